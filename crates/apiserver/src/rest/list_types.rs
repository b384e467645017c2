//! The merge markers of Kubernetes' OpenAPI (`x-kubernetes-list-type`,
//! `x-kubernetes-list-map-keys`, `x-kubernetes-map-type`, and the strategic-merge
//! `x-kubernetes-patch-merge-key` / `x-kubernetes-patch-strategy`) for every schema reachable
//! from the served kinds, served in `/openapi/v3` as kube-apiserver serves them.
//!
//! The schemas themselves come from k8s-openapi (schemars), which drops these markers; they are
//! checked in here, copied from kube-apiserver's published documents
//! (`kubernetes/kubernetes: api/openapi-spec/v3/api__v1_openapi.json` and
//! `apis__discovery.k8s.io__v1_openapi.json`, generated from the `+listType`, `+listMapKey`,
//! `+mapType`, `+patchMergeKey` and `+patchStrategy` markers of `k8s.io/api`), and for
//! `networking.k8s.io/v1` ServiceCIDR from its `types.go` markers. Lists of the served kinds
//! not named here carry no marker in kube's documents either (kube's Event has no list).

use serde_json::{Value, json};

/// `(schema, property, markers)`: the markers of one property.
type PropertyMarkers = (&'static str, &'static str, fn() -> Value);

fn atomic_list() -> Value {
    json!({"x-kubernetes-list-type": "atomic"})
}

fn atomic_map() -> Value {
    json!({"x-kubernetes-map-type": "atomic"})
}

fn conditions_by_type() -> Value {
    json!({
        "x-kubernetes-list-map-keys": ["type"],
        "x-kubernetes-list-type": "map",
        "x-kubernetes-patch-merge-key": "type",
        "x-kubernetes-patch-strategy": "merge",
    })
}

fn merged_set() -> Value {
    json!({"x-kubernetes-list-type": "set", "x-kubernetes-patch-strategy": "merge"})
}

fn set() -> Value {
    json!({"x-kubernetes-list-type": "set"})
}

fn service_ports() -> Value {
    json!({
        "x-kubernetes-list-map-keys": ["port", "protocol"],
        "x-kubernetes-list-type": "map",
        "x-kubernetes-patch-merge-key": "port",
        "x-kubernetes-patch-strategy": "merge",
    })
}

fn default_tcp() -> Value {
    json!({"default": "TCP"})
}

fn owner_references() -> Value {
    json!({
        "x-kubernetes-list-map-keys": ["uid"],
        "x-kubernetes-list-type": "map",
        "x-kubernetes-patch-merge-key": "uid",
        "x-kubernetes-patch-strategy": "merge",
    })
}

