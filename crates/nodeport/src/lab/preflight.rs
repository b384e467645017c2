//! What the lab needs from the machine before it creates anything, and the exact message
//! when something is missing.

use std::fmt;
use std::path::Path;

use super::ProxyMode;

/// One thing the machine lacks, with how to get it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    /// What is missing.
    pub what: String,
    /// Why the lab needs it and how to get it.
    pub how: String,
}

/// Everything missing at once, so one run tells the whole story.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing(pub Vec<Need>);

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "the lab cannot start; this machine is missing:")?;
        for need in &self.0 {
            writeln!(f, "  - {}: {}", need.what, need.how)?;
        }
        write!(
            f,
            "(on Debian/Ubuntu, from a checkout: `bash scripts/quickstart.sh` installs what is \
             missing; or, as root: apt-get install -y iproute2 nftables iptables; kubectl from \
             the Kubernetes packages or Debian's kubernetes-client)"
        )
    }
}

impl std::error::Error for Missing {}

/// A command the lab runs, the package that has it, and what it is for.
struct Tool {
    command: &'static str,
    package: &'static str,
    purpose: &'static str,
}

const IP: Tool = Tool {
    command: "ip",
    package: "iproute2",
    purpose: "creates the namespaces, links and routes",
};
const NFT: Tool = Tool {
    command: "nft",
    package: "nftables",
    purpose: "the nftables proxy programs and the lab shows the rules with it",
};
const BPFTOOL: Tool = Tool {
    command: "bpftool",
    package: "bpftool",
    purpose: "the lab sees the eBPF proxy's first sync and shows its programs and maps with it",
};
const IPTABLES: Tool = Tool {
    command: "iptables",
    package: "iptables",
    purpose: "the iptables proxy mode needs it, and the lab shows the rules with it",
};
const IPTABLES_RESTORE: Tool = Tool {
    command: "iptables-restore",
    package: "iptables",
    purpose: "the iptables proxy mode applies its rules with it",
};
const KUBECTL: Tool = Tool {
    command: "kubectl",
    package: "kubectl or kubernetes-client",
    purpose: "the lab writes the objects and shows the cluster with the real kubectl",
};

/// The commands the lab runs in `mode`. `scripts/packages.sh`'s `lab` group installs those of
/// every mode (a test below keeps the two equal).
fn tools(mode: ProxyMode) -> Vec<Tool> {
    let mut tools = vec![IP, KUBECTL];
    match mode {
        ProxyMode::Nftables => tools.push(NFT),
        ProxyMode::Ebpf => tools.push(BPFTOOL),
        ProxyMode::Iptables | ProxyMode::Ipvs => tools.extend([IPTABLES, IPTABLES_RESTORE]),
    }
    tools
}

/// Checks root, the commands the chosen mode needs, and kernel support, returning every
/// missing item.
pub fn check(mode: ProxyMode) -> Result<(), Missing> {
    let mut missing = Vec::new();
    if !nix::unistd::geteuid().is_root() {
        missing.push(Need {
            what: "root".to_owned(),
            how: "the lab creates network namespaces; run it as root (e.g. with sudo)".to_owned(),
        });
    }
    if mode == ProxyMode::Ipvs && !Path::new("/proc/net/ip_vs").exists() {
        missing.push(Need {
            what: "IPVS in the kernel".to_owned(),
            how: "--proxy-mode ipvs needs the ip_vs module (`modprobe ip_vs`); this kernel \
                  does not have it: use --proxy-mode nftables or iptables"
                .to_owned(),
        });
    }
    if mode == ProxyMode::Ebpf && nodeport_proxy::ebpf::dataplane::cgroup2_mount().is_none() {
        missing.push(Need {
            what: "cgroup v2".to_owned(),
            how: "--proxy-mode ebpf attaches socket programs to a cgroup v2 per node; no cgroup2 \
                  hierarchy is mounted (see /proc/self/mountinfo)"
                .to_owned(),
        });
    }
    for tool in tools(mode) {
        if find_on_path(tool.command).is_none() {
            missing.push(Need {
                what: format!("`{}` on PATH (package {})", tool.command, tool.package),
                how: tool.purpose.to_owned(),
            });
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Missing(missing))
    }
}

/// The full path of `command` on `PATH`, if any.
pub fn find_on_path(command: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(command))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_every_missing_item_and_how_to_get_it() {
        let missing = Missing(vec![
            Need {
                what: "root".into(),
                how: "run it as root".into(),
            },
            Need {
                what: "`nft` on PATH (package nftables)".into(),
                how: "the proxy programs with it".into(),
            },
        ]);
        let text = missing.to_string();
        assert!(text.starts_with("the lab cannot start; this machine is missing:\n"));
        assert!(text.contains("\n  - root: run it as root\n"));
        assert!(text.contains("\n  - `nft` on PATH (package nftables): the proxy programs"));
        assert!(text.contains("apt-get install"));
    }

    /// Every command the lab may run, in any mode, sorted.
    fn commands() -> Vec<&'static str> {
        let mut commands: Vec<&'static str> = <ProxyMode as clap::ValueEnum>::value_variants()
            .iter()
            .flat_map(|mode| tools(*mode))
            .map(|tool| tool.command)
            .collect();
        commands.sort_unstable();
        commands.dedup();
        commands
    }

    /// `bash scripts/quickstart.sh --list-tools`: "<group> <command> <package>" lines.
    fn quickstart_tools() -> Vec<(String, String)> {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/quickstart.sh");
        let out = std::process::Command::new("bash")
            .arg(&script)
            .arg("--list-tools")
            .output()
            .expect("running bash");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                assert_eq!(words.len(), 3, "{line:?}");
                (words[0].to_owned(), words[1].to_owned())
            })
            .collect()
    }

    #[test]
    fn the_quick_start_installs_exactly_the_commands_the_lab_checks_for() {
        let listed = quickstart_tools();
        let mut lab: Vec<&str> = listed
            .iter()
            .filter(|(group, _)| group == "lab")
            .map(|(_, command)| command.as_str())
            .collect();
        lab.sort_unstable();
        lab.dedup();
        assert_eq!(
            lab,
            commands(),
            "scripts/packages.sh's lab group and the preflight differ"
        );
        assert!(
            listed
                .iter()
                .all(|(group, _)| group == "lab" || group == "build"),
            "{listed:?}"
        );
    }

    #[test]
    fn the_quick_start_installs_protoc_for_the_etcd_client_build() {
        assert!(
            quickstart_tools()
                .iter()
                .any(|(group, command)| group == "build" && command == "protoc")
        );
    }
}
