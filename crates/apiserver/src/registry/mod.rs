//! The registry: kube-apiserver's generic `Store` for the served kinds, over [`crate::store`].
//!
//! Reads come straight from the backend. Every write is one [`Store::mutate`] closure that reads
//! the object (and, for Services, the allocators), applies kube-apiserver's steps in its order
//! (metadata, defaulting, allocation, `PrepareForUpdate`, validation, preconditions) and writes
//! the result, so the check-then-write is atomic and the allocation is part of the same commit.
//!
//! Objects are stored as JSON without `metadata.resourceVersion`; on every read the key's
//! `mod_revision` is written into it, as kube-apiserver's etcd3 store does.

pub mod event;
pub mod gvk;
pub mod ip_addresses;
pub mod ip_families;
pub mod kinds;
pub mod managed_fields;
pub mod master_leases;
pub mod namespace;
pub mod net_validation;
pub mod object;
pub mod patch;
pub mod selector;
pub mod service;
pub mod service_cidr;
pub mod validation;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use base64::Engine;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use rand::RngExt;
use serde_json::{Value, json};

use self::object::Object;
use self::selector::{FieldSelector, LabelSelector};
use self::service::ServiceRanges;
use crate::error::ApiError;
use crate::resource::Kind;
use crate::storage::{self, KeyValue, ListRequest, Revision};
use crate::store::{Allocators, Done, Store, Txn};

/// How unknown fields in a request body are treated (`fieldValidation` query parameter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FieldValidation {
    /// Drop them silently.
    Ignore,
    /// Drop them and say so in a `Warning` header (kube-apiserver's default).
    #[default]
    Warn,
    /// Reject the request with 400 `strict decoding error: unknown field "..."`.
    Strict,
}

impl FieldValidation {
    /// Parses the query value.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        match s {
            "" | "Warn" => Ok(FieldValidation::Warn),
            "Ignore" => Ok(FieldValidation::Ignore),
            "Strict" => Ok(FieldValidation::Strict),
            other => Err(ApiError::bad_request(format!(
                "fieldValidation parameter unsupported: {other}; must be one of: Ignore, Warn, Strict"
            ))),
        }
    }
}

/// Options of a write.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// `dryRun=All`: run everything, keep nothing.
    pub dry_run: bool,
    /// `fieldValidation`.
    pub field_validation: FieldValidation,
    /// The field manager the write is recorded under in `metadata.managedFields`
    /// (`fieldManager`, or what kube derives from the User-Agent; see
    /// [`managed_fields::manager_name`]). The server's own writes are `kube-apiserver`'s, the
    /// name kube-apiserver's own clients write under.
    pub manager: Arc<str>,
}

/// The stored default ServiceCIDR as the bootstrap write found it, for
/// [`Registry::report_default_cidr`].
struct DefaultCidrMismatch {
    /// Whether the write turned it dual-stack.
    upgraded: bool,
    uid: String,
    /// Its revision, or 0 when the bootstrap write itself rewrote it.
    revision: Revision,
    /// Its CIDRs before the write.
    stored: Vec<String>,
    /// The flags' CIDRs.
    flags: Vec<String>,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            dry_run: false,
            field_validation: FieldValidation::default(),
            manager: "kube-apiserver".into(),
        }
    }
}

/// The managed fields after an Update by `options.manager` from `old` (stored form; `None` on
/// create) to `new` (see [`managed_fields::on_update`]), set on `new`. They are worked out in
/// the form of the request's version, as kube's field manager does (an `events.k8s.io/v1`
/// write records `events.k8s.io/v1` paths, whatever the stored form).
fn record_update(kind: Kind, old: Option<&Value>, new: &mut Object, manager: &str, status: bool) {
    let subresource = if status { "status" } else { "" };
    record_update_through(kind, old, new, manager, subresource);
}

/// [`record_update`] through any subresource (`finalize` too).
fn record_update_through(
    kind: Kind,
    old: Option<&Value>,
    new: &mut Object,
    manager: &str,
    subresource: &str,
) {
    let now = serde_json::to_value(now()).expect("times serialize");
    let old = old.map(|o| event::present(kind, o.clone()));
    let managed = managed_fields::on_update(
        kind,
        old.as_ref(),
        &event::present(kind, new.to_value()),
        managed_fields::Writer {
            manager,
            subresource,
            now: &now,
        },
    );
    set_managed_fields(new, managed);
}

/// Sets `metadata.managedFields` from its JSON form (`None` clears it).
fn set_managed_fields(object: &mut Object, managed: Option<Value>) {
    let entries = managed
        .and_then(|m| serde_json::from_value::<Vec<_>>(m).ok())
        .filter(|e| !e.is_empty());
    object.metadata_mut().managed_fields = entries;
}

/// The result of a write.
#[derive(Debug, Clone)]
pub struct Written {
    /// The object as stored (with its new `resourceVersion`).
    pub object: Value,
    /// `Warning` headers to send.
    pub warnings: Vec<String>,
    /// Whether the write created the object (201 instead of 200).
    pub created: bool,
}

/// `preconditions` of a delete.
#[derive(Debug, Clone, Default)]
pub struct Preconditions {
    /// The object must have this UID.
    pub uid: Option<String>,
    /// The object must be at this resourceVersion.
    pub resource_version: Option<String>,
}

/// Options of a list.
#[derive(Debug, Clone, Default)]
pub struct ListOptions {
    /// `labelSelector`.
    pub labels: LabelSelector,
    /// `fieldSelector`.
    pub fields: FieldSelector,
    /// `limit` (0 = all).
    pub limit: usize,
    /// `continue`.
    pub continue_token: Option<String>,
    /// `resourceVersion` with `resourceVersionMatch=Exact`: read at exactly this revision.
    pub exact_revision: Option<Revision>,
}

/// One page of a list.
#[derive(Debug, Clone)]
pub struct ListResult {
    /// The objects, in key order.
    pub items: Vec<Value>,
    /// The revision the list was read at.
    pub revision: Revision,
    /// The token for the next page.
    pub continue_token: Option<String>,
    /// How many keys follow (an upper bound when selectors filter).
    pub remaining: Option<usize>,
}

/// A patch format (`Content-Type` of a PATCH).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    /// `application/json-patch+json` (RFC 6902).
    Json,
    /// `application/merge-patch+json` (RFC 7386).
    Merge,
    /// `application/strategic-merge-patch+json`.
    StrategicMerge,
}

/// Discrepancies between the allocation bitmaps and the Services (see [`Registry::verify`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verification {
    /// Ports set in the bitmap that no Service holds.
    pub leaked_ports: Vec<u16>,
    /// Ports Services hold that the bitmap does not mark.
    pub missing_ports: Vec<u16>,
    /// Ports held by more than one Service.
    pub duplicate_ports: Vec<u16>,
    /// Addresses set in the bitmap that no Service holds.
    pub leaked_ips: Vec<IpAddr>,
    /// Addresses Services hold that the bitmap does not mark.
    pub missing_ips: Vec<IpAddr>,
    /// Addresses held by more than one Service.
    pub duplicate_ips: Vec<IpAddr>,
    /// How many Services were checked.
    pub services: usize,
    /// The `mod_revision`s of the NodePort and ClusterIP bitmaps that were checked.
    pub bitmap_revisions: (Option<Revision>, Option<Revision>),
    /// The `mod_revision` of the secondary family's ClusterIP bitmap, on a dual-stack server.
    pub secondary_bitmap_revision: Option<Revision>,
    /// The `mod_revision` of the added ServiceCIDRs' allocations, if any exist.
    pub extra_revision: Option<Revision>,
    /// ClusterIPs held by a Service without their IPAddress object: the address, and the
    /// Service's namespace and name.
    pub missing_ip_addresses: Vec<(IpAddr, String, String)>,
    /// IPAddress objects of the allocator whose address no Service holds.
    pub stale_ip_addresses: Vec<IpAddr>,
    /// Addresses an IPAddress object rightly holds (a reservation, or the object of the
    /// Service that holds the address) that the bitmaps do not mark: the cache behind the
    /// truth, marked by the verification loop. Also among [`Verification::missing_ips`].
    pub unmarked_objects: Vec<IpAddr>,
}

impl Verification {
    /// How many differences were found.
    pub fn differences(&self) -> usize {
        self.leaked_ports.len()
            + self.missing_ports.len()
            + self.duplicate_ports.len()
            + self.leaked_ips.len()
            + self.missing_ips.len()
            + self.duplicate_ips.len()
            + self.missing_ip_addresses.len()
            + self.stale_ip_addresses.len()
    }

    /// Whether the bitmaps equal exactly what the Services hold.
    pub fn is_consistent(&self) -> bool {
        self.leaked_ports.is_empty()
            && self.missing_ports.is_empty()
            && self.duplicate_ports.is_empty()
            && self.leaked_ips.is_empty()
            && self.missing_ips.is_empty()
            && self.duplicate_ips.is_empty()
            && self.missing_ip_addresses.is_empty()
            && self.stale_ip_addresses.is_empty()
    }
}

/// Allocators rebuilt from the stored Services, and the bitmaps' revisions they were read beside.
struct Rebuilt {
    allocators: Allocators,
    bitmap_revisions: (Option<Revision>, Option<Revision>),
    secondary_bitmap_revision: Option<Revision>,
    extra_revision: Option<Revision>,
    services: usize,
}

/// The namespaces that exist from the first start (kube-apiserver's system namespaces).
pub const SYSTEM_NAMESPACES: [&str; 3] = ["default", "kube-system", "kube-public"];

/// Serves the kinds over a [`Store`].
#[derive(Clone)]
pub struct Registry {
    store: Store,
    ranges: Arc<ServiceRanges>,
    /// Namespaces whose deletion this server is finishing.
    finalizing: Arc<namespace::InProgress>,
    /// This server's view of the API servers' leases (see [`master_leases`]).
    leases: Arc<tokio::sync::Mutex<master_leases::Leases>>,
}

fn now() -> Time {
    // Kubernetes timestamps have second precision.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Time(k8s_openapi::jiff::Timestamp::from_second(secs as i64).expect("current time is in range"))
}

