//! `nodeport trace --live` on a node a real `nodeport proxy` programmed (nftables, in network
//! namespaces), with real packets from the client: the explanation printed for a real packet
//! equals `--rules kernel`'s for the same packet, and the offline trace's (`-f` with render's
//! flags) in both nftables layouts, the endpoint named is the one that answered,
//! a reject and a drop in another table are seen where they happen, two traces at once each
//! report only their own packets, and the tracer's table is gone after a normal exit, Ctrl-C
//! and SIGKILL.

mod proxy_support;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nodeport_testbed::{Netns, require_tools};
use proxy_support::*;

/// A running `nodeport trace --live`, killed (by PID) if the test ends before it does.
struct LiveTrace {
    child: Option<Child>,
    /// What it printed before the test went on, and its stdout from there (the ebpf
    /// mode's start).
    head: String,
    reader: Option<std::io::BufReader<std::process::ChildStdout>>,
}

impl LiveTrace {
    /// Starts it inside the node with `args` (objects from the node's API server) and waits
    /// until its table is in the kernel.
    fn start(node: &Netns, args: &[&str]) -> LiveTrace {
        let mut all = vec![
            "--master",
            "http://127.0.0.1:6443",
            "--node-name",
            "node-a",
            "--cluster-cidr",
            "10.244.0.0/16",
        ];
        all.extend_from_slice(args);
        Self::start_alone(node, &all)
    }

