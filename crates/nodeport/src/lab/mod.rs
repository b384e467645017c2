//! `nodeport lab`: the NodePort lab of the reference guide, rebuilt with our own parts in
//! network namespaces on this machine.
//!
//! A control plane and two workers on one network, a client outside the cluster, a
//! deployment `web` of three pods on the workers; our API server on the control plane, one
//! `nodeport proxy` per node; the Service `web` exposed as a NodePort. Then it shows what the
//! guide shows (`kubectl get svc web`, the endpoints, every node IP answering on the NodePort
//! with a pod, the rules of one worker) and gives a verdict.
//!
//! Everything it creates is named for the run (`nplab-<id>-…` namespaces, the
//! `/run/nodeport/lab/<id>` directory, processes marked with `NODEPORT_LAB=<id>`) and is
//! removed on every way out (normal end, failure, Ctrl-C or SIGTERM) unless `--keep` asked to
//! leave a working lab running; `nodeport lab --down <id>` removes that later. A lab whose
//! process was killed outright is swept by the next `nodeport lab`.

pub mod dual_stack;
pub mod ebpf;
pub mod interrupt;
pub mod objects;
pub mod pki;
pub mod plan;
pub mod preflight;
pub mod processes;
pub mod state;
pub mod topology;
pub mod verdict;

use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nodeport_proxy::config::NftablesLayout;
use nodeport_testbed::{Lan, Netns, probe};

use interrupt::Interrupt;
use plan::{API_PORT, CLIENT_IP, Plan};
use processes::Processes;
use state::{LabDir, State};
use verdict::{NodeResult, Reach, Verdict};

/// The dataplane each node's proxy programs (`nodeport proxy --proxy-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProxyMode {
    /// kube-proxy's nftables mode: `table ip kube-proxy`.
    Nftables,
    /// kube-proxy's iptables mode: `KUBE-*` chains in the nat table.
    Iptables,
    /// kube-proxy's IPVS mode (needs IPVS in the kernel).
    Ipvs,
    /// Our eBPF dataplane: tc and cgroup socket programs, BPF maps (a pin root and a cgroup
    /// per node, see [`ebpf`]).
    Ebpf,
}

impl ProxyMode {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nftables => "nftables",
            Self::Iptables => "iptables",
            Self::Ipvs => "ipvs",
            Self::Ebpf => "ebpf",
        }
    }

    /// The mode recorded in a lab's state file ([`ProxyMode::as_str`]).
    fn from_state(text: &str) -> Self {
        match text {
            "iptables" => Self::Iptables,
            "ipvs" => Self::Ipvs,
            "ebpf" => Self::Ebpf,
            _ => Self::Nftables,
        }
    }
}

/// What a lab run does.
#[derive(Debug, Clone)]
pub struct Config {
    /// The proxies' dataplane.
    pub proxy_mode: ProxyMode,
    /// nftables mode: the proxies' table layout.
    pub nftables_layout: NftablesLayout,
    /// Leave the lab running at the end (also after a failed verdict, to look into it; never
    /// after a setup error or a signal).
    pub keep: bool,
    /// Pods in the deployment; the reference scales `web` to 3.
    pub replicas: usize,
    /// IPv4 only, or dual-stack (see [`dual_stack`]).
    pub ip_family: dual_stack::IpFamily,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            proxy_mode: ProxyMode::Nftables,
            nftables_layout: NftablesLayout::Flat,
            keep: false,
            replicas: 3,
            ip_family: dual_stack::IpFamily::Ipv4,
        }
    }
}

/// How long the API server may take to answer `/readyz` (it opens its store first).
const API_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a proxy may take to program its first rules.
const PROXY_SYNC_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the NodePort may take to answer on a node once the objects exist.
const REACH_TIMEOUT: Duration = Duration::from_secs(45);
/// One HTTP attempt from the client.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long processes get to exit on SIGTERM at teardown before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// The title of the page the pods serve, as nginx's default site has it.
const WELCOME: &str = "Welcome to nginx!";
/// The steps, for the `[n/N]` progress prefix.
const STEPS: usize = 9;

/// Runs the lab; returns its verdict (the caller turns a failed one into an exit status).
/// Everything is removed before this returns, except with [`Config::keep`].
pub fn run(config: &Config, interrupt: &Interrupt) -> anyhow::Result<Verdict> {
    preflight::check(config.proxy_mode)?;
    for id in state::sweep_abandoned() {
        println!("removed lab {id}, left behind by a nodeport lab process that no longer exists");
    }
    let mut lab = Lab::create(config)?;
    let verdict = lab.build_and_check(interrupt)?;
    println!("{verdict}");
    if config.keep {
        lab.keep(verdict.node_port)?;
    } else {
        println!("removing lab {} ...", lab.plan.id);
    }
    Ok(verdict)
}

