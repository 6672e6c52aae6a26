//! The `kvtier` binary: `kvtier serve` runs a node, `kvtier agent` a GPU agent beside it; the other subcommands are a small client for
//! trying a node by hand (`put`, `get`, `lookup`, `session park|resume|extend|ls|drop`, `stats`);
//! `kvtier cert` makes TLS certificates.

/// One line of a client command's answer on stdout, as `println!` but returning an error
/// instead of panicking: a reader that went away (`kvtier stats | head -1`) ends the command
/// quietly (see [`StdoutClosed`]).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_line(format_args!($($arg)*))
    };
}

mod agent;
mod fabric;
mod lease_lane;
mod peers;
mod plan;
mod watch;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, CommandFactory, Parser, Subcommand};
use kvtier_client::{ClientConfig, ClientError, KvClient, NamespaceHandle, ParkOptions};
use kvtier_proto::dataplane::ItemStatus;
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
    Stats(NodeArgs),
    /// Remove every unpinned block of a namespace, on the node and on every other member of its
    /// cluster.
    Purge(ConnArgs),
    /// Remove a namespace (its sessions, its blocks and its slot), on the node and on every other
    /// member of its cluster.
    Unregister(ConnArgs),
    /// Follow a node's KV events (stored, evicted, purged keys; sessions), one line each.
    Events(watch::EventsArgs),
    /// Which nodes hold how long a prefix of a token sequence, and a session: a routing hint.
    Route(watch::RouteArgs),
    /// TLS certificates: a CA, node certificates, client certificates (mTLS tenants).
    #[command(subcommand)]
    Cert(cert::CertCmd),
    /// Capacity planner: what a fleet's tiers hold and the prefill they save (runs
    /// `kvtier-bench plan` from beside this binary).
    Plan(plan::PlanArgs),
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
    /// Bearer token /metrics requires (16..=1024 bytes; required when --metrics is beyond loopback).
    #[arg(long, env = "KVTIER_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    /// Register the DRAM arena with this RDMA device (`any`: the first), so peers lease its
    /// slots and move blocks one-sidedly (needs the `rdma` build feature and a verbs device).
    #[arg(long, env = "KVTIER_RDMA_DEVICE")]
    rdma_device: Option<String>,
    /// Where the node keeps its disk tier, session log and namespaces (default ./kvtier-data);
    /// one node per directory (it is locked while the node runs).
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

/// How to reach a node.
#[derive(Args, Clone)]
struct NodeArgs {
    /// The server's gRPC address.
    #[arg(long, env = "KVTIER_SERVER", default_value = "127.0.0.1:7070")]
    server: String,
    #[arg(long, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
    /// How long each call to the node may take (connecting included), e.g. 5s or 2m: a node
    /// that accepts connections but does not answer (stopped, overloaded) fails after this.
    #[arg(long, env = "KVTIER_TIMEOUT", default_value = "30s")]
    timeout: DurationStr,
}

/// TLS to a node (`kvtier agent` takes the same flags).
#[derive(Args, Clone)]
pub(crate) struct TlsArgs {
    /// The CA (PEM) of a server that runs TLS: connect over TLS.
    #[arg(long, env = "KVTIER_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), for servers that take client certificates; with --tls-key.
    #[arg(long, env = "KVTIER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "KVTIER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The client's TLS settings (`None`: plain TCP); the files are read and checked here.
    pub(crate) fn client_tls(&self) -> anyhow::Result<Option<kvtier_client::ClientTls>> {
        let ident = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            (None, None) => None,
            _ => bail!("--tls-cert and --tls-key go together"),
        };
        match &self.tls_ca {
            Some(ca) => Ok(Some(kvtier_client::ClientTls::from_files(ca, ident)?)),
            None if ident.is_some() => {
                bail!("--tls-cert and --tls-key need --tls-ca (the CA of the server's certificate)")
            }
            None => Ok(None),
        }
    }
}

/// A node, and a namespace on it.
#[derive(Args, Clone)]
struct ConnArgs {
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    ns: NsArgs,
}

impl NodeArgs {
    fn client_config(&self) -> anyhow::Result<ClientConfig> {
        let tls = self.tls.client_tls()?;
        let timeout = self.timeout.0;
        if timeout.is_zero() {
            bail!("--timeout must be positive");
        }
        Ok(ClientConfig {
            auth_token: self.auth_token.clone(),
            tls,
            request_timeout: timeout,
            connect_timeout: timeout.min(ClientConfig::default().connect_timeout),
            ..Default::default()
        })
    }
}

