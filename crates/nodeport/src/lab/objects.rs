//! The Kubernetes objects the lab writes through the API, built from the [`Plan`]: what the
//! kubelets, `kubectl expose` and the endpoint controllers of a real cluster would write.
//!
//! The lab has no kubelet, no Deployment controller and no endpoint controllers: it plays
//! their part and writes exactly the objects they would, so that the API server and the
//! proxies see what they see in a real cluster. Pure functions, so the objects are tested
//! here without a server.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EndpointAddress, EndpointPort, EndpointSubset, Endpoints, Node as NodeObject, NodeAddress,
    NodeCondition, NodeSpec, NodeStatus, NodeSystemInfo, ObjectReference, Service, ServicePort,
    ServiceSpec, Taint,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointPort as SlicePort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::plan::{APP, Plan, Role, WEB_PORT};

/// The namespace everything lives in, as in the reference.
pub const NAMESPACE: &str = "default";
/// The label that ties an EndpointSlice to its Service (`discovery.k8s.io/v1`).
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label the endpointslice controller puts on the slices it manages.
const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
const MANAGED_BY: &str = "endpointslice-controller.k8s.io";
/// The control plane's role label and taint key (kubeadm's).
const CONTROL_PLANE_KEY: &str = "node-role.kubernetes.io/control-plane";

fn labels(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, String>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    )
}

/// The Node objects the kubelets would register: labels, pod network, the control plane's
/// taint, `InternalIP`/`Hostname` addresses and a `Ready` condition (the lab's "kubelet" is
/// the namespace being up).
pub fn nodes(plan: &Plan) -> Vec<NodeObject> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    plan.nodes
        .iter()
        .map(|node| {
            let mut node_labels = vec![
                ("kubernetes.io/arch", arch),
                ("kubernetes.io/hostname", node.name.as_str()),
                ("kubernetes.io/os", "linux"),
            ];
            let mut taints = None;
            if node.role == Role::ControlPlane {
                node_labels.push((CONTROL_PLANE_KEY, ""));
                taints = Some(vec![Taint {
                    key: CONTROL_PLANE_KEY.to_owned(),
                    effect: "NoSchedule".to_owned(),
                    ..Default::default()
                }]);
            }
            NodeObject {
                metadata: ObjectMeta {
                    name: Some(node.name.clone()),
                    labels: labels(&node_labels),
                    ..Default::default()
                },
                spec: Some(NodeSpec {
                    pod_cidr: Some(node.pod_cidr.to_string()),
                    pod_cidrs: Some(vec![node.pod_cidr.to_string()]),
                    taints,
                    ..Default::default()
                }),
                status: Some(NodeStatus {
                    addresses: Some(vec![
                        NodeAddress {
                            type_: "InternalIP".to_owned(),
                            address: node.ip.to_string(),
                        },
                        NodeAddress {
                            type_: "Hostname".to_owned(),
                            address: node.name.clone(),
                        },
                    ]),
                    conditions: Some(vec![NodeCondition {
                        type_: "Ready".to_owned(),
                        status: "True".to_owned(),
                        reason: Some("NodeportLabReady".to_owned()),
                        message: Some(format!(
                            "network namespace {} is up",
                            plan.netns(&node.name)
                        )),
                        ..Default::default()
                    }]),
                    node_info: Some(NodeSystemInfo {
                        architecture: arch.to_owned(),
                        operating_system: "linux".to_owned(),
                        os_image: "nodeport lab (network namespace)".to_owned(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
            }
        })
        .collect()
}

/// The Service `kubectl expose deployment web --port=80 --type=NodePort` creates: the
/// deployment's labels and selector (`app=web`), one unnamed TCP port 80 to target port 80,
/// type `NodePort`. The API server allocates the cluster IP and the node port as it saves it.
pub fn service() -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(APP.to_owned()),
            namespace: Some(NAMESPACE.to_owned()),
            labels: labels(&[("app", APP)]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                port: i32::from(WEB_PORT),
                protocol: Some("TCP".to_owned()),
                target_port: Some(IntOrString::Int(i32::from(WEB_PORT))),
                ..Default::default()
            }]),
            selector: labels(&[("app", APP)]),
            type_: Some("NodePort".to_owned()),
            ..Default::default()
        }),
        status: None,
    }
}

fn pod_ref(name: &str) -> ObjectReference {
    ObjectReference {
        kind: Some("Pod".to_owned()),
        namespace: Some(NAMESPACE.to_owned()),
        name: Some(name.to_owned()),
        ..Default::default()
    }
}

/// The EndpointSlice the endpointslice controller writes for the Service once its pods are
/// ready: named `web-<suffix>` (the controller uses `generateName: web-`), labelled with the
/// service name and the controller, owned by the Service when its UID is known, one ready
/// endpoint per pod with its node name.
pub fn endpoint_slice(plan: &Plan, slice_suffix: &str, service_uid: Option<&str>) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{APP}-{slice_suffix}")),
            generate_name: Some(format!("{APP}-")),
            namespace: Some(NAMESPACE.to_owned()),
            labels: labels(&[
                ("app", APP),
                (SERVICE_NAME_LABEL, APP),
                (MANAGED_BY_LABEL, MANAGED_BY),
            ]),
            owner_references: service_uid.map(|uid| {
                vec![OwnerReference {
                    api_version: "v1".to_owned(),
                    kind: "Service".to_owned(),
                    name: APP.to_owned(),
                    uid: uid.to_owned(),
                    controller: Some(true),
                    block_owner_deletion: Some(true),
                }]
            }),
            ..Default::default()
        },
        address_type: "IPv4".to_owned(),
        endpoints: plan
            .pods
            .iter()
            .map(|pod| Endpoint {
                addresses: vec![pod.ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                node_name: Some(plan.nodes[pod.node].name.clone()),
                target_ref: Some(pod_ref(&pod.name)),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![SlicePort {
            name: Some(String::new()),
            port: Some(i32::from(WEB_PORT)),
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        }]),
    }
}

