//! Redis and Redis Cluster: key prefixes of the benchmark's own, the raw Lua baseline, and bulk
//! preloading of records in the store's own layout.
//!
//! Every measurement gets a fresh prefix `og-bench-<16 hex digits>:`; [`Redis::cleanup`]
//! deletes the keys under every prefix this run used (`SCAN MATCH <prefix>*` on every master,
//! then `UNLINK`), and nothing else.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use onceguard_core::store::DEFAULT_STORE_TIMEOUT;
use onceguard_core::{Guard, Key, Namespace, Scope, TenantId, Timestamp};
use onceguard_store_redis::layout::{Keys, Placement};
use onceguard_store_redis::scripts::ClaimCall;
use onceguard_store_redis::{RedisOptions, RedisStore, RedisTarget};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Script};

use crate::harness::{
    Measured, RETENTION, guard_on, measure, preloaded_fingerprint, preloaded_record, random_tag, warmup_for,
};

/// The raw baseline's claim: one key, set once, as a `SET NX` would; answers 1 when it
/// claimed the key and 0 when the key existed.
pub const RAW_CLAIM: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[1])
return 1
"#;

/// A claim of a fresh key in the store's layout reduced to the commands it runs, each step
/// adding one: what the server spends on each, without the claim script's decisions. The keys
/// and arguments are the claim script's (see [`Redis::script_costs`]).
pub const CLAIM_FLOOR: [(&str, &str); 5] = [
    ("GET record", "redis.call('GET', KEYS[1])"),
    ("+ GET slot fence mark", "redis.call('GET', KEYS[2])"),
    ("+ INCR fence counter", "local fence = redis.call('INCR', KEYS[3])"),
    ("+ SET slot fence mark", "redis.call('SET', KEYS[2], fence)"),
    (
        "+ SET record PX (12 fields packed)",
        "redis.call('SET', KEYS[1], cmsgpack.pack({t = ARGV[6], n = ARGV[7], k = ARGV[8], st = 'in_progress', \
         fp = ARGV[2], at = '1', le = ARGV[1], re = ARGV[4], ca = ARGV[1], up = ARGV[1], ex = ARGV[1], fe = fence}), \
         'PX', ARGV[4])",
    ),
];

/// The place of the short script (`CLAIM_NEW`) among [`Redis::script_costs`]'s variants.
const NEW_KEY_VARIANT: usize = 2;

/// Records per pipeline when preloading.
const PRELOAD_CHUNK: usize = 2_000;

/// Pipelines in flight at once when preloading.
const PRELOAD_PIPELINES: usize = 4;

/// A timeout long enough for bulk commands (loads, scans).
const BULK_TIMEOUT: Duration = Duration::from_secs(60);

/// One Redis server or cluster used by the benchmark, and the prefixes this run used on it.
pub struct Redis {
    target: RedisTarget,
    /// `redis://host:port` of every master (one for a single server).
    masters: Vec<String>,
    prefixes: Vec<String>,
}

/// `redis://host:port` of every master of the cluster that `seeds` belong to, from
/// `CLUSTER NODES` as the first seed that answers sees it.
async fn cluster_masters(seeds: &[String]) -> Result<Vec<String>> {
    let mut last = None;
    for seed in seeds {
        let answer: Result<String> = async {
            let mut conn = bulk_connection(seed).await?;
            Ok(redis::cmd("CLUSTER").arg("NODES").query_async(&mut conn).await?)
        }
        .await;
        match answer {
            Ok(nodes) => {
                let masters: Vec<String> = nodes
                    .lines()
                    .filter_map(|line| {
                        let fields: Vec<&str> = line.split_whitespace().collect();
                        let flags = fields.get(2)?;
                        let addr = fields.get(1)?.split('@').next()?;
                        (flags.split(',').any(|f| f == "master") && !flags.contains("fail")).then(|| {
                            let auth = seed.split_once("://").and_then(|(_, r)| r.rsplit_once('@')).map(|(a, _)| a);
                            match auth {
                                Some(auth) => format!("redis://{auth}@{addr}"),
                                None => format!("redis://{addr}"),
                            }
                        })
                    })
                    .collect();
                ensure!(!masters.is_empty(), "CLUSTER NODES at {seed} lists no master");
                return Ok(masters);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no cluster seed given")))
}

/// A connection for bulk work (loads, scans) with a long response timeout.
async fn bulk_connection(url: &str) -> Result<MultiplexedConnection> {
    let client = redis::Client::open(url)?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(BULK_TIMEOUT));
    Ok(client.get_multiplexed_async_connection_with_config(&config).await?)
}

/// A connection configured as the store configures its own (one multiplexed connection with
/// the store's timeouts), for the raw baseline.
async fn store_like_connection(url: &str) -> Result<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(DEFAULT_STORE_TIMEOUT))
        .set_response_timeout(Some(DEFAULT_STORE_TIMEOUT))
        .set_number_of_retries(1);
    Ok(ConnectionManager::new_with_config(redis::Client::open(url)?, config).await?)
}

