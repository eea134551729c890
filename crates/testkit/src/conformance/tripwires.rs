//! Conformance cases of the tripwires: the store's counts summed across instances, a rule
//! tripping once whichever instances cross its threshold at once, and what a trip engages.

use onceguard_core::control::{Mode, Settings, SettingsEntry};
use onceguard_core::tripwire::{Per, SpendUnit, Symptom, Tally, TripAction, Tripped, Tripwire};

use super::*;

/// A second instance on the same store: its own guard (own tallies, own cache of the rules),
/// its clock the case's (ahead of a shared store's by the same offset, measured).
async fn second_instance(c: &Case, subject: &Subject) -> Guard {
    let store = subject.store.clone();
    match &subject.clock {
        None => Guard::new(store, c.clock.clone(), Limits::default()),
        Some(clock) => {
            let limits = Limits { max_clock_offset: 2 * INSTANCE_AHEAD, ..Limits::default() };
            let guard = Guard::new(store, Arc::new(Ahead { of: clock.clone(), by: INSTANCE_AHEAD }), limits);
            guard.measure_clock_offset().await.expect("the store answers");
            guard
        }
    }
}

fn runaway_rule(symptom: Symptom, per: Per) -> Tripwire {
    Tripwire {
        tenant: TenantId::parse("acme").unwrap(),
        name: "runaway".into(),
        prefix: Some(Namespace::parse("prod").unwrap()),
        symptom,
        window: Duration::from_secs(120),
        min_calls: 10,
        per,
        action: TripAction::Switch,
        revoke_leases: false,
        rollback: false,
        auto_release_after: None,
        set_by: "test".into(),
        set_at: Timestamp(0),
    }
}

fn failure(body: &str) -> Mutation {
    let mut outcome = success(body);
    outcome.kind = OutcomeKind::Failure;
    Mutation::Fail { retryable: false, outcome }
}

async fn trips_of(store: &Arc<dyn Store>) -> Vec<AuditEntry> {
    let filter = AuditFilter { action: Some("tripwire.trip".into()), limit: MAX_PAGE, ..AuditFilter::default() };
    store.list_audit(&TenantId::parse("acme").unwrap(), &filter).await.unwrap().items
}

/// One effect of `run` through `guard`: claimed, then completed (`ok`) or failed for good.
/// Answers the claim's refusal by a switch, if it was refused.
async fn effect(guard: &Guard, key: &str, run: &str, ok: bool) -> Option<String> {
    let req = in_run(&scope(key), "pay", run, 0);
    match guard.claim(crate::through_the_door(&req, Duration::ZERO)).await.unwrap() {
        ClaimOutcome::Acquired(a) => {
            let outcome = if ok { Mutation::Complete(success("paid")) } else { failure("declined") };
            assert!(matches!(guard.mutate(&req.scope, a.fence, outcome).await.unwrap(), FencedOutcome::Applied(_)));
            None
        }
        ClaimOutcome::Denied(Denial::SwitchEngaged { target, why }) => Some(format!("{target}: {why}")),
        other => panic!("{key} answered {other:?}"),
    }
}

/// The switches of trips.
fn engaged(tripped: &[Tripped]) -> Vec<Switch> {
    let switch = |t: &Tripped| match t {
        Tripped::Switch(s) => s.clone(),
        other => panic!("not a switch: {other:?}"),
    };
    tripped.iter().map(switch).collect()
}

/// Both instances add their counts at once, then read the controls (every instance sees a
/// switch or a setting within a second; here at once). Answers what their trips did.
async fn flush_both(a: &Guard, b: &Guard) -> Vec<Tripped> {
    let (x, y) = tokio::join!(a.flush_tripwires(), b.flush_tripwires());
    a.refresh_controls().await.unwrap();
    b.refresh_controls().await.unwrap();
    x.unwrap().into_iter().chain(y.unwrap()).collect()
}

