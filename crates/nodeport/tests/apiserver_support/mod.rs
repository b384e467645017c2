//! Shared helpers for the `apiserver_*` tests: the real `nodeport apiserver` binary on a free
//! loopback port, a kubeconfig of its own, kubectl, and a tiny blocking HTTP client.

#![allow(dead_code)]

pub mod etcd;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A running `nodeport apiserver`; killed (SIGKILL) and reaped on drop.
pub struct Server {
    child: Option<Child>,
    /// The port it listens on.
    pub port: u16,
    /// Its data directory.
    pub data_dir: PathBuf,
    kubeconfig: PathBuf,
    cache_dir: PathBuf,
}

/// A free loopback port (bound, then released for the server).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// kubectl, or a loud failure (only `NODEPORT_SKIP_PRIVILEGED=1` skips).
pub fn kubectl_available() -> bool {
    if Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return true;
    }
    if std::env::var("NODEPORT_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        eprintln!("skipped: kubectl is not installed (NODEPORT_SKIP_PRIVILEGED=1)");
        return false;
    }
    panic!("kubectl is required for this test and was not found on PATH");
}

impl Server {
    /// Starts the server with its data in `data_dir` and waits until it answers `/readyz`.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Server {
        Self::start_logging(data_dir, extra, None)
    }

    /// [`Server::start`], with the server's log (`warn` and up) written to `log` instead of the
    /// test's stderr when given.
    pub fn start_logging(data_dir: &Path, extra: &[&str], log: Option<&Path>) -> Server {
        Self::start_wrapped(data_dir, extra, log, &[])
    }

    /// [`Server::start_logging`], with the server run by `wrapper` (a command and its
    /// arguments, which must end by exec'ing the rest of its command line, e.g. `unshare`), so
    /// that [`Server::pid`] is the server's own.
    pub fn start_wrapped(
        data_dir: &Path,
        extra: &[&str],
        log: Option<&Path>,
        wrapper: &[&str],
    ) -> Server {
        let port = free_port();
        let stderr = match log {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("create the log file")),
            None => Stdio::inherit(),
        };
        let binary = env!("CARGO_BIN_EXE_nodeport");
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(binary);
                c
            }
            None => Command::new(binary),
        };
        let child = command
            .args(["apiserver", "--port", &port.to_string(), "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .env("NODEPORT_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start nodeport apiserver");
        let kubeconfig = data_dir.with_extension("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- cluster: {{server: \"http://127.0.0.1:{port}\"}}\n  name: t\ncontexts:\n- context: {{cluster: t, user: u}}\n  name: t\ncurrent-context: t\nusers:\n- name: u\n  user: {{}}\n"
            ),
        )
        .unwrap();
        let mut server = Server {
            child: Some(child),
            port,
            data_dir: data_dir.to_path_buf(),
            kubeconfig,
            cache_dir: data_dir.with_extension("kubecache"),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok((200, _)) = server.try_http("GET", "/readyz", None) {
                return server;
            }
            if let Some(status) = server.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("nodeport apiserver exited early: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "nodeport apiserver did not become ready"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server with SIGTERM (a clean shutdown) and waits for it.
    pub fn terminate(&mut self) {
        assert!(
            self.terminate_within(Duration::from_secs(30)),
            "nodeport apiserver did not stop within 30 s of SIGTERM"
        );
    }

    /// Sends SIGTERM; whether the server exited within `limit` (if not, it is killed).
    pub fn terminate_within(&mut self, limit: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if child.try_wait().ok().flatten().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Kills the server with SIGKILL and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs kubectl against this server only (own kubeconfig and cache).
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_command(args).output().expect("run kubectl")
    }

    /// A kubectl command against this server, to add environment or pipes to.
    pub fn kubectl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache_dir)
            .args(args);
        cmd
    }

    /// One HTTP/1.1 request; `(status, body)`.
    pub fn try_http(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> std::io::Result<(u16, String)> {
        http(self.port, method, path, body)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One blocking HTTP/1.1 request with `Connection: close`.
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP status in {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// stdout and stderr of a command as strings.
pub fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}
