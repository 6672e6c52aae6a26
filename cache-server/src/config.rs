//! Server configuration: embedded defaults, then a TOML file, then environment variables and
//! flags (the binary merges those), validated once at start with errors that name the setting.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvtier_proto::CodecId;
use serde::Deserialize;

use crate::error::ServerError;

/// Everything `kvtier serve` needs. Field docs end with the default.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// gRPC control plane. Default: `127.0.0.1:7070`.
    pub listen: SocketAddr,
    /// Bulk data plane (framed TCP). Default: `127.0.0.1:7071`.
    pub data_listen: SocketAddr,
    /// Prometheus `/metrics`; `None` turns it off. Default: `127.0.0.1:9464`.
    pub metrics_listen: Option<SocketAddr>,
    /// Where the node keeps its files. Default: `./kvtier-data`.
    pub data_dir: PathBuf,
    /// Hard cap of the DRAM tier, e.g. `"4GiB"`. Default: a quarter of physical memory.
    pub dram_capacity: ByteSize,
    /// Pinned (session) bytes may not exceed this fraction of the DRAM cap. Default: `0.9`.
    pub max_pinned_ratio: f64,
    /// Longest context one request or session may carry, in tokens. Default: `1048576`.
    pub max_context_tokens: u64,
    /// Largest block payload accepted. Default: `64MiB`.
    pub max_frame_bytes: ByteSize,
    /// Most blocks in one data-plane request. Default: `4096`.
    pub max_blocks_per_request: u32,
    /// TTL of a parked session when the client gives none, e.g. `"10m"`. Default: `10m`.
    pub session_ttl: DurationStr,
    /// Longest TTL a client may ask for. Default: `24h`.
    pub session_max_ttl: DurationStr,
    /// Hard cap of the disk tier under DRAM (segment files in `data_dir`); `0` turns it off,
    /// and then parked sessions live in DRAM only. Default: `0`.
    pub disk_capacity: ByteSize,
    /// Size at which a disk segment file is sealed. Default: `64MiB`.
    pub disk_segment_bytes: ByteSize,
    /// Codec for prefix blocks demoted from DRAM to disk that arrive lossless: `"keep"` (as the
    /// client stored them), `"raw+lz4"` (lossless, smaller), or a quantizing codec such as
    /// `"nvfp4+had+lz4"` (the measured choice for a cold tier, see the README). Blocks already
    /// quantized and a parked session's own blocks are written as they came (a session shares the
    /// blocks of a prefix the server already holds as they are). Default: `keep`.
    pub disk_codec: String,
    /// `"fsync"`: a park is acknowledged after its blocks and manifest are fsynced (survives power
    /// loss); `"async"`: after they are written (survives `kill -9`, not power loss). Default: `fsync`.
    pub session_durability: String,
    /// Shared secret clients must present; required when any listener is beyond loopback.
    /// Default: none.
    pub auth_token: Option<String>,
    /// What backs the DRAM tier's one arena: `"anonymous"` memory, or a `"memfd"` a same-node
    /// process can map. Default: `anonymous`.
    pub dram_region: String,
    /// Fault in every page of the DRAM tier's capacity at start, in the background, so the first
    /// fill of the cache doesn't pay a page fault (and a zeroing) per 4 KiB in the store path:
    /// the node holds its whole DRAM capacity from the start. For nodes dedicated to the cache.
    /// Default: `false`.
    pub dram_prefault: bool,
    /// The CPUs the node's threads run on, as a Linux cpulist (`"2-5"`, `"0,4-7"`), set before
    /// its runtime starts (which then runs one worker per CPU): on a host shared with inference
    /// engines, the cache's threads stay off the engines' cores. Default: none, every CPU the
    /// process may use ([`crate::affinity`]).
    pub cpus: Option<String>,
    /// How long a client may hold a reserved DRAM slot (a block being received) before it is
    /// revoked, e.g. `"30s"`. Default: `30s`.
    pub lease_timeout: DurationStr,
    /// A data-plane connection that moves no byte for this long inside a request (a frame cut off
    /// mid-way, an answer nobody reads) is closed. Default: `30s`.
    pub stall_timeout: DurationStr,
    /// How long a data-plane connection polls its socket for the caller's next request after
    /// answering a load of up to 256 KiB, while no other connection is busy (see
    /// `dataplane::spin`): saves a wake-up per request for a caller loading small blocks back to
    /// back; `"0"` turns it off. At most 10ms. Default: `50us`.
    pub dataplane_poll: DurationStr,
    /// A data-plane connection idle this long between requests is closed (clients recycle pooled
    /// connections idle for a minute, so keep it above that), as is a same-node one, and a gRPC
    /// connection with no call in flight this long (a stream open counts as one). Default: `5m`.
    pub idle_timeout: DurationStr,
    /// Bearer token `/metrics` asks for; none: open (it listens on loopback by default).
    /// Default: none.
    pub metrics_token: Option<String>,
    /// The same-node Unix socket (buffers registered by clients on this host, see
    /// `crate::samenode`): `"auto"` (`<data_dir>/kvtier.sock`, left off with a warning when that
    /// path is too long for a socket), `"off"`, or a path. Created with mode 0600, removed on stop.
    /// Default: `auto`.
    pub samenode_socket: String,
    /// Most bytes of buffers all same-node clients together may have registered at once. The
    /// server maps them, and pages a client never touched are filled by the server's copies (and
    /// charged to it), so this bounds what clients can make the server hold there; `0`: the
    /// host's physical memory. Default: `0`.
    pub samenode_max_registered_bytes: ByteSize,
    /// Most bytes of those buffers the clients of any one tenant may have registered at once (the
    /// operator's clients: all of them), so one tenant can't take the whole budget from the
    /// others; `0`: half of `samenode_max_registered_bytes`. Default: `0`.
    pub samenode_max_registered_bytes_per_tenant: ByteSize,
    /// Most bytes of gRPC request bodies still arriving that the node holds at once, over every
    /// connection (a message is read whole before it is handled; a park of a 1M-key manifest is
    /// ~32 MiB). A body that would pass it waits (its sender held back) and is refused
    /// `RESOURCE_EXHAUSTED` after `stall_timeout`; one that moves no byte for `stall_timeout` or
    /// is not whole after 60 s is ended. At least 65 MiB (a message may be 64 MiB). Default:
    /// `256MiB`.
    pub grpc_max_buffered_bytes: ByteSize,
    /// Most of those bytes one tenant's bodies may hold at once (the operator's: all of them), so
    /// one tenant holding its share leaves the rest to the others; `0`: half of
    /// `grpc_max_buffered_bytes`. At least 65 MiB, at most `grpc_max_buffered_bytes`: with many
    /// tenants, a smaller share (and a larger budget) keeps a few of them from holding it all.
    /// Default: `0`.
    pub grpc_max_buffered_bytes_per_tenant: ByteSize,
    /// Tenants as principals (`[[tenants]]` tables, see [`TenantConfig`]): each credential belongs
    /// to one tenant, which reaches only the namespaces it registered (`tenant = <its name>` in the
    /// namespace spec) and those other tenants granted it here. With any tenant configured every
    /// request must present a credential; `auth_token` then is the operator's (every namespace).
    /// Default: none (one user: whoever reaches the listeners).
    pub tenants: Vec<TenantConfig>,
    /// Connections each listener (gRPC, data plane) serves at once; more wait in the kernel's
    /// backlog. Default: `1024`.
    pub max_connections: usize,
    /// Connections one peer (an IP address; a local user on the same-node socket) may hold on each
    /// listener; more are closed on arrival. Default: `256`.
    pub max_connections_per_peer: usize,
    /// Data-plane, same-node and gRPC connections one tenant's clients may hold at once, whatever
    /// addresses they come from (the operator's: no such limit); more are refused at their hello
    /// (gRPC: at the first call with the tenant's credential) with `KV:Connections:TooMany`.
    /// Default: `512`.
    pub max_connections_per_tenant: usize,
    /// Most block keys all parked sessions' manifests may name together (32 bytes of memory
    /// each, outside the DRAM cap), each session counting `MANIFEST_OVERHEAD_KEYS` more for its
    /// own memory; `0`: a 256th of `dram_capacity` in keys (an eighth of it in bytes), at least
    /// 1M. Default: `0`.
    pub max_session_keys: u64,
    /// The cluster's membership store, a Redis URL (`redis://host:port`): the node registers
    /// itself there with a TTL heartbeat and watches the other members (`crate::cluster`); none:
    /// one node. Keys placed on other members are loaded from and stored to them (the peer tier,
    /// `crate::cluster::peer`). Default: none.
    pub cluster: Option<String>,
    /// This node's id in the cluster. Default: `<hostname>:<gRPC port>`.
    pub node_id: Option<String>,
    /// The host (name or IP) other nodes and clients dial this node at, with the listeners'
    /// ports — for listeners on `0.0.0.0` / `::` or behind NAT. Default: the listen address's IP,
    /// or the machine's hostname when that is unspecified.
    pub advertise_host: Option<String>,
    /// Topology labels placement spreads replicas over. Default: none.
    pub rack: Option<String>,
    pub zone: Option<String>,
    /// How long a node that stopped heartbeating (killed, partitioned) stays a member.
    /// Default: `10s`.
    pub cluster_ttl: DurationStr,
    /// What `Info` reports as this node's host (clients use the same-node socket only when it is
    /// their own boot id); set it when the socket is not reachable from where clients run even on
    /// the same kernel (another container without the socket mounted). Default: the boot id.
    pub host_id: Option<String>,
    /// Owners of each block, and nodes holding each parked session, in a cluster (replicas
    /// placed by rendezvous hashing, spread over racks and zones); every node must use the same.
    /// A namespace registered with `replicas` set uses its own instead. With 2 or more, a park
    /// is acknowledged once that many nodes hold the session. Default: `1`.
    pub cluster_rf: usize,
    /// Bound of one request to a peer node, connecting included: past it the peer's keys are
    /// misses (or go to their next replica). Default: `2s`.
    pub peer_timeout: DurationStr,
    /// Whether a block loaded from a peer is kept in this node's DRAM (counted against its cap
    /// like any other block). Default: `true`.
    pub peer_cache: bool,
    /// Requests to peers running at once, over all clients. Default: `64`.
    pub peer_max_inflight: usize,
    /// Hedged peer reads (with `cluster_rf` >= 2): when a replica has not answered a load within
    /// this delay, the keys are also asked of their next replica and the first answer is used.
    /// `"auto"`: the 95th percentile of recent peer loads (so about one in twenty is hedged);
    /// a duration such as `"20ms"`; or `"off"`. Default: `auto`.
    pub peer_hedge: String,
    /// How long a membership change must stay quiet before this node hands the blocks it holds
    /// to their new owners (`crate::cluster::rebalance`): a duration such as `"5s"`, or `"off"`
    /// (moved keys are then found only while reads within ten minutes of the change still ask
    /// their former owners). Default: `30s` (a node restarted within it is one change, not a
    /// departure whose blocks are copied elsewhere and then back).
    pub peer_rebalance: String,
    /// The same wait for a change that only took members away (a graceful stop leaves at once,
    /// a killed node after `cluster_ttl`): a member that comes back within it (a rolling restart)
    /// is handed only what it lacks, and its share is never copied to interim owners and back.
    /// A duration of at most 1h; `peer_rebalance` when that is longer. Default: `5m`.
    pub peer_rebalance_departed: String,
    /// How this node's data plane is reached by its peers: `"tcp"` (the data-plane listener, TLS
    /// when `[tls]` is set) or `"quic"`: a QUIC listener on the same port number over UDP, one
    /// QUIC connection per peer with a stream per pooled connection, and peers dial it. QUIC needs
    /// `[tls]` with `client_ca` (nodes present their node certificates to each other, and a node
    /// without one is refused). Every node of a cluster must use the same. Default: `tcp`.
    pub peer_transport: String,
    /// `WatchEvents` streams open at once on this node, over all callers. Default: `64`.
    pub events_max_watchers: usize,
    /// `WatchEvents` streams one tenant may hold open at once (the operator is bound by
    /// `events_max_watchers` only). Default: `8`.
    pub events_max_watchers_per_tenant: usize,
    /// Events kept for watchers that fall behind; a watcher further behind gets `LAGGED` (and
    /// resyncs with `Lookup` / `RouteHint`). Bounds the memory of events at ~this many batches of
    /// at most 512 keys. Default: `4096`.
    pub events_buffer: usize,
    /// How long a read of a block that only a GPU agent's G1 holds waits for the agent to spill
    /// it into DRAM (see `crate::tiers::agent`); past it the read is a miss. Default: `200ms`.
    pub agent_demand_wait: DurationStr,
    /// Keys of GPU agents' G1 indexed per namespace (over every agent of the node); past it a
    /// reported key is not indexed (`kvtier_agent_index_full_total`). Default: `1048576`.
    pub agent_index_max_keys: usize,
    /// TLS on the gRPC and data-plane listeners, and client certificates (mTLS) as credentials:
    /// a `[tls]` table, see [`TlsConfig`]. The same-node socket and `/metrics` stay plain (local).
    /// Default: none (plain TCP: keep the listeners on loopback or a trusted network).
    pub tls: Option<TlsConfig>,
    /// An existing Redis or Redis Cluster (Valkey too) as a tier shared by every node that names
    /// it: a `[redis_tier]` table, see [`RedisTierConfig`] and `crate::tiers::redis`.
    /// Default: none (off).
    pub redis_tier: Option<RedisTierConfig>,
    /// The GPU agent's settings (`kvtier agent`, the keys of its flags), so that one file
    /// (`--config`, `KVTIER_CONFIG`) can configure a node and its agent: an `[agent]` table,
    /// which `serve` accepts and does not read (the agent checks its keys). Default: none.
    pub agent: Option<toml::Table>,
}

