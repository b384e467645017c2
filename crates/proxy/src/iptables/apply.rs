//! Applying a ruleset: the kernel behind one trait, and the applier that turns "desired
//! ruleset" into `iptables-restore --noflush` runs, one per family, one transaction per table.
//!
//! * [`Kernel`]: restores, lists what the tables hold (`iptables-save`), checks the canary.
//!   [`IptablesCommand`] runs the `iptables` tools (the nf_tables or legacy variant, behind
//!   an optional prefix such as `ip netns exec <ns>`); [`FakeKernel`] keeps the tables in
//!   memory with the kernel's rules for what may fail, for unit tests.
//! * [`Applier`]: kube-proxy's sync. Every sync rewrites the top-level chains
//!   (`KUBE-SERVICES`, `KUBE-NODEPORTS`, ...), whose size grows with the number of Services;
//!   a partial sync rewrites only the per service chains whose content changed (a content
//!   hash per service port) and deletes the chains that went away; a full sync (start,
//!   failure, hourly, a missing canary) lists the tables, rewrites every chain, deletes stale
//!   ones, and prepends the jumps from the built-in chains that are missing.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::process::{Command, Stdio};

use super::names::{KUBE_FIREWALL, KUBE_PROXY_CANARY, is_service_chain};
use super::render::{localhost_nodeports, render_family};
use super::ruleset::{Line, Restore, Rule, Table, TableRestore, TableView, Target};
use crate::config::NodeConfig;
use crate::desired::DesiredState;
use crate::model::{IpFamily, ServicePortName};
use crate::tool::ToolError;

/// A kernel failure.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A command-line tool (`nft`, `iptables-restore`, ...) could not be run or refused; a
    /// refused transaction changed nothing (`iptables-restore`: in the table that failed).
    #[error(transparent)]
    Tool(#[from] ToolError),
    /// The tool did not finish in time and was killed.
    #[error("`{program}` did not finish within {after:?}; killed")]
    TimedOut {
        /// The command line.
        program: String,
        /// The time it was given.
        after: std::time::Duration,
    },
    /// Writing `route_localnet` failed.
    #[error("setting net.ipv4.conf.all.route_localnet=1")]
    Sysctl(#[source] std::io::Error),
    /// The fake kernel refused an operation, as the real one would.
    #[error("{0}")]
    Fake(String),
}

/// What the tables of a family hold now (from `iptables-save`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Existing {
    /// User-defined chains per table.
    pub chains: BTreeMap<Table, BTreeSet<String>>,
    /// Jumps found in built-in chains: `(table, built-in chain, comment, target)`.
    pub jumps: BTreeSet<(Table, String, Option<String>, String)>,
}

impl Existing {
    fn has_chain(&self, table: Table, name: &str) -> bool {
        self.chains.get(&table).is_some_and(|c| c.contains(name))
    }

    fn has_jump(&self, table: Table, from: &str, rule: &Rule) -> bool {
        let Some(target) = rule.jump_target() else {
            return false;
        };
        self.jumps.contains(&(
            table,
            from.to_string(),
            rule.comment().map(str::to_string),
            target.to_string(),
        ))
    }
}

/// The one place the kernel is touched.
pub trait Kernel: Send {
    /// Runs `iptables-restore --noflush` (or `ip6tables-restore`) with `restore`.
    fn restore(&mut self, restore: &Restore) -> Result<(), KernelError>;

    /// Lists the user chains and the jumps in built-in chains of `filter` and `nat`.
    fn list(&mut self, family: IpFamily) -> Result<Existing, KernelError>;

    /// Whether the `mangle` canary chain exists (kube-proxy's `iptables.Monitor`).
    fn canary_present(&mut self, family: IpFamily) -> Result<bool, KernelError>;

    /// Sets `net.ipv4.conf.all.route_localnet=1` (localhost NodePorts).
    fn enable_route_localnet(&mut self) -> Result<(), KernelError>;
}

impl Kernel for Box<dyn Kernel> {
    fn restore(&mut self, restore: &Restore) -> Result<(), KernelError> {
        (**self).restore(restore)
    }
    fn list(&mut self, family: IpFamily) -> Result<Existing, KernelError> {
        (**self).list(family)
    }
    fn canary_present(&mut self, family: IpFamily) -> Result<bool, KernelError> {
        (**self).canary_present(family)
    }
    fn enable_route_localnet(&mut self) -> Result<(), KernelError> {
        (**self).enable_route_localnet()
    }
}

/// Which `iptables` the tools are: Debian's `iptables` is an alternative pointing at one of
/// the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Variant {
    /// `iptables-restore`, `iptables-save`, `iptables` as installed (the default).
    #[default]
    System,
    /// `iptables-nft-restore` ...: the nf_tables backend.
    Nft,
    /// `iptables-legacy-restore` ...: the legacy x_tables backend.
    Legacy,
}

impl Variant {
    /// Parses `nft`, `legacy` or `system`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "system" | "" => Some(Variant::System),
            "nft" => Some(Variant::Nft),
            "legacy" => Some(Variant::Legacy),
            _ => None,
        }
    }
}

