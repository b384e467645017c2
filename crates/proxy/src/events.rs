//! The Events kube-proxy posts: at start, `Starting` (action `StartKubeProxy`) about its Node,
//! through `events.k8s.io/v1` as client-go's new event recorder sends it (kube-proxy's
//! `server.go`: `Recorder.Eventf(nodeRef, nil, Normal, "Starting", "StartKubeProxy", "")`).

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

/// kube-proxy's reporting controller name.
pub const REPORTING_CONTROLLER: &str = "kube-proxy";

/// How often a failed post is tried again, and how many times in all (client-go's broadcaster
/// tries 12 times, 10 s apart; the first tries here are quicker, for a server still starting).
const RETRY_EVERY: Duration = Duration::from_secs(2);
const ATTEMPTS: u32 = 12;

/// The `Starting` Event about `node_name`, recorded now by an instance on `host`.
pub fn starting(node_name: &str, host: &str) -> Event {
    let now = k8s_openapi::jiff::Timestamp::now();
    Event {
        metadata: ObjectMeta {
            // client-go names an event `<object name>.<nanoseconds in hex>`; events about
            // cluster-scoped objects go to `default`.
            name: Some(format!("{node_name}.{:x}", now.as_nanosecond())),
            namespace: Some("default".to_owned()),
            ..Default::default()
        },
        // kube-proxy's node reference: the node name stands for its UID.
        regarding: Some(ObjectReference {
            kind: Some("Node".to_owned()),
            name: Some(node_name.to_owned()),
            uid: Some(node_name.to_owned()),
            ..Default::default()
        }),
        event_time: Some(MicroTime(now)),
        reason: Some("Starting".to_owned()),
        action: Some("StartKubeProxy".to_owned()),
        type_: Some("Normal".to_owned()),
        reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
        // client-go: `<controller>-<os.Hostname()>`.
        reporting_instance: Some(format!("{REPORTING_CONTROLLER}-{host}")),
        ..Default::default()
    }
}

/// Posts the `Starting` Event about `node_name`, trying again while the API server does not
/// take it; gives up with a warning (events are best effort, as in kube-proxy).
pub async fn post_starting(client: kube::Client, node_name: String) {
    let host = crate::nix_hostname().unwrap_or_else(|_| node_name.clone());
    let api = kube::Api::<Event>::namespaced(client, "default");
    let event = starting(&node_name, &host);
    for attempt in 1..=ATTEMPTS {
        match api.create(&kube::api::PostParams::default(), &event).await {
            Ok(_) => {
                tracing::debug!(node = %node_name, "posted the Starting event");
                return;
            }
            Err(e) if attempt == ATTEMPTS => {
                tracing::warn!(error = %e, "cannot post the Starting event; giving up");
            }
            Err(e) => {
                tracing::debug!(error = %e, attempt, "cannot post the Starting event yet");
                tokio::time::sleep(RETRY_EVERY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_starting_event_is_kube_proxys() {
        let event = starting("node-a", "host-1");
        let json = serde_json::to_value(&event).unwrap();
        assert_eq!(json["regarding"]["kind"], "Node");
        assert_eq!(json["regarding"]["uid"], "node-a");
        assert_eq!(json["reason"], "Starting");
        assert_eq!(json["action"], "StartKubeProxy");
        assert_eq!(json["reportingController"], "kube-proxy");
        assert_eq!(json["reportingInstance"], "kube-proxy-host-1");
        assert_eq!(json["metadata"]["namespace"], "default");
        assert!(
            json["metadata"]["name"]
                .as_str()
                .unwrap()
                .starts_with("node-a.")
        );
    }
}
