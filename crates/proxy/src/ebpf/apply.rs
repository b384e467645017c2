//! The applier: writes the rendered frontends and backend sets into the maps, so that a
//! packet never sees a half-written Service, and collects stale connections.
//!
//! # Order of writes (Calico's fresh-id scheme, in batched phases)
//!
//! A sync first decides every entry it writes or removes, then issues them in phases, each
//! phase one batched `bpf()` call per map ([`super::batch`]; `BPF_MAP_UPDATE_BATCH` applies
//! its entries one after the other, each one atomically):
//!
//! 1. Every backend set whose content changed is written under a **fresh** set id: its
//!    backends at ordinals `1..=n`, their membership entries (only where the programs read
//!    them: UDP service ports and session affinity, as Cilium keeps its affinity match map
//!    for affinity services only), its Maglev table.
//! 2. Source ranges that are new are added, and the names of new service ports
//!    (`np_svc_names`: service id → `namespace/name:port/PROTO`, which no program reads; for
//!    `nodeport trace`, so that a frontend is named before it is written).
//! 3. Each frontend whose value changed is written, in one update each: it now names the new
//!    set id and count.
//! 4. Frontends that went away are deleted (unless another service port took the key over in
//!    the same sync).
//! 5. Sets no frontend names any more are deleted (Maglev tables, backends, membership), then
//! 6. ranges no longer wanted, and the names of service ports gone.
//!
//! A frontend is written only after everything it names, whichever Service it belongs to, and
//! nothing is deleted before every frontend has left it. A lookup therefore sees either the
//! old frontend and its complete old set, or the new frontend and its complete new set.
//! Established connections keep their backend through `np_ct`, whatever the frontend says.
//! A sync that fails part-way leaves each frontend on a complete set; the next sync walks the
//! maps and repairs the rest (see below).
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
//!   `FullSyncPeriod`) **walk** each map the applier owns once (`KernelView`: batched
//!   look-ups, `BPF_MAP_LOOKUP_BATCH`, a few calls per map; key walks for the few Maglev
//!   tables and source ranges): every entry compared, and entries the applier did not write
//!   deleted after the writes (with the phases 4 to 6). A first sync over maps this
//!   process's load created ([`Maps::known_empty`]: no pins taken over, nothing written
//!   since) reads nothing: a walk of an empty hash map still visits every bucket.
//! - The other full syncs (the periodic resync, every `--sync-period`) **check** the
//!   applier's own entries instead: every frontend (what decides where traffic goes; the
//!   frontend map read in batches), and a rotating share of the backend sets
//!   ([`CHECK_BACKENDS_PER_SYNC`] entries per sync, a look-up each), so that a resync costs
//!   a fraction of a walk. Entries added by others wait for the next walk.
//!
//! On its first sync the
//! applier takes the service ids of the frontends an earlier run left (so that affinity
//! survives a restart, and the names written then still name them); set ids start above any
//! found. The walk also compares the names: a service port whose name the map lacks or holds
//! otherwise is written again, and names of ids no service port has are deleted. (The lighter
//! check between walks looks at frontends and backends only.) Full syncs also write the cluster
//! CIDRs (`--cluster-cidr`) into the source-range trie under service id 0
//! (`CLUSTER_CIDRS_ID`), which the routed ClusterIP frontends consult.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

use super::maglev;
use super::maps::{
    BackendEntry, CLUSTER_CIDRS_ID, CT_CLOSING, CT_REPLY, Frontend, FrontendKey, MemberKey,
    SVC_AFFINITY, SVC_NAME_LEN, Tuple, names, svc_name,
};
use super::programs::{self, Maps};
use super::render::{
    Algorithm, FamilyContext, RenderConfig, ServiceMaps, SetKey, render_service, render_service_in,
};
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
    /// Where the sync's time went, in order.
    pub phases: Vec<Phase>,
}

