//! Protobuf request bodies (`application/vnd.kubernetes.protobuf`), turned into the JSON a client
//! would have sent, so that everything after body decoding sees one format.
//!
//! The wire form is apimachinery's protobuf serializer: the four bytes `k8s\0`, then a
//! `runtime.Unknown` message whose `typeMeta` names the object and whose `raw` holds the typed
//! object (without `apiVersion`/`kind`, which only the envelope carries). The typed messages are
//! `k8s-pb`'s prost structs.
//!
//! Go's generated marshallers always write a non-pointer field, so an empty `clusterIP` arrives as
//! `Some("")` and a zero `nodePort` as `Some(0)`. The conversion therefore follows Go's
//! `encoding/json` per field, as the Go struct declares it: a non-pointer `omitempty` field is left
//! out when it holds its zero value, a pointer field is written whenever it is set (`Some(false)`
//! stays `false`), and a field without `omitempty` is always written. `metav1.Time` is written in
//! whole seconds (its protobuf form drops nanoseconds) as RFC 3339, and an empty `Time` message is
//! Go's zero time, which JSON leaves out. Field names are the JSON API's (`clusterIP`, `podCIDRs`,
//! `Port` in `DaemonEndpoint`).

use std::collections::BTreeMap;

use k8s_pb::api::core::v1 as core;
use k8s_pb::api::discovery::v1 as discovery;
use k8s_pb::api::events::v1 as events;
use k8s_pb::api::networking::v1 as networking;
use k8s_pb::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_pb::apimachinery::pkg::runtime::Unknown;
use k8s_pb::apimachinery::pkg::util::intstr::IntOrString;
use prost::Message;
use serde_json::{Map, Value};

use crate::resource::Kind;

mod rbac;

/// The media type of Kubernetes' protobuf encoding.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// The prefix of every protobuf-encoded object (apimachinery's `protoEncodingPrefix`).
pub const MAGIC: [u8; 4] = *b"k8s\0";

/// The kinds whose protobuf bodies are decoded, as `(apiVersion, kind)`.
pub const DECODED: [(&str, &str); 9] = [
    ("v1", "Service"),
    ("v1", "Namespace"),
    ("v1", "Node"),
    ("v1", "Endpoints"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("v1", "Event"),
    ("events.k8s.io/v1", "Event"),
    ("networking.k8s.io/v1", "ServiceCIDR"),
    ("networking.k8s.io/v1", "IPAddress"),
];

/// Why a protobuf body could not be turned into JSON.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The body lacks the `k8s\0` prefix (apimachinery's wording).
    #[error(
        "provided data does not appear to be a protobuf message, expected prefix [107 56 115 0]"
    )]
    NotProtobuf,
    /// The `runtime.Unknown` envelope is not valid protobuf.
    #[error("failed to decode the protobuf envelope (runtime.Unknown)")]
    Envelope(#[source] prost::DecodeError),
    /// The envelope's `contentEncoding` is set; apimachinery's serializers never set it.
    #[error("unsupported protobuf content encoding {0:?}")]
    ContentEncoding(String),
    /// The envelope names a kind this server does not decode from protobuf.
    #[error("{}", unsupported_message(api_version, kind))]
    UnsupportedKind {
        /// `typeMeta.apiVersion` of the envelope.
        api_version: String,
        /// `typeMeta.kind` of the envelope.
        kind: String,
    },
    /// The object inside the envelope is not a valid message of the kind the envelope names.
    #[error("failed to decode the protobuf body as {api_version} {kind}")]
    Object {
        /// The object's `apiVersion`.
        api_version: String,
        /// The object's `kind`.
        kind: String,
        /// What prost found wrong.
        #[source]
        source: prost::DecodeError,
    },
    /// An `IntOrString` whose `type` is neither 0 (int) nor 1 (string).
    #[error("{field}: invalid IntOrString type {kind}")]
    IntOrString {
        /// The JSON field holding it.
        field: &'static str,
        /// The `type` sent.
        kind: i64,
    },
    /// A `metav1.Time` outside what RFC 3339 can write (Go's JSON refuses years past 9999 too).
    #[error("{field}: time {seconds} seconds after the epoch is out of range")]
    Time {
        /// The JSON field holding it.
        field: &'static str,
        /// The seconds sent.
        seconds: i64,
    },
    /// `managedFields[].fieldsV1` is JSON text on the wire, and this one is not valid JSON.
    #[error("managedFields: fieldsV1 is not valid JSON")]
    FieldsV1(#[source] serde_json::Error),
}

fn unsupported_message(api_version: &str, kind: &str) -> String {
    let decoded: Vec<String> = DECODED
        .iter()
        .chain(rbac::DECODED.iter())
        .map(|(version, kind)| format!("{version} {kind}"))
        .collect();
    format!(
        "protobuf bodies are accepted for {} and meta/v1 DeleteOptions; {api_version:?} {kind:?} must be sent as application/json or application/yaml",
        decoded.join(", ")
    )
}

impl Error {
    /// Whether the body was well-formed protobuf of a type this server does not decode (415),
    /// rather than a malformed body (400).
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            Error::UnsupportedKind { .. } | Error::ContentEncoding(_)
        )
    }
}

/// The envelope's type and the typed object's bytes.
struct Envelope {
    api_version: String,
    kind: String,
    raw: Vec<u8>,
}

fn envelope(body: &[u8]) -> Result<Envelope, Error> {
    let message = body.strip_prefix(&MAGIC).ok_or(Error::NotProtobuf)?;
    let unknown = Unknown::decode(message).map_err(Error::Envelope)?;
    if let Some(encoding) = unknown.content_encoding.filter(|e| !e.is_empty()) {
        return Err(Error::ContentEncoding(encoding));
    }
    let type_meta = unknown.type_meta.unwrap_or_default();
    Ok(Envelope {
        api_version: type_meta.api_version.unwrap_or_default(),
        kind: type_meta.kind.unwrap_or_default(),
        raw: unknown.raw.unwrap_or_default(),
    })
}

fn typed<M: Message + Default>(envelope: &Envelope) -> Result<M, Error> {
    M::decode(envelope.raw.as_slice()).map_err(|source| Error::Object {
        api_version: envelope.api_version.clone(),
        kind: envelope.kind.clone(),
        source,
    })
}

/// Decodes a protobuf object body (create, update) into its JSON form, `apiVersion` and `kind`
/// included. An envelope without a type is read as `endpoint`, the kind the URL names, as
/// kube-apiserver decodes into the endpoint's kind by default.
pub fn decode_object(body: &[u8], endpoint: Kind) -> Result<Value, Error> {
    let mut envelope = envelope(body)?;
    if envelope.kind.is_empty() {
        envelope.kind = endpoint.kind().to_owned();
        if envelope.api_version.is_empty() {
            envelope.api_version = endpoint.api_version().to_owned();
        }
    }
    // The typed bytes carry no `apiVersion`/`kind`; the envelope's type heads the object.
    let head = Fields::default()
        .put("apiVersion", envelope.api_version.as_str())
        .put("kind", envelope.kind.as_str());
    if let Some(decoded) = rbac::decode(head.clone(), &envelope) {
        return decoded;
    }
    match (envelope.api_version.as_str(), envelope.kind.as_str()) {
        ("v1", "Service") => service(head, typed(&envelope)?),
        ("v1", "Namespace") => namespace(head, typed(&envelope)?),
        ("v1", "Node") => node(head, typed(&envelope)?),
        ("v1", "Endpoints") => endpoints(head, typed(&envelope)?),
        ("discovery.k8s.io/v1", "EndpointSlice") => endpoint_slice(head, typed(&envelope)?),
        ("v1", "Event") => core_event(head, typed(&envelope)?),
        ("events.k8s.io/v1", "Event") => events_event(head, typed(&envelope)?),
        ("networking.k8s.io/v1", "ServiceCIDR") => service_cidr(head, typed(&envelope)?),
        ("networking.k8s.io/v1", "IPAddress") => ip_address(head, typed(&envelope)?),
        _ => Err(Error::UnsupportedKind {
            api_version: envelope.api_version,
            kind: envelope.kind,
        }),
    }
}

