//! `nodeport trace --rules kernel` on a node whose kernel a real `nodeport proxy` programmed
//! (in network namespaces; nftables in both layouts, and iptables): the path read back from
//! the kernel (`nft -j list table`, `iptables-save`) equals the trace of what the proxy would
//! program for the same objects, the fate matches what a real client gets, and a kernel that
//! no longer holds the rules is told apart.

mod proxy_support;

use nodeport_testbed::require_tools;
use proxy_support::*;

/// `nodeport trace` inside the node, objects from its API server, run.
fn run_trace(c: &Cluster, mode: Mode, rules: &str, args: &[&str]) -> std::process::Output {
    let mut cmd = c.node.command(env!("CARGO_BIN_EXE_nodeport"));
    cmd.args(["trace", "--rules", rules]);
    // The proxy's pin root, where the ebpf mode's maps are read.
    if let Some(ebpf) = &c.ebpf {
        cmd.arg("--ebpf-pin-root").arg(&ebpf.pin_root);
    }
    // The kernel's trace finds the mode (and the nftables layout) on the node by itself.
    if rules == "render" {
        cmd.args(["--proxy-mode", mode.as_str()])
            .args(mode.extra_args());
    }
    cmd.args([
        "--master",
        "http://127.0.0.1:6443",
        "--node-name",
        "node-a",
        // The proxy's own flags (proxy_support::Cluster::start_proxy).
        "--cluster-cidr",
        "10.244.0.0/16",
    ])
    .args(args)
    .env("NODEPORT_LOG", "error")
    .output()
    .unwrap()
}

/// [`run_trace`] with `-o json`: the object printed.
fn trace_json(c: &Cluster, mode: Mode, rules: &str, args: &[&str]) -> serde_json::Value {
    let out = run_trace(c, mode, rules, &[args, &["-o", "json"]].concat());
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&out.stderr)))
}

/// `nodeport trace` inside the node, objects from its API server: (stdout without the
/// `rules` line, exit code).
fn trace(c: &Cluster, mode: Mode, rules: &str, args: &[&str]) -> (String, i32) {
    let out = run_trace(c, mode, rules, args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "{args:?}: {stderr}");
    let rules_line = stdout.lines().next().unwrap_or_default();
    assert!(rules_line.starts_with("rules "), "{stdout}");
    if rules == "kernel" {
        let held = match mode {
            Mode::Nftables => {
                "nftables, as this node's kernel holds them (nft -j list table ip/ip6 kube-proxy, the flat layout)"
            }
            Mode::NftablesKubeProxy => {
                "nftables, as this node's kernel holds them (nft -j list table ip/ip6 kube-proxy, the kube-proxy layout)"
            }
            Mode::Iptables => "iptables, as this node's kernel holds them (iptables-",
            Mode::Ebpf => "ebpf, as this node's kernel holds them (the BPF maps pinned under /",
        };
        assert!(rules_line.contains(held), "{stdout}");
    }
    let body: Vec<&str> = stdout.lines().skip(1).collect();
    (body.join("\n"), out.status.code().expect("exited"))
}

/// `nodeport trace` inside the node with no objects at all (no `-f`, no API server, none of
/// the proxy's flags): (stdout, stderr, exit code).
fn trace_alone(c: &Cluster, args: &[&str]) -> (String, String, i32) {
    let mut cmd = c.node.command(env!("CARGO_BIN_EXE_nodeport"));
    cmd.arg("trace");
    if let Some(ebpf) = &c.ebpf {
        cmd.arg("--ebpf-pin-root").arg(&ebpf.pin_root);
    }
    let out = cmd
        .args(args)
        .env("NODEPORT_LOG", "error")
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code().expect("exited"),
    )
}

/// Removes from `line` each `<word> <digits>` (`rule 416`, `rule #6`, `svc 3, `, `set 7, `,
/// `, frontend 3`): what a path's rules and map entries are named by in the kernel (handles,
/// service and backend set ids) or in a render (a rule's place).
fn without_numbered(line: &str, word: &str) -> String {
    let mut out = line.to_string();
    let mut from = 0;
    while let Some(at) = out[from..].find(word).map(|i| i + from) {
        let rest = &out[at + word.len()..];
        let digits = rest.trim_start_matches('#');
        let n = digits.len()
            - digits
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .len();
        if n == 0 {
            from = at + word.len();
            continue;
        }
        let end = at + word.len() + (rest.len() - digits.len()) + n;
        out.replace_range(at..end, "");
        from = at;
    }
    out
}

