//! `nodeport version` and `nodeport --version`: the build information, and each dataplane's
//! check agreeing with what the kernel and the tools do when asked directly, leaving nothing
//! behind.

use std::collections::BTreeMap;
use std::process::Command;

fn nodeport(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The dataplane lines: name → (word, detail).
fn dataplanes(report: &str) -> BTreeMap<String, (String, String)> {
    report
        .lines()
        .skip_while(|l| *l != "dataplanes on this kernel:")
        .skip(1)
        .map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next().unwrap().to_owned();
            let word = words.next().unwrap().to_owned();
            (name, (word, words.collect::<Vec<_>>().join(" ")))
        })
        .collect()
}

#[test]
fn version_and_dash_dash_version_name_version_commit_date_and_compiler() {
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let head = String::from_utf8(head.stdout).unwrap();
    for args in [&["version"][..], &["--version"], &["-V"]] {
        let report = nodeport(args);
        assert!(
            report.starts_with(&format!("nodeport {}\n", env!("CARGO_PKG_VERSION"))),
            "{report}"
        );
        assert!(
            report.contains(&format!("  git commit:  {}\n", head.trim())),
            "{report}"
        );
        assert!(report.contains("  build date:  20"), "{report}");
        assert!(report.contains("  rust:        rustc 1."), "{report}");
        assert_eq!(
            dataplanes(&report).keys().collect::<Vec<_>>(),
            [
                "ebpf",
                "iptables-legacy",
                "iptables-nft",
                "ipvs",
                "nftables"
            ]
        );
    }
}

#[test]
fn each_dataplane_check_agrees_with_the_kernel_and_leaves_nothing_behind() {
    if !nodeport_testbed::require_tools(
        "each_dataplane_check_agrees_with_the_kernel_and_leaves_nothing_behind",
        &[
            "nft",
            "iptables-nft-restore",
            "iptables-legacy-restore",
            "iptables-nft-save",
            "iptables-legacy-save",
        ],
    ) {
        return;
    }
    let report = nodeport(&["version"]);
    let found = dataplanes(&report);
    let word = |name: &str| found[name].0.as_str();

    // nftables: nft itself can read the ruleset.
    let nft = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert_eq!(
        word("nftables"),
        if nft.status.success() { "yes" } else { "no" },
        "{report}"
    );
    // Both iptables back ends are installed here (the tools were required above); each works
    // on this kernel when its save tool can read the nat table.
    for (name, save) in [
        ("iptables-nft", "iptables-nft-save"),
        ("iptables-legacy", "iptables-legacy-save"),
    ] {
        let out = Command::new(save).args(["-t", "nat"]).output().unwrap();
        assert_eq!(
            word(name),
            if out.status.success() { "yes" } else { "no" },
            "{report}"
        );
        // The check's chain was written in a throwaway namespace, never here.
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("NODEPORT-VERSION-CHECK"),
            "{save} shows the check's chain"
        );
    }
    assert_eq!(
        word("ipvs"),
        if std::path::Path::new("/proc/net/ip_vs").exists() {
            "yes"
        } else {
            "no"
        },
        "{report}"
    );
    // As root on the project's kernels (6.x), tc and cgroup socket programs load.
    assert_eq!(word("ebpf"), "yes", "{report}");
}

/// A reader that stops early (`nodeport version | head -1`, `nodeport render ... | head`) ends
/// the command quietly with 141, as a C tool killed by SIGPIPE would be reported, instead of a
/// panic about a broken pipe.
#[test]
fn a_closed_pipe_on_stdout_ends_version_and_render_quietly_with_141() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let objects = dir.path().join("objects.yaml");
    std::fs::write(
        &objects,
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n  ports: [{port: 80, nodePort: 30080}]\n",
    )
    .unwrap();
    let render = ["render", "-f", objects.to_str().unwrap()];
    for args in [&["version"][..], &render[..]] {
        // A pipe whose read end is closed before the command starts.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
