//! Rolling a run back: undoing what a runaway run already did.
//!
//! A completion may register a [`Compensation`]: a name and small data saying how to undo its
//! effect. Rolling a run back ([`crate::Guard::start_rollback`]) switches the run off (a kill
//! switch on it) and keeps a [`Rollback`] with the run (one per run, written once by an
//! insert-if-absent, [`crate::store::RunStore::insert_rollback`]); from then on every successful effect of the
//! run that registered a compensation is a **compensation task**, and every other is *not
//! compensable*.
//!
//! A task is an ordinary key, so it has every guarantee of a claim (lease, fence, recovery,
//! checkpoints): the key [`task_key`] of the effect's attempt in the namespace
//! `<effect namespace>/_undo` ([`task_namespace`]), claimed with a fingerprint of the effect and
//! its compensation ([`task_fingerprint`]). Workers ask for the next task
//! ([`crate::Guard::claim_compensation`]), newest effect first, run it, and complete or fail
//! the task's key with its fence like any holder:
//!
//! - completed: *compensated*; failed permanently: *failed*, kept and shown, never handed out
//!   again; failed retryably: handed out again; a worker that crashed: the task is handed out
//!   again as a recovery once its lease passed.
//!
//! The progress ([`Progress`]) is read from the run's records and the tasks' records, never
//! kept apart, so it cannot drift from what happened. It covers the effects whose records are
//! still kept (their retention); a task's record is kept at least as long as its effect's
//! ([`Effect::kept_until`]), whatever the settings say by then, so a task once run is never
//! handed out again.
//!
//! A rollback has a cut-off and an end: its effects are those its run made before it started
//! and every instance saw its switch ([`Rollback::cut_off`]; one in flight then becomes a task
//! when it completes), never one made after (once its switch was released, say), and it is done only when no effect of it
//! can still complete and every task is compensated or failed.
//!
//! A compensation task is always enforced, whatever the namespace's mode: it must run once.
//! It asks no approver: the admin who started the rollback approved its compensations. Its
//! namespace is reserved: no claim through the front ends reaches it
//! ([`is_task_namespace`]). A kill switch on the tenant or on a namespace covering the task
//! refuses it (and the next task is tried); the run's own switch does not (the task's claim
//! names the undo run, [`task_run`]).
//!
//! This folder is the feature's room: this file holds the types and the pure rules (tasks,
//! their keys, progress), which the record and the store hold; `guard.rs` the rollback's part
//! of the guard (starting a rollback, its progress, the worker's claims of tasks through the
//! door), which uses the store.

use serde::{Deserialize, Serialize};

use crate::domain::{Fence, Fingerprint, InvalidInput, Key, Namespace, RunId, Scope, TenantId, Timestamp};
use crate::record::{Compensation, OutcomeKind, Record, RecordState};

mod guard;

pub(crate) use guard::TaskTerms;
pub use guard::{CompensationClaim, TaskHeld};

/// The last segment of the namespace that holds an effect's compensation task.
pub const TASK_SEGMENT: &str = "_undo";

/// A run being rolled back, as kept with its run ([`crate::store::RunStore`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollback {
    /// Its tenant.
    pub tenant: TenantId,
    /// The run.
    pub run: RunId,
    /// Why it was rolled back.
    pub why: String,
    /// Who started it (an API key id, `cli:<user>`).
    pub started_by: String,
    /// When.
    pub started_at: Timestamp,
}

/// How long after its start a rollback still takes the run's effects as its own: twice the
/// time every instance takes to see the run's switch (`control_cache::CONTROL_MAX_AGE`, which
/// the guard checks it covers), so that an effect an instance claimed before it saw the switch
/// is still undone.
pub const CUT_OFF_MARGIN: std::time::Duration = std::time::Duration::from_secs(2);

impl Rollback {
    /// Its effects are the run's records made until then: its start and [`CUT_OFF_MARGIN`].
    pub fn cut_off(&self) -> Timestamp {
        self.started_at.plus(CUT_OFF_MARGIN)
    }
}

crate::label::vocabulary! {
    /// Where a compensation task stands.
    pub enum TaskState {
        /// Not started yet, or released after a retryable failure.
        Pending => "pending",
        /// A worker holds it (or held it: its lease passed, and the next worker recovers it).
        InProgress => "in_progress",
        /// The compensation completed.
        Compensated => "compensated",
        /// The compensation failed permanently (or the task's key was taken by another request):
        /// kept and shown, never handed out again.
        Failed => "failed",
    }
}

impl TaskState {
    /// Where the task whose record is `record` (none if never claimed) stands; `fingerprint` is
    /// the task's: a record of the task's key with another one is a task that can never run.
    pub fn of(record: Option<&Record>, fingerprint: &Fingerprint) -> Self {
        let Some(record) = record else { return Self::Pending };
        if record.state != RecordState::Released && &record.fingerprint != fingerprint {
            return Self::Failed;
        }
        match (record.state, record.outcome.as_ref().map(|o| o.kind)) {
            (RecordState::Released, _) => Self::Pending,
            (RecordState::InProgress, _) => Self::InProgress,
            (RecordState::Completed, Some(OutcomeKind::Success)) => Self::Compensated,
            (RecordState::Completed, _) => Self::Failed,
        }
    }
}

