//! Cost attribution: pick the most specific row of the price table for a request
//! (model, pool, worker tier) and price its tokens. Pure functions; the measured
//! throughput for GPU-hour prices is passed in.

use crate::config::observability::{PriceConfig, PriceRate};

/// Tokens of one request, as reported in `usage` (or counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenCounts {
    pub prompt: u64,
    pub cached: u64,
    pub output: u64,
}

impl TokenCounts {
    /// Tokens the worker had to process: uncached prompt plus output.
    pub fn processed(&self) -> u64 {
        self.prompt.saturating_sub(self.cached) + self.output
    }
}

/// The price row for a request: the matching row with the most matchers set, the
/// first of those on a tie; `None` when no row matches (cost 0).
pub fn find_price<'a>(
    prices: &'a [PriceConfig],
    model: &str,
    pool: &str,
    tier: Option<&str>,
) -> Option<&'a PriceConfig> {
    let mut best: Option<(&PriceConfig, u8)> = None;
    for p in prices {
        if let Some(s) = p.specificity(model, pool, tier) {
            if best.is_none_or(|(_, b)| s > b) {
                best = Some((p, s));
            }
        }
    }
    best.map(|(p, _)| p)
}

/// The most `t` may cost for `model` on `pool` on any worker: the dearest row
/// that may apply (tier unknown before routing), GPU-hour prices at their
/// throughput floor. 0 when no row matches.
pub fn worst_usd(prices: &[PriceConfig], model: &str, pool: &str, t: TokenCounts) -> f64 {
    prices
        .iter()
        .filter(|p| p.model.as_deref().is_none_or(|m| m == model))
        .filter(|p| p.pool.as_deref().is_none_or(|q| q == pool))
        .map(|p| cost_usd(&p.rate, t, 0.0))
        .fold(0.0, f64::max)
}

/// USD for `t` at `rate`. `throughput_tps` is the worker's measured token
/// throughput (processed tokens per second), used by GPU-hour prices.
pub fn cost_usd(rate: &PriceRate, t: TokenCounts, throughput_tps: f64) -> f64 {
    match *rate {
        PriceRate::Tokens {
            prompt,
            cached_prompt,
            output,
        } => {
            let cached = t.cached.min(t.prompt);
            ((t.prompt - cached) as f64 * prompt
                + cached as f64 * cached_prompt
                + t.output as f64 * output)
                / 1e6
        }
        PriceRate::GpuHour {
            usd,
            throughput_floor_tps,
        } => {
            let tps = if throughput_tps.is_finite() {
                throughput_tps.max(throughput_floor_tps)
            } else {
                throughput_floor_tps
            };
            usd / 3600.0 * t.processed() as f64 / tps
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(model: Option<&str>, pool: Option<&str>, tier: Option<&str>, p: f64) -> PriceConfig {
        PriceConfig {
            model: model.map(Into::into),
            pool: pool.map(Into::into),
            tier: tier.map(Into::into),
            rate: PriceRate::Tokens {
                prompt: p,
                cached_prompt: p / 10.0,
                output: p * 4.0,
            },
        }
    }

    #[test]
    fn the_worst_cost_is_the_dearest_row_that_may_apply() {
        let table = vec![
            row(None, None, None, 1.0),
            row(Some("m"), None, Some("h100"), 3.0),
            row(Some("other"), None, None, 9.0),
        ];
        let t = TokenCounts {
            prompt: 1_000_000,
            cached: 0,
            output: 0,
        };
        assert_eq!(worst_usd(&table, "m", "p", t), 3.0);
        assert_eq!(worst_usd(&table, "x", "p", t), 1.0);
        assert_eq!(worst_usd(&[], "m", "p", t), 0.0);
    }

    #[test]
    fn the_most_specific_matching_row_wins() {
        let table = vec![
            row(None, None, None, 1.0),
            row(Some("m"), None, None, 2.0),
            row(Some("m"), Some("p"), Some("h100"), 3.0),
            row(None, Some("p"), None, 4.0),
        ];
        let f = |m, p, t| match find_price(&table, m, p, t).unwrap().rate {
            PriceRate::Tokens { prompt, .. } => prompt,
            _ => unreachable!(),
        };
        assert_eq!(f("x", "q", None), 1.0);
        assert_eq!(f("m", "q", None), 2.0);
        assert_eq!(f("m", "p", Some("h100")), 3.0);
        // model and pool each set one matcher: the first such row wins.
        assert_eq!(f("m", "p", Some("a10")), 2.0);
        assert_eq!(f("x", "p", None), 4.0);
        assert!(find_price(&table[1..2], "x", "p", None).is_none());
    }

    #[test]
    fn token_prices_split_cached_and_uncached_prompt() {
        let rate = PriceRate::Tokens {
            prompt: 1.0,
            cached_prompt: 0.1,
            output: 4.0,
        };
        let t = TokenCounts {
            prompt: 1_000,
            cached: 600,
            output: 250,
        };
        // 400 × 1.0 + 600 × 0.1 + 250 × 4.0 = 1460 per 1M.
        assert!((cost_usd(&rate, t, 0.0) - 1460.0 / 1e6).abs() < 1e-12);
    }

    #[test]
    fn gpu_hour_prices_amortise_over_measured_throughput() {
        let rate = PriceRate::GpuHour {
            usd: 3.6,
            throughput_floor_tps: 10.0,
        };
        let t = TokenCounts {
            prompt: 100,
            cached: 50,
            output: 50,
        };
        // $0.001/s at 100 tok/s → 100 processed tokens cost $0.001.
        assert!((cost_usd(&rate, t, 100.0) - 0.001).abs() < 1e-12);
        // Below the floor the floor applies: 10 tok/s → $0.01.
        assert!((cost_usd(&rate, t, 1.0) - 0.01).abs() < 1e-12);
    }
}
