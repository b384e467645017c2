//! The iptables ruleset as data: chains of rules made of the few matches and targets
//! kube-proxy uses, the `iptables-restore` transactions that install them, and their text.
//!
//! A [`Rule`] is printed as kube-proxy writes it (`-m comment --comment "..." -m tcp -p tcp
//! -d 10.96.0.10 --dport 80 -j KUBE-SVC-...`), evaluated by the [`tracer`](super::tracer),
//! and hashed by the [`apply`](super::apply) layer to tell which chains changed.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::model::{IpFamily, Protocol, ServicePortName};

/// An iptables table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// `filter`: accept, drop and reject decisions.
    Filter,
    /// `nat`: DNAT to endpoints, masquerading.
    Nat,
    /// `mangle`: only the canary chain lives here.
    Mangle,
}

impl Table {
    /// `filter`, `nat` or `mangle`.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
            Table::Mangle => "mangle",
        }
    }

    /// The built-in chains of the table (they always exist and are never declared).
    pub fn builtin_chains(self) -> &'static [&'static str] {
        match self {
            Table::Filter => &["INPUT", "FORWARD", "OUTPUT"],
            Table::Nat => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
            Table::Mangle => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        }
    }

    /// Whether `chain` is one of the table's built-in chains.
    pub fn is_builtin(self, chain: &str) -> bool {
        self.builtin_chains().contains(&chain)
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One match of a rule, in the order kube-proxy writes its arguments.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Match {
    /// `-m comment --comment <text>` (quoted when it has spaces).
    Comment(String),
    /// `-m tcp -p tcp` (the protocol module and the protocol, as kube-proxy writes them).
    Protocol(Protocol),
    /// `-p tcp` alone (the IPVS companion rules).
    ProtocolOnly(Protocol),
    /// `--dport <port>` (after [`Match::Protocol`]).
    Dport(u16),
    /// `[!] -d <address or CIDR>`.
    Dst {
        /// Negated.
        negate: bool,
        /// Compared with.
        addr: Addr,
    },
    /// `[!] -s <address or CIDR>`.
    Src {
        /// Negated.
        negate: bool,
        /// Compared with.
        addr: Addr,
    },
    /// `-m addrtype [!] --src-type LOCAL` / `--dst-type LOCAL`: an address of this node.
    AddrTypeLocal {
        /// The source address (else the destination).
        src: bool,
        /// Negated: not an address of this node.
        negate: bool,
    },
    /// `-m physdev ! --physdev-is-in`: not arriving through a bridge port (the IPVS mode's
    /// "from off the machine" rule for external IPs).
    NotFromBridge,
    /// `-m conntrack [!] --ctstate <states>`.
    CtState {
        /// Negated.
        negate: bool,
        /// Comma-separated states (`NEW`, `INVALID`, `RELATED,ESTABLISHED`, ...).
        states: &'static str,
    },
    /// `-m mark [!] --mark <mark>/<mark>`.
    Mark {
        /// Negated.
        negate: bool,
        /// The mark bit(s).
        mark: u32,
    },
    /// `-m statistic --mode random --probability <1/n>`: true with probability `1/n`,
    /// printed as kube-proxy's `computeProbability` (`%0.10f`).
    Probability(u32),
    /// `-m recent --name <list> --rcheck --seconds <s> --reap`: the client was recorded in
    /// the list within `s` seconds (session affinity).
    RecentCheck {
        /// The list (the endpoint chain's name).
        name: String,
        /// `sessionAffinityConfig.clientIP.timeoutSeconds`.
        seconds: u32,
    },
    /// `-m recent --name <list> --set`: records the client (always matches).
    RecentSet(String),
    /// `-m set --match-set <set> <directions>` (IPVS companion rules).
    MatchSet {
        /// The ipset.
        set: String,
        /// `dst`, `dst,dst`, `dst,dst,src`, ...
        directions: &'static str,
    },
}

/// An address operand: kube-proxy writes single addresses bare (`-d 10.96.0.10`) and
/// CIDRs with their length, even a `/32` source range (`-s 203.0.113.7/32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Addr {
    /// One address.
    Ip(IpAddr),
    /// A CIDR.
    Net(IpNet),
}

