//! The rollback's part of the guard (the types and rules are [`crate::rollback`]'s): starting
//! a rollback (an operator's action, [`Guard::start_rollback`]), reading its progress, and
//! handing its compensation tasks to workers through the one door.

use std::collections::HashMap;
use std::time::Duration;

use crate::control::{AuditEntry, SwitchTarget};
use crate::domain::{RunId, Scope, TenantId, check_reason};
use crate::guard::{Claim, Guard, GuardError};
use crate::record::{Acquired, ClaimOutcome, Denial, OutcomeKind, Record, RecordState};
use crate::rollback::{Progress, Rollback, RollbackReport, Task, TaskState, task_run};
use crate::store::{ListFilter, MAX_PAGE, Pages, StoreError};

/// What a worker asking for a compensation task gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompensationClaim {
    /// A task, held: run its compensation, then complete or fail the task's key with the fence.
    Acquired(Box<TaskHeld>),
    /// Nothing to take now: other workers hold the rest; ask again after `retry_after`.
    Busy {
        /// When the first held task's lease passes (or a second).
        retry_after: Duration,
        /// Tasks held.
        in_progress: u64,
    },
    /// Nothing is left to run.
    Done {
        /// Tasks compensated.
        compensated: u64,
        /// Tasks that failed permanently.
        failed: u64,
    },
    /// The task's claim was refused (a kill switch on its namespace or tenant, a quota): why.
    /// A task asks no approver and is claimed in enforce mode, so a refusal is a denial.
    Refused(Denial),
}

/// A compensation task a worker holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskHeld {
    /// The task (its state as it was before this claim).
    pub task: Task,
    /// The claim of its key: the fence, attempt, lease and recovery.
    pub acquired: Acquired,
}

/// How long a worker is told to wait when the held tasks' leases are unknown.
const BUSY_RETRY: Duration = Duration::from_secs(1);

/// The most pages of a run's records a rollback reads.
const MAX_RUN_PAGES: usize = 100;

/// The most pages of a tenant's rollbacks [`Guard::rollbacks`] reads.
const MAX_ROLLBACK_PAGES: usize = 10;

// A rollback's cut-off leaves every instance the time to see the run's switch, twice over.
const _: () =
    assert!(crate::rollback::CUT_OFF_MARGIN.as_millis() >= 2 * crate::control_cache::CONTROL_MAX_AGE.as_millis());

/// How a compensation task is claimed through the door ([`Guard::claim_compensation`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskTerms {
    /// The task's record is kept at least this long: until its effect's record goes.
    pub keep: Duration,
}

impl Guard {
    /// Starts rolling `run` back (an admin's action): a kill switch on the run (audited as
    /// `switch.engage`), then the rollback itself (audited as `run.rollback` with why). Answers
    /// the rollback as it now stands and whether this call started it: a run already being
    /// rolled back is left as it is.
    pub async fn start_rollback(
        &self,
        actor: &str,
        tenant: &TenantId,
        run: &RunId,
        why: String,
    ) -> Result<(RollbackReport, bool), GuardError> {
        check_reason("why", &why)?;
        // A run rolled back already answers its rollback, and changes nothing (its switch may
        // have been released since: it stays released).
        if let Some(existing) = self.store().get_rollback(tenant, run).await? {
            return Ok((self.report(existing).await?, false));
        }
        // The run is switched off first, so that the rollback's cut-off (from its start, which
        // comes after) covers every effect an instance claimed before it saw the switch. A
        // switch engaged on the run already (a tripwire's, which starts the rollback after it)
        // is kept as it is.
        let target = SwitchTarget::Run { run: run.clone() };
        let engaged = self.refresh_controls().await?.switches.iter().any(|s| &s.tenant == tenant && s.target == target);
        if !engaged {
            self.engage_switch(actor, tenant, target, format!("rolled back: {why}"), false).await?;
        }
        let now = self.clock().now();
        let rollback =
            Rollback { tenant: tenant.clone(), run: run.clone(), why, started_by: actor.to_owned(), started_at: now };
        let entry =
            AuditEntry::new(tenant.clone(), now, actor, "run.rollback", run.as_str()).why(Some(rollback.why.clone()));
        // The start is one insert-if-absent with its run: of concurrent starts on any
        // instances, one writes the rollback (and its one audit entry); the others answer the
        // rollback it wrote.
        let started = self.store().insert_rollback(&rollback, &entry).await?;
        let rollback = if started {
            rollback
        } else {
            self.store().get_rollback(tenant, run).await?.ok_or_else(|| {
                StoreError::Unavailable("the run's rollback was started but could not be read back".into())
            })?
        };
        Ok((self.report(rollback).await?, started))
    }

