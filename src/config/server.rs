//! `[server]`: the client listener, its limits and timeouts, and the upstream
//! timeouts (`[server.timeouts]`), with their defaults.

use super::key::Key;
use super::problems::Problems;
use super::{edge, ms, CorsConfig, RawServer, RawTimeouts, Secret, TlsConfig};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// Default listen address for the OpenAI-compatible listener.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default deepest JSON nesting of a request body (serde_json itself stops at 128).
pub const DEFAULT_MAX_JSON_DEPTH: usize = 64;
/// Most `server.max_json_depth` may allow: serde_json's own recursion limit.
pub const MAX_MAX_JSON_DEPTH: usize = 127;
/// Default limit on a request body (bytes).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Default upstream connect timeout (ms).
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default limit for the upstream's response headers to arrive (ms).
pub const DEFAULT_FIRST_BYTE_TIMEOUT_MS: u64 = 60_000;
/// Default limit on the gap between two body chunks of a response (ms).
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default limit on a whole request, streaming included (ms).
pub const DEFAULT_TOTAL_TIMEOUT_MS: u64 = 600_000;
/// Default interval between re-reads of each worker's `/v1/models` for discovered pools (ms).
pub const DEFAULT_MODEL_DISCOVERY_MS: u64 = 5_000;
/// Most request headers `server.max_headers` may allow.
const MAX_MAX_HEADERS: usize = 1_000;
/// Bounds of `server.max_header_bytes`.
const MIN_MAX_HEADER_BYTES: usize = 1_024;
const MAX_MAX_HEADER_BYTES: usize = 1024 * 1024;
/// File descriptors kept for everything but client connections (listeners, the
/// stats poller, health checks, logs) when sizing `max_connections`.
const RESERVED_FDS: u64 = 256;
/// Default time a client has to send its request headers (ms).
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default time to receive a whole request body once its headers are in (ms).
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// Default time a connection may stay open with no request starting (ms).
pub const DEFAULT_CLIENT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default limit on the number of request headers.
pub const DEFAULT_MAX_HEADERS: usize = 100;
/// Default limit on the size of a request's header section (bytes).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// Longest busy-poll window a serving thread may be given (µs).
pub const MAX_BUSY_POLL_US: u64 = 10_000;
/// Default time in-flight requests get to finish after SIGTERM (ms).
pub const DEFAULT_DRAIN_TIMEOUT_MS: u64 = 30_000;

/// The default cap on open client connections, from the open-file limit: each
/// client connection may hold an upstream connection too, so half of what is
/// left after a reserve. `main` raises the limit to its hard value first.
pub fn default_max_connections() -> usize {
    let soft = rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft);
    connections_for_fd_limit(soft)
}

fn connections_for_fd_limit(soft: u64) -> usize {
    let usable = soft.saturating_sub(RESERVED_FDS) / 2;
    usable.clamp(64, 1_000_000) as usize
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub timeouts: Timeouts,
    /// Add `x-switchyard-route` / `x-switchyard-worker` headers to responses.
    pub debug_headers: bool,
    /// Interval between `/v1/models` reads for pools whose models are discovered.
    pub model_discovery_interval: Duration,
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_headers: usize,
    pub max_header_bytes: usize,
    pub drain_timeout: Duration,
    pub unready_grace: Duration,
    pub watch_config: bool,
    /// Serving threads for `switchyard serve` (thread-per-core); 0 means one per CPU.
    pub threads: usize,
    /// How long a serving thread keeps polling its sockets after request
    /// activity before it parks (`server::busy_poll`); zero: it parks at once.
    pub busy_poll: Duration,
    /// Deepest JSON nesting accepted in a request body; deeper is answered 400.
    pub max_json_depth: usize,
    /// TLS on the client listener.
    pub tls: Option<TlsConfig>,
    /// Browser origins allowed to call the API; `None`: no CORS headers at all.
    pub cors: Option<CorsConfig>,
    /// The key that signs the Responses ids the gateway issues (read from
    /// `id_key_env`); `None`: a random key per process.
    pub id_key: Option<Secret>,
    /// Workers may be link-local (169.254/16, fe80::/10) or cloud metadata addresses.
    pub allow_link_local_workers: bool,
    /// Peers whose `x-forwarded-for` is believed: the client is the first
    /// untrusted hop from the right (empty: always the socket peer).
    pub trusted_proxies: Vec<edge::Cidr>,
}

impl ServerConfig {
    /// The number of serving threads to start: `threads`, or one per available CPU.
    pub fn serving_threads(&self) -> usize {
        if self.threads > 0 {
            self.threads
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        }
    }
}

/// Upstream timeouts.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub connect: Duration,
    pub first_byte: Duration,
    pub idle: Duration,
    pub total: Duration,
}

