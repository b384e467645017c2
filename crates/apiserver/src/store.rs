//! The single writer: every mutation of the API runs here, serially, and commits in batches.
//!
//! Why one writer: the NodePort and ClusterIP bitmaps are two hot keys that every Service write
//! reads and changes. With optimistic compare-and-swap from many concurrent requests, nearly all
//! of them would lose the race and retry. Instead each request hands a closure (see [`Store::mutate`])
//! to one writer task, which
//!
//! 1. takes every mutation that is queued (up to [`MAX_BATCH`], and within the backend's limit of
//!    keys per transaction), waiting briefly for the clients it has just answered to come back
//!    (at most 1 ms, see `LINGER_MAX`),
//! 2. reads the keys they declared, plus both range keys, at one revision; on etcd, where a read
//!    is a network round trip, it skips the read and takes the keys as it last saw them (from its
//!    own commits, its reads and the keys a lost commit gives back, absent if it never saw them),
//!    which is as safe because step 4 compares every one of them at the revision taken, and costs
//!    one failed commit (no more than the read) when another writer changed one meanwhile,
//! 3. runs the mutations one after the other against a view ([`Txn`]) that holds the decoded
//!    allocators (kept between batches while the stored bitmaps are the bytes they were encoded
//!    into, so the bitmaps are decoded only when another writer changed them); a mutation that
//!    declared a key an earlier one in the batch wrote, or writes such a key again, is deferred to
//!    the next batch, so that it reads real revisions and no key is written twice in one
//!    transaction,
//! 4. commits the writes of all of them, and the bitmaps that changed, in **one** backend
//!    transaction whose compares are the `mod_revision`s of every key read, and the absence of
//!    every key a mutation created (a ClusterIP's IPAddress object, see [`Txn::create`]). On the
//!    embedded backend that is one redb write transaction and one fsync for the whole batch
//!    (group commit).
//!    On a lost race (only possible when several API servers share etcd) the batch, with whatever
//!    queued meanwhile, is re-run on the keys the failed commit gave back (at once the first
//!    time, after a random pause later).
//!
//! A mutation that fails leaves nothing behind: its writes and its allocator changes are made on a
//! working copy that is dropped. So a rejected request, a lost race or a crash (nothing is
//! acknowledged before the commit is durable) never leaks or doubles a port or an IP.

use std::any::Any;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine;
use nodeport_alloc::{PortRange, Snapshot, ip, port};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::cidr_ranges::{ExtraRanges, View};
use crate::error::ApiError;
use crate::storage::{self, Backend, Batch, Commit, Compare, Fetched, KeyValue, Op, Revision};

/// Most mutations committed in one batch.
pub const MAX_BATCH: usize = 256;
/// Longest a batch waits for the requests of clients that were just answered (see
/// [`Writer::run`]); a quarter of the last commit's time if that is shorter. Group commit's
/// "sync delay": without it, with 8 clients the batches alternate between the clients answered by
/// one commit and those that queued during it, about 4 requests each instead of 8.
const LINGER_MAX: std::time::Duration = std::time::Duration::from_micros(1000);
/// How often a batch is re-run after losing a race before the requests fail. The first re-run
/// goes at once; before each later one the writer sleeps a random time up to 1, 2, 4, ... 32 ms,
/// so that API servers racing for the bitmaps stop colliding in lockstep; 64 attempts wait about
/// 1 s on average, under 2 s at most.
const MAX_CONFLICT_RETRIES: u32 = 64;
/// Most keys the writer remembers as stored (see `Writer::known`); past that it forgets all but
/// the range keys.
const KNOWN_MAX: usize = 4096;

/// The NodePort and ClusterIP allocators as one batch (or one mutation) sees them.
#[derive(Debug, Clone)]
pub struct Allocators {
    /// NodePorts (`--service-node-port-range`).
    pub ports: port::Allocator,
    /// ClusterIPs of the primary range (`--service-cluster-ip-range`, its first CIDR).
    pub ips: ip::Allocator,
    /// ClusterIPs of the secondary range (the second CIDR of a dual-stack
    /// `--service-cluster-ip-range`), stored under `<prefix>/ranges/secondaryserviceips` as
    /// kube-apiserver stores it.
    pub secondary_ips: Option<ip::Allocator>,
    /// The ServiceCIDRs added through the API and the addresses allocated from them, stored
    /// under `<prefix>/ranges/servicecidrs` (see [`crate::cidr_ranges`]).
    pub extra: ExtraRanges,
}

impl Allocators {
    /// ClusterIP allocation over every range: the flag's and the added ServiceCIDRs.
    pub fn cluster_ips(&mut self) -> View<'_> {
        View {
            primary: &mut self.ips,
            secondary: self.secondary_ips.as_mut(),
            extra: &mut self.extra,
        }
    }

    /// The allocator of `ip`'s family, if this cluster serves that family.
    pub fn ips_for(&mut self, ip: std::net::IpAddr) -> Option<&mut ip::Allocator> {
        self.family(ip.is_ipv6())
    }

    /// The allocator of IPv6 (`ipv6`) or IPv4 ClusterIPs, if this cluster serves that family.
    pub fn family(&mut self, ipv6: bool) -> Option<&mut ip::Allocator> {
        if self.ips.cidr().addr().is_ipv6() == ipv6 {
            return Some(&mut self.ips);
        }
        self.secondary_ips
            .as_mut()
            .filter(|a| a.cidr().addr().is_ipv6() == ipv6)
    }

    /// Gives `ip` back to the allocator of its family; an address of a family this cluster
    /// does not serve (the flag changed) is ignored, as kube-apiserver's `releaseIPs` does.
    pub fn release_ip(&mut self, ip: std::net::IpAddr) {
        self.cluster_ips().release(ip);
    }
}

