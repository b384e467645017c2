//! Typed objects: decoding from JSON with unknown-field detection, and back.

use k8s_openapi::api::core::v1::{Endpoints, Event, Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::error::ApiError;
use crate::resource::Kind;

/// One object of a served kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Object {
    /// A Service.
    Service(Box<Service>),
    /// An Endpoints.
    Endpoints(Box<Endpoints>),
    /// An EndpointSlice.
    EndpointSlice(Box<EndpointSlice>),
    /// A Node.
    Node(Box<Node>),
    /// A Namespace.
    Namespace(Box<Namespace>),
    /// A ServiceCIDR.
    ServiceCidr(Box<ServiceCIDR>),
    /// An Event, in its stored (core/v1) form whichever API it came through.
    Event(Box<Event>),
    /// An IPAddress.
    IpAddress(Box<IPAddress>),
    /// A Role.
    Role(Box<Role>),
    /// A ClusterRole.
    ClusterRole(Box<ClusterRole>),
    /// A RoleBinding.
    RoleBinding(Box<RoleBinding>),
    /// A ClusterRoleBinding.
    ClusterRoleBinding(Box<ClusterRoleBinding>),
}

/// A decoded object and the input fields the typed object does not know.
#[derive(Debug)]
pub struct Decoded {
    /// The object.
    pub object: Object,
    /// Paths of unknown fields, as kube-apiserver's strict decoder names them (`spec.foo`).
    pub unknown_fields: Vec<String>,
}

/// A body that cannot be decoded as `kind`, worded as kube-apiserver's `transformDecodeError`:
/// `Service in version "v1" cannot be handled as a Service: <why>`.
pub fn undecodable(kind: Kind, why: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!(
        "{} in version {:?} cannot be handled as a {}: {why}",
        kind.kind(),
        kind.version(),
        kind.kind()
    ))
}

impl Object {
    /// Decodes `value` as a `kind`, collecting unknown fields.
    ///
    /// A value of the wrong shape is a 400, worded as kube-apiserver words it:
    /// `Service in version "v1" cannot be handled as a Service: <why>`.
    pub fn decode(kind: Kind, value: &Value) -> Result<Decoded, ApiError> {
        fn typed<T: serde::de::DeserializeOwned>(kind: Kind, value: &Value) -> Result<T, ApiError> {
            serde_path_to_error::deserialize::<_, T>(value.clone()).map_err(|e| {
                let probe = |v: &Value| {
                    serde_path_to_error::deserialize::<_, T>(v.clone())
                        .err()
                        .map(|e| (e.path().to_string(), e.inner().to_string()))
                };
                match go_decode_error(kind.kind(), value, &e, &probe) {
                    Some(text) => undecodable(kind, text),
                    None => undecodable(kind, e.inner()),
                }
            })
        }
        if kind == Kind::EventsV1 {
            // Decoded in the core form; unknown fields are named as the new form names them.
            let (core, moved) = super::event::to_core(value);
            let mut decoded = Object::decode(Kind::Event, &core)?;
            decoded.unknown_fields = moved
                .into_iter()
                .chain(
                    decoded
                        .unknown_fields
                        .iter()
                        .map(|p| super::event::events_path(p)),
                )
                .collect();
            return Ok(decoded);
        }
        let object = match kind {
            Kind::Service => Object::Service(Box::new(typed(kind, value)?)),
            Kind::Endpoints => Object::Endpoints(Box::new(typed(kind, value)?)),
            Kind::EndpointSlice => Object::EndpointSlice(Box::new(typed(kind, value)?)),
            Kind::Node => Object::Node(Box::new(typed(kind, value)?)),
            Kind::Namespace => Object::Namespace(Box::new(typed(kind, value)?)),
            Kind::ServiceCidr => Object::ServiceCidr(Box::new(typed(kind, value)?)),
            Kind::Event | Kind::EventsV1 => Object::Event(Box::new(typed(kind, value)?)),
            Kind::IpAddress => Object::IpAddress(Box::new(typed(kind, value)?)),
            Kind::Role => Object::Role(Box::new(typed(kind, value)?)),
            Kind::ClusterRole => Object::ClusterRole(Box::new(typed(kind, value)?)),
            Kind::RoleBinding => Object::RoleBinding(Box::new(typed(kind, value)?)),
            Kind::ClusterRoleBinding => Object::ClusterRoleBinding(Box::new(typed(kind, value)?)),
        };
        let mut unknown_fields = Vec::new();
        let round_trip = object.to_value();
        collect_unknown(value, &round_trip, "", &mut unknown_fields);
        Ok(Decoded {
            object,
            unknown_fields,
        })
    }

