//! The gate in front of tests that need root, network namespaces and kernel tools.

/// The only way to skip privileged tests; CI never sets it.
pub const SKIP_VAR: &str = "NODEPORT_SKIP_PRIVILEGED";

/// Returns `true` when a privileged test may run, `false` only when the operator opted out with
/// `NODEPORT_SKIP_PRIVILEGED=1` (a line on stderr says the test was skipped).
///
/// # Panics
/// When not running as root, or when `ip` or `nft` is missing: such a test must fail loudly,
/// never pass silently.
pub fn require_privileged(test: &str) -> bool {
    require_tools(test, &["ip", "nft"])
}

/// Like [`require_privileged`], for a test that also needs the given commands
/// (for example `iptables-restore`, `conntrack`, `etcd`, `kubectl`).
///
/// # Panics
/// When not root or a command is missing, unless `NODEPORT_SKIP_PRIVILEGED=1`.
pub fn require_tools(test: &str, tools: &[&str]) -> bool {
    if std::env::var(SKIP_VAR).as_deref() == Ok("1") {
        eprintln!("SKIPPED {test}: {SKIP_VAR}=1");
        return false;
    }
    let mut missing: Vec<String> = Vec::new();
    if !nix::unistd::geteuid().is_root() {
        missing.push("root (run as uid 0)".to_owned());
    }
    for tool in ["ip"].iter().chain(tools) {
        if !on_path(tool) {
            missing.push(format!("`{tool}` on PATH"));
        }
    }
    assert!(
        missing.is_empty(),
        "{test} needs {}; install them (scripts/test.sh does) or set {SKIP_VAR}=1 to skip on purpose",
        missing.join(", ")
    );
    true
}

fn on_path(tool: &str) -> bool {
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| dir.join(tool).is_file())
}
