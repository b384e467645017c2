//! Name and value checks shared by the kinds, with apimachinery's messages
//! (`k8s.io/apimachinery/pkg/util/validation`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::error::{FieldError, GoValue};

const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1035_LABEL_MSG: &str = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')";
const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

fn is_label_chars(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Problems with `s` as an RFC 1123 label (`IsDNS1123Label`).
pub fn dns1123_label(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > 63 {
        errs.push("must be no more than 63 characters".to_owned());
    }
    if !is_label_chars(s) {
        errs.push(DNS1123_LABEL_MSG.to_owned());
    }
    errs
}

/// Problems with `s` as an RFC 1035 label (`IsDNS1035Label`).
pub fn dns1035_label(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > 63 {
        errs.push("must be no more than 63 characters".to_owned());
    }
    if !is_label_chars(s) || !s.starts_with(|c: char| c.is_ascii_lowercase()) {
        errs.push(DNS1035_LABEL_MSG.to_owned());
    }
    errs
}

/// Problems with `s` as an RFC 1123 subdomain (`IsDNS1123Subdomain`).
pub fn dns1123_subdomain(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > 253 {
        errs.push("must be no more than 253 characters".to_owned());
    }
    if s.is_empty() || !s.split('.').all(is_label_chars) {
        errs.push(DNS1123_SUBDOMAIN_MSG.to_owned());
    }
    errs
}

/// Problems with `s` as an IANA service name, the named form of a port (`IsValidPortName`).
pub fn port_name(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > 15 {
        errs.push("must be no more than 15 characters".to_owned());
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        errs.push(
            "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)".to_owned(),
        );
    }
    if s.contains("--") {
        errs.push("must not contain consecutive hyphens".to_owned());
    }
    if !s.bytes().any(|b| b.is_ascii_lowercase()) {
        errs.push("must contain at least one letter (a-z)".to_owned());
    }
    if s.starts_with('-') || s.ends_with('-') {
        errs.push("must not begin or end with a hyphen".to_owned());
    }
    errs
}

/// Which name rule an object's name follows.
#[derive(Debug, Clone, Copy)]
pub enum NameRule {
    /// Services.
    Dns1035Label,
    /// Namespaces.
    Dns1123Label,
    /// Nodes, Endpoints, EndpointSlices.
    Dns1123Subdomain,
}

/// `ValidateObjectMeta`: name present and well formed, namespace as required by the scope.
pub fn object_meta(meta: &ObjectMeta, namespaced: bool, rule: NameRule) -> Vec<FieldError> {
    let mut errs = Vec::new();
    match meta.name.as_deref() {
        None | Some("") => {
            if meta.generate_name.as_deref().unwrap_or("").is_empty() {
                errs.push(FieldError::required(
                    "metadata.name",
                    "name or generateName is required",
                ));
            }
        }
        Some(name) => {
            let problems = match rule {
                NameRule::Dns1035Label => dns1035_label(name),
                NameRule::Dns1123Label => dns1123_label(name),
                NameRule::Dns1123Subdomain => dns1123_subdomain(name),
            };
            for p in problems {
                errs.push(FieldError::invalid("metadata.name", GoValue::Str(name), p));
            }
        }
    }
    if namespaced {
        if meta.namespace.as_deref().unwrap_or("").is_empty() {
            errs.push(FieldError::required("metadata.namespace", ""));
        }
    } else if meta.namespace.as_deref().is_some_and(|ns| !ns.is_empty()) {
        errs.push(FieldError::forbidden(
            "metadata.namespace",
            "not allowed on this type",
        ));
    }
    for (field, map) in [("metadata.labels", &meta.labels)] {
        if let Some(map) = map {
            for (k, v) in map {
                if v.len() > 63 {
                    errs.push(FieldError::invalid(
                        field,
                        GoValue::Str(v),
                        "must be no more than 63 characters",
                    ));
                }
                if k.is_empty() {
                    errs.push(FieldError::invalid(
                        field,
                        GoValue::Str(k),
                        "name part must be non-empty",
                    ));
                }
            }
        }
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_names_must_be_dns1035_labels() {
        assert!(dns1035_label("web").is_empty());
        assert_eq!(dns1035_label("1web").len(), 1);
        assert_eq!(dns1035_label("Web").len(), 1);
        assert!(dns1123_label("1web").is_empty());
        assert!(dns1123_subdomain("node-1.example").is_empty());
        assert!(!dns1123_subdomain("a..b").is_empty());
    }

    #[test]
    fn port_names_follow_iana_rules() {
        assert!(port_name("http").is_empty());
        assert!(!port_name("8080").is_empty());
        assert!(!port_name("a-very-long-port-name").is_empty());
    }
}
