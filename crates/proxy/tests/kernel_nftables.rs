//! The nftables applier against the real kernel, in a throwaway network namespace: every
//! transaction it builds (first sync, partial syncs, take-over, drift repair) must be accepted
//! by `nft` and leave the kernel holding exactly the rendered ruleset. The tests without a
//! layout in their name run kube-proxy's layout; the `flat_` ones the flat layout.

use std::collections::BTreeSet;

use nodeport_proxy::config::{NftablesLayout, NodeConfig};
use nodeport_proxy::desired::{self, DesiredState, NodeView, StateConfig};
use nodeport_proxy::model::ServiceName;
use nodeport_proxy::nftables::apply::{Applier, Kernel, NftCommand};
use nodeport_proxy::nodeaddr::NodeFacts;
use nodeport_proxy::objects::{self, Cluster};
use nodeport_testbed::{Netns, require_privileged};

fn nft_in(ns: &Netns) -> NftCommand {
    NftCommand::in_netns(ns.name())
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
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: other}}
spec: {{type: NodePort, clusterIP: 10.96.0.11, ports: [{{port: 443, nodePort: 30443}}]}}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {{name: kubernetes}}
spec: {{cidrs: [10.96.0.0/16]}}
"#,
        if eps.is_empty() {
            "  []".to_string()
        } else {
            eps.join("\n")
        }
    )
}

