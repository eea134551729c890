//! The one harness of the integration tests of every front end (the API server, the proxy, the
//! MCP gateway): it starts the front end's app through [`onceguard_http::run`], the start-up of
//! every `run`, so the control refresh, the sweep and the change feed run under every test, on a fresh store, on `127.0.0.1:0`, with a [`ManualClock`] the
//! test moves. Dropping the harness shuts the server down gracefully.
//!
//! ```text
//! let h = Harness::start(config, limits, store, onceguard_proxy::app).await;
//! let token = h.key("acme", Role::Agent).await;
//! h.http.post(h.url("/v1/claims")).bearer_auth(token)…
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use onceguard_core::auth::{ApiKey, Role, Tenant};
use onceguard_core::store::prelude::*;
use onceguard_core::{Clock, Guard, InvalidInput, Limits, ManualClock, TenantId, Timestamp};
use onceguard_http::{AppState, Config};
use tokio::sync::oneshot;

use crate::TestStore;

/// A front end served for one test.
pub struct Harness {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// A client that follows no redirects and gives up after a minute.
    pub http: reqwest::Client,
    /// The guard's clock: nothing in a test waits for time to pass, it moves this.
    pub clock: Arc<ManualClock>,
    /// The guard the front end serves.
    pub guard: Guard,
    /// The store under the guard, for changes made beside the server (as the CLI makes them).
    pub store: Arc<dyn Store>,
    stop: Option<oneshot::Sender<()>>,
    _store: TestStore,
}

impl Harness {
    /// Serves the app that `app` builds on the state of a guard over `store` (with `limits`),
    /// as the front end's `run` serves it. The harness's `guard` is that guard before the
    /// state measures its store: what a test does through it is not counted in the metrics.
    pub async fn start(
        config: Config,
        limits: Limits,
        store: TestStore,
        app: impl FnOnce(&Config, AppState) -> Result<Router, InvalidInput> + Send + 'static,
    ) -> Self {
        config.validate().expect("the test's configuration is valid");
        let clock = Arc::new(ManualClock::new(Timestamp::now()));
        let guard = Guard::new(store.store.clone(), clock.clone(), limits);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let base = format!("http://{}", listener.local_addr().expect("a bound listener"));
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn({
            let guard = guard.clone();
            async move {
                let shutdown = async move {
                    let _ = stopped.await;
                };
                onceguard_http::run(&config, guard, listener, shutdown, app).await.expect("the server ran");
            }
        });
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(60))
            .build()
            .expect("an HTTP client");
        Self { base, http, clock, guard, store: store.store.clone(), stop: Some(stop), _store: store }
    }

    /// The URL of `path` on the server.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A new API key of `role` in `tenant` (made if absent), written to the store as a fixture
    /// (not audited), and its token.
    pub async fn key(&self, tenant: &str, role: Role) -> String {
        let tenant = TenantId::parse(tenant).expect("a valid tenant id");
        let now = self.clock.now();
        if self.store.get_tenant(&tenant).await.expect("the store answers").is_none() {
            let made = Tenant { id: tenant.clone(), created_at: now };
            self.store.create_tenant(&made, None).await.expect("the tenant is made");
        }
        let new = ApiKey::generate(tenant, role, "test", now);
        self.store.create_api_key(&new.key, None).await.expect("the key is stored");
        new.token
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A caller that stops reading: it sends `request` (a whole HTTP/1.1 request) to the server at
/// `base` (`http://host:port`) from a socket whose receive buffer is 64 KiB (set before
/// connecting, so the kernel does not grow it), reads the first bytes of the answer, and then
/// nothing more. Answers the socket and those bytes.
pub async fn stalled_caller(base: &str, request: &str) -> (tokio::net::TcpStream, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://").parse().expect("an http://host:port base");
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.set_recv_buffer_size(64 * 1024).expect("a receive buffer of 64 KiB");
    let mut stream = socket.connect(addr).await.expect("the server accepts");
    stream.write_all(request.as_bytes()).await.expect("the request is sent");
    let mut head = vec![0; 4096];
    let n = stream.read(&mut head).await.expect("the answer's first bytes");
    head.truncate(n);
    (stream, head)
}

/// [`stalled_caller`] for a POST of the JSON `body` to `path`, accepting JSON or an event
/// stream; checks that the answer is a 200 and answers the socket and the bytes read of it.
pub async fn stalled_post(base: &str, path: &str, body: &str) -> (tokio::net::TcpStream, Vec<u8>) {
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let (stream, head) = stalled_caller(base, &request).await;
    assert!(head.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head));
    (stream, head)
}

/// Reads what is left of an answer until its connection ends; answers the bytes read. Panics if
/// it has not ended within 30 s.
pub async fn drain(stream: &mut tokio::net::TcpStream) -> usize {
    use tokio::io::AsyncReadExt;
    let mut got = 0;
    let read = async {
        let mut buf = vec![0; 1 << 16];
        while let Ok(k @ 1..) = stream.read(&mut buf).await {
            got += k;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read).await.expect("the connection ended");
    got
}

/// Waits (at most 30 s) until the key of `scope` holds a completed record; answers it.
pub async fn completed(guard: &Guard, scope: &onceguard_core::Scope) -> onceguard_core::Record {
    let completed = async {
        loop {
            if let Some(record) = guard.get(scope).await.expect("the store answers")
                && record.state == onceguard_core::RecordState::Completed
            {
                return record;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), completed)
        .await
        .unwrap_or_else(|_| panic!("the key {scope} was not completed within 30 s"))
}
