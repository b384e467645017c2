//! `nodeport trace -f`: every fate in every traced mode (nftables flat and
//! kube-proxy layouts, iptables, ebpf) against golden outputs in `testdata/trace/`, the JSON
//! form, exit codes (0 reaches an endpoint, 1 does not, 3 cannot trace, 64 bad usage).
//!
//! The goldens are the command lines and their full output; `NODEPORT_BLESS=1` rewrites them
//! from the current binary (review the diff before committing).

use std::path::{Path, PathBuf};
use std::process::Command;

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/testdata/trace")
}

/// Runs `nodeport trace` in the testdata folder: (stdout, stderr, exit code).
fn trace(args: &[&str]) -> (String, String, i32) {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .arg("trace")
        .args(args)
        .current_dir(testdata())
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code().expect("exited"),
    )
}

/// Every fate the fixture's Services give, as `--from`, `--to` and extra flags.
const CASES: &[(&str, &str, &[&str])] = &[
    // NodePort, externalTrafficPolicy Cluster: DNAT to one of two endpoints, masqueraded.
    ("203.0.113.5", "192.0.2.11:30569/tcp", &[]),
    // No endpoints: rejected.
    ("203.0.113.5", "192.0.2.11:30570/tcp", &[]),
    // externalTrafficPolicy Local without a local endpoint: dropped.
    ("203.0.113.5", "192.0.2.11:30571/tcp", &[]),
    // loadBalancerSourceRanges: outside dropped, inside translated.
    ("198.51.100.7", "198.51.100.200:443/tcp", &[]),
    ("203.0.113.5", "198.51.100.200:443/tcp", &[]),
    // A NodePort on an address --nodeport-addresses primary leaves out.
    ("203.0.113.5", "198.51.100.11:30569/tcp", &[]),
    // Not a Service at all.
    ("203.0.113.5", "192.0.2.11:22/tcp", &[]),
    // ClusterIP from a pod, from the node itself (output path), and under --masquerade-all.
    ("10.244.2.3", "10.96.0.10:80/tcp", &[]),
    ("192.0.2.11", "10.96.0.10:80/tcp", &[]),
    ("10.244.2.3", "10.96.0.10:80/tcp", &["--masquerade-all"]),
    // IPv6.
    ("2001:db8::99", "[2001:db8::11]:30569/tcp", &[]),
    // externalTrafficPolicy Local with a local endpoint: the client's address is kept; from
    // the node itself, every endpoint, masqueraded.
    ("203.0.113.5", "192.0.2.11:30573/tcp", &[]),
    ("192.0.2.11", "192.0.2.11:30573/tcp", &[]),
    // internalTrafficPolicy Local without a local endpoint: dropped.
    ("10.244.2.3", "10.96.0.15:80/tcp", &[]),
    // Three endpoints, one in three each.
    ("203.0.113.5", "192.0.2.11:30574/tcp", &[]),
    // No endpoints, from the node itself: out untranslated, then rejected on its way back in
    // through loopback (filter INPUT; the ebpf mode refuses it at connect()).
    ("192.0.2.11", "192.0.2.11:30570/tcp", &[]),
];

/// The golden text of one mode: each command line, its output and exit code.
fn run_mode(mode: &[&str], extra_cases: &[(&str, &str, &[&str])]) -> String {
    let mut text = String::new();
    for (from, to, extra) in CASES.iter().chain(extra_cases) {
        let mut args = vec!["-f", "objects.yaml"];
        args.extend_from_slice(mode);
        args.extend_from_slice(&[
            "--cluster-cidr",
            "10.244.0.0/16,fd00:244::/48",
            "--nodeport-addresses",
            "primary",
        ]);
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--from", from, "--to", to]);
        let (stdout, stderr, code) = trace(&args);
        assert!(
            stderr.is_empty(),
            "{args:?}: nothing on standard error, got {stderr}"
        );
        text.push_str(&format!(
            "$ nodeport trace {}\n{stdout}exit {code}\n\n",
            args.join(" ")
        ));
    }
    text
}

