//! Conformance cases of approvals (bound to a key and its fingerprint) and of reconciliation
//! (a recovery completed without running the effect again), on every store.

use onceguard_core::approval::{Approval, ApprovalId, ApprovalState, DecideError};
use onceguard_core::control::{Settings, SettingsEntry};
use onceguard_core::store::{ApprovalFilter, Page};
use onceguard_core::{Claim, GuardError};

use super::*;

/// The namespace of these cases needs approvals, with pending ones expiring after a minute.
async fn needing_approvals(c: &Case) {
    let entry = SettingsEntry {
        tenant: TenantId::parse("acme").unwrap(),
        namespace_prefix: Some(Namespace::parse("prod").unwrap()),
        settings: Settings {
            approval_required: Some(true),
            approval_expiry: Some(Duration::from_secs(60)),
            ..Settings::default()
        },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(entry, None).await.unwrap();
}

fn claim_of(req: &ClaimRequest, summary: &str) -> Claim {
    Claim { summary: Some(summary.into()), ..crate::through_the_door(req, Duration::ZERO) }
}

impl Case {
    async fn pending(&self, req: &ClaimRequest) -> Approval {
        match self.guard.claim(claim_of(req, "refund 20 EUR")).await.unwrap() {
            ClaimOutcome::PendingApproval(p) => p.approval,
            other => panic!("expected pending_approval, got {other:?}"),
        }
    }

    async fn decide(&self, id: &ApprovalId, approved: bool) -> Result<Approval, GuardError> {
        let tenant = TenantId::parse("acme").unwrap();
        self.guard.decide_approval(&tenant, id, approved, "admin-key", "checked the order".into()).await
    }

    async fn audit_actions(&self) -> Vec<String> {
        let tenant = TenantId::parse("acme").unwrap();
        let page = self.guard.audit_log(&tenant, &AuditFilter { limit: 100, ..AuditFilter::default() }).await.unwrap();
        page.items.into_iter().map(|e| e.action).collect()
    }
}

/// A claim in a namespace that needs approvals records one pending approval of the key and its
/// fingerprint, with what it asked, and acquires nothing; asking again answers the same
/// approval. Approved, the next claims acquire exactly once (concurrent claims: one acquires,
/// the others find it in flight), the key then replays, and the decision is audited once.
pub async fn an_approved_call_acquires_once(store: Subject) {
    let c = case(store.clone()).await;
    needing_approvals(&c).await;
    let s = scope("refund-1");
    let req = in_run(&s, "refund order 7", "run-1", 5);
    let first = c.pending(&req).await;
    assert_eq!(first.state(c.clock.now()), ApprovalState::Pending);
    assert_eq!((first.summary.as_deref(), first.cost), (Some("refund 20 EUR"), Some(5)));
    assert_eq!(first.run.as_ref().map(|r| r.as_str()), Some("run-1"));
    assert_eq!(first.expires_at, c.clock.now().plus(Duration::from_secs(60)));
    assert!(c.get(&s).await.is_none(), "nothing was acquired");
    assert!(c.guard.run(&s.tenant, &RunId::parse("run-1").unwrap()).await.unwrap().is_none(), "nothing charged");
    assert_eq!(c.pending(&req).await.id, first.id, "asked once");
    // Outside the prefix nothing needs approval.
    c.acquire(&request(&scope_in("acme", "staging/pay", "refund-1"), "refund order 7")).await;

    let approved = c.decide(&first.id, true).await.unwrap();
    assert_eq!(approved.state(c.clock.now()), ApprovalState::Approved);
    let claims = (0..8).map(|_| {
        let (guard, claim) = (c.guard.clone(), crate::through_the_door(&req, Duration::ZERO));
        tokio::spawn(async move { guard.claim(claim).await.unwrap() })
    });
    let mut acquired = Vec::new();
    for claim in claims.collect::<Vec<_>>() {
        match claim.await.unwrap() {
            ClaimOutcome::Acquired(a) => acquired.push(a.fence),
            ClaimOutcome::InFlight(_) => {}
            other => panic!("an approved key answered {other:?}"),
        }
    }
    assert_eq!(acquired.len(), 1, "exactly one claim acquired the approved key");
    c.applied(&s, acquired[0], Mutation::Complete(success("refunded"))).await;
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Replay(_)));
    let run = c.guard.run(&s.tenant, &RunId::parse("run-1").unwrap()).await.unwrap().unwrap();
    assert_eq!(run.usage.effects, 1, "charged once, when acquired");
    assert!(matches!(c.decide(&first.id, false).await, Err(GuardError::Approval(DecideError::Decided(_)))));
    let actions = c.audit_actions().await;
    assert_eq!(actions.iter().filter(|a| *a == "approval.approve").count(), 1, "{actions:?}");
    assert!(!actions.iter().any(|a| a == "approval.deny"), "{actions:?}");
    // A purge of the key takes its approval with it: the next claim asks again.
    assert!(c.guard.purge("test", &s, None).await.unwrap());
    let asked_again = c.pending(&req).await;
    assert_ne!(asked_again.id, first.id);
}

