//! The `onceguard` binary as a process: first start, kill -9 under load, graceful shutdown.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{admin_key, start};
use serde_json::{Value, json};
use tokio::sync::Mutex;

async fn claim(client: &reqwest::Client, base: &str, token: &str, key: &str) -> reqwest::Result<(u16, Value)> {
    let body = json!({"namespace": "crash", "key": key, "request": {"key": key}});
    let response = client.post(format!("{base}/v1/claims")).bearer_auth(token).json(&body).send().await?;
    let status = response.status().as_u16();
    Ok((status, response.json().await?))
}

/// Runs claim+complete pairs from 16 tasks until the server stops answering; answers the
/// acknowledged completions.
async fn load(base: String, token: String) -> Vec<(String, Value)> {
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let tasks = (0..16).map(|task| {
        let (client, base, token, acknowledged) = (client.clone(), base.clone(), token.clone(), acknowledged.clone());
        tokio::spawn(async move {
            for i in 0..100_000 {
                let key = format!("k-{task}-{i}");
                let Ok((201, acquired)) = claim(&client, &base, &token, &key).await else { break };
                let result = json!({"task": task, "i": i, "payload": "x".repeat(i % 50)});
                let body = json!({"namespace": "crash", "key": key, "fence": acquired["fence"], "result": result});
                match client.post(format!("{base}/v1/claims/complete")).bearer_auth(&token).json(&body).send().await {
                    Ok(r) if r.status().is_success() => acknowledged.lock().await.push((key, result)),
                    _ => break,
                }
            }
        })
    });
    futures_join(tasks).await;
    Arc::try_unwrap(acknowledged).unwrap().into_inner()
}

async fn futures_join(tasks: impl Iterator<Item = tokio::task::JoinHandle<()>>) {
    for task in tasks.collect::<Vec<_>>() {
        let _ = task.await;
    }
}