fn check_golden(name: &str, got: &str) {
    let path = testdata().join(name);
    if std::env::var_os("NODEPORT_BLESS").is_some() {
        std::fs::write(&path, got).unwrap();
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (NODEPORT_BLESS=1 writes it)", path.display()));
    assert_eq!(
        got,
        want,
        "{} differs from the output; got:\n{got}",
        path.display()
    );
}

/// The exit codes a golden text records, in order.
fn exit_codes(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.strip_prefix("exit "))
        .collect()
}

/// What every mode must agree on: reaches (0) or not (1), case by case.
const EXPECTED_EXITS: &[&str] = &[
    "0", "1", "1", "1", "0", "1", "1", "0", "0", "0", "0", "0", "0", "1", "0", "1",
];

#[test]
fn the_flat_nftables_layout_traces_every_fate_as_its_golden_output() {
    let text = run_mode(&["--proxy-mode", "nftables"], &[]);
    assert_eq!(exit_codes(&text), EXPECTED_EXITS);
    check_golden("nftables-flat.txt", &text);
}

#[test]
fn the_kube_proxy_nftables_layout_traces_every_fate_as_its_golden_output() {
    let text = run_mode(
        &[
            "--proxy-mode",
            "nftables",
            "--nftables-layout",
            "kube-proxy",
        ],
        &[],
    );
    assert_eq!(exit_codes(&text), EXPECTED_EXITS);
    check_golden("nftables-kube-proxy.txt", &text);
}

#[test]
fn the_iptables_mode_traces_every_fate_as_its_golden_output() {
    let text = run_mode(&["--proxy-mode", "iptables"], &[]);
    assert_eq!(exit_codes(&text), EXPECTED_EXITS);
    check_golden("iptables.txt", &text);
}

#[test]
fn the_ebpf_mode_traces_every_fate_as_its_golden_output_with_maglev_shares() {
    let maglev: &[(&str, &str, &[&str])] = &[(
        "203.0.113.5",
        "192.0.2.11:30569/tcp",
        &["--ebpf-lb-algorithm", "maglev"],
    )];
    let text = run_mode(&["--proxy-mode", "ebpf"], maglev);
    let mut want = EXPECTED_EXITS.to_vec();
    want.push("0");
    assert_eq!(exit_codes(&text), want);
    assert!(text.contains("of the Maglev table"), "{text}");
    check_golden("ebpf.txt", &text);
}

#[test]
fn every_mode_names_the_same_service_endpoints_and_fate_for_the_same_packet() {
    // The lines that do not depend on the dataplane's words: the Service, each endpoint and
    // its probability, and the fate's first words.
    let summary = |mode: &[&str]| -> Vec<String> {
        run_mode(mode, &[])
            .lines()
            .filter(|l| {
                l.starts_with("service") || l.starts_with("endpoint") || l.starts_with("fate")
            })
            .map(str::to_string)
            .collect()
    };
    let flat = summary(&["--proxy-mode", "nftables"]);
    assert!(!flat.is_empty());
    for mode in [
        &[
            "--proxy-mode",
            "nftables",
            "--nftables-layout",
            "kube-proxy",
        ][..],
        &["--proxy-mode", "iptables"][..],
        &["--proxy-mode", "ebpf"][..],
    ] {
        assert_eq!(summary(mode), flat, "{mode:?}");
    }
}