    /// [`LiveTrace::start`] with `args` only: without objects, named from the kernel.
    fn start_alone(node: &Netns, args: &[&str]) -> LiveTrace {
        let before = trace_tables(node).len();
        let child = node
            .command(env!("CARGO_BIN_EXE_nodeport"))
            .args(["trace", "--live"])
            .args(args)
            .env("NODEPORT_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut t = LiveTrace {
            child: Some(child),
            head: String::new(),
            reader: None,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while trace_tables(node).len() <= before {
            if let Some(status) = t.child.as_mut().unwrap().try_wait().unwrap() {
                let (out, err) = t.output();
                panic!("trace --live ended early ({status}): {out}{err}");
            }
            assert!(Instant::now() < deadline, "no tracer table appeared");
            std::thread::sleep(Duration::from_millis(50));
        }
        // `nft` reads the tracer's rules back: every `nft -f` of the proxy (which lists the
        // ruleset into its cache first) keeps working beside them.
        let listed = node
            .command("nft")
            .args(["list", "ruleset"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&listed.stderr);
        // (nft warns about iptables-nft's tables, and this nft, built without xtables, says
        // it cannot print their targets; anything else is an error.)
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|l| !(l.starts_with("# Warning: table ") && l.ends_with("do not touch!")))
            .filter(|l| !(l.starts_with("XT ") && l.ends_with(" not found")))
            .collect();
        assert!(
            listed.status.success() && errors.is_empty(),
            "nft list ruleset: {stderr}"
        );
        t
    }

    /// Starts it in the ebpf mode (objects from the node's API server, the maps under the
    /// proxy's pin root) and waits until it has read the maps (its `live` line).
    fn start_ebpf(c: &Cluster, args: &[&str]) -> LiveTrace {
        use std::io::BufRead;
        let mut child = c
            .node
            .command(env!("CARGO_BIN_EXE_nodeport"))
            .args(["trace", "--live", "--master", "http://127.0.0.1:6443"])
            .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
            .arg("--ebpf-pin-root")
            .arg(&c.ebpf.as_ref().expect("an ebpf cluster").pin_root)
            .args(args)
            .env("NODEPORT_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut head = String::new();
        while !head.lines().any(|l| l.starts_with("live ")) {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap() == 0 {
                let mut err = String::new();
                child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                panic!("trace --live ended early: {head}{err}");
            }
            head.push_str(&line);
        }
        LiveTrace {
            child: Some(child),
            head,
            reader: Some(reader),
        }
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    fn output(&mut self) -> (String, String) {
        let child = self.child.as_mut().unwrap();
        let mut out = std::mem::take(&mut self.head);
        let mut err = String::new();
        if let Some(mut r) = self.reader.take() {
            r.read_to_string(&mut out).unwrap();
        }
        if let Some(mut s) = child.stdout.take() {
            s.read_to_string(&mut out).unwrap();
        }
        if let Some(mut s) = child.stderr.take() {
            s.read_to_string(&mut err).unwrap();
        }
        (out, err)
    }

    /// Waits for it to end: (stdout, stderr, exit code).
    fn finish(mut self) -> (String, String, Option<i32>) {
        let (out, err) = self.output();
        let status = self.child.take().unwrap().wait().unwrap();
        (out, err, status.code())
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), signal).unwrap();
    }
}

impl Drop for LiveTrace {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The tracers' tables in the node's kernel.
fn trace_tables(node: &Netns) -> Vec<String> {
    node.run(&["nft", "list", "tables"])
        .unwrap()
        .lines()
        .filter(|l| l.contains("nodeport-trace-"))
        .map(str::to_string)
        .collect()
}

/// Polls until no tracer table is left (the kernel removes an owner's table when its socket
/// closes, as the process ends).
fn no_table_left(node: &Netns, after: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !trace_tables(node).is_empty() {
        assert!(
            Instant::now() < deadline,
            "{after}: table(s) left behind: {:?}",
            trace_tables(node)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `nodeport trace --rules kernel` of one packet: its explanation lines.
fn kernel_trace(c: &Cluster, from: &str, to: &str) -> Vec<String> {
    let out = c
        .node
        .command(env!("CARGO_BIN_EXE_nodeport"))
        .args([
            "trace",
            "--rules",
            "kernel",
            "--master",
            "http://127.0.0.1:6443",
        ])
        .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
        .args(["--from", from, "--to", to])
        .env("NODEPORT_LOG", "error")
        .output()
        .unwrap();
    explanation(&String::from_utf8_lossy(&out.stdout))
}

/// The explanation lines of a trace (the `packet` line without its interface), without the
/// `rules`, `live`, `path` and `seen` lines.
fn explanation(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| {
            !["rules ", "live ", "path ", "seen "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .map(|l| match l.split_once(", on ") {
            Some((head, _)) if l.starts_with("packet ") => head.to_string(),
            _ => l.to_string(),
        })
        .collect()
}

fn seen(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.starts_with("seen ")).collect()
}

#[test]
fn real_packets_are_traced_named_by_conntrack_and_the_tracers_table_never_outlives_it() {
    if !require_tools(
        "real_packets_are_traced_named_by_conntrack_and_the_tracers_table_never_outlives_it",
        &["kubectl", "nft"],
    ) {
        return;
    }
    let c = Cluster::start(Mode::Nftables, &[]);
    c.apply(&service_yaml("web", 30080, "", &[1, 2, 3]))
        .unwrap();
    c.apply(&service_yaml("empty", 30090, "", &[])).unwrap();
    let web = format!("{NODE_IP}:30080");
    eventually(&c.client, &web, "the NodePort answers", |r| {
        matches!(r, Reply::Pod { .. })
    });
    let empty = format!("{NODE_IP}:30090");
    eventually(&c.client, &empty, "the empty Service is refused", |r| {
        *r == Reply::Refused
    });

    // One real connection: explained as the kernel's rules explain that packet, its path
    // through the proxy's chains, and the endpoint conntrack names is the pod that answered.
    let t = LiveTrace::start(
        &c.node,
        &[
            "--to",
            ":30080/tcp",
            "--from",
            "192.0.2.0/24",
            "--timeout",
            "20s",
        ],
    );
    let reply = get(&c.client, &web, Duration::from_secs(3));
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    let Reply::Pod { pod, client } = reply else {
        panic!("{reply:?}")
    };
    let n = pod.trim_start_matches("pod");
    assert_eq!(
        explanation(&out),
        kernel_trace(&c, CLIENT_IP, &format!("{web}/tcp")),
        "{out}"
    );
    assert!(
        out.contains("(input path), on eth0"),
        "the interface the packet came in on: {out}"
    );
    assert!(out.contains("path        ip kube-proxy "), "{out}");
    assert_eq!(
        seen(&out),
        [format!(
            "seen        DNAT to 10.244.{n}.2:8080 (conntrack), masqueraded to 10.244.{n}.1; it answered"
        )
        .as_str()],
        "{out}"
    );
    // The source the pod saw is the one conntrack names.
    assert!(client.starts_with(&format!("10.244.{n}.1")), "{client}");
    no_table_left(&c.node, "a normal exit");

    // The same as one JSON object (docs/TRACE.md's schema).
    let t = LiveTrace::start(
        &c.node,
        &[
            "--to",
            &format!("{web}/tcp"),
            "--timeout",
            "20s",
            "-o",
            "json",
        ],
    );
    let reply = get(&c.client, &web, Duration::from_secs(3));
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    let Reply::Pod { pod, .. } = reply else {
        panic!("{reply:?}")
    };
    let n = pod.trim_start_matches("pod");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["rules"], "live", "{out}");
    assert_eq!(v["mode"], "nftables", "{out}");
    assert!(
        v["table"].as_str().unwrap().starts_with("nodeport-trace-"),
        "{out}"
    );
    let p = &v["packets"][0];
    assert_eq!(p["packet"]["from"], CLIENT_IP, "{out}");
    assert_eq!(p["service"]["port"], "default/web:80/TCP", "{out}");
    assert_eq!(p["seen"]["verdict"], "dnat", "{out}");
    assert_eq!(p["seen"]["reason"], "endpoint", "{out}");
    assert_eq!(p["seen"]["endpoint"], format!("10.244.{n}.2:8080"), "{out}");
    assert_eq!(p["seen"]["answered"], true, "{out}");
    assert_eq!(p["path"][0]["table"], "kube-proxy", "{out}");
    assert!(p["source_port"].as_u64().unwrap() > 0, "{out}");
    no_table_left(&c.node, "-o json");

    // A reject by the proxy's rules: seen in its chain, in the Service's words; exit 1.
    let t = LiveTrace::start(
        &c.node,
        &["--to", &format!("{empty}/tcp"), "--timeout", "20s"],
    );
    assert_eq!(
        get(&c.client, &empty, Duration::from_secs(3)),
        Reply::Refused
    );
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    let seen_line = seen(&out).join("\n");
    assert!(
        seen_line.starts_with(
            "seen        reject: default/empty:80/TCP has no endpoints (at ip kube-proxy "
        ),
        "{out}"
    );

    // A drop by another table (a forward filter of the node's own) is told apart from the
    // proxy's rules.
    c.node
        .run_with_stdin(
            &["nft", "-f", "-"],
            format!(
                "table inet site {{\n chain forward {{\n type filter hook forward priority 0;\n \
                 ip saddr {CLIENT2_IP} tcp dport 8080 drop\n }}\n}}\n"
            )
            .as_bytes(),
        )
        .unwrap();
    let t = LiveTrace::start(&c.node, &["--to", ":30080/tcp", "--timeout", "20s"]);
    assert_eq!(
        get(&c.client2, &web, Duration::from_millis(1500)),
        Reply::Timeout
    );
    let (out, err, code) = t.finish();
    c.node
        .run(&["nft", "delete", "table", "inet", "site"])
        .unwrap();
    assert_eq!(code, Some(1), "{out}{err}");
    assert_eq!(
        seen(&out),
        [
            "seen        drop by table inet site, not by the proxy's rules (at inet site forward rule 2: drop)"
        ],
        "{out}"
    );
    // What the proxy's rules did before: the DNAT.
    assert!(out.contains("path        ip kube-proxy "), "{out}");

    // Two traces at once: each reports its own packets only (the second one's source).
    let mine = LiveTrace::start(
        &c.node,
        &[
            "--to",
            ":30080/tcp",
            "--from",
            CLIENT_IP,
            "--timeout",
            "20s",
        ],
    );
    let any = LiveTrace::start(
        &c.node,
        &["--to", ":30080/tcp", "--count", "2", "--timeout", "20s"],
    );
    assert_eq!(trace_tables(&c.node).len(), 2);
    assert!(matches!(
        get(&c.client2, &web, Duration::from_secs(3)),
        Reply::Pod { .. }
    ));
    assert!(matches!(
        get(&c.client, &web, Duration::from_secs(3)),
        Reply::Pod { .. }
    ));
    let (out, err, code) = mine.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    let packets: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("live        packet"))
        .collect();
    assert_eq!(packets.len(), 1, "{out}");
    assert!(
        packets[0].contains(&format!(": {CLIENT_IP} → {web}/tcp")),
        "{out}"
    );
    let (out, err, code) = any.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    let packets: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("live        packet"))
        .collect();
    assert_eq!(packets.len(), 2, "{out}");
    assert!(packets[0].contains(&format!(": {CLIENT2_IP} → ")), "{out}");
    assert!(packets[1].contains(&format!(": {CLIENT_IP} → ")), "{out}");
    // The other tracer's table is not part of a path.
    assert!(!out.contains("path        inet nodeport-trace-"), "{out}");
    no_table_left(&c.node, "two traces");

    // Ctrl-C ends the trace as its timeout would, with 130 as a shell reports it (also when
    // the trace was started with SIGINT ignored, as a background job is: it handles the signal
    // itself); SIGKILL: the kernel removes the table with the process's socket.
    let t = LiveTrace::start(&c.node, &["--to", ":30080/tcp", "--timeout", "60s"]);
    let asked = Instant::now();
    t.signal(nix::sys::signal::Signal::SIGINT);
    let (_, err, code) = t.finish();
    assert_eq!(code, Some(130), "ended by the signal: {err}");
    assert!(err.contains("interrupted by SIGINT"), "{err}");
    assert!(
        asked.elapsed() < Duration::from_secs(30),
        "the trace ended at Ctrl-C, not at its 60 s timeout"
    );
    no_table_left(&c.node, "Ctrl-C");
    let t = LiveTrace::start(&c.node, &["--to", ":30080/tcp", "--timeout", "60s"]);
    t.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = t.finish();
    no_table_left(&c.node, "SIGKILL");

    // No packet within the timeout: nothing to trace, exit 3.
    let t = LiveTrace::start(&c.node, &["--to", ":30099/tcp", "--timeout", "300ms"]);
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(
        err.contains("no new connection to :30099/tcp from any source within 300ms"),
        "{err}"
    );
    no_table_left(&c.node, "a timeout");
}

/// `nodeport trace -f <objects> <render's flags>` of one packet, offline (no kernel, no
/// server, outside the node): its explanation lines.
fn offline_trace(
    objects: &std::path::Path,
    render_flags: &[&str],
    from: &str,
    to: &str,
) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .arg("trace")
        .arg("-f")
        .arg(objects)
        .args(render_flags)
        .args(["--from", from, "--to", to])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("rules       nftables ("),
        "offline, as `nodeport render` programs them: {stdout}"
    );
    explanation(&stdout)
}

/// `nodeport trace -f <objects> <render's flags> -o json` of one packet, offline.
fn offline_json(
    objects: &std::path::Path,
    render_flags: &[&str],
    from: &str,
    to: &str,
) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .arg("trace")
        .arg("-f")
        .arg(objects)
        .args(render_flags)
        .args(["--from", from, "--to", to, "-o", "json"])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `nodeport trace --rules kernel -o json` of one packet inside the node.
fn kernel_json(c: &Cluster, from: &str, to: &str) -> serde_json::Value {
    let out = c
        .node
        .command(env!("CARGO_BIN_EXE_nodeport"))
        .args([
            "trace",
            "--rules",
            "kernel",
            "--master",
            "http://127.0.0.1:6443",
        ])
        .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
        .args(["--from", from, "--to", to, "-o", "json"])
        .env("NODEPORT_LOG", "error")
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

fn names(p: &[Named]) -> Vec<String> {
    p.iter().map(|(n, _)| n.clone()).collect()
}

/// A path step as a live and a traced path both name it (`ip kube-proxy services: jump
/// nodeport-cluster-policy (default/web:80/TCP)`), and its rule's handle. Left out: the
/// rule's place (a traced path's `rule #6`; a live one names the handle only) and the
/// elements a rule matched (nftrace names rules, not elements).
type Named = (String, Option<u64>);

/// The steps of a live trace's `path` lines whose `family table` is `at` (`ip kube-proxy`).
fn live_path(out: &str, at: &str) -> Vec<Named> {
    out.lines()
        .filter_map(|l| l.strip_prefix("path        "))
        .filter_map(|l| l.strip_prefix(at)?.strip_prefix(' '))
        .map(|l| {
            let (head, rest) = l.split_once(": ").expect("a path line");
            let (chain, handle) = match head.split_once(" rule ") {
                Some((chain, h)) => (chain, Some(h.parse().expect("a rule handle"))),
                None => (head, None),
            };
            (format!("{at} {chain}: {rest}"), handle)
        })
        .collect()
}

/// The steps of a traced path (`-o json`) whose `family table` is `at`, the random choice's
/// candidate for `endpoint` in its place.
fn traced_path(v: &serde_json::Value, endpoint: Option<&str>, at: &str) -> Vec<Named> {
    let mut out = Vec::new();
    for s in v.as_array().expect("a path") {
        if s["kind"] == "choice" {
            let candidates = s["candidates"].as_array().unwrap();
            let c = candidates
                .iter()
                .find(|c| endpoint.is_some() && c["endpoint"].as_str() == endpoint)
                .unwrap_or_else(|| panic!("no candidate to {endpoint:?}: {s}"));
            out.extend(traced_path(&c["path"], endpoint, at));
            continue;
        }
        let here = format!(
            "{} {}",
            s["family"].as_str().unwrap(),
            s["table"].as_str().unwrap()
        );
        if here != at {
            continue;
        }
        let verdict = s["verdict"].as_str().unwrap();
        let what = match s["kind"].as_str().unwrap() {
            "policy" => format!("policy {verdict}"),
            _ => verdict.to_string(),
        };
        let service = s["service"]
            .as_str()
            .map_or_else(String::new, |l| format!(" ({l})"));
        out.push((
            format!(
                "{} {} {}: {what}{service}",
                s["family"].as_str().unwrap(),
                s["table"].as_str().unwrap(),
                s["chain"].as_str().unwrap()
            ),
            s["rule_handle"].as_u64(),
        ));
    }
    out
}

/// The issue's test: real packets in the nftables mode, in both layouts, traced live; each
/// printed explanation equals the offline trace (`-f` with the objects and `render`'s flags,
/// the proxy's own) of the same packet: a NodePort DNATed to one of three pods, a Service
/// without endpoints (rejected), `externalTrafficPolicy: Local` without a local endpoint
/// (dropped), a pod to a ClusterIP, the node itself to a NodePort without endpoints
/// (rejected on its way back in through loopback). So does its path, step for step through the proxy's
/// table: the offline trace's (its random choice taken as conntrack says the packet took
/// it), and `--rules kernel`'s down to each rule's handle. (Where they cannot agree: nftrace
/// names rules, not the elements they matched; an offline trace names a rule by its place,
/// not the kernel's handle.) And no trace table is left after Ctrl-C or SIGKILL, in either
/// layout.
#[test]
fn live_traces_of_real_packets_equal_the_offline_trace_of_the_same_packet_in_both_nftables_layouts()
{
    if !require_tools(
        "live_traces_of_real_packets_equal_the_offline_trace_of_the_same_packet_in_both_nftables_layouts",
        &["kubectl", "nft"],
    ) {
        return;
    }
    for (mode, layout) in [
        (Mode::Nftables, "flat"),
        (Mode::NftablesKubeProxy, "kube-proxy"),
    ] {
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
        eventually(
            &c.client,
            &format!("{NODE_IP}:30090"),
            "the empty Service is refused",
            |r| *r == Reply::Refused,
        );
        eventually(
            &c.client,
            &format!("{NODE_IP}:30070"),
            "the Local Service without a local endpoint drops",
            |r| *r == Reply::Timeout,
        );
        // The objects as the API server holds them, and the proxy's flags as render's.
        let dir = tempfile::tempdir().unwrap();
        let objects = dir.path().join("objects.yaml");
        let listed = c
            .kubectl(&["get", "svc,endpointslices,nodes", "-A", "-o", "yaml"])
            .unwrap();
        std::fs::write(&objects, listed).unwrap();
        let render_flags = [
            "--proxy-mode",
            "nftables",
            "--nftables-layout",
            layout,
            "--node-name",
            "node-a",
            "--cluster-cidr",
            "10.244.0.0/16",
        ];
        let web_ip = c.cluster_ip("web");
        // (who sends, from, to, what it gets, the exit code)
        type Case<'a> = (&'a Netns, &'a str, String, fn(&Reply) -> bool, i32);
        let cases: [Case<'_>; 5] = [
            (
                &c.client,
                CLIENT_IP,
                web.clone(),
                |r| matches!(r, Reply::Pod { .. }),
                0,
            ),
            (
                &c.client,
                CLIENT_IP,
                format!("{NODE_IP}:30090"),
                |r| *r == Reply::Refused,
                1,
            ),
            (
                &c.client,
                CLIENT_IP,
                format!("{NODE_IP}:30070"),
                |r| *r == Reply::Timeout,
                1,
            ),
            (
                &c.pods[2],
                "10.244.3.2",
                format!("{web_ip}:80"),
                |r| matches!(r, Reply::Pod { .. }),
                0,
            ),
            // The node's own connection to its NodePort without endpoints: out untranslated,
            // rejected on its way back in through loopback.
            (
                &c.node,
                NODE_IP,
                format!("{NODE_IP}:30090"),
                |r| *r == Reply::Refused,
                1,
            ),
        ];
        for (client, from, to, want, exit) in cases {
            let to_tcp = format!("{to}/tcp");
            let t = LiveTrace::start(
                &c.node,
                &["--to", &to_tcp, "--from", from, "--timeout", "20s"],
            );
            let got = get(client, &to, Duration::from_millis(1500));
            let (out, err, code) = t.finish();
            assert!(want(&got), "{layout}: {from} → {to}: {got:?}\n{out}{err}");
            assert_eq!(code, Some(exit), "{layout}: {from} → {to}: {out}{err}");
            assert!(
                out.starts_with(&format!(
                    "rules       nftables, as this node's kernel holds them (nft -j list table ip/ip6 kube-proxy, the {layout} layout)"
                )),
                "{out}"
            );
            // The path names the Service's own steps: the flat layout's rules that found its
            // elements (its NodePort's policy chain, its endpoint map's DNAT), kube-proxy's
            // chains named for it.
            if to == web {
                let named: Vec<&str> = out
                    .lines()
                    .filter(|l| l.starts_with("path ") && l.ends_with(" (default/web:80/TCP)"))
                    .collect();
                let want: &[&str] = if layout == "flat" {
                    &["path        ip kube-proxy pick-nodeport-endpoints rule "]
                } else {
                    &[
                        "path        ip kube-proxy services rule ",
                        "path        ip kube-proxy endpoint-",
                    ]
                };
                for w in want {
                    assert!(named.iter().any(|l| l.starts_with(w)), "{w}: {out}");
                }
                assert!(
                    named
                        .iter()
                        .all(|l| l.starts_with("path        ip kube-proxy ")),
                    "{out}"
                );
            }
            let offline = offline_trace(&objects, &render_flags, from, &to_tcp);
            assert!(
                offline.iter().any(|l| l.starts_with("fate ")),
                "{offline:?}"
            );
            assert_eq!(
                explanation(&out),
                offline,
                "{layout}: {from} → {to}: the live trace, then the offline one"
            );
            // The path: the live one through the proxy's table, step for step the offline
            // trace's for the endpoint conntrack names, and the kernel trace's with the
            // same rule handles.
            let endpoint = seen(&out).first().and_then(|l| {
                let rest = l.split_once("DNAT to ")?.1;
                Some(rest.split_once(' ')?.0.to_string())
            });
            let live = live_path(&out, "ip kube-proxy");
            assert!(live.len() > 3, "{out}");
            let offline = traced_path(
                &offline_json(&objects, &render_flags, from, &to_tcp)["path"],
                endpoint.as_deref(),
                "ip kube-proxy",
            );
            assert_eq!(
                names(&live),
                names(&offline),
                "{layout}: {from} → {to}: the live path, then the offline one\n{out}"
            );
            let kernel = traced_path(
                &kernel_json(&c, from, &to_tcp)["path"],
                endpoint.as_deref(),
                "ip kube-proxy",
            );
            assert_eq!(
                live, kernel,
                "{layout}: {from} → {to}: the live path, then --rules kernel's\n{out}"
            );
        }
        // Ctrl-C and SIGKILL: the kernel removes the tracer's table with its socket.
        for signal in [
            nix::sys::signal::Signal::SIGINT,
            nix::sys::signal::Signal::SIGKILL,
        ] {
            let t = LiveTrace::start(&c.node, &["--to", ":30080/tcp", "--timeout", "60s"]);
            assert_eq!(trace_tables(&c.node).len(), 1, "{layout}");
            t.signal(signal);
            let (_, err, code) = t.finish();
            let want = if signal == nix::sys::signal::Signal::SIGINT {
                Some(130)
            } else {
                None
            };
            assert_eq!(code, want, "{layout} {signal}: {err}");
            no_table_left(&c.node, &format!("{layout}, {signal}"));
        }
    }
}

#[test]
fn live_rejects_a_cidr_of_the_other_family_and_a_bad_timeout_as_usage_errors() {
    for (args, want) in [
        (
            vec!["--to", "192.0.2.10:80/tcp", "--from", "2001:db8::/64"],
            "are not of the same IP family",
        ),
        (
            vec!["--to", ":80/tcp", "--timeout", "soon"],
            "invalid value \"soon\" for --timeout",
        ),
        (vec!["--to", ":0/tcp"], "invalid value \":0/tcp\" for --to"),
        (
            vec!["--to", ":80/tcp", "--from", "10.0.0.0/33"],
            "for --from",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
            .args(["trace", "--live", "-f", "-", "--proxy-mode", "nftables"])
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

#[test]
fn in_the_iptables_mode_iptables_nft_chains_are_traced_live_as_the_kernels_rules_explain() {
    if !require_tools(
        "in_the_iptables_mode_iptables_nft_chains_are_traced_live_as_the_kernels_rules_explain",
        &["kubectl", "nft", "iptables-nft-save"],
    ) {
        return;
    }
    let c = Cluster::start(Mode::Iptables, &["--iptables-variant", "nft"]);
    c.apply(&service_yaml("web", 30080, "", &[2])).unwrap();
    let web = format!("{NODE_IP}:30080");
    eventually(&c.client, &web, "the NodePort answers", |r| {
        matches!(r, Reply::Pod { .. })
    });
    let t = LiveTrace::start(
        &c.node,
        &["--to", &format!("{web}/tcp"), "--timeout", "20s"],
    );
    assert!(matches!(
        get(&c.client, &web, Duration::from_secs(3)),
        Reply::Pod { .. }
    ));
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(
        explanation(&out),
        kernel_trace(&c, CLIENT_IP, &format!("{web}/tcp")),
        "{out}"
    );
    // iptables-nft's chains, in the nf_tables tables `ip nat` and `ip filter`.
    assert!(
        out.contains("path        ip nat KUBE-NODEPORTS rule "),
        "{out}"
    );
    // The Service's own chains are named for it.
    let named = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| l.ends_with(" (default/web:80/TCP)"))
            .map(|l| l.split_whitespace().nth(3).unwrap_or("").to_string())
            .collect()
    };
    let chains = named(&out);
    for prefix in ["KUBE-NODEPORTS", "KUBE-EXT-", "KUBE-SVC-", "KUBE-SEP-"] {
        assert!(
            chains.iter().any(|c| c.starts_with(prefix)),
            "{prefix}: {out}"
        );
    }
    assert!(chains.iter().all(|c| c.starts_with("KUBE-")), "{out}");
    // The path, step for step through iptables-nft's tables, is the kernel trace's
    // (iptables-save names no handles: rules are compared without them).
    let kernel = kernel_json(&c, CLIENT_IP, &format!("{web}/tcp"));
    for at in ["ip nat", "ip filter"] {
        let live = live_path(&out, at);
        assert!(!live.is_empty(), "{at}: {out}");
        assert_eq!(
            names(&live),
            names(&traced_path(&kernel["path"], Some("10.244.2.2:8080"), at)),
            "{at}: the live path, then --rules kernel's\n{out}"
        );
    }
    // Without objects, the rules' comments name the same Service and chains.
    let t = LiveTrace::start_alone(
        &c.node,
        &["--to", &format!("{web}/tcp"), "--timeout", "20s"],
    );
    assert!(matches!(
        get(&c.client, &web, Duration::from_secs(3)),
        Reply::Pod { .. }
    ));
    let (alone, err, code) = t.finish();
    assert_eq!(code, Some(0), "{alone}{err}");
    assert!(
        alone.contains("names from the kernel (its rules' comments)"),
        "{alone}"
    );
    assert_eq!(named(&alone), chains, "{alone}");
    assert_eq!(
        seen(&out),
        ["seen        DNAT to 10.244.2.2:8080 (conntrack), masqueraded to 10.244.2.1; it answered"],
        "{out}"
    );
    no_table_left(&c.node, "a normal exit");
}

#[test]
fn with_iptables_legacy_live_says_it_cannot_and_traces_the_packet_through_the_kernels_rules() {
    if !require_tools(
        "with_iptables_legacy_live_says_it_cannot_and_traces_the_packet_through_the_kernels_rules",
        &["kubectl", "iptables-legacy-save"],
    ) {
        return;
    }
    let c = Cluster::start(Mode::Iptables, &["--iptables-variant", "legacy"]);
    c.apply(&service_yaml("web", 30080, "", &[2])).unwrap();
    let web = format!("{NODE_IP}:30080");
    eventually(&c.client, &web, "the NodePort answers", |r| {
        matches!(r, Reply::Pod { .. })
    });
    let live = |args: &[&str]| {
        c.node
            .command(env!("CARGO_BIN_EXE_nodeport"))
            .args(["trace", "--live", "--master", "http://127.0.0.1:6443"])
            .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
            .args(args)
            .env("NODEPORT_LOG", "error")
            .output()
            .unwrap()
    };
    let to = format!("{web}/tcp");
    let out = live(&["--from", CLIENT_IP, "--to", &to]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stderr.contains("--live is not possible with iptables-legacy"),
        "{stderr}"
    );
    assert_eq!(
        explanation(&stdout),
        kernel_trace(&c, CLIENT_IP, &to),
        "{stdout}"
    );
    assert!(trace_tables(&c.node).is_empty());
    // Without one packet to trace instead: exit 3, saying what to give.
    let out = live(&["--to", ":30080/tcp"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("give --from ADDR and --to ADDR:PORT/PROTO"),
        "{stderr}"
    );
}

/// `nodeport trace --rules kernel` with the proxy's `--nodeport-addresses`: (stdout, code).
fn kernel_verdict(c: &Cluster, extra: &[&str], from: &str, to: &str) -> (String, Option<i32>) {
    let out = c
        .node
        .command(env!("CARGO_BIN_EXE_nodeport"))
        .args([
            "trace",
            "--rules",
            "kernel",
            "--master",
            "http://127.0.0.1:6443",
        ])
        .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
        .args(extra)
        .args(["--from", from, "--to", to])
        .env("NODEPORT_LOG", "error")
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.code(),
    )
}

/// The end-to-end suite's connections that get no answer (`proxy_end_to_end`: a Service
/// without endpoints, `externalTrafficPolicy: Local` without a local endpoint, an address
/// `--nodeport-addresses` leaves out, a client outside `loadBalancerSourceRanges`, an
/// unallocated ClusterIP of an added ServiceCIDR), each met by a real client, then traced:
/// the kernel's rules name the cause, and a live trace of a real packet sees it happen there.
#[test]
fn every_unanswered_connection_of_the_end_to_end_suite_is_explained_with_its_cause() {
    if !require_tools(
        "every_unanswered_connection_of_the_end_to_end_suite_is_explained_with_its_cause",
        &["kubectl", "nft"],
    ) {
        return;
    }
    let flags = ["--nodeport-addresses", "192.0.2.0/24"];
    let c = Cluster::start(Mode::Nftables, &flags);
    c.apply(&service_yaml("empty", 30090, "", &[])).unwrap();
    c.apply(&service_yaml(
        "local",
        30081,
        "  externalTrafficPolicy: Local",
        &[2],
    ))
    .unwrap();
    c.apply(&service_yaml("web", 30084, "", &[1])).unwrap();
    let lb = service_yaml(
        "lb",
        30085,
        &format!("  loadBalancerSourceRanges: [{CLIENT_IP}/32]"),
        &[1, 2, 3],
    )
    .replace("type: NodePort", "type: LoadBalancer");
    c.apply(&lb).unwrap();
    c.kubectl(&[
        "patch",
        "svc",
        "lb",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"loadBalancer":{"ingress":[{"ip":"192.0.2.200"}]}}}"#,
    ])
    .unwrap();
    c.apply(
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: more}\nspec: {cidrs: [10.97.0.0/24]}\n",
    )
    .unwrap();
    let more = service_yaml("more", 30130, "", &[1]).replace(
        "  type: NodePort\n",
        "  type: NodePort\n  clusterIP: 10.97.0.10\n",
    );
    c.apply(&more).unwrap();
    eventually(
        &c.client,
        "192.0.2.200:80",
        "the listed client reaches the VIP",
        |r| matches!(r, Reply::Pod { .. }),
    );
    eventually(
        &c.pods[2],
        "10.97.0.10:80",
        "the added range answers",
        |r| matches!(r, Reply::Pod { .. }),
    );
    eventually(
        &c.client,
        &format!("{NODE_IP}:30090"),
        "the empty Service is refused",
        |r| *r == Reply::Refused,
    );

