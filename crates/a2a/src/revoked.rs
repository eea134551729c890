//! The tasks of keys a kill switch revoked: cancelled upstream.
//!
//! A switch engaged with `revoke_leases` ends the leases it covers, keys delegated to a task
//! included (they recover with their delegation once the switch is released: the task is asked,
//! never the message sent again). Their tasks would run on upstream; so each gateway instance
//! watches the switches engaged with `revoke_leases` and, once for each, sends `CancelTask` for
//! the task of every delegated key of its upstream that the switch covers. The requests are the
//! gateway's own, without any caller's credentials: an upstream that authenticates each task's
//! caller refuses them, and the task runs on (its key stays revoked, never sent again).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use onceguard_core::control::{Switch, SwitchTarget};
use onceguard_core::{ListFilter, RecordState};

use crate::settle::Delegation;
use crate::state::Gateway;

/// How often the switches are looked at.
const EVERY: Duration = Duration::from_secs(1);

/// Most pages of a switch's delegated keys gone through (100 records a page).
const MAX_PAGES: usize = 100;

/// How long after an instance first sees a switch it looks again each second: keys other
/// instances delegated meanwhile are revoked by the switch's second pass.
const RESCAN: Duration = Duration::from_secs(10);

/// What an instance did about one engaged switch.
struct Seen {
    since: std::time::Instant,
    /// Whether a pass went through every page without an error.
    complete: bool,
    /// The keys (scope and fence) whose tasks it cancelled.
    cancelled: HashSet<(String, u64)>,
}

/// Watches the switches while `gateway` lives (when there is a runtime to watch them in).
pub(crate) fn watch(gateway: &Arc<Gateway>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    let weak = Arc::downgrade(gateway);
    runtime.spawn(async move {
        let mut seen: HashMap<(String, String, String), Seen> = HashMap::new();
        let mut tick = tokio::time::interval(EVERY);
        loop {
            tick.tick().await;
            let Some(gateway) = weak.upgrade() else { return };
            let Ok(switches) = gateway.guard().engaged_switches().await else { continue };
            let revoking: Vec<&Switch> = switches.iter().filter(|s| s.revoke_leases).collect();
            let id = |s: &Switch| (s.tenant.to_string(), s.target.id(), s.engaged_at.to_rfc3339());
            seen.retain(|k, _| revoking.iter().any(|s| id(s) == *k));
            for switch in revoking {
                let entry = seen.entry(id(switch)).or_insert_with(|| Seen {
                    since: std::time::Instant::now(),
                    complete: false,
                    cancelled: HashSet::new(),
                });
                if !entry.complete || entry.since.elapsed() < RESCAN {
                    entry.complete |= cancel_covered(&gateway, switch, &mut entry.cancelled).await;
                }
            }
        }
    });
}

/// Cancels the tasks of the delegated keys of this gateway's upstream that `switch` covers, but
/// those in `cancelled` (which it adds to); answers whether it went through every page.
async fn cancel_covered(gateway: &Arc<Gateway>, switch: &Switch, cancelled: &mut HashSet<(String, u64)>) -> bool {
    let sends = gateway.sends_namespace();
    let run = match &switch.target {
        SwitchTarget::Run { run } => Some(run.clone()),
        SwitchTarget::Namespace { prefix } if !prefix.is_within(&sends) && !sends.is_within(prefix) => return true,
        _ => None,
    };
    let mut after = None;
    let before = cancelled.len();
    for _ in 0..MAX_PAGES {
        let filter = ListFilter {
            namespace_prefix: Some(sends.clone()),
            state: Some(RecordState::InProgress),
            stuck: false,
            run: run.clone(),
            after,
            limit: 100,
        };
        let Ok(page) = gateway.guard().list(&switch.tenant, &filter).await else { return false };
        for record in page.items.iter().filter(|r| switch.target.covers_record(r)) {
            if let Some(delegation) = Delegation::of(record)
                && cancelled.insert((record.scope.to_string(), record.fence.0))
            {
                gateway.cancel_task(&delegation).await;
            }
        }
        match page.next {
            Some(next) => after = Some(next),
            None => {
                let sent = cancelled.len() - before;
                if sent > 0 {
                    tracing::info!(tenant = %switch.tenant, target = %switch.target, sent, "sent CancelTask for the tasks of the keys a switch revoked");
                }
                return true;
            }
        }
    }
    tracing::warn!(tenant = %switch.tenant, target = %switch.target, "a switch covers more delegated keys than one pass reads; the rest are cancelled in the next passes");
    false
}