/// The ranges the allocators cover.
#[derive(Debug, Clone)]
pub struct Ranges {
    /// `--service-node-port-range`.
    pub node_ports: PortRange,
    /// `--service-cluster-ip-range`, its first (primary) CIDR.
    pub cluster_ips: ipnet::IpNet,
    /// The second CIDR of a dual-stack `--service-cluster-ip-range` (the other family).
    pub secondary_cluster_ips: Option<ipnet::IpNet>,
}

impl Ranges {
    /// Empty allocators over these ranges.
    pub fn empty(&self) -> Result<Allocators, ApiError> {
        Ok(Allocators {
            ports: port::Allocator::new(self.node_ports),
            ips: ip::Allocator::new(self.cluster_ips).map_err(ApiError::internal)?,
            secondary_ips: self
                .secondary_cluster_ips
                .map(ip::Allocator::new)
                .transpose()
                .map_err(ApiError::internal)?,
            extra: ExtraRanges::default(),
        })
    }
}

/// Kubernetes' `RangeAllocation`, the stored form of a bitmap.
#[derive(Debug, Serialize, Deserialize)]
struct RangeAllocation {
    kind: String,
    #[serde(rename = "apiVersion")]
    api_version: String,
    metadata: serde_json::Value,
    range: String,
    /// Base64, as Go's `[]byte` in JSON.
    data: String,
}

/// Encodes a bitmap snapshot as a `RangeAllocation` JSON document.
pub fn encode_range(snapshot: &Snapshot) -> Arc<[u8]> {
    let doc = RangeAllocation {
        kind: "RangeAllocation".into(),
        api_version: "v1".into(),
        metadata: serde_json::json!({"creationTimestamp": null}),
        range: snapshot.range.clone(),
        data: base64::engine::general_purpose::STANDARD.encode(&snapshot.data),
    };
    serde_json::to_vec(&doc).expect("range serializes").into()
}

/// Decodes a stored `RangeAllocation`.
pub fn decode_range(value: &[u8]) -> Result<Snapshot, String> {
    let doc: RangeAllocation =
        serde_json::from_slice(value).map_err(|e| format!("not a RangeAllocation: {e}"))?;
    let data = base64::engine::general_purpose::STANDARD
        .decode(doc.data.as_bytes())
        .map_err(|e| format!("bad bitmap: {e}"))?;
    Ok(Snapshot {
        range: doc.range,
        data,
    })
}

/// A key as a mutation sees it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The value.
    pub value: Arc<[u8]>,
    /// Its `mod_revision`, or 0 if an earlier mutation of the same batch wrote it.
    pub mod_revision: Revision,
}

/// The view a mutation runs against: the keys it declared, the writes of the mutations before it
/// in the batch, and the allocators.
pub struct Txn<'a> {
    base: &'a HashMap<String, KeyValue>,
    batch_writes: &'a HashMap<String, Option<Arc<[u8]>>>,
    batch_allocators: &'a Option<Allocators>,
    writes: Vec<Op>,
    /// Keys written with [`Txn::create`]: the commit requires them absent.
    created: Vec<String>,
    allocators: Option<Allocators>,
    allocators_replaced: bool,
    dry_run: bool,
}

impl Txn<'_> {
    /// Reads a key. The key must be one the mutation declared.
    pub fn get(&self, key: &str) -> Option<Entry> {
        if let Some(op) = self.writes.iter().rev().find(|op| op.key() == key) {
            return match op {
                Op::Put { value, .. } => Some(Entry {
                    value: value.clone(),
                    mod_revision: 0,
                }),
                Op::Delete { .. } => None,
            };
        }
        if let Some(write) = self.batch_writes.get(key) {
            return write.as_ref().map(|value| Entry {
                value: value.clone(),
                mod_revision: 0,
            });
        }
        self.base.get(key).map(|kv| Entry {
            value: kv.value.clone(),
            mod_revision: kv.mod_revision,
        })
    }

    /// Writes a key.
    pub fn put(&mut self, key: String, value: Arc<[u8]>) {
        self.writes.push(Op::Put { key, value });
    }

    /// Creates a key that must not exist: the commit compares it as absent even when the
    /// mutation did not declare it, so a key someone else created meanwhile fails the commit
    /// instead of being overwritten. ClusterIPs are allocated so, by creating their IPAddress
    /// objects (kube 1.33's allocator creates the object named by the address and fails if it
    /// exists); see [`Writer::taken_ips`] for what a failed one teaches the writer.
    pub fn create(&mut self, key: String, value: Arc<[u8]>) {
        self.created.push(key.clone());
        self.writes.push(Op::Put { key, value });
    }

    /// Deletes a key.
    pub fn delete(&mut self, key: String) {
        self.writes.push(Op::Delete { key });
    }

    /// The allocators, as changed by this mutation so far. Changes are kept only if the mutation
    /// succeeds and is not a dry run.
    pub fn allocators(&mut self) -> Result<&mut Allocators, ApiError> {
        if self.allocators.is_none() {
            let current = self.batch_allocators.as_ref().ok_or_else(|| {
                ApiError::internal(
                    "cannot allocate resources of type servicenodeportallocations at this time",
                )
            })?;
            self.allocators = Some(current.clone());
        }
        Ok(self.allocators.as_mut().expect("set above"))
    }

    /// Replaces the allocators (bootstrap and repair only).
    pub fn replace_allocators(&mut self, allocators: Allocators) {
        self.allocators = Some(allocators);
        self.allocators_replaced = true;
    }

    /// Whether the stored bitmaps exist yet.
    pub fn allocators_initialized(&self) -> bool {
        self.batch_allocators.is_some()
    }

    /// Marks the mutation a dry run: it runs to the end, but nothing it wrote or allocated is kept.
    pub fn set_dry_run(&mut self) {
        self.dry_run = true;
    }
}

