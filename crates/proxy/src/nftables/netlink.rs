//! The kernel over netlink: transactions encoded as nf_tables netlink batches and sent on a
//! `NETLINK_NETFILTER` socket, without the `nft` binary.
//!
//! Why: `nft -f` parses text and, before every transaction, dumps the table into its cache.
//! At 10,000 Services (110,000 chains) that dump alone costs seconds, so one changed Service
//! would take seconds to program; a netlink batch of the few changed objects takes
//! milliseconds. (kube-proxy also broke when the host's `nft` segfaulted, kubernetes#136786.)
//!
//! The encoding is the one `nft` itself produces (the same expressions, registers, set key
//! types and user data), so `nft list ruleset` prints our rules exactly as if `nft -f` had
//! loaded them; the kernel tests compare both listings and the rules' bytecode
//! (`nft --debug=netlink list ruleset`), so that even nft's shortcuts are reproduced (a
//! byte-aligned prefix such as `127.0.0.0/8` loads and compares only its leading bytes). The few forms this encoder does not
//! produce (anonymous sets: kube-proxy's inline `numgen ... vmap { }` and the firewall
//! chain's `ip saddr != { ... }`) make the whole transaction go through `nft -f` instead.
//!
//! A batch is `NFNL_MSG_BATCH_BEGIN`, the operations, `NFNL_MSG_BATCH_END`, in one `sendmsg`
//! (the kernel commits or aborts it whole); the socket's buffers are sized to the batch.
//! Only the last operation asks for an acknowledgement, so success costs one reply; every
//! failing operation is reported with its sequence number and mapped back to the operation.

pub mod nftrace;

use std::net::IpAddr;
use std::os::fd::AsFd;
use std::time::Duration;

use ipnet::IpNet;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::apply::{Existing, Kernel, KernelError, NftCommand, TransactionSink};
use super::ruleset::{
    AddrMatch, AffinityKey, ChainType, CtKey, ElemKey, Element, Expr, Hook, KeyType, LookupKey,
    MapKey, Op, Rule, Set, TABLE, TABLE_COMMENT, Transaction, Verdict, ct_state,
};
use crate::model::{IpFamily, Protocol};

// linux/netfilter/nfnetlink.h, nf_tables.h (values are ABI).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_DELRULE: u16 = 8;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_GETSET: u16 = 10;
const NFT_MSG_DELSET: u16 = 11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;

const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_USERDATA: u16 = 6;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DATA_TYPE: u16 = 6;
const NFTA_SET_DATA_LEN: u16 = 7;
const NFTA_SET_DESC: u16 = 9;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_TIMEOUT: u16 = 11;
const NFTA_SET_USERDATA: u16 = 13;
const NFTA_SET_DESC_SIZE: u16 = 1;
const NFTA_SET_DESC_CONCAT: u16 = 2;
const NFTA_SET_FIELD_LEN: u16 = 1;
const NFT_SET_INTERVAL: u32 = 0x4;
const NFT_SET_MAP: u32 = 0x8;
const NFT_SET_TIMEOUT: u32 = 0x10;
const NFT_SET_EVAL: u32 = 0x20;
const NFT_SET_CONCAT: u32 = 0x80;
const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_USERDATA: u16 = 6;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

// Registers: NFT_REG_VERDICT, NFT_REG_1 (16 bytes), and the 32-bit ones for concatenations.
const REG_VERDICT: u32 = 0;
const REG_1: u32 = 1;
const REG_2: u32 = 2;
const REG32_00: u32 = 8;

// Verdict codes.
const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NFT_RETURN: i32 = -5;

// nft's data type ids (datatype.h), stored as the set key type and decoded by `nft list`.
const TYPE_VERDICT: u32 = 1;
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const TYPE_BITS: u32 = 6;
const TYPE_INTEGER: u32 = 4;
// libnftnl user data: set comment, element / rule / table comment.
const UDATA_SET_COMMENT: u8 = 7;
const UDATA_COMMENT: u8 = 0;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A netlink message buffer with nested attributes.
struct Buf {
    b: Vec<u8>,
}

impl Buf {
    /// Sets `NLM_F_ACK` on the message that starts at `offset`.
    fn request_ack(&mut self, offset: usize) {
        let at = offset + 6;
        let flags = u16::from_ne_bytes([self.b[at], self.b[at + 1]]) | NLM_F_ACK;
        self.b[at..at + 2].copy_from_slice(&flags.to_ne_bytes());
    }