#[test]
fn json_output_follows_the_documented_schema() {
    let (stdout, _, code) = trace(&[
        "-f",
        "objects.yaml",
        "--cluster-cidr",
        "10.244.0.0/16",
        "--from",
        "203.0.113.5",
        "--to",
        "192.0.2.11:30569/tcp",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0);
    check_golden("nodeport.json", &stdout);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["source"], "file");
    assert_eq!(v["mode"], "nftables");
    assert_eq!(v["nftables_layout"], "flat");
    assert_eq!(v["packet"]["to"], "192.0.2.11:30569");
    assert_eq!(v["packet"]["path"], "input");
    assert_eq!(v["service"]["port"], "default/web:80/TCP");
    assert_eq!(v["service"]["frontend"], "NodePort");
    assert_eq!(v["endpoints"].as_array().unwrap().len(), 2);
    assert_eq!(v["outcomes"][0]["verdict"], "dnat");
    assert_eq!(v["outcomes"][0]["reason"], "endpoint");
    // The path: each rule that matched (its chain, its place, its verdict, the elements it
    // matched, the Service port it is for), each chain's end, each base chain's policy, and
    // the random choice once, each candidate with its share and its own steps.
    let path = v["path"].as_array().unwrap();
    assert_eq!(path[0]["family"], "ip");
    assert_eq!(path[0]["table"], "kube-proxy");
    assert_eq!(path[0]["chain"], "filter-prerouting-pre-dnat");
    assert_eq!(path[0]["rule_index"], 1);
    assert_eq!(path[0]["kind"], "rule");
    assert_eq!(path[0]["verdict"], "jump firewall-check");
    assert!(path.iter().any(|s| s["kind"] == "policy"), "{stdout}");
    let lookup = path
        .iter()
        .find(|s| s["chain"] == "services" && s["kind"] == "rule")
        .unwrap();
    assert_eq!(lookup["service"], "default/web:80/TCP");
    assert_eq!(
        lookup["elements"][1],
        "@masquerade-nodeports { tcp . 30569 comment \"default/web:http\" }"
    );
    let choices: Vec<&serde_json::Value> = path.iter().filter(|s| s["kind"] == "choice").collect();
    assert_eq!(choices.len(), 1, "{stdout}");
    let candidates = choices[0]["candidates"].as_array().unwrap();
    let to: Vec<&serde_json::Value> = candidates.iter().map(|c| &c["endpoint"]).collect();
    let endpoints: Vec<&serde_json::Value> = v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["endpoint"])
        .collect();
    assert_eq!(to, endpoints);
    for c in candidates {
        assert_eq!(c["probability"], 0.5);
        assert_eq!(c["verdict"], "dnat");
        assert_eq!(c["path"][0]["verdict"], "accept");
    }

    let (stdout, _, code) = trace(&[
        "-f",
        "objects.yaml",
        "--from",
        "203.0.113.5",
        "--to",
        "192.0.2.11:30570/tcp",
        "-o",
        "json",
    ]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["outcomes"][0]["verdict"], "reject");
    assert_eq!(v["outcomes"][0]["reason"], "no_endpoints");
    assert_eq!(v["outcomes"][0]["at"], "nodeport-endpoints-check");
}

