//! The SQLite store against the conformance suite and the model, each test on its own file.

fn fresh() -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = onceguard_testkit::TestStore> + Send>> {
    || {
        Box::pin(async {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let store =
                onceguard_store_sqlite::SqliteStore::open(dir.path().join("onceguard.db")).expect("the store opens");
            onceguard_testkit::TestStore::with(store, dir)
        })
    }
}

onceguard_testkit::conformance_tests!(fresh());
onceguard_testkit::property_tests!(fresh(), 48);