/// A random (version 4, RFC 4122 variant) UUID, as kube-apiserver's `uuid.NewUUID`.
fn new_uid() -> String {
    let mut b: [u8; 16] = rand::rng().random();
    b[6] = (b[6] & 0x0f) | 0x40; // version 4
    b[8] = (b[8] & 0x3f) | 0x80; // variant 10xx
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod uid_tests {
    #[test]
    fn uids_are_rfc_4122_version_4() {
        for _ in 0..200 {
            let uid = super::new_uid();
            let parts: Vec<&str> = uid.split('-').collect();
            let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
            assert_eq!(lens, [8, 4, 4, 4, 12], "{uid}");
            assert!(parts[2].starts_with('4'), "{uid}");
            assert!(matches!(&parts[3][..1], "8" | "9" | "a" | "b"), "{uid}");
        }
    }
}

/// `BeforeCreate`'s system fields: a new uid and creation time; no resourceVersion, deletion or
/// managed fields from the client.
fn reset_for_create(meta: &mut ObjectMeta) {
    meta.uid = Some(new_uid());
    meta.creation_timestamp = Some(now());
    meta.resource_version = None;
    meta.deletion_timestamp = None;
    meta.deletion_grace_period_seconds = None;
    meta.managed_fields = None;
}

/// `names.SimpleNameGenerator`: the prefix and 5 random characters from kube's alphabet.
fn generate_name(prefix: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    let prefix = if prefix.len() > 58 {
        &prefix[..58]
    } else {
        prefix
    };
    let suffix: String = (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("{prefix}{suffix}")
}

/// The stored form: JSON without `resourceVersion`.
fn encode_stored(object: &Object) -> Arc<[u8]> {
    let mut value = object.to_value();
    if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("resourceVersion");
    }
    serde_json::to_vec(&value)
        .expect("objects serialize")
        .into()
}

/// Parses a stored value and stamps its `resourceVersion`.
pub fn decode_stored(value: &[u8], revision: Revision) -> Result<Value, ApiError> {
    let mut v: Value = serde_json::from_slice(value)
        .map_err(|e| ApiError::internal(format!("stored object is not JSON: {e}")))?;
    if revision != 0 {
        set_resource_version(&mut v, revision);
    }
    Ok(v)
}

/// Sets `metadata.resourceVersion`.
pub fn set_resource_version(value: &mut Value, revision: Revision) {
    if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert(
            "resourceVersion".into(),
            Value::String(revision.to_string()),
        );
    }
}

fn typed_from_entry(kind: Kind, value: &[u8]) -> Result<Object, ApiError> {
    let v: Value = serde_json::from_slice(value)
        .map_err(|e| ApiError::internal(format!("stored object is not JSON: {e}")))?;
    Ok(Object::decode(kind.stored_as(), &v)?.object)
}

fn unknown_field_handling(
    unknown: &[String],
    mode: FieldValidation,
) -> Result<Vec<String>, ApiError> {
    if unknown.is_empty() {
        return Ok(Vec::new());
    }
    let messages: Vec<String> = unknown
        .iter()
        .map(|f| format!("unknown field {f:?}"))
        .collect();
    match mode {
        FieldValidation::Ignore => Ok(Vec::new()),
        FieldValidation::Warn => Ok(messages),
        FieldValidation::Strict => Err(ApiError::bad_request(format!(
            "strict decoding error: {}",
            messages.join(", ")
        ))),
    }
}

fn invalid(kind: Kind, name: &str, errs: Vec<crate::error::FieldError>) -> ApiError {
    ApiError::invalid(kind.subject(), name, errs)
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    v: String,
    rv: Revision,
    start: String,
}

impl Registry {
    /// A registry over `store` for the given ranges.
    pub fn new(store: Store, ranges: ServiceRanges) -> Self {
        Registry {
            store,
            ranges: Arc::new(ranges),
            finalizing: Arc::default(),
            leases: Arc::default(),
        }
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The allocation ranges.
    pub fn ranges(&self) -> &ServiceRanges {
        &self.ranges
    }

    fn key(&self, kind: Kind, namespace: Option<&str>, name: &str) -> String {
        kind.key(self.store.prefix(), namespace, name)
    }

    fn namespace_key(&self, namespace: &str) -> String {
        Kind::Namespace.key(self.store.prefix(), None, namespace)
    }

    /// GET one object.
    pub async fn get(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let key = self.key(kind, namespace, name);
        let fetched = self.store.backend().get_many(vec![key.clone()]).await?;
        match fetched.kvs.get(&key) {
            Some(kv) => decode_stored(&kv.value, kv.mod_revision),
            None => Err(ApiError::not_found(kind.subject(), name)),
        }
    }

    /// LIST with selectors and pagination.
    pub async fn list(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        options: &ListOptions,
    ) -> Result<ListResult, ApiError> {
        let prefix = kind.list_prefix(self.store.prefix(), namespace);
        let (mut start, mut revision) = (None, options.exact_revision);
        if let Some(token) = options.continue_token.as_deref().filter(|t| !t.is_empty()) {
            let decoded = base64::engine::general_purpose::URL_SAFE
                .decode(token)
                .ok()
                .and_then(|b| serde_json::from_slice::<ContinueToken>(&b).ok())
                .ok_or_else(|| ApiError::bad_request("invalid continue token"))?;
            start = Some(format!("{prefix}{}", decoded.start));
            revision = Some(decoded.rv);
        }
        let continued = start.is_some();
        let limit = (options.limit > 0).then_some(options.limit);

        // A single-name field selector (`metadata.name=<node>`) reads one key.
        if let Some(name) = options.fields.exact_name()
            && !continued
        {
            let key = match namespace {
                Some(_) => self.key(kind, namespace, name),
                None if !kind.namespaced() => self.key(kind, None, name),
                None => String::new(),
            };
            if !key.is_empty() && revision.is_none() {
                let fetched = self.store.backend().get_many(vec![key.clone()]).await?;
                let mut items = Vec::new();
                if let Some(kv) = fetched.kvs.get(&key) {
                    let v = decode_stored(&kv.value, kv.mod_revision)?;
                    if options.fields.matches(&v)
                        && options.labels.matches(&selector::labels_of(&v))
                    {
                        items.push(v);
                    }
                }
                return Ok(ListResult {
                    items,
                    revision: fetched.revision,
                    continue_token: None,
                    remaining: None,
                });
            }
        }

        let mut items = Vec::new();
        let mut read_revision = None;
        let mut next_start = start;
        let mut remaining;
        loop {
            let page = self
                .store
                .backend()
                .list(ListRequest {
                    prefix: prefix.clone(),
                    start: next_start.clone(),
                    revision: read_revision.or(revision),
                    limit: limit.map(|l| (l - items.len()).max(1)),
                })
                .await
                .map_err(|err| match err {
                    storage::Error::Compacted { .. } if continued => ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
                    ),
                    other => other.into(),
                })?;
            read_revision = Some(page.revision);
            remaining = page.remaining;
            let last_key = page.kvs.last().map(|kv| kv.key.clone());
            for kv in &page.kvs {
                let v = decode_stored(&kv.value, kv.mod_revision)?;
                if options.fields.matches(&v) && options.labels.matches(&selector::labels_of(&v)) {
                    items.push(v);
                }
            }
            match (limit, last_key) {
                (Some(l), Some(last)) if remaining > 0 => {
                    next_start = Some(format!("{last}\u{0}"));
                    if items.len() >= l {
                        break;
                    }
                }
                _ => {
                    remaining = 0;
                    break;
                }
            }
        }
        let revision = read_revision.unwrap_or_default();
        let continue_token = (remaining > 0).then(|| {
            let start = next_start.unwrap_or_default();
            let token = ContinueToken {
                v: "meta.k8s.io/v1".into(),
                rv: revision,
                start: start.strip_prefix(&prefix).unwrap_or(&start).to_owned(),
            };
            base64::engine::general_purpose::URL_SAFE
                .encode(serde_json::to_vec(&token).expect("token serializes"))
        });
        Ok(ListResult {
            items,
            revision,
            remaining: (remaining > 0 && options.labels.is_empty() && options.fields.is_empty())
                .then_some(remaining),
            continue_token,
        })
    }

    /// Decodes a request body, applying `fieldValidation`.
    fn decode_body(
        kind: Kind,
        mut body: Value,
        mode: FieldValidation,
    ) -> Result<(Object, Vec<String>), ApiError> {
        gvk::default_and_check(kind, &mut body)?;
        let decoded = Object::decode(kind, &body)?;
        // A create or update wraps the strict decoding error as any decoding error
        // (kube-apiserver's `transformDecodeError`).
        let warnings = unknown_field_handling(&decoded.unknown_fields, mode)
            .map_err(|e| object::undecodable(kind, e.message()))?;
        Ok((decoded.object, warnings))
    }

    /// CREATE (POST).
    pub async fn create(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        body: Value,
        options: WriteOptions,
    ) -> Result<Written, ApiError> {
        let (mut object, warnings) = Self::decode_body(kind, body, options.field_validation)?;
        // kube's create handler runs the field manager on the body as decoded (defaulted, with
        // the managed fields sent, valid ones kept: see `managed_fields::on_update`), before
        // the strategy's `PrepareForCreate`: what the strategy adds (a Namespace's
        // `kubernetes` finalizer) is owned by no one.
        let mut recorded = object.clone();
        kinds::set_defaults(&mut recorded);
        record_update(kind, None, &mut recorded, &options.manager, false);
        let resource_version_set = admit_create(kind, namespace, &mut object, options.dry_run)?;
        object.metadata_mut().managed_fields = recorded.metadata().managed_fields.clone();
        let name = object.name().to_owned();
        let ns = object.metadata().namespace.clone();
        let key = self.key(kind, ns.as_deref(), &name);
        let mut keys = vec![key.clone()];
        let ns_key = ns.as_deref().map(|n| self.namespace_key(n));
        keys.extend(ns_key.clone());
        let ranges = self.ranges.clone();
        let prefix: Arc<str> = self.store.prefix().into();
        let dry_run = options.dry_run;
        let done = self
            .store
            .mutate(keys, move |txn| {
                if resource_version_set {
                    if let (Some(ns_key), Some(ns)) = (&ns_key, &ns) {
                        check_namespace_open(txn, ns_key, ns, kind, &name)?;
                    }
                    // The storage's `ErrResourceVersionSetOnCreate`, which no handler classifies.
                    return Err(ApiError::unclassified(
                        "resourceVersion should not be set on objects to be created",
                    ));
                }
                let target = CreateTarget {
                    kind,
                    key: &key,
                    ns_key: ns_key.as_deref(),
                    namespace: ns.as_deref(),
                    ranges: &ranges,
                    prefix: &prefix,
                    dry_run,
                };
                store_create(txn, &target, object.clone())
            })
            .await?;
        Ok(finish(done, warnings, true))
    }

