//! `/metrics` after traffic through the API.

use std::collections::HashMap;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{Backing, TestApp, spawn_app_with};

/// The samples of an OpenMetrics text: `name{labels}` → value.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn scrape(app: &TestApp) -> (String, HashMap<String, f64>) {
    let response = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let text = response.text().await.unwrap();
    assert!(text.ends_with("# EOF\n"), "an OpenMetrics exposition ends with # EOF");
    let parsed = samples(&text);
    (text, parsed)
}

fn value(samples: &HashMap<String, f64>, name: &str) -> f64 {
    *samples.get(name).unwrap_or_else(|| panic!("no sample {name}"))
}

/// Traffic of tenant `acme` in namespace `demo`: 2 completions (cost 1200 and none), 3
/// replays, 1 mismatch, 1 in-flight answer, a lease expiry recovered and its zombie's stale
/// completion, an outcome reported unknown and recovered, one key left stuck, one held.
async fn traffic(app: &TestApp) {
    let (_, a) = app.claim_key("paid", json!({"n": 1})).await;
    let body = json!({"namespace": "demo", "key": "paid", "fence": a["fence"], "result": {"ok": true}, "cost": 1200});
    assert_eq!(app.fenced("complete", body).await.0, StatusCode::OK);
    let (_, b) = app.claim_key("free", json!({"n": 2})).await;
    let body = json!({"namespace": "demo", "key": "free", "fence": b["fence"], "result": null});
    assert_eq!(app.fenced("complete", body).await.0, StatusCode::OK);
    for _ in 0..2 {
        assert_eq!(app.claim_key("paid", json!({"n": 1})).await.0, StatusCode::OK);
    }
    assert_eq!(app.claim_key("free", json!({"n": 2})).await.0, StatusCode::OK);
    assert_eq!(app.claim_key("paid", json!({"n": 999})).await.0, StatusCode::UNPROCESSABLE_ENTITY);

    let (_, held) =
        app.claim(&app.agent, json!({"namespace": "demo", "key": "held", "request": 1, "lease": "1h"})).await;
    assert_eq!(held["outcome"], "acquired");
    assert_eq!(app.claim_key("held", json!(1)).await.0, StatusCode::CONFLICT);

    let (_, zombie) =
        app.claim(&app.agent, json!({"namespace": "demo", "key": "zombie", "request": 1, "lease": "1s"})).await;
    let (_, stuck) = app
        .claim(&app.agent, json!({"namespace": "demo", "key": "stuck", "request": 1, "lease": "1s", "run": "run-9"}))
        .await;
    let cp = json!({"namespace": "demo", "key": "stuck", "fence": stuck["fence"], "name": "step-1", "data": {"private": "x"}});
    assert_eq!(app.fenced("checkpoint", cp).await.0, StatusCode::OK);
    let (_, unknown) = app.claim_key("unknown", json!(1)).await;
    let report = json!({"namespace": "demo", "key": "unknown", "fence": unknown["fence"], "detail": "timed out"});
    assert_eq!(app.fenced("report-unknown", report).await.0, StatusCode::OK);
    let (_, recovered) = app.claim_key("unknown", json!(1)).await;
    assert_eq!(recovered["recovery"]["reason"], "reported_unknown");

    app.clock.advance(Duration::from_secs(2));
    let (_, taken) =
        app.claim(&app.agent, json!({"namespace": "demo", "key": "zombie", "request": 1, "lease": "1h"})).await;
    assert_eq!(taken["recovery"]["reason"], "lease_expired");
    let late = json!({"namespace": "demo", "key": "zombie", "fence": zombie["fence"], "result": 1});
    assert_eq!(app.fenced("complete", late).await.0, StatusCode::CONFLICT);

    // Another tenant's traffic is counted apart.
    app.claim(&app.other_agent, json!({"namespace": "demo", "key": "g", "request": 1, "lease": "1h"})).await;
}

#[tokio::test]
async fn metrics_count_claims_replays_cost_recoveries_stale_calls_and_keys() {
    for backing in [Backing::Memory, Backing::Sqlite] {
        let app = spawn_app_with(backing, |c| c.metrics.refresh_interval = Duration::ZERO).await;
        traffic(&app).await;
        let (text, m) = scrape(&app).await;

        let acme =
            |outcome: &str| value(&m, &format!(r#"onceguard_claims_total{{tenant="acme",outcome="{outcome}"}}"#));
        // paid, free, held, zombie, stuck, unknown; unknown and zombie again (recoveries).
        assert_eq!(acme("acquired"), 8.0, "{text}");
        assert_eq!(acme("replay"), 3.0);
        assert_eq!(acme("mismatch"), 1.0);
        assert_eq!(acme("in_flight"), 1.0);
        assert_eq!(value(&m, r#"onceguard_claims_total{tenant="globex",outcome="acquired"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_replay_cost_saved_total{tenant="acme"}"#), 2400.0, "2 replays × 1200");
        assert_eq!(value(&m, r#"onceguard_recoveries_total{tenant="acme",reason="lease_expired"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_recoveries_total{tenant="acme",reason="reported_unknown"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_stale_calls_total{tenant="acme",op="complete",reason="superseded"}"#), 1.0);
        // held, zombie (taken over), stuck, unknown (recovered) are in flight; stuck is stuck.
        assert_eq!(value(&m, r#"onceguard_keys_in_flight{tenant="acme"}"#), 4.0);
        assert_eq!(value(&m, r#"onceguard_keys_stuck{tenant="acme"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_keys_in_flight{tenant="globex"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_keys_stuck{tenant="globex"}"#), 0.0);
        let store = match backing {
            Backing::Memory => "memory",
            Backing::Sqlite => "sqlite",
        };
        assert_eq!(value(&m, &format!(r#"onceguard_store_up{{store="{store}"}}"#)), 1.0);
        assert!(
            value(
                &m,
                &format!(
                    r#"onceguard_store_operation_duration_seconds_count{{store="{store}",op="claim",result="ok"}}"#
                )
            ) >= 14.0
        );
        assert_eq!(
            value(
                &m,
                r#"onceguard_http_request_duration_seconds_count{method="POST",route="/v1/claims",status="422"}"#
            ),
            1.0
        );
        assert!(text.contains(r#"onceguard_http_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/claims",status="201"}"#));
        assert_eq!(value(&m, r#"onceguard_build_info{version="0.1.0"}"#), 1.0);

        // Every metric is described; denials are declared (no switches or budgets exist yet).
        for name in [
            "claims",
            "replay_cost_saved",
            "recoveries",
            "stale_calls",
            "denials",
            "keys_in_flight",
            "keys_stuck",
            "store_up",
            "store_operation_duration_seconds",
            "http_request_duration_seconds",
        ] {
            assert!(text.contains(&format!("# HELP onceguard_{name} ")), "no description of {name}");
        }
        // Bounded labels: never keys, namespaces, runs, fingerprints or payloads.
        for leaked in ["paid", "zombie", "demo", "run-9", "sha256", "private", "timed out"] {
            assert!(!text.contains(leaked), "'{leaked}' is in the metrics");
        }
    }
}
