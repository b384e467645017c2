//! Small "pod" servers: an HTTP server answering like nginx's welcome page and a UDP echo,
//! each telling which pod answered and which client address it saw.
//!
//! They run on threads of the calling process that have entered a namespace
//! ([`Server::start_in`]), or in the current namespace ([`Server::start`], used by a `nodeport`
//! subcommand that the lab starts inside pod namespaces). HTTP answers:
//! - `GET /hostname`: the pod name;
//! - `GET /clientip`: the client `ip:port` as the pod saw it (after any NAT);
//! - anything else: an nginx-style welcome page with `pod:` and `client:` lines,
//!
//! and every answer carries `X-Pod-Name` and `X-Client-Address` headers. UDP answers each
//! datagram with `<pod> <client ip:port>`.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::{Error, Netns, Result};

/// What a pod server listens on.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The pod name it reports.
    pub name: String,
    /// Address to bind; the default `::` accepts IPv4 and IPv6.
    pub bind: IpAddr,
    /// TCP port for HTTP, if any.
    pub http_port: Option<u16>,
    /// UDP port for the echo, if any.
    pub udp_port: Option<u16>,
}

impl ServerConfig {
    /// HTTP on `http_port` and no UDP, bound to every address.
    pub fn http(name: &str, http_port: u16) -> Self {
        Self {
            name: name.to_owned(),
            bind: IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            http_port: Some(http_port),
            udp_port: None,
        }
    }

    /// Adds a UDP echo on `port`.
    pub fn with_udp(mut self, port: u16) -> Self {
        self.udp_port = Some(port);
        self
    }
}

/// Running pod servers; stopped and joined on drop.
#[derive(Debug)]
pub struct Server {
    stop: Arc<AtomicBool>,
    tcp: Option<Arc<TcpListener>>,
    threads: Vec<JoinHandle<()>>,
}

impl Server {
    /// Starts the servers in the current network namespace.
    pub fn start(config: ServerConfig) -> Result<Self> {
        Self::spawn(None, config)
    }

    /// Starts the servers on threads that enter `ns` first, so they listen inside it.
    pub fn start_in(ns: &Netns, config: ServerConfig) -> Result<Self> {
        Self::spawn(Some(ns.open()?), config)
    }

    fn spawn(ns: Option<std::fs::File>, config: ServerConfig) -> Result<Self> {
        // Bind on a thread inside the namespace: the sockets stay in that namespace whichever
        // thread serves them afterwards.
        let bind = std::thread::spawn(
            move || -> Result<(Option<TcpListener>, Option<UdpSocket>)> {
                if let Some(ns) = ns {
                    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(
                        |errno| Error::Io {
                            what: "enter namespace for pod server".to_owned(),
                            source: errno.into(),
                        },
                    )?;
                }
                let tcp = config
                    .http_port
                    .map(|port| {
                        TcpListener::bind(SocketAddr::new(config.bind, port)).map_err(|source| {
                            Error::Io {
                                what: format!("bind HTTP {}:{port}", config.bind),
                                source,
                            }
                        })
                    })
                    .transpose()?;
                let udp = config
                    .udp_port
                    .map(|port| {
                        UdpSocket::bind(SocketAddr::new(config.bind, port)).map_err(|source| {
                            Error::Io {
                                what: format!("bind UDP {}:{port}", config.bind),
                                source,
                            }
                        })
                    })
                    .transpose()?;
                Ok((tcp, udp))
            },
        );
        let (tcp, udp) = bind
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let tcp = tcp.map(Arc::new);
        if let Some(listener) = tcp.clone() {
            let (stop, name) = (stop.clone(), config.name.clone());
            threads.push(std::thread::spawn(move || {
                serve_http(&listener, &stop, &name)
            }));
        }
        if let Some(socket) = udp {
            let (stop, name) = (stop.clone(), config.name.clone());
            threads.push(std::thread::spawn(move || serve_udp(&socket, &stop, &name)));
        }
        Ok(Self { stop, tcp, threads })
    }

    /// Blocks the calling thread forever (for a process whose only job is to serve).
    pub fn wait(self) -> ! {
        loop {
            std::thread::park();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(listener) = &self.tcp {
            // Wakes the blocked accept() on Linux.
            let _ = nix::sys::socket::shutdown(
                std::os::fd::AsRawFd::as_raw_fd(listener.as_ref()),
                nix::sys::socket::Shutdown::Both,
            );
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn serve_http(listener: &TcpListener, stop: &AtomicBool, name: &str) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        let name = name.to_owned();
        std::thread::spawn(move || {
            let _ = answer_http(stream, &name);
        });
    }
}

fn answer_http(stream: TcpStream, name: &str) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let client = stream.peer_addr()?;
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("/");
    let client = plain(client);
    let body = match path {
        "/hostname" => name.to_owned(),
        "/clientip" => client.to_string(),
        _ => welcome_page(name, client),
    };
    let mut stream = reader.into_inner();
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nServer: nodeport-testbed\r\nContent-Type: text/html\r\n\
         Content-Length: {}\r\nX-Pod-Name: {name}\r\nX-Client-Address: {client}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

/// The page nginx's default site serves, plus who answered and who asked.
fn welcome_page(name: &str, client: SocketAddr) -> String {
    format!(
        "<!DOCTYPE html>\n<html>\n<head>\n<title>Welcome to nginx!</title>\n</head>\n<body>\n\
         <h1>Welcome to nginx!</h1>\n<p>If you see this page, the nginx web server is \
         successfully installed and working.</p>\n<p>pod: {name}</p>\n<p>client: {client}</p>\n\
         </body>\n</html>\n"
    )
}

fn serve_udp(socket: &UdpSocket, stop: &AtomicBool, name: &str) {
    let _ = socket.set_read_timeout(Some(Duration::from_millis(100)));
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::SeqCst) {
        if let Ok((_, from)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(format!("{name} {}", plain(from)).as_bytes(), from);
        }
    }
}

/// Shows an IPv4 peer of a dual-stack socket (`::ffff:a.b.c.d`) as plain IPv4.
fn plain(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        SocketAddr::V4(_) => addr,
    }
}
