//! The storage contract: a revisioned key-value store with multi-key compare-and-swap and watch.
//!
//! The contract is etcd v3's, reduced to what the registry needs, so that the embedded redb
//! backend and an etcd backend are interchangeable:
//!
//! - every committed change gets a **revision** from one counter that only grows; the
//!   `resourceVersion` of an object is the revision of its last change (`mod_revision`), and the
//!   `resourceVersion` of a list is the store revision it was read at;
//! - [`Backend::commit`] applies a [`Batch`] atomically, and only if every [`Compare`] in it still
//!   holds (the key's `mod_revision` is the one the writer read, or the key is still absent);
//! - [`Backend::watch`] replays every change after a revision, then follows; a revision that is no
//!   longer kept fails with [`Error::Compacted`], which the REST layer turns into `410 Gone`.
//!
//! Keys are laid out as kube-apiserver lays them out in etcd (see [`keys`]); values are JSON.

pub mod etcd;
pub mod keys;
pub mod outage;
pub mod redb;

use std::collections::HashMap;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

/// A revision of the store: etcd's `revision`, Kubernetes' `resourceVersion`.
pub type Revision = i64;

/// One stored key with its value and revisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The full key, e.g. `/registry/services/specs/default/web`.
    pub key: String,
    /// The value: a JSON document.
    pub value: Arc<[u8]>,
    /// Revision of the change that created the key.
    pub create_revision: Revision,
    /// Revision of the last change to the key (the object's `resourceVersion`).
    pub mod_revision: Revision,
}

/// A condition a [`Batch`] needs to hold at commit time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compare {
    /// The key the condition is about.
    pub key: String,
    /// The `mod_revision` the key must still have, or `None` if it must still be absent.
    pub mod_revision: Option<Revision>,
}

/// One write of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Set the key to this value.
    Put {
        /// The key to write.
        key: String,
        /// The new value.
        value: Arc<[u8]>,
    },
    /// Remove the key (a no-op if it is absent).
    Delete {
        /// The key to remove.
        key: String,
    },
}

impl Op {
    /// The key this operation writes.
    pub fn key(&self) -> &str {
        match self {
            Op::Put { key, .. } | Op::Delete { key } => key,
        }
    }
}

/// Writes committed together, in one backend transaction.
///
/// A batch carries the writes of several API requests (group commit). Each request's writes are a
/// `group`; the redb backend gives each non-empty group its own revision so that a watcher can
/// resume between two requests of one batch; a backend that cannot (etcd gives one revision per
/// transaction) may give all groups the same revision. Either way all groups commit or none does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// Conditions checked atomically before any write.
    pub compares: Vec<Compare>,
    /// Writes, one group per request, in order.
    pub groups: Vec<Vec<Op>>,
}

/// The result of [`Backend::commit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit {
    /// The batch was written and is durable. One revision per group (0 for an empty group).
    Committed {
        /// The revision each group was written at, in order.
        revisions: Vec<Revision>,
        /// The store revision after the batch.
        revision: Revision,
        /// The `mod_revision` each key the batch put now has.
        put_revisions: HashMap<String, Revision>,
    },
    /// A compare failed; nothing was written. A backend that can read in the same round trip
    /// (etcd: the failure branch of the transaction) gives every compared key as it is now, so
    /// that the writer can re-run the batch without reading again.
    Conflict(Option<Fetched>),
}

/// The keys read by [`Backend::get_many`], at one revision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fetched {
    /// The store revision the keys were read at.
    pub revision: Revision,
    /// The keys that exist; absent keys are not in the map.
    pub kvs: HashMap<String, KeyValue>,
}

/// A range read by [`Backend::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListRequest {
    /// Every key starting with this prefix.
    pub prefix: String,
    /// Start at this key (inclusive) instead of at `prefix`: how `continue` resumes.
    pub start: Option<String>,
    /// Read at this revision (a continued list); `None` reads the latest.
    pub revision: Option<Revision>,
    /// At most this many keys; `None` for all.
    pub limit: Option<usize>,
}

/// One page of a [`ListRequest`].
#[derive(Debug, Clone, Default)]
pub struct ListPage {
    /// The revision the page was read at.
    pub revision: Revision,
    /// The keys, in key order.
    pub kvs: Vec<KeyValue>,
    /// How many keys under the prefix come after this page.
    pub remaining: usize,
}

/// What happened to a key, as a watcher sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// The key was created or changed.
    Put,
    /// The key was deleted.
    Delete,
}

/// A change to a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Put or delete.
    pub kind: EventKind,
    /// The key after the change: for a delete, the value it had, with the delete's revision as
    /// `mod_revision`.
    pub kv: KeyValue,
    /// The value before the change, if the key existed.
    pub prev: Option<KeyValue>,
    /// Shared by every clone of this event (see [`Memo`]).
    pub memo: Memo,
}

impl Event {
    /// An event with an empty memo.
    pub fn new(kind: EventKind, kv: KeyValue, prev: Option<KeyValue>) -> Self {
        Event {
            kind,
            kv,
            prev,
            memo: Memo::default(),
        }
    }
}

