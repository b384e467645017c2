//! A small packet tracer over a rendered [`Ruleset`]: which endpoints a new connection can
//! reach, with what probability, masqueraded or not, or where it is dropped or rejected.
//!
//! It walks the base chains hook by hook in priority order as netfilter does for the first
//! packet of a connection (prerouting → input or forward → postrouting, or output →
//! postrouting), evaluating the same [`Expr`] values that are sent to the kernel. `numgen`
//! branches are all followed and weighted, so a test can assert that every endpoint gets its
//! share. It states behaviour, e.g.
//! `from 203.0.113.5 to 192.0.2.10:30080/tcp → DNAT 10.180.0.1:80, masqueraded`.
//!
//! Each way records its [path](crate::trace::path) as nf_tables' trace events report it: a
//! rule whose every expression matched, with its verdict and the elements it matched; the
//! end of each chain it falls off; each base chain's policy.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use super::ruleset::{
    AddrMatch, AffinityKey, ChainType, CtKey, ElemKey, Element, Expr, Hook, LookupKey, MapKey,
    Ruleset, TABLE, Table, Verdict, ct_state, ct_status,
};
use crate::model::IpFamily;
use crate::trace::path::{Step as PathStep, Trail, Walk};
use crate::trace::{Env, Fate, Origin, Packet, Trace};

#[derive(Debug, Clone)]
struct State {
    dst: IpAddr,
    dport: u16,
    dnat: Option<SocketAddr>,
    mark: u32,
    masqueraded: bool,
    affinity: Vec<String>,
    /// Back in through loopback (a packet of the node to one of its own addresses): its
    /// connection's NAT is set up already, no NAT chain runs again.
    looped: bool,
    /// The steps so far.
    trail: Trail,
}

impl State {
    fn start(dst: IpAddr, dport: u16, dnat: Option<SocketAddr>) -> Self {
        State {
            dst,
            dport,
            dnat,
            mark: 0,
            masqueraded: false,
            affinity: Vec::new(),
            looped: false,
            trail: Trail::default(),
        }
    }
}

#[derive(Debug, Clone)]
enum End {
    /// Fell off the end of the chain or `return`ed.
    Continue,
    /// Accepted in this hook (`accept`, or a NAT statement).
    Accept,
    Drop(String),
    Reject(String),
}

type Branches = Vec<(f64, State, End)>;

/// Traces `packet` through the table of its family.
pub fn trace(ruleset: &Ruleset, packet: &Packet, env: &Env) -> Trace {
    let family = IpFamily::of(packet.dst);
    let start = State::start(packet.dst, packet.dport, None);
    let Some(table) = ruleset.table(family) else {
        let walk = Walk {
            probability: 1.0,
            fate: Fate::Delivered {
                dnat: None,
                masqueraded: false,
                affinity: vec![],
            },
            steps: Vec::new(),
        };
        return Trace::of_walks(packet, vec![walk]);
    };
    let t = Tracer::new(table, packet, env);
    let first_hooks: &[Hook] = match packet.origin {
        Origin::Remote => &[Hook::Prerouting],
        Origin::Local => &[Hook::Output],
    };
    let mut walks = Vec::new();
    let mut walked = |p: f64, state: State, fate: Fate| {
        walks.push(Walk {
            probability: p,
            fate,
            steps: state.trail.steps(),
        })
    };
    for (p, state, end) in t.hooks(first_hooks, vec![(1.0, start, End::Continue)]) {
        match end {
            End::Drop(c) => walked(p, state, Fate::Dropped(c)),
            End::Reject(c) => walked(p, state, Fate::Rejected(c)),
            End::Continue | End::Accept => {
                // After prerouting: routing decides input or forward.
                let local = env.local_addrs.contains(&state.dst);
                let next: &[Hook] = match (packet.origin, local) {
                    (Origin::Remote, true) => &[Hook::Input],
                    (Origin::Remote, false) => &[Hook::Forward, Hook::Postrouting],
                    (Origin::Local, _) => &[Hook::Postrouting],
                };
                let mut ways = t.hooks(next, vec![(p, state, End::Continue)]);
                if packet.origin == Origin::Local {
                    ways = t.looped_back(ways);
                }
                for (p2, s2, e2) in ways {
                    let fate = match e2 {
                        End::Drop(c) => Fate::Dropped(c),
                        End::Reject(c) => Fate::Rejected(c),
                        _ => Fate::Delivered {
                            dnat: s2.dnat,
                            masqueraded: s2.masqueraded,
                            affinity: s2.affinity.clone(),
                        },
                    };
                    walked(p2, s2, fate);
                }
            }
        }
    }
    Trace::of_walks(packet, walks)
}

