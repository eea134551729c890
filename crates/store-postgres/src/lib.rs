//! The PostgreSQL store: the durable store that several Onceguard instances share.
//!
//! # How it keeps the contract
//!
//! - **Atomicity**: a claim or fenced call runs in a transaction that first takes a
//!   transaction-scoped advisory lock on the key (`og_lock_get`, which also reads the record),
//!   then runs the protocol in Rust and writes the record it returns. Another instance's
//!   operation on the same key waits for the lock, so read-decide-write is never interleaved,
//!   also for keys that have no row yet.
//! - **Group commit**: writer tasks take every job waiting (up to [`MAX_BATCH`], at most one job
//!   per key) into one transaction: the locks and reads of the batch are pipelined, in ascending
//!   lock order (so batches of different instances never deadlock), then the fences, then the
//!   writes, then one `COMMIT`. An answer is sent only after that commit succeeded; if it fails,
//!   every job of the batch answers `Unavailable` and nothing of it took effect.
//! - **Fences** come from the sequence `og_fence`, drawn *after* the key's lock is held, so a
//!   key's next fence is always greater than every fence it had; the sequence is never reset, so
//!   fences keep growing after a record expired, was swept or purged.
//! - **Retention** is checked when read (`expires_at > now`); the sweep deletes expired rows in
//!   bounded batches with `FOR UPDATE SKIP LOCKED`, so it never waits on (or blocks) a claim.
//! - **Waits across instances**: once a batch (or a purge) committed, the keys it finished are
//!   handed to a notifier task that `pg_notify`s them on the schema's channel, many per
//!   statement, on a connection of its own (a `NOTIFY` takes a database-wide lock while its
//!   transaction commits, so it is kept out of the batches). A `LISTEN` connection feeds
//!   [`Store::changes`]. Waiters also poll, so a lost notification only delays a replay.
//! - **Fail closed**: every statement runs under `statement_timeout`, and taking a connection
//!   from the pool times out; both answer `Unavailable` (HTTP 503), never a decision. The pool
//!   reconnects by itself when the server comes back.

#![forbid(unsafe_code)]

use std::collections::{HashSet, VecDeque};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures::StreamExt;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, Tenant};
use onceguard_core::protocol::{self, ClaimRequest, Mutation};
use onceguard_core::store::{ListFilter, MAX_PAGE, Page, Store, StoreError};
use onceguard_core::{ClaimOutcome, Fence, FencedOutcome, Record, Scope, TenantId, Timestamp};
use tokio::sync::{Mutex, broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, NoTls, Row};

/// The most jobs committed in one transaction.
pub const MAX_BATCH: usize = 256;

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

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("postgres: {e}"))
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

