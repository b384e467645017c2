//! The etcd v3 backend: several API servers share one etcd and stay consistent through etcd's
//! transactions.
//!
//! ## Revisions: etcd revision × 1000 + sequence
//!
//! The writer commits a batch of requests (group commit) in **one** etcd transaction, and etcd
//! gives a transaction a single revision. If the resourceVersion were the etcd revision, every
//! object of a batch would carry the same one, and a watcher that saw only the first of those
//! events and resumed from its resourceVersion would skip the others. So a resourceVersion here is
//!
//! ```text
//! resourceVersion = etcd_revision × SEQUENCE_SCALE + position of the change in its transaction
//! ```
//!
//! which keeps resourceVersions integers, unique, and ordered as etcd orders the changes. The
//! position is known when the transaction is built (every delete in a batch removes a key the
//! writer compared as existing, so each operation is exactly one change and one watch event) and
//! is stored with the value, so a GET long after reads the same resourceVersion the watch event
//! had. The other directions map back: a watch from resourceVersion `v` starts at etcd revision
//! `v / 1000` and skips changes at or before `v`; a list (or a whole revision) is
//! `etcd_revision × 1000 + 999`, after every change of that revision; a compare on
//! `mod_revision` compares the etcd part. A transaction has fewer than [`SEQUENCE_SCALE`]
//! operations (etcd's own limit, `--max-txn-ops`, is 128 by default; see [`MAX_TXN_OPS`]).
//!
//! One request per transaction would avoid the scheme, but would cap each API server at one etcd
//! round trip (and fsync) per request; the benchmark in docs/BENCHMARKS.md shows what batching
//! buys.
//!
//! ## Values
//!
//! Keys are kube-apiserver's. Values are JSON, but not kube-apiserver's protobuf: each is
//! `{"seq":N,"value":<the object>}` with the position `N` described above. A value written by
//! hand without the envelope is read as the object itself at position 0.
//!
//! ## Watches
//!
//! An etcd watch covers the whole key prefix (so that positions count every change of a
//! transaction) and is filtered here to the prefix asked for. One such watch per API server (the
//! hub) serves every HTTP watch that starts within its recent history; older ones, and any while
//! the hub reconnects, get an etcd watch of their own.
//!
//! ## Taking turns
//!
//! Every write compares the two range keys, so API servers that write at once race for them,
//! and on a slow etcd the race is not fair. A transaction that arrives while etcd is writing
//! another one waits for the next round of consensus. So the server that won a round learns it
//! one round before the losers learn that they lost, and its next transaction, sent at once,
//! is queued ahead of their re-runs, again and again. In CI, a replica lost 64 rounds in a row
//! and answered 500; with etcd's fsync slowed to 10 ms it happens within a run (see
//! docs/BENCHMARKS.md, "Taking turns").
//!
//! So a server whose last [`MARK_AFTER`] commits failed says so: the failure branch of its next
//! transaction puts its id on the **turn mark**, `<--etcd-prefix>-writers/contention` (outside
//! the prefix, so no watch sees it; a deployment with `--etcd-prefix <P>-writers` on the same
//! etcd would collide with it, and an etcd role limited to `<P>/` would refuse every commit).
//! Every transaction's success branch reads the mark. A server that wins and finds a mark newer
//! than the last one it saw, put by another server, waits [`YIELD_ROUNDS`] of its own commit
//! times (at most [`YIELD_MAX`]) before its next commit, unless that commit comes [`YIELD_MAX`]
//! or more after the win, so that the losers' re-runs get a round without it. The mark decides nothing about correctness (no transaction compares it);
//! it only orders who goes next. The held time is inside the commit call, so the writer's commit
//! time (`nodeport_apiserver_storage_commit_seconds_total`) includes it.
//!
//! ## Failures
//!
//! Every call has a deadline ([`Config::request_timeout`]). An unreachable etcd gives
//! [`Error::Unavailable`] (503), one that does not answer in time [`Error::Timeout`] (504); the
//! gRPC channel reconnects by itself when etcd is back.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};

use super::{
    Backend, Batch, Commit, Error, Event, EventKind, Fetched, KeyValue, ListPage, ListRequest, Op,
    Revision, WatchItem, WatchStream,
};

/// How many resourceVersions one etcd revision spans (see the module docs).
pub const SEQUENCE_SCALE: i64 = 1000;

/// etcd's default `--max-txn-ops`: the most compares, and the most operations, in one
/// transaction. The writer keeps batches within it.
pub const MAX_TXN_OPS: usize = 128;

/// Failed commits in a row after which a server puts its mark (see "Taking turns" in the module
/// docs). A commit on a stale guess counts (see `store::Writer::known`), so the mark usually
/// goes up after a guess that failed and a re-run on the keys it gave back that failed too: one
/// lost race for the writer's own count, which leaves guesses out.
const MARK_AFTER: u32 = 2;
/// How many of its own last commit times a server that won waits before its next commit, after
/// it saw another server's new mark: one round for the round the losers' re-runs are queued in,
/// one for their travel.
const YIELD_ROUNDS: u32 = 2;
/// Longest such wait.
const YIELD_MAX: Duration = Duration::from_millis(50);