/// Asserts two canonical listings are equal, printing only what differs.
#[track_caller]
fn assert_same(got: &[String], want: &[String], what: &str) {
    let extra: Vec<&String> = got.iter().filter(|x| !want.contains(x)).collect();
    let missing: Vec<&String> = want.iter().filter(|x| !got.contains(x)).collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "{what}: kernel has extra {extra:#?}\nand lacks {missing:#?}"
    );
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
            state: StateConfig::default(),
            config: NodeConfig {
                cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
                nftables_layout: NftablesLayout::KubeProxy,
                ..Default::default()
            },
        }
    }

    /// The same in the flat layout.
    fn flat(yaml: &str) -> Self {
        let mut s = Self::new(yaml);
        s.config.nftables_layout = NftablesLayout::Flat;
        s
    }

    fn desired(&self) -> DesiredState {
        desired::build(
            &self.cluster,
            NodeView::named("node-a"),
            &self.facts,
            &self.state,
        )
    }

    /// Replaces the slice of `web` and returns the service ports that changed.
    fn set_endpoints(
        &mut self,
        d: &mut DesiredState,
        endpoints: &[&str],
        affinity: bool,
    ) -> BTreeSet<nodeport_proxy::model::ServicePortName> {
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

/// The kernel's ruleset as nft reports it, canonical: `nft -j` objects without handles,
/// element lists sorted, objects sorted (creation order and hash order are not content).
fn listing(ns: &Netns) -> Vec<String> {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                map.remove("handle");
                for (k, x) in map.iter_mut() {
                    strip(x);
                    if k == "elem"
                        && let serde_json::Value::Array(items) = x
                    {
                        items.sort_by_key(|i| i.to_string());
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let text = ns.run(&["nft", "-j", "list", "ruleset"]).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    strip(&mut json);
    let mut out: Vec<String> = json["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o.get("metainfo").is_none())
        .map(|o| o.to_string())
        .collect();
    out.sort();
    out
}

/// The kernel's rules as nf_tables bytecode (`nft --debug=netlink list ruleset`): one entry
/// per rule, `<family> kube-proxy <chain>` and its expressions, handles dropped, sorted.
/// Equal bytecode is the strict form of "programs exactly what nft would".
fn bytecode(ns: &Netns) -> Vec<String> {
    let text = ns
        .run(&["nft", "--debug=netlink", "list", "ruleset"])
        .unwrap();
    let mut rules = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if line.starts_with("ip kube-proxy ") || line.starts_with("ip6 kube-proxy ") {
            rules.extend(current.take());
            // `ip kube-proxy <chain> <handle>`
            let head: Vec<&str> = line.split_whitespace().take(3).collect();
            current = Some(head.join(" "));
        } else if let Some(rule) = current.as_mut()
            && (line.starts_with("  [") || line.starts_with("  userdata"))
        {
            rule.push('\n');
            rule.push_str(line.trim());
        } else {
            rules.extend(current.take());
        }
    }
    rules.extend(current);
    rules.sort();
    rules
}

/// The bytecode `nft -f` produces for the rendered ruleset in a fresh namespace.
fn reference_bytecode(s: &Setup) -> Vec<String> {
    let fresh = Netns::new("nftrefbc").unwrap();
    let tx = nodeport_proxy::nftables::ruleset::create_all(&nodeport_proxy::nftables::render(
        &s.desired(),
        &s.config,
    ));
    nft_in(&fresh).apply(&tx).expect("rendered ruleset loads");
    let rules = bytecode(&fresh);
    assert!(
        rules.len() > 10,
        "nft --debug=netlink printed rules: {rules:?}"
    );
    rules
}

/// What `nft` prints for the rendered ruleset loaded into a fresh namespace.
fn reference_listing(s: &Setup) -> Vec<String> {
    let fresh = Netns::new("nftref").unwrap();
    let tx = nodeport_proxy::nftables::ruleset::create_all(&nodeport_proxy::nftables::render(
        &s.desired(),
        &s.config,
    ));
    nft_in(&fresh).apply(&tx).expect("rendered ruleset loads");
    listing(&fresh)
}

#[test]
fn every_sync_the_applier_builds_is_accepted_by_the_kernel_and_matches_the_render() {
    if !require_privileged(
        "every_sync_the_applier_builds_is_accepted_by_the_kernel_and_matches_the_render",
    ) {
        return;
    }
    let ns = Netns::new("nftapply").unwrap();
    let mut s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2", "10.244.1.3"], false));
    let mut d = s.desired();
    let mut a = Applier::new(nft_in(&ns));
    let r = a.sync(&d, &s.config, None).expect("first sync");
    assert!(r.full);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after the first sync",
    );

    // Partial: one endpoint gone, session affinity switched on (new sets), then all gone.
    for (eps, affinity) in [
        (vec!["10.244.1.1", "10.244.1.2"], false),
        (vec!["10.244.1.1", "10.244.1.2"], true),
        (vec!["10.244.1.2", "10.244.1.9"], true),
        (vec![], true),
        (vec!["10.244.1.4"], false),
    ] {
        let changed = s.set_endpoints(&mut d, &eps, affinity);
        let r = a.sync(&d, &s.config, Some(&changed)).unwrap_or_else(|e| {
            panic!(
                "partial sync to {eps:?}: {e}: {:?}",
                std::error::Error::source(&e)
            )
        });
        assert!(!r.full);
        assert!(!r.cleanup_failed);
        assert_same(
            &listing(&ns),
            &reference_listing(&s),
            &format!("after partial sync to {eps:?} affinity={affinity}"),
        );
    }
}

#[test]
fn start_up_takes_over_a_kube_proxy_table_and_repairs_drift_without_recreating_it() {
    if !require_privileged(
        "start_up_takes_over_a_kube_proxy_table_and_repairs_drift_without_recreating_it",
    ) {
        return;
    }
    let ns = Netns::new("nfttakeover").unwrap();
    // A table as kube-proxy 1.30 left it (reference 003's layout: older base chains, an
    // inline vmap, a chain for a Service that no longer exists).
    ns.run_with_stdin(
        &["nft", "-f", "-"],
        br#"
table ip kube-proxy {
    comment "rules for kube-proxy"
    set cluster-ips { type ipv4_addr ; elements = { 10.96.0.99 } ; }
    map service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }
    chain firewall-check {
    }
    chain cluster-ips-check {
        ip daddr @cluster-ips reject
    }
    chain filter-prerouting {
        type filter hook prerouting priority dstnat - 10; policy accept;
        ct state new jump firewall-check
    }
    chain filter-output-post-dnat {
        type filter hook output priority -90; policy accept;
        ct state new jump cluster-ips-check
    }
    chain mark-for-masquerade {
        meta mark set meta mark | 0x00004000
    }
    chain endpoint-AAAAAAAA-old/gone/tcp/__10.244.9.9/80 {
        ip saddr 10.244.9.9 jump mark-for-masquerade
        meta l4proto tcp dnat to 10.244.9.9:80
    }
    chain service-AAAAAAAA-old/gone/tcp/ {
        numgen random mod 1 vmap { 0 : goto endpoint-AAAAAAAA-old/gone/tcp/__10.244.9.9/80 }
    }
}
"#,
    )
    .unwrap();
    ns.run_with_stdin(&["nft", "-f", "-"], b"add element ip kube-proxy service-ips { 10.96.0.99 . tcp . 80 : goto service-AAAAAAAA-old/gone/tcp/ }\n").unwrap();
    let table_handle = |ns: &Netns| -> serde_json::Value {
        let text = ns.run(&["nft", "-j", "list", "tables", "ip"]).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        json["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|o| o.get("table").map(|t| t["handle"].clone()))
            .unwrap()
    };
    let handle_before = table_handle(&ns);

    let s = Setup::new(&objects(&["10.244.1.1"], false));
    let d = s.desired();
    let mut a = Applier::new(nft_in(&ns));
    let r = a
        .sync(&d, &s.config, Some(&BTreeSet::new()))
        .expect("take-over sync");
    assert!(r.full);
    assert_eq!(
        r.deleted_chains, 4,
        "old service/endpoint chains and old base chains"
    );
    assert_same(&listing(&ns), &reference_listing(&s), "after take-over");
    assert_eq!(
        table_handle(&ns),
        handle_before,
        "the table was never deleted"
    );

    // Someone deletes a rule by hand; the next full resync puts it back.
    ns.run(&["nft", "flush", "chain", "ip", "kube-proxy", "services"])
        .unwrap();
    assert_ne!(listing(&ns), reference_listing(&s));
    a.request_full_sync();
    a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap();
    assert_same(&listing(&ns), &reference_listing(&s), "after the repair");
}

#[test]
fn a_transaction_the_kernel_refuses_changes_nothing() {
    if !require_privileged("a_transaction_the_kernel_refuses_changes_nothing") {
        return;
    }
    let ns = Netns::new("nftrefuse").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1"], false));
    let mut a = Applier::new(nft_in(&ns));
    a.sync(&s.desired(), &s.config, None).unwrap();
    let before = listing(&ns);
    let mut tx = nodeport_proxy::nftables::ruleset::Transaction::default();
    tx.push(
        nodeport_proxy::model::IpFamily::V4,
        nodeport_proxy::nftables::ruleset::Op::FlushChain("services".into()),
    );
    tx.push(
        nodeport_proxy::model::IpFamily::V4,
        nodeport_proxy::nftables::ruleset::Op::DeleteChain("no-such-chain".into()),
    );
    let err = nft_in(&ns).apply(&tx).unwrap_err();
    assert!(
        err.to_string().contains("No such file or directory"),
        "{err}"
    );
    assert_eq!(
        listing(&ns),
        before,
        "the flush in the failed transaction did not happen"
    );
}

fn netlink_in(ns: &Netns) -> nodeport_proxy::nftables::netlink::NetlinkKernel {
    netlink_with(ns, nft_in(ns))
}

fn netlink_with(
    ns: &Netns,
    fallback: NftCommand,
) -> nodeport_proxy::nftables::netlink::NetlinkKernel {
    nodeport_proxy::nftables::netlink::NetlinkKernel::in_namespace(
        &std::path::Path::new("/run/netns").join(ns.name()),
        fallback,
    )
    .expect("netlink socket in the namespace")
}

/// An `nft` that always fails: proves a transaction went over netlink alone.
fn no_nft() -> NftCommand {
    NftCommand {
        program: "false".into(),
        args: vec![],
    }
}

#[test]
fn netlink_batches_program_exactly_what_nft_would() {
    if !require_privileged("netlink_batches_program_exactly_what_nft_would") {
        return;
    }
    let ns = Netns::new("nftnetlink").unwrap();
    let mut s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2", "10.244.1.3"], true));
    // The firewall chain's anonymous set goes through nft; the rest through netlink. Drop the
    // source ranges here so that this test sees netlink alone.
    let yaml = objects(&["10.244.1.1", "10.244.1.2", "10.244.1.3"], true)
        .replace("  loadBalancerSourceRanges: [203.0.113.0/24]\n", "");
    s.cluster = objects::load(&yaml).unwrap().cluster;
    let mut d = s.desired();
    let mut a = Applier::new(netlink_with(&ns, no_nft()));
    a.sync(&d, &s.config, None)
        .expect("first sync over netlink");
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after the first netlink sync",
    );
    assert_same(
        &bytecode(&ns),
        &reference_bytecode(&s),
        "bytecode after the first netlink sync",
    );
    for (eps, affinity) in [
        (vec!["10.244.1.1"], true),
        (vec!["10.244.1.1", "10.244.1.5"], false),
        (vec![], false),
    ] {
        let changed = s.set_endpoints(&mut d, &eps, affinity);
        a.sync(&d, &s.config, Some(&changed)).unwrap_or_else(|e| {
            panic!(
                "partial netlink sync to {eps:?}: {e}: {:?}",
                std::error::Error::source(&e)
            )
        });
        assert_same(
            &listing(&ns),
            &reference_listing(&s),
            &format!("after partial netlink sync to {eps:?}"),
        );
        assert_same(
            &bytecode(&ns),
            &reference_bytecode(&s),
            &format!("bytecode after partial netlink sync to {eps:?}"),
        );
    }
    // Drift: nothing moved after our own commits; a hand edit moves the generation.
    assert!(!a.drifted());
    ns.run(&["nft", "flush", "chain", "ip", "kube-proxy", "services"])
        .unwrap();
    assert!(a.drifted());
    a.request_full_sync();
    a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap();
    assert!(!a.drifted());
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after repairing the hand edit",
    );

    // A fresh process takes the table over through a netlink listing.
    let mut b = Applier::new(netlink_with(&ns, no_nft()));
    let r = b.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap();
    assert!(r.full);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after a netlink take-over",
    );
}