#[test]
fn bad_usage_exits_64_naming_the_flag_and_an_untraceable_packet_exits_3() {
    for (args, flag) in [
        (vec!["--from", "203.0.113.5", "--to", "192.0.2.11"], "--to"),
        (
            vec!["--from", "203.0.113.5", "--to", "192.0.2.11:80/icmp"],
            "--to",
        ),
        (
            vec!["--from", "2001:db8::1", "--to", "192.0.2.11:80/tcp"],
            "--from",
        ),
        (vec!["--from", "x", "--to", "192.0.2.11:80/tcp"], "--from"),
        (
            vec![
                "--from",
                "203.0.113.5",
                "--to",
                "192.0.2.11:80",
                "-o",
                "yaml",
            ],
            "--output",
        ),
        (
            vec![
                "--from",
                "203.0.113.5",
                "--to",
                "192.0.2.11:80",
                "--proxy-mode",
                "userspace",
            ],
            "--proxy-mode",
        ),
    ] {
        let mut all = vec!["-f", "objects.yaml"];
        all.extend(args);
        let (_, stderr, code) = trace(&all);
        assert_eq!(code, 64, "{all:?}: {stderr}");
        assert!(stderr.contains(flag), "{all:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
    for (args, why) in [
        (
            vec![
                "-f",
                "missing.yaml",
                "--from",
                "203.0.113.5",
                "--to",
                "192.0.2.11:80",
            ],
            "missing.yaml",
        ),
        (
            vec![
                "-f",
                "objects.yaml",
                "--proxy-mode",
                "ipvs",
                "--from",
                "203.0.113.5",
                "--to",
                "192.0.2.11:80",
            ],
            "ipvs",
        ),
    ] {
        let (_, stderr, code) = trace(&args);
        assert_eq!(code, 3, "{args:?}: {stderr}");
        assert!(stderr.contains(why), "{args:?}: {stderr}");
    }
}

#[test]
fn node_name_picks_that_nodes_addresses_from_a_file_of_several_nodes() {
    // What `kubectl get svc,endpointslices,nodes -o yaml` of a cluster gives: every Node.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.yaml");
    let objects = std::fs::read_to_string(testdata().join("objects.yaml")).unwrap();
    std::fs::write(
        &file,
        format!(
            "{objects}---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-b}}\n\
             status: {{addresses: [{{type: InternalIP, address: 192.0.2.12}}]}}\n"
        ),
    )
    .unwrap();
    let file = file.to_str().unwrap();
    for (node, to, local) in [
        (
            "node-a",
            "192.0.2.11:30569/tcp",
            "10.244.1.5:8080  50.00%  on this node",
        ),
        (
            "node-b",
            "192.0.2.12:30569/tcp",
            "10.244.2.7:8080  50.00%  on this node",
        ),
    ] {
        let (stdout, stderr, code) = trace(&[
            "-f",
            file,
            "--node-name",
            node,
            "--from",
            "203.0.113.5",
            "--to",
            to,
        ]);
        assert_eq!(code, 0, "{node}: {stdout}{stderr}");
        assert!(stdout.contains(local), "{node}: {stdout}");
    }
}

#[test]
fn service_lists_every_address_the_node_serves_it_on_with_its_fate_in_every_mode() {
    for (mode, golden) in [
        (
            &["--proxy-mode", "nftables"][..],
            "service-nftables-flat.txt",
        ),
        (
            &[
                "--proxy-mode",
                "nftables",
                "--nftables-layout",
                "kube-proxy",
            ][..],
            "service-nftables-kube-proxy.txt",
        ),
        (&["--proxy-mode", "iptables"][..], "service-iptables.txt"),
        (&["--proxy-mode", "ebpf"][..], "service-ebpf.txt"),
    ] {
        let mut text = String::new();
        for (service, extra, want) in [
            // Every address answers (the one --nodeport-addresses leaves out is shown, not
            // counted).
            ("default/web", &[][..], 0),
            // The load-balancer IP drops this client: exit 1.
            ("default/lb", &["--from", "198.51.100.7"][..], 1),
            ("default/empty", &[][..], 1),
        ] {
            let mut args = vec!["-f", "objects.yaml"];
            args.extend_from_slice(mode);
            args.extend_from_slice(&[
                "--cluster-cidr",
                "10.244.0.0/16,fd00:244::/48",
                "--nodeport-addresses",
                "primary",
                "--service",
                service,
            ]);
            args.extend_from_slice(extra);
            let (stdout, stderr, code) = trace(&args);
            assert_eq!(code, want, "{args:?}: {stdout}{stderr}");
            text.push_str(&format!(
                "$ nodeport trace {}\n{stdout}exit {code}\n\n",
                args.join(" ")
            ));
        }
        check_golden(golden, &text);
    }
}

#[test]
fn service_json_holds_one_trace_per_address_and_an_unknown_service_exits_3() {
    let (stdout, _, code) = trace(&[
        "-f",
        "objects.yaml",
        "--service",
        "default/web",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["service"], "default/web");
    let traces = v["traces"].as_array().unwrap();
    let to: Vec<&str> = traces
        .iter()
        .map(|t| t["packet"]["to"].as_str().unwrap())
        .collect();
    assert_eq!(
        to,
        [
            "10.96.0.10:80",
            "192.0.2.11:30569",
            "198.51.100.11:30569",
            "[fd00:96::10]:80",
            "[2001:db8::11]:30569"
        ]
    );
    assert_eq!(traces[2]["outcomes"][0]["reason"], "not_node_port_address");

    let (_, stderr, code) = trace(&["-f", "objects.yaml", "--service", "default/nope"]);
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("no Service default/nope"), "{stderr}");
}

/// A dump of a whole cluster's Nodes (the README's `kubectl get svc,endpointslices,nodes`)
/// names no node to trace on: unless this host is one of them, `--node-name` must say which
/// (a black-box review found the last Node picked silently).
#[test]
fn several_nodes_and_no_node_name_is_a_usage_error_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("nodes.yaml");
    let node = |name: &str, ip: &str| {
        format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}}}\nstatus: {{addresses: [{{type: InternalIP, address: {ip}}}]}}\n"
        )
    };
    std::fs::write(
        &file,
        format!(
            "{}---\n{}---\n{}",
            node("rv-a", "192.0.2.11"),
            node("rv-b", "192.0.2.12"),
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{port: 80, nodePort: 30080}]}\n"
        ),
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let to = ["--from", "203.0.113.5", "--to", "192.0.2.12:30080/tcp"];
    let (_, stderr, code) = trace(&[&["-f", f][..], &to[..]].concat());
    assert_eq!(code, 64, "{stderr}");
    assert!(
        stderr.contains("holds 2 Nodes (rv-a, rv-b), none named as this host")
            && stderr.contains("give --node-name"),
        "{stderr}"
    );
    let (out, _, _) = trace(&[&["-f", f, "--node-name", "rv-b"][..], &to[..]].concat());
    assert!(
        out.contains("service     default/web:80/TCP: NodePort 192.0.2.12:30080"),
        "{out}"
    );
}

