//! The RBAC policy in memory, kept in step with the store by a list and a watch of the four RBAC
//! kinds (kube-apiserver's RBAC authorizer reads informers the same way), and the ClusterRole
//! aggregation controller (kube-controller-manager's `clusterrole-aggregation`), which writes
//! the union of the matching roles' rules into every ClusterRole with an `aggregationRule`.
//!
//! A write to an RBAC kind through this server waits, before it is answered, until the cache
//! has seen it (see [`PolicyCache::caught_up`]), so that the client's next request is judged by
//! it; another API server on the same etcd sees it as soon as its watch delivers it.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde_json::Value;

use super::rbac::{Binding, ClusterRoleEntry, Policy, RoleKind, Rule};
use crate::registry::{Registry, WriteOptions};
use crate::resource::Kind;
use crate::storage::{self, Backend, EventKind, ListRequest, Revision, WatchItem};

/// The four RBAC kinds, in the order of [`PolicyCache`]'s revision slots.
const KINDS: [Kind; 4] = [
    Kind::Role,
    Kind::ClusterRole,
    Kind::RoleBinding,
    Kind::ClusterRoleBinding,
];

/// How long a write to an RBAC kind waits for the cache before it is answered anyway.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(3);

struct Inner {
    policy: RwLock<Policy>,
    /// Per kind: every change up to this revision is in `policy`.
    applied: [AtomicI64; 4],
    /// Bumped after every change to `policy` or `applied`.
    changed: tokio::sync::watch::Sender<u64>,
    /// The backend, to learn the revision a write reached.
    backend: RwLock<Option<Arc<dyn Backend>>>,
}

/// The RBAC objects in memory, shared by the authorizer, the access reviews and the escalation
/// checks.
#[derive(Clone)]
pub struct PolicyCache {
    inner: Arc<Inner>,
}

impl Default for PolicyCache {
    fn default() -> Self {
        PolicyCache {
            inner: Arc::new(Inner {
                policy: RwLock::new(Policy::default()),
                applied: Default::default(),
                changed: tokio::sync::watch::channel(0).0,
                backend: RwLock::new(None),
            }),
        }
    }
}

/// The namespace and name of a stored key under the kind's list prefix.
fn key_parts(kind: Kind, list_prefix: &str, key: &str) -> Option<(String, String)> {
    let rest = key.strip_prefix(list_prefix)?;
    if kind.namespaced() {
        let (ns, name) = rest.split_once('/')?;
        Some((ns.to_owned(), name.to_owned()))
    } else {
        Some((String::new(), rest.to_owned()))
    }
}

fn rules_of(rules: Option<&Vec<k8s_openapi::api::rbac::v1::PolicyRule>>) -> Arc<[Rule]> {
    rules
        .map(|r| r.iter().map(Rule::from).collect::<Vec<_>>())
        .unwrap_or_default()
        .into()
}

fn binding(
    name: &str,
    role_ref: &k8s_openapi::api::rbac::v1::RoleRef,
    subjects: Option<&Vec<k8s_openapi::api::rbac::v1::Subject>>,
) -> Binding {
    Binding {
        name: name.to_owned(),
        role_kind: if role_ref.kind == "Role" {
            RoleKind::Role
        } else {
            RoleKind::ClusterRole
        },
        role_name: role_ref.name.clone(),
        subjects: subjects.cloned().unwrap_or_default(),
    }
}

/// Puts a stored object into the policy (a value that does not decode is left out, logged).
fn put(policy: &mut Policy, kind: Kind, ns: String, name: String, value: &[u8]) {
    let decoded = match kind {
        Kind::Role => serde_json::from_slice::<Role>(value).map(|r| {
            policy
                .roles
                .entry(ns.clone())
                .or_default()
                .insert(name.clone(), rules_of(r.rules.as_ref()));
        }),
        Kind::ClusterRole => serde_json::from_slice::<ClusterRole>(value).map(|r| {
            let entry = ClusterRoleEntry {
                rules: rules_of(r.rules.as_ref()),
                labels: r.metadata.labels.clone().unwrap_or_default(),
                aggregation: r
                    .aggregation_rule
                    .as_ref()
                    .map(|a| a.cluster_role_selectors.clone().unwrap_or_default()),
            };
            policy.cluster_roles.insert(name.clone(), entry);
        }),
        Kind::RoleBinding => serde_json::from_slice::<RoleBinding>(value).map(|b| {
            policy.role_bindings.entry(ns.clone()).or_default().insert(
                name.clone(),
                binding(&name, &b.role_ref, b.subjects.as_ref()),
            );
        }),
        Kind::ClusterRoleBinding => serde_json::from_slice::<ClusterRoleBinding>(value).map(|b| {
            policy.cluster_role_bindings.insert(
                name.clone(),
                binding(&name, &b.role_ref, b.subjects.as_ref()),
            );
        }),
        _ => Ok(()),
    };
    if let Err(err) = decoded {
        tracing::warn!(kind = kind.kind(), namespace = %ns, name = %name, error = %err, "stored RBAC object does not decode; left out of the policy");
    }
}

