//! TLS on the listener, through the real binary: a handshake with a test CA, a plaintext
//! connection refused, and the certificate replaced under load (by a change of its files, and
//! on SIGHUP) without a failed request.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{admin_key, start_with};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use serde_json::json;

/// A test certificate authority.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        Self { issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap() }
    }

    fn root(&self) -> reqwest::Certificate {
        reqwest::Certificate::from_pem(self.issuer.pem().as_bytes()).unwrap()
    }

    /// Writes a certificate for 127.0.0.1 and localhost, and its key, to `cert` and `key`
    /// (each replaced at once, by a rename).
    fn issue(&self, cert: &Path, key: &Path) {
        let leaf_key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        let leaf = params.signed_by(&leaf_key, &self.issuer).unwrap();
        for (path, text) in [(key, leaf_key.serialize_pem()), (cert, leaf.pem())] {
            let temporary = path.with_extension("new");
            std::fs::write(&temporary, text).unwrap();
            std::fs::rename(&temporary, path).unwrap();
        }
    }
}

/// A client that trusts only `roots` and opens a new connection for every request (so every
/// request is a handshake).
fn client(roots: &[&Ca]) -> reqwest::Client {
    let mut builder = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .https_only(true)
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10));
    for ca in roots {
        builder = builder.add_root_certificate(ca.root());
    }
    builder.build().unwrap()
}

