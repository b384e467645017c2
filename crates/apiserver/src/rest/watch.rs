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
use futures::{FutureExt, StreamExt};
use http::{StatusCode, header};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::{AppState, Query, flag, limits, parse_revision, table};
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
        if self.table && event_type != "ERROR" && event_type != "BOOKMARK" {
            let rv = object
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str)
                .unwrap_or("");
            let table = table::table(
                self.kind,
                std::slice::from_ref(object),
                rv,
                None,
                "Metadata",
            );
            encode_line(event_type, &table)
        } else if self.kind == Kind::EventsV1 && !matches!(event_type, "ERROR" | "BOOKMARK") {
            encode_line(
                event_type,
                &registry::event::present(self.kind, object.clone()),
            )
        } else {
            encode_line(event_type, object)
        }
    }

    /// The line for a storage event: shared by every watcher of the event unless this one wants
    /// a Table.
    fn event_line(&self, shared: &Shared, change: Change) -> Bytes {
        let object = shared
            .current
            .as_ref()
            .expect("translated events have an object");
        if self.table || self.kind == Kind::EventsV1 {
            return self.line(change.event_type(), object);
        }
        shared.lines[change as usize]
            .get_or_init(|| encode_line(change.event_type(), object))
            .clone()
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

/// `{"type":"<event_type>","object":<object>}` and a newline, without copying the object.
fn encode_line(event_type: &str, object: &Value) -> Bytes {
    let mut line = Vec::with_capacity(1024);
    line.extend_from_slice(b"{\"type\":\"");
    line.extend_from_slice(event_type.as_bytes());
    line.extend_from_slice(b"\",\"object\":");
    serde_json::to_writer(&mut line, object).expect("events serialize");
    line.extend_from_slice(b"}\n");
    Bytes::from(line)
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
    let out = Out {
        tx,
        unresponsive: state.config.unresponsive_watch_timeout,
        limits: state.limits.clone(),
    };
    let interval = state.config.bookmark_interval;
    let mut shutting_down = state.shutting_down.clone();
    let watcher = state.limits.watcher();
    let task = async move {
        let _watcher = watcher;
        for object in initial {
            if !out
                .send(encoder.line("ADDED", &with_type(kind, object)))
                .await
            {
                return;
            }
        }
        if send_initial && bookmarks && !out.send(encoder.bookmark(after, true)).await {
            return;
        }
        let mut stream = match stream {
            Ok(stream) => stream,
            Err(err) => {
                out.send(encoder.line("ERROR", &ApiError::from(err).to_status()))
                    .await;
                return;
            }
        };
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let stopping = async move {
            let _ = shutting_down.wait_for(|down| *down).await;
        };
        tokio::pin!(stopping);
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        let mut delivered = after;
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                // The server is shutting down: the client will watch again elsewhere.
                () = &mut stopping => return,
                _ = ticker.tick(), if bookmarks => {
                    if !out.send(encoder.bookmark(delivered, false)).await {
                        return;
                    }
                }
                item = stream.next() => {
                    // Everything the stream has ready goes out as one chunk: one wake-up of the
                    // connection and one write for a whole committed batch.
                    let mut chunk = Vec::new();
                    let mut item = item;
                    let mut end = false;
                    loop {
                        match item {
                            None => end = true,
                            Some(Err(err)) => {
                                let status = match err {
                                    storage::Error::WatcherLagged { .. } => {
                                        ApiError::expired(err.to_string())
                                    }
                                    other => ApiError::from(other),
                                };
                                chunk.extend_from_slice(&encoder.line("ERROR", &status.to_status()));
                                end = true;
                            }
                            Some(Ok(WatchItem::Progress(rev))) => delivered = delivered.max(rev),
                            Some(Ok(WatchItem::Event(event))) => {
                                delivered = delivered.max(event.kv.mod_revision);
                                if let Some(line) = event_line(&encoder, &options, &event) {
                                    chunk.extend_from_slice(&line);
                                }
                            }
                        }
                        if end {
                            break;
                        }
                        match stream.next().now_or_never() {
                            Some(next) => item = next,
                            None => break,
                        }
                    }
                    if !chunk.is_empty() && !out.send(Bytes::from(chunk)).await {
                        return;
                    }
                    if end {
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

/// The line one watcher sends for a storage event, if its selectors let it see the event.
/// The watch's end of its response body.
struct Out {
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
    /// How long a send may wait for room before the client counts as gone.
    unresponsive: std::time::Duration,
    limits: std::sync::Arc<limits::Limits>,
}

impl Out {
    /// Sends one chunk; `false` when the watch must end: its client went away, or has read
    /// nothing while the body's buffer stayed full for [`Out::unresponsive`]. The watch then
    /// stops reading the store, so a client that never reads holds at most the buffer.
    async fn send(&self, chunk: Bytes) -> bool {
        match tokio::time::timeout(self.unresponsive, self.tx.send(Ok(chunk))).await {
            Ok(Ok(())) => true,
            Ok(Err(_)) => false,
            Err(_) => {
                tracing::info!(
                    waited = ?self.unresponsive,
                    "closing a watch whose client stopped reading"
                );
                self.limits.unresponsive_watcher_closed();
                false
            }
        }
    }
}

fn event_line(encoder: &Encoder, options: &ListOptions, event: &storage::Event) -> Option<Bytes> {
    let kind = encoder.kind;
    let shared = event.memo.get_or_init(|| Shared::new(kind, event));
    if shared.kind != kind {
        // Not expected (one prefix holds one kind), but stay correct.
        let own = Shared::new(kind, event);
        return translate(options, event, &own).map(|change| encoder.event_line(&own, change));
    }
    translate(options, event, &shared).map(|change| encoder.event_line(&shared, change))
}

/// The kind of Kubernetes watch event a storage event becomes for one watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Added = 0,
    Modified = 1,
    Deleted = 2,
}

impl Change {
    fn event_type(self) -> &'static str {
        match self {
            Change::Added => "ADDED",
            Change::Modified => "MODIFIED",
            Change::Deleted => "DELETED",
        }
    }
}

/// What every watcher of one storage event shares (kept in the event's [`storage::Memo`]): the
/// object decoded once, with its `kind`, `apiVersion` and `resourceVersion`, the object before
/// the change for selector checks, and each line once it has been encoded.
struct Shared {
    kind: Kind,
    current: Option<Value>,
    prev: Option<Value>,
    lines: [std::sync::OnceLock<Bytes>; 3],
}

impl Shared {
    fn new(kind: Kind, event: &storage::Event) -> Self {
        let decode = |kv: &storage::KeyValue, revision| {
            registry::decode_stored(&kv.value, revision)
                .ok()
                .map(|v| with_type(kind, v))
        };
        Shared {
            kind,
            current: decode(&event.kv, event.kv.mod_revision),
            prev: event.prev.as_ref().and_then(|prev| decode(prev, 0)),
            lines: Default::default(),
        }
    }
}

/// The Kubernetes event a storage event is for one watcher, after its selectors; `None` if the
/// watcher does not see it.
fn translate(options: &ListOptions, event: &storage::Event, shared: &Shared) -> Option<Change> {
    let current = shared.current.as_ref()?;
    let previous_matched = shared.prev.as_ref().map(|prev| matches(options, prev));
    match event.kind {
        EventKind::Delete => previous_matched.unwrap_or(false).then_some(Change::Deleted),
        EventKind::Put => {
            let now = matches(options, current);
            match (previous_matched, now) {
                (None, true) | (Some(false), true) => Some(Change::Added),
                (Some(true), true) => Some(Change::Modified),
                (Some(true), false) => Some(Change::Deleted),
                _ => None,
            }
        }
    }
}
