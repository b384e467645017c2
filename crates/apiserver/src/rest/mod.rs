//! The REST layer: Kubernetes' URL scheme, verbs, content negotiation and error rendering.
//!
//! Resource paths are parsed by hand (`/api/v1/namespaces/{ns}/services/{name}/status`, ...) in
//! one fallback handler, because the scheme is more regular than a router table can say (a
//! namespace's own subresources share the shape of a namespaced collection).

pub mod discovery;
mod json;
pub mod limits;
mod list_types;
pub mod protobuf;
pub mod table;
pub mod watch;
mod yaml;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::ranges;
use crate::registry::selector::{FieldSelector, LabelSelector};
use crate::registry::{
    FieldValidation, ListOptions, PatchType, Preconditions, Registry, WriteOptions,
};
use crate::resource::Kind;

/// Largest request body accepted (kube-apiserver's `MaxRequestBodyBytes`, 3 MiB).
pub const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;

/// Settings of the REST layer.
#[derive(Debug, Clone)]
pub struct Config {
    /// How often a watch with `allowWatchBookmarks=true` gets a BOOKMARK. Default 60 s, about
    /// kube-apiserver's rhythm (it sends one a minute, and before a watch times out).
    pub bookmark_interval: Duration,
    /// Longest watch when the client gives no `timeoutSeconds`. Default 30 minutes
    /// (kube-apiserver picks between `--min-request-timeout` and twice that, 30-60 minutes).
    pub watch_timeout: Duration,
    /// The address clients reach this server at, for `/api`'s `serverAddressByClientCIDRs`.
    pub server_address: String,
    /// In-flight limits and the request timeout.
    pub limits: limits::Config,
    /// How long a watch may wait for its client to read before the server closes it. Default
    /// 30 s: the watch's buffer (256 chunks) is full by then, and the client has read nothing
    /// for that long. kube-apiserver likewise closes a watcher whose buffer stays full
    /// ("Forcing watcher close due to unresponsiveness").
    pub unresponsive_watch_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            bookmark_interval: Duration::from_secs(60),
            watch_timeout: Duration::from_secs(30 * 60),
            server_address: "127.0.0.1:6443".into(),
            limits: limits::Config::default(),
            unresponsive_watch_timeout: Duration::from_secs(30),
        }
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The registry.
    pub registry: Registry,
    /// REST settings.
    pub config: Arc<Config>,
    /// Becomes `true` when the server begins to shut down: open watches end then (as
    /// kube-apiserver closes them), so a graceful shutdown does not wait for their clients.
    pub shutting_down: tokio::sync::watch::Receiver<bool>,
    /// The sender of [`AppState::shutting_down`].
    pub shut_down: Arc<tokio::sync::watch::Sender<bool>>,
    /// The in-flight limits and what they count.
    pub limits: Arc<limits::Limits>,
    /// The authorizers of `--authorization-mode` over the RBAC policy (`AlwaysAllow` over an
    /// empty policy until the server sets them).
    pub authorizer: crate::authz::Authorizer,
}

impl AppState {
    /// The state over `registry`, not shutting down.
    pub fn new(registry: Registry, config: Config) -> Self {
        let (shut_down, shutting_down) = tokio::sync::watch::channel(false);
        AppState {
            registry,
            limits: Arc::new(limits::Limits::new(config.limits)),
            config: Arc::new(config),
            shutting_down,
            shut_down: Arc::new(shut_down),
            authorizer: crate::authz::Authorizer::new(
                vec![crate::authz::Mode::AlwaysAllow],
                crate::authz::cache::PolicyCache::default(),
            ),
        }
    }
}

