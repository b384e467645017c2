//! The bootstrap policy, kube-apiserver's (`plugin/pkg/auth/authorizer/rbac/bootstrappolicy/
//! policy.go`, as `testdata/cluster-roles.yaml` and `cluster-role-bindings.yaml` list it for
//! kube 1.33), for the roles this server's clients need: `cluster-admin`, the aggregated
//! `admin`/`edit`/`view` with their `system:aggregate-to-*` parts, `system:discovery`,
//! `system:basic-user`, `system:public-info-viewer` and `system:node-proxier`, with kube's
//! ClusterRoleBindings for them.
//!
//! It is created on first start and reconciled on every start, as kube-apiserver's
//! `rbac/bootstrap-roles` post-start hook does (`pkg/registry/rbac/reconciliation`): a missing
//! object is created; an object annotated `rbac.authorization.kubernetes.io/autoupdate: "true"`
//! (or without the annotation) gets back missing rules, aggregation selectors, labels,
//! annotations and subjects, and keeps whatever users added; one annotated `"false"` is left
//! alone. A binding whose `roleRef` changed is deleted and created again, as kube does (a
//! `roleRef` cannot be updated).

use std::collections::BTreeMap;

use k8s_openapi::api::rbac::v1::{
    AggregationRule, ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use super::rbac::{Rule, uncovered};
use crate::error::ApiError;
use crate::registry::object::Object;
use crate::registry::{Preconditions, Registry, WriteOptions};
use crate::resource::Kind;

/// The annotation that lets reconciliation update a bootstrap object.
pub const AUTOUPDATE: &str = "rbac.authorization.kubernetes.io/autoupdate";
/// The label of bootstrap objects.
const BOOTSTRAPPING: (&str, &str) = ("kubernetes.io/bootstrapping", "rbac-defaults");
const RBAC_GROUP: &str = "rbac.authorization.k8s.io";
const AGGREGATE_TO_ADMIN: &str = "rbac.authorization.k8s.io/aggregate-to-admin";
const AGGREGATE_TO_EDIT: &str = "rbac.authorization.k8s.io/aggregate-to-edit";
const AGGREGATE_TO_VIEW: &str = "rbac.authorization.k8s.io/aggregate-to-view";

/// kube's `Read` verbs.
const READ: &[&str] = &["get", "list", "watch"];
/// kube's `ReadWrite` verbs.
const READ_WRITE: &[&str] = &[
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
];
/// kube's `Write` verbs.
const WRITE: &[&str] = &["create", "update", "patch", "delete", "deletecollection"];

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// `rbacv1helpers.NewRule(verbs...).Groups(groups...).Resources(resources...)`.
fn rule(verbs: &[&str], groups: &[&str], resources: &[&str]) -> PolicyRule {
    PolicyRule {
        verbs: strings(verbs),
        api_groups: Some(strings(groups)),
        resources: Some(strings(resources)),
        ..PolicyRule::default()
    }
}

/// `rbacv1helpers.NewRule(verbs...).URLs(urls...)`.
fn urls(verbs: &[&str], urls: &[&str]) -> PolicyRule {
    PolicyRule {
        verbs: strings(verbs),
        non_resource_urls: Some(strings(urls)),
        ..PolicyRule::default()
    }
}

/// kube's `eventsRule()`.
fn events_rule() -> PolicyRule {
    rule(
        &["create", "update", "patch"],
        &["", "events.k8s.io"],
        &["events"],
    )
}

fn meta(name: &str, extra_labels: &[(&str, &str)]) -> ObjectMeta {
    let mut labels = BTreeMap::from([(BOOTSTRAPPING.0.to_owned(), BOOTSTRAPPING.1.to_owned())]);
    for (k, v) in extra_labels {
        labels.insert((*k).to_owned(), (*v).to_owned());
    }
    ObjectMeta {
        name: Some(name.to_owned()),
        labels: Some(labels),
        annotations: Some(BTreeMap::from([(AUTOUPDATE.to_owned(), "true".to_owned())])),
        ..ObjectMeta::default()
    }
}

fn aggregated(name: &str, label: &str, extra_labels: &[(&str, &str)]) -> ClusterRole {
    ClusterRole {
        metadata: meta(name, extra_labels),
        aggregation_rule: Some(AggregationRule {
            cluster_role_selectors: Some(vec![LabelSelector {
                match_labels: Some(BTreeMap::from([(label.to_owned(), "true".to_owned())])),
                ..LabelSelector::default()
            }]),
        }),
        rules: None,
    }
}

fn plain(name: &str, extra_labels: &[(&str, &str)], rules: Vec<PolicyRule>) -> ClusterRole {
    ClusterRole {
        metadata: meta(name, extra_labels),
        aggregation_rule: None,
        rules: Some(rules),
    }
}

/// The bootstrap ClusterRoles.
pub fn cluster_roles() -> Vec<ClusterRole> {
    vec![
        plain(
            "cluster-admin",
            &[],
            vec![rule(&["*"], &["*"], &["*"]), urls(&["*"], &["*"])],
        ),
        aggregated("admin", AGGREGATE_TO_ADMIN, &[]),
        aggregated("edit", AGGREGATE_TO_EDIT, &[(AGGREGATE_TO_ADMIN, "true")]),
        aggregated("view", AGGREGATE_TO_VIEW, &[(AGGREGATE_TO_EDIT, "true")]),
        plain(
            "system:aggregate-to-admin",
            &[(AGGREGATE_TO_ADMIN, "true")],
            vec![
                rule(
                    &["create"],
                    &["authorization.k8s.io"],
                    &["localsubjectaccessreviews"],
                ),
                rule(READ_WRITE, &[RBAC_GROUP], &["roles", "rolebindings"]),
            ],
        ),
        plain(
            "system:aggregate-to-edit",
            &[(AGGREGATE_TO_EDIT, "true")],
            vec![
                rule(
                    READ,
                    &[""],
                    &[
                        "pods/attach",
                        "pods/proxy",
                        "pods/exec",
                        "pods/portforward",
                        "secrets",
                        "services/proxy",
                    ],
                ),
                rule(&["impersonate"], &[""], &["serviceaccounts"]),
                rule(
                    WRITE,
                    &[""],
                    &[
                        "pods",
                        "pods/attach",
                        "pods/proxy",
                        "pods/exec",
                        "pods/portforward",
                    ],
                ),
                rule(&["create"], &[""], &["pods/eviction"]),
                rule(
                    WRITE,
                    &[""],
                    &[
                        "replicationcontrollers",
                        "replicationcontrollers/scale",
                        "serviceaccounts",
                        "services",
                        "services/proxy",
                        "persistentvolumeclaims",
                        "configmaps",
                        "secrets",
                        "events",
                    ],
                ),
                rule(&["create"], &[""], &["serviceaccounts/token"]),
                rule(
                    WRITE,
                    &["apps"],
                    &[
                        "statefulsets",
                        "statefulsets/scale",
                        "daemonsets",
                        "deployments",
                        "deployments/scale",
                        "deployments/rollback",
                        "replicasets",
                        "replicasets/scale",
                    ],
                ),
                rule(WRITE, &["autoscaling"], &["horizontalpodautoscalers"]),
                rule(WRITE, &["batch"], &["jobs", "cronjobs"]),
                rule(
                    WRITE,
                    &["extensions"],
                    &[
                        "daemonsets",
                        "deployments",
                        "deployments/scale",
                        "deployments/rollback",
                        "ingresses",
                        "replicasets",
                        "replicasets/scale",
                        "replicationcontrollers/scale",
                        "networkpolicies",
                    ],
                ),
                rule(WRITE, &["policy"], &["poddisruptionbudgets"]),
                rule(
                    WRITE,
                    &["networking.k8s.io"],
                    &["ingresses", "networkpolicies"],
                ),
                rule(READ_WRITE, &["coordination.k8s.io"], &["leases"]),
            ],
        ),
        plain(
            "system:aggregate-to-view",
            &[(AGGREGATE_TO_VIEW, "true")],
            vec![
                rule(
                    READ,
                    &[""],
                    &[
                        "pods",
                        "replicationcontrollers",
                        "replicationcontrollers/scale",
                        "serviceaccounts",
                        "services",
                        "services/status",
                        "endpoints",
                        "persistentvolumeclaims",
                        "persistentvolumeclaims/status",
                        "configmaps",
                    ],
                ),
                rule(
                    READ,
                    &[""],
                    &[
                        "limitranges",
                        "resourcequotas",
                        "bindings",
                        "events",
                        "pods/status",
                        "resourcequotas/status",
                        "namespaces/status",
                        "replicationcontrollers/status",
                        "pods/log",
                    ],
                ),
                rule(READ, &[""], &["namespaces"]),
                rule(READ, &["discovery.k8s.io"], &["endpointslices"]),
                rule(
                    READ,
                    &["apps"],
                    &[
                        "controllerrevisions",
                        "statefulsets",
                        "statefulsets/status",
                        "statefulsets/scale",
                        "daemonsets",
                        "daemonsets/status",
                        "deployments",
                        "deployments/status",
                        "deployments/scale",
                        "replicasets",
                        "replicasets/status",
                        "replicasets/scale",
                    ],
                ),
                rule(
                    READ,
                    &["autoscaling"],
                    &[
                        "horizontalpodautoscalers",
                        "horizontalpodautoscalers/status",
                    ],
                ),
                rule(
                    READ,
                    &["batch"],
                    &["jobs", "cronjobs", "cronjobs/status", "jobs/status"],
                ),
                rule(
                    READ,
                    &["extensions"],
                    &[
                        "daemonsets",
                        "daemonsets/status",
                        "deployments",
                        "deployments/scale",
                        "deployments/status",
                        "ingresses",
                        "ingresses/status",
                        "replicasets",
                        "replicasets/scale",
                        "replicasets/status",
                        "replicationcontrollers/scale",
                        "networkpolicies",
                    ],
                ),
                rule(
                    READ,
                    &["policy"],
                    &["poddisruptionbudgets", "poddisruptionbudgets/status"],
                ),
                rule(
                    READ,
                    &["networking.k8s.io"],
                    &["ingresses", "ingresses/status", "networkpolicies"],
                ),
            ],
        ),
        plain(
            "system:discovery",
            &[],
            vec![urls(
                &["get"],
                &[
                    "/healthz",
                    "/livez",
                    "/readyz",
                    "/version",
                    "/version/",
                    "/api",
                    "/api/*",
                    "/apis",
                    "/apis/*",
                    "/openapi",
                    "/openapi/*",
                ],
            )],
        ),
        plain(
            "system:basic-user",
            &[],
            vec![
                rule(
                    &["create"],
                    &["authorization.k8s.io"],
                    &["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                ),
                rule(
                    &["create"],
                    &["authentication.k8s.io"],
                    &["selfsubjectreviews"],
                ),
            ],
        ),
        plain(
            "system:public-info-viewer",
            &[],
            vec![urls(
                &["get"],
                &["/healthz", "/livez", "/readyz", "/version", "/version/"],
            )],
        ),
        plain(
            "system:node-proxier",
            &[],
            vec![
                rule(&["list", "watch"], &[""], &["services", "endpoints"]),
                rule(&["get", "list", "watch"], &[""], &["nodes"]),
                events_rule(),
                rule(
                    &["list", "watch"],
                    &["discovery.k8s.io"],
                    &["endpointslices"],
                ),
                rule(
                    &["list", "watch"],
                    &["networking.k8s.io"],
                    &["servicecidrs"],
                ),
            ],
        ),
    ]
}

fn subject(kind: &str, name: &str) -> Subject {
    Subject {
        api_group: Some(RBAC_GROUP.to_owned()),
        kind: kind.to_owned(),
        name: name.to_owned(),
        namespace: None,
    }
}

fn cluster_binding(name: &str, role: &str, subjects: Vec<Subject>) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: meta(name, &[]),
        role_ref: RoleRef {
            api_group: RBAC_GROUP.to_owned(),
            kind: "ClusterRole".to_owned(),
            name: role.to_owned(),
        },
        subjects: Some(subjects),
    }
}

/// The bootstrap ClusterRoleBindings.
pub fn cluster_role_bindings() -> Vec<ClusterRoleBinding> {
    vec![
        cluster_binding(
            "cluster-admin",
            "cluster-admin",
            vec![subject("Group", super::SYSTEM_MASTERS)],
        ),
        cluster_binding(
            "system:discovery",
            "system:discovery",
            vec![subject("Group", super::AUTHENTICATED)],
        ),
        cluster_binding(
            "system:basic-user",
            "system:basic-user",
            vec![subject("Group", super::AUTHENTICATED)],
        ),
        cluster_binding(
            "system:public-info-viewer",
            "system:public-info-viewer",
            vec![
                subject("Group", super::AUTHENTICATED),
                subject("Group", super::UNAUTHENTICATED),
            ],
        ),
        cluster_binding(
            "system:node-proxier",
            "system:node-proxier",
            vec![subject("User", "system:kube-proxy")],
        ),
    ]
}

/// What reconciliation did to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It was missing and was created.
    Created,
    /// Missing rules, selectors, labels, annotations or subjects were added.
    Updated,
    /// A binding's `roleRef` differed: it was deleted and created again.
    Recreated,
    /// Nothing was missing.
    Unchanged,
    /// It is annotated `autoupdate: "false"` and was left alone.
    Protected,
}

