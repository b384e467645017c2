//! Authorization as kube-apiserver does it: who the request is from (authentication, then
//! impersonation), what it asks for (kube's `RequestInfo`: verb, API group, resource,
//! subresource, namespace, name, or a non-resource path), and whether the authorizers of
//! `--authorization-mode` (`AlwaysAllow`, `RBAC`, in order) allow it.
//!
//! - Identities: a plain-HTTP request (served on loopback only) without a token is the local
//!   administrator, in `system:masters` as kube-apiserver's own loopback client (so is every
//!   request to a server without `--token-auth-file`, which authenticates no one); a bearer token
//!   of `--token-auth-file` is its user, with `system:authenticated` added; over TLS a request
//!   without a token is `system:anonymous` in `system:unauthenticated` when `--anonymous-auth`
//!   is on (kube turns it off under `AlwaysAllow`, which would otherwise let anyone do anything),
//!   and a 401 otherwise; a wrong token is a 401. The health endpoints answer in both cases,
//!   as they did before authorization existed.
//! - `system:masters` is allowed everything before any authorizer is asked, as kube's
//!   privileged-group authorizer.
//! - Denials answer kube's 403 (`responsewriters.Forbidden`), see [`forbidden`].
//! - Impersonation (`Impersonate-User`, `Impersonate-Group`, `Impersonate-Uid`) is authorized by
//!   the `impersonate` verb on `users`, `groups`, `serviceaccounts` and `uids`, see
//!   [`impersonate`].

pub mod bootstrap;
pub mod cache;
pub mod discovery;
pub mod escalation;
pub mod rbac;
pub mod review;
pub mod validation;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, header};

use crate::auth::TokenSource;
use crate::error::ApiError;

/// The group whose members may do everything (`user.SystemPrivilegedGroup`).
pub const SYSTEM_MASTERS: &str = "system:masters";
/// The group every authenticated user is in.
pub const AUTHENTICATED: &str = "system:authenticated";
/// The group of anonymous requests.
pub const UNAUTHENTICATED: &str = "system:unauthenticated";
/// The user name of anonymous requests.
pub const ANONYMOUS: &str = "system:anonymous";
/// The name of the local administrator (plain HTTP on loopback without a token; `up`'s in-process
/// proxy unless `--proxy-token-file` gives it a token).
pub const LOCAL_ADMIN: &str = "system:apiserver";

/// Who a request is from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UserInfo {
    /// The user name.
    pub name: String,
    /// The UID.
    pub uid: String,
    /// The groups, the implied `system:authenticated`/`system:unauthenticated` included.
    pub groups: Vec<String>,
}

impl UserInfo {
    /// The local administrator: kube-apiserver's loopback identity (`system:apiserver` in
    /// `system:masters`).
    pub fn local_admin() -> Self {
        UserInfo {
            name: LOCAL_ADMIN.into(),
            uid: String::new(),
            groups: vec![SYSTEM_MASTERS.into(), AUTHENTICATED.into()],
        }
    }

    /// `system:anonymous` in `system:unauthenticated`.
    pub fn anonymous() -> Self {
        UserInfo {
            name: ANONYMOUS.into(),
            uid: String::new(),
            groups: vec![UNAUTHENTICATED.into()],
        }
    }

    /// The user of a token, with `system:authenticated` added (kube's `AuthenticatedGroupAdder`).
    pub fn authenticated(user: &crate::auth::User) -> Self {
        let mut groups = user.groups.clone();
        if !groups.iter().any(|g| g == AUTHENTICATED) {
            groups.push(AUTHENTICATED.into());
        }
        UserInfo {
            name: user.name.clone(),
            uid: user.uid.clone(),
            groups,
        }
    }

    /// Whether the user is in `system:masters`.
    pub fn is_superuser(&self) -> bool {
        self.groups.iter().any(|g| g == SYSTEM_MASTERS)
    }
}

/// An authorization mode of `--authorization-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Everything is allowed.
    AlwaysAllow,
    /// Role-based access control.
    Rbac,
}

