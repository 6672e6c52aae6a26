//! [`KvClient`]: the async client engines link. It hashes tokens into block keys, asks the
//! control plane (gRPC) for lookups and sessions, and moves payloads over a pool of data-plane
//! connections, splitting large calls into batches that run concurrently.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::try_join_all;
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::pb::kv_tier_client::KvTierClient;
use kvtier_proto::{
    codes, pb, BlockFrame, BlockKey, CodecId, FrameHeader, KeyChain, Namespace, NamespaceId, FRAME_FLAG_KEEP_LOSSLESS,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use kvtier_kernels::{BlockSpec, KvBlockView};
use rayon::prelude::*;

use crate::conn::{DataPool, Dial, GatherFrame, Landed};
use crate::connector::DataPlaneConnector;
use crate::ClientError;

/// Where one loaded block goes: one or more segments of the caller's memory, filled in order
/// (one segment for a contiguous buffer; an engine page's per-layer planes for scatter loads).
pub type BlockDest<'a> = Vec<&'a mut [u8]>;

/// A session's full-block keys, its tail key, and the frames to send.
type SessionFrames = (Vec<BlockKey>, Option<BlockKey>, Vec<BlockFrame>);

/// A call moving at least this many bytes is striped over the pool's connections.
const STRIPE_MIN_BYTES: u64 = 4 << 20;

/// Client settings. Field docs end with the default.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Time to establish a connection. Default: 5 s.
    pub connect_timeout: Duration,
    /// Time budget of one call (lookup, store, load, park...). Default: 30 s.
    pub request_timeout: Duration,
    /// Data-plane connections kept open; also how many batches of one call run at once. Default: 4.
    pub data_connections: usize,
    /// Most blocks per data-plane request (also capped by the server's limit). Default: 256.
    pub max_batch_blocks: usize,
    /// Most payload bytes per data-plane request. Default: 32 MiB.
    pub max_batch_bytes: u64,
    /// Bearer token for servers that require one. Default: none.
    pub auth_token: Option<String>,
    /// How often a park re-sends blocks evicted between store and park. Default: 3.
    pub park_retries: u32,
    /// A pooled data-plane connection idle this long is closed instead of reused; keep it below
    /// the server's `idle_timeout` (5 minutes by default). Default: 60 s.
    pub pool_idle: Duration,
    /// Whether calls into and from a [`crate::SharedBuffer`] use the server's same-node socket
    /// on their own when the server runs on this host (see [`crate::near`]). Default: `Auto`.
    pub samenode: crate::SameNodeMode,
    /// The longest a same-node call polls its socket for the answer (on its own thread, without
    /// parking) before it waits parked; each call polls for about the time its copies take, at
    /// most this; calls moving over 4 MiB don't, nor calls while this process has other same-node
    /// calls in flight, nor calls the process finds parked calls answered sooner for (it times
    /// its calls both ways, see `client/src/wait.rs`). `Duration::ZERO`: never poll, leaving every
    /// core to the server. Default: 2.5 ms.
    pub samenode_poll: Duration,
    /// The same for a load over a plain TCP data-plane connection: after its request, its reads
    /// `recv` the answer (header, then the blocks as they stream in) without parking: its first
    /// bytes for about the time 4 MiB at most take at 2 GB/s plus 50 µs, at most this, then on
    /// while bytes keep coming (a gap of 100 µs, or this if shorter, parks it); only while it is
    /// this process's only call in flight (same-node or TCP), and not while parked calls are
    /// answered sooner (a busy machine, timed as for same-node calls).
    /// TLS and connector streams always park. `Duration::ZERO`: never poll. Default: 2.5 ms.
    pub dataplane_poll: Duration,
    /// TLS to a node whose listeners run it (gRPC and data plane), with this client's certificate
    /// where the node takes client certificates. Default: none (plain TCP).
    pub tls: Option<crate::ClientTls>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            data_connections: 4,
            max_batch_blocks: 256,
            max_batch_bytes: 32 << 20,
            auth_token: None,
            park_retries: 3,
            pool_idle: Duration::from_secs(60),
            samenode: crate::SameNodeMode::Auto,
            samenode_poll: crate::polled::MAX_POLL,
            dataplane_poll: crate::polled::MAX_POLL,
            tls: None,
        }
    }
}

/// A namespace registered with the server, with its key chain and the codec this client stores
/// its blocks with.
#[derive(Clone)]
pub struct NamespaceHandle {
    pub namespace: Namespace,
    pub id: NamespaceId,
    chain: KeyChain,
    codec: CodecId,
    lossless_sink_blocks: usize,
}

impl NamespaceHandle {
    /// A handle made here, without asking a server (one that can't be reached now): its keys
    /// are the same as a registered one's; calls through it are answered `UnknownNamespace`
    /// until the namespace is registered ([`KvClient::register`]).
    pub fn unregistered(ns: Namespace) -> Result<Self, ClientError> {
        ns.validate().map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        Ok(NamespaceHandle {
            chain: KeyChain::new(&ns),
            id: ns.id(),
            namespace: ns,
            codec: CodecId::RAW,
            lossless_sink_blocks: 0,
        })
    }

    pub fn block_tokens(&self) -> usize {
        self.chain.block_tokens()
    }
    /// The key of a block an engine hashed itself (vLLM's block hash, SGLang's page hash,
    /// LMCache's chunk key), salted into this namespace: the same engine hash in two namespaces
    /// (two tenants, models, layouts) gives two keys.
    pub fn engine_key(&self, engine_hash: &[u8]) -> BlockKey {
        BlockKey::opaque(&self.namespace, engine_hash)
    }

