//! The tripwires' part of the guard: setting and deleting rules, counting what the door sees,
//! adding it to the store's counts, tripping, and releasing what is due (see the module
//! documentation of [`crate::tripwire`]).

use std::time::Duration;

use crate::control::{
    AuditEntry, ControlDoc, ControlKind, Mode, ObserveTrip, Settings, SettingsEntry, Switch, SwitchTarget,
};
use crate::control_cache::{CONTROL_MAX_AGE, CONTROL_REFRESH};
use crate::domain::{InvalidInput, Namespace, RunId, Scope, TenantId, Timestamp, check_reason};
use crate::guard::{Guard, GuardError};
use crate::record::{ClaimOutcome, Record};
use crate::store::StoreError;

use super::{Subject, Tally, Trip, TripAction, Tripped, Tripwire};

/// How far back the sweep keeps counts: the longest window and a minute.
const KEPT_MINUTES: u64 = super::MAX_WINDOW.as_secs() / 60 + 1;

/// The actor a rule acts as in the audit log.
fn actor(rule: &str) -> String {
    format!("tripwire:{rule}")
}

fn minute_of(now: Timestamp) -> u64 {
    now.0 / 60_000
}

impl Guard {
    /// Sets a tripwire rule (replacing one of the same name), audited as `tripwire.set`.
    pub async fn set_tripwire(&self, mut rule: Tripwire, why: Option<String>) -> Result<Tripwire, GuardError> {
        if let Some(why) = &why {
            check_reason("why", why)?;
        }
        rule.validate()?;
        let controls = self.refresh_controls().await?;
        let theirs = controls.tripwires.iter().filter(|r| r.tenant == rule.tenant);
        if theirs.clone().count() >= super::MAX_RULES && !theirs.clone().any(|r| r.name == rule.name) {
            let most = super::MAX_RULES;
            return Err(InvalidInput::new("name", format!("a tenant has at most {most} tripwires")).into());
        }
        // Counts are kept under the rule's name and this time: a rule set anew starts from
        // nothing (a threshold of another symptom never reads the old counts).
        rule.set_at = self.clock().now();
        let details = serde_json::to_value(&rule).unwrap_or_default();
        let audit = AuditEntry::new(rule.tenant.clone(), rule.set_at, &rule.set_by, "tripwire.set", &rule.name)
            .why(why)
            .details(details);
        self.store().put_control(&ControlDoc::of_tripwire(&rule), &audit).await?;
        self.refresh_controls().await?;
        Ok(rule)
    }

    /// Deletes a tripwire rule, audited as `tripwire.delete`; answers it if there was one. A
    /// switch it engaged stays until released.
    pub async fn delete_tripwire(
        &self,
        actor: &str,
        tenant: &TenantId,
        name: &str,
        why: Option<String>,
    ) -> Result<Option<Tripwire>, GuardError> {
        if let Some(why) = &why {
            check_reason("why", why)?;
        }
        let audit = AuditEntry::new(tenant.clone(), self.clock().now(), actor, "tripwire.delete", name).why(why);
        let Some(doc) = self.store().delete_control(ControlKind::Tripwire, tenant, name, &audit).await? else {
            return Ok(None);
        };
        let rule: Tripwire = serde_json::from_str(&doc.body).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.refresh_controls().await?;
        Ok(Some(rule))
    }

    /// A tenant's tripwire rules, by name, read from the store.
    pub async fn tripwires(&self, tenant: &TenantId) -> Result<Vec<Tripwire>, GuardError> {
        let controls = self.refresh_controls().await?;
        let mut rules: Vec<Tripwire> = controls.tripwires.iter().filter(|r| &r.tenant == tenant).cloned().collect();
        rules.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(rules)
    }

    /// Counts, for the tenant's rules, an attempt that finished (the door's fenced calls).
    pub(crate) fn tally_finished(&self, record: &Record, now: Timestamp) {
        self.tally(&record.scope.tenant, &record.scope.namespace, record.run.as_ref(), |rule| {
            rule.on_finished(record, now)
        });
    }

    /// Counts, for the tenant's rules, a claim's answer (of a claim for `run`): a mismatch
    /// (observe mode's would-be mismatch too), a recovery.
    pub(crate) fn tally_claimed(&self, scope: &Scope, run: Option<&RunId>, outcome: &ClaimOutcome) {
        self.tally(&scope.tenant, &scope.namespace, run, |rule| rule.on_claimed(outcome));
    }

    /// Counts, for the tenant's rules, a fenced call refused as stale.
    pub(crate) fn tally_stale(&self, scope: &Scope) {
        self.tally(&scope.tenant, &scope.namespace, None, Tripwire::on_stale);
    }

