//! Protobuf bodies of the RBAC kinds (`rbac.authorization.k8s.io/v1`) and of the access reviews
//! (`authorization.k8s.io/v1`), which kubectl's typed commands (`kubectl create role`,
//! `kubectl auth can-i`) send, turned into JSON by the parent module's rules.

use k8s_pb::api::authorization::v1 as authz;
use k8s_pb::api::rbac::v1 as rbac;
use k8s_pb::apimachinery::pkg::apis::meta::v1 as meta;
use serde_json::Value;

use super::{Envelope, Error, Fields, object_meta, typed};

/// The RBAC and review kinds decoded here, as `(apiVersion, kind)`.
pub const DECODED: [(&str, &str); 7] = [
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"),
    ("authorization.k8s.io/v1", "SelfSubjectRulesReview"),
    ("authorization.k8s.io/v1", "SubjectAccessReview"),
];

/// The JSON of an envelope of one of [`DECODED`], `None` for another kind.
pub(super) fn decode(head: Fields, envelope: &Envelope) -> Option<Result<Value, Error>> {
    let decoded = match (envelope.api_version.as_str(), envelope.kind.as_str()) {
        ("rbac.authorization.k8s.io/v1", "Role") => typed(envelope).and_then(|r| role(head, r)),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            typed(envelope).and_then(|r| cluster_role(head, r))
        }
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
            typed(envelope).and_then(|b| role_binding(head, b))
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            typed(envelope).and_then(|b| cluster_role_binding(head, b))
        }
        ("authorization.k8s.io/v1", "SelfSubjectAccessReview") => {
            typed(envelope).and_then(|r| self_subject_access_review(head, r))
        }
        ("authorization.k8s.io/v1", "SelfSubjectRulesReview") => {
            typed(envelope).and_then(|r| self_subject_rules_review(head, r))
        }
        ("authorization.k8s.io/v1", "SubjectAccessReview") => {
            typed(envelope).and_then(|r| subject_access_review(head, r))
        }
        _ => return None,
    };
    Some(decoded)
}

fn policy_rule(r: rbac::PolicyRule) -> Result<Value, Error> {
    // `verbs` has no `omitempty`: always written (empty as `[]`, so that validation, not
    // decoding, refuses a rule without verbs, as kube's 422 does).
    Ok(Fields::default()
        .put("verbs", r.verbs)
        .strings("apiGroups", r.api_groups)
        .strings("resources", r.resources)
        .strings("resourceNames", r.resource_names)
        .strings("nonResourceURLs", r.non_resource_ur_ls)
        .done())
}

fn label_selector(s: meta::LabelSelector) -> Result<Value, Error> {
    Fields::default()
        .string_map("matchLabels", s.match_labels)
        .list("matchExpressions", s.match_expressions, |e| {
            Ok(Fields::default()
                .always("key", e.key)
                .always("operator", e.operator)
                .strings("values", e.values)
                .done())
        })
        .map(Fields::done)
}

fn subject(s: rbac::Subject) -> Result<Value, Error> {
    Ok(Fields::default()
        .always("kind", s.kind)
        .nonzero("apiGroup", s.api_group)
        .always("name", s.name)
        .nonzero("namespace", s.namespace)
        .done())
}

fn role_ref(r: rbac::RoleRef) -> Result<Value, Error> {
    Ok(Fields::default()
        .always("apiGroup", r.api_group)
        .always("kind", r.kind)
        .always("name", r.name)
        .done())
}

fn role(head: Fields, r: rbac::Role) -> Result<Value, Error> {
    head.object("metadata", r.metadata, object_meta)?
        .list("rules", r.rules, policy_rule)
        .map(Fields::done)
}

fn cluster_role(head: Fields, r: rbac::ClusterRole) -> Result<Value, Error> {
    head.object("metadata", r.metadata, object_meta)?
        .list("rules", r.rules, policy_rule)?
        .object("aggregationRule", r.aggregation_rule, |a| {
            Fields::default()
                .list(
                    "clusterRoleSelectors",
                    a.cluster_role_selectors,
                    label_selector,
                )
                .map(Fields::done)
        })
        .map(Fields::done)
}

fn role_binding(head: Fields, b: rbac::RoleBinding) -> Result<Value, Error> {
    head.object("metadata", b.metadata, object_meta)?
        .list("subjects", b.subjects, subject)?
        .object("roleRef", b.role_ref, role_ref)
        .map(Fields::done)
}

fn cluster_role_binding(head: Fields, b: rbac::ClusterRoleBinding) -> Result<Value, Error> {
    head.object("metadata", b.metadata, object_meta)?
        .list("subjects", b.subjects, subject)?
        .object("roleRef", b.role_ref, role_ref)
        .map(Fields::done)
}

