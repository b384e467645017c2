//! API errors as Kubernetes `Status` objects (`k8s.io/apimachinery/pkg/api/errors`).
//!
//! Every failure a client can see is an [`ApiError`]: HTTP code, `reason`, message and details,
//! built by constructors named after apimachinery's (`NewNotFound`, `NewInvalid`, ...), with the
//! same message texts. [`axum::response::IntoResponse`] renders it as a `Status` JSON document.
//! Client mistakes (4xx) are logged at debug level; internal faults (5xx) once, at error level.

use std::fmt;

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde::Serialize;
use serde_json::json;

use crate::storage;

/// Kind of a field error (`field.ErrorType` in apimachinery).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// `FieldValueInvalid`.
    Invalid,
    /// `FieldValueRequired`.
    Required,
    /// `FieldValueDuplicate`.
    Duplicate,
    /// `FieldValueForbidden`.
    Forbidden,
    /// `FieldValueNotSupported`.
    NotSupported,
    /// `FieldValueTooLong`.
    TooLong,
}

impl FieldErrorKind {
    fn reason(self) -> &'static str {
        match self {
            FieldErrorKind::Invalid => "FieldValueInvalid",
            FieldErrorKind::Required => "FieldValueRequired",
            FieldErrorKind::Duplicate => "FieldValueDuplicate",
            FieldErrorKind::Forbidden => "FieldValueForbidden",
            FieldErrorKind::NotSupported => "FieldValueNotSupported",
            FieldErrorKind::TooLong => "FieldValueTooLong",
        }
    }
}

/// One validation error on one field (`field.Error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// What is wrong.
    pub kind: FieldErrorKind,
    /// The field path, e.g. `spec.ports[0].nodePort`.
    pub field: String,
    /// The offending value as Go's `%v`/`%q`/`%#v` would print it (see [`GoValue`]).
    pub value: Option<String>,
    /// The explanation.
    pub detail: String,
}

/// How a value is printed in a field error, as apimachinery's `field.Error.ErrorBody` does.
pub enum GoValue<'a> {
    /// An integer or boolean: `%v`.
    Int(i64),
    /// A string: `%q`.
    Str(&'a str),
    /// A list of strings: `%#v` of a `[]string`.
    Strings(&'a [String]),
    /// Already formatted.
    Raw(String),
}

impl fmt::Display for GoValue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GoValue::Int(v) => write!(f, "{v}"),
            GoValue::Str(s) => write!(f, "{s:?}"),
            GoValue::Strings(list) => {
                f.write_str("[]string{")?;
                for (i, s) in list.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{s:?}")?;
                }
                f.write_str("}")
            }
            GoValue::Raw(s) => f.write_str(s),
        }
    }
}

impl FieldError {
    /// `field.Invalid(path, value, detail)`.
    pub fn invalid(
        field: impl Into<String>,
        value: GoValue<'_>,
        detail: impl Into<String>,
    ) -> Self {
        FieldError {
            kind: FieldErrorKind::Invalid,
            field: field.into(),
            value: Some(value.to_string()),
            detail: detail.into(),
        }
    }

    /// `field.Required(path, detail)`.
    pub fn required(field: impl Into<String>, detail: impl Into<String>) -> Self {
        FieldError {
            kind: FieldErrorKind::Required,
            field: field.into(),
            value: None,
            detail: detail.into(),
        }
    }

    /// `field.Duplicate(path, value)`.
    pub fn duplicate(field: impl Into<String>, value: GoValue<'_>) -> Self {
        FieldError {
            kind: FieldErrorKind::Duplicate,
            field: field.into(),
            value: Some(value.to_string()),
            detail: String::new(),
        }
    }