/// Why `--authorization-mode` is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ModeError {
    /// A mode this server does not know (kube-apiserver's message).
    #[error("authorization-mode {0:?} is not a valid mode")]
    Unknown(String),
    /// A mode given twice.
    #[error("authorization-mode {0:?} has mode specified more than once")]
    Duplicate(String),
    /// No mode at all.
    #[error("at least one authorization-mode must be passed")]
    Empty,
}

impl Mode {
    /// Parses kube-apiserver's comma-separated list (`AlwaysAllow,RBAC`).
    pub fn parse_list(text: &str) -> Result<Vec<Mode>, ModeError> {
        let mut modes = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let mode = match part {
                "AlwaysAllow" => Mode::AlwaysAllow,
                "RBAC" => Mode::Rbac,
                other => return Err(ModeError::Unknown(other.to_owned())),
            };
            if modes.contains(&mode) {
                return Err(ModeError::Duplicate(part.to_owned()));
            }
            modes.push(mode);
        }
        if modes.is_empty() {
            return Err(ModeError::Empty);
        }
        Ok(modes)
    }

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Mode::AlwaysAllow => "AlwaysAllow",
            Mode::Rbac => "RBAC",
        }
    }
}

/// What a request asks for (kube's `authorizer.Attributes` from its `RequestInfo`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Attributes {
    /// Who asks.
    pub user: UserInfo,
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`, or for
    /// a non-resource request the lower-case HTTP method.
    pub verb: String,
    /// Whether the path names a resource (`/api/v1/...`, `/apis/<group>/<version>/...`).
    pub resource_request: bool,
    /// The URL path.
    pub path: String,
    /// The namespace (`""` for cluster scope; a namespace's own name for `namespaces/<name>`).
    pub namespace: String,
    /// The API group (`""` for core).
    pub api_group: String,
    /// The API version.
    pub api_version: String,
    /// The resource (`services`).
    pub resource: String,
    /// The subresource (`status`).
    pub subresource: String,
    /// The object's name, if the request names one.
    pub name: String,
}

/// The `metadata.name` an exact field selector requires (`metadata.name=x` or `==x`).
fn field_selector_name(selector: &str) -> Option<&str> {
    selector.split(',').find_map(|term| {
        let term = term.trim();
        term.strip_prefix("metadata.name==")
            .or_else(|| term.strip_prefix("metadata.name="))
    })
}

impl Attributes {
    /// kube's `RequestInfoFactory.NewRequestInfo` for `method path?query`.
    pub fn of_request(user: UserInfo, method: &Method, path: &str, query: Option<&str>) -> Self {
        let mut a = Attributes {
            user,
            verb: method.as_str().to_ascii_lowercase(),
            path: path.to_owned(),
            ..Attributes::default()
        };
        let trimmed = path.trim_matches('/');
        let parts: Vec<&str> = if trimmed.is_empty() {
            Vec::new()
        } else {
            trimmed.split('/').collect()
        };
        if parts.len() < 3 {
            return a;
        }
        let mut rest: &[&str] = match parts[0] {
            "api" => &parts[1..],
            "apis" if parts.len() >= 4 => {
                a.api_group = parts[1].to_owned();
                &parts[2..]
            }
            _ => return a,
        };
        a.resource_request = true;
        a.api_version = rest[0].to_owned();
        rest = &rest[1..];
        let mut by_method = true;
        if matches!(rest[0], "watch" | "proxy") && rest.len() >= 2 {
            a.verb = rest[0].to_owned();
            rest = &rest[1..];
            by_method = false;
        } else {
            a.verb = match *method {
                Method::POST => "create",
                Method::GET | Method::HEAD => "get",
                Method::PUT => "update",
                Method::PATCH => "patch",
                Method::DELETE => "delete",
                _ => "",
            }
            .to_owned();
        }
        if rest[0] == "namespaces" && rest.len() > 1 {
            a.namespace = rest[1].to_owned();
            if rest.len() > 2 && !matches!(rest[2], "status" | "finalize") {
                rest = &rest[2..];
            }
        }
        a.resource = rest[0].to_owned();
        if rest.len() >= 2 {
            a.name = rest[1].to_owned();
        }
        if rest.len() >= 3 && a.verb != "proxy" {
            a.subresource = rest[2].to_owned();
        }
        let params: Vec<(String, String)> = query
            .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
            .unwrap_or_default();
        let param = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v);
        if a.name.is_empty() && a.verb == "get" && by_method {
            let watch = param("watch").is_some_and(|w| matches!(w.as_str(), "true" | "1"));
            a.verb = if watch { "watch" } else { "list" }.to_owned();
        }
        if a.name.is_empty()
            && matches!(a.verb.as_str(), "list" | "watch")
            && let Some(name) = param("fieldSelector").and_then(|s| field_selector_name(s))
            && !name.is_empty()
            && !name.contains('/')
        {
            a.name = name.to_owned();
        }
        if a.name.is_empty() && a.verb == "delete" {
            a.verb = "deletecollection".to_owned();
        }
        a
    }

    /// Attributes of a resource check (impersonation, `escalate`, `bind`, access reviews).
    pub fn resource(
        user: UserInfo,
        verb: &str,
        group: &str,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Self {
        let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
        Attributes {
            user,
            verb: verb.to_owned(),
            resource_request: true,
            namespace: namespace.to_owned(),
            api_group: group.to_owned(),
            api_version: "*".to_owned(),
            resource: resource.to_owned(),
            subresource: subresource.to_owned(),
            name: name.to_owned(),
            path: String::new(),
        }
    }
}

/// The authorizers of `--authorization-mode`, over the RBAC policy cache.
#[derive(Clone)]
pub struct Authorizer {
    modes: Arc<[Mode]>,
    policy: cache::PolicyCache,
}

/// An authorization decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request is allowed.
    pub allowed: bool,
    /// Why not, as the authorizers said it (may be empty).
    pub reason: String,
}

impl Authorizer {
    /// The authorizers of `modes`, in order.
    pub fn new(modes: Vec<Mode>, policy: cache::PolicyCache) -> Self {
        Authorizer {
            modes: modes.into(),
            policy,
        }
    }

    /// The modes, in order.
    pub fn modes(&self) -> &[Mode] {
        &self.modes
    }

    /// The RBAC policy cache.
    pub fn policy(&self) -> &cache::PolicyCache {
        &self.policy
    }

    /// Whether anonymous requests may be admitted at all: kube-apiserver turns
    /// `--anonymous-auth` off when `AlwaysAllow` is among the modes.
    pub fn admits_anonymous(&self) -> bool {
        !self.modes.contains(&Mode::AlwaysAllow)
    }

    /// Asks the authorizers in order (the privileged group first); the first that allows wins.
    pub fn authorize(&self, a: &Attributes) -> Decision {
        if a.user.is_superuser() {
            return Decision {
                allowed: true,
                reason: String::new(),
            };
        }
        let mut reasons = Vec::new();
        for mode in self.modes.iter() {
            match mode {
                Mode::AlwaysAllow => {
                    return Decision {
                        allowed: true,
                        reason: String::new(),
                    };
                }
                Mode::Rbac => {
                    let (allowed, reason) = self.policy.read(|p| p.authorize(a));
                    if allowed {
                        return Decision {
                            allowed,
                            reason: String::new(),
                        };
                    }
                    if !reason.is_empty() {
                        reasons.push(reason);
                    }
                }
            }
        }
        Decision {
            allowed: false,
            reason: reasons.join("\n"),
        }
    }
}

/// kube's `forbiddenMessage`: what the user may not do.
fn forbidden_message(a: &Attributes) -> String {
    let user = &a.user.name;
    if !a.resource_request {
        return format!("User {user:?} cannot {} path {:?}", a.verb, a.path);
    }
    let resource = if a.subresource.is_empty() {
        a.resource.clone()
    } else {
        format!("{}/{}", a.resource, a.subresource)
    };
    if a.namespace.is_empty() {
        format!(
            "User {user:?} cannot {} resource {resource:?} in API group {:?} at the cluster scope",
            a.verb, a.api_group
        )
    } else {
        format!(
            "User {user:?} cannot {} resource {resource:?} in API group {:?} in the namespace {:?}",
            a.verb, a.api_group, a.namespace
        )
    }
}

/// kube's 403 for a denied request (`responsewriters.Forbidden`, then `NewForbidden`):
/// `services is forbidden: User "x" cannot create resource "services" in API group "" in the
/// namespace "default"`, `services "web" is forbidden: ...` when a name is given, and
/// `forbidden: User "x" cannot get path "/metrics"` for a non-resource path; the authorizers'
/// reason follows after `: ` when there is one.
pub fn forbidden(a: &Attributes, reason: &str) -> ApiError {
    let mut why = forbidden_message(a);
    if !reason.is_empty() {
        why = format!("{why}: {reason}");
    }
    if a.resource_request {
        ApiError::forbidden_resource(&a.api_group, &a.resource, &a.name, &why)
    } else {
        ApiError::forbidden_resource("", "", "", &why)
    }
}