impl Addr {
    /// Whether `ip` is (inside) this operand.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match self {
            Addr::Ip(a) => *a == ip,
            Addr::Net(n) => n.contains(&ip),
        }
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Addr::Ip(ip) => write!(f, "{ip}"),
            Addr::Net(net) => write!(f, "{net}"),
        }
    }
}

/// What a rule does when it matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Target {
    /// `-j <chain>`.
    Jump(String),
    /// `-j ACCEPT`.
    Accept,
    /// `-j DROP`.
    Drop,
    /// `-j REJECT` (ICMP port unreachable).
    Reject,
    /// `-j RETURN`.
    Return,
    /// `-j MARK --or-mark <bits>`.
    MarkOr(u32),
    /// `-j MARK --xor-mark <bits>`.
    MarkXor(u32),
    /// `-j MASQUERADE [--random-fully]`.
    Masquerade {
        /// `--random-fully` (source ports picked at random; iptables ≥ 1.6.2).
        random_fully: bool,
    },
    /// `-j DNAT --to-destination <ip:port>`.
    Dnat(SocketAddr),
    /// No target: the rule only counts (kube-proxy's explanatory rule at the end of a
    /// `KUBE-FW-` chain).
    None,
}

/// A rule: matches and a target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    /// Matches, in order.
    pub matches: Vec<Match>,
    /// Target.
    pub target: Target,
}

impl Rule {
    /// A rule from its parts.
    pub fn new(matches: Vec<Match>, target: Target) -> Self {
        Rule { matches, target }
    }

    /// The rule's arguments, without `-A <chain>`.
    pub fn text(&self) -> String {
        let mut out = String::with_capacity(96);
        for m in &self.matches {
            if !out.is_empty() {
                out.push(' ');
            }
            write_match(&mut out, m);
        }
        let target = target_text(&self.target);
        if !target.is_empty() {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(&target);
        }
        out
    }

    /// The chain this rule jumps to, if any.
    pub fn jump_target(&self) -> Option<&str> {
        match &self.target {
            Target::Jump(c) => Some(c),
            _ => None,
        }
    }

    /// The comment, if any.
    pub fn comment(&self) -> Option<&str> {
        self.matches.iter().find_map(|m| match m {
            Match::Comment(c) => Some(c.as_str()),
            _ => None,
        })
    }
}

/// Quotes an argument for `iptables-restore` when it has spaces, as kube-proxy does
/// (`--comment ns1/svc1:p80` but `--comment "ns1/svc1:p80 cluster IP"`).
pub fn quote(s: &str) -> String {
    if s.is_empty() || s.chars().any(char::is_whitespace) {
        format!("\"{}\"", s.replace('"', "'"))
    } else {
        s.to_string()
    }
}

/// kube-proxy's `computeProbability`: `fmt.Sprintf("%0.10f", 1.0/float64(n))`.
pub fn probability_text(n: u32) -> String {
    format!("{:.10}", 1.0 / f64::from(n))
}

/// kube-proxy's mark text, `fmt.Sprintf("%#08x", mark)`: `0x004000` for bit 14.
pub fn mark_text(mark: u32) -> String {
    format!("{mark:#08x}")
}