    /// `field.Forbidden(path, detail)`.
    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        FieldError {
            kind: FieldErrorKind::Forbidden,
            field: field.into(),
            value: None,
            detail: detail.into(),
        }
    }

    /// `field.NotSupported(path, value, supported)`.
    pub fn not_supported(field: impl Into<String>, value: &str, supported: &[&str]) -> Self {
        let list: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
        FieldError {
            kind: FieldErrorKind::NotSupported,
            field: field.into(),
            value: Some(format!("{value:?}")),
            detail: format!("supported values: {}", list.join(", ")),
        }
    }

    /// `field.TooLong(path, value, max)`.
    pub fn too_long(field: impl Into<String>, max: usize) -> Self {
        FieldError {
            kind: FieldErrorKind::TooLong,
            field: field.into(),
            value: None,
            detail: format!("may not be more than {max} bytes"),
        }
    }

    /// `ErrorBody()`: the message without the field path.
    pub fn body(&self) -> String {
        let value = self.value.as_deref().unwrap_or("");
        let head = match self.kind {
            FieldErrorKind::Invalid => format!("Invalid value: {value}"),
            FieldErrorKind::Required => "Required value".to_owned(),
            FieldErrorKind::Duplicate => format!("Duplicate value: {value}"),
            FieldErrorKind::Forbidden => "Forbidden".to_owned(),
            FieldErrorKind::NotSupported => format!("Unsupported value: {value}"),
            FieldErrorKind::TooLong => "Too long".to_owned(),
        };
        if self.detail.is_empty() {
            head
        } else {
            format!("{head}: {}", self.detail)
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}

/// The group/resource/kind an error is about, for messages and `details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subject {
    /// API group, `""` for core.
    pub group: &'static str,
    /// Plural resource name, e.g. `services`.
    pub resource: &'static str,
    /// Kind, e.g. `Service`.
    pub kind: &'static str,
}

impl Subject {
    /// `services` or `endpointslices.discovery.k8s.io`, as apimachinery's `GroupResource.String()`.
    pub fn group_resource(&self) -> String {
        if self.group.is_empty() {
            self.resource.to_owned()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }

    /// `Service` or `EndpointSlice.discovery.k8s.io`, as apimachinery's `GroupKind.String()`.
    pub fn group_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_owned()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
struct Cause {
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
struct Details {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    uid: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    causes: Vec<Cause>,
    #[serde(rename = "retryAfterSeconds", skip_serializing_if = "Option::is_none")]
    retry_after_seconds: Option<u32>,
}

/// An error as the client sees it: a Kubernetes `Status` with `status: Failure`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    code: u16,
    reason: &'static str,
    message: String,
    details: Option<Box<Details>>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn with_subject(mut self, subject: Subject, name: &str) -> Self {
        self.details = Some(Box::new(Details {
            name: (!name.is_empty()).then(|| name.to_owned()),
            group: (!subject.group.is_empty()).then(|| subject.group.to_owned()),
            kind: Some(subject.resource.to_owned()),
            ..Details::default()
        }));
        self
    }

    /// The HTTP status code.
    pub fn code(&self) -> u16 {
        self.code
    }

    /// The `reason` (`NotFound`, `Invalid`, ...).
    pub fn reason(&self) -> &'static str {
        self.reason
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// 404 `services "x" not found`.
    pub fn not_found(subject: Subject, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", subject.group_resource()),
        )
        .with_subject(subject, name)
    }

    /// 404 for a path that names no resource: `the server could not find the requested resource`.
    pub fn no_route() -> Self {
        let mut e = Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        );
        e.details = Some(Box::default());
        e
    }

