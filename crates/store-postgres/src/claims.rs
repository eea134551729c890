//! The claim path on PostgreSQL: claims and fenced calls are jobs of the group commit (the writers
//! in lib.rs), reads and listings are plain queries, a purge takes the key's lock.

use super::*;

#[async_trait]
impl ClaimStore for PgStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        self.ensure_fences([&req.scope.tenant]).await?;
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

    /// Every claim submitted together to the group commit: one transaction for up to
    /// [`MAX_GROUP`] distinct keys.
    async fn claim_batch(&self, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.ensure_fences(reqs.iter().map(|r| &r.scope.tenant)).await?;
        let ops = reqs.iter().cloned().map(Op::Claim).collect();
        self.submit_all(ops, now)
            .await?
            .into_iter()
            .map(|answer| match answer {
                Answer::Claim(outcome) => Ok(outcome),
                Answer::Mutate(_) => Err(corrupt("a claim was answered as a mutation")),
            })
            .collect()
    }

    /// Every call submitted at once to the group commit, as [`ClaimStore::claim_batch`].
    async fn mutate_batch(
        &self,
        calls: &[onceguard_core::store::FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError> {
        let ops = calls
            .iter()
            .map(|c| Op::Mutate {
                scope: c.scope.clone(),
                fence: c.fence,
                mutation: c.mutation.clone(),
                max_checkpoints,
            })
            .collect();
        self.submit_all(ops, now)
            .await?
            .into_iter()
            .map(|answer| match answer {
                Answer::Mutate(outcome) => Ok(outcome),
                Answer::Claim(_) => Err(corrupt("a mutation was answered as a claim")),
            })
            .collect()
    }

    async fn get(&self, scope: &Scope, _caller_now: Timestamp) -> Result<Option<Record>, StoreError> {
        let client = self.client().await?;
        let st = client
            .prepare_cached(
                "SELECT doc, body FROM og_records
                 WHERE tenant = $1 AND namespace = $2 AND key = $3 AND expires_at > og_now($4)",
            )
            .await
            .map_err(unavailable)?;
        let given = self.writers.clock.given().map(to_i64);
        let row = client
            .query_opt(&st, &[&scope.tenant.as_str(), &scope.namespace.as_str(), &scope.key.as_str(), &given])
            .await
            .map_err(unavailable)?;
        row.map(|row| decode_row(scope.clone(), &row)).transpose().map_err(corrupt)
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, _caller_now: Timestamp) -> Result<Page, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let client = self.client().await?;
        // A listing of one run names it outright, so that the plan reads the run's index
        // (og_records_run) rather than the tenant's records.
        let run = if filter.run.is_some() { "run = $5" } else { "$5::text IS NULL" };
        let st = client
            .prepare_cached(&format!(
                "SELECT doc, body, namespace, key FROM og_records
                 WHERE tenant = $1 AND {run} AND expires_at > og_now($2)
                   AND ($3::text IS NULL OR state = $3)
                   AND (NOT $4 OR (state = 'in_progress' AND (lease_expires_at IS NULL OR lease_expires_at <= og_now($2))))
                   AND ($6::text IS NULL OR namespace = $6 OR starts_with(namespace, $6 || '/'))
                   AND ($7::text IS NULL OR (namespace, key) > ($7::text COLLATE \"C\", $8::text COLLATE \"C\"))
                 ORDER BY namespace, key
                 LIMIT $9",
            ))
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
                    &self.writers.clock.given().map(to_i64),
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
        let records: Vec<Record> = rows
            .iter()
            .map(|row| {
                let (namespace, key): (&str, &str) = (row.get(2), row.get(3));
                let scope = Scope::new(
                    tenant.clone(),
                    Namespace::parse(namespace).map_err(corrupt)?,
                    Key::parse(key).map_err(corrupt)?,
                );
                decode_row(scope, row).map_err(corrupt)
            })
            .collect::<Result<_, _>>()?;
        Ok(Page::from_overfetch(records, limit))
    }

    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError> {
        if new.scope != old.scope {
            return Ok(false);
        }
        let scope = &old.scope;
        // Under the key's lock, as every batch that writes the key.
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(scope)]).await.map_err(unavailable)?;
        let row = tx
            .query_opt(
                "SELECT doc, body FROM og_records WHERE tenant = $1 AND namespace = $2 AND key = $3",
                &[&scope.tenant.as_str(), &scope.namespace.as_str(), &scope.key.as_str()],
            )
            .await
            .map_err(unavailable)?;
        let stored = row.map(|row| decode_row(scope.clone(), &row)).transpose().map_err(corrupt)?;
        if stored.as_ref() != Some(old) {
            return Ok(false);
        }
        let mut columns = RecordColumns::default();
        columns.push(new.clone()).map_err(corrupt)?;
        tx.execute(UPSERT_RECORDS, &columns.as_sql()).await.map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        // What this instance remembers of the key is no longer what is stored.
        self.writers.known.forget(std::iter::once(scope));
        Ok(true)
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        // Under the key's lock, as every batch that reads and writes the key: a batch that read
        // the record before the purge has written it by the time the lock is granted, so the
        // purge deletes what it wrote instead of being undone by it.
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(scope)]).await.map_err(unavailable)?;
        let n = tx
            .execute(
                "DELETE FROM og_records WHERE tenant = $1 AND namespace = $2 AND key = $3",
                &[&scope.tenant.as_str(), &scope.namespace.as_str(), &scope.key.as_str()],
            )
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        self.writers.known.forget(std::iter::once(scope));
        let _ = self.finished.send(scope.clone());
        Ok(n > 0)
    }

    async fn sweep(&self, _caller_now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let client = self.client().await?;
        let n = client
            .execute(
                "DELETE FROM og_records WHERE ctid IN
                   (SELECT ctid FROM og_records WHERE expires_at <= og_now($1) LIMIT $2 FOR UPDATE SKIP LOCKED)",
                &[&self.writers.clock.given().map(to_i64), &i64::try_from(batch).unwrap_or(i64::MAX)],
            )
            .await
            .map_err(unavailable)?;
        usize::try_from(n).map_err(corrupt)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.client().await?.simple_query("SELECT 1").await.map(drop).map_err(unavailable)
    }

    async fn store_time(&self) -> Result<Option<Timestamp>, StoreError> {
        let client = self.client().await?;
        let given = self.writers.clock.given().map(to_i64);
        let row = client.query_one("SELECT og_now($1::bigint)", &[&given]).await.map_err(unavailable)?;
        timestamp(row.get(0)).map(Some)
    }

    fn changes(&self) -> Option<broadcast::Receiver<Scope>> {
        Some(self.changes.subscribe())
    }
}
