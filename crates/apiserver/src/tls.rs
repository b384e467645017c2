//! Serving over TLS (`--tls-cert-file`, `--tls-private-key-file`): PEM files, rustls with the
//! `ring` provider, HTTP/2 and HTTP/1.1 negotiated by ALPN as kube-apiserver does.
//!
//! Each connection's handshake runs in its own task, so a slow or broken client never holds up
//! the accept loop.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;

/// Why the TLS settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The certificate file could not be read or holds no PEM certificate.
    #[error("cannot load the TLS certificate {path}")]
    Certificate {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// The key file could not be read or holds no PEM private key.
    #[error("cannot load the TLS private key {path}")]
    Key {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// The certificate and key do not make a usable server configuration (e.g. they do not
    /// match).
    #[error("the TLS certificate {cert} and key {key} cannot be used together")]
    Config {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// The cause.
        #[source]
        source: rustls::Error,
    },
}

/// The TLS server configuration for a PEM certificate chain and private key.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, Error> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| Error::Certificate {
            path: cert.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(Error::Certificate {
            path: cert.to_path_buf(),
            source: rustls_pki_types::pem::Error::NoItemsFound,
        });
    }
    let private_key = PrivateKeyDer::from_pem_file(key).map_err(|source| Error::Key {
        path: key.to_path_buf(),
        source,
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config_error = |source| Error::Config {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        source,
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(config_error)?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(config_error)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Longest a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` over TLS on `listener` until `shutdown` completes, then waits for open
/// connections (watches end when their clients see the connection close).
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(config);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(err) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        let span = tracing::debug_span!("connection", %peer);
        let connection_task = async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(err)) => {
                    tracing::debug!(%peer, error = %err, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let builder = auto::Builder::new(TokioExecutor::new());
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
            if let Err(err) = watcher.watch(connection.into_owned()).await {
                tracing::debug!(%peer, error = %err, "connection ended with an error");
            }
        };
        tokio::spawn(tracing::Instrument::instrument(connection_task, span));
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(5)) => {
            tracing::warn!("connections still open after 5 s; stopping anyway");
        }
    }
    Ok(())
}