    /// Keys of the full blocks of `tokens`.
    pub fn keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.chain.full_blocks(tokens)
    }
    /// Key of the partial tail of `tokens`, if any.
    pub fn tail_key(&self, tokens: &[u32]) -> Option<BlockKey> {
        self.chain.tail(tokens)
    }
    /// Bytes of a full block in the engine's dtype.
    pub fn block_bytes(&self) -> u64 {
        self.namespace.layout.block_bytes()
    }
    /// The same namespace, storing with `codec` (loads decode whatever codec a block was stored
    /// with, so readers need not agree with writers).
    pub fn with_codec(mut self, codec: CodecId) -> Result<Self, ClientError> {
        kvtier_kernels::split_codec(codec)?;
        if self.namespace.is_lossless() && !kvtier_kernels::is_lossless(codec) {
            return Err(ClientError::InvalidArgument(format!(
                "codec {} quantizes; this namespace is lossless (an opaque layout or `lossless`)",
                codec.name()
            )));
        }
        if self.namespace.layout.is_opaque() && codec != CodecId::RAW {
            return Err(ClientError::InvalidArgument(format!(
                "an opaque layout is stored raw (codec {} needs the KV's shape)",
                codec.name()
            )));
        }
        self.codec = codec;
        Ok(self)
    }

    /// The codec blocks are stored with. Default: raw.
    pub fn codec(&self) -> CodecId {
        self.codec
    }

    /// The same namespace, keeping the first `n` blocks of every context lossless (raw) whatever
    /// the codec: the attention-sink tokens at the start draw attention from every later token,
    /// and quantizing them costs more accuracy than their size saves (`python -m
    /// kvtier.accuracy` measures it). Their frames carry [`FRAME_FLAG_KEEP_LOSSLESS`], so the
    /// server's disk codec leaves them lossless too. Default: 0.
    pub fn with_lossless_sink_blocks(mut self, n: usize) -> Self {
        self.lossless_sink_blocks = n;
        self
    }

    pub fn lossless_sink_blocks(&self) -> usize {
        self.lossless_sink_blocks
    }

    /// The codec block `index` (0 = the context's first) is stored with.
    pub fn codec_for_block(&self, index: usize) -> CodecId {
        if index < self.lossless_sink_blocks {
            CodecId::RAW
        } else {
            self.codec
        }
    }

    /// A frame of `tokens` tokens under `key`; `payload` is the block in the namespace's layout
    /// (`tokens` tokens of it) and is encoded with the namespace's codec.
    pub fn frame(&self, key: BlockKey, tokens: u32, payload: Bytes) -> Result<BlockFrame, ClientError> {
        self.frame_with(self.codec, key, tokens, payload)
    }

    fn frame_with(
        &self,
        codec: CodecId,
        key: BlockKey,
        tokens: u32,
        payload: Bytes,
    ) -> Result<BlockFrame, ClientError> {
        let layout = self.namespace.layout;
        let payload = if codec == CodecId::RAW {
            payload
        } else {
            let spec = BlockSpec::from_layout(&layout, tokens);
            Bytes::from(kvtier_kernels::encode(codec, &KvBlockView::new(spec, &payload)?)?)
        };
        Ok(BlockFrame::new(self.id, key, layout, codec, tokens, payload))
    }

    /// Frames for `(key, tokens, payload)` of blocks `first_index..` of a context, each encoded
    /// with [`NamespaceHandle::codec_for_block`] (in parallel when any is encoded). Sink blocks
    /// are flagged [`FRAME_FLAG_KEEP_LOSSLESS`], so no tier quantizes them later either.
    pub(crate) fn frames(
        &self,
        first_index: usize,
        blocks: Vec<(BlockKey, u32, Bytes)>,
    ) -> Result<Vec<BlockFrame>, ClientError> {
        let one = |(i, (k, n, b)): (usize, (BlockKey, u32, Bytes))| {
            let index = first_index + i;
            let frame = self.frame_with(self.codec_for_block(index), k, n, b)?;
            Ok(if index < self.lossless_sink_blocks { frame.with_flags(FRAME_FLAG_KEEP_LOSSLESS) } else { frame })
        };
        if self.codec == CodecId::RAW {
            blocks.into_iter().enumerate().map(one).collect()
        } else {
            kvtier_kernels::par::run(|| blocks.into_par_iter().enumerate().map(one).collect())
        }
    }
}

/// A loaded frame's payload in the layout's dtype: raw payloads as they are, encoded ones decoded.
pub fn decode_frame(frame: &BlockFrame) -> Result<Bytes, ClientError> {
    let h = &frame.header;
    if h.codec == CodecId::RAW {
        return Ok(frame.payload.clone());
    }
    let spec = BlockSpec::from_layout(&h.layout, h.tokens);
    Ok(Bytes::from(kvtier_kernels::decode(h.codec, &frame.payload, &spec)?))
}

/// Decodes `frame` into `out`, which must be exactly the block's size in the layout's dtype.
pub fn decode_frame_into(frame: &BlockFrame, out: &mut [u8]) -> Result<(), ClientError> {
    let h = &frame.header;
    let spec = BlockSpec::from_layout(&h.layout, h.tokens);
    if out.len() != spec.byte_len() {
        return Err(ClientError::InvalidArgument(format!(
            "a block of {} tokens is {} bytes, the buffer has {}",
            h.tokens,
            spec.byte_len(),
            out.len()
        )));
    }
    if h.codec == CodecId::RAW {
        if frame.payload.len() != out.len() {
            return Err(kvtier_proto::ProtoError::SizeMismatch {
                expected: out.len() as u64,
                actual: frame.payload.len() as u64,
                tokens: h.tokens,
                codec: h.codec.0,
            }
            .into());
        }
        out.copy_from_slice(&frame.payload);
        return Ok(());
    }
    kvtier_kernels::Codec::new(h.codec).decode_into(&frame.payload, &spec, spec.dtype, out)?;
    Ok(())
}

/// Decodes frames in parallel (raw ones are passed through without a copy).
fn decode_frames(frames: Vec<BlockFrame>) -> Result<Vec<Bytes>, ClientError> {
    if frames.iter().all(|f| f.header.codec == CodecId::RAW) {
        Ok(frames.into_iter().map(|f| f.payload).collect())
    } else {
        kvtier_kernels::par::run(|| frames.par_iter().map(decode_frame).collect())
    }
}

/// What a store of one block left on the server: its status (`Ok` stored now, `Present` already
/// held, or why refused) and the codec of the copy held now (`None` when refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredAs {
    pub status: ItemStatus,
    pub codec: Option<CodecId>,
}

/// Per-block outcome of a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreReport {
    pub stored: usize,
    /// Blocks the server refused, with why (e.g. `Capacity` when everything resident is pinned).
    pub rejected: Vec<(usize, ItemStatus)>,
}

impl StoreReport {
    /// An error for the first rejected block, if any.
    pub fn ok(&self) -> Result<(), ClientError> {
        match self.rejected.first() {
            Some(&(index, status)) => Err(ClientError::Rejected { index, status }),
            None => Ok(()),
        }
    }
}

/// A session's state as the server reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub id: String,
    /// The namespace it belongs to (all zeros where the server did not say).
    pub namespace: NamespaceId,
    pub version: u64,
    pub token_count: u64,
    pub blocks: u32,
    pub has_tail: bool,
    pub bytes: u64,
    pub expires_in: Duration,
    pub priority: u32,
    /// The namespace's tenant, where the server said (`list_sessions`; empty elsewhere).
    pub tenant: String,
}

impl SessionInfo {
    fn from_pb(p: pb::SessionInfo) -> Self {
        SessionInfo {
            namespace: NamespaceId(p.namespace_id[..].try_into().unwrap_or([0; 16])),
            id: p.session_id,
            version: p.version,
            token_count: p.token_count,
            blocks: p.blocks,
            has_tail: p.has_tail,
            bytes: p.bytes,
            expires_in: Duration::from_millis(p.expires_in_ms),
            priority: p.priority,
            tenant: p.tenant,
        }
    }
}

/// A resumed session: its manifest and its KV (in the layout's dtype), full blocks in order then
/// the tail.
#[derive(Debug, Clone)]
pub struct ResumedSession {
    pub info: SessionInfo,
    pub keys: Vec<BlockKey>,
    pub tail_key: Option<BlockKey>,
    pub blocks: Vec<Bytes>,
}

/// A session's manifest without its KV ([`KvClient::session_manifest`]): its info and keys, full
/// blocks in order then the tail's.
#[derive(Debug, Clone)]
pub struct SessionManifest {
    pub info: SessionInfo,
    pub keys: Vec<BlockKey>,
    pub tail_key: Option<BlockKey>,
}

/// How to park a session.
#[derive(Debug, Clone, Default)]
pub struct ParkOptions {
    /// `None`: the server's default TTL. Zero is refused (`InvalidArgument`); under a
    /// millisecond rounds up to one.
    pub ttl: Option<Duration>,
    /// 0 low, 1 normal (default), 2 high.
    pub priority: Option<u32>,
}

