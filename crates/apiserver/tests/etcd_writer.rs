//! The writer on etcd commits a batch on the keys as it last saw them, without reading them
//! first; these tests run two writers (two `Store`s, as two API servers have) on one real etcd and
//! check that a guess gone stale, or a key guessed absent that another writer created, costs a
//! failed commit and a re-run, never a lost update or an overwrite; and that servers take turns
//! when one keeps losing (the turn mark, see "Taking turns" in `storage::etcd`).
//!
//! Needs `/usr/bin/etcd` (Debian package `etcd-server`); fails when it is missing unless
//! `NODEPORT_SKIP_PRIVILEGED=1` is set.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nodeport_apiserver::PortRange;
use nodeport_apiserver::error::ApiError;
use nodeport_apiserver::storage::etcd::{Config, EtcdBackend};
use nodeport_apiserver::storage::{Backend, Batch, Commit, Compare, Op};
use nodeport_apiserver::store::{Ranges, Store};
use nodeport_testbed::etcd::Etcd;

const PREFIX: &str = "/registry";

/// etcd with its data in a temporary directory; `None` (after saying so) only when
/// `NODEPORT_SKIP_PRIVILEGED=1` and etcd is missing.
fn start_etcd() -> Option<(Etcd, tempfile::TempDir)> {
    if !std::path::Path::new("/usr/bin/etcd").exists() {
        if std::env::var("NODEPORT_SKIP_PRIVILEGED").as_deref() == Ok("1") {
            eprintln!("skipped: /usr/bin/etcd is missing and NODEPORT_SKIP_PRIVILEGED=1");
            return None;
        }
        panic!("/usr/bin/etcd is missing: install the Debian package etcd-server");
    }
    let dir = tempfile::tempdir().unwrap();
    Some((Etcd::start(dir.path()), dir))
}

fn ranges() -> Ranges {
    Ranges {
        node_ports: PortRange::default(),
        cluster_ips: "10.96.0.0/16".parse().unwrap(),
        secondary_cluster_ips: None,
    }
}