    /// UPDATE (PUT), of the object or of its `status`.
    pub async fn update(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status_only: bool,
        body: Value,
        options: WriteOptions,
    ) -> Result<Written, ApiError> {
        let (mut object, warnings) = Self::decode_body(kind, body, options.field_validation)?;
        match object.metadata().name.as_deref() {
            None | Some("") => object.metadata_mut().name = Some(name.to_owned()),
            Some(n) if n != name => {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )));
            }
            _ => {}
        }
        if kind.namespaced() {
            let url_ns = namespace.unwrap_or("");
            match object.metadata().namespace.as_deref() {
                None | Some("") => object.metadata_mut().namespace = Some(url_ns.to_owned()),
                Some(ns) if ns != url_ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => {}
            }
        }
        kinds::set_defaults(&mut object);
        let ObjectKeys {
            key,
            ns_key,
            extra,
            all: keys,
        } = self.object_keys(kind, namespace, name, true).await?;
        let ranges = self.ranges.clone();
        let prefix: Arc<str> = self.store.prefix().into();
        let name = name.to_owned();
        let namespace = namespace.map(str::to_owned);
        let manager = options.manager.clone();
        let done = self
            .store
            .mutate(keys, move |txn| {
                let Some(old) = txn.get(&key) else {
                    if !kind.allow_create_on_update() || status_only {
                        return Err(ApiError::not_found(kind.subject(), &name));
                    }
                    if let (Some(ns_key), Some(ns)) = (&ns_key, &namespace) {
                        check_namespace_open(txn, ns_key, ns, kind, &name)?;
                    }
                    let mut object = object.clone();
                    // As on create: the field manager before the strategy.
                    let mut recorded = object.clone();
                    record_update(kind, None, &mut recorded, &manager, false);
                    reset_for_create(object.metadata_mut());
                    kinds::prepare_create(&mut object);
                    object.metadata_mut().managed_fields =
                        recorded.metadata().managed_fields.clone();
                    if let Object::Service(svc) = &mut object {
                        service::create(svc, txn.allocators()?, &ranges)?;
                    } else if let Object::Event(event) = &object {
                        let errs = event::validate_create(kind, event);
                        if !errs.is_empty() {
                            return Err(invalid(kind, &name, errs));
                        }
                    } else {
                        let errs = kinds::validate(&object);
                        if !errs.is_empty() {
                            return Err(invalid(kind, &name, errs));
                        }
                    }
                    if options.dry_run {
                        txn.set_dry_run();
                    }
                    txn.put(key.clone(), encode_stored(&object));
                    if let Object::Service(svc) = &object {
                        ip_addresses::sync(txn, &prefix, None, Some(svc));
                    }
                    return Ok((object.to_value(), true, 0));
                };
                let old_object = typed_from_entry(kind, &old.value)?;
                let mut object = object.clone();
                record_update(
                    kind,
                    Some(&decode_stored(&old.value, 0)?),
                    &mut object,
                    &manager,
                    status_only,
                );
                let managed = object.metadata().managed_fields.clone();
                let mut new = apply_update(
                    txn,
                    kind,
                    &old_object,
                    old.mod_revision,
                    object,
                    status_only,
                    &ranges,
                )?;
                new.metadata_mut().managed_fields = managed;
                if options.dry_run {
                    txn.set_dry_run();
                }
                if finalized(&new) {
                    remove_object(txn, &key, &new, &extra)?;
                    return Ok((new.to_value(), false, old.mod_revision));
                }
                let encoded = encode_stored(&new);
                if encoded == old.value {
                    // kube-apiserver's GuaranteedUpdate writes nothing when nothing changed.
                    return Ok((new.to_value(), false, old.mod_revision));
                }
                txn.put(key.clone(), encoded);
                if let (Object::Service(before), Object::Service(after)) = (&old_object, &new) {
                    ip_addresses::sync(txn, &prefix, Some(before), Some(after));
                }
                Ok((new.to_value(), false, old.mod_revision))
            })
            .await?;
        let (mut object, created, old_revision) = done.value;
        match done.revision {
            Some(rev) => set_resource_version(&mut object, rev),
            None if old_revision != 0 => set_resource_version(&mut object, old_revision),
            None => {}
        }
        Ok(Written {
            object,
            warnings,
            created,
        })
    }

    /// PATCH, of the object or of its `status`.
    #[allow(clippy::too_many_arguments)]
    pub async fn patch(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status_only: bool,
        patch_type: PatchType,
        patch: Value,
        options: WriteOptions,
    ) -> Result<Written, ApiError> {
        let ObjectKeys {
            key,
            extra,
            all: keys,
            ..
        } = self.object_keys(kind, namespace, name, false).await?;
        let ranges = self.ranges.clone();
        let prefix: Arc<str> = self.store.prefix().into();
        let name = name.to_owned();
        let manager = options.manager.clone();
        let done = self
            .store
            .mutate(keys, move |txn| {
                let Some(old) = txn.get(&key) else {
                    return Err(ApiError::not_found(kind.subject(), &name));
                };
                let old_value = event::present(kind, decode_stored(&old.value, old.mod_revision)?);
                let patched = patch::apply(kind, patch_type, &old_value, &patch)?;
                let decoded = Object::decode(kind, &patched)?;
                let warnings =
                    unknown_field_handling(&decoded.unknown_fields, options.field_validation)?;
                let mut object = decoded.object;
                if object.name() != name {
                    return Err(ApiError::bad_request(format!(
                        "the name of the object ({}) does not match the name on the URL ({name})",
                        object.name()
                    )));
                }
                kinds::set_defaults(&mut object);
                let old_object = typed_from_entry(kind, &old.value)?;
                record_update(
                    kind,
                    Some(&decode_stored(&old.value, 0)?),
                    &mut object,
                    &manager,
                    status_only,
                );
                let managed = object.metadata().managed_fields.clone();
                let mut new = apply_update(
                    txn,
                    kind,
                    &old_object,
                    old.mod_revision,
                    object,
                    status_only,
                    &ranges,
                )?;
                new.metadata_mut().managed_fields = managed;
                if options.dry_run {
                    txn.set_dry_run();
                }
                if finalized(&new) {
                    remove_object(txn, &key, &new, &extra)?;
                    return Ok((new.to_value(), warnings, old.mod_revision));
                }
                let encoded = encode_stored(&new);
                if encoded != old.value {
                    txn.put(key.clone(), encoded);
                    if let (Object::Service(before), Object::Service(after)) = (&old_object, &new) {
                        ip_addresses::sync(txn, &prefix, Some(before), Some(after));
                    }
                }
                Ok((new.to_value(), warnings, old.mod_revision))
            })
            .await?;
        let (mut object, warnings, old_revision) = done.value;
        set_resource_version(&mut object, done.revision.unwrap_or(old_revision));
        Ok(Written {
            object,
            warnings,
            created: false,
        })
    }

    /// Server-side apply (PATCH with `application/apply-patch+yaml`) of `config` by
    /// `options.manager`, of the object or of its `status` (see [`managed_fields`]). An apply
    /// to an object that does not exist creates it, allocating as a create does, unless
    /// `create_denied` says the user may not create (RBAC: apply needs `create` then).
    #[allow(clippy::too_many_arguments)]
    pub async fn apply(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status_only: bool,
        config: Value,
        force: bool,
        create_denied: Option<ApiError>,
        options: WriteOptions,
    ) -> Result<Written, ApiError> {
        let config = apply_config(kind, namespace, name, config)?;
        let ObjectKeys {
            key,
            ns_key,
            extra,
            all: keys,
        } = self.object_keys(kind, namespace, name, true).await?;
        let ranges = self.ranges.clone();
        let prefix: Arc<str> = self.store.prefix().into();
        let name = name.to_owned();
        let namespace = namespace.map(str::to_owned);
        let done = self
            .store
            .mutate(keys, move |txn| {
                let old = txn.get(&key);
                if old.is_none() && status_only {
                    return Err(ApiError::not_found(kind.subject(), &name));
                }
                if old.is_none()
                    && let Some(err) = &create_denied
                {
                    return Err(err.clone());
                }
                // Merged in the form of the request's version, as kube's field manager does.
                let live = old
                    .as_ref()
                    .map(|o| decode_stored(&o.value, 0).map(|v| event::present(kind, v)))
                    .transpose()?;
                let now_value = serde_json::to_value(now()).expect("times serialize");
                let applied = managed_fields::apply(
                    kind,
                    live.as_ref(),
                    &config,
                    managed_fields::Writer {
                        manager: &options.manager,
                        subresource: if status_only { "status" } else { "" },
                        now: &now_value,
                    },
                    force,
                )?;
                let decoded = Object::decode(kind, &applied.object)?;
                let warnings =
                    unknown_field_handling(&decoded.unknown_fields, options.field_validation)?;
                let mut object = decoded.object;
                let Some(old) = old else {
                    let resource_version_set =
                        admit_create(kind, namespace.as_deref(), &mut object, options.dry_run)?;
                    if resource_version_set {
                        return Err(ApiError::unclassified(
                            "resourceVersion should not be set on objects to be created",
                        ));
                    }
                    set_managed_fields(&mut object, Some(applied.managed_fields));
                    let target = CreateTarget {
                        kind,
                        key: &key,
                        ns_key: ns_key.as_deref(),
                        namespace: namespace.as_deref(),
                        ranges: &ranges,
                        prefix: &prefix,
                        dry_run: options.dry_run,
                    };
                    let value = store_create(txn, &target, object)?;
                    return Ok((value, warnings, true, 0));
                };
                kinds::set_defaults(&mut object);
                let old_object = typed_from_entry(kind, &old.value)?;
                let mut new = apply_update(
                    txn,
                    kind,
                    &old_object,
                    old.mod_revision,
                    object,
                    status_only,
                    &ranges,
                )?;
                set_managed_fields(&mut new, Some(applied.managed_fields));
                if options.dry_run {
                    txn.set_dry_run();
                }
                if finalized(&new) {
                    remove_object(txn, &key, &new, &extra)?;
                    return Ok((new.to_value(), warnings, false, old.mod_revision));
                }
                let encoded = encode_stored(&new);
                if encoded != old.value {
                    txn.put(key.clone(), encoded);
                    if let (Object::Service(before), Object::Service(after)) = (&old_object, &new) {
                        ip_addresses::sync(txn, &prefix, Some(before), Some(after));
                    }
                }
                Ok((new.to_value(), warnings, false, old.mod_revision))
            })
            .await?;
        let (mut object, warnings, created, old_revision) = done.value;
        match done.revision {
            Some(rev) => set_resource_version(&mut object, rev),
            None if old_revision != 0 => set_resource_version(&mut object, old_revision),
            None => {}
        }
        Ok(Written {
            object,
            warnings,
            created,
        })
    }

    /// DELETE one object. Returns the deleted object.
    pub async fn delete(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        preconditions: Preconditions,
        options: WriteOptions,
    ) -> Result<Value, ApiError> {
        if kind == Kind::Namespace {
            if SYSTEM_NAMESPACES.contains(&name) {
                return Err(ApiError::forbidden(
                    kind.subject(),
                    name,
                    "this namespace may not be deleted",
                ));
            }
            return self.delete_namespace(name, preconditions, options).await;
        }
        let ObjectKeys {
            key,
            extra,
            all: keys,
            ..
        } = self.object_keys(kind, namespace, name, false).await?;
        let name = name.to_owned();
        let done = self
            .store
            .mutate(keys, move |txn| {
                let Some(old) = txn.get(&key) else {
                    return Err(ApiError::not_found(kind.subject(), &name));
                };
                let old_value = decode_stored(&old.value, old.mod_revision)?;
                check_preconditions(kind, &name, &old_value, old.mod_revision, &preconditions)?;
                let object = typed_from_entry(kind, &old.value)?;
                if options.dry_run {
                    txn.set_dry_run();
                }
                if has_finalizers(&object) {
                    // kube-apiserver's `updateForGracefulDeletionAndFinalizers`: the object is
                    // only marked, and keeps what it holds until its last finalizer is removed.
                    if object.metadata().deletion_timestamp.is_some() {
                        return Ok((old_value, None));
                    }
                    let mut marked = object;
                    let meta = marked.metadata_mut();
                    meta.deletion_timestamp = Some(now());
                    meta.deletion_grace_period_seconds = Some(0);
                    // `markAsDeleting`: the spec's generation moves with the deletion.
                    if let Some(generation) = meta.generation.filter(|g| *g > 0) {
                        meta.generation = Some(generation + 1);
                    }
                    if let Object::ServiceCidr(cidr) = &mut marked
                        && service_cidr::on_delete(cidr, txn.allocators()?, now())
                    {
                        remove_object(txn, &key, &marked, &extra)?;
                        return Ok((marked.to_value(), None));
                    }
                    txn.put(key.clone(), encode_stored(&marked));
                    return Ok((marked.to_value(), Some(old.mod_revision)));
                }
                remove_object(txn, &key, &object, &extra)?;
                Ok((old_value, None))
            })
            .await?;
        let (mut object, marked) = done.value;
        if let Some(old_revision) = marked {
            set_resource_version(&mut object, done.revision.unwrap_or(old_revision));
        }
        Ok(object)
    }

    /// The keys a write to one existing object declares: the object's, its namespace's when
    /// `with_namespace` (an update must find it open), its companions' and its IPAddress
    /// objects'.
    async fn object_keys(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        with_namespace: bool,
    ) -> Result<ObjectKeys, ApiError> {
        let key = self.key(kind, namespace, name);
        let ns_key = namespace
            .filter(|_| with_namespace && kind.namespaced())
            .map(|n| self.namespace_key(n));
        let extra = self.companion_keys(kind, namespace, name);
        let mut all = vec![key.clone()];
        all.extend(ns_key.clone());
        all.extend(extra.iter().cloned());
        all.extend(self.ip_address_keys(kind, namespace, name).await?);
        Ok(ObjectKeys {
            key,
            ns_key,
            extra,
            all,
        })
    }

    /// The keys of the IPAddress objects of a stored Service's ClusterIPs, declared by a write
    /// that may remove them (a backend deletes only keys it compares). A Service whose
    /// addresses changed since this read leaves the objects of the others to the verification
    /// loop.
    async fn ip_address_keys(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Vec<String>, ApiError> {
        if kind != Kind::Service {
            return Ok(Vec::new());
        }
        let key = self.key(kind, namespace, name);
        let fetched = self.store.backend().get_many(vec![key.clone()]).await?;
        let Some(kv) = fetched.kvs.get(&key) else {
            return Ok(Vec::new());
        };
        let Ok(Object::Service(svc)) = typed_from_entry(kind, &kv.value) else {
            return Ok(Vec::new());
        };
        Ok(service::held(&svc)
            .0
            .into_iter()
            .map(|ip| Kind::IpAddress.key(self.store.prefix(), None, &ip.to_string()))
            .collect())
    }

    /// Keys removed together with an object of `kind`: the Endpoints of a Service's name
    /// (kube-apiserver's Service REST deletes them with the Service).
    fn companion_keys(&self, kind: Kind, namespace: Option<&str>, name: &str) -> Vec<String> {
        match kind {
            Kind::Service => vec![self.key(Kind::Endpoints, namespace, name)],
            _ => Vec::new(),
        }
    }

    /// DELETE a collection: every object the selectors match. Returns the deleted objects.
    pub async fn delete_collection(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        list: &ListOptions,
        options: WriteOptions,
    ) -> Result<Vec<Value>, ApiError> {
        if kind == Kind::Namespace {
            return Err(ApiError::method_not_supported(
                kind.subject(),
                "deletecollection",
            ));
        }
        let matched = self
            .list(
                kind,
                namespace,
                &ListOptions {
                    limit: 0,
                    continue_token: None,
                    ..list.clone()
                },
            )
            .await?;
        // One delete per object, as kube-apiserver's `DeleteCollection` does: each commits with
        // the release of what it held, and the writer batches them into transactions that fit
        // the backend (etcd takes at most 128 operations in one).
        let names: Vec<(Option<String>, String)> = matched
            .items
            .iter()
            .map(|item| {
                (
                    item.pointer("/metadata/namespace")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    item.pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned(),
                )
            })
            .collect();
        let results = self.delete_each(kind, names, options).await;
        let mut deleted = Vec::with_capacity(results.len());
        for result in results {
            match result {
                Ok(object) => deleted.push(object),
                // Deleted by someone else meanwhile: kube-apiserver ignores it too.
                Err(err) if err.code() == 404 => {}
                Err(err) => return Err(err),
            }
        }
        Ok(deleted)
    }

    /// Creates what exists from the first start, and the allocation bitmaps: the system
    /// namespaces, `default/kubernetes`, the default ServiceCIDR `kubernetes`, and bitmaps rebuilt from the stored Services when they are
    /// missing or were written for other ranges (the flags changed).
    pub async fn bootstrap(&self) -> Result<(), ApiError> {
        // A rebuild gives up when the bitmaps change between its read and its commit (another
        // API server rebuilt them, or one with other flags wrote); the next attempt reads again.
        const ATTEMPTS: usize = 10;
        for _ in 0..ATTEMPTS {
            if self.bootstrap_once().await? {
                return Ok(());
            }
        }
        Err(ApiError::internal(
            "the allocation bitmaps kept changing while they were being rebuilt",
        ))
    }

    /// One attempt of [`Registry::bootstrap`]; `false` if the bitmaps changed under a rebuild.
    async fn bootstrap_once(&self) -> Result<bool, ApiError> {
        let np_key = storage::keys::node_port_range(self.store.prefix());
        let ip_key = storage::keys::service_ip_range(self.store.prefix());
        let secondary_key = self.secondary_ip_key();
        let extra_key = storage::keys::service_cidr_ranges(self.store.prefix());
        let mut range_keys = vec![np_key.clone(), ip_key.clone()];
        range_keys.extend(secondary_key.clone());
        let fetched = self.store.backend().get_many(range_keys).await?;
        // Missing or unusable bitmaps are rebuilt from every stored Service, read at one revision
        // with the bitmaps' own revisions. The Services are not declared as keys of the write (on
        // etcd a transaction takes at most 128); the bitmaps' revisions stand for them instead:
        // no Service can change what it holds without changing a bitmap.
        let rebuilt = if self.bitmaps_usable(&fetched.kvs, &np_key, &ip_key) {
            None
        } else {
            let page = self
                .store
                .backend()
                .list(ListRequest {
                    prefix: format!("{}/", self.store.prefix()),
                    start: None,
                    revision: None,
                    limit: None,
                })
                .await?;
            Some(Arc::new(
                self.rebuild_allocators(&page.kvs, &np_key, &ip_key)?,
            ))
        };
        let ns_keys: Vec<(String, String)> = SYSTEM_NAMESPACES
            .iter()
            .map(|n| (n.to_string(), self.namespace_key(n)))
            .collect();
        let mut keys: Vec<String> = ns_keys.iter().map(|(_, k)| k.clone()).collect();
        let kubernetes_key = self.key(Kind::Service, Some("default"), "kubernetes");
        keys.push(kubernetes_key.clone());
        let cidr_key = self.key(Kind::ServiceCidr, None, service_cidr::DEFAULT_NAME);
        keys.push(cidr_key.clone());
        let ranges = self.ranges.clone();
        let prefix: Arc<str> = self.store.prefix().into();
        let plan = rebuilt.clone();
        let done = self
            .store
            .mutate(keys, move |txn| {
                let mut rebuilt_now = None;
                let mut mismatch = None;
                if !txn.allocators_initialized() {
                    let Some(plan) = &plan else {
                        // Usable when checked, unusable now: look again.
                        return Ok(None);
                    };
                    let now = (
                        txn.get(&np_key).map(|e| e.mod_revision),
                        txn.get(&ip_key).map(|e| e.mod_revision),
                    );
                    let secondary_now = secondary_key
                        .as_ref()
                        .and_then(|k| txn.get(k))
                        .map(|e| e.mod_revision);
                    let extra_now = txn.get(&extra_key).map(|e| e.mod_revision);
                    if now != plan.bitmap_revisions
                        || secondary_now != plan.secondary_bitmap_revision
                        || extra_now != plan.extra_revision
                    {
                        return Ok(None);
                    }
                    txn.replace_allocators(plan.allocators.clone());
                    rebuilt_now = Some(plan.services);
                }
                for (name, key) in &ns_keys {
                    if txn.get(key).is_none() {
                        let mut ns = Object::Namespace(Box::new(Namespace {
                            metadata: ObjectMeta {
                                name: Some(name.clone()),
                                uid: Some(new_uid()),
                                creation_timestamp: Some(now()),
                                labels: Some(
                                    [("kubernetes.io/metadata.name".to_owned(), name.clone())]
                                        .into(),
                                ),
                                ..Default::default()
                            },
                            ..Default::default()
                        }));
                        kinds::prepare_create(&mut ns);
                        txn.put(key.clone(), encode_stored(&ns));
                    }
                }
                if txn.get(&kubernetes_key).is_none() {
                    let mut svc: Service = service::kubernetes_service(&ranges);
                    svc.metadata.uid = Some(new_uid());
                    svc.metadata.creation_timestamp = Some(now());
                    service::create(&mut svc, txn.allocators()?, &ranges)?;
                    txn.put(
                        kubernetes_key.clone(),
                        encode_stored(&Object::Service(Box::new(svc.clone()))),
                    );
                    ip_addresses::sync(txn, &prefix, None, Some(&svc));
                }
                match txn.get(&cidr_key) {
                    None => {
                        let cidr = service_cidr::default_service_cidr(&ranges, new_uid(), now());
                        let extra = &txn.allocators()?.extra;
                        let mut tracked = extra.clone();
                        service_cidr::track_default(&cidr, &ranges, &mut tracked);
                        if &tracked != extra {
                            txn.allocators()?.extra = tracked;
                        }
                        txn.put(
                            cidr_key.clone(),
                            encode_stored(&Object::ServiceCidr(Box::new(cidr))),
                        );
                    }
                    Some(entry) => {
                        // Left as it is, as kube-apiserver leaves it (every API server must
                        // run with the range it holds; its other ranges keep allocating),
                        // except for kube's single- to dual-stack upgrade.
                        if let Ok(Object::ServiceCidr(mut cidr)) =
                            typed_from_entry(Kind::ServiceCidr, &entry.value)
                        {
                            let stored = service_cidr::cidrs(&cidr);
                            let flags = service_cidr::flag_cidrs(&ranges);
                            let upgraded = service_cidr::upgrade_default(&mut cidr, &ranges);
                            let rewritten = service_cidr::ensure_finalizer(&mut cidr) || upgraded;
                            if rewritten {
                                txn.put(
                                    cidr_key.clone(),
                                    encode_stored(&Object::ServiceCidr(cidr.clone())),
                                );
                            }
                            mismatch = Some(DefaultCidrMismatch {
                                upgraded,
                                uid: cidr.metadata.uid.clone().unwrap_or_default(),
                                // 0: this write's revision.
                                revision: if rewritten { 0 } else { entry.mod_revision },
                                stored,
                                flags,
                            });
                            let extra = &txn.allocators()?.extra;
                            let mut tracked = extra.clone();
                            service_cidr::track_default(&cidr, &ranges, &mut tracked);
                            if &tracked != extra {
                                txn.allocators()?.extra = tracked;
                            }
                        }
                    }
                }
                Ok(Some((rebuilt_now, mismatch)))
            })
            .await?;
        let Some((rebuilt_now, mismatch)) = done.value else {
            return Ok(false);
        };
        if let Some(services) = rebuilt_now.filter(|n| *n > 0) {
            tracing::warn!(
                services,
                "allocation bitmaps rebuilt from the stored Services"
            );
        }
        if let Some(m) = mismatch {
            self.report_default_cidr(m, done.revision.unwrap_or_default())
                .await;
        }
        Ok(true)
    }

    /// What kube-apiserver's default ServiceCIDR controller says about the stored default
    /// ServiceCIDR at start (`sync`, `syncStatus`), in its words: the single- to dual-stack
    /// upgrade it made, or, once per process, a differing range (a log line and a Warning Event
    /// about the ServiceCIDR, [`service_cidr::inconsistent_event`]).
    async fn report_default_cidr(&self, m: DefaultCidrMismatch, revision: Revision) {
        let DefaultCidrMismatch {
            upgraded,
            uid,
            revision: rv,
            stored,
            flags,
        } = m;
        if upgraded {
            tracing::info!(
                "Updating default ServiceCIDR from single-stack ({stored:?}) to dual-stack ({flags:?})"
            );
            return;
        }
        if stored == flags {
            return;
        }
        tracing::warn!(
            "Inconsistent ServiceCIDR status for {}, controller configuration: {flags:?}, ServiceCIDR configuration: {stored:?}. Configure the flags to match current ServiceCIDR or manually delete it.",
            service_cidr::DEFAULT_NAME
        );
        let rv = if rv == 0 { revision } else { rv };
        let event = service_cidr::inconsistent_event(
            &uid,
            &rv.to_string(),
            &stored,
            &flags,
            std::time::SystemTime::now(),
        );
        // As client-go's recorder, a failed post is logged, never fatal.
        if let Err(err) = self
            .create(Kind::Event, Some("default"), event, WriteOptions::default())
            .await
        {
            tracing::warn!(error = %err, "could not record the {} Event", service_cidr::INCONSISTENT_REASON);
        }
    }

    /// Whether both stored bitmaps exist and decode for the configured ranges.
    fn bitmaps_usable(
        &self,
        kvs: &std::collections::HashMap<String, KeyValue>,
        np_key: &str,
        ip_key: &str,
    ) -> bool {
        let (Some(np), Some(ip)) = (kvs.get(np_key), kvs.get(ip_key)) else {
            return false;
        };
        let secondary = match self.secondary_ip_key() {
            Some(key) => match kvs.get(&key) {
                Some(kv) => Some(kv),
                None => return false,
            },
            None => None,
        };
        let Ok(mut allocators) = self.empty_allocators() else {
            return false;
        };
        let restored = |value: &[u8], restore: &mut dyn FnMut(&str, &[u8]) -> bool| {
            crate::store::decode_range(value).is_ok_and(|snap| restore(&snap.range, &snap.data))
        };
        restored(&np.value, &mut |range, data| {
            allocators.ports.restore(range, data).is_ok()
        }) && restored(&ip.value, &mut |range, data| {
            allocators.ips.restore(range, data).is_ok()
        }) && secondary.is_none_or(|kv| {
            restored(&kv.value, &mut |range, data| {
                allocators
                    .secondary_ips
                    .as_mut()
                    .is_some_and(|a| a.restore(range, data).is_ok())
            })
        })
    }

    /// The key of the secondary ClusterIP bitmap, on a dual-stack server.
    fn secondary_ip_key(&self) -> Option<String> {
        self.ranges
            .secondary_cluster_ips
            .map(|_| storage::keys::secondary_service_ip_range(self.store.prefix()))
    }

    fn empty_allocators(&self) -> Result<Allocators, ApiError> {
        self.ranges.store_ranges().empty()
    }

    /// Allocators holding exactly what the Services in `kvs` (a dump at one revision) hold.
    fn rebuild_allocators(
        &self,
        kvs: &[KeyValue],
        np_key: &str,
        ip_key: &str,
    ) -> Result<Rebuilt, ApiError> {
        let service_prefix = Kind::Service.list_prefix(self.store.prefix(), None);
        let mut fresh = self.empty_allocators()?;
        let secondary_key = self.secondary_ip_key();
        let extra_key = storage::keys::service_cidr_ranges(self.store.prefix());
        let default_cidr_key = self.key(Kind::ServiceCidr, None, service_cidr::DEFAULT_NAME);
        let address_prefix = Kind::IpAddress.list_prefix(self.store.prefix(), None);
        let mut reservations = Vec::new();
        let mut rebuilt = Rebuilt {
            allocators: fresh.clone(),
            bitmap_revisions: (None, None),
            secondary_bitmap_revision: None,
            extra_revision: None,
            services: 0,
        };
        for kv in kvs {
            if kv.key == np_key {
                rebuilt.bitmap_revisions.0 = Some(kv.mod_revision);
                continue;
            }
            if kv.key == ip_key {
                rebuilt.bitmap_revisions.1 = Some(kv.mod_revision);
                continue;
            }
            if Some(&kv.key) == secondary_key.as_ref() {
                rebuilt.secondary_bitmap_revision = Some(kv.mod_revision);
                continue;
            }
            if kv.key == extra_key {
                // The added ServiceCIDRs stay; their addresses are rebuilt below.
                let stored = crate::cidr_ranges::ExtraRanges::decode(&kv.value)
                    .map_err(ApiError::internal)?;
                fresh.extra.service_cidrs = stored.service_cidrs;
                rebuilt.extra_revision = Some(kv.mod_revision);
                continue;
            }
            if kv.key.starts_with(&address_prefix) {
                if let Ok(Object::IpAddress(object)) = typed_from_entry(Kind::IpAddress, &kv.value)
                    && !ip_addresses::managed(&object)
                    && let Some(ip) = ip_addresses::address(&object)
                {
                    reservations.push(ip);
                }
                continue;
            }
            if kv.key == default_cidr_key {
                // Written with other flags: its ranges stay allocated (see `track_default`).
                // `servicecidrs/` sorts after `ranges/` and before `services/`.
                if let Ok(Object::ServiceCidr(cidr)) =
                    typed_from_entry(Kind::ServiceCidr, &kv.value)
                {
                    service_cidr::track_default(&cidr, &self.ranges, &mut fresh.extra);
                }
                continue;
            }
            if !kv.key.starts_with(&service_prefix) {
                continue;
            }
            let Object::Service(svc) = typed_from_entry(Kind::Service, &kv.value)? else {
                continue;
            };
            rebuilt.services += 1;
            let (ips, ports) = service::held(&svc);
            // The Services come after the ranges key in the dump (`ranges/` sorts before
            // `services/`), so the added ServiceCIDRs are known here.
            for ip in ips {
                if let Err(e) = fresh.cluster_ips().record(ip) {
                    tracing::warn!(service = %kv.key, %ip, error = %e, "ClusterIP not restored into the rebuilt bitmap");
                }
            }
            for port in ports {
                if let Err(e) = fresh.ports.allocate(port) {
                    tracing::warn!(service = %kv.key, port, error = %e, "nodePort not restored into the rebuilt bitmap");
                }
            }
        }
        for ip in reservations {
            if let Err(e) = fresh.cluster_ips().record(ip) {
                tracing::warn!(%ip, error = %e, "reserved IPAddress not restored into the rebuilt bitmap");
            }
        }
        rebuilt.allocators = fresh;
        Ok(rebuilt)
    }

    /// Compares the stored bitmaps with what the stored Services hold, at one revision.
    pub async fn verify(&self) -> Result<Verification, ApiError> {
        let page = self
            .store
            .backend()
            .list(ListRequest {
                prefix: format!("{}/", self.store.prefix()),
                start: None,
                revision: None,
                limit: None,
            })
            .await?;
        verify_dump(&page.kvs, self.store.prefix(), &self.ranges)
    }
}

