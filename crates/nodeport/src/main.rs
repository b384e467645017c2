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
#[command(
    name = "nodeport",
    about,
    // `--version` is ours: the same report as `nodeport version`, with the kernel checks.
    disable_version_flag = true,
    override_usage = "nodeport <COMMAND>\n       nodeport --version",
    arg_required_else_help = true,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    /// Print version, git commit, build date, Rust version and the dataplanes this kernel
    /// supports (the same as `nodeport version`).
    #[arg(short = 'V', long)]
    version: bool,
    #[command(subcommand)]
    command: Option<cmd::Command>,
}

/// The command-line interface as clap sees it (for completions and man pages).
pub(crate) fn cli() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

fn main() -> ExitCode {
    // clap's own usage errors (a missing or unknown argument) exit 64 like ours, not clap's
    // 2: one exit code for every usage error. `--help` still exits 0.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let code = if err.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = err.print();
            return ExitCode::from(code);
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a terminal: logs redirected to a file or a journal stay plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NODEPORT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let command = match (cli.command, cli.version) {
        (Some(command), _) => command,
        (None, true) => cmd::Command::Version(cmd::version::Args {}),
        (None, false) => crate::cli()
            .error(
                clap::error::ErrorKind::MissingSubcommand,
                "a subcommand is required",
            )
            .exit(),
    };
    match cmd::run(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if let Some(usage) = err.downcast_ref::<cmd::UsageError>() {
                eprintln!("nodeport: {usage}");
                return ExitCode::from(EXIT_USAGE);
            }
            if let Some(exit) = err.downcast_ref::<cmd::Exit>() {
                if let Some(message) = &exit.message {
                    eprintln!("nodeport: {message}");
                }
                return ExitCode::from(exit.code);
            }
            eprintln!("nodeport: {err:#}");
            ExitCode::FAILURE
        }
    }
}
