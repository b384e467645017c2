//! The applier: writes the rendered frontends and backend sets into the maps, Service by
//! Service, so that a packet never sees a half-written Service, and collects stale
//! connections.
//!
//! # Order of writes for one service port (Calico's fresh-id scheme)
//!
//! 1. Every backend set whose content changed is written under a **fresh** set id: its
//!    backends at ordinals `1..=n`, their membership entries (only where the programs read
//!    them: UDP service ports and session affinity, as Cilium keeps its affinity match map
//!    for affinity services only), its Maglev table.
//! 2. Source ranges that are new are added.
//! 3. Each frontend whose value changed is written in one map update: it now names the new
//!    set id and count. Frontends that went away are deleted.
//! 4. Sets no frontend names any more are deleted, then ranges no longer wanted.
//!
//! A lookup therefore sees either the old frontend and its complete old set, or the new
//! frontend and its complete new set. Established connections keep their backend through
//! `np_ct`, whatever the frontend says.
//!
//! # The mirror, full syncs and take-over
//!
//! The applier keeps what it wrote (`installed`): a sync compares the rendered Services with
//! it and writes only what differs, so an unchanged Service costs no `bpf()` call. A full sync
//! first finds what others changed, so that a service port whose entries the maps no longer
//! hold as written is written again whole (fresh set ids, then its frontends), as kube-proxy's
//! full syncs repair hand edits of its rules. Nothing is read back after the writes.
//!
//! - The first full sync, one after a failure, and one an hour after the last (kube-proxy's
//!   `FullSyncPeriod`) **walk** each map the applier owns once (`KernelView`, two calls per
//!   entry: next key and lookup; aya 0.14 has no batched lookups): every entry compared, and
//!   entries the applier did not write deleted after the writes.
//! - The other full syncs (the periodic resync, every `--sync-period`) **look up** the
//!   applier's own entries instead, one call each: every frontend (what decides where traffic
//!   goes), and a rotating share of the backend sets ([`CHECK_BACKENDS_PER_SYNC`] entries per
//!   sync), so that a resync costs a fraction of a walk. Entries added by others wait for the
//!   next walk.
//!
//! On its first sync the
//! applier takes the service ids of the frontends an earlier run left (so that affinity
//! survives a restart); set ids start above any found. Full syncs also write the cluster
//! CIDRs (`--cluster-cidr`) into the source-range trie under service id 0
//! (`CLUSTER_CIDRS_ID`), which the routed ClusterIP frontends consult.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

use super::maglev;
use super::maps::{
    BackendEntry, CLUSTER_CIDRS_ID, CT_CLOSING, CT_REPLY, Frontend, FrontendKey, MemberKey,
    SVC_AFFINITY, Tuple, names,
};
use super::programs::{self, Maps};
use super::render::{Algorithm, RenderConfig, ServiceMaps, SetKey, render_service};
use crate::desired::DesiredState;
use crate::model::{IpFamily, ServicePortName};

/// A failed sync: the maps keep what was written so far, every Service whole.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A map operation failed.
    #[error("writing the eBPF maps")]
    Maps(#[source] programs::Error),
}

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// A full sync (everything compared, stale entries swept).
    pub full: bool,
    /// Service ports written (their frontends or sets changed).
    pub services_written: usize,
    /// Map updates and deletions issued.
    pub map_operations: usize,
}

/// What the applier wrote for one service port.
#[derive(Debug, Clone)]
struct Installed {
    svc_id: u32,
    maps: ServiceMaps,
    set_ids: BTreeMap<SetKey, u32>,
}

/// Connection lifetimes for the collector (Cilium's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP with a reply seen (`bpf-ct-timeout-regular-tcp`, 6 h).
    pub tcp: Duration,
    /// TCP before any reply, and after FIN or RST (`bpf-ct-timeout-regular-tcp-fin`, 10 s;
    /// Cilium uses 60 s for SYN, we use one figure).
    pub tcp_closing: Duration,
    /// UDP idle time (`bpf-ct-timeout-regular-any`, 60 s).
    pub udp: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            tcp: Duration::from_secs(6 * 3600),
            tcp_closing: Duration::from_secs(10),
            udp: Duration::from_secs(60),
        }
    }
}

