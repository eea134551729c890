//! TLS on a front end's listener (rustls): TLS 1.3 and 1.2 only, the certificate and key read
//! from PEM files and read again when either file changes or the process gets `SIGHUP`, without
//! dropping a connection (a new certificate serves the handshakes that follow).
//!
//! Handshakes run in tasks of their own, each bounded by [`HANDSHAKE_TIMEOUT`], so a client
//! that connects and says nothing delays nobody; a connection that does not speak TLS (plain
//! HTTP) is closed after its handshake fails, never served.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::config::TlsConfig;

/// How long a client has to finish its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at most; further connections wait to be accepted.
const MAX_HANDSHAKES: usize = 1_024;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("tls: {0}")]
pub struct TlsError(String);

/// The certificate and key being served, replaced when their files change.
#[derive(Debug)]
struct Served {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' modification times when they were last read.
    read_at: RwLock<(Option<SystemTime>, Option<SystemTime>)>,
}

impl ResolvesServerCert for Served {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone())
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The certificates of a PEM file (at least one).
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect())
        .map_err(|e| TlsError(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!("{}: no certificate in the file", path.display())));
    }
    Ok(certs)
}

/// Reads a certificate chain and its private key (PEM).
fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = certificates(cert)?;
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError(format!("{}: {e}", key.display())))?;
    let signing = any_supported_type(&private).map_err(|e| TlsError(format!("{}: {e}", key.display())))?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|e| TlsError(format!("{} and {} do not belong together: {e}", cert.display(), key.display())))?;
    Ok(certified)
}

impl Served {
    fn open(config: &TlsConfig) -> Result<Option<Arc<Self>>, TlsError> {
        let (cert, key) = match (&config.cert, &config.key) {
            (None, None) => return Ok(None),
            (Some(cert), Some(key)) => (cert.clone(), key.clone()),
            _ => return Err(TlsError("give both tls.cert and tls.key, or neither".into())),
        };
        let read_at = (modified(&cert), modified(&key));
        let current = load(&cert, &key)?;
        Ok(Some(Arc::new(Self { cert, key, current: RwLock::new(Arc::new(current)), read_at: RwLock::new(read_at) })))
    }

    /// Reads the files again if `force` or if either changed since they were last read; keeps
    /// what is served if they cannot be read.
    fn reload(&self, force: bool) {
        let now = (modified(&self.cert), modified(&self.key));
        if !force && *self.read_at.read().unwrap_or_else(std::sync::PoisonError::into_inner) == now {
            return;
        }
        match load(&self.cert, &self.key) {
            Ok(fresh) => {
                *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(fresh);
                *self.read_at.write().unwrap_or_else(std::sync::PoisonError::into_inner) = now;
                tracing::info!(cert = %self.cert.display(), "tls: certificate read again");
            }
            Err(e) => {
                tracing::error!(error = %e, "tls: the new certificate could not be read; the old one is still served");
            }
        }
    }
}

/// The rustls server configuration over `served`: TLS 1.3 and 1.2, HTTP/2 and HTTP/1.1, and
/// client certificates from `client_ca` required if given.
fn server_config(served: Arc<Served>, client_ca: Option<&Path>) -> Result<rustls::ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| TlsError(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            let certs = certificates(path).map_err(|e| TlsError(format!("tls.client_ca {}", e.0)))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(TlsError(format!("tls.client_ca {}: no certificate in the file", path.display())));
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError(format!("tls.client_ca: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(served);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// A listener whose connections speak TLS: what `axum::serve` serves when `tls` is configured.
pub struct TlsListener {
    local: SocketAddr,
    handshaken: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener").field("local", &self.local).finish_non_exhaustive()
    }
}

impl TlsListener {
    /// `listener` with TLS from `config`, or `None` when `config` names no certificate.
    pub fn wrap(listener: TcpListener, config: &TlsConfig) -> Result<Result<Self, TcpListener>, TlsError> {
        let Some(served) = Served::open(config)? else { return Ok(Err(listener)) };
        let acceptor = TlsAcceptor::from(Arc::new(server_config(served.clone(), config.client_ca.as_deref())?));
        let local = listener.local_addr().map_err(|e| TlsError(e.to_string()))?;
        let (tx, handshaken) = mpsc::channel(64);
        // SIGHUP is taken over before the first connection is served, so from then on it reads
        // the certificate again instead of ending the process.
        #[cfg(unix)]
        let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|e| TlsError(format!("listening for SIGHUP: {e}")))?;
        #[cfg(not(unix))]
        let hangup = ();
        let accepting = tokio::spawn(accept_loop(listener, acceptor, tx));
        let watching = tokio::spawn(watch(served, config.reload_interval, hangup));
        Ok(Ok(Self { local, handshaken, tasks: vec![accepting, watching] }))
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Serves `app` on `listener` (TLS, or the plain one [`TlsListener::wrap`] gave back) until
/// `shutdown`.
pub async fn serve(
    listener: Result<TlsListener, TcpListener>,
    app: axum::Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    match listener {
        Ok(tls) => axum::serve(tls, app).with_graceful_shutdown(shutdown).await,
        Err(plain) => axum::serve(plain, app).with_graceful_shutdown(shutdown).await,
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.handshaken.recv().await {
            Some(connection) => connection,
            // The accepting task ended (it does not, short of a panic): accept nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    handshaken: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // As axum does: errors of one connection (or too many open files) must not end
                // the server; wait a little and go on.
                tracing::warn!(error = %e, "tls: accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (acceptor, handshaken) = (acceptor.clone(), handshaken.clone());
        tokio::spawn(async move {
            let _slot = slot;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let _ = handshaken.send((stream, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "tls: handshake refused"),
                Err(_) => tracing::debug!(%peer, "tls: no handshake within the timeout"),
            }
        });
    }
}

#[cfg(unix)]
type Hangup = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangup = ();

/// Reads the certificate again when its files change (checked every `interval`) or on SIGHUP.
async fn watch(served: Arc<Served>, interval: Duration, mut hangup: Hangup) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let forced = tokio::select! {
            _ = tick.tick() => false,
            _ = hangup.recv() => true,
        };
        #[cfg(not(unix))]
        let forced = {
            let () = hangup;
            tick.tick().await;
            false
        };
        let served = served.clone();
        // File reads block: off the runtime's threads.
        let _ = tokio::task::spawn_blocking(move || served.reload(forced)).await;
    }
}
