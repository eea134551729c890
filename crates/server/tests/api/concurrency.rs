//! Duplicates fired concurrently through the API.

use std::collections::HashMap;
use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::json;
use tokio::sync::Mutex;

use crate::helpers::{Backing, spawn_app};

/// 64 tasks × the same 100 keys: exactly 100 acquisitions; every other answer is a replay or
/// in flight; every replay is byte-identical to what its acquirer stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_the_same_hundred_keys() {
    for backing in [Backing::Memory, Backing::Sqlite] {
        let app = Arc::new(spawn_app(backing).await);
        let stored: Arc<Mutex<HashMap<String, String>>> = Arc::default();
        let replays: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let tasks = (0..64).map(|task| {
            let (app, stored, replays) = (app.clone(), stored.clone(), replays.clone());
            tokio::spawn(async move {
                let (mut acquired, mut in_flight, mut replayed) = (0, 0, 0);
                for i in 0..100 {
                    let key = format!("key-{:03}", (i + task) % 100);
                    let body = json!({"namespace": "load", "key": key, "request": {"k": key}});
                    let response = app.post(&app.agent, "/v1/claims", &body).await;
                    match response.status() {
                        StatusCode::CREATED => {
                            acquired += 1;
                            let a: serde_json::Value = response.json().await.unwrap();
                            let result = format!(r#"{{"by":{task},"key":"{key}","n":[{i}, {task}]}}"#);
                            let complete = format!(
                                r#"{{"namespace":"load","key":"{key}","fence":{},"result":{result}}}"#,
                                a["fence"]
                            );
                            let done = app.post_raw(&app.agent, "/v1/claims/complete", complete).await;
                            assert_eq!(done.status(), StatusCode::OK);
                            stored.lock().await.insert(key, result);
                        }
                        StatusCode::OK => {
                            replayed += 1;
                            let text = response.text().await.unwrap();
                            replays.lock().await.push((key, text));
                        }
                        StatusCode::CONFLICT => in_flight += 1,
                        other => panic!("unexpected {other}: {}", response.text().await.unwrap()),
                    }
                }
                (acquired, in_flight, replayed)
            })
        });
        let (mut acquired, mut in_flight, mut replayed) = (0, 0, 0);
        for t in futures::future::join_all(tasks).await {
            let (a, f, r) = t.unwrap();
            acquired += a;
            in_flight += f;
            replayed += r;
        }
        assert_eq!(acquired, 100, "{backing:?}: exactly one acquisition per key");
        assert_eq!(acquired + in_flight + replayed, 6_400);
        let stored = stored.lock().await;
        for (key, text) in replays.lock().await.iter() {
            let expected = format!(r#""result":{}"#, stored[key]);
            assert!(text.contains(&expected), "{backing:?}: replay of {key} differs: {text}");
        }
        println!("{backing:?}: acquired {acquired}, replayed {replayed}, in flight {in_flight}");
    }
}
