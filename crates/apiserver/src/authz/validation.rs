//! Validation of the RBAC kinds, with kube's messages (`pkg/apis/rbac/validation`): names are
//! path segments (`system:node-proxier` is valid), rules need verbs and either API groups and
//! resources or non-resource URLs (the latter only in ClusterRoles), bindings name a Role or
//! ClusterRole of `rbac.authorization.k8s.io` and subjects of a known kind.

use k8s_openapi::api::rbac::v1::{PolicyRule, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::error::{FieldError, GoValue};
use crate::registry::object::Object;

const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// `path.IsValidPathSegmentName`'s messages for a name, empty if it is valid.
fn path_segment_problems(name: &str) -> Vec<&'static str> {
    let mut problems = Vec::new();
    if name == "." {
        problems.push("may not be '.'");
    } else if name == ".." {
        problems.push("may not be '..'");
    }
    if name.contains('/') {
        problems.push("may not contain '/'");
    }
    if name.contains('%') {
        problems.push("may not contain '%'");
    }
    problems
}

fn meta(meta: &ObjectMeta) -> Vec<FieldError> {
    match meta.name.as_deref() {
        None | Some("") if meta.generate_name.as_deref().unwrap_or("").is_empty() => {
            vec![FieldError::required(
                "metadata.name",
                "name or generateName is required",
            )]
        }
        None | Some("") => Vec::new(),
        Some(name) => path_segment_problems(name)
            .into_iter()
            .map(|p| FieldError::invalid("metadata.name", GoValue::Str(name), p))
            .collect(),
    }
}

fn rules(rules: Option<&Vec<PolicyRule>>, namespaced: bool) -> Vec<FieldError> {
    let mut errs = Vec::new();
    for (i, rule) in rules.into_iter().flatten().enumerate() {
        let path = format!("rules[{i}]");
        if rule.verbs.is_empty() {
            errs.push(FieldError::required(
                format!("{path}.verbs"),
                "verbs must contain at least one value",
            ));
        }
        let empty = |v: &Option<Vec<String>>| v.as_ref().is_none_or(Vec::is_empty);
        if let Some(urls) = rule.non_resource_urls.as_ref().filter(|u| !u.is_empty()) {
            if namespaced {
                errs.push(FieldError::invalid(
                    format!("{path}.nonResourceURLs"),
                    GoValue::Strings(urls),
                    "namespaced rules cannot apply to non-resource URLs",
                ));
            }
            if !empty(&rule.api_groups) || !empty(&rule.resources) || !empty(&rule.resource_names) {
                errs.push(FieldError::invalid(
                    format!("{path}.nonResourceURLs"),
                    GoValue::Strings(urls),
                    "rules cannot apply to both regular resources and non-resource URLs",
                ));
            }
            continue;
        }
        if empty(&rule.api_groups) {
            errs.push(FieldError::required(
                format!("{path}.apiGroups"),
                "resource rules must supply at least one api group",
            ));
        }
        if empty(&rule.resources) {
            errs.push(FieldError::required(
                format!("{path}.resources"),
                "resource rules must supply at least one resource",
            ));
        }
    }
    errs
}

