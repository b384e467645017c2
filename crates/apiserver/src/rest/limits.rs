//! kube-apiserver's global request limits: how many requests may be in flight at once
//! (`--max-requests-inflight`, `--max-mutating-requests-inflight`), and how long a request may
//! take (`--request-timeout`).
//!
//! As kube-apiserver's `WithMaxInFlightLimit` filter: read-only and mutating requests are counted
//! apart, long-running requests (watches) are not counted, and a request over the limit is
//! answered at once with `429` and `Retry-After: 1`, in kube's words ("Too many requests, please
//! try again later.", plain text, as `http.Error` writes it), so that client-go backs off and
//! retries. The health checks are exempt, as API Priority and Fairness exempts them (its `probes`
//! FlowSchema), so that a flooded server still answers its kubelet's probes. kube also exempts
//! the `system:masters` group; this server does not, so a local client flooding it over loopback
//! is limited too.
//!
//! As kube-apiserver's `WithTimeoutForNonLongRunningRequests`: a request that has not been
//! answered within `--request-timeout` (body included: a client that sends its body one byte a
//! second is cut off) gets `504 Timeout`, and its handler is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode, header};
use tokio::sync::Semaphore;

use crate::error::ApiError;

/// The limits' settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// `--max-requests-inflight`: read-only requests served at once; 0 means no limit.
    /// Default 400, kube-apiserver's.
    pub max_requests_inflight: usize,
    /// `--max-mutating-requests-inflight`: mutating requests served at once; 0 means no limit.
    /// Default 200, kube-apiserver's.
    pub max_mutating_requests_inflight: usize,
    /// `--request-timeout`: the longest a request other than a watch may take. Default 60 s,
    /// kube-apiserver's.
    pub request_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_requests_inflight: 400,
            max_mutating_requests_inflight: 200,
            request_timeout: Duration::from_secs(60),
        }
    }
}

/// The limits in force, and what they count (shared by every connection).
#[derive(Debug)]
pub struct Limits {
    config: Config,
    read_only: Option<Arc<Semaphore>>,
    mutating: Option<Arc<Semaphore>>,
    /// Read-only requests being served now.
    read_only_inflight: AtomicI64,
    /// Mutating requests being served now.
    mutating_inflight: AtomicI64,
    /// Open watches (kube's `apiserver_registered_watchers`).
    watchers: AtomicI64,
    /// Watches closed because their client stopped reading.
    unresponsive_watchers: AtomicI64,
}

impl Limits {
    /// Limits as `config` says.
    pub fn new(config: Config) -> Self {
        let semaphore = |n: usize| (n > 0).then(|| Arc::new(Semaphore::new(n)));
        Limits {
            read_only: semaphore(config.max_requests_inflight),
            mutating: semaphore(config.max_mutating_requests_inflight),
            config,
            read_only_inflight: AtomicI64::new(0),
            mutating_inflight: AtomicI64::new(0),
            watchers: AtomicI64::new(0),
            unresponsive_watchers: AtomicI64::new(0),
        }
    }

    /// Counts an open watch until the returned guard is dropped.
    pub fn watcher(self: &Arc<Self>) -> WatcherGuard {
        self.watchers.fetch_add(1, Ordering::Relaxed);
        WatcherGuard {
            limits: self.clone(),
        }
    }

    /// Counts a watch closed because its client stopped reading.
    pub fn unresponsive_watcher_closed(&self) {
        self.unresponsive_watchers.fetch_add(1, Ordering::Relaxed);
    }

    /// The limits' metrics, in the Prometheus text format, with kube-apiserver's names where it
    /// has them.
    pub fn metrics(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP apiserver_current_inflight_requests Maximal number of currently used inflight request limit of this apiserver per request kind in last second.\n# TYPE apiserver_current_inflight_requests gauge\n",
        );
        out.push_str(&format!(
            "apiserver_current_inflight_requests{{request_kind=\"readOnly\"}} {}\n",
            self.read_only_inflight.load(Ordering::Relaxed)
        ));
        out.push_str(&format!(
            "apiserver_current_inflight_requests{{request_kind=\"mutating\"}} {}\n",
            self.mutating_inflight.load(Ordering::Relaxed)
        ));
        out.push_str(
            "# HELP apiserver_registered_watchers Number of currently registered watchers.\n# TYPE apiserver_registered_watchers gauge\n",
        );
        out.push_str(&format!(
            "apiserver_registered_watchers {}\n",
            self.watchers.load(Ordering::Relaxed)
        ));
        out.push_str(
            "# HELP nodeport_apiserver_unresponsive_watchers_closed_total Watches closed because their client stopped reading.\n# TYPE nodeport_apiserver_unresponsive_watchers_closed_total counter\n",
        );
        out.push_str(&format!(
            "nodeport_apiserver_unresponsive_watchers_closed_total {}\n",
            self.unresponsive_watchers.load(Ordering::Relaxed)
        ));
        out
    }
}

