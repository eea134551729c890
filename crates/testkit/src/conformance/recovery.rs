//! Conformance cases of the recovery policy (`rerun`, `verify`, `ask`): what may take over a key
//! whose last attempt did not finish, decided in the store's atomic claim, on every store.

use onceguard_core::approval::{Approval, ApprovalState};
use onceguard_core::control::{RecoveryPolicy, Settings, SettingsEntry};
use onceguard_core::protocol::RecoveryGate;
use onceguard_core::{Claim, GuardError};

use super::*;

/// Concurrent claimants of each stuck key in the cases that race.
const ACTORS: usize = 8;
/// Rounds (keys) of the cases that race.
const ROUNDS: usize = 6;

/// Sets the recovery policy of the cases' namespace prefix `prod`.
async fn recovery_policy(c: &Case, policy: RecoveryPolicy) {
    let entry = SettingsEntry {
        tenant: TenantId::parse("acme").unwrap(),
        namespace_prefix: Some(Namespace::parse("prod").unwrap()),
        settings: Settings { recovery: Some(policy), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(entry, None).await.unwrap();
}

fn with_hook(req: &ClaimRequest) -> Claim {
    Claim { verify_hook: true, ..crate::through_the_door(req, Duration::ZERO) }
}

/// A key acquired, a checkpoint saved, and its lease passed: stuck. Answers the attempt's fence.
async fn stuck(c: &Case, req: &ClaimRequest) -> Fence {
    let fence = c.acquire(req).await;
    c.applied(&req.scope, fence, checkpoint("charged-card", r#"{"charge":"ch_1"}"#)).await;
    c.clock.advance(LEASE);
    fence
}

/// `ACTORS` claims of `claim` at once; answers them.
async fn at_once(c: &Case, claim: Claim) -> Vec<ClaimOutcome> {
    let claims: Vec<_> = (0..ACTORS)
        .map(|_| {
            let (guard, claim) = (c.guard.clone(), claim.clone());
            tokio::spawn(async move { guard.claim(claim).await.unwrap() })
        })
        .collect();
    let mut answers = Vec::new();
    for claim in claims {
        answers.push(claim.await.unwrap());
    }
    answers
}

impl Case {
    async fn pending_recovery(&self, req: &ClaimRequest) -> Approval {
        match self.claim(req).await {
            ClaimOutcome::PendingApproval(p) => p.approval,
            other => panic!("expected pending_approval, got {other:?}"),
        }
    }
}

/// The store's claim decides with the recovery gate on the record as it is there: a stuck
/// record is refused to a claim that does not verify and to one without the approved re-run of
/// that very attempt (nothing written: the record keeps its fence, attempt and checkpoints), and
/// taken over by the grant of its fence only. A record held, completed or absent answers as
/// always, whatever the gate.
pub async fn the_recovery_gate_decides_in_the_stores_claim(store: Subject) {
    let c = case(store.clone()).await;
    let s = scope("gate-1");
    let req = request(&s, "charge 1");
    let held = c.acquire(&req).await;
    let gated = |gate: RecoveryGate| ClaimRequest { recovery: gate, ..req.clone() };
    let now = || c.guard.clock().now();
    for gate in [RecoveryGate::NeedsVerify, RecoveryGate::Ask(None), RecoveryGate::Ask(Some(held))] {
        assert!(matches!(store.claim(&gated(gate), now()).await.unwrap(), ClaimOutcome::InFlight(_)));
    }
    c.clock.advance(LEASE);
    let before = c.get(&s).await.unwrap();
    match store.claim(&gated(RecoveryGate::NeedsVerify), now()).await.unwrap() {
        ClaimOutcome::Denied(Denial::RecoveryNeedsVerify { previous_fence, previous_attempt }) => {
            assert_eq!((previous_fence, previous_attempt), (held, 1));
        }
        other => panic!("a claim that does not verify took a stuck record over: {other:?}"),
    }
    for gate in [RecoveryGate::Ask(None), RecoveryGate::Ask(Some(Fence(held.0 + 1000)))] {
        match store.claim(&gated(gate.clone()), now()).await.unwrap() {
            ClaimOutcome::Denied(Denial::RecoveryNeedsDecision { previous_fence, previous_attempt }) => {
                assert_eq!((previous_fence, previous_attempt), (held, 1));
            }
            other => panic!("{gate:?} took a stuck record over: {other:?}"),
        }
    }
    // Another request is still a mismatch, before any gate.
    let other = ClaimRequest { recovery: RecoveryGate::NeedsVerify, ..request(&s, "charge 2") };
    assert_eq!(store.claim(&other, now()).await.unwrap(), ClaimOutcome::Mismatch);
    assert_eq!(c.get(&s).await.unwrap(), before, "nothing was written");
    let ClaimOutcome::Acquired(a) = store.claim(&gated(RecoveryGate::Ask(Some(held))), now()).await.unwrap() else {
        panic!("the grant of the attempt's fence did not take it over")
    };
    let recovery = a.recovery.expect("a recovery");
    assert_eq!((recovery.previous_fence, a.attempt), (held, 2));
    // The grant of that fence takes it over once: the fence moved on.
    assert!(matches!(
        store.claim(&gated(RecoveryGate::Ask(Some(held))), now()).await.unwrap(),
        ClaimOutcome::InFlight(_)
    ));
    c.applied(&s, a.fence, Mutation::Complete(success("charged"))).await;
    for gate in [RecoveryGate::NeedsVerify, RecoveryGate::Ask(None)] {
        assert!(matches!(store.claim(&gated(gate), now()).await.unwrap(), ClaimOutcome::Replay(_)));
    }
    let fresh = ClaimRequest { recovery: RecoveryGate::Ask(None), ..request(&scope("gate-2"), "x") };
    assert!(matches!(store.claim(&fresh, now()).await.unwrap(), ClaimOutcome::Acquired(_)));
}

/// With the policy `verify`, only a caller that verifies (a `verify` hook) takes over a stuck
/// key: of 8 concurrent claims that do not verify, none does, round after round, and nothing is
/// written; one that verifies recovers it, with the last checkpoint. Outside the prefix, and with
/// `rerun`, any claim recovers as before.
pub async fn verify_lets_only_a_verifying_caller_recover(store: Subject) {
    let c = case(store).await;
    recovery_policy(&c, RecoveryPolicy::Verify).await;
    for round in 0..ROUNDS {
        let s = scope(&format!("verify-{round}"));
        let req = request(&s, "send the invoice");
        let first = stuck(&c, &req).await;
        let before = c.get(&s).await.unwrap();
        for answer in at_once(&c, crate::through_the_door(&req, Duration::ZERO)).await {
            match answer {
                ClaimOutcome::Denied(Denial::RecoveryNeedsVerify { previous_fence, .. }) => {
                    assert_eq!(previous_fence, first);
                }
                other => panic!("round {round}: a caller without a verify hook got {other:?}"),
            }
        }
        assert_eq!(c.get(&s).await.unwrap(), before, "round {round}: nothing was written");
        let verifying = at_once(&c, with_hook(&req)).await;
        let recovered: Vec<_> = verifying.iter().filter(|a| matches!(a, ClaimOutcome::Acquired(_))).collect();
        assert_eq!(recovered.len(), 1, "round {round}: {verifying:?}");
        let ClaimOutcome::Acquired(a) = recovered[0] else { unreachable!() };
        let cp = a.recovery.as_ref().and_then(|r| r.last_checkpoint.as_ref()).expect("the last checkpoint");
        assert_eq!(cp.name.as_str(), "charged-card");
        assert!(verifying.iter().all(|a| matches!(a, ClaimOutcome::Acquired(_) | ClaimOutcome::InFlight(_))));
    }
    let outside = request(&scope_in("acme", "staging/mail", "verify-x"), "send");
    stuck(&c, &outside).await;
    assert!(matches!(c.claim(&outside).await, ClaimOutcome::Acquired(a) if a.recovery.is_some()));
}

/// With the policy `ask`, a claim of a stuck key records one pending approval of its recovery
/// (the attempt's fence, number, reason and last checkpoint) and acquires nothing. Approved, of
/// 8 concurrent claims exactly one re-runs it (the others find it in flight), round after
/// round; the re-run's own crash asks again rather than running on the first approval.
pub async fn ask_turns_a_recovery_into_one_approved_rerun(store: Subject) {
    let c = case(store).await;
    recovery_policy(&c, RecoveryPolicy::Ask).await;
    let tenant = TenantId::parse("acme").unwrap();
    for round in 0..ROUNDS {
        let s = scope(&format!("ask-{round}"));
        let req = request(&s, "charge 20 EUR");
        let first = stuck(&c, &req).await;
        let before = c.get(&s).await.unwrap();
        let asked: Vec<_> = at_once(&c, crate::through_the_door(&req, Duration::ZERO)).await;
        let mut ids = Vec::new();
        for answer in asked {
            match answer {
                ClaimOutcome::PendingApproval(p) => ids.push(p.approval.id),
                other => panic!("round {round}: a claim of a stuck key under ask got {other:?}"),
            }
        }
        ids.dedup();
        assert_eq!(ids.len(), 1, "round {round}: one approval asked: {ids:?}");
        assert_eq!(c.get(&s).await.unwrap(), before, "round {round}: nothing was written");
        let pending = c.pending_recovery(&req).await;
        let ask = pending.recovery.clone().expect("an approval of a recovery");
        assert_eq!((ask.previous_fence, ask.previous_attempt, ask.reason.as_str()), (first, 1, "lease_expired"));
        assert_eq!(ask.last_checkpoint.as_ref().map(|n| n.as_str()), Some("charged-card"));
        assert_eq!(pending.fingerprint, before.fingerprint);
        c.guard
            .decide_approval(&tenant, &pending.id, true, "admin-key", "the charge did not go out".into())
            .await
            .unwrap();
        let answers = at_once(&c, crate::through_the_door(&req, Duration::ZERO)).await;
        let reruns: Vec<_> = answers
            .iter()
            .filter_map(|a| match a {
                ClaimOutcome::Acquired(a) => Some(a.clone()),
                ClaimOutcome::InFlight(_) => None,
                other => panic!("round {round}: an approved recovery answered {other:?}"),
            })
            .collect();
        assert_eq!(reruns.len(), 1, "round {round}: exactly one re-run: {answers:?}");
        assert_eq!(reruns[0].recovery.as_ref().map(|r| r.previous_fence), Some(first));
        if round % 2 == 0 {
            c.applied(&s, reruns[0].fence, Mutation::Complete(success("charged"))).await;
            assert!(matches!(c.claim(&req).await, ClaimOutcome::Replay(_)));
        } else {
            // The re-run crashed too: its recovery is asked again, never run on the approval
            // of the attempt before it.
            c.clock.advance(LEASE);
            let again = c.pending_recovery(&req).await;
            assert_ne!(again.id, pending.id);
            assert_eq!(again.recovery.map(|r| (r.previous_fence, r.previous_attempt)), Some((reruns[0].fence, 2)));
            assert_eq!(c.get(&s).await.unwrap().fence, reruns[0].fence);
        }
    }
}

/// A person may instead fail the attempt (deny) or mark it done (reconcile): the key then
/// replays a permanent failure saying who decided and why, or completes, marked reconciled,
/// with the result given; every later claim replays it and nothing runs. Both are audited; only
/// an approval of a recovery can be reconciled.
pub async fn ask_fails_or_reconciles_a_recovery_by_decision(store: Subject) {
    let c = case(store).await;
    recovery_policy(&c, RecoveryPolicy::Ask).await;
    let tenant = TenantId::parse("acme").unwrap();
    let failed = request(&scope("ask-fail"), "email 7");
    stuck(&c, &failed).await;
    let asked = c.pending_recovery(&failed).await;
    let denied =
        c.guard.decide_approval(&tenant, &asked.id, false, "admin-key", "the mail server bounced it".into()).await;
    assert_eq!(denied.unwrap().state(c.clock.now()), ApprovalState::Denied);
    match c.claim(&failed).await {
        ClaimOutcome::Replay(r) => {
            assert_eq!(r.outcome.kind, OutcomeKind::Failure);
            let body = String::from_utf8(r.outcome.body).unwrap();
            assert!(body.contains("recovery_failed") && body.contains("the mail server bounced it"), "{body}");
        }
        other => panic!("a failed recovery answered {other:?}"),
    }

    let done = request(&scope("ask-done"), "charge 9");
    stuck(&c, &done).await;
    let asked = c.pending_recovery(&done).await;
    let result = serde_json::json!({ "charge": "ch_9" });
    let reconciled = c
        .guard
        .reconcile_recovery(&tenant, &asked.id, "admin-key", "the provider shows ch_9".into(), Some(result))
        .await
        .unwrap();
    assert_eq!(reconciled.state(c.clock.now()), ApprovalState::Reconciled);
    for _ in 0..2 {
        match c.claim(&done).await {
            ClaimOutcome::Replay(r) => {
                assert!(r.outcome.reconciled);
                assert_eq!(r.outcome.body, br#"{"charge":"ch_9"}"#);
                assert_eq!(r.attempt, 2);
            }
            other => panic!("a reconciled recovery answered {other:?}"),
        }
    }
    let page = c.guard.audit_log(&tenant, &AuditFilter { limit: 100, ..AuditFilter::default() }).await.unwrap();
    let actions: Vec<_> = page.items.iter().map(|e| e.action.as_str()).collect();
    assert!(actions.contains(&"approval.deny") && actions.contains(&"approval.reconcile"), "{actions:?}");

    // Marked done without a result: reconciled (as the store keeps it), replaying null.
    let bare = request(&scope("ask-bare"), "ping 3");
    stuck(&c, &bare).await;
    let asked = c.pending_recovery(&bare).await;
    c.guard.reconcile_recovery(&tenant, &asked.id, "admin-key", "it went out".into(), None).await.unwrap();
    let kept = c.guard.approval(&tenant, &asked.id).await.unwrap().expect("kept");
    assert_eq!(kept.state(c.clock.now()), ApprovalState::Reconciled, "as the store keeps it: {kept:?}");
    match c.claim(&bare).await {
        ClaimOutcome::Replay(r) => assert!(r.outcome.reconciled && r.outcome.body == b"null", "{r:?}"),
        other => panic!("a recovery reconciled without a result answered {other:?}"),
    }

    // An approval of a call (not of a recovery) cannot be reconciled.
    let entry = SettingsEntry {
        tenant: tenant.clone(),
        namespace_prefix: Some(Namespace::parse("prod/approved").unwrap()),
        settings: Settings { approval_required: Some(true), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(entry, None).await.unwrap();
    let call = request(&scope_in("acme", "prod/approved", "k"), "refund");
    let ClaimOutcome::PendingApproval(p) = c.claim(&call).await else { panic!("not pending") };
    match c.guard.reconcile_recovery(&tenant, &p.approval.id, "admin-key", "done".into(), None).await {
        Err(GuardError::Invalid(e)) => assert_eq!(e.field, "approval"),
        other => panic!("an approval of a call was reconciled: {other:?}"),
    }
}

/// A denial whose writer took the record over and stopped before ending it (its lease passed)
/// is written by the next claim: the key replays the failure, and no new approval is asked.
pub async fn a_decided_recovery_is_written_by_the_next_claim_if_its_writer_stopped(store: Subject) {
    let c = case(store.clone()).await;
    recovery_policy(&c, RecoveryPolicy::Ask).await;
    let tenant = TenantId::parse("acme").unwrap();
    let req = request(&scope("ask-crash"), "email 9");
    let first = stuck(&c, &req).await;
    let asked = c.pending_recovery(&req).await;
    // The writer's takeover, as a decider that stopped right after it would leave it: the
    // decision written, the record taken over with the grant and the approval's id.
    let decision = onceguard_core::approval::Decision {
        approved: false,
        by: "admin-key".into(),
        why: "bounced".into(),
        at: c.clock.now(),
        reconciled: false,
        result: None,
    };
    let decided = Approval { decision: Some(decision), ..asked.clone() };
    assert!(store.put_approval(Some(&asked), &decided, None, c.guard.clock().now()).await.unwrap());
    let take = ClaimRequest {
        approval: Some(onceguard_core::protocol::ApprovalGate::Granted(asked.id.clone())),
        recovery: RecoveryGate::Ask(Some(first)),
        ..req.clone()
    };
    let ClaimOutcome::Acquired(taken) = store.claim(&take, c.guard.clock().now()).await.unwrap() else {
        panic!("the grant did not take the record over")
    };
    c.clock.advance(LEASE);
    match c.claim(&req).await {
        ClaimOutcome::Replay(r) => {
            assert_eq!(r.outcome.kind, OutcomeKind::Failure);
            assert!(r.fence > taken.fence, "written under a fence of its own");
        }
        other => panic!("the stopped writer's decision was not written: {other:?}"),
    }
    let kept = c.guard.approval(&tenant, &asked.id).await.unwrap().expect("kept");
    assert_eq!(kept.state(c.clock.now()), ApprovalState::Denied, "no new approval was asked");
}

/// In a namespace that needs approvals and asks for recoveries: `req`'s call approved and
/// acquired, its holder vanished, and the re-run approved. Answers the first attempt's fence
/// and the approval of its recovery.
async fn approved_recovery_of_an_approved_call(c: &Case, req: &ClaimRequest) -> (Fence, Approval) {
    let tenant = TenantId::parse("acme").unwrap();
    let entry = SettingsEntry {
        tenant: tenant.clone(),
        namespace_prefix: Some(Namespace::parse("prod").unwrap()),
        settings: Settings {
            recovery: Some(RecoveryPolicy::Ask),
            approval_required: Some(true),
            ..Settings::default()
        },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(entry, None).await.unwrap();
    let ClaimOutcome::PendingApproval(call) = c.claim(req).await else { panic!("the call was not asked") };
    c.guard.decide_approval(&tenant, &call.approval.id, true, "admin-key", "ok".into()).await.unwrap();
    let first = c.acquire(req).await;
    c.clock.advance(LEASE);
    let recovery = c.pending_recovery(req).await;
    assert!(recovery.recovery.is_some());
    c.guard.decide_approval(&tenant, &recovery.id, true, "admin-key", "re-run".into()).await.unwrap();
    (first, recovery)
}

/// Where the namespace also needs approvals, an approval of a recovery lets no new call run once
/// its record is gone: that call needs a person's approval of its own.
pub async fn an_approval_of_a_recovery_lets_no_new_call_run(store: Subject) {
    let c = case(store).await;
    let tenant = TenantId::parse("acme").unwrap();
    let req = request(&scope("both"), "refund 5");
    let (first, recovery) = approved_recovery_of_an_approved_call(&c, &req).await;
    // The first attempt's holder finishes after all: the approved re-run is not needed.
    c.applied(&req.scope, first, Mutation::Complete(success("refunded"))).await;
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Replay(_)));
    // Its record's retention passed, the approved (unused) recovery, still kept, lets no new
    // call run.
    c.clock.advance(RETENTION);
    assert!(c.get(&req.scope).await.is_none());
    assert!(c.guard.approval(&tenant, &recovery.id).await.unwrap().is_some(), "still kept");
    match c.claim(&req).await {
        ClaimOutcome::PendingApproval(p) => assert!(p.approval.recovery.is_none() && p.approval.id != recovery.id),
        other => panic!("an approval of a recovery let a new call run: {other:?}"),
    }
}

/// Where the namespace also needs approvals, another call of a key whose re-run released it
/// (a retryable failure) is a mismatch, as it is for any approval of another call: the recovery
/// approval kept for the key does not make room for it.
pub async fn another_call_of_a_released_recovered_key_is_a_mismatch(store: Subject) {
    let c = case(store).await;
    let tenant = TenantId::parse("acme").unwrap();
    let req = request(&scope("released"), "refund 6");
    let (_, recovery) = approved_recovery_of_an_approved_call(&c, &req).await;
    let rerun = c.acquire(&req).await;
    let release = Mutation::Fail { retryable: true, outcome: success("try again") };
    c.applied(&req.scope, rerun, release).await;
    let other = request(&req.scope, "refund 600");
    assert_eq!(c.claim(&other).await, ClaimOutcome::Mismatch, "another call of the released key");
    let kept = c.guard.approval(&tenant, &recovery.id).await.unwrap().expect("kept");
    assert_eq!(kept.id, recovery.id, "the recovery's approval is unchanged");
}