/// A denied call is refused (`approval_denied`, with who and why) on every later claim of the
/// key with the same fingerprint, and never acquired; the denial is audited.
pub async fn a_denied_call_is_refused_for_good(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let s = scope("wire-1");
    let req = request(&s, "wire 1M");
    let asked = c.pending(&req).await;
    c.decide(&asked.id, false).await.unwrap();
    for _ in 0..2 {
        match c.claim(&req).await {
            ClaimOutcome::Denied(Denial::ApprovalDenied { approval, by, why }) => {
                assert_eq!(
                    (approval.as_str(), by.as_str(), why.as_str()),
                    (asked.id.as_str(), "admin-key", "checked the order")
                );
            }
            other => panic!("a denied call answered {other:?}"),
        }
    }
    assert!(c.get(&s).await.is_none());
    c.clock.advance(Duration::from_secs(600));
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Denied(Denial::ApprovalDenied { .. })), "the decision is kept");
    assert!(c.audit_actions().await.contains(&"approval.deny".to_owned()));
}

/// A pending approval nobody decides expires: it can no longer be decided, and the next claim
/// asks again with a new approval.
pub async fn an_undecided_approval_expires(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let req = request(&scope("late"), "a");
    let old = c.pending(&req).await;
    c.clock.advance(Duration::from_secs(60));
    assert!(matches!(c.decide(&old.id, true).await, Err(GuardError::Approval(DecideError::NotFound(_)))));
    let new = c.pending(&req).await;
    assert_ne!(new.id, old.id, "asked again");
    assert!(c.guard.approval(&req.scope.tenant, &old.id).await.unwrap().is_none());
    c.decide(&new.id, true).await.unwrap();
    c.acquire(&req).await;
    assert!(matches!(c.decide(&new.id, true).await, Err(GuardError::Approval(DecideError::Decided(_)))));
}

/// A claim of the key with another fingerprint is a mismatch, whether the approval is pending
/// or given, and changes nothing: the approved request still acquires.
pub async fn another_fingerprint_is_a_mismatch_and_keeps_the_approval(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let s = scope("pay-1");
    let (meant, other) = (request(&s, "pay 10"), request(&s, "pay 10000"));
    let asked = c.pending(&meant).await;
    assert_eq!(c.claim(&other).await, ClaimOutcome::Mismatch);
    c.decide(&asked.id, true).await.unwrap();
    assert_eq!(c.claim(&other).await, ClaimOutcome::Mismatch, "the approval is of the other request");
    let kept = c.guard.approval(&s.tenant, &asked.id).await.unwrap().unwrap();
    assert_eq!(kept.state(c.clock.now()), ApprovalState::Approved);
    // The approver saw no run and no cost: the same request in a run, or declaring a cost, is
    // another call.
    assert_eq!(c.claim(&in_run(&s, "pay 10", "run-9", 0)).await, ClaimOutcome::Mismatch, "another run");
    assert_eq!(c.claim(&ClaimRequest { cost: 500, ..meant.clone() }).await, ClaimOutcome::Mismatch, "more cost");
    let fence = c.acquire(&meant).await;
    assert_eq!(c.claim(&other).await, ClaimOutcome::Mismatch, "now the record's fingerprint refuses it");
    c.applied(&s, fence, Mutation::Complete(success("paid"))).await;
}

