//! Conformance cases of rolling a run back (compensation tasks run once, newest first, by
//! concurrent workers, one of them crashing) and of observe mode (every caller proceeds, and
//! what enforcement would have answered is counted exactly), on every store.

use std::collections::BTreeMap;
use std::sync::Mutex;

use onceguard_core::control::{Mode, Settings, SettingsEntry};
use onceguard_core::rollback::TaskState;
use onceguard_core::rollback::{CompensationClaim, TaskHeld};
use onceguard_core::{AnswerKind, Compensation, Observer};

use super::*;

const RUN: &str = "run-rb";

fn run_id() -> RunId {
    RunId::parse(RUN).unwrap()
}

fn tenant() -> TenantId {
    TenantId::parse("acme").unwrap()
}

fn undoable(body: &str, name: &str, data: &str) -> Outcome {
    let compensation = Compensation { name: CheckpointName::parse(name).unwrap(), data: data.into() };
    Outcome { compensation: Some(compensation), ..success(body) }
}

impl Case {
    /// Runs `key` as an effect of the run, completing it with `outcome`; a second apart from the
    /// last, so that effects complete in the order they are made.
    async fn effect(&self, key: &str, outcome: Outcome) {
        let s = scope(key);
        let fence = self.acquire(&in_run(&s, key, RUN, 0)).await;
        self.applied(&s, fence, Mutation::Complete(outcome)).await;
        self.clock.advance(Duration::from_secs(1));
    }

    async fn next_task(&self) -> CompensationClaim {
        let lease = Some(Duration::from_secs(10));
        self.guard.claim_compensation(&tenant(), &run_id(), lease).await.unwrap().expect("the run is rolled back")
    }
}

