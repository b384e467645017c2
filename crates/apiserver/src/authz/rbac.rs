//! kube's RBAC rule matching (`plugin/pkg/auth/authorizer/rbac/rbac.go`), the in-memory policy
//! it runs against, and the coverage check of escalation prevention
//! (`pkg/registry/rbac/validation/policy_comparator.go`).
//!
//! The policy is an index of the four RBAC kinds kept up to date by [`super::cache`]: a request
//! is allowed when one rule of one role bound to the user allows it. ClusterRoleBindings apply
//! everywhere; a RoleBinding only in its namespace; non-resource URLs and cluster-scoped
//! resources only through ClusterRoleBindings (their namespace is `""`), as in kube.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::rbac::v1::{PolicyRule, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::{Attributes, UserInfo};

/// `*`: every verb, group, resource or URL.
const ALL: &str = "*";

/// One `PolicyRule`, with absent lists as empty ones.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rule {
    /// `verbs`.
    pub verbs: Vec<String>,
    /// `apiGroups`.
    pub api_groups: Vec<String>,
    /// `resources`, subresources as `services/status`.
    pub resources: Vec<String>,
    /// `resourceNames`: empty allows every name.
    pub resource_names: Vec<String>,
    /// `nonResourceURLs`.
    pub non_resource_urls: Vec<String>,
}

impl From<&PolicyRule> for Rule {
    fn from(r: &PolicyRule) -> Self {
        Rule {
            verbs: r.verbs.clone(),
            api_groups: r.api_groups.clone().unwrap_or_default(),
            resources: r.resources.clone().unwrap_or_default(),
            resource_names: r.resource_names.clone().unwrap_or_default(),
            non_resource_urls: r.non_resource_urls.clone().unwrap_or_default(),
        }
    }
}

impl Rule {
    /// The rule as a `PolicyRule` (empty lists left out).
    pub fn to_policy_rule(&self) -> PolicyRule {
        let opt = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
        PolicyRule {
            verbs: self.verbs.clone(),
            api_groups: opt(&self.api_groups),
            resources: opt(&self.resources),
            resource_names: opt(&self.resource_names),
            non_resource_urls: opt(&self.non_resource_urls),
        }
    }

    fn verb_matches(&self, verb: &str) -> bool {
        self.verbs.iter().any(|v| v == ALL || v == verb)
    }

    fn group_matches(&self, group: &str) -> bool {
        self.api_groups.iter().any(|g| g == ALL || g == group)
    }

    /// `ResourceMatches`: `*`, the exact `resource/subresource`, or `*/subresource`.
    fn resource_matches(&self, resource: &str, subresource: &str) -> bool {
        self.resources.iter().any(|r| {
            if r == ALL {
                return true;
            }
            let exact = if subresource.is_empty() {
                r == resource
            } else {
                r.len() == resource.len() + 1 + subresource.len()
                    && r.starts_with(resource)
                    && r.as_bytes()[resource.len()] == b'/'
                    && r.ends_with(subresource)
            };
            exact
                || (!subresource.is_empty()
                    && r.len() == subresource.len() + 2
                    && r.starts_with("*/")
                    && r.ends_with(subresource))
        })
    }

    fn name_matches(&self, name: &str) -> bool {
        self.resource_names.is_empty() || self.resource_names.iter().any(|n| n == name)
    }

    /// `NonResourceURLMatches`: `*`, the exact path, or a prefix ending in `*`.
    fn url_matches(&self, path: &str) -> bool {
        self.non_resource_urls.iter().any(|u| {
            u == ALL
                || u == path
                || u.strip_suffix('*')
                    .is_some_and(|prefix| path.starts_with(prefix))
        })
    }

    /// `RuleAllows`: whether this rule allows the request.
    pub fn allows(&self, a: &Attributes) -> bool {
        if a.resource_request {
            self.verb_matches(&a.verb)
                && self.group_matches(&a.api_group)
                && self.resource_matches(&a.resource, &a.subresource)
                && self.name_matches(&a.name)
        } else {
            self.verb_matches(&a.verb) && self.url_matches(&a.path)
        }
    }

    /// kube's `CompactString`: `{APIGroups:[""], Resources:["services"], Verbs:["create"]}`.
    pub fn compact_string(&self) -> String {
        let q = |v: &[String]| {
            let parts: Vec<String> = v.iter().map(|s| format!("{s:?}")).collect();
            format!("[{}]", parts.join(" "))
        };
        let mut parts = Vec::new();
        if !self.api_groups.is_empty() {
            parts.push(format!("APIGroups:{}", q(&self.api_groups)));
        }
        if !self.resources.is_empty() {
            parts.push(format!("Resources:{}", q(&self.resources)));
        }
        if !self.non_resource_urls.is_empty() {
            parts.push(format!("NonResourceURLs:{}", q(&self.non_resource_urls)));
        }
        if !self.resource_names.is_empty() {
            parts.push(format!("ResourceNames:{}", q(&self.resource_names)));
        }
        if !self.verbs.is_empty() {
            parts.push(format!("Verbs:{}", q(&self.verbs)));
        }
        format!("{{{}}}", parts.join(", "))
    }