/// A run whose effects start failing trips its rule within the window, on two instances that
/// each run half of its effects and add their counts at the same moment: the figures are the
/// store's sums, so the trip comes after the same number of effects as on one instance, and of
/// the two instances crossing the threshold at once one engages the switch (audited once).
/// Both refuse the run's next claim. Another run with failures but fewer calls than
/// `min_calls` trips nothing; once a person releases the switch, counting starts from nothing.
pub async fn a_runaway_run_trips_its_rule_once_across_two_instances(store: Subject) {
    let c = case(store.clone()).await;
    let other = second_instance(&c, &store).await;
    let rule = runaway_rule(Symptom::FailureRate { above: 0.5 }, Per::Run);
    c.guard.set_tripwire(rule, None).await.unwrap();
    other.refresh_controls().await.unwrap();

    // A quiet run: 8 effects, all failing, below min_calls (10).
    for i in 0..4 {
        assert_eq!(effect(&c.guard, &format!("quiet-{i}-a"), "quiet", false).await, None);
        assert_eq!(effect(&other, &format!("quiet-{i}-b"), "quiet", false).await, None);
        assert!(flush_both(&c.guard, &other).await.is_empty());
    }

    // The runaway run: its first 10 effects succeed, then every one fails (the symptom begins
    // at effect 11). Each round, each instance runs one effect, then both add their counts.
    let mut tripped = Vec::new();
    let mut ran = 0;
    let mut refused = None;
    for round in 0..30 {
        for guard in [&c.guard, &other] {
            match effect(guard, &format!("runaway-{ran}"), "runaway", ran < 10).await {
                None => ran += 1,
                Some(why) => refused = refused.or(Some(why)),
            }
        }
        if refused.is_some() {
            assert!(round > 0);
            break;
        }
        tripped.extend(flush_both(&c.guard, &other).await);
    }
    let refused = refused.expect("the run was switched off");
    assert!(refused.starts_with("run:runaway: tripwire runaway: failure rate"), "{refused}");
    // 10 successes, then failures until more than half of the window's attempts failed: in
    // the 11th round (22 effects). The instance whose add came first saw 11 of 21, the other
    // 12 of 22: either may have engaged the switch, never both.
    assert_eq!(ran, 22, "effects run before the switch refused the run");
    println!(
        "runaway timeline: the symptom began at effect 11 (round 6); the rule tripped after effect {ran} (round 11, two \
         instances adding at once); {} failing effects ran in between; the next claim was refused",
        ran - 10
    );
    assert_eq!(tripped.len(), 1, "one instance engaged the switch: {tripped:?}");
    let trip = engaged(&tripped)[0].tripwire.clone().expect("the switch says which rule");
    assert!([(21, 11), (22, 12)].contains(&(trip.calls, trip.bad)), "{trip:?}");
    assert_eq!(trip.run.as_ref().map(|r| r.as_str()), Some("runaway"));
    assert_eq!(trips_of(&store.store).await.len(), 1, "audited once");
    let elsewhere = in_run(&scope("elsewhere"), "pay", "quiet", 0);
    assert!(matches!(c.claim(&elsewhere).await, ClaimOutcome::Acquired(_)), "the quiet run never tripped");
    // A person releases it. The counts that tripped it are gone: three more failures (below
    // min_calls on their own) trip nothing.
    let target = SwitchTarget::Run { run: RunId::parse("runaway").unwrap() };
    assert!(c.guard.release_switch("ops", &TenantId::parse("acme").unwrap(), &target, None).await.unwrap().is_some());
    other.refresh_controls().await.unwrap();
    for i in 0..3 {
        assert_eq!(effect(&c.guard, &format!("again-{i}"), "runaway", false).await, None);
        assert!(flush_both(&c.guard, &other).await.is_empty(), "tripped again on the old counts");
    }
}

