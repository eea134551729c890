//! A claim on a Redis Cluster: the reservations it makes on other slots before it acquires (a
//! place in the tenant's in-flight set, a charge to the run), the claim itself, and the
//! settling of the reservations once it is decided. The crate documentation gives the design
//! and what it guarantees.

use std::time::Duration;

use onceguard_core::protocol::ClaimRequest;
use onceguard_core::store::StoreError;
use onceguard_core::{ClaimOutcome, Fence, RunId, TenantId};
use redis::ScriptInvocation;

use crate::codec::{Claimed, corrupt};
use crate::layout::{Placement, RunPlacement};
use crate::scripts::SCRIPTS;
use crate::{Conn, MAX_DRAWS, RedisStore, ms, unavailable};

/// A pending charge older than this (or four store timeouts, if longer) was left by a claim
/// that never settled it (its process stopped, or Redis stopped answering).
const LEAKED_AFTER: Duration = Duration::from_secs(600);

/// What a claim holds on other slots while it decides.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    /// The tenant's in-flight quota, once asked.
    pub(crate) quota: Option<QuotaHold>,
    /// The run's admission, once asked.
    pub(crate) run: Option<RunHold>,
}

/// A place in the tenant's in-flight set.
#[derive(Debug)]
pub(crate) struct QuotaHold {
    /// The place's token, or `None` if the quota was spent.
    token: Option<String>,
    /// The place's score: the lease the claim may get ends no later.
    until: Option<u64>,
}

/// What is asked of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldMode {
    /// A charge for a key not yet charged (and the deadline).
    Charge,
    /// Only the deadline (the record is charged already).
    Check,
}

impl HoldMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Charge => "charge",
            Self::Check => "check",
        }
    }
}

/// The run's answer to a claim about to acquire one of its keys.
#[derive(Debug)]
pub(crate) struct RunHold {
    /// The run.
    run: RunId,
    /// What was asked.
    mode: HoldMode,
    /// `ok`, or the limit the claim would pass (`deadline`, `effects`, `cost`).
    verdict: String,
}

impl RunHold {
    /// Whether the claim holds a pending charge, which it must settle.
    fn holds_charge(&self) -> bool {
        self.mode == HoldMode::Charge && self.verdict == "ok"
    }
}

impl Holds {
    /// The run reserved, if any.
    pub(crate) fn run(&self) -> Option<&RunId> {
        self.run.as_ref().map(|h| &h.run)
    }

    /// The claim script's arguments about the holds (see [`crate::scripts::CLAIM`]).
    pub(crate) fn args(&self, invocation: &mut ScriptInvocation<'_>) {
        let (token, spent) = match &self.quota {
            Some(QuotaHold { token: Some(token), .. }) => (token.as_str(), ""),
            Some(QuotaHold { token: None, .. }) => ("", "denied"),
            None => ("", ""),
        };
        let (mode, verdict) = self.run.as_ref().map_or(("", ""), |h| (h.mode.as_str(), h.verdict.as_str()));
        let until = self.quota.as_ref().and_then(|q| q.until).map(|u| u.to_string()).unwrap_or_default();
        invocation.arg(token).arg(spent).arg(mode).arg(verdict).arg(until);
    }
}

/// A tenant's in-flight set member: the record's member, NUL, the place's token.
pub(crate) fn in_flight_member(member: &[u8], token: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(member.len() + 1 + token.len());
    m.extend_from_slice(member);
    m.push(0);
    m.extend_from_slice(token.as_bytes());
    m
}

