//! The IPVS kernel: only its presence is checked.
//!
//! IPVS mode is deprecated upstream (KEP-5495: deprecated in v1.35, the `KubeProxyIPVS` gate
//! off by default from 1.40) and this project's machines have no IPVS in their kernel, so
//! nothing here programs virtual servers: `nodeport proxy --proxy-mode ipvs` checks
//! `/proc/net/ip_vs` and stops at once with a message, and `nodeport render --proxy-mode
//! ipvs` shows what kube-proxy would program.

use std::path::{Path, PathBuf};

/// Where the kernel lists IPVS virtual servers; present only when IPVS is built in or its
/// module is loaded.
pub const PROC_IP_VS: &str = "/proc/net/ip_vs";

/// The kernel cannot do IPVS.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No `/proc/net/ip_vs`: IPVS is neither built in nor loaded.
    #[error(
        "this kernel has no IPVS ({} is missing: the ip_vs module is not built or not loaded); \
         IPVS mode is deprecated upstream (KEP-5495): use --proxy-mode nftables or iptables",
        path.display()
    )]
    NoIpvs {
        /// The path looked at.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: std::io::Error,
    },
}

/// Checks that the kernel has IPVS, by reading `proc_ip_vs` (normally [`PROC_IP_VS`]).
pub fn check_kernel(proc_ip_vs: &Path) -> Result<(), Error> {
    std::fs::metadata(proc_ip_vs)
        .map(|_| ())
        .map_err(|source| Error::NoIpvs {
            path: proc_ip_vs.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_without_proc_net_ip_vs_is_refused_with_a_message_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("ip_vs");
        let err = check_kernel(&missing).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("has no IPVS"), "{text}");
        assert!(text.contains("KEP-5495"), "{text}");
        std::fs::write(&missing, "IP Virtual Server version 1.2.1 (size=4096)\n").unwrap();
        assert!(check_kernel(&missing).is_ok());
    }
}