/// A rule set anew (here: the same rule again) counts from nothing: counts of its earlier
/// setting never add to the new one's.
pub async fn a_rule_set_anew_counts_from_nothing(store: Subject) {
    let c = case(store).await;
    let mut rule = runaway_rule(Symptom::FailureRate { above: 0.5 }, Per::Namespace);
    rule.min_calls = 4;
    c.guard.set_tripwire(rule.clone(), None).await.unwrap();
    for i in 0..3 {
        assert_eq!(effect(&c.guard, &format!("before-{i}"), "r", false).await, None);
        assert!(c.guard.flush_tripwires().await.unwrap().is_empty(), "3 calls, below min_calls");
    }
    c.clock.advance(Duration::from_millis(5));
    c.guard.set_tripwire(rule, None).await.unwrap();
    assert_eq!(effect(&c.guard, "after-0", "r", false).await, None);
    assert!(c.guard.flush_tripwires().await.unwrap().is_empty(), "the earlier setting's 3 calls do not count");
    let mut tripped = Vec::new();
    for i in 1..4 {
        assert_eq!(effect(&c.guard, &format!("after-{i}"), "r", false).await, None);
        tripped.extend(c.guard.flush_tripwires().await.unwrap());
    }
    assert_eq!(tripped.len(), 1, "4 calls of the new setting, all failing");
}

/// A rule that rolls the run back starts its rollback, and the switch stays the tripwire's
/// (its figures kept; audited once as the trip, not again as an engagement).
pub async fn a_tripwire_can_roll_the_offending_run_back(store: Subject) {
    let c = case(store.clone()).await;
    let mut rule = runaway_rule(Symptom::FailureRate { above: 0.5 }, Per::Run);
    (rule.min_calls, rule.rollback) = (2, true);
    c.guard.set_tripwire(rule, None).await.unwrap();
    let mut tripped = Vec::new();
    for i in 0..2 {
        assert_eq!(effect(&c.guard, &format!("undo-{i}"), "bad-plan", false).await, None);
        tripped.extend(c.guard.flush_tripwires().await.unwrap());
    }
    assert_eq!(tripped.len(), 1);
    let acme = TenantId::parse("acme").unwrap();
    let run = RunId::parse("bad-plan").unwrap();
    assert!(c.guard.rollback(&acme, &run).await.unwrap().is_some(), "the run is being rolled back");
    let switches = c.guard.switches(&acme).await.unwrap();
    assert_eq!(switches.len(), 1);
    assert_eq!(switches[0].tripwire.as_ref().map(|t| t.rule.as_str()), Some("runaway"), "{switches:?}");
    let filter = AuditFilter { limit: MAX_PAGE, ..AuditFilter::default() };
    let actions: Vec<String> =
        store.list_audit(&acme, &filter).await.unwrap().items.into_iter().map(|e| e.action).collect();
    assert_eq!(actions.iter().filter(|a| *a == "tripwire.trip").count(), 1, "{actions:?}");
    assert_eq!(actions.iter().filter(|a| *a == "switch.engage").count(), 0, "{actions:?}");
    assert_eq!(actions.iter().filter(|a| *a == "run.rollback").count(), 1, "{actions:?}");
}

/// The store's counts are one atomic add-and-sum: 8 instances adding at once lose no count,
/// minutes before the window are left out and forgotten, and a subject's counts clear.
pub async fn symptom_counts_add_up_across_instances(store: Subject) {
    let acme = TenantId::parse("acme").unwrap();
    let mut adders = Vec::new();
    for _ in 0..8 {
        let (store, acme) = (store.store.clone(), acme.clone());
        adders.push(tokio::spawn(async move {
            let mut last = Tally::default();
            for _ in 0..25 {
                last = store.count_symptoms(&acme, "r", "*", 100, Tally { calls: 2, bad: 1 }, 99).await.unwrap();
            }
            last
        }));
    }
    let mut seen = Vec::new();
    for adder in adders {
        seen.push(adder.await.unwrap());
    }
    let last = store.count_symptoms(&acme, "r", "*", 100, Tally::default(), 99).await.unwrap();
    assert_eq!(last, Tally { calls: 400, bad: 200 });
    // The adder that finished last saw everything.
    assert!(seen.contains(&last), "{seen:?}");
    // A minute later, a window of 2 minutes still holds minute 100; one of 1 minute does not.
    let two = store.count_symptoms(&acme, "r", "*", 101, Tally { calls: 1, bad: 0 }, 100).await.unwrap();
    assert_eq!(two, Tally { calls: 401, bad: 200 });
    let one = store.count_symptoms(&acme, "r", "*", 101, Tally::default(), 101).await.unwrap();
    assert_eq!(one, Tally { calls: 1, bad: 0 });
    // Other subjects, rules and tenants are apart.
    let apart = store.count_symptoms(&acme, "r", "run:x", 101, Tally { calls: 1, bad: 1 }, 0).await.unwrap();
    assert_eq!(apart, Tally { calls: 1, bad: 1 });
    let globex = TenantId::parse("globex").unwrap();
    assert_eq!(store.count_symptoms(&globex, "r", "*", 101, Tally::default(), 0).await.unwrap(), Tally::default());
    store.clear_symptoms(&acme, "r", "*").await.unwrap();
    assert_eq!(store.count_symptoms(&acme, "r", "*", 101, Tally::default(), 0).await.unwrap(), Tally::default());
    assert_eq!(store.count_symptoms(&acme, "r", "run:x", 101, Tally::default(), 0).await.unwrap().calls, 1);
    // Pruning forgets the minutes before the one given (a store whose counts expire by
    // themselves, Redis, answers 0 and keeps them until then).
    if store.prune_symptoms(102).await.unwrap() > 0 {
        assert_eq!(
            store.count_symptoms(&acme, "r", "run:x", 102, Tally::default(), 0).await.unwrap(),
            Tally::default()
        );
    }
    assert_eq!(store.count_symptoms(&acme, "r", "run:x", 102, Tally::default(), 102).await.unwrap(), Tally::default());
}

