//! The claim path on SQLite: each claim and fenced call is a job of the writer's group commit
//! (a batch of them is one job: one transaction, each call in a savepoint of its own); reads use
//! the reading connection.

use std::collections::{HashMap, HashSet};

use onceguard_core::protocol::answer_without_write;
use onceguard_core::store::{ClaimSection, FencedCall, claim_in};

use super::*;
use crate::runs::{run_or_new, save_run};

/// A SQLite store's atomic section for the claim transaction ([`claim_in`]): the caller's job
/// in the writer's group commit, or one claim of a batch's job.
struct Section<'c> {
    conn: &'c Connection,
    /// In a batch's job, the fences it draws, counted here and stored once at its end; else
    /// each fence is drawn from the stored counter, and a denial rolls the job back.
    counter: Option<FenceCounter>,
    /// The key's record, read by the job before its savepoint: the section's first load.
    preloaded: Option<Option<Record>>,
}

/// The fences a batch's job has drawn so far, per tenant.
#[derive(Default)]
struct FenceCounter {
    /// Each tenant's counter as stored, and the last fence drawn for it.
    tenants: HashMap<TenantId, (u64, u64)>,
    /// The tenant the claim being decided drew a fence for (a denial gives it back).
    drawn_now: Option<TenantId>,
}

impl<'c> Section<'c> {
    /// The whole job.
    fn job(conn: &'c Connection) -> Self {
        Self { conn, counter: None, preloaded: None }
    }

    /// The whole job, for a key the job found without a record.
    fn new_key(conn: &'c Connection) -> Self {
        Self { conn, counter: None, preloaded: Some(None) }
    }
}

/// The claims of a batch in one job, one after the other. Only an admission writes (a denial
/// happens before any write but the fence's), so no claim needs a savepoint of its own: the
/// fences are counted in memory from the stored counter, a denied claim gives its fence back,
/// and the counter is stored once, at the end.
fn claim_batch_in(conn: &Connection, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
    let mut section = Section { conn, counter: Some(FenceCounter::default()), preloaded: None };
    let mut outcomes = Vec::with_capacity(reqs.len());
    for req in reqs {
        if let Some(counter) = &mut section.counter {
            counter.drawn_now = None;
        }
        outcomes.push(claim_in(&mut section, req, now)?);
    }
    for (tenant, (stored, last)) in section.counter.map(|c| c.tenants).unwrap_or_default() {
        if last != stored {
            store_fence(conn, &tenant, last)?;
        }
    }
    Ok(outcomes)
}

/// A fenced call: [`onceguard_core::control::apply_fenced`], its write and the reported cost
/// added to the record's run. The record alone, written over the one read (so its namespace is
/// there), is one statement, which writes whole or not at all; a write of more statements goes
/// in a savepoint, so that a call that fails leaves nothing behind.
fn mutate_in(
    conn: &Connection,
    scope: &Scope,
    fence: Fence,
    mutation: Mutation,
    now: Timestamp,
    max_checkpoints: usize,
) -> Result<FencedOutcome, StoreError> {
    let existing = load(conn, scope)?;
    let had_record = existing.is_some();
    let (outcome, write) = onceguard_core::control::apply_fenced(existing, fence, mutation, now, max_checkpoints);
    match write {
        None => {}
        Some(write) if had_record && write.charge.is_none() => save(conn, write.record)?,
        Some(write) => in_savepoint(conn, |conn| {
            if let Some((id, cost)) = &write.charge {
                let mut run = run_or_new(conn, &scope.tenant, id, now)?;
                run.add_cost(*cost, now);
                save_run(conn, &run)?;
            }
            save(conn, write.record)
        })?,
    }
    Ok(outcome)
}