/// The namespace to use (defaults: a small demo model).
#[derive(Args, Clone)]
struct NsArgs {
    /// The namespace's tenant (default: the tenant of the credential given, else `cli`).
    #[arg(long)]
    tenant: Option<String>,
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
        /// Time to live, e.g. 30s, 10m (default: the server's session TTL).
        #[arg(long, value_parser = positive_duration)]
        ttl: Option<DurationStr>,
        /// Full blocks then the tail, back to back; synthetic if absent.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Replace the session if one with this id exists (its version is read first; the
        /// park fails if it changes meanwhile).
        #[arg(long)]
        replace: bool,
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
    /// List live sessions of the namespace (with --all: of every namespace the credential may read).
    Ls {
        #[command(flatten)]
        conn: ConnArgs,
        /// Every namespace's sessions (the namespace flags are ignored), each with its namespace id.
        #[arg(long)]
        all: bool,
        /// Only the node asked's copies. Without it, in a cluster every member is asked and each
        /// session is listed once (its newest version), with the members holding a copy.
        #[arg(long)]
        here: bool,
    },
    /// Drop a session and unpin its blocks.
    Drop {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(long)]
        id: String,
    },
}

/// A duration flag that must be more than zero (a session parked with a TTL of 0 is already
/// expired).
fn positive_duration(s: &str) -> Result<DurationStr, String> {
    let d: DurationStr = s.parse()?;
    if d.0.is_zero() {
        return Err(format!("{s:?} is no time at all: a session parked for 0 is already expired (try 30s or 10m)"));
    }
    Ok(d)
}

/// Stdout was closed by its reader (a pipe into `head`): the command stops there, quietly.
#[derive(Debug)]
struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// What [`outln!`] runs.
fn write_line(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        other => other.context("writing to stdout"),
    }
}

/// An error as one line: each cause once. A cause whose text the message holds already (an
/// error that prints its source inside its own text) is not repeated.
fn describe(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Exit status of a command whose stdout closed under it: what a shell reports for a process
/// ended by SIGPIPE (128 + 13), as for any other command in a pipe that closed early.
const CLOSED_PIPE_EXIT: u8 = 141;

/// Clap's own exit for a command line it refused, saying which environment variable a bad value
/// came from: clap names the flag (`--dram-capacity`) even where the flag was not given and the
/// value was `KVTIER_DRAM_CAPACITY`'s.
fn exit_on_parse_error(e: clap::Error) -> ! {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let from_env = match (e.kind(), e.get(ContextKind::InvalidArg)) {
        (ErrorKind::ValueValidation | ErrorKind::InvalidValue, Some(ContextValue::String(arg))) => {
            let long = arg.split_whitespace().next().unwrap_or_default().trim_start_matches("--");
            env_source(&command_line(), long)
        }
        _ => None,
    };
    match from_env {
        Some(var) => {
            let text = e.render().to_string();
            let (first, rest) = text.split_once('\n').unwrap_or((&text, ""));
            eprintln!("{first} (its value came from the environment variable {var})\n{}", rest.trim_end());
            std::process::exit(2)
        }
        None => e.exit(),
    }
}

/// The command line after the program's name. Not `args()`: an argument that is not UTF-8 would
/// panic it.
fn command_line() -> Vec<String> {
    std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect()
}

/// The environment variable flag `--long` took its value from: the one it reads in the
/// subcommand `args` run (flags of the same name in other subcommands may read other variables:
/// `--metrics` of `serve` and of `agent`), where that variable is set and the flag was not given.
fn env_source(args: &[String], long: &str) -> Option<String> {
    let given = args.iter().any(|a| {
        a.strip_prefix("--")
            .and_then(|a| a.strip_prefix(long))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
    });
    if given {
        return None;
    }
    let root = Cli::command();
    let mut cmd = &root;
    for a in args {
        match cmd.find_subcommand(a) {
            Some(sub) => cmd = sub,
            None if a.starts_with('-') => continue,
            None => break,
        }
    }
    let var = cmd.get_arguments().find(|a| a.get_long() == Some(long)).and_then(|a| a.get_env());
    var.map(|v| v.to_string_lossy().into_owned()).filter(|var| std::env::var_os(var).is_some())
}

/// A configuration error that starts with a setting or its flag (`dram_capacity 100000B is below
/// …`, `--pool-fraction must be …`) whose value came from the environment (the flag not given,
/// its variable set): says which variable, as a bad value clap refused does.
fn with_env_source(e: anyhow::Error) -> anyhow::Error {
    let text = e.to_string();
    let head = text.trim_start_matches("invalid configuration: ");
    let head = head.strip_prefix("--").unwrap_or(head);
    let setting = head.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-')).next();
    let Some(long) = setting.filter(|s| !s.is_empty()).map(|s| s.replace('_', "-")) else { return e };
    match env_source(&command_line(), &long) {
        // The causes kept: `describe` prints each once, and this line holds the first.
        Some(var) => e.context(format!("{text} (its value came from the environment variable {var})")),
        None => e,
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.chain().any(|c| c.is::<StdoutClosed>()) => ExitCode::from(CLOSED_PIPE_EXIT),
        Err(e) => {
            // A user's error is a sentence, not a stack: the backtrace anyhow took (under
            // RUST_BACKTRACE) is shown only where RUST_LIB_BACKTRACE asks for it.
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "Error: {}", describe(&e));
            if std::env::var_os("RUST_LIB_BACKTRACE").is_some_and(|v| v != "0") {
                let _ = writeln!(err, "\n{}", e.backtrace());
            }
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::try_parse().unwrap_or_else(|e| exit_on_parse_error(e));
    let cmd = match cli.cmd {
        Cmd::Plan(a) => std::process::exit(plan::run(&a)?),
        Cmd::Cert(c) => return cert::run(c),
        other => other,
    };
    if let Cmd::Serve(a) = cmd {
        // The configuration first: its `cpus` confine the process before the runtime starts,
        // which then runs one worker per CPU of the set.
        let cfg = serve_config(&a)?;
        if let Some(list) = &cfg.cpus {
            let cpus = kvtier_server::affinity::parse_cpulist(list).map_err(|e| with_env_source(e.into()))?;
            kvtier_server::affinity::confine_process(&cpus).map_err(|e| with_env_source(e.into()))?;
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
            Cmd::Purge(c) => delete(c, false).await,
            Cmd::Unregister(c) => delete(c, true).await,
            Cmd::Events(a) => watch::events(a).await,
            Cmd::Route(a) => watch::route(a).await,
            Cmd::Plan(_) | Cmd::Cert(_) => Ok(()),
        }
    })
}

/// Logs to stderr at `filter` (`--log`), coloured only when stderr is a terminal: a log sent to a
/// file or a pipe carried escape codes.
pub fn init_logging(filter: &str) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(filter).context("--log")?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(())
}