fn resource_attributes(a: authz::ResourceAttributes) -> Result<Value, Error> {
    Ok(Fields::default()
        .nonzero("namespace", a.namespace)
        .nonzero("verb", a.verb)
        .nonzero("group", a.group)
        .nonzero("version", a.version)
        .nonzero("resource", a.resource)
        .nonzero("subresource", a.subresource)
        .nonzero("name", a.name)
        .done())
}

fn non_resource_attributes(a: authz::NonResourceAttributes) -> Result<Value, Error> {
    Ok(Fields::default()
        .nonzero("path", a.path)
        .nonzero("verb", a.verb)
        .done())
}

fn self_subject_access_review(
    head: Fields,
    r: authz::SelfSubjectAccessReview,
) -> Result<Value, Error> {
    head.object("metadata", r.metadata, object_meta)?
        .object("spec", r.spec, |s| {
            Fields::default()
                .object(
                    "resourceAttributes",
                    s.resource_attributes,
                    resource_attributes,
                )?
                .object(
                    "nonResourceAttributes",
                    s.non_resource_attributes,
                    non_resource_attributes,
                )
                .map(Fields::done)
        })
        .map(Fields::done)
}

fn self_subject_rules_review(
    head: Fields,
    r: authz::SelfSubjectRulesReview,
) -> Result<Value, Error> {
    head.object("metadata", r.metadata, object_meta)?
        .object("spec", r.spec, |s| {
            Ok(Fields::default().nonzero("namespace", s.namespace).done())
        })
        .map(Fields::done)
}

fn subject_access_review(head: Fields, r: authz::SubjectAccessReview) -> Result<Value, Error> {
    head.object("metadata", r.metadata, object_meta)?
        .object("spec", r.spec, |s| {
            Ok(Fields::default()
                .object(
                    "resourceAttributes",
                    s.resource_attributes,
                    resource_attributes,
                )?
                .object(
                    "nonResourceAttributes",
                    s.non_resource_attributes,
                    non_resource_attributes,
                )?
                .nonzero("user", s.user)
                .strings("groups", s.groups)
                .nonzero("uid", s.uid)
                .done())
        })
        .map(Fields::done)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::super::{MAGIC, decode_object};
    use super::*;
    use crate::resource::Kind;

    fn wire(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
        let unknown = k8s_pb::apimachinery::pkg::runtime::Unknown {
            type_meta: Some(k8s_pb::apimachinery::pkg::runtime::TypeMeta {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
            }),
            raw: Some(raw),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        [MAGIC.to_vec(), unknown.encode_to_vec()].concat()
    }

    #[test]
    fn a_role_as_kubectl_create_role_sends_it_decodes_to_its_json() {
        let role = rbac::Role {
            metadata: Some(meta::ObjectMeta {
                name: Some("reader".into()),
                creation_timestamp: Some(meta::Time::default()),
                ..Default::default()
            }),
            rules: vec![rbac::PolicyRule {
                verbs: vec!["get".into(), "list".into()],
                api_groups: vec![String::new()],
                resources: vec!["services".into()],
                ..Default::default()
            }],
        };
        let json = decode_object(
            &wire("rbac.authorization.k8s.io/v1", "Role", role.encode_to_vec()),
            Kind::Role,
        )
        .unwrap();
        assert_eq!(
            json,
            serde_json::json!({"apiVersion":"rbac.authorization.k8s.io/v1","kind":"Role",
                "metadata":{"name":"reader"},
                "rules":[{"verbs":["get","list"],"apiGroups":[""],"resources":["services"]}]})
        );
    }

    #[test]
    fn a_self_subject_access_review_decodes_to_its_json() {
        let review = authz::SelfSubjectAccessReview {
            metadata: Some(meta::ObjectMeta::default()),
            spec: Some(authz::SelfSubjectAccessReviewSpec {
                resource_attributes: Some(authz::ResourceAttributes {
                    namespace: Some("default".into()),
                    verb: Some("create".into()),
                    group: Some(String::new()),
                    resource: Some("services".into()),
                    ..Default::default()
                }),
                non_resource_attributes: None,
            }),
            status: Some(authz::SubjectAccessReviewStatus::default()),
        };
        let json = super::super::decode_review(&wire(
            "authorization.k8s.io/v1",
            "SelfSubjectAccessReview",
            review.encode_to_vec(),
        ))
        .unwrap();
        assert_eq!(
            json["spec"],
            serde_json::json!({"resourceAttributes":{"namespace":"default","verb":"create","resource":"services"}})
        );
        assert_eq!(json["kind"], "SelfSubjectAccessReview");
    }
}
