//! eBPF backend (`--proxy-mode ebpf`): Services served by tc and cgroup socket
//! programs looking them up in BPF maps, with no iptables or nftables rules.
//!
//! # Programs (`bpf/nodeport.c`, compiled by `build.rs` with clang, loaded with aya 0.14)
//!
//! | program | hook | does |
//! | --- | --- | --- |
//! | `np_tc_ingress` | tc ingress, interfaces carrying NodePort addresses and those the node routes endpoints (local or remote) through | reverses replies (`np_nat`); translates known connections (`np_ct`); opens connections to external frontends (`np_services`, scope external): source ranges, affinity, random or Maglev choice, DNAT, SNAT to the node under the Cluster policy or for remote backends; forwards with `bpf_fib_lookup` + `bpf_redirect_neigh`; no endpoints: ICMP (ICMPv6) port unreachable, or drop under a Local policy |
//! | `np_tc_egress` | tc egress, same interfaces | reverses replies of local backends (`np_nat`) |
//! | `np_connect4/6`, `np_sendmsg4/6` | cgroup socket hooks | rewrite the destination of sockets to a backend (scope internal: ClusterIPs, and NodePorts, external and load-balancer IPs reached from the node; a load-balancer IP with source ranges only for a socket bound to a source inside them, any other left to tc) |
//! | `np_recvmsg4/6`, `np_getpeername4/6` | cgroup socket hooks | show the service address back to the application (`np_sock_rev`) |
//!
//! # Maps ([`maps`])
//!
//! Frontends are keyed by (address, port, protocol, scope) and carry a stable service id
//! (affinity, source ranges) and a backend set id with its count. A changed backend set is
//! written under a fresh id (backends, membership, Maglev table) before the frontend is
//! switched to it in one map update, as Calico does: a packet sees the old set or the new
//! one, never half of one. Conntrack (`np_ct`) and reverse NAT/SNAT (`np_nat`) are our own
//! LRU hashes, as in Cilium and Calico (aya 0.14 cannot load the kernel conntrack kfuncs).
//!
//! # Files
//!
//! [`maps`] (keys and values, byte for byte), [`maglev`] (consistent hashing tables),
//! [`programs`] (the object, loading, typed map access), [`batch`] (batched map operations
//! through the raw `bpf()` call, in one small `unsafe` block), [`mod@render`]
//! (desired state → frontends and backend sets, pure), [`apply`] (the applier: map writes
//! staged and issued in order, one batched call per map and step; sweep; conntrack
//! collector), [`dataplane`] (one node's dataplane: loading, pins, cgroup and tc attachment
//! following the NodePort addresses and the endpoints' routes, fill levels), [`routes`]
//! (route dumps and look-ups over rtnetlink), [`sockets`] (closing UDP sockets connected to
//! removed backends), [`tracer`] (what the programs do with a new connection, evaluated over
//! the rendered maps), [`recover`] (what the maps say of their Service ports, named by
//! `np_svc_names`, for a trace without objects).
//!
//! # Not handled by the programs
//!
//! IPv4 options and IPv6 extension headers other than the fragment header (passed
//! untranslated), SCTP (its CRC32c cannot be patched incrementally), an IP fragment that
//! arrives before its datagram's first fragment (passed untranslated: the later fragments
//! take the first one's ports from `np_frags`, as Cilium's fragment map does). (ICMP errors about translated connections are translated back, and
//! packets too big for their next hop answered with fragmentation needed: see the C
//! source's `np_icmp_error` and `np_frag_needed`.) SNAT
//! ports (32768–65535, Cilium's range) are not kept apart from the node's own ephemeral
//! ports: a connection of the node itself to a backend, from the very port a SNATed flow to
//! that backend uses, would have its replies taken for the SNATed flow's. Packets of pods
//! outside the dataplane's cgroup to a ClusterIP are served by tc only on interfaces the
//! programs are on (those carrying NodePort addresses and those routing endpoints).

pub mod apply;
pub mod batch;
pub mod dataplane;
pub mod maglev;
pub mod maps;
pub mod programs;
pub mod recover;
pub mod render;
pub mod routes;
pub mod sockets;
pub mod trace_events;
pub mod tracer;

#[cfg(test)]
mod tests;