/// The shared Redis tier (`[redis_tier]`): blocks and parked sessions' manifests in an existing
/// Redis deployment, under a byte budget of kvtier's own. Checked by [`RedisTierConfig::validate`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisTierConfig {
    /// One Redis, e.g. `"redis://10.0.0.5:6379/0"` (`rediss://`, `redis+unix://` too). Either this
    /// or `urls`.
    #[serde(default)]
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster (with `cluster = true`); any one of them that answers is
    /// enough to learn the rest.
    #[serde(default)]
    pub urls: Vec<String>,
    /// Whether the deployment is a Redis Cluster (keys hashed to slots over its masters).
    /// Default: `false`.
    #[serde(default)]
    pub cluster: bool,
    /// Hard cap of what this node keeps in Redis (blocks and manifests, with a per-key overhead
    /// estimate): past it, this node deletes its own oldest keys first. Per node: a fleet of N
    /// nodes holds at most N × this. Required.
    pub budget: ByteSize,
    /// How long a block lives in Redis after it was written (a parked session's blocks live at
    /// least as long as the session). Default: `1h`.
    #[serde(default = "default_redis_block_ttl")]
    pub block_ttl: DurationStr,
    /// How much longer than its session a manifest (and its blocks) lives in Redis, so a resume
    /// just before the session's expiry still finds its blocks. Default: `1m`.
    #[serde(default = "default_redis_session_slack")]
    pub session_ttl_slack: DurationStr,
    /// Bound of every Redis call (connecting included): past it a load is a miss and a write is
    /// dropped, counted. Default: `500ms`.
    #[serde(default = "default_redis_timeout")]
    pub timeout: DurationStr,
    /// Prefix of every key, so several fleets (or other users) can share a Redis; no braces (they
    /// would make a Redis Cluster hash tag). Default: `kvtier`.
    #[serde(default = "default_redis_prefix")]
    pub key_prefix: String,
    /// Most payload bytes waiting to be written to Redis; stores past it are not shared (counted
    /// in `kvtier_redis_write_dropped_total`). Default: `256MiB`.
    #[serde(default = "default_redis_write_queue")]
    pub write_queue_bytes: ByteSize,
}

fn default_redis_block_ttl() -> DurationStr {
    DurationStr(Duration::from_secs(3600))
}
fn default_redis_session_slack() -> DurationStr {
    DurationStr(Duration::from_secs(60))
}
fn default_redis_timeout() -> DurationStr {
    DurationStr(Duration::from_millis(500))
}
fn default_redis_prefix() -> String {
    "kvtier".into()
}
fn default_redis_write_queue() -> ByteSize {
    ByteSize(256 << 20)
}

