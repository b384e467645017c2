//! A packet's path, step by step, in the words of `nodeport trace --live`: each rule that
//! matched (`ip kube-proxy services rule 416: jump nodeport-cluster-policy`), the end of each
//! chain it fell off and the policy of each base chain, or an eBPF program's map look-ups;
//! the set or map elements a rule matched; the Service port a step is for.
//!
//! Each tracer records the steps of every way the packet can go (a [`Walk`] per random
//! branch, [`Trail`] while it walks); [`fold`] makes them one path: the steps every way
//! shares, the random choice once with its candidates (each with the steps only it takes),
//! then the steps they share again. The steps are the ones nf_tables reports in its trace
//! events (Linux 6.18, as `--live` reads them): a rule whose every expression matched, with
//! its verdict (`continue` when it has none; `accept` for a NAT statement; `drop` for
//! `reject`), the end of a chain as a step without a rule (`continue`), and after a base
//! chain's end its policy.

use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::rc::Rc;

use serde::Serialize;

use super::Fate;
use crate::desired::ServicePortState;

/// One step of a path, as `-o json` prints it in `path[]` (the same schema for a real
/// packet's, `--live`, and a traced one's).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    /// `ip`, `ip6`, `inet` (an nftables table, iptables-nft's too) or `ebpf`.
    pub family: &'static str,
    /// The table (`kube-proxy`, `nat`, `filter`), or the eBPF program.
    pub table: String,
    /// The chain, or the eBPF program's step (`frontend`, `backend`, `snat`, ...).
    pub chain: String,
    /// The rule's handle in the kernel (`--live`, and `--rules kernel` in the nftables mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule_handle: Option<u64>,
    /// The rule's place in its chain, from 1, as `nft -a list` and `iptables -L
    /// --line-numbers` count them (traced paths; not `--live`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule_index: Option<usize>,
    /// `rule` (a rule matched; without a rule, the end of a chain), `return`, `policy` (the
    /// end of a base chain) or `choice` (a random choice: see `candidates`).
    pub kind: &'static str,
    /// `accept`, `drop`, `continue`, `return`, `jump CHAIN`, `goto CHAIN`; a policy's verdict;
    /// an eBPF step's outcome; a choice's kind (`random choice, one of 3`).
    pub verdict: String,
    /// The set and map elements the rule matched, as `nft list` writes them
    /// (`@nodeport-ips { 192.0.2.11 }`), or the eBPF map entries the step read.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub elements: Vec<String>,
    /// The Service port the step is for (`default/web:80/TCP`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// A choice's candidates, most likely first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<Candidate>,
}

/// One way a random choice goes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// Its probability (Maglev: its share of the table).
    pub probability: f64,
    /// `dnat`, `drop`, `reject` or `pass` (untranslated): how this way ends.
    pub verdict: &'static str,
    /// The endpoint it is translated to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<SocketAddr>,
    /// The steps only this way takes, from the choice on.
    pub path: Vec<Step>,
}

impl Step {
    /// A rule that matched: its place in the chain (from 1) and its verdict.
    pub fn rule(
        family: &'static str,
        table: &str,
        chain: &str,
        index: usize,
        verdict: impl Into<String>,
    ) -> Self {
        Step {
            family,
            table: table.to_string(),
            chain: chain.to_string(),
            rule_handle: None,
            rule_index: Some(index),
            kind: "rule",
            verdict: verdict.into(),
            elements: Vec::new(),
            service: None,
            candidates: Vec::new(),
        }
    }

    /// The end of a chain: evaluation goes on after the rule that jumped to it (nf_tables
    /// reports it as a rule step without a rule, verdict `continue`).
    pub fn end(family: &'static str, table: &str, chain: &str) -> Self {
        Step {
            rule_index: None,
            ..Step::rule(family, table, chain, 0, "continue")
        }
    }

    /// A base chain's policy, after its end.
    pub fn policy(family: &'static str, table: &str, chain: &str, verdict: &str) -> Self {
        Step {
            kind: "policy",
            ..Step::end(family, table, chain).with_verdict(verdict)
        }
    }

    /// A step of an eBPF program (`np_tc_ingress`, `np_connect4`): `what` it does
    /// (`frontend`, `backend`, ...) and how that went.
    pub fn program(program: &str, what: &str, verdict: impl Into<String>) -> Self {
        Step {
            family: "ebpf",
            ..Step::end("ebpf", program, what).with_verdict(verdict)
        }
    }

    fn with_verdict(mut self, verdict: impl Into<String>) -> Self {
        self.verdict = verdict.into();
        self
    }

    /// The step with the elements it matched.
    pub fn with_elements(mut self, elements: Vec<String>) -> Self {
        self.elements = elements;
        self
    }

