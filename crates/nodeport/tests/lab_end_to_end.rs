//! End-to-end: `nodeport lab` itself, as a user runs it. Its verdict and exit status, and
//! that afterwards nothing of the run is left: no namespace, link, process or file — after a
//! normal end, after SIGINT in the middle, and after `--keep` followed by `--down`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nodeport_testbed::{require_privileged, require_tools};

const NODEPORT: &str = env!("CARGO_BIN_EXE_nodeport");

/// Proxy modes the lab runs end to end (IPVS needs a kernel with IPVS, which the test
/// machines lack).
const MODES: &[&str] = &["nftables", "iptables"];

fn lab(args: &[&str]) -> Output {
    Command::new(NODEPORT)
        .arg("lab")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run nodeport lab")
}

/// The id from the lab's first line, `nodeport lab <id>: ...`.
fn lab_id(stdout: &str) -> String {
    let first = stdout.lines().next().unwrap_or_default();
    let id = first
        .strip_prefix("nodeport lab ")
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("no lab id in the first line: {first:?}"));
    id.to_owned()
}

/// The node-side veth names of the lab's pods, from its `  <pod> <ip> on <node>` lines.
fn pod_veths(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("  web-"))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter_map(|name| name.rsplit('-').next())
        .map(|suffix| format!("veth{suffix}"))
        .collect()
}

/// Processes whose environment marks them as started by lab `id`.
fn processes_of(id: &str) -> Vec<String> {
    let marker = format!("NODEPORT_LAB={id}");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter(|e| {
            std::fs::read(e.path().join("environ"))
                .map(|env| env.split(|&b| b == 0).any(|var| var == marker.as_bytes()))
                .unwrap_or(false)
        })
        .map(|e| {
            let pid = e.file_name().to_string_lossy().into_owned();
            let cmd = std::fs::read_to_string(e.path().join("cmdline")).unwrap_or_default();
            format!("{pid} {}", cmd.replace('\0', " "))
        })
        .collect()
}

fn namespaces_of(id: &str) -> Vec<String> {
    let prefix = format!("nplab-{id}-");
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Nothing of lab `id` is left: namespaces, processes, its directory, and its pod links (none
/// of which may ever appear in the host's namespace).
fn assert_nothing_left(id: &str, veths: &[String]) {
    // Killed processes may take a moment to be reaped by init.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_of(id).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        processes_of(id),
        Vec::<String>::new(),
        "processes of lab {id} left"
    );
    assert_eq!(
        namespaces_of(id),
        Vec::<String>::new(),
        "namespaces of lab {id} left"
    );
    let dir = format!("/run/nodeport/lab/{id}");
    assert!(!std::path::Path::new(&dir).exists(), "{dir} left");
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    for veth in veths {
        assert!(
            !links.contains(veth.as_str()),
            "{veth} in the host namespace: {links}"
        );
    }
}

fn lab_answers_on_every_node_ip_and_leaves_nothing_behind(mode: &str, layout: Option<&str>) {
    let mut args = vec!["--proxy-mode", mode];
    args.extend(layout.iter().flat_map(|l| ["--nftables-layout", l]));
    let out = lab(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "nodeport lab --proxy-mode {mode} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("verdict: PASS: all 3 node IPs answered on NodePort"),
        "{stdout}"
    );
    // What the reference shows: the Service with its allocated port, the endpoints, the rules.
    assert!(stdout.contains("$ kubectl get svc web\n"), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("web ")
            && l.contains("NodePort")
            && l.contains("10.96.")
            && l.contains("80:3")),
        "{stdout}"
    );
    assert!(
        stdout.contains("10.244.1.2:80,10.244.2.2:80,10.244.2.3:80"),
        "{stdout}"
    );
    for step in 1..=9 {
        assert!(stdout.contains(&format!("[{step}/9] ")), "{stdout}");
    }
    // The proxies ran with the system:kube-proxy token under RBAC (the verdict above is their
    // work); RBAC refuses that user a Service create (the lab also checks it with the token).
    assert!(
        stdout.contains("$ kubectl auth can-i create services --as system:kube-proxy\nno\n"),
        "{stdout}"
    );
    if mode == "nftables" {
        // The layout the proxies were given, and its tables: the flat layout has no chain per
        // Service or endpoint, kube-proxy's has both.
        let layout = layout.unwrap_or("flat");
        assert!(
            stdout
                .lines()
                .next()
                .unwrap_or_default()
                .contains(&format!("proxy mode nftables ({layout} layout)")),
            "{stdout}"
        );
        let per_endpoint_chains = stdout.contains("\tchain endpoint-");
        assert_eq!(per_endpoint_chains, layout == "kube-proxy", "{stdout}");
        // Our API server serves the default ServiceCIDR `kubernetes` (kube-apiserver >= 1.33),
        // and the proxy turns it into kube-proxy's drop rule for unallocated ClusterIPs: the
        // whole chain API server -> ServiceCIDR watch -> rule, with our own parts.
        assert!(
            stdout.contains(
                "ip daddr 10.96.0.0/16 drop comment \"Drop traffic to unallocated ClusterIPs\""
            ),
            "{stdout}"
        );
    }
    let veths = pod_veths(&stdout);
    assert_eq!(veths.len(), 3, "{stdout}");
    assert_nothing_left(&lab_id(&stdout), &veths);
}

