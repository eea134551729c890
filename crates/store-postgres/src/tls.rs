//! TLS to PostgreSQL (rustls): with `sslmode=require`, `verify-ca` or `verify-full` in the
//! URL, every connection (the pool's, the migration's, the `LISTEN` one) is encrypted and the
//! server's certificate is checked, host name included, against `sslrootcert=PATH` (PEM) or,
//! without it, Mozilla's root authorities. Any other `sslmode` (or none) connects without TLS, as
//! before. (libpq's `require` does not check the certificate; here every mode that uses TLS does.)

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio_postgres_rustls::MakeRustlsConnect;

/// How the store's connections are made.
#[derive(Clone)]
pub(crate) enum Tls {
    /// Plain TCP (or a Unix socket).
    Off,
    /// TLS, checking the server's certificate.
    On(MakeRustlsConnect),
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Off => "Tls::Off",
            Self::On(_) => "Tls::On",
        })
    }
}

impl Tls {
    /// TLS trusting `ca` (PEM), else Mozilla's roots.
    pub(crate) fn on(ca: Option<&Path>) -> Result<Self, String> {
        let mut roots = rustls::RootCertStore::empty();
        match ca {
            Some(path) => {
                let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                    .and_then(|certs| certs.collect())
                    .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(format!("sslrootcert {}: no certificate in the file", path.display()));
                }
            }
            None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self::On(MakeRustlsConnect::new(config)))
    }
}

/// Runs `$body` with `$tls` bound to the connector of `$of` (`NoTls` or rustls's): the two are
/// different types, and `tokio_postgres` is generic over them.
macro_rules! with_tls {
    ($of:expr, |$tls:ident| $body:expr) => {
        match $of {
            $crate::tls::Tls::Off => {
                let $tls = tokio_postgres::NoTls;
                $body
            }
            $crate::tls::Tls::On(connector) => {
                let $tls = connector.clone();
                $body
            }
        }
    };
}
pub(crate) use with_tls;