/// The whole HTTP API.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/version",
            get(|| async { json_response(StatusCode::OK, &discovery::version()) }),
        )
        .route("/healthz", get(|q| health(q, "healthz")))
        .route("/livez", get(|q| health(q, "livez")))
        .route("/readyz", get(ready))
        .route("/api", get(api_versions))
        .route(
            "/apis",
            get(|| async { json_response(StatusCode::OK, &discovery::api_group_list()) }),
        )
        .route(
            "/openapi/v3",
            get(|| async { json_response(StatusCode::OK, &discovery::openapi_v3_root()) }),
        )
        .route("/openapi/v3/{*path}", get(openapi_document))
        .route("/ranges", get(ranges_handler))
        .route("/metrics", get(metrics_handler))
        .route(
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            axum::routing::post(crate::authz::review::self_subject_access_review),
        )
        .route(
            "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
            axum::routing::post(crate::authz::review::self_subject_rules_review),
        )
        .route(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            axum::routing::post(crate::authz::review::subject_access_review),
        )
        .fallback(resource_handler)
        .layer(axum::middleware::from_fn_with_state(
            state.limits.clone(),
            limits::limit,
        ))
        .with_state(state)
}

/// `?verbose` on a health endpoint: the list of checks instead of `ok`.
fn verbose(query: &axum::extract::RawQuery) -> bool {
    query.0.as_deref().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "verbose" || p.starts_with("verbose="))
    })
}

/// `/healthz` and `/livez`: the process answers (kube-apiserver's `ping` check).
async fn health(query: axum::extract::RawQuery, endpoint: &'static str) -> String {
    if verbose(&query) {
        format!("[+]ping ok\n{endpoint} check passed\n")
    } else {
        "ok".to_owned()
    }
}

/// `/readyz`: ready when the storage answers (kube-apiserver's `etcd` check), 500 with the
/// failed check otherwise, as kube-apiserver words it; `?verbose` lists the checks.
async fn ready(query: axum::extract::RawQuery, State(state): State<AppState>) -> Response {
    let backend = state.registry.store().backend();
    match backend.check().await {
        Ok(()) if verbose(&query) => (
            StatusCode::OK,
            format!(
                "[+]ping ok\n[+]{} ok\nreadyz check passed\n",
                backend.name()
            ),
        )
            .into_response(),
        Ok(()) => (StatusCode::OK, "ok").into_response(),
        Err(err) => {
            if matches!(
                err,
                crate::storage::Error::Unavailable { .. } | crate::storage::Error::Timeout { .. }
            ) {
                // An outage, logged once by the backend.
                tracing::debug!(error = %crate::report(&err), "readiness check failed");
            } else {
                tracing::warn!(error = %crate::report(&err), "readiness check failed");
            }
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                // The cause goes to the log, not to an endpoint that needs no token.
                format!(
                    "[+]ping ok\n[-]{} failed: reason withheld\nreadyz check failed\n",
                    backend.name()
                ),
            )
                .into_response()
        }
    }
}

async fn api_versions(State(state): State<AppState>) -> Response {
    json_response(
        StatusCode::OK,
        &discovery::api_versions(&state.config.server_address),
    )
}

async fn openapi_document(axum::extract::Path(path): axum::extract::Path<String>) -> Response {
    match discovery::openapi_v3_document(&path) {
        Some(doc) => json_response(StatusCode::OK, &doc),
        None => ApiError::no_route().into_response(),
    }
}

async fn ranges_handler(State(state): State<AppState>) -> Response {
    match ranges::report(&state.registry).await {
        Ok(report) => json_response(StatusCode::OK, &report),
        Err(err) => err.into_response(),
    }
}

async fn metrics_handler(State(state): State<AppState>) -> Response {
    match ranges::metrics(&state.registry).await {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            text + &state.limits.metrics(),
        )
            .into_response(),
        Err(err) => err.into_response(),
    }
}

