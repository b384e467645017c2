//! `kind` and `apiVersion` of create and update bodies, as kube-apiserver's decoder settles them.
//!
//! The JSON/YAML serializer of apimachinery reads `apiVersion` and `kind` from the body, fills
//! what is empty from the resource the URL names (`gvkWithDefaults`: an empty kind takes the
//! endpoint's kind; an empty group and version take the endpoint's; an empty version with the
//! endpoint's group takes its version), then creates the type registered for the result and
//! converts it into the endpoint's internal type. So a body without `kind` and `apiVersion`, as
//! the official Python client and `curl` users send, is accepted; a kind or version that
//! disagrees fails with the message the scheme gives:
//! - a kind kube's scheme does not register for that group/version:
//!   `Foo in version "v1" cannot be handled as a Service: no kind "Foo" is registered for version "v1" in scheme "k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30"`;
//! - a registered kind of another type (a `Namespace`, a `ServiceList`, a `List`):
//!   `Namespace in version "v1" cannot be handled as a Service: converting (v1.Namespace) to (core.Service): unknown conversion`;
//! - a registered kind that converts to the same internal type from another group/version
//!   (a core/v1 Event sent to `events.k8s.io/v1`):
//!   `the API version in the data (v1) does not match the expected API version (events.k8s.io/v1)`.
//!
//! All three are 400 BadRequest, as in kube (`transformDecodeError` in the create and update
//! handlers). Server-side apply bodies are not defaulted (kube requires both fields there).

use serde_json::Value;

use crate::error::ApiError;
use crate::resource::Kind;

/// The name kube-apiserver's scheme gives itself in "not registered" errors (its call site).
const SCHEME: &str = "k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30";

/// A group, version and kind.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Gvk {
    group: String,
    version: String,
    kind: String,
}

impl Gvk {
    fn group_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// The Go package of an endpoint's internal (hub) type, as `reflect` names it in conversion
/// errors (`core.Service`, `discovery.EndpointSlice`).
fn internal_package(kind: Kind) -> &'static str {
    match kind.group() {
        "" => "core",
        "discovery.k8s.io" => "discovery",
        "networking.k8s.io" => "networking",
        // kube's internal Event for events.k8s.io is core's.
        "events.k8s.io" => "core",
        other => other.split('.').next().unwrap_or(other),
    }
}

/// The kinds kube-apiserver's scheme registers in `group`/`version` (of the groups this server
/// serves), from k8s.io/api's `register.go` files; each is the Go type `v1.<Kind>`.
fn registered(group: &str, version: &str, kind: &str) -> bool {
    const CORE_V1: &[&str] = &[
        "Pod",
        "PodList",
        "PodStatusResult",
        "PodTemplate",
        "PodTemplateList",
        "ReplicationController",
        "ReplicationControllerList",
        "Service",
        "ServiceProxyOptions",
        "ServiceList",
        "Endpoints",
        "EndpointsList",
        "Node",
        "NodeConfigSource",
        "NodeList",
        "NodeProxyOptions",
        "Binding",
        "Event",
        "EventList",
        "List",
        "LimitRange",
        "LimitRangeList",
        "ResourceQuota",
        "ResourceQuotaList",
        "Namespace",
        "NamespaceList",
        "Secret",
        "SecretList",
        "ServiceAccount",
        "ServiceAccountList",
        "PersistentVolume",
        "PersistentVolumeList",
        "PersistentVolumeClaim",
        "PersistentVolumeClaimList",
        "PodAttachOptions",
        "PodLogOptions",
        "PodExecOptions",
        "PodPortForwardOptions",
        "PodProxyOptions",
        "ComponentStatus",
        "ComponentStatusList",
        "SerializedReference",
        "RangeAllocation",
        "ConfigMap",
        "ConfigMapList",
    ];
    const DISCOVERY_V1: &[&str] = &["EndpointSlice", "EndpointSliceList"];
    const NETWORKING_V1: &[&str] = &[
        "Ingress",
        "IngressList",
        "IngressClass",
        "IngressClassList",
        "NetworkPolicy",
        "NetworkPolicyList",
        "IPAddress",
        "IPAddressList",
        "ServiceCIDR",
        "ServiceCIDRList",
    ];
    const EVENTS_V1: &[&str] = &["Event", "EventList"];
    let kinds: &[&str] = match (group, version) {
        ("", "v1") => CORE_V1,
        ("discovery.k8s.io", "v1") => DISCOVERY_V1,
        ("networking.k8s.io", "v1") => NETWORKING_V1,
        ("events.k8s.io", "v1") => EVENTS_V1,
        _ => &[],
    };
    kinds.contains(&kind)
}

