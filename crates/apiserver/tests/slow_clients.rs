//! Slow and broken clients against a server on a real socket (issue #20): a watcher that never
//! reads is closed while the others get every event; a body sent one byte a second is cut off by
//! `--request-timeout`; a flood of mutating requests beyond `--max-mutating-requests-inflight` is
//! answered 429 with `Retry-After`, while `/readyz` and reads still answer.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use nodeport_apiserver::Config;
use nodeport_apiserver::rest::limits;

/// A server on a free loopback port, on its own runtime thread.
fn start(config: Config) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let state = nodeport_apiserver::in_memory(&config).await.unwrap();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            nodeport_apiserver::serve(state, listener, std::future::pending())
                .await
                .unwrap();
        });
    });
    rx.recv().unwrap()
}

/// One request with `Connection: close`: status, headers and body.
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    read_response(stream)
}

fn read_response(mut stream: TcpStream) -> (u16, String, String) {
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_owned(), body.to_owned())
}

fn service(name: &str, padding: usize) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","annotations":{{"pad":"{}"}}}},"spec":{{"ports":[{{"port":80}}]}}}}"#,
        "x".repeat(padding)
    )
}

fn metric(addr: SocketAddr, name: &str) -> i64 {
    let (_, _, text) = request(addr, "GET", "/metrics", "");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// Opens a watch on Services and sends the request: the caller reads it, or never does.
fn open_watch(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET /api/v1/namespaces/default/services?watch=true&resourceVersion=0 HTTP/1.1\r\nHost: t\r\n\r\n"
    )
    .unwrap();
    stream
}

#[test]
fn a_watcher_that_never_reads_is_closed_and_the_others_get_every_event() {
    let mut config = Config::default();
    config.rest.unresponsive_watch_timeout = Duration::from_secs(1);
    let addr = start(config);

    let _stuck = open_watch(addr); // never read
    let reader = open_watch(addr);
    let counter = std::thread::spawn(move || {
        let mut added = 0;
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if line.contains(r#""type":"ADDED""#) && line.contains(r#""name":"big-"#) {
                added += 1;
                if added == CREATES {
                    break;
                }
            }
        }
        added
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(metric(addr, "apiserver_registered_watchers"), 2);

    // More than the socket buffers and the watch's 256-chunk buffer can hold: ~40 MB.
    const CREATES: usize = 400;
    for i in 0..CREATES {
        let (code, _, body) = request(
            addr,
            "POST",
            "/api/v1/namespaces/default/services",
            &service(&format!("big-{i}"), 100_000),
        );
        assert_eq!(code, 201, "{body}");
    }
    assert_eq!(
        counter.join().unwrap(),
        CREATES,
        "the reading watcher missed events"
    );

    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(
        addr,
        "nodeport_apiserver_unresponsive_watchers_closed_total",
    ) < 1
    {
        assert!(
            Instant::now() < deadline,
            "the stuck watch was never closed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Only the reading watch (which this test stopped reading only after its last event) may
    // still be registered.
    assert!(metric(addr, "apiserver_registered_watchers") <= 1);
}

#[test]
fn a_body_sent_one_byte_a_second_is_cut_off_by_the_request_timeout() {
    let mut config = Config::default();
    config.rest.limits.request_timeout = Duration::from_secs(2);
    let addr = start(config);
    let body = service("slow", 0);
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "POST /api/v1/namespaces/default/services HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        for byte in body.bytes() {
            if writer.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    let started = Instant::now();
    let (code, _, text) = read_response(stream);
    assert_eq!(code, 504, "{text}");
    assert!(
        text.contains("Timeout: request did not complete within requested timeout"),
        "{text}"
    );
    // Cut off long before the body (over 100 bytes at one a second) could have arrived.
    assert!(started.elapsed() < Duration::from_secs(30));
    drop(trickle);
    let (code, _, _) = request(addr, "GET", "/readyz", "");
    assert_eq!(code, 200);
    let (code, _, _) = request(addr, "GET", "/api/v1/namespaces/default/services/slow", "");
    assert_eq!(code, 404, "the cut-off create must not have happened");
}

#[test]
fn mutating_requests_beyond_the_limit_get_429_with_retry_after_and_reads_and_readyz_go_on() {
    let mut config = Config::default();
    config.rest.limits = limits::Config {
        max_requests_inflight: 10,
        max_mutating_requests_inflight: 2,
        request_timeout: Duration::from_secs(30),
    };
    let addr = start(config);
    // Two creates in flight: headers sent, body still coming.
    let held: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            write!(
                s,
                "POST /api/v1/namespaces/default/services HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"
            )
            .unwrap();
            s
        })
        .collect();
    // Wait until both hold their permit (a create of ours sent meanwhile would take one of the
    // two, and one held create would be refused instead).
    let mutating = r#"apiserver_current_inflight_requests{request_kind="mutating"}"#;
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(addr, mutating) < 2 {
        assert!(
            Instant::now() < deadline,
            "the held creates never reached the server"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, head, body) = request(
        addr,
        "POST",
        "/api/v1/namespaces/default/services",
        &service("third", 0),
    );
    assert_eq!(code, 429, "{body}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 1"),
        "{head}"
    );
    assert_eq!(body, "Too many requests, please try again later.\n");
    assert_eq!(
        metric(
            addr,
            r#"apiserver_current_inflight_requests{request_kind="mutating"}"#
        ),
        2
    );
    // Reads have a limit of their own; the health checks have none.
    let (code, _, _) = request(addr, "GET", "/api/v1/namespaces/default/services", "");
    assert_eq!(code, 200);
    let (code, _, _) = request(addr, "GET", "/readyz", "");
    assert_eq!(code, 200);
    drop(held);
    // Once they are gone, creates go through again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, _, body) = request(
            addr,
            "POST",
            "/api/v1/namespaces/default/services",
            &service("fourth", 0),
        );
        if code == 201 {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {code} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