/// `--iptables-variant`: which `iptables` tools the iptables mode runs.
///
/// `auto` (the default) decides at start-up the way kube-proxy's container images do
/// ([`decide_variant`]); `nft` and `legacy` force one. On this machine
/// `iptables-nft-restore` grows close to quadratically with the size of the input (about 23 s
/// for 4,000 Services, minutes at 10,000: `docs/BENCHMARKS.md`, "nftables vs iptables"), so a
/// node with thousands of Services in iptables mode wants `--iptables-variant legacy` (or,
/// better, the nftables mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VariantChoice {
    /// Detect from what the kernel's tables hold ([`detect_variant`]).
    #[default]
    Auto,
    /// `iptables-nft*`.
    Nft,
    /// `iptables-legacy*`.
    Legacy,
}

impl VariantChoice {
    /// Parses `auto`, `nft` or `legacy`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(VariantChoice::Auto),
            "nft" => Some(VariantChoice::Nft),
            "legacy" => Some(VariantChoice::Legacy),
            _ => None,
        }
    }

    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            VariantChoice::Auto => "auto",
            VariantChoice::Nft => "nft",
            VariantChoice::Legacy => "legacy",
        }
    }
}

/// The chains whose presence tells which `iptables` a node uses: kubelet's
/// `KUBE-IPTABLES-HINT` and `KUBE-KUBELET-CANARY` (in `mangle`, since Kubernetes 1.17), the
/// two iptables-wrappers looks for, and our own (kube-proxy's) `KUBE-PROXY-CANARY`, so that a
/// restarted proxy stays with the tables it programmed even on a node without kubelet.
pub const VARIANT_HINT_CHAINS: [&str; 3] = [
    "KUBE-IPTABLES-HINT",
    "KUBE-KUBELET-CANARY",
    KUBE_PROXY_CANARY,
];

/// Whether `iptables-save` output declares one of [`VARIANT_HINT_CHAINS`] (a `:NAME` line).
pub fn has_hint_chains(save: &str) -> bool {
    save.lines().any(|line| {
        line.strip_prefix(':')
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|name| VARIANT_HINT_CHAINS.contains(&name))
    })
}

/// What [`detect_variant`] read: `iptables-save` outputs (IPv4 and IPv6) of each backend;
/// a tool that is missing, failed or timed out gives an empty string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VariantListings {
    /// `iptables-nft-save -t mangle`, `ip6tables-nft-save -t mangle`.
    pub nft: [String; 2],
    /// `iptables-legacy-save`, `ip6tables-legacy-save` (every table).
    pub legacy: [String; 2],
    /// `iptables-nft-save`, `ip6tables-nft-save` (every table): read only when no backend
    /// holds the hint chains, to count rules.
    pub nft_all: [String; 2],
}

/// The choice `auto` makes, and why (for the start-up log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Detected {
    /// The tools to run.
    pub variant: Variant,
    /// One line saying which listing decided.
    pub reason: &'static str,
}

/// The number of rules in `iptables-save` outputs: the lines that start with `-` (`-A ...`),
/// as the wrappers' `grep '^-' | wc -l` counts them.
pub fn count_rules<'a>(saves: impl IntoIterator<Item = &'a String>) -> usize {
    saves
        .into_iter()
        .flat_map(|s| s.lines())
        .filter(|l| l.starts_with('-'))
        .count()
}

/// Decides between the nft and the legacy tools as kube-proxy's images do. Their `iptables`
/// is kubernetes-sigs/iptables-wrappers: its `DetectMode` (pkg/xtables/detect.go) uses nft
/// when the nft `mangle` tables (IPv4, then IPv6) hold kubelet's hint chains, else legacy
/// when the legacy tables do. When neither does, that Go version falls back to nft; the
/// wrapper script it replaced (`iptables-wrapper-installer.sh`, also in kube-proxy images
/// built by kubernetes/release) instead counts the rules (`grep '^-' | wc -l`) of every
/// table of both families in each backend and takes legacy only when the legacy tables hold
/// strictly more (`-gt`), nft otherwise (a tie, nothing anywhere). We keep that count: a
/// node without kubelet's chains whose firewall is in the legacy tables is a legacy node,
/// and programming nf_tables beside it would split the rules between two backends. We also
/// count our own canary chain as a hint ([`VARIANT_HINT_CHAINS`]).
pub fn decide_variant(listings: &VariantListings) -> Detected {
    if listings.nft.iter().any(|s| has_hint_chains(s)) {
        return Detected {
            variant: Variant::Nft,
            reason: "the nf_tables iptables tables hold the Kubernetes chains",
        };
    }
    if listings.legacy.iter().any(|s| has_hint_chains(s)) {
        return Detected {
            variant: Variant::Legacy,
            reason: "the legacy iptables tables hold the Kubernetes chains and the nf_tables ones do not",
        };
    }
    if count_rules(&listings.legacy) > count_rules(&listings.nft_all) {
        return Detected {
            variant: Variant::Legacy,
            reason: "no Kubernetes chains in either backend, and the legacy tables hold more rules",
        };
    }
    Detected {
        variant: Variant::Nft,
        reason: "no Kubernetes chains in either backend, and the legacy tables hold no more rules: nf_tables",
    }
}