    fn begin(&mut self, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> usize {
        let start = self.b.len();
        self.b.extend_from_slice(&0u32.to_ne_bytes()); // length, patched in end()
        self.b.extend_from_slice(&ty.to_ne_bytes());
        self.b.extend_from_slice(&flags.to_ne_bytes());
        self.b.extend_from_slice(&seq.to_ne_bytes());
        self.b.extend_from_slice(&0u32.to_ne_bytes()); // port id
        // struct nfgenmsg
        self.b.push(family);
        self.b.push(0); // NFNETLINK_V0
        self.b.extend_from_slice(&res_id.to_be_bytes());
        start
    }

    /// Begins an nf_tables message `msg` (resource id 0, as nft sends them).
    fn begin_nft(&mut self, msg: u16, flags: u16, seq: u32, family: u8) -> usize {
        self.begin((NFNL_SUBSYS_NFTABLES << 8) | msg, flags, seq, family, 0)
    }

    /// Begins an nf_tables message about the object `name` of our table: `attrs` are the
    /// message's (table, name) attribute types.
    fn begin_named(
        &mut self,
        msg: u16,
        flags: u16,
        seq: u32,
        family: u8,
        attrs: (u16, u16),
        name: &str,
    ) -> usize {
        let m = self.begin_nft(msg, flags, seq, family);
        self.str(attrs.0, TABLE);
        self.str(attrs.1, name);
        m
    }

    fn end(&mut self, start: usize) {
        let len = (self.b.len() - start) as u32;
        self.b[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    fn attr(&mut self, ty: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.b.extend_from_slice(&(len as u16).to_ne_bytes());
        self.b.extend_from_slice(&ty.to_ne_bytes());
        self.b.extend_from_slice(data);
        self.b.resize(self.b.len() + (align4(len) - len), 0);
    }

    /// A user-data attribute holding one comment TLV (what [`udata_comment`] builds), written
    /// in place.
    fn comment_udata(&mut self, ty: u16, comment: &str) {
        let text = &comment.as_bytes()[..comment.len().min(254)];
        let len = 4 + 2 + text.len() + 1;
        self.b.extend_from_slice(&(len as u16).to_ne_bytes());
        self.b.extend_from_slice(&ty.to_ne_bytes());
        self.b
            .extend_from_slice(&[UDATA_COMMENT, (comment.len() + 1).min(255) as u8]);
        self.b.extend_from_slice(text);
        self.b.push(0);
        self.b.resize(self.b.len() + (align4(len) - len), 0);
    }

    fn str(&mut self, ty: u16, s: &str) {
        let mut v = Vec::with_capacity(s.len() + 1);
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        self.attr(ty, &v);
    }

    fn u32be(&mut self, ty: u16, v: u32) {
        self.attr(ty, &v.to_be_bytes());
    }

    fn nest(&mut self, ty: u16) -> usize {
        let start = self.b.len();
        self.b.extend_from_slice(&0u16.to_ne_bytes());
        self.b.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        start
    }

    fn close(&mut self, start: usize) {
        let len = (self.b.len() - start) as u16;
        self.b[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }

    /// `NFTA_DATA_VALUE` inside a nest of type `ty`.
    fn data_value(&mut self, ty: u16, value: &[u8]) {
        let n = self.nest(ty);
        self.attr(NFTA_DATA_VALUE, value);
        self.close(n);
    }

    fn verdict_data(&mut self, ty: u16, v: &Verdict) {
        let n = self.nest(ty);
        let vn = self.nest(NFTA_DATA_VERDICT);
        let (code, chain) = match v {
            Verdict::Jump(c) => (NFT_JUMP, Some(c)),
            Verdict::Goto(c) => (NFT_GOTO, Some(c)),
            Verdict::Drop => (NF_DROP, None),
            Verdict::Accept => (NF_ACCEPT, None),
            Verdict::Return => (NFT_RETURN, None),
            Verdict::Reject => unreachable!("reject is an expression, not a verdict code"),
        };
        self.attr(NFTA_VERDICT_CODE, &code.to_be_bytes());
        if let Some(c) = chain {
            self.str(NFTA_VERDICT_CHAIN, c);
        }
        self.close(vn);
        self.close(n);
    }

    /// One expression: `NFTA_LIST_ELEM { NAME, DATA { ... } }`, `f` writes the data.
    fn expr(&mut self, name: &str, f: impl FnOnce(&mut Buf)) {
        let e = self.nest(NFTA_LIST_ELEM);
        self.str(NFTA_EXPR_NAME, name);
        let d = self.nest(NFTA_EXPR_DATA);
        f(self);
        self.close(d);
        self.close(e);
    }
}

/// User data TLVs (libnftnl's `nftnl_udata`): type, length, NUL-terminated string.
fn udata_comment(ty: u8, comment: &str) -> Vec<u8> {
    let mut v = vec![ty, (comment.len() + 1).min(255) as u8];
    v.extend_from_slice(&comment.as_bytes()[..comment.len().min(254)]);
    v.push(0);
    v
}

fn nfproto(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => NFPROTO_IPV4,
        IpFamily::V6 => NFPROTO_IPV6,
    }
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// An operation this encoder does not produce (anonymous sets).
#[derive(Debug)]
pub(crate) struct Unsupported;

/// Offsets of `ip saddr`/`ip daddr` (and IPv6) in the network header, and the length.
fn addr_field(family: IpFamily, dst: bool) -> (u32, u32) {
    match (family, dst) {
        (IpFamily::V4, false) => (12, 4),
        (IpFamily::V4, true) => (16, 4),
        (IpFamily::V6, false) => (8, 16),
        (IpFamily::V6, true) => (24, 16),
    }
}

const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;

fn payload(b: &mut Buf, reg: u32, base: u32, offset: u32, len: u32) {
    b.expr("payload", |b| {
        b.u32be(NFTA_PAYLOAD_DREG, reg);
        b.u32be(NFTA_PAYLOAD_BASE, base);
        b.u32be(NFTA_PAYLOAD_OFFSET, offset);
        b.u32be(NFTA_PAYLOAD_LEN, len);
    });
}

const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;

fn cmp(b: &mut Buf, reg: u32, negate: bool, value: &[u8]) {
    b.expr("cmp", |b| {
        b.u32be(NFTA_CMP_SREG, reg);
        b.u32be(NFTA_CMP_OP, if negate { NFT_CMP_NEQ } else { NFT_CMP_EQ });
        b.data_value(NFTA_CMP_DATA, value);
    });
}

const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;

fn bitwise(b: &mut Buf, reg: u32, mask: &[u8], xor: &[u8]) {
    b.expr("bitwise", |b| {
        b.u32be(NFTA_BITWISE_SREG, reg);
        b.u32be(NFTA_BITWISE_DREG, reg);
        b.u32be(NFTA_BITWISE_LEN, mask.len() as u32);
        b.data_value(NFTA_BITWISE_MASK, mask);
        b.data_value(NFTA_BITWISE_XOR, xor);
    });
}

const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFTA_CT_DIRECTION: u16 = 3;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_STATUS: u32 = 2;
const NFT_CT_PROTO_DST: u32 = 12;
const NFT_CT_SRC_IP: u32 = 19;
const NFT_CT_DST_IP: u32 = 20;
const NFT_CT_SRC_IP6: u32 = 21;
const NFT_CT_DST_IP6: u32 = 22;

const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFTA_META_SREG: u16 = 3;
const NFT_META_MARK: u32 = 3;
const NFT_META_L4PROTO: u32 = 16;

fn meta_load(b: &mut Buf, key: u32, reg: u32) {
    b.expr("meta", |b| {
        b.u32be(NFTA_META_DREG, reg);
        b.u32be(NFTA_META_KEY, key);
    });
}

const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_LOOKUP_SREG: u16 = 2;
const NFTA_LOOKUP_DREG: u16 = 3;
const NFTA_LOOKUP_FLAGS: u16 = 5;

fn lookup(b: &mut Buf, set: &str, sreg: u32, dreg: Option<u32>, invert: bool) {
    b.expr("lookup", |b| {
        b.str(NFTA_LOOKUP_SET, set);
        b.u32be(NFTA_LOOKUP_SREG, sreg);
        if let Some(d) = dreg {
            b.u32be(NFTA_LOOKUP_DREG, d);
        }
        if invert {
            b.u32be(NFTA_LOOKUP_FLAGS, 1);
        }
    });
}

fn immediate_verdict(b: &mut Buf, v: &Verdict) {
    b.expr("immediate", |b| {
        b.u32be(1, REG_VERDICT); // NFTA_IMMEDIATE_DREG
        b.verdict_data(2, v); // NFTA_IMMEDIATE_DATA
    });
}

fn immediate_value(b: &mut Buf, reg: u32, value: &[u8]) {
    b.expr("immediate", |b| {
        b.u32be(1, reg);
        b.data_value(2, value);
    });
}

/// Loads an address match into reg 1 and compares it.
fn addr_match(
    b: &mut Buf,
    family: IpFamily,
    dst: bool,
    negate: bool,
    m: &AddrMatch,
) -> Result<(), Unsupported> {
    let (offset, len) = addr_field(family, dst);
    match m {
        AddrMatch::Addr(ip) => {
            payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
            cmp(b, REG_1, negate, &ip_bytes(*ip));
        }
        AddrMatch::Net(net) => prefix_match(b, offset, negate, net),
        AddrMatch::Set(name) => {
            payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
            lookup(b, name, REG_1, None, negate);
        }
        // nft turns a one-element anonymous set into a plain comparison.
        AddrMatch::Nets(nets) if nets.len() == 1 => prefix_match(b, offset, negate, &nets[0]),
        AddrMatch::Nets(_) => return Err(Unsupported),
    }
    Ok(())
}

/// An address compared with a prefix, as nft encodes it: the whole address for a host
/// prefix; only the prefix's bytes when it ends on a byte boundary (`127.0.0.0/8` loads one
/// byte); else the whole address, masked.
fn prefix_match(b: &mut Buf, offset: u32, negate: bool, net: &ipnet::IpNet) {
    let network = ip_bytes(net.network());
    let bits = usize::from(net.prefix_len());
    if net.prefix_len() == net.max_prefix_len() {
        payload(
            b,
            REG_1,
            NFT_PAYLOAD_NETWORK_HEADER,
            offset,
            network.len() as u32,
        );
        cmp(b, REG_1, negate, &ip_bytes(net.addr()));
    } else if bits > 0 && bits % 8 == 0 {
        let n = bits / 8;
        payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, n as u32);
        cmp(b, REG_1, negate, &network[..n]);
    } else {
        payload(
            b,
            REG_1,
            NFT_PAYLOAD_NETWORK_HEADER,
            offset,
            network.len() as u32,
        );
        let mask = ip_bytes(net.netmask());
        bitwise(b, REG_1, &mask, &vec![0; mask.len()]);
        cmp(b, REG_1, negate, &network);
    }
}

/// One field of a concatenated key, loaded into consecutive 32-bit registers.
#[derive(Debug, Clone, Copy)]
enum Field {
    Daddr,
    Saddr,
    L4proto,
    /// `meta l4proto` in an interval set's key: nft converts it to big endian (`byteorder
    /// hton`), as ranges are compared bytewise.
    L4protoBigEndian,
    Dport,
    /// `numgen random mod <m> offset <o>`.
    Numgen(u32, u32),
    /// `ct original ip saddr`.
    CtOrigSaddr,
    /// `ct original ip daddr`.
    CtOrigDaddr,
    /// `ct original proto-dst`.
    CtOrigProtoDst,
}

/// `ct load <key> => reg, dir original`.
fn ct_original(b: &mut Buf, key: u32, reg: u32) {
    b.expr("ct", |b| {
        b.u32be(NFTA_CT_DREG, reg);
        b.u32be(NFTA_CT_KEY, key);
        b.attr(NFTA_CT_DIRECTION, &[0]); // IP_CT_DIR_ORIGINAL
    });
}

/// Loads `fields` as nft does for a concatenation: the first at reg 1, each next one in
/// the 32-bit register after the previous one's padded length.
fn load_fields(b: &mut Buf, family: IpFamily, fields: &[Field]) {
    let mut slot = 0;
    for f in fields {
        let reg = if slot == 0 { REG_1 } else { REG32_00 + slot };
        let len = match f {
            Field::Daddr | Field::Saddr => {
                let (offset, len) = addr_field(family, matches!(f, Field::Daddr));
                payload(b, reg, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
                len
            }
            Field::L4proto | Field::L4protoBigEndian => {
                meta_load(b, NFT_META_L4PROTO, reg);
                if matches!(f, Field::L4protoBigEndian) {
                    b.expr("byteorder", |b| {
                        b.u32be(1, reg); // NFTA_BYTEORDER_SREG
                        b.u32be(2, reg); // NFTA_BYTEORDER_DREG
                        b.u32be(3, 1); // NFTA_BYTEORDER_OP = NFT_BYTEORDER_HTON
                        b.u32be(4, 1); // NFTA_BYTEORDER_LEN
                        b.u32be(5, 2); // NFTA_BYTEORDER_SIZE
                    });
                }
                4
            }
            Field::Dport => {
                payload(b, reg, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
                4
            }
            Field::Numgen(modulus, offset) => {
                b.expr("numgen", |b| {
                    b.u32be(1, reg); // NFTA_NG_DREG
                    b.u32be(2, *modulus); // NFTA_NG_MODULUS
                    b.u32be(3, 1); // NFTA_NG_TYPE = NFT_NG_RANDOM
                    b.u32be(4, *offset); // NFTA_NG_OFFSET
                });
                4
            }
            Field::CtOrigSaddr | Field::CtOrigDaddr => {
                let src = matches!(f, Field::CtOrigSaddr);
                let key = match (family, src) {
                    (IpFamily::V4, true) => NFT_CT_SRC_IP,
                    (IpFamily::V4, false) => NFT_CT_DST_IP,
                    (IpFamily::V6, true) => NFT_CT_SRC_IP6,
                    (IpFamily::V6, false) => NFT_CT_DST_IP6,
                };
                ct_original(b, key, reg);
                addr_field(family, true).1
            }
            Field::CtOrigProtoDst => {
                ct_original(b, NFT_CT_PROTO_DST, reg);
                4
            }
        };
        slot += len / 4;
    }
}

/// `dnat <ip> to <fields> map @<map>`: the key loaded, looked up into reg 1, and the data
/// (`addr . port`: the address in reg 1, the port in the 32-bit register after it) DNATed to.
fn dnat_to_map_data(b: &mut Buf, family: IpFamily, fields: &[Field], map: &str) {
    load_fields(b, family, fields);
    lookup(b, map, REG_1, Some(REG_1), false);
    let port_reg = REG32_00 + addr_field(family, true).1 / 4;
    b.expr("nat", |b| {
        b.u32be(1, 1); // NFTA_NAT_TYPE = NFT_NAT_DNAT
        b.u32be(2, u32::from(nfproto(family))); // NFTA_NAT_FAMILY
        b.u32be(3, REG_1); // NFTA_NAT_REG_ADDR_MIN
        b.u32be(4, REG_1); // NFTA_NAT_REG_ADDR_MAX
        b.u32be(5, port_reg); // NFTA_NAT_REG_PROTO_MIN
        b.u32be(6, port_reg); // NFTA_NAT_REG_PROTO_MAX
        // NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED
        b.u32be(7, 3); // NFTA_NAT_FLAGS
    });
}

/// Encodes a rule's expressions as nft does.
fn rule_exprs(b: &mut Buf, family: IpFamily, rule: &Rule) -> Result<(), Unsupported> {
    for e in &rule.exprs {
        match e {
            Expr::CtStateNew => {
                b.expr("ct", |b| {
                    b.u32be(NFTA_CT_DREG, REG_1);
                    b.u32be(NFTA_CT_KEY, NFT_CT_STATE);
                });
                bitwise(b, REG_1, &ct_state::NEW.to_ne_bytes(), &0u32.to_ne_bytes());
                cmp(b, REG_1, true, &0u32.to_ne_bytes());
            }
            Expr::Ct { key, negate, bits } => {
                // `ct load <key> => reg 1`, then the bits kept and compared with zero:
                // `ct state ! established,related` is `& 0x6 == 0`, `ct state
                // invalid,untracked` is `& 0x41 != 0` (nft --debug=netlink).
                let key = match key {
                    CtKey::State => NFT_CT_STATE,
                    CtKey::Status => NFT_CT_STATUS,
                };
                b.expr("ct", |b| {
                    b.u32be(NFTA_CT_DREG, REG_1);
                    b.u32be(NFTA_CT_KEY, key);
                });
                bitwise(b, REG_1, &bits.to_ne_bytes(), &0u32.to_ne_bytes());
                cmp(b, REG_1, !*negate, &0u32.to_ne_bytes());
            }
            Expr::Daddr { negate, value } => addr_match(b, family, true, *negate, value)?,
            Expr::Saddr { negate, value } => addr_match(b, family, false, *negate, value)?,
            Expr::Dport(p, port) => {
                meta_load(b, NFT_META_L4PROTO, REG_1);
                cmp(b, REG_1, false, &[proto_number(*p)]);
                payload(b, REG_1, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
                cmp(b, REG_1, false, &port.to_be_bytes());
            }
            Expr::FibSaddrLocal | Expr::FibDaddrLocal => {
                let flags = if matches!(e, Expr::FibSaddrLocal) {
                    1
                } else {
                    2
                };
                b.expr("fib", |b| {
                    b.u32be(1, REG_1); // NFTA_FIB_DREG
                    b.u32be(2, 3); // NFTA_FIB_RESULT = NFT_FIB_RESULT_ADDRTYPE
                    b.u32be(3, flags); // NFTA_FIB_FLAGS: SADDR / DADDR
                });
                cmp(b, REG_1, false, &2u32.to_ne_bytes()); // RTN_LOCAL
            }
            Expr::MarkUnset(mask) => {
                meta_load(b, NFT_META_MARK, REG_1);
                bitwise(b, REG_1, &mask.to_ne_bytes(), &0u32.to_ne_bytes());
                cmp(b, REG_1, false, &0u32.to_ne_bytes());
            }
            Expr::NumgenIs { modulus, value } => {
                b.expr("numgen", |b| {
                    b.u32be(1, REG_1); // NFTA_NG_DREG
                    b.u32be(2, *modulus); // NFTA_NG_MODULUS
                    b.u32be(3, 1); // NFTA_NG_TYPE = NFT_NG_RANDOM
                    b.u32be(4, 0); // NFTA_NG_OFFSET
                });
                cmp(b, REG_1, false, &value.to_ne_bytes());
            }
            Expr::VerdictMap { key, map } => {
                match key {
                    MapKey::DaddrProtoPort => {
                        let (offset, len) = addr_field(family, true);
                        payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
                        let next = REG32_00 + len / 4;
                        meta_load(b, NFT_META_L4PROTO, next);
                        payload(b, next + 1, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
                    }
                    MapKey::ProtoPort => {
                        meta_load(b, NFT_META_L4PROTO, REG_1);
                        payload(b, REG32_00 + 1, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
                    }
                }
                lookup(b, map, REG_1, Some(REG_VERDICT), false);
            }
            Expr::NumgenVmap(_) => return Err(Unsupported),
            Expr::Lookup { key, negate, set } => {
                let fields = match key {
                    LookupKey::DaddrProtoPort => {
                        vec![Field::Daddr, Field::L4proto, Field::Dport]
                    }
                    LookupKey::ProtoPort => vec![Field::L4proto, Field::Dport],
                    LookupKey::SaddrDaddr => vec![Field::Saddr, Field::Daddr],
                    LookupKey::DaddrProtoPortSaddr => vec![
                        Field::Daddr,
                        Field::L4protoBigEndian,
                        Field::Dport,
                        Field::Saddr,
                    ],
                    LookupKey::OrigDaddr => vec![Field::CtOrigDaddr],
                    LookupKey::OrigDaddrProtoPort => {
                        vec![Field::CtOrigDaddr, Field::L4proto, Field::CtOrigProtoDst]
                    }
                    LookupKey::ProtoOrigPort => vec![Field::L4proto, Field::CtOrigProtoDst],
                };
                load_fields(b, family, &fields);
                lookup(b, set, REG_1, None, *negate);
            }
            Expr::DnatMap {
                key,
                modulus,
                offset,
                map,
            } => {
                let mut fields = match key {
                    MapKey::DaddrProtoPort => vec![Field::Daddr, Field::L4proto, Field::Dport],
                    MapKey::ProtoPort => vec![Field::L4proto, Field::Dport],
                };
                fields.push(Field::Numgen(*modulus, *offset));
                dnat_to_map_data(b, family, &fields, map);
            }
            Expr::MarkSetOr(bits) | Expr::MarkSetXor(bits) => {
                meta_load(b, NFT_META_MARK, REG_1);
                let mask = if matches!(e, Expr::MarkSetOr(_)) {
                    !bits
                } else {
                    u32::MAX
                };
                bitwise(b, REG_1, &mask.to_ne_bytes(), &bits.to_ne_bytes());
                b.expr("meta", |b| {
                    b.u32be(NFTA_META_KEY, NFT_META_MARK);
                    b.u32be(NFTA_META_SREG, REG_1);
                });
            }
            Expr::Masquerade => b.expr("masq", |b| b.u32be(1, 0x10)), // NF_NAT_RANGE_PROTO_RANDOM_FULLY
            Expr::Dnat(p, to) => {
                meta_load(b, NFT_META_L4PROTO, REG_1);
                cmp(b, REG_1, false, &[proto_number(*p)]);
                immediate_value(b, REG_1, &ip_bytes(to.ip()));
                immediate_value(b, REG_2, &to.port().to_be_bytes());
                b.expr("nat", |b| {
                    b.u32be(1, 1); // NFTA_NAT_TYPE = NFT_NAT_DNAT
                    b.u32be(2, u32::from(nfproto(family))); // NFTA_NAT_FAMILY
                    b.u32be(3, REG_1); // NFTA_NAT_REG_ADDR_MIN
                    b.u32be(5, REG_2); // NFTA_NAT_REG_PROTO_MIN
                    b.u32be(7, 2); // NFTA_NAT_FLAGS = NF_NAT_RANGE_PROTO_SPECIFIED
                });
            }
            Expr::L4proto(p) => {
                meta_load(b, NFT_META_L4PROTO, REG_1);
                cmp(b, REG_1, false, &[proto_number(*p)]);
            }
            Expr::AffinityDnat { key, map } => {
                let mut fields = vec![Field::Saddr];
                if *key == AffinityKey::Dst {
                    fields.push(Field::Daddr);
                }
                fields.extend([Field::L4proto, Field::Dport]);
                dnat_to_map_data(b, family, &fields, map);
            }
            Expr::AffinityUpdate { key, map } => {
                let fields = affinity_update_key(*key);
                load_fields(b, family, &fields);
                // nft puts the data in the first 16-byte register after the key's.
                let data_reg = REG_1 + affinity_update_key_len(family, *key).div_ceil(16);
                let data_reg32 = REG32_00 + (data_reg - REG_1) * 4;
                let (offset, len) = addr_field(family, true);
                payload(b, data_reg, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
                payload(b, data_reg32 + len / 4, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
                b.expr("dynset", |b| {
                    b.str(1, map); // NFTA_DYNSET_SET_NAME
                    b.u32be(3, 1); // NFTA_DYNSET_OP = NFT_DYNSET_OP_UPDATE
                    b.u32be(4, REG_1); // NFTA_DYNSET_SREG_KEY
                    b.u32be(5, data_reg); // NFTA_DYNSET_SREG_DATA
                });
            }
            Expr::UpdateSaddr(set) => {
                let (offset, len) = addr_field(family, false);
                payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
                b.expr("dynset", |b| {
                    b.str(1, set); // NFTA_DYNSET_SET_NAME
                    b.u32be(3, 1); // NFTA_DYNSET_OP = NFT_DYNSET_OP_UPDATE
                    b.u32be(4, REG_1); // NFTA_DYNSET_SREG_KEY
                });
            }
            Expr::Verdict(Verdict::Reject) => {
                // nft's plain `reject`: ICMP port unreachable (ICMPv6 code 4 for ip6).
                let code = match family {
                    IpFamily::V4 => 3u8,
                    IpFamily::V6 => 4u8,
                };
                b.expr("reject", |b| {
                    b.u32be(1, 0); // NFTA_REJECT_TYPE = NFT_REJECT_ICMP_UNREACH
                    b.attr(2, &[code]); // NFTA_REJECT_ICMP_CODE
                });
            }
            Expr::Verdict(v) => immediate_verdict(b, v),
        }
    }
    Ok(())
}

/// The fields of an affinity map's key as the record rule loads them (`ct original` client
/// and destination, protocol, `ct original proto-dst`).
fn affinity_update_key(key: AffinityKey) -> Vec<Field> {
    let mut fields = vec![Field::CtOrigSaddr];
    if key == AffinityKey::Dst {
        fields.push(Field::CtOrigDaddr);
    }
    fields.extend([Field::L4proto, Field::CtOrigProtoDst]);
    fields
}

/// The length in bytes of an affinity map's key in registers (each field padded to 4 bytes).
/// nft 1.0.6 gives a dynset map statement's key one 16-byte register whatever this length
/// (see the flat module's "Session affinity"), so only keys of at most 16 bytes are encoded
/// alike by nft and by us.
pub(crate) fn affinity_update_key_len(family: IpFamily, key: AffinityKey) -> u32 {
    let addr_len = addr_field(family, true).1;
    affinity_update_key(key)
        .iter()
        .map(|f| match f {
            Field::CtOrigSaddr | Field::CtOrigDaddr => addr_len,
            _ => 4,
        })
        .sum()
}

/// Key type id, key length and concatenation field lengths of a set key, as nft computes them.
fn key_spec(key: KeyType, family: IpFamily) -> (u32, u32, Vec<u32>) {
    let (addr_type, addr_len) = match family {
        IpFamily::V4 => (TYPE_IPADDR, 4),
        IpFamily::V6 => (TYPE_IP6ADDR, 16),
    };
    match key {
        KeyType::Addr => (addr_type, addr_len, vec![]),
        KeyType::AddrProtoPort => (
            (((addr_type << TYPE_BITS) | TYPE_INET_PROTOCOL) << TYPE_BITS) | TYPE_INET_SERVICE,
            addr_len + 4 + 4,
            vec![addr_len, 1, 2],
        ),
        KeyType::ProtoPort => (
            (TYPE_INET_PROTOCOL << TYPE_BITS) | TYPE_INET_SERVICE,
            8,
            vec![1, 2],
        ),
        // Plain concatenations nft sends without field lengths (no interval).
        KeyType::AddrAddr => ((addr_type << TYPE_BITS) | addr_type, 2 * addr_len, vec![]),
        KeyType::AddrProtoPortNet => (
            (((((addr_type << TYPE_BITS) | TYPE_INET_PROTOCOL) << TYPE_BITS) | TYPE_INET_SERVICE)
                << TYPE_BITS)
                | addr_type,
            addr_len + 4 + 4 + addr_len,
            vec![addr_len, 1, 2, addr_len],
        ),
        // `typeof ... . numgen ...`: the numgen field is an `integer`.
        KeyType::AddrProtoPortSlot => (
            (((((addr_type << TYPE_BITS) | TYPE_INET_PROTOCOL) << TYPE_BITS) | TYPE_INET_SERVICE)
                << TYPE_BITS)
                | TYPE_INTEGER,
            addr_len + 12,
            vec![],
        ),
        KeyType::ProtoPortSlot => (
            (((TYPE_INET_PROTOCOL << TYPE_BITS) | TYPE_INET_SERVICE) << TYPE_BITS) | TYPE_INTEGER,
            12,
            vec![],
        ),
        // Dynamic maps: nft sends no field lengths.
        KeyType::AffinityDst => (
            (((((addr_type << TYPE_BITS) | addr_type) << TYPE_BITS) | TYPE_INET_PROTOCOL)
                << TYPE_BITS)
                | TYPE_INET_SERVICE,
            2 * addr_len + 8,
            vec![],
        ),
        KeyType::AffinityNodePort => (
            (((addr_type << TYPE_BITS) | TYPE_INET_PROTOCOL) << TYPE_BITS) | TYPE_INET_SERVICE,
            addr_len + 8,
            vec![],
        ),
    }
}

/// Bytes of one element key or datum, built without a heap allocation (the longest, an IPv6
/// `addr . proto . port . prefix`, is 40 bytes).
type ElemBytes = smallvec::SmallVec<[u8; 48]>;

/// Appends `ip`'s bytes in network order.
fn push_ip(v: &mut ElemBytes, ip: IpAddr) {
    match ip {
        IpAddr::V4(a) => v.extend_from_slice(&a.octets()),
        IpAddr::V6(a) => v.extend_from_slice(&a.octets()),
    }
}

/// Appends `proto . port`, each field padded to 4 bytes.
fn push_proto_port(v: &mut ElemBytes, p: Protocol, port: u16) {
    v.extend_from_slice(&[proto_number(p), 0, 0, 0]);
    let [hi, lo] = port.to_be_bytes();
    v.extend_from_slice(&[hi, lo, 0, 0]);
}

/// Element key bytes: each concatenated field padded to 4 bytes.
fn key_bytes(key: &ElemKey) -> ElemBytes {
    let mut v = ElemBytes::new();
    match *key {
        ElemKey::Addr(ip) => push_ip(&mut v, ip),
        ElemKey::AddrProtoPort(ip, p, port) => {
            push_ip(&mut v, ip);
            push_proto_port(&mut v, p, port);
        }
        ElemKey::ProtoPort(p, port) => push_proto_port(&mut v, p, port),
        ElemKey::AddrAddr(a, b) => {
            push_ip(&mut v, a);
            push_ip(&mut v, b);
        }
        ElemKey::AddrProtoPortNet(ip, p, port, net) => {
            push_ip(&mut v, ip);
            push_proto_port(&mut v, p, port);
            push_ip(&mut v, net.network());
        }
        ElemKey::AddrProtoPortSlot(ip, p, port, slot) => {
            push_ip(&mut v, ip);
            push_proto_port(&mut v, p, port);
            // numgen writes its register in host order.
            v.extend_from_slice(&slot.to_ne_bytes());
        }
        ElemKey::ProtoPortSlot(p, port, slot) => {
            push_proto_port(&mut v, p, port);
            v.extend_from_slice(&slot.to_ne_bytes());
        }
        ElemKey::AddrAddrProtoPort(a, b, p, port) => {
            push_ip(&mut v, a);
            push_ip(&mut v, b);
            push_proto_port(&mut v, p, port);
        }
    }
    v
}

/// The end of an interval key (the last address of the prefix), for interval sets.
fn key_end_bytes(key: &ElemKey) -> Option<ElemBytes> {
    let ElemKey::AddrProtoPortNet(ip, p, port, net) = key else {
        return None;
    };
    Some(key_bytes(&ElemKey::AddrProtoPortNet(
        *ip,
        *p,
        *port,
        IpNet::from(net.broadcast()),
    )))
}

/// `addr . port` map data: the address, then the port padded to 4 bytes.
fn endpoint_bytes(to: &std::net::SocketAddr) -> ElemBytes {
    let mut v = ElemBytes::new();
    push_ip(&mut v, to.ip());
    let [hi, lo] = to.port().to_be_bytes();
    v.extend_from_slice(&[hi, lo, 0, 0]);
    v
}

// libnftnl's set user data (`NFTNL_UDATA_SET_*`) and nft's `typeof` description of a key
// (`expr_build_udata`): nested TLVs of one-byte type and length, integers in host order.
const UDATA_SET_KEYBYTEORDER: u8 = 0;
const UDATA_SET_DATABYTEORDER: u8 = 1;
const UDATA_SET_KEY_TYPEOF: u8 = 3;
const UDATA_SET_DATA_TYPEOF: u8 = 4;
const UDATA_SET_DATA_INTERVAL: u8 = 6;
// nft's expression type ids (`enum expr_types`).
const EXPR_PAYLOAD: u32 = 7;
const EXPR_META: u32 = 9;
const EXPR_CONCAT: u32 = 13;
const EXPR_NUMGEN: u32 = 23;

fn ud(ty: u8, value: &[u8]) -> Vec<u8> {
    let mut v = vec![ty, value.len() as u8];
    v.extend_from_slice(value);
    v
}

fn ud_u32(ty: u8, value: u32) -> Vec<u8> {
    ud(ty, &value.to_ne_bytes())
}

/// One typeof expression: `{ 0: expression type, 1: { its attributes } }`.
fn ud_expr(ty: u8, expr: u32, attrs: &[Vec<u8>]) -> Vec<u8> {
    let mut v = ud_u32(0, expr);
    v.extend(ud(1, &attrs.concat()));
    ud(ty, &v)
}

/// A concatenation of typeof expressions (`attrs` of each: `(type, attributes)`).
fn ud_concat(ty: u8, exprs: &[(u32, Vec<Vec<u8>>)]) -> Vec<u8> {
    let items: Vec<u8> = exprs
        .iter()
        .enumerate()
        .flat_map(|(i, (t, a))| ud_expr(i as u8, *t, a))
        .collect();
    let mut v = ud_u32(0, EXPR_CONCAT);
    v.extend(ud(1, &items));
    ud(ty, &v)
}

/// The user data nft writes for the flat layout's `typeof ... . numgen random mod 1 :
/// <ip> daddr . th dport` endpoint maps (checked against `nft list` by the kernel tests).
fn slot_map_udata(family: IpFamily, key: KeyType, comment: Option<&str>) -> Vec<u8> {
    // Payload (protocol description, field) of `ip daddr`, `ip6 daddr`, `th dport`.
    let daddr = match family {
        IpFamily::V4 => (12, 12),
        IpFamily::V6 => (13, 9),
    };
    let payload =
        |(desc, field): (u32, u32)| (EXPR_PAYLOAD, vec![ud_u32(0, desc), ud_u32(1, field)]);
    let dport = (11, 2);
    let mut keys = Vec::new();
    if key == KeyType::AddrProtoPortSlot {
        keys.push(payload(daddr));
    }
    keys.push((EXPR_META, vec![ud_u32(0, NFT_META_L4PROTO)]));
    keys.push(payload(dport));
    keys.push((EXPR_NUMGEN, vec![ud_u32(0, 1), ud_u32(1, 1), ud_u32(2, 0)]));
    let mut v = ud_u32(UDATA_SET_KEYBYTEORDER, 0);
    v.extend(ud_u32(UDATA_SET_DATABYTEORDER, 0));
    v.extend(ud_concat(UDATA_SET_KEY_TYPEOF, &keys));
    v.extend(ud_concat(
        UDATA_SET_DATA_TYPEOF,
        &[payload(daddr), payload(dport)],
    ));
    v.extend(ud_u32(UDATA_SET_DATA_INTERVAL, 0));
    if let Some(c) = comment {
        v.extend(udata_comment(UDATA_SET_COMMENT, c));
    }
    v
}

fn hook_number(h: Hook) -> u32 {
    match h {
        Hook::Prerouting => 0,
        Hook::Input => 1,
        Hook::Forward => 2,
        Hook::Output => 3,
        Hook::Postrouting => 4,
    }
}

/// Encodes one operation; `seq` numbers it. Consecutive element additions to one set share
/// a message (see [`encode`]).
fn encode_op(
    b: &mut Buf,
    family: IpFamily,
    op: &Op,
    seq: u32,
    ack: bool,
) -> Result<(), Unsupported> {
    let fam = nfproto(family);
    let ack = if ack { NLM_F_ACK } else { 0 };
    let create = NLM_F_REQUEST | NLM_F_CREATE | ack;
    match op {
        Op::AddTable => {
            let m = b.begin_nft(NFT_MSG_NEWTABLE, create, seq, fam);
            b.str(NFTA_TABLE_NAME, TABLE);
            b.attr(
                NFTA_TABLE_USERDATA,
                &udata_comment(UDATA_COMMENT, TABLE_COMMENT),
            );
            b.end(m);
        }
        Op::DeleteTable => {
            let m = b.begin_nft(NFT_MSG_DELTABLE, NLM_F_REQUEST | ack, seq, fam);
            b.str(NFTA_TABLE_NAME, TABLE);
            b.end(m);
        }
        Op::AddChain(name, hook) => {
            let m = b.begin_named(
                NFT_MSG_NEWCHAIN,
                create,
                seq,
                fam,
                (NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME),
                name,
            );
            if let Some(h) = hook {
                let n = b.nest(NFTA_CHAIN_HOOK);
                b.u32be(NFTA_HOOK_HOOKNUM, hook_number(h.hook));
                b.attr(NFTA_HOOK_PRIORITY, &h.priority.to_be_bytes());
                b.close(n);
                b.str(
                    NFTA_CHAIN_TYPE,
                    match h.kind {
                        ChainType::Filter => "filter",
                        ChainType::Nat => "nat",
                    },
                );
            }
            b.end(m);
        }
        Op::FlushChain(name) => {
            let m = b.begin_named(
                NFT_MSG_DELRULE,
                NLM_F_REQUEST | ack,
                seq,
                fam,
                (NFTA_RULE_TABLE, NFTA_RULE_CHAIN),
                name,
            );
            b.end(m);
        }
        Op::DeleteChain(name) => {
            let m = b.begin_named(
                NFT_MSG_DELCHAIN,
                NLM_F_REQUEST | ack,
                seq,
                fam,
                (NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME),
                name,
            );
            b.end(m);
        }
        Op::AddRule(chain, rule) => {
            let m = b.begin_named(
                NFT_MSG_NEWRULE,
                create | NLM_F_APPEND,
                seq,
                fam,
                (NFTA_RULE_TABLE, NFTA_RULE_CHAIN),
                chain,
            );
            let n = b.nest(NFTA_RULE_EXPRESSIONS);
            rule_exprs(b, family, rule)?;
            b.close(n);
            if let Some(c) = &rule.comment {
                b.attr(NFTA_RULE_USERDATA, &udata_comment(UDATA_COMMENT, c));
            }
            b.end(m);
        }
        Op::AddSet(set) => encode_set(b, family, set, seq, create),
        Op::FlushSet(name, _) => {
            let m = b.begin_named(
                NFT_MSG_DELSETELEM,
                NLM_F_REQUEST | ack,
                seq,
                fam,
                (NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET),
                name,
            );
            b.end(m);
        }
        Op::DeleteSet(name, _) => {
            let m = b.begin_named(
                NFT_MSG_DELSET,
                NLM_F_REQUEST | ack,
                seq,
                fam,
                (NFTA_SET_TABLE, NFTA_SET_NAME),
                name,
            );
            b.end(m);
        }
        Op::AddElement(e) => encode_elements(b, fam, e.set, [e], seq, create),
        Op::DeleteElement(set, key) => {
            let m = b.begin_named(
                NFT_MSG_DELSETELEM,
                NLM_F_REQUEST | ack,
                seq,
                fam,
                (NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET),
                set,
            );
            let list = b.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
            let el = b.nest(NFTA_LIST_ELEM);
            b.data_value(NFTA_SET_ELEM_KEY, &key_bytes(key));
            if let Some(end) = key_end_bytes(key) {
                b.data_value(NFTA_SET_ELEM_KEY_END, &end);
            }
            b.close(el);
            b.close(list);
            b.end(m);
        }
    }
    Ok(())
}

fn encode_set(b: &mut Buf, family: IpFamily, set: &Set, seq: u32, flags: u16) {
    let m = b.begin_named(
        NFT_MSG_NEWSET,
        flags,
        seq,
        nfproto(family),
        (NFTA_SET_TABLE, NFTA_SET_NAME),
        &set.name,
    );
    let (key_type, key_len, fields) = key_spec(set.key, family);
    let mut set_flags = 0;
    if set.is_map() {
        set_flags |= NFT_SET_MAP;
    }
    if set.key.is_interval() {
        set_flags |= NFT_SET_INTERVAL;
    }
    if set.timeout.is_some() {
        set_flags |= NFT_SET_TIMEOUT | NFT_SET_EVAL;
    }
    if !fields.is_empty() {
        set_flags |= NFT_SET_CONCAT;
    }
    b.u32be(NFTA_SET_FLAGS, set_flags);
    // The kernel requires a transaction-local id for every new set.
    b.u32be(NFTA_SET_ID, seq);
    b.u32be(NFTA_SET_KEY_TYPE, key_type);
    b.u32be(NFTA_SET_KEY_LEN, key_len);
    if set.verdict_map {
        b.u32be(NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT);
        b.u32be(NFTA_SET_DATA_LEN, 0);
    }
    if set.key.is_slot() || set.key.is_affinity() {
        // `<ip> daddr . th dport`: ipv4_addr or ipv6_addr, then inet_service.
        let (addr_type, addr_len) = match family {
            IpFamily::V4 => (TYPE_IPADDR, 4),
            IpFamily::V6 => (TYPE_IP6ADDR, 16),
        };
        b.u32be(
            NFTA_SET_DATA_TYPE,
            (addr_type << TYPE_BITS) | TYPE_INET_SERVICE,
        );
        b.u32be(NFTA_SET_DATA_LEN, addr_len + 4);
    }
    if let Some(t) = set.timeout {
        b.attr(NFTA_SET_TIMEOUT, &(u64::from(t) * 1000).to_be_bytes());
    }
    if set.timeout.is_some() || !fields.is_empty() || set.size.is_some() {
        let d = b.nest(NFTA_SET_DESC);
        if let Some(n) = set.size {
            b.u32be(NFTA_SET_DESC_SIZE, n);
        } else if set.timeout.is_some() {
            // nft's default size for dynamic sets.
            b.u32be(NFTA_SET_DESC_SIZE, 65535);
        }
        if !fields.is_empty() {
            let c = b.nest(NFTA_SET_DESC_CONCAT);
            for f in &fields {
                let e = b.nest(NFTA_LIST_ELEM);
                b.u32be(NFTA_SET_FIELD_LEN, *f);
                b.close(e);
            }
            b.close(c);
        }
        b.close(d);
    }
    if set.key.is_slot() {
        b.attr(
            NFTA_SET_USERDATA,
            &slot_map_udata(family, set.key, set.comment.as_deref()),
        );
    } else if set.key.is_affinity() {
        // What nft writes for a `type` map with concatenations: byte orders, empty `typeof`
        // concatenations for key and data, no interval data.
        let mut v = ud_u32(UDATA_SET_KEYBYTEORDER, 0);
        v.extend(ud_u32(UDATA_SET_DATABYTEORDER, 0));
        v.extend(ud_concat(UDATA_SET_KEY_TYPEOF, &[]));
        v.extend(ud_concat(UDATA_SET_DATA_TYPEOF, &[]));
        v.extend(ud_u32(UDATA_SET_DATA_INTERVAL, 0));
        if let Some(c) = &set.comment {
            v.extend(udata_comment(UDATA_SET_COMMENT, c));
        }
        b.attr(NFTA_SET_USERDATA, &v);
    } else if let Some(c) = &set.comment {
        b.attr(NFTA_SET_USERDATA, &udata_comment(UDATA_SET_COMMENT, c));
    }
    b.end(m);
    let _ = TYPE_VERDICT;
}

fn encode_elements<'e>(
    b: &mut Buf,
    fam: u8,
    set: &str,
    elements: impl IntoIterator<Item = &'e Element>,
    seq: u32,
    flags: u16,
) {
    let m = b.begin_named(
        NFT_MSG_NEWSETELEM,
        flags,
        seq,
        fam,
        (NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET),
        set,
    );
    let list = b.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
    for e in elements {
        let el = b.nest(NFTA_LIST_ELEM);
        b.data_value(NFTA_SET_ELEM_KEY, &key_bytes(&e.key));
        if let Some(end) = key_end_bytes(&e.key) {
            b.data_value(NFTA_SET_ELEM_KEY_END, &end);
        }
        if let Some(v) = &e.value {
            b.verdict_data(NFTA_SET_ELEM_DATA, v);
        }
        if let Some(to) = &e.data {
            b.data_value(NFTA_SET_ELEM_DATA, &endpoint_bytes(to));
        }
        if let Some(c) = &e.comment {
            b.comment_udata(NFTA_SET_ELEM_USERDATA, c);
        }
        b.close(el);
    }
    b.close(list);
    b.end(m);
}

/// The encoded batch and, per sequence number, what it was (for error messages).
pub(crate) struct Batch {
    buf: Buf,
    /// `(first seq, op index)` of each message, in order.
    seqs: Vec<(u32, usize)>,
    last_seq: u32,
}

/// Element additions per message: element lists are one attribute, whose length is 16 bits;
/// 128 elements with the longest names stay far below 64 KiB.
const ELEMENTS_PER_MESSAGE: usize = 128;

/// Encodes `ops` after what `buf` holds, numbering the messages on from `*seq`; element
/// additions to the same set that follow each other share a message (up to
/// [`ELEMENTS_PER_MESSAGE`]), as nft does. `message(seq, op index, offset in buf)` is called
/// for each message. No message asks for an acknowledgement (see [`Buf::request_ack`]).
fn encode_ops(
    buf: &mut Buf,
    ops: &[(IpFamily, Op)],
    seq: &mut u32,
    mut message: impl FnMut(u32, usize, usize),
) -> Result<(), Unsupported> {
    let mut i = 0;
    let n = ops.len();
    while i < n {
        *seq += 1;
        let offset = buf.b.len();
        let (family, op) = &ops[i];
        if let Op::AddElement(e) = op {
            let mut j = i + 1;
            // Attribute lengths are 16 bits: keep a message's element list well under 64 KiB.
            while j < n && j - i < ELEMENTS_PER_MESSAGE {
                match &ops[j] {
                    (f, Op::AddElement(e2)) if f == family && e2.set == e.set => j += 1,
                    _ => break,
                }
            }
            let els = ops[i..j].iter().filter_map(|(_, o)| match o {
                Op::AddElement(e) => Some(e),
                _ => None,
            });
            encode_elements(
                buf,
                nfproto(*family),
                e.set,
                els,
                *seq,
                NLM_F_REQUEST | NLM_F_CREATE,
            );
            message(*seq, i, offset);
            i = j;
            continue;
        }
        encode_op(buf, *family, op, *seq, false)?;
        message(*seq, i, offset);
        i += 1;
    }
    Ok(())
}

/// The message that opens (`NFNL_MSG_BATCH_BEGIN`) or closes (`NFNL_MSG_BATCH_END`) a batch.
fn batch_marker(buf: &mut Buf, ty: u16, seq: u32) {
    let m = buf.begin(ty, NLM_F_REQUEST, seq, 0, NFNL_SUBSYS_NFTABLES);
    buf.end(m);
}

/// Encodes a transaction; only its last message asks for an acknowledgement, which the kernel
/// sends after every error of the batch.
pub(crate) fn encode(tx: &Transaction, first_seq: u32) -> Result<Batch, Unsupported> {
    let mut buf = Buf {
        b: Vec::with_capacity(tx.ops.len() * 160 + 64),
    };
    let mut seq = first_seq;
    batch_marker(&mut buf, NFNL_MSG_BATCH_BEGIN, seq);
    let mut seqs = Vec::new();
    let mut last = None;
    encode_ops(&mut buf, &tx.ops, &mut seq, |s, i, offset| {
        seqs.push((s, i));
        last = Some(offset);
    })?;
    if let Some(offset) = last {
        buf.request_ack(offset);
    }
    let last_seq = seq;
    batch_marker(&mut buf, NFNL_MSG_BATCH_END, seq + 1);
    Ok(Batch {
        buf,
        seqs,
        last_seq,
    })
}

/// A transaction encoded into one netlink batch as its pieces arrive (see [`Kernel::batch`]),
/// and sent whole at commit. It keeps no operations, so a refusal cannot name the one at
/// fault: it fails with [`KernelError::Streamed`], and the caller applies the transaction
/// whole to learn which.
struct StreamedBatch<'k> {
    kernel: &'k mut NetlinkKernel,
    buf: Buf,
    seq: u32,
    messages: usize,
    /// Offset of the last message.
    last: Option<usize>,
    encoding: Duration,
}

impl TransactionSink for StreamedBatch<'_> {
    fn add(&mut self, piece: Transaction) -> Result<(), KernelError> {
        let started = std::time::Instant::now();
        let (mut last, mut messages) = (self.last, 0);
        let encoded = encode_ops(&mut self.buf, &piece.ops, &mut self.seq, |_, _, offset| {
            last = Some(offset);
            messages += 1;
        });
        self.last = last;
        self.messages += messages;
        self.encoding += started.elapsed();
        encoded.map_err(|Unsupported| {
            KernelError::Streamed("an operation the netlink encoder does not produce".into())
        })
    }

    fn commit(self: Box<Self>) -> Result<(), KernelError> {
        let StreamedBatch {
            kernel,
            mut buf,
            seq,
            messages,
            last,
            encoding,
        } = *self;
        let Some(offset) = last else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        buf.request_ack(offset);
        batch_marker(&mut buf, NFNL_MSG_BATCH_END, seq + 1);
        kernel.seq = seq + 2;
        let begin = seq - messages as u32;
        kernel.largest_batch = kernel.largest_batch.max(buf.b.len());
        let errors = kernel.exchange(&buf.b, begin, seq)?;
        kernel.last_timing = Some((encoding, started.elapsed()));
        match errors.first() {
            None => Ok(()),
            Some((failed, errno)) => {
                let at = match failed - begin {
                    // Acknowledged on the batch's begin message: the commit as a whole.
                    0 => "the batch".to_string(),
                    n => format!("message {n} of {messages}"),
                };
                Err(KernelError::Streamed(format!(
                    "nf_tables refused {at}: {}",
                    std::io::Error::from_raw_os_error(-errno)
                )))
            }
        }
    }
}

/// nf_tables over a netlink socket, bound to the network namespace it was opened in.
pub struct NetlinkKernel {
    socket: Socket,
    seq: u32,
    /// For transactions with forms this encoder does not produce, and as the lister's twin.
    fallback: NftCommand,
    /// Transactions that went through `nft -f` instead.
    fallbacks: usize,
    /// Encoding and kernel time of the last transaction sent over netlink.
    last_timing: Option<(Duration, Duration)>,
    /// Size of the largest streamed batch so far: the next one starts with room for it
    /// rather than growing to it by doubling (a full sync at 100,000 Services is about
    /// 200 MB, whose growth copies as much again).
    largest_batch: usize,
}

fn io_err(what: &str, e: impl std::fmt::Display) -> KernelError {
    KernelError::Netlink(format!("netlink: {what}: {e}"))
}

impl NetlinkKernel {
    /// Opens a socket in the current network namespace; `fallback` runs `nft` there too.
    pub fn new(fallback: NftCommand) -> Result<Self, KernelError> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(|e| io_err("socket", e))?;
        socket.bind_auto().map_err(|e| io_err("bind", e))?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(|e| io_err("connect", e))?;
        // Receive replies promptly even if the kernel sends none (never block forever).
        let fd = socket.as_fd();
        nix::sys::socket::setsockopt(
            &fd,
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(REPLY_TIMEOUT.as_secs() as _, 0),
        )
        .map_err(|e| io_err("SO_RCVTIMEO", e))?;
        let _ =
            nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::RcvBufForce, &(8 << 20));
        Ok(NetlinkKernel {
            socket,
            seq: 1,
            fallback,
            fallbacks: 0,
            last_timing: None,
            largest_batch: 0,
        })
    }

    /// Opens the socket inside the network namespace at `path` (e.g. `/run/netns/<name>`);
    /// the socket stays bound to that namespace. `fallback` should run `nft` there as well.
    pub fn in_namespace(path: &std::path::Path, fallback: NftCommand) -> Result<Self, KernelError> {
        let file = std::fs::File::open(path).map_err(|e| io_err("open namespace", e))?;
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| io_err("setns", e))?;
                Self::new(fallback)
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// How many transactions went through `nft -f` (forms the encoder does not produce).
    pub fn fallbacks(&self) -> usize {
        self.fallbacks
    }

    /// How long the last netlink transaction took to encode, and from sending it to the
    /// kernel's acknowledgement (its parsing, validation and commit): for benchmarks.
    pub fn last_timing(&self) -> Option<(Duration, Duration)> {
        self.last_timing
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), KernelError> {
        let fd = self.socket.as_fd();
        let want = bytes.len() + (1 << 16);
        let _ = nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::SndBufForce, &want);
        let n = self.socket.send(bytes, 0).map_err(|e| io_err("send", e))?;
        if n != bytes.len() {
            return Err(io_err(
                "send",
                format!("short write {n} of {}", bytes.len()),
            ));
        }
        Ok(())
    }

    /// Sends an encoded batch that opens with its begin message (`first_seq`) and whose last
    /// operation (`last_seq`) asks for an acknowledgement; returns `(seq, errno)` of every
    /// message the kernel refused.
    fn exchange(
        &mut self,
        batch: &[u8],
        first_seq: u32,
        last_seq: u32,
    ) -> Result<Vec<(u32, i32)>, KernelError> {
        self.send(batch)?;
        let mut errors: Vec<(u32, i32)> = Vec::new();
        self.receive(|ty, seq, errno, _| {
            // Replies left over from an earlier exchange that failed half-way are not ours.
            if ty != NLMSG_ERROR || !(first_seq..=last_seq).contains(&seq) {
                return false;
            }
            if errno != 0 {
                errors.push((seq, errno));
            }
            // The last operation's acknowledgement (or its error) comes after all others. An
            // error on the begin message refuses the batch as a whole (nfnetlink: unknown
            // subsystem, no memory, a failed commit): nothing after it is waited for, as
            // nothing else may come before the receive timeout.
            seq == last_seq || (seq == first_seq && errno != 0)
        })?;
        Ok(errors)
    }

    /// Reads replies until `until` says stop; returns `(seq, errno)` of every error.
    fn receive(
        &mut self,
        mut until: impl FnMut(u16, u32, i32, &[u8]) -> bool,
    ) -> Result<(), KernelError> {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = self
                .socket
                .recv(&mut &mut buf[..], 0)
                .map_err(|e| match e.kind() {
                    // SO_RCVTIMEO ran out.
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => io_err(
                        "receive",
                        format!("no reply from nf_tables within {REPLY_TIMEOUT:?}"),
                    ),
                    _ => io_err("receive", e),
                })?;
            if walk_replies(&buf[..n], &mut until)? {
                return Ok(());
            }
        }
    }

    /// The operation the message `seq` of `batch` encodes.
    fn op_at<'t>(tx: &'t Transaction, batch: &Batch, seq: u32) -> Option<&'t (IpFamily, Op)> {
        let idx = batch
            .seqs
            .iter()
            .rev()
            .find(|(s, _)| *s <= seq)
            .map(|(_, i)| *i)?;
        tx.ops.get(idx)
    }

    fn describe(tx: &Transaction, batch: &Batch, seq: u32) -> String {
        let idx = batch
            .seqs
            .iter()
            .rev()
            .find(|(s, _)| *s <= seq)
            .map(|(_, i)| *i);
        match idx {
            Some(i) => {
                let (f, op) = &tx.ops[i];
                let mut s = String::new();
                super::ruleset::write_op(&mut s, *f, op);
                s
            }
            None => "the batch".to_string(),
        }
    }

    /// Dumps chains or sets of `family`; calls `each` with the attributes of each object.
    fn dump(
        &mut self,
        family: IpFamily,
        msg: u16,
        each: impl FnMut(&[u8]),
    ) -> Result<(), KernelError> {
        self.dump_of(family, msg, None, each)
    }

    /// [`Self::dump`], of one object's contents when `named` gives its (table, name)
    /// attribute types and name (a set's elements).
    fn dump_of(
        &mut self,
        family: IpFamily,
        msg: u16,
        named: Option<((u16, u16), &str)>,
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), KernelError> {
        self.seq += 1;
        let seq = self.seq;
        let mut b = Buf { b: Vec::new() };
        let flags = NLM_F_REQUEST | NLM_F_DUMP;
        let m = match named {
            Some((attrs, name)) => b.begin_named(msg, flags, seq, nfproto(family), attrs, name),
            None => b.begin_nft(msg, flags, seq, nfproto(family)),
        };
        b.end(m);
        self.send(&b.b)?;
        let mut failed = None;
        self.receive(|ty, s, errno, payload| {
            if s != seq {
                return false;
            }
            match ty {
                NLMSG_DONE => true,
                NLMSG_ERROR => {
                    failed = Some(errno);
                    true
                }
                _ => {
                    if payload.len() >= 4 {
                        each(&payload[4..]);
                    }
                    false
                }
            }
        })?;
        match failed {
            Some(e) if e != 0 => Err(io_err("dump", std::io::Error::from_raw_os_error(-e))),
            _ => Ok(()),
        }
    }
}

/// Walks the netlink messages of one received datagram, calling `until(type, seq, errno,
/// payload)` for each (`errno` is an `NLMSG_ERROR`'s code, else 0); returns whether `until`
/// said stop. A message whose length runs past the datagram is an error.
pub(crate) fn walk_replies(
    buf: &[u8],
    until: &mut impl FnMut(u16, u32, i32, &[u8]) -> bool,
) -> Result<bool, KernelError> {
    let n = buf.len();
    let mut off = 0;
    while off + 16 <= n {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4 bytes")) as usize;
        let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().expect("2 bytes"));
        let seq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().expect("4 bytes"));
        if len < 16 || len > n - off {
            return Err(io_err("receive", "truncated message"));
        }
        let payload = &buf[off + 16..off + len];
        let errno = if ty == NLMSG_ERROR && payload.len() >= 4 {
            i32::from_ne_bytes(payload[..4].try_into().expect("4 bytes"))
        } else {
            0
        };
        if until(ty, seq, errno, payload) {
            return Ok(true);
        }
        off += align4(len);
    }
    Ok(false)
}