#[derive(Clone)]
pub(crate) struct Auth(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub(crate) type Grpc = KvTierClient<InterceptedService<Channel, Auth>>;

struct Inner {
    grpc: Grpc,
    pool: DataPool,
    cfg: ClientConfig,
    info: pb::InfoResponse,
    batch_blocks: usize,
    near: crate::near::AutoNear,
}

/// The engine-facing client. Cheap to clone; clones share connections.
///
/// Every call is bounded by `ClientConfig::request_timeout` and returns a typed [`ClientError`];
/// [`crate::EngineClient`] wraps it so that nothing raises.
#[derive(Clone)]
pub struct KvClient {
    inner: Arc<Inner>,
}

/// Whether `addr` can name a node's gRPC listener: `host:port` (or a URL with a scheme and a
/// port); the error says what is wrong with it, for the caller to fix (nothing is dialled).
pub fn check_server_addr(addr: &str) -> Result<(), String> {
    let url = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
    let uri: tonic::transport::Uri = url
        .parse()
        .map_err(|e| format!("{addr:?} is not a server address (host:port, such as 127.0.0.1:7070): {e}"))?;
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("{addr:?} names no host (host:port, such as 127.0.0.1:7070)"));
    }
    // A URL with its scheme may leave the port to it (443 behind a load balancer).
    if uri.port_u16().is_none() && !addr.contains("://") {
        return Err(format!("{addr:?} names no port: the node's gRPC port (host:port, such as 127.0.0.1:7070)"));
    }
    Ok(())
}

#[cfg(test)]
mod addr_tests {
    use super::check_server_addr;

