//! The compiled object (`bpf/nodeport.c`, built by `build.rs` with clang), loaded with aya:
//! its programs and typed access to its maps.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{Array, HashMap, MapData, MapError};
use aya::programs::links::{FdLink, LinkError, PinnedLink};
use aya::programs::{
    CgroupAttachMode, CgroupSockAddr, ProgramError, SchedClassifier, TcAttachType,
};
use aya::{Ebpf, EbpfError, EbpfLoader};
use ipnet::IpNet;

use super::batch::Batch;
use super::maps::{
    self, BackendEntry, Frontend, FrontendKey, MAGLEV_M, MemberKey, Translation, Tuple, names,
};
use super::render::HeldAffinity;
use crate::model::ServicePortName;

/// The object file, aligned for the ELF parser.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/nodeport.bpf.o"));

/// The tc program for packets arriving on a node interface.
pub const TC_INGRESS: &str = "np_tc_ingress";
/// The tc program for packets leaving a node interface.
pub const TC_EGRESS: &str = "np_tc_egress";
/// The cgroup socket programs, each with the hook it attaches to.
pub const SOCK_PROGRAMS: [&str; 8] = [
    "np_connect4_prog",
    "np_connect6_prog",
    "np_sendmsg4_prog",
    "np_sendmsg6_prog",
    "np_recvmsg4_prog",
    "np_recvmsg6_prog",
    "np_getpeername4_prog",
    "np_getpeername6_prog",
];

/// The maps the applier writes and a full sync walks.
pub const APPLIER_MAPS: [&str; 6] = [
    names::SERVICES,
    names::SVC_NAMES,
    names::BACKENDS,
    names::MEMBERS,
    names::MAGLEV,
    names::SOURCE_RANGES,
];

/// The LRU maps: full, they evict their least recently used entries (live connections,
/// affinities) instead of refusing new ones.
pub const LRU_MAPS: [&str; 5] = [
    names::CT,
    names::NAT,
    names::AFFINITY,
    names::SOCK_REV,
    names::TRACE_LOG,
];

/// Map sizes (`--ebpf-*-map-size`). The defaults hold the
/// benchmark's 100,000 Services × 10 endpoints, with Cilium's conntrack size.
///
/// Memory (kernel 6.18, `bpftool map show`): the LRU maps are preallocated, about 160 bytes
/// per entry (`np_ct` and `np_nat` 80 MiB each at 512 Ki, `np_affinity` 8 MiB at 64 Ki,
/// `np_sock_rev` 15 MiB at 128 Ki); the hash maps take 16 bytes per entry of bucket array at
/// load (`np_services` 16 MiB, `np_backends` and `np_members` 32 MiB each) and about
/// 100 bytes per element as they fill; a Maglev table takes 64 KiB. `np_svc_names` (the
/// service ports' names, for `nodeport trace`) is sized from `np_services`: half its entries
/// (a service port has at least two frontends), 8 MiB of buckets at load with the defaults,
/// and about 200 bytes per service port and family as it fills (a 136-byte name). About
/// 273 MiB at load with the defaults. (`np_trace_log`, fixed at 4096 entries of 104 bytes,
/// adds under 1 MiB.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapSizes {
    /// Frontends (`np_services`): one per service address, port and scope.
    pub services: u32,
    /// Backends (`np_backends`, and `np_members` alike).
    pub backends: u32,
    /// Connections (`np_ct`, and `np_nat` alike: one reply entry per connection).
    pub conntrack: u32,
    /// Affinity entries (`np_affinity`).
    pub affinity: u32,
    /// Source ranges (`np_src_ranges`).
    pub source_ranges: u32,
    /// Maglev tables (`np_maglev`), 64 KiB each.
    pub maglev: u32,
    /// Socket reverse entries (`np_sock_rev`).
    pub sockets: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes {
            // 100,000 Services: ClusterIP, NodePort on a few addresses, both scopes.
            services: 1 << 20,
            // 100,000 × 10 endpoints, and room for the next backend set during a switch.
            backends: 1 << 21,
            // Cilium's CT default (bpf-ct-global-tcp-max, 512 Ki).
            conntrack: 512 * 1024,
            affinity: 64 * 1024,
            source_ranges: 64 * 1024,
            maglev: 4096,
            sockets: 128 * 1024,
        }
    }
}

impl MapSizes {
    /// `np_svc_names`' `max_entries`: half of [`Self::services`] (every service port has at
    /// least two frontends, its ClusterIP's internal and external ones, so the names never
    /// fill before the frontends do).
    pub fn svc_names(&self) -> u32 {
        (self.services / 2).max(1)
    }

