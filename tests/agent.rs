//! `kvtier agent` as a process beside a real `kvtier serve`: configured from an `[agent]` TOML
//! table, it answers engines on its Unix socket, serves `/metrics` and stops on SIGTERM (removing
//! its socket); configuration errors name the setting at fault; blocks only its G1 holds count in
//! the server's lookups and load through any client (the server asks the agent to spill them),
//! until the agent dies; only the namespace's tenant (or the operator) reports G1 or takes its
//! demands. (The engine round trip with spills, reloads and byte equality is
//! `client/python/tests/test_agent.py`.)

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_agent::engine::proto::{Header, Request, Status, HEADER_LEN};
use kvtier_proto::{DType, HashScheme, KvLayout, Namespace};
use kvtier_tests::*;

/// 4 layers × 2 heads × 64 × fp16 × 16 tokens, K and V: 32 KiB blocks.
const BLOCK: u64 = 2 * 4 * 2 * 64 * 2 * 16;

fn agent(args: &[&str]) -> Command {
    let mut cmd = Command::new(kvtier_bin());
    cmd.arg("agent").args(args).env_remove("KVTIER_CONFIG").env("KVTIER_LOG", "warn");
    cmd
}

/// A spawned `kvtier agent`, killed by its pid if a test ends early.
struct AgentProcess(std::process::Child);

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn call(sock: &mut UnixStream, req: &Request) -> (Header, Vec<u8>) {
    sock.write_all(&req.encode(1)).unwrap();
    let mut h = [0u8; HEADER_LEN];
    sock.read_exact(&mut h).unwrap();
    let h = Header::decode(&h);
    let mut body = vec![0u8; h.body_len as usize];
    sock.read_exact(&mut body).unwrap();
    (h, body)
}

fn scrape(port: u16) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return String::new() };
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn an_agent_configured_by_toml_answers_engines_serves_metrics_and_stops_on_sigterm() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("agent.sock");
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "[agent]\nserver = \"{}\"\nsocket = \"{}\"\ndevice = \"host\"\nhost_memory = \"8MiB\"\npage_bytes = {BLOCK}\n\
             pool_capacity = \"256KiB\"\nmetrics = \"127.0.0.1:0\"\n",
            server.grpc_addr(),
            sock_path.display()
        ),
    )
    .unwrap();
    let mut proc = AgentProcess(agent(&["--config", cfg.to_str().unwrap()]).stdout(Stdio::piped()).spawn().unwrap());
    let child = &mut proc.0;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    assert!(first.contains("kvtier agent listening"), "{first}");
    assert!(first.contains("G1 8 pages of 32768 bytes"), "{first}");
    // The kernel picked the metrics port (a port picked here and released could be taken first).
    let port: u16 = first
        .split("metrics http://127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in {first:?}"));
    let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<String>>());

    let layout = KvLayout::new(4, 2, 64, DType::Fp16, 16);
    let mut engine = UnixStream::connect(&sock_path).unwrap();
    let (h, body) = call(&mut engine, &Request::Open(Namespace::new("t", "m", layout, HashScheme::Blake3, b"s")));
    assert_eq!(h.status, Status::Ok as u8, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body[..8], BLOCK.to_le_bytes());
    // Another layout's blocks don't fit this agent's pages: said so, by size.
    let mut other = UnixStream::connect(&sock_path).unwrap();
    let wrong = KvLayout::new(4, 2, 128, DType::Fp16, 16);
    let (h, body) = call(&mut other, &Request::Open(Namespace::new("t", "m", wrong, HashScheme::Blake3, b"s")));
    assert_eq!(h.status, Status::SizeMismatch as u8);
    assert!(String::from_utf8_lossy(&body).contains("G1 pages are 32768"));

    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let t = scrape(port);
        if metric(&t, "kvtier_agent_engine_connections", &[]) >= 2.0 || Instant::now() > deadline {
            break t;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(metric(&text, "kvtier_agent_pool_pages", &[]), 8.0, "{text}");
    assert_eq!(metric(&text, "kvtier_agent_pool_bytes", &[]), 8.0 * BLOCK as f64);
    assert_eq!(metric(&text, "kvtier_agent_engine_connections", &[]), 2.0);
    assert_eq!(metric(&text, "kvtier_agent_refused_total", &[]), 1.0);
    // Counters of events that have not happened are there at 0, with what they mean.
    assert!(text.contains("\nkvtier_agent_spill_errors_total 0\n"), "{text}");
    assert!(text.contains("# HELP kvtier_agent_spill_errors_total "), "{text}");

    let pid = rustix::process::Pid::from_child(child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!sock_path.exists(), "the agent removes its socket when it stops");
    // And says it stopped (it exited without a word).
    let rest = rest.join().unwrap();
    assert_eq!(rest.last().map(String::as_str), Some("kvtier agent stopped"), "{rest:?}");
    drop(server);
}