/// Merges the expected labels and annotations into `existing` (existing values are kept).
fn merge_meta(existing: &mut ObjectMeta, expected: &ObjectMeta) -> bool {
    let mut changed = false;
    for (mine, theirs) in [
        (&mut existing.labels, &expected.labels),
        (&mut existing.annotations, &expected.annotations),
    ] {
        for (k, v) in theirs.iter().flatten() {
            let map = mine.get_or_insert_with(BTreeMap::new);
            if !map.contains_key(k) {
                map.insert(k.clone(), v.clone());
                changed = true;
            }
        }
    }
    changed
}

fn protected(meta: &ObjectMeta) -> bool {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(AUTOUPDATE))
        .is_some_and(|v| v == "false")
}

/// kube's `computeReconciledRole` for a ClusterRole: missing metadata, aggregation selectors and
/// (for a role that does not aggregate) the expected rules not covered by the existing ones.
fn reconcile_role(existing: &mut ClusterRole, expected: &ClusterRole) -> bool {
    let mut changed = merge_meta(&mut existing.metadata, &expected.metadata);
    if let Some(expected_aggregation) = &expected.aggregation_rule {
        let selectors = existing
            .aggregation_rule
            .get_or_insert_with(AggregationRule::default)
            .cluster_role_selectors
            .get_or_insert_with(Vec::new);
        for selector in expected_aggregation.cluster_role_selectors.iter().flatten() {
            if !selectors.contains(selector) {
                selectors.push(selector.clone());
                changed = true;
            }
        }
        return changed;
    }
    let have: Vec<Rule> = existing.rules.iter().flatten().map(Rule::from).collect();
    let want: Vec<Rule> = expected.rules.iter().flatten().map(Rule::from).collect();
    let missing: Vec<&PolicyRule> = expected
        .rules
        .iter()
        .flatten()
        .zip(&want)
        .filter(|(_, w)| !uncovered(&have, std::slice::from_ref(w)).is_empty())
        .map(|(p, _)| p)
        .collect();
    if !missing.is_empty() {
        existing
            .rules
            .get_or_insert_with(Vec::new)
            .extend(missing.into_iter().cloned());
        changed = true;
    }
    changed
}