    /// The step as one line for people (without the `path` label): `ip kube-proxy services
    /// rule 416: jump nodeport-cluster-policy (default/web:80/TCP)`, with the elements it
    /// matched after a `;`. A rule is named by its handle when the kernel gave one, else by
    /// its place (`rule #3`).
    pub fn describe(&self) -> String {
        let mut out = format!("{} {} {}", self.family, self.table, self.chain);
        match (self.rule_handle, self.rule_index) {
            (Some(h), _) => {
                let _ = write!(out, " rule {h}");
            }
            (None, Some(i)) => {
                let _ = write!(out, " rule #{i}");
            }
            (None, None) => {}
        }
        out.push_str(": ");
        match self.kind {
            "policy" => {
                let _ = write!(out, "policy {}", self.verdict);
            }
            "return" => out.push_str("return"),
            _ => out.push_str(&self.verdict),
        }
        if let Some(s) = &self.service {
            let _ = write!(out, " ({s})");
        }
        if !self.elements.is_empty() {
            let _ = write!(out, "; {}", self.elements.join(", "));
        }
        out
    }

    /// Every step of the path the way to `endpoint` takes (a choice replaced by that
    /// candidate's steps; the first candidate's when none goes there).
    pub fn flatten(path: &[Step], endpoint: Option<SocketAddr>) -> Vec<Step> {
        let mut out = Vec::new();
        for s in path {
            if s.kind != "choice" {
                out.push(s.clone());
                continue;
            }
            let c = s
                .candidates
                .iter()
                .find(|c| c.endpoint.is_some() && c.endpoint == endpoint)
                .or(s.candidates.first());
            if let Some(c) = c {
                out.extend(Step::flatten(&c.path, endpoint));
            }
        }
        out
    }
}

/// Writes a path for people, one `path` line per step; a choice as a line, then each
/// candidate's probability and outcome, and its own steps indented under it.
pub fn write_lines(f: &mut impl fmt::Write, path: &[Step]) -> fmt::Result {
    for s in path {
        if s.kind != "choice" {
            writeln!(f, "path        {}", s.describe())?;
            continue;
        }
        writeln!(f, "path        {}", s.describe())?;
        for c in &s.candidates {
            let what = match (c.verdict, c.endpoint) {
                (_, Some(to)) => format!("to {to}"),
                ("drop", _) => "dropped".to_string(),
                ("reject", _) => "rejected".to_string(),
                _ => "not translated".to_string(),
            };
            writeln!(f, "path          {:.2}% {what}", c.probability * 100.0)?;
            for step in &c.path {
                writeln!(f, "path            {}", step.describe())?;
            }
        }
    }
    Ok(())
}

/// The steps of one walk so far: a list shared by the branches that split from it, so that
/// a random branch costs no copy of the steps before it.
#[derive(Debug, Clone, Default)]
pub struct Trail(Option<Rc<Link>>);

#[derive(Debug)]
struct Link {
    step: Step,
    before: Option<Rc<Link>>,
}

impl Trail {
    /// Adds a step.
    pub fn push(&mut self, step: Step) {
        let before = self.0.take();
        self.0 = Some(Rc::new(Link { step, before }));
    }

    /// The steps, first to last.
    pub fn steps(&self) -> Vec<Step> {
        let mut out = Vec::new();
        let mut at = self.0.as_deref();
        while let Some(link) = at {
            out.push(link.step.clone());
            at = link.before.as_deref();
        }
        out.reverse();
        out
    }
}

/// One way a packet goes: its probability, how it ends and the steps it takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Walk {
    /// Its probability.
    pub probability: f64,
    /// How it ends.
    pub fate: Fate,
    /// Its steps.
    pub steps: Vec<Step>,
}

/// How a choice is made, for its step's verdict: `random choice` (numgen, statistic, the
/// programs' random pick) or `Maglev` (the table's slot for the flow's hash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choosing {
    /// Per new connection, at random.
    Random,
    /// By the flow's hash through a Maglev table.
    Maglev,
}

