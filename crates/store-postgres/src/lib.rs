//! The PostgreSQL store: the durable store that several Onceguard instances share.
//!
//! # How it keeps the contract
//!
//! - **Atomicity**: a claim or fenced call runs in a transaction that first takes a
//!   transaction-scoped advisory lock on the key, then reads the record in a statement of its
//!   own (so with a snapshot taken under the lock), runs the protocol in Rust and writes the
//!   record it returns. Another instance's operation on the same key waits for the lock, so
//!   read-decide-write is never interleaved, also for keys that have no row yet.
//! - **Group commit**: writer tasks take every job waiting (up to [`MAX_BATCH`], at most one job
//!   per key) into one transaction. `BEGIN`, the batch's key locks (one statement, in ascending
//!   lock order, so batches of different instances never deadlock) and its reads (one
//!   statement) are sent together; the jobs are decided in Rust; then the writes (one multi-row
//!   upsert) and `COMMIT` are sent together: two round trips, whatever the batch's size. One
//!   writer at a time takes a batch and reads it, while the batches before it wait for their
//!   commits' WAL flush, so a batch holds every job that came in meanwhile. An answer is sent
//!   only after its batch's commit succeeded; if it fails, every job of the batch answers
//!   `Unavailable` and nothing of it took effect.
//! - **Decided before the read, written only if right**: a claim of a key that this instance
//!   knows no record of is decided as if the key had no row (it acquires), and a fenced call on
//!   a key this instance claimed is decided on the in-progress record it last wrote (kept in
//!   memory, `Known`), both with `protocol` as usual. The statement that reads the batch's
//!   keys, under their locks, also writes each such record, but only where the key holds what
//!   was assumed: no row, or exactly the record assumed (its `doc` and `body`). A batch whose
//!   every job was decided so commits in the same round trip: one round trip in all. Where the
//!   assumption was wrong, nothing was written for that key, and its job is decided on the
//!   record read, as any other (in a batch that committed already, a job that must then write
//!   runs again in a batch of its own). What is in memory is never taken as the record: it
//!   only says what to write if the record is that.
//! - **Fences** come from the sequence `og_fence`, drawn *after* the key's lock is held, so a
//!   key's next fence is always greater than every fence it had; the sequence is never reset, so
//!   fences keep growing after a record expired, was swept or purged. The read statement draws
//!   one for each claim of a key that has no row (such a claim acquires unless a limit denies
//!   it), and writes it into a claim decided before the read, in place of `GUESSED_FENCE`; a
//!   claim that acquires a key that has a row (a recovery) has its fence drawn in one more round
//!   trip. So fences are drawn only for claims that acquire (or are denied).
//! - **Plans**: the batch's statements run with `plan_cache_mode = force_generic_plan`, planned
//!   once per connection, and each key is an index lookup in that plan.
//! - **Retention** is checked when read (`expires_at > now`); the sweep deletes expired rows in
//!   bounded batches with `FOR UPDATE SKIP LOCKED`, so it never waits on (or blocks) a claim.
//! - **Waits across instances**: once a batch (or a purge) committed, the keys it finished are
//!   handed to a notifier task that `pg_notify`s them on the schema's channel, those finished
//!   within `NOTIFY_WINDOW` (5 ms) in one statement, on a connection of its own (a `NOTIFY`
//!   takes a database-wide lock while its transaction commits, so it is kept out of the
//!   batches, and each notifying transaction waits for a WAL flush). A `LISTEN` connection
//!   feeds [`onceguard_core::store::ClaimStore::changes`]. Waiters also poll, so a lost notification only delays a replay.
//! - **Fail closed**: every statement runs under `statement_timeout`, and taking a connection
//!   from the pool times out; both answer `Unavailable` (HTTP 503), never a decision. The pool
//!   reconnects by itself when the server comes back.
//!
//! # Budgets, quotas and revocation
//!
//! - **In the batch**: once its keys are locked and read, a batch works out what its jobs need
//!   and takes it in one more pipelined round trip: for each tenant
//!   with an acquiring claim that carries an in-flight quota, the tenant's quota lock and its
//!   leases that have not passed (`og_lock_leases`, on the index `og_records_state`); for each
//!   run that an acquiring claim names, or that a fenced call reporting cost charges, the run's
//!   lock and row (`og_lock_run`). It then decides its jobs in order, on a ledger of those leases
//!   and runs that each decision updates, so a job sees the ones before it in the batch; a claim
//!   goes through `control::admit`, and the records and the charged runs (`og_runs`) are
//!   written in the batch's transaction. A denied claim writes nothing (the fence drawn for it
//!   is skipped: a sequence never gives a number back).
//! - **Exact under concurrency**: every claim that counts a tenant's leases holds the tenant's
//!   quota lock from before its count to its commit, and every transaction that writes a run
//!   holds the run's lock from before its read to its commit; PostgreSQL releases a
//!   transaction's locks only once its commit is visible, and each read inside the lock
//!   functions takes a fresh snapshot after the lock. So two batches, of this instance or of
//!   another, never both count the same leases or charge the same usage: of 64 concurrent
//!   claims against a budget of 10, exactly 10 acquire. Claims with no quota and no run take
//!   neither lock and cost what they did before.
//! - **Deadlock freedom**: locks are taken in one global order: key locks (advisory, one
//!   `bigint`) in ascending order, then quota locks (advisory, (1, hash)) in ascending order,
//!   then run locks ((2, hash)) in ascending order. A batch takes them in that order; revoking
//!   takes key locks only; setting a budget takes one run lock. Rows of `og_records` are written
//!   only under their key's lock (the sweep skips locked rows, a purge is one statement that
//!   waits for nothing else), rows of `og_runs` only under their run's lock, and a claim rate's
//!   row is locked by a transaction that takes no other lock. No transaction ever waits for a
//!   lock that comes before one it holds, so no cycle of waits can form.
//! - **Revoking leases** runs in chunks of up to [`MAX_BATCH`] keys in (namespace, key) order,
//!   each one transaction: the chunk's key locks in ascending order, each record read again under
//!   its lock and, if it is still a live in-progress record the switch covers, given a fence
//!   from `og_fence` drawn after the locks (`control::revoke`). (Chunks keep one transaction's
//!   advisory locks within PostgreSQL's lock table when a switch covers many keys.)
//! - **Claim rates**: one transaction locks the tenant's row of `og_rates` by an upsert that
//!   returns its theoretical arrival time, runs `control::gcra`, and writes the new time and
//!   commits, or rolls back when the claim must wait.
//! - Control documents (`og_control`) and the audit log (`og_audit`, listed newest first by id
//!   from the indexes on (tenant, id), (tenant, action, id) and (tenant, actor, id)) are plain
//!   rows.
//! - **Migrations** are numbered in `og_migrations` and applied once each; an applied one is
//!   never edited, a change of schema is a new entry.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{ClientWrapper, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures::StreamExt;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, Tenant};
use onceguard_core::control::{
    Admission, AuditEntry, AuditFilter, AuditPage, Budget, ControlDoc, ControlKind, Rate, Run, RunUsage, SwitchTarget,
};
use onceguard_core::protocol::{self, ClaimRequest, Mutation};
use onceguard_core::store::{ClaimStore, ControlStore, ListFilter, MAX_PAGE, Page, RunStore, StoreError, TenantStore};
use onceguard_core::{
    ClaimOutcome, Fence, FencedOutcome, Key, Namespace, Record, RecordState, RunId, Scope, TenantId, Timestamp,
};
use tokio::sync::{Mutex, broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, NoTls, Row};

mod claims;
mod control;
mod runs;
mod tenants;

/// The most jobs committed in one transaction.
pub const MAX_BATCH: usize = 256;

/// How the store's writers have batched claims and fenced calls since it started (see
/// [`PgStore::batch_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Transactions committed by the writers.
    pub batches: u64,
    /// Claims and fenced calls answered in them.
    pub jobs: u64,
    /// Batches committed in one round trip: every job was decided before the read and the
    /// guess held or needed no write.
    pub one_round_trip: u64,
    /// Jobs whose guess did not hold and that ran again in a batch of their own.
    pub run_again: u64,
}

/// The counters behind [`BatchStats`].
#[derive(Debug, Default)]
struct BatchCounters {
    batches: AtomicU64,
    jobs: AtomicU64,
    one_round_trip: AtomicU64,
    run_again: AtomicU64,
}

/// Settings of the PostgreSQL store (from the store URL's query: `?schema=…&pool_size=…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgOptions {
    /// The schema that holds Onceguard's tables (created if missing).
    pub schema: String,
    /// Connections in the pool.
    pub pool_size: usize,
    /// Writer tasks running group commits in parallel.
    pub writers: usize,
    /// Longest any statement may run, and longest to wait for a connection.
    pub statement_timeout: Duration,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self { schema: "onceguard".into(), pool_size: 16, writers: 4, statement_timeout: Duration::from_secs(5) }
    }
}

