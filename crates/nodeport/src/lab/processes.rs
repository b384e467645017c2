//! The lab's long-running processes (API server, proxies, pod servers): each is the
//! `nodeport` binary itself, started inside a namespace with `ip netns exec`, in its own
//! process group (a Ctrl-C at the terminal reaches the lab, which tears down in order, not
//! every process at once), with its output in a log file, so that `--keep` can leave it
//! running after the lab exits.

use std::ffi::OsString;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use nodeport_testbed::{ChildGuard, Netns};

use super::state::LAB_ENV;

/// One started process.
#[derive(Debug)]
pub struct Process {
    /// Short name (`apiserver`, `proxy-worker`, `pod-web-…`), also its log's name.
    pub name: String,
    /// Its log file (stdout and stderr).
    pub log: PathBuf,
    guard: ChildGuard,
}

/// Every process a lab started, in start order.
#[derive(Debug, Default)]
pub struct Processes {
    list: Vec<Process>,
}

impl Processes {
    /// Starts `nodeport <args>` inside `ns`, logging to `log`, marked with the lab's id.
    pub fn start(
        &mut self,
        lab_id: &str,
        ns: &Netns,
        name: &str,
        args: &[OsString],
        log: &Path,
    ) -> anyhow::Result<&Process> {
        let exe = std::env::current_exe().context("find the nodeport executable")?;
        let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone().context("duplicate log file handle")?;
        let mut cmd = ns.command(exe);
        cmd.args(args)
            .env(LAB_ENV, lab_id)
            .env(
                "NODEPORT_LOG",
                std::env::var("NODEPORT_LOG").unwrap_or("info".into()),
            )
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let guard = ns
            .spawn(&mut cmd)
            .with_context(|| format!("start {name} in {}", ns.name()))?;
        self.list.push(Process {
            name: name.to_owned(),
            log: log.to_owned(),
            guard,
        });
        Ok(self.list.last().expect("just pushed"))
    }

    /// The processes that have exited, with how (each reported once).
    pub fn exited(&mut self) -> Vec<(String, std::process::ExitStatus, PathBuf)> {
        self.list
            .iter_mut()
            .filter_map(|p| {
                p.guard
                    .try_wait()
                    .map(|status| (p.name.clone(), status, p.log.clone()))
            })
            .collect()
    }

    /// Whether `name` is still running.
    pub fn is_running(&mut self, name: &str) -> bool {
        self.list
            .iter_mut()
            .find(|p| p.name == name)
            .is_some_and(|p| p.guard.pid() != 0 && p.guard.try_wait().is_none())
    }

    /// Stops every process: SIGTERM to all, up to `grace` for them to exit, then SIGKILL.
    pub fn stop(&mut self, grace: Duration) {
        for p in &self.list {
            let pid = p.guard.pid();
            if pid != 0 {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline
            && self
                .list
                .iter_mut()
                .any(|p| p.guard.pid() != 0 && p.guard.try_wait().is_none())
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        // Dropping the guards SIGKILLs and reaps what is left.
        self.list.clear();
    }

    /// Leaves every process running after this one exits; returns (name, pid) of each.
    pub fn detach(&mut self) -> Vec<(String, u32)> {
        self.list
            .drain(..)
            .map(|p| (p.name, p.guard.detach()))
            .collect()
    }
}

/// The last `lines` lines of a log file, for failure messages.
pub fn tail(log: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