/// The allocation documents a verification read (NodePort and ClusterIP bitmaps, the secondary
/// family's, the added ServiceCIDRs' allocations) with their revisions then: a repair based on
/// that verification commits only if none of them changed since, or another writer allocated
/// meanwhile and the report is out of date.
#[derive(Clone)]
struct CheckedAllocations {
    node_ports: String,
    cluster_ips: String,
    secondary_cluster_ips: Option<String>,
    service_cidrs: String,
    revisions: AllocationRevisions,
}

/// The revisions of the documents of [`CheckedAllocations`], in its order (NodePort and
/// ClusterIP bitmaps together, as [`Verification::bitmap_revisions`]).
type AllocationRevisions = (
    (Option<Revision>, Option<Revision>),
    Option<Revision>,
    Option<Revision>,
);

impl CheckedAllocations {
    /// Refuses when any of the documents changed since the verification.
    fn still_current(&self, txn: &Txn<'_>) -> Result<(), ApiError> {
        let revision = |key: &str| txn.get(key).map(|e| e.mod_revision);
        let now = (
            (revision(&self.node_ports), revision(&self.cluster_ips)),
            self.secondary_cluster_ips.as_deref().and_then(revision),
            revision(&self.service_cidrs),
        );
        if now != self.revisions {
            return Err(ApiError::internal(
                "the allocations changed since they were checked",
            ));
        }
        Ok(())
    }
}