/// The address of a listener (`key`): `IP:port`, or `name:port` with a name
/// that resolves (its first address is used).
pub(super) fn listen_addr(key: &str, value: &str, p: &mut Problems) -> Option<SocketAddr> {
    if let Ok(a) = value.parse() {
        return Some(a);
    }
    let why = match value.to_socket_addrs() {
        Ok(mut addrs) => match addrs.next() {
            Some(a) => return Some(a),
            None => "the name has no address".to_string(),
        },
        Err(e) => e.to_string(),
    };
    p.push(format!(
        "{key}: `{value}` is not a listen address ({why}); expected host:port with an IP address or a resolvable name, e.g. 127.0.0.1:8080, 0.0.0.0:8080 (every interface) or localhost:8080"
    ));
    None
}

/// `[server]` (its `region` is taken out first: it belongs to the global sections).
pub(super) fn validate_server(s: RawServer, p: &mut Problems) -> ServerConfig {
    let key = Key::new("server");
    let listen = s.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
    let listen = listen_addr(&key.field("listen"), listen, p).unwrap_or_else(|| {
        DEFAULT_LISTEN
            .parse()
            .expect("default listen address parses")
    });
    let max_body_bytes = s.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    if max_body_bytes == 0 {
        p.push(format!(
            "{}: must be greater than 0",
            key.field("max_body_bytes")
        ));
    }
    let timeouts = validate_timeouts(&s.timeouts, &key.field("timeouts"), p);
    let [model_discovery_interval, header_read_timeout, drain_timeout, body_read_timeout, idle_timeout] =
        server_timeouts(&s, &key, p);
    let max_headers = s.max_headers.unwrap_or(DEFAULT_MAX_HEADERS);
    between(
        p,
        &key.field("max_headers"),
        max_headers,
        1..=MAX_MAX_HEADERS,
    );
    let max_header_bytes = s.max_header_bytes.unwrap_or(DEFAULT_MAX_HEADER_BYTES);
    let header_bytes = MIN_MAX_HEADER_BYTES..=MAX_MAX_HEADER_BYTES;
    between(
        p,
        &key.field("max_header_bytes"),
        max_header_bytes,
        header_bytes,
    );
    let max_connections = s.max_connections.unwrap_or_else(default_max_connections);
    if max_connections == 0 {
        p.push(format!(
            "{}: must be greater than 0",
            key.field("max_connections")
        ));
    }
    let threads = s.threads.unwrap_or(0);
    if threads > 1024 {
        let threads = key.field("threads");
        p.push(format!("{threads}: must be at most 1024 (0 = one per CPU)"));
    }
    let max_json_depth = s.max_json_depth.unwrap_or(DEFAULT_MAX_JSON_DEPTH);
    between(
        p,
        &key.field("max_json_depth"),
        max_json_depth,
        1..=MAX_MAX_JSON_DEPTH,
    );
    let tls = s
        .tls
        .and_then(|t| edge::validate_tls(t, &key.field("tls"), false, p));
    let cors = s
        .cors
        .and_then(|c| edge::validate_cors(c, &key.field("cors"), p));
    let trusted_proxies =
        edge::validate_trusted_proxies(s.trusted_proxies, &key.field("trusted_proxies"), p);
    let busy_poll_us = s.busy_poll_us.unwrap_or(0);
    if busy_poll_us > MAX_BUSY_POLL_US {
        let busy = key.field("busy_poll_us");
        p.push(format!(
            "{busy}: must be at most {MAX_BUSY_POLL_US} (0 = off)"
        ));
    }
    ServerConfig {
        listen,
        max_body_bytes,
        timeouts,
        debug_headers: s.debug_headers.unwrap_or(false),
        model_discovery_interval,
        max_connections,
        header_read_timeout,
        body_read_timeout,
        idle_timeout,
        max_headers,
        max_header_bytes,
        drain_timeout,
        unready_grace: Duration::from_millis(s.unready_grace_ms.unwrap_or(0)),
        watch_config: s.watch_config.unwrap_or(false),
        threads,
        busy_poll: Duration::from_micros(busy_poll_us),
        max_json_depth,
        tls,
        cors,
        id_key: None,
        allow_link_local_workers: s.allow_link_local_workers.unwrap_or(false),
        trusted_proxies,
    }
}

/// `[server]`'s own timeouts: model discovery, header read, drain, body read
/// and idle, in that order (the order of their problems).
fn server_timeouts(s: &RawServer, key: &Key, p: &mut Problems) -> [Duration; 5] {
    [
        (
            "model_discovery_ms",
            s.model_discovery_ms,
            DEFAULT_MODEL_DISCOVERY_MS,
        ),
        (
            "header_read_timeout_ms",
            s.header_read_timeout_ms,
            DEFAULT_HEADER_READ_TIMEOUT_MS,
        ),
        (
            "drain_timeout_ms",
            s.drain_timeout_ms,
            DEFAULT_DRAIN_TIMEOUT_MS,
        ),
        (
            "body_read_timeout_ms",
            s.body_read_timeout_ms,
            DEFAULT_BODY_READ_TIMEOUT_MS,
        ),
        (
            "idle_timeout_ms",
            s.idle_timeout_ms,
            DEFAULT_CLIENT_IDLE_TIMEOUT_MS,
        ),
    ]
    .map(|(name, v, default)| ms(p, &key.field(name), v, default))
}

