//! The proxy's compact object model: what it keeps of Services, EndpointSlices and its Node.
//!
//! Watch events are converted into these structs at once (see [`crate::convert`]) and the
//! Kubernetes objects are dropped: a node proxy watching 10,000 Services must not keep
//! 10,000 full `Service` objects with their managed fields around.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

/// IP family of an address, a table or a Service's ClusterIP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    /// IPv4 (`table ip kube-proxy`).
    V4,
    /// IPv6 (`table ip6 kube-proxy`).
    V6,
}

impl IpFamily {
    /// Both families, IPv4 first (the order kube-proxy syncs them in).
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The family of an address.
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    /// The family of a CIDR.
    pub fn of_net(net: &IpNet) -> Self {
        Self::of(net.addr())
    }

    /// `IPv4` / `IPv6`, as in Kubernetes' `ipFamilies` and kube-proxy's health JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

/// Transport protocol of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// TCP (the Kubernetes default).
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    /// Parses Kubernetes' `TCP`/`UDP`/`SCTP`; anything else is not a protocol kube-proxy serves.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

/// Identity of one port of one Service: kube-proxy's `ServicePortName` (namespace, name,
/// port name) plus the protocol, which kube-proxy also hashes into chain names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    /// Namespace of the Service.
    pub namespace: Arc<str>,
    /// Name of the Service.
    pub name: Arc<str>,
    /// `spec.ports[].name`, empty for an unnamed port.
    pub port: Arc<str>,
    /// `spec.ports[].protocol`.
    pub protocol: Protocol,
}

impl ServicePortName {
    /// Builds a name from its parts.
    pub fn new(namespace: &str, name: &str, port: &str, protocol: Protocol) -> Self {
        ServicePortName {
            namespace: namespace.into(),
            name: name.into(),
            port: port.into(),
            protocol,
        }
    }

    /// The Service this port belongs to.
    pub fn service(&self) -> ServiceName {
        ServiceName {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

/// `ns/name` or `ns/name:port`: kube-proxy's `ServicePortName.String()`, used in comments.
impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}/{}", self.namespace, self.name)
        } else {
            write!(f, "{}/{}:{}", self.namespace, self.name, self.port)
        }
    }
}

/// Namespace and name of a Service.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

impl ServiceName {
    /// Builds a name from its parts.
    pub fn new(namespace: &str, name: &str) -> Self {
        ServiceName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the proxy keeps of one Service: its ports, with the fields every port shares copied
/// into [`ServicePort`] so that a port can be rendered on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    /// The Service's ports, in `spec.ports` order.
    pub ports: Vec<Arc<ServicePort>>,
}

/// One port of a Service, with everything the dataplane needs for it. Lists are boxed slices
/// (set once, 8 bytes smaller than a `Vec` each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    /// Identity (namespace, name, port name, protocol).
    pub name: ServicePortName,
    /// `spec.clusterIPs`: at most one per family.
    pub cluster_ips: Box<[IpAddr]>,
    /// `spec.ports[].port`.
    pub port: u16,
    /// `spec.ports[].nodePort`, if allocated.
    pub node_port: Option<u16>,
    /// `spec.externalIPs`.
    pub external_ips: Box<[IpAddr]>,
    /// `status.loadBalancer.ingress[].ip`, except those with `ipMode: Proxy`.
    pub load_balancer_ips: Box<[IpAddr]>,
    /// `spec.loadBalancerSourceRanges`.
    pub load_balancer_source_ranges: Box<[IpNet]>,
    /// `externalTrafficPolicy: Local`, as set; it applies in a family where the port is externally
    /// reachable ([`crate::desired::ServicePortState::external_policy_local`]).
    pub external_policy_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_policy_local: bool,
    /// `sessionAffinity: ClientIP`: the stickiness timeout in seconds
    /// (`sessionAffinityConfig.clientIP.timeoutSeconds`, default 10800 = 3 h).
    pub session_affinity_seconds: Option<u32>,
    /// `spec.healthCheckNodePort` (only for `externalTrafficPolicy: Local`).
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// The ClusterIP of `family`, if the Service has one.
    pub fn cluster_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.cluster_ips
            .iter()
            .copied()
            .find(|ip| IpFamily::of(*ip) == family)
    }
}