    /// Each map's `max_entries`.
    pub fn entries(&self) -> [(&'static str, u32); 10] {
        [
            (names::SERVICES, self.services),
            (names::SVC_NAMES, self.svc_names()),
            (names::BACKENDS, self.backends),
            (names::MEMBERS, self.backends),
            (names::CT, self.conntrack),
            (names::NAT, self.conntrack),
            (names::AFFINITY, self.affinity),
            (names::SOURCE_RANGES, self.source_ranges),
            (names::MAGLEV, self.maglev),
            (names::SOCK_REV, self.sockets),
        ]
    }
}

/// Loading the object or using its maps failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel refused the object (maps or programs).
    #[error("loading the eBPF object")]
    Load(#[source] EbpfError),
    /// A program failed to load or attach.
    #[error("eBPF program {name}")]
    Program {
        /// The program.
        name: &'static str,
        /// Why.
        #[source]
        source: ProgramError,
    },
    /// A map operation failed.
    #[error("eBPF map {name}")]
    Map {
        /// The map.
        name: &'static str,
        /// Why.
        #[source]
        source: MapError,
    },
    /// A cgroup directory could not be opened.
    #[error("opening cgroup {path}")]
    Cgroup {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The pin root is not on a bpffs and one could not be mounted there.
    #[error("pin root {path}: mounting bpffs")]
    Mount {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Pinning, finding or replacing a pinned link failed.
    #[error("pinned link {path}")]
    Link {
        /// The pin.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A Maglev table of the wrong size.
    #[error("a Maglev table has {MAGLEV_M} slots, not {0}")]
    MaglevSize(usize),
    /// The object lacks a map or program (built from another source).
    #[error("the eBPF object has no {0}")]
    Missing(&'static str),
    /// A batched map operation failed.
    #[error("batched eBPF map operation")]
    Batch(#[source] super::batch::Error),
}

/// A backend's place: (backend set, ordinal).
pub type BackendSlot = (u32, u32);

/// The loaded object.
pub struct Programs {
    ebpf: Ebpf,
}

impl std::fmt::Debug for Programs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Programs").finish_non_exhaustive()
    }
}

/// `BPF_FS_MAGIC`: the `f_type` of a bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Makes sure `dir` is on a bpffs, mounting one there when it is not.
pub fn ensure_bpffs(dir: &Path) -> Result<(), Error> {
    let err = |source: std::io::Error| Error::Mount {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let st = nix::sys::statfs::statfs(dir).map_err(|e| err(e.into()))?;
    if st.filesystem_type().0 as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    nix::mount::mount(
        Some("bpf"),
        dir,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| err(e.into()))
}

/// Pins `link` at `path`, replacing (and so detaching) a link pinned there before.
fn pin_replacing(link: Result<FdLink, LinkError>, path: &Path) -> Result<(), Error> {
    let err = |source: std::io::Error| Error::Link {
        path: path.to_path_buf(),
        source,
    };
    let link = link.map_err(|e| err(std::io::Error::other(e)))?;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    // The old link stays attached while its descriptor is open: unpin it, pin the new one,
    // then let it go.
    let old = match PinnedLink::from_pin(path) {
        Ok(old) => Some(old.unpin().map_err(err)?),
        Err(_) if !path.exists() => None,
        Err(e) => return Err(err(std::io::Error::other(e))),
    };
    link.pin(path).map_err(|e| err(std::io::Error::other(e)))?;
    drop(old);
    Ok(())
}

/// Removes every pin under `pin_root` (maps and links: the links detach, the maps go once no
/// program uses them). For `nodeport proxy --cleanup`-style teardown and tests.
pub fn remove_pins(pin_root: &Path) -> std::io::Result<()> {
    for sub in ["links", "maps"] {
        let dir = pin_root.join(sub);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            std::fs::remove_file(entry?.path())?;
        }
        std::fs::remove_dir(&dir)?;
    }
    Ok(())
}

/// Treats a missing key as done (removals are idempotent).
fn absent_ok(r: Result<(), MapError>, name: &'static str) -> Result<(), Error> {
    match r {
        Ok(()) | Err(MapError::KeyNotFound) | Err(MapError::ElementNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(source) => Err(Error::Map { name, source }),
    }
}

fn map_err(name: &'static str) -> impl FnOnce(MapError) -> Error {
    move |source| Error::Map { name, source }
}

impl Programs {
    /// Loads the maps (sized from `sizes`) and every program into the kernel, unpinned.
    pub fn load(sizes: &MapSizes) -> Result<(Self, Maps), Error> {
        Self::load_with(sizes, None)
    }

    /// Loads with the maps pinned under `<pin_root>/maps/`: maps already pinned there (by an
    /// earlier run) are taken over with their contents, others are created and pinned. The
    /// pin root must be on a bpffs; one is mounted there when it is not (as Cilium's agent
    /// does). Pinned maps keep the size they were created with.
    pub fn load_pinned(sizes: &MapSizes, pin_root: &Path) -> Result<(Self, Maps), Error> {
        ensure_bpffs(pin_root)?;
        let dir = pin_root.join("maps");
        std::fs::create_dir_all(&dir).map_err(|source| Error::Mount {
            path: dir.clone(),
            source,
        })?;
        Self::load_with(sizes, Some(&dir))
    }

    fn load_with(sizes: &MapSizes, pin_dir: Option<&Path>) -> Result<(Self, Maps), Error> {
        let mut loader = EbpfLoader::new();
        for (name, size) in sizes.entries() {
            loader.map_max_entries(name, size);
        }
        // Maps created by this load start empty; pinned ones taken over hold what an
        // earlier run wrote.
        let known_empty =
            pin_dir.is_none_or(|dir| APPLIER_MAPS.iter().all(|name| !dir.join(name).exists()));
        if let Some(dir) = pin_dir {
            for name in names::ALL.into_iter().chain([names::FRAGS]) {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader.load(OBJECT).map_err(Error::Load)?;
        for name in [TC_INGRESS, TC_EGRESS] {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            prog.load()
                .map_err(|source| Error::Program { name, source })?;
        }
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            prog.load()
                .map_err(|source| Error::Program { name, source })?;
        }
        let mut maps = std::collections::BTreeMap::new();
        for name in names::ALL {
            maps.insert(name, ebpf.take_map(name).ok_or(Error::Missing(name))?);
        }
        Ok((Programs { ebpf }, Maps { maps, known_empty }))
    }

    /// A loaded tc program ([`TC_INGRESS`] or [`TC_EGRESS`]).
    pub fn classifier(&self, name: &'static str) -> Result<&SchedClassifier, Error> {
        self.ebpf
            .program(name)
            .ok_or(Error::Missing(name))?
            .try_into()
            .map_err(|source| Error::Program { name, source })
    }

    /// Attaches [`TC_INGRESS`] and [`TC_EGRESS`] to an interface of the calling thread's
    /// network namespace (TCX links on kernels since 6.6, clsact filters before). The links
    /// belong to this object: they detach when it is dropped.
    pub fn attach_tc(&mut self, interface: &str) -> Result<(), Error> {
        for (name, kind) in [
            (TC_INGRESS, TcAttachType::Ingress),
            (TC_EGRESS, TcAttachType::Egress),
        ] {
            let prog: &mut SchedClassifier = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            prog.attach(interface, kind)
                .map_err(|source| Error::Program { name, source })?;
        }
        Ok(())
    }

    /// [`Programs::attach_tc`], with the links pinned as `<pin_root>/links/tc-<interface>-
    /// ingress` and `-egress`, so that they outlive this process. Links pinned there by an
    /// earlier run are replaced without a gap: the new link is attached (both run for a
    /// moment, over the same maps), pinned in the old one's place, then the old one detached.
    pub fn attach_tc_pinned(&mut self, interface: &str, pin_root: &Path) -> Result<(), Error> {
        for (name, kind, dir) in [
            (TC_INGRESS, TcAttachType::Ingress, "ingress"),
            (TC_EGRESS, TcAttachType::Egress, "egress"),
        ] {
            let prog: &mut SchedClassifier = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            let id = prog
                .attach(interface, kind)
                .map_err(|source| Error::Program { name, source })?;
            let link = prog
                .take_link(id)
                .map_err(|source| Error::Program { name, source })?;
            let path = pin_root.join("links").join(format!("tc-{interface}-{dir}"));
            pin_replacing(FdLink::try_from(link), &path)?;
        }
        Ok(())
    }

    /// [`Programs::attach_cgroup`], with the links pinned as `<pin_root>/links/cgroup-<program>`
    /// and earlier ones replaced as [`Programs::attach_tc_pinned`] replaces them.
    pub fn attach_cgroup_pinned(&mut self, cgroup: &Path, pin_root: &Path) -> Result<(), Error> {
        let dir = std::fs::File::open(cgroup).map_err(|source| Error::Cgroup {
            path: cgroup.to_path_buf(),
            source,
        })?;
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            let id = prog
                .attach(&dir, CgroupAttachMode::Single)
                .map_err(|source| Error::Program { name, source })?;
            let link = prog
                .take_link(id)
                .map_err(|source| Error::Program { name, source })?;
            let path = pin_root.join("links").join(format!("cgroup-{name}"));
            pin_replacing(FdLink::try_from(link), &path)?;
        }
        Ok(())
    }

    /// Attaches the socket programs to a cgroup v2 directory as bpf_links, which run
    /// alongside any other programs there (the kernel refuses attach flags on links; they
    /// always behave as `BPF_F_ALLOW_MULTI`). The links belong to this object: they
    /// detach when it is dropped.
    pub fn attach_cgroup(&mut self, cgroup: &Path) -> Result<(), Error> {
        let dir = std::fs::File::open(cgroup).map_err(|source| Error::Cgroup {
            path: cgroup.to_path_buf(),
            source,
        })?;
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            prog.attach(&dir, CgroupAttachMode::Single)
                .map_err(|source| Error::Program { name, source })?;
        }
        Ok(())
    }
}

/// The object's maps, taken out of it so that they can be written while the programs run
/// (and tested) elsewhere: the kernel keeps the programs' references to them.
pub struct Maps {
    maps: std::collections::BTreeMap<&'static str, aya::maps::Map>,
    /// The maps the applier owns ([`APPLIER_MAPS`]) were created empty by this process's
    /// load, and nothing has been written through this handle since.
    known_empty: bool,
}

impl std::fmt::Debug for Maps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maps").finish_non_exhaustive()
    }
}

impl Maps {
    fn map(&self, name: &'static str) -> Result<&aya::maps::Map, Error> {
        self.maps.get(name).ok_or(Error::Missing(name))
    }

    /// Takes one map out (the trace event maps, which a tracer owns).
    pub(super) fn take(&mut self, name: &'static str) -> Result<aya::maps::Map, Error> {
        self.maps.remove(name).ok_or(Error::Missing(name))
    }

    fn map_mut(&mut self, name: &'static str) -> Result<&mut aya::maps::Map, Error> {
        self.known_empty = false;
        self.maps.get_mut(name).ok_or(Error::Missing(name))
    }

    /// Whether the maps the applier owns ([`APPLIER_MAPS`]) are known to be empty: this
    /// process's load created them (no pins taken over), and nothing was written through
    /// these maps since. A first sync need not read them then (a walk of an empty hash map
    /// still visits each of its buckets: about 10 ms for the default sizes).
    pub fn known_empty(&self) -> bool {
        self.known_empty
    }

    fn hash<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &'static str,
    ) -> Result<HashMap<&mut MapData, K, V>, Error> {
        HashMap::try_from(self.map_mut(name)?).map_err(map_err(name))
    }

    fn hash_ref<K: aya::Pod, V: aya::Pod>(
        &self,
        name: &'static str,
    ) -> Result<HashMap<&MapData, K, V>, Error> {
        HashMap::try_from(self.map(name)?).map_err(map_err(name))
    }

    fn data(&self, name: &'static str) -> Result<&MapData, Error> {
        use aya::maps::Map;
        match self.map(name)? {
            Map::HashMap(d) | Map::LruHashMap(d) | Map::Array(d) | Map::LpmTrie(d) => Ok(d),
            _ => Err(Error::Missing(name)),
        }
    }

    /// Batched operations on one map (`BPF_MAP_*_BATCH`: one system call for any number of
    /// entries).
    pub fn batch(&self, name: &'static str) -> Result<Batch<'_>, Error> {
        Batch::new(self.data(name)?, name).map_err(Error::Batch)
    }

    fn update_all(&mut self, name: &'static str, keys: &[u8], values: &[u8]) -> Result<(), Error> {
        if keys.is_empty() {
            return Ok(());
        }
        self.known_empty = false;
        self.batch(name)?.update(keys, values).map_err(Error::Batch)
    }

    fn delete_all(&mut self, name: &'static str, keys: &[u8]) -> Result<(), Error> {
        if keys.is_empty() {
            return Ok(());
        }
        self.known_empty = false;
        self.batch(name)?.delete(keys).map_err(Error::Batch)
    }

    /// Every entry of a map, read in batches: (keys, values) back to back.
    fn read_all(&self, name: &'static str) -> Result<(Vec<u8>, Vec<u8>), Error> {
        self.batch(name)?.lookup_all().map_err(Error::Batch)
    }

    /// Writes frontends, in one batched call.
    pub fn set_frontends(&mut self, entries: &[(FrontendKey, Frontend)]) -> Result<(), Error> {
        let mut keys = Vec::with_capacity(entries.len() * 20);
        let mut values = Vec::with_capacity(entries.len() * 16);
        for (k, v) in entries {
            keys.extend_from_slice(&k.encode());
            values.extend_from_slice(&v.encode());
        }
        self.update_all(names::SERVICES, &keys, &values)
    }

    /// Removes frontends (absent ones: nothing to do), in one batched call.
    pub fn remove_frontends(&mut self, keys: &[FrontendKey]) -> Result<(), Error> {
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.encode()).collect();
        self.delete_all(names::SERVICES, &bytes)
    }

    /// Writes the names of service ports by service id (`np_svc_names`), in one batched
    /// call.
    pub fn set_names(&mut self, entries: &[(u32, ServicePortName)]) -> Result<(), Error> {
        let mut keys = Vec::with_capacity(entries.len() * 4);
        let mut values = Vec::with_capacity(entries.len() * maps::SVC_NAME_LEN);
        for (id, name) in entries {
            keys.extend_from_slice(&id.to_ne_bytes());
            values.extend_from_slice(&maps::svc_name(name));
        }
        self.update_all(names::SVC_NAMES, &keys, &values)
    }

    /// Removes names by service id (absent ones: nothing to do), in one batched call.
    pub fn remove_names(&mut self, ids: &[u32]) -> Result<(), Error> {
        let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_ne_bytes()).collect();
        self.delete_all(names::SVC_NAMES, &bytes)
    }

