//! The `kvtier` binary: `kvtier serve` runs a node, `kvtier agent` a GPU agent beside it; the other subcommands are a small client for
//! trying a node by hand (`put`, `get`, `lookup`, `session park|resume|extend|ls|drop`, `stats`);
//! `kvtier cert` makes TLS certificates.

mod agent;
mod fabric;
mod lease_lane;
mod peers;
mod watch;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use kvtier_client::{ClientConfig, KvClient, NamespaceHandle, ParkOptions};
use kvtier_proto::{BlockKey, DType, HashScheme, KvLayout, Namespace};
use kvtier_server::config::{ByteSize, DurationStr, ServerConfig};

mod cert;

#[derive(Parser)]
#[command(name = "kvtier", version, about = "A KV-cache tiering service for LLM inference")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a node (embedded defaults: loopback, DRAM cap = 1/4 of RAM, ./kvtier-data).
    Serve(ServeArgs),
    /// Run the GPU agent of one device beside a node's server: a G1 page pool that same-node
    /// engines save to and load from over a Unix socket, spilling into the server.
    Agent(agent::AgentArgs),
    /// Store the KV blocks of a token sequence.
    Put(PutArgs),
    /// Load the longest stored prefix of a token sequence.
    Get(GetArgs),
    /// How many tokens of a sequence the server holds.
    Lookup(TokensArgs),
    /// Park, resume, extend, list and drop agent sessions.
    #[command(subcommand)]
    Session(SessionCmd),
    /// Tier and session statistics.
    Stats(ConnArgs),
    /// Follow a node's KV events (stored, evicted, purged keys; sessions), one line each.
    Events(watch::EventsArgs),
    /// Which nodes hold how long a prefix of a token sequence, and a session: a routing hint.
    Route(watch::RouteArgs),
    /// TLS certificates: a CA, node certificates, client certificates (mTLS tenants).
    #[command(subcommand)]
    Cert(cert::CertCmd),
    /// Capacity planner (runs `kvtier-bench plan` from beside this binary; same arguments).
    #[command(disable_help_flag = true)]
    Plan {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// TOML configuration file; flags and environment variables override it.
    #[arg(long, env = "KVTIER_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC control-plane address.
    #[arg(long, env = "KVTIER_LISTEN")]
    listen: Option<std::net::SocketAddr>,
    /// Data-plane address (clients learn it from the control plane).
    #[arg(long, env = "KVTIER_DATA_LISTEN")]
    data_listen: Option<std::net::SocketAddr>,
    /// Prometheus /metrics address.
    #[arg(long, env = "KVTIER_METRICS")]
    metrics: Option<std::net::SocketAddr>,
    /// Serve no /metrics.
    #[arg(long)]
    no_metrics: bool,
    /// Register the DRAM arena with this RDMA device (`any`: the first), so peers lease its
    /// slots and move blocks one-sidedly (needs the `rdma` build feature and a verbs device).
    #[arg(long, env = "KVTIER_RDMA_DEVICE")]
    rdma_device: Option<String>,
    #[arg(long, env = "KVTIER_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Hard cap of the DRAM tier, e.g. 512MiB or 4GiB.
    #[arg(long, env = "KVTIER_DRAM_CAPACITY")]
    dram_capacity: Option<ByteSize>,
    /// Fault in the whole DRAM capacity at start (in the background), so the first fill of the
    /// cache doesn't page-fault in the store path; the node then holds all of it.
    #[arg(long, env = "KVTIER_DRAM_PREFAULT")]
    dram_prefault: bool,
    /// The CPUs the node runs on, a cpulist such as 2-5 or 0,4-7 (default: all it may use).
    #[arg(long, env = "KVTIER_CPUS")]
    cpus: Option<String>,
    /// Hard cap of the disk tier under DRAM (0: off), e.g. 64GiB.
    #[arg(long, env = "KVTIER_DISK_CAPACITY")]
    disk_capacity: Option<ByteSize>,
    /// Codec for prefix blocks demoted to disk: keep, raw+lz4, nvfp4+had+lz4, ...
    #[arg(long, env = "KVTIER_DISK_CODEC")]
    disk_codec: Option<String>,
    /// Longest context per request or session, in tokens.
    #[arg(long, env = "KVTIER_MAX_CONTEXT_TOKENS")]
    max_context_tokens: Option<u64>,
    /// Default TTL of parked sessions, e.g. 10m.
    #[arg(long, env = "KVTIER_SESSION_TTL")]
    session_ttl: Option<DurationStr>,
    /// Shared secret clients must present (required beyond loopback).
    #[arg(long, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// The cluster's membership store, e.g. redis://10.0.0.5:6379 (none: one node).
    #[arg(long, env = "KVTIER_CLUSTER")]
    cluster: Option<String>,
    /// This node's id in the cluster (default: <hostname>:<gRPC port>).
    #[arg(long, env = "KVTIER_NODE_ID")]
    node_id: Option<String>,
    /// The host other nodes and clients dial this node at (default: the listen IP, or the
    /// hostname when listening on 0.0.0.0).
    #[arg(long, env = "KVTIER_ADVERTISE_HOST")]
    advertise_host: Option<String>,
    /// Log filter, e.g. info or kvtier_server=debug.
    #[arg(long, env = "KVTIER_LOG", default_value = "info")]
    log: String,
}