fn write_match(out: &mut String, m: &Match) {
    let neg = |n: bool| if n { "! " } else { "" };
    match m {
        Match::Comment(c) => {
            let _ = write!(out, "-m comment --comment {}", quote(c));
        }
        Match::Protocol(p) => {
            let p = p.as_lower();
            let _ = write!(out, "-m {p} -p {p}");
        }
        Match::ProtocolOnly(p) => {
            let _ = write!(out, "-p {}", p.as_lower());
        }
        Match::Dport(port) => {
            let _ = write!(out, "--dport {port}");
        }
        Match::Dst { negate, addr } => {
            let _ = write!(out, "{}-d {addr}", neg(*negate));
        }
        Match::Src { negate, addr } => {
            let _ = write!(out, "{}-s {addr}", neg(*negate));
        }
        Match::AddrTypeLocal { src, negate } => {
            let which = if *src { "src" } else { "dst" };
            let _ = write!(out, "-m addrtype {}--{which}-type LOCAL", neg(*negate));
        }
        Match::NotFromBridge => out.push_str("-m physdev ! --physdev-is-in"),
        Match::CtState { negate, states } => {
            let _ = write!(out, "-m conntrack {}--ctstate {states}", neg(*negate));
        }
        Match::Mark { negate, mark } => {
            let m = mark_text(*mark);
            let _ = write!(out, "-m mark {}--mark {m}/{m}", neg(*negate));
        }
        Match::Probability(n) => {
            let _ = write!(
                out,
                "-m statistic --mode random --probability {}",
                probability_text(*n)
            );
        }
        Match::RecentCheck { name, seconds } => {
            let _ = write!(
                out,
                "-m recent --name {name} --rcheck --seconds {seconds} --reap"
            );
        }
        Match::RecentSet(name) => {
            let _ = write!(out, "-m recent --name {name} --set");
        }
        Match::MatchSet { set, directions } => {
            let _ = write!(out, "-m set --match-set {set} {directions}");
        }
    }
}

fn target_text(t: &Target) -> String {
    match t {
        Target::Jump(c) => format!("-j {c}"),
        Target::Accept => "-j ACCEPT".into(),
        Target::Drop => "-j DROP".into(),
        Target::Reject => "-j REJECT".into(),
        Target::Return => "-j RETURN".into(),
        Target::MarkOr(m) => format!("-j MARK --or-mark {}", mark_text(*m)),
        Target::MarkXor(m) => format!("-j MARK --xor-mark {}", mark_text(*m)),
        Target::Masquerade { random_fully } => {
            if *random_fully {
                "-j MASQUERADE --random-fully".into()
            } else {
                "-j MASQUERADE".into()
            }
        }
        Target::Dnat(to) => format!("-j DNAT --to-destination {to}"),
        Target::None => String::new(),
    }
}

/// A chain and its rules.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Chain {
    /// Name.
    pub name: String,
    /// Rules in order.
    pub rules: Vec<Rule>,
}

impl Chain {
    /// A chain from its parts.
    pub fn new(name: impl Into<String>, rules: Vec<Rule>) -> Self {
        Chain {
            name: name.into(),
            rules,
        }
    }
}

/// A jump from a built-in chain to one of ours (kube-proxy's `iptablesJumpChains`), ensured
/// at the top of the built-in chain on full syncs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JumpRule {
    /// Table.
    pub table: Table,
    /// The built-in chain (`PREROUTING`, `INPUT`, ...).
    pub from: &'static str,
    /// The rule (its target is our chain).
    pub rule: Rule,
}

/// Everything of one family: the jumps from built-in chains, the top-level chains (rewritten
/// on every sync, as kube-proxy does) and the per service port `nat` chains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyRules {
    /// The family (`iptables` or `ip6tables`).
    pub family: IpFamily,
    /// Jumps from built-in chains, in kube-proxy's order (each is prepended, so the last
    /// one ends up first).
    pub jumps: Vec<JumpRule>,
    /// Top-level chains with all their rules, `filter` ones first.
    pub top: Vec<(Table, Chain)>,
    /// `KUBE-SVC-`, `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-` and `KUBE-SEP-` chains (`nat`) of
    /// each service port.
    pub services: BTreeMap<ServicePortName, Vec<Chain>>,
}

impl FamilyRules {
    /// The rules of a top-level chain.
    pub fn top_chain(&self, table: Table, name: &str) -> Option<&Chain> {
        self.top
            .iter()
            .find(|(t, c)| *t == table && c.name == name)
            .map(|(_, c)| c)
    }

