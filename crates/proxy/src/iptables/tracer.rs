//! A small packet tracer over iptables chains: which endpoints a new connection can reach,
//! with what probability, masqueraded or not, or where it is dropped or rejected.
//!
//! It walks the built-in chains as netfilter does for the first packet of a connection
//! (`nat PREROUTING` → routing → `filter INPUT` or `filter FORWARD` → `nat POSTROUTING`, or
//! `nat OUTPUT` → `filter OUTPUT` → `nat POSTROUTING`), evaluating the same [`Rule`] values
//! that are sent to the kernel. `statistic` branches are all followed and weighted (branches
//! that reach the same state are merged). Rules read back from a kernel (`iptables-save`) can
//! be anything: a walk that jumps deeper than [`MAX_JUMP_DEPTH`] chains (a jump loop, which the
//! kernel refuses, or nesting no ruleset needs) or that evaluates more than
//! [`STEPS_PER_RULE`] rules per rule of the view (random branches that keep apart, each walking
//! on) is given up, and the trace has no fates, rather than a panic or a walk exponential in
//! the number of `statistic` rules. The
//! packet, environment and outcome types are shared by every backend's tracer
//! ([`crate::trace`]), so that a behaviour test reads the same in every mode:
//! `from 203.0.113.5 to 192.0.2.10:30080/tcp → DNAT 10.244.1.1:8080, masqueraded`.
//!
//! Each way records its [path](crate::trace::path) as iptables-nft's chains report it in
//! nf_tables trace events (`ip nat KUBE-SERVICES rule #3: jump KUBE-SVC-…`): each rule that
//! matched with its verdict, each chain's end, each built-in chain's policy. Branches merged
//! into one keep the first one's steps.

use std::cell::Cell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::net::IpAddr;

use crate::model::IpFamily;
use crate::trace::path::{Step as PathStep, Trail, Walk};
use crate::trace::{Env, Fate, Origin, Packet, Trace};

use super::ruleset::{Match, Rule, Table, TableView, Target};

/// Chains deeper than this below a built-in chain are not walked (the trace is given up).
pub const MAX_JUMP_DEPTH: usize = 64;

/// Rule evaluations a trace may make per rule of the view (and one view's worth more) before
/// it is given up. A kube-proxy ruleset walks each rule about once per packet (a Service's
/// endpoints are branches that end in their own chains), so this only stops walks whose
/// random branches keep apart and walk on, which double with every `statistic` rule.
pub const STEPS_PER_RULE: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct State {
    dst: IpAddr,
    dport: u16,
    dnat: Option<std::net::SocketAddr>,
    mark: u32,
    masqueraded: bool,
    affinity: Vec<String>,
    /// The steps so far: not part of what makes two branches one (they are merged by where
    /// they are, keeping the first one's steps).
    trail: Steps,
}

/// A branch's steps, equal to any other and hashed as nothing, so that branches are merged
/// by their state alone.
#[derive(Debug, Clone, Default)]
struct Steps(Trail);

