// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * nodeport's eBPF dataplane: Service load balancing in tc and cgroup socket programs.
 *
 * tc (TCX) programs on the node's interfaces:
 *   np_tc_ingress  replies of translated connections (np_nat) are reversed; packets of known
 *                  connections (np_ct) are translated as before; a packet to an external
 *                  frontend (np_services, scope EXT) opens a connection: source ranges,
 *                  affinity, backend choice (random or Maglev), DNAT, SNAT to the node when
 *                  the backend is remote or the frontend says so (externalTrafficPolicy
 *                  Cluster); no endpoints: ICMP port unreachable or drop.
 *   np_tc_egress   replies of local backends leaving the node are reversed (np_nat).
 * cgroup socket programs (ClusterIPs, and external frontends reached from the node):
 *   connect4/6, sendmsg4/6  rewrite the destination to a backend (scope INT);
 *   recvmsg4/6, getpeername4/6  show the service address back to the application.
 *
 * Layouts: nodeport.h. Designs followed, in our own code: Cilium's bpf/lib/lb.h (frontend
 * scopes, slot ordinals, own LRU conntrack) and Calico's felix/bpf-gpl (a fresh backend set
 * id per change, so that a frontend switches atomically to a fully written set).
 *
 * ICMP errors about translated connections are translated back (np_icmp_error), and a
 * translated packet too big for its next hop is answered with ICMP fragmentation needed or
 * packet too big (np_frag_needed).
 *
 * IP fragments follow their first fragment's translation (np_frags).
 *
 * Not handled here: IPv4 options and IPv6 extension headers other than the fragment header
 * (passed to the stack untouched), SCTP (its CRC32c cannot be patched incrementally: SCTP
 * frontends are not loaded).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/icmpv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "nodeport.h"

/* ICMPv4 (linux/icmp.h pulls in libc's socket headers, which a BPF target lacks). */
#define ICMP_DEST_UNREACH 3
#define ICMP_PORT_UNREACH 3
struct icmphdr {
	__u8 type;
	__u8 code;
	__u16 checksum;
	__u32 unused;
};

#ifndef ECONNREFUSED
#define ECONNREFUSED 111
#endif

/* Not in libbpf 1.1.2's helper list; the kernel has it since 5.18. */
static long (*np_set_retval)(int retval) = (void *)187;

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Sizes are the defaults; the loader sets them from the --ebpf-*-map-max flags. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct np_svc_key);
	__type(value, struct np_svc_val);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} np_services SEC(".maps");

/* Names of the service ports, by service id, for nodeport trace (nodeport.h). Written by the
 * applier with the frontends; no program reads it. The loader sizes it from np_services
 * (half: every service port has at least two frontends). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 32768);
	__type(key, __u32);
	__type(value, struct np_svc_name);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} np_svc_names SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct np_be_key);
	__type(value, struct np_be_val);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} np_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct np_member_key);
	__type(value, __u32);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} np_members SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 524288);
	__type(key, struct np_ct_key);
	__type(value, struct np_ct_val);
} np_ct SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 524288);
	__type(key, struct np_ct_key);
	__type(value, struct np_ct_val);
} np_nat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct np_aff_key);
	__type(value, struct np_aff_val);
} np_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__type(key, struct np_range_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} np_src_ranges SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct np_maglev_val);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} np_maglev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct np_config_val);
} np_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct np_sock_key);
	__type(value, struct np_sock_val);
} np_sock_rev SEC(".maps");

/* np_flags[0]: NP_FLAG_FIB_FORWARD sends packets translated at ingress straight to their
 * next hop (bpf_fib_lookup + bpf_redirect_neigh), as Cilium does: a reply reversed at
 * ingress carries the node's own address as its source, which the stack's input routing
 * would drop as martian. Off, packets go up the stack (program tests). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} np_flags SEC(".maps");

#define NP_FLAG_FIB_FORWARD 0x1

/* IP fragments (Cilium's fragment map, bpf/lib/ipv4.h and ipv6.h): a datagram's first
 * fragment carries its ports, the later ones only the IP header. The first fragment's
 * ports are remembered under (source, destination, IP id, protocol), as the packet arrived,
 * so that the later fragments find the same connection and get the same address
 * translation (the ports and the L4 checksum are in the first fragment only). Fragments
 * arriving before their first one find nothing and go up the stack untranslated. */
struct np_frag_key {
	struct np_addr saddr;
	struct np_addr daddr;
	__u32 id;
	__u8 proto;
	__u8 pad[3];
};

struct np_frag_val {
	__u16 sport;
	__u16 dport;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, struct np_frag_key);
	__type(value, struct np_frag_val);
} np_frags SEC(".maps");

#define NP_FRAG_FIRST 1 /* np_pkt.frag: the first fragment (offset 0, more follow) */
#define NP_FRAG_LATER 2 /* a later fragment: no L4 header */

#define NP_NAT_PORT_MIN 32768
#define NP_NAT_PORT_TRIES 8

/* The IPv6 fragment extension header (RFC 8200 4.5). */
#define NP_IPV6_FRAGMENT 44
struct np_ipv6_frag {
	__u8 nexthdr;
	__u8 reserved;
	__u16 frag_off; /* offset in 8-byte units << 3, M flag in bit 0 */
	__u32 id;
};

/* A parsed packet: where its fields are and what they hold. */
struct np_pkt {
	__u32 l3_off;
	__u32 l4_off;
	__u32 csum_off; /* L4 checksum */
	__u16 eth_proto;
	__u8 proto;
	__u8 tcp_flags;
	struct np_ct_key tuple;
	__u8 frag;     /* NP_FRAG_*, 0 for a whole datagram */
	__u32 frag_id; /* the IP id of a fragment */
};

/* The ports of a fragment's datagram: read from a first fragment and remembered, or
 * looked up for a later one. Returns 0 when the packet's ports are known. */
static __always_inline int np_frag_ports(struct np_pkt *p)
{
	struct np_frag_key k = {};
	struct np_frag_val v = {}, *found;

	k.saddr = p->tuple.saddr;
	k.daddr = p->tuple.daddr;
	k.id = p->frag_id;
	k.proto = p->proto;
	if (p->frag == NP_FRAG_FIRST) {
		v.sport = p->tuple.sport;
		v.dport = p->tuple.dport;
		bpf_map_update_elem(&np_frags, &k, &v, BPF_ANY);
		return 0;
	}
	found = bpf_map_lookup_elem(&np_frags, &k);
	if (!found)
		return -1;
	p->tuple.sport = found->sport;
	p->tuple.dport = found->dport;
	return 0;
}

static __always_inline void np_addr_v4(struct np_addr *a, __u32 v4)
{
	a->w[0] = 0;
	a->w[1] = 0;
	a->w[2] = bpf_htonl(0xffff);
	a->w[3] = v4;
}

static __always_inline int np_addr_eq(const struct np_addr *a, const struct np_addr *b)
{
	return a->w[0] == b->w[0] && a->w[1] == b->w[1] && a->w[2] == b->w[2] && a->w[3] == b->w[3];
}

/* Parses Ethernet, IPv4 (no options, no fragments) or IPv6 (no extension headers), and TCP
 * or UDP. Returns 0 when the packet is one this dataplane translates. */
