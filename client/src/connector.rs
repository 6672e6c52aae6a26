//! Where the data plane's byte streams come from. By default a [`crate::KvClient`] opens TCP
//! connections to the data address the server announces; [`crate::KvClient::connect_with`] takes a
//! [`DataPlaneConnector`] instead (a Unix socket, an in-memory duplex to an in-process node, a
//! fault-injecting wrapper in tests; QUIC streams later). A connector is called once per pooled
//! connection, never per request: the stream it returns is boxed once, at construction.

use std::future::Future;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

/// A byte stream the data plane can run over: any `AsyncRead + AsyncWrite + Unpin + Send`.
pub trait DataStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> DataStream for T {}

/// A data-plane stream, boxed once when its connection is made.
pub type BoxedStream = Box<dyn DataStream>;

/// What [`DataPlaneConnector::connect`] returns.
pub type ConnectFuture = Pin<Box<dyn Future<Output = std::io::Result<BoxedStream>> + Send + 'static>>;

/// Opens data-plane streams to one node. The client says hello (protocol version, token) on each
/// stream it gets; the connector only supplies the bytes' path. Closures
/// `Fn() -> impl Future<Output = io::Result<BoxedStream>>` are connectors.
///
/// ```no_run
/// # async fn demo() -> Result<(), kvtier_client::ClientError> {
/// use kvtier_client::{BoxedStream, ClientConfig, KvClient};
/// let connector = || async {
///     let s = tokio::net::TcpStream::connect("127.0.0.1:7071").await?;
///     Ok(Box::new(s) as BoxedStream)
/// };
/// let client = KvClient::connect_with("127.0.0.1:7070", ClientConfig::default(), connector).await?;
/// # Ok(()) }
/// ```
pub trait DataPlaneConnector: Send + Sync + 'static {
    /// Opens one new stream (bounded by `ClientConfig::connect_timeout`, hello included).
    fn connect(&self) -> ConnectFuture;
}

impl<F, Fut> DataPlaneConnector for F
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::io::Result<BoxedStream>> + Send + 'static,
{
    fn connect(&self) -> ConnectFuture {
        Box::pin(self())
    }
}

/// Data-plane streams over a Unix socket (a node's `dataplane::serve_unix` listener).
#[cfg(unix)]
#[derive(Debug, Clone)]
pub struct UnixConnector {
    path: std::path::PathBuf,
}

#[cfg(unix)]
impl UnixConnector {
    pub fn new(path: impl Into<std::path::PathBuf>) -> Self {
        UnixConnector { path: path.into() }
    }
}

#[cfg(unix)]
impl DataPlaneConnector for UnixConnector {
    fn connect(&self) -> ConnectFuture {
        let path = self.path.clone();
        Box::pin(async move { Ok(Box::new(tokio::net::UnixStream::connect(path).await?) as BoxedStream) })
    }
}
