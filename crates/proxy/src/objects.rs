//! The proxy's view of the cluster: change-tracked Services, EndpointSlices and ServiceCIDRs,
//! indexed for per-Service lookups, plus the objects-file loader of `nodeport render`.

use std::collections::{BTreeSet, HashMap};

use ipnet::IpNet;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use serde::Deserialize;

use crate::convert;
use crate::desired::Objects;
use crate::model::{EndpointSlice, Node, Protocol, Service, ServiceCidr, ServiceName};
use crate::tracker::ChangeTracker;

/// Services, EndpointSlices and ServiceCIDRs as the proxy knows them.
#[derive(Debug, Default)]
pub struct Cluster {
    /// Services by namespace/name.
    pub services: ChangeTracker<ServiceName, Service>,
    /// EndpointSlices by namespace/name of the slice.
    pub slices: ChangeTracker<ServiceName, EndpointSlice>,
    /// ServiceCIDRs by name.
    pub service_cidrs: ChangeTracker<String, ServiceCidr>,
    /// Slice names of each Service, sorted. A `Vec`: a Service has one slice or a few, and a
    /// `BTreeSet` would allocate a node with room for eleven.
    by_service: HashMap<ServiceName, Vec<ServiceName>>,
}

/// What changed since the last sync, in the terms a sync needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services whose ports or endpoints changed.
    pub services: BTreeSet<ServiceName>,
    /// Service CIDRs changed.
    pub service_cidrs: bool,
    /// A changed EndpointSlice belongs to a Service that had or has a UDP port, or a
    /// changed Service had or has one: conntrack needs cleaning after the sync (kube-proxy's
    /// `ConntrackCleanupRequired`, and its reconciling clean-up, which finds the entries a
    /// new Service's UDP NodePort or address inherits: a client that sent before the Service
    /// existed keeps an untranslated entry for as long as it keeps sending).
    pub udp_endpoints_changed: bool,
    /// Number of EndpointSlice changes (metrics).
    pub endpoint_changes: usize,
    /// Number of Service changes (metrics).
    pub service_changes: usize,
}

impl Cluster {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a Service (`None`: deleted).
    pub fn update_service(&mut self, key: ServiceName, value: Option<Service>) -> bool {
        self.services.update(key, value)
    }

    /// Records an EndpointSlice (`None`: deleted).
    pub fn update_slice(&mut self, key: ServiceName, value: Option<EndpointSlice>) -> bool {
        if let Some(old) = self.slices.get(&key)
            && value.as_ref().is_none_or(|v| v.service != old.service)
        {
            let svc = old.service.clone();
            if let Some(set) = self.by_service.get_mut(&svc) {
                set.retain(|k| *k != key);
                if set.is_empty() {
                    self.by_service.remove(&svc);
                }
            }
        }
        if let Some(v) = &value {
            let names = self.by_service.entry(v.service.clone()).or_default();
            if let Err(i) = names.binary_search(&key) {
                names.insert(i, key.clone());
            }
        }
        self.slices.update(key, value)
    }

    /// Records a ServiceCIDR (`None`: deleted).
    pub fn update_service_cidr(&mut self, name: String, value: Option<ServiceCidr>) -> bool {
        self.service_cidrs.update(name, value)
    }

    /// Number of changes waiting for the next sync.
    pub fn pending(&self) -> usize {
        self.services.pending() + self.slices.pending() + self.service_cidrs.pending()
    }

    /// Drains the pending changes.
    pub fn take_changes(&mut self) -> Changes {
        let mut out = Changes::default();
        let has_udp = |svc: &Service| svc.ports.iter().any(|p| p.name.protocol == Protocol::Udp);
        for (name, change) in self.services.take_changes() {
            out.service_changes += 1;
            out.services.insert(name);
            if change
                .previous
                .iter()
                .chain(change.current.iter())
                .any(&has_udp)
            {
                out.udp_endpoints_changed = true;
            }
        }
        for (_, change) in self.slices.take_changes() {
            out.endpoint_changes += 1;
            for slice in change.previous.iter().chain(change.current.iter()) {
                out.services.insert(slice.service.clone());
                if self.services.get(&slice.service).is_some_and(has_udp)
                    || slice.ports.iter().any(|p| p.protocol == Protocol::Udp)
                {
                    out.udp_endpoints_changed = true;
                }
            }
        }
        out.service_cidrs = !self.service_cidrs.take_changes().is_empty();
        out
    }
}

