//! Namespace deletion, as kube-apiserver and kube-controller-manager's namespace controller do it.
//!
//! 1. `DELETE /api/v1/namespaces/<ns>` sets `metadata.deletionTimestamp` and `status.phase:
//!    Terminating` and answers 200 with that object; the namespace keeps its `kubernetes`
//!    finalizer (`spec.finalizers`), so it is not removed yet.
//! 2. While the namespace is Terminating, creating anything in it is refused with 403
//!    (`NamespaceLifecycle` admission: `unable to create new content in namespace <ns> because it is
//!    being terminated`). The check reads the namespace in the same transaction as the create, so
//!    no create can slip in after the phase changed.
//! 3. The namespace controller (here: a task of the API server that took the DELETE, and a sweep
//!    at start and every [`SYNC_PERIOD`] on every API server, so a Terminating namespace left by a
//!    replica that died is finished by another) deletes the contents one object per request, as
//!    `deletecollection` does. The writer groups those requests into transactions that fit the
//!    backend (etcd takes at most 128 operations in one), and each Service's removal commits with
//!    the release of its ports and addresses.
//! 4. When nothing is left it removes the `kubernetes` finalizer; with no finalizer left the
//!    namespace is deleted (kube-apiserver's `ShouldDeleteNamespaceDuringUpdate`). Other
//!    finalizers keep it Terminating until a client removes them through
//!    `PUT /api/v1/namespaces/<ns>/finalize`.
//!
//! `kubectl delete namespace` prints `namespace "<ns>" deleted` and waits until the namespace is
//! gone, as against kube-apiserver.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, NamespaceSpec, NamespaceStatus};
use serde_json::Value;
use tracing::Instrument;

use super::object::Object;
use super::{
    Preconditions, Registry, WriteOptions, check_preconditions, decode_stored, encode_stored,
    finish, now, typed_from_entry,
};
use crate::error::{ApiError, FieldError, GoValue};
use crate::resource::Kind;
use crate::storage::ListRequest;

/// The finalizer kube-apiserver puts on every namespace; the namespace controller removes it once
/// the namespace is empty.
pub const FINALIZER: &str = "kubernetes";

/// `status.phase` of a namespace that is being deleted.
pub const TERMINATING: &str = "Terminating";

/// How often every API server looks for Terminating namespaces to finish (kube-controller-manager's
/// `--namespace-sync-period` default, 5 minutes). A DELETE starts the work at once; the sweep only
/// picks up namespaces whose deletion an API server left unfinished (it died, or storage failed).
pub const SYNC_PERIOD: Duration = Duration::from_secs(300);

/// Most deletes of one namespace's contents, or of one `deletecollection`, in flight at once. The
/// writer commits them in batches that fit the backend.
pub const DELETE_CONCURRENCY: usize = 256;

/// The longest wait between attempts to finish a namespace after a failure.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Namespaces this API server is finishing now (so that a DELETE and the sweep do not start two
/// tasks for one namespace).
#[derive(Default)]
pub struct InProgress(Mutex<HashSet<String>>);

#[derive(serde::Deserialize)]
struct PhaseOnly {
    status: Option<PhaseStatus>,
}

#[derive(serde::Deserialize)]
struct PhaseStatus {
    phase: Option<String>,
}

#[derive(serde::Deserialize)]
struct DeletionOnly {
    metadata: Option<DeletionMeta>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeletionMeta {
    deletion_timestamp: Option<serde_json::Value>,
    #[serde(default)]
    finalizers: Vec<String>,
}

/// Whether a stored object was deleted and waits for its finalizers.
fn is_being_deleted(stored: &[u8]) -> bool {
    serde_json::from_slice::<DeletionOnly>(stored)
        .ok()
        .and_then(|o| o.metadata)
        .is_some_and(|m| {
            m.deletion_timestamp.is_some_and(|t| !t.is_null()) && !m.finalizers.is_empty()
        })
}

/// Whether a stored namespace is being deleted.
pub fn is_terminating(stored: &[u8]) -> bool {
    serde_json::from_slice::<PhaseOnly>(stored)
        .ok()
        .and_then(|ns| ns.status?.phase)
        .is_some_and(|phase| phase == TERMINATING)
}

/// The `NamespaceLifecycle` admission error for a create in a Terminating namespace: 403 with the
/// `NamespaceTerminating` cause, as kube-apiserver words it.
pub fn terminating_error(kind: Kind, name: &str, namespace: &str) -> ApiError {
    ApiError::forbidden(
        kind.subject(),
        name,
        &format!(
            "unable to create new content in namespace {namespace} because it is being terminated"
        ),
    )
    .with_cause(
        "NamespaceTerminating",
        format!("namespace {namespace} is being terminated"),
        "metadata.namespace",
    )
}

/// `validateFinalizerName` on `spec.finalizers`: a finalizer without a domain must be one of the
/// standard ones.
pub fn validate_finalizers(namespace: &Namespace) -> Vec<FieldError> {
    let mut errs = Vec::new();
    for name in namespace
        .spec
        .as_ref()
        .and_then(|s| s.finalizers.as_ref())
        .into_iter()
        .flatten()
    {
        if !super::validation::is_kube_finalizer_name(name) {
            errs.push(FieldError::invalid(
                "spec.finalizers",
                GoValue::Str(name),
                super::validation::NOT_QUALIFIED_FINALIZER,
            ));
        }
    }
    errs
}

/// The namespace's `spec.finalizers`.
pub(super) fn finalizers(namespace: &Namespace) -> &[String] {
    namespace
        .spec
        .as_ref()
        .and_then(|s| s.finalizers.as_deref())
        .unwrap_or(&[])
}

/// Whether finalizers still hold the namespace: `spec.finalizers` (the namespace controller's)
/// or `metadata.finalizers` (anyone's, as for every kind).
pub(super) fn held(namespace: &Namespace) -> bool {
    !finalizers(namespace).is_empty()
        || namespace
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| !f.is_empty())
}