/// Removes a lab left running with `--keep` (or by a crash): `nodeport lab --down <id>`.
pub fn down(id: &str) -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("removing a lab needs root (it deletes network namespaces): run it with sudo");
    }
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        bail!("invalid lab id {id:?}: ids are letters and digits, as printed by `nodeport lab`");
    }
    let dir = LabDir::of(id);
    if !dir.path().exists() && state::namespaces_of(id).is_empty() {
        let known: Vec<String> = state::labs()
            .into_iter()
            .map(|(id, st)| match st {
                Some(st) if st.kept => format!("{id} (kept)"),
                Some(_) => format!("{id} (running)"),
                None => id,
            })
            .collect();
        if known.is_empty() {
            bail!("there is no lab {id} on this machine (and no other)");
        }
        bail!(
            "there is no lab {id} on this machine; labs here: {}",
            known.join(", ")
        );
    }
    let removed = state::tear_down(id);
    println!(
        "lab {id} removed: {} namespaces, their links and processes, and {}",
        removed.len(),
        dir.path().display()
    );
    Ok(())
}

/// A lab being built: every part it created, torn down in reverse on drop unless kept.
struct Lab {
    plan: Plan,
    dir: LabDir,
    /// The owner's lock on the lab directory, held until this process ends (see
    /// [`state::sweep_abandoned`]).
    _owner: std::fs::File,
    state: State,
    processes: Processes,
    pods: Vec<Netns>,
    nodes: Vec<Netns>,
    client: Option<Netns>,
    lan: Option<Lan>,
    kept: bool,
    step: usize,
    ip_family: dual_stack::IpFamily,
    nftables_layout: NftablesLayout,
}

impl Lab {
    /// Picks an unused id, creates the lab directory and records the state, before any
    /// namespace exists (so a crash at any later point leaves something to sweep by).
    fn create(config: &Config) -> anyhow::Result<Self> {
        // An id is free when neither its directory nor any of its namespaces exists.
        let mut last_error = None;
        let (id, dir) = (0..10)
            .find_map(|_| {
                let id = plan::new_id();
                if !state::namespaces_of(&id).is_empty() {
                    return None;
                }
                LabDir::create(&id)
                    .map_err(|err| last_error = Some(err))
                    .ok()
                    .map(|dir| (id, dir))
            })
            .ok_or_else(|| {
                let what = format!("create a lab directory under {}", state::LABS_DIR);
                match last_error {
                    Some(err) => anyhow::Error::new(err).context(what),
                    None => anyhow::anyhow!("{what}: no free lab id"),
                }
            })?;
        let owner = dir.lock_as_owner().context("lock the lab directory")?;
        let plan = Plan::new(&id, config.replicas);
        let state = State {
            id: id.clone(),
            owner_pid: std::process::id(),
            kept: false,
            proxy_mode: config.proxy_mode.as_str().to_owned(),
            namespaces: plan.namespaces(),
        };
        let lab = Self {
            plan,
            dir,
            _owner: owner,
            state,
            processes: Processes::default(),
            pods: Vec::new(),
            nodes: Vec::new(),
            client: None,
            lan: None,
            kept: false,
            step: 0,
            ip_family: config.ip_family,
            nftables_layout: config.nftables_layout,
        };
        lab.dir.save(&lab.state).context("write the lab state")?;
        let layout = match config.proxy_mode {
            ProxyMode::Nftables => format!(" ({} layout)", config.nftables_layout.as_str()),
            _ => String::new(),
        };
        println!(
            "nodeport lab {id}: proxy mode {}{layout}, files in {}",
            config.proxy_mode.as_str(),
            lab.dir.path().display()
        );
        if config.ip_family == dual_stack::IpFamily::Dual {
            println!(
                "  dual-stack: IPv6 beside every IPv4 address (nodes {}, client {}), Service \
                 ranges {}",
                dual_stack::NODE_NETWORK6,
                dual_stack::CLIENT_IP6,
                dual_stack::SERVICE_RANGES
            );
        }
        Ok(lab)
    }

    fn progress(&mut self, text: &str) {
        self.step += 1;
        println!("[{}/{STEPS}] {text}", self.step);
    }

    fn control_plane(&self) -> &Netns {
        &self.nodes[0]
    }