impl Objects for Cluster {
    fn services(&self) -> Box<dyn Iterator<Item = (&ServiceName, &Service)> + '_> {
        Box::new(self.services.iter())
    }

    fn service(&self, name: &ServiceName) -> Option<&Service> {
        self.services.get(name)
    }

    fn slices_of(&self, service: &ServiceName) -> Vec<&EndpointSlice> {
        self.by_service
            .get(service)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k))
            .collect()
    }

    fn service_cidrs(&self) -> Vec<IpNet> {
        let mut names: Vec<&String> = self.service_cidrs.keys().collect();
        names.sort();
        let mut out: Vec<IpNet> = Vec::new();
        for n in names {
            for c in &self.service_cidrs.get(n).expect("listed key").cidrs {
                if !out.contains(c) {
                    out.push(*c);
                }
            }
        }
        out
    }
}

/// A bad objects file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A document is not valid YAML.
    #[error("document {index}: invalid YAML")]
    Yaml {
        /// 1-based document number.
        index: usize,
        /// Parser error.
        #[source]
        source: yaml_serde::Error,
    },
    /// A document of a known kind does not decode as that kind.
    #[error("document {index}: invalid {kind}")]
    Decode {
        /// 1-based document number.
        index: usize,
        /// The kind.
        kind: String,
        /// Decoder error.
        #[source]
        source: serde_json::Error,
    },
}

/// The content of an objects file.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Services, EndpointSlices and ServiceCIDRs.
    pub cluster: Cluster,
    /// The Node, if the file has one (the last, if it has several).
    pub node: Option<Node>,
    /// Every Node of the file, in order (`kubectl get nodes -o yaml` lists them all).
    pub nodes: Vec<Node>,
    /// One line per skipped document.
    pub warnings: Vec<String>,
}

#[derive(Deserialize)]
struct TypeMeta {
    #[serde(default)]
    kind: String,
    #[serde(default, rename = "apiVersion")]
    api_version: String,
}

/// Loads a multi-document YAML file of Services, EndpointSlices, ServiceCIDRs and an optional
/// Node. `List` documents (`kubectl get -o yaml`) are unpacked; other kinds are skipped with
/// a warning.
pub fn load(text: &str) -> Result<Loaded, Error> {
    let mut loaded = Loaded::default();
    let mut index = 0;
    for doc in yaml_serde::Deserializer::from_str(text) {
        index += 1;
        // Through YAML's own value, which refuses a key given twice in one mapping (as kubectl
        // does): two documents run together without `---` would otherwise merge silently, the
        // later keys winning.
        let value = yaml_serde::Value::deserialize(doc)
            .and_then(yaml_serde::from_value::<serde_json::Value>)
            .map_err(|source| Error::Yaml { index, source })?;
        if value.is_null() {
            continue;
        }
        let items = match value.get("kind").and_then(|k| k.as_str()) {
            Some("List") | Some("ServiceList") | Some("EndpointSliceList") => value
                .get("items")
                .and_then(|i| i.as_array())
                .cloned()
                .unwrap_or_default(),
            _ => vec![value],
        };
        for item in items {
            add_object(&mut loaded, index, item)?;
        }
    }
    Ok(loaded)
}

