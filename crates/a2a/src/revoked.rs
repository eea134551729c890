//! The tasks of keys a kill switch revoked: cancelled upstream.
//!
//! A switch engaged with `revoke_leases` ends the leases it covers, keys delegated to a task
//! included (they recover with their delegation once the switch is released: the task is asked,
//! never the message sent again). Their tasks would run on upstream; so each gateway instance
//! watches the switches engaged with `revoke_leases` (the MCP gateway's watch,
//! [`onceguard_mcp::revoked::watch`]) and, once for each, sends `CancelTask` for the task of every
//! delegated key of its upstream that the switch covers. The requests are the gateway's own,
//! without any caller's credentials: an upstream that authenticates each task's caller refuses
//! them, and the task runs on (its key stays revoked, never sent again).

use std::sync::Arc;

use onceguard_core::{Guard, Namespace, Record};
use onceguard_mcp::revoked::Revocable;

use crate::settle::Delegation;
use crate::state::Gateway;

impl Revocable for Gateway {
    fn revocation_guard(&self) -> &Guard {
        self.guard()
    }

    fn keys_namespace(&self) -> Option<Namespace> {
        Some(self.sends_namespace())
    }

    async fn cancel_delegated(self: Arc<Self>, record: Record) -> bool {
        let Some(delegation) = Delegation::of(&record) else { return false };
        self.cancel_task(&delegation).await;
        true
    }
}
