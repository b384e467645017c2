//! Applying a ruleset: the kernel behind one trait, and the applier that turns "desired
//! ruleset" into the smallest transaction that gets the kernel there.
//!
//! * [`Kernel`]: applies one atomic transaction, lists what a table holds. [`NftCommand`]
//!   pipes the transaction to `nft -f -` as kube-proxy's knftables does (program and
//!   leading arguments configurable, e.g. `ip netns exec <ns> nft`); [`FakeKernel`] keeps
//!   the table in memory with the kernel's rules for what may fail, for unit tests.
//! * [`Applier`]: remembers what it applied (a content hash per chain, the state each Service
//!   port was rendered from, the owners of each claim) so that a partial sync rewrites only
//!   changed chains and touches only changed elements; a full sync rewrites every chain and refills every map in one transaction,
//!   which corrects any drift; stale chains are flushed in the main transaction and deleted
//!   in a second one once nothing references them (kube-proxy's `staleChains`).

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::flat::SetBounds;
use super::names::is_affinity_set;
use super::record::{Claim, Claims, OwnerId, Unit, Units};
use super::render::{render_base, render_base_sized, render_service};
use super::ruleset::{
    BaseHook, BaseObjects, Chain, ElemKey, Element, Expr, KeyType, Op, Rule, Ruleset,
    ServiceObjects, Set, Table, Transaction, Verdict,
};
use crate::config::NodeConfig;
use crate::desired::{DesiredState, FamilyState, ServicePortState};
use crate::model::{IpFamily, Protocol, ServicePortName};

/// A kernel failure.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A command-line tool (`nft`, `iptables-restore`, ...) could not be run or refused; a
    /// refused transaction changed nothing (`iptables-restore`: in the table that failed).
    #[error(transparent)]
    Tool(#[from] crate::tool::ToolError),
    /// `nft -j` printed something that is not its JSON.
    #[error("could not parse the output of `{program}`")]
    BadListing {
        /// The program.
        program: String,
        /// Parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The fake kernel refused an operation, as the real one would.
    #[error("{0}")]
    Fake(String),
    /// nf_tables over netlink refused a transaction (nothing was changed), or the socket
    /// failed.
    #[error("{0}")]
    Netlink(String),
    /// A transaction handed over in pieces ([`Kernel::batch`]) could not be encoded or was
    /// refused; nothing was changed. Applying the same transaction whole
    /// ([`Kernel::apply`]) names the operation at fault, or takes another way to the kernel.
    #[error("streamed transaction failed: {0}")]
    Streamed(String),
    /// nf_tables refused an element because its set or map holds `size` elements already
    /// (`ENFILE`); nothing was changed.
    #[error("{family:?} set {set} is full (its size is reached): {detail}")]
    SetFull {
        /// The table's family.
        family: IpFamily,
        /// The set or map.
        set: String,
        /// The kernel's answer, with the operation.
        detail: String,
    },
}

/// What a table holds now, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Existing {
    /// Chain names.
    pub chains: BTreeSet<String>,
    /// Set names (`false`) and map names (`true`).
    pub sets: BTreeMap<String, bool>,
    /// Sets known to have another definition than the one wanted now (a flat set whose
    /// `size` grows): re-created by the full sync, not only emptied.
    pub other_spec: BTreeSet<String>,
}

/// The one place the kernel is touched.
pub trait Kernel: Send {
    /// Applies `tx` atomically: all of it or nothing.
    fn apply(&mut self, tx: &Transaction) -> Result<(), KernelError>;

    /// Lists the `kube-proxy` table of `family` (`None`: no such table).
    fn list(&mut self, family: IpFamily) -> Result<Option<Existing>, KernelError>;

    /// The entries the kernel holds in the flat layout's session-affinity map `map` (of key
    /// type `key`): each client key with the endpoint it was sent to. No such map: an error.
    fn affinity_entries(
        &mut self,
        family: IpFamily,
        map: &str,
        key: KeyType,
    ) -> Result<Vec<(ElemKey, SocketAddr)>, KernelError>;

    /// The network namespace's nf_tables generation, bumped by every commit of anyone
    /// (`None`: this kernel interface cannot tell, so drift must be assumed).
    fn generation(&mut self) -> Option<u32> {
        None
    }

    /// Starts one transaction that is handed over in pieces and applied, all or nothing like
    /// [`Kernel::apply`], at [`TransactionSink::commit`]. A full sync at 10,000 Services is
    /// about 400,000 operations; handing them over one Service at a time lets a kernel
    /// interface encode them as they come, so the proxy never holds them all at once. The
    /// default gathers the pieces and calls [`Kernel::apply`].
    fn batch(&mut self) -> Box<dyn TransactionSink + '_> {
        Box::new(Collected::new(move |tx| self.apply(&tx)))
    }
}

/// One transaction being handed to the kernel in pieces (see [`Kernel::batch`]). Dropping it
/// without [`TransactionSink::commit`] changes nothing.
pub trait TransactionSink {
    /// Appends the operations of `piece`.
    fn add(&mut self, piece: Transaction) -> Result<(), KernelError>;

    /// Applies everything added, atomically.
    fn commit(self: Box<Self>) -> Result<(), KernelError>;
}

/// A [`TransactionSink`] that gathers the pieces into one [`Transaction`] and hands it to a
/// function (usually [`Kernel::apply`]) at commit.
pub struct Collected<'k> {
    tx: Transaction,
    apply: Box<dyn FnOnce(Transaction) -> Result<(), KernelError> + 'k>,
}

impl<'k> Collected<'k> {
    /// Gathers pieces for `apply`.
    pub fn new(apply: impl FnOnce(Transaction) -> Result<(), KernelError> + 'k) -> Self {
        Collected {
            tx: Transaction::default(),
            apply: Box::new(apply),
        }
    }
}

impl TransactionSink for Collected<'_> {
    fn add(&mut self, piece: Transaction) -> Result<(), KernelError> {
        self.tx.ops.extend(piece.ops);
        Ok(())
    }

    fn commit(self: Box<Self>) -> Result<(), KernelError> {
        if self.tx.is_empty() {
            return Ok(());
        }
        (self.apply)(self.tx)
    }
}

impl Kernel for Box<dyn Kernel> {
    fn apply(&mut self, tx: &Transaction) -> Result<(), KernelError> {
        (**self).apply(tx)
    }

    fn batch(&mut self) -> Box<dyn TransactionSink + '_> {
        (**self).batch()
    }

    fn list(&mut self, family: IpFamily) -> Result<Option<Existing>, KernelError> {
        (**self).list(family)
    }

    fn affinity_entries(
        &mut self,
        family: IpFamily,
        map: &str,
        key: KeyType,
    ) -> Result<Vec<(ElemKey, SocketAddr)>, KernelError> {
        (**self).affinity_entries(family, map, key)
    }

    fn generation(&mut self) -> Option<u32> {
        (**self).generation()
    }
}

/// The `nft` command line: the program and the arguments that come before nft's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftCommand {
    /// Program, `nft` by default.
    pub program: String,
    /// Leading arguments (e.g. `["netns", "exec", "ns1", "nft"]` with program `ip`).
    pub args: Vec<String>,
}

impl Default for NftCommand {
    fn default() -> Self {
        NftCommand {
            program: "nft".to_string(),
            args: Vec::new(),
        }
    }
}

impl NftCommand {
    /// `nft` inside network namespace `ns` (through `ip netns exec`).
    pub fn in_netns(ns: &str) -> Self {
        NftCommand {
            program: "ip".into(),
            args: vec!["netns".into(), "exec".into(), ns.into(), "nft".into()],
        }
    }

    /// Parses a command line such as `ip netns exec ns1 nft` (split on whitespace).
    pub fn parse(line: &str) -> Option<Self> {
        let mut words = line.split_whitespace().map(str::to_string);
        let program = words.next()?;
        Some(NftCommand {
            program,
            args: words.collect(),
        })
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.args(&self.args);
        c
    }

    fn describe(&self) -> String {
        std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Runs nft with `args`, feeding `input` on stdin; returns stdout.
    pub fn run(&self, args: &[&str], input: Option<&str>) -> Result<String, KernelError> {
        let mut cmd = self.command();
        cmd.args(args);
        Ok(crate::tool::run(cmd, &self.describe(), input)?)
    }
}

impl Kernel for NftCommand {
    fn apply(&mut self, tx: &Transaction) -> Result<(), KernelError> {
        if tx.is_empty() {
            return Ok(());
        }
        self.run(&["-f", "-"], Some(&tx.to_nft())).map(|_| ())
    }

