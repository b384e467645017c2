//! Label and field selectors (`labelSelector`, `fieldSelector` query parameters).
//!
//! Label selectors follow `k8s.io/apimachinery/pkg/labels`: `k`, `!k`, `k=v`, `k==v`, `k!=v`,
//! `k in (a,b)`, `k notin (a,b)`, comma-separated. Field selectors follow
//! `k8s.io/apimachinery/pkg/fields`: `f=v`, `f==v`, `f!=v`, comma-separated, over the fields each
//! kind supports (see [`field_value`]).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::ApiError;
use crate::resource::Kind;

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelRequirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelRequirement>);

/// Splits at commas that are not inside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&s[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_set(rest: &str, selector: &str) -> Result<Vec<String>, ApiError> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "unable to parse requirement: found '{rest}', expected: '('"
            ))
        })?;
    let _ = selector;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect())
}

fn check_label_key(key: &str) -> Result<(), ApiError> {
    let valid = !key.is_empty()
        && key.len() <= 317
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if valid {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "unable to parse requirement: invalid label key {key:?}"
        )))
    }
}

impl LabelSelector {
    /// Parses a `labelSelector` query value.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for term in split_terms(s) {
            let req = if let Some(key) = term.strip_prefix('!') {
                LabelRequirement::NotExists(key.trim().to_owned())
            } else if let Some((key, rest)) = term.split_once(" notin ") {
                LabelRequirement::NotIn(key.trim().to_owned(), parse_set(rest, s)?)
            } else if let Some((key, rest)) = term.split_once(" in ") {
                LabelRequirement::In(key.trim().to_owned(), parse_set(rest, s)?)
            } else if let Some((key, value)) = term.split_once("!=") {
                LabelRequirement::NotEquals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = term.split_once("==") {
                LabelRequirement::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = term.split_once('=') {
                LabelRequirement::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else {
                LabelRequirement::Exists(term.to_owned())
            };
            let key = match &req {
                LabelRequirement::Exists(k)
                | LabelRequirement::NotExists(k)
                | LabelRequirement::Equals(k, _)
                | LabelRequirement::NotEquals(k, _)
                | LabelRequirement::In(k, _)
                | LabelRequirement::NotIn(k, _) => k,
            };
            check_label_key(key)?;
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    /// Whether the selector is empty (matches everything).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|req| match req {
            LabelRequirement::Exists(k) => labels.contains_key(k),
            LabelRequirement::NotExists(k) => !labels.contains_key(k),
            LabelRequirement::Equals(k, v) => labels.get(k) == Some(v),
            LabelRequirement::NotEquals(k, v) => labels.get(k) != Some(v),
            LabelRequirement::In(k, vs) => labels.get(k).is_some_and(|l| vs.contains(l)),
            LabelRequirement::NotIn(k, vs) => labels.get(k).is_none_or(|l| !vs.contains(l)),
        })
    }
}

/// A parsed field selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses a `fieldSelector` query value for `kind`, rejecting fields the kind does not support
    /// with kube-apiserver's `field label not supported: <field>`.
    pub fn parse(kind: Kind, s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for term in split_terms(s) {
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{s}'; can't understand '{term}'"
                )));
            };
            let field = field.trim();
            if !supported_fields(kind).contains(&field) {
                return Err(ApiError::bad_request(format!(
                    "field label not supported: {field}"
                )));
            }
            // `events.k8s.io/v1` names are selected by their core/v1 names, the stored form's.
            let field = super::event::core_field_label(field);
            reqs.push((field, equal, value.trim().to_owned()));
        }
        Ok(FieldSelector(reqs))
    }

    /// Whether the selector is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the object satisfies every requirement.
    pub fn matches(&self, object: &Value) -> bool {
        self.0
            .iter()
            .all(|(field, equal, value)| (field_value(object, field) == *value) == *equal)
    }

    /// The name required by a `metadata.name=<name>` term, if any: such a list reads one key.
    pub fn exact_name(&self) -> Option<&str> {
        self.0
            .iter()
            .find(|(f, eq, _)| f == "metadata.name" && *eq)
            .map(|(_, _, v)| v.as_str())
    }
}

/// The fields `kind` can be selected by (the `SelectableFields` of each kube strategy).
pub fn supported_fields(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Service => &[
            "metadata.name",
            "metadata.namespace",
            "spec.clusterIP",
            "spec.type",
        ],
        Kind::Node => &["metadata.name", "spec.unschedulable"],
        Kind::ServiceCidr => &["metadata.name"],
        Kind::IpAddress => &["metadata.name"],
        Kind::Namespace => &["metadata.name", "status.phase"],
        Kind::Endpoints | Kind::EndpointSlice => &["metadata.name", "metadata.namespace"],
        Kind::Event | Kind::EventsV1 => super::event::selectable_fields(kind),
        Kind::Role | Kind::ClusterRole | Kind::RoleBinding | Kind::ClusterRoleBinding => {
            &["metadata.name", "metadata.namespace"]
        }
    }
}

/// The value of a selectable field, as a string (`""` when unset; booleans as `true`/`false`).
pub fn field_value(object: &Value, field: &str) -> String {
    if field == "source" {
        return super::event::source_field(object);
    }
    let mut current = object;
    for part in field.split('.') {
        match current.get(part) {
            Some(v) => current = v,
            None => {
                return if field == "spec.unschedulable" {
                    "false".to_owned()
                } else {
                    String::new()
                };
            }
        }
    }
    match current {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    }
}

/// The labels of a JSON object.
pub fn labels_of(object: &Value) -> BTreeMap<String, String> {
    object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn label_selectors_support_equality_and_set_terms() {
        let s = LabelSelector::parse("app=web,tier in (fe, be),!legacy,env!=prod").unwrap();
        assert!(s.matches(&labels(&[("app", "web"), ("tier", "fe")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("tier", "db")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("tier", "fe"), ("legacy", "")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("tier", "fe"), ("env", "prod")])));
        let s = LabelSelector::parse("tier notin (db),app").unwrap();
        assert!(s.matches(&labels(&[("app", "x")])));
        assert!(!s.matches(&labels(&[("app", "x"), ("tier", "db")])));
    }

    #[test]
    fn field_selector_on_node_name_matches_one_node() {
        let s = FieldSelector::parse(Kind::Node, "metadata.name=worker").unwrap();
        assert_eq!(s.exact_name(), Some("worker"));
        assert!(s.matches(&json!({"metadata":{"name":"worker"}})));
        assert!(!s.matches(&json!({"metadata":{"name":"other"}})));
    }

    #[test]
    fn unsupported_field_is_a_bad_request_with_kube_wording() {
        let err = FieldSelector::parse(Kind::Service, "spec.foo=bar").unwrap_err();
        assert_eq!(err.code(), 400);
        assert_eq!(err.message(), "field label not supported: spec.foo");
    }
}