/// Keys read per etcd range request when listing.
const LIST_PAGE: usize = 1000;

/// Largest gRPC message accepted from etcd (a page of large objects, a big transaction).
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Settings of the etcd backend.
#[derive(Debug, Clone)]
pub struct Config {
    /// `--etcd-servers`: client URLs.
    pub endpoints: Vec<String>,
    /// Deadline of every etcd call. Default 5 s.
    pub request_timeout: Duration,
    /// Deadline of establishing a connection. Default 2 s.
    pub connect_timeout: Duration,
    /// `--etcd-compaction-interval`: how often etcd's history is compacted, to the revision of
    /// one interval before; zero leaves it to someone else. Default 5 minutes, kube-apiserver's:
    /// watches and continued lists can go back about that far, and etcd's database does not
    /// grow without end.
    pub compaction_interval: Duration,
}

impl Config {
    /// Settings for these endpoints with the default deadlines.
    pub fn new(endpoints: Vec<String>) -> Self {
        Config {
            endpoints,
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            compaction_interval: Duration::from_secs(300),
        }
    }
}

/// The etcd backend.
#[derive(Clone)]
pub struct EtcdBackend {
    client: Client,
    /// Everything this server stores is under this prefix (`<--etcd-prefix>/`).
    root: String,
    config: Arc<Config>,
    hub: Arc<Hub>,
    /// Whether etcd answers, from every call: one log line per outage, not one per request.
    outages: Arc<super::outage::Outages>,
    /// Taking turns with other API servers (see the module docs).
    turns: Arc<Turns>,
}

/// This server's side of taking turns (see "Taking turns" in the module docs).
struct Turns {
    /// The turn mark's key.
    key: String,
    /// What this server puts on the mark: an id no other server has.
    id: Vec<u8>,
    /// Commits lost in a row.
    lost: AtomicU32,
    /// The newest mod_revision of the mark this server has seen.
    seen: AtomicI64,
    /// A turn given to the losers: when this server won, and how long its next commit waits.
    turn: std::sync::Mutex<Option<(std::time::Instant, Duration)>>,
}

impl Turns {
    fn new(prefix: &str) -> Turns {
        Turns {
            key: format!("{prefix}-writers/contention"),
            id: format!("{:032x}", rand::random::<u128>()).into_bytes(),
            lost: Default::default(),
            seen: Default::default(),
            turn: Default::default(),
        }
    }

    /// After a won commit that took `took`, given the mark as the commit read it: whether
    /// another server has lost since this one last looked, and if so, the turn it gives.
    fn won(&self, mark: Option<&etcd_client::KeyValue>, took: Duration) {
        self.lost.store(0, Ordering::Relaxed);
        let Some(mark) = mark else { return };
        let newer =
            self.seen.fetch_max(mark.mod_revision(), Ordering::Relaxed) < mark.mod_revision();
        if newer && mark.value() != self.id.as_slice() {
            let wait = (took * YIELD_ROUNDS).min(YIELD_MAX);
            *self.turn.lock().expect("turns lock") = Some((std::time::Instant::now(), wait));
        }
    }

    /// Takes the turn given, if any: how long the next commit waits. A commit that starts
    /// [`YIELD_MAX`] or more after the win does not wait: the losers had their turn. The wait
    /// is counted from the next commit, not from the win: counted from the win, the longest
    /// losing streaks in the 10,000-create test were 20-37 per run instead of 4-17
    /// (docs/BENCHMARKS.md, "Taking turns").
    fn take_turn(&self) -> Option<Duration> {
        let (won_at, wait) = self.turn.lock().expect("turns lock").take()?;
        (won_at.elapsed() < YIELD_MAX).then_some(wait)
    }
}

/// Events the hub keeps for watchers that start a little in the past: at most this many, and
/// none older than [`HUB_RETENTION`].
const HUB_HISTORY: usize = 10_000;
/// How long the hub keeps an event: kube-apiserver's watch cache keeps 75 s of events
/// (`eventFreshDuration`). Bounded by count alone, the history grew with the write rate until
/// it held 10,000 events (seven minutes into the churn soak at 24 changes a second: the API
/// server's RSS +33 % after the first five minutes). A watch from further back gets its own
/// etcd watch, as it would without the hub.
const HUB_RETENTION: Duration = Duration::from_secs(75);
/// Committed transactions a hub subscriber may fall behind before it is closed.
const HUB_BUFFER: usize = 4096;