/// How often a full sync walks every map rather than looking up the applier's own entries
/// (kube-proxy's `FullSyncPeriod`).
pub const WALK_EVERY: Duration = Duration::from_secs(3600);

/// Backend entries a full sync that does not walk looks up (a rotating share of the sets,
/// whole sets at a time).
pub const CHECK_BACKENDS_PER_SYNC: usize = 8192;

/// Writes desired state into the maps of a loaded object ([`programs::Programs::load`]).
#[derive(Debug)]
pub struct Applier {
    maps: Maps,
    config: RenderConfig,
    /// The mirror: what the applier wrote, per service port and family.
    installed: BTreeMap<(ServicePortName, IpFamily), Installed>,
    /// Service ids found in the maps at start, by frontend.
    adopted: HashMap<FrontendKey, u32>,
    next_svc_id: u32,
    next_be_set: u32,
    snat: BTreeMap<IpFamily, IpAddr>,
    needs_full: bool,
    started: bool,
    /// Entries of the LRU maps at the last collection (counted by its walk).
    lru_counts: BTreeMap<&'static str, usize>,
    /// When a full sync last walked the maps (`None`: never, or a sync failed since).
    last_walk: Option<std::time::Instant>,
    /// Where the next look-up of backend sets starts, in the mirror's order.
    check_cursor: usize,
}

/// What the maps the applier owns hold, read once at the start of a full sync.
#[derive(Debug, Default)]
struct KernelView {
    frontends: HashMap<FrontendKey, Frontend>,
    backends: HashMap<programs::BackendSlot, BackendEntry>,
    members: HashMap<MemberKey, u32>,
    maglev: HashSet<u32>,
    ranges: HashSet<(u32, IpNet)>,
}

impl KernelView {
    fn read(maps: &Maps) -> Result<Self, programs::Error> {
        Ok(KernelView {
            frontends: maps.frontends()?.into_iter().collect(),
            backends: maps.backends()?.into_iter().collect(),
            members: maps.members()?.into_iter().collect(),
            maglev: maps.maglev_sets()?.into_iter().collect(),
            ranges: maps.source_ranges()?.into_iter().collect(),
        })
    }

    /// Whether the maps hold everything `inst` wrote, as written. Maglev tables are checked
    /// for presence, not compared slot by slot.
    fn holds(&self, inst: &Installed, maglev: bool) -> bool {
        let sets = inst.set_ids.iter().all(|(set, id)| {
            let list = &inst.maps.sets[set];
            let members = needs_members(&inst.maps, set);
            (!maglev || self.maglev.contains(id))
                && list.iter().enumerate().all(|(i, be)| {
                    let ordinal = i as u32 + 1;
                    self.backends.get(&(*id, ordinal)) == Some(be)
                        && (!members
                            || self.members.get(&(*id, be.addr, be.port)) == Some(&ordinal))
                })
        });
        sets && inst.maps.frontends.iter().all(|(fk, spec)| {
            let value = frontend_value(inst.svc_id, spec, &inst.maps, &inst.set_ids);
            self.frontends.get(fk) == Some(&value)
        }) && ranges_of(inst)
            .iter()
            .all(|net| self.ranges.contains(&(inst.svc_id, *net)))
    }
}

impl Applier {
    /// An applier over `maps`; the first sync is full.
    pub fn new(maps: Maps, config: RenderConfig) -> Self {
        Applier {
            maps,
            config,
            installed: BTreeMap::new(),
            adopted: HashMap::new(),
            next_svc_id: 1,
            next_be_set: 1,
            snat: BTreeMap::new(),
            needs_full: true,
            started: false,
            lru_counts: BTreeMap::new(),
            last_walk: None,
            check_cursor: 0,
        }
    }

    /// The maps.
    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// The maps, to change behind the applier's back (tools and tests): the next full sync
    /// finds what no longer matches what it wrote, and repairs it.
    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// Sets the node's local addresses (for NodePort selections that match them all); a
    /// change makes the next sync full.
    pub fn set_local_ips(&mut self, ips: Vec<IpAddr>) {
        if self.config.local_ips != ips {
            self.config.local_ips = ips;
            self.needs_full = true;
        }
    }

    /// Whether the next sync is full whatever is asked.
    pub fn needs_full_sync(&self) -> bool {
        self.needs_full
    }

