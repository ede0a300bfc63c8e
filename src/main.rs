//! The `switchyard` binary: `serve`, `epp`, `sim`, `demo`, `check-config`,
//! `health`, `completions`, `tokenize`.

use clap::{CommandFactory, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use switchyard::cli::{self, ServeArgs};
use switchyard::server;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "switchyard",
    version = cli::VERSION,
    about = "L7 inference gateway for OpenAI-compatible engines"
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve(ServeArgs),
    /// Validate a configuration file without starting; every problem is reported.
    CheckConfig {
        file: PathBuf,
        /// Don't require the secret environment variables (`*_env` keys): unset
        /// ones are listed as notes (for CI without the secrets); set ones are
        /// still checked.
        #[arg(long)]
        no_secrets: bool,
        /// Also contact each configured worker of a pool with KV events once
        /// (its `/metrics`, 2 s timeout) and fail when the KV block size it
        /// serves differs from `[pools.kv_events] block_size` or from the
        /// pool's other engines. Without it nothing is contacted.
        #[arg(long)]
        probe: bool,
    },
    /// Run simulated vLLM/SGLang engines.
    Sim(Box<switchyard::sim::SimArgs>),
    /// Endpoint Picker for Envoy-based gateways: the ext_proc gRPC service that
    /// tells the data plane which worker serves each request.
    Epp(switchyard::epp::EppArgs),
    /// Simulated workers and a gateway in one process, ready to try.
    Demo(switchyard::demo::DemoArgs),
    /// Probe a running gateway's health endpoint once; exit 0 on a 2xx answer
    /// (a container HEALTHCHECK without curl).
    Health(cli::HealthArgs),
    /// Print a shell completion script to stdout.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the prompt token ids the gateway computes for a request body read
    /// from stdin (a model directory's tokenizer and chat template).
    Tokenize(cli::TokenizeArgs),
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person at a terminal: log files and collectors get plain text.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    if format == "json" {
        b.json().init();
    } else {
        b.init();
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

async fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.resolve()?;
    for w in switchyard::config::open_warnings(&config) {
        tracing::warn!("open configuration: {w}");
    }
    // Thread-per-core: one single-threaded runtime per serving thread, each with its
    // own SO_REUSEPORT listener; this runtime keeps the background work.
    let listeners = server::shards::bind(config.server.listen, config.server.serving_threads())?;
    let addr = listeners[0].local_addr()?;
    let threads = listeners.len();
    let gw = server::Gateway::start(config).await?;
    gw.registry.note_listener(addr);
    gw.set_reloader(args.reloader());
    server::spawn_reload_triggers(gw.clone(), args.config.clone());
    if let Some(admin) = server::admin::spawn(gw.clone()).await? {
        let tls = gw
            .registry
            .config()
            .admin
            .as_ref()
            .is_some_and(|a| a.tls.is_some());
        let scheme = if tls { "https" } else { "http" };
        println!("switchyard admin url={scheme}://{admin}");
    }
    let drain = gw.registry.config().server.drain_timeout;
    let grace = gw.registry.config().server.unready_grace;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let shards = server::shards::start(gw.clone(), listeners, stopped, drain)?;
    let max_connections = gw.registry.config().server.max_connections;
    tracing::info!(%addr, threads, max_connections, "switchyard listening");
    if max_connections > switchyard::config::default_max_connections() {
        tracing::warn!(
            max_connections,
            "server.max_connections is more than the open-file limit allows (about half of it); connections past that fail to open"
        );
    }
    announce_ready(gw.clone(), addr);
    shutdown_signal().await;
    let _ = stop.send(true);
    tracing::info!(?grace, ?drain, "shutting down");
    tokio::task::spawn_blocking(move || shards.join()).await?;
    gw.log_drained();
    Ok(())
}

/// Raise the open-file limit to its hard value: every client connection, and the
/// upstream connection it may hold, is a descriptor. `max_connections` defaults
/// from the result (`config::default_max_connections`).
fn raise_open_file_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => tracing::info!(limit = n, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
}

/// Print `switchyard ready url=…` once a model is served. Until then, say on
/// stdout what is missing (a worker whose models cannot be discovered, a pool
/// with no available worker), so a first run does not look ready when it is not.
fn announce_ready(gw: std::sync::Arc<server::Gateway>, addr: std::net::SocketAddr) {
    let snap = gw.routes.snapshot();
    let scheme = gw.scheme();
    if snap.is_ready() {
        println!("switchyard ready url={scheme}://{addr}");
        return;
    }
    println!(
        "switchyard listening url={scheme}://{addr}, not ready: {}",
        snap.unready_reasons().join("; ")
    );
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(200));
        loop {
            tick.tick().await;
            if gw.routes.snapshot().is_ready() {
                println!("switchyard ready url={scheme}://{addr}");
                return;
            }
        }
    });
}

/// `switchyard tokenize`: synchronous, no runtime.
fn run_tokenize(args: &cli::TokenizeArgs) -> ExitCode {
    let mut body = Vec::new();
    if let Err(e) = std::io::Read::read_to_end(&mut std::io::stdin(), &mut body) {
        eprintln!("error: reading stdin: {e}");
        return ExitCode::FAILURE;
    }
    match cli::tokenize(args, &body) {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Completions { shell } = cli.cmd {
        clap_complete::generate(
            shell,
            &mut Cli::command(),
            "switchyard",
            &mut std::io::stdout(),
        );
        return ExitCode::SUCCESS;
    }
    init_logging(&cli.log_format);
    if let Command::Tokenize(args) = &cli.cmd {
        return run_tokenize(args);
    }
    if matches!(
        cli.cmd,
        Command::Serve(_) | Command::Sim(_) | Command::Demo(_)
    ) {
        raise_open_file_limit();
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if matches!(cli.cmd, Command::Serve(_) | Command::Health(_)) {
        // Requests are served on their own threads (server::shards); this runtime
        // runs only the background work. A health probe needs no more either.
        rt.worker_threads(1);
    }
    let rt = rt.enable_all().build().expect("tokio runtime");
    let result = rt.block_on(async move {
        match cli.cmd {
            Command::Serve(a) => run_serve(a).await,
            Command::Sim(a) => switchyard::sim::run(*a).await,
            Command::Epp(a) => switchyard::epp::run(a, shutdown_signal()).await,
            Command::Demo(a) => switchyard::demo::run(a, shutdown_signal()).await,
            Command::Tokenize(_) => unreachable!("handled before the runtime starts"),
            Command::CheckConfig {
                file,
                no_secrets,
                probe,
            } => {
                let secrets = if no_secrets {
                    switchyard::config::Secrets::Optional
                } else {
                    switchyard::config::Secrets::Required
                };
                if probe {
                    println!("{}", cli::check_config_probe(&file, secrets).await?);
                } else {
                    println!("{}", cli::check_config(&file, secrets)?);
                }
                Ok(())
            }
            Command::Health(a) => {
                println!("{}", cli::health_probe(&a).await?);
                Ok(())
            }
            Command::Completions { .. } => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
