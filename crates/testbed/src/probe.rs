//! Client side: requests made from inside a namespace, with a deadline, reporting what answered.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use crate::{Error, Netns, Result};

/// An HTTP answer from a pod server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpAnswer {
    /// Status code.
    pub status: u16,
    /// `X-Pod-Name`: which pod answered.
    pub pod: String,
    /// `X-Client-Address`: the client address the pod saw (after NAT).
    pub client: String,
    /// The body.
    pub body: String,
}

/// Sends `GET path` to `to` from inside `ns` (optionally from source address `from`) and reads
/// the whole answer; any failure, including a timeout, is an error.
pub fn http_get(
    ns: &Netns,
    from: Option<IpAddr>,
    to: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<HttpAnswer> {
    ns.enter(|| {
        let io = |what: &str| {
            let what = format!("{what} {to}");
            move |source: std::io::Error| Error::Io { what, source }
        };
        let mut stream = connect(from, to, timeout).map_err(io("connect to"))?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(io("set timeout for"))?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(io("set timeout for"))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n"
        )
        .map_err(io("send request to"))?;
        let mut raw = String::new();
        stream
            .read_to_string(&mut raw)
            .map_err(io("read answer from"))?;
        parse_answer(&raw).ok_or_else(|| Error::Io {
            what: format!("malformed HTTP answer from {to}: {raw:?}"),
            source: std::io::ErrorKind::InvalidData.into(),
        })
    })?
}

/// Opens a TCP connection from inside `ns` and returns how long the handshake took.
pub fn tcp_connect(ns: &Netns, to: SocketAddr, timeout: Duration) -> Result<Duration> {
    ns.enter(|| {
        let start = Instant::now();
        let stream = TcpStream::connect_timeout(&to, timeout).map_err(|source| Error::Io {
            what: format!("connect to {to}"),
            source,
        })?;
        let took = start.elapsed();
        drop(stream);
        Ok(took)
    })?
}

/// Sends one UDP datagram from inside `ns` and returns the first answer.
pub fn udp_query(ns: &Netns, to: SocketAddr, payload: &[u8], timeout: Duration) -> Result<String> {
    ns.enter(|| {
        let io = |what: &'static str| {
            move |source| Error::Io {
                what: format!("{what} {to}"),
                source,
            }
        };
        let any: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }
            .parse()
            .expect("literal");
        let socket = UdpSocket::bind(any).map_err(io("bind a socket for"))?;
        socket
            .set_read_timeout(Some(timeout))
            .map_err(io("set timeout for"))?;
        socket.send_to(payload, to).map_err(io("send to"))?;
        let mut buf = [0u8; 2048];
        let (n, _) = socket.recv_from(&mut buf).map_err(io("receive from"))?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    })?
}

fn connect(from: Option<IpAddr>, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let Some(from) = from else {
        return TcpStream::connect_timeout(&to, timeout);
    };
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect as nix_connect, socket,
    };
    let family = if to.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(SocketAddr::new(from, 0)),
    )?;
    // A bound socket cannot use connect_timeout; the kernel's SYN retries bound the wait, and
    // the read/write timeouts set by the caller bound the rest.
    nix_connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(to),
    )?;
    Ok(TcpStream::from(fd))
}

/// Parses a pod server's raw HTTP answer (status line, headers, body), as [`http_get`] does;
/// for answers read by another client (`curl -i`).
pub fn parse_answer(raw: &str) -> Option<HttpAnswer> {
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let mut answer = HttpAnswer {
        status,
        pod: String::new(),
        client: String::new(),
        body: body.to_owned(),
    };
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "x-pod-name" => answer.pod = v.trim().to_owned(),
                "x-client-address" => answer.client = v.trim().to_owned(),
                _ => {}
            }
        }
    }
    Some(answer)
}