    /// 409 `services "x" already exists`.
    pub fn already_exists(subject: Subject, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} {name:?} already exists", subject.group_resource()),
        )
        .with_subject(subject, name)
    }

    /// 409 `Operation cannot be fulfilled on services "x": <why>`.
    pub fn conflict(subject: Subject, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {why}",
                subject.group_resource()
            ),
        )
        .with_subject(subject, name)
    }

    /// The `Conflict` for a stale `resourceVersion` (`registry.OptimisticLockErrorMsg`).
    pub fn modified(subject: Subject, name: &str) -> Self {
        Self::conflict(
            subject,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 `Service "x" is invalid: ...` with one cause per field error.
    pub fn invalid(subject: Subject, name: &str, errors: Vec<FieldError>) -> Self {
        // `ErrorList.ToAggregate`: a message given twice is written once (the causes keep both).
        let mut parts: Vec<String> = Vec::with_capacity(errors.len());
        for e in &errors {
            let text = e.to_string();
            if !parts.contains(&text) {
                parts.push(text);
            }
        }
        let joined = if parts.len() == 1 {
            parts.remove(0)
        } else {
            format!("[{}]", parts.join(", "))
        };
        // apimachinery's `NewInvalid` names the GroupKind.
        let mut e = Self::new(
            422,
            "Invalid",
            format!("{} {name:?} is invalid: {joined}", subject.group_kind()),
        );
        e.details = Some(Box::new(Details {
            name: Some(name.to_owned()),
            group: (!subject.group.is_empty()).then(|| subject.group.to_owned()),
            kind: Some(subject.kind.to_owned()),
            causes: errors
                .iter()
                .map(|fe| Cause {
                    reason: Some(fe.kind.reason().to_owned()),
                    message: Some(fe.body()),
                    field: Some(fe.field.clone()),
                })
                .collect(),
            ..Details::default()
        }));
        e
    }

    /// 422 `Invalid` without field causes (a patch that cannot be applied).
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(422, "Invalid", message)
    }

    /// 400 `BadRequest` with the given message.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 403 `Forbidden`: `<resource> "x" is forbidden: <why>`.
    pub fn forbidden(subject: Subject, name: &str, why: &str) -> Self {
        Self::new(
            403,
            "Forbidden",
            format!("{} {name:?} is forbidden: {why}", subject.group_resource()),
        )
        .with_subject(subject, name)
    }

    /// 403 `Forbidden` for any group and resource (apimachinery's `NewForbidden`):
    /// `<resource>[.<group>] ["<name>"] is forbidden: <why>`, or `forbidden: <why>` without a
    /// resource; `details` names the group, the resource (as `kind`) and the name.
    pub fn forbidden_resource(group: &str, resource: &str, name: &str, why: &str) -> Self {
        let qualified = if group.is_empty() {
            resource.to_owned()
        } else {
            format!("{resource}.{group}")
        };
        let message = match (qualified.is_empty(), name.is_empty()) {
            (true, _) => format!("forbidden: {why}"),
            (false, true) => format!("{qualified} is forbidden: {why}"),
            (false, false) => format!("{qualified} {name:?} is forbidden: {why}"),
        };
        let mut e = Self::new(403, "Forbidden", message);
        let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        e.details = Some(Box::new(Details {
            name: some(name),
            group: some(group),
            kind: some(resource),
            ..Details::default()
        }));
        e
    }

    /// Adds a cause to `details.causes` (e.g. the `NamespaceTerminating` cause of a create in a
    /// namespace that is being deleted).
    pub fn with_cause(mut self, reason: &str, message: impl Into<String>, field: &str) -> Self {
        let details = self.details.get_or_insert_with(Box::default);
        details.causes.push(Cause {
            reason: Some(reason.to_owned()),
            message: Some(message.into()),
            field: Some(field.to_owned()),
        });
        self
    }

    /// 405 `MethodNotAllowed`.
    pub fn method_not_supported(subject: Subject, action: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!(
                "{action} is not supported on resources of kind {:?}",
                subject.group_resource()
            ),
        )
    }

    /// 504 `Timeout: <message>` (`NewTimeoutError`).
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(504, "Timeout", format!("Timeout: {}", message.into()))
    }

    /// 410 `Expired` (`NewResourceExpired`).
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 413 for a body over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            "RequestEntityTooLarge",
            format!("Request entity too large: limit is {limit}"),
        )
    }

    /// 409 `Conflict` of a server-side apply (`errors.NewApplyConflict`): the message lists the
    /// conflicts; add one `FieldManagerConflict` cause per conflict with [`ApiError::with_cause`].
    pub fn apply_conflict(message: impl Into<String>) -> Self {
        Self::new(409, "Conflict", message)
    }

    /// 415 `UnsupportedMediaType`.
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(415, "UnsupportedMediaType", message)
    }

    /// 406 `NotAcceptable`.
    pub fn not_acceptable(message: impl Into<String>) -> Self {
        Self::new(406, "NotAcceptable", message)
    }

    /// 401 `Unauthorized`.
    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    /// 500 `Internal error occurred: <err>` (`NewInternalError`), with the raw error as the cause.
    pub fn internal(err: impl fmt::Display) -> Self {
        let raw = err.to_string();
        let mut e = Self::new(
            500,
            "InternalError",
            format!("Internal error occurred: {raw}"),
        );
        e.details = Some(Box::new(Details {
            causes: vec![Cause {
                message: Some(raw),
                ..Cause::default()
            }],
            ..Details::default()
        }));
        e
    }

    /// 500 with no reason: how kube-apiserver answers a plain error of its storage layer that
    /// no handler turned into a status (`ErrorToAPIStatus`); kubectl prints
    /// `Error from server: <message>`.
    pub fn unclassified(message: impl Into<String>) -> Self {
        Self::new(500, "", message)
    }

    /// 503 `ServiceUnavailable`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(503, "ServiceUnavailable", message);
        e.details = Some(Box::new(Details {
            retry_after_seconds: Some(1),
            ..Details::default()
        }));
        e
    }

    /// The `Status` document.
    pub fn to_status(&self) -> serde_json::Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if self.reason.is_empty() {
            // `StatusReasonUnknown` is `omitempty`.
            status.as_object_mut().expect("an object").remove("reason");
        }
        if let Some(details) = &self.details {
            status["details"] = serde_json::to_value(details).expect("details serialize");
        }
        status
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