/// What the request gate needs: how to authenticate and whom to ask.
#[derive(Clone)]
pub struct Gate {
    /// Bearer tokens, if `--token-auth-file` is set.
    pub tokens: Option<Arc<TokenSource>>,
    /// Whether the listener is TLS (a plain-HTTP request without a token is the local admin).
    pub tls: bool,
    /// `--anonymous-auth`.
    pub anonymous_auth: bool,
    /// The authorizers.
    pub authorizer: Authorizer,
}

/// Paths anyone may read when anonymous requests are not admitted (kube's public health
/// checks; with anonymous requests, `system:public-info-viewer` grants them).
fn is_health(path: &str) -> bool {
    matches!(path, "/healthz" | "/livez" | "/readyz")
        || path.starts_with("/healthz/")
        || path.starts_with("/livez/")
        || path.starts_with("/readyz/")
}

/// The bearer token of a request, if it has one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

impl Gate {
    /// Authentication: the request's user, `Ok(None)` for a health check let through without
    /// one, or 401.
    fn authenticate(&self, headers: &HeaderMap, path: &str) -> Result<Option<UserInfo>, ApiError> {
        if let Some(token) = bearer(headers) {
            return match self.tokens.as_ref().and_then(|t| t.authenticate(token)) {
                Some(user) => Ok(Some(UserInfo::authenticated(&user))),
                None if self.tokens.is_none() && !self.tls => Ok(Some(UserInfo::local_admin())),
                // The health checks answer whatever the token, as before authorization existed.
                None if is_health(path) => Ok(None),
                None => Err(ApiError::unauthorized()),
            };
        }
        if !self.tls || self.tokens.is_none() {
            return Ok(Some(UserInfo::local_admin()));
        }
        if self.anonymous_auth && self.authorizer.admits_anonymous() {
            return Ok(Some(UserInfo::anonymous()));
        }
        if is_health(path) {
            return Ok(None);
        }
        Err(ApiError::unauthorized())
    }
}