/// How long each `*-save` run of the detection may take before it is killed and counts as
/// empty: the iptables-wrappers script's `timeout 5` around the nft saves (iptables-nft
/// 1.8.3 could loop forever), given here to every detection save so that a stuck tool
/// cannot hang the proxy's start.
pub const DETECT_SAVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads what [`decide_variant`] needs with the tools behind `prefix` (as
/// iptables-wrappers does: `-t mangle` for nft; every table for legacy, because naming
/// `mangle` would make the legacy kernel module create that table; every nft table only if
/// no hint chain was found, to count rules) and decides. Each save gets
/// [`DETECT_SAVE_TIMEOUT`]. Errors are ignored, as upstream ignores them: a missing tool
/// lists nothing.
pub fn detect_variant(prefix: &[String]) -> Detected {
    detect_variant_within(prefix, DETECT_SAVE_TIMEOUT)
}

/// [`detect_variant`] with each save given `timeout`.
pub fn detect_variant_within(prefix: &[String], timeout: std::time::Duration) -> Detected {
    let with = |variant| IptablesCommand {
        prefix: prefix.to_vec(),
        variant,
    };
    let (nft, legacy) = (with(Variant::Nft), with(Variant::Legacy));
    let read = |c: &IptablesCommand, family, args: &[&str]| {
        c.run_bounded(&c.tool(family, "save"), args, timeout)
            .unwrap_or_default()
    };
    let mut listings = VariantListings {
        nft: [
            read(&nft, IpFamily::V4, &["-t", "mangle"]),
            read(&nft, IpFamily::V6, &["-t", "mangle"]),
        ],
        legacy: [
            read(&legacy, IpFamily::V4, &[]),
            read(&legacy, IpFamily::V6, &[]),
        ],
        nft_all: Default::default(),
    };
    let hinted = listings
        .nft
        .iter()
        .chain(&listings.legacy)
        .any(|s| has_hint_chains(s));
    if !hinted {
        listings.nft_all = [read(&nft, IpFamily::V4, &[]), read(&nft, IpFamily::V6, &[])];
    }
    decide_variant(&listings)
}

/// The tools to run for `choice`: detected for `auto`, with the reason.
pub fn resolve_variant(choice: VariantChoice, prefix: &[String]) -> Detected {
    match choice {
        VariantChoice::Auto => detect_variant(prefix),
        VariantChoice::Nft => Detected {
            variant: Variant::Nft,
            reason: "--iptables-variant nft",
        },
        VariantChoice::Legacy => Detected {
            variant: Variant::Legacy,
            reason: "--iptables-variant legacy",
        },
    }
}

/// The `iptables` tools, run with an optional prefix (`ip netns exec <ns>`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IptablesCommand {
    /// Program and arguments put before every tool (empty: run the tools directly).
    pub prefix: Vec<String>,
    /// Which variant of the tools.
    pub variant: Variant,
}

impl IptablesCommand {
    /// The tools inside network namespace `ns` (through `ip netns exec`).
    pub fn in_netns(ns: &str) -> Self {
        IptablesCommand {
            prefix: vec!["ip".into(), "netns".into(), "exec".into(), ns.into()],
            variant: Variant::System,
        }
    }

    /// The program name of `tool` (`restore`, `save`, or `""` for `iptables` itself).
    pub fn tool(&self, family: IpFamily, tool: &str) -> String {
        let base = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        let variant = match self.variant {
            Variant::System => "",
            Variant::Nft => "-nft",
            Variant::Legacy => "-legacy",
        };
        if tool.is_empty() {
            format!("{base}{variant}")
        } else {
            format!("{base}{variant}-{tool}")
        }
    }

    /// `program args` behind the prefix (e.g. `ip netns exec ns1`), and its command line.
    fn command(&self, program: &str, args: &[&str]) -> (Command, String) {
        let mut words: Vec<&str> = self.prefix.iter().map(String::as_str).collect();
        words.push(program);
        words.extend_from_slice(args);
        let mut c = Command::new(words[0]);
        c.args(&words[1..]);
        (c, words.join(" "))
    }

    /// Runs `program args` without input, killing it after `timeout`; returns stdout
    /// (stderr is discarded, as the wrappers' `2>/dev/null` does).
    fn run_bounded(
        &self,
        program: &str,
        args: &[&str],
        timeout: std::time::Duration,
    ) -> Result<String, KernelError> {
        let (mut cmd, line) = self.command(program, args);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| ToolError::Spawn {
                program: line.clone(),
                source,
            })?;
        // Read stdout on a thread: a large listing would otherwise fill the pipe and stall
        // the tool while we wait for it.
        let mut stdout = child.stdout.take().expect("piped stdout");
        let reader = std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = std::io::Read::read_to_end(&mut stdout, &mut text);
            text
        });
        let deadline = std::time::Instant::now() + timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) if std::time::Instant::now() >= deadline => {
                    // Our own child, by its handle.
                    let _ = child.kill();
                    let _ = child.wait();
                    break Err(KernelError::TimedOut {
                        program: line.clone(),
                        after: timeout,
                    });
                }
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(5)),
                Err(source) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break Err(ToolError::Spawn {
                        program: line.clone(),
                        source,
                    }
                    .into());
                }
            }
        };
        let text = reader.join().unwrap_or_default();
        let status = status?;
        if !status.success() {
            return Err(ToolError::Rejected {
                program: line,
                status,
                stderr: String::new(),
            }
            .into());
        }
        Ok(String::from_utf8_lossy(&text).into_owned())
    }

    /// Runs `program args`, feeding `input`; returns stdout.
    fn run(
        &self,
        program: &str,
        args: &[&str],
        input: Option<&str>,
    ) -> Result<String, KernelError> {
        let (cmd, line) = self.command(program, args);
        Ok(crate::tool::run(cmd, &line, input)?)
    }
}

