//! The PostgreSQL store over TLS, against the machine's server when it offers TLS (Debian's
//! default: `ssl = on` with its self-signed certificate for `localhost`): every connection is
//! encrypted and checked against the CA given, host name included; a wrong CA or a name the
//! certificate does not carry is refused. Skipped, saying why, when the server has no TLS.

mod common;

use std::sync::Arc;

use onceguard_core::{ManualClock, Store, StoreClock};
use onceguard_store_postgres::PgStore;
use onceguard_testkit::conformance::Subject;
use tokio_postgres::NoTls;

/// The server's certificate file, when it offers TLS and the file can be read here.
async fn server_certificate() -> Option<String> {
    let (client, connection) = tokio_postgres::connect(&common::url(), NoTls).await.expect("connects");
    let driver = tokio::spawn(connection);
    let ssl: String = client.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    let file: String = client.query_one("SHOW ssl_cert_file", &[]).await.unwrap().get(0);
    drop(client);
    let _ = driver.await;
    if ssl != "on" || std::fs::read(&file).is_err() {
        println!("SKIPPED: PostgreSQL TLS tests (the server has ssl = {ssl}, certificate {file})");
        return None;
    }
    Some(file)
}

/// The test server's URL with `host` and `query`.
fn url_with(host: &str, query: &str) -> String {
    let base = common::url().replacen("127.0.0.1", host, 1);
    let joiner = if base.contains('?') { '&' } else { '?' };
    format!("{base}{joiner}{query}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_is_encrypted_and_checked() {
    if !common::available("PostgreSQL TLS tests") {
        return;
    }
    let Some(cert) = server_certificate().await else { return };
    let schema = common::schema("og_tls");
    let app = format!("og-tls-{}", &schema[schema.len() - 8..]);
    let url = url_with(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={cert}&schema={schema}&application_name={app}&pool_size=2&writers=1"),
    );
    let (conninfo, mut options) = onceguard_store_postgres::parse_url(&url).expect("a valid URL");
    // The cases move a clock of their own: the store decides by it.
    let clock = Arc::new(ManualClock::default());
    options.clock = StoreClock::Given(clock.clone());
    let store: Arc<dyn Store> =
        Arc::new(PgStore::connect_with(&conninfo, options).await.expect("the store connects over TLS"));
    let subject = || Subject { store: store.clone(), clock: Some(clock.clone()) };
    onceguard_testkit::conformance::completed_key_replays_byte_for_byte(subject()).await;
    onceguard_testkit::conformance::waiting_claim_receives_the_replay(subject()).await;

    // Every connection of the store (the pool's and the LISTEN one) is encrypted.
    let (client, connection) = tokio_postgres::connect(&common::url(), NoTls).await.unwrap();
    let driver = tokio::spawn(connection);
    let row = client
        .query_one(
            "SELECT count(*), coalesce(bool_and(s.ssl), false) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.application_name = $1",
            &[&app],
        )
        .await
        .unwrap();
    let (connections, all_encrypted): (i64, bool) = (row.get(0), row.get(1));
    assert!(connections >= 2, "the pool and the LISTEN connection: {connections}");
    assert!(all_encrypted, "every connection of the store uses TLS");
    drop(client);
    let _ = driver.await;
    drop(store);
    common::drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_or_a_name_the_certificate_lacks_is_refused() {
    if !common::available("PostgreSQL TLS tests") {
        return;
    }
    let Some(cert) = server_certificate().await else { return };
    let schema = common::schema("og_tls");
    // The certificate names localhost, not 127.0.0.1.
    let by_address = url_with("127.0.0.1", &format!("sslmode=require&sslrootcert={cert}&schema={schema}"));
    let refused = PgStore::connect(&by_address).await;
    assert!(refused.is_err(), "the host name is checked");
    // Another authority.
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other-ca.pem");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.distinguished_name.push(rcgen::DnType::CommonName, "another ca");
    let ca = rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
    std::fs::write(&other, ca.pem()).unwrap();
    let wrong = url_with("localhost", &format!("sslmode=verify-full&sslrootcert={}&schema={schema}", other.display()));
    let refused = PgStore::connect(&wrong).await;
    assert!(refused.is_err(), "a certificate of another authority is refused");
    let message = refused.err().unwrap().to_string();
    assert!(message.contains("certificate") || message.contains("tls") || message.contains("TLS"), "{message}");
    common::drop_schema(&schema).await;
}