    /// Every name in `np_svc_names`: service id → the value as the map holds it.
    pub fn names(&self) -> Result<Vec<(u32, [u8; maps::SVC_NAME_LEN])>, Error> {
        self.entries(
            names::SVC_NAMES,
            |k: &[u8; 4], v: &[u8; maps::SVC_NAME_LEN]| (u32::from_ne_bytes(*k), *v),
        )
    }

    /// The kernel's id of the map `name` (`bpftool map show id <id>` shows its memory).
    pub fn map_id(&self, name: &'static str) -> Result<u32, Error> {
        let info = self.data(name)?.info().map_err(map_err(name))?;
        Ok(info.id())
    }

    /// Whether this handle has the map `name` (a trace of a proxy started before the map
    /// existed opens its maps without it).
    pub fn has(&self, name: &'static str) -> bool {
        self.maps.contains_key(name)
    }

    /// Writes backends at their (set, ordinal), in one batched call.
    pub fn set_backends(&mut self, entries: &[(BackendSlot, BackendEntry)]) -> Result<(), Error> {
        let mut keys = Vec::with_capacity(entries.len() * 8);
        let mut values = Vec::with_capacity(entries.len() * 20);
        for ((set, ordinal), be) in entries {
            keys.extend_from_slice(&maps::backend_key(*set, *ordinal));
            values.extend_from_slice(&be.encode());
        }
        self.update_all(names::BACKENDS, &keys, &values)
    }