impl From<storage::Error> for ApiError {
    fn from(err: storage::Error) -> Self {
        match &err {
            storage::Error::Compacted { .. } => ApiError::expired(err.to_string()),
            storage::Error::FutureRevision { requested, .. } => ApiError::new(
                504,
                "Timeout",
                format!("Too large resource version: {requested}"),
            ),
            storage::Error::WatcherLagged { .. } => ApiError::expired(err.to_string()),
            storage::Error::Closed => ApiError::unavailable(err.to_string()),
            storage::Error::Unavailable { .. } => ApiError::unavailable(err.to_string()),
            storage::Error::Timeout { .. } => ApiError::new(
                504,
                "Timeout",
                format!("Timeout: request did not complete within the allowed time: {err}"),
            ),
            storage::Error::Redb { .. }
            | storage::Error::Corrupt { .. }
            | storage::Error::Backend { .. }
            | storage::Error::InvalidBatch(_) => ApiError::internal(crate::report(&err)),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.code >= 500 && !matches!(self.code, 503 | 504) {
            tracing::error!(code = self.code, reason = self.reason, "{}", self.message);
        } else {
            // 503 and 504 mean the storage does not answer: the backend logs each outage once
            // (`storage::outage`), not each request that fails during it.
            tracing::debug!(code = self.code, reason = self.reason, "{}", self.message);
        }
        let status = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self.to_status()).expect("status serializes");
        (
            status,
            [(http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVICES: Subject = Subject {
        group: "",
        resource: "services",
        kind: "Service",
    };

    #[test]
    fn invalid_status_matches_kube_apiserver_wire_format() {
        let err = ApiError::invalid(
            SERVICES,
            "minio",
            vec![FieldError::invalid(
                "spec.ports[0].nodePort",
                GoValue::Int(30009),
                "provided port is already allocated",
            )],
        );
        assert_eq!(
            err.to_status(),
            json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
             "message":"Service \"minio\" is invalid: spec.ports[0].nodePort: Invalid value: 30009: provided port is already allocated",
             "reason":"Invalid",
             "details":{"name":"minio","kind":"Service",
               "causes":[{"reason":"FieldValueInvalid","message":"Invalid value: 30009: provided port is already allocated","field":"spec.ports[0].nodePort"}]},
             "code":422})
        );
    }

    #[test]
    fn several_field_errors_are_bracketed() {
        let err = ApiError::invalid(
            SERVICES,
            "x",
            vec![
                FieldError::required("spec.ports[0].name", ""),
                FieldError::not_supported(
                    "spec.ports[1].protocol",
                    "HTTP",
                    &["SCTP", "TCP", "UDP"],
                ),
            ],
        );
        assert_eq!(
            err.message(),
            "Service \"x\" is invalid: [spec.ports[0].name: Required value, spec.ports[1].protocol: Unsupported value: \"HTTP\": supported values: \"SCTP\", \"TCP\", \"UDP\"]"
        );
    }

    #[test]
    fn internal_error_keeps_the_raw_cause() {
        let err = ApiError::internal("failed to allocate a nodePort: range is full");
        assert_eq!(
            err.message(),
            "Internal error occurred: failed to allocate a nodePort: range is full"
        );
        assert_eq!(err.code(), 500);
    }
}
