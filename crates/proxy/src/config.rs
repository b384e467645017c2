//! Node-level configuration every backend renders with.

use ipnet::IpNet;

use crate::model::IpFamily;

/// How a service chain picks one of its endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointChoice {
    /// A cascade of plain rules: rule `i` of `n` is `numgen random mod (n-i) 0 goto
    /// endpoint-i`, the last a plain `goto`. Each endpoint gets 1/n, and loading stays linear
    /// (the default; see the nftables module documentation for the measurements).
    #[default]
    Cascade,
    /// kube-proxy's `numgen random mod n vmap { 0 : goto ..., 1 : goto ... }`: one anonymous
    /// map per service chain, which `nft` loads in superlinear time. Kept to measure against.
    InlineVmap,
}

/// The nftables mode's table layout (`--nftables-layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NftablesLayout {
    /// A fixed, small set of chains and rules; every Service and endpoint is an element of
    /// a named set or map, so that a change is element operations only and costs the same
    /// at 100 Services as at 100,000 (the default; see the nftables module documentation).
    #[default]
    Flat,
    /// kube-proxy 1.33's layout, chain for chain: one chain per Service port and one per
    /// endpoint. For comparing a node's rules with a kube-proxy node's.
    KubeProxy,
}

impl NftablesLayout {
    /// Parses `flat` or `kube-proxy`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "flat" => Some(NftablesLayout::Flat),
            "kube-proxy" => Some(NftablesLayout::KubeProxy),
            _ => None,
        }
    }

    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            NftablesLayout::Flat => "flat",
            NftablesLayout::KubeProxy => "kube-proxy",
        }
    }
}

/// The dataplane (`--proxy-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProxyMode {
    /// nftables (the default, kube-proxy's recommended mode).
    #[default]
    Nftables,
    /// iptables (`nat` and `filter` tables, `iptables-restore`).
    Iptables,
    /// IPVS: deprecated upstream (KEP-5495); rendered only.
    Ipvs,
    /// eBPF: tc and cgroup socket programs looking Services up in BPF maps (no rules).
    Ebpf,
}

impl ProxyMode {
    /// Parses `nftables`, `iptables` or `ipvs` (kube-proxy's values), or `ebpf` (ours).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "nftables" => Some(ProxyMode::Nftables),
            "iptables" => Some(ProxyMode::Iptables),
            "ipvs" => Some(ProxyMode::Ipvs),
            "ebpf" => Some(ProxyMode::Ebpf),
            _ => None,
        }
    }

    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Nftables => "nftables",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Ebpf => "ebpf",
        }
    }
}

/// Configuration that shapes the rendered rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// `--masquerade-bit`: the mark bit set on packets to masquerade (default 14 → 0x4000).
    pub masquerade_bit: u8,
    /// `--masquerade-all`: masquerade every packet sent to a ClusterIP (default false).
    pub masquerade_all: bool,
    /// `--cluster-cidr`: the pod ranges, one per family at most. Traffic from outside them is
    /// "not local" and masqueraded when sent to a ClusterIP (kube-proxy's ClusterCIDR local
    /// traffic detector, its default `--detect-local-mode`). Empty: no detection.
    pub cluster_cidrs: Vec<IpNet>,
    /// How service chains pick an endpoint (kube-proxy layout).
    pub endpoint_choice: EndpointChoice,
    /// `--nftables-layout` (default flat).
    pub nftables_layout: NftablesLayout,
    /// Flat layout: the largest `size` a set or map is given (default 16,777,216). Each is
    /// sized at twice what its Service ports can fill, rounded up to a power of two, at least
    /// 4,096 and at most this; the kernel preallocates hash buckets for a set's size
    /// (about 17 bytes an element), so sizes follow the cluster rather than start huge. A
    /// set that would hold more is refused by the kernel as full; the old rules stay and
    /// `/healthz` and `kubeproxy_sync_proxy_rules_nftables_set_full` say which.
    pub flat_max_set_size: u32,
    /// Flat layout: every element carries its Service port's `namespace/name:port` as a
    /// comment (default true; what they cost is in `docs/BENCHMARKS.md`).
    pub flat_comments: bool,
    /// `--iptables-localhost-nodeports` (default true, kube-proxy's): in iptables mode,
    /// NodePorts also answer on 127.0.0.1 when every IPv4 address accepts NodePorts (the
    /// iptables mode's default). The nftables mode never serves them.
    pub localhost_nodeports: bool,
    /// `net.ipv4.conf.all.route_localnet` is 1 on this node, set by this proxy
    /// or an earlier run for localhost NodePorts (or by someone else). The sysctl is never
    /// reset, so the CVE-2020-8558 guard must stay while it is on, even once
    /// `--nodeport-addresses` no longer selects 127.0.0.1.
    pub route_localnet: bool,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            // kube-proxy's default masqueradeBit (defaults.go).
            masquerade_bit: 14,
            masquerade_all: false,
            cluster_cidrs: Vec::new(),
            endpoint_choice: EndpointChoice::default(),
            nftables_layout: NftablesLayout::default(),
            flat_max_set_size: 1 << 24,
            flat_comments: true,
            // kube-proxy's default (iptables.localhostNodePorts).
            localhost_nodeports: true,
            route_localnet: false,
        }
    }
}