    let pod3 = "10.244.3.2";
    let short = Duration::from_millis(1500);
    // (client, its address, destination, what it gets, the cause traced, live: where seen)
    type Case<'a> = (&'a Netns, &'a str, String, Reply, &'a str, Option<&'a str>);
    let cases: [Case<'_>; 4] = [
        (
            &c.client,
            CLIENT_IP,
            format!("{NODE_IP}:30090"),
            Reply::Refused,
            "fate        reject: default/empty:80/TCP has no endpoints",
            Some("seen        reject: default/empty:80/TCP has no endpoints (at ip kube-proxy "),
        ),
        (
            &c.client,
            CLIENT_IP,
            format!("{NODE_IP}:30081"),
            Reply::Timeout,
            "fate        drop: externalTrafficPolicy Local and default/local:80/TCP has no endpoint on this node",
            Some(
                "seen        drop: externalTrafficPolicy Local and default/local:80/TCP has no endpoint on this node (at ip kube-proxy ",
            ),
        ),
        (
            &c.client,
            CLIENT_IP,
            format!("{NODE_IP2}:30084"),
            Reply::Refused,
            "fate        not a NodePort address: 198.51.100.10 is not selected by --nodeport-addresses 192.0.2.0/24, so NodePort 30084 of default/web:80/TCP does not answer there",
            // No rule of the proxy touches it: the node's own stack refuses it, with a reset
            // (which ends the connection's conntrack entry at once) the live trace sees.
            Some(
                "seen        passed on untranslated, not masqueraded; refused: 198.51.100.10 \
                 answered with a TCP reset (nothing listens on that port there",
            ),
        ),
        (
            &c.client2,
            CLIENT2_IP,
            "192.0.2.200:80".to_string(),
            Reply::Timeout,
            "fate        drop: 192.0.2.101 is not in loadBalancerSourceRanges 192.0.2.100/32 of default/lb:80/TCP",
            Some(
                "seen        drop: 192.0.2.101 is not in loadBalancerSourceRanges 192.0.2.100/32 of default/lb:80/TCP (at ip kube-proxy ",
            ),
        ),
    ];
    for (client, from, to, reply, cause, live) in cases {
        let to_tcp = format!("{to}/tcp");
        let (out, code) = kernel_verdict(&c, &flags, from, &to_tcp);
        assert_eq!(code, Some(1), "{from} → {to}: {out}");
        assert!(out.contains(cause), "{from} → {to}: {out}");
        let Some(seen_line) = live else {
            assert_eq!(get(client, &to, short), reply, "{from} → {to}");
            continue;
        };
        let t = LiveTrace::start(
            &c.node,
            &[
                "--nodeport-addresses",
                "192.0.2.0/24",
                "--to",
                &to_tcp,
                "--timeout",
                "20s",
            ],
        );
        let got = get(client, &to, short);
        let (live_out, err, code) = t.finish();
        assert_eq!(got, reply, "{from} → {to}: {live_out}{err}");
        assert_eq!(code, Some(1), "{from} → {to}: {live_out}{err}");
        assert!(live_out.contains(cause), "{from} → {to}: {live_out}");
        assert!(
            seen(&live_out).iter().any(|l| l.starts_with(seen_line)),
            "{from} → {to}: {live_out}"
        );
    }

