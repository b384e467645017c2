//! Events, in their two forms: `core/v1` (`/api/v1/.../events`) and `events.k8s.io/v1`
//! (`/apis/events.k8s.io/v1/.../events`), one set of objects as in kube-apiserver, stored in the
//! core form under `/registry/events/<namespace>/<name>`.
//!
//! - Conversion is kube's (`pkg/apis/events/v1/conversion.go`): `regarding` is
//!   `involvedObject`, `note` is `message`, `reportingController` is `reportingComponent`, and
//!   `deprecatedSource`, `deprecatedFirstTimestamp`, `deprecatedLastTimestamp`,
//!   `deprecatedCount` are `source`, `firstTimestamp`, `lastTimestamp`, `count`.
//! - Validation is `pkg/apis/core/validation/events.go`: the legacy rules for every write, and
//!   the strict ones (name, `eventTime`, `type`, series, no deprecated fields) for writes through
//!   `events.k8s.io/v1`.
//! - Field selectors are the event strategy's (`involvedObject.*`, `reason`,
//!   `reportingComponent`, `source`, `type`); `events.k8s.io/v1` maps `regarding.*` and
//!   `reportingController` onto them, as its field label conversion does.
//! - Events expire `--event-ttl` (default 1 h) after they were last recorded (see
//!   [`last_recorded`]); kube-apiserver gives each write an etcd lease of that length.

use k8s_openapi::api::core::v1::Event;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Map, Value};

use super::validation::{self, NameRule};
use crate::error::{ApiError, FieldError, GoValue};
use crate::resource::Kind;

/// `--event-ttl`'s default: kube-apiserver keeps events for one hour.
pub const DEFAULT_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

/// `(events.k8s.io/v1 name, core/v1 name)` of the fields that differ.
const RENAMED: [(&str, &str); 7] = [
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("reportingController", "reportingComponent"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
];

/// A stored (core/v1) Event in the form `kind` serves: `events.k8s.io/v1` for
/// [`Kind::EventsV1`], unchanged otherwise (other kinds too).
pub fn present(kind: Kind, object: Value) -> Value {
    if kind != Kind::EventsV1 {
        return object;
    }
    let Value::Object(core) = object else {
        return object;
    };
    let mut out = Map::new();
    for (key, value) in core {
        let key = match RENAMED.iter().find(|(_, c)| *c == key) {
            Some((events, _)) => (*events).to_owned(),
            None => key,
        };
        out.insert(key, value);
    }
    if out.contains_key("apiVersion") {
        out.insert(
            "apiVersion".into(),
            Value::String(Kind::EventsV1.api_version().into()),
        );
    }
    // Go writes this form's `eventTime` (no `omitempty`) even when zero, as `null`.
    out.entry("eventTime").or_insert(Value::Null);
    Value::Object(out)
}

/// An `events.k8s.io/v1` body in the core form, with the paths of the fields that are core's
/// names and not the new form's (unknown there, as kube's decoder finds them).
pub fn to_core(body: &Value) -> (Value, Vec<String>) {
    let Value::Object(events) = body else {
        return (body.clone(), Vec::new());
    };
    let mut unknown = Vec::new();
    let mut out = Map::new();
    for (key, value) in events {
        if value.is_null() {
            // As if left out (the typed form reads both the same way).
            continue;
        }
        if RENAMED.iter().any(|(_, c)| c == key) {
            unknown.push(key.clone());
            continue;
        }
        let key = match RENAMED.iter().find(|(e, _)| e == key) {
            Some((_, core)) => (*core).to_owned(),
            None => key.clone(),
        };
        out.insert(key, value.clone());
    }
    if out.contains_key("apiVersion") {
        out.insert(
            "apiVersion".into(),
            Value::String(Kind::Event.api_version().into()),
        );
    }
    (Value::Object(out), unknown)
}

/// The name a top-level Event field has in the other form: the `events.k8s.io/v1` name of a
/// core one (`to_events`), or the core name of an `events.k8s.io/v1` one; `None` when both
/// forms call it the same.
pub fn renamed_field(name: &str, to_events: bool) -> Option<&'static str> {
    RENAMED.iter().find_map(|(events, core)| match to_events {
        true if *core == name => Some(*events),
        false if *events == name => Some(*core),
        _ => None,
    })
}

