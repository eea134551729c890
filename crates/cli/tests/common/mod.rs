//! Starting `onceguard serve` processes for the process tests.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

/// A running `onceguard serve`; killed (SIGKILL) when dropped, with every process of its group
/// when a wrapper started it (the wrapper's child, the server itself, must not outlive it).
pub struct Server {
    pub child: Child,
    pub base: String,
    /// Every line it wrote to stderr (its logs), so far.
    #[allow(dead_code)]
    pub logs: Arc<Mutex<Vec<String>>>,
    /// Whether it leads a process group of its own (started under a wrapper).
    group: bool,
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.group {
            let group = format!("-{}", self.child.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `onceguard serve` in `dir` on a free port with the extra `args` and environment;
/// answers once it listens.
pub fn start_with(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
    let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    spawn(dir, &all, env)
}

/// Starts `onceguard` with `args` (a command that logs the address it listens on) in `dir`;
/// answers once it listens.
pub fn spawn(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
    spawn_under(&[], dir, args, env)
}

/// [`spawn`], run by the command `wrapper` (its program and arguments, the binary's path
/// following them; none: the binary itself), e.g. `faketime` for a skewed clock.
pub fn spawn_under(wrapper: &[&str], dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
    let binary = env!("CARGO_BIN_EXE_onceguard");
    let mut command = match wrapper.split_first() {
        Some((program, wrapper_args)) => {
            let mut command = Command::new(program);
            // A group of its own, so that dropping the server stops what the wrapper started.
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
            command.args(wrapper_args).arg(binary);
            command
        }
        None => Command::new(binary),
    };
    command
        .args(["--log-format", "json"])
        .args(args)
        .current_dir(dir)
        .env_remove("ONCEGUARD_STORE")
        .env_remove("TOKIO_WORKER_THREADS")
        .stderr(Stdio::piped())
        .stdout(Stdio::null());
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("onceguard starts");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let logs = Arc::new(Mutex::new(Vec::new()));
    let kept = logs.clone();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            kept.lock().unwrap().push(line.clone());
            if let Ok(event) = serde_json::from_str::<Value>(&line)
                && let Some(addr) = event["addr"].as_str()
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(addr.to_owned());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(60)).expect("onceguard says where it listens");
    Server { child, base: format!("http://{addr}"), logs, group: !wrapper.is_empty() }
}

/// Starts `onceguard serve` in `dir` with the default (SQLite) store.
#[allow(dead_code)]
pub fn start(dir: &Path) -> Server {
    start_with(dir, &[], &[])
}

/// The admin key the first start wrote under `dir`.
#[allow(dead_code)]
pub fn admin_key(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("onceguard-data/admin.key"))
        .expect("the first start wrote an admin key")
        .trim()
        .to_owned()
}

/// The PostgreSQL server of the shared-store tests (`ONCEGUARD_POSTGRES_URL`).
#[allow(dead_code)]
pub fn postgres_url() -> String {
    std::env::var("ONCEGUARD_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The Redis server of the shared-store tests (`ONCEGUARD_REDIS_URL`).
#[allow(dead_code)]
pub fn redis_url() -> String {
    std::env::var("ONCEGUARD_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Starts three instances on `store`; the first bootstraps the admin key.
#[allow(dead_code)]
pub fn three_instances(dir: &std::path::Path, store: &str) -> (Vec<Server>, String) {
    let key_file = dir.join("admin.key");
    let env = [("ONCEGUARD_AUTH__BOOTSTRAP_KEY_FILE", key_file.to_str().unwrap())];
    let first = start_with(dir, &["--store", store], &env);
    let token = std::fs::read_to_string(&key_file).expect("the first instance wrote the admin key").trim().to_owned();
    let mut servers = vec![first];
    servers.extend((0..2).map(|_| start_with(dir, &["--store", store], &env)));
    (servers, token)
}

/// A fresh PostgreSQL schema or Redis key prefix for one test, dropped when the value is.
#[allow(dead_code)]
pub struct SharedStore {
    /// The store URL to pass to `--store`.
    pub url: String,
    cleanup: Vec<String>,
}

impl Drop for SharedStore {
    fn drop(&mut self) {
        let _ = Command::new(&self.cleanup[0]).args(&self.cleanup[1..]).output();
    }
}

/// A fresh schema on the PostgreSQL server, or `None` (the suite is reported skipped) when it
/// is not reachable outside CI.
#[allow(dead_code)]
pub fn postgres_store(suite: &str) -> Option<SharedStore> {
    let url = postgres_url();
    let addr = onceguard_testkit::services::addr_of_url(&url, 5432);
    if !onceguard_testkit::services::available(suite, &addr, "start PostgreSQL or set ONCEGUARD_POSTGRES_URL") {
        return None;
    }
    let schema = format!("og_proc_{:08x}", rand::random::<u32>());
    let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
    Some(SharedStore { url: format!("{url}?schema={schema}"), cleanup: vec!["psql".into(), url, "-qc".into(), drop] })
}

/// A fresh key prefix on the Redis server, or `None` (the suite is reported skipped) when it is
/// not reachable outside CI.
#[allow(dead_code)]
pub fn redis_store(suite: &str) -> Option<SharedStore> {
    let url = redis_url();
    let addr = onceguard_testkit::services::addr_of_url(&url, 6379);
    if !onceguard_testkit::services::available(suite, &addr, "start redis-server or set ONCEGUARD_REDIS_URL") {
        return None;
    }
    let prefix = format!("og-proc-{:08x}:", rand::random::<u32>());
    let unlink =
        format!("redis-cli -u {url} --scan --pattern '{prefix}*' | xargs -r redis-cli -u {url} unlink >/dev/null");
    Some(SharedStore { url: format!("{url}?prefix={prefix}"), cleanup: vec!["sh".into(), "-c".into(), unlink] })
}
