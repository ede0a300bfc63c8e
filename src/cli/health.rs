//! `switchyard health`: a one-shot HTTP probe of a running gateway, so container
//! images without curl (distroless) can still have a `HEALTHCHECK`.

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// `switchyard health` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct HealthArgs {
    /// URL to probe (plain `http://`); any 2xx answer is healthy.
    #[arg(long, default_value = "http://127.0.0.1:8080/health")]
    pub url: String,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
}

/// GET the URL once: `Ok` with the status line on 2xx, an error naming the URL otherwise.
pub async fn probe(args: &HealthArgs) -> anyhow::Result<String> {
    let uri: http::Uri = args
        .url
        .parse()
        .map_err(|e| anyhow::anyhow!("--url `{}`: {e}", args.url))?;
    if uri.scheme_str() != Some("http") {
        anyhow::bail!("--url `{}`: only http:// URLs are probed", args.url);
    }
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let timeout = Duration::from_millis(args.timeout_ms);
    let status = match tokio::time::timeout(timeout, client.get(uri)).await {
        Err(_) => anyhow::bail!("{}: no answer within {timeout:?}", args.url),
        Ok(Err(e)) => anyhow::bail!("{}: {}", args.url, chain(&e)),
        Ok(Ok(resp)) => resp.status(),
    };
    if !status.is_success() {
        anyhow::bail!("{}: unhealthy ({status})", args.url);
    }
    Ok(format!("{}: {status}", args.url))
}

/// An error and its causes, `outer: inner: …` (hyper's own message is only "client error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