/// A JSON response.
pub fn json_response(status: StatusCode, value: &Value) -> Response {
    let body = serde_json::to_vec(value).expect("JSON values serialize");
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// What a resource path names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

/// Parses `/api/v1/...` and `/apis/<group>/<version>/...`.
fn parse_path(path: &str) -> Result<Option<Target>, ApiError> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segments.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Ok(None),
    };
    let kind_of = |resource: &str| Kind::from_path(group, version, resource);
    let target = match rest {
        [resource] => kind_of(resource).map(|kind| Target {
            kind,
            namespace: None,
            name: None,
            subresource: None,
        }),
        ["namespaces", ns, sub @ ("status" | "finalize")] if group.is_empty() => Some(Target {
            kind: Kind::Namespace,
            namespace: None,
            name: Some((*ns).to_owned()),
            subresource: Some((*sub).to_owned()),
        }),
        ["namespaces", ns, resource, more @ ..]
            if kind_of(resource).is_some_and(Kind::namespaced) =>
        {
            let kind = kind_of(resource).expect("checked");
            match more {
                [] => Some(Target {
                    kind,
                    namespace: Some((*ns).to_owned()),
                    name: None,
                    subresource: None,
                }),
                [name] => Some(Target {
                    kind,
                    namespace: Some((*ns).to_owned()),
                    name: Some((*name).to_owned()),
                    subresource: None,
                }),
                [name, sub] => Some(Target {
                    kind,
                    namespace: Some((*ns).to_owned()),
                    name: Some((*name).to_owned()),
                    subresource: Some((*sub).to_owned()),
                }),
                _ => None,
            }
        }
        [resource, name] => kind_of(resource)
            .filter(|k| !k.namespaced())
            .map(|kind| Target {
                kind,
                namespace: None,
                name: Some((*name).to_owned()),
                subresource: None,
            }),
        [resource, name, sub] => kind_of(resource)
            .filter(|k| !k.namespaced())
            .map(|kind| Target {
                kind,
                namespace: None,
                name: Some((*name).to_owned()),
                subresource: Some((*sub).to_owned()),
            }),
        _ => None,
    };
    if let Some(t) = &target
        && let Some(sub) = t.subresource.as_deref()
        && !(sub == "status" && t.kind.has_status())
        && !(sub == "finalize" && t.kind == Kind::Namespace)
    {
        return Ok(None);
    }
    Ok(target)
}

type Query = HashMap<String, String>;

fn parse_query(raw: Option<&str>) -> Query {
    raw.map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

fn flag(query: &Query, key: &str) -> bool {
    matches!(query.get(key).map(String::as_str), Some("true" | "1"))
}

/// kube's `ValidateFieldManager` of a write's options: at most 128 bytes, printable.
fn check_field_manager(method: &Method, manager: &str) -> Result<(), ApiError> {
    let mut errs = Vec::new();
    if manager.len() > crate::registry::managed_fields::MAX_MANAGER_LENGTH {
        errs.push(crate::error::FieldError::too_long(
            "fieldManager",
            crate::registry::managed_fields::MAX_MANAGER_LENGTH,
        ));
    }
    for (i, c) in manager.char_indices() {
        if c.is_control() {
            errs.push(crate::error::FieldError::invalid(
                "fieldManager",
                crate::error::GoValue::Str(manager),
                format!("invalid character U+{:04X} (at position {i})", u32::from(c)),
            ));
        }
    }
    if errs.is_empty() {
        return Ok(());
    }
    let kind = match *method {
        Method::POST => "CreateOptions",
        Method::PUT => "UpdateOptions",
        _ => "PatchOptions",
    };
    let resource = match *method {
        Method::POST => "createoptions",
        Method::PUT => "updateoptions",
        _ => "patchoptions",
    };
    Err(ApiError::invalid(
        crate::error::Subject {
            group: "meta.k8s.io",
            resource,
            kind,
        },
        "",
        errs,
    ))
}

fn write_options(
    query: &Query,
    method: &Method,
    headers: &HeaderMap,
) -> Result<WriteOptions, ApiError> {
    if let Some(manager) = query.get("fieldManager")
        && *method != Method::DELETE
    {
        check_field_manager(method, manager)?;
    }
    let dry_run = match query.get("dryRun").map(String::as_str) {
        None | Some("") => false,
        Some("All") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "Invalid dryRun value: {other:?}: supported values: \"All\""
            )));
        }
    };
    let user_agent = headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    Ok(WriteOptions {
        dry_run,
        field_validation: FieldValidation::parse(
            query
                .get("fieldValidation")
                .map(String::as_str)
                .unwrap_or(""),
        )?,
        manager: crate::registry::managed_fields::manager_name(
            query.get("fieldManager").map(String::as_str),
            user_agent,
        )
        .into(),
    })
}