/// One etcd watch per API server, fanned out to every HTTP watch (kube-apiserver's watch
/// cache, reduced): subscribers share the events (and so their [`super::Memo`]: each change is
/// decoded and encoded once), and etcd serves one watch instead of one per client. A watch from
/// a revision older than the hub's history, or while the hub is reconnecting, gets its own etcd
/// watch instead.
#[derive(Default)]
struct Hub {
    state: std::sync::Mutex<HubState>,
}

impl Hub {
    /// Drops the history before `floor` (this server compacted etcd to it): a watch from an
    /// older revision then goes to etcd, which answers 410 Gone, as it would without the hub.
    fn forget_before(&self, floor: Revision) {
        let mut state = self.state.lock().expect("hub lock");
        if !state.running || floor <= state.oldest {
            return;
        }
        while state
            .log
            .front()
            .is_some_and(|(_, e)| e.kv.mod_revision <= floor)
        {
            state.log.pop_front();
        }
        state.oldest = floor;
    }
}

#[derive(Default)]
struct HubState {
    /// Whether the hub's etcd watch is running (and `log`, `oldest`, `progress` are valid).
    running: bool,
    /// Whether a task is (re)starting it.
    starting: bool,
    /// Recent changes, in order, with when the hub received them.
    log: std::collections::VecDeque<(std::time::Instant, Event)>,
    /// Every change after this resourceVersion is in `log`.
    oldest: Revision,
    /// Every change up to this resourceVersion has been received.
    progress: Revision,
    /// Committed transactions as they arrive; `None` when the hub's watch broke.
    sender: Option<tokio::sync::broadcast::Sender<Option<Arc<HubBatch>>>>,
}

/// What the hub received from etcd in one response.
struct HubBatch {
    events: Vec<Event>,
    progress: Revision,
}

/// The resourceVersion of a change at `position` in the transaction of etcd `revision`.
pub fn resource_version(revision: i64, position: i64) -> Revision {
    revision * SEQUENCE_SCALE + position
}

/// The resourceVersion after every change of etcd `revision`.
pub fn after_revision(revision: i64) -> Revision {
    revision * SEQUENCE_SCALE + SEQUENCE_SCALE - 1
}

/// The etcd revision a resourceVersion belongs to.
pub fn etcd_revision(resource_version: Revision) -> i64 {
    resource_version.div_euclid(SEQUENCE_SCALE)
}

const ENVELOPE_START: &[u8] = b"{\"seq\":";
const ENVELOPE_VALUE: &[u8] = b",\"value\":";

/// `{"seq":N,"value":<value>}`.
pub fn encode_value(position: i64, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() + 24);
    out.extend_from_slice(ENVELOPE_START);
    out.extend_from_slice(position.to_string().as_bytes());
    out.extend_from_slice(ENVELOPE_VALUE);
    out.extend_from_slice(value);
    out.push(b'}');
    out
}

/// The position and the object of a stored value (position 0 and the whole value if it has no
/// envelope).
pub fn decode_value(raw: &[u8]) -> (i64, &[u8]) {
    let Some(rest) = raw.strip_prefix(ENVELOPE_START) else {
        return (0, raw);
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let Some(value) = rest[digits..]
        .strip_prefix(ENVELOPE_VALUE)
        .and_then(|v| v.strip_suffix(b"}"))
    else {
        return (0, raw);
    };
    let position = std::str::from_utf8(&rest[..digits])
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
    (position, value)
}

fn key_value(kv: &etcd_client::KeyValue) -> Result<KeyValue, Error> {
    let key = std::str::from_utf8(kv.key())
        .map_err(|_| Error::Corrupt {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            reason: "the key is not UTF-8".into(),
        })?
        .to_owned();
    let (position, value) = decode_value(kv.value());
    let mod_revision = resource_version(kv.mod_revision(), position);
    Ok(KeyValue {
        key,
        value: Arc::from(value),
        create_revision: if kv.version() == 1 {
            mod_revision
        } else {
            resource_version(kv.create_revision(), 0)
        },
        mod_revision,
    })
}

/// The smallest key greater than every key starting with `prefix` (etcd's range end).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn etcd_error(
    operation: &'static str,
    requested: Option<Revision>,
    err: etcd_client::Error,
) -> Error {
    match &err {
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
                if !status.message().contains("compacted") =>
            {
                Error::Unavailable {
                    backend: "etcd",
                    message: format!("{operation}: {}", status.message()),
                }
            }
            tonic::Code::DeadlineExceeded => Error::Timeout {
                backend: "etcd",
                operation,
            },
            _ if status
                .message()
                .contains("required revision has been compacted") =>
            {
                Error::Compacted {
                    requested: requested.unwrap_or(0),
                    oldest: 0,
                }
            }
            _ if status
                .message()
                .contains("required revision is a future revision") =>
            {
                Error::FutureRevision {
                    requested: requested.unwrap_or(0),
                    current: 0,
                }
            }
            _ => Error::Backend {
                operation,
                source: Box::new(err),
            },
        },
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => {
            Error::Unavailable {
                backend: "etcd",
                message: format!("{operation}: {err}"),
            }
        }
        _ => Error::Backend {
            operation,
            source: Box::new(err),
        },
    }
}

