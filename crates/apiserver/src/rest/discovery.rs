//! Discovery (`/api`, `/apis`, `/api/v1`, ...), `/version`, and the OpenAPI v3 documents kubectl
//! reads before it sends `fieldValidation=Strict`.
//!
//! kubectl 1.32 asks for aggregated discovery first; answering plain `application/json` makes it
//! fall back to the legacy documents served here. Its `--validate=strict` default reads
//! `/openapi/v3` and the group-version document to learn whether the server supports the
//! `fieldValidation` query parameter for the kind it sends (the POST/PUT/PATCH operations carry
//! `x-kubernetes-group-version-kind` and a `fieldValidation` parameter); without that it would
//! fetch OpenAPI v2 for client-side validation. The documents below are minimal: operations with
//! those markers, and schemas that only say "object".

use serde_json::{Value, json};

use crate::resource::Kind;

fn verbs(kind: Kind) -> Vec<&'static str> {
    if kind.read_only() {
        return vec!["get", "list", "watch"];
    }
    let mut v = vec!["create", "delete"];
    if kind != Kind::Namespace {
        v.push("deletecollection");
    }
    v.extend(["get", "list", "patch", "update", "watch"]);
    v
}

/// `/api`.
pub fn api_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

fn discovery_group() -> Value {
    json!({
        "name": "discovery.k8s.io",
        "versions": [{"groupVersion": "discovery.k8s.io/v1", "version": "v1"}],
        "preferredVersion": {"groupVersion": "discovery.k8s.io/v1", "version": "v1"},
    })
}

fn networking_group() -> Value {
    json!({
        "name": "networking.k8s.io",
        "versions": [{"groupVersion": "networking.k8s.io/v1", "version": "v1"}],
        "preferredVersion": {"groupVersion": "networking.k8s.io/v1", "version": "v1"},
    })
}

fn events_group() -> Value {
    json!({
        "name": "events.k8s.io",
        "versions": [{"groupVersion": "events.k8s.io/v1", "version": "v1"}],
        "preferredVersion": {"groupVersion": "events.k8s.io/v1", "version": "v1"},
    })
}

/// `/apis`.
pub fn api_group_list() -> Value {
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [discovery_group(), networking_group(), events_group(), crate::authz::discovery::rbac_group(), crate::authz::discovery::authorization_group()],
    })
}

/// `/apis/<group>`.
pub fn api_group(group: &str) -> Option<Value> {
    let mut g = match group {
        "discovery.k8s.io" => discovery_group(),
        "networking.k8s.io" => networking_group(),
        "events.k8s.io" => events_group(),
        "rbac.authorization.k8s.io" => crate::authz::discovery::rbac_group(),
        "authorization.k8s.io" => crate::authz::discovery::authorization_group(),
        _ => return None,
    };
    g["kind"] = json!("APIGroup");
    g["apiVersion"] = json!("v1");
    Some(g)
}

/// `/api/v1` or `/apis/<group>/<version>`.
pub fn api_resource_list(group: &str, version: &str) -> Option<Value> {
    if let Some(list) = crate::authz::discovery::authorization_resources(group, version) {
        return Some(list);
    }
    let kinds: Vec<Kind> = Kind::ALL
        .into_iter()
        .filter(|k| k.group() == group && k.version() == version)
        .collect();
    if kinds.is_empty() {
        return None;
    }
    let mut resources = Vec::new();
    for kind in kinds {
        let mut r = json!({
            "name": kind.resource(),
            "singularName": kind.singular(),
            "namespaced": kind.namespaced(),
            "kind": kind.kind(),
            "verbs": verbs(kind),
        });
        if !kind.short_names().is_empty() {
            r["shortNames"] = json!(kind.short_names());
        }
        if !kind.categories().is_empty() {
            r["categories"] = json!(kind.categories());
        }
        resources.push(r);
        if kind.has_status() {
            resources.push(json!({
                "name": format!("{}/status", kind.resource()),
                "singularName": "",
                "namespaced": kind.namespaced(),
                "kind": kind.kind(),
                "verbs": ["get", "patch", "update"],
            }));
        }
        if kind == Kind::Namespace {
            resources.push(json!({
                "name": "namespaces/finalize",
                "singularName": "",
                "namespaced": false,
                "kind": "Namespace",
                "verbs": ["update"],
            }));
        }
    }
    let group_version = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }))
}