    /// The tables as the kernel would hold them after installing these rules on empty
    /// tables: what the tracer evaluates.
    pub fn view(&self) -> TableView {
        let mut view = TableView::empty();
        for (table, chain) in &self.top {
            view.chains
                .insert((*table, chain.name.clone()), chain.rules.clone());
        }
        for chain in self.services.values().flatten() {
            view.chains
                .insert((Table::Nat, chain.name.clone()), chain.rules.clone());
        }
        for j in &self.jumps {
            view.chains
                .entry((j.table, j.from.to_string()))
                .or_default()
                .insert(0, j.rule.clone());
            // A jump to a chain we do not fill (kubelet's KUBE-FIREWALL): it exists, empty.
            if let Some(to) = j.rule.jump_target() {
                view.chains.entry((j.table, to.to_string())).or_default();
            }
        }
        view
    }
}

/// Everything the proxy programs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ruleset {
    /// One entry per enabled family, IPv4 first.
    pub families: Vec<FamilyRules>,
}

impl Ruleset {
    /// The rules of one family.
    pub fn family(&self, family: IpFamily) -> Option<&FamilyRules> {
        self.families.iter().find(|f| f.family == family)
    }
}

/// The chains of one family's tables, built-in ones included: what the kernel holds (the
/// fake kernel keeps one), what the tracer walks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableView {
    /// `(table, chain)` → rules.
    pub chains: BTreeMap<(Table, String), Vec<Rule>>,
}

impl TableView {
    /// Tables holding only their (empty) built-in chains.
    pub fn empty() -> Self {
        let mut chains = BTreeMap::new();
        for table in [Table::Filter, Table::Nat, Table::Mangle] {
            for c in table.builtin_chains() {
                chains.insert((table, (*c).to_string()), Vec::new());
            }
        }
        TableView { chains }
    }

    /// The rules of a chain.
    pub fn chain(&self, table: Table, name: &str) -> Option<&[Rule]> {
        self.chains
            .get(&(table, name.to_string()))
            .map(Vec::as_slice)
    }

    /// The user-defined chains of a table.
    pub fn user_chains(&self, table: Table) -> impl Iterator<Item = &str> {
        self.chains
            .keys()
            .filter(move |(t, c)| *t == table && !table.is_builtin(c))
            .map(|(_, c)| c.as_str())
    }
}

/// One line of a table section of `iptables-restore` input, after the chain declarations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// `-A <chain> <rule>`.
    Append(String, Rule),
    /// `-I <chain> 1 <rule>`: prepend (the jumps in built-in chains).
    Prepend(String, Rule),
    /// `-X <chain>`: delete a (declared, hence flushed) chain nobody references any more.
    DeleteChain(String),
}

/// One table of an `iptables-restore --noflush` transaction: declared chains are created or
/// flushed, then the lines run in order; the table is committed whole or not at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRestore {
    /// The table.
    pub table: Table,
    /// `:<chain> - [0:0]`: created if missing, flushed if present.
    pub declare: Vec<String>,
    /// The lines after the declarations.
    pub lines: Vec<Line>,
}

impl TableRestore {
    /// An empty section for `table`.
    pub fn new(table: Table) -> Self {
        TableRestore {
            table,
            declare: Vec::new(),
            lines: Vec::new(),
        }
    }

    /// Appends the section's text.
    pub fn write(&self, out: &mut String) {
        let _ = writeln!(out, "*{}", self.table);
        for c in &self.declare {
            let _ = writeln!(out, ":{c} - [0:0]");
        }
        for line in &self.lines {
            match line {
                Line::Append(chain, rule) => {
                    let _ = writeln!(out, "-A {chain} {}", rule.text());
                }
                Line::Prepend(chain, rule) => {
                    let _ = writeln!(out, "-I {chain} 1 {}", rule.text());
                }
                Line::DeleteChain(chain) => {
                    let _ = writeln!(out, "-X {chain}");
                }
            }
        }
        out.push_str("COMMIT\n");
    }
}

/// One `iptables-restore --noflush` (or `ip6tables-restore`) run for one family: one
/// transaction per table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    /// The family: which program runs it.
    pub family: IpFamily,
    /// Table sections in order.
    pub tables: Vec<TableRestore>,
}

