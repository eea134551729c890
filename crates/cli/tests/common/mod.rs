//! Starting `onceguard serve` processes for the process tests.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

/// A running `onceguard serve`; killed (SIGKILL) when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
    /// Every line it wrote to stderr (its logs), so far.
    #[allow(dead_code)]
    pub logs: Arc<Mutex<Vec<String>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
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
    let mut command = Command::new(env!("CARGO_BIN_EXE_onceguard"));
    command
        .args(["--log-format", "json"])
        .args(args)
        .current_dir(dir)
        .env_remove("ONCEGUARD_STORE")
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
            if let Ok(event) = serde_json::from_str::<Value>(&line) {
                if let Some(addr) = event["addr"].as_str() {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr.to_owned());
                    }
                }
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(60)).expect("onceguard says where it listens");
    Server { child, base: format!("http://{addr}"), logs }
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