    /// Removes backends by (set, ordinal), in one batched call.
    pub fn remove_backend_slots(&mut self, slots: &[BackendSlot]) -> Result<(), Error> {
        let bytes: Vec<u8> = slots
            .iter()
            .flat_map(|(set, ordinal)| maps::backend_key(*set, *ordinal))
            .collect();
        self.delete_all(names::BACKENDS, &bytes)
    }

    /// Writes membership entries (set, address, port) → ordinal, in one batched call.
    pub fn set_members(&mut self, entries: &[(MemberKey, u32)]) -> Result<(), Error> {
        let mut keys = Vec::with_capacity(entries.len() * 24);
        let mut values = Vec::with_capacity(entries.len() * 4);
        for ((set, addr, port), ordinal) in entries {
            keys.extend_from_slice(&maps::member_key(*set, *addr, *port));
            values.extend_from_slice(&ordinal.to_ne_bytes());
        }
        self.update_all(names::MEMBERS, &keys, &values)
    }

    /// Removes membership entries, in one batched call.
    pub fn remove_members(&mut self, keys: &[MemberKey]) -> Result<(), Error> {
        let bytes: Vec<u8> = keys
            .iter()
            .flat_map(|(set, addr, port)| maps::member_key(*set, *addr, *port))
            .collect();
        self.delete_all(names::MEMBERS, &bytes)
    }

