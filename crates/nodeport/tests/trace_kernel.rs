//! `nodeport trace --rules kernel` on a node whose kernel a real `nodeport proxy` programmed
//! (iptables mode, in network namespaces): the path read back from `iptables-save` equals
//! the trace of what the proxy would program for the same objects, the fate matches what a
//! real client gets, and a kernel that no longer holds the rules is told apart.

mod proxy_support;

use nodeport_testbed::require_tools;
use proxy_support::*;

/// `nodeport trace` inside the node, objects from its API server: (stdout without the
/// `rules` line, exit code).
fn trace(c: &Cluster, rules: &str, args: &[&str]) -> (String, i32) {
    let out = c
        .node
        .command(env!("CARGO_BIN_EXE_nodeport"))
        .args([
            "trace",
            "--rules",
            rules,
            "--proxy-mode",
            "iptables",
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
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "{args:?}: {stderr}");
    let rules_line = stdout.lines().next().unwrap_or_default();
    assert!(rules_line.starts_with("rules "), "{stdout}");
    if rules == "kernel" {
        assert!(
            rules_line.contains("as this node's kernel holds them"),
            "{stdout}"
        );
    }
    let body: Vec<&str> = stdout.lines().skip(1).collect();
    (body.join("\n"), out.status.code().expect("exited"))
}

#[test]
fn the_kernels_iptables_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes() {
    if !require_tools(
        "the_kernels_iptables_rules_trace_as_what_the_proxy_programs_and_as_the_packet_goes",
        &[
            "kubectl",
            "curl",
            "iptables",
            "iptables-restore",
            "iptables-save",
        ],
    ) {
        return;
    }
    let c = Cluster::start(Mode::Iptables, &[]);
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

    let web_to = format!("{web}/tcp");
    let empty_to = format!("{empty}/tcp");
    let cluster_ip = format!("{}:80/tcp", c.cluster_ip("web"));
    for args in [
        vec!["--from", CLIENT_IP, "--to", web_to.as_str()],
        vec!["--from", CLIENT_IP, "--to", empty_to.as_str()],
        // The node's own address: the output path.
        vec!["--from", NODE_IP, "--to", cluster_ip.as_str()],
        vec!["--from", "10.244.2.2", "--to", cluster_ip.as_str()],
        vec!["--from", CLIENT_IP, "--to", "192.0.2.10:22/tcp"],
    ] {
        let (kernel, kernel_code) = trace(&c, "kernel", &args);
        let (render, render_code) = trace(&c, "render", &args);
        assert_eq!(kernel, render, "{args:?}");
        assert_eq!(kernel_code, render_code, "{args:?}");
        assert!(!kernel.contains("note "), "{args:?}: {kernel}");
    }

    // The fates themselves, as the client met them above.
    let (out, code) = trace(&c, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(
            "fate        DNAT to one of 10.244.1.2:8080, 10.244.2.2:8080, 10.244.3.2:8080"
        ),
        "{out}"
    );
    assert!(out.contains("path)"), "{out}");
    let (out, code) = trace(&c, "kernel", &["--from", CLIENT_IP, "--to", &empty_to]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("reject: default/empty:80/TCP has no endpoints"),
        "{out}"
    );
    let (out, _) = trace(&c, "kernel", &["--from", NODE_IP, "--to", &cluster_ip]);
    assert!(out.contains("from this node (output path)"), "{out}");

    // Rules removed by hand behind the proxy's back: the kernel's trace says what it holds
    // and that the proxy would program something else.
    c.break_service_dispatch_by_hand();
    let (out, code) = trace(&c, "kernel", &["--from", CLIENT_IP, "--to", &web_to]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("passed on untranslated"), "{out}");
    assert!(
        out.contains("note        the kernel differs from what the proxy would program"),
        "{out}"
    );
}

#[test]
fn kernel_rules_of_other_modes_cannot_be_read_yet_and_exit_3() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .args([
            "trace",
            "--rules",
            "kernel",
            "-f",
            "-",
            "--from",
            "192.0.2.1",
        ])
        .args(["--to", "192.0.2.10:80/tcp"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("--rules kernel reads the iptables mode's rules only"),
        "{stderr}"
    );
}
