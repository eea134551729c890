//! The background work a guard's owner runs: refreshing the cached switches and settings,
//! forwarding other processes' finished keys to this process's waiters, sweeping expired
//! records and approvals, and pruning the audit log.

use super::*;

impl Guard {
    /// A task that refreshes the cached switches and settings every [`CONTROL_REFRESH`]. The
    /// caller owns it and stops it at shutdown.
    pub fn refresh_controls_task(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let guard = self.clone();
        async move {
            let mut tick = tokio::time::interval(CONTROL_REFRESH);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(error) = guard.refresh_controls().await {
                    tracing::warn!(%error, "could not refresh switches and settings");
                }
            }
        }
    }

    /// A task that wakes this process's waiters for keys finished through other processes (see
    /// [`crate::store::ClaimStore::changes`]); `None` if the store has no such feed. The caller owns the task and
    /// stops it at shutdown.
    pub fn forward_changes(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let mut changes = self.store.changes()?;
        let notifier = self.notifier.clone();
        Some(async move {
            loop {
                match changes.recv().await {
                    Ok(scope) => notifier.notify(&scope),
                    // Missed some: the waiters' polling covers them.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        })
    }

    /// Deletes expired records until none is left or `max_batches` batches of `batch` ran,
    /// then approvals no longer kept the same way; answers what it deleted, and whether it
    /// stopped at `max_batches` with more left (then the caller sweeps again at once: a store
    /// written faster than one run a period deletes keeps growing otherwise).
    pub async fn sweep(&self, batch: usize, max_batches: usize) -> Result<Swept, GuardError> {
        let (records, records_left) =
            in_batches(batch, max_batches, || self.store.sweep(self.clock.now(), batch)).await?;
        let (approvals, approvals_left) =
            in_batches(batch, max_batches, || self.store.sweep_approvals(self.clock.now(), batch)).await?;
        Ok(Swept { records, approvals, more_left: records_left || approvals_left })
    }

    /// Deletes every tenant's audit entries older than `retention`, `batch` at a time, at most
    /// `max_batches` batches per tenant; answers how many it deleted.
    pub async fn prune_audit(
        &self,
        retention: Duration,
        batch: usize,
        max_batches: usize,
    ) -> Result<usize, GuardError> {
        let before = self.clock.now().minus(retention);
        let mut total = 0;
        for tenant in self.store.list_tenants().await? {
            total += in_batches(batch, max_batches, || self.store.prune_audit(&tenant.id, before, batch)).await?.0;
        }
        Ok(total)
    }
}

/// What one sweep deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Expired records.
    pub records: usize,
    /// Approvals past their keeping.
    pub approvals: usize,
    /// Whether it stopped at its number of batches with its last batch full: more may be left.
    pub more_left: bool,
}

/// Runs `step` (which deletes up to `batch` things and answers how many) until it deletes
/// fewer than `batch` or ran `max_batches` times; answers the total, and whether its last
/// batch was full (more may be left).
async fn in_batches<F, Fut>(batch: usize, max_batches: usize, mut step: F) -> Result<(usize, bool), GuardError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<usize, StoreError>>,
{
    let mut total = 0;
    for _ in 0..max_batches {
        let n = step().await?;
        total += n;
        if n < batch {
            return Ok((total, false));
        }
    }
    Ok((total, max_batches > 0))
}
