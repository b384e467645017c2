//! The endpoints of `default/kubernetes`: kube-apiserver's lease endpoint reconciler
//! (`--endpoint-reconciler-type=lease`, its default).
//!
//! Every API server with an advertise address holds a lease, the key
//! `<prefix>/masterleases/<ip>`, rewritten every [`RENEW_INTERVAL`]. After each renewal it
//! writes the Endpoints and the EndpointSlice `default/kubernetes`: the address of every live
//! lease of the Service's IP family, with this server's port (named `https`, as in the
//! Service). As in kube-apiserver, all servers are expected to serve on the same port. So
//! in-cluster clients reach an API server through the `kubernetes` Service's ClusterIP, and a
//! server leaves: at once when it begins to shut down ([`Registry::leave_kubernetes_endpoints`],
//! after which it renews no more), within [`LEASE_TTL`] when it dies.
//!
//! kube-apiserver gives lease keys an etcd TTL. Here a lease is live while it keeps being
//! rewritten: a server counts a lease as expired when its revision has not moved for
//! [`LEASE_TTL`] of this server's own monotonic time. No wall clocks are compared, and the
//! embedded store works the same way. A server that could not read the leases starts their clocks
//! again, so an outage of the store does not make it drop the others.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{EndpointAddress, EndpointPort, EndpointSubset, Endpoints};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointPort as SlicePort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::object::Object;
use super::{Registry, encode_stored, new_uid, now, typed_from_entry};
use crate::error::ApiError;
use crate::resource::Kind;
use crate::storage::{ListRequest, Revision};

/// How long a lease counts without being rewritten (kube-apiserver's
/// `DefaultEndpointReconcilerTTL`).
pub const LEASE_TTL: Duration = Duration::from_secs(15);

/// How often a server renews its lease and rewrites the endpoints
/// (`DefaultEndpointReconcilerInterval`).
pub const RENEW_INTERVAL: Duration = Duration::from_secs(10);

/// The port name of the `kubernetes` Service and its endpoints.
const PORT_NAME: &str = "https";

/// This server's view of the leases.
#[derive(Default)]
pub struct Leases {
    /// Set once this server has left: no renewal may bring its lease back.
    stopped: bool,
    /// Each lease key's revision and when this server first saw it.
    seen: HashMap<String, (Revision, Instant)>,
    /// The last attempt to read the leases failed.
    blind: bool,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Lease {
    ip: IpAddr,
}

impl Registry {
    fn lease_prefix(&self) -> String {
        format!("{}/masterleases/", self.store.prefix())
    }

    fn lease_key(&self, ip: IpAddr) -> String {
        format!("{}{ip}", self.lease_prefix())
    }

    /// Renews this server's lease (`ip`), then rewrites the endpoints of `default/kubernetes`
    /// with the live leases and `port`. Does nothing once this server has left.
    pub async fn renew_kubernetes_endpoints(
        &self,
        ip: IpAddr,
        port: u16,
        ttl: Duration,
    ) -> Result<(), ApiError> {
        let mut leases = self.leases.lock().await;
        if leases.stopped {
            return Ok(());
        }
        let key = self.lease_key(ip);
        let value: std::sync::Arc<[u8]> = serde_json::to_vec(&Lease { ip })
            .map_err(ApiError::internal)?
            .into();
        self.store
            .mutate(vec![key.clone()], move |txn| {
                txn.put(key.clone(), value.clone());
                Ok(())
            })
            .await?;
        self.reconcile_kubernetes_endpoints(&mut leases, port, ttl)
            .await
    }

    /// Gives up this server's lease for good and rewrites the endpoints without it (the start of
    /// a shutdown, as kube-apiserver's pre-shutdown hook).
    pub async fn leave_kubernetes_endpoints(
        &self,
        ip: IpAddr,
        port: u16,
        ttl: Duration,
    ) -> Result<(), ApiError> {
        let mut leases = self.leases.lock().await;
        leases.stopped = true;
        let key = self.lease_key(ip);
        self.store
            .mutate(vec![key.clone()], move |txn| {
                if txn.get(&key).is_some() {
                    txn.delete(key.clone());
                }
                Ok(())
            })
            .await?;
        self.reconcile_kubernetes_endpoints(&mut leases, port, ttl)
            .await
    }