#[derive(Args, Clone)]
struct ConnArgs {
    /// The server's gRPC address.
    #[arg(long, env = "KVTIER_SERVER", default_value = "127.0.0.1:7070")]
    server: String,
    #[arg(long, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// The CA (PEM) of a server that runs TLS: connect over TLS.
    #[arg(long, env = "KVTIER_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), for servers that take client certificates; with --tls-key.
    #[arg(long, env = "KVTIER_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "KVTIER_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    #[command(flatten)]
    ns: NsArgs,
}

impl ConnArgs {
    fn client_config(&self) -> anyhow::Result<ClientConfig> {
        let tls = match &self.tls_ca {
            Some(ca) => {
                let ident = self.tls_cert.as_deref().zip(self.tls_key.as_deref());
                Some(kvtier_client::ClientTls::from_files(ca, ident)?)
            }
            None if self.tls_cert.is_some() => bail!("--tls-cert needs --tls-ca"),
            None => None,
        };
        Ok(ClientConfig { auth_token: self.auth_token.clone(), tls, ..Default::default() })
    }
}

/// The namespace to use (defaults: a small demo model).
#[derive(Args, Clone)]
struct NsArgs {
    #[arg(long, default_value = "cli")]
    tenant: String,
    #[arg(long, default_value = "demo-model")]
    model: String,
    #[arg(long, default_value_t = 4)]
    layers: u16,
    #[arg(long, default_value_t = 2)]
    kv_heads: u16,
    #[arg(long, default_value_t = 64)]
    head_dim: u16,
    #[arg(long, default_value = "fp16")]
    dtype: String,
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    #[arg(long, default_value = "")]
    salt: String,
    /// sha256 instead of blake3 key hashing.
    #[arg(long)]
    sha256: bool,
}

#[derive(Args)]
struct TokensArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Text whose UTF-8 bytes are the token ids.
    #[arg(long, conflicts_with = "tokens")]
    text: Option<String>,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
}

#[derive(Args)]
struct PutArgs {
    #[command(flatten)]
    t: TokensArgs,
    /// Payload file: the blocks back to back, in the namespace's layout. Without it, a synthetic
    /// payload derived from each block's key is stored (handy for trying the service).
    #[arg(long)]
    file: Option<PathBuf>,
}