/// Decodes a protobuf access review (`authorization.k8s.io/v1` SelfSubjectAccessReview,
/// SelfSubjectRulesReview, SubjectAccessReview) into its JSON form.
pub fn decode_review(body: &[u8]) -> Result<Value, Error> {
    let envelope = envelope(body)?;
    let head = Fields::default()
        .put("apiVersion", envelope.api_version.as_str())
        .put("kind", envelope.kind.as_str());
    match rbac::decode(head, &envelope) {
        Some(decoded) => decoded,
        None => Err(Error::UnsupportedKind {
            api_version: envelope.api_version,
            kind: envelope.kind,
        }),
    }
}

/// Decodes a protobuf `DeleteOptions` body (client-go sends one with every typed delete) into
/// its JSON form. Every group version registers `DeleteOptions`, so only the kind is checked.
pub fn decode_delete_options(body: &[u8]) -> Result<Value, Error> {
    let envelope = envelope(body)?;
    if !matches!(envelope.kind.as_str(), "" | "DeleteOptions") {
        return Err(Error::UnsupportedKind {
            api_version: envelope.api_version,
            kind: envelope.kind,
        });
    }
    let options: meta::DeleteOptions = typed(&envelope)?;
    let preconditions = options.preconditions.map(|p| {
        Fields::default()
            .ptr("uid", p.uid)
            .ptr("resourceVersion", p.resource_version)
            .done()
    });
    Ok(Fields::default()
        .ptr("gracePeriodSeconds", options.grace_period_seconds)
        .value("preconditions", preconditions)
        .ptr("orphanDependents", options.orphan_dependents)
        .ptr("propagationPolicy", options.propagation_policy)
        .strings("dryRun", options.dry_run)
        .ptr(
            "ignoreStoreReadErrorWithClusterBreakingPotential",
            options.ignore_store_read_error_with_cluster_breaking_potential,
        )
        .done())
}

/// 0000-01-01T00:00:00Z and 9999-12-31T23:59:59Z in Unix seconds: the years Go's
/// `Time.MarshalJSON` accepts.
const YEAR_0: i64 = -62_167_219_200;
const END_OF_YEAR_9999: i64 = 253_402_300_799;

/// A JSON object written field by field, each method named after how Go's `encoding/json` writes
/// the field: a pointer ([`Fields::ptr`]), a value with `omitempty` ([`Fields::nonzero`]), a
/// value without it ([`Fields::always`]), and the lists, maps and nested objects.
#[derive(Default, Clone)]
struct Fields(Map<String, Value>);

impl Fields {
    fn put(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.0.insert(key.to_owned(), value.into());
        self
    }

    /// A Go pointer field (`*string`, `*int32`, `*int64`, `*bool`): written whenever set, zero
    /// values included.
    fn ptr<T: Into<Value>>(self, key: &str, value: Option<T>) -> Self {
        match value {
            Some(v) => self.put(key, v),
            None => self,
        }
    }

    /// A Go value field with `omitempty`: left out when it holds its type's zero value.
    fn nonzero<T: Into<Value> + Default + PartialEq>(self, key: &str, value: Option<T>) -> Self {
        self.ptr(key, value.filter(|v| *v != T::default()))
    }

    /// A Go value field without `omitempty`: always written, unset as its zero value.
    fn always<T: Into<Value> + Default>(self, key: &str, value: Option<T>) -> Self {
        self.put(key, value.unwrap_or_default())
    }

    /// Go `[]string` (an empty or nil slice is left out: both decode to nil in Go).
    fn strings(self, key: &str, values: Vec<String>) -> Self {
        if values.is_empty() {
            self
        } else {
            self.put(key, values)
        }
    }

    /// Go `map[string]string` with `omitempty`.
    fn string_map(self, key: &str, map: BTreeMap<String, String>) -> Self {
        if map.is_empty() {
            self
        } else {
            let object: Map<String, Value> = map
                .into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect();
            self.put(key, object)
        }
    }

    /// A Go slice of structs.
    fn list<T>(
        self,
        key: &str,
        items: Vec<T>,
        convert: impl Fn(T) -> Result<Value, Error>,
    ) -> Result<Self, Error> {
        if items.is_empty() {
            return Ok(self);
        }
        let items = items
            .into_iter()
            .map(convert)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.put(key, items))
    }

    /// A Go struct or pointer to one. Go's marshallers always write a non-pointer struct, so it
    /// is present whenever the sender set it; a pointer only when it was not nil.
    fn object<T>(
        self,
        key: &str,
        item: Option<T>,
        convert: impl Fn(T) -> Result<Value, Error>,
    ) -> Result<Self, Error> {
        match item {
            Some(item) => Ok(self.put(key, convert(item)?)),
            None => Ok(self),
        }
    }

    /// An already converted value, when there is one.
    fn value(self, key: &str, value: Option<Value>) -> Self {
        match value {
            Some(v) => self.put(key, v),
            None => self,
        }
    }

    /// `metav1.Time` (or a pointer to one): RFC 3339 in whole seconds; the zero time is an empty
    /// message and is left out.
    fn time(self, key: &'static str, time: Option<meta::Time>) -> Result<Self, Error> {
        let Some(seconds) = time.and_then(|t| t.seconds) else {
            return Ok(self);
        };
        let stamp = Some(seconds)
            .filter(|s| (YEAR_0..=END_OF_YEAR_9999).contains(s))
            .and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok())
            .ok_or(Error::Time {
                field: key,
                seconds,
            })?;
        Ok(self.put(key, stamp.to_string()))
    }

    fn done(self) -> Value {
        Value::Object(self.0)
    }

    /// `metav1.MicroTime`: RFC 3339 with microseconds, in UTC; the zero time is left out (Go
    /// writes `null`).
    fn micro_time(self, key: &'static str, time: Option<meta::MicroTime>) -> Result<Self, Error> {
        let Some(time) = time.filter(|t| t.seconds.is_some() || t.nanos.is_some()) else {
            return Ok(self);
        };
        let seconds = time.seconds.unwrap_or(0);
        let stamp = Some(seconds)
            .filter(|s| (YEAR_0..=END_OF_YEAR_9999).contains(s))
            .and_then(|s| {
                k8s_openapi::jiff::Timestamp::new(s, time.nanos.unwrap_or(0).clamp(0, 999_999_999))
                    .ok()
            })
            .ok_or(Error::Time {
                field: key,
                seconds,
            })?;
        let text = k8s_openapi::jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%S%.6fZ", stamp)
            .map_err(|_| Error::Time {
                field: key,
                seconds,
            })?;
        Ok(self.put(key, text))
    }
}

/// `intstr.IntOrString`: a JSON number for type 0, a string for type 1.
fn int_or_string(field: &'static str, value: IntOrString) -> Result<Value, Error> {
    match value.r#type.unwrap_or(0) {
        0 => Ok(Value::from(value.int_val.unwrap_or(0))),
        1 => Ok(Value::from(value.str_val.unwrap_or_default())),
        kind => Err(Error::IntOrString { field, kind }),
    }
}