impl RedisTierConfig {
    /// The URLs to connect to: `url`, or the cluster's seeds.
    pub fn seeds(&self) -> Vec<String> {
        self.url.iter().cloned().chain(self.urls.iter().cloned()).collect()
    }

    /// Checks every setting, naming it in the error.
    pub fn validate(&self) -> Result<(), ServerError> {
        let bad = |m: String| Err(ServerError::Config(format!("[redis_tier] {m}")));
        match (&self.url, self.urls.is_empty(), self.cluster) {
            (Some(_), false, _) => return bad("set url (one Redis) or urls (cluster seeds), not both".into()),
            (None, true, _) => {
                return bad("needs url = \"redis://host:port\" (or urls = [...] with cluster = true)".into())
            }
            (None, false, false) if self.urls.len() > 1 => {
                return bad("several urls are the seeds of a Redis Cluster: set cluster = true (or one url)".into())
            }
            _ => {}
        }
        for u in self.seeds() {
            if !(u.starts_with("redis://") || u.starts_with("rediss://") || u.starts_with("redis+unix://")) {
                return bad(format!("{u:?} is not a Redis URL (redis://host:port)"));
            }
            if self.cluster && u.starts_with("redis+unix://") {
                return bad(format!("{u:?}: a Redis Cluster is reached over TCP"));
            }
            if let Err(e) = redis::Client::open(u.as_str()) {
                return bad(format!("{u:?}: {e}"));
            }
        }
        if self.budget.0 < (1 << 20) {
            return bad(format!("budget {} is below the minimum of 1MiB", self.budget));
        }
        if self.block_ttl.0 < Duration::from_secs(1) {
            return bad(format!("block_ttl must be at least 1s, got {}", self.block_ttl));
        }
        if self.session_ttl_slack.0 > Duration::from_secs(24 * 3600) {
            return bad(format!("session_ttl_slack must be at most 24h, got {}", self.session_ttl_slack));
        }
        if self.timeout.0 < Duration::from_millis(1) || self.timeout.0 > Duration::from_secs(60) {
            return bad(format!("timeout must be 1ms..=60s, got {}", self.timeout));
        }
        let p = &self.key_prefix;
        if p.is_empty() || p.len() > 64 || !p.bytes().all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}') {
            return bad(format!("key_prefix {p:?}: 1 to 64 printable characters, no braces"));
        }
        if self.write_queue_bytes.0 < (1 << 20) || self.write_queue_bytes.0 > (u32::MAX as u64) {
            return bad(format!("write_queue_bytes must be 1MiB..4GiB, got {}", self.write_queue_bytes));
        }
        Ok(())
    }
}

/// The node's certificate and key, and how clients' certificates are checked (`[tls]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The node's certificate chain (PEM, leaf first), e.g. from `kvtier cert node`.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates (PEM) that client certificates are verified against; none: clients present
    /// no certificate and authenticate with tokens.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: whether every client must present a certificate it signed (`true`), or may
    /// come with a token only (`false`). Default: `true`. Refused without `client_ca` (nothing
    /// would verify the certificates, and none would be asked for).
    #[serde(default)]
    pub require_client_cert: Option<bool>,
    /// Client-certificate names (DNS or URI subject-alternative names) that act as the operator:
    /// the cluster's other nodes, admin tools. Tenants name theirs in `cert_names`.
    #[serde(default)]
    pub operator_names: Vec<String>,
}

impl TlsConfig {
    /// Whether every client must present a certificate `client_ca` signed.
    pub fn client_certs_required(&self) -> bool {
        self.client_ca.is_some() && self.require_client_cert.unwrap_or(true)
    }
}

/// One tenant: its credentials, its grants and its quotas (`None`: no quota of that kind).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant's name; its namespaces carry it as their `tenant`.
    pub name: String,
    /// Bearer tokens (16..=1024 bytes each) that authenticate as this tenant.
    #[serde(default)]
    pub tokens: Vec<String>,
    /// A file holding one more token (its whole content, surrounding whitespace trimmed).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Client-certificate names (DNS or URI subject-alternative names, exact) that authenticate
    /// as this tenant when the certificate verifies against `tls.client_ca` (mTLS).
    #[serde(default)]
    pub cert_names: Vec<String>,
    /// Tenants whose namespaces this one may read (look up, load, resume, list).
    #[serde(default)]
    pub read: Vec<String>,
    /// Tenants whose namespaces this one may also change (store, park, drop, purge).
    #[serde(default)]
    pub write: Vec<String>,
    /// Most namespaces the tenant may register.
    #[serde(default)]
    pub max_namespaces: Option<u64>,
    /// Most parked sessions the tenant may hold.
    #[serde(default)]
    pub max_sessions: Option<u64>,
    /// Most KV bytes the tenant's parked sessions may pin (token count × bytes per token).
    #[serde(default)]
    pub max_session_bytes: Option<ByteSize>,
    /// Most bytes of the tenant's blocks resident in DRAM; past it, the tenant's own least recently
    /// used blocks make room first.
    #[serde(default)]
    pub dram_bytes: Option<ByteSize>,
    /// Most bytes of the tenant's blocks on disk; past it, its blocks leaving DRAM are dropped
    /// instead of demoted (its parked sessions' blocks still go to disk: `max_session_bytes`
    /// bounds those), so it can't push other tenants' blocks off the disk.
    #[serde(default)]
    pub disk_bytes: Option<ByteSize>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            data_listen: SocketAddr::from(([127, 0, 0, 1], 7071)),
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            data_dir: PathBuf::from("./kvtier-data"),
            dram_capacity: ByteSize(default_dram_capacity()),
            max_pinned_ratio: 0.9,
            max_context_tokens: 1 << 20,
            max_frame_bytes: ByteSize(64 << 20),
            max_blocks_per_request: 4096,
            session_ttl: DurationStr(Duration::from_secs(600)),
            session_max_ttl: DurationStr(Duration::from_secs(24 * 3600)),
            auth_token: None,
            disk_capacity: ByteSize(0),
            disk_segment_bytes: ByteSize(64 << 20),
            disk_codec: "keep".into(),
            session_durability: "fsync".into(),
            dram_region: "anonymous".into(),
            dram_prefault: false,
            cpus: None,
            lease_timeout: DurationStr(Duration::from_secs(30)),
            stall_timeout: DurationStr(Duration::from_secs(30)),
            dataplane_poll: DurationStr(Duration::from_micros(50)),
            idle_timeout: DurationStr(Duration::from_secs(300)),
            metrics_token: None,
            samenode_socket: "auto".into(),
            samenode_max_registered_bytes: ByteSize(0),
            samenode_max_registered_bytes_per_tenant: ByteSize(0),
            grpc_max_buffered_bytes: ByteSize(256 << 20),
            grpc_max_buffered_bytes_per_tenant: ByteSize(0),
            tenants: Vec::new(),
            max_connections: 1024,
            max_connections_per_peer: 256,
            max_connections_per_tenant: 512,
            max_session_keys: 0,
            cluster: None,
            node_id: None,
            advertise_host: None,
            rack: None,
            zone: None,
            cluster_ttl: DurationStr(Duration::from_secs(10)),
            host_id: None,
            cluster_rf: 1,
            peer_timeout: DurationStr(Duration::from_secs(2)),
            peer_cache: true,
            peer_max_inflight: 64,
            peer_hedge: "auto".into(),
            peer_rebalance: "30s".into(),
            peer_rebalance_departed: "5m".into(),
            peer_transport: "tcp".into(),
            events_max_watchers: 64,
            events_max_watchers_per_tenant: 8,
            events_buffer: 4096,
            agent_demand_wait: DurationStr(Duration::from_millis(200)),
            agent_index_max_keys: 1 << 20,
            tls: None,
            redis_tier: None,
            agent: None,
        }
    }
}

/// A quarter of physical memory (from `/proc/meminfo`), at least 64 MiB; 1 GiB where unknown.
pub fn default_dram_capacity() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    match total {
        Some(t) => (t / 4).max(64 << 20),
        None => 1 << 30,
    }
}