/// The walks as one path: the steps they share, then (when they part) one `choice` step
/// with each way as a candidate (its probability, its outcome, the steps only it takes),
/// then the steps they share again at their end. Ways that take the very same steps are
/// one candidate.
pub fn fold(walks: &[Walk], choosing: Choosing) -> Vec<Step> {
    let Some(first) = walks.first() else {
        return Vec::new();
    };
    if walks.iter().all(|w| w.steps == first.steps) {
        return first.steps.clone();
    }
    let shortest = walks.iter().map(|w| w.steps.len()).min().unwrap_or(0);
    let prefix = (0..shortest)
        .take_while(|&i| walks.iter().all(|w| w.steps[i] == first.steps[i]))
        .count();
    // Shared steps at the end, leaving each way at least one step of its own.
    let suffix = (0..shortest.saturating_sub(prefix + 1))
        .take_while(|&k| {
            fn at(w: &Walk, k: usize) -> &Step {
                &w.steps[w.steps.len() - 1 - k]
            }
            walks.iter().all(|w| at(w, k) == at(first, k))
        })
        .count();
    let mut candidates: Vec<Candidate> = Vec::new();
    for w in walks {
        let own = w.steps[prefix..w.steps.len() - suffix].to_vec();
        let (verdict, endpoint) = match &w.fate {
            Fate::Delivered { dnat: Some(to), .. } => ("dnat", Some(*to)),
            Fate::Delivered { dnat: None, .. } => ("pass", None),
            Fate::Dropped(_) => ("drop", None),
            Fate::Rejected(_) => ("reject", None),
        };
        match candidates
            .iter_mut()
            .find(|c| c.path == own && c.endpoint == endpoint && c.verdict == verdict)
        {
            Some(c) => c.probability += w.probability,
            None => candidates.push(Candidate {
                probability: w.probability,
                verdict,
                endpoint,
                path: own,
            }),
        }
    }
    // Most likely first; equal shares (up to rounding) by endpoint, as the endpoints are
    // listed.
    let share = |c: &Candidate| (c.probability * 1e9).round() as i64;
    candidates.sort_by(|a, b| {
        share(b)
            .cmp(&share(a))
            .then_with(|| a.endpoint.cmp(&b.endpoint))
    });
    // Where the ways part: the chain they all take their first own step in.
    let heads: Vec<&Step> = candidates.iter().filter_map(|c| c.path.first()).collect();
    let (family, table, chain) = match heads.first() {
        Some(head) => {
            let same = |f: fn(&Step) -> &str| heads.iter().all(|s| f(s) == f(head));
            let chain = if same(|s| &s.table) && same(|s| &s.chain) {
                head.chain.clone()
            } else {
                String::new()
            };
            (head.family, head.table.clone(), chain)
        }
        None => ("", String::new(), String::new()),
    };
    let how = match choosing {
        Choosing::Random => "random choice",
        Choosing::Maglev => "Maglev table",
    };
    let choice = Step {
        family,
        table,
        chain,
        rule_handle: None,
        rule_index: None,
        kind: "choice",
        verdict: format!("{how}, one of {}", candidates.len()),
        elements: Vec::new(),
        service: None,
        candidates,
    };
    let mut out = first.steps[..prefix].to_vec();
    out.push(choice);
    out.extend_from_slice(&first.steps[first.steps.len() - suffix..]);
    out
}

/// Names the steps of `path` that are `svc`'s (its label `label`, `default/web:80/TCP`):
/// a rule in a chain of its own (kube-proxy's nftables layout: `service-<H>-…`,
/// `external-…`, `endpoint-…`; iptables: `KUBE-SVC-<H>`, `KUBE-EXT-`, `KUBE-FW-`,
/// `KUBE-SVL-`, `KUBE-SEP-` of its hashes) or a jump into one (kube-proxy's `services`
/// map, the `KUBE-NODEPORTS` rule), or, in the flat layout's shared chains (`flat`), a rule
/// that decided for the packet (a lookup that found the port's element and jumped, the
/// DNAT from its endpoint map, its no-endpoint or source-range drop). A choice is the
/// port's when each of its candidates' first steps is. `--live` names a real packet's
/// path alike.
pub fn name_steps(path: &mut [Step], svc: &ServicePortState, label: &str, flat: bool) {
    use crate::iptables::names as ipt;
    use crate::nftables::names as nft;
    let name = svc.name();
    let nft_chains = nft::ServiceChainNames::new(name);
    let ipt_chains = ipt::ServiceChainNames::new(name);
    let mut own: std::collections::BTreeSet<String> = [
        nft_chains.cluster,
        nft_chains.local,
        nft_chains.external,
        nft_chains.firewall,
        ipt_chains.cluster,
        ipt_chains.local,
        ipt_chains.external,
        ipt_chains.firewall,
    ]
    .into();
    for e in svc.cluster_endpoints.iter().chain(&svc.local_endpoints) {
        own.insert(nft::EndpointNames::new(name, e.ip, e.port).chain);
        own.insert(ipt::endpoint_chain(name, e.ip, e.port));
    }
    let shared = [
        nft::SERVICES,
        nft::CLUSTER_IP_POLICY,
        nft::EXTERNAL_CLUSTER_POLICY,
        nft::EXTERNAL_LOCAL_POLICY,
        nft::NODEPORT_CLUSTER_POLICY,
        nft::NODEPORT_LOCAL_POLICY,
        nft::PICK_SERVICE_ENDPOINTS,
        nft::PICK_NODEPORT_ENDPOINTS,
        nft::PICK_SERVICE_CLUSTER_ENDPOINTS,
        nft::PICK_NODEPORT_CLUSTER_ENDPOINTS,
        nft::SERVICE_ENDPOINTS_CHECK,
        nft::NODEPORT_ENDPOINTS_CHECK,
        nft::FIREWALL_CHECK,
    ];
    name_with(
        path,
        &|step: &Step| {
            let proxys =
                step.table == crate::nftables::ruleset::TABLE || step.chain.starts_with("KUBE-");
            let decided = step.kind == "rule" && step.verdict != "continue";
            let into_own = step
                .verdict
                .split_once(' ')
                .is_some_and(|(verb, to)| matches!(verb, "jump" | "goto") && own.contains(to));
            proxys
                && (own.contains(&step.chain)
                    || into_own
                    || (flat && decided && shared.contains(&step.chain.as_str())))
        },
        label,
    );
}