type BoxedMutation =
    Box<dyn FnMut(&mut Txn<'_>) -> Result<Box<dyn Any + Send>, ApiError> + Send + 'static>;

struct Job {
    keys: Vec<String>,
    run: BoxedMutation,
    reply: oneshot::Sender<Result<Done<Box<dyn Any + Send>>, ApiError>>,
}

/// The result of a committed mutation.
#[derive(Debug)]
pub struct Done<T> {
    /// What the mutation returned.
    pub value: T,
    /// The revision its writes were committed at; `None` if it wrote nothing.
    pub revision: Option<Revision>,
}

/// Counters of the writer, for `/metrics` and the benchmarks.
#[derive(Debug, Default)]
pub struct Stats {
    /// Transactions tried: each attempt of a batch, lost races included.
    pub batches: AtomicU64,
    /// Mutations run in committed batches.
    pub mutations: AtomicU64,
    /// Commits that lost a race with another writer and were re-run.
    pub conflicts: AtomicU64,
    /// The most lost races one batch has counted in a row (a gauge; the batch fails at
    /// `MAX_CONFLICT_RETRIES`).
    pub most_lost_in_a_row: AtomicU64,
    /// Write requests answered 500 because their batch lost too many races in a row.
    pub gave_up: AtomicU64,
    /// Time spent in backend commits, in nanoseconds.
    pub commit_nanos: AtomicU64,
    /// Time the writer spent reading the keys of its batches, in nanoseconds.
    pub read_nanos: AtomicU64,
    /// Rounds of the allocation verification loop.
    pub verifications: AtomicU64,
    /// Differences the last verification found (a gauge).
    pub differences: AtomicU64,
    /// Leaked ports and addresses the verification loop freed.
    pub leaks_repaired: AtomicU64,
}

/// Handle to the writer task and the backend. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    jobs: mpsc::Sender<Job>,
    prefix: Arc<str>,
    stats: Arc<Stats>,
}

impl Store {
    /// Starts the writer task over `backend`.
    pub fn start(backend: Arc<dyn Backend>, prefix: &str, ranges: Ranges) -> Self {
        let (jobs, rx) = mpsc::channel(4 * MAX_BATCH);
        let stats = Arc::new(Stats::default());
        let writer = Writer {
            stats: stats.clone(),
            backend: backend.clone(),
            node_port_key: storage::keys::node_port_range(prefix),
            ip_key: storage::keys::service_ip_range(prefix),
            secondary_ip_key: ranges
                .secondary_cluster_ips
                .map(|_| storage::keys::secondary_service_ip_range(prefix)),
            extra_key: storage::keys::service_cidr_ranges(prefix),
            ranges,
            cache: None,
            speculate: backend.reads_on_conflict(),
            known: HashMap::new(),
            ip_address_dir: crate::resource::Kind::IpAddress.key(prefix, None, ""),
            taken_ips: BTreeSet::new(),
        };
        tokio::spawn(
            writer
                .run(rx)
                .instrument(tracing::info_span!("writer", backend = backend.name())),
        );
        Store {
            backend,
            jobs,
            prefix: prefix.into(),
            stats,
        }
    }