/// Splits a `postgres://` URL into the connection URL and the store's own options
/// (`schema`, `pool_size`, `writers`, `statement_timeout` as query parameters).
pub fn parse_url(url: &str) -> Result<(String, PgOptions), String> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(format!("'{url}' is not a postgres:// URL"));
    }
    let mut options = PgOptions::default();
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let number = || value.parse::<usize>().map_err(|_| format!("{name}={value} is not a number"));
        match name {
            "schema" => options.schema = value.to_owned(),
            "pool_size" => options.pool_size = number()?.clamp(1, 1024),
            "writers" => options.writers = number()?.clamp(1, 64),
            "statement_timeout_ms" => options.statement_timeout = Duration::from_millis(number()? as u64),
            _ => kept.push(pair),
        }
    }
    if !valid_schema(&options.schema) {
        return Err(format!("schema '{}' must be 1 to 48 of a-z, 0-9 and _, starting with a letter", options.schema));
    }
    options.writers = options.writers.min(options.pool_size);
    let base = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Ok((base, options))
}

fn valid_schema(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 48
        && s.as_bytes()[0].is_ascii_lowercase()
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// The store cannot answer because of `e`: its message and its causes' (for an error the
/// server sent, the driver's own message is only "db error"; the server's words are its cause).
fn unavailable(e: impl std::error::Error) -> StoreError {
    StoreError::Unavailable(format!("postgres: {}", with_causes(&e)))
}

/// The store cannot answer, for a reason of its own.
fn stopped(why: &str) -> StoreError {
    StoreError::Unavailable(format!("postgres: {why}"))
}

/// `e`'s message followed by those of its causes that it does not already include.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("postgres: {e}"))
}

fn to_i64(t: Timestamp) -> i64 {
    i64::try_from(t.0).unwrap_or(i64::MAX)
}

fn timestamp(v: i64) -> Result<Timestamp, StoreError> {
    u64::try_from(v).map(Timestamp).map_err(corrupt)
}

/// An unsigned number as a `bigint`: saturates at `i64::MAX` (a count or a limit that large is
/// out of reach either way).
fn to_sql_u64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The migrations, in order; each runs once, recorded in `og_migrations`.
const MIGRATIONS: &[&str] = &[
    r#"
    CREATE SEQUENCE og_fence;
    CREATE TABLE og_records (
        tenant text NOT NULL,
        namespace text COLLATE "C" NOT NULL,
        key text COLLATE "C" NOT NULL,
        state text NOT NULL,
        run text,
        lease_expires_at bigint,
        expires_at bigint NOT NULL,
        doc text NOT NULL,
        body bytea,
        PRIMARY KEY (tenant, namespace, key)
    );
    CREATE INDEX og_records_expiry ON og_records (expires_at);
    CREATE INDEX og_records_state ON og_records (tenant, state, lease_expires_at);
    CREATE TABLE og_tenants (id text PRIMARY KEY, created_at bigint NOT NULL);
    CREATE TABLE og_api_keys (
        id text PRIMARY KEY,
        tenant text NOT NULL,
        role text NOT NULL,
        label text NOT NULL,
        secret_sha256 text NOT NULL,
        created_at bigint NOT NULL,
        revoked_at bigint
    );
    CREATE INDEX og_api_keys_tenant ON og_api_keys (tenant, created_at);
    CREATE FUNCTION og_lock_get(h bigint, t text, n text, k text) RETURNS TABLE (doc text, body bytea)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(h);
        RETURN QUERY SELECT r.doc, r.body FROM og_records r WHERE r.tenant = t AND r.namespace = n AND r.key = k;
    END $$;
"#,
    r#"
    CREATE TABLE og_runs (
        tenant text NOT NULL,
        run text NOT NULL,
        budget text NOT NULL,
        effects bigint NOT NULL,
        cost bigint NOT NULL,
        created_at bigint NOT NULL,
        updated_at bigint NOT NULL,
        PRIMARY KEY (tenant, run)
    );
    CREATE TABLE og_control (
        kind text NOT NULL,
        tenant text NOT NULL,
        id text NOT NULL,
        body text NOT NULL,
        PRIMARY KEY (kind, tenant, id)
    );
    CREATE TABLE og_rates (tenant text PRIMARY KEY, tat_us bigint NOT NULL);
    CREATE TABLE og_audit (
        tenant text NOT NULL,
        id text COLLATE "C" NOT NULL,
        at bigint NOT NULL,
        actor text NOT NULL,
        action text NOT NULL,
        doc text NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX og_audit_action ON og_audit (tenant, action, id);
    CREATE INDEX og_audit_actor ON og_audit (tenant, actor, id);
    -- Takes the tenant's quota lock (class 1), then reads the leases that have not passed at
    -- `since` (on og_records_state); the caller counts those live at each claim's time.
    CREATE FUNCTION og_lock_leases(h integer, t text, since bigint)
    RETURNS TABLE (lease_namespace text, lease_key text, lease_until bigint, live_until bigint)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(1, h);
        RETURN QUERY SELECT r.namespace::text, r.key::text, r.lease_expires_at, r.expires_at FROM og_records r
            WHERE r.tenant = t AND r.state = 'in_progress' AND r.lease_expires_at > since AND r.expires_at > since
              AND (r.doc::json ->> 'unknown') IS NULL;
    END $$;
    -- Takes a run's lock (class 2), then reads the run.
    CREATE FUNCTION og_lock_run(h integer, t text, r text)
    RETURNS TABLE (run_budget text, run_effects bigint, run_cost bigint, run_created_at bigint, run_updated_at bigint)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(2, h);
        RETURN QUERY SELECT u.budget, u.effects, u.cost, u.created_at, u.updated_at FROM og_runs u
            WHERE u.tenant = t AND u.run = r;
    END $$;
"#,
];

/// Serializes migrations of all instances (a session advisory lock key).
const MIGRATION_LOCK: i64 = 0x6f6e_6365_6775_6172; // "onceguar"

enum Op {
    Claim(ClaimRequest),
    Mutate { scope: Scope, fence: Fence, mutation: Mutation, max_checkpoints: usize },
}

impl Op {
    fn scope(&self) -> &Scope {
        match self {
            Self::Claim(req) => &req.scope,
            Self::Mutate { scope, .. } => scope,
        }
    }
}

#[derive(Debug)]
enum Answer {
    Claim(ClaimOutcome),
    Mutate(FencedOutcome),
}

struct Job {
    op: Op,
    now: Timestamp,
    /// The job decided before its key is read, made by the caller's task when it submitted the
    /// job (so not by a writer while it holds the intake).
    guess: Option<Guess>,
    reply: oneshot::Sender<Result<Answer, StoreError>>,
}

/// The PostgreSQL store. Dropping it stops its writer and listener tasks.
pub struct PgStore {
    pool: Pool,
    schema: String,
    jobs: mpsc::Sender<Job>,
    changes: broadcast::Sender<Scope>,
    finished: mpsc::UnboundedSender<Scope>,
    writers: Arc<Writers>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").field("schema", &self.schema).finish()
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        self.pool.close();
    }
}

