//! Name and value checks shared by the kinds, with apimachinery's messages
//! (`k8s.io/apimachinery/pkg/util/validation`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

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

const QUALIFIED_NAME_MSG: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
/// `TotalAnnotationSizeLimitB`: keys and values of all annotations together.
const ANNOTATIONS_MAX_BYTES: usize = 256 * 1024;

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, the name part of a qualified name and a
/// non-empty label value.
fn is_qualified_chars(s: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_alphanumeric();
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && alnum(bytes[0])
        && alnum(bytes[bytes.len() - 1])
        && bytes
            .iter()
            .all(|b| alnum(*b) || matches!(b, b'-' | b'_' | b'.'))
}

/// Problems with `s` as a qualified name, `[prefix/]name` (`IsQualifiedName`): label keys,
/// annotation keys.
pub fn qualified_name(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let parts: Vec<&str> = s.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_owned());
            } else {
                errs.extend(
                    dns1123_subdomain(prefix)
                        .into_iter()
                        .map(|m| format!("prefix part {m}")),
                );
            }
            *name
        }
        _ => {
            errs.push(format!("a qualified name {QUALIFIED_NAME_MSG} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"));
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_owned());
    } else if name.len() > 63 {
        errs.push("name part must be no more than 63 characters".to_owned());
    }
    if !is_qualified_chars(name) {
        errs.push(format!("name part {QUALIFIED_NAME_MSG}"));
    }
    errs
}

/// Problems with `s` as a label value (`IsValidLabelValue`).
pub fn label_value(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > 63 {
        errs.push("must be no more than 63 characters".to_owned());
    }
    if !s.is_empty() && !is_qualified_chars(s) {
        errs.push(LABEL_VALUE_MSG.to_owned());
    }
    errs
}

/// `ValidateLabels`: every key a qualified name, every value a label value. Also the rule
/// for a Service's `spec.selector`.
pub fn labels<'a>(
    field: &str,
    map: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Vec<FieldError> {
    let mut errs = Vec::new();
    for (k, v) in map {
        for m in qualified_name(k) {
            errs.push(FieldError::invalid(field, GoValue::Str(k), m));
        }
        for m in label_value(v) {
            errs.push(FieldError::invalid(field, GoValue::Str(v), m));
        }
    }
    errs
}

/// `ValidateAnnotations`: keys are qualified names in any case, and all of them together
/// stay within 256 KiB.
pub fn annotations<'a>(
    field: &str,
    map: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let mut total = 0;
    for (k, v) in map {
        total += k.len() + v.len();
        for m in qualified_name(&k.to_ascii_lowercase()) {
            errs.push(FieldError::invalid(field, GoValue::Str(k), m));
        }
    }
    if total > ANNOTATIONS_MAX_BYTES {
        errs.push(FieldError::too_long(field, ANNOTATIONS_MAX_BYTES));
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
    errs.extend(labels("metadata.labels", meta.labels.iter().flatten()));
    errs.extend(annotations(
        "metadata.annotations",
        meta.annotations.iter().flatten(),
    ));
    errs.extend(owner_references(
        meta.owner_references.as_deref().unwrap_or_default(),
    ));
    errs.extend(finalizers(meta.finalizers.as_deref().unwrap_or_default()));
    errs
}

/// apimachinery's `ValidateOwnerReferences`: each names a version, a kind, a name and a uid,
/// and at most one is the controller.
fn owner_references(refs: &[OwnerReference]) -> Vec<FieldError> {
    const FIELD: &str = "metadata.ownerReferences";
    let mut errs = Vec::new();
    let mut controller: Option<String> = None;
    for r in refs {
        // `ParseGroupVersion`: `version` or `group/version`; anything else has no version.
        let version = match r.api_version.split('/').collect::<Vec<_>>().as_slice() {
            [version] | [_, version] => *version,
            _ => "",
        };
        let checks = [
            (
                "apiVersion",
                &r.api_version,
                version.is_empty(),
                "version must not be empty",
            ),
            ("kind", &r.kind, r.kind.is_empty(), "must not be empty"),
            ("name", &r.name, r.name.is_empty(), "must not be empty"),
            ("uid", &r.uid, r.uid.is_empty(), "must not be empty"),
        ];
        for (field, value, bad, detail) in checks {
            if bad {
                errs.push(FieldError::invalid(
                    format!("{FIELD}.{field}"),
                    GoValue::Str(value),
                    detail,
                ));
            }
        }
        // `BannedOwners`: an Event may not own anything.
        if r.api_version == "v1" && r.kind == "Event" {
            errs.push(FieldError::invalid(
                FIELD,
                GoValue::Raw(format!(
                    "v1.OwnerReference{{APIVersion:\"v1\", Kind:\"Event\", Name:{:?}, UID:{:?}}}",
                    r.name, r.uid
                )),
                "/v1, Kind=Event is disallowed from being an owner",
            ));
        }
        if r.controller == Some(true) {
            let this = format!("{}/{}", r.kind, r.name);
            match &controller {
                // kube prints the whole list with Go's %#v; abbreviated here.
                Some(first) => errs.push(FieldError::invalid(
                    FIELD,
                    GoValue::Raw("[]v1.OwnerReference{...}".to_owned()),
                    format!(
                        "Only one reference can have Controller set to true. Found \"true\" in references for {first} and {this}"
                    ),
                )),
                None => controller = Some(this),
            }
        }
    }
    errs
}

