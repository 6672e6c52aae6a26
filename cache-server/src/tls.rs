//! TLS on the gRPC and data-plane listeners (rustls with ring): the node's certificate and key,
//! client certificates verified against a CA (mTLS), and the names a verified client certificate
//! carries, which [`crate::tenants::Tenants::authenticate_cert`] turns into a principal. Every
//! handshake runs in its connection's own task, bounded in time, holding its connection slot.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::config::TlsConfig;
use crate::error::ServerError;

/// A client that has not finished its TLS handshake this long after connecting is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The acceptors of the node's two TCP listeners: gRPC announces HTTP/2 by ALPN, the data plane
/// nothing; and the same identity for the QUIC listener between nodes (TLS 1.3 only, client
/// certificates always required, ALPN [`crate::quic::ALPN`]) when `client_ca` is set.
#[derive(Clone)]
pub struct TlsAcceptors {
    pub grpc: TlsAcceptor,
    pub data: TlsAcceptor,
    pub quic: Option<Arc<rustls::ServerConfig>>,
}

impl std::fmt::Debug for TlsAcceptors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsAcceptors")
    }
}

fn bad(what: &str, path: &Path, e: impl std::fmt::Display) -> ServerError {
    ServerError::Config(format!("tls.{what} {}: {e}", path.display()))
}

/// The certificates of a PEM file (at least one).
pub fn read_certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ServerError> {
    let text = std::fs::read(path).map_err(|e| bad(what, path, e))?;
    let certs = CertificateDer::pem_slice_iter(&text).collect::<Result<Vec<_>, _>>().map_err(|e| bad(what, path, e))?;
    if certs.is_empty() {
        return Err(bad(what, path, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn read_key(what: &str, path: &Path) -> Result<PrivateKeyDer<'static>, ServerError> {
    let text = std::fs::read(path).map_err(|e| bad(what, path, e))?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| bad(what, path, format!("no usable PEM private key: {e}")))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsAcceptors {
    /// Reads the node's certificate, key and client CA; errors name the setting and the file.
    pub fn load(cfg: &TlsConfig) -> Result<TlsAcceptors, ServerError> {
        let certs = read_certs("cert", &cfg.cert)?;
        let key = read_key("key", &cfg.key)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| ServerError::Config(format!("tls: {e}")))?;
        let builder = match &cfg.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in read_certs("client_ca", path)? {
                    roots.add(c).map_err(|e| bad("client_ca", path, e))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
                let verifier = if cfg.client_certs_required() { verifier } else { verifier.allow_unauthenticated() };
                builder.with_client_cert_verifier(verifier.build().map_err(|e| bad("client_ca", path, e))?)
            }
        };
        let quic = match &cfg.client_ca {
            Some(path) => Some(Arc::new(quic_config(path, certs.clone(), key.clone_key())?)),
            None => None,
        };
        let data =
            builder.with_single_cert(certs, key).map_err(|e| ServerError::Config(format!("tls.cert/tls.key: {e}")))?;
        let mut grpc = data.clone();
        grpc.alpn_protocols = vec![b"h2".to_vec()];
        Ok(TlsAcceptors { grpc: TlsAcceptor::from(Arc::new(grpc)), data: TlsAcceptor::from(Arc::new(data)), quic })
    }
}

/// The QUIC listener's TLS: TLS 1.3 (QUIC has no other), a client certificate from `client_ca`
/// always required (only nodes and clients of the cluster's CA speak QUIC to a node).
fn quic_config(
    client_ca: &Path,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<rustls::ServerConfig, ServerError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs("client_ca", client_ca)? {
        roots.add(c).map_err(|e| bad("client_ca", client_ca, e))?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| bad("client_ca", client_ca, e))?;
    let mut c = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| ServerError::Config(format!("tls (QUIC): {e}")))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|e| ServerError::Config(format!("tls.cert/tls.key: {e}")))?;
    c.alpn_protocols = vec![crate::quic::ALPN.to_vec()];
    Ok(c)
}

/// Runs the server side of a handshake within [`HANDSHAKE_TIMEOUT`]; returns the stream and the
/// names of the client's verified certificate (empty without one). A failure is counted and says
/// why (a plain-TCP client, an unknown CA, no certificate where one is required).
pub async fn accept<IO>(acceptor: &TlsAcceptor, io: IO) -> std::io::Result<(TlsStream<IO>, Vec<String>)>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            crate::metrics::error("tls_handshake");
            return Err(e);
        }
        Err(_) => {
            crate::metrics::error("tls_handshake_timeout");
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no TLS handshake within 10 s"));
        }
    };
    let names = stream.get_ref().1.peer_certificates().and_then(|c| c.first()).map(cert_names).unwrap_or_default();
    Ok((stream, names))
}

/// The DNS and URI subject-alternative names of a (verified) certificate.
pub fn cert_names(cert: &CertificateDer<'_>) -> Vec<String> {
    match webpki::EndEntityCert::try_from(cert) {
        Ok(c) => c.valid_dns_names().chain(c.valid_uri_names()).map(str::to_string).collect(),
        Err(_) => Vec::new(),
    }
}