/// `serve`'s configuration: the file, then environment and flags over it, validated; logging set
/// up.
fn serve_config(a: &ServeArgs) -> anyhow::Result<ServerConfig> {
    init_logging(&a.log)?;
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
    if let Some(v) = &a.metrics_token {
        cfg.metrics_token = Some(v.clone());
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
        // KVTIER_AUTH_TOKEN is also the CLI's: exported for the client in the shell that starts
        // the node, it replaced the file's token without a word.
        if cfg.auth_token.as_ref().is_some_and(|f| f != v) {
            tracing::warn!(
                "auth_token: --auth-token / KVTIER_AUTH_TOKEN overrides the one in {} (they differ)",
                a.config.as_ref().map_or("the config file".into(), |p| p.display().to_string())
            );
        }
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
    cfg.validate().map_err(|e| with_env_source(e.into()))?;
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
            " disk={} (recovered {} blocks, {} of deleted namespaces dropped, {} bytes scanned, {} discarded, {} sessions, in {} ms)",
            disk_cap.approx(),
            r.blocks.saturating_sub(r.deleted),
            r.deleted,
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
        cap.approx(),
        dir.display()
    );
    std::io::stdout().flush()?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let fenced = server.membership.fenced();
    let fenced = tokio::select! {
        _ = tokio::signal::ctrl_c() => None,
        _ = term.recv() => None,
        why = fenced => Some(why),
    };
    tracing::info!("shutting down");
    server.stop(Duration::from_secs(5)).await?;
    tracing::info!("stopped");
    match fenced {
        Some(why) => bail!("stopped: {why}"),
        None => Ok(()),
    }
}

impl NsArgs {
    /// The namespace the flags name; `tenant` is the node's word for the credential's (empty for
    /// the operator), the namespace's tenant unless `--tenant` names one.
    fn namespace(&self, tenant: &str) -> anyhow::Result<Namespace> {
        let layout =
            KvLayout::new(self.layers, self.kv_heads, self.head_dim, DType::parse(&self.dtype)?, self.block_tokens);
        let hashing = if self.sha256 { HashScheme::Sha256 } else { HashScheme::Blake3 };
        let tenant = match (&self.tenant, tenant) {
            (Some(t), _) => t.as_str(),
            (None, "") => "cli",
            (None, t) => t,
        };
        let ns = Namespace::new(tenant, &self.model, layout, hashing, self.salt.as_bytes());
        // Checked here, before connecting: these are this command's own flags.
        if let Err(e) = ns.validate() {
            bail!("{e} (the namespace flags: --layers, --kv-heads, --head-dim, --dtype, --block-tokens, --tenant, --model)");
        }
        Ok(ns)
    }
}

/// A client of the node `c` names, no namespace registered.
async fn connect_client(c: &NodeArgs) -> anyhow::Result<KvClient> {
    let cfg = c.client_config()?;
    match KvClient::connect(&c.server, cfg).await {
        Ok(client) => Ok(client),
        // It names the address already (no context); its hint, in this command's flags.
        Err(e @ ClientError::Connect { .. }) => {
            let text = e.to_string();
            let flag = if text.contains("runs TLS") {
                "--tls-ca"
            } else if text.contains("client certificate") {
                "--tls-cert and --tls-key"
            } else {
                return Err(e.into());
            };
            match text.strip_suffix(')') {
                Some(t) => bail!("{t}: {flag})"),
                None => bail!("{text} ({flag})"),
            }
        }
        Err(e) => Err(e).with_context(|| format!("connecting to {}", c.server)),
    }
}

