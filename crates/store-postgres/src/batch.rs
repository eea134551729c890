//! The group commit: claims and fenced calls queued as jobs, taken by the writer tasks in
//! batches, each batch one transaction (locks in key order, one read, the protocol decided in
//! Rust, the writes, one commit). See the crate documentation for how it keeps the contract.

use super::*;

pub(crate) enum Op {
    Claim(ClaimRequest),
    Mutate { scope: Scope, fence: Fence, mutation: Mutation, max_checkpoints: usize },
}

impl Op {
    pub(crate) fn scope(&self) -> &Scope {
        match self {
            Self::Claim(req) => &req.scope,
            Self::Mutate { scope, .. } => scope,
        }
    }
}

#[derive(Debug)]
pub(crate) enum Answer {
    Claim(ClaimOutcome),
    Mutate(FencedOutcome),
}

pub(crate) struct Job {
    pub(crate) op: Op,
    /// The caller's `now` when it submitted the job. It decides nothing (the batch decides by
    /// the store's time, read under the keys' locks); it only tells this instance how far its
    /// clock is from the store's, to date guesses ([`Writers::estimate`]).
    pub(crate) caller_now: Timestamp,
    /// The job decided before its key is read, made by the caller's task when it submitted the
    /// job (so not by a writer while it holds the intake).
    pub(crate) guess: Option<Guess>,
    pub(crate) reply: oneshot::Sender<Result<Answer, StoreError>>,
}

/// Where writers take their batches from, one writer at a time: the queue of submissions (one
/// job, or the jobs of a batch call, which go into one transaction together), the submission
/// that did not fit in the last batch, and the jobs put off to a later batch.
pub(crate) struct Intake {
    pub(crate) queue: mpsc::Receiver<Vec<Job>>,
    /// A submission that would have made the last batch larger than [`MAX_BATCH`]: the next
    /// batch starts with it.
    pub(crate) held: Option<Vec<Job>>,
    /// Jobs on a key that the batch being taken already had.
    pub(crate) deferred: VecDeque<Job>,
}

/// A batch being taken: its jobs, one per key, and the jobs on a key it has already.
struct Taking {
    batch: Vec<Job>,
    keys: HashSet<Scope>,
    put_off: VecDeque<Job>,
}

impl Taking {
    fn take(&mut self, job: Job) {
        if self.keys.insert(job.op.scope().clone()) {
            self.batch.push(job);
        } else {
            self.put_off.push_back(job);
        }
    }
}

impl Writers {
    /// The store's time as this instance expects it at the caller's `now`: the caller's time
    /// plus the offset the last batch measured. It dates a [`Guess`], which is written only if
    /// the store's time then is within [`GUESS_TOLERANCE_MS`] of it.
    pub(crate) fn estimate(&self, now: Timestamp) -> Timestamp {
        let offset = self.offset_ms.load(Ordering::Relaxed);
        Timestamp(now.0.saturating_add_signed(offset))
    }
}

/// How far a [`Guess`]'s time may be from the store's time read under the keys' locks for the
/// guess to be written. Its decision does not depend on the time (a claim of a key with no row,
/// a fenced call on an in-progress record); only the times it writes (lease end, completion,
/// expiry) do, and those stay this close to the store's time when the job was submitted (the
/// gap is mostly the job's wait in the queue, which a burst of claims makes hundreds of
/// milliseconds). Every later decision compares those times with the store's, so no lease is
/// taken over early whatever they are. A guess further off (this instance's clock jumped, or
/// the job waited longer) is decided again on the store's time.
pub(crate) const GUESS_TOLERANCE_MS: i64 = 1_000;

