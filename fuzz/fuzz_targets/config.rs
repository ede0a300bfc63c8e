//! The config loader: TOML text to a validated config, never a panic. Listen
//! addresses that are not IP addresses are replaced first: validation resolves
//! names, and the fuzzer must not send DNS queries.
#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard::config::{self, Secrets};

fn pin(listen: &mut Option<String>) {
    if listen
        .as_deref()
        .is_some_and(|l| l.parse::<std::net::SocketAddr>().is_err())
    {
        *listen = Some("127.0.0.1:0".into());
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut parsed = config::read(text);
    pin(&mut parsed.raw.server.listen);
    pin(&mut parsed.raw.admin.listen);
    if let Ok(checked) = parsed.validate(Secrets::Optional) {
        // A valid config is usable as it stands.
        let _ = checked.config.server.serving_threads();
    }
});
