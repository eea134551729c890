//! `--start-cluster`: a throwaway Redis Cluster of three masters on free loopback ports, with
//! its files in a temporary directory, stopped by PID when the benchmark ends (and by the
//! servers' watchdogs if the benchmark is killed); see `onceguard_testkit::redis_process`.

use anyhow::{Result, anyhow};
use onceguard_testkit::redis_process::{RedisProcess, scratch_dir, start_cluster};

/// A running throwaway cluster. Dropping it stops its servers.
pub struct LocalCluster {
    servers: Vec<RedisProcess>,
}

impl LocalCluster {
    /// Starts three cluster nodes, joins them and waits for `cluster_state:ok`.
    pub fn start() -> Result<Self> {
        let dir = scratch_dir("og-bench-cluster-");
        Ok(Self { servers: start_cluster(&dir).map_err(|e| anyhow!(e))? })
    }

    /// `127.0.0.1:<port>` of each node.
    pub fn nodes(&self) -> Vec<String> {
        self.servers.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect()
    }
}
