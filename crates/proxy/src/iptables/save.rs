//! `iptables-save` output read back into the [`TableView`] the [tracer](super::tracer) walks:
//! what a node's kernel holds, for `nodeport trace --rules kernel`.
//!
//! `iptables-save` prints rules in its own canonical form (`-d 10.96.0.10/32 -p tcp -m
//! comment --comment "…" -m tcp --dport 80`, marks as `--set-xmark value/mask`,
//! probabilities with eleven digits), which this reads into the same [`Rule`] values the
//! proxy renders. A rule with a match or target the tracer does not model (an interface
//! match, a `LOG` target, another tool's extension) is left out and listed in
//! [`Saved::skipped`], so that a trace over it can say what it did not evaluate.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::ruleset::{Addr, Match, Rule, Table, TableView, Target};
use crate::model::Protocol;

/// What an `iptables-save` output holds, as the tracer reads it.
#[derive(Debug, Clone, Default)]
pub struct Saved {
    /// Every table's chains and the rules understood.
    pub view: TableView,
    /// Rules left out, as `table chain: rule text`.
    pub skipped: Vec<String>,
    /// Per chain, for each rule read into [`Self::view`] (in its order): its place among
    /// every rule the chain lists (from 1, those left out counted), as `iptables -L
    /// --line-numbers` numbers it.
    pub places: std::collections::HashMap<(Table, String), Vec<usize>>,
}

impl Saved {
    /// The place in its chain (from 1) of the rule `index` (from 0) of `chain` as read.
    pub fn place(&self, table: Table, chain: &str, index: usize) -> Option<usize> {
        self.places
            .get(&(table, chain.to_string()))?
            .get(index)
            .copied()
    }
}

/// Reads `iptables-save` (or `ip6tables-save`) output of every table.
pub fn parse(text: &str) -> Saved {
    let mut saved = Saved {
        view: TableView::empty(),
        skipped: Vec::new(),
        places: Default::default(),
    };
    let mut listed: std::collections::HashMap<(Table, String), usize> = Default::default();
    // Chains are declared (`:NAME POLICY [counters]`) before the rules of their table.
    let mut table = None;
    let mut chains: BTreeSet<(Table, String)> = BTreeSet::new();
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = match name.trim() {
                "filter" => Some(Table::Filter),
                "nat" => Some(Table::Nat),
                "mangle" => Some(Table::Mangle),
                // raw, security: no rule of ours, not walked.
                _ => None,
            };
        } else if let (Some(t), Some(decl)) = (table, line.strip_prefix(':')) {
            if let Some(name) = decl.split_whitespace().next() {
                chains.insert((t, name.to_string()));
                saved.view.chains.entry((t, name.to_string())).or_default();
            }
        } else if let (Some(t), Some(rest)) = (table, line.strip_prefix("-A ")) {
            let words = words(rest);
            let Some((chain, args)) = words.split_first() else {
                continue;
            };
            let place = listed.entry((t, chain.clone())).or_default();
            *place += 1;
            match rule(&args.iter().map(String::as_str).collect::<Vec<_>>(), |c| {
                chains.contains(&(t, c.to_string()))
            }) {
                Some(r) => {
                    saved
                        .view
                        .chains
                        .entry((t, chain.clone()))
                        .or_default()
                        .push(r);
                    saved
                        .places
                        .entry((t, chain.clone()))
                        .or_default()
                        .push(*place);
                }
                None => saved
                    .skipped
                    .push(format!("{} {chain}: {}", t.as_str(), args.join(" "))),
            }
        }
    }
    saved
}

/// Splits a rule into words, `"quoted words"` kept whole without their quotes.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut any = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

fn addr(s: &str) -> Option<Addr> {
    if let Ok(net) = s.parse::<IpNet>() {
        // `iptables-save` prints every address with its length: a host route is the address.
        if net.prefix_len() == net.max_prefix_len() {
            return Some(Addr::Ip(net.addr()));
        }
        return Some(Addr::Net(net));
    }
    s.parse::<IpAddr>().ok().map(Addr::Ip)
}

fn number(s: &str) -> Option<u32> {
    match s.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

fn protocol(s: &str) -> Option<Protocol> {
    Protocol::parse(&s.to_ascii_uppercase())
}

/// `--ctstate` states as the tracer evaluates them: the first packet of a connection is
/// `NEW` (and `DNAT` once translated), nothing else.
fn ct_states(s: &str) -> &'static str {
    let states: Vec<&str> = s.split(',').collect();
    match (states.contains(&"NEW"), states.contains(&"DNAT")) {
        (true, true) => "NEW,DNAT",
        (true, false) => "NEW",
        (false, true) => "DNAT",
        (false, false) => "INVALID",
    }
}