/// The name of a chain of our table in a `NFT_MSG_NEWCHAIN` dump message's attributes.
pub(crate) fn dumped_chain(payload: &[u8]) -> Option<String> {
    let a = attrs(payload);
    let table = a
        .iter()
        .find(|(t, _)| *t == NFTA_CHAIN_TABLE)
        .map(|(_, v)| attr_str(v));
    if table.as_deref() != Some(TABLE) {
        return None;
    }
    a.iter()
        .find(|(t, _)| *t == NFTA_CHAIN_NAME)
        .map(|(_, name)| attr_str(name))
}

/// The name of a named set of our table in a `NFT_MSG_NEWSET` dump message's attributes, and
/// whether it is a map (anonymous sets, `__set%d`, are left out).
pub(crate) fn dumped_set(payload: &[u8]) -> Option<(String, bool)> {
    let a = attrs(payload);
    let table = a
        .iter()
        .find(|(t, _)| *t == NFTA_SET_TABLE)
        .map(|(_, v)| attr_str(v));
    if table.as_deref() != Some(TABLE) {
        return None;
    }
    let name = a
        .iter()
        .find(|(t, _)| *t == NFTA_SET_NAME)
        .map(|(_, v)| attr_str(v))?;
    let flags = a
        .iter()
        .find(|(t, _)| *t == NFTA_SET_FLAGS)
        .and_then(|(_, v)| v.get(..4))
        .map(|v| u32::from_be_bytes(v.try_into().expect("4 bytes")))
        .unwrap_or(0);
    (!name.starts_with("__")).then_some((name, flags & NFT_SET_MAP != 0))
}