    /// kube's `BreakdownRule`: one rule per group × resource × verb (× name), or per URL × verb.
    pub fn breakdown(&self) -> Vec<Rule> {
        let mut out = Vec::new();
        for group in &self.api_groups {
            for resource in &self.resources {
                for verb in &self.verbs {
                    let one = |names: Vec<String>| Rule {
                        verbs: vec![verb.clone()],
                        api_groups: vec![group.clone()],
                        resources: vec![resource.clone()],
                        resource_names: names,
                        non_resource_urls: Vec::new(),
                    };
                    if self.resource_names.is_empty() {
                        out.push(one(Vec::new()));
                    } else {
                        for name in &self.resource_names {
                            out.push(one(vec![name.clone()]));
                        }
                    }
                }
            }
        }
        for url in &self.non_resource_urls {
            for verb in &self.verbs {
                out.push(Rule {
                    verbs: vec![verb.clone()],
                    non_resource_urls: vec![url.clone()],
                    ..Rule::default()
                });
            }
        }
        out
    }

    /// kube's `ruleCovers`: whether this (owner) rule grants everything `servant` grants.
    pub fn covers(&self, servant: &Rule) -> bool {
        let has_all = |v: &[String], s: &String| v.iter().any(|x| x == ALL || x == s);
        let verbs = servant.verbs.iter().all(|v| has_all(&self.verbs, v));
        let groups = servant
            .api_groups
            .iter()
            .all(|g| has_all(&self.api_groups, g));
        let resources = servant.resources.iter().all(|r| {
            self.resources.iter().any(|o| {
                if o == ALL || o == r {
                    return true;
                }
                // `services/*` covers `services/status`; `*/status` covers `services/status`.
                match (o.split_once('/'), r.split_once('/')) {
                    (Some((ob, "*")), Some((rb, _))) => ob == rb,
                    (Some(("*", os)), Some((_, rs))) => os == rs,
                    _ => false,
                }
            })
        });
        let urls = servant.non_resource_urls.iter().all(|u| {
            self.non_resource_urls.iter().any(|o| {
                o == ALL
                    || o == u
                    || o.strip_suffix('*')
                        .is_some_and(|prefix| u.starts_with(prefix))
            })
        });
        let names = self.resource_names.is_empty()
            || (!servant.resource_names.is_empty()
                && servant
                    .resource_names
                    .iter()
                    .all(|n| self.resource_names.contains(n)));
        verbs && groups && resources && urls && names
    }
}

/// Which kind of role a binding names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoleKind {
    /// A Role in the binding's namespace.
    Role,
    /// A ClusterRole.
    ClusterRole,
}

/// A RoleBinding or ClusterRoleBinding, as the authorizer needs it.
#[derive(Debug, Clone)]
pub struct Binding {
    /// `metadata.name`.
    pub name: String,
    /// `roleRef.kind`.
    pub role_kind: RoleKind,
    /// `roleRef.name`.
    pub role_name: String,
    /// `subjects`.
    pub subjects: Vec<Subject>,
}

/// A ClusterRole, as the authorizer and the aggregation need it.
#[derive(Debug, Clone, Default)]
pub struct ClusterRoleEntry {
    /// `rules`.
    pub rules: Arc<[Rule]>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `aggregationRule.clusterRoleSelectors`, if the role aggregates others.
    pub aggregation: Option<Vec<LabelSelector>>,
}

/// The RBAC objects, indexed for authorization.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// Roles by namespace, then name.
    pub roles: HashMap<String, HashMap<String, Arc<[Rule]>>>,
    /// ClusterRoles by name.
    pub cluster_roles: HashMap<String, ClusterRoleEntry>,
    /// RoleBindings by namespace, then name.
    pub role_bindings: HashMap<String, BTreeMap<String, Binding>>,
    /// ClusterRoleBindings by name.
    pub cluster_role_bindings: BTreeMap<String, Binding>,
}

