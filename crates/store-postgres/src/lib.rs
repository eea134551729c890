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
//!   per key) into one transaction. The jobs of a batch call are submitted together and taken
//!   whole into one transaction (up to [`MAX_GROUP`] of them; a larger call goes in groups of
//!   that many, and a key given twice has its second job in a later transaction). `BEGIN`, the batch's key locks (one statement, in ascending
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
//! - **Fences** come from the tenant's sequence (`og_fence_of(tenant)`, made by
//!   `og_ensure_fence` before the tenant's first claim in a process, starting above
//!   `og_fence_floor`, the one sequence of earlier versions renamed so that an earlier version
//!   left running fails to draw), drawn *after* the key's lock is held, so a
//!   key's next fence is always greater than every fence it had; the sequence is never reset, so
//!   fences keep growing after a record expired, was swept or purged. The read statement draws
//!   one for each claim of a key that has no row (such a claim acquires unless a limit denies
//!   it), and writes it into a claim decided before the read, in place of `GUESSED_FENCE`; a
//!   claim that acquires a key that has a row (a recovery) has its fence drawn in one more round
//!   trip. So fences are drawn only for claims that acquire (or are denied).
//! - **Plans**: the batch's statements run with `plan_cache_mode = force_generic_plan`, planned
//!   once per connection, and each key is an index lookup in that plan.
//! - **The store's clock decides**: every decision that compares a time with a lease, a
//!   retention, an expiry, a deadline or a rate is made by PostgreSQL's time, read inside the
//!   statement or transaction that decides (`og_now(NULL)`: `statement_timestamp()` in
//!   milliseconds; a batch reads it with its keys, under their locks), and the times it writes
//!   (lease end, completion, expiry) are that time plus a duration. The caller's `now` decides
//!   nothing, so instances whose clocks disagree still judge every lease alike; it only dates a
//!   guess (above), from this instance's clock plus the offset the last batch measured, and a
//!   guess whose time is more than `GUESS_TOLERANCE_MS` (1 s) from the store's is decided again.
//!   [`PgOptions::clock`] gives a clock in PostgreSQL's place (tests), passed to `og_now`.
//! - **Retention** is checked when read (`expires_at > og_now(…)`); the sweep deletes expired rows in
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
//!   leases that have not passed (`og_lock_leases`, on the index `og_records_leases`); for each
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
//!   from the tenant's sequence drawn after the locks (`control::revoke`). (Chunks keep one transaction's
//!   advisory locks within PostgreSQL's lock table when a switch covers many keys.)
//! - **Claim rates**: one transaction locks the tenant's row of `og_rates` by an upsert that
//!   returns its theoretical arrival time, runs `control::gcra`, and writes the new time and
//!   commits, or rolls back when the claim must wait.
//! - Control documents (`og_control`) and the audit log (`og_audit`, listed newest first by id
//!   from the indexes on (tenant, id), (tenant, action, id) and (tenant, actor, id)) are plain
//!   rows.
//! - **A run's records** are listed from the index `og_records_run` (tenant, run, namespace,
//!   key): the listing of one run names it in its statement (not as an optional parameter), so
//!   that what a rollback reads of its run and of its undo run costs the run's rows, not the
//!   tenant's.
//! - **Migrations** are numbered in `og_migrations` and applied once each; an applied one is
//!   never edited, a change of schema is a new entry.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{ClientWrapper, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures::StreamExt;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, Tenant};
use onceguard_core::control::{
    Admission, AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Rate, Run, RunUsage, SwitchTarget,
};
use onceguard_core::protocol::{self, ClaimRequest, Mutation};
use onceguard_core::store::{ClaimStore, ControlStore, ListFilter, MAX_PAGE, Page, RunStore, StoreError, TenantStore};
use onceguard_core::tripwire::Tally;
use onceguard_core::{
    ClaimOutcome, Fence, FencedOutcome, Key, Namespace, Record, RecordState, RunId, Scope, StoreClock, TenantId,
    Timestamp,
};
use tokio::sync::{Mutex, broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, Row};