impl Intake {
    /// Takes the jobs put off before (one per key, up to [`MAX_BATCH`]); then, if that is
    /// nothing, waits for a submission. Then takes every submission waiting, in order and each
    /// whole, while the batch stays within [`MAX_BATCH`] jobs (a larger submission is a batch
    /// of its own), and one job per key: a second job on a key goes in a later batch, so each key
    /// is read and written once per transaction. Sorted by [`lock_key`]. `None` once the store
    /// is gone.
    pub(crate) async fn next_batch(&mut self) -> Option<Vec<Job>> {
        let mut t = Taking { batch: Vec::with_capacity(MAX_BATCH), keys: HashSet::new(), put_off: VecDeque::new() };
        for job in std::mem::take(&mut self.deferred) {
            if t.batch.len() < MAX_BATCH && !t.keys.contains(job.op.scope()) {
                t.take(job);
            } else {
                t.put_off.push_back(job);
            }
        }
        if t.batch.is_empty() {
            let first = match self.held.take() {
                Some(held) => held,
                None => self.queue.recv().await?,
            };
            for job in first {
                t.take(job);
            }
        }
        loop {
            let next = match self.held.take() {
                Some(held) => held,
                None if t.batch.len() < MAX_BATCH => match self.queue.try_recv() {
                    Ok(submission) => submission,
                    Err(_) => break,
                },
                None => break,
            };
            if t.batch.len() + next.len() > MAX_BATCH {
                self.held = Some(next);
                break;
            }
            for job in next {
                t.take(job);
            }
        }
        self.deferred = t.put_off;
        let mut batch = t.batch;
        batch.sort_by_key(|job| lock_key(job.op.scope()));
        Some(batch)
    }
}

/// What the writer tasks share.
pub(crate) struct Writers {
    pub(crate) pool: Pool,
    /// Where the batches' time comes from.
    pub(crate) clock: StoreClock,
    /// The store's time minus the caller's `now`, in milliseconds, as the last batch found it.
    pub(crate) offset_ms: AtomicI64,
    pub(crate) intake: Mutex<Intake>,
    pub(crate) known: Known,
    pub(crate) finished: mpsc::UnboundedSender<Scope>,
    pub(crate) counters: BatchCounters,
}

