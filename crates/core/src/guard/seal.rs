//! Sealing on the way in and opening on the way out (see [`crate::sealing`]): outcomes,
//! compensation data and checkpoint data are sealed before the store sees them and opened
//! before a caller does; a value this guard cannot open is refused, never answered as if it
//! were the value. [`Guard::reseal`] seals a tenant's stored values again with the current key.

use super::*;

impl Guard {
    /// `mutation` with what it stores sealed (see [`Guard::with_sealer`]).
    pub(super) fn seal(&self, scope: &Scope, mutation: Mutation) -> Mutation {
        let Some(sealer) = &self.sealer else { return mutation };
        match mutation {
            Mutation::Complete(mut o) => {
                o.body = sealer.seal_bytes(scope, &o.body);
                if let Some(c) = &mut o.compensation {
                    c.data = sealer.seal_text(scope, &c.data);
                }
                Mutation::Complete(o)
            }
            Mutation::Fail { retryable: false, mut outcome } => {
                outcome.body = sealer.seal_bytes(scope, &outcome.body);
                Mutation::Fail { retryable: false, outcome }
            }
            Mutation::Checkpoint { name, data } => Mutation::Checkpoint { data: sealer.seal_text(scope, &data), name },
            other => other,
        }
    }

    /// The fingerprint the store keeps for a caller's `fingerprint`: keyed under the key
    /// file's fingerprint key where this guard seals ([`crate::sealing::Sealer::keyed_fingerprint`]),
    /// the caller's own where it does not.
    pub fn stored_fingerprint(&self, fingerprint: &Fingerprint) -> Fingerprint {
        match &self.sealer {
            Some(sealer) => sealer.keyed_fingerprint(fingerprint),
            None => fingerprint.clone(),
        }
    }

    /// A mismatch the store answered because the record's fingerprint is of the other form than
    /// this guard's (read after the answer, on this rare path only): a record stored before
    /// fingerprints were keyed, whose fingerprint is the caller's `plain` one, is claimed again
    /// by that fingerprint (the store decides again, atomically, on the record as it is), until
    /// `onceguard keys reseal` keys it; a keyed fingerprint seen by a guard without the key file
    /// is refused as a sealed value is (503, never a mismatch the caller would take for another
    /// request's). Any other answer is as the store gave it.
    pub(super) async fn unkeyed_mismatch(
        &self,
        req: &ClaimRequest,
        plain: &Fingerprint,
        outcome: ClaimOutcome,
    ) -> Result<ClaimOutcome, GuardError> {
        if !matches!(outcome, ClaimOutcome::Mismatch) {
            return Ok(outcome);
        }
        let Some(record) = self.store.get(&req.scope, self.clock.now()).await? else { return Ok(outcome) };
        match &self.sealer {
            None if Sealer::is_keyed(&record.fingerprint) => {
                Err(self.unopened(&req.scope, sealing::OpenError::NoKey(crate::sealing::FINGERPRINT_KEY_ID.into())))
            }
            Some(_) if record.fingerprint == *plain => {
                let unkeyed = ClaimRequest { fingerprint: plain.clone(), ..req.clone() };
                match self.store.claim(&unkeyed, self.clock.now()).await? {
                    // Keyed meanwhile (a reseal between the read and this claim): as keyed.
                    ClaimOutcome::Mismatch => Ok(self.store.claim(req, self.clock.now()).await?),
                    answer => Ok(answer),
                }
            }
            _ => Ok(outcome),
        }
    }

    /// `record` with what it stores opened (see [`crate::sealing::open_bytes`]: a sealed value
    /// is refused, whether or not this guard seals).
    pub(super) fn open_record(&self, mut record: Record) -> Result<Record, GuardError> {
        let sealer = self.sealer.as_deref();
        let scope = record.scope.clone();
        let opened = (|| {
            if let Some(o) = &mut record.outcome {
                o.body = sealing::open_bytes(sealer, &scope, std::mem::take(&mut o.body))?;
                if let Some(c) = &mut o.compensation {
                    c.data = sealing::open_text(sealer, &scope, std::mem::take(&mut c.data))?;
                }
            }
            for cp in &mut record.checkpoints {
                cp.data = sealing::open_text(sealer, &scope, std::mem::take(&mut cp.data))?;
            }
            Ok(())
        })();
        opened.map_err(|e| self.unopened(&scope, e))?;
        Ok(record)
    }