/// A client and the namespace of the namespace flags, registered.
async fn connect(c: &ConnArgs) -> anyhow::Result<(KvClient, NamespaceHandle)> {
    // The flags checked before connecting.
    c.ns.namespace("")?;
    let client = connect_client(&c.node).await?;
    let ns = c.ns.namespace(&client.server_info().tenant)?;
    let ns = client.register(ns).await?;
    Ok((client, ns))
}

/// [`connect`] for commands that read or remove what is there. On a node alone the namespace
/// is not registered, so a question about one that does not exist (a typo in a flag) is
/// answered about that one — none there — and creates nothing (it created the namespace, for
/// good, and took a tenant's `max_namespaces` slot). In a cluster a node learns a namespace when
/// first asked about it, and the other members may hold what it does not (a resume, a load from
/// the owners, a purge or unregistration passed on to them): so it is registered on the node
/// asked when some member knows it, or one could not be asked; a namespace no member knows is
/// answered about as on one node, taking no slot of the tenant's anywhere. A tenant at its
/// `max_namespaces` is answered about the namespace as it is (none there).
async fn connect_existing(c: &ConnArgs) -> anyhow::Result<(KvClient, NamespaceHandle)> {
    c.ns.namespace("")?;
    let client = connect_client(&c.node).await?;
    let spec = c.ns.namespace(&client.server_info().tenant)?;
    let members = client.members().await.unwrap_or_default();
    let known = members.members.len() > 1 && known_on_some_member(&client, &members, &c.node, &spec).await;
    let ns = match known {
        false => NamespaceHandle::unregistered(spec)?,
        true => match client.register(spec.clone()).await {
            Err(ClientError::QuotaExceeded(_)) => NamespaceHandle::unregistered(spec)?,
            other => other?,
        },
    };
    Ok((client, ns))
}

/// Whether some member of the cluster knows namespace `spec` (asked with a lookup of one key,
/// which a node refuses for a namespace it does not know), or some member gave no answer.
async fn known_on_some_member(
    client: &KvClient,
    members: &kvtier_client::ClusterMembers,
    node: &NodeArgs,
    spec: &Namespace,
) -> bool {
    let Ok(handle) = NamespaceHandle::unregistered(spec.clone()) else { return true };
    let Ok(answers) = ask_each_member(client, members, node, |c| {
        let handle = &handle;
        async move { c.lookup_keys(handle, &[BlockKey([0; 32])]).await }
    })
    .await
    else {
        return true;
    };
    answers.into_iter().any(|a| !matches!(a.answer, Err(ClientError::UnknownNamespace(_))))
}

/// One member's answer to [`ask_each_member`].
struct MemberAnswer<T> {
    /// The member's id.
    node: String,
    /// Whether it is the node the command is connected to.
    asked: bool,
    answer: Result<T, ClientError>,
}

/// Asks every member of a cluster `ask`: the node asked through `client`, the command's own
/// connection (bounded by `--timeout` as its other calls are; its advertised address may not be
/// reachable from here, behind NAT), each other member on a connection of its own within
/// [`MEMBER_WAIT`] (at most `--timeout`), so one that hangs (stopped, cut off) answers
/// `Timeout` without holding the command up.
async fn ask_each_member<T, F, Fut>(
    client: &KvClient,
    members: &kvtier_client::ClusterMembers,
    node: &NodeArgs,
    ask: F,
) -> anyhow::Result<Vec<MemberAnswer<T>>>
where
    F: Fn(KvClient) -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let cfg = node.client_config()?;
    let wait = MEMBER_WAIT.min(cfg.request_timeout);
    let asks = members.members.iter().map(|m| {
        let asked = members.local.as_ref() == Some(&m.id);
        let (cfg, ask) = (cfg.clone(), &ask);
        async move {
            let answer = match asked {
                true => ask(client.clone()).await,
                false => {
                    let dialled = async { ask(KvClient::connect(&m.grpc_addr, cfg).await?).await };
                    tokio::time::timeout(wait, dialled).await.unwrap_or(Err(ClientError::Timeout(wait)))
                }
            };
            MemberAnswer { node: m.id.as_str().to_string(), asked, answer }
        }
    });
    Ok(futures::future::join_all(asks).await)
}

