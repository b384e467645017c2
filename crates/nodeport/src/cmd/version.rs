//! `nodeport version` and `nodeport --version`: what was built (version, git commit, build
//! date, compiler) and which dataplanes this kernel supports, each checked on the spot, so
//! that an operator can paste one block into a bug report.
//!
//! Every check is cheap and leaves nothing behind: nf_tables is asked for its ruleset
//! generation (a read), the iptables tools write a chain into a network namespace made for
//! the check and gone with it, IPVS is looked up in `/proc` and the kernel's module lists,
//! and eBPF is a trivial program loaded and closed at once. Checks that need privileges say
//! so instead of guessing when run without them.

use std::fmt;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

/// Flags of `nodeport version` (none: the report is always complete).
#[derive(Debug, clap::Args)]
pub struct Args {}

/// What was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildInfo {
    /// The crate version.
    pub version: &'static str,
    /// The git commit the binary was built from ("unknown" outside a git checkout).
    pub commit: &'static str,
    /// When the build script ran (or `SOURCE_DATE_EPOCH`), RFC 3339 UTC.
    pub date: &'static str,
    /// `rustc --version` of the compiler.
    pub rustc: &'static str,
}

/// This binary's build information (from `build.rs`).
pub const BUILD: BuildInfo = BuildInfo {
    version: env!("CARGO_PKG_VERSION"),
    commit: env!("NODEPORT_GIT_COMMIT"),
    date: env!("NODEPORT_BUILD_DATE"),
    rustc: env!("NODEPORT_RUSTC_VERSION"),
};

/// The answer of one dataplane check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Support {
    /// The kernel (and the tools the mode runs) did what the mode needs.
    Yes(String),
    /// It did not, with the reason.
    No(String),
    /// The check could not run (typically: not root), with the reason.
    Unknown(String),
}

impl Support {
    /// The word printed in the table: `yes`, `no` or `unknown`.
    pub fn word(&self) -> &'static str {
        match self {
            Self::Yes(_) => "yes",
            Self::No(_) => "no",
            Self::Unknown(_) => "unknown",
        }
    }

    fn detail(&self) -> &str {
        match self {
            Self::Yes(d) | Self::No(d) | Self::Unknown(d) => d,
        }
    }
}

/// One dataplane and what its check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// `nftables`, `iptables-nft`, `iptables-legacy`, `ipvs` or `ebpf`.
    pub dataplane: &'static str,
    /// The finding.
    pub support: Support,
}

/// The whole report: build information, kernel release and the dataplane checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// What was built.
    pub build: BuildInfo,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel: String,
    /// One entry per dataplane.
    pub checks: Vec<Check>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.build;
        writeln!(f, "nodeport {}", b.version)?;
        writeln!(f, "  git commit:  {}", b.commit)?;
        writeln!(f, "  build date:  {}", b.date)?;
        writeln!(f, "  rust:        {}", b.rustc)?;
        writeln!(
            f,
            "  platform:    {}/{}",
            std::env::consts::OS,
            std::env::consts::ARCH
        )?;
        writeln!(f, "  kernel:      {}", self.kernel)?;
        writeln!(f, "dataplanes on this kernel:")?;
        for check in &self.checks {
            writeln!(
                f,
                "  {:<16} {:<8} {}",
                check.dataplane,
                check.support.word(),
                check.support.detail()
            )?;
        }
        Ok(())
    }
}

/// Runs every check and prints the report on stdout.
pub fn run(_args: Args) -> anyhow::Result<()> {
    let report = Report {
        build: BUILD,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|e| format!("unknown ({e})")),
        checks: check_all(),
    };
    // Not a write that swallows errors: a full stdout is a panic with its backtrace, as for
    // every other Rust CLI (the package check relies on that to see that backtraces carry
    // file and line); a closed pipe (`| head`) ends the command quietly (see `write_stdout`).
    super::write_stdout(format_args!("{report}"));
    Ok(())
}

/// Checks each dataplane, in the order of `--proxy-mode`'s values.
pub fn check_all() -> Vec<Check> {
    let root = nix::unistd::geteuid().is_root();
    let (iptables_nft, iptables_legacy) = iptables(root);
    vec![
        Check {
            dataplane: "nftables",
            support: nftables(),
        },
        Check {
            dataplane: "iptables-nft",
            support: iptables_nft,
        },
        Check {
            dataplane: "iptables-legacy",
            support: iptables_legacy,
        },
        Check {
            dataplane: "ipvs",
            support: ipvs(Path::new("/proc/net/ip_vs")),
        },
        Check {
            dataplane: "ebpf",
            support: ebpf(),
        },
    ]
}