    /// The kind of the object.
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::Endpoints(_) => Kind::Endpoints,
            Object::EndpointSlice(_) => Kind::EndpointSlice,
            Object::Node(_) => Kind::Node,
            Object::Namespace(_) => Kind::Namespace,
            Object::ServiceCidr(_) => Kind::ServiceCidr,
            Object::Event(_) => Kind::Event,
            Object::IpAddress(_) => Kind::IpAddress,
            Object::Role(_) => Kind::Role,
            Object::ClusterRole(_) => Kind::ClusterRole,
            Object::RoleBinding(_) => Kind::RoleBinding,
            Object::ClusterRoleBinding(_) => Kind::ClusterRoleBinding,
        }
    }

    /// The object's metadata.
    pub fn metadata(&self) -> &ObjectMeta {
        match self {
            Object::Service(o) => &o.metadata,
            Object::Endpoints(o) => &o.metadata,
            Object::EndpointSlice(o) => &o.metadata,
            Object::Node(o) => &o.metadata,
            Object::Namespace(o) => &o.metadata,
            Object::ServiceCidr(o) => &o.metadata,
            Object::Event(o) => &o.metadata,
            Object::IpAddress(o) => &o.metadata,
            Object::Role(o) => &o.metadata,
            Object::ClusterRole(o) => &o.metadata,
            Object::RoleBinding(o) => &o.metadata,
            Object::ClusterRoleBinding(o) => &o.metadata,
        }
    }

    /// The object's metadata, to change.
    pub fn metadata_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Object::Service(o) => &mut o.metadata,
            Object::Endpoints(o) => &mut o.metadata,
            Object::EndpointSlice(o) => &mut o.metadata,
            Object::Node(o) => &mut o.metadata,
            Object::Namespace(o) => &mut o.metadata,
            Object::ServiceCidr(o) => &mut o.metadata,
            Object::Event(o) => &mut o.metadata,
            Object::IpAddress(o) => &mut o.metadata,
            Object::Role(o) => &mut o.metadata,
            Object::ClusterRole(o) => &mut o.metadata,
            Object::RoleBinding(o) => &mut o.metadata,
            Object::ClusterRoleBinding(o) => &mut o.metadata,
        }
    }

    /// `metadata.name`, or `""`.
    pub fn name(&self) -> &str {
        self.metadata().name.as_deref().unwrap_or("")
    }

    /// The object as JSON, with `apiVersion` and `kind`.
    pub fn to_value(&self) -> Value {
        let mut value = match self {
            Object::Service(o) => serde_json::to_value(o),
            Object::Endpoints(o) => serde_json::to_value(o),
            Object::EndpointSlice(o) => serde_json::to_value(o),
            Object::Node(o) => serde_json::to_value(o),
            Object::Namespace(o) => serde_json::to_value(o),
            Object::ServiceCidr(o) => serde_json::to_value(o),
            Object::Event(o) => serde_json::to_value(o),
            Object::IpAddress(o) => serde_json::to_value(o),
            Object::Role(o) => serde_json::to_value(o),
            Object::ClusterRole(o) => serde_json::to_value(o),
            Object::RoleBinding(o) => serde_json::to_value(o),
            Object::ClusterRoleBinding(o) => serde_json::to_value(o),
        }
        .expect("k8s-openapi objects serialize");
        if let Value::Object(map) = &mut value {
            let kind = self.kind();
            map.insert(
                "apiVersion".into(),
                Value::String(kind.api_version().into()),
            );
            map.insert("kind".into(), Value::String(kind.kind().into()));
        }
        value
    }

    /// Moves the status of `from` into `self` (status subresource semantics).
    pub fn set_status_from(&mut self, from: &Object) {
        match (self, from) {
            (Object::Service(a), Object::Service(b)) => a.status = b.status.clone(),
            (Object::Node(a), Object::Node(b)) => a.status = b.status.clone(),
            (Object::Namespace(a), Object::Namespace(b)) => a.status = b.status.clone(),
            (Object::ServiceCidr(a), Object::ServiceCidr(b)) => a.status = b.status.clone(),
            _ => {}
        }
    }
}