/// The effect a task undoes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    /// Its key.
    pub scope: Scope,
    /// The fence of the attempt that completed it.
    pub fence: Fence,
    /// When it completed.
    pub completed_at: Timestamp,
    /// Until when its record is kept: its task's record is kept at least as long, so that a
    /// task once run is never handed out again while its effect can still be read.
    pub kept_until: Timestamp,
}

/// A compensation task: an effect, how to undo it, and the key that undoes it once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    /// The effect it undoes.
    pub effect: Effect,
    /// How.
    pub compensation: Compensation,
    /// The task's own key.
    pub scope: Scope,
    /// The task's fingerprint.
    pub fingerprint: Fingerprint,
    /// Where it stands.
    pub state: TaskState,
    /// How many times it was acquired (0 if never).
    pub attempt: u32,
    /// Until when its holder's lease runs (in progress only).
    pub lease_expires_at: Option<Timestamp>,
    /// In progress, but nobody holds a live lease (it passed, or the holder reported the
    /// outcome unknown): the next worker recovers it.
    pub stuck: bool,
}

impl Task {
    /// The task of `effect`, a completed record with a compensation (`None` for any other).
    pub fn of(effect: &Record) -> Option<Result<Self, InvalidInput>> {
        let outcome = effect.outcome.as_ref().filter(|o| o.kind == OutcomeKind::Success)?;
        let compensation = outcome.compensation.clone()?;
        let completed_at = effect.completed_at?;
        let effect =
            Effect { scope: effect.scope.clone(), fence: effect.fence, completed_at, kept_until: effect.expires_at };
        Some(Self::undoing(effect, compensation))
    }

    /// The task that undoes `effect` with `compensation`, not started; an error where the
    /// effect's namespace is too long to hold its task.
    fn undoing(effect: Effect, compensation: Compensation) -> Result<Self, InvalidInput> {
        let namespace = task_namespace(&effect.scope.namespace)?;
        let scope = Scope::new(effect.scope.tenant.clone(), namespace, task_key(&effect.scope.key, effect.fence)?);
        let fingerprint = task_fingerprint(&effect, &compensation);
        Ok(Self {
            effect,
            compensation,
            scope,
            fingerprint,
            state: TaskState::Pending,
            attempt: 0,
            lease_expires_at: None,
            stuck: false,
        })
    }

    /// The same task, standing where its record (`None` if never claimed) says at `now`.
    pub fn with_record(mut self, record: Option<&Record>, now: Timestamp) -> Self {
        self.state = TaskState::of(record, &self.fingerprint);
        self.attempt = record.map_or(0, |r| r.attempt);
        self.lease_expires_at = record.and_then(|r| r.lease_expires_at);
        self.stuck = record.is_some_and(|r| r.is_stuck(now));
        self
    }
}

/// The namespace of the compensation tasks of effects in `namespace`: `<namespace>/_undo` (so
/// that settings and a kill switch on the effect's namespace cover its undoing too).
pub fn task_namespace(namespace: &Namespace) -> Result<Namespace, InvalidInput> {
    Namespace::parse(&format!("{namespace}/{TASK_SEGMENT}"))
        .map_err(|_| InvalidInput::new("namespace", "too long to hold its compensation tasks (255 bytes with /_undo)"))
}

/// Whether `namespace` holds compensation tasks (a segment is [`TASK_SEGMENT`]): reserved for
/// [`crate::Guard::claim_compensation`], never claimed through [`crate::Guard::claim`].
pub fn is_task_namespace(namespace: &Namespace) -> bool {
    namespace.as_str().split('/').any(|segment| segment == TASK_SEGMENT)
}

/// The key of the compensation task of the attempt `fence` of `key`: `<fence>.<key>`, or
/// `<fence>.sha256-<hex of key>` where that would pass 255 bytes. The fence makes it unique for
/// ever: a key completed again after its retention is another effect, with another task.
pub fn task_key(key: &Key, fence: Fence) -> Result<Key, InvalidInput> {
    let plain = format!("{}.{key}", fence.0);
    if plain.len() <= 255 {
        return Key::parse(&plain);
    }
    Key::parse(&format!("{}.sha256-{}", fence.0, sha256_hex(key.as_str())))
}

/// The run that the compensation tasks of `run` are claimed in: `<run>/undo` (or
/// `undo/sha256-<hex>` where that would pass 128 bytes). Their records are read by listing it,
/// and it is a run like any other: a budget on it bounds the compensations, a kill switch on it
/// stops them, and its usage counts them.
pub fn task_run(run: &RunId) -> RunId {
    let plain = format!("{run}/undo");
    if plain.len() <= 128
        && let Ok(id) = RunId::parse(&plain)
    {
        return id;
    }
    RunId::parse(&format!("undo/sha256-{}", &sha256_hex(run.as_str())[..32])).expect("a digest makes a valid run id")
}