/// nf_tables answers `NFT_MSG_GETGEN` (the ruleset generation, what `nft` asks first) over
/// netlink: the same socket the proxy's nftables mode writes its transactions to. A read.
fn nftables() -> Support {
    const NFNL_SUBSYS_NFTABLES: u16 = 10;
    const NFT_MSG_NEWGEN: u16 = 15;
    const NFT_MSG_GETGEN: u16 = 16;
    const NLMSG_ERROR: u16 = 2;
    const NLM_F_REQUEST: u16 = 1;

    let mut socket = match Socket::new(NETLINK_NETFILTER) {
        Ok(s) => s,
        Err(e) => return Support::No(format!("no netfilter netlink socket: {e}")),
    };
    if let Err(e) = socket.bind_auto() {
        return Support::Unknown(format!("binding a netlink socket: {e}"));
    }
    // nlmsghdr (16 bytes) + nfgenmsg (family AF_UNSPEC, version 0, resource id 0).
    let mut request = Vec::with_capacity(20);
    request.extend_from_slice(&20u32.to_ne_bytes());
    request.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN).to_ne_bytes());
    request.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes());
    request.extend_from_slice(&0u32.to_ne_bytes());
    request.extend_from_slice(&[0, 0, 0, 0]);
    if let Err(e) = socket.send(&request, 0) {
        return Support::Unknown(format!("sending to nf_tables: {e}"));
    }
    let reply = match socket.recv_from_full() {
        Ok((reply, _)) => reply,
        Err(e) => return Support::Unknown(format!("reading nf_tables' answer: {e}")),
    };
    if reply.len() < 20 {
        return Support::Unknown(format!("short netlink answer ({} bytes)", reply.len()));
    }
    let kind = u16::from_ne_bytes([reply[4], reply[5]]);
    if kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
        return Support::Yes("nf_tables answered over netlink".to_owned());
    }
    if kind == NLMSG_ERROR {
        let errno = -i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
        let err = std::io::Error::from_raw_os_error(errno);
        return match nix::errno::Errno::from_raw(errno) {
            nix::errno::Errno::EPERM => Support::Unknown(format!(
                "nf_tables: {err}; needs CAP_NET_ADMIN (run as root)"
            )),
            _ => Support::No(format!("nf_tables refused over netlink: {err}")),
        };
    }
    Support::Unknown(format!("unexpected netlink message type {kind:#x}"))
}

/// The chain each iptables tool writes: nat, as kube-proxy's iptables mode needs it (a DNAT
/// rule with a comment, as in its `KUBE-SEP-*` chains).
const IPTABLES_PROBE: &str = "*nat\n\
    :NODEPORT-VERSION-CHECK - [0:0]\n\
    -A NODEPORT-VERSION-CHECK -p tcp -m comment --comment \"nodeport version\" -j DNAT --to-destination 192.0.2.1:80\n\
    COMMIT\n";

/// Runs `iptables-nft-restore` and `iptables-legacy-restore` with [`IPTABLES_PROBE`] inside a
/// network namespace of this thread's own, which disappears with the thread: nothing is left
/// in the host's tables. (The kernel may load the modules they need, as any first use does.)
fn iptables(root: bool) -> (Support, Support) {
    if !root {
        let why = "writing a chain into a throwaway network namespace needs root".to_owned();
        return (Support::Unknown(why.clone()), Support::Unknown(why));
    }
    std::thread::spawn(|| {
        if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
            let why = format!("creating a throwaway network namespace: {e}");
            return (Support::Unknown(why.clone()), Support::Unknown(why));
        }
        (
            iptables_restore("iptables-nft-restore"),
            iptables_restore("iptables-legacy-restore"),
        )
    })
    .join()
    .unwrap_or_else(|_| {
        let why = "the check's thread panicked".to_owned();
        (Support::Unknown(why.clone()), Support::Unknown(why))
    })
}

/// One restore of [`IPTABLES_PROBE`] (in the calling thread's network namespace).
fn iptables_restore(tool: &str) -> Support {
    if crate::lab::preflight::find_on_path(tool).is_none() {
        return Support::No(format!(
            "`{tool}` is not installed (Debian package iptables)"
        ));
    }
    let child = Command::new(tool)
        .arg("-w")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return Support::Unknown(format!("running {tool}: {e}")),
    };
    if let Some(mut stdin) = child.stdin.take()
        && let Err(e) = stdin.write_all(IPTABLES_PROBE.as_bytes())
    {
        return Support::Unknown(format!("writing to {tool}: {e}"));
    }
    match child.wait_with_output() {
        Ok(out) if out.status.success() => {
            Support::Yes(format!("{tool} wrote a nat chain with DNAT"))
        }
        Ok(out) => Support::No(format!(
            "{tool} failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
        )),
        Err(e) => Support::Unknown(format!("running {tool}: {e}")),
    }
}

