//! Storage outages, logged once each: one ERROR line when the storage stops answering, one WARN
//! line when it answers again (how long it was down, how many calls to it failed meanwhile:
//! requests, health checks, watch restarts), and counters for `/metrics`, instead of one ERROR
//! line per failed request.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Error;

/// Tracks whether the storage answers, from the outcome of every call to it.
#[derive(Debug)]
pub struct Outages {
    backend: &'static str,
    /// The outage in progress, if any.
    current: Mutex<Option<Down>>,
    outages: AtomicU64,
    failed: AtomicU64,
}

#[derive(Debug)]
struct Down {
    since: Instant,
    failed: u64,
}

/// A change of reachability, as [`Outages::record`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// The storage stopped answering (the first failure after a success).
    Lost,
    /// The storage answers again.
    Restored {
        /// How long it did not answer.
        down_for: Duration,
        /// Calls that failed meanwhile.
        failed: u64,
    },
}

/// The counters of [`Outages`], for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutageStats {
    /// Whether the storage answered the last call.
    pub reachable: bool,
    /// Outages since the start.
    pub outages: u64,
    /// Calls that failed because the storage did not answer.
    pub failed_calls: u64,
}

impl Outages {
    /// A tracker for `backend` (named in the log lines), reachable to begin with.
    pub fn new(backend: &'static str) -> Self {
        Self {
            backend,
            current: Mutex::new(None),
            outages: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// Records the outcome of one call. Only `Unavailable` and `Timeout` mean the storage does
    /// not answer; any other outcome, errors included, is an answer. Logs and returns a
    /// transition when reachability changed.
    pub fn record<T>(&self, operation: &str, result: &Result<T, Error>) -> Option<Transition> {
        let unreachable = match result {
            Err(err @ (Error::Unavailable { .. } | Error::Timeout { .. })) => Some(err),
            _ => None,
        };
        let mut current = self.current.lock().expect("outage lock");
        match (unreachable, current.as_mut()) {
            (Some(_), Some(down)) => {
                down.failed += 1;
                self.failed.fetch_add(1, Ordering::Relaxed);
                None
            }
            (Some(err), None) => {
                *current = Some(Down {
                    since: Instant::now(),
                    failed: 1,
                });
                self.failed.fetch_add(1, Ordering::Relaxed);
                self.outages.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    backend = self.backend,
                    operation,
                    error = %crate::report(err),
                    "storage is unreachable; requests fail with 503/504 until it answers again"
                );
                Some(Transition::Lost)
            }
            (None, Some(_)) => {
                let down = current.take().expect("in an outage");
                let down_for = down.since.elapsed();
                tracing::warn!(
                    backend = self.backend,
                    down_for = ?down_for,
                    failed_calls = down.failed,
                    "storage is reachable again"
                );
                Some(Transition::Restored {
                    down_for,
                    failed: down.failed,
                })
            }
            (None, None) => None,
        }
    }

    /// The counters.
    pub fn stats(&self) -> OutageStats {
        OutageStats {
            reachable: self.current.lock().expect("outage lock").is_none(),
            outages: self.outages.load(Ordering::Relaxed),
            failed_calls: self.failed.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unavailable() -> Result<(), Error> {
        Err(Error::Unavailable {
            backend: "etcd",
            message: "commit: transport error".into(),
        })
    }

    fn timeout() -> Result<(), Error> {
        Err(Error::Timeout {
            backend: "etcd",
            operation: "read",
        })
    }

    #[test]
    fn an_outage_is_reported_once_when_it_starts_and_once_when_it_ends() {
        let o = Outages::new("etcd");
        assert_eq!(o.record("read", &Ok::<(), Error>(())), None);
        assert_eq!(o.record("commit", &unavailable()), Some(Transition::Lost));
        for _ in 0..99 {
            assert_eq!(o.record("read", &timeout()), None);
        }
        assert_eq!(
            o.stats(),
            OutageStats {
                reachable: false,
                outages: 1,
                failed_calls: 100
            }
        );
        match o.record("read", &Ok::<(), Error>(())) {
            Some(Transition::Restored { failed, .. }) => assert_eq!(failed, 100),
            other => panic!("expected Restored, got {other:?}"),
        }
        assert_eq!(o.record("read", &Ok::<(), Error>(())), None);
        assert!(o.stats().reachable);
        // The next outage counts on.
        assert_eq!(o.record("watch", &unavailable()), Some(Transition::Lost));
        assert_eq!(o.stats().outages, 2);
        assert_eq!(o.stats().failed_calls, 101);
    }

    #[test]
    fn errors_that_are_answers_do_not_start_an_outage() {
        let o = Outages::new("etcd");
        let compacted: Result<(), Error> = Err(Error::Compacted {
            requested: 5,
            oldest: 9,
        });
        assert_eq!(o.record("watch", &compacted), None);
        assert!(o.stats().reachable);
        // And they end one: etcd answered.
        o.record("read", &unavailable());
        assert!(matches!(
            o.record("watch", &compacted),
            Some(Transition::Restored { failed: 1, .. })
        ));
    }
}
