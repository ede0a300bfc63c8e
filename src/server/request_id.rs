//! Request ids: the client's `x-request-id` when it is sane, else a fresh one
//! (a per-process random prefix plus a counter: unique, and no syscall per request).

use crate::api::headers::{Name, Own};
use crate::telemetry::trace::hex_into;
use http::{HeaderMap, HeaderValue};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

pub use crate::proxy::REQUEST_ID_HEADER as HEADER;
const MAX_LEN: usize = 128;

static PREFIX: LazyLock<u32> = LazyLock::new(rand::random);
static NEXT: AtomicU64 = AtomicU64::new(1);

pub fn get_or_make(headers: &HeaderMap) -> HeaderValue {
    sane(headers.get(HEADER)).unwrap_or_else(make)
}

/// [`get_or_make`] for a request whose headers [`Own::scan`] noted: no lookup
/// when it sent no id.
pub fn get_or_make_noted(headers: &HeaderMap, own: Own) -> HeaderValue {
    sane(own.get(headers, Name::RequestId)).unwrap_or_else(make)
}

/// The client's id, if it is one to keep.
fn sane(v: Option<&HeaderValue>) -> Option<HeaderValue> {
    let v = v?;
    let ok =
        !v.is_empty() && v.len() <= MAX_LEN && v.as_bytes().iter().all(|b| b.is_ascii_graphic());
    ok.then(|| v.clone())
}

fn make() -> HeaderValue {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // `sy-{prefix:08x}-{n:012x}`, written by hand: this runs for every request and
    // `format!` costs more than the rest of the id.
    let mut buf = *b"sy-00000000-000000000000";
    hex_into(&mut buf[3..11], u128::from(*PREFIX));
    hex_into(&mut buf[12..24], u128::from(n));
    HeaderValue::from_bytes(&buf).expect("hex is a valid header")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_ids_are_prefix_and_counter_in_hex() {
        let id = get_or_make(&HeaderMap::new());
        let s = id.to_str().unwrap();
        assert_eq!(s.len(), 24, "{s}");
        assert_eq!(&s[3..11], format!("{:08x}", *PREFIX));
        let n = u64::from_str_radix(&s[12..], 16).unwrap();
        let next = get_or_make(&HeaderMap::new());
        let m = u64::from_str_radix(&next.to_str().unwrap()[12..], 16).unwrap();
        assert!(m > n, "{s} then {next:?}");
    }

    #[test]
    fn propagates_sane_ids_and_replaces_bad_ones() {
        let mut h = HeaderMap::new();
        h.insert(HEADER, "abc-123".parse().unwrap());
        assert_eq!(get_or_make(&h), "abc-123");
        h.insert(HEADER, "x".repeat(200).parse().unwrap());
        let made = get_or_make(&h);
        assert!(made.to_str().unwrap().starts_with("sy-"));
        // The same through the scanned headers.
        let own = Own::scan(&h).unwrap();
        assert!(get_or_make_noted(&h, own)
            .to_str()
            .unwrap()
            .starts_with("sy-"));
        h.insert(HEADER, "abc-123".parse().unwrap());
        let own = Own::scan(&h).unwrap();
        assert_eq!(get_or_make_noted(&h, own), "abc-123");
        assert!(
            get_or_make_noted(&HeaderMap::new(), Own::scan(&HeaderMap::new()).unwrap())
                .to_str()
                .unwrap()
                .starts_with("sy-")
        );
        assert_ne!(
            get_or_make(&HeaderMap::new()),
            get_or_make(&HeaderMap::new())
        );
    }
}