/// What a read of a namespace the node does not know says beside its (empty) answer.
const NO_SUCH_NAMESPACE: &str =
    "the node holds no such namespace: never registered on it, or unregistered; check the namespace flags and the \
     credential (another tenant's namespace is answered as none)";

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
    // The bytes of the blocks stored, not of those sent.
    let rejected: usize = report.rejected.iter().filter_map(|(i, _)| blocks.get(*i)).map(|b| b.len()).sum();
    let bytes = blocks.iter().map(|b| b.len()).sum::<usize>() - rejected;
    // The tokens covered, where every block was stored (a refused one leaves a gap).
    let covering = match report.rejected.is_empty() {
        true => format!(", covering {} tokens", keys.len() * ns.block_tokens()),
        false => String::new(),
    };
    outln!("stored {} of {} block(s), {} bytes{covering}", report.stored, keys.len(), bytes)?;
    // One line per reason, not per block: a refused namespace refuses every block alike.
    let mut reasons: Vec<(ItemStatus, Vec<usize>)> = Vec::new();
    for &(i, st) in &report.rejected {
        match reasons.iter_mut().find(|(s, _)| *s == st) {
            Some((_, blocks)) => blocks.push(i),
            None => reasons.push((st, vec![i])),
        }
    }
    for (st, blocks) in &reasons {
        let which = index_ranges(blocks);
        outln!("  rejected block(s) {which}: {}{}", coded(*st), st.describe())?;
    }
    if let Some((st, _)) = reasons.first() {
        bail!("{}{} of {} block(s) refused (why above)", coded(*st), report.rejected.len(), keys.len());
    }
    // Stored is not held: a prefix larger than what the node keeps evicts its own first blocks,
    // and a lookup (longest prefix from the start) then finds nothing. Say so.
    let stored_tokens = keys.len() * ns.block_tokens();
    let held = client.lookup(&ns, &tokens).await?;
    if held < stored_tokens {
        // Which cap: with a disk tier, evicted blocks went down to it unless it could not take them.
        let has_disk = client.stats().await.is_ok_and(|s| s.tiers.iter().any(|t| t.tier == "disk"));
        let why = if has_disk {
            "its DRAM and disk tiers are full, or its disk refused writes (a full file system); see `kvtier stats` \
             and the node's log"
        } else {
            "its DRAM cap; see `kvtier stats`, or give it --dram-capacity or --disk-capacity"
        };
        outln!(
            "note: only {held} of those {stored_tokens} tokens are held from the start now: the node evicted \
             blocks to make room ({why})"
        )?;
    }
    Ok(())
}

/// A session write's error: a block the node refused is the write's refusal, said as such (the
/// first block refused is where the upload stopped; no session was written).
fn block_refused(what: &str, e: ClientError, blocks: usize) -> anyhow::Error {
    match e {
        ClientError::Rejected { index, status } => anyhow::anyhow!(
            "{}session {what} refused: {} (block {index} was the first refused, of {blocks} sent; the session was not \
             written)",
            coded(status),
            status.describe()
        ),
        e => e.into(),
    }
}

/// `1 block`, `2 blocks`.
fn count_of(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// Sorted indices as runs: `0-3, 7, 9-10` (a refused file of many blocks is one short line).
fn index_ranges(ix: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &i in ix {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == i => *end = i,
            _ => runs.push((i, i)),
        }
    }
    let runs: Vec<String> =
        runs.iter().map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
    runs.join(", ")
}

/// How long a command that asks every member of a cluster (`session ls`, a read's check that
/// some member knows the namespace) waits for each other one (at most `--timeout`).
const MEMBER_WAIT: Duration = Duration::from_secs(5);

/// What a listing says of the members that left lately (newest first, three named): "member n2
/// left the cluster 4s ago: the sessions only it held are not listed (they come back when it
/// rejoins)"; `None` when none did.
fn departed_note(departed: &[(kvtier_proto::cluster::NodeId, Duration)]) -> Option<String> {
    let (member, it) = match departed.len() {
        0 => return None,
        1 => ("member", "it"),
        _ => ("members", "they"),
    };
    let mut named: Vec<String> =
        departed.iter().take(3).map(|(n, ago)| format!("{} ({}s ago)", n.as_str(), ago.as_secs())).collect();
    if departed.len() > 3 {
        named.push(format!("{} more", departed.len() - 3));
    }
    Some(format!(
        "{member} {} left the cluster: the sessions only {it} held are not listed (they come back when {it} rejoin{})",
        named.join(", "),
        if departed.len() == 1 { "s" } else { "" }
    ))
}

