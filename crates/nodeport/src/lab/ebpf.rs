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
    let cgroup = hierarchy.join(format!("nodeport-lab-{id}-{node}"));
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

/// Removes what [`prepare_node`] made for every node (after the proxies stopped): pins
/// (pinned links detach), bpffs mounts, cgroups, the cgroup2 mount. Missing parts are fine.
pub fn tear_down(lab_dir: &Path) {
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
                .starts_with("nodeport-lab-")
            {
                let _ = std::fs::remove_dir(group.path());
            }
        }
    }
    let _ = nix::mount::umount2(&hierarchy, nix::mount::MntFlags::MNT_DETACH);
}