fn name_with(path: &mut [Step], is_own: &dyn Fn(&Step) -> bool, label: &str) {
    for step in path {
        if step.kind == "choice" {
            for c in &mut step.candidates {
                name_with(&mut c.path, is_own, label);
            }
            let all = step
                .candidates
                .iter()
                .all(|c| c.path.first().is_some_and(|s| s.service.is_some()));
            if all && !step.candidates.is_empty() {
                step.service = Some(label.to_string());
            }
        } else if is_own(step) {
            step.service = Some(label.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dnat(to: &str) -> Fate {
        Fate::Delivered {
            dnat: Some(to.parse().unwrap()),
            masqueraded: true,
            affinity: vec![],
        }
    }

    fn rule(chain: &str, i: usize, verdict: &str) -> Step {
        Step::rule("ip", "kube-proxy", chain, i, verdict)
    }

    #[test]
    fn ways_that_part_at_a_random_choice_are_one_path_with_the_choice_once() {
        let before = vec![rule("nat-prerouting", 1, "jump services")];
        let after = vec![
            rule("nat-postrouting", 2, "jump masquerading"),
            rule("masquerading", 4, "accept"),
        ];
        let way = |endpoint: &str| {
            let mut steps = before.clone();
            steps.push(
                rule("pick", 3, "accept").with_elements(vec![format!("@m {{ {endpoint} }}")]),
            );
            steps.extend(after.clone());
            Walk {
                probability: 0.5,
                fate: dnat(endpoint),
                steps,
            }
        };
        let path = fold(&[way("10.0.0.2:80"), way("10.0.0.1:80")], Choosing::Random);
        let kinds: Vec<&str> = path.iter().map(|s| s.kind).collect();
        assert_eq!(kinds, ["rule", "choice", "rule", "rule"]);
        let choice = &path[1];
        assert_eq!(choice.chain, "pick");
        assert_eq!(choice.verdict, "random choice, one of 2");
        // By endpoint at equal shares, each with its own step only.
        let to: Vec<String> = choice
            .candidates
            .iter()
            .map(|c| c.endpoint.unwrap().to_string())
            .collect();
        assert_eq!(to, ["10.0.0.1:80", "10.0.0.2:80"]);
        assert!(choice.candidates.iter().all(|c| c.path.len() == 1));
        // Flattened for one endpoint: that way's every step.
        let flat = Step::flatten(&path, Some("10.0.0.2:80".parse().unwrap()));
        assert_eq!(flat, way("10.0.0.2:80").steps);
        let mut text = String::new();
        write_lines(&mut text, &path).unwrap();
        assert_eq!(
            text,
            "path        ip kube-proxy nat-prerouting rule #1: jump services\n\
             path        ip kube-proxy pick: random choice, one of 2\n\
             path          50.00% to 10.0.0.1:80\n\
             path            ip kube-proxy pick rule #3: accept; @m { 10.0.0.1:80 }\n\
             path          50.00% to 10.0.0.2:80\n\
             path            ip kube-proxy pick rule #3: accept; @m { 10.0.0.2:80 }\n\
             path        ip kube-proxy nat-postrouting rule #2: jump masquerading\n\
             path        ip kube-proxy masquerading rule #4: accept\n"
        );
    }

    #[test]
    fn a_walk_without_a_choice_is_its_steps_and_a_shared_list_keeps_each_branchs_own() {
        let mut a = Trail::default();
        a.push(rule("x", 1, "continue"));
        let mut b = a.clone();
        a.push(rule("x", 2, "accept"));
        b.push(Step::end("ip", "kube-proxy", "x"));
        assert_eq!(a.steps().len(), 2);
        assert_eq!(b.steps()[1].describe(), "ip kube-proxy x: continue");
        let w = Walk {
            probability: 1.0,
            fate: dnat("10.0.0.1:80"),
            steps: a.steps(),
        };
        assert_eq!(fold(std::slice::from_ref(&w), Choosing::Random), w.steps);
        assert_eq!(
            Step::policy("ip", "kube-proxy", "nat-output", "accept").describe(),
            "ip kube-proxy nat-output: policy accept"
        );
    }
}