/// A trace's `path` lines without what names their rules and entries (the kernel's handles
/// and ids, a render's places): the kernel's and a render's paths are then the same.
fn path_unnumbered(out: &str) -> String {
    out.lines()
        .map(|l| {
            if !l.starts_with("path ") {
                return l.to_string();
            }
            let mut l = without_numbered(l, " rule ");
            for word in ["svc ", "set "] {
                l = without_numbered(&l, word)
                    .replace("{ , ", "{ ")
                    .replace(": , ", ": ")
                    .replace(", , ", ", ");
            }
            without_numbered(&l, ", frontend ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A trace's lines with what places differ by left out: the `rules` line and the interface;
/// an endpoint's node. The Service ports' names are compared as they are: the kernel's own
/// (the ebpf mode's `np_svc_names` too) must name them as the objects do.
fn comparable(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| !l.starts_with("rules "))
        .map(|l| {
            let mut l = match l.split_once(", on ") {
                Some((head, _)) if l.starts_with("packet ") => head.to_string(),
                _ => l.to_string(),
            };
            if l.starts_with("endpoint ") {
                l = l.replace("on another node", "on this node");
            }
            l
        })
        .collect()
}

/// Removes every `rule_handle` from a JSON path, counting them.
fn strip_handles(v: &mut serde_json::Value, count: &mut usize) {
    match v {
        serde_json::Value::Object(m) => {
            if m.remove("rule_handle").is_some() {
                *count += 1;
            }
            m.values_mut().for_each(|x| strip_handles(x, count));
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|x| strip_handles(x, count)),
        _ => {}
    }
}

fn the_kernels_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes(mode: Mode) {
    let mut tools = vec!["kubectl", "curl"];
    tools.extend(mode.tools());
    if !require_tools(
        &format!(
            "the_kernels_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes ({mode:?})"
        ),
        &tools,
    ) {
        return;
    }
    let c = Cluster::start(mode, &[]);
    c.apply(&service_yaml("web", 30080, "", &[1, 2, 3]))
        .unwrap();
    c.apply(&service_yaml("empty", 30090, "", &[])).unwrap();
    c.apply(&service_yaml(
        "local",
        30070,
        "  externalTrafficPolicy: Local",
        &[2],
    ))
    .unwrap();
    let web = format!("{NODE_IP}:30080");
    eventually(&c.client, &web, "the NodePort answers", |r| {
        matches!(r, Reply::Pod { .. })
    });
    let empty = format!("{NODE_IP}:30090");
    eventually(&c.client, &empty, "the empty Service is refused", |r| {
        *r == Reply::Refused
    });
    // Applied last: until the proxy has synced it, the node refuses the port (no listener);
    // once synced, its packets are dropped (no local endpoint). Traced before that, the kernel
    // rightly differed from the render, and the test failed now and then.
    eventually(
        &c.client,
        &format!("{NODE_IP}:30070"),
        "the Local Service without a local endpoint drops",
        |r| *r == Reply::Timeout,
    );

    let web_to = format!("{web}/tcp");
    let empty_to = format!("{empty}/tcp");
    let local_to = format!("{NODE_IP}:30070/tcp");
    let cluster_ip = format!("{}:80/tcp", c.cluster_ip("web"));
    // A node routes its Service addresses (by its default route, as a rule): without a
    // route the node's own connection to a ClusterIP fails at connect(), which the kernel's
    // trace notes and a render's cannot know (trace_live checks that note).
    c.node
        .run(&["ip", "route", "add", "10.96.0.0/12", "via", CLIENT_IP])
        .unwrap();
    for args in [
        vec!["--from", CLIENT_IP, "--to", web_to.as_str()],
        vec!["--from", CLIENT_IP, "--to", empty_to.as_str()],
        vec!["--from", CLIENT_IP, "--to", local_to.as_str()],
        // The node's own address: the output path.
        vec!["--from", NODE_IP, "--to", cluster_ip.as_str()],
        vec!["--from", "10.244.2.2", "--to", cluster_ip.as_str()],
        vec!["--from", CLIENT_IP, "--to", "192.0.2.10:22/tcp"],
    ] {
        let (kernel, kernel_code) = trace(&c, mode, "kernel", &args);
        let (render, render_code) = trace(&c, mode, "render", &args);
        // The kernel's trace also names the input interface (the route back to the source).
        let kernel = kernel
            .lines()
            .map(|l| match l.split_once(", on ") {
                Some((head, _)) if l.starts_with("packet ") => head,
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n");
        // The same path, step for step, but for how its rules and entries are named: the
        // kernel's handles (nftables) and ids (ebpf), a render's places.
        assert!(kernel.contains("\npath "), "{mode:?} {args:?}: {kernel}");
        assert_eq!(
            path_unnumbered(&kernel),
            path_unnumbered(&render),
            "{mode:?} {args:?}"
        );
        assert_eq!(kernel_code, render_code, "{mode:?} {args:?}");
        assert!(!kernel.contains("note"), "{mode:?} {args:?}: {kernel}");

        // With no objects at all, the kernel names the same Services (the ebpf mode's maps
        // from np_svc_names), endpoints, policies and reasons: the same explanation.
        let (alone, stderr, alone_code) = trace_alone(&c, &args);
        assert!(stderr.is_empty(), "{mode:?} {args:?}: {stderr}");
        assert_eq!(alone_code, kernel_code, "{mode:?} {args:?}: {alone}");
        assert_eq!(comparable(&alone), comparable(&kernel), "{mode:?} {args:?}");
        let names = match mode {
            Mode::Nftables => "; names from the kernel (its elements' comments)\n",
            Mode::NftablesKubeProxy => {
                "; names from the kernel (its chains' names and its elements' comments)\n"
            }
            Mode::Iptables => "; names from the kernel (its rules' comments)\n",
            Mode::Ebpf => "; names from the kernel (its np_svc_names map)\n",
        };
        assert!(
            alone.starts_with("rules ") && alone.contains(names),
            "{alone}"
        );
        assert!(!alone.contains("svc-"), "{alone}");
    }
    // The path as JSON: the kernel's rules in the same places as the render's, each named by
    // its handle too in the nftables mode.
    if mode != Mode::Ebpf {
        let args = ["--from", CLIENT_IP, "--to", web_to.as_str()];
        let mut kernel = trace_json(&c, mode, "kernel", &args)["path"].clone();
        let render = trace_json(&c, mode, "render", &args)["path"].clone();
        let mut handles = 0;
        strip_handles(&mut kernel, &mut handles);
        assert_eq!(kernel, render, "{mode:?}");
        let rules = render.to_string().matches("\"rule_index\"").count();
        match mode {
            Mode::Iptables => assert_eq!(handles, 0),
            _ => assert_eq!(handles, rules, "{mode:?}: every rule by its handle"),
        }
    }
    // Named from the kernel: the pods the node routes to over its own links (all three in
    // this topology, whatever their Node objects say) are on this node; the ebpf mode's maps
    // say it themselves (the objects' word, their remote flag).
    let (alone, _, _) = trace_alone(&c, &["--from", CLIENT_IP, "--to", &web_to]);
    let places: Vec<&str> = alone
        .lines()
        .filter(|l| l.starts_with("endpoint "))
        .map(|l| l.rsplit("  ").next().unwrap())
        .collect();
    let want = if mode == Mode::Ebpf {
        ["on this node", "on another node", "on another node"]
    } else {
        ["on this node"; 3]
    };
    assert_eq!(places, want, "{mode:?}: {alone}");
    // An API server that cannot be read: named from the kernel, said on stderr.
    let (fallback, stderr, code) = trace_alone(
        &c,
        &[
            "--master",
            "http://127.0.0.1:9",
            "--rules",
            "kernel",
            "--from",
            CLIENT_IP,
            "--to",
            &web_to,
        ],
    );
    assert_eq!(code, 0, "{mode:?}: {fallback}{stderr}");
    assert!(
        stderr.contains("nodeport trace: the objects of http://127.0.0.1:9 cannot be read (")
            && stderr.contains("naming what the kernel holds from the kernel alone"),
        "{mode:?}: {stderr}"
    );
    assert_eq!(comparable(&fallback), comparable(&alone), "{mode:?}");
    if matches!(mode, Mode::Nftables | Mode::NftablesKubeProxy | Mode::Ebpf) {
        // The flat layout's affinity maps (kube-proxy's layout: the endpoints' affinity sets;
        // the ebpf mode's np_affinity) remember a client that connected: the kernel's trace
        // shows a new client's path (as the render) and says where this one goes.
        c.apply(&service_yaml(
            "sticky",
            30060,
            "  sessionAffinity: ClientIP",
            &[1, 2, 3],
        ))
        .unwrap();
        let sticky = format!("{NODE_IP}:30060");
        let Reply::Pod { pod, .. } =
            eventually(&c.client, &sticky, "the sticky NodePort answers", |r| {
                matches!(r, Reply::Pod { .. })
            })
        else {
            unreachable!()
        };
        let to = format!("{sticky}/tcp");
        let args = ["--from", CLIENT_IP, "--to", to.as_str()];
        let (kernel, code) = trace(&c, mode, "kernel", &args);
        let (render, _) = trace(&c, mode, "render", &args);
        assert_eq!(code, 0, "{kernel}");
        let n: u8 = pod.trim_start_matches("pod").parse().unwrap();
        assert!(
            kernel.contains(&format!(
                "session affinity: the kernel remembers this client and sends it to 10.244.{n}.2:"
            )),
            "{kernel}"
        );
        assert!(!kernel.contains("differs"), "{kernel}");
        assert!(!render.contains("session affinity: the kernel"), "{render}");
        if mode == Mode::Ebpf {
            // The affinity step reads the client's entry (IPv4 clients are keyed by their
            // ::ffff: mapped address) and says how long it holds.
            assert!(
                kernel.contains(&format!("np_affinity sends {CLIENT_IP} to 10.244.{n}.2:"))
                    && kernel.contains("honoured only until the entry has been idle 10800 s"),
                "{kernel}"
            );
        }
    }
    // Every address: the kernel's trace takes the node's own addresses (the pod gateways and
    // eth1 too), the rendered one the Node's; where both look, they agree.
    let (kernel, _) = trace(&c, mode, "kernel", &["--service", "default/web"]);
    let (render, _) = trace(&c, mode, "render", &["--service", "default/web"]);
    let kernel_lines: Vec<String> = kernel
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    for line in render.lines() {
        let line = line.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            kernel_lines.contains(&line),
            "{mode:?}: {line:?} not in\n{kernel}"
        );
    }
    assert!(kernel.contains("198.51.100.10:30080/tcp"), "{kernel}");
    assert!(!kernel.contains("note"), "{mode:?}: {kernel}");
    // Named from the kernel, the same addresses, the ClusterIP from the node network's
    // address.
    let (alone, stderr, code) = trace_alone(&c, &["--service", "default/web"]);
    assert_eq!(code, 0, "{mode:?}: {alone}{stderr}");
    let lines: Vec<String> = alone
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let web_ip = c.cluster_ip("web");
    assert!(
        lines.iter().any(|l| l.starts_with(&format!(
            "{web_ip}:80/tcp ClusterIP from {NODE_IP} DNAT to one of"
        ))),
        "{mode:?}: {alone}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("192.0.2.10:30080/tcp NodePort from 203.0.113.1 DNAT to one of")),
        "{mode:?}: {alone}"
    );

    // The fates themselves, as the client met them above.
    let (out, code) = trace(&c, mode, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(
            "fate        DNAT to one of 10.244.1.2:8080, 10.244.2.2:8080, 10.244.3.2:8080"
        ),
        "{out}"
    );
    let (out, code) = trace(
        &c,
        mode,
        "kernel",
        &["--from", CLIENT_IP, "--to", &empty_to],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("reject: default/empty:80/TCP has no endpoints"),
        "{out}"
    );
    let (out, code) = trace(
        &c,
        mode,
        "kernel",
        &["--from", CLIENT_IP, "--to", &local_to],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("drop: externalTrafficPolicy Local and default/local:80/TCP has no endpoint on this node"),
        "{out}"
    );
    let (out, _) = trace(
        &c,
        mode,
        "kernel",
        &["--from", NODE_IP, "--to", &cluster_ip],
    );
    assert!(out.contains("from this node (output path)"), "{out}");
    let (out, _) = trace(&c, mode, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
    assert!(
        out.contains("(input path), on eth0 (the route back to 192.0.2.100)"),
        "{out}"
    );

    // Another table's chains in a hook the packet crosses are evaluated: a forward filter
    // (the NodePort's endpoints are pods, forwarded to) and a prerouting filter before the
    // proxy's DNAT (it still sees the NodePort) decide the fate when they drop the packet,
    // say they do not when they do not, and one the tracer cannot evaluate (an interface
    // match) is noted as one that may drop it. A packet to a local address crosses neither
    // forward chain.
    if mode != Mode::Ebpf {
        let node_port = web_to
            .rsplit_once(':')
            .and_then(|(_, p)| p.split('/').next())
            .unwrap();
        c.node
            .run_with_stdin(
                &["nft", "-f", "-"],
                format!(
                    "table inet site {{\n chain forward {{\n type filter hook forward priority 0;\n \
                     ip saddr {CLIENT2_IP} drop\n }}\n chain early {{\n type filter hook prerouting \
                     priority -300;\n ip saddr 192.0.2.102 tcp dport {node_port} drop\n }}\n \
                     chain odd {{\n type filter hook forward priority 10;\n iifname \"eth9\" drop\n }}\n}}\n"
                )
                .as_bytes(),
            )
            .unwrap();
        let (out, code) = trace(&c, mode, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
        let (dropped, dropped_code) =
            trace(&c, mode, "kernel", &["--from", CLIENT2_IP, "--to", &web_to]);
        let (early, early_code) = trace(
            &c,
            mode,
            "kernel",
            &["--from", "192.0.2.102", "--to", &web_to],
        );
        let (to_node, _) = trace(
            &c,
            mode,
            "kernel",
            &["--from", CLIENT_IP, "--to", "192.0.2.10:22/tcp"],
        );
        c.node
            .run(&["nft", "delete", "table", "inet", "site"])
            .unwrap();
        assert_eq!(code, 0, "{mode:?}: {out}");
        assert!(
            out.contains("note        table inet site chain forward (hook forward, priority 0) holds drop or reject rules; evaluated, none of them drops this packet"),
            "{mode:?}: {out}"
        );
        assert!(
            out.contains("note        table inet site chain odd (hook forward, priority 10) holds 1 drop or reject rule(s): it may drop this packet, outside the proxy's rules"),
            "{mode:?}: {out}"
        );
        assert_eq!(dropped_code, 1, "{mode:?}: {dropped}");
        assert!(
            dropped.contains("fate        drop by table inet site, not by the proxy's rules: its chain forward (hook forward, priority 0) drops it\n"),
            "{mode:?}: {dropped}"
        );
        assert_eq!(early_code, 1, "{mode:?}: {early}");
        assert!(
            early.contains("fate        drop by table inet site, not by the proxy's rules: its chain early (hook prerouting, priority -300) drops it\n"),
            "{mode:?}: {early}"
        );
        assert!(!to_node.contains("chain forward"), "{mode:?}: {to_node}");
        assert!(!to_node.contains("chain odd"), "{mode:?}: {to_node}");

        // A chain after the DNAT that drops the way to one endpoint only: that share; a
        // later chain dropping the same finds nothing left of it to drop.
        c.node
            .run_with_stdin(
                &["nft", "-f", "-"],
                b"table inet part {\n chain post {\n type filter hook postrouting priority 0;\n \
                  ip daddr 10.244.2.2 tcp dport 8080 drop\n }\n chain later {\n type filter hook \
                  postrouting priority 10;\n ip daddr 10.244.2.2 drop\n }\n}\n",
            )
            .unwrap();
        let (part, part_code) = trace(&c, mode, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
        c.node
            .run(&["nft", "delete", "table", "inet", "part"])
            .unwrap();
        assert_eq!(part_code, 1, "{mode:?}: {part}");
        assert!(
            part.contains("\nor          drop by table inet part, not by the proxy's rules: its chain post (hook postrouting, priority 0) drops it on its way to 10.244.2.2:8080 (33.33%)"),
            "{mode:?}: {part}"
        );
        assert!(part.contains(" (66.67%)\n"), "{mode:?}: {part}");
        assert_eq!(part.matches("\nor ").count(), 1, "{mode:?}: {part}");
        assert!(
            part.contains("note        table inet part chain later (hook postrouting, priority 10) holds drop or reject rules; evaluated, none of them drops this packet"),
            "{mode:?}: {part}"
        );
    }

    // Rules removed by hand behind the proxy's back: the kernel's trace says what it holds
    // and that the proxy would program something else. (The nftables mode notices a changed
    // table at once and repairs it, so only the iptables mode keeps the damage long enough
    // to look at.)
    if mode != Mode::Iptables {
        return;
    }
    // What else on the node decides: strict reverse-path filtering on an interface the route
    // back does not leave through, forwarding off, an endpoint without a route.
    c.node.sysctl("net.ipv4.conf.all.rp_filter", "1").unwrap();
    let (out, _) = trace(
        &c,
        mode,
        "kernel",
        &[
            "--from",
            CLIENT_IP,
            "--to",
            &web_to,
            "--in-interface",
            "eth1",
        ],
    );
    c.node.sysctl("net.ipv4.conf.all.rp_filter", "0").unwrap();
    assert!(out.contains("(input path), on eth1"), "{out}");
    assert!(
        out.contains("note        strict rp_filter on eth1 drops it before any rule: the route back to 192.0.2.100 leaves through eth0"),
        "{out}"
    );
    c.node.sysctl("net.ipv4.ip_forward", "0").unwrap();
    c.node
        .run(&["ip", "route", "add", "unreachable", "10.244.2.2/32"])
        .unwrap();
    let (out, _) = trace(&c, mode, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
    c.node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    c.node
        .run(&["ip", "route", "del", "unreachable", "10.244.2.2/32"])
        .unwrap();
    assert!(
        out.contains("note        net.ipv4.ip_forward is 0: this node does not forward"),
        "{out}"
    );
    assert!(
        out.contains("note        no route to the endpoint 10.244.2.2"),
        "{out}"
    );
    // Only the endpoint without a route is named.
    assert!(
        !out.contains("no route to the endpoint 10.244.1.2"),
        "{out}"
    );
    c.break_service_dispatch_by_hand();
    let (out, code) = trace(&c, mode, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("passed on untranslated"), "{out}");
    assert!(
        out.contains("note        the kernel differs from what the proxy would program"),
        "{out}"
    );
}

#[test]
fn the_flat_nftables_tables_trace_as_the_proxy_programs_them() {
    the_kernels_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes(Mode::Nftables);
}

#[test]
fn the_kube_proxy_layouts_tables_trace_as_the_proxy_programs_them() {
    the_kernels_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes(
        Mode::NftablesKubeProxy,
    );
}

#[test]
fn iptables_rules_trace_as_the_proxy_programs_them_and_a_broken_kernel_is_told_apart() {
    the_kernels_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes(Mode::Iptables);
}

#[test]
fn the_ebpf_modes_pinned_maps_trace_as_the_proxy_programs_them() {
    the_kernels_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes(Mode::Ebpf);
}

#[test]
fn the_ebpf_mode_without_pinned_maps_cannot_be_traced_and_exits_3() {
    let empty = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .args([
            "trace",
            "--rules",
            "kernel",
            "--proxy-mode",
            "ebpf",
            "-f",
            "-",
        ])
        .arg("--ebpf-pin-root")
        .arg(empty.path())
        .args(["--from", "192.0.2.1", "--to", "192.0.2.10:80/tcp"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "--rules kernel: reading the ebpf mode's maps pinned under {}: eBPF map np_services",
            empty.path().display()
        )),
        "{stderr}"
    );
}