    // An unallocated ClusterIP of the added ServiceCIDR: the proxy's rules drop it in the
    // forward hook, but this node has no route to it (no default route), so routing refuses
    // it first, with ICMP network unreachable (or the client times out). The kernel's rules
    // say both; the live trace shows that no forward rule was reached.
    let to = "10.97.0.77:80";
    let (out, code) = kernel_verdict(&c, &flags, pod3, "10.97.0.77:80/tcp");
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("fate        drop: 10.97.0.77 is in the ServiceCIDR 10.97.0.0/24 but no Service has it (an unallocated ClusterIP)"),
        "{out}"
    );
    assert!(
        out.contains("note        no route to 10.97.0.77 on this node: routing refuses the packet (ICMP network unreachable) before any forward rule"),
        "{out}"
    );
    let t = LiveTrace::start(&c.node, &["--to", "10.97.0.77:80/tcp", "--timeout", "20s"]);
    let got = get(&c.pods[2], to, short);
    let (live_out, err, code) = t.finish();
    assert!(!matches!(got, Reply::Pod { .. }), "{got:?}");
    assert_eq!(code, Some(1), "{live_out}{err}");
    assert!(!live_out.contains("filter-forward"), "{live_out}");
    // The node's ICMP error comes back on the connection: the live trace sees the refusal.
    assert_eq!(
        seen(&live_out),
        [
            "seen        accepted by every rule, then refused: this node (10.244.3.1) answered \
             with ICMP network unreachable (code 0) (no route to the address)"
        ],
        "{live_out}"
    );
    // With a route (toward the client), the proxy's drop decides.
    c.node
        .run(&["ip", "route", "add", "10.97.0.0/24", "via", CLIENT_IP])
        .unwrap();
    let (out, _) = kernel_verdict(&c, &flags, pod3, "10.97.0.77:80/tcp");
    assert!(!out.contains("no route"), "{out}");
    let t = LiveTrace::start(&c.node, &["--to", "10.97.0.77:80/tcp", "--timeout", "20s"]);
    let got = get(&c.pods[2], to, short);
    let (live_out, err, code) = t.finish();
    c.node
        .run(&["ip", "route", "del", "10.97.0.0/24", "via", CLIENT_IP])
        .unwrap();
    assert_eq!(got, Reply::Timeout, "{live_out}");
    assert_eq!(code, Some(1), "{live_out}{err}");
    assert!(
        seen(&live_out)[0].starts_with("seen        drop: 10.97.0.77 is in the ServiceCIDR 10.97.0.0/24 but no Service has it (an unallocated ClusterIP) (at ip kube-proxy cluster-ips-check rule "),
        "{live_out}"
    );

    // A load-balancer IP this node has no route to, from a source outside the ranges: the
    // drop in filter-prerouting comes before routing, so no "no route" note (a black-box
    // review saw one, while the client met a silent drop, not ICMP network unreachable).
    c.kubectl(&[
        "patch",
        "svc",
        "lb",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"loadBalancer":{"ingress":[{"ip":"192.0.2.200"},{"ip":"203.0.113.10"}]}}}"#,
    ])
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let out = loop {
        let (out, code) = kernel_verdict(&c, &flags, CLIENT2_IP, "203.0.113.10:80/tcp");
        if code == Some(1)
            && out.contains("fate        drop: 192.0.2.101 is not in loadBalancerSourceRanges")
        {
            break out;
        }
        assert!(std::time::Instant::now() < deadline, "{out}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(!out.contains("no route"), "{out}");
    // A listed client to the same address is translated, and nothing is noted either.
    let (out, code) = kernel_verdict(&c, &flags, CLIENT_IP, "203.0.113.10:80/tcp");
    assert_eq!(code, Some(0), "{out}");
    assert!(!out.contains("no route"), "{out}");

    // The node's own connection to a ClusterIP it has no route to (no default route here)
    // fails at connect(), before the output rules could translate it: the trace says so
    // beside its DNAT, as the node's curl finds out.
    let web_ip = c.cluster_ip("web");
    let (out, _) = kernel_verdict(&c, &flags, NODE_IP, &format!("{web_ip}:80/tcp"));
    assert!(
        out.contains(&format!(
            "note        no route to {web_ip} on this node: the node's own connection fails at \
             connect() (Network is unreachable) before the output rules translate it"
        )),
        "{out}"
    );
    let curl = c
        .node
        .command("curl")
        .args(["-s", "-m", "2", &format!("http://{web_ip}/")])
        .output()
        .unwrap();
    assert_eq!(curl.status.code(), Some(7), "curl: network unreachable");
}

#[test]
fn in_the_ebpf_mode_live_sees_what_the_programs_decide_for_each_new_connection_and_socket() {
    if !require_tools(
        "in_the_ebpf_mode_live_sees_what_the_programs_decide_for_each_new_connection_and_socket",
        &["kubectl", "bpftool"],
    ) {
        return;
    }
    let c = Cluster::start(Mode::Ebpf, &[]);
    c.apply(&service_yaml("web", 30080, "", &[1, 2, 3]))
        .unwrap();
    let web = format!("{NODE_IP}:30080");
    eventually(&c.client, &web, "the NodePort answers", |r| {
        matches!(r, Reply::Pod { .. })
    });
    let t = LiveTrace::start_ebpf(
        &c,
        &[
            "--to",
            ":30080/tcp",
            "--from",
            CLIENT_IP,
            "--timeout",
            "20s",
        ],
    );
    let reply = get(&c.client, &web, Duration::from_secs(3));
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    let Reply::Pod { pod, client } = reply else {
        panic!("{reply:?}")
    };
    let n = pod.trim_start_matches("pod");
    assert!(
        out.contains("as np_tc_ingress and the connect hook record them in np_trace_log"),
        "{out}"
    );
    // The programs' steps.
    assert!(
        out.contains("path        ebpf np_tc_ingress frontend: 192.0.2.10:30080/tcp is default/web:80/TCP (NodePort, frontend "),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "path        ebpf np_tc_ingress backend: 10.244.{n}.2:8080 chosen\n"
        )),
        "{out}"
    );
    // Explained as the kernel's maps explain the same packet.
    let mut kernel = c.node.command(env!("CARGO_BIN_EXE_nodeport"));
    kernel
        .args([
            "trace",
            "--rules",
            "kernel",
            "--master",
            "http://127.0.0.1:6443",
        ])
        .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
        .arg("--ebpf-pin-root")
        .arg(&c.ebpf.as_ref().unwrap().pin_root)
        .args(["--from", CLIENT_IP, "--to", &format!("{web}/tcp")])
        .env("NODEPORT_LOG", "error");
    let kernel = kernel.output().unwrap();
    assert_eq!(
        explanation(&out),
        explanation(&String::from_utf8_lossy(&kernel.stdout)),
        "{out}"
    );
    // The programs' frontend and backend steps are the kernel trace's for the backend they
    // chose (which the trace of the maps cannot name: the source port the SNAT takes, and the
    // steps the programs do not report, the source range it passed and the affinity look-up).
    let kernel_json: serde_json::Value = {
        let mut cmd = c.node.command(env!("CARGO_BIN_EXE_nodeport"));
        cmd.args([
            "trace",
            "--rules",
            "kernel",
            "--master",
            "http://127.0.0.1:6443",
        ])
        .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
        .arg("--ebpf-pin-root")
        .arg(&c.ebpf.as_ref().unwrap().pin_root)
        .args([
            "--from",
            CLIENT_IP,
            "--to",
            &format!("{web}/tcp"),
            "-o",
            "json",
        ])
        .env("NODEPORT_LOG", "error");
        serde_json::from_slice(&cmd.output().unwrap().stdout).unwrap()
    };
    let chosen = format!("10.244.{n}.2:8080");
    let reported = |p: Vec<Named>| -> Vec<Named> {
        p.into_iter()
            .filter(|(l, _)| l.contains(" frontend: ") || l.contains(" backend: "))
            .collect()
    };
    let live = reported(live_path(&out, "ebpf np_tc_ingress"));
    assert_eq!(live.len(), 2, "{out}");
    assert_eq!(
        live,
        reported(traced_path(
            &kernel_json["path"],
            Some(&chosen),
            "ebpf np_tc_ingress"
        )),
        "{out}"
    );
    // The backend the maps name is the pod that answered, and the source it saw.
    let seen_line = seen(&out).join("\n");
    assert!(
        seen_line.starts_with(&format!(
            "seen        DNAT to 10.244.{n}.2:8080 (np_tc_ingress), "
        )),
        "{out}"
    );
    assert!(seen_line.ends_with("; it answered"), "{out}");
    let client_ip = client.split(':').next().unwrap();
    if client_ip == CLIENT_IP {
        assert!(seen_line.contains("not masqueraded"), "{out} ({client})");
    } else {
        assert!(
            seen_line.contains(&format!("masqueraded to {client_ip}")),
            "{out} ({client})"
        );
    }

    // Two traces at once each see the connection (each reads the whole log).
    let one = LiveTrace::start_ebpf(&c, &["--to", ":30080/tcp", "--timeout", "20s"]);
    let two = LiveTrace::start_ebpf(
        &c,
        &[
            "--to",
            &format!("{web}/tcp"),
            "--from",
            CLIENT_IP,
            "--timeout",
            "20s",
        ],
    );
    assert!(matches!(
        get(&c.client, &web, Duration::from_secs(3)),
        Reply::Pod { .. }
    ));
    for t in [one, two] {
        let (out, err, code) = t.finish();
        assert_eq!(code, Some(0), "{out}{err}");
        assert!(
            out.contains(&format!("live        packet 1: {CLIENT_IP} → {web}/tcp")),
            "{out}"
        );
    }

    // What the programs drop or reject, from their trace events: no endpoints (rejected),
    // externalTrafficPolicy Local without a local endpoint (dropped); a retransmitted SYN is
    // one connection.
    c.apply(&service_yaml("empty", 30090, "", &[])).unwrap();
    c.apply(&service_yaml(
        "local",
        30081,
        "  externalTrafficPolicy: Local",
        &[2],
    ))
    .unwrap();
    eventually(
        &c.client,
        &format!("{NODE_IP}:30090"),
        "the empty Service is refused",
        |r| *r == Reply::Refused,
    );
    eventually(
        &c.client,
        &format!("{NODE_IP}:30081"),
        "the Local Service drops",
        |r| *r == Reply::Timeout,
    );
    for (port, want, seen_line) in [
        (
            30090,
            Reply::Refused,
            "seen        reject: default/empty:80/TCP has no endpoints (at ebpf np_tc_ingress)",
        ),
        (
            30081,
            Reply::Timeout,
            "seen        drop: externalTrafficPolicy Local and default/local:80/TCP has no endpoint on this node (at ebpf np_tc_ingress)",
        ),
    ] {
        let t = LiveTrace::start_ebpf(
            &c,
            &[
                "--to",
                &format!(":{port}/tcp"),
                "--count",
                "2",
                "--timeout",
                "4s",
            ],
        );
        let to = format!("{NODE_IP}:{port}");
        assert_eq!(get(&c.client, &to, Duration::from_millis(1500)), want);
        let (out, err, code) = t.finish();
        // One connection within the timeout (the second never comes): exit 1 for the drop.
        assert_eq!(code, Some(1), "{out}{err}");
        assert_eq!(seen(&out), [seen_line], "{out}");
        assert!(
            out.contains("path        ebpf np_tc_ingress verdict: "),
            "{out}"
        );
    }

    // The connect hook: a process on the node connecting to a ClusterIP, translated at
    // connect(), and refused when the Service has no endpoints. Conntrack (which the
    // tracer's nftables table has follow the node's connections) names the socket's real
    // source, the node's address towards the pod, which --from selects by, and whether the
    // pod answered.
    let web_ip = c.cluster_ip("web");
    let t = LiveTrace::start_ebpf(
        &c,
        &[
            "--to",
            &format!("{web_ip}:80/tcp"),
            "--from",
            "10.244.0.0/16",
            "--timeout",
            "20s",
        ],
    );
    let Reply::Pod { pod, client } =
        c.get_in_node_cgroup(&c.node, &format!("{web_ip}:80"), Duration::from_secs(3))
    else {
        panic!("the ClusterIP answers the node's socket")
    };
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    let n = pod.trim_start_matches("pod");
    // The source the pod saw is the one conntrack names, the explanation's too.
    assert!(client.starts_with(&format!("10.244.{n}.1:")), "{client}");
    assert!(
        out.contains(&format!(
            "packet      10.244.{n}.1 → {web_ip}:80/tcp, from this node (output path)"
        )),
        "{out}"
    );
    assert_eq!(
        seen(&out),
        [format!(
            "seen        connected to 10.244.{n}.2:8080 at connect() (np_connect4), from \
             {client} (conntrack); it answered"
        )
        .as_str()],
        "{out}"
    );
    // The tracer withdrew its deadline: the programs report nothing more.
    let until = c
        .node
        .command("bpftool")
        .args(["-j", "map", "lookup", "pinned"])
        .arg(
            c.ebpf
                .as_ref()
                .unwrap()
                .pin_root
                .join("maps/np_trace_until"),
        )
        .args(["key", "0", "0", "0", "0"])
        .output()
        .unwrap();
    let until: serde_json::Value = serde_json::from_slice(&until.stdout).unwrap();
    assert!(
        until["value"]
            .as_array()
            .is_some_and(|v| v.iter().all(|b| b.as_str() == Some("0x00"))),
        "{until}"
    );
    let empty_ip = c.cluster_ip("empty");
    let t = LiveTrace::start_ebpf(
        &c,
        &["--to", &format!("{empty_ip}:80/tcp"), "--timeout", "20s"],
    );
    assert_eq!(
        c.get_in_node_cgroup(&c.node, &format!("{empty_ip}:80"), Duration::from_secs(3)),
        Reply::Refused
    );
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    assert_eq!(
        seen(&out),
        [
            "seen        reject: default/empty:80/TCP has no endpoints: connect() refused with ECONNREFUSED (at ebpf np_connect4)"
        ],
        "{out}"
    );
}