#[test]
fn netlink_errors_name_the_operation_and_change_nothing() {
    if !require_privileged("netlink_errors_name_the_operation_and_change_nothing") {
        return;
    }
    let ns = Netns::new("nftnlerr").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1"], false));
    let mut k = netlink_in(&ns);
    let mut a = Applier::new(netlink_in(&ns));
    a.sync(&s.desired(), &s.config, None).unwrap();
    let before = listing(&ns);
    use nodeport_proxy::model::IpFamily;
    use nodeport_proxy::nftables::ruleset::{Op, Transaction};
    let mut tx = Transaction::default();
    tx.push(IpFamily::V4, Op::FlushChain("services".into()));
    tx.push(IpFamily::V4, Op::DeleteChain("no-such-chain".into()));
    let err = k.apply(&tx).unwrap_err().to_string();
    assert!(
        err.contains("delete chain ip kube-proxy no-such-chain"),
        "{err}"
    );
    assert_eq!(listing(&ns), before);
}

#[test]
fn a_streamed_netlink_batch_the_kernel_refuses_changes_nothing_and_says_which_message() {
    if !require_privileged(
        "a_streamed_netlink_batch_the_kernel_refuses_changes_nothing_and_says_which_message",
    ) {
        return;
    }
    let ns = Netns::new("nftnlstream").unwrap();
    let s = Setup::new(&objects(&["10.244.1.1"], false));
    let mut k = netlink_in(&ns);
    let mut a = Applier::new(netlink_in(&ns));
    a.sync(&s.desired(), &s.config, None).unwrap();
    let before = listing(&ns);
    use nodeport_proxy::model::IpFamily;
    use nodeport_proxy::nftables::apply::KernelError;
    use nodeport_proxy::nftables::ruleset::{Op, Transaction};
    let mut batch = k.batch();
    for op in [
        Op::FlushChain("services".into()),
        Op::DeleteChain("no-such-chain".into()),
    ] {
        let mut piece = Transaction::default();
        piece.push(IpFamily::V4, op);
        batch.add(piece).unwrap();
    }
    let err = batch.commit().unwrap_err();
    assert!(
        matches!(&err, KernelError::Streamed(m) if m.contains("message 2 of 2") && m.contains("No such file")),
        "{err}"
    );
    assert_eq!(listing(&ns), before, "the streamed flush did not happen");
}