impl PgStore {
    /// Connects to `url` (`postgres://…`, query options as in [`parse_url`]), creates the schema
    /// and runs pending migrations, and starts the writers and the `LISTEN` connection.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let (base, options) = parse_url(url).map_err(StoreError::Unavailable)?;
        Self::connect_with(&base, options).await
    }

    /// Like [`PgStore::connect`], with the options given apart.
    pub async fn connect_with(url: &str, options: PgOptions) -> Result<Self, StoreError> {
        if !valid_schema(&options.schema) {
            return Err(StoreError::Unavailable(format!("invalid schema name '{}'", options.schema)));
        }
        let mut config = tokio_postgres::Config::from_str(url).map_err(unavailable)?;
        config.connect_timeout(options.statement_timeout);
        if config.get_application_name().is_none() {
            config.application_name("onceguard");
        }
        migrate(&config, &options.schema).await?;
        config.options(format!(
            "-c search_path={} -c statement_timeout={}",
            options.schema,
            options.statement_timeout.as_millis()
        ));
        let manager =
            Manager::from_config(config.clone(), NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(options.pool_size)
            .wait_timeout(Some(options.statement_timeout))
            .create_timeout(Some(options.statement_timeout))
            .recycle_timeout(Some(options.statement_timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(unavailable)?;
        let channel = format!("og_changes_{}", options.schema);
        let (changes, _) = broadcast::channel(4096);
        let (jobs, queue) = mpsc::channel(4 * MAX_BATCH);
        let (finished, finished_rx) = mpsc::unbounded_channel();
        let writers = Arc::new(Writers {
            pool: pool.clone(),
            intake: Mutex::new(Intake { queue, deferred: VecDeque::new() }),
            known: Known::default(),
            finished: finished.clone(),
            counters: BatchCounters::default(),
        });
        let mut tasks: Vec<JoinHandle<()>> =
            (0..options.writers).map(|_| tokio::spawn(write_loop(writers.clone()))).collect();
        tasks.push(tokio::spawn(notify_loop(pool.clone(), finished_rx, channel.clone())));
        tasks.push(tokio::spawn(listen_loop(config, channel, changes.clone())));
        Ok(Self { pool, schema: options.schema, jobs, changes, finished, writers, tasks })
    }

    /// The schema holding the tables.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// How the writers have batched claims and fenced calls so far.
    pub fn batch_stats(&self) -> BatchStats {
        let counters = &self.writers.counters;
        BatchStats {
            batches: counters.batches.load(Ordering::Relaxed),
            jobs: counters.jobs.load(Ordering::Relaxed),
            one_round_trip: counters.one_round_trip.load(Ordering::Relaxed),
            run_again: counters.run_again.load(Ordering::Relaxed),
        }
    }

    async fn submit(&self, op: Op, now: Timestamp) -> Result<Answer, StoreError> {
        let (reply, answer) = oneshot::channel();
        let guess = Guess::of(&op, now, &self.writers.known);
        let job = Job { op, now, guess, reply };
        self.jobs.send(job).await.map_err(|_| stopped("the writers stopped"))?;
        answer.await.map_err(|_| stopped("the writer dropped the operation"))?
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(unavailable)
    }
}

/// Creates the schema and applies pending migrations, one instance at a time.
async fn migrate(config: &tokio_postgres::Config, schema: &str) -> Result<(), StoreError> {
    let (mut client, connection) = config.connect(NoTls).await.map_err(unavailable)?;
    let driver = tokio::spawn(connection);
    let result = async {
        client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]).await.map_err(unavailable)?;
        let applied = async {
            client.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}")).await.map_err(unavailable)?;
            client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {schema}.og_migrations (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
                ))
                .await
                .map_err(unavailable)?;
            let done: i32 = client
                .query_one(&format!("SELECT coalesce(max(version), 0) FROM {schema}.og_migrations"), &[])
                .await
                .map_err(unavailable)?
                .get(0);
            let done = usize::try_from(done).map_err(corrupt)?;
            if done > MIGRATIONS.len() {
                return Err(corrupt(format!("schema {schema} is at version {done}, newer than this onceguard knows")));
            }
            for (i, sql) in MIGRATIONS.iter().enumerate().skip(done) {
                let tx = client.transaction().await.map_err(unavailable)?;
                tx.batch_execute(&format!("SET LOCAL search_path = {schema}")).await.map_err(unavailable)?;
                tx.batch_execute(sql).await.map_err(unavailable)?;
                let version = i32::try_from(i + 1).map_err(corrupt)?;
                tx.execute("INSERT INTO og_migrations (version) VALUES ($1)", &[&version]).await.map_err(unavailable)?;
                tx.commit().await.map_err(unavailable)?;
                tracing::info!(schema, version, "applied a migration");
            }
            Ok(())
        }
        .await;
        let _ = client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]).await;
        applied
    }
    .await;
    drop(client);
    let _ = driver.await;
    result
}

/// FNV-1a over `parts`, each followed by a zero byte.
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// A stable 64-bit lock key for a scope (FNV-1a over its parts). Key locks use the advisory
/// locks of one `bigint`; every instance must compute the same key, so this never changes.
fn lock_key(scope: &Scope) -> i64 {
    fnv1a(&[scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()]) as i64
}

/// The hash half of a tenant's quota lock or a run's lock. Those are advisory locks of two
/// `integer`s, (class, hash), a lock space apart from the keys' `bigint` one: class 1 is a
/// tenant's quota (taken by `og_lock_leases`), class 2 a run (`og_lock_run`). The hash is
/// FNV-1a folded to 32 bits; two tenants (or runs) that share it share a lock, which costs some
/// waiting, never correctness.
fn class_lock(parts: &[&str]) -> i32 {
    let h = fnv1a(parts);
    (h ^ (h >> 32)) as u32 as i32
}

/// Where writers take their batches from, one writer at a time: the queue of submitted jobs,
/// and the jobs put off to a later batch.
struct Intake {
    queue: mpsc::Receiver<Job>,
    /// Jobs on a key that the batch being taken already had.
    deferred: VecDeque<Job>,
}

impl Intake {
    /// Waits for a job, then takes every job waiting, up to [`MAX_BATCH`] and one per key
    /// (a second job on a key goes in a later batch, so each key is read and written once per
    /// transaction), sorted by [`lock_key`]. `None` once the store is gone.
    async fn next_batch(&mut self) -> Option<Vec<Job>> {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut keys = HashSet::new();
        let mut put_off = VecDeque::new();
        for job in std::mem::take(&mut self.deferred) {
            if batch.len() < MAX_BATCH && keys.insert(job.op.scope().clone()) {
                batch.push(job);
            } else {
                put_off.push_back(job);
            }
        }
        if batch.is_empty() {
            let job = self.queue.recv().await?;
            keys.insert(job.op.scope().clone());
            batch.push(job);
        }
        while batch.len() < MAX_BATCH {
            let Ok(job) = self.queue.try_recv() else { break };
            if keys.insert(job.op.scope().clone()) {
                batch.push(job);
            } else {
                put_off.push_back(job);
            }
        }
        self.deferred = put_off;
        batch.sort_by_key(|job| lock_key(job.op.scope()));
        Some(batch)
    }
}

/// What the writer tasks share.
struct Writers {
    pool: Pool,
    intake: Mutex<Intake>,
    known: Known,
    finished: mpsc::UnboundedSender<Scope>,
    counters: BatchCounters,
}

/// A writer task. It holds the intake while it takes a batch and until the batch's reads are
/// answered, and lets go of it while the batch's `COMMIT` (and, for a batch whose jobs were
/// not all decided before the read, its writes) run: so one batch at a time gathers and reads
/// while those before it wait for their commits' WAL flush, and each batch takes every job
/// that came in meanwhile.
async fn write_loop(writers: Arc<Writers>) {
    loop {
        let mut turn = writers.intake.lock().await;
        let Some(mut batch) = turn.next_batch().await else { return };
        let guesses = batch.iter_mut().map(|job| job.guess.take()).collect();
        let mut result = run_batch(&writers, &batch, guesses, Some(turn)).await;
        if result.as_ref().is_err_and(is_retryable) {
            result = run_batch(&writers, &batch, Vec::new(), None).await;
        }
        let answers = match result {
            Ok(answers) => answers,
            Err(e) => {
                fail_batch(batch, &e);
                continue;
            }
        };
        // Jobs decided before their keys were read whose guess did not hold, and that must write
        // what their key holds: run again, on what is read this time.
        let mut again = Vec::new();
        for (job, answer) in batch.into_iter().zip(answers) {
            match answer {
                Some(answer) => {
                    let _ = job.reply.send(Ok(answer));
                }
                None => again.push(job),
            }
        }
        if again.is_empty() {
            continue;
        }
        writers.counters.run_again.fetch_add(again.len() as u64, Ordering::Relaxed);
        let mut result = run_batch(&writers, &again, Vec::new(), None).await;
        if result.as_ref().is_err_and(is_retryable) {
            result = run_batch(&writers, &again, Vec::new(), None).await;
        }
        match result {
            Ok(answers) => {
                for (job, answer) in again.into_iter().zip(answers) {
                    let answer = answer.ok_or_else(|| corrupt("a job read again was not decided"));
                    let _ = job.reply.send(answer);
                }
            }
            Err(e) => fail_batch(again, &e),
        }
    }
}

/// Answers every job of a batch that failed (nothing of it took effect).
fn fail_batch(batch: Vec<Job>, e: &BatchError) {
    tracing::warn!(error = %e, jobs = batch.len(), "postgres: a batch failed; nothing of it took effect");
    let e = unavailable(e);
    for job in batch {
        let _ = job.reply.send(Err(match &e {
            StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
            StoreError::Corrupt(m) => StoreError::Corrupt(m.clone()),
        }));
    }
}