#[test]
fn agent_configuration_errors_name_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&mut agent(&["--socket", dir.path().join("a.sock").to_str().unwrap()]));
    assert!(err.contains("--page-bytes is required"), "{err}");
    let err = run(&mut agent(&["--device", "tpu", "--page-bytes", "4096"]));
    assert!(err.contains("host or cuda"), "{err}");
    let err = run(&mut agent(&["--page-bytes", "4096", "--metrics", "0.0.0.0:0"]));
    assert!(err.contains("metrics 0.0.0.0:0 is beyond loopback"), "{err}");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[agent]\npage_bytes = 4096\npool_size = \"1GiB\"\n").unwrap();
    let err = run(&mut agent(&["--config", cfg.to_str().unwrap()]));
    assert!(err.contains("unknown key \"pool_size\""), "{err}");
    std::fs::write(&cfg, "[agent]\npage_bytes = \"lots\"\n").unwrap();
    let err = run(&mut agent(&["--config", cfg.to_str().unwrap()]));
    assert!(err.contains("page_bytes"), "{err}");
    let closed = format!("127.0.0.1:{}", free_port());
    let err = run(&mut agent(&["--server", &closed, "--page-bytes", "4096"]));
    assert!(err.contains(&format!("connecting to the server at {closed}")), "{err}");
    // A pool fraction out of range is refused before connecting (the server here is closed),
    // naming the variable it came from.
    let err = run(agent(&["--server", &closed, "--page-bytes", "4096"]).env("KVTIER_AGENT_POOL_FRACTION", "1.5"));
    assert!(
        err.contains("--pool-fraction must be above 0 and at most 1, got 1.5")
            && err.contains("(its value came from the environment variable KVTIER_AGENT_POOL_FRACTION)")
            && !err.contains("connecting"),
        "{err}"
    );
    std::fs::write(&cfg, "[agent]\npage_bytes = 4096\npool_fraction = 0\n").unwrap();
    let err =
        run(agent(&["--server", &closed, "--config", cfg.to_str().unwrap()]).env_remove("KVTIER_AGENT_POOL_FRACTION"));
    assert!(err.contains("--pool-fraction must be above 0") && !err.contains("environment variable"), "{err}");
    // Spills by RDMA where they can't be had (no `rdma` feature in this build, or no verbs device
    // on this machine): the agent doesn't start, and says which.
    let server = ServerProcess::start(&[]);
    let args = ["--server", &server.grpc_addr(), "--page-bytes", "4096", "--rdma-device", "mlx5_0"];
    let err = run(&mut agent(&args));
    assert!(err.contains("--rdma-device mlx5_0") && err.contains("rdma"), "{err}");
    // Several GPUs: a list for the CUDA backend only, and on this build or machine (no `cuda`
    // feature, or no driver) a start that says why.
    let err = run(&mut agent(&["--page-bytes", "4096", "--gpus", "0,1"]));
    assert!(err.contains("--gpus is for --device cuda"), "{err}");
    let err = run(&mut agent(&[
        "--server",
        &server.grpc_addr(),
        "--page-bytes",
        "4096",
        "--device",
        "cuda",
        "--gpus",
        "all",
    ]));
    assert!(err.contains("without the `cuda` feature") || err.contains("no CUDA driver library"), "{err}");
}

/// Registers a sealed memfd of `pages` pages with the agent over `sock`; the buffer id.
fn register_memfd(sock: &mut UnixStream, pages: u32) -> u32 {
    register_memfd_with(sock, pages, &[]).0
}