#[test]
fn lab_in_every_proxy_mode_answers_on_every_node_ip_and_leaves_nothing_behind() {
    if !require_tools(
        "lab_answers_on_every_node_ip",
        &["nft", "iptables", "iptables-restore", "kubectl"],
    ) {
        return;
    }
    for mode in MODES {
        lab_answers_on_every_node_ip_and_leaves_nothing_behind(mode, None);
    }
    lab_answers_on_every_node_ip_and_leaves_nothing_behind("nftables", Some("kube-proxy"));
}

/// `nodeport lab --ip-family dual`: the verdict names both addresses of every node, each
/// answered on the NodePort through a pod, in every proxy mode; the Service is dual-stack and
/// the IPv6 rules are shown.
#[test]
fn lab_dual_stack_answers_on_both_families_of_every_node_in_every_proxy_mode() {
    if !require_tools(
        "lab_dual_stack_answers_on_both_families_of_every_node",
        &[
            "nft",
            "iptables",
            "iptables-restore",
            "ip6tables",
            "ip6tables-restore",
            "kubectl",
        ],
    ) {
        return;
    }
    for mode in MODES {
        let out = lab(&["--proxy-mode", mode, "--ip-family", "dual"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "nodeport lab --proxy-mode {mode} --ip-family dual failed ({}):\n{stdout}\n{stderr}",
            out.status
        );
        let verdict = stdout
            .lines()
            .find(|l| l.starts_with("verdict: "))
            .unwrap_or_else(|| panic!("no verdict:\n{stdout}"));
        assert!(
            verdict.starts_with("verdict: PASS: all 6 node IPs answered on NodePort"),
            "{verdict}"
        );
        for node in [
            "control-plane 192.0.2.10",
            "control-plane fd00:192:0:2::10",
            "worker 192.0.2.11",
            "worker fd00:192:0:2::11",
            "worker2 192.0.2.12",
            "worker2 fd00:192:0:2::12",
        ] {
            assert!(verdict.contains(node), "{node} missing: {verdict}");
        }
        // The IPv6 request reached a pod at its IPv6 address, which saw an IPv6 client (the
        // node's address after the masquerade).
        let line = stdout
            .lines()
            .find(|l| l.contains("worker [fd00:192:0:2::11]:"))
            .unwrap_or_else(|| panic!("no IPv6 line for worker:\n{stdout}"));
        assert!(
            line.contains("(fd00:10:244:") && line.contains("saw the client as [fd00:"),
            "{line}"
        );
        if *mode == "nftables" {
            assert!(
                stdout.contains("ip6 daddr fd00:10:96::/108 drop"),
                "the IPv6 rules are shown with the secondary range's drop rule:\n{stdout}"
            );
        }
        let veths = pod_veths(&stdout);
        assert_eq!(veths.len(), 3, "{stdout}");
        assert_nothing_left(&lab_id(&stdout), &veths);
    }
}

#[test]
fn lab_interrupted_by_sigint_in_the_middle_removes_everything_and_exits_130() {
    if !require_tools("lab_interrupted_by_sigint", &["nft", "kubectl"]) {
        return;
    }
    let mut child = Command::new(NODEPORT)
        .arg("lab")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    // Interrupt once the API server is up and the proxies are starting: namespaces, links and
    // several processes exist by then.
    loop {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap() == 0 {
            panic!("the lab ended before it was interrupted:\n{seen}");
        }
        seen.push_str(&line);
        if line.starts_with("[5/9]") {
            break;
        }
    }
    let id = lab_id(&seen);
    assert!(
        !namespaces_of(&id).is_empty(),
        "the lab should be running:\n{seen}"
    );
    assert!(
        !processes_of(&id).is_empty(),
        "the lab should be running:\n{seen}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "{seen}{rest}\n{stderr}");
    assert!(stderr.contains("interrupted by SIGINT"), "{stderr}");
    assert_nothing_left(&id, &pod_veths(&seen));
}

#[test]
fn lab_killed_with_sigkill_is_swept_by_the_next_lab() {
    if !require_tools("lab_killed_with_sigkill", &["nft", "kubectl"]) {
        return;
    }
    let mut child = Command::new(NODEPORT)
        .arg("lab")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("\n[3/9]") {
        let mut line = String::new();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "lab ended:\n{seen}"
        );
        seen.push_str(&line);
    }
    let id = lab_id(&seen);
    child.kill().unwrap(); // SIGKILL: no handler, no guard runs
    child.wait().unwrap();
    assert!(!namespaces_of(&id).is_empty(), "{seen}");
    // The next lab (this one, or one another test started meanwhile) removes it first thing.
    let out = lab(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_nothing_left(&id, &pod_veths(&seen));
}

#[test]
fn lab_kept_with_keep_serves_after_the_command_ends_and_down_removes_it() {
    if !require_tools("lab_kept_with_keep", &["nft", "kubectl", "curl"]) {
        return;
    }
    let out = lab(&["--keep"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = lab_id(&stdout);
    let veths = pod_veths(&stdout);
    // Remove it whatever happens below.
    struct Down(String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = lab(&["--down", &self.0]);
        }
    }
    let down = Down(id.clone());

    assert!(
        stdout.contains(&format!("lab {id} is left running")),
        "{stdout}"
    );
    assert!(stdout.contains(&format!("lab --down {id}")), "{stdout}");
    assert_eq!(namespaces_of(&id).len(), 3 + 3 + 2, "{stdout}");
    // The printed kubectl wrapper reaches the API server.
    let kubectl = format!("/run/nodeport/lab/{id}/kubectl");
    assert!(stdout.contains(&kubectl), "{stdout}");
    let svc = Command::new(&kubectl)
        .args([
            "get",
            "svc",
            "web",
            "-o",
            "jsonpath={.spec.ports[0].nodePort}",
        ])
        .output()
        .unwrap();
    let node_port = String::from_utf8_lossy(&svc.stdout).trim().to_owned();
    assert!(node_port.starts_with('3'), "{svc:?}");
    // The printed curl works from the client, after `nodeport lab` has exited.
    let curl = Command::new("ip")
        .args([
            "netns",
            "exec",
            &format!("nplab-{id}-client"),
            "curl",
            "-s",
            "-m",
            "5",
        ])
        .arg(format!("192.0.2.12:{node_port}"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&curl.stdout).contains("<h1>Welcome to nginx!</h1>"),
        "{curl:?}"
    );
    // A pod reaches the API server through the `kubernetes` Service, as in-cluster clients do:
    // the API server's lease made its address an endpoint, the proxy on the pod's node DNATs
    // the ClusterIP to it.
    let pod = stdout
        .lines()
        .find_map(|l| l.strip_prefix("  web-"))
        .and_then(|rest| rest.split_whitespace().next())
        .map(|rest| format!("nplab-{id}-web-{rest}"))
        .expect("a pod in the output");
    let readyz = Command::new("ip")
        .args(["netns", "exec", &pod, "curl", "-sk", "-m", "5"])
        .arg("https://10.96.0.1/readyz")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&readyz.stdout), "ok", "{readyz:?}");

    std::mem::forget(down);
    let removed = lab(&["--down", &id]);
    assert!(removed.status.success(), "{removed:?}");
    assert_nothing_left(&id, &veths);
    let again = lab(&["--down", &id]);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains(&format!("there is no lab {id}")),
        "{again:?}"
    );
}