static __always_inline int np_parse(struct __sk_buff *skb, struct np_pkt *p)
{
	struct ethhdr eth;
	__u16 ports[2];

	__builtin_memset(p, 0, sizeof(*p));
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
		return -1;
	p->eth_proto = eth.h_proto;
	p->l3_off = sizeof(eth);
	if (eth.h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, p->l3_off, &ip, sizeof(ip)) < 0)
			return -1;
		if (ip.ihl != 5)
			return -1;
		if (ip.frag_off & bpf_htons(0x3fff)) {
			p->frag = (ip.frag_off & bpf_htons(0x1fff)) ? NP_FRAG_LATER : NP_FRAG_FIRST;
			p->frag_id = ip.id;
		}
		p->proto = ip.protocol;
		np_addr_v4(&p->tuple.saddr, ip.saddr);
		np_addr_v4(&p->tuple.daddr, ip.daddr);
		p->l4_off = p->l3_off + sizeof(ip);
	} else if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;

		if (bpf_skb_load_bytes(skb, p->l3_off, &ip6, sizeof(ip6)) < 0)
			return -1;
		p->proto = ip6.nexthdr;
		__builtin_memcpy(&p->tuple.saddr, &ip6.saddr, 16);
		__builtin_memcpy(&p->tuple.daddr, &ip6.daddr, 16);
		p->l4_off = p->l3_off + sizeof(ip6);
		if (p->proto == NP_IPV6_FRAGMENT) {
			struct np_ipv6_frag fh;

			if (bpf_skb_load_bytes(skb, p->l4_off, &fh, sizeof(fh)) < 0)
				return -1;
			p->proto = fh.nexthdr;
			p->l4_off += sizeof(fh);
			p->frag = (fh.frag_off & bpf_htons(0xfff8)) ? NP_FRAG_LATER : NP_FRAG_FIRST;
			p->frag_id = fh.id;
		}
	} else {
		return -1;
	}
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return -1;
	if (p->frag == NP_FRAG_LATER) {
		/* No L4 header: no ports, flags or checksum to read or rewrite. */
		p->tuple.proto = p->proto;
		return np_frag_ports(p);
	}
	if (p->proto == IPPROTO_TCP) {
		__u8 flags;

		p->csum_off = p->l4_off + offsetof(struct tcphdr, check);
		if (bpf_skb_load_bytes(skb, p->l4_off + 13, &flags, 1) < 0)
			return -1;
		p->tcp_flags = flags;
	} else if (p->proto == IPPROTO_UDP) {
		p->csum_off = p->l4_off + offsetof(struct udphdr, check);
	} else {
		return -1;
	}
	if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
		return -1;
	p->tuple.sport = ports[0];
	p->tuple.dport = ports[1];
	p->tuple.proto = p->proto;
	if (p->frag == NP_FRAG_FIRST)
		return np_frag_ports(p);
	return 0;
}

#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04