/// Runs a batch (sorted by [`lock_key`]) in one transaction on a pooled connection: answers
/// each job's answer, `None` for a job to run again (see [`Decided::answers`]). Lets go of
/// `turn` as [`write_loop`] says. Keeps [`Writers::known`] up to date and hands the keys the
/// batch finished to the notifier.
async fn run_batch(
    writers: &Writers,
    batch: &[Job],
    mut guesses: Vec<Option<Guess>>,
    turn: Option<tokio::sync::MutexGuard<'_, Intake>>,
) -> Result<Vec<Option<Answer>>, BatchError> {
    let client = writers.pool.get().await.map_err(|e| BatchError::Pool(with_causes(&e)))?;
    guesses.resize_with(batch.len(), || None);
    let decided = match decide_batch(&client, batch, guesses, turn).await {
        Ok(decided) => decided,
        Err(e) => {
            abandon(client).await;
            writers.known.forget(batch.iter().map(|job| job.op.scope()));
            return Err(e);
        }
    };
    if !decided.committed
        && let Err(e) = write_and_commit(&client, &decided.writes, &decided.runs).await
    {
        abandon(client).await;
        writers.known.forget(batch.iter().map(|job| job.op.scope()));
        return Err(e);
    }
    writers.known.update(decided.known);
    let counters = &writers.counters;
    counters.batches.fetch_add(1, Ordering::Relaxed);
    counters.jobs.fetch_add(decided.answers.iter().filter(|a| a.is_some()).count() as u64, Ordering::Relaxed);
    if decided.committed {
        counters.one_round_trip.fetch_add(1, Ordering::Relaxed);
    }
    for scope in decided.finished {
        let _ = writers.finished.send(scope);
    }
    Ok(decided.answers)
}

/// The most records [`Known`] keeps; past it, it forgets them all and starts again.
const KNOWN_MAX: usize = 8_192;

/// A record as this instance last wrote it: the record, and its `doc` and `body` columns.
#[derive(Debug)]
struct KnownRecord {
    record: Record,
    doc: String,
    body: Option<Vec<u8>>,
}

/// The in-progress records this instance last wrote, by key, so that a fenced call on a key it
/// claimed can be decided before the key is read (see [`Guess`]). Only ever a guess: another
/// instance, a purge, the sweep or a revocation may have changed the record since, and the
/// guessed write then does not happen.
#[derive(Debug, Default)]
struct Known(std::sync::Mutex<HashMap<Scope, Arc<KnownRecord>>>);

impl Known {
    fn records(&self) -> std::sync::MutexGuard<'_, HashMap<Scope, Arc<KnownRecord>>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn get(&self, scope: &Scope) -> Option<Arc<KnownRecord>> {
        self.records().get(scope).cloned()
    }

    /// Notes what committed batches left their keys as: an in-progress record, or something
    /// this cache does not keep.
    fn update(&self, changes: Vec<(Scope, Option<Arc<KnownRecord>>)>) {
        let mut records = self.records();
        for (scope, known) in changes {
            match known {
                Some(known) => {
                    if records.len() >= KNOWN_MAX {
                        records.clear();
                    }
                    records.insert(scope, known);
                }
                None => {
                    records.remove(&scope);
                }
            }
        }
    }

    fn forget<'a>(&self, scopes: impl Iterator<Item = &'a Scope>) {
        let mut records = self.records();
        for scope in scopes {
            records.remove(scope);
        }
    }
}

/// What [`Known`] keeps of a record written with `doc` and `body`: in-progress records only.
fn known(record: &Record, doc: &str, body: &Option<Vec<u8>>) -> Option<Arc<KnownRecord>> {
    (record.state == RecordState::InProgress)
        .then(|| Arc::new(KnownRecord { record: record.clone(), doc: doc.to_owned(), body: body.clone() }))
}

/// The fence a guessed claim is decided with, and written with until the statement that
/// writes it puts the fence it draws in its place (never a real fence: those come from a
/// `bigint` sequence).
const GUESSED_FENCE: Fence = Fence(u64::MAX);

/// How a fence appears in a record's `doc`.
fn fence_in_doc(fence: Fence) -> String {
    format!("\"fence\":{}", fence.0)
}

/// A job decided before its key is read, on a guess of what the key holds, with the record to
/// write if the guess holds. The statement that reads the key writes that record only if the
/// key holds what was guessed, under the key's lock; the decision is `protocol::claim` or
/// `protocol::apply` on that record, as if it had been read. If the guess does not hold, the
/// job is decided on the record read, as any other.
#[derive(Debug)]
struct Guess {
    /// `None`: a claim, guessing that the key has no row; it then acquires, with the fence the
    /// statement draws. `Some`: a fenced call, guessing that the key holds this record.
    known: Option<Arc<KnownRecord>>,
    /// The answer if the guess holds (a claim's: with [`GUESSED_FENCE`]).
    answer: Answer,
    record: Record,
    doc: String,
    body: Option<Vec<u8>>,
}

impl Guess {
    /// The guess for a claim with no quota and no run of a key this instance knows of no record
    /// for, or for a fenced call that changes a record this instance wrote (and charges no run);
    /// `None` for any other job.
    fn of(op: &Op, now: Timestamp, known: &Known) -> Option<Self> {
        match op {
            Op::Claim(req) => {
                if req.max_in_flight.is_some() || req.run.is_some() || known.get(&req.scope).is_some() {
                    return None;
                }
                let (answer, record) = protocol::claim(None, req, now, || GUESSED_FENCE);
                let record = record?;
                let (doc, body) = record.clone().into_doc().ok()?;
                // The fence must be in the document once, and nothing else may depend on it,
                // for the statement to put the drawn fence in its place.
                let other = Fence(GUESSED_FENCE.0 - 1);
                let (other_doc, _) = Record { fence: other, ..record.clone() }.into_doc().ok()?;
                let (placeholder, replaced) = (fence_in_doc(GUESSED_FENCE), fence_in_doc(other));
                if doc.matches(&placeholder).count() != 1 || doc.replace(&placeholder, &replaced) != other_doc {
                    return None;
                }
                Some(Self { known: None, answer: Answer::Claim(answer), record, doc, body })
            }
            Op::Mutate { scope, fence, mutation, max_checkpoints } => {
                let known = known.get(scope)?;
                let (answer, record) =
                    protocol::apply(Some(known.record.clone()), *fence, mutation.clone(), now, *max_checkpoints);
                let record = record?;
                if onceguard_core::control::reported_cost(mutation) > 0 && record.run.is_some() {
                    return None;
                }
                let (doc, body) = record.clone().into_doc().ok()?;
                Some(Self { known: Some(known), answer: Answer::Mutate(answer), record, doc, body })
            }
        }
    }
}

#[derive(Debug)]
enum BatchError {
    Pg(tokio_postgres::Error),
    Pool(String),
    Data(String),
}

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Pg(e) => f.write_str(&with_causes(e)),
            Self::Pool(e) | Self::Data(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for BatchError {}

impl From<tokio_postgres::Error> for BatchError {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::Pg(e)
    }
}

/// Deadlocks and serialization failures: the batch rolled back and may simply run again.
fn is_retryable(e: &BatchError) -> bool {
    matches!(e, BatchError::Pg(e) if e.code().is_some_and(|c| c.code() == "40P01" || c.code() == "40001"))
}

fn decode_row(row: &Row) -> Result<Record, BatchError> {
    let doc: String = row.get(0);
    let body: Option<Vec<u8>> = row.get(1);
    Record::from_doc(&doc, body).map_err(|e| BatchError::Data(e.to_string()))
}

/// Set at the start of a batch's transaction: its statements are planned once per connection,
/// not at each execution (PostgreSQL would otherwise keep planning them for the parameters
/// given, as a custom plan looks cheaper for the one-element arrays of its first executions).
/// Their plans do not depend on the parameters: each key is an index lookup
/// ([`READ_KEYS`]), also when planned while the table was empty.
const GENERIC_PLANS: &str = "SET LOCAL plan_cache_mode = force_generic_plan";

/// Takes the key locks of a batch: one advisory lock (a `bigint`) per key, in the order of the
/// array, which the caller sorts ascending. A function scan returns `unnest`'s elements in
/// order, and each row's lock is taken before the next row is produced.
const LOCK_KEYS: &str = "SELECT pg_advisory_xact_lock(h) FROM unnest($1::bigint[]) AS h";

/// Reads the records of a batch's keys, one row per key with its place in the arrays (from 1),
/// and draws a fence for each key that has no row and is marked in `$4` (a claim, which the
/// protocol always lets acquire a key with no record, unless a limit denies it; then the fence
/// is left unused). It runs as a statement of its own after [`LOCK_KEYS`], so that its snapshot
/// is taken once every lock is held and sees every commit made under them, and so that its
/// fences are drawn under those locks. (`LATERAL … LIMIT 1` keeps the plan an index lookup per
/// key, also when the statement was prepared while the table was empty.)
const READ_KEYS: &str = "SELECT r.doc, r.body, u.i, CASE WHEN r.doc IS NULL AND u.d THEN nextval('og_fence') END
     FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[]) WITH ORDINALITY AS u (t, n, k, d, i)
     LEFT JOIN LATERAL (SELECT s.doc, s.body FROM og_records s
                        WHERE s.tenant = u.t AND s.namespace = u.n AND s.key = u.k LIMIT 1) r ON true";