/// The SHA-256 of `text`, in lowercase hex.
fn sha256_hex(text: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// The fingerprint of a task: the effect's key and attempt, and the compensation registered.
pub fn task_fingerprint(effect: &Effect, compensation: &Compensation) -> Fingerprint {
    Fingerprint::of_json(&serde_json::json!({
        "namespace": effect.scope.namespace.as_str(),
        "key": effect.scope.key.as_str(),
        "fence": effect.fence.0,
        "compensation": compensation.name.as_str(),
        "data": compensation.data,
    }))
}

/// Where a rollback stands: counted from the run's records and the tasks' records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Progress {
    /// The run's effects that completed successfully (compensable or not).
    pub effects: u64,
    /// Tasks whose compensation completed.
    pub compensated: u64,
    /// Tasks a worker holds (or held, its lease passed).
    pub in_progress: u64,
    /// Tasks not started yet (or released after a retryable failure).
    pub pending: u64,
    /// Tasks that failed permanently: kept, never handed out again.
    pub failed: u64,
    /// Effects that registered no compensation (or whose namespace is too long for a task).
    pub not_compensable: u64,
    /// Keys of the run still in progress: whether their effects happened is not known yet.
    pub effects_in_flight: u64,
}

impl Progress {
    /// Whether nothing is left to run: no task pending or in progress, and no effect of the run
    /// still in flight (it may yet complete, and become a task).
    pub fn done(&self) -> bool {
        self.pending == 0 && self.in_progress == 0 && self.effects_in_flight == 0
    }

    /// Counts `task`.
    pub fn count(&mut self, state: TaskState) {
        match state {
            TaskState::Pending => self.pending += 1,
            TaskState::InProgress => self.in_progress += 1,
            TaskState::Compensated => self.compensated += 1,
            TaskState::Failed => self.failed += 1,
        }
    }
}

/// A rollback as read now: the document, its progress and its tasks, newest effect first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackReport {
    /// The rollback.
    pub rollback: Rollback,
    /// Its progress.
    pub progress: Progress,
    /// The compensation tasks, newest effect first.
    pub tasks: Vec<Task>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::CheckpointName;

    fn effect(key: &str, fence: u64) -> Effect {
        let scope =
            Scope::new(TenantId::parse("t").unwrap(), Namespace::parse("prod/pay").unwrap(), Key::parse(key).unwrap());
        Effect { scope, fence: Fence(fence), completed_at: Timestamp(1), kept_until: Timestamp(2) }
    }

    #[test]
    fn a_task_key_is_unique_per_attempt_and_fits() {
        let key = Key::parse("charge-1").unwrap();
        assert_eq!(task_key(&key, Fence(3)).unwrap().as_str(), "3.charge-1");
        assert_ne!(task_key(&key, Fence(3)).unwrap(), task_key(&key, Fence(4)).unwrap());
        let long = Key::parse(&"k".repeat(255)).unwrap();
        let task = task_key(&long, Fence(u64::MAX)).unwrap();
        assert!(task.as_str().starts_with(&format!("{}.sha256-", u64::MAX)), "{task}");
        assert!(task.as_str().len() <= 255);
    }

    #[test]
    fn a_task_run_is_the_runs_undo_run_and_fits() {
        assert_eq!(task_run(&RunId::parse("run-42").unwrap()).as_str(), "run-42/undo");
        let long = RunId::parse(&"r".repeat(128)).unwrap();
        let undo = task_run(&long);
        assert!(undo.as_str().starts_with("undo/sha256-") && undo.as_str().len() <= 128, "{undo}");
        assert_ne!(undo, task_run(&RunId::parse(&"s".repeat(128)).unwrap()));
    }

    #[test]
    fn a_task_lives_under_its_effects_namespace() {
        let ns = Namespace::parse("prod/pay").unwrap();
        let task = task_namespace(&ns).unwrap();
        assert_eq!(task.as_str(), "prod/pay/_undo");
        assert!(task.is_within(&ns));
        let long = Namespace::parse(&vec!["n".repeat(62); 4].join("/")).unwrap();
        assert!(task_namespace(&long).is_err(), "251 bytes and /_undo pass 255");
    }

    #[test]
    fn a_task_fingerprint_binds_the_effect_and_its_compensation() {
        let undo = Compensation { name: CheckpointName::parse("refund").unwrap(), data: "{}".into() };
        let other = Compensation { data: r#"{"x":1}"#.into(), ..undo.clone() };
        let fp = task_fingerprint(&effect("a", 1), &undo);
        assert_eq!(fp, task_fingerprint(&effect("a", 1), &undo));
        assert_ne!(fp, task_fingerprint(&effect("a", 2), &undo));
        assert_ne!(fp, task_fingerprint(&effect("b", 1), &undo));
        assert_ne!(fp, task_fingerprint(&effect("a", 1), &other));
    }
}
