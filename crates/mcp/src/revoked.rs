//! The tasks of keys a kill switch revoked: cancelled upstream.
//!
//! A switch engaged with `revoke_leases` ends the leases it covers, delegated keys included
//! (they recover with their delegation once it is released: the task is asked, never the call
//! run again). Their tasks would run on upstream; so each gateway instance watches the switches
//! engaged with `revoke_leases` and, once for each, sends `tasks/cancel` for every delegated key
//! of its upstream that the switch covers, then asks the task what it did and settles the key
//! (a task that had completed completes it; a cancelled one leaves it unknown). The requests are
//! the gateway's own: the call's protocol revision and session, none of its caller's
//! credentials (an upstream that authenticates each task's caller refuses them, and the task
//! runs on; the key stays revoked, never forwarded again).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, Uri};
use onceguard_core::control::{Switch, SwitchTarget};
use onceguard_core::{Guard, ListFilter, Namespace, Record, RecordState, RunId, Scope};

use crate::delegated::{ACTOR, Capture, ask, ask_one, own_headers};
use crate::state::Gateway;
use crate::tasks::Delegation;

/// How often the switches are looked at.
const EVERY: Duration = Duration::from_secs(1);

/// Most pages of a switch's delegated keys gone through (100 records a page).
const MAX_PAGES: usize = 100;

/// How long after an instance first sees a switch it looks again each second: the switch's
/// second revocation pass comes [`onceguard_core::CONTROL_MAX_AGE`] after the first, and keys
/// other instances delegated meanwhile are revoked only then.
const RESCAN: Duration = Duration::from_secs(10);

/// What an instance did about one engaged switch.
struct Seen {
    since: std::time::Instant,
    /// Whether a pass went through every page without an error.
    complete: bool,
    /// The keys (scope and fence) whose tasks it cancelled.
    cancelled: HashSet<(String, u64)>,
}

/// A gateway whose keys delegated to tasks a switch engaged with `revoke_leases` cancels
/// upstream (the MCP gateway's `tasks/cancel`, the A2A gateway's `CancelTask`).
pub trait Revocable: Send + Sync + 'static {
    /// The guard.
    fn revocation_guard(&self) -> &Guard;
    /// The namespace the gateway's keys live under (`mcp/<upstream>`, `a2a/<upstream>`).
    fn keys_namespace(&self) -> Option<Namespace>;
    /// Cancels the task of `record`'s key when the key is delegated to one; answers whether it
    /// was.
    fn cancel_delegated(self: Arc<Self>, record: Record) -> impl Future<Output = bool> + Send;
}

/// Watches the switches while `gateway` lives (when there is a runtime to watch them in).
pub fn watch<G: Revocable>(gateway: &Arc<G>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    let weak = Arc::downgrade(gateway);
    runtime.spawn(async move {
        let mut seen: HashMap<(String, String, String), Seen> = HashMap::new();
        let mut tick = tokio::time::interval(EVERY);
        loop {
            tick.tick().await;
            let Some(gateway) = weak.upgrade() else { return };
            let Ok(switches) = gateway.revocation_guard().engaged_switches().await else { continue };
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

/// Cancels the tasks of the delegated keys of the gateway's upstream that `switch` covers, but
/// those in `cancelled` (which it adds to); answers whether it went through every page.
async fn cancel_covered<G: Revocable>(
    gateway: &Arc<G>,
    switch: &Switch,
    cancelled: &mut HashSet<(String, u64)>,
) -> bool {
    let Some(upstream) = gateway.keys_namespace() else { return true };
    let run = match &switch.target {
        SwitchTarget::Run { run } => Some(run.clone()),
        SwitchTarget::Namespace { prefix } if !prefix.is_within(&upstream) && !upstream.is_within(prefix) => {
            return true;
        }
        _ => None,
    };
    let mut after = None;
    let before = cancelled.len();
    for _ in 0..MAX_PAGES {
        let filter = ListFilter {
            namespace_prefix: Some(upstream.clone()),
            state: Some(RecordState::InProgress),
            stuck: false,
            run: run.clone(),
            after,
            limit: 100,
        };
        let Ok(page) = gateway.revocation_guard().list(&switch.tenant, &filter).await else { return false };
        for record in page.items.iter().filter(|r| switch.target.covers_record(r)) {
            let key = (record.scope.to_string(), record.fence.0);
            if !cancelled.contains(&key) && gateway.clone().cancel_delegated(record.clone()).await {
                cancelled.insert(key);
            }
        }
        match page.next {
            Some(next) => after = Some(next),
            None => {
                let sent = cancelled.len() - before;
                if sent > 0 {
                    tracing::info!(tenant = %switch.tenant, target = %switch.target, sent, "cancelled the tasks of the delegated keys a switch revoked");
                }
                return true;
            }
        }
    }
    tracing::warn!(tenant = %switch.tenant, target = %switch.target, "a switch covers more delegated keys than one pass reads; the rest are cancelled in the next passes");
    false
}

impl Revocable for Gateway {
    fn revocation_guard(&self) -> &Guard {
        self.guard()
    }

    fn keys_namespace(&self) -> Option<Namespace> {
        Namespace::parse(&format!("mcp/{}", crate::call::segment(&self.options.upstream_name))).ok()
    }

    async fn cancel_delegated(self: Arc<Self>, record: Record) -> bool {
        let Some(delegation) = Delegation::of(&record) else { return false };
        cancel(&self, &record, &delegation).await;
        true
    }
}

/// Sends `tasks/cancel` for `delegation`'s task when a switch engaged with `revoke_leases`
/// covers `scope` (a call forwarded before the switch, whose handle came after it: its key's
/// delegation was refused as stale).
pub(crate) async fn cancel_if_revoked(gateway: &Gateway, scope: &Scope, run: Option<&RunId>, delegation: &Delegation) {
    let Ok(switches) = gateway.guard().engaged_switches().await else { return };
    let revoked =
        switches.iter().any(|s| s.revoke_leases && s.tenant == scope.tenant && s.target.covers(&scope.namespace, run));
    if revoked {
        send_cancel(gateway, delegation).await;
        tracing::info!(scope = %scope, "sent tasks/cancel for a task started after a switch revoked its key");
    }
}

/// Sends `tasks/cancel` for `delegation`'s task; answers the headers and endpoint it used.
async fn send_cancel(gateway: &Gateway, delegation: &Delegation) -> Option<(HeaderMap, Uri)> {
    let headers = own_headers(delegation);
    let uri = gateway.options.endpoint.parse::<Uri>().ok()?;
    let _ = ask_one(gateway, &headers, &uri, delegation, "tasks/cancel").await;
    Some((headers, uri))
}

/// Sends `tasks/cancel` for the task of `record`'s key, then asks it, and settles the key.
async fn cancel(gateway: &Arc<Gateway>, record: &Record, delegation: &Delegation) {
    let Some((headers, uri)) = send_cancel(gateway, delegation).await else { return };
    let state = ask(gateway, &headers, &uri, delegation).await;
    Capture::of(gateway, record, ACTOR, delegation.task_ref(record).id(), &delegation.task).settle(state).await;
}
