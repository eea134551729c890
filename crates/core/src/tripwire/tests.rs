use std::time::Duration;

use super::*;
use crate::domain::{Fence, Fingerprint, Key, Scope};
use crate::record::{ClaimOutcome, Outcome};

fn rule(symptom: Symptom) -> Tripwire {
    Tripwire {
        tenant: TenantId::parse("acme").unwrap(),
        name: "runaway".into(),
        prefix: Some(Namespace::parse("agents").unwrap()),
        symptom,
        window: Duration::from_secs(300),
        min_calls: 20,
        per: Per::Namespace,
        action: TripAction::Switch,
        revoke_leases: false,
        rollback: false,
        auto_release_after: None,
        set_by: "test".into(),
        set_at: Timestamp(0),
    }
}

fn record(kind: OutcomeKind, attempt: u32, created: u64, cost: Option<u64>) -> Record {
    let scope = Scope::new(
        TenantId::parse("acme").unwrap(),
        Namespace::parse("agents/mail").unwrap(),
        Key::parse("k").unwrap(),
    );
    Record {
        scope,
        state: RecordState::Completed,
        fingerprint: Fingerprint::sha256(b"x"),
        fence: Fence(1),
        attempt,
        run: None,
        charged: false,
        approval: None,
        lease_expires_at: None,
        unknown: None,
        retention: Duration::from_secs(60),
        outcome: Some(Outcome {
            kind,
            content_type: "application/json".into(),
            body: b"{}".to_vec(),
            cost,
            tokens: None,
            reconciled: false,
            compensation: None,
        }),
        completed_at: Some(Timestamp(created + 10)),
        checkpoints: vec![],
        created_at: Timestamp(created),
        updated_at: Timestamp(created + 10),
        expires_at: Timestamp(created + 60_000),
    }
}

#[test]
fn a_failure_rate_trips_above_its_share_and_never_below_the_minimum_calls() {
    let r = rule(Symptom::FailureRate { above: 0.2 });
    assert_eq!(r.crossed(Tally { calls: 19, bad: 19 }), None, "below min_calls");
    assert_eq!(r.crossed(Tally { calls: 20, bad: 4 }), None, "at the threshold, not above");
    let why = r.crossed(Tally { calls: 20, bad: 5 }).expect("above 0.2");
    assert!(why.contains("5 of 20") && why.contains("5 min"), "{why}");
    // What finished attempts add: a success (a retry's too) is a call, a failure or an
    // unknown outcome a bad one.
    let now = Timestamp(1_000);
    assert_eq!(r.on_finished(&record(OutcomeKind::Success, 1, 0, None), now), Tally { calls: 1, bad: 0 });
    assert_eq!(r.on_finished(&record(OutcomeKind::Failure, 1, 0, None), now), Tally { calls: 1, bad: 1 });
    assert_eq!(r.on_finished(&record(OutcomeKind::Success, 2, 0, None), now), Tally { calls: 1, bad: 0 }, "a retry");
    let mut unknown = record(OutcomeKind::Success, 1, 0, None);
    (unknown.state, unknown.outcome, unknown.unknown) = (RecordState::InProgress, None, Some("timeout".into()));
    assert_eq!(r.on_finished(&unknown, now), Tally { calls: 1, bad: 1 });
    // A recovery is a bad call when claimed, unless a switch revoked the attempt it recovers.
    let recovery = |reason| {
        ClaimOutcome::Acquired(crate::record::Acquired {
            fence: Fence(2),
            attempt: 2,
            lease_expires_at: Timestamp(9),
            recovery: Some(crate::record::Recovery {
                previous_fence: Fence(1),
                previous_attempt: 1,
                reason,
                last_checkpoint: None,
            }),
        })
    };
    assert_eq!(r.on_claimed(&recovery(RecoveryReason::LeaseExpired)), Tally { calls: 1, bad: 1 });
    let revoked = format!("{}namespace:agents: runaway", crate::control::REVOKED_BY_SWITCH);
    assert_eq!(
        r.on_claimed(&recovery(RecoveryReason::ReportedUnknown { detail: revoked })),
        Tally { calls: 1, bad: 0 }
    );
    assert_eq!(r.on_claimed(&ClaimOutcome::Mismatch), Tally::default(), "not this rule's symptom");
}

#[test]
fn latency_counts_effects_slower_than_the_bound_against_the_quantile() {
    let r = rule(Symptom::Latency { quantile: 0.95, above_ms: 2_000 });
    let fast = r.on_finished(&record(OutcomeKind::Success, 1, 0, None), Timestamp(1_999));
    let slow = r.on_finished(&record(OutcomeKind::Success, 1, 0, None), Timestamp(2_001));
    assert_eq!((fast, slow), (Tally { calls: 1, bad: 0 }, Tally { calls: 1, bad: 1 }));
    // A later attempt's record keeps the first's creation: not counted.
    assert!(r.on_finished(&record(OutcomeKind::Success, 2, 0, None), Timestamp(9_000)).is_empty());
    // p90 at exactly 10 % slow is at the bound, not above it.
    let p90 = rule(Symptom::Latency { quantile: 0.9, above_ms: 2_000 });
    assert_eq!(p90.crossed(Tally { calls: 100, bad: 10 }), None);
    assert!(p90.crossed(Tally { calls: 100, bad: 11 }).is_some());
    assert_eq!(r.crossed(Tally { calls: 100, bad: 5 }), None, "5 % slower: p95 at the bound");
    let why = r.crossed(Tally { calls: 100, bad: 6 }).expect("6 % slower: p95 above 2 s");
    assert!(why.starts_with("p95 latency above 2000 ms"), "{why}");
}