    /// Syncs the maps to `desired`: the service ports in `changed` only, or everything
    /// (`None`, or when a full sync is due).
    pub fn sync(
        &mut self,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncReport, Error> {
        let full = changed.is_none() || self.needs_full;
        match self.sync_inner(desired, changed, full) {
            Ok(report) => {
                self.needs_full = false;
                Ok(report)
            }
            Err(e) => {
                self.needs_full = true;
                self.last_walk = None;
                Err(Error::Maps(e))
            }
        }
    }

    fn sync_inner(
        &mut self,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
        full: bool,
    ) -> Result<SyncReport, programs::Error> {
        let mut report = SyncReport {
            full,
            ..Default::default()
        };
        let walk = full && self.last_walk.is_none_or(|t| t.elapsed() >= WALK_EVERY);
        let view = if walk {
            Some(KernelView::read(&self.maps)?)
        } else {
            None
        };
        if !self.started {
            let flags = if self.config.fib_forward {
                super::maps::FLAG_FIB_FORWARD
            } else {
                0
            };
            self.maps.set_flags(flags)?;
            if let Some(view) = &view {
                self.adopt(view);
            }
            self.started = true;
        }
        for fam in &desired.families {
            if let Some(&ip) = fam.node_ips.first()
                && self.snat.get(&fam.family) != Some(&ip)
            {
                self.maps.set_snat_address(ip)?;
                self.snat.insert(fam.family, ip);
            }
        }
        let mut todo: BTreeSet<(ServicePortName, IpFamily)> = BTreeSet::new();
        // Service ports whose entries others changed: written again whole.
        let mut damaged: BTreeSet<(ServicePortName, IpFamily)> = BTreeSet::new();
        if let Some(view) = &view {
            // The cluster CIDRs (`SVC_SNAT_OFF_CLUSTER`) before any frontend that needs them.
            for net in &self.config.cluster_cidrs {
                if !view.ranges.contains(&(CLUSTER_CIDRS_ID, net.trunc())) {
                    self.maps.add_source_range(CLUSTER_CIDRS_ID, net.trunc())?;
                    report.map_operations += 1;
                }
            }
            let maglev = self.config.algorithm == Algorithm::Maglev;
            damaged.extend(
                self.installed
                    .iter()
                    .filter(|(_, inst)| !view.holds(inst, maglev))
                    .map(|(key, _)| key.clone()),
            );
        } else if full {
            damaged.extend(self.look_up_own_entries()?);
        }
        if !damaged.is_empty() {
            tracing::info!(
                service_ports = damaged.len(),
                "eBPF map entries changed by others: their service ports are written again"
            );
        }
        if full {
            todo.extend(self.installed.keys().cloned());
            for fam in &desired.families {
                todo.extend(fam.services.keys().map(|n| (n.clone(), fam.family)));
            }
        } else if let Some(changed) = changed {
            for name in changed {
                for family in IpFamily::ALL {
                    todo.insert((name.clone(), family));
                }
            }
        }
        for (name, family) in todo {
            let fresh = desired.family(family).and_then(|fam| {
                fam.services
                    .get(&name)
                    .map(|svc| render_service(svc, fam, &self.config))
            });
            let force = damaged.contains(&(name.clone(), family));
            let ops = self.apply_service(&name, family, fresh, force)?;
            if ops > 0 {
                report.services_written += 1;
                report.map_operations += ops;
            }
        }
        if let Some(view) = &view {
            report.map_operations += self.sweep(view)?;
            self.adopted.clear();
            self.last_walk = Some(std::time::Instant::now());
        }
        Ok(report)
    }

    /// The light check of a full sync that does not walk: every frontend the applier wrote,
    /// and about [`CHECK_BACKENDS_PER_SYNC`] backend entries (with their membership entries
    /// and Maglev tables) from where the last check stopped, looked up one by one. Returns
    /// the service ports the maps no longer hold as written.
    fn look_up_own_entries(
        &mut self,
    ) -> Result<BTreeSet<(ServicePortName, IpFamily)>, programs::Error> {
        let maglev = self.config.algorithm == Algorithm::Maglev;
        let mut damaged = BTreeSet::new();
        for (key, inst) in &self.installed {
            for (fk, spec) in &inst.maps.frontends {
                let value = frontend_value(inst.svc_id, spec, &inst.maps, &inst.set_ids);
                if self.maps.frontend(fk)? != Some(value) {
                    damaged.insert(key.clone());
                    break;
                }
            }
        }
        let n = self.installed.len();
        let start = if n == 0 { 0 } else { self.check_cursor % n };
        let mut checked = 0;
        let mut visited = 0;
        for (key, inst) in self
            .installed
            .iter()
            .skip(start)
            .chain(self.installed.iter().take(start))
        {
            if checked >= CHECK_BACKENDS_PER_SYNC {
                break;
            }
            visited += 1;
            'sets: for (set, id) in &inst.set_ids {
                let list = &inst.maps.sets[set];
                let members = needs_members(&inst.maps, set);
                checked += list.len();
                if maglev && !self.maps.has_maglev(*id)? {
                    damaged.insert(key.clone());
                    break;
                }
                for (i, be) in list.iter().enumerate() {
                    let ordinal = i as u32 + 1;
                    if self.maps.backend(*id, ordinal)? != Some(*be)
                        || (members && self.maps.member(*id, be.addr, be.port)? != Some(ordinal))
                    {
                        damaged.insert(key.clone());
                        break 'sets;
                    }
                }
            }
        }
        self.check_cursor = start + visited;
        Ok(damaged)
    }

