//! This node's interface addresses, from a netlink (rtnetlink) address dump.
//!
//! `--nodeport-addresses` CIDRs select among them; the proxy dumps them periodically so that
//! an address added or removed on the node is followed without a restart (reference 004,
//! "in case of something like DHCP").

use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;

/// An address dump failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The rtnetlink socket could not be opened.
    #[error("opening an rtnetlink socket")]
    Socket(#[source] std::io::Error),
    /// The dump failed.
    #[error("dumping interface addresses")]
    Dump(#[source] rtnetlink::Error),
}

/// Every address configured on an interface of this network namespace, sorted.
pub async fn local_addresses() -> Result<Vec<IpAddr>, Error> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
    let task = tokio::spawn(connection);
    let mut stream = handle.address().get().execute();
    let mut out = Vec::new();
    let result = loop {
        match stream.try_next().await {
            Ok(Some(msg)) => {
                // IFA_LOCAL is the address itself on point-to-point links; IFA_ADDRESS otherwise.
                let local = msg.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Local(ip) => Some(*ip),
                    _ => None,
                });
                let addr = msg.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(ip) => Some(*ip),
                    _ => None,
                });
                if let Some(ip) = local.or(addr) {
                    out.push(ip);
                }
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(Error::Dump(e)),
        }
    };
    drop(stream);
    drop(handle);
    task.abort();
    result?;
    out.sort();
    out.dedup();
    Ok(out)
}