    fn build_and_check(&mut self, interrupt: &Interrupt) -> anyhow::Result<Verdict> {
        let mode = ProxyMode::from_state(&self.state.proxy_mode);
        let nodes_text: Vec<String> = self
            .plan
            .nodes
            .iter()
            .map(|n| format!("{} {}", n.name, n.ip))
            .collect();
        self.progress(&format!(
            "network {}: nodes {}, client {CLIENT_IP} outside the cluster",
            plan::NODE_NETWORK,
            nodes_text.join(", ")
        ));
        let (lan, nodes, client) = topology::build_network(&self.plan)?;
        (self.lan, self.nodes, self.client) = (Some(lan), nodes, Some(client));
        interrupt.check()?;

        self.progress(&format!(
            "deployment {}: {} pods on the workers, one namespace each",
            plan::APP,
            self.plan.pods.len()
        ));
        self.pods = topology::build_pods(&self.plan, &self.nodes)?;
        if self.ip_family == dual_stack::IpFamily::Dual {
            let client = self.client.as_ref().expect("network is built");
            dual_stack::add_ipv6(&self.plan, &self.nodes, client, &self.pods)?;
        }
        self.start_pods()?;
        interrupt.check()?;

        self.progress(&format!(
            "API server on {} (https://{}:{API_PORT}, TLS, tokens and RBAC, embedded store)",
            self.plan.control_plane().name,
            self.plan.control_plane().ip
        ));
        self.start_api()?;
        self.wait_api(interrupt)?;

        self.progress("nodes register, as their kubelets would");
        let mut node_objects = objects::nodes(&self.plan);
        if self.ip_family == dual_stack::IpFamily::Dual {
            node_objects = dual_stack::dual_stack_nodes(&self.plan, node_objects);
        }
        let nodes = objects::to_yaml(&node_objects)?;
        self.create_objects("nodes.yaml", &nodes)?;
        self.show(&["get", "nodes", "-o", "wide"])?;
        interrupt.check()?;

        self.progress(&format!(
            "one nodeport proxy per node, --proxy-mode {}",
            mode.as_str()
        ));
        self.start_proxies(mode)?;
        self.wait_proxies(mode, interrupt)?;
        self.check_proxy_privilege()?;
        interrupt.check()?;

        self.progress("kubectl expose deployment web --port=80 --type=NodePort");
        let mut service = objects::service();
        if self.ip_family == dual_stack::IpFamily::Dual {
            service = dual_stack::dual_stack_service(service);
        }
        let service = objects::to_yaml(&[service])?;
        self.create_objects("service.yaml", &service)?;
        let node_port = self.node_port()?;
        let uid = self.kubectl(&["get", "svc", plan::APP, "-o", "jsonpath={.metadata.uid}"])?;
        self.show(&["get", "svc", plan::APP])?;
        interrupt.check()?;

        self.progress("the endpoint controllers publish the ready pods");
        let slice_suffix = plan::new_id();
        let uid = Some(uid.trim()).filter(|u| !u.is_empty());
        let mut slices = vec![objects::endpoint_slice(&self.plan, &slice_suffix, uid)];
        if self.ip_family == dual_stack::IpFamily::Dual {
            let ipv6 = dual_stack::ipv6_slice(&self.plan, slices[0].clone(), &plan::new_id());
            slices.push(ipv6);
        }
        let endpoints = format!(
            "{}---\n{}",
            objects::to_yaml(&slices)?,
            objects::to_yaml(&[objects::endpoints(&self.plan)])?
        );
        self.create_objects("endpoints.yaml", &endpoints)?;
        self.show(&["get", "ep"])?;
        self.show(&[
            "get",
            "endpointslices",
            "-l",
            &format!("{}={}", objects::SERVICE_NAME_LABEL, plan::APP),
        ])?;
        interrupt.check()?;

        self.progress(&format!(
            "from the client ({CLIENT_IP}) to every node IP on NodePort {node_port}"
        ));
        let verdict = self.reach_every_node(mode, node_port, interrupt)?;

        let worker = self.plan.nodes.len() - 1;
        self.progress(&format!(
            "the rules of {}",
            self.plan.nodes[worker].name.clone()
        ));
        self.show_rules(mode, worker, node_port);
        Ok(verdict)
    }

    /// Starts one `nodeport pod-server` per pod, inside its namespace.
    fn start_pods(&mut self) -> anyhow::Result<()> {
        for (pod, ns) in self.plan.pods.iter().zip(&self.pods) {
            let mut args = os_args(&[
                "pod-server",
                "--name",
                &pod.name,
                "--http",
                &plan::WEB_PORT.to_string(),
            ]);
            if self.ip_family == dual_stack::IpFamily::Dual {
                args.extend(os_args(&["--bind", "::"]));
            }
            let log = self.dir.log(&format!("pod-{}", pod.name));
            self.processes
                .start(&self.plan.id, ns, &format!("pod-{}", pod.name), &args, &log)?;
            println!(
                "  {} {} on {}",
                pod.name, pod.ip, self.plan.nodes[pod.node].name
            );
        }
        Ok(())
    }