/// A NodePort Service (TCP `node_port` → `tcp_target`, UDP `node_port + 100` → `udp_target`)
/// whose one endpoint is `address` on this node.
fn one_endpoint_yaml(
    name: &str,
    node_port: u16,
    address: &str,
    tcp_target: u16,
    udp_target: u16,
) -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  selector: {{app: {name}}}
  ports:
  - {{name: http, port: 80, targetPort: {tcp_target}, nodePort: {node_port}}}
  - {{name: dns, port: 53, targetPort: {udp_target}, protocol: UDP, nodePort: {udp}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: {tcp_target}}}, {{name: dns, port: {udp_target}, protocol: UDP}}]
endpoints:
- {{addresses: [{address}], nodeName: node-a}}
"#,
        udp = node_port + 100
    )
}

/// An endpoint that does not answer, with real packets: one that drops them silently (a drop
/// rule in the pod's own namespace) and an address no host has are told from one that refuses
/// them (nothing listens: a TCP reset, or for UDP ICMP port unreachable, which the tracer's
/// table marks on their way back and conntrack's id ties to the traced packet).
#[test]
fn an_endpoint_that_does_not_answer_is_told_apart_from_one_that_refuses_with_real_packets() {
    if !require_tools(
        "an_endpoint_that_does_not_answer_is_told_apart_from_one_that_refuses_with_real_packets",
        &["kubectl", "nft"],
    ) {
        return;
    }
    let c = Cluster::start(Mode::Nftables, &[]);
    c.apply(&one_endpoint_yaml(
        "silent",
        30080,
        "10.244.1.2",
        8080,
        5353,
    ))
    .unwrap();
    // Nothing listens on 8081/tcp and 5354/udp in pod1.
    c.apply(&one_endpoint_yaml(
        "closed",
        30081,
        "10.244.1.2",
        8081,
        5354,
    ))
    .unwrap();
    // No host has 10.244.1.9 (on pod1's link).
    c.apply(&one_endpoint_yaml("ghost", 30082, "10.244.1.9", 8080, 5353))
        .unwrap();
    let silent = format!("{NODE_IP}:30080");
    let closed = format!("{NODE_IP}:30081");
    let ghost = format!("{NODE_IP}:30082");
    eventually(&c.client, &silent, "the NodePort answers", |r| {
        matches!(r, Reply::Pod { .. })
    });
    eventually(&c.client, &closed, "the closed port is refused", |r| {
        *r == Reply::Refused
    });
    // From now on pod1 drops what comes to 8080/tcp, answering nothing.
    c.pods[0]
        .run_with_stdin(
            &["nft", "-f", "-"],
            b"table inet silent {\n chain input {\n type filter hook input priority 0;\n \
              tcp dport 8080 drop\n }\n}\n",
        )
        .unwrap();

    // Went nowhere: delivered to the endpoint's link, nothing came back.
    let t = LiveTrace::start(&c.node, &["--to", ":30080/tcp", "--timeout", "20s"]);
    assert_eq!(
        get(&c.client, &silent, Duration::from_millis(1500)),
        Reply::Timeout
    );
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    assert_eq!(
        seen(&out),
        [
            "seen        DNAT to 10.244.1.2:8080 (conntrack), masqueraded to 10.244.1.1; it has \
             not answered within 1s and nothing came back (no TCP reset, no ICMP error): the \
             packet went nowhere after this node sent it out on vpod1; the endpoint, or \
             something between, drops it silently"
        ],
        "{out}"
    );

    // Went nowhere because no host has the address: its neighbour entry says so.
    let t = LiveTrace::start(
        &c.node,
        &["--to", ":30082/tcp", "--timeout", "20s", "-o", "json"],
    );
    assert_eq!(
        get(&c.client, &ghost, Duration::from_millis(1500)),
        Reply::Timeout
    );
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let s = &v["packets"][0]["seen"];
    assert_eq!(s["verdict"], "dnat", "{out}");
    assert_eq!(s["reason"], "not_answering", "{out}");
    assert_eq!(s["endpoint"], "10.244.1.9:8080", "{out}");
    assert_eq!(s["answered"], false, "{out}");
    assert_eq!(s["sent_on"], "vpod1", "{out}");
    // INCOMPLETE while the node still asks (3 s), FAILED after: either says no host has it.
    let message = s["message"].as_str().unwrap();
    assert!(
        [
            "no host answers for 10.244.1.9 on vpod1 (its neighbour entry is INCOMPLETE): the address is not there",
            "no host answers for 10.244.1.9 on vpod1 (its neighbour entry is FAILED): the address is not there",
        ]
        .iter()
        .any(|end| message.ends_with(end)),
        "{out}"
    );

    // Refused over TCP: the endpoint's reset (which ends conntrack's entry at once) names it.
    let t = LiveTrace::start(&c.node, &["--to", ":30081/tcp", "--timeout", "20s"]);
    assert_eq!(
        get(&c.client, &closed, Duration::from_millis(1500)),
        Reply::Refused
    );
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    assert_eq!(
        seen(&out),
        [
            "seen        DNAT to 10.244.1.2:8081 (its reset), masqueraded to 10.244.1.1; \
             refused: 10.244.1.2 answered with a TCP reset (nothing listens on that port \
             there, or a firewall rejects with a reset)"
        ],
        "{out}"
    );

    // Refused over UDP: ICMP port unreachable from the endpoint.
    let t = LiveTrace::start(
        &c.node,
        &["--to", ":30181/udp", "--timeout", "20s", "-o", "json"],
    );
    let udp = nodeport_testbed::probe::udp_query(
        &c.client,
        format!("{NODE_IP}:30181").parse().unwrap(),
        b"ping",
        Duration::from_millis(1500),
    );
    assert!(udp.is_err(), "{udp:?}");
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let p = &v["packets"][0];
    assert_eq!(p["service"]["port"], "default/closed:53/UDP", "{out}");
    let s = &p["seen"];
    assert_eq!(s["verdict"], "dnat", "{out}");
    assert_eq!(s["reason"], "refused", "{out}");
    assert_eq!(s["refused_with"], "icmp_unreachable", "{out}");
    assert_eq!(s["refused_by"], "10.244.1.2", "{out}");
    assert_eq!(s["endpoint"], "10.244.1.2:5354", "{out}");
    assert_eq!(
        s["message"],
        "DNAT to 10.244.1.2:5354 (conntrack), masqueraded to 10.244.1.1; refused: 10.244.1.2 \
         answered with ICMP port unreachable (code 3) (nothing listens on that port there)",
        "{out}"
    );
    no_table_left(&c.node, "the last trace");
}

