//! Batch claims and completions through HTTP: each answer is its own request's.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{Backing, assert_problem, spawn_app, spawn_app_with};

fn claim(key: &str, request: Value) -> Value {
    json!({"namespace": "rag/embed", "key": key, "request": request})
}

#[tokio::test]
async fn a_batch_answers_each_claim_as_its_own_request() {
    for backing in [Backing::Memory, Backing::Sqlite] {
        let app = spawn_app(backing).await;
        // Beforehand, one at a time: "done" completed (stored byte for byte), "held" in flight.
        let (_, done) = app.claim(&app.agent, claim("done", json!({"chunk": 1}))).await;
        let raw = r#"{"vector": [0.10, 2.50]}"#;
        let body =
            format!(r#"{{"namespace":"rag/embed","key":"done","fence":{},"result":{raw},"cost":30}}"#, done["fence"]);
        assert_eq!(app.post_raw(&app.agent, "/v1/claims/complete", body).await.status(), StatusCode::OK);
        let (status, _) = app.claim(&app.agent, claim("held", json!({"chunk": 2}))).await;
        assert_eq!(status, StatusCode::CREATED);
        let switch = json!({"target": {"kind": "namespace", "prefix": "rag/off"}, "reason": "drill"});
        assert_eq!(app.post(&app.admin, "/v1/switches", &switch).await.status(), StatusCode::CREATED);

        let batch = json!({"claims": [
            claim("new", json!({"chunk": 3})),
            claim("done", json!({"chunk": 1})),
            claim("held", json!({"chunk": 2})),
            claim("done", json!({"chunk": 99})),
            {"namespace": "rag/off", "key": "k", "request": 1},
            claim("new", json!({"chunk": 3})),
        ]});
        let response = app.post(&app.agent, "/v1/claims/batch", &batch).await;
        assert_eq!(response.status(), StatusCode::OK);
        let text = response.text().await.unwrap();
        assert!(text.contains(&format!(r#""result":{raw}"#)), "the replay is stored byte for byte: {text}");
        let answers: Value = serde_json::from_str(&text).unwrap();
        let results = answers["results"].as_array().unwrap();
        let statuses: Vec<u64> = results.iter().map(|r| r["status"].as_u64().unwrap()).collect();
        assert_eq!(statuses, [201, 200, 409, 422, 423, 409], "{answers}");
        assert_eq!(results[0]["body"]["outcome"], "acquired");
        assert_eq!(results[1]["body"]["outcome"], "replay");
        assert_eq!(results[1]["body"]["cost"], 30);
        let kinds: Vec<&str> = results[2..].iter().map(|r| r["body"]["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["in-flight", "fingerprint-mismatch", "switch-engaged", "in-flight"]
                .map(|k| format!("https://onceguard.dev/problems/{k}"))
        );

        // The acquired key is held as any claim's, and completes in a batch.
        let fence = results[0]["body"]["fence"].as_u64().unwrap();
        let completions = json!({"completions": [
            {"namespace": "rag/embed", "key": "new", "fence": fence, "result": {"vector": [1]}, "cost": 7},
            {"namespace": "rag/embed", "key": "held", "fence": fence + 1000, "result": 1},
        ]});
        let response = app.post(&app.agent, "/v1/claims/complete/batch", &completions).await;
        assert_eq!(response.status(), StatusCode::OK);
        let answers: Value = response.json().await.unwrap();
        assert_eq!(answers["results"][0]["status"], 200);
        assert_eq!(answers["results"][0]["body"]["state"], "completed");
        assert_eq!(answers["results"][1]["status"], 409);
        assert_eq!(answers["results"][1]["body"]["type"], "https://onceguard.dev/problems/stale-fence");
        let (status, replay) = app.claim(&app.agent, claim("new", json!({"chunk": 3}))).await;
        assert_eq!((status, replay["cost"].as_u64()), (StatusCode::OK, Some(7)));
        let (status, _) = app.claim(&app.agent, claim("held", json!({"chunk": 2}))).await;
        assert_eq!(status, StatusCode::CONFLICT, "the stale completion changed nothing");
    }
}

#[tokio::test]
async fn a_batch_is_refused_whole_when_a_claim_is_invalid_or_it_is_too_large() {
    let app = spawn_app_with(Backing::Memory, |c| c.limits.max_batch = 2).await;
    let three = json!({"claims": [claim("a", json!(1)), claim("b", json!(1)), claim("c", json!(1))]});
    let problem = assert_problem(
        app.post(&app.agent, "/v1/claims/batch", &three).await,
        StatusCode::BAD_REQUEST,
        "invalid-request",
    )
    .await;
    assert!(problem["detail"].as_str().unwrap().contains("at most 2"), "{problem}");
    let bad = json!({"claims": [claim("a", json!(1)), {"namespace": "bad namespace!", "key": "b", "request": 1}]});
    let problem = assert_problem(
        app.post(&app.agent, "/v1/claims/batch", &bad).await,
        StatusCode::BAD_REQUEST,
        "invalid-request",
    )
    .await;
    assert!(problem["detail"].as_str().unwrap().contains("item 1"), "{problem}");
    let waits = json!({"claims": [{"namespace": "rag/embed", "key": "a", "request": 1, "wait": "5s"}]});
    let problem = assert_problem(
        app.post(&app.agent, "/v1/claims/batch", &waits).await,
        StatusCode::BAD_REQUEST,
        "invalid-request",
    )
    .await;
    assert!(problem["detail"].as_str().unwrap().contains("does not wait"), "{problem}");
    // Nothing of a refused batch was claimed.
    let (status, _) = app.claim(&app.agent, claim("a", json!(1))).await;
    assert_eq!(status, StatusCode::CREATED);
    let empty = app.post(&app.agent, "/v1/claims/batch", &json!({"claims": []})).await;
    assert_eq!(empty.json::<Value>().await.unwrap(), json!({"results": []}));
}