/// Every acknowledged completion replays, byte for byte, after a restart.
async fn assert_all_replay(base: &str, token: &str, acknowledged: &[(String, Value)]) {
    let client = reqwest::Client::new();
    for (key, result) in acknowledged {
        let (status, replay) = claim(&client, base, token, key).await.unwrap();
        assert_eq!(status, 200, "acknowledged completion of {key} lost: {replay}");
        assert_eq!(&replay["result"], result);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_loses_no_acknowledged_completion() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    let token = admin_key(dir.path());
    let load = tokio::spawn(load(server.base.clone(), token.clone()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.child.kill().unwrap(); // SIGKILL
    server.child.wait().unwrap();
    let acknowledged = load.await.unwrap();
    assert!(acknowledged.len() >= 50, "the load ran ({} acknowledged)", acknowledged.len());

    let mut restarted = start(dir.path());
    assert_eq!(admin_key(dir.path()), token, "the second start keeps the first admin key");
    assert_all_replay(&restarted.base, &token, &acknowledged).await;
    println!("kill -9: {} acknowledged completions, all replayed after restart", acknowledged.len());
    restarted.child.kill().unwrap();
    restarted.child.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_requests_in_flight_and_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    let token = admin_key(dir.path());
    let client = reqwest::Client::new();
    // A claim that waits on a held key is in flight when the signal comes; it must be answered.
    let (status, held) = claim(&client, &server.base, &token, "held").await.unwrap();
    assert_eq!(status, 201);
    let waiting = {
        let (client, base, token) = (client.clone(), server.base.clone(), token.clone());
        tokio::spawn(async move {
            let body = json!({"namespace": "crash", "key": "held", "request": {"key": "held"}, "wait": "2s"});
            client
                .post(format!("{base}/v1/claims"))
                .bearer_auth(token)
                .json(&body)
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert_eq!(waiting.await.unwrap().expect("the request in flight is answered"), 409);
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "exits cleanly: {exit:?}");

    let restarted = start(dir.path());
    let body = json!({"namespace": "crash", "key": "held", "fence": held["fence"], "result": "done"});
    let r = client
        .post(format!("{}/v1/claims/complete", restarted.base))
        .bearer_auth(&token)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the held key survived the restart");
    let mut restarted = restarted;
    restarted.child.kill().unwrap();
    restarted.child.wait().unwrap();
}

#[test]
fn operator_commands_work_on_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_onceguard")).args(args).current_dir(dir.path()).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert!(run(&["tenants", "create", "acme"]).0);
    let (ok, _, err) = run(&["tenants", "create", "acme"]);
    assert!(!ok && err.contains("exists"), "{err}");
    let (ok, out, _) = run(&["api-keys", "create", "--tenant", "acme", "--role", "agent", "--label", "ci"]);
    assert!(ok);
    let created: Value = serde_json::from_str(&out).unwrap();
    assert!(created["token"].as_str().unwrap().starts_with("og_"));
    let (ok, out, _) = run(&["api-keys", "list", "--tenant", "acme"]);
    assert!(ok && out.contains(created["id"].as_str().unwrap()) && !out.contains("token"));
    let (ok, _, err) = run(&["api-keys", "create", "--tenant", "nobody"]);
    assert!(!ok && err.contains("no tenant"), "{err}");
    let (ok, out, _) = run(&["keys", "list", "--tenant", "acme"]);
    assert!(ok && out.trim() == "[]");
    let (ok, _, err) = run(&["keys", "get", "--tenant", "acme", "demo", "nope"]);
    assert!(!ok && err.contains("no live record"), "{err}");
    let (ok, out, _) = run(&["keys", "purge", "--tenant", "acme", "demo", "nope"]);
    assert!(ok && out.contains("no record"));
    let (ok, _, err) = run(&["keys", "list", "--tenant", "acme", "--state", "done"]);
    assert!(!ok && err.contains("--state"), "{err}");
    let (ok, _, err) = run(&["--store", "postgres://nowhere", "tenants", "list"]);
    assert!(!ok && err.contains("store"), "{err}");
    // Sealing again needs the key file; with it, every tenant the store knows is read.
    let (ok, _, err) = run(&["keys", "reseal"]);
    assert!(!ok && err.contains("key file"), "{err}");
    let keys = dir.path().join("keys.txt");
    std::fs::write(&keys, "k-1 AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=\n").unwrap();
    let (ok, _, err) = run(&["--encryption-key-file", keys.to_str().unwrap(), "keys", "reseal"]);
    assert!(!ok && err.contains("no fingerprint key"), "a key file without a fingerprint key: {err}");
    std::fs::write(
        &keys,
        "k-1 AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=\nfingerprint ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=\n",
    )
    .unwrap();
    let (ok, out, err) = run(&["--encryption-key-file", keys.to_str().unwrap(), "keys", "reseal"]);
    assert!(ok, "{err}");
    let done: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        done["acme"],
        serde_json::json!({"examined": 0, "resealed": 0, "approvals_keyed": 0, "changed_meanwhile": 0, "unopened": 0}),
        "{out}"
    );
}

#[test]
fn bench_verifies_exactly_once_on_a_short_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_onceguard"))
        .args(["--store", "memory://", "bench", "--duration", "1s", "--concurrency", "4", "--no-baseline"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(" 0 more than once, 0 of "), "{stdout}");
    assert!(stdout.contains("0 unexpected"), "{stdout}");
}

/// Under systemd (`Type=notify`), the server says it is ready once it listens and its store
/// answered: `READY=1` on the socket named by `NOTIFY_SOCKET`.
#[cfg(unix)]
#[test]
fn it_tells_the_service_manager_when_it_is_ready() {
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let server = common::start_with(dir.path(), &[], &[("NOTIFY_SOCKET", socket_path.to_str().unwrap())]);
    let mut buf = [0u8; 256];
    let n = socket.recv(&mut buf).expect("a notification arrives");
    let said = String::from_utf8_lossy(&buf[..n]);
    assert!(said.lines().any(|l| l == "READY=1"), "{said}");
    let health = reqwest::blocking::get(format!("{}/readyz", server.base)).unwrap();
    assert_eq!(health.status(), 200, "ready means it answers");
}

/// `systemctl reload` sends SIGHUP: without TLS (nothing to read again) it must not end the
/// server, as SIGHUP's default action would.
#[cfg(unix)]
#[test]
fn sighup_without_tls_leaves_the_server_serving() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-HUP", &pid]).status().unwrap().success());
    let health = reqwest::blocking::get(format!("{}/healthz", server.base)).unwrap();
    assert_eq!(health.status(), 200);
    assert!(server.child.try_wait().unwrap().is_none(), "the server is still running");
}

/// `http.workers` sets the async runtime's workers of the process: as many `tokio-rt-worker`
/// threads as it says; at 0 the runtime's default, one per core or `TOKIO_WORKER_THREADS`,
/// which a number in `http.workers` overrides. It serves with each. (The runtime's blocking
/// threads have the same name; `serve` on the memory store starts none before it listens.)
#[cfg(target_os = "linux")]
#[test]
fn the_process_runs_the_workers_it_is_given() {
    let workers = |server: &common::Server| {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", server.child.id())).unwrap();
        tasks
            .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
            .filter(|name| name.trim() == "tokio-rt-worker")
            .count()
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let more = (cores + 3).to_string();
    let cases: [(&[(&str, &str)], usize); 5] = [
        (&[("ONCEGUARD_HTTP__WORKERS", "3")], 3),
        (&[("ONCEGUARD_HTTP__WORKERS", "1")], 1),
        (&[("ONCEGUARD_HTTP__WORKERS", "0")], cores),
        (&[("ONCEGUARD_HTTP__WORKERS", "0"), ("TOKIO_WORKER_THREADS", &more)], cores + 3),
        (&[("ONCEGUARD_HTTP__WORKERS", "2"), ("TOKIO_WORKER_THREADS", &more)], 2),
    ];
    for (env, expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        let server = common::start_with(dir.path(), &["--store", "memory://"], env);
        // A thread names itself once it runs: wait for the count, a while at most.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while workers(&server) != expected && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(workers(&server), expected, "{env:?}");
        let health = reqwest::blocking::get(format!("{}/healthz", server.base)).unwrap();
        assert_eq!(health.status(), 200, "it serves with {env:?}");
    }
}

/// A `TOKIO_WORKER_THREADS` the runtime cannot take stops the start with a message naming it,
/// not a panic.
#[test]
fn a_worker_count_the_runtime_cannot_take_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_onceguard"))
        .args(["--store", "memory://", "serve", "--listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .env("TOKIO_WORKER_THREADS", "many")
        .env_remove("ONCEGUARD_HTTP__WORKERS")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("TOKIO_WORKER_THREADS") && !err.contains("panicked"), "{err}");
}