impl RedisStore {
    /// Claims a key on a Cluster: ask (`peek`), then draw a fence and make the reservations the
    /// record needs (all at once: they are on different slots), then claim with them; again if
    /// the record changed in between. Then settle the reservations.
    pub(crate) async fn claim_on_cluster(
        &self,
        conn: &mut Conn,
        req: &ClaimRequest,
        placement: &Placement,
    ) -> Result<ClaimOutcome, StoreError> {
        let mut holds = Holds::default();
        let mut fence: Option<Fence> = None;
        let mut decided = None;
        // Set when a claim with a fence failed to answer: it may have acquired, using the
        // reservations, so they are left as they are (each errs on the safe side; see the
        // crate documentation).
        let mut maybe_used = false;
        let mut failure = None;
        for _ in 0..MAX_DRAWS {
            let source = fence.map_or_else(|| "peek".to_owned(), |f| f.0.to_string());
            let run = holds.run().cloned();
            match self.run_claim(conn, req, placement, &source, run.as_ref(), &holds).await {
                Ok(Claimed::Outcome { outcome, used_charge }) => {
                    decided = Some((outcome, used_charge));
                    break;
                }
                Ok(Claimed::NeedFence { mark, run, charged }) => {
                    // The run the record would keep: a switch on it refuses (what was reserved
                    // for another run is settled below).
                    if let Some(denial) = run.as_ref().and_then(|r| onceguard_core::control::refusal_of_run(req, r)) {
                        decided = Some((ClaimOutcome::Denied(denial), false));
                        break;
                    }
                    let prepared = self.prepare(conn, req, placement, &mut holds, &mut fence, mark, run, charged);
                    if let Err(e) = prepared.await {
                        failure = Some(e);
                        break;
                    }
                }
                Ok(Claimed::NeedRun(_)) => {
                    failure = Some(corrupt("the claim script asked for a run's keys on a Cluster"));
                    break;
                }
                Err(e) => {
                    maybe_used = fence.is_some();
                    failure = Some(e);
                    break;
                }
            }
        }
        if !maybe_used {
            let acquired = matches!(decided, Some((ClaimOutcome::Acquired(_), _)));
            let used = decided.as_ref().is_some_and(|(_, used)| *used);
            self.settle(conn, &req.scope.tenant, placement, &holds, acquired, used).await;
        }
        match (decided, failure) {
            (Some((outcome, _)), _) => Ok(outcome),
            (None, Some(e)) => Err(e),
            (None, None) => Err(StoreError::Unavailable(format!(
                "redis claim: other claims on the same slot kept overtaking this one ({MAX_DRAWS} fences drawn)"
            ))),
        }
    }

    /// Gets what the claim script asked for: a fence above `mark` (unless the one drawn is),
    /// a place in flight (with a quota, once), and the run's admission for the record it
    /// would write (settling one made for another run).
    #[allow(clippy::too_many_arguments)]
    async fn prepare(
        &self,
        conn: &Conn,
        req: &ClaimRequest,
        placement: &Placement,
        holds: &mut Holds,
        fence: &mut Option<Fence>,
        mark: Fence,
        run: Option<RunId>,
        charged: bool,
    ) -> Result<(), StoreError> {
        let tenant = &req.scope.tenant;
        let draw = fence.is_none_or(|f| f <= mark);
        let reserve_quota = req.max_in_flight.is_some() && holds.quota.is_none();
        let wanted = run.map(|run| (run, if charged { HoldMode::Check } else { HoldMode::Charge }));
        let enough = match (&holds.run, &wanted) {
            (Some(h), Some((run, mode))) => &h.run == run && (h.mode == HoldMode::Charge || *mode == HoldMode::Check),
            (None, None) => true,
            _ => false,
        };
        let (old, new) = if enough { (None, None) } else { (holds.run.take(), wanted) };
        let (drawn, quota, admitted, settled) = tokio::join!(
            async {
                match draw {
                    true => self.draw_fence(conn.clone(), tenant, mark).await.map(Some),
                    false => Ok(None),
                }
            },
            async {
                match (reserve_quota, req.max_in_flight) {
                    (true, Some(max)) => self.reserve_in_flight(conn.clone(), req, max, placement).await.map(Some),
                    _ => Ok(None),
                }
            },
            async {
                match new {
                    Some((run, mode)) => {
                        let verdict =
                            self.reserve_run(conn.clone(), tenant, &run, mode, &placement.member, req.cost).await?;
                        Ok(Some(RunHold { run, mode, verdict }))
                    }
                    None => Ok(None),
                }
            },
            async {
                match &old {
                    Some(h) if h.holds_charge() => {
                        self.settle_run(conn.clone(), tenant, &h.run, &placement.member, false).await
                    }
                    _ => Ok(()),
                }
            },
        );
        // Keep what was reserved even if something else failed, so that it is settled.
        let mut failed = None;
        match drawn {
            Ok(drawn) => *fence = drawn.or(*fence),
            Err(e) => failed = Some(e),
        }
        match quota {
            Ok(Some(quota)) => holds.quota = Some(quota),
            Ok(None) => {}
            Err(e) => failed = failed.or(Some(e)),
        }
        match admitted {
            Ok(admitted) => holds.run = admitted.or(holds.run.take()),
            Err(e) => failed = failed.or(Some(e)),
        }
        failed.or(settled.err()).map_or(Ok(()), Err)
    }