/// The Kubernetes minor version whose API this server serves: `networking.k8s.io/v1`
/// ServiceCIDRs are GA from 1.33. (kubectl warns beyond one minor version of skew, so a claim
/// newer than the API would only cost its users a warning on `kubectl version`.)
const KUBE_MINOR: &str = "33";

/// `/version`.
pub fn version() -> Value {
    // Go's names for the architecture, as kube-apiserver reports `runtime.GOARCH`.
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    json!({
        "major": "1",
        "minor": KUBE_MINOR,
        "gitVersion": format!("v1.{KUBE_MINOR}.0-nodeport.{}", env!("CARGO_PKG_VERSION")),
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "",
        "goVersion": "rust",
        "compiler": "rustc",
        "platform": format!("{}/{arch}", std::env::consts::OS),
    })
}

/// The group-version paths of `/openapi/v3`: path, group, version, schema package.
fn openapi_paths() -> [(&'static str, &'static str, &'static str, &'static str); 5] {
    [
        ("api/v1", "", "v1", "core"),
        (
            "apis/discovery.k8s.io/v1",
            "discovery.k8s.io",
            "v1",
            "discovery",
        ),
        (
            "apis/networking.k8s.io/v1",
            "networking.k8s.io",
            "v1",
            "networking",
        ),
        ("apis/events.k8s.io/v1", "events.k8s.io", "v1", "events"),
        (
            "apis/rbac.authorization.k8s.io/v1",
            "rbac.authorization.k8s.io",
            "v1",
            "rbac",
        ),
    ]
}

/// `/openapi/v3`: the index of group-version documents.
pub fn openapi_v3_root() -> Value {
    let mut paths = serde_json::Map::new();
    for (path, _, _, _) in openapi_paths() {
        paths.insert(
            path.to_owned(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash={}", hash_of(path))}),
        );
    }
    json!({ "paths": paths })
}

fn hash_of(path: &str) -> String {
    // Stable per build: kubectl caches documents by this hash.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in path.bytes().chain(env!("CARGO_PKG_VERSION").bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016X}")
}

/// The OpenAPI schemas of the kinds of `group` and of every type they contain, named as
/// kube-apiserver names them (`io.k8s.api.core.v1.ServiceSpec`), with the field descriptions
/// `kubectl explain` prints: k8s-openapi's, which come from the same API definitions.
fn schemas_of(group: &str) -> serde_json::Map<String, Value> {
    use k8s_openapi::api::events::v1 as events;
    use k8s_openapi::api::{core::v1 as core, discovery::v1 as discovery, networking::v1 as net};
    let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
    for kind in Kind::ALL.into_iter().filter(|k| k.group() == group) {
        let _ = match kind {
            Kind::Service => generator.subschema_for::<core::Service>(),
            Kind::Endpoints => generator.subschema_for::<core::Endpoints>(),
            Kind::Node => generator.subschema_for::<core::Node>(),
            Kind::Namespace => generator.subschema_for::<core::Namespace>(),
            Kind::EndpointSlice => generator.subschema_for::<discovery::EndpointSlice>(),
            Kind::ServiceCidr => generator.subschema_for::<net::ServiceCIDR>(),
            Kind::Event => generator.subschema_for::<core::Event>(),
            Kind::EventsV1 => generator.subschema_for::<events::Event>(),
            Kind::IpAddress => generator.subschema_for::<net::IPAddress>(),
            Kind::Role => generator.subschema_for::<k8s_openapi::api::rbac::v1::Role>(),
            Kind::ClusterRole => {
                generator.subschema_for::<k8s_openapi::api::rbac::v1::ClusterRole>()
            }
            Kind::RoleBinding => {
                generator.subschema_for::<k8s_openapi::api::rbac::v1::RoleBinding>()
            }
            Kind::ClusterRoleBinding => {
                generator.subschema_for::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>()
            }
        };
    }
    generator.take_definitions(true)
}

/// The schemas of every served kind with kube's merge markers, as `/openapi/v3` serves them
/// (server-side apply merges by them), built once.
pub(crate) fn merge_schemas() -> &'static serde_json::Map<String, Value> {
    static SCHEMAS: std::sync::OnceLock<serde_json::Map<String, Value>> =
        std::sync::OnceLock::new();
    SCHEMAS.get_or_init(|| {
        let mut all = serde_json::Map::new();
        for (_, group, _, _) in openapi_paths() {
            all.extend(schemas_of(group));
        }
        super::list_types::annotate(&mut all);
        all
    })
}