    #[test]
    fn a_server_address_needs_a_host_and_a_port() {
        for ok in [
            "127.0.0.1:7070",
            "localhost:1",
            "http://10.0.0.1:7070",
            "https://node-3.example:443",
            "https://kv.example",
            "[::1]:7070",
        ] {
            assert_eq!(check_server_addr(ok), Ok(()), "{ok}");
        }
        for (bad, says) in [
            ("garbage addr", "not a server address"),
            ("127.0.0.1", "names no port"),
            (":7070", "no host"),
            ("", "not a server address"),
        ] {
            let e = check_server_addr(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}

impl KvClient {
    /// Connects to a server's gRPC address (`host:port`) and learns its data-plane address.
    pub async fn connect(addr: &str, cfg: ClientConfig) -> Result<Self, ClientError> {
        Self::connect_dial(addr, cfg, None).await
    }

    /// Connects to a server's gRPC address (`host:port`); data-plane connections come from
    /// `connector` instead of TCP to the address the server announces (a Unix socket, an
    /// in-process stream, a test's fault-injecting wrapper).
    pub async fn connect_with(
        addr: &str,
        cfg: ClientConfig,
        connector: impl DataPlaneConnector,
    ) -> Result<Self, ClientError> {
        Self::connect_dial(addr, cfg, Some(Arc::new(connector))).await
    }

    async fn connect_dial(
        addr: &str,
        cfg: ClientConfig,
        connector: Option<Arc<dyn DataPlaneConnector>>,
    ) -> Result<Self, ClientError> {
        check_server_addr(addr).map_err(ClientError::InvalidArgument)?;
        crate::fork::hold_locks_over_fork();
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let url = if addr.contains("://") { addr.to_string() } else { format!("{scheme}://{addr}") };
        let cerr = |reason: String| ClientError::Connect { addr: addr.to_string(), reason };
        let mut endpoint = Endpoint::from_shared(url)
            .map_err(|e| cerr(e.to_string()))?
            .connect_timeout(cfg.connect_timeout)
            .timeout(cfg.request_timeout)
            .tcp_nodelay(true);
        // The host the node's certificate must name (unless `ClientTls::server_name` says which).
        let host = endpoint.uri().host().unwrap_or_default().to_string();
        let tls_dial = match &cfg.tls {
            Some(tls) => {
                endpoint = endpoint.tls_config(tls.tonic_config(&host)).map_err(|e| cerr(format!("TLS: {e}")))?;
                Some(crate::tls::TlsDial::new(tls, &host)?)
            }
            None => None,
        };
        let channel = tokio::time::timeout(cfg.connect_timeout, endpoint.connect())
            .await
            .map_err(|_| ClientError::Timeout(cfg.connect_timeout))?
            .map_err(|e| {
                let cause = std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default();
                // A TLS client's hello answered by a plain listener: its bytes are no TLS record.
                let hint = if cfg.tls.is_some() && cause.contains("InvalidContentType") {
                    "; the node may not run TLS: connect without TLS"
                } else {
                    ""
                };
                cerr(format!("{e} ({cause}{hint})"))
            })?;
        let auth = match &cfg.auth_token {
            Some(t) => Some(
                format!("Bearer {t}")
                    .parse()
                    .map_err(|_| ClientError::InvalidArgument("auth token is not valid ASCII".into()))?,
            ),
            None => None,
        };
        let mut grpc = KvTierClient::with_interceptor(channel, Auth(auth))
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        let info = match grpc.info(pb::InfoRequest {}).await {
            Ok(r) => r.into_inner(),
            Err(s) => return Err(first_call_error(addr, s, &cfg)),
        };
        let dial = match connector {
            Some(c) => Dial::Custom(c),
            None => {
                let data_addr = info
                    .data_addr
                    .parse::<SocketAddr>()
                    .map_err(|_| cerr(format!("server announced a bad data address {:?}", info.data_addr)))?;
                match tls_dial {
                    Some(t) => Dial::Tls(data_addr, t),
                    None => Dial::Tcp(data_addr),
                }
            }
        };
        let pool = DataPool::new(
            dial,
            cfg.auth_token.clone(),
            cfg.data_connections,
            cfg.connect_timeout,
            cfg.pool_idle,
            cfg.dataplane_poll,
        );
        let batch_blocks = cfg.max_batch_blocks.min(info.max_blocks_per_request as usize).max(1);
        // A client with a certificate and no token gets a ticket for each same-node connection.
        let cert_only = cfg.auth_token.is_none() && cfg.tls.as_ref().is_some_and(|t| t.identity.is_some());
        let near = crate::near::AutoNear::new(&cfg, &info, cert_only.then(|| grpc.clone()));
        Ok(KvClient { inner: Arc::new(Inner { grpc, pool, cfg, info, batch_blocks, near }) })
    }

    /// A connection to the server's same-node socket, for loads into and stores from this
    /// process's [`crate::SharedBuffer`]s. An error ([`ClientError::NotSameNode`]) when the server
    /// advertises no socket or runs on another host (its boot id is not ours), or the socket
    /// can't be reached (another container, permissions): the caller falls back to the data
    /// plane.
    pub async fn samenode(&self) -> Result<crate::SameNode, ClientError> {
        let info = &self.inner.info;
        if info.samenode_socket.is_empty() {
            return Err(ClientError::NotSameNode("the server advertises no same-node socket".into()));
        }
        let ours = crate::samenode::host_id();
        if ours.is_empty() || ours != info.host_id {
            return Err(ClientError::NotSameNode(format!(
                "the server runs on another host (its boot id {:?}, ours {ours:?})",
                info.host_id
            )));
        }
        let cfg = &self.inner.cfg;
        let ticket = match (&cfg.auth_token, cfg.tls.as_ref().is_some_and(|t| t.identity.is_some())) {
            (None, true) => Some(self.samenode_ticket().await?),
            _ => None,
        };
        let mut conn = crate::SameNode::connect(
            std::path::Path::new(&info.samenode_socket),
            ticket.as_deref().or(cfg.auth_token.as_deref()),
            cfg.connect_timeout,
            cfg.request_timeout,
            info.max_blocks_per_request as usize,
        )
        .await
        .map_err(|e| match e {
            ClientError::Connect { addr, reason } => {
                // The host is the server's (checked above): most likely it is stopped or restarting.
                ClientError::NotSameNode(format!(
                    "cannot reach the same-node socket {addr}: {reason} (the server runs on this host: is it stopped \
                     or restarting?)"
                ))
            }
            other => other,
        })?;
        conn.set_answer_poll(cfg.samenode_poll);
        Ok(conn)
    }

    /// A single-use ticket (valid for about a minute) that stands for this client on the
    /// server's same-node socket, where a TLS client certificate can't be presented: what
    /// [`KvClient::samenode`] and the automatic path present in the hello when the client has a
    /// certificate and no token.
    pub async fn samenode_ticket(&self) -> Result<String, ClientError> {
        crate::near::fetch_ticket(&self.inner.grpc, self.inner.cfg.connect_timeout).await
    }

    /// What the server said about itself on connect.
    pub fn server_info(&self) -> &pb::InfoResponse {
        &self.inner.info
    }

    pub(crate) fn near(&self) -> &crate::near::AutoNear {
        &self.inner.near
    }

    fn grpc(&self) -> Grpc {
        self.inner.grpc.clone()
    }

    async fn timed<T>(&self, f: impl std::future::Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
        let t = self.inner.cfg.request_timeout;
        tokio::time::timeout(t, f).await.map_err(|_| ClientError::Timeout(t))?
    }

    /// Registers (idempotently) a namespace and returns its handle.
    pub async fn register(&self, ns: Namespace) -> Result<NamespaceHandle, ClientError> {
        // The caller's own arguments, checked here: nothing is sent.
        ns.validate().map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        let resp = self.grpc().register_namespace(ns.to_pb()).await?.into_inner();
        let id = NamespaceId::from_slice(&resp.namespace_id)?;
        if id != ns.id() {
            return Err(ClientError::Refused {
                code: "namespace-id".into(),
                message: "server computed another namespace id".into(),
            });
        }
        Ok(NamespaceHandle {
            chain: KeyChain::new(&ns),
            namespace: ns,
            id,
            codec: CodecId::RAW,
            lossless_sink_blocks: 0,
        })
    }

    /// How many leading tokens of `tokens` the server holds (a multiple of the block size).
    pub async fn lookup(&self, ns: &NamespaceHandle, tokens: &[u32]) -> Result<usize, ClientError> {
        // As a store or load of these tokens would (the server, given only the full blocks'
        // keys, would count the tail out and name another length).
        self.check_context(tokens.len())?;
        let keys = ns.keys(tokens);
        Ok(self.lookup_keys(ns, &keys).await? * ns.block_tokens())
    }

    /// How many leading keys of a chain the server holds.
    pub async fn lookup_keys(&self, ns: &NamespaceHandle, keys: &[BlockKey]) -> Result<usize, ClientError> {
        let req = pb::LookupRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            keys: keys.iter().map(|k| Bytes::copy_from_slice(&k.0)).collect(),
        };
        let mut g = self.grpc();
        let resp = self.timed(async move { Ok(g.lookup(req).await?.into_inner()) }).await?;
        Ok(resp.matched_blocks as usize)
    }

    /// Refuses, before anything is sent, a context longer than the server accepts.
    pub(crate) fn check_context(&self, tokens: usize) -> Result<(), ClientError> {
        let max = self.inner.info.max_context_tokens;
        if tokens as u64 > max {
            return Err(ClientError::ContextTooLong(format!(
                "{tokens} tokens exceed the server's max_context_tokens {max}"
            )));
        }
        Ok(())
    }

    /// Splits frames into batches bounded by block count and bytes (as index ranges), spread over
    /// the pool's connections when the call moves enough bytes to gain from it (as [`Self::stripes`]).
    fn batches(&self, frames: &[BlockFrame]) -> Vec<std::ops::Range<usize>> {
        self.split_batches(frames, true)
    }

    /// [`Self::batches`] for requests sent one after another on one connection (no striping).
    fn batches_on_one(&self, frames: &[BlockFrame]) -> Vec<std::ops::Range<usize>> {
        self.split_batches(frames, false)
    }

    fn split_batches(&self, frames: &[BlockFrame], stripe: bool) -> Vec<std::ops::Range<usize>> {
        let total: u64 = frames.iter().map(|f| f.payload.len() as u64).sum();
        let mut most = self.inner.batch_blocks.max(1);
        if stripe && total >= STRIPE_MIN_BYTES {
            most = most.min(frames.len().div_ceil(self.inner.cfg.data_connections.max(1))).max(1);
        }
        let mut out = Vec::new();
        let (mut start, mut bytes) = (0usize, 0u64);
        for (i, f) in frames.iter().enumerate() {
            let n = i - start;
            if n > 0 && (n >= most || bytes + f.payload.len() as u64 > self.inner.cfg.max_batch_bytes) {
                out.push(start..i);
                start = i;
                bytes = 0;
            }
            bytes += f.payload.len() as u64;
        }
        if start < frames.len() {
            out.push(start..frames.len());
        }
        out
    }

    /// Stores frames as they are (any namespace, any codec). One status per frame.
    pub async fn store_frames(&self, frames: &[BlockFrame]) -> Result<Vec<ItemStatus>, ClientError> {
        let batches = self.batches(frames);
        let results = self
            .timed(try_join_all(batches.into_iter().map(|r| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let st = conn.put(&frames[r], false).await?;
                lease.release();
                Ok::<_, ClientError>(st)
            })))
            .await?;
        Ok(results.into_iter().flatten().collect())
    }

    /// Stores the KV of the full blocks of `tokens`: `blocks[i]` is block `i`'s payload in the
    /// namespace's layout (the tail, if any, is not stored here; see [`KvClient::park`]).
    pub async fn store(
        &self,
        ns: &NamespaceHandle,
        tokens: &[u32],
        blocks: &[Bytes],
    ) -> Result<StoreReport, ClientError> {
        self.store_from(ns, tokens, 0, blocks).await
    }

    /// Stores full blocks from block `first_block` of `tokens` on: `blocks[i]` is block
    /// `first_block + i` (an engine that reused a prefix sends only what it computed).
    pub async fn store_from(
        &self,
        ns: &NamespaceHandle,
        tokens: &[u32],
        first_block: usize,
        blocks: &[Bytes],
    ) -> Result<StoreReport, ClientError> {
        self.check_context(tokens.len())?;
        let keys = ns.keys(tokens);
        if first_block.checked_add(blocks.len()).is_none_or(|end| end > keys.len()) {
            return Err(ClientError::InvalidArgument(format!(
                "{} blocks from block {first_block} given for {} tokens, which make only {} full blocks",
                blocks.len(),
                tokens.len(),
                keys.len()
            )));
        }
        let bt = ns.block_tokens() as u32;
        let frames =
            ns.frames(first_block, keys[first_block..].iter().zip(blocks).map(|(k, b)| (*k, bt, b.clone())).collect())?;
        self.store_checked(&frames).await
    }

    async fn store_checked(&self, frames: &[BlockFrame]) -> Result<StoreReport, ClientError> {
        let st = self.store_frames(frames).await?;
        let rejected: Vec<(usize, ItemStatus)> =
            st.iter().enumerate().filter(|(_, s)| **s != ItemStatus::Ok).map(|(i, s)| (i, *s)).collect();
        Ok(StoreReport { stored: st.len() - rejected.len(), rejected })
    }

    /// Loads blocks by key; `None` for a miss. Every frame was verified end to end.
    pub async fn load_keys(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<BlockFrame>>, ClientError> {
        self.load_keys_with(ns, keys, false).await
    }

    async fn load_keys_with(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        stop_at_miss: bool,
    ) -> Result<Vec<Option<BlockFrame>>, ClientError> {
        let max_frame = self.inner.info.max_frame_bytes;
        let chunks: Vec<&[BlockKey]> = keys.chunks(self.inner.batch_blocks).collect();
        let (id, block_bytes) = (ns.id, ns.block_bytes());
        let results = self
            .timed(try_join_all(chunks.into_iter().map(|c| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let got = conn.get(id, c, stop_at_miss, max_frame, c.len() as u64 * block_bytes).await?;
                lease.release();
                Ok::<_, ClientError>(got)
            })))
            .await?;
        Ok(results.into_iter().flatten().collect())
    }

    /// Batches of `n` blocks of about `block_bytes` each: within the per-request limits, and spread
    /// over the pool's connections when the call moves enough bytes to gain from it.
    fn stripes(&self, n: usize, block_bytes: u64) -> Vec<std::ops::Range<usize>> {
        let conns = self.inner.cfg.data_connections.max(1);
        let by_bytes = (self.inner.cfg.max_batch_bytes / block_bytes.max(1)).max(1) as usize;
        let mut per = self.inner.batch_blocks.min(by_bytes).max(1);
        if n as u64 * block_bytes >= STRIPE_MIN_BYTES {
            per = per.min(n.div_ceil(conns)).max(1);
        }
        (0..n).step_by(per).map(|s| s..(s + per).min(n)).collect()
    }

    /// A data-plane connection of its own for remote leases: slots of the node's DRAM arena that
    /// a one-sided mover (RDMA) writes and reads outside the connection (see [`LeaseSession`]).
    /// A node with no fabric attached refuses each lease request with a message saying so; only
    /// the operator (`auth_token`) may connect to one.
    pub async fn lease_session(&self) -> Result<crate::LeaseSession, ClientError> {
        let conn = self.inner.pool.dedicated().await?;
        Ok(crate::LeaseSession::new(conn, self.inner.info.max_frame_bytes, self.inner.cfg.request_timeout))
    }

    /// Which of `keys` the server holds (in any tier), each key on its own: engines store chunks
    /// out of order, so a hole does not hide the keys after it. See [`NamespaceHandle::engine_key`].
    pub async fn exists_keys(&self, ns: &NamespaceHandle, keys: &[BlockKey]) -> Result<Vec<bool>, ClientError> {
        let id = ns.id;
        let results = self
            .timed(try_join_all(keys.chunks(self.inner.batch_blocks).map(|c| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let got = conn.exists(id, c).await?;
                lease.release();
                Ok::<_, ClientError>(got)
            })))
            .await?;
        Ok(results.into_iter().flatten().collect())
    }