/// A field path of the core form renamed for the `events.k8s.io/v1` form (`involvedObject.foo`
/// is `regarding.foo` there).
pub fn events_path(path: &str) -> String {
    for (events, core) in RENAMED {
        if path == core {
            return events.to_owned();
        }
        if let Some(rest) = path.strip_prefix(core)
            && (rest.starts_with('.') || rest.starts_with('['))
        {
            return format!("{events}{rest}");
        }
    }
    path.to_owned()
}

/// The fields Events can be selected by, as `kind` names them.
pub fn selectable_fields(kind: Kind) -> &'static [&'static str] {
    if kind == Kind::EventsV1 {
        &[
            "reason",
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "regarding.apiVersion",
            "regarding.resourceVersion",
            "regarding.fieldPath",
            "reportingController",
            "source",
            "type",
            "metadata.namespace",
            "metadata.name",
        ]
    } else {
        &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
            "metadata.namespace",
            "metadata.name",
        ]
    }
}

/// An `events.k8s.io/v1` field label as the stored (core) form selects it
/// (`AddFieldLabelConversionsForEvent`).
pub fn core_field_label(label: &str) -> String {
    if let Some(rest) = label.strip_prefix("regarding.") {
        return format!("involvedObject.{rest}");
    }
    if label == "reportingController" {
        return "reportingComponent".to_owned();
    }
    label.to_owned()
}

/// The selectable value of `source`: `source.component`, else `reportingComponent` (the event
/// strategy's `ToSelectableFields`).
pub fn source_field(object: &Value) -> String {
    object
        .pointer("/source/component")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .or_else(|| object.get("reportingComponent").and_then(Value::as_str))
        .unwrap_or("")
        .to_owned()
}

const REPORTING_INSTANCE_LIMIT: usize = 128;
const ACTION_LIMIT: usize = 128;
const REASON_LIMIT: usize = 128;
const NOTE_LIMIT: usize = 1024;

fn text(field: &Option<String>) -> &str {
    field.as_deref().unwrap_or("")
}

/// `legacyValidateEvent`: the rules every Event write passes, through either API.
fn legacy(event: &Event) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let namespace = text(&event.metadata.namespace);
    let involved_ns = text(&event.involved_object.namespace);
    let mismatch = || {
        FieldError::invalid(
            "involvedObject.namespace",
            GoValue::Str(involved_ns),
            "does not match event.namespace",
        )
    };
    if event.event_time.is_none() {
        // An old-style event: its namespace follows the object's.
        if involved_ns.is_empty() {
            if !namespace.is_empty() && namespace != "default" {
                errs.push(mismatch());
            }
        } else if namespace != involved_ns {
            errs.push(mismatch());
        }
    } else {
        if involved_ns.is_empty() && namespace != "default" && namespace != "kube-system" {
            errs.push(mismatch());
        }
        let controller = text(&event.reporting_component);
        if controller.is_empty() {
            errs.push(FieldError::required("reportingController", ""));
        }
        for m in validation::qualified_name(controller) {
            errs.push(FieldError::invalid(
                "reportingController",
                GoValue::Str(controller),
                m,
            ));
        }
        let limited = [
            (
                "reportingInstance",
                text(&event.reporting_instance),
                REPORTING_INSTANCE_LIMIT,
            ),
            ("action", text(&event.action), ACTION_LIMIT),
            ("reason", text(&event.reason), REASON_LIMIT),
        ];
        for (field, value, limit) in limited {
            if value.is_empty() {
                errs.push(FieldError::required(field, ""));
            }
            if value.len() > limit {
                errs.push(FieldError::invalid(
                    field,
                    GoValue::Str(""),
                    format!("can have at most {limit} characters"),
                ));
            }
        }
        if text(&event.message).len() > NOTE_LIMIT {
            errs.push(FieldError::invalid(
                "message",
                GoValue::Str(""),
                format!("can have at most {NOTE_LIMIT} characters"),
            ));
        }
    }
    for m in validation::dns1123_subdomain(namespace) {
        errs.push(FieldError::invalid("namespace", GoValue::Str(namespace), m));
    }
    errs
}