fn object_meta(m: meta::ObjectMeta) -> Result<Value, Error> {
    Ok(Fields::default()
        .nonzero("name", m.name)
        .nonzero("generateName", m.generate_name)
        .nonzero("namespace", m.namespace)
        .nonzero("selfLink", m.self_link)
        .nonzero("uid", m.uid)
        .nonzero("resourceVersion", m.resource_version)
        .nonzero("generation", m.generation)
        .time("creationTimestamp", m.creation_timestamp)?
        .time("deletionTimestamp", m.deletion_timestamp)?
        .ptr(
            "deletionGracePeriodSeconds",
            m.deletion_grace_period_seconds,
        )
        .string_map("labels", m.labels)
        .string_map("annotations", m.annotations)
        .list("ownerReferences", m.owner_references, owner_reference)?
        .strings("finalizers", m.finalizers)
        .list("managedFields", m.managed_fields, managed_fields_entry)?
        .done())
}

fn owner_reference(r: meta::OwnerReference) -> Result<Value, Error> {
    Ok(Fields::default()
        .always("apiVersion", r.api_version)
        .always("kind", r.kind)
        .always("name", r.name)
        .always("uid", r.uid)
        .ptr("controller", r.controller)
        .ptr("blockOwnerDeletion", r.block_owner_deletion)
        .done())
}

fn managed_fields_entry(e: meta::ManagedFieldsEntry) -> Result<Value, Error> {
    // FieldsV1 carries its JSON text as bytes and marshals to that JSON as it is.
    let fields_v1 = e
        .fields_v1
        .map(|f| serde_json::from_slice::<Value>(&f.raw.unwrap_or_default()))
        .transpose()
        .map_err(Error::FieldsV1)?;
    Ok(Fields::default()
        .nonzero("manager", e.manager)
        .nonzero("operation", e.operation)
        .nonzero("apiVersion", e.api_version)
        .time("time", e.time)?
        .nonzero("fieldsType", e.fields_type)
        .value("fieldsV1", fields_v1)
        .nonzero("subresource", e.subresource)
        .done())
}