    /// Stores full blocks under `keys`: `blocks[i]` is block `i`'s payload in the namespace's
    /// layout, as one part or as segments taken back to back (an engine page's planes; sent
    /// from where they are, never staged). One status per block: `Ok` stored now, `Present`
    /// already held (nothing sent was kept; in a lossless namespace the held copy is lossless
    /// too), or why it was refused.
    pub async fn store_keys(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        blocks: &[Vec<Bytes>],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        Ok(self.store_keys_report(ns, keys, blocks).await?.into_iter().map(|r| r.status).collect())
    }

    /// [`KvClient::store_keys`], saying beside each status which codec the copy the server holds
    /// is in: a writer that stores raw learns whether a block someone else stored first is lossy.
    pub async fn store_keys_report(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        blocks: &[Vec<Bytes>],
    ) -> Result<Vec<StoredAs>, ClientError> {
        if keys.len() != blocks.len() {
            return Err(ClientError::InvalidArgument(format!("{} keys but {} blocks", keys.len(), blocks.len())));
        }
        let bb = ns.block_bytes();
        for (i, b) in blocks.iter().enumerate() {
            let len: u64 = b.iter().map(|p| p.len() as u64).sum();
            if len != bb {
                return Err(ClientError::InvalidArgument(format!("block {i} is {len} bytes; a block is {bb}")));
            }
        }
        let layout = ns.namespace.layout;
        let tokens = layout.block_tokens;
        let flags = if ns.namespace.is_lossless() { FRAME_FLAG_KEEP_LOSSLESS } else { 0 };
        let frames: Vec<GatherFrame> = if ns.codec == CodecId::RAW {
            keys.iter()
                .zip(blocks)
                .map(|(k, parts)| {
                    let header = FrameHeader {
                        codec: CodecId::RAW,
                        tokens,
                        flags,
                        namespace: ns.id,
                        key: *k,
                        layout,
                        payload_len: bb,
                        // Hashed as it is sent (see `DataConn::put_frames`).
                        checksum: 0,
                    };
                    GatherFrame { header, parts: parts.clone(), summed: false }
                })
                .collect()
        } else {
            let one = |(k, parts): (&BlockKey, &Vec<Bytes>)| {
                let payload = match parts.as_slice() {
                    [one] => one.clone(),
                    many => Bytes::from(many.concat()),
                };
                let f = ns.frame(*k, tokens, payload)?.with_flags(flags);
                Ok::<_, ClientError>(GatherFrame { header: f.header, parts: vec![f.payload], summed: true })
            };
            kvtier_kernels::par::run(|| keys.par_iter().zip(blocks.par_iter()).map(one).collect::<Result<_, _>>())?
        };
        let frames = &frames;
        let results = self
            .timed(try_join_all(self.stripes(frames.len(), bb).into_iter().map(|r| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let st = conn.put_reporting(&frames[r]).await?;
                lease.release();
                Ok::<_, ClientError>(st)
            })))
            .await?;
        Ok(results.into_iter().flatten().map(|(status, codec)| StoredAs { status, codec }).collect())
    }

    /// Loads blocks by key straight into the caller's memory: `dests[i]` receives block `i` in
    /// the layout's dtype (decoded if it was stored encoded). A raw block is received from the
    /// socket into its destination and verified there: one copy, no staging. True where block
    /// `i` landed and verified; false for a miss, or for a block that failed its checksum
    /// (whose destination then holds unspecified bytes, never mistaken for data since it is
    /// reported false). With `stop_at_miss`, keys after the first miss are reported false (the
    /// longest stored prefix, with lookup and load in one round trip; each stripe's request stops
    /// at its own first miss).
    pub async fn load_keys_into(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        dests: &mut [BlockDest<'_>],
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        if keys.len() != dests.len() {
            return Err(ClientError::InvalidArgument(format!("{} keys but {} destinations", keys.len(), dests.len())));
        }
        let max_frame = self.inner.info.max_frame_bytes;
        let id = ns.id;
        let decode = |frame: &BlockFrame, dest: &mut [&mut [u8]]| -> Result<(), ClientError> {
            if let [one] = dest {
                return decode_frame_into(frame, one);
            }
            let all = decode_frame(frame)?;
            let room: usize = dest.iter().map(|s| s.len()).sum();
            if room != all.len() {
                return Err(ClientError::InvalidArgument(format!("block is {} bytes, its segments {room}", all.len())));
            }
            let mut at = 0;
            for seg in dest.iter_mut() {
                seg.copy_from_slice(&all[at..at + seg.len()]);
                at += seg.len();
            }
            Ok(())
        };
        let decode = &decode;
        // Disjoint batches of keys and destinations, one request each, run concurrently.
        let mut batches = Vec::new();
        let mut rest: &mut [BlockDest<'_>] = dests;
        for r in self.stripes(keys.len(), ns.block_bytes()) {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
            rest = tail;
            batches.push((&keys[r], head));
        }
        let results = self
            .timed(try_join_all(batches.into_iter().map(|(k, d)| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let got = conn.get_into(id, k, d, stop_at_miss, max_frame, decode).await?;
                lease.release();
                Ok::<_, ClientError>(got)
            })))
            .await?;
        let landed: Vec<Landed> = results.into_iter().flatten().collect();
        let bad = landed.iter().filter(|l| **l == Landed::Bad).count();
        if bad > 0 {
            metrics::counter!("kvtier_client_bad_blocks_total").increment(bad as u64);
            tracing::warn!(bad, "loaded blocks failed their checksum or decode; reported as misses");
        }
        let mut ok: Vec<bool> = landed.into_iter().map(|l| l == Landed::Ok).collect();
        if stop_at_miss {
            // Stripes run concurrently, each stopping at its own first miss: the prefix ends at
            // the first miss overall (later stripes' blocks are reported false, contents unspecified).
            if let Some(first) = ok.iter().position(|l| !l) {
                ok[first..].fill(false);
            }
        }
        Ok(ok)
    }

    /// Loads the longest stored prefix of `tokens` into `out` (full blocks back to back, in the
    /// layout's dtype), with lookup and load in one data-plane round trip per stripe. Returns the
    /// number of blocks written; `out` bounds how many are asked for.
    pub async fn load_prefix_into(
        &self,
        ns: &NamespaceHandle,
        tokens: &[u32],
        out: &mut [u8],
    ) -> Result<usize, ClientError> {
        self.check_context(tokens.len())?;
        let bb =
            usize::try_from(ns.block_bytes()).map_err(|_| ClientError::InvalidArgument("block too large".into()))?;
        let mut keys = ns.keys(tokens);
        keys.truncate(out.len().checked_div(bb).unwrap_or(0));
        let mut dests: Vec<BlockDest<'_>> = out.chunks_exact_mut(bb).take(keys.len()).map(|c| vec![c]).collect();
        let landed = self.load_keys_into(ns, &keys, &mut dests, true).await?;
        Ok(landed.iter().take_while(|ok| **ok).count())
    }

    /// Loads the longest stored prefix of `tokens`: the payloads of its full blocks, in order,
    /// in the layout's dtype (decoded if they were stored with a codec).
    pub async fn load(&self, ns: &NamespaceHandle, tokens: &[u32]) -> Result<Vec<Bytes>, ClientError> {
        decode_frames(self.load_prefix_frames(ns, tokens).await?)
    }

    /// The frames of the longest stored prefix of `tokens`, as stored (not decoded).
    pub async fn load_prefix_frames(
        &self,
        ns: &NamespaceHandle,
        tokens: &[u32],
    ) -> Result<Vec<BlockFrame>, ClientError> {
        self.check_context(tokens.len())?;
        let keys = ns.keys(tokens);
        // Lookup and load in one request: the server stops at the first block it lacks.
        let frames = self.load_keys_with(ns, &keys, true).await?;
        Ok(frames.into_iter().map_while(|f| f).collect())
    }

    /// Frames for a session's blocks: full blocks from `first_block`, then the tail.
    fn session_frames(
        ns: &NamespaceHandle,
        tokens: &[u32],
        first_block: usize,
        blocks: &[Bytes],
    ) -> Result<SessionFrames, ClientError> {
        let keys = ns.keys(tokens);
        let tail = ns.tail_key(tokens);
        if first_block > keys.len() {
            return Err(ClientError::InvalidArgument(format!(
                "first block {first_block} is past {} full blocks",
                keys.len()
            )));
        }
        let want = keys.len() - first_block + usize::from(tail.is_some());
        if blocks.len() != want {
            return Err(ClientError::InvalidArgument(format!(
                "{} tokens from block {first_block} need {want} block payloads (full blocks then the tail), got {}",
                tokens.len(),
                blocks.len()
            )));
        }
        let bt = ns.block_tokens();
        let mut parts = Vec::with_capacity(want);
        for (i, b) in blocks.iter().enumerate() {
            let idx = first_block + i;
            let (key, n) = match keys.get(idx) {
                Some(k) => (*k, bt),
                None => (tail.unwrap_or(BlockKey([0; 32])), tokens.len() % bt),
            };
            parts.push((key, n as u32, b.clone()));
        }
        let frames = ns.frames(first_block, parts)?;
        Ok((keys, tail, frames))
    }

    /// Parks a session: stores its blocks that the server lacks (the tail included), then writes
    /// the manifest, pinning every block. `blocks` holds every full block of `tokens` then the
    /// tail, if the tokens don't fill whole blocks. `expected_version` 0 creates the session.
    pub async fn park(
        &self,
        ns: &NamespaceHandle,
        session_id: &str,
        tokens: &[u32],
        blocks: &[Bytes],
        opts: &ParkOptions,
        expected_version: u64,
    ) -> Result<SessionInfo, ClientError> {
        self.check_context(tokens.len())?;
        if opts.ttl == Some(Duration::ZERO) {
            return Err(ClientError::InvalidArgument(
                "a TTL of 0 parks a session that is already expired: give a positive TTL, or None for the \
                 server's default"
                    .into(),
            ));
        }
        // Saturated, never wrapped (a wrapped TTL could read as 0: the server's default).
        let ttl_ms = opts.ttl.map(|d| u64::try_from(d.as_millis().max(1)).unwrap_or(u64::MAX)).unwrap_or(0);
        // Refused here, before any block is sent, as the server would refuse it after.
        let max_ms = self.inner.info.session_max_ttl_ms;
        if max_ms > 0 && ttl_ms > max_ms {
            return Err(ClientError::InvalidArgument(format!(
                "ttl {:?} exceeds the server's session_max_ttl {:?}",
                Duration::from_millis(ttl_ms),
                Duration::from_millis(max_ms)
            )));
        }
        let (keys, tail, frames) = Self::session_frames(ns, tokens, 0, blocks)?;
        // Blocks the server already has (a shared prefix) are not sent again.
        let present = self.lookup_keys(ns, &keys).await?;
        let req = pb::ParkRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            session_id: session_id.to_string(),
            keys: keys.iter().map(|k| Bytes::copy_from_slice(&k.0)).collect(),
            tail_key: tail.map(|k| Bytes::copy_from_slice(&k.0)).unwrap_or_default(),
            token_count: tokens.len() as u64,
            ttl_ms,
            priority: opts.priority.unwrap_or(1),
            expected_version,
        };
        let grpc = self.grpc();
        self.timed(self.upload_and_commit(&frames, present, tail.is_some(), || {
            let (mut g, r) = (grpc.clone(), req.clone());
            async move { Ok(g.park_session(r).await?.into_inner()) }
        }))
        .await
    }

    /// Sends `frames[first..]` over one data-plane connection with pin leases (so nothing can be
    /// evicted before the manifest pins it), then runs `commit` (a park or extend), re-sending
    /// whatever the server reports missing. The leases are released at the end either way.
    async fn upload_and_commit<F, Fut>(
        &self,
        frames: &[BlockFrame],
        first: usize,
        has_tail: bool,
        commit: F,
    ) -> Result<SessionInfo, ClientError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<pb::ParkResponse, ClientError>>,
    {
        let mut lease = self.inner.pool.lease().await?;
        let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
        let outcome = async {
            let to_send = &frames[first..];
            for r in self.batches_on_one(to_send) {
                let offset = first + r.start;
                let st = conn.put(&to_send[r], true).await?;
                if let Some((i, s)) = st.iter().enumerate().find(|(_, s)| **s != ItemStatus::Ok) {
                    return Err(ClientError::Rejected { index: offset + i, status: *s });
                }
            }
            for _ in 0..=self.inner.cfg.park_retries {
                let resp = commit().await?;
                if resp.parked {
                    return resp
                        .info
                        .map(SessionInfo::from_pb)
                        .ok_or_else(|| ClientError::Io("answer without session info".into()));
                }
                // Evicted before this call could lease them: send those again.
                let mut again: Vec<BlockFrame> =
                    resp.missing_blocks.iter().filter_map(|&i| frames.get(i as usize).cloned()).collect();
                if resp.missing_tail && has_tail {
                    again.extend(frames.last().cloned());
                }
                for r in self.batches_on_one(&again) {
                    let st = conn.put(&again[r], true).await?;
                    if let Some((i, s)) = st.iter().enumerate().find(|(_, s)| **s != ItemStatus::Ok) {
                        return Err(ClientError::Rejected { index: i, status: *s });
                    }
                }
            }
            // The server lost blocks it had taken (evicted from DRAM, and not kept on disk) on
            // every try: it has no room to hold this session.
            let sent = self.inner.cfg.park_retries + 1;
            Err(ClientError::Capacity(format!(
                "{}: the server lost some of the session's blocks before its park could pin them, {sent} times \
                 (evicted from DRAM and not kept on disk): the session is larger than the room the node has for it \
                 (its DRAM, or a disk tier that is full, too small for the session, or failing: see the node's \
                 log and kvtier_disk_demotions_failed_total)",
                kvtier_proto::codes::CAPACITY
            )))
        }
        .await;
        // On a failed release the connection is dropped, and the server releases on close.
        if conn.release().await.is_ok() {
            lease.release();
        }
        outcome
    }

    /// Extends a parked session after a new turn. `tokens` is the whole context now;
    /// `prev_token_count` what the session held at `expected_version`; `blocks` the payloads of
    /// the full blocks from `prev_token_count / block_tokens` on, then the new tail. Blocks
    /// before that are neither sent nor rewritten. A context that doesn't start with the
    /// session's tokens is refused (`Refused` with `KV:Request:Invalid`), the session unchanged.
    pub async fn extend(
        &self,
        ns: &NamespaceHandle,
        session_id: &str,
        expected_version: u64,
        prev_token_count: usize,
        tokens: &[u32],
        blocks: &[Bytes],
    ) -> Result<SessionInfo, ClientError> {
        if prev_token_count > tokens.len() {
            return Err(ClientError::InvalidArgument("prev_token_count is past the tokens given".into()));
        }
        self.check_context(tokens.len())?;
        let base = prev_token_count / ns.block_tokens();
        let (keys, tail, frames) = Self::session_frames(ns, tokens, base, blocks)?;
        let req = pb::ExtendRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            session_id: session_id.to_string(),
            expected_version,
            base_blocks: base as u32,
            // The server checks the context continues the session's: keys chain over every
            // token before them, so the key of the last block kept stands for all of them.
            base_key: base.checked_sub(1).map(|i| Bytes::copy_from_slice(&keys[i].0)).unwrap_or_default(),
            // And that it keeps the session's partial tail: the tail's tokens are in no block key.
            base_tail_key: ns
                .tail_key(&tokens[..prev_token_count])
                .map(|k| Bytes::copy_from_slice(&k.0))
                .unwrap_or_default(),
            new_keys: keys[base..].iter().map(|k| Bytes::copy_from_slice(&k.0)).collect(),
            tail_key: tail.map(|k| Bytes::copy_from_slice(&k.0)).unwrap_or_default(),
            token_count: tokens.len() as u64,
        };
        let grpc = self.grpc();
        self.timed(self.upload_and_commit(&frames, 0, tail.is_some(), || {
            let (mut g, r) = (grpc.clone(), req.clone());
            async move { Ok(g.extend_session(r).await?.into_inner()) }
        }))
        .await
    }

    /// A session's manifest alone: its info (version, token count...) and keys, no block moved
    /// (what [`KvClient::extend`] needs to know). Like a resume, it restarts the session's TTL.
    pub async fn session_manifest(
        &self,
        ns: &NamespaceHandle,
        session_id: &str,
    ) -> Result<SessionManifest, ClientError> {
        let req =
            pb::ResumeRequest { namespace_id: Bytes::copy_from_slice(&ns.id.0), session_id: session_id.to_string() };
        let mut g = self.grpc();
        let m = self.timed(async move { Ok(g.resume_session(req).await?.into_inner()) }).await?;
        let keys = m.keys.iter().map(|k| BlockKey::try_from(&k[..])).collect::<Result<Vec<_>, _>>()?;
        let tail_key = if m.tail_key.is_empty() { None } else { Some(BlockKey::try_from(&m.tail_key[..])?) };
        let info =
            m.info.map(SessionInfo::from_pb).ok_or_else(|| ClientError::Io("resume answer without info".into()))?;
        Ok(SessionManifest { info, keys, tail_key })
    }

    /// Resumes a session: its manifest and every block, full blocks then the tail.
    pub async fn resume(&self, ns: &NamespaceHandle, session_id: &str) -> Result<ResumedSession, ClientError> {
        let SessionManifest { info, keys, tail_key } = self.session_manifest(ns, session_id).await?;
        let mut all = keys.clone();
        all.extend(tail_key);
        let frames = self.load_keys(ns, &all).await?;
        let mut present = Vec::with_capacity(frames.len());
        for (index, f) in frames.into_iter().enumerate() {
            present.push(f.ok_or(ClientError::Missing { index })?);
        }
        let blocks = decode_frames(present)?;
        Ok(ResumedSession { info, keys, tail_key, blocks })
    }

    /// Drops a session, unpinning its blocks. False if there was none.
    pub async fn drop_session(&self, ns: &NamespaceHandle, session_id: &str) -> Result<bool, ClientError> {
        let req = pb::DropSessionRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            session_id: session_id.to_string(),
        };
        let mut g = self.grpc();
        Ok(self.timed(async move { Ok(g.drop_session(req).await?.into_inner()) }).await?.dropped)
    }

    /// Live sessions of a namespace, or of every namespace, in (namespace, id) order: asked for
    /// a page at a time, so a node holding very many answers in messages of bounded size.
    pub async fn list_sessions(&self, ns: Option<&NamespaceHandle>) -> Result<Vec<SessionInfo>, ClientError> {
        const PAGE: u32 = 4096;
        let namespace_id = ns.map(|n| Bytes::copy_from_slice(&n.id.0)).unwrap_or_default();
        let mut out: Vec<SessionInfo> = Vec::new();
        let (mut after_ns, mut after_id) = (Bytes::new(), String::new());
        loop {
            let req = pb::ListSessionsRequest {
                namespace_id: namespace_id.clone(),
                limit: PAGE,
                after_namespace_id: after_ns.clone(),
                after_session_id: after_id.clone(),
            };
            let mut g = self.grpc();
            let r = self.timed(async move { Ok(g.list_sessions(req).await?.into_inner()) }).await?;
            let last = r.sessions.last().map(|s| (s.namespace_id.clone(), s.session_id.clone()));
            out.extend(r.sessions.into_iter().map(SessionInfo::from_pb));
            match last {
                Some((n, id)) if r.more => (after_ns, after_id) = (n, id),
                // A server of before pages answers everything at once (`more` unset).
                _ => return Ok(out),
            }
        }
    }

    pub async fn stats(&self) -> Result<pb::StatsResponse, ClientError> {
        let mut g = self.grpc();
        self.timed(async move { Ok(g.stats(pb::StatsRequest {}).await?.into_inner()) }).await
    }

    /// Admin: removes every unpinned block of a namespace, on the node and on every other
    /// member of its cluster (see [`Deleted::missed`] for members that could not be reached).
    pub async fn purge(&self, ns: &NamespaceHandle) -> Result<Deleted, ClientError> {
        let req = pb::PurgeRequest { namespace_id: Bytes::copy_from_slice(&ns.id.0), local_only: false };
        let mut g = self.grpc();
        let r = self.timed(async move { Ok(g.purge(req).await?.into_inner()) }).await?;
        Ok(Deleted { blocks_removed: r.blocks_removed, sessions_dropped: 0, peers: r.peers })
    }

    /// Removes a namespace from the server: its sessions are dropped, its blocks removed, and
    /// the server's slot for it freed — on the node and on every other member of its cluster
    /// (see [`Deleted::missed`] for members that could not be reached).
    pub async fn unregister(&self, ns: &NamespaceHandle) -> Result<Deleted, ClientError> {
        let req = pb::UnregisterNamespaceRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            local_only: false,
            as_of_ago_ms: 0,
        };
        let mut g = self.grpc();
        let r = self.timed(async move { Ok(g.unregister_namespace(req).await?.into_inner()) }).await?;
        Ok(Deleted { blocks_removed: r.blocks_removed, sessions_dropped: r.sessions_dropped, peers: r.peers })
    }

    /// The raw gRPC client, for requests the typed API doesn't cover (and for tests that send
    /// malformed ones on purpose).
    pub fn raw_grpc(&self) -> KvTierClient<InterceptedService<Channel, impl tonic::service::Interceptor + Clone>> {
        self.grpc()
    }
}