    /// Removes Maglev tables, in one batched call.
    pub fn remove_maglevs(&mut self, sets: &[u32]) -> Result<(), Error> {
        let bytes: Vec<u8> = sets.iter().flat_map(|s| s.to_ne_bytes()).collect();
        self.delete_all(names::MAGLEV, &bytes)
    }

    /// Opens the maps pinned under `<pin_root>/maps/` by a running proxy, to read them
    /// (`nodeport trace --rules kernel` and `--live`): no program is loaded and nothing is
    /// created. `np_svc_names` is opened when pinned (a proxy older than it has none).
    pub fn open_pinned(pin_root: &Path) -> Result<Self, Error> {
        let dir = pin_root.join("maps");
        let mut maps = std::collections::BTreeMap::new();
        for name in [
            names::SERVICES,
            names::BACKENDS,
            names::SOURCE_RANGES,
            names::CT,
            names::NAT,
            names::AFFINITY,
            names::SVC_NAMES,
        ] {
            if name == names::SVC_NAMES && !dir.join(name).exists() {
                continue;
            }
            let data = MapData::from_pin(dir.join(name)).map_err(map_err(name))?;
            let map = aya::maps::Map::from_map_data(data).map_err(map_err(name))?;
            maps.insert(name, map);
        }
        Ok(Maps {
            maps,
            known_empty: false,
        })
    }