    fn list(&mut self, family: IpFamily) -> Result<Option<Existing>, KernelError> {
        let fam = super::ruleset::nft_family(family);
        let tables = self.run(&["-j", "list", "tables", fam], None)?;
        if !tables.contains("\"kube-proxy\"") {
            return Ok(None);
        }
        let mut existing = Existing::default();
        for what in ["chains", "sets", "maps"] {
            let text = self.run(&["-j", "-t", "list", what, fam], None)?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| KernelError::BadListing {
                    program: self.describe(),
                    source,
                })?;
            for item in json["nftables"].as_array().into_iter().flatten() {
                for (kind, obj) in item.as_object().into_iter().flatten() {
                    if obj["table"] != super::ruleset::TABLE {
                        continue;
                    }
                    let Some(name) = obj["name"].as_str() else {
                        continue;
                    };
                    match kind.as_str() {
                        "chain" => {
                            existing.chains.insert(name.to_string());
                        }
                        "set" => {
                            existing.sets.insert(name.to_string(), false);
                        }
                        "map" => {
                            existing.sets.insert(name.to_string(), true);
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(Some(existing))
    }

    fn affinity_entries(
        &mut self,
        family: IpFamily,
        map: &str,
        _key: KeyType,
    ) -> Result<Vec<(ElemKey, SocketAddr)>, KernelError> {
        let fam = super::ruleset::nft_family(family);
        let text = self.run(
            &["-j", "list", "map", fam, super::ruleset::TABLE, map],
            None,
        )?;
        let listed = super::listing::parse(&text, family).map_err(|e| match e {
            super::listing::Error::Json(source) => KernelError::BadListing {
                program: self.describe(),
                source,
            },
        })?;
        Ok(listed
            .table
            .base
            .elements
            .into_iter()
            .filter(|e| e.set == map)
            .filter_map(|e| Some((e.key, e.data?)))
            .collect())
    }
}

/// What the fake kernel holds of one table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeTable {
    /// Chains with their hook and rules.
    pub chains: BTreeMap<String, (Option<BaseHook>, Vec<Rule>)>,
    /// Sets and maps with their elements.
    pub sets: BTreeMap<String, (Set, BTreeMap<ElemKey, Element>)>,
}

/// An in-memory kernel that enforces what the real one would refuse (missing objects,
/// deleting referenced or non-empty chains, changing an element's value with `add`), applies
/// transactions atomically, and can be told to fail.
#[derive(Debug, Clone, Default)]
pub struct FakeKernel {
    /// The tables by family.
    pub tables: BTreeMap<IpFamily, FakeTable>,
    /// Fail this many coming transactions.
    pub fail_next: usize,
    /// Refuse every chain deletion, as kernels before 6.2 may while a flushed chain's last
    /// references are still being released.
    pub refuse_chain_deletes: bool,
    /// Every transaction applied successfully, in order.
    pub history: Vec<Transaction>,
    /// The generation: bumped by every successful transaction (tests bump it to play
    /// another tool changing the ruleset).
    pub generation: u32,
    /// Session-affinity maps read back ([`Kernel::affinity_entries`]), in order.
    pub affinity_reads: Vec<String>,
}

fn refs_of_rule(rule: &Rule) -> Vec<&str> {
    let mut out = Vec::new();
    for e in &rule.exprs {
        match e {
            Expr::Verdict(Verdict::Jump(c) | Verdict::Goto(c)) => out.push(c.as_str()),
            Expr::NumgenVmap(ts) => out.extend(ts.iter().map(String::as_str)),
            _ => {}
        }
    }
    out
}

fn sets_of_rule(rule: &Rule) -> Vec<&str> {
    let mut out = Vec::new();
    for e in &rule.exprs {
        match e {
            Expr::Daddr {
                value: super::ruleset::AddrMatch::Set(s),
                ..
            }
            | Expr::Saddr {
                value: super::ruleset::AddrMatch::Set(s),
                ..
            }
            | Expr::UpdateSaddr(s)
            | Expr::Lookup { set: s, .. }
            | Expr::DnatMap { map: s, .. }
            | Expr::AffinityDnat { map: s, .. }
            | Expr::AffinityUpdate { map: s, .. }
            | Expr::VerdictMap { map: s, .. } => out.push(s.as_str()),
            _ => {}
        }
    }
    out
}

impl FakeTable {
    fn chain_referenced(&self, name: &str) -> bool {
        self.chains
            .values()
            .flat_map(|(_, rules)| rules.iter())
            .any(|r| refs_of_rule(r).contains(&name))
            || self
                .sets
                .values()
                .flat_map(|(_, els)| els.values())
                .any(|e| matches!(&e.value, Some(Verdict::Jump(c) | Verdict::Goto(c)) if c == name))
    }

    fn set_referenced(&self, name: &str) -> bool {
        self.chains
            .values()
            .flat_map(|(_, rules)| rules.iter())
            .any(|r| sets_of_rule(r).contains(&name))
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::AddTable | Op::DeleteTable => Ok(()),
            Op::AddChain(name, hook) => {
                self.chains
                    .entry(name.clone())
                    .or_insert_with(|| (hook.clone(), Vec::new()));
                Ok(())
            }
            Op::FlushChain(name) => {
                let c = self
                    .chains
                    .get_mut(name)
                    .ok_or(format!("flush chain {name}: no such chain"))?;
                c.1.clear();
                Ok(())
            }
            Op::DeleteChain(name) => {
                let c = self
                    .chains
                    .get(name)
                    .ok_or(format!("delete chain {name}: no such chain"))?;
                if !c.1.is_empty() {
                    return Err(format!("delete chain {name}: chain is not empty"));
                }
                if self.chain_referenced(name) {
                    return Err(format!("delete chain {name}: device or resource busy"));
                }
                self.chains.remove(name);
                Ok(())
            }
            Op::AddRule(chain, rule) => {
                for target in refs_of_rule(rule) {
                    if !self.chains.contains_key(target) {
                        return Err(format!("add rule {chain}: no such chain {target}"));
                    }
                }
                for set in sets_of_rule(rule) {
                    if !self.sets.contains_key(set) {
                        return Err(format!("add rule {chain}: no such set {set}"));
                    }
                }
                let c = self
                    .chains
                    .get_mut(chain)
                    .ok_or(format!("add rule {chain}: no such chain"))?;
                c.1.push(rule.clone());
                Ok(())
            }
            Op::AddSet(set) => {
                let entry = self
                    .sets
                    .entry(set.name.clone())
                    .or_insert_with(|| (set.clone(), BTreeMap::new()));
                entry.0.timeout = set.timeout;
                Ok(())
            }
            Op::FlushSet(name, _) => {
                let s = self
                    .sets
                    .get_mut(name)
                    .ok_or(format!("flush set {name}: no such set"))?;
                s.1.clear();
                Ok(())
            }
            Op::DeleteSet(name, _) => {
                if !self.sets.contains_key(name) {
                    return Err(format!("delete set {name}: no such set"));
                }
                if self.set_referenced(name) {
                    return Err(format!("delete set {name}: device or resource busy"));
                }
                self.sets.remove(name);
                Ok(())
            }
            Op::AddElement(e) => {
                if let Some(Verdict::Jump(c) | Verdict::Goto(c)) = &e.value
                    && !self.chains.contains_key(c)
                {
                    return Err(format!("add element {}: no such chain {c}", e.set));
                }
                let s = self
                    .sets
                    .get_mut(e.set)
                    .ok_or(format!("add element {}: no such set", e.set))?;
                match s.1.get(&e.key) {
                    Some(old) if old.value != e.value || old.data != e.data => {
                        Err(format!("add element {} {}: file exists", e.set, e.key))
                    }
                    Some(_) => Ok(()),
                    None => {
                        s.1.insert(e.key, e.clone());
                        Ok(())
                    }
                }
            }
            Op::DeleteElement(set, key) => {
                let s = self
                    .sets
                    .get_mut(*set)
                    .ok_or(format!("delete element {set}: no such set"))?;
                s.1.remove(key)
                    .map(|_| ())
                    .ok_or(format!("delete element {set} {key}: no such element"))
            }
        }
    }

    /// The table as a [`Table`] (everything under base objects), for the tracer.
    pub fn to_table(&self, family: IpFamily) -> Table {
        let mut base = super::ruleset::BaseObjects::default();
        for (name, (hook, rules)) in &self.chains {
            base.chains.push(Chain {
                name: name.clone(),
                base: hook.clone(),
                rules: rules.clone(),
            });
        }
        for (set, els) in self.sets.values() {
            base.sets.push(set.clone());
            base.elements.extend(els.values().cloned());
        }
        Table {
            family,
            base,
            services: BTreeMap::new(),
        }
    }
}

impl FakeKernel {
    /// The kernel's current state as a ruleset, for the tracer.
    pub fn ruleset(&self) -> Ruleset {
        Ruleset {
            tables: self.tables.iter().map(|(f, t)| t.to_table(*f)).collect(),
        }
    }
}

impl Kernel for FakeKernel {
    fn apply(&mut self, tx: &Transaction) -> Result<(), KernelError> {
        if self.fail_next > 0 {
            self.fail_next -= 1;
            return Err(KernelError::Fake("injected failure".to_string()));
        }
        if self.refuse_chain_deletes
            && tx
                .ops
                .iter()
                .any(|(_, op)| matches!(op, Op::DeleteChain(_)))
        {
            return Err(KernelError::Fake(
                "chain still in use (injected)".to_string(),
            ));
        }
        let mut next = self.tables.clone();
        for (family, op) in &tx.ops {
            if matches!(op, Op::DeleteTable) {
                next.remove(family);
                continue;
            }
            if !matches!(op, Op::AddTable) && !next.contains_key(family) {
                return Err(KernelError::Fake(format!("{op:?}: no such table")));
            }
            let table = next.entry(*family).or_default();
            table.apply(op).map_err(KernelError::Fake)?;
        }
        self.tables = next;
        self.history.push(tx.clone());
        self.generation += 1;
        Ok(())
    }

    fn generation(&mut self) -> Option<u32> {
        Some(self.generation)
    }

    fn affinity_entries(
        &mut self,
        family: IpFamily,
        map: &str,
        _key: KeyType,
    ) -> Result<Vec<(ElemKey, SocketAddr)>, KernelError> {
        self.affinity_reads.push(map.to_string());
        let set = self
            .tables
            .get(&family)
            .and_then(|t| t.sets.get(map))
            .ok_or_else(|| KernelError::Fake(format!("list map {map}: no such map")))?;
        Ok(set
            .1
            .values()
            .filter_map(|e| Some((e.key, e.data?)))
            .collect())
    }

    fn list(&mut self, family: IpFamily) -> Result<Option<Existing>, KernelError> {
        Ok(self.tables.get(&family).map(|t| Existing {
            chains: t.chains.keys().cloned().collect(),
            sets: t
                .sets
                .iter()
                .map(|(n, (s, _))| (n.clone(), s.is_map()))
                .collect(),
            other_spec: BTreeSet::new(),
        }))
    }
}

/// A destination with session affinity, as the flat layout's affinity maps key it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum AffinityDest {
    /// A ClusterIP, external or load-balancer IP and port.
    Dst(IpAddr, Protocol, u16),
    /// A NodePort.
    NodePort(Protocol, u16),
}

impl AffinityDest {
    /// The affinity destinations of a port (none without `sessionAffinity: ClientIP`).
    fn of(svc: &ServicePortState) -> impl Iterator<Item = AffinityDest> + '_ {
        let port = &svc.port;
        let proto = port.name.protocol;
        let on = port.session_affinity_seconds.is_some();
        std::iter::once(&svc.cluster_ip)
            .chain(&svc.external_ips)
            .chain(&svc.load_balancer_ips)
            .map(move |ip| AffinityDest::Dst(*ip, proto, port.port))
            .chain(port.node_port.map(|np| AffinityDest::NodePort(proto, np)))
            .filter(move |_| on)
    }
}

/// Which session-affinity entries a sync may have made stale.
#[derive(Debug)]
enum AffinityScope {
    /// Any (a full sync).
    All,
    /// Those of these destinations (of the sync's changed ports, before and after).
    Some(HashSet<AffinityDest>),
}

type ElemValue = (
    Option<Verdict>,
    Option<std::net::SocketAddr>,
    Option<Arc<str>>,
);

/// Sets whose elements are keyed by addresses alone; any other set shares the last index.
const CLAIM_SETS: [&str; 3] = [
    super::names::CLUSTER_IPS,
    super::names::NODEPORT_IPS,
    super::names::HAIRPIN_IPS,
];

impl Claim {
    /// The claim element `set`/`key` belongs to.
    fn of(set: &str, key: &ElemKey) -> Self {
        let set_index = || {
            CLAIM_SETS
                .iter()
                .position(|s| *s == set)
                .unwrap_or(CLAIM_SETS.len()) as u8
        };
        match *key {
            ElemKey::AddrProtoPort(ip, proto, port)
            | ElemKey::AddrAddrProtoPort(_, ip, proto, port)
            | ElemKey::AddrProtoPortNet(ip, proto, port, _)
            | ElemKey::AddrProtoPortSlot(ip, proto, port, _) => Claim::Dst(ip, proto, port),
            ElemKey::ProtoPort(proto, port) | ElemKey::ProtoPortSlot(proto, port, _) => {
                Claim::NodePort(proto, port)
            }
            ElemKey::Addr(ip) | ElemKey::AddrAddr(ip, _) => Claim::Addr(set_index(), ip),
        }
    }
}

/// The claim of each of `elements`, and their indices sorted by claim, key and set, without
/// repeated keys (of two elements with one key the first listed stays). Indices are sorted
/// rather than elements, which are large. The set's name is compared last: claim and key
/// nearly always differ.
fn claim_order(elements: &[Element]) -> (Vec<Claim>, Vec<u32>) {
    let claims: Vec<Claim> = elements.iter().map(|e| Claim::of(e.set, &e.key)).collect();
    let mut order: Vec<u32> = (0..elements.len() as u32).collect();
    // Stable.
    order.sort_by(|&a, &b| {
        let (a, b) = (a as usize, b as usize);
        (claims[a], elements[a].key, elements[a].set).cmp(&(
            claims[b],
            elements[b].key,
            elements[b].set,
        ))
    });
    order.dedup_by(|b, a| {
        let (a, b) = (&elements[*a as usize], &elements[*b as usize]);
        a.key == b.key && a.set == b.set
    });
    (claims, order)
}

/// One owner's elements by claim: sorted by claim, then set and key, one element per key
/// (an owner listing a key twice keeps the first).
#[derive(Debug, Default)]
struct Claimed(Vec<(Claim, Element)>);

impl Claimed {
    fn new(elements: Vec<Element>) -> Self {
        let (claims, order) = claim_order(&elements);
        let mut slots: Vec<Option<Element>> = elements.into_iter().map(Some).collect();
        Claimed(
            order
                .into_iter()
                .map(|i| {
                    let i = i as usize;
                    (claims[i], slots[i].take().expect("each index once"))
                })
                .collect(),
        )
    }

