//! GPU availability from an NVIDIA DCGM exporter, scraped next to the engine's
//! `/metrics` for workers labelled `dcgm_url` (the exporter's metrics URL):
//! utilisation, frame-buffer memory and clock-throttle reasons, summed or
//! averaged over the worker's GPUs. The poller stores them in [`GpuStats`]
//! (atomics on the worker); the per-worker gauges, the dashboard and saturation
//! rules read [`GpuStats::get`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Worker label naming the DCGM exporter's metrics URL.
pub const DCGM_LABEL: &str = "dcgm_url";
/// Throttle reasons that mean the GPU is slowed by something other than idling
/// or the application's own clock setting: SW power cap (0x4), HW slowdown (0x8),
/// sync boost (0x10), SW thermal (0x20), HW thermal (0x40), HW power brake (0x80).
pub const SLOWDOWN_REASONS: u64 = 0xfc;

/// What one exporter scrape found, over every GPU it lists.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuScrape {
    /// Mean utilisation, percent.
    pub util_pct: Option<f64>,
    /// Frame buffer used and free, MiB, summed over the GPUs.
    pub fb_used_mib: Option<f64>,
    pub fb_free_mib: Option<f64>,
    /// Clock-throttle reasons, OR-ed over the GPUs (DCGM's bitmask).
    pub throttle_reasons: Option<u64>,
}

/// Scan a DCGM exporter's Prometheus text for the fields above (per-GPU series
/// are told apart by their labels, which are otherwise ignored). Never panics.
pub fn parse_dcgm(text: &str) -> GpuScrape {
    let mut s = GpuScrape::default();
    let (mut util_sum, mut util_n) = (0.0, 0u32);
    for line in text.lines().map(str::trim_start) {
        if line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let Some(value) = line
            .rsplit(|c: char| c.is_ascii_whitespace())
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
        else {
            continue;
        };
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        match &line[..name_end] {
            "DCGM_FI_DEV_GPU_UTIL" => {
                util_sum += value.min(100.0);
                util_n += 1;
            }
            "DCGM_FI_DEV_FB_USED" => add(&mut s.fb_used_mib),
            "DCGM_FI_DEV_FB_FREE" => add(&mut s.fb_free_mib),
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS" | "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" => {
                s.throttle_reasons = Some(s.throttle_reasons.unwrap_or(0) | value as u64);
            }
            _ => {}
        }
    }
    s.util_pct = (util_n > 0).then(|| util_sum / f64::from(util_n));
    s
}

/// A worker's GPU stats as last scraped (atomics; written by the poller).
#[derive(Debug, Default)]
pub struct GpuStats {
    /// Utilisation × 1000 (percent), fixed point.
    util_milli: AtomicU32,
    fb_used_mib: AtomicU64,
    fb_free_mib: AtomicU64,
    throttle_reasons: AtomicU64,
    /// `now_ms` of the last successful scrape; 0: never.
    last_ms: AtomicU64,
}

/// A worker's GPUs at one instant.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Gpu {
    pub util_ratio: f64,
    pub fb_used_bytes: u64,
    pub fb_free_bytes: u64,
    pub throttle_reasons: u64,
    /// Some reason in [`SLOWDOWN_REASONS`] is set.
    pub throttled: bool,
    pub age_ms: u64,
}

const MIB: u64 = 1 << 20;

impl GpuStats {
    /// Store a scrape taken at `now` (fields the exporter left out keep 0).
    pub fn store(&self, s: &GpuScrape, now: u64) {
        let n = |v: Option<f64>| v.map_or(0, |v| v.round() as u64);
        self.util_milli.store(
            (s.util_pct.unwrap_or(0.0) * 1000.0).round() as u32,
            Ordering::Relaxed,
        );
        self.fb_used_mib.store(n(s.fb_used_mib), Ordering::Relaxed);
        self.fb_free_mib.store(n(s.fb_free_mib), Ordering::Relaxed);
        self.throttle_reasons
            .store(s.throttle_reasons.unwrap_or(0), Ordering::Relaxed);
        self.last_ms.store(now.max(1), Ordering::Relaxed);
    }

    /// The last scrape, seen at `now`; `None` if the worker's exporter never answered.
    pub fn get(&self, now: u64) -> Option<Gpu> {
        let last = self.last_ms.load(Ordering::Relaxed);
        if last == 0 {
            return None;
        }
        let reasons = self.throttle_reasons.load(Ordering::Relaxed);
        Some(Gpu {
            util_ratio: f64::from(self.util_milli.load(Ordering::Relaxed)) / 100_000.0,
            fb_used_bytes: self.fb_used_mib.load(Ordering::Relaxed).saturating_mul(MIB),
            fb_free_bytes: self.fb_free_mib.load(Ordering::Relaxed).saturating_mul(MIB),
            throttle_reasons: reasons,
            throttled: reasons & SLOWDOWN_REASONS != 0,
            age_ms: now.saturating_sub(last),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Two GPUs as dcgm-exporter 3.x prints them.
    pub const TWO_GPUS: &str = r#"# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 90
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 70
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a"} 70000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b"} 1000
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a"} 11000
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-b"} 80000
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0",UUID="GPU-a"} 1
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="1",UUID="GPU-b"} 64
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-a"} 1980
"#;

    #[test]
    fn gpus_are_averaged_summed_and_ored() {
        let s = parse_dcgm(TWO_GPUS);
        assert_eq!(s.util_pct, Some(80.0));
        assert_eq!(
            (s.fb_used_mib, s.fb_free_mib),
            (Some(71000.0), Some(91000.0))
        );
        assert_eq!(s.throttle_reasons, Some(65));
        let g = GpuStats::default();
        assert_eq!(g.get(5), None);
        g.store(&s, 1_000);
        let v = g.get(1_500).unwrap();
        assert!((v.util_ratio - 0.8).abs() < 1e-9);
        assert_eq!(v.fb_used_bytes, 71000 * MIB);
        assert!(v.throttled, "HW thermal (64) is a slowdown");
        assert_eq!(v.age_ms, 500);
        g.store(&parse_dcgm("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS 1\n"), 2_000);
        assert!(!g.get(2_000).unwrap().throttled, "GPU idle (1) is not");
    }

    proptest! {
        #[test]
        fn never_panics(text in ".{0,400}") {
            let s = parse_dcgm(&text);
            GpuStats::default().store(&s, 1);
        }
    }
}
