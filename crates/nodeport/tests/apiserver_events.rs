//! Events with the real kubectl: an event about a Service posted as a controller posts it, once
//! in JSON through core/v1 (client-go's legacy recorder) and once in protobuf through
//! `events.k8s.io/v1` (the new recorder), then `kubectl get events`, `kubectl events` and the
//! Events section of `kubectl describe svc`.

mod apiserver_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use apiserver_support::{Server, kubectl_available, text};
use prost::Message;

fn ok(server: &Server, args: &[&str]) -> String {
    let out = server.kubectl(args);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "kubectl {args:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

/// One POST with the given body and content type; `(status, body)`.
fn post(port: u16, path: &str, content_type: &str, body: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(body).unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, text.split_once("\r\n\r\n").unwrap().1.to_owned())
}

/// An events.k8s.io/v1 Event in apimachinery's protobuf envelope.
fn protobuf_event(event: &k8s_pb::api::events::v1::Event) -> Vec<u8> {
    let unknown = k8s_pb::apimachinery::pkg::runtime::Unknown {
        type_meta: Some(k8s_pb::apimachinery::pkg::runtime::TypeMeta {
            api_version: Some("events.k8s.io/v1".into()),
            kind: Some("Event".into()),
        }),
        raw: Some(event.encode_to_vec()),
        content_encoding: Some(String::new()),
        content_type: Some(String::new()),
    };
    let mut body = b"k8s\0".to_vec();
    body.extend(unknown.encode_to_vec());
    body
}

#[test]
fn kubectl_get_events_events_and_describe_show_events_posted_in_json_and_protobuf() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    ok(
        &server,
        &["create", "service", "nodeport", "web", "--tcp=80:8080"],
    );
    let uid = ok(
        &server,
        &["get", "svc", "web", "-o", "jsonpath={.metadata.uid}"],
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let stamp = k8s_pb_time(now);

    // client-go's legacy recorder: core/v1, JSON.
    let legacy = serde_json::json!({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": format!("web.{now:x}"), "namespace": "default"},
        "involvedObject": {"kind": "Service", "namespace": "default", "name": "web", "uid": uid,
            "apiVersion": "v1"},
        "reason": "EnsuringLoadBalancer", "message": "posted in JSON",
        "source": {"component": "service-controller"},
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1, "type": "Normal"});
    let (status, body) = post(
        server.port,
        "/api/v1/namespaces/default/events",
        "application/json",
        legacy.to_string().as_bytes(),
    );
    assert_eq!(status, 201, "{body}");

    // client-go's new recorder: events.k8s.io/v1, protobuf.
    let event = k8s_pb::api::events::v1::Event {
        metadata: Some(k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(format!("web.{now:x}1")),
            namespace: Some("default".into()),
            ..Default::default()
        }),
        event_time: Some(k8s_pb::apimachinery::pkg::apis::meta::v1::MicroTime {
            seconds: Some(now as i64),
            nanos: Some(0),
        }),
        reporting_controller: Some("example.com/checker".into()),
        reporting_instance: Some("checker-1".into()),
        action: Some("Check".into()),
        reason: Some("Unhealthy".into()),
        regarding: Some(k8s_pb::api::core::v1::ObjectReference {
            kind: Some("Service".into()),
            namespace: Some("default".into()),
            name: Some("web".into()),
            uid: Some(uid.clone()),
            api_version: Some("v1".into()),
            ..Default::default()
        }),
        note: Some("posted in protobuf".into()),
        r#type: Some("Warning".into()),
        ..Default::default()
    };
    let (status, body) = post(
        server.port,
        "/apis/events.k8s.io/v1/namespaces/default/events",
        "application/vnd.kubernetes.protobuf",
        &protobuf_event(&event),
    );
    assert_eq!(status, 201, "{body}");

    let table = ok(&server, &["get", "events"]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("LAST SEEN")
            && lines[0].contains("TYPE")
            && lines[0].contains("OBJECT"),
        "{table}"
    );
    for (kind, reason, message) in [
        ("Normal", "EnsuringLoadBalancer", "posted in JSON"),
        ("Warning", "Unhealthy", "posted in protobuf"),
    ] {
        assert!(
            lines.iter().any(|l| l.contains(kind)
                && l.contains(reason)
                && l.contains("service/web")
                && l.contains(message)),
            "{table}"
        );
    }

    let events = ok(&server, &["events", "--for", "service/web"]);
    assert!(
        events.contains("posted in JSON") && events.contains("posted in protobuf"),
        "{events}"
    );

    let described = ok(&server, &["describe", "svc", "web"]);
    let section = described
        .split_once("Events:")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no Events section:\n{described}"));
    assert!(
        section.contains("EnsuringLoadBalancer")
            && section.contains("posted in JSON")
            && section.contains("service-controller")
            && section.contains("Unhealthy")
            && section.contains("posted in protobuf"),
        "{described}"
    );

    // The same objects through events.k8s.io/v1, with that API's names.
    let notes = ok(
        &server,
        &[
            "get",
            "events.v1.events.k8s.io",
            "--field-selector",
            "regarding.name=web",
            "-o",
            "jsonpath={range .items[*]}{.note}/{.reportingController}{\"\\n\"}{end}",
        ],
    );
    assert!(
        notes.contains("posted in JSON/")
            && notes.contains("posted in protobuf/example.com/checker"),
        "{notes}"
    );
}