    /// Takes the service ids of the frontends an earlier run left, and the ids in use.
    fn adopt(&mut self, view: &KernelView) {
        for (key, fe) in &view.frontends {
            self.adopted.insert(*key, fe.svc_id);
            self.next_svc_id = self.next_svc_id.max(fe.svc_id + 1);
            self.next_be_set = self.next_be_set.max(fe.be_set + 1);
        }
        let sets = view
            .backends
            .keys()
            .map(|(set, _)| *set)
            .chain(view.members.keys().map(|(set, _, _)| *set))
            .chain(view.maglev.iter().copied());
        for set in sets {
            self.next_be_set = self.next_be_set.max(set + 1);
        }
    }

    fn fresh_set(&mut self) -> u32 {
        let id = self.next_be_set;
        self.next_be_set = self.next_be_set.wrapping_add(1).max(1);
        id
    }

    /// Brings one service port of one family from what is installed to `fresh`; returns
    /// the map operations issued. `force`: the maps no longer hold what is installed, so
    /// every set is written under a fresh id and every frontend written again.
    fn apply_service(
        &mut self,
        name: &ServicePortName,
        family: IpFamily,
        fresh: Option<ServiceMaps>,
        force: bool,
    ) -> Result<usize, programs::Error> {
        let key = (name.clone(), family);
        let old = self.installed.remove(&key);
        if name.protocol == crate::model::Protocol::Sctp && old.is_none() && fresh.is_some() {
            // Rendered empty; said once per port and family.
            tracing::warn!(service = %name, family = family.as_str(), "{}", super::render::SCTP_NOT_SERVED);
        }
        let Some(fresh) = fresh else {
            return match old {
                Some(old) => self.remove_all(&old),
                None => Ok(0),
            };
        };
        if let Some(old) = &old
            && old.maps == fresh
            && !force
        {
            self.installed.insert(key, old.clone());
            return Ok(0);
        }
        let mut ops = 0;
        let svc_id = match &old {
            Some(o) => o.svc_id,
            None => {
                let adopted = fresh
                    .frontends
                    .keys()
                    .find_map(|k| self.adopted.get(k).copied());
                adopted.unwrap_or_else(|| {
                    let id = self.next_svc_id;
                    self.next_svc_id += 1;
                    id
                })
            }
        };
        // 1. Backend sets: unchanged ones keep their id, changed ones get a fresh one.
        let mut set_ids = BTreeMap::new();
        for (set, list) in &fresh.sets {
            let members = needs_members(&fresh, set);
            let kept = old.as_ref().filter(|_| !force).and_then(|o| {
                (o.maps.sets.get(set) == Some(list) && needs_members(&o.maps, set) == members)
                    .then(|| o.set_ids.get(set).copied())
                    .flatten()
            });
            let id = match kept {
                Some(id) => id,
                None => {
                    let id = self.fresh_set();
                    ops += self.write_set(id, list, members)?;
                    id
                }
            };
            set_ids.insert(set.clone(), id);
        }
        // 2. New source ranges (all of them when forced: adding is idempotent).
        let old_ranges = old.as_ref().map(ranges_of).unwrap_or_default();
        let new_ranges = ranges_of_maps(&fresh);
        for net in &new_ranges {
            if force || !old_ranges.contains(net) {
                self.maps.add_source_range(svc_id, *net)?;
                ops += 1;
            }
        }
        // 3. Frontends, each switched in one update.
        for (fk, spec) in &fresh.frontends {
            let value = frontend_value(svc_id, spec, &fresh, &set_ids);
            let before = old.as_ref().filter(|_| !force).and_then(|o| {
                o.maps
                    .frontends
                    .get(fk)
                    .map(|s| frontend_value(o.svc_id, s, &o.maps, &o.set_ids))
            });
            if before != Some(value) {
                self.maps.set_frontend(fk, &value)?;
                ops += 1;
            }
        }
        if let Some(old) = &old {
            for fk in old.maps.frontends.keys() {
                if !fresh.frontends.contains_key(fk) {
                    self.maps.remove_frontend(fk)?;
                    ops += 1;
                }
            }
            // 4. Sets no longer named, then ranges no longer wanted.
            let live: BTreeSet<u32> = set_ids.values().copied().collect();
            for (set, id) in &old.set_ids {
                if !live.contains(id) {
                    let members = needs_members(&old.maps, set);
                    ops += self.delete_set(*id, &old.maps.sets[set], members)?;
                }
            }
            for net in old_ranges.difference(&new_ranges) {
                self.maps.remove_source_range(svc_id, *net)?;
                ops += 1;
            }
        }
        self.installed.insert(
            key,
            Installed {
                svc_id,
                maps: fresh,
                set_ids,
            },
        );
        Ok(ops)
    }

