//! A small packet tracer over iptables chains: which endpoints a new connection can reach,
//! with what probability, masqueraded or not, or where it is dropped or rejected.
//!
//! It walks the built-in chains as netfilter does for the first packet of a connection
//! (`nat PREROUTING` → routing → `filter INPUT` or `filter FORWARD` → `nat POSTROUTING`, or
//! `nat OUTPUT` → `filter OUTPUT` → `nat POSTROUTING`), evaluating the same [`Rule`] values
//! that are sent to the kernel. `statistic` branches are all followed and weighted. The
//! packet, environment and outcome types are shared by every backend's tracer
//! ([`crate::trace`]), so that a behaviour test reads the same in every mode:
//! `from 203.0.113.5 to 192.0.2.10:30080/tcp → DNAT 10.244.1.1:8080, masqueraded`.

use std::net::IpAddr;

use crate::trace::{Env, Fate, Origin, Packet, Trace};

use super::ruleset::{Match, Rule, Table, TableView, Target};

#[derive(Debug, Clone)]
struct State {
    dst: IpAddr,
    dport: u16,
    dnat: Option<std::net::SocketAddr>,
    mark: u32,
    masqueraded: bool,
    affinity: Vec<String>,
}

#[derive(Debug, Clone)]
enum End {
    /// Fell off the end of a chain or `RETURN`ed.
    Continue,
    /// `ACCEPT`, or a NAT target, in this table's hook.
    Accept,
    Drop(String),
    Reject(String),
}

type Branches = Vec<(f64, State, End)>;

/// Traces `packet` through `view`, the tables of the packet's family.
pub fn trace(view: &TableView, packet: &Packet, env: &Env) -> Trace {
    let start = State {
        dst: packet.dst,
        dport: packet.dport,
        dnat: None,
        mark: 0,
        masqueraded: false,
        affinity: Vec::new(),
    };
    let t = Tracer { view, packet, env };
    let first: &[(Table, &str)] = match packet.origin {
        Origin::Remote => &[(Table::Nat, "PREROUTING")],
        Origin::Local => &[(Table::Nat, "OUTPUT"), (Table::Filter, "OUTPUT")],
    };
    let mut fates: Vec<(Fate, f64)> = Vec::new();
    for (p, state, end) in t.hooks(first, vec![(1.0, start, End::Continue)]) {
        if let Some(f) = stopped(&end) {
            add(&mut fates, f, p);
            continue;
        }
        let local = is_local(env, state.dst);
        let next: &[(Table, &str)] = match (packet.origin, local) {
            (Origin::Remote, true) => &[(Table::Filter, "INPUT")],
            (Origin::Remote, false) => &[(Table::Filter, "FORWARD"), (Table::Nat, "POSTROUTING")],
            (Origin::Local, _) => &[(Table::Nat, "POSTROUTING")],
        };
        for (p2, s2, e2) in t.hooks(next, vec![(p, state, End::Continue)]) {
            let fate = stopped(&e2).unwrap_or(Fate::Delivered {
                dnat: s2.dnat,
                masqueraded: s2.masqueraded,
                affinity: s2.affinity,
            });
            add(&mut fates, fate, p2);
        }
    }
    fates.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Trace {
        packet: packet.clone(),
        fates,
    }
}

fn stopped(end: &End) -> Option<Fate> {
    match end {
        End::Drop(c) => Some(Fate::Dropped(c.clone())),
        End::Reject(c) => Some(Fate::Rejected(c.clone())),
        End::Continue | End::Accept => None,
    }
}

fn add(fates: &mut Vec<(Fate, f64)>, fate: Fate, p: f64) {
    match fates.iter_mut().find(|(f, _)| *f == fate) {
        Some((_, q)) => *q += p,
        None => fates.push((fate, p)),
    }
}

/// `-m addrtype --*-type LOCAL`: the node's addresses and the loopback range.
fn is_local(env: &Env, ip: IpAddr) -> bool {
    ip.is_loopback()
        || match ip {
            IpAddr::V4(v4) => v4.octets()[0] == 127,
            IpAddr::V6(_) => false,
        }
        || env.local_addrs.contains(&ip)
}

struct Tracer<'a> {
    view: &'a TableView,
    packet: &'a Packet,
    env: &'a Env,
}

enum Step {
    Next,
    End(End),
}