    /// Draws a fence from the tenant's counter, raised first to at least `mark` and to the
    /// counter of earlier versions.
    pub(crate) async fn draw_fence(&self, mut conn: Conn, tenant: &TenantId, mark: Fence) -> Result<Fence, StoreError> {
        let mut invocation = SCRIPTS.draw_fence.prepare_invoke();
        invocation.key(self.keys.fence_counter(tenant)).arg(mark.0.max(self.fence_floor));
        let fence: u64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("draw a fence"))?;
        crate::check_range(&[fence])?;
        Ok(Fence(fence))
    }

    /// Reserves a place in the tenant's in-flight set, scored by the lease the claim would get
    /// (the store's now on the set's slot, plus the lease).
    async fn reserve_in_flight(
        &self,
        mut conn: Conn,
        req: &ClaimRequest,
        max: u64,
        placement: &Placement,
    ) -> Result<QuotaHold, StoreError> {
        let token = format!("{:016x}", rand::random::<u64>());
        let mut invocation = SCRIPTS.reserve_in_flight.prepare_invoke();
        invocation
            .key(self.keys.in_flight(&req.scope.tenant))
            .arg(self.clock_arg())
            .arg(max)
            .arg(in_flight_member(&placement.member, &token))
            .arg(ms(req.lease))
            .arg(ms(self.options.expiry_margin));
        let score: u64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("reserve a place in flight"))?;
        let reserved = score > 0;
        Ok(QuotaHold { token: reserved.then_some(token), until: reserved.then_some(score) })
    }

    /// Asks the run to admit the key (see [`crate::scripts::RESERVE_RUN`]); answers the verdict.
    #[allow(clippy::too_many_arguments)]
    async fn reserve_run(
        &self,
        mut conn: Conn,
        tenant: &TenantId,
        run: &RunId,
        mode: HoldMode,
        member: &[u8],
        cost: u64,
    ) -> Result<String, StoreError> {
        let at = RunPlacement::of(tenant, run);
        let leaked_after = ms(self.options.timeout.saturating_mul(4).max(LEAKED_AFTER));
        let mut invocation = SCRIPTS.reserve_run.prepare_invoke();
        invocation
            .key(self.keys.run(&at))
            .key(self.keys.run_pending(&at))
            .arg(self.clock_arg())
            .arg(tenant.as_str())
            .arg(run.as_str())
            .arg(member)
            .arg(cost)
            .arg(mode.as_str())
            .arg(leaked_after);
        invocation.invoke_async(&mut conn).await.map_err(unavailable("reserve a charge"))
    }

    /// Settles a pending charge: `used` if the claim charged its record with it.
    async fn settle_run(
        &self,
        mut conn: Conn,
        tenant: &TenantId,
        run: &RunId,
        member: &[u8],
        used: bool,
    ) -> Result<(), StoreError> {
        let at = RunPlacement::of(tenant, run);
        let mut invocation = SCRIPTS.settle_run.prepare_invoke();
        invocation.key(self.keys.run(&at)).key(self.keys.run_pending(&at)).arg(member).arg(if used {
            "1"
        } else {
            "0"
        });
        invocation.invoke_async::<i64>(&mut conn).await.map(drop).map_err(unavailable("settle a charge"))
    }

    /// Removes a place from the tenant's in-flight set.
    pub(crate) async fn release_in_flight(
        &self,
        mut conn: Conn,
        tenant: &TenantId,
        member: &[u8],
        token: &str,
    ) -> Result<(), StoreError> {
        redis::cmd("ZREM")
            .arg(self.keys.in_flight(tenant))
            .arg(in_flight_member(member, token))
            .query_async::<i64>(&mut conn)
            .await
            .map(drop)
            .map_err(unavailable("leave the in-flight set"))
    }

    /// Raises a place in the tenant's in-flight set to a longer lease (never lowers it).
    pub(crate) async fn raise_in_flight(
        &self,
        mut conn: Conn,
        tenant: &TenantId,
        member: &[u8],
        token: &str,
        until: u64,
    ) -> Result<(), StoreError> {
        redis::cmd("ZADD")
            .arg(self.keys.in_flight(tenant))
            .arg("GT")
            .arg(until)
            .arg(in_flight_member(member, token))
            .query_async::<i64>(&mut conn)
            .await
            .map(drop)
            .map_err(unavailable("extend in the in-flight set"))
    }

    /// Settles the reservations of a decided claim: a place in flight is kept only if the claim
    /// acquired (its record names the place); a pending charge says whether the claim used it.
    /// A failure is logged, not answered: the claim is decided, and what is left over errs on
    /// the safe side (a place counted until its lease would have ended, a charge kept).
    async fn settle(
        &self,
        conn: &Conn,
        tenant: &TenantId,
        placement: &Placement,
        holds: &Holds,
        acquired: bool,
        used: bool,
    ) {
        let (released, settled) = tokio::join!(
            async {
                match &holds.quota {
                    Some(QuotaHold { token: Some(token), .. }) if !acquired => {
                        self.release_in_flight(conn.clone(), tenant, &placement.member, token).await
                    }
                    _ => Ok(()),
                }
            },
            async {
                match &holds.run {
                    Some(h) if h.holds_charge() => {
                        self.settle_run(conn.clone(), tenant, &h.run, &placement.member, used).await
                    }
                    _ => Ok(()),
                }
            },
        );
        for error in [released.err(), settled.err()].into_iter().flatten() {
            tracing::warn!(%error, "redis: a claim's reservation could not be settled; it is kept");
        }
    }
}
