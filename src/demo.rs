//! `switchyard demo`: a few simulated workers and a gateway in one process, with a
//! ready-to-paste request printed for the user.

use crate::config::{RawConfig, RawPool, RawWorker};
use crate::server;
use crate::sim::{self, SimConfig};
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Gateway listen address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Number of simulated workers.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Routing policy.
    #[arg(long, default_value = "prefix", value_parser = policy_names())]
    pub policy: String,
    /// Simulated-engine speed-up factor (1 = real time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
}

/// `--policy` takes one of the policy names (listed by `--help` and in the
/// error for any other).
fn policy_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        crate::config::PolicyKind::ALL.iter().map(|p| p.as_str()),
    )
}

/// Start everything, print how to use it, and run until Ctrl-C.
pub async fn run(
    args: DemoArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let mut sims = Vec::new();
    for i in 0..args.workers.max(1) {
        let cfg = SimConfig {
            time_scale: args.time_scale,
            seed: i as u64,
            ..SimConfig::default()
        };
        sims.push(sim::spawn(cfg).await?);
    }
    let model = SimConfig::default().model.clone();
    let raw = RawConfig {
        pools: vec![RawPool {
            name: Some("demo".into()),
            models: vec![model.clone()],
            policy: Some(args.policy.clone()),
            workers: sims
                .iter()
                .map(|s| RawWorker {
                    url: s.url(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        server: crate::config::RawServer {
            listen: Some(args.listen.clone()),
            debug_headers: Some(true),
            ..Default::default()
        },
        ..Default::default()
    };
    let config = raw.validate()?;
    let listener = match tokio::net::TcpListener::bind(config.server.listen).await {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => anyhow::bail!(
            "{} is already in use (another demo or gateway?); choose another address with --listen, e.g. --listen 127.0.0.1:8090",
            config.server.listen
        ),
        Err(e) => anyhow::bail!("cannot listen on {}: {e}", config.server.listen),
    };
    let addr = listener.local_addr()?;
    let gw = server::Gateway::start(config).await?;
    println!(
        "Switchyard demo: {} simulated workers serving `{model}`",
        sims.len()
    );
    for s in &sims {
        println!("  worker {}", s.url());
    }
    println!("Gateway:   http://{addr}");
    println!("Dashboard: http://{addr}/dashboard   (metrics: http://{addr}/metrics)");
    println!("Try a streaming chat completion:\n");
    println!(
        "  curl -N http://{addr}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"stream\":true,\"max_tokens\":32,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'\n"
    );
    println!("Press Ctrl-C to stop.");
    let drain = gw.registry.config().server.drain_timeout;
    server::serve(listener, gw, shutdown, drain).await?;
    for s in sims {
        s.shutdown().await;
    }
    Ok(())
}