/// [`READ_KEYS`], and the writes of the batch's [`Guess`]es whose guess holds, in the same
/// statement (so on the same reads, under the keys' locks). Each key comes with its guess, if
/// any (`$5` to `$12`: the record to write, and for a fenced call the `doc` and `body` of the
/// record it guesses the key holds). A guessed claim's record is inserted where the key has no
/// row, with the fence drawn for it in place of [`GUESSED_FENCE`] (`$13`); a guessed fenced
/// call's record replaces the row that holds exactly the guessed record. Each row says whether
/// its key was written (`w`), and carries the record read only if it was not. The rows read
/// are those from before the writes (all parts of a statement see one snapshot).
const READ_KEYS_WRITING_GUESSES: &str = "WITH cur AS MATERIALIZED (
       SELECT u.*, r.doc, r.body, r.at, CASE WHEN r.doc IS NULL AND u.d THEN nextval('og_fence') END AS fence
       FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[], $5::text[], $6::text[], $7::bigint[],
                   $8::bigint[], $9::text[], $10::bytea[], $11::text[], $12::bytea[]) WITH ORDINALITY
         AS u (t, n, k, d, g_state, g_run, g_lease, g_expires, g_doc, g_body, was_doc, was_body, i)
       LEFT JOIN LATERAL (SELECT s.doc, s.body, s.ctid AS at FROM og_records s
                          WHERE s.tenant = u.t AND s.namespace = u.n AND s.key = u.k LIMIT 1) r ON true),
     inserted AS (
       INSERT INTO og_records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
       SELECT t, n, k, g_state, g_run, g_lease, g_expires, replace(g_doc, $13, '\"fence\":' || fence), g_body
       FROM cur WHERE g_doc IS NOT NULL AND was_doc IS NULL AND doc IS NULL AND fence IS NOT NULL),
     updated AS (
       UPDATE og_records r SET state = c.g_state, run = c.g_run, lease_expires_at = c.g_lease,
                               expires_at = c.g_expires, doc = c.g_doc, body = c.g_body
       FROM cur c
       WHERE r.ctid = c.at AND c.was_doc IS NOT NULL AND c.doc = c.was_doc
         AND c.body IS NOT DISTINCT FROM c.was_body
       RETURNING c.i)
     SELECT CASE WHEN w THEN NULL ELSE doc END, CASE WHEN w THEN NULL ELSE body END, i, fence, w
     FROM (SELECT c.doc, c.body, c.i, c.fence,
                  (c.g_doc IS NOT NULL AND c.was_doc IS NULL AND c.doc IS NULL AND c.fence IS NOT NULL)
                  OR c.i IN (SELECT i FROM updated) AS w
           FROM cur c) c";

/// Draws fences, for the claims that acquire a key that had a record (a recovery); sent once
/// the keys' locks are held.
const NEXT_FENCES: &str = "SELECT nextval('og_fence') FROM generate_series(1, $1::bigint)";

/// Writes records whole, many in one statement (a batch holds at most one job per key, so no
/// row is written twice); only a transaction holding their keys' locks writes them.
const UPSERT_RECORDS: &str =
    "INSERT INTO og_records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::bigint[],
                          $8::text[], $9::bytea[])
     ON CONFLICT (tenant, namespace, key) DO UPDATE SET
       state = excluded.state, run = excluded.run, lease_expires_at = excluded.lease_expires_at,
       expires_at = excluded.expires_at, doc = excluded.doc, body = excluded.body";

/// Records to write with [`UPSERT_RECORDS`], column by column.
#[derive(Debug, Default)]
struct RecordColumns {
    tenant: Vec<String>,
    namespace: Vec<String>,
    key: Vec<String>,
    state: Vec<&'static str>,
    run: Vec<Option<String>>,
    lease: Vec<Option<i64>>,
    expires: Vec<i64>,
    doc: Vec<String>,
    body: Vec<Option<Vec<u8>>>,
}

impl RecordColumns {
    /// Adds a record; answers what [`Known`] keeps of it.
    fn push(&mut self, record: Record) -> Result<Option<Arc<KnownRecord>>, BatchError> {
        let scope = record.scope.clone();
        let (state, run, lease, expires) =
            (record.state, record.run.clone(), record.lease_expires_at, record.expires_at);
        let kept = (state == RecordState::InProgress).then(|| record.clone());
        let (doc, body) = record.into_doc().map_err(|e| BatchError::Data(e.to_string()))?;
        let known = kept.map(|record| Arc::new(KnownRecord { record, doc: doc.clone(), body: body.clone() }));
        self.tenant.push(scope.tenant.to_string());
        self.namespace.push(scope.namespace.to_string());
        self.key.push(scope.key.to_string());
        self.state.push(state.as_str());
        self.run.push(run.map(|r| r.to_string()));
        self.lease.push(lease.map(to_i64));
        self.expires.push(to_i64(expires));
        self.doc.push(doc);
        self.body.push(body);
        Ok(known)
    }

    fn is_empty(&self) -> bool {
        self.key.is_empty()
    }

    fn as_sql(&self) -> [&(dyn ToSql + Sync); 9] {
        [
            &self.tenant,
            &self.namespace,
            &self.key,
            &self.state,
            &self.run,
            &self.lease,
            &self.expires,
            &self.doc,
            &self.body,
        ]
    }
}

/// Writes a run whole; only a transaction holding the run's lock (class 2) writes it.
const UPSERT_RUN: &str = "INSERT INTO og_runs (tenant, run, budget, effects, cost, created_at, updated_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7)
     ON CONFLICT (tenant, run) DO UPDATE SET
       budget = excluded.budget, effects = excluded.effects, cost = excluded.cost, updated_at = excluded.updated_at";

/// A run's columns as [`decode_run`] reads them.
const RUN_COLUMNS: &str = "budget, effects, cost, created_at, updated_at";

/// What a batch must lock, read and draw once its keys are locked, besides the keys.
#[derive(Debug, Default)]
struct Needs {
    /// Fences: one per claim that acquires a key for which [`READ_KEYS`] drew none.
    fences: usize,
    /// Tenants whose in-flight quota an acquiring claim checks, with the earliest time among
    /// those claims.
    quotas: BTreeMap<TenantId, Timestamp>,
    /// Runs that an acquiring claim, or a fenced call reporting cost, may charge.
    runs: BTreeSet<(TenantId, RunId)>,
}

impl Needs {
    /// Works out what the jobs need from what was read for them (a claim's decision is the
    /// same whatever fence it is given).
    fn of<'a>(jobs: impl Iterator<Item = (&'a Job, &'a Read)>) -> Self {
        let mut needs = Self::default();
        for (job, Read { record, fence, .. }) in jobs {
            match &job.op {
                Op::Claim(req) => {
                    let Some(written) = protocol::claim(record.clone(), req, job.now, || Fence(0)).1 else { continue };
                    if fence.is_none() {
                        needs.fences += 1;
                    }
                    if req.max_in_flight.is_some() {
                        let since = needs.quotas.entry(req.scope.tenant.clone()).or_insert(job.now);
                        *since = (*since).min(job.now);
                    }
                    if let Some(run) = written.run {
                        needs.runs.insert((req.scope.tenant.clone(), run));
                    }
                }
                Op::Mutate { scope, mutation, .. } => {
                    if let (true, Some(run)) = (
                        onceguard_core::control::reported_cost(mutation) > 0,
                        record.as_ref().and_then(|r| r.run.as_ref()),
                    ) {
                        needs.runs.insert((scope.tenant.clone(), run.clone()));
                    }
                }
            }
        }
        needs
    }

    fn is_empty(&self) -> bool {
        self.fences == 0 && self.quotas.is_empty() && self.runs.is_empty()
    }
}

/// A tenant's leases by (namespace, key), each with the lease's end and the record's expiry.
type Leases = HashMap<(String, String), (Timestamp, Timestamp)>;

/// What a batch knows of the tenants' leases and of the runs it may charge, kept up to date as
/// its jobs are decided in order, so that each decision sees those before it in the batch.
#[derive(Debug, Default)]
struct Ledger {
    /// For each tenant whose quota is checked: its leases.
    leases: HashMap<TenantId, Leases>,
    /// Each run the batch may charge: as stored, `None` while unseen.
    runs: HashMap<(TenantId, RunId), Option<Run>>,
    /// Runs charged by the batch, to write.
    charged: BTreeSet<(TenantId, RunId)>,
}

impl Ledger {
    /// The tenant's live leases at `now` ([`control::holds_lease`]).
    fn in_flight(&self, tenant: &TenantId, now: Timestamp) -> Result<u64, BatchError> {
        let leases = self
            .leases
            .get(tenant)
            .ok_or_else(|| BatchError::Data(format!("tenant {tenant}'s leases were not read")))?;
        Ok(leases.values().filter(|(lease, live)| *lease > now && *live > now).count() as u64)
    }

    /// A run the batch locked, as stored or new at `now`.
    fn run(&mut self, tenant: &TenantId, id: &RunId, now: Timestamp) -> Result<&mut Run, BatchError> {
        let slot = self
            .runs
            .get_mut(&(tenant.clone(), id.clone()))
            .ok_or_else(|| BatchError::Data(format!("run {id} of tenant {tenant} was not locked")))?;
        Ok(slot.get_or_insert_with(|| Run::new(tenant.clone(), id.clone(), now)))
    }