/// `[server.timeouts]`: upstream timeouts.
fn validate_timeouts(t: &RawTimeouts, key: &Key, p: &mut Problems) -> Timeouts {
    let [connect, first_byte, idle, total] = [
        ("connect_ms", t.connect_ms, DEFAULT_CONNECT_TIMEOUT_MS),
        (
            "first_byte_ms",
            t.first_byte_ms,
            DEFAULT_FIRST_BYTE_TIMEOUT_MS,
        ),
        ("idle_ms", t.idle_ms, DEFAULT_IDLE_TIMEOUT_MS),
        ("total_ms", t.total_ms, DEFAULT_TOTAL_TIMEOUT_MS),
    ]
    .map(|(name, v, default)| ms(p, &key.field(name), v, default));
    Timeouts {
        connect,
        first_byte,
        idle,
        total,
    }
}

/// A count within `range`, or a problem naming `key`.
fn between(p: &mut Problems, key: &str, v: usize, range: std::ops::RangeInclusive<usize>) {
    if !range.contains(&v) {
        p.push(format!(
            "{key}: must be between {} and {}, got {v}",
            range.start(),
            range.end()
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{check, ONE_POOL, POOL};

    #[test]
    fn max_connections_follows_the_open_file_limit() {
        assert_eq!(connections_for_fd_limit(1024), 384);
        assert_eq!(connections_for_fd_limit(1 << 20), ((1 << 20) - 256) / 2);
        assert_eq!(connections_for_fd_limit(100), 64);
        let c = check(ONE_POOL).unwrap();
        assert_eq!(c.server.max_connections, default_max_connections());
    }

    #[test]
    fn client_connection_limits_have_defaults_and_bounds() {
        let c = check(ONE_POOL).unwrap();
        assert_eq!(c.server.body_read_timeout, Duration::from_secs(30));
        assert_eq!(c.server.idle_timeout, Duration::from_secs(60));
        assert_eq!(c.server.max_headers, 100);
        assert_eq!(c.server.max_header_bytes, 64 * 1024);
        let text = format!(
            "[server]\nmax_headers = 0\nmax_header_bytes = 10\nbody_read_timeout_ms = 0\n{ONE_POOL}"
        );
        let e = check(&text).unwrap_err().to_string();
        assert!(e.contains("server.max_headers"), "{e}");
        assert!(e.contains("server.max_header_bytes"), "{e}");
        assert!(e.contains("server.body_read_timeout_ms"), "{e}");
    }

    #[test]
    fn busy_poll_window_is_read_and_capped() {
        let pool = "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{ url = \"http://127.0.0.1:9000\" }]\n";
        let off = check(pool).unwrap();
        assert!(off.server.busy_poll.is_zero(), "off by default");
        let on = check(&format!("[server]\nbusy_poll_us = 200\n{pool}")).unwrap();
        assert_eq!(on.server.busy_poll, Duration::from_micros(200));
        let e = check(&format!("[server]\nbusy_poll_us = 10001\n{pool}")).unwrap_err();
        assert!(e.to_string().contains("server.busy_poll_us"), "{e}");
    }

    #[test]
    fn listen_addresses_take_resolvable_names() {
        std::env::set_var("SWITCHYARD_TEST_ADMIN_TOKEN_LISTEN", "0123456789abcdef");
        let c = check(&format!(
            "[server]\nlisten = \"localhost:8080\"\n[admin]\nlisten = \"localhost:9090\"\ntoken_env = \"SWITCHYARD_TEST_ADMIN_TOKEN_LISTEN\"\n{POOL}"
        ))
        .unwrap();
        assert!(c.server.listen.ip().is_loopback(), "{}", c.server.listen);
        assert_eq!(c.server.listen.port(), 8080);
        assert_eq!(c.admin.unwrap().listen.port(), 9090);
        let c = check(&format!("[server]\nlisten = \"[::1]:8080\"\n{POOL}")).unwrap();
        assert_eq!(c.server.listen, "[::1]:8080".parse().unwrap());
    }

    #[test]
    fn a_bad_listen_address_shows_the_value_and_the_expected_form() {
        std::env::set_var("SWITCHYARD_TEST_ADMIN_TOKEN_BAD", "0123456789abcdef");
        let e = check(&format!(
            "[server]\nlisten = \"no-such-host.invalid:8080\"\n[admin]\nlisten = \"localhost\"\ntoken_env = \"SWITCHYARD_TEST_ADMIN_TOKEN_BAD\"\n{POOL}"
        ))
        .unwrap_err();
        assert_eq!(e.problems.len(), 2, "{e}");
        for (key, value) in [
            ("server.listen", "no-such-host.invalid:8080"),
            ("admin.listen", "localhost"),
        ] {
            let p = e.problems.iter().find(|p| p.starts_with(key)).unwrap();
            assert!(p.contains(&format!("`{value}`")), "{p}");
            assert!(
                p.contains("expected host:port") && p.contains("localhost:8080"),
                "{p}"
            );
        }
    }
}
