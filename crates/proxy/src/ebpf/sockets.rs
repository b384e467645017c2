//! Closing UDP sockets connected to a removed backend: the socket programs rewrite a
//! connected UDP socket's destination once, at `connect()`, so it keeps sending to a backend
//! after the backend left its Service. kube-proxy's modes clear the UDP conntrack entries of
//! removed endpoints; here the sockets themselves are closed with the `SOCK_DIAG` netlink
//! destroy request (`SOCK_DESTROY`, what `ss -K` sends; the kernel needs
//! `CONFIG_INET_DIAG_DESTROY`), and the application sees `ECONNABORTED` and connects again.
//! aya 0.14 cannot load the `bpf_sock_destroy` kfunc Cilium uses instead.
//!
//! `SOCK_DIAG` sees the sockets of one network namespace: [`destroy_in_cgroup`] visits the
//! namespace of every process in the dataplane's cgroup.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsFd;
use std::path::Path;

use netlink_sys::{Socket, SocketAddr as NlAddr, protocols::NETLINK_SOCK_DIAG};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const IPPROTO_UDP: u8 = 17;
/// `struct inet_diag_sockid`: ports, addresses, interface, cookie.
const SOCKID_LEN: usize = 48;

/// A request: `nlmsghdr` + `inet_diag_req_v2` for UDP sockets of `family`, in any state.
fn request(kind: u16, flags: u16, family: u8, id: &[u8; SOCKID_LEN]) -> Vec<u8> {
    let len = 16 + 8 + SOCKID_LEN;
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&(len as u32).to_ne_bytes());
    b.extend_from_slice(&kind.to_ne_bytes());
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    b.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    b.extend_from_slice(&[family, IPPROTO_UDP, 0, 0]);
    b.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    b.extend_from_slice(id);
    b
}

fn socket() -> std::io::Result<Socket> {
    let mut s = Socket::new(NETLINK_SOCK_DIAG)?;
    s.bind_auto()?;
    s.connect(&NlAddr::new(0, 0))?;
    Ok(s)
}

/// The destination of a socket id, as an address of `family`.
fn destination(family: u8, id: &[u8]) -> SocketAddr {
    let port = u16::from_be_bytes([id[2], id[3]]);
    let dst = &id[20..36];
    let ip = if family == libc::AF_INET as u8 {
        IpAddr::V4(Ipv4Addr::new(dst[0], dst[1], dst[2], dst[3]))
    } else {
        let mut o = [0u8; 16];
        o.copy_from_slice(dst);
        IpAddr::V6(Ipv6Addr::from(o))
    };
    SocketAddr::new(ip, port)
}

/// Reads netlink messages until the dump ends or the ack arrives; calls `each` with every
/// `inet_diag_msg`.
fn read_replies(s: &Socket, mut each: impl FnMut(&[u8])) -> std::io::Result<()> {
    loop {
        let (buf, _) = s.recv_from_full()?;
        let mut at = 0;
        while at + 16 <= buf.len() {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
            if len < 16 || at + len > buf.len() {
                return Err(std::io::Error::other("truncated SOCK_DIAG reply"));
            }
            match kind {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(buf[at + 16..at + 20].try_into().expect("4"));
                    // An ack (0), or a socket that went away meanwhile (ENOENT).
                    return if code == 0 || -code == libc::ENOENT {
                        Ok(())
                    } else {
                        Err(std::io::Error::from_raw_os_error(-code))
                    };
                }
                _ => each(&buf[at + 16..at + len]),
            }
            at += (len + 3) & !3;
        }
    }
}

/// Closes, in the calling thread's network namespace, every UDP socket connected to one of
/// `targets`; returns how many.
pub fn destroy_connected_to(targets: &BTreeSet<SocketAddr>) -> std::io::Result<usize> {
    if targets.is_empty() {
        return Ok(0);
    }
    let mut closed = 0;
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let s = socket()?;
        s.send(
            &request(
                SOCK_DIAG_BY_FAMILY,
                NLM_F_REQUEST | NLM_F_DUMP,
                family,
                &[0; SOCKID_LEN],
            ),
            0,
        )?;
        let mut found: Vec<[u8; SOCKID_LEN]> = Vec::new();
        read_replies(&s, |msg| {
            // inet_diag_msg: family, state, timer, retrans, then the socket id.
            if msg.len() >= 4 + SOCKID_LEN && targets.contains(&destination(msg[0], &msg[4..])) {
                let mut id = [0u8; SOCKID_LEN];
                id.copy_from_slice(&msg[4..4 + SOCKID_LEN]);
                found.push(id);
            }
        })?;
        for id in found {
            let s = socket()?;
            s.send(
                &request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, family, &id),
                0,
            )?;
            read_replies(&s, |_| {})?;
            closed += 1;
        }
    }
    Ok(closed)
}

/// [`destroy_connected_to`] in the network namespace of every process in `cgroup` and its
/// descendants, and in the caller's.
pub fn destroy_in_cgroup(cgroup: &Path, targets: &BTreeSet<SocketAddr>) -> std::io::Result<usize> {
    if targets.is_empty() {
        return Ok(0);
    }
    let mut closed = destroy_connected_to(targets)?;
    let own = std::fs::read_link("/proc/thread-self/ns/net")?;
    let mut seen = BTreeSet::from([own]);
    let mut dirs = vec![cgroup.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.split_whitespace() {
            let ns = format!("/proc/{pid}/ns/net");
            let Ok(id) = std::fs::read_link(&ns) else {
                continue; // exited meanwhile
            };
            if !seen.insert(id) {
                continue;
            }
            let Ok(file) = std::fs::File::open(&ns) else {
                continue;
            };
            closed += std::thread::scope(|scope| {
                scope
                    .spawn(|| {
                        nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                            .map_err(std::io::Error::from)?;
                        destroy_connected_to(targets)
                    })
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })?;
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
        }
    }
    Ok(closed)
}