/// A switch engaged while an approval is pending refuses the key's claims (approved or not);
/// released, the approved key acquires.
pub async fn a_switch_refuses_a_call_pending_approval(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let tenant = TenantId::parse("acme").unwrap();
    let req = request(&scope("send-1"), "email all customers");
    let asked = c.pending(&req).await;
    let target = SwitchTarget::Namespace { prefix: Namespace::parse("prod").unwrap() };
    c.guard.engage_switch("test", &tenant, target.clone(), "runaway agent".into(), false).await.unwrap();
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Denied(Denial::SwitchEngaged { .. })));
    c.decide(&asked.id, true).await.unwrap();
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Denied(Denial::SwitchEngaged { .. })));
    c.guard.release_switch("test", &tenant, &target, None).await.unwrap();
    c.acquire(&req).await;
}

/// A claim that may wait for a pending approval answers as soon as it is decided: acquired
/// when approved (once, however many wait), denied when denied.
pub async fn a_waiting_claim_gets_the_decision(store: Subject) {
    let limits = Limits { wait_poll: Duration::from_millis(20), ..Limits::default() };
    let c = case_with(store, limits).await;
    needing_approvals(&c).await;
    for approved in [true, false] {
        let req = request(&scope(&format!("waited-{approved}")), "a");
        let asked = c.pending(&req).await;
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let (guard, claim) = (c.guard.clone(), crate::through_the_door(&req, Duration::from_secs(30)));
                tokio::spawn(async move { guard.claim(claim).await.unwrap() })
            })
            .collect();
        // The waiters are waiting (each polls every 20 ms) when the decision comes.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(waiters.iter().all(|w| !w.is_finished()), "the waiters wait for the decision");
        c.decide(&asked.id, approved).await.unwrap();
        if approved {
            // One waiter acquires; the others then wait for its outcome and receive the replay.
            let mut held = None;
            while held.is_none() {
                tokio::time::sleep(Duration::from_millis(10)).await;
                held = c.get(&req.scope).await.map(|r| r.fence);
            }
            c.applied(&req.scope, held.unwrap(), Mutation::Complete(success("done"))).await;
        }
        let mut answers = Vec::new();
        for waiter in waiters {
            answers.push(waiter.await.unwrap());
        }
        let acquired = answers.iter().filter(|a| matches!(a, ClaimOutcome::Acquired(_))).count();
        if approved {
            assert_eq!(acquired, 1, "{answers:?}");
            let replays = answers.iter().filter(|a| matches!(a, ClaimOutcome::Replay(_))).count();
            assert_eq!(replays, 2, "{answers:?}");
        } else {
            assert!(answers.iter().all(|a| matches!(a, ClaimOutcome::Denied(Denial::ApprovalDenied { .. }))));
        }
    }
}