/// The user name of a service account (`system:serviceaccount:<ns>:<name>`).
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// `appliesToUser`: whether a binding subject names the user (`namespace` is the binding's, the
/// default for a ServiceAccount subject of a RoleBinding).
fn applies_to(subject: &Subject, user: &UserInfo, namespace: &str) -> bool {
    match subject.kind.as_str() {
        "User" => user.name == subject.name,
        "Group" => user.groups.contains(&subject.name),
        "ServiceAccount" => {
            let ns = subject
                .namespace
                .as_deref()
                .filter(|n| !n.is_empty())
                .unwrap_or(namespace);
            !ns.is_empty() && user.name == service_account_user(ns, &subject.name)
        }
        _ => false,
    }
}

impl Policy {
    /// The rules of the role a binding in `namespace` (`""` for a ClusterRoleBinding) names, or
    /// kube's lister error when it does not exist.
    fn role_rules(&self, binding: &Binding, namespace: &str) -> Result<&[Rule], String> {
        match binding.role_kind {
            RoleKind::ClusterRole => self
                .cluster_roles
                .get(&binding.role_name)
                .map(|r| &r.rules[..])
                .ok_or_else(|| {
                    format!(
                        "clusterrole.rbac.authorization.k8s.io {:?} not found",
                        binding.role_name
                    )
                }),
            RoleKind::Role => self
                .roles
                .get(namespace)
                .and_then(|roles| roles.get(&binding.role_name))
                .map(|r| &r[..])
                .ok_or_else(|| {
                    format!(
                        "role.rbac.authorization.k8s.io {:?} not found",
                        binding.role_name
                    )
                }),
        }
    }

    /// `VisitRulesFor`: calls `visit` with every rule that applies to `user` in `namespace`
    /// (ClusterRoleBindings, then the namespace's RoleBindings) until it returns `true`. Returns
    /// whether it did, and the errors met on the way (bindings naming missing roles).
    pub fn visit_rules(
        &self,
        user: &UserInfo,
        namespace: &str,
        mut visit: impl FnMut(&Rule) -> bool,
    ) -> (bool, Vec<String>) {
        let mut errors = Vec::new();
        for binding in self.cluster_role_bindings.values() {
            if !binding.subjects.iter().any(|s| applies_to(s, user, "")) {
                continue;
            }
            match self.role_rules(binding, "") {
                Ok(rules) => {
                    if rules.iter().any(&mut visit) {
                        return (true, errors);
                    }
                }
                Err(e) => errors.push(e),
            }
        }
        if namespace.is_empty() {
            return (false, errors);
        }
        if let Some(bindings) = self.role_bindings.get(namespace) {
            for binding in bindings.values() {
                if !binding
                    .subjects
                    .iter()
                    .any(|s| applies_to(s, user, namespace))
                {
                    continue;
                }
                match self.role_rules(binding, namespace) {
                    Ok(rules) => {
                        if rules.iter().any(&mut visit) {
                            return (true, errors);
                        }
                    }
                    Err(e) => errors.push(e),
                }
            }
        }
        (false, errors)
    }

    /// Every rule that applies to `user` in `namespace` (`RulesFor`), for escalation checks and
    /// SelfSubjectRulesReview.
    pub fn rules_for(&self, user: &UserInfo, namespace: &str) -> (Vec<Rule>, Vec<String>) {
        let mut rules = Vec::new();
        let (_, errors) = self.visit_rules(user, namespace, |r| {
            rules.push(r.clone());
            false
        });
        (rules, errors)
    }

    /// The RBAC decision: whether a rule allows the request, and kube's reason when none does
    /// (`RBAC: <errors>` if bindings name missing roles, else empty).
    pub fn authorize(&self, a: &Attributes) -> (bool, String) {
        let (allowed, errors) = self.visit_rules(&a.user, &a.namespace, |r| r.allows(a));
        if allowed {
            return (true, String::new());
        }
        let reason = match errors.as_slice() {
            [] => String::new(),
            [one] => format!("RBAC: {one}"),
            many => format!("RBAC: [{}]", many.join(", ")),
        };
        (false, reason)
    }

    /// The rules an aggregated ClusterRole gets: every rule of the ClusterRoles its selectors
    /// match (itself excluded), without duplicates, in name order (kube's aggregation
    /// controller). `None` for a role without `aggregationRule`.
    pub fn aggregated_rules(&self, name: &str) -> Option<Vec<Rule>> {
        let selectors = self.cluster_roles.get(name)?.aggregation.as_ref()?;
        let mut names: Vec<&String> = self.cluster_roles.keys().collect();
        names.sort();
        let mut rules: Vec<Rule> = Vec::new();
        for other in names {
            if other == name {
                continue;
            }
            let entry = &self.cluster_roles[other];
            if selectors.iter().any(|s| selector_matches(s, &entry.labels)) {
                for rule in entry.rules.iter() {
                    if !rules.contains(rule) {
                        rules.push(rule.clone());
                    }
                }
            }
        }
        Some(rules)
    }
}