impl ServerConfig {
    /// Reads a TOML file over the defaults.
    pub fn from_toml_file(path: &std::path::Path) -> Result<Self, ServerError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ServerError::Config(format!("cannot read config file {}: {e}", path.display())))?;
        Self::from_toml_str(&text).map_err(|e| match e {
            ServerError::Config(m) => ServerError::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    pub fn from_toml_str(text: &str) -> Result<Self, ServerError> {
        toml::from_str(text).map_err(|e| {
            let m = e.to_string();
            // A top-level setting written below a `[[tenants]]` (or any) table belongs to that
            // table in TOML: said, since the message alone lists the table's keys.
            // The top-level keys, as serde lists them for an unknown one.
            let top = toml::from_str::<ServerConfig>("kvtier_no_such_setting = 0").err().map(|e| e.to_string());
            let top_level = m
                .split("unknown field `")
                .nth(1)
                .and_then(|rest| rest.split('`').next())
                .filter(|key| top.as_deref().is_some_and(|t| t.contains(&format!("`{key}`"))));
            match top_level {
                Some(key) => ServerError::Config(format!(
                    "{m}\n`{key}` is a top-level setting: in TOML every key below a [table] or [[table]] header \
                     belongs to that table, so write top-level settings above the first one"
                )),
                None => ServerError::Config(m),
            }
        })
    }

    /// Checks every setting; the server refuses to start on the first problem.
    pub fn validate(&self) -> Result<(), ServerError> {
        let bad = |m: String| Err(ServerError::Config(m));
        if let Some(list) = &self.cpus {
            crate::affinity::parse_cpulist(list)?;
        }
        if self.dram_capacity.0 < (1 << 20) {
            return bad(format!("dram_capacity {} is below the minimum of 1MiB", self.dram_capacity));
        }
        if !(self.max_pinned_ratio > 0.0 && self.max_pinned_ratio <= 1.0) {
            return bad(format!("max_pinned_ratio must be in (0, 1], got {}", self.max_pinned_ratio));
        }
        if self.max_context_tokens == 0 {
            return bad("max_context_tokens must be positive".into());
        }
        if let Some(h) = &self.advertise_host {
            let ipv6 = h.parse::<std::net::Ipv6Addr>().is_ok();
            if h.is_empty() || h.len() > 253 || !h.bytes().all(|b| b.is_ascii_graphic()) || (h.contains(':') && !ipv6) {
                return bad(format!("advertise_host must be a host name or IP address without a port, got {h:?}"));
            }
        }
        if self.max_frame_bytes.0 < 4096 || self.max_frame_bytes.0 > (1 << 32) {
            return bad(format!("max_frame_bytes must be between 4KiB and 4GiB, got {}", self.max_frame_bytes));
        }
        if self.max_blocks_per_request == 0 || self.max_blocks_per_request > 1 << 20 {
            return bad(format!("max_blocks_per_request must be 1..=1048576, got {}", self.max_blocks_per_request));
        }
        if self.session_ttl.0.is_zero() || self.session_ttl.0 > self.session_max_ttl.0 {
            return bad(format!(
                "session_ttl {} must be positive and at most session_max_ttl {}",
                self.session_ttl, self.session_max_ttl
            ));
        }
        if self.dram_region != "anonymous" && self.dram_region != "memfd" {
            return Err(ServerError::Config(format!(
                "dram_region must be \"anonymous\" or \"memfd\", got {:?}",
                self.dram_region
            )));
        }
        if self.idle_timeout.0 < Duration::from_secs(60) {
            tracing::warn!(
                "idle_timeout {} is below the minute after which clients recycle idle connections: \
                 a client's first request after a pause may fail once",
                self.idle_timeout
            );
        }
        for (name, d) in [
            ("lease_timeout", &self.lease_timeout),
            ("stall_timeout", &self.stall_timeout),
            ("idle_timeout", &self.idle_timeout),
        ] {
            if d.0.is_zero() {
                return Err(ServerError::Config(format!("{name} must be above zero")));
            }
        }
        if self.dataplane_poll.0 > Duration::from_millis(10) {
            return bad(format!(
                "dataplane_poll {} is above 10ms: a poll that long only burns a core (0 turns it off)",
                self.dataplane_poll
            ));
        }
        if self.session_durability != "fsync" && self.session_durability != "async" {
            return bad(format!(
                "session_durability must be \"fsync\" or \"async\", got {:?}",
                self.session_durability
            ));
        }
        if self.disk_capacity.0 != 0 && self.disk_capacity.0 < (16 << 20) {
            return bad(format!(
                "disk_capacity {} is below the minimum of 16MiB (0 turns the disk tier off)",
                self.disk_capacity
            ));
        }
        if self.disk_segment_bytes.0 < (1 << 20) {
            return bad(format!(
                "disk_segment_bytes {} is below the minimum of 1MiB (a segment holds many blocks; at most a \
                 quarter of disk_capacity is used)",
                self.disk_segment_bytes
            ));
        }
        if !self.disk_codec.eq_ignore_ascii_case("keep") && CodecId::from_name(&self.disk_codec).is_none() {
            return bad(format!(
                "disk_codec {:?} is not a codec: \"keep\", or one of {}",
                self.disk_codec,
                (0u16..).map(CodecId).take_while(|c| c.is_known()).map(|c| c.name()).collect::<Vec<_>>().join(", ")
            ));
        }
        if !self.disk_codec.eq_ignore_ascii_case("keep") && self.disk_capacity.0 == 0 {
            return bad(format!(
                "disk_codec {} needs a disk tier: set disk_capacity (the codec re-encodes blocks demoted to disk)",
                self.disk_codec
            ));
        }
        if let Some(t) = &self.auth_token {
            if t.len() < 16 || t.len() > kvtier_proto::dataplane::MAX_TOKEN_LEN {
                return bad("auth_token must be 16..=1024 bytes".into());
            }
        }
        crate::tenants::Tenants::from_config(self)?;
        if let Some(url) = &self.cluster {
            if !(url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("redis+unix://")) {
                return bad(format!("cluster must be a Redis URL (redis://host:port), got {url:?}"));
            }
        }
        if self.cluster_ttl.0 < Duration::from_secs(1) {
            return bad(format!("cluster_ttl must be at least 1s, got {}", self.cluster_ttl));
        }
        if !(1..=crate::cluster::placement::MAX_RF).contains(&self.cluster_rf) {
            return bad(format!(
                "cluster_rf must be 1..={}, got {}",
                crate::cluster::placement::MAX_RF,
                self.cluster_rf
            ));
        }
        if self.peer_timeout.0 < Duration::from_millis(10) || self.peer_timeout.0 > Duration::from_secs(600) {
            return bad(format!("peer_timeout must be 10ms..=600s, got {}", self.peer_timeout));
        }
        if let Err(e) = self.peer_hedge() {
            return bad(e);
        }
        if let Err(e) = self.peer_rebalance() {
            return bad(e);
        }
        if let Err(e) = self.peer_rebalance_departed() {
            return bad(e);
        }
        match self.peer_transport.as_str() {
            "tcp" => {}
            "quic" if self.tls.as_ref().is_some_and(|t| t.client_ca.is_some()) => {}
            "quic" => {
                return bad("peer_transport = \"quic\" needs [tls] with client_ca: nodes authenticate each other by \
                            their certificates (kvtier cert ca / kvtier cert node)"
                    .into())
            }
            other => return bad(format!("peer_transport must be \"tcp\" or \"quic\", got {other:?}")),
        }
        if let Some(r) = &self.redis_tier {
            r.validate()?;
        }
        if !(1..=4096).contains(&self.peer_max_inflight) {
            return bad(format!("peer_max_inflight must be 1..=4096, got {}", self.peer_max_inflight));
        }
        if !(1..=65_536).contains(&self.events_max_watchers) || self.events_max_watchers_per_tenant == 0 {
            return bad(format!(
                "events_max_watchers must be 1..=65536 and events_max_watchers_per_tenant at least 1, got {} and {}",
                self.events_max_watchers, self.events_max_watchers_per_tenant
            ));
        }
        if self.agent_demand_wait.0 < Duration::from_millis(1) || self.agent_demand_wait.0 > Duration::from_secs(60) {
            return bad(format!("agent_demand_wait must be 1ms..=60s, got {}", self.agent_demand_wait));
        }
        if !(1..=1 << 26).contains(&self.agent_index_max_keys) {
            return bad(format!("agent_index_max_keys must be 1..=67108864, got {}", self.agent_index_max_keys));
        }
        if !(1..=1 << 20).contains(&self.events_buffer) {
            return bad(format!("events_buffer must be 1..=1048576, got {}", self.events_buffer));
        }
        if self.max_connections == 0 || self.max_connections > 1 << 20 {
            return bad(format!("max_connections must be 1..=1048576, got {}", self.max_connections));
        }
        if self.max_connections_per_tenant == 0 {
            return bad("max_connections_per_tenant must be at least 1".to_string());
        }
        if self.max_connections_per_peer == 0 || self.max_connections_per_peer > self.max_connections {
            return bad(format!(
                "max_connections_per_peer must be 1..=max_connections ({}), got {}",
                self.max_connections, self.max_connections_per_peer
            ));
        }
        let addrs = {
            let mut v = vec![("listen", self.listen), ("data_listen", self.data_listen)];
            v.extend(self.metrics_listen.map(|m| ("metrics_listen", m)));
            v
        };
        if let Some(t) = self.tls.as_ref().filter(|t| t.client_ca.is_none()) {
            if t.require_client_cert == Some(true) {
                return bad("tls.require_client_cert = true needs tls.client_ca: the CA that signs the clients' \
                            certificates (without it no certificate is asked for)"
                    .into());
            }
        }
        // Client certificates a CA must have signed are a credential too.
        let certs_required = self.tls.as_ref().is_some_and(|t| t.client_certs_required());
        for (name, a) in &addrs[..2] {
            if !a.ip().is_loopback() && self.auth_token.is_none() && self.tenants.is_empty() && !certs_required {
                return bad(format!(
                    "{name} {a} is beyond loopback: set auth_token, tenants or required client certificates to expose it"
                ));
            }
        }
        // A metrics_token set is one wherever /metrics listens (16..=1024 bytes, as every token).
        if let Some(t) = &self.metrics_token {
            if !(16..=kvtier_proto::dataplane::MAX_TOKEN_LEN).contains(&t.len()) {
                return bad(format!("metrics_token must be 16..=1024 bytes, got {}", t.len()));
            }
        }
        // `/metrics` is plain HTTP, and none of those reach it: only its own bearer token does.
        if let Some(m) = self.metrics_listen.filter(|m| !m.ip().is_loopback()) {
            let len = self.metrics_token.as_ref().map_or(0, |t| t.len());
            if !(16..=kvtier_proto::dataplane::MAX_TOKEN_LEN).contains(&len) {
                return bad(format!(
                    "metrics_listen {m} is beyond loopback: set metrics_token (16..=1024 bytes; `--metrics-token`, \
                     KVTIER_METRICS_TOKEN) so that /metrics answers only `Authorization: Bearer <metrics_token>`, \
                     or keep metrics_listen on loopback{}",
                    if len > 0 { format!(" (the metrics_token set is {len} bytes)") } else { String::new() }
                ));
            }
        }
        for (i, (n1, a1)) in addrs.iter().enumerate() {
            for (n2, a2) in &addrs[i + 1..] {
                if a1 == a2 && a1.port() != 0 {
                    return bad(format!("{n1} and {n2} are both {a1}"));
                }
            }
        }
        if !matches!(self.samenode_socket.as_str(), "auto" | "off") {
            let n = self.samenode_socket.len();
            if n == 0 || n >= SUN_PATH_MAX {
                return bad(format!(
                    "samenode_socket must be \"auto\", \"off\" or a path of 1..{SUN_PATH_MAX} bytes, got {:?}",
                    self.samenode_socket
                ));
            }
        }
        Ok(())
    }

    /// The limit on keys named by all manifests (see `max_session_keys`).
    pub fn max_session_keys(&self) -> u64 {
        match self.max_session_keys {
            0 => (self.dram_capacity.0 / 256).max(1 << 20),
            n => n,
        }
    }

    /// The limit on bytes of registered same-node buffers (see `samenode_max_registered_bytes`).
    pub fn samenode_max_registered_bytes(&self) -> u64 {
        match self.samenode_max_registered_bytes.0 {
            0 => physical_memory().unwrap_or(64 << 30),
            n => n,
        }
    }

    /// The limit on bytes of registered same-node buffers per tenant (see
    /// `samenode_max_registered_bytes_per_tenant`).
    pub fn samenode_max_registered_bytes_per_tenant(&self) -> u64 {
        match self.samenode_max_registered_bytes_per_tenant.0 {
            0 => self.samenode_max_registered_bytes() / 2,
            n => n,
        }
    }

    /// The node's budget for gRPC request bodies still arriving, and each tenant's share of it
    /// (see `grpc_max_buffered_bytes` and `grpc_max_buffered_bytes_per_tenant`): both hold one
    /// message of the largest size.
    pub fn grpc_body_budget(&self) -> (u64, u64) {
        let least = crate::MAX_GRPC_MESSAGE as u64 + (1 << 20);
        let budget = self.grpc_max_buffered_bytes.0.max(least);
        let share = match self.grpc_max_buffered_bytes_per_tenant.0 {
            0 => budget / 2,
            n => n,
        };
        (budget, share.clamp(least, budget))
    }

    /// When peer loads are hedged (see `peer_hedge`).
    pub fn peer_hedge(&self) -> Result<crate::cluster::Hedge, String> {
        use crate::cluster::Hedge;
        match self.peer_hedge.trim() {
            "auto" => Ok(Hedge::Auto),
            "off" => Ok(Hedge::Off),
            d => match d.parse::<DurationStr>() {
                Ok(DurationStr(after)) if !after.is_zero() => Ok(Hedge::After(after)),
                _ => Err(format!("peer_hedge must be \"auto\", \"off\" or a duration above 0 such as 20ms, got {d:?}")),
            },
        }
    }

    /// How long a membership change stays quiet before blocks are handed to their new owners;
    /// `None` for `off` (see `peer_rebalance`).
    pub fn peer_rebalance(&self) -> Result<Option<Duration>, String> {
        match self.peer_rebalance.trim() {
            "off" => Ok(None),
            d => match d.parse::<DurationStr>() {
                Ok(DurationStr(after)) if after <= Duration::from_secs(3600) => Ok(Some(after)),
                _ => Err(format!("peer_rebalance must be \"off\" or a duration of at most 1h such as 30s, got {d:?}")),
            },
        }
    }

    /// How long a change that only took members away stays quiet before its pass (see
    /// `peer_rebalance_departed`; never shorter than `peer_rebalance`'s wait).
    pub fn peer_rebalance_departed(&self) -> Result<Duration, String> {
        let d = self.peer_rebalance_departed.trim();
        let departed = match d.parse::<DurationStr>() {
            Ok(DurationStr(departed)) if departed <= Duration::from_secs(3600) => departed,
            _ => return Err(format!("peer_rebalance_departed must be a duration of at most 1h such as 5m, got {d:?}")),
        };
        Ok(departed.max(self.peer_rebalance()?.unwrap_or_default()))
    }

    /// The connection limits of the gRPC and data-plane listeners.
    pub fn conn_limits(&self) -> crate::listen::ConnLimits {
        crate::listen::ConnLimits { total: self.max_connections, per_peer: self.max_connections_per_peer }
    }

    /// The codec blocks demoted to disk get, `None` for `keep` (call after [`Self::validate`]).
    pub fn disk_codec_id(&self) -> Option<CodecId> {
        CodecId::from_name(&self.disk_codec).filter(|_| !self.disk_codec.eq_ignore_ascii_case("keep"))
    }

    /// Settings that follow from others: a frame can't be larger than the DRAM tier.
    pub fn normalize(&mut self) {
        self.max_frame_bytes.0 = self.max_frame_bytes.0.min(self.dram_capacity.0);
    }

    /// Creates the data directory and checks it is writable.
    pub fn prepare_data_dir(&self) -> Result<(), ServerError> {
        let dir = &self.data_dir;
        std::fs::create_dir_all(dir)
            .map_err(|e| ServerError::Config(format!("data_dir {}: cannot create: {e}", dir.display())))?;
        if let Ok(st) = rustix::fs::statvfs(dir) {
            let size = st.f_blocks.saturating_mul(st.f_frsize);
            if self.disk_capacity.0 > size {
                // Each demotion then meets a full disk before the tier's own eviction would make
                // room (it evicts at its capacity).
                tracing::warn!(
                    "disk_capacity {} is more than the file system of data_dir {} holds ({} bytes): the disk \
                     tier will fill it and then refuse demotions and parks; set disk_capacity below it",
                    self.disk_capacity,
                    dir.display(),
                    size
                );
            }
        }
        let probe = dir.join(".kvtier-write-probe");
        let wrote = std::fs::write(&probe, b"ok");
        let _ = std::fs::remove_file(&probe);
        match wrote {
            Ok(()) => Ok(()),
            // Full, not unwritable: the node starts (a node that stopped on a full disk must come
            // back), serves from DRAM and what is on disk, and says what fails until room is made.
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => {
                tracing::warn!(
                    "data_dir {} is full: the node starts, but parks and demotions to disk fail until room is \
                     made there",
                    dir.display()
                );
                Ok(())
            }
            Err(e) => Err(ServerError::Config(format!("data_dir {}: not writable: {e}", dir.display()))),
        }
    }

    /// Where the same-node socket goes (absolute), `None` when it is off — or `auto` and
    /// `<data_dir>/kvtier.sock` is too long for a socket path (the caller warns). Call after
    /// [`Self::prepare_data_dir`].
    pub fn samenode_path(&self) -> Option<PathBuf> {
        let path = match self.samenode_socket.as_str() {
            "off" => return None,
            "auto" => self.data_dir.join("kvtier.sock"),
            p => PathBuf::from(p),
        };
        let path = std::path::absolute(&path).unwrap_or(path);
        (path.as_os_str().len() < SUN_PATH_MAX).then_some(path)
    }
}

/// Longest Unix socket path (with its NUL) on Linux.
const SUN_PATH_MAX: usize = 108;

/// The host's physical memory (`MemTotal` in `/proc/meminfo`), if it can be read.
fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A byte count written as `512MiB`, `4GiB`, `1.5G`, `64k` or a plain number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let num: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (try 512MiB or 4GiB)"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            "t" | "tb" | "tib" => 1 << 40,
            other => return Err(format!("unknown size unit {other:?} in {s:?}")),
        };
        let v = num * mult as f64;
        if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
            return Err(format!("size {s:?} is out of range"));
        }
        Ok(ByteSize(v as u64))
    }
}

