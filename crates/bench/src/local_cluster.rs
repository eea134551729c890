//! `--start-cluster`: a throwaway Redis Cluster of three masters on free loopback ports, with
//! its files in a temporary directory, stopped by PID when the benchmark ends.
//!
//! Each server also gets a watchdog (`sh`) that stops it by PID, if it still runs in the
//! cluster's directory, once the benchmark's process is gone (so a killed benchmark leaves no
//! server behind), and then removes the directory.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How long the cluster may take to reach `cluster_state:ok`.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running throwaway cluster. Dropping it stops its servers.
pub struct LocalCluster {
    servers: Vec<(u16, Child)>,
    dir: PathBuf,
}

/// A port `p` from 30000 up such that `p` and its cluster bus port `p + 10000` are free.
fn free_port(taken: &[u16]) -> Result<u16> {
    for _ in 0..1_000 {
        let port = 30_000 + rand::random::<u16>() % 10_000;
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if !taken.contains(&port) && free(port) && free(port + 10_000) {
            return Ok(port);
        }
    }
    bail!("found no free pair of loopback ports")
}

/// Starts a process that waits for this process to exit, then stops `pid` (only if it still
/// runs in `dir`: PIDs are reused) and removes `dir`.
fn watch(pid: u32, dir: &Path) {
    let script = r#"
        while kill -0 "$0" 2>/dev/null; do sleep 0.5; done
        cwd=$(readlink "/proc/$1/cwd" 2>/dev/null)
        if [ "$cwd" = "$2" ] || [ "$cwd" = "$2 (deleted)" ]; then kill "$1"; fi
        rm -rf -- "$2"
    "#;
    let _ = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(std::process::id().to_string())
        .arg(pid.to_string())
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

/// Runs `redis-cli -p port` with `args`; its output.
fn cli(port: u16, args: &[&str]) -> Result<String> {
    let out = Command::new("redis-cli").args(["-h", "127.0.0.1", "-p", &port.to_string()]).args(args).output()?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl LocalCluster {
    /// Starts three `redis-server --cluster-enabled yes` nodes, joins them with
    /// `redis-cli --cluster create … --cluster-replicas 0 --cluster-yes`, and waits for every
    /// node to report `cluster_state:ok`.
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("og-bench-cluster-").tempdir()?.keep();
        let dir = dir.canonicalize().unwrap_or(dir);
        let mut cluster = Self { servers: Vec::new(), dir };
        while cluster.servers.len() < 3 {
            let taken: Vec<u16> = cluster.servers.iter().map(|(p, _)| *p).collect();
            let port = free_port(&taken)?;
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--daemonize", "no", "--cluster-enabled", "yes", "--cluster-node-timeout", "5000"])
                .arg("--cluster-config-file")
                .arg(cluster.dir.join(format!("nodes-{port}.conf")))
                .arg("--dir")
                .arg(&cluster.dir)
                .arg("--logfile")
                .arg(cluster.dir.join(format!("redis-{port}.log")))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting redis-server (is it installed?)")?;
            watch(child.id(), &cluster.dir);
            cluster.servers.push((port, child));
            let deadline = Instant::now() + Duration::from_secs(10);
            while cli(port, &["PING"])?.trim() != "PONG" {
                if Instant::now() > deadline {
                    bail!("redis-server on port {port} did not answer within 10 s");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(cluster.nodes())
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .context("running redis-cli --cluster create")?;
        if !created.status.success() {
            bail!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&created.stdout),
                String::from_utf8_lossy(&created.stderr)
            );
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let mut ready = true;
            for (port, _) in &cluster.servers {
                let info = cli(*port, &["CLUSTER", "INFO"])?;
                ready &= info.lines().any(|l| l.trim() == "cluster_state:ok")
                    && info.lines().any(|l| l.trim() == "cluster_known_nodes:3");
            }
            if ready {
                return Ok(cluster);
            }
            if Instant::now() > deadline {
                bail!("the cluster did not reach cluster_state:ok within {READY_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `127.0.0.1:<port>` of each node.
    pub fn nodes(&self) -> Vec<String> {
        self.servers.iter().map(|(port, _)| format!("127.0.0.1:{port}")).collect()
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.servers {
            // `Child::kill` signals this child's own PID.
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