/// How a base chain of another table than the proxy's ends for a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainEnd {
    /// It lets the packet go on (no verdict, or `accept`: the next chain of the hook runs).
    Continue,
    /// `drop`, or a `drop` policy.
    Drop,
    /// `reject`.
    Reject,
}

/// Evaluates the base chain `chain` of `table` (another table than the proxy's, read back
/// from the kernel) for `packet` as it is when it gets there: already translated to `dnat`
/// (a chain after the proxy's DNAT) or not; `policy_drop`: the chain's policy is `drop`.
/// Each way the chain ends, with its probability; `None` when the table has no such chain.
pub fn evaluate_chain(
    table: &Table,
    (chain, policy_drop): (&str, bool),
    packet: &Packet,
    dnat: Option<SocketAddr>,
    env: &Env,
) -> Option<Vec<(ChainEnd, f64)>> {
    table.chain(chain)?;
    let t = Tracer::new(table, packet, env);
    let state = State::start(
        dnat.map_or(packet.dst, |d| d.ip()),
        dnat.map_or(packet.dport, |d| d.port()),
        dnat,
    );
    let mut out: Vec<(ChainEnd, f64)> = Vec::new();
    for (p, _, end) in t.chain(chain, state, 0) {
        let end = match end {
            End::Drop(_) => ChainEnd::Drop,
            End::Reject(_) => ChainEnd::Reject,
            End::Accept => ChainEnd::Continue,
            End::Continue if policy_drop => ChainEnd::Drop,
            End::Continue => ChainEnd::Continue,
        };
        match out.iter_mut().find(|(e, _)| *e == end) {
            Some((_, q)) => *q += p,
            None => out.push((end, p)),
        }
    }
    Some(out)
}

struct Tracer<'a> {
    table: &'a Table,
    packet: &'a Packet,
    env: &'a Env,
    /// `ip` or `ip6`, for the path.
    family: &'static str,
    /// Every element (the first owner's, as the kernel holds it), and by set and key.
    elements: Vec<&'a Element>,
    index: HashMap<(&'a str, ElemKey), &'a Element>,
    /// The flat layout's endpoint maps: by map and key without the slot, slot → endpoint
    /// and its element.
    slots: HashMap<(&'a str, ElemKey), Slots<'a>>,
}

/// One destination's slots in an endpoint map: slot → endpoint and its element.
type Slots<'a> = BTreeMap<u32, (SocketAddr, &'a Element)>;

/// An element as the path names it: `@set { key [comment "c"] [: value] }`.
fn element_text(e: &Element) -> String {
    format!("@{} {}", e.set, e.text())
}

/// The verdict a rule's trace event reports: `reject` drops (after sending its answer).
fn verdict_text(v: &Verdict) -> String {
    match v {
        Verdict::Reject => "drop".to_string(),
        other => other.to_string(),
    }
}

/// Where a rule is, for its step: its chain and its place there (from 0).
#[derive(Clone, Copy)]
struct At<'c> {
    chain: &'c str,
    index: usize,
}