/// The store's approvals: one kept per key, written only over the one read (a decision is
/// taken once however many try), listed by state, and swept once no longer kept.
pub async fn approvals_are_written_over_the_one_read(store: Subject) {
    let c = case(store.clone()).await;
    let now = c.clock.now();
    let s = scope("cas");
    let a = Approval::new(s.clone(), Fingerprint::sha256(b"a"), now, Duration::from_secs(60), RETENTION);
    assert!(store.put_approval(None, &a, None, now).await.unwrap());
    let b = Approval::new(s.clone(), Fingerprint::sha256(b"b"), now, Duration::from_secs(60), RETENTION);
    assert!(!store.put_approval(None, &b, None, now).await.unwrap(), "one kept per key");
    assert_eq!(store.approval_of(&s, now).await.unwrap().as_ref(), Some(&a));
    assert_eq!(store.approval(&s.tenant, &a.id, now).await.unwrap().as_ref(), Some(&a));
    assert!(store.approval(&TenantId::parse("globex").unwrap(), &a.id, now).await.unwrap().is_none());
    // Four deciders at once: one decision is written.
    let deciders = (0..4).map(|i| {
        let (store, a) = (store.clone(), a.clone());
        tokio::spawn(async move {
            let decision = onceguard_core::approval::Decision {
                reconciled: false,
                result: None,
                approved: i % 2 == 0,
                by: format!("admin-{i}"),
                why: "x".into(),
                at: now,
            };
            store.put_approval(Some(&a), &a.decide(decision).unwrap(), None, now).await.unwrap()
        })
    });
    let mut written = 0;
    for d in deciders.collect::<Vec<_>>() {
        written += usize::from(d.await.unwrap());
    }
    assert_eq!(written, 1);
    let decided = store.approval_of(&s, now).await.unwrap().unwrap();
    assert!(decided.decision.is_some());
    let other = scope("pending");
    let p = Approval::new(other.clone(), Fingerprint::sha256(b"p"), now, Duration::from_secs(60), RETENTION);
    assert!(store.put_approval(None, &p, None, now).await.unwrap());
    let ids = |found: Page<Approval>| found.items.into_iter().map(|a| a.id).collect::<Vec<_>>();
    let pending = ApprovalFilter { state: Some(ApprovalState::Pending), after: None, limit: 10 };
    assert_eq!(ids(store.list_approvals(&s.tenant, &pending, now).await.unwrap()), vec![p.id.clone()]);
    let mut all = vec![a.id.clone(), p.id.clone()];
    all.sort();
    let every = ApprovalFilter { limit: 10, ..ApprovalFilter::default() };
    assert_eq!(ids(store.list_approvals(&s.tenant, &every, now).await.unwrap()), all);
    let after_first = ApprovalFilter { after: Some(all[0].to_string()), limit: 10, ..ApprovalFilter::default() };
    assert_eq!(ids(store.list_approvals(&s.tenant, &after_first, now).await.unwrap()), all[1..].to_vec());
    // A page at a time: a full page says where the next starts; the last page says none follows.
    let one = ApprovalFilter { limit: 1, ..ApprovalFilter::default() };
    let first = store.list_approvals(&s.tenant, &one, now).await.unwrap();
    assert_eq!(first.next.as_deref(), Some(all[0].as_str()));
    let second = ApprovalFilter { after: first.next.clone(), ..one.clone() };
    let last = store.list_approvals(&s.tenant, &second, now).await.unwrap();
    assert_eq!((ids(last.clone()), last.next), (all[1..].to_vec(), None));
    // Past its expiry the pending one is no longer kept; a new request may replace it.
    c.clock.advance(Duration::from_secs(61));
    let later = c.clock.now();
    assert!(store.approval_of(&other, later).await.unwrap().is_none());
    assert_eq!(store.sweep_approvals(later, 100).await.unwrap(), 1);
    assert!(store.approval(&s.tenant, &p.id, later).await.unwrap().is_none());
    assert!(store.approval_of(&s, later).await.unwrap().is_some(), "a decision is kept for its retention");
    c.clock.advance(RETENTION);
    let past = c.clock.now();
    assert_eq!(store.sweep_approvals(past, 100).await.unwrap(), 1);
    c.clock.set(now);
    assert!(store.approval(&s.tenant, &a.id, now).await.unwrap().is_none(), "swept");
}

