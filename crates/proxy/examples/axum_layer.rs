//! An axum service made idempotent with one layer: `POST /refunds` runs once per
//! `Idempotency-Key`; retries get the stored response.
//!
//! `cargo run -p onceguard-proxy --example axum_layer`, then
//! `curl -i -X POST -H 'Authorization: Bearer me' -H 'Idempotency-Key: r-1' localhost:3000/refunds`
//! twice (a guarded request names its caller: keys are scoped by the `Authorization` header).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::routing::post;
use onceguard_core::{Guard, Limits, SystemClock, TenantId};
use onceguard_proxy::{IdempotencyLayer, IdempotencyOptions};
use onceguard_store_sqlite::SqliteStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::open("onceguard-data/refunds.db")?;
    let guard = Guard::new(Arc::new(store), Arc::new(SystemClock), Limits::default());
    let refunds = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/refunds",
            post(move || {
                let n = refunds.fetch_add(1, Ordering::SeqCst) + 1;
                async move { format!("refund #{n} issued\n") }
            }),
        )
        .layer(IdempotencyLayer::new(guard, IdempotencyOptions::new(TenantId::parse("refunds")?)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await?;
    Ok(())
}