    fn tally(&self, tenant: &TenantId, namespace: &Namespace, run: Option<&RunId>, of: impl Fn(&Tripwire) -> Tally) {
        // The rules as last read (counting decides nothing; the flush decides on fresh ones).
        let Some(controls) = self.controls.latest() else { return };
        if controls.tripwires.is_empty() {
            return;
        }
        self.tallies.add(&controls.tripwires, tenant, namespace, run, of);
    }

    /// Adds what this instance counted to the store's counts and decides each rule counted on
    /// the window's sums across instances; trips those that crossed their threshold. Answers
    /// what this instance's trips did (it alone tells of them). Counts that could not reach the
    /// store are kept for the next flush.
    pub async fn flush_tripwires(&self) -> Result<Vec<Tripped>, GuardError> {
        let counted = self.tallies.take();
        if counted.is_empty() {
            return Ok(Vec::new());
        }
        let controls = match self.controls().await {
            Ok(controls) => controls,
            Err(e) => {
                for (key, tally) in counted {
                    self.tallies.put_back(key, tally);
                }
                return Err(e);
            }
        };
        let now = self.clock().now();
        let minute = minute_of(now);
        let mut tripped = Vec::new();
        let mut failed = None;
        for ((tenant, counts_key, subject), tally) in counted {
            // A rule deleted or set anew since drops these counts.
            let Some(rule) = controls.tripwires.iter().find(|r| r.tenant == tenant && r.counts_key() == counts_key)
            else {
                continue;
            };
            let since = minute + 1 - rule.minutes().min(minute + 1);
            let subject_key = subject.key();
            // An add whose answer was lost is added again with the next flush: counted twice,
            // never lost.
            let sums = match self.store().count_symptoms(&tenant, &counts_key, &subject_key, minute, tally, since).await
            {
                Ok(sums) => sums,
                Err(e) => {
                    self.tallies.put_back((tenant, counts_key, subject), tally);
                    failed = Some(e);
                    continue;
                }
            };
            let Some(why) = rule.crossed(sums) else { continue };
            let done = match rule.action {
                TripAction::Switch => self.trip(rule, &subject, sums, why, now).await.map(|s| s.map(Tripped::Switch)),
                TripAction::Observe => {
                    self.trip_to_observe(rule, sums, why, now).await.map(|e| e.map(Tripped::Observe))
                }
            };
            match done {
                Ok(Some(done)) => tripped.push(done),
                Ok(None) => {}
                // The counts stay: the next call counted decides again.
                Err(e) => tracing::error!(%tenant, rule = rule.name, error = %e, "tripwire: could not trip"),
            }
        }
        match failed {
            Some(e) if tripped.is_empty() => Err(e.into()),
            Some(e) => {
                tracing::warn!(error = %e, "tripwires: some counts could not be added; kept for the next flush");
                Ok(tripped)
            }
            None => Ok(tripped),
        }
    }

    /// Trips `rule` for `subject`: creates its switch if none is engaged on the target (one
    /// atomic insert-if-absent with its `tripwire.trip` entry). The creator alone clears the
    /// counts, revokes the covered leases, starts the run's rollback and reports it. Answers
    /// the switch if this call engaged it.
    async fn trip(
        &self,
        rule: &Tripwire,
        subject: &Subject,
        sums: Tally,
        why: String,
        now: Timestamp,
    ) -> Result<Option<Switch>, GuardError> {
        let (target, run) = match subject {
            Subject::Run(run) => (SwitchTarget::Run { run: run.clone() }, Some(run.clone())),
            Subject::Scope => match &rule.prefix {
                Some(prefix) => (SwitchTarget::Namespace { prefix: prefix.clone() }, None),
                None => (SwitchTarget::Tenant, None),
            },
        };
        let reason = format!("tripwire {}: {why}", rule.name);
        let trip = Trip {
            rule: rule.name.clone(),
            run: run.clone(),
            calls: sums.calls,
            bad: sums.bad,
            window_secs: rule.window.as_secs(),
            release_at: rule.auto_release_after.map(|after| now.plus(after)),
        };
        let switch = Switch {
            tenant: rule.tenant.clone(),
            target,
            reason,
            revoke_leases: rule.revoke_leases,
            revoked: 0,
            engaged_by: actor(&rule.name),
            engaged_at: now,
            tripwire: Some(trip.clone()),
        };
        let details =
            serde_json::json!({ "tripwire": trip, "revoke_leases": rule.revoke_leases, "rollback": rule.rollback });
        let entry = AuditEntry::new(rule.tenant.clone(), now, &switch.engaged_by, "tripwire.trip", switch.target.id())
            .why(Some(switch.reason.clone()))
            .details(details);
        let created = self.store().create_control(&ControlDoc::of_switch(&switch), &entry).await?;
        // Engaged now, or already (by another instance's trip, an earlier one, or a person):
        // either way counting starts again from nothing, once the switch is released.
        if let Err(e) = self.store().clear_symptoms(&rule.tenant, &rule.counts_key(), &subject.key()).await {
            tracing::warn!(tenant = %rule.tenant, rule = rule.name, error = %e, "tripwire: its counts could not be cleared");
        }
        if !created {
            return Ok(None);
        }
        // From here on the switch is engaged and audited: what follows is done as far as it
        // goes (each failure logged), and the switch is reported whatever failed. (An instance
        // stopped here leaves the switch engaged, without the revocation or rollback: the audit
        // entry `tripwire.trip` says what the rule asked for.)
        tracing::warn!(tenant = %rule.tenant, rule = rule.name, target = %switch.target, reason = switch.reason, "tripwire tripped");
        self.observer.tripped(&Tripped::Switch(switch.clone()));
        if let Err(e) = self.refresh_controls().await {
            tracing::warn!(error = %e, "tripwire: could not read the switches back; other claims see it within a second");
        }
        if rule.revoke_leases {
            self.revoke_for_trip(&switch).await;
        }
        if let (true, Some(run)) = (rule.rollback, run)
            && let Err(e) = self.start_rollback(&switch.engaged_by, &rule.tenant, &run, switch.reason.clone()).await
        {
            tracing::error!(tenant = %rule.tenant, %run, error = %e, "tripwire: could not start the run's rollback");
        }
        Ok(Some(switch))
    }

