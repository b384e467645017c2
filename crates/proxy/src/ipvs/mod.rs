//! IPVS backend (rendering only): what kube-proxy's IPVS mode would program for the desired
//! state, name by name.
//!
//! **IPVS mode is deprecated upstream** (KEP-5495: deprecated in Kubernetes 1.35, the
//! `KubeProxyIPVS` feature gate off by default from 1.40) and the kernels this project runs
//! on have no IPVS. It is therefore tested only at the level of what it would program:
//! [`render`] is golden-tested, `nodeport render --proxy-mode ipvs` prints it, and `nodeport
//! proxy --proxy-mode ipvs` checks `/proc/net/ip_vs` ([`apply::check_kernel`]) and stops
//! at once with a message; nothing here touches the kernel.
//!
//! # What the IPVS mode programs
//!
//! Per family (as reference 000 lists a node):
//!
//! * **Virtual servers** (`ipvsadm -S -n` form), scheduler `rr`, real servers forwarded by
//!   masquerading (`-m`, weight 1), persistence `-p <timeout>` for `sessionAffinity:
//!   ClientIP`: one per ClusterIP, external IP and load-balancer IP, and one per NodePort
//!   address for each NodePort (every node IP of the family with `--nodeport-addresses`
//!   matching all). Local policies use the local endpoints, or the cluster ones when there
//!   is no local endpoint (kubernetes#97081). The service addresses are bound to the dummy
//!   interface `kube-ipvs0`.
//! * **ipsets** (`ipset save` form), kube-proxy's names and types: `KUBE-CLUSTER-IP`
//!   (`hash:ip,port`), `KUBE-NODE-PORT-TCP`/`-UDP` (`bitmap:port`), `KUBE-LOOP-BACK`
//!   (`hash:ip,port,ip`, hairpin), `KUBE-LOAD-BALANCER*`, `KUBE-EXTERNAL-IP*`,
//!   `KUBE-HEALTH-CHECK-NODE-PORT`; IPv6 sets are named `KUBE-6-...`.
//! * **Companion iptables rules** (`iptables-restore` form): masquerade decisions by set
//!   membership (`-m set --match-set KUBE-CLUSTER-IP dst,dst ! -s <pod CIDR> -j
//!   KUBE-MARK-MASQ`, `KUBE-NODE-PORT` for local destinations), the source-range firewall,
//!   forwarding and health-check accepts, `KUBE-POSTROUTING` masquerading.
//!
//! Left out: the `KUBE-IPVS-IPS` set and `KUBE-IPVS-FILTER` chains of the newest releases
//! (they reject traffic to unused ports of service VIPs), and IPVS timeouts and sysctls.
//!
//! # Files
//!
//! [`names`] (set, chain and device names), [`mod@render`] (desired state →
//! [`ruleset::IpvsRuleset`], pure), [`ruleset`] (virtual servers, sets and their text),
//! [`apply`] (the kernel check). There is no tracer: IPVS is not evaluated here.

pub mod apply;
pub mod names;
pub mod render;
pub mod ruleset;

#[cfg(test)]
mod tests;

pub use render::render;
