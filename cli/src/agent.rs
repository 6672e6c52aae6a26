//! `kvtier agent`: the GPU agent of a node's devices (one agent for all of them with `--gpus`,
//! or one per GPU). It holds a G1 page pool on each device, serves same-node engines on a Unix socket
//! (`kvtier_agent::engine`), spills the pool's evictions into the node's server (G2) and loads
//! pool misses back from it, both through the server's same-node socket (registered memfd
//! buffers) — [`SameNodeStore`], the agent's `BackingStore`, lives here because kvtier-agent
//! builds without a network client (DESIGN.md). Blocks a load fetched from the server are
//! promoted into G1 unless `--promote-loads false`. `/metrics` shows the pool, the copies, the
//! spills, the promotions and borrowing between devices.
//!
//! One agent can drive several devices: the GPUs of `--gpus 0,1,2,3` (or `all`), or, on the host
//! backend, `--host-devices N` standing in for them. Each has its G1 pool and its engine socket
//! (`<socket>.<ordinal>`), and they borrow pages from each other
//! (`kvtier_agent::pool::NodePool`) over the links `kvtier_agent::pool::find_links` finds: GPUs
//! with peer access, at the rate their timed peer copies show (or `--link-gbps`); host devices,
//! all pairs at the modelled `--link-gbps` (default 100 GB/s).
//!
//! Configuration: flags, their `KVTIER_AGENT_*` environment variables, or an `[agent]` table in
//! the `--config` TOML file (keys as the flags, with `_`: `server`, `socket`, `device`, `gpu`,
//! `gpus`, `host_memory`, `host_devices`, `link_gbps`, `page_bytes`, `pool_capacity`, `pool_fraction`,
//! `promote_loads`, `metrics`, `rdma_device`, `tls_ca`, `tls_cert`, `tls_key`); flags win. A node
//! that runs TLS is reached over TLS with `--tls-ca` (and the agent's certificate where the node
//! takes certificates: its same-node connections then present single-use tickets).
//!
//! With `--rdma-device`, spills go into leased slots of the server's DRAM as one-sided RDMA
//! writes (`crate::lease_lane`; the server registers its arena with `serve --rdma-device`), and
//! over the same-node socket for whatever the lane can't place.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use kvtier_agent::engine::{Agent, AgentConfig, BackingStore, EngineServer};
use kvtier_agent::pool::{find_links, Capacity, FoundLinks, LinkRate, NodeLink, PoolChange, Spill};
use kvtier_agent::{AgentError, Device, HostDevice};
use kvtier_client::{ClientConfig, KvClient, NamespaceHandle, SameNode, SharedBuffer};
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::{BlockKey, CodecId, Namespace, NamespaceId};
use kvtier_server::config::ByteSize;

use crate::lease_lane::LeaseLane;

/// Bytes one same-node exchange with the server moves at most (the store's shared buffer, in
/// whole blocks, at least one).
const STORE_BUFFER_BYTES: usize = 64 << 20;

/// The smallest `--page-bytes` taken (a block of one layer, one head of 16, fp16, 1 token, K and V
/// is 64 bytes).
const MIN_PAGE_BYTES: u64 = 64;

/// The host backend's modelled link between two host devices (without --link-gbps): 100 GB/s.
const HOST_LINK_BYTES_PER_SEC: u64 = 100_000_000_000;

/// The peer copies that rate a link between two GPUs at start: 64 MiB each way, long enough
/// beside the copies' fixed cost even over NVLink.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const LINK_PROBE_BYTES: usize = 64 << 20;

#[derive(Args)]
pub struct AgentArgs {
    /// TOML file with an `[agent]` table; flags and environment variables override it.
    #[arg(long, env = "KVTIER_CONFIG")]
    config: Option<PathBuf>,
    /// The node's server (gRPC address); the agent reaches its same-node socket from there.
    #[arg(long, env = "KVTIER_AGENT_SERVER")]
    server: Option<String>,
    #[arg(long, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// TLS to the server; with a client certificate, same-node connections present tickets.
    #[command(flatten)]
    tls: crate::TlsArgs,
    /// The engine socket this agent listens on. Default: `kvtier-agent.sock` in the current
    /// directory.
    #[arg(long, env = "KVTIER_AGENT_SOCKET")]
    socket: Option<PathBuf>,
    /// `host` (RAM stands in for HBM) or `cuda`.
    #[arg(long, env = "KVTIER_AGENT_DEVICE")]
    device: Option<String>,
    /// The GPU's ordinal (cuda), or the host device's number. Default: 0.
    #[arg(long, env = "KVTIER_AGENT_GPU")]
    gpu: Option<u32>,
    /// The GPUs this agent drives (cuda): ordinals such as `0,1,2,3`, or `all` (every GPU the
    /// driver reports). Engines of GPU N use `<socket>.N`. Instead of --gpu.
    #[arg(long, env = "KVTIER_AGENT_GPUS")]
    gpus: Option<String>,
    /// The host backend's "device memory" (of each host device). Default: 1GiB.
    #[arg(long, env = "KVTIER_AGENT_HOST_MEMORY")]
    host_memory: Option<ByteSize>,
    /// Host devices on this node (numbered from --gpu), each with its G1 pool, borrowing pages
    /// from each other over a modelled link; engines of device N use `<socket>.N`. Host backend
    /// only. Default: 1.
    #[arg(long, env = "KVTIER_AGENT_HOST_DEVICES")]
    host_devices: Option<u32>,
    /// The link between every pair of devices with peer access, in GB/s (10^9 bytes): borrowing
    /// stops at 30% of it. Default: GPUs, measured at start by timed peer copies; host devices
    /// (a modelled link), 100.
    #[arg(long, env = "KVTIER_AGENT_LINK_GBPS", allow_negative_numbers = true)]
    link_gbps: Option<f64>,
    /// Bytes of one block (the engines' layout): the G1 page size.
    #[arg(long, env = "KVTIER_AGENT_PAGE_BYTES")]
    page_bytes: Option<ByteSize>,
    /// G1 capacity in bytes (overrides --pool-fraction).
    #[arg(long, env = "KVTIER_AGENT_POOL_CAPACITY")]
    pool_capacity: Option<ByteSize>,
    /// G1 capacity as a fraction of the device's free memory. Default: 0.2.
    #[arg(long, env = "KVTIER_AGENT_POOL_FRACTION")]
    pool_fraction: Option<f64>,
    /// Promote blocks an engine's load fetched from the server into G1 (`true` or `false`), so
    /// the next load of them is a G1 hit. Default: true.
    #[arg(long, env = "KVTIER_AGENT_PROMOTE_LOADS")]
    promote_loads: Option<bool>,
    /// Prometheus /metrics address.
    #[arg(long, env = "KVTIER_AGENT_METRICS")]
    metrics: Option<std::net::SocketAddr>,
    /// Spill into leased slots of the server's DRAM with one-sided writes through this RDMA
    /// device (`any`: the first; the server needs `--rdma-device` too). Needs the `rdma` build
    /// feature. Default: spills go over the same-node socket.
    #[arg(long, env = "KVTIER_AGENT_RDMA_DEVICE")]
    rdma_device: Option<String>,
    #[arg(long, env = "KVTIER_LOG", default_value = "info")]
    log: String,
}

/// Settings after the file, the environment and the flags.
struct Settings {
    server: String,
    /// The credential the agent presents to the server.
    auth_token: Option<String>,
    /// TLS to the server (`--tls-ca`, with the agent's certificate where given).
    tls: Option<kvtier_client::ClientTls>,
    socket: PathBuf,
    device: String,
    gpus: DeviceSelection,
    host_memory: u64,
    host_devices: u32,
    /// None: measured (GPUs) or the model's 100 GB/s (host devices).
    link_bytes_per_sec: Option<u64>,
    page_bytes: u64,
    capacity: Capacity,
    promote_loads: bool,
    metrics: Option<std::net::SocketAddr>,
    rdma_device: Option<String>,
}

/// The devices an agent drives: one (`--gpu`; on the host backend the first of its
/// `--host-devices`), or a list of GPUs (`--gpus`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum DeviceSelection {
    One(u32),
    Listed(Vec<u32>),
    /// Every GPU the driver reports.
    All,
}

impl std::str::FromStr for DeviceSelection {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        if s.trim() == "all" {
            return Ok(DeviceSelection::All);
        }
        let mut list = Vec::new();
        for part in s.split(',') {
            let o: u32 = part.trim().parse().with_context(|| format!("--gpus {s:?}: {part:?} is not a GPU ordinal"))?;
            if list.contains(&o) {
                bail!("--gpus {s:?}: GPU {o} is listed twice");
            }
            list.push(o);
        }
        if list.len() > 64 {
            bail!("--gpus {s:?}: at most 64 GPUs");
        }
        Ok(DeviceSelection::Listed(list))
    }
}