impl PartialEq for Steps {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Steps {}

impl std::hash::Hash for Steps {
    fn hash<H: std::hash::Hasher>(&self, _: &mut H) {}
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum End {
    /// Fell off the end of a chain or `RETURN`ed.
    Continue,
    /// `ACCEPT`, or a NAT target, in this table's hook.
    Accept,
    Drop(String),
    Reject(String),
}

type Branches = Vec<(f64, State, End)>;

/// What follows a matched rule, per branch: its probability, state and next step.
type Outcomes = Vec<(f64, State, Step)>;

/// Why a walk was given up: too deep, too long, or a jump to a chain the view lacks.
struct GiveUp;

/// Merges branches that reached the same state and end, adding their probabilities.
fn merged(branches: Branches) -> Branches {
    if branches.len() < 2 {
        return branches;
    }
    let mut index: HashMap<(State, End), usize> = HashMap::with_capacity(branches.len());
    let mut out: Branches = Vec::with_capacity(branches.len());
    for (p, state, end) in branches {
        match index.entry((state, end)) {
            Entry::Occupied(seen) => out[*seen.get()].0 += p,
            Entry::Vacant(new) => {
                let (state, end) = new.key().clone();
                new.insert(out.len());
                out.push((p, state, end));
            }
        }
    }
    out
}

/// Traces `packet` through `view`, the tables of the packet's family. A walk given up (see the
/// module header) gives a trace without fates.
pub fn trace(view: &TableView, packet: &Packet, env: &Env) -> Trace {
    let walks = walk(view, packet, env).unwrap_or_default();
    Trace::of_walks(packet, walks)
}

fn walk(view: &TableView, packet: &Packet, env: &Env) -> Result<Vec<Walk>, GiveUp> {
    let start = State {
        dst: packet.dst,
        dport: packet.dport,
        dnat: None,
        mark: 0,
        masqueraded: false,
        affinity: Vec::new(),
        trail: Steps::default(),
    };
    let rules: usize = view.chains.values().map(Vec::len).sum();
    let t = Tracer {
        view,
        packet,
        env,
        family: match IpFamily::of(packet.dst) {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        },
        steps_left: Cell::new((rules + 1).saturating_mul(STEPS_PER_RULE)),
    };
    let first: &[(Table, &str)] = match packet.origin {
        Origin::Remote => &[(Table::Nat, "PREROUTING")],
        Origin::Local => &[(Table::Nat, "OUTPUT"), (Table::Filter, "OUTPUT")],
    };
    let mut walks: Vec<Walk> = Vec::new();
    let mut walked = |p: f64, state: &State, fate: Fate| {
        walks.push(Walk {
            probability: p,
            fate,
            steps: state.trail.0.steps(),
        })
    };
    for (p, state, end) in t.hooks(first, vec![(1.0, start, End::Continue)])? {
        if let Some(f) = stopped(&end) {
            walked(p, &state, f);
            continue;
        }
        let local = is_local(env, state.dst);
        let next: &[(Table, &str)] = match (packet.origin, local) {
            (Origin::Remote, true) => &[(Table::Filter, "INPUT")],
            (Origin::Remote, false) => &[(Table::Filter, "FORWARD"), (Table::Nat, "POSTROUTING")],
            (Origin::Local, _) => &[(Table::Nat, "POSTROUTING")],
        };
        let mut ways = t.hooks(next, vec![(p, state, End::Continue)])?;
        if packet.origin == Origin::Local {
            // The node's own packet for one of its addresses comes back in through
            // loopback: filter INPUT (its NAT done, nat PREROUTING does not run again).
            let mut back = Vec::new();
            for (p, s, e) in ways {
                if stopped(&e).is_some() || !is_local(env, s.dst) {
                    back.push((p, s, e));
                } else {
                    back.extend(t.hooks(&[(Table::Filter, "INPUT")], vec![(p, s, e)])?);
                }
            }
            ways = back;
        }
        for (p2, s2, e2) in ways {
            let fate = stopped(&e2).unwrap_or(Fate::Delivered {
                dnat: s2.dnat,
                masqueraded: s2.masqueraded,
                affinity: s2.affinity.clone(),
            });
            walked(p2, &s2, fate);
        }
    }
    Ok(walks)
}

fn stopped(end: &End) -> Option<Fate> {
    match end {
        End::Drop(c) => Some(Fate::Dropped(c.clone())),
        End::Reject(c) => Some(Fate::Rejected(c.clone())),
        End::Continue | End::Accept => None,
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
    /// `ip` or `ip6`: iptables-nft's tables' family, for the path.
    family: &'static str,
    /// Rule evaluations left before the walk is given up.
    steps_left: Cell<usize>,
}

enum Step {
    Next,
    End(End),
}

impl Tracer<'_> {
    /// Runs built-in chains in order; branches that end in a drop or reject stop there.
    fn hooks(&self, chains: &[(Table, &str)], mut branches: Branches) -> Result<Branches, GiveUp> {
        for (table, chain) in chains {
            let mut next = Vec::new();
            for (p, state, end) in branches {
                if matches!(end, End::Drop(_) | End::Reject(_)) {
                    next.push((p, state, end));
                    continue;
                }
                for (q, mut s, e) in self.chain(*table, chain, state, 0)? {
                    let e = match e {
                        End::Accept => End::Continue,
                        End::Continue => {
                            // Its end: the policy (kube-proxy's built-in chains accept).
                            s.trail.0.push(PathStep::policy(
                                self.family,
                                table.as_str(),
                                chain,
                                "accept",
                            ));
                            End::Continue
                        }
                        other => other,
                    };
                    next.push((p * q, s, e));
                }
            }
            branches = merged(next);
        }
        Ok(branches)
    }

    fn chain(
        &self,
        table: Table,
        name: &str,
        state: State,
        depth: usize,
    ) -> Result<Branches, GiveUp> {
        if depth >= MAX_JUMP_DEPTH {
            return Err(GiveUp);
        }
        let rules = self.view.chain(table, name).ok_or(GiveUp)?;
        self.rules(table, name, rules, state, depth)
    }

    /// A chain's rules in order, for every branch still walking it at once: a branch goes on
    /// past a rule it does not match, and after one that lets it (a `statistic` match splits
    /// it in two); branches in the same state are merged after each rule, so that a chain of
    /// `statistic` rules costs rules times states, not two to the power of the rules.
    fn rules(
        &self,
        table: Table,
        chain: &str,
        rules: &[Rule],
        state: State,
        depth: usize,
    ) -> Result<Branches, GiveUp> {
        let mut walking: Branches = vec![(1.0, state, End::Continue)];
        let mut ended: Branches = Vec::new();
        for (i, rule) in rules.iter().enumerate() {
            let mut next = Vec::new();
            for (p, s, _) in walking {
                let Some(bs) = self.rule((table, chain, i), rule, s.clone(), depth)? else {
                    next.push((p, s, End::Continue));
                    continue;
                };
                for (q, s2, step) in bs {
                    match step {
                        Step::Next => next.push((p * q, s2, End::Continue)),
                        Step::End(end) => ended.push((p * q, s2, end)),
                    }
                }
            }
            walking = merged(next);
            if walking.is_empty() {
                break;
            }
        }
        for (_, s, _) in &mut walking {
            s.trail
                .0
                .push(PathStep::end(self.family, table.as_str(), chain));
        }
        ended.extend(walking);
        Ok(merged(ended))
    }

    /// `None`: the rule does not match; otherwise what happens after it, per branch.
    fn rule(
        &self,
        (table, chain, index): (Table, &str, usize),
        rule: &Rule,
        mut state: State,
        depth: usize,
    ) -> Result<Option<Outcomes>, GiveUp> {
        let left = self.steps_left.get().checked_sub(1).ok_or(GiveUp)?;
        self.steps_left.set(left);
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
                return Ok(None);
            }
        }
        let mut out = Vec::new();
        if probability < 1.0 {
            out.push((1.0 - probability, state.clone(), Step::Next));
        }
        // The rule matched: its step, with the verdict the kernel reports.
        let verdict = match &rule.target {
            Target::None | Target::MarkOr(_) | Target::MarkXor(_) => "continue".to_string(),
            Target::Accept | Target::Masquerade { .. } | Target::Dnat(_) => "accept".to_string(),
            Target::Drop | Target::Reject => "drop".to_string(),
            Target::Return => "return".to_string(),
            Target::Jump(to) => format!("jump {to}"),
        };
        state.trail.0.push(PathStep::rule(
            self.family,
            table.as_str(),
            chain,
            index + 1,
            verdict,
        ));
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
                for (q, s, e) in self.chain(table, target, state, depth + 1)? {
                    let step = match e {
                        End::Continue => Step::Next,
                        other => Step::End(other),
                    };
                    out.push((probability * q, s, step));
                }
            }
        }
        Ok(Some(out))
    }
}
