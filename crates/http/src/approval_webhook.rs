//! The webhook told of each pending approval: a signed `POST` (Standard Webhooks: headers
//! `webhook-id`, the approval's id, the same on every attempt; `webhook-timestamp`;
//! `webhook-signature`, `v1,` and the base64 HMAC-SHA256 of `id.timestamp.body`).
//!
//! Every instance looks at the pending approvals every `approvals.webhook_poll`. An attempt is
//! taken by writing the approval's notice, with a lease, over the approval as read (the store's
//! compare-and-set): one instance sends it, whichever instances run, and however often the
//! claim that asked was retried (it asked once). A receiver that answers 2xx has it: the
//! notice is marked delivered and never sent again. Any other answer, a timeout or a crash
//! before the mark leaves the lease to pass, and the next attempt goes out with the same
//! `webhook-id` (so a receiver that did get it can drop the repeat), the lease doubling from
//! 5 s up to an hour, at most `approvals.webhook_attempts` attempts. A notice is sent only while
//! its approval is pending.
//!
//! The same webhook is told when a tripwire trips (`type: tripwire.tripped`; `data.action` says
//! whether it engaged a switch or turned its scope to observe mode), by the one instance whose
//! trip wrote it (see `onceguard_core::tripwire`): up to `approvals.webhook_attempts` attempts
//! with the same `webhook-id`, 5 s apart and doubling, from that instance's memory. An instance
//! stopped before delivery loses the notice; the switch (or the settings), its audit entry
//! (`tripwire.trip`) and the metric `onceguard_tripwires_tripped_total` remain.

use std::time::Duration;

use onceguard_core::approval::{Approval, ApprovalState};
use onceguard_core::tripwire::Tripped;
use onceguard_core::{Guard, GuardError, Timestamp};
use tokio::sync::watch;

use crate::config::ApprovalsConfig;

/// The webhook, ready to send.
pub struct Webhook {
    url: reqwest::Url,
    signer: standardwebhooks::Webhook,
    client: reqwest::Client,
    attempts: u32,
    timeout: Duration,
}

/// The webhook could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("approvals webhook: {0}")]
pub struct WebhookError(String);

impl Webhook {
    /// The webhook of `config`, its secret read from `approvals.webhook_secret_file`; `None`
    /// when no URL is configured.
    pub fn from_config(config: &ApprovalsConfig) -> Result<Option<Self>, WebhookError> {
        if config.webhook_url.is_empty() {
            return Ok(None);
        }
        let url = reqwest::Url::parse(&config.webhook_url).map_err(|e| WebhookError(e.to_string()))?;
        let path = config.webhook_secret_file.as_ref().ok_or_else(|| WebhookError("no secret file".into()))?;
        let secret = std::fs::read_to_string(path)
            .map_err(|e| WebhookError(format!("reading the secret {}: {e}", path.display())))?;
        Self::new(url, secret.trim(), config.webhook_timeout, config.webhook_attempts).map(Some)
    }

    /// A webhook to `url` signed with `secret` (`whsec_` and base64).
    pub fn new(url: reqwest::Url, secret: &str, timeout: Duration, attempts: u32) -> Result<Self, WebhookError> {
        if !secret.starts_with("whsec_") {
            return Err(WebhookError("the secret must be whsec_ and base64".into()));
        }
        let signer = standardwebhooks::Webhook::new(secret).map_err(|e| WebhookError(format!("the secret: {e}")))?;
        let client = reqwest::Client::builder().timeout(timeout).build().map_err(|e| WebhookError(e.to_string()))?;
        Ok(Self { url, signer, client, attempts, timeout })
    }

    /// One pass over every tenant's pending approvals: sends each notice that is due and not
    /// taken by another instance. Answers how many were delivered.
    pub async fn notify_pending(&self, guard: &Guard) -> Result<usize, GuardError> {
        let mut delivered = 0;
        for tenant in guard.tenants().await? {
            for approval in &guard.all_approvals(&tenant.id, Some(ApprovalState::Pending), usize::MAX).await? {
                // One approval's store write failing leaves the others to be sent.
                match self.notify(guard, approval).await {
                    Ok(sent) => delivered += usize::from(sent),
                    Err(e) => {
                        tracing::warn!(approval = approval.id.as_str(), error = %e, "approval webhook: could not take or settle a notice; will retry")
                    }
                }
            }
        }
        Ok(delivered)
    }

