//! A real etcd (the testbed's [`Etcd`]) and `nodeport apiserver` replicas on it.

use std::path::Path;
use std::process::Command;

use super::http;

/// etcd, or a loud failure (only `NODEPORT_SKIP_PRIVILEGED=1` skips).
pub fn etcd_available() -> bool {
    if Command::new("etcd")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return true;
    }
    if std::env::var("NODEPORT_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        eprintln!("skipped: etcd is not installed (NODEPORT_SKIP_PRIVILEGED=1)");
        return false;
    }
    panic!("etcd (Debian package etcd-server) is required for this test and was not found");
}

pub use nodeport_testbed::etcd::Etcd;

/// A POST to etcd's JSON gateway (`/v3/kv/...`); the response body.
pub fn gateway(etcd: &Etcd, path: &str, body: &str) -> String {
    let (status, response) = http(etcd.client_port, "POST", path, Some(body)).unwrap();
    assert_eq!(status, 200, "{path}: {response}");
    response
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 (the gateway's `bytes` encoding).
pub fn base64(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk.len();
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let v = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= n {
                out.push(B64[((v >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64.
pub fn unbase64(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in text.bytes().filter(|c| *c != b'=') {
        let v = B64.iter().position(|b| *b == c).expect("base64 digit") as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// `nodeport apiserver` replicas on one etcd, each with `extra` flags.
pub fn replicas(etcd: &Etcd, dir: &Path, count: usize, extra: &[&str]) -> Vec<super::Server> {
    replicas_logging(etcd, dir, count, extra, false)
}

/// [`replicas`]; with `logs`, replica `i` logs to `dir/replica<i>.log`.
pub fn replicas_logging(
    etcd: &Etcd,
    dir: &Path,
    count: usize,
    extra: &[&str],
    logs: bool,
) -> Vec<super::Server> {
    let url = etcd.url();
    (0..count)
        .map(|i| {
            let mut args: Vec<&str> = vec!["--etcd-servers", &url];
            args.extend_from_slice(extra);
            let log = dir.join(format!("replica{i}.log"));
            super::Server::start_logging(
                &dir.join(format!("replica{i}")),
                &args,
                logs.then_some(log.as_path()),
            )
        })
        .collect()
}
