//! nftables backend: kube-proxy's nftables mode, in two layouts (`--nftables-layout`).
//!
//! # Layouts
//!
//! * **flat** (the default, [`flat`]): the base chains, hooks, priorities and helper chains
//!   below, plus four fixed `pick-` chains; every Service port and endpoint is an element of
//!   a named set or data map (`service-endpoints`, `nodeport-endpoints`, `masquerade-ips`,
//!   `no-endpoint-services`, `firewall-allow`, ...). The chains and rules do not depend on
//!   the Services, so a Service or endpoint change is element operations only, which the
//!   kernel commits without validating the chain graph: about the same cost at 10 Services
//!   as at 100,000. Endpoint choice is exact (1/n) up to 64 endpoints, within 1 % above.
//!   Session affinity is two dynamic maps per timeout (client → endpoint); IPv6 ports with
//!   affinity keep kube-proxy's chains (reached through `service-ips` / `service-nodeports`,
//!   which hold only theirs), as nft 1.0.6 cannot write the IPv6 map update.
//! * **kube-proxy**: kube-proxy 1.33's layout, described below, chain for chain, to compare
//!   with a kube-proxy node. Every change that adds a rule makes the kernel walk all its
//!   chains (`shared/reference/notes/nftables-kernel-costs.md`).
//!
//! Both layouts share the desired state, the applier (an owner contributes chains, sets and
//! elements; in the flat layout a Service port contributes only elements), the netlink
//! kernel and the tracer. Restarting with the other layout takes the table over in one
//! transaction (the other layout's sets re-created or deleted, its chains flushed, then
//! deleted).
//!
//! # Tables, hooks and priorities
//!
//! One table per family, `ip kube-proxy` and `ip6 kube-proxy` (comment `rules for
//! kube-proxy`); nothing else on the host is touched. The base chains are kube-proxy's GA ones
//! (v1.33+, see `shared/reference/notes/kube-proxy.md` §2), in both layouts; the rest of this
//! section describes kube-proxy's layout:
//!
//! | base chain | type | hook | priority | jumps to |
//! | --- | --- | --- | --- | --- |
//! | `filter-prerouting-pre-dnat` | filter | prerouting | dstnat - 10 | `firewall-check` (new) |
//! | `filter-output-pre-dnat` | filter | output | -110 | `firewall-check` (new) |
//! | `filter-input` | filter | input | filter | `localnet-check` (with localhost NodePorts, every packet), `nodeport-endpoints-check`, `service-endpoints-check` (new) |
//! | `filter-forward` | filter | forward | filter | `service-endpoints-check`, `cluster-ips-check` (new) |
//! | `filter-output` | filter | output | filter | `service-endpoints-check`, `cluster-ips-check` (new) |
//! | `nat-prerouting` | nat | prerouting | dstnat | `services` |
//! | `nat-output` | nat | output | -100 (dstnat) | `services` |
//! | `nat-postrouting` | nat | postrouting | srcnat | `masquerading` |
//!
//! `services` looks the packet up in `service-ips` (`daddr . proto . port` of ClusterIPs,
//! external IPs, load-balancer IPs) and, for `nodeport-ips` destinations (or every local
//! address with `--nodeport-addresses 0.0.0.0/0`), in `service-nodeports` (`proto . port`).
//! Each service port has `service-<H>` (Cluster policy), `local-<H>` (Local policy),
//! `external-<H>` (NodePort/external/LB entry: masquerade, or eTP=Local short-circuits),
//! `firewall-<H>` (LoadBalancerSourceRanges) and one `endpoint-<E>` per endpoint, which marks
//! hairpin traffic, records session affinity in `affinity-<E>` and DNATs. Packets to a service
//! without usable endpoints are rejected (or dropped, for a Local policy with no local
//! endpoint) by the filter chains through `no-endpoint-services`/`no-endpoint-nodeports`;
//! unused ports of ClusterIPs are rejected and unallocated ClusterIPs dropped by
//! `cluster-ips-check`. Masquerading is a mark (`0x4000`, `--masquerade-bit`) set by
//! `mark-for-masquerade` and acted on in `masquerading`.
//!
//! Localhost NodePorts (ours; upstream's nftables mode has none): when a
//! `--nodeport-addresses` CIDR such as `127.0.0.0/8` selects `127.0.0.1`, it goes into
//! `nodeport-ips`, the proxy sets `net.ipv4.conf.all.route_localnet=1`, and `filter-input`
//! first jumps (every packet) to `localnet-check`, which drops packets to 127.0.0.0/8 from
//! non-loopback sources unless they are established, related or DNATed: kube-proxy's
//! iptables CVE-2020-8558 guard, see `render::localhost_nodeports`.
//!
//! # Contract with other tools
//!
//! As kube-proxy's README states it: DNAT happens in `type nat` chains at `priority dstnat`
//! on prerouting and output; masquerade in `type nat hook postrouting priority srcnat`;
//! no-endpoint drops and rejects in `type filter` chains on input, forward and output (a
//! `reject` is not allowed in prerouting on kernels before 5.9). Other tools may add their
//! own tables around these priorities. The mark bit is not API. An `accept` here does not
//! override another table's `drop`.
//!
//! # Rule forms that scale
//!
//! kube-proxy picks an endpoint with `numgen random mod N vmap { 0 : goto a, 1 : goto b }`,
//! an anonymous map per service chain, which `nft` loads in superlinear time (22-35 s for
//! 10,000 services on this machine, against 0.45 s for the same chains with a named map).
//! Here the service chain holds a cascade of plain rules instead: rule `i` of `n` is
//! `numgen random mod (n-i) 0 goto endpoint-i` and the last a plain `goto`, so each endpoint
//! is chosen with probability 1/n and loading stays linear. Names and every other rule are
//! kube-proxy's. [`EndpointChoice::InlineVmap`](crate::config::EndpointChoice) renders
//! kube-proxy's form, for the benchmark.
//!
//! # Applying
//!
//! One transaction per sync, all or nothing. The default kernel interface is
//! [`netlink::NetlinkKernel`]: nf_tables netlink batches encoded exactly as `nft` encodes
//! them (tests compare `nft list ruleset` of both), so a change costs no `nft` process and no
//! dump of the whole table; forms it does not encode (anonymous sets) go through `nft -f`.
//! [`apply::NftCommand`] pipes the same transaction to `nft -f -` (knftables' way; the
//! program and leading arguments are configurable, e.g. `ip netns exec <ns> nft`). Partial
//! syncs rewrite only chains whose content changed and touch only changed map elements
//! (each key settled once per transaction, however many owners share it); a shared set whose
//! definition changes (a flat set outgrowing its `size`) makes the sync full; stale chains are flushed, then deleted in a second transaction; any commit by someone else
//! (the nf_tables generation moved) makes the next sync a full rewrite; start-up takes over
//! an existing table without deleting it. Figures: `docs/BENCHMARKS.md`, "Proxy (nftables)".
//!
//! # Files
//!
//! [`names`] (object names), [`mod@render`] (desired state → [`ruleset::Ruleset`], pure),
//! [`flat`] (the flat layout's rendering, pure),
//! [`ruleset`] (the structured ruleset, transactions and their `nft -f` text), [`apply`]
//! (the [`apply::Kernel`] trait, `nft` runner, fake, and the applier that computes partial
//! and full transactions), `record` (the applier's compact record of owners and claims),
//! [`netlink`] (the netlink kernel), [`tracer`] (evaluates a ruleset for a packet),
//! [`listing`] (`nft -j list table` read back for the tracer), [`recover`] (the Service ports
//! a table names, for a trace without objects).

pub mod apply;
pub mod flat;
pub mod listing;
pub mod names;
pub mod netlink;
mod record;
pub mod recover;
pub mod render;
pub mod ruleset;
pub mod tracer;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod apply_props;
#[cfg(test)]
mod flat_tests;

pub use render::render;