fn list_options(kind: Kind, query: &Query) -> Result<ListOptions, ApiError> {
    let labels =
        LabelSelector::parse(query.get("labelSelector").map(String::as_str).unwrap_or(""))?;
    let fields = FieldSelector::parse(
        kind,
        query.get("fieldSelector").map(String::as_str).unwrap_or(""),
    )?;
    let limit = match query.get("limit").map(String::as_str) {
        None | Some("") => 0,
        Some(l) => l
            .parse::<i64>()
            .map_err(|_| ApiError::bad_request(format!("invalid limit: {l:?}")))?
            .max(0) as usize,
    };
    let exact_revision = match (
        query.get("resourceVersionMatch").map(String::as_str),
        query.get("resourceVersion").map(String::as_str),
    ) {
        (Some("Exact"), Some(rv)) => Some(parse_revision(rv)?),
        _ => None,
    };
    Ok(ListOptions {
        labels,
        fields,
        limit,
        continue_token: query.get("continue").cloned(),
        exact_revision,
    })
}

/// Parses a `resourceVersion` query value.
pub fn parse_revision(rv: &str) -> Result<i64, ApiError> {
    rv.parse::<i64>()
        .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv:?}")))
}

fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|err| {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
            while let Some(e) = source {
                if e.is::<http_body_util::LengthLimitError>() {
                    return ApiError::too_large(MAX_BODY_BYTES);
                }
                source = e.source();
            }
            ApiError::bad_request(format!("failed to read the request body: {err}"))
        })
}

/// The media types a create or update body may be sent in.
const BODY_MEDIA_TYPES: &str =
    "application/json, application/yaml, application/vnd.kubernetes.protobuf";

/// A decoded create or update body.
struct Decoded {
    value: Value,
    /// `Warning` headers about the body itself (keys given twice, under `fieldValidation=Warn`).
    warnings: Vec<String>,
}

/// Decodes a JSON, YAML or protobuf request body for an endpoint serving `kind`. A JSON key given
/// twice in one object is handled as kube-apiserver's strict decoder handles it: refused under
/// `fieldValidation=Strict` (the message names the duplicates, not also the unknown fields),
/// a warning under `Warn`, the later value silently under `Ignore`.
fn decode_body(
    content_type: &str,
    kind: Kind,
    bytes: &[u8],
    validation: FieldValidation,
) -> Result<Decoded, ApiError> {
    let value = match content_type {
        "application/yaml" | "application/x-yaml" | "text/yaml" => {
            yaml_serde::from_slice::<Value>(bytes).map_err(|e| {
                ApiError::bad_request(format!("error converting YAML to JSON: yaml: {e}"))
            })?
        }
        "" | "application/json" | "*/*" => {
            let (value, duplicates) = json::parse(bytes).map_err(|e| {
                ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
            })?;
            let messages: Vec<String> = duplicates
                .iter()
                .map(|path| format!("duplicate field {path:?}"))
                .collect();
            let warnings = match validation {
                _ if messages.is_empty() => Vec::new(),
                FieldValidation::Ignore => Vec::new(),
                FieldValidation::Warn => messages,
                FieldValidation::Strict => {
                    return Err(crate::registry::object::undecodable(
                        kind,
                        format!("strict decoding error: {}", messages.join(", ")),
                    ));
                }
            };
            return Ok(Decoded { value, warnings });
        }
        protobuf::MEDIA_TYPE => protobuf::decode_object(bytes, kind).map_err(protobuf_error)?,
        _ => {
            return Err(ApiError::unsupported_media_type(format!(
                "the body of the request was in an unknown format - accepted media types include: {BODY_MEDIA_TYPES}"
            )));
        }
    };
    Ok(Decoded {
        value,
        warnings: Vec::new(),
    })
}

/// Decodes a DELETE body (`DeleteOptions`): JSON, or protobuf as client-go's typed clients send.
fn decode_delete_options(content_type: &str, bytes: &[u8]) -> Result<Value, ApiError> {
    if content_type == protobuf::MEDIA_TYPE {
        return protobuf::decode_delete_options(bytes).map_err(protobuf_error);
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("couldn't decode DeleteOptions: {e}")))
}

/// A body that is not valid protobuf is the client's mistake (400); valid protobuf of a kind
/// this server does not decode is an unsupported format (415).
fn protobuf_error(err: protobuf::Error) -> ApiError {
    if err.is_unsupported() {
        ApiError::unsupported_media_type(err.to_string())
    } else {
        ApiError::bad_request(crate::report(&err))
    }
}

