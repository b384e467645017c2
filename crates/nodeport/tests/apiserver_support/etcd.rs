//! A real etcd (the machine's `/usr/bin/etcd`) on free loopback ports with a temporary data
//! directory, stopped by PID on drop, and `nodeport apiserver` replicas on it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, http};

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

/// A running etcd member; SIGKILLed and reaped on drop.
pub struct Etcd {
    child: Option<Child>,
    /// The client port.
    pub client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
}

impl Etcd {
    /// Starts etcd with its data in `data_dir` and waits until `/health` says so.
    pub fn start(data_dir: &Path) -> Etcd {
        let mut etcd = Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            data_dir: data_dir.to_path_buf(),
        };
        etcd.restart();
        etcd
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Starts (again) on the same ports and data.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "etcd is already running");
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&self.data_dir)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("t={peer}")])
            .args(["--logger", "zap", "--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok((200, body)) = http(self.client_port, "GET", "/health", None)
                && body.contains("true")
            {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("etcd exited early: {status}");
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops etcd (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A POST to etcd's JSON gateway (`/v3/kv/...`); the response body.
    pub fn gateway(&self, path: &str, body: &str) -> String {
        let (status, response) = http(self.client_port, "POST", path, Some(body)).unwrap();
        assert_eq!(status, 200, "{path}: {response}");
        response
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
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
