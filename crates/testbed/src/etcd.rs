//! A real etcd member for tests and benches: the machine's `etcd` (Debian package
//! `etcd-server`) on free loopback ports, with its data in a directory the caller owns,
//! healthy before [`Etcd::start`] returns, and killed by PID on drop.

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd member; SIGKILLed and reaped on drop.
pub struct Etcd {
    child: Option<Child>,
    /// The client port (on 127.0.0.1).
    pub client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

impl Etcd {
    /// Starts etcd with its data in `data_dir` and waits until `/health` says so.
    ///
    /// # Panics
    /// When etcd cannot be started or does not become healthy within 20 s.
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

    /// Starts (again) on the same ports and data, and waits until it is healthy.
    ///
    /// # Panics
    /// When it is already running, cannot be started, exits, or stays unhealthy for 20 s.
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
            .expect("start etcd (Debian package etcd-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.healthy() {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok()?) {
                panic!("etcd exited early: {status}");
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether `GET /health` answers `"health":"true"`.
    fn healthy(&self) -> bool {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut reply = String::new();
        s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .and_then(|()| s.read_to_string(&mut reply))
            .is_ok()
            && reply.starts_with("HTTP/1.")
            && reply.contains(" 200 ")
            && reply.contains("true")
    }

    /// Stops etcd (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}