impl EtcdBackend {
    /// A backend over the etcd cluster at `config.endpoints`, storing under `prefix`. Does not
    /// wait for etcd: a server may start while etcd is down and serve once it is up.
    pub async fn connect(config: Config, prefix: &str) -> Result<Self, Error> {
        let options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.request_timeout)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        let client = Client::connect(&config.endpoints, Some(options))
            .await
            .map_err(|e| etcd_error("connect", None, e))?;
        let backend = EtcdBackend {
            client,
            root: format!("{prefix}/"),
            config: Arc::new(config),
            hub: Arc::default(),
            outages: Arc::new(super::outage::Outages::new("etcd")),
            turns: Arc::new(Turns::new(prefix)),
        };
        if !backend.config.compaction_interval.is_zero() {
            let compactor = backend.clone();
            tokio::spawn(tracing::Instrument::instrument(
                async move { compactor.compact_periodically().await },
                tracing::info_span!("etcd_compactor"),
            ));
        }
        Ok(backend)
    }

    /// How long this server's next commit waits, having seen another server's turn mark (see
    /// "Taking turns" in the module docs); `None` if it does not.
    pub fn turn_given(&self) -> Option<Duration> {
        self.turns
            .turn
            .lock()
            .expect("turns lock")
            .map(|(_, wait)| wait)
    }

    /// The key of the turn mark (see "Taking turns" in the module docs).
    pub fn turn_mark_key(&self) -> &str {
        &self.turns.key
    }

    /// Every interval, compacts etcd to the revision it had one interval before (what
    /// kube-apiserver's compactor does). With several API servers each compacts; compacting to a
    /// revision already compacted is refused by etcd and ignored here.
    async fn compact_periodically(&self) {
        let interval = self.config.compaction_interval;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        let mut previous: Option<i64> = None;
        loop {
            ticker.tick().await;
            let current = match self.deadline("read", self.current_revision_now()).await {
                Ok(rv) => etcd_revision(rv),
                Err(err) => {
                    tracing::debug!(error = %err, "cannot read the revision to compact at");
                    continue;
                }
            };
            if let Some(revision) = previous.filter(|r| *r > 0) {
                let compacted = tokio::time::timeout(
                    self.config.request_timeout,
                    self.client.kv_client().compact(revision, None),
                )
                .await;
                match compacted {
                    Ok(Ok(_)) => {
                        tracing::info!(revision, "compacted etcd history");
                        self.hub.forget_before(resource_version(revision, 0));
                    }
                    Ok(Err(err)) if err.to_string().contains("compacted") => {}
                    Ok(Err(err)) => tracing::warn!(revision, error = %err, "compaction failed"),
                    Err(_) => tracing::warn!(revision, "compaction timed out"),
                }
            }
            previous = Some(current);
        }
    }

    async fn deadline<T>(
        &self,
        operation: &'static str,
        call: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let result = tokio::time::timeout(self.config.request_timeout, call)
            .await
            .unwrap_or(Err(Error::Timeout {
                backend: "etcd",
                operation,
            }));
        self.outages.record(operation, &result);
        result
    }

    /// Every key and value under the prefix (offline checks and tests).
    pub async fn dump(&self) -> Result<Vec<KeyValue>, Error> {
        let page = self
            .list(ListRequest {
                prefix: self.root.clone(),
                start: None,
                revision: None,
                limit: None,
            })
            .await?;
        Ok(page.kvs)
    }

    async fn get_many_now(&self, keys: Vec<String>, serializable: bool) -> Result<Fetched, Error> {
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let mut fetched = Fetched::default();
        let mut revision = None;
        for chunk in keys.chunks(MAX_TXN_OPS) {
            let mut options = GetOptions::new();
            if let Some(r) = revision {
                options = options.with_revision(r);
            }
            if serializable {
                options = options.with_serializable();
            }
            let options = Some(options);
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|k| TxnOp::get(k.as_bytes(), options.clone()))
                .collect();
            let response = kv
                .txn(Txn::new().and_then(ops))
                .await
                .map_err(|e| etcd_error("read", None, e))?;
            let header_revision = response.header().map_or(0, |h| h.revision());
            let revision = *revision.get_or_insert(header_revision);
            fetched.revision = after_revision(revision);
            for op in response.op_responses() {
                if let TxnOpResponse::Get(get) = op {
                    for kv in get.kvs() {
                        let kv = key_value(kv)?;
                        fetched.kvs.insert(kv.key.clone(), kv);
                    }
                }
            }
        }
        if keys.is_empty() {
            fetched.revision = self.current_revision_now().await?;
        }
        Ok(fetched)
    }

    async fn current_revision_now(&self) -> Result<Revision, Error> {
        let response = self
            .client
            .kv_client()
            .get(
                self.root.as_bytes(),
                Some(GetOptions::new().with_count_only()),
            )
            .await
            .map_err(|e| etcd_error("read", None, e))?;
        Ok(after_revision(
            response.header().map_or(0, |h| h.revision()),
        ))
    }

    async fn list_now(&self, request: ListRequest) -> Result<ListPage, Error> {
        // Read in pages of at most LIST_PAGE keys at one revision, so that no gRPC message grows
        // past the client's limit however many objects there are.
        let mut start = request
            .start
            .clone()
            .unwrap_or_else(|| request.prefix.clone());
        let end = prefix_end(&request.prefix);
        let mut revision = request.revision.map(etcd_revision);
        let mut kvs = Vec::new();
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        loop {
            let want = request
                .limit
                .map_or(LIST_PAGE, |l| (l - kvs.len()).min(LIST_PAGE));
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(want as i64);
            if let Some(r) = revision {
                options = options.with_revision(r);
            }
            let response = kv
                .get(start.as_bytes(), Some(options))
                .await
                .map_err(|e| etcd_error("list", request.revision, e))?;
            revision.get_or_insert(response.header().map_or(0, |h| h.revision()));
            for item in response.kvs() {
                kvs.push(key_value(item)?);
            }
            let remaining = (response.count().max(0) as usize).saturating_sub(response.kvs().len());
            let full = request.limit.is_some_and(|l| kvs.len() >= l);
            if remaining == 0 || full || response.kvs().is_empty() {
                return Ok(ListPage {
                    revision: request
                        .revision
                        .unwrap_or_else(|| after_revision(revision.unwrap_or(0))),
                    kvs,
                    remaining,
                });
            }
            start = format!("{}\u{0}", kvs.last().expect("not empty").key);
        }
    }

    async fn commit_now(&self, batch: Batch) -> Result<Commit, Error> {
        let compared: std::collections::HashMap<&str, Option<Revision>> = batch
            .compares
            .iter()
            .map(|c| (c.key.as_str(), c.mod_revision))
            .collect();
        let mut ops = Vec::new();
        let mut first_positions = Vec::with_capacity(batch.groups.len());
        let mut put_positions = Vec::new();
        for group in &batch.groups {
            let mut first = None;
            for op in group {
                match op {
                    Op::Put { key, value } => {
                        let position = ops.len() as i64;
                        first.get_or_insert(position);
                        put_positions.push((key.as_str(), position));
                        ops.push(TxnOp::put(
                            key.as_bytes(),
                            encode_value(position, value),
                            None,
                        ));
                    }
                    Op::Delete { key } => match compared.get(key.as_str()) {
                        // Compared as absent: the delete changes nothing and makes no event.
                        Some(None) => {}
                        Some(Some(_)) => {
                            first.get_or_insert(ops.len() as i64);
                            ops.push(TxnOp::delete(key.as_bytes(), None));
                        }
                        // A delete that may or may not change something would make the
                        // positions, and so the resourceVersions, ambiguous.
                        None => {
                            return Err(Error::InvalidBatch(format!(
                                "delete of {key} without a compare"
                            )));
                        }
                    },
                }
            }
            first_positions.push(first);
        }
        if ops.len() >= SEQUENCE_SCALE as usize {
            return Err(Error::InvalidBatch(format!(
                "{} writes in one transaction; at most {} fit a resourceVersion",
                ops.len(),
                SEQUENCE_SCALE - 1
            )));
        }
        let compares: Vec<Compare> = batch
            .compares
            .iter()
            .map(|c| match c.mod_revision {
                Some(rv) => {
                    Compare::mod_revision(c.key.as_bytes(), CompareOp::Equal, etcd_revision(rv))
                }
                None => Compare::version(c.key.as_bytes(), CompareOp::Equal, 0),
            })
            .collect();
        // Even a batch that writes nothing is sent with its compares: its answers (404,
        // AlreadyExists, ...) come from a serializable read, which must be confirmed current.
        let writes = !ops.is_empty();
        // A lost race reads every compared key in the same round trip (the failure branch), so
        // that the writer can re-run the batch on what is stored now without reading again.
        let mut reads: Vec<TxnOp> = batch
            .compares
            .iter()
            .map(|c| TxnOp::get(c.key.as_bytes(), None))
            .collect();
        // Taking turns (module docs): a winner reads the mark, a loser that keeps losing puts it.
        let turns = &self.turns;
        ops.push(TxnOp::get(turns.key.as_bytes(), None));
        if turns.lost.load(Ordering::Relaxed) >= MARK_AFTER {
            reads.push(TxnOp::put(turns.key.as_bytes(), turns.id.clone(), None));
        }
        if let Some(wait) = turns.take_turn() {
            tokio::time::sleep(wait).await;
        }
        let started = std::time::Instant::now();
        let response = self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .txn(Txn::new().when(compares).and_then(ops).or_else(reads))
            .await
            .map_err(|e| etcd_error("commit", None, e))?;
        if response.succeeded() {
            let mark = match response.op_responses().pop() {
                Some(TxnOpResponse::Get(get)) => get.kvs().first().cloned(),
                _ => None,
            };
            turns.won(mark.as_ref(), started.elapsed());
        } else {
            turns.lost.fetch_add(1, Ordering::Relaxed);
            let mut current = Fetched {
                revision: after_revision(response.header().map_or(0, |h| h.revision())),
                ..Fetched::default()
            };
            for op in response.op_responses() {
                if let TxnOpResponse::Get(get) = op {
                    for kv in get.kvs() {
                        let kv = key_value(kv)?;
                        current.kvs.insert(kv.key.clone(), kv);
                    }
                }
            }
            return Ok(Commit::Conflict(Some(current)));
        }
        if !writes {
            return Ok(Commit::Committed {
                revisions: vec![0; batch.groups.len()],
                revision: 0,
                put_revisions: std::collections::HashMap::new(),
            });
        }
        let revision = response.header().map_or(0, |h| h.revision());
        Ok(Commit::Committed {
            revisions: first_positions
                .into_iter()
                .map(|p| p.map_or(0, |p| resource_version(revision, p)))
                .collect(),
            revision: after_revision(revision),
            put_revisions: put_positions
                .into_iter()
                .map(|(key, p)| (key.to_owned(), resource_version(revision, p)))
                .collect(),
        })
    }

    async fn watch_now(&self, prefix: String, after: Revision) -> Result<WatchStream, Error> {
        // A whole revision already seen starts the watch at the next one.
        let start = if after.rem_euclid(SEQUENCE_SCALE) == SEQUENCE_SCALE - 1 {
            etcd_revision(after) + 1
        } else {
            etcd_revision(after)
        }
        .max(1);
        let options = WatchOptions::new()
            .with_range(prefix_end(&self.root))
            .with_start_revision(start)
            .with_prev_key()
            .with_progress_notify();
        let stream = self
            .client
            .watch_client()
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .watch(self.root.as_bytes(), Some(options))
            .await
            .map_err(|e| etcd_error("watch", Some(after), e))?;

        struct State {
            stream: etcd_client::WatchStream,
            pending: std::collections::VecDeque<Result<WatchItem, Error>>,
            prefix: String,
            after: Revision,
            done: bool,
        }
        let state = State {
            stream,
            pending: Default::default(),
            prefix,
            after,
            done: false,
        };
        let stream = futures::stream::unfold(state, |mut s| async move {
            loop {
                if let Some(item) = s.pending.pop_front() {
                    return Some((item, s));
                }
                if s.done {
                    return None;
                }
                let response = match s.stream.message().await {
                    Ok(Some(response)) => response,
                    Ok(None) => {
                        s.done = true;
                        s.pending.push_back(Err(Error::Unavailable {
                            backend: "etcd",
                            message: "the watch stream ended".into(),
                        }));
                        continue;
                    }
                    Err(err) => {
                        s.done = true;
                        s.pending
                            .push_back(Err(etcd_error("watch", Some(s.after), err)));
                        continue;
                    }
                };
                if response.compact_revision() > 0 {
                    s.done = true;
                    s.pending.push_back(Err(Error::Compacted {
                        requested: s.after,
                        oldest: after_revision(response.compact_revision() - 1),
                    }));
                    continue;
                }
                if response.canceled() {
                    s.done = true;
                    s.pending.push_back(Err(Error::Unavailable {
                        backend: "etcd",
                        message: format!("watch canceled: {}", response.cancel_reason()),
                    }));
                    continue;
                }
                let mut last_revision = None;
                let mut position = 0;
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    if last_revision != Some(kv.mod_revision()) {
                        last_revision = Some(kv.mod_revision());
                        position = 0;
                    }
                    // A put's position is in its value; a delete's is counted (each operation of
                    // a transaction is one event, in order).
                    let counted = resource_version(kv.mod_revision(), position);
                    position += 1;
                    let rv = match event.event_type() {
                        EventType::Put => {
                            resource_version(kv.mod_revision(), decode_value(kv.value()).0)
                        }
                        EventType::Delete => counted,
                    };
                    if rv <= s.after || !kv.key().starts_with(s.prefix.as_bytes()) {
                        continue;
                    }
                    let prev = match event.prev_kv().map(key_value).transpose() {
                        Ok(prev) => prev,
                        Err(err) => {
                            s.pending.push_back(Err(err));
                            continue;
                        }
                    };
                    let item = match event.event_type() {
                        EventType::Put => {
                            key_value(kv).map(|current| Event::new(EventKind::Put, current, prev))
                        }
                        EventType::Delete => {
                            let key = String::from_utf8_lossy(kv.key()).into_owned();
                            let gone = match &prev {
                                Some(prev) => KeyValue {
                                    mod_revision: rv,
                                    ..prev.clone()
                                },
                                None => KeyValue {
                                    key,
                                    value: Arc::from(&b""[..]),
                                    create_revision: 0,
                                    mod_revision: rv,
                                },
                            };
                            Ok(Event::new(EventKind::Delete, gone, prev))
                        }
                    };
                    s.pending.push_back(item.map(WatchItem::Event));
                }
                // Events of one revision arrive together, so every revision up to the last one
                // here, or up to the header's for a progress notification, is complete.
                let complete = last_revision
                    .or_else(|| response.header().map(|h| h.revision()))
                    .map(after_revision);
                if let Some(rv) = complete.filter(|rv| *rv > s.after) {
                    s.pending.push_back(Ok(WatchItem::Progress(rv)));
                }
            }
        });
        Ok(stream.boxed())
    }
}