/// Splits an `iptables-save` rule line into words, keeping double-quoted strings whole.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut any = false;
    for ch in line.chars() {
        match ch {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// Parses `iptables-save` output of one table into `existing`.
pub fn parse_save(table: Table, text: &str, existing: &mut Existing) {
    let chains = existing.chains.entry(table).or_default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(':') {
            if let Some(name) = rest.split_whitespace().next()
                && !table.is_builtin(name)
            {
                chains.insert(name.to_string());
            }
        } else if line.starts_with("-A ") {
            let w = words(line);
            let Some(chain) = w.get(1) else { continue };
            if !table.is_builtin(chain) {
                continue;
            }
            let after = |flag: &str| {
                w.iter()
                    .position(|x| x == flag)
                    .and_then(|i| w.get(i + 1))
                    .cloned()
            };
            if let Some(target) = after("-j") {
                existing
                    .jumps
                    .insert((table, chain.clone(), after("--comment"), target));
            }
        }
    }
}

impl Kernel for IptablesCommand {
    fn restore(&mut self, restore: &Restore) -> Result<(), KernelError> {
        if restore.is_empty() {
            return Ok(());
        }
        let program = self.tool(restore.family, "restore");
        self.run(
            &program,
            &["--noflush", "--counters", "-w", "5"],
            Some(&restore.text()),
        )
        .map(|_| ())
    }

    fn list(&mut self, family: IpFamily) -> Result<Existing, KernelError> {
        let program = self.tool(family, "save");
        let mut existing = Existing::default();
        for table in [Table::Filter, Table::Nat] {
            let text = self.run(&program, &["-t", table.as_str()], None)?;
            parse_save(table, &text, &mut existing);
        }
        Ok(existing)
    }

    fn canary_present(&mut self, family: IpFamily) -> Result<bool, KernelError> {
        let program = self.tool(family, "");
        match self.run(
            &program,
            &["-w", "5", "-t", "mangle", "-S", KUBE_PROXY_CANARY],
            None,
        ) {
            Ok(_) => Ok(true),
            Err(KernelError::Tool(ToolError::Rejected { .. })) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn enable_route_localnet(&mut self) -> Result<(), KernelError> {
        const PATH: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";
        if self.prefix.is_empty() {
            std::fs::write(PATH, "1").map_err(KernelError::Sysctl)
        } else {
            self.run("sh", &["-c", &format!("echo 1 > {PATH}")], None)
                .map(|_| ())
        }
    }
}

/// An in-memory kernel with iptables' rules for what may fail (jumping to or appending to a
/// missing chain, deleting a referenced or non-empty chain, declaring a built-in chain),
/// each table section applied whole or not at all; it can be told to fail.
#[derive(Debug, Clone, Default)]
pub struct FakeKernel {
    /// The tables of each family.
    pub tables: BTreeMap<IpFamily, TableView>,
    /// Fail this many coming restores.
    pub fail_next: usize,
    /// Every restore applied successfully, in order.
    pub history: Vec<Restore>,
    /// `route_localnet` was set.
    pub route_localnet: bool,
    /// Make setting `route_localnet` fail with this message (a read-only `/proc/sys`).
    pub route_localnet_fault: Option<String>,
}

impl FakeKernel {
    /// The tables of a family (empty built-in chains if never touched).
    pub fn view(&self, family: IpFamily) -> TableView {
        self.tables
            .get(&family)
            .cloned()
            .unwrap_or_else(TableView::empty)
    }
}

fn apply_section(view: &mut TableView, section: &TableRestore) -> Result<(), String> {
    let table = section.table;
    let key = |c: &str| (table, c.to_string());
    for c in &section.declare {
        if table.is_builtin(c) {
            return Err(format!("{table}: cannot declare built-in chain {c}"));
        }
        view.chains.insert(key(c), Vec::new());
    }
    let check_target = |view: &TableView, rule: &Rule| -> Result<(), String> {
        if let Target::Jump(t) = &rule.target
            && !view.chains.contains_key(&key(t))
        {
            return Err(format!("{table}: Couldn't load target `{t}'"));
        }
        Ok(())
    };
    for line in &section.lines {
        match line {
            Line::Append(chain, rule) | Line::Prepend(chain, rule) => {
                check_target(view, rule)?;
                let rules = view
                    .chains
                    .get_mut(&key(chain))
                    .ok_or(format!("{table}: chain `{chain}' does not exist"))?;
                if matches!(line, Line::Append(..)) {
                    rules.push(rule.clone());
                } else {
                    rules.insert(0, rule.clone());
                }
            }
            Line::DeleteChain(chain) => {
                if table.is_builtin(chain) {
                    return Err(format!("{table}: cannot delete built-in chain {chain}"));
                }
                let rules = view
                    .chains
                    .get(&key(chain))
                    .ok_or(format!("{table}: -X {chain}: no such chain"))?;
                if !rules.is_empty() {
                    return Err(format!("{table}: -X {chain}: directory not empty"));
                }
                let referenced = view
                    .chains
                    .iter()
                    .filter(|((t, _), _)| *t == table)
                    .flat_map(|(_, rules)| rules)
                    .any(|r| r.jump_target() == Some(chain.as_str()));
                if referenced {
                    return Err(format!("{table}: -X {chain}: too many links"));
                }
                view.chains.remove(&key(chain));
            }
        }
    }
    Ok(())
}

impl Kernel for FakeKernel {
    fn restore(&mut self, restore: &Restore) -> Result<(), KernelError> {
        if self.fail_next > 0 {
            self.fail_next -= 1;
            return Err(KernelError::Fake("injected failure".to_string()));
        }
        let view = self
            .tables
            .entry(restore.family)
            .or_insert_with(TableView::empty);
        // Each table is its own transaction, as `COMMIT` makes it.
        for section in &restore.tables {
            let mut next = view.clone();
            apply_section(&mut next, section).map_err(KernelError::Fake)?;
            *view = next;
        }
        self.history.push(restore.clone());
        Ok(())
    }

    fn list(&mut self, family: IpFamily) -> Result<Existing, KernelError> {
        let view = self.view(family);
        let mut existing = Existing::default();
        for ((table, chain), rules) in &view.chains {
            if table.is_builtin(chain) {
                for r in rules {
                    if let Some(t) = r.jump_target() {
                        existing.jumps.insert((
                            *table,
                            chain.clone(),
                            r.comment().map(str::to_string),
                            t.to_string(),
                        ));
                    }
                }
            } else {
                existing
                    .chains
                    .entry(*table)
                    .or_default()
                    .insert(chain.clone());
            }
        }
        Ok(existing)
    }

    fn canary_present(&mut self, family: IpFamily) -> Result<bool, KernelError> {
        Ok(self
            .view(family)
            .chain(Table::Mangle, KUBE_PROXY_CANARY)
            .is_some())
    }

    fn enable_route_localnet(&mut self) -> Result<(), KernelError> {
        if let Some(fault) = &self.route_localnet_fault {
            return Err(KernelError::Fake(fault.clone()));
        }
        self.route_localnet = true;
        Ok(())
    }
}

/// Rule counts of one table after a sync (kube-proxy's `sync_proxy_rules_iptables_total`
/// and `sync_proxy_rules_iptables_last`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleCount {
    /// Family.
    pub family: IpFamily,
    /// Table.
    pub table: Table,
    /// Rules the table holds for us.
    pub total: usize,
    /// Rules written by this sync.
    pub written: usize,
}

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// A full sync (every chain rewritten, tables listed).
    pub full: bool,
    /// Lines sent to `iptables-restore` (declarations, rules, deletions).
    pub lines: usize,
    /// Service chains written.
    pub service_chains_written: usize,
    /// Stale chains deleted.
    pub deleted_chains: usize,
    /// Rule counts per family and table.
    pub rules: Vec<RuleCount>,
}

/// A failed sync.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `iptables-restore` refused; the tables keep the previous rules (a table committed
    /// before the failing one keeps the new ones; the next sync is full).
    #[error("iptables-restore failed ({family:?})")]
    RestoreFailed {
        /// The family.
        family: IpFamily,
        /// Why.
        #[source]
        source: KernelError,
    },
    /// Listing the tables (full sync) failed.
    #[error("listing the {family:?} iptables tables failed")]
    ListFailed {
        /// The family.
        family: IpFamily,
        /// Why.
        #[source]
        source: KernelError,
    },
}