    /// Writes the Endpoints and the EndpointSlice `default/kubernetes` with every live lease of
    /// the Service's family (nothing when they already say so), and deletes expired leases.
    async fn reconcile_kubernetes_endpoints(
        &self,
        leases: &mut Leases,
        port: u16,
        ttl: Duration,
    ) -> Result<(), ApiError> {
        let listed = self
            .store
            .backend()
            .list(ListRequest {
                prefix: self.lease_prefix(),
                start: None,
                revision: None,
                limit: None,
            })
            .await;
        let page = match listed {
            Ok(page) => page,
            Err(err) => {
                leases.blind = true;
                return Err(err.into());
            }
        };
        let now = Instant::now();
        if std::mem::take(&mut leases.blind) {
            leases.seen.clear();
        }
        let ipv6 = self.ranges.cluster_ips.addr().is_ipv6();
        let mut live = BTreeSet::new();
        let mut expired = Vec::new();
        let mut seen = HashMap::new();
        for kv in &page.kvs {
            // A key this server cannot read is someone else's: neither counted nor removed.
            let Ok(lease) = serde_json::from_slice::<Lease>(&kv.value) else {
                continue;
            };
            let since = match leases.seen.get(&kv.key) {
                Some((revision, since)) if *revision == kv.mod_revision => *since,
                _ => now,
            };
            seen.insert(kv.key.clone(), (kv.mod_revision, since));
            if now.duration_since(since) >= ttl {
                expired.push((kv.key.clone(), kv.mod_revision));
            } else if lease.ip.is_ipv6() == ipv6 {
                live.insert(lease.ip);
            }
        }
        leases.seen = seen;
        let endpoints_key = self.key(Kind::Endpoints, Some("default"), "kubernetes");
        let slice_key = self.key(Kind::EndpointSlice, Some("default"), "kubernetes");
        let mut keys = vec![endpoints_key.clone(), slice_key.clone()];
        keys.extend(expired.iter().map(|(k, _)| k.clone()));
        self.store
            .mutate(keys, move |txn| {
                for (key, revision) in &expired {
                    // Only if nobody renewed it meanwhile.
                    if txn.get(key).is_some_and(|e| e.mod_revision == *revision) {
                        txn.delete(key.clone());
                    }
                }
                let old = txn
                    .get(&endpoints_key)
                    .map(|e| typed_from_entry(Kind::Endpoints, &e.value))
                    .transpose()?;
                let endpoints = kubernetes_endpoints(&live, port, old.as_ref());
                if old.as_ref() != Some(&endpoints) {
                    txn.put(endpoints_key.clone(), encode_stored(&endpoints));
                }
                let old = txn
                    .get(&slice_key)
                    .map(|e| typed_from_entry(Kind::EndpointSlice, &e.value))
                    .transpose()?;
                let slice = kubernetes_slice(&live, port, ipv6, old.as_ref());
                if old.as_ref() != Some(&slice) {
                    txn.put(slice_key.clone(), encode_stored(&slice));
                }
                Ok(())
            })
            .await?;
        Ok(())
    }
}

/// The metadata kept across rewrites (uid, creation time, annotations, finalizers, owners),
/// with the reconciler's own labels (kube's reconciler resets only the labels).
fn kept_meta(old: Option<&Object>, labels: &[(&str, &str)]) -> ObjectMeta {
    let old = old.map(Object::metadata).cloned().unwrap_or_default();
    ObjectMeta {
        name: Some("kubernetes".into()),
        namespace: Some("default".into()),
        uid: old.uid.or_else(|| Some(new_uid())),
        creation_timestamp: old.creation_timestamp.or_else(|| Some(now())),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        ),
        annotations: old.annotations,
        finalizers: old.finalizers,
        owner_references: old.owner_references,
        generation: old.generation,
        ..Default::default()
    }
}

/// The Endpoints kube-apiserver's reconciler writes: one subset with every address and the
/// port, and the label that keeps the EndpointSlice mirroring controller away (the reconciler
/// writes the slice itself).
fn kubernetes_endpoints(live: &BTreeSet<IpAddr>, port: u16, old: Option<&Object>) -> Object {
    let subsets = (!live.is_empty()).then(|| {
        vec![EndpointSubset {
            addresses: Some(
                live.iter()
                    .map(|ip| EndpointAddress {
                        ip: ip.to_string(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ports: Some(vec![EndpointPort {
                name: Some(PORT_NAME.into()),
                port: i32::from(port),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }]
    });
    Object::Endpoints(Box::new(Endpoints {
        metadata: kept_meta(old, &[("endpointslice.kubernetes.io/skip-mirror", "true")]),
        subsets,
    }))
}

/// The EndpointSlice `default/kubernetes`: of the Service's family, every address ready, with
/// the port; its generation moves when what it says (or its labels) changes.
fn kubernetes_slice(
    live: &BTreeSet<IpAddr>,
    port: u16,
    ipv6: bool,
    old: Option<&Object>,
) -> Object {
    let mut slice = EndpointSlice {
        metadata: kept_meta(old, &[("kubernetes.io/service-name", "kubernetes")]),
        address_type: if ipv6 { "IPv6" } else { "IPv4" }.into(),
        endpoints: live
            .iter()
            .map(|ip| Endpoint {
                addresses: vec![ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![SlicePort {
            name: Some(PORT_NAME.into()),
            port: Some(i32::from(port)),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    };
    let generation = slice.metadata.generation.unwrap_or(0);
    let same = matches!(old, Some(Object::EndpointSlice(o))
        if o.endpoints == slice.endpoints
            && o.ports == slice.ports
            && o.address_type == slice.address_type
            && o.metadata.labels == slice.metadata.labels);
    slice.metadata.generation = Some(if same {
        generation.max(1)
    } else {
        generation + 1
    });
    Object::EndpointSlice(Box::new(slice))
}