    /// Reports and logs a sealed value this guard could not open, and answers the error.
    fn unopened(&self, scope: &Scope, error: sealing::OpenError) -> GuardError {
        tracing::error!(tenant = %scope.tenant, namespace = %scope.namespace, %error, "a sealed value was refused");
        self.observer.unopened(scope);
        error.into()
    }

    /// A claim's answer, opened ([`Guard::open_claim`]). If it cannot be opened, what the claim
    /// acquired is let go first, in this request: reported unknown with the fence it was given,
    /// so that the next claim is a recovery again with the same last checkpoint (nothing ran).
    pub(super) async fn opened_claim(&self, scope: &Scope, outcome: ClaimOutcome) -> Result<ClaimOutcome, GuardError> {
        let held = match &outcome {
            ClaimOutcome::Acquired(a) => Some(a.fence),
            _ => None,
        };
        match self.open_claim(scope, outcome) {
            Ok(outcome) => Ok(outcome),
            Err(error) => {
                if let Some(fence) = held {
                    let detail = "released unanswered: its recovery point could not be opened by this instance; \
                                  nothing ran";
                    let let_go = Mutation::ReportUnknown(detail.into());
                    self.store.mutate(scope, fence, let_go, self.clock.now(), self.limits.max_checkpoints).await?;
                    self.notifier.notify(scope);
                }
                Err(self.unopened(scope, error))
            }
        }
    }

    /// A claim's answer with what it carries (a replay's outcome, a recovery's checkpoint) opened.
    fn open_claim(&self, scope: &Scope, outcome: ClaimOutcome) -> Result<ClaimOutcome, sealing::OpenError> {
        let sealer = self.sealer.as_deref();
        Ok(match outcome {
            ClaimOutcome::Replay(mut r) => {
                r.outcome.body = sealing::open_bytes(sealer, scope, std::mem::take(&mut r.outcome.body))?;
                ClaimOutcome::Replay(r)
            }
            ClaimOutcome::Acquired(mut a) => {
                if let Some(cp) = a.recovery.as_mut().and_then(|r| r.last_checkpoint.as_mut()) {
                    cp.data = sealing::open_text(sealer, scope, std::mem::take(&mut cp.data))?;
                }
                ClaimOutcome::Acquired(a)
            }
            ClaimOutcome::Proceed(would_have_been) => {
                ClaimOutcome::Proceed(Box::new(self.open_claim(scope, *would_have_been)?))
            }
            other => other,
        })
    }

    /// A sealed fenced call's answer, opened; a completion refused as `finished` that repeats,
    /// once opened, what the record holds (it was sealed under a key since rotated) is answered
    /// as the repeat it is.
    pub(super) async fn opened_fenced(
        &self,
        scope: &Scope,
        fence: Fence,
        plain: &Mutation,
        outcome: FencedOutcome,
    ) -> Result<FencedOutcome, GuardError> {
        match outcome {
            FencedOutcome::Applied(record) => Ok(FencedOutcome::Applied(Box::new(self.open_record(*record)?))),
            FencedOutcome::Stale(StaleReason::Finished)
                if matches!(plain, Mutation::Complete(_) | Mutation::Fail { retryable: false, .. }) =>
            {
                let stored = self.get(scope).await?;
                match stored {
                    Some(record) if record.fence == fence && crate::protocol::is_repeat(&record, plain) => {
                        Ok(FencedOutcome::Applied(Box::new(record)))
                    }
                    _ => Ok(FencedOutcome::Stale(StaleReason::Finished)),
                }
            }
            stale => Ok(stale),
        }
    }