    /// Makes the lab's credentials and starts the API server on the control plane's node
    /// address, with TLS and token authentication, as kube-apiserver runs in a kubeadm
    /// cluster.
    fn start_api(&mut self) -> anyhow::Result<()> {
        let cp = self.plan.control_plane();
        let pki_dir = self.dir.join("pki");
        std::fs::create_dir_all(&pki_dir).context("create the pki directory")?;
        let cert = pki::serving_cert(
            &self.plan.id,
            &[cp.name.as_str(), "kubernetes", "localhost"],
            &[IpAddr::V4(cp.ip), IpAddr::V4(Ipv4Addr::LOCALHOST)],
        )
        .context("issue the API server's certificate")?;
        let (ca, cert_file, key_file, tokens_file) = (
            pki_dir.join("ca.pem"),
            pki_dir.join("apiserver.pem"),
            pki_dir.join("apiserver-key.pem"),
            pki_dir.join("tokens.csv"),
        );
        std::fs::write(&ca, &cert.ca_pem)?;
        std::fs::write(&cert_file, &cert.cert_pem)?;
        std::fs::write(&key_file, &cert.key_pem)?;
        // kubeadm's admin, in system:masters; the proxies' user system:kube-proxy, which the
        // bootstrap policy binds to the ClusterRole system:node-proxier (read Services,
        // EndpointSlices, Nodes; write events) and nothing else.
        let (admin, proxy) = (pki::token()?, pki::token()?);
        std::fs::write(
            &tokens_file,
            pki::token_line(&admin, "kubernetes-admin", &["system:masters"])
                + &pki::token_line(&proxy, "system:kube-proxy", &[]),
        )?;
        let server = format!("https://{}:{API_PORT}", cp.ip);
        let ca_text = ca.display().to_string();
        std::fs::write(
            self.dir.join("kubeconfig"),
            pki::kubeconfig(&server, &ca_text, "kubernetes-admin", &admin),
        )?;
        std::fs::write(
            self.dir.join("kube-proxy.kubeconfig"),
            pki::kubeconfig(&server, &ca_text, "system:kube-proxy", &proxy),
        )?;
        let mut args = os_args(&[
            "apiserver",
            "--bind-address",
            &cp.ip.to_string(),
            "--port",
            &API_PORT.to_string(),
            "--authorization-mode",
            "RBAC",
        ]);
        if self.ip_family == dual_stack::IpFamily::Dual {
            args.extend(os_args(&[
                "--service-cluster-ip-range",
                dual_stack::SERVICE_RANGES,
            ]));
        }
        for (flag, path) in [
            ("--tls-cert-file", &cert_file),
            ("--tls-private-key-file", &key_file),
            ("--token-auth-file", &tokens_file),
            ("--data-dir", &self.dir.join("apiserver-data")),
        ] {
            args.push(flag.into());
            args.push(path.clone().into_os_string());
        }
        let log = self.dir.log("apiserver");
        self.processes
            .start(&self.plan.id, &self.nodes[0], "apiserver", &args, &log)?;
        Ok(())
    }

    /// Waits until the API server accepts connections, then checks that kubectl gets `ok`
    /// from `/readyz` over TLS with the admin token.
    fn wait_api(&mut self, interrupt: &Interrupt) -> anyhow::Result<()> {
        let start = Instant::now();
        let to = SocketAddr::new(IpAddr::V4(self.plan.control_plane().ip), API_PORT);
        let mut last = String::new();
        while start.elapsed() < API_READY_TIMEOUT {
            interrupt.check()?;
            self.check_processes()?;
            match probe::tcp_connect(self.control_plane(), to, Duration::from_secs(1)) {
                Ok(_) => {
                    let ready = self.kubectl(&["get", "--raw", "/readyz"])?;
                    if ready.trim() == "ok" {
                        println!("  ready in {:.1}s", start.elapsed().as_secs_f64());
                        return Ok(());
                    }
                    last = format!("/readyz answered {:?}", ready.trim());
                }
                Err(err) => last = error_chain(&err),
            }
            interrupt.sleep(Duration::from_millis(100))?;
        }
        bail!(
            "the API server did not become ready in {}s ({last}); last lines of {}:\n{}",
            API_READY_TIMEOUT.as_secs(),
            self.dir.log("apiserver").display(),
            processes::tail(&self.dir.log("apiserver"), 20)
        )
    }

    /// Fails if any process of the lab has exited, with its log's last lines.
    fn check_processes(&mut self) -> anyhow::Result<()> {
        if let Some((name, status, log)) = self.processes.exited().into_iter().next() {
            bail!(
                "{name} exited ({status}); last lines of {}:\n{}",
                log.display(),
                processes::tail(&log, 20)
            );
        }
        Ok(())
    }

