//! Node proxy: what kube-proxy does, in Rust.
//!
//! The pipeline runs one way, from objects to kernel rules:
//!
//! 1. [`watch`] runs kube-rs watchers on Services, EndpointSlices and this node's Node and
//!    converts each object at once into the compact [`model`] ([`convert`]).
//! 2. [`tracker::ChangeTracker`]s keep the latest value per object and what changed since
//!    the last sync, dropping changes that cancel out.
//! 3. [`desired`] computes, purely, every service port's categorized endpoints per family,
//!    the NodePort addresses ([`nodeaddr`]) and the service CIDRs.
//! 4. A backend renders that state (purely) and applies it in one transaction:
//!    [`nftables`] (the default), [`iptables`], or [`ipvs`] (rendered only: deprecated
//!    upstream), one folder per backend with the same files (`names`, `render`, `ruleset`,
//!    `apply`, `tracer`); [`backend`] is what the agent sees of them. Hashed names shared by
//!    every backend live in [`names`]; the tracers' shared vocabulary (packet, fate,
//!    the explanation `nodeport trace` prints) in [`trace`].
//! 5. [`agent`] rate-limits syncs, retries failures and runs periodic resyncs;
//!    [`health`] and [`metrics`] report on it; [`conntrack`] cleans UDP flows whose endpoint
//!    went away.

pub mod addrs;
pub mod agent;
pub mod backend;
pub mod config;
pub mod conntrack;
pub mod convert;
pub mod desired;
pub mod ebpf;
pub mod events;
pub mod fuzzing;
pub mod health;
pub mod iptables;
pub mod ipvs;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod names;
pub mod nftables;
pub mod nodeaddr;
pub mod objects;
pub mod tool;
pub mod trace;
pub mod tracker;
pub mod watch;

/// Re-exported so the binary parses CIDRs with the same type.
pub use ipnet;

/// Re-exported so the binary builds its client with the same kube-rs.
pub use kube;

/// This host's name, lower-cased, as kube-proxy uses it when `--hostname-override` is unset.
pub fn nix_hostname() -> std::io::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    Ok(name.trim().to_lowercase())
}
