//! The iptables applier against the real `iptables-restore`, in throwaway network
//! namespaces: every restore it builds (first sync, partial syncs, deletions, take-over)
//! must be accepted and leave the tables holding exactly what the render says; a refused
//! restore changes nothing; a flushed table is noticed; the IPVS rendering's ipsets and
//! companion rules load into the real tools.

use std::collections::{BTreeMap, BTreeSet};

use nodeport_proxy::config::NodeConfig;
use nodeport_proxy::desired::{self, DesiredState, NodeView, StateConfig};
use nodeport_proxy::iptables::apply::{Applier, IptablesCommand, Kernel, Variant, detect_variant};
use nodeport_proxy::iptables::ruleset::create_all;
use nodeport_proxy::model::{IpFamily, ServiceName, ServicePortName};
use nodeport_proxy::nodeaddr::NodeFacts;
use nodeport_proxy::objects::{self, Cluster};
use nodeport_testbed::{Netns, require_tools};

fn privileged(test: &str) -> bool {
    require_tools(
        test,
        &[
            "iptables-restore",
            "iptables-save",
            "ip6tables-restore",
            "ip6tables-save",
        ],
    )
}

fn objects(endpoints: &[&str], affinity: bool) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|ip| format!("- {{addresses: [{ip}], nodeName: node-a}}"))
        .collect();
    let affinity = if affinity {
        "  sessionAffinity: ClientIP\n"
    } else {
        ""
    };
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  loadBalancerSourceRanges: [203.0.113.0/24]
{affinity}  ports: [{{name: http, port: 80, targetPort: 8080, nodePort: 30080}}, {{name: dns, port: 53, protocol: UDP, nodePort: 30053}}]
status: {{loadBalancer: {{ingress: [{{ip: 198.51.100.200}}]}}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]
endpoints:
{}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-6, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv6
ports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]
endpoints: [{{addresses: ["fd00:244::1"], nodeName: node-a}}]
---
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: other}}
spec: {{type: NodePort, clusterIP: 10.96.0.11, ports: [{{port: 443, nodePort: 30443}}]}}
"#,
        if eps.is_empty() {
            "  []".to_string()
        } else {
            eps.join("\n")
        }
    )
}

struct Setup {
    cluster: Cluster,
    facts: NodeFacts,
    state: StateConfig,
    config: NodeConfig,
}

impl Setup {
    fn new(yaml: &str) -> Self {
        Setup {
            cluster: objects::load(yaml).unwrap().cluster,
            facts: NodeFacts {
                node_ips: vec![
                    "192.0.2.10".parse().unwrap(),
                    "2001:db8::10".parse().unwrap(),
                ],
                local_ips: vec![
                    "192.0.2.10".parse().unwrap(),
                    "2001:db8::10".parse().unwrap(),
                ],
                ..Default::default()
            },
            state: StateConfig {
                families: IpFamily::ALL.to_vec(),
                nodeport_addresses: "0.0.0.0/0,::/0".parse().unwrap(),
            },
            config: NodeConfig {
                cluster_cidrs: vec![
                    "10.244.0.0/16".parse().unwrap(),
                    "fd00:244::/64".parse().unwrap(),
                ],
                ..Default::default()
            },
        }
    }

    fn desired(&self) -> DesiredState {
        desired::build(
            &self.cluster,
            NodeView::named("node-a"),
            &self.facts,
            &self.state,
        )
    }

    fn set_endpoints(
        &mut self,
        d: &mut DesiredState,
        endpoints: &[&str],
        affinity: bool,
    ) -> BTreeSet<ServicePortName> {
        let fresh = objects::load(&objects(endpoints, affinity))
            .unwrap()
            .cluster;
        let key = ServiceName::new("default", "web-1");
        self.cluster
            .update_slice(key.clone(), fresh.slices.get(&key).cloned());
        let svc = ServiceName::new("default", "web");
        self.cluster
            .update_service(svc.clone(), fresh.services.get(&svc).cloned());
        let changes = self.cluster.take_changes();
        d.refresh_services(&self.cluster, NodeView::named("node-a"), &changes.services)
    }
}

/// `(table, chain)` → its rules in order, as `iptables-save` prints them (counters and
/// comments of the dump itself left out).
type Listing = BTreeMap<(String, String), Vec<String>>;