/// A live trace (from the client) of a connection to `to` whose reply `want` accepts, whose
/// explanation equals `--rules kernel`'s: (stdout, stderr, exit code).
fn live_from_client(
    c: &Cluster,
    to: &str,
    want: impl Fn(&Reply) -> bool,
) -> (String, String, Option<i32>) {
    let t = LiveTrace::start(
        &c.node,
        &[
            "--to",
            &format!("{to}/tcp"),
            "--from",
            CLIENT_IP,
            "--timeout",
            "20s",
        ],
    );
    let got = get(&c.client, to, Duration::from_millis(1500));
    assert!(want(&got), "{to}: {got:?}");
    let (out, err, code) = t.finish();
    assert_eq!(
        explanation(&out),
        kernel_trace(c, CLIENT_IP, &format!("{to}/tcp")),
        "{out}"
    );
    (out, err, code)
}

/// `127.0.0.1` from outside the node, with real packets (the end-to-end suite's client that
/// routes 127.0.0.1 to the node): with localhost NodePorts the NodePort is DNATed and answers
/// (kube-proxy's guard lets DNATed connections through) and a service of the node's own on
/// 127.0.0.1 is dropped by the CVE-2020-8558 guard; with route_localnet off (no localhost
/// NodePorts) the kernel drops 127.0.0.1 from the network as a martian destination. The live
/// trace and `--rules kernel` name the same cause.
#[test]
fn loopback_destinations_from_outside_the_node_are_traced_live_to_the_localnet_guard_or_the_martian_drop()
 {
    if !require_tools(
        "loopback_destinations_from_outside_the_node_are_traced_live_to_the_localnet_guard_or_the_martian_drop",
        &["kubectl", "nft"],
    ) {
        return;
    }
    let mut c = Cluster::start(
        Mode::Nftables,
        &["--nodeport-addresses", "127.0.0.0/8,198.51.100.0/24"],
    );
    c.apply(&service_yaml("here", 30093, "", &[1])).unwrap();
    let _node_local = nodeport_testbed::server::Server::start_in(
        &c.node,
        nodeport_testbed::server::ServerConfig {
            bind: "127.0.0.1".parse().unwrap(),
            ..nodeport_testbed::server::ServerConfig::http("node-lo", 18080)
        },
    )
    .unwrap();
    // The client sends 127.0.0.1 to the node over the LAN and accepts answers from it.
    c.client
        .sh(&format!(
            "ip rule add pref 100 lookup local && ip rule del pref 0 && \
             ip rule add pref 10 to 127.0.0.1/32 lookup 100 && \
             ip route add 127.0.0.1/32 via {NODE_IP} dev eth0 table 100 && \
             sysctl -qw net.ipv4.conf.all.route_localnet=1"
        ))
        .unwrap();
    eventually(&c.client, "127.0.0.1:30093", "127.0.0.1 via the LAN", |r| {
        matches!(r, Reply::Pod { .. })
    });

    // The localhost NodePort: DNATed before the guard looks, answered.
    let (out, err, code) = live_from_client(
        &c,
        "127.0.0.1:30093",
        |r| matches!(r, Reply::Pod { pod, .. } if pod == "pod1"),
    );
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(
        seen(&out),
        ["seen        DNAT to 10.244.1.2:8080 (conntrack), masqueraded to 10.244.1.1; it answered"],
        "{out}"
    );

    // The node's own 127.0.0.1 service: the guard drops it.
    let (out, err, code) = live_from_client(&c, "127.0.0.1:18080", |r| *r == Reply::Timeout);
    assert_eq!(code, Some(1), "{out}{err}");
    let guard = "drop: 127.0.0.1 from the network, not DNATed to a Service: route_localnet is on \
                 (localhost NodePorts) and the guard against CVE-2020-8558 drops it (kube-proxy's \
                 \"block incoming localnet connections\")";
    assert!(out.contains(&format!("fate        {guard}\n")), "{out}");
    assert!(
        seen(&out)[0].starts_with(&format!(
            "seen        {guard} (at ip kube-proxy localnet-check rule "
        )),
        "{out}"
    );

    // Without localhost NodePorts and with route_localnet off: the kernel's martian drop,
    // after every rule accepted it.
    c.node
        .run(&["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=0"])
        .unwrap();
    c.restart_proxy_with(&["--nodeport-addresses", "198.51.100.0/24"]);
    eventually(
        &c.client,
        &format!("{NODE_IP2}:30093"),
        "the proxy is back",
        |r| matches!(r, Reply::Pod { .. }),
    );
    let (out, err, code) = live_from_client(&c, "127.0.0.1:30093", |r| *r == Reply::Timeout);
    assert_eq!(code, Some(1), "{out}{err}");
    let martian = "drop: 127.0.0.1 from the network is a martian destination: with route_localnet \
                   off the kernel's routing drops it, NodePort or not";
    assert!(out.contains(&format!("fate        {martian}\n")), "{out}");
    assert_eq!(
        seen(&out),
        [format!(
            "seen        {martian}: every rule accepted it, no conntrack entry is left and \
             nothing came back"
        )
        .as_str()],
        "{out}"
    );
    no_table_left(&c.node, "the last trace");
}