/// Of 8 callers creating the same control document at once, one creates it and its one audit
/// entry; an existing document is never replaced.
pub async fn a_control_document_is_created_once(store: Subject) {
    let acme = TenantId::parse("acme").unwrap();
    let mut creators = Vec::new();
    for i in 0..8 {
        let store = store.store.clone();
        let doc =
            ControlDoc { kind: ControlKind::Switch, tenant: acme.clone(), id: "run:r".into(), body: format!("{i}") };
        let entry = AuditEntry::new(acme.clone(), Timestamp(1_000 + i), "tripwire:t", "tripwire.trip", "run:r");
        creators.push(tokio::spawn(async move { (store.create_control(&doc, &entry).await.unwrap(), doc) }));
    }
    let mut created = Vec::new();
    for creator in creators {
        let (won, doc) = creator.await.unwrap();
        if won {
            created.push(doc);
        }
    }
    assert_eq!(created.len(), 1, "one creator");
    assert_eq!(store.list_control().await.unwrap(), created, "the winner's document is kept");
    assert_eq!(trips_of(&store.store).await.len(), 1, "one audit entry");
}

/// A spend rule on a namespace trips on the reported cost per minute, engages a switch on its
/// prefix, and releases it by itself after `auto_release_after`: one release, audited once,
/// whichever instances see it due.
pub async fn a_spend_rule_trips_and_releases_itself(store: Subject) {
    let c = case(store.clone()).await;
    let other = second_instance(&c, &store).await;
    let mut rule = runaway_rule(Symptom::Spend { unit: SpendUnit::Cost, per_minute: 100 }, Per::Namespace);
    (rule.min_calls, rule.auto_release_after) = (3, Some(Duration::from_secs(30)));
    c.guard.set_tripwire(rule, None).await.unwrap();
    // 42 a call (`success` reports a cost of 42), two minutes: more than 200 trips on the 5th.
    let mut tripped = Vec::new();
    for i in 0..10 {
        let req = request(&scope(&format!("spend-{i}")), "embed");
        match c.claim(&req).await {
            ClaimOutcome::Acquired(a) => {
                c.applied(&req.scope, a.fence, Mutation::Complete(success("ok"))).await;
            }
            ClaimOutcome::Denied(Denial::SwitchEngaged { target, .. }) => {
                assert_eq!((i, target.as_str()), (5, "namespace:prod"));
                break;
            }
            other => panic!("claim {i} answered {other:?}"),
        }
        tripped.extend(c.guard.flush_tripwires().await.unwrap());
    }
    assert_eq!(tripped.len(), 1);
    assert!(tripped[0].reason().contains("spend 105.0 cost/min"), "{}", tripped[0].reason());
    // Not due yet; then due: one instance releases it.
    c.clock.advance(Duration::from_secs(29));
    assert_eq!(c.guard.release_due_tripwires().await.unwrap() + other.release_due_tripwires().await.unwrap(), 0);
    c.clock.advance(Duration::from_secs(2));
    other.refresh_controls().await.unwrap();
    let (a, b) = tokio::join!(c.guard.release_due_tripwires(), other.release_due_tripwires());
    assert_eq!(a.unwrap() + b.unwrap(), 1, "released once");
    let filter = AuditFilter { action: Some("switch.release".into()), limit: MAX_PAGE, ..AuditFilter::default() };
    let released = store.list_audit(&TenantId::parse("acme").unwrap(), &filter).await.unwrap().items;
    assert_eq!(released.len(), 1);
    assert_eq!(released[0].actor, "tripwire:runaway");
    c.guard.refresh_controls().await.unwrap();
    assert!(matches!(c.claim(&request(&scope("spend-after"), "embed")).await, ClaimOutcome::Acquired(_)));
    // An instance that still sees the released switch as due never releases one a person
    // engaged on the target since.
    let acme = TenantId::parse("acme").unwrap();
    let prod = SwitchTarget::Namespace { prefix: Namespace::parse("prod").unwrap() };
    let due = engaged(&tripped)[0].clone();
    c.guard.engage_switch("ops", &acme, prod.clone(), "by hand".into(), false).await.unwrap();
    let stale_view = ControlDoc::of_switch(&due);
    let entry = AuditEntry::new(acme.clone(), c.clock.now(), "tripwire:runaway", "switch.release", prod.id());
    assert!(!store.delete_control_if(&stale_view, &entry).await.unwrap());
    assert_eq!(c.guard.switches(&acme).await.unwrap()[0].reason, "by hand");
    c.guard.release_switch("ops", &acme, &prod, None).await.unwrap();
}

