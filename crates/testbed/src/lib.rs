//! Throwaway network-namespace topologies for nodeport's lab and kernel tests.
//!
//! Everything a test builds lives inside namespaces this crate creates: hosts are
//! [`Netns`]es, a shared network is a bridge inside its own "fabric" namespace ([`Lan`]),
//! and links are veth pairs created directly between two namespaces (never with an end in
//! the host's own namespace), so no packet of a test can reach a real network.
//!
//! Names carry a per-process prefix (`np-<pid>-<n>-<role>`): two test binaries running at
//! once never collide, and [`sweep_stale`] removes namespaces whose creating process is gone
//! (a test killed with SIGKILL cannot run its `Drop` guards).
//!
//! ```no_run
//! use nodeport_testbed::{Lan, Netns, require_privileged};
//! if require_privileged("example") {
//!     let lan = Lan::new("lan").unwrap();
//!     let node = Netns::new("node").unwrap();
//!     lan.attach(&node, "eth0", "192.0.2.10/24").unwrap();
//!     node.sh("ip addr show eth0").unwrap();
//! } // everything is deleted here, even on panic
//! ```

pub mod etcd;
pub mod fuzz_corpus;
mod lan;
mod netns;
mod privileged;
pub mod probe;
pub mod server;

pub use lan::{Lan, veth};
pub use netns::{ChildGuard, Netns, sweep_stale};
pub use privileged::{require_privileged, require_tools};

/// What can go wrong while building or driving a topology.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A command could not be started at all (missing binary, no permission).
    #[error("could not run `{command}`")]
    Spawn {
        /// The command line.
        command: String,
        /// Why it could not start.
        #[source]
        source: std::io::Error,
    },
    /// A command ran and failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed on stderr.
        stderr: String,
    },
    /// Entering a namespace, or a socket operation inside it, failed.
    #[error("{what}")]
    Io {
        /// The step that failed.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
