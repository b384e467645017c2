//! The eBPF dataplane of one node, whole: the object loaded (pinned or not), the socket
//! programs on a cgroup, the tc programs on every interface carrying a NodePort address
//! (followed as addresses appear) and on every interface the node routes its endpoints
//! through, local or remote (where the replies of connections SNATed to the node come back:
//! from local pods, or through a tunnel device from other nodes' pods),
//! the applier, the closing of UDP sockets connected to removed backends, the collector and
//! the fill levels the metrics and `/healthz` report.
//!
//! Everything here runs in the calling thread's network namespace: interface names and
//! addresses are looked up there, as the proxy does on its node.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::apply::{self, Applier, Phases, Timeouts};
use super::programs::{self, MapSizes, Programs};
use super::render::{RenderConfig, nodeport_ips};
use super::routes;
use crate::desired::DesiredState;
use crate::model::{Protocol, ServicePortName};

/// How the dataplane is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// Map sizes.
    pub sizes: MapSizes,
    /// Rendering and forwarding settings.
    pub render: RenderConfig,
    /// `--ebpf-pin-root`: maps and links are pinned there (on a bpffs, mounted when
    /// missing) and taken over on restart. `None`: nothing is pinned, and the programs stop
    /// with the process.
    pub pin_root: Option<PathBuf>,
    /// `--ebpf-cgroup-root`: the cgroup v2 directory whose processes get the socket
    /// programs. `None`: no socket programs.
    pub cgroup_root: Option<PathBuf>,
    /// Connection lifetimes for the collector.
    pub timeouts: Timeouts,
    /// How often a sync also runs the collector (a walk over both connection maps, which
    /// the sync waits for: about a microsecond per entry).
    pub collect_every: std::time::Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            sizes: MapSizes::default(),
            render: RenderConfig::default(),
            pin_root: None,
            cgroup_root: None,
            timeouts: Timeouts::default(),
            collect_every: std::time::Duration::from_secs(30),
        }
    }
}

