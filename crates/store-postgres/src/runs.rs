//! Runs, budgets, rollbacks and claim rates on PostgreSQL (og_runs, og_rollbacks, og_rates).

use super::*;
use crate::control::AUDIT_COLUMNS;
use onceguard_core::rollback::Rollback;

#[async_trait]
impl RunStore for PgStore {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        _caller_now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let now =
            timestamp(tx.query_one("SELECT og_now($1)", &[&self.given_now()]).await.map_err(unavailable)?.get(0))?;
        // The run's lock, as a batch that charges it takes it: read, change, write.
        let lock_run = tx.prepare_cached("SELECT * FROM og_lock_run($1, $2, $3)").await.map_err(unavailable)?;
        let h = class_lock(&[tenant.as_str(), run.as_str()]);
        let row = tx.query_opt(&lock_run, &[&h, &tenant.as_str(), &run.as_str()]).await.map_err(unavailable)?;
        let mut stored = match row {
            Some(row) => decode_run(tenant, run, &row)?,
            None => Run::new(tenant.clone(), run.clone(), now),
        };
        stored.budget = budget.clone();
        stored.updated_at = now;
        let (t, r, b, effects, cost, created, updated) = run_params(&stored).map_err(corrupt)?;
        let upsert_run = tx.prepare_cached(UPSERT_RUN).await.map_err(unavailable)?;
        tx.execute(&upsert_run, &[&t, &r, &b, &effects, &cost, &created, &updated]).await.map_err(unavailable)?;
        // The budget and its audit entry commit together.
        crate::control::insert_audit(&tx, audit).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(stored)
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        let client = self.client().await?;
        let st = client
            .prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM og_runs WHERE tenant = $1 AND run = $2"))
            .await
            .map_err(unavailable)?;
        let row = client.query_opt(&st, &[&tenant.as_str(), &run.as_str()]).await.map_err(unavailable)?;
        row.map(|row| decode_run(tenant, run, &row)).transpose()
    }

    async fn insert_rollback(&self, rollback: &Rollback, audit: &AuditEntry) -> Result<bool, StoreError> {
        let body = serde_json::to_string(rollback).map_err(corrupt)?;
        let (t, i, at, actor, action, entry) = crate::control::audit_params(audit)?;
        // One statement: the entry is written if and only if the rollback was inserted.
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "WITH started AS (
                       INSERT INTO og_rollbacks (tenant, run, body) VALUES ($1, $2, $3)
                       ON CONFLICT (tenant, run) DO NOTHING RETURNING 1),
                     entry AS (
                       INSERT INTO og_audit ({AUDIT_COLUMNS}) SELECT $4::text, $5::text, $6::bigint, $7::text, $8::text, $9::text FROM started
                       ON CONFLICT (tenant, id) DO NOTHING)
                     SELECT 1 FROM started"
                ),
                &[&rollback.tenant.as_str(), &rollback.run.as_str(), &body, &t, &i, &at, &actor, &action, &entry],
            )
            .await
            .map_err(unavailable)?;
        Ok(row.is_some())
    }

    async fn get_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError> {
        let client = self.client().await?;
        let st = client
            .prepare_cached("SELECT body FROM og_rollbacks WHERE tenant = $1 AND run = $2")
            .await
            .map_err(unavailable)?;
        let row = client.query_opt(&st, &[&tenant.as_str(), &run.as_str()]).await.map_err(unavailable)?;
        row.map(|row| serde_json::from_str(row.get(0)).map_err(corrupt)).transpose()
    }

    async fn list_rollbacks(
        &self,
        tenant: &TenantId,
        after: Option<&RunId>,
        limit: usize,
    ) -> Result<Page<Rollback>, StoreError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let client = self.client().await?;
        let st = client
            .prepare_cached("SELECT body FROM og_rollbacks WHERE tenant = $1 AND run > $2 ORDER BY run LIMIT $3")
            .await
            .map_err(unavailable)?;
        let after = after.map_or("", |a| a.as_str());
        let rows = client
            .query(&st, &[&tenant.as_str(), &after, &i64::try_from(limit + 1).map_err(corrupt)?])
            .await
            .map_err(unavailable)?;
        let items =
            rows.iter().map(|row| serde_json::from_str(row.get(0)).map_err(corrupt)).collect::<Result<_, _>>()?;
        Ok(Page::from_overfetch(items, limit))
    }

    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        _caller_now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        // Reads the tenant's theoretical arrival time with its row locked (created at 0, which
        // `gcra` reads as never stored), so that concurrent takes queue up on it.
        let take = tx
            .prepare_cached(
                "INSERT INTO og_rates (tenant, tat_us) VALUES ($1, 0)
                 ON CONFLICT (tenant) DO UPDATE SET tat_us = og_rates.tat_us
                 RETURNING tat_us, og_now($2)",
            )
            .await
            .map_err(unavailable)?;
        let row = tx.query_one(&take, &[&tenant.as_str(), &self.given_now()]).await.map_err(unavailable)?;
        let tat = u64::try_from(row.get::<_, i64>(0)).map_err(corrupt)?;
        let now = timestamp(row.get(1))?;
        match onceguard_core::control::gcra(Some(tat), now, rate) {
            Ok(next) => {
                tx.execute("UPDATE og_rates SET tat_us = $2 WHERE tenant = $1", &[&tenant.as_str(), &to_sql_u64(next)])
                    .await
                    .map_err(unavailable)?;
                tx.commit().await.map_err(unavailable)?;
                Ok(Ok(()))
            }
            Err(wait) => {
                tx.rollback().await.map_err(unavailable)?;
                Ok(Err(wait))
            }
        }
    }
}
