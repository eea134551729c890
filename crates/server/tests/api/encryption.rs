//! Encryption at rest: with `encryption.key_file`, the SQLite file and a PostgreSQL dump hold
//! no stored result and no checkpoint data in clear, while every answer (replays, records,
//! recoveries) shows them as given; a rotated key still opens what it sealed, and a completion
//! repeated after the rotation is still answered as the repeat it is.

use std::path::{Path, PathBuf};

use base64::Engine;
use onceguard_core::auth::Role;
use onceguard_server::Config;
use onceguard_store_postgres::PgStore;
use onceguard_store_sqlite::SqliteStore;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::files_hold;

const RESULT_MARKER: &str = "MARKER-result-4111";
const CHECKPOINT_MARKER: &str = "MARKER-checkpoint-ch9";
const COMPENSATION_MARKER: &str = "MARKER-compensation-re7";

/// A key file of `keys` (id, the byte its 32 bytes repeat), with the deployment's one
/// fingerprint key (the same in every file, as it is never rotated).
fn key_file(dir: &Path, name: &str, keys: &[(&str, u8)]) -> PathBuf {
    let path = dir.join(name);
    let lines: String = keys
        .iter()
        .chain([&("fingerprint", 42)])
        .map(|(id, byte)| format!("{id} {}\n", base64::engine::general_purpose::STANDARD.encode([*byte; 32])))
        .collect();
    std::fs::write(&path, lines).unwrap();
    path
}

async fn serve(store: TestStore, key_file: Option<PathBuf>) -> (Harness, String) {
    let mut config = Config { store: "memory://".into(), ..Config::default() };
    config.encryption.key_file = key_file;
    let limits = config.limits.clone();
    let harness = Harness::start(config, limits, store, onceguard_server::app).await;
    let agent = harness.key("acme", Role::Agent).await;
    (harness, agent)
}

/// The hex digits of the plain fingerprint of `write_markers`'s request for `key`.
/// The SHA-256 of a claim's request, in each form a store keeps it: hex (PostgreSQL, Redis, and
/// SQLite records of earlier versions) and its 32 bytes (SQLite's packed records).
fn request_digest(key: &str) -> [Vec<u8>; 2] {
    let fingerprint = onceguard_core::Fingerprint::of_json(&json!({"k": key}));
    let hex = fingerprint.as_str().trim_start_matches("sha256:").to_owned();
    [hex::decode(&hex).unwrap(), hex.into_bytes()]
}

/// Whether the files in `dir` hold the digest of `key`'s request in either form.
fn files_hold_digest(dir: &std::path::Path, key: &str) -> bool {
    request_digest(key).iter().any(|form| files_hold(dir, form))
}

