//! Operator actions on the guard: tenants and API keys, kill switches, run budgets, settings and
//! the audit log. Each action is written to the audit log with who did it and why; the HTTP API
//! and the CLI call these, never the store. Also the cache of control
//! documents (switches, settings) that every claim consults.
//!
//! Every instance refreshes its cache from the store every [`CONTROL_REFRESH`], and a claim
//! never decides on a cache whose read began [`CONTROL_MAX_AGE`] (one second) ago or more: it
//! reads the store first, and fails closed ("store unavailable") if it cannot. So a switch
//! engaged through any instance refuses claims on every instance within one second (the
//! instance that engaged it, at once).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::auth::{ApiKey, ApiKeyId, NewApiKey, Role, Tenant};
use crate::control::{
    AuditEntry, AuditFilter, AuditPage, Budget, ControlDoc, ControlKind, Controls, Run, SettingsEntry, Switch,
    SwitchTarget,
};
use crate::domain::{InvalidInput, Namespace, RunId, TenantId};
use crate::guard::{Guard, GuardError};
use crate::store::StoreError;

/// How often each instance re-reads switches and settings from the store.
pub const CONTROL_REFRESH: Duration = Duration::from_millis(250);

/// How old the cached switches and settings may grow before a claim reads them from the store
/// itself (failing closed if it cannot): the contract's "within one second on every instance".
pub const CONTROL_MAX_AGE: Duration = Duration::from_secs(1);

/// Longest reason or explanation an operator may give, in bytes.
pub const MAX_REASON_BYTES: usize = 1_024;

/// Longest label of an API key, in bytes.
pub const MAX_LABEL_BYTES: usize = 128;

/// The switches and settings last read from the store, and when. Every claim reads it, so the
/// read takes no lock.
#[derive(Debug, Default)]
pub(crate) struct ControlCache {
    current: ArcSwapOption<Cached>,
    refreshing: Mutex<()>,
}

#[derive(Debug)]
struct Cached {
    controls: Arc<Controls>,
    /// When the store read began: what was read is at least this fresh.
    read_at: Instant,
}

impl ControlCache {
    /// The cached switches and settings, unless they are older than [`CONTROL_MAX_AGE`].
    fn fresh(&self) -> Option<Arc<Controls>> {
        let current = self.current.load();
        current.as_ref().filter(|c| c.read_at.elapsed() < CONTROL_MAX_AGE).map(|c| c.controls.clone())
    }

    /// Caches `read` unless the cache holds a read that began later: a slow read (the
    /// background refresh's) must not put back what a later one (after a switch was engaged)
    /// replaced. Answers the switches and settings the cache then holds.
    fn offer(&self, read: Cached) -> Arc<Controls> {
        let read = Arc::new(read);
        let kept = |current: &Option<Arc<Cached>>| match current {
            Some(current) if current.read_at > read.read_at => current.clone(),
            _ => read.clone(),
        };
        let before = self.current.rcu(|current| Some(kept(current)));
        kept(&before).controls.clone()
    }
}

fn check_reason(field: &'static str, text: &str) -> Result<(), InvalidInput> {
    if text.trim().is_empty() || text.len() > MAX_REASON_BYTES {
        return Err(InvalidInput::new(field, format!("must be 1 to {MAX_REASON_BYTES} bytes, not blank")));
    }
    Ok(())
}

fn check_why(why: Option<&str>) -> Result<(), InvalidInput> {
    why.map_or(Ok(()), |w| check_reason("why", w))
}

impl Guard {
    /// The switches and settings in force: the cached ones if fresh, else read now.
    pub(crate) async fn controls(&self) -> Result<Arc<Controls>, GuardError> {
        if let Some(controls) = self.controls.fresh() {
            return Ok(controls);
        }
        let _one_at_a_time = self.controls.refreshing.lock().await;
        if let Some(controls) = self.controls.fresh() {
            return Ok(controls);
        }
        self.refresh_controls().await
    }