    /// Starts `nodeport proxy` in every node namespace, configured as kube-proxy on a kind
    /// node: its own kubeconfig, its node name, the cluster's pod network.
    fn start_proxies(&mut self, mode: ProxyMode) -> anyhow::Result<()> {
        let kubeconfig = self.dir.join("kube-proxy.kubeconfig");
        for i in 0..self.plan.nodes.len() {
            let node = self.plan.nodes[i].name.clone();
            let mut args = os_args(&["proxy", "--kubeconfig"]);
            args.push(kubeconfig.clone().into_os_string());
            args.extend(os_args(&[
                "--hostname-override",
                &node,
                "--proxy-mode",
                mode.as_str(),
                "--cluster-cidr",
                &dual_stack::cluster_cidrs(self.ip_family),
            ]));
            if mode == ProxyMode::Nftables {
                args.extend(os_args(&[
                    "--nftables-layout",
                    self.nftables_layout.as_str(),
                ]));
            }
            if mode == ProxyMode::Ebpf {
                let flags = ebpf::prepare_node(self.dir.path(), &self.plan.id, &node)?;
                args.extend(flags.into_iter().map(OsString::from));
            }
            let name = format!("proxy-{node}");
            let log = self.dir.log(&name);
            self.processes
                .start(&self.plan.id, &self.nodes[i], &name, &args, &log)?;
        }
        Ok(())
    }

    /// Waits until every node's proxy has programmed its table (its first sync, which comes
    /// after its first list of Services, EndpointSlices and its Node).
    fn wait_proxies(&mut self, mode: ProxyMode, interrupt: &Interrupt) -> anyhow::Result<()> {
        let start = Instant::now();
        let probe: &[&str] = match mode {
            ProxyMode::Nftables => &["nft", "list", "table", "ip", "kube-proxy"],
            ProxyMode::Iptables | ProxyMode::Ipvs => {
                &["iptables", "-t", "nat", "-S", "KUBE-SERVICES"]
            }
            // The first sync attaches the tc programs to the node's interface and pins the
            // link (see `ebpf::first_sync_done`).
            ProxyMode::Ebpf => &[],
        };
        for i in 0..self.plan.nodes.len() {
            loop {
                interrupt.check()?;
                self.check_processes()?;
                let done = if mode == ProxyMode::Ebpf {
                    ebpf::first_sync_done(self.dir.path(), &self.plan.nodes[i].name)
                } else {
                    self.nodes[i].run(probe).is_ok()
                };
                if done {
                    println!(
                        "  {}: first sync done after {:.1}s ({} exists)",
                        self.plan.nodes[i].name,
                        start.elapsed().as_secs_f64(),
                        match mode {
                            ProxyMode::Nftables => "table ip kube-proxy",
                            ProxyMode::Ebpf => "np_tc_ingress on eth0",
                            _ => "chain KUBE-SERVICES",
                        }
                    );
                    break;
                }
                if start.elapsed() > PROXY_SYNC_TIMEOUT {
                    let log = self.dir.log(&format!("proxy-{}", self.plan.nodes[i].name));
                    bail!(
                        "the proxy on {} programmed nothing in {}s; last lines of {}:\n{}",
                        self.plan.nodes[i].name,
                        PROXY_SYNC_TIMEOUT.as_secs(),
                        log.display(),
                        processes::tail(&log, 20)
                    );
                }
                interrupt.sleep(Duration::from_millis(100))?;
            }
        }
        Ok(())
    }

    /// Least privilege of the proxies: shows that `system:kube-proxy` may not create Services
    /// (`kubectl auth can-i`, answered by RBAC), and checks it with the proxies' own token.
    fn check_proxy_privilege(&self) -> anyhow::Result<()> {
        let args = [
            "auth",
            "can-i",
            "create",
            "services",
            "--as",
            "system:kube-proxy",
        ];
        let out = self
            .control_plane()
            .command("kubectl")
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .arg("--cache-dir")
            .arg(self.dir.join("kube-cache"))
            .args(args)
            .output()
            .context("kubectl auth can-i")?;
        // `can-i` exits 1 for "no".
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        println!("$ kubectl {}\n{answer}", args.join(" "));
        anyhow::ensure!(
            answer == "no",
            "system:kube-proxy may create Services (kubectl auth can-i said {answer:?}): the proxies do not run with least privilege"
        );
        let out = self
            .control_plane()
            .command("kubectl")
            .arg("--kubeconfig")
            .arg(self.dir.join("kube-proxy.kubeconfig"))
            .arg("--cache-dir")
            .arg(self.dir.join("kube-cache"))
            .args(["create", "service", "clusterip", "probe", "--tcp", "80"])
            .output()
            .context("kubectl create service with the proxies' token")?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(
            !out.status.success()
                && stderr.contains(
                    "services is forbidden: User \"system:kube-proxy\" cannot create resource \"services\""
                ),
            "the proxies' token could create a Service, or was refused for another reason: {stderr}"
        );
        Ok(())
    }

