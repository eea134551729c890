//! What this instance last wrote, so that a fenced call on a key it claimed can be decided
//! before the key is read (a guess the batch's read confirms under the key's lock).

use super::*;

/// The most records [`Known`] keeps; past it, it forgets them all and starts again.
pub(crate) const KNOWN_MAX: usize = 8_192;

/// A record as this instance last wrote it: the record, and its `doc` and `body` columns.
#[derive(Debug)]
pub(crate) struct KnownRecord {
    pub(crate) record: Record,
    pub(crate) doc: Vec<u8>,
    pub(crate) body: Option<Vec<u8>>,
}

/// The in-progress records this instance last wrote, by key, so that a fenced call on a key it
/// claimed can be decided before the key is read (see [`Guess`]). Only ever a guess: another
/// instance, a purge, the sweep or a revocation may have changed the record since, and the
/// guessed write then does not happen.
#[derive(Debug, Default)]
pub(crate) struct Known(pub(crate) std::sync::Mutex<HashMap<Scope, Arc<KnownRecord>>>);

impl Known {
    pub(crate) fn records(&self) -> std::sync::MutexGuard<'_, HashMap<Scope, Arc<KnownRecord>>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn get(&self, scope: &Scope) -> Option<Arc<KnownRecord>> {
        self.records().get(scope).cloned()
    }

    /// Notes what committed batches left their keys as: an in-progress record, or something
    /// this cache does not keep.
    pub(crate) fn update(&self, changes: Vec<(Scope, Option<Arc<KnownRecord>>)>) {
        let mut records = self.records();
        for (scope, known) in changes {
            match known {
                Some(known) => {
                    if records.len() >= KNOWN_MAX {
                        records.clear();
                    }
                    records.insert(scope, known);
                }
                None => {
                    records.remove(&scope);
                }
            }
        }
    }

    pub(crate) fn forget<'a>(&self, scopes: impl Iterator<Item = &'a Scope>) {
        let mut records = self.records();
        for scope in scopes {
            records.remove(scope);
        }
    }
}

/// What [`Known`] keeps of a record written with `doc` and `body`: in-progress records only.
pub(crate) fn known(record: &Record, doc: &[u8], body: &Option<Vec<u8>>) -> Option<Arc<KnownRecord>> {
    (record.state == RecordState::InProgress)
        .then(|| Arc::new(KnownRecord { record: record.clone(), doc: doc.to_vec(), body: body.clone() }))
}

/// The fence a guessed claim is decided with, and written with until the statement that
/// writes it puts the fence it draws in its place (never a real fence: those come from a
/// `bigint` sequence).
pub(crate) const GUESSED_FENCE: Fence = Fence(u64::MAX);

/// `doc` with its one spelling of `placeholder` (a packed fence, [`Fence::packed`]) replaced by
/// `fence`'s; `None` unless it holds that spelling exactly once.
pub(crate) fn with_fence(doc: &[u8], placeholder: Fence, fence: Fence) -> Option<Vec<u8>> {
    let (from, to) = (placeholder.packed(), fence.packed());
    let mut found = doc.windows(from.len()).enumerate().filter(|(_, w)| *w == from.as_slice()).map(|(i, _)| i);
    let (Some(at), None) = (found.next(), found.next()) else { return None };
    Some([&doc[..at], &to[..], &doc[at + from.len()..]].concat())
}

/// A job decided before its key is read, on a guess of what the key holds, with the record to
/// write if the guess holds. The statement that reads the key writes that record only if the
/// key holds what was guessed, under the key's lock; the decision is `protocol::claim` or
/// `protocol::apply` on that record, as if it had been read. If the guess does not hold, the
/// job is decided on the record read, as any other.
#[derive(Debug)]
pub(crate) struct Guess {
    /// `None`: a claim, guessing that the key has no row; it then acquires, with the fence the
    /// statement draws. `Some`: a fenced call, guessing that the key holds this record.
    pub(crate) known: Option<Arc<KnownRecord>>,
    /// The time the guess is decided at: this instance's estimate of the store's
    /// ([`Writers::estimate`]); the guess is written only if the store's time is close to it.
    pub(crate) now: Timestamp,
    /// The answer if the guess holds (a claim's: with [`GUESSED_FENCE`]).
    pub(crate) answer: Answer,
    pub(crate) record: Record,
    pub(crate) doc: Vec<u8>,
    pub(crate) body: Option<Vec<u8>>,
}

impl Guess {
    /// The guess for a claim with no quota and no run of a key this instance knows of no record
    /// for, or for a fenced call that changes a record this instance wrote (and charges no run);
    /// `None` for any other job. `now` is the store's time as this instance expects it.
    pub(crate) fn of(op: &Op, now: Timestamp, known: &Known) -> Option<Self> {
        match op {
            Op::Claim(req) => {
                if req.max_in_flight.is_some() || req.run.is_some() || known.get(&req.scope).is_some() {
                    return None;
                }
                let (answer, record) = protocol::claim(None, req, now, || GUESSED_FENCE);
                let record = record?;
                let (doc, body) = record.clone().pack();
                // The fence must be in the document once, and nothing else may depend on it,
                // for the statement to put the drawn fence in its place.
                let other = Fence(GUESSED_FENCE.0 - 1);
                let (other_doc, _) = Record { fence: other, ..record.clone() }.pack();
                if with_fence(&doc, GUESSED_FENCE, other)? != other_doc {
                    return None;
                }
                Some(Self { known: None, now, answer: Answer::Claim(answer), record, doc, body })
            }
            Op::Mutate { scope, fence, mutation, max_checkpoints } => {
                let known = known.get(scope)?;
                let (answer, record) =
                    protocol::apply(Some(known.record.clone()), *fence, mutation.clone(), now, *max_checkpoints);
                let record = record?;
                if onceguard_core::control::reported_cost(mutation) > 0 && record.run.is_some() {
                    return None;
                }
                let (doc, body) = record.clone().pack();
                Some(Self { known: Some(known), now, answer: Answer::Mutate(answer), record, doc, body })
            }
        }
    }
}