/// `validateV1EventSeries`.
fn series(event: &Event) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if let Some(series) = &event.series {
        if series.count.unwrap_or(0) < 2 {
            errs.push(FieldError::invalid(
                "series.count",
                GoValue::Str(""),
                "should be at least 2",
            ));
        }
        if series.last_observed_time.is_none() {
            errs.push(FieldError::required("series.lastObservedTime", ""));
        }
    }
    errs
}

/// The checks kube-apiserver's `BeforeCreate` runs on any object's metadata: the name is a path
/// segment (`ValidatePathSegmentName`) and the namespace is set. (Only `events.k8s.io/v1` asks
/// for a DNS subdomain name.)
fn generic_meta(event: &Event) -> Vec<FieldError> {
    let mut errs: Vec<FieldError> =
        validation::object_meta(&event.metadata, true, NameRule::Dns1123Subdomain)
            .into_iter()
            .filter(|e| !(e.field == "metadata.name" && e.value.is_some()))
            .collect();
    if let Some(name) = event.metadata.name.as_deref().filter(|n| !n.is_empty()) {
        let bad = if name == "." || name == ".." {
            Some(format!("may not be '{name}'"))
        } else {
            ["/", "%"]
                .into_iter()
                .find(|c| name.contains(c))
                .map(|c| format!("may not contain '{c}'"))
        };
        if let Some(detail) = bad {
            errs.insert(
                0,
                FieldError::invalid("metadata.name", GoValue::Str(name), detail),
            );
        }
    }
    errs
}

/// `ValidateEventCreate` for a create through `kind`'s API, with the generic metadata checks.
pub fn validate_create(kind: Kind, event: &Event) -> Vec<FieldError> {
    let mut errs = legacy(event);
    if kind != Kind::EventsV1 {
        errs.extend(generic_meta(event));
        return errs;
    }
    errs.extend(validation::object_meta(
        &event.metadata,
        true,
        NameRule::Dns1123Subdomain,
    ));
    errs.extend(series(event));
    errs.extend(strict_fields(event));
    errs
}

/// The fields `events.k8s.io/v1` requires or forbids on create.
fn strict_fields(event: &Event) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if event.event_time.is_none() {
        errs.push(FieldError::required("eventTime", ""));
    }
    let event_type = text(&event.type_);
    if event_type != "Normal" && event_type != "Warning" {
        errs.push(FieldError::invalid(
            "type",
            GoValue::Str(""),
            format!("has invalid value: {event_type}"),
        ));
    }
    let unset = |field: &str| FieldError::invalid(field, GoValue::Str(""), "needs to be unset");
    if event.first_timestamp.is_some() {
        errs.push(unset("firstTimestamp"));
    }
    if event.last_timestamp.is_some() {
        errs.push(unset("lastTimestamp"));
    }
    if event.count.unwrap_or(0) != 0 {
        errs.push(unset("count"));
    }
    if event
        .source
        .as_ref()
        .is_some_and(|s| !text(&s.component).is_empty() || !text(&s.host).is_empty())
    {
        errs.push(unset("source"));
    }
    errs
}

/// A field's value as `field.Invalid` prints it: strings quoted, numbers plain, structs as JSON
/// (Go prints them with `%#v`).
fn printed(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        Value::Number(n) => n.to_string(),
        Value::Null => "\"\"".to_owned(),
        other => other.to_string(),
    }
}

