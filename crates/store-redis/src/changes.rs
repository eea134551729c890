//! The change feed: keys finished or purged through other store instances, heard on the
//! prefix's pub/sub channel (see the crate documentation).

use std::time::Duration;

use futures::StreamExt;
use onceguard_core::Scope;
use redis::RedisError;
use tokio::sync::{broadcast, oneshot};

/// The message announcing that `scope` finished or was purged through the instance `origin`.
pub(crate) fn message(origin: &str, scope: &Scope) -> String {
    serde_json::json!({ "origin": origin, "scope": scope }).to_string()
}

/// Keeps a subscription to the change channel, forwarding other instances' keys to `changes`,
/// and resubscribing (round the servers) when the connection drops. Reports on `ready` whether
/// the first subscription worked.
pub(crate) async fn listen(
    urls: Vec<String>,
    tls_ca: Option<Vec<u8>>,
    channel: String,
    origin: String,
    changes: broadcast::Sender<Scope>,
    timeout: Duration,
    ready: oneshot::Sender<Result<(), String>>,
) {
    let mut ready = Some(ready);
    let mut next = 0;
    loop {
        let mut first_error = None;
        let mut subscribed = None;
        for _ in 0..urls.len() {
            let url = &urls[next % urls.len()];
            match subscribe(url, tls_ca.as_deref(), &channel, timeout).await {
                Ok(pubsub) => {
                    subscribed = Some(pubsub);
                    break;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    next += 1;
                }
            }
        }
        match subscribed {
            Some(mut pubsub) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Ok(()));
                }
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    if let Some(scope) = parse_message(message.get_payload_bytes(), &origin) {
                        // No receiver is fine: nobody waits.
                        let _ = changes.send(scope);
                    }
                }
                tracing::warn!(channel, "redis: the change subscription dropped; resubscribing");
            }
            None => {
                let error = first_error.unwrap_or_else(|| "no server to subscribe to".into());
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(error));
                    return;
                }
                tracing::warn!(channel, error, "redis: could not resubscribe to changes; trying again");
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn subscribe(
    url: &str,
    tls_ca: Option<&[u8]>,
    channel: &str,
    timeout: Duration,
) -> Result<redis::aio::PubSub, String> {
    let attempt = async {
        let client = crate::client_of(url, tls_ca)?;
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok::<_, RedisError>(pubsub)
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(pubsub)) => Ok(pubsub),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

fn parse_message(payload: &[u8], origin: &str) -> Option<Scope> {
    #[derive(serde::Deserialize)]
    struct Message {
        origin: String,
        scope: Scope,
    }
    match serde_json::from_slice::<Message>(payload) {
        Ok(m) if m.origin != origin => Some(m.scope),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(error = %e, "redis: ignoring a malformed change message");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use onceguard_core::{Key, Namespace, TenantId};

    use super::*;

    #[test]
    fn only_other_instances_changes_are_forwarded() {
        let scope = Scope::new(TenantId::parse("t").unwrap(), Namespace::parse("n").unwrap(), Key::parse("k").unwrap());
        let message = message("a", &scope);
        assert_eq!(parse_message(message.as_bytes(), "b"), Some(scope));
        assert_eq!(parse_message(message.as_bytes(), "a"), None);
        assert_eq!(parse_message(b"nonsense", "a"), None);
    }
}