/// The media type of a server-side apply (`types.ApplyYAMLPatchType`; YAML, so JSON too).
const APPLY_PATCH: &str = "application/apply-patch+yaml";

/// kube's `ValidatePatchOptions`: an apply names its `fieldManager`; `force` is only for applies.
fn apply_options(query: &Query, apply: bool) -> Result<(), ApiError> {
    let patch_options = crate::error::Subject {
        group: "meta.k8s.io",
        resource: "patchoptions",
        kind: "PatchOptions",
    };
    let mut errs = Vec::new();
    if apply && query.get("fieldManager").is_none_or(String::is_empty) {
        errs.push(crate::error::FieldError::required(
            "fieldManager",
            "is required for apply patch",
        ));
    }
    if !apply && query.contains_key("force") {
        errs.push(crate::error::FieldError::forbidden(
            "force",
            "may not be specified for non-apply patch",
        ));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(patch_options, "", errs))
    }
}

/// The patch media types a PATCH accepts, in kube-apiserver's order. kube 1.33 adds
/// `application/apply-patch+cbor` only under the `CBORServingAndStorage` feature gate (alpha,
/// off by default: `k8s.io/apiserver/pkg/endpoints/installer.go`, the PATCH route's
/// `supportedTypes`), so with default gates it answers a CBOR apply with the 415 below, as
/// this server does.
const PATCH_MEDIA_TYPES: &str = "application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml";

/// kube's `PatchResource` check: a media type outside [`PATCH_MEDIA_TYPES`] is
/// `negotiation.NewUnsupportedMediaTypeError(patchTypes)`, a 415 `UnsupportedMediaType` whose
/// message lists the accepted types.
fn patch_type(content_type: &str) -> Result<PatchType, ApiError> {
    match content_type {
        "application/json-patch+json" => Ok(PatchType::Json),
        "application/merge-patch+json" => Ok(PatchType::Merge),
        "application/strategic-merge-patch+json" => Ok(PatchType::StrategicMerge),
        _ => Err(ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format - accepted media types include: {PATCH_MEDIA_TYPES}"
        ))),
    }
}

fn with_warnings(mut response: Response, warnings: &[String]) -> Response {
    for w in warnings {
        let text = format!("299 - {}", serde_json::to_string(w).unwrap_or_default());
        if let Ok(v) = HeaderValue::from_str(&text) {
            response.headers_mut().append("Warning", v);
        }
    }
    response
}

/// Strips `kind`/`apiVersion` from list items, as kube-apiserver's typed lists do.
fn list_item(mut item: Value) -> Value {
    if let Value::Object(m) = &mut item {
        m.remove("kind");
        m.remove("apiVersion");
    }
    item
}