    /// Notes a record the batch writes: from now on it holds a lease, or it no longer does.
    fn wrote(&mut self, record: &Record) {
        let Some(leases) = self.leases.get_mut(&record.scope.tenant) else { return };
        let key = (record.scope.namespace.as_str().to_owned(), record.scope.key.as_str().to_owned());
        match (record.state, &record.unknown, record.lease_expires_at) {
            (RecordState::InProgress, None, Some(lease)) => leases.insert(key, (lease, record.expires_at)),
            _ => leases.remove(&key),
        };
    }

    /// Checks the tenant's quota and the run's budget for a claim the protocol acquires
    /// ([`control::admit`]). Denied: the claim writes nothing.
    fn admit(
        &mut self,
        req: &ClaimRequest,
        now: Timestamp,
        outcome: ClaimOutcome,
        write: Option<Record>,
    ) -> Result<(ClaimOutcome, Option<Record>), BatchError> {
        let Some(mut record) = write else { return Ok((outcome, None)) };
        if req.max_in_flight.is_none() && record.run.is_none() {
            return Ok((outcome, Some(record)));
        }
        let tenant = &req.scope.tenant;
        let in_flight = req.max_in_flight.map(|_| self.in_flight(tenant, now)).transpose()?;
        let id = record.run.clone();
        let run = match &id {
            Some(id) => Some(self.run(tenant, id, now)?),
            None => None,
        };
        match onceguard_core::control::admit(&mut record, req, Admission { in_flight, run }, now) {
            Err(denial) => Ok((ClaimOutcome::Denied(denial), None)),
            Ok(charged) => {
                if let (true, Some(id)) = (charged, id) {
                    self.charged.insert((tenant.clone(), id));
                }
                Ok((outcome, Some(record)))
            }
        }
    }
}

fn decode_run(tenant: &TenantId, id: &RunId, row: &Row) -> Result<Run, StoreError> {
    let count = |i: usize| u64::try_from(row.get::<_, i64>(i)).map_err(corrupt);
    Ok(Run {
        tenant: tenant.clone(),
        run: id.clone(),
        budget: serde_json::from_str(row.get::<_, &str>(0)).map_err(corrupt)?,
        usage: RunUsage { effects: count(1)?, cost: count(2)? },
        created_at: timestamp(row.get(3))?,
        updated_at: timestamp(row.get(4))?,
    })
}

/// The parameters of [`UPSERT_RUN`] for a run.
type RunParams = (String, String, String, i64, i64, i64, i64);

fn run_params(run: &Run) -> Result<RunParams, serde_json::Error> {
    Ok((
        run.tenant.to_string(),
        run.run.to_string(),
        serde_json::to_string(&run.budget)?,
        to_sql_u64(run.usage.effects),
        to_sql_u64(run.usage.cost),
        to_i64(run.created_at),
        to_i64(run.updated_at),
    ))
}

/// What [`lock_and_read`] read for a key: its record, the fence drawn for it, if any, and
/// whether its [`Guess`] held (and was written).
#[derive(Debug)]
struct Read {
    record: Option<Record>,
    fence: Option<Fence>,
    guessed: bool,
}

/// The guesses of a batch's keys, column by column, for [`READ_KEYS_WRITING_GUESSES`]
/// (`NULL` for a key without one).
#[derive(Debug, Default)]
struct GuessColumns<'a> {
    state: Vec<Option<&'static str>>,
    run: Vec<Option<&'a str>>,
    lease: Vec<Option<i64>>,
    expires: Vec<Option<i64>>,
    doc: Vec<Option<&'a str>>,
    body: Vec<Option<&'a [u8]>>,
    was_doc: Vec<Option<&'a str>>,
    was_body: Vec<Option<&'a [u8]>>,
}

impl<'a> GuessColumns<'a> {
    fn of(guesses: &'a [Option<Guess>]) -> Self {
        let mut columns = Self::default();
        for guess in guesses {
            let g = guess.as_ref();
            columns.state.push(g.map(|g| g.record.state.as_str()));
            columns.run.push(g.and_then(|g| g.record.run.as_ref()).map(|r| r.as_str()));
            columns.lease.push(g.and_then(|g| g.record.lease_expires_at).map(to_i64));
            columns.expires.push(g.map(|g| to_i64(g.record.expires_at)));
            columns.doc.push(g.map(|g| g.doc.as_str()));
            columns.body.push(g.and_then(|g| g.body.as_deref()));
            let known = g.and_then(|g| g.known.as_ref());
            columns.was_doc.push(known.map(|k| k.doc.as_str()));
            columns.was_body.push(known.and_then(|k| k.body.as_deref()));
        }
        columns
    }
}

/// Begins a transaction (with [`GENERIC_PLANS`]), locks the keys of `scopes` (sorted by
/// [`lock_key`]), and reads their records, drawing a fence for each key marked in `claims`
/// that has none and writing the guesses that hold: four statements sent together, one round
/// trip, and `COMMIT` with them if `commit`. `turn` is let go of once the reads are answered.
/// Unless it committed, the transaction stays open on `client`; if this fails, the caller must
/// [`abandon`] it.
async fn lock_and_read(
    client: &ClientWrapper,
    scopes: &[&Scope],
    claims: &[bool],
    guesses: &[Option<Guess>],
    commit: bool,
    turn: Option<tokio::sync::MutexGuard<'_, Intake>>,
) -> Result<Vec<Read>, BatchError> {
    debug_assert!(scopes.is_sorted_by_key(|s| lock_key(s)), "key locks are taken in ascending order");
    let guessing = guesses.iter().any(Option::is_some);
    let (begin, generic, lock_keys, read_keys, end) = futures::try_join!(
        client.prepare_cached("BEGIN"),
        client.prepare_cached(GENERIC_PLANS),
        client.prepare_cached(LOCK_KEYS),
        client.prepare_cached(if guessing { READ_KEYS_WRITING_GUESSES } else { READ_KEYS }),
        client.prepare_cached("COMMIT"),
    )?;
    let keys: Vec<i64> = scopes.iter().map(|s| lock_key(s)).collect();
    let tenants: Vec<&str> = scopes.iter().map(|s| s.tenant.as_str()).collect();
    let namespaces: Vec<&str> = scopes.iter().map(|s| s.namespace.as_str()).collect();
    let names: Vec<&str> = scopes.iter().map(|s| s.key.as_str()).collect();
    let g = GuessColumns::of(guesses);
    let placeholder = fence_in_doc(GUESSED_FENCE);
    let lock_params: [&(dyn ToSql + Sync); 1] = [&keys];
    let read_params: [&(dyn ToSql + Sync); 13] = [
        &tenants,
        &namespaces,
        &names,
        &claims,
        &g.state,
        &g.run,
        &g.lease,
        &g.expires,
        &g.doc,
        &g.body,
        &g.was_doc,
        &g.was_body,
        &placeholder,
    ];
    let read_params = if guessing { &read_params[..] } else { &read_params[..4] };
    // Each future sends its statement when first polled, and `join!` and `try_join!` poll them
    // in order: all are sent at once. The reads are answered before the `COMMIT` (which waits
    // for its WAL flush), and `turn` is let go of then, so that the next batch runs while this
    // one's commit is flushed.
    let reads = async {
        let done = futures::try_join!(
            client.execute(&begin, &[]),
            client.execute(&generic, &[]),
            client.execute(&lock_keys, &lock_params),
            client.query(&read_keys, read_params),
        );
        drop(turn);
        done
    };
    let end_statement = async { if commit { client.execute(&end, &[]).await } else { Ok(0) } };
    let (read, ended) = futures::join!(reads, end_statement);
    let (_, _, _, rows) = read?;
    ended?;
    let mut reads: Vec<Option<Read>> = scopes.iter().map(|_| None).collect();
    for row in &rows {
        let slot = usize::try_from(row.get::<_, i64>(2) - 1)
            .ok()
            .and_then(|i| reads.get_mut(i))
            .ok_or_else(|| BatchError::Data("a row was read for no key of the batch".into()))?;
        let doc: Option<String> = row.get(0);
        let record = doc.map(|doc| Record::from_doc(&doc, row.get(1))).transpose();
        let fence = row.get::<_, Option<i64>>(3).map(|f| Fence(f as u64));
        let guessed = guessing && row.get::<_, bool>(4);
        *slot = Some(Read { record: record.map_err(|e| BatchError::Data(e.to_string()))?, fence, guessed });
    }
    reads.into_iter().map(|r| r.ok_or_else(|| BatchError::Data("a key of the batch was not read".into()))).collect()
}