impl Restore {
    /// The `iptables-restore` input.
    pub fn text(&self) -> String {
        let lines: usize = self
            .tables
            .iter()
            .map(|t| t.declare.len() + t.lines.len() + 2)
            .sum();
        let mut out = String::with_capacity(lines * 100);
        for t in &self.tables {
            t.write(&mut out);
        }
        out
    }

    /// Number of lines (declarations, rules, deletions) in all sections.
    pub fn len(&self) -> usize {
        self.tables
            .iter()
            .map(|t| t.declare.len() + t.lines.len())
            .sum()
    }

    /// Whether there is nothing to restore.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The section of `table`, if any.
    pub fn table(&self, table: Table) -> Option<&TableRestore> {
        self.tables.iter().find(|t| t.table == table)
    }
}

/// The restore that creates `rules` on tables that do not have them yet: what `nodeport
/// render --proxy-mode iptables` prints and what a first sync on a fresh node sends.
pub fn create_all(rules: &FamilyRules, canary: bool) -> Restore {
    let mut tables = Vec::new();
    for table in [Table::Filter, Table::Nat] {
        let mut section = TableRestore::new(table);
        for (t, chain) in &rules.top {
            if *t == table {
                section.declare.push(chain.name.clone());
            }
        }
        if table == Table::Nat {
            for chain in rules.services.values().flatten() {
                section.declare.push(chain.name.clone());
            }
        }
        // Chains the jumps need that we do not fill (kubelet's KUBE-FIREWALL).
        for j in rules.jumps.iter().filter(|j| j.table == table) {
            if let Some(to) = j.rule.jump_target()
                && !section.declare.iter().any(|d| d == to)
            {
                section.declare.push(to.to_string());
            }
        }
        if canary {
            section
                .declare
                .push(super::names::KUBE_PROXY_CANARY.to_string());
        }
        for (t, chain) in &rules.top {
            if *t == table {
                for r in &chain.rules {
                    section
                        .lines
                        .push(Line::Append(chain.name.clone(), r.clone()));
                }
            }
        }
        if table == Table::Nat {
            for chain in rules.services.values().flatten() {
                for r in &chain.rules {
                    section
                        .lines
                        .push(Line::Append(chain.name.clone(), r.clone()));
                }
            }
        }
        for j in rules.jumps.iter().filter(|j| j.table == table) {
            section
                .lines
                .push(Line::Prepend(j.from.to_string(), j.rule.clone()));
        }
        tables.push(section);
    }
    if canary {
        let mut mangle = TableRestore::new(Table::Mangle);
        mangle
            .declare
            .push(super::names::KUBE_PROXY_CANARY.to_string());
        tables.push(mangle);
    }
    Restore {
        family: rules.family,
        tables,
    }
}

/// The program a family's rules are restored with: `iptables-restore` or `ip6tables-restore`.
pub fn restore_program(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "iptables-restore",
        IpFamily::V6 => "ip6tables-restore",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_are_printed_as_kube_proxys_computeprobability() {
        assert_eq!(probability_text(3), "0.3333333333");
        assert_eq!(probability_text(2), "0.5000000000");
        assert_eq!(probability_text(6), "0.1666666667");
        assert_eq!(probability_text(7), "0.1428571429");
    }

    #[test]
    fn marks_are_printed_as_kube_proxys_percent_hash_08x() {
        assert_eq!(mark_text(1 << 14), "0x004000");
        assert_eq!(mark_text(1 << 31), "0x80000000");
    }

    #[test]
    fn comments_are_quoted_only_when_they_have_spaces() {
        let r = Rule::new(
            vec![
                Match::Comment("ns1/svc1:p80".into()),
                Match::Src {
                    negate: false,
                    addr: Addr::Ip("10.180.0.1".parse().unwrap()),
                },
            ],
            Target::Jump("KUBE-MARK-MASQ".into()),
        );
        assert_eq!(
            r.text(),
            "-m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ"
        );
        let r = Rule::new(
            vec![Match::Comment("other traffic to x will be dropped".into())],
            Target::None,
        );
        assert_eq!(
            r.text(),
            "-m comment --comment \"other traffic to x will be dropped\""
        );
    }
}