    fn remove_all(&mut self, old: &Installed) -> Result<usize, programs::Error> {
        let mut ops = 0;
        for fk in old.maps.frontends.keys() {
            self.maps.remove_frontend(fk)?;
            ops += 1;
        }
        for (set, id) in &old.set_ids {
            let members = needs_members(&old.maps, set);
            ops += self.delete_set(*id, &old.maps.sets[set], members)?;
        }
        for net in ranges_of(old) {
            self.maps.remove_source_range(old.svc_id, net)?;
            ops += 1;
        }
        Ok(ops)
    }

    fn write_set(
        &mut self,
        id: u32,
        list: &[BackendEntry],
        members: bool,
    ) -> Result<usize, programs::Error> {
        for (i, be) in list.iter().enumerate() {
            if members {
                self.maps.set_backend(id, i as u32 + 1, be)?;
            } else {
                self.maps.set_backend_slot(id, i as u32 + 1, be)?;
            }
        }
        let mut ops = if members { 2 } else { 1 } * list.len();
        if self.config.algorithm == Algorithm::Maglev {
            let names: Vec<String> = list
                .iter()
                .map(|b| std::net::SocketAddr::new(b.addr, b.port).to_string())
                .collect();
            self.maps.set_maglev(id, &maglev::table(&names))?;
            ops += 1;
        }
        Ok(ops)
    }

    fn delete_set(
        &mut self,
        id: u32,
        list: &[BackendEntry],
        members: bool,
    ) -> Result<usize, programs::Error> {
        let mut ops = 0;
        if self.config.algorithm == Algorithm::Maglev {
            self.maps.remove_maglev(id)?;
            ops += 1;
        }
        for (i, be) in list.iter().enumerate() {
            if members {
                self.maps.remove_backend(id, i as u32 + 1, be)?;
                ops += 2;
            } else {
                self.maps.remove_backend_slot(id, i as u32 + 1)?;
                ops += 1;
            }
        }
        Ok(ops)
    }