/// Writes `records` and `runs` and commits, in one round trip. If this fails, the caller must
/// [`abandon`] the transaction (a `COMMIT` after a failed statement only rolls back).
async fn write_and_commit(
    client: &ClientWrapper,
    records: &RecordColumns,
    runs: &[RunParams],
) -> Result<(), BatchError> {
    let upsert = if records.is_empty() { None } else { Some(client.prepare_cached(UPSERT_RECORDS).await?) };
    let upsert_run = if runs.is_empty() { None } else { Some(client.prepare_cached(UPSERT_RUN).await?) };
    let commit = client.prepare_cached("COMMIT").await?;
    let record_writes = async {
        match &upsert {
            Some(st) => client.execute(st, &records.as_sql()).await,
            None => Ok(0),
        }
    };
    let run_writes = upsert_run.iter().flat_map(|st| {
        runs.iter().map(move |(tenant, run, budget, effects, cost, created, updated)| async move {
            client.execute(st, &[tenant, run, budget, effects, cost, created, updated]).await
        })
    });
    futures::try_join!(record_writes, futures::future::try_join_all(run_writes), client.execute(&commit, &[]))?;
    Ok(())
}

/// Ends a transaction that failed part-way, so that its connection goes back to the pool idle;
/// a connection that cannot even roll back is closed instead.
async fn abandon(client: deadpool_postgres::Object) {
    if client.batch_execute("ROLLBACK").await.is_err() {
        drop(deadpool_postgres::Object::take(client));
    }
}

/// Locks and reads what `needs` names, pipelined in one round trip, in the global lock order
/// (see the module documentation): the tenants' quota locks with their leases, then the runs'
/// locks with the runs, each class in ascending lock order; and draws the fences it names.
async fn lock_needs(client: &ClientWrapper, needs: &Needs) -> Result<(Ledger, VecDeque<Fence>), BatchError> {
    let mut quotas: Vec<(i32, &TenantId, i64)> =
        needs.quotas.iter().map(|(t, since)| (class_lock(&[t.as_str()]), t, to_i64(*since))).collect();
    quotas.sort();
    let mut runs: Vec<(i32, &TenantId, &RunId)> =
        needs.runs.iter().map(|(t, r)| (class_lock(&[t.as_str(), r.as_str()]), t, r)).collect();
    runs.sort();
    let lock_leases = if quotas.is_empty() {
        None
    } else {
        Some(client.prepare_cached("SELECT * FROM og_lock_leases($1, $2, $3)").await?)
    };
    let lock_run = if runs.is_empty() {
        None
    } else {
        Some(client.prepare_cached("SELECT * FROM og_lock_run($1, $2, $3)").await?)
    };
    let next_fences = if needs.fences == 0 { None } else { Some(client.prepare_cached(NEXT_FENCES).await?) };
    let count = i64::try_from(needs.fences).unwrap_or(i64::MAX);
    let lease_reads = lock_leases.iter().flat_map(|st| {
        quotas
            .iter()
            .map(move |(h, tenant, since)| async move { client.query(st, &[h, &tenant.as_str(), since]).await })
    });
    let run_reads = lock_run.iter().flat_map(|st| {
        runs.iter()
            .map(move |(h, tenant, id)| async move { client.query_opt(st, &[h, &tenant.as_str(), &id.as_str()]).await })
    });
    let fence_read = async {
        match &next_fences {
            Some(st) => client.query(st, &[&count]).await,
            None => Ok(Vec::new()),
        }
    };
    let (lease_rows, run_rows, fence_rows) = futures::try_join!(
        futures::future::try_join_all(lease_reads),
        futures::future::try_join_all(run_reads),
        fence_read
    )?;

    let data = |e: StoreError| BatchError::Data(e.to_string());
    let mut ledger = Ledger::default();
    for ((_, tenant, _), rows) in quotas.iter().zip(lease_rows) {
        let leases = ledger.leases.entry((*tenant).clone()).or_default();
        for row in rows {
            let until = (timestamp(row.get(2)).map_err(data)?, timestamp(row.get(3)).map_err(data)?);
            leases.insert((row.get(0), row.get(1)), until);
        }
    }
    for ((_, tenant, id), row) in runs.iter().zip(run_rows) {
        let run = row.map(|row| decode_run(tenant, id, &row)).transpose().map_err(data)?;
        ledger.runs.insert(((*tenant).clone(), (*id).clone()), run);
    }
    let mut fences: Vec<i64> = fence_rows.iter().map(|r| r.get(0)).collect();
    fences.sort_unstable();
    Ok((ledger, fences.into_iter().map(|f| Fence(f as u64)).collect()))
}

/// A batch decided under its locks, to be written and committed unless it already was.
struct Decided {
    /// Each job's answer, to send once the batch committed; `None` for a job whose guess did
    /// not hold, in a batch that committed with its reads (all its jobs were guessed), and that
    /// must write: it runs again in a batch of its own.
    answers: Vec<Option<Answer>>,
    writes: RecordColumns,
    runs: Vec<RunParams>,
    /// The keys whose attempt the batch finishes.
    finished: Vec<Scope>,
    /// What the batch leaves its keys as, for [`Known`].
    known: Vec<(Scope, Option<Arc<KnownRecord>>)>,
    /// Whether the batch committed with its reads.
    committed: bool,
}

/// Decides a batch in a transaction on `client`: one round trip when every job is guessed
/// (the batch then commits with it), or else one more to write and commit ([`write_and_commit`])
/// and, before it, one more when a job needs a quota or a run checked or a recovery's fence
/// drawn.
async fn decide_batch(
    client: &ClientWrapper,
    batch: &[Job],
    guesses: Vec<Option<Guess>>,
    turn: Option<tokio::sync::MutexGuard<'_, Intake>>,
) -> Result<Decided, BatchError> {
    // 1. Lock and read every key, in ascending lock order, drawing a fence for each claim of a
    //    key that has no record, and writing the guesses that hold. A batch whose every job is
    //    guessed commits then: those whose guess does not hold and that must write run again.
    let scopes: Vec<&Scope> = batch.iter().map(|job| job.op.scope()).collect();
    let claims: Vec<bool> = batch.iter().map(|job| matches!(job.op, Op::Claim(_))).collect();
    let committed = guesses.iter().all(Option::is_some);
    let reads = lock_and_read(client, &scopes, &claims, &guesses, committed, turn).await?;

    let mut answers: Vec<Option<Answer>> = batch.iter().map(|_| None).collect();
    let mut known = Vec::new();
    let mut finished = Vec::new();
    let mut pending = Vec::with_capacity(batch.len());
    for (i, ((job, read), guess)) in batch.iter().zip(reads).zip(guesses).enumerate() {
        let guess = match guess {
            Some(guess) if read.guessed => guess,
            Some(_) => {
                // Whatever this instance knew of the key is out of date.
                known.push((job.op.scope().clone(), None));
                pending.push((i, job, read));
                continue;
            }
            None => {
                pending.push((i, job, read));
                continue;
            }
        };
        let (answer, record, doc) = match (&job.op, guess.known) {
            (Op::Claim(req), None) => {
                let fence = read.fence.ok_or_else(|| BatchError::Data("a guessed claim drew no fence".into()))?;
                let (answer, record) = protocol::claim(None, req, job.now, || fence);
                let record = record.ok_or_else(|| BatchError::Data("a guessed claim did not acquire".into()))?;
                debug_assert_eq!(record, Record { fence, ..guess.record });
                let doc = guess.doc.replace(&fence_in_doc(GUESSED_FENCE), &fence_in_doc(fence));
                (Answer::Claim(answer), record, doc)
            }
            (Op::Mutate { scope, mutation, .. }, Some(_)) => {
                if matches!(mutation, Mutation::Complete(_) | Mutation::Fail { .. } | Mutation::ReportUnknown(_)) {
                    finished.push(scope.clone());
                }
                (guess.answer, guess.record, guess.doc)
            }
            _ => return Err(BatchError::Data("a guess does not fit its job".into())),
        };
        known.push((record.scope.clone(), self::known(&record, &doc, &guess.body)));
        answers[i] = Some(answer);
    }
    if committed {
        // The jobs whose guess did not hold are decided on what was read; those that would
        // write run again.
        for (i, job, read) in pending {
            answers[i] = match &job.op {
                Op::Claim(req) => match protocol::claim(read.record, req, job.now, || Fence(0)) {
                    (outcome, None) => Some(Answer::Claim(outcome)),
                    (_, Some(_)) => None,
                },
                Op::Mutate { fence, mutation, max_checkpoints, .. } => {
                    match protocol::apply(read.record, *fence, mutation.clone(), job.now, *max_checkpoints) {
                        (outcome, None) => Some(Answer::Mutate(outcome)),
                        (_, Some(_)) => None,
                    }
                }
            };
        }
        let (writes, runs) = (RecordColumns::default(), Vec::new());
        return Ok(Decided { answers, writes, runs, finished, known, committed });
    }

    // 2. Now that the keys are locked: the quota and run locks with what they guard (only for
    //    claims that carry a quota or name a run, and fenced calls that report cost), and the
    //    fences of claims that acquire a key that had a record.
    let needs = Needs::of(pending.iter().map(|(_, job, read)| (*job, read)));
    let (mut ledger, mut fences) =
        if needs.is_empty() { (Ledger::default(), VecDeque::new()) } else { lock_needs(client, &needs).await? };

    // 3. Decide the jobs read, in order, then write every changed record and charged run.
    let mut writes = RecordColumns::default();
    for (i, job, Read { record, fence, .. }) in pending {
        let (answer, write) = match &job.op {
            Op::Claim(req) => {
                let draw = || fence.or_else(|| fences.pop_front()).unwrap_or(Fence(0));
                let (outcome, write) = protocol::claim(record, req, job.now, draw);
                if let ClaimOutcome::Acquired(a) = &outcome
                    && a.fence == Fence(0)
                {
                    return Err(BatchError::Data("ran out of drawn fences".into()));
                }
                let (outcome, write) = ledger.admit(req, job.now, outcome, write)?;
                (Answer::Claim(outcome), write)
            }
            Op::Mutate { scope, fence, mutation, max_checkpoints } => {
                let finishes =
                    matches!(mutation, Mutation::Complete(_) | Mutation::Fail { .. } | Mutation::ReportUnknown(_));
                let (outcome, write) =
                    onceguard_core::control::apply_fenced(record, *fence, mutation.clone(), job.now, *max_checkpoints);
                if finishes && write.is_some() {
                    finished.push(scope.clone());
                }
                let write = write.map(|write| -> Result<Record, BatchError> {
                    if let Some((id, cost)) = &write.charge {
                        ledger.run(&scope.tenant, id, job.now)?.add_cost(*cost, job.now);
                        ledger.charged.insert((scope.tenant.clone(), id.clone()));
                    }
                    Ok(write.record)
                });
                (Answer::Mutate(outcome), write.transpose()?)
            }
        };
        answers[i] = Some(answer);
        if let Some(record) = write {
            ledger.wrote(&record);
            let scope = record.scope.clone();
            known.push((scope, writes.push(record)?));
        }
    }
    let mut runs = Vec::with_capacity(ledger.charged.len());
    for charged in &ledger.charged {
        let run = ledger.runs.get(charged).and_then(Option::as_ref);
        let run = run.ok_or_else(|| BatchError::Data(format!("charged run {} was not read", charged.1)))?;
        runs.push(run_params(run).map_err(|e| BatchError::Data(e.to_string()))?);
    }
    Ok(Decided { answers, writes, runs, finished, known, committed })
}

