//! The resources this server serves, with their names, scopes and storage keys.

use crate::error::Subject;

/// A served resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `core/v1` Service (namespaced, `status` subresource, allocation).
    Service,
    /// `core/v1` Endpoints (namespaced).
    Endpoints,
    /// `discovery.k8s.io/v1` EndpointSlice (namespaced).
    EndpointSlice,
    /// `core/v1` Node (cluster-scoped, `status` subresource).
    Node,
    /// `core/v1` Namespace (cluster-scoped, `status` subresource).
    Namespace,
    /// `networking.k8s.io/v1` ServiceCIDR (cluster-scoped): the default `kubernetes` object,
    /// which mirrors `--service-cluster-ip-range`, and those added to grow the ClusterIP space.
    ServiceCidr,
    /// `core/v1` Event (namespaced), stored as kube-apiserver stores it.
    Event,
    /// `events.k8s.io/v1` Event: the same objects as [`Kind::Event`], in the newer form
    /// (`regarding`, `note`, `reportingController`, ...), converted on the way in and out.
    EventsV1,
    /// `networking.k8s.io/v1` IPAddress (cluster-scoped): one per allocated ClusterIP, or a
    /// reservation a user made.
    IpAddress,
    /// `rbac.authorization.k8s.io/v1` Role (namespaced).
    Role,
    /// `rbac.authorization.k8s.io/v1` ClusterRole (cluster-scoped, `aggregationRule`).
    ClusterRole,
    /// `rbac.authorization.k8s.io/v1` RoleBinding (namespaced).
    RoleBinding,
    /// `rbac.authorization.k8s.io/v1` ClusterRoleBinding (cluster-scoped).
    ClusterRoleBinding,
}

impl Kind {
    /// Every served resource.
    pub const ALL: [Kind; 13] = [
        Kind::Namespace,
        Kind::Service,
        Kind::Endpoints,
        Kind::Node,
        Kind::EndpointSlice,
        Kind::ServiceCidr,
        Kind::Event,
        Kind::EventsV1,
        Kind::IpAddress,
        Kind::Role,
        Kind::ClusterRole,
        Kind::RoleBinding,
        Kind::ClusterRoleBinding,
    ];

