//! `nodeport proxy` and `nodeport render` command lines: bad flags exit 64 naming the flag;
//! render prints the ruleset for a file of objects without touching kernel or server, in
//! each proxy mode; the IPVS mode refuses to start on a kernel without IPVS.

use std::process::Command;

fn nodeport(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn invalid_proxy_flags_exit_64_naming_the_flag() {
    for (args, flag) in [
        (
            vec!["proxy", "--nodeport-addresses", ""],
            "--nodeport-addresses",
        ),
        (
            vec!["proxy", "--nodeport-addresses", "10.0.0.0/33"],
            "--nodeport-addresses",
        ),
        (vec!["proxy", "--cluster-cidr", "banana"], "--cluster-cidr"),
        (vec!["proxy", "--sync-period", "10"], "--sync-period"),
        (vec!["proxy", "--proxy-mode", "userspace"], "--proxy-mode"),
        (
            vec!["proxy", "--iptables-variant", "system"],
            "--iptables-variant",
        ),
        (
            vec!["render", "-f", "-", "--nodeport-addresses", "x"],
            "--nodeport-addresses",
        ),
        (
            vec!["proxy", "--nftables-layout", "chains"],
            "--nftables-layout",
        ),
        (
            vec!["render", "-f", "-", "--nftables-layout", "chains"],
            "--nftables-layout",
        ),
    ] {
        let out = nodeport(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
}

#[test]
fn render_prints_kube_proxys_names_for_a_file_of_objects() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("objects.yaml");
    std::fs::write(
        &file,
        r#"apiVersion: v1
kind: Service
metadata: {name: backends, namespace: default}
spec: {type: NodePort, clusterIP: 10.96.109.220, ports: [{port: 80, nodePort: 31384}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: backends-x, namespace: default, labels: {kubernetes.io/service-name: backends}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [10.244.2.14], nodeName: kind-worker2}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
"#,
    )
    .unwrap();
    let out = nodeport(&[
        "render",
        "--nftables-layout",
        "kube-proxy",
        "-f",
        file.to_str().unwrap(),
        "--node-name",
        "kind-worker2",
        "--node-ip",
        "192.168.228.2",
        "--cluster-cidr",
        "10.244.0.0/16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    // Names as in reference 003.
    for line in [
        "add element ip kube-proxy service-ips { 10.96.109.220 . tcp . 80 : goto service-GZEOLGI7-default/backends/tcp/ }",
        "add element ip kube-proxy service-nodeports { tcp . 31384 : goto external-GZEOLGI7-default/backends/tcp/ }",
        "add rule ip kube-proxy endpoint-LNODCRIZ-default/backends/tcp/__10.244.2.14/80 meta l4proto tcp dnat to 10.244.2.14:80",
        "add element ip kube-proxy nodeport-ips { 192.168.228.2 }",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    assert!(String::from_utf8_lossy(&out.stderr).contains("skipping v1 ConfigMap"));
}

#[test]
fn render_prints_the_flat_layout_by_default_with_each_element_named_by_its_service_port() {
    let text = render("nftables");
    for line in [
        "add map ip kube-proxy service-endpoints { typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . th dport ; size 4096 ; comment \"endpoints of each destination\" ; }",
        "add rule ip kube-proxy pick-service-endpoints dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 offset 3 map @service-endpoints",
        "add element ip kube-proxy service-endpoints { 10.96.132.141 . tcp . 80 . 3 comment \"default/web\" : 10.244.1.6 . 80 }",
        "add element ip kube-proxy nodeport-endpoints { tcp . 30510 . 5 comment \"default/web\" : 10.244.2.8 . 80 }",
        "add element ip kube-proxy masquerade-nodeports { tcp . 30510 comment \"default/web\" }",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    // No per-Service chains (kube-proxy's have a `/` in their names).
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("add chain") && l.contains('/')),
        "{text}"
    );
}

/// Reference 000's `web` Service with its three pods, one on this node (`worker2`).
const WEB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {type: NodePort, clusterIP: 10.96.132.141, ports: [{port: 80, nodePort: 30510}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-x, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [10.244.1.6]}, {addresses: [10.244.2.7]}, {addresses: [10.244.2.8], nodeName: worker2}]
"#;

fn render(mode: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, WEB).unwrap();
    let out = nodeport(&[
        "render",
        "--proxy-mode",
        mode,
        "-f",
        file.to_str().unwrap(),
        "--node-name",
        "worker2",
        "--node-ip",
        "192.0.2.4",
        "--cluster-cidr",
        "10.244.0.0/16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn render_iptables_prints_the_iptables_restore_input_with_reference_000s_chain_names() {
    let text = render("iptables");
    for line in [
        "# iptables-restore --noflush (IPv4)",
        "*nat",
        ":KUBE-SVC-LOLE4ISW44XBNF3G - [0:0]",
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
        "-A KUBE-NODEPORTS -m comment --comment default/web -m tcp -p tcp --dport 30510 -j KUBE-EXT-LOLE4ISW44XBNF3G",
        "-A KUBE-SVC-LOLE4ISW44XBNF3G -m comment --comment \"default/web -> 10.244.1.6:80\" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-PJHHG4YJTBHVHUTY",
        "-A KUBE-SVC-LOLE4ISW44XBNF3G -m comment --comment \"default/web -> 10.244.2.8:80\" -j KUBE-SEP-R53NX34J3PCIETEY",
        "-A KUBE-SEP-4OIMBIYGK4QJUGT7 -m comment --comment default/web -m tcp -p tcp -j DNAT --to-destination 10.244.2.7:80",
        "-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        "COMMIT",
        "# ip6tables-restore --noflush (IPv6)",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

#[test]
fn render_ipvs_prints_virtual_servers_ipsets_and_companion_rules() {
    let text = render("ipvs");
    for line in [
        "# ipvsadm -S -n (IPv4)",
        "-A -t 192.0.2.4:30510 -s rr",
        "-a -t 192.0.2.4:30510 -r 10.244.2.8:80 -m -w 1",
        "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535",
        "add KUBE-NODE-PORT-TCP 30510",
        "add KUBE-CLUSTER-IP 10.96.132.141,tcp:80",
        "-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port for masquerade purpose\" -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

#[test]
fn proxy_in_ipvs_mode_exits_at_once_saying_why() {
    let out = nodeport(&[
        "proxy",
        "--proxy-mode",
        "ipvs",
        "--master",
        "http://127.0.0.1:9",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("KEP-5495"), "{stderr}");
    if !std::path::Path::new("/proc/net/ip_vs").exists() {
        assert!(
            stderr.contains("this kernel has no IPVS (/proc/net/ip_vs is missing"),
            "{stderr}"
        );
    }
}

#[test]
fn every_invalid_nodeport_addresses_value_exits_64_naming_the_flag_and_the_value() {
    // Reference 004: the empty string is invalid; so are malformed CIDRs and unknown
    // keywords, anywhere in the list, and what kube-proxy's validation refuses.
    for value in [
        "",
        ",",
        "10.0.0.0/33",
        "300.1.2.3/8",
        "192.0.2.0/24,",
        "default_route",
        "127.0.0.0/8,bogus",
        "localhost",
        // kube-proxy's validateKubeProxyNodePortAddress: "primary" only alone; entries
        // with spaces around them are not CIDRs (pflag keeps the spaces).
        "primary,192.0.2.0/24",
        "default-route,primary",
        "192.0.2.0/24, 127.0.0.0/8",
        " primary",
    ] {
        for cmd in [
            vec!["proxy", "--nodeport-addresses", value],
            vec!["render", "-f", "-", "--nodeport-addresses", value],
            vec![
                "render",
                "--proxy-mode",
                "iptables",
                "-f",
                "-",
                "--nodeport-addresses",
                value,
            ],
        ] {
            let out = nodeport(&cmd);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(64), "{cmd:?}: {stderr}");
            assert!(
                stderr.contains(&format!(
                    "invalid value \"{value}\" for --nodeport-addresses"
                )),
                "{cmd:?}: {stderr}"
            );
            assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
        }
    }
    // The same list in a KubeProxyConfiguration file.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nnodePortAddresses: [\"127.0.0.0/8\", \"nonsense\"]\n",
    )
    .unwrap();
    let out = nodeport(&["proxy", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("--nodeport-addresses: \"nonsense\" is not a CIDR"),
        "{stderr}"
    );
}

/// `nodeport render` with a node of two interfaces: eth0 (holding the default route) and
/// eth1.
fn render_selection(mode: &str, nodeport_addresses: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, WEB).unwrap();
    let out = nodeport(&[
        "render",
        "--proxy-mode",
        mode,
        "-f",
        file.to_str().unwrap(),
        "--node-name",
        "worker2",
        "--node-ip",
        "192.0.2.4",
        "--interface",
        "eth0=192.0.2.4",
        "--interface",
        "eth1=198.51.100.4,2001:db8::4",
        "--default-route-interface",
        "eth0",
        "--nodeport-addresses",
        nodeport_addresses,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn render_previews_what_each_nodeport_addresses_value_selects_in_nftables_mode() {
    let set = |ip: &str| format!("add element ip kube-proxy nodeport-ips {{ {ip} }}");
    let text = render_selection("nftables", "default-route");
    assert!(text.contains(&set("192.0.2.4")), "{text}");
    assert!(!text.contains("198.51.100.4"), "{text}");
    let text = render_selection("nftables", "192.168.0.0/16,198.51.100.0/24");
    assert!(text.contains(&set("198.51.100.4")), "{text}");
    assert!(!text.contains(&set("192.0.2.4")), "{text}");
    let text = render_selection("nftables", "127.0.0.0/8,default-route");
    assert!(text.contains(&set("127.0.0.1")), "{text}");
    assert!(text.contains(&set("192.0.2.4")), "{text}");
    assert!(
        text.contains("add rule ip kube-proxy filter-input jump localnet-check"),
        "{text}"
    );
    let text = render_selection("nftables", "0.0.0.0/0");
    assert!(
        text.contains("services fib daddr type local ip daddr != 127.0.0.0/8"),
        "{text}"
    );
    assert!(!text.contains("localnet-check"), "{text}");
    // IPv6 entries apply to the ip6 table only.
    let text = render_selection("nftables", "198.51.100.0/24,2001:db8::/64");
    assert!(
        text.contains("add element ip6 kube-proxy nodeport-ips { 2001:db8::4 }"),
        "{text}"
    );
    assert!(text.contains(&set("198.51.100.4")), "{text}");
}

#[test]
fn render_previews_what_each_nodeport_addresses_value_selects_in_iptables_mode() {
    let jump = |ip: &str| format!("-d {ip} -j KUBE-NODEPORTS");
    let text = render_selection("iptables", "default-route");
    assert!(text.contains(&jump("192.0.2.4")), "{text}");
    assert!(!text.contains(&jump("198.51.100.4")), "{text}");
    let text = render_selection("iptables", "127.0.0.0/8,198.51.100.0/24");
    assert!(text.contains(&jump("127.0.0.1")), "{text}");
    assert!(text.contains(&jump("198.51.100.4")), "{text}");
    assert!(!text.contains(&jump("192.0.2.4")), "{text}");
    assert!(
        text.contains("-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"),
        "{text}"
    );
    let text = render_selection("iptables", "0.0.0.0/0");
    assert!(text.contains("-m addrtype --dst-type LOCAL"), "{text}");
}

#[test]
fn render_refuses_a_default_route_interface_it_was_not_given() {
    let out = nodeport(&[
        "render",
        "-f",
        "-",
        "--interface",
        "eth0=192.0.2.4",
        "--default-route-interface",
        "eth9",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("--default-route-interface"), "{stderr}");
}

#[test]
fn render_reads_the_nodes_interfaces_and_default_route_from_the_objects_file() {
    let node = r#"apiVersion: v1
kind: Node
metadata:
  name: worker2
  annotations:
    nodeport.render/interfaces: "eth0=192.0.2.4 eth1=198.51.100.4"
    nodeport.render/default-route-interfaces: eth1
status: {addresses: [{type: InternalIP, address: 192.0.2.4}]}
---
"#;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, format!("{node}{WEB}")).unwrap();
    let out = nodeport(&[
        "render",
        "-f",
        file.to_str().unwrap(),
        "--nodeport-addresses",
        "default-route",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("add element ip kube-proxy nodeport-ips { 198.51.100.4 }"),
        "{text}"
    );
    assert!(!text.contains("nodeport-ips { 192.0.2.4 }"), "{text}");
    // A flag wins over the annotation.
    let out = nodeport(&[
        "render",
        "-f",
        file.to_str().unwrap(),
        "--nodeport-addresses",
        "default-route",
        "--default-route-interface",
        "eth0",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("add element ip kube-proxy nodeport-ips { 192.0.2.4 }"),
        "{text}"
    );
}

#[test]
fn invalid_ebpf_flags_exit_64_naming_the_flag() {
    let not_a_cgroup = tempfile::tempdir().unwrap();
    let not_a_cgroup = not_a_cgroup.path().to_str().unwrap();
    for (args, flag) in [
        (
            vec!["proxy", "--proxy-mode", "ebpf", "--ebpf-ct-map-size", "0"],
            "--ebpf-ct-map-size",
        ),
        (
            vec![
                "proxy",
                "--proxy-mode",
                "ebpf",
                "--ebpf-services-map-size",
                "1k",
            ],
            "--ebpf-services-map-size",
        ),
        (
            vec!["proxy", "--proxy-mode", "ebpf", "--ebpf-lb-algorithm", "rr"],
            "--ebpf-lb-algorithm",
        ),
        (
            vec!["proxy", "--proxy-mode", "ebpf", "--ebpf-pin-root", "bpf"],
            "--ebpf-pin-root",
        ),
        (
            vec![
                "proxy",
                "--proxy-mode",
                "ebpf",
                "--ebpf-cgroup-root",
                not_a_cgroup,
            ],
            "--ebpf-cgroup-root",
        ),
        (
            vec![
                "render",
                "-f",
                "-",
                "--proxy-mode",
                "ebpf",
                "--ebpf-lb-algorithm",
                "x",
            ],
            "--ebpf-lb-algorithm",
        ),
        (
            vec![
                "up",
                "--proxy-mode",
                "ebpf",
                "--node-ip",
                "192.0.2.1",
                "--ebpf-backends-map-size",
                "0",
            ],
            "--ebpf-backends-map-size",
        ),
    ] {
        let out = nodeport(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
}

#[test]
fn proxy_help_states_each_ebpf_maps_default_and_memory() {
    let out = nodeport(&["proxy", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--ebpf-pin-root",
        "--ebpf-cgroup-root",
        "--ebpf-lb-algorithm",
        "--ebpf-services-map-size",
        "--ebpf-backends-map-size",
        "--ebpf-ct-map-size",
        "--ebpf-affinity-map-size",
        "--ebpf-source-ranges-map-size",
        "--ebpf-maglev-map-size",
        "--ebpf-sockets-map-size",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    assert!(
        help.contains("[default: 524288, about 80 MiB per map]"),
        "{help}"
    );
}

#[test]
fn render_ebpf_prints_one_line_per_frontend_with_its_backends() {
    let text = render("ebpf");
    assert_eq!(
        text,
        "10.96.132.141:80/TCP external (default/web) → 10.244.1.6:80, 10.244.2.7:80, 10.244.2.8:80 (random, masquerade unless from 10.244.0.0/16)\n\
         10.96.132.141:80/TCP internal (default/web) → 10.244.1.6:80, 10.244.2.7:80, 10.244.2.8:80 (random)\n\
         192.0.2.4:30510/TCP external (default/web) → 10.244.1.6:80, 10.244.2.7:80, 10.244.2.8:80 (random, masquerade)\n\
         192.0.2.4:30510/TCP internal (default/web) → 10.244.1.6:80, 10.244.2.7:80, 10.244.2.8:80 (random)\n"
    );
}
