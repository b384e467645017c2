//! The endpoints of `default/kubernetes`: kube-apiserver's lease endpoint reconciler
//! (`--endpoint-reconciler-type=lease`, its default).
//!
//! Every API server with an advertise address holds a lease, the key
//! `<prefix>/masterleases/<ip>`, renewed every [`RENEW_INTERVAL`] and valid for [`LEASE_TTL`]. After
//! each renewal it writes the Endpoints `default/kubernetes` and the EndpointSlice
//! `default/kubernetes` with the address of every unexpired lease and its port, named `https`
//! as in the Service. So in-cluster clients reach an API server through the `kubernetes`
//! Service's ClusterIP (the proxy DNATs it like any other Service), and a replica that stops
//! leaves them: at once when it shuts down ([`Registry::leave_kubernetes_endpoints`]), within a
//! TTL when it dies.
//!
//! kube-apiserver gives its lease keys an etcd TTL; here the value carries the expiry time
//! (wall clock, seconds) instead, which the embedded store can hold as well, and an expired
//! lease is deleted by the next replica that reconciles. Replicas therefore need clocks that
//! agree to within a fraction of the TTL, which NTP gives.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{EndpointAddress, EndpointPort, EndpointSubset, Endpoints};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointPort as SlicePort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::object::Object;
use super::{Registry, encode_stored, new_uid, now, typed_from_entry};
use crate::error::ApiError;
use crate::resource::Kind;
use crate::storage::ListRequest;

/// How long a lease lasts without renewal (kube-apiserver's `DefaultEndpointReconcilerTTL`).
pub const LEASE_TTL: Duration = Duration::from_secs(15);

/// How often a server renews its lease and rewrites the endpoints
/// (`DefaultEndpointReconcilerInterval`).
pub const RENEW_INTERVAL: Duration = Duration::from_secs(10);

/// The port name of the `kubernetes` Service and its endpoints.
const PORT_NAME: &str = "https";

#[derive(serde::Serialize, serde::Deserialize)]
struct Lease {
    ip: IpAddr,
    port: u16,
    /// Unix seconds after which the lease no longer counts.
    expires: u64,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Registry {
    fn lease_prefix(&self) -> String {
        format!("{}/masterleases/", self.store.prefix())
    }

    /// Renews this server's lease (`ip`, serving on `port`) for `ttl`, then rewrites the
    /// endpoints of `default/kubernetes` from every lease still valid.
    pub async fn renew_kubernetes_endpoints(
        &self,
        ip: IpAddr,
        port: u16,
        ttl: Duration,
    ) -> Result<(), ApiError> {
        let key = format!("{}{ip}", self.lease_prefix());
        let lease = Lease {
            ip,
            port,
            expires: unix_now() + ttl.as_secs(),
        };
        let value: std::sync::Arc<[u8]> = serde_json::to_vec(&lease)
            .map_err(ApiError::internal)?
            .into();
        self.store
            .mutate(vec![key.clone()], move |txn| {
                txn.put(key.clone(), value.clone());
                Ok(())
            })
            .await?;
        self.reconcile_kubernetes_endpoints().await
    }

    /// Gives up this server's lease and rewrites the endpoints without it (a clean shutdown).
    pub async fn leave_kubernetes_endpoints(&self, ip: IpAddr) -> Result<(), ApiError> {
        let key = format!("{}{ip}", self.lease_prefix());
        self.store
            .mutate(vec![key.clone()], move |txn| {
                if txn.get(&key).is_some() {
                    txn.delete(key.clone());
                }
                Ok(())
            })
            .await?;
        self.reconcile_kubernetes_endpoints().await
    }

    /// Writes the Endpoints and the EndpointSlice `default/kubernetes` with the address and port
    /// of every valid lease (nothing when they already say so), and deletes expired leases.
    pub async fn reconcile_kubernetes_endpoints(&self) -> Result<(), ApiError> {
        let page = self
            .store
            .backend()
            .list(ListRequest {
                prefix: self.lease_prefix(),
                start: None,
                revision: None,
                limit: None,
            })
            .await?;
        let now = unix_now();
        let mut live = BTreeSet::new();
        let mut expired = Vec::new();
        for kv in &page.kvs {
            match serde_json::from_slice::<Lease>(&kv.value) {
                Ok(lease) if lease.expires > now => {
                    live.insert((lease.ip, lease.port));
                }
                // Expired, or not ours to read: neither counts.
                _ => expired.push((kv.key.clone(), kv.mod_revision)),
            }
        }
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
                let old_endpoints = txn
                    .get(&endpoints_key)
                    .map(|e| typed_from_entry(Kind::Endpoints, &e.value))
                    .transpose()?;
                let endpoints = Object::Endpoints(Box::new(kubernetes_endpoints(
                    &live,
                    old_endpoints.as_ref(),
                )));
                if old_endpoints.as_ref() != Some(&endpoints) {
                    txn.put(endpoints_key.clone(), encode_stored(&endpoints));
                }
                let old_slice = txn
                    .get(&slice_key)
                    .map(|e| typed_from_entry(Kind::EndpointSlice, &e.value))
                    .transpose()?;
                let slice =
                    Object::EndpointSlice(Box::new(kubernetes_slice(&live, old_slice.as_ref())));
                if old_slice.as_ref() != Some(&slice) {
                    txn.put(slice_key.clone(), encode_stored(&slice));
                }
                Ok(())
            })
            .await?;
        Ok(())
    }
}