#[test]
fn lab_without_root_or_without_its_tools_says_exactly_what_is_missing() {
    if !require_privileged("lab_without_root_or_without_its_tools") {
        return;
    }
    // As root, with nothing on PATH.
    let out = Command::new(NODEPORT)
        .arg("lab")
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the lab cannot start; this machine is missing:"),
        "{stderr}"
    );
    assert!(
        stderr.contains("- `ip` on PATH (package iproute2)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("- `nft` on PATH (package nftables)"),
        "{stderr}"
    );
    assert!(stderr.contains("- `kubectl` on PATH"), "{stderr}");
    assert!(!stderr.contains("- root"), "{stderr}");

    // As an unprivileged user (nobody), tools present.
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            NODEPORT,
            "lab",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("- root: the lab creates network namespaces"),
        "{stderr}"
    );
    assert!(!stderr.contains("`ip` on PATH"), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing may be created: {out:?}");
}

#[test]
fn lab_in_ebpf_mode_answers_on_every_node_ip_and_leaves_no_pin_mount_or_cgroup_behind() {
    if !require_tools("lab_in_ebpf_mode", &["bpftool", "kubectl"]) {
        return;
    }
    let out = lab(&["--proxy-mode", "ebpf"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nodeport lab --proxy-mode ebpf failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("verdict: PASS: all 3 node IPs answered on NodePort"),
        "{stdout}"
    );
    // The programs the lab shows: tc on each node's eth0.
    assert!(stdout.contains("np_tc_ingress"), "{stdout}");
    let id = lab_id(&stdout);
    let veths = pod_veths(&stdout);
    assert_eq!(veths.len(), 3, "{stdout}");
    assert_nothing_left(&id, &veths);
    // Per node: a bpffs and a cgroup under the lab's directory, all gone.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.lines().any(|l| l.contains(&format!("/{id}/ebpf"))),
        "{mounts}"
    );
    let cgroups = nodeport_proxy::ebpf::dataplane::cgroup2_mount().unwrap();
    let left: Vec<String> = std::fs::read_dir(&cgroups)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("nodeport-lab-{id}-")))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