impl NodeConfig {
    /// The masquerade mark: `1 << masquerade_bit`.
    pub fn masquerade_mark(&self) -> u32 {
        1u32 << self.masquerade_bit.min(31)
    }

    /// The pod range of a family, if local traffic detection is on for it.
    pub fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        self.cluster_cidrs
            .iter()
            .copied()
            .find(|c| IpFamily::of_net(c) == family)
    }
}

/// A `KubeProxyConfiguration` file (`--config`), the fields `nodeport proxy` understands.
/// Both the v1alpha1 per-mode fields (`nftables.syncPeriod`, ...) and the newer top-level
/// ones are read; unknown fields are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    /// `kubeproxy.config.k8s.io/v1alpha1`.
    pub api_version: Option<String>,
    /// `KubeProxyConfiguration`.
    pub kind: Option<String>,
    /// `clientConnection.kubeconfig`.
    pub client_connection: Option<ClientConnection>,
    /// `hostnameOverride`.
    pub hostname_override: Option<String>,
    /// `mode`.
    pub mode: Option<String>,
    /// `nodePortAddresses`.
    pub node_port_addresses: Option<Vec<String>>,
    /// `clusterCIDR` (comma-separated).
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    /// `healthzBindAddress`.
    pub healthz_bind_address: Option<String>,
    /// `metricsBindAddress`.
    pub metrics_bind_address: Option<String>,
    /// `syncPeriod` (newer top-level field).
    pub sync_period: Option<String>,
    /// `minSyncPeriod` (newer top-level field).
    pub min_sync_period: Option<String>,
    /// `nftables` section.
    pub nftables: Option<ModeSection>,
    /// `iptables` section (read for `masqueradeAll`/`masqueradeBit` as kube-proxy does).
    pub iptables: Option<ModeSection>,
    /// `ebpf` section (ours: kube-proxy has no eBPF mode).
    pub ebpf: Option<EbpfSection>,
}

/// The `ebpf:` section, the file form of the `--ebpf-*` flags.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EbpfSection {
    /// `pinRoot` (`--ebpf-pin-root`).
    pub pin_root: Option<String>,
    /// `cgroupRoot` (`--ebpf-cgroup-root`).
    pub cgroup_root: Option<String>,
    /// `lbAlgorithm` (`--ebpf-lb-algorithm`): `random` or `maglev`.
    pub lb_algorithm: Option<String>,
}

/// `clientConnection`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnection {
    /// Path of the kubeconfig file.
    pub kubeconfig: Option<String>,
}

/// A per-mode section (`nftables:` / `iptables:`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModeSection {
    /// `masqueradeAll`.
    pub masquerade_all: Option<bool>,
    /// `masqueradeBit`.
    pub masquerade_bit: Option<u8>,
    /// `syncPeriod`.
    pub sync_period: Option<String>,
    /// `minSyncPeriod`.
    pub min_sync_period: Option<String>,
    /// `localhostNodePorts` (iptables section).
    pub localhost_node_ports: Option<bool>,
    /// `layout` (nftables section, ours): `flat` or `kube-proxy`, as `--nftables-layout`.
    pub layout: Option<String>,
}

/// A bad configuration file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not YAML of the expected shape.
    #[error("invalid KubeProxyConfiguration")]
    Yaml(#[source] yaml_serde::Error),
    /// Another kind of object.
    #[error("kind {0:?} is not KubeProxyConfiguration")]
    WrongKind(String),
}

impl KubeProxyConfiguration {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Self, Error> {
        let c: KubeProxyConfiguration = yaml_serde::from_str(text).map_err(Error::Yaml)?;
        match c.kind.as_deref() {
            None | Some("KubeProxyConfiguration") => Ok(c),
            Some(other) => Err(Error::WrongKind(other.to_string())),
        }
    }