    /// Sends the notice of `approval` if it is due and this instance takes it; answers whether
    /// the receiver has it now.
    async fn notify(&self, guard: &Guard, approval: &Approval) -> Result<bool, GuardError> {
        let timeout = self.timeout;
        let Some(taken) = guard.take_notice(approval, |attempt| timeout + backoff(attempt), self.attempts).await?
        else {
            return Ok(false);
        };
        let attempt = taken.notice.as_ref().map_or(0, |n| n.attempts);
        let result = self.send(&taken, guard.clock().now()).await;
        let (tenant, id) = (&taken.scope.tenant, taken.id.as_str());
        match &result {
            Ok(()) => tracing::info!(%tenant, approval = id, attempt, "approval webhook delivered"),
            Err(e) if attempt >= self.attempts => {
                tracing::error!(%tenant, approval = id, attempt, error = e, "approval webhook abandoned")
            }
            Err(e) => tracing::warn!(%tenant, approval = id, attempt, error = e, "approval webhook failed; will retry"),
        }
        let delivered = result.is_ok();
        guard.settle_notice(&taken, result).await?;
        Ok(delivered)
    }

    /// One attempt: the signed `POST` of the approval's notice.
    async fn send(&self, approval: &Approval, now: Timestamp) -> Result<(), String> {
        self.post(approval.id.as_str(), &payload(approval, now), now).await
    }
}

impl Webhook {
    /// Tells of a tripwire's trip (a switch it engaged, or its scope turned to observe mode; see
    /// the module documentation): retries until the receiver answers 2xx or the attempts run
    /// out.
    pub async fn notify_tripped(&self, tripped: &Tripped) {
        let (tenant, target) = (tripped.tenant(), tripped.target_id());
        // The rule and what it did too: two rules tripping on one target in one flush are two notices.
        let rule = tripped.trip().map_or("", |t| t.rule.as_str());
        let action = if matches!(tripped, Tripped::Observe(_)) { "observe" } else { "switch" };
        let id = format!("tripwire_{tenant}_{}_{rule}_{action}_{}", target.replace(':', "_"), tripped.at().0);
        for attempt in 1..=self.attempts.max(1) {
            let now = Timestamp::now();
            match self.post(&id, &tripped_payload(tripped, now), now).await {
                Ok(()) => {
                    tracing::info!(%tenant, %target, attempt, "tripwire webhook delivered");
                    return;
                }
                Err(e) => {
                    tracing::warn!(%tenant, %target, attempt, error = e, "tripwire webhook failed")
                }
            }
            if attempt < self.attempts {
                tokio::time::sleep(backoff(attempt)).await;
            }
        }
        tracing::error!(%tenant, %target, "tripwire webhook abandoned");
    }

    /// One signed `POST` of `payload` as notice `id`.
    async fn post(&self, id: &str, payload: &serde_json::Value, now: Timestamp) -> Result<(), String> {
        let body = serde_json::to_vec(payload).map_err(|e| e.to_string())?;
        let timestamp = i64::try_from(now.0 / 1000).unwrap_or(i64::MAX);
        let signature = self.signer.sign(id, timestamp, &body).map_err(|e| e.to_string())?;
        let response = self
            .client
            .post(self.url.clone())
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(body)
            .send()
            .await
            .map_err(|e| format!("the receiver could not be reached: {e}"))?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("the receiver answered {}", response.status()))
        }
    }
}

/// What a tripwire's notice says: its tenant, what it did (`action`), the figures it tripped on;
/// of a switch, the switch as `GET /v1/switches` shows it; of observe mode, the settings it
/// wrote.
fn tripped_payload(tripped: &Tripped, now: Timestamp) -> serde_json::Value {
    let mut data = serde_json::json!({
        "tenant": tripped.tenant().as_str(),
        "target": tripped.target_id(),
        "reason": tripped.reason(),
        "engaged_at": tripped.at().to_rfc3339(),
        "tripwire": tripped.trip(),
    });
    match tripped {
        Tripped::Switch(s) => {
            data["action"] = "switch".into();
            data["revoke_leases"] = s.revoke_leases.into();
            data["engaged_by"] = s.engaged_by.clone().into();
        }
        Tripped::Observe(e) => {
            data["action"] = "observe".into();
            data["engaged_by"] = e.updated_by.clone().into();
            data["settings"] = serde_json::to_value(&e.settings).unwrap_or_default();
        }
    }
    serde_json::json!({ "type": "tripwire.tripped", "timestamp": now.to_rfc3339(), "data": data })
}

/// How long after attempt `n` (counting from 1) the next may begin, beyond the timeout: 5 s,
/// doubling, at most an hour.
fn backoff(n: u32) -> Duration {
    Duration::from_secs(5).saturating_mul(1 << n.saturating_sub(1).min(10)).min(Duration::from_secs(3600))
}

