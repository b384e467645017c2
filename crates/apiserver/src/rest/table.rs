//! `meta.k8s.io/v1 Table` output with kubectl's columns (`pkg/printers/internalversion/printers.go`).

use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use crate::resource::Kind;

/// Whether the `Accept` header asks for a Table.
pub fn wants_table(accept: &str) -> bool {
    accept.contains("as=Table")
}

fn columns(kind: Kind) -> Vec<(&'static str, &'static str, i32)> {
    let name = ("Name", "Name must be unique within a namespace.", 0);
    let age = (
        "Age",
        "CreationTimestamp is a timestamp representing the server time when this object was created.",
        0,
    );
    match kind {
        Kind::Service => vec![
            name,
            ("Type", "type determines how the Service is exposed.", 0),
            (
                "Cluster-IP",
                "clusterIP is the IP address of the service.",
                0,
            ),
            (
                "External-IP",
                "externalIPs is a list of IP addresses for which nodes in the cluster will also accept traffic for this service.",
                0,
            ),
            (
                "Port(s)",
                "The list of ports that are exposed by this service.",
                0,
            ),
            age,
            (
                "Selector",
                "Route service traffic to pods with label keys and values matching this selector.",
                1,
            ),
        ],
        Kind::Endpoints => vec![name, ("Endpoints", "Endpoints of the service", 0), age],
        Kind::EndpointSlice => vec![
            name,
            ("AddressType", "The IP protocol for this slice", 0),
            ("Ports", "The ports for this slice", 0),
            ("Endpoints", "Endpoints of the slice", 0),
            age,
        ],
        Kind::Node => vec![
            name,
            ("Status", "The status of the node", 0),
            ("Roles", "The roles of the node", 0),
            age,
            ("Version", "Kubelet Version reported by the node.", 0),
            ("Internal-IP", "The node's first internal IP.", 1),
            ("External-IP", "The node's first external IP.", 1),
            ("OS-Image", "OS image reported by the node.", 1),
            ("Kernel-Version", "Kernel version reported by the node.", 1),
            (
                "Container-Runtime",
                "Container runtime version reported by the node.",
                1,
            ),
        ],
        Kind::Namespace => vec![name, ("Status", "The status of the namespace", 0), age],
        Kind::ServiceCidr => vec![
            name,
            (
                "CIDRs",
                "CIDRs defines the IP blocks in CIDR notation (e.g. \"192.168.0.0/24\" or \"2001:db8::/64\") from which to assign service cluster IPs.",
                0,
            ),
            age,
        ],
        Kind::Event | Kind::EventsV1 => vec![
            (
                "Last Seen",
                "The time at which the most recent occurrence of this event was recorded.",
                0,
            ),
            (
                "Type",
                "Type of this event (Normal, Warning), new types could be added in the future",
                0,
            ),
            (
                "Reason",
                "This should be a short, machine understandable string that gives the reason for the transition into the object's current status.",
                0,
            ),
            ("Object", "The object that this event is about.", 0),
            (
                "Subobject",
                "If referring to a piece of an object instead of an entire object, this string should contain a valid JSON/Go field access statement, such as desiredState.manifest.containers[2].",
                1,
            ),
            (
                "Source",
                "The component reporting this event. Should be a short machine understandable string.",
                1,
            ),
            (
                "Message",
                "A human-readable description of the status of this operation.",
                0,
            ),
            (
                "First Seen",
                "The time at which the event was first recorded. (Time of server receipt is in TypeMeta.)",
                1,
            ),
            ("Count", "The number of times this event has occurred.", 1),
            ("Name", "Name must be unique within a namespace.", 1),
        ],
        Kind::IpAddress => vec![
            name,
            (
                "ParentRef",
                "ParentRef references the resource that an IPAddress is attached to.",
                0,
            ),
        ],
        Kind::Role | Kind::ClusterRole => vec![
            name,
            (
                "Created At",
                "CreationTimestamp is a timestamp representing the server time when this object was created.",
                0,
            ),
        ],
        Kind::RoleBinding | Kind::ClusterRoleBinding => vec![
            name,
            ("Role", "Role of the binding", 0),
            age,
            ("Users", "Users in the binding", 1),
            ("Groups", "Groups in the binding", 1),
            ("ServiceAccounts", "ServiceAccounts in the binding", 1),
        ],
    }
}