impl Tracer<'_> {
    /// Runs built-in chains in order; branches that end in a drop or reject stop there.
    fn hooks(&self, chains: &[(Table, &str)], mut branches: Branches) -> Branches {
        for (table, chain) in chains {
            let mut next = Vec::new();
            for (p, state, end) in branches {
                if matches!(end, End::Drop(_) | End::Reject(_)) {
                    next.push((p, state, end));
                    continue;
                }
                for (q, s, e) in self.chain(*table, chain, state, 0) {
                    let e = match e {
                        End::Accept => End::Continue,
                        other => other,
                    };
                    next.push((p * q, s, e));
                }
            }
            branches = next;
        }
        branches
    }

    fn chain(&self, table: Table, name: &str, state: State, depth: usize) -> Branches {
        assert!(depth < 64, "chain recursion too deep at {name}");
        let rules = self
            .view
            .chain(table, name)
            .unwrap_or_else(|| panic!("jump to missing chain {table} {name}"));
        self.rules(table, name, rules, 0, state, depth)
    }

    fn rules(
        &self,
        table: Table,
        chain: &str,
        rules: &[Rule],
        from: usize,
        state: State,
        depth: usize,
    ) -> Branches {
        for (i, rule) in rules.iter().enumerate().skip(from) {
            let Some(bs) = self.rule(table, chain, rule, state.clone(), depth) else {
                continue;
            };
            let mut out = Vec::new();
            for (p, s, step) in bs {
                match step {
                    Step::Next => {
                        for (q, s2, e2) in self.rules(table, chain, rules, i + 1, s, depth) {
                            out.push((p * q, s2, e2));
                        }
                    }
                    Step::End(end) => out.push((p, s, end)),
                }
            }
            return out;
        }
        vec![(1.0, state, End::Continue)]
    }

    /// `None`: the rule does not match; otherwise what happens after it, per branch.
    fn rule(
        &self,
        table: Table,
        chain: &str,
        rule: &Rule,
        mut state: State,
        depth: usize,
    ) -> Option<Vec<(f64, State, Step)>> {
        let mut probability = 1.0;
        for m in &rule.matches {
            let hit = match m {
                Match::Comment(_) => true,
                Match::Protocol(p) | Match::ProtocolOnly(p) => *p == self.packet.proto,
                Match::Dport(port) => *port == state.dport,
                Match::Dst { negate, addr } => addr.contains(state.dst) != *negate,
                Match::Src { negate, addr } => addr.contains(self.packet.src) != *negate,
                Match::AddrTypeLocal { src, negate } => {
                    let ip = if *src { self.packet.src } else { state.dst };
                    is_local(self.env, ip) != *negate
                }
                // Pods here are routed, not bridged.
                Match::NotFromBridge => true,
                Match::CtState { negate, states } => {
                    // The first packet of a connection: NEW, and DNAT once translated.
                    let any = states.split(',').any(|s| match s {
                        "NEW" => true,
                        "DNAT" => state.dnat.is_some(),
                        _ => false,
                    });
                    any != *negate
                }
                Match::Mark { negate, mark } => (state.mark & mark == *mark) != *negate,
                Match::Probability(n) => {
                    probability = 1.0 / f64::from(*n);
                    true
                }
                Match::RecentCheck { name, .. } => self
                    .env
                    .affinity
                    .iter()
                    .any(|(set, client)| set == name && *client == self.packet.src),
                Match::RecentSet(name) => {
                    state.affinity.push(name.clone());
                    true
                }
                // ipsets are not modelled (the IPVS companions are golden-tested only).
                Match::MatchSet { .. } => false,
            };
            if !hit {
                return None;
            }
        }
        let mut out = Vec::new();
        if probability < 1.0 {
            out.push((1.0 - probability, state.clone(), Step::Next));
        }
        let end = |e: End| Step::End(e);
        match &rule.target {
            Target::None => out.push((probability, state, Step::Next)),
            Target::Accept => out.push((probability, state, end(End::Accept))),
            Target::Drop => out.push((probability, state, end(End::Drop(chain.to_string())))),
            Target::Reject => out.push((probability, state, end(End::Reject(chain.to_string())))),
            Target::Return => out.push((probability, state, end(End::Continue))),
            Target::MarkOr(bits) => {
                state.mark |= bits;
                out.push((probability, state, Step::Next));
            }
            Target::MarkXor(bits) => {
                state.mark ^= bits;
                out.push((probability, state, Step::Next));
            }
            Target::Masquerade { .. } => {
                state.masqueraded = true;
                out.push((probability, state, end(End::Accept)));
            }
            Target::Dnat(to) => {
                state.dnat = Some(*to);
                state.dst = to.ip();
                state.dport = to.port();
                out.push((probability, state, end(End::Accept)));
            }
            Target::Jump(target) => {
                for (q, s, e) in self.chain(table, target, state, depth + 1) {
                    let step = match e {
                        End::Continue => Step::Next,
                        other => Step::End(other),
                    };
                    out.push((probability * q, s, step));
                }
            }
        }
        Some(out)
    }
}