impl Registry {
    /// What `report` read of the allocations, to repair by it only while it is current.
    fn checked_allocations(&self, report: &Verification) -> CheckedAllocations {
        let prefix = self.store.prefix();
        CheckedAllocations {
            node_ports: storage::keys::node_port_range(prefix),
            cluster_ips: storage::keys::service_ip_range(prefix),
            secondary_cluster_ips: self.secondary_ip_key(),
            service_cidrs: storage::keys::service_cidr_ranges(prefix),
            revisions: (
                report.bitmap_revisions,
                report.secondary_bitmap_revision,
                report.extra_revision,
            ),
        }
    }

    /// Frees the bits `report` found leaked (set in a bitmap, held by no Service), if the bitmap
    /// has not changed since the check; never touches a Service, and leaves missing or doubled
    /// allocations alone (they are reported). Returns how many bits were freed.
    pub async fn repair_leaks(&self, report: &Verification) -> Result<usize, ApiError> {
        if report.leaked_ports.is_empty() && report.leaked_ips.is_empty() {
            return Ok(0);
        }
        let (ports, ips) = (report.leaked_ports.clone(), report.leaked_ips.clone());
        let checked = self.checked_allocations(report);
        let done = self
            .store
            .mutate(Vec::new(), move |txn| {
                checked.still_current(txn)?;
                let allocators = txn.allocators()?;
                for port in &ports {
                    allocators.ports.release(*port);
                }
                for ip in &ips {
                    allocators.release_ip(*ip);
                }
                Ok(ports.len() + ips.len())
            })
            .await?;
        Ok(done.value)
    }