/// What the proxy keeps of one EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSlice {
    /// The Service it belongs to (label `kubernetes.io/service-name`).
    pub service: ServiceName,
    /// `addressType` (FQDN slices are not kept at all).
    pub family: IpFamily,
    /// `ports[]`: name, port and protocol.
    pub ports: Box<[EndpointPort]>,
    /// `endpoints[]`.
    pub endpoints: Box<[Endpoint]>,
}

/// One entry of an EndpointSlice's `ports`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointPort {
    /// Port name, matching `spec.ports[].name` of the Service (empty when unnamed).
    pub name: Arc<str>,
    /// Target port on the endpoints.
    pub port: u16,
    /// Protocol.
    pub protocol: Protocol,
}

/// One endpoint (kube-proxy uses only the first address of each entry). Its `zone` is not kept:
/// topology routing follows the hints and this node's zone label, never an endpoint's own zone.
///
/// 32 bytes: a large cluster has a million endpoints and more, and the proxy keeps each one
/// (a node name as a fat `Arc<str>` and an inline hints pointer made it 48).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `addresses[0]`.
    pub ip: IpAddr,
    /// `conditions.ready` (unset means ready).
    pub ready: bool,
    /// `conditions.serving` (unset means the value of `ready`).
    pub serving: bool,
    /// `conditions.terminating` (unset means not terminating).
    pub terminating: bool,
    /// `nodeName` and `hints`; `None` when it has neither. Shared: the endpoints of one node
    /// with the same hints point to one [`Placement`] (see [`crate::convert`]).
    pub placement: Option<Arc<Placement>>,
}

impl Endpoint {
    /// `nodeName`: the endpoint is local when it equals this node's name.
    pub fn node_name(&self) -> Option<&str> {
        self.placement.as_deref()?.node_name.as_deref()
    }

    /// `hints.forZones[].name`.
    pub fn zone_hints(&self) -> &[Arc<str>] {
        self.placement.as_deref().map_or(&[], |p| &p.zone_hints)
    }

    /// `hints.forNodes[].name`.
    pub fn node_hints(&self) -> &[Arc<str>] {
        self.placement.as_deref().map_or(&[], |p| &p.node_hints)
    }
}

/// Where an endpoint runs and which topology hints it carries. A cluster has few distinct
/// ones (about one per node and hint set), so they are shared rather than kept per endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Placement {
    /// `nodeName`.
    pub node_name: Option<Arc<str>>,
    /// `hints.forZones[].name`.
    pub zone_hints: Box<[Arc<str>]>,
    /// `hints.forNodes[].name`.
    pub node_hints: Box<[Arc<str>]>,
}

/// What the proxy keeps of its own Node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Node {
    /// `metadata.name`.
    pub name: String,
    /// `status.addresses` of type `InternalIP`, then `ExternalIP`, in that order.
    pub addresses: Vec<IpAddr>,
    /// Label `topology.kubernetes.io/zone`.
    pub zone: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// Tainted `ToBeDeletedByClusterAutoscaler`.
    pub to_be_deleted: bool,
}

impl Node {
    /// kube-proxy's primary node IP of a family: the first `InternalIP`, else the first
    /// `ExternalIP` of that family (`GetNodeHostIPs`), never a loopback address.
    pub fn primary_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.addresses
            .iter()
            .copied()
            .find(|ip| IpFamily::of(*ip) == family && !ip.is_loopback())
    }

    /// kube-proxy's `NodeEligible` for `/healthz`: not being deleted.
    pub fn eligible(&self) -> bool {
        !self.deleting && !self.to_be_deleted
    }
}

/// A `networking.k8s.io/v1` ServiceCIDR's ranges: kube-proxy drops traffic to unallocated
/// addresses inside them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceCidr {
    /// `spec.cidrs`.
    pub cidrs: Vec<IpNet>,
}