async fn resource_handler(State(state): State<AppState>, request: Request) -> Response {
    match handle(&state, request).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn handle(state: &AppState, request: Request) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_owned();
    let query = parse_query(parts.uri.query());
    let accept = parts
        .headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();

    // Discovery documents live under the same prefixes as resources.
    if parts.method == Method::GET {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let doc = match segments.as_slice() {
            ["api", "v1"] => discovery::api_resource_list("", "v1"),
            ["apis", group] => discovery::api_group(group),
            ["apis", group, version] => discovery::api_resource_list(group, version),
            _ => None,
        };
        if let Some(doc) = doc {
            return Ok(json_response(StatusCode::OK, &doc));
        }
    }

    let Some(target) = parse_path(&path)? else {
        return Err(ApiError::no_route());
    };
    let registry = &state.registry;
    let kind = target.kind;
    let ns = target.namespace.as_deref();
    let ct = content_type(&parts.headers);
    let include_object = query
        .get("includeObject")
        .cloned()
        .unwrap_or_else(|| "Metadata".into());

    if kind.read_only() && parts.method != Method::GET {
        return Err(ApiError::method_not_supported(
            kind.subject(),
            &parts.method.as_str().to_ascii_lowercase(),
        ));
    }
    match (&parts.method, target.name.as_deref()) {
        (&Method::GET, None) => {
            let options = list_options(kind, &query)?;
            if flag(&query, "watch") {
                return watch::serve(
                    state.clone(),
                    kind,
                    target.namespace.clone(),
                    options,
                    &query,
                    &accept,
                )
                .await;
            }
            let list = registry.list(kind, ns, &options).await?;
            let rv = list.revision.to_string();
            if table::wants_table(&accept) {
                return Ok(json_response(
                    StatusCode::OK,
                    &table::table(
                        kind,
                        &list.items,
                        &rv,
                        list.continue_token.as_deref(),
                        &include_object,
                    ),
                ));
            }
            let mut metadata = json!({"resourceVersion": rv});
            if let Some(token) = &list.continue_token {
                metadata["continue"] = json!(token);
            }
            if let Some(remaining) = list.remaining {
                metadata["remainingItemCount"] = json!(remaining);
            }
            let items: Vec<Value> = list
                .items
                .into_iter()
                .map(|item| list_item(crate::registry::event::present(kind, item)))
                .collect();
            Ok(negotiated_response(
                StatusCode::OK,
                &json!({
                    "kind": kind.list_kind(),
                    "apiVersion": kind.api_version(),
                    "metadata": metadata,
                    "items": items,
                }),
                &accept,
            ))
        }
        (&Method::POST, None) => {
            if kind.namespaced() && ns.is_none() {
                return Err(ApiError::method_not_supported(kind.subject(), "create"));
            }
            let options = write_options(&query, &parts.method, &parts.headers)?;
            let body = decode_body(&ct, kind, &read_body(body).await?, options.field_validation)?;
            check_escalation(state, &parts.extensions, kind, ns, &body.value)?;
            let written = registry.create(kind, ns, body.value, options).await?;
            Ok(with_warnings(
                object_response(StatusCode::CREATED, kind, written.object, &accept),
                &[body.warnings, written.warnings].concat(),
            ))
        }
        (&Method::DELETE, None) => {
            let options = write_options(&query, &parts.method, &parts.headers)?;
            let list = list_options(kind, &query)?;
            let deleted = registry.delete_collection(kind, ns, &list, options).await?;
            let items: Vec<Value> = deleted
                .into_iter()
                .map(|item| list_item(crate::registry::event::present(kind, item)))
                .collect();
            Ok(json_response(
                StatusCode::OK,
                &json!({
                    "kind": kind.list_kind(),
                    "apiVersion": kind.api_version(),
                    "metadata": {},
                    "items": items,
                }),
            ))
        }
        (&Method::GET, Some(name)) => {
            let object = registry.get(kind, ns, name).await?;
            Ok(object_response(StatusCode::OK, kind, object, &accept))
        }
        (&Method::PUT, Some(name)) if target.subresource.as_deref() == Some("finalize") => {
            let options = write_options(&query, &parts.method, &parts.headers)?;
            let body = decode_body(&ct, kind, &read_body(body).await?, options.field_validation)?;
            let object = registry
                .finalize_namespace(name, body.value, options)
                .await?;
            Ok(object_response(StatusCode::OK, kind, object, &accept))
        }
        (_, Some(_)) if target.subresource.as_deref() == Some("finalize") => {
            Err(ApiError::method_not_supported(
                kind.subject(),
                &parts.method.as_str().to_ascii_lowercase(),
            ))
        }
        (&Method::PUT, Some(name)) => {
            let options = write_options(&query, &parts.method, &parts.headers)?;
            let body = decode_body(&ct, kind, &read_body(body).await?, options.field_validation)?;
            let status_only = target.subresource.is_some();
            check_escalation(state, &parts.extensions, kind, ns, &body.value)?;
            let written = registry
                .update(kind, ns, name, status_only, body.value, options)
                .await?;
            let code = if written.created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok(with_warnings(
                object_response(code, kind, written.object, &accept),
                &[body.warnings, written.warnings].concat(),
            ))
        }
        (&Method::PATCH, Some(name)) if ct == APPLY_PATCH => {
            let options = write_options(&query, &parts.method, &parts.headers)?;
            apply_options(&query, true)?;
            let bytes = read_body(body).await?;
            let config: Value = yaml_serde::from_slice(&bytes)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
            let status_only = target.subresource.is_some();
            let force = flag(&query, "force");
            // RBAC: the request passed the gate as a `patch`; an apply that creates needs
            // `create` too.
            let create_denied = parts
                .extensions
                .get::<crate::authz::UserInfo>()
                .and_then(|user| {
                    let attributes = crate::authz::Attributes::resource(
                        user.clone(),
                        "create",
                        kind.group(),
                        kind.resource(),
                        ns.unwrap_or(""),
                        "",
                    );
                    let decision = state.authorizer.authorize(&attributes);
                    (!decision.allowed)
                        .then(|| crate::authz::forbidden(&attributes, &decision.reason))
                });
            if escalation_checked(kind) {
                let preview = registry
                    .apply(
                        kind,
                        ns,
                        name,
                        status_only,
                        config.clone(),
                        force,
                        create_denied.clone(),
                        WriteOptions {
                            dry_run: true,
                            ..options.clone()
                        },
                    )
                    .await?;
                check_escalation(state, &parts.extensions, kind, ns, &preview.object)?;
            }
            let written = registry
                .apply(
                    kind,
                    ns,
                    name,
                    status_only,
                    config,
                    force,
                    create_denied,
                    options,
                )
                .await?;
            let code = if written.created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok(with_warnings(
                object_response(code, kind, written.object, &accept),
                &written.warnings,
            ))
        }
        (&Method::PATCH, Some(name)) => {
            let options = write_options(&query, &parts.method, &parts.headers)?;
            let patch_type = patch_type(&ct)?;
            apply_options(&query, false)?;
            let bytes = read_body(body).await?;
            let patch: Value = serde_json::from_slice(&bytes)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            let status_only = target.subresource.is_some();
            if escalation_checked(kind) {
                // The patched object is judged before it is written: a dry run shows it.
                let preview = registry
                    .patch(
                        kind,
                        ns,
                        name,
                        status_only,
                        patch_type,
                        patch.clone(),
                        WriteOptions {
                            dry_run: true,
                            ..options.clone()
                        },
                    )
                    .await?;
                check_escalation(state, &parts.extensions, kind, ns, &preview.object)?;
            }
            let written = registry
                .patch(kind, ns, name, status_only, patch_type, patch, options)
                .await?;
            Ok(with_warnings(
                object_response(StatusCode::OK, kind, written.object, &accept),
                &written.warnings,
            ))
        }
        (&Method::DELETE, Some(name)) if target.subresource.is_none() => {
            let mut options = write_options(&query, &parts.method, &parts.headers)?;
            let bytes = read_body(body).await?;
            let mut preconditions = Preconditions::default();
            if !bytes.is_empty() {
                let delete_options = decode_delete_options(&ct, &bytes)?;
                preconditions.uid = delete_options
                    .pointer("/preconditions/uid")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                preconditions.resource_version = delete_options
                    .pointer("/preconditions/resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                if delete_options
                    .get("dryRun")
                    .and_then(Value::as_array)
                    .is_some_and(|v| v.iter().any(|d| d == "All"))
                {
                    options.dry_run = true;
                }
            }
            let deleted = registry
                .delete(kind, ns, name, preconditions, options)
                .await?;
            // Services and Namespaces return the deleted object; the generic store a Status,
            // but the object itself when it was only marked and waits for its finalizers.
            let marked = deleted
                .pointer("/metadata/deletionTimestamp")
                .is_some_and(|t| !t.is_null())
                && deleted
                    .pointer("/metadata/finalizers")
                    .and_then(Value::as_array)
                    .is_some_and(|f| !f.is_empty());
            if matches!(kind, Kind::Service | Kind::Namespace) || marked {
                Ok(object_response(StatusCode::OK, kind, deleted, &accept))
            } else {
                Ok(json_response(
                    StatusCode::OK,
                    &crate::registry::success_status(kind, &deleted),
                ))
            }
        }
        (method, _) => Err(ApiError::method_not_supported(
            kind.subject(),
            &method.as_str().to_ascii_lowercase(),
        )),
    }
}

/// Whether writes of `kind` are checked for privilege escalation (the RBAC kinds).
fn escalation_checked(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Role | Kind::ClusterRole | Kind::RoleBinding | Kind::ClusterRoleBinding
    )
}