/// What a namespace DELETE did.
enum Deletion {
    /// The namespace is Terminating (now or already) and its finalizers are pending.
    Terminating,
    /// The namespace had no finalizer left and was removed.
    Removed,
}

impl Registry {
    /// `DELETE` of a namespace (kube-apiserver's namespace `REST.Delete`): the first request marks
    /// it Terminating and starts the namespace controller's work; a later one, once no finalizer
    /// is left, removes it. Returns the namespace as it now is.
    pub(super) async fn delete_namespace(
        &self,
        name: &str,
        preconditions: Preconditions,
        options: WriteOptions,
    ) -> Result<Value, ApiError> {
        let key = self.namespace_key(name);
        let owned = name.to_owned();
        let done = self
            .store
            .mutate(vec![key.clone()], move |txn| {
                let name = owned.as_str();
                let Some(old) = txn.get(&key) else {
                    return Err(ApiError::not_found(Kind::Namespace.subject(), name));
                };
                let old_value = decode_stored(&old.value, old.mod_revision)?;
                check_preconditions(
                    Kind::Namespace,
                    name,
                    &old_value,
                    old.mod_revision,
                    &preconditions,
                )?;
                let Object::Namespace(mut ns) = typed_from_entry(Kind::Namespace, &old.value)?
                else {
                    return Err(ApiError::internal("stored namespace is not a Namespace"));
                };
                if options.dry_run {
                    txn.set_dry_run();
                }
                if ns.metadata.deletion_timestamp.is_none()
                    || ns.status.as_ref().and_then(|s| s.phase.as_deref()) != Some(TERMINATING)
                {
                    ns.metadata.deletion_timestamp.get_or_insert_with(now);
                    ns.status.get_or_insert_with(NamespaceStatus::default).phase =
                        Some(TERMINATING.to_owned());
                    let object = Object::Namespace(ns);
                    txn.put(key.clone(), encode_stored(&object));
                    return Ok((object.to_value(), Deletion::Terminating));
                }
                if held(&ns) {
                    return Ok((old_value, Deletion::Terminating));
                }
                txn.delete(key.clone());
                Ok((old_value, Deletion::Removed))
            })
            .await?;
        let revision = done.revision;
        let (object, deletion) = done.value;
        if matches!(deletion, Deletion::Terminating) && !options.dry_run {
            self.finish_namespace_in_background(name.to_owned());
        }
        Ok(finish(
            crate::store::Done {
                value: object,
                revision,
            },
            Vec::new(),
            false,
        )
        .object)
    }