/// A writer task. It holds the intake while it takes a batch and until the batch's reads are
/// answered, and lets go of it while the batch's `COMMIT` (and, for a batch whose jobs were
/// not all decided before the read, its writes) run: so one batch at a time gathers and reads
/// while those before it wait for their commits' WAL flush, and each batch takes every job
/// that came in meanwhile.
pub(crate) async fn write_loop(writers: Arc<Writers>) {
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
pub(crate) fn fail_batch(batch: Vec<Job>, e: &BatchError) {
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
pub(crate) async fn run_batch(
    writers: &Writers,
    batch: &[Job],
    mut guesses: Vec<Option<Guess>>,
    turn: Option<tokio::sync::MutexGuard<'_, Intake>>,
) -> Result<Vec<Option<Answer>>, BatchError> {
    let client = writers.pool.get().await.map_err(|e| BatchError::Pool(with_causes(&e)))?;
    guesses.resize_with(batch.len(), || None);
    let decided = match decide_batch(writers, &client, batch, guesses, turn).await {
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

#[derive(Debug)]
pub(crate) enum BatchError {
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
pub(crate) fn is_retryable(e: &BatchError) -> bool {
    matches!(e, BatchError::Pg(e) if e.code().is_some_and(|c| c.code() == "40P01" || c.code() == "40001"))
}

/// The record of `scope` from a row whose first two columns are its `doc` and `body`.
pub(crate) fn decode_row(scope: Scope, row: &Row) -> Result<Record, BatchError> {
    let doc: Vec<u8> = row.get(0);
    Record::unpack(scope, &doc, row.get(1)).map_err(BatchError::Data)
}

/// The `lease_expires_at` column of a record: its lease, unless its holder reported the outcome
/// unknown (it then holds none, and its document keeps the time).
pub(crate) fn lease_column(record: &Record) -> Option<i64> {
    record.lease_expires_at.filter(|_| record.unknown.is_none()).map(to_i64)
}

/// Set at the start of a batch's transaction: its statements are planned once per connection,
/// not at each execution (PostgreSQL would otherwise keep planning them for the parameters
/// given, as a custom plan looks cheaper for the one-element arrays of its first executions).
/// Their plans do not depend on the parameters: each key is an index lookup
/// ([`READ_KEYS`]), also when planned while the table was empty.
pub(crate) const GENERIC_PLANS: &str = "SET LOCAL plan_cache_mode = force_generic_plan";

/// Takes the key locks of a batch: one advisory lock (a `bigint`) per key, in the order of the
/// array, which the caller sorts ascending. A function scan returns `unnest`'s elements in
/// order, and each row's lock is taken before the next row is produced.
pub(crate) const LOCK_KEYS: &str = "SELECT pg_advisory_xact_lock(h) FROM unnest($1::bigint[]) AS h";

/// Reads the records of a batch's keys, one row per key with its place in the arrays (from 1),
/// and draws a fence for each key that has no row and is marked in `$4` (a claim, which the
/// protocol always lets acquire a key with no record, unless a limit denies it; then the fence
/// is left unused). It runs as a statement of its own after [`LOCK_KEYS`], so that its snapshot
/// is taken once every lock is held and sees every commit made under them, and so that its
/// fences are drawn under those locks. Each row carries the store's time (`og_now($5)`: the
/// statement's start, or the time `$5` given in its place), by which the batch is decided.
/// (`LATERAL … LIMIT 1` keeps the plan an index lookup per key, also when the statement was
/// prepared while the table was empty.)
pub(crate) const READ_KEYS: &str =
    "SELECT r.doc, r.body, u.i, CASE WHEN r.doc IS NULL AND u.d THEN nextval(og_fence_of(u.t)) END, og_now($5)
     FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[]) WITH ORDINALITY AS u (t, n, k, d, i)
     LEFT JOIN LATERAL (SELECT s.doc, s.body FROM og_records s
                        WHERE s.tenant = u.t AND s.namespace = u.n AND s.key = u.k LIMIT 1) r ON true";

/// [`READ_KEYS`], and the writes of the batch's [`Guess`]es whose guess holds, in the same
/// statement (so on the same reads, under the keys' locks). Each key comes with its guess, if
/// any (`$5` to `$12`: the record to write, and for a fenced call the `doc` and `body` of the
/// record it guesses the key holds). A guessed claim's record is inserted where the key has no
/// row, with the fence drawn for it in place of [`GUESSED_FENCE`]'s spelling (`$13`, see
/// [`Fence::packed`]); a guessed fenced
/// call's record replaces the row that holds exactly the guessed record; and only a guess dated
/// (`$14`) within `$16` ms ([`GUESS_TOLERANCE_MS`]) of the store's time (`og_now($15)`, as in
/// [`READ_KEYS`]) is written at all. Each row says whether its key was written (`w`), and
/// carries the record read only if it was not, and the store's time. The rows read are those
/// from before the writes (all parts of a statement see one snapshot).
pub(crate) const READ_KEYS_WRITING_GUESSES: &str = "WITH cur AS MATERIALIZED (
       SELECT u.*, r.doc, r.body, r.at, CASE WHEN r.doc IS NULL AND u.d THEN nextval(og_fence_of(u.t)) END AS fence,
              og_now($15) AS now, abs(u.g_now - og_now($15)) <= $16::bigint AS on_time
       FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[], $5::text[], $6::text[], $7::bigint[],
                   $8::bigint[], $9::bytea[], $10::bytea[], $11::bytea[], $12::bytea[], $14::bigint[]) WITH ORDINALITY
         AS u (t, n, k, d, g_state, g_run, g_lease, g_expires, g_doc, g_body, was_doc, was_body, g_now, i)
       LEFT JOIN LATERAL (SELECT s.doc, s.body, s.ctid AS at FROM og_records s
                          WHERE s.tenant = u.t AND s.namespace = u.n AND s.key = u.k LIMIT 1) r ON true),
     inserted AS (
       INSERT INTO og_records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
       SELECT t, n, k, g_state, g_run, g_lease, g_expires,
              overlay(g_doc PLACING og_varint(fence) FROM position($13::bytea IN g_doc) FOR length($13::bytea)), g_body
       FROM cur WHERE g_doc IS NOT NULL AND on_time AND was_doc IS NULL AND doc IS NULL AND fence IS NOT NULL),
     updated AS (
       UPDATE og_records r SET state = c.g_state, run = c.g_run, lease_expires_at = c.g_lease,
                               expires_at = c.g_expires, doc = c.g_doc, body = c.g_body
       FROM cur c
       WHERE r.ctid = c.at AND c.on_time AND c.was_doc IS NOT NULL AND c.doc = c.was_doc
         AND c.body IS NOT DISTINCT FROM c.was_body
       RETURNING c.i)
     SELECT CASE WHEN w THEN NULL ELSE doc END, CASE WHEN w THEN NULL ELSE body END, i, fence, w, now
     FROM (SELECT c.doc, c.body, c.i, c.fence, c.now,
                  (c.g_doc IS NOT NULL AND c.on_time AND c.was_doc IS NULL AND c.doc IS NULL AND c.fence IS NOT NULL)
                  OR c.i IN (SELECT i FROM updated) AS w
           FROM cur c) c";

/// Draws fences, for the claims that acquire a key that had a record (a recovery): one from
/// its tenant's sequence for each tenant in `$1`; sent once the keys' locks are held.
pub(crate) const NEXT_FENCES: &str = "SELECT t, nextval(og_fence_of(t)) FROM unnest($1::text[]) AS t";

/// Writes records whole, many in one statement (a batch holds at most one job per key, so no
/// row is written twice); only a transaction holding their keys' locks writes them.
pub(crate) const UPSERT_RECORDS: &str =
    "INSERT INTO og_records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::bigint[],
                          $8::bytea[], $9::bytea[])
     ON CONFLICT (tenant, namespace, key) DO UPDATE SET
       state = excluded.state, run = excluded.run, lease_expires_at = excluded.lease_expires_at,
       expires_at = excluded.expires_at, doc = excluded.doc, body = excluded.body";

/// Records to write with [`UPSERT_RECORDS`], column by column.
#[derive(Debug, Default)]
pub(crate) struct RecordColumns {
    pub(crate) tenant: Vec<String>,
    pub(crate) namespace: Vec<String>,
    pub(crate) key: Vec<String>,
    pub(crate) state: Vec<&'static str>,
    pub(crate) run: Vec<Option<String>>,
    pub(crate) lease: Vec<Option<i64>>,
    pub(crate) expires: Vec<i64>,
    pub(crate) doc: Vec<Vec<u8>>,
    pub(crate) body: Vec<Option<Vec<u8>>>,
}

impl RecordColumns {
    /// Adds a record; answers what [`Known`] keeps of it.
    pub(crate) fn push(&mut self, record: Record) -> Result<Option<Arc<KnownRecord>>, BatchError> {
        let scope = record.scope.clone();
        let (state, run, lease, expires) = (record.state, record.run.clone(), lease_column(&record), record.expires_at);
        let kept = (state == RecordState::InProgress).then(|| record.clone());
        let (doc, body) = record.pack();
        let known = kept.map(|record| Arc::new(KnownRecord { record, doc: doc.clone(), body: body.clone() }));
        self.tenant.push(scope.tenant.to_string());
        self.namespace.push(scope.namespace.to_string());
        self.key.push(scope.key.to_string());
        self.state.push(state.as_str());
        self.run.push(run.map(|r| r.to_string()));
        self.lease.push(lease);
        self.expires.push(to_i64(expires));
        self.doc.push(doc);
        self.body.push(body);
        Ok(known)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.key.is_empty()
    }

    pub(crate) fn as_sql(&self) -> [&(dyn ToSql + Sync); 9] {
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
pub(crate) const UPSERT_RUN: &str = "INSERT INTO og_runs (tenant, run, budget, effects, cost, created_at, updated_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7)
     ON CONFLICT (tenant, run) DO UPDATE SET
       budget = excluded.budget, effects = excluded.effects, cost = excluded.cost, updated_at = excluded.updated_at";

/// A run's columns as [`decode_run`] reads them.
pub(crate) const RUN_COLUMNS: &str = "budget, effects, cost, created_at, updated_at";

/// What a batch must lock, read and draw once its keys are locked, besides the keys.
#[derive(Debug, Default)]
pub(crate) struct Needs {
    /// Fences, by tenant: one per claim that acquires a key for which [`READ_KEYS`] drew none.
    pub(crate) fences: BTreeMap<TenantId, usize>,
    /// Tenants whose in-flight quota an acquiring claim checks, with the batch's time.
    pub(crate) quotas: BTreeMap<TenantId, Timestamp>,
    /// Runs that an acquiring claim, or a fenced call reporting cost, may charge.
    pub(crate) runs: BTreeSet<(TenantId, RunId)>,
}

impl Needs {
    /// Works out what the jobs need from what was read for them (a claim's decision is the
    /// same whatever fence it is given).
    pub(crate) fn of<'a>(jobs: impl Iterator<Item = (&'a Job, &'a Read)>, now: Timestamp) -> Self {
        let mut needs = Self::default();
        for (job, Read { record, fence, .. }) in jobs {
            match &job.op {
                Op::Claim(req) => {
                    let Some(written) = protocol::claim(record.clone(), req, now, || Fence(0)).1 else { continue };
                    if fence.is_none() {
                        *needs.fences.entry(req.scope.tenant.clone()).or_default() += 1;
                    }
                    if req.max_in_flight.is_some() {
                        needs.quotas.insert(req.scope.tenant.clone(), now);
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

    pub(crate) fn is_empty(&self) -> bool {
        self.fences.is_empty() && self.quotas.is_empty() && self.runs.is_empty()
    }
}

/// A tenant's leases by (namespace, key), each with the lease's end and the record's expiry.
pub(crate) type Leases = HashMap<(String, String), (Timestamp, Timestamp)>;

/// What a batch knows of the tenants' leases and of the runs it may charge, kept up to date as
/// its jobs are decided in order, so that each decision sees those before it in the batch.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// For each tenant whose quota is checked: its leases.
    pub(crate) leases: HashMap<TenantId, Leases>,
    /// Each run the batch may charge: as stored, `None` while unseen.
    pub(crate) runs: HashMap<(TenantId, RunId), Option<Run>>,
    /// Runs charged by the batch, to write.
    pub(crate) charged: BTreeSet<(TenantId, RunId)>,
}

impl Ledger {
    /// The tenant's live leases at `now` ([`control::holds_lease`]).
    pub(crate) fn in_flight(&self, tenant: &TenantId, now: Timestamp) -> Result<u64, BatchError> {
        let leases = self
            .leases
            .get(tenant)
            .ok_or_else(|| BatchError::Data(format!("tenant {tenant}'s leases were not read")))?;
        Ok(leases.values().filter(|(lease, live)| *lease > now && *live > now).count() as u64)
    }

    /// A run the batch locked, as stored or new at `now`.
    pub(crate) fn run(&mut self, tenant: &TenantId, id: &RunId, now: Timestamp) -> Result<&mut Run, BatchError> {
        let slot = self
            .runs
            .get_mut(&(tenant.clone(), id.clone()))
            .ok_or_else(|| BatchError::Data(format!("run {id} of tenant {tenant} was not locked")))?;
        Ok(slot.get_or_insert_with(|| Run::new(tenant.clone(), id.clone(), now)))
    }

    /// Notes a record the batch writes: from now on it holds a lease, or it no longer does.
    pub(crate) fn wrote(&mut self, record: &Record) {
        let Some(leases) = self.leases.get_mut(&record.scope.tenant) else { return };
        let key = (record.scope.namespace.as_str().to_owned(), record.scope.key.as_str().to_owned());
        match (record.state, &record.unknown, record.lease_expires_at) {
            (RecordState::InProgress, None, Some(lease)) => leases.insert(key, (lease, record.expires_at)),
            _ => leases.remove(&key),
        };
    }

    /// Checks the tenant's quota and the run's budget for a claim the protocol acquires
    /// ([`control::admit`]). Denied: the claim writes nothing.
    pub(crate) fn admit(
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

pub(crate) fn decode_run(tenant: &TenantId, id: &RunId, row: &Row) -> Result<Run, StoreError> {
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
pub(crate) type RunParams = (String, String, String, i64, i64, i64, i64);

pub(crate) fn run_params(run: &Run) -> Result<RunParams, serde_json::Error> {
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
pub(crate) struct Read {
    pub(crate) record: Option<Record>,
    pub(crate) fence: Option<Fence>,
    pub(crate) guessed: bool,
}

/// The guesses of a batch's keys, column by column, for [`READ_KEYS_WRITING_GUESSES`]
/// (`NULL` for a key without one).
#[derive(Debug, Default)]
pub(crate) struct GuessColumns<'a> {
    pub(crate) state: Vec<Option<&'static str>>,
    pub(crate) run: Vec<Option<&'a str>>,
    pub(crate) lease: Vec<Option<i64>>,
    pub(crate) expires: Vec<Option<i64>>,
    pub(crate) doc: Vec<Option<&'a [u8]>>,
    pub(crate) body: Vec<Option<&'a [u8]>>,
    pub(crate) was_doc: Vec<Option<&'a [u8]>>,
    pub(crate) was_body: Vec<Option<&'a [u8]>>,
    pub(crate) now: Vec<Option<i64>>,
}

impl<'a> GuessColumns<'a> {
    pub(crate) fn of(guesses: &'a [Option<Guess>]) -> Self {
        let mut columns = Self::default();
        for guess in guesses {
            let g = guess.as_ref();
            columns.state.push(g.map(|g| g.record.state.as_str()));
            columns.run.push(g.and_then(|g| g.record.run.as_ref()).map(|r| r.as_str()));
            columns.lease.push(g.and_then(|g| lease_column(&g.record)));
            columns.expires.push(g.map(|g| to_i64(g.record.expires_at)));
            columns.doc.push(g.map(|g| g.doc.as_slice()));
            columns.body.push(g.and_then(|g| g.body.as_deref()));
            let known = g.and_then(|g| g.known.as_ref());
            columns.was_doc.push(known.map(|k| k.doc.as_slice()));
            columns.was_body.push(known.and_then(|k| k.body.as_deref()));
            columns.now.push(g.map(|g| to_i64(g.now)));
        }
        columns
    }
}

/// Begins a transaction (with [`GENERIC_PLANS`]), locks the keys of `scopes` (sorted by
/// [`lock_key`]), and reads their records, drawing a fence for each key marked in `claims`
/// that has none and writing the guesses that hold: four statements sent together, one round
/// trip, and `COMMIT` with them if `commit`. `turn` is let go of once the reads are answered.
/// Answers the reads and the store's time under the locks (`clock`'s, if it gives one). Unless
/// it committed, the transaction stays open on `client`; if this fails, the caller must
/// [`abandon`] it.
pub(crate) async fn lock_and_read(
    client: &ClientWrapper,
    scopes: &[&Scope],
    claims: &[bool],
    guesses: &[Option<Guess>],
    clock: &StoreClock,
    commit: bool,
    turn: Option<tokio::sync::MutexGuard<'_, Intake>>,
) -> Result<(Vec<Read>, Timestamp), BatchError> {
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
    let placeholder = GUESSED_FENCE.packed();
    let given = clock.given().map(to_i64);
    let lock_params: [&(dyn ToSql + Sync); 1] = [&keys];
    let read_params: [&(dyn ToSql + Sync); 16] = [
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
        &g.now,
        &given,
        &GUESS_TOLERANCE_MS,
    ];
    let plain_params: [&(dyn ToSql + Sync); 5] = [&tenants, &namespaces, &names, &claims, &given];
    let (read_params, now_column) = if guessing { (&read_params[..], 5) } else { (&plain_params[..], 4) };
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
    let now = rows
        .first()
        .map(|row| timestamp(row.get(now_column)))
        .transpose()
        .map_err(|e| BatchError::Data(e.to_string()))?
        .ok_or_else(|| BatchError::Data("the batch's keys were not read".into()))?;
    for row in &rows {
        let i = usize::try_from(row.get::<_, i64>(2) - 1)
            .ok()
            .filter(|&i| i < scopes.len())
            .ok_or_else(|| BatchError::Data("a row was read for no key of the batch".into()))?;
        let doc: Option<Vec<u8>> = row.get(0);
        let record = doc.map(|doc| Record::unpack(scopes[i].clone(), &doc, row.get(1))).transpose();
        let fence = row.get::<_, Option<i64>>(3).map(|f| Fence(f as u64));
        let guessed = guessing && row.get::<_, bool>(4);
        reads[i] = Some(Read { record: record.map_err(BatchError::Data)?, fence, guessed });
    }
    let reads = reads.into_iter().map(|r| r.ok_or_else(|| BatchError::Data("a key of the batch was not read".into())));
    Ok((reads.collect::<Result<_, _>>()?, now))
}

/// Writes `records` and `runs` and commits, in one round trip. If this fails, the caller must
/// [`abandon`] the transaction (a `COMMIT` after a failed statement only rolls back).
pub(crate) async fn write_and_commit(
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
pub(crate) async fn abandon(client: deadpool_postgres::Object) {
    if client.batch_execute("ROLLBACK").await.is_err() {
        drop(deadpool_postgres::Object::take(client));
    }
}

/// Locks and reads what `needs` names, pipelined in one round trip, in the global lock order
/// (see the module documentation): the tenants' quota locks with their leases, then the runs'
/// locks with the runs, each class in ascending lock order; and draws the fences it names.
pub(crate) async fn lock_needs(client: &ClientWrapper, needs: &Needs) -> Result<(Ledger, Fences), BatchError> {
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
    let next_fences = if needs.fences.is_empty() { None } else { Some(client.prepare_cached(NEXT_FENCES).await?) };
    let fence_tenants: Vec<&str> =
        needs.fences.iter().flat_map(|(tenant, n)| std::iter::repeat_n(tenant.as_str(), *n)).collect();
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
            Some(st) => client.query(st, &[&fence_tenants]).await,
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
    let mut drawn: Vec<(&str, i64)> = fence_rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    drawn.sort_unstable();
    let mut fences = Fences::default();
    for (tenant, fence) in drawn {
        let tenant = TenantId::parse(tenant).map_err(|e| BatchError::Data(e.to_string()))?;
        fences.0.entry(tenant).or_default().push_back(Fence(fence as u64));
    }
    Ok((ledger, fences))
}

/// The fences a batch drew, by tenant, each tenant's in ascending order.
#[derive(Debug, Default)]
pub(crate) struct Fences(HashMap<TenantId, VecDeque<Fence>>);

impl Fences {
    /// The tenant's next fence.
    pub(crate) fn next(&mut self, tenant: &TenantId) -> Option<Fence> {
        self.0.get_mut(tenant).and_then(VecDeque::pop_front)
    }
}

/// A batch decided under its locks, to be written and committed unless it already was.
pub(crate) struct Decided {
    /// Each job's answer, to send once the batch committed; `None` for a job whose guess did
    /// not hold, in a batch that committed with its reads (all its jobs were guessed), and that
    /// must write: it runs again in a batch of its own.
    pub(crate) answers: Vec<Option<Answer>>,
    pub(crate) writes: RecordColumns,
    pub(crate) runs: Vec<RunParams>,
    /// The keys whose attempt the batch finishes.
    pub(crate) finished: Vec<Scope>,
    /// What the batch leaves its keys as, for [`Known`].
    pub(crate) known: Vec<(Scope, Option<Arc<KnownRecord>>)>,
    /// Whether the batch committed with its reads.
    pub(crate) committed: bool,
}

/// Decides a batch in a transaction on `client`: one round trip when every job is guessed
/// (the batch then commits with it), or else one more to write and commit ([`write_and_commit`])
/// and, before it, one more when a job needs a quota or a run checked or a recovery's fence
/// drawn.
pub(crate) async fn decide_batch(
    writers: &Writers,
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
    let (reads, now) = lock_and_read(client, &scopes, &claims, &guesses, &writers.clock, committed, turn).await?;
    if let Some(job) = batch.first() {
        writers.offset_ms.store(to_i64(now).saturating_sub(to_i64(job.caller_now)), Ordering::Relaxed);
    }

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
                let (answer, record) = protocol::claim(None, req, guess.now, || fence);
                let record = record.ok_or_else(|| BatchError::Data("a guessed claim did not acquire".into()))?;
                debug_assert_eq!(record, Record { fence, ..guess.record });
                let doc = with_fence(&guess.doc, GUESSED_FENCE, fence)
                    .ok_or_else(|| BatchError::Data("a guessed claim's document lost its fence".into()))?;
                (Answer::Claim(answer), record, doc)
            }
            (Op::Mutate { scope, mutation, .. }, Some(_)) => {
                if mutation.finishes() {
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
                Op::Claim(req) => match protocol::claim(read.record, req, now, || Fence(0)) {
                    (outcome, None) => Some(Answer::Claim(outcome)),
                    (_, Some(_)) => None,
                },
                Op::Mutate { fence, mutation, max_checkpoints, .. } => {
                    match protocol::apply(read.record, *fence, mutation.clone(), now, *max_checkpoints) {
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
    let needs = Needs::of(pending.iter().map(|(_, job, read)| (*job, read)), now);
    let (mut ledger, mut fences) =
        if needs.is_empty() { (Ledger::default(), Fences::default()) } else { lock_needs(client, &needs).await? };

    // 3. Decide the jobs read, in order, then write every changed record and charged run.
    let mut writes = RecordColumns::default();
    for (i, job, Read { record, fence, .. }) in pending {
        let (answer, write) = match &job.op {
            Op::Claim(req) => {
                let draw = || fence.or_else(|| fences.next(&req.scope.tenant)).unwrap_or(Fence(0));
                let (outcome, write) = protocol::claim(record, req, now, draw);
                if let ClaimOutcome::Acquired(a) = &outcome
                    && a.fence == Fence(0)
                {
                    return Err(BatchError::Data("ran out of drawn fences".into()));
                }
                let (outcome, write) = ledger.admit(req, now, outcome, write)?;
                (Answer::Claim(outcome), write)
            }
            Op::Mutate { scope, fence, mutation, max_checkpoints } => {
                let finishes = mutation.finishes();
                let (outcome, write) =
                    onceguard_core::control::apply_fenced(record, *fence, mutation.clone(), now, *max_checkpoints);
                if finishes && write.is_some() {
                    finished.push(scope.clone());
                }
                let write = write.map(|write| -> Result<Record, BatchError> {
                    if let Some((id, cost)) = &write.charge {
                        ledger.run(&scope.tenant, id, now)?.add_cost(*cost, now);
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