fn remove(policy: &mut Policy, kind: Kind, ns: &str, name: &str) {
    match kind {
        Kind::Role => {
            if let Some(m) = policy.roles.get_mut(ns) {
                m.remove(name);
            }
        }
        Kind::ClusterRole => {
            policy.cluster_roles.remove(name);
        }
        Kind::RoleBinding => {
            if let Some(m) = policy.role_bindings.get_mut(ns) {
                m.remove(name);
            }
        }
        Kind::ClusterRoleBinding => {
            policy.cluster_role_bindings.remove(name);
        }
        _ => {}
    }
}

impl PolicyCache {
    /// Runs `f` over the current policy.
    pub fn read<T>(&self, f: impl FnOnce(&Policy) -> T) -> T {
        f(&self.inner.policy.read().expect("not poisoned"))
    }

    fn bump(&self) {
        self.inner.changed.send_modify(|g| *g += 1);
    }

    fn advance(&self, index: usize, revision: Revision) {
        self.inner.applied[index].fetch_max(revision, Ordering::SeqCst);
    }

    /// Waits until the cache has every change of the RBAC `resource` (`roles`, ...) that the
    /// store holds now, or [`CATCH_UP_TIMEOUT`].
    pub async fn caught_up(&self, resource: &str) {
        let Some(index) = KINDS.iter().position(|k| k.resource() == resource) else {
            return;
        };
        let backend = self.inner.backend.read().expect("not poisoned").clone();
        let Some(backend) = backend else { return };
        let Ok(target) = backend.current_revision().await else {
            return;
        };
        let mut changed = self.inner.changed.subscribe();
        let wait = async {
            while self.inner.applied[index].load(Ordering::SeqCst) < target {
                if changed.changed().await.is_err() {
                    return;
                }
            }
        };
        if tokio::time::timeout(CATCH_UP_TIMEOUT, wait).await.is_err() {
            tracing::debug!(resource, target, "RBAC cache did not catch up in time");
        }
    }

