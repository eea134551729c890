//! Runs, budgets and claim rates on Redis (see the crate documentation for where each lives).

use super::*;

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

    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        _now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError> {
        self.bounded("take from the claim rate", self.take_from_rate(tenant, rate)).await
    }
}