/// What a purge or an unregistration removed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Deleted {
    /// Blocks removed on the node asked.
    pub blocks_removed: u64,
    /// Sessions dropped on the node asked (an unregistration's).
    pub sessions_dropped: u64,
    /// What the other members of its cluster did; `None` on a node without a cluster.
    pub peers: Option<pb::ClusterDelete>,
}

impl Deleted {
    /// Blocks removed on every member that did it.
    pub fn total_blocks(&self) -> u64 {
        self.blocks_removed + self.peers.as_ref().map_or(0, |p| p.blocks_removed)
    }

    /// Sessions dropped on every member that did it.
    pub fn total_sessions(&self) -> u64 {
        self.sessions_dropped + self.peers.as_ref().map_or(0, |p| p.sessions_dropped)
    }

    /// Members that could not be reached (node id, why): they may still hold the namespace's
    /// blocks until the node asked reaches them (it retries in the background for up to an
    /// hour while it runs); asking again is safe.
    pub fn missed(&self) -> &[pb::MemberFailure] {
        self.peers.as_ref().map_or(&[], |p| &p.failed)
    }

    /// Members that left the membership lately (killed, stopped) and are asked when they are
    /// back (node id, since when): not a failure of this call.
    pub fn away(&self) -> &[pb::MemberFailure] {
        self.peers.as_ref().map_or(&[], |p| &p.away)
    }
}