fn listing(ns: &Netns, family: IpFamily) -> Listing {
    let save = match family {
        IpFamily::V4 => "iptables-save",
        IpFamily::V6 => "ip6tables-save",
    };
    let text = ns.run(&[save]).unwrap();
    let mut out = Listing::new();
    let mut table = String::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.to_string();
        } else if let Some(rest) = line.strip_prefix(':') {
            let chain = rest.split_whitespace().next().unwrap().to_string();
            out.entry((table.clone(), chain)).or_default();
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let (chain, rule) = rest.split_once(' ').unwrap_or((rest, ""));
            out.entry((table.clone(), chain.to_string()))
                .or_default()
                .push(rule.to_string());
        }
    }
    out
}

/// What the tools print for the rendered rules loaded into a fresh namespace.
fn reference(s: &Setup, family: IpFamily) -> Listing {
    let fresh = Netns::new("iptref").unwrap();
    let rules = nodeport_proxy::iptables::render(&s.desired(), &s.config);
    let mut k = IptablesCommand::in_netns(fresh.name());
    k.restore(&create_all(rules.family(family).unwrap(), true))
        .expect("rendered rules load");
    listing(&fresh, family)
}

#[track_caller]
fn assert_same(got: &Listing, want: &Listing, what: &str) {
    let diff: Vec<String> = got
        .keys()
        .chain(want.keys())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter(|k| got.get(k) != want.get(k))
        .map(|k| format!("{k:?}: kernel {:#?}\nrender {:#?}", got.get(k), want.get(k)))
        .collect();
    assert!(diff.is_empty(), "{what}:\n{}", diff.join("\n"));
}

fn check_both(ns: &Netns, s: &Setup, what: &str) {
    for family in IpFamily::ALL {
        assert_same(
            &listing(ns, family),
            &reference(s, family),
            &format!("{what} ({family:?})"),
        );
    }
}

#[test]
fn every_sync_the_applier_builds_is_accepted_by_iptables_restore_and_matches_the_render() {
    if !privileged(
        "every_sync_the_applier_builds_is_accepted_by_iptables_restore_and_matches_the_render",
    ) {
        return;
    }
    let ns = Netns::new("iptapply").unwrap();
    let mut s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2", "10.244.1.3"], false));
    let mut a = Applier::new(IptablesCommand::in_netns(ns.name()));
    let mut d = s.desired();
    assert!(a.sync(&d, &s.config, None).unwrap().full);
    check_both(&ns, &s, "first sync");

    // One endpoint replaced, affinity on: partial sync, stale SEP chain deleted.
    let changed = s.set_endpoints(&mut d, &["10.244.1.1", "10.244.1.4", "10.244.1.3"], true);
    let r = a.sync(&d, &s.config, Some(&changed)).unwrap();
    assert!(!r.full);
    assert!(r.deleted_chains > 0);
    check_both(&ns, &s, "endpoint replaced");

    // Every endpoint gone: the service chains go, the filter rules drop/reject.
    let changed = s.set_endpoints(&mut d, &[], false);
    a.sync(&d, &s.config, Some(&changed)).unwrap();
    check_both(&ns, &s, "no endpoints");

    // Nothing changed: accepted, same tables.
    a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap();
    check_both(&ns, &s, "nothing changed");
}

#[test]
fn start_up_takes_over_existing_chains_keeping_foreign_rules_and_deleting_stale_chains() {
    if !privileged(
        "start_up_takes_over_existing_chains_keeping_foreign_rules_and_deleting_stale_chains",
    ) {
        return;
    }
    let ns = Netns::new("ipttakeover").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2"], false));
    let mut first = Applier::new(IptablesCommand::in_netns(ns.name()));
    first.sync(&s.desired(), &s.config, None).unwrap();
    // Someone else's rule, and a chain of a Service deleted while no proxy ran.
    ns.run(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "PREROUTING",
        "-p",
        "udp",
        "--dport",
        "9",
        "-j",
        "ACCEPT",
    ])
    .unwrap();
    ns.run(&["iptables", "-t", "nat", "-N", "KUBE-SEP-GONEGONEGONEGONE"])
        .unwrap();
    ns.run(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "KUBE-SEP-GONEGONEGONEGONE",
        "-p",
        "tcp",
        "-j",
        "DNAT",
        "--to-destination",
        "10.244.9.9:80",
    ])
    .unwrap();

    let mut second = Applier::new(IptablesCommand::in_netns(ns.name()));
    let r = second
        .sync(&s.desired(), &s.config, Some(&BTreeSet::new()))
        .unwrap();
    assert!(r.full, "a new process starts with a full sync");
    assert_eq!(r.deleted_chains, 1);
    let l = listing(&ns, IpFamily::V4);
    let prerouting = &l[&("nat".to_string(), "PREROUTING".to_string())];
    assert_eq!(
        prerouting
            .iter()
            .filter(|r| r.ends_with("-j KUBE-SERVICES"))
            .count(),
        1,
        "{prerouting:?}"
    );
    assert!(prerouting.iter().any(|r| r.contains("--dport 9 -j ACCEPT")));
    assert!(!l.contains_key(&("nat".to_string(), "KUBE-SEP-GONEGONEGONEGONE".to_string())));
}