#[derive(Args)]
struct GetArgs {
    #[command(flatten)]
    t: TokensArgs,
    /// Write the loaded payloads here, back to back.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Subcommand)]
enum SessionCmd {
    /// Park a session (its blocks are stored and pinned).
    Park {
        #[command(flatten)]
        t: TokensArgs,
        #[arg(long)]
        id: String,
        /// Time to live, e.g. 30s, 10m.
        #[arg(long)]
        ttl: Option<DurationStr>,
        /// Full blocks then the tail, back to back; synthetic if absent.
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Append a turn: the whole context now; only new blocks are sent.
    Extend {
        #[command(flatten)]
        t: TokensArgs,
        #[arg(long)]
        id: String,
    },
    /// Resume a session and load its KV.
    Resume {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(long)]
        id: String,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// List live sessions of the namespace.
    Ls(ConnArgs),
    /// Drop a session and unpin its blocks.
    Drop {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(long)]
        id: String,
    },
}

/// `kvtier plan ...` is `kvtier-bench plan ...`: the planner lives with the benchmarks.
fn plan(args: &[String]) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let bench = exe.with_file_name("kvtier-bench");
    if !bench.exists() {
        bail!("{} is missing: build it with `cargo build --release -p kvtier-bench`", bench.display());
    }
    let status = std::process::Command::new(&bench)
        .arg("plan")
        .args(args)
        .status()
        .with_context(|| format!("running {}", bench.display()))?;
    std::process::exit(status.code().unwrap_or(1));
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let cmd = match cli.cmd {
        Cmd::Plan { args } => return plan(&args),
        Cmd::Cert(c) => return cert::run(c),
        other => other,
    };
    if let Cmd::Serve(a) = cmd {
        // The configuration first: its `cpus` confine the process before the runtime starts,
        // which then runs one worker per CPU of the set.
        let cfg = serve_config(&a)?;
        if let Some(list) = &cfg.cpus {
            let cpus = kvtier_server::affinity::parse_cpulist(list)?;
            kvtier_server::affinity::confine_process(&cpus)?;
            tracing::info!("running on CPUs {list}");
        }
        let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
        return rt.block_on(serve(a, cfg));
    }
    let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    rt.block_on(async move {
        match cmd {
            // Run above, on a runtime started after its `cpus` took effect.
            Cmd::Serve(_) => Ok(()),
            Cmd::Agent(a) => agent::run(a).await,
            Cmd::Put(a) => put(a).await,
            Cmd::Get(a) => get(a).await,
            Cmd::Lookup(a) => lookup(a).await,
            Cmd::Session(s) => session(s).await,
            Cmd::Stats(c) => stats(c).await,
            Cmd::Events(a) => watch::events(a).await,
            Cmd::Route(a) => watch::route(a).await,
            Cmd::Plan { .. } | Cmd::Cert(_) => Ok(()),
        }
    })
}

/// `serve`'s configuration: the file, then environment and flags over it, validated; logging set
/// up.
fn serve_config(a: &ServeArgs) -> anyhow::Result<ServerConfig> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&a.log).context("--log")?)
        .with_writer(std::io::stderr)
        .init();
    let mut cfg = match &a.config {
        Some(p) => ServerConfig::from_toml_file(p)?,
        None => ServerConfig::default(),
    };
    if let Some(v) = a.listen {
        cfg.listen = v;
    }
    if let Some(v) = a.data_listen {
        cfg.data_listen = v;
    }
    if let Some(v) = a.metrics {
        cfg.metrics_listen = Some(v);
    }
    if a.no_metrics {
        cfg.metrics_listen = None;
    }
    if let Some(v) = &a.data_dir {
        cfg.data_dir = v.clone();
    }
    if let Some(v) = a.dram_capacity {
        cfg.dram_capacity = v;
    }
    if a.dram_prefault {
        cfg.dram_prefault = true;
    }
    if let Some(v) = &a.cpus {
        cfg.cpus = Some(v.clone());
    }
    if let Some(v) = a.disk_capacity {
        cfg.disk_capacity = v;
    }
    if let Some(v) = &a.disk_codec {
        cfg.disk_codec = v.clone();
    }
    if let Some(v) = a.max_context_tokens {
        cfg.max_context_tokens = v;
    }
    if let Some(v) = a.session_ttl {
        cfg.session_ttl = v;
    }
    if let Some(v) = &a.auth_token {
        cfg.auth_token = Some(v.clone());
    }
    if let Some(v) = &a.cluster {
        cfg.cluster = Some(v.clone());
    }
    if let Some(v) = &a.node_id {
        cfg.node_id = Some(v.clone());
    }
    if let Some(v) = &a.advertise_host {
        cfg.advertise_host = Some(v.clone());
    }
    cfg.validate()?;
    Ok(cfg)
}