    /// Seals again, with the current key of the key file, every stored result and checkpoint
    /// of `tenant` that an older key sealed or that was stored before sealing was on, and keys
    /// every record's and approval's fingerprint stored before fingerprints were keyed (an
    /// operator's action, audited as `records.reseal` with its counts, once the tenant is done).
    /// A record that changes while it is read and rewritten is left as its writer left it and
    /// counted (what its writer added is sealed with the current key, what it kept may not be:
    /// run it again); one with a value no key opens is counted and left. Without a sealer
    /// nothing can be sealed: an error.
    pub async fn reseal(&self, actor: &str, tenant: &TenantId) -> Result<Resealed, GuardError> {
        let Some(sealer) = &self.sealer else {
            return Err(InvalidInput::new("encryption", "no key file: give --encryption-key-file to seal").into());
        };
        let now = self.clock.now();
        let mut pages = Pages::new(ListFilter { limit: crate::store::MAX_PAGE, ..Default::default() }, usize::MAX);
        let mut counts = Resealed::default();
        while let Some(filter) = pages.page() {
            let page = self.store.list(tenant, filter, now).await?;
            pages.turn(page.next.clone(), |f, next| f.after = Some(next));
            for old in &page.items {
                counts.examined += 1;
                let Ok(new) = resealed(sealer, old) else {
                    // Sealed with a key the file lacks: left as it is, and counted.
                    counts.unopened += 1;
                    continue;
                };
                let Some(new) = new else { continue };
                if self.store.replace(old, &new).await? {
                    counts.resealed += 1;
                } else {
                    counts.changed_meanwhile += 1;
                }
            }
        }
        // Approvals asked before fingerprints were keyed: keyed, so that the call they ask
        // about compares again (a compare-and-set over the approval read).
        for old in self.all_approvals(tenant, None, usize::MAX).await? {
            if Sealer::is_keyed(&old.fingerprint) {
                continue;
            }
            let new =
                crate::approval::Approval { fingerprint: sealer.keyed_fingerprint(&old.fingerprint), ..old.clone() };
            if self.store.put_approval(Some(&old), &new, None, self.clock.now()).await? {
                counts.approvals_keyed += 1;
            } else {
                counts.changed_meanwhile += 1;
            }
        }
        let entry = AuditEntry::new(tenant.clone(), now, actor, "records.reseal", sealer.current())
            .details(serde_json::to_value(counts).unwrap_or_default());
        self.store.append_audit(&entry).await?;
        Ok(counts)
    }
}

/// What [`Guard::reseal`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Resealed {
    /// Records read.
    pub examined: u64,
    /// Records rewritten with every value sealed by the current key and their fingerprint
    /// keyed.
    pub resealed: u64,
    /// Approvals whose fingerprint was keyed (asked before fingerprints were).
    pub approvals_keyed: u64,
    /// Records (and approvals) that changed between the read and the rewrite (left as their
    /// writer left them; run it again for those).
    pub changed_meanwhile: u64,
    /// Records with a value no key of the file opens (left as they are).
    pub unopened: u64,
}

/// `record` with every value sealed by the current key and its fingerprint keyed, or `None` if
/// each is already.
fn resealed(sealer: &Sealer, record: &Record) -> Result<Option<Record>, crate::sealing::OpenError> {
    let mut new = record.clone();
    let mut changed = false;
    if !Sealer::is_keyed(&record.fingerprint) {
        new.fingerprint = sealer.keyed_fingerprint(&record.fingerprint);
        changed = true;
    }
    if let Some(o) = &mut new.outcome {
        if let Some(body) = sealer.reseal_bytes(&record.scope, &o.body)? {
            o.body = body;
            changed = true;
        }
        if let Some(c) = &mut o.compensation
            && let Some(data) = sealer.reseal_text(&record.scope, &c.data)?
        {
            c.data = data;
            changed = true;
        }
    }
    for cp in &mut new.checkpoints {
        if let Some(data) = sealer.reseal_text(&record.scope, &cp.data)? {
            cp.data = data;
            changed = true;
        }
    }
    Ok(changed.then_some(new))
}
