//! The `--ebpf-*` flags of `nodeport proxy` and `nodeport up` (`--proxy-mode ebpf`), and
//! the `ebpf:` section of the configuration file they override.

use std::path::{Path, PathBuf};

use nodeport_proxy::config::EbpfSection;
use nodeport_proxy::ebpf::dataplane::{self, Config};
use nodeport_proxy::ebpf::programs::MapSizes;
use nodeport_proxy::ebpf::render::{Algorithm, RenderConfig};

use super::UsageError;

/// Where the maps and links are pinned by default (under the host's bpffs, as Cilium pins
/// under `/sys/fs/bpf/tc/globals`).
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/nodeport";

/// eBPF mode flags. Map sizes apply when the maps are created: maps pinned by an earlier run
/// are taken over with their size, so a change takes effect once the pins are removed.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EbpfArgs {
    /// eBPF mode: bpffs directory where maps and links are pinned, so that a restarted proxy
    /// takes them over without a gap in traffic (a bpffs is mounted there when it is not on
    /// one) [default: /sys/fs/bpf/nodeport].
    #[arg(long, value_name = "DIR")]
    ebpf_pin_root: Option<PathBuf>,
    /// eBPF mode: cgroup v2 directory whose processes (pods, node daemons) get the socket
    /// programs that serve ClusterIPs at connect() [default: the root of the cgroup v2
    /// hierarchy, from /proc/self/mountinfo].
    #[arg(long, value_name = "DIR")]
    ebpf_cgroup_root: Option<PathBuf>,
    /// eBPF mode: how a new connection picks its backend: "random" (default) or "maglev"
    /// (consistent hashing of the connection's addresses and ports).
    #[arg(long, value_name = "random|maglev")]
    ebpf_lb_algorithm: Option<String>,
    /// eBPF mode: frontends (service address, port and scope) [default: 1048576, about
    /// 16 MiB at load plus 100 bytes per entry]. The service ports' names (np_svc_names, for
    /// nodeport trace) take half as many entries: 8 MiB at load with the default, plus 200
    /// bytes per service port and family.
    #[arg(long, value_name = "N")]
    ebpf_services_map_size: Option<String>,
    /// eBPF mode: backends, in the backend and membership maps alike [default: 2097152,
    /// about 32 MiB per map at load plus 100 bytes per entry].
    #[arg(long, value_name = "N")]
    ebpf_backends_map_size: Option<String>,
    /// eBPF mode: tracked connections, in the connection and reverse NAT maps alike (LRU,
    /// preallocated) [default: 524288, about 80 MiB per map].
    #[arg(long, value_name = "N")]
    ebpf_ct_map_size: Option<String>,
    /// eBPF mode: session affinity entries (LRU, preallocated) [default: 65536, about 8 MiB].
    #[arg(long, value_name = "N")]
    ebpf_affinity_map_size: Option<String>,
    /// eBPF mode: loadBalancerSourceRanges entries [default: 65536, about 100 bytes each as
    /// used].
    #[arg(long, value_name = "N")]
    ebpf_source_ranges_map_size: Option<String>,
    /// eBPF mode: Maglev tables, one per Service port with endpoints [default: 4096, 64 KiB
    /// per table as used].
    #[arg(long, value_name = "N")]
    ebpf_maglev_map_size: Option<String>,
    /// eBPF mode: sockets connected to a ClusterIP whose peer address is shown back (LRU,
    /// preallocated) [default: 131072, about 15 MiB].
    #[arg(long, value_name = "N")]
    ebpf_sockets_map_size: Option<String>,
}

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

/// A map size: a whole number from 1 to 2^31 (the kernel's limit on `max_entries` for
/// preallocated maps is memory, not a count; 2^31 keeps the sums in u32).
fn map_size(flag: &str, value: Option<&str>, default: u32) -> anyhow::Result<u32> {
    let Some(v) = value else {
        return Ok(default);
    };
    match v.trim().parse::<u32>() {
        Ok(n) if (1..=1 << 31).contains(&n) => Ok(n),
        _ => Err(usage(format!(
            "invalid value {v:?} for {flag}: must be a whole number from 1 to 2147483648"
        ))),
    }
}

/// Whether `dir` is a cgroup v2 directory (it has `cgroup.procs` and `cgroup.controllers`).
fn is_cgroup2(dir: &Path) -> bool {
    dir.join("cgroup.procs").is_file() && dir.join("cgroup.controllers").is_file()
}