/// One step of a sync and its time: wall clock, and the CPU time of the thread that ran it
/// (which a loaded machine inflates less).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phase {
    /// What was done.
    pub name: &'static str,
    /// Wall-clock time.
    pub wall: Duration,
    /// The syncing thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`).
    pub cpu: Duration,
}

/// Times the phases of a sync one after the other.
#[derive(Debug)]
pub(crate) struct Phases {
    wall: std::time::Instant,
    cpu: Duration,
    done: Vec<Phase>,
}

fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map_or(Duration::ZERO, Duration::from)
}

impl Phases {
    /// Starts the first phase now.
    pub(crate) fn start() -> Self {
        Phases {
            wall: std::time::Instant::now(),
            cpu: thread_cpu(),
            done: Vec::new(),
        }
    }

    /// Ends the current phase as `name`, and starts the next.
    pub(crate) fn end(&mut self, name: &'static str) {
        let (wall, cpu) = (std::time::Instant::now(), thread_cpu());
        self.done.push(Phase {
            name,
            wall: wall - self.wall,
            cpu: cpu.saturating_sub(self.cpu),
        });
        (self.wall, self.cpu) = (wall, cpu);
    }

    /// The phases ended so far.
    pub(crate) fn take(&mut self) -> Vec<Phase> {
        std::mem::take(&mut self.done)
    }
}

/// What the applier wrote for one service port.
#[derive(Debug, Clone)]
struct Installed {
    svc_id: u32,
    maps: ServiceMaps,
    set_ids: BTreeMap<SetKey, u32>,
}

/// The map writes of one sync, staged so that they are issued in the order that keeps every
/// Service whole (the phases of the module doc), one batched call per map and phase.
#[derive(Debug, Default)]
struct Writes {
    /// Phase 1: the backends of fresh sets.
    backends: Vec<(programs::BackendSlot, BackendEntry)>,
    /// Phase 1: their membership entries.
    members: Vec<(MemberKey, u32)>,
    /// Phase 1: their Maglev tables.
    maglev: Vec<(u32, Vec<u32>)>,
    /// Phase 2.
    ranges_added: Vec<(u32, IpNet)>,
    /// Phase 2: names of service ports (by service id).
    names: Vec<(u32, ServicePortName)>,
    /// Phase 3.
    frontends: Vec<(FrontendKey, Frontend)>,
    /// Phase 4.
    frontends_removed: Vec<FrontendKey>,
    /// Phase 5.
    maglev_removed: Vec<u32>,
    /// Phase 5.
    backends_removed: Vec<programs::BackendSlot>,
    /// Phase 5.
    members_removed: Vec<MemberKey>,
    /// Phase 6.
    ranges_removed: Vec<(u32, IpNet)>,
    /// Phase 6: names of service ports gone.
    names_removed: Vec<u32>,
}

impl Writes {
    /// Map operations staged.
    fn operations(&self) -> usize {
        self.backends.len()
            + self.members.len()
            + self.maglev.len()
            + self.ranges_added.len()
            + self.names.len()
            + self.frontends.len()
            + self.frontends_removed.len()
            + self.maglev_removed.len()
            + self.backends_removed.len()
            + self.members_removed.len()
            + self.ranges_removed.len()
            + self.names_removed.len()
    }

