/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Map layouts of nodeport's eBPF dataplane, shared by the programs in nodeport.c.
 *
 * Every key and value is a packed little-endian C struct whose byte layout the Rust side
 * (crates/proxy/src/ebpf/maps.rs) encodes by hand, field by field: a change here needs the
 * same change there (the Rust tests compare the sizes the object's BTF declares).
 *
 * Addresses are 16 bytes in network order; IPv4 is IPv4-mapped IPv6 (::ffff:a.b.c.d), so one
 * set of maps serves both families. Ports are in network order, as they sit in the packet.
 */
#ifndef NODEPORT_H
#define NODEPORT_H

#include <linux/types.h>

/* Maglev lookup table size: prime, Cilium's default (M = 16381, about 160 backends per
 * service for at most 1% imbalance). Fixed: the table is one map value. */
#define NP_MAGLEV_M 16381

/* Frontend scopes: external traffic (tc on the node's interfaces: NodePorts, external and
 * load-balancer IPs, subject to externalTrafficPolicy) and internal traffic (socket hooks:
 * ClusterIPs under internalTrafficPolicy, and NodePorts, external and load-balancer IPs
 * reached from the node itself, which use the Cluster policy's endpoints as kube-proxy's
 * short-circuit does). */
#define NP_SCOPE_EXT 0
#define NP_SCOPE_INT 1

/* Frontend flags. */
#define NP_SVC_REJECT 0x1    /* no endpoints: ICMP port unreachable (kube-proxy's reject) */
#define NP_SVC_DROP 0x2      /* no endpoints and the policy is Local: drop */
#define NP_SVC_AFFINITY 0x4  /* sessionAffinity ClientIP, timeout in affinity_timeout */
#define NP_SVC_MAGLEV 0x8    /* pick through np_maglev rather than at random */
#define NP_SVC_RANGES 0x10   /* loadBalancerSourceRanges: the source must be in np_src_ranges */
#define NP_SVC_SNAT 0x20     /* SNAT to the node whatever the backend (externalTrafficPolicy
                              * Cluster: kube-proxy masquerades external traffic; ClusterIPs
                              * under --masquerade-all) */
#define NP_SVC_SNAT_OFF_CLUSTER 0x40 /* SNAT to the node when the source is outside the
                                      * cluster CIDRs (--cluster-cidr: kube-proxy masquerades
                                      * off-cluster traffic to ClusterIPs) */

/* np_src_ranges holds the cluster CIDRs under this service id (frontends start at 1). */
#define NP_CLUSTER_CIDRS_ID 0

/* Backend flags. */
#define NP_BE_REMOTE 0x1 /* on another node: SNAT to the node so that replies come back */

/* Connection flags (np_ct / np_nat values). */
#define NP_CT_SNAT 0x1   /* the source was rewritten too */
#define NP_CT_CLOSING 0x2 /* TCP FIN or RST seen: the collector expires it sooner */
#define NP_CT_REPLY 0x4  /* a reply was seen (TCP: the connection is established) */

struct np_addr {
	__u32 w[4];
};

/* np_services: (address, port, protocol, scope) → the frontend. */
struct np_svc_key {
	struct np_addr addr;
	__u16 port;
	__u8 proto;
	__u8 scope;
};

struct np_svc_val {
	__u32 svc_id;           /* stable per service port: affinity and source ranges */
	__u32 be_set;           /* fresh for every new backend set: np_backends, np_maglev */
	__u16 count;            /* backends at ordinals 1..count */
	__u16 flags;            /* NP_SVC_* */
	__u32 affinity_timeout; /* seconds */
};

/* np_svc_names: service id → the service port's name, "namespace/name:port/PROTO" (the
 * port's name, not its number; "namespace/name/PROTO" for an unnamed port), NUL-padded, at
 * most NP_SVC_NAME_LEN - 1 bytes (long names shortened as the flat nftables layout shortens
 * its 128-byte element comments). For nodeport trace: the programs never read it. */
#define NP_SVC_NAME_LEN 136

struct np_svc_name {
	char name[NP_SVC_NAME_LEN];
};

/* np_backends: (backend set, ordinal) → backend. */
struct np_be_key {
	__u32 be_set;
	__u32 ordinal;
};

struct np_be_val {
	struct np_addr addr;
	__u16 port;
	__u8 flags; /* NP_BE_* */
	__u8 pad;
};

/* np_members: (backend set, address, port) → ordinal; lets a remembered affinity choice be
 * checked against the current backend set. */
struct np_member_key {
	__u32 be_set;
	struct np_addr addr;
	__u16 port;
	__u16 pad;
};

/* np_ct (forward direction, keyed by the packet as the client sent it) and np_nat (reply
 * direction, keyed by the packet as the backend sends it): the translation to apply. */
struct np_ct_key {
	struct np_addr saddr;
	struct np_addr daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 pad[3];
};

struct np_ct_val {
	struct np_addr saddr; /* rewrite the source to */
	struct np_addr daddr; /* rewrite the destination to */
	__u16 sport;
	__u16 dport;
	__u8 flags; /* NP_CT_* */
	__u8 pad[3];
	__u32 svc_id;
	__u32 pad2;
	__u64 last_seen; /* bpf_ktime_get_ns() */
};

/* np_affinity: (service, client) → the backend it was sent to. The client is its address for
 * packets, its network namespace cookie for sockets (in the first 8 bytes). */
struct np_aff_key {
	__u32 svc_id;
	struct np_addr client;
};

struct np_aff_val {
	struct np_addr addr;
	__u16 port;
	__u16 pad;
	__u32 pad2;
	__u64 last_seen;
};

/* np_src_ranges: LPM trie over (service, source address). */
struct np_range_key {
	__u32 prefixlen; /* 32 (the service id) + the address bits (IPv4: 96 + prefix) */
	__u32 svc_id;
	struct np_addr addr;
};

/* np_maglev: backend set → lookup table of ordinals. */
struct np_maglev_val {
	__u32 ordinal[NP_MAGLEV_M];
};

/* np_config: index 0 is the IPv4 SNAT address (mapped), 1 the IPv6 one. */
struct np_config_val {
	struct np_addr snat;
};

/* np_sock_rev: (socket cookie, backend address, port) → the service address the application
 * asked for, for recvmsg and getpeername. */
struct np_sock_key {
	__u64 cookie;
	struct np_addr addr;
	__u16 port;
	__u16 pad;
	__u32 pad2;
};

struct np_sock_val {
	struct np_addr addr;
	__u16 port;
	__u16 pad;
};

#endif