    /// Marks in the bitmaps the addresses `report` found held by IPAddress objects but free
    /// there (the objects are the truth of allocation, the bitmaps their cache), if no
    /// allocation changed since the check. Returns how many were marked.
    pub async fn mark_unmarked_objects(&self, report: &Verification) -> Result<usize, ApiError> {
        if report.unmarked_objects.is_empty() {
            return Ok(0);
        }
        let checked = self.checked_allocations(report);
        let unmarked = report.unmarked_objects.clone();
        let done = self
            .store
            .mutate(Vec::new(), move |txn| {
                checked.still_current(txn)?;
                let allocators = txn.allocators()?;
                let mut marked = 0;
                for ip in &unmarked {
                    if allocators.cluster_ips().allocate(*ip).is_ok() {
                        marked += 1;
                    }
                }
                Ok(marked)
            })
            .await?;
        Ok(done.value)
    }

    /// Writes the IPAddress objects `report` found missing and removes the stale ones, if no
    /// allocation changed since the check (as kube's repair loop keeps IPAddresses in step).
    pub async fn repair_ip_addresses(&self, report: &Verification) -> Result<usize, ApiError> {
        if report.missing_ip_addresses.is_empty() && report.stale_ip_addresses.is_empty() {
            return Ok(0);
        }
        let prefix: Arc<str> = self.store.prefix().into();
        let checked = self.checked_allocations(report);
        let (missing, stale) = (
            report.missing_ip_addresses.clone(),
            report.stale_ip_addresses.clone(),
        );
        let stale_keys: Vec<String> = stale
            .iter()
            .map(|ip| Kind::IpAddress.key(&prefix, None, &ip.to_string()))
            .collect();
        let done = self
            .store
            .mutate(stale_keys, move |txn| {
                checked.still_current(txn)?;
                for ip in &stale {
                    let key = Kind::IpAddress.key(&prefix, None, &ip.to_string());
                    if txn.get(&key).is_some() {
                        txn.delete(key);
                    }
                }
                for (ip, namespace, name) in &missing {
                    let holder = Service {
                        metadata: ObjectMeta {
                            namespace: Some(namespace.clone()),
                            name: Some(name.clone()),
                            ..Default::default()
                        },
                        ..Default::default()
                    };
                    let object =
                        Object::IpAddress(Box::new(ip_addresses::for_service(*ip, &holder)));
                    txn.put(
                        Kind::IpAddress.key(&prefix, None, &ip.to_string()),
                        encode_stored(&object),
                    );
                }
                Ok(stale.len() + missing.len())
            })
            .await?;
        Ok(done.value)
    }