/// kube's `duration.HumanDuration`.
pub fn human_duration(secs: i64) -> String {
    let s = secs.max(0);
    if s < 60 * 2 {
        return format!("{s}s");
    }
    let minutes = s / 60;
    if minutes < 10 {
        let rem = s % 60;
        return if rem == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{rem}s")
        };
    }
    if minutes < 60 * 3 {
        return format!("{minutes}m");
    }
    let hours = s / 3600;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{}d", hours / 24)
        } else {
            format!("{}d{h}h", hours / 24)
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{}d", hours / 24);
    }
    if hours < 24 * 365 * 8 {
        let d = (hours / 24) % 365;
        return if d == 0 {
            format!("{}y", hours / 24 / 365)
        } else {
            format!("{}y{d}d", hours / 24 / 365)
        };
    }
    format!("{}y", hours / 24 / 365)
}

fn age(object: &Value) -> String {
    let Some(ts) = object
        .pointer("/metadata/creationTimestamp")
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<Timestamp>().ok())
    else {
        return "<unknown>".into();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    human_duration(now - ts.as_second())
}

fn s<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn arr<'a>(v: &'a Value, pointer: &str) -> &'a [Value] {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn or_none(s: String) -> String {
    if s.is_empty() { "<none>".into() } else { s }
}

fn join_first_three(items: Vec<String>) -> String {
    if items.is_empty() {
        return "<none>".into();
    }
    let extra = items.len().saturating_sub(3);
    let mut out = items.into_iter().take(3).collect::<Vec<_>>().join(",");
    if extra > 0 {
        out.push_str(&format!(" + {extra} more..."));
    }
    out
}

fn service_cells(svc: &Value) -> Vec<Value> {
    let svc_type = s(svc, "/spec/type");
    let svc_type = if svc_type.is_empty() {
        "ClusterIP"
    } else {
        svc_type
    };
    let cluster_ip = match svc_type {
        "ExternalName" => "<none>".to_owned(),
        _ => or_none(s(svc, "/spec/clusterIP").to_owned()),
    };
    let external_ips: Vec<String> = arr(svc, "/spec/externalIPs")
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect();
    let external = match svc_type {
        "ExternalName" => s(svc, "/spec/externalName").to_owned(),
        "LoadBalancer" => {
            let mut ips: Vec<String> = arr(svc, "/status/loadBalancer/ingress")
                .iter()
                .filter_map(|i| {
                    i.get("ip")
                        .or_else(|| i.get("hostname"))
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                })
                .collect();
            ips.extend(external_ips.iter().cloned());
            if ips.is_empty() {
                "<pending>".into()
            } else {
                ips.join(",")
            }
        }
        _ => or_none(external_ips.join(",")),
    };
    let ports: Vec<String> = arr(svc, "/spec/ports")
        .iter()
        .map(|p| {
            let port = p.get("port").and_then(Value::as_i64).unwrap_or(0);
            let proto = p.get("protocol").and_then(Value::as_str).unwrap_or("TCP");
            match p
                .get("nodePort")
                .and_then(Value::as_i64)
                .filter(|n| *n != 0)
            {
                Some(np) => format!("{port}:{np}/{proto}"),
                None => format!("{port}/{proto}"),
            }
        })
        .collect();
    let selector: Vec<String> = svc
        .pointer("/spec/selector")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    vec![
        json!(s(svc, "/metadata/name")),
        json!(svc_type),
        json!(cluster_ip),
        json!(external),
        json!(or_none(ports.join(","))),
        json!(age(svc)),
        json!(or_none(selector.join(","))),
    ]
}

