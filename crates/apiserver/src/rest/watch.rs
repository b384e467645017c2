//! Watch: `?watch=true` streams of `{"type": ..., "object": ...}` lines.
//!
//! Semantics follow kube-apiserver's watch cache:
//! - `resourceVersion` unset or `"0"`: synthetic `ADDED` events for the current state, then the
//!   changes after it; an explicit version: every change after it, replayed from the event log;
//! - `sendInitialEvents=true` (streaming lists, kube-rs' `InitialListStrategy::StreamingList`):
//!   the current state as `ADDED`, then a `BOOKMARK` annotated `k8s.io/initial-events-end`;
//! - a version older than the log: HTTP 200 and one `ERROR` event with a `410 Expired` Status,
//!   `too old resource version: X (Y)` (the cacher's error watcher; clients relist on it);
//! - `allowWatchBookmarks=true`: a `BOOKMARK` with the latest delivered revision every
//!   [`super::Config::bookmark_interval`];
//! - selectors are applied to the old and the new object, so an object that stops matching is
//!   reported `DELETED` and one that starts matching `ADDED`.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures::StreamExt;
use http::{StatusCode, header};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::{AppState, Query, flag, parse_revision, table};
use crate::error::ApiError;
use crate::registry::{self, ListOptions, selector};
use crate::resource::Kind;
use crate::storage::{self, EventKind, WatchItem};

struct Encoder {
    kind: Kind,
    table: bool,
}

impl Encoder {
    fn line(&self, event_type: &str, object: &Value) -> Bytes {
        let object = if self.table && event_type != "ERROR" && event_type != "BOOKMARK" {
            let rv = object
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str)
                .unwrap_or("");
            table::table(
                self.kind,
                std::slice::from_ref(object),
                rv,
                None,
                "Metadata",
            )
        } else {
            object.clone()
        };
        let mut line = serde_json::to_vec(&json!({"type": event_type, "object": object}))
            .expect("events serialize");
        line.push(b'\n');
        Bytes::from(line)
    }

    fn bookmark(&self, revision: i64, initial_end: bool) -> Bytes {
        let mut metadata =
            json!({"resourceVersion": revision.to_string(), "creationTimestamp": null});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        self.line(
            "BOOKMARK",
            &json!({"kind": self.kind.kind(), "apiVersion": self.kind.api_version(), "metadata": metadata}),
        )
    }
}

fn with_type(kind: Kind, mut object: Value) -> Value {
    if let Value::Object(m) = &mut object {
        m.insert("kind".into(), json!(kind.kind()));
        m.insert("apiVersion".into(), json!(kind.api_version()));
    }
    object
}

fn matches(options: &ListOptions, object: &Value) -> bool {
    options.fields.matches(object) && options.labels.matches(&selector::labels_of(object))
}

/// Starts a watch and returns the streaming response.
pub async fn serve(
    state: AppState,
    kind: Kind,
    namespace: Option<String>,
    options: ListOptions,
    query: &Query,
    accept: &str,
) -> Result<Response, ApiError> {
    let encoder = Encoder {
        kind,
        table: table::wants_table(accept),
    };
    let bookmarks = flag(query, "allowWatchBookmarks");
    let send_initial = flag(query, "sendInitialEvents");
    let rv = query.get("resourceVersion").cloned().unwrap_or_default();
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|t| *t > 0)
        .map(std::time::Duration::from_secs)
        .unwrap_or(state.config.watch_timeout);

    let mut initial = Vec::new();
    let after = if rv.is_empty() || rv == "0" || send_initial {
        let list = state
            .registry
            .list(
                kind,
                namespace.as_deref(),
                &ListOptions {
                    limit: 0,
                    continue_token: None,
                    exact_revision: None,
                    ..options.clone()
                },
            )
            .await?;
        initial = list.items;
        list.revision
    } else {
        parse_revision(&rv)?
    };

    let prefix = kind.list_prefix(state.registry.store().prefix(), namespace.as_deref());
    let stream = state.registry.store().backend().watch(prefix, after).await;

    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(256);
    let interval = state.config.bookmark_interval;
    let task = async move {
        for object in initial {
            if tx
                .send(Ok(encoder.line("ADDED", &with_type(kind, object))))
                .await
                .is_err()
            {
                return;
            }
        }
        if send_initial && bookmarks && tx.send(Ok(encoder.bookmark(after, true))).await.is_err() {
            return;
        }
        let mut stream = match stream {
            Ok(stream) => stream,
            Err(err) => {
                let _ = tx
                    .send(Ok(encoder.line("ERROR", &ApiError::from(err).to_status())))
                    .await;
                return;
            }
        };
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        let mut delivered = after;
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                _ = ticker.tick(), if bookmarks => {
                    if tx.send(Ok(encoder.bookmark(delivered, false))).await.is_err() {
                        return;
                    }
                }
                item = stream.next() => {
                    let line = match item {
                        None => return,
                        Some(Err(err @ storage::Error::WatcherLagged { .. })) => {
                            let status = ApiError::expired(err.to_string()).to_status();
                            let _ = tx.send(Ok(encoder.line("ERROR", &status))).await;
                            return;
                        }
                        Some(Err(err)) => {
                            let _ = tx.send(Ok(encoder.line("ERROR", &ApiError::from(err).to_status()))).await;
                            return;
                        }
                        Some(Ok(WatchItem::Progress(rev))) => {
                            delivered = delivered.max(rev);
                            continue;
                        }
                        Some(Ok(WatchItem::Event(event))) => {
                            delivered = delivered.max(event.kv.mod_revision);
                            match translate(kind, &options, &event) {
                                Some((event_type, object)) => encoder.line(event_type, &object),
                                None => continue,
                            }
                        }
                    };
                    if tx.send(Ok(line)).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::spawn(task.instrument(tracing::debug_span!("watch", kind = kind.resource())));

    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::TRANSFER_ENCODING, "chunked")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .expect("valid response"))
}

/// The Kubernetes event for a storage event, after selectors; `None` if the watcher does not see it.
fn translate(
    kind: Kind,
    options: &ListOptions,
    event: &storage::Event,
) -> Option<(&'static str, Value)> {
    let decode = |kv: &storage::KeyValue| {
        registry::decode_stored(&kv.value, kv.mod_revision)
            .ok()
            .map(|v| with_type(kind, v))
    };
    let current = decode(&event.kv)?;
    let previous_matched = event
        .prev
        .as_ref()
        .and_then(decode)
        .map(|prev| matches(options, &prev));
    match event.kind {
        EventKind::Delete => previous_matched
            .unwrap_or(false)
            .then_some(("DELETED", current)),
        EventKind::Put => {
            let now = matches(options, &current);
            match (previous_matched, now) {
                (None, true) | (Some(false), true) => Some(("ADDED", current)),
                (Some(true), true) => Some(("MODIFIED", current)),
                (Some(true), false) => Some(("DELETED", current)),
                _ => None,
            }
        }
    }
}