/// A recovering attempt may complete the key as reconciled (the downstream system said the
/// effect happened): the record and its replays say so. A first attempt may not, and nothing
/// changes.
pub async fn a_recovery_completes_as_reconciled(store: Subject) {
    let c = case(store).await;
    let s = scope("charge-9");
    let req = request(&s, "charge 9");
    let first = c.acquire(&req).await;
    let reconciled = Outcome { reconciled: true, ..success(r#"{"charge":"ch_9"}"#) };
    match c.guard.mutate(&s, first, Mutation::Complete(reconciled.clone())).await {
        Err(GuardError::Invalid(e)) => assert_eq!(e.field, "reconciled"),
        other => panic!("a first attempt completed as reconciled: {other:?}"),
    }
    assert_eq!(c.get(&s).await.unwrap().state, RecordState::InProgress);
    c.clock.advance(LEASE);
    let recovery = match c.claim(&req).await {
        ClaimOutcome::Acquired(a) if a.recovery.is_some() => a.fence,
        other => panic!("expected a recovery, got {other:?}"),
    };
    let record = c.applied(&s, recovery, Mutation::Complete(reconciled.clone())).await;
    assert!(record.outcome.as_ref().unwrap().reconciled);
    assert!(c.get(&s).await.unwrap().outcome.unwrap().reconciled);
    match c.claim(&req).await {
        ClaimOutcome::Replay(r) => assert_eq!(r.outcome, reconciled),
        other => panic!("expected a replay, got {other:?}"),
    }
    // The same completion again is answered as the first; one that is not reconciled is not.
    c.applied(&s, recovery, Mutation::Complete(reconciled.clone())).await;
    let plain = Outcome { reconciled: false, ..reconciled };
    assert_eq!(c.mutate(&s, recovery, Mutation::Complete(plain)).await, FencedOutcome::Stale(StaleReason::Finished));
}

/// A batch asks for each key that needs approval, and claims those approved, each answered as
/// alone.
pub async fn a_batch_asks_each_key_needing_approval(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let (a, b) = (request(&scope("batch-a"), "a"), request(&scope("batch-b"), "b"));
    let outside = request(&scope_in("acme", "staging/x", "batch-c"), "c");
    let batch = |reqs: &[&ClaimRequest]| {
        reqs.iter().map(|r| crate::through_the_door(r, Duration::ZERO)).map(|c| Claim { wait: None, ..c }).collect()
    };
    let first = c.claim_batch(batch(&[&a, &b, &outside])).await;
    let ids: Vec<ApprovalId> = first[..2]
        .iter()
        .map(|o| match o {
            ClaimOutcome::PendingApproval(p) => p.approval.id.clone(),
            other => panic!("expected pending_approval, got {other:?}"),
        })
        .collect();
    assert!(matches!(first[2], ClaimOutcome::Acquired(_)), "outside the prefix: {:?}", first[2]);
    c.decide(&ids[0], true).await.unwrap();
    let second = c.claim_batch(batch(&[&a, &b])).await;
    assert!(matches!(second[0], ClaimOutcome::Acquired(_)), "{:?}", second[0]);
    assert!(matches!(&second[1], ClaimOutcome::PendingApproval(p) if p.approval.id == ids[1]), "{:?}", second[1]);
}

/// The webhook's notice of a pending approval is taken by one instance at a time, however many
/// try at once: retried only after its lease passes, never once delivered, never for an
/// approval decided meanwhile.
pub async fn a_notice_is_taken_once_per_attempt(store: Subject) {
    let c = case(store.clone()).await;
    needing_approvals(&c).await;
    let pending = c.pending(&request(&scope("notify-1"), "a")).await;
    let lease = |_| Duration::from_secs(15);
    let instances: Vec<Guard> =
        (0..4).map(|_| Guard::new(store.store.clone(), c.clock.clone(), Limits::default())).collect();
    let take = |pending: Approval| {
        let instances = instances.clone();
        async move {
            let tries = instances.iter().map(|g| {
                let (g, a) = (g.clone(), pending.clone());
                tokio::spawn(async move { g.take_notice(&a, lease, 3).await.unwrap() })
            });
            let mut taken = Vec::new();
            for t in tries.collect::<Vec<_>>() {
                taken.extend(t.await.unwrap());
            }
            taken
        }
    };
    let first = take(pending.clone()).await;
    assert_eq!(first.len(), 1, "one of four instances takes the attempt");
    assert_eq!(first[0].notice.as_ref().unwrap().attempts, 1);
    c.guard.settle_notice(&first[0], Err("the receiver answered 500".into())).await.unwrap();
    let now_kept = c.guard.approval(&pending.scope.tenant, &pending.id).await.unwrap().unwrap();
    assert_eq!(now_kept.notice.as_ref().unwrap().last_error.as_deref(), Some("the receiver answered 500"));
    assert!(take(now_kept.clone()).await.is_empty(), "not again within the lease");
    c.clock.advance(Duration::from_secs(15));
    let second = take(now_kept).await;
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].notice.as_ref().unwrap().attempts, 2);
    c.guard.settle_notice(&second[0], Ok(())).await.unwrap();
    c.clock.advance(Duration::from_secs(15));
    let delivered = c.guard.approval(&pending.scope.tenant, &pending.id).await.unwrap().unwrap();
    assert!(delivered.notice.as_ref().unwrap().delivered_at.is_some());
    assert!(take(delivered).await.is_empty(), "never once delivered");
    // Decided before any attempt: never announced.
    let other = c.pending(&request(&scope("notify-2"), "b")).await;
    let decided = c.decide(&other.id, true).await.unwrap();
    assert!(take(decided).await.is_empty());
    // Out of attempts: no more.
    let third = c.pending(&request(&scope("notify-3"), "c")).await;
    let mut current = third;
    for _ in 0..3 {
        let taken = c.guard.take_notice(&current, |_| Duration::from_secs(1), 3).await.unwrap().unwrap();
        c.guard.settle_notice(&taken, Err("down".into())).await.unwrap();
        c.clock.advance(Duration::from_secs(1));
        current = c.guard.approval(&taken.scope.tenant, &taken.id).await.unwrap().unwrap();
    }
    assert!(c.guard.take_notice(&current, |_| Duration::from_secs(1), 3).await.unwrap().is_none());
}