    /// Deletes whatever the maps held at the start of this full sync (`view`) that the
    /// applier has not written: entries of an earlier run, or added by others. Entries
    /// written during the sync are in the mirror, so they are never taken for strays.
    fn sweep(&mut self, view: &KernelView) -> Result<usize, programs::Error> {
        let mut ops = 0;
        let frontends: HashSet<FrontendKey> = self
            .installed
            .values()
            .flat_map(|i| i.maps.frontends.keys().copied())
            .collect();
        // Set id → (its backends, whether it has membership entries).
        let sets: HashMap<u32, (&[BackendEntry], bool)> = self
            .installed
            .values()
            .flat_map(|i| {
                i.set_ids.iter().map(|(set, id)| {
                    (
                        *id,
                        (i.maps.sets[set].as_slice(), needs_members(&i.maps, set)),
                    )
                })
            })
            .collect();
        let ranges: HashSet<(u32, IpNet)> = self
            .installed
            .values()
            .flat_map(|i| ranges_of(i).into_iter().map(|n| (i.svc_id, n)))
            .chain(
                self.config
                    .cluster_cidrs
                    .iter()
                    .map(|n| (CLUSTER_CIDRS_ID, n.trunc())),
            )
            .collect();
        let stray_frontends: Vec<FrontendKey> = view
            .frontends
            .keys()
            .filter(|k| !frontends.contains(k))
            .copied()
            .collect();
        let stray_slots: Vec<programs::BackendSlot> = view
            .backends
            .keys()
            .filter(|(set, ordinal)| {
                sets.get(set)
                    .is_none_or(|(list, _)| *ordinal == 0 || *ordinal as usize > list.len())
            })
            .copied()
            .collect();
        let stray_members: Vec<MemberKey> = view
            .members
            .keys()
            .filter(|(set, addr, port)| {
                sets.get(set).is_none_or(|(list, members)| {
                    !members || !list.iter().any(|b| b.addr == *addr && b.port == *port)
                })
            })
            .copied()
            .collect();
        let stray_maglev: Vec<u32> = view
            .maglev
            .iter()
            .filter(|set| self.config.algorithm != Algorithm::Maglev || !sets.contains_key(set))
            .copied()
            .collect();
        let stray_ranges: Vec<(u32, IpNet)> = view
            .ranges
            .iter()
            .filter(|r| !ranges.contains(r))
            .copied()
            .collect();
        for key in &stray_frontends {
            self.maps.remove_frontend(key)?;
        }
        for (set, ordinal) in &stray_slots {
            self.maps.remove_backend_slot(*set, *ordinal)?;
        }
        for (set, addr, port) in &stray_members {
            self.maps.remove_member(*set, *addr, *port)?;
        }
        for set in &stray_maglev {
            self.maps.remove_maglev(*set)?;
        }
        for (svc_id, net) in &stray_ranges {
            self.maps.remove_source_range(*svc_id, *net)?;
        }
        ops += stray_frontends.len()
            + stray_slots.len()
            + stray_members.len()
            + stray_maglev.len()
            + stray_ranges.len();
        Ok(ops)
    }

    /// Entries of each map the applier owns, from the mirror (exact after a sync: a full
    /// sync removes what it did not write), and of the LRU maps as counted by the last
    /// collection ([`Applier::collect`]); in [`names::ALL`]'s order, without the arrays.
    pub fn entry_counts(&self) -> Vec<(&'static str, usize)> {
        let mut frontends = 0;
        let mut backends = 0;
        let mut members = 0;
        let mut sets = 0;
        let mut ranges = self.config.cluster_cidrs.len();
        for inst in self.installed.values() {
            frontends += inst.maps.frontends.len();
            ranges += ranges_of(inst).len();
            for set in inst.set_ids.keys() {
                let n = inst.maps.sets[set].len();
                backends += n;
                sets += 1;
                if needs_members(&inst.maps, set) {
                    members += n;
                }
            }
        }
        let maglev = if self.config.algorithm == Algorithm::Maglev {
            sets
        } else {
            0
        };
        let lru = |name| self.lru_counts.get(name).copied().unwrap_or(0);
        vec![
            (names::SERVICES, frontends),
            (names::BACKENDS, backends),
            (names::MEMBERS, members),
            (names::CT, lru(names::CT)),
            (names::NAT, lru(names::NAT)),
            (names::AFFINITY, lru(names::AFFINITY)),
            (names::SOURCE_RANGES, ranges),
            (names::MAGLEV, maglev),
            (names::SOCK_REV, lru(names::SOCK_REV)),
        ]
    }
    /// Every backend of a UDP service port in the maps.
    pub fn udp_backends(&self) -> BTreeSet<std::net::SocketAddr> {
        self.installed
            .iter()
            .filter(|((name, _), _)| name.protocol == crate::model::Protocol::Udp)
            .flat_map(|(_, i)| i.maps.sets.values().flatten())
            .map(|b| std::net::SocketAddr::new(b.addr, b.port))
            .collect()
    }