    /// Each claim with its elements, in order.
    fn groups(&self) -> impl Iterator<Item = (Claim, &[(Claim, Element)])> {
        self.0.chunk_by(|a, b| a.0 == b.0).map(|g| (g[0].0, g))
    }

    /// The elements of `claim`.
    fn of(&self, claim: Claim) -> &[(Claim, Element)] {
        let start = self.0.partition_point(|(c, _)| *c < claim);
        let end = self.0.partition_point(|(c, _)| *c <= claim);
        &self.0[start..end]
    }

    fn has(&self, claim: Claim) -> bool {
        !self.of(claim).is_empty()
    }
}

/// A chain's name as the applied record keeps it. kube-proxy's names of a Service port's
/// chains repeat the port's readable name (`ns/name/proto/port`, which the owner holds) and,
/// for endpoint chains, the endpoint: kept as parts, a name costs 32 bytes instead of a
/// string of 60 or more, which at 10,000 Services × 10 endpoints is about 6 MiB.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum ChainKey {
    /// `<prefix><hash>-<readable>`, `prefix` one of [`PORT_CHAIN_PREFIXES`].
    Port(u8, [u8; 8]),
    /// `endpoint-<hash>-<readable>__<ip>/<port>` (IPv6 colons as dots).
    Endpoint([u8; 8], IpAddr, u16),
    /// Any other name (static chains, truncated names), as it is.
    Named(Box<str>),
}

/// Prefixes of a Service port's own chains.
const PORT_CHAIN_PREFIXES: [&str; 4] = ["service-", "local-", "external-", "firewall-"];

/// An endpoint as kube-proxy writes it into names: `ip/port`, IPv6 colons as dots.
fn endpoint_suffix(ip: IpAddr, port: u16) -> String {
    format!("{}/{port}", ip.to_string().replace(':', "."))
}

impl ChainKey {
    /// The key of chain `name` of the owner whose readable port name is `readable` (`None`:
    /// the static objects). Every key gives back exactly the name it was made from.
    fn of(readable: Option<&str>, name: &str) -> Self {
        let hashed = |rest: &str| -> Option<([u8; 8], usize)> {
            let hash: [u8; 8] = rest.get(..8)?.as_bytes().try_into().ok()?;
            (rest.as_bytes().get(8) == Some(&b'-')).then_some((hash, 9))
        };
        let parsed = readable.and_then(|readable| {
            for (i, prefix) in PORT_CHAIN_PREFIXES.iter().enumerate() {
                if let Some(rest) = name.strip_prefix(prefix)
                    && let Some((hash, at)) = hashed(rest)
                    && &rest[at..] == readable
                {
                    return Some(ChainKey::Port(i as u8, hash));
                }
            }
            let rest = name.strip_prefix("endpoint-")?;
            let (hash, at) = hashed(rest)?;
            let endpoint = rest[at..].strip_prefix(readable)?.strip_prefix("__")?;
            let (ip, port) = endpoint.rsplit_once('/')?;
            let ip: IpAddr = ip.parse().or_else(|_| ip.replace('.', ":").parse()).ok()?;
            let port: u16 = port.parse().ok()?;
            (endpoint_suffix(ip, port) == endpoint).then_some(ChainKey::Endpoint(hash, ip, port))
        });
        parsed.unwrap_or_else(|| ChainKey::Named(name.into()))
    }