/// Walks `input` and records every key that did not survive the typed round trip.
fn collect_unknown(input: &Value, output: &Value, path: &str, out: &mut Vec<String>) {
    match (input, output) {
        (Value::Object(inp), Value::Object(outp)) => {
            for (key, value) in inp {
                if value.is_null() {
                    continue;
                }
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match outp.get(key) {
                    Some(o) => collect_unknown(value, o, &child, out),
                    None => out.push(child),
                }
            }
        }
        (Value::Array(inp), Value::Array(outp)) => {
            for (i, (a, b)) in inp.iter().zip(outp).enumerate() {
                collect_unknown(a, b, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unknown_fields_are_named_by_their_path() {
        let decoded = Object::decode(
            Kind::Service,
            &json!({"apiVersion":"v1","kind":"Service","metadata":{"name":"a","creationTimestamp":null},
                    "spec":{"foo":1,"ports":[{"port":80,"bar":true}]}}),
        )
        .unwrap();
        assert_eq!(
            decoded.unknown_fields,
            vec!["spec.foo", "spec.ports[0].bar"]
        );
    }

    #[test]
    fn a_value_of_the_wrong_type_is_a_bad_request() {
        let err = Object::decode(
            Kind::Service,
            &json!({"metadata":{"name":"a"},"spec":{"ports":[{"port":"x"}]}}),
        )
        .unwrap_err();
        assert_eq!(err.code(), 400);
        assert!(
            err.message()
                .starts_with("Service in version \"v1\" cannot be handled as a Service:")
        );
    }

    /// Every node of a full Service and EndpointSlice replaced by a value of every JSON kind:
    /// the decode error is worded without a panic (the Go wording probes the value again).
    #[test]
    fn any_node_of_any_wrong_kind_is_worded_without_a_panic() {
        fn paths(v: &Value, at: Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
            out.push(at.clone());
            match v {
                Value::Object(m) => m.iter().for_each(|(k, v)| {
                    let mut p = at.clone();
                    p.push(Seg::Key(k.clone()));
                    paths(v, p, out)
                }),
                Value::Array(a) => a.iter().enumerate().for_each(|(i, v)| {
                    let mut p = at.clone();
                    p.push(Seg::Index(i));
                    paths(v, p, out)
                }),
                _ => {}
            }
        }
        let service = json!({"apiVersion":"v1","kind":"Service",
            "metadata":{"name":"a","labels":{"app":"web"},"ownerReferences":[{"apiVersion":"v1","kind":"X","name":"x","uid":"u"}]},
            "spec":{"type":"LoadBalancer","selector":{"app":"web"},"clusterIPs":["10.0.0.1"],
                "ports":[{"name":"http","port":80,"targetPort":8080,"nodePort":30080}],
                "sessionAffinityConfig":{"clientIP":{"timeoutSeconds":10}},
                "loadBalancerSourceRanges":["10.0.0.0/8"]},
            "status":{"loadBalancer":{"ingress":[{"ip":"192.0.2.1","ports":[{"port":80,"protocol":"TCP"}]}]}}});
        let slice = json!({"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","addressType":"IPv4",
            "metadata":{"name":"a"},
            "endpoints":[{"addresses":["10.0.0.1"],"conditions":{"ready":true},"hints":{"forZones":[{"name":"z"}]}}],
            "ports":[{"port":80}]});
        let kinds = [
            json!(true),
            json!("x"),
            json!(1.5),
            json!(-1),
            json!(70000000000i64),
            json!([]),
            json!({}),
            json!(null),
            json!([true]),
            json!({"a": 1}),
        ];
        for (kind, body) in [(Kind::Service, service), (Kind::EndpointSlice, slice)] {
            let mut all = Vec::new();
            paths(&body, Vec::new(), &mut all);
            for path in all.iter().filter(|p| !p.is_empty()) {
                for with in &kinds {
                    let v = replaced(&body, path, with.clone());
                    if let Err(e) = Object::decode(kind, &v) {
                        assert!(
                            e.message().contains(" cannot be handled as a "),
                            "{v}: {}",
                            e.message()
                        );
                    }
                }
            }
        }
    }

    /// kube-apiserver's decoder is Go's `encoding/json`: its words name the JSON kind, the
    /// struct and path of the innermost struct field, and the Go type of the slot (a
    /// black-box review found serde's words, `invalid type: string "abc", expected i32`).
    #[test]
    fn a_value_of_the_wrong_type_is_worded_as_gos_json_decoder_words_it() {
        let cases = [
            (
                json!({"spec":{"ports":[{"port":"abc"}]}}),
                "string into Go struct field ServicePort.spec.ports.port of type int32",
            ),
            (
                json!({"spec":{"ports":[{"port":80,"nodePort":true}]}}),
                "bool into Go struct field ServicePort.spec.ports.nodePort of type int32",
            ),
            (
                json!({"spec":{"ports":[{"port":1.5}]}}),
                "number 1.5 into Go struct field ServicePort.spec.ports.port of type int32",
            ),
            (
                json!({"spec":{"ports":[{"port":70000000000i64}]}}),
                "number 70000000000 into Go struct field ServicePort.spec.ports.port of type int32",
            ),
            (
                json!({"spec":{"externalIPs":[true]}}),
                "bool into Go struct field ServiceSpec.spec.externalIPs of type string",
            ),
            (
                json!({"metadata":{"labels":{"a":1}}}),
                "number into Go struct field ObjectMeta.metadata.labels of type string",
            ),
            (
                json!({"spec":"x"}),
                "string into Go struct field Service.spec of type v1.ServiceSpec",
            ),
            (
                json!({"spec":{"ports":true}}),
                "bool into Go struct field ServiceSpec.spec.ports of type []v1.ServicePort",
            ),
            (
                json!({"spec":{"ports":[true]}}),
                "bool into Go struct field ServiceSpec.spec.ports of type v1.ServicePort",
            ),
            (
                json!({"spec":{"selector":true}}),
                "bool into Go struct field ServiceSpec.spec.selector of type map[string]string",
            ),
            (
                json!({"spec":{"allocateLoadBalancerNodePorts":"x"}}),
                "string into Go struct field ServiceSpec.spec.allocateLoadBalancerNodePorts of type bool",
            ),
        ];
        for (body, words) in cases {
            let err = Object::decode(Kind::Service, &body).unwrap_err();
            assert_eq!(
                err.message(),
                format!(
                    "Service in version \"v1\" cannot be handled as a Service: json: cannot \
                     unmarshal {words}"
                ),
                "{body}"
            );
        }
        let err = Object::decode(
            Kind::EndpointSlice,
            &json!({"addressType":"IPv4","endpoints":[{"addresses":["10.0.0.1"],"conditions":{"ready":"yes"}}]}),
        )
        .unwrap_err();
        assert_eq!(
            err.message(),
            "EndpointSlice in version \"v1\" cannot be handled as a EndpointSlice: json: cannot \
             unmarshal string into Go struct field EndpointConditions.endpoints.conditions.ready of \
             type bool"
        );
    }
}

/// One step of a decode error's path.
#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Key(String),
    Index(usize),
}

fn segments(path: &serde_path_to_error::Path) -> Option<Vec<Seg>> {
    use serde_path_to_error::Segment;
    path.iter()
        .map(|s| match s {
            Segment::Map { key } => Some(Seg::Key(key.clone())),
            Segment::Seq { index } => Some(Seg::Index(*index)),
            _ => None,
        })
        .collect()
}

fn at<'v>(value: &'v Value, path: &[Seg]) -> Option<&'v Value> {
    path.iter().try_fold(value, |v, s| match s {
        Seg::Key(k) => v.get(k),
        Seg::Index(i) => v.get(i),
    })
}

/// `value` with the node at `path` replaced by `with`.
fn replaced(value: &Value, path: &[Seg], with: Value) -> Value {
    let mut out = value.clone();
    let mut node = &mut out;
    for s in path {
        node = match s {
            Seg::Key(k) => &mut node[k.as_str()],
            Seg::Index(i) => &mut node[*i],
        };
    }
    *node = with;
    out
}

/// What serde expected, from its message (`invalid type: …, expected X`).
fn expected(message: &str) -> Option<&str> {
    message.rsplit_once(", expected ").map(|(_, x)| x)
}

/// A decode error in the words of Go's `encoding/json`, which kube-apiserver's decoder
/// returns: `json: cannot unmarshal string into Go struct field ServicePort.spec.ports.port of
/// type int32`. Go names the JSON kind of the value, the struct holding the innermost struct
/// field on the path with the path's field names (no indices, no map keys), and the Go type
/// of the slot being filled. The struct and collection element types are found by asking
/// serde again with a `true` in their place (its message names what it expected there).
/// `None` when the error is not a wrong type or value (a missing field, a null), which keep
/// serde's words.
fn go_decode_error(
    kind: &str,
    value: &Value,
    err: &serde_path_to_error::Error<serde_json::Error>,
    probe: &dyn Fn(&Value) -> Option<(String, String)>,
) -> Option<String> {
    let inner = err.inner().to_string();
    if !inner.starts_with("invalid type: ") && !inner.starts_with("invalid value: ") {
        return None;
    }
    let path = segments(err.path())?;
    let bad = at(value, &path)?;
    // What serde expects at `report` once `with` is put at `path`.
    let expect = |path: &[Seg], with: Value, report: &[Seg]| -> Option<String> {
        let (p, message) = probe(&replaced(value, path, with))?;
        let want: Vec<String> = report.iter().map(seg_text).collect();
        if p != join(&want) {
            return None;
        }
        expected(&message).map(str::to_owned)
    };
    let expect_at = |path: &[Seg]| expect(path, Value::Bool(true), path);
    // The Go type of a collection at `path`: its element's, probed in a one-element array
    // (maps here are all string to string).
    let collection_type = |path: &[Seg], x: &str| -> Option<String> {
        if x == "a map" {
            return Some("map[string]string".into());
        }
        let mut first = path.to_vec();
        first.push(Seg::Index(0));
        let element = expect(path, Value::Array(vec![Value::Bool(true)]), &first)?;
        (element != "a sequence" && element != "a map").then(|| format!("[]{}", go_name(&element)))
    };
    let target = go_name(expected(&inner)?);
    let numeric =
        target.starts_with("int") || target.starts_with("uint") || target.starts_with("float");
    let kind_word = match bad {
        Value::String(_) => "string".to_owned(),
        Value::Bool(_) => "bool".to_owned(),
        Value::Number(n) if numeric => format!("number {n}"),
        Value::Number(_) => "number".to_owned(),
        Value::Array(_) => "array".to_owned(),
        Value::Object(_) => "object".to_owned(),
        Value::Null => return None,
    };
    // The "of type": the slot being filled (a collection's element, a struct's field).
    let of_type = match expected(&inner)? {
        x @ ("a sequence" | "a map") => collection_type(&path, x)?,
        x => go_name(x),
    };
    // The innermost struct field: the last key whose parent is a struct (not a map).
    let mut field_end = path.len();
    let strukt = loop {
        let last_key = path[..field_end]
            .iter()
            .rposition(|s| matches!(s, Seg::Key(_)))?;
        let parent = &path[..last_key];
        let x = if parent.is_empty() {
            kind.to_owned()
        } else {
            expect_at(parent)?
        };
        if x == "a map" {
            field_end = last_key;
            continue;
        }
        field_end = last_key + 1;
        break x;
    };
    let fields: Vec<&str> = path[..field_end]
        .iter()
        .filter_map(|s| match s {
            Seg::Key(k) => Some(k.as_str()),
            Seg::Index(_) => None,
        })
        .collect();
    Some(format!(
        "json: cannot unmarshal {kind_word} into Go struct field {strukt}.{} of type {of_type}",
        fields.join(".")
    ))
}

fn seg_text(s: &Seg) -> String {
    match s {
        Seg::Key(k) => k.clone(),
        Seg::Index(i) => format!("[{i}]"),
    }
}

/// `serde_path_to_error`'s way of printing a path: keys joined by dots, indices in brackets.
fn join(parts: &[String]) -> String {
    let mut out = String::new();
    for p in parts {
        if !p.starts_with('[') && !out.is_empty() {
            out.push('.');
        }
        out.push_str(p);
    }
    if out.is_empty() { ".".to_owned() } else { out }
}

/// The Go type kube decodes into, for what serde expected.
fn go_name(expected: &str) -> String {
    match expected {
        "a string" => "string".into(),
        "a boolean" => "bool".into(),
        "i8" | "i16" | "i32" | "i64" | "u8" | "u16" | "u32" | "u64" | "f32" | "f64" => {
            let (sign, bits) = expected.split_at(1);
            match sign {
                "i" => format!("int{bits}"),
                "u" => format!("uint{bits}"),
                _ => format!("float{bits}"),
            }
        }
        "IntOrString" => "intstr.IntOrString".into(),
        "Quantity" => "resource.Quantity".into(),
        // k8s-openapi names its structs as Go does; their packages are all `v1` here.
        other => format!("v1.{other}"),
    }
}