    /// Loads the RBAC objects from the registry's store, then follows them (and aggregates
    /// ClusterRoles) for as long as the runtime runs. Returns once the first load is in.
    pub async fn start(&self, registry: Registry) {
        *self.inner.backend.write().expect("not poisoned") =
            Some(registry.store().backend().clone());
        let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel();
        let cache = self.clone();
        let follow = async move {
            let mut loaded = Some(loaded_tx);
            let mut failing = false;
            loop {
                match cache.sync(&registry, &mut loaded).await {
                    Ok(()) => failing = false,
                    Err(err) => {
                        if !failing {
                            tracing::warn!(error = %crate::report(&err), "RBAC policy watch failed; listing again");
                        }
                        failing = true;
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        };
        tokio::spawn(tracing::Instrument::instrument(
            follow,
            tracing::info_span!("rbac_cache"),
        ));
        let _ = loaded_rx.await;
    }

    async fn sync(
        &self,
        registry: &Registry,
        loaded: &mut Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Result<(), storage::Error> {
        let backend = registry.store().backend().clone();
        let prefix = registry.store().prefix().to_owned();
        let revision = backend.current_revision().await?;
        let mut policy = Policy::default();
        for kind in KINDS {
            let list_prefix = kind.list_prefix(&prefix, None);
            let page = backend
                .list(ListRequest {
                    prefix: list_prefix.clone(),
                    start: None,
                    revision: Some(revision),
                    limit: None,
                })
                .await?;
            for kv in &page.kvs {
                if let Some((ns, name)) = key_parts(kind, &list_prefix, &kv.key) {
                    put(&mut policy, kind, ns, name, &kv.value);
                }
            }
        }
        let mut streams = Vec::new();
        for (index, kind) in KINDS.into_iter().enumerate() {
            let stream = backend
                .watch(kind.list_prefix(&prefix, None), revision)
                .await?;
            streams.push(stream.map(move |item| (index, item)).boxed());
        }
        *self.inner.policy.write().expect("not poisoned") = policy;
        for index in 0..KINDS.len() {
            self.advance(index, revision);
        }
        self.bump();
        self.aggregate(registry).await;
        if let Some(tx) = loaded.take() {
            let _ = tx.send(());
        }
        let mut merged = futures::stream::select_all(streams);
        while let Some((index, item)) = merged.next().await {
            let kind = KINDS[index];
            match item? {
                WatchItem::Event(event) => {
                    let list_prefix = kind.list_prefix(&prefix, None);
                    if let Some((ns, name)) = key_parts(kind, &list_prefix, &event.kv.key) {
                        let mut policy = self.inner.policy.write().expect("not poisoned");
                        match event.kind {
                            EventKind::Put => put(&mut policy, kind, ns, name, &event.kv.value),
                            EventKind::Delete => remove(&mut policy, kind, &ns, &name),
                        }
                    }
                    self.advance(index, event.kv.mod_revision);
                    if kind == Kind::ClusterRole {
                        self.aggregate(registry).await;
                    }
                }
                WatchItem::Progress(revision) => self.advance(index, revision),
            }
            self.bump();
        }
        Ok(())
    }

    /// Writes the aggregated rules into every ClusterRole with an `aggregationRule` whose stored
    /// rules differ from them.
    async fn aggregate(&self, registry: &Registry) {
        let stale: Vec<(String, Vec<Rule>)> = self.read(|policy| {
            let mut names: Vec<&String> = policy
                .cluster_roles
                .iter()
                .filter(|(_, e)| e.aggregation.is_some())
                .map(|(n, _)| n)
                .collect();
            names.sort();
            names
                .into_iter()
                .filter_map(|name| {
                    let rules = policy.aggregated_rules(name)?;
                    (rules[..] != policy.cluster_roles[name].rules[..])
                        .then(|| (name.clone(), rules))
                })
                .collect()
        });
        for (name, rules) in stale {
            if let Err(err) = write_rules(registry, &name, &rules).await {
                tracing::debug!(role = %name, error = %err, "cannot write the aggregated rules yet");
            }
        }
    }
}

/// Replaces the `rules` of ClusterRole `name`, at the resourceVersion read (a lost race is left
/// to the next change).
async fn write_rules(
    registry: &Registry,
    name: &str,
    rules: &[Rule],
) -> Result<(), crate::error::ApiError> {
    let mut object = registry.get(Kind::ClusterRole, None, name).await?;
    let rules: Vec<Value> = rules
        .iter()
        .map(|r| serde_json::to_value(r.to_policy_rule()).expect("rules serialize"))
        .collect();
    object["rules"] = Value::Array(rules);
    registry
        .update(
            Kind::ClusterRole,
            None,
            name,
            false,
            object,
            WriteOptions::default(),
        )
        .await?;
    tracing::info!(role = %name, "aggregated ClusterRole rules updated");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn keys_split_into_namespace_and_name() {
        assert_eq!(
            key_parts(
                Kind::RoleBinding,
                "/registry/rolebindings/",
                "/registry/rolebindings/ns/rb"
            ),
            Some(("ns".into(), "rb".into()))
        );
        assert_eq!(
            key_parts(
                Kind::ClusterRole,
                "/registry/clusterroles/",
                "/registry/clusterroles/system:a/b"
            ),
            Some((String::new(), "system:a/b".into()))
        );
    }

    #[test]
    fn an_aggregated_role_gets_the_rules_of_the_roles_its_selector_matches() {
        let mut policy = Policy::default();
        let selector = k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
            match_labels: Some(labels(&[("agg", "true")])),
            ..Default::default()
        };
        policy.cluster_roles.insert(
            "agg".into(),
            ClusterRoleEntry {
                aggregation: Some(vec![selector]),
                ..Default::default()
            },
        );
        let rule = Rule {
            verbs: vec!["get".into()],
            api_groups: vec![String::new()],
            resources: vec!["services".into()],
            ..Rule::default()
        };
        for (name, l) in [("a", "true"), ("b", "false")] {
            policy.cluster_roles.insert(
                name.into(),
                ClusterRoleEntry {
                    rules: vec![rule.clone()].into(),
                    labels: labels(&[("agg", l)]),
                    aggregation: None,
                },
            );
        }
        assert_eq!(policy.aggregated_rules("agg"), Some(vec![rule]));
        assert_eq!(policy.aggregated_rules("a"), None);
    }
}