impl<'a> Tracer<'a> {
    fn new(table: &'a Table, packet: &'a Packet, env: &'a Env) -> Self {
        let elements = table.elements();
        let index = elements.iter().map(|e| ((e.set, e.key), *e)).collect();
        let mut slots: HashMap<(&str, ElemKey), Slots<'_>> = HashMap::new();
        for e in &elements {
            let (prefix, slot) = match e.key {
                ElemKey::AddrProtoPortSlot(ip, p, port, slot) => {
                    (ElemKey::AddrProtoPort(ip, p, port), slot)
                }
                ElemKey::ProtoPortSlot(p, port, slot) => (ElemKey::ProtoPort(p, port), slot),
                _ => continue,
            };
            if let Some(to) = e.data {
                slots
                    .entry((e.set, prefix))
                    .or_default()
                    .insert(slot, (to, *e));
            }
        }
        Tracer {
            table,
            packet,
            env,
            family: super::ruleset::nft_family(table.family),
            elements,
            index,
            slots,
        }
    }
    /// Runs the base chains of `hooks` in order (each hook's chains by priority); branches
    /// that end in drop/reject stop there.
    fn hooks(&self, hooks: &[Hook], mut branches: Branches) -> Branches {
        for hook in hooks {
            let mut chains: Vec<_> = self
                .table
                .chains()
                .filter(|c| c.base.as_ref().is_some_and(|b| b.hook == *hook))
                .collect();
            chains.sort_by_key(|c| c.base.as_ref().map(|b| b.priority));
            for chain in chains {
                let kind = chain.base.as_ref().map(|b| b.kind);
                let mut next = Vec::new();
                for (p, state, end) in branches {
                    if matches!(end, End::Drop(_) | End::Reject(_)) {
                        next.push((p, state, end));
                        continue;
                    }
                    // NAT chains see only the first packet, once; a DNATed packet is not
                    // translated again by a later nat chain of the same hook, nor one back
                    // in through loopback by any.
                    if kind == Some(ChainType::Nat)
                        && (state.looped || (*hook != Hook::Postrouting && state.dnat.is_some()))
                    {
                        next.push((p, state, End::Continue));
                        continue;
                    }
                    for (q, mut s, e) in self.chain(&chain.name, state, 0) {
                        let e = match e {
                            End::Accept => End::Continue,
                            End::Continue => {
                                // Its end: the policy (the proxy's base chains accept).
                                s.trail.push(PathStep::policy(
                                    self.family,
                                    TABLE,
                                    &chain.name,
                                    "accept",
                                ));
                                End::Continue
                            }
                            other => other,
                        };
                        next.push((p * q, s, e));
                    }
                }
                branches = next;
            }
        }
        branches
    }

    /// A packet of the node's own that is (still) for one of its addresses leaves through
    /// loopback and comes back in: prerouting and input again, as the same connection (its
    /// state still `new`, its NAT done). What a branch dropped stays dropped.
    fn looped_back(&self, branches: Branches) -> Branches {
        let mut out = Vec::new();
        for (p, mut state, end) in branches {
            let own = state.dst.is_loopback() || self.env.local_addrs.contains(&state.dst);
            if matches!(end, End::Drop(_) | End::Reject(_)) || !own {
                out.push((p, state, end));
                continue;
            }
            state.looped = true;
            out.extend(self.hooks(
                &[Hook::Prerouting, Hook::Input],
                vec![(p, state, End::Continue)],
            ));
        }
        out
    }

    fn chain(&self, name: &str, state: State, depth: usize) -> Branches {
        assert!(depth < 64, "chain recursion too deep at {name}");
        let Some(chain) = self.table.chain(name) else {
            panic!("jump to missing chain {name}");
        };
        self.rules(chain.name.as_str(), &chain.rules, 0, state, depth)
    }

    fn rules(
        &self,
        chain: &str,
        rules: &[super::ruleset::Rule],
        from: usize,
        state: State,
        depth: usize,
    ) -> Branches {
        let mut state = state;
        for (i, rule) in rules.iter().enumerate().skip(from) {
            let at = At { chain, index: i };
            match self.rule(at, &rule.exprs, 0, state.clone(), Vec::new(), depth) {
                RuleResult::NoMatch => continue,
                RuleResult::Branches(bs) => {
                    // A rule can branch (numgen, jump): each branch either ended the chain or
                    // continues with the next rule.
                    let mut out = Vec::new();
                    for (p, s, e) in bs {
                        match e {
                            Step::Next => {
                                for (q, s2, e2) in self.rules(chain, rules, i + 1, s, depth) {
                                    out.push((p * q, s2, e2));
                                }
                            }
                            Step::End(end) => out.push((p, s, end)),
                        }
                    }
                    return out;
                }
                RuleResult::Continue(s) => state = s,
            }
        }
        state.trail.push(PathStep::end(self.family, TABLE, chain));
        vec![(1.0, state, End::Continue)]
    }

    /// The step of the rule at `at` that matched, with the elements it matched.
    fn step(&self, at: At<'_>, verdict: String, matched: Vec<String>) -> PathStep {
        PathStep::rule(self.family, TABLE, at.chain, at.index + 1, verdict).with_elements(matched)
    }