static __always_inline __u64 np_csum_flags(const struct np_pkt *p)
{
	return p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* Rewrites one address (source or destination), with the IPv4 header checksum and the L4
 * pseudo-header checksum. */
static __always_inline int np_set_addr(struct __sk_buff *skb, const struct np_pkt *p, int dst,
				       const struct np_addr *from, const struct np_addr *to)
{
	if (np_addr_eq(from, to))
		return 0;
	if (p->eth_proto == bpf_htons(ETH_P_IP)) {
		__u32 off = p->l3_off + (dst ? offsetof(struct iphdr, daddr) : offsetof(struct iphdr, saddr));
		__u32 old = from->w[3], new = to->w[3];

		if (p->frag != NP_FRAG_LATER &&
		    bpf_l4_csum_replace(skb, p->csum_off, old, new,
					BPF_F_PSEUDO_HDR | sizeof(new) | np_csum_flags(p)) < 0)
			return -1;
		if (bpf_l3_csum_replace(skb, p->l3_off + offsetof(struct iphdr, check), old, new,
					sizeof(new)) < 0)
			return -1;
		return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
	} else {
		__u32 off = p->l3_off +
			    (dst ? offsetof(struct ipv6hdr, daddr) : offsetof(struct ipv6hdr, saddr));
		__s64 diff = bpf_csum_diff((__be32 *)from->w, 16, (__be32 *)to->w, 16, 0);

		if (p->frag != NP_FRAG_LATER &&
		    bpf_l4_csum_replace(skb, p->csum_off, 0, diff,
					BPF_F_PSEUDO_HDR | np_csum_flags(p)) < 0)
			return -1;
		return bpf_skb_store_bytes(skb, off, to->w, 16, 0);
	}
}

static __always_inline int np_set_port(struct __sk_buff *skb, const struct np_pkt *p, int dst,
				       __u16 from, __u16 to)
{
	if (from == to || p->frag == NP_FRAG_LATER)
		return 0;
	if (bpf_l4_csum_replace(skb, p->csum_off, from, to, sizeof(to) | np_csum_flags(p)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, p->l4_off + (dst ? 2 : 0), &to, sizeof(to), 0);
}

/* Applies a translation: the packet's addresses and ports become those of `v`. */
static __always_inline int np_translate(struct __sk_buff *skb, const struct np_pkt *p,
					const struct np_ct_val *v)
{
	if (np_set_addr(skb, p, 0, &p->tuple.saddr, &v->saddr) < 0 ||
	    np_set_addr(skb, p, 1, &p->tuple.daddr, &v->daddr) < 0 ||
	    np_set_port(skb, p, 0, p->tuple.sport, v->sport) < 0 ||
	    np_set_port(skb, p, 1, p->tuple.dport, v->dport) < 0)
		return -1;
	return 0;
}

static __always_inline void np_touch(struct np_ct_val *v, const struct np_pkt *p, int reply)
{
	__u8 flags = v->flags;

	v->last_seen = bpf_ktime_get_ns();
	if (p->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST))
		flags |= NP_CT_CLOSING;
	if (reply)
		flags |= NP_CT_REPLY;
	if (flags != v->flags)
		v->flags = flags;
}

/* A 32-bit mix of the connection's tuple (Maglev's flow hash), Jenkins' final mix. */
static __always_inline __u32 np_mix(__u32 a, __u32 b, __u32 c)
{
	c ^= b; c -= (b << 14) | (b >> 18);
	a ^= c; a -= (c << 11) | (c >> 21);
	b ^= a; b -= (a << 25) | (a >> 7);
	c ^= b; c -= (b << 16) | (b >> 16);
	a ^= c; a -= (c << 4) | (c >> 28);
	b ^= a; b -= (a << 14) | (a >> 18);
	c ^= b; c -= (b << 24) | (b >> 8);
	return c;
}

static __always_inline __u32 np_hash_addr(const struct np_addr *a, __u32 seed)
{
	return np_mix(a->w[0] ^ a->w[1], a->w[2] ^ seed, a->w[3]);
}

/* Picks a backend ordinal of `svc` (1..count) for a flow with hash `hash`. */
static __always_inline __u32 np_pick(const struct np_svc_val *svc, __u32 hash)
{
	__u32 be_set = svc->be_set;

	if (svc->flags & NP_SVC_MAGLEV) {
		struct np_maglev_val *lut = bpf_map_lookup_elem(&np_maglev, &be_set);
		__u32 slot = hash % NP_MAGLEV_M;

		/* Keeps the bound check the compiler would drop, for the verifier. */
		asm volatile("" : "+r"(slot));
		if (lut && slot < NP_MAGLEV_M)
			return lut->ordinal[slot];
		return 0;
	}
	return bpf_get_prandom_u32() % svc->count + 1;
}

/* The backend a client stuck to, if it is still one of the service's backends. */
static __always_inline struct np_be_val *np_affinity_lookup(const struct np_svc_val *svc,
							    const struct np_aff_key *key, __u64 now)
{
	struct np_aff_val *aff = bpf_map_lookup_elem(&np_affinity, key);
	struct np_member_key mk = {};
	struct np_be_key bk = {};
	__u32 *ordinal;

	if (!aff)
		return 0;
	if (now - aff->last_seen > (__u64)svc->affinity_timeout * 1000000000ULL)
		return 0;
	mk.be_set = svc->be_set;
	mk.addr = aff->addr;
	mk.port = aff->port;
	ordinal = bpf_map_lookup_elem(&np_members, &mk);
	if (!ordinal)
		return 0;
	bk.be_set = svc->be_set;
	bk.ordinal = *ordinal;
	aff->last_seen = now;
	return bpf_map_lookup_elem(&np_backends, &bk);
}

static __always_inline void np_affinity_record(const struct np_aff_key *key,
					       const struct np_be_val *be, __u64 now)
{
	struct np_aff_val v = {};

	v.addr = be->addr;
	v.port = be->port;
	v.last_seen = now;
	bpf_map_update_elem(&np_affinity, key, &v, BPF_ANY);
}

/* Selects the backend of a new connection or socket: affinity first, then the service's
 * algorithm. */
static __always_inline struct np_be_val *np_select(const struct np_svc_val *svc,
						   const struct np_addr *client, __u32 hash,
						   __u64 now)
{
	struct np_aff_key ak = {};
	struct np_be_key bk = {};
	struct np_be_val *be;

	if (svc->flags & NP_SVC_AFFINITY) {
		ak.svc_id = svc->svc_id;
		ak.client = *client;
		be = np_affinity_lookup(svc, &ak, now);
		if (be)
			return be;
	}
	bk.be_set = svc->be_set;
	bk.ordinal = np_pick(svc, hash);
	be = bpf_map_lookup_elem(&np_backends, &bk);
	if (be && (svc->flags & NP_SVC_AFFINITY))
		np_affinity_record(&ak, be, now);
	return be;
}

static __always_inline int np_source_allowed(const struct np_svc_val *svc, const struct np_addr *src)
{
	struct np_range_key k = {};

	if (!(svc->flags & NP_SVC_RANGES))
		return 1;
	k.prefixlen = 32 + 128;
	k.svc_id = svc->svc_id;
	k.addr = *src;
	return bpf_map_lookup_elem(&np_src_ranges, &k) != 0;
}

/* Whether a source is inside the cluster CIDRs (NP_SVC_SNAT_OFF_CLUSTER). */
static __always_inline int np_in_cluster(const struct np_addr *src)
{
	struct np_range_key k = {};

	k.prefixlen = 32 + 128;
	k.svc_id = NP_CLUSTER_CIDRS_ID;
	k.addr = *src;
	return bpf_map_lookup_elem(&np_src_ranges, &k) != 0;
}

/* Folds a 32-bit one's complement sum into the 16-bit checksum. */
static __always_inline __u16 np_csum_fold(__s64 sum)
{
	__u32 s = (__u32)sum;

	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

/* Turns the packet into an ICMP port unreachable for its sender and sends it back out of
 * the interface it came in on (kube-proxy's `reject`). IPv4: type 3 code 3, quoting the IP
 * header and the first 8 bytes of the datagram (RFC 792). */
static __always_inline int np_reject_v4(struct __sk_buff *skb, const struct np_pkt *p)
{
	struct ethhdr eth;
	struct {
		struct iphdr ip;
		struct icmphdr icmp;
		__u8 quote[28];
	} out = {};
	__u8 mac[ETH_ALEN];

	_Static_assert(sizeof(out) == 20 + 8 + 28, "ICMP reply without padding");
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l3_off, out.quote, sizeof(out.quote)) < 0)
		return TC_ACT_SHOT;
	__builtin_memcpy(mac, eth.h_source, ETH_ALEN);
	__builtin_memcpy(eth.h_source, eth.h_dest, ETH_ALEN);
	__builtin_memcpy(eth.h_dest, mac, ETH_ALEN);

	out.ip.version = 4;
	out.ip.ihl = 5;
	out.ip.tos = 0xc0;
	out.ip.tot_len = bpf_htons(sizeof(out));
	out.ip.ttl = 64;
	out.ip.protocol = IPPROTO_ICMP;
	out.ip.saddr = p->tuple.daddr.w[3];
	out.ip.daddr = p->tuple.saddr.w[3];
	out.ip.check = np_csum_fold(bpf_csum_diff(0, 0, (__be32 *)&out.ip, sizeof(out.ip), 0));
	out.icmp.type = ICMP_DEST_UNREACH;
	out.icmp.code = ICMP_PORT_UNREACH;
	out.icmp.checksum = np_csum_fold(
		bpf_csum_diff(0, 0, (__be32 *)&out.icmp, sizeof(out.icmp) + sizeof(out.quote), 0));

	if (bpf_skb_change_tail(skb, sizeof(eth) + sizeof(out), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0 ||
	    bpf_skb_store_bytes(skb, sizeof(eth), &out, sizeof(out), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* IPv6: ICMPv6 destination unreachable, code 4 (port unreachable), quoting the IPv6 header
 * and the first 8 bytes of the datagram. */
static __always_inline int np_reject_v6(struct __sk_buff *skb, const struct np_pkt *p)
{
	struct ethhdr eth;
	struct {
		struct ipv6hdr ip6;
		struct icmp6hdr icmp6;
		__u8 quote[48];
	} out = {};
	struct {
		struct np_addr src;
		struct np_addr dst;
		__u32 len;
		__u32 next;
	} pseudo = {};
	__u8 mac[ETH_ALEN];
	__s64 sum;

	_Static_assert(sizeof(out) == 40 + 8 + 48, "ICMPv6 reply without padding");
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l3_off, out.quote, sizeof(out.quote)) < 0)
		return TC_ACT_SHOT;
	__builtin_memcpy(mac, eth.h_source, ETH_ALEN);
	__builtin_memcpy(eth.h_source, eth.h_dest, ETH_ALEN);
	__builtin_memcpy(eth.h_dest, mac, ETH_ALEN);

	out.ip6.version = 6;
	out.ip6.payload_len = bpf_htons(sizeof(out.icmp6) + sizeof(out.quote));
	out.ip6.nexthdr = IPPROTO_ICMPV6;
	out.ip6.hop_limit = 64;
	__builtin_memcpy(&out.ip6.saddr, &p->tuple.daddr, 16);
	__builtin_memcpy(&out.ip6.daddr, &p->tuple.saddr, 16);
	out.icmp6.icmp6_type = ICMPV6_DEST_UNREACH;
	out.icmp6.icmp6_code = ICMPV6_PORT_UNREACH;

	pseudo.src = p->tuple.daddr;
	pseudo.dst = p->tuple.saddr;
	pseudo.len = bpf_htonl(sizeof(out.icmp6) + sizeof(out.quote));
	pseudo.next = bpf_htonl(IPPROTO_ICMPV6);
	sum = bpf_csum_diff(0, 0, (__be32 *)&pseudo, sizeof(pseudo), 0);
	sum = bpf_csum_diff(0, 0, (__be32 *)&out.icmp6, sizeof(out.icmp6) + sizeof(out.quote), sum);
	out.icmp6.icmp6_cksum = np_csum_fold(sum);

	if (bpf_skb_change_tail(skb, sizeof(eth) + sizeof(out), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0 ||
	    bpf_skb_store_bytes(skb, sizeof(eth), &out, sizeof(out), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

#define NP_AF_INET 2
#define NP_AF_INET6 10

/* ICMP "fragmentation needed" (IPv4) and "packet too big" (IPv6) for a packet translated at
 * ingress that the FIB cannot forward whole (RFC 1191, RFC 8201): sent back to the packet's
 * original sender, quoting the packet as that sender wrote it (its untranslated addresses
 * and ports, still in p->tuple), so that its socket finds the error and lowers its path MTU.
 * The node's own stack cannot do it here: the error would quote the translated packet, or,
 * for a reply whose source is now the node's own address, not be sent at all (martian).
 * The source is the node's address of the family (np_config), else the address the sender
 * wrote to. The frame goes back out of the interface the packet came in on. */
#define ICMP_FRAG_NEEDED 4

static __always_inline void np_pmtu_source(const struct np_pkt *p, __u32 idx, struct np_addr *src)
{
	struct np_config_val *cfg = bpf_map_lookup_elem(&np_config, &idx);

	*src = p->tuple.daddr;
	if (cfg && (cfg->snat.w[0] | cfg->snat.w[1] | cfg->snat.w[2] | cfg->snat.w[3]))
		*src = cfg->snat;
}

static __always_inline int np_frag_needed_v4(struct __sk_buff *skb, const struct np_pkt *p, __u32 mtu)
{
	struct ethhdr eth;
	struct {
		struct iphdr ip;
		struct icmphdr icmp;
		struct iphdr quote_ip;
		__u16 quote_ports[2];
		__u8 quote_rest[4];
	} out = {};
	struct np_addr src;
	__u8 mac[ETH_ALEN];

	_Static_assert(sizeof(out) == 20 + 8 + 28, "ICMP error without padding");
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l3_off, &out.quote_ip, 28) < 0)
		return TC_ACT_SHOT;
	/* Without DF the sender allowed fragmentation: left to the stack, as before. */
	if (!(out.quote_ip.frag_off & bpf_htons(0x4000)))
		return TC_ACT_OK;
	out.quote_ip.saddr = p->tuple.saddr.w[3];
	out.quote_ip.daddr = p->tuple.daddr.w[3];
	out.quote_ip.check = 0;
	out.quote_ip.check = np_csum_fold(bpf_csum_diff(0, 0, (__be32 *)&out.quote_ip, sizeof(out.quote_ip), 0));
	out.quote_ports[0] = p->tuple.sport;
	out.quote_ports[1] = p->tuple.dport;
	np_pmtu_source(p, 0, &src);
	__builtin_memcpy(mac, eth.h_source, ETH_ALEN);
	__builtin_memcpy(eth.h_source, eth.h_dest, ETH_ALEN);
	__builtin_memcpy(eth.h_dest, mac, ETH_ALEN);

	out.ip.version = 4;
	out.ip.ihl = 5;
	out.ip.tos = 0xc0;
	out.ip.tot_len = bpf_htons(sizeof(out));
	out.ip.ttl = 64;
	out.ip.protocol = IPPROTO_ICMP;
	out.ip.saddr = src.w[3];
	out.ip.daddr = p->tuple.saddr.w[3];
	out.ip.check = np_csum_fold(bpf_csum_diff(0, 0, (__be32 *)&out.ip, sizeof(out.ip), 0));
	out.icmp.type = ICMP_DEST_UNREACH;
	out.icmp.code = ICMP_FRAG_NEEDED;
	out.icmp.unused = bpf_htonl(mtu & 0xffff);
	out.icmp.checksum = np_csum_fold(bpf_csum_diff(0, 0, (__be32 *)&out.icmp, sizeof(out) - sizeof(out.ip), 0));

	if (bpf_skb_change_tail(skb, sizeof(eth) + sizeof(out), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0 ||
	    bpf_skb_store_bytes(skb, sizeof(eth), &out, sizeof(out), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

static __always_inline int np_frag_needed_v6(struct __sk_buff *skb, const struct np_pkt *p, __u32 mtu)
{
	struct ethhdr eth;
	struct {
		struct ipv6hdr ip6;
		struct icmp6hdr icmp6;
		struct ipv6hdr quote_ip6;
		__u16 quote_ports[2];
		__u8 quote_rest[4];
	} out = {};
	struct {
		struct np_addr src;
		struct np_addr dst;
		__u32 len;
		__u32 next;
	} pseudo = {};
	struct np_addr src;
	__u8 mac[ETH_ALEN];
	__s64 sum;

	_Static_assert(sizeof(out) == 40 + 8 + 48, "ICMPv6 error without padding");
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l3_off, &out.quote_ip6, 48) < 0)
		return TC_ACT_SHOT;
	__builtin_memcpy(&out.quote_ip6.saddr, &p->tuple.saddr, 16);
	__builtin_memcpy(&out.quote_ip6.daddr, &p->tuple.daddr, 16);
	/* A fragment's quote ends with its fragment header, not its ports. */
	if (!p->frag) {
		out.quote_ports[0] = p->tuple.sport;
		out.quote_ports[1] = p->tuple.dport;
	}
	np_pmtu_source(p, 1, &src);
	__builtin_memcpy(mac, eth.h_source, ETH_ALEN);
	__builtin_memcpy(eth.h_source, eth.h_dest, ETH_ALEN);
	__builtin_memcpy(eth.h_dest, mac, ETH_ALEN);

	out.ip6.version = 6;
	out.ip6.payload_len = bpf_htons(sizeof(out) - sizeof(out.ip6));
	out.ip6.nexthdr = IPPROTO_ICMPV6;
	out.ip6.hop_limit = 64;
	__builtin_memcpy(&out.ip6.saddr, &src, 16);
	__builtin_memcpy(&out.ip6.daddr, &p->tuple.saddr, 16);
	out.icmp6.icmp6_type = ICMPV6_PKT_TOOBIG;
	out.icmp6.icmp6_mtu = bpf_htonl(mtu);

	pseudo.src = src;
	pseudo.dst = p->tuple.saddr;
	pseudo.len = bpf_htonl(sizeof(out) - sizeof(out.ip6));
	pseudo.next = bpf_htonl(IPPROTO_ICMPV6);
	sum = bpf_csum_diff(0, 0, (__be32 *)&pseudo, sizeof(pseudo), 0);
	sum = bpf_csum_diff(0, 0, (__be32 *)&out.icmp6, sizeof(out) - sizeof(out.ip6), sum);
	out.icmp6.icmp6_cksum = np_csum_fold(sum);

	if (bpf_skb_change_tail(skb, sizeof(eth) + sizeof(out), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0 ||
	    bpf_skb_store_bytes(skb, sizeof(eth), &out, sizeof(out), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* The FIB said the translated packet is too big for its next hop. Only TCP and UDP
 * packets get an error (never an error about an ICMP error, RFC 1122 3.2.2). */
static __always_inline int np_frag_needed(struct __sk_buff *skb, const struct np_pkt *p, __u32 mtu)
{
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return TC_ACT_OK;
	if (p->eth_proto == bpf_htons(ETH_P_IP))
		return np_frag_needed_v4(skb, p, mtu);
	return np_frag_needed_v6(skb, p, mtu);
}

/* Forwards a packet translated at ingress to its next hop, decrementing its TTL (hop
 * limit) as the stack would. Anything the FIB cannot forward (local destinations, no
 * route, fragmentation needed, TTL running out) goes up the stack. */
static __always_inline int np_forward(struct __sk_buff *skb, const struct np_pkt *p)
{
	struct bpf_fib_lookup fib = {};
	__u32 zero = 0, *flags = bpf_map_lookup_elem(&np_flags, &zero);
	struct ethhdr eth;
	long rc;

	if (!flags || !(*flags & NP_FLAG_FIB_FORWARD))
		return TC_ACT_OK;
	fib.ifindex = skb->ingress_ifindex;
	fib.l4_protocol = p->proto;
	if (p->eth_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, p->l3_off, &ip, sizeof(ip)) < 0)
			return TC_ACT_OK;
		if (ip.ttl <= 1)
			return TC_ACT_OK;
		fib.family = NP_AF_INET;
		fib.tos = ip.tos;
		fib.ipv4_src = ip.saddr;
		fib.ipv4_dst = ip.daddr;
	} else {
		struct ipv6hdr ip6;

		if (bpf_skb_load_bytes(skb, p->l3_off, &ip6, sizeof(ip6)) < 0)
			return TC_ACT_OK;
		if (ip6.hop_limit <= 1)
			return TC_ACT_OK;
		fib.family = NP_AF_INET6;
		__builtin_memcpy(fib.ipv6_src, &ip6.saddr, 16);
		__builtin_memcpy(fib.ipv6_dst, &ip6.daddr, 16);
	}
	fib.sport = p->tuple.sport;
	fib.dport = p->tuple.dport;
	/* tot_len stays 0: the kernel then checks the skb itself against the egress device's
	 * MTU (is_skb_forwardable, which knows GSO). A header's tot_len of a GSO packet (up to
	 * 64 KiB from a veth with TSO) would fail the MTU check, and the translated packet,
	 * sent up the stack instead, be dropped there (a SNATed source is the node's own). */
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return np_frag_needed(skb, p, fib.mtu_result);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return TC_ACT_OK;

	if (p->eth_proto == bpf_htons(ETH_P_IP)) {
		/* TTL and protocol share a 16-bit word of the header checksum. */
		__u8 ttl;
		__u16 old, new;

		if (bpf_skb_load_bytes(skb, p->l3_off + offsetof(struct iphdr, ttl), &ttl, 1) < 0)
			return TC_ACT_OK;
		old = bpf_htons(((__u16)ttl << 8) | p->proto);
		ttl--;
		new = bpf_htons(((__u16)ttl << 8) | p->proto);
		if (bpf_l3_csum_replace(skb, p->l3_off + offsetof(struct iphdr, check), old, new, 2) < 0 ||
		    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct iphdr, ttl), &ttl, 1, 0) < 0)
			return TC_ACT_SHOT;
	} else {
		__u8 hops;

		if (bpf_skb_load_bytes(skb, p->l3_off + offsetof(struct ipv6hdr, hop_limit), &hops, 1) < 0)
			return TC_ACT_OK;
		hops--;
		if (bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct ipv6hdr, hop_limit), &hops, 1, 0) < 0)
			return TC_ACT_SHOT;
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {};

		nh.nh_family = fib.family;
		if (fib.family == NP_AF_INET)
			nh.ipv4_nh = fib.ipv4_dst;
		else
			__builtin_memcpy(nh.ipv6_nh, fib.ipv6_dst, 16);
		return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
		return TC_ACT_OK;
	__builtin_memcpy(eth.h_dest, fib.dmac, ETH_ALEN);
	__builtin_memcpy(eth.h_source, fib.smac, ETH_ALEN);
	if (bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(fib.ifindex, 0);
}

/* Reverses a translated connection's reply (np_nat). Returns 1 when the packet was one. */
static __always_inline int np_reverse(struct __sk_buff *skb, struct np_pkt *p, int *verdict)
{
	struct np_ct_val *rev = bpf_map_lookup_elem(&np_nat, &p->tuple);

	if (!rev)
		return 0;
	np_touch(rev, p, 1);
	*verdict = np_translate(skb, p, rev) < 0 ? TC_ACT_SHOT : TC_ACT_OK;
	return 1;
}

/* Opens a connection to an external frontend: chooses the backend, records both
 * directions, translates. */
static __always_inline int np_open(struct __sk_buff *skb, struct np_pkt *p,
				   const struct np_svc_val *svc)
{
	__u64 now = bpf_ktime_get_ns();
	struct np_ct_val fwd = {}, rev = {};
	struct np_ct_key reply = {};
	struct np_be_val *be;
	__u32 hash;
	int i;

	if (!np_source_allowed(svc, &p->tuple.saddr))
		return TC_ACT_SHOT;
	hash = np_mix(np_hash_addr(&p->tuple.saddr, p->tuple.proto),
		      ((__u32)p->tuple.sport << 16) | p->tuple.dport, svc->svc_id);
	be = np_select(svc, &p->tuple.saddr, hash, now);
	if (!be)
		return TC_ACT_SHOT;

	fwd.saddr = p->tuple.saddr;
	fwd.sport = p->tuple.sport;
	fwd.daddr = be->addr;
	fwd.dport = be->port;
	fwd.svc_id = svc->svc_id;
	fwd.last_seen = now;

	reply.saddr = be->addr;
	reply.sport = be->port;
	reply.proto = p->tuple.proto;
	rev.saddr = p->tuple.daddr;
	rev.sport = p->tuple.dport;
	rev.daddr = p->tuple.saddr;
	rev.dport = p->tuple.sport;
	rev.svc_id = svc->svc_id;
	rev.last_seen = now;

	if ((be->flags & NP_BE_REMOTE) || (svc->flags & NP_SVC_SNAT) ||
	    ((svc->flags & NP_SVC_SNAT_OFF_CLUSTER) && !np_in_cluster(&p->tuple.saddr))) {
		__u32 idx = p->eth_proto == bpf_htons(ETH_P_IP) ? 0 : 1;
		struct np_config_val *cfg = bpf_map_lookup_elem(&np_config, &idx);
		int done = 0;

		if (!cfg)
			return TC_ACT_SHOT;
		fwd.saddr = cfg->snat;
		/* No node address of this family configured: the frontend's own address, which is
		 * the node's for a NodePort. */
		if (!(cfg->snat.w[0] | cfg->snat.w[1] | cfg->snat.w[2] | cfg->snat.w[3]))
			fwd.saddr = p->tuple.daddr;
		fwd.flags = NP_CT_SNAT;
		rev.flags = NP_CT_SNAT;
		reply.daddr = fwd.saddr;
		for (i = 0; i < NP_NAT_PORT_TRIES; i++) {
			__u16 port = NP_NAT_PORT_MIN + (bpf_get_prandom_u32() % (65536 - NP_NAT_PORT_MIN));

			reply.dport = bpf_htons(port);
			if (bpf_map_update_elem(&np_nat, &reply, &rev, BPF_NOEXIST) == 0) {
				done = 1;
				break;
			}
		}
		if (!done)
			return TC_ACT_SHOT;
		fwd.sport = reply.dport;
	} else {
		reply.daddr = p->tuple.saddr;
		reply.dport = p->tuple.sport;
		if (bpf_map_update_elem(&np_nat, &reply, &rev, BPF_ANY) < 0)
			return TC_ACT_SHOT;
	}
	if (bpf_map_update_elem(&np_ct, &p->tuple, &fwd, BPF_ANY) < 0)
		return TC_ACT_SHOT;
	return np_translate(skb, p, &fwd) < 0 ? TC_ACT_SHOT : TC_ACT_OK;
}

/* Trace events for `nodeport trace --live` in the ebpf mode. A tracer sets np_trace_until[0]
 * to the CLOCK_MONOTONIC time its trace ends: until then the programs record the decision
 * they take for each new connection (tc: translated, dropped or rejected, and why; the
 * connect hook: translated or refused) in np_trace_log, by tuple, the latest kept. Every
 * tracer reads the whole log, so tracers at once each see every event. The deadline lapses
 * by itself, so a tracer that dies leaves nothing switched on. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} np_trace_until SEC(".maps");

/* One event, 104 bytes; ports in network order. The Rust side reads this layout
 * (ebpf::trace_events). */
struct np_trace_event {
	__u64 time;
	__u8 kind;
	__u8 pad;
	__u16 flags; /* NP_CT_* of the new entry */
	__u32 svc_id;
	__u32 ifindex; /* tc: the interface it came in on */
	__u32 pad2;
	struct np_ct_key tuple; /* as it arrived (the connect hook: no source) */
	struct np_addr to;
	struct np_addr snat;
	__u16 to_port;
	__u16 snat_port;
	__u32 pad3;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct np_ct_key);
	__type(value, struct np_trace_event);
} np_trace_log SEC(".maps");

/* Where an event is built (a per-CPU slot, not the stack: np_tc_ingress's frame is close to
 * the 512-byte limit). Transient, so not pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct np_trace_event);
} np_trace_scratch SEC(".maps");

/* The zeroed scratch event, stamped `now`; NULL when no tracer asks. */
static __always_inline struct np_trace_event *np_trace_begin(void)
{
	__u32 zero = 0;
	__u64 now = bpf_ktime_get_ns();
	__u64 *until = bpf_map_lookup_elem(&np_trace_until, &zero);
	struct np_trace_event *ev;

	if (!until || now >= *until)
		return NULL;
	ev = bpf_map_lookup_elem(&np_trace_scratch, &zero);
	if (!ev)
		return NULL;
	__builtin_memset(ev, 0, sizeof(*ev));
	ev->time = now;
	return ev;
}

#define NP_TRACE_DNAT 1		/* tc: a new connection translated (to, snat) */
#define NP_TRACE_REJECT 2	/* tc: no endpoints, rejected */
#define NP_TRACE_DROP_NO_ENDPOINTS 3 /* tc: no endpoints (policy Local), dropped */
#define NP_TRACE_DROP_SOURCE 4	/* tc: source outside loadBalancerSourceRanges */
#define NP_TRACE_DROP_OTHER 5	/* tc: no backend chosen, or a map full */
#define NP_TRACE_SOCK_DNAT 6	/* connect hook: the socket connected to `to` */
#define NP_TRACE_SOCK_REFUSED 7	/* connect hook: no endpoints, ECONNREFUSED */


/* tc: what np_tc_ingress decided for a new connection to `svc` (`verdict` of np_open, or
 * TC_ACT_SHOT for a service without endpoints). */
static __always_inline void np_trace_tc(struct __sk_buff *skb, const struct np_pkt *p,
					const struct np_svc_val *svc, int verdict)
{
	struct np_trace_event *ev = np_trace_begin();
	struct np_ct_val *ct;

	if (!ev)
		return;
	ev->svc_id = svc->svc_id;
	ev->ifindex = skb->ingress_ifindex;
	ev->tuple = p->tuple;
	if (svc->count == 0)
		ev->kind = (svc->flags & NP_SVC_REJECT) ? NP_TRACE_REJECT : NP_TRACE_DROP_NO_ENDPOINTS;
	else if (verdict != TC_ACT_OK)
		ev->kind = np_source_allowed(svc, &p->tuple.saddr) ? NP_TRACE_DROP_OTHER
								  : NP_TRACE_DROP_SOURCE;
	else {
		ev->kind = NP_TRACE_DNAT;
		ct = bpf_map_lookup_elem(&np_ct, &p->tuple);
		if (ct) {
			ev->flags = ct->flags;
			ev->to = ct->daddr;
			ev->to_port = ct->dport;
			ev->snat = ct->saddr;
			ev->snat_port = ct->sport;
		}
	}
	bpf_map_update_elem(&np_trace_log, &ev->tuple, ev, BPF_ANY);
}

/* The connect hook: `be` chosen for the socket's connection to `key`, or refused (NULL).
 * No source is known at connect(): the tuple's source holds the socket's cookie, which
 * keeps sockets apart in the log. */
static __always_inline void np_trace_sock(struct bpf_sock_addr *ctx,
					  const struct np_svc_key *key,
					  const struct np_svc_val *svc,
					  const struct np_be_val *be)
{
	struct np_trace_event *ev = np_trace_begin();
	__u64 cookie;

	if (!ev)
		return;
	cookie = bpf_get_socket_cookie(ctx);
	__builtin_memcpy(&ev->tuple.saddr, &cookie, sizeof(cookie));
	ev->kind = be ? NP_TRACE_SOCK_DNAT : NP_TRACE_SOCK_REFUSED;
	ev->svc_id = svc->svc_id;
	ev->tuple.daddr = key->addr;
	ev->tuple.dport = key->port;
	ev->tuple.proto = key->proto;
	if (be) {
		ev->to = be->addr;
		ev->to_port = be->port;
	}
	bpf_map_update_elem(&np_trace_log, &ev->tuple, ev, BPF_ANY);
}

/* Whether a known connection must choose a backend again: a TCP SYN reusing the tuple of a
 * closed connection, or a UDP flow whose backend left the service's backend set (kube-proxy
 * deletes the UDP conntrack entries of removed endpoints; TCP connections keep their
 * backend until they end). */
static __always_inline int np_ct_stale(const struct np_ct_val *ct, const struct np_pkt *p,
				       const struct np_svc_val *svc)
{
	struct np_member_key mk = {};

	if (p->proto == IPPROTO_TCP)
		return (ct->flags & NP_CT_CLOSING) && (p->tcp_flags & TCP_FLAG_SYN) &&
		       !(p->tcp_flags & 0x10);
	if (!svc)
		return 0;
	mk.be_set = svc->be_set;
	mk.addr = ct->daddr;
	mk.port = ct->dport;
	return bpf_map_lookup_elem(&np_members, &mk) == 0;
}

/* ICMP errors about translated connections (destination unreachable, fragmentation needed,
 * time exceeded, parameter problem; ICMPv6 likewise, packet too big included), translated as
 * Linux's NAT (nf_nat_icmp_reply_translation) and Cilium's do: the packet the error quotes
 * is one direction of a known connection, so the error is turned into the error its other
 * end would have received had there been no translation. The quoted packet's swapped tuple
 * is a key of np_nat (an error from the backend's side: the backend's stack, or a router
 * towards it) or of np_ct (from the client's side); its translation v gives:
 *   quoted source := v.daddr:v.dport, quoted destination := v.saddr:v.sport,
 *   outer destination := v.daddr, outer source := v.saddr when the error comes from the
 *   peer itself (a router keeps its own address),
 * with the quoted IPv4 header checksum, a quoted UDP checksum, the outer IPv4 header checksum
 * and the ICMP checksum (ICMPv6's pseudo-header too) patched to match. At ingress the error
 * is then forwarded as the connection's packets are; at egress it leaves as it is.
 * Quoted packets must have no IPv4 options or IPv6 extension headers, as the programs'
 * own parsing requires. */
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PARAMETERPROB 12

struct np_icmp_err {
	__u32 icmp_off;   /* the ICMP header */
	__u32 in_off;     /* the quoted IP header */
	__u32 in_l4_off;  /* the quoted L4 header */
	__u8 in_proto;
	struct np_ct_key key; /* the quoted packet's tuple, swapped */
	struct np_addr outer_src;
	struct np_addr outer_dst;
};

/* Whether the packet is an ICMP error quoting a TCP or UDP packet; fills `e`. */
static __always_inline int np_icmp_parse(struct __sk_buff *skb, struct np_pkt *p,
					 struct np_icmp_err *e)
{
	struct ethhdr eth;
	__u16 ports[2];
	__u8 type;

	__builtin_memset(p, 0, sizeof(*p));
	__builtin_memset(e, 0, sizeof(*e));
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
		return 0;
	p->eth_proto = eth.h_proto;
	p->l3_off = sizeof(eth);
	if (eth.h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr ip, in;

		if (bpf_skb_load_bytes(skb, p->l3_off, &ip, sizeof(ip)) < 0)
			return 0;
		if (ip.ihl != 5 || (ip.frag_off & bpf_htons(0x3fff)) || ip.protocol != IPPROTO_ICMP)
			return 0;
		e->icmp_off = p->l3_off + sizeof(ip);
		if (bpf_skb_load_bytes(skb, e->icmp_off, &type, 1) < 0)
			return 0;
		if (type != ICMP_DEST_UNREACH && type != ICMP_TIME_EXCEEDED && type != ICMP_PARAMETERPROB)
			return 0;
		e->in_off = e->icmp_off + sizeof(struct icmphdr);
		if (bpf_skb_load_bytes(skb, e->in_off, &in, sizeof(in)) < 0 || in.ihl != 5)
			return 0;
		e->in_proto = in.protocol;
		e->in_l4_off = e->in_off + sizeof(in);
		np_addr_v4(&e->key.saddr, in.daddr);
		np_addr_v4(&e->key.daddr, in.saddr);
		np_addr_v4(&e->outer_src, ip.saddr);
		np_addr_v4(&e->outer_dst, ip.daddr);
		p->proto = IPPROTO_ICMP;
	} else if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6, in6;

		if (bpf_skb_load_bytes(skb, p->l3_off, &ip6, sizeof(ip6)) < 0 ||
		    ip6.nexthdr != IPPROTO_ICMPV6)
			return 0;
		e->icmp_off = p->l3_off + sizeof(ip6);
		if (bpf_skb_load_bytes(skb, e->icmp_off, &type, 1) < 0)
			return 0;
		if (type != ICMPV6_DEST_UNREACH && type != ICMPV6_PKT_TOOBIG &&
		    type != ICMPV6_TIME_EXCEED && type != ICMPV6_PARAMPROB)
			return 0;
		e->in_off = e->icmp_off + sizeof(struct icmp6hdr);
		if (bpf_skb_load_bytes(skb, e->in_off, &in6, sizeof(in6)) < 0)
			return 0;
		e->in_proto = in6.nexthdr;
		e->in_l4_off = e->in_off + sizeof(in6);
		__builtin_memcpy(&e->key.saddr, &in6.daddr, 16);
		__builtin_memcpy(&e->key.daddr, &in6.saddr, 16);
		__builtin_memcpy(&e->outer_src, &ip6.saddr, 16);
		__builtin_memcpy(&e->outer_dst, &ip6.daddr, 16);
		p->proto = IPPROTO_ICMPV6;
	} else {
		return 0;
	}
	if (e->in_proto != IPPROTO_TCP && e->in_proto != IPPROTO_UDP)
		return 0;
	if (bpf_skb_load_bytes(skb, e->in_l4_off, ports, sizeof(ports)) < 0)
		return 0;
	e->key.sport = ports[1];
	e->key.dport = ports[0];
	e->key.proto = e->in_proto;
	return 1;
}

/* Rewrites a 16-byte or 4-byte address at `off` and patches the checksum at `csum_off`
 * (`pseudo`: the address is in that checksum's pseudo-header, not in its data). */
static __always_inline int np_icmp_set_addr(struct __sk_buff *skb, int v4, __u32 off,
					    __u32 csum_off, int pseudo,
					    const struct np_addr *from, const struct np_addr *to)
{
	if (np_addr_eq(from, to))
		return 0;
	if (v4) {
		__u32 old = from->w[3], new = to->w[3];

		if (bpf_l3_csum_replace(skb, csum_off, old, new, sizeof(new)) < 0)
			return -1;
		return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
	}
	if (pseudo) {
		__s64 diff = bpf_csum_diff((__be32 *)from->w, 16, (__be32 *)to->w, 16, 0);

		if (bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR) < 0)
			return -1;
	}
	return bpf_skb_store_bytes(skb, off, to->w, 16, 0);
}

/* Translates an ICMP error about a known connection; returns the verdict (TC_ACT_OK for a
 * packet that is none). */
static __always_inline int np_icmp_error(struct __sk_buff *skb, int ingress)
{
	struct np_icmp_err e;
	struct np_ct_val *v;
	struct np_pkt p;
	struct np_addr new_src;
	__u32 before[12] = {}, after[12] = {};
	__u32 ip_csum_off;
	__u16 sport, dport;
	__s64 diff;
	int v4;

	if (!np_icmp_parse(skb, &p, &e))
		return TC_ACT_OK;
	v = bpf_map_lookup_elem(&np_nat, &e.key);
	if (!v)
		v = bpf_map_lookup_elem(&np_ct, &e.key);
	if (!v)
		return TC_ACT_OK;
	v4 = p.eth_proto == bpf_htons(ETH_P_IP);
	/* The quoted IP header and the first 8 bytes of its L4 header, before and after. */
	if (bpf_skb_load_bytes(skb, e.in_off, before, v4 ? 28 : 48) < 0)
		return TC_ACT_OK;

	/* The quoted packet: its source becomes v's destination, its destination v's source. */
	if (v4) {
		__u32 csum = e.in_off + offsetof(struct iphdr, check);

		if (np_icmp_set_addr(skb, 1, e.in_off + offsetof(struct iphdr, saddr), csum, 0,
				     &e.key.daddr, &v->daddr) < 0 ||
		    np_icmp_set_addr(skb, 1, e.in_off + offsetof(struct iphdr, daddr), csum, 0,
				     &e.key.saddr, &v->saddr) < 0)
			return TC_ACT_SHOT;
	} else {
		if (np_icmp_set_addr(skb, 0, e.in_off + offsetof(struct ipv6hdr, saddr), 0, 0,
				     &e.key.daddr, &v->daddr) < 0 ||
		    np_icmp_set_addr(skb, 0, e.in_off + offsetof(struct ipv6hdr, daddr), 0, 0,
				     &e.key.saddr, &v->saddr) < 0)
			return TC_ACT_SHOT;
	}
	sport = v->dport;
	dport = v->sport;
	if (bpf_skb_store_bytes(skb, e.in_l4_off, &sport, 2, 0) < 0 ||
	    bpf_skb_store_bytes(skb, e.in_l4_off + 2, &dport, 2, 0) < 0)
		return TC_ACT_SHOT;
	if (e.in_proto == IPPROTO_UDP) {
		/* The quoted UDP checksum, when it has one: the addresses of its pseudo-header and
		 * the ports changed. */
		__u16 check;
		__u32 off = e.in_l4_off + offsetof(struct udphdr, check);

		if (bpf_skb_load_bytes(skb, off, &check, 2) < 0)
			return TC_ACT_SHOT;
		if (check) {
			__s64 d = bpf_csum_diff((__be32 *)e.key.daddr.w, 16, (__be32 *)v->daddr.w, 16, 0);

			d = bpf_csum_diff((__be32 *)e.key.saddr.w, 16, (__be32 *)v->saddr.w, 16, d);
			if (bpf_l3_csum_replace(skb, off, 0, d, 0) < 0 ||
			    bpf_l3_csum_replace(skb, off, e.key.dport, sport, 2) < 0 ||
			    bpf_l3_csum_replace(skb, off, e.key.sport, dport, 2) < 0)
				return TC_ACT_SHOT;
		}
	}
	/* The ICMP checksum covers the quoted bytes: patched by their difference. */
	if (bpf_skb_load_bytes(skb, e.in_off, after, v4 ? 28 : 48) < 0)
		return TC_ACT_SHOT;
	diff = bpf_csum_diff((__be32 *)before, v4 ? 28 : 48, (__be32 *)after, v4 ? 28 : 48, 0);
	if (bpf_l3_csum_replace(skb, e.icmp_off + 2, 0, diff, 0) < 0)
		return TC_ACT_SHOT;

	/* The outer header: to the other end, from the peer's translated address. */
	new_src = np_addr_eq(&e.outer_src, &e.key.saddr) ? v->saddr : e.outer_src;
	ip_csum_off = v4 ? p.l3_off + offsetof(struct iphdr, check) : e.icmp_off + 2;
	if (np_icmp_set_addr(skb, v4,
			     p.l3_off + (v4 ? offsetof(struct iphdr, daddr) : offsetof(struct ipv6hdr, daddr)),
			     ip_csum_off, 1, &e.outer_dst, &v->daddr) < 0 ||
	    np_icmp_set_addr(skb, v4,
			     p.l3_off + (v4 ? offsetof(struct iphdr, saddr) : offsetof(struct ipv6hdr, saddr)),
			     ip_csum_off, 1, &e.outer_src, &new_src) < 0)
		return TC_ACT_SHOT;
	if (!ingress)
		return TC_ACT_OK;
	return np_forward(skb, &p);
}

SEC("classifier")
int np_tc_ingress(struct __sk_buff *skb)
{
	struct np_svc_key key = {};
	struct np_svc_val *svc;
	struct np_ct_val *ct;
	struct np_pkt p;
	int verdict;

	if (np_parse(skb, &p) < 0)
		return np_icmp_error(skb, 1);
	if (np_reverse(skb, &p, &verdict))
		return verdict == TC_ACT_OK ? np_forward(skb, &p) : verdict;
	key.addr = p.tuple.daddr;
	key.port = p.tuple.dport;
	key.proto = p.tuple.proto;
	key.scope = NP_SCOPE_EXT;
	svc = bpf_map_lookup_elem(&np_services, &key);
	ct = bpf_map_lookup_elem(&np_ct, &p.tuple);
	if (ct && !np_ct_stale(ct, &p, svc)) {
		np_touch(ct, &p, 0);
		return np_translate(skb, &p, ct) < 0 ? TC_ACT_SHOT : np_forward(skb, &p);
	}
	if (!svc)
		return TC_ACT_OK;
	/* A later fragment of a datagram whose first fragment opened nothing. */
	if (p.frag == NP_FRAG_LATER)
		return TC_ACT_SHOT;
	if (svc->count == 0) {
		np_trace_tc(skb, &p, svc, TC_ACT_SHOT);
		if (svc->flags & NP_SVC_REJECT)
			return p.eth_proto == bpf_htons(ETH_P_IP) ? np_reject_v4(skb, &p)
								   : np_reject_v6(skb, &p);
		return TC_ACT_SHOT;
	}
	verdict = np_open(skb, &p, svc);
	np_trace_tc(skb, &p, svc, verdict);
	return verdict == TC_ACT_OK ? np_forward(skb, &p) : verdict;
}

SEC("classifier")
int np_tc_egress(struct __sk_buff *skb)
{
	struct np_pkt p;
	int verdict;

	if (np_parse(skb, &p) < 0)
		return np_icmp_error(skb, 0);
	if (np_reverse(skb, &p, &verdict))
		return verdict;
	return TC_ACT_OK;
}

/* Socket programs. The client of affinity is the socket's network namespace.
 *
 * A frontend with loadBalancerSourceRanges is translated here only when the socket's source
 * is known and inside them: the address it is bound to, or for sendmsg the one the message
 * names (IP_PKTINFO). connect() on an unbound socket has no source yet (routing picks it
 * afterwards), so such a socket, and one whose source is outside the ranges, is passed on
 * untranslated: its packets meet np_tc_ingress, which checks their real source as
 * kube-proxy's firewall chain does for every source, pods included. (Cilium's bpf_sock.c
 * does no source range check; its tc programs do, as ours do.) */

static __always_inline int np_sock_connect(struct bpf_sock_addr *ctx, struct np_addr *dst,
					   const struct np_addr *src, int src_known, int udp_only)
{
	struct np_svc_key key = {};
	struct np_sock_key rk = {};
	struct np_sock_val rv = {};
	struct np_addr client = {};
	struct np_svc_val *svc;
	struct np_be_val *be;
	__u64 netns, now = bpf_ktime_get_ns();
	__u32 proto = ctx->protocol;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return -1;
	if (udp_only && proto != IPPROTO_UDP)
		return -1;
	key.addr = *dst;
	key.port = (__u16)ctx->user_port;
	key.proto = proto;
	key.scope = NP_SCOPE_INT;
	svc = bpf_map_lookup_elem(&np_services, &key);
	if (!svc)
		return -1;
	if ((svc->flags & NP_SVC_RANGES) && (!src_known || !np_source_allowed(svc, src)))
		return -1;
	if (svc->count == 0) {
		np_trace_sock(ctx, &key, svc, 0);
		np_set_retval(-ECONNREFUSED);
		return 0;
	}
	netns = bpf_get_netns_cookie(ctx);
	__builtin_memcpy(&client, &netns, sizeof(netns));
	be = np_select(svc, &client, np_mix((__u32)netns, (__u32)(netns >> 32), (__u32)now), now);
	np_trace_sock(ctx, &key, svc, be);
	if (!be) {
		np_set_retval(-ECONNREFUSED);
		return 0;
	}
	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.addr = be->addr;
	rk.port = be->port;
	rv.addr = *dst;
	rv.port = key.port;
	bpf_map_update_elem(&np_sock_rev, &rk, &rv, BPF_ANY);
	*dst = be->addr;
	ctx->user_port = be->port;
	return 1;
}

static __always_inline int np_sock_reverse(struct bpf_sock_addr *ctx, const struct np_addr *src,
					   struct np_addr *out, __u16 *port)
{
	struct np_sock_key rk = {};
	struct np_sock_val *rv;

	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.addr = *src;
	rk.port = (__u16)ctx->user_port;
	rv = bpf_map_lookup_elem(&np_sock_rev, &rk);
	if (!rv)
		return 0;
	*out = rv->addr;
	*port = rv->port;
	return 1;
}

/* src4: the socket's source as far as it is known (0: not yet chosen). */
static __always_inline int np_connect4(struct bpf_sock_addr *ctx, __u32 src4, int udp_only)
{
	struct np_addr dst, src;
	int r;

	np_addr_v4(&dst, ctx->user_ip4);
	np_addr_v4(&src, src4);
	r = np_sock_connect(ctx, &dst, &src, src4 != 0, udp_only);
	if (r < 0)
		return 1;
	if (r == 1)
		ctx->user_ip4 = dst.w[3];
	return r;
}

/* src: the socket's source as far as it is known (all zero: not yet chosen). */
static __always_inline int np_connect6(struct bpf_sock_addr *ctx, const struct np_addr *src,
				       int udp_only)
{
	struct np_addr dst;
	int r;

	dst.w[0] = ctx->user_ip6[0];
	dst.w[1] = ctx->user_ip6[1];
	dst.w[2] = ctx->user_ip6[2];
	dst.w[3] = ctx->user_ip6[3];
	r = np_sock_connect(ctx, &dst, src, src->w[0] | src->w[1] | src->w[2] | src->w[3],
			    udp_only);
	if (r < 0)
		return 1;
	if (r == 1) {
		ctx->user_ip6[0] = dst.w[0];
		ctx->user_ip6[1] = dst.w[1];
		ctx->user_ip6[2] = dst.w[2];
		ctx->user_ip6[3] = dst.w[3];
	}
	return r;
}

static __always_inline int np_reverse4(struct bpf_sock_addr *ctx)
{
	struct np_addr src, out;
	__u16 port;

	np_addr_v4(&src, ctx->user_ip4);
	if (np_sock_reverse(ctx, &src, &out, &port)) {
		ctx->user_ip4 = out.w[3];
		ctx->user_port = port;
	}
	return 1;
}

static __always_inline int np_reverse6(struct bpf_sock_addr *ctx)
{
	struct np_addr src, out;
	__u16 port;

	src.w[0] = ctx->user_ip6[0];
	src.w[1] = ctx->user_ip6[1];
	src.w[2] = ctx->user_ip6[2];
	src.w[3] = ctx->user_ip6[3];
	if (np_sock_reverse(ctx, &src, &out, &port)) {
		ctx->user_ip6[0] = out.w[0];
		ctx->user_ip6[1] = out.w[1];
		ctx->user_ip6[2] = out.w[2];
		ctx->user_ip6[3] = out.w[3];
		ctx->user_port = port;
	}
	return 1;
}

/* The address the socket is bound to (all zero when unbound). */
static __always_inline void np_bound6(struct bpf_sock_addr *ctx, struct np_addr *src)
{
	struct bpf_sock *sk = ctx->sk;

	src->w[0] = sk->src_ip6[0];
	src->w[1] = sk->src_ip6[1];
	src->w[2] = sk->src_ip6[2];
	src->w[3] = sk->src_ip6[3];
}

SEC("cgroup/connect4")
int np_connect4_prog(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;

	return np_connect4(ctx, sk->src_ip4, 0);
}

SEC("cgroup/connect6")
int np_connect6_prog(struct bpf_sock_addr *ctx)
{
	struct np_addr src;

	np_bound6(ctx, &src);
	return np_connect6(ctx, &src, 0);
}

SEC("cgroup/sendmsg4")
int np_sendmsg4_prog(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	__u32 src4 = ctx->msg_src_ip4;

	return np_connect4(ctx, src4 ? src4 : sk->src_ip4, 1);
}

SEC("cgroup/sendmsg6")
int np_sendmsg6_prog(struct bpf_sock_addr *ctx)
{
	struct np_addr src;

	src.w[0] = ctx->msg_src_ip6[0];
	src.w[1] = ctx->msg_src_ip6[1];
	src.w[2] = ctx->msg_src_ip6[2];
	src.w[3] = ctx->msg_src_ip6[3];
	if (!(src.w[0] | src.w[1] | src.w[2] | src.w[3]))
		np_bound6(ctx, &src);
	return np_connect6(ctx, &src, 1);
}

SEC("cgroup/recvmsg4")
int np_recvmsg4_prog(struct bpf_sock_addr *ctx)
{
	return np_reverse4(ctx);
}

SEC("cgroup/recvmsg6")
int np_recvmsg6_prog(struct bpf_sock_addr *ctx)
{
	return np_reverse6(ctx);
}

SEC("cgroup/getpeername4")
int np_getpeername4_prog(struct bpf_sock_addr *ctx)
{
	return np_reverse4(ctx);
}

SEC("cgroup/getpeername6")
int np_getpeername6_prog(struct bpf_sock_addr *ctx)
{
	return np_reverse6(ctx);
}
