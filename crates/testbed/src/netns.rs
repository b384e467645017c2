//! Network-namespace guards and the processes started inside them.

use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::AsFd;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Where `ip netns` keeps its named namespaces.
const NETNS_DIR: &str = "/run/netns";
/// Every namespace this crate creates starts with this, followed by the creating PID.
const PREFIX: &str = "np-";

static SEQUENCE: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

/// A named network namespace (`ip netns add`), deleted with everything running in it on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `np-<pid>-<n>-<role>` with its loopback up.
    ///
    /// The first call in a process also removes namespaces left by processes that no longer
    /// exist ([`sweep_stale`]).
    pub fn new(role: &str) -> Result<Self> {
        SWEEP.call_once(sweep_stale);
        let n = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}{}-{n}-{role}", std::process::id());
        run_cmd(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Self { name };
        ns.run(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Creates a namespace with exactly this name (loopback up), for callers that own the
    /// naming themselves, such as `nodeport lab` whose namespaces may outlive the process
    /// (`--keep`). Such names are never touched by [`sweep_stale`]; the caller keeps them unique.
    pub fn create(name: &str) -> Result<Self> {
        run_cmd(Command::new("ip").args(["netns", "add", name]))?;
        let ns = Self {
            name: name.to_owned(),
        };
        ns.run(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Takes charge of an existing namespace: dropping the guard deletes it (and kills what
    /// runs in it), as for one this process created.
    pub fn adopt(name: &str) -> Self {
        Self {
            name: name.to_owned(),
        }
    }

    /// Disarms the guard: the namespace and everything running in it stay after the guard is
    /// gone. Returns the name, with which [`Netns::adopt`] can take charge of it again.
    pub fn persist(self) -> String {
        let mut this = std::mem::ManuallyDrop::new(self);
        std::mem::take(&mut this.name)
    }

    /// The namespace's name, as `ip netns` knows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A command that runs `program` inside the namespace (`ip netns exec <name> program`).
    /// `ip netns exec` execs the program, so the child's PID is the program's own.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Runs `args` inside the namespace and returns its stdout; a non-zero exit is an error
    /// that carries stderr.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let (program, rest) = args.split_first().expect("run needs a program");
        let mut cmd = self.command(program);
        cmd.args(rest);
        run_cmd(&mut cmd)
    }

    /// Like [`Netns::run`], feeding `stdin` to the command (e.g. `nft -f -`).
    pub fn run_with_stdin(&self, args: &[&str], stdin: &[u8]) -> Result<String> {
        let (program, rest) = args.split_first().expect("run needs a program");
        let mut cmd = self.command(program);
        cmd.args(rest);
        run_cmd_stdin(&mut cmd, stdin)
    }

    /// Runs a shell script inside the namespace (`sh -c`), returning stdout.
    pub fn sh(&self, script: &str) -> Result<String> {
        self.run(&["sh", "-c", script])
    }

    /// Sets a sysctl inside the namespace (network sysctls are per namespace).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.run(&["sysctl", "-qw", &format!("{key}={value}")])
            .map(drop)
    }

    /// Starts `cmd` (usually from [`Netns::command`]) and returns a guard that kills it.
    /// Its stdout and stderr go to the test's stderr so failures show what it printed.
    pub fn spawn(&self, cmd: &mut Command) -> Result<ChildGuard> {
        spawn_guarded(cmd)
    }

    /// Runs `f` on a thread that has entered this namespace; sockets `f` opens belong to it.
    /// The calling thread stays where it is.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        let file = self.open()?;
        std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(
                        |errno| Error::Io {
                            what: format!("enter namespace {}", self.name),
                            source: errno.into(),
                        },
                    )?;
                    Ok(f())
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// Adds an address to an interface of this namespace (IPv6 without duplicate address
    /// detection, so it is usable at once).
    pub fn add_addr(&self, ifname: &str, addr: &str) -> Result<()> {
        let mut args = vec!["ip", "addr", "add", addr, "dev", ifname];
        if addr.contains(':') {
            args.push("nodad");
        }
        self.run(&args).map(drop)
    }

    /// Opens the namespace file, for code that enters the namespace itself (long-lived
    /// server threads, see [`crate::server`]).
    pub(crate) fn open(&self) -> Result<std::fs::File> {
        std::fs::File::open(format!("{NETNS_DIR}/{}", self.name)).map_err(|source| Error::Io {
            what: format!("open namespace {}", self.name),
            source,
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        remove(&self.name);
    }
}

/// Kills every process inside `name` (they were all started by tests), then deletes it.
fn remove(name: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", name]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
    let _ = Command::new("ip")
        .args(["netns", "del", name])
        .stderr(Stdio::null())
        .status();
}

/// Deletes namespaces named by this crate whose creating process no longer exists.
pub fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            remove(&name);
        }
    }
}

/// A child process that is killed (SIGKILL, by PID) and reaped when the guard drops.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
    what: String,
}

impl ChildGuard {
    /// The child's PID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Sends SIGTERM and waits up to `grace` for the child to exit, then SIGKILLs it.
    /// Returns the exit status if it exited by itself.
    pub fn terminate(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }

    /// SIGKILLs the child now and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the child has exited (reaping it if so), with its status.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok().flatten();
        if status.is_some() {
            self.child = None;
        }
        status
    }

    /// Leaves the child running after the guard is gone (it is no longer killed or reaped by
    /// this process) and returns its PID.
    pub fn detach(mut self) -> u32 {
        let pid = self.pid();
        self.child = None;
        pid
    }

    /// What was started, for messages.
    pub fn describe(&self) -> &str {
        &self.what
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `cmd` with inherited stdout/stderr and wraps it in a [`ChildGuard`].
pub(crate) fn spawn_guarded(cmd: &mut Command) -> Result<ChildGuard> {
    let what = describe(cmd);
    let child = cmd
        .stdin(Stdio::null())
        .spawn()
        .map_err(|source| Error::Spawn {
            command: what.clone(),
            source,
        })?;
    Ok(ChildGuard {
        child: Some(child),
        what,
    })
}

pub(crate) fn run_cmd(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Spawn {
            command: describe(cmd),
            source,
        })?;
    check(cmd, out)
}

fn run_cmd_stdin(cmd: &mut Command, stdin: &[u8]) -> Result<String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            command: describe(cmd),
            source,
        })?;
    let mut pipe = child.stdin.take().expect("stdin was piped");
    let written = pipe.write_all(stdin);
    drop(pipe);
    let out = child.wait_with_output().map_err(|source| Error::Io {
        what: format!("wait for `{}`", describe(cmd)),
        source,
    })?;
    written.map_err(|source| Error::Io {
        what: format!("write stdin of `{}`", describe(cmd)),
        source,
    })?;
    check(cmd, out)
}

fn check(cmd: &Command, out: Output) -> Result<String> {
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Error::Command {
            command: describe(cmd),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}
