//! An in-process N-node harness (after quinn's test `Pair`): [`Cluster::start`] runs N kvtier
//! nodes in this process, each a real node (`kvtier_server::start`: its own temporary data
//! directory, `NodeState`, demotion, sessions), whose data planes clients reach over in-memory
//! duplex streams (or a Unix socket each, [`Transport::Unix`]) through [`crate::faults`] wrappers.
//! The gRPC control plane still runs on a loopback port per node.
//!
//! Faults are set per link at two levels, applied one inside the other: [`Node::faults`] covers
//! every data-plane stream to that node (a node's network), [`Link::faults`] the streams of one
//! client built by [`Cluster::link`]. A client's connections go through
//! `KvClient::connect_with`, the same pool, timeouts and checks as over TCP.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier_client::{BoxedStream, ClientConfig, KvClient};
use kvtier_server::config::ByteSize;
use kvtier_server::{dataplane, NodeState, RunningServer, ServerConfig};
use tokio::sync::watch;

use crate::faults::Faults;

/// Bytes in flight each way on one in-memory stream before a writer waits (bounded like a socket
/// buffer).
const DUPLEX_BUF: usize = 1 << 20;

/// How clients reach the nodes' data planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// `tokio::io::duplex`, served by `dataplane::serve_stream`.
    Duplex,
    /// A Unix socket in the node's data directory, served by `dataplane::serve_unix`.
    Unix,
}

/// One node of a [`Cluster`].
pub struct Node {
    pub server: RunningServer,
    /// Faults of every data-plane stream to this node.
    pub faults: Faults,
    unix_path: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

impl Node {
    pub fn state(&self) -> &Arc<NodeState> {
        &self.server.state
    }

    pub fn grpc_addr(&self) -> String {
        self.server.grpc_addr.to_string()
    }
}

/// A client of one node over its own faulty link.
pub struct Link {
    pub client: KvClient,
    /// Faults of this client's data-plane streams only.
    pub faults: Faults,
}

/// N in-process nodes. [`Cluster::stop`] stops them all (dropping does too, less gracefully).
pub struct Cluster {
    nodes: Vec<Node>,
    transport: Transport,
    /// Ends the in-memory connections and Unix listeners the harness serves.
    stop: watch::Sender<bool>,
}

/// The configuration of a harness node: loopback, no metrics, 64 MiB of DRAM, no disk tier.
pub fn node_config(dir: &std::path::Path) -> ServerConfig {
    ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        data_listen: ([127, 0, 0, 1], 0).into(),
        metrics_listen: None,
        data_dir: dir.to_path_buf(),
        dram_capacity: ByteSize(64 << 20),
        ..ServerConfig::default()
    }
}

/// Client settings for harness clients: one data connection (so a test knows which stream a
/// fault lands on) and short timeouts (a stalled link fails in seconds, not 30).
pub fn client_config() -> ClientConfig {
    ClientConfig {
        data_connections: 1,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    }
}

impl Cluster {
    /// `n` nodes over in-memory streams with [`node_config`].
    pub async fn start(n: usize) -> Cluster {
        Self::start_with(n, Transport::Duplex, |_, _| {}).await
    }

    /// `n` nodes over `transport`; `tweak(i, config)` adjusts node `i`'s configuration.
    pub async fn start_with(n: usize, transport: Transport, tweak: impl Fn(usize, &mut ServerConfig)) -> Cluster {
        let (stop, stop_rx) = watch::channel(false);
        let mut nodes = Vec::with_capacity(n);
        for i in 0..n {
            let dir = tempfile::tempdir().expect("tempdir");
            let mut cfg = node_config(dir.path());
            tweak(i, &mut cfg);
            let server = kvtier_server::start(cfg, None).await.expect("start node");
            let unix_path = match transport {
                Transport::Duplex => None,
                Transport::Unix => {
                    let path = dir.path().join("data.sock");
                    let l = tokio::net::UnixListener::bind(&path).expect("bind unix socket");
                    tokio::spawn(dataplane::serve_unix(l, server.state.clone(), stop_rx.clone()));
                    Some(path)
                }
            };
            nodes.push(Node { server, faults: Faults::new(), unix_path, _dir: dir });
        }
        Cluster { nodes, transport, stop }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    /// A connector for node `i`'s data plane whose streams pass `link`'s faults, then the node's.
    pub fn connector(
        &self,
        i: usize,
        link: Faults,
    ) -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<BoxedStream>> + Send>>
           + Send
           + Sync
           + 'static {
        let node = &self.nodes[i];
        let (state, node_faults, stop) = (node.server.state.clone(), node.faults.clone(), self.stop.subscribe());
        let unix_path = node.unix_path.clone();
        let transport = self.transport;
        move || {
            let (state, node_faults, link, stop, unix_path) =
                (state.clone(), node_faults.clone(), link.clone(), stop.clone(), unix_path.clone());
            Box::pin(async move {
                let stream: BoxedStream = match (transport, unix_path) {
                    (Transport::Unix, Some(path)) => {
                        let s = tokio::net::UnixStream::connect(path).await?;
                        Box::new(link.wrap(node_faults.wrap(s)))
                    }
                    _ => {
                        let (near, far) = tokio::io::duplex(DUPLEX_BUF);
                        tokio::spawn(dataplane::serve_stream(far, state, stop));
                        Box::new(link.wrap(node_faults.wrap(near)))
                    }
                };
                Ok(stream)
            })
        }
    }

    /// A client of node `i` over a link of its own, with [`client_config`].
    pub async fn link(&self, i: usize) -> Link {
        self.link_with(i, client_config()).await
    }

    /// A client of node `i` over a link of its own.
    pub async fn link_with(&self, i: usize, cfg: ClientConfig) -> Link {
        let faults = Faults::new();
        let client = KvClient::connect_with(&self.nodes[i].grpc_addr(), cfg, self.connector(i, faults.clone()))
            .await
            .expect("connect to a harness node");
        Link { client, faults }
    }

    /// Stops every node (every harness connection first).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for node in self.nodes {
            let _ = node.server.stop(Duration::from_secs(5)).await;
        }
    }
}