/// A client outside `loadBalancerSourceRanges` of a Service without endpoints: kube-proxy's
/// nftables mode drops it in `firewall-check` before anything looks at the endpoints, its
/// iptables mode writes no firewall rule for such a Service and rejects every client (as
/// the eBPF tc program does). The fate names the rule that decided (the nftables fate once
/// said "has no endpoints" beside a path that ended in firewall-check).
#[test]
fn an_out_of_range_client_of_a_service_without_endpoints_is_told_what_decided_in_each_mode() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lb.yaml");
    std::fs::write(
        &file,
        "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: default}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.20, loadBalancerSourceRanges: [192.0.2.100/32], ports: [{port: 80, targetPort: 8080, nodePort: 30085}]}\nstatus: {loadBalancer: {ingress: [{ip: 192.0.2.200}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: lb-1, namespace: default, labels: {kubernetes.io/service-name: lb}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: []\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let dropped = "fate        drop: 192.0.2.101 is not in loadBalancerSourceRanges 192.0.2.100/32 of default/lb:80/TCP";
    let rejected = "fate        reject: default/lb:80/TCP has no endpoints";
    for (mode, out_of_range) in [
        (&["--proxy-mode", "nftables"][..], dropped),
        (
            &[
                "--proxy-mode",
                "nftables",
                "--nftables-layout",
                "kube-proxy",
            ][..],
            dropped,
        ),
        (&["--proxy-mode", "iptables"][..], rejected),
        (&["--proxy-mode", "ebpf"][..], rejected),
    ] {
        let base = [
            "-f",
            f,
            "--node-name",
            "node-a",
            "--node-ip",
            "192.0.2.10",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--to",
            "192.0.2.200:80/tcp",
            "--from",
        ];
        let (out, _, code) = trace(&[&base[..], &["192.0.2.101"], mode].concat());
        assert_eq!(code, 1, "{mode:?}: {out}");
        assert!(out.contains(out_of_range), "{mode:?}: {out}");
        let (out, _, code) = trace(&[&base[..], &["192.0.2.100"], mode].concat());
        assert_eq!(code, 1, "{mode:?}: {out}");
        assert!(out.contains(rejected), "{mode:?}: {out}");
    }
}

/// A kubeconfig that cannot be read is said once, with its path as given (kube's own error
/// repeated its cause and quoted the path twice).
#[test]
fn an_unreadable_kubeconfig_is_named_once_and_exits_3() {
    let (_, stderr, code) = trace(&[
        "--kubeconfig",
        "/nonexistent/kubeconfig",
        "--rules",
        "render",
        "--from",
        "203.0.113.5",
        "--to",
        "192.0.2.11:80/tcp",
    ]);
    assert_eq!(code, 3, "{stderr}");
    assert_eq!(
        stderr.trim(),
        "nodeport: reading kubeconfig /nonexistent/kubeconfig: No such file or directory (os error 2)"
    );
}