/// Whether the registered `gvk` converts into the internal type of `kind`'s endpoint: the same
/// kind in another group that shares the internal type (core/v1 and events.k8s.io/v1 Events).
fn converts_to(gvk: &Gvk, kind: Kind) -> bool {
    gvk.kind == kind.kind()
        && matches!(
            (gvk.group.as_str(), kind.group()),
            ("", "events.k8s.io") | ("events.k8s.io", "")
        )
}

/// apimachinery's `schema.ParseGroupVersion`.
fn parse_group_version(api_version: &str) -> Result<(String, String), String> {
    if api_version.is_empty() || api_version == "/" {
        return Ok((String::new(), String::new()));
    }
    match api_version.matches('/').count() {
        0 => Ok((String::new(), api_version.to_owned())),
        1 => {
            let (group, version) = api_version.split_once('/').expect("one slash");
            Ok((group.to_owned(), version.to_owned()))
        }
        _ => Err(format!("unexpected GroupVersion string: {api_version}")),
    }
}

/// The name Go's `encoding/json` gives a JSON value's type in an unmarshal error.
fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// `summarizeData(body, 30)` of the create handler: the body's first 30 bytes.
fn summary(body: &Value) -> String {
    let text = serde_json::to_string(body).unwrap_or_default();
    if text.len() > 30 {
        let mut end = 30;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        format!("{} ...", &text[..end])
    } else {
        text
    }
}

/// The error of a body whose type could not even be read (`gvk` nil in `transformDecodeError`).
fn unrecognized(kind: Kind, body: &Value, why: &str) -> ApiError {
    ApiError::bad_request(format!(
        "the object provided is unrecognized (must be of type {}): {why} ({})",
        kind.kind(),
        summary(body)
    ))
}

