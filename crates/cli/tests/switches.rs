//! Kill switches across processes: engaged through one of three `onceguard serve` instances
//! under load, every instance refuses (how soon is printed; the one-second bound is the control
//! cache's unit test) and never acquires a covered key again until the release, after which
//! claims flow again; switches and budgets survive a restart; the operator commands engage, list,
//! release and audit.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Server, admin_key, postgres_store, redis_store, start, three_instances};
use serde_json::{Value, json};

/// One claim answered during the load: which instance, when it was sent and answered, its
/// status.
#[derive(Debug, Clone, Copy)]
struct Answer {
    instance: usize,
    sent: Instant,
    answered: Instant,
    status: u16,
}

/// Claims fresh keys (and completes the acquired ones) on every instance, two tasks each,
/// until `stop`; answers every claim's answer.
async fn load(servers: &[Server], token: &str, stop: Arc<AtomicBool>) -> Vec<Answer> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let mut tasks = Vec::new();
    for (instance, server) in servers.iter().enumerate() {
        for task in 0..2 {
            let (client, base, token, stop) = (client.clone(), server.base.clone(), token.to_owned(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) && answers.len() < 20_000 {
                    i += 1;
                    let key = format!("{instance}-{task}-{i}");
                    let body = json!({"namespace": "prod/agent", "key": key, "request": i});
                    let sent = Instant::now();
                    let response =
                        client.post(format!("{base}/v1/claims")).bearer_auth(&token).json(&body).send().await.unwrap();
                    let status = response.status().as_u16();
                    let answered = Instant::now();
                    if status == 201 {
                        let acquired: Value = response.json().await.unwrap();
                        let done =
                            json!({"namespace": "prod/agent", "key": key, "fence": acquired["fence"], "result": i});
                        let url = format!("{base}/v1/claims/complete");
                        client.post(url).bearer_auth(&token).json(&done).send().await.unwrap();
                    }
                    answers.push(Answer { instance, sent, answered, status });
                }
                answers
            }));
        }
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    all
}

/// For each instance: how long after `from` its first answer with `status` was sent, if any.
fn first_after(answers: &[Answer], instances: usize, from: Instant, status: u16) -> Vec<Option<Duration>> {
    (0..instances)
        .map(|i| {
            let mut times: Vec<Duration> = answers
                .iter()
                .filter(|a| a.instance == i && a.status == status && a.sent >= from)
                .map(|a| a.sent - from)
                .collect();
            times.sort();
            times.first().copied()
        })
        .collect()
}