    /// The API group (`""` for core).
    pub fn group(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io",
            Kind::ServiceCidr => "networking.k8s.io",
            Kind::EventsV1 => "events.k8s.io",
            Kind::IpAddress => "networking.k8s.io",
            Kind::Role | Kind::ClusterRole | Kind::RoleBinding | Kind::ClusterRoleBinding => {
                "rbac.authorization.k8s.io"
            }
            _ => "",
        }
    }

    /// The version within the group.
    pub fn version(self) -> &'static str {
        "v1"
    }

    /// `apiVersion` as written in objects.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::ServiceCidr => "networking.k8s.io/v1",
            Kind::EventsV1 => "events.k8s.io/v1",
            Kind::IpAddress => "networking.k8s.io/v1",
            Kind::Role | Kind::ClusterRole | Kind::RoleBinding | Kind::ClusterRoleBinding => {
                "rbac.authorization.k8s.io/v1"
            }
            _ => "v1",
        }
    }

    /// `kind`.
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::Endpoints => "Endpoints",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::Namespace => "Namespace",
            Kind::ServiceCidr => "ServiceCIDR",
            Kind::Event | Kind::EventsV1 => "Event",
            Kind::IpAddress => "IPAddress",
            Kind::Role => "Role",
            Kind::ClusterRole => "ClusterRole",
            Kind::RoleBinding => "RoleBinding",
            Kind::ClusterRoleBinding => "ClusterRoleBinding",
        }
    }

    /// `kind` of the list.
    pub fn list_kind(self) -> String {
        format!("{}List", self.kind())
    }

    /// The plural resource name used in paths.
    pub fn resource(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::Endpoints => "endpoints",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::Namespace => "namespaces",
            Kind::ServiceCidr => "servicecidrs",
            Kind::Event | Kind::EventsV1 => "events",
            Kind::IpAddress => "ipaddresses",
            Kind::Role => "roles",
            Kind::ClusterRole => "clusterroles",
            Kind::RoleBinding => "rolebindings",
            Kind::ClusterRoleBinding => "clusterrolebindings",
        }
    }

    /// The singular name.
    pub fn singular(self) -> &'static str {
        match self {
            Kind::Service => "service",
            Kind::Endpoints => "endpoints",
            Kind::EndpointSlice => "endpointslice",
            Kind::Node => "node",
            Kind::Namespace => "namespace",
            Kind::ServiceCidr => "servicecidr",
            Kind::Event | Kind::EventsV1 => "event",
            Kind::IpAddress => "ipaddress",
            Kind::Role => "role",
            Kind::ClusterRole => "clusterrole",
            Kind::RoleBinding => "rolebinding",
            Kind::ClusterRoleBinding => "clusterrolebinding",
        }
    }

    /// kubectl short names.
    pub fn short_names(self) -> &'static [&'static str] {
        match self {
            Kind::Service => &["svc"],
            Kind::Endpoints => &["ep"],
            Kind::EndpointSlice | Kind::ServiceCidr => &[],
            Kind::Node => &["no"],
            Kind::Namespace => &["ns"],
            Kind::Event | Kind::EventsV1 => &["ev"],
            Kind::IpAddress => &["ip"],
            Kind::Role | Kind::ClusterRole | Kind::RoleBinding | Kind::ClusterRoleBinding => &[],
        }
    }

    /// Whether objects live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(
            self,
            Kind::Node
                | Kind::Namespace
                | Kind::ServiceCidr
                | Kind::IpAddress
                | Kind::ClusterRole
                | Kind::ClusterRoleBinding
        )
    }

    /// Whether the resource is served for reading only (get, list, watch); other verbs are
    /// answered 405 `MethodNotAllowed`, as kube-apiserver answers a verb a resource does not
    /// support. Every served kind is writable (ServiceCIDRs since kube 1.33).
    pub fn read_only(self) -> bool {
        false
    }

    /// Whether the resource has a `status` subresource.
    pub fn has_status(self) -> bool {
        matches!(
            self,
            Kind::Service | Kind::Node | Kind::Namespace | Kind::ServiceCidr
        )
    }

    /// Whether PUT of a missing object creates it (`AllowCreateOnUpdate` of the kube strategy).
    pub fn allow_create_on_update(self) -> bool {
        matches!(
            self,
            Kind::Service | Kind::Endpoints | Kind::EndpointSlice | Kind::Event | Kind::EventsV1
        )
    }

    /// The storage directory under the prefix, as kube-apiserver names it.
    fn key_dir(self) -> &'static str {
        match self {
            Kind::Service => "services/specs",
            Kind::Endpoints => "services/endpoints",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "minions",
            Kind::Namespace => "namespaces",
            Kind::ServiceCidr => "servicecidrs",
            Kind::Role => "roles",
            Kind::ClusterRole => "clusterroles",
            Kind::RoleBinding => "rolebindings",
            Kind::ClusterRoleBinding => "clusterrolebindings",
            Kind::IpAddress => "ipaddresses",
            // Both forms of Event are one resource in storage, as in kube-apiserver.
            Kind::Event | Kind::EventsV1 => "events",
        }
    }

    /// The kind whose form objects of this kind are stored in: core/v1 for both Events.
    pub fn stored_as(self) -> Kind {
        match self {
            Kind::EventsV1 => Kind::Event,
            other => other,
        }
    }

    /// The storage key of one object.
    pub fn key(self, prefix: &str, namespace: Option<&str>, name: &str) -> String {
        match namespace {
            Some(ns) if self.namespaced() => format!("{prefix}/{}/{ns}/{name}", self.key_dir()),
            _ => format!("{prefix}/{}/{name}", self.key_dir()),
        }
    }

    /// The key prefix of a list, within one namespace or across all.
    pub fn list_prefix(self, prefix: &str, namespace: Option<&str>) -> String {
        match namespace {
            Some(ns) if self.namespaced() => format!("{prefix}/{}/{ns}/", self.key_dir()),
            _ => format!("{prefix}/{}/", self.key_dir()),
        }
    }

    /// The subject of error messages about this resource.
    pub fn subject(self) -> Subject {
        Subject {
            group: self.group(),
            resource: self.resource(),
            kind: self.kind(),
        }
    }

    /// The resource served at `group`/`version`/`resource`.
    pub fn from_path(group: &str, version: &str, resource: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.group() == group && k.version() == version && k.resource() == resource)
    }

    /// kubectl categories (`kubectl get all`).
    pub fn categories(self) -> &'static [&'static str] {
        match self {
            Kind::Service => &["all"],
            _ => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_laid_out_as_kube_apiserver_lays_them_out() {
        assert_eq!(
            Kind::Service.key("/registry", Some("default"), "web"),
            "/registry/services/specs/default/web"
        );
        assert_eq!(
            Kind::Endpoints.key("/registry", Some("default"), "web"),
            "/registry/services/endpoints/default/web"
        );
        assert_eq!(
            Kind::EndpointSlice.key("/registry", Some("ns"), "web-abc"),
            "/registry/endpointslices/ns/web-abc"
        );
        assert_eq!(
            Kind::Node.key("/registry", None, "n1"),
            "/registry/minions/n1"
        );
        assert_eq!(
            Kind::Namespace.key("/registry", None, "default"),
            "/registry/namespaces/default"
        );
        assert_eq!(
            Kind::ServiceCidr.key("/registry", None, "kubernetes"),
            "/registry/servicecidrs/kubernetes"
        );
    }

    #[test]
    fn both_forms_of_event_share_kube_apiservers_event_keys() {
        for kind in [Kind::Event, Kind::EventsV1] {
            assert_eq!(
                kind.key("/registry", Some("default"), "web.1"),
                "/registry/events/default/web.1"
            );
            assert_eq!(kind.stored_as(), Kind::Event);
        }
        assert_eq!(Kind::EventsV1.api_version(), "events.k8s.io/v1");
        assert_eq!(
            Kind::from_path("events.k8s.io", "v1", "events"),
            Some(Kind::EventsV1)
        );
        assert_eq!(Kind::from_path("", "v1", "events"), Some(Kind::Event));
    }
}
