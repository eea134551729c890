//! What one instance saw since it last added its counts to the store's, per rule and subject.

use std::collections::HashMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::domain::{Namespace, RunId, TenantId};

use super::{Subject, Tripwire};

/// Two counts of a minute (or a window): the calls seen and the bad ones among them (or, for
/// spend, the units spent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    /// Calls seen.
    pub calls: u64,
    /// Bad calls among them, or units spent.
    pub bad: u64,
}

impl Tally {
    /// Whether it counts nothing.
    pub fn is_empty(&self) -> bool {
        self.calls == 0 && self.bad == 0
    }

    /// It with each count at most [`super::MAX_ADD`].
    pub fn clamped(self) -> Tally {
        Tally { calls: self.calls.min(super::MAX_ADD), bad: self.bad.min(super::MAX_ADD) }
    }

    /// Adds `other` to it.
    pub fn add(&mut self, other: Tally) {
        self.calls = self.calls.saturating_add(other.calls);
        self.bad = self.bad.saturating_add(other.bad);
    }
}

/// The most (tenant, rule, subject) an instance counts between two flushes; past it, new
/// subjects wait for the next flush's room and are not counted (a warning says so).
const MAX_SUBJECTS: usize = 100_000;

/// Where a tally goes: the tenant, the rule's [`Tripwire::counts_key`] and the subject.
pub(crate) type TallyKey = (TenantId, String, Subject);

/// What this instance saw since its last flush. Adding takes a short lock and never waits on
/// anything else.
#[derive(Debug, Default)]
pub struct Tallies(Mutex<HashMap<TallyKey, Tally>>);

impl Tallies {
    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<TallyKey, Tally>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds, for each of `rules` (the tenant's) that watches `namespace`, what `of` says a call
    /// of `run` adds to it.
    pub(crate) fn add(
        &self,
        rules: &[Tripwire],
        tenant: &TenantId,
        namespace: &Namespace,
        run: Option<&RunId>,
        of: impl Fn(&Tripwire) -> Tally,
    ) {
        let mut counts = None;
        for rule in rules.iter().filter(|r| &r.tenant == tenant && r.watches(namespace)) {
            let tally = of(rule).clamped();
            let Some(subject) = rule.subject(run).filter(|_| !tally.is_empty()) else { continue };
            let counts = counts.get_or_insert_with(|| self.counts());
            let key = (tenant.clone(), rule.counts_key(), subject);
            if let Some(kept) = counts.get_mut(&key) {
                kept.add(tally);
            } else if counts.len() < MAX_SUBJECTS {
                counts.insert(key, tally);
            } else {
                tracing::warn!(%tenant, rule = rule.name, "tripwires: too many subjects counted at once; a call went uncounted");
            }
        }
    }

    /// Takes everything counted so far.
    pub(crate) fn take(&self) -> Vec<(TallyKey, Tally)> {
        std::mem::take(&mut *self.counts()).into_iter().collect()
    }

    /// Puts back counts that could not be added to the store's.
    pub(crate) fn put_back(&self, key: TallyKey, tally: Tally) {
        let mut counts = self.counts();
        if counts.len() < MAX_SUBJECTS || counts.contains_key(&key) {
            let kept = counts.entry(key).or_default();
            kept.add(tally);
            *kept = kept.clamped();
        }
    }
}