    /// The writer's counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The backend, for reads and watches.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The key prefix (`--etcd-prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Runs `f` in the writer against the declared `keys` and commits what it wrote.
    ///
    /// `f` may run more than once (when a batch loses a race with another API server), so it must
    /// not have side effects outside the [`Txn`].
    pub async fn mutate<T, F>(&self, keys: Vec<String>, mut f: F) -> Result<Done<T>, ApiError>
    where
        T: Send + 'static,
        F: FnMut(&mut Txn<'_>) -> Result<T, ApiError> + Send + 'static,
    {
        // Every caller keeps to the limit (large deletes are one request per object); a request
        // over it could never commit on etcd, so it is refused before it reaches the writer.
        let limit = self.backend.max_batch_keys();
        if keys.len() > limit {
            return Err(ApiError::internal(format!(
                "one write may touch at most {limit} keys on {}; this one touches {}",
                self.backend.name(),
                keys.len()
            )));
        }
        let (reply, rx) = oneshot::channel();
        let job = Job {
            keys,
            run: Box::new(move |txn| f(txn).map(|v| Box::new(v) as Box<dyn Any + Send>)),
            reply,
        };
        self.jobs
            .send(job)
            .await
            .map_err(|_| ApiError::unavailable("the storage writer has stopped"))?;
        let done = rx
            .await
            .map_err(|_| ApiError::unavailable("the storage writer has stopped"))??;
        Ok(Done {
            value: *done.value.downcast::<T>().expect("mutation output type"),
            revision: done.revision,
        })
    }
}

struct Writer {
    stats: Arc<Stats>,
    backend: Arc<dyn Backend>,
    node_port_key: String,
    ip_key: String,
    /// The secondary ClusterIP bitmap's key, on a dual-stack server.
    secondary_ip_key: Option<String>,
    /// The key of the added ServiceCIDRs' allocations (absent until one is created).
    extra_key: String,
    ranges: Ranges,
    /// The allocators decoded from (or encoded into) the stored bitmaps.
    cache: Option<CachedAllocators>,
    /// Whether batches are committed without reading their keys first (see `known`): on a
    /// backend that gives the compared keys back when a commit loses (etcd), where a read is a
    /// network round trip.
    speculate: bool,
    /// Keys as this writer last saw them stored, with their revisions: from its reads, from the
    /// failure branch of its lost commits and from its own commits. A key not in the map is taken
    /// as absent. A batch may be run on these instead of on a fresh read because its commit
    /// compares every key it ran on at the revision taken here (absent: version 0); when another
    /// writer changed one meanwhile, the commit fails, gives the keys back as they are now, and
    /// the batch is re-run on those.
    known: HashMap<String, KeyValue>,
    /// `<prefix>/ipaddresses/`: where the IPAddress objects are.
    ip_address_dir: String,
    /// Addresses whose IPAddress objects a lost commit found existing while the bitmaps had
    /// them free (objects written past this server's allocator); marked in the bitmaps by the
    /// next batch, which stores them.
    taken_ips: BTreeSet<std::net::IpAddr>,
}

/// Decoded allocators and the stored bitmaps they equal.
struct CachedAllocators {
    np: Arc<[u8]>,
    ip: Arc<[u8]>,
    secondary_ip: Option<Arc<[u8]>>,
    extra: Option<Arc<[u8]>>,
    allocs: Allocators,
}

fn same_bytes(a: &Arc<[u8]>, b: &Arc<[u8]>) -> bool {
    Arc::ptr_eq(a, b) || a[..] == b[..]
}

/// The jobs of one batch, declaring at most the backend's limit of keys between them.
struct Collected {
    jobs: Vec<Job>,
    keys: std::collections::HashSet<String>,
}

impl Collected {
    fn from_jobs(jobs: Vec<Job>) -> Self {
        Collected {
            keys: jobs.iter().flat_map(|j| j.keys.iter().cloned()).collect(),
            jobs,
        }
    }

    fn new(first: Job) -> Self {
        Collected {
            keys: first.keys.iter().cloned().collect(),
            jobs: vec![first],
        }
    }

    /// Adds `job`, or gives it back if its keys would take the batch over `max_keys`.
    fn admit(&mut self, job: Job, max_keys: usize) -> Result<(), Job> {
        let new = job.keys.iter().filter(|k| !self.keys.contains(*k)).count();
        if self.keys.len() + new > max_keys {
            return Err(job);
        }
        self.keys.extend(job.keys.iter().cloned());
        self.jobs.push(job);
        Ok(())
    }
}

struct Outcome {
    /// `None` if the job was deferred to the next batch.
    result: Option<Result<Box<dyn Any + Send>, ApiError>>,
    group: usize,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        // How many requests were in the system when the last batch committed: the ones in it
        // plus the ones already queued behind it. Their clients come back about one round trip
        // after their reply, so a batch that starts with fewer than that waits for them, briefly.
        let mut concurrency = 1;
        let mut last_commit = LINGER_MAX;
        let max_keys = self.backend.max_batch_keys();
        // A job that did not fit the last batch starts the next one.
        let mut carry: Option<Job> = None;
        loop {
            let first = match carry.take() {
                Some(job) => job,
                None => match rx.recv().await {
                    Some(job) => job,
                    None => return,
                },
            };
            let mut batch = Collected::new(first);
            let linger_until = tokio::time::Instant::now() + (last_commit / 4).min(LINGER_MAX);
            'collect: loop {
                while batch.jobs.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(job) => {
                            if let Err(job) = batch.admit(job, max_keys) {
                                carry = Some(job);
                                break 'collect;
                            }
                        }
                        Err(_) => break,
                    }
                }
                if batch.jobs.len() >= concurrency.min(MAX_BATCH) {
                    break;
                }
                match tokio::time::timeout_at(linger_until, rx.recv()).await {
                    Ok(Some(job)) => {
                        if let Err(job) = batch.admit(job, max_keys) {
                            carry = Some(job);
                            break;
                        }
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            let size = batch.jobs.len();
            let started = std::time::Instant::now();
            self.run_batch(batch.jobs, &mut rx, &mut carry, max_keys)
                .await;
            last_commit = started.elapsed();
            concurrency = size + rx.len() + usize::from(carry.is_some());
        }
    }

    /// Runs `jobs` to the end: commits them, in as many batches as it takes (see
    /// [`Writer::try_batch`] for why a job may be deferred to the next one).
    async fn run_batch(
        &mut self,
        mut jobs: Vec<Job>,
        rx: &mut mpsc::Receiver<Job>,
        carry: &mut Option<Job>,
        max_keys: usize,
    ) {
        while !jobs.is_empty() {
            jobs = self.run_once(jobs, rx, carry, max_keys).await;
        }
    }

