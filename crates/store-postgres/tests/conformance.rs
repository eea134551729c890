//! The PostgreSQL store against the conformance suite and the model, each test in its own
//! schema (dropped afterwards), on the server at `ONCEGUARD_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`).

use std::future::Future;
use std::pin::Pin;

use onceguard_store_postgres::{PgOptions, PgStore};
use onceguard_testkit::TestStore;

fn url() -> String {
    std::env::var("ONCEGUARD_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Drops the test's schema when the test ends.
struct DropSchema(String);

impl Drop for DropSchema {
    fn drop(&mut self) {
        let schema = self.0.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                if let Ok((client, connection)) = tokio_postgres::connect(&url(), tokio_postgres::NoTls).await {
                    let driver = tokio::spawn(connection);
                    let statement = format!("SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS {schema} CASCADE");
                    let _ = client.batch_execute(&statement).await;
                    drop(client);
                    let _ = driver.await;
                }
            });
        })
        .join();
    }
}

fn fresh() -> impl Fn() -> Pin<Box<dyn Future<Output = Option<TestStore>> + Send>> {
    || {
        Box::pin(async {
            let url = url();
            if !onceguard_testkit::services::available(
                "PostgreSQL store suites",
                &onceguard_testkit::services::addr_of_url(&url, 5432),
                "start PostgreSQL or set ONCEGUARD_POSTGRES_URL",
            ) {
                return None;
            }
            let schema = format!("og_test_{:016x}", rand::random::<u64>());
            // The store decides by a clock of the test's, which the cases move.
            let clock = std::sync::Arc::new(onceguard_core::ManualClock::default());
            let options = PgOptions {
                schema: schema.clone(),
                pool_size: 4,
                writers: 2,
                clock: onceguard_core::StoreClock::Given(clock.clone()),
                ..PgOptions::default()
            };
            let store = PgStore::connect_with(&url, options).await.expect("the store connects");
            Some(TestStore::with(store, DropSchema(schema)).on_clock(clock))
        })
    }
}

onceguard_testkit::conformance_tests!(fresh());
onceguard_testkit::property_tests!(fresh(), 24);