/// The Endpoints object the endpoints controller writes (what `kubectl get ep` shows): one
/// subset with every ready pod and the unnamed port.
pub fn endpoints(plan: &Plan) -> Endpoints {
    Endpoints {
        metadata: ObjectMeta {
            name: Some(APP.to_owned()),
            namespace: Some(NAMESPACE.to_owned()),
            labels: labels(&[("app", APP)]),
            ..Default::default()
        },
        subsets: Some(vec![EndpointSubset {
            addresses: Some(
                plan.pods
                    .iter()
                    .map(|pod| EndpointAddress {
                        ip: pod.ip.to_string(),
                        node_name: Some(plan.nodes[pod.node].name.clone()),
                        target_ref: Some(pod_ref(&pod.name)),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ports: Some(vec![EndpointPort {
                port: i32::from(WEB_PORT),
                protocol: Some("TCP".to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }]),
    }
}

/// Objects as a multi-document YAML file for `kubectl create -f`.
pub fn to_yaml<T: serde::Serialize>(objects: &[T]) -> Result<String, yaml_serde::Error> {
    let mut out = String::new();
    for object in objects {
        if !out.is_empty() {
            out.push_str("---\n");
        }
        out.push_str(&yaml_serde::to_string(object)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn plan() -> Plan {
        Plan::new("abcde", 3)
    }

    #[test]
    fn the_service_is_what_kubectl_expose_deployment_web_port_80_type_nodeport_sends() {
        let service = serde_json::to_value(service()).unwrap();
        assert_eq!(
            service,
            json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
                "spec": {
                    "ports": [{"port": 80, "protocol": "TCP", "targetPort": 80}],
                    "selector": {"app": "web"},
                    "type": "NodePort"
                }
            })
        );
    }

    #[test]
    fn the_endpoint_slice_lists_every_pod_ready_with_its_node_under_the_service_label() {
        let plan = plan();
        let slice = serde_json::to_value(endpoint_slice(&plan, "x2k9p", Some("uid-1"))).unwrap();
        assert_eq!(slice["apiVersion"], "discovery.k8s.io/v1");
        assert_eq!(slice["kind"], "EndpointSlice");
        assert_eq!(slice["metadata"]["name"], "web-x2k9p");
        assert_eq!(
            slice["metadata"]["labels"]["kubernetes.io/service-name"],
            "web"
        );
        assert_eq!(slice["metadata"]["ownerReferences"][0]["uid"], "uid-1");
        assert_eq!(slice["addressType"], "IPv4");
        assert_eq!(
            slice["ports"],
            json!([{"name": "", "port": 80, "protocol": "TCP"}])
        );
        let endpoints = slice["endpoints"].as_array().unwrap();
        assert_eq!(endpoints.len(), 3);
        for (endpoint, pod) in endpoints.iter().zip(&plan.pods) {
            assert_eq!(endpoint["addresses"], json!([pod.ip.to_string()]));
            assert_eq!(
                endpoint["conditions"],
                json!({"ready": true, "serving": true, "terminating": false})
            );
            assert_eq!(endpoint["nodeName"], plan.nodes[pod.node].name.as_str());
            assert_eq!(endpoint["targetRef"]["name"], pod.name.as_str());
        }
        let without_owner = serde_json::to_value(endpoint_slice(&plan, "x2k9p", None)).unwrap();
        assert!(without_owner["metadata"].get("ownerReferences").is_none());
    }

    #[test]
    fn the_endpoints_object_has_one_subset_with_every_pod_on_port_80() {
        let plan = plan();
        let ep = serde_json::to_value(endpoints(&plan)).unwrap();
        assert_eq!(ep["metadata"]["name"], "web");
        let ips: Vec<&str> = ep["subsets"][0]["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["ip"].as_str().unwrap())
            .collect();
        assert_eq!(ips, ["10.244.1.2", "10.244.2.2", "10.244.2.3"]);
        assert_eq!(
            ep["subsets"][0]["ports"],
            json!([{"port": 80, "protocol": "TCP"}])
        );
    }

    #[test]
    fn each_node_has_its_internal_ip_and_pod_cidr_and_only_the_control_plane_is_tainted() {
        let nodes = serde_json::to_value(nodes(&plan())).unwrap();
        let nodes = nodes.as_array().unwrap();
        let summary: Vec<(&str, &str, &str, bool)> = nodes
            .iter()
            .map(|n| {
                (
                    n["metadata"]["name"].as_str().unwrap(),
                    n["status"]["addresses"][0]["address"].as_str().unwrap(),
                    n["spec"]["podCIDR"].as_str().unwrap(),
                    n["spec"].get("taints").is_some(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("control-plane", "192.0.2.10", "10.244.0.0/24", true),
                ("worker", "192.0.2.11", "10.244.1.0/24", false),
                ("worker2", "192.0.2.12", "10.244.2.0/24", false),
            ]
        );
        assert!(
            nodes
                .iter()
                .all(|n| n["status"]["addresses"][0]["type"] == "InternalIP")
        );
    }

    #[test]
    fn objects_become_one_yaml_document_each() {
        let yaml = to_yaml(&nodes(&plan())).unwrap();
        assert_eq!(yaml.matches("---\n").count(), 2);
        assert_eq!(yaml.matches("kind: Node\n").count(), 3);
    }
}
