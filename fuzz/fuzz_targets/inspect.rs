//! Request inspection: any body, any nesting limit. Never panics; a body within
//! the nesting limit that inspects fine slices its routing text out of itself.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use switchyard::api::inspect::{check_depth, inspect};

fuzz_target!(|data: &[u8]| {
    let Some((&limit, body)) = data.split_first() else {
        return;
    };
    let _ = check_depth(body, usize::from(limit) + 1);
    let body = Bytes::copy_from_slice(body);
    if let Ok(info) = inspect(&body) {
        if let Some(text) = info.routing_text {
            let start = text.as_ptr() as usize - body.as_ptr() as usize;
            assert!(start + text.len() <= body.len());
        }
    }
});