#[test]
fn a_restore_the_kernel_refuses_changes_nothing_and_the_next_sync_is_full() {
    if !privileged("a_restore_the_kernel_refuses_changes_nothing_and_the_next_sync_is_full") {
        return;
    }
    let ns = Netns::new("iptrefuse").unwrap();
    let mut s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2"], false));
    let mut a = Applier::new(IptablesCommand::in_netns(ns.name()));
    let mut d = s.desired();
    a.sync(&d, &s.config, None).unwrap();
    // Another tool's chain jumps to one of our endpoint chains: deleting it must fail.
    let doomed = nodeport_proxy::iptables::names::endpoint_chain(
        &ServicePortName::new(
            "default",
            "web",
            "http",
            nodeport_proxy::model::Protocol::Tcp,
        ),
        "10.244.1.2".parse().unwrap(),
        8080,
    );
    ns.run(&["iptables", "-t", "nat", "-N", "OTHER-TOOL"])
        .unwrap();
    ns.run(&["iptables", "-t", "nat", "-A", "OTHER-TOOL", "-j", &doomed])
        .unwrap();
    let before = listing(&ns, IpFamily::V4);
    let changed = s.set_endpoints(&mut d, &["10.244.1.1"], false);
    let err = a.sync(&d, &s.config, Some(&changed)).unwrap_err();
    assert!(
        format!("{err}: {:?}", std::error::Error::source(&err)).contains("iptables-restore"),
        "{err}"
    );
    let after = listing(&ns, IpFamily::V4);
    assert_same(
        &after.into_iter().filter(|((t, _), _)| t == "nat").collect(),
        &before
            .into_iter()
            .filter(|((t, _), _)| t == "nat")
            .collect(),
        "nat after a refused restore",
    );
    assert!(a.needs_full_sync());
    // Once the other tool lets go, the next (full) sync goes through.
    ns.run(&["iptables", "-t", "nat", "-F", "OTHER-TOOL"])
        .unwrap();
    ns.run(&["iptables", "-t", "nat", "-X", "OTHER-TOOL"])
        .unwrap();
    assert!(a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap().full);
    check_both(&ns, &s, "after recovery");
}

#[test]
fn a_flushed_table_is_noticed_by_the_canary_and_rebuilt() {
    if !privileged("a_flushed_table_is_noticed_by_the_canary_and_rebuilt") {
        return;
    }
    let ns = Netns::new("iptcanary").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1"], false));
    let mut a = Applier::new(IptablesCommand::in_netns(ns.name()));
    let d = s.desired();
    a.sync(&d, &s.config, None).unwrap();
    // A firewalld reload: every table flushed and every user chain deleted.
    for t in ["filter", "nat", "mangle"] {
        ns.run(&["iptables", "-t", t, "-F"]).unwrap();
        ns.run(&["iptables", "-t", t, "-X"]).unwrap();
    }
    let r = a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap();
    assert!(r.full);
    check_both(&ns, &s, "after the flush");
}

