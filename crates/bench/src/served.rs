//! The server on a preloaded store: an `onceguard serve` process started on the store the
//! cost-per-claim comparison loaded, its memory (from `/proc/<pid>/status`) and the latency of
//! claims sent to it over HTTP.
//!
//! The process runs with anonymous access as agents of the benchmark tenant, so that requests
//! reach the records the benchmark preloaded; it listens on a free loopback port and is killed
//! when the value is dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use onceguard_client::{Claim, ClaimAnswer, Client, Fenced, Spent};
use serde_json::{Value, json};

use crate::harness::{
    Measured, PRELOADED_BODY, SCALE_NAMESPACE, TENANT, measure, preloaded_request, spread, warmup_for,
};

/// How long a started server may take to listen and become ready.
const STARTUP: Duration = Duration::from_secs(60);

/// Log lines of a server kept for the error message if it fails to start.
const KEPT_LOG_LINES: usize = 20;

/// A running `onceguard serve` on a preloaded store.
pub struct Served {
    child: Child,
    client: Client,
    /// Its working directory (its data folder and bootstrap key live there).
    _dir: tempfile::TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resident memory of a process, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    /// `VmRSS`: resident now, in bytes.
    pub rss: u64,
    /// `VmHWM`: the peak resident size so far, in bytes.
    pub peak: u64,
}

/// The `onceguard` binary next to this benchmark's (a release build of `-p onceguard` puts both
/// in the same folder).
pub fn default_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.with_file_name("onceguard"))
}

impl Served {
    /// Starts `binary serve` on `store_url`, anonymous requests acting for the benchmark
    /// tenant; answers once `/readyz` says ready.
    pub async fn start(binary: &Path, store_url: &str) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut child = Command::new(binary)
            .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0", "--store", store_url])
            .current_dir(dir.path())
            .env("ONCEGUARD_AUTH__ALLOW_ANONYMOUS", "true")
            .env("ONCEGUARD_AUTH__ANONYMOUS_TENANT", TENANT)
            .env("ONCEGUARD_AUTH__BOOTSTRAP_KEY_FILE", dir.path().join("admin.key"))
            .env("RUST_LOG", "warn,onceguard=info")
            .env_remove("ONCEGUARD_STORE")
            .env_remove("ONCEGUARD_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let stderr = child.stderr.take().context("the server's stderr")?;
        let (tx, rx) = std::sync::mpsc::channel();
        let kept = Arc::new(Mutex::new(Vec::new()));
        let lines = kept.clone();
        // Drains the server's logs for as long as it runs (a full pipe would block it).
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(event) = serde_json::from_str::<Value>(&line)
                    && let Some(addr) = event["addr"].as_str()
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(addr.to_owned());
                }
                let mut kept = lines.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if kept.len() < KEPT_LOG_LINES {
                    kept.push(line);
                }
            }
        });
        let addr = tokio::task::spawn_blocking(move || rx.recv_timeout(STARTUP)).await?;
        let Ok(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            let logs = kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner).join("\n");
            bail!("{} serve did not say where it listens within {STARTUP:?}; its logs:\n{logs}", binary.display());
        };
        let client = Client::with_options(&format!("http://{addr}"), None, Duration::from_secs(30), 0)?;
        let served = Self { child, client, _dir: dir };
        served.wait_ready(&format!("http://{addr}/readyz")).await?;
        Ok(served)
    }

    /// Waits for `/readyz` to answer 200.
    async fn wait_ready(&self, url: &str) -> Result<()> {
        let http = reqwest::Client::new();
        let started = Instant::now();
        loop {
            if let Ok(r) = http.get(url).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            ensure!(started.elapsed() < STARTUP, "{url} did not answer 200 within {STARTUP:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The server's resident memory now, and its peak.
    pub fn memory(&self) -> Result<Memory> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .context("reading the server's /proc/<pid>/status (Linux only)")?;
        let field = |name: &str| -> Result<u64> {
            let line = status.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name} in status"))?;
            let kib: u64 = line.trim_start_matches(name).trim().trim_end_matches("kB").trim().parse()?;
            Ok(kib * 1024)
        };
        Ok(Memory { rss: field("VmRSS:")?, peak: field("VmHWM:")? })
    }

    /// `pairs` claim+complete pairs on fresh keys over HTTP, one at a time: each claim must
    /// acquire and each completion apply. `tag` and the stored count spread the keys.
    pub async fn pairs(&self, pairs: usize, stored: usize, tag: String) -> Result<Measured> {
        let client = self.client.clone();
        measure(pairs, 1, warmup_for(pairs, 1), move |i| {
            let (client, key) = (client.clone(), format!("pre-{}-{tag}-{i}", spread(i, stored)));
            async move {
                let claim = Claim::new(SCALE_NAMESPACE, key, json!({ "i": i }));
                let fence = match client.claim(&claim).await? {
                    ClaimAnswer::Acquired(a) => a.fence,
                    other => bail!("key {} was not acquired over HTTP: {other:?}", claim.key),
                };
                match client.complete(&claim.target(), fence, &json!({ "i": i }), Spent::NOTHING).await? {
                    Fenced::Applied(_) => Ok(()),
                    Fenced::Stale { reason } => bail!("the completion of {} was stale: {reason}", claim.key),
                }
            }
        })
        .await
    }

    /// `claims` claims of random preloaded keys over HTTP from `concurrency` tasks; each must
    /// replay the stored outcome. `offset` moves the random choice between rounds.
    pub async fn replays(&self, claims: usize, concurrency: usize, stored: usize, offset: usize) -> Result<Measured> {
        let client = self.client.clone();
        measure(claims, concurrency, warmup_for(claims, concurrency), move |i| {
            let client = client.clone();
            let n = spread(i + offset, stored);
            async move {
                let claim = Claim::new(SCALE_NAMESPACE, format!("pre-{n}"), preloaded_request());
                match client.claim(&claim).await? {
                    ClaimAnswer::Replay(r) if r.result.as_ref().map(|b| b.get().as_bytes()) == Some(PRELOADED_BODY) => {
                        Ok(())
                    }
                    other => bail!("preloaded key {n} did not replay over HTTP: {other:?}"),
                }
            }
        })
        .await
    }
}