mod approvals;
mod batch;
mod claims;
mod control;
mod known;
mod notify;
mod runs;
mod schema;
mod tenants;
mod tls;

use batch::*;
use known::*;
use notify::*;
use schema::*;

/// The most jobs committed in one transaction.
pub const MAX_BATCH: usize = 256;

/// The most claims or fenced calls of one batch call ([`ClaimStore::claim_batch`],
/// [`ClaimStore::mutate_batch`]) decided in one transaction; a larger call is decided in groups
/// of this many, each a transaction. (It bounds the advisory locks one transaction holds, well
/// within PostgreSQL's default lock table.)
pub const MAX_GROUP: usize = 1_024;

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
    /// With `sslmode=require` (or `verify-ca`, `verify-full`): the certificate authority (PEM)
    /// the server's certificate is checked against (`sslrootcert=PATH`); else Mozilla's roots.
    pub tls_ca: Option<std::path::PathBuf>,
    /// The time the store decides by: PostgreSQL's (the default), or a clock given in its place
    /// (tests).
    pub clock: StoreClock,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            schema: "onceguard".into(),
            pool_size: 16,
            writers: 4,
            statement_timeout: Duration::from_secs(5),
            tls_ca: None,
            clock: StoreClock::Server,
        }
    }
}

/// Splits a `postgres://` URL into the connection URL and the store's own options
/// (`schema`, `pool_size`, `writers`, `statement_timeout`, `sslrootcert` as query parameters;
/// `sslmode=verify-ca` and `verify-full` become `require`, which checks as much: see tls.rs).
pub fn parse_url(url: &str) -> Result<(String, PgOptions), String> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(format!("'{url}' is not a postgres:// URL"));
    }
    let mut options = PgOptions::default();
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, raw) = pair.split_once('=').unwrap_or((pair, ""));
        // A URL's query is percent-encoded (`schema=og%5Fa` is `og_a`).
        let value =
            &*percent_encoding::percent_decode_str(raw).decode_utf8().map_err(|_| format!("{name}: not UTF-8"))?;
        let number = || value.parse::<usize>().map_err(|_| format!("{name}={value} is not a number"));
        match name {
            "schema" => options.schema = value.to_owned(),
            "pool_size" => options.pool_size = number()?.clamp(1, 1024),
            "writers" => options.writers = number()?.clamp(1, 64),
            "statement_timeout_ms" => options.statement_timeout = Duration::from_millis(number()? as u64),
            "sslrootcert" => options.tls_ca = Some(value.into()),
            // Every mode that uses TLS checks the certificate and the host name (see tls.rs).
            "sslmode" if matches!(value, "verify-ca" | "verify-full") => kept.push("sslmode=require"),
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

/// The PostgreSQL store. Dropping it stops its writer and listener tasks.
pub struct PgStore {
    pool: Pool,
    schema: String,
    jobs: mpsc::Sender<Vec<Job>>,
    changes: broadcast::Sender<Scope>,
    finished: mpsc::UnboundedSender<Scope>,
    writers: Arc<Writers>,
    tasks: Vec<JoinHandle<()>>,
    /// The tenants whose fence sequence this process has made sure of.
    fenced: std::sync::Mutex<std::collections::HashSet<TenantId>>,
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
    /// Makes sure each of `tenants` has its fence sequence (`og_ensure_fence`), once per tenant
    /// and process, before a claim or a revocation draws from it.
    pub(crate) async fn ensure_fences<'a>(
        &self,
        tenants: impl IntoIterator<Item = &'a TenantId>,
    ) -> Result<(), StoreError> {
        let missing: std::collections::BTreeSet<TenantId> = {
            let known = self.fenced.lock().expect("the fenced set is never poisoned");
            tenants.into_iter().filter(|t| !known.contains(*t)).cloned().collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        for tenant in &missing {
            client.execute("SELECT og_ensure_fence($1)", &[&tenant.as_str()]).await.map_err(unavailable)?;
        }
        self.fenced.lock().expect("the fenced set is never poisoned").extend(missing);
        Ok(())
    }

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
        let tls = match config.get_ssl_mode() {
            tokio_postgres::config::SslMode::Require => {
                tls::Tls::on(options.tls_ca.as_deref()).map_err(StoreError::Unavailable)?
            }
            _ => tls::Tls::Off,
        };
        migrate(&config, &tls, &options.schema).await?;
        config.options(format!(
            "-c search_path={} -c statement_timeout={}",
            options.schema,
            options.statement_timeout.as_millis()
        ));
        let manager_config = || ManagerConfig { recycling_method: RecyclingMethod::Fast };
        let manager =
            tls::with_tls!(&tls, |connector| Manager::from_config(config.clone(), connector, manager_config()));
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
            clock: options.clock.clone(),
            offset_ms: AtomicI64::new(0),
            intake: Mutex::new(Intake { queue, held: None, deferred: VecDeque::new() }),
            known: Known::default(),
            finished: finished.clone(),
            counters: BatchCounters::default(),
        });
        let mut tasks: Vec<JoinHandle<()>> =
            (0..options.writers).map(|_| tokio::spawn(write_loop(writers.clone()))).collect();
        tasks.push(tokio::spawn(notify_loop(pool.clone(), finished_rx, channel.clone())));
        tasks.push(tokio::spawn(listen_loop(config, tls, channel, changes.clone())));
        Ok(Self {
            pool,
            schema: options.schema,
            jobs,
            changes,
            finished,
            writers,
            tasks,
            fenced: std::sync::Mutex::default(),
        })
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
        let guess = Guess::of(&op, self.writers.estimate(now), &self.writers.known);
        let job = Job { op, caller_now: now, guess, reply };
        self.jobs.send(vec![job]).await.map_err(|_| stopped("the writers stopped"))?;
        answer.await.map_err(|_| stopped("the writer dropped the operation"))?
    }

    /// Submits the ops together, [`MAX_GROUP`] at a time: each group is taken whole into one
    /// batch of the group commit, so it is one transaction (a key given twice in it goes into a
    /// later one, which sees the first). Answers each op's answer in order.
    async fn submit_all(&self, ops: Vec<Op>, now: Timestamp) -> Result<Vec<Answer>, StoreError> {
        let mut answers = Vec::with_capacity(ops.len());
        let mut ops = ops.into_iter().peekable();
        while ops.peek().is_some() {
            let mut group = Vec::with_capacity(MAX_GROUP);
            for op in ops.by_ref().take(MAX_GROUP) {
                let (reply, answer) = oneshot::channel();
                let guess = Guess::of(&op, self.writers.estimate(now), &self.writers.known);
                group.push(Job { op, caller_now: now, guess, reply });
                answers.push(answer);
            }
            self.jobs.send(group).await.map_err(|_| stopped("the writers stopped"))?;
        }
        let mut out = Vec::with_capacity(answers.len());
        for answer in answers {
            out.push(answer.await.map_err(|_| stopped("the writer dropped the operation"))??);
        }
        Ok(out)
    }

    /// The time given in place of PostgreSQL's, for `og_now($n)` (`NULL`: PostgreSQL's own).
    fn given_now(&self) -> Option<i64> {
        self.writers.clock.given().map(to_i64)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(unavailable)
    }
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
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
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
            recovery: Default::default(),
            scope: scope.clone(),
            fingerprint: onceguard_core::Fingerprint::sha256(b"old"),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
            run: None,
            cost: 0,
            max_in_flight: Some(1),
            refused_runs: Vec::new(),
            approval: None,
        };
        // Rows as the first version wrote them: the document JSON text, the lease in its column.
        let write_first_version_row = |record: Record, mut doc: serde_json::Value| {
            let client = &client;
            async move {
                doc.as_object_mut().unwrap().remove("charged");
                let (_, body) = record.clone().into_doc().unwrap();
                client
                    .execute(
                        "INSERT INTO og_records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
                         VALUES ($1, $2, $3, $4, NULL, $5, $6, $7, $8)",
                        &[
                            &record.scope.tenant.as_str(),
                            &record.scope.namespace.as_str(),
                            &record.scope.key.as_str(),
                            &record.state.as_str(),
                            &record.lease_expires_at.map(to_i64),
                            &to_i64(record.expires_at),
                            &doc.to_string(),
                            &body,
                        ],
                    )
                    .await
                    .unwrap();
            }
        };
        let json =
            |record: &Record| serde_json::from_str::<serde_json::Value>(&record.clone().into_doc().unwrap().0).unwrap();
        let (_, Some(record)) = protocol::claim(None, &req, now, || Fence(7)) else { panic!("acquired") };
        write_first_version_row(record.clone(), json(&record)).await;
        // Another tenant's record whose holder reported its outcome unknown: it holds no lease
        // (the first version's og_lock_leases read that from the document).
        let reported = Scope { tenant: TenantId::parse("globex").unwrap(), ..scope.clone() };
        let (_, Some(mut unknown)) =
            protocol::claim(None, &ClaimRequest { scope: reported.clone(), ..req.clone() }, now, || Fence(6))
        else {
            panic!("acquired")
        };
        unknown.unknown = Some("the charge timed out".to_owned());
        write_first_version_row(unknown.clone(), json(&unknown)).await;

        let clock = Arc::new(onceguard_core::ManualClock::new(now));
        let options = PgOptions {
            schema: schema.clone(),
            pool_size: 2,
            writers: 1,
            clock: StoreClock::Given(clock.clone()),
            ..PgOptions::default()
        };
        let store = PgStore::connect_with(&url, options).await.unwrap();
        let version: i32 = client.query_one("SELECT max(version) FROM og_migrations", &[]).await.unwrap().get(0);
        assert_eq!(version as usize, MIGRATIONS.len());
        assert!(!store.get(&scope, now).await.unwrap().expect("the old record reads").charged);
        // Its lease counts against the quota of 1.
        let other = ClaimRequest { scope: Scope { key: Key::parse("new").unwrap(), ..scope.clone() }, ..req.clone() };
        assert!(matches!(store.claim(&other, now).await.unwrap(), ClaimOutcome::Denied(_)));
        // The record reported unknown does not count against its tenant's quota of 1, and is
        // listed as stuck (it waits for a person).
        assert_eq!(store.get(&reported, now).await.unwrap().unwrap().unknown.as_deref(), Some("the charge timed out"));
        let beside =
            ClaimRequest { scope: Scope { key: Key::parse("new").unwrap(), ..reported.clone() }, ..req.clone() };
        assert!(matches!(store.claim(&beside, now).await.unwrap(), ClaimOutcome::Acquired(_)));
        let stuck = ListFilter { stuck: true, limit: 10, ..ListFilter::default() };
        let listed = store.list(&reported.tenant, &stuck, now).await.unwrap();
        assert_eq!(listed.items.iter().map(|r| r.scope.clone()).collect::<Vec<_>>(), vec![reported.clone()]);
        // Once its lease passed, its recovery draws from the tenant's sequence, which starts
        // above the one sequence of the first version (at 7): the denied claim drew 8.
        clock.advance(Duration::from_secs(19));
        let recovered = store.claim(&req, now).await.unwrap();
        assert!(matches!(recovered, ClaimOutcome::Acquired(ref a) if a.fence == Fence(9)), "{recovered:?}");
        drop(store);
        client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
        drop(client);
        let _ = driver.await;
    }
}