fn endpoints_cells(ep: &Value) -> Vec<Value> {
    let mut items = Vec::new();
    for subset in arr(ep, "/subsets") {
        let ports = arr(subset, "/ports");
        for addr in arr(subset, "/addresses") {
            let ip = s(addr, "/ip");
            if ports.is_empty() {
                items.push(ip.to_owned());
            }
            for port in ports {
                items.push(format!(
                    "{ip}:{}",
                    port.get("port").and_then(Value::as_i64).unwrap_or(0)
                ));
            }
        }
    }
    vec![
        json!(s(ep, "/metadata/name")),
        json!(join_first_three(items)),
        json!(age(ep)),
    ]
}

fn endpointslice_cells(slice: &Value) -> Vec<Value> {
    let ports: Vec<String> = arr(slice, "/ports")
        .iter()
        .map(|p| match p.get("port").and_then(Value::as_i64) {
            Some(port) => port.to_string(),
            None => "<unset>".into(),
        })
        .collect();
    let ports = if ports.is_empty() {
        "<unset>".to_owned()
    } else {
        ports.join(",")
    };
    let addrs: Vec<String> = arr(slice, "/endpoints")
        .iter()
        .flat_map(|e| {
            arr(e, "/addresses")
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
        })
        .collect();
    let endpoints = if addrs.is_empty() {
        "<unset>".to_owned()
    } else {
        join_first_three(addrs)
    };
    vec![
        json!(s(slice, "/metadata/name")),
        json!(s(slice, "/addressType")),
        json!(ports),
        json!(endpoints),
        json!(age(slice)),
    ]
}

fn node_cells(node: &Value) -> Vec<Value> {
    let ready = arr(node, "/status/conditions")
        .iter()
        .find(|c| s(c, "/type") == "Ready")
        .map(|c| match s(c, "/status") {
            "True" => "Ready",
            "False" => "NotReady",
            _ => "Unknown",
        })
        .unwrap_or("Unknown");
    let mut status = ready.to_owned();
    if node.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true) {
        status.push_str(",SchedulingDisabled");
    }
    let mut roles: Vec<String> = node
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.keys()
                .filter_map(|k| k.strip_prefix("node-role.kubernetes.io/"))
                .filter(|r| !r.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    roles.sort();
    // kube's printNode: the first address of each type, `<unknown>` for unreported versions.
    let first_address = |kind: &str| {
        arr(node, "/status/addresses")
            .iter()
            .find(|a| s(a, "/type") == kind)
            .map_or_else(|| "<none>".to_owned(), |a| s(a, "/address").to_owned())
    };
    let info = |field: &str| {
        let value = s(node, &format!("/status/nodeInfo/{field}"));
        if value.is_empty() { "<unknown>" } else { value }.to_owned()
    };
    vec![
        json!(s(node, "/metadata/name")),
        json!(status),
        json!(or_none(roles.join(","))),
        json!(age(node)),
        json!(s(node, "/status/nodeInfo/kubeletVersion")),
        json!(first_address("InternalIP")),
        json!(first_address("ExternalIP")),
        json!(info("osImage")),
        json!(info("kernelVersion")),
        json!(info("containerRuntimeVersion")),
    ]
}

/// kube's `printServiceCIDR`: the CIDRs joined with commas.
fn service_cidr_cells(cidr: &Value) -> Vec<Value> {
    let cidrs: Vec<&str> = cidr
        .pointer("/spec/cidrs")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    vec![
        json!(s(cidr, "/metadata/name")),
        json!(cidrs.join(",")),
        json!(age(cidr)),
    ]
}