impl ByteSize {
    /// For people: the exact form where it is short (`64MiB`, `1536KiB`), else about it to two
    /// decimals (`5.89GiB` for a quarter of the host's memory, not `6170943KiB`).
    pub fn approx(&self) -> String {
        let exact = self.to_string();
        if exact.len() <= 8 {
            return exact;
        }
        let v = self.0 as f64;
        // The largest unit the value, to two decimals, is at least one of (1048575KiB is
        // 1024.00MiB to two decimals: 1.00GiB).
        let units = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
        let (shift, unit) = units
            .into_iter()
            .find(|(shift, _)| (v / (1u64 << shift) as f64 * 100.0).round() >= 100.0)
            .unwrap_or((0, "B"));
        format!("{:.2}{unit}", v / (1u64 << shift) as f64)
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.0;
        if v >= 1 << 30 && v.is_multiple_of(1 << 30) {
            write!(f, "{}GiB", v >> 30)
        } else if v >= 1 << 20 && v.is_multiple_of(1 << 20) {
            write!(f, "{}MiB", v >> 20)
        } else if v >= 1 << 10 && v.is_multiple_of(1 << 10) {
            write!(f, "{}KiB", v >> 10)
        } else {
            write!(f, "{v}B")
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// A duration written as `50us`, `500ms`, `30s`, `10m`, `2h` or `1d`, at most [`MAX_DURATION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationStr(pub Duration);

/// The longest duration a setting takes: 100 years. Deadlines are `now + duration`, and a
/// longer one could overflow the clock (a panic on the first request that sets one).
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 86400);

impl std::str::FromStr for DurationStr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a duration (try 30s or 10m)"))?;
        let d = match unit {
            "us" | "µs" => Duration::from_micros(n),
            "ms" => Duration::from_millis(n),
            "" | "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            "d" => Duration::from_secs(n.saturating_mul(86400)),
            other => {
                return Err(format!(
                    "unknown duration unit {:?} in {s:?} (one of us, ms, s, m, h, d, right after the number: 30s, 10m)",
                    other.trim()
                ))
            }
        };
        if d > MAX_DURATION {
            return Err(format!("{s:?} is longer than the longest duration a setting takes (36500d, 100 years)"));
        }
        Ok(DurationStr(d))
    }
}