    /// Reads switches and settings from the store into the cache.
    pub async fn refresh_controls(&self) -> Result<Arc<Controls>, GuardError> {
        let read_at = Instant::now();
        let docs = self.store().list_control().await?;
        let controls = Arc::new(Controls::decode(&docs).map_err(StoreError::Corrupt)?);
        Ok(self.controls.offer(Cached { controls, read_at }))
    }

    /// A task that refreshes the cached switches and settings every [`CONTROL_REFRESH`]. The
    /// caller owns it and stops it at shutdown.
    pub fn refresh_controls_task(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let guard = self.clone();
        async move {
            let mut tick = tokio::time::interval(CONTROL_REFRESH);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(error) = guard.refresh_controls().await {
                    tracing::warn!(%error, "could not refresh switches and settings");
                }
            }
        }
    }

    /// Appends an entry to the audit log.
    pub async fn audit(&self, entry: AuditEntry) -> Result<(), GuardError> {
        Ok(self.store().append_audit(&entry).await?)
    }

    /// Creates a tenant (audited as `tenant.create` in it); answers `None` if it existed (and
    /// changes nothing).
    pub async fn create_tenant(&self, actor: &str, id: &TenantId) -> Result<Option<Tenant>, GuardError> {
        let tenant = Tenant { id: id.clone(), created_at: self.clock().now() };
        if !self.store().create_tenant(&tenant).await? {
            return Ok(None);
        }
        self.audit(AuditEntry::new(id.clone(), tenant.created_at, actor, "tenant.create", id.as_str())).await?;
        Ok(Some(tenant))
    }

    /// One tenant.
    pub async fn tenant(&self, id: &TenantId) -> Result<Option<Tenant>, GuardError> {
        Ok(self.store().get_tenant(id).await?)
    }

    /// All tenants, by id.
    pub async fn tenants(&self) -> Result<Vec<Tenant>, GuardError> {
        Ok(self.store().list_tenants().await?)
    }

    /// Creates an API key in `tenant` (audited as `api_key.create`, with its role and label,
    /// never its secret); answers `None` if there is no such tenant. The token is in the answer
    /// only: the store keeps its hash.
    pub async fn create_api_key(
        &self,
        actor: &str,
        tenant: &TenantId,
        role: Role,
        label: &str,
    ) -> Result<Option<NewApiKey>, GuardError> {
        if label.len() > MAX_LABEL_BYTES {
            return Err(InvalidInput::new("label", format!("at most {MAX_LABEL_BYTES} bytes")).into());
        }
        if self.store().get_tenant(tenant).await?.is_none() {
            return Ok(None);
        }
        let new = ApiKey::generate(tenant.clone(), role, label, self.clock().now());
        self.store().create_api_key(&new.key).await?;
        let entry = AuditEntry::new(tenant.clone(), new.key.created_at, actor, "api_key.create", new.key.id.as_str())
            .details(serde_json::json!({ "role": role.as_str(), "label": label }));
        self.audit(entry).await?;
        Ok(Some(new))
    }

    /// A tenant's API keys, newest first (never their secrets).
    pub async fn api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, GuardError> {
        Ok(self.store().list_api_keys(tenant).await?)
    }

    /// Revokes one of a tenant's API keys (audited as `api_key.revoke`); answers whether it
    /// existed in that tenant.
    pub async fn revoke_api_key(&self, actor: &str, tenant: &TenantId, id: &ApiKeyId) -> Result<bool, GuardError> {
        let now = self.clock().now();
        if !self.store().revoke_api_key(tenant, id, now).await? {
            return Ok(false);
        }
        self.audit(AuditEntry::new(tenant.clone(), now, actor, "api_key.revoke", id.as_str())).await?;
        Ok(true)
    }

    /// A tenant's audit log, newest first.
    pub async fn audit_log(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<AuditPage, GuardError> {
        Ok(self.store().list_audit(tenant, filter).await?)
    }

    /// Engages a kill switch: from now on claims it covers are refused, on this instance at once
    /// and on every other within [`CONTROL_MAX_AGE`]. With `revoke_leases`, the live leases it covers are revoked in the
    /// store: their holders' completions are refused as stale, and the keys recover (with their
    /// last checkpoint) once the switch is released. The call then waits [`CONTROL_MAX_AGE`] and
    /// revokes again, to catch keys that instances acquired before they saw the switch: when it
    /// returns, no covered lease is live anywhere. Engaging an engaged switch replaces its reason.
    pub async fn engage_switch(
        &self,
        actor: &str,
        tenant: &TenantId,
        target: SwitchTarget,
        reason: String,
        revoke_leases: bool,
    ) -> Result<Switch, GuardError> {
        check_reason("reason", &reason)?;
        let now = self.clock().now();
        let mut switch = Switch {
            tenant: tenant.clone(),
            target,
            reason,
            revoke_leases,
            revoked: 0,
            engaged_by: actor.to_owned(),
            engaged_at: now,
        };
        // The switch first, so that no claim acquires behind the revocation; this instance's
        // claims (waiting ones included) see it at once.
        self.store().put_control(&ControlDoc::of_switch(&switch)).await?;
        self.refresh_controls().await?;
        if revoke_leases {
            let detail = format!("leases revoked by the switch on {}: {}", switch.target, switch.reason);
            switch.revoked = self.store().revoke_leases(tenant, &switch.target, &detail, now).await?;
            // Other instances may acquire covered keys until they see the switch (at most
            // CONTROL_MAX_AGE, after which an instance that could not read it fails closed):
            // a second pass then revokes those too.
            // (Unless the switch was released or engaged anew meanwhile.)
            tokio::time::sleep(CONTROL_MAX_AGE + CONTROL_REFRESH).await;
            let controls = self.refresh_controls().await?;
            if controls
                .switches
                .iter()
                .any(|s| s.tenant == switch.tenant && s.target == switch.target && s.engaged_at == now)
            {
                let later = self.clock().now();
                switch.revoked += self.store().revoke_leases(tenant, &switch.target, &detail, later).await?;
                self.store().put_control(&ControlDoc::of_switch(&switch)).await?;
            }
        }
        let entry = AuditEntry::new(tenant.clone(), now, actor, "switch.engage", switch.target.id())
            .why(Some(switch.reason.clone()))
            .details(serde_json::json!({ "revoke_leases": revoke_leases, "revoked": switch.revoked }));
        self.audit(entry).await?;
        self.refresh_controls().await?;
        Ok(switch)
    }

    /// Releases a kill switch; answers it, or `None` if none was engaged on `target`.
    pub async fn release_switch(
        &self,
        actor: &str,
        tenant: &TenantId,
        target: &SwitchTarget,
        why: Option<String>,
    ) -> Result<Option<Switch>, GuardError> {
        check_why(why.as_deref())?;
        let Some(doc) = self.store().delete_control(ControlKind::Switch, tenant, &target.id()).await? else {
            return Ok(None);
        };
        let switch: Switch = serde_json::from_str(&doc.body).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let entry = AuditEntry::new(tenant.clone(), self.clock().now(), actor, "switch.release", target.id()).why(why);
        self.audit(entry).await?;
        self.refresh_controls().await?;
        Ok(Some(switch))
    }

    /// A tenant's engaged switches, read from the store.
    pub async fn switches(&self, tenant: &TenantId) -> Result<Vec<Switch>, GuardError> {
        let controls = self.refresh_controls().await?;
        Ok(controls.switches.iter().filter(|s| &s.tenant == tenant).cloned().collect())
    }

    /// Sets a run's budget (it keeps what it spent).
    pub async fn set_budget(
        &self,
        actor: &str,
        tenant: &TenantId,
        run: &RunId,
        budget: Budget,
        why: Option<String>,
    ) -> Result<Run, GuardError> {
        check_why(why.as_deref())?;
        let now = self.clock().now();
        let stored = self.store().put_budget(tenant, run, &budget, now).await?;
        let details = serde_json::to_value(&budget).unwrap_or_default();
        let entry = AuditEntry::new(tenant.clone(), now, actor, "budget.set", run.as_str()).why(why).details(details);
        self.audit(entry).await?;
        Ok(stored)
    }

    /// One run of a tenant.
    pub async fn run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, GuardError> {
        Ok(self.store().get_run(tenant, run).await?)
    }

    /// Sets the settings of a tenant or of a namespace prefix in it (replacing earlier ones).
    pub async fn put_settings(
        &self,
        mut entry: SettingsEntry,
        why: Option<String>,
    ) -> Result<SettingsEntry, GuardError> {
        check_why(why.as_deref())?;
        entry.validate(self.limits())?;
        entry.updated_at = self.clock().now();
        self.store().put_control(&ControlDoc::of_settings(&entry)).await?;
        let target = entry.namespace_prefix.as_ref().map_or_else(|| "tenant".to_owned(), |p| format!("namespace:{p}"));
        let details = serde_json::to_value(&entry.settings).unwrap_or_default();
        let audit = AuditEntry::new(entry.tenant.clone(), entry.updated_at, &entry.updated_by, "settings.set", target)
            .why(why)
            .details(details);
        self.audit(audit).await?;
        self.refresh_controls().await?;
        Ok(entry)
    }

    /// Deletes the settings of a tenant (`prefix` absent) or a namespace prefix; answers them if
    /// there were any.
    pub async fn delete_settings(
        &self,
        actor: &str,
        tenant: &TenantId,
        prefix: Option<&Namespace>,
        why: Option<String>,
    ) -> Result<Option<SettingsEntry>, GuardError> {
        check_why(why.as_deref())?;
        let id = prefix.map(|p| p.as_str().to_owned()).unwrap_or_default();
        let Some(doc) = self.store().delete_control(ControlKind::Settings, tenant, &id).await? else {
            return Ok(None);
        };
        let entry: SettingsEntry = serde_json::from_str(&doc.body).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let target = prefix.map_or_else(|| "tenant".to_owned(), |p| format!("namespace:{p}"));
        let audit = AuditEntry::new(tenant.clone(), self.clock().now(), actor, "settings.delete", target).why(why);
        self.audit(audit).await?;
        self.refresh_controls().await?;
        Ok(Some(entry))
    }

    /// A tenant's settings entries, the tenant's first, then by namespace prefix.
    pub async fn settings(&self, tenant: &TenantId) -> Result<Vec<SettingsEntry>, GuardError> {
        let controls = self.refresh_controls().await?;
        let mut entries: Vec<SettingsEntry> =
            controls.settings.iter().filter(|e| &e.tenant == tenant).cloned().collect();
        entries.sort_by(|a, b| a.namespace_prefix.cmp(&b.namespace_prefix));
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controls(by: &str) -> Arc<Controls> {
        let settings = vec![crate::control::SettingsEntry {
            tenant: TenantId::parse("acme").unwrap(),
            namespace_prefix: None,
            settings: Default::default(),
            updated_by: by.to_owned(),
            updated_at: crate::domain::Timestamp(0),
        }];
        Arc::new(Controls { switches: vec![], settings })
    }

    /// Of two reads that overlap, the one that began later is kept, whichever finishes last.
    #[test]
    fn a_slower_earlier_read_does_not_replace_a_later_one() {
        let cache = ControlCache::default();
        let (early, late) = (Instant::now(), Instant::now() + Duration::from_millis(1));
        assert_eq!(cache.offer(Cached { controls: controls("later"), read_at: late }), controls("later"));
        assert_eq!(cache.offer(Cached { controls: controls("earlier"), read_at: early }), controls("later"));
        assert_eq!(cache.fresh(), Some(controls("later")));
        let latest = late + Duration::from_millis(1);
        assert_eq!(cache.offer(Cached { controls: controls("latest"), read_at: latest }), controls("latest"));
        assert_eq!(cache.fresh(), Some(controls("latest")));
    }
}