    /// Issues the writes, phase by phase; `between` is called after each batched call with
    /// what it wrote.
    fn flush(
        mut self,
        maps: &mut Maps,
        between: &mut dyn FnMut(&'static str),
    ) -> Result<(), programs::Error> {
        maps.set_backends(&self.backends)?;
        between("backends");
        maps.set_members(&self.members)?;
        between("members");
        for (set, table) in &self.maglev {
            maps.set_maglev(*set, table)?;
        }
        between("Maglev tables");
        for (svc_id, net) in &self.ranges_added {
            maps.add_source_range(*svc_id, *net)?;
        }
        between("source ranges");
        maps.set_names(&self.names)?;
        between("names");
        maps.set_frontends(&self.frontends)?;
        between("frontends");
        // A key another service port wrote in this sync is its frontend now, not a leftover.
        if !self.frontends_removed.is_empty() {
            let written: HashSet<FrontendKey> = self.frontends.iter().map(|(k, _)| *k).collect();
            self.frontends_removed.retain(|k| !written.contains(k));
        }
        // A walk's sweep finds the sets this sync let go again: each key once (a key the
        // map no longer holds costs a batch call of its own).
        self.frontends_removed.sort_unstable();
        self.frontends_removed.dedup();
        self.maglev_removed.sort_unstable();
        self.maglev_removed.dedup();
        self.backends_removed.sort_unstable();
        self.backends_removed.dedup();
        self.members_removed.sort_unstable();
        self.members_removed.dedup();
        self.ranges_removed.sort_unstable();
        self.ranges_removed.dedup();
        self.names_removed.sort_unstable();
        self.names_removed.dedup();
        maps.remove_frontends(&self.frontends_removed)?;
        between("frontends removed");
        maps.remove_maglevs(&self.maglev_removed)?;
        between("Maglev tables removed");
        maps.remove_backend_slots(&self.backends_removed)?;
        between("backends removed");
        maps.remove_members(&self.members_removed)?;
        between("members removed");
        for (svc_id, net) in &self.ranges_removed {
            maps.remove_source_range(*svc_id, *net)?;
        }
        between("source ranges removed");
        maps.remove_names(&self.names_removed)?;
        between("names removed");
        Ok(())
    }
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
    names: HashMap<u32, [u8; SVC_NAME_LEN]>,
}

impl KernelView {
    fn read(maps: &Maps) -> Result<Self, programs::Error> {
        Ok(KernelView {
            frontends: maps.frontends()?.into_iter().collect(),
            backends: maps.backends()?.into_iter().collect(),
            members: maps.members()?.into_iter().collect(),
            maglev: maps.maglev_sets()?.into_iter().collect(),
            ranges: maps.source_ranges()?.into_iter().collect(),
            names: maps.names()?.into_iter().collect(),
        })
    }

    /// Whether the maps held nothing the applier owns.
    fn is_empty(&self) -> bool {
        self.frontends.is_empty()
            && self.backends.is_empty()
            && self.members.is_empty()
            && self.maglev.is_empty()
            && self.ranges.is_empty()
            && self.names.is_empty()
    }