/// A writer on its own etcd client, once etcd answers.
async fn writer(etcd: &Etcd) -> Store {
    for _ in 0..100 {
        if let Ok(backend) = EtcdBackend::connect(Config::new(vec![etcd.url()]), PREFIX).await
            && backend.check().await.is_ok()
        {
            return Store::start(Arc::new(backend), PREFIX, ranges());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("etcd at {} did not answer within 10 s", etcd.url());
}

/// Writes the empty bitmaps, as the API server's bootstrap does, so that writers have range keys
/// to commit against.
async fn bootstrap(store: &Store) {
    store
        .mutate(Vec::new(), |txn| {
            txn.replace_allocators(ranges().empty()?);
            Ok(())
        })
        .await
        .unwrap();
}

/// Reads `key` as a number and writes it plus one; returns the mod_revision it read and the
/// revision of the write.
async fn increment(store: &Store, key: &str) -> (Option<i64>, i64) {
    let key = key.to_owned();
    let done = store
        .mutate(vec![key.clone()], move |txn| {
            let entry = txn.get(&key);
            let n: u64 = entry.as_ref().map_or(0, |e| {
                std::str::from_utf8(&e.value).unwrap().parse().unwrap()
            });
            txn.put(key.clone(), Arc::from((n + 1).to_string().as_bytes()));
            Ok(entry.map(|e| e.mod_revision))
        })
        .await
        .unwrap();
    (done.value, done.revision.unwrap())
}

/// Creates `key` with `value` unless it exists (kube-apiserver's create: `AlreadyExists`).
async fn create(store: &Store, key: &str, value: &'static str) -> Result<i64, ApiError> {
    let key = key.to_owned();
    let done = store
        .mutate(vec![key.clone()], move |txn| {
            if txn.get(&key).is_some() {
                return Err(ApiError::bad_request(format!("{key} already exists")));
            }
            txn.put(key.clone(), Arc::from(value.as_bytes()));
            Ok(())
        })
        .await?;
    Ok(done.revision.unwrap())
}

async fn stored(store: &Store, key: &str) -> Option<String> {
    let fetched = store
        .backend()
        .get_many(vec![key.to_owned()])
        .await
        .unwrap();
    fetched
        .kvs
        .get(key)
        .map(|kv| String::from_utf8(kv.value.to_vec()).unwrap())
}

#[tokio::test]
async fn a_writer_whose_view_went_stale_re_runs_on_the_current_value_and_loses_no_update() {
    let Some((etcd, _dir)) = start_etcd() else {
        return;
    };
    let (a, b) = (writer(&etcd).await, writer(&etcd).await);
    bootstrap(&a).await;
    let key = "/registry/test/counter";

    let (_, first) = increment(&a, key).await;
    // B never saw the key: it reads it once (it knows no bitmaps yet), then knows it.
    let (seen, second) = increment(&b, key).await;
    assert_eq!(seen, Some(first));
    // A's view of the key (and of the bitmaps) is now stale: it commits on it without a read,
    // loses, and re-runs on what the failed commit gave back.
    let reads_before = a.stats().read_nanos.load(Ordering::Relaxed);
    let conflicts_before = a.stats().conflicts.load(Ordering::Relaxed);
    let (seen, third) = increment(&a, key).await;
    assert_eq!(seen, Some(second), "the re-run must see B's write");
    assert!(third > second);
    assert_eq!(
        a.stats().conflicts.load(Ordering::Relaxed),
        conflicts_before + 1
    );
    assert_eq!(
        a.stats().read_nanos.load(Ordering::Relaxed),
        reads_before,
        "the stale guess was corrected by the failed commit, not by a read"
    );
    // A's own write is what it knows now: the next increment commits at once, with no loss.
    let (seen, _) = increment(&a, key).await;
    assert_eq!(
        seen,
        Some(third),
        "the revision remembered from the commit is exact"
    );
    assert_eq!(
        a.stats().conflicts.load(Ordering::Relaxed),
        conflicts_before + 1
    );
    assert_eq!(stored(&a, key).await.as_deref(), Some("4"));

    // Both writers at once, 4 clients each, 25 increments per client: no update lost.
    let mut tasks = Vec::new();
    for store in [a.clone(), b.clone()] {
        for _ in 0..4 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..25 {
                    increment(&store, key).await;
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(stored(&a, key).await.as_deref(), Some("204"));
}

#[tokio::test]
async fn a_key_guessed_absent_that_another_writer_created_is_not_overwritten() {
    let Some((etcd, _dir)) = start_etcd() else {
        return;
    };
    let (a, b) = (writer(&etcd).await, writer(&etcd).await);
    bootstrap(&a).await;
    // B learns the bitmaps, so that it commits its next batches on what it knows.
    increment(&b, "/registry/test/warm").await;
    let key = "/registry/test/object";
    create(&a, key, "from a").await.unwrap();
    // B never saw the key and takes it as absent; its commit compares it as absent, fails, and
    // the re-run sees A's object.
    let conflicts_before = b.stats().conflicts.load(Ordering::Relaxed);
    let err = create(&b, key, "from b").await.unwrap_err();
    assert_eq!(err.code(), 400, "{err:?}");
    assert_eq!(
        b.stats().conflicts.load(Ordering::Relaxed),
        conflicts_before + 1
    );
    assert_eq!(stored(&a, key).await.as_deref(), Some("from a"));
}

async fn backend(etcd: &Etcd) -> EtcdBackend {
    EtcdBackend::connect(Config::new(vec![etcd.url()]), PREFIX)
        .await
        .unwrap()
}

/// Puts `key`, on condition that it is still absent.
async fn put_if_absent(backend: &EtcdBackend, key: &str) -> Commit {
    backend
        .commit(Batch {
            compares: vec![Compare {
                key: key.to_owned(),
                mod_revision: None,
            }],
            groups: vec![vec![Op::Put {
                key: key.to_owned(),
                value: Arc::from(&b"{}"[..]),
            }]],
        })
        .await
        .unwrap()
}

/// The turn mark as stored: (value, mod_revision).
async fn mark(backend: &EtcdBackend) -> Option<(String, i64)> {
    let key = backend.turn_mark_key().to_owned();
    let fetched = backend.get_many(vec![key.clone()]).await.unwrap();
    fetched.kvs.get(&key).map(|kv| {
        (
            String::from_utf8(kv.value.to_vec()).unwrap(),
            kv.mod_revision,
        )
    })
}

#[tokio::test]
async fn a_server_that_keeps_losing_puts_its_mark_and_the_next_winner_waits_a_turn() {
    let Some((etcd, _dir)) = start_etcd() else {
        return;
    };
    let (winner, loser) = (backend(&etcd).await, backend(&etcd).await);
    assert!(matches!(
        put_if_absent(&winner, "/registry/test/taken").await,
        Commit::Committed { .. }
    ));
    // The loser commits on a stale view (the key absent) again and again. The first two failed
    // commits leave no mark; the third says "I keep losing".
    for lost in 1..=2 {
        let commit = put_if_absent(&loser, "/registry/test/taken").await;
        assert!(matches!(commit, Commit::Conflict(_)), "{lost}");
        assert_eq!(
            mark(&loser).await,
            None,
            "no mark after {lost} failed commits"
        );
    }
    assert!(matches!(
        put_if_absent(&loser, "/registry/test/taken").await,
        Commit::Conflict(_)
    ));
    let (loser_id, marked_at) = mark(&loser).await.expect("the mark after 3 failed commits");
    // The mark is outside the prefix, so that no watch of the API server sees it.
    assert!(!loser.turn_mark_key().starts_with("/registry/"));

    // The winner's next win reads the new mark, not its own: it gives the losers a turn, a wait
    // before its next commit, which that commit takes.
    assert_eq!(winner.turn_given(), None);
    let commit = put_if_absent(&winner, "/registry/test/next").await;
    assert!(matches!(commit, Commit::Committed { .. }));
    let wait = winner
        .turn_given()
        .expect("the winner must give the losers a turn");
    assert!(
        !wait.is_zero() && wait <= Duration::from_millis(50),
        "{wait:?}"
    );
    let commit = put_if_absent(&winner, "/registry/test/after").await;
    assert!(matches!(commit, Commit::Committed { .. }));
    assert_eq!(winner.turn_given(), None, "a turn is given once");

    // A mark already seen gives no turn again.
    put_if_absent(&winner, "/registry/test/again").await;
    assert_eq!(winner.turn_given(), None);

    // The loser's own mark gives no turn when it wins; its win ends its streak, so one more
    // failed commit leaves the mark as it was.
    assert!(matches!(
        put_if_absent(&loser, "/registry/test/mine").await,
        Commit::Committed { .. }
    ));
    assert_eq!(loser.turn_given(), None, "its own mark gives no turn");
    assert!(matches!(
        put_if_absent(&loser, "/registry/test/taken").await,
        Commit::Conflict(_)
    ));
    assert_eq!(mark(&loser).await, Some((loser_id, marked_at)));
}

/// Keys a mutation creates without declaring them (a Service's IPAddress objects) are compared
/// as absent too; the writer keeps the compares of one transaction within etcd's
/// `--max-txn-ops` (128) by moving the jobs that would pass it to the next batch: a hundred
/// requests at once, each reading five declared keys and creating two (24 such jobs fit the
/// declared keys, and would compare 172 keys), all commit, every created key once.
#[tokio::test]
async fn keys_created_without_being_declared_keep_a_batch_within_etcds_operation_limit() {
    let Some((etcd, _dir)) = start_etcd() else {
        return;
    };
    let store = writer(&etcd).await;
    bootstrap(&store).await;
    let requests = (0..100).map(|i| {
        let store = store.clone();
        async move {
            let declared: Vec<String> = (0..5).map(|k| format!("{PREFIX}/test/d{i}-{k}")).collect();
            let keys = declared.clone();
            store
                .mutate(keys, move |txn| {
                    for key in &declared {
                        assert!(txn.get(key).is_none());
                    }
                    for k in 0..2 {
                        txn.create(format!("{PREFIX}/test/c{i}-{k}"), Arc::from(&b"c"[..]));
                    }
                    Ok(())
                })
                .await
        }
    });
    for result in futures::future::join_all(requests).await {
        result.unwrap();
    }
    let listed = store
        .backend()
        .list(nodeport_apiserver::storage::ListRequest {
            prefix: format!("{PREFIX}/test/c"),
            start: None,
            revision: None,
            limit: None,
        })
        .await
        .unwrap();
    assert_eq!(listed.kvs.len(), 200);
}