impl EtcdBackend {
    /// A watch served by the hub, if the hub runs and still holds every change after `after`;
    /// starts the hub if it does not run.
    fn subscribe(&self, prefix: &str, after: Revision) -> Option<WatchStream> {
        let mut state = self.hub.state.lock().expect("hub lock");
        if !state.running {
            if !state.starting {
                state.starting = true;
                let this = self.clone();
                tokio::spawn(tracing::Instrument::instrument(
                    async move { this.run_hub().await },
                    tracing::info_span!("etcd_watch_hub"),
                ));
            }
            return None;
        }
        if after < state.oldest {
            return None;
        }
        let mut pending: std::collections::VecDeque<Result<WatchItem, Error>> = state
            .log
            .iter()
            .filter(|(_, e)| e.kv.mod_revision > after && e.kv.key.starts_with(prefix))
            .map(|(_, e)| Ok(WatchItem::Event(e.clone())))
            .collect();
        pending.push_back(Ok(WatchItem::Progress(state.progress.max(after))));
        // Subscribed under the lock that publishing holds: each later change arrives exactly
        // once, either in `pending` or on the channel.
        let receiver = state.sender.as_ref()?.subscribe();
        drop(state);

        struct Subscriber {
            pending: std::collections::VecDeque<Result<WatchItem, Error>>,
            receiver: tokio::sync::broadcast::Receiver<Option<Arc<HubBatch>>>,
            prefix: String,
            after: Revision,
            done: bool,
        }
        let subscriber = Subscriber {
            pending,
            receiver,
            prefix: prefix.to_owned(),
            after,
            done: false,
        };
        let stream = futures::stream::unfold(subscriber, |mut s| async move {
            loop {
                if let Some(item) = s.pending.pop_front() {
                    return Some((item, s));
                }
                if s.done {
                    return None;
                }
                match s.receiver.recv().await {
                    Ok(Some(batch)) => {
                        for event in &batch.events {
                            if event.kv.mod_revision > s.after
                                && event.kv.key.starts_with(&s.prefix)
                            {
                                s.pending.push_back(Ok(WatchItem::Event(event.clone())));
                            }
                        }
                        if batch.progress > s.after {
                            s.pending.push_back(Ok(WatchItem::Progress(batch.progress)));
                        }
                    }
                    Ok(None) | Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        s.done = true;
                        s.pending.push_back(Err(Error::Unavailable {
                            backend: "etcd",
                            message: "the watch of etcd broke; watch again".into(),
                        }));
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                        s.done = true;
                        s.pending.push_back(Err(Error::WatcherLagged { missed }));
                    }
                }
            }
        });
        Some(stream.boxed())
    }

    /// The hub's task: one etcd watch over the whole prefix, from the current revision, its
    /// changes kept in a bounded log and sent to every subscriber. Ends when the etcd watch
    /// breaks; the next watch request starts it again.
    async fn run_hub(&self) {
        let started = async {
            let from = self.deadline("read", self.current_revision_now()).await?;
            let stream = self
                .deadline("watch", self.watch_now(self.root.clone(), from))
                .await?;
            Ok::<_, Error>((from, stream))
        }
        .await;
        let (from, mut stream) = match started {
            Ok(started) => started,
            Err(err) => {
                tracing::debug!(error = %err, "cannot start the shared etcd watch");
                self.hub.state.lock().expect("hub lock").starting = false;
                return;
            }
        };
        {
            let mut state = self.hub.state.lock().expect("hub lock");
            let (sender, _) = tokio::sync::broadcast::channel(HUB_BUFFER);
            *state = HubState {
                running: true,
                starting: false,
                log: Default::default(),
                oldest: from,
                progress: from,
                sender: Some(sender),
            };
        }
        let mut events = Vec::new();
        loop {
            match stream.next().await {
                Some(Ok(WatchItem::Event(event))) => events.push(event),
                Some(Ok(WatchItem::Progress(progress))) => {
                    let mut state = self.hub.state.lock().expect("hub lock");
                    state.progress = progress;
                    let now = std::time::Instant::now();
                    for event in &events {
                        state.log.push_back((now, event.clone()));
                    }
                    while state.log.len() > HUB_HISTORY
                        || state
                            .log
                            .front()
                            .is_some_and(|(at, _)| now.duration_since(*at) > HUB_RETENTION)
                    {
                        let (_, dropped) = state.log.pop_front().expect("not empty");
                        state.oldest = dropped.kv.mod_revision;
                    }
                    if let Some(sender) = &state.sender {
                        let _ = sender.send(Some(Arc::new(HubBatch {
                            events: std::mem::take(&mut events),
                            progress,
                        })));
                    }
                }
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "the shared etcd watch broke");
                    break;
                }
                None => break,
            }
        }
        let mut state = self.hub.state.lock().expect("hub lock");
        if let Some(sender) = state.sender.take() {
            let _ = sender.send(None);
        }
        *state = HubState::default();
    }
}