/// kubectl's `NAME PARENTREF`: the parent as `<resource>[.<group>]/<namespace>/<name>`.
fn ip_address_cells(ip: &Value) -> Vec<Value> {
    let parent = ip.pointer("/spec/parentRef");
    let part = |field: &str| {
        parent
            .and_then(|p| p.get(field))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let mut resource = part("resource");
    if !part("group").is_empty() {
        resource = format!("{resource}.{}", part("group"));
    }
    let namespace = part("namespace");
    let reference = if namespace.is_empty() {
        format!("{resource}/{}", part("name"))
    } else {
        format!("{resource}/{namespace}/{}", part("name"))
    };
    vec![json!(s(ip, "/metadata/name")), json!(reference)]
}

/// kubectl's role row: the name and the creation time in RFC 3339.
fn role_cells(role: &Value) -> Vec<Value> {
    vec![
        json!(s(role, "/metadata/name")),
        json!(s(role, "/metadata/creationTimestamp")),
    ]
}

/// kubectl's binding row: `Kind/name` of the role, then (wide) the users, groups and
/// `namespace/name` of the service accounts, each joined with `", "`.
fn binding_cells(binding: &Value) -> Vec<Value> {
    let subjects = arr(binding, "/subjects");
    let of_kind = |kind: &str| -> String {
        subjects
            .iter()
            .filter(|sub| s(sub, "/kind") == kind)
            .map(|sub| match kind {
                "ServiceAccount" => format!("{}/{}", s(sub, "/namespace"), s(sub, "/name")),
                _ => s(sub, "/name").to_owned(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    vec![
        json!(s(binding, "/metadata/name")),
        json!(format!(
            "{}/{}",
            s(binding, "/roleRef/kind"),
            s(binding, "/roleRef/name")
        )),
        json!(age(binding)),
        json!(of_kind("User")),
        json!(of_kind("Group")),
        json!(of_kind("ServiceAccount")),
    ]
}

fn namespace_cells(ns: &Value) -> Vec<Value> {
    vec![
        json!(s(ns, "/metadata/name")),
        json!(s(ns, "/status/phase")),
        json!(age(ns)),
    ]
}

/// kube's `translateTimestampSince` (and its MicroTime twin): the age of a time, `<unknown>`
/// when unset.
fn since(object: &Value, pointer: &str) -> Option<String> {
    let ts = object
        .pointer(pointer)
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<Timestamp>().ok())?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    Some(human_duration(now - ts.as_second()))
}

/// kube's `printEvent` (server-side, wide), over the stored core/v1 form.
fn event_cells(event: &Value) -> Vec<Value> {
    let first = since(event, "/firstTimestamp")
        .or_else(|| since(event, "/eventTime"))
        .unwrap_or_else(|| "<unknown>".into());
    let mut last = since(event, "/lastTimestamp").unwrap_or_else(|| first.clone());
    let mut count = event.get("count").and_then(Value::as_i64).unwrap_or(0);
    if event.get("series").is_some_and(|s| !s.is_null()) {
        last = since(event, "/series/lastObservedTime").unwrap_or_else(|| "<unknown>".into());
        count = event
            .pointer("/series/count")
            .and_then(Value::as_i64)
            .unwrap_or(0);
    } else if count == 0 {
        // Singleton events have no count in the new API.
        count = 1;
    }
    let kind = s(event, "/involvedObject/kind").to_lowercase();
    let name = s(event, "/involvedObject/name");
    let target = if name.is_empty() {
        kind
    } else {
        format!("{kind}/{name}")
    };
    let first_non_empty = |a: &str, b: &str| {
        if a.is_empty() {
            b.to_owned()
        } else {
            a.to_owned()
        }
    };
    let component = first_non_empty(
        s(event, "/source/component"),
        s(event, "/reportingComponent"),
    );
    let instance = first_non_empty(s(event, "/source/host"), s(event, "/reportingInstance"));
    let source = if instance.is_empty() {
        component
    } else {
        format!("{component}, {instance}")
    };
    vec![
        json!(last),
        json!(s(event, "/type")),
        json!(s(event, "/reason")),
        json!(target),
        json!(s(event, "/involvedObject/fieldPath")),
        json!(source),
        json!(s(event, "/message").trim()),
        json!(first),
        json!(count),
        json!(s(event, "/metadata/name")),
    ]
}

/// One row for `object`. `include_object` is `None`, `Metadata` (default) or `Object`.
pub fn row(kind: Kind, object: &Value, include_object: &str) -> Value {
    let cells = match kind {
        Kind::Service => service_cells(object),
        Kind::Endpoints => endpoints_cells(object),
        Kind::EndpointSlice => endpointslice_cells(object),
        Kind::Node => node_cells(object),
        Kind::Namespace => namespace_cells(object),
        Kind::ServiceCidr => service_cidr_cells(object),
        Kind::Event | Kind::EventsV1 => event_cells(object),
        Kind::IpAddress => ip_address_cells(object),
        Kind::Role | Kind::ClusterRole => role_cells(object),
        Kind::RoleBinding | Kind::ClusterRoleBinding => binding_cells(object),
    };
    let embedded = match include_object {
        "None" => Value::Null,
        "Object" => {
            let mut o = crate::registry::event::present(kind, object.clone());
            o["kind"] = json!(kind.kind());
            o["apiVersion"] = json!(kind.api_version());
            o
        }
        _ => json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": object.get("metadata").cloned().unwrap_or(Value::Null),
        }),
    };
    let mut row = json!({ "cells": cells });
    if !embedded.is_null() {
        row["object"] = embedded;
    }
    row
}

/// A Table of `objects`.
pub fn table(
    kind: Kind,
    objects: &[Value],
    resource_version: &str,
    continue_token: Option<&str>,
    include_object: &str,
) -> Value {
    let column_definitions: Vec<Value> = columns(kind)
        .into_iter()
        .map(|(name, description, priority)| {
            json!({
                "name": name,
                "type": "string",
                "format": if name == "Name" { "name" } else { "" },
                "description": description,
                "priority": priority,
            })
        })
        .collect();
    let mut metadata = json!({ "resourceVersion": resource_version });
    if let Some(token) = continue_token {
        metadata["continue"] = json!(token);
    }
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": column_definitions,
        "rows": objects.iter().map(|o| row(kind, o, include_object)).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_row_shows_node_ports_as_kubectl_does() {
        let svc = json!({"metadata":{"name":"web"},"spec":{"type":"NodePort","clusterIP":"10.96.132.141",
            "ports":[{"port":80,"protocol":"TCP","nodePort":30510}]}});
        let cells = service_cells(&svc);
        assert_eq!(cells[1], "NodePort");
        assert_eq!(cells[2], "10.96.132.141");
        assert_eq!(cells[3], "<none>");
        assert_eq!(cells[4], "80:30510/TCP");
    }

    #[test]
    fn endpoints_row_lists_address_port_pairs() {
        let ep = json!({"metadata":{"name":"web"},"subsets":[{"addresses":[{"ip":"10.244.1.6"},{"ip":"10.244.2.7"}],"ports":[{"port":80}]}]});
        assert_eq!(endpoints_cells(&ep)[1], "10.244.1.6:80,10.244.2.7:80");
    }

    #[test]
    fn node_row_has_kubectls_wide_columns() {
        let node = json!({"metadata":{"name":"worker","labels":{"node-role.kubernetes.io/worker":""}},
            "status":{"conditions":[{"type":"Ready","status":"True"}],
            "addresses":[{"type":"Hostname","address":"worker"},{"type":"InternalIP","address":"192.0.2.11"},
                         {"type":"InternalIP","address":"fd00::11"}],
            "nodeInfo":{"kubeletVersion":"v1.33.0","kernelVersion":"6.18.0"}}});
        let cells = node_cells(&node);
        assert_eq!(cells.len(), columns(Kind::Node).len());
        assert_eq!(
            cells[4..],
            [
                json!("v1.33.0"),
                json!("192.0.2.11"),
                json!("<none>"),
                json!("<unknown>"),
                json!("6.18.0"),
                json!("<unknown>")
            ]
        );
    }

    #[test]
    fn human_durations_match_kubectl() {
        assert_eq!(human_duration(43), "43s");
        assert_eq!(human_duration(150), "2m30s");
        assert_eq!(human_duration(3 * 3600 + 600), "3h10m");
        assert_eq!(human_duration(3 * 86400), "3d");
    }
}
