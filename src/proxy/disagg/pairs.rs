//! Latency objectives in a disaggregated pool, over (prefill, decode) pairs.
//!
//! A pair's predicted TTFT is the prefill worker's (the prompt it must prefill)
//! plus the decode worker's (nothing to prefill: the KV arrives) for vLLM's
//! sequential hand-off, and the larger of the two for SGLang's concurrent one,
//! where the decode worker's model learns a TTFT that already includes waiting
//! for its prefill. The pair's TPOT is the decode worker's. Each worker's model
//! learns from its own leg: a prefill worker from its leg's answer time, a
//! decode worker from its first token after the hand-off.

use super::super::forward::ForwardContext;
use super::super::slo::{settle, Verdict};
use super::super::GatewayError;
use crate::config::DisaggMode;
use crate::pool::predict::Prediction;
use crate::pool::RequestSize;

/// A prefill and a decode worker (indexes in the route).
pub(super) type Pair = (usize, usize);

/// Phase: select, in a disaggregated pool (first attempt only). The policy's
/// pair when it is predicted to meet the request's objectives, else the
/// eligible pair with the most headroom; when no pair can, the pool sheds the
/// request (`Err`) or serves the policy's pair marked downgraded.
pub(super) fn choose(
    ctx: &ForwardContext<'_>,
    mode: DisaggMode,
    picked: Pair,
    can_prefill: &dyn Fn(usize) -> bool,
    can_decode: &dyn Fn(usize) -> bool,
) -> Result<Pair, GatewayError> {
    if !ctx.info.slo.is_set() {
        return Ok(picked);
    }
    let n = ctx.route.workers.len();
    let prefills: Vec<usize> = (0..n).filter(|&i| can_prefill(i)).collect();
    let decodes: Vec<usize> = (0..n).filter(|&i| can_decode(i)).collect();
    let (verdict, best) = assess(ctx, mode, picked, &prefills, &decodes);
    settle(ctx, verdict)?;
    Ok(if verdict == Verdict::Met {
        best
    } else {
        picked
    })
}

/// The verdict over every pair, and the pair to take if it is `Met`. The
/// prefill leg is predicted, as it is learnt, for the whole prompt.
fn assess(
    ctx: &ForwardContext<'_>,
    mode: DisaggMode,
    picked: Pair,
    prefills: &[usize],
    decodes: &[usize],
) -> (Verdict, Pair) {
    let ws = &ctx.route.workers;
    let slo = &ctx.info.slo;
    let elapsed_ms = ctx.start.elapsed().as_secs_f64() * 1e3;
    let decode_size = RequestSize {
        prefill_tokens: 0,
        ..ctx.size(0)
    };
    let pre = |p: usize| ws[p].predict(ctx.size(0));
    let dec = |d: usize| ws[d].predict(decode_size);
    let pairs = std::iter::once(picked).chain(
        prefills
            .iter()
            .flat_map(|&p| decodes.iter().map(move |&d| (p, d)))
            .filter(|&pair| pair != picked),
    );
    // The most headroom, and the shortest predicted TTFT for a miss.
    let mut most: Option<(f64, Pair)> = None;
    let mut fastest: Option<(f64, f64)> = None;
    for (p, d) in pairs {
        let (Some(pp), Some(pd)) = (pre(p), dec(d)) else {
            return (Verdict::Unknown, picked); // a worker has no model yet
        };
        let pred = combine(mode, pp, pd);
        let Some(h) = pred.headroom(slo, elapsed_ms) else {
            return (Verdict::Unknown, picked); // a TPOT objective, no TPOT learnt yet
        };
        if (p, d) == picked && h >= 0.0 {
            return (Verdict::Met, picked);
        }
        if most.is_none_or(|(m, _)| h > m) {
            most = Some((h, (p, d)));
        }
        let ttft = elapsed_ms + pred.ttft_ms;
        if fastest.is_none_or(|(f, _)| ttft < f) {
            let over = slo.ttft_ms.map_or(0.0, |t| ttft - f64::from(t));
            fastest = Some((ttft, over));
        }
    }
    match (most, fastest) {
        (Some((h, pair)), _) if h >= 0.0 => (Verdict::Met, pair),
        (_, Some((ttft_ms, over_ms))) => (Verdict::Missed { ttft_ms, over_ms }, picked),
        _ => (Verdict::Unknown, picked),
    }
}

/// A pair's prediction from its workers' (see the module's note).
fn combine(mode: DisaggMode, prefill: Prediction, decode: Prediction) -> Prediction {
    let ttft_ms = match mode {
        DisaggMode::Vllm => prefill.ttft_ms + decode.ttft_ms,
        DisaggMode::Sglang => prefill.ttft_ms.max(decode.ttft_ms),
    };
    Prediction {
        ttft_ms,
        tpot_ms: decode.tpot_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(ttft_ms: f64, tpot: Option<f64>) -> Prediction {
        Prediction {
            ttft_ms,
            tpot_ms: tpot,
        }
    }

    #[test]
    fn a_pair_adds_sequential_legs_and_overlaps_concurrent_ones() {
        let (pre, dec) = (p(300.0, Some(99.0)), p(40.0, Some(12.0)));
        assert_eq!(combine(DisaggMode::Vllm, pre, dec), p(340.0, Some(12.0)));
        assert_eq!(combine(DisaggMode::Sglang, pre, dec), p(300.0, Some(12.0)));
        assert_eq!(combine(DisaggMode::Vllm, pre, p(40.0, None)).tpot_ms, None);
    }
}