/// What was applied for one service port: a hash of its chains and their names.
#[derive(Debug, Clone)]
struct Applied {
    hash: u64,
    chains: Vec<String>,
}

fn hash_of<T: Hash>(t: &T) -> u64 {
    let mut h = DefaultHasher::new();
    t.hash(&mut h);
    h.finish()
}

/// An error and its sources on one line (`a: b: c`), to log and to compare.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Keeps the kernel's iptables equal to the desired ruleset, kube-proxy's way.
pub struct Applier<K: Kernel> {
    kernel: K,
    applied: BTreeMap<IpFamily, HashMap<ServicePortName, Applied>>,
    need_full: bool,
    route_localnet: bool,
    /// The last `route_localnet` failure logged, so that a lasting one is logged once.
    route_localnet_failure: Option<String>,
}

impl<K: Kernel> Applier<K> {
    /// An applier that will take over whatever the tables hold at its first sync.
    pub fn new(kernel: K) -> Self {
        Applier {
            kernel,
            applied: BTreeMap::new(),
            need_full: true,
            route_localnet: false,
            route_localnet_failure: None,
        }
    }

    /// The kernel.
    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    /// The kernel, mutably (tests inject faults).
    pub fn kernel_mut(&mut self) -> &mut K {
        &mut self.kernel
    }

    /// Whether the next sync will be full.
    pub fn needs_full_sync(&self) -> bool {
        self.need_full
    }

    /// Why setting `route_localnet` failed at the last attempt, if it did (localhost
    /// NodePorts do not reach pods meanwhile; the rules are synced all the same).
    pub fn route_localnet_failure(&self) -> Option<&str> {
        self.route_localnet_failure.as_deref()
    }