    /// `PUT /api/v1/namespaces/<ns>/finalize`: sets `spec.finalizers` (and nothing else, as
    /// kube-apiserver's finalize strategy). A Terminating namespace left with no finalizer is
    /// removed.
    pub async fn finalize_namespace(
        &self,
        name: &str,
        body: Value,
        options: WriteOptions,
    ) -> Result<Value, ApiError> {
        let (object, _) = Self::decode_body(Kind::Namespace, body, options.field_validation)?;
        let Object::Namespace(new) = object else {
            return Err(ApiError::internal("decoded namespace is not a Namespace"));
        };
        if new.metadata.name.as_deref().is_some_and(|n| n != name) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                new.metadata.name.as_deref().unwrap_or("")
            )));
        }
        let errs = validate_finalizers(&new);
        if !errs.is_empty() {
            return Err(ApiError::invalid(Kind::Namespace.subject(), name, errs));
        }
        let wanted = finalizers(&new).to_vec();
        let expected_rv = new
            .metadata
            .resource_version
            .clone()
            .filter(|rv| !rv.is_empty());
        let key = self.namespace_key(name);
        let owned = name.to_owned();
        let done = self
            .store
            .mutate(vec![key.clone()], move |txn| {
                let name = owned.as_str();
                let Some(old) = txn.get(&key) else {
                    return Err(ApiError::not_found(Kind::Namespace.subject(), name));
                };
                if let Some(rv) = &expected_rv
                    && *rv != old.mod_revision.to_string()
                {
                    return Err(ApiError::modified(Kind::Namespace.subject(), name));
                }
                let Object::Namespace(mut ns) = typed_from_entry(Kind::Namespace, &old.value)?
                else {
                    return Err(ApiError::internal("stored namespace is not a Namespace"));
                };
                ns.spec
                    .get_or_insert_with(NamespaceSpec::default)
                    .finalizers = (!wanted.is_empty()).then(|| wanted.clone());
                if options.dry_run {
                    txn.set_dry_run();
                }
                let mut object = Object::Namespace(ns.clone());
                // kube-apiserver's field manager on the `finalize` subresource
                // (`k8s.io/apiserver/pkg/endpoints/installer.go` gives every subresource's
                // field manager its name; the finalize strategy resets `status` only): an
                // Update entry with `subresource: finalize` for what it added or changed.
                super::record_update_through(
                    Kind::Namespace,
                    Some(&super::decode_stored(&old.value, 0)?),
                    &mut object,
                    &options.manager,
                    "finalize",
                );
                if ns.metadata.deletion_timestamp.is_some() && !held(&ns) {
                    txn.delete(key.clone());
                    return Ok((object.to_value(), old.mod_revision));
                }
                let encoded = encode_stored(&object);
                if encoded != old.value {
                    txn.put(key.clone(), encoded);
                }
                Ok((object.to_value(), old.mod_revision))
            })
            .await?;
        let (mut object, old_revision) = done.value;
        super::set_resource_version(&mut object, done.revision.unwrap_or(old_revision));
        Ok(object)
    }

    /// Finishes the deletion of `name` in a task of its own, retrying until it is done (unless
    /// this API server is already doing it).
    pub fn finish_namespace_in_background(&self, name: String) {
        if !self
            .finalizing
            .0
            .lock()
            .expect("in-progress lock")
            .insert(name.clone())
        {
            return;
        }
        let this = self.clone();
        let span = tracing::info_span!("namespace_controller", namespace = %name);
        tokio::spawn(
            async move {
                let mut pause = Duration::from_secs(1);
                let mut failures = 0u32;
                loop {
                    match this.finish_namespace(&name).await {
                        Ok(()) => break,
                        Err(err) => {
                            failures += 1;
                            // Once when it starts failing; the storage logs its own outages.
                            if failures == 1 {
                                tracing::warn!(error = %err, "namespace deletion not finished; retrying");
                            } else {
                                tracing::debug!(error = %err, failures, "namespace deletion not finished; retrying");
                            }
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(RETRY_MAX);
                        }
                    }
                }
                this.finalizing
                    .0
                    .lock()
                    .expect("in-progress lock")
                    .remove(&name);
            }
            .instrument(span),
        );
    }

    /// Starts finishing every Terminating namespace (at start, then every [`SYNC_PERIOD`]).
    pub async fn sweep_terminating_namespaces(&self) -> Result<usize, ApiError> {
        let page = self
            .store
            .backend()
            .list(ListRequest {
                prefix: Kind::Namespace.list_prefix(self.store.prefix(), None),
                start: None,
                revision: None,
                limit: None,
            })
            .await?;
        let mut started = 0;
        for kv in &page.kvs {
            if is_terminating(&kv.value)
                && let Some(name) = kv.key.rsplit('/').next()
            {
                self.finish_namespace_in_background(name.to_owned());
                started += 1;
            }
        }
        Ok(started)
    }

    /// The namespace controller's work for one namespace: delete what it holds, then remove the
    /// `kubernetes` finalizer (and with it the namespace, if no other finalizer is left). Done
    /// when the namespace is gone, not Terminating, or waits only for other finalizers.
    pub async fn finish_namespace(&self, name: &str) -> Result<(), ApiError> {
        let ns = match self.get(Kind::Namespace, None, name).await {
            Ok(value) => value,
            Err(err) if err.code() == 404 => return Ok(()),
            Err(err) => return Err(err),
        };
        let Object::Namespace(ns) = Object::decode(Kind::Namespace, &ns)?.object else {
            return Err(ApiError::internal("stored namespace is not a Namespace"));
        };
        if ns.metadata.deletion_timestamp.is_none() {
            return Ok(());
        }
        if finalizers(&ns).iter().any(|f| f == FINALIZER) {
            self.delete_namespace_contents(name).await?;
        }
        // Remove our finalizer; with none left the namespace goes.
        let key = self.namespace_key(name);
        self.store
            .mutate(vec![key.clone()], move |txn| {
                let Some(old) = txn.get(&key) else {
                    return Ok(());
                };
                let Object::Namespace(mut ns) = typed_from_entry(Kind::Namespace, &old.value)?
                else {
                    return Err(ApiError::internal("stored namespace is not a Namespace"));
                };
                if ns.metadata.deletion_timestamp.is_none() {
                    return Ok(());
                }
                let spec = ns.spec.get_or_insert_with(NamespaceSpec::default);
                spec.finalizers = Some(
                    spec.finalizers
                        .iter()
                        .flatten()
                        .filter(|f| *f != FINALIZER)
                        .cloned()
                        .collect(),
                );
                if !held(&ns) {
                    txn.delete(key.clone());
                    return Ok(());
                }
                let encoded = encode_stored(&Object::Namespace(ns));
                if encoded != old.value {
                    txn.put(key.clone(), encoded);
                }
                Ok(())
            })
            .await?;
        Ok(())
    }

    /// Deletes every Service, Endpoints, EndpointSlice and Event in `namespace`, until a listing
    /// finds none. Nothing new can appear: creates are refused while the namespace is Terminating.
    async fn delete_namespace_contents(&self, namespace: &str) -> Result<(), ApiError> {
        for _round in 0..10 {
            let (mut found, mut pending) = (0, 0);
            for kind in [
                Kind::Service,
                Kind::Endpoints,
                Kind::EndpointSlice,
                Kind::Event,
            ] {
                let page = self
                    .store
                    .backend()
                    .list(ListRequest {
                        prefix: kind.list_prefix(self.store.prefix(), Some(namespace)),
                        start: None,
                        revision: None,
                        limit: None,
                    })
                    .await?;
                // Objects already deleted wait for their finalizers (some controller's work);
                // the namespace waits with them, as kube's namespace controller does.
                let (waiting, fresh): (Vec<_>, Vec<_>) =
                    page.kvs.iter().partition(|kv| is_being_deleted(&kv.value));
                pending += waiting.len();
                let targets: Vec<(Option<String>, String)> = fresh
                    .iter()
                    .filter_map(|kv| kv.key.rsplit('/').next())
                    .map(|name| (Some(namespace.to_owned()), name.to_owned()))
                    .collect();
                found += targets.len();
                for result in self
                    .delete_each(kind, targets, WriteOptions::default())
                    .await
                {
                    match result {
                        Ok(_) => {}
                        Err(err) if err.code() == 404 => {}
                        Err(err) => return Err(err),
                    }
                }
            }
            if found == 0 && pending == 0 {
                return Ok(());
            }
            if found == 0 {
                return Err(ApiError::unavailable(format!(
                    "namespace {namespace} waits for {pending} objects whose finalizers are not yet removed"
                )));
            }
        }
        Err(ApiError::internal(format!(
            "content of namespace {namespace} keeps reappearing"
        )))
    }

    /// Deletes the named objects (namespace, name) one request each (kube-apiserver's
    /// `DeleteCollection` does the same), up to [`DELETE_CONCURRENCY`] at a time; the results are
    /// in the order of `targets`.
    pub(super) async fn delete_each(
        &self,
        kind: Kind,
        targets: Vec<(Option<String>, String)>,
        options: WriteOptions,
    ) -> Vec<Result<Value, ApiError>> {
        futures::stream::iter(targets)
            .map(|(namespace, name)| {
                let options = options.clone();
                async move {
                    self.delete(
                        kind,
                        namespace.as_deref(),
                        &name,
                        Preconditions::default(),
                        options,
                    )
                    .await
                }
            })
            .buffered(DELETE_CONCURRENCY)
            .collect()
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_phase_is_read_from_the_stored_namespace() {
        assert!(is_terminating(
            br#"{"metadata":{"name":"a"},"status":{"phase":"Terminating"}}"#
        ));
        assert!(!is_terminating(
            br#"{"metadata":{"name":"a"},"status":{"phase":"Active"}}"#
        ));
        assert!(!is_terminating(br#"{"metadata":{"name":"a"}}"#));
    }

    #[test]
    fn a_create_in_a_terminating_namespace_is_forbidden_with_kubes_cause() {
        let status = terminating_error(Kind::Service, "web", "team").to_status();
        assert_eq!(status["code"], 403);
        assert_eq!(status["reason"], "Forbidden");
        assert_eq!(
            status["message"],
            "services \"web\" is forbidden: unable to create new content in namespace team because it is being terminated"
        );
        assert_eq!(
            status["details"]["causes"][0],
            serde_json::json!({"reason":"NamespaceTerminating","message":"namespace team is being terminated","field":"metadata.namespace"})
        );
    }
}