/// The name of a kind's schema in `/openapi/v3` (`io.k8s.api.core.v1.Service`).
pub(crate) fn schema_name(kind: Kind) -> String {
    let package = openapi_paths()
        .into_iter()
        .find(|(_, group, _, _)| *group == kind.group())
        .map_or("core", |(_, _, _, package)| package);
    format!("io.k8s.api.{package}.{}.{}", kind.version(), kind.kind())
}

/// [`schemas_of`], for the marker table's own test.
#[cfg(test)]
pub(crate) fn schemas_for_test(group: &str) -> serde_json::Map<String, Value> {
    schemas_of(group)
}

/// `/openapi/v3/<path>`: each kind's schema and operations, with the markers kubectl looks for.
pub fn openapi_v3_document(path: &str) -> Option<Value> {
    let (_, group, version, package) = openapi_paths()
        .into_iter()
        .find(|(p, _, _, _)| *p == path)?;
    let mut paths = serde_json::Map::new();
    let mut schemas = schemas_of(group);
    super::list_types::annotate(&mut schemas);
    let field_validation = json!({
        "name": "fieldValidation",
        "in": "query",
        "description": "fieldValidation instructs the server on how to handle objects in the request (POST/PUT/PATCH) containing unknown or duplicate fields.",
        "schema": {"type": "string", "uniqueItems": true},
    });
    for kind in Kind::ALL.into_iter().filter(|k| k.group() == group) {
        let gvk = json!({"group": group, "version": version, "kind": kind.kind()});
        let schema_name = schema_name(kind);
        debug_assert_eq!(
            schema_name,
            format!("io.k8s.api.{package}.{version}.{}", kind.kind())
        );
        let schema = schemas
            .entry(schema_name.clone())
            .or_insert_with(|| json!({"type": "object"}));
        schema["x-kubernetes-group-version-kind"] = json!([gvk]);
        let reference = json!({"$ref": format!("#/components/schemas/{schema_name}")});
        let body = json!({"content": {"*/*": {"schema": reference}}, "required": true});
        let op = |verb: &str| {
            json!({
                "operationId": format!("{verb}{}", kind.kind()),
                "parameters": [field_validation],
                "requestBody": body,
                "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": reference}}}},
                "x-kubernetes-action": verb,
                "x-kubernetes-group-version-kind": gvk,
            })
        };
        let base = if group.is_empty() {
            format!("/api/{version}")
        } else {
            format!("/apis/{group}/{version}")
        };
        let (collection, item) = if kind.namespaced() {
            (
                format!("{base}/namespaces/{{namespace}}/{}", kind.resource()),
                format!(
                    "{base}/namespaces/{{namespace}}/{}/{{name}}",
                    kind.resource()
                ),
            )
        } else {
            (
                format!("{base}/{}", kind.resource()),
                format!("{base}/{}/{{name}}", kind.resource()),
            )
        };
        // Also for a kind served read-only (ServiceCIDR): kubectl looks for the write operation
        // and its `fieldValidation` parameter before it sends a manifest (else it falls back to
        // `/openapi/v2` and fails); the write itself then answers 405 MethodNotAllowed.
        paths.insert(collection, json!({"post": op("post")}));
        paths.insert(
            item.clone(),
            json!({"put": op("put"), "patch": op("patch")}),
        );
        if kind.has_status() {
            paths.insert(
                format!("{item}/status"),
                json!({"put": op("put"), "patch": op("patch")}),
            );
        }
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": format!("v1.{KUBE_MINOR}.0")},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}
