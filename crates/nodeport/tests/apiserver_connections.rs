//! 1,100 idle connections to `nodeport apiserver` started with a soft open-files limit of 1024
//! (the common default): the server raises its limit at start, as Go servers such as
//! kube-apiserver do, keeps accepting, and answers `/readyz` and creates meanwhile (issue #20).

mod apiserver_support;

use std::net::TcpStream;

use apiserver_support::Server;
use nix::sys::resource::{Resource, getrlimit, setrlimit};

const IDLE: usize = 1100;

#[test]
fn eleven_hundred_idle_connections_leave_the_server_answering() {
    if !nodeport_testbed::require_tools("idle connections", &["prlimit"]) {
        return;
    }
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(
        hard > 4096,
        "the hard open-files limit ({hard}) is too low for this test"
    );
    // This test's own sockets need more than 1024 descriptors.
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_wrapped(
        &dir.path().join("data"),
        &[],
        None,
        &["prlimit", "--nofile=1024:"],
    );
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", server.pid())).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .to_owned();
    assert!(
        !open_files.contains(" 1024 "),
        "the server kept the soft limit of 1024: {open_files}"
    );

    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|i| {
            TcpStream::connect(("127.0.0.1", server.port))
                .unwrap_or_else(|e| panic!("connection {i}: {e}"))
        })
        .collect();
    // Give the server time to accept them all before asking it anything.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (code, _) = server.try_http("GET", "/readyz", None).unwrap();
    assert_eq!(code, 200);
    let (code, text) = server
        .try_http(
            "POST",
            "/api/v1/namespaces/default/services",
            Some(r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"a"},"spec":{"ports":[{"port":80}]}}"#),
        )
        .unwrap();
    assert_eq!(code, 201, "{text}");
    let fds = std::fs::read_dir(format!("/proc/{}/fd", server.pid()))
        .unwrap()
        .count();
    assert!(
        fds > IDLE,
        "the server holds {fds} descriptors, not every connection"
    );
    drop(idle);
}
