//! Data-plane streams over QUIC, to a node whose `peer_transport` is `"quic"` (its QUIC listener
//! shares the data plane's port number, over UDP): one QUIC connection per [`QuicConnector`],
//! made on first use and again after it died, and one bidirectional stream on it per pooled
//! data-plane connection — many connections, one handshake. The node requires a client
//! certificate from its `client_ca`, so the [`ClientTls`] must carry one.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use kvtier_proto::dataplane::QUIC_ALPN;
use quinn::crypto::rustls::QuicClientConfig;

use crate::connector::{BoxedStream, ConnectFuture, DataPlaneConnector};
use crate::{ClientError, ClientTls};

/// How often an idle QUIC connection sends a keep-alive (the node closes one silent for 30 s).
const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// Opens data-plane streams on one QUIC connection to a node (see the module doc); give it to
/// [`crate::KvClient::connect_with`].
#[derive(Clone)]
pub struct QuicConnector {
    inner: Arc<Inner>,
}

struct Inner {
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    name: String,
    conn: tokio::sync::Mutex<Option<quinn::Connection>>,
}

impl std::fmt::Debug for QuicConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicConnector").field("addr", &self.inner.addr).field("name", &self.inner.name).finish()
    }
}

impl QuicConnector {
    /// To the node whose data plane is at `data_addr` (`host:port`, resolved now), checking its
    /// certificate and presenting this client's as `tls` says. Call inside a Tokio runtime.
    pub fn new(data_addr: &str, tls: &ClientTls) -> Result<Self, ClientError> {
        let bad = |reason: String| ClientError::Connect { addr: data_addr.to_string(), reason };
        let addr = data_addr
            .to_socket_addrs()
            .map_err(|e| bad(format!("resolving: {e}")))?
            .next()
            .ok_or_else(|| bad("no address".into()))?;
        if tls.identity.is_none() {
            return Err(ClientError::InvalidArgument(
                "QUIC to a node needs a client certificate (ClientTls with cert and key)".into(),
            ));
        }
        let host = data_addr.rsplit_once(':').map_or(data_addr, |(h, _)| h);
        let name = tls.name_for(host).to_string();
        let mut rustls_cfg = (*tls.rustls_config()?).clone();
        rustls_cfg.alpn_protocols = vec![QUIC_ALPN.to_vec()];
        let crypto = QuicClientConfig::try_from(Arc::new(rustls_cfg)).map_err(|e| bad(format!("QUIC TLS: {e}")))?;
        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(Some(KEEP_ALIVE));
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(Arc::new(transport));
        let local: SocketAddr = if addr.is_ipv6() { ([0u16; 8], 0).into() } else { ([0u8; 4], 0).into() };
        let mut endpoint = quinn::Endpoint::client(local).map_err(|e| bad(format!("UDP socket: {e}")))?;
        endpoint.set_default_client_config(client);
        Ok(QuicConnector { inner: Arc::new(Inner { endpoint, addr, name, conn: tokio::sync::Mutex::new(None) }) })
    }
}

impl Inner {
    /// The live QUIC connection, made now if there is none (or the last one closed).
    async fn connection(&self) -> std::io::Result<quinn::Connection> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref().filter(|c| c.close_reason().is_none()) {
            return Ok(c.clone());
        }
        let io = |e: &dyn std::fmt::Display| std::io::Error::new(std::io::ErrorKind::ConnectionRefused, e.to_string());
        let c = self.endpoint.connect(self.addr, &self.name).map_err(|e| io(&e))?.await.map_err(|e| io(&e))?;
        *conn = Some(c.clone());
        Ok(c)
    }
}

impl DataPlaneConnector for QuicConnector {
    fn connect(&self) -> ConnectFuture {
        let inner = self.inner.clone();
        Box::pin(async move {
            let conn = inner.connection().await?;
            let (send, recv) = conn
                .open_bi()
                .await
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::ConnectionReset, e.to_string()))?;
            Ok(Box::new(tokio::io::join(recv, send)) as BoxedStream)
        })
    }
}