/// What a notice says: the approval as the API shows it, and its tenant; of a recovery, the
/// attempt it asks about (`recovery`).
fn payload(a: &Approval, now: Timestamp) -> serde_json::Value {
    let mut payload = serde_json::json!({
        "type": "approval.pending",
        "timestamp": now.to_rfc3339(),
        "data": {
            "tenant": a.scope.tenant.as_str(),
            "id": a.id,
            "namespace": a.scope.namespace.as_str(),
            "key": a.scope.key.as_str(),
            "fingerprint": a.fingerprint.as_str(),
            "run": a.run.as_ref().map(|r| r.as_str()),
            "cost": a.cost,
            "summary": a.summary,
            "requested_at": a.requested_at.to_rfc3339(),
            "expires_at": a.expires_at.to_rfc3339(),
        },
    });
    if let Some(recovery) = &a.recovery {
        payload["data"]["recovery"] = serde_json::json!(recovery);
    }
    payload
}

/// Sends due notices every `poll` until `stop` says so.
pub async fn notify_loop(webhook: Webhook, guard: Guard, poll: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if let Err(e) = webhook.notify_pending(&guard).await {
            tracing::warn!(error = %e, "approval webhook: could not read pending approvals; will retry");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_are_signed_as_standard_webhooks_specify() {
        // The specification's example.
        let signer = standardwebhooks::Webhook::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signature = signer.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1_614_265_330, br#"{"test": 2432232314}"#).unwrap();
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn a_tripwire_notice_says_what_the_trip_did() {
        use onceguard_core::control::{ObserveTrip, Settings, SettingsEntry, Switch, SwitchTarget, Trip};
        use onceguard_core::{Namespace, TenantId};
        let acme = TenantId::parse("acme").unwrap();
        let trip = Trip { rule: "r".into(), run: None, calls: 10, bad: 9, window_secs: 300, release_at: None };
        let switch = Switch {
            tenant: acme.clone(),
            target: SwitchTarget::Namespace { prefix: Namespace::parse("prod").unwrap() },
            reason: "tripwire r: failure rate 0.90".into(),
            revoke_leases: true,
            revoked: 0,
            engaged_by: "tripwire:r".into(),
            engaged_at: Timestamp(5_000),
            tripwire: Some(trip.clone()),
        };
        let notice = tripped_payload(&Tripped::Switch(switch), Timestamp(6_000));
        assert_eq!(notice["type"], "tripwire.tripped");
        let data = &notice["data"];
        assert_eq!(
            (&data["action"], &data["target"], &data["revoke_leases"]),
            (&"switch".into(), &"namespace:prod".into(), &true.into())
        );
        assert_eq!(data["tripwire"]["calls"], 10);
        let entry = SettingsEntry {
            tenant: acme,
            namespace_prefix: Some(Namespace::parse("prod").unwrap()),
            settings: Settings { mode: Some(onceguard_core::control::Mode::Observe), ..Settings::default() },
            updated_by: "tripwire:r".into(),
            updated_at: Timestamp(5_000),
            tripwire: Some(ObserveTrip { reason: "tripwire r: failure rate 0.90".into(), trip }),
        };
        let notice = tripped_payload(&Tripped::Observe(entry), Timestamp(6_000));
        let data = &notice["data"];
        assert_eq!(
            (&data["action"], &data["target"], &data["engaged_by"]),
            (&"observe".into(), &"namespace:prod".into(), &"tripwire:r".into())
        );
        assert_eq!(
            (&data["reason"], &data["settings"]["mode"]),
            (&"tripwire r: failure rate 0.90".into(), &"observe".into())
        );
        assert_eq!((&data["tripwire"]["rule"], &data["tripwire"]["bad"]), (&"r".into(), &9.into()));
        assert!(data.get("revoke_leases").is_none());
    }

    #[test]
    fn a_notice_of_a_recovery_names_the_attempt() {
        use onceguard_core::{Fingerprint, Key, Namespace, Scope, TenantId};
        let scope = Scope::new(
            TenantId::parse("acme").unwrap(),
            Namespace::parse("prod/pay").unwrap(),
            Key::parse("k").unwrap(),
        );
        let now = Timestamp(1_000);
        let hour = Duration::from_secs(3600);
        let call = Approval::new(scope, Fingerprint::sha256(b"x"), now, hour, hour);
        assert!(payload(&call, now)["data"].get("recovery").is_none());
        let recovery = onceguard_core::approval::RecoveryAsk {
            previous_fence: onceguard_core::Fence(7),
            previous_attempt: 1,
            reason: "lease_expired".into(),
            unknown_detail: None,
            last_checkpoint: None,
        };
        let asked = Approval { recovery: Some(recovery), ..call };
        let data = &payload(&asked, now)["data"];
        assert_eq!(
            (&data["recovery"]["previous_fence"], &data["recovery"]["reason"]),
            (&serde_json::json!(7), &serde_json::json!("lease_expired"))
        );
    }

    #[test]
    fn attempts_back_off_from_five_seconds_to_an_hour() {
        assert_eq!([1, 2, 3].map(backoff), [5, 10, 20].map(Duration::from_secs));
        assert_eq!(backoff(12), Duration::from_secs(3600));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(3600));
    }
}