/// Finalizer names kube-apiserver accepts without a domain (`standardFinalizers`).
const STANDARD_FINALIZERS: [&str; 3] = ["kubernetes", "orphan", "foregroundDeletion"];

/// Core's `validateKubeFinalizerName`: a name without a `/` must be a standard one.
pub fn is_kube_finalizer_name(name: &str) -> bool {
    name.contains('/') || STANDARD_FINALIZERS.contains(&name)
}

/// What core says of a finalizer name that [`is_kube_finalizer_name`] refuses.
pub const NOT_QUALIFIED_FINALIZER: &str =
    "name is neither a standard finalizer name nor is it fully qualified";

/// apimachinery's `ValidateFinalizers` (qualified names; not both `orphan` and
/// `foregroundDeletion`), then core's `validateKubeFinalizerName` on each: a name without a
/// `/` must be a standard one.
fn finalizers(names: &[String]) -> Vec<FieldError> {
    let mut errs = Vec::new();
    for name in names {
        for m in qualified_name(name) {
            errs.push(FieldError::invalid(
                "metadata.finalizers",
                GoValue::Str(name),
                m,
            ));
        }
    }
    if names.iter().any(|n| n == "orphan") && names.iter().any(|n| n == "foregroundDeletion") {
        errs.push(FieldError::invalid(
            "metadata.finalizers",
            GoValue::Strings(names),
            "finalizer orphan and foregroundDeletion cannot be both set",
        ));
    }
    for (i, name) in names.iter().enumerate() {
        if !is_kube_finalizer_name(name) {
            errs.push(FieldError::invalid(
                format!("metadata.finalizers[{i}]"),
                GoValue::Str(name),
                NOT_QUALIFIED_FINALIZER,
            ));
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
    fn label_keys_and_values_follow_apimachinerys_rules() {
        assert!(qualified_name("app").is_empty());
        assert!(qualified_name("app.kubernetes.io/name").is_empty());
        assert!(qualified_name("My_Key.1").is_empty());
        assert_eq!(
            qualified_name("bad key!"),
            vec![format!("name part {QUALIFIED_NAME_MSG}")]
        );
        assert_eq!(qualified_name("-k").len(), 1);
        assert_eq!(qualified_name("a/b/c").len(), 1);
        assert_eq!(qualified_name(&"k".repeat(64)).len(), 1);
        assert_eq!(
            qualified_name("/x"),
            vec!["prefix part must be non-empty".to_owned()]
        );
        assert_eq!(
            qualified_name("Example.com/x"),
            vec![format!("prefix part {DNS1123_SUBDOMAIN_MSG}")]
        );
        assert!(label_value("").is_empty());
        assert!(label_value("v1.2_x-y").is_empty());
        assert_eq!(label_value("bad value!"), vec![LABEL_VALUE_MSG.to_owned()]);
        assert_eq!(label_value(&"v".repeat(64)).len(), 1);
    }

    #[test]
    fn annotation_keys_ignore_case_and_the_total_is_limited() {
        let big = "x".repeat(ANNOTATIONS_MAX_BYTES);
        let (k1, v1, k2, v2) = (
            "Example.com/Key".to_owned(),
            big,
            "bad key!".to_owned(),
            String::new(),
        );
        let errs = annotations("metadata.annotations", [(&k1, &v1), (&k2, &v2)]);
        let bodies: Vec<String> = errs.iter().map(FieldError::body).collect();
        assert_eq!(bodies.len(), 2, "{bodies:#?}");
        assert!(bodies[0].contains("\"bad key!\""), "{bodies:#?}");
        assert!(bodies[1].contains("262144"), "{bodies:#?}");
    }

    #[test]
    fn port_names_follow_iana_rules() {
        assert!(port_name("http").is_empty());
        assert!(!port_name("8080").is_empty());
        assert!(!port_name("a-very-long-port-name").is_empty());
    }
}