    /// Evaluates the rule at `at` from its expression `from` on, `matched` holding the
    /// elements the expressions before matched. A rule that matches records its step.
    fn rule(
        &self,
        at: At<'_>,
        exprs: &[Expr],
        from: usize,
        mut state: State,
        mut matched: Vec<String>,
        depth: usize,
    ) -> RuleResult {
        // A NAT statement accepts the packet in its hook.
        let accepted = |mut s: State, matched: Vec<String>| {
            s.trail.push(self.step(at, "accept".into(), matched));
            RuleResult::Branches(vec![(1.0, s, Step::End(End::Accept))])
        };
        for (k, e) in exprs.iter().enumerate().skip(from) {
            match e {
                Expr::CtStateNew => {}
                Expr::Ct { key, negate, bits } => {
                    // A traced packet opens a tracked connection: its state is `new`, and
                    // its status has `dnat` once a NAT chain rewrote its destination.
                    let have = match key {
                        CtKey::State => ct_state::NEW,
                        CtKey::Status if state.dnat.is_some() => ct_status::DNAT,
                        CtKey::Status => 0,
                    };
                    if (have & bits != 0) == *negate {
                        return RuleResult::NoMatch;
                    }
                }
                Expr::Daddr { negate, value } => {
                    let hit = self.addr_matches(state.dst, value);
                    if hit.is_some() == *negate {
                        return RuleResult::NoMatch;
                    }
                    matched.extend(hit.flatten());
                }
                Expr::Saddr { negate, value } => {
                    let hit = self.addr_matches(self.packet.src, value);
                    if hit.is_some() == *negate {
                        return RuleResult::NoMatch;
                    }
                    matched.extend(hit.flatten());
                }
                Expr::Dport(p, port) => {
                    if *p != self.packet.proto || *port != state.dport {
                        return RuleResult::NoMatch;
                    }
                }
                Expr::FibSaddrLocal => {
                    if !self.env.local_addrs.contains(&self.packet.src) {
                        return RuleResult::NoMatch;
                    }
                }
                Expr::FibDaddrLocal => {
                    if !self.env.local_addrs.contains(&state.dst) {
                        return RuleResult::NoMatch;
                    }
                }
                Expr::MarkUnset(mask) => {
                    if state.mark & mask != 0 {
                        return RuleResult::NoMatch;
                    }
                }
                Expr::NumgenIs { modulus, value } => {
                    // Two branches: the rest of the rule with probability 1/modulus, the next
                    // rule otherwise.
                    let hit = if *value < *modulus {
                        1.0 / f64::from(*modulus)
                    } else {
                        0.0
                    };
                    let mut out = Vec::new();
                    if hit > 0.0 {
                        match self.rule(at, exprs, k + 1, state.clone(), matched, depth) {
                            RuleResult::NoMatch => out.push((hit, state.clone(), Step::Next)),
                            RuleResult::Continue(s) => out.push((hit, s, Step::Next)),
                            RuleResult::Branches(bs) => {
                                out.extend(bs.into_iter().map(|(p, s, e)| (p * hit, s, e)))
                            }
                        }
                    }
                    if hit < 1.0 {
                        out.push((1.0 - hit, state, Step::Next));
                    }
                    return RuleResult::Branches(out);
                }
                Expr::VerdictMap { key, map } => {
                    let elem_key = match key {
                        MapKey::DaddrProtoPort => {
                            ElemKey::AddrProtoPort(state.dst, self.packet.proto, state.dport)
                        }
                        MapKey::ProtoPort => ElemKey::ProtoPort(self.packet.proto, state.dport),
                    };
                    let found = self
                        .index
                        .get(&(map.as_str(), elem_key))
                        .and_then(|el| el.value.clone().map(|v| (v, *el)));
                    match found {
                        Some((v, el)) => {
                            matched.push(element_text(el));
                            return self.verdict(at, &v, state, matched, depth);
                        }
                        None => return RuleResult::NoMatch,
                    }
                }
                Expr::Lookup { key, negate, set } => {
                    let hit = self.in_set(*key, set, &state);
                    if hit.is_some() == *negate {
                        return RuleResult::NoMatch;
                    }
                    matched.extend(hit.map(element_text));
                }
                Expr::DnatMap {
                    key,
                    modulus,
                    offset,
                    map,
                } => {
                    // Every slot with probability 1/modulus: a slot the map holds DNATs (the
                    // hook accepts), a missing one ends the rule without a match.
                    let p = 1.0 / f64::from(*modulus);
                    let mut hits: BTreeMap<SocketAddr, (f64, &Element)> = BTreeMap::new();
                    let prefix = match key {
                        MapKey::DaddrProtoPort => {
                            ElemKey::AddrProtoPort(state.dst, self.packet.proto, state.dport)
                        }
                        MapKey::ProtoPort => ElemKey::ProtoPort(self.packet.proto, state.dport),
                    };
                    let mut found = 0u32;
                    if let Some(held) = self.slots.get(&(map.as_str(), prefix)) {
                        for (_, (to, el)) in held.range(*offset..offset + modulus) {
                            hits.entry(*to).or_insert((0.0, el)).0 += p;
                            found += 1;
                        }
                    }
                    let miss = f64::from(modulus - found) * p;
                    let mut out = Vec::new();
                    for (to, (q, el)) in hits {
                        let mut s = state.clone();
                        s.dnat = Some(to);
                        s.dst = to.ip();
                        s.dport = to.port();
                        let mut m = matched.clone();
                        // The element of its first slot.
                        m.push(element_text(el));
                        s.trail.push(self.step(at, "accept".into(), m));
                        out.push((q, s, Step::End(End::Accept)));
                    }
                    if miss > 1e-12 {
                        out.push((miss, state, Step::Next));
                    }
                    return RuleResult::Branches(out);
                }
                Expr::NumgenVmap(targets) => {
                    let n = targets.len() as f64;
                    let mut out = Vec::new();
                    for t in targets {
                        let goto = Verdict::Goto(t.clone());
                        if let RuleResult::Branches(bs) =
                            self.verdict(at, &goto, state.clone(), matched.clone(), depth)
                        {
                            out.extend(bs.into_iter().map(|(p, s, e)| (p / n, s, e)));
                        }
                    }
                    return RuleResult::Branches(out);
                }
                Expr::MarkSetOr(bits) => state.mark |= bits,
                Expr::MarkSetXor(bits) => state.mark ^= bits,
                Expr::Masquerade => {
                    state.masqueraded = true;
                    return accepted(state, matched);
                }
                Expr::Dnat(p, to) => {
                    if *p != self.packet.proto {
                        return RuleResult::NoMatch;
                    }
                    state.dnat = Some(*to);
                    state.dst = to.ip();
                    state.dport = to.port();
                    return accepted(state, matched);
                }
                Expr::UpdateSaddr(set) => state.affinity.push(set.clone()),
                Expr::L4proto(p) => {
                    if *p != self.packet.proto {
                        return RuleResult::NoMatch;
                    }
                }
                Expr::AffinityDnat { key, map } => {
                    // The endpoint the map remembers for this client, if any (a kernel's
                    // listing holds what traffic recorded; a rendered table holds none).
                    if !self.env.recorded_affinity {
                        return RuleResult::NoMatch;
                    }
                    let (src, proto) = (self.packet.src, self.packet.proto);
                    let k = match key {
                        AffinityKey::Dst => {
                            ElemKey::AddrAddrProtoPort(src, state.dst, proto, state.dport)
                        }
                        AffinityKey::NodePort => ElemKey::AddrProtoPort(src, proto, state.dport),
                    };
                    let Some((to, el)) = self
                        .index
                        .get(&(map.as_str(), k))
                        .and_then(|e| e.data.map(|to| (to, *e)))
                    else {
                        return RuleResult::NoMatch;
                    };
                    state.dnat = Some(to);
                    state.dst = to.ip();
                    state.dport = to.port();
                    state.affinity.push(map.clone());
                    matched.push(element_text(el));
                    return accepted(state, matched);
                }
                Expr::AffinityUpdate { map, .. } => {
                    if !state.affinity.contains(map) {
                        state.affinity.push(map.clone());
                    }
                }
                Expr::Verdict(v) => return self.verdict(at, v, state, matched, depth),
            }
        }
        // Every expression matched and none decided: the rule's verdict is `continue`.
        state.trail.push(self.step(at, "continue".into(), matched));
        RuleResult::Continue(state)
    }

