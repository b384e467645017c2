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
/// The file in a lab's directory that its owner keeps locked while it runs.
const OWNER_LOCK: &str = "owner.lock";

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

    /// Writes the state file: a new file renamed over the old one, so that a sweep reading it
    /// meanwhile sees the old state or the new one, never an empty or half-written file.
    pub fn save(&self, state: &State) -> io::Result<()> {
        let text = serde_json::to_string_pretty(state).map_err(io::Error::other)?;
        let next = self.join("state.json.next");
        std::fs::write(&next, text + "\n")?;
        std::fs::rename(&next, self.join("state.json"))
    }

    /// Takes the owner's lock (`owner.lock`, an exclusive `flock`), waiting if a sweep holds
    /// it for a moment. The owner holds it for as long as it lives; the kernel releases it
    /// when the process ends, however it ends (SIGKILL included).
    pub fn lock_as_owner(&self) -> io::Result<std::fs::File> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.join(OWNER_LOCK))?;
        file.lock()?;
        Ok(file)
    }

    /// Takes the owner's lock if nobody holds it: proof that the lab's `nodeport lab` process
    /// is gone (whatever became of its PID). `None` while the owner lives, and for a lab whose
    /// owner has not taken the lock yet (the file does not exist).
    fn try_lock_abandoned(&self) -> Option<std::fs::File> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(self.join(OWNER_LOCK))
            .ok()?;
        file.try_lock().ok()?;
        Some(file)
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
    super::ebpf::tear_down(dir.path(), id);
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
///
/// "No longer exists" is the owner's lock being free, not its PID being absent from `/proc`:
/// a check of the PID followed by a read of the state could see a lab as not kept, then its
/// owner mark it kept and exit, then the PID gone, and tear down a lab left running on purpose
/// (with whatever ran in it, a user's kubectl included). Holding the lock while reading the
/// state closes that gap: the owner writes `kept` before it exits and releases the lock.
pub fn sweep_abandoned() -> Vec<String> {
    labs()
        .into_iter()
        .filter_map(|(id, _)| {
            let dir = LabDir::of(&id);
            let _lock = dir.try_lock_abandoned()?;
            let state = dir.load()?;
            (!state.kept).then(|| {
                tear_down(&id);
                id
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_in(tmp: &tempfile::TempDir) -> LabDir {
        LabDir {
            path: tmp.path().to_owned(),
        }
    }

    #[test]
    fn a_lab_is_abandoned_only_once_its_owner_lock_is_free() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = dir_in(&tmp);
        // Before the owner has taken the lock (no lock file yet), the lab is not abandoned.
        assert!(dir.try_lock_abandoned().is_none());
        let owner = dir.lock_as_owner().unwrap();
        assert!(dir.try_lock_abandoned().is_none(), "the owner holds it");
        drop(owner); // what the kernel does when the owner exits, SIGKILL or not
        let sweeper = dir.try_lock_abandoned().expect("the owner is gone");
        // While a sweep holds it, a new owner waits rather than fails; here it just shows that
        // the lock is exclusive.
        assert!(dir.try_lock_abandoned().is_none());
        drop(sweeper);
    }

    #[test]
    fn the_state_file_is_replaced_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = dir_in(&tmp);
        let mut state = State {
            id: "abcde".into(),
            owner_pid: 1,
            kept: false,
            proxy_mode: "nftables".into(),
            namespaces: vec!["nplab-abcde-client".into()],
        };
        dir.save(&state).unwrap();
        state.kept = true;
        dir.save(&state).unwrap();
        assert_eq!(dir.load(), Some(state));
        assert!(!dir.join("state.json.next").exists());
    }
}