    /// One round of the verification loop: compare, log, count, free leaks.
    pub async fn verify_and_repair(&self) -> Result<Verification, ApiError> {
        let report = self.verify().await?;
        let stats = self.store.stats();
        stats
            .verifications
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        stats.differences.store(
            report.differences() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        if report.is_consistent() {
            tracing::debug!(
                services = report.services,
                "allocation bitmaps match the stored Services"
            );
            return Ok(report);
        }
        tracing::error!(
            leaked_ports = ?report.leaked_ports,
            missing_ports = ?report.missing_ports,
            duplicate_ports = ?report.duplicate_ports,
            leaked_ips = ?report.leaked_ips,
            missing_ips = ?report.missing_ips,
            duplicate_ips = ?report.duplicate_ips,
            "allocation bitmaps differ from the stored Services"
        );
        match self.repair_leaks(&report).await {
            Ok(0) => {}
            Ok(freed) => {
                stats
                    .leaks_repaired
                    .fetch_add(freed as u64, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(freed, "freed leaked allocations that no Service holds");
            }
            Err(err) => tracing::warn!(error = %err, "leaked allocations not freed this round"),
        }
        match self.mark_unmarked_objects(&report).await {
            Ok(0) => {}
            Ok(marked) => tracing::warn!(
                marked,
                "marked in the bitmaps the addresses IPAddress objects hold"
            ),
            Err(err) => {
                tracing::warn!(error = %err, "bitmaps not brought to the IPAddress objects this round")
            }
        }
        match self.repair_ip_addresses(&report).await {
            Ok(0) => {}
            Ok(fixed) => tracing::warn!(
                fixed,
                "IPAddress objects written again to match the Services"
            ),
            Err(err) => tracing::warn!(error = %err, "IPAddress objects not repaired this round"),
        }
        Ok(report)
    }
}

impl Registry {
    /// kube-apiserver's default ServiceCIDR controller between starts: the default ServiceCIDR
    /// `kubernetes`, once a deletion has removed it, is created again from the flags (kube's
    /// `sync` does it on its next round). Returns whether it was created.
    pub async fn ensure_default_service_cidr(&self) -> Result<bool, ApiError> {
        let key = self.key(Kind::ServiceCidr, None, service_cidr::DEFAULT_NAME);
        let ranges = self.ranges.clone();
        let done = self
            .store
            .mutate(vec![key.clone()], move |txn| {
                if txn.get(&key).is_some() {
                    return Ok(false);
                }
                let cidr = service_cidr::default_service_cidr(&ranges, new_uid(), now());
                let extra = &txn.allocators()?.extra;
                let mut tracked = extra.clone();
                service_cidr::track_default(&cidr, &ranges, &mut tracked);
                if &tracked != extra {
                    txn.allocators()?.extra = tracked;
                }
                txn.put(
                    key.clone(),
                    encode_stored(&Object::ServiceCidr(Box::new(cidr))),
                );
                Ok(true)
            })
            .await?;
        Ok(done.value)
    }

    /// The deletion side of kube-controller-manager's ServiceCIDR controller: every ServiceCIDR
    /// marked for deletion whose addresses no Service holds any more (or another Ready range
    /// covers) loses its finalizer and goes, in one write. Returns how many went.
    pub async fn finish_service_cidr_deletions(&self) -> Result<usize, ApiError> {
        let page = self
            .store
            .backend()
            .list(ListRequest {
                prefix: Kind::ServiceCidr.list_prefix(self.store.prefix(), None),
                start: None,
                revision: None,
                limit: None,
            })
            .await?;
        let mut removed = 0;
        for kv in page.kvs {
            let Ok(Object::ServiceCidr(cidr)) = typed_from_entry(Kind::ServiceCidr, &kv.value)
            else {
                continue;
            };
            let waiting = cidr.metadata.deletion_timestamp.is_some()
                && cidr
                    .metadata
                    .finalizers
                    .iter()
                    .flatten()
                    .any(|f| f == service_cidr::FINALIZER);
            if !waiting {
                continue;
            }
            let key = kv.key.clone();
            let done = self
                .store
                .mutate(vec![key.clone()], move |txn| {
                    let Some(entry) = txn.get(&key) else {
                        return Ok(false);
                    };
                    let Object::ServiceCidr(mut cidr) =
                        typed_from_entry(Kind::ServiceCidr, &entry.value)?
                    else {
                        return Ok(false);
                    };
                    if cidr.metadata.deletion_timestamp.is_none()
                        || service_cidr::in_use(&cidr, txn.allocators()?)
                    {
                        return Ok(false);
                    }
                    if let Some(f) = cidr.metadata.finalizers.as_mut() {
                        f.retain(|f| f != service_cidr::FINALIZER);
                    }
                    let object = Object::ServiceCidr(cidr);
                    if has_finalizers(&object) {
                        // Someone else's finalizer: only ours goes.
                        txn.put(key.clone(), encode_stored(&object));
                        return Ok(false);
                    }
                    remove_object(txn, &key, &object, &[])?;
                    Ok(true)
                })
                .await?;
            removed += usize::from(done.value);
        }
        Ok(removed)
    }
}

/// [`Registry::verify`] over a dump of the keyspace (also used offline on a stopped server's data).
pub fn verify_dump(
    kvs: &[KeyValue],
    prefix: &str,
    ranges: &ServiceRanges,
) -> Result<Verification, ApiError> {
    let np_key = storage::keys::node_port_range(prefix);
    let ip_key = storage::keys::service_ip_range(prefix);
    let secondary_key = storage::keys::secondary_service_ip_range(prefix);
    let extra_key = storage::keys::service_cidr_ranges(prefix);
    let service_prefix = Kind::Service.list_prefix(prefix, None);
    let address_prefix = Kind::IpAddress.list_prefix(prefix, None);
    let mut report = Verification::default();
    // IPAddress objects of the allocator, by address: the Service they name.
    let mut objects = std::collections::BTreeMap::<IpAddr, (String, String)>::new();
    // ClusterIPs of the Services, with the Service.
    let mut holders = std::collections::BTreeMap::<IpAddr, (String, String)>::new();
    let mut ports_held = std::collections::BTreeMap::<u16, usize>::new();
    let mut ips_held = std::collections::BTreeMap::<IpAddr, usize>::new();
    let mut bitmap_ports = BTreeSet::new();
    let mut bitmap_ips = BTreeSet::new();
    let mut reservations = BTreeSet::new();
    for kv in kvs {
        if kv.key == np_key {
            report.bitmap_revisions.0 = Some(kv.mod_revision);
            let snap = crate::store::decode_range(&kv.value).map_err(ApiError::internal)?;
            let mut a = nodeport_alloc::port::Allocator::new(ranges.node_ports);
            a.restore(&snap.range, &snap.data)
                .map_err(ApiError::internal)?;
            bitmap_ports.extend(a.iter());
        } else if kv.key == ip_key {
            report.bitmap_revisions.1 = Some(kv.mod_revision);
            let snap = crate::store::decode_range(&kv.value).map_err(ApiError::internal)?;
            let mut a = nodeport_alloc::ip::Allocator::new(ranges.cluster_ips)
                .map_err(ApiError::internal)?;
            a.restore(&snap.range, &snap.data)
                .map_err(ApiError::internal)?;
            bitmap_ips.extend(a.iter());
        } else if kv.key == secondary_key
            && let Some(cidr) = ranges.secondary_cluster_ips
        {
            report.secondary_bitmap_revision = Some(kv.mod_revision);
            let snap = crate::store::decode_range(&kv.value).map_err(ApiError::internal)?;
            let mut a = nodeport_alloc::ip::Allocator::new(cidr).map_err(ApiError::internal)?;
            a.restore(&snap.range, &snap.data)
                .map_err(ApiError::internal)?;
            bitmap_ips.extend(a.iter());
        } else if kv.key.starts_with(&address_prefix) {
            let Object::IpAddress(object) = typed_from_entry(Kind::IpAddress, &kv.value)? else {
                continue;
            };
            let Some(ip) = ip_addresses::address(&object) else {
                continue;
            };
            if ip_addresses::managed(&object) {
                let parent = object.spec.map(|s| s.parent_ref).unwrap_or_default();
                objects.insert(ip, (parent.namespace.unwrap_or_default(), parent.name));
            } else {
                // A user's reservation holds its address like a Service.
                *ips_held.entry(ip).or_default() += 1;
                reservations.insert(ip);
            }
        } else if kv.key == extra_key {
            report.extra_revision = Some(kv.mod_revision);
            let stored =
                crate::cidr_ranges::ExtraRanges::decode(&kv.value).map_err(ApiError::internal)?;
            bitmap_ips.extend(stored.allocated);
        } else if kv.key.starts_with(&service_prefix) {
            let Object::Service(svc) = typed_from_entry(Kind::Service, &kv.value)? else {
                continue;
            };
            report.services += 1;
            let (ips, ports) = service::held(&svc);
            for ip in ips {
                *ips_held.entry(ip).or_default() += 1;
                holders.insert(
                    ip,
                    (
                        svc.metadata.namespace.clone().unwrap_or_default(),
                        svc.metadata.name.clone().unwrap_or_default(),
                    ),
                );
            }
            for p in ports {
                *ports_held.entry(p).or_default() += 1;
            }
        }
    }
    for (p, n) in &ports_held {
        if *n > 1 {
            report.duplicate_ports.push(*p);
        }
        if !bitmap_ports.contains(p) {
            report.missing_ports.push(*p);
        }
    }
    for (ip, n) in &ips_held {
        if *n > 1 {
            report.duplicate_ips.push(*ip);
        }
        if !bitmap_ips.contains(ip) {
            report.missing_ips.push(*ip);
            let reserved = reservations.contains(ip);
            if reserved || holders.get(ip).is_some_and(|h| objects.get(ip) == Some(h)) {
                report.unmarked_objects.push(*ip);
            }
        }
    }
    report.leaked_ports = bitmap_ports
        .into_iter()
        .filter(|p| !ports_held.contains_key(p))
        .collect();
    report.leaked_ips = bitmap_ips
        .into_iter()
        .filter(|ip| !ips_held.contains_key(ip))
        .collect();
    for (ip, holder) in &holders {
        if objects.get(ip) != Some(holder) {
            report
                .missing_ip_addresses
                .push((*ip, holder.0.clone(), holder.1.clone()));
        }
    }
    report.stale_ip_addresses = objects
        .into_iter()
        .filter(|(ip, owner)| holders.get(ip) != Some(owner))
        .map(|(ip, _)| ip)
        .collect();
    Ok(report)
}

/// kube-apiserver's `NamespaceLifecycle` admission for a create, inside the create's
/// transaction: the namespace must exist and must not be Terminating.
fn check_namespace_open(
    txn: &Txn<'_>,
    ns_key: &str,
    namespace: &str,
    kind: Kind,
    name: &str,
) -> Result<(), ApiError> {
    match txn.get(ns_key) {
        None => Err(ApiError::not_found(Kind::Namespace.subject(), namespace)),
        Some(entry) if namespace::is_terminating(&entry.value) => {
            Err(namespace::terminating_error(kind, name, namespace))
        }
        Some(_) => Ok(()),
    }
}

fn check_preconditions(
    kind: Kind,
    name: &str,
    object: &Value,
    revision: Revision,
    pre: &Preconditions,
) -> Result<(), ApiError> {
    if let Some(uid) = pre.uid.as_deref() {
        let actual = object
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or("");
        if uid != actual {
            return Err(ApiError::conflict(
                kind.subject(),
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {actual}"
                ),
            ));
        }
    }
    if let Some(rv) = pre.resource_version.as_deref() {
        let actual = revision.to_string();
        if rv != actual {
            return Err(ApiError::conflict(
                kind.subject(),
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {actual}"
                ),
            ));
        }
    }
    Ok(())
}

/// `metadata.finalizers` is not empty: a DELETE only marks the object.
fn has_finalizers(object: &Object) -> bool {
    object
        .metadata()
        .finalizers
        .as_ref()
        .is_some_and(|f| !f.is_empty())
}

/// `ShouldDeleteDuringUpdate`: the object is being deleted and its last finalizer is gone (for
/// a namespace, also the last of `spec.finalizers`), so the update removes it.
fn finalized(object: &Object) -> bool {
    object.metadata().deletion_timestamp.is_some()
        && match object {
            Object::Namespace(ns) => !namespace::held(ns),
            _ => !has_finalizers(object),
        }
}

/// Removes a stored object with its companion keys; what a Service held is released.
fn remove_object(
    txn: &mut Txn<'_>,
    key: &str,
    object: &Object,
    companions: &[String],
) -> Result<(), ApiError> {
    if let Object::Service(svc) = object {
        service::release(svc, txn.allocators()?);
    }
    if let Object::IpAddress(ip) = object {
        ip_addresses::on_remove(ip, txn.allocators()?);
    }
    if let Object::ServiceCidr(cidr) = object {
        service_cidr::on_remove(cidr, &mut txn.allocators()?.extra);
    }
    for companion in companions {
        if txn.get(companion).is_some() {
            txn.delete(companion.clone());
        }
    }
    txn.delete(key.to_owned());
    if let Object::Service(svc) = object
        && let Some((prefix, _)) = key.split_once("/services/specs/")
    {
        // `<prefix>/services/specs/<namespace>/<name>`: its addresses' objects go with it.
        ip_addresses::sync(txn, prefix, Some(svc), None);
    }
    Ok(())
}

/// An applied configuration, checked as kube checks it before merging: an object naming this
/// endpoint's group, version and kind (apply bodies are not defaulted from the URL: kube's
/// `versionCheckManager` answers `invalid object type: /v1, Kind=`), the name of the URL, the
/// namespace of the URL (filled in when left out). Returned in the stored form.
fn apply_config(
    kind: Kind,
    namespace: Option<&str>,
    name: &str,
    config: Value,
) -> Result<Value, ApiError> {
    let Value::Object(map) = &config else {
        return Err(ApiError::bad_request(format!(
            "error decoding YAML: the applied configuration is not an object: {config}"
        )));
    };
    let text = |key: &str| map.get(key).and_then(Value::as_str).unwrap_or("");
    let api_version = text("apiVersion");
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    if api_version != kind.api_version() || text("kind") != kind.kind() {
        return Err(ApiError::bad_request(format!(
            "invalid object type: {group}/{version}, Kind={}",
            text("kind")
        )));
    }
    let mut config = config;
    if let Some(Value::Object(meta)) = config.get_mut("metadata") {
        let given = meta.get("name").and_then(Value::as_str).unwrap_or("");
        if given != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({given}) does not match the name on the URL ({name})"
            )));
        }
        if let Some(url_ns) = namespace.filter(|_| kind.namespaced()) {
            match meta.get("namespace").and_then(Value::as_str) {
                None | Some("") => {
                    meta.insert("namespace".into(), Value::String(url_ns.to_owned()));
                }
                Some(ns) if ns != url_ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                Some(_) => {}
            }
        }
    } else {
        return Err(ApiError::bad_request(format!(
            "the name of the object () does not match the name on the URL ({name})"
        )));
    }
    Ok(config)
}