/// The migrations, in order; each runs once, recorded in `og_migrations`.
const MIGRATIONS: &[&str] = &[r#"
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
"#];

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

enum Answer {
    Claim(ClaimOutcome),
    Mutate(FencedOutcome),
}

struct Job {
    op: Op,
    now: Timestamp,
    reply: oneshot::Sender<Result<Answer, StoreError>>,
}

/// The PostgreSQL store. Dropping it stops its writer and listener tasks.
pub struct PgStore {
    pool: Pool,
    schema: String,
    jobs: mpsc::Sender<Job>,
    changes: broadcast::Sender<Scope>,
    finished: mpsc::UnboundedSender<Scope>,
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
        let (jobs, rx) = mpsc::channel(4 * MAX_BATCH);
        let rx = Arc::new(Mutex::new(rx));
        let (finished, finished_rx) = mpsc::unbounded_channel();
        let mut tasks: Vec<JoinHandle<()>> = (0..options.writers)
            .map(|_| tokio::spawn(write_loop(pool.clone(), rx.clone(), finished.clone())))
            .collect();
        tasks.push(tokio::spawn(notify_loop(pool.clone(), finished_rx, channel.clone())));
        tasks.push(tokio::spawn(listen_loop(config, channel, changes.clone())));
        Ok(Self { pool, schema: options.schema, jobs, changes, finished, tasks })
    }

    /// The schema holding the tables.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    async fn submit(&self, op: Op, now: Timestamp) -> Result<Answer, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job { op, now, reply }).await.map_err(|_| unavailable("the writers stopped"))?;
        answer.await.map_err(|_| unavailable("the writer dropped the operation"))?
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

/// A stable 64-bit lock key for a scope (FNV-1a over its parts).
fn lock_key(scope: &Scope) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()] {
        for b in part.bytes().chain([0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h as i64
}

async fn write_loop(pool: Pool, rx: Arc<Mutex<mpsc::Receiver<Job>>>, finished: mpsc::UnboundedSender<Scope>) {
    let mut deferred: VecDeque<Job> = VecDeque::new();
    loop {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut keys = HashSet::new();
        let mut pending = std::mem::take(&mut deferred);
        while let Some(job) = pending.pop_front() {
            if batch.len() < MAX_BATCH && keys.insert(job.op.scope().clone()) {
                batch.push(job);
            } else {
                deferred.push_back(job);
            }
        }
        // With work in hand, take more only if no other writer is waiting on the queue (it
        // holds the lock while it waits, and must not make this writer wait with it).
        let receiver = if batch.is_empty() { Some(rx.lock().await) } else { rx.try_lock().ok() };
        if let Some(mut rx) = receiver {
            if batch.is_empty() {
                match rx.recv().await {
                    Some(job) => {
                        keys.insert(job.op.scope().clone());
                        batch.push(job);
                    }
                    None => return,
                }
            }
            while batch.len() < MAX_BATCH {
                let Ok(job) = rx.try_recv() else { break };
                if keys.insert(job.op.scope().clone()) {
                    batch.push(job);
                } else {
                    // A second operation on a key already in this batch goes in the next one,
                    // so each key is read and written once per transaction.
                    deferred.push_back(job);
                }
            }
        }
        batch.sort_by_key(|job| lock_key(job.op.scope()));
        let mut result = run_batch(&pool, &batch).await;
        if result.as_ref().is_err_and(is_retryable) {
            result = run_batch(&pool, &batch).await;
        }
        match result {
            Ok((answers, done)) => {
                for scope in done {
                    let _ = finished.send(scope);
                }
                for (job, answer) in batch.into_iter().zip(answers) {
                    let _ = job.reply.send(Ok(answer));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, jobs = batch.len(), "postgres: a batch failed; nothing of it took effect");
                let e = unavailable(e);
                for job in batch {
                    let _ = job.reply.send(Err(match &e {
                        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
                        StoreError::Corrupt(m) => StoreError::Corrupt(m.clone()),
                    }));
                }
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
            Self::Pg(e) => write!(f, "{e}"),
            Self::Pool(e) | Self::Data(e) => f.write_str(e),
        }
    }
}

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

const UPSERT: &str =
    "INSERT INTO og_records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
     ON CONFLICT (tenant, namespace, key) DO UPDATE SET
       state = excluded.state, run = excluded.run, lease_expires_at = excluded.lease_expires_at,
       expires_at = excluded.expires_at, doc = excluded.doc, body = excluded.body";

/// Runs one batch in one transaction; answers each job's answer and the keys it finished.
async fn run_batch(pool: &Pool, batch: &[Job]) -> Result<(Vec<Answer>, Vec<Scope>), BatchError> {
    let mut client = pool.get().await.map_err(|e| BatchError::Pool(e.to_string()))?;
    let tx = client.transaction().await?;
    let lock_get = tx.prepare_cached("SELECT doc, body FROM og_lock_get($1, $2, $3, $4)").await?;
    // 1. Lock and read every key, pipelined, in ascending lock order.
    let reads = batch.iter().map(|job| {
        let s = job.op.scope();
        let tx = &tx;
        let lock_get = &lock_get;
        async move {
            let key = lock_key(s);
            tx.query_opt(lock_get, &[&key, &s.tenant.as_str(), &s.namespace.as_str(), &s.key.as_str()]).await
        }
    });
    let rows = futures::future::try_join_all(reads).await?;
    let existing: Vec<Option<Record>> =
        rows.iter().map(|r| r.as_ref().map(decode_row).transpose()).collect::<Result<_, _>>()?;

    // 2. Fences, drawn only now that the keys are locked.
    let needed = batch
        .iter()
        .zip(&existing)
        .filter(|(job, record)| match &job.op {
            Op::Claim(req) => {
                matches!(protocol::claim((*record).clone(), req, job.now, || Fence(0)).0, ClaimOutcome::Acquired(_))
            }
            Op::Mutate { .. } => false,
        })
        .count();
    let mut fences: VecDeque<Fence> = if needed == 0 {
        VecDeque::new()
    } else {
        let n = i64::try_from(needed).unwrap_or(i64::MAX);
        let rows = tx.query("SELECT nextval('og_fence') FROM generate_series(1, $1::bigint)", &[&n]).await?;
        let mut fences: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        fences.sort_unstable();
        fences.into_iter().map(|f| Fence(f as u64)).collect()
    };

    // 3. Decide, then write every changed record (pipelined).
    let mut answers = Vec::with_capacity(batch.len());
    let mut writes = Vec::new();
    let mut finished = Vec::new();
    for (job, record) in batch.iter().zip(existing) {
        let (answer, write) = match &job.op {
            Op::Claim(req) => {
                let (outcome, write) = protocol::claim(record, req, job.now, || fences.pop_front().unwrap_or(Fence(0)));
                if let ClaimOutcome::Acquired(a) = &outcome {
                    if a.fence == Fence(0) {
                        return Err(BatchError::Data("ran out of drawn fences".into()));
                    }
                }
                (Answer::Claim(outcome), write)
            }
            Op::Mutate { scope, fence, mutation, max_checkpoints } => {
                let finishes =
                    matches!(mutation, Mutation::Complete(_) | Mutation::Fail { .. } | Mutation::ReportUnknown(_));
                let (outcome, write) = protocol::apply(record, *fence, mutation.clone(), job.now, *max_checkpoints);
                if finishes && write.is_some() {
                    finished.push(scope.clone());
                }
                (Answer::Mutate(outcome), write)
            }
        };
        answers.push(answer);
        if let Some(record) = write {
            writes.push(record);
        }
    }
    let upsert = tx.prepare_cached(UPSERT).await?;
    let mut params = Vec::with_capacity(writes.len());
    for record in writes {
        let scope = record.scope.clone();
        let (state, run, lease, expires) =
            (record.state, record.run.clone(), record.lease_expires_at, record.expires_at);
        let (doc, body) = record.into_doc().map_err(|e| BatchError::Data(e.to_string()))?;
        let (tenant, namespace, key) = (scope.tenant.to_string(), scope.namespace.to_string(), scope.key.to_string());
        let run = run.map(|r| r.to_string());
        params.push((tenant, namespace, key, state.as_str(), run, lease.map(to_i64), to_i64(expires), doc, body));
    }
    let upserts = params.iter().map(|(tenant, namespace, key, state, run, lease, expires, doc, body)| {
        let (tx, upsert) = (&tx, &upsert);
        async move { tx.execute(upsert, &[tenant, namespace, key, state, run, lease, expires, doc, body]).await }
    });
    futures::future::try_join_all(upserts).await?;
    tx.commit().await?;
    Ok((answers, finished))
}

/// Notifies finished keys on `channel`, in batches, each in a statement of its own.
async fn notify_loop(pool: Pool, mut finished: mpsc::UnboundedReceiver<Scope>, channel: String) {
    let mut scopes = Vec::new();
    while finished.recv_many(&mut scopes, 1_000).await > 0 {
        let sent = async {
            let client = pool.get().await.map_err(|e| e.to_string())?;
            notify(&client, &channel, &scopes).await.map_err(|e| e.to_string())
        };
        if let Err(e) = sent.await {
            tracing::debug!(error = %e, "postgres: could not notify finished keys; waiters will poll");
        }
        scopes.clear();
    }
}

async fn notify(client: &tokio_postgres::Client, channel: &str, scopes: &[Scope]) -> Result<(), tokio_postgres::Error> {
    let payloads: Vec<String> = scopes.iter().filter_map(|s| serde_json::to_string(s).ok()).collect();
    if payloads.is_empty() {
        return Ok(());
    }
    client.execute("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p", &[&channel, &payloads]).await.map(drop)
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
                    if let AsyncMessage::Notification(n) = message {
                        if tx.send(n.payload().to_owned()).is_err() {
                            break;
                        }
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

fn tenant_from_row(row: &Row) -> Result<Tenant, StoreError> {
    Ok(Tenant { id: TenantId::parse(row.get::<_, &str>(0)).map_err(corrupt)?, created_at: timestamp(row.get(1))? })
}

const API_KEY_COLUMNS: &str = "id, tenant, role, label, secret_sha256, created_at, revoked_at";

fn api_key_from_row(row: &Row) -> Result<ApiKey, StoreError> {
    Ok(ApiKey {
        id: ApiKeyId::parse(row.get::<_, &str>(0)).map_err(corrupt)?,
        tenant: TenantId::parse(row.get::<_, &str>(1)).map_err(corrupt)?,
        role: Role::parse(row.get::<_, &str>(2)).map_err(corrupt)?,
        label: row.get(3),
        secret_sha256: row.get(4),
        created_at: timestamp(row.get(5))?,
        revoked_at: row.get::<_, Option<i64>>(6).map(timestamp).transpose()?,
    })
}

#[async_trait]
impl Store for PgStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        match self.submit(Op::Claim(req.clone()), now).await? {
            Answer::Claim(outcome) => Ok(outcome),
            Answer::Mutate(_) => Err(corrupt("a claim was answered as a mutation")),
        }
    }

    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        let op = Op::Mutate { scope: scope.clone(), fence, mutation, max_checkpoints };
        match self.submit(op, now).await? {
            Answer::Mutate(outcome) => Ok(outcome),
            Answer::Claim(_) => Err(corrupt("a mutation was answered as a claim")),
        }
    }

    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let client = self.client().await?;
        let st = client
            .prepare_cached("SELECT doc, body FROM og_records WHERE tenant = $1 AND namespace = $2 AND key = $3")
            .await
            .map_err(unavailable)?;
        let row = client
            .query_opt(&st, &[&scope.tenant.as_str(), &scope.namespace.as_str(), &scope.key.as_str()])
            .await
            .map_err(unavailable)?;
        let record = row.as_ref().map(decode_row).transpose().map_err(corrupt)?;
        Ok(record.filter(|r| r.is_live(now)))
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let client = self.client().await?;
        let st = client
            .prepare_cached(
                "SELECT doc, body FROM og_records
                 WHERE tenant = $1 AND expires_at > $2
                   AND ($3::text IS NULL OR state = $3)
                   AND (NOT $4 OR (state = 'in_progress' AND lease_expires_at <= $2))
                   AND ($5::text IS NULL OR run = $5)
                   AND ($6::text IS NULL OR namespace = $6 OR starts_with(namespace, $6 || '/'))
                   AND ($7::text IS NULL OR (namespace, key) > ($7::text COLLATE \"C\", $8::text COLLATE \"C\"))
                 ORDER BY namespace, key
                 LIMIT $9",
            )
            .await
            .map_err(unavailable)?;
        let (after_ns, after_key) = match &filter.after {
            Some((ns, key)) => (Some(ns.as_str()), Some(key.as_str())),
            None => (None, None),
        };
        let rows = client
            .query(
                &st,
                &[
                    &tenant.as_str(),
                    &to_i64(now),
                    &filter.state.map(|s| s.as_str()),
                    &filter.stuck,
                    &filter.run.as_ref().map(|r| r.as_str()),
                    &filter.namespace_prefix.as_ref().map(|p| p.as_str()),
                    &after_ns,
                    &after_key,
                    &i64::try_from(limit + 1).unwrap_or(i64::MAX),
                ],
            )
            .await
            .map_err(unavailable)?;
        let records: Vec<Record> = rows.iter().map(decode_row).collect::<Result<_, _>>().map_err(corrupt)?;
        Ok(Page::from_overfetch(records, limit))
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "DELETE FROM og_records WHERE tenant = $1 AND namespace = $2 AND key = $3",
                &[&scope.tenant.as_str(), &scope.namespace.as_str(), &scope.key.as_str()],
            )
            .await
            .map_err(unavailable)?;
        let _ = self.finished.send(scope.clone());
        Ok(n > 0)
    }

    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let client = self.client().await?;
        let n = client
            .execute(
                "DELETE FROM og_records WHERE ctid IN
                   (SELECT ctid FROM og_records WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED)",
                &[&to_i64(now), &i64::try_from(batch).unwrap_or(i64::MAX)],
            )
            .await
            .map_err(unavailable)?;
        usize::try_from(n).map_err(corrupt)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.client().await?.simple_query("SELECT 1").await.map(drop).map_err(unavailable)
    }

    fn changes(&self) -> Option<broadcast::Receiver<Scope>> {
        Some(self.changes.subscribe())
    }

    async fn create_tenant(&self, tenant: &Tenant) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "INSERT INTO og_tenants (id, created_at) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
                &[&tenant.id.as_str(), &to_i64(tenant.created_at)],
            )
            .await
            .map_err(unavailable)?;
        Ok(n > 0)
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt("SELECT id, created_at FROM og_tenants WHERE id = $1", &[&id.as_str()])
            .await
            .map_err(unavailable)?;
        row.as_ref().map(tenant_from_row).transpose()
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let rows = self
            .client()
            .await?
            .query("SELECT id, created_at FROM og_tenants ORDER BY id COLLATE \"C\"", &[])
            .await
            .map_err(unavailable)?;
        rows.iter().map(tenant_from_row).collect()
    }

    async fn create_api_key(&self, key: &ApiKey) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                &format!("INSERT INTO og_api_keys ({API_KEY_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"),
                &[
                    &key.id.as_str(),
                    &key.tenant.as_str(),
                    &key.role.as_str(),
                    &key.label,
                    &key.secret_sha256,
                    &to_i64(key.created_at),
                    &key.revoked_at.map(to_i64),
                ],
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        let client = self.client().await?;
        let st = client
            .prepare_cached(&format!("SELECT {API_KEY_COLUMNS} FROM og_api_keys WHERE id = $1"))
            .await
            .map_err(unavailable)?;
        let row = client.query_opt(&st, &[&id.as_str()]).await.map_err(unavailable)?;
        row.as_ref().map(api_key_from_row).transpose()
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                &format!("SELECT {API_KEY_COLUMNS} FROM og_api_keys WHERE tenant = $1 ORDER BY created_at DESC, id"),
                &[&tenant.as_str()],
            )
            .await
            .map_err(unavailable)?;
        rows.iter().map(api_key_from_row).collect()
    }

    async fn revoke_api_key(&self, tenant: &TenantId, id: &ApiKeyId, now: Timestamp) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "UPDATE og_api_keys SET revoked_at = coalesce(revoked_at, $3) WHERE id = $1 AND tenant = $2",
                &[&id.as_str(), &tenant.as_str(), &to_i64(now)],
            )
            .await
            .map_err(unavailable)?;
        Ok(n > 0)
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
}