    /// The conntrack collector: deletes connections idle past their timeout, and UDP
    /// connections whose backend no longer belongs to any backend set (kube-proxy clears
    /// UDP conntrack entries of removed endpoints; TCP connections keep going until they
    /// end). `now_ns` is `CLOCK_MONOTONIC`, the clock of `bpf_ktime_get_ns()`. Returns the
    /// entries deleted.
    pub fn collect(&mut self, now_ns: u64, timeouts: &Timeouts) -> Result<usize, Error> {
        let live: BTreeSet<(IpAddr, u16)> = self
            .installed
            .values()
            .flat_map(|i| i.maps.sets.values().flatten().map(|b| (b.addr, b.port)))
            .collect();
        let expired = |t: &Tuple, flags: u8, last: u64, backend: (IpAddr, u16)| {
            let idle = Duration::from_nanos(now_ns.saturating_sub(last));
            if t.proto == 6 {
                let closing = flags & CT_CLOSING != 0 || flags & CT_REPLY == 0;
                idle > if closing {
                    timeouts.tcp_closing
                } else {
                    timeouts.tcp
                }
            } else {
                idle > timeouts.udp || !live.contains(&backend)
            }
        };
        let mut deleted = 0;
        for nat in [false, true] {
            let entries = if nat {
                self.maps.nat()
            } else {
                self.maps.conntrack()
            }
            .map_err(Error::Maps)?;
            let name = if nat { names::NAT } else { names::CT };
            let stale: Vec<Tuple> = entries
                .iter()
                .filter(|(k, v)| {
                    // Forward entries name the backend as their new destination; reply
                    // entries are keyed by the backend's source.
                    let backend = if nat {
                        (k.saddr, k.sport)
                    } else {
                        (v.daddr, v.dport)
                    };
                    expired(k, v.flags, v.last_seen_ns, backend)
                })
                .map(|(k, _)| *k)
                .collect();
            deleted += stale.len();
            self.lru_counts.insert(name, entries.len() - stale.len());
            self.maps
                .remove_connections(nat, &stale)
                .map_err(Error::Maps)?;
        }
        for name in [names::AFFINITY, names::SOCK_REV] {
            let n = self.maps.lru_entries(name).map_err(Error::Maps)?;
            self.lru_counts.insert(name, n);
        }
        Ok(deleted)
    }
}

/// The map value of a frontend whose sets have the ids `set_ids`.
fn frontend_value(
    svc_id: u32,
    spec: &super::render::FrontendSpec,
    maps: &ServiceMaps,
    set_ids: &BTreeMap<SetKey, u32>,
) -> Frontend {
    Frontend {
        svc_id,
        be_set: spec
            .set
            .as_ref()
            .and_then(|s| set_ids.get(s).copied())
            .unwrap_or(0),
        count: spec
            .set
            .as_ref()
            .and_then(|s| maps.sets.get(s))
            // The programs count backends in 16 bits: a set beyond 65,535 endpoints uses its
            // first 65,535 (kube-proxy has no such limit; EndpointSlices rarely come close).
            .map_or(0, |l| l.len().min(usize::from(u16::MAX)) as u16),
        flags: spec.flags,
        affinity_timeout: spec.affinity_timeout,
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns()`, which stamps the
/// connections' last use.
pub fn monotonic_now_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        (t.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(t.tv_nsec() as u64)
    })
}

/// Whether a backend set gets membership entries: the programs read `np_members` to check a
/// UDP flow's backend against the frontend's current set, and a remembered affinity choice;
/// a TCP set without affinity is only ever read by ordinal.
fn needs_members(maps: &ServiceMaps, set: &SetKey) -> bool {
    set.port.protocol == crate::model::Protocol::Udp
        || maps
            .frontends
            .values()
            .any(|f| f.set.as_ref() == Some(set) && f.flags & SVC_AFFINITY != 0)
}

fn ranges_of_maps(maps: &ServiceMaps) -> BTreeSet<IpNet> {
    maps.frontends
        .values()
        .flat_map(|f| f.source_ranges.iter().copied())
        .collect()
}

fn ranges_of(i: &Installed) -> BTreeSet<IpNet> {
    ranges_of_maps(&i.maps)
}