/// A cluster connection configured as the store configures its own.
async fn store_like_cluster_connection(seeds: &[String]) -> Result<redis::cluster_async::ClusterConnection> {
    let client = redis::cluster::ClusterClientBuilder::new(seeds.to_vec())
        .connection_timeout(DEFAULT_STORE_TIMEOUT)
        .response_timeout(DEFAULT_STORE_TIMEOUT)
        .retries(2)
        .build()?;
    Ok(client.get_async_connection().await?)
}

/// Runs `ops` raw claims from `concurrency` tasks, spread over `conns` (task `t` uses
/// connection `t mod conns`), each one `EVALSHA` of [`RAW_CLAIM`] on a fresh key under
/// `prefix`, which must answer 1.
async fn raw_claims<C>(conns: Vec<C>, prefix: &str, ops: usize, concurrency: usize) -> Result<Measured>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let script = Arc::new(Script::new(RAW_CLAIM));
    let prefix = prefix.to_owned();
    measure(ops, concurrency, warmup_for(ops, concurrency), move |i| {
        let mut conn = conns[i % conns.len()].clone();
        let (script, key) = (script.clone(), format!("{prefix}raw:{i}"));
        async move {
            let claimed: i64 = script.key(key).arg(i).invoke_async(&mut conn).await?;
            ensure!(claimed == 1, "raw key {i} was not claimed");
            Ok(())
        }
    })
    .await
}

/// `EVALSHA` calls and the microseconds Redis spent in them so far (`INFO commandstats`).
async fn evalsha_time(conn: &mut MultiplexedConnection) -> Result<(u64, u64)> {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await?;
    let line = info.lines().find(|l| l.starts_with("cmdstat_evalsha:")).unwrap_or("");
    let field = |name: &str| {
        line.split([':', ',']).find_map(|f| f.strip_prefix(name)?.strip_prefix('=')?.parse::<u64>().ok()).unwrap_or(0)
    };
    Ok((field("calls"), field("usec")))
}

impl Redis {
    /// The server or cluster at `target`; fails if it does not answer.
    pub async fn connect(target: RedisTarget) -> Result<Self> {
        let masters = match &target {
            RedisTarget::Single(url) => {
                let mut conn = bulk_connection(url).await.with_context(|| format!("connecting to Redis at {url}"))?;
                redis::cmd("PING").query_async::<String>(&mut conn).await?;
                vec![url.clone()]
            }
            RedisTarget::Cluster(seeds) => {
                cluster_masters(seeds).await.with_context(|| format!("reading the cluster's nodes from {seeds:?}"))?
            }
        };
        Ok(Self { target, masters, prefixes: Vec::new() })
    }