/// Escalation prevention for a write of an RBAC kind, by the user the request gate found
/// (a request that did not pass the gate is the local administrator's).
fn check_escalation(
    state: &AppState,
    extensions: &http::Extensions,
    kind: Kind,
    namespace: Option<&str>,
    object: &Value,
) -> Result<(), ApiError> {
    if !escalation_checked(kind) {
        return Ok(());
    }
    let Some(user) = extensions.get::<crate::authz::UserInfo>() else {
        return Ok(());
    };
    crate::authz::escalation::check_write(&state.authorizer, user, kind, namespace, object)
}

fn object_response(code: StatusCode, kind: Kind, object: Value, accept: &str) -> Response {
    if table::wants_table(accept) {
        let rv = object
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        return json_response(code, &table::table(kind, &[object], &rv, None, "Metadata"));
    }
    negotiated_response(code, &crate::registry::event::present(kind, object), accept)
}

/// Whether `Accept` prefers YAML among what this server writes, as kube-apiserver negotiates
/// (goautoneg): media ranges by `q`, then specific types before wildcards, then in order.
/// Protobuf, which kube-apiserver also offers, is answered in JSON here.
fn wants_yaml(accept: &str) -> bool {
    let mut ranges: Vec<(f32, bool, usize, &str)> = accept
        .split(',')
        .enumerate()
        .filter_map(|(i, range)| {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().filter(|m| !m.is_empty())?;
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            Some((q, media.contains('*'), i, media))
        })
        .filter(|(q, ..)| *q > 0.0)
        .collect();
    ranges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranges.iter().map(|(.., media)| *media).find(|media| {
        matches!(
            *media,
            "application/json"
                | "application/yaml"
                | "application/vnd.kubernetes.protobuf"
                | "application/*"
                | "*/*"
        )
    }) == Some("application/yaml")
}

