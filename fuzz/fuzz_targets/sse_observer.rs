//! The response observer's scanning: an SSE body cut into chunks at fuzzed
//! points yields the same lines as the whole body (while no line is longer
//! than the carry limit), and every line and body is read without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard::proxy::observe::fuzzing::{body_usage, sse_line, sse_lines, MAX_LINE_CARRY};

fuzz_target!(|data: &[u8]| {
    let Some((&cuts, body)) = data.split_first() else {
        return;
    };
    // Cut points from the body's own bytes, so the fuzzer steers them.
    let mut chunks = Vec::new();
    let mut rest = body;
    for i in 0..usize::from(cuts % 16) {
        if rest.is_empty() {
            break;
        }
        let at = usize::from(rest[i % rest.len()]) % (rest.len() + 1);
        let (a, b) = rest.split_at(at);
        chunks.push(a);
        rest = b;
    }
    chunks.push(rest);
    let whole = sse_lines(&[body]);
    let cut = sse_lines(&chunks);
    if whole.iter().all(|l| l.len() < MAX_LINE_CARRY) {
        assert_eq!(whole, cut);
    }
    for line in &cut {
        let _ = sse_line(line);
    }
    let _ = body_usage(&chunks);
});
