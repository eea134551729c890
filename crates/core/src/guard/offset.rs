//! How far this instance's clock is from the store's, and the bound past which it refuses
//! claims.
//!
//! A shared store (PostgreSQL, Redis) decides leases, retention and expiry by its own clock
//! inside its atomic steps, so no instance's clock can take over a live lease. The guard
//! measures its clock against the store's ([`crate::store::ClaimStore::store_time`]) on the
//! first claim, every [`CLOCK_CHECK`] in the background, and again on a claim once the last
//! measurement is older than [`CLOCK_CHECK_MAX_AGE`]; it decides what it decides itself by its
//! clock moved by that offset ([`StoreAligned`]). Past `limits.max_clock_offset` the instance
//! refuses claims ([`GuardError::ClockOffset`], 503 `clock-offset`) and is not ready until a
//! later measurement is back within bound: a clock that far off is a fault to see and mend
//! (every log line, trace and certificate check of the instance uses it), not one to serve
//! through. A store that decides by this process's clock (memory, SQLite) has no offset.

use std::sync::Mutex;

use super::*;
use crate::clock::{ClockOffset, StoreAligned};

/// How often the background task measures the offset.
pub const CLOCK_CHECK: Duration = Duration::from_secs(2);

/// A claim measures the offset itself when the last measurement is older than this (no
/// background task, or it could not reach the store).
pub const CLOCK_CHECK_MAX_AGE: Duration = Duration::from_secs(10);

/// The offset the guard decides by, and when it was measured.
pub(super) struct Offsets {
    /// The guard's clock: this instance's, moved by the last offset.
    pub(super) aligned: Arc<StoreAligned>,
    last: Mutex<Option<Measured>>,
    /// One measurement at a time.
    measuring: tokio::sync::Mutex<()>,
}

#[derive(Debug, Clone, Copy)]
struct Measured {
    /// `None`: the store decides by this process's clock, for good.
    offset: Option<ClockOffset>,
    at: Instant,
}

impl Offsets {
    pub(super) fn new(local: Arc<dyn Clock>) -> Self {
        Self { aligned: Arc::new(StoreAligned::new(local)), last: Mutex::new(None), measuring: Default::default() }
    }

    fn last(&self) -> Option<Measured> {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The last offset, if it is recent enough to go by.
    fn fresh(&self) -> Option<Option<ClockOffset>> {
        self.last().filter(|m| m.offset.is_none() || m.at.elapsed() < CLOCK_CHECK_MAX_AGE).map(|m| m.offset)
    }
}

impl Guard {
    /// Measures how far this instance's clock is from the store's (one store round trip;
    /// nothing for a store that decides by this process's clock), aligns the guard's clock to
    /// it and reports it to the observer. `None`: the store decides by this process's clock.
    pub async fn measure_clock_offset(&self) -> Result<Option<ClockOffset>, GuardError> {
        let _one = self.offsets.measuring.lock().await;
        self.measure_held().await
    }

    /// [`Guard::measure_clock_offset`], the measuring lock held.
    async fn measure_held(&self) -> Result<Option<ClockOffset>, GuardError> {
        let previous = self.offsets.last();
        if let Some(Measured { offset: None, .. }) = previous {
            return Ok(None);
        }
        let local = self.offsets.aligned.local();
        let before = local.now();
        let store = self.store.store_time().await?;
        let offset = store.map(|store| ClockOffset::measured(before, store, local.now()));
        if let Some(offset) = offset {
            self.offsets.aligned.align(offset);
            self.observer.clock_offset(offset);
            // Said once as it crosses the bound, either way (the metric says it every time).
            let bound = self.limits.max_clock_offset;
            let was_past = previous.and_then(|m| m.offset).is_some_and(|o| o.exceeds(bound));
            match (was_past, offset.exceeds(bound)) {
                (false, true) => tracing::error!(
                    %offset,
                    ?bound,
                    "this instance's clock is off the store's past limits.max_clock_offset: claims are refused"
                ),
                (true, false) => tracing::info!(%offset, ?bound, "this instance's clock is back within bound"),
                _ => {}
            }
        }
        *self.offsets.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Measured { offset, at: Instant::now() });
        Ok(offset)
    }

    /// The offset last measured (`None`: never measured, or the store decides by this process's
    /// clock).
    pub fn clock_offset(&self) -> Option<ClockOffset> {
        self.offsets.last().and_then(|m| m.offset)
    }

    /// Refuses ([`GuardError::ClockOffset`]) while this instance's clock is off the store's
    /// past `limits.max_clock_offset`, measuring first if the last measurement is missing or
    /// old. Every claim passes it; so does the readiness check.
    pub async fn check_clock_offset(&self) -> Result<(), GuardError> {
        let offset = match self.offsets.fresh() {
            Some(offset) => offset,
            None => {
                // Claims that found the measurement old wait for one round trip, not one each.
                let _one = self.offsets.measuring.lock().await;
                match self.offsets.fresh() {
                    Some(offset) => offset,
                    None => self.measure_held().await?,
                }
            }
        };
        match offset {
            Some(offset) if offset.exceeds(self.limits.max_clock_offset) => {
                Err(GuardError::ClockOffset { offset, bound: self.limits.max_clock_offset })
            }
            _ => Ok(()),
        }
    }

    /// A task that measures the offset every [`CLOCK_CHECK`] (stopping after the first if the
    /// store decides by this process's clock). The caller owns it and stops it at shutdown.
    pub fn clock_offset_task(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let guard = self.clone();
        async move {
            let mut tick = tokio::time::interval(CLOCK_CHECK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match guard.measure_clock_offset().await {
                    Ok(None) => return,
                    Ok(Some(_)) => {}
                    Err(error) => tracing::warn!(%error, "could not measure the clock's offset to the store's"),
                }
            }
        }
    }
}
