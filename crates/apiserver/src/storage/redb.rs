//! The embedded backend: one redb file, an in-memory copy for reads, and an in-memory event log.
//!
//! The redb file is the durable copy: every [`Backend::commit`] is one redb write transaction
//! committed with [`redb::Durability::Immediate`] (one fsync), so a batch is on disk before any
//! request in it is acknowledged. Reads never touch the file: the whole keyspace is kept in memory
//! as a persistent ordered map (`imbl::OrdMap`, cheap to clone), which also gives consistent
//! snapshots for continued lists. Watches are served from a bounded in-memory log of recent events,
//! like kube-apiserver's watch cache; a revision older than the log gives [`Error::Compacted`].
//!
//! Record layout in the `kv` table: `create_revision` (i64 LE), `mod_revision` (i64 LE), value.
//! The store revision is kept in the `meta` table under `revision`, written in the same transaction.
//!
//! A failed write (a full disk, an I/O error) fails its batch and leaves the in-memory copy as it
//! was, so reads and watches carry on. redb then refuses every later write ("Previous I/O error
//! occurred. Please close and re-open the database"), so the file is closed at once and opened
//! again by the next commit: once space is freed, writes resume without a restart. The reopened
//! file is checked against the acknowledged revision (see [`RedbBackend::reopen`]).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use imbl::OrdMap;
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::broadcast;

pub mod fault;

use super::{
    Backend, Batch, Commit, Error, Event, EventKind, Fetched, KeyValue, ListPage, ListRequest, Op,
    Revision, WatchItem, WatchStream,
};

const KV: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("kv");
const META: TableDefinition<'_, &str, i64> = TableDefinition::new("meta");
const REVISION: &str = "revision";
/// How many continued-list snapshots are kept (kube-apiserver relies on etcd keeping history for
/// 5 minutes; we keep the snapshots of the most recent paginated lists instead).
const PINNED_SNAPSHOTS: usize = 64;

/// Settings of the embedded backend.
#[derive(Debug, Clone)]
pub struct Config {
    /// How many recent events the watch log keeps. A watch from a revision older than the log
    /// gets `410 Gone`. Default 100,000: at about 200 bytes of bookkeeping per event (values are
    /// shared with the keyspace) this is a few tens of MiB at most, and covers minutes of the
    /// heaviest write load measured (see docs/BENCHMARKS.md).
    pub event_history: usize,
    /// How many published batches a watcher may fall behind before it is closed. Default 4096.
    pub watcher_buffer: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            event_history: 100_000,
            watcher_buffer: 4096,
        }
    }
}

/// The embedded redb backend.
#[derive(Clone)]
pub struct RedbBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// The open database, or `None` from a failed write until the next commit opens it again.
    /// Held for the whole of a commit, which serialises commits (redb allows one write
    /// transaction at a time anyway).
    db: Mutex<Option<redb::Database>>,
    /// How to open the file again; `None` for a store in memory, which has nothing to reopen.
    opener: Option<Opener>,
    state: RwLock<State>,
    events: broadcast::Sender<Arc<Published>>,
}

/// Opens the database file: at start, and again after a failed write.
type Opener = Box<dyn Fn() -> Result<redb::Database, Error> + Send + Sync>;

struct State {
    revision: Revision,
    map: OrdMap<String, KeyValue>,
    log: VecDeque<Event>,
    /// Events with a revision greater than this are all in `log`.
    oldest: Revision,
    capacity: usize,
    pinned: VecDeque<(Revision, OrdMap<String, KeyValue>)>,
}

/// One committed batch as watchers receive it.
struct Published {
    events: Vec<Event>,
    revision: Revision,
}

fn redb_error(
    operation: &'static str,
) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> Error {
    move |source| Error::Redb { operation, source }
}

macro_rules! db {
    ($op:literal, $e:expr) => {
        $e.map_err(|e| redb_error($op)(Box::new(e)))
    };
}

impl RedbBackend {
    /// Opens (or creates) the store in `path`.
    pub fn open(path: &Path, config: Config) -> Result<Self, Error> {
        let path = path.to_path_buf();
        Self::with_opener(
            Box::new(move || db!("open", redb::Database::create(&path))),
            config,
        )
    }

