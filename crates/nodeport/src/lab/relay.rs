//! A plain TCP relay: accepts on one address and splices each connection to another.
//!
//! A lab-only shortcut for reaching the API server. Our API server, like kube-apiserver's
//! insecure port of old, serves plain HTTP only on loopback (a non-loopback address needs
//! TLS and token authentication). In the lab it listens on `127.0.0.1:6443` inside the
//! control-plane namespace; a relay there listens on the control plane's node address
//! (`192.0.2.10:6443`) and one in each worker listens on the worker's `127.0.0.1:6443`
//! and connects over the lab network to the control plane. So every proxy is configured as on
//! a real node with a local API endpoint (`--kubeconfig` pointing at `127.0.0.1:6443`) and its
//! traffic to the API really crosses the node network. It carries no authentication, so it
//! exists only inside the lab's namespaces, never on the host's network.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// How long a connection to the target may take before the accepted one is dropped.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds `listen` and relays every accepted connection to `connect`, forever.
pub fn run(listen: SocketAddr, connect: SocketAddr) -> io::Result<()> {
    let listener = TcpListener::bind(listen)?;
    tracing::info!(%listen, %connect, "relaying");
    for incoming in listener.incoming() {
        let Ok(client) = incoming else { continue };
        std::thread::spawn(move || {
            if let Err(err) = splice(client, connect) {
                tracing::debug!(%connect, error = %err, "relayed connection ended with an error");
            }
        });
    }
    Ok(())
}

/// Copies both directions between `client` and a new connection to `connect`, passing each
/// side's end of stream on to the other.
fn splice(client: TcpStream, connect: SocketAddr) -> io::Result<()> {
    let server = TcpStream::connect_timeout(&connect, CONNECT_TIMEOUT)?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_r, mut server_w) = (client.try_clone()?, server.try_clone()?);
    let upstream = std::thread::spawn(move || {
        let copied = io::copy(&mut client_r, &mut server_w);
        let _ = server_w.shutdown(Shutdown::Write);
        copied
    });
    let (mut server_r, mut client_w) = (server, client);
    let copied = io::copy(&mut server_r, &mut client_w);
    let _ = client_w.shutdown(Shutdown::Write);
    let up = upstream
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
    up.and(copied).map(drop)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    #[test]
    fn a_relayed_connection_carries_both_directions_and_end_of_stream() {
        let target = TcpListener::bind("127.0.0.1:0").unwrap();
        let target_addr = target.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = target.accept().unwrap();
            let mut request = String::new();
            conn.read_to_string(&mut request).unwrap();
            conn.write_all(format!("echo {request}").as_bytes())
                .unwrap();
        });
        // Find a free port for the relay, then let it bind there.
        let listen = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        std::thread::spawn(move || run(listen, target_addr));
        let mut conn = (0..100)
            .find_map(|_| {
                TcpStream::connect(listen).ok().or_else(|| {
                    std::thread::sleep(Duration::from_millis(10));
                    None
                })
            })
            .expect("relay listens");
        conn.write_all(b"hello").unwrap();
        conn.shutdown(Shutdown::Write).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        assert_eq!(answer, "echo hello");
    }
}
