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
            serde_json::from_value(value.clone()).map_err(|e| undecodable(kind, e))
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
}