/// `ValidateEventUpdate` for an update through `kind`'s API.
pub fn validate_update(kind: Kind, new: &Event, old: &Event) -> Vec<FieldError> {
    let mut errs = legacy(new);
    if kind != Kind::EventsV1 {
        return errs;
    }
    if new.series != old.series {
        errs.extend(series(new));
    }
    let (new_value, old_value) = (
        serde_json::to_value(new).unwrap_or_default(),
        serde_json::to_value(old).unwrap_or_default(),
    );
    // kube's list, `reason` twice included.
    let immutable = [
        "involvedObject",
        "reason",
        "message",
        "source",
        "firstTimestamp",
        "lastTimestamp",
        "count",
        "reason",
        "type",
        "eventTime",
        "action",
        "related",
        "reportingComponent",
        "reportingInstance",
    ];
    for field in immutable {
        let (a, b) = (
            new_value.get(field).unwrap_or(&Value::Null),
            old_value.get(field).unwrap_or(&Value::Null),
        );
        if a != b {
            let path = if field == "reportingComponent" {
                "reportingController"
            } else {
                field
            };
            errs.push(FieldError::invalid(
                path,
                GoValue::Raw(printed(a)),
                "field is immutable",
            ));
        }
    }
    errs
}

/// When a stored Event was last recorded: the latest of its `series.lastObservedTime`,
/// `lastTimestamp`, `eventTime`, `firstTimestamp` and `creationTimestamp`. Its TTL counts from
/// there. (kube-apiserver counts from the last write, with an etcd lease; recorders write those
/// times with every write, so the two agree for events written by recorders.)
pub fn last_recorded(event: &Value) -> Option<Timestamp> {
    [
        "/series/lastObservedTime",
        "/lastTimestamp",
        "/eventTime",
        "/firstTimestamp",
        "/metadata/creationTimestamp",
    ]
    .iter()
    .filter_map(|p| event.pointer(p).and_then(Value::as_str))
    .filter_map(|t| t.parse::<Timestamp>().ok())
    .max()
}

impl super::Registry {
    /// Deletes the Events last recorded more than `ttl` ago (see [`last_recorded`]); each
    /// only if it has not been written since it was read. Returns how many were deleted.
    pub async fn expire_events(&self, ttl: std::time::Duration) -> Result<usize, ApiError> {
        self.expire_events_at(Timestamp::now(), ttl).await
    }

