//! Conformance case of a canary (`enforce_percent`): enforce mode for a share of keys, observe
//! mode for the rest, on every store.

use onceguard_core::control::{Mode, Settings, SettingsEntry, canary_mode};

use super::*;

/// Under a canary of 30 % on a namespace prefix, a duplicate claim of each key is answered as its
/// side says: a replay where enforced, `proceed` (would have been a replay) where observed; the
/// same key always on the same side. About 30 % of 200 keys are enforced.
pub async fn a_canary_enforces_its_share_of_keys(store: Subject) {
    let c = case(store).await;
    let entry = SettingsEntry {
        tenant: TenantId::parse("acme").unwrap(),
        namespace_prefix: Some(Namespace::parse("prod").unwrap()),
        settings: Settings { enforce_percent: Some(30), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: c.clock.now(),
        tripwire: None,
    };
    c.guard.put_settings(entry, None).await.unwrap();
    let mut enforced = 0;
    for i in 0..200 {
        let s = scope(&format!("canary-{i}"));
        let req = request(&s, "send");
        let first = c.acquire(&req).await;
        c.applied(&s, first, Mutation::Complete(success("sent"))).await;
        for _ in 0..2 {
            match (canary_mode(&s, 30), c.claim(&req).await) {
                (Mode::Enforce, ClaimOutcome::Replay(_)) => {}
                (Mode::Observe, ClaimOutcome::Proceed(would)) => assert!(matches!(*would, ClaimOutcome::Replay(_))),
                (side, other) => panic!("key {i} on the {side:?} side answered {other:?}"),
            }
        }
        enforced += usize::from(canary_mode(&s, 30) == Mode::Enforce);
    }
    assert!((40..=80).contains(&enforced), "{enforced} of 200 keys enforced");
    // Outside the prefix every key is enforced.
    let outside = request(&scope_in("acme", "staging/x", "k"), "send");
    let fence = c.acquire(&outside).await;
    c.applied(&outside.scope, fence, Mutation::Complete(success("sent"))).await;
    assert!(matches!(c.claim(&outside).await, ClaimOutcome::Replay(_)));
}
