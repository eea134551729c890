//! Finished keys told to other instances (NOTIFY, gathered over a short window) and heard from
//! them (LISTEN), for the waiters of the change feed.

use super::*;

/// How long the notifier gathers finished keys before it notifies them: each notification is
/// a transaction of its own, with a commit that waits for its WAL flush, so notifying every
/// batch's keys at once would cost nearly as much as the batches. Waiters in other instances
/// hear of a finished key this much later (those of this instance are woken by the guard at
/// once, and every waiter also polls).
pub(crate) const NOTIFY_WINDOW: Duration = Duration::from_millis(5);

/// Notifies finished keys on `channel`: those finished within [`NOTIFY_WINDOW`] of each other
/// in one statement.
pub(crate) async fn notify_loop(pool: Pool, mut finished: mpsc::UnboundedReceiver<Scope>, channel: String) {
    let mut scopes = Vec::new();
    while finished.recv_many(&mut scopes, 1_000).await > 0 {
        tokio::time::sleep(NOTIFY_WINDOW).await;
        while scopes.len() < 10_000 {
            let Ok(scope) = finished.try_recv() else { break };
            scopes.push(scope);
        }
        let sent = async {
            let client = pool.get().await.map_err(|e| with_causes(&e))?;
            notify(&client, &channel, &scopes).await.map_err(|e| with_causes(&e))
        };
        if let Err(e) = sent.await {
            tracing::debug!(error = %e, "postgres: could not notify finished keys; waiters will poll");
        }
        scopes.clear();
    }
}

pub(crate) async fn notify(
    client: &ClientWrapper,
    channel: &str,
    scopes: &[Scope],
) -> Result<(), tokio_postgres::Error> {
    let payloads: Vec<String> = scopes.iter().filter_map(|s| serde_json::to_string(s).ok()).collect();
    if payloads.is_empty() {
        return Ok(());
    }
    let st = client.prepare_cached("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p").await?;
    client.execute(&st, &[&channel, &payloads]).await.map(drop)
}

/// Keeps a `LISTEN` connection open (reconnecting after a second when it drops) and forwards
/// notified keys to `changes`.
pub(crate) async fn listen_loop(
    config: tokio_postgres::Config,
    tls: crate::tls::Tls,
    channel: String,
    changes: broadcast::Sender<Scope>,
) {
    crate::tls::with_tls!(&tls, |connector| listen_with(config, connector, channel, changes).await)
}

async fn listen_with<T>(config: tokio_postgres::Config, tls: T, channel: String, changes: broadcast::Sender<Scope>)
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as tokio_postgres::tls::TlsConnect<tokio_postgres::Socket>>::Future: Send,
{
    loop {
        if let Ok((client, mut connection)) = config.connect(tls.clone()).await {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let driver = tokio::spawn(async move {
                let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
                while let Some(Ok(message)) = messages.next().await {
                    if let AsyncMessage::Notification(n) = message
                        && tx.send(n.payload().to_owned()).is_err()
                    {
                        break;
                    }
                }
            });
            if client.batch_execute(&format!("LISTEN \"{channel}\"")).await.is_ok() {
                while let Some(payload) = rx.recv().await {
                    if let Ok(scope) = serde_json::from_str::<Scope>(&payload) {
                        let _ = changes.send(scope);
                    }
                }
            }
            driver.abort();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