/// An approval lets its call run once: a retry after a retryable failure is the same call and
/// runs without a new approval, another request under the released key is a mismatch, and once
/// the record is gone (its retention passed), the key needs a person again.
pub async fn an_approval_lets_its_call_run_once(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let s = scope("once-only");
    // Asked with the default retention (the approval is kept an hour from its decision), the
    // call then claimed with a retention of a minute.
    let asked = c.pending(&request(&s, "transfer 5")).await;
    let req = ClaimRequest { retention: Duration::from_secs(60), ..request(&s, "transfer 5") };
    c.decide(&asked.id, true).await.unwrap();
    let first = c.acquire(&req).await;
    let used = c.guard.approval(&s.tenant, &asked.id).await.unwrap().unwrap();
    assert_eq!(used.used, Some(c.clock.now()), "the approval is reserved by the acquiring claim");
    assert_eq!(c.get(&s).await.unwrap().approval.as_ref(), Some(&asked.id), "the record keeps it");
    let failed = Outcome { kind: OutcomeKind::Failure, ..success("timeout before sending") };
    c.applied(&s, first, Mutation::Fail { retryable: true, outcome: failed }).await;
    // The released key: another request is refused; the same one runs again.
    assert_eq!(c.claim(&request(&s, "transfer 5000")).await, ClaimOutcome::Mismatch);
    // So is the same request in another run, or declaring more cost than the person saw.
    let other_run = ClaimRequest { run: Some(RunId::parse("run-9").unwrap()), ..req.clone() };
    assert_eq!(c.claim(&other_run).await, ClaimOutcome::Mismatch, "another run");
    assert_eq!(c.claim(&ClaimRequest { cost: 9, ..req.clone() }).await, ClaimOutcome::Mismatch, "more cost");
    let retry = c.acquire(&req).await;
    c.applied(&s, retry, Mutation::Complete(success("sent"))).await;
    // The record's retention passes (the approval is still kept): the call ran; running it
    // again needs a person.
    c.clock.advance(Duration::from_secs(61));
    assert!(c.get(&s).await.is_none());
    let kept = c.guard.approval(&s.tenant, &asked.id).await.unwrap().unwrap();
    assert_eq!(kept.state(c.clock.now()), ApprovalState::Approved);
    let again = c.pending(&req).await;
    assert_ne!(again.id, asked.id);
}

/// A decision is kept for the namespace's retention, whatever retention the call asked for: a
/// call asking for one second, denied, is still refused (not asked again) long after that
/// second, until the namespace's retention has passed.
pub async fn a_decision_is_kept_for_the_namespaces_retention(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let s = scope("refund-short");
    let req = ClaimRequest { retention: Duration::from_secs(1), ..request(&s, "refund order 11") };
    let asked = c.pending(&req).await;
    c.decide(&asked.id, false).await.unwrap();
    c.clock.advance(Duration::from_secs(60));
    let later = c.claim(&req).await;
    assert!(matches!(later, ClaimOutcome::Denied(Denial::ApprovalDenied { .. })), "still denied: {later:?}");
    c.clock.advance(Limits::default().default_retention);
    let asked_again = c.pending(&req).await;
    assert_ne!(asked_again.id, asked.id, "after the namespace's retention the call is asked again");
}

