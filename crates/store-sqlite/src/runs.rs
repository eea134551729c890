//! Runs, budgets, rollbacks and claim rates on SQLite (the tables runs, rollbacks and rates).

use super::*;
use onceguard_core::rollback::Rollback;

type RunRow = (String, String, String, i64, i64, i64, i64);

pub(crate) fn run_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<RunRow> {
    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?, row.get(5)?, row.get(6)?))
}

pub(crate) fn decode_run(
    (tenant, run, budget, effects, cost, created_at, updated_at): RunRow,
) -> Result<Run, StoreError> {
    Ok(Run {
        tenant: TenantId::parse(&tenant).map_err(corrupt)?,
        run: RunId::parse(&run).map_err(corrupt)?,
        budget: serde_json::from_str::<Budget>(&budget).map_err(corrupt)?,
        usage: RunUsage { effects: from_sql_u64(effects)?, cost: from_sql_u64(cost)? },
        created_at: Timestamp(from_sql_u64(created_at)?),
        updated_at: Timestamp(from_sql_u64(updated_at)?),
    })
}

pub(crate) fn load_run(conn: &Connection, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
    conn.prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE tenant = ?1 AND run = ?2"))
        .and_then(|mut st| st.query_row(params![tenant.as_str(), run.as_str()], run_from_row).optional())
        .map_err(unavailable)?
        .map(decode_run)
        .transpose()
}

/// Writes a run whole (only the writer thread writes runs, inside the job that read it).
pub(crate) fn save_run(conn: &Connection, run: &Run) -> Result<(), StoreError> {
    let budget = serde_json::to_string(&run.budget).map_err(corrupt)?;
    conn.prepare_cached(&format!(
        "INSERT INTO runs ({RUN_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
         ON CONFLICT (tenant, run) DO UPDATE SET
           budget = excluded.budget, effects = excluded.effects, cost = excluded.cost,
           updated_at = excluded.updated_at"
    ))
    .and_then(|mut st| {
        st.execute(params![
            run.tenant.as_str(),
            run.run.as_str(),
            budget,
            to_sql_u64(run.usage.effects),
            to_sql_u64(run.usage.cost),
            to_i64(run.created_at),
            to_i64(run.updated_at),
        ])
    })
    .map_err(unavailable)?;
    Ok(())
}

/// The run `id` of `tenant` as stored, or a new one seen at `now`.
pub(crate) fn run_or_new(conn: &Connection, tenant: &TenantId, id: &RunId, now: Timestamp) -> Result<Run, StoreError> {
    Ok(load_run(conn, tenant, id)?.unwrap_or_else(|| Run::new(tenant.clone(), id.clone(), now)))
}

#[async_trait]
impl RunStore for SqliteStore {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        let (tenant, id, budget, audit) = (tenant.clone(), run.clone(), budget.clone(), audit.clone());
        self.write(move |conn| {
            let mut run = run_or_new(conn, &tenant, &id, now)?;
            run.budget = budget;
            run.updated_at = now;
            save_run(conn, &run)?;
            crate::control::insert_audit(conn, &audit)?;
            Ok(run)
        })
        .await
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        let (tenant, run) = (tenant.clone(), run.clone());
        self.read(move |conn| load_run(conn, &tenant, &run)).await
    }

    async fn insert_rollback(&self, rollback: &Rollback, audit: &AuditEntry) -> Result<bool, StoreError> {
        let body = serde_json::to_string(rollback).map_err(corrupt)?;
        let (tenant, run, audit) = (rollback.tenant.clone(), rollback.run.clone(), audit.clone());
        self.write(move |conn| {
            let inserted = conn
                .prepare_cached(
                    "INSERT INTO rollbacks (tenant, run, body) VALUES (?1, ?2, ?3) ON CONFLICT (tenant, run) DO NOTHING",
                )
                .and_then(|mut st| st.execute(params![tenant.as_str(), run.as_str(), body]))
                .map_err(unavailable)?;
            if inserted == 1 {
                crate::control::insert_audit(conn, &audit)?;
            }
            Ok(inserted == 1)
        })
        .await
    }

    async fn get_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError> {
        let (tenant, run) = (tenant.clone(), run.clone());
        self.read(move |conn| {
            conn.prepare_cached("SELECT body FROM rollbacks WHERE tenant = ?1 AND run = ?2")
                .and_then(|mut st| {
                    st.query_row(params![tenant.as_str(), run.as_str()], |r| r.get::<_, String>(0)).optional()
                })
                .map_err(unavailable)?
                .map(|body| serde_json::from_str(&body).map_err(corrupt))
                .transpose()
        })
        .await
    }

    async fn list_rollbacks(
        &self,
        tenant: &TenantId,
        after: Option<&RunId>,
        limit: usize,
    ) -> Result<Page<Rollback>, StoreError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let (tenant, after) = (tenant.clone(), after.map(|a| a.as_str().to_owned()).unwrap_or_default());
        self.read(move |conn| {
            let mut st = conn
                .prepare_cached("SELECT body FROM rollbacks WHERE tenant = ?1 AND run > ?2 ORDER BY run LIMIT ?3")
                .map_err(unavailable)?;
            let rows = st
                .query_map(params![tenant.as_str(), after, limit as i64 + 1], |r| r.get::<_, String>(0))
                .map_err(unavailable)?;
            let items = rows
                .map(|body| serde_json::from_str(&body.map_err(unavailable)?).map_err(corrupt))
                .collect::<Result<Vec<_>, StoreError>>()?;
            Ok(Page::from_overfetch(items, limit))
        })
        .await
    }

    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError> {
        let (tenant, rate) = (tenant.clone(), *rate);
        self.write(move |conn| {
            let tat: Option<i64> = conn
                .prepare_cached("SELECT tat_us FROM rates WHERE tenant = ?1")
                .and_then(|mut st| st.query_row([tenant.as_str()], |r| r.get(0)).optional())
                .map_err(unavailable)?;
            let next = match onceguard_core::control::gcra(tat.map(from_sql_u64).transpose()?, now, &rate) {
                Ok(next) => next,
                Err(wait) => return Ok(Err(wait)),
            };
            conn.prepare_cached(
                "INSERT INTO rates (tenant, tat_us) VALUES (?1, ?2)
                 ON CONFLICT (tenant) DO UPDATE SET tat_us = excluded.tat_us",
            )
            .and_then(|mut st| st.execute(params![tenant.as_str(), to_sql_u64(next)]))
            .map_err(unavailable)?;
            Ok(Ok(()))
        })
        .await
    }
}
