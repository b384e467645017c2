//! The testbed's own checks: two hosts on a LAN reach each other's pod servers, and nothing
//! is left behind afterwards.

use std::net::SocketAddr;
use std::time::Duration;

use nodeport_testbed::server::{Server, ServerConfig};
use nodeport_testbed::{Lan, Netns, probe, require_privileged};

fn namespaces() -> String {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

#[test]
fn hosts_on_a_lan_reach_each_others_pod_servers_and_everything_is_removed_after() {
    if !require_privileged("hosts_on_a_lan_reach_each_others_pod_servers") {
        return;
    }
    let names;
    {
        let lan = Lan::new("lan").unwrap();
        let client = Netns::new("client").unwrap();
        let pod = Netns::new("pod").unwrap();
        lan.attach(&client, "eth0", "192.0.2.1/24").unwrap();
        lan.attach(&pod, "eth0", "192.0.2.2/24").unwrap();
        let _server =
            Server::start_in(&pod, ServerConfig::http("web-1", 8080).with_udp(5353)).unwrap();
        names = [
            lan.fabric().name().to_owned(),
            client.name().to_owned(),
            pod.name().to_owned(),
        ];

        let to: SocketAddr = "192.0.2.2:8080".parse().unwrap();
        let answer = probe::http_get(&client, None, to, "/", Duration::from_secs(5)).unwrap();
        assert_eq!(answer.status, 200);
        assert_eq!(answer.pod, "web-1");
        assert!(answer.client.starts_with("192.0.2.1:"), "{answer:?}");
        assert!(answer.body.contains("Welcome to nginx!"));

        let from = Some("192.0.2.1".parse().unwrap());
        let hostname = probe::http_get(&client, from, to, "/hostname", Duration::from_secs(5));
        assert_eq!(hostname.unwrap().body, "web-1");

        let udp = probe::udp_query(
            &client,
            "192.0.2.2:5353".parse().unwrap(),
            b"hi",
            Duration::from_secs(5),
        );
        assert!(udp.unwrap().starts_with("web-1 192.0.2.1:"));

        // Nothing listens on the host's own namespace at that address.
        assert!(
            probe::tcp_connect(
                &client,
                "192.0.2.3:8080".parse().unwrap(),
                Duration::from_millis(300)
            )
            .is_err()
        );
    }
    let left = namespaces();
    for name in names {
        assert!(
            !left.split(' ').any(|n| n == name),
            "{name} left behind: {left}"
        );
    }
}

#[test]
fn a_spawned_process_is_killed_when_its_guard_drops() {
    if !require_privileged("a_spawned_process_is_killed_when_its_guard_drops") {
        return;
    }
    let ns = Netns::new("proc").unwrap();
    let mut cmd = ns.command("sleep");
    cmd.arg("300");
    let child = ns.spawn(&mut cmd).unwrap();
    let pid = child.pid();
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    drop(child);
    // Reaped by the guard, so the PID is gone at once.
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[test]
fn a_persisted_namespace_outlives_its_guard_until_adopted_and_dropped() {
    if !require_privileged("a_persisted_namespace_outlives_its_guard") {
        return;
    }
    let name = format!("nptest-{}-persist", std::process::id());
    let lan = Lan::with_fabric(Netns::create(&format!("{name}-lan")).unwrap()).unwrap();
    let ns = Netns::create(&name).unwrap();
    lan.attach(&ns, "eth0", "192.0.2.1/24").unwrap();
    let mut cmd = ns.command("sleep");
    cmd.arg("300");
    let pid = ns.spawn(&mut cmd).unwrap().detach();
    let fabric = lan.into_fabric().persist();
    assert_eq!(ns.persist(), name);
    // Guards gone: namespace, link and process are still there.
    assert!(namespaces().split(' ').any(|n| n == name));
    let adopted = Netns::adopt(&name);
    assert!(adopted.run(&["ip", "link", "show", "eth0"]).is_ok());
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    drop(adopted);
    drop(Netns::adopt(&fabric));
    let left = namespaces();
    assert!(!left.split(' ').any(|n| n == name || n == fabric), "{left}");
    // Killed by the drop; its zombie (this process is the parent) is reaped here.
    let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None).unwrap();
    assert!(
        matches!(
            status,
            nix::sys::wait::WaitStatus::Signaled(_, nix::sys::signal::Signal::SIGKILL, _)
        ),
        "{status:?}"
    );
}