/// RFC 3339 in whole seconds, UTC.
fn k8s_pb_time(secs: u64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(secs as i64)
        .unwrap()
        .to_string()
}

/// kube's field manager records a write in the version of its request: an Event created with
/// `kubectl create` through `events.k8s.io/v1` is owned in that version's field names
/// (`f:regarding`, `f:note`, `apiVersion: events.k8s.io/v1`), and reads the same through both
/// group versions (managedFields are not converted); a later server-side apply through core/v1
/// of a field the creator owns conflicts, named in the creator's version.
#[test]
fn an_events_k8s_io_event_records_its_managed_fields_in_the_version_of_the_request() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let file = dir.path().join("event.yaml");
    std::fs::write(
        &file,
        "apiVersion: events.k8s.io/v1\nkind: Event\nmetadata: {name: web.1, namespace: default}\n\
         eventTime: \"2026-01-01T00:00:00.000000Z\"\nreportingController: example.com/checker\n\
         reportingInstance: checker-1\naction: Check\nreason: Unhealthy\ntype: Warning\n\
         note: created through events.k8s.io\n\
         regarding: {kind: Service, namespace: default, name: web, apiVersion: v1}\n",
    )
    .unwrap();
    ok(&server, &["create", "-f", file.to_str().unwrap()]);
    let expected = serde_json::json!([{
        "manager": "kubectl-create", "operation": "Update", "apiVersion": "events.k8s.io/v1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {
            "f:action": {}, "f:eventTime": {}, "f:note": {}, "f:reason": {},
            "f:regarding": {}, "f:reportingController": {}, "f:reportingInstance": {},
            "f:type": {},
        },
    }]);
    for path in [
        "/apis/events.k8s.io/v1/namespaces/default/events/web.1",
        "/api/v1/namespaces/default/events/web.1",
    ] {
        let read: serde_json::Value =
            serde_json::from_str(&ok(&server, &["get", "--raw", path])).unwrap();
        let mut managed = read["metadata"]["managedFields"].clone();
        managed[0].as_object_mut().unwrap().remove("time");
        assert_eq!(managed, expected, "{path}: {read}");
    }
    let core = dir.path().join("core.yaml");
    std::fs::write(
        &core,
        "apiVersion: v1\nkind: Event\nmetadata: {name: web.1, namespace: default}\n\
         message: applied through core\n\
         involvedObject: {kind: Service, namespace: default, name: web, apiVersion: v1}\n",
    )
    .unwrap();
    let out = server.kubectl(&[
        "apply",
        "--server-side",
        "--field-manager=other",
        "-f",
        core.to_str().unwrap(),
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(r#"conflict with "kubectl-create" using events.k8s.io/v1: .note"#),
        "{stderr}"
    );
}
