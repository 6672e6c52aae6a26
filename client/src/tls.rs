//! TLS to a node whose listeners run it: the CA its certificate must chain to, this client's own
//! certificate for nodes that take client certificates (mTLS, where the certificate names the
//! tenant), and the name checked in the node's certificate. Used for the gRPC channel (tonic's
//! rustls) and every pooled data-plane connection (tokio-rustls), both with ring.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::ClientError;

/// How a client speaks TLS to a node (`ClientConfig::tls`).
#[derive(Clone)]
pub struct ClientTls {
    /// PEM certificates of the CA(s) the node's certificate must chain to.
    pub ca_pem: Vec<u8>,
    /// PEM certificate chain and private key of this client, for nodes that verify clients.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The name the node's certificate must carry (a DNS name or an IP address). Default: the
    /// host of the address the client connects to.
    pub server_name: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("client_certificate", &self.identity.is_some())
            .field("server_name", &self.server_name)
            .finish()
    }
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|e| ClientError::InvalidArgument(format!("TLS {what} {}: {e}", path.display())))
}

impl ClientTls {
    /// From PEM files: the CA, and optionally this client's certificate and key.
    pub fn from_files(ca: &Path, cert_and_key: Option<(&Path, &Path)>) -> Result<Self, ClientError> {
        let identity = match cert_and_key {
            Some((c, k)) => Some((read("certificate", c)?, read("key", k)?)),
            None => None,
        };
        let tls = ClientTls { ca_pem: read("CA", ca)?, identity, server_name: None };
        // What is wrong with a file's contents, with the file named (a key given as the CA).
        tls.rustls_config().map_err(|e| match e {
            ClientError::InvalidArgument(why) => {
                let file = match (why.split(':').next(), cert_and_key) {
                    (Some("TLS CA"), _) => ca.display().to_string(),
                    (Some("TLS certificate"), Some((c, _))) => c.display().to_string(),
                    (Some("TLS key"), Some((_, k))) => k.display().to_string(),
                    (_, Some((c, k))) => format!("{}, {}", c.display(), k.display()),
                    (_, None) => ca.display().to_string(),
                };
                ClientError::InvalidArgument(format!("{why} (in {file})"))
            }
            other => other,
        })?;
        Ok(tls)
    }

    /// The rustls configuration of data-plane connections (also for callers that make their own
    /// streams, a [`crate::DataPlaneConnector`]); errors say what is wrong with the PEM.
    pub fn rustls_config(&self) -> Result<Arc<rustls::ClientConfig>, ClientError> {
        let bad = |what: &str, e: &dyn std::fmt::Display| ClientError::InvalidArgument(format!("TLS {what}: {e}"));
        let mut roots = rustls::RootCertStore::empty();
        let cas =
            CertificateDer::pem_slice_iter(&self.ca_pem).collect::<Result<Vec<_>, _>>().map_err(|e| bad("CA", &e))?;
        if cas.is_empty() {
            return Err(bad("CA", &"no PEM certificate"));
        }
        for c in cas {
            roots.add(c).map_err(|e| bad("CA", &e))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?
            .with_root_certificates(roots);
        let cfg = match &self.identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = CertificateDer::pem_slice_iter(cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| bad("certificate", &e))?;
                if chain.is_empty() {
                    return Err(bad("certificate", &"no PEM certificate"));
                }
                let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad("key", &e))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| bad("certificate/key", &e))?
            }
        };
        Ok(Arc::new(cfg))
    }

    /// `server_name`, else `host` (an IPv6 address without its brackets).
    pub(crate) fn name_for<'a>(&'a self, host: &'a str) -> &'a str {
        self.server_name.as_deref().unwrap_or(host).trim_start_matches('[').trim_end_matches(']')
    }

    /// The name checked in the node's certificate when connecting to `host`.
    pub(crate) fn server_name(&self, host: &str) -> Result<ServerName<'static>, ClientError> {
        let name = self.name_for(host);
        ServerName::try_from(name.to_string())
            .map_err(|e| ClientError::InvalidArgument(format!("TLS server name {name:?}: {e}")))
    }

    /// tonic's configuration of the gRPC channel (same CA, identity and name).
    pub(crate) fn tonic_config(&self, host: &str) -> tonic::transport::ClientTlsConfig {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let name = self.name_for(host);
        let mut c = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem)).domain_name(name);
        if let Some((cert, key)) = &self.identity {
            c = c.identity(Identity::from_pem(cert, key));
        }
        c
    }
}

/// A data-plane TLS dialer: the rustls configuration and the name to check, built once per client.
#[derive(Clone)]
pub(crate) struct TlsDial {
    pub(crate) connector: tokio_rustls::TlsConnector,
    pub(crate) name: ServerName<'static>,
}

impl TlsDial {
    pub(crate) fn new(tls: &ClientTls, host: &str) -> Result<Self, ClientError> {
        Ok(TlsDial { connector: tokio_rustls::TlsConnector::from(tls.rustls_config()?), name: tls.server_name(host)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file with the wrong contents is named in the error (a key given as the CA said only
    /// "TLS CA: no PEM certificate").
    #[test]
    fn a_file_without_what_it_should_hold_is_named() {
        let not_a_cert = std::env::temp_dir().join(format!("kvtier-tls-test-{}.key", std::process::id()));
        std::fs::write(&not_a_cert, "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n").unwrap();
        let e = ClientTls::from_files(&not_a_cert, None).unwrap_err().to_string();
        let _ = std::fs::remove_file(&not_a_cert);
        assert!(
            e.contains("TLS CA: no PEM certificate") && e.contains(&format!("(in {})", not_a_cert.display())),
            "{e}"
        );
    }
}