/// A rollback turns each effect of the run that registered a compensation into a task, and each
/// other into *not compensable*; the run is switched off. Workers are handed the tasks newest
/// first; four concurrent workers, one of which takes a task and crashes before running it, run
/// every compensation exactly once (the crashed worker's task is recovered once its lease
/// passed); the rollback is then done, the start audited once, and a second start changes
/// nothing.
pub async fn a_rolled_back_run_compensates_each_effect_once(store: Subject) {
    let c = case(store).await;
    for i in 1..=6 {
        c.effect(&format!("charge-{i}"), undoable("{}", "refund", &format!(r#"{{"charge":{i}}}"#))).await;
    }
    c.effect("log-line", success("{}")).await;
    // A failed effect and an unfinished one are no effects to undo.
    let failed = scope("failed-charge");
    let fence = c.acquire(&in_run(&failed, "f", RUN, 0)).await;
    let failure = Outcome { kind: OutcomeKind::Failure, ..success("{}") };
    c.applied(&failed, fence, Mutation::Fail { retryable: false, outcome: failure }).await;
    let in_flight = c.acquire(&in_run(&scope("in-flight"), "i", RUN, 0)).await;

    let (report, started) = c.guard.start_rollback("admin-key", &tenant(), &run_id(), "runaway".into()).await.unwrap();
    assert!(started);
    let p = report.progress;
    assert_eq!((p.effects, p.pending, p.not_compensable, p.effects_in_flight), (7, 6, 1, 1), "{p:?}");
    let order: Vec<&str> = report.tasks.iter().map(|t| t.effect.scope.key.as_str()).collect();
    assert_eq!(order, ["charge-6", "charge-5", "charge-4", "charge-3", "charge-2", "charge-1"], "newest first");
    assert!(report.tasks.iter().all(|t| t.scope.namespace.as_str() == "prod/payments-agent/_undo"));
    // The run is switched off.
    let after = c.claim(&in_run(&scope("charge-7"), "charge-7", RUN, 0)).await;
    assert!(matches!(after, ClaimOutcome::Denied(Denial::SwitchEngaged { .. })), "{after:?}");

    // A worker takes the newest task and crashes before running it.
    let CompensationClaim::Acquired(crashed) = c.next_task().await else { panic!("no task") };
    assert_eq!(crashed.task.effect.scope.key.as_str(), "charge-6");
    // Four workers run the rest concurrently, each compensation counted where it runs.
    let ran: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let worker = |guard: Guard, ran: Arc<Mutex<BTreeMap<String, u32>>>| async move {
        loop {
            let claimed = guard.claim_compensation(&tenant(), &run_id(), None).await.unwrap().unwrap();
            let held = match claimed {
                CompensationClaim::Acquired(held) => held,
                // Another worker is finishing a task: ask again.
                CompensationClaim::Busy { in_progress, .. } if in_progress > 1 => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                other => return other,
            };
            let TaskHeld { task, acquired } = *held;
            assert_eq!(task.compensation.name.as_str(), "refund");
            *ran.lock().unwrap().entry(task.compensation.data.clone()).or_default() += 1;
            let done = guard.mutate(&task.scope, acquired.fence, Mutation::Complete(success("{}"))).await.unwrap();
            assert!(matches!(done, FencedOutcome::Applied(_)), "{done:?}");
        }
    };
    let workers: Vec<_> = (0..4).map(|_| tokio::spawn(worker(c.guard.clone(), ran.clone()))).collect();
    for w in workers {
        let last = w.await.unwrap();
        assert!(matches!(last, CompensationClaim::Busy { in_progress: 1, .. }), "the crashed task is held: {last:?}");
    }
    assert_eq!(ran.lock().unwrap().len(), 5, "{ran:?}");
    assert!(ran.lock().unwrap().values().all(|n| *n == 1), "each ran once: {ran:?}");
    // The crashed worker's lease passes: the next worker recovers its task, and runs it once.
    c.clock.advance(Duration::from_secs(11));
    let CompensationClaim::Acquired(recovered) = c.next_task().await else { panic!("not recovered") };
    assert_eq!(recovered.task.scope, crashed.task.scope);
    let recovery = recovered.acquired.recovery.as_ref().expect("a recovery");
    assert_eq!(recovery.previous_fence, crashed.acquired.fence);
    let late = c.mutate(&crashed.task.scope, crashed.acquired.fence, Mutation::Complete(success("{}"))).await;
    assert_eq!(late, FencedOutcome::Stale(StaleReason::Superseded), "the crashed worker is fenced off");
    c.applied(&recovered.task.scope, recovered.acquired.fence, Mutation::Complete(success("{}"))).await;

    // Every task ran, but an effect is still in flight: it may yet complete, so the workers
    // wait; it completes without a compensation, and the rollback is done.
    assert!(matches!(c.next_task().await, CompensationClaim::Busy { .. }), "an effect in flight");
    c.applied(&scope("in-flight"), in_flight, Mutation::Complete(success("{}"))).await;
    assert_eq!(c.next_task().await, CompensationClaim::Done { compensated: 6, failed: 0 });
    let report = c.guard.rollback(&tenant(), &run_id()).await.unwrap().unwrap();
    assert!(report.tasks.iter().all(|t| t.state == TaskState::Compensated), "{:?}", report.tasks);
    assert_eq!((report.progress.compensated, report.progress.done()), (6, true));
    // The tasks were claimed in the run's undo run: its usage counts them, each once.
    let undo = c.guard.run(&tenant(), &RunId::parse("run-rb/undo").unwrap()).await.unwrap().expect("the undo run");
    assert_eq!(undo.usage.effects, 6);
    let (again, started) = c.guard.start_rollback("admin-key", &tenant(), &run_id(), "again".into()).await.unwrap();
    assert!(!started);
    assert_eq!(again.rollback.why, "runaway", "a second start changes nothing");
    let page = c.guard.audit_log(&tenant(), &AuditFilter { limit: 100, ..AuditFilter::default() }).await.unwrap();
    let rollbacks = page.items.iter().filter(|e| e.action == "run.rollback").count();
    assert_eq!(rollbacks, 1);
}

/// Starting a rollback is a compare-and-set: eight instances (guards of their own over the one
/// store) start the rollback of the same run at once, twenty rounds of a new run each: in every
/// round exactly one start answers *started*, every other one answers that rollback, and the
/// audit log holds one `run.rollback` entry for the run.
pub async fn concurrent_rollback_starts_start_once(store: Subject) {
    const ACTORS: usize = 8;
    const ROUNDS: usize = 20;
    let clock = store.clock.clone().unwrap_or_default();
    let guards: Vec<Guard> = (0..ACTORS)
        .map(|_| Guard::new(store.store.clone(), clock.clone(), onceguard_core::Limits::default()))
        .collect();
    for round in 0..ROUNDS {
        let run = RunId::parse(&format!("run-start-{round}")).unwrap();
        let starts = guards.iter().enumerate().map(|(i, guard)| {
            let (guard, run) = (guard.clone(), run.clone());
            tokio::spawn(async move {
                guard.start_rollback(&format!("admin-{i}"), &tenant(), &run, format!("start {i}")).await
            })
        });
        let answers: Vec<_> =
            futures::future::join_all(starts).await.into_iter().map(|a| a.expect("the start did not panic")).collect();
        let started: Vec<usize> =
            answers.iter().enumerate().filter(|(_, a)| matches!(a, Ok((_, true)))).map(|(i, _)| i).collect();
        assert_eq!(started.len(), 1, "round {round}: starts that answered started: {started:?}");
        let first = format!("start {}", started[0]);
        for answer in &answers {
            let (report, _) = answer.as_ref().expect("the store answers");
            assert_eq!(report.rollback.why, first, "round {round}: every answer is the one rollback started");
        }
        let filter = AuditFilter { action: Some("run.rollback".into()), limit: MAX_PAGE, ..AuditFilter::default() };
        let page = guards[0].audit_log(&tenant(), &filter).await.unwrap();
        let entries = page.items.iter().filter(|e| e.target == run.as_str()).count();
        assert_eq!(entries, 1, "round {round}: one run.rollback entry");
    }
}

/// Rollbacks are kept with their runs: a tenant's are listed a page at a time in run order,
/// never another tenant's, and the guard lists them newest first; a run has one rollback, read
/// back as started.
pub async fn rollbacks_are_listed_by_run_a_page_at_a_time(store: Subject) {
    let runs = ["run-e", "run-a", "run-g", "run-c", "run-b", "run-f", "run-d"];
    let store_ = store.store.clone();
    let c = case(store).await;
    let other = TenantId::parse("umbrella").unwrap();
    for run in runs {
        c.guard.start_rollback("admin", &tenant(), &RunId::parse(run).unwrap(), format!("why {run}")).await.unwrap();
        c.clock.advance(Duration::from_secs(1));
    }
    c.guard.start_rollback("admin", &other, &RunId::parse("run-a").unwrap(), "elsewhere".into()).await.unwrap();
    let mut listed = Vec::new();
    let mut after: Option<RunId> = None;
    let mut pages = 0;
    loop {
        let page = store_.list_rollbacks(&tenant(), after.as_ref(), 3).await.unwrap();
        pages += 1;
        assert!(page.items.len() <= 3);
        assert!(page.items.iter().all(|r| r.tenant == tenant()), "another tenant's rollback listed");
        listed.extend(page.items.iter().map(|r| r.run.to_string()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let mut sorted = runs.map(str::to_owned).to_vec();
    sorted.sort();
    assert_eq!((listed, pages), (sorted, 3));
    let newest: Vec<String> = c.guard.rollbacks(&tenant()).await.unwrap().iter().map(|r| r.run.to_string()).collect();
    let mut expected = runs.map(str::to_owned).to_vec();
    expected.reverse();
    assert_eq!(newest, expected, "newest first");
    let kept = store_.get_rollback(&other, &RunId::parse("run-a").unwrap()).await.unwrap().expect("kept");
    assert_eq!((kept.why.as_str(), kept.started_by.as_str()), ("elsewhere", "admin"));
    assert!(store_.get_rollback(&other, &RunId::parse("run-b").unwrap()).await.unwrap().is_none());
    // The switches the starts engaged are control documents; the rollbacks are not.
    assert_eq!(store_.list_control().await.unwrap().len(), runs.len() + 1);
}

/// A task lives as long as its effect: a compensation task completed under a namespace whose
/// `max_retention` was lowered below its effect's retention is never handed out again while the
/// effect is kept.
pub async fn a_task_lives_as_long_as_its_effect(store: Subject) {
    let c = case(store).await;
    let s = scope("charge-long");
    let req = ClaimRequest { retention: Duration::from_secs(60), ..in_run(&s, "charge-long", RUN, 0) };
    let fence = c.acquire(&req).await;
    c.applied(&s, fence, Mutation::Complete(undoable("{}", "refund", "{}"))).await;
    c.guard.start_rollback("admin-key", &tenant(), &run_id(), "runaway".into()).await.unwrap();
    let lowered = SettingsEntry {
        tenant: tenant(),
        namespace_prefix: Some(Namespace::parse("prod").unwrap()),
        settings: Settings {
            default_retention: Some(Duration::from_secs(1)),
            max_retention: Some(Duration::from_secs(2)),
            ..Settings::default()
        },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(lowered, None).await.unwrap();
    let CompensationClaim::Acquired(held) = c.next_task().await else { panic!("no task") };
    c.applied(&held.task.scope, held.acquired.fence, Mutation::Complete(success("{}"))).await;
    for _ in 0..5 {
        c.clock.advance(Duration::from_secs(10));
        let next = c.next_task().await;
        assert_eq!(next, CompensationClaim::Done { compensated: 1, failed: 0 }, "never handed out again");
    }
}

/// A rollback is done only when no effect of its run can still complete: an effect in flight
/// when it started keeps the workers waiting (`busy`), and becomes a task once it completes.
/// And it has a cut-off: an effect the run makes after it started (its switch released) is
/// none of its tasks.
pub async fn a_rollback_waits_for_its_effects_and_ends_at_its_start(store: Subject) {
    let c = case(store).await;
    let late = scope("charge-late");
    let fence = c.acquire(&in_run(&late, "charge-late", RUN, 0)).await;
    c.clock.advance(Duration::from_secs(1));
    c.guard.start_rollback("admin-key", &tenant(), &run_id(), "runaway".into()).await.unwrap();
    let waiting = c.next_task().await;
    assert!(matches!(waiting, CompensationClaim::Busy { .. }), "an effect in flight: {waiting:?}");
    let report = c.guard.rollback(&tenant(), &run_id()).await.unwrap().unwrap();
    assert!(!report.progress.done(), "not done while an effect is in flight: {:?}", report.progress);
    c.applied(&late, fence, Mutation::Complete(undoable("{}", "refund", "{}"))).await;
    let CompensationClaim::Acquired(held) = c.next_task().await else { panic!("the late effect's task") };
    assert_eq!(held.task.effect.scope, late);
    c.applied(&held.task.scope, held.acquired.fence, Mutation::Complete(success("{}"))).await;
    assert_eq!(c.next_task().await, CompensationClaim::Done { compensated: 1, failed: 0 });

    // The switch released, the run goes on: its new effects are not the old rollback's tasks.
    let target = SwitchTarget::Run { run: run_id() };
    c.guard.release_switch("admin-key", &tenant(), &target, Some("fixed".into())).await.unwrap();
    c.clock.advance(Duration::from_secs(3));
    c.effect("charge-after", undoable("{}", "refund", "{}")).await;
    assert_eq!(c.next_task().await, CompensationClaim::Done { compensated: 1, failed: 0 });
    let report = c.guard.rollback(&tenant(), &run_id()).await.unwrap().unwrap();
    assert_eq!(report.tasks.len(), 1, "{:?}", report.tasks);
    assert!(report.progress.done());
}

/// Compensations ask no approver (the admin who started the rollback approved them), and one
/// refused task never blocks the others: with a kill switch on the newest effect's namespace,
/// the older effect's task is handed out; the refusal is answered once nothing else is left.
pub async fn compensations_ask_no_approver_and_a_refused_task_blocks_none(store: Subject) {
    let c = case(store).await;
    let approvals = SettingsEntry {
        tenant: tenant(),
        namespace_prefix: Some(Namespace::parse("prod/payments-agent").unwrap()),
        settings: Settings { approval_required: Some(true), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.effect("charge-a", undoable("{}", "refund", "{}")).await;
    let other = scope_in("acme", "prod/mail-agent", "mail-b");
    let fence = c.acquire(&in_run(&other, "mail-b", RUN, 0)).await;
    c.applied(&other, fence, Mutation::Complete(undoable("{}", "unsend", "{}"))).await;
    c.guard.put_settings(approvals, None).await.unwrap();
    c.guard.start_rollback("admin-key", &tenant(), &run_id(), "runaway".into()).await.unwrap();
    let target = SwitchTarget::Namespace { prefix: Namespace::parse("prod/mail-agent").unwrap() };
    c.guard.engage_switch("admin-key", &tenant(), target, "freeze mail".into(), false).await.unwrap();

    let CompensationClaim::Acquired(held) = c.next_task().await else { panic!("the task not refused") };
    assert_eq!(held.task.effect.scope, scope("charge-a"), "the refused newest task blocks nothing");
    c.applied(&held.task.scope, held.acquired.fence, Mutation::Complete(success("{}"))).await;
    let left = c.next_task().await;
    assert!(
        matches!(left, CompensationClaim::Refused(Denial::SwitchEngaged { .. })),
        "what is left is refused, and says why: {left:?}"
    );
}

/// The keys of compensation tasks are reserved: no claim through the front ends' door (alone
/// or in a batch) reaches a namespace with a segment `_undo`, so no caller can take a task and
/// complete it without running its compensation.
pub async fn task_namespaces_are_reserved(store: Subject) {
    let c = case(store).await;
    c.effect("charge-r", undoable("{}", "refund", "{}")).await;
    let (report, _) = c.guard.start_rollback("admin-key", &tenant(), &run_id(), "runaway".into()).await.unwrap();
    let task = &report.tasks[0];
    let claim = onceguard_core::Claim::new(task.scope.clone(), task.fingerprint.clone());
    let refused = c.guard.claim(claim.clone()).await;
    assert!(matches!(&refused, Err(onceguard_core::GuardError::Invalid(e)) if e.field == "namespace"), "{refused:?}");
    let refused = c.guard.claim_batch(vec![claim]).await;
    assert!(matches!(&refused, Err(onceguard_core::GuardError::Invalid(e)) if e.field == "namespace"), "{refused:?}");
    let elsewhere = scope_in("acme", "prod/_undo/x", "k");
    let refused = c.guard.claim(onceguard_core::Claim::new(elsewhere, Fingerprint::sha256(b"x"))).await;
    assert!(refused.is_err(), "any namespace with the segment is reserved");
    let CompensationClaim::Acquired(_) = c.next_task().await else { panic!("the worker still gets the task") };
}

/// A compensation that fails permanently is kept and shown as failed, and never handed out
/// again; one that fails retryably is handed out again. A kill switch on the effects'
/// namespace refuses the tasks too; another run is not being rolled back.
pub async fn a_compensation_failing_permanently_is_kept(store: Subject) {
    let c = case(store).await;
    c.effect("ship-1", undoable("{}", "cancel-shipment", "{}")).await;
    c.effect("ship-2", undoable("{}", "cancel-shipment", "{}")).await;
    let other = RunId::parse("other-run").unwrap();
    assert_eq!(c.guard.claim_compensation(&tenant(), &other, None).await.unwrap(), None);
    c.guard.start_rollback("admin-key", &tenant(), &run_id(), "bad deploy".into()).await.unwrap();

    let CompensationClaim::Acquired(newest) = c.next_task().await else { panic!("no task") };
    assert_eq!(newest.task.effect.scope.key.as_str(), "ship-2");
    let refusal = Outcome { kind: OutcomeKind::Failure, ..success(r#"{"error":"already delivered"}"#) };
    let failed = Mutation::Fail { retryable: false, outcome: refusal };
    c.applied(&newest.task.scope, newest.acquired.fence, failed).await;
    let CompensationClaim::Acquired(older) = c.next_task().await else { panic!("no task") };
    assert_eq!(older.task.effect.scope.key.as_str(), "ship-1");
    let retry = Mutation::Fail { retryable: true, outcome: success("{}") };
    c.applied(&older.task.scope, older.acquired.fence, retry).await;
    let CompensationClaim::Acquired(again) = c.next_task().await else { panic!("a released task is handed out") };
    assert_eq!((again.task.scope.clone(), again.acquired.attempt), (older.task.scope.clone(), 2));
    c.applied(&again.task.scope, again.acquired.fence, Mutation::Complete(success("{}"))).await;

    assert_eq!(c.next_task().await, CompensationClaim::Done { compensated: 1, failed: 1 });
    let report = c.guard.rollback(&tenant(), &run_id()).await.unwrap().unwrap();
    let states: Vec<TaskState> = report.tasks.iter().map(|t| t.state).collect();
    assert_eq!(states, [TaskState::Failed, TaskState::Compensated]);
    assert_eq!((report.progress.failed, report.progress.compensated, report.progress.done()), (1, 1, true));

    // A switch on the namespace covers its tasks (the run's own switch does not).
    c.effect_outside_the_run_then_roll_back().await;
}

impl Case {
    async fn effect_outside_the_run_then_roll_back(&self) {
        let run = RunId::parse("run-2").unwrap();
        let s = scope("charge-9");
        let fence = self.acquire(&in_run(&s, "charge-9", "run-2", 0)).await;
        self.applied(&s, fence, Mutation::Complete(undoable("{}", "refund", "{}"))).await;
        // The compensation is part of the completion: repeated as it was, the same answer;
        // with other data, the attempt finished differently.
        self.applied(&s, fence, Mutation::Complete(undoable("{}", "refund", "{}"))).await;
        let other = self.mutate(&s, fence, Mutation::Complete(undoable("{}", "refund", "1"))).await;
        assert_eq!(other, FencedOutcome::Stale(StaleReason::Finished));
        self.guard.start_rollback("admin-key", &tenant(), &run, "second".into()).await.unwrap();
        let target = SwitchTarget::Namespace { prefix: Namespace::parse("prod").unwrap() };
        self.guard.engage_switch("admin-key", &tenant(), target, "freeze".into(), false).await.unwrap();
        let refused = self.guard.claim_compensation(&tenant(), &run, None).await.unwrap().unwrap();
        assert!(matches!(refused, CompensationClaim::Refused(Denial::SwitchEngaged { .. })), "{refused:?}");
    }
}

/// Counts what the guard reports: per mode, per answer enforcement gave or would have given,
/// and the callers told to proceed.
#[derive(Default)]
struct Counted(Mutex<BTreeMap<(&'static str, &'static str), u64>>);

impl Observer for Counted {
    fn claimed(&self, _: &Scope, outcome: &ClaimOutcome, mode: Mode) {
        let mut counts = self.0.lock().unwrap();
        *counts.entry((mode.as_str(), outcome.enforced().name())).or_default() += 1;
        if matches!(outcome, ClaimOutcome::Proceed(_)) {
            *counts.entry((mode.as_str(), PROCEEDED)).or_default() += 1;
        }
    }

    fn stale(&self, _: &Scope, _: onceguard_core::FencedOp, _: Fence, _: StaleReason) {}
}

/// The entry of [`Counted`] for the callers told to proceed.
const PROCEEDED: &str = "told to proceed";

impl Counted {
    fn told_to_proceed(&self, mode: Mode) -> u64 {
        self.0.lock().unwrap().get(&(mode.as_str(), PROCEEDED)).copied().unwrap_or(0)
    }

    fn get(&self, mode: &str, answer: AnswerKind) -> u64 {
        self.0.lock().unwrap().iter().filter(|((m, a), _)| *m == mode && *a == answer.as_str()).map(|(_, n)| n).sum()
    }
}

fn mode_of(c: &Case, prefix: &str, mode: Mode) -> SettingsEntry {
    SettingsEntry {
        tenant: tenant(),
        namespace_prefix: Some(Namespace::parse(prefix).unwrap()),
        settings: Settings { mode: Some(mode), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    }
}

/// In observe mode every claim is decided and recorded as in enforce mode, but the caller
/// proceeds wherever enforcement would have stopped it (a duplicate in flight, a replay, a
/// mismatch, a spent budget), holding nothing; what enforcement would have answered is
/// reported exactly. A kill switch still refuses. Back in enforce mode the same key replays.
pub async fn observe_mode_counts_each_would_be_outcome(store: Subject) {
    let counted = Arc::new(Counted::default());
    let c = case(store).await;
    let c = Case { guard: c.guard.with_observer(counted.clone()), clock: c.clock };
    c.guard.put_settings(mode_of(&c, "prod", Mode::Observe), None).await.unwrap();
    let s = scope("email-1");
    let req = request(&s, "send the welcome email");
    let fence = c.acquire(&req).await;
    let proceeds = |o: &ClaimOutcome, would: AnswerKind| matches!(o, ClaimOutcome::Proceed(w) if w.answer() == would);
    let dup = c.claim(&req).await;
    assert!(proceeds(&dup, AnswerKind::InFlight), "{dup:?}");
    // A claim asking to wait does not wait in observe mode.
    let waited = c.guard.claim(crate::through_the_door(&req, Duration::from_secs(30))).await.unwrap();
    assert!(proceeds(&waited, AnswerKind::InFlight), "{waited:?}");
    c.applied(&s, fence, Mutation::Complete(success("{}"))).await;
    for _ in 0..3 {
        let replay = c.claim(&req).await;
        assert!(proceeds(&replay, AnswerKind::Replay), "{replay:?}");
    }
    let other = c.claim(&request(&s, "send another email")).await;
    assert!(proceeds(&other, AnswerKind::Mismatch), "{other:?}");
    // A batch answers each claim as alone.
    let batch = vec![
        crate::through_the_door(&req, Duration::ZERO),
        crate::through_the_door(&request(&scope("email-2"), "e2"), Duration::ZERO),
    ];
    let answers = c.claim_batch(batch).await;
    assert!(proceeds(&answers[0], AnswerKind::Replay), "{answers:?}");
    assert!(matches!(answers[1], ClaimOutcome::Acquired(_)), "{answers:?}");
    // A spent budget proceeds too; the record keeps what enforcement decided.
    let budget = Budget { max_effects: Some(1), ..Budget::default() };
    c.guard.set_budget("admin-key", &tenant(), &RunId::parse("r").unwrap(), budget, None).await.unwrap();
    c.acquire(&in_run(&scope("b-1"), "b-1", "r", 0)).await;
    let spent = c.claim(&in_run(&scope("b-2"), "b-2", "r", 0)).await;
    assert!(proceeds(&spent, AnswerKind::Denied), "{spent:?}");
    assert!(c.get(&scope("b-2")).await.is_none(), "nothing was acquired for it");
    // A kill switch is never observe-only.
    let target = SwitchTarget::Namespace { prefix: Namespace::parse("prod/payments-agent").unwrap() };
    c.guard.engage_switch("admin-key", &tenant(), target.clone(), "stop".into(), false).await.unwrap();
    let stopped = c.claim(&req).await;
    assert!(matches!(stopped, ClaimOutcome::Denied(Denial::SwitchEngaged { .. })), "{stopped:?}");
    c.guard.release_switch("admin-key", &tenant(), &target, None).await.unwrap();

    assert_eq!(counted.get("observe", AnswerKind::Acquired), 3);
    assert_eq!(counted.get("observe", AnswerKind::InFlight), 2);
    assert_eq!(counted.get("observe", AnswerKind::Replay), 4);
    assert_eq!(counted.get("observe", AnswerKind::Mismatch), 1);
    assert_eq!(counted.get("observe", AnswerKind::Denied), 2, "the budget's and the switch's");
    assert_eq!(counted.get("enforce", AnswerKind::Acquired), 0);

    c.guard.put_settings(mode_of(&c, "prod", Mode::Enforce), None).await.unwrap();
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Replay(_)));
    assert_eq!(counted.get("enforce", AnswerKind::Replay), 1);
}

/// Switching a namespace between modes under load: workers claim the same keys while the mode
/// flips under them. Whatever the mode, each key is acquired (and its effect recorded) once; a
/// caller is told to proceed only by a claim decided in observe mode, every proceed is reported
/// as what enforcement would have answered, and every claim is reported once. Once the
/// namespace is enforced again, every key replays.
pub async fn switching_modes_under_load_keeps_each_key_acquired_once(store: Subject) {
    const KEYS: usize = 8;
    const PASSES: usize = 6;
    const WORKERS: usize = 4;
    let counted = Arc::new(Counted::default());
    let c = case(store).await;
    let c = Case { guard: c.guard.with_observer(counted.clone()), clock: c.clock };
    c.guard.put_settings(mode_of(&c, "prod", Mode::Observe), None).await.unwrap();
    let acquired: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let proceeded = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (guard, acquired, proceeded) = (c.guard.clone(), acquired.clone(), proceeded.clone());
            tokio::spawn(async move {
                for _ in 0..PASSES {
                    for k in 0..KEYS {
                        let s = scope(&format!("doc-{k}"));
                        let req = request(&s, &format!("embed doc {k}"));
                        match guard.claim(crate::through_the_door(&req, Duration::ZERO)).await.unwrap() {
                            ClaimOutcome::Acquired(a) => {
                                *acquired.lock().unwrap().entry(s.key.to_string()).or_default() += 1;
                                let done = guard.mutate(&s, a.fence, Mutation::Complete(success("{}"))).await;
                                assert!(matches!(done.unwrap(), FencedOutcome::Applied(_)));
                            }
                            ClaimOutcome::Proceed(_) => {
                                proceeded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            ClaimOutcome::Replay(_) | ClaimOutcome::InFlight(_) => {}
                            other => panic!("unexpected {other:?}"),
                        }
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    // The mode flips while the workers claim.
    for flip in 0..10 {
        let mode = if flip % 2 == 0 { Mode::Enforce } else { Mode::Observe };
        c.guard.put_settings(mode_of(&c, "prod", mode), None).await.unwrap();
        tokio::task::yield_now().await;
    }
    for w in workers {
        w.await.unwrap();
    }
    let acquired = acquired.lock().unwrap().clone();
    assert_eq!(acquired.len(), KEYS, "{acquired:?}");
    assert!(acquired.values().all(|n| *n == 1), "each key acquired once: {acquired:?}");
    let proceeded = proceeded.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(counted.told_to_proceed(Mode::Enforce), 0, "a caller told to proceed by an enforced claim");
    assert_eq!(counted.told_to_proceed(Mode::Observe), proceeded, "each proceed reported once");
    let stopped_in_observe: u64 =
        [AnswerKind::Replay, AnswerKind::InFlight].iter().map(|a| counted.get("observe", *a)).sum();
    assert_eq!(stopped_in_observe, proceeded, "each reported as what enforcement would have answered");
    let all: u64 = AnswerKind::ALL.iter().map(|a| counted.get("observe", *a) + counted.get("enforce", *a)).sum();
    assert_eq!(all, (PASSES * WORKERS * KEYS) as u64, "every claim reported once");
    c.guard.put_settings(mode_of(&c, "prod", Mode::Enforce), None).await.unwrap();
    for k in 0..KEYS {
        let req = request(&scope(&format!("doc-{k}")), &format!("embed doc {k}"));
        assert!(matches!(c.claim(&req).await, ClaimOutcome::Replay(_)), "doc-{k} replays");
    }
}

/// A compensation task whose worker vanished is taken over by the next worker whatever the
/// namespace's recovery policy (`ask` here, on the prefix the task namespace is in): a task is
/// the rollback's own, its compensation registered to run once.
pub async fn a_task_is_recovered_whatever_the_recovery_policy(store: Subject) {
    let c = case(store).await;
    let entry = SettingsEntry {
        tenant: tenant(),
        namespace_prefix: Some(Namespace::parse("prod").unwrap()),
        settings: Settings { recovery: Some(onceguard_core::control::RecoveryPolicy::Ask), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(entry, None).await.unwrap();
    c.effect("charge-1", undoable("{}", "refund", r#"{"charge":1}"#)).await;
    c.guard.start_rollback("admin-key", &tenant(), &run_id(), "runaway".into()).await.unwrap();
    let CompensationClaim::Acquired(crashed) = c.next_task().await else { panic!("no task") };
    c.clock.advance(Duration::from_secs(11));
    let CompensationClaim::Acquired(recovered) = c.next_task().await else { panic!("the task was not recovered") };
    assert_eq!(recovered.task.scope, crashed.task.scope);
    assert_eq!(recovered.acquired.recovery.map(|r| r.previous_fence), Some(crashed.acquired.fence));
}