/// The innermost cause of a failed call: tonic's own words for a connection that failed are
/// only "transport error".
fn root_cause(s: &tonic::Status) -> Option<String> {
    let mut e: &dyn std::error::Error = std::error::Error::source(s)?;
    while let Some(next) = e.source() {
        e = next;
    }
    Some(e.to_string())
}

/// What the first call on a new connection failing means. A server's refusal (it carries a
/// kvtier code) is itself. A connection that fails after it opened (a node that is down fails
/// before) is speaking the wrong protocol: a plain client's HTTP/2 to a TLS listener, or to a
/// listener that isn't gRPC (the data plane, /metrics), gets bytes that are no HTTP/2 or a closed
/// connection; a TLS client without the certificate its node requires, a closed connection.
/// Those are said with their cause and what to check.
fn first_call_error(addr: &str, s: tonic::Status, cfg: &ClientConfig) -> ClientError {
    // The node's listener refused the connection with an HTTP/2 GOAWAY (ENHANCE_YOUR_CALM, which
    // tonic reads as RESOURCE_EXHAUSTED): this address holds the node's max_connections_per_peer.
    if s.code() == tonic::Code::ResourceExhausted
        && !s.metadata().contains_key(codes::METADATA_KEY)
        && s.message().contains("h2 protocol error")
    {
        return ClientError::Refused {
            code: codes::TOO_MANY_CONNECTIONS.into(),
            message: format!(
                "{addr} refused the connection: this address has the node's max_connections_per_peer open \
                 already ({})",
                s.message()
            ),
        };
    }
    if s.metadata().contains_key(codes::METADATA_KEY)
        || !matches!(
            s.code(),
            tonic::Code::Internal | tonic::Code::Unknown | tonic::Code::Unavailable | tonic::Code::Cancelled
        )
    {
        return s.into();
    }
    let said = match root_cause(&s) {
        Some(c) if !s.message().contains(c.as_str()) => format!("{}: {c}", s.message()),
        _ => s.message().to_string(),
    };
    let timed_out = said.contains("Timeout expired") || said.to_ascii_lowercase().contains("timed out");
    let hint = match &cfg.tls {
        // Connected, then nothing: the node's listener is full (its connections wait in the
        // kernel's backlog) as often as it is the wrong port.
        _ if timed_out => {
            "the connection opened but nothing answered in time: the node may be stopped or overloaded, at \
                 its max_connections (busy, or held by other clients), or this is not its gRPC port"
        }
        None => {
            "the node's answer was not HTTP/2 gRPC: is this its gRPC port (not its data-plane or metrics \
                 port)? If the node runs TLS, connect over TLS with its CA"
        }
        Some(t) if t.identity.is_none() => {
            "the node may require a client certificate (mTLS): give the client one signed by the node's client CA"
        }
        Some(_) => return s.into(),
    };
    ClientError::Connect { addr: addr.to_string(), reason: format!("{said} ({hint})") }
}

/// Requests a node sends its peers on a client's behalf.
#[path = "client_peer.rs"]
mod peer;

/// Routing hints: which nodes hold a request's prefix and session.
#[path = "routing.rs"]
mod routing;
pub use routing::{NodeHolding, RouteHint};

/// KV events: a node's stream of stored, evicted and purged keys and session changes.
#[path = "events.rs"]
mod events;
pub use events::{EventKind, EventWatch, KvEvent};

/// Stores and loads straight to a block's owners in a cluster.
#[path = "owners.rs"]
mod owners;
pub use owners::{ClusterMembers, OwnerRouter};