    /// The store URL of the store under `prefix` on a single server (`None` on a cluster).
    pub fn store_url(&self, prefix: &str) -> Option<String> {
        match &self.target {
            RedisTarget::Single(url) => {
                let sep = if url.contains('?') { '&' } else { '?' };
                Some(format!("{url}{sep}prefix={prefix}"))
            }
            RedisTarget::Cluster(_) => None,
        }
    }

    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.target, RedisTarget::Cluster(_))
    }

    /// A fresh key prefix, remembered so that [`Redis::cleanup`] deletes its keys.
    fn new_prefix(&mut self) -> String {
        let prefix = format!("og-bench-{}:", random_tag());
        self.prefixes.push(prefix.clone());
        prefix
    }

    /// An Onceguard Redis store (default options) under a fresh prefix, a guard over it, and
    /// the prefix.
    pub async fn store(&mut self) -> Result<(Guard, String)> {
        let prefix = self.new_prefix();
        let options = RedisOptions { prefix: prefix.clone(), ..RedisOptions::default() };
        let store = RedisStore::connect_with(&self.target, options).await?;
        Ok((guard_on(store), prefix))
    }

    /// The raw baseline on `connections` connections (each set up as the store sets up its
    /// one), under a fresh prefix (deleted afterwards).
    pub async fn raw_claims(&mut self, ops: usize, concurrency: usize, connections: usize) -> Result<Measured> {
        let prefix = self.new_prefix();
        let measured = match &self.target {
            RedisTarget::Single(url) => {
                let mut conns = Vec::with_capacity(connections);
                for _ in 0..connections {
                    conns.push(store_like_connection(url).await?);
                }
                raw_claims(conns, &prefix, ops, concurrency).await
            }
            RedisTarget::Cluster(seeds) => {
                let mut conns = Vec::with_capacity(connections);
                for _ in 0..connections {
                    conns.push(store_like_cluster_connection(seeds).await?);
                }
                raw_claims(conns, &prefix, ops, concurrency).await
            }
        };
        self.delete_prefix(&prefix).await?;
        measured
    }

    /// What a claim of a fresh key costs the server itself, in microseconds per call (from
    /// `INFO commandstats`, so other `EVALSHA` traffic on the server skews it): the raw claim,
    /// the store's claim script, the short script by which the store reads a key and acquires
    /// it if it has no record (`CLAIM_NEW`, given the record the store packed), and each step of
    /// [`CLAIM_FLOOR`]. Each runs `ops` calls from 16 tasks on one multiplexed connection, on
    /// fresh keys of one tenant spread over its slots, with the keys and arguments the store
    /// gives that script. One server only.
    pub async fn script_costs(&mut self, ops: usize) -> Result<Vec<(String, f64)>> {
        let RedisTarget::Single(url) = &self.target else { bail!("measured on one server only") };
        let conn = bulk_connection(url).await?;
        let prefix = self.new_prefix();
        let keys = Arc::new(Keys::new(&prefix).map_err(anyhow::Error::msg)?);
        let scripts = &onceguard_store_redis::scripts::SCRIPTS;
        let mut variants = vec![
            ("raw claim (EXISTS, HSET)".to_owned(), Script::new(RAW_CLAIM), None),
            ("Onceguard's claim script".to_owned(), scripts.claim.clone(), Some("acquired")),
            ("Onceguard's claim of a new key (CLAIM_NEW)".to_owned(), scripts.claim_new.clone(), Some("acquired")),
        ];
        for i in 0..CLAIM_FLOOR.len() {
            let body: Vec<&str> = CLAIM_FLOOR[..=i].iter().map(|(_, line)| *line).collect();
            let source = format!("{}\nreturn 1", body.join("\n"));
            variants.push((format!("  {}", CLAIM_FLOOR[i].0), Script::new(&source), None));
        }
        // What every call shares, made once.
        let (tenant, namespace) = (TenantId::parse("bench")?, Namespace::parse("bench")?);
        let fingerprint = Arc::new(preloaded_fingerprint());
        let retention_ms = u64::try_from(RETENTION.as_millis())?;
        let mut costs = Vec::new();
        for (v, (name, script, expect)) in variants.into_iter().enumerate() {
            let (script, keys) = (Arc::new(script), keys.clone());
            let (tenant, namespace, fingerprint) = (tenant.clone(), namespace.clone(), fingerprint.clone());
            let mut stats = conn.clone();
            let before = evalsha_time(&mut stats).await?;
            let conn = conn.clone();
            measure(ops, 16, warmup_for(ops, 16), move |i| {
                let (script, keys, mut conn, fingerprint) =
                    (script.clone(), keys.clone(), conn.clone(), fingerprint.clone());
                let key = Key::parse(&format!("{v}-{i}"));
                let scope = key.map(|key| Scope::new(tenant.clone(), namespace.clone(), key));
                async move {
                    let scope = scope?;
                    let placement = Placement::of(&scope);
                    let mut invocation = script.prepare_invoke();
                    if v == NEW_KEY_VARIANT {
                        // As the store sends it: the record decided and packed here, cut
                        // where the script writes the fence it draws and the store's time.
                        let req = onceguard_core::ClaimRequest {
                            recovery: Default::default(),
                            scope: scope.clone(),
                            fingerprint: (*fingerprint).clone(),
                            lease: Duration::from_secs(60),
                            retention: RETENTION,
                            run: None,
                            cost: 0,
                            max_in_flight: None,
                            refused_runs: Vec::new(),
                            approval: None,
                        };
                        let (_, record) =
                            onceguard_core::protocol::claim(None, &req, Timestamp::now(), || onceguard_core::Fence(0));
                        let record = record.context("a key with no record is acquired")?;
                        let new = onceguard_store_redis::NewRecord::of(&record).context("a lease")?;
                        invocation
                            .key(keys.record(&placement))
                            .key(keys.fence_mark(placement.slot, &scope.tenant))
                            .key(keys.fence_counter(&scope.tenant))
                            .arg("")
                            .arg(60_000);
                        for part in new.parts() {
                            invocation.arg(part);
                        }
                    } else {
                        ClaimCall {
                            keys: &keys,
                            scope: &scope,
                            placement: &placement,
                            clock: "",
                            fingerprint: &fingerprint,
                            lease_ms: 60_000,
                            retention_ms,
                            run: "",
                            margin_ms: 60_000,
                            source: "draw",
                            approval: None,
                            recovery: &onceguard_core::protocol::RecoveryGate::Open,
                        }
                        .add_to(&mut invocation);
                        invocation.key(keys.fence_counter(&scope.tenant));
                    }
                    let answer: redis::Value = invocation.invoke_async(&mut conn).await?;
                    if let Some(expect) = expect {
                        let first = match &answer {
                            redis::Value::Array(items) => items.first().cloned(),
                            _ => None,
                        };
                        let first: Option<String> = first.map(redis::from_redis_value).transpose()?;
                        ensure!(first.as_deref() == Some(expect), "key {i}: the claim answered {answer:?}");
                    }
                    Ok(())
                }
            })
            .await?;
            let after = evalsha_time(&mut stats).await?;
            let calls = after.0.saturating_sub(before.0).max(1);
            costs.push((name, after.1.saturating_sub(before.1) as f64 / calls as f64));
        }
        self.delete_prefix(&prefix).await?;
        Ok(costs)
    }

    /// Deletes every key under `prefix`, on every master: `SCAN MATCH` then `UNLINK`
    /// (pipelined, one key per command, so that it also works across a cluster's slots).
    pub async fn delete_prefix(&mut self, prefix: &str) -> Result<()> {
        ensure!(self.prefixes.iter().any(|p| p == prefix), "prefix {prefix} was not used by this run");
        ensure!(!prefix.contains(['*', '?', '[', ']', '\\']), "prefix {prefix} holds glob characters");
        for master in &self.masters {
            let mut conn = bulk_connection(master).await?;
            let mut cursor: u64 = 0;
            loop {
                let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(format!("{prefix}*"))
                    .arg("COUNT")
                    .arg(10_000)
                    .query_async(&mut conn)
                    .await?;
                if !keys.is_empty() {
                    let mut pipe = redis::pipe();
                    for key in &keys {
                        pipe.cmd("UNLINK").arg(key).ignore();
                    }
                    pipe.query_async::<()>(&mut conn).await?;
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        self.prefixes.retain(|p| p != prefix);
        Ok(())
    }

    /// Deletes the keys of every prefix this run used and has not cleaned yet.
    pub async fn cleanup(&mut self) -> Result<()> {
        for prefix in self.prefixes.clone() {
            self.delete_prefix(&prefix).await?;
        }
        Ok(())
    }

    /// Writes preloaded records `from .. to` under `prefix` as the store's claim and complete
    /// scripts would have left them (one string per record with its TTL, the used-slot set),
    /// with fences above the store's counter, which it
    /// then raises past them (and the touched slots' fence marks with it). Pipelined,
    /// [`PRELOAD_CHUNK`] records per pipeline, [`PRELOAD_PIPELINES`] pipelines in flight. One
    /// server only.
    pub async fn grow(&self, prefix: &str, from: usize, to: usize, now: Timestamp) -> Result<Duration> {
        let RedisTarget::Single(url) = &self.target else { bail!("preloading is done on one server only") };
        ensure!(self.prefixes.iter().any(|p| p == prefix), "prefix {prefix} was not used by this run");
        let started = Instant::now();
        let keys = Keys::new(prefix).map_err(anyhow::Error::msg)?;
        let conn = bulk_connection(url).await?;
        // Every preloaded record is of one tenant: its counter and marks are raised past them.
        let tenant = crate::harness::preloaded_scope(from).tenant;
        let base: u64 = redis::cmd("GET")
            .arg(keys.fence_counter(&tenant))
            .query_async::<Option<u64>>(&mut conn.clone())
            .await?
            .unwrap_or(0);
        let chunks: Vec<(usize, usize)> =
            (from..to).step_by(PRELOAD_CHUNK).map(|start| (start, (start + PRELOAD_CHUNK).min(to))).collect();
        let slots: Vec<Vec<u16>> = futures::stream::iter(chunks)
            .map(|(start, end)| {
                let (mut conn, keys) = (conn.clone(), keys.clone());
                async move {
                    let mut pipe = redis::pipe();
                    let mut slots: BTreeSet<u16> = BTreeSet::new();
                    for i in start..end {
                        let fence = base + (i - from) as u64 + 1;
                        let record = preloaded_record(i, onceguard_core::Fence(fence), now);
                        let placement = Placement::of(&record.scope);
                        let key = keys.record(&placement);
                        pipe.cmd("SET")
                            .arg(&key)
                            .arg(onceguard_store_redis::packed_record(&record))
                            .arg("PX")
                            .arg(record.expires_at.0 - now.0)
                            .ignore();
                        slots.insert(placement.slot);
                    }
                    pipe.query_async::<()>(&mut conn).await?;
                    Ok::<Vec<u16>, anyhow::Error>(slots.into_iter().collect())
                }
            })
            .buffer_unordered(PRELOAD_PIPELINES)
            .try_collect()
            .await?;
        let mut slots: Vec<u16> = slots.into_iter().flatten().collect();
        slots.sort_unstable();
        slots.dedup();
        let top = base + (to - from) as u64;
        let mut pipe = redis::pipe();
        pipe.cmd("SET").arg(keys.fence_counter(&tenant)).arg(top).ignore();
        for slot in &slots {
            // The counter was at least every mark; the new top is above both.
            pipe.cmd("SET").arg(keys.fence_mark(*slot, &tenant)).arg(top).ignore();
            pipe.cmd("SADD").arg(keys.used_slots()).arg(*slot).ignore();
        }
        pipe.query_async::<()>(&mut conn.clone()).await?;
        Ok(started.elapsed())
    }

    /// `used_memory` of the server, in bytes (one server only).
    pub async fn used_memory(&self) -> Result<u64> {
        let RedisTarget::Single(url) = &self.target else { bail!("one server only") };
        let mut conn = bulk_connection(url).await?;
        let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn).await?;
        let used =
            info.lines().find_map(|l| l.strip_prefix("used_memory:")).context("INFO memory has no used_memory")?;
        Ok(used.trim().parse()?)
    }
}