/// The end-to-end suite's other connections that get no answer, met by a real client and
/// traced with `--rules kernel` and `--live` (which agree): a process of the node to
/// `127.0.0.1:<nodePort>` under `--nodeport-addresses 0.0.0.0/0,::/0` (the nftables mode leaves
/// loopback out: refused by the node's own stack), an IPv6 NodePort of a Service without
/// endpoints (rejected), a NodePort's number sent to an address the node does not hold (the
/// suite's address not yet added, or removed: routing refuses it, network unreachable).
#[test]
fn the_end_to_end_suites_other_unanswered_connections_are_explained_with_their_cause() {
    if !require_tools(
        "the_end_to_end_suites_other_unanswered_connections_are_explained_with_their_cause",
        &["kubectl", "nft"],
    ) {
        return;
    }
    let flags = ["--nodeport-addresses", "0.0.0.0/0,::/0"];
    let c = Cluster::start_with(Mode::Nftables, &flags, Stack::Dual);
    c.apply(&dual_stack_service_yaml("web", 30095, &[1]))
        .unwrap();
    c.apply(&dual_stack_service_yaml("empty", 30121, &[]))
        .unwrap();
    eventually(
        &c.client,
        &format!("{NODE_IP}:30095"),
        "the NodePort answers",
        |r| matches!(r, Reply::Pod { .. }),
    );
    let v6 = format!("[{NODE_IP6}]:30121");
    // Over IPv6 the reject was seen to answer only the SYN's retransmission, a second after
    // the connect began (proxy_end_to_end's dual-stack test): asked with 3 s to answer.
    let slow = Duration::from_secs(3);
    let deadline = Instant::now() + Duration::from_secs(15);
    while get(&c.client, &v6, slow) != Reply::Refused {
        assert!(
            Instant::now() < deadline,
            "the empty Service is refused over IPv6"
        );
        std::thread::sleep(Duration::from_millis(150));
    }
    c.client
        .run(&["ip", "route", "add", "203.0.113.10/32", "via", NODE_IP])
        .unwrap();
    // (who asks, its address, the destination, what it gets, the fate and notes traced, seen live)
    type Case<'a> = (
        &'a Netns,
        &'a str,
        String,
        fn(&Reply) -> bool,
        String,
        &'a str,
    );
    let cases: [Case<'_>; 3] = [
        (
            &c.node,
            "127.0.0.1",
            "127.0.0.1:30095".to_string(),
            |r| *r == Reply::Refused,
            "fate        not a NodePort address: 127.0.0.1 is not selected by \
             --nodeport-addresses 0.0.0.0/0,::/0 (a selection of every address leaves loopback \
             out in the nftables mode, as kube-proxy's does; 127.0.0.0/8 in --nodeport-addresses \
             asks for localhost NodePorts), so NodePort 30095 of default/web:80/TCP does not \
             answer there\n"
                .to_string(),
            "seen        passed on untranslated, not masqueraded; refused: 127.0.0.1 answered \
             with a TCP reset (nothing listens on that port there, or a firewall rejects with a \
             reset)",
        ),
        (
            &c.client,
            CLIENT_IP6,
            v6.clone(),
            |r| *r == Reply::Refused,
            "fate        reject: default/empty:80/TCP has no endpoints\n".to_string(),
            "seen        reject: default/empty:80/TCP has no endpoints (at ip6 kube-proxy \
             nodeport-endpoints-check rule ",
        ),
        (
            &c.client,
            CLIENT_IP,
            "203.0.113.10:30095".to_string(),
            |r| matches!(r, Reply::Other(e) if e.contains("Network is unreachable")),
            "fate        not a Service: no Service has 203.0.113.10:30095/tcp; passed on \
             untranslated\nnote        30095/tcp is the NodePort of default/web:80/TCP, but \
             203.0.113.10 is not an address of this node: NodePorts answer on the node's own \
             addresses\nnote        no route to 203.0.113.10 on this node: routing refuses the \
             packet (ICMP network unreachable) before any forward rule\n"
                .to_string(),
            "seen        accepted by every rule, then refused: this node (192.0.2.10) answered \
             with ICMP network unreachable (code 0) (no route to the address)",
        ),
    ];
    for (who, from, to, want, cause, seen_line) in cases {
        let to_tcp = format!("{to}/tcp");
        let (out, code) = kernel_verdict(&c, &flags, from, &to_tcp);
        assert_eq!(code, Some(1), "{from} → {to}: {out}");
        assert!(out.contains(&cause), "{from} → {to}: {out}");
        let mut args = flags.to_vec();
        args.extend(["--to", &to_tcp, "--timeout", "20s"]);
        let t = LiveTrace::start(&c.node, &args);
        let got = get(who, &to, slow);
        let (live, err, code) = t.finish();
        assert!(want(&got), "{from} → {to}: {got:?}\n{live}{err}");
        assert_eq!(code, Some(1), "{from} → {to}: {live}{err}");
        assert_eq!(
            explanation(&live),
            explanation(&out),
            "{from} → {to}: live, then --rules kernel"
        );
        assert!(
            seen(&live).iter().any(|l| l.starts_with(seen_line)),
            "{from} → {to}: {live}"
        );
    }
    no_table_left(&c.node, "the last trace");
}

