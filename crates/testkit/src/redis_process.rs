//! Throwaway `redis-server` processes on loopback, for tests and benchmarks: single servers
//! and a three-master Redis Cluster.
//!
//! Every server gets a watchdog (`sh`) that stops it by PID once the process that started it is
//! gone, if it still runs in its directory (PIDs are reused), and then removes the directory:
//! a killed test or benchmark leaves no server behind.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port `p` from 30000 up such that `p` and its cluster bus port `p + 10000` are free.
fn free_port(taken: &[u16]) -> Option<u16> {
    (0..1_000).map(|_| 30_000 + rand::random::<u16>() % 10_000).find(|&port| {
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        !taken.contains(&port) && free(port) && free(port + 10_000)
    })
}

/// Starts a process that waits for this process to exit, then stops `pid` (only if it still
/// runs in `dir`) and removes `dir`.
fn watch(pid: u32, dir: &Path) {
    let script = r#"
        while kill -0 "$0" 2>/dev/null; do sleep 0.2; done
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

/// Runs `redis-cli -p port` with `args`; its output, if it ran.
pub fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli").args(["-h", "127.0.0.1", "-p", &port.to_string()]).args(args).output().ok()?;
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A temporary directory that outlives this process (the watchdogs remove it), as servers
/// started in it see their working directory.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = tempfile::Builder::new().prefix(name).tempdir().expect("a temporary directory").keep();
    dir.canonicalize().unwrap_or(dir)
}

/// A `redis-server` started here, on 127.0.0.1 only, without persistence. Stopped when dropped.
#[derive(Debug)]
pub struct RedisProcess {
    /// Its port.
    pub port: u16,
    child: Child,
}

impl RedisProcess {
    /// Starts a server (a cluster node if `cluster`) on a free port not in `taken`, with its
    /// files in `dir`; `None` if it did not come up.
    pub fn start(dir: &Path, cluster: bool, taken: &[u16]) -> Option<Self> {
        let port = free_port(taken)?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--shutdown-on-sigterm", "nosave"])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join(format!("redis-{port}.log")));
        if cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000", "--cluster-config-file"])
                .arg(dir.join(format!("nodes-{port}.conf")));
        }
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().ok()?;
        watch(child.id(), dir);
        let mut server = Self { port, child };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if server.child.try_wait().ok().flatten().is_some() {
                return None;
            }
            if cli(port, &["PING"]).is_some_and(|r| r.trim() == "PONG") {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        server.stop();
        None
    }

    /// Starts a server that speaks TLS only, on a free port, with the certificate `cert` and
    /// key `key` (PEM; clients need no certificate of their own); `None` if it did not come up.
    pub fn start_tls(dir: &Path, cert: &Path, key: &Path, ca: &Path) -> Option<Self> {
        let port = free_port(&[])?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", "0", "--tls-port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no", "--shutdown-on-sigterm", "nosave"])
            .arg("--tls-cert-file")
            .arg(cert)
            .arg("--tls-key-file")
            .arg(key)
            .arg("--tls-ca-cert-file")
            .arg(ca)
            .args(["--tls-auth-clients", "no"])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join(format!("redis-tls-{port}.log")));
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().ok()?;
        watch(child.id(), dir);
        let mut server = Self { port, child };
        let ping = || {
            Command::new("redis-cli")
                .args(["--tls", "--cacert"])
                .arg(ca)
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "PING"])
                .output()
                .ok()
                .is_some_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if server.child.try_wait().ok().flatten().is_some() {
                return None;
            }
            if ping() {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        server.stop();
        None
    }

    /// Starts a plain (non-cluster) server, trying a few ports.
    pub fn standalone(dir: &Path) -> Self {
        (0..5).find_map(|_| Self::start(dir, false, &[])).expect("a redis-server starts")
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (`STOP`, `CONT`, `TERM`) to the server, by PID. After `STOP`, returns once
    /// every thread of the server is stopped: one thread takes the signal and stops the others when
    /// it next runs, after the signal is sent, and until then they go on answering.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.pid().to_string()).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{signal} {}", self.pid());
        if signal == "STOP" {
            if !Path::new(&format!("/proc/{}/task", self.pid())).is_dir() {
                std::thread::sleep(Duration::from_millis(100)); // no /proc here: a short wait in its place
                return;
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while !self.stopped() {
                assert!(Instant::now() < deadline, "redis-server {} did not stop within 5 s of SIGSTOP", self.pid());
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// Whether every thread of the server shows stopped in `/proc` (a thread gone, a zombie or
    /// dead, counts as stopped).
    fn stopped(&self) -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid())) else {
            return true; // the process is gone
        };
        tasks.flatten().all(|task| match std::fs::read_to_string(task.path().join("stat")) {
            Ok(stat) => stat
                .rfind(')')
                .and_then(|end| stat[end..].chars().nth(2))
                .is_none_or(|state| matches!(state, 'T' | 't' | 'Z' | 'X')),
            Err(_) => true,
        })
    }

    /// Stops the server and waits for it to exit.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Redis Cluster of three masters on 127.0.0.1, with its files in `dir`: started, joined
/// (`redis-cli --cluster create … --cluster-replicas 0`), and waited for until every node says
/// `cluster_state:ok` (30 s at most).
pub fn start_cluster(dir: &Path) -> Result<Vec<RedisProcess>, String> {
    let mut servers: Vec<RedisProcess> = Vec::new();
    for _ in 0..20 {
        if servers.len() == 3 {
            break;
        }
        let taken: Vec<u16> = servers.iter().map(|s| s.port).collect();
        servers.extend(RedisProcess::start(dir, true, &taken));
    }
    if servers.len() < 3 {
        return Err("could not start three redis-server cluster nodes (is redis-server installed?)".into());
    }
    let nodes: Vec<String> = servers.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
    let created = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(&nodes)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running redis-cli: {e}"))?;
    if !created.status.success() {
        return Err(format!(
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&created.stdout),
            String::from_utf8_lossy(&created.stderr)
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = |s: &RedisProcess| {
        cli(s.port, &["CLUSTER", "INFO"]).is_some_and(|info| {
            info.lines().any(|l| l.trim() == "cluster_state:ok")
                && info.lines().any(|l| l.trim() == "cluster_known_nodes:3")
        })
    };
    while !servers.iter().all(ready) {
        if Instant::now() > deadline {
            return Err("the cluster did not reach cluster_state:ok within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(servers)
}