/// An object or list in the form `Accept` asks for: YAML or JSON.
fn negotiated_response(code: StatusCode, value: &Value, accept: &str) -> Response {
    if wants_yaml(accept) {
        let body = yaml::to_string(value);
        return (code, [(header::CONTENT_TYPE, "application/yaml")], body).into_response();
    }
    json_response(code, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_is_answered_when_it_is_the_preferred_writable_media_type() {
        assert!(wants_yaml("application/yaml"));
        assert!(wants_yaml("text/html, application/yaml"));
        // By q, then specific before wildcard (goautoneg), as kube-apiserver picks.
        assert!(!wants_yaml(
            "text/html, application/yaml;q=0.9, application/json"
        ));
        assert!(wants_yaml("application/json;q=0.5, application/yaml"));
        assert!(wants_yaml("*/*, application/yaml"));
        assert!(!wants_yaml("application/json, application/yaml"));
        assert!(!wants_yaml(
            "application/vnd.kubernetes.protobuf, application/yaml"
        ));
        assert!(!wants_yaml("*/*"));
        assert!(!wants_yaml("application/yaml;q=0, application/json"));
        assert!(!wants_yaml(""));
    }

    #[test]
    fn paths_map_to_resources_and_subresources() {
        let t = parse_path("/api/v1/namespaces/default/services/web/status")
            .unwrap()
            .unwrap();
        assert_eq!(t.kind, Kind::Service);
        assert_eq!(t.namespace.as_deref(), Some("default"));
        assert_eq!(t.subresource.as_deref(), Some("status"));
        let t = parse_path("/api/v1/namespaces/default").unwrap().unwrap();
        assert_eq!(t.kind, Kind::Namespace);
        assert_eq!(t.name.as_deref(), Some("default"));
        let t = parse_path("/api/v1/namespaces/kube-system/status")
            .unwrap()
            .unwrap();
        assert_eq!(
            (t.kind, t.name.as_deref()),
            (Kind::Namespace, Some("kube-system"))
        );
        let t = parse_path("/apis/discovery.k8s.io/v1/endpointslices")
            .unwrap()
            .unwrap();
        assert_eq!((t.kind, t.namespace), (Kind::EndpointSlice, None));
        assert!(parse_path("/api/v1/pods").unwrap().is_none());
        assert!(
            parse_path("/api/v1/namespaces/default/endpoints/x/status")
                .unwrap()
                .is_none()
        );
    }
}