/// Impersonation as kube's `WithImpersonation` filter: with `Impersonate-User` (and optionally
/// `Impersonate-Group`, `Impersonate-Uid`), the requester needs `impersonate` on `users` (or
/// `serviceaccounts` for `system:serviceaccount:<ns>:<name>`), on `groups` for each group and on
/// `uids` (`authentication.k8s.io`); the request then runs as that user, in the groups given
/// plus `system:authenticated` (or, for a service account without groups, its groups).
pub fn impersonate(
    authorizer: &Authorizer,
    requester: UserInfo,
    headers: &HeaderMap,
) -> Result<UserInfo, ApiError> {
    let user = headers
        .get("impersonate-user")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let groups: Vec<String> = headers
        .get_all("impersonate-group")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_owned)
        .collect();
    let uid = headers
        .get("impersonate-uid")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let Some(name) = user else {
        if groups.is_empty() && uid.is_none() {
            return Ok(requester);
        }
        return Err(ApiError::internal(
            "requested impersonation without impersonating a user",
        ));
    };
    let check = |a: Attributes| -> Result<(), ApiError> {
        let decision = authorizer.authorize(&a);
        if decision.allowed {
            Ok(())
        } else {
            Err(forbidden(&a, &decision.reason))
        }
    };
    let service_account = name
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'));
    match service_account {
        Some((ns, sa)) => check(Attributes::resource(
            requester.clone(),
            "impersonate",
            "",
            "serviceaccounts",
            ns,
            sa,
        ))?,
        None => check(Attributes::resource(
            requester.clone(),
            "impersonate",
            "",
            "users",
            "",
            &name,
        ))?,
    }
    for group in &groups {
        check(Attributes::resource(
            requester.clone(),
            "impersonate",
            "",
            "groups",
            "",
            group,
        ))?;
    }
    if let Some(uid) = &uid {
        check(Attributes::resource(
            requester.clone(),
            "impersonate",
            "authentication.k8s.io",
            "uids",
            "",
            uid,
        ))?;
    }
    let mut all_groups = groups;
    if all_groups.is_empty()
        && let Some((ns, _)) = service_account
    {
        all_groups.push("system:serviceaccounts".into());
        all_groups.push(format!("system:serviceaccounts:{ns}"));
    }
    if name == ANONYMOUS {
        if !all_groups.iter().any(|g| g == UNAUTHENTICATED) {
            all_groups.push(UNAUTHENTICATED.into());
        }
    } else if !all_groups.iter().any(|g| g == AUTHENTICATED) {
        all_groups.push(AUTHENTICATED.into());
    }
    Ok(UserInfo {
        name,
        uid: uid.unwrap_or_default(),
        groups: all_groups,
    })
}