    /// The name, given the same `readable` as [`ChainKey::of`].
    fn name(&self, readable: Option<&str>) -> String {
        let hash = |h: &[u8; 8]| String::from_utf8_lossy(h).into_owned();
        let readable = readable.unwrap_or_default();
        match self {
            ChainKey::Port(i, h) => {
                format!(
                    "{}{}-{readable}",
                    PORT_CHAIN_PREFIXES[usize::from(*i)],
                    hash(h)
                )
            }
            ChainKey::Endpoint(h, ip, port) => format!(
                "endpoint-{}-{readable}__{}",
                hash(h),
                endpoint_suffix(*ip, *port)
            ),
            ChainKey::Named(name) => name.to_string(),
        }
    }
}

/// kube-proxy's readable service port name, the part every chain name of the port repeats
/// (see [`crate::names::nft_service_port_base`]).
fn readable(name: Option<&ServicePortName>) -> Option<String> {
    name.map(|p| {
        format!(
            "{}/{}/{}/{}",
            p.namespace,
            p.name,
            p.protocol.as_lower(),
            p.port
        )
    })
}

/// One owner's chains as applied: each with the hash of its hook and rules, sorted by key.
/// A sorted `Vec` rather than a `BTreeMap<String, _>`: a Service has a dozen chains, and the
/// map's nodes cost more than the entries.
#[derive(Debug, Clone, Default)]
pub(super) struct AppliedChains(Vec<(ChainKey, u64)>);

impl AppliedChains {
    /// No chains.
    pub(super) const EMPTY: AppliedChains = AppliedChains(Vec::new());

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// From chains in any order (names are unique within an owner).
    fn new(mut chains: Vec<(ChainKey, u64)>) -> Self {
        chains.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        AppliedChains(chains)
    }

    fn hash(&self, key: &ChainKey) -> Option<u64> {
        self.0
            .binary_search_by(|(k, _)| k.cmp(key))
            .ok()
            .map(|i| self.0[i].1)
    }

    fn contains(&self, key: &ChainKey) -> bool {
        self.hash(key).is_some()
    }

    fn keys(&self) -> impl Iterator<Item = &ChainKey> {
        self.0.iter().map(|(k, _)| k)
    }
}

/// Every chain name of `table`.
fn chain_names(table: &AppliedTable) -> impl Iterator<Item = String> + '_ {
    table.units.iter().flat_map(|(_, unit)| {
        let readable = readable(unit.name());
        unit.chains()
            .keys()
            .map(move |k| k.name(readable.as_deref()))
    })
}

/// An applied full sync: its number of operations, the applied state of each table and the
/// chains it left stale.
type FullSynced = (
    usize,
    Vec<(IpFamily, AppliedTable)>,
    Vec<(IpFamily, String)>,
);

/// What was applied to one table.
///
/// The record holds no Service port's elements (a million and more at 100,000 Services): it
/// keeps each port's state ([`Unit::source`]) and renders the elements again when a change
/// needs them, given the same render context ([`Context`]), which is checked at every sync.
/// What it keeps per element-group is who claims it ([`Claim`]), to know whose elements are
/// in the kernel (see [`super::record`]).
#[derive(Debug, Clone, Default)]
struct AppliedTable {
    /// What was applied for each owner.
    units: Units,
    /// The owners of every claim; the first one's elements are in the kernel.
    claims: Claims,
    /// The static objects' elements.
    base_elements: Vec<Element>,
    /// Which sets are verdict maps (for `flush map`).
    set_is_map: HashMap<String, bool>,
    /// The sum of the units' bounds: what the flat sets are sized for.
    bounds: SetBounds,
    /// What the Service ports were rendered with, besides their own state.
    context: Option<Context>,
}

/// Everything a Service port's elements depend on besides the port's own state
/// ([`render_service`] reads the family's node IPs and the configuration): a partial sync
/// renders the applied ports again to know what the kernel holds, which is only right in
/// the same context. Any change of it makes the sync a full one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Context {
    node_ips: Vec<IpAddr>,
    config: NodeConfig,
}

impl Context {
    fn of(state: &FamilyState, config: &NodeConfig) -> Self {
        Context {
            node_ips: state.node_ips.clone(),
            config: config.clone(),
        }
    }
}

fn hash_of<T: Hash>(t: &T) -> u64 {
    let mut h = DefaultHasher::new();
    t.hash(&mut h);
    h.finish()
}

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// A full sync (every chain rewritten, maps refilled).
    pub full: bool,
    /// Operations in the main transaction.
    pub ops: usize,
    /// Stale chains deleted in the clean-up transaction.
    pub deleted_chains: usize,
    /// The clean-up transaction failed; its chains are retried next sync.
    pub cleanup_failed: bool,
    /// Session-affinity entries deleted because they sent a client to an endpoint its
    /// destination no longer uses (flat layout).
    pub affinity_deleted: usize,
}