    /// The verdict of the rule at `at`, which matched (its step recorded first, as the
    /// kernel reports it before it runs a jump's chain).
    fn verdict(
        &self,
        at: At<'_>,
        v: &Verdict,
        mut state: State,
        matched: Vec<String>,
        depth: usize,
    ) -> RuleResult {
        state.trail.push(self.step(at, verdict_text(v), matched));
        let chain = at.chain;
        let end = |e: End, s: State| RuleResult::Branches(vec![(1.0, s, Step::End(e))]);
        match v {
            Verdict::Drop => end(End::Drop(chain.to_string()), state),
            Verdict::Reject => end(End::Reject(chain.to_string()), state),
            Verdict::Accept => end(End::Accept, state),
            Verdict::Return => end(End::Continue, state),
            Verdict::Jump(target) => RuleResult::Branches(
                self.chain(target, state, depth + 1)
                    .into_iter()
                    .map(|(p, s, e)| match e {
                        End::Continue => (p, s, Step::Next),
                        other => (p, s, Step::End(other)),
                    })
                    .collect(),
            ),
            Verdict::Goto(target) => RuleResult::Branches(
                self.chain(target, state, depth + 1)
                    .into_iter()
                    .map(|(p, s, e)| (p, s, Step::End(e)))
                    .collect(),
            ),
        }
    }

