//! `nodeport lab --proxy-mode ebpf`: each node's proxy gets a bpffs pin root and a cgroup of
//! its own, under the lab's directory, so that the nodes' dataplanes share nothing and the
//! lab removes all of it. Both are mounted in the lab's mount namespace, outside
//! `ip netns exec` (which remounts /sys, hiding /sys/fs/cgroup, and whose own mounts die
//! with it): the cgroup2 hierarchy a second time on `<lab>/ebpf/cgroup2`, the node cgroups
//! in it, and one bpffs per node on `<lab>/ebpf/pins/<node>`.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The lab's eBPF folder.
fn root(lab_dir: &Path) -> PathBuf {
    lab_dir.join("ebpf")
}

/// Creates node `node`'s pin root and cgroup; returns the proxy's flags for them.
pub fn prepare_node(lab_dir: &Path, id: &str, node: &str) -> anyhow::Result<Vec<String>> {
    let hierarchy = root(lab_dir).join("cgroup2");
    if !hierarchy.join("cgroup.procs").exists() {
        std::fs::create_dir_all(&hierarchy)
            .with_context(|| format!("creating {}", hierarchy.display()))?;
        nix::mount::mount(
            Some("cgroup2"),
            &hierarchy,
            Some("cgroup2"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .with_context(|| format!("mounting the cgroup2 hierarchy on {}", hierarchy.display()))?;
    }
    let cgroup = hierarchy.join(format!("{}{node}", cgroup_prefix(id)));
    std::fs::create_dir(&cgroup)
        .with_context(|| format!("creating cgroup {}", cgroup.display()))?;
    let pins = root(lab_dir).join("pins").join(node);
    nodeport_proxy::ebpf::programs::ensure_bpffs(&pins)
        .with_context(|| format!("mounting bpffs on {}", pins.display()))?;
    Ok(vec![
        "--ebpf-pin-root".into(),
        pins.display().to_string(),
        "--ebpf-cgroup-root".into(),
        cgroup.display().to_string(),
    ])
}

/// Whether node `node`'s proxy has done its first sync: it attached the tc programs to the
/// node's `eth0` and pinned the link.
pub fn first_sync_done(lab_dir: &Path, node: &str) -> bool {
    root(lab_dir)
        .join("pins")
        .join(node)
        .join("links")
        .join("tc-eth0-ingress")
        .exists()
}

/// The prefix of lab `id`'s node cgroups. The hierarchy mounted under each lab's directory is
/// the machine's one cgroup2 hierarchy, where every lab's node cgroups are siblings: the
/// prefix keeps a lab's tear-down to its own.
fn cgroup_prefix(id: &str) -> String {
    format!("nodeport-lab-{id}-")
}

/// Removes what [`prepare_node`] made for lab `id`'s nodes (after the proxies stopped): pins
/// (pinned links detach), bpffs mounts, its node cgroups (never another lab's), the cgroup2
/// mount. Missing parts are fine.
pub fn tear_down(lab_dir: &Path, id: &str) {
    let root = root(lab_dir);
    if let Ok(nodes) = std::fs::read_dir(root.join("pins")) {
        for node in nodes.flatten() {
            let path = node.path();
            let _ = nodeport_proxy::ebpf::programs::remove_pins(&path);
            let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    let hierarchy = root.join("cgroup2");
    if let Ok(groups) = std::fs::read_dir(&hierarchy) {
        for group in groups.flatten() {
            if group
                .file_name()
                .to_string_lossy()
                .starts_with(&cgroup_prefix(id))
            {
                let _ = std::fs::remove_dir(group.path());
            }
        }
    }
    let _ = nix::mount::umount2(&hierarchy, nix::mount::MntFlags::MNT_DETACH);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two labs' node cgroups live side by side in the machine's cgroup2 hierarchy: one lab's
    /// tear-down leaves the other's (a black-box review lost a kept lab's cgroups to another
    /// lab run ending). Needs root (cgroup2); `NODEPORT_SKIP_PRIVILEGED=1` skips it.
    #[test]
    fn tearing_a_lab_down_leaves_another_labs_node_cgroups() {
        if std::env::var_os("NODEPORT_SKIP_PRIVILEGED").is_some() {
            eprintln!("skipped: NODEPORT_SKIP_PRIVILEGED is set");
            return;
        }
        let base = tempfile::tempdir().expect("temp dir");
        let unique = format!("t{}", std::process::id());
        let (a, b) = (format!("{unique}a"), format!("{unique}b"));
        let (dir_a, dir_b) = (base.path().join("a"), base.path().join("b"));
        prepare_node(&dir_a, &a, "worker").expect("lab a's node");
        let flags = prepare_node(&dir_b, &b, "worker").expect("lab b's node");
        let cgroup_b = PathBuf::from(&flags[3]);
        assert!(
            cgroup_b.join("cgroup.procs").exists(),
            "{}",
            cgroup_b.display()
        );
        tear_down(&dir_a, &a);
        let survived = cgroup_b.join("cgroup.procs").exists();
        tear_down(&dir_b, &b);
        assert!(survived, "lab a's tear-down removed lab b's cgroup");
        let hierarchy = root(&dir_b).join("cgroup2");
        assert!(
            !hierarchy.join("cgroup.procs").exists(),
            "the mount is gone"
        );
    }
}