/// One rule's arguments; `None` when something in it is not modelled. `is_chain` tells a
/// jump to a user chain from a target extension.
fn rule(args: &[&str], is_chain: impl Fn(&str) -> bool) -> Option<Rule> {
    let mut matches = Vec::new();
    let mut target = Target::None;
    let mut i = 0;
    let mut negate = false;
    let next = |i: &mut usize| -> Option<&str> {
        *i += 1;
        args.get(*i).copied()
    };
    while i < args.len() {
        match args[i] {
            "!" => {
                negate = true;
                i += 1;
                continue;
            }
            "-d" => matches.push(Match::Dst {
                negate,
                addr: addr(next(&mut i)?)?,
            }),
            "-s" => matches.push(Match::Src {
                negate,
                addr: addr(next(&mut i)?)?,
            }),
            "-p" => {
                let p = protocol(next(&mut i)?)?;
                // `-p tcp -m tcp` is kube-proxy's pair; the module is read with `-m`.
                if args.get(i + 1) == Some(&"-m")
                    && args.get(i + 2).and_then(|m| protocol(m)) == Some(p)
                {
                    i += 2;
                    matches.push(Match::Protocol(p));
                } else {
                    matches.push(Match::ProtocolOnly(p));
                }
            }
            "--dport" => matches.push(Match::Dport(next(&mut i)?.parse().ok()?)),
            "-m" => match next(&mut i)? {
                "comment" => {
                    if next(&mut i)? != "--comment" {
                        return None;
                    }
                    matches.push(Match::Comment(next(&mut i)?.to_string()));
                }
                m if protocol(m).is_some() => {
                    // `-m tcp` without a preceding `-p`: nothing to evaluate by itself.
                }
                "addrtype" => {
                    let mut neg = false;
                    let mut flag = next(&mut i)?;
                    if flag == "!" {
                        neg = true;
                        flag = next(&mut i)?;
                    }
                    let src = match flag {
                        "--src-type" => true,
                        "--dst-type" => false,
                        _ => return None,
                    };
                    if next(&mut i)? != "LOCAL" {
                        return None;
                    }
                    matches.push(Match::AddrTypeLocal { src, negate: neg });
                }
                "conntrack" => {
                    let mut neg = false;
                    let mut flag = next(&mut i)?;
                    if flag == "!" {
                        neg = true;
                        flag = next(&mut i)?;
                    }
                    if flag != "--ctstate" {
                        return None;
                    }
                    matches.push(Match::CtState {
                        negate: neg,
                        states: ct_states(next(&mut i)?),
                    });
                }
                "mark" => {
                    let mut neg = false;
                    let mut flag = next(&mut i)?;
                    if flag == "!" {
                        neg = true;
                        flag = next(&mut i)?;
                    }
                    if flag != "--mark" {
                        return None;
                    }
                    let (value, mask) = next(&mut i)?.split_once('/')?;
                    let (value, mask) = (number(value)?, number(mask)?);
                    if value != mask {
                        return None;
                    }
                    matches.push(Match::Mark {
                        negate: neg,
                        mark: value,
                    });
                }
                "statistic" => {
                    if next(&mut i)? != "--mode" || next(&mut i)? != "random" {
                        return None;
                    }
                    if next(&mut i)? != "--probability" {
                        return None;
                    }
                    let p: f64 = next(&mut i)?.parse().ok()?;
                    // iptables' statistic extension takes 0 to 1 (`--probability must be
                    // between 0 and 1`); anything else (above 1, `inf`, `NaN`) cannot come
                    // from a kernel and has no branch weight. 0 never matches: not modelled.
                    if !(p > 0.0 && p <= 1.0) {
                        return None;
                    }
                    matches.push(Match::Probability((1.0 / p).round() as u32));
                }
                "recent" => {
                    // `--rcheck --seconds S --reap --name N --mask M --rsource`, or
                    // `--set --name N --mask M --rsource`, in any order.
                    let (mut check, mut set, mut name, mut seconds) = (false, false, None, 0);
                    while let Some(flag) = args.get(i + 1).filter(|a| a.starts_with("--")) {
                        i += 1;
                        match *flag {
                            "--rcheck" => check = true,
                            "--set" => set = true,
                            "--reap" | "--rsource" => {}
                            "--name" => name = Some(next(&mut i)?.to_string()),
                            "--seconds" => seconds = next(&mut i)?.parse().ok()?,
                            "--mask" => {
                                // Only the full mask: affinity per client address.
                                let m = next(&mut i)?;
                                if m != "255.255.255.255"
                                    && m != "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
                                {
                                    return None;
                                }
                            }
                            _ => return None,
                        }
                    }
                    let name = name?;
                    match (check, set) {
                        (true, false) => matches.push(Match::RecentCheck { name, seconds }),
                        (false, true) => matches.push(Match::RecentSet(name)),
                        _ => return None,
                    }
                }
                "physdev" => {
                    if next(&mut i)? != "!" || next(&mut i)? != "--physdev-is-in" {
                        return None;
                    }
                    matches.push(Match::NotFromBridge);
                }
                _ => return None,
            },
            "-j" => {
                target = match next(&mut i)? {
                    "ACCEPT" => Target::Accept,
                    "DROP" => Target::Drop,
                    "RETURN" => Target::Return,
                    "REJECT" => {
                        // `--reject-with` any: the packet is refused either way.
                        if args.get(i + 1) == Some(&"--reject-with") {
                            i += 2;
                        }
                        Target::Reject
                    }
                    "MASQUERADE" => {
                        let random_fully = args.get(i + 1) == Some(&"--random-fully");
                        if random_fully {
                            i += 1;
                        }
                        Target::Masquerade { random_fully }
                    }
                    "MARK" => {
                        let (value, mask) = match next(&mut i)? {
                            "--set-xmark" => {
                                let (v, m) = next(&mut i)?.split_once('/')?;
                                (number(v)?, number(m)?)
                            }
                            "--or-mark" => {
                                let v = number(next(&mut i)?)?;
                                (v, v)
                            }
                            "--xor-mark" => (number(next(&mut i)?)?, 0),
                            _ => return None,
                        };
                        // x = (x & ~mask) ^ value: an OR when mask = value, an XOR when 0.
                        if mask == value {
                            Target::MarkOr(value)
                        } else if mask == 0 {
                            Target::MarkXor(value)
                        } else {
                            return None;
                        }
                    }
                    "DNAT" => {
                        if next(&mut i)? != "--to-destination" {
                            return None;
                        }
                        Target::Dnat(next(&mut i)?.parse::<SocketAddr>().ok()?)
                    }
                    chain if is_chain(chain) => Target::Jump(chain.to_string()),
                    _ => return None,
                };
            }
            _ => return None,
        }
        negate = false;
        i += 1;
    }
    if negate {
        return None;
    }
    Some(Rule::new(matches, target))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_save_forms_read_back_as_the_rules_the_proxy_renders() {
        let saved = parse(
            "*nat\n\
             :PREROUTING ACCEPT [0:0]\n\
             :KUBE-SERVICES - [0:0]\n\
             :KUBE-SVC-X - [0:0]\n\
             :KUBE-SEP-A - [0:0]\n\
             :KUBE-MARK-MASQ - [0:0]\n\
             -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment \"default/web:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-X\n\
             -A KUBE-SVC-X ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-MARK-MASQ\n\
             -A KUBE-SVC-X -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-A\n\
             -A KUBE-SEP-A -p tcp -m recent --set --name KUBE-SEP-A --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.5:8080\n\
             -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
             -A KUBE-SERVICES -i eth0 -j KUBE-SVC-X\n\
             -A KUBE-SERVICES -j LOG\n\
             COMMIT\n",
        );
        let svc = saved.view.chain(Table::Nat, "KUBE-SERVICES").unwrap();
        assert_eq!(
            svc[0].text(),
            "-d 10.96.0.10 -p tcp -m comment --comment \"default/web:http cluster IP\" --dport 80 -j KUBE-SVC-X"
        );
        let chain = saved.view.chain(Table::Nat, "KUBE-SVC-X").unwrap();
        assert_eq!(
            chain[0].matches[0],
            Match::Src {
                negate: true,
                addr: Addr::Net("10.244.0.0/16".parse().unwrap())
            }
        );
        assert_eq!(chain[1].matches, [Match::Probability(3)]);
        let sep = saved.view.chain(Table::Nat, "KUBE-SEP-A").unwrap();
        assert_eq!(
            sep[0].target,
            Target::Dnat("10.244.1.5:8080".parse().unwrap())
        );
        assert!(
            sep[0]
                .matches
                .contains(&Match::RecentSet("KUBE-SEP-A".into()))
        );
        assert_eq!(
            saved.view.chain(Table::Nat, "KUBE-MARK-MASQ").unwrap()[0].target,
            Target::MarkOr(0x4000)
        );
        // An interface match and a LOG target are not modelled: left out, and said so.
        assert_eq!(
            saved.skipped,
            [
                "nat KUBE-SERVICES: -i eth0 -j KUBE-SVC-X",
                "nat KUBE-SERVICES: -j LOG"
            ]
        );
    }

    /// A `nat` table whose `PREROUTING` holds `rules`, after declaring `chains`.
    fn nat(chains: &[&str], rules: &[String]) -> Saved {
        let mut text = String::from("*nat\n:PREROUTING ACCEPT [0:0]\n");
        for chain in chains {
            text.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for rule in rules {
            text.push_str(rule);
            text.push('\n');
        }
        text.push_str("COMMIT\n");
        parse(&text)
    }

    fn remote_packet() -> crate::trace::Packet {
        crate::trace::Packet::remote(
            "203.0.113.5",
            "192.0.2.4",
            crate::model::Protocol::Tcp,
            30080,
        )
    }

    fn traced(saved: &Saved) -> crate::trace::Trace {
        super::super::tracer::trace(&saved.view, &remote_packet(), &crate::trace::Env::default())
    }

    #[test]
    fn a_jump_loop_read_back_from_the_kernel_gives_a_trace_without_fates_instead_of_a_panic() {
        // Found by the `iptables_save` fuzz target: the tracer asserted its depth. No kernel
        // takes a loop (ELOOP), but `iptables-save` text is read as it comes.
        let saved = nat(
            &["A", "B"],
            &[
                "-A PREROUTING -j A".into(),
                "-A A -j B".into(),
                "-A B -j A".into(),
            ],
        );
        assert!(traced(&saved).fates.is_empty());
    }

    #[test]
    fn random_branches_that_keep_apart_are_given_up_instead_of_walked_exponentially() {
        // Found by the fuzz target as a timeout: forty `statistic` rules each flipping another
        // mark bit and walking on make 2^40 distinct branches.
        let rules: Vec<String> = (0..40)
            .map(|i| {
                format!(
                    "-A PREROUTING -m statistic --mode random --probability 0.50000000000 \
                     -j MARK --xor-mark {:#x}",
                    1u32 << (i % 31)
                )
            })
            .collect();
        let saved = nat(&[], &rules);
        assert!(saved.skipped.is_empty(), "{:?}", saved.skipped);
        assert!(traced(&saved).fates.is_empty());
    }

    #[test]
    fn random_branches_that_reach_the_same_state_merge_so_a_long_statistic_chain_is_traced() {
        // Two hundred random rules that change nothing: 2^200 walks before branches merged.
        let rules: Vec<String> = (0..200)
            .map(|_| "-A PREROUTING -m statistic --mode random --probability 0.50000000000".into())
            .collect();
        let trace = traced(&nat(&[], &rules));
        assert_eq!(trace.fates.len(), 1, "{trace}");
        assert!((trace.fates[0].1 - 1.0).abs() < 1e-9, "{trace}");
    }

    #[test]
    fn probabilities_outside_zero_to_one_are_left_out_as_iptables_refuses_them() {
        // Found by the fuzz target: `--probability 3` weighted a branch 1/round(1/3) = 1/0,
        // infinite, and `NaN` the same; the fates no longer summed to 1.
        let saved = nat(
            &["KUBE-SEP-A"],
            &[
                "-A PREROUTING -m statistic --mode random --probability 3 -j KUBE-SEP-A".into(),
                "-A PREROUTING -m statistic --mode random --probability NaN -j KUBE-SEP-A".into(),
                "-A PREROUTING -m statistic --mode random --probability inf -j KUBE-SEP-A".into(),
                "-A PREROUTING -m statistic --mode random --probability 1.00000000000 -j KUBE-SEP-A"
                    .into(),
            ],
        );
        assert_eq!(saved.skipped.len(), 3, "{:?}", saved.skipped);
        let trace = traced(&saved);
        assert_eq!(trace.fates.len(), 1, "{trace}");
        assert!((trace.fates[0].1 - 1.0).abs() < 1e-9, "{trace}");
    }
}
