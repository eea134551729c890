//! In-process wake-ups for claims that wait on an in-flight key.
//!
//! A waiter subscribes to its key *before* it claims, so that a completion landing between its
//! claim and its wait is never missed. Every finishing call made through this process notifies
//! the key; stores shared between processes add their own feed (and waiters always fall back to
//! polling, so a missed notification only delays, never loses, a replay).

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

use crate::domain::Scope;

/// Per-key change notifications.
#[derive(Debug, Default)]
pub struct Notifier {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    keys: HashMap<Scope, watch::Sender<u64>>,
    /// When the map grows to this size, entries nobody waits on are dropped (amortized).
    prune_at: usize,
}

/// A subscription to one key's changes; see [`Notifier::subscribe`].
#[derive(Debug)]
pub struct Subscription {
    rx: watch::Receiver<u64>,
}

impl Subscription {
    /// Resolves when the key changed since the subscription was made (or since the last call).
    pub async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            // The sender is gone only when the notifier is dropped; never resolve then.
            std::future::pending::<()>().await;
        }
    }
}

impl Notifier {
    /// Subscribes to changes of `scope`.
    pub fn subscribe(&self, scope: &Scope) -> Subscription {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.keys.len() >= inner.prune_at {
            inner.keys.retain(|_, tx| tx.receiver_count() > 0);
            inner.prune_at = (inner.keys.len() * 2).max(1024);
        }
        let tx = inner.keys.entry(scope.clone()).or_insert_with(|| watch::channel(0).0);
        let mut rx = tx.subscribe();
        rx.mark_unchanged();
        Subscription { rx }
    }

    /// Wakes every waiter of `scope`.
    pub fn notify(&self, scope: &Scope) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = inner.keys.get(scope) {
            tx.send_modify(|v| *v = v.wrapping_add(1));
            if tx.receiver_count() == 0 {
                inner.keys.remove(scope);
            }
        }
    }
}