impl DeviceSelection {
    /// Whether each device's engine socket is `<socket>.<ordinal>` (a list, whatever its length,
    /// so the names don't depend on how many GPUs a machine has), or `--socket` itself.
    fn suffixed(&self, host_devices: u32) -> bool {
        !matches!(self, DeviceSelection::One(_)) || host_devices > 1
    }
}

fn settings(a: &AgentArgs) -> anyhow::Result<Settings> {
    // The `[agent]` table, and the file's top-level `auth_token` (the node's own, as `serve`
    // reads it from the same file).
    let (table, node_token) = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let doc: toml::Table = text.parse().with_context(|| format!("parsing {}", p.display()))?;
            let node_token = match doc.get("auth_token") {
                None => None,
                Some(toml::Value::String(t)) => Some(t.clone()),
                Some(_) => bail!("{}: `auth_token` must be a string", p.display()),
            };
            let table = match doc.get("agent") {
                Some(toml::Value::Table(t)) => t.clone(),
                Some(_) => bail!("{}: `agent` must be a table", p.display()),
                None => toml::Table::new(),
            };
            (table, node_token)
        }
        None => (toml::Table::new(), None),
    };
    let known = [
        "server",
        "socket",
        "device",
        "gpu",
        "gpus",
        "host_memory",
        "host_devices",
        "link_gbps",
        "page_bytes",
        "pool_capacity",
        "pool_fraction",
        "promote_loads",
        "metrics",
        "rdma_device",
        "auth_token",
        "tls_ca",
        "tls_cert",
        "tls_key",
    ];
    if let Some(k) = table.keys().find(|k| !known.contains(&k.as_str())) {
        bail!("[agent]: unknown key {k:?} (known: {})", known.join(", "));
    }
    let text = |k: &str| -> anyhow::Result<Option<String>> {
        match table.get(k) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(toml::Value::Integer(i)) => Ok(Some(i.to_string())),
            Some(toml::Value::Float(f)) => Ok(Some(f.to_string())),
            Some(toml::Value::Boolean(b)) => Ok(Some(b.to_string())),
            Some(v) => bail!("[agent] {k}: expected a string or a number, got {v}"),
        }
    };
    let bytes = |flag: Option<ByteSize>, k: &str| -> anyhow::Result<Option<u64>> {
        match flag {
            Some(b) => Ok(Some(b.0)),
            None => text(k)?
                .map(|s| s.parse::<ByteSize>().map(|b| b.0).map_err(|e| anyhow::anyhow!("[agent] {k}: {e}")))
                .transpose(),
        }
    };
    let server = a.server.clone().or(text("server")?).unwrap_or_else(|| "127.0.0.1:7070".into());
    let socket = a.socket.clone().or(text("socket")?.map(PathBuf::from)).unwrap_or_else(|| "kvtier-agent.sock".into());
    let device = a.device.clone().or(text("device")?).unwrap_or_else(|| "host".into());
    if !matches!(device.as_str(), "host" | "cuda") {
        bail!("--device must be host or cuda, got {device:?}");
    }
    // `--gpu` and `--gpus` (flags or their variables) win over the file's `gpu` and `gpus`
    // together; both at one level is a mistake.
    let (gpu, gpus) = if a.gpu.is_some() || a.gpus.is_some() {
        (a.gpu, a.gpus.clone())
    } else {
        let gpu = text("gpu")?.map(|s| s.parse::<u32>()).transpose().context("[agent] gpu")?;
        let gpus = match table.get("gpus") {
            // `gpus = [0, 1]`, the natural TOML, as well as `gpus = "0,1"` or `"all"`.
            Some(toml::Value::Array(list)) => Some(
                list.iter()
                    .map(|v| v.as_integer().map(|i| i.to_string()).context("[agent] gpus: a list of GPU ordinals"))
                    .collect::<anyhow::Result<Vec<_>>>()?
                    .join(","),
            ),
            _ => text("gpus")?,
        };
        (gpu, gpus)
    };
    let gpus = match (gpus, gpu) {
        (Some(_), Some(_)) => bail!("give --gpu or --gpus, not both"),
        (Some(list), None) => {
            if device != "cuda" {
                bail!("--gpus is for --device cuda (host devices: --host-devices N, numbered from --gpu)");
            }
            list.parse::<DeviceSelection>()?
        }
        (None, g) => DeviceSelection::One(g.unwrap_or(0)),
    };
    let host_memory = bytes(a.host_memory, "host_memory")?.unwrap_or(1 << 30);
    let host_devices = match a.host_devices {
        Some(n) => n,
        None => text("host_devices")?.map(|s| s.parse()).transpose().context("[agent] host_devices")?.unwrap_or(1),
    };
    if !(1..=64).contains(&host_devices) {
        bail!("--host-devices must be 1..=64, got {host_devices}");
    }
    if host_devices > 1 && device != "host" {
        bail!("--host-devices is for the host backend (--device host); GPUs: --gpus 0,1,.. or all");
    }
    let link_gbps = match a.link_gbps {
        Some(g) => Some(g),
        None => text("link_gbps")?.map(|s| s.parse::<f64>()).transpose().context("[agent] link_gbps")?,
    };
    if let Some(g) = link_gbps {
        if !(g.is_finite() && g > 0.0 && g <= 1e6) {
            bail!("--link-gbps must be above 0 and at most 1000000 GB/s, got {g}");
        }
    }
    let link_bytes_per_sec = link_gbps.map(|g| ((g * 1e9) as u64).max(1));
    let Some(page_bytes) = bytes(a.page_bytes, "page_bytes")? else {
        bail!("--page-bytes is required: the bytes of one block of the engines' layout");
    };
    // A block is layers x 2 (K, V) x heads x head_dim x element bytes x tokens: even, and far
    // above a few bytes; a page of 0 or 7 bytes is a mistyped size, not a layout.
    if page_bytes < MIN_PAGE_BYTES || !page_bytes.is_multiple_of(2) {
        bail!(
            "--page-bytes {page_bytes}: one block of the engines' layout (layers x 2 x kv heads x head dim x \
             element bytes x tokens per block), an even number of at least {MIN_PAGE_BYTES} bytes"
        );
    }
    let fraction = match a.pool_fraction {
        Some(f) => Some(f),
        None => text("pool_fraction")?.map(|s| s.parse::<f64>()).transpose().context("[agent] pool_fraction")?,
    };
    if let Some(f) = fraction.filter(|f| !(*f > 0.0 && *f <= 1.0)) {
        bail!(
            "--pool-fraction must be above 0 and at most 1, got {f} (the share of the device's free memory G1 takes)"
        );
    }
    let capacity = match (bytes(a.pool_capacity, "pool_capacity")?, fraction) {
        (Some(b), _) => Capacity::Bytes(usize::try_from(b).context("pool capacity")?),
        (None, Some(f)) => Capacity::FractionOfFree(f),
        (None, None) => Capacity::FractionOfFree(0.2),
    };
    let promote_loads = match a.promote_loads {
        Some(p) => p,
        None => text("promote_loads")?
            .map(|s| s.parse::<bool>())
            .transpose()
            .context("[agent] promote_loads: expected true or false")?
            .unwrap_or(true),
    };
    let metrics = match a.metrics {
        Some(m) => Some(m),
        None => text("metrics")?.map(|s| s.parse()).transpose().context("[agent] metrics")?,
    };
    // The agent's /metrics has no token of its own (the node's needs `metrics_token` there).
    if let Some(m) = metrics.filter(|m: &std::net::SocketAddr| !m.ip().is_loopback()) {
        bail!("metrics {m} is beyond loopback: the agent's /metrics takes no token; keep it on loopback");
    }
    let rdma_device = a.rdma_device.clone().or(text("rdma_device")?);
    // The flag (or KVTIER_AUTH_TOKEN), then `[agent] auth_token`, then the file's own.
    let auth_token = a.auth_token.clone().or(text("auth_token")?).or(node_token);
    // Each of the three from its flag (or variable), else `[agent]`.
    let path = |flag: &Option<PathBuf>, k: &str| -> anyhow::Result<Option<PathBuf>> {
        Ok(flag.clone().or(text(k)?.map(PathBuf::from)))
    };
    let tls = crate::TlsArgs {
        tls_ca: path(&a.tls.tls_ca, "tls_ca")?,
        tls_cert: path(&a.tls.tls_cert, "tls_cert")?,
        tls_key: path(&a.tls.tls_key, "tls_key")?,
    }
    .client_tls()?;
    Ok(Settings {
        auth_token,
        tls,
        server,
        socket,
        device,
        gpus,
        host_memory,
        host_devices,
        link_bytes_per_sec,
        page_bytes,
        capacity,
        promote_loads,
        metrics,
        rdma_device,
    })
}

