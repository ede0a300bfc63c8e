//! The engine metrics parser (vLLM / SGLang Prometheus text) and what routing
//! makes of a scrape: never a panic, whatever the worker's `/metrics` says.
#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard::pool::stats::{parse_metrics, WorkerStats};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let s = parse_metrics(&text);
    if s.is_useful() {
        let w = WorkerStats::default();
        w.store(&s, 1_000);
        let _ = w.load(3, 2_000, 5_000);
        let _ = (w.kv_capacity_tokens(), w.kv_capacity_bytes(2.0));
    }
});
