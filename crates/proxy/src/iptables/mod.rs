//! iptables backend: kube-proxy's iptables mode, chain by chain and comment by comment.
//!
//! # Tables, hooks and chains
//!
//! The rules live in the `nat` and `filter` tables of `iptables` (IPv4) and `ip6tables`
//! (IPv6), in chains named as kube-proxy names them (`pkg/proxy/iptables/proxier.go`; see
//! `shared/reference/notes/kube-proxy.md` §3 and reference 000 for a node's listing). Jumps
//! from the built-in chains, each prepended once (kube-proxy's `iptablesJumpChains`):
//!
//! | table | built-in chain | match | jumps to |
//! | --- | --- | --- | --- |
//! | nat | `PREROUTING`, `OUTPUT` | `kubernetes service portals` | `KUBE-SERVICES` |
//! | nat | `POSTROUTING` | `kubernetes postrouting rules` | `KUBE-POSTROUTING` |
//! | filter | `INPUT`, `FORWARD` | `--ctstate NEW`, `kubernetes externally-visible service portals` | `KUBE-EXTERNAL-SERVICES` |
//! | filter | `INPUT` | `kubernetes health check service ports` | `KUBE-NODEPORTS` |
//! | filter | `FORWARD`, `OUTPUT` | `--ctstate NEW`, `kubernetes service portals` | `KUBE-SERVICES` |
//! | filter | `FORWARD` | `kubernetes forwarding rules` | `KUBE-FORWARD` |
//! | filter | `INPUT`, `OUTPUT`, `FORWARD` | `--ctstate NEW`, `kubernetes load balancer firewall` | `KUBE-PROXY-FIREWALL` |
//! | filter | `INPUT`, `OUTPUT` | (kubelet's duplicate) | `KUBE-FIREWALL` |
//!
//! In `nat`, `KUBE-SERVICES` holds one rule per ClusterIP, external IP and load-balancer IP
//! (`-m comment --comment "ns/svc:port cluster IP" -m tcp -p tcp -d <ip> --dport <port>`),
//! walked in order, and last `KUBE-NODEPORTS` for local destinations (`-m addrtype
//! --dst-type LOCAL`, or one `-d <ip>` rule per `--nodeport-addresses` address). Each
//! service port has `KUBE-SVC-<H>` (Cluster policy: `-m statistic --mode random
//! --probability 1/(n-i)` to each endpoint, `-m recent` for session affinity),
//! `KUBE-SVL-<H>` (Local policy), `KUBE-EXT-<H>` (NodePort/external/LB entry: masquerade, or
//! the eTP=Local short-circuits), `KUBE-FW-<H>` (loadBalancerSourceRanges) and one
//! `KUBE-SEP-<H>` per endpoint (hairpin mark, DNAT). `KUBE-MARK-MASQ` sets the mark
//! (`0x004000`, `--masquerade-bit`), `KUBE-POSTROUTING` masquerades marked packets
//! (`--random-fully`). In `filter`, services without usable endpoints are rejected
//! (`KUBE-SERVICES`, `KUBE-EXTERNAL-SERVICES`) or dropped (Local policy without a local
//! endpoint), `KUBE-PROXY-FIREWALL` drops load-balancer traffic `KUBE-FW-` did not admit,
//! `KUBE-NODEPORTS` accepts health-check node ports, `KUBE-FORWARD` accepts marked and
//! established forwarded traffic. Hashes: `KUBE-SVC-` + 16 characters of base32(sha256(
//! `ns/name[:port]` + protocol)), `KUBE-SEP-` also hashing `ip:port` ([`crate::names`]).
//!
//! Unlike the nftables mode, the default `--nodeport-addresses` is every local address, and
//! with it (or with a CIDR such as `127.0.0.0/8` that selects `127.0.0.1`, which then gets
//! its own `-d 127.0.0.1` jump) NodePorts answer on `127.0.0.1` too
//! (`--iptables-localhost-nodeports`, default true): the proxy sets `net.ipv4.conf.all.route_localnet=1` and installs kube-proxy's
//! `KUBE-FIREWALL` guard against martian packets to 127/8 (CVE-2020-8558). As in kube-proxy's
//! iptables mode there is no rule for unused ports of ClusterIPs or unallocated ClusterIPs.
//!
//! # Contract with other tools
//!
//! Only chains named `KUBE-*` are written, with `iptables-restore --noflush`: other chains
//! and the other rules of the built-in chains stay as they are. Each run is one transaction
//! per table (`COMMIT`). The jumps are at the top of the built-in chains; tools that must see
//! packets first insert above them. `KUBE-PROXY-CANARY` in `mangle`, `nat` and `filter` is
//! ours: its disappearance means the tables were flushed (a firewalld reload), and the next
//! sync rewrites everything. The mark bit is not API. Both variants of the tools work
//! ([`apply::Variant`]), but one node must use one of them: `--iptables-variant auto` (the
//! default) picks them at start-up as kube-proxy's images do (iptables-wrappers: legacy when
//! only the legacy tables hold kubelet's or kube-proxy's chains; with no such chain anywhere,
//! legacy when the legacy tables hold more rules; else nft, [`apply::decide_variant`]);
//! `nft` or `legacy` force one. With thousands of Services,
//! `legacy` is the way around `iptables-nft-restore`'s near-quadratic restore time
//! ([`apply::VariantChoice`]).
//!
//! # Syncing
//!
//! As in kube-proxy, every sync rewrites the top-level chains, so a sync costs time
//! proportional to the number of Services even when one changed, and the first packet of a
//! connection walks `KUBE-SERVICES` rule by rule: both grow with the number of Services
//! (`docs/BENCHMARKS.md`, "nftables vs iptables"). Per service chains are rewritten only when
//! their content changed; chains that went away are flushed and deleted (`-X`) in the same
//! transaction, after every rule that referenced them was rewritten. Start-up takes over
//! existing chains without flushing the tables: the first sync is full (lists the tables,
//! declares and rewrites every chain, deletes stale ones). A failed restore leaves the
//! tables as they were, the sync is retried and `/healthz` turns unhealthy after twice the
//! sync period, as in the nftables mode. Above 1,000 endpoints the per-endpoint comments are
//! left out (kube-proxy's large cluster mode).
//!
//! # Files
//!
//! [`names`] (chain names), [`mod@render`] (desired state → [`ruleset::Ruleset`], pure),
//! [`ruleset`] (rules, restores and their text), [`apply`] (the [`apply::Kernel`] trait,
//! the `iptables` tools runner, a fake, and the applier), [`tracer`] (evaluates the chains for
//! a packet), [`save`] (`iptables-save` output read back for the tracer), [`recover`] (the
//! Service ports the chains' comments name, for a trace without objects).

pub mod apply;
pub mod names;
pub mod recover;
pub mod render;
pub mod ruleset;
pub mod save;
pub mod tracer;

#[cfg(test)]
mod tests;

pub use render::render;