/// IPVS: `/proc/net/ip_vs` exists once the module is loaded; otherwise the kernel's module
/// lists say whether `modprobe ip_vs` would bring it. The proxy only renders IPVS (the mode
/// is deprecated upstream, KEP-5495).
fn ipvs(proc_ip_vs: &Path) -> Support {
    if proc_ip_vs.exists() {
        return Support::Yes(format!(
            "{} exists (ip_vs loaded); the proxy renders IPVS, it does not program it",
            proc_ip_vs.display()
        ));
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let dir = Path::new("/lib/modules").join(release.trim());
    let listed = ["modules.builtin", "modules.dep"].iter().any(|list| {
        std::fs::read_to_string(dir.join(list))
            .map(|text| text.lines().any(|l| l.contains("/ip_vs.ko")))
            .unwrap_or(false)
    });
    if listed {
        Support::No(format!(
            "{} missing: ip_vs is a module of this kernel, not loaded (modprobe ip_vs)",
            proc_ip_vs.display()
        ))
    } else {
        Support::No(format!(
            "{} missing and no ip_vs module in {}",
            proc_ip_vs.display(),
            dir.display()
        ))
    }
}

/// eBPF: the kernel loads the program types an eBPF dataplane attaches (tc `sched_cls` on
/// the interfaces, `cgroup_sock_addr` for connect-time load balancing), each a trivial
/// program loaded and closed at once (aya's feature probe, as `bpftool feature probe`).
fn ebpf() -> Support {
    use aya::programs::ProgramType;
    let mut loaded = Vec::new();
    for (name, kind) in [
        ("sched_cls", ProgramType::SchedClassifier),
        ("cgroup_sock_addr", ProgramType::CgroupSockAddr),
    ] {
        match aya::sys::is_program_supported(kind) {
            Ok(true) => loaded.push(name),
            Ok(false) => return Support::No(format!("the kernel has no {name} programs")),
            Err(e) => {
                let text = error_chain(&e);
                return if text.contains("Operation not permitted") {
                    Support::Unknown(format!(
                        "loading a {name} program: {text}; needs CAP_BPF (run as root)"
                    ))
                } else {
                    Support::No(format!("loading a {name} program: {text}"))
                };
            }
        }
    }
    Support::Yes(format!("{} programs load", loaded.join(" and ")))
}

/// An error and its causes, joined with ": ".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_build_kernel_and_each_dataplane_with_its_answer() {
        let report = Report {
            build: BuildInfo {
                version: "1.2.3",
                commit: "0123abcd",
                date: "2026-11-26T12:00:00Z",
                rustc: "rustc 1.95.0",
            },
            kernel: "6.18.0".into(),
            checks: vec![
                Check {
                    dataplane: "nftables",
                    support: Support::Yes("answered".into()),
                },
                Check {
                    dataplane: "ipvs",
                    support: Support::No("missing".into()),
                },
            ],
        };
        let text = report.to_string();
        assert!(text.starts_with("nodeport 1.2.3\n"), "{text}");
        for line in [
            "  git commit:  0123abcd\n",
            "  build date:  2026-11-26T12:00:00Z\n",
            "  rust:        rustc 1.95.0\n",
            "  kernel:      6.18.0\n",
            "dataplanes on this kernel:\n",
            "  nftables         yes      answered\n",
            "  ipvs             no       missing\n",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
    }

    #[test]
    fn build_info_carries_a_commit_a_date_and_the_compiler() {
        assert_eq!(BUILD.version, env!("CARGO_PKG_VERSION"));
        // Built from this git checkout: a full hash.
        assert_eq!(BUILD.commit.len(), 40, "{}", BUILD.commit);
        assert!(BUILD.commit.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(
            BUILD.date.len(),
            "2026-11-26T12:00:00Z".len(),
            "{}",
            BUILD.date
        );
        assert!(BUILD.date.ends_with('Z') && BUILD.date.as_bytes()[10] == b'T');
        assert!(BUILD.rustc.starts_with("rustc 1."), "{}", BUILD.rustc);
    }

    #[test]
    fn ipvs_is_supported_when_its_proc_file_exists() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ip_vs");
        assert_eq!(ipvs(&file).word(), "no");
        std::fs::write(&file, "IP Virtual Server version 1.2.1\n").unwrap();
        assert_eq!(ipvs(&file).word(), "yes");
    }
}