/// Whether a `metav1.LabelSelector` matches `labels` (an empty selector matches nothing in an
/// aggregation rule, as kube skips it).
pub fn selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let match_labels = selector.match_labels.as_ref();
    let expressions = selector.match_expressions.as_deref().unwrap_or(&[]);
    if match_labels.is_none_or(|m| m.is_empty()) && expressions.is_empty() {
        return false;
    }
    if let Some(m) = match_labels
        && !m.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return false;
    }
    expressions.iter().all(|e| {
        let values = e.values.as_deref().unwrap_or(&[]);
        match e.operator.as_str() {
            "In" => labels.get(&e.key).is_some_and(|v| values.contains(v)),
            "NotIn" => labels.get(&e.key).is_none_or(|v| !values.contains(v)),
            "Exists" => labels.contains_key(&e.key),
            "DoesNotExist" => !labels.contains_key(&e.key),
            _ => false,
        }
    })
}

/// kube's `Covers`: the rules of `servant` that no rule of `owner` covers, broken down.
pub fn uncovered(owner: &[Rule], servant: &[Rule]) -> Vec<Rule> {
    servant
        .iter()
        .flat_map(Rule::breakdown)
        .filter(|s| !owner.iter().any(|o| o.covers(s)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(verbs: &[&str], groups: &[&str], resources: &[&str]) -> Rule {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect();
        Rule {
            verbs: v(verbs),
            api_groups: v(groups),
            resources: v(resources),
            ..Rule::default()
        }
    }

    fn attrs(verb: &str, group: &str, resource: &str, sub: &str, name: &str) -> Attributes {
        Attributes {
            user: UserInfo::default(),
            verb: verb.into(),
            resource_request: true,
            path: String::new(),
            namespace: "default".into(),
            api_group: group.into(),
            api_version: "v1".into(),
            resource: resource.into(),
            subresource: sub.into(),
            name: name.into(),
        }
    }

    #[test]
    fn subresources_match_exactly_or_through_a_star_prefix_as_kube_rbac_go() {
        let status = rule(&["get"], &[""], &["services/status"]);
        assert!(status.allows(&attrs("get", "", "services", "status", "web")));
        assert!(!status.allows(&attrs("get", "", "services", "", "web")));
        let any_status = rule(&["get"], &[""], &["*/status"]);
        assert!(any_status.allows(&attrs("get", "", "nodes", "status", "n1")));
        assert!(!any_status.allows(&attrs("get", "", "nodes", "", "n1")));
        let plain = rule(&["get"], &[""], &["services"]);
        assert!(!plain.allows(&attrs("get", "", "services", "status", "web")));
    }

    #[test]
    fn resource_names_restrict_a_rule_and_never_match_a_nameless_request() {
        let mut r = rule(&["get", "list"], &[""], &["services"]);
        r.resource_names = vec!["web".into()];
        assert!(r.allows(&attrs("get", "", "services", "", "web")));
        assert!(!r.allows(&attrs("get", "", "services", "", "db")));
        assert!(!r.allows(&attrs("list", "", "services", "", "")));
    }

    #[test]
    fn non_resource_urls_match_exactly_or_by_a_trailing_star() {
        let r = Rule {
            verbs: vec!["get".into()],
            non_resource_urls: vec!["/healthz".into(), "/apis/*".into()],
            ..Rule::default()
        };
        let mut a = attrs("get", "", "", "", "");
        a.resource_request = false;
        for (path, allowed) in [
            ("/healthz", true),
            ("/healthz/etcd", false),
            ("/apis/rbac.authorization.k8s.io", true),
            ("/api", false),
        ] {
            a.path = path.into();
            assert_eq!(r.allows(&a), allowed, "{path}");
        }
    }

    #[test]
    fn the_compact_string_is_kubes() {
        assert_eq!(
            rule(&["create"], &[""], &["services"]).compact_string(),
            r#"{APIGroups:[""], Resources:["services"], Verbs:["create"]}"#
        );
    }

    #[test]
    fn a_star_rule_covers_everything_and_a_narrow_one_does_not() {
        let all = rule(&["*"], &["*"], &["*"]);
        let want = rule(
            &["create", "get"],
            &["", "apps"],
            &["services", "services/status"],
        );
        assert!(uncovered(std::slice::from_ref(&all), std::slice::from_ref(&want)).is_empty());
        let narrow = rule(&["get"], &[""], &["services/*"]);
        let missing = uncovered(&[narrow], &[want]);
        assert_eq!(missing.len(), 7, "{missing:?}");
    }
}
