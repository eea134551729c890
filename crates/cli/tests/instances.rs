//! Many instances, one store: three `onceguard serve` processes on one PostgreSQL, then on one
//! Redis, take 2,000 keys × 8 concurrent duplicate claims spread over them.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::{Server, postgres_store, redis_store, three_instances};
use serde_json::{Value, json};
use tokio::sync::{Mutex, Semaphore};

const KEYS: usize = 2_000;
const DUPLICATES: usize = 8;

/// Every key claimed 8 times at once across the instances (waiting up to 10 s for the
/// holder): exactly one acquisition per key; afterwards every instance replays every key
/// byte for byte.
async fn duplicates_across_instances(servers: &[Server], token: &str) -> (usize, usize, usize) {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let limit = Arc::new(Semaphore::new(48));
    let stored: Arc<Mutex<HashMap<usize, String>>> = Arc::default();
    let mut tasks = Vec::with_capacity(KEYS * DUPLICATES);
    for key in 0..KEYS {
        for dup in 0..DUPLICATES {
            let base = servers[(key + dup) % servers.len()].base.clone();
            let (client, token, limit, stored) = (client.clone(), token.to_owned(), limit.clone(), stored.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = limit.acquire_owned().await.unwrap();
                let body =
                    json!({"namespace": "many", "key": format!("key-{key}"), "request": {"key": key}, "wait": "10s"});
                let response =
                    client.post(format!("{base}/v1/claims")).bearer_auth(&token).json(&body).send().await.unwrap();
                match response.status().as_u16() {
                    201 => {
                        let acquired: Value = response.json().await.unwrap();
                        let result = format!(r#"{{"key":{key},"by":"{base}","dup":{dup}}}"#);
                        let complete = format!(
                            r#"{{"namespace":"many","key":"key-{key}","fence":{},"result":{result}}}"#,
                            acquired["fence"]
                        );
                        let done = client
                            .post(format!("{base}/v1/claims/complete"))
                            .bearer_auth(&token)
                            .header("content-type", "application/json")
                            .body(complete)
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(done.status(), 200);
                        stored.lock().await.insert(key, result);
                        "acquired"
                    }
                    200 => "replay",
                    409 => "in_flight",
                    other => panic!("unexpected {other}: {}", response.text().await.unwrap()),
                }
            }));
        }
    }
    let (mut acquired, mut replayed, mut in_flight) = (0, 0, 0);
    for task in tasks {
        match task.await.unwrap() {
            "acquired" => acquired += 1,
            "replay" => replayed += 1,
            _ => in_flight += 1,
        }
    }
    let stored = stored.lock().await;
    assert_eq!(stored.len(), KEYS);
    for server in servers {
        for key in (0..KEYS).step_by(7) {
            let body = json!({"namespace": "many", "key": format!("key-{key}"), "request": {"key": key}});
            let response =
                client.post(format!("{}/v1/claims", server.base)).bearer_auth(token).json(&body).send().await.unwrap();
            assert_eq!(response.status(), 200);
            let text = response.text().await.unwrap();
            assert!(
                text.contains(&format!(r#""result":{}"#, stored[&key])),
                "{} replays key {key} differently: {text}",
                server.base
            );
        }
    }
    (acquired, replayed, in_flight)
}

/// Runs the duplicates on three instances of `store`, named `label`, and checks exactly one
/// acquisition per key.
async fn three_instances_on(label: &str, store: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (servers, token) = three_instances(dir.path(), store);
    let started = std::time::Instant::now();
    let (acquired, replayed, in_flight) = duplicates_across_instances(&servers, &token).await;
    println!(
        "{label}, 3 instances: {KEYS} keys x {DUPLICATES} duplicates in {:.1}s: {acquired} acquired, {replayed} replays, {in_flight} in flight",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(acquired, KEYS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_postgres() {
    if let Some(store) = postgres_store("PostgreSQL many-instances test") {
        three_instances_on("postgres", &store.url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_redis() {
    if let Some(store) = redis_store("Redis many-instances test") {
        three_instances_on("redis", &store.url).await;
    }
}