    /// Writes a frontend.
    pub fn set_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), Error> {
        self.hash::<[u8; 20], [u8; 16]>(names::SERVICES)?
            .insert(key.encode(), value.encode(), 0)
            .map_err(map_err(names::SERVICES))
    }

    /// Writes backend `ordinal` (1-based) of a backend set, and its membership entry.
    pub fn set_backend(
        &mut self,
        be_set: u32,
        ordinal: u32,
        backend: &BackendEntry,
    ) -> Result<(), Error> {
        self.set_backend_slot(be_set, ordinal, backend)?;
        self.hash::<[u8; 24], u32>(names::MEMBERS)?
            .insert(
                maps::member_key(be_set, backend.addr, backend.port),
                ordinal,
                0,
            )
            .map_err(map_err(names::MEMBERS))
    }

    /// Writes a backend set's Maglev table ([`MAGLEV_M`] ordinals).
    pub fn set_maglev(&mut self, be_set: u32, table: &[u32]) -> Result<(), Error> {
        let value: Box<[u32; MAGLEV_M]> = table
            .to_vec()
            .into_boxed_slice()
            .try_into()
            .map_err(|_| Error::MaglevSize(table.len()))?;
        self.hash::<u32, [u32; MAGLEV_M]>(names::MAGLEV)?
            .insert(be_set, value.as_ref(), 0)
            .map_err(map_err(names::MAGLEV))
    }

    /// Admits the sources in `net` to service port `svc_id`.
    pub fn add_source_range(&mut self, svc_id: u32, net: IpNet) -> Result<(), Error> {
        let name = names::SOURCE_RANGES;
        let mut trie: LpmTrie<&mut MapData, [u8; 20], u8> =
            LpmTrie::try_from(self.map_mut(name)?).map_err(map_err(name))?;
        let (len, data) = maps::range_key(svc_id, net);
        trie.insert(&LpmKey::new(len, data), 1, 0)
            .map_err(map_err(name))
    }

    /// Sets the address remote backends' connections are SNATed to, for its family.
    pub fn set_snat_address(&mut self, addr: IpAddr) -> Result<(), Error> {
        let name = names::CONFIG;
        let mut config: Array<&mut MapData, [u8; 16]> =
            Array::try_from(self.map_mut(name)?).map_err(map_err(name))?;
        config
            .set(maps::config_index(addr), maps::addr_bytes(addr), 0)
            .map_err(map_err(name))
    }

    /// Removes a frontend (absent: nothing to do).
    pub fn remove_frontend(&mut self, key: &FrontendKey) -> Result<(), Error> {
        let r = self
            .hash::<[u8; 20], [u8; 16]>(names::SERVICES)?
            .remove(&key.encode());
        absent_ok(r, names::SERVICES)
    }

    /// The frontend of `key`, if the map holds one.
    pub fn frontend(&self, key: &FrontendKey) -> Result<Option<Frontend>, Error> {
        let map = self.hash_ref::<[u8; 20], [u8; 16]>(names::SERVICES)?;
        match map.get(&key.encode(), 0) {
            Ok(v) => Ok(Some(Frontend::decode(&v))),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(names::SERVICES)(e)),
        }
    }

    /// Backend `ordinal` of a set, if the map holds it.
    pub fn backend(&self, be_set: u32, ordinal: u32) -> Result<Option<BackendEntry>, Error> {
        let map = self.hash_ref::<[u8; 8], [u8; 20]>(names::BACKENDS)?;
        match map.get(&maps::backend_key(be_set, ordinal), 0) {
            Ok(v) => Ok(Some(BackendEntry::decode(&v))),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(names::BACKENDS)(e)),
        }
    }

    /// The ordinal a backend's membership entry in a set gives, if the map holds one.
    pub fn member(&self, be_set: u32, addr: IpAddr, port: u16) -> Result<Option<u32>, Error> {
        let map = self.hash_ref::<[u8; 24], u32>(names::MEMBERS)?;
        match map.get(&maps::member_key(be_set, addr, port), 0) {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(names::MEMBERS)(e)),
        }
    }

    /// Whether a backend set has a Maglev table.
    pub fn has_maglev(&self, be_set: u32) -> Result<bool, Error> {
        let map = self.hash_ref::<u32, [u32; MAGLEV_M]>(names::MAGLEV)?;
        match map.get(&be_set, 0) {
            Ok(_) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(map_err(names::MAGLEV)(e)),
        }
    }

    /// Every frontend in the map.
    pub fn frontends(&self) -> Result<Vec<(FrontendKey, Frontend)>, Error> {
        self.entries(names::SERVICES, |k: &[u8; 20], v: &[u8; 16]| {
            (FrontendKey::decode(k), Frontend::decode(v))
        })
    }

    /// Every entry of a map with `K`-byte keys and `V`-byte values, read in batches and
    /// decoded by `decode`.
    fn entries<const K: usize, const V: usize, T>(
        &self,
        name: &'static str,
        decode: impl Fn(&[u8; K], &[u8; V]) -> T,
    ) -> Result<Vec<T>, Error> {
        let (keys, values) = self.read_all(name)?;
        let keys = keys.as_chunks::<K>();
        let values = values.as_chunks::<V>();
        if !keys.1.is_empty() || !values.1.is_empty() || keys.0.len() != values.0.len() {
            return Err(Error::Batch(super::batch::Error::Shape {
                map: name,
                keys: keys.0.len() * K + keys.1.len(),
                values: values.0.len() * V + values.1.len(),
                count: keys.0.len(),
                key_size: K,
                value_size: V,
            }));
        }
        Ok(keys
            .0
            .iter()
            .zip(values.0)
            .map(|(k, v)| decode(k, v))
            .collect())
    }

    /// Removes backend `ordinal` of a set and its membership entry.
    pub fn remove_backend(
        &mut self,
        be_set: u32,
        ordinal: u32,
        backend: &BackendEntry,
    ) -> Result<(), Error> {
        self.remove_backend_slot(be_set, ordinal)?;
        self.remove_member(be_set, backend.addr, backend.port)
    }

    /// Writes backend `ordinal` (1-based) of a backend set, without a membership entry (the
    /// programs read `np_members` only for UDP flows and session affinity).
    pub fn set_backend_slot(
        &mut self,
        be_set: u32,
        ordinal: u32,
        backend: &BackendEntry,
    ) -> Result<(), Error> {
        self.hash::<[u8; 8], [u8; 20]>(names::BACKENDS)?
            .insert(maps::backend_key(be_set, ordinal), backend.encode(), 0)
            .map_err(map_err(names::BACKENDS))
    }

    /// Removes backend `ordinal` of a set (absent: nothing to do), not its membership entry.
    pub fn remove_backend_slot(&mut self, be_set: u32, ordinal: u32) -> Result<(), Error> {
        let r = self
            .hash::<[u8; 8], [u8; 20]>(names::BACKENDS)?
            .remove(&maps::backend_key(be_set, ordinal));
        absent_ok(r, names::BACKENDS)
    }

    /// Removes the membership entry of a backend in a set (absent: nothing to do).
    pub fn remove_member(&mut self, be_set: u32, addr: IpAddr, port: u16) -> Result<(), Error> {
        let r = self
            .hash::<[u8; 24], u32>(names::MEMBERS)?
            .remove(&maps::member_key(be_set, addr, port));
        absent_ok(r, names::MEMBERS)
    }

    /// Every membership entry: (set, address, port) → ordinal.
    pub fn members(&self) -> Result<Vec<(maps::MemberKey, u32)>, Error> {
        self.entries(names::MEMBERS, |k: &[u8; 24], v: &[u8; 4]| {
            (maps::decode_member_key(k), u32::from_ne_bytes(*v))
        })
    }

    /// Every backend entry: (set, ordinal) → backend.
    pub fn backends(&self) -> Result<Vec<(BackendSlot, BackendEntry)>, Error> {
        self.entries(names::BACKENDS, |k: &[u8; 8], v: &[u8; 20]| {
            (maps::decode_backend_key(k), BackendEntry::decode(v))
        })
    }

    /// Removes a set's Maglev table (absent: nothing to do).
    pub fn remove_maglev(&mut self, be_set: u32) -> Result<(), Error> {
        let r = self
            .hash::<u32, [u32; MAGLEV_M]>(names::MAGLEV)?
            .remove(&be_set);
        absent_ok(r, names::MAGLEV)
    }

    /// The backend sets that have a Maglev table.
    pub fn maglev_sets(&self) -> Result<Vec<u32>, Error> {
        let map = self.hash_ref::<u32, [u32; MAGLEV_M]>(names::MAGLEV)?;
        map.keys()
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_err(names::MAGLEV))
    }

    /// Removes a source range of a service port.
    pub fn remove_source_range(&mut self, svc_id: u32, net: IpNet) -> Result<(), Error> {
        let name = names::SOURCE_RANGES;
        let mut trie: LpmTrie<&mut MapData, [u8; 20], u8> =
            LpmTrie::try_from(self.map_mut(name)?).map_err(map_err(name))?;
        let (len, data) = maps::range_key(svc_id, net);
        absent_ok(trie.remove(&LpmKey::new(len, data)), name)
    }

    /// Every source range: (service id, range).
    pub fn source_ranges(&self) -> Result<Vec<(u32, IpNet)>, Error> {
        let name = names::SOURCE_RANGES;
        let trie: LpmTrie<&MapData, [u8; 20], u8> =
            LpmTrie::try_from(self.map(name)?).map_err(map_err(name))?;
        let mut out = Vec::new();
        for key in trie.keys() {
            let key = key.map_err(map_err(name))?;
            out.push(maps::decode_range_key(key.prefix_len(), &key.data()));
        }
        Ok(out)
    }

    /// Removes connections from `np_ct` (`nat: false`) or `np_nat` (`nat: true`).
    pub fn remove_connections(&mut self, nat: bool, tuples: &[Tuple]) -> Result<(), Error> {
        let name = if nat { names::NAT } else { names::CT };
        let keys: Vec<u8> = tuples.iter().flat_map(|t| t.encode()).collect();
        self.delete_all(name, &keys)
    }

    /// How many entries an LRU map holds (`np_affinity` or `np_sock_rev`; a walk over
    /// every key: for the collector's pace, not per sync).
    pub fn lru_entries(&self, name: &'static str) -> Result<usize, Error> {
        match name {
            names::AFFINITY | names::SOCK_REV | names::CT | names::NAT => {
                let batch = self.batch(name)?;
                let (keys, _) = batch.lookup_all().map_err(Error::Batch)?;
                Ok(keys.len() / batch.key_size().max(1))
            }
            _ => Err(Error::Missing(name)),
        }
    }

    /// Sets the dataplane flags (`maps::FLAG_*`).
    pub fn set_flags(&mut self, flags: u32) -> Result<(), Error> {
        let name = names::FLAGS;
        let mut map: Array<&mut MapData, u32> =
            Array::try_from(self.map_mut(name)?).map_err(map_err(name))?;
        map.set(0, flags, 0).map_err(map_err(name))
    }

    fn translations(&self, name: &'static str) -> Result<Vec<(Tuple, Translation)>, Error> {
        self.entries(name, |k: &[u8; 40], v: &[u8; 56]| {
            (Tuple::decode(k), Translation::decode(v))
        })
    }

    /// The forward conntrack entries (`np_ct`).
    pub fn conntrack(&self) -> Result<Vec<(Tuple, Translation)>, Error> {
        self.translations(names::CT)
    }

    /// The reply-direction entries (`np_nat`).
    pub fn nat(&self) -> Result<Vec<(Tuple, Translation)>, Error> {
        self.translations(names::NAT)
    }

    /// Every client's remembered backend (`np_affinity`), by (service id, client address),
    /// with how long each entry has been idle now. Sockets' entries (keyed by their network
    /// namespace's cookie, not an address) are read as the address those bytes spell, which
    /// no packet carries.
    pub fn held_affinity(
        &self,
    ) -> Result<std::collections::BTreeMap<(u32, IpAddr), HeldAffinity>, Error> {
        let now = super::apply::monotonic_now_ns();
        let entries = self.entries(names::AFFINITY, |k: &[u8; 20], v: &[u8; 32]| {
            let svc_id = u32::from_ne_bytes([k[0], k[1], k[2], k[3]]);
            let (addr, port, last_seen) = maps::decode_affinity(v);
            (
                (svc_id, maps::addr_from(&k[4..])),
                HeldAffinity {
                    backend: std::net::SocketAddr::new(addr, port),
                    idle_ns: now.saturating_sub(last_seen),
                },
            )
        })?;
        Ok(entries.into_iter().collect())
    }

    /// The backend `client` is stuck to for service port `svc_id`, if any: address, port
    /// and last use (`CLOCK_MONOTONIC` nanoseconds).
    pub fn affinity(
        &self,
        svc_id: u32,
        client: IpAddr,
    ) -> Result<Option<(IpAddr, u16, u64)>, Error> {
        let map = self.hash_ref::<[u8; 20], [u8; 32]>(names::AFFINITY)?;
        match map.get(&maps::affinity_key(svc_id, client), 0) {
            Ok(v) => Ok(Some(maps::decode_affinity(&v))),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(names::AFFINITY)(e)),
        }
    }
}