/// A failed sync.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The main transaction was refused; the kernel still has the previous rules.
    #[error("nftables transaction failed")]
    RulesetApplyFailed(#[source] KernelError),
    /// Listing the existing table (start-up take-over) failed.
    #[error("listing the existing kube-proxy table failed")]
    ListFailed(#[source] KernelError),
}

/// Keeps the kernel's `kube-proxy` tables equal to the desired ruleset.
pub struct Applier<K: Kernel> {
    kernel: K,
    tables: BTreeMap<IpFamily, AppliedTable>,
    /// Full sync needed (start, after a failure).
    need_full: bool,
    /// Base chains are re-created once after start, in case an older kube-proxy left them
    /// with other hooks or priorities (kube-proxy's `!flushed`).
    recreated_base: bool,
    /// Chains flushed and waiting to be deleted.
    stale: BTreeMap<(IpFamily, String), Instant>,
    /// What we remember may differ from the kernel (a failed sync): list it again.
    relist: bool,
    /// The nf_tables generation right after our last successful sync.
    generation: Option<u32>,
    /// The flat layout's session-affinity maps may hold entries of endpoints that are gone
    /// (at start: an earlier run's; after a failed sync or clean-up): the next sync reads
    /// every affinity map back, not only the changed ports' entries.
    affinity_unclean: bool,
}

impl<K: Kernel> Applier<K> {
    /// An applier that will take over whatever the kernel holds at its first sync.
    pub fn new(kernel: K) -> Self {
        Applier {
            kernel,
            tables: BTreeMap::new(),
            need_full: true,
            recreated_base: false,
            stale: BTreeMap::new(),
            relist: true,
            generation: None,
            affinity_unclean: true,
        }
    }

    /// Whether anything changed nf_tables in this namespace since our last sync (someone
    /// editing our table by hand, or any other tool committing anything): the next sync is
    /// then a full one. Without a generation to compare it cannot tell and says no.
    pub fn drifted(&mut self) -> bool {
        match self.generation {
            Some(g) => self.kernel.generation() != Some(g),
            None => false,
        }
    }

    /// Whether [`Applier::drifted`] can tell (the kernel interface reports generations).
    pub fn detects_drift(&self) -> bool {
        self.generation.is_some()
    }

    /// The kernel.
    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    /// The kernel, mutably (tests inject faults).
    pub fn kernel_mut(&mut self) -> &mut K {
        &mut self.kernel
    }

    /// Whether the next sync will be full.
    pub fn needs_full_sync(&self) -> bool {
        self.need_full
    }

    /// Forces the next sync to be full (the periodic resync).
    pub fn request_full_sync(&mut self) {
        self.need_full = true;
    }

    /// Chains flushed and not yet deleted.
    pub fn stale_chains(&self) -> usize {
        self.stale.len()
    }

    /// Syncs the kernel to `desired`. `changed`: the service ports that changed since the last
    /// sync (a partial sync), or `None` for a full sync. A partial sync is turned into a full
    /// one when one is needed.
    pub fn sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncReport, Error> {
        // Anyone else's commit since ours (a rule deleted by hand, another tool) makes this
        // sync a full one, which rewrites everything we own.
        let drifted = changed.is_some() && !self.need_full && self.drifted();
        if drifted {
            tracing::info!("nftables changed since our last sync; resyncing fully");
            // Our record says what we wrote, not what is there now: list it.
            self.relist = true;
        }
        // A family without a full sync behind it (cannot happen after one succeeded).
        let unknown_family = desired
            .families
            .iter()
            .any(|f| !self.tables.contains_key(&f.family));
        // The applied ports are rendered again in their old context to know what the kernel
        // holds: a changed context (node addresses, configuration) needs a full sync.
        let context_changed = desired.families.iter().any(|state| {
            self.tables
                .get(&state.family)
                .is_some_and(|t| t.context.as_ref() != Some(&Context::of(state, config)))
        });
        let mut full =
            self.need_full || changed.is_none() || drifted || unknown_family || context_changed;
        // The static objects of a partial sync, rendered once, with the flat sets' bounds
        // once the changed ports are applied (the record's sum from then on).
        let mut bases = Vec::new();
        if !full {
            bases = desired
                .families
                .iter()
                .map(|state| {
                    let bounds = self.bounds_after(state, changed.expect("partial"));
                    (render_base_sized(state, config, &bounds), bounds)
                })
                .collect();
            if self.shared_sets_changed(desired, &bases) {
                // A shared set re-created (the flat layout's sets grow their `size` in steps)
                // loses every element: it is refilled by a full sync, in one transaction.
                tracing::info!("a shared set changed its definition; syncing fully");
                full = true;
            }
        }
        let mut report = SyncReport {
            full,
            ..Default::default()
        };
        // The session-affinity destinations this sync may leave with stale entries (read
        // before a partial sync updates the record).
        // Reading an affinity map back costs the kernel about 10 µs per entry (1.3 s at
        // 100,000 clients, docs/BENCHMARKS.md), so it is done only when entries may be
        // stale: the changed ports' destinations that lost an endpoint (or their affinity),
        // or every map when the record cannot tell.
        let affinity_scope: Vec<(IpFamily, AffinityScope)> =
            if config.nftables_layout == crate::config::NftablesLayout::Flat {
                desired
                    .families
                    .iter()
                    .filter_map(|state| {
                        let scope = match changed {
                            _ if self.affinity_unclean => AffinityScope::All,
                            Some(changed) => {
                                AffinityScope::Some(self.affinity_dests_of(state, changed))
                            }
                            None => return None,
                        };
                        Some((state.family, scope))
                    })
                    .collect()
            } else {
                Vec::new()
            };
        report.deleted_chains = self.cleanup(&mut report);

        let result = if full {
            self.full_sync(desired, config)
        } else {
            let changed = changed.expect("partial sync has changes");
            let (tx, stale) = self.partial_sync(desired, config, changed, bases);
            self.kernel
                .apply(&tx)
                .map_err(Error::RulesetApplyFailed)
                .map(|()| (tx.len(), Vec::new(), stale))
        };
        match result {
            Ok((ops, next_tables, stale)) => {
                report.ops = ops;
                for (f, t) in next_tables {
                    self.tables.insert(f, t);
                }
                let now = Instant::now();
                if full {
                    // A full sync saw every chain there is (the record includes the ones
                    // waiting for deletion): what it left stale is the whole list. A chain
                    // wanted again is off it, and one that vanished meanwhile does not stay on
                    // it to make every clean-up fail.
                    let waiting = std::mem::take(&mut self.stale);
                    for s in stale {
                        let since = waiting.get(&s).copied().unwrap_or(now);
                        self.stale.insert(s, since);
                    }
                } else {
                    for s in stale {
                        self.stale.entry(s).or_insert(now);
                    }
                }
                if full {
                    self.need_full = false;
                    self.recreated_base = true;
                    self.relist = false;
                }
                // Delete what became unreferenced right away; a kernel older than 6.2 may
                // still see references and refuse, then the next sync retries.
                report.deleted_chains += self.cleanup(&mut report);
                let mut clean = true;
                for (family, scope) in &affinity_scope {
                    if let Some(state) = desired.family(*family) {
                        match self.clean_affinity(state, scope, changed) {
                            Some(n) => report.affinity_deleted += n,
                            None => clean = false,
                        }
                    }
                }
                if !affinity_scope.is_empty() {
                    self.affinity_unclean = !clean;
                }
                self.generation = self.kernel.generation();
                Ok(report)
            }
            Err(e) => {
                self.need_full = true;
                self.relist = true;
                self.affinity_unclean = true;
                Err(e)
            }
        }
    }

    /// The session-affinity destinations of the `changed` ports whose entries may have gone
    /// stale: those that lost an endpoint, or their affinity (switched off, another timeout,
    /// the port or the destination gone). Added endpoints make nothing stale.
    fn affinity_dests_of(
        &self,
        state: &FamilyState,
        changed: &BTreeSet<ServicePortName>,
    ) -> HashSet<AffinityDest> {
        let mut out = HashSet::new();
        let table = self.tables.get(&state.family);
        for name in changed {
            let Some(old) = table
                .and_then(|t| t.units.of(name))
                .and_then(|u| u.source.as_deref())
                .filter(|old| old.port.session_affinity_seconds.is_some())
            else {
                continue;
            };
            let endpoints = |s: &ServicePortState| -> HashSet<SocketAddr> {
                s.cluster_endpoints
                    .iter()
                    .chain(&s.local_endpoints)
                    .map(|e| e.socket())
                    .collect()
            };
            match state.services.get(name) {
                Some(new)
                    if new.port.session_affinity_seconds == old.port.session_affinity_seconds =>
                {
                    let kept: HashSet<AffinityDest> = AffinityDest::of(new).collect();
                    let lost_endpoint = !endpoints(old).is_subset(&endpoints(new));
                    out.extend(
                        AffinityDest::of(old).filter(|d| lost_endpoint || !kept.contains(d)),
                    );
                }
                _ => out.extend(AffinityDest::of(old)),
            }
        }
        out
    }

    /// Deletes the session-affinity entries in `scope` that send a client to an endpoint
    /// its destination no longer uses, or that belong to a destination without affinity
    /// now (kube-proxy deletes an endpoint's affinity set with its chain). Entries are
    /// written by the kernel, so they are read back first; an entry that expires between
    /// the read and the deletion fails the deletion, which is then retried on a new read.
    /// Returns the entries deleted, or `None` when reading or deleting failed (logged; the
    /// next sync then reads every map).
    fn clean_affinity(
        &mut self,
        state: &FamilyState,
        scope: &AffinityScope,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Option<usize> {
        let family = state.family;
        let Some(timeouts) = self
            .tables
            .get(&family)
            .map(|t| t.bounds.affinity_timeouts().collect::<Vec<_>>())
        else {
            return Some(0);
        };
        if timeouts.is_empty() || matches!(scope, AffinityScope::Some(d) if d.is_empty()) {
            return Some(0);
        }
        // What each destination in scope may keep: its timeout and endpoints.
        let mut wanted: HashMap<AffinityDest, (u32, HashSet<SocketAddr>)> = HashMap::new();
        let mut want = |svc: &ServicePortState| {
            let Some(t) = svc.port.session_affinity_seconds else {
                return;
            };
            let eps: HashSet<SocketAddr> = svc
                .cluster_endpoints
                .iter()
                .chain(&svc.local_endpoints)
                .map(|e| e.socket())
                .collect();
            for d in AffinityDest::of(svc) {
                let entry = wanted.entry(d).or_insert_with(|| (t, HashSet::new()));
                if entry.0 == t {
                    entry.1.extend(eps.iter().copied());
                }
            }
        };
        match scope {
            AffinityScope::All => state.services.values().for_each(|s| want(s)),
            // The changed ports as they are now (a destination another, unchanged port also
            // claims loses its clients' entries once: harmless, and rare).
            AffinityScope::Some(_) => changed
                .into_iter()
                .flatten()
                .filter_map(|name| state.services.get(name))
                .for_each(|s| want(s)),
        }
        let mut deleted = 0;
        let mut failed = false;
        for t in timeouts {
            let names = super::names::AffinityNames::new(t);
            for (map, key) in [
                (names.dst_map, KeyType::AffinityDst),
                (names.nodeport_map, KeyType::AffinityNodePort),
            ] {
                for attempt in 0..3 {
                    let entries = match self.kernel.affinity_entries(family, map, key) {
                        Ok(e) => e,
                        Err(e) => {
                            tracing::warn!(error = %e, map, "reading session-affinity entries failed");
                            failed = true;
                            break;
                        }
                    };
                    let mut tx = Transaction::default();
                    for (k, to) in entries {
                        let dest = match k {
                            ElemKey::AddrAddrProtoPort(_, ip, p, port) => {
                                AffinityDest::Dst(ip, p, port)
                            }
                            ElemKey::AddrProtoPort(_, p, port) => AffinityDest::NodePort(p, port),
                            _ => continue,
                        };
                        if let AffinityScope::Some(dests) = scope
                            && !dests.contains(&dest)
                        {
                            continue;
                        }
                        let keep = wanted
                            .get(&dest)
                            .is_some_and(|(wt, eps)| *wt == t && eps.contains(&to));
                        if !keep {
                            tx.push(family, Op::DeleteElement(map, k));
                        }
                    }
                    if tx.is_empty() {
                        break;
                    }
                    let n = tx.len();
                    match self.kernel.apply(&tx) {
                        Ok(()) => {
                            deleted += n;
                            break;
                        }
                        Err(e) if attempt < 2 => {
                            tracing::debug!(error = %e, map, "an affinity entry went meanwhile; reading again");
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, map, "deleting stale session-affinity entries failed");
                            failed = true;
                        }
                    }
                }
            }
        }
        if deleted > 0 {
            // Our own commit: not drift.
            self.generation = self.kernel.generation();
        }
        (!failed).then_some(deleted)
    }

    /// The flat sets' bounds of `state`'s table once the `changed` ports are applied: the
    /// applied sum, moved by those ports only.
    fn bounds_after(&self, state: &FamilyState, changed: &BTreeSet<ServicePortName>) -> SetBounds {
        let Some(table) = self.tables.get(&state.family) else {
            return SetBounds::of_state(state);
        };
        let mut bounds = table.bounds.clone();
        for name in changed {
            if let Some(unit) = table.units.of(name) {
                bounds.remove(&unit.bounds());
            }
            if let Some(svc) = state.services.get(name) {
                bounds.add(&SetBounds::of_port(svc));
            }
        }
        bounds
    }

    /// Whether a shared (static) set's definition (`bases`, one per desired family) differs
    /// from what was applied.
    fn shared_sets_changed(
        &self,
        desired: &DesiredState,
        bases: &[(BaseObjects, SetBounds)],
    ) -> bool {
        desired
            .families
            .iter()
            .zip(bases)
            .any(|(state, (base, _))| {
                let Some(unit) = self
                    .tables
                    .get(&state.family)
                    .map(|t| t.units.get(OwnerId::BASE))
                else {
                    return true;
                };
                // A set that is new or gone (the flat layout's per-timeout affinity sets) is
                // added or deleted by the partial sync; one whose definition changed is not.
                base.sets
                    .iter()
                    .any(|s| unit.sets().get(&s.name).is_some_and(|h| *h != hash_of(s)))
            })
    }

    /// Deletes flushed stale chains in their own transaction.
    fn cleanup(&mut self, report: &mut SyncReport) -> usize {
        if self.stale.is_empty() {
            return 0;
        }
        let mut tx = Transaction::default();
        for (family, name) in self.stale.keys() {
            tx.push(*family, Op::DeleteChain(name.clone()));
        }
        match self.kernel.apply(&tx) {
            Ok(()) => {
                let n = self.stale.len();
                self.stale.clear();
                n
            }
            Err(e) => {
                tracing::debug!(error = %e, "deleting stale chains failed; retrying later");
                report.cleanup_failed = true;
                0
            }
        }
    }

    /// Rewrites every table we own in one transaction, handed to the kernel one owner at a
    /// time (see [`Kernel::batch`]).
    fn full_sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
    ) -> Result<FullSynced, Error> {
        let first = !self.recreated_base;
        let mut unwanted = Vec::new();
        let mut tables = Vec::new();
        for family in IpFamily::ALL {
            let Some(state) = desired.family(family) else {
                // A family no longer wanted: remove its table (knftables' cleanup).
                if self
                    .kernel
                    .list(family)
                    .map_err(Error::ListFailed)?
                    .is_some()
                {
                    unwanted.push(family);
                }
                continue;
            };
            // What is there now: on the first sync this is the take-over of a table left by
            // an earlier run (or kube-proxy); later it catches objects someone else added.
            let existing = if first || self.relist || !self.tables.contains_key(&family) {
                self.kernel
                    .list(family)
                    .map_err(Error::ListFailed)?
                    .unwrap_or_default()
            } else {
                let t = &self.tables[&family];
                let waiting = self
                    .stale
                    .keys()
                    .filter(|(f, _)| *f == family)
                    .map(|(_, name)| name.clone());
                Existing {
                    chains: chain_names(t).chain(waiting).collect(),
                    sets: t.set_is_map.iter().map(|(k, v)| (k.clone(), *v)).collect(),
                    other_spec: BTreeSet::new(),
                }
            };
            let mut existing = existing;
            if let Some(unit) = self.tables.get(&family).map(|t| t.units.get(OwnerId::BASE)) {
                for set in render_base(state, config).sets {
                    if unit
                        .sets()
                        .get(&set.name)
                        .is_some_and(|h| *h != hash_of(&set))
                    {
                        existing.other_spec.insert(set.name);
                    }
                }
            }
            tables.push((state, existing));
        }
        // The old record is not needed any more: the new one replaces it, and a failed sync
        // lists the kernel again (`relist`). Freed first, its memory is reused for the new one
        // instead of leaving a hole the size of it in the heap after every full sync.
        self.tables.clear();
        let sink = self.kernel.batch();
        match write_full(sink, &unwanted, &tables, config, first) {
            Err(KernelError::Streamed(reason)) => {
                // Once more, built whole: the error then names the operation the kernel
                // refused, and netlink hands a form it does not encode to `nft -f`.
                tracing::debug!(%reason, "streamed full sync failed; applying it whole");
                let kernel = &mut self.kernel;
                let sink = Box::new(Collected::new(move |tx| kernel.apply(&tx)));
                write_full(sink, &unwanted, &tables, config, first)
            }
            result => result,
        }
        .map_err(Error::RulesetApplyFailed)
    }

    /// Plans the transaction of a partial sync (the record is updated as planned; a failure
    /// makes the next sync full and relisted) and the chains it leaves stale.
    fn partial_sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        changed: &BTreeSet<ServicePortName>,
        bases: Vec<(BaseObjects, SetBounds)>,
    ) -> (Transaction, Vec<(IpFamily, String)>) {
        let mut tx = Transaction::default();
        let mut stale = Vec::new();
        for (state, (base, bounds)) in desired.families.iter().zip(bases) {
            let family = state.family;
            let applied = self.tables.get_mut(&family).expect("checked above");
            applied.bounds = bounds;
            let mut plan = Plan::default();
            let base = objects_of_base(base);
            // Every changed owner's elements before and after (the static objects always:
            // the node's addresses are among them).
            let mut changes = Vec::with_capacity(changed.len() + 1);
            let new_base = Claimed::new(base.elements.clone());
            let old_base = Claimed::new(std::mem::take(&mut applied.base_elements));
            applied.base_elements = base.elements.clone();
            plan.unit(applied, OwnerId::BASE, Some(base), None, false);
            changes.push((OwnerId::BASE, old_base, new_base));
            for name in changed {
                let svc = state.services.get(name);
                // What the kernel holds for it: its last state rendered again.
                let (owner, old) = match (applied.units.id_of(name), svc) {
                    (Some(id), _) => {
                        let old =
                            applied.units.get(id).source.as_deref().map(|old| {
                                Claimed::new(render_service(old, state, config).elements)
                            });
                        (id, old.unwrap_or_default())
                    }
                    (None, Some(svc)) => {
                        (applied.units.add(Unit::of(svc.clone())), Claimed::default())
                    }
                    (None, None) => continue,
                };
                let mut objs = svc.map(|svc| render_service(svc, state, config));
                let new = objs
                    .as_mut()
                    .map(|o| Claimed::new(std::mem::take(&mut o.elements)))
                    .unwrap_or_default();
                plan.unit(applied, owner, objs, svc.cloned(), false);
                changes.push((owner, old, new));
            }
            plan.settle_elements(applied, changes, state, config);
            applied.units.settled();
            stale.extend(plan.stale.iter().map(|c| (family, c.clone())));
            // A chain waiting for deletion that is wanted again (an endpoint back before its
            // old chain was deleted) is re-used, not deleted.
            for (name, _) in &plan.add_chains {
                self.stale.remove(&(family, name.clone()));
            }
            plan.write(&mut tx, family);
        }
        (tx, stale)
    }
}

