//! Command-line entry points shared by the binary: `serve`, `check-config`,
//! `health`, and the version string.

mod health;
mod probe;

pub use health::{probe as health_probe, HealthArgs};
pub use probe::{check_config_probe, PROBE_TIMEOUT};

use crate::config::{self, Config, PolicyKind, RawConfig, RawPool, RawWorker, Secrets};
use clap::builder::PossibleValuesParser;
use clap::Args;
use std::path::PathBuf;

/// `switchyard --version`: the package version and the git revision it was built
/// from (`unknown` outside a git tree; see `build.rs`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("SWITCHYARD_GIT_REV"),
    ")"
);

/// `--policy` takes one of the policy names.
fn policy_names() -> PossibleValuesParser {
    PossibleValuesParser::new(PolicyKind::ALL.iter().map(|p| p.as_str()))
}

/// `switchyard serve` flags. Flags override the file; `--worker` adds workers to a
/// pool named `cli` whose models are discovered from each worker's `/v1/models`.
#[derive(Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// TOML configuration file.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Listen address, e.g. 127.0.0.1:8080 or localhost:8080 (overrides server.listen).
    #[arg(long)]
    pub listen: Option<String>,
    /// Upstream worker base URL (repeatable).
    #[arg(long = "worker")]
    pub workers: Vec<String>,
    /// Routing policy for the `--worker` pool (or for every pool when no --worker is given).
    #[arg(long, value_parser = policy_names())]
    pub policy: Option<String>,
    /// Add x-switchyard-route headers to responses.
    #[arg(long)]
    pub debug_headers: bool,
    /// Serving threads, one runtime and listener each (overrides server.threads; 0 = one per CPU).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Busy-poll window of each serving thread in µs (overrides
    /// server.busy_poll_us; 0 = off): lower latency at low load for CPU.
    #[arg(long)]
    pub busy_poll_us: Option<u64>,
    /// This gateway's region, one of the config's `[regions]` (overrides
    /// server.region): turns on locality routing.
    #[arg(long)]
    pub region: Option<String>,
    /// PEM certificate chain: serve HTTPS (with --tls-key; overrides server.tls.cert).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (overrides server.tls.key).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ServeArgs {
    /// Merge the file (if any) and the flags, then validate (reporting the
    /// file's reading problems together with the validation problems).
    pub fn resolve(&self) -> Result<Config, config::ConfigError> {
        let mut parsed = match &self.config {
            Some(path) => config::read_file(path)?,
            None => config::Parsed::from(RawConfig::default()),
        };
        let raw = &mut parsed.raw;
        if let Some(l) = &self.listen {
            raw.server.listen = Some(l.clone());
        }
        if self.debug_headers {
            raw.server.debug_headers = Some(true);
        }
        if let Some(n) = self.threads {
            raw.server.threads = Some(n);
        }
        if let Some(us) = self.busy_poll_us {
            raw.server.busy_poll_us = Some(us);
        }
        if let Some(r) = &self.region {
            raw.server.region = Some(r.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            let tls = raw.server.tls.get_or_insert_with(Default::default);
            tls.cert = Some(cert.display().to_string());
            tls.key = Some(key.display().to_string());
        }
        if let Some(p) = &self.policy {
            if PolicyKind::parse(p).is_none() {
                return Err(config::ConfigError {
                    problems: vec![format!(
                        "--policy: unknown policy `{p}` (expected one of: {})",
                        PolicyKind::names()
                    )],
                });
            }
            if self.workers.is_empty() {
                for pool in &mut raw.pools {
                    pool.policy = Some(p.clone());
                }
            }
        }
        if !self.workers.is_empty() {
            raw.pools.push(RawPool {
                name: Some("cli".into()),
                policy: self.policy.clone(),
                workers: self
                    .workers
                    .iter()
                    .map(|u| RawWorker {
                        url: u.clone(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            });
        }
        parsed
            .check_with(crate::routing::scorers::unknown_names)
            .validate(Secrets::Required)
            .map(|c| c.config)
    }
}

impl ServeArgs {
    /// A reloader that re-reads the file and re-applies these flags.
    pub fn reloader(&self) -> crate::server::Reloader {
        let args = self.clone();
        Box::new(move || args.resolve())
    }
}

/// `switchyard check-config [--no-secrets] FILE`: validate and summarise (with
/// a `note:` line per unset secret when `secrets` is optional).
pub fn check_config(
    path: &std::path::Path,
    secrets: Secrets,
) -> Result<String, config::ConfigError> {
    let checked = config::read_file(path)?
        .check_with(crate::routing::scorers::unknown_names)
        .validate(secrets)?;
    let c = &checked.config;
    tokenizers_load(c)?;
    let workers: usize = c.pools.iter().map(|p| p.workers.len()).sum();
    let mut out = format!(
        "{}: ok ({} pools, {} workers, listen {})",
        path.display(),
        c.pools.len(),
        workers,
        c.server.listen
    );
    if c.server.tls.is_some() {
        out.push_str("; TLS");
    }
    let g = &c.global;
    if !g.regions.is_empty() {
        out.push_str(&format!(
            "; regions {} (this gateway: {}), {} residency zones, {} splits",
            g.names(g.all_regions()),
            g.region.map_or("none", |r| &**g.region_name(r)),
            g.zones.len(),
            g.splits.len()
        ));
    } else if !g.splits.is_empty() {
        out.push_str(&format!("; {} splits", g.splits.len()));
    }
    for n in &checked.notes {
        out.push_str(&format!("\nnote: {n}"));
    }
    for w in config::open_warnings(c) {
        out.push_str(&format!("\nwarning: {w}"));
    }
    Ok(out)
}

/// Each pool's tokenizer loads (files, template): `serve` would otherwise find
/// out at start and route those pools on estimates.
fn tokenizers_load(c: &config::Config) -> Result<(), config::ConfigError> {
    let problems: Vec<String> = c
        .pools
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let t = p.tokenizer.as_ref()?;
            let e = crate::tokenize::build(t).err()?;
            Some(format!("pools[{i}].tokenizer: {e}"))
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(config::ConfigError { problems })
    }
}

/// `switchyard tokenize`: the prompt tokens the gateway computes for a request.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Model directory with `tokenizer.json` and `tokenizer_config.json`.
    #[arg(long)]
    pub model_dir: PathBuf,
    /// Chat template file to use instead of the model's (like vLLM's `--chat-template`).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// The endpoint the request body (read from stdin) is for.
    #[arg(long, default_value = "chat", value_parser = ["chat", "completions", "responses"])]
    pub endpoint: String,
    /// Print the rendered chat prompt text instead of token ids.
    #[arg(long)]
    pub render: bool,
}

/// Token ids as a JSON array (or the rendered prompt) for the request body on stdin.
pub fn tokenize(args: &TokenizeArgs, body: &[u8]) -> anyhow::Result<String> {
    use crate::api::inspect::Endpoint;
    use crate::tokenize::{HfTokenizer, PromptTokenizer};
    let template = match &args.chat_template {
        Some(p) => {
            Some(std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
        }
        None => None,
    };
    let tok = HfTokenizer::from_dir(&args.model_dir, template)?;
    let endpoint = match args.endpoint.as_str() {
        "completions" => Endpoint::Completions,
        "responses" => Endpoint::Responses,
        _ => Endpoint::ChatCompletions,
    };
    if args.render {
        return Ok(tok.render(endpoint, body)?);
    }
    let ids = tok.prompt_tokens(endpoint, body)?;
    Ok(serde_json::to_string(&*ids)?)
}
