//! What the agent sees of a dataplane backend: one sync (full or partial) of the desired
//! state, and whether the backend notices changes made behind its back.
//!
//! Each backend folder keeps its own applier, kernel trait and errors; this trait is the
//! seam the sync loop drives, so that the loop (rate limiting, retries, health, metrics) is
//! the same for every `--proxy-mode`.

use std::collections::BTreeSet;

use crate::config::{NodeConfig, ProxyMode};
use crate::desired::DesiredState;
use crate::ebpf;
use crate::iptables;
use crate::model::ServicePortName;
use crate::nftables;

/// What one sync did, in the terms the agent reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// A full sync (everything rewritten).
    pub full: bool,
    /// Deleting stale objects failed; retried shortly (nftables' second transaction).
    pub cleanup_failed: bool,
    /// Rule counts per family and table (iptables mode's `sync_proxy_rules_iptables_*`).
    pub iptables_rules: Vec<iptables::apply::RuleCount>,
}

/// A failed sync; the kernel keeps the previous rules.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The nftables transaction failed.
    #[error("nftables sync failed")]
    Nftables(#[source] nftables::apply::Error),
    /// `iptables-restore` failed.
    #[error("iptables sync failed")]
    Iptables(#[source] iptables::apply::Error),
    /// Writing the eBPF maps (or attaching the tc programs) failed.
    #[error("eBPF sync failed")]
    Ebpf(#[source] ebpf::dataplane::Error),
}

/// One BPF map's fill level (`nodeport_ebpf_map_entries{map}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapFill {
    /// The map's name (`np_services`, ...).
    pub map: &'static str,
    /// Entries it holds.
    pub entries: usize,
    /// Its `max_entries`.
    pub capacity: u32,
    /// An LRU map: it evicts its oldest entries rather than refuse new ones.
    pub lru: bool,
}

/// One dataplane, driven by the agent's sync loop.
pub trait Backend: Send {
    /// The mode this backend implements.
    fn mode(&self) -> ProxyMode;

    /// Syncs the kernel to `desired`; `changed` as in the appliers (`None`: full sync).
    fn sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncReport, Error>;

    /// Whether the next sync will be full whatever is asked (start, after a failure).
    fn needs_full_sync(&self) -> bool;

    /// Whether a partial sync notices and repairs changes made by others (then periodic
    /// syncs may be partial; otherwise every periodic sync is full).
    fn detects_drift(&self) -> bool;

    /// Fill levels of the backend's maps, read after each sync (only the eBPF dataplane has
    /// maps of a fixed size).
    fn map_fill(&self) -> Vec<MapFill> {
        Vec::new()
    }
}

impl<K: nftables::apply::Kernel> Backend for nftables::apply::Applier<K> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncReport, Error> {
        let r = nftables::apply::Applier::sync(self, desired, config, changed)
            .map_err(Error::Nftables)?;
        Ok(SyncReport {
            full: r.full,
            cleanup_failed: r.cleanup_failed,
            iptables_rules: Vec::new(),
        })
    }

    fn needs_full_sync(&self) -> bool {
        nftables::apply::Applier::needs_full_sync(self)
    }

    fn detects_drift(&self) -> bool {
        nftables::apply::Applier::detects_drift(self)
    }
}

impl<K: iptables::apply::Kernel> Backend for iptables::apply::Applier<K> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncReport, Error> {
        let r = iptables::apply::Applier::sync(self, desired, config, changed)
            .map_err(Error::Iptables)?;
        Ok(SyncReport {
            full: r.full,
            cleanup_failed: false,
            iptables_rules: r.rules,
        })
    }

    fn needs_full_sync(&self) -> bool {
        iptables::apply::Applier::needs_full_sync(self)
    }

    /// Every iptables sync rewrites the top-level chains, and a missing canary chain turns
    /// it into a full one (kube-proxy's `iptables.Monitor`): periodic syncs can be partial.
    fn detects_drift(&self) -> bool {
        true
    }
}

impl Backend for ebpf::dataplane::Dataplane {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    /// `config` is not read: `--masquerade-all` and `--cluster-cidr` reach the dataplane
    /// through its render configuration, set when `agent::run` starts it.
    fn sync(
        &mut self,
        desired: &DesiredState,
        _config: &NodeConfig,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncReport, Error> {
        let r = ebpf::dataplane::Dataplane::sync(self, desired, changed).map_err(Error::Ebpf)?;
        Ok(SyncReport {
            full: r.full,
            cleanup_failed: false,
            iptables_rules: Vec::new(),
        })
    }

    fn needs_full_sync(&self) -> bool {
        ebpf::dataplane::Dataplane::needs_full_sync(self)
    }

    /// A partial sync writes only the changed services' entries; entries changed by others
    /// (`bpftool map delete`) are found only by a full sync's comparison with the maps, so
    /// every periodic sync is full.
    fn detects_drift(&self) -> bool {
        false
    }

    fn map_fill(&self) -> Vec<MapFill> {
        match self.fill() {
            Ok(levels) => levels
                .into_iter()
                .map(|(map, entries, capacity)| MapFill {
                    map,
                    entries,
                    capacity,
                    lru: ebpf::programs::LRU_MAPS.contains(&map),
                })
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "reading the eBPF map fill levels failed");
                Vec::new()
            }
        }
    }
}