/// The static objects viewed as a unit.
fn objects_of_base(base: super::ruleset::BaseObjects) -> ServiceObjects {
    ServiceObjects {
        chains: base.chains,
        sets: base.sets,
        elements: base.elements,
    }
}

/// Transaction pieces collected per phase, so that, whatever the owners, objects are created
/// before they are referenced and unreferenced before they are deleted.
#[derive(Default)]
struct Plan {
    add_sets: Vec<Set>,
    add_chains: Vec<(String, Option<BaseHook>)>,
    flush_chains: Vec<String>,
    delete_sets: Vec<(String, bool)>,
    rules: Vec<(String, Rule)>,
    delete_elements: Vec<(&'static str, ElemKey)>,
    add_elements: Vec<Element>,
    stale: Vec<String>,
}

impl Plan {
    /// Plans the element changes of a partial sync: `changes` holds every changed owner with
    /// its elements before and after. For each claim they touch, the owners are updated,
    /// and the elements of its first owner before (what the kernel holds) are turned into
    /// those of its first owner after, key by key. An unchanged owner that wins or loses a
    /// claim (another Service took its external IP, or left it) is rendered again.
    fn settle_elements(
        &mut self,
        applied: &mut AppliedTable,
        changes: Vec<(OwnerId, Claimed, Claimed)>,
        state: &FamilyState,
        config: &NodeConfig,
    ) {
        let mut touched: BTreeMap<Claim, Option<OwnerId>> = BTreeMap::new();
        for (_, old, new) in &changes {
            for (claim, _) in old.groups().chain(new.groups()) {
                touched
                    .entry(claim)
                    .or_insert_with(|| applied.claims.first(&claim));
            }
        }
        // Every owner leaves the claims it no longer makes before any joins one: the order of
        // owners is by name, and a gone owner's name is gone with its unit.
        for (owner, old, new) in &changes {
            for (claim, _) in old.groups() {
                if !new.has(claim) {
                    applied.claims.remove(&claim, *owner);
                }
            }
        }
        let units = &applied.units;
        for (owner, old, new) in &changes {
            for (claim, _) in new.groups() {
                if !old.has(claim) {
                    applied.claims.add(claim, *owner, |a, b| units.order(a, b));
                }
            }
        }
        let by_owner: HashMap<OwnerId, (&Claimed, &Claimed)> = changes
            .iter()
            .map(|(o, old, new)| (*o, (old, new)))
            .collect();
        // Unchanged owners rendered again, once each.
        let mut rendered: HashMap<OwnerId, Claimed> = HashMap::new();
        let current = |owner: OwnerId| -> Claimed {
            match applied.units.get(owner).source.as_deref() {
                Some(svc) => Claimed::new(render_service(svc, state, config).elements),
                None => Claimed::new(applied.base_elements.clone()),
            }
        };
        for (claim, before) in touched {
            let after = applied.claims.first(&claim);
            let mut elements_of = |owner: Option<OwnerId>, old: bool| -> Vec<Element> {
                let Some(owner) = owner else {
                    return Vec::new();
                };
                let of = |c: &Claimed| c.of(claim).iter().map(|(_, e)| e.clone()).collect();
                match by_owner.get(&owner) {
                    Some((o, n)) => of(if old { o } else { n }),
                    None => of(rendered.entry(owner).or_insert_with(|| current(owner))),
                }
            };
            let was = elements_of(before, true);
            let now = elements_of(after, false);
            self.diff_elements(was, now);
        }
    }