async fn serve(a: ServeArgs, cfg: ServerConfig) -> anyhow::Result<()> {
    let handle = match cfg.metrics_listen {
        Some(_) => Some(kvtier_server::metrics::install()?),
        None => None,
    };
    let (cap, disk_cap, dir) = (cfg.dram_capacity, cfg.disk_capacity, cfg.data_dir.clone());
    // With TLS, nodes reach each other over TLS too: the node's own certificate as the client's
    // (node certificates from `kvtier cert node` are good for both), peers checked against
    // `client_ca`, the CA the cluster's certificates come from.
    let peer_tls = match (&cfg.tls, &cfg.cluster) {
        (Some(t), Some(_)) => {
            let ca = t.client_ca.as_deref().context(
                "a cluster with [tls] needs tls.client_ca: the CA the nodes' certificates come from (nodes verify each other with it)",
            )?;
            Some(kvtier_client::ClientTls::from_files(ca, Some((&t.cert, &t.key)))?)
        }
        _ => None,
    };
    let quic = cfg.peer_transport == "quic";
    let peer_transport = peers::ClientTransport::new(cfg.auth_token.clone(), cfg.peer_timeout.0, peer_tls, quic);
    let mut server = kvtier_server::start(cfg, handle).await?;
    server.attach_peers(std::sync::Arc::new(peer_transport));
    if let Some(device) = &a.rdma_device {
        if let Err(e) = fabric::attach_rdma(&server.state, device) {
            server.stop(Duration::from_secs(5)).await?;
            return Err(e);
        }
    }
    let metrics = server.metrics_addr.map(|m| format!("http://{m}/metrics")).unwrap_or_else(|| "off".into());
    let disk = match server.state.disk_recovery() {
        Some(r) => format!(
            " disk={disk_cap} (recovered {} blocks, {} bytes, {} discarded, {} sessions, in {} ms)",
            r.blocks,
            r.bytes,
            r.discarded,
            server.state.sessions().len(),
            r.millis
        ),
        None => String::new(),
    };
    println!(
        "kvtier {} listening grpc={} data={} metrics={} dram={} data_dir={}{disk}",
        env!("CARGO_PKG_VERSION"),
        server.grpc_addr,
        server.data_addr,
        metrics,
        cap,
        dir.display()
    );
    std::io::stdout().flush()?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    server.stop(Duration::from_secs(5)).await?;
    Ok(())
}

impl NsArgs {
    fn namespace(&self) -> anyhow::Result<Namespace> {
        let layout =
            KvLayout::new(self.layers, self.kv_heads, self.head_dim, DType::parse(&self.dtype)?, self.block_tokens);
        let hashing = if self.sha256 { HashScheme::Sha256 } else { HashScheme::Blake3 };
        Ok(Namespace::new(&self.tenant, &self.model, layout, hashing, self.salt.as_bytes()))
    }
}

async fn connect(c: &ConnArgs) -> anyhow::Result<(KvClient, NamespaceHandle)> {
    let cfg = c.client_config()?;
    let client = KvClient::connect(&c.server, cfg).await.with_context(|| format!("connecting to {}", c.server))?;
    let ns = client.register(c.ns.namespace()?).await?;
    Ok((client, ns))
}

