//! One module per subcommand; each owns its `Args` and `run`.

pub mod apiserver;
pub mod completions;
pub mod ebpf;
pub mod lab;
pub mod proxy;
pub mod render;
pub mod trace;
pub mod up;
pub mod version;

use clap::Subcommand;

/// A configuration mistake: printed as one line, exit code 64.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A command that ends with an exit code of its own: `message` (if any) printed as one
/// line first. `nodeport trace` ends so: 1 when the packet is dropped or rejected, 3 when
/// it cannot be traced.
#[derive(Debug)]
pub struct Exit {
    /// The process's exit code.
    pub code: u8,
    /// What to print on standard error, if anything.
    pub message: Option<String>,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.message {
            Some(m) => f.write_str(m),
            None => write!(f, "exit code {}", self.code),
        }
    }
}

impl std::error::Error for Exit {}

/// The subcommands of `nodeport`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Kubernetes-compatible API server that allocates NodePorts and ClusterIPs.
    Apiserver(apiserver::Args),
    /// Node proxy: programs the kernel for Services, as kube-proxy does.
    Proxy(proxy::Args),
    /// Print the ruleset the proxy would program for a file of objects.
    Render(render::Args),
    /// Follow a packet through what the proxy programs: its path rule by rule, the Service
    /// port, endpoints, masquerade and fate.
    Trace(trace::Args),
    /// Reproduce the NodePort lab in network namespaces on this machine.
    Lab(lab::Args),
    /// Single node: API server and proxy in one process.
    Up(up::Args),
    /// A pod of the lab's deployment: an HTTP server answering like nginx's welcome page.
    #[command(hide = true)]
    PodServer(lab::PodServerArgs),
    /// Print version and build information, and which dataplanes this kernel supports.
    Version(version::Args),
    /// Print the shell completion script for bash, zsh or fish.
    Completions(completions::Args),
    /// Write the man pages (nodeport.1 and one per subcommand) into a directory.
    #[command(hide = true)]
    Manpages(completions::ManArgs),
}

/// Runs one subcommand to completion.
pub fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Apiserver(args) => apiserver::run(args),
        Command::Proxy(args) => proxy::run(args),
        Command::Render(args) => render::run(args),
        Command::Trace(args) => trace::run(args),
        Command::Lab(args) => lab::run(args),
        Command::Up(args) => up::run(args),
        Command::PodServer(args) => lab::run_pod_server(args),
        Command::Version(args) => version::run(args),
        Command::Completions(args) => completions::run(args),
        Command::Manpages(args) => completions::run_manpages(args),
    }
}

/// Writes to standard output as `print!` does, except that a reader that went away (`nodeport
/// render ... | head`) ends the process quietly with status 141, what a shell reports for a
/// command killed by SIGPIPE (Rust ignores the signal, so the write fails with `EPIPE`
/// instead, and `print!` would panic). Any other failure (a full disk) still panics with its
/// message and backtrace, as `print!` does.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(141),
        Err(e) => panic!("failed printing to stdout: {e}"),
    }
}

/// `print!` through [`write_stdout`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cmd::write_stdout(format_args!($($arg)*))
    };
}

/// `println!` through [`write_stdout`].
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cmd::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {out, outln};

/// Raises this process's soft limit on open files to its hard limit, as Go programs (and so
/// kube-apiserver and kube-proxy) do at start since Go 1.19: a server holding one descriptor per
/// connection and watch must not stop accepting at the common soft default of 1024.
pub fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %err, "cannot raise the open files limit");
            }
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "cannot read the open files limit"),
    }
}
