//! The lab directory (`/run/nodeport/lab/<id>`): state file, logs, kubeconfig, objects, and
//! teardown of a lab by its id, whether its process still runs (`--down`), is gone after a
//! crash (sweep), or is this process on its way out.

use std::io;
use std::path::{Path, PathBuf};

use nodeport_testbed::Netns;
use serde::{Deserialize, Serialize};

use super::plan::NETNS_PREFIX;

/// Where labs keep their files. Under `/run` (a tmpfs), like `/run/netns`: both vanish on
/// reboot, together.
pub const LABS_DIR: &str = "/run/nodeport/lab";
/// Where `ip netns` keeps its named namespaces.
const NETNS_DIR: &str = "/run/netns";
/// The environment variable set on every process a lab starts, naming the lab: it tells the
/// lab's processes apart from everything else on the machine.
pub const LAB_ENV: &str = "NODEPORT_LAB";

/// What a lab records about itself before it creates anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// The lab's id.
    pub id: String,
    /// The `nodeport lab` process that made it.
    pub owner_pid: u32,
    /// Whether it was left running on purpose (`--keep`); a lab that is not kept and whose
    /// owner is gone was interrupted hard (SIGKILL) and is swept by the next lab.
    pub kept: bool,
    /// The proxy mode it runs.
    pub proxy_mode: String,
    /// Its namespaces.
    pub namespaces: Vec<String>,
}

/// A lab's directory.
#[derive(Debug, Clone)]
pub struct LabDir {
    path: PathBuf,
}

impl LabDir {
    /// The directory of lab `id`.
    pub fn of(id: &str) -> Self {
        Self {
            path: Path::new(LABS_DIR).join(id),
        }
    }

    /// Creates it (and its `logs/` and `objects/` folders); fails if it already exists, so
    /// two labs never share one.
    pub fn create(id: &str) -> io::Result<Self> {
        let dir = Self::of(id);
        std::fs::create_dir_all(LABS_DIR)?;
        std::fs::create_dir(&dir.path)?;
        std::fs::create_dir(dir.path.join("logs"))?;
        std::fs::create_dir(dir.path.join("objects"))?;
        Ok(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A file in it.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The log file of a process.
    pub fn log(&self, process: &str) -> PathBuf {
        self.path.join("logs").join(format!("{process}.log"))
    }

    /// Writes the state file.
    pub fn save(&self, state: &State) -> io::Result<()> {
        let text = serde_json::to_string_pretty(state).map_err(io::Error::other)?;
        std::fs::write(self.join("state.json"), text + "\n")
    }

    /// Reads the state file, if there is one.
    pub fn load(&self) -> Option<State> {
        let text = std::fs::read_to_string(self.join("state.json")).ok()?;
        serde_json::from_str(&text).ok()
    }
}

/// The namespaces named for lab `id`, whatever its state file says (a crash may have come
/// between creating a namespace and recording it).
pub fn namespaces_of(id: &str) -> Vec<String> {
    let prefix = format!("{NETNS_PREFIX}{id}-");
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    names.sort();
    names
}

/// Removes lab `id`: kills every process in its namespaces, deletes the namespaces (which
/// deletes their links) and the lab directory. Returns the namespaces it deleted.
pub fn tear_down(id: &str) -> Vec<String> {
    let dir = LabDir::of(id);
    let mut names = dir.load().map(|s| s.namespaces).unwrap_or_default();
    for name in namespaces_of(id) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let names: Vec<String> = names
        .into_iter()
        .filter(|n| Path::new(NETNS_DIR).join(n).exists())
        .collect();
    // Pods and nodes before the fabric: `Netns`'s drop kills the processes in each one.
    for name in &names {
        drop(Netns::adopt(name));
    }
    // eBPF mode: pins, bpffs and cgroup2 mounts, cgroups (the processes are gone).
    super::ebpf::tear_down(dir.path());
    let _ = std::fs::remove_dir_all(dir.path());
    names
}

/// The labs on this machine: (id, state), for `--down` messages and the sweep.
pub fn labs() -> Vec<(String, Option<State>)> {
    let Ok(entries) = std::fs::read_dir(LABS_DIR) else {
        return Vec::new();
    };
    let mut labs: Vec<(String, Option<State>)> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .map(|id| {
            let state = LabDir::of(&id).load();
            (id, state)
        })
        .collect();
    labs.sort_by(|a, b| a.0.cmp(&b.0));
    labs
}

/// Removes labs that were not kept and whose `nodeport lab` process no longer exists (it was
/// killed before it could clean up). Returns their ids.
pub fn sweep_abandoned() -> Vec<String> {
    labs()
        .into_iter()
        .filter_map(|(id, state)| {
            let state = state?;
            let owner_alive = Path::new(&format!("/proc/{}", state.owner_pid)).exists();
            (!state.kept && !owner_alive).then(|| {
                tear_down(&id);
                id
            })
        })
        .collect()
}