impl TokensArgs {
    fn tokens(&self) -> anyhow::Result<Vec<u32>> {
        match (&self.text, &self.tokens) {
            (Some(t), None) => Ok(t.bytes().map(u32::from).collect()),
            (None, Some(t)) => Ok(t.clone()),
            _ => bail!("give the tokens with --text or --tokens"),
        }
    }
}

/// A payload derived from a key, so a hand-run `put` and a later `get` can be compared.
fn synthetic(key: &BlockKey, len: u64) -> Bytes {
    let mut out = vec![0u8; len as usize];
    blake3::Hasher::new().update(&key.0).finalize_xof().fill(&mut out);
    Bytes::from(out)
}

/// Payloads for `keys` (full blocks, then optionally a tail of `tail_tokens`).
fn payloads(
    ns: &NamespaceHandle,
    file: Option<&PathBuf>,
    keys: &[BlockKey],
    tail: Option<(BlockKey, u32)>,
) -> anyhow::Result<Vec<Bytes>> {
    let layout = ns.namespace.layout;
    let mut sizes: Vec<(BlockKey, u64)> = keys.iter().map(|k| (*k, layout.block_bytes())).collect();
    if let Some((k, n)) = tail {
        sizes.push((k, layout.bytes_for_tokens(n)));
    }
    match file {
        None => Ok(sizes.iter().map(|(k, n)| synthetic(k, *n)).collect()),
        Some(p) => {
            let data = Bytes::from(std::fs::read(p).with_context(|| format!("reading {}", p.display()))?);
            let need: u64 = sizes.iter().map(|(_, n)| n).sum();
            if data.len() as u64 != need {
                bail!(
                    "{} is {} bytes; {} block(s) of this layout need exactly {need}",
                    p.display(),
                    data.len(),
                    sizes.len()
                );
            }
            let mut off = 0usize;
            Ok(sizes
                .iter()
                .map(|(_, n)| {
                    let b = data.slice(off..off + *n as usize);
                    off += *n as usize;
                    b
                })
                .collect())
        }
    }
}

fn short(b: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(b))
}

async fn put(a: PutArgs) -> anyhow::Result<()> {
    let (client, ns) = connect(&a.t.conn).await?;
    let tokens = a.t.tokens()?;
    let keys = ns.keys(&tokens);
    if keys.is_empty() {
        bail!("{} tokens make no full block of {} tokens", tokens.len(), ns.block_tokens());
    }
    let blocks = payloads(&ns, a.file.as_ref(), &keys, None)?;
    let report = client.store(&ns, &tokens, &blocks).await?;
    let bytes: usize = blocks.iter().map(|b| b.len()).sum();
    println!(
        "stored {} of {} block(s), {} bytes, covering {} tokens",
        report.stored,
        keys.len(),
        bytes,
        keys.len() * ns.block_tokens()
    );
    for (i, st) in &report.rejected {
        println!("  block {i} rejected: {}", st.describe());
    }
    report.ok()?;
    Ok(())
}

async fn get(a: GetArgs) -> anyhow::Result<()> {
    let (client, ns) = connect(&a.t.conn).await?;
    let tokens = a.t.tokens()?;
    let blocks = client.load(&ns, &tokens).await?;
    println!("loaded {} block(s) = {} tokens of {}", blocks.len(), blocks.len() * ns.block_tokens(), tokens.len());
    for (i, b) in blocks.iter().enumerate() {
        println!("  block {i}: {} bytes xxh3={}", b.len(), short(b));
    }
    if let Some(p) = a.out {
        let mut f = std::fs::File::create(&p).with_context(|| format!("creating {}", p.display()))?;
        for b in &blocks {
            f.write_all(b)?;
        }
        println!("wrote {}", p.display());
    }
    Ok(())
}

async fn lookup(a: TokensArgs) -> anyhow::Result<()> {
    let (client, ns) = connect(&a.conn).await?;
    let tokens = a.tokens()?;
    let n = client.lookup(&ns, &tokens).await?;
    println!("{n} of {} tokens are stored", tokens.len());
    Ok(())
}