/// How long the notifier gathers finished keys before it notifies them: each notification is
/// a transaction of its own, with a commit that waits for its WAL flush, so notifying every
/// batch's keys at once would cost nearly as much as the batches. Waiters in other instances
/// hear of a finished key this much later (those of this instance are woken by the guard at
/// once, and every waiter also polls).
const NOTIFY_WINDOW: Duration = Duration::from_millis(5);

/// Notifies finished keys on `channel`: those finished within [`NOTIFY_WINDOW`] of each other
/// in one statement.
async fn notify_loop(pool: Pool, mut finished: mpsc::UnboundedReceiver<Scope>, channel: String) {
    let mut scopes = Vec::new();
    while finished.recv_many(&mut scopes, 1_000).await > 0 {
        tokio::time::sleep(NOTIFY_WINDOW).await;
        while scopes.len() < 10_000 {
            let Ok(scope) = finished.try_recv() else { break };
            scopes.push(scope);
        }
        let sent = async {
            let client = pool.get().await.map_err(|e| with_causes(&e))?;
            notify(&client, &channel, &scopes).await.map_err(|e| with_causes(&e))
        };
        if let Err(e) = sent.await {
            tracing::debug!(error = %e, "postgres: could not notify finished keys; waiters will poll");
        }
        scopes.clear();
    }
}

async fn notify(client: &ClientWrapper, channel: &str, scopes: &[Scope]) -> Result<(), tokio_postgres::Error> {
    let payloads: Vec<String> = scopes.iter().filter_map(|s| serde_json::to_string(s).ok()).collect();
    if payloads.is_empty() {
        return Ok(());
    }
    let st = client.prepare_cached("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p").await?;
    client.execute(&st, &[&channel, &payloads]).await.map(drop)
}

/// Keeps a `LISTEN` connection open (reconnecting after a second when it drops) and forwards
/// notified keys to `changes`.
async fn listen_loop(config: tokio_postgres::Config, channel: String, changes: broadcast::Sender<Scope>) {
    loop {
        if let Ok((client, mut connection)) = config.connect(NoTls).await {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let driver = tokio::spawn(async move {
                let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
                while let Some(Ok(message)) = messages.next().await {
                    if let AsyncMessage::Notification(n) = message
                        && tx.send(n.payload().to_owned()).is_err()
                    {
                        break;
                    }
                }
            });
            if client.batch_execute(&format!("LISTEN \"{channel}\"")).await.is_ok() {
                while let Some(payload) = rx.recv().await {
                    if let Ok(scope) = serde_json::from_str::<Scope>(&payload) {
                        let _ = changes.send(scope);
                    }
                }
            }
            driver.abort();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_carry_the_store_options() {
        let (base, o) = parse_url("postgres://u@h:5432/db?schema=og_a&pool_size=8&sslmode=disable").unwrap();
        assert_eq!(base, "postgres://u@h:5432/db?sslmode=disable");
        assert_eq!((o.schema.as_str(), o.pool_size, o.writers), ("og_a", 8, 4));
        assert!(parse_url("postgres://h/db?schema=Bad-Name").is_err());
        assert!(parse_url("postgres://h/db?pool_size=many").is_err());
        assert!(parse_url("mysql://h/db").is_err());
        assert_eq!(parse_url("postgresql://h/db").unwrap().1, PgOptions::default());
    }

    #[test]
    fn lock_keys_never_change() {
        // Instances of different versions share a database: they must lock a key (and a tenant's
        // quota) under the same numbers.
        let scope = Scope::new(
            TenantId::parse("acme").unwrap(),
            Namespace::parse("prod/payments").unwrap(),
            Key::parse("k-1").unwrap(),
        );
        assert_eq!(lock_key(&scope), 6_471_301_242_186_714_639);
        assert_eq!(class_lock(&["acme"]), 621_423_428);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_schema_of_the_first_version_is_upgraded_and_its_records_still_read() {
        let url = std::env::var("ONCEGUARD_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let addr = onceguard_testkit::services::addr_of_url(&url, 5432);
        if !onceguard_testkit::services::available("PostgreSQL migration test", &addr, "start PostgreSQL") {
            return;
        }
        let schema = format!("og_upgrade_{:08x}", rand::random::<u32>());
        let (client, connection) = tokio_postgres::connect(&url, NoTls).await.unwrap();
        let driver = tokio::spawn(connection);
        // A schema as instances of the first version left it: one record in flight, whose
        // document has no `charged`.
        let first = MIGRATIONS[0];
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; SET search_path = {schema};
                 CREATE TABLE og_migrations (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());
                 {first}
                 INSERT INTO og_migrations (version) VALUES (1);
                 SELECT setval('og_fence', 7);"
            ))
            .await
            .unwrap();
        let now = Timestamp(1_000);
        let scope =
            Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("ns").unwrap(), Key::parse("old").unwrap());
        let req = ClaimRequest {
            scope: scope.clone(),
            fingerprint: onceguard_core::Fingerprint::sha256(b"old"),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
            run: None,
            cost: 0,
            max_in_flight: Some(1),
            refused_runs: Vec::new(),
        };
        let (_, Some(record)) = protocol::claim(None, &req, now, || Fence(7)) else { panic!("acquired") };
        let mut columns = RecordColumns::default();
        columns.push(record).unwrap();
        let mut doc: serde_json::Value = serde_json::from_str(&columns.doc[0]).unwrap();
        doc.as_object_mut().unwrap().remove("charged");
        columns.doc[0] = doc.to_string();
        client.execute(UPSERT_RECORDS, &columns.as_sql()).await.unwrap();

        let options = PgOptions { schema: schema.clone(), pool_size: 2, writers: 1, ..PgOptions::default() };
        let store = PgStore::connect_with(&url, options).await.unwrap();
        let version: i32 = client.query_one("SELECT max(version) FROM og_migrations", &[]).await.unwrap().get(0);
        assert_eq!(version as usize, MIGRATIONS.len());
        assert!(!store.get(&scope, now).await.unwrap().expect("the old record reads").charged);
        // Its lease counts against the quota of 1.
        let other = ClaimRequest { scope: Scope { key: Key::parse("new").unwrap(), ..scope }, ..req };
        assert!(matches!(store.claim(&other, now).await.unwrap(), ClaimOutcome::Denied(_)));
        drop(store);
        client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
        drop(client);
        let _ = driver.await;
    }
}