#[test]
fn a_full_sync_the_encoder_cannot_stream_is_applied_whole_through_nft() {
    if !require_privileged("a_full_sync_the_encoder_cannot_stream_is_applied_whole_through_nft") {
        return;
    }
    // kube-proxy's inline `numgen random mod N vmap { ... }` is a form the netlink encoder
    // does not produce: the streamed batch stops there, and the same transaction, built
    // whole, goes through `nft -f`.
    let ns = Netns::new("nftnlwhole").unwrap();
    let mut s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2"], false));
    s.config.endpoint_choice = nodeport_proxy::config::EndpointChoice::InlineVmap;
    let mut a = Applier::new(netlink_in(&ns));
    let r = a.sync(&s.desired(), &s.config, None).unwrap();
    assert!(r.full);
    assert_eq!(a.kernel().fallbacks(), 1);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after a full sync applied whole",
    );
}

#[test]
fn a_ruleset_flushed_by_hand_is_rebuilt_by_the_next_sync_in_one_go() {
    if !require_privileged("a_ruleset_flushed_by_hand_is_rebuilt_by_the_next_sync_in_one_go") {
        return;
    }
    // A firewall reload (`nft flush ruleset`, the first line of Debian's nftables.conf) takes
    // our table with it. The next full sync must rebuild it at once, whether it learned of
    // the drift (netlink: the generation moved) or runs on its own record (the `nft` command,
    // whose periodic syncs are full).
    let s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2"], true));
    let d = s.desired();

    let ns = Netns::new("nftreload").unwrap();
    let mut a = Applier::new(netlink_in(&ns));
    a.sync(&d, &s.config, None).unwrap();
    a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap();
    ns.run(&["nft", "flush", "ruleset"]).unwrap();
    let r = a
        .sync(&d, &s.config, Some(&BTreeSet::new()))
        .expect("the sync after the reload repairs it");
    assert!(r.full);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "netlink, after the reload",
    );

    let ns = Netns::new("nftreloadcmd").unwrap();
    let mut a = Applier::new(nft_in(&ns));
    a.sync(&d, &s.config, None).unwrap();
    ns.run(&["nft", "delete", "table", "ip", "kube-proxy"])
        .unwrap();
    a.request_full_sync();
    a.sync(&d, &s.config, Some(&BTreeSet::new()))
        .expect("the periodic full sync repairs it");
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "nft, after the reload",
    );
}