/// A rule whose action is `observe` turns a canary back to observe mode when the namespace's
/// effects start failing: of two instances crossing the threshold at once, one writes the
/// prefix's settings (audited once, told once), keeping its other settings; from then every key
/// of the prefix is observed, a more specific canary below it too, on both instances. The rule
/// trips no more while its settings stand; a person setting them again ends it.
pub async fn a_tripwire_turns_a_canary_back_to_observe_once(store: Subject) {
    let c = case(store.clone()).await;
    let other = second_instance(&c, &store).await;
    let acme = TenantId::parse("acme").unwrap();
    let canary = |prefix: &str, percent: u8| SettingsEntry {
        tenant: acme.clone(),
        namespace_prefix: Some(Namespace::parse(prefix).unwrap()),
        settings: Settings {
            enforce_percent: Some(percent),
            default_retention: Some(Duration::from_secs(7200)),
            ..Settings::default()
        },
        updated_by: "ops".into(),
        updated_at: Timestamp(0),
        tripwire: None,
    };
    c.guard.put_settings(canary("prod", 10), None).await.unwrap();
    // Every key of the effects' namespace is on the enforced side.
    c.guard.put_settings(canary("prod/payments-agent", 100), None).await.unwrap();
    let mut rule = runaway_rule(Symptom::FailureRate { above: 0.5 }, Per::Namespace);
    rule.action = TripAction::Observe;
    c.guard.set_tripwire(rule, None).await.unwrap();
    other.refresh_controls().await.unwrap();
    let duplicate = request(&scope("duplicate"), "send");
    let fence = c.acquire(&duplicate).await;
    c.applied(&duplicate.scope, fence, Mutation::Complete(success("sent"))).await;
    let answer = |guard: &Guard| {
        let claim = crate::through_the_door(&duplicate, Duration::ZERO);
        let guard = guard.clone();
        async move { guard.claim(claim).await.unwrap() }
    };
    for guard in [&c.guard, &other] {
        assert!(matches!(answer(guard).await, ClaimOutcome::Replay(_)), "enforced before the trip");
    }

    // The namespace's effects fail from now on: each round, each instance runs one.
    let mut tripped = Vec::new();
    let mut ran = 0;
    while tripped.is_empty() && ran < 40 {
        for guard in [&c.guard, &other] {
            assert_eq!(effect(guard, &format!("failing-{ran}"), "any", false).await, None, "never refused");
            ran += 1;
        }
        tripped = flush_both(&c.guard, &other).await;
    }
    // The completed duplicate and 9 or 10 failures: at least min_calls (10), most of them bad.
    assert_eq!(ran, 10, "effects run before the trip");
    assert_eq!(tripped.len(), 1, "one instance wrote the settings: {tripped:?}");
    let Tripped::Observe(entry) = &tripped[0] else { panic!("not observe mode: {tripped:?}") };
    assert_eq!((entry.settings.mode, entry.settings.enforce_percent), (Some(Mode::Observe), None));
    assert_eq!(entry.settings.default_retention, Some(Duration::from_secs(7200)), "other settings kept");
    assert_eq!(entry.updated_by, "tripwire:runaway");
    assert!(tripped[0].reason().starts_with("tripwire runaway: failure rate"), "{}", tripped[0].reason());
    assert_eq!(tripped[0].target_id(), "namespace:prod");
    let trips = trips_of(&store.store).await;
    assert_eq!(trips.len(), 1, "audited once");
    assert_eq!(trips[0].target, "namespace:prod");
    let stored = c.guard.settings(&acme).await.unwrap();
    let prod = stored.iter().find(|e| e.namespace_prefix.as_ref().is_some_and(|p| p.as_str() == "prod")).unwrap();
    assert_eq!(prod, entry, "the entry as written is the one stored");

    // Both instances observe every key of the prefix, under the more specific canary too.
    for guard in [&c.guard, &other] {
        match answer(guard).await {
            ClaimOutcome::Proceed(would) => assert!(matches!(*would, ClaimOutcome::Replay(_)), "{would:?}"),
            answered => panic!("still enforced after the trip: {answered:?}"),
        }
    }
    // More failures trip nothing more.
    for i in 0..12 {
        assert_eq!(effect(&c.guard, &format!("after-{i}"), "any", false).await, None);
    }
    assert!(flush_both(&c.guard, &other).await.is_empty(), "tripped again");
    assert_eq!(trips_of(&store.store).await.len(), 1);

    // A person sets the canary again: enforced again.
    c.guard.put_settings(canary("prod", 10), None).await.unwrap();
    other.refresh_controls().await.unwrap();
    for guard in [&c.guard, &other] {
        assert!(matches!(answer(guard).await, ClaimOutcome::Replay(_)), "enforced once a person set the canary");
    }
}