    /// Commits one batch, re-running it after a lost race; answers every job in it and returns
    /// the deferred ones.
    async fn run_once(
        &mut self,
        mut jobs: Vec<Job>,
        rx: &mut mpsc::Receiver<Job>,
        carry: &mut Option<Job>,
        max_keys: usize,
    ) -> Vec<Job> {
        // Lost races, counted only for attempts run on what was stored a moment before (a fresh
        // read, or the keys a lost commit just gave back): an attempt run on what this writer
        // remembered from earlier can fail only because that was stale, which costs what the read
        // it replaces would have.
        let mut lost = 0;
        // Whether `known` holds what the store held a moment ago.
        let mut fresh = false;
        while lost < MAX_CONFLICT_RETRIES {
            let speculate = self.speculate
                && self.known.contains_key(&self.node_port_key)
                && self.known.contains_key(&self.ip_key)
                && self
                    .secondary_ip_key
                    .as_ref()
                    .is_none_or(|k| self.known.contains_key(k));
            let ran_on_fresh = fresh || !speculate;
            match self.try_batch(&mut jobs, speculate).await {
                Ok(Some((outcomes, revisions))) => {
                    let mut deferred = Vec::new();
                    for (job, outcome) in jobs.into_iter().zip(outcomes) {
                        let Some(result) = outcome.result else {
                            deferred.push(job);
                            continue;
                        };
                        let result = result.map(|value| Done {
                            value,
                            revision: revisions.get(outcome.group).copied().filter(|r| *r != 0),
                        });
                        let _ = job.reply.send(result);
                    }
                    return deferred;
                }
                Ok(None) => {
                    tracing::debug!(jobs = jobs.len(), "batch lost a race; re-running it");
                    // What the lost commit gave back is current.
                    fresh = self.speculate;
                    if ran_on_fresh {
                        lost += 1;
                        self.stats
                            .most_lost_in_a_row
                            .fetch_max(u64::from(lost), Ordering::Relaxed);
                        // The first re-run goes at once: the winner's commit is done, and it is
                        // gathering its next batch. Later ones back off, at random, so that
                        // writers do not collide in lockstep.
                        if lost > 1 {
                            let ceiling = 1u64 << (lost - 2).min(5);
                            let pause = rand::random_range(0..ceiling * 1000);
                            tokio::time::sleep(std::time::Duration::from_micros(pause)).await;
                            fresh = false;
                        }
                    }
                    // Whatever queued meanwhile joins the re-run: one commit for all of it.
                    if carry.is_none() {
                        let mut batch = Collected::from_jobs(std::mem::take(&mut jobs));
                        while batch.jobs.len() < MAX_BATCH {
                            let Ok(job) = rx.try_recv() else { break };
                            if let Err(job) = batch.admit(job, max_keys) {
                                *carry = Some(job);
                                break;
                            }
                        }
                        jobs = batch.jobs;
                    }
                }
                Err(err) => {
                    if matches!(
                        err,
                        storage::Error::Unavailable { .. } | storage::Error::Timeout { .. }
                    ) {
                        // Logged once per outage by the backend.
                        tracing::debug!(error = %crate::report(&err), "commit failed");
                    } else {
                        tracing::error!(error = %crate::report(&err), "commit failed");
                    }
                    let api = ApiError::from(err);
                    for job in jobs {
                        let _ = job.reply.send(Err(api.clone()));
                    }
                    self.cache = None;
                    self.known.clear();
                    return Vec::new();
                }
            }
        }
        tracing::warn!(
            requests = jobs.len(),
            lost_races = lost,
            "a batch lost every race for the range keys; its requests fail"
        );
        self.stats
            .gave_up
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        for job in jobs {
            let _ = job.reply.send(Err(ApiError::internal(
                "storage kept changing under the write; giving up after retries",
            )));
        }
        Vec::new()
    }