    /// `masqueradeAll`, from the nftables section, else the iptables one.
    pub fn masquerade_all(&self) -> Option<bool> {
        self.nftables
            .as_ref()
            .and_then(|s| s.masquerade_all)
            .or_else(|| self.iptables.as_ref().and_then(|s| s.masquerade_all))
    }

    /// `masqueradeBit`.
    pub fn masquerade_bit(&self) -> Option<u8> {
        self.nftables
            .as_ref()
            .and_then(|s| s.masquerade_bit)
            .or_else(|| self.iptables.as_ref().and_then(|s| s.masquerade_bit))
    }

    /// `syncPeriod`: top-level, else the nftables section's, else the iptables one's.
    pub fn sync_period(&self) -> Option<&str> {
        self.sync_period.as_deref().or_else(|| {
            [&self.nftables, &self.iptables]
                .into_iter()
                .flatten()
                .find_map(|s| s.sync_period.as_deref())
        })
    }

    /// `minSyncPeriod`: top-level, else the nftables section's, else the iptables one's.
    pub fn min_sync_period(&self) -> Option<&str> {
        self.min_sync_period.as_deref().or_else(|| {
            [&self.nftables, &self.iptables]
                .into_iter()
                .flatten()
                .find_map(|s| s.min_sync_period.as_deref())
        })
    }

    /// `nftables.layout`.
    pub fn nftables_layout(&self) -> Option<&str> {
        self.nftables.as_ref().and_then(|s| s.layout.as_deref())
    }

    /// `iptables.localhostNodePorts`.
    pub fn localhost_node_ports(&self) -> Option<bool> {
        self.iptables.as_ref().and_then(|s| s.localhost_node_ports)
    }
}

/// Parses a Go duration (`30s`, `1m0s`, `500ms`, `1h30m`, `1.5s`).
pub fn parse_go_duration(s: &str) -> Option<std::time::Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(std::time::Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let value: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    Some(std::time::Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse_as_kube_proxy_writes_them() {
        use std::time::Duration;
        assert_eq!(parse_go_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_go_duration("1m0s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_go_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration("10"), None);
        assert_eq!(parse_go_duration("abc"), None);
    }

    #[test]
    fn kube_proxy_configuration_files_are_read() {
        let c = KubeProxyConfiguration::parse(
            r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clusterCIDR: 10.244.0.0/16
nodePortAddresses: [192.0.2.0/24]
healthzBindAddress: 0.0.0.0:10256
clientConnection: {kubeconfig: /etc/kube/proxy.conf}
nftables: {masqueradeAll: true, syncPeriod: 1m0s, minSyncPeriod: 2s, layout: kube-proxy}
conntrack: {maxPerCore: 32768}
"#,
        )
        .unwrap();
        assert_eq!(c.ebpf, None);
        assert_eq!(c.cluster_cidr.as_deref(), Some("10.244.0.0/16"));
        assert_eq!(c.masquerade_all(), Some(true));
        assert_eq!(c.sync_period(), Some("1m0s"));
        assert_eq!(c.nftables_layout(), Some("kube-proxy"));
        assert_eq!(
            c.client_connection.unwrap().kubeconfig.as_deref(),
            Some("/etc/kube/proxy.conf")
        );
        assert!(KubeProxyConfiguration::parse("kind: Pod").is_err());
    }

    #[test]
    fn the_ebpf_mode_and_its_section_are_read_from_the_file() {
        let c = KubeProxyConfiguration::parse(
            "kind: KubeProxyConfiguration\nmode: ebpf\n\
             ebpf: {pinRoot: /sys/fs/bpf/np, cgroupRoot: /sys/fs/cgroup/k, lbAlgorithm: maglev}\n",
        )
        .unwrap();
        assert_eq!(
            c.mode.as_deref().and_then(ProxyMode::parse),
            Some(ProxyMode::Ebpf)
        );
        let e = c.ebpf.unwrap();
        assert_eq!(e.pin_root.as_deref(), Some("/sys/fs/bpf/np"));
        assert_eq!(e.cgroup_root.as_deref(), Some("/sys/fs/cgroup/k"));
        assert_eq!(e.lb_algorithm.as_deref(), Some("maglev"));
        assert_eq!(ProxyMode::Ebpf.as_str(), "ebpf");
    }
}