/// G2 through the server's same-node socket: spills are stores from a shared buffer, fetches
/// are loads into it. One connection, one exchange at a time; a broken connection is reopened
/// on the next call.
#[derive(Clone)]
pub struct SameNodeStore {
    inner: Arc<StoreInner>,
}

struct StoreInner {
    rt: tokio::runtime::Handle,
    client: KvClient,
    link: Mutex<Link>,
    /// Spills as one-sided writes into leased slots (`--rdma-device`), shared by every link of
    /// the agent; `None` without one, or once it failed (spills then take `link`).
    lane: Arc<Mutex<Option<LeaseLane>>>,
    /// Shared by every link of the agent ([`SameNodeStore::another_link`]).
    namespaces: Arc<Mutex<HashMap<NamespaceId, NamespaceHandle>>>,
}

struct Link {
    near: SameNode,
    buf: SharedBuffer,
    block_bytes: usize,
}

fn chunk_blocks(block_bytes: usize) -> usize {
    (STORE_BUFFER_BYTES / block_bytes.max(1)).max(1)
}

impl SameNodeStore {
    async fn connect(client: KvClient, block_bytes: usize, lane: Option<LeaseLane>) -> anyhow::Result<Self> {
        let near = client
            .samenode()
            .await
            .context("the server's same-node socket (the agent must run on the server's host)")?;
        let buf = SharedBuffer::new(block_bytes * chunk_blocks(block_bytes))?;
        Ok(SameNodeStore {
            inner: Arc::new(StoreInner {
                rt: tokio::runtime::Handle::current(),
                client,
                link: Mutex::new(Link { near, buf, block_bytes }),
                lane: Arc::new(Mutex::new(lane)),
                namespaces: Arc::new(Mutex::new(HashMap::new())),
            }),
        })
    }

    /// The same store over a connection of its own (the namespaces opened are shared): spills
    /// the server asks for go through it, so they never queue behind a G2 fetch whose server
    /// side waits on them.
    async fn another_link(&self) -> anyhow::Result<Self> {
        let block_bytes = self.inner.link.lock().map_err(|_| anyhow::anyhow!("store link poisoned"))?.block_bytes;
        let client = self.inner.client.clone();
        let near = client.samenode().await.context("a second same-node connection")?;
        let buf = SharedBuffer::new(block_bytes)?;
        Ok(SameNodeStore {
            inner: Arc::new(StoreInner {
                rt: tokio::runtime::Handle::current(),
                client,
                link: Mutex::new(Link { near, buf, block_bytes }),
                lane: self.inner.lane.clone(),
                namespaces: self.inner.namespaces.clone(),
            }),
        })
    }

    /// The namespaces engines opened through this agent.
    fn namespace_ids(&self) -> Vec<NamespaceId> {
        let m = self.inner.namespaces.lock().unwrap_or_else(|p| p.into_inner());
        m.keys().copied().collect()
    }

    fn client(&self) -> &KvClient {
        &self.inner.client
    }

    fn handle(&self, ns: &NamespaceId) -> kvtier_agent::Result<NamespaceHandle> {
        let map = self.inner.namespaces.lock().map_err(|_| AgentError::Spill("namespace map poisoned".into()))?;
        map.get(ns).cloned().ok_or_else(|| AgentError::Spill("namespace not opened with the server".into()))
    }

    /// Registers namespace `ns` with the server again (it answered that it does not know it: it
    /// restarted without its registrations, a node without a disk tier) and keeps the new handle.
    async fn register_again(&self, ns: &NamespaceId) -> kvtier_agent::Result<NamespaceHandle> {
        let spec = self.handle(ns)?.namespace;
        let h = self
            .inner
            .client
            .register(spec)
            .await
            .map_err(|e| AgentError::Spill(format!("registering the namespace with the server again: {e}")))?;
        self.inner
            .namespaces
            .lock()
            .map_err(|_| AgentError::Spill("namespace map poisoned".into()))?
            .insert(*ns, h.clone());
        metrics::counter!("kvtier_agent_namespaces_registered_again_total").increment(1);
        tracing::info!("the server did not know a namespace engines opened (it restarted?): registered it again");
        Ok(h)
    }

    /// One spill over the same-node socket: the server's answer for the block.
    fn spill_over_link(&self, h: &NamespaceHandle, key: &BlockKey, payload: &[u8]) -> kvtier_agent::Result<ItemStatus> {
        let status = self.with_link(async |l: &mut Link| {
            if payload.len() != l.block_bytes {
                return Err(kvtier_client::ClientError::InvalidArgument(format!(
                    "a {}-byte block; the store's blocks are {}",
                    payload.len(),
                    l.block_bytes
                )));
            }
            l.buf.as_mut_slice()[..payload.len()].copy_from_slice(payload);
            l.near.store_from_buffer(h, &[*key], &l.buf, &[0]).await
        })?;
        status.first().copied().ok_or_else(|| AgentError::Spill("the server answered for no block".into()))
    }

    /// Runs `f` on the lease lane, if the agent has one; `None` without a lane, or when it
    /// failed: the lane is then closed (logged once) and later calls go over the same-node socket.
    /// The lane's lock is held only for `f`, so the caller's same-node fallback (a load there may
    /// wait on a demand spill, which takes the lane) runs without it.
    fn on_lane<T>(&self, f: impl AsyncFnOnce(&mut LeaseLane) -> kvtier_agent::Result<T>) -> Option<T> {
        let mut slot = self.inner.lane.lock().ok()?;
        let lane = slot.as_mut()?;
        match self.inner.rt.block_on(f(lane)) {
            Ok(v) => Some(v),
            Err(e) => {
                metrics::counter!("kvtier_agent_lease_lane_failures_total").increment(1);
                tracing::warn!("the lease lane failed ({e}); blocks move over the same-node socket from now on");
                *slot = None;
                None
            }
        }
    }

    /// Runs `f` on the link, reopening a connection that broke earlier. Called on the agent's
    /// connection threads (never on a runtime thread: `block_on` there would panic), so blocking
    /// on the runtime is fine; bounded by the client's request timeout.
    fn with_link<T>(
        &self,
        f: impl AsyncFnOnce(&mut Link) -> Result<T, kvtier_client::ClientError>,
    ) -> kvtier_agent::Result<T> {
        let mut link = self.inner.link.lock().map_err(|_| AgentError::Spill("store link poisoned".into()))?;
        self.inner.rt.block_on(async {
            if !link.near.is_usable() {
                link.near = self.inner.client.samenode().await.map_err(|e| AgentError::Spill(e.to_string()))?;
            }
            f(&mut link).await.map_err(|e| AgentError::Spill(e.to_string()))
        })
    }
}

impl Spill for SameNodeStore {
    fn spill(&self, ns: &NamespaceId, key: &BlockKey, codec: CodecId, payload: &[u8]) -> kvtier_agent::Result<()> {
        if codec != CodecId::RAW {
            return Err(AgentError::Spill(format!("the same-node store takes raw blocks, not {}", codec.name())));
        }
        let h = self.handle(ns)?;
        if let Some(placed) = self.on_lane(async |l| l.spill(&h, key, payload).await) {
            let outcome = if placed { "placed" } else { "refused" };
            metrics::counter!("kvtier_agent_lease_spills_total", "outcome" => outcome).increment(1);
            if placed {
                return Ok(());
            }
        }
        // A connection the server's restart broke fails once (and is reopened by the next
        // call), and a server that restarted without its registrations does not know the
        // namespace: each is tried again once, so a restart costs no block.
        let status = match self.spill_over_link(&h, key, payload) {
            Err(_) => self.spill_over_link(&h, key, payload),
            done => done,
        };
        let status = match status {
            Ok(ItemStatus::UnknownNamespace) => {
                let h = self.inner.rt.block_on(self.register_again(ns))?;
                self.spill_over_link(&h, key, payload)
            }
            other => other,
        };
        match status {
            Ok(ItemStatus::Ok | ItemStatus::Present) => Ok(()),
            Ok(other) => Err(spill_failed(format!("the server refused the block: {other:?}"))),
            Err(e) => Err(spill_failed(e.to_string())),
        }
    }
}

/// A spill that failed: said in the log (at most once every 10 s, the rest counted by the
/// agent), so a store that refuses every block is not silent.
fn spill_failed(why: String) -> AgentError {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let last = LAST.load(std::sync::atomic::Ordering::Relaxed);
    if now >= last + 10
        && LAST
            .compare_exchange(last, now, std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!("a block could not be spilled into the server: {why}");
    }
    AgentError::Spill(why)
}