    /// Deletions and additions that turn `was` into `now` (both sorted by set and key, one
    /// element per key): an element whose value or comment changed is deleted and added.
    fn diff_elements(&mut self, was: Vec<Element>, now: Vec<Element>) {
        let value = |e: &Element| (e.value.clone(), e.data, e.comment.clone()) as ElemValue;
        let mut now = now.into_iter().peekable();
        for old in was {
            let key = (old.set, old.key);
            while let Some(n) = now.next_if(|n| (n.set, n.key) < key) {
                self.add_elements.push(n);
            }
            match now.next_if(|n| (n.set, n.key) == key) {
                Some(n) if value(&n) == value(&old) => {}
                Some(n) => {
                    self.delete_elements.push(key);
                    self.add_elements.push(n);
                }
                None => self.delete_elements.push(key),
            }
        }
        self.add_elements.extend(now);
    }

    /// Plans the change of one owner's chains and sets from what `applied` remembers to
    /// `objs` (`None`: the owner is gone), updating `applied`; `source` is the Service port's
    /// state `objs` was rendered from. `rewrite`: rewrite every chain even if unchanged (full
    /// sync). Elements are not looked at: see [`Plan::settle_elements`].
    fn unit(
        &mut self,
        applied: &mut AppliedTable,
        owner: OwnerId,
        objs: Option<ServiceObjects>,
        source: Option<Arc<ServicePortState>>,
        rewrite: bool,
    ) {
        let gone = objs.is_none();
        let (name, (old_chains, old_sets)) = if gone {
            let mut old = applied.units.remove(owner);
            (old.name().cloned(), old.take_objects())
        } else {
            let unit = applied.units.get_mut(owner);
            (unit.name().cloned(), unit.take_objects())
        };
        let ServiceObjects { chains, sets, .. } = objs.unwrap_or_default();
        let mut unit_sets = BTreeMap::new();

        // Sets: new ones are added; ones whose spec changed are re-created, which needs
        // every chain of this owner rewritten (they may reference it).
        let mut respec = false;
        for set in &sets {
            let h = hash_of(set);
            match old_sets.get(&set.name) {
                Some(oh) if *oh == h => {}
                Some(_) => {
                    respec = true;
                    self.delete_sets.push((set.name.clone(), set.is_map()));
                    self.add_sets.push(set.clone());
                }
                None => self.add_sets.push(set.clone()),
            }
            applied.set_is_map.insert(set.name.clone(), set.is_map());
            unit_sets.insert(set.name.clone(), h);
        }
        // Chains.
        let readable = readable(name.as_ref());
        let readable = readable.as_deref();
        let mut applied_chains = Vec::with_capacity(chains.len());
        for chain in chains {
            let h = hash_of(&(&chain.base, &chain.rules));
            let key = ChainKey::of(readable, &chain.name);
            let same = old_chains.hash(&key) == Some(h);
            if !same || rewrite || respec {
                if !old_chains.contains(&key) || rewrite {
                    self.add_chains
                        .push((chain.name.clone(), chain.base.clone()));
                }
                self.flush_chains.push(chain.name.clone());
                // Rules are moved, not copied: a full sync at 10,000 Services holds
                // hundreds of thousands of them.
                for rule in chain.rules {
                    self.rules.push((chain.name.clone(), rule));
                }
            }
            applied_chains.push((key, h));
        }
        let unit_chains = AppliedChains::new(applied_chains);
        for key in old_chains.keys() {
            if !unit_chains.contains(key) {
                let name = key.name(readable);
                self.flush_chains.push(name.clone());
                self.stale.push(name);
            }
        }
        for (name, _) in old_sets.iter() {
            if !unit_sets.contains_key(name) {
                let is_map = applied.set_is_map.remove(name).unwrap_or(false);
                self.delete_sets.push((name.clone(), is_map));
            }
        }
        if !gone {
            let unit = applied.units.get_mut(owner);
            unit.source = source;
            unit.set_objects(unit_chains, unit_sets);
        }
    }