/// Whether a live trace's path holds no step of the programs (a packet they passed on).
fn no_np_ebpf_path(out: &str) -> bool {
    !out.lines().any(|l| l.starts_with("path        ebpf "))
}

/// `nodeport trace --rules kernel` in the ebpf mode, the proxy's maps under its pin root:
/// (stdout, exit code).
fn ebpf_kernel_trace(c: &Cluster, extra: &[&str], from: &str, to: &str) -> (String, Option<i32>) {
    let out = c
        .node
        .command(env!("CARGO_BIN_EXE_nodeport"))
        .args([
            "trace",
            "--rules",
            "kernel",
            "--master",
            "http://127.0.0.1:6443",
        ])
        .args(["--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
        .arg("--ebpf-pin-root")
        .arg(&c.ebpf.as_ref().expect("an ebpf cluster").pin_root)
        .args(extra)
        .args(["--from", from, "--to", to])
        .env("NODEPORT_LOG", "error")
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.code(),
    )
}

/// The ebpf mode on the real kernel (the end-to-end suite's cases): a client outside
/// `loadBalancerSourceRanges` is dropped by `np_tc_ingress`, which the live trace sees and
/// `--rules kernel` names alike, while a listed client is translated; `127.0.0.1` sent to the
/// node from outside (a NodePort with localhost NodePorts asked for, and a service of the
/// node's own) is dropped by the kernel as a martian destination (route_localnet stays off
/// in the ebpf mode), which `--rules kernel` says from the node's own sysctl.
#[test]
fn in_the_ebpf_mode_source_ranges_and_127_0_0_1_from_outside_are_traced_on_the_real_kernel() {
    if !require_tools(
        "in_the_ebpf_mode_source_ranges_and_127_0_0_1_from_outside_are_traced_on_the_real_kernel",
        &["kubectl", "bpftool"],
    ) {
        return;
    }
    // The proxy's defaults first: its tc programs are on eth0, which holds the NodePort
    // address (`primary`), where the load-balancer VIP arrives.
    let mut c = Cluster::start(Mode::Ebpf, &[]);
    let lb = service_yaml(
        "lb",
        30085,
        &format!("  loadBalancerSourceRanges: [{CLIENT_IP}/32]"),
        &[1, 2, 3],
    )
    .replace("type: NodePort", "type: LoadBalancer");
    c.apply(&lb).unwrap();
    c.kubectl(&[
        "patch",
        "svc",
        "lb",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"loadBalancer":{"ingress":[{"ip":"192.0.2.200"}]}}}"#,
    ])
    .unwrap();
    c.apply(&service_yaml("here", 30093, "", &[1])).unwrap();
    eventually(
        &c.client,
        "192.0.2.200:80",
        "the listed client reaches the VIP",
        |r| matches!(r, Reply::Pod { .. }),
    );
    let vip = "192.0.2.200:80/tcp";
    let outside = "drop: 192.0.2.101 is not in loadBalancerSourceRanges 192.0.2.100/32 of \
                   default/lb:80/TCP";

    // Outside the ranges: the kernel's maps name the drop; live, the program reports it.
    let (kernel, code) = ebpf_kernel_trace(&c, &[], CLIENT2_IP, vip);
    assert_eq!(code, Some(1), "{kernel}");
    assert!(
        kernel.contains(&format!("fate        {outside}\n")),
        "{kernel}"
    );
    let args = ["--to", vip, "--timeout", "20s"];
    let t = LiveTrace::start_ebpf(&c, &args);
    assert_eq!(
        get(&c.client2, "192.0.2.200:80", Duration::from_millis(1500)),
        Reply::Timeout
    );
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    assert_eq!(explanation(&out), explanation(&kernel), "{out}");
    assert!(
        out.contains(
            "path        ebpf np_tc_ingress source ranges: 192.0.2.101 is not in np_src_ranges: drop\n"
        ),
        "{out}"
    );
    assert_eq!(
        seen(&out),
        [format!("seen        {outside} (at ebpf np_tc_ingress)").as_str()],
        "{out}"
    );
    // Inside them: translated, and answered.
    let (kernel, code) = ebpf_kernel_trace(&c, &[], CLIENT_IP, vip);
    assert_eq!(code, Some(0), "{kernel}");
    let t = LiveTrace::start_ebpf(&c, &args);
    assert!(matches!(
        get(&c.client, "192.0.2.200:80", Duration::from_secs(3)),
        Reply::Pod { .. }
    ));
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(explanation(&out), explanation(&kernel), "{out}");
    assert!(
        seen(&out)[0].starts_with("seen        DNAT to 10.244.")
            && seen(&out)[0].ends_with("; it answered"),
        "{out}"
    );

    // 127.0.0.1 from outside, with localhost NodePorts asked for (the suite's flags): the
    // client routes it to the node.
    let flags = ["--nodeport-addresses", "127.0.0.0/8,198.51.100.0/24"];
    c.restart_proxy_with(&flags);
    c.eventually_in_node_cgroup(&c.node, "127.0.0.1:30093", "the localhost NodePort", |r| {
        matches!(r, Reply::Pod { .. })
    });
    let _node_local = nodeport_testbed::server::Server::start_in(
        &c.node,
        nodeport_testbed::server::ServerConfig {
            bind: "127.0.0.1".parse().unwrap(),
            ..nodeport_testbed::server::ServerConfig::http("node-lo", 18080)
        },
    )
    .unwrap();
    c.client
        .sh(&format!(
            "ip rule add pref 100 lookup local && ip rule del pref 0 && \
             ip rule add pref 10 to 127.0.0.1/32 lookup 100 && \
             ip route add 127.0.0.1/32 via {NODE_IP} dev eth0 table 100 && \
             sysctl -qw net.ipv4.conf.all.route_localnet=1"
        ))
        .unwrap();
    let martian = "fate        drop: 127.0.0.1 from the network is a martian destination: with \
                   route_localnet off the kernel's routing drops it, NodePort or not\n";
    for to in ["127.0.0.1:30093", "127.0.0.1:18080"] {
        assert_eq!(
            get(&c.client, to, Duration::from_millis(1500)),
            Reply::Timeout,
            "{to}"
        );
        let (kernel, code) = ebpf_kernel_trace(&c, &flags, CLIENT_IP, &format!("{to}/tcp"));
        assert_eq!(code, Some(1), "{to}: {kernel}");
        assert!(kernel.contains(martian), "{to}: {kernel}");
        assert!(kernel.contains("(input path), on eth0"), "{to}: {kernel}");
    }
    // Live: the programs pass 127.0.0.1 to the stack untranslated (no tc frontend is ever
    // loaded for loopback); the tracer's nftables table marks it there, and it is seen to
    // leave no conntrack entry and get no answer: the martian drop, as explained.
    let mut args = flags.to_vec();
    args.extend(["--to", "127.0.0.1:30093/tcp", "--timeout", "20s"]);
    let t = LiveTrace::start_ebpf(&c, &args);
    assert_eq!(
        get(&c.client, "127.0.0.1:30093", Duration::from_millis(1500)),
        Reply::Timeout
    );
    let (out, err, code) = t.finish();
    assert_eq!(code, Some(1), "{out}{err}");
    let (kernel, _) = ebpf_kernel_trace(&c, &flags, CLIENT_IP, "127.0.0.1:30093/tcp");
    assert_eq!(explanation(&out), explanation(&kernel), "{out}");
    assert_eq!(
        seen(&out),
        [format!(
            "seen        {}: every rule accepted it, no conntrack entry is left and nothing came back",
            martian
                .trim_start_matches("fate        ")
                .trim_end()
        )
        .as_str()],
        "{out}"
    );
    assert!(no_np_ebpf_path(&out), "{out}");
    // The node's own socket to its localhost NodePort is served at connect().
    let (kernel, code) = ebpf_kernel_trace(&c, &flags, "127.0.0.1", "127.0.0.1:30093/tcp");
    assert_eq!(code, Some(0), "{kernel}");
    assert!(
        kernel.contains("fate        DNAT to 10.244.1.2:8080\n"),
        "{kernel}"
    );
}