/// The metadata an object keeps across rewrites (uid, creation time), or a fresh one.
fn kept_meta(old: Option<&Object>, labels: &[(&str, &str)]) -> ObjectMeta {
    let old = old.map(Object::metadata);
    ObjectMeta {
        name: Some("kubernetes".into()),
        namespace: Some("default".into()),
        uid: Some(old.and_then(|m| m.uid.clone()).unwrap_or_else(new_uid)),
        creation_timestamp: Some(
            old.and_then(|m| m.creation_timestamp.clone())
                .unwrap_or_else(now),
        ),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        ),
        ..Default::default()
    }
}

/// The Endpoints kube-apiserver's reconciler writes: one subset with every address and the
/// port (several ports if replicas serve on different ones, each address with its own), and
/// the label that keeps the EndpointSlice mirroring controller away (the reconciler writes the
/// slice itself).
fn kubernetes_endpoints(live: &BTreeSet<(IpAddr, u16)>, old: Option<&Object>) -> Endpoints {
    let ports: BTreeSet<u16> = live.iter().map(|(_, p)| *p).collect();
    let subsets = ports
        .iter()
        .map(|port| EndpointSubset {
            addresses: Some(
                live.iter()
                    .filter(|(_, p)| p == port)
                    .map(|(ip, _)| EndpointAddress {
                        ip: ip.to_string(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ports: Some(vec![EndpointPort {
                name: Some(PORT_NAME.into()),
                port: i32::from(*port),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        })
        .collect::<Vec<_>>();
    Endpoints {
        metadata: kept_meta(old, &[("endpointslice.kubernetes.io/skip-mirror", "true")]),
        subsets: (!subsets.is_empty()).then_some(subsets),
    }
}

/// The EndpointSlice `default/kubernetes`: the addresses of the family of the first lease (a
/// slice holds one family), ready, with the port.
fn kubernetes_slice(live: &BTreeSet<(IpAddr, u16)>, old: Option<&Object>) -> EndpointSlice {
    let ipv6 = live.iter().next().is_some_and(|(ip, _)| ip.is_ipv6());
    let of_family: Vec<&(IpAddr, u16)> =
        live.iter().filter(|(ip, _)| ip.is_ipv6() == ipv6).collect();
    let port = of_family.first().map(|(_, p)| *p);
    let mut metadata = kept_meta(
        old,
        &[
            ("kubernetes.io/service-name", "kubernetes"),
            (
                "endpointslice.kubernetes.io/managed-by",
                "endpointslice-controller.k8s.io",
            ),
        ],
    );
    let endpoints: Vec<Endpoint> = of_family
        .iter()
        .filter(|(_, p)| Some(*p) == port)
        .map(|(ip, _)| Endpoint {
            addresses: vec![ip.to_string()],
            conditions: Some(EndpointConditions {
                ready: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let old_generation = old.and_then(|o| o.metadata().generation).unwrap_or(0);
    let slice = EndpointSlice {
        metadata: ObjectMeta::default(),
        address_type: if ipv6 { "IPv6" } else { "IPv4" }.into(),
        endpoints,
        ports: port.map(|p| {
            vec![SlicePort {
                name: Some(PORT_NAME.into()),
                port: Some(i32::from(p)),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]
        }),
    };
    // The generation moves only when what the slice says changes.
    let same = matches!(old, Some(Object::EndpointSlice(o))
        if o.endpoints == slice.endpoints && o.ports == slice.ports && o.address_type == slice.address_type);
    metadata.generation = Some(if same {
        old_generation.max(1)
    } else {
        old_generation + 1
    });
    EndpointSlice { metadata, ..slice }
}