#[test]
fn take_over_recreates_a_shared_set_an_older_version_made_with_other_flags() {
    if !require_privileged(
        "take_over_recreates_a_shared_set_an_older_version_made_with_other_flags",
    ) {
        return;
    }
    let s = Setup::new(&objects(&["10.244.1.1"], false));
    let ns = Netns::new("nftsetflags").unwrap();
    ns.run(&["nft", "add", "table", "ip", "kube-proxy"])
        .unwrap();
    ns.run(&[
        "nft",
        "add set ip kube-proxy cluster-ips { type ipv4_addr; flags interval; }",
    ])
    .unwrap();
    let mut a = Applier::new(netlink_in(&ns));
    a.sync(&s.desired(), &s.config, None)
        .expect("the first sync re-creates the set with our definition");
    assert_same(&listing(&ns), &reference_listing(&s), "after the take-over");
}

#[test]
fn netlink_encodes_the_localnet_guard_exactly_as_nft_does() {
    if !require_privileged("netlink_encodes_the_localnet_guard_exactly_as_nft_does") {
        return;
    }
    let ns = Netns::new("nftlocalnet").unwrap();
    let yaml = objects(&["10.244.1.1"], false)
        .replace("  loadBalancerSourceRanges: [203.0.113.0/24]\n", "");
    let mut s = Setup::new(&yaml);
    s.facts.local_ips.push("127.0.0.1".parse().unwrap());
    s.state.nodeport_addresses = "127.0.0.0/8,192.0.2.0/24".parse().unwrap();
    let d = s.desired();
    let mut a = Applier::new(netlink_with(&ns, no_nft()));
    a.sync(&d, &s.config, None)
        .expect("localhost NodePorts over netlink alone");
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "the localnet guard over netlink",
    );
    assert_same(
        &bytecode(&ns),
        &reference_bytecode(&s),
        "the bytecode of the localnet guard over netlink",
    );
    // And nft reads the ct matches back as the render writes them.
    let chain = ns
        .run(&["nft", "list", "chain", "ip", "kube-proxy", "localnet-check"])
        .unwrap();
    for rule in [
        "ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state invalid,untracked drop comment \"block incoming localnet connections\"",
        "ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state ! established,related ct status ! dnat drop comment \"block incoming localnet connections\"",
    ] {
        assert!(
            chain.lines().any(|l| l.trim() == rule),
            "missing {rule:?} in:\n{chain}"
        );
    }
}

// ---- the flat layout ----

