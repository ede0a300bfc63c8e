//! `switchyard sim`: flags and the entry point that runs N engines.

use std::io::Write as _;

use anyhow::{bail, Context};

use super::{profiles, spawn, EngineKind, Faults, Role, SimConfig};

/// Run simulated vLLM/SGLang engines. Every timing and KV flag overrides the
/// chosen profile; times are simulated milliseconds (divided by --time-scale).
#[derive(clap::Args, Clone, Debug)]
pub struct SimArgs {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port of a single engine (0 = ephemeral). Ignored when --base-port is set.
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Number of independent engines in this process.
    #[arg(long, default_value_t = 1)]
    pub workers: u16,
    /// Engine i listens on BASE_PORT + i.
    #[arg(long)]
    pub base_port: Option<u16>,
    /// Parameter profile: llama-8b-h100, llama-70b-h100x4, llama-8b-l4, tiny.
    #[arg(long, default_value = "llama-8b-h100")]
    pub profile: String,
    /// Per-worker profiles, comma-separated, cycled over the workers.
    #[arg(long, value_delimiter = ',')]
    pub worker_profile: Vec<String>,
    /// Served model name; repeat for aliases (the first one is the metrics label).
    #[arg(long)]
    pub model: Vec<String>,
    /// Per-worker model names, comma-separated, cycled over the workers.
    #[arg(long, value_delimiter = ',')]
    pub worker_model: Vec<String>,
    /// Metric names and extra endpoints to imitate.
    #[arg(long, value_enum, default_value = "vllm")]
    pub engine: EngineKind,
    /// Role in prefill/decode disaggregation.
    #[arg(long, value_enum, default_value = "both")]
    pub role: Role,
    /// Speed-up factor applied to every simulated duration.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Seed for output text, output lengths and random faults.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most sequences in the running batch [default: the profile's].
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Most tokens computed in one engine step: the chunked-prefill budget [default: the
    /// profile's].
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Tokens per KV cache block [default: the profile's].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// KV cache capacity in blocks [default: the profile's].
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Longest prompt + output in tokens, capped at the KV cache size [default: the profile's].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Disable the prefix cache.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Never preempt; reserve KV for each sequence's whole length on admission.
    #[arg(long)]
    pub no_preemption: bool,
    /// Keep generating a streamed request after its client disconnects, until
    /// it ends or `/abort_request` names it (an engine that must be told).
    #[arg(long)]
    pub ignore_disconnect: bool,
    /// Fixed cost of one engine step, in simulated ms [default: the profile's].
    #[arg(long)]
    pub step_base_ms: Option<f64>,
    /// Step cost added per sequence in the batch, in simulated ms [default: the profile's].
    #[arg(long)]
    pub per_seq_ms: Option<f64>,
    /// Step cost added per uncached prompt token computed, in simulated ms [default: the
    /// profile's].
    #[arg(long)]
    pub per_prefill_token_ms: Option<f64>,
    /// Fixed cost of receiving a remote prefill's KV (P/D decode side), in simulated ms [default:
    /// the profile's].
    #[arg(long)]
    pub kv_transfer_base_ms: Option<f64>,
    /// KV transfer cost per token, in simulated ms [default: the profile's].
    #[arg(long)]
    pub kv_transfer_per_token_ms: Option<f64>,
    /// Blocks of a CPU offload tier: a block evicted from the GPU moves there (LRU) and is
    /// published as stored with medium CPU; 0 turns it off.
    #[arg(long)]
    pub cpu_offload_blocks: Option<usize>,
    /// Cost of loading a prefix back from the CPU tier, per token, in simulated ms [default: the
    /// profile's].
    #[arg(long)]
    pub cpu_load_per_token_ms: Option<f64>,
    /// Mean natural output length in tokens before EOS, when a request does not set ignore_eos
    /// [default: the profile's].
    #[arg(long)]
    pub mean_output_tokens: Option<usize>,
    /// Length of /v1/embeddings vectors [default: the profile's].
    #[arg(long)]
    pub embedding_dim: Option<usize>,
    /// Fraction (0-1) of requests answered with --error-status.
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// HTTP status of the responses --error-rate injects.
    #[arg(long, default_value_t = 500)]
    pub error_status: u16,
    /// /health answers 503.
    #[arg(long)]
    pub health_fail: bool,
    /// Fraction (0-1) of requests delayed by --spike-ms (wall clock).
    #[arg(long, default_value_t = 0.0)]
    pub spike_rate: f64,
    /// Wall-clock delay, in ms, of the requests --spike-rate picks.
    #[arg(long, default_value_t = 0)]
    pub spike_ms: u64,
    /// An x-sim-fault value applied to every request (e.g. 503, slow:200).
    #[arg(long)]
    pub fault: Option<String>,
    /// Publish KV-cache events (ZeroMQ PUB) on this endpoint, e.g. tcp://127.0.0.1:5557
    /// (port 0: ephemeral; worker i of several adds i to a fixed port, like vLLM's
    /// data-parallel ranks).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// Answer KV-event replay requests (ZeroMQ ROUTER) on this endpoint.
    #[arg(long, requires = "kv_events")]
    pub kv_replay: Option<String>,
    /// Topic of the KV-event messages.
    #[arg(long, default_value = "kv-events")]
    pub kv_topic: String,
    /// Encoding of each KV event inside a batch.
    #[arg(long, value_enum, default_value = "map")]
    pub kv_events_format: super::kv_events::EventFormat,
    /// Do not send these live KV-event sequence numbers (A-B or A); replay still has them.
    #[arg(long, value_parser = super::kv_events::parse_range)]
    pub kv_drop_seqs: Option<std::ops::RangeInclusive<u64>>,
    /// Hold these live KV-event sequence numbers back and send them in reverse order.
    #[arg(long, value_parser = super::kv_events::parse_range)]
    pub kv_reorder_seqs: Option<std::ops::RangeInclusive<u64>>,
}

impl SimArgs {
    /// The configuration of worker `i`.
    pub fn config(&self, i: usize) -> anyhow::Result<SimConfig> {
        let profile = if self.worker_profile.is_empty() {
            self.profile.as_str()
        } else {
            self.worker_profile[i % self.worker_profile.len()].as_str()
        };
        let Some(mut c) = profiles::get(profile) else {
            bail!(
                "unknown profile {profile:?} (known: {})",
                profiles::NAMES.join(", ")
            );
        };
        c.host = self.host.clone();
        c.port = match self.base_port {
            Some(b) => b
                .checked_add(i as u16)
                .context("--base-port + --workers exceeds 65535")?,
            None if i == 0 => self.port,
            None => 0,
        };
        if !self.worker_model.is_empty() {
            c.model = self.worker_model[i % self.worker_model.len()].clone();
        } else if let Some((first, rest)) = self.model.split_first() {
            c.model = first.clone();
            c.aliases = rest.to_vec();
        }
        c.engine = self.engine;
        c.role = self.role;
        c.time_scale = self.time_scale;
        c.seed = self.seed.wrapping_add(i as u64);
        macro_rules! over {
            ($($f:ident),*) => { $( if let Some(v) = self.$f { c.$f = v; } )* };
        }
        over!(
            max_num_seqs,
            max_num_batched_tokens,
            block_size,
            num_blocks,
            max_model_len,
            step_base_ms,
            per_seq_ms,
            per_prefill_token_ms,
            kv_transfer_base_ms,
            kv_transfer_per_token_ms,
            cpu_offload_blocks,
            cpu_load_per_token_ms,
            mean_output_tokens,
            embedding_dim
        );
        if self.no_prefix_caching {
            c.enable_prefix_caching = false;
        }
        c.ignore_disconnect = self.ignore_disconnect;
        if self.no_preemption {
            c.preemption = false;
        }
        c.faults = Faults {
            error_rate: self.error_rate,
            error_status: self.error_status,
            health_fail: self.health_fail,
            refuse_connections: false,
            spike_rate: self.spike_rate,
            spike_ms: self.spike_ms,
            always: self.fault.clone(),
        };
        c.kv_events = match &self.kv_events {
            Some(ev) => Some(super::kv_events::KvEventsConfig {
                events: offset_port(ev, i)?,
                replay: self
                    .kv_replay
                    .as_deref()
                    .map(|r| offset_port(r, i))
                    .transpose()?,
                topic: self.kv_topic.clone(),
                format: self.kv_events_format,
                drop: self.kv_drop_seqs.clone(),
                reorder: self.kv_reorder_seqs.clone(),
                block_size: c.block_size,
            }),
            None => None,
        };
        c.validate().map_err(anyhow::Error::msg)?;
        Ok(c)
    }
}

/// `tcp://HOST:PORT` with `i` added to a non-zero port.
fn offset_port(endpoint: &str, i: usize) -> anyhow::Result<String> {
    let (base, port) = endpoint
        .rsplit_once(':')
        .with_context(|| format!("{endpoint:?}: expected tcp://HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("{endpoint:?}: expected tcp://HOST:PORT"))?;
    if port == 0 {
        return Ok(endpoint.to_string());
    }
    let port = port
        .checked_add(i as u16)
        .context("KV event port + worker index exceeds 65535")?;
    Ok(format!("{base}:{port}"))
}

/// CLI entry: spawn the engines, print one `switchyard-sim ready ...` line per
/// engine, then serve until ctrl-c.
pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let mut handles = Vec::with_capacity(args.workers as usize);
    for i in 0..args.workers as usize {
        let cfg = args.config(i)?;
        let h = spawn(cfg.clone())
            .await
            .with_context(|| format!("starting sim worker {i} on {}:{}", cfg.host, cfg.port))?;
        let mut out = std::io::stdout().lock();
        write!(
            out,
            "switchyard-sim ready url={} model={} engine={} role={}",
            h.url(),
            cfg.model,
            cfg.engine.as_str(),
            cfg.role.as_str()
        )?;
        if let Some(kv) = h.kv_endpoints() {
            write!(out, " kv_events={}", kv.events)?;
            if let Some(r) = &kv.replay {
                write!(out, " kv_replay={r}")?;
            }
        }
        writeln!(out)?;
        out.flush()?;
        handles.push(h);
    }
    tokio::signal::ctrl_c().await?;
    for h in handles {
        h.shutdown().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command};

    #[test]
    fn every_option_and_value_has_a_description() {
        let cmd = super::SimArgs::augment_args(Command::new("sim"));
        let mut n = 0;
        for a in cmd.get_arguments() {
            n += 1;
            assert!(
                a.get_help().is_some(),
                "--{} has no description",
                a.get_id()
            );
            if !a.get_action().takes_values() {
                continue; // a flag: its implicit true/false are not listed
            }
            for v in a.get_possible_values() {
                assert!(
                    v.get_help().is_some(),
                    "--{} {} has no description",
                    a.get_id(),
                    v.get_name()
                );
            }
        }
        assert!(n > 30, "only {n} options found");
    }
}
