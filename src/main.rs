use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "switchyard", version, about = "L7 inference gateway")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run simulated vLLM/SGLang engines.
    Sim(switchyard::sim::SimArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Sim(args) => switchyard::sim::run(args).await,
    }
}