/// The elements of a session-affinity map in a `NFT_MSG_NEWSETELEM` dump message's
/// attributes, read as `key` describes them: `(client key, endpoint)`.
pub(crate) fn dumped_affinity_entries(
    payload: &[u8],
    key: KeyType,
    family: IpFamily,
    out: &mut Vec<(ElemKey, std::net::SocketAddr)>,
) {
    let addr_len = addr_field(family, true).1 as usize;
    let ip_at = |v: &[u8], at: usize| -> Option<IpAddr> {
        let b = v.get(at..at + addr_len)?;
        Some(match family {
            IpFamily::V4 => IpAddr::from(<[u8; 4]>::try_from(b).ok()?),
            IpFamily::V6 => IpAddr::from(<[u8; 16]>::try_from(b).ok()?),
        })
    };
    let port_at = |v: &[u8], at: usize| -> Option<u16> {
        Some(u16::from_be_bytes(v.get(at..at + 2)?.try_into().ok()?))
    };
    let proto_at = |v: &[u8], at: usize| -> Option<Protocol> {
        match v.get(at)? {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    };
    let value = |nested: &[u8]| -> Option<Vec<u8>> {
        attrs(nested)
            .into_iter()
            .find(|(t, _)| *t == NFTA_DATA_VALUE)
            .map(|(_, v)| v.to_vec())
    };
    for (t, list) in attrs(payload) {
        if t != NFTA_SET_ELEM_LIST_ELEMENTS {
            continue;
        }
        for (t, elem) in attrs(list) {
            if t != NFTA_LIST_ELEM {
                continue;
            }
            let a = attrs(elem);
            let k = a
                .iter()
                .find(|(t, _)| *t == NFTA_SET_ELEM_KEY)
                .and_then(|(_, v)| value(v));
            let d = a
                .iter()
                .find(|(t, _)| *t == NFTA_SET_ELEM_DATA)
                .and_then(|(_, v)| value(v));
            let (Some(k), Some(d)) = (k, d) else {
                continue;
            };
            let parsed = (|| {
                let client = ip_at(&k, 0)?;
                let key = match key {
                    KeyType::AffinityDst => ElemKey::AddrAddrProtoPort(
                        client,
                        ip_at(&k, addr_len)?,
                        proto_at(&k, 2 * addr_len)?,
                        port_at(&k, 2 * addr_len + 4)?,
                    ),
                    KeyType::AffinityNodePort => ElemKey::AddrProtoPort(
                        client,
                        proto_at(&k, addr_len)?,
                        port_at(&k, addr_len + 4)?,
                    ),
                    _ => return None,
                };
                let to = std::net::SocketAddr::new(ip_at(&d, 0)?, port_at(&d, addr_len)?);
                Some((key, to))
            })();
            out.extend(parsed);
        }
    }
}

/// Whether a `NFT_MSG_NEWTABLE` dump message names our table.
pub(crate) fn dumped_table_is_ours(payload: &[u8]) -> bool {
    attrs(payload)
        .iter()
        .any(|(t, v)| *t == NFTA_TABLE_NAME && attr_str(v) == TABLE)
}

/// The ruleset generation in a `NFT_MSG_NEWGEN` message's attributes (`NFTA_GEN_ID`).
pub(crate) fn generation_id(payload: &[u8]) -> Option<u32> {
    attrs(payload)
        .iter()
        .find(|(t, _)| *t == 1) // NFTA_GEN_ID
        .and_then(|(_, v)| v.get(..4))
        .map(|v| u32::from_be_bytes(v.try_into().expect("4 bytes")))
}

/// Walks top-level attributes: `(type, value)`.
fn attrs(mut data: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while data.len() >= 4 {
        let len = u16::from_ne_bytes([data[0], data[1]]) as usize;
        let ty = u16::from_ne_bytes([data[2], data[3]]) & 0x3fff;
        if len < 4 || len > data.len() {
            break;
        }
        out.push((ty, &data[4..len]));
        data = &data[align4(len).min(data.len())..];
    }
    out
}

fn attr_str(v: &[u8]) -> String {
    String::from_utf8_lossy(v.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

impl Kernel for NetlinkKernel {
    fn apply(&mut self, tx: &Transaction) -> Result<(), KernelError> {
        if tx.is_empty() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let first_seq = self.seq + 1;
        let Ok(batch) = encode(tx, first_seq) else {
            self.fallbacks += 1;
            return self.fallback.apply(tx);
        };
        let encoded = started.elapsed();
        self.seq = batch.last_seq + 2;
        let errors = self.exchange(&batch.buf.b, first_seq, batch.last_seq)?;
        self.last_timing = Some((encoded, started.elapsed() - encoded));
        if errors.is_empty() {
            return Ok(());
        }
        // A set at its `size`: named as such, so that the agent can report which.
        for (seq, errno) in &errors {
            if *errno == -(nix::errno::Errno::ENFILE as i32)
                && let Some((family, Op::AddElement(e))) = Self::op_at(tx, &batch, *seq)
            {
                return Err(KernelError::SetFull {
                    family: *family,
                    set: e.set.to_string(),
                    detail: format!(
                        "{}: {}",
                        Self::describe(tx, &batch, *seq),
                        std::io::Error::from_raw_os_error(-errno)
                    ),
                });
            }
        }
        let text: Vec<String> = errors
            .iter()
            .take(3)
            .map(|(seq, errno)| {
                format!(
                    "{}: {}",
                    Self::describe(tx, &batch, *seq),
                    std::io::Error::from_raw_os_error(-errno)
                )
            })
            .collect();
        Err(KernelError::Netlink(format!(
            "nf_tables refused the transaction: {}",
            text.join("; ")
        )))
    }

    fn batch(&mut self) -> Box<dyn TransactionSink + '_> {
        let seq = self.seq + 1;
        let mut buf = Buf {
            b: Vec::with_capacity((1 << 20).max(self.largest_batch)),
        };
        batch_marker(&mut buf, NFNL_MSG_BATCH_BEGIN, seq);
        Box::new(StreamedBatch {
            kernel: self,
            buf,
            seq,
            messages: 0,
            last: None,
            encoding: Duration::ZERO,
        })
    }

    fn generation(&mut self) -> Option<u32> {
        self.seq += 1;
        let seq = self.seq;
        let mut b = Buf { b: Vec::new() };
        let m = b.begin_nft(NFT_MSG_GETGEN, NLM_F_REQUEST, seq, 0);
        b.end(m);
        self.send(&b.b).ok()?;
        let mut id = None;
        self.receive(|ty, s, _, payload| {
            if s != seq {
                return false;
            }
            if ty == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN && payload.len() >= 4 {
                id = generation_id(&payload[4..]);
            }
            true
        })
        .ok()?;
        id
    }

    fn list(&mut self, family: IpFamily) -> Result<Option<Existing>, KernelError> {
        let mut existing = Existing::default();
        let mut table_seen = false;
        self.dump(family, NFT_MSG_GETCHAIN, |payload| {
            if let Some(name) = dumped_chain(payload) {
                existing.chains.insert(name);
            }
        })?;
        self.dump(family, NFT_MSG_GETSET, |payload| {
            if let Some((name, map)) = dumped_set(payload) {
                existing.sets.insert(name, map);
            }
        })?;
        if existing.chains.is_empty() && existing.sets.is_empty() {
            // Either no table or an empty one: ask for the tables (over netlink too; `nft
            // list tables` would fetch every table's sets and elements first).
            self.dump(family, NFT_MSG_GETTABLE, |payload| {
                if dumped_table_is_ours(payload) {
                    table_seen = true;
                }
            })?;
        }
        if !table_seen && existing.chains.is_empty() && existing.sets.is_empty() {
            return Ok(None);
        }
        Ok(Some(existing))
    }

    fn affinity_entries(
        &mut self,
        family: IpFamily,
        map: &str,
        key: KeyType,
    ) -> Result<Vec<(ElemKey, std::net::SocketAddr)>, KernelError> {
        let mut out = Vec::new();
        self.dump_of(
            family,
            NFT_MSG_GETSETELEM,
            Some(((NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET), map)),
            |payload| dumped_affinity_entries(payload, key, family, &mut out),
        )?;
        Ok(out)
    }
}

/// How long a reply may take before the socket read gives up.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;
    use nodeport_testbed::{Netns, require_privileged};

    /// nfnetlink answers a batch it refuses as a whole with one error on the begin message and
    /// nothing more; the exchange must end there instead of waiting for an acknowledgement of
    /// the last operation that never comes (it used to wait out the 30 s receive timeout).
    #[test]
    fn a_batch_refused_on_its_begin_message_ends_the_exchange_with_that_error() {
        if !require_privileged(
            "a_batch_refused_on_its_begin_message_ends_the_exchange_with_that_error",
        ) {
            return;
        }
        let ns = Netns::new("nftnlbegin").unwrap();
        let mut kernel = NetlinkKernel::in_namespace(
            &std::path::Path::new("/run/netns").join(ns.name()),
            NftCommand::in_netns(ns.name()),
        )
        .unwrap();
        let mut tx = Transaction::default();
        tx.push(IpFamily::V4, Op::AddTable);
        let first_seq = kernel.seq + 1;
        let mut batch = encode(&tx, first_seq).unwrap();
        // Name a subsystem nfnetlink does not have (255 >= NFNL_SUBSYS_COUNT): the kernel
        // refuses the batch with EINVAL on its begin message, before any operation. The begin
        // message opens the buffer; its nfgenmsg's res_id follows the 16-byte header, the
        // family and the version.
        let res_id = 16 + 2;
        batch.buf.b[res_id..res_id + 2].copy_from_slice(&255u16.to_be_bytes());
        let errors = kernel
            .exchange(&batch.buf.b, first_seq, batch.last_seq)
            .expect("the refusal is read, not timed out");
        assert_eq!(
            errors,
            vec![(first_seq, -(nix::errno::Errno::EINVAL as i32))]
        );
        let listed = NftCommand::in_netns(ns.name())
            .run(&["list", "tables"], None)
            .unwrap();
        assert!(listed.trim().is_empty(), "nothing was added: {listed}");
    }
}