impl BackingStore for SameNodeStore {
    fn open_namespace(&self, ns: &Namespace) -> kvtier_agent::Result<()> {
        let id = ns.id();
        if self.handle(&id).is_ok() {
            return Ok(());
        }
        let h = match self.inner.rt.block_on(self.inner.client.register(ns.clone())) {
            Ok(h) => h,
            // The server is down or restarting: engines use G1 meanwhile; the namespace is
            // registered when a spill or the demand stream meets the server again.
            Err(
                e @ (kvtier_client::ClientError::Io(_)
                | kvtier_client::ClientError::Connect { .. }
                | kvtier_client::ClientError::Timeout(_)),
            ) => {
                tracing::warn!(
                    "the server can't be reached ({e}): the namespace is served from G1 and registered once it is back"
                );
                metrics::counter!("kvtier_agent_namespaces_opened_offline_total").increment(1);
                kvtier_client::NamespaceHandle::unregistered(ns.clone())
                    .map_err(|e| AgentError::Spill(format!("the namespace: {e}")))?
            }
            Err(e) => return Err(AgentError::Spill(format!("registering the namespace with the server: {e}"))),
        };
        self.inner.namespaces.lock().map_err(|_| AgentError::Spill("namespace map poisoned".into()))?.insert(id, h);
        Ok(())
    }

    fn fetch(
        &self,
        ns: &NamespaceId,
        keys: &[BlockKey],
        block_bytes: usize,
        out: &mut [u8],
    ) -> kvtier_agent::Result<Vec<bool>> {
        let h = self.handle(ns)?;
        let mut found = match self.on_lane(async |l| l.fetch(&h, keys, block_bytes, out).await) {
            Some(landed) => {
                let n = landed.iter().filter(|l| **l).count() as u64;
                metrics::counter!("kvtier_agent_lease_fetches_total").increment(n);
                landed
            }
            None => vec![false; keys.len()],
        };
        // What the lane didn't land, over the same-node socket, a buffer's worth at a time.
        let rest: Vec<usize> = (0..keys.len()).filter(|&i| !found[i]).collect();
        for chunk in rest.chunks(chunk_blocks(block_bytes)) {
            let chunk_keys: Vec<BlockKey> = chunk.iter().map(|&i| keys[i]).collect();
            let offsets: Vec<u64> = (0..chunk.len() as u64).map(|j| j * block_bytes as u64).collect();
            let got = self.with_link(async |l: &mut Link| {
                let landed = l.near.load_into_buffer(&h, &chunk_keys, &mut l.buf, &offsets, false).await?;
                for (j, &i) in chunk.iter().enumerate() {
                    out[i * block_bytes..(i + 1) * block_bytes]
                        .copy_from_slice(&l.buf.as_slice()[j * block_bytes..(j + 1) * block_bytes]);
                }
                Ok(landed)
            })?;
            for (j, &i) in chunk.iter().enumerate() {
                found[i] = got.get(j).copied().unwrap_or(false);
            }
        }
        Ok(found)
    }
}

pub async fn run(a: AgentArgs) -> anyhow::Result<()> {
    crate::init_logging(&a.log)?;
    // Checked before connecting; a value from the environment is said to be.
    let s = settings(&a).map_err(crate::with_env_source)?;
    let page_bytes = usize::try_from(s.page_bytes).context("--page-bytes")?;
    let cfg = ClientConfig { auth_token: s.auth_token.clone(), tls: s.tls.clone(), ..Default::default() };
    let client =
        KvClient::connect(&s.server, cfg).await.with_context(|| format!("connecting to the server at {}", s.server))?;
    let lane = match &s.rdma_device {
        Some(device) => Some(lease_lane(&client, device, page_bytes).await?),
        None => None,
    };
    let store = SameNodeStore::connect(client, page_bytes, lane).await?;
    let demand_store = store.another_link().await?;
    let mut config = AgentConfig::new(page_bytes);
    config.capacity = s.capacity;
    config.promote_loads = s.promote_loads;
    match s.device.as_str() {
        "host" => {
            let mem = usize::try_from(s.host_memory)?;
            // `--gpus` is refused for the host backend: its devices are numbered from `--gpu`.
            let DeviceSelection::One(first) = s.gpus else { bail!("--gpus is for --device cuda") };
            let last = first.checked_add(s.host_devices - 1).context("--gpu + --host-devices overflow")?;
            let devices: Vec<Arc<HostDevice>> = (first..=last).map(|o| Arc::new(HostDevice::new(o, mem))).collect();
            let rate = LinkRate::Fixed(s.link_bytes_per_sec.unwrap_or(HOST_LINK_BYTES_PER_SEC));
            let links = find_links(&devices, rate).context("linking the host devices")?;
            log_links(&links, "modelled");
            serve_devices(devices, &links.links, [store, demand_store], config, &s).await
        }
        _ => cuda([store, demand_store], config, &s).await,
    }
}

/// The lease lane over the RDMA device `device` (`--rdma-device`).
#[cfg(feature = "rdma")]
async fn lease_lane(client: &KvClient, device: &str, page_bytes: usize) -> anyhow::Result<LeaseLane> {
    let writer = crate::lease_lane::rdma::RdmaWriter::open(device, page_bytes)
        .with_context(|| format!("--rdma-device {device} (start without it to spill over the same-node socket)"))?;
    LeaseLane::connect(client, Box::new(writer)).await.context("connecting the lease lane to the server's fabric")
}

#[cfg(not(feature = "rdma"))]
async fn lease_lane(_client: &KvClient, device: &str, _page_bytes: usize) -> anyhow::Result<LeaseLane> {
    bail!("--rdma-device {device}: this kvtier was built without the `rdma` feature (cargo build --features rdma)")
}

