//! The gateway process's own CPU time and resident memory, read from `/proc` at
//! scrape time (Linux; elsewhere the gauges are not set).

use super::names;
use metrics::gauge;

/// Clock ticks per second of `/proc/self/stat` times (USER_HZ, 100 on Linux).
const USER_HZ: f64 = 100.0;

/// (cpu seconds, resident bytes), when `/proc` is readable.
pub fn sample() -> (Option<f64>, Option<u64>) {
    let cpu = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| parse_cpu(&s));
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_rss(&s));
    (cpu, rss)
}

/// utime + stime (fields 14 and 15) of `/proc/self/stat`, in seconds.
fn parse_cpu(stat: &str) -> Option<f64> {
    // The command name (field 2) may contain spaces; fields resume after its `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_ascii_whitespace().collect();
    // `rest` starts at field 3 (state), so field n is f[n - 3].
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

fn parse_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_ascii_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Set the memory gauge; returns the CPU seconds for [`render_into`].
pub fn refresh() -> Option<f64> {
    let (cpu, rss) = sample();
    if let Some(r) = rss {
        gauge!(names::PROCESS_RESIDENT_MEMORY_BYTES).set(r as f64);
    }
    cpu
}

/// Append the CPU counter (a float, so rendered here rather than through
/// `metrics`, whose counters are integers).
pub fn render_into(out: &mut String, cpu: Option<f64>) {
    use std::fmt::Write;
    if let Some(c) = cpu {
        let n = names::PROCESS_CPU_SECONDS_TOTAL;
        let _ = writeln!(
            out,
            "# HELP {n} CPU time (user + system) used by the gateway process.\n# TYPE {n} counter\n{n} {c}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        let stat = "1234 (my (odd) name) S 1 2 3 4 5 6 7 8 9 10 250 150 0 0 20 0 4 0";
        assert_eq!(parse_cpu(stat), Some(4.0));
        assert_eq!(
            parse_rss("Name:\tx\nVmRSS:\t   2048 kB\nVmData: 1 kB\n"),
            Some(2 * 1024 * 1024)
        );
        let (cpu, rss) = sample();
        if cfg!(target_os = "linux") {
            assert!(cpu.is_some() && rss.unwrap() > 0);
        }
    }
}