#[test]
fn missing_or_conflicting_arguments_exit_64() {
    for args in [
        vec!["-f", "objects.yaml", "--from", "203.0.113.5"],
        vec![
            "-f",
            "objects.yaml",
            "--service",
            "default/web",
            "--to",
            "192.0.2.11:80",
        ],
        vec!["-f", "objects.yaml", "--service", "web"],
        // What the proxy would program needs objects (without them the default is the
        // kernel's rules, named from the kernel: `trace_kernel`).
        vec![
            "--rules",
            "render",
            "--from",
            "203.0.113.5",
            "--to",
            "192.0.2.11:80",
        ],
    ] {
        let (_, stderr, code) = trace(&args);
        assert_eq!(code, 64, "{args:?}: {stderr}");
    }
    let (_, stderr, _) = trace(&[
        "--rules",
        "render",
        "--to",
        "192.0.2.11:80",
        "--from",
        "203.0.113.5",
    ]);
    assert!(
        stderr.contains("--rules render traces what the proxy would program for objects: give -f FILE, --kubeconfig or --master"),
        "{stderr}"
    );
}

/// `127.0.0.1:<nodePort>` and another port of 127.0.0.1 from outside the node (kube-proxy's
/// CVE-2020-8558 guard): with localhost NodePorts (`127.0.0.0/8` in `--nodeport-addresses`,
/// route_localnet on) the NodePort is DNATed as kube-proxy does (its guard skips `--ctstate
/// DNAT`) and the rest is dropped by the guard; without them (and in the ebpf mode, which
/// leaves route_localnet off) the kernel drops 127.0.0.1 from the network as a martian
/// destination; from the node itself the NodePort answers.
#[test]
fn loopback_destinations_from_outside_the_node_are_traced_to_the_localnet_guard_or_the_martian_drop()
 {
    let cases: &[(&str, &str, &str)] = &[
        (
            "203.0.113.5",
            "127.0.0.1:30569/tcp",
            "127.0.0.0/8,192.0.2.0/24",
        ),
        (
            "203.0.113.5",
            "127.0.0.1:18080/tcp",
            "127.0.0.0/8,192.0.2.0/24",
        ),
        (
            "192.0.2.11",
            "127.0.0.1:30569/tcp",
            "127.0.0.0/8,192.0.2.0/24",
        ),
        ("203.0.113.5", "127.0.0.1:30569/tcp", "primary"),
    ];
    let modes: &[&[&str]] = &[
        &["--proxy-mode", "nftables"],
        &[
            "--proxy-mode",
            "nftables",
            "--nftables-layout",
            "kube-proxy",
        ],
        &["--proxy-mode", "iptables"],
        &["--proxy-mode", "ebpf"],
    ];
    let mut text = String::new();
    for mode in modes {
        for (from, to, addresses) in cases {
            let mut args = vec!["-f", "objects.yaml"];
            args.extend_from_slice(mode);
            args.extend_from_slice(&["--cluster-cidr", "10.244.0.0/16"]);
            args.extend_from_slice(&["--nodeport-addresses", addresses]);
            args.extend_from_slice(&["--from", from, "--to", to]);
            let (stdout, stderr, code) = trace(&args);
            assert!(stderr.is_empty(), "{args:?}: {stderr}");
            text.push_str(&format!(
                "$ nodeport trace {}\n{stdout}exit {code}\n\n",
                args.join(" ")
            ));
        }
    }
    let exits = exit_codes(&text);
    // nftables (both layouts) and iptables: served, guarded, served, martian; ebpf: martian,
    // martian, served (its socket hook), martian.
    assert_eq!(
        exits,
        [
            "0", "1", "0", "1", "0", "1", "0", "1", "0", "1", "0", "1", "1", "1", "0", "1"
        ],
        "{text}"
    );
    assert_eq!(
        text.matches("the guard against CVE-2020-8558").count(),
        3,
        "{text}"
    );
    assert_eq!(
        text.matches("is a martian destination").count(),
        6,
        "{text}"
    );
    check_golden("localnet.txt", &text);
}