#[cfg(feature = "cuda")]
async fn cuda(stores: [SameNodeStore; 2], config: AgentConfig, s: &Settings) -> anyhow::Result<()> {
    use kvtier_agent::CudaDevice;
    let ordinals = match &s.gpus {
        DeviceSelection::One(g) => vec![*g],
        DeviceSelection::Listed(l) => l.clone(),
        DeviceSelection::All => {
            let n = CudaDevice::count().context("--gpus all: counting the GPUs")?;
            if n == 0 {
                bail!("--gpus all: the CUDA driver reports no GPU");
            }
            (0..n).collect()
        }
    };
    let devices = ordinals
        .iter()
        .map(|&o| CudaDevice::new(o).map(Arc::new).with_context(|| format!("opening GPU {o}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let rate = match s.link_bytes_per_sec {
        Some(r) => LinkRate::Fixed(r),
        None => LinkRate::Measured { bytes: LINK_PROBE_BYTES },
    };
    let found =
        tokio::task::block_in_place(|| find_links(&devices, rate)).context("finding the links between the GPUs")?;
    log_links(&found, if s.link_bytes_per_sec.is_some() { "--link-gbps" } else { "measured" });
    serve_devices(devices, &found.links, stores, config, s).await
}

/// Says which pairs of devices borrow from each other, at what rate (`how`: where it came from),
/// and which can't.
fn log_links(found: &FoundLinks, how: &str) {
    for l in &found.links {
        tracing::info!(
            "devices {} and {}: peer access, {:.1} GB/s ({how}); borrowing between them stops at 30% of it",
            l.a,
            l.b,
            l.bytes_per_sec as f64 / 1e9
        );
    }
    for u in &found.unlinked {
        tracing::warn!("devices {} and {}: not linked ({}); neither borrows pages from the other", u.a, u.b, u.why);
    }
}

#[cfg(not(feature = "cuda"))]
async fn cuda(_stores: [SameNodeStore; 2], _config: AgentConfig, _s: &Settings) -> anyhow::Result<()> {
    bail!("this kvtier was built without the `cuda` feature (cargo build --features cuda)")
}

/// The engine socket of one device: `<socket>.<ordinal>` when `suffixed`
/// ([`DeviceSelection::suffixed`]), else `--socket` itself.
fn device_socket(socket: &std::path::Path, ordinal: u32, suffixed: bool) -> PathBuf {
    if !suffixed {
        return socket.to_path_buf();
    }
    let mut name = socket.as_os_str().to_os_string();
    name.push(format!(".{ordinal}"));
    PathBuf::from(name)
}

/// `stores`: the pool's store (its spills, its fetches) and the link spills the server asks for
/// go through.
async fn serve_devices<D: Device>(
    devices: Vec<Arc<D>>,
    links: &[NodeLink],
    stores: [SameNodeStore; 2],
    config: AgentConfig,
    s: &Settings,
) -> anyhow::Result<()> {
    let [store, demand_store] = stores;
    let ordinals: Vec<u32> = devices.iter().map(|d| d.ordinal()).collect();
    let agent = Arc::new(Agent::node(devices, links, store, config).context("building the G1 pools")?);
    let metrics = match s.metrics {
        Some(addr) => {
            let handle = kvtier_server::metrics::install()?;
            // The agent's own label-less counters (and its client's) at 0 from the start.
            use kvtier_server::metric_catalog::{register_zeros, RecordedBy};
            register_zeros(&[RecordedBy::Agent, RecordedBy::Client]);
            let listener =
                tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding /metrics at {addr}"))?;
            let bound = listener.local_addr()?;
            tokio::spawn(kvtier_server::metrics::serve(listener, handle, None));
            tokio::spawn(publish_metrics(agent.clone()));
            Some(bound)
        }
        None => None,
    };
    // Unique among this node's agents: the pid, and the start time against pid reuse.
    let agent_id = format!(
        "agent-{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
    );
    tokio::spawn(report_g1(agent.clone(), demand_store, agent_id));
    let mut servers = Vec::with_capacity(ordinals.len());
    let mut paths = Vec::with_capacity(ordinals.len());
    for &o in &ordinals {
        let path = device_socket(&s.socket, o, s.gpus.suffixed(s.host_devices));
        let server = EngineServer::bind_device(agent.clone(), o, &path)
            .with_context(|| format!("binding {}", path.display()))?;
        servers.push(server);
        paths.push(path.display().to_string());
    }
    let stats = agent.stats();
    println!(
        "kvtier agent listening on {} (device {} {}, G1 {} pages of {} bytes, server {}, metrics {})",
        paths.join(", "),
        s.device,
        ordinals.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        stats.pool.pages,
        s.page_bytes,
        s.server,
        metrics.map_or("off".into(), |m| format!("http://{m}/metrics")),
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let signal = tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    };
    // What G1 holds goes with the agent (what it spilled is the server's).
    let held = agent.stats().pool.resident;
    tracing::info!(
        signal,
        "stopping: the {held} block(s) G1 holds go with the agent (those spilled stay on the server)"
    );
    drop(servers);
    println!("kvtier agent stopped");
    Ok(())
}

/// How often a run of failures to reach the server is said again at WARN.
const REMIND_EVERY: Duration = Duration::from_secs(60);

/// What to say of one call to the server, given the run of failures before it.
#[derive(Debug, PartialEq, Eq)]
enum Say {
    /// The first failure of a run, or the first after [`REMIND_EVERY`]: at WARN, with how many
    /// failed since the last WARN.
    Warn { since_last: u64 },
    /// A failure within a run already said: at DEBUG.
    Debug,
    /// The first success after `failures` failures: at INFO.
    Recovered { failures: u64 },
    /// A success after successes.
    Nothing,
}

/// A run of failed calls of one kind to the server, process-wide (one agent per process). While
/// the server is down every namespace's demand stream and every report fails about once a second:
/// each said at WARN filled the log with the same line, and the moment it came back said nothing.
/// One run per kind of call ([`REPORTS`], [`DEMANDS`]), so one kind failing while the other works
/// is still said once a minute.
#[derive(Default)]
struct ServerFailures {
    /// Failures in the current run, failures since the last WARN, and when that WARN was.
    run: Mutex<(u64, u64, Option<std::time::Instant>)>,
}

impl ServerFailures {
    fn failed(&self, now: std::time::Instant) -> Say {
        let Ok(mut run) = self.run.lock() else { return Say::Debug };
        run.0 += 1;
        run.1 += 1;
        if run.2.is_none_or(|at| now.duration_since(at) >= REMIND_EVERY) || run.0 == 1 {
            let since_last = run.1;
            run.1 = 0;
            run.2 = Some(now);
            return Say::Warn { since_last };
        }
        Say::Debug
    }

    fn succeeded(&self) -> Say {
        let Ok(mut run) = self.run.lock() else { return Say::Nothing };
        let failures = std::mem::take(&mut *run).0;
        if failures == 0 {
            Say::Nothing
        } else {
            Say::Recovered { failures }
        }
    }
}

/// Reports of what G1 holds (changes, resyncs, demanded blocks not spilled).
static REPORTS: ServerFailures = ServerFailures { run: Mutex::new((0, 0, None)) };
/// The namespaces' demand streams (opening them, reading them).
static DEMANDS: ServerFailures = ServerFailures { run: Mutex::new((0, 0, None)) };

/// Says a failed call to the server (`what`: what it was for) as its kind's run allows.
fn server_failed(kind: &ServerFailures, what: &str, e: &dyn std::fmt::Display) {
    match kind.failed(std::time::Instant::now()) {
        Say::Warn { since_last } if since_last > 1 => {
            tracing::warn!("{what}: {e} ({since_last} calls to the server failed since the last warning)")
        }
        Say::Warn { .. } => tracing::warn!("{what}: {e} (said again at most once a minute while it lasts)"),
        _ => tracing::debug!("{what}: {e}"),
    }
}

/// Notes a call of `kind` (`what`) to the server that worked: the end of a run of failures is said.
fn server_answered(kind: &ServerFailures, what: &str) {
    if let Say::Recovered { failures } = kind.succeeded() {
        tracing::info!("{what}: the server answers again (after {failures} failed calls)");
    }
}

/// How often G1's changes go to the server.
const REPORT_EVERY: Duration = Duration::from_millis(100);

/// Reports what G1 took in and gave up to the server (`ReportAgentBlocks`), which publishes it on
/// the node's KV events with tier `hbm`. Within one interval the last change of a key wins; when
/// changes were lost (the pool's log overflowed) every resident key is reported stored again. A
/// failed report is counted and dropped (the events are advisory; the next ones follow).
///
/// It also keeps one `AgentDemands` stream open per namespace an engine opened (re-opened on the
/// next tick when it ends): while it is open the server indexes this agent's reports for the
/// namespace as G1 (its lookups count them) and sends on it the keys loads want that only G1
/// holds ([`serve_demands`]).
async fn report_g1<D: Device>(agent: Arc<Agent<D, SameNodeStore>>, demand_store: SameNodeStore, agent_id: String) {
    let client = agent.store().client().clone();
    let mut tick = tokio::time::interval(REPORT_EVERY);
    let mut demands: HashMap<NamespaceId, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        tick.tick().await;
        for ns in agent.store().namespace_ids() {
            if demands.get(&ns).is_none_or(|t| t.is_finished()) {
                let task = serve_demands(agent.clone(), demand_store.clone(), ns, agent_id.clone());
                demands.insert(ns, tokio::spawn(task));
            }
        }
        let a = agent.clone();
        let Ok((changes, resync)) = tokio::task::spawn_blocking(move || {
            let (changes, lost) = a.take_g1_changes();
            (changes, lost.then(|| a.resident_keys()))
        })
        .await
        else {
            continue;
        };
        // Per namespace, per key: stored (0), evicted with a copy below (1), dropped (2).
        let mut last: HashMap<NamespaceId, HashMap<BlockKey, u8>> = HashMap::new();
        for (ns, key) in resync.unwrap_or_default() {
            last.entry(ns).or_default().insert(key, 0);
        }
        for c in changes {
            let ((ns, key), what) = match c {
                PoolChange::Stored(k) => (k, 0),
                PoolChange::Evicted { key, below } => (key, if below { 1 } else { 2 }),
            };
            last.entry(ns).or_default().insert(key, what);
        }
        for (ns, keys) in last {
            let keys: Vec<(BlockKey, u8)> = keys.into_iter().collect();
            for chunk in keys.chunks(REPORT_MAX_KEYS) {
                let pick = |w: u8| -> Vec<bytes::Bytes> {
                    chunk.iter().filter(|(_, x)| *x == w).map(|(k, _)| bytes::Bytes::copy_from_slice(&k.0)).collect()
                };
                let req = kvtier_proto::pb::AgentBlocksReport {
                    namespace_id: bytes::Bytes::copy_from_slice(&ns.0),
                    stored: pick(0),
                    evicted: pick(1),
                    dropped: pick(2),
                    agent_id: agent_id.clone(),
                    resync: false,
                    unspilled: vec![],
                };
                match client.raw_grpc().report_agent_blocks(req).await {
                    Ok(_) => {
                        server_answered(&REPORTS, "reporting G1 blocks to the server");
                        metrics::counter!("kvtier_agent_reported_keys_total").increment(chunk.len() as u64)
                    }
                    Err(e) => {
                        metrics::counter!("kvtier_agent_report_errors_total").increment(1);
                        server_failed(&REPORTS, "reporting G1 blocks to the server", &e);
                    }
                }
            }
        }
    }
}

/// What a report says of its keys.
#[derive(Clone, Copy)]
enum Reported {
    /// What G1 holds (`resync`: indexed, not published again).
    Resident,
    /// Demanded keys this agent could not spill.
    Unspilled,
}

/// Sends `keys` to the server as `what` (chunked; nothing when there are none); the first error.
async fn report_keys(
    client: &KvClient,
    ns: &NamespaceId,
    agent_id: &str,
    keys: &[BlockKey],
    what: Reported,
) -> Result<(), String> {
    for chunk in keys.chunks(REPORT_MAX_KEYS) {
        let keys: Vec<bytes::Bytes> = chunk.iter().map(|k| bytes::Bytes::copy_from_slice(&k.0)).collect();
        let (stored, unspilled) = match what {
            Reported::Resident => (keys, vec![]),
            Reported::Unspilled => (vec![], keys),
        };
        let req = kvtier_proto::pb::AgentBlocksReport {
            namespace_id: bytes::Bytes::copy_from_slice(&ns.0),
            stored,
            evicted: vec![],
            dropped: vec![],
            agent_id: agent_id.to_string(),
            resync: true,
            unspilled,
        };
        client.raw_grpc().report_agent_blocks(req).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// One namespace's `AgentDemands` stream: opens it, reports every block of the namespace G1
/// holds (the server indexes an agent's keys only while its stream is open), then for each key
/// the server sends copies the page out of G1 and stores it into the server through its own
/// same-node link (the pool is not held during the store). Returns when the stream ends or
/// fails (after a pause, so a refusing server is not hammered); the caller re-opens it.
async fn serve_demands<D: Device>(
    agent: Arc<Agent<D, SameNodeStore>>,
    store: SameNodeStore,
    ns: NamespaceId,
    agent_id: String,
) {
    let client = agent.store().client().clone();
    let req = kvtier_proto::pb::AgentDemandsRequest {
        namespace_id: bytes::Bytes::copy_from_slice(&ns.0),
        agent_id: agent_id.clone(),
    };
    let mut stream = match client.raw_grpc().agent_demands(req).await {
        Ok(s) => {
            server_answered(&DEMANDS, "opening the server's demand stream");
            s.into_inner()
        }
        Err(e) if e.message().starts_with(kvtier_proto::codes::UNKNOWN_NAMESPACE) => {
            // The server restarted without its registrations: registered again, and the stream
            // opened on the next round.
            if let Err(e) = store.register_again(&ns).await {
                server_failed(&DEMANDS, "opening the server's demand stream", &e);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            return;
        }
        Err(e) => {
            metrics::counter!("kvtier_agent_demand_stream_errors_total").increment(1);
            server_failed(&DEMANDS, "opening the server's demand stream", &e);
            tokio::time::sleep(Duration::from_secs(1)).await;
            return;
        }
    };
    let a = agent.clone();
    let resident: Vec<BlockKey> = match tokio::task::spawn_blocking(move || a.resident_keys()).await {
        Ok(keys) => keys.into_iter().filter(|(n, _)| *n == ns).map(|(_, k)| k).collect(),
        Err(_) => return,
    };
    match report_keys(&client, &ns, &agent_id, &resident, Reported::Resident).await {
        Ok(()) => server_answered(&REPORTS, "reporting G1 to the server"),
        Err(e) => server_failed(&REPORTS, "reporting G1 to the server", &e),
    }
    loop {
        let demand = match stream.message().await {
            Ok(Some(d)) => d,
            Ok(None) => return,
            Err(e) => {
                metrics::counter!("kvtier_agent_demand_stream_errors_total").increment(1);
                server_failed(&DEMANDS, "the server's demand stream", &e);
                tokio::time::sleep(Duration::from_secs(1)).await;
                return;
            }
        };
        let keys: Vec<BlockKey> = demand.keys.iter().filter_map(|k| BlockKey::try_from(&k[..]).ok()).collect();
        let (a, st) = (agent.clone(), store.clone());
        let batch = keys.clone();
        // One batch at a time: the stream's queue on the server bounds what waits.
        let unspilled = tokio::task::spawn_blocking(move || {
            let mut unspilled = Vec::new();
            for key in keys {
                match a.copy_out(&ns, &key) {
                    Ok(Some(bytes)) => match st.spill(&ns, &key, CodecId::RAW, &bytes) {
                        Ok(()) => {
                            a.mark_spilled(&ns, &key);
                            metrics::counter!("kvtier_agent_demand_spills_total").increment(1);
                            continue;
                        }
                        Err(e) => {
                            metrics::counter!("kvtier_agent_demand_errors_total").increment(1);
                            tracing::warn!("spilling a demanded block: {e}");
                        }
                    },
                    Ok(None) => metrics::counter!("kvtier_agent_demand_not_resident_total").increment(1),
                    Err(e) => {
                        metrics::counter!("kvtier_agent_demand_errors_total").increment(1);
                        tracing::warn!("copying a demanded block out of G1: {e}");
                    }
                }
                unspilled.push(key);
            }
            unspilled
        })
        .await
        .unwrap_or_else(|e| {
            // The batch's task failed (a panic in a copy or a spill): none of it is known to be
            // spilled, so every key is reported, and its readers miss now rather than wait.
            metrics::counter!("kvtier_agent_demand_errors_total").increment(1);
            tracing::error!("serving a batch of demanded blocks failed: {e}");
            batch
        });
        // The reads waiting on what could not be spilled miss now, not at the end of their wait.
        if let Err(e) = report_keys(&client, &ns, &agent_id, &unspilled, Reported::Unspilled).await {
            server_failed(&REPORTS, "telling the server which demanded blocks could not be spilled", &e);
        }
    }
}

/// Keys per report (the server's default `max_blocks_per_request`).
const REPORT_MAX_KEYS: usize = 4096;

/// Copies the agent's counters into the metrics registry four times a second.
async fn publish_metrics<D: Device>(agent: Arc<Agent<D, SameNodeStore>>) {
    let page = agent.config().page_bytes as f64;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        // Off the runtime's threads: the pool's lock is taken (briefly: spills run outside it).
        let a = agent.clone();
        let Ok(s) = tokio::task::spawn_blocking(move || a.stats()).await else { continue };
        let p = s.pool;
        metrics::gauge!("kvtier_agent_pool_pages").set(p.pages as f64);
        metrics::gauge!("kvtier_agent_pool_bytes").set(p.pages as f64 * page);
        metrics::gauge!("kvtier_agent_resident_pages").set(p.resident as f64);
        metrics::gauge!("kvtier_agent_resident_bytes").set(p.resident as f64 * page);
        metrics::gauge!("kvtier_agent_pinned_pages").set(p.pinned as f64);
        metrics::gauge!("kvtier_agent_engine_connections").set(s.connections as f64);
        metrics::counter!("kvtier_agent_evictions_total").absolute(p.evictions);
        metrics::counter!("kvtier_agent_spills_total").absolute(p.spills);
        metrics::counter!("kvtier_agent_spilled_bytes_total").absolute(p.spilled_bytes);
        metrics::counter!("kvtier_agent_spill_errors_total").absolute(p.spill_errors);
        metrics::counter!("kvtier_agent_requests_total").absolute(s.requests);
        metrics::counter!("kvtier_agent_refused_total").absolute(s.refused);
        metrics::counter!("kvtier_agent_saved_blocks_total").absolute(s.saved_blocks);
        metrics::counter!("kvtier_agent_saves_expired_total").absolute(s.saves_expired);
        metrics::counter!("kvtier_agent_loaded_blocks_total", "from" => "g1").absolute(s.loaded_from_g1);
        metrics::counter!("kvtier_agent_loaded_blocks_total", "from" => "g2").absolute(s.loaded_from_g2);
        metrics::counter!("kvtier_agent_load_misses_total").absolute(s.load_misses);
        metrics::counter!("kvtier_agent_store_errors_total").absolute(s.store_errors);
        metrics::counter!("kvtier_agent_promotions_total").absolute(s.promotions);
        metrics::counter!("kvtier_agent_promotions_skipped_total").absolute(s.promotions_skipped);
        metrics::counter!("kvtier_agent_copy_bytes_total").absolute(s.copy_bytes);
        if s.copy_seconds > 0.0 {
            metrics::gauge!("kvtier_agent_copy_gbps").set(s.copy_bytes as f64 / s.copy_seconds / 1e9);
        }
        let b = &s.borrow;
        for (lender, l) in &b.lenders {
            let lender = lender.to_string();
            metrics::gauge!("kvtier_agent_lent_pages", "lender" => lender.clone()).set(l.lent_pages as f64);
            metrics::gauge!("kvtier_agent_lent_bytes", "lender" => lender.clone()).set(l.lent_pages as f64 * page);
            metrics::counter!("kvtier_agent_borrows_total", "lender" => lender.clone()).absolute(l.borrows);
            metrics::counter!("kvtier_agent_borrowed_bytes_total", "lender" => lender).absolute(l.borrowed_bytes);
        }
        metrics::counter!("kvtier_agent_borrow_reclaims_total").absolute(b.reclaims);
        for (reason, n) in [
            ("link_budget", b.declined_link_budget),
            ("no_peer_capacity", b.declined_no_peer_capacity),
            ("no_peer_access", b.declined_no_peer_access),
        ] {
            metrics::counter!("kvtier_agent_borrow_declines_total", "reason" => reason).absolute(n);
        }
        for ((a, z), n) in &b.link_bytes {
            metrics::counter!("kvtier_agent_link_bytes_total", "link" => format!("{a}-{z}")).absolute(*n);
        }
        for ((a, z), u) in &s.link_use {
            metrics::gauge!("kvtier_agent_link_use", "link" => format!("{a}-{z}")).set(*u);
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: AgentArgs,
    }

    fn parse(args: &[&str]) -> anyhow::Result<Settings> {
        let cmd = Cmd::try_parse_from(std::iter::once("agent").chain(args.iter().copied()))?;
        settings(&cmd.a)
    }

    /// A run of failed calls to the server is said at WARN once, then once a minute with the
    /// count since, and its end once; a new run after a success warns at once again.
    #[test]
    fn a_run_of_server_failures_is_said_once_a_minute_and_its_end_once() {
        let f = ServerFailures::default();
        let t0 = std::time::Instant::now();
        assert_eq!(f.succeeded(), Say::Nothing);
        assert_eq!(f.failed(t0), Say::Warn { since_last: 1 });
        for i in 1..=58 {
            assert_eq!(f.failed(t0 + Duration::from_secs(i)), Say::Debug, "second {i}");
        }
        assert_eq!(f.failed(t0 + REMIND_EVERY), Say::Warn { since_last: 59 });
        assert_eq!(f.failed(t0 + REMIND_EVERY + Duration::from_secs(1)), Say::Debug);
        assert_eq!(f.succeeded(), Say::Recovered { failures: 61 });
        assert_eq!(f.succeeded(), Say::Nothing);
        assert_eq!(f.failed(t0 + REMIND_EVERY + Duration::from_secs(2)), Say::Warn { since_last: 1 });
    }

    #[test]
    fn host_devices_and_their_link_are_checked() {
        let s = parse(&["--page-bytes", "1KiB", "--host-devices", "4", "--link-gbps", "2.5"]).unwrap();
        assert_eq!((s.host_devices, s.link_bytes_per_sec), (4, Some(2_500_000_000)));
        let one = parse(&["--page-bytes", "1KiB"]).unwrap();
        assert_eq!((one.host_devices, one.link_bytes_per_sec, one.gpus), (1, None, DeviceSelection::One(0)));
        for (bad, why) in [
            (vec!["--host-devices", "0"], "--host-devices must be 1..=64"),
            (vec!["--host-devices", "65"], "--host-devices must be 1..=64"),
            (vec!["--host-devices", "2", "--device", "cuda"], "for the host backend"),
            (vec!["--link-gbps", "0"], "--link-gbps must be above 0"),
            (vec!["--link-gbps", "NaN"], "--link-gbps must be above 0"),
            (vec!["--link-gbps", "-1"], "--link-gbps must be above 0"),
        ] {
            let args: Vec<&str> = ["--page-bytes", "1KiB"].into_iter().chain(bad.iter().copied()).collect();
            let e = parse(&args).err().map(|e| format!("{e:#}")).unwrap_or_default();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        // A page that can't be a block is named as such (0 said "a shared buffer of 0 bytes",
        // 7 built a pool of 7-byte pages).
        for bad in ["0", "7", "63"] {
            let e = parse(&["--page-bytes", bad]).err().map(|e| format!("{e:#}")).unwrap_or_default();
            assert!(e.contains(&format!("--page-bytes {bad}: one block")), "{bad}: {e}");
        }
        assert_eq!(parse(&["--page-bytes", "64"]).unwrap().page_bytes, 64);
    }

    #[test]
    fn an_agent_drives_the_gpus_listed_or_all_of_them() {
        let gpus = |args: &[&str]| -> anyhow::Result<DeviceSelection> {
            let all: Vec<&str> = ["--page-bytes", "1KiB"].iter().chain(args).copied().collect();
            parse(&all).map(|s| s.gpus)
        };
        assert_eq!(gpus(&["--device", "cuda", "--gpus", "0, 2,3"]).unwrap(), DeviceSelection::Listed(vec![0, 2, 3]));
        assert_eq!(gpus(&["--device", "cuda", "--gpus", "all"]).unwrap(), DeviceSelection::All);
        assert_eq!(gpus(&["--device", "cuda", "--gpu", "5"]).unwrap(), DeviceSelection::One(5));
        // From the file, as a string or a TOML list; a flag wins over both of the file's keys.
        let file = std::env::temp_dir().join(format!("kvtier-agent-gpus-{}.toml", std::process::id()));
        let cfg = file.to_str().unwrap();
        std::fs::write(&file, "[agent]\ndevice = \"cuda\"\ngpus = \"1,0\"\n").unwrap();
        assert_eq!(gpus(&["--config", cfg]).unwrap(), DeviceSelection::Listed(vec![1, 0]));
        assert_eq!(gpus(&["--config", cfg, "--gpu", "1"]).unwrap(), DeviceSelection::One(1));
        std::fs::write(&file, "[agent]\ndevice = \"cuda\"\ngpu = 0\ngpus = [2, 3]\n").unwrap();
        let both = gpus(&["--config", cfg]);
        assert!(format!("{:#}", both.unwrap_err()).contains("--gpu or --gpus, not both"), "both in one file");
        std::fs::write(&file, "[agent]\ndevice = \"cuda\"\ngpu = 0\n").unwrap();
        assert_eq!(gpus(&["--config", cfg, "--gpus", "all"]).unwrap(), DeviceSelection::All);
        std::fs::write(&file, "[agent]\ndevice = \"cuda\"\ngpus = [2, 3]\n").unwrap();
        assert_eq!(gpus(&["--config", cfg]).unwrap(), DeviceSelection::Listed(vec![2, 3]));
        std::fs::write(&file, "[agent]\ndevice = \"cuda\"\ngpus = [\"a\"]\n").unwrap();
        let bad = gpus(&["--config", cfg]);
        std::fs::remove_file(&file).unwrap();
        assert!(format!("{:#}", bad.unwrap_err()).contains("a list of GPU ordinals"));
        for (bad, why) in [
            (vec!["--gpus", "0,1"], "--gpus is for --device cuda"),
            (vec!["--device", "cuda", "--gpus", "0,1", "--gpu", "0"], "not both"),
            (vec!["--device", "cuda", "--gpus", "0,0"], "GPU 0 is listed twice"),
            (vec!["--device", "cuda", "--gpus", "0,,1"], "\"\" is not a GPU ordinal"),
            (vec!["--device", "cuda", "--gpus", "one"], "\"one\" is not a GPU ordinal"),
            (vec!["--device", "cuda", "--gpus=-1"], "\"-1\" is not a GPU ordinal"),
        ] {
            let e = gpus(&bad).err().map(|e| format!("{e:#}")).unwrap_or_default();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn promotion_is_on_unless_turned_off_by_flag_or_file() {
        assert!(parse(&["--page-bytes", "1KiB"]).unwrap().promote_loads);
        assert!(!parse(&["--page-bytes", "1KiB", "--promote-loads", "false"]).unwrap().promote_loads);
        assert!(parse(&["--page-bytes", "1KiB", "--promote-loads", "no"]).is_err(), "true or false only");
        let file = std::env::temp_dir().join(format!("kvtier-agent-promote-{}.toml", std::process::id()));
        let config = file.to_str().unwrap();
        std::fs::write(&file, "[agent]\npromote_loads = false\n").unwrap();
        assert!(!parse(&["--config", config, "--page-bytes", "1KiB"]).unwrap().promote_loads);
        let flag_wins = parse(&["--config", config, "--page-bytes", "1KiB", "--promote-loads", "true"]).unwrap();
        assert!(flag_wins.promote_loads);
        std::fs::write(&file, "[agent]\npromote_loads = \"sometimes\"\n").unwrap();
        let e =
            parse(&["--config", config, "--page-bytes", "1KiB"]).err().map(|e| format!("{e:#}")).unwrap_or_default();
        let _ = std::fs::remove_file(&file);
        assert!(e.contains("promote_loads"), "{e}");
    }

    /// The agent's credential: the flag, else `[agent] auth_token`, else the file's top-level
    /// one (the node's, so one file configures `serve` and `agent` with auth on; it was ignored).
    #[test]
    fn the_credential_comes_from_the_flag_the_agent_table_or_the_file() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let config = file.path().to_str().unwrap();
        std::fs::write(file.path(), "auth_token = \"node-secret-0123456\"\n[agent]\npage_bytes = \"1KiB\"\n").unwrap();
        assert_eq!(parse(&["--config", config]).unwrap().auth_token.as_deref(), Some("node-secret-0123456"));
        std::fs::write(
            file.path(),
            "auth_token = \"node-secret-0123456\"\n[agent]\npage_bytes = \"1KiB\"\nauth_token = \"agent-secret-0123\"\n",
        )
        .unwrap();
        assert_eq!(parse(&["--config", config]).unwrap().auth_token.as_deref(), Some("agent-secret-0123"));
        let flag = parse(&["--config", config, "--auth-token", "flag-secret-012345"]).unwrap();
        assert_eq!(flag.auth_token.as_deref(), Some("flag-secret-012345"));
        assert_eq!(parse(&["--page-bytes", "1KiB"]).unwrap().auth_token, None);
    }

    /// A writer on the agent's loopback fabric (what an RDMA NIC is to `--rdma-device`, on a
    /// machine without one), counting its writes; `stall` makes its completions stop arriving.
    struct LoopbackWriter {
        mover: kvtier_agent::mover::loopback::LoopbackMover,
        staging: kvtier_agent::mover::loopback::LoopbackRegion,
        writes: Arc<std::sync::atomic::AtomicUsize>,
        reads: Arc<std::sync::atomic::AtomicUsize>,
        stall: Arc<std::sync::atomic::AtomicBool>,
    }

    impl crate::lease_lane::OneSided for LoopbackWriter {
        fn endpoint(&self) -> Vec<u8> {
            kvtier_tests::fabric::peer_endpoint().to_vec()
        }
        fn connect(&mut self, server: &[u8]) -> kvtier_agent::Result<()> {
            kvtier_tests::fabric::connect_peer(&self.mover, server)
        }
        fn write(&mut self, bytes: &[u8], slot: &kvtier_proto::dataplane::SlotDescriptor) -> kvtier_agent::Result<()> {
            use kvtier_agent::mover::{BulkMover, MoverRegion};
            use std::sync::atomic::Ordering;
            self.writes.fetch_add(1, Ordering::SeqCst);
            if self.stall.load(Ordering::SeqCst) {
                self.mover.stall();
            }
            self.staging.buffer().write(0, bytes)?;
            self.mover.write(&self.staging, 0, slot, 0, bytes.len(), Duration::from_millis(200))
        }
        fn read(&mut self, slot: &kvtier_proto::dataplane::SlotDescriptor, out: &mut [u8]) -> kvtier_agent::Result<()> {
            use kvtier_agent::mover::{BulkMover, MoverRegion};
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.mover.read(slot, 0, &self.staging, 0, out.len(), Duration::from_millis(200))?;
            self.staging.buffer().read(0, out)
        }
    }

    /// `--rdma-device`'s path on the loopback fabric against an in-process node with that fabric
    /// attached: spills land in the server's DRAM through leases and fetches read them back
    /// one-sidedly (the same-node socket only for what the lane didn't find); once the writer
    /// fails the lane closes and both go on over the same-node socket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn spills_and_fetches_go_through_the_lease_lane_and_over_the_socket_once_it_fails() {
        use kvtier_agent::mover::loopback::{LoopbackFabric, LoopbackMover};
        use kvtier_agent::mover::BulkMover;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

        let dir = tempfile::tempdir().unwrap();
        // A harness node: loopback, no metrics, 64 MiB of DRAM.
        let config = kvtier_tests::harness::node_config(dir.path());
        let server = kvtier_server::start(config, None).await.unwrap();
        let fabric = LoopbackFabric::new();
        server.state.attach_fabric(Arc::new(kvtier_tests::fabric::ArenaOnLoopback(fabric.clone()))).unwrap();
        let client = KvClient::connect(&server.grpc_addr.to_string(), ClientConfig::default()).await.unwrap();
        let ns = kvtier_tests::namespace("agent", b"lane", kvtier_tests::small_layout());
        let h = client.register(ns.clone()).await.unwrap();
        let block_bytes = h.block_bytes() as usize;
        let (writes, reads) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let stall = Arc::new(AtomicBool::new(false));
        let mover = LoopbackMover::new(&fabric);
        let staging = mover.register(&kvtier_agent::HostBuffer::new(block_bytes)).unwrap();
        let writer =
            LoopbackWriter { mover, staging, writes: writes.clone(), reads: reads.clone(), stall: stall.clone() };
        let lane = LeaseLane::connect(&client, Box::new(writer)).await.unwrap();
        let store = SameNodeStore::connect(client.clone(), block_bytes, Some(lane)).await.unwrap();

        let keys = h.keys(&kvtier_tests::tokens(3, h.block_tokens() * 6));
        let payloads: Vec<bytes::Bytes> =
            keys.iter().map(|k| kvtier_tests::payload_for(k, block_bytes as u64)).collect();
        // The agent spills from its own threads, never from the runtime's.
        let spill = |range: std::ops::Range<usize>| {
            let (store, keys, payloads, ns) = (store.clone(), keys.clone(), payloads.clone(), ns.clone());
            tokio::task::spawn_blocking(move || {
                store.open_namespace(&ns).unwrap();
                for i in range {
                    store.spill(&ns.id(), &keys[i], CodecId::RAW, &payloads[i]).unwrap();
                }
            })
        };
        spill(0..4).await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 4, "four spills, four one-sided writes");
        let loaded = client.load_keys(&h, &keys[..4]).await.unwrap();
        for (got, want) in loaded.iter().zip(&payloads) {
            assert!(got.as_ref().map(|f| &f.payload) == Some(want), "a spilled block loads byte for byte");
        }

        // Fetched back through the lane: one-sided reads of what DRAM holds; a key nobody holds
        // and one the lane doesn't find go the other way (and miss there too).
        let absent = h.keys(&kvtier_tests::tokens(4, h.block_tokens()))[0];
        let mut ask: Vec<BlockKey> = keys[..4].to_vec();
        ask.insert(2, absent);
        let (fetcher, id) = (store.clone(), ns.id());
        let (found, out) = tokio::task::spawn_blocking(move || {
            let mut out = vec![0u8; ask.len() * block_bytes];
            (fetcher.fetch(&id, &ask, block_bytes, &mut out).unwrap(), out)
        })
        .await
        .unwrap();
        assert_eq!(found, vec![true, true, false, true, true]);
        assert_eq!(reads.load(Ordering::SeqCst), 4, "four one-sided reads");
        for (slot, want) in [0usize, 1, 3, 4].into_iter().zip(&payloads) {
            assert!(out[slot * block_bytes..(slot + 1) * block_bytes] == want[..], "fetched byte for byte");
        }

        // The writer stops completing: its write times out, the lane closes, the spill still lands.
        stall.store(true, Ordering::SeqCst);
        spill(4..6).await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 5, "one failed write, then no lane");
        let loaded = client.load_keys(&h, &keys[4..]).await.unwrap();
        for (got, want) in loaded.iter().zip(&payloads[4..]) {
            assert!(got.as_ref().map(|f| &f.payload) == Some(want), "spilled over the same-node socket");
        }
        // Fetches go over the same-node socket too now.
        let (fetcher, id, again) = (store.clone(), ns.id(), keys.clone());
        let (found, out) = tokio::task::spawn_blocking(move || {
            let mut out = vec![0u8; again.len() * block_bytes];
            (fetcher.fetch(&id, &again, block_bytes, &mut out).unwrap(), out)
        })
        .await
        .unwrap();
        assert_eq!((found, reads.load(Ordering::SeqCst)), (vec![true; 6], 4));
        assert!(out.chunks(block_bytes).zip(&payloads).all(|(got, want)| got == &want[..]), "byte for byte");
        server.stop(Duration::from_secs(5)).await.unwrap();
    }

    #[test]
    fn each_device_of_a_node_gets_its_own_socket() {
        let p = std::path::Path::new("/run/kvtier-agent.sock");
        assert_eq!(device_socket(p, 3, false), PathBuf::from("/run/kvtier-agent.sock"));
        assert_eq!(device_socket(p, 3, true), PathBuf::from("/run/kvtier-agent.sock.3"));
        // A list of GPUs is suffixed whatever its length (`--gpus all` on a one-GPU machine too),
        // one device or one host device is not, several host devices are.
        assert!(DeviceSelection::Listed(vec![3]).suffixed(1) && DeviceSelection::All.suffixed(1));
        assert!(!DeviceSelection::One(3).suffixed(1) && DeviceSelection::One(0).suffixed(4));
    }
}