    fn write(&mut self, tx: &mut Transaction, family: IpFamily) {
        for s in &self.add_sets {
            if !self.delete_sets.iter().any(|(n, _)| *n == s.name) {
                tx.push(family, Op::AddSet(s.clone()));
            }
        }
        for (name, hook) in &self.add_chains {
            tx.push(family, Op::AddChain(name.clone(), hook.clone()));
        }
        for name in &self.flush_chains {
            tx.push(family, Op::FlushChain(name.clone()));
        }
        for (name, is_map) in &self.delete_sets {
            tx.push(family, Op::DeleteSet(name.clone(), *is_map));
        }
        for s in &self.add_sets {
            if self.delete_sets.iter().any(|(n, _)| *n == s.name) {
                tx.push(family, Op::AddSet(s.clone()));
            }
        }
        for (chain, rule) in std::mem::take(&mut self.rules) {
            tx.push(family, Op::AddRule(chain, rule));
        }
        for (set, key) in &self.delete_elements {
            // A deleted (or re-created) set took its elements with it.
            if !self.delete_sets.iter().any(|(n, _)| n == set) {
                tx.push(family, Op::DeleteElement(set, *key));
            }
        }
        for e in &self.add_elements {
            tx.push(family, Op::AddElement(e.clone()));
        }
    }
}

/// Writes a full sync into `sink` and commits it: the unwanted families' tables deleted, the
/// others rewritten (see [`full_table`]).
fn write_full(
    mut sink: Box<dyn TransactionSink + '_>,
    unwanted: &[IpFamily],
    tables: &[(&FamilyState, Existing)],
    config: &NodeConfig,
    recreate_base: bool,
) -> Result<FullSynced, KernelError> {
    let mut ops = 0;
    for family in unwanted {
        let mut tx = Transaction::default();
        tx.push(*family, Op::DeleteTable);
        ops += tx.len();
        sink.add(tx)?;
    }
    let mut applied_tables = Vec::new();
    let mut stale = Vec::new();
    for (state, existing) in tables {
        let (applied, family_stale, n) =
            full_table(&mut *sink, state, config, existing, recreate_base)?;
        ops += n;
        stale.extend(family_stale.into_iter().map(|c| (state.family, c)));
        applied_tables.push((state.family, applied));
    }
    sink.commit()?;
    Ok((ops, applied_tables, stale))
}

/// Elements per piece of a full sync's element section (a multiple of the netlink encoder's
/// 128 elements per message).
const ELEMENTS_PER_PIECE: usize = 4096;

/// Writes the full rewrite of one table into `sink`, in pieces: first the table, the shared
/// sets and a flush of every chain that exists, then each owner's sets, chains and rules (the
/// static objects first, then one Service port at a time), then the stale sets' removal and
/// every map element. Returns what is then applied, the stale chains (flushed here, deleted
/// later) and the number of operations.
fn full_table(
    sink: &mut dyn TransactionSink,
    state: &FamilyState,
    config: &NodeConfig,
    existing: &Existing,
    recreate_base: bool,
) -> Result<(AppliedTable, Vec<String>, usize), KernelError> {
    let family = state.family;
    let mut applied = AppliedTable::default();
    let mut ops = 0;
    let mut emit = |tx: Transaction| {
        ops += tx.len();
        sink.add(tx)
    };
    // What the Service ports may put into the flat sets: sizes the sets, and is the record's
    // running sum from here on.
    let bounds = SetBounds::of_state(state);
    let base = render_base_sized(state, config, &bounds);

    let mut tx = Transaction::default();
    tx.push(family, Op::AddTable);
    for s in &base.sets {
        // On the first sync an existing shared set is deleted and re-created below: adding it
        // here first would fail if an older version made it with other flags or type.
        let recreate =
            recreate_base || existing.other_spec.contains(&s.name) || s.has_endpoint_data();
        if !(recreate && existing.sets.contains_key(&s.name)) {
            tx.push(family, Op::AddSet(s.clone()));
        }
    }
    // Every chain there is gets flushed before anything else: then no rule references a set
    // or another chain, and each owner's piece below only adds. `existing` may be our record
    // rather than a listing, and someone may have deleted the chain or the whole table since
    // (`nft flush ruleset` in a firewall reload): each is added first, so the flush always
    // finds it (knftables' add-then-flush), with its hook if it is one of our base chains.
    let hooks: HashMap<&str, &BaseHook> = base
        .chains
        .iter()
        .filter_map(|c| c.base.as_ref().map(|h| (c.name.as_str(), h)))
        .collect();
    for name in &existing.chains {
        let hook = hooks.get(name.as_str()).map(|h| (*h).clone());
        tx.push(family, Op::AddChain(name.clone(), hook));
        tx.push(family, Op::FlushChain(name.clone()));
    }
    if recreate_base {
        // Re-create base chains so that hooks and priorities are ours even if an older
        // version left them otherwise; in one transaction, so no packet sees them missing.
        for chain in &base.chains {
            if chain.base.is_some() && existing.chains.contains(&chain.name) {
                tx.push(family, Op::DeleteChain(chain.name.clone()));
            }
        }
    }
    // On the first sync, shared sets and maps an older version created are re-created with
    // our definition (type, flags, comment); later they are only emptied. Either way they are
    // refilled at the end. (Affinity sets belong to Service ports, below, and keep their
    // dynamic content.)
    for s in &base.sets {
        if is_affinity_set(&s.name) || !existing.sets.contains_key(&s.name) {
            continue;
        }
        if recreate_base || existing.other_spec.contains(&s.name) || s.has_endpoint_data() {
            tx.push(family, Op::DeleteSet(s.name.clone(), s.is_map()));
            tx.push(family, Op::AddSet(s.clone()));
        } else {
            tx.push(family, Op::FlushSet(s.name.clone(), s.is_map()));
        }
    }
    emit(tx)?;

    // Elements wait in one buffer per set and reach the sink in runs of one set (the netlink
    // encoder packs a run into few messages), after the chains they may point to.
    let mut pending = Pending::default();
    let mut owner_piece = |applied: &mut AppliedTable,
                           owner: OwnerId,
                           mut objs: ServiceObjects,
                           source: Option<Arc<ServicePortState>>,
                           pending: &mut Pending,
                           last: bool|
     -> Result<(), KernelError> {
        let is_base = owner == OwnerId::BASE;
        let elements = std::mem::take(&mut objs.elements);
        let mut plan = Plan::default();
        plan.unit(applied, owner, Some(objs), source, true);
        let mut tx = Transaction::default();
        if !is_base {
            for s in plan.add_sets {
                tx.push(family, Op::AddSet(s));
            }
        }
        for (name, hook) in plan.add_chains {
            tx.push(family, Op::AddChain(name, hook));
        }
        for (chain, rule) in plan.rules {
            tx.push(family, Op::AddRule(chain, rule));
        }
        emit(tx)?;
        // Owners come in order, so the first to claim something keeps it: a later one is
        // only noted as a claimant, its elements of that claim stay out. Each kept element
        // is moved once, into its set's pending piece.
        let (claims, order) = claim_order(&elements);
        let mut keep = vec![false; elements.len()];
        let mut won: Option<(Claim, bool)> = None;
        for i in order {
            let claim = claims[i as usize];
            keep[i as usize] = match won {
                Some((c, w)) if c == claim => w,
                _ => {
                    let units = &applied.units;
                    let w = applied.claims.add(claim, owner, |a, b| units.order(a, b));
                    won = Some((claim, w));
                    w
                }
            };
        }
        for (element, keep) in elements.into_iter().zip(keep) {
            if keep {
                pending.push(family, element);
            }
        }
        for (_, piece) in &mut pending.0 {
            if last || piece.len() >= ELEMENTS_PER_PIECE {
                emit(std::mem::take(piece))?;
                if !last {
                    piece.ops.reserve(ELEMENTS_PER_PIECE);
                }
            }
        }
        Ok(())
    };
    // The claims of every Service port: about one per destination, NodePort and endpoint
    // (reserved at once rather than grown, which would rehash a million entries in steps).
    applied.claims.reserve(family, bounds.claims());
    applied.units.reserve(state.services.len());
    applied.bounds = bounds;
    applied.base_elements = base.elements.clone();
    let base_last = state.services.is_empty();
    owner_piece(
        &mut applied,
        OwnerId::BASE,
        objects_of_base(base),
        None,
        &mut pending,
        base_last,
    )?;
    let count = state.services.len();
    for (i, svc) in state.services.values().enumerate() {
        let objects = render_service(svc, state, config);
        let owner = applied.units.add(Unit::of(svc.clone()));
        owner_piece(
            &mut applied,
            owner,
            objects,
            Some(svc.clone()),
            &mut pending,
            i + 1 == count,
        )?;
    }
    applied.context = Some(Context::of(state, config));

    let wanted_chains: HashSet<String> = chain_names(&applied).collect();
    let stale: Vec<String> = existing
        .chains
        .iter()
        .filter(|c| !wanted_chains.contains(c.as_str()))
        .cloned()
        .collect();
    let mut tx = Transaction::default();
    // Stale sets: unreferenced since every chain was flushed above, and never filled here. A
    // stale map may point at chains; flushing it first drops those references.
    for (name, is_map) in &existing.sets {
        if !applied.set_is_map.contains_key(name) {
            tx.push(family, Op::FlushSet(name.clone(), *is_map));
            tx.push(family, Op::DeleteSet(name.clone(), *is_map));
        }
    }
    if !tx.is_empty() {
        emit(tx)?;
    }
    Ok((applied, stale, ops))
}

/// A full sync's elements waiting for the sink, one piece per set (a handful of sets: a piece
/// found by a scan, comparing names by address first).
#[derive(Default)]
struct Pending(Vec<(&'static str, Transaction)>);

impl Pending {
    fn push(&mut self, family: IpFamily, e: Element) {
        let set = e.set;
        let at = match self
            .0
            .iter()
            .position(|(s, _)| std::ptr::eq(*s, set) || *s == set)
        {
            Some(at) => at,
            None => {
                let mut piece = Transaction::default();
                piece.ops.reserve(ELEMENTS_PER_PIECE);
                self.0.push((set, piece));
                self.0.len() - 1
            }
        };
        self.0[at].1.push(family, Op::AddElement(e));
    }
}

/// Time after which a stale chain is surely unreferenced on old kernels (kube-proxy waits 1 s).
pub const STALE_CHAIN_GRACE: Duration = Duration::from_secs(1);

#[cfg(test)]
mod chain_key_tests {
    use super::*;
    use crate::model::Protocol;
    use crate::nftables::names::{EndpointNames, ServiceChainNames};

    fn round_trip(port: &ServicePortName, name: &str) -> ChainKey {
        let readable = readable(Some(port));
        let key = ChainKey::of(readable.as_deref(), name);
        assert_eq!(key.name(readable.as_deref()), name, "{key:?}");
        key
    }

    #[test]
    fn every_chain_name_of_a_service_port_is_kept_as_parts_and_gives_back_the_same_name() {
        // Reference 003's names.
        let backends = ServicePortName::new("default", "backends", "", Protocol::Tcp);
        let key = round_trip(&backends, "service-GZEOLGI7-default/backends/tcp/");
        assert!(matches!(key, ChainKey::Port(0, _)));
        let kubernetes = ServicePortName::new("default", "kubernetes", "https", Protocol::Tcp);
        let key = round_trip(
            &kubernetes,
            "endpoint-4GDGBDUZ-default/kubernetes/tcp/https__192.168.228.3/6443",
        );
        assert!(matches!(key, ChainKey::Endpoint(_, _, 6443)));

        let port = ServicePortName::new("ns1", "web", "http", Protocol::Udp);
        let names = ServiceChainNames::new(&port);
        for name in [
            &names.cluster,
            &names.local,
            &names.external,
            &names.firewall,
        ] {
            assert!(matches!(round_trip(&port, name), ChainKey::Port(..)));
        }
        for ip in ["10.0.0.1", "fd00::1", "2001:db8::a:b"] {
            let name = EndpointNames::new(&port, ip.parse().unwrap(), 8080).chain;
            assert!(
                matches!(round_trip(&port, &name), ChainKey::Endpoint(..)),
                "{name}"
            );
        }
    }

    #[test]
    fn names_the_parts_cannot_rebuild_are_kept_whole_and_every_name_reads_back_unchanged() {
        let port = ServicePortName::new("ns1", "web", "http", Protocol::Tcp);
        // An IPv4-mapped IPv6 address reads back as another address after the colon-to-dot
        // rewrite, but one that writes the same name: the name is what is kept.
        let mapped = EndpointNames::new(&port, "::ffff:10.0.0.1".parse().unwrap(), 80).chain;
        round_trip(&port, &mapped);
        // kube-proxy truncates names over 240 characters.
        let long = ServicePortName::new("ns1", &"x".repeat(250), "http", Protocol::Tcp);
        let names = ServiceChainNames::new(&long);
        assert!(names.cluster.ends_with("..."));
        assert!(matches!(
            round_trip(&long, &names.cluster),
            ChainKey::Named(_)
        ));
        // Static chains, and another port's chain.
        assert!(matches!(
            ChainKey::of(None, "services"),
            ChainKey::Named(n) if &*n == "services"
        ));
        let other = ServicePortName::new("ns1", "api", "http", Protocol::Tcp);
        let other_name = ServiceChainNames::new(&other).cluster;
        assert!(matches!(round_trip(&port, &other_name), ChainKey::Named(_)));
    }
}