/// A slot that every clone of one [`Event`] shares, where the layer above keeps what it derived
/// from the event (the decoded object and its encoded watch lines), so that a hundred watchers of
/// one change decode and encode it once rather than a hundred times. Backends fan one event out
/// to all their watchers as clones, so they share the slot; the slot never takes part in
/// comparisons.
#[derive(Clone, Default)]
pub struct Memo(Arc<std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>>);

impl Memo {
    /// The value kept in the slot, computing it with `init` if this is the first use.
    pub fn get_or_init<T: std::any::Any + Send + Sync>(&self, init: impl FnOnce() -> T) -> Arc<T> {
        let mut init = Some(init);
        let any = self
            .0
            .get_or_init(|| Arc::new(init.take().expect("called once")()));
        match any.clone().downcast::<T>() {
            Ok(value) => value,
            // The slot holds another type (so `init` was not called): compute without sharing.
            Err(_) => Arc::new(init.take().expect("not called")()),
        }
    }
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "Memo(set)"
        } else {
            "Memo(empty)"
        })
    }
}

impl PartialEq for Memo {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Memo {}

/// An item of a watch stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchItem {
    /// A change under the watched prefix.
    Event(Event),
    /// Every change up to this revision has been delivered (the basis of BOOKMARK events).
    Progress(Revision),
}

/// A watch: changes after the requested revision, in revision order, then progress marks.
pub type WatchStream = BoxStream<'static, Result<WatchItem, Error>>;

/// Why a storage call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The requested revision is older than the oldest one the backend still keeps.
    #[error("too old resource version: {requested} ({oldest})")]
    Compacted {
        /// The revision asked for.
        requested: Revision,
        /// The oldest revision that can still be served (exclusive).
        oldest: Revision,
    },
    /// The requested revision is newer than the store's.
    #[error("resource version {requested} is newer than the store revision {current}")]
    FutureRevision {
        /// The revision asked for.
        requested: Revision,
        /// The store's current revision.
        current: Revision,
    },
    /// A watcher fell so far behind that events it had not read were dropped.
    #[error("watcher fell behind by {missed} batches and was closed")]
    WatcherLagged {
        /// How many batches it missed.
        missed: u64,
    },
    /// The embedded database failed.
    #[error("embedded store {operation} failed")]
    Redb {
        /// What was being done.
        operation: &'static str,
        /// The database error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A stored record could not be decoded.
    #[error("stored record for key {key:?} is corrupt: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The backend is shut down.
    #[error("storage is shut down")]
    Closed,
    /// The backend cannot be reached (etcd down or partitioned away).
    #[error("{backend} is unavailable: {message}")]
    Unavailable {
        /// `etcd`.
        backend: &'static str,
        /// What failed.
        message: String,
    },
    /// The backend did not answer in time.
    #[error("{backend} did not answer in time ({operation})")]
    Timeout {
        /// `etcd`.
        backend: &'static str,
        /// What was being done.
        operation: &'static str,
    },
    /// The backend refused a request.
    #[error("{operation} failed")]
    Backend {
        /// What was being done.
        operation: &'static str,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A batch the backend cannot commit as asked.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
}

/// A revisioned key-value store (see the module docs for the contract).
///
/// Methods return boxed futures so that the registry can hold an `Arc<dyn Backend>`.
pub trait Backend: Send + Sync + 'static {
    /// A short name for logs and `/readyz` (`redb`, `etcd`).
    fn name(&self) -> &'static str;

    /// The current store revision.
    fn current_revision(&self) -> BoxFuture<'_, Result<Revision, Error>>;

    /// Reads several keys at one revision (the latest).
    fn get_many(&self, keys: Vec<String>) -> BoxFuture<'_, Result<Fetched, Error>>;

    /// Reads several keys at one revision for the writer, whose commit compares every key it
    /// read: the read may be a little stale if that is cheaper (a lost race follows).
    fn get_many_for_write(&self, keys: Vec<String>) -> BoxFuture<'_, Result<Fetched, Error>> {
        self.get_many(keys)
    }

    /// Reads a key range at one revision.
    fn list(&self, request: ListRequest) -> BoxFuture<'_, Result<ListPage, Error>>;

    /// Commits a batch atomically if all its compares hold. Returns when the batch is durable.
    fn commit(&self, batch: Batch) -> BoxFuture<'_, Result<Commit, Error>>;

    /// Changes under `prefix` with a revision greater than `after`, then follows.
    fn watch(&self, prefix: String, after: Revision) -> BoxFuture<'_, Result<WatchStream, Error>>;

    /// Whether a lost race gives the compared keys back ([`Commit::Conflict`] with `Some`), so
    /// that the writer may commit from what it believes is stored and read only when it was
    /// wrong (etcd, where a read is a network round trip).
    fn reads_on_conflict(&self) -> bool {
        false
    }

    /// The most keys one batch may declare (the writer adds both range keys to them).
    fn max_batch_keys(&self) -> usize {
        usize::MAX
    }

    /// Outages of a backend that can be unreachable (etcd): whether it answers now, how often
    /// it stopped, and how many calls failed meanwhile. `None` for the embedded store.
    fn outages(&self) -> Option<outage::OutageStats> {
        None
    }

    /// Whether the backend answers (`/readyz`).
    fn check(&self) -> BoxFuture<'_, Result<(), Error>> {
        futures::future::ready(Ok(())).boxed()
    }
}
