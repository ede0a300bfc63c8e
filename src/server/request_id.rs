//! Request ids: the client's `x-request-id` when it is sane, else a fresh one
//! (a per-process random prefix plus a counter: unique, and no syscall per request).

use http::{HeaderMap, HeaderValue};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

pub const HEADER: &str = "x-request-id";
const MAX_LEN: usize = 128;

static PREFIX: LazyLock<u32> = LazyLock::new(rand::random);
static NEXT: AtomicU64 = AtomicU64::new(1);

pub fn get_or_make(headers: &HeaderMap) -> HeaderValue {
    if let Some(v) = headers.get(HEADER) {
        let ok = !v.is_empty()
            && v.len() <= MAX_LEN
            && v.as_bytes().iter().all(|b| b.is_ascii_graphic());
        if ok {
            return v.clone();
        }
    }
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    HeaderValue::from_str(&format!("sy-{:08x}-{n:012x}", *PREFIX)).expect("hex is a valid header")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn propagates_sane_ids_and_replaces_bad_ones() {
        let mut h = HeaderMap::new();
        h.insert(HEADER, "abc-123".parse().unwrap());
        assert_eq!(get_or_make(&h), "abc-123");
        h.insert(HEADER, "x".repeat(200).parse().unwrap());
        let made = get_or_make(&h);
        assert!(made.to_str().unwrap().starts_with("sy-"));
        assert_ne!(
            get_or_make(&HeaderMap::new()),
            get_or_make(&HeaderMap::new())
        );
    }
}