/// Partial syncs of the flat layout the tests below go through: endpoints removed, added,
/// all gone, session affinity on and off, policies changed.
fn flat_changes() -> Vec<(Vec<&'static str>, bool)> {
    vec![
        (vec!["10.244.1.1", "10.244.1.2"], false),
        (vec!["10.244.1.1", "10.244.1.2"], true),
        (vec!["10.244.1.2", "10.244.1.9"], true),
        (vec![], true),
        (vec!["10.244.1.4"], false),
        (vec![], false),
        (
            vec!["10.244.1.4", "10.244.1.5", "10.244.1.6", "10.244.1.7"],
            false,
        ),
    ]
}

#[test]
fn flat_every_sync_the_applier_builds_is_accepted_by_the_kernel_and_matches_the_render() {
    if !require_privileged(
        "flat_every_sync_the_applier_builds_is_accepted_by_the_kernel_and_matches_the_render",
    ) {
        return;
    }
    let ns = Netns::new("nftflat").unwrap();
    let mut s = Setup::flat(&objects(&["10.244.1.1", "10.244.1.2", "10.244.1.3"], false));
    let mut d = s.desired();
    let mut a = Applier::new(nft_in(&ns));
    assert!(a.sync(&d, &s.config, None).expect("first sync").full);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after the first sync",
    );
    for (eps, affinity) in flat_changes() {
        let changed = s.set_endpoints(&mut d, &eps, affinity);
        let r = a.sync(&d, &s.config, Some(&changed)).unwrap_or_else(|e| {
            panic!(
                "partial sync to {eps:?}: {e}: {:?}",
                std::error::Error::source(&e)
            )
        });
        assert!(!r.full);
        assert_same(
            &listing(&ns),
            &reference_listing(&s),
            &format!("after partial sync to {eps:?} affinity={affinity}"),
        );
    }
}

#[test]
fn flat_netlink_batches_program_exactly_what_nft_would_in_both_families() {
    if !require_privileged("flat_netlink_batches_program_exactly_what_nft_would_in_both_families") {
        return;
    }
    let ns = Netns::new("nftflatnl").unwrap();
    // Dual stack: an IPv6 ClusterIP and endpoints beside the IPv4 ones.
    let dual = |eps4: &[&str], eps6: &[&str], affinity: bool| {
        let eps6: Vec<String> = eps6
            .iter()
            .map(|ip| format!("- {{addresses: [\"{ip}\"], nodeName: node-a}}"))
            .collect();
        objects(eps4, affinity).replace(
            "  clusterIP: 10.96.0.10\n",
            "  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ipFamilyPolicy: PreferDualStack\n",
        ) + &format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-6, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv6\nports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]\nendpoints:\n{}\n",
            if eps6.is_empty() { "  []".to_string() } else { eps6.join("\n") }
        )
    };
    let mut s = Setup::flat(&dual(
        &["10.244.1.1", "10.244.1.2", "10.244.1.3"],
        &["fd00:244::1", "fd00:244::2"],
        false,
    ));
    let mut d = s.desired();
    assert!(
        d.family(nodeport_proxy::model::IpFamily::V6)
            .is_some_and(|f| !f.services.is_empty()),
        "the fixture is dual-stack"
    );
    let mut a = Applier::new(netlink_with(&ns, no_nft()));
    a.sync(&d, &s.config, None)
        .expect("first sync over netlink alone");
    assert_eq!(a.kernel().fallbacks(), 0);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after the first netlink sync",
    );
    assert_same(
        &bytecode(&ns),
        &reference_bytecode(&s),
        "bytecode after the first sync",
    );
    let v6 = [
        vec!["fd00:244::1"],
        vec!["fd00:244::1", "fd00:244::3"],
        vec![],
        vec!["fd00:244::4"],
    ];
    for (i, (eps, affinity)) in flat_changes().into_iter().enumerate() {
        let eps6 = &v6[i % v6.len()];
        let fresh = objects::load(&dual(&eps, eps6, affinity)).unwrap().cluster;
        for key in [
            ServiceName::new("default", "web-1"),
            ServiceName::new("default", "web-6"),
        ] {
            s.cluster
                .update_slice(key.clone(), fresh.slices.get(&key).cloned());
        }
        let svc = ServiceName::new("default", "web");
        s.cluster
            .update_service(svc.clone(), fresh.services.get(&svc).cloned());
        let changes = s.cluster.take_changes();
        let changed = d.refresh_services(&s.cluster, NodeView::named("node-a"), &changes.services);
        a.sync(&d, &s.config, Some(&changed)).unwrap_or_else(|e| {
            panic!(
                "partial netlink sync to {eps:?} {eps6:?}: {e}: {:?}",
                std::error::Error::source(&e)
            )
        });
        assert_same(
            &listing(&ns),
            &reference_listing(&s),
            &format!("after partial netlink sync to {eps:?} {eps6:?} affinity={affinity}"),
        );
    }
    assert_same(
        &bytecode(&ns),
        &reference_bytecode(&s),
        "bytecode after the partial syncs",
    );
    assert_eq!(a.kernel().fallbacks(), 0, "nothing went through nft");
    // A fresh process takes the table over through a netlink listing.
    let mut b = Applier::new(netlink_with(&ns, no_nft()));
    assert!(b.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap().full);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "after a netlink take-over",
    );
}