#[test]
fn spend_and_mismatches_are_rates_per_minute_of_the_window() {
    let spend = rule(Symptom::Spend { unit: SpendUnit::Cost, per_minute: 100 });
    assert_eq!(spend.on_finished(&record(OutcomeKind::Success, 1, 0, Some(70)), Timestamp(5)).bad, 70);
    assert_eq!(spend.crossed(Tally { calls: 50, bad: 500 }), None, "100 a minute over 5 minutes");
    assert!(spend.crossed(Tally { calls: 50, bad: 501 }).is_some());
    let mismatches = rule(Symptom::Mismatches { per_minute: 2 });
    assert_eq!(mismatches.on_claimed(&ClaimOutcome::Mismatch), Tally { calls: 1, bad: 1 });
    let would = ClaimOutcome::Proceed(Box::new(ClaimOutcome::Mismatch));
    assert_eq!(mismatches.on_claimed(&would), Tally { calls: 1, bad: 1 }, "observe mode's would-be mismatch");
    assert_eq!(mismatches.on_stale(), Tally { calls: 1, bad: 1 });
    assert!(mismatches.crossed(Tally { calls: 40, bad: 11 }).is_some());
    // Other symptoms take nothing from claims and stale calls.
    assert!(spend.on_claimed(&ClaimOutcome::Mismatch).is_empty() && spend.on_stale().is_empty());
}

#[test]
fn a_rule_is_checked_before_it_is_kept() {
    assert!(rule(Symptom::FailureRate { above: 0.2 }).validate().is_ok());
    let bad = |f: fn(&mut Tripwire)| {
        let mut r = rule(Symptom::FailureRate { above: 0.2 });
        f(&mut r);
        r.validate().expect_err("refused").field
    };
    assert_eq!(bad(|r| r.name = "Bad Name".into()), "name");
    assert_eq!(bad(|r| r.window = Duration::from_secs(90)), "window");
    assert_eq!(bad(|r| r.window = Duration::from_secs(25 * 3600)), "window");
    assert_eq!(bad(|r| r.min_calls = 0), "min_calls");
    assert_eq!(bad(|r| r.symptom = Symptom::FailureRate { above: 1.0 }), "symptom.above");
    assert_eq!(bad(|r| r.rollback = true), "rollback");
    assert_eq!(bad(|r| (r.per, r.symptom) = (Per::Run, Symptom::Mismatches { per_minute: 1 })), "per");
    assert_eq!(
        bad(|r| (r.per, r.rollback, r.auto_release_after) = (Per::Run, true, Some(Duration::from_secs(60)))),
        "auto_release_after"
    );
    // A rule that turns its scope to observe: per namespace, and nothing a switch does.
    let observe = |f: fn(&mut Tripwire)| {
        let mut r = rule(Symptom::FailureRate { above: 0.2 });
        r.action = TripAction::Observe;
        f(&mut r);
        r.validate().err().map(|e| e.field)
    };
    assert_eq!(observe(|_| {}), None);
    assert_eq!(observe(|r| r.per = Per::Run), Some("per"));
    assert_eq!(observe(|r| r.revoke_leases = true), Some("revoke_leases"));
    assert_eq!(observe(|r| (r.per, r.rollback) = (Per::Run, true)), Some("per"));
    assert_eq!(observe(|r| r.rollback = true), Some("rollback"));
    assert_eq!(observe(|r| r.auto_release_after = Some(Duration::from_secs(60))), Some("auto_release_after"));
}

#[test]
fn tallies_add_per_rule_and_subject_and_skip_calls_a_rule_does_not_watch() {
    let tallies = Tallies::default();
    let per_run = Tripwire { name: "per-run".into(), per: Per::Run, ..rule(Symptom::FailureRate { above: 0.2 }) };
    let rules = [rule(Symptom::FailureRate { above: 0.2 }), per_run];
    let tenant = TenantId::parse("acme").unwrap();
    let inside = Namespace::parse("agents/mail").unwrap();
    let run = RunId::parse("run-1").unwrap();
    let bad = |_: &Tripwire| Tally { calls: 1, bad: 1 };
    tallies.add(&rules, &tenant, &inside, Some(&run), bad);
    tallies.add(&rules, &tenant, &inside, None, bad);
    tallies.add(&rules, &tenant, &Namespace::parse("billing").unwrap(), Some(&run), bad);
    tallies.add(&rules, &TenantId::parse("globex").unwrap(), &inside, Some(&run), bad);
    let mut taken = tallies.take();
    taken.sort_by(|a, b| (&a.0.1, &a.0.2).cmp(&(&b.0.1, &b.0.2)));
    assert_eq!(
        taken,
        vec![
            ((tenant.clone(), "per-run@0".into(), Subject::Run(run)), Tally { calls: 1, bad: 1 }),
            ((tenant, "runaway@0".into(), Subject::Scope), Tally { calls: 2, bad: 2 }),
        ]
    );
    assert!(tallies.take().is_empty(), "taken once");
}