async fn post(h: &Harness, token: &str, path: &str, body: Value) -> (StatusCode, Value) {
    let r = h.http.post(h.url(path)).bearer_auth(token).json(&body).send().await.unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

/// Claims `key`, saves a checkpoint and completes it, each with a marker; answers the fence.
async fn write_markers(h: &Harness, token: &str, key: &str) -> u64 {
    let claim = json!({"namespace": "pii/cards", "key": key, "request": {"k": key}});
    let (status, held) = post(h, token, "/v1/claims", claim.clone()).await;
    assert_eq!(status, StatusCode::CREATED);
    let fence = held["fence"].as_u64().unwrap();
    let checkpoint = json!({"namespace": "pii/cards", "key": key, "fence": fence, "name": "charged", "data": {"charge": CHECKPOINT_MARKER}});
    assert_eq!(post(h, token, "/v1/claims/checkpoint", checkpoint).await.0, StatusCode::OK);
    let done = json!({"namespace": "pii/cards", "key": key, "fence": fence, "result": {"card": RESULT_MARKER},
                      "compensation": {"name": "refund", "data": {"card": COMPENSATION_MARKER}}});
    assert_eq!(post(h, token, "/v1/claims/complete", done).await.0, StatusCode::OK);
    let (status, replay) = post(h, token, "/v1/claims", claim).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(replay["result"]["card"], RESULT_MARKER, "a replay shows the result as given");
    let record: Value = h
        .http
        .get(h.url(&format!("/v1/record?namespace=pii/cards&key={key}")))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(record["stored"]["result"]["card"], RESULT_MARKER);
    assert_eq!(record["checkpoints"][0]["data"]["charge"], CHECKPOINT_MARKER, "{record}");
    assert_eq!(record["compensation"], "refund", "{record}");
    assert_eq!(record["compensation_data"]["card"], COMPENSATION_MARKER, "{record}");
    fence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_file_holds_no_result_or_checkpoint_in_clear() {
    let dir = tempfile::tempdir().unwrap();
    let keys = key_file(dir.path(), "keys", &[("k-2026", 7)]);
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let (h, agent) = serve(TestStore::new(SqliteStore::open(data.join("og.db")).unwrap()), Some(keys)).await;
    write_markers(&h, &agent, "card-1").await;
    // A recovery is handed the last checkpoint as it was given.
    let claim = json!({"namespace": "pii/cards", "key": "card-r", "request": 1});
    let fence = post(&h, &agent, "/v1/claims", claim.clone()).await.1["fence"].as_u64().unwrap();
    let checkpoint = json!({"namespace": "pii/cards", "key": "card-r", "fence": fence, "name": "charged", "data": {"charge": CHECKPOINT_MARKER}});
    assert_eq!(post(&h, &agent, "/v1/claims/checkpoint", checkpoint).await.0, StatusCode::OK);
    let unknown = json!({"namespace": "pii/cards", "key": "card-r", "fence": fence, "detail": "timed out"});
    assert_eq!(post(&h, &agent, "/v1/claims/report-unknown", unknown).await.0, StatusCode::OK);
    let (_, recovered) = post(&h, &agent, "/v1/claims", claim).await;
    assert_eq!(recovered["recovery"]["last_checkpoint"]["data"]["charge"], CHECKPOINT_MARKER, "{recovered}");
    drop(h);
    // Nor the request's digest: a stored fingerprint is keyed, so that a dictionary of likely
    // requests read against the file finds nothing.
    for marker in [RESULT_MARKER, CHECKPOINT_MARKER, COMPENSATION_MARKER] {
        assert!(!files_hold(&data, marker), "{marker} is in the SQLite files");
    }
    assert!(!files_hold_digest(&data, "card-1"), "the request's digest is in the SQLite files");

    // The same without a key file: the markers are there (the search finds what is there).
    let plain = dir.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    let (h, agent) = serve(TestStore::new(SqliteStore::open(plain.join("og.db")).unwrap()), None).await;
    write_markers(&h, &agent, "card-1").await;
    drop(h);
    assert!(files_hold(&plain, RESULT_MARKER) && files_hold(&plain, CHECKPOINT_MARKER));
    assert!(files_hold_digest(&plain, "card-1"), "without a key file the fingerprint is the request's digest");
    assert!(files_hold(&plain, COMPENSATION_MARKER));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_opens_what_it_sealed_and_new_values_take_the_new_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("og.db");
    let old = key_file(dir.path(), "old", &[("k-2026", 7)]);
    let (h, agent) = serve(TestStore::new(SqliteStore::open(&db).unwrap()), Some(old)).await;
    let fence = write_markers(&h, &agent, "card-1").await;
    drop(h);

    let rotated = key_file(dir.path(), "rotated", &[("k-2027", 9), ("k-2026", 7)]);
    let (h, agent) = serve(TestStore::new(SqliteStore::open(&db).unwrap()), Some(rotated)).await;
    let claim = json!({"namespace": "pii/cards", "key": "card-1", "request": {"k": "card-1"}});
    let (status, replay) = post(&h, &agent, "/v1/claims", claim).await;
    assert_eq!((status, &replay["result"]["card"]), (StatusCode::OK, &json!(RESULT_MARKER)), "sealed with the old key");
    let again = json!({"namespace": "pii/cards", "key": "card-1", "fence": fence, "result": {"card": RESULT_MARKER},
                       "compensation": {"name": "refund", "data": {"card": COMPENSATION_MARKER}}});
    assert_eq!(post(&h, &agent, "/v1/claims/complete", again).await.0, StatusCode::OK, "still a repeat");
    let other = json!({"namespace": "pii/cards", "key": "card-1", "fence": fence, "result": {"card": "another"}});
    assert_eq!(post(&h, &agent, "/v1/claims/complete", other).await.0, StatusCode::CONFLICT, "another result is not");
    write_markers(&h, &agent, "card-2").await;
    drop(h);
    assert!(files_hold(dir.path(), "k-2027"), "new values name the new key");

    // Without the old key, what it sealed does not open: an error, never the ciphertext.
    let only_new = key_file(dir.path(), "only-new", &[("k-2027", 9)]);
    let (h, agent) = serve(TestStore::new(SqliteStore::open(&db).unwrap()), Some(only_new)).await;
    let claim = json!({"namespace": "pii/cards", "key": "card-1", "request": {"k": "card-1"}});
    let (status, problem) = post(&h, &agent, "/v1/claims", claim.clone()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
    assert_eq!(problem["type"], "https://onceguard.dev/problems/sealed-value-unopened", "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("key 'k-2026'"), "{problem}");
    assert!(!problem.to_string().contains(RESULT_MARKER));
    let card_2 = json!({"namespace": "pii/cards", "key": "card-2", "request": {"k": "card-2"}});
    assert_eq!(post(&h, &agent, "/v1/claims", card_2).await.0, StatusCode::OK);
    drop(h);

    // Restarted without any key file: a sealed value is still refused, never served as a
    // result, a checkpoint or compensation data; and the refusal is counted.
    let (h, agent) = serve(TestStore::new(SqliteStore::open(&db).unwrap()), None).await;
    let (status, problem) = post(&h, &agent, "/v1/claims", claim).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "a replay without the key file: {problem}");
    assert_eq!(problem["type"], "https://onceguard.dev/problems/sealed-value-unopened", "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("--encryption-key-file"), "{problem}");
    let read = h.http.get(h.url("/v1/record?namespace=pii/cards&key=card-1")).bearer_auth(&agent).send().await.unwrap();
    assert_eq!(read.status(), StatusCode::SERVICE_UNAVAILABLE, "a record read without the key file");
    assert!(!read.text().await.unwrap().contains("ogenc1"), "no sealed bytes in the answer");
    let metrics = h.http.get(h.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let refused = metrics.lines().find(|l| l.starts_with("onceguard_sealed_values_refused_total{"));
    assert!(refused.is_some_and(|l| !l.ends_with(" 0")), "counted: {refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_dump_holds_no_result_or_checkpoint_in_clear() {
    let url =
        std::env::var("ONCEGUARD_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let addr = onceguard_testkit::services::addr_of_url(&url, 5432);
    if !onceguard_testkit::services::available("PostgreSQL encryption test", &addr, "start PostgreSQL") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let keys = key_file(dir.path(), "keys", &[("k-2026", 7)]);
    let schema = format!("og_enc_{:08x}", rand::random::<u32>());
    let store = PgStore::connect(&format!("{url}?schema={schema}")).await.unwrap();
    let (h, agent) = serve(TestStore::new(store), Some(keys)).await;
    write_markers(&h, &agent, "card-1").await;
    drop(h);
    let dump = std::process::Command::new("pg_dump").args(["--schema", &schema, &url]).output().unwrap();
    assert!(dump.status.success(), "{}", String::from_utf8_lossy(&dump.stderr));
    let text = String::from_utf8_lossy(&dump.stdout);
    assert!(text.contains("card-1"), "the dump holds the record");
    for marker in [RESULT_MARKER, CHECKPOINT_MARKER, COMPENSATION_MARKER] {
        assert!(!text.contains(marker), "{marker} is in the dump");
    }
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    let driver = tokio::spawn(connection);
    client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
    drop(client);
    let _ = driver.await;
}

/// What Redis holds for every key under `prefix` (then deleted): each value as it is, read by
/// its type (`DUMP` would compress a long string, and hide what is in it from the search).
fn dump_and_delete(port: &str, prefix: &str) -> Vec<u8> {
    let cli = |args: &[&str]| {
        let out = std::process::Command::new("redis-cli").args(["-p", port]).args(args).output().unwrap();
        out.stdout
    };
    let names = String::from_utf8(cli(&["--scan", "--pattern", &format!("{prefix}*")])).unwrap();
    let names: Vec<&str> = names.lines().filter(|l| !l.is_empty()).collect();
    assert!(!names.is_empty(), "the store wrote keys under {prefix}");
    let mut dumped = Vec::new();
    for name in &names {
        let kind = String::from_utf8(cli(&["TYPE", name])).unwrap();
        let read: &[&str] = match kind.trim() {
            "string" => &["GET"],
            "hash" => &["HGETALL"],
            "zset" => &["ZRANGE", "0", "-1", "WITHSCORES"],
            "set" => &["SMEMBERS"],
            _ => &["DUMP"],
        };
        let mut args = vec!["--no-raw", read[0], name];
        args.extend_from_slice(&read[1..]);
        dumped.extend(cli(&args));
    }
    for name in names {
        cli(&["DEL", name]);
    }
    dumped
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_dump_holds_no_result_or_checkpoint_in_clear() {
    let url = std::env::var("ONCEGUARD_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let addr = onceguard_testkit::services::addr_of_url(&url, 6379);
    if !onceguard_testkit::services::available("Redis encryption test", &addr, "start Redis") {
        return;
    }
    let port = addr.rsplit(':').next().unwrap().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let keys = key_file(dir.path(), "keys", &[("k-2026", 7)]);
    let holds = |bytes: &[u8], marker: &str| bytes.windows(marker.len()).any(|w| w == marker.as_bytes());
    for sealed in [true, false] {
        let prefix = format!("og-enc-{:08x}:", rand::random::<u32>());
        let store = onceguard_store_redis::RedisStore::connect(&url, &prefix).await.unwrap();
        let (h, agent) = serve(TestStore::new(store), sealed.then(|| keys.clone())).await;
        write_markers(&h, &agent, "card-1").await;
        drop(h);
        let dumped = dump_and_delete(&port, &prefix);
        for marker in [RESULT_MARKER, CHECKPOINT_MARKER, COMPENSATION_MARKER] {
            // Without a key file the markers are there: the search finds what is there.
            assert_eq!(holds(&dumped, marker), !sealed, "{marker} in a DUMP, sealed: {sealed}");
        }
    }
}

/// `onceguard keys reseal` (Guard::reseal): after a rotation every value an older key sealed,
/// and every value stored before sealing was on, is sealed again with the new key, so the old
/// key can leave the key file and every record still opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resealing_lets_the_old_key_go() {
    use std::sync::Arc;

    use onceguard_core::sealing::{MAGIC, Sealer};
    use onceguard_core::{Guard, Key, Limits, ManualClock, Namespace, Scope, TenantId, Timestamp};

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("og.db");
    let (h, agent) = serve(TestStore::new(SqliteStore::open(&db).unwrap()), None).await;
    write_markers(&h, &agent, "in-clear").await;
    drop(h);
    let old = key_file(dir.path(), "old", &[("k-2026", 7)]);
    let (h, agent) = serve(TestStore::new(SqliteStore::open(&db).unwrap()), Some(old)).await;
    write_markers(&h, &agent, "card-1").await;
    // The record stored before encryption was on keeps the request's plain fingerprint until it
    // is resealed: the same request still replays it, another is still a mismatch.
    let same = json!({"namespace": "pii/cards", "key": "in-clear", "request": {"k": "in-clear"}});
    let (status, replay) = post(&h, &agent, "/v1/claims", same).await;
    assert_eq!((status, &replay["result"]["card"]), (StatusCode::OK, &json!(RESULT_MARKER)), "{replay}");
    let another = json!({"namespace": "pii/cards", "key": "in-clear", "request": {"k": "another"}});
    assert_eq!(post(&h, &agent, "/v1/claims", another).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    drop(h);
    assert!(files_hold_digest(dir.path(), "in-clear"), "not keyed before the reseal");

    let rotated = key_file(dir.path(), "rotated", &[("k-2027", 9), ("k-2026", 7)]);
    let store: Arc<dyn onceguard_core::Store> = Arc::new(SqliteStore::open(&db).unwrap());
    let clock = Arc::new(ManualClock::new(Timestamp::now()));
    let sealer = Arc::new(Sealer::from_file(&rotated).unwrap());
    let guard = Guard::new(store.clone(), clock, Limits::default()).with_sealer(Some(sealer));
    let acme = TenantId::parse("acme").unwrap();
    let done = guard.reseal("cli:ops", &acme).await.unwrap();
    assert_eq!((done.examined, done.resealed, done.changed_meanwhile, done.unopened), (2, 2, 0, 0), "{done:?}");
    let again = guard.reseal("cli:ops", &acme).await.unwrap();
    assert_eq!((again.examined, again.resealed), (2, 0), "what the current key sealed is left as it is");
    let scope = |key: &str| Scope::new(acme.clone(), Namespace::parse("pii/cards").unwrap(), Key::parse(key).unwrap());
    for key in ["in-clear", "card-1"] {
        let raw = store.get(&scope(key), Timestamp::now()).await.unwrap().unwrap();
        let body = &raw.outcome.as_ref().unwrap().body;
        assert!(body.starts_with(MAGIC) && body[MAGIC.len() + 1..].starts_with(b"k-2027"), "{key} is sealed anew");
        assert!(raw.checkpoints[0].data.contains("k-2027"), "{key}: {}", raw.checkpoints[0].data);
        assert!(Sealer::is_keyed(&raw.fingerprint), "{key}'s fingerprint is keyed: {}", raw.fingerprint);
    }
    let filter = onceguard_core::control::AuditFilter { limit: 10, ..Default::default() };
    let entries = guard.audit_log(&acme, &filter).await.unwrap().items;
    assert_eq!(entries[0].action, "records.reseal");
    drop(guard);

    // The old key can go: every record opens with the new one alone.
    let only_new = key_file(dir.path(), "only-new", &[("k-2027", 9)]);
    let (h, agent) = serve(TestStore::new(SqliteStore::open(&db).unwrap()), Some(only_new)).await;
    for key in ["in-clear", "card-1"] {
        let claim = json!({"namespace": "pii/cards", "key": key, "request": {"k": key}});
        let (status, replay) = post(&h, &agent, "/v1/claims", claim).await;
        assert_eq!((status, &replay["result"]["card"]), (StatusCode::OK, &json!(RESULT_MARKER)), "{key}: {replay}");
    }
}