impl Backend for EtcdBackend {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn reads_on_conflict(&self) -> bool {
        true
    }

    fn max_batch_keys(&self) -> usize {
        // The writer adds the range keys (four on a dual-stack server) to the declared keys,
        // and each branch of the transaction has one operation on the turn mark.
        MAX_TXN_OPS - 5
    }

    fn current_revision(&self) -> BoxFuture<'_, Result<Revision, Error>> {
        self.deadline("read", self.current_revision_now()).boxed()
    }

    fn get_many(&self, keys: Vec<String>) -> BoxFuture<'_, Result<Fetched, Error>> {
        self.deadline("read", self.get_many_now(keys, false))
            .boxed()
    }

    /// A serializable read: served by the etcd member itself, without a round of consensus.
    /// It may be a little behind a linearizable one (on a member that lags); the commit's
    /// compares then fail and the batch is read again, so only speed depends on it.
    fn get_many_for_write(&self, keys: Vec<String>) -> BoxFuture<'_, Result<Fetched, Error>> {
        self.deadline("read", self.get_many_now(keys, true)).boxed()
    }

    fn list(&self, request: ListRequest) -> BoxFuture<'_, Result<ListPage, Error>> {
        self.deadline("list", self.list_now(request)).boxed()
    }

    fn commit(&self, batch: Batch) -> BoxFuture<'_, Result<Commit, Error>> {
        self.deadline("commit", self.commit_now(batch)).boxed()
    }

    fn watch(&self, prefix: String, after: Revision) -> BoxFuture<'_, Result<WatchStream, Error>> {
        async move {
            if let Some(stream) = self.subscribe(&prefix, after) {
                return Ok(stream);
            }
            self.deadline("watch", self.watch_now(prefix, after)).await
        }
        .boxed()
    }

    fn check(&self) -> BoxFuture<'_, Result<(), Error>> {
        async move {
            let result = tokio::time::timeout(
                Duration::from_secs(2).min(self.config.request_timeout),
                self.current_revision_now(),
            )
            .await
            .unwrap_or(Err(Error::Timeout {
                backend: "etcd",
                operation: "health check",
            }))
            .map(|_| ());
            self.outages.record("health check", &result);
            result
        }
        .boxed()
    }

    fn outages(&self) -> Option<super::outage::OutageStats> {
        Some(self.outages.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_carry_their_position_in_a_json_envelope() {
        let raw = encode_value(17, br#"{"kind":"Service"}"#);
        assert_eq!(raw, br#"{"seq":17,"value":{"kind":"Service"}}"#);
        assert_eq!(decode_value(&raw), (17, &br#"{"kind":"Service"}"#[..]));
        // A value written by hand without the envelope is the object at position 0.
        assert_eq!(decode_value(b"{\"a\":1}"), (0, &b"{\"a\":1}"[..]));
    }

    #[test]
    fn resource_versions_order_changes_within_and_across_revisions() {
        assert!(resource_version(5, 0) < resource_version(5, 3));
        assert!(resource_version(5, 3) < after_revision(5));
        assert!(after_revision(5) < resource_version(6, 0));
        assert_eq!(etcd_revision(resource_version(5, 3)), 5);
        assert_eq!(etcd_revision(after_revision(5)), 5);
    }

    #[test]
    fn a_turn_given_makes_the_next_commit_wait_unless_it_comes_long_after_the_win() {
        let turns = Turns::new("/registry");
        assert_eq!(turns.take_turn(), None);
        let wait = Duration::from_secs(3600);
        *turns.turn.lock().unwrap() = Some((std::time::Instant::now(), wait));
        assert_eq!(turns.take_turn(), Some(wait));
        assert_eq!(turns.take_turn(), None, "a turn is given once");
        let won_at = std::time::Instant::now() - YIELD_MAX;
        *turns.turn.lock().unwrap() = Some((won_at, Duration::from_millis(10)));
        assert_eq!(turns.take_turn(), None, "the quiet spell was the turn");
    }

    #[test]
    fn prefix_end_is_the_next_key_after_the_prefix() {
        assert_eq!(prefix_end("/registry/"), b"/registry0".to_vec());
    }
}