fn binding(role_ref: &RoleRef, subjects: Option<&Vec<Subject>>, cluster: bool) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if role_ref.api_group != RBAC_GROUP {
        errs.push(FieldError::not_supported(
            "roleRef.apiGroup",
            &role_ref.api_group,
            &[RBAC_GROUP],
        ));
    }
    let kinds: &[&str] = if cluster {
        &["ClusterRole"]
    } else {
        &["ClusterRole", "Role"]
    };
    if !kinds.contains(&role_ref.kind.as_str()) {
        errs.push(FieldError::not_supported(
            "roleRef.kind",
            &role_ref.kind,
            kinds,
        ));
    }
    if role_ref.name.is_empty() {
        errs.push(FieldError::required("roleRef.name", ""));
    } else {
        for p in path_segment_problems(&role_ref.name) {
            errs.push(FieldError::invalid(
                "roleRef.name",
                GoValue::Str(&role_ref.name),
                p,
            ));
        }
    }
    for (i, subject) in subjects.into_iter().flatten().enumerate() {
        let path = format!("subjects[{i}]");
        if subject.name.is_empty() {
            errs.push(FieldError::required(format!("{path}.name"), ""));
        }
        match subject.kind.as_str() {
            "ServiceAccount" => {
                if subject.api_group.as_deref().is_some_and(|g| !g.is_empty()) {
                    errs.push(FieldError::not_supported(
                        format!("{path}.apiGroup"),
                        subject.api_group.as_deref().unwrap_or(""),
                        &[""],
                    ));
                }
                if cluster && subject.namespace.as_deref().unwrap_or("").is_empty() {
                    errs.push(FieldError::required(format!("{path}.namespace"), ""));
                }
            }
            "User" | "Group" => {
                if subject.api_group.as_deref() != Some(RBAC_GROUP) {
                    errs.push(FieldError::not_supported(
                        format!("{path}.apiGroup"),
                        subject.api_group.as_deref().unwrap_or(""),
                        &[RBAC_GROUP],
                    ));
                }
            }
            other => errs.push(FieldError::not_supported(
                format!("{path}.kind"),
                other,
                &["Group", "ServiceAccount", "User"],
            )),
        }
    }
    errs
}

/// kube's RBAC v1 defaults: `roleRef.apiGroup` and the `apiGroup` of User and Group subjects
/// default to `rbac.authorization.k8s.io`.
pub fn set_defaults(object: &mut Object) {
    let (role_ref, subjects) = match object {
        Object::RoleBinding(b) => (&mut b.role_ref, b.subjects.as_mut()),
        Object::ClusterRoleBinding(b) => (&mut b.role_ref, b.subjects.as_mut()),
        _ => return,
    };
    if role_ref.api_group.is_empty() {
        role_ref.api_group = RBAC_GROUP.into();
    }
    for subject in subjects.into_iter().flatten() {
        if subject.api_group.as_deref().unwrap_or("").is_empty()
            && matches!(subject.kind.as_str(), "User" | "Group")
        {
            subject.api_group = Some(RBAC_GROUP.into());
        }
    }
}

/// Validation of a Role, ClusterRole, RoleBinding or ClusterRoleBinding (other kinds: none).
pub fn validate(object: &Object) -> Vec<FieldError> {
    match object {
        Object::Role(r) => [meta(&r.metadata), rules(r.rules.as_ref(), true)].concat(),
        Object::ClusterRole(r) => [meta(&r.metadata), rules(r.rules.as_ref(), false)].concat(),
        Object::RoleBinding(b) => [
            meta(&b.metadata),
            binding(&b.role_ref, b.subjects.as_ref(), false),
        ]
        .concat(),
        Object::ClusterRoleBinding(b) => [
            meta(&b.metadata),
            binding(&b.role_ref, b.subjects.as_ref(), true),
        ]
        .concat(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::rbac::v1::Role;

    #[test]
    fn a_namespaced_rule_may_not_name_urls_and_a_resource_rule_needs_groups() {
        let role = Role {
            metadata: ObjectMeta {
                name: Some("r".into()),
                ..Default::default()
            },
            rules: Some(vec![
                PolicyRule {
                    verbs: vec!["get".into()],
                    non_resource_urls: Some(vec!["/healthz".into()]),
                    ..Default::default()
                },
                PolicyRule {
                    verbs: vec!["get".into()],
                    resources: Some(vec!["services".into()]),
                    ..Default::default()
                },
            ]),
        };
        let errs = validate(&Object::Role(Box::new(role)));
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            vec![
                r#"rules[0].nonResourceURLs: Invalid value: []string{"/healthz"}: namespaced rules cannot apply to non-resource URLs"#,
                "rules[1].apiGroups: Required value: resource rules must supply at least one api group",
            ]
        );
    }

    #[test]
    fn names_are_path_segments() {
        assert!(path_segment_problems("system:node-proxier").is_empty());
        assert_eq!(path_segment_problems("a/b"), vec!["may not contain '/'"]);
    }
}