#[test]
fn switching_layout_on_a_running_node_takes_over_in_place_both_ways() {
    if !require_privileged("switching_layout_on_a_running_node_takes_over_in_place_both_ways") {
        return;
    }
    let ns = Netns::new("nftswitch").unwrap();
    let mut s = Setup::new(&objects(&["10.244.1.1", "10.244.1.2"], true));
    let d = s.desired();
    for layout in [
        NftablesLayout::KubeProxy,
        NftablesLayout::Flat,
        NftablesLayout::KubeProxy,
    ] {
        s.config.nftables_layout = layout;
        // A new process (restart with the other --nftables-layout) on the same kernel.
        let mut a = Applier::new(netlink_with(&ns, nft_in(&ns)));
        let r = a
            .sync(&d, &s.config, Some(&BTreeSet::new()))
            .unwrap_or_else(|e| panic!("{layout:?}: {e}: {:?}", std::error::Error::source(&e)));
        assert!(r.full);
        assert!(
            !r.cleanup_failed,
            "{layout:?}: the old layout's chains are deleted"
        );
        assert_same(
            &listing(&ns),
            &reference_listing(&s),
            &format!("as {layout:?}"),
        );
    }
}

#[test]
fn flat_a_set_at_its_size_refuses_the_sync_names_the_set_and_keeps_the_old_rules() {
    if !require_privileged(
        "flat_a_set_at_its_size_refuses_the_sync_names_the_set_and_keeps_the_old_rules",
    ) {
        return;
    }
    let ns = Netns::new("nftflatfull").unwrap();
    let mut s = Setup::flat(&objects(&["10.244.1.1"], false));
    s.config.flat_max_set_size = 64;
    let mut d = s.desired();
    let mut a = Applier::new(netlink_in(&ns));
    a.sync(&d, &s.config, None).expect("fits");
    let before = listing(&ns);
    assert!(
        ns.run(&[
            "nft",
            "list",
            "map",
            "ip",
            "kube-proxy",
            "service-endpoints"
        ])
        .unwrap()
        .contains("size 64"),
        "sized as configured"
    );
    let many: Vec<String> = (1..=40).map(|i| format!("10.244.2.{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let changed = s.set_endpoints(&mut d, &many, false);
    let err = a.sync(&d, &s.config, Some(&changed)).unwrap_err();
    let source = std::error::Error::source(&err).expect("the kernel's error");
    assert!(
        matches!(
            source.downcast_ref::<nodeport_proxy::nftables::apply::KernelError>(),
            Some(nodeport_proxy::nftables::apply::KernelError::SetFull { set, .. })
                if set.ends_with("-endpoints")
        ),
        "{source}"
    );
    assert_eq!(listing(&ns), before, "the previous rules serve on");
    assert!(a.needs_full_sync(), "retried as a full sync");
}

#[test]
fn flat_sets_grow_by_recreation_in_one_transaction_when_services_outgrow_their_size() {
    if !require_privileged(
        "flat_sets_grow_by_recreation_in_one_transaction_when_services_outgrow_their_size",
    ) {
        return;
    }
    let ns = Netns::new("nftflatgrow").unwrap();
    let mut s = Setup::flat(&objects(&["10.244.1.1"], false));
    let mut d = s.desired();
    let mut a = Applier::new(netlink_with(&ns, no_nft()));
    a.sync(&d, &s.config, None).unwrap();
    let many: Vec<String> = (1..=100).map(|i| format!("10.244.2.{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let size = |ns: &Netns| {
        // Terse: the definition without its elements.
        let text = ns
            .run(&[
                "nft",
                "-t",
                "list",
                "map",
                "ip",
                "kube-proxy",
                "service-endpoints",
            ])
            .unwrap();
        text.split("size ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_string)
    };
    assert_eq!(size(&ns).as_deref(), Some("4096"));
    // 100 endpoints: 12,800 slots for each of 4 destinations (ClusterIP and load-balancer IP
    // of two ports), twice that rounded up.
    let changed = s.set_endpoints(&mut d, &many, false);
    let r = a.sync(&d, &s.config, Some(&changed)).unwrap();
    assert!(r.full, "a size change re-creates the sets in a full sync");
    assert_eq!(size(&ns).as_deref(), Some("131072"));
    let changed = s.set_endpoints(&mut d, &["10.244.1.1"], false);
    assert!(a.sync(&d, &s.config, Some(&changed)).unwrap().full);
    assert_same(
        &listing(&ns),
        &reference_listing(&s),
        "back to one endpoint",
    );
}

#[test]
fn flat_a_periodic_full_resync_over_netlink_rewrites_the_loaded_table_in_place() {
    if !require_privileged(
        "flat_a_periodic_full_resync_over_netlink_rewrites_the_loaded_table_in_place",
    ) {
        return;
    }
    let ns = Netns::new("nftflatresync").unwrap();
    let s = Setup::flat(&objects(&["10.244.1.1", "10.244.1.2"], false));
    let d = s.desired();
    let mut a = Applier::new(netlink_with(&ns, no_nft()));
    a.sync(&d, &s.config, None).unwrap();
    ns.run(&[
        "nft",
        "flush",
        "map",
        "ip",
        "kube-proxy",
        "nodeport-endpoints",
    ])
    .unwrap();
    a.request_full_sync();
    assert!(a.sync(&d, &s.config, Some(&BTreeSet::new())).unwrap().full);
    assert_eq!(a.kernel().fallbacks(), 0);
    assert_same(&listing(&ns), &reference_listing(&s), "after the resync");
}

/// A node with two ServiceCIDRs of a family (KEP-1880: an operator grew the ClusterIP space
/// with a second ServiceCIDR). The flat layout drops each with a rule of its own, which the
/// netlink encoder encodes, so its full syncs never fall back to `nft -f`; and a full resync
/// through `nft -f` over a loaded table works too: the endpoint maps are re-created, since nft
/// 1.0.6 refuses a pick rule on such a map when it reads the map from the kernel ("conflicting
/// protocols specified: ip vs. th"), which once made every full sync of such a node fail.
#[test]
fn flat_full_resyncs_with_two_service_cidrs_go_over_netlink_and_work_through_nft_too() {
    if !require_privileged(
        "flat_full_resyncs_with_two_service_cidrs_go_over_netlink_and_work_through_nft_too",
    ) {
        return;
    }
    let cidrs = "---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: more}\nspec: {cidrs: [10.97.0.0/24]}\n";
    let s = Setup::flat(&(objects(&["10.244.1.1", "10.244.1.2"], false) + cidrs));
    let d = s.desired();
    assert_eq!(
        d.family(nodeport_proxy::model::IpFamily::V4)
            .map(|f| f.service_cidrs.len()),
        Some(2),
        "the fixture has two IPv4 ServiceCIDRs"
    );

    let ns = Netns::new("nftcidrsnl").unwrap();
    let mut a = Applier::new(netlink_with(&ns, no_nft()));
    for round in ["first sync", "full resync"] {
        a.request_full_sync();
        let r = a.sync(&d, &s.config, None).unwrap_or_else(|e| {
            panic!(
                "{round} over netlink: {e}: {:?}",
                std::error::Error::source(&e)
            )
        });
        assert!(r.full, "{round}");
        assert_eq!(
            a.kernel().fallbacks(),
            0,
            "{round}: nothing went through nft"
        );
        assert_same(&listing(&ns), &reference_listing(&s), round);
    }

    let ns = Netns::new("nftcidrsnft").unwrap();
    let mut a = Applier::new(nft_in(&ns));
    for round in ["first sync", "full resync"] {
        a.request_full_sync();
        let r = a.sync(&d, &s.config, None).unwrap_or_else(|e| {
            panic!(
                "{round} through nft: {e}: {:?}",
                std::error::Error::source(&e)
            )
        });
        assert!(r.full, "{round}");
        assert_same(&listing(&ns), &reference_listing(&s), round);
    }
}