/// [`register_memfd`], the memfd starting with `fill`; the buffer id and the memfd.
fn register_memfd_with(sock: &mut UnixStream, pages: u32, fill: &[u8]) -> (u32, std::os::fd::OwnedFd) {
    use std::io::IoSlice;
    use std::mem::MaybeUninit;
    use std::os::fd::AsFd;

    use kvtier_agent::engine::proto::BufferSource;
    use rustix::fs::{MemfdFlags, SealFlags};
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

    let len = u64::from(pages) * BLOCK;
    let fd = rustix::fs::memfd_create("engine", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    assert_eq!(rustix::io::pwrite(&fd, fill, 0).unwrap(), fill.len());
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    let msg = Request::Register { source: BufferSource::Memfd, len, pages }.encode(2);
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    assert!(anc.push(SendAncillaryMessage::ScmRights(&fds)));
    let n = rustix::net::sendmsg(&*sock, &[IoSlice::new(&msg)], &mut anc, SendFlags::NOSIGNAL).unwrap();
    sock.write_all(&msg[n..]).unwrap();
    let mut h = [0u8; HEADER_LEN];
    sock.read_exact(&mut h).unwrap();
    let h = Header::decode(&h);
    let mut body = vec![0u8; h.body_len as usize];
    sock.read_exact(&mut body).unwrap();
    assert_eq!(h.status, 0, "{}", String::from_utf8_lossy(&body));
    (u32::from_le_bytes(body[..4].try_into().unwrap()), fd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_g1_holds_is_published_on_the_nodes_kv_events_as_hbm() {
    use kvtier_agent::engine::proto::Item;
    use kvtier_client::EventKind;
    use kvtier_proto::{BlockKey, KEY_LEN};

    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("agent.sock");
    let mut proc = AgentProcess(
        agent(&[
            "--server",
            &server.grpc_addr(),
            "--socket",
            sock_path.to_str().unwrap(),
            "--host-memory",
            "8MiB",
            "--page-bytes",
            &BLOCK.to_string(),
            "--pool-capacity",
            &(2 * BLOCK).to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let child = &mut proc.0;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    assert!(first.contains("kvtier agent listening"), "{first}");
    std::thread::spawn(move || for _ in lines {});

    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s");
    let client = server.client().await;
    let handle = client.register(ns.clone()).await.unwrap();
    let mut watch = client.watch_events(&[&handle]).await.unwrap();
    let keys: Vec<BlockKey> = (1..=3u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let engine = tokio::task::spawn_blocking(move || {
        let mut sock = UnixStream::connect(&sock_path).unwrap();
        let (h, _) = call(&mut sock, &Request::Open(ns));
        assert_eq!(h.status, 0);
        let buffer = register_memfd(&mut sock, 3);
        // Three blocks into a two-page pool: the first is spilled into the server.
        for (i, k) in keys.iter().enumerate() {
            for layer in 0..4 {
                let items = vec![Item { page: i as u32, key: *k }];
                let (h, body) = call(&mut sock, &Request::Save { buffer, layer, items });
                assert_eq!(h.status, 0, "{}", String::from_utf8_lossy(&body));
            }
        }
        keys
    });
    // What the server holds them under: the engine's hashes salted into the namespace.
    let keys: Vec<BlockKey> = engine.await.unwrap().iter().map(|k| handle.engine_key(&k.0)).collect();
    let (mut in_hbm, mut left_hbm) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(10);
    while (in_hbm.iter().filter(|k| **k != keys[0]).count() < 2 || left_hbm.is_empty()) && Instant::now() < deadline {
        let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_secs(5), watch.next()).await else { break };
        match (e.kind, e.tier.as_str()) {
            (EventKind::Stored, "hbm") => in_hbm.extend(e.keys),
            (EventKind::Evicted, "hbm") => {
                assert_eq!(e.to_tier, "dram", "a spilled block is still on the node");
                left_hbm.extend(e.keys);
            }
            _ => {}
        }
    }
    in_hbm.sort();
    // Within one report interval the last change of a key wins: block 1 may have been stored and
    // spilled between two reports, and then only its leaving is reported.
    in_hbm.retain(|k| *k != keys[0]);
    let mut held = keys[1..].to_vec();
    held.sort();
    assert_eq!(in_hbm, held, "the blocks G1 holds were reported in G1");
    assert_eq!(left_hbm, [keys[0]], "the spilled block was reported leaving G1");
    let pid = rustix::process::Pid::from_child(child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert!(child.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_agent_reports_are_refused() {
    use kvtier_proto::pb::AgentBlocksReport;

    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s");
    let report = |ns: &Namespace, stored: Vec<bytes::Bytes>| AgentBlocksReport {
        namespace_id: bytes::Bytes::copy_from_slice(&ns.id().0),
        stored,
        evicted: vec![],
        dropped: vec![],
        agent_id: String::new(),
        resync: false,
        unspilled: vec![],
    };
    let key = bytes::Bytes::from(vec![7u8; 32]);
    let err = client.raw_grpc().report_agent_blocks(report(&ns, vec![key.clone()])).await.unwrap_err();
    assert!(err.message().contains("unknown namespace"), "{err}");
    client.register(ns.clone()).await.unwrap();
    client.raw_grpc().report_agent_blocks(report(&ns, vec![key.clone()])).await.unwrap();
    let err = client.raw_grpc().report_agent_blocks(report(&ns, vec![bytes::Bytes::from_static(b"short")])).await;
    assert_eq!(err.unwrap_err().code(), tonic::Code::InvalidArgument);
    let err = client.raw_grpc().report_agent_blocks(report(&ns, vec![key; 4097])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("at most 4096"), "{err}");
}

/// Starts `kvtier agent` with `args` and waits for its first line (it listens then).
fn start_agent(args: &[&str]) -> AgentProcess {
    let mut proc = AgentProcess(agent(args).stdout(Stdio::piped()).spawn().unwrap());
    let mut lines = BufReader::new(proc.0.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    assert!(first.contains("kvtier agent listening"), "{first}");
    std::thread::spawn(move || for _ in lines {});
    proc
}

/// An agent of `server` on `sock`, with 8 MiB of host memory and a G1 pool of `pool_pages` pages
/// of one block each.
fn agent_of(server: &ServerProcess, sock: &std::path::Path, pool_pages: u64) -> AgentProcess {
    start_agent(&[
        "--server",
        &server.grpc_addr(),
        "--socket",
        sock.to_str().unwrap(),
        "--host-memory",
        "8MiB",
        "--page-bytes",
        &BLOCK.to_string(),
        "--pool-capacity",
        &(pool_pages * BLOCK).to_string(),
    ])
}

/// The bytes of engine page `page` of a `[layer][page][layer_bytes]` buffer of `pages` pages, as
/// a block (its layers back to back).
fn block_of(buffer: &[u8], pages: usize, page: usize) -> Vec<u8> {
    let layer_bytes = BLOCK as usize / 4;
    (0..4).flat_map(|l| buffer[(l * pages + page) * layer_bytes..][..layer_bytes].to_vec()).collect()
}

/// Saves every page of a fresh buffer filled with `seed`'s pattern under `keys` (page i: key i)
/// through the agent at `sock`; the buffer's bytes.
fn save_through_agent(sock: &std::path::Path, ns: &Namespace, keys: &[kvtier_proto::BlockKey], seed: u8) -> Vec<u8> {
    use kvtier_agent::engine::proto::Item;
    let pages = keys.len();
    let data: Vec<u8> =
        (0..pages * BLOCK as usize).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect();
    let mut s = UnixStream::connect(sock).unwrap();
    let (h, body) = call(&mut s, &Request::Open(ns.clone()));
    assert_eq!(h.status, 0, "{}", String::from_utf8_lossy(&body));
    let (buffer, _) = register_memfd_with(&mut s, pages as u32, &data);
    for layer in 0..4 {
        let items = keys.iter().enumerate().map(|(i, k)| Item { page: i as u32, key: *k }).collect();
        let (h, body) = call(&mut s, &Request::Save { buffer, layer, items });
        assert_eq!(h.status, 0, "{}", String::from_utf8_lossy(&body));
    }
    data
}

/// Polls `f` every 20 ms until it returns true or 20 s pass; whether it did.
async fn eventually(mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_only_g1_holds_count_in_lookups_and_load_over_tcp_until_the_agent_dies() {
    use kvtier_client::{ClientConfig, KvClient, SameNodeMode};
    use kvtier_proto::{BlockKey, KEY_LEN};

    // A demanded block is waited for this long (the default is 200 ms): a read that waited it out
    // and a prompt miss (under half of it) are far apart even on a busy machine.
    const DEMAND_WAIT: Duration = Duration::from_secs(2);
    let dir = tempfile::tempdir().unwrap();
    let server_cfg = dir.path().join("kvtier.toml");
    std::fs::write(&server_cfg, format!("agent_demand_wait = \"{}ms\"\n", DEMAND_WAIT.as_millis())).unwrap();
    let mut server = ServerProcess::start(&["--dram-capacity", "64MiB", "--config", server_cfg.to_str().unwrap()]);
    let sock_path = dir.path().join("agent.sock");
    let mut proc = agent_of(&server, &sock_path, 16);
    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s");
    let keys: Vec<BlockKey> = (1..=6u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let (sp, n2, k2) = (sock_path.clone(), ns.clone(), keys.clone());
    let data = tokio::task::spawn_blocking(move || save_through_agent(&sp, &n2, &k2, 0x5a)).await.unwrap();

    // A plain client over TCP only, which never talked to the agent.
    let cfg = ClientConfig { samenode: SameNodeMode::Off, ..ClientConfig::default() };
    let client = KvClient::connect(&server.grpc_addr(), cfg).await.unwrap();
    let handle = client.register(ns.clone()).await.unwrap();
    // The engine's hashes, salted into the namespace by the agent as by the client.
    let keys: Vec<BlockKey> = keys.iter().map(|k| handle.engine_key(&k.0)).collect();
    assert!(
        eventually(async || client.lookup_keys(&handle, &keys).await.unwrap() == 6).await,
        "the six blocks G1 holds are counted by the server's lookup"
    );
    let text = server.scrape();
    assert_eq!(metric(&text, "kvtier_agent_index_keys", &[]), 6.0, "{text}");
    assert_eq!(metric(&text, "kvtier_agent_links", &[]), 1.0);
    assert_eq!(metric(&text, "kvtier_agent_demands_total", &[]), 0.0, "nothing was asked of the agent yet");

    // Loaded byte-exact: the server asks the agent, which spills them into DRAM.
    let start = Instant::now();
    let got = client.load_keys(&handle, &keys[..3]).await.unwrap();
    let took = start.elapsed();
    for (i, f) in got.iter().enumerate() {
        let f = f.as_ref().unwrap_or_else(|| panic!("block {i} missed"));
        assert!(f.payload[..] == block_of(&data, 6, i)[..], "block {i}: the engine's bytes");
    }
    assert!(took < Duration::from_secs(2), "three demanded blocks took {took:?}");
    // A hit is counted just after its block is committed to DRAM, where a read already finds it:
    // the last one may be counted after the load's answer.
    until_metric(&server, "kvtier_agent_demand_hits_total", &[], 3.0);
    let text = server.scrape();
    // All three asked of the agent up front (the read sends a batch's demands ahead), none missed,
    // each a hit however its read then found it (it counted only those still awaited).
    assert_eq!(metric(&text, "kvtier_agent_demands_total", &[]), 3.0, "{text}");
    assert_eq!(metric(&text, "kvtier_agent_demand_misses_total", &[]), 0.0);
    assert_eq!(metric(&text, "kvtier_agent_demand_hits_total", &[]), 3.0, "{text}");

    // A stopped agent can't answer: the load is a miss after the bounded wait, never wrong bytes.
    stop_process(proc.0.id());
    let start = Instant::now();
    let got = client.load_keys(&handle, &keys[3..4]).await.unwrap();
    let took = start.elapsed();
    continue_process(proc.0.id());
    assert!(
        got[0].is_none(),
        "a demand the agent does not answer in time is a miss (took {took:?}): {}",
        server.scrape()
    );
    assert!(
        took >= DEMAND_WAIT - Duration::from_millis(50) && took < DEMAND_WAIT + Duration::from_secs(2),
        "waited {took:?}"
    );
    let text = server.scrape();
    assert_eq!(metric(&text, "kvtier_agent_demand_misses_total", &[("reason", "timeout")]), 1.0, "{text}");
    assert_eq!(metric(&text, "kvtier_agent_demands_total", &[]), 4.0, "{text}");

    // Killed: its G1 keys stop counting, and a load of them is a prompt miss; the server serves on.
    let mut watch = client.watch_events(&[&handle]).await.unwrap();
    proc.0.kill().unwrap();
    proc.0.wait().unwrap();
    let rest = &keys[4..];
    assert!(
        eventually(async || client.lookup_keys(&handle, rest).await.unwrap() == 0).await,
        "a dead agent's G1 keys no longer count"
    );
    let start = Instant::now();
    let got = client.load_keys(&handle, rest).await.unwrap();
    assert!(got.iter().all(Option::is_none));
    assert!(start.elapsed() < DEMAND_WAIT / 2, "a prompt miss, took {:?}", start.elapsed());
    // Prompt because nothing was asked of the dead agent, so nothing was waited for: no demand
    // went out and no wait ran out since the stopped agent's.
    let text = server.scrape();
    assert_eq!(metric(&text, "kvtier_agent_demands_total", &[]), 4.0, "no demand to a dead agent: {text}");
    let timed_out = metric(&text, "kvtier_agent_demand_misses_total", &[("reason", "timeout")]);
    assert_eq!(timed_out, 1.0, "only the stopped agent's wait ran out: {text}");
    assert_eq!(metric(&text, "kvtier_agent_links", &[]), 0.0);
    // Routers hear it too: every key left `hbm`, to DRAM where the node still holds it.
    let mut left: std::collections::HashMap<BlockKey, String> = std::collections::HashMap::new();
    while left.len() < 6 {
        let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_secs(5), watch.next()).await else { break };
        if e.kind == kvtier_client::EventKind::Evicted && e.tier == "hbm" {
            left.extend(e.keys.iter().map(|k| (*k, e.to_tier.clone())));
        }
    }
    assert_eq!(left.len(), 6, "{left:?}");
    assert_eq!((left[&keys[0]].as_str(), left[&keys[5]].as_str()), ("dram", ""), "{left:?}");
    let again = client.load_keys(&handle, &keys[..3]).await.unwrap();
    assert!(again.iter().all(Option::is_some), "the spilled blocks are the server's own now");
    assert!(server.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_namespaces_tenant_reports_g1_into_it_or_takes_its_demands() {
    use kvtier_client::{ClientConfig, KvClient};
    use kvtier_proto::pb::{AgentBlocksReport, AgentDemandsRequest};

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tenants.toml");
    std::fs::write(
        &cfg,
        "auth_token = \"operator-secret-0000\"\n\n[[tenants]]\nname = \"a\"\ntokens = [\"tenant-a-secret-0001\"]\n\n\
         [[tenants]]\nname = \"b\"\ntokens = [\"tenant-b-secret-0002\"]\n",
    )
    .unwrap();
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--config", cfg.to_str().unwrap()]);
    let as_ = async |token: &str| {
        let cfg = ClientConfig { auth_token: Some(token.into()), ..ClientConfig::default() };
        KvClient::connect(&server.grpc_addr(), cfg).await.unwrap()
    };
    let (a, b, operator) =
        (as_("tenant-a-secret-0001").await, as_("tenant-b-secret-0002").await, as_("operator-secret-0000").await);
    let ns = Namespace::new("a", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s");
    let handle = a.register(ns.clone()).await.unwrap();
    let id = bytes::Bytes::copy_from_slice(&ns.id().0);
    let key = kvtier_proto::BlockKey([9; 32]);
    let report = |agent: &str| AgentBlocksReport {
        namespace_id: id.clone(),
        stored: vec![bytes::Bytes::copy_from_slice(&key.0)],
        evicted: vec![],
        dropped: vec![],
        agent_id: agent.into(),
        resync: false,
        unspilled: vec![],
    };
    let demands = |agent: &str| AgentDemandsRequest { namespace_id: id.clone(), agent_id: agent.into() };

    // b has no grant on a's namespace: answered as if it were not registered.
    let err = b.raw_grpc().agent_demands(demands("b-agent")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    let err = b.raw_grpc().report_agent_blocks(report("b-agent")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    let err = a.raw_grpc().agent_demands(demands("")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "an agent names itself");

    // The tenant's own agent (and the operator's) may; only a reporter with an open stream counts.
    let _stream = a.raw_grpc().agent_demands(demands("a-agent")).await.unwrap();
    let _op_stream = operator.raw_grpc().agent_demands(demands("op-agent")).await.unwrap();
    a.raw_grpc().report_agent_blocks(report("not-streaming")).await.unwrap();
    assert_eq!(a.lookup_keys(&handle, &[key]).await.unwrap(), 0, "no stream, not indexed");
    a.raw_grpc().report_agent_blocks(report("a-agent")).await.unwrap();
    assert_eq!(a.lookup_keys(&handle, &[key]).await.unwrap(), 1);
    drop(_stream);
    assert!(
        eventually(async || a.lookup_keys(&handle, &[key]).await.unwrap() == 0).await,
        "the stream closed: the agent's keys stop counting"
    );
}

/// A demanded block the agent can't spill (it left G1 meanwhile, or its copy failed): the
/// agent says so, and the read misses at once instead of waiting out `agent_demand_wait`. Only
/// the agent the demand went to can end the wait. The test plays the agent's side of the
/// protocol (its demand stream and reports) against a real server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demand_the_agent_cannot_spill_misses_at_once() {
    use kvtier_client::{ClientConfig, KvClient, SameNodeMode};
    use kvtier_proto::pb::{AgentBlocksReport, AgentDemandsRequest};

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kvtier.toml");
    std::fs::write(&cfg, "agent_demand_wait = \"20s\"\n").unwrap();
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--config", cfg.to_str().unwrap()]);
    let cfg = ClientConfig { samenode: SameNodeMode::Off, ..ClientConfig::default() };
    let client = KvClient::connect(&server.grpc_addr(), cfg).await.unwrap();
    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s");
    let handle = client.register(ns.clone()).await.unwrap();
    let id = bytes::Bytes::copy_from_slice(&ns.id().0);
    let key = kvtier_proto::BlockKey([7; 32]);
    let report = |agent: &str, stored: Vec<kvtier_proto::BlockKey>, unspilled: Vec<kvtier_proto::BlockKey>| {
        let raw = |v: Vec<kvtier_proto::BlockKey>| v.iter().map(|k| bytes::Bytes::copy_from_slice(&k.0)).collect();
        AgentBlocksReport {
            namespace_id: id.clone(),
            stored: raw(stored),
            evicted: vec![],
            dropped: vec![],
            agent_id: agent.into(),
            resync: false,
            unspilled: raw(unspilled),
        }
    };
    let mut demands = client
        .raw_grpc()
        .agent_demands(AgentDemandsRequest { namespace_id: id.clone(), agent_id: "g1".into() })
        .await
        .unwrap()
        .into_inner();
    client.raw_grpc().report_agent_blocks(report("g1", vec![key], vec![])).await.unwrap();
    assert_eq!(client.lookup_keys(&handle, &[key]).await.unwrap(), 1, "G1 holds it");

    let (c, h) = (client.clone(), handle.clone());
    let start = Instant::now();
    let read = tokio::spawn(async move { c.load_keys(&h, &[key]).await });
    let asked = tokio::time::timeout(Duration::from_secs(5), demands.message()).await.unwrap().unwrap().unwrap();
    assert_eq!(asked.keys, vec![bytes::Bytes::copy_from_slice(&key.0)], "the server asks the agent for it");
    // Another agent can't end a wait it wasn't asked for.
    client.raw_grpc().report_agent_blocks(report("other", vec![], vec![key])).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!read.is_finished(), "the read still waits for the agent it asked");
    client.raw_grpc().report_agent_blocks(report("g1", vec![], vec![key])).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), read).await.expect("the read ended").unwrap().unwrap();
    assert!(got[0].is_none(), "a miss, never bytes");
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "the read waited {took:?} of its 20 s");
    let text = server.scrape();
    assert_eq!(metric(&text, "kvtier_agent_demand_misses_total", &[("reason", "unspilled")]), 1.0, "{text}");
    // The server goes on: a block stored in DRAM meanwhile is served.
    let payload = payload_for(&key, handle.block_bytes());
    client.store_keys(&handle, &[key], &[vec![payload.clone()]]).await.unwrap();
    assert_eq!(client.load_keys(&handle, &[key]).await.unwrap()[0].as_ref().unwrap().payload, payload);
}

/// A LOAD of `items` into `buffer` over `sock`: its counts (found, from G1, from G2), after every
/// layer's answer came back OK.
fn load_through_agent(sock: &mut UnixStream, buffer: u32, items: Vec<kvtier_agent::engine::proto::Item>) -> Vec<u32> {
    sock.write_all(&Request::Load { buffer, items }.encode(3)).unwrap();
    let mut read = || {
        let mut h = [0u8; HEADER_LEN];
        sock.read_exact(&mut h).unwrap();
        let h = Header::decode(&h);
        let mut body = vec![0u8; h.body_len as usize];
        sock.read_exact(&mut body).unwrap();
        assert_eq!(h.status, 0, "{}", String::from_utf8_lossy(&body));
        body
    };
    let counts: Vec<u32> = read().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    for _ in 0..4 {
        read();
    }
    counts
}

#[test]
fn a_spill_stalled_on_a_stopped_server_does_not_stall_another_connections_g1_load() {
    use kvtier_agent::engine::proto::Item;
    use kvtier_proto::{BlockKey, KEY_LEN};

    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("agent.sock");
    let _agent = agent_of(&server, &sock_path, 2);
    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s");
    let keys: Vec<BlockKey> = (1..=3u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let data: Vec<u8> = (0..3 * BLOCK as usize).map(|i| (i % 253) as u8 ^ 0x33).collect();
    // Engine A fills the two-page pool; engine B will load into its own buffer.
    let mut a = UnixStream::connect(&sock_path).unwrap();
    assert_eq!(call(&mut a, &Request::Open(ns.clone())).0.status, 0);
    let (buf_a, _) = register_memfd_with(&mut a, 3, &data);
    let k2 = keys.clone();
    let save = move |s: &mut UnixStream, page: u32| {
        for layer in 0..4 {
            let items = vec![Item { page, key: k2[page as usize] }];
            let (h, body) = call(s, &Request::Save { buffer: buf_a, layer, items });
            assert_eq!(h.status, 0, "{}", String::from_utf8_lossy(&body));
        }
    };
    save(&mut a, 0);
    save(&mut a, 1);
    let mut b = UnixStream::connect(&sock_path).unwrap();
    assert_eq!(call(&mut b, &Request::Open(ns.clone())).0.status, 0);
    let (buf_b, mem_b) = register_memfd_with(&mut b, 3, &[]);
    let page_of = |fd: &std::os::fd::OwnedFd, page: usize| {
        let mut all = vec![0u8; 3 * BLOCK as usize];
        rustix::io::pread(fd, &mut all, 0).unwrap();
        block_of(&all, 3, page)
    };

    // The server stops: block 1's spill (to make room for block 3) can't finish.
    stop_process(server.child.id());
    let saver = std::thread::spawn(move || {
        let started = Instant::now();
        save(&mut a, 2);
        started.elapsed()
    });
    // The save returns with block 1 evicted and its spill still stalled (not a fixed sleep: on
    // a busy machine the save may not have reached the agent yet, and block 1 would still be in
    // G1).
    let save_took = saver.join().unwrap();
    let started = Instant::now();
    let got = load_through_agent(&mut b, buf_b, vec![Item { page: 1, key: keys[1] }]);
    let g1_load = started.elapsed();
    // Block 1 is on its way to the stopped server: loaded from the copy in flight.
    let in_flight = load_through_agent(&mut b, buf_b, vec![Item { page: 0, key: keys[0] }]);
    continue_process(server.child.id());

    assert_eq!(got, [1, 1, 0], "a G1 hit");
    assert!(g1_load < Duration::from_secs(1), "the G1 load waited {g1_load:?} behind a stalled spill");
    assert!(save_took < Duration::from_secs(1), "the save that evicted waited {save_took:?}");
    assert!(page_of(&mem_b, 1) == block_of(&data, 3, 1), "block 2's bytes");
    assert_eq!(in_flight, [1, 0, 1], "found outside G1");
    assert!(page_of(&mem_b, 0) == block_of(&data, 3, 0), "block 1's bytes");
    // Once the server runs again the spill lands: block 1 loads from the server.
    let client = tokio::runtime::Runtime::new().unwrap();
    let landed = client.block_on(async {
        let c = server.client().await;
        let h = c.register(ns.clone()).await.unwrap();
        let first = [h.engine_key(&keys[0].0)];
        eventually(async || matches!(c.load_keys(&h, &first).await.as_deref(), Ok([Some(_)]))).await
    });
    assert!(landed, "the stalled spill reached the server once it ran again");
}

/// A DRAM-only server on a data directory in `dir` (to restart in place: it comes back without
/// its registrations) and an agent of it with an 8-page pool: the server, the agent's socket,
/// the agent.
fn restartable_server_and_agent(dir: &std::path::Path) -> (ServerProcess, std::path::PathBuf, AgentProcess) {
    let data_dir = dir.join("data");
    std::fs::create_dir_all(&data_dir).unwrap();
    let server = ServerProcess::start_in(&data_dir, &["--dram-capacity", "64MiB"]);
    let sock_path = dir.join("agent.sock");
    let agent = agent_of(&server, &sock_path, 8);
    (server, sock_path, agent)
}

/// A server that restarts without its registrations (no disk tier) costs the agent no block:
/// its spills meet a broken connection, then a namespace the server no longer knows, and register
/// it again; its demand stream likewise. Before, every spill after the restart failed (each
/// evicted block lost) and the demand stream was refused for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_outlives_a_restart_of_its_server() {
    use kvtier_client::{ClientConfig, KvClient, SameNodeMode};
    use kvtier_proto::{BlockKey, KEY_LEN};

    let dir = tempfile::tempdir().unwrap();
    let (mut server, sock_path, _agent) = restartable_server_and_agent(dir.path());
    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s");
    let first: Vec<BlockKey> = (1..=8u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let second: Vec<BlockKey> = (11..=18u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let (sp, n, k) = (sock_path.clone(), ns.clone(), first.clone());
    let data1 = tokio::task::spawn_blocking(move || save_through_agent(&sp, &n, &k, 0x11)).await.unwrap();

    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let server = server.restart_in_place(&["--dram-capacity", "64MiB"]);
    // Eight more through a full pool: the first eight are spilled into the restarted server.
    let (sp, n, k) = (sock_path.clone(), ns.clone(), second.clone());
    let data2 = tokio::task::spawn_blocking(move || save_through_agent(&sp, &n, &k, 0x22)).await.unwrap();

    let cfg = ClientConfig { samenode: SameNodeMode::Off, ..ClientConfig::default() };
    let client = KvClient::connect(&server.grpc_addr(), cfg).await.unwrap();
    let handle = client.register(ns.clone()).await.unwrap();
    let salted = |keys: &[BlockKey]| keys.iter().map(|k| handle.engine_key(&k.0)).collect::<Vec<_>>();
    let (first, second) = (salted(&first), salted(&second));
    // Spilled into the server, or still in G1 and reported once the agent re-opened its stream.
    assert!(
        eventually(async || client.lookup_keys(&handle, &first).await.unwrap() == 8).await,
        "the first batch is lost: {}",
        server.scrape()
    );
    let got = client.load_keys(&handle, &first).await.unwrap();
    for (i, f) in got.iter().enumerate() {
        let f = f.as_ref().unwrap_or_else(|| panic!("first batch, block {i}: missed"));
        assert!(f.payload[..] == block_of(&data1, 8, i)[..], "first batch, block {i}: the engine's bytes");
    }
    // What G1 still holds is reported and demanded again once the agent re-opened its stream.
    assert!(
        eventually(async || client.lookup_keys(&handle, &second).await.unwrap() == 8).await,
        "the restarted server sees what G1 holds"
    );
    let got = client.load_keys(&handle, &second).await.unwrap();
    for (i, f) in got.iter().enumerate() {
        let f = f.as_ref().unwrap_or_else(|| panic!("second batch, block {i}: missed"));
        assert!(f.payload[..] == block_of(&data2, 8, i)[..], "second batch, block {i}: the engine's bytes");
    }
}

/// An engine opens its namespace through the agent while the server is down: G1 serves it, and
/// once the server is back the agent registers it there and reports what G1 holds, which loads
/// through the server byte-exact. Before, the OPEN was refused ("spill failed: registering the
/// namespace") until the server returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_opens_through_the_agent_while_the_server_is_down() {
    use kvtier_client::{ClientConfig, KvClient, SameNodeMode};
    use kvtier_proto::{BlockKey, KEY_LEN};

    let dir = tempfile::tempdir().unwrap();
    let (mut server, sock_path, _agent) = restartable_server_and_agent(dir.path());
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"down");
    let keys: Vec<BlockKey> = (21..=24u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let (sp, n, k) = (sock_path.clone(), ns.clone(), keys.clone());
    let data = tokio::task::spawn_blocking(move || save_through_agent(&sp, &n, &k, 0x33)).await.unwrap();

    let server = server.restart_in_place(&["--dram-capacity", "64MiB"]);
    let cfg = ClientConfig { samenode: SameNodeMode::Off, ..ClientConfig::default() };
    let client = KvClient::connect(&server.grpc_addr(), cfg).await.unwrap();
    // Not registered by this client: the agent registers it (the server started without it).
    let handle = kvtier_client::NamespaceHandle::unregistered(ns.clone()).unwrap();
    let keys: Vec<BlockKey> = keys.iter().map(|k| handle.engine_key(&k.0)).collect();
    assert!(
        eventually(async || client.lookup_keys(&handle, &keys).await.unwrap_or(0) == 4).await,
        "the agent registers the namespace and the server sees what G1 holds once it is back"
    );
    let got = client.load_keys(&handle, &keys).await.unwrap();
    for (i, f) in got.iter().enumerate() {
        let f = f.as_ref().unwrap_or_else(|| panic!("block {i} missed"));
        assert!(f.payload[..] == block_of(&data, 4, i)[..], "block {i}: the engine's bytes");
    }
}

/// An agent reaches a node that runs TLS and takes client certificates only: `--tls-ca` and the
/// agent's certificate (named as the operator), its same-node spills through single-use tickets.
/// Blocks saved through it past its pool are spilled into the node and load from there with the
/// engine's bytes. Before, the agent had no TLS settings and could not start against such a node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reaches_a_tls_node_with_its_certificate() {
    use kvtier_client::{ClientConfig, ClientTls, KvClient, SameNodeMode};
    use kvtier_proto::{BlockKey, KEY_LEN};

    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let p = pki.to_str().unwrap();
    for args in [
        vec!["ca", "--dir", p],
        vec!["node", "--dir", p, "--name", "node", "--host", "127.0.0.1"],
        vec!["client", "--dir", p, "--name", "agent"],
    ] {
        let out = Command::new(kvtier_bin()).arg("cert").args(&args).output().unwrap();
        assert!(out.status.success(), "kvtier cert {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let f = |n: &str| pki.join(n).to_str().unwrap().to_string();
    let cfg = dir.path().join("tls.toml");
    std::fs::write(
        &cfg,
        format!(
            "[tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\noperator_names = [\"agent\"]\n",
            f("node.pem"),
            f("node.key"),
            f("ca.pem")
        ),
    )
    .unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let sock = dir.path().join("agent.sock");
    let base = ["--server", &server.grpc_addr(), "--socket", sock.to_str().unwrap(), "--page-bytes", "32KiB"];

    // Without TLS settings it can't start, and says what to do.
    let out = agent(&base).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("over TLS with its CA"), "{err}");
    let out =
        agent(&[&base[..], &["--tls-cert", &f("agent.pem"), "--tls-key", &f("agent.key")]].concat()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("need --tls-ca"), "{err}");

    let (ca, cert, key) = (f("ca.pem"), f("agent.pem"), f("agent.key"));
    let tls = ["--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key, "--host-memory", "8MiB"];
    let pool = (8 * BLOCK).to_string();
    let page = BLOCK.to_string();
    let mut args: Vec<&str> = vec!["--server", &base[1], "--socket", base[3], "--page-bytes", &page];
    args.extend(tls);
    args.extend(["--pool-capacity", &pool]);
    let _agent = start_agent(&args);

    // Sixteen blocks through a pool of eight: the first eight are spilled into the node over the
    // same-node socket (a ticket each connection), and every one loads with the engine's bytes.
    let ns = Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"tls");
    let keys: Vec<BlockKey> = (1..=8u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let (sp, n, k) = (sock.clone(), ns.clone(), keys.clone());
    let data = tokio::task::spawn_blocking(move || save_through_agent(&sp, &n, &k, 0x3c)).await.unwrap();
    let more: Vec<BlockKey> = (11..=18u8).map(|i| BlockKey([i; KEY_LEN])).collect();
    let (sp, n) = (sock.clone(), ns.clone());
    tokio::task::spawn_blocking(move || save_through_agent(&sp, &n, &more, 0x4d)).await.unwrap();
    let tls =
        ClientTls::from_files(&pki.join("ca.pem"), Some((&pki.join("agent.pem"), &pki.join("agent.key")))).unwrap();
    let cfg = ClientConfig { tls: Some(tls), samenode: SameNodeMode::Off, ..ClientConfig::default() };
    let client = KvClient::connect(&server.grpc_addr(), cfg).await.unwrap();
    let handle = client.register(ns.clone()).await.unwrap();
    let salted: Vec<BlockKey> = keys.iter().map(|k| handle.engine_key(&k.0)).collect();
    assert!(eventually(async || client.lookup_keys(&handle, &salted).await.unwrap() == 8).await, "{}", server.scrape());
    let got = client.load_keys(&handle, &salted).await.unwrap();
    for (i, f) in got.iter().enumerate() {
        let f = f.as_ref().unwrap_or_else(|| panic!("block {i}: missed"));
        assert!(f.payload[..] == block_of(&data, 8, i)[..], "block {i}: the engine's bytes");
    }
    assert!(metric(&server.scrape(), "kvtier_samenode_tickets_total", &[("event", "redeemed")]) >= 1.0);
}