    /// [`Registry::expire_events`] as of `now`.
    ///
    /// [`Registry::expire_events`]: super::Registry::expire_events
    pub async fn expire_events_at(
        &self,
        now: Timestamp,
        ttl: std::time::Duration,
    ) -> Result<usize, ApiError> {
        let ttl = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
        let all = self
            .list(Kind::Event, None, &super::ListOptions::default())
            .await?;
        let mut expired = 0;
        for event in &all.items {
            let Some(recorded) = last_recorded(event) else {
                continue;
            };
            if now.as_second().saturating_sub(recorded.as_second()) < ttl {
                continue;
            }
            let field = |p: &str| event.pointer(p).and_then(Value::as_str).unwrap_or("");
            let preconditions = super::Preconditions {
                uid: None,
                resource_version: Some(field("/metadata/resourceVersion").to_owned()),
            };
            match self
                .delete(
                    Kind::Event,
                    Some(field("/metadata/namespace")),
                    field("/metadata/name"),
                    preconditions,
                    super::WriteOptions::default(),
                )
                .await
            {
                Ok(_) => expired += 1,
                // Deleted meanwhile, or recorded again: not expired any more.
                Err(err) if matches!(err.code(), 404 | 409) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(expired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(value: Value) -> Event {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn the_two_forms_convert_field_for_field_as_kube_converts_them() {
        let core = json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e", "namespace": "ns"},
            "involvedObject": {"kind": "Service", "name": "web"}, "message": "hi", "reason": "R",
            "reportingComponent": "c", "source": {"component": "c"}, "count": 2,
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:01Z", "type": "Normal"});
        let events = present(Kind::EventsV1, core.clone());
        assert_eq!(
            events,
            json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e", "namespace": "ns"},
                "regarding": {"kind": "Service", "name": "web"}, "note": "hi", "reason": "R",
                "reportingController": "c", "deprecatedSource": {"component": "c"}, "deprecatedCount": 2,
                "deprecatedFirstTimestamp": "2026-01-01T00:00:00Z",
                "deprecatedLastTimestamp": "2026-01-01T00:00:01Z", "type": "Normal", "eventTime": null})
        );
        let (back, unknown) = to_core(&events);
        assert!(unknown.is_empty());
        assert_eq!(back, core);
        assert_eq!(present(Kind::Event, core.clone()), core);
        // Core's names are unknown fields of the new form.
        let (_, unknown) = to_core(&json!({"message": "x", "note": "y"}));
        assert_eq!(unknown, ["message"]);
        assert_eq!(events_path("involvedObject.foo"), "regarding.foo");
        assert_eq!(events_path("involvedObjects"), "involvedObjects");
    }

    #[test]
    fn legacy_validation_ties_the_namespace_to_the_involved_object() {
        let ok = event(json!({"metadata": {"name": "e", "namespace": "ns"},
            "involvedObject": {"kind": "Service", "name": "web", "namespace": "ns"}}));
        assert!(validate_create(Kind::Event, &ok).is_empty());
        let bad = event(json!({"metadata": {"name": "e", "namespace": "ns"},
            "involvedObject": {"kind": "Service", "name": "web", "namespace": "other"}}));
        let errs = validate_create(Kind::Event, &bad);
        assert_eq!(
            errs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["involvedObject.namespace: Invalid value: \"other\": does not match event.namespace"]
        );
        // A cluster-scoped object's events go to `default`.
        let node = event(json!({"metadata": {"name": "n.1", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": "n"}}));
        assert!(validate_create(Kind::Event, &node).is_empty());
    }

    #[test]
    fn new_style_events_need_controller_instance_action_and_reason() {
        let e = event(json!({"metadata": {"name": "e", "namespace": "default"},
            "eventTime": "2026-01-01T00:00:00.000000Z", "reportingComponent": "ctl",
            "involvedObject": {"kind": "Node", "name": "n"}}));
        let errs: Vec<String> = validate_create(Kind::Event, &e)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            errs,
            [
                "reportingInstance: Required value",
                "action: Required value",
                "reason: Required value"
            ]
        );
    }

    #[test]
    fn events_k8s_io_creates_are_validated_strictly() {
        let e = event(json!({"metadata": {"name": "E", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": "n"}, "type": "Info", "count": 3}));
        let errs: Vec<String> = validate_create(Kind::EventsV1, &e)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert!(
            errs.iter()
                .any(|e| e.starts_with("metadata.name: Invalid value: \"E\"")),
            "{errs:?}"
        );
        assert!(
            errs.contains(&"eventTime: Required value".to_owned()),
            "{errs:?}"
        );
        assert!(
            errs.contains(&"type: Invalid value: \"\": has invalid value: Info".to_owned()),
            "{errs:?}"
        );
        assert!(
            errs.contains(&"count: Invalid value: \"\": needs to be unset".to_owned()),
            "{errs:?}"
        );
    }

    #[test]
    fn the_last_recorded_time_is_the_latest_of_the_events_times() {
        let e = json!({"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
            "eventTime": "2026-01-01T00:00:05.000000Z",
            "series": {"count": 2, "lastObservedTime": "2026-01-01T00:10:00.000000Z"}});
        assert_eq!(
            last_recorded(&e).unwrap().to_string(),
            "2026-01-01T00:10:00Z"
        );
        assert!(last_recorded(&json!({})).is_none());
    }
}