/// An open watch, counted in [`Limits`] until dropped.
#[derive(Debug)]
pub struct WatcherGuard {
    limits: Arc<Limits>,
}

impl Drop for WatcherGuard {
    fn drop(&mut self) {
        self.limits.watchers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether a request is long-running: a watch (`?watch=true` or a `/watch/` path), which kube
/// neither counts in flight nor times out.
fn long_running(request: &Request) -> bool {
    let watch_query = request.uri().query().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "watch" || p == "watch=true" || p == "watch=1")
    });
    watch_query || request.uri().path().contains("/watch/")
}

/// The health checks, exempt from the in-flight limits.
fn probe(request: &Request) -> bool {
    matches!(request.uri().path(), "/healthz" | "/livez" | "/readyz")
}

/// The middleware: counts the request in flight (or refuses it with 429), and bounds its time.
pub async fn limit(State(limits): State<Arc<Limits>>, request: Request, next: Next) -> Response {
    if long_running(&request) {
        return next.run(request).await;
    }
    let permit = if probe(&request) {
        None
    } else {
        let mutating = !matches!(
            *request.method(),
            Method::GET | Method::HEAD | Method::OPTIONS
        );
        let (semaphore, counter) = if mutating {
            (&limits.mutating, &limits.mutating_inflight)
        } else {
            (&limits.read_only, &limits.read_only_inflight)
        };
        let permit = match semaphore {
            Some(semaphore) => match semaphore.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => return too_many_requests(),
            },
            None => None,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Some((permit, counter))
    };
    let response =
        match tokio::time::timeout(limits.config.request_timeout, next.run(request)).await {
            Ok(response) => response,
            Err(_) => ApiError::timeout(
                "request did not complete within requested timeout - context deadline exceeded",
            )
            .into_response(),
        };
    if let Some((_permit, counter)) = permit {
        counter.fetch_sub(1, Ordering::Relaxed);
    }
    response
}

/// kube-apiserver's answer over the limit (`tooManyRequests` in its `maxinflight.go`).
fn too_many_requests() -> Response {
    (
        StatusCode::TOO_MANY_REQUESTS,
        [
            (header::RETRY_AFTER, "1"),
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
        ],
        "Too many requests, please try again later.\n",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(uri: &str) -> Request {
        Request::builder()
            .uri(uri)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    #[test]
    fn watches_are_long_running_and_lists_are_not() {
        assert!(long_running(&request("/api/v1/services?watch=true")));
        assert!(long_running(&request("/api/v1/services?limit=1&watch=1")));
        assert!(long_running(&request("/api/v1/watch/services")));
        assert!(!long_running(&request("/api/v1/services?watch=false")));
        assert!(!long_running(&request("/api/v1/services")));
    }

    /// Read-only requests have their own limit: two slow reads fill it, a third read gets 429,
    /// while a write and the health checks still go through.
    #[tokio::test]
    async fn reads_over_their_limit_get_429_while_writes_and_probes_go_through() {
        use tower::ServiceExt;
        let limits = Arc::new(Limits::new(Config {
            max_requests_inflight: 2,
            max_mutating_requests_inflight: 2,
            request_timeout: Duration::from_secs(30),
        }));
        let gate = Arc::new(Semaphore::new(0));
        let wait = gate.clone();
        let app = axum::Router::new()
            .route(
                "/slow",
                axum::routing::get(move || {
                    let wait = wait.clone();
                    async move {
                        let _ = wait.acquire().await;
                    }
                }),
            )
            .route("/fast", axum::routing::get(|| async {}).post(|| async {}))
            .route("/readyz", axum::routing::get(|| async {}))
            .layer(axum::middleware::from_fn_with_state(limits.clone(), limit));
        let call = |method: Method, uri: &str| {
            let app = app.clone();
            let request = Request::builder()
                .method(method)
                .uri(uri)
                .body(axum::body::Body::empty())
                .unwrap();
            async move { app.oneshot(request).await.unwrap().status() }
        };
        let slow: Vec<_> = (0..2)
            .map(|_| tokio::spawn(call(Method::GET, "/slow")))
            .collect();
        while limits.read_only_inflight.load(Ordering::Relaxed) < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            call(Method::GET, "/fast").await,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(call(Method::POST, "/fast").await, StatusCode::OK);
        assert_eq!(call(Method::GET, "/readyz").await, StatusCode::OK);
        assert_eq!(call(Method::GET, "/fast?watch=true").await, StatusCode::OK);
        gate.add_permits(2);
        for s in slow {
            assert_eq!(s.await.unwrap(), StatusCode::OK);
        }
        assert_eq!(call(Method::GET, "/fast").await, StatusCode::OK);
    }

    #[test]
    fn zero_means_no_limit_as_in_kube() {
        let limits = Limits::new(Config {
            max_requests_inflight: 0,
            max_mutating_requests_inflight: 3,
            ..Config::default()
        });
        assert!(limits.read_only.is_none());
        assert_eq!(limits.mutating.as_ref().unwrap().available_permits(), 3);
    }
}
