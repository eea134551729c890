//! The memory store against the conformance suite and the model.

fn fresh() -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = onceguard_testkit::TestStore> + Send>> {
    || Box::pin(async { onceguard_testkit::TestStore::new(onceguard_core::MemoryStore::new()) })
}

onceguard_testkit::conformance_tests!(fresh());
onceguard_testkit::property_tests!(fresh(), 256);