/// A session's time left as a person reads it, to the second: "9m59s", "1h05m", "42s" (a
/// `Duration`'s debug form printed "599.985s").
fn remaining(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{}ms", d.as_millis()),
        1..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// A refused block's stable code and a colon, for the start of a line.
fn coded(st: ItemStatus) -> String {
    st.code().map(|c| format!("{c}: ")).unwrap_or_default()
}

async fn get(a: GetArgs) -> anyhow::Result<()> {
    let (client, ns) = connect_existing(&a.t.conn).await?;
    let tokens = a.t.tokens()?;
    let blocks = match client.load(&ns, &tokens).await {
        Err(ClientError::UnknownNamespace(_)) => {
            outln!("note: {NO_SUCH_NAMESPACE}")?;
            Vec::new()
        }
        other => other?,
    };
    // The file first: what is printed may go to a pipe that closes early (`| head`).
    let wrote = a.out.map(|p| write_blocks(&p, &blocks)).transpose()?;
    outln!("loaded {} block(s) = {} tokens of {}", blocks.len(), blocks.len() * ns.block_tokens(), tokens.len())?;
    for (i, b) in blocks.iter().enumerate() {
        outln!("  block {i}: {} bytes xxh3={}", b.len(), short(b))?;
    }
    if let Some(p) = wrote {
        outln!("wrote {}", p.display())?;
    }
    Ok(())
}

/// Writes `blocks` back to back to `path`; the path, for the caller to report.
fn write_blocks(path: &std::path::Path, blocks: &[bytes::Bytes]) -> anyhow::Result<PathBuf> {
    let mut f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    for b in blocks {
        f.write_all(b).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(path.to_path_buf())
}

async fn lookup(a: TokensArgs) -> anyhow::Result<()> {
    let (client, ns) = connect_existing(&a.conn).await?;
    let tokens = a.tokens()?;
    match client.lookup(&ns, &tokens).await {
        Ok(n) => outln!("{n} of {} tokens are stored", tokens.len())?,
        Err(ClientError::UnknownNamespace(_)) => {
            outln!("0 of {} tokens are stored ({NO_SUCH_NAMESPACE})", tokens.len())?
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// `purge` (or `unregister`): what went, here and on the other members; an error when a member
/// could not be reached (the node asks it again in the background).
async fn delete(c: ConnArgs, unregister: bool) -> anyhow::Result<()> {
    let (client, ns) = connect_existing(&c).await?;
    let d = if unregister { client.unregister(&ns).await? } else { client.purge(&ns).await? };
    let what = if unregister { "unregistered" } else { "purged" };
    let sessions = |n: u64| if unregister { format!("{n} session(s) and ") } else { String::new() };
    match &d.peers {
        Some(p) => outln!(
            "{what}: {}{} block(s) here, {}{} block(s) on {} other member(s)",
            sessions(d.sessions_dropped),
            d.blocks_removed,
            sessions(p.sessions_dropped),
            p.blocks_removed,
            p.members_done
        )?,
        None => outln!("{what}: {}{} block(s)", sessions(d.sessions_dropped), d.blocks_removed)?,
    }
    for m in d.away() {
        outln!(
            "{}: {} (it gets the {} when it is back)",
            m.node_id,
            m.reason,
            if unregister { "unregistration" } else { "purge" }
        )?;
    }
    if !d.missed().is_empty() {
        let who: Vec<String> = d.missed().iter().map(|m| format!("{} ({})", m.node_id, m.reason)).collect();
        bail!(
            "not done on {} member(s) of the cluster: {}; they may still hold its blocks until the node reaches them \
             (it asks again in the background; running this again is safe)",
            who.len(),
            who.join(", ")
        );
    }
    Ok(())
}

async fn session(s: SessionCmd) -> anyhow::Result<()> {
    match s {
        SessionCmd::Park { t, id, ttl, file, replace } => {
            let (client, ns) = connect(&t.conn).await?;
            let tokens = t.tokens()?;
            let keys = ns.keys(&tokens);
            let tail = ns.tail_key(&tokens).map(|k| (k, (tokens.len() % ns.block_tokens()) as u32));
            let blocks = payloads(&ns, file.as_ref(), &keys, tail)?;
            let opts = ParkOptions { ttl: ttl.map(|d| d.0), priority: None };
            let version = match replace {
                true => match client.session_manifest(&ns, &id).await {
                    Ok(m) => m.info.version,
                    Err(ClientError::SessionNotFound(_) | ClientError::SessionExpired(_)) => 0,
                    Err(e) => return Err(e.into()),
                },
                false => 0,
            };
            let info = client.park(&ns, &id, &tokens, &blocks, &opts, version).await.map_err(|e| match e {
                ClientError::SessionExists(_) => anyhow::anyhow!(
                    "{e}: pass --replace to park over it, `kvtier session extend` to add a turn to it, or \
                     `kvtier session drop` it first"
                ),
                e => block_refused("park", e, blocks.len()),
            })?;
            outln!(
                "parked {:?} v{}: {} tokens, {}{}, expires in {}",
                info.id,
                info.version,
                info.token_count,
                count_of(info.blocks as usize, "block"),
                if info.has_tail { " + tail" } else { "" },
                remaining(info.expires_in)
            )?;
        }
        SessionCmd::Extend { t, id } => {
            let (client, ns) = connect(&t.conn).await?;
            let tokens = t.tokens()?;
            // The manifest alone (version, token count): the blocks already parked stay where
            // they are.
            let cur = client.session_manifest(&ns, &id).await?;
            let prev = cur.info.token_count as usize;
            if prev > tokens.len() {
                bail!(
                    "session {id:?} holds {prev} tokens and the context given has {}: extend with the whole \
                     context (the session's tokens and the new ones)",
                    tokens.len()
                );
            }
            let base = prev / ns.block_tokens();
            let keys = ns.keys(&tokens);
            let tail = ns.tail_key(&tokens).map(|k| (k, (tokens.len() % ns.block_tokens()) as u32));
            let blocks = payloads(&ns, None, &keys[base.min(keys.len())..], tail)?;
            let info = client
                .extend(&ns, &id, cur.info.version, prev, &tokens, &blocks)
                .await
                .map_err(|e| block_refused("extend", e, blocks.len()))?;
            outln!(
                "extended {:?} to v{}: {} tokens, {}",
                info.id,
                info.version,
                info.token_count,
                count_of(info.blocks as usize, "block")
            )?;
        }
        SessionCmd::Resume { conn, id, out } => {
            let (client, ns) = connect_existing(&conn).await?;
            let r = client.resume(&ns, &id).await?;
            let wrote = out.map(|p| write_blocks(&p, &r.blocks)).transpose()?;
            outln!(
                "resumed {:?} v{}: {} tokens in {} block(s), expires in {}",
                r.info.id,
                r.info.version,
                r.info.token_count,
                r.blocks.len(),
                remaining(r.info.expires_in)
            )?;
            for (i, b) in r.blocks.iter().enumerate() {
                outln!("  block {i}: {} bytes xxh3={}", b.len(), short(b))?;
            }
            if let Some(p) = wrote {
                outln!("wrote {}", p.display())?;
            }
        }
        SessionCmd::Ls { conn, all, here } => {
            let (client, ns) = match all {
                true => (connect_client(&conn.node).await?, None),
                false => connect_existing(&conn).await.map(|(c, ns)| (c, Some(ns)))?,
            };
            let members = client.members().await.unwrap_or_default();
            // With --here, the node asked's copies alone (named, in a cluster).
            let cluster = !here && members.members.len() > 1;
            // Each member's list (in a cluster: the node asked through this connection, the
            // others each within a few seconds, so one that hangs doesn't hold the listing up),
            // or the node asked's.
            let lists: Vec<(String, Result<Vec<kvtier_client::SessionInfo>, ClientError>)> = if cluster {
                let answers = ask_each_member(&client, &members, &conn.node, |c| {
                    let ns = ns.as_ref();
                    async move { c.list_sessions(ns).await }
                })
                .await?;
                let mut lists = Vec::new();
                for a in answers {
                    match a.answer {
                        // The node asked answers as without a cluster: its refusal is the command's.
                        Err(e) if a.asked && !matches!(e, ClientError::UnknownNamespace(_)) => return Err(e.into()),
                        listed => lists.push((a.node, listed)),
                    }
                }
                lists
            } else {
                vec![(String::new(), client.list_sessions(ns.as_ref()).await)]
            };
            // Each session once: its newest copy, and who holds one (at which version).
            let mut listed: Vec<(kvtier_client::SessionInfo, Vec<(String, u64)>)> = Vec::new();
            let mut at: std::collections::HashMap<(kvtier_proto::NamespaceId, String), usize> = Default::default();
            let (mut answered, mut unknown) = (0, 0);
            for (node, list) in lists {
                let list = match list {
                    Ok(list) => list,
                    Err(ClientError::UnknownNamespace(_)) => {
                        (answered, unknown) = (answered + 1, unknown + 1);
                        continue;
                    }
                    Err(e) if cluster => {
                        // On stderr: stdout is the list a script reads.
                        eprintln!("note: member {node} did not answer ({e}): its copies are not listed");
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                answered += 1;
                for s in list {
                    match at.get(&(s.namespace, s.id.clone())) {
                        Some(&i) => {
                            let (l, holders) = &mut listed[i];
                            holders.push((node.clone(), s.version));
                            if s.version > l.version {
                                *l = s;
                            }
                        }
                        None => {
                            at.insert((s.namespace, s.id.clone()), listed.len());
                            let version = s.version;
                            listed.push((s, vec![(node.clone(), version)]));
                        }
                    }
                }
            }
            if answered > 0 && unknown == answered {
                outln!("note: {NO_SUCH_NAMESPACE}")?;
            }
            if let Some(left) = departed_note(&members.departed).filter(|_| !here) {
                eprintln!("note: {left}");
            }
            if cluster {
                listed.sort_by(|(a, _), (b, _)| (a.namespace.0, &a.id).cmp(&(b.namespace.0, &b.id)));
            }
            match members.local.as_ref().filter(|_| here) {
                Some(node) => outln!("{} session(s) on {} alone", listed.len(), node.as_str())?,
                None => outln!("{} session(s)", listed.len())?,
            }
            for (s, holders) in listed {
                // Full blocks, and the partial tail as `session resume` counts it (in its blocks).
                let blocks = format!("{}{}", s.blocks, if s.has_tail { " + tail" } else { "" });
                // With --all, the namespace each belongs to (its id: the first 8 bytes, in hex) and
                // its tenant ("-" from a node too old to say).
                let ns = match all {
                    true => {
                        let tenant = if s.tenant.is_empty() { "-" } else { s.tenant.as_str() };
                        format!("ns {} tenant {tenant:<10} ", hex_prefix(&s.namespace.0[..8]))
                    }
                    false => String::new(),
                };
                // In a cluster, the members holding a copy; a version only where copies differ.
                let on = match cluster {
                    false => String::new(),
                    true => {
                        let same = holders.iter().all(|(_, v)| *v == s.version);
                        let held: Vec<String> =
                            holders.iter().map(|(n, v)| if same { n.clone() } else { format!("{n} v{v}") }).collect();
                        format!("  on {}", held.join(", "))
                    }
                };
                outln!(
                    "  {ns}{:<24} v{:<4} {:>8} tokens {:>10} blocks {:>12} bytes  expires in {}{on}",
                    s.id,
                    s.version,
                    s.token_count,
                    blocks,
                    s.bytes,
                    remaining(s.expires_in)
                )?;
            }
        }
        SessionCmd::Drop { conn, id } => {
            let (client, ns) = connect_existing(&conn).await?;
            if !client.drop_session(&ns, &id).await? {
                // As a resume of it would: an error (exit 1), not an answer.
                anyhow::bail!(
                    "{}: no session {id:?} (never parked, dropped already, or expired): nothing dropped",
                    kvtier_proto::codes::SESSION_NOT_FOUND
                );
            }
            outln!("dropped {id:?}")?;
        }
    }
    Ok(())
}

/// `bytes` as lowercase hex.
fn hex_prefix(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn stats(c: NodeArgs) -> anyhow::Result<()> {
    let client = connect_client(&c).await?;
    let s = client.stats().await?;
    outln!(
        "uptime {:?}, {} namespace(s), {} session(s)",
        Duration::from_millis(s.uptime_ms),
        s.namespaces,
        s.sessions
    )?;
    for t in s.tiers {
        // The other members hold nothing of this node's: what was asked of them, and how it went.
        if t.tier == "peer" {
            outln!(
                "peer: {} requests, {} errors; hits {} misses {}; received {} bytes",
                t.requests,
                t.errors,
                t.hits,
                t.misses,
                t.bytes_in
            )?;
            continue;
        }
        outln!(
            "{}: {} blocks, resident {} / allocated {} / cap {} bytes, pinned {}; hits {} misses {} evictions {}; in {} out {} bytes",
            t.tier, t.blocks, t.resident_bytes, t.allocated_bytes, t.capacity_bytes, t.pinned_bytes, t.hits, t.misses, t.evictions, t.bytes_in, t.bytes_out
        )?;
    }
    // The operator's answer: each tenant's share (its quota as the cap where it has one).
    for t in s.tenants {
        let tiers: Vec<String> = t
            .tiers
            .iter()
            .map(|x| {
                format!(
                    "{} {} blocks, resident {} / cap {} bytes, pinned {}",
                    x.tier, x.blocks, x.resident_bytes, x.capacity_bytes, x.pinned_bytes
                )
            })
            .collect();
        outln!("tenant {}: {} namespace(s), {} session(s); {}", t.tenant, t.namespaces, t.sessions, tiers.join("; "))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_left_reads_to_the_second() {
        assert_eq!(remaining(Duration::from_millis(250)), "250ms");
        assert_eq!(remaining(Duration::from_millis(42_900)), "42s");
        assert_eq!(remaining(Duration::from_millis(599_985)), "9m59s");
        assert_eq!(remaining(Duration::from_secs(600)), "10m00s");
        assert_eq!(remaining(Duration::from_secs(3600 + 5 * 60 + 59)), "1h05m");
        assert_eq!(remaining(Duration::from_secs(2 * 86400)), "48h00m");
    }

    #[test]
    fn departed_members_are_named_newest_first_three_at_most() {
        let id = |s: &str| kvtier_proto::cluster::NodeId::new(s).unwrap();
        assert_eq!(departed_note(&[]), None);
        let one = departed_note(&[(id("n2"), Duration::from_millis(4_200))]).unwrap();
        assert_eq!(
            one,
            "member n2 (4s ago) left the cluster: the sessions only it held are not listed (they come back when it \
             rejoins)"
        );
        let five: Vec<_> = (1..=5).map(|i| (id(&format!("n{i}")), Duration::from_secs(i))).collect();
        let many = departed_note(&five).unwrap();
        assert!(many.starts_with("members n1 (1s ago), n2 (2s ago), n3 (3s ago), 2 more left the cluster"), "{many}");
        assert!(many.ends_with("when they rejoin)"), "{many}");
    }
}