/// Middleware: authenticates, impersonates, authorizes, and keeps the user in the request's
/// extensions (for access reviews and escalation checks); after a write to an RBAC kind, waits
/// (briefly) until the policy cache has seen it, so that the next request is judged by it.
pub async fn gate(State(gate): State<Arc<Gate>>, mut request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let user = match gate.authenticate(request.headers(), &path) {
        Ok(Some(user)) => user,
        Ok(None) => return next.run(request).await,
        Err(err) => return err.into_response(),
    };
    let user = match impersonate(&gate.authorizer, user, request.headers()) {
        Ok(user) => user,
        Err(err) => return err.into_response(),
    };
    let attributes =
        Attributes::of_request(user.clone(), request.method(), &path, request.uri().query());
    let decision = gate.authorizer.authorize(&attributes);
    if !decision.allowed {
        tracing::debug!(user = %user.name, verb = %attributes.verb, path = %path, "forbidden");
        return forbidden(&attributes, &decision.reason).into_response();
    }
    request.extensions_mut().insert(user);
    request.extensions_mut().insert(gate.authorizer.clone());
    let rbac_write = attributes.resource_request
        && attributes.api_group == "rbac.authorization.k8s.io"
        && !matches!(attributes.verb.as_str(), "get" | "list" | "watch");
    let response = next.run(request).await;
    if rbac_write && response.status().is_success() {
        gate.authorizer
            .policy()
            .caught_up(&attributes.resource)
            .await;
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(method: Method, path: &str, query: Option<&str>) -> Attributes {
        Attributes::of_request(UserInfo::default(), &method, path, query)
    }

    #[test]
    fn request_attributes_follow_kubes_request_info() {
        let a = info(Method::GET, "/api/v1/namespaces/default/services", None);
        assert_eq!(
            (a.verb.as_str(), a.namespace.as_str(), a.resource.as_str()),
            ("list", "default", "services")
        );
        let a = info(Method::GET, "/api/v1/services", Some("watch=1"));
        assert_eq!((a.verb.as_str(), a.namespace.as_str()), ("watch", ""));
        let a = info(
            Method::PUT,
            "/api/v1/namespaces/default/services/web/status",
            None,
        );
        assert_eq!(
            (a.verb.as_str(), a.name.as_str(), a.subresource.as_str()),
            ("update", "web", "status")
        );
        let a = info(
            Method::DELETE,
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            None,
        );
        assert_eq!(
            (a.verb.as_str(), a.api_group.as_str()),
            ("deletecollection", "rbac.authorization.k8s.io")
        );
        // A namespace is its own namespace, as in kube (a RoleBinding there may grant it).
        let a = info(Method::GET, "/api/v1/namespaces/team-a", None);
        assert_eq!(
            (
                a.verb.as_str(),
                a.namespace.as_str(),
                a.resource.as_str(),
                a.name.as_str()
            ),
            ("get", "team-a", "namespaces", "team-a")
        );
        let a = info(
            Method::GET,
            "/api/v1/nodes",
            Some("fieldSelector=metadata.name%3Dn1&watch=true"),
        );
        assert_eq!((a.verb.as_str(), a.name.as_str()), ("watch", "n1"));
        let a = info(Method::GET, "/apis/discovery.k8s.io/v1", None);
        assert!(!a.resource_request);
        assert_eq!(a.verb, "get");
        let a = info(Method::POST, "/metrics", None);
        assert_eq!((a.resource_request, a.verb.as_str()), (false, "post"));
    }

    #[test]
    fn forbidden_messages_are_kubes_three_forms() {
        let mut a = info(Method::POST, "/api/v1/namespaces/default/services", None);
        a.user.name = "system:kube-proxy".into();
        let e = forbidden(&a, "");
        assert_eq!(e.code(), 403);
        assert_eq!(e.reason(), "Forbidden");
        assert_eq!(
            e.message(),
            r#"services is forbidden: User "system:kube-proxy" cannot create resource "services" in API group "" in the namespace "default""#
        );
        let mut a = info(Method::GET, "/api/v1/nodes/n1/status", None);
        a.user.name = "bob".into();
        assert_eq!(
            forbidden(&a, "").message(),
            r#"nodes "n1" is forbidden: User "bob" cannot get resource "nodes/status" in API group "" at the cluster scope"#
        );
        let mut a = info(Method::GET, "/metrics", None);
        a.user.name = "system:anonymous".into();
        assert_eq!(
            forbidden(&a, "").message(),
            r#"forbidden: User "system:anonymous" cannot get path "/metrics""#
        );
    }

    #[test]
    fn authorization_modes_parse_as_kube_apiservers_flag() {
        assert_eq!(
            Mode::parse_list("AlwaysAllow,RBAC").unwrap(),
            vec![Mode::AlwaysAllow, Mode::Rbac]
        );
        assert!(matches!(
            Mode::parse_list("RBAC,Node"),
            Err(ModeError::Unknown(m)) if m == "Node"
        ));
        assert!(matches!(
            Mode::parse_list("RBAC,RBAC"),
            Err(ModeError::Duplicate(_))
        ));
    }

    #[test]
    fn the_default_mode_is_always_allow_on_loopback_and_rbac_beyond_it_and_a_given_list_wins() {
        let on = |ip: &str, modes: Option<Vec<Mode>>| crate::Config {
            bind_address: ip.parse().unwrap(),
            authorization_modes: modes,
            ..crate::Config::default()
        };
        assert_eq!(
            on("127.0.0.1", None).effective_authorization_modes(),
            vec![Mode::AlwaysAllow]
        );
        assert_eq!(
            on("::1", None).effective_authorization_modes(),
            vec![Mode::AlwaysAllow]
        );
        assert_eq!(
            on("192.0.2.10", None).effective_authorization_modes(),
            vec![Mode::Rbac]
        );
        assert_eq!(
            on("0.0.0.0", None).effective_authorization_modes(),
            vec![Mode::Rbac]
        );
        assert_eq!(
            on("127.0.0.1", Some(vec![Mode::Rbac])).effective_authorization_modes(),
            vec![Mode::Rbac]
        );
    }
}