async fn switch_under_load(label: &str, store: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (servers, token) = three_instances(dir.path(), store);
    let stop = Arc::new(AtomicBool::new(false));
    let client = reqwest::Client::new();
    let target = json!({"kind": "namespace", "prefix": "prod"});
    let running = {
        let (servers, token, stop) = (&servers, token.clone(), stop.clone());
        async move { load(servers, &token, stop).await }
    };
    let operate = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let engage = json!({"target": target, "reason": "incident drill"});
        let url = format!("{}/v1/switches", servers[0].base);
        let response = client.post(url).bearer_auth(&token).json(&engage).send().await.unwrap();
        assert_eq!(response.status(), 201);
        let engaged = Instant::now();
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        let release = json!({"target": target, "why": "drill over"});
        let releasing = Instant::now();
        let url = format!("{}/v1/switches/release", servers[1].base);
        let response = client.post(url).bearer_auth(&token).json(&release).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let released = Instant::now();
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        stop.store(true, Ordering::SeqCst);
        (engaged, releasing, released)
    };
    let (answers, (engaged, releasing, released)) = tokio::join!(running, operate);

    let refused = first_after(&answers, servers.len(), engaged, 423);
    let flowing = first_after(&answers, servers.len(), released, 201);
    println!(
        "{label}: {} claims on 3 instances; first refusal after the engage: {:?}; first acquisition after the release: {:?}",
        answers.len(),
        refused,
        flowing
    );
    // How soon is a figure printed above; that it is within a second is the control cache's
    // unit test (on a paused clock). Here: every instance saw the switch and the release, and
    // none acquired a covered key once it had refused one, until the release was sent.
    for (instance, (refused, flowing)) in refused.iter().zip(&flowing).enumerate() {
        assert!(refused.is_some(), "instance {instance} refused claims after the engage");
        assert!(flowing.is_some(), "instance {instance} acquired again after the release");
        // Ordered by cause: a claim sent after the instance *answered* its first refusal (one
        // sent earlier may still be decided on the switches read before).
        let first_refusal = answers
            .iter()
            .filter(|a| a.instance == instance && a.status == 423 && a.sent >= engaged)
            .map(|a| a.answered)
            .min()
            .expect("a refusal");
        let acquired_after = answers
            .iter()
            .filter(|a| a.instance == instance && a.sent > first_refusal && a.answered < releasing)
            .find(|a| a.status != 423);
        assert!(acquired_after.is_none(), "instance {instance} answered {acquired_after:?} while engaged");
    }
    let while_engaged = answers.iter().filter(|a| a.sent > engaged && a.answered < releasing).count();
    assert!(while_engaged > 30, "load kept running: {while_engaged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_reaches_three_instances_on_postgres() {
    if let Some(store) = postgres_store("PostgreSQL switch test") {
        switch_under_load("postgres", &store.url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_reaches_three_instances_on_redis() {
    if let Some(store) = redis_store("Redis switch test") {
        switch_under_load("redis", &store.url).await;
    }
}

fn onceguard(dir: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_onceguard")).args(args).current_dir(dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switches_and_budgets_survive_a_restart_and_the_cli_operates_them() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let server = start(dir.path());
    let token = admin_key(dir.path());
    let engage = json!({"target": {"kind": "run", "run": "r-1"}, "reason": "looping agent"});
    let response = client.post(format!("{}/v1/switches", server.base)).bearer_auth(&token).json(&engage);
    assert_eq!(response.send().await.unwrap().status(), 201);
    let budget =
        client.put(format!("{}/v1/runs/r-2", server.base)).bearer_auth(&token).json(&json!({"max_effects": 1}));
    assert_eq!(budget.send().await.unwrap().status(), 200);
    drop(server); // SIGKILL

    let server = start(dir.path());
    let claim = |run: &str, key: &str| {
        let body = json!({"namespace": "ns", "key": key, "request": 1, "run": run});
        client.post(format!("{}/v1/claims", server.base)).bearer_auth(&token).json(&body).send()
    };
    assert_eq!(claim("r-1", "a").await.unwrap().status(), 423, "the switch survived");
    assert_eq!(claim("r-2", "a").await.unwrap().status(), 201);
    assert_eq!(claim("r-2", "b").await.unwrap().status(), 429, "the budget survived");
    drop(server);

    // The operator commands, on the same store.
    let (ok, listed) = onceguard(dir.path(), &["switch", "list", "--tenant", "default"]);
    assert!(ok && listed.contains("looping agent"), "{listed}");
    let (ok, out) = onceguard(
        dir.path(),
        &["switch", "engage", "--tenant", "default", "--namespace", "prod", "--reason", "cli drill"],
    );
    assert!(ok, "{out}");
    let (ok, out) =
        onceguard(dir.path(), &["switch", "release", "--tenant", "default", "--run", "r-1", "--why", "fixed"]);
    assert!(ok, "{out}");
    let (ok, out) = onceguard(dir.path(), &["switch", "release", "--tenant", "default", "--run", "r-1"]);
    assert!(!ok && out.contains("no switch is engaged"), "{out}");
    let (ok, out) = onceguard(dir.path(), &["runs", "budget", "--tenant", "default", "r-3", "--max-cost", "50"]);
    assert!(ok && out.contains("\"max_cost\": 50"), "{out}");
    let (ok, out) = onceguard(dir.path(), &["runs", "get", "--tenant", "default", "r-2"]);
    let run: Value = serde_json::from_str(&out).unwrap_or_default();
    assert!(ok && run["usage"]["effects"] == 1, "{out}");
    let (ok, out) = onceguard(dir.path(), &["settings", "set", "--tenant", "default", "--max-in-flight", "5"]);
    assert!(ok, "{out}");
    let (ok, out) = onceguard(dir.path(), &["audit", "--tenant", "default"]);
    assert!(ok, "{out}");
    let entries: Vec<Value> = serde_json::from_str(&out).unwrap();
    let actions: Vec<&str> = entries.iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert_eq!(
        actions,
        [
            "settings.set",
            "budget.set",
            "switch.release",
            "switch.engage",
            "budget.set",
            "switch.engage",
            "api_key.create",
            "tenant.create"
        ]
    );
    assert_eq!((entries[6]["actor"].as_str(), entries[7]["actor"].as_str()), (Some("system"), Some("system")));
    assert_eq!(entries[6]["details"]["label"], "bootstrap", "the first start's admin key is audited");
    let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
    assert_eq!(entries[0]["actor"], format!("cli:{user}"));
    assert_eq!(entries[2]["why"], "fixed");
    assert_eq!(entries[5]["actor"].as_str().map(str::len), Some(16), "an API key id");

    let server = start(dir.path());
    let body = json!({"namespace": "prod/x", "key": "k", "request": 1});
    let refused = client.post(format!("{}/v1/claims", server.base)).bearer_auth(&token).json(&body).send().await;
    assert_eq!(refused.unwrap().status(), 423, "the switch engaged by the CLI is in force");
}

/// The operator's commands for a rollback and observe mode, on a served store: `runs rollback`
/// switches the run off and lists its tasks, `runs get` shows the progress as workers finish
/// them, and `settings set --mode observe` lets the next duplicate through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_rolls_a_run_back_and_sets_observe_mode() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let server = start(dir.path());
    let token = admin_key(dir.path());
    let post =
        |path: &str, body: Value| client.post(format!("{}{path}", server.base)).bearer_auth(&token).json(&body).send();
    for (key, undo) in [("a", true), ("b", false)] {
        let claim = json!({"namespace": "ops", "key": key, "request": 1, "run": "r-9"});
        let held: Value = post("/v1/claims", claim).await.unwrap().json().await.unwrap();
        let mut done = json!({"namespace": "ops", "key": key, "fence": held["fence"], "result": {}});
        if undo {
            done["compensation"] = json!({"name": "undo-a", "data": {"a": 1}});
        }
        assert_eq!(post("/v1/claims/complete", done).await.unwrap().status(), 200);
    }
    drop(server);

    let (ok, out) = onceguard(dir.path(), &["runs", "rollback", "--tenant", "default", "r-9", "--why", "INC-1"]);
    assert!(ok, "{out}");
    let rollback: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((&rollback["pending"], &rollback["not_compensable"]), (&json!(1), &json!(1)), "{out}");
    assert_eq!(rollback["tasks"][0]["compensation"]["name"], "undo-a");
    let (ok, out) = onceguard(
        dir.path(),
        &["settings", "set", "--tenant", "default", "--namespace-prefix", "ops", "--mode", "observe"],
    );
    assert!(ok, "{out}");
    let (ok, out) = onceguard(dir.path(), &["settings", "set", "--tenant", "default", "--mode", "loose"]);
    assert!(!ok && out.contains("not enforce or observe"), "{out}");

    let server = start(dir.path());
    let post =
        |path: &str, body: Value| client.post(format!("{}{path}", server.base)).bearer_auth(&token).json(&body).send();
    let refused =
        post("/v1/claims", json!({"namespace": "ops", "key": "c", "request": 1, "run": "r-9"})).await.unwrap();
    assert_eq!(refused.status(), 423, "the rolled-back run is switched off, observe mode or not");
    let again: Value =
        post("/v1/claims", json!({"namespace": "ops", "key": "b", "request": 1})).await.unwrap().json().await.unwrap();
    assert_eq!((&again["outcome"], &again["would_have_been"]), (&json!("proceed"), &json!("replay")));
    let task: Value = post("/v1/runs/r-9/compensations/claim", json!({})).await.unwrap().json().await.unwrap();
    let done = json!({"namespace": task["namespace"], "key": task["key"], "fence": task["fence"], "result": {}});
    assert_eq!(post("/v1/claims/complete", done).await.unwrap().status(), 200);
    drop(server);
    let (ok, out) = onceguard(dir.path(), &["runs", "get", "--tenant", "default", "r-9"]);
    assert!(ok, "{out}");
    let run: Value = serde_json::from_str(&out).unwrap();
    let progress = &run["rollback"];
    assert_eq!(
        (&progress["compensated"], &progress["done"], &progress["why"]),
        (&json!(1), &json!(true), &json!("INC-1")),
        "{out}"
    );
}