/// Markers on properties, as kube's documents carry them.
const PROPERTIES: &[PropertyMarkers] = &[
    ("io.k8s.api.core.v1.ServiceSpec", "clusterIPs", atomic_list),
    ("io.k8s.api.core.v1.ServiceSpec", "externalIPs", atomic_list),
    ("io.k8s.api.core.v1.ServiceSpec", "ipFamilies", atomic_list),
    (
        "io.k8s.api.core.v1.ServiceSpec",
        "loadBalancerSourceRanges",
        atomic_list,
    ),
    ("io.k8s.api.core.v1.ServiceSpec", "ports", service_ports),
    // Not a merge marker: the `+default="TCP"` of `ServicePort.protocol`, which kube's document
    // carries and server-side apply reads for a port's key when `protocol` is left out.
    ("io.k8s.api.core.v1.ServicePort", "protocol", default_tcp),
    ("io.k8s.api.core.v1.ServiceSpec", "selector", atomic_map),
    (
        "io.k8s.api.core.v1.ServiceStatus",
        "conditions",
        conditions_by_type,
    ),
    (
        "io.k8s.api.core.v1.LoadBalancerStatus",
        "ingress",
        atomic_list,
    ),
    (
        "io.k8s.api.core.v1.LoadBalancerIngress",
        "ports",
        atomic_list,
    ),
    ("io.k8s.api.core.v1.Endpoints", "subsets", atomic_list),
    (
        "io.k8s.api.core.v1.EndpointSubset",
        "addresses",
        atomic_list,
    ),
    (
        "io.k8s.api.core.v1.EndpointSubset",
        "notReadyAddresses",
        atomic_list,
    ),
    ("io.k8s.api.core.v1.EndpointSubset", "ports", atomic_list),
    (
        "io.k8s.api.core.v1.NamespaceSpec",
        "finalizers",
        atomic_list,
    ),
    (
        "io.k8s.api.core.v1.NamespaceStatus",
        "conditions",
        conditions_by_type,
    ),
    ("io.k8s.api.core.v1.NodeSpec", "podCIDRs", merged_set),
    ("io.k8s.api.core.v1.NodeSpec", "taints", atomic_list),
    (
        "io.k8s.api.core.v1.NodeStatus",
        "addresses",
        conditions_by_type,
    ),
    (
        "io.k8s.api.core.v1.NodeStatus",
        "conditions",
        conditions_by_type,
    ),
    ("io.k8s.api.core.v1.NodeStatus", "images", atomic_list),
    (
        "io.k8s.api.core.v1.NodeStatus",
        "volumesAttached",
        atomic_list,
    ),
    ("io.k8s.api.core.v1.NodeStatus", "volumesInUse", atomic_list),
    ("io.k8s.api.core.v1.ContainerImage", "names", atomic_list),
    (
        "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
        "finalizers",
        merged_set,
    ),
    (
        "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
        "managedFields",
        atomic_list,
    ),
    (
        "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
        "ownerReferences",
        owner_references,
    ),
    (
        "io.k8s.api.discovery.v1.EndpointSlice",
        "endpoints",
        atomic_list,
    ),
    (
        "io.k8s.api.discovery.v1.EndpointSlice",
        "ports",
        atomic_list,
    ),
    ("io.k8s.api.discovery.v1.Endpoint", "addresses", set),
    (
        "io.k8s.api.discovery.v1.EndpointHints",
        "forNodes",
        atomic_list,
    ),
    (
        "io.k8s.api.discovery.v1.EndpointHints",
        "forZones",
        atomic_list,
    ),
    (
        "io.k8s.api.networking.v1.ServiceCIDRSpec",
        "cidrs",
        atomic_list,
    ),
    (
        "io.k8s.api.networking.v1.ServiceCIDRStatus",
        "conditions",
        conditions_by_type,
    ),
];

/// Schemas that are atomic as a whole (`x-kubernetes-map-type: atomic` on the type).
const ATOMIC_SCHEMAS: &[&str] = &[
    "io.k8s.api.core.v1.ObjectReference",
    "io.k8s.api.core.v1.EndpointAddress",
    "io.k8s.api.core.v1.EndpointPort",
    "io.k8s.apimachinery.pkg.apis.meta.v1.OwnerReference",
    "io.k8s.api.discovery.v1.EndpointPort",
];

/// Adds kube's merge markers to the schemas of one `/openapi/v3` document.
pub fn annotate(schemas: &mut serde_json::Map<String, Value>) {
    for (schema, property, markers) in PROPERTIES {
        let Some(Value::Object(target)) = schemas
            .get_mut(*schema)
            .and_then(|s| s.get_mut("properties"))
            .and_then(|p| p.get_mut(*property))
        else {
            continue;
        };
        if let Value::Object(markers) = markers() {
            target.extend(markers);
        }
    }
    for schema in ATOMIC_SCHEMAS {
        if let Some(Value::Object(target)) = schemas.get_mut(*schema) {
            target.extend(atomic_map().as_object().cloned().unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_marked_property_and_schema_exists_in_the_served_schemas() {
        // A marker whose schema or property is misspelt would silently mark nothing.
        let mut all = serde_json::Map::new();
        for group in ["", "discovery.k8s.io", "networking.k8s.io", "events.k8s.io"] {
            all.extend(super::super::discovery::schemas_for_test(group));
        }
        for (schema, property, _) in PROPERTIES {
            assert!(
                all.get(*schema)
                    .and_then(|s| s.get("properties"))
                    .and_then(|p| p.get(*property))
                    .is_some(),
                "{schema}.{property} is not a served property"
            );
        }
        for schema in ATOMIC_SCHEMAS {
            assert!(all.contains_key(*schema), "{schema} is not a served schema");
        }
    }
}
