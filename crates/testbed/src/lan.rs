//! A shared network: a bridge inside its own "fabric" namespace, and veth links.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::{Netns, Result};

/// The bridge's name inside the fabric namespace.
const BRIDGE: &str = "br0";

/// One layer-2 network. Hosts join it with [`Lan::attach`]; the bridge and every host-side
/// port live in the fabric namespace, which is deleted (with them) on drop.
#[derive(Debug)]
pub struct Lan {
    fabric: Netns,
    ports: AtomicU32,
}

impl Lan {
    /// Creates the fabric namespace `np-…-<role>` with a bridge in it.
    pub fn new(role: &str) -> Result<Self> {
        Self::with_fabric(Netns::new(role)?)
    }

    /// Builds the network in a fabric namespace the caller created (for example with
    /// [`Netns::create`], to choose its name): adds the bridge and brings it up.
    pub fn with_fabric(fabric: Netns) -> Result<Self> {
        fabric.run(&["ip", "link", "add", BRIDGE, "type", "bridge"])?;
        fabric.run(&["ip", "link", "set", BRIDGE, "up"])?;
        Ok(Self {
            fabric,
            ports: AtomicU32::new(0),
        })
    }

    /// Gives up the network object and returns its fabric namespace guard (which still deletes
    /// the bridge and every port when dropped, unless persisted).
    pub fn into_fabric(self) -> Netns {
        self.fabric
    }

    /// The fabric namespace (for `tcpdump` while debugging, or to cut a link).
    pub fn fabric(&self) -> &Netns {
        &self.fabric
    }

    /// Connects `host` to this network through a veth whose host end is `ifname`, up, with
    /// `addr` (CIDR form, e.g. `192.0.2.10/24`; empty for none). Returns the name of the port
    /// on the bridge side.
    pub fn attach(&self, host: &Netns, ifname: &str, addr: &str) -> Result<String> {
        let port = format!("p{}", self.ports.fetch_add(1, Ordering::Relaxed));
        veth(&self.fabric, &port, host, ifname)?;
        self.fabric
            .run(&["ip", "link", "set", &port, "master", BRIDGE])?;
        if !addr.is_empty() {
            host.add_addr(ifname, addr)?;
        }
        Ok(port)
    }
}

/// Creates a veth pair between two namespaces, `a_if` in `a` and `b_if` in `b`, both up.
/// Neither end ever exists in the host's own namespace.
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> Result<()> {
    a.run(&[
        "ip",
        "link",
        "add",
        a_if,
        "type",
        "veth",
        "peer",
        "name",
        b_if,
        "netns",
        b.name(),
    ])?;
    a.run(&["ip", "link", "set", a_if, "up"])?;
    b.run(&["ip", "link", "set", b_if, "up"])?;
    Ok(())
}