/// Reads `apiVersion` and `kind` of a create or update `body` sent to `kind`'s endpoint,
/// defaults what is empty from the endpoint, and writes the result back into the body; a type
/// that is not the endpoint's is refused as kube-apiserver refuses it (see the module doc).
pub fn default_and_check(kind: Kind, body: &mut Value) -> Result<(), ApiError> {
    let Value::Object(map) = body else {
        // Not an object: Go cannot read the type fields out of it.
        let why = format!(
            "couldn't get version/kind; json parse error: json: cannot unmarshal {} into Go value of type struct {{ APIVersion string \"json:\\\"apiVersion,omitempty\\\"\"; Kind string \"json:\\\"kind,omitempty\\\"\" }}",
            json_type(body)
        );
        return Err(unrecognized(kind, body, &why));
    };
    let field = |name: &str| -> Result<String, String> {
        match map.get(name) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!(
                "couldn't get version/kind; json parse error: json: cannot unmarshal {} into Go struct field .{name} of type string",
                json_type(other)
            )),
        }
    };
    let read = field("apiVersion").and_then(|api_version| {
        let kind_field = field("kind")?;
        let (group, version) = parse_group_version(&api_version)?;
        Ok(Gvk {
            group,
            version,
            kind: kind_field,
        })
    });
    let mut actual = match read {
        Ok(gvk) => gvk,
        Err(why) => return Err(unrecognized(kind, body, &why)),
    };
    // gvkWithDefaults.
    if actual.kind.is_empty() {
        actual.kind = kind.kind().to_owned();
    }
    if actual.version.is_empty() && actual.group.is_empty() {
        actual.group = kind.group().to_owned();
        actual.version = kind.version().to_owned();
    }
    if actual.version.is_empty() && actual.group == kind.group() {
        actual.version = kind.version().to_owned();
    }
    let expected = Gvk {
        group: kind.group().to_owned(),
        version: kind.version().to_owned(),
        kind: kind.kind().to_owned(),
    };
    if actual != expected {
        let cannot = |why: String| {
            ApiError::bad_request(format!(
                "{} in version {:?} cannot be handled as a {}: {why}",
                actual.kind,
                actual.version,
                kind.kind()
            ))
        };
        if actual.version.is_empty() {
            // A group without a version that is not the endpoint's: `NewMissingVersionErr`.
            return Err(cannot(format!(
                "Object 'apiVersion' is missing in '{}'",
                serde_json::to_string(body).unwrap_or_default()
            )));
        }
        if !registered(&actual.group, &actual.version, &actual.kind) {
            return Err(cannot(format!(
                "no kind {:?} is registered for version {:?} in scheme {SCHEME:?}",
                actual.kind,
                actual.group_version()
            )));
        }
        if converts_to(&actual, kind) {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({}) does not match the expected API version ({})",
                actual.group_version(),
                kind.api_version()
            )));
        }
        return Err(cannot(format!(
            "converting (v1.{}) to ({}.{}): unknown conversion",
            actual.kind,
            internal_package(kind),
            kind.kind()
        )));
    }
    map.insert(
        "apiVersion".into(),
        Value::String(kind.api_version().to_owned()),
    );
    map.insert("kind".into(), Value::String(kind.kind().to_owned()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(kind: Kind, mut body: Value) -> Result<Value, (u16, String)> {
        default_and_check(kind, &mut body)
            .map(|()| body)
            .map_err(|e| (e.code(), e.message().to_owned()))
    }

    #[test]
    fn an_empty_kind_and_api_version_are_taken_from_the_endpoint_as_gvk_with_defaults_does() {
        for kind in Kind::ALL {
            let body = check(kind, json!({"metadata": {"name": "a"}})).unwrap();
            assert_eq!(body["kind"], kind.kind());
            assert_eq!(body["apiVersion"], kind.api_version());
            // Empty strings and nulls count as missing.
            let body = check(kind, json!({"kind": "", "apiVersion": null})).unwrap();
            assert_eq!(body["apiVersion"], kind.api_version());
        }
        // Only the kind given, only the version given, the group without its version.
        assert!(check(Kind::Service, json!({"kind": "Service"})).is_ok());
        assert!(check(Kind::Service, json!({"apiVersion": "v1"})).is_ok());
        assert!(
            check(
                Kind::EndpointSlice,
                json!({"apiVersion": "discovery.k8s.io/"})
            )
            .is_ok()
        );
    }

    #[test]
    fn a_kind_kube_does_not_register_is_refused_with_the_schemes_message() {
        assert_eq!(
            check(Kind::Service, json!({"kind": "service"})).unwrap_err(),
            (
                400,
                "service in version \"v1\" cannot be handled as a Service: no kind \"service\" is registered for version \"v1\" in scheme \"k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30\"".into()
            )
        );
        // A version given without the endpoint's group: the kind is looked up in core/v1.
        assert_eq!(
            check(Kind::EndpointSlice, json!({"apiVersion": "v1"}))
                .unwrap_err()
                .1,
            "EndpointSlice in version \"v1\" cannot be handled as a EndpointSlice: no kind \"EndpointSlice\" is registered for version \"v1\" in scheme \"k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30\""
        );
        assert_eq!(
            check(
                Kind::Service,
                json!({"apiVersion": "apps/v1", "kind": "Service"})
            )
            .unwrap_err()
            .1,
            "Service in version \"v1\" cannot be handled as a Service: no kind \"Service\" is registered for version \"apps/v1\" in scheme \"k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30\""
        );
    }

    #[test]
    fn another_registered_kind_and_list_bodies_fail_conversion_as_in_kube() {
        assert_eq!(
            check(Kind::Service, json!({"kind": "Namespace"})).unwrap_err(),
            (
                400,
                "Namespace in version \"v1\" cannot be handled as a Service: converting (v1.Namespace) to (core.Service): unknown conversion".into()
            )
        );
        for list in ["List", "ServiceList"] {
            assert_eq!(
                check(Kind::Service, json!({"apiVersion": "v1", "kind": list}))
                    .unwrap_err()
                    .1,
                format!(
                    "{list} in version \"v1\" cannot be handled as a Service: converting (v1.{list}) to (core.Service): unknown conversion"
                )
            );
        }
        assert_eq!(
            check(
                Kind::EndpointSlice,
                json!({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1"})
            )
            .unwrap_err()
            .1,
            "EndpointSliceList in version \"v1\" cannot be handled as a EndpointSlice: converting (v1.EndpointSliceList) to (discovery.EndpointSlice): unknown conversion"
        );
    }

    #[test]
    fn type_fields_that_cannot_be_read_make_the_object_unrecognized() {
        assert_eq!(
            check(Kind::Service, json!({"kind": 1})).unwrap_err(),
            (
                400,
                "the object provided is unrecognized (must be of type Service): couldn't get version/kind; json parse error: json: cannot unmarshal number into Go struct field .kind of type string ({\"kind\":1})".into()
            )
        );
        assert_eq!(
            check(
                Kind::Node,
                json!({"apiVersion": "a/b/c", "metadata": {"name": "long-enough-to-cut"}})
            )
            .unwrap_err()
            .1,
            "the object provided is unrecognized (must be of type Node): unexpected GroupVersion string: a/b/c ({\"apiVersion\":\"a/b/c\",\"metadat ...)"
        );
    }
}