    /// `kubectl <args>` inside the control-plane namespace; returns stdout.
    fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        let kubeconfig = self.dir.join("kubeconfig");
        let cache = self.dir.join("kube-cache");
        let mut full = vec![
            "kubectl".to_owned(),
            "--kubeconfig".to_owned(),
            kubeconfig.display().to_string(),
            "--cache-dir".to_owned(),
            cache.display().to_string(),
        ];
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        self.control_plane()
            .run(&full)
            .with_context(|| format!("kubectl {}", args.join(" ")))
    }

    /// Prints `$ kubectl <args>` and its output, as the reference shows them.
    fn show(&self, args: &[&str]) -> anyhow::Result<()> {
        let out = self.kubectl(args)?;
        println!("$ kubectl {}\n{}", args.join(" "), out.trim_end());
        Ok(())
    }

    /// Writes `objects/<file>` and creates it with `kubectl create -f`, printing the command
    /// and kubectl's answer.
    fn create_objects(&self, file: &str, yaml: &str) -> anyhow::Result<()> {
        let path = self.dir.join("objects").join(file);
        std::fs::write(&path, yaml).with_context(|| format!("write {}", path.display()))?;
        self.show(&["create", "-f", &path.display().to_string()])
    }

    /// The node port the API server allocated for `web`.
    fn node_port(&self) -> anyhow::Result<u16> {
        let text = self.kubectl(&[
            "get",
            "svc",
            plan::APP,
            "-o",
            "jsonpath={.spec.ports[0].nodePort}",
        ])?;
        text.trim().parse().with_context(|| {
            format!(
                "the API server allocated no node port for service {} (got {text:?})",
                plan::APP
            )
        })
    }

    /// Asks every node IP on the NodePort from the client, retrying each until it answers or
    /// [`REACH_TIMEOUT`] has passed since the step began.
    fn reach_every_node(
        &mut self,
        mode: ProxyMode,
        node_port: u16,
        interrupt: &Interrupt,
    ) -> anyhow::Result<Verdict> {
        let deadline = Instant::now() + REACH_TIMEOUT;
        let mut results = Vec::new();
        let asked: Vec<(usize, IpAddr)> = (0..self.plan.nodes.len())
            .flat_map(|i| {
                dual_stack::node_ips(&self.plan.nodes[i], self.ip_family)
                    .into_iter()
                    .map(move |ip| (i, ip))
            })
            .collect();
        for (i, ip) in asked {
            let node = self.plan.nodes[i].clone();
            let to = SocketAddr::new(ip, node_port);
            let client = self.client.as_ref().expect("network is built");
            let reach = loop {
                interrupt.check()?;
                match probe::http_get(client, None, to, "/", ATTEMPT_TIMEOUT) {
                    Ok(answer)
                        if answer.status == 200
                            && !answer.pod.is_empty()
                            && answer.body.contains(WELCOME) =>
                    {
                        break Reach::Answered {
                            pod: answer.pod,
                            seen_client: answer.client,
                        };
                    }
                    Ok(answer) if Instant::now() >= deadline => {
                        break Reach::Failed {
                            why: format!(
                                "answered HTTP {} without a pod's welcome page (pod {:?})",
                                answer.status, answer.pod
                            ),
                        };
                    }
                    Err(err) if Instant::now() >= deadline => {
                        break Reach::Failed {
                            why: format!(
                                "{} (tried for {}s){}",
                                error_chain(&err),
                                REACH_TIMEOUT.as_secs(),
                                self.diagnose(mode, i, node_port)
                            ),
                        };
                    }
                    _ => interrupt.sleep(Duration::from_millis(250))?,
                }
            };
            match &reach {
                Reach::Answered { pod, seen_client } => {
                    let at = self
                        .plan
                        .pods
                        .iter()
                        .find(|p| &p.name == pod)
                        .map(|p| {
                            let pod_ip = match ip {
                                IpAddr::V4(_) => IpAddr::V4(p.ip),
                                IpAddr::V6(_) => IpAddr::V6(dual_stack::pod_ip6(p)),
                            };
                            format!(" ({pod_ip} on {})", self.plan.nodes[p.node].name)
                        })
                        .unwrap_or_default();
                    println!(
                        "  {} {to} -> \"{WELCOME}\" from pod {pod}{at}, which saw the client \
                         as {seen_client}",
                        node.name
                    );
                }
                Reach::Failed { why } => println!("  {} {to} -> no answer: {why}", node.name),
            }
            results.push(NodeResult {
                node: node.name.clone(),
                ip,
                reach,
            });
        }
        Ok(Verdict {
            node_port,
            nodes: results,
        })
    }

    /// What the lab can tell about a node that did not answer.
    fn diagnose(&mut self, mode: ProxyMode, node: usize, node_port: u16) -> String {
        let name = format!("proxy-{}", self.plan.nodes[node].name);
        let log = self.dir.log(&name);
        if !self.processes.is_running(&name) {
            return format!(
                "; its proxy is not running; last lines of {}:\n{}",
                log.display(),
                processes::tail(&log, 10)
            );
        }
        let ns = &self.nodes[node];
        let mut why = String::new();
        if mode == ProxyMode::Nftables {
            match ns.run(&["nft", "list", "table", "ip", "kube-proxy"]) {
                Err(_) => why.push_str("; the node has no `table ip kube-proxy`"),
                Ok(rules) if !rules.contains(&node_port.to_string()) => {
                    let _ = write!(why, "; `table ip kube-proxy` has no rule for {node_port}");
                }
                Ok(_) => {}
            }
        }
        let _ = write!(why, "; see {}", log.display());
        why
    }

    /// Prints the rules the proxy programmed on one node, as the reference lists them.
    fn show_rules(&self, mode: ProxyMode, node: usize, node_port: u16) {
        let ns = &self.nodes[node];
        let prompt = &self.plan.nodes[node].name;
        let print = |args: &[&str]| match ns.run(args) {
            Ok(out) => {
                println!("{prompt}$ {}\n{}", args.join(" "), out.trim_end());
                out
            }
            Err(err) => {
                println!(
                    "{prompt}$ {}\n  failed: {}",
                    args.join(" "),
                    error_chain(&err)
                );
                String::new()
            }
        };
        match mode {
            ProxyMode::Nftables => {
                print(&["nft", "list", "table", "ip", "kube-proxy"]);
                if self.ip_family == dual_stack::IpFamily::Dual {
                    print(&["nft", "list", "table", "ip6", "kube-proxy"]);
                }
            }
            ProxyMode::Ebpf => {
                print(&["bpftool", "net", "show", "dev", "eth0"]);
                let pins = self.dir.join("ebpf").join("pins").join(prompt);
                let map = pins.join("maps").join("np_services");
                print(&[
                    "bpftool",
                    "map",
                    "dump",
                    "pinned",
                    &map.display().to_string(),
                ]);
            }
            ProxyMode::Iptables | ProxyMode::Ipvs => {
                print(&["iptables", "-t", "nat", "-nvL", "PREROUTING"]);
                let nodeports = print(&["iptables", "-t", "nat", "-nvL", "KUBE-NODEPORTS"]);
                // Follow the chains the NodePort jumps to, then their endpoint chains.
                let mut seen = Vec::new();
                let mut queue: Vec<String> = chains_in(&nodeports, &node_port.to_string());
                while let Some(chain) = queue.pop() {
                    if seen.contains(&chain) {
                        continue;
                    }
                    let out = print(&["iptables", "-t", "nat", "-nvL", &chain]);
                    queue.extend(chains_in(&out, ""));
                    seen.push(chain);
                }
            }
        }
    }

    /// Leaves the lab running: namespaces and processes outlive this process; writes the
    /// helper scripts and prints how to use and remove the lab.
    fn keep(&mut self, node_port: u16) -> anyhow::Result<()> {
        self.kept = true;
        let mut namespaces: Vec<String> = std::mem::take(&mut self.pods)
            .into_iter()
            .map(Netns::persist)
            .collect();
        namespaces.extend(
            std::mem::take(&mut self.nodes)
                .into_iter()
                .map(Netns::persist),
        );
        namespaces.extend(self.client.take().map(Netns::persist));
        namespaces.extend(self.lan.take().map(|lan| lan.into_fabric().persist()));
        let pids = self.processes.detach();
        self.state.kept = true;
        self.state.namespaces = namespaces;
        self.dir.save(&self.state).context("write the lab state")?;
        let exe = std::env::current_exe().context("find the nodeport executable")?;
        let cp = self.plan.netns(&self.plan.control_plane().name);
        let kubectl = self.dir.join("kubectl");
        std::fs::write(
            &kubectl,
            format!(
                "#!/bin/sh\n# kubectl against lab {id}'s API server (run inside its control-plane \
                 namespace).\nexec ip netns exec {cp} kubectl --kubeconfig {kc} --cache-dir {cache} \"$@\"\n",
                id = self.plan.id,
                kc = self.dir.join("kubeconfig").display(),
                cache = self.dir.join("kube-cache").display(),
            ),
        )?;
        let down = self.dir.join("down.sh");
        let mut script = format!(
            "#!/bin/sh\n# Removes lab {id} without the nodeport binary: kills its processes, \
             deletes its namespaces (and so their links) and this directory.\n",
            id = self.plan.id
        );
        for ns in &self.state.namespaces {
            let _ = writeln!(
                script,
                "ip netns pids {ns} 2>/dev/null | xargs -r kill -9; ip netns del {ns} 2>/dev/null"
            );
        }
        let _ = writeln!(script, "rm -rf {}", self.dir.path().display());
        std::fs::write(&down, script)?;
        for file in [&kubectl, &down] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o755))?;
        }

        let id = &self.plan.id;
        println!("\nlab {id} is left running (--keep). As root:");
        println!("  enter a node, a pod or the client:");
        let mut entries: Vec<(String, String)> = self
            .plan
            .nodes
            .iter()
            .map(|n| {
                (
                    self.plan.netns(&n.name),
                    format!("node {} {}", n.name, n.ip),
                )
            })
            .collect();
        entries.extend(self.plan.pods.iter().map(|p| {
            let node = &self.plan.nodes[p.node].name;
            (self.plan.netns(&p.name), format!("pod {} on {node}", p.ip))
        }));
        entries.push((self.plan.netns("client"), format!("client {CLIENT_IP}")));
        let width = entries.iter().map(|(ns, _)| ns.len()).max().unwrap_or(0);
        for (ns, what) in entries {
            println!("    ip netns exec {ns:width$} bash    # {what}");
        }
        println!(
            "  kubectl (the API server is https://{}:{API_PORT}; kubeconfig with the admin token):",
            self.plan.control_plane().ip
        );
        println!("    {} get svc,ep", kubectl.display());
        println!(
            "    ip netns exec {cp} kubectl --kubeconfig {} get svc,ep",
            self.dir.join("kubeconfig").display()
        );
        println!("  curl a NodePort from the client:");
        println!(
            "    ip netns exec {} curl -s {}:{node_port}",
            self.plan.netns("client"),
            self.plan.nodes[1].ip,
        );
        let last = self.plan.nodes.last().expect("the lab has nodes");
        let rules = match ProxyMode::from_state(&self.state.proxy_mode) {
            ProxyMode::Nftables => "nft list table ip kube-proxy",
            ProxyMode::Iptables | ProxyMode::Ipvs => "iptables -t nat -nvL KUBE-NODEPORTS",
            ProxyMode::Ebpf => "bpftool net show dev eth0",
        };
        println!("  the rules of {}:", last.name);
        println!("    ip netns exec {} {rules}", self.plan.netns(&last.name));
        println!(
            "  logs: {}/   processes: {}",
            self.dir.join("logs").display(),
            pids.iter()
                .map(|(n, p)| format!("{n}={p}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        println!("  remove it: {} lab --down {id}", exe.display());
        println!("         or: sh {}", down.display());
        Ok(())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        self.processes.stop(STOP_GRACE);
        self.pods.clear();
        self.nodes.clear();
        self.client = None;
        self.lan = None;
        // Whatever was recorded but not (or no longer) guarded, and the directory.
        state::tear_down(&self.plan.id);
    }
}

fn os_args(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// An error and its causes on one line.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

/// The `KUBE-…` chains that lines of `iptables -nvL` output jump to, among lines containing
/// `filter` (all lines when empty).
fn chains_in(listing: &str, filter: &str) -> Vec<String> {
    listing
        .lines()
        .filter(|l| l.contains(filter))
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|target| {
            ["KUBE-SVC-", "KUBE-EXT-", "KUBE-SEP-", "KUBE-SVL-"]
                .iter()
                .any(|p| target.starts_with(p))
        })
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_listing_yields_the_service_and_endpoint_chains_it_jumps_to() {
        let listing = "Chain KUBE-NODEPORTS (1 references)\n pkts bytes target     prot opt in     out     source               destination\n    1    60 KUBE-EXT-LOLE4ISW44XBNF3G  tcp  --  *      *       0.0.0.0/0            0.0.0.0/0            /* default/web */ tcp dpt:30510\n    0     0 KUBE-SVC-AAAA  tcp  --  *      *       0.0.0.0/0            0.0.0.0/0            /* default/other */ tcp dpt:30999\n";
        assert_eq!(chains_in(listing, "30510"), ["KUBE-EXT-LOLE4ISW44XBNF3G"]);
        assert_eq!(chains_in(listing, "").len(), 2);
    }
}
