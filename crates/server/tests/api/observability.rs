//! `/metrics` and the dashboard's JSON, after traffic through the API.

use std::collections::HashMap;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{Backing, TestApp, assert_problem, spawn_app_with};

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

/// Traffic of tenant `acme` in namespace `demo`: 2 completions (cost 1200 and 900 tokens, and none), 3
/// replays, 1 mismatch, 1 in-flight answer, a lease expiry recovered and its zombie's stale
/// completion, an outcome reported unknown and recovered, one key left stuck, one held.
async fn traffic(app: &TestApp) {
    let (_, a) = app.claim_key("paid", json!({"n": 1})).await;
    let body = json!({"namespace": "demo", "key": "paid", "fence": a["fence"], "result": {"ok": true}, "cost": 1200, "tokens": 900});
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

        let acme = |outcome: &str| {
            value(&m, &format!(r#"onceguard_claims_total{{tenant="acme",outcome="{outcome}",mode="enforce"}}"#))
        };
        // paid, free, held, zombie, stuck, unknown; unknown and zombie again (recoveries).
        assert_eq!(acme("acquired"), 8.0, "{text}");
        assert_eq!(acme("replay"), 3.0);
        assert_eq!(acme("mismatch"), 1.0);
        assert_eq!(acme("in_flight"), 1.0);
        assert_eq!(value(&m, r#"onceguard_claims_total{tenant="globex",outcome="acquired",mode="enforce"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_replay_cost_saved_total{tenant="acme"}"#), 2400.0, "2 replays × 1200");
        assert_eq!(value(&m, r#"onceguard_replay_tokens_saved_total{tenant="acme"}"#), 1800.0, "2 replays × 900");
        assert_eq!(value(&m, r#"onceguard_replay_tokens_saved_total{tenant="globex"}"#), 0.0);
        assert_eq!(value(&m, r#"onceguard_recoveries_total{tenant="acme",reason="lease_expired"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_recoveries_total{tenant="acme",reason="reported_unknown"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_stale_calls_total{tenant="acme",op="complete",reason="superseded"}"#), 1.0);
        // held, zombie (taken over), stuck, unknown (recovered) are in flight; stuck is stuck.
        assert_eq!(value(&m, r#"onceguard_keys_in_flight{tenant="acme"}"#), 4.0);
        assert_eq!(value(&m, r#"onceguard_keys_stuck{tenant="acme"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_keys_in_flight{tenant="globex"}"#), 1.0);
        assert_eq!(value(&m, r#"onceguard_keys_stuck{tenant="globex"}"#), 0.0);
        let store = match backing {
            Backing::Memory | Backing::Breakable => "memory",
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
            "replay_tokens_saved",
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

#[tokio::test]
async fn the_dashboard_data_matches_the_metrics_and_is_admin_only() {
    let app = spawn_app_with(Backing::Sqlite, |c| c.metrics.refresh_interval = Duration::ZERO).await;
    traffic(&app).await;
    let response = app.get(&app.admin, "/v1/dashboard").await;
    assert_eq!(response.status(), StatusCode::OK);
    let d: Value = response.json().await.unwrap();
    let (_, m) = scrape(&app).await;
    for outcome in ["acquired", "replay", "in_flight", "mismatch", "denied"] {
        let metric =
            m.get(&format!(r#"onceguard_claims_total{{tenant="acme",outcome="{outcome}",mode="enforce"}}"#)).copied();
        assert_eq!(d["claims"][outcome].as_f64(), Some(metric.unwrap_or(0.0)), "{outcome}");
    }
    assert_eq!(d["tenant"], "acme");
    assert_eq!(d["tenants"], json!(["acme", "globex"]));
    assert_eq!(d["cost_saved"], 2400);
    assert_eq!(d["recoveries"], json!({"lease_expired": 1, "reported_unknown": 1}));
    assert_eq!(d["stale_calls"], 1);
    assert_eq!(d["keys"]["in_flight"], 4);
    assert_eq!(d["keys"]["stuck"], 1);
    assert_eq!(d["store"]["kind"], "sqlite");
    assert_eq!(d["store"]["up"], true);
    assert_eq!(d["controls"]["switches"], json!([]));
    assert_eq!(d["controls"]["summary"], "No kill switch is engaged: claims flow.");
    assert_eq!(d["series"]["cost_saved"].as_array().unwrap().iter().filter_map(Value::as_u64).sum::<u64>(), 2400);
    assert_eq!(d["tokens_saved"], 1800);
    let by_namespace = &d["series"]["tokens_saved_by_namespace"];
    assert_eq!(by_namespace["namespaces"][0]["namespace"], "demo");
    assert_eq!(by_namespace["namespaces"][0]["total"], 1800);
    assert_eq!(by_namespace["others"].as_array().unwrap().iter().filter_map(Value::as_u64).sum::<u64>(), 0);
    assert!(d["latency"]["count"].as_u64().unwrap() >= 18, "{}", d["latency"]);
    let stuck = &d["stuck"][0];
    assert_eq!((stuck["key"].as_str(), stuck["run"].as_str()), (Some("stuck"), Some("run-9")));
    assert_eq!(stuck["last_checkpoint"]["name"], "step-1");
    assert_eq!(stuck["stuck_for_seconds"], 1);
    let kinds: Vec<&str> = d["recent"].as_array().unwrap().iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds, ["stale_completion", "recovery", "recovery", "mismatch"], "newest first");
    assert!(!d.to_string().contains("private"), "checkpoint data is never shown");

    // The inspector: fences, attempts, checkpoints (names only) and a timeline.
    let r: Value = app.get(&app.admin, "/v1/dashboard/record?namespace=demo&key=stuck").await.json().await.unwrap();
    assert_eq!((r["state"].as_str(), r["stuck"].as_bool()), (Some("in_progress"), Some(true)));
    assert_eq!(r["checkpoints"][0]["name"], "step-1");
    let timeline: Vec<&str> = r["timeline"].as_array().unwrap().iter().filter_map(|e| e["what"].as_str()).collect();
    assert_eq!(timeline.len(), 3, "claimed, checkpoint, lease passed: {r}");
    assert!(timeline.iter().all(|what| !what.contains("expires")), "a key in progress never expires: {r}");
    assert!(!r.to_string().contains("private"));
    let done: Value = app.get(&app.admin, "/v1/dashboard/record?namespace=demo&key=paid").await.json().await.unwrap();
    let last = done["timeline"].as_array().unwrap().last().unwrap()["what"].as_str().unwrap().to_owned();
    assert_eq!(last, "the record expires (retention)", "a finished key shows its retention");
    assert_eq!(
        done["stored"],
        json!({"status": "success", "content_type": "application/json", "bytes": 11, "digest_only": false, "cost": 1200, "tokens": 900, "reconciled": false})
    );
    let missing = app.get(&app.admin, "/v1/dashboard/record?namespace=demo&key=nothing").await;
    assert_problem(missing, StatusCode::NOT_FOUND, "not-found").await;

    // Admins only; another tenant only for the operator tenant's admins.
    assert_problem(app.get(&app.agent, "/v1/dashboard").await, StatusCode::FORBIDDEN, "forbidden").await;
    let other = app.get(&app.admin, "/v1/dashboard?tenant=globex").await;
    let other: Value = other.json().await.unwrap();
    assert_eq!((other["tenant"].as_str(), other["keys"]["in_flight"].as_u64()), (Some("globex"), Some(1)));
    let created = app.post(&app.admin, "/v1/api-keys", &json!({"role": "admin", "tenant": "globex"})).await;
    let globex_admin = created.json::<Value>().await.unwrap()["token"].as_str().unwrap().to_owned();
    let own: Value = app.get(&globex_admin, "/v1/dashboard").await.json().await.unwrap();
    assert_eq!((own["tenant"].as_str(), own["tenants"].clone()), (Some("globex"), json!(["globex"])));
    assert_problem(app.get(&globex_admin, "/v1/dashboard?tenant=acme").await, StatusCode::FORBIDDEN, "forbidden").await;
    let peek = app.get(&globex_admin, "/v1/dashboard/record?tenant=acme&namespace=demo&key=paid").await;
    assert_problem(peek, StatusCode::FORBIDDEN, "forbidden").await;
    assert_problem(
        app.client.get(app.url("/v1/dashboard")).send().await.unwrap(),
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
    )
    .await;
}

#[tokio::test]
async fn a_store_that_does_not_answer_shows_in_the_metrics() {
    use std::sync::atomic::Ordering;
    let app = spawn_app_with(Backing::Breakable, |c| {
        c.metrics.refresh_interval = Duration::ZERO;
        // The agent's key is read once, before the outage, and remembered throughout it.
        c.auth.key_cache_ttl = Duration::from_secs(60);
    })
    .await;
    assert_eq!(app.claim_key("before", json!(1)).await.0, StatusCode::CREATED);
    let (_, m) = scrape(&app).await;
    assert_eq!(value(&m, r#"onceguard_store_up{store="memory"}"#), 1.0);

    app.store_down.store(true, Ordering::SeqCst);
    let response =
        app.post(&app.agent, "/v1/claims", &json!({"namespace": "demo", "key": "during", "request": 1})).await;
    assert_problem(response, StatusCode::SERVICE_UNAVAILABLE, "store-unavailable").await;
    // A key not read before the outage cannot be checked: 503, never 401.
    let unread =
        app.post(&app.other_agent, "/v1/claims", &json!({"namespace": "demo", "key": "k", "request": 1})).await;
    assert_problem(unread, StatusCode::SERVICE_UNAVAILABLE, "store-unavailable").await;
    let (_, m) = scrape(&app).await;
    assert_eq!(value(&m, r#"onceguard_store_up{store="memory"}"#), 0.0, "the store is reported down");
    assert!(
        value(
            &m,
            r#"onceguard_store_operation_duration_seconds_count{store="memory",op="claim",result="unavailable"}"#
        ) >= 1.0,
        "the remembered key let the claim reach the store, which did not answer"
    );
    assert!(
        value(&m, r#"onceguard_store_operation_duration_seconds_count{store="memory",op="auth",result="unavailable"}"#)
            >= 1.0
    );
    assert!(
        value(&m, r#"onceguard_store_operation_duration_seconds_count{store="memory",op="ping",result="unavailable"}"#)
            >= 1.0
    );
    assert_eq!(
        value(&m, r#"onceguard_keys_in_flight{tenant="acme"}"#),
        1.0,
        "the last counts are kept while the store is down"
    );
    assert_eq!(
        value(&m, r#"onceguard_http_request_duration_seconds_count{method="POST",route="/v1/claims",status="503"}"#),
        2.0
    );

    app.store_down.store(false, Ordering::SeqCst);
    assert_eq!(app.claim_key("after", json!(1)).await.0, StatusCode::CREATED);
    let (_, m) = scrape(&app).await;
    assert_eq!(value(&m, r#"onceguard_store_up{store="memory"}"#), 1.0, "and up again once it answers");
    assert_eq!(value(&m, r#"onceguard_keys_in_flight{tenant="acme"}"#), 2.0);
    let d: Value = app.get(&app.admin, "/v1/dashboard").await.json().await.unwrap();
    assert_eq!(d["store"]["up"], true);
    let ops = d["store"]["ops"].as_array().unwrap();
    let auth = ops.iter().find(|op| op["op"] == "auth").unwrap();
    assert!(auth["errors"].as_u64().unwrap() >= 1, "the dashboard counts the failed store calls: {auth}");
}

#[tokio::test]
async fn a_request_the_store_never_answers_times_out_with_503_and_is_measured() {
    use std::sync::atomic::Ordering;
    let app = spawn_app_with(Backing::Breakable, |c| {
        c.limits.max_wait = Duration::from_millis(100);
        c.http.request_timeout = Duration::from_millis(300);
    })
    .await;
    app.store_stalled.store(true, Ordering::SeqCst);
    // The client waits a minute: an answer at all is the server's, at its own timeout.
    let response = app.post(&app.agent, "/v1/claims", &json!({"namespace": "demo", "key": "k", "request": 1})).await;
    let problem = assert_problem(response, StatusCode::SERVICE_UNAVAILABLE, "store-unavailable").await;
    assert!(problem["detail"].as_str().unwrap().contains("timed out"), "{problem}");
    let (_, m) = scrape(&app).await;
    assert_eq!(
        value(&m, r#"onceguard_http_request_duration_seconds_count{method="POST",route="/v1/claims",status="503"}"#),
        1.0,
        "the timed-out request is measured with the answer it got"
    );
    // The 5xx's log line (method, route, status) is checked where the logs are the process's
    // own: crates/cli/tests/fail_closed.rs.
    app.store_stalled.store(false, Ordering::SeqCst);
    assert_eq!(app.claim_key("after", json!(1)).await.0, StatusCode::CREATED);
}

#[tokio::test]
async fn the_dashboard_page_is_served_with_a_strict_policy() {
    let app = spawn_app_with(Backing::Memory, |_| {}).await;
    let page = app.client.get(app.url("/dashboard")).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    let csp = page.headers()["content-security-policy"].to_str().unwrap().to_owned();
    assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"), "{csp}");
    let html = page.text().await.unwrap();
    assert!(html.contains("/dashboard/app.js") && html.contains("Key inspector"));
    for (asset, kind) in [("app.js", "text/javascript"), ("style.css", "text/css")] {
        let response = app.client.get(app.url(&format!("/dashboard/{asset}"))).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers()["content-type"].to_str().unwrap().starts_with(kind));
    }
    let missing = app.client.get(app.url("/dashboard/other.js")).send().await.unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn metrics_with_a_token_file_answer_only_that_bearer_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("metrics.token");
    std::fs::write(&token_file, "scrape-0123456789-secret\n").unwrap();
    let app = spawn_app_with(Backing::Memory, |c| c.metrics.token_file = Some(token_file.clone())).await;
    let metrics = app.url("/metrics");
    let open = app.client.get(&metrics).send().await.unwrap();
    assert_eq!(open.headers()["www-authenticate"], "Bearer");
    assert_problem(open, StatusCode::UNAUTHORIZED, "unauthenticated").await;
    for wrong in ["scrape-0123456789-secreT", "scrape-0123456789", &app.admin] {
        let refused = app.client.get(&metrics).bearer_auth(wrong).send().await.unwrap();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "{wrong}");
    }
    let scraped = app.client.get(&metrics).bearer_auth("scrape-0123456789-secret").send().await.unwrap();
    assert_eq!(scraped.status(), StatusCode::OK);
    assert!(scraped.text().await.unwrap().contains("onceguard_claims_total"));
}

#[tokio::test]
async fn metrics_on_their_own_listener_are_no_longer_on_the_api() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let app = spawn_app_with(Backing::Memory, |c| c.metrics.listen = Some(addr)).await;
    app.claim_key("k", json!(1)).await;
    assert_problem(app.client.get(app.url("/metrics")).send().await.unwrap(), StatusCode::NOT_FOUND, "not-found").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        match app.client.get(format!("http://{addr}/metrics")).send().await {
            Ok(r) if r.status() == StatusCode::OK => break r.text().await.unwrap(),
            other => assert!(std::time::Instant::now() < deadline, "no metrics on {addr}: {other:?}"),
        }
        tokio::task::yield_now().await;
    };
    assert!(text.contains(r#"onceguard_claims_total{tenant="acme",outcome="acquired",mode="enforce"} 1"#), "{text}");
    let other = app.client.get(format!("http://{addr}/v1/records")).send().await.unwrap();
    assert_eq!(other.status(), StatusCode::NOT_FOUND, "the metrics listener serves the metrics only");
}

#[tokio::test]
async fn tenant_labels_as_digests_keep_the_ids_out_of_the_metrics() {
    let app = spawn_app_with(Backing::Memory, |c| {
        c.metrics.tenant_labels = onceguard_server::config::TenantLabels::Digest;
        c.metrics.refresh_interval = Duration::ZERO;
    })
    .await;
    traffic(&app).await;
    let (text, m) = scrape(&app).await;
    for id in ["acme", "globex"] {
        assert!(!text.contains(&format!("\"{id}\"")), "the tenant id {id} is a label value: {text}");
    }
    let digest = |id: &str| {
        let fingerprint = onceguard_core::Fingerprint::sha256(id.as_bytes());
        let hex = &fingerprint.as_str()["sha256:".len()..];
        format!("t-{}", &hex[..12])
    };
    let acme = digest("acme");
    assert_eq!(
        value(&m, &format!(r#"onceguard_claims_total{{tenant="{acme}",outcome="replay",mode="enforce"}}"#)),
        3.0
    );
    assert_eq!(value(&m, &format!(r#"onceguard_keys_in_flight{{tenant="{}"}}"#, digest("globex"))), 1.0);
    // The dashboard still counts per tenant.
    let d: Value = app.get(&app.admin, "/v1/dashboard").await.json().await.unwrap();
    assert_eq!(d["claims"]["replay"], 3);
}

/// Every metric the Grafana dashboard (deploy/grafana/onceguard-dashboard.json) queries is one
/// the server exports (its queries' syntax is checked by promtool in scripts/deploy-check).
#[tokio::test]
async fn the_grafana_dashboard_queries_only_exported_metrics() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/grafana/onceguard-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(query) = variable["query"]["query"].as_str() {
            queries.push(query.to_owned());
        }
    }
    let app = spawn_app_with(Backing::Memory, |c| c.metrics.refresh_interval = Duration::ZERO).await;
    traffic(&app).await;
    let (mut text, _) = scrape(&app).await;
    // The families the API server leaves empty (they count the MCP gateway's calls, the proxy's
    // unstored responses, stale audits dropped), exported once they count something.
    let others = onceguard_server::Metrics::new();
    let tenant = onceguard_core::TenantId::parse("acme").unwrap();
    others.observe_mcp_call(&tenant, "tools", "guarded");
    others.observe_unstored_response(&tenant);
    let scope = onceguard_core::Scope::new(
        tenant,
        onceguard_core::Namespace::parse("n").unwrap(),
        onceguard_core::Key::parse("k").unwrap(),
    );
    onceguard_core::Observer::stale_audit_dropped(&others, &scope);
    text.push_str(&others.encode());
    let mut named = std::collections::BTreeSet::new();
    for query in &queries {
        let mut rest = query.as_str();
        while let Some(at) = rest.find("onceguard_") {
            let name: String = rest[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            rest = &rest[at + name.len()..];
            named.insert(name);
        }
    }
    assert!(named.len() >= 12, "{named:?}");
    for name in &named {
        let family =
            ["_bucket", "_count", "_sum", "_total"].iter().find_map(|suffix| name.strip_suffix(suffix)).unwrap_or(name);
        assert!(text.contains(&format!("# TYPE {family} ")), "the dashboard queries {name}, which is not exported");
    }
}

/// A tenant's admin reads its own latency and store operations on the dashboard: another
/// tenant's 150 claims move none of them; the operator's page holds the whole instance's.
#[tokio::test]
async fn the_dashboard_shows_a_tenant_its_own_traffic_only() {
    let app = spawn_app_with(Backing::Sqlite, |c| c.metrics.refresh_interval = Duration::ZERO).await;
    let created = app.post(&app.admin, "/v1/api-keys", &json!({"role": "admin", "tenant": "globex"})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let globex_admin = created.json::<Value>().await.unwrap()["token"].as_str().unwrap().to_owned();
    let figures = |token: &str| {
        let (app, token) = (&app, token.to_owned());
        async move {
            let d: Value = app.get(&token, "/v1/dashboard").await.json().await.unwrap();
            let claims_in_store = d["store"]["ops"]
                .as_array()
                .unwrap()
                .iter()
                .find(|op| op["op"] == "claim")
                .map_or(0, |op| op["count"].as_u64().unwrap());
            (d["figures"].as_str().unwrap().to_owned(), d["latency"]["count"].as_u64().unwrap(), claims_in_store)
        }
    };
    let (globex_before, operator_before) = (figures(&globex_admin).await, figures(&app.admin).await);
    assert_eq!((globex_before.0.as_str(), operator_before.0.as_str()), ("tenant", "instance"));
    for i in 0..150 {
        let (status, _) =
            app.claim(&app.agent, json!({"namespace": "busy", "key": format!("k-{i}"), "request": i})).await;
        assert_eq!(status, StatusCode::CREATED);
    }
    let (globex_after, operator_after) = (figures(&globex_admin).await, figures(&app.admin).await);
    assert_eq!(globex_after, globex_before, "acme's claims are not in globex's figures");
    assert!(operator_after.1 >= operator_before.1 + 150, "{operator_before:?} → {operator_after:?}");
    assert!(operator_after.2 >= operator_before.2 + 150, "{operator_before:?} → {operator_after:?}");
}

/// More expired records than one sweep run deletes (`batch × max_batches`): the sweep runs again
/// at once while a run stops with more left, instead of waiting an interval per run (at one run
/// an interval, these 600 records would take 15 s), and `onceguard_records_swept_total` counts
/// the deletions.
#[tokio::test]
async fn the_sweep_keeps_up_with_more_expired_records_than_one_run_deletes() {
    use onceguard_core::record::Outcome;
    use onceguard_core::{
        ClaimOutcome, ClaimRequest, Clock, Fingerprint, Key, ListFilter, Mutation, Namespace, Scope, TenantId,
    };

    let app = spawn_app_with(Backing::Sqlite, |c| {
        c.sweep.interval = Duration::from_millis(500);
        c.sweep.batch = 10;
        c.sweep.max_batches = 2;
    })
    .await;
    let tenant = TenantId::parse("acme").unwrap();
    let records = 600;
    for i in 0..records {
        let scope =
            Scope::new(tenant.clone(), Namespace::parse("demo").unwrap(), Key::parse(&format!("k-{i}")).unwrap());
        let request = ClaimRequest {
            recovery: Default::default(),
            scope: scope.clone(),
            fingerprint: Fingerprint::sha256(b"same"),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(1),
            run: None,
            cost: 0,
            max_in_flight: None,
            refused_runs: Vec::new(),
            approval: None,
        };
        let now = app.clock.now();
        let ClaimOutcome::Acquired(acquired) = app.store.claim(&request, now).await.unwrap() else {
            panic!("a new key is acquired")
        };
        let outcome = Outcome::json(b"{}".to_vec());
        app.store.mutate(&scope, acquired.fence, Mutation::Complete(outcome), now, 16).await.unwrap();
    }
    app.clock.advance(Duration::from_secs(2));

    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let swept = loop {
        let (_, metrics) = scrape(&app).await;
        let swept = value(&metrics, "onceguard_records_swept_total");
        if swept >= records as f64 || std::time::Instant::now() > deadline {
            break swept;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(swept, records as f64, "the sweep deleted {swept} of {records} expired records in 5 s");
    let left = app.store.list(&tenant, &ListFilter::default(), app.clock.now()).await.unwrap();
    assert!(left.items.is_empty(), "{} expired records are left", left.items.len());
}

/// A backlog of expired records that never ends (every sweep run stops on a full batch) does
/// not keep the audit log from being pruned: a round sweeps for at most one interval, then
/// prunes.
#[tokio::test]
async fn the_audit_log_is_pruned_under_a_sweep_backlog_that_never_ends() {
    let app = spawn_app_with(Backing::Breakable, |c| {
        c.sweep.interval = Duration::from_millis(200);
        c.sweep.audit_retention = Duration::from_secs(3_600);
    })
    .await;
    let switch = json!({"target": {"kind": "namespace", "prefix": "demo/off"}, "reason": "drill"});
    assert_eq!(app.post(&app.admin, "/v1/switches", &switch).await.status(), StatusCode::CREATED);
    let entries = || async {
        let audit: Value = app.get(&app.admin, "/v1/audit").await.json().await.unwrap();
        audit["entries"].as_array().unwrap().len()
    };
    assert_eq!(entries().await, 1, "the switch is audited");

    app.sweep_endless.store(true, std::sync::atomic::Ordering::SeqCst);
    app.clock.advance(Duration::from_secs(2 * 3_600));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while entries().await > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(entries().await, 0, "the entry past its retention is still in the audit log after 5 s");
}

/// Every attempt that ends is counted by how (`onceguard_effects_total`), and a completed key's
/// time from its first claim is in `onceguard_effect_duration_seconds`, whose 30 s bucket the
/// latency alerts read.
#[tokio::test]
async fn effects_are_counted_by_how_they_ended_with_their_duration() {
    let app = spawn_app_with(Backing::Sqlite, |_| {}).await;
    let claim = |key: &str| json!({"namespace": "fx", "key": key, "request": 1, "lease": "1h"});
    let fenced = |key: &str, fence: &Value, extra: Value| {
        let mut body = json!({"namespace": "fx", "key": key, "fence": fence});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let (_, ok) = app.claim(&app.agent, claim("ok")).await;
    assert_eq!(app.fenced("complete", fenced("ok", &ok["fence"], json!({"result": 1}))).await.0, StatusCode::OK);
    let (_, bad) = app.claim(&app.agent, claim("bad")).await;
    let fail = json!({"retryable": false, "error": {"code": "card_declined"}});
    assert_eq!(app.fenced("fail", fenced("bad", &bad["fence"], fail)).await.0, StatusCode::OK);
    let (_, retry) = app.claim(&app.agent, claim("retry")).await;
    let release = json!({"retryable": true, "error": "try again"});
    assert_eq!(app.fenced("fail", fenced("retry", &retry["fence"], release)).await.0, StatusCode::OK);
    let (_, unknown) = app.claim(&app.agent, claim("unknown")).await;
    let report = json!({"detail": "timed out"});
    assert_eq!(app.fenced("report-unknown", fenced("unknown", &unknown["fence"], report)).await.0, StatusCode::OK);
    let (_, slow) = app.claim(&app.agent, claim("slow")).await;
    app.clock.advance(Duration::from_secs(40));
    assert_eq!(app.fenced("complete", fenced("slow", &slow["fence"], json!({"result": 2}))).await.0, StatusCode::OK);
    // A stale completion ends nothing.
    assert_eq!(app.fenced("complete", fenced("ok", &json!(999), json!({"result": 1}))).await.0, StatusCode::CONFLICT);

    let (text, m) = scrape(&app).await;
    for (result, n) in [("success", 2.0), ("failure", 1.0), ("released", 1.0), ("unknown", 1.0)] {
        assert_eq!(value(&m, &format!(r#"onceguard_effects_total{{tenant="acme",result="{result}"}}"#)), n, "{result}");
    }
    assert_eq!(value(&m, r#"onceguard_effect_duration_seconds_count{tenant="acme"}"#), 3.0);
    assert_eq!(value(&m, r#"onceguard_effect_duration_seconds_bucket{le="30.0",tenant="acme"}"#), 2.0, "{text}");
    assert_eq!(value(&m, r#"onceguard_effect_duration_seconds_bucket{le="60.0",tenant="acme"}"#), 3.0);
}
