//! What the PostgreSQL store's integration tests share: the server's URL, whether it runs, and
//! schemas of their own, dropped afterwards.

/// The server at `ONCEGUARD_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
pub fn url() -> String {
    std::env::var("ONCEGUARD_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Whether the server runs (see `onceguard_testkit::services::available`).
pub fn available(suite: &str) -> bool {
    onceguard_testkit::services::available(
        suite,
        &onceguard_testkit::services::addr_of_url(&url(), 5432),
        "start PostgreSQL or set ONCEGUARD_POSTGRES_URL",
    )
}

/// A fresh schema name starting with `prefix`.
pub fn schema(prefix: &str) -> String {
    format!("{prefix}_{:08x}", rand::random::<u32>())
}

/// Drops a schema a test made.
pub async fn drop_schema(schema: &str) {
    if let Ok((client, connection)) = tokio_postgres::connect(&url(), tokio_postgres::NoTls).await {
        let driver = tokio::spawn(connection);
        let _ = client.batch_execute(&format!("SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS {schema} CASCADE")).await;
        drop(client);
        let _ = driver.await;
    }
}
