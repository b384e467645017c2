//! What the IPVS mode programs, as data: virtual servers with their real servers, ipsets
//! with their entries, the companion iptables rules, and their text (`ipvsadm -S -n`,
//! `ipset save`, `iptables-restore` forms).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use super::names::{DUMMY_DEVICE, SetId};
use crate::iptables::ruleset::Restore;
use crate::model::{IpFamily, Protocol};

/// An IPVS virtual server (`ipvsadm -A`) and its real servers (`ipvsadm -a`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualServer {
    /// Protocol (`-t`, `-u`, `--sctp-service`).
    pub protocol: Protocol,
    /// Address and port.
    pub address: SocketAddr,
    /// Scheduler (`rr`).
    pub scheduler: &'static str,
    /// `-p <seconds>`: persistence for `sessionAffinity: ClientIP`.
    pub persistence: Option<u32>,
    /// Real servers, forwarded by masquerading (`-m`) with weight 1.
    pub reals: Vec<SocketAddr>,
}

fn service_flag(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "-t",
        Protocol::Udp => "-u",
        Protocol::Sctp => "--sctp-service",
    }
}

impl VirtualServer {
    /// The `ipvsadm -S -n` lines of this virtual server.
    pub fn write(&self, out: &mut String) {
        let flag = service_flag(self.protocol);
        let _ = write!(out, "-A {flag} {} -s {}", self.address, self.scheduler);
        if let Some(p) = self.persistence {
            let _ = write!(out, " -p {p}");
        }
        out.push('\n');
        for r in &self.reals {
            let _ = writeln!(out, "-a {flag} {} -r {r} -m -w 1", self.address);
        }
    }
}

/// An ipset and its entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpSet {
    /// Which set.
    pub id: SetId,
    /// Its entries in `ipset` syntax (`10.96.0.10,tcp:80`, `30080`, ...), sorted.
    pub entries: BTreeSet<String>,
}

impl IpSet {
    /// Whether the set holds nothing (kube-proxy writes no rule for an empty set).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `ipset save` lines (`create` as kube-proxy creates it, then one `add` per entry).
    pub fn write(&self, family: IpFamily, out: &mut String) {
        let name = self.id.name(family);
        let kind = self.id.set_type();
        let _ = write!(out, "create {name} {}", kind.as_str());
        match kind {
            super::names::SetType::BitmapPort => out.push_str(" range 0-65535"),
            _ => {
                let fam = match family {
                    IpFamily::V4 => "inet",
                    IpFamily::V6 => "inet6",
                };
                let _ = write!(out, " family {fam} hashsize 1024 maxelem 65536");
            }
        }
        out.push('\n');
        for e in &self.entries {
            let _ = writeln!(out, "add {name} {e}");
        }
    }
}

/// An `ip,proto:port` entry.
pub fn ip_port(ip: IpAddr, p: Protocol, port: u16) -> String {
    format!("{ip},{}:{port}", p.as_lower())
}

/// Everything of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyIpvs {
    /// Family.
    pub family: IpFamily,
    /// Virtual servers, in service-port order, ClusterIP, external IPs, load-balancer IPs,
    /// then one per NodePort address.
    pub virtual_servers: Vec<VirtualServer>,
    /// Every set, in kube-proxy's creation order.
    pub sets: BTreeMap<SetId, IpSet>,
    /// Addresses bound to `kube-ipvs0` (ClusterIPs, external IPs, load-balancer IPs).
    pub bound: BTreeSet<IpAddr>,
    /// The companion iptables rules.
    pub iptables: Restore,
}

impl FamilyIpvs {
    /// The set with `id`.
    pub fn set(&self, id: SetId) -> &IpSet {
        &self.sets[&id]
    }

    /// The virtual server at `address`, if any.
    pub fn virtual_server(
        &self,
        protocol: Protocol,
        address: SocketAddr,
    ) -> Option<&VirtualServer> {
        self.virtual_servers
            .iter()
            .find(|v| v.protocol == protocol && v.address == address)
    }

    /// The text `nodeport render --proxy-mode ipvs` prints for this family: `ipvsadm -S -n`
    /// lines, the `kube-ipvs0` addresses, `ipset save` lines, and the `iptables-restore`
    /// input of the companion rules, each part under a comment line naming it.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let (ipt, suffix) = match self.family {
            IpFamily::V4 => ("iptables", 32),
            IpFamily::V6 => ("ip6tables", 128),
        };
        let _ = writeln!(out, "# ipvsadm -S -n ({})", self.family.as_str());
        for vs in &self.virtual_servers {
            vs.write(&mut out);
        }
        let _ = writeln!(
            out,
            "# ip addr show {DUMMY_DEVICE} ({})",
            self.family.as_str()
        );
        for ip in &self.bound {
            let _ = writeln!(out, "{ip}/{suffix}");
        }
        let _ = writeln!(out, "# ipset save ({})", self.family.as_str());
        for id in SetId::ALL {
            self.sets[&id].write(self.family, &mut out);
        }
        let _ = writeln!(out, "# {ipt}-restore --noflush");
        out.push_str(&self.iptables.text());
        out
    }
}

/// Everything the IPVS mode would program.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IpvsRuleset {
    /// One entry per enabled family, IPv4 first.
    pub families: Vec<FamilyIpvs>,
}

impl IpvsRuleset {
    /// The state of one family.
    pub fn family(&self, family: IpFamily) -> Option<&FamilyIpvs> {
        self.families.iter().find(|f| f.family == family)
    }

    /// Every family's text.
    pub fn text(&self) -> String {
        self.families.iter().map(FamilyIpvs::text).collect()
    }
}