fn condition(c: meta::Condition) -> Result<Value, Error> {
    Ok(Fields::default()
        .always("type", c.r#type)
        .always("status", c.status)
        .nonzero("observedGeneration", c.observed_generation)
        .time("lastTransitionTime", c.last_transition_time)?
        .always("reason", c.reason)
        .always("message", c.message)
        .done())
}

fn object_reference(r: core::ObjectReference) -> Result<Value, Error> {
    Ok(Fields::default()
        .nonzero("kind", r.kind)
        .nonzero("namespace", r.namespace)
        .nonzero("name", r.name)
        .nonzero("uid", r.uid)
        .nonzero("apiVersion", r.api_version)
        .nonzero("resourceVersion", r.resource_version)
        .nonzero("fieldPath", r.field_path)
        .done())
}

fn service(head: Fields, s: core::Service) -> Result<Value, Error> {
    head.object("metadata", s.metadata, object_meta)?
        .object("spec", s.spec, service_spec)?
        .object("status", s.status, service_status)
        .map(Fields::done)
}

fn service_spec(s: core::ServiceSpec) -> Result<Value, Error> {
    Ok(Fields::default()
        .list("ports", s.ports, service_port)?
        .string_map("selector", s.selector)
        .nonzero("clusterIP", s.cluster_ip)
        .strings("clusterIPs", s.cluster_ips)
        .nonzero("type", s.r#type)
        .strings("externalIPs", s.external_ips)
        .nonzero("sessionAffinity", s.session_affinity)
        .nonzero("loadBalancerIP", s.load_balancer_ip)
        .strings("loadBalancerSourceRanges", s.load_balancer_source_ranges)
        .nonzero("externalName", s.external_name)
        .nonzero("externalTrafficPolicy", s.external_traffic_policy)
        .nonzero("healthCheckNodePort", s.health_check_node_port)
        .nonzero("publishNotReadyAddresses", s.publish_not_ready_addresses)
        .object("sessionAffinityConfig", s.session_affinity_config, |c| {
            Fields::default()
                .object("clientIP", c.client_ip, |ip| {
                    Ok(Fields::default()
                        .ptr("timeoutSeconds", ip.timeout_seconds)
                        .done())
                })
                .map(Fields::done)
        })?
        .strings("ipFamilies", s.ip_families)
        .ptr("ipFamilyPolicy", s.ip_family_policy)
        .ptr(
            "allocateLoadBalancerNodePorts",
            s.allocate_load_balancer_node_ports,
        )
        .ptr("loadBalancerClass", s.load_balancer_class)
        .ptr("internalTrafficPolicy", s.internal_traffic_policy)
        .ptr("trafficDistribution", s.traffic_distribution)
        .done())
}

fn service_port(p: core::ServicePort) -> Result<Value, Error> {
    // `targetPort` is a struct in Go, so JSON always carries it (0 when unset, which the
    // registry defaults to `port` as kube-apiserver does).
    let target_port = match p.target_port {
        Some(t) => int_or_string("targetPort", t)?,
        None => Value::from(0),
    };
    Ok(Fields::default()
        .nonzero("name", p.name)
        .nonzero("protocol", p.protocol)
        .ptr("appProtocol", p.app_protocol)
        .always("port", p.port)
        .put("targetPort", target_port)
        .nonzero("nodePort", p.node_port)
        .done())
}

fn service_status(s: core::ServiceStatus) -> Result<Value, Error> {
    Fields::default()
        .object("loadBalancer", s.load_balancer, load_balancer_status)?
        .list("conditions", s.conditions, condition)
        .map(Fields::done)
}

fn load_balancer_status(s: core::LoadBalancerStatus) -> Result<Value, Error> {
    Fields::default()
        .list("ingress", s.ingress, |i| {
            Fields::default()
                .nonzero("ip", i.ip)
                .nonzero("hostname", i.hostname)
                .ptr("ipMode", i.ip_mode)
                .list("ports", i.ports, |p| {
                    Ok(Fields::default()
                        .always("port", p.port)
                        .always("protocol", p.protocol)
                        .ptr("error", p.error)
                        .done())
                })
                .map(Fields::done)
        })
        .map(Fields::done)
}

fn namespace(head: Fields, n: core::Namespace) -> Result<Value, Error> {
    head.object("metadata", n.metadata, object_meta)?
        .object("spec", n.spec, |s| {
            Ok(Fields::default().strings("finalizers", s.finalizers).done())
        })?
        .object("status", n.status, |s| {
            Fields::default()
                .nonzero("phase", s.phase)
                .list("conditions", s.conditions, |c| {
                    Ok(Fields::default()
                        .always("type", c.r#type)
                        .always("status", c.status)
                        .time("lastTransitionTime", c.last_transition_time)?
                        .nonzero("reason", c.reason)
                        .nonzero("message", c.message)
                        .done())
                })
                .map(Fields::done)
        })
        .map(Fields::done)
}

fn node(head: Fields, n: core::Node) -> Result<Value, Error> {
    head.object("metadata", n.metadata, object_meta)?
        .object("spec", n.spec, node_spec)?
        .object("status", n.status, node_status)
        .map(Fields::done)
}

fn node_spec(s: core::NodeSpec) -> Result<Value, Error> {
    Ok(Fields::default()
        .nonzero("podCIDR", s.pod_cidr)
        .strings("podCIDRs", s.pod_cid_rs)
        .nonzero("providerID", s.provider_id)
        .nonzero("unschedulable", s.unschedulable)
        .list("taints", s.taints, |t| {
            Ok(Fields::default()
                .always("key", t.key)
                .nonzero("value", t.value)
                .always("effect", t.effect)
                .time("timeAdded", t.time_added)?
                .done())
        })?
        .object("configSource", s.config_source, node_config_source)?
        .nonzero("externalID", s.external_id)
        .done())
}

fn node_config_source(s: core::NodeConfigSource) -> Result<Value, Error> {
    Fields::default()
        .object("configMap", s.config_map, |c| {
            Ok(Fields::default()
                .always("namespace", c.namespace)
                .always("name", c.name)
                .nonzero("uid", c.uid)
                .nonzero("resourceVersion", c.resource_version)
                .always("kubeletConfigKey", c.kubelet_config_key)
                .done())
        })
        .map(Fields::done)
}

fn node_status(s: core::NodeStatus) -> Result<Value, Error> {
    let quantities = |map: BTreeMap<String, k8s_pb::apimachinery::pkg::api::resource::Quantity>| {
        map.into_iter()
            .map(|(name, q)| (name, q.string.unwrap_or_default()))
            .collect::<BTreeMap<_, _>>()
    };
    Ok(Fields::default()
        .string_map("capacity", quantities(s.capacity))
        .string_map("allocatable", quantities(s.allocatable))
        .nonzero("phase", s.phase)
        .list("conditions", s.conditions, |c| {
            Ok(Fields::default()
                .always("type", c.r#type)
                .always("status", c.status)
                .time("lastHeartbeatTime", c.last_heartbeat_time)?
                .time("lastTransitionTime", c.last_transition_time)?
                .nonzero("reason", c.reason)
                .nonzero("message", c.message)
                .done())
        })?
        .list("addresses", s.addresses, |a| {
            Ok(Fields::default()
                .always("type", a.r#type)
                .always("address", a.address)
                .done())
        })?
        .object("daemonEndpoints", s.daemon_endpoints, |d| {
            Fields::default()
                // `DaemonEndpoint.Port` is the one capitalised JSON name in core/v1.
                .object("kubeletEndpoint", d.kubelet_endpoint, |e| {
                    Ok(Fields::default().always("Port", e.port).done())
                })
                .map(Fields::done)
        })?
        .object("nodeInfo", s.node_info, node_system_info)?
        .list("images", s.images, |i| {
            Ok(Fields::default()
                .strings("names", i.names)
                .nonzero("sizeBytes", i.size_bytes)
                .done())
        })?
        .strings("volumesInUse", s.volumes_in_use)
        .list("volumesAttached", s.volumes_attached, |v| {
            Ok(Fields::default()
                .always("name", v.name)
                .always("devicePath", v.device_path)
                .done())
        })?
        .object("config", s.config, |c| {
            Ok(Fields::default()
                .object("assigned", c.assigned, node_config_source)?
                .object("active", c.active, node_config_source)?
                .object("lastKnownGood", c.last_known_good, node_config_source)?
                .nonzero("error", c.error)
                .done())
        })?
        .list("runtimeHandlers", s.runtime_handlers, |h| {
            Fields::default()
                .always("name", h.name)
                .object("features", h.features, |f| {
                    Ok(Fields::default()
                        .ptr("recursiveReadOnlyMounts", f.recursive_read_only_mounts)
                        .ptr("userNamespaces", f.user_namespaces)
                        .done())
                })
                .map(Fields::done)
        })?
        .object("features", s.features, |f| {
            Ok(Fields::default()
                .ptr("supplementalGroupsPolicy", f.supplemental_groups_policy)
                .done())
        })?
        .strings("declaredFeatures", s.declared_features)
        .done())
}

fn node_system_info(i: core::NodeSystemInfo) -> Result<Value, Error> {
    Fields::default()
        .always("machineID", i.machine_id)
        .always("systemUUID", i.system_uuid)
        .always("bootID", i.boot_id)
        .always("kernelVersion", i.kernel_version)
        .always("osImage", i.os_image)
        .always("containerRuntimeVersion", i.container_runtime_version)
        .always("kubeletVersion", i.kubelet_version)
        .always("kubeProxyVersion", i.kube_proxy_version)
        .always("operatingSystem", i.operating_system)
        .always("architecture", i.architecture)
        .object("swap", i.swap, |s| {
            Ok(Fields::default().ptr("capacity", s.capacity).done())
        })
        .map(Fields::done)
}

fn endpoints(head: Fields, e: core::Endpoints) -> Result<Value, Error> {
    head.object("metadata", e.metadata, object_meta)?
        .list("subsets", e.subsets, |s| {
            Fields::default()
                .list("addresses", s.addresses, endpoint_address)?
                .list("notReadyAddresses", s.not_ready_addresses, endpoint_address)?
                .list("ports", s.ports, |p| {
                    Ok(Fields::default()
                        .nonzero("name", p.name)
                        .always("port", p.port)
                        .nonzero("protocol", p.protocol)
                        .ptr("appProtocol", p.app_protocol)
                        .done())
                })
                .map(Fields::done)
        })
        .map(Fields::done)
}

fn endpoint_address(a: core::EndpointAddress) -> Result<Value, Error> {
    Fields::default()
        .always("ip", a.ip)
        .nonzero("hostname", a.hostname)
        .ptr("nodeName", a.node_name)
        .object("targetRef", a.target_ref, object_reference)
        .map(Fields::done)
}

fn endpoint_slice(head: Fields, s: discovery::EndpointSlice) -> Result<Value, Error> {
    // `endpoints` and `ports` have no `omitempty`; Go writes a nil slice as `null`, which
    // decodes as an absent field, so an empty one is left out like the other slices.
    head.object("metadata", s.metadata, object_meta)?
        .always("addressType", s.address_type)
        .list("endpoints", s.endpoints, slice_endpoint)?
        .list("ports", s.ports, |p| {
            Ok(Fields::default()
                .ptr("name", p.name)
                .ptr("protocol", p.protocol)
                .ptr("port", p.port)
                .ptr("appProtocol", p.app_protocol)
                .done())
        })
        .map(Fields::done)
}

fn service_cidr(head: Fields, c: networking::ServiceCIDR) -> Result<Value, Error> {
    head.object("metadata", c.metadata, object_meta)?
        .object("spec", c.spec, |s| {
            Ok(Fields::default().strings("cidrs", s.cidrs).done())
        })?
        .object("status", c.status, |s| {
            Fields::default()
                .list("conditions", s.conditions, condition)
                .map(Fields::done)
        })
        .map(Fields::done)
}

fn ip_address(head: Fields, a: networking::IPAddress) -> Result<Value, Error> {
    head.object("metadata", a.metadata, object_meta)?
        .object("spec", a.spec, |s| {
            // `parentRef` is a pointer; its fields have no `omitempty` but `group` and
            // `namespace`.
            Ok(Fields::default()
                .value(
                    "parentRef",
                    s.parent_ref.map(|p| {
                        Fields::default()
                            .nonzero("group", p.group)
                            .always("resource", p.resource)
                            .nonzero("namespace", p.namespace)
                            .always("name", p.name)
                            .done()
                    }),
                )
                .done())
        })
        .map(Fields::done)
}

fn slice_endpoint(e: discovery::Endpoint) -> Result<Value, Error> {
    let name = |n: Option<String>| Ok(Fields::default().always("name", n).done());
    Fields::default()
        .strings("addresses", e.addresses)
        .object("conditions", e.conditions, |c| {
            Ok(Fields::default()
                .ptr("ready", c.ready)
                .ptr("serving", c.serving)
                .ptr("terminating", c.terminating)
                .done())
        })?
        .ptr("hostname", e.hostname)
        .object("targetRef", e.target_ref, object_reference)?
        .string_map("deprecatedTopology", e.deprecated_topology)
        .ptr("nodeName", e.node_name)
        .ptr("zone", e.zone)
        .object("hints", e.hints, |h| {
            Fields::default()
                .list("forZones", h.for_zones, |z| name(z.name))?
                .list("forNodes", h.for_nodes, |n| name(n.name))
                .map(Fields::done)
        })
        .map(Fields::done)
}

fn event_source(s: core::EventSource) -> Result<Value, Error> {
    Ok(Fields::default()
        .nonzero("component", s.component)
        .nonzero("host", s.host)
        .done())
}

/// core/v1 `EventSeries` (`count`, `lastObservedTime`, both `omitempty`).
fn core_event_series(s: core::EventSeries) -> Result<Value, Error> {
    Fields::default()
        .nonzero("count", s.count)
        .micro_time("lastObservedTime", s.last_observed_time)
        .map(Fields::done)
}

/// events.k8s.io/v1 `EventSeries` (neither field `omitempty`).
fn events_event_series(s: events::EventSeries) -> Result<Value, Error> {
    Fields::default()
        .always("count", s.count)
        .micro_time("lastObservedTime", s.last_observed_time)
        .map(Fields::done)
}

/// core/v1 Event, as client-go's legacy event recorder sends it.
fn core_event(head: Fields, e: core::Event) -> Result<Value, Error> {
    Ok(head
        .object("metadata", e.metadata, object_meta)?
        .object("involvedObject", e.involved_object, object_reference)?
        .nonzero("reason", e.reason)
        .nonzero("message", e.message)
        .object("source", e.source, event_source)?
        .time("firstTimestamp", e.first_timestamp)?
        .time("lastTimestamp", e.last_timestamp)?
        .nonzero("count", e.count)
        .nonzero("type", e.r#type)
        .micro_time("eventTime", e.event_time)?
        .object("series", e.series, core_event_series)?
        .nonzero("action", e.action)
        .object("related", e.related, object_reference)?
        .always("reportingComponent", e.reporting_component)
        .always("reportingInstance", e.reporting_instance)
        .done())
}

/// events.k8s.io/v1 Event, as client-go's new event recorder sends it.
fn events_event(head: Fields, e: events::Event) -> Result<Value, Error> {
    Ok(head
        .object("metadata", e.metadata, object_meta)?
        .micro_time("eventTime", e.event_time)?
        .object("series", e.series, events_event_series)?
        .nonzero("reportingController", e.reporting_controller)
        .nonzero("reportingInstance", e.reporting_instance)
        .nonzero("action", e.action)
        .nonzero("reason", e.reason)
        .object("regarding", e.regarding, object_reference)?
        .object("related", e.related, object_reference)?
        .nonzero("note", e.note)
        .nonzero("type", e.r#type)
        .object("deprecatedSource", e.deprecated_source, event_source)?
        .time("deprecatedFirstTimestamp", e.deprecated_first_timestamp)?
        .time("deprecatedLastTimestamp", e.deprecated_last_timestamp)?
        .nonzero("deprecatedCount", e.deprecated_count)
        .done())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use k8s_pb::apimachinery::pkg::api::resource::Quantity;
    use k8s_pb::apimachinery::pkg::runtime::TypeMeta;

    /// `k8s\0` + `runtime.Unknown`, as apimachinery's protobuf serializer writes a body.
    fn wire(api_version: &str, kind: &str, object: &impl Message) -> Vec<u8> {
        let unknown = Unknown {
            type_meta: Some(TypeMeta {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
            }),
            raw: Some(object.encode_to_vec()),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        [MAGIC.as_slice(), &unknown.encode_to_vec()].concat()
    }

    fn empty() -> Option<String> {
        Some(String::new())
    }

    /// `ObjectMeta` as Go's marshaller writes it: every non-pointer field present, the zero
    /// `creationTimestamp` as an empty message.
    fn go_meta(name: &str, labels: &[(&str, &str)]) -> meta::ObjectMeta {
        meta::ObjectMeta {
            name: Some(name.into()),
            generate_name: empty(),
            namespace: empty(),
            self_link: empty(),
            uid: empty(),
            resource_version: empty(),
            generation: Some(0),
            creation_timestamp: Some(meta::Time::default()),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    /// What `kubectl create service <type> <name> --tcp=80:8080` builds, as Go writes it.
    fn kubectl_service(name: &str, kind: &str, node_port: i32) -> core::Service {
        let app = [("app", name)];
        core::Service {
            metadata: Some(go_meta(name, &app)),
            spec: Some(core::ServiceSpec {
                ports: vec![core::ServicePort {
                    name: Some("80-8080".into()),
                    protocol: Some("TCP".into()),
                    app_protocol: None,
                    port: Some(80),
                    target_port: Some(IntOrString {
                        r#type: Some(0),
                        int_val: Some(8080),
                        str_val: empty(),
                    }),
                    node_port: Some(node_port),
                }],
                selector: go_meta(name, &app).labels,
                cluster_ip: empty(),
                r#type: Some(kind.into()),
                session_affinity: empty(),
                load_balancer_ip: empty(),
                external_name: empty(),
                external_traffic_policy: empty(),
                health_check_node_port: Some(0),
                publish_not_ready_addresses: Some(false),
                ..Default::default()
            }),
            status: Some(core::ServiceStatus {
                load_balancer: Some(core::LoadBalancerStatus::default()),
                conditions: vec![],
            }),
        }
    }

    fn decode_service(service: &core::Service) -> Value {
        decode_object(&wire("v1", "Service", service), Kind::Service).unwrap()
    }

    #[test]
    fn kubectl_create_service_nodeport_decodes_to_the_json_kubectl_would_send() {
        let body = decode_service(&kubectl_service("smp", "NodePort", 30080));
        // `kubectl create service nodeport smp --tcp=80:8080 --node-port=30080 -o json`, less
        // the `creationTimestamp: null` that Go writes for the zero time.
        assert_eq!(
            body,
            json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "smp", "labels": {"app": "smp"}},
                "spec": {
                    "ports": [{
                        "name": "80-8080",
                        "protocol": "TCP",
                        "port": 80,
                        "targetPort": 8080,
                        "nodePort": 30080
                    }],
                    "selector": {"app": "smp"},
                    "type": "NodePort"
                },
                "status": {"loadBalancer": {}}
            })
        );
    }

    #[test]
    fn kubectl_create_service_clusterip_leaves_out_the_zero_node_port() {
        let body = decode_service(&kubectl_service("cip", "ClusterIP", 0));
        assert_eq!(
            body["spec"]["ports"],
            json!([{"name": "80-8080", "protocol": "TCP", "port": 80, "targetPort": 8080}])
        );
        assert_eq!(body["spec"]["type"], "ClusterIP");
        assert!(body["spec"].get("clusterIP").is_none(), "{body}");
    }

    #[test]
    fn kubectl_create_namespace_decodes_to_the_json_kubectl_would_send() {
        let namespace = core::Namespace {
            metadata: Some(go_meta("team-a", &[])),
            spec: Some(core::NamespaceSpec::default()),
            status: Some(core::NamespaceStatus {
                phase: empty(),
                conditions: vec![],
            }),
        };
        let body = decode_object(&wire("v1", "Namespace", &namespace), Kind::Namespace).unwrap();
        assert_eq!(
            body,
            json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": "team-a"},
                "spec": {},
                "status": {}
            })
        );
    }

    #[test]
    fn int_or_string_target_ports_become_numbers_or_strings() {
        let mut service = kubectl_service("ios", "ClusterIP", 0);
        let spec = service.spec.as_mut().unwrap();
        let named = IntOrString {
            r#type: Some(1),
            int_val: Some(0),
            str_val: Some("http".into()),
        };
        let mut second = spec.ports[0].clone();
        second.name = Some("web".into());
        second.target_port = Some(named);
        spec.ports.push(second);
        // A port without targetPort: Go's JSON writes the zero IntOrString, 0.
        let mut third = spec.ports[0].clone();
        third.name = Some("bare".into());
        third.target_port = None;
        spec.ports.push(third);
        let body = decode_service(&service);
        let targets: Vec<&Value> = body["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| &p["targetPort"])
            .collect();
        assert_eq!(targets, [&json!(8080), &json!("http"), &json!(0)]);

        let mut bad = kubectl_service("bad", "ClusterIP", 0);
        bad.spec.as_mut().unwrap().ports[0].target_port = Some(IntOrString {
            r#type: Some(7),
            ..Default::default()
        });
        let err = decode_object(&wire("v1", "Service", &bad), Kind::Service).unwrap_err();
        assert!(matches!(err, Error::IntOrString { kind: 7, .. }), "{err}");
    }

    #[test]
    fn object_meta_keeps_labels_annotations_owners_times_and_managed_fields() {
        let mut service = kubectl_service("meta", "ClusterIP", 0);
        let metadata = service.metadata.as_mut().unwrap();
        metadata.namespace = Some("team-a".into());
        metadata.uid = Some("0b5a3f3e-1111-4c1c-9d3e-000000000001".into());
        metadata.resource_version = Some("42".into());
        metadata.generation = Some(3);
        metadata.creation_timestamp = Some(meta::Time {
            seconds: Some(1_700_000_000),
            nanos: Some(0),
        });
        metadata.deletion_grace_period_seconds = Some(0);
        metadata
            .labels
            .insert("app.kubernetes.io/name".into(), "meta".into());
        metadata.annotations.insert(
            "kubectl.kubernetes.io/last-applied-configuration".into(),
            "{\"a\":1}\n".into(),
        );
        metadata.annotations.insert("empty".into(), String::new());
        metadata.finalizers = vec!["example.com/hold".into()];
        metadata.owner_references = vec![meta::OwnerReference {
            api_version: Some("apps/v1".into()),
            kind: Some("Deployment".into()),
            name: Some("web".into()),
            uid: Some("u-1".into()),
            controller: Some(false),
            block_owner_deletion: None,
        }];
        metadata.managed_fields = vec![meta::ManagedFieldsEntry {
            manager: Some("kubectl-create".into()),
            operation: Some("Update".into()),
            api_version: Some("v1".into()),
            time: Some(meta::Time {
                seconds: Some(1_700_000_060),
                nanos: Some(0),
            }),
            fields_type: Some("FieldsV1".into()),
            fields_v1: Some(meta::FieldsV1 {
                raw: Some(br#"{"f:spec":{"f:type":{}}}"#.to_vec()),
            }),
            subresource: empty(),
        }];
        let body = decode_service(&service);
        assert_eq!(
            body["metadata"],
            json!({
                "name": "meta",
                "namespace": "team-a",
                "uid": "0b5a3f3e-1111-4c1c-9d3e-000000000001",
                "resourceVersion": "42",
                "generation": 3,
                "creationTimestamp": "2023-11-14T22:13:20Z",
                "deletionGracePeriodSeconds": 0,
                "labels": {"app": "meta", "app.kubernetes.io/name": "meta"},
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{\"a\":1}\n",
                    "empty": ""
                },
                "ownerReferences": [{
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": "web",
                    "uid": "u-1",
                    "controller": false
                }],
                "finalizers": ["example.com/hold"],
                "managedFields": [{
                    "manager": "kubectl-create",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "time": "2023-11-14T22:14:20Z",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:spec": {"f:type": {}}}
                }]
            })
        );
    }

    #[test]
    fn pointer_fields_keep_their_zero_values_and_plain_fields_drop_them() {
        let mut service = kubectl_service("lb", "LoadBalancer", 0);
        let spec = service.spec.as_mut().unwrap();
        spec.allocate_load_balancer_node_ports = Some(false);
        spec.ip_family_policy = Some("SingleStack".into());
        spec.internal_traffic_policy = Some("Cluster".into());
        spec.external_traffic_policy = Some("Local".into());
        spec.health_check_node_port = Some(30999);
        spec.cluster_ips = vec!["10.96.0.20".into()];
        spec.ip_families = vec!["IPv4".into()];
        spec.session_affinity = Some("ClientIP".into());
        spec.session_affinity_config = Some(core::SessionAffinityConfig {
            client_ip: Some(core::ClientIpConfig {
                timeout_seconds: Some(10800),
            }),
        });
        spec.ports[0].app_protocol = Some(String::new());
        service.status = Some(core::ServiceStatus {
            load_balancer: Some(core::LoadBalancerStatus {
                ingress: vec![core::LoadBalancerIngress {
                    ip: Some("203.0.113.9".into()),
                    hostname: empty(),
                    ip_mode: Some("VIP".into()),
                    ports: vec![core::PortStatus {
                        port: Some(80),
                        protocol: Some("TCP".into()),
                        error: None,
                    }],
                }],
            }),
            conditions: vec![meta::Condition {
                r#type: Some("Ready".into()),
                status: Some("True".into()),
                observed_generation: Some(0),
                last_transition_time: Some(meta::Time {
                    seconds: Some(0),
                    nanos: Some(0),
                }),
                reason: empty(),
                message: empty(),
            }],
        });
        let body = decode_service(&service);
        let spec = &body["spec"];
        assert_eq!(spec["allocateLoadBalancerNodePorts"], json!(false));
        assert_eq!(spec["ipFamilyPolicy"], "SingleStack");
        assert_eq!(spec["internalTrafficPolicy"], "Cluster");
        assert_eq!(spec["externalTrafficPolicy"], "Local");
        assert_eq!(spec["healthCheckNodePort"], 30999);
        assert_eq!(spec["clusterIPs"], json!(["10.96.0.20"]));
        assert_eq!(spec["ipFamilies"], json!(["IPv4"]));
        assert_eq!(
            spec["sessionAffinityConfig"],
            json!({"clientIP": {"timeoutSeconds": 10800}})
        );
        assert_eq!(spec["ports"][0]["appProtocol"], "");
        for unset in ["publishNotReadyAddresses", "loadBalancerIP", "externalName"] {
            assert!(spec.get(unset).is_none(), "{unset} in {spec}");
        }
        assert_eq!(
            body["status"],
            json!({
                "loadBalancer": {"ingress": [{
                    "ip": "203.0.113.9",
                    "ipMode": "VIP",
                    "ports": [{"port": 80, "protocol": "TCP"}]
                }]},
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "lastTransitionTime": "1970-01-01T00:00:00Z",
                    "reason": "",
                    "message": ""
                }]
            })
        );
    }

    #[test]
    fn nodes_decode_with_addresses_capacity_conditions_and_the_capitalised_kubelet_port() {
        let node = core::Node {
            metadata: Some(go_meta("node-a", &[("kubernetes.io/hostname", "node-a")])),
            spec: Some(core::NodeSpec {
                pod_cidr: Some("10.244.1.0/24".into()),
                pod_cid_rs: vec!["10.244.1.0/24".into()],
                provider_id: empty(),
                unschedulable: Some(true),
                taints: vec![core::Taint {
                    key: Some("node.kubernetes.io/unschedulable".into()),
                    value: empty(),
                    effect: Some("NoSchedule".into()),
                    time_added: Some(meta::Time {
                        seconds: Some(1_700_000_000),
                        nanos: None,
                    }),
                }],
                config_source: None,
                external_id: empty(),
            }),
            status: Some(core::NodeStatus {
                capacity: [(
                    "cpu".to_string(),
                    Quantity {
                        string: Some("2".into()),
                    },
                )]
                .into(),
                allocatable: [(
                    "memory".to_string(),
                    Quantity {
                        string: Some("24Gi".into()),
                    },
                )]
                .into(),
                phase: empty(),
                conditions: vec![core::NodeCondition {
                    r#type: Some("Ready".into()),
                    status: Some("True".into()),
                    last_heartbeat_time: Some(meta::Time {
                        seconds: Some(1_700_000_000),
                        nanos: Some(0),
                    }),
                    last_transition_time: Some(meta::Time::default()),
                    reason: Some("KubeletReady".into()),
                    message: empty(),
                }],
                addresses: vec![core::NodeAddress {
                    r#type: Some("InternalIP".into()),
                    address: Some("192.0.2.11".into()),
                }],
                daemon_endpoints: Some(core::NodeDaemonEndpoints {
                    kubelet_endpoint: Some(core::DaemonEndpoint { port: Some(10250) }),
                }),
                node_info: Some(core::NodeSystemInfo {
                    kubelet_version: Some("v1.32.0".into()),
                    ..Default::default()
                }),
                images: vec![core::ContainerImage {
                    names: vec!["registry.k8s.io/pause:3.10".into()],
                    size_bytes: Some(320_368),
                }],
                ..Default::default()
            }),
        };
        let body = decode_object(&wire("v1", "Node", &node), Kind::Node).unwrap();
        assert_eq!(body["kind"], "Node");
        assert_eq!(
            body["spec"],
            json!({
                "podCIDR": "10.244.1.0/24",
                "podCIDRs": ["10.244.1.0/24"],
                "unschedulable": true,
                "taints": [{
                    "key": "node.kubernetes.io/unschedulable",
                    "effect": "NoSchedule",
                    "timeAdded": "2023-11-14T22:13:20Z"
                }]
            })
        );
        let status = &body["status"];
        assert_eq!(status["capacity"], json!({"cpu": "2"}));
        assert_eq!(status["allocatable"], json!({"memory": "24Gi"}));
        assert_eq!(
            status["conditions"],
            json!([{
                "type": "Ready",
                "status": "True",
                "lastHeartbeatTime": "2023-11-14T22:13:20Z",
                "reason": "KubeletReady"
            }])
        );
        assert_eq!(
            status["addresses"],
            json!([{"type": "InternalIP", "address": "192.0.2.11"}])
        );
        assert_eq!(
            status["daemonEndpoints"],
            json!({"kubeletEndpoint": {"Port": 10250}})
        );
        assert_eq!(status["nodeInfo"]["kubeletVersion"], "v1.32.0");
        assert_eq!(status["nodeInfo"]["machineID"], "");
        assert_eq!(
            status["images"],
            json!([{"names": ["registry.k8s.io/pause:3.10"], "sizeBytes": 320368}])
        );
    }

    #[test]
    fn endpoints_decode_with_ready_and_not_ready_addresses() {
        let address = |ip: &str, node: Option<&str>| core::EndpointAddress {
            ip: Some(ip.into()),
            hostname: empty(),
            node_name: node.map(Into::into),
            target_ref: Some(core::ObjectReference {
                kind: Some("Pod".into()),
                namespace: Some("default".into()),
                name: Some("web-1".into()),
                uid: empty(),
                api_version: empty(),
                resource_version: empty(),
                field_path: empty(),
            }),
        };
        let endpoints = core::Endpoints {
            metadata: Some(go_meta("web", &[])),
            subsets: vec![core::EndpointSubset {
                addresses: vec![address("10.244.1.5", Some("node-a"))],
                not_ready_addresses: vec![address("10.244.2.5", None)],
                ports: vec![core::EndpointPort {
                    name: empty(),
                    port: Some(8080),
                    protocol: Some("TCP".into()),
                    app_protocol: None,
                }],
            }],
        };
        let body = decode_object(&wire("v1", "Endpoints", &endpoints), Kind::Endpoints).unwrap();
        let target = json!({"kind": "Pod", "namespace": "default", "name": "web-1"});
        assert_eq!(
            body["subsets"],
            json!([{
                "addresses": [{"ip": "10.244.1.5", "nodeName": "node-a", "targetRef": target}],
                "notReadyAddresses": [{"ip": "10.244.2.5", "targetRef": target}],
                "ports": [{"port": 8080, "protocol": "TCP"}]
            }])
        );
    }

    #[test]
    fn endpoint_slices_keep_false_conditions_and_optional_ports() {
        let slice = discovery::EndpointSlice {
            metadata: Some(meta::ObjectMeta {
                generate_name: Some("web-".into()),
                namespace: Some("default".into()),
                labels: [("kubernetes.io/service-name".to_string(), "web".to_string())].into(),
                ..go_meta("", &[])
            }),
            address_type: Some("IPv4".into()),
            endpoints: vec![discovery::Endpoint {
                addresses: vec!["10.244.1.5".into()],
                conditions: Some(discovery::EndpointConditions {
                    ready: Some(false),
                    serving: Some(true),
                    terminating: Some(true),
                }),
                hostname: None,
                target_ref: None,
                deprecated_topology: BTreeMap::new(),
                node_name: Some("node-a".into()),
                zone: Some("zone-1".into()),
                hints: Some(discovery::EndpointHints {
                    for_zones: vec![discovery::ForZone {
                        name: Some("zone-1".into()),
                    }],
                    for_nodes: vec![],
                }),
            }],
            ports: vec![discovery::EndpointPort {
                name: empty(),
                protocol: Some("TCP".into()),
                port: Some(8080),
                app_protocol: None,
            }],
        };
        let body = decode_object(
            &wire("discovery.k8s.io/v1", "EndpointSlice", &slice),
            Kind::EndpointSlice,
        )
        .unwrap();
        assert_eq!(
            body,
            json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "generateName": "web-",
                    "namespace": "default",
                    "labels": {"kubernetes.io/service-name": "web"}
                },
                "addressType": "IPv4",
                "endpoints": [{
                    "addresses": ["10.244.1.5"],
                    "conditions": {"ready": false, "serving": true, "terminating": true},
                    "nodeName": "node-a",
                    "zone": "zone-1",
                    "hints": {"forZones": [{"name": "zone-1"}]}
                }],
                "ports": [{"name": "", "protocol": "TCP", "port": 8080}]
            })
        );
    }

    #[test]
    fn delete_options_keep_preconditions_and_dry_run() {
        let options = meta::DeleteOptions {
            grace_period_seconds: Some(0),
            preconditions: Some(meta::Preconditions {
                uid: Some("u-1".into()),
                resource_version: None,
            }),
            orphan_dependents: None,
            propagation_policy: Some("Background".into()),
            dry_run: vec!["All".into()],
            ignore_store_read_error_with_cluster_breaking_potential: None,
        };
        let body = decode_delete_options(&wire("v1", "DeleteOptions", &options)).unwrap();
        assert_eq!(
            body,
            json!({
                "gracePeriodSeconds": 0,
                "preconditions": {"uid": "u-1"},
                "propagationPolicy": "Background",
                "dryRun": ["All"]
            })
        );
        let service = kubectl_service("x", "ClusterIP", 0);
        let err = decode_delete_options(&wire("v1", "Service", &service)).unwrap_err();
        assert!(err.is_unsupported(), "{err}");
    }

    #[test]
    fn an_envelope_without_a_type_is_read_as_the_kind_the_url_names() {
        let namespace = core::Namespace {
            metadata: Some(go_meta("untyped", &[])),
            ..Default::default()
        };
        let body = decode_object(&wire("", "", &namespace), Kind::Namespace).unwrap();
        assert_eq!(
            body,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "untyped"}})
        );
    }

    #[test]
    fn a_body_without_the_k8s_prefix_is_not_protobuf() {
        let json = br#"{"apiVersion":"v1","kind":"Namespace"}"#;
        let err = decode_object(json, Kind::Namespace).unwrap_err();
        assert!(matches!(err, Error::NotProtobuf), "{err}");
        assert!(!err.is_unsupported());
        assert_eq!(
            err.to_string(),
            "provided data does not appear to be a protobuf message, expected prefix [107 56 115 0]"
        );
    }

    #[test]
    fn a_truncated_envelope_or_object_is_a_decode_error() {
        let body = wire("v1", "Service", &kubectl_service("t", "NodePort", 0));
        let err = decode_object(&body[..body.len() - 3], Kind::Service).unwrap_err();
        assert!(matches!(err, Error::Envelope(_)), "{err}");

        // A well-formed envelope whose `raw` is not a Service: field 1 (metadata) claims 100
        // bytes and holds 2.
        let unknown = Unknown {
            type_meta: Some(TypeMeta {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
            }),
            raw: Some(vec![0x0a, 100, 1, 2]),
            ..Default::default()
        };
        let body = [MAGIC.as_slice(), &unknown.encode_to_vec()].concat();
        let err = decode_object(&body, Kind::Service).unwrap_err();
        assert!(matches!(err, Error::Object { .. }), "{err}");
        assert!(!err.is_unsupported());
        assert!(
            crate::report(&err).starts_with("failed to decode the protobuf body as v1 Service: "),
            "{}",
            crate::report(&err)
        );
    }

    #[test]
    fn a_kind_not_decoded_from_protobuf_is_unsupported_and_names_the_accepted_kinds() {
        let pod = core::Pod {
            metadata: Some(go_meta("p", &[])),
            ..Default::default()
        };
        let err = decode_object(&wire("v1", "Pod", &pod), Kind::Service).unwrap_err();
        assert!(err.is_unsupported());
        let message = err.to_string();
        for accepted in [
            "v1 Service",
            "v1 Namespace",
            "v1 Node",
            "v1 Endpoints",
            "discovery.k8s.io/v1 EndpointSlice",
        ] {
            assert!(message.contains(accepted), "{message}");
        }
        assert!(message.contains("\"Pod\""), "{message}");
    }

    #[test]
    fn a_time_beyond_year_9999_is_refused_as_go_refuses_it() {
        let mut service = kubectl_service("late", "ClusterIP", 0);
        service.metadata.as_mut().unwrap().creation_timestamp = Some(meta::Time {
            seconds: Some(END_OF_YEAR_9999 + 1),
            nanos: None,
        });
        let err = decode_object(&wire("v1", "Service", &service), Kind::Service).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Time {
                    field: "creationTimestamp",
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[cfg(test)]
mod event_tests {
    use super::*;

    fn wire(api_version: &str, kind: &str, object: &impl Message) -> Vec<u8> {
        let unknown = Unknown {
            type_meta: Some(k8s_pb::apimachinery::pkg::runtime::TypeMeta {
                api_version: Some(api_version.to_owned()),
                kind: Some(kind.to_owned()),
            }),
            raw: Some(object.encode_to_vec()),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        let mut body = MAGIC.to_vec();
        body.extend(unknown.encode_to_vec());
        body
    }

    fn reference() -> core::ObjectReference {
        core::ObjectReference {
            kind: Some("Service".into()),
            namespace: Some("default".into()),
            name: Some("web".into()),
            uid: Some("u-1".into()),
            api_version: Some("v1".into()),
            resource_version: Some(String::new()),
            field_path: Some(String::new()),
        }
    }

    #[test]
    fn a_legacy_recorders_core_event_decodes_to_its_json() {
        let event = core::Event {
            metadata: Some(meta::ObjectMeta {
                name: Some("web.1".into()),
                namespace: Some("default".into()),
                ..Default::default()
            }),
            involved_object: Some(reference()),
            reason: Some("Synced".into()),
            message: Some("synced".into()),
            source: Some(core::EventSource {
                component: Some("ctl".into()),
                host: Some(String::new()),
            }),
            first_timestamp: Some(meta::Time {
                seconds: Some(1_767_225_600),
                nanos: Some(0),
            }),
            last_timestamp: Some(meta::Time {
                seconds: Some(1_767_225_600),
                nanos: Some(0),
            }),
            count: Some(1),
            r#type: Some("Normal".into()),
            event_time: Some(meta::MicroTime::default()),
            series: None,
            action: Some(String::new()),
            related: None,
            reporting_component: Some(String::new()),
            reporting_instance: Some(String::new()),
        };
        let body = decode_object(&wire("v1", "Event", &event), Kind::Event).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": "web.1", "namespace": "default"},
                "involvedObject": {"kind": "Service", "namespace": "default", "name": "web", "uid": "u-1", "apiVersion": "v1"},
                "reason": "Synced", "message": "synced", "source": {"component": "ctl"},
                "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
                "count": 1, "type": "Normal", "reportingComponent": "", "reportingInstance": ""})
        );
    }

    #[test]
    fn a_new_recorders_events_k8s_io_event_keeps_its_microsecond_times() {
        let event = events::Event {
            metadata: Some(meta::ObjectMeta {
                name: Some("web.2".into()),
                namespace: Some("default".into()),
                ..Default::default()
            }),
            event_time: Some(meta::MicroTime {
                seconds: Some(1_767_225_600),
                nanos: Some(123_456_789),
            }),
            series: Some(events::EventSeries {
                count: Some(2),
                last_observed_time: Some(meta::MicroTime {
                    seconds: Some(1_767_225_601),
                    nanos: Some(0),
                }),
            }),
            reporting_controller: Some("ctl".into()),
            reporting_instance: Some("ctl-1".into()),
            action: Some("Sync".into()),
            reason: Some("Synced".into()),
            regarding: Some(reference()),
            note: Some("synced".into()),
            r#type: Some("Normal".into()),
            deprecated_source: Some(core::EventSource::default()),
            deprecated_count: Some(0),
            ..Default::default()
        };
        let body =
            decode_object(&wire("events.k8s.io/v1", "Event", &event), Kind::EventsV1).unwrap();
        assert_eq!(body["eventTime"], "2026-01-01T00:00:00.123456Z");
        assert_eq!(
            body["series"],
            serde_json::json!({"count": 2, "lastObservedTime": "2026-01-01T00:00:01.000000Z"})
        );
        assert_eq!(body["regarding"]["name"], "web");
        assert_eq!(body["deprecatedSource"], serde_json::json!({}));
        assert!(body.get("deprecatedCount").is_none());
        assert_eq!(body["reportingController"], "ctl");
    }
}