/// The end-to-end suite's `0.0.0.0/0` case: a process of the node to `127.0.0.1:<nodePort>`
/// is served in the iptables mode (kube-proxy's `localhostNodePorts`), refused by the node's
/// own stack in the nftables and ebpf modes, whose selection of every address leaves loopback
/// out: traced as "not a NodePort address", saying so. And a NodePort's number sent to an
/// address the node does not hold is no Service there, with a note naming whose NodePort it is.
#[test]
fn loopback_under_a_selection_of_every_address_and_a_nodeport_to_a_foreign_address_are_explained() {
    for (mode, exit, fate) in [
        (
            &["--proxy-mode", "nftables"][..],
            1,
            "fate        not a NodePort address: 127.0.0.1 is not selected by --nodeport-addresses \
             0.0.0.0/0 (a selection of every address leaves loopback out in the nftables mode, \
             as kube-proxy's does; 127.0.0.0/8 in --nodeport-addresses asks for localhost \
             NodePorts), so NodePort 30569 of default/web:80/TCP does not answer there\n",
        ),
        (
            &["--proxy-mode", "ebpf"][..],
            1,
            "fate        not a NodePort address: 127.0.0.1 is not selected by --nodeport-addresses \
             0.0.0.0/0 (a selection of every address leaves loopback out in the ebpf mode; \
             127.0.0.0/8 in --nodeport-addresses asks for localhost NodePorts), so NodePort \
             30569 of default/web:80/TCP does not answer there\n",
        ),
        (
            &["--proxy-mode", "iptables"][..],
            0,
            "fate        DNAT to one of 10.244.1.5:8080, 10.244.2.7:8080\n",
        ),
        (
            &[
                "--proxy-mode",
                "iptables",
                "--iptables-localhost-nodeports=false",
            ][..],
            1,
            "fate        not a NodePort address: 127.0.0.1 is not selected by --nodeport-addresses \
             0.0.0.0/0 (--iptables-localhost-nodeports is off), so NodePort 30569 of \
             default/web:80/TCP does not answer there\n",
        ),
    ] {
        let mut args = vec!["-f", "objects.yaml", "--nodeport-addresses", "0.0.0.0/0"];
        args.extend_from_slice(mode);
        args.extend_from_slice(&["--from", "127.0.0.1", "--to", "127.0.0.1:30569/tcp"]);
        let (stdout, stderr, code) = trace(&args);
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
        assert_eq!(code, exit, "{args:?}: {stdout}");
        assert!(stdout.contains(fate), "{args:?}: {stdout}");
    }
    let (stdout, _, code) = trace(&[
        "-f",
        "objects.yaml",
        "--from",
        "203.0.113.5",
        "--to",
        "203.0.113.10:30569/tcp",
    ]);
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains(
            "fate        not a Service: no Service has 203.0.113.10:30569/tcp; passed on untranslated\n\
             note        30569/tcp is the NodePort of default/web:80/TCP, but 203.0.113.10 is not \
             an address of this node: NodePorts answer on the node's own addresses\n"
        ),
        "{stdout}"
    );
}

/// `nodeport trace … | head -1` and the like: a reader that leaves early closes the pipe, and
/// the command ends quietly with 141 (128 + SIGPIPE, what a shell reports for a program killed
/// by it), not with a panic's backtrace. The pipe's read end is closed before the command
/// starts, so its first write fails.
#[test]
fn a_closed_stdout_ends_trace_render_and_version_quietly() {
    for args in [
        &["trace", "-f", "objects.yaml", "--service", "default/web"][..],
        &[
            "trace",
            "-f",
            "objects.yaml",
            "--from",
            "203.0.113.5",
            "--to",
            "192.0.2.11:30569/tcp",
        ][..],
        &[
            "trace",
            "-f",
            "objects.yaml",
            "-o",
            "json",
            "--from",
            "203.0.113.5",
            "--to",
            "192.0.2.11:30569/tcp",
        ][..],
        &["render", "-f", "objects.yaml"][..],
        &["version"][..],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
            .args(args)
            .current_dir(testdata())
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
    }
}