fn https(base: &str) -> String {
    base.replacen("http://", "https://", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_speaks_tls_and_refuses_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("onceguard test ca");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    ca.issue(&cert, &key);
    let args = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    let server = start_with(dir.path(), &args, &[]);
    let base = https(&server.base);

    let trusted = client(&[&ca]);
    assert_eq!(trusted.get(format!("{base}/healthz")).send().await.unwrap().status(), 200);
    let claim = json!({"namespace": "tls/demo", "key": "k-1", "request": {"n": 1}});
    let answer =
        trusted.post(format!("{base}/v1/claims")).bearer_auth(admin_key(dir.path())).json(&claim).send().await.unwrap();
    assert_eq!(answer.status(), 201, "a claim over TLS");

    let plain = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let refused = plain.get(format!("{}/healthz", server.base)).send().await;
    assert!(refused.is_err(), "a plaintext request is never served: {refused:?}");
    let other = client(&[&Ca::new("another ca")]);
    assert!(other.get(format!("{base}/healthz")).send().await.is_err(), "a certificate of another CA is refused");
    // The server still serves after those.
    assert_eq!(trusted.get(format!("{base}/readyz")).send().await.unwrap().status(), 200);
}

/// Sends requests, each on a new connection, until `stop`; counts successes in `ok` and keeps
/// the failures.
fn load(
    base: &str,
    client: reqwest::Client,
    ok: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<String>> {
    let url = format!("{base}/healthz");
    tokio::spawn(async move {
        let mut failures = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            match client.get(&url).send().await {
                Ok(r) if r.status() == 200 => {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                other => failures.push(format!("{other:?}")),
            }
        }
        failures
    })
}

/// Waits until `ok` reaches `n`.
async fn until(ok: &AtomicU64, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while ok.load(Ordering::Relaxed) < n {
        assert!(Instant::now() < deadline, "the load did not get {n} answers");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Replaces the certificate with one of a second CA while two tasks send requests, each a new
/// TLS connection (100 answered before, 100 more after the new certificate is served): none
/// fails, and from then on a client that trusts only the first CA is refused.
async fn replaced_under_load(server: &common::Server, cert: &Path, key: &Path, first: &Ca, nudge: impl Fn()) {
    let base = https(&server.base);
    assert_eq!(client(&[first]).get(format!("{base}/healthz")).send().await.unwrap().status(), 200);
    let second = Ca::new("second ca");
    let (ok, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
    let tasks: Vec<_> = (0..2).map(|_| load(&base, client(&[first, &second]), ok.clone(), stop.clone())).collect();
    until(&ok, 100).await;
    second.issue(cert, key);
    nudge();
    let only_second = client(&[&second]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while only_second.get(format!("{base}/healthz")).send().await.is_err() {
        assert!(Instant::now() < deadline, "the new certificate was never served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let switched = ok.load(Ordering::Relaxed);
    until(&ok, switched + 100).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let failures = task.await.unwrap();
        assert!(failures.is_empty(), "requests failed while the certificate was replaced: {failures:?}");
    }
    println!("{} requests, each a new TLS connection, none failed", ok.load(Ordering::Relaxed));
    assert!(client(&[first]).get(format!("{base}/healthz")).send().await.is_err(), "the old certificate is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_certificate_is_served_without_a_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let first = Ca::new("first ca");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    first.issue(&cert, &key);
    let args = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    let server = start_with(dir.path(), &args, &[("ONCEGUARD_TLS__RELOAD_INTERVAL", "100ms")]);
    replaced_under_load(&server, &cert, &key, &first, || {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reads_the_certificate_again() {
    let dir = tempfile::tempdir().unwrap();
    let first = Ca::new("first ca");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    first.issue(&cert, &key);
    let args = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    // Files checked once an hour: only the signal can make the server read them again.
    let server = start_with(dir.path(), &args, &[("ONCEGUARD_TLS__RELOAD_INTERVAL", "1h")]);
    let pid = server.child.id().to_string();
    replaced_under_load(&server, &cert, &key, &first, || {
        let sent = std::process::Command::new("kill").args(["-HUP", &pid]).status().unwrap();
        assert!(sent.success());
    })
    .await;
    assert!(server.logs.lock().unwrap().iter().any(|l| l.contains("certificate read again")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_clients_with_its_certificate_get_in() {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = Ca::new("server ca");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    server_ca.issue(&cert, &key);
    let clients = Ca::new("client ca");
    let client_ca = dir.path().join("client-ca.pem");
    std::fs::write(&client_ca, clients.issuer.pem()).unwrap();
    let args = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    let server = start_with(dir.path(), &args, &[("ONCEGUARD_TLS__CLIENT_CA", client_ca.to_str().unwrap())]);
    let base = https(&server.base);

    let anonymous = client(&[&server_ca]);
    assert!(anonymous.get(format!("{base}/healthz")).send().await.is_err(), "no client certificate: refused");
    let with = |ca: &Ca| {
        let (cert, key) = (dir.path().join("client.pem"), dir.path().join("client.key"));
        ca.issue(&cert, &key);
        let pem = [std::fs::read(&cert).unwrap(), std::fs::read(&key).unwrap()].concat();
        reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(server_ca.root())
            .identity(reqwest::Identity::from_pem(&pem).unwrap())
            .build()
            .unwrap()
    };
    let stranger = with(&Ca::new("another client ca"));
    assert!(stranger.get(format!("{base}/healthz")).send().await.is_err(), "a certificate of another CA: refused");
    let known = with(&clients);
    assert_eq!(known.get(format!("{base}/healthz")).send().await.unwrap().status(), 200);
}

#[test]
fn a_certificate_without_its_key_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let first = Ca::new("ca");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    first.issue(&cert, &key);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onceguard"))
        .args(["serve", "--listen", "127.0.0.1:0", "--tls-cert", cert.to_str().unwrap()])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tls"), "{}", String::from_utf8_lossy(&out.stderr));
    // A key that is not the certificate's.
    let other = KeyPair::generate().unwrap();
    std::fs::write(&key, other.serialize_pem()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onceguard"))
        .args(["serve", "--listen", "127.0.0.1:0", "--tls-cert", cert.to_str().unwrap()])
        .args(["--tls-key", key.to_str().unwrap()])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("do not belong together"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The status of `GET path` over HTTP/2 to `addr` (TLS with ALPN `h2` only, trusting `ca`): a
/// client of the `h2` crate itself, so that nothing in this test's build gives the server an
/// HTTP/2 it would not have on its own.
async fn over_http2(ca: &Ca, addr: &str, path: &str) -> u16 {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.issuer.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "the server takes the h2 it offers");
    let (client, connection) = h2::client::handshake(tls).await.expect("an HTTP/2 connection");
    let driver = tokio::spawn(connection);
    let mut client = client.ready().await.expect("ready for a request");
    let request = http::Request::get(format!("https://127.0.0.1{path}")).body(()).unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let status = response.await.expect("an HTTP/2 answer").status().as_u16();
    driver.abort();
    status
}

/// The HTTP version and status of `GET url` by a client that speaks HTTP/1.1 only.
async fn over_http1(ca: &Ca, url: &str) -> (reqwest::Version, u16) {
    let client = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(ca.root())
        .http1_only()
        .build()
        .unwrap();
    let response = client.get(url).send().await.unwrap_or_else(|e| panic!("{url}: {e:?}"));
    (response.version(), response.status().as_u16())
}

/// Every listener offers HTTP/2 and HTTP/1.1 by ALPN and serves both: `serve`, `proxy` and
/// `mcp`, to a Rust client that takes the HTTP/2 offer, to one that speaks HTTP/1.1 only, and
/// to curl as it is called by default (where curl is installed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_listener_serves_the_http2_it_offers() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("onceguard test ca");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    ca.issue(&cert, &key);
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.issuer.pem()).unwrap();
    let tls = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    let store = format!("sqlite://{}", dir.path().join("og.db").display());
    // An upstream for the proxy and the gateway that answers 200 to anything.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, axum::Router::new().fallback(|| async { "up" })).await.unwrap() });
    let front_ends: [(&str, Vec<&str>, &str); 3] = [
        ("serve", vec!["serve", "--listen", "127.0.0.1:0"], "/healthz"),
        ("proxy", vec!["proxy", "--listen", "127.0.0.1:0", "--upstream", &upstream], "/status"),
        ("mcp", vec!["mcp", "--listen", "127.0.0.1:0", "--upstream", &upstream], "/_onceguard/healthz"),
    ];
    for (name, command, path) in front_ends {
        let mut args = vec!["--store", store.as_str()];
        args.extend_from_slice(&tls);
        args.extend(command);
        let server = common::spawn(dir.path(), &args, &[]);
        let url = format!("{}{path}", https(&server.base));
        let addr = server.base.trim_start_matches("http://");
        assert_eq!(over_http2(&ca, addr, path).await, 200, "{name} over HTTP/2");
        assert_eq!(over_http1(&ca, &url).await, (reqwest::Version::HTTP_11, 200), "{name} over HTTP/1.1");
        let curl = std::process::Command::new("curl")
            .args([
                "-sS",
                "--cacert",
                ca_file.to_str().unwrap(),
                "-o",
                "/dev/null",
                "-w",
                "%{http_version} %{http_code}",
            ])
            .arg(&url)
            .output();
        match curl {
            Ok(out) => assert_eq!(String::from_utf8_lossy(&out.stdout), "2 200", "{name}, curl: {out:?}"),
            Err(e) => onceguard_testkit::services::skipped(&format!("curl's default over TLS ({e})")),
        }
    }
}