fn add_object(loaded: &mut Loaded, index: usize, value: serde_json::Value) -> Result<(), Error> {
    let meta: TypeMeta = serde_json::from_value(value.clone()).unwrap_or(TypeMeta {
        kind: String::new(),
        api_version: String::new(),
    });
    let decode_err = |kind: &str| {
        let kind = kind.to_string();
        move |source| Error::Decode {
            index,
            kind,
            source,
        }
    };
    match (meta.kind.as_str(), meta.api_version.as_str()) {
        ("Service", "v1") => {
            let svc: core::Service =
                serde_json::from_value(value).map_err(decode_err("Service"))?;
            match convert::service(&svc) {
                Some((k, v)) => {
                    loaded.cluster.update_service(k, Some(v));
                }
                None => loaded.warnings.push(format!(
                    "document {index}: Service {} has no ClusterIP or is ExternalName; kube-proxy ignores it",
                    convert::object_key(&svc.metadata)
                )),
            }
        }
        ("EndpointSlice", "discovery.k8s.io/v1") => {
            let slice: discovery::EndpointSlice =
                serde_json::from_value(value).map_err(decode_err("EndpointSlice"))?;
            match convert::endpoint_slice(&slice) {
                Some((k, v)) => {
                    loaded.cluster.update_slice(k, Some(v));
                }
                None => loaded.warnings.push(format!(
                    "document {index}: EndpointSlice {} has no kubernetes.io/service-name label or is FQDN; skipped",
                    convert::object_key(&slice.metadata)
                )),
            }
        }
        ("ServiceCIDR", "networking.k8s.io/v1") => {
            let cidr: networking::ServiceCIDR =
                serde_json::from_value(value).map_err(decode_err("ServiceCIDR"))?;
            let (k, v) = convert::service_cidr(&cidr);
            loaded.cluster.update_service_cidr(k, Some(v));
        }
        ("Node", "v1") => {
            let node: core::Node = serde_json::from_value(value).map_err(decode_err("Node"))?;
            let node = convert::node(&node);
            loaded.nodes.push(node.clone());
            loaded.node = Some(node);
        }
        (kind, api) => loaded.warnings.push(format!(
            "document {index}: skipping {} (not a Service, EndpointSlice, ServiceCIDR or Node)",
            if kind.is_empty() {
                "an object without kind".to_string()
            } else {
                format!("{api} {kind}")
            }
        )),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_given_twice_in_one_document_is_an_error_not_a_silent_merge() {
        // Two objects without the `---` between them.
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n";
        let Err(err) = load(text) else {
            panic!("loaded a document with duplicate keys");
        };
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(chain.starts_with("document 1: invalid YAML"), "{chain}");
        assert!(
            chain.contains("duplicate entry with key \"apiVersion\""),
            "{chain}"
        );
        // With the separator both load.
        let fixed = text.replace("apiVersion: networking", "---\napiVersion: networking");
        let loaded = load(&fixed).unwrap();
        assert_eq!(loaded.cluster.services.len(), 1);
    }

    /// A UDP Service created after its EndpointSlice changes no slice, yet flows that a
    /// client sent to its NodePort before it existed must be cleaned (black-box review: the
    /// client's untranslated entry outlived the new Service for as long as it kept sending).
    #[test]
    fn a_service_change_with_a_udp_port_asks_for_conntrack_cleaning_and_a_tcp_one_does_not() {
        let yaml = |proto: &str| {
            format!(
                "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dns-1, namespace: default, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{port: 53, protocol: {proto}}}]\nendpoints: [{{addresses: [10.244.1.5]}}]\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: default}}\nspec: {{type: NodePort, clusterIP: 10.96.0.10, ports: [{{port: 53, protocol: {proto}, nodePort: 30053}}]}}\n"
            )
        };
        for (proto, cleaning) in [("UDP", true), ("TCP", false)] {
            let loaded = load(&yaml(proto)).unwrap().cluster;
            let mut cluster = Cluster::default();
            for (key, slice) in loaded.slices.iter() {
                cluster.update_slice(key.clone(), Some(slice.clone()));
            }
            let changes = cluster.take_changes();
            assert_eq!(
                changes.udp_endpoints_changed, cleaning,
                "{proto}: the slice"
            );
            for (name, svc) in loaded.services.iter() {
                cluster.update_service(name.clone(), Some(svc.clone()));
            }
            let changes = cluster.take_changes();
            assert_eq!(
                changes.udp_endpoints_changed, cleaning,
                "{proto}: the Service alone"
            );
        }
    }
}