/// Of 8 instances whose adds cross an observe rule's threshold at once, one writes the
/// settings and the audit entry, round after round (each round a person sets the canary again).
pub async fn eight_instances_turn_a_canary_to_observe_once_a_round(store: Subject) {
    let c = case(store.clone()).await;
    let mut guards = vec![c.guard.clone()];
    for _ in 1..8 {
        guards.push(second_instance(&c, &store).await);
    }
    let acme = TenantId::parse("acme").unwrap();
    let canary = SettingsEntry {
        tenant: acme.clone(),
        namespace_prefix: Some(Namespace::parse("prod").unwrap()),
        settings: Settings { enforce_percent: Some(10), ..Settings::default() },
        updated_by: "ops".into(),
        updated_at: Timestamp(0),
        tripwire: None,
    };
    let mut rule = runaway_rule(Symptom::FailureRate { above: 0.5 }, Per::Namespace);
    rule.action = TripAction::Observe;
    c.guard.set_tripwire(rule, None).await.unwrap();
    for round in 0..6 {
        c.guard.put_settings(canary.clone(), None).await.unwrap();
        for (n, guard) in guards.iter().enumerate() {
            guard.refresh_controls().await.unwrap();
            for i in 0..2 {
                assert_eq!(effect(guard, &format!("r{round}-{n}-{i}"), "any", false).await, None);
            }
        }
        let flushes = guards.iter().map(|g| g.flush_tripwires());
        let tripped: Vec<Tripped> =
            futures::future::join_all(flushes).await.into_iter().flat_map(|t| t.unwrap()).collect();
        assert_eq!(tripped.len(), 1, "round {round}: {tripped:?}");
        assert!(matches!(&tripped[0], Tripped::Observe(e) if e.settings.mode == Some(Mode::Observe)));
        assert_eq!(trips_of(&store.store).await.len(), round + 1, "round {round}: audited once");
    }
}