    /// The rollback of `run` as it now stands, if the run is being rolled back.
    pub async fn rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<RollbackReport>, GuardError> {
        match self.store().get_rollback(tenant, run).await? {
            Some(rollback) => Ok(Some(self.report(rollback).await?)),
            None => Ok(None),
        }
    }

    /// The runs of `tenant` being rolled back (at most [`MAX_ROLLBACK_PAGES`] pages of them),
    /// newest first.
    pub async fn rollbacks(&self, tenant: &TenantId) -> Result<Vec<Rollback>, GuardError> {
        let mut rollbacks = Vec::new();
        let mut pages = Pages::new(None::<RunId>, MAX_ROLLBACK_PAGES);
        while let Some(after) = pages.page() {
            let page = self.store().list_rollbacks(tenant, after.as_ref(), MAX_PAGE).await?;
            pages.turn(page.next, |after, next| *after = Some(next));
            rollbacks.extend(page.items);
        }
        rollbacks.sort_by_key(|r| std::cmp::Reverse(r.started_at));
        Ok(rollbacks)
    }

    /// Hands a worker the next compensation task of `run`, newest effect first: the first task
    /// not started, released, or whose holder's lease passed (a recovery), claimed through the
    /// one door in enforce mode with the longest retention in force and `lease`. `None` if the
    /// run is not being rolled back.
    pub async fn claim_compensation(
        &self,
        tenant: &TenantId,
        run: &RunId,
        lease: Option<Duration>,
    ) -> Result<Option<CompensationClaim>, GuardError> {
        let Some(rollback) = self.store().get_rollback(tenant, run).await? else { return Ok(None) };
        let (progress, tasks) = self.tasks(&rollback).await?;
        let now = self.clock().now();
        let mut refused = None;
        let mut soonest: Option<Duration> = None;
        let mut sooner = |d: Duration| soonest = Some(soonest.map_or(d, |s| s.min(d)));
        for task in tasks {
            match task.state {
                TaskState::Pending => {}
                TaskState::InProgress => match task.lease_expires_at {
                    Some(until) if until > now && !task.stuck => {
                        sooner(now.until(until));
                        continue;
                    }
                    _ => {}
                },
                TaskState::Compensated | TaskState::Failed => continue,
            }
            let retention = self.effective(&task.scope).await?.limits.max_retention;
            let claim = Claim {
                lease,
                retention: Some(retention),
                run: Some(task_run(run)),
                ..Claim::new(task.scope.clone(), task.fingerprint.clone())
            };
            let terms = TaskTerms { keep: now.until(task.effect.kept_until) };
            match self.claim_under(claim, Some(terms)).await? {
                ClaimOutcome::Acquired(acquired) => {
                    return Ok(Some(CompensationClaim::Acquired(Box::new(TaskHeld { task, acquired }))));
                }
                ClaimOutcome::InFlight(in_flight) => sooner(in_flight.retry_after),
                // Taken and finished by another worker meanwhile, or its key taken by another request.
                ClaimOutcome::Replay(_) | ClaimOutcome::Mismatch => {}
                // Refused (a switch on its namespace, a quota): the next task is tried.
                ClaimOutcome::Denied(denial) => {
                    refused.get_or_insert(denial);
                }
                // A task asks no approver and is claimed in enforce mode: no pending approval,
                // no observe-mode proceed.
                other @ (ClaimOutcome::PendingApproval(_) | ClaimOutcome::Proceed(_)) => {
                    return Err(StoreError::Unavailable(format!(
                        "a compensation task's claim answered {}, which no task's claim can",
                        other.name()
                    ))
                    .into());
                }
            }
        }
        Ok(Some(match soonest {
            Some(retry_after) => CompensationClaim::Busy { retry_after, in_progress: progress.in_progress.max(1) },
            // An effect still in flight may complete and become a task: the workers wait.
            None if progress.in_progress > 0 || progress.effects_in_flight > 0 => {
                CompensationClaim::Busy { retry_after: BUSY_RETRY, in_progress: progress.in_progress }
            }
            None => match refused {
                Some(refused) => CompensationClaim::Refused(refused),
                None => CompensationClaim::Done { compensated: progress.compensated, failed: progress.failed },
            },
        }))
    }

