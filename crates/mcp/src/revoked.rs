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

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, Uri};
use onceguard_core::control::{Switch, SwitchTarget};
use onceguard_core::{ListFilter, Namespace, Record, RecordState};

use crate::delegated::{Capture, ask, ask_one};
use crate::state::Gateway;
use crate::tasks::{self, Delegation};

/// How often the switches are looked at.
const EVERY: Duration = Duration::from_secs(1);

/// Most pages of a switch's delegated keys gone through (100 records a page).
const MAX_PAGES: usize = 100;

/// Who settles a key after a switch's cancel, for the audit log.
const ACTOR: &str = "onceguard-mcp";

/// Watches the switches while `gateway` lives.
pub(crate) fn watch(gateway: &Arc<Gateway>) {
    let weak = Arc::downgrade(gateway);
    tokio::spawn(async move {
        let mut handled: HashSet<(String, String, String)> = HashSet::new();
        let mut tick = tokio::time::interval(EVERY);
        loop {
            tick.tick().await;
            let Some(gateway) = weak.upgrade() else { return };
            let Ok(switches) = gateway.guard().engaged_switches().await else { continue };
            let revoking: Vec<&Switch> = switches.iter().filter(|s| s.revoke_leases).collect();
            let id = |s: &Switch| (s.tenant.to_string(), s.target.id(), s.engaged_at.to_rfc3339());
            handled.retain(|h| revoking.iter().any(|s| id(s) == *h));
            for switch in revoking {
                if handled.insert(id(switch)) {
                    cancel_covered(&gateway, switch).await;
                }
            }
        }
    });
}

/// Cancels the tasks of the delegated keys of this gateway's upstream that `switch` covers.
async fn cancel_covered(gateway: &Arc<Gateway>, switch: &Switch) {
    let Ok(upstream) = Namespace::parse(&format!("mcp/{}", crate::call::segment(&gateway.options.upstream_name)))
    else {
        return;
    };
    let run = match &switch.target {
        SwitchTarget::Run { run } => Some(run.clone()),
        SwitchTarget::Namespace { prefix } if !prefix.is_within(&upstream) && !upstream.is_within(prefix) => return,
        _ => None,
    };
    let mut after = None;
    let mut cancelled = 0usize;
    for _ in 0..MAX_PAGES {
        let filter = ListFilter {
            namespace_prefix: Some(upstream.clone()),
            state: Some(RecordState::InProgress),
            stuck: false,
            run: run.clone(),
            after,
            limit: 100,
        };
        let Ok(page) = gateway.guard().list(&switch.tenant, &filter).await else { return };
        for record in page.items.iter().filter(|r| switch.target.covers_record(r)) {
            if let Some(delegation) = Delegation::of(record) {
                cancel(gateway, record, &delegation).await;
                cancelled += 1;
            }
        }
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    if cancelled > 0 {
        tracing::info!(tenant = %switch.tenant, target = %switch.target, cancelled, "sent tasks/cancel for the delegated keys a switch revoked");
    }
}

/// Sends `tasks/cancel` for the task of `record`'s key, then asks it, and settles the key.
async fn cancel(gateway: &Arc<Gateway>, record: &Record, delegation: &Delegation) {
    let headers = own_headers(delegation);
    let Ok(uri) = gateway.options.endpoint.parse::<Uri>() else { return };
    let _ = ask_one(gateway, &headers, &uri, delegation, "tasks/cancel").await;
    let state = ask(gateway, &headers, &uri, delegation).await;
    let capture = Capture {
        gateway: gateway.clone(),
        scope: record.scope.clone(),
        fence: record.fence,
        actor: ACTOR.to_owned(),
        unknown: record.unknown.is_some(),
        task_id: delegation.task_ref(record).id(),
    };
    capture.settle(state).await;
}

/// The headers of the gateway's own request about a task: JSON, the call's protocol revision
/// and session, and (2026-07-28 and later) the method and name headers that `ask_one` fills in.
fn own_headers(delegation: &Delegation) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("accept", HeaderValue::from_static("application/json, text/event-stream"));
    let value = |v: &str| HeaderValue::from_str(v).ok();
    if let Some(revision) = delegation.revision.as_deref().and_then(value) {
        if tasks::is_modern(revision.to_str().unwrap_or_default()) {
            headers.insert("mcp-method", HeaderValue::from_static("tasks/get"));
        }
        headers.insert("mcp-protocol-version", revision);
    }
    if let Some(session) = delegation.session.as_deref().and_then(value) {
        headers.insert("mcp-session-id", session);
    }
    headers
}