/// A call that proceeds asks no one: in observe mode a claim that enforcement would have held
/// for an approval proceeds carrying that answer, and records no pending approval (approving it
/// later would let the effect run a second time).
pub async fn observe_mode_asks_no_approver(store: Subject) {
    let c = case(store).await;
    needing_approvals(&c).await;
    let observe = SettingsEntry {
        tenant: TenantId::parse("acme").unwrap(),
        namespace_prefix: Some(Namespace::parse("prod/payments-agent").unwrap()),
        settings: Settings {
            approval_required: Some(true),
            mode: Some(onceguard_core::control::Mode::Observe),
            ..Settings::default()
        },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(observe, None).await.unwrap();
    let s = scope("refund-observed");
    let req = request(&s, "refund order 12");
    for _ in 0..2 {
        let outcome = c.guard.claim(claim_of(&req, "refund 12 EUR")).await.unwrap();
        let ClaimOutcome::Proceed(would_have_been) = outcome else { panic!("expected proceed, got {outcome:?}") };
        assert!(matches!(*would_have_been, ClaimOutcome::PendingApproval(_)), "{would_have_been:?}");
    }
    let tenant = TenantId::parse("acme").unwrap();
    let kept = c.guard.list_approvals(&tenant, &ApprovalFilter { limit: 100, ..Default::default() }).await.unwrap();
    assert!(kept.items.is_empty() && kept.next.is_none(), "no approval recorded: {kept:?}");
}

/// `actors` tasks each claiming `req` ten times, yielding between claims: each answers the
/// acquisitions it got.
fn claiming_in_a_loop(
    c: &Case,
    req: &ClaimRequest,
    actors: usize,
) -> Vec<tokio::task::JoinHandle<Vec<onceguard_core::Acquired>>> {
    (0..actors)
        .map(|_| {
            let (guard, claim) = (c.guard.clone(), crate::through_the_door(req, Duration::ZERO));
            tokio::spawn(async move {
                let mut acquired = Vec::new();
                for _ in 0..10 {
                    if let ClaimOutcome::Acquired(a) = guard.claim(claim.clone()).await.expect("the store answers") {
                        acquired.push(a);
                    }
                    tokio::task::yield_now().await;
                }
                acquired
            })
        })
        .collect()
}

/// Only the approved request ever acquires an approved key, decided in the store's atomic
/// claim: in each of twenty rounds the approved call holds the key and fails retryably while
/// eight claimants send *another* request under the same key in a loop; none of them ever
/// acquires it (nor could then complete it as reconciled), and the approved request's retry
/// acquires it again.
pub async fn another_request_never_takes_an_approved_key(store: Subject) {
    const ACTORS: usize = 8;
    const ROUNDS: usize = 20;
    let c = case(store).await;
    needing_approvals(&c).await;
    for round in 0..ROUNDS {
        let s = scope(&format!("approved-{round}"));
        let approved = request(&s, "refund 6");
        let other = request(&s, "refund 666");
        let asked = c.pending(&approved).await;
        c.decide(&asked.id, true).await.unwrap();
        let fence = c.acquire(&approved).await;
        let others = claiming_in_a_loop(&c, &other, ACTORS);
        tokio::task::yield_now().await;
        let failure = Outcome { kind: OutcomeKind::Failure, ..success("timeout before sending") };
        c.applied(&s, fence, Mutation::Fail { retryable: true, outcome: failure }).await;
        for handle in others {
            let acquired = handle.await.unwrap();
            assert!(acquired.is_empty(), "round {round}: another request acquired the approved key: {acquired:?}");
        }
        let record = c.get(&s).await.expect("the record");
        assert_eq!(record.fingerprint, approved.fingerprint, "round {round}: the record is the approved call's");
        let ClaimOutcome::Acquired(retry) = c.claim(&approved).await else { panic!("round {round}: no retry") };
        assert_eq!(retry.attempt, 2, "round {round}: the approved call's retry");
    }
}

/// An approved call runs once, also across its record's retention: in each of twenty rounds the
/// approved call completes with a retention of a second, and eight claimants send the same
/// request in a loop while the clock moves past that retention; none of them ever acquires the
/// key (the guard's gate may read the record live and the store find it expired: the store's
/// claim refuses). Once the reserving claim's lease passed too, the key asks a person again.
pub async fn an_approved_call_never_runs_again_after_its_retention(store: Subject) {
    const ACTORS: usize = 8;
    const ROUNDS: usize = 20;
    let c = case(store).await;
    needing_approvals(&c).await;
    for round in 0..ROUNDS {
        let s = scope(&format!("short-lived-{round}"));
        let req = ClaimRequest { retention: Duration::from_secs(1), ..request(&s, "transfer 5") };
        let asked = c.pending(&req).await;
        c.decide(&asked.id, true).await.unwrap();
        let fence = c.acquire(&req).await;
        c.applied(&s, fence, Mutation::Complete(success("{}"))).await;
        let claims = claiming_in_a_loop(&c, &req, ACTORS);
        for _ in 0..10 {
            c.clock.advance(Duration::from_millis(300));
            tokio::task::yield_now().await;
        }
        for claim in claims {
            let acquired = claim.await.unwrap();
            assert!(acquired.is_empty(), "round {round}: the call ran again without a new approval: {acquired:?}");
        }
        c.clock.advance(LEASE);
        let again = c.pending(&req).await;
        assert_ne!(again.id, asked.id, "round {round}: a person is asked again");
        assert!(c.get(&s).await.is_none(), "round {round}: nothing acquired");
    }
}
