//! QUIC between nodes (`peer_transport = "quic"`): a UDP listener on the data plane's port that
//! speaks the same data-plane protocol, one bidirectional QUIC stream per pooled connection of
//! the caller (so many requests share one QUIC connection and one handshake per peer).
//!
//! Nodes authenticate each other: the listener requires a client certificate signed by
//! `tls.client_ca` (TLS 1.3, ALPN [`ALPN`]) — a node without the cluster's certificate is refused
//! at the handshake — and the names of that certificate give the connection its principal, as on
//! the TLS data plane. Bounds: connections in total and per peer address (`max_connections`,
//! `max_connections_per_peer`), [`MAX_STREAMS`] streams at once per connection, the TLS handshake
//! within [`crate::tls::HANDSHAKE_TIMEOUT`], and an idle QUIC connection closed after
//! [`IDLE_TIMEOUT`]; each stream then has the data plane's own timeouts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::QuicServerConfig;
use rustls::pki_types::CertificateDer;
use tokio::sync::watch;

use crate::error::ServerError;
use crate::listen::Peer;
use crate::state::NodeState;

/// The ALPN protocol of kvtier's data plane over QUIC.
pub use kvtier_proto::dataplane::QUIC_ALPN as ALPN;
/// Streams one QUIC connection may have open at once (a peer's pooled connections).
pub const MAX_STREAMS: u32 = 64;
/// A QUIC connection with no packet for this long is closed (keep-alives keep live ones open).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often an idle connection sends a keep-alive.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// The transport settings both ends use.
pub fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(MAX_STREAMS));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    // `IDLE_TIMEOUT` is far below QUIC's 2^62 ms limit.
    t.max_idle_timeout(quinn::IdleTimeout::try_from(IDLE_TIMEOUT).ok());
    t.keep_alive_interval(Some(KEEP_ALIVE));
    t
}

/// Binds the QUIC listener on UDP `addr` with the node's TLS identity (see
/// [`crate::tls::TlsAcceptors::quic`]).
pub fn bind(addr: SocketAddr, tls: Arc<rustls::ServerConfig>) -> Result<quinn::Endpoint, ServerError> {
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| ServerError::Config(format!("tls (QUIC): {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(transport_config()));
    quinn::Endpoint::server(server, addr)
        .map_err(|e| ServerError::Config(format!("peer_transport = \"quic\": cannot bind UDP {addr}: {e}")))
}

/// Accepts QUIC connections until `stop` turns true; then closes them all.
pub async fn serve(endpoint: quinn::Endpoint, state: Arc<NodeState>, stop: watch::Receiver<bool>) {
    crate::listen::accept_bounded(
        "quic",
        state.config().conn_limits(),
        stop,
        || async {
            let incoming = endpoint
                .accept()
                .await
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotConnected, "the QUIC endpoint closed"))?;
            let peer = Peer::Ip(incoming.remote_address().ip());
            Ok((incoming, peer))
        },
        |incoming, stop| serve_connection(incoming, state.clone(), stop),
        // Refused before its handshake: QUIC's CONNECTION_REFUSED (no reason travels with it).
        |incoming, _why| {
            incoming.refuse();
            std::future::ready(())
        },
    )
    .await;
    endpoint.close(quinn::VarInt::from_u32(0), b"node stopping");
}

/// One QUIC connection: the handshake (bounded), then every stream it opens served as a
/// data-plane connection with the principal its certificate names.
async fn serve_connection(incoming: quinn::Incoming, state: Arc<NodeState>, mut stop: watch::Receiver<bool>) {
    let remote = incoming.remote_address();
    let conn = match tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            crate::metrics::error("quic_handshake");
            tracing::debug!(%remote, "QUIC handshake failed: {e}");
            return;
        }
        Err(_) => {
            crate::metrics::error("quic_handshake_timeout");
            return;
        }
    };
    ::metrics::counter!("kvtier_quic_connections_total").increment(1);
    let names = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|certs| certs.first().map(crate::tls::cert_names))
        .unwrap_or_default();
    let cert = state.tenants().authenticate_cert(&names);
    let peer = remote.to_string();
    let mut streams = tokio::task::JoinSet::new();
    loop {
        let (send, recv) = tokio::select! {
            _ = crate::stopped(&mut stop) => break,
            s = conn.accept_bi() => match s {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%remote, "QUIC connection ended: {e}");
                    break;
                }
            },
        };
        ::metrics::counter!("kvtier_quic_streams_total").increment(1);
        streams.spawn(crate::dataplane::serve_halves(
            recv,
            send,
            state.clone(),
            stop.clone(),
            peer.clone(),
            cert.clone(),
            crate::dataplane::OwnSocket::default(),
        ));
        while streams.try_join_next().is_some() {}
    }
    streams.shutdown().await;
    conn.close(quinn::VarInt::from_u32(0), b"");
}