/// `BeginCreate` and the strategy's `PrepareForCreate` and validation, before the store is read:
/// the namespace from the URL, `generateName`, the system fields, defaults, and (but for
/// Services, which validate after allocation) validation. Returns whether the client set a
/// `resourceVersion`, which the store refuses.
fn admit_create(
    kind: Kind,
    namespace: Option<&str>,
    object: &mut Object,
    dry_run: bool,
) -> Result<bool, ApiError> {
    let resource_version_set;
    {
        let meta = object.metadata_mut();
        if kind.namespaced() {
            let url_ns = namespace.unwrap_or("");
            match meta.namespace.as_deref() {
                None | Some("") => meta.namespace = Some(url_ns.to_owned()),
                Some(ns) if ns != url_ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => {}
            }
        } else {
            meta.namespace = None;
        }
        if meta.name.as_deref().unwrap_or("").is_empty()
            && let Some(prefix) = meta.generate_name.as_deref().filter(|p| !p.is_empty())
        {
            meta.name = Some(generate_name(prefix));
        }
        // etcd3's check parses the value as a number and lets 0 (and anything that does
        // not parse) through; a dry run never reaches it.
        resource_version_set = !dry_run
            && meta
                .resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|v| v != 0);
        reset_for_create(meta);
    }
    kinds::prepare_create(object);
    let name = object.name().to_owned();
    if let Object::Event(event) = &*object {
        let errs = event::validate_create(kind, event);
        if !errs.is_empty() {
            return Err(invalid(kind, &name, errs));
        }
    } else if !matches!(object, Object::Service(_)) {
        let errs = kinds::validate(object);
        if !errs.is_empty() {
            return Err(invalid(kind, &name, errs));
        }
    } else {
        // Without a usable name there is no key; report it before allocating anything. The
        // rest of the metadata is judged with the spec, after allocation, as kube-apiserver
        // does (BeginCreate, then validation).
        let errs: Vec<_> =
            validation::object_meta(object.metadata(), true, validation::NameRule::Dns1035Label)
                .into_iter()
                .filter(|e| matches!(e.field.as_str(), "metadata.name" | "metadata.namespace"))
                .collect();
        if !errs.is_empty() {
            return Err(invalid(kind, &name, errs));
        }
    }
    Ok(resource_version_set)
}

/// Where a create writes.
struct CreateTarget<'a> {
    kind: Kind,
    key: &'a str,
    ns_key: Option<&'a str>,
    namespace: Option<&'a str>,
    ranges: &'a ServiceRanges,
    prefix: &'a str,
    dry_run: bool,
}

/// The part of a create inside the store's transaction: the namespace is open, the name free,
/// then allocation and the write.
fn store_create(
    txn: &mut Txn<'_>,
    target: &CreateTarget<'_>,
    mut object: Object,
) -> Result<Value, ApiError> {
    let kind = target.kind;
    let name = object.name().to_owned();
    if let (Some(ns_key), Some(ns)) = (target.ns_key, target.namespace) {
        check_namespace_open(txn, ns_key, ns, kind, &name)?;
    }
    if txn.get(target.key).is_some() {
        return Err(ApiError::already_exists(kind.subject(), &name));
    }
    if let Object::Service(svc) = &mut object {
        service::create(svc, txn.allocators()?, target.ranges)?;
    }
    if let Object::ServiceCidr(cidr) = &mut object {
        service_cidr::on_create(cidr, &mut txn.allocators()?.extra, now());
    }
    if let Object::IpAddress(ip) = &object
        && !ip_addresses::reserve(ip, txn.allocators()?)
    {
        return Err(ApiError::already_exists(kind.subject(), &name));
    }
    if target.dry_run {
        txn.set_dry_run();
    }
    txn.put(target.key.to_owned(), encode_stored(&object));
    // After the object: its write's resourceVersion is the first of the request's.
    if let Object::Service(svc) = &object {
        ip_addresses::sync(txn, target.prefix, None, Some(svc));
    }
    Ok(object.to_value())
}

/// The shared part of PUT and PATCH once the new object is decoded: optimistic concurrency,
/// immutable metadata, status handling, then the kind's update hooks.
fn apply_update(
    txn: &mut Txn<'_>,
    kind: Kind,
    old: &Object,
    old_revision: Revision,
    mut new: Object,
    status_only: bool,
    ranges: &ServiceRanges,
) -> Result<Object, ApiError> {
    let name = old.name().to_owned();
    if let Some(rv) = new
        .metadata()
        .resource_version
        .as_deref()
        .filter(|rv| !rv.is_empty())
        && (old_revision == 0 || rv != old_revision.to_string())
    {
        return Err(ApiError::modified(kind.subject(), &name));
    }
    if status_only {
        // The status subresource changes status and nothing else.
        let mut merged = old.clone();
        merged.set_status_from(&new);
        new = merged;
    } else {
        if kind.has_status() {
            new.set_status_from(old);
        }
        let old_meta = old.metadata();
        let meta = new.metadata_mut();
        meta.uid = old_meta.uid.clone();
        meta.creation_timestamp = old_meta.creation_timestamp.clone();
        meta.deletion_timestamp = old_meta.deletion_timestamp.clone();
        meta.deletion_grace_period_seconds = old_meta.deletion_grace_period_seconds;
        if old_meta.deletion_timestamp.is_some() {
            // ValidateNoNewFinalizers.
            let old_finalizers = old_meta.finalizers.as_deref().unwrap_or_default();
            let mut added: Vec<String> = meta
                .finalizers
                .iter()
                .flatten()
                .filter(|f| !old_finalizers.contains(f))
                .cloned()
                .collect();
            if !added.is_empty() {
                added.sort();
                added.dedup();
                return Err(invalid(
                    kind,
                    &name,
                    vec![crate::error::FieldError::forbidden(
                        "metadata.finalizers",
                        format!(
                            "no new finalizers can be added if the object is being deleted, found new finalizers {}",
                            crate::error::GoValue::Strings(&added)
                        ),
                    )],
                ));
            }
        }
        meta.generate_name = meta
            .generate_name
            .take()
            .or_else(|| old_meta.generate_name.clone());
        meta.managed_fields = None;
        if let Some(uid) = &meta.uid
            && old_meta.uid.as_ref() != Some(uid)
        {
            return Err(ApiError::conflict(kind.subject(), &name, "UID mismatch"));
        }
    }
    new.metadata_mut().resource_version = None;
    match (&mut new, old) {
        (Object::Service(new_svc), Object::Service(old_svc)) => {
            if status_only {
                let errs = service::validate_status(new_svc);
                if !errs.is_empty() {
                    return Err(invalid(kind, &name, errs));
                }
            } else {
                service::update(old_svc, new_svc, txn.allocators()?, ranges)?;
            }
        }
        (Object::IpAddress(new_ip), Object::IpAddress(old_ip)) => {
            let mut errs = ip_addresses::validate(new_ip);
            errs.extend(ip_addresses::validate_update(old_ip, new_ip));
            if !errs.is_empty() {
                return Err(invalid(kind, &name, errs));
            }
        }
        (Object::ServiceCidr(new_cidr), Object::ServiceCidr(old_cidr)) => {
            let mut errs = service_cidr::validate(new_cidr);
            errs.extend(service_cidr::validate_update(old_cidr, new_cidr));
            if !errs.is_empty() {
                return Err(invalid(kind, &name, errs));
            }
            // A status write may make it Ready or not: allocation follows in this write.
            service_cidr::track_any(new_cidr, ranges, &mut txn.allocators()?.extra);
        }
        (Object::Namespace(new_ns), Object::Namespace(old_ns)) => {
            // The namespace strategy's PrepareForUpdate: finalizers change only through
            // `finalize`, the phase only through `status` (and deletion).
            if !status_only {
                new_ns.spec = old_ns.spec.clone();
            }
            let errs = kinds::validate(&new);
            if !errs.is_empty() {
                return Err(invalid(kind, &name, errs));
            }
        }
        (Object::Event(new_event), Object::Event(old_event)) => {
            let errs = event::validate_update(kind, new_event, old_event);
            if !errs.is_empty() {
                return Err(invalid(kind, &name, errs));
            }
        }
        (Object::EndpointSlice(new_slice), Object::EndpointSlice(old_slice)) => {
            let generation = old_slice.metadata.generation.unwrap_or(1);
            let changed = new_slice.endpoints != old_slice.endpoints
                || new_slice.ports != old_slice.ports
                || new_slice.address_type != old_slice.address_type;
            new_slice.metadata.generation = Some(if changed { generation + 1 } else { generation });
            let mut errs = kinds::validate(&new);
            if let (Object::EndpointSlice(new_slice), false) = (&new, status_only)
                && new_slice.address_type != old_slice.address_type
            {
                // ValidateEndpointSliceUpdate.
                errs.push(crate::error::FieldError::invalid(
                    "addressType",
                    crate::error::GoValue::Str(&new_slice.address_type),
                    "field is immutable",
                ));
            }
            if !errs.is_empty() {
                return Err(invalid(kind, &name, errs));
            }
        }
        _ => {
            let errs = kinds::validate(&new);
            if !errs.is_empty() {
                return Err(invalid(kind, &name, errs));
            }
        }
    }
    Ok(new)
}

fn finish(done: Done<Value>, warnings: Vec<String>, created: bool) -> Written {
    let mut object = done.value;
    if let Some(rev) = done.revision {
        set_resource_version(&mut object, rev);
    }
    Written {
        object,
        warnings,
        created,
    }
}

/// A `Status` with `status: Success` for a deleted object (what the generic store returns when it
/// does not return the object itself).
pub fn success_status(kind: Kind, object: &Value) -> Value {
    let mut details = json!({
        "name": object.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
        "kind": kind.resource(),
        "uid": object.pointer("/metadata/uid").cloned().unwrap_or(Value::Null),
    });
    if !kind.group().is_empty() {
        details["group"] = Value::String(kind.group().into());
    }
    json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success","details":details})
}

/// What [`Registry::object_keys`] finds for one object.
struct ObjectKeys {
    /// The object's own key.
    key: String,
    /// Its namespace's key, when the write checks that the namespace is open.
    ns_key: Option<String>,
    /// Its companions' keys (removed with it).
    extra: Vec<String>,
    /// Every key the write declares.
    all: Vec<String>,
}
