//! The Redis store over TLS (`rediss://`), against a `redis-server` of its own that speaks TLS
//! only, with a certificate of a test CA: the store connects with that CA and keeps the
//! contract (conformance cases, the change feed included); a client without the CA, or in
//! plaintext, does not get in.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use onceguard_core::{ManualClock, StoreClock};
use onceguard_store_redis::{RedisOptions, RedisStore, RedisTarget};

use onceguard_testkit::TestStore;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// The TLS server of this test binary and its CA's certificate (PEM).
struct TlsServer {
    server: common::Server,
    ca: Vec<u8>,
    _dir: PathBuf,
}

fn tls_server() -> Option<&'static TlsServer> {
    static SERVER: OnceLock<Option<TlsServer>> = OnceLock::new();
    if !common::binaries_available() {
        return None;
    }
    SERVER
        .get_or_init(|| {
            let dir = common::scratch_dir("og-redis-tls-");
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            // OpenSSL (redis-server, redis-cli) wants names on the certificates.
            params.distinguished_name.push(rcgen::DnType::CommonName, "onceguard test ca");
            let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
            let key = KeyPair::generate().unwrap();
            let mut leaf = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
            leaf.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
            let leaf = leaf.signed_by(&key, &ca).unwrap();
            let (ca_file, cert_file, key_file) = (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"));
            std::fs::write(&ca_file, ca.pem()).unwrap();
            std::fs::write(&cert_file, leaf.pem()).unwrap();
            std::fs::write(&key_file, key.serialize_pem()).unwrap();
            let server = common::Server::start_tls(&dir, &cert_file, &key_file, &ca_file)
                .expect("redis-server starts with TLS (it is built with TLS on Debian)");
            Some(TlsServer { server, ca: ca.pem().into_bytes(), _dir: dir })
        })
        .as_ref()
}

fn url(server: &TlsServer) -> String {
    format!("rediss://127.0.0.1:{}", server.server.port)
}

async fn tls_store() -> Option<TestStore> {
    let server = tokio::task::spawn_blocking(tls_server).await.unwrap()?;
    let clock = Arc::new(ManualClock::new(common::T0));
    let options = RedisOptions {
        prefix: common::prefix(),
        tls_ca: Some(server.ca.clone()),
        clock: StoreClock::Given(clock.clone()),
        ..RedisOptions::default()
    };
    let store = RedisStore::connect_with(&RedisTarget::Single(url(server)), options).await.expect("connects over TLS");
    Some(TestStore::new(store).on_clock(clock))
}

fn over_tls() -> common::Factory {
    || Box::pin(tls_store())
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(store) = (over_tls())().await else { return };
                onceguard_testkit::conformance::$name(store.subject()).await;
            }
        )*
    };
}

cases!(
    completed_key_replays_byte_for_byte,
    concurrent_claims_acquire_exactly_once,
    waiting_claim_receives_the_replay,
    a_batch_answers_as_its_claims_one_by_one,
    stale_fences_change_nothing,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_ca_or_without_tls_the_store_does_not_connect() {
    let Some(server) = tokio::task::spawn_blocking(tls_server).await.unwrap() else { return };
    let fast = |tls_ca| RedisOptions {
        prefix: common::prefix(),
        timeout: std::time::Duration::from_secs(3),
        tls_ca,
        ..RedisOptions::default()
    };
    let system_roots = RedisStore::connect_with(&RedisTarget::Single(url(server)), fast(None)).await;
    assert!(system_roots.is_err(), "a certificate of an unknown CA is refused");
    let plain = format!("redis://127.0.0.1:{}", server.server.port);
    assert!(RedisStore::connect_with(&RedisTarget::Single(plain), fast(None)).await.is_err(), "no plaintext");
    let by_name = format!("rediss://localhost:{}", server.server.port);
    let ok = RedisStore::connect_with(&RedisTarget::Single(by_name), fast(Some(server.ca.clone()))).await;
    assert!(ok.is_ok(), "the certificate names localhost too: {:?}", ok.err());
}
