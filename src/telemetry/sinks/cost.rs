//! Cost so far by (model, region, tenant), priced by the price table. Rendered as
//! a float counter, which `metrics` (integer counters) cannot hold.

use super::super::local::escape;
use super::super::{cost, names, FastMap};
use metrics::SharedString;
use std::sync::atomic::{AtomicU64, Ordering};

type CostKey = (SharedString, SharedString, SharedString);

#[derive(Default)]
pub struct CostTotals {
    /// Nano-USD by (model, region, tenant).
    totals: FastMap<CostKey, AtomicU64>,
}

impl CostTotals {
    /// Add `usd` for (model, region, tenant); returns it in nano-USD.
    pub fn add(
        &self,
        model: &SharedString,
        region: &SharedString,
        tenant: &SharedString,
        usd: f64,
    ) -> u64 {
        let nano = (usd * 1e9).round() as u64;
        if nano == 0 {
            return 0;
        }
        let key = (model.clone(), region.clone(), tenant.clone());
        match self.totals.get(&key) {
            Some(c) => c.fetch_add(nano, Ordering::Relaxed),
            None => self
                .totals
                .entry(key)
                .or_default()
                .fetch_add(nano, Ordering::Relaxed),
        };
        nano
    }

    /// Cost so far by (model, region, tenant), in USD, sorted.
    pub fn totals(&self) -> Vec<(SharedString, SharedString, SharedString, f64)> {
        let mut v: Vec<_> = self
            .totals
            .iter()
            .map(|e| {
                let (m, r, t) = e.key().clone();
                (m, r, t, e.value().load(Ordering::Relaxed) as f64 / 1e9)
            })
            .collect();
        v.sort_by(|a, b| (&*a.0, &*a.1, &*a.2).cmp(&(&*b.0, &*b.1, &*b.2)));
        v
    }

    /// Append the cost counter family to `out`.
    pub fn render_into(&self, out: &mut String) {
        use std::fmt::Write;
        let name = names::COST_USD_TOTAL;
        let _ = writeln!(
            out,
            "# HELP {name} Cost attributed to requests by the price table (USD), by model, region and tenant.\n# TYPE {name} counter"
        );
        for (m, r, t, usd) in self.totals() {
            let _ = writeln!(
                out,
                "{name}{{{}=\"{}\",{}=\"{}\",{}=\"{}\"}} {usd}",
                names::L_MODEL,
                escape(&m),
                names::L_REGION,
                escape(&r),
                names::L_TENANT,
                escape(&t)
            );
        }
    }
}

/// The price of one answered request, USD.
pub fn price(
    prices: &[crate::config::observability::PriceConfig],
    model: &str,
    pool: &str,
    tier: Option<&str>,
    tokens: cost::TokenCounts,
    tokens_per_s: impl FnOnce() -> f64,
) -> f64 {
    // The worker's throughput is read only for a per-GPU-hour price.
    cost::find_price(prices, model, pool, tier).map_or(0.0, |p| {
        let tps = match p.rate {
            crate::config::observability::PriceRate::GpuHour { .. } => tokens_per_s(),
            _ => 0.0,
        };
        cost::cost_usd(&p.rate, tokens, tps)
    })
}
