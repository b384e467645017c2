//! kube-rs against the server over a real socket: list + watch, resume from a resourceVersion,
//! and relist after `410 Gone`.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher;
use nodeport_apiserver::Config;

async fn start(config: Config) -> (kube::Client, tokio::task::JoinHandle<()>) {
    let state = nodeport_apiserver::in_memory(&config).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        nodeport_apiserver::serve(state, listener, std::future::pending())
            .await
            .unwrap();
    });
    let kube_config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    (kube::Client::try_from(kube_config).unwrap(), server)
}

fn svc(name: &str) -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name}, "spec": {"ports": [{"port": 80}]}
    }))
    .unwrap()
}

async fn next_event(
    stream: &mut (impl futures::Stream<Item = Result<watcher::Event<Service>, watcher::Error>> + Unpin),
) -> watcher::Event<Service> {
    tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("watcher event in time")
        .expect("stream open")
        .expect("no watcher error")
}

#[tokio::test]
async fn kube_rs_watcher_lists_then_follows_changes() {
    let (client, _server) = start(Config::default()).await;
    let api: Api<Service> = Api::namespaced(client, "default");
    let mut stream = watcher(api.clone(), watcher::Config::default()).boxed();
    assert!(matches!(
        next_event(&mut stream).await,
        watcher::Event::Init
    ));
    let first = next_event(&mut stream).await;
    assert!(
        matches!(first, watcher::Event::InitApply(ref s) if s.metadata.name.as_deref() == Some("kubernetes"))
    );
    assert!(matches!(
        next_event(&mut stream).await,
        watcher::Event::InitDone
    ));
    api.create(&PostParams::default(), &svc("a")).await.unwrap();
    match next_event(&mut stream).await {
        watcher::Event::Apply(s) => assert_eq!(s.metadata.name.as_deref(), Some("a")),
        other => panic!("unexpected {other:?}"),
    }
    api.delete("a", &Default::default()).await.unwrap();
    assert!(matches!(
        next_event(&mut stream).await,
        watcher::Event::Delete(_)
    ));
}

#[tokio::test]
async fn watch_resumes_from_a_resource_version() {
    let (client, _server) = start(Config::default()).await;
    let api: Api<Service> = Api::namespaced(client, "default");
    let a = api.create(&PostParams::default(), &svc("a")).await.unwrap();
    api.create(&PostParams::default(), &svc("b")).await.unwrap();
    api.create(&PostParams::default(), &svc("c")).await.unwrap();
    let rv = a.metadata.resource_version.unwrap();
    let mut events = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    let mut names = Vec::new();
    while names.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            WatchEvent::Added(s) => names.push(s.metadata.name.unwrap()),
            WatchEvent::Bookmark(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(names, ["b", "c"], "replay starts after the given version");
}

#[tokio::test]
async fn a_too_old_version_gets_410_and_the_watcher_relists() {
    let mut config = Config::default();
    config.storage.event_history = 4;
    // Watches end quickly, so the watcher re-watches from its last version.
    config.rest.watch_timeout = Duration::from_millis(500);
    let (client, _server) = start(config).await;
    let ns_api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    ns_api
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata":{"name":"other"}})).unwrap(),
        )
        .await
        .unwrap();
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let other: Api<Service> = Api::namespaced(client, "other");

    // A raw watch from version 1 is long gone: one ERROR event, 410 Expired.
    let mut raw = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    for i in 0..6 {
        other
            .create(&PostParams::default(), &svc(&format!("o{i}")))
            .await
            .unwrap();
    }
    drop(raw);
    let mut raw2 = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    match raw2.next().await.unwrap().unwrap() {
        WatchEvent::Error(e) => {
            assert_eq!(e.code, 410);
            assert_eq!(e.reason, "Expired");
            assert!(
                e.message.starts_with("too old resource version: 1 ("),
                "{}",
                e.message
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    raw = raw2;
    drop(raw);

    let mut stream = watcher(api.clone(), watcher::Config::default().disable_bookmarks()).boxed();
    assert!(matches!(
        next_event(&mut stream).await,
        watcher::Event::Init
    ));
    while !matches!(next_event(&mut stream).await, watcher::Event::InitDone) {}
    // Changes the watcher does not see (another namespace) push its version out of the log;
    // when its watch times out and it re-watches, it gets 410 and must list again.
    for i in 6..16 {
        other
            .create(&PostParams::default(), &svc(&format!("o{i}")))
            .await
            .unwrap();
    }
    let relisted = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.next().await {
                Some(Ok(watcher::Event::Init)) => return true,
                Some(_) => {}
                None => return false,
            }
        }
    })
    .await
    .expect("the watcher relisted after 410");
    assert!(relisted);
    while !matches!(next_event(&mut stream).await, watcher::Event::InitDone) {}
    api.create(&PostParams::default(), &svc("after"))
        .await
        .unwrap();
    match next_event(&mut stream).await {
        watcher::Event::Apply(s) => assert_eq!(s.metadata.name.as_deref(), Some("after")),
        other => panic!("unexpected {other:?}"),
    }
}