impl ClaimSection for Section<'_> {
    fn load(&mut self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        match self.preloaded.take() {
            Some(record) => Ok(record),
            None => load(self.conn, scope),
        }
    }

    fn next_fence(&mut self, tenant: &TenantId) -> Result<Fence, StoreError> {
        match &mut self.counter {
            Some(counter) => {
                let (_, last) = match counter.tenants.entry(tenant.clone()) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        let stored = current_fence(self.conn, tenant)?;
                        e.insert((stored, stored))
                    }
                };
                *last += 1;
                let fence = Fence(*last);
                counter.drawn_now = Some(tenant.clone());
                Ok(fence)
            }
            None => next_fence(self.conn, tenant),
        }
    }

    fn leases_held(&mut self, tenant: &TenantId, now: Timestamp) -> Result<u64, StoreError> {
        count_in_flight(self.conn, tenant, now)
    }

    fn run(&mut self, tenant: &TenantId, id: &RunId, now: Timestamp) -> Result<Run, StoreError> {
        run_or_new(self.conn, tenant, id, now)
    }

    fn save_run(&mut self, run: Run) -> Result<(), StoreError> {
        save_run(self.conn, &run)
    }

    fn save(&mut self, record: Record) -> Result<(), StoreError> {
        save(self.conn, record)
    }

    /// Undoes the claim: not even the fence drawn for the denied claim is kept (in a batch,
    /// the only thing it changed).
    fn discard(&mut self) -> Result<(), StoreError> {
        match &mut self.counter {
            Some(counter) => {
                if let Some(tenant) = counter.drawn_now.take()
                    && let Some((_, last)) = counter.tenants.get_mut(&tenant)
                {
                    *last -= 1;
                }
                Ok(())
            }
            None => run(self.conn, "ROLLBACK TO job"),
        }
    }
}

fn count_in_flight(conn: &Connection, tenant: &TenantId, now: Timestamp) -> Result<u64, StoreError> {
    let n: i64 = conn
        .prepare_cached(COUNT_IN_FLIGHT)
        .and_then(|mut st| st.query_row(params![tenant.as_str(), to_i64(now)], |r| r.get(0)))
        .map_err(unavailable)?;
    from_sql_u64(n)
}