    /// Trips `rule` of action `observe`: writes the settings entry of its scope (its prefix, or
    /// the tenant) with observe mode and the trip, keeping the entry's other settings, with its
    /// `tripwire.trip` audit entry in the same atomic write: a replace of the entry exactly as
    /// read, or a create where there is none, so that of instances tripping at once one writes
    /// (and tells). An entry a tripwire turned already is left as it is; an entry a person
    /// changed between the read and the write is read again. Answers the entry if this call
    /// wrote it.
    async fn trip_to_observe(
        &self,
        rule: &Tripwire,
        sums: Tally,
        why: String,
        now: Timestamp,
    ) -> Result<Option<SettingsEntry>, GuardError> {
        let trip = ObserveTrip {
            reason: format!("tripwire {}: {why}", rule.name),
            trip: Trip {
                rule: rule.name.clone(),
                run: None,
                calls: sums.calls,
                bad: sums.bad,
                window_secs: rule.window.as_secs(),
                release_at: None,
            },
        };
        let target = SwitchTarget::of_prefix(rule.prefix.as_ref()).id();
        // Some(entry): this call wrote it; None: a tripwire's entry was there already.
        let written = 'write: {
            for _ in 0..3 {
                let controls = self.refresh_controls().await?;
                let current =
                    controls.settings.iter().find(|e| e.tenant == rule.tenant && e.namespace_prefix == rule.prefix);
                if current.is_some_and(|e| e.tripwire.is_some()) {
                    break 'write None;
                }
                let mut entry = current.cloned().unwrap_or_else(|| SettingsEntry {
                    tenant: rule.tenant.clone(),
                    namespace_prefix: rule.prefix.clone(),
                    settings: Settings::default(),
                    updated_by: String::new(),
                    updated_at: now,
                    tripwire: None,
                });
                (entry.settings.mode, entry.settings.enforce_percent) = (Some(Mode::Observe), None);
                (entry.updated_by, entry.updated_at, entry.tripwire) = (actor(&rule.name), now, Some(trip.clone()));
                let details =
                    serde_json::json!({ "tripwire": trip.trip, "action": "observe", "settings": entry.settings });
                let audit = AuditEntry::new(rule.tenant.clone(), now, &entry.updated_by, "tripwire.trip", &target)
                    .why(Some(trip.reason.clone()))
                    .details(details);
                let doc = ControlDoc::of_settings(&entry);
                let wrote = match current {
                    Some(current) => {
                        self.store().replace_control(&ControlDoc::of_settings(current), &doc, &audit).await?
                    }
                    None => self.store().create_control(&doc, &audit).await?,
                };
                if wrote {
                    break 'write Some(entry);
                }
            }
            // Changed under each of three writes: the counts stay, and the next flush decides again.
            return Err(StoreError::Unavailable(format!(
                "tripwire {}: the settings of {target} changed under each of 3 writes",
                rule.name
            ))
            .into());
        };
        if let Err(e) = self.store().clear_symptoms(&rule.tenant, &rule.counts_key(), &Subject::Scope.key()).await {
            tracing::warn!(tenant = %rule.tenant, rule = rule.name, error = %e, "tripwire: its counts could not be cleared");
        }
        let Some(entry) = written else { return Ok(None) };
        tracing::warn!(tenant = %rule.tenant, rule = rule.name, %target, reason = trip.reason, "tripwire tripped: observe mode");
        self.observer.tripped(&Tripped::Observe(entry.clone()));
        if let Err(e) = self.refresh_controls().await {
            tracing::warn!(error = %e, "tripwire: could not read the settings back; other claims see them within a second");
        }
        Ok(Some(entry))
    }

    /// Revokes the leases a tripped switch covers now, and once more after every instance has
    /// seen the switch (as [`Guard::engage_switch`] does), in the background.
    async fn revoke_for_trip(&self, switch: &Switch) {
        let detail = format!("{}{}: {}", crate::control::REVOKED_BY_SWITCH, switch.target, switch.reason);
        let (tenant, target) = (switch.tenant.clone(), switch.target.clone());
        let first = self.store().revoke_leases(&tenant, &target, &detail, self.clock().now()).await;
        if let Err(e) = &first {
            tracing::error!(%tenant, %target, error = %e, "tripwire: could not revoke leases");
        }
        let (guard, engaged_at) = (self.clone(), switch.engaged_at);
        tokio::spawn(async move {
            tokio::time::sleep(CONTROL_MAX_AGE + CONTROL_REFRESH).await;
            // Unless it was released (or engaged anew) meanwhile.
            let still_engaged = guard.refresh_controls().await.is_ok_and(|controls| {
                controls.switches.iter().any(|s| s.tenant == tenant && s.target == target && s.engaged_at == engaged_at)
            });
            if !still_engaged {
                return;
            }
            let later = guard.clock().now();
            let second = guard.store().revoke_leases(&tenant, &target, &detail, later).await;
            let revoked = first.unwrap_or(0) + second.as_ref().copied().unwrap_or(0);
            let entry = AuditEntry::new(tenant.clone(), later, "tripwire", "switch.revoke_leases", target.id())
                .details(serde_json::json!({ "revoked": revoked }));
            if let Err(e) = guard.audit(entry).await {
                tracing::warn!(%tenant, %target, error = %e, "tripwire: could not audit the revocation");
            }
        });
    }

    /// Releases the switches tripwires engaged whose `auto_release_after` passed; of instances
    /// doing so at once, one releases each (and audits it). Answers how many this call released.
    pub async fn release_due_tripwires(&self) -> Result<usize, GuardError> {
        let now = self.clock().now();
        let controls = self.controls().await?;
        let due: Vec<&Switch> = controls
            .switches
            .iter()
            .filter(|s| s.tripwire.as_ref().and_then(|t| t.release_at).is_some_and(|at| at <= now))
            .collect();
        let mut released = 0;
        for switch in due {
            let rule = switch.tripwire.as_ref().map_or("", |t| t.rule.as_str());
            let why = Some(format!("released by tripwire {rule}: auto_release_after passed"));
            let entry =
                AuditEntry::new(switch.tenant.clone(), now, actor(rule), "switch.release", switch.target.id()).why(why);
            // Only the switch read as due: one engaged on the target since (a person's, a new
            // trip's) stays.
            if self.store().delete_control_if(&ControlDoc::of_switch(switch), &entry).await? {
                released += 1;
            }
        }
        if released > 0 {
            self.refresh_controls().await?;
        }
        Ok(released)
    }

    /// Forgets counts older than the longest window (every minute, by [`Guard::tripwire_task`]).
    pub(crate) async fn prune_tripwire_counts(&self) -> Result<u64, GuardError> {
        let minute = minute_of(self.clock().now());
        Ok(self.store().prune_symptoms(minute.saturating_sub(KEPT_MINUTES)).await?)
    }

    /// The background work of the tripwires: every [`super::FLUSH`], adds this instance's
    /// counts to the store's and decides the rules, and releases what is due; `tripped` is
    /// handed what each trip of this instance did (to tell of it: the webhook).
    pub fn tripwire_task(
        &self,
        tripped: impl Fn(Tripped) + Send + Sync + 'static,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let guard = self.clone();
        async move {
            let mut tick = tokio::time::interval(super::FLUSH);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut pruned_at = tokio::time::Instant::now();
            loop {
                tick.tick().await;
                match guard.flush_tripwires().await {
                    Ok(switches) => switches.into_iter().for_each(&tripped),
                    Err(e) => tracing::warn!(error = %e, "tripwires: could not add this instance's counts; will retry"),
                }
                if let Err(e) = guard.release_due_tripwires().await {
                    tracing::warn!(error = %e, "tripwires: could not release a due switch; will retry");
                }
                if pruned_at.elapsed() >= Duration::from_secs(60) {
                    pruned_at = tokio::time::Instant::now();
                    if let Err(e) = guard.prune_tripwire_counts().await {
                        tracing::warn!(error = %e, "tripwires: could not forget old counts");
                    }
                }
            }
        }
    }
}
