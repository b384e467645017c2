//! The `nodeport` binary: argument parsing and wiring only.

mod cmd;
mod lab;

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::Parser;

/// Exit code for invalid configuration (sysexits.h EX_USAGE), as STYLE.md asks.
const EXIT_USAGE: u8 = 64;

/// Kubernetes NodePort Service networking, end to end.
#[derive(Debug, Parser)]
#[command(name = "nodeport", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: cmd::Command,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a terminal: logs redirected to a file or a journal stay plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NODEPORT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match cmd::run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if let Some(usage) = err.downcast_ref::<cmd::UsageError>() {
                eprintln!("nodeport: {usage}");
                return ExitCode::from(EXIT_USAGE);
            }
            eprintln!("nodeport: {err:#}");
            ExitCode::FAILURE
        }
    }
}