    /// Like [`RedbBackend::open`], with every read, write and sync of the file going through
    /// `faults` ([`fault::Faults`]): storage faults that a test cannot make a real disk produce.
    pub fn open_with_faults(
        path: &Path,
        config: Config,
        faults: Arc<fault::Faults>,
    ) -> Result<Self, Error> {
        let path: PathBuf = path.to_path_buf();
        Self::with_opener(
            Box::new(move || {
                let file = db!(
                    "open",
                    std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(&path)
                )?;
                let backend = fault::FaultyFile::new(file, faults.clone())?;
                db!(
                    "open",
                    redb::Database::builder().create_with_backend(backend)
                )
            }),
            config,
        )
    }

    fn with_opener(opener: Opener, config: Config) -> Result<Self, Error> {
        let db = opener()?;
        Self::from_database(db, Some(opener), config)
    }

    /// A store that lives in memory only (tests).
    pub fn in_memory(config: Config) -> Result<Self, Error> {
        let db = db!(
            "open",
            redb::Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())
        )?;
        Self::from_database(db, None, config)
    }

    fn from_database(
        db: redb::Database,
        opener: Option<Opener>,
        config: Config,
    ) -> Result<Self, Error> {
        create_tables(&db)?;
        let (revision, map) = read_all(&db)?;
        let (events, _) = broadcast::channel(config.watcher_buffer.max(16));
        Ok(RedbBackend {
            inner: Arc::new(Inner {
                db: Mutex::new(Some(db)),
                opener,
                state: RwLock::new(State {
                    revision,
                    map,
                    log: VecDeque::new(),
                    oldest: revision,
                    capacity: config.event_history.max(1),
                    pinned: VecDeque::new(),
                }),
                events,
            }),
        })
    }

    /// Every key and value currently stored (offline checks and tests).
    pub fn dump(&self) -> Vec<KeyValue> {
        let state = self.inner.state.read().expect("state lock");
        state.map.values().cloned().collect()
    }

    fn commit_blocking(&self, batch: Batch) -> Result<Commit, Error> {
        let mut db = self.inner.db.lock().expect("commit lock");
        if db.is_none() {
            *db = Some(self.reopen()?);
        }
        let (base_revision, mut map) = {
            let state = self.inner.state.read().expect("state lock");
            for compare in &batch.compares {
                let current = state.map.get(&compare.key).map(|kv| kv.mod_revision);
                if current != compare.mod_revision {
                    return Ok(Commit::Conflict(None));
                }
            }
            (state.revision, state.map.clone())
        };

        let mut revision = base_revision;
        let mut revisions = Vec::with_capacity(batch.groups.len());
        let mut events = Vec::new();
        // The last write of each key in the batch, to persist.
        let mut writes: OrdMap<String, Option<KeyValue>> = OrdMap::new();
        for group in batch.groups {
            let mut group_revision = 0;
            for op in group {
                let prev = map.get(op.key()).cloned();
                if matches!(op, Op::Delete { .. }) && prev.is_none() {
                    continue;
                }
                if group_revision == 0 {
                    revision += 1;
                    group_revision = revision;
                }
                match op {
                    Op::Put { key, value } => {
                        let kv = KeyValue {
                            key: key.clone(),
                            value,
                            create_revision: prev
                                .as_ref()
                                .map_or(group_revision, |p| p.create_revision),
                            mod_revision: group_revision,
                        };
                        map.insert(key.clone(), kv.clone());
                        writes.insert(key, Some(kv.clone()));
                        events.push(Event::new(EventKind::Put, kv, prev));
                    }
                    Op::Delete { key } => {
                        let prev = prev.expect("checked above");
                        map.remove(&key);
                        writes.insert(key, None);
                        events.push(Event::new(
                            EventKind::Delete,
                            KeyValue {
                                mod_revision: group_revision,
                                ..prev.clone()
                            },
                            Some(prev),
                        ));
                    }
                }
            }
            revisions.push(group_revision);
        }
        if revision == base_revision {
            return Ok(Commit::Committed {
                revisions,
                revision,
                put_revisions: HashMap::new(),
            });
        }
        let put_revisions = writes
            .iter()
            .filter_map(|(key, kv)| kv.as_ref().map(|kv| (key.clone(), kv.mod_revision)))
            .collect();

        if let Err(err) = write(db.as_ref().expect("opened above"), &writes, revision) {
            if self.inner.opener.is_some() {
                // redb refuses every write after an I/O error until the database is closed and
                // opened again: close it now (releasing the file), and let the next commit
                // reopen it, so that writes resume once the cause (a full disk) is gone.
                // The error itself is logged once, with the request it failed.
                *db = None;
                tracing::warn!(
                    "embedded store closed after a failed write; the next write reopens it"
                );
            }
            return Err(err);
        }
        let mut state = self.inner.state.write().expect("state lock");
        self.publish(&mut state, map, revision, events);
        Ok(Commit::Committed {
            revisions,
            revision,
            put_revisions,
        })
    }

    /// Opens the file again after a failed write, and checks it against what was acknowledged.
    ///
    /// The file normally holds exactly the acknowledged revision. It may hold more when the
    /// failed commit reached the disk after all (an fsync that failed after the header was
    /// written): the batch was answered with an error, yet it is durable, as a write to etcd
    /// that timed out may be. Its changes are then taken into the in-memory copy and sent to
    /// watchers, so that memory, disk and watches agree; deletions in it get the file's revision,
    /// since the file does not record theirs. A file older than what was acknowledged means
    /// acknowledged writes are gone: that is reported as corruption and nothing is written.
    fn reopen(&self) -> Result<redb::Database, Error> {
        let opener = self
            .inner
            .opener
            .as_ref()
            .expect("only a file-backed store closes its database");
        let db = opener()?;
        let (revision, map) = read_all(&db)?;
        let mut state = self.inner.state.write().expect("state lock");
        if revision < state.revision {
            return Err(Error::Corrupt {
                key: REVISION.to_owned(),
                reason: format!(
                    "the reopened file is at revision {revision}, older than the acknowledged {}",
                    state.revision
                ),
            });
        }
        if revision > state.revision {
            let mut events = Vec::new();
            for (key, kv) in map.iter() {
                let prev = state.map.get(key);
                if prev.is_none_or(|p| p.mod_revision != kv.mod_revision) {
                    events.push(Event::new(EventKind::Put, kv.clone(), prev.cloned()));
                }
            }
            for (key, prev) in state.map.iter() {
                if !map.contains_key(key) {
                    let deleted = KeyValue {
                        mod_revision: revision,
                        ..prev.clone()
                    };
                    events.push(Event::new(EventKind::Delete, deleted, Some(prev.clone())));
                }
            }
            events.sort_by_key(|e| e.kv.mod_revision);
            tracing::warn!(
                acknowledged = state.revision,
                on_disk = revision,
                changes = events.len(),
                "a write reported as failed reached the embedded store's file; taking it in"
            );
            self.publish(&mut state, map, revision, events);
        }
        tracing::info!(revision, "embedded store reopened");
        Ok(db)
    }

    /// Makes a committed batch visible: the new keyspace and revision, the watch log, and the
    /// watchers. Called under the state's write lock, so a watch that registers under the read
    /// lock sees each event exactly once: either in the log or on the channel.
    fn publish(
        &self,
        state: &mut State,
        map: OrdMap<String, KeyValue>,
        revision: Revision,
        events: Vec<Event>,
    ) {
        state.map = map;
        state.revision = revision;
        for event in &events {
            state.log.push_back(event.clone());
        }
        while state.log.len() > state.capacity {
            let dropped = state.log.pop_front().expect("non-empty");
            state.oldest = dropped.kv.mod_revision;
        }
        let _ = self
            .inner
            .events
            .send(Arc::new(Published { events, revision }));
    }

    fn list_now(&self, request: ListRequest) -> Result<ListPage, Error> {
        let mut state = self.inner.state.write().expect("state lock");
        let (revision, map) = match request.revision {
            None => (state.revision, state.map.clone()),
            Some(r) if r == state.revision => (r, state.map.clone()),
            Some(r) if r > state.revision => {
                return Err(Error::FutureRevision {
                    requested: r,
                    current: state.revision,
                });
            }
            Some(r) => match state.pinned.iter().find(|(rev, _)| *rev == r) {
                Some((rev, map)) => (*rev, map.clone()),
                None => {
                    return Err(Error::Compacted {
                        requested: r,
                        oldest: state.oldest,
                    });
                }
            },
        };
        let start = request
            .start
            .clone()
            .unwrap_or_else(|| request.prefix.clone());
        let mut kvs = Vec::new();
        let mut remaining = 0;
        for (key, kv) in map.range(start..) {
            if !key.starts_with(&request.prefix) {
                break;
            }
            if request.limit.is_some_and(|limit| kvs.len() >= limit) {
                remaining += 1;
            } else {
                kvs.push(kv.clone());
            }
        }
        if remaining > 0 && !state.pinned.iter().any(|(rev, _)| *rev == revision) {
            state.pinned.push_back((revision, map));
            if state.pinned.len() > PINNED_SNAPSHOTS {
                state.pinned.pop_front();
            }
        }
        Ok(ListPage {
            revision,
            kvs,
            remaining,
        })
    }

    fn watch_now(&self, prefix: String, after: Revision) -> Result<WatchStream, Error> {
        let state = self.inner.state.read().expect("state lock");
        if after < state.oldest {
            return Err(Error::Compacted {
                requested: after,
                oldest: state.oldest,
            });
        }
        let mut pending: VecDeque<WatchItem> = state
            .log
            .iter()
            .filter(|e| e.kv.mod_revision > after && e.kv.key.starts_with(&prefix))
            .cloned()
            .map(WatchItem::Event)
            .collect();
        pending.push_back(WatchItem::Progress(state.revision.max(after)));
        let receiver = self.inner.events.subscribe();
        drop(state);

        struct Watch {
            pending: VecDeque<WatchItem>,
            receiver: broadcast::Receiver<Arc<Published>>,
            prefix: String,
            after: Revision,
            done: bool,
        }
        let stream = futures::stream::unfold(
            Watch {
                pending,
                receiver,
                prefix,
                after,
                done: false,
            },
            |mut w| async move {
                loop {
                    if let Some(item) = w.pending.pop_front() {
                        return Some((Ok(item), w));
                    }
                    if w.done {
                        return None;
                    }
                    match w.receiver.recv().await {
                        Ok(batch) => {
                            for event in &batch.events {
                                if event.kv.mod_revision > w.after
                                    && event.kv.key.starts_with(&w.prefix)
                                {
                                    w.pending.push_back(WatchItem::Event(event.clone()));
                                }
                            }
                            if batch.revision > w.after {
                                w.pending.push_back(WatchItem::Progress(batch.revision));
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(missed)) => {
                            w.done = true;
                            return Some((Err(Error::WatcherLagged { missed }), w));
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            },
        );
        Ok(stream.boxed())
    }
}

/// Writes one batch's last value of each key, and the new store revision, in one fsynced redb
/// transaction.
fn write(
    db: &redb::Database,
    writes: &OrdMap<String, Option<KeyValue>>,
    revision: Revision,
) -> Result<(), Error> {
    let mut txn = db!("begin write", db.begin_write())?;
    db!(
        "set durability",
        txn.set_durability(redb::Durability::Immediate)
    )?;
    {
        let mut kv = db!("open table", txn.open_table(KV))?;
        let mut record = Vec::new();
        for (key, value) in writes {
            match value {
                Some(value) => {
                    encode_record(value, &mut record);
                    db!("put", kv.insert(key.as_str(), record.as_slice()))?;
                }
                None => {
                    db!("delete", kv.remove(key.as_str()))?;
                }
            }
        }
        let mut meta = db!("open table", txn.open_table(META))?;
        db!("write revision", meta.insert(REVISION, revision))?;
    }
    db!("commit", txn.commit())
}

/// Creates both tables if they are missing, so that read transactions can open them.
fn create_tables(db: &redb::Database) -> Result<(), Error> {
    let txn = db!("begin write", db.begin_write())?;
    {
        db!("open table", txn.open_table(KV))?;
        db!("open table", txn.open_table(META))?;
    }
    db!("commit", txn.commit())
}

/// The store revision and every key of a database whose tables exist. Writes nothing, so that
/// a file can be reopened on a disk that is still full.
fn read_all(db: &redb::Database) -> Result<(Revision, OrdMap<String, KeyValue>), Error> {
    let read = db!("begin read", db.begin_read())?;
    let revision = {
        let meta = db!("open table", read.open_table(META))?;
        db!("read revision", meta.get(REVISION))?
            .map(|v| v.value())
            .unwrap_or(0)
    };
    let mut map = OrdMap::new();
    {
        let kv = db!("open table", read.open_table(KV))?;
        for entry in db!("scan", kv.iter())? {
            let (key, record) = db!("scan", entry)?;
            let key = key.value().to_owned();
            let kv = decode_record(&key, record.value())?;
            map.insert(key, kv);
        }
    }
    Ok((revision, map))
}

fn encode_record(kv: &KeyValue, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&kv.create_revision.to_le_bytes());
    out.extend_from_slice(&kv.mod_revision.to_le_bytes());
    out.extend_from_slice(&kv.value);
}

fn decode_record(key: &str, record: &[u8]) -> Result<KeyValue, Error> {
    if record.len() < 16 {
        return Err(Error::Corrupt {
            key: key.to_owned(),
            reason: format!(
                "record of {} bytes is shorter than its header",
                record.len()
            ),
        });
    }
    let create_revision = i64::from_le_bytes(record[0..8].try_into().expect("8 bytes"));
    let mod_revision = i64::from_le_bytes(record[8..16].try_into().expect("8 bytes"));
    Ok(KeyValue {
        key: key.to_owned(),
        value: Arc::from(&record[16..]),
        create_revision,
        mod_revision,
    })
}

impl Backend for RedbBackend {
    fn name(&self) -> &'static str {
        "redb"
    }

    fn current_revision(&self) -> BoxFuture<'_, Result<Revision, Error>> {
        let revision = self.inner.state.read().expect("state lock").revision;
        futures::future::ready(Ok(revision)).boxed()
    }

    fn get_many(&self, keys: Vec<String>) -> BoxFuture<'_, Result<Fetched, Error>> {
        let state = self.inner.state.read().expect("state lock");
        let kvs = keys
            .into_iter()
            .filter_map(|key| state.map.get(&key).cloned().map(|kv| (key, kv)))
            .collect();
        futures::future::ready(Ok(Fetched {
            revision: state.revision,
            kvs,
        }))
        .boxed()
    }

    fn list(&self, request: ListRequest) -> BoxFuture<'_, Result<ListPage, Error>> {
        futures::future::ready(self.list_now(request)).boxed()
    }

    fn commit(&self, batch: Batch) -> BoxFuture<'_, Result<Commit, Error>> {
        let this = self.clone();
        async move {
            tokio::task::spawn_blocking(move || this.commit_blocking(batch))
                .await
                .map_err(|e| redb_error("commit task")(Box::new(e)))?
        }
        .boxed()
    }

    fn watch(&self, prefix: String, after: Revision) -> BoxFuture<'_, Result<WatchStream, Error>> {
        futures::future::ready(self.watch_now(prefix, after)).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Compare;

    fn put(key: &str, value: &str) -> Op {
        Op::Put {
            key: key.into(),
            value: Arc::from(value.as_bytes()),
        }
    }

    async fn commit(b: &RedbBackend, groups: Vec<Vec<Op>>) -> Vec<Revision> {
        match b
            .commit(Batch {
                compares: vec![],
                groups,
            })
            .await
            .unwrap()
        {
            Commit::Committed { revisions, .. } => revisions,
            Commit::Conflict(_) => panic!("conflict"),
        }
    }

    #[tokio::test]
    async fn each_group_of_a_batch_gets_its_own_revision() {
        let b = RedbBackend::in_memory(Config::default()).unwrap();
        let revs = commit(&b, vec![vec![put("/a", "1")], vec![], vec![put("/b", "2")]]).await;
        assert_eq!(revs, vec![1, 0, 2]);
        let f = b
            .get_many(vec!["/a".into(), "/b".into(), "/c".into()])
            .await
            .unwrap();
        assert_eq!(f.revision, 2);
        assert_eq!(f.kvs["/b"].mod_revision, 2);
        assert!(!f.kvs.contains_key("/c"));
    }

    #[tokio::test]
    async fn a_failed_compare_writes_nothing() {
        let b = RedbBackend::in_memory(Config::default()).unwrap();
        commit(&b, vec![vec![put("/a", "1")]]).await;
        let outcome = b
            .commit(Batch {
                compares: vec![Compare {
                    key: "/a".into(),
                    mod_revision: None,
                }],
                groups: vec![vec![put("/b", "2")]],
            })
            .await
            .unwrap();
        assert_eq!(outcome, Commit::Conflict(None));
        assert_eq!(b.current_revision().await.unwrap(), 1);
    }

    #[tokio::test]
    async fn data_survives_reopening_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        {
            let b = RedbBackend::open(&path, Config::default()).unwrap();
            commit(&b, vec![vec![put("/a", "1"), put("/b", "2")]]).await;
            commit(&b, vec![vec![Op::Delete { key: "/a".into() }]]).await;
        }
        let b = RedbBackend::open(&path, Config::default()).unwrap();
        assert_eq!(b.current_revision().await.unwrap(), 2);
        let dump = b.dump();
        assert_eq!(dump.len(), 1);
        assert_eq!(dump[0].key, "/b");
        assert_eq!(dump[0].create_revision, 1);
    }

    async fn try_commit(b: &RedbBackend, groups: Vec<Vec<Op>>) -> Result<Commit, Error> {
        b.commit(Batch {
            compares: vec![],
            groups,
        })
        .await
    }

    /// The events a watch has delivered so far (it is polled until nothing more is ready).
    async fn drain(watch: &mut WatchStream) -> Vec<(String, Revision)> {
        let mut seen = Vec::new();
        while let Ok(Some(item)) =
            tokio::time::timeout(std::time::Duration::from_millis(50), watch.next()).await
        {
            if let WatchItem::Event(e) = item.unwrap() {
                seen.push((e.kv.key.clone(), e.kv.mod_revision));
            }
        }
        seen
    }

    /// What the file holds, read by a second handle after the first is dropped.
    fn on_disk(path: &Path) -> Vec<(String, Revision)> {
        RedbBackend::open(path, Config::default())
            .unwrap()
            .dump()
            .into_iter()
            .map(|kv| (kv.key, kv.mod_revision))
            .collect()
    }

    fn in_memory(b: &RedbBackend) -> Vec<(String, Revision)> {
        b.dump()
            .into_iter()
            .map(|kv| (kv.key, kv.mod_revision))
            .collect()
    }

    /// A full disk (ENOSPC on write) fails the batch and keeps reads and watches; once space is
    /// back, the next write reopens the file and succeeds: no restart (issue #20).
    #[tokio::test]
    async fn writes_resume_after_a_full_disk_without_a_restart_and_watches_survive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let faults = fault::Faults::new();
        let b = RedbBackend::open_with_faults(&path, Config::default(), faults.clone()).unwrap();
        commit(&b, vec![vec![put("/a", "1")]]).await;
        let mut watch = b.watch("/".into(), 1).await.unwrap();

        faults.fail_writes(Some(libc::ENOSPC));
        for _ in 0..3 {
            let err = try_commit(&b, vec![vec![put("/b", "2")]])
                .await
                .expect_err("a write on a full disk fails");
            let text = crate::report(&err);
            assert!(text.contains("No space left on device"), "{text}");
        }
        assert_eq!(b.current_revision().await.unwrap(), 1);
        assert_eq!(in_memory(&b), vec![("/a".to_owned(), 1)]);

        faults.fail_writes(None);
        assert_eq!(commit(&b, vec![vec![put("/c", "3")]]).await, vec![2]);
        assert_eq!(drain(&mut watch).await, vec![("/c".to_owned(), 2)]);
        let memory = in_memory(&b);
        assert_eq!(memory, vec![("/a".to_owned(), 1), ("/c".to_owned(), 2)]);
        drop(b);
        assert_eq!(on_disk(&path), memory);
    }

    /// EIO on write and on fsync, each: the failed batch is not acknowledged, the next one is,
    /// and afterwards the file, the in-memory copy and the watch all agree.
    #[tokio::test]
    async fn an_io_error_on_write_or_fsync_leaves_memory_disk_and_watches_in_agreement() {
        for fail_sync in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db");
            let faults = fault::Faults::new();
            let b =
                RedbBackend::open_with_faults(&path, Config::default(), faults.clone()).unwrap();
            commit(&b, vec![vec![put("/a", "1"), put("/gone", "x")]]).await;
            let mut watch = b.watch("/".into(), 1).await.unwrap();

            if fail_sync {
                faults.fail_syncs(Some(libc::EIO));
            } else {
                faults.fail_writes(Some(libc::EIO));
            }
            let err = try_commit(
                &b,
                vec![vec![
                    put("/b", "2"),
                    Op::Delete {
                        key: "/gone".into(),
                    },
                ]],
            )
            .await
            .expect_err("the faulty write fails");
            assert!(crate::report(&err).contains("Input/output error"), "{err}");
            faults.fail_syncs(None);
            faults.fail_writes(None);

            let revs = commit(&b, vec![vec![put("/c", "3")]]).await;
            let memory = in_memory(&b);
            assert!(memory.contains(&("/c".to_owned(), revs[0])), "{memory:?}");
            // Every key the watch reported is where memory says it is.
            for (key, rev) in drain(&mut watch).await {
                assert!(
                    memory.contains(&(key.clone(), rev)) || !memory.iter().any(|(k, _)| *k == key),
                    "watch saw {key}@{rev}, memory holds {memory:?}"
                );
            }
            drop(b);
            assert_eq!(on_disk(&path), memory, "fail_sync={fail_sync}");
        }
    }

    #[tokio::test]
    async fn paginated_list_continues_at_its_revision() {
        let b = RedbBackend::in_memory(Config::default()).unwrap();
        commit(
            &b,
            vec![vec![put("/p/a", "1"), put("/p/b", "2"), put("/p/c", "3")]],
        )
        .await;
        let page = b
            .list(ListRequest {
                prefix: "/p/".into(),
                start: None,
                revision: None,
                limit: Some(2),
            })
            .await
            .unwrap();
        assert_eq!(page.kvs.len(), 2);
        assert_eq!(page.remaining, 1);
        commit(&b, vec![vec![put("/p/d", "4")]]).await;
        let next = b
            .list(ListRequest {
                prefix: "/p/".into(),
                start: Some("/p/c".into()),
                revision: Some(page.revision),
                limit: Some(2),
            })
            .await
            .unwrap();
        assert_eq!(
            next.kvs.len(),
            1,
            "the key written later is not in the old snapshot"
        );
        assert_eq!(next.remaining, 0);
    }

    #[tokio::test]
    async fn watch_replays_then_follows_and_too_old_is_compacted() {
        let b = RedbBackend::in_memory(Config {
            event_history: 2,
            ..Config::default()
        })
        .unwrap();
        commit(&b, vec![vec![put("/w/a", "1")]]).await;
        commit(&b, vec![vec![put("/w/b", "2")]]).await;
        commit(&b, vec![vec![put("/x/c", "3")]]).await;
        assert!(matches!(
            b.watch("/w/".into(), 0).await,
            Err(Error::Compacted {
                requested: 0,
                oldest: 1
            })
        ));
        let mut w = b.watch("/w/".into(), 1).await.unwrap();
        let first = w.next().await.unwrap().unwrap();
        assert!(matches!(first, WatchItem::Event(ref e) if e.kv.key == "/w/b"));
        assert_eq!(w.next().await.unwrap().unwrap(), WatchItem::Progress(3));
        commit(&b, vec![vec![Op::Delete { key: "/w/a".into() }]]).await;
        match w.next().await.unwrap().unwrap() {
            WatchItem::Event(e) => {
                assert_eq!(e.kind, EventKind::Delete);
                assert_eq!(e.kv.mod_revision, 4);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