    /// Runs the batch once: on a fresh read of its keys, or, if `speculate`, on what the writer
    /// knows of them (see [`Writer::known`]). `Ok(None)` when the commit lost a race.
    async fn try_batch(
        &mut self,
        jobs: &mut [Job],
        speculate: bool,
    ) -> Result<Option<(Vec<Outcome>, Vec<Revision>)>, storage::Error> {
        let mut keys: BTreeSet<String> = jobs.iter().flat_map(|j| j.keys.iter().cloned()).collect();
        keys.insert(self.node_port_key.clone());
        keys.insert(self.ip_key.clone());
        if let Some(key) = &self.secondary_ip_key {
            keys.insert(key.clone());
        }
        keys.insert(self.extra_key.clone());
        let keys: Vec<String> = keys.into_iter().collect();
        let fetched = if speculate {
            Fetched {
                revision: 0,
                kvs: keys
                    .iter()
                    .filter_map(|k| self.known.get(k).map(|kv| (k.clone(), kv.clone())))
                    .collect(),
            }
        } else {
            let read_started = std::time::Instant::now();
            let fetched = self.backend.get_many_for_write(keys.clone()).await;
            self.stats
                .read_nanos
                .fetch_add(read_started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let fetched = fetched?;
            if self.speculate {
                self.remember(&keys, &fetched);
            }
            fetched
        };
        let compares: Vec<Compare> = keys
            .iter()
            .map(|key| Compare {
                key: key.clone(),
                mod_revision: fetched.kvs.get(key).map(|kv| kv.mod_revision),
            })
            .collect();

        let mut allocators = self.load_allocators(&fetched.kvs);
        let base_allocators = allocators.clone();
        let mut allocators_dirty = false;
        // The bitmaps are a cache of the IPAddress objects: an address a lost commit found
        // taken by an object is marked before the jobs run, and the bitmap goes with the batch.
        let marked = match allocators.as_mut() {
            Some(allocs) if !self.taken_ips.is_empty() => {
                for ip in &self.taken_ips {
                    allocators_dirty |= allocs.cluster_ips().allocate(*ip).is_ok();
                }
                true
            }
            _ => false,
        };
        let mut creates: Vec<String> = Vec::new();
        let mut batch_writes: HashMap<String, Option<Arc<[u8]>>> = HashMap::new();
        let mut groups: Vec<Vec<Op>> = Vec::with_capacity(jobs.len());
        let mut outcomes = Vec::with_capacity(jobs.len());
        // Keys written by the jobs so far. A job that reads one of them, or writes one again, waits
        // for the next batch: it then reads the key with its real mod_revision, and no key is
        // written twice in one transaction (etcd refuses that).
        let mut written: std::collections::HashSet<String> = std::collections::HashSet::new();
        let mut writes_in_batch = 0usize;
        let write_budget = self.backend.max_batch_keys();
        // The keys the commit compares: the range keys, those of the jobs that are not
        // deferred, and the keys they create (see `Txn::create`); within the backend's limit,
        // which counts the range keys apart.
        let range_keys = [
            Some(&self.node_port_key),
            Some(&self.ip_key),
            self.secondary_ip_key.as_ref(),
            Some(&self.extra_key),
        ];
        let mut compared: std::collections::HashSet<String> =
            range_keys.iter().flatten().map(|k| (*k).clone()).collect();
        let compare_budget = write_budget.saturating_add(compared.len());
        let mut included_any = false;
        for job in jobs.iter_mut() {
            let group = groups.len();
            if job.keys.iter().any(|k| written.contains(k)) {
                groups.push(Vec::new());
                outcomes.push(Outcome {
                    result: None,
                    group,
                });
                continue;
            }
            let mut txn = Txn {
                base: &fetched.kvs,
                batch_writes: &batch_writes,
                batch_allocators: &allocators,
                writes: Vec::new(),
                created: Vec::new(),
                allocators: None,
                allocators_replaced: false,
                dry_run: false,
            };
            let result = (job.run)(&mut txn);
            let Txn {
                writes,
                created,
                allocators: working,
                allocators_replaced,
                dry_run,
                ..
            } = txn;
            // A job may write keys it did not declare (a Service's IPAddress objects): the
            // batch's writes stay within the backend's limit too (etcd's --max-txn-ops), the
            // job that would pass it waits for the next batch.
            let over_budget = result.is_ok()
                && !dry_run
                && writes_in_batch > 0
                && writes_in_batch + writes.len() > write_budget;
            // Every job that is not deferred has its keys compared, a failed or dry one too.
            let new_keys = job.keys.iter().filter(|k| !compared.contains(*k)).count();
            let new_creates = if result.is_ok() && !dry_run {
                created.len()
            } else {
                0
            };
            let over_compares = included_any
                && compared.len() + new_keys + creates.len() + new_creates > compare_budget;
            if over_budget
                || over_compares
                || (result.is_ok()
                    && !dry_run
                    && writes.iter().any(|op| written.contains(op.key())))
            {
                groups.push(Vec::new());
                outcomes.push(Outcome {
                    result: None,
                    group,
                });
                continue;
            }
            included_any = true;
            compared.extend(job.keys.iter().cloned());
            if result.is_ok() && !dry_run {
                creates.extend(created);
                writes_in_batch += writes.len();
                written.extend(writes.iter().map(|op| op.key().to_owned()));
                for op in &writes {
                    match op {
                        Op::Put { key, value } => {
                            batch_writes.insert(key.clone(), Some(value.clone()));
                        }
                        Op::Delete { key } => {
                            batch_writes.insert(key.clone(), None);
                        }
                    }
                }
                if let Some(working) = working {
                    // Bootstrap replaces the allocators; every other mutation changed a clone.
                    let _ = allocators_replaced;
                    allocators_dirty = true;
                    allocators = Some(working);
                }
                groups.push(writes);
            } else {
                groups.push(Vec::new());
            }
            outcomes.push(Outcome {
                result: Some(result),
                group,
            });
        }

        // The stored bitmaps after the batch: only a bitmap that changed is encoded and written.
        let mut stored_ranges = (
            fetched
                .kvs
                .get(&self.node_port_key)
                .map(|kv| kv.value.clone()),
            fetched.kvs.get(&self.ip_key).map(|kv| kv.value.clone()),
        );
        let mut stored_secondary = self
            .secondary_ip_key
            .as_ref()
            .and_then(|key| fetched.kvs.get(key))
            .map(|kv| kv.value.clone());
        let mut stored_extra = fetched.kvs.get(&self.extra_key).map(|kv| kv.value.clone());
        if allocators_dirty && let Some(allocs) = &allocators {
            let mut ops = Vec::new();
            let ports = allocs.ports.snapshot();
            if base_allocators
                .as_ref()
                .map(|b| b.ports.snapshot())
                .as_ref()
                != Some(&ports)
            {
                let value = encode_range(&ports);
                stored_ranges.0 = Some(value.clone());
                ops.push(Op::Put {
                    key: self.node_port_key.clone(),
                    value,
                });
            }
            let ips = allocs.ips.snapshot();
            if base_allocators.as_ref().map(|b| b.ips.snapshot()).as_ref() != Some(&ips) {
                let value = encode_range(&ips);
                stored_ranges.1 = Some(value.clone());
                ops.push(Op::Put {
                    key: self.ip_key.clone(),
                    value,
                });
            }
            if base_allocators.as_ref().map(|b| &b.extra) != Some(&allocs.extra) {
                let value = allocs.extra.encode();
                stored_extra = Some(value.clone());
                ops.push(Op::Put {
                    key: self.extra_key.clone(),
                    value,
                });
            }
            if let (Some(key), Some(secondary)) = (&self.secondary_ip_key, &allocs.secondary_ips) {
                let snapshot = secondary.snapshot();
                let before = base_allocators
                    .as_ref()
                    .and_then(|b| b.secondary_ips.as_ref())
                    .map(|a| a.snapshot());
                if before.as_ref() != Some(&snapshot) {
                    let value = encode_range(&snapshot);
                    stored_secondary = Some(value.clone());
                    ops.push(Op::Put {
                        key: key.clone(),
                        value,
                    });
                }
            }
            if !ops.is_empty() {
                // The bitmaps go with the last request that wrote anything (they are not
                // watched).
                let target = groups
                    .iter()
                    .rposition(|g| !g.is_empty())
                    .unwrap_or_else(|| {
                        groups.push(Vec::new());
                        groups.len() - 1
                    });
                groups[target].extend(ops);
            }
        }

        // The deferred jobs' keys are not compared (they wrote nothing; they run again); keys
        // created without being declared must still be absent at the commit.
        let mut compares = compares;
        compares.retain(|c| compared.contains(&c.key));
        for key in &creates {
            if !compared.contains(key) {
                compares.push(Compare {
                    key: key.clone(),
                    mod_revision: None,
                });
            }
        }
        let compared_keys: Vec<String> = compares.iter().map(|c| c.key.clone()).collect();
        let started = std::time::Instant::now();
        let batch = Batch { compares, groups };
        let committed = self.backend.commit(batch.clone()).await;
        self.stats
            .commit_nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        match committed? {
            Commit::Conflict(current) => {
                self.stats.conflicts.fetch_add(1, Ordering::Relaxed);
                self.learn_taken(&creates, current.as_ref()).await;
                if self.speculate {
                    match current {
                        // The failed commit read back exactly the keys it compared.
                        Some(current) => self.remember(&compared_keys, &current),
                        None => self.known.clear(),
                    }
                }
                Ok(None)
            }
            Commit::Committed {
                revisions,
                put_revisions,
                ..
            } => {
                if self.speculate {
                    self.remember_writes(&batch.groups, &put_revisions);
                }
                if marked {
                    // Written into the stored bitmap with this batch.
                    self.taken_ips.clear();
                }
                if let (Some(allocs), (Some(np), Some(ip))) = (allocators, stored_ranges) {
                    self.cache = Some(CachedAllocators {
                        np,
                        ip,
                        secondary_ip: stored_secondary,
                        extra: stored_extra,
                        allocs,
                    });
                }
                self.stats
                    .mutations
                    .fetch_add(outcomes.len() as u64, Ordering::Relaxed);
                Ok(Some((outcomes, revisions)))
            }
        }
    }

    /// After a lost commit: the keys the batch created that exist now are IPAddress objects
    /// someone else wrote (the truth of allocation), so their addresses are taken whatever the
    /// bitmap said; the re-run marks them (see [`Writer::taken_ips`]). `current` is what the
    /// failed commit gave back, if the backend gives anything back.
    async fn learn_taken(&mut self, creates: &[String], current: Option<&Fetched>) {
        if creates.is_empty() {
            return;
        }
        let read;
        let current = match current {
            Some(current) => current,
            None => match self.backend.get_many(creates.to_vec()).await {
                Ok(fetched) => {
                    read = fetched;
                    &read
                }
                Err(_) => return,
            },
        };
        for key in creates.iter().filter(|k| current.kvs.contains_key(*k)) {
            if let Some(ip) = key
                .strip_prefix(self.ip_address_dir.as_str())
                .and_then(|name| name.parse::<std::net::IpAddr>().ok())
                && self.taken_ips.insert(ip)
            {
                tracing::warn!(%ip, "an IPAddress object holds an address the allocation bitmap had free; marking it taken");
            }
        }
    }

    /// Takes `keys` as `fetched` has them (absent if not in it).
    fn remember(&mut self, keys: &[String], fetched: &Fetched) {
        for key in keys {
            match fetched.kvs.get(key) {
                Some(kv) => {
                    self.known.insert(key.clone(), kv.clone());
                }
                None => {
                    self.known.remove(key);
                }
            }
        }
        self.bound_known();
    }

    /// Takes the writes of a committed batch as stored, at the revisions the commit gave them.
    fn remember_writes(&mut self, groups: &[Vec<Op>], put_revisions: &HashMap<String, Revision>) {
        for op in groups.iter().flatten() {
            match op {
                Op::Put { key, value } => match put_revisions.get(key) {
                    Some(&mod_revision) => {
                        let create_revision = self
                            .known
                            .get(key)
                            .map_or(mod_revision, |kv| kv.create_revision);
                        self.known.insert(
                            key.clone(),
                            KeyValue {
                                key: key.clone(),
                                value: value.clone(),
                                create_revision,
                                mod_revision,
                            },
                        );
                    }
                    None => {
                        self.known.remove(key);
                    }
                },
                Op::Delete { key } => {
                    self.known.remove(key);
                }
            }
        }
        self.bound_known();
    }

    fn bound_known(&mut self) {
        if self.known.len() > KNOWN_MAX {
            let (np, ip) = (&self.node_port_key, &self.ip_key);
            let secondary = self.secondary_ip_key.as_deref();
            let extra = self.extra_key.as_str();
            self.known.retain(|key, _| {
                key == np || key == ip || key == extra || Some(key.as_str()) == secondary
            });
        }
    }

    /// The allocators for the fetched range keys: the cached ones if the stored bitmaps are the
    /// very bytes they were encoded into (a pointer comparison when the value came back from
    /// this writer's own commit, a memcmp of a few KiB otherwise), decoded ones if not.
    fn load_allocators(&mut self, kvs: &HashMap<String, KeyValue>) -> Option<Allocators> {
        let np = kvs.get(&self.node_port_key);
        let ip = kvs.get(&self.ip_key);
        let (np, ip) = (np?, ip?);
        // On a dual-stack server the allocators exist once all three bitmaps do.
        let secondary = match &self.secondary_ip_key {
            Some(key) => Some(kvs.get(key)?),
            None => None,
        };
        let extra = kvs.get(&self.extra_key);
        let same = |a: &Option<Arc<[u8]>>, b: Option<&KeyValue>| match (a, b) {
            (Some(a), Some(b)) => same_bytes(a, &b.value),
            (None, None) => true,
            _ => false,
        };
        if let Some(cached) = &self.cache
            && same_bytes(&cached.np, &np.value)
            && same_bytes(&cached.ip, &ip.value)
            && same(&cached.secondary_ip, secondary)
            && same(&cached.extra, extra)
        {
            return Some(cached.allocs.clone());
        }
        match self.decode_allocators(np, ip, secondary, extra) {
            Ok(allocs) => {
                self.cache = Some(CachedAllocators {
                    np: np.value.clone(),
                    ip: ip.value.clone(),
                    secondary_ip: secondary.map(|kv| kv.value.clone()),
                    extra: extra.map(|kv| kv.value.clone()),
                    allocs: allocs.clone(),
                });
                Some(allocs)
            }
            Err(err) => {
                tracing::error!(error = %err, "stored allocation bitmaps cannot be loaded");
                None
            }
        }
    }

    fn decode_allocators(
        &self,
        np: &KeyValue,
        ip: &KeyValue,
        secondary: Option<&KeyValue>,
        extra: Option<&KeyValue>,
    ) -> Result<Allocators, String> {
        let mut allocs = self.ranges.empty().map_err(|e| e.to_string())?;
        let snap = decode_range(&np.value)?;
        allocs
            .ports
            .restore(&snap.range, &snap.data)
            .map_err(|e| format!("{}: {e}", np.key))?;
        let snap = decode_range(&ip.value)?;
        allocs
            .ips
            .restore(&snap.range, &snap.data)
            .map_err(|e| format!("{}: {e}", ip.key))?;
        if let (Some(kv), Some(allocator)) = (secondary, allocs.secondary_ips.as_mut()) {
            let snap = decode_range(&kv.value)?;
            allocator
                .restore(&snap.range, &snap.data)
                .map_err(|e| format!("{}: {e}", kv.key))?;
        }
        if let Some(kv) = extra {
            allocs.extra =
                ExtraRanges::decode(&kv.value).map_err(|e| format!("{}: {e}", kv.key))?;
        }
        Ok(allocs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::redb::{Config, RedbBackend};

    fn store() -> Store {
        let backend = Arc::new(RedbBackend::in_memory(Config::default()).unwrap());
        Store::start(
            backend,
            "/registry",
            Ranges {
                node_ports: PortRange::default(),
                cluster_ips: "10.96.0.0/16".parse().unwrap(),
                secondary_cluster_ips: None,
            },
        )
    }

    /// Reads `/k` as a number, writes it plus one; returns the mod_revision it read.
    async fn increment(store: &Store) -> (Option<Revision>, Revision) {
        let done = store
            .mutate(vec!["/k".to_owned()], |txn| {
                let entry = txn.get("/k");
                let n: u64 = entry.as_ref().map_or(0, |e| {
                    std::str::from_utf8(&e.value).unwrap().parse().unwrap()
                });
                txn.put("/k".to_owned(), Arc::from((n + 1).to_string().as_bytes()));
                Ok(entry.map(|e| e.mod_revision))
            })
            .await
            .unwrap();
        (done.value, done.revision.unwrap())
    }

    #[tokio::test]
    async fn requests_on_one_key_queued_together_commit_one_after_the_other_with_real_revisions() {
        let store = store();
        // Both are queued before the writer runs, so they arrive in one batch; the second reads
        // what the first wrote, at its committed revision (not the in-batch placeholder 0).
        let (first, second) = tokio::join!(increment(&store), increment(&store));
        let (read_by_first, first_revision) = first;
        let (read_by_second, second_revision) = second;
        assert_eq!(read_by_first, None);
        assert_eq!(read_by_second, Some(first_revision));
        assert!(second_revision > first_revision);
        let fetched = store.backend().get_many(vec!["/k".into()]).await.unwrap();
        assert_eq!(&fetched.kvs["/k"].value[..], b"2");
        assert_eq!(store.stats().batches.load(Ordering::Relaxed), 2);
    }
}
