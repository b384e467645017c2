//! Escalation prevention, as kube's RBAC storage does it (`pkg/registry/rbac/role/policybased`,
//! `.../rolebinding/policybased`, `pkg/registry/rbac/validation/rule.go`): a user may create or
//! update a Role or ClusterRole only if they already hold every permission in it (or may
//! `escalate` roles), and a RoleBinding or ClusterRoleBinding only if they hold every permission
//! of the role it names (or may `bind` that role). `system:masters` may always.

use serde_json::Value;

use super::rbac::{Rule, uncovered};
use super::{Attributes, Authorizer, UserInfo};
use crate::error::ApiError;
use crate::resource::Kind;

const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// Go's `%q` of a `[]string`: `["a" "b"]`.
fn go_quoted_list(items: &[String]) -> String {
    let parts: Vec<String> = items.iter().map(|s| format!("{s:?}")).collect();
    format!("[{}]", parts.join(" "))
}

/// kube's `ConfirmNoEscalation`: the rules of `wanted` the user does not hold in `namespace`.
fn confirm_no_escalation(
    authorizer: &Authorizer,
    user: &UserInfo,
    namespace: &str,
    wanted: &[Rule],
) -> Result<(), String> {
    let (owned, errors) = authorizer.policy().read(|p| p.rules_for(user, namespace));
    let missing = uncovered(&owned, wanted);
    if missing.is_empty() {
        return Ok(());
    }
    let mut descriptions: Vec<String> = missing.iter().map(Rule::compact_string).collect();
    descriptions.sort();
    descriptions.dedup();
    let mut message = format!(
        "user {:?} (groups={}) is attempting to grant RBAC permissions not currently held:\n{}",
        user.name,
        go_quoted_list(&user.groups),
        descriptions.join("\n")
    );
    if !errors.is_empty() {
        message.push_str(&format!("; resolution errors: [{}]", errors.join(" ")));
    }
    Err(message)
}

fn rules_in(object: &Value) -> Vec<Rule> {
    object
        .get("rules")
        .cloned()
        .and_then(|r| serde_json::from_value::<Vec<k8s_openapi::api::rbac::v1::PolicyRule>>(r).ok())
        .unwrap_or_default()
        .iter()
        .map(Rule::from)
        .collect()
}

/// Checks that `user` may write `object` (a Role, ClusterRole, RoleBinding or
/// ClusterRoleBinding in `namespace`); other kinds pass.
pub fn check_write(
    authorizer: &Authorizer,
    user: &UserInfo,
    kind: Kind,
    namespace: Option<&str>,
    object: &Value,
) -> Result<(), ApiError> {
    if user.is_superuser() {
        return Ok(());
    }
    let namespace = namespace.unwrap_or("");
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let allowed = |verb: &str, resource: &str, role_name: &str| {
        authorizer
            .authorize(&Attributes::resource(
                user.clone(),
                verb,
                RBAC_GROUP,
                resource,
                namespace,
                role_name,
            ))
            .allowed
    };
    let refuse =
        |why: String| ApiError::forbidden_resource(RBAC_GROUP, kind.resource(), name, &why);
    match kind {
        Kind::Role | Kind::ClusterRole => {
            if allowed("escalate", kind.resource(), name) {
                return Ok(());
            }
            confirm_no_escalation(authorizer, user, namespace, &rules_in(object))
                .map_err(refuse)?;
            if kind == Kind::ClusterRole
                && object.get("aggregationRule").is_some_and(|a| !a.is_null())
            {
                let everything = [
                    Rule {
                        verbs: vec!["*".into()],
                        api_groups: vec!["*".into()],
                        resources: vec!["*".into()],
                        ..Rule::default()
                    },
                    Rule {
                        verbs: vec!["*".into()],
                        non_resource_urls: vec!["*".into()],
                        ..Rule::default()
                    },
                ];
                confirm_no_escalation(authorizer, user, namespace, &everything).map_err(|_| {
                    refuse("must have cluster-admin privileges to use the aggregationRule".into())
                })?;
            }
            Ok(())
        }
        Kind::RoleBinding | Kind::ClusterRoleBinding => {
            let role_kind = object
                .pointer("/roleRef/kind")
                .and_then(Value::as_str)
                .unwrap_or("");
            let role_name = object
                .pointer("/roleRef/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            let role_resource = if role_kind == "Role" {
                "roles"
            } else {
                "clusterroles"
            };
            if allowed("bind", role_resource, role_name) {
                return Ok(());
            }
            let rules = authorizer.policy().read(|p| {
                if role_kind == "Role" {
                    p.roles
                        .get(namespace)
                        .and_then(|r| r.get(role_name))
                        .map(|r| r.to_vec())
                        .ok_or_else(|| {
                            format!("role.rbac.authorization.k8s.io {role_name:?} not found")
                        })
                } else {
                    p.cluster_roles
                        .get(role_name)
                        .map(|r| r.rules.to_vec())
                        .ok_or_else(|| {
                            format!("clusterrole.rbac.authorization.k8s.io {role_name:?} not found")
                        })
                }
            });
            let rules = rules.map_err(refuse)?;
            confirm_no_escalation(authorizer, user, namespace, &rules).map_err(refuse)
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_quoted_as_gos_percent_q_of_a_slice() {
        assert_eq!(
            go_quoted_list(&["system:authenticated".into(), "dev".into()]),
            r#"["system:authenticated" "dev"]"#
        );
    }
}
