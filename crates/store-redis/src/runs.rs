//! Runs, budgets, rollbacks and claim rates on Redis (see the crate documentation for where
//! each lives).

use super::*;
use onceguard_core::rollback::Rollback;

impl RedisStore {
    pub(crate) async fn set_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        let mut conn = self.conn.clone();
        let text = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
        let key = self.keys.run(&RunPlacement::of(tenant, run));
        let mut invocation = SCRIPTS.put_budget.prepare_invoke();
        invocation
            .key(&key)
            .arg(self.clock_arg())
            .arg(tenant.as_str())
            .arg(run.as_str())
            .arg(text(budget.max_effects))
            .arg(text(budget.max_cost))
            .arg(text(budget.deadline.map(|d| d.0)))
            .arg(audit.id.as_str())
            .arg(serde_json::to_string(audit).map_err(corrupt)?);
        let answer: Value = invocation.invoke_async(&mut conn).await.map_err(unavailable("set a budget"))?;
        let flat = strings(answer)?;
        self.deliver_run_audit(&key, &flat).await;
        codec::run(tenant, run, flat)?.ok_or_else(|| corrupt("a budget was set on no run"))
    }

    pub(crate) async fn read_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        let mut conn = self.conn.clone();
        let key = self.keys.run(&RunPlacement::of(tenant, run));
        let answer: Value =
            redis::cmd("HGETALL").arg(&key).query_async(&mut conn).await.map_err(unavailable("get a run"))?;
        let flat = strings(answer)?;
        self.deliver_run_audit(&key, &flat).await;
        codec::run(tenant, run, flat)
    }

    /// Moves the audit entries a budget change left in its run (fields `pa:<id>`, written by
    /// the same script as the budget) to the tenant's log, then out of the run
    /// ([`RedisStore::deliver_audit`]). The budget and its entries are stored already: an entry
    /// that cannot be moved now waits in the run for its next read.
    async fn deliver_run_audit(&self, key: &str, flat: &[Vec<u8>]) {
        let waiting = flat
            .chunks_exact(2)
            .filter(|pair| pair[0].starts_with(b"pa:"))
            .map(|pair| match serde_json::from_slice::<AuditEntry>(&pair[1]) {
                Ok(entry) if entry.id.as_bytes() == &pair[0][3..] => Ok((pair[0].clone(), entry)),
                Ok(_) => Err(corrupt("a run's waiting audit entry is filed under another id")),
                Err(e) => Err(corrupt(e)),
            })
            .collect::<Result<Vec<_>, _>>();
        if let Err(e) = async { self.deliver_audit(key, waiting?).await }.await {
            tracing::warn!(error = %e, "redis: a budget's audit entry waits in its run; moved at the run's next read");
        }
    }

    /// Keeps a run's rollback if it has none, with its audit entry (if any) in the same script
    /// on the tenant's slot; answers whether it wrote.
    pub(crate) async fn write_rollback(
        &self,
        rollback: &Rollback,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError> {
        let tenant = &rollback.tenant;
        let entry = audit.map(serde_json::to_string).transpose().map_err(corrupt)?;
        let mut conn = self.conn.clone();
        let mut invocation = SCRIPTS.insert_rollback.prepare_invoke();
        invocation
            .key(self.keys.rollbacks(tenant))
            .key(self.keys.rollback_runs(tenant))
            .key(self.keys.audit(tenant))
            .key(self.keys.audit_entries(tenant))
            .arg(rollback.run.as_str())
            .arg(serde_json::to_string(rollback).map_err(corrupt)?)
            .arg(audit.map_or("", |a| a.id.as_str()))
            .arg(entry.unwrap_or_default());
        let wrote: i64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("start a rollback"))?;
        Ok(wrote == 1)
    }

    async fn read_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError> {
        let mut conn = self.conn.clone();
        let body: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(self.keys.rollbacks(tenant))
            .arg(run.as_str())
            .query_async(&mut conn)
            .await
            .map_err(unavailable("get a rollback"))?;
        body.map(|b| serde_json::from_slice(&b).map_err(corrupt)).transpose()
    }

    async fn read_rollbacks(
        &self,
        tenant: &TenantId,
        after: Option<&RunId>,
        limit: usize,
    ) -> Result<Page<Rollback>, StoreError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let mut conn = self.conn.clone();
        let from = after.map_or_else(|| "-".to_owned(), |a| format!("({a}"));
        let runs: Vec<String> = redis::cmd("ZRANGEBYLEX")
            .arg(self.keys.rollback_runs(tenant))
            .arg(from)
            .arg("+")
            .arg("LIMIT")
            .arg(0)
            .arg(limit + 1)
            .query_async(&mut conn)
            .await
            .map_err(unavailable("list rollbacks"))?;
        if runs.is_empty() {
            return Ok(Page::default());
        }
        let bodies: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
            .arg(self.keys.rollbacks(tenant))
            .arg(&runs)
            .query_async(&mut conn)
            .await
            .map_err(unavailable("list rollbacks"))?;
        let items = bodies
            .into_iter()
            .map(|body| {
                serde_json::from_slice(&body.ok_or_else(|| corrupt("a listed rollback is missing"))?).map_err(corrupt)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Page::from_overfetch(items, limit))
    }

    /// Cluster: adds a reported cost to a run (on one server the fenced-call script does).
    pub(crate) async fn add_cost(
        &self,
        mut conn: Conn,
        tenant: &TenantId,
        run: &RunId,
        cost: u64,
    ) -> Result<(), StoreError> {
        let mut invocation = SCRIPTS.add_cost.prepare_invoke();
        invocation
            .key(self.keys.run(&RunPlacement::of(tenant, run)))
            .arg(self.clock_arg())
            .arg(tenant.as_str())
            .arg(run.as_str())
            .arg(cost);
        invocation.invoke_async::<i64>(&mut conn).await.map(drop).map_err(unavailable("add a reported cost"))
    }

    /// `control::gcra` in one script on the tenant's slot, at the store's now, with the numbers
    /// it derives from the rate computed here as it does.
    pub(crate) async fn take_from_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
    ) -> Result<Result<(), Duration>, StoreError> {
        let interval = (1_000_000 / u64::from(rate.per_second.max(1))).max(1);
        let tolerance = interval.saturating_mul(u64::from(rate.burst.max(1)));
        let mut conn = self.conn.clone();
        let mut invocation = SCRIPTS.rate.prepare_invoke();
        invocation
            .key(self.keys.rate(tenant))
            .arg(self.clock_arg())
            .arg(interval)
            .arg(tolerance)
            .arg(ms(self.options.expiry_margin));
        let answer: Value =
            invocation.invoke_async(&mut conn).await.map_err(unavailable("take from the claim rate"))?;
        match codec::tagged(strings(answer)?)? {
            (head, _) if head == "ok" => Ok(Ok(())),
            (head, rest) if head == "wait" && rest.len() == 1 => {
                let wait: u64 = rest[0].parse().map_err(|_| corrupt("a rate's wait is not a number"))?;
                Ok(Err(Duration::from_micros(wait)))
            }
            (head, _) => Err(corrupt(format!("unknown rate answer {head:?}"))),
        }
    }
}

#[async_trait]
impl RunStore for RedisStore {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        _now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        self.bounded("set a budget", self.set_budget(tenant, run, budget, audit)).await
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        self.bounded("get a run", self.read_run(tenant, run)).await
    }

    async fn insert_rollback(&self, rollback: &Rollback, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.bounded("start a rollback", self.write_rollback(rollback, Some(audit))).await
    }

    async fn get_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError> {
        self.bounded("get a rollback", self.read_rollback(tenant, run)).await
    }

    async fn list_rollbacks(
        &self,
        tenant: &TenantId,
        after: Option<&RunId>,
        limit: usize,
    ) -> Result<Page<Rollback>, StoreError> {
        self.bounded("list rollbacks", self.read_rollbacks(tenant, after, limit)).await
    }

    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        _now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError> {
        self.bounded("take from the claim rate", self.take_from_rate(tenant, rate)).await
    }
}