async fn session(s: SessionCmd) -> anyhow::Result<()> {
    match s {
        SessionCmd::Park { t, id, ttl, file } => {
            let (client, ns) = connect(&t.conn).await?;
            let tokens = t.tokens()?;
            let keys = ns.keys(&tokens);
            let tail = ns.tail_key(&tokens).map(|k| (k, (tokens.len() % ns.block_tokens()) as u32));
            let blocks = payloads(&ns, file.as_ref(), &keys, tail)?;
            let opts = ParkOptions { ttl: ttl.map(|d| d.0), priority: None };
            let info = client.park(&ns, &id, &tokens, &blocks, &opts, 0).await?;
            println!(
                "parked {:?} v{}: {} tokens, {} blocks{}, expires in {:?}",
                info.id,
                info.version,
                info.token_count,
                info.blocks,
                if info.has_tail { " + tail" } else { "" },
                info.expires_in
            );
        }
        SessionCmd::Extend { t, id } => {
            let (client, ns) = connect(&t.conn).await?;
            let tokens = t.tokens()?;
            let cur = client.resume(&ns, &id).await?;
            let prev = cur.info.token_count as usize;
            let base = prev / ns.block_tokens();
            let keys = ns.keys(&tokens);
            let tail = ns.tail_key(&tokens).map(|k| (k, (tokens.len() % ns.block_tokens()) as u32));
            let blocks = payloads(&ns, None, &keys[base.min(keys.len())..], tail)?;
            let info = client.extend(&ns, &id, cur.info.version, prev, &tokens, &blocks).await?;
            println!(
                "extended {:?} to v{}: {} tokens, {} blocks",
                info.id, info.version, info.token_count, info.blocks
            );
        }
        SessionCmd::Resume { conn, id, out } => {
            let (client, ns) = connect(&conn).await?;
            let r = client.resume(&ns, &id).await?;
            println!(
                "resumed {:?} v{}: {} tokens in {} block(s), expires in {:?}",
                r.info.id,
                r.info.version,
                r.info.token_count,
                r.blocks.len(),
                r.info.expires_in
            );
            for (i, b) in r.blocks.iter().enumerate() {
                println!("  block {i}: {} bytes xxh3={}", b.len(), short(b));
            }
            if let Some(p) = out {
                let mut f = std::fs::File::create(&p)?;
                for b in &r.blocks {
                    f.write_all(b)?;
                }
                println!("wrote {}", p.display());
            }
        }
        SessionCmd::Ls(conn) => {
            let (client, ns) = connect(&conn).await?;
            let list = client.list_sessions(Some(&ns)).await?;
            println!("{} session(s)", list.len());
            for s in list {
                println!(
                    "  {:<24} v{:<4} {:>8} tokens {:>6} blocks {:>12} bytes  expires in {:?}",
                    s.id, s.version, s.token_count, s.blocks, s.bytes, s.expires_in
                );
            }
        }
        SessionCmd::Drop { conn, id } => {
            let (client, ns) = connect(&conn).await?;
            let dropped = client.drop_session(&ns, &id).await?;
            println!("{}", if dropped { format!("dropped {id:?}") } else { format!("no session {id:?}") });
        }
    }
    Ok(())
}

async fn stats(c: ConnArgs) -> anyhow::Result<()> {
    let client = KvClient::connect(&c.server, c.client_config()?).await?;
    let s = client.stats().await?;
    println!(
        "uptime {:?}, {} namespace(s), {} session(s)",
        Duration::from_millis(s.uptime_ms),
        s.namespaces,
        s.sessions
    );
    for t in s.tiers {
        println!(
            "{}: {} blocks, resident {} / allocated {} / cap {} bytes, pinned {}; hits {} misses {} evictions {}; in {} out {} bytes",
            t.tier, t.blocks, t.resident_bytes, t.allocated_bytes, t.capacity_bytes, t.pinned_bytes, t.hits, t.misses, t.evictions, t.bytes_in, t.bytes_out
        );
    }
    Ok(())
}