/// In the largest unit the settings take that divides it (`2d`, `90s`, `250ms`), so a value is
/// echoed as it would be written; anything finer than that as the standard library prints it.
impl std::fmt::Display for DurationStr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = self.0.as_micros();
        if us == 0 && self.0.is_zero() {
            return write!(f, "0s");
        }
        if us == 0 || !self.0.subsec_nanos().is_multiple_of(1000) {
            return write!(f, "{:?}", self.0);
        }
        const UNITS: [(u128, &str); 6] =
            [(86_400_000_000, "d"), (3_600_000_000, "h"), (60_000_000, "m"), (1_000_000, "s"), (1000, "ms"), (1, "us")];
        let (n, unit) = UNITS.iter().find(|(n, _)| us.is_multiple_of(*n)).copied().unwrap_or((1, "us"));
        write!(f, "{}{unit}", us / n)
    }
}

impl<'de> Deserialize<'de> for DurationStr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_up_to_a_hundred_years() {
        assert_eq!("36500d".parse::<DurationStr>(), Ok(DurationStr(MAX_DURATION)));
        assert_eq!("250ms".parse::<DurationStr>(), Ok(DurationStr(Duration::from_millis(250))));
        // Echoed as it would be written, and read back the same.
        for (d, says) in [(172_800_000, "2d"), (5_400_000, "90m"), (90_000, "90s"), (250, "250ms"), (1500, "1500ms")] {
            let d = DurationStr(Duration::from_millis(d));
            assert_eq!(d.to_string(), says);
            assert_eq!(says.parse::<DurationStr>(), Ok(d));
        }
        assert_eq!("50us".parse::<DurationStr>(), Ok(DurationStr(Duration::from_micros(50))));
        assert_eq!("0".parse::<DurationStr>(), Ok(DurationStr(Duration::ZERO)));
        let e = "5min".parse::<DurationStr>().unwrap_err();
        assert!(e.contains("\"min\"") && e.contains("one of us, ms, s, m, h, d"), "{e}");
        let e = "5 minutes".parse::<DurationStr>().unwrap_err();
        assert!(e.contains("unit \"minutes\""), "{e}");
        for bad in ["36501d", "99999999999999d", "18446744073709551615s"] {
            let e = bad.parse::<DurationStr>().unwrap_err();
            assert!(e.contains("longer than the longest duration"), "{bad}: {e}");
        }
        // A server given one from its file refuses to start, saying which setting.
        let e = toml::from_str::<ServerConfig>("lease_timeout = \"99999999999999d\"").unwrap_err().to_string();
        assert!(e.contains("lease_timeout") && e.contains("longest duration"), "{e}");
    }

    /// A tenant's share of the gRPC body budget: half by default, as set otherwise, and always
    /// room for one message of the largest size, never more than the budget.
    #[test]
    fn a_tenant_s_share_of_the_grpc_body_budget_is_set_and_bounded() {
        let least = crate::MAX_GRPC_MESSAGE as u64 + (1 << 20);
        let c = |text: &str| toml::from_str::<ServerConfig>(text).unwrap().grpc_body_budget();
        assert_eq!(c(""), (256 << 20, 128 << 20));
        assert_eq!(
            c("grpc_max_buffered_bytes = \"1GiB\"\ngrpc_max_buffered_bytes_per_tenant = \"100MiB\""),
            (1 << 30, 100 << 20)
        );
        assert_eq!(c("grpc_max_buffered_bytes_per_tenant = \"1MiB\""), (256 << 20, least));
        assert_eq!(c("grpc_max_buffered_bytes_per_tenant = \"1GiB\""), (256 << 20, 256 << 20));
        assert_eq!(c("grpc_max_buffered_bytes = \"1MiB\""), (least, least));
    }

    /// A top-level setting written below a `[[tenants]]` table (where TOML puts it in the table)
    /// is refused saying so, not only with the table's keys; a real unknown key is not.
    #[test]
    fn a_top_level_key_below_a_table_is_refused_with_a_hint() {
        let text = "[[tenants]]\nname = \"a\"\ntokens = [\"token-of-tenant-a-0123\"]\ncluster_rf = 2\n";
        let e = ServerConfig::from_toml_str(text).unwrap_err().to_string();
        assert!(e.contains("unknown field `cluster_rf`") && e.contains("`cluster_rf` is a top-level setting"), "{e}");
        let e = ServerConfig::from_toml_str("dram_capacty = \"1GiB\"").unwrap_err().to_string();
        assert!(e.contains("unknown field `dram_capacty`") && !e.contains("top-level setting"), "{e}");
        let e = ServerConfig::from_toml_str("[[tenants]]\nname = \"a\"\nfoo = 1\n").unwrap_err().to_string();
        assert!(e.contains("unknown field `foo`") && !e.contains("top-level setting"), "{e}");
    }

    /// A disk codec without a disk tier is refused (it was taken silently, and did nothing).
    #[test]
    fn a_disk_codec_without_a_disk_tier_is_refused() {
        let c = ServerConfig::from_toml_str("disk_codec = \"raw+lz4\"").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("disk_codec raw+lz4 needs a disk tier: set disk_capacity"), "{e}");
        let c = ServerConfig::from_toml_str("disk_codec = \"raw+lz4\"\ndisk_capacity = \"64MiB\"").unwrap();
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        assert!(ServerConfig::from_toml_str("disk_codec = \"keep\"").unwrap().validate().is_ok());
    }

    /// Client-certificate settings without the CA that would verify them are refused at start:
    /// before, `require_client_cert = true` alone was taken, and no certificate was asked for.
    #[test]
    fn client_certificate_settings_without_a_client_ca_are_refused() {
        let tls = |extra: &str| format!("[tls]\ncert = \"node.pem\"\nkey = \"node.key\"\n{extra}");
        for (extra, want) in [
            ("require_client_cert = true\n", "tls.require_client_cert = true needs tls.client_ca"),
            ("operator_names = [\"ops\"]\n", "tls.operator_names is set but tls.client_ca is not"),
        ] {
            let c = ServerConfig::from_toml_str(&tls(extra)).unwrap();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
        for extra in ["", "require_client_cert = false\n", "client_ca = \"ca.pem\"\nrequire_client_cert = true\n"] {
            let c = ServerConfig::from_toml_str(&tls(extra)).unwrap();
            assert!(c.validate().is_ok(), "{extra}: {:?}", c.validate());
        }
        let required =
            |extra: &str| ServerConfig::from_toml_str(&tls(extra)).unwrap().tls.unwrap().client_certs_required();
        assert!(required("client_ca = \"ca.pem\"\n"), "required by default where a client CA is set");
        assert!(!required("client_ca = \"ca.pem\"\nrequire_client_cert = false\n"));
        assert!(!required(""), "never without a client CA");
    }

    #[test]
    fn peer_hedge_parses_and_bad_values_are_refused() {
        use crate::cluster::Hedge;
        let mut c = ServerConfig::default();
        assert_eq!(c.peer_hedge(), Ok(Hedge::Auto));
        c.peer_hedge = "off".into();
        assert_eq!(c.peer_hedge(), Ok(Hedge::Off));
        c.peer_hedge = "25ms".into();
        assert_eq!(c.peer_hedge(), Ok(Hedge::After(Duration::from_millis(25))));
        for bad in ["0ms", "soon", ""] {
            c.peer_hedge = bad.into();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("peer_hedge"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn peer_rebalance_parses_and_bad_values_are_refused() {
        let mut c = ServerConfig::default();
        assert_eq!(c.peer_rebalance(), Ok(Some(Duration::from_secs(30))));
        c.peer_rebalance = "off".into();
        assert_eq!(c.peer_rebalance(), Ok(None));
        c.peer_rebalance = "0s".into();
        assert_eq!(c.peer_rebalance(), Ok(Some(Duration::ZERO)));
        for bad in ["2h", "later", ""] {
            c.peer_rebalance = bad.into();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("peer_rebalance"), "{bad:?}: {e}");
        }
        // Departures wait 5 minutes by default, never less than any change.
        let mut c = ServerConfig::default();
        assert_eq!(c.peer_rebalance_departed(), Ok(Duration::from_secs(300)));
        c.peer_rebalance = "10m".into();
        assert_eq!(c.peer_rebalance_departed(), Ok(Duration::from_secs(600)));
        c.peer_rebalance_departed = "1s".into();
        c.peer_rebalance = "off".into();
        assert_eq!(c.peer_rebalance_departed(), Ok(Duration::from_secs(1)));
        for bad in ["2h", "off", "soon"] {
            c.peer_rebalance_departed = bad.into();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("peer_rebalance_departed"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn quic_between_nodes_needs_a_client_ca() {
        let mut c = ServerConfig { peer_transport: "quic".into(), ..ServerConfig::default() };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("client_ca"), "{e}");
        c.peer_transport = "udp".into();
        assert!(c.validate().unwrap_err().to_string().contains("peer_transport"));
    }

    #[test]
    fn sizes_parse() {
        assert_eq!("512MiB".parse::<ByteSize>().unwrap(), ByteSize(512 << 20));
        assert_eq!("4GiB".parse::<ByteSize>().unwrap(), ByteSize(4 << 30));
        assert_eq!("1.5g".parse::<ByteSize>().unwrap(), ByteSize(3 << 29));
        assert_eq!("4096".parse::<ByteSize>().unwrap(), ByteSize(4096));
        assert!("4 parsecs".parse::<ByteSize>().is_err());
        // Said to people: exact where short, else about it.
        assert_eq!(ByteSize(64 << 20).approx(), "64MiB");
        assert_eq!(ByteSize(6170943 << 10).approx(), "5.89GiB");
        assert_eq!(ByteSize(1000).approx(), "1000B");
        assert_eq!(ByteSize((1 << 30) - 1).approx(), "1.00GiB");
        assert_eq!(DurationStr(Duration::ZERO).to_string(), "0s");
        assert!("".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(512 << 20).to_string(), "512MiB");
    }

    #[test]
    fn durations_parse() {
        assert_eq!("10m".parse::<DurationStr>().unwrap().0, Duration::from_secs(600));
        assert_eq!("250ms".parse::<DurationStr>().unwrap().0, Duration::from_millis(250));
        assert!("10 fortnights".parse::<DurationStr>().is_err());
    }

    #[test]
    fn toml_and_validation() {
        let c = ServerConfig::from_toml_str(
            "listen = \"127.0.0.1:0\"\ndata_listen = \"127.0.0.1:0\"\ndram_capacity = \"256MiB\"\nsession_ttl = \"30s\"\n",
        )
        .unwrap();
        assert_eq!(c.dram_capacity, ByteSize(256 << 20));
        c.validate().unwrap();
        let e = ServerConfig::from_toml_str("dram_capacty = \"1GiB\"").unwrap_err();
        assert!(e.to_string().contains("dram_capacty"), "{e}");
        let e = ServerConfig::from_toml_str("dram_capacity = \"lots\"").unwrap_err();
        assert!(e.to_string().contains("lots"), "{e}");
        let mut c = ServerConfig { listen: "0.0.0.0:7070".parse().unwrap(), ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("auth_token"));
        c.auth_token = Some("a-long-enough-shared-secret".into());
        c.validate().unwrap();
        let c = ServerConfig { dram_capacity: ByteSize(1000), ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("dram_capacity"));
        let c = ServerConfig { data_listen: "127.0.0.1:7070".parse().unwrap(), ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("both"));
        let c = ServerConfig::from_toml_str("dram_region = \"memfd\"\nlease_timeout = \"5s\"").unwrap();
        assert_eq!((c.dram_region.as_str(), c.lease_timeout.0), ("memfd", Duration::from_secs(5)));
        c.validate().unwrap();
        let c = ServerConfig::from_toml_str("dram_region = \"hugepages\"").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("dram_region"));
        // A segment that can't hold a block was taken, and every park then failed.
        for small in ["0", "1KiB"] {
            let c = ServerConfig::from_toml_str(&format!("disk_segment_bytes = \"{small}\"")).unwrap();
            assert!(c.validate().unwrap_err().to_string().contains("disk_segment_bytes"), "{small}");
        }
    }

    #[test]
    fn disk_codec_names() {
        assert_eq!(ServerConfig::default().disk_codec_id(), None, "keep by default");
        let c = ServerConfig::from_toml_str("disk_codec = \"nvfp4+had+lz4\"\ndisk_capacity = \"1GiB\"").unwrap();
        c.validate().unwrap();
        assert_eq!(c.disk_codec_id(), Some(CodecId::NVFP4_HAD_LZ4));
        let c = ServerConfig { disk_codec: "lz4".into(), ..Default::default() };
        assert_eq!(c.disk_codec_id(), Some(CodecId::RAW_LZ4));
        let c = ServerConfig { disk_codec: "zstd".into(), ..Default::default() };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("disk_codec \"zstd\"") && e.contains("nvfp4+had+lz4"), "{e}");
    }

    #[test]
    fn redis_tier_is_off_by_default_and_bad_settings_are_named() {
        assert!(ServerConfig::default().redis_tier.is_none());
        let ok = "[redis_tier]\nurl = \"redis://127.0.0.1:6379\"\nbudget = \"1GiB\"\n";
        let c = ServerConfig::from_toml_str(ok).unwrap();
        c.validate().unwrap();
        let r = c.redis_tier.as_ref().unwrap();
        assert_eq!(
            (r.block_ttl.0, r.timeout.0, r.key_prefix.as_str()),
            (Duration::from_secs(3600), Duration::from_millis(500), "kvtier")
        );
        let cluster =
            "[redis_tier]\ncluster = true\nurls = [\"redis://a:7000\", \"redis://b:7000\"]\nbudget = \"1GiB\"\n";
        ServerConfig::from_toml_str(cluster).unwrap().validate().unwrap();
        let bad = |toml: &str, says: &str| {
            let e = match ServerConfig::from_toml_str(toml) {
                Ok(c) => c.validate().unwrap_err().to_string(),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(says), "{toml:?}: {e}");
        };
        bad("[redis_tier]\nurl = \"redis://h:1\"\n", "budget");
        bad("[redis_tier]\nbudget = \"1GiB\"\n", "[redis_tier] needs url");
        bad("[redis_tier]\nurl = \"http://h:1\"\nbudget = \"1GiB\"\n", "not a Redis URL");
        bad("[redis_tier]\nurls = [\"redis://a:1\", \"redis://b:1\"]\nbudget = \"1GiB\"\n", "cluster = true");
        bad("[redis_tier]\nurl = \"redis://h:1\"\nbudget = \"1k\"\n", "budget");
        bad("[redis_tier]\nurl = \"redis://h:1\"\nbudget = \"1GiB\"\nkey_prefix = \"{x}\"\n", "key_prefix");
        bad("[redis_tier]\nurl = \"redis://h:1\"\nbudget = \"1GiB\"\ntimeout = \"0ms\"\n", "timeout");
        bad("[redis_tier]\nurl = \"redis://h:1\"\nbudget = \"1GiB\"\nttl = \"1h\"\n", "ttl");
    }

    /// `/metrics` beyond loopback needs its own token: `auth_token`, tenants and client
    /// certificates guard the gRPC and data planes, not the plain-HTTP `/metrics`.
    #[test]
    fn metrics_beyond_loopback_need_a_metrics_token() {
        let exposed = |token: Option<&str>| ServerConfig {
            metrics_listen: Some("0.0.0.0:19464".parse().unwrap()),
            auth_token: Some("a-long-enough-shared-secret".into()),
            metrics_token: token.map(str::to_string),
            ..ServerConfig::default()
        };
        let e = exposed(None).validate().unwrap_err().to_string();
        assert!(
            e.contains("metrics_listen 0.0.0.0:19464 is beyond loopback") && e.contains("set metrics_token"),
            "{e}"
        );
        assert!(!e.contains("auth_token"), "auth_token does not guard /metrics: {e}");
        let e = exposed(Some("short")).validate().unwrap_err().to_string();
        assert!(e.contains("metrics_token must be 16..=1024 bytes, got 5"), "{e}");
        // On loopback too (it was taken there).
        let short = ServerConfig {
            metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
            metrics_token: Some("short".into()),
            ..ServerConfig::default()
        };
        assert!(short.validate().unwrap_err().to_string().contains("metrics_token must be 16..=1024 bytes"));
        exposed(Some("a-metrics-scrape-secret")).validate().unwrap();
        // Tenants and required client certificates don't stand in for it either.
        let mut c = exposed(None);
        c.auth_token = None;
        c.tenants =
            vec![TenantConfig { name: "t".into(), tokens: vec!["token-of-tenant-t".into()], ..Default::default() }];
        assert!(c.validate().unwrap_err().to_string().contains("set metrics_token"));
        // On loopback /metrics needs nothing; the other listeners still need a credential.
        let c = ServerConfig { metrics_listen: Some("127.0.0.1:0".parse().unwrap()), ..ServerConfig::default() };
        c.validate().unwrap();
        let c = ServerConfig { listen: "0.0.0.0:7070".parse().unwrap(), ..exposed(Some("a-metrics-scrape-secret")) };
        c.validate().unwrap();
        let c = ServerConfig { auth_token: None, ..c };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("listen 0.0.0.0:7070") && e.contains("auth_token"), "{e}");
    }

    /// One file for a node and its GPU agent: `serve` takes (and ignores) an `[agent]` table, and
    /// still refuses unknown keys everywhere else.
    #[test]
    fn an_agent_table_is_accepted_and_unknown_keys_elsewhere_are_not() {
        let shared = "dram_capacity = \"256MiB\"\n\n[agent]\nserver = \"127.0.0.1:7070\"\ndevice = \"host\"\n\
                      host_memory = \"1GiB\"\ngpus = [0, 1]\n";
        let c = ServerConfig::from_toml_str(shared).unwrap();
        c.validate().unwrap();
        assert_eq!(c.dram_capacity, ByteSize(256 << 20));
        assert!(c.agent.as_ref().is_some_and(|t| t.contains_key("host_memory")));
        let e = ServerConfig::from_toml_str(&format!("{shared}\n[agnet]\nserver = \"x\"\n")).unwrap_err();
        assert!(e.to_string().contains("agnet"), "{e}");
        let e = ServerConfig::from_toml_str(&format!("dram_capacty = \"1GiB\"\n{shared}")).unwrap_err();
        assert!(e.to_string().contains("dram_capacty"), "{e}");
        let e = ServerConfig::from_toml_str("agent = \"on\"\n").unwrap_err();
        assert!(e.to_string().contains("agent"), "{e}");
    }

    #[test]
    fn the_data_plane_poll_defaults_to_50us_and_is_at_most_10ms() {
        assert_eq!(ServerConfig::default().dataplane_poll.0, Duration::from_micros(50));
        let off = ServerConfig::from_toml_str("dataplane_poll = \"0\"\n").unwrap();
        off.validate().unwrap();
        assert_eq!(off.dataplane_poll.0, Duration::ZERO);
        ServerConfig::from_toml_str("dataplane_poll = \"10ms\"\n").unwrap().validate().unwrap();
        let e = ServerConfig::from_toml_str("dataplane_poll = \"11ms\"\n").unwrap().validate().unwrap_err();
        assert!(e.to_string().contains("dataplane_poll"), "{e}");
    }
}