    /// `rollback` with its progress and tasks as they now stand.
    async fn report(&self, rollback: Rollback) -> Result<RollbackReport, GuardError> {
        let (progress, tasks) = self.tasks(&rollback).await?;
        Ok(RollbackReport { rollback, progress, tasks })
    }

    /// The rollback's compensation tasks, newest effect first, each where its record says, and
    /// its progress. Its effects are the run's records made before its cut-off
    /// ([`Rollback::cut_off`]): an effect made after it (its switch released, the run going on)
    /// is none of its.
    async fn tasks(&self, rollback: &Rollback) -> Result<(Progress, Vec<Task>), GuardError> {
        let (tenant, run) = (&rollback.tenant, &rollback.run);
        let mut progress = Progress::default();
        let mut tasks = Vec::new();
        let records = self.run_records(tenant, run).await?;
        for record in records.into_iter().filter(|r| r.created_at <= rollback.cut_off()) {
            match record.state {
                RecordState::InProgress => progress.effects_in_flight += 1,
                RecordState::Completed if record.outcome.as_ref().is_some_and(|o| o.kind == OutcomeKind::Success) => {
                    progress.effects += 1;
                    match Task::of(&record) {
                        Some(Ok(task)) => tasks.push(task),
                        Some(Err(_)) | None => progress.not_compensable += 1,
                    }
                }
                RecordState::Completed | RecordState::Released => {}
            }
        }
        tasks.sort_by_key(|t| std::cmp::Reverse((t.effect.completed_at, t.effect.fence)));
        // The tasks' own records: the records of the run's undo run, read in pages.
        let mut undone: HashMap<Scope, Record> =
            self.run_records(tenant, &task_run(run)).await?.into_iter().map(|r| (r.scope.clone(), r)).collect();
        let now = self.clock().now();
        let mut read = Vec::with_capacity(tasks.len());
        for task in tasks {
            let record = undone.remove(&task.scope);
            let task = task.with_record(record.as_ref(), now);
            progress.count(task.state);
            read.push(task);
        }
        Ok((progress, read))
    }

    /// The live records of `run`, at most [`MAX_RUN_PAGES`] pages of them.
    async fn run_records(&self, tenant: &TenantId, run: &RunId) -> Result<Vec<Record>, GuardError> {
        let mut records = Vec::new();
        let mut pages =
            Pages::new(ListFilter { run: Some(run.clone()), limit: MAX_PAGE, ..Default::default() }, MAX_RUN_PAGES);
        while let Some(filter) = pages.page() {
            let page = self.list(tenant, filter).await?;
            pages.turn(page.next, |f, next| f.after = Some(next));
            records.extend(page.items);
        }
        Ok(records)
    }
}