    /// Whether `ip` matches `m`: `Some` (with the set's element, for a named set) or `None`.
    fn addr_matches(&self, ip: IpAddr, m: &AddrMatch) -> Option<Option<String>> {
        let hit = match m {
            AddrMatch::Addr(a) => *a == ip,
            AddrMatch::Net(n) => n.contains(&ip),
            AddrMatch::Nets(ns) => ns.iter().any(|n| n.contains(&ip)),
            AddrMatch::Set(name) => {
                if name.starts_with("affinity-") {
                    // kube-proxy's layout (and the flat layout's IPv6 affinity ports): a
                    // client the test names, or, following the kernel's records, one its
                    // listing holds (the element traffic added with `update @set`).
                    if self.env.recorded_affinity
                        && let Some(e) = self.index.get(&(name.as_str(), ElemKey::Addr(ip)))
                    {
                        return Some(Some(element_text(e)));
                    }
                    self.env.affinity.iter().any(|(s, c)| s == name && *c == ip)
                } else {
                    return self
                        .index
                        .get(&(name.as_str(), ElemKey::Addr(ip)))
                        .map(|e| Some(element_text(e)));
                }
            }
        };
        hit.then_some(None)
    }
}

impl<'a> Tracer<'a> {
    /// The element of the plain set `set` the packet's `key` is, if it is one.
    fn in_set(&self, key: LookupKey, set: &str, state: &State) -> Option<&'a Element> {
        let (src, proto) = (self.packet.src, self.packet.proto);
        let k = match key {
            LookupKey::DaddrProtoPort => ElemKey::AddrProtoPort(state.dst, proto, state.dport),
            LookupKey::ProtoPort => ElemKey::ProtoPort(proto, state.dport),
            LookupKey::SaddrDaddr => ElemKey::AddrAddr(src, state.dst),
            // `ct original`: the destination as the packet arrived, before any DNAT.
            LookupKey::OrigDaddr => ElemKey::Addr(self.packet.dst),
            LookupKey::OrigDaddrProtoPort => {
                ElemKey::AddrProtoPort(self.packet.dst, proto, self.packet.dport)
            }
            LookupKey::ProtoOrigPort => ElemKey::ProtoPort(proto, self.packet.dport),
            LookupKey::DaddrProtoPortSaddr => {
                return self.elements.iter().copied().find(|e| {
                    e.set == set
                        && matches!(e.key, ElemKey::AddrProtoPortNet(ip, p, port, net)
                            if ip == state.dst && p == proto && port == state.dport
                                && net.contains(&src))
                });
            }
        };
        self.index.get(&(set, k)).copied()
    }
}

enum Step {
    /// Go on with the next rule of the chain.
    Next,
    /// The chain ends here.
    End(End),
}

enum RuleResult {
    NoMatch,
    Continue(State),
    Branches(Vec<(f64, State, Step)>),
}