impl EbpfArgs {
    /// The dataplane's configuration from the flags, else the file's `ebpf:` section, else
    /// the defaults. Bad values are usage errors naming the flag.
    pub fn config(&self, file: Option<&EbpfSection>) -> anyhow::Result<Config> {
        let file = file.cloned().unwrap_or_default();
        let algorithm = match self
            .ebpf_lb_algorithm
            .as_deref()
            .or(file.lb_algorithm.as_deref())
        {
            Some(v) => Algorithm::parse(v).ok_or_else(|| {
                usage(format!(
                    "invalid value {v:?} for --ebpf-lb-algorithm: must be random or maglev"
                ))
            })?,
            None => Algorithm::default(),
        };
        let d = MapSizes::default();
        let sizes = MapSizes {
            services: map_size(
                "--ebpf-services-map-size",
                self.ebpf_services_map_size.as_deref(),
                d.services,
            )?,
            backends: map_size(
                "--ebpf-backends-map-size",
                self.ebpf_backends_map_size.as_deref(),
                d.backends,
            )?,
            conntrack: map_size(
                "--ebpf-ct-map-size",
                self.ebpf_ct_map_size.as_deref(),
                d.conntrack,
            )?,
            affinity: map_size(
                "--ebpf-affinity-map-size",
                self.ebpf_affinity_map_size.as_deref(),
                d.affinity,
            )?,
            source_ranges: map_size(
                "--ebpf-source-ranges-map-size",
                self.ebpf_source_ranges_map_size.as_deref(),
                d.source_ranges,
            )?,
            maglev: map_size(
                "--ebpf-maglev-map-size",
                self.ebpf_maglev_map_size.as_deref(),
                d.maglev,
            )?,
            sockets: map_size(
                "--ebpf-sockets-map-size",
                self.ebpf_sockets_map_size.as_deref(),
                d.sockets,
            )?,
        };
        let pin_root = self
            .ebpf_pin_root
            .clone()
            .or(file.pin_root.map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_PIN_ROOT));
        if !pin_root.is_absolute() {
            return Err(usage(format!(
                "invalid value {:?} for --ebpf-pin-root: must be an absolute path",
                pin_root.display().to_string()
            )));
        }
        let cgroup_root = match self
            .ebpf_cgroup_root
            .clone()
            .or(file.cgroup_root.map(PathBuf::from))
        {
            Some(dir) => {
                if !is_cgroup2(&dir) {
                    return Err(usage(format!(
                        "invalid value {:?} for --ebpf-cgroup-root: not a cgroup v2 directory",
                        dir.display().to_string()
                    )));
                }
                dir
            }
            None => dataplane::cgroup2_mount().ok_or_else(|| {
                usage(
                    "--ebpf-cgroup-root: no cgroup v2 hierarchy is mounted (none in \
                     /proc/self/mountinfo); mount one or give the flag",
                )
            })?,
        };
        Ok(Config {
            sizes,
            render: RenderConfig {
                algorithm,
                fib_forward: true,
                ..RenderConfig::default()
            },
            pin_root: Some(pin_root),
            cgroup_root: Some(cgroup_root),
            ..Config::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_sizes_must_be_whole_numbers_from_one() {
        assert_eq!(map_size("--x", None, 7).unwrap(), 7);
        assert_eq!(map_size("--x", Some("4096"), 7).unwrap(), 4096);
        for bad in ["0", "-1", "1k", "", "4294967295"] {
            let e = map_size("--x", Some(bad), 7).unwrap_err().to_string();
            assert!(e.contains("--x") && e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn flags_win_over_the_file_and_the_defaults_are_the_dataplanes() {
        let dir = tempfile::tempdir().unwrap();
        let cgroup = dir.path().join("cg");
        std::fs::create_dir(&cgroup).unwrap();
        std::fs::write(cgroup.join("cgroup.procs"), "").unwrap();
        std::fs::write(cgroup.join("cgroup.controllers"), "").unwrap();
        let args = EbpfArgs {
            ebpf_lb_algorithm: Some("maglev".into()),
            ebpf_ct_map_size: Some("1024".into()),
            ebpf_cgroup_root: Some(cgroup.clone()),
            ..EbpfArgs::default()
        };
        let file = EbpfSection {
            pin_root: Some("/sys/fs/bpf/np-file".into()),
            lb_algorithm: Some("random".into()),
            ..EbpfSection::default()
        };
        let c = args.config(Some(&file)).unwrap();
        assert_eq!(c.render.algorithm, Algorithm::Maglev);
        assert!(c.render.fib_forward);
        assert_eq!(c.sizes.conntrack, 1024);
        assert_eq!(c.sizes.services, MapSizes::default().services);
        assert_eq!(c.pin_root, Some(PathBuf::from("/sys/fs/bpf/np-file")));
        assert_eq!(c.cgroup_root, Some(cgroup));
        let bad = EbpfArgs {
            ebpf_cgroup_root: Some(dir.path().to_path_buf()),
            ..EbpfArgs::default()
        };
        let e = bad.config(None).unwrap_err().to_string();
        assert!(e.contains("--ebpf-cgroup-root"), "{e}");
    }
}