#[test]
fn the_legacy_iptables_variant_is_programmed_the_same_way() {
    if !require_tools(
        "the_legacy_iptables_variant_is_programmed_the_same_way",
        &[
            "iptables-legacy-restore",
            "iptables-legacy-save",
            "ip6tables-legacy-restore",
        ],
    ) {
        return;
    }
    let ns = Netns::new("iptlegacy").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2"], true));
    let mut k = IptablesCommand::in_netns(ns.name());
    k.variant = Variant::Legacy;
    let mut a = Applier::new(k);
    let d = s.desired();
    a.sync(&d, &s.config, None).unwrap();
    let r = a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap();
    assert!(!r.full, "the canary is found in the legacy tables too");
    let text = ns.run(&["iptables-legacy-save", "-t", "nat"]).unwrap();
    assert!(text.contains("-A KUBE-NODEPORTS"), "{text}");
    assert!(text.contains("--rcheck --seconds 10800 --reap"), "{text}");
}

/// Every tool `--iptables-variant auto` runs, and the ones the test uses to plant chains.
const VARIANT_TOOLS: [&str; 6] = [
    "iptables-nft",
    "iptables-legacy",
    "iptables-nft-save",
    "ip6tables-nft-save",
    "iptables-legacy-save",
    "ip6tables-legacy-save",
];

#[test]
fn auto_variant_picks_legacy_when_only_the_legacy_tables_hold_the_kubernetes_chains() {
    if !require_tools(
        "auto_variant_picks_legacy_when_only_the_legacy_tables_hold_the_kubernetes_chains",
        &VARIANT_TOOLS,
    ) {
        return;
    }
    let ns = Netns::new("iptvariant").unwrap();
    let prefix = IptablesCommand::in_netns(ns.name()).prefix;
    let detected = || detect_variant(&prefix).variant;
    assert_eq!(detected(), Variant::Nft, "nothing anywhere: nf_tables");
    // kubelet on a legacy node leaves its hint chain in the legacy mangle table.
    ns.run(&[
        "iptables-legacy",
        "-t",
        "mangle",
        "-N",
        "KUBE-IPTABLES-HINT",
    ])
    .unwrap();
    assert_eq!(detected(), Variant::Legacy);
    // iptables-wrappers looks at nf_tables first: chains there win.
    ns.run(&["iptables-nft", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"])
        .unwrap();
    assert_eq!(detected(), Variant::Nft);
}

#[test]
fn a_restarted_proxy_detects_the_legacy_tables_it_programmed_itself() {
    if !require_tools(
        "a_restarted_proxy_detects_the_legacy_tables_it_programmed_itself",
        &[
            &VARIANT_TOOLS[..],
            &["iptables-legacy-restore", "ip6tables-legacy-restore"],
        ]
        .concat(),
    ) {
        return;
    }
    let ns = Netns::new("iptvarself").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1"], false));
    let mut k = IptablesCommand::in_netns(ns.name());
    let prefix = k.prefix.clone();
    k.variant = Variant::Legacy;
    Applier::new(k).sync(&s.desired(), &s.config, None).unwrap();
    // No kubelet here: our own KUBE-PROXY-CANARY in the legacy tables decides.
    assert_eq!(detect_variant(&prefix).variant, Variant::Legacy);
}

#[test]
fn ipvs_ipsets_and_companion_rules_load_into_ipset_and_iptables_restore() {
    if !require_tools(
        "ipvs_ipsets_and_companion_rules_load_into_ipset_and_iptables_restore",
        &["ipset", "iptables-restore"],
    ) {
        return;
    }
    let ns = Netns::new("ipvsload").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2"], true));
    let rendered = nodeport_proxy::ipvs::render(&s.desired(), &s.config);
    for f in &rendered.families {
        let mut sets = String::new();
        for set in f.sets.values() {
            set.write(f.family, &mut sets);
        }
        ns.run_with_stdin(&["ipset", "restore"], sets.as_bytes())
            .unwrap_or_else(|e| panic!("ipset restore ({:?}): {e}\n{sets}", f.family));
        let mut k = IptablesCommand::in_netns(ns.name());
        k.restore(&f.iptables)
            .unwrap_or_else(|e| panic!("companion rules ({:?}): {e}", f.family));
    }
    let listed = ns.run(&["ipset", "list", "KUBE-NODE-PORT-TCP"]).unwrap();
    assert!(listed.contains("Type: bitmap:port"), "{listed}");
    assert!(listed.contains("30080"), "{listed}");
    let listed = ns.run(&["ipset", "list", "KUBE-6-CLUSTER-IP"]).unwrap();
    assert!(listed.contains("fd00:96::10,tcp:80"), "{listed}");
}
