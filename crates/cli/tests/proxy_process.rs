//! `onceguard proxy` as a process: a completed record survives kill -9, and the restarted proxy
//! replays it without running the upstream again.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::routing::post;
use common::spawn;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_replays_without_running_again() {
    let executions = Arc::new(AtomicUsize::new(0));
    let counter = executions.clone();
    let upstream = Router::new().route(
        "/tickets",
        post(move || {
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (axum::http::StatusCode::CREATED, format!(r#"{{"ticket":{n}}}"#)) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, upstream).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("proxy.db").display());
    let args = [
        "--store",
        &store,
        "proxy",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream_url,
        "--lease",
        "2s",
        "--retention",
        "1h",
    ];
    let client = reqwest::Client::new();
    let post = |base: String| {
        let client = client.clone();
        async move {
            client
                .post(format!("{base}/tickets"))
                .bearer_auth("agent-a")
                .header("Idempotency-Key", "ticket-42")
                .body("open")
                .send()
                .await
                .unwrap()
        }
    };

    let mut first = spawn(dir.path(), &args, &[]);
    let created = post(first.base.clone()).await;
    assert_eq!(created.status(), 201);
    let body = created.text().await.unwrap();
    first.child.kill().unwrap(); // SIGKILL
    first.child.wait().unwrap();

    let second = spawn(dir.path(), &args, &[]);
    let replay = post(second.base.clone()).await;
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), body);
    assert_eq!(executions.load(Ordering::SeqCst), 1, "the upstream ran once");
}
