//! Operator actions on the guard: tenants and API keys, kill switches, run budgets, settings
//! and the audit log. Each action is written to the audit log with who did it and why; the HTTP
//! API and the CLI call these, never the store. (The cache of switches and settings that every
//! claim consults is [`crate::control_cache`]; starting a rollback is the rollback's part of
//! the guard, in `rollback/guard.rs`.)

use crate::auth::{ApiKey, ApiKeyId, NewApiKey, Role, Tenant};
use crate::control::{
    AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Controls, Run, SettingsEntry, Switch, SwitchTarget,
};
use crate::control_cache::{CONTROL_MAX_AGE, CONTROL_REFRESH};
use crate::domain::{InvalidInput, Namespace, RunId, TenantId};
use crate::guard::{Guard, GuardError};
use crate::store::{Page, StoreError};

pub use crate::domain::MAX_REASON_BYTES;
use crate::domain::check_reason;

/// Longest label of an API key, in bytes.
pub const MAX_LABEL_BYTES: usize = 128;

fn check_why(why: Option<&str>) -> Result<(), InvalidInput> {
    why.map_or(Ok(()), |w| check_reason("why", w))
}

impl Guard {
    /// Appends an entry to the audit log.
    pub(crate) async fn audit(&self, entry: AuditEntry) -> Result<(), GuardError> {
        Ok(self.store().append_audit(&entry).await?)
    }

    /// Creates a tenant (audited as `tenant.create` in it); answers `None` if it existed (and
    /// changes nothing).
    pub async fn create_tenant(&self, actor: &str, id: &TenantId) -> Result<Option<Tenant>, GuardError> {
        let tenant = Tenant { id: id.clone(), created_at: self.clock().now() };
        let entry = AuditEntry::new(id.clone(), tenant.created_at, actor, "tenant.create", id.as_str());
        if !self.store().create_tenant(&tenant, Some(&entry)).await? {
            return Ok(None);
        }
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
        self.add_api_key(actor, &new.key).await?;
        Ok(Some(new))
    }

    /// Stores an API key made by the caller ([`ApiKey::generate`], whose token the caller has
    /// kept; the bootstrap writes it to a file first), audited as `api_key.create` with its
    /// role and label in the same write.
    pub async fn add_api_key(&self, actor: &str, key: &ApiKey) -> Result<(), GuardError> {
        let entry = AuditEntry::new(key.tenant.clone(), key.created_at, actor, "api_key.create", key.id.as_str())
            .details(serde_json::json!({ "role": key.role.as_str(), "label": key.label }));
        Ok(self.store().create_api_key(key, Some(&entry)).await?)
    }

    /// The API key `id` as stored (revoked or not; its secret's digest only).
    pub async fn api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, GuardError> {
        Ok(self.store().get_api_key(id).await?)
    }

    /// A tenant's API keys, newest first (never their secrets).
    pub async fn api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, GuardError> {
        Ok(self.store().list_api_keys(tenant).await?)
    }

    /// Revokes one of a tenant's API keys (audited as `api_key.revoke`); answers whether it
    /// existed in that tenant.
    pub async fn revoke_api_key(&self, actor: &str, tenant: &TenantId, id: &ApiKeyId) -> Result<bool, GuardError> {
        let now = self.clock().now();
        let entry = AuditEntry::new(tenant.clone(), now, actor, "api_key.revoke", id.as_str());
        Ok(self.store().revoke_api_key(tenant, id, now, Some(&entry)).await?)
    }

    /// A tenant's audit log, newest first.
    pub async fn audit_log(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, GuardError> {
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
            tripwire: None,
        };
        // The switch first, so that no claim acquires behind the revocation; this instance's
        // claims (waiting ones included) see it at once. Its audit entry is written with it.
        let entry = AuditEntry::new(tenant.clone(), now, actor, "switch.engage", switch.target.id())
            .why(Some(switch.reason.clone()))
            .details(serde_json::json!({ "revoke_leases": revoke_leases }));
        let engaged = ControlDoc::of_switch(&switch);
        self.store().put_control(&engaged, &entry).await?;
        self.refresh_controls().await?;
        if revoke_leases {
            let detail = format!("{}{}: {}", crate::control::REVOKED_BY_SWITCH, switch.target, switch.reason);
            switch.revoked = self.store().revoke_leases(tenant, &switch.target, &detail, now).await?;
            // Other instances may acquire covered keys until they see the switch (at most
            // CONTROL_MAX_AGE, after which an instance that could not read it fails closed):
            // a second pass then revokes those too.
            // (Unless the switch was released or engaged anew meanwhile.)
            tokio::time::sleep(CONTROL_MAX_AGE + CONTROL_REFRESH).await;
            let still_engaged = |controls: &Controls| {
                controls
                    .switches
                    .iter()
                    .any(|s| s.tenant == switch.tenant && s.target == switch.target && s.engaged_at == now)
            };
            if still_engaged(&*self.refresh_controls().await?) {
                let later = self.clock().now();
                switch.revoked += self.store().revoke_leases(tenant, &switch.target, &detail, later).await?;
            }
            // The count is written into the switch only if it is still the document this call
            // wrote (a release or a new engagement meanwhile is never undone); else it is only
            // audited.
            let later = self.clock().now();
            let entry = AuditEntry::new(tenant.clone(), later, actor, "switch.revoke_leases", switch.target.id())
                .details(serde_json::json!({ "revoked": switch.revoked }));
            if !self.store().replace_control(&engaged, &ControlDoc::of_switch(&switch), &entry).await? {
                self.audit(entry).await?;
            }
        }
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
        let entry = AuditEntry::new(tenant.clone(), self.clock().now(), actor, "switch.release", target.id()).why(why);
        let Some(doc) = self.store().delete_control(ControlKind::Switch, tenant, &target.id(), &entry).await? else {
            return Ok(None);
        };
        let switch: Switch = serde_json::from_str(&doc.body).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.refresh_controls().await?;
        Ok(Some(switch))
    }

    /// The switches engaged in every tenant, as this instance knows them (at most
    /// [`CONTROL_MAX_AGE`] old): for front ends that act on an engagement themselves (the MCP
    /// gateway cancels the tasks of the keys a switch revoked).
    pub async fn engaged_switches(&self) -> Result<Vec<Switch>, GuardError> {
        Ok(self.controls().await?.switches.clone())
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
        let details = serde_json::to_value(&budget).unwrap_or_default();
        let entry = AuditEntry::new(tenant.clone(), now, actor, "budget.set", run.as_str()).why(why).details(details);
        Ok(self.store().put_budget(tenant, run, &budget, now, &entry).await?)
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
        // A person's setting ends a tripwire's observe mode.
        entry.tripwire = None;
        let target = SwitchTarget::of_prefix(entry.namespace_prefix.as_ref()).id();
        let details = serde_json::to_value(&entry.settings).unwrap_or_default();
        let audit = AuditEntry::new(entry.tenant.clone(), entry.updated_at, &entry.updated_by, "settings.set", target)
            .why(why)
            .details(details);
        self.store().put_control(&ControlDoc::of_settings(&entry), &audit).await?;
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
        let target = SwitchTarget::of_prefix(prefix).id();
        let audit = AuditEntry::new(tenant.clone(), self.clock().now(), actor, "settings.delete", target).why(why);
        let Some(doc) = self.store().delete_control(ControlKind::Settings, tenant, &id, &audit).await? else {
            return Ok(None);
        };
        let entry: SettingsEntry = serde_json::from_str(&doc.body).map_err(|e| StoreError::Corrupt(e.to_string()))?;
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