    /// Forces the next sync to be full (the hourly resync).
    pub fn request_full_sync(&mut self) {
        self.need_full = true;
    }

    /// Syncs the kernel to `desired`. `changed`: `Some` for a partial sync (the set is not
    /// needed: per service content hashes tell what changed), `None` for a full one. A
    /// partial sync turns full when one is needed or the canary is gone.
    pub fn sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncReport, Error> {
        let mut full = self.need_full || changed.is_none();
        if !full {
            for state in &desired.families {
                match self.kernel.canary_present(state.family) {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::info!(
                            family = state.family.as_str(),
                            "iptables canary chain gone (tables flushed?); resyncing fully"
                        );
                        full = true;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "checking the iptables canary failed");
                        full = true;
                    }
                }
            }
        }
        let mut report = SyncReport {
            full,
            ..Default::default()
        };
        let result = self.sync_families(desired, config, full, &mut report);
        match result {
            Ok(()) => {
                if full {
                    self.need_full = false;
                }
                // Only once the rules holding the KUBE-FIREWALL localnet guard are in: set
                // before, a failed sync would leave 127.0.0.0/8 routable from outside,
                // unguarded (CVE-2020-8558).
                self.enable_route_localnet_if_needed(desired, config);
                Ok(report)
            }
            Err(e) => {
                self.need_full = true;
                Err(e)
            }
        }
    }

    /// Sets `route_localnet` when localhost NodePorts are served. kube-proxy sets it at
    /// start-up (issue 90259) and, when the write fails, only logs it: the rules are synced
    /// all the same and localhost NodePorts do not reach pods, as in the nftables mode. The
    /// write is retried on every sync; a failure is logged when it first happens or changes,
    /// and the recovery once, not every sync.
    fn enable_route_localnet_if_needed(&mut self, desired: &DesiredState, config: &NodeConfig) {
        if self.route_localnet
            || !desired
                .families
                .iter()
                .any(|f| localhost_nodeports(f, config))
        {
            return;
        }
        match self.kernel.enable_route_localnet() {
            Ok(()) => {
                self.route_localnet = true;
                if self.route_localnet_failure.take().is_some() {
                    tracing::info!(
                        "set net.ipv4.conf.all.route_localnet=1; localhost NodePorts now reach pods"
                    );
                }
            }
            Err(e) => {
                let failure = error_chain(&e);
                if self.route_localnet_failure.as_deref() != Some(failure.as_str()) {
                    tracing::error!(
                        error = %failure,
                        "setting net.ipv4.conf.all.route_localnet=1 failed; localhost NodePorts \
                         will not reach pods (retried every sync, logged again only if the \
                         error changes)"
                    );
                }
                self.route_localnet_failure = Some(failure);
            }
        }
    }

    fn sync_families(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        full: bool,
        report: &mut SyncReport,
    ) -> Result<(), Error> {
        for state in &desired.families {
            let family = state.family;
            let existing = if full {
                Some(
                    self.kernel
                        .list(family)
                        .map_err(|source| Error::ListFailed { family, source })?,
                )
            } else {
                None
            };
            let rules = render_family(state, config);
            let previous = self.applied.remove(&family).unwrap_or_default();
            let mut next: HashMap<ServicePortName, Applied> =
                HashMap::with_capacity(rules.services.len());

            let mut filter = TableRestore::new(Table::Filter);
            let mut nat = TableRestore::new(Table::Nat);
            let (mut filter_total, mut nat_total) = (0, 0);
            for (table, chain) in &rules.top {
                let section = match table {
                    Table::Filter => {
                        filter_total += chain.rules.len();
                        &mut filter
                    }
                    _ => {
                        nat_total += chain.rules.len();
                        &mut nat
                    }
                };
                section.declare.push(chain.name.clone());
                for r in &chain.rules {
                    section
                        .lines
                        .push(Line::Append(chain.name.clone(), r.clone()));
                }
            }

            // Per service chains: only those whose content changed, unless full.
            let mut active: BTreeSet<&str> = BTreeSet::new();
            for (name, chains) in &rules.services {
                let hash = hash_of(chains);
                nat_total += chains.iter().map(|c| c.rules.len()).sum::<usize>();
                let same = previous.get(name).is_some_and(|a| a.hash == hash);
                if full || !same {
                    report.service_chains_written += chains.len();
                    for c in chains {
                        nat.declare.push(c.name.clone());
                        for r in &c.rules {
                            nat.lines.push(Line::Append(c.name.clone(), r.clone()));
                        }
                    }
                }
                active.extend(chains.iter().map(|c| c.name.as_str()));
                next.insert(
                    name.clone(),
                    Applied {
                        hash,
                        chains: chains.iter().map(|c| c.name.clone()).collect(),
                    },
                );
            }

            // Stale chains: declared (flushed) and deleted after every reference to them
            // was rewritten above.
            let stale: BTreeSet<String> = match &existing {
                Some(e) => e
                    .chains
                    .get(&Table::Nat)
                    .into_iter()
                    .flatten()
                    .filter(|c| is_service_chain(c) && !active.contains(c.as_str()))
                    .cloned()
                    .collect(),
                None => previous
                    .values()
                    .flat_map(|a| a.chains.iter())
                    .filter(|c| !active.contains(c.as_str()))
                    .cloned()
                    .collect(),
            };
            for c in &stale {
                nat.declare.push(c.clone());
                nat.lines.push(Line::DeleteChain(c.clone()));
            }
            report.deleted_chains += stale.len();

            let mut tables = Vec::new();
            if let Some(existing) = &existing {
                // Full sync: the canaries, kubelet's KUBE-FIREWALL if nobody made it yet,
                // and the jumps from the built-in chains that are missing (kube-proxy's
                // EnsureChain/EnsureRule(Prepend), here inside the same transaction).
                let localhost = rules.top_chain(Table::Filter, KUBE_FIREWALL).is_some();
                if !localhost && !existing.has_chain(Table::Filter, KUBE_FIREWALL) {
                    filter.declare.push(KUBE_FIREWALL.to_string());
                }
                filter.declare.push(KUBE_PROXY_CANARY.to_string());
                nat.declare.push(KUBE_PROXY_CANARY.to_string());
                for j in &rules.jumps {
                    if existing.has_jump(j.table, j.from, &j.rule) {
                        continue;
                    }
                    let section = if j.table == Table::Filter {
                        &mut filter
                    } else {
                        &mut nat
                    };
                    section
                        .lines
                        .push(Line::Prepend(j.from.to_string(), j.rule.clone()));
                }
                let mut mangle = TableRestore::new(Table::Mangle);
                mangle.declare.push(KUBE_PROXY_CANARY.to_string());
                tables.push(mangle);
            }
            report.rules.push(RuleCount {
                family,
                table: Table::Filter,
                total: filter_total,
                written: filter.lines.len(),
            });
            report.rules.push(RuleCount {
                family,
                table: Table::Nat,
                total: nat_total,
                written: nat.lines.len(),
            });
            tables.insert(0, nat);
            tables.insert(0, filter);
            let restore = Restore { family, tables };
            report.lines += restore.len();
            if let Err(source) = self.kernel.restore(&restore) {
                // What we remember may now differ from the kernel: forget it.
                self.applied.clear();
                return Err(Error::RestoreFailed { family, source });
            }
            self.applied.insert(family, next);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_save_output_yields_chains_and_jumps_with_quoted_comments() {
        let save = r#"# Generated by iptables-save v1.8.9 (nf_tables)
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j DOCKER_OUTPUT
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "ns/web cluster IP" -j KUBE-SVC-X
COMMIT
"#;
        let mut e = Existing::default();
        parse_save(Table::Nat, save, &mut e);
        assert_eq!(
            e.chains[&Table::Nat],
            BTreeSet::from([
                "KUBE-SERVICES".to_string(),
                "KUBE-SEP-SXIVWICOYRO3J4NJ".to_string()
            ])
        );
        assert!(e.jumps.contains(&(
            Table::Nat,
            "PREROUTING".into(),
            Some("kubernetes service portals".into()),
            "KUBE-SERVICES".into()
        )));
        assert!(
            e.jumps
                .contains(&(Table::Nat, "OUTPUT".into(), None, "DOCKER_OUTPUT".into()))
        );
        assert_eq!(e.jumps.len(), 2, "rules of our own chains are not jumps");
    }

    fn listings(nft: [&str; 2], legacy: [&str; 2]) -> VariantListings {
        VariantListings {
            nft: nft.map(str::to_string),
            legacy: legacy.map(str::to_string),
            nft_all: Default::default(),
        }
    }

    const HINT: &str = "# Generated by iptables-save\n*mangle\n:PREROUTING ACCEPT [0:0]\n\
                        :KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
    const CANARY_ONLY: &str = "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n";
    const OTHERS: &str = "*filter\n:INPUT ACCEPT [0:0]\n:DOCKER - [0:0]\n\
                          -A INPUT -m comment --comment \":KUBE-IPTABLES-HINT\" -j DOCKER\nCOMMIT\n";

    #[test]
    fn auto_picks_legacy_only_when_the_legacy_tables_hold_the_kubernetes_chains_and_nft_ones_do_not()
     {
        let d = |l| decide_variant(&l).variant;
        // iptables-wrappers' DetectMode: nft first, then legacy, else nft.
        assert_eq!(d(listings(["", ""], ["", ""])), Variant::Nft);
        assert_eq!(d(listings(["", ""], [HINT, ""])), Variant::Legacy);
        assert_eq!(
            d(listings(["", ""], ["", HINT])),
            Variant::Legacy,
            "IPv6 only"
        );
        assert_eq!(d(listings([HINT, ""], [HINT, HINT])), Variant::Nft);
        assert_eq!(d(listings(["", HINT], [HINT, ""])), Variant::Nft);
        // Our own canary counts as kube-proxy's chains.
        assert_eq!(d(listings(["", ""], [CANARY_ONLY, ""])), Variant::Legacy);
        // Only a chain declaration counts, not the name inside a rule or another chain.
        let mut others = listings(["", ""], [OTHERS, OTHERS]);
        others.nft_all = [OTHERS.to_string(), OTHERS.to_string()];
        assert_eq!(d(others), Variant::Nft);
    }

    /// An `iptables-save` listing of the filter table with `n` rules.
    fn with_rules(n: usize) -> String {
        let mut s = String::from("# Generated by iptables-save\n*filter\n:INPUT ACCEPT [0:0]\n");
        for i in 0..n {
            s.push_str(&format!("-A INPUT -s 192.0.2.{i}/32 -j DROP\n"));
        }
        s.push_str("COMMIT\n");
        s
    }

    #[test]
    fn without_hint_chains_auto_counts_rules_and_picks_legacy_only_when_it_holds_more_as_iptables_wrappers_does()
     {
        // iptables-wrapper-installer.sh: no KUBE-IPTABLES-HINT / KUBE-KUBELET-CANARY in
        // either backend: `grep '^-' | wc -l` over IPv4 and IPv6 saves of every table,
        // legacy if `num_legacy_lines -gt num_nft_lines`, else nft.
        let case = |legacy: [usize; 2], nft: [usize; 2]| {
            let l = VariantListings {
                nft: [String::new(), String::new()],
                legacy: legacy.map(with_rules),
                nft_all: nft.map(with_rules),
            };
            decide_variant(&l)
        };
        let legacy = case([3, 0], [2, 0]);
        assert_eq!(legacy.variant, Variant::Legacy);
        assert!(legacy.reason.contains("more rules"), "{}", legacy.reason);
        // Both families add up: 2 + 2 legacy rules beat 3 nft ones.
        assert_eq!(case([2, 2], [3, 0]).variant, Variant::Legacy);
        // A tie, nothing anywhere, or more nft rules: nft.
        assert_eq!(case([2, 0], [0, 2]).variant, Variant::Nft);
        assert_eq!(case([0, 0], [0, 0]).variant, Variant::Nft);
        assert_eq!(case([1, 0], [5, 0]).variant, Variant::Nft);
        // Only rule lines count: chain declarations, comments and COMMIT do not.
        assert_eq!(count_rules(&[with_rules(0), with_rules(4)]), 4);
        // Hint chains decide before any count: nft hints win over many legacy rules.
        let hinted = VariantListings {
            nft: [HINT.to_string(), String::new()],
            legacy: [with_rules(50), String::new()],
            nft_all: Default::default(),
        };
        assert_eq!(decide_variant(&hinted).variant, Variant::Nft);
    }

    #[test]
    fn a_detection_save_that_hangs_is_killed_after_the_timeout_and_lists_nothing() {
        // The wrappers run the nft saves under `timeout 5`. A prefix that ignores the tool
        // and sleeps stands for a stuck iptables-nft-save.
        let stuck = IptablesCommand {
            prefix: vec![
                "sh".into(),
                "-c".into(),
                "exec sleep 30".into(),
                "sh".into(),
            ],
            variant: Variant::Nft,
        };
        let started = std::time::Instant::now();
        let err = stuck
            .run_bounded(
                "iptables-nft-save",
                &[],
                std::time::Duration::from_millis(100),
            )
            .unwrap_err();
        assert!(matches!(err, KernelError::TimedOut { .. }), "{err}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "the sleeping tool was not killed"
        );
        // detect_variant_within treats it as an empty listing: nothing anywhere, nft.
        let d = detect_variant_within(&stuck.prefix, std::time::Duration::from_millis(50));
        assert_eq!(d.variant, Variant::Nft);
        // A tool that finishes in time is read whole.
        let echo = IptablesCommand {
            prefix: vec![
                "sh".into(),
                "-c".into(),
                "printf '*filter\\n-A INPUT -j DROP\\nCOMMIT\\n'".into(),
                "sh".into(),
            ],
            variant: Variant::Legacy,
        };
        let out = echo
            .run_bounded("iptables-legacy-save", &[], DETECT_SAVE_TIMEOUT)
            .unwrap();
        assert_eq!(out, "*filter\n-A INPUT -j DROP\nCOMMIT\n");
    }

    #[test]
    fn explicit_variants_are_not_detected_and_unknown_values_are_refused() {
        for (text, want) in [("nft", Variant::Nft), ("legacy", Variant::Legacy)] {
            let choice = VariantChoice::parse(text).unwrap();
            assert_eq!(choice.as_str(), text);
            // The prefix would fail if run: resolving an explicit choice runs nothing.
            let r = resolve_variant(choice, &["/nonexistent/prefix".to_string()]);
            assert_eq!(r.variant, want);
        }
        assert_eq!(VariantChoice::parse("auto"), Some(VariantChoice::Auto));
        assert_eq!(VariantChoice::default(), VariantChoice::Auto);
        assert_eq!(VariantChoice::parse("system"), None);
        assert_eq!(VariantChoice::parse(""), None);
    }

    #[test]
    fn tool_names_follow_the_variant_and_family() {
        let mut c = IptablesCommand::default();
        assert_eq!(c.tool(IpFamily::V4, "restore"), "iptables-restore");
        assert_eq!(c.tool(IpFamily::V6, "save"), "ip6tables-save");
        c.variant = Variant::Legacy;
        assert_eq!(c.tool(IpFamily::V4, "restore"), "iptables-legacy-restore");
        assert_eq!(c.tool(IpFamily::V6, ""), "ip6tables-legacy");
        c.variant = Variant::Nft;
        assert_eq!(c.tool(IpFamily::V4, "save"), "iptables-nft-save");
    }
}