#[async_trait]
impl ClaimStore for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    /// A job of the writer. It reads the key's record first: a claim that writes nothing (a
    /// replay, a holder in flight, a mismatch; [`answer_without_write`]) is answered from it
    /// without a savepoint; the others decide in one, on the record read. (Answering from the
    /// reading connection first, as a batch does, was measured slower: see
    /// docs/PERFORMANCE.md.)
    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        let req = req.clone();
        self.write_unguarded(move |conn| {
            let existing = load(conn, &req.scope)?;
            if existing.is_none() {
                return in_savepoint(conn, |conn| claim_in(&mut Section::new_key(conn), &req, now));
            }
            if let Some(answer) = answer_without_write(existing, &req, now) {
                return Ok(answer);
            }
            // Rare (a recovery, a retry after a failure): the section reads the record again.
            in_savepoint(conn, |conn| claim_in(&mut Section::job(conn), &req, now))
        })
        .await
    }

    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        let scope = scope.clone();
        self.write_unguarded(move |conn| mutate_in(conn, &scope, fence, mutation, now, max_checkpoints)).await
    }

    /// The claims that write nothing (a replay, a holder in flight, a mismatch;
    /// [`answer_without_write`]) answered from one read on the reading connection, without
    /// waiting for the writer's next commit; the others in one job of the group commit: one
    /// transaction, which decides them again on the records as they are then. (A key given twice goes to the
    /// job if its first claim does, so that the second sees the first.)
    async fn claim_batch(&self, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
        let read = reqs.to_vec();
        let mut answers: Vec<Option<ClaimOutcome>> = self
            .read(move |conn| {
                let mut writing: HashSet<&Scope> = HashSet::new();
                read.iter()
                    .map(|req| {
                        if writing.contains(&req.scope) {
                            return Ok(None);
                        }
                        let answer = answer_without_write(load(conn, &req.scope)?, req, now);
                        if answer.is_none() {
                            writing.insert(&req.scope);
                        }
                        Ok(answer)
                    })
                    .collect::<Result<_, StoreError>>()
            })
            .await?;
        let to_write: Vec<ClaimRequest> =
            reqs.iter().zip(&answers).filter(|(_, a)| a.is_none()).map(|(r, _)| r.clone()).collect();
        if !to_write.is_empty() {
            let mut written = self.write(move |conn| claim_batch_in(conn, &to_write, now)).await?.into_iter();
            for answer in answers.iter_mut().filter(|a| a.is_none()) {
                *answer = written.next();
            }
        }
        answers.into_iter().map(|a| a.ok_or_else(|| corrupt("a claim of the batch was not answered"))).collect()
    }

    /// One job of the group commit: one transaction.
    async fn mutate_batch(
        &self,
        calls: &[FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError> {
        let calls = calls.to_vec();
        self.write(move |conn| {
            calls.into_iter().map(|c| mutate_in(conn, &c.scope, c.fence, c.mutation, now, max_checkpoints)).collect()
        })
        .await
    }

    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let scope = scope.clone();
        self.read(move |conn| Ok(load(conn, &scope)?.filter(|r| r.is_live(now)))).await
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError> {
        let tenant = tenant.clone();
        let filter = filter.clone();
        self.read(move |conn| {
            let limit = filter.limit.clamp(1, MAX_PAGE);
            let prefix = filter.namespace_prefix.as_ref().map(|p| p.as_str().to_owned());
            let (after_ns, after_key) = match &filter.after {
                Some((ns, key)) => (Some(ns.as_str().to_owned()), Some(key.as_str().to_owned())),
                None => (None, None),
            };
            let sql = list_sql(filter.run.is_some());
            let mut st = conn.prepare_cached(&sql).map_err(unavailable)?;
            let rows = st
                .query_map(
                    params![
                        tenant.as_str(),
                        to_i64(now),
                        filter.state.map(|s| s.as_str()),
                        filter.stuck,
                        filter.run.as_ref().map(|r| r.as_str()),
                        prefix,
                        after_ns,
                        after_key,
                        i64::try_from(limit + 1).unwrap_or(i64::MAX),
                    ],
                    row_parts,
                )
                .map_err(unavailable)?;
            let mut records = Vec::with_capacity(limit + 1);
            for row in rows {
                records.push(decode(row.map_err(unavailable)?)?);
            }
            Ok(Page::from_overfetch(records, limit))
        })
        .await
    }

    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError> {
        let (old, new) = (old.clone(), new.clone());
        self.write(move |conn| {
            if new.scope != old.scope || load(conn, &old.scope)?.as_ref() != Some(&old) {
                return Ok(false);
            }
            save(conn, new)?;
            Ok(true)
        })
        .await
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        let scope = scope.clone();
        self.write(move |conn| {
            let ns: Option<i64> = conn
                .query_row(
                    "DELETE FROM records
                     WHERE tenant = ?1 AND ns = (SELECT id FROM namespaces WHERE tenant = ?1 AND name = ?2) AND key = ?3
                     RETURNING ns",
                    params![scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(unavailable)?;
            forget_empty_namespaces(conn, ns)?;
            Ok(ns.is_some())
        })
        .await
    }

    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.write(move |conn| {
            let mut st = conn
                .prepare_cached(
                    "DELETE FROM records WHERE (tenant, ns, key) IN
                       (SELECT tenant, ns, key FROM records WHERE expires_at <= ?1 LIMIT ?2)
                     RETURNING ns",
                )
                .map_err(unavailable)?;
            let swept = st
                .query_map(params![to_i64(now), i64::try_from(batch).unwrap_or(i64::MAX)], |r| r.get::<_, i64>(0))
                .map_err(unavailable)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(unavailable)?;
            let namespaces: HashSet<i64> = swept.iter().copied().collect();
            forget_empty_namespaces(conn, namespaces)?;
            Ok(swept.len())
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.read(|conn| {
            conn.query_row("SELECT value FROM meta WHERE name = 'fence_floor'", [], |r| r.get::<_, i64>(0))
                .map(drop)
                .map_err(unavailable)
        })
        .await
    }
}

/// The listing's query: `?1` tenant, `?2` now, `?3` state, `?4` stuck, `?5` run, `?6` namespace
/// prefix, `?7` and `?8` the cursor, `?9` how many. In order of namespace name and key: the
/// tenant's namespaces by name (from the cursor's on), and the records of each by key. A
/// listing of one run reads the run's index (`records_run`) instead, and sorts the run's
/// records: its cost grows with the run, not with the tenant.
pub(crate) fn list_sql(by_run: bool) -> String {
    let from = if by_run {
        "records r INDEXED BY records_run JOIN namespaces n ON n.id = r.ns"
    } else {
        "namespaces n CROSS JOIN records r ON r.tenant = n.tenant AND r.ns = n.id"
    };
    let run = if by_run { "r.run = ?5" } else { "?5 IS NULL" };
    format!(
        "SELECT {RECORD_COLUMNS} FROM {from}
         WHERE n.tenant = ?1 AND r.tenant = ?1 AND {run} AND r.expires_at > ?2
           AND (?3 IS NULL OR r.state = ?3)
           AND (?4 = 0 OR (r.state = 'in_progress' AND r.lease_expires_at <= ?2))
           AND (?6 IS NULL OR n.name = ?6 OR substr(n.name, 1, length(?6) + 1) = ?6 || '/')
           AND (?7 IS NULL OR n.name >= ?7)
           AND (?7 IS NULL OR (n.name, r.key) > (?7, ?8))
         ORDER BY n.name, r.key
         LIMIT ?9"
    )
}
