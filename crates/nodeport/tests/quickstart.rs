//! `scripts/quickstart.sh`, the README's first command, as a user meets it: on a machine that
//! lacks the lab's tools, run by root and by a normal user with sudo. `apt-get`, `sudo`, `id`,
//! `cargo` and the built binary are stand-ins that log their calls (and apt-get "installs" by
//! linking the real tool in), so the test sees who runs what, and in which order, without
//! installing packages, building, or starting a lab.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn script(path: &Path, body: &str) {
    std::fs::write(path, format!("#!/bin/bash\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Where a command lives on this machine (the test's PATH hides /usr/sbin and /sbin).
fn real(command: &str) -> Option<PathBuf> {
    ["/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(command))
        .find(|p| p.is_file())
}

/// Runs the quick start with `uid` as the caller; returns the log of calls and the exit status.
fn quickstart(uid: u32) -> (Vec<String>, std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    let target = dir.path().join("target");
    let log = dir.path().join("log");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(target.join("release")).unwrap();
    let log_line = format!("echo \"$(basename \"$0\") $*\" >> {}", log.display());

    script(
        &bin.join("id"),
        &format!("[ \"$1\" = -u ] && echo {uid} || /usr/bin/id \"$@\""),
    );
    // sudo: logs, then runs the command (as this same process: the test runs as root).
    script(&bin.join("sudo"), &format!("{log_line}\nexec \"$@\""));
    script(&bin.join("cargo"), &log_line);
    // apt-get install: "installs" a package by linking the real commands it provides.
    let mut links = String::new();
    for (package, commands) in [
        ("nftables", &["nft"][..]),
        ("iproute2", &["ip"]),
        ("iptables", &["iptables", "iptables-restore"]),
        ("kubernetes-client", &["kubectl"]),
        ("protobuf-compiler", &["protoc"]),
        ("gcc", &["cc"]),
        ("clang-19", &["clang-19"]),
        ("bpftool", &["bpftool"]),
    ] {
        for command in commands {
            let real = real(command).unwrap_or_else(|| panic!("{command} is not installed"));
            links.push_str(&format!(
                "case \" $* \" in *\" {package} \"*) ln -sf {} {}/{command};; esac\n",
                real.display(),
                bin.display()
            ));
        }
    }
    script(&bin.join("apt-get"), &format!("{log_line}\n{links}"));
    script(&target.join("release/nodeport"), &log_line);

    // PATH: the stand-ins and the tools every machine has (bash, coreutils, env), but not
    // /usr/sbin or /sbin, where nft, ip and iptables live, nor cc, protoc or kubectl.
    let basics = dir.path().join("basics");
    std::fs::create_dir_all(&basics).unwrap();
    for tool in [
        "bash", "env", "sort", "basename", "dirname", "printf", "cat", "ln", "rm",
    ] {
        std::os::unix::fs::symlink(real(tool).unwrap(), basics.join(tool)).unwrap();
    }
    let out = Command::new(real("bash").unwrap())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/quickstart.sh"))
        .args(["--proxy-mode", "iptables"])
        .env_clear()
        .env("PATH", format!("{}:{}", bin.display(), basics.display()))
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .unwrap();
    let calls = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            l.replace(&bin.display().to_string(), "BIN")
                .replace(&basics.display().to_string(), "BASICS")
                .replace(&target.display().to_string(), "TARGET")
        })
        .collect();
    (
        calls,
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const PACKAGES: &str =
    "bpftool clang-19 gcc iproute2 iptables kubernetes-client nftables protobuf-compiler";

#[test]
fn as_root_the_quick_start_installs_what_is_missing_builds_and_runs_the_lab() {
    let (calls, status, stderr) = quickstart(0);
    assert!(status.success(), "{stderr}");
    assert_eq!(
        calls,
        [
            "apt-get update -qq".to_owned(),
            format!("apt-get install -y -qq {PACKAGES}"),
            "cargo build --release --locked -p nodeport".to_owned(),
            "nodeport lab --proxy-mode iptables".to_owned(),
        ],
        "{stderr}"
    );
}

#[test]
fn as_a_user_the_quick_start_builds_as_the_user_and_uses_sudo_for_apt_and_the_lab() {
    let (calls, status, stderr) = quickstart(1000);
    assert!(status.success(), "{stderr}");
    assert_eq!(
        calls,
        [
            "sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq".to_owned(),
            "apt-get update -qq".to_owned(),
            format!("sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {PACKAGES}"),
            format!("apt-get install -y -qq {PACKAGES}"),
            "cargo build --release --locked -p nodeport".to_owned(),
            "sudo env PATH=BIN:BASICS TARGET/release/nodeport lab --proxy-mode iptables".to_owned(),
            "nodeport lab --proxy-mode iptables".to_owned(),
        ],
        "{stderr}"
    );
}