/// A dataplane failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading or attaching programs failed.
    #[error("eBPF programs")]
    Programs(#[source] programs::Error),
    /// Writing the maps failed.
    #[error("eBPF maps")]
    Apply(#[source] apply::Error),
    /// The interfaces could not be listed.
    #[error("listing interface addresses")]
    Interfaces(#[source] nix::Error),
}

/// The loaded, attached dataplane.
#[derive(Debug)]
pub struct Dataplane {
    programs: Programs,
    applier: Applier,
    config: Config,
    /// Interfaces the tc programs are attached to, by name, with the index they had then.
    attached: std::collections::BTreeMap<String, u32>,
    /// When the collector last ran.
    last_collect: Option<std::time::Instant>,
    /// Backends of UDP service ports after the last sync.
    udp_backends: BTreeSet<std::net::SocketAddr>,
    /// The interface each local endpoint is routed through (`None`: no route, or local).
    routes: std::collections::BTreeMap<IpAddr, Option<String>>,
    /// Remote endpoints whose route partial syncs looked up since the last full sync.
    recent_routes: foldhash::HashSet<IpAddr>,
    sizes: Vec<(&'static str, u32)>,
}

impl Dataplane {
    /// Loads the object (taking pinned maps over) and attaches the socket programs.
    pub fn start(config: Config) -> Result<Self, Error> {
        let (mut programs, maps) = match &config.pin_root {
            Some(root) => Programs::load_pinned(&config.sizes, root),
            None => Programs::load(&config.sizes),
        }
        .map_err(Error::Programs)?;
        if let Some(cgroup) = &config.cgroup_root {
            match &config.pin_root {
                Some(root) => programs.attach_cgroup_pinned(cgroup, root),
                None => programs.attach_cgroup(cgroup),
            }
            .map_err(Error::Programs)?;
        }
        let sizes = config.sizes.entries().to_vec();
        Ok(Dataplane {
            programs,
            applier: Applier::new(maps, config.render.clone()),
            config,
            attached: std::collections::BTreeMap::new(),
            routes: std::collections::BTreeMap::new(),
            recent_routes: foldhash::HashSet::default(),
            udp_backends: BTreeSet::new(),
            last_collect: None,
            sizes,
        })
    }

    /// The applier (and through it, the maps).
    pub fn applier(&self) -> &Applier {
        &self.applier
    }

    /// Whether the next sync is full whatever is asked.
    pub fn needs_full_sync(&self) -> bool {
        self.applier.needs_full_sync()
    }

    /// Interfaces the tc programs are attached to.
    pub fn interfaces(&self) -> Vec<&str> {
        self.attached.keys().map(String::as_str).collect()
    }

    /// Syncs the maps (see [`Applier::sync`]) and attaches the tc programs to the interfaces
    /// that carry a NodePort address or route endpoints and do not have them yet. The
    /// interfaces are found first, so that attaching them (each TCX link waits for an RCU
    /// grace period in the kernel) runs on a thread of its own while the maps are written.
    pub fn sync(
        &mut self,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<apply::SyncReport, Error> {
        let mut phases = Phases::start();
        let addresses = local_addresses()?;
        let mut render = self.config.render.clone();
        render.local_ips = addresses.iter().map(|(_, ip)| *ip).collect();
        render.local_ips.sort();
        render.local_ips.dedup();
        self.applier.set_local_ips(render.local_ips.clone());
        // As the applier decides it.
        let full = changed.is_none() || self.applier.needs_full_sync();
        phases.end("interface addresses");
        let interfaces = self.wanted_interfaces(desired, changed, full, addresses, &render);
        // An interface deleted and created again under its name lost its links with it.
        self.attached.retain(|name, index| {
            nix::net::if_::if_nametoindex(name.as_str()).ok() == Some(*index)
        });
        let to_attach: Vec<(String, u32)> = interfaces
            .into_iter()
            .filter(|name| !self.attached.contains_key(name))
            .filter_map(|name| {
                let index = nix::net::if_::if_nametoindex(name.as_str()).ok()?;
                Some((name, index))
            })
            .collect();
        phases.end("endpoint routes");
        let (report, attached) = if to_attach.is_empty() {
            let report = self.applier.sync(desired, changed);
            phases.end("maps");
            (report, (Vec::new(), None))
        } else {
            let programs = &mut self.programs;
            let applier = &mut self.applier;
            let pin_root = self.config.pin_root.as_deref();
            let phases = &mut phases;
            // The thread is created in this thread's network namespace, where the interface
            // names are looked up.
            std::thread::scope(|scope| {
                let attach = scope.spawn(move || attach_tc(programs, &to_attach, pin_root));
                let report = applier.sync(desired, changed);
                phases.end("maps");
                let attached = attach
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                phases.end("tc attach, after the maps");
                (report, attached)
            })
        };
        let (attached, attach_failed) = attached;
        for (name, index) in attached {
            tracing::info!(interface = %name, "eBPF tc programs attached");
            self.attached.insert(name, index);
        }
        let mut report = report.map_err(Error::Apply)?;
        if let Some(e) = attach_failed {
            return Err(Error::Programs(e));
        }
        let mut all = phases.take();
        // The applier's own phases inside "maps".
        all.extend(std::mem::take(&mut report.phases));
        let mut phases = Phases::start();
        // UDP sockets connected to a backend that left: closed, so that they connect again
        // (looked for only when a UDP service port was written).
        let udp_written =
            report.full || changed.is_none_or(|c| c.iter().any(|n| n.protocol == Protocol::Udp));
        let mut gone: BTreeSet<std::net::SocketAddr> = BTreeSet::new();
        if udp_written {
            let udp = self.applier.udp_backends();
            gone = self.udp_backends.difference(&udp).copied().collect();
            self.udp_backends = udp;
        }
        if !gone.is_empty() {
            let closed = match &self.config.cgroup_root {
                Some(cgroup) => super::sockets::destroy_in_cgroup(cgroup, &gone),
                None => super::sockets::destroy_connected_to(&gone),
            };
            match closed {
                Ok(0) => {}
                Ok(n) => tracing::info!(sockets = n, "closed UDP sockets of removed backends"),
                Err(e) => {
                    tracing::warn!(error = %e, "closing UDP sockets of removed backends failed")
                }
            }
        }
        if self
            .last_collect
            .is_none_or(|t| t.elapsed() >= self.config.collect_every)
        {
            self.last_collect = Some(std::time::Instant::now());
            let timeouts = self.config.timeouts;
            match self.collect(&timeouts) {
                Ok(0) => {}
                Ok(n) => tracing::debug!(entries = n, "collected stale eBPF connections"),
                Err(e) => tracing::warn!(error = %e, "collecting stale eBPF connections failed"),
            }
        }
        phases.end("UDP sockets and collector");
        all.extend(phases.take());
        report.phases = all;
        Ok(report)
    }

    /// The interfaces the tc programs belong on: those carrying a NodePort address, those
    /// the node routes its local endpoints through, and those its routes send remote
    /// endpoints through (the endpoints of the service ports this sync writes: all of them
    /// on a full sync, the changed ones otherwise, so that a change costs the same whatever
    /// the number of Services).
    fn wanted_interfaces(
        &mut self,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
        full: bool,
        addresses: Vec<(String, IpAddr)>,
        render: &RenderConfig,
    ) -> BTreeSet<String> {
        let wanted: BTreeSet<IpAddr> = desired
            .families
            .iter()
            .flat_map(|f| nodeport_ips(f, render))
            .filter(|ip| !ip.is_loopback())
            .collect();
        let mut interfaces: BTreeSet<String> = addresses
            .into_iter()
            .filter(|(_, ip)| wanted.contains(ip))
            .map(|(name, _)| name)
            .collect();
        // Replies of connections SNATed to a remote backend come back through the device
        // that backend is routed through (a tunnel device, a pod network's link): the tc
        // programs go there too, found by longest prefix match in the main routing tables.
        // A full sync dumps them (one dump per family) for every endpoint; a partial sync
        // only when a changed service port has a remote endpoint it did not have before,
        // and that no partial sync since the last full one looked up (an endpoint that
        // comes back after a readiness flap; the others' devices were found when they came).
        // One table per family, dumped when first needed.
        let mut tables: [Option<routes::RouteTable>; 2] = [None, None];
        if full {
            self.recent_routes.clear();
        }
        let mut devices: BTreeSet<std::sync::Arc<str>> = BTreeSet::new();
        let mut local_endpoints: BTreeSet<IpAddr> = BTreeSet::new();
        for fam in &desired.families {
            let written: Vec<(&ServicePortName, &crate::desired::ServicePortState)> = match changed
            {
                Some(names) if !full => names
                    .iter()
                    .filter_map(|n| fam.services.get_key_value(n))
                    .map(|(n, s)| (n, s.as_ref()))
                    .collect(),
                _ => fam.services.iter().map(|(n, s)| (n, s.as_ref())).collect(),
            };
            for (name, svc) in written {
                let known = if full {
                    foldhash::HashSet::default()
                } else {
                    self.applier.backend_addresses(name)
                };
                for e in svc.cluster_endpoints.iter().chain(&svc.local_endpoints) {
                    if e.local {
                        local_endpoints.insert(e.ip);
                        continue;
                    }
                    if known.contains(&e.ip) || self.recent_routes.contains(&e.ip) {
                        continue;
                    }
                    if !full {
                        self.recent_routes.insert(e.ip);
                    }
                    let table = tables[usize::from(e.ip.is_ipv6())]
                        .get_or_insert_with(|| routes::RouteTable::dump_for(e.ip));
                    if let Some(dev) = table.device(e.ip)
                        && !devices.contains(dev)
                    {
                        devices.insert(dev.clone());
                    }
                }
            }
        }
        interfaces.extend(devices.iter().map(|d| d.to_string()));
        for ip in local_endpoints {
            let via = self
                .routes
                .entry(ip)
                .or_insert_with(|| routes::route_interface(ip));
            if let Some(name) = via {
                interfaces.insert(name.clone());
            }
        }
        interfaces
    }

    /// Runs the conntrack collector now; returns the entries deleted.
    pub fn collect(&mut self, timeouts: &Timeouts) -> Result<usize, Error> {
        self.applier
            .collect(apply::monotonic_now_ns(), timeouts)
            .map_err(Error::Apply)
    }

    /// Each map's entries and capacity (`nodeport_ebpf_map_entries{map}`), LRU maps
    /// included: they evict rather than fill, but a full one is evicting live connections.
    /// The maps the applier writes are counted from its mirror, the LRU maps by the
    /// collector's walk (every `collect_every`): no map is walked for this.
    pub fn fill(&self) -> Result<Vec<(&'static str, usize, u32)>, Error> {
        let counts = self.applier.entry_counts();
        Ok(counts
            .into_iter()
            .map(|(name, n)| {
                let cap = self
                    .sizes
                    .iter()
                    .find(|(m, _)| *m == name)
                    .map_or(0, |(_, c)| *c);
                (name, n, cap)
            })
            .collect())
    }
}

/// Attaches the tc programs to `interfaces` (pinned under `pin_root` when given); returns
/// those attached, and the failure that stopped it, if one did.
fn attach_tc(
    programs: &mut Programs,
    interfaces: &[(String, u32)],
    pin_root: Option<&Path>,
) -> (Vec<(String, u32)>, Option<programs::Error>) {
    let mut done = Vec::new();
    for (name, index) in interfaces {
        let r = match pin_root {
            Some(root) => programs.attach_tc_pinned(name, root),
            None => programs.attach_tc(name),
        };
        match r {
            Ok(()) => done.push((name.clone(), *index)),
            Err(e) => return (done, Some(e)),
        }
    }
    (done, None)
}

/// Every (interface, address) of this network namespace.
pub fn local_addresses() -> Result<Vec<(String, IpAddr)>, Error> {
    let mut out = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs().map_err(Error::Interfaces)? {
        let Some(addr) = ifa.address else { continue };
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        out.push((ifa.interface_name, ip));
    }
    Ok(out)
}

/// The first cgroup v2 mount of this mount namespace, from `/proc/self/mountinfo`: the
/// production default of `--ebpf-cgroup-root` (Cilium's `--cgroup-root`), found rather than
/// assumed, since hybrid hierarchies mount it at `/sys/fs/cgroup/unified`.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    cgroup2_mount_in(&text)
}

/// [`cgroup2_mount`] over a mountinfo text.
pub fn cgroup2_mount_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // `id parent major:minor root mountpoint options [optional...] - fstype source ...`
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        let mountpoint = left.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| Path::new(mountpoint).to_path_buf())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_in_a_hybrid_hierarchy() {
        let mountinfo = "\
25 30 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup ro,nosuid shared:8 - tmpfs tmpfs ro,mode=755
27 26 0:25 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw
28 26 0:26 / /sys/fs/cgroup/systemd rw,nosuid shared:10 - cgroup cgroup rw,name=systemd
";
        assert_eq!(
            cgroup2_mount_in(mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            cgroup2_mount_in("25 30 0:23 / /sys rw - sysfs sysfs rw\n"),
            None
        );
    }
}