    /// Whether the maps hold everything `inst` (of the service port `name`) wrote, as
    /// written. Maglev tables are checked for presence, not compared slot by slot.
    fn holds(&self, name: &ServicePortName, inst: &Installed, maglev: bool) -> bool {
        let named =
            inst.maps.frontends.is_empty() || self.names.get(&inst.svc_id) == Some(&svc_name(name));
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
            && named
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

    /// The maps back, the applier done with them (a proxy that stops: a new applier over
    /// them takes them over as a restarted one takes its pins over).
    pub fn into_maps(self) -> Maps {
        self.maps
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
        self.sync_observing(desired, changed, &mut |_| {})
    }

    /// [`Applier::sync`], calling `between` after each batched write with the step just
    /// done (`"backends"`, `"frontends"`, `"backends removed"`, ...), while the maps stand
    /// between two steps: tests send packets there to check that every state the programs
    /// can see is whole.
    pub fn sync_observing(
        &mut self,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
        between: &mut dyn FnMut(&'static str),
    ) -> Result<SyncReport, Error> {
        let full = changed.is_none() || self.needs_full;
        match self.sync_inner(desired, changed, full, between) {
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
        between: &mut dyn FnMut(&'static str),
    ) -> Result<SyncReport, programs::Error> {
        let mut report = SyncReport {
            full,
            ..Default::default()
        };
        let mut phases = Phases::start();
        let walk = full && self.last_walk.is_none_or(|t| t.elapsed() >= WALK_EVERY);
        let view = if walk && !self.started && self.maps.known_empty() {
            // Maps this process just created: nothing to compare, adopt or sweep.
            Some(KernelView::default())
        } else if walk {
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
        let mut writes = Writes::default();
        // Service ports whose entries others changed: written again whole.
        let mut damaged: BTreeSet<(ServicePortName, IpFamily)> = BTreeSet::new();
        if let Some(view) = &view {
            // The cluster CIDRs (`SVC_SNAT_OFF_CLUSTER`) before any frontend that needs them.
            for net in &self.config.cluster_cidrs {
                if !view.ranges.contains(&(CLUSTER_CIDRS_ID, net.trunc())) {
                    writes.ranges_added.push((CLUSTER_CIDRS_ID, net.trunc()));
                }
            }
            let maglev = self.config.algorithm == Algorithm::Maglev;
            damaged.extend(
                self.installed
                    .iter()
                    .filter(|((name, _), inst)| !view.holds(name, inst, maglev))
                    .map(|(key, _)| key.clone()),
            );
        } else if full {
            damaged.extend(self.check_own_entries()?);
        }
        phases.end(if walk {
            "reading the maps (walk)"
        } else {
            "checking own entries"
        });
        if !damaged.is_empty() {
            tracing::info!(
                service_ports = damaged.len(),
                "eBPF map entries changed by others: their service ports are written again"
            );
        }
        let mut plan = |this: &mut Self, name: &ServicePortName, family, fresh| {
            let force = damaged.contains(&(name.clone(), family));
            let before = writes.operations();
            this.plan_service(name, family, fresh, force, &mut writes);
            if writes.operations() > before {
                report.services_written += 1;
            }
        };
        if full {
            // Every desired service port, then those installed that are no longer desired.
            for fam in &desired.families {
                let ctx = FamilyContext::new(fam, &self.config);
                for (name, svc) in &fam.services {
                    let fresh = render_service_in(svc, fam, &self.config, &ctx);
                    plan(self, name, fam.family, Some(fresh));
                }
            }
            let gone: Vec<(ServicePortName, IpFamily)> = self
                .installed
                .keys()
                .filter(|(name, family)| {
                    desired
                        .family(*family)
                        .is_none_or(|fam| !fam.services.contains_key(name))
                })
                .cloned()
                .collect();
            for (name, family) in gone {
                plan(self, &name, family, None);
            }
        } else if let Some(changed) = changed {
            for name in changed {
                for family in IpFamily::ALL {
                    let fresh = desired.family(family).and_then(|fam| {
                        fam.services
                            .get(name)
                            .map(|svc| render_service(svc, fam, &self.config))
                    });
                    plan(self, name, family, fresh);
                }
            }
        }
        if let Some(view) = &view {
            self.sweep(view, &mut writes);
        }
        phases.end("rendering and planning");
        report.map_operations += writes.operations();
        writes.flush(&mut self.maps, between)?;
        phases.end("writing the maps");
        report.phases = phases.take();
        if view.is_some() {
            self.adopted.clear();
            self.last_walk = Some(std::time::Instant::now());
        }
        Ok(report)
    }

    /// The light check of a full sync that does not walk: every frontend the applier wrote
    /// (against one batched read of the frontend map), and about
    /// [`CHECK_BACKENDS_PER_SYNC`] backend entries (with their membership entries and Maglev
    /// tables) from where the last check stopped, looked up one by one. Returns the service
    /// ports the maps no longer hold as written.
    fn check_own_entries(
        &mut self,
    ) -> Result<BTreeSet<(ServicePortName, IpFamily)>, programs::Error> {
        let maglev = self.config.algorithm == Algorithm::Maglev;
        let mut damaged = BTreeSet::new();
        // Every frontend, in a few batched calls (rather than a look-up each).
        let kernel: HashMap<FrontendKey, Frontend> = self.maps.frontends()?.into_iter().collect();
        for (key, inst) in &self.installed {
            for (fk, spec) in &inst.maps.frontends {
                let value = frontend_value(inst.svc_id, spec, &inst.maps, &inst.set_ids);
                if kernel.get(fk) != Some(&value) {
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
        for id in view.names.keys() {
            self.next_svc_id = self.next_svc_id.max(id + 1);
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

    /// Stages what brings one service port of one family from what is installed to `fresh`,
    /// and records it as installed. `force`: the maps no longer hold what is installed, so
    /// every set is written under a fresh id and every frontend written again.
    fn plan_service(
        &mut self,
        name: &ServicePortName,
        family: IpFamily,
        fresh: Option<ServiceMaps>,
        force: bool,
        w: &mut Writes,
    ) {
        let key = (name.clone(), family);
        let old = self.installed.remove(&key);
        if name.protocol == crate::model::Protocol::Sctp && old.is_none() && fresh.is_some() {
            // Rendered empty; said once per port and family.
            tracing::warn!(service = %name, family = family.as_str(), "{}", super::render::SCTP_NOT_SERVED);
        }
        let Some(fresh) = fresh else {
            if let Some(old) = old {
                self.remove_all(&old, w);
            }
            return;
        };
        let old = match old {
            Some(old) if old.maps == fresh && !force => {
                self.installed.insert(key, old);
                return;
            }
            old => old,
        };
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
                    self.write_set(id, list, members, w);
                    id
                }
            };
            set_ids.insert(set.clone(), id);
        }
        // 2. The name of a new service port, or of one written again whole.
        if (old.is_none() || force) && !fresh.frontends.is_empty() {
            w.names.push((svc_id, name.clone()));
        }
        // 2. New source ranges (all of them when forced: adding is idempotent).
        let old_ranges = old.as_ref().map(ranges_of).unwrap_or_default();
        let new_ranges = ranges_of_maps(&fresh);
        for net in &new_ranges {
            if force || !old_ranges.contains(net) {
                w.ranges_added.push((svc_id, *net));
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
                w.frontends.push((*fk, value));
            }
        }
        if let Some(old) = &old {
            // 4. Frontends gone.
            for fk in old.maps.frontends.keys() {
                if !fresh.frontends.contains_key(fk) {
                    w.frontends_removed.push(*fk);
                }
            }
            // 5. Sets no longer named, then 6. ranges no longer wanted.
            let live: BTreeSet<u32> = set_ids.values().copied().collect();
            for (set, id) in &old.set_ids {
                if !live.contains(id) {
                    let members = needs_members(&old.maps, set);
                    self.delete_set(*id, &old.maps.sets[set], members, w);
                }
            }
            for net in old_ranges.difference(&new_ranges) {
                w.ranges_removed.push((svc_id, *net));
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
    }

    fn remove_all(&mut self, old: &Installed, w: &mut Writes) {
        w.frontends_removed
            .extend(old.maps.frontends.keys().copied());
        if !old.maps.frontends.is_empty() {
            w.names_removed.push(old.svc_id);
        }
        for (set, id) in &old.set_ids {
            let members = needs_members(&old.maps, set);
            self.delete_set(*id, &old.maps.sets[set], members, w);
        }
        w.ranges_removed
            .extend(ranges_of(old).into_iter().map(|net| (old.svc_id, net)));
    }

    fn write_set(&self, id: u32, list: &[BackendEntry], members: bool, w: &mut Writes) {
        for (i, be) in list.iter().enumerate() {
            let ordinal = i as u32 + 1;
            w.backends.push(((id, ordinal), *be));
            if members {
                w.members.push(((id, be.addr, be.port), ordinal));
            }
        }
        if self.config.algorithm == Algorithm::Maglev {
            let names: Vec<String> = list
                .iter()
                .map(|b| std::net::SocketAddr::new(b.addr, b.port).to_string())
                .collect();
            w.maglev.push((id, maglev::table(&names)));
        }
    }

    fn delete_set(&self, id: u32, list: &[BackendEntry], members: bool, w: &mut Writes) {
        if self.config.algorithm == Algorithm::Maglev {
            w.maglev_removed.push(id);
        }
        for (i, be) in list.iter().enumerate() {
            w.backends_removed.push((id, i as u32 + 1));
            if members {
                w.members_removed.push((id, be.addr, be.port));
            }
        }
    }

    /// Stages the deletion of whatever the maps held at the start of this full sync (`view`)
    /// that the applier has not written: entries of an earlier run, or added by others.
    /// Entries written during the sync are in the mirror, so they are never taken for
    /// strays; the deletions run after every frontend is written (phases 4 to 6).
    fn sweep(&self, view: &KernelView, w: &mut Writes) {
        if view.is_empty() {
            return;
        }
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
        w.frontends_removed.extend(
            view.frontends
                .keys()
                .filter(|k| !frontends.contains(k))
                .copied(),
        );
        w.backends_removed.extend(
            view.backends
                .keys()
                .filter(|(set, ordinal)| {
                    sets.get(set)
                        .is_none_or(|(list, _)| *ordinal == 0 || *ordinal as usize > list.len())
                })
                .copied(),
        );
        w.members_removed.extend(
            view.members
                .keys()
                .filter(|(set, addr, port)| {
                    sets.get(set).is_none_or(|(list, members)| {
                        !members || !list.iter().any(|b| b.addr == *addr && b.port == *port)
                    })
                })
                .copied(),
        );
        w.maglev_removed.extend(
            view.maglev
                .iter()
                .filter(|set| self.config.algorithm != Algorithm::Maglev || !sets.contains_key(set))
                .copied(),
        );
        w.ranges_removed
            .extend(view.ranges.iter().filter(|r| !ranges.contains(r)).copied());
        let named: HashSet<u32> = self
            .installed
            .values()
            .filter(|i| !i.maps.frontends.is_empty())
            .map(|i| i.svc_id)
            .collect();
        w.names_removed
            .extend(view.names.keys().filter(|id| !named.contains(id)).copied());
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
        let mut named = 0;
        for inst in self.installed.values() {
            frontends += inst.maps.frontends.len();
            named += usize::from(!inst.maps.frontends.is_empty());
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
            (names::SVC_NAMES, named),
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
    /// The addresses of the backends of the service port `name` (both families) as the
    /// applier last wrote them.
    pub fn backend_addresses(&self, name: &ServicePortName) -> foldhash::HashSet<IpAddr> {
        IpFamily::ALL
            .into_iter()
            .filter_map(|family| self.installed.get(&(name.clone(), family)))
            .flat_map(|i| i.maps.sets.values().flatten().map(|b| b.addr))
            .collect()
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
        let ct = self.maps.conntrack().map_err(Error::Maps)?;
        let nat = self.maps.nat().map_err(Error::Maps)?;
        // Every backend, for UDP entries only (built when there are some).
        let live: BTreeSet<(IpAddr, u16)> = if ct.iter().chain(&nat).any(|(t, _)| t.proto != 6) {
            self.installed
                .values()
                .flat_map(|i| i.maps.sets.values().flatten().map(|b| (b.addr, b.port)))
                .collect()
        } else {
            BTreeSet::new()
        };
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
        for (is_nat, entries) in [(false, ct), (true, nat)] {
            let name = if is_nat { names::NAT } else { names::CT };
            let stale: Vec<Tuple> = entries
                .iter()
                .filter(|(k, v)| {
                    // Forward entries name the backend as their new destination; reply
                    // entries are keyed by the backend's source.
                    let backend = if is_nat {
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
                .remove_connections(is_nat, &stale)
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