/// Creates or reconciles one bootstrap ClusterRole.
pub async fn reconcile_cluster_role(
    registry: &Registry,
    expected: &ClusterRole,
) -> Result<Outcome, ApiError> {
    let name = expected.metadata.name.as_deref().unwrap_or("");
    for _ in 0..5 {
        let existing = match registry.get(Kind::ClusterRole, None, name).await {
            Ok(v) => v,
            Err(e) if e.code() == 404 => {
                let body = Object::ClusterRole(Box::new(expected.clone())).to_value();
                match registry
                    .create(Kind::ClusterRole, None, body, WriteOptions::default())
                    .await
                {
                    Ok(_) => return Ok(Outcome::Created),
                    Err(e) if e.code() == 409 => continue,
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let mut role: ClusterRole = serde_json::from_value(existing)
            .map_err(|e| ApiError::internal(format!("stored ClusterRole {name:?}: {e}")))?;
        if protected(&role.metadata) {
            return Ok(Outcome::Protected);
        }
        if !reconcile_role(&mut role, expected) {
            return Ok(Outcome::Unchanged);
        }
        let body = Object::ClusterRole(Box::new(role)).to_value();
        match registry
            .update(
                Kind::ClusterRole,
                None,
                name,
                false,
                body,
                WriteOptions::default(),
            )
            .await
        {
            Ok(_) => return Ok(Outcome::Updated),
            Err(e) if e.code() == 409 => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::internal(format!(
        "cannot reconcile ClusterRole {name:?}: it keeps changing"
    )))
}

/// Creates or reconciles one bootstrap ClusterRoleBinding.
pub async fn reconcile_cluster_role_binding(
    registry: &Registry,
    expected: &ClusterRoleBinding,
) -> Result<Outcome, ApiError> {
    let name = expected.metadata.name.as_deref().unwrap_or("");
    let create = |registry: &Registry| {
        let body = Object::ClusterRoleBinding(Box::new(expected.clone())).to_value();
        let registry = registry.clone();
        async move {
            registry
                .create(
                    Kind::ClusterRoleBinding,
                    None,
                    body,
                    WriteOptions::default(),
                )
                .await
        }
    };
    for _ in 0..5 {
        let existing = match registry.get(Kind::ClusterRoleBinding, None, name).await {
            Ok(v) => v,
            Err(e) if e.code() == 404 => match create(registry).await {
                Ok(_) => return Ok(Outcome::Created),
                Err(e) if e.code() == 409 => continue,
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        };
        let mut binding: ClusterRoleBinding = serde_json::from_value(existing.clone())
            .map_err(|e| ApiError::internal(format!("stored ClusterRoleBinding {name:?}: {e}")))?;
        if protected(&binding.metadata) {
            return Ok(Outcome::Protected);
        }
        if binding.role_ref != expected.role_ref {
            let preconditions = Preconditions {
                uid: binding.metadata.uid.clone(),
                resource_version: None,
            };
            match registry
                .delete(
                    Kind::ClusterRoleBinding,
                    None,
                    name,
                    preconditions,
                    WriteOptions::default(),
                )
                .await
            {
                Ok(_) | Err(_) => {}
            }
            match create(registry).await {
                Ok(_) => return Ok(Outcome::Recreated),
                Err(e) if e.code() == 409 => continue,
                Err(e) => return Err(e),
            }
        }
        let mut changed = merge_meta(&mut binding.metadata, &expected.metadata);
        let subjects = binding.subjects.get_or_insert_with(Vec::new);
        for s in expected.subjects.iter().flatten() {
            if !subjects.contains(s) {
                subjects.push(s.clone());
                changed = true;
            }
        }
        if !changed {
            return Ok(Outcome::Unchanged);
        }
        let body = Object::ClusterRoleBinding(Box::new(binding)).to_value();
        match registry
            .update(
                Kind::ClusterRoleBinding,
                None,
                name,
                false,
                body,
                WriteOptions::default(),
            )
            .await
        {
            Ok(_) => return Ok(Outcome::Updated),
            Err(e) if e.code() == 409 => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::internal(format!(
        "cannot reconcile ClusterRoleBinding {name:?}: it keeps changing"
    )))
}

/// Creates and reconciles the whole bootstrap policy; logs what changed.
pub async fn reconcile(registry: &Registry) -> Result<(), ApiError> {
    for role in cluster_roles() {
        let outcome = reconcile_cluster_role(registry, &role).await?;
        log(Kind::ClusterRole, &role.metadata, outcome);
    }
    for binding in cluster_role_bindings() {
        let outcome = reconcile_cluster_role_binding(registry, &binding).await?;
        log(Kind::ClusterRoleBinding, &binding.metadata, outcome);
    }
    Ok(())
}

fn log(kind: Kind, meta: &ObjectMeta, outcome: Outcome) {
    let name = meta.name.as_deref().unwrap_or("");
    match outcome {
        Outcome::Unchanged => {}
        Outcome::Created => tracing::debug!(kind = kind.kind(), name, "bootstrap policy created"),
        Outcome::Protected => tracing::info!(
            kind = kind.kind(),
            name,
            "bootstrap policy object annotated autoupdate=false; left alone"
        ),
        Outcome::Updated | Outcome::Recreated => tracing::info!(
            kind = kind.kind(),
            name,
            ?outcome,
            "bootstrap policy object reconciled"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciliation_adds_missing_rules_and_keeps_the_users_own() {
        let expected = cluster_roles()
            .into_iter()
            .find(|r| r.metadata.name.as_deref() == Some("system:node-proxier"))
            .unwrap();
        let mut existing = expected.clone();
        let own = rule(&["get"], &[""], &["configmaps"]);
        existing.rules = Some(vec![
            expected.rules.as_ref().unwrap()[0].clone(),
            own.clone(),
        ]);
        assert!(reconcile_role(&mut existing, &expected));
        let rules = existing.rules.clone().unwrap();
        assert_eq!(rules.len(), expected.rules.as_ref().unwrap().len() + 1);
        assert!(rules.contains(&own));
        let mut again = ClusterRole {
            rules: Some(rules),
            ..existing.clone()
        };
        assert!(
            !reconcile_role(&mut again, &expected),
            "nothing left to add"
        );
    }

    #[test]
    fn kube_proxy_is_bound_to_node_proxier_and_masters_to_cluster_admin() {
        let bindings = cluster_role_bindings();
        let find = |n: &str| {
            bindings
                .iter()
                .find(|b| b.metadata.name.as_deref() == Some(n))
                .unwrap()
        };
        assert_eq!(
            find("system:node-proxier").subjects.as_ref().unwrap()[0].name,
            "system:kube-proxy"
        );
        assert_eq!(
            find("cluster-admin").subjects.as_ref().unwrap()[0].name,
            "system:masters"
        );
    }
}
