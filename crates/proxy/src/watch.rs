//! kube-rs watchers on Services, EndpointSlices, ServiceCIDRs and this node's Node.
//!
//! Each object is converted into the compact model the moment it arrives and the Kubernetes
//! object is dropped (no reflector store of full objects). A watch restart (`Init` ..
//! `InitDone`) is a relist: objects it does not list again are deleted. Nothing is synced
//! before every required watcher has finished its first list (kube-proxy waits for
//! `OnServiceSynced` and `OnEndpointSlicesSynced`).

use std::collections::HashSet;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::SystemTime;

use futures::StreamExt;
use kube::Resource;
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;

/// Annotation the EndpointSlice controller sets to the time of the change that triggered
/// the slice update; kube-proxy measures network programming latency from it.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What a watcher feeds.
pub trait Sink<K>: Send + Sync + 'static {
    /// The key of a converted object.
    type Key: Clone + Eq + Hash + Send + Debug;
    /// Converts and records one object (`deleted`: remove it). Returns its key.
    fn apply(&self, obj: &K, deleted: bool) -> Option<Self::Key>;
    /// Removes objects by key (relist found them gone).
    fn remove(&self, keys: Vec<Self::Key>);
    /// Keys known now.
    fn keys(&self) -> Vec<Self::Key>;
    /// The first list (or a relist) is complete.
    fn synced(&self);
}

/// Whether a watcher error is the API server refusing the list or watch (403 Forbidden).
fn forbidden(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 403,
        watcher::Error::WatchError(status) => status.code == 403,
        _ => false,
    }
}

/// Runs a watcher until the stream ends (never, in practice: it retries with backoff). A list
/// or watch the API server refuses (403) is logged at error level and makes the proxy
/// unhealthy (`health`) until a list succeeds again: without it the rules cannot follow the
/// cluster, and carrying on would hide that.
pub async fn run<K, S>(
    api: kube::Api<K>,
    config: watcher::Config,
    sink: Arc<S>,
    what: &'static str,
    health: Arc<crate::health::ProxyHealth>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    S: Sink<K>,
{
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut seen: Option<HashSet<S::Key>> = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => seen = Some(HashSet::new()),
            Ok(watcher::Event::InitApply(obj)) => {
                if let Some(k) = sink.apply(&obj, false)
                    && let Some(s) = seen.as_mut()
                {
                    s.insert(k);
                }
            }
            Ok(watcher::Event::InitDone) => {
                if let Some(s) = seen.take() {
                    let gone: Vec<S::Key> =
                        sink.keys().into_iter().filter(|k| !s.contains(k)).collect();
                    if !gone.is_empty() {
                        sink.remove(gone);
                    }
                }
                tracing::debug!(what, "initial list done");
                health.set_refused(what, false);
                sink.synced();
            }
            Ok(watcher::Event::Apply(obj)) => {
                sink.apply(&obj, false);
            }
            Ok(watcher::Event::Delete(obj)) => {
                sink.apply(&obj, true);
            }
            Err(e) if forbidden(&e) => {
                health.set_refused(what, true);
                tracing::error!(
                    what,
                    error = %e,
                    "the API server refuses to let this proxy list or watch a resource it needs (check the RBAC binding of its user: kube-proxy's is system:node-proxier); unhealthy until allowed"
                );
            }
            Err(e) => tracing::warn!(what, error = %e, "watch failed; retrying"),
        }
    }
}

/// The trigger time of an EndpointSlice change, if annotated.
pub fn trigger_time(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Option<SystemTime> {
    let value = meta.annotations.as_ref()?.get(TRIGGER_TIME_ANNOTATION)?;
    let ts: jiff::Timestamp = value.parse().ok()?;
    Some(SystemTime::from(ts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("services is forbidden", "Forbidden")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn a_403_on_list_or_watch_is_a_refusal_and_other_failures_are_not() {
        assert!(forbidden(&watcher::Error::InitialListFailed(api_error(
            403
        ))));
        assert!(forbidden(&watcher::Error::WatchStartFailed(api_error(403))));
        assert!(forbidden(&watcher::Error::WatchFailed(api_error(403))));
        assert!(!forbidden(&watcher::Error::InitialListFailed(api_error(
            500
        ))));
        assert!(!forbidden(&watcher::Error::NoResourceVersion));
    }
}
