//! Tenants as principals, against a real server configured with three tenants and an operator:
//! a tenant that knows another's namespace id and salt still cannot read, write, park, resume,
//! drop, purge, list or poison anything of it, on the control plane, the data plane or the
//! same-node socket; a read grant allows reads only; quotas stop a tenant at its own limits.

use kvtier_client::{ClientConfig, ClientError, KvClient, ParkOptions, SharedBuffer};
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::NamespaceId;
use kvtier_tests::*;

const TOKEN_A: &str = "tenant-a-secret-0001";
const TOKEN_B: &str = "tenant-b-secret-0002";
const TOKEN_C: &str = "tenant-c-secret-0003";
const TOKEN_Q: &str = "tenant-q-secret-0004";
const TOKEN_R: &str = "tenant-r-secret-0005";
const OPERATOR: &str = "operator-secret-0000";

fn config(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("tenants.toml");
    std::fs::write(
        &path,
        format!(
            r#"
auth_token = "{OPERATOR}"

[[tenants]]
name = "a"
tokens = ["{TOKEN_A}"]

[[tenants]]
name = "b"
tokens = ["{TOKEN_B}"]

[[tenants]]
name = "c"
tokens = ["{TOKEN_C}"]
read = ["a"]

[[tenants]]
name = "q"
tokens = ["{TOKEN_Q}"]
max_namespaces = 1
max_sessions = 1

[[tenants]]
name = "r"
tokens = ["{TOKEN_R}"]
read = ["a"]
max_namespaces = 1
"#
        ),
    )
    .unwrap();
    path
}

/// A server with a 64 MiB disk tier, `dram` of DRAM and `tenants` (TOML) as its configuration.
fn with_tenants(dir: &std::path::Path, tenants: &str, dram: &str) -> ServerProcess {
    let cfg = dir.join("quota.toml");
    std::fs::write(&cfg, tenants).unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", dram, "--disk-capacity", "64MiB"])
}

/// Waits (up to 60 s) until the blocks queued for the disk are written.
async fn until_demotions_written(server: &ServerProcess) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while metric(&server.scrape(), "kvtier_disk_queue_depth", &[]) > 0.0 {
        assert!(std::time::Instant::now() < deadline, "the demotion queue never drained");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

async fn client_as(server: &ServerProcess, token: Option<&str>) -> KvClient {
    let cfg = ClientConfig { auth_token: token.map(str::to_string), ..ClientConfig::default() };
    KvClient::connect(&server.grpc_addr(), cfg).await.expect("connect")
}

fn forbidden<T>(r: Result<T, ClientError>, what: &str) {
    match r {
        Err(ClientError::Forbidden(m)) => assert!(!m.is_empty(), "{what}"),
        Err(other) => panic!("{what}: expected Forbidden, got {other}"),
        Ok(_) => panic!("{what}: expected Forbidden, it succeeded"),
    }
}

/// A call on another tenant's namespace (no grant) is answered as the same call on a namespace
/// nobody registered, the id aside: probing ids tells a tenant nothing of which namespaces
/// (models, layouts) another uses.
fn as_if_unregistered<T>(
    theirs: Result<T, ClientError>,
    unregistered: Result<T, ClientError>,
    ids: [&NamespaceId; 2],
    what: &str,
) {
    let (Err(theirs), Err(unregistered)) = (theirs, unregistered) else { panic!("{what}: expected both refused") };
    assert!(matches!(theirs, ClientError::UnknownNamespace(_)), "{what}: {theirs}");
    assert_eq!(
        theirs.to_string().replace(&ids[0].to_string(), "<id>"),
        unregistered.to_string().replace(&ids[1].to_string(), "<id>"),
        "{what}: another tenant's namespace answers as an unregistered one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_can_neither_read_nor_change_nor_list_a_tenants_data() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = config(cfg_dir.path());
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let a = client_as(&server, Some(TOKEN_A)).await;
    let b = client_as(&server, Some(TOKEN_B)).await;

    // Tenant a stores a prefix and parks a session.
    let ns_a = a.register(namespace("a", b"a's salt", small_layout())).await.unwrap();
    let doc = tokens(1, 64);
    let blocks = full_block_payloads(&ns_a, &doc);
    a.store(&ns_a, &doc, &blocks).await.unwrap().ok().unwrap();
    a.park(&ns_a, "a-agent", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();

    // b knows a's namespace spec (tenant, model, salt) and so its id: the worst case. It learns
    // no more than it would of a namespace nobody registered (`none`: one a unregistered).
    let none = a.register(namespace("a", b"unregistered", small_layout())).await.unwrap();
    a.unregister(&none).await.unwrap();
    let ids = [&ns_a.id, &none.id];
    forbidden(b.register(namespace("a", b"a's salt", small_layout())).await, "register as a");
    forbidden(b.register(namespace("a", b"unregistered", small_layout())).await, "register as a");
    as_if_unregistered(b.lookup(&ns_a, &doc).await, b.lookup(&none, &doc).await, ids, "lookup");
    let (keys, none_keys) = (ns_a.keys(&doc), none.keys(&doc));
    as_if_unregistered(b.load_keys(&ns_a, &keys).await, b.load_keys(&none, &none_keys).await, ids, "load");
    as_if_unregistered(b.exists_keys(&ns_a, &keys).await, b.exists_keys(&none, &none_keys).await, ids, "exists");
    as_if_unregistered(b.resume(&ns_a, "a-agent").await, b.resume(&none, "a-agent").await, ids, "resume");
    as_if_unregistered(b.drop_session(&ns_a, "a-agent").await, b.drop_session(&none, "a-agent").await, ids, "drop");
    as_if_unregistered(b.purge(&ns_a).await, b.purge(&none).await, ids, "purge");
    as_if_unregistered(b.list_sessions(Some(&ns_a)).await, b.list_sessions(Some(&none)).await, ids, "list");
    let opts = ParkOptions::default();
    let none_blocks = full_block_payloads(&none, &doc);
    as_if_unregistered(
        b.park(&ns_a, "b-agent", &doc, &blocks, &opts, 0).await,
        b.park(&none, "b-agent", &doc, &none_blocks, &opts, 0).await,
        ids,
        "park",
    );
    assert!(b.list_sessions(None).await.unwrap().is_empty(), "an empty filter lists only b's own sessions");
    let stats = b.stats().await.unwrap();
    assert_eq!((stats.namespaces, stats.sessions), (0, 0), "b's stats count b's own");
    // Tier figures too: a tenant sees the bytes it holds, none of another's traffic.
    let dram = |s: &kvtier_proto::pb::StatsResponse| s.tiers.iter().find(|t| t.tier == "dram").cloned().unwrap();
    let (of_a, of_b) = (dram(&a.stats().await.unwrap()), dram(&stats));
    let stored: u64 = blocks.iter().map(|p| p.len() as u64).sum();
    assert!(of_a.resident_bytes >= stored, "a's own blocks: {of_a:?}");
    assert_eq!(of_b.capacity_bytes, 64 << 20);
    assert_eq!(
        (of_b.resident_bytes, of_b.blocks, of_b.hits, of_b.misses, of_b.bytes_in, of_b.bytes_out),
        (0, 0, 0, 0, 0, 0),
        "b sees nothing of a's blocks or traffic: {of_b:?}"
    );

    // Poisoning: a purged key re-put with b's bytes is refused per block; a then stores and loads
    // its own bytes. (The parked session's blocks stay pinned through a purge: another document.)
    let doc2 = tokens(9, 32);
    let blocks2 = full_block_payloads(&ns_a, &doc2);
    a.store(&ns_a, &doc2, &blocks2).await.unwrap().ok().unwrap();
    assert!(a.purge(&ns_a).await.unwrap().blocks_removed >= 2);
    let poison: Vec<_> = blocks2.iter().map(|p| bytes::Bytes::from(vec![0xEE; p.len()])).collect();
    let report = b.store(&ns_a, &doc2, &poison).await.unwrap();
    assert_eq!(report.stored, 0);
    assert!(report.rejected.iter().all(|(_, s)| *s == ItemStatus::UnknownNamespace), "{:?}", report.rejected);
    assert_eq!(a.lookup(&ns_a, &doc2).await.unwrap(), 0, "nothing of b's landed in a's namespace");
    a.store(&ns_a, &doc2, &blocks2).await.unwrap().ok().unwrap();
    assert_eq!(a.load(&ns_a, &doc2).await.unwrap(), blocks2);

    // The same-node socket checks the same way.
    let mut near = b.samenode().await.expect("same host: the same-node path opens");
    let mut dst = SharedBuffer::new(blocks.len() * ns_a.block_bytes() as usize).unwrap();
    let at: Vec<u64> = (0..blocks.len() as u64).map(|i| i * ns_a.block_bytes()).collect();
    as_if_unregistered(
        near.load_into_buffer(&ns_a, &keys, &mut dst, &at, false).await,
        near.load_into_buffer(&none, &none_keys, &mut dst, &at, false).await,
        ids,
        "same-node load",
    );
    assert!(dst.as_slice().iter().all(|&x| x == 0), "no byte of a's reached b's buffer");

    // a's data survived every attempt.
    assert_eq!(a.resume(&ns_a, "a-agent").await.unwrap().blocks, blocks);
    assert_eq!(a.list_sessions(None).await.unwrap().len(), 1);
    let text = server.scrape();
    assert!(metric(&text, "kvtier_auth_denied_total", &[]) >= 10.0, "refusals are counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_grant_allows_reads_only_and_the_operator_sees_everything() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = config(cfg_dir.path());
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let a = client_as(&server, Some(TOKEN_A)).await;
    let c = client_as(&server, Some(TOKEN_C)).await;
    let op = client_as(&server, Some(OPERATOR)).await;
    let ns_a = a.register(namespace("a", b"shared corpus", small_layout())).await.unwrap();
    let doc = tokens(2, 48);
    let blocks = full_block_payloads(&ns_a, &doc);
    a.park(&ns_a, "shared", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();

    // c reads a's namespace: lookup, load, resume, list.
    assert_eq!(c.lookup(&ns_a, &doc).await.unwrap(), 48);
    assert_eq!(c.load(&ns_a, &doc).await.unwrap(), blocks);
    assert_eq!(c.resume(&ns_a, "shared").await.unwrap().blocks, blocks);
    assert_eq!(c.list_sessions(None).await.unwrap().len(), 1);
    // ...and changes nothing.
    forbidden(c.drop_session(&ns_a, "shared").await, "drop under a read grant");
    forbidden(c.purge(&ns_a).await, "purge under a read grant");
    let report = c.store(&ns_a, &tokens(3, 16), &full_block_payloads(&ns_a, &tokens(3, 16))).await.unwrap();
    assert_eq!(report.rejected, vec![(0, ItemStatus::Forbidden)]);
    // The grant is directed: a reads nothing of c's.
    let ns_c = c.register(namespace("c", b"c", small_layout())).await.unwrap();
    let err = a.lookup(&ns_c, &doc).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownNamespace(_)), "reverse grant: {err}");

    // The operator reaches everything; a client with no token or a wrong one reaches nothing.
    assert_eq!(op.list_sessions(None).await.unwrap().len(), 1);
    assert_eq!(op.stats().await.unwrap().namespaces, 2);
    for token in [None, Some("not-any-configured-token")] {
        let err = KvClient::connect(
            &server.grpc_addr(),
            ClientConfig { auth_token: token.map(str::to_string), ..ClientConfig::default() },
        )
        .await;
        let err = match err {
            Ok(client) => client.lookup(&ns_a, &doc).await.unwrap_err(),
            Err(e) => e,
        };
        assert!(matches!(err, ClientError::Unauthenticated(_)), "{token:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_stop_a_tenant_at_its_own_namespaces_and_sessions() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = config(cfg_dir.path());
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let q = client_as(&server, Some(TOKEN_Q)).await;
    let b = client_as(&server, Some(TOKEN_B)).await;
    let ns = q.register(namespace("q", b"1", small_layout())).await.unwrap();
    // Registering the same one again is not a second namespace.
    q.register(namespace("q", b"1", small_layout())).await.unwrap();
    let Err(err) = q.register(namespace("q", b"2", small_layout())).await else { panic!("past max_namespaces") };
    assert!(matches!(err, ClientError::QuotaExceeded(ref m) if m.contains("max_namespaces")), "{err}");

    let doc = tokens(4, 32);
    let blocks = full_block_payloads(&ns, &doc);
    q.park(&ns, "one", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();
    let err = q.park(&ns, "two", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap_err();
    assert!(matches!(err, ClientError::QuotaExceeded(ref m) if m.contains("max_sessions")), "{err}");
    // Replacing its one session is fine; dropping it makes room.
    q.park(&ns, "one", &doc, &blocks, &ParkOptions::default(), 1).await.unwrap();
    assert!(q.drop_session(&ns, "one").await.unwrap());
    q.park(&ns, "two", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();

    // Another tenant is not held to q's quotas.
    let ns_b = b.register(namespace("b", b"1", small_layout())).await.unwrap();
    b.register(namespace("b", b"2", small_layout())).await.unwrap();
    let blocks_b = full_block_payloads(&ns_b, &doc);
    for id in ["x", "y", "z"] {
        b.park(&ns_b, id, &doc, &blocks_b, &ParkOptions::default(), 0).await.unwrap();
    }
    // The refusals are counted under the tenant and the quota it ran into (they were one
    // `kvtier_errors_total{kind="quota"}` for every tenant alike).
    let m = server.scrape();
    let refused = |quota: &str| metric(&m, "kvtier_quota_refusals_total", &[("tenant", "q"), ("quota", quota)]);
    assert_eq!((refused("max_namespaces"), refused("max_sessions")), (1.0, 1.0), "{m}");
    assert!(!m.contains("kvtier_quota_refusals_total{tenant=\"b\""), "{m}");
}

/// A node with the tenants of `cfg`, 64 MiB of DRAM and a 256 MiB disk tier.
fn node_with_disk(cfg: &std::path::Path) -> ServerProcess {
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB", "--disk-capacity", "256MiB"])
}

/// A tenant's `Stats` shows its disk quota as the disk's capacity from the start, as it does
/// its DRAM quota. Before, it showed the whole tier's until its first namespace was registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_stats_show_its_quotas_before_its_first_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("quota.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[tenants]]\nname = \"q\"\ntokens = [\"{TOKEN_A}\"]\ndram_bytes = \"24MiB\"\ndisk_bytes = \"32MiB\"\n"
        ),
    )
    .unwrap();
    let server = node_with_disk(&cfg);
    let q = client_as(&server, Some(TOKEN_A)).await;
    let cap = |s: &kvtier_proto::pb::StatsResponse, tier: &str| {
        s.tiers.iter().find(|t| t.tier == tier).map(|t| t.capacity_bytes)
    };
    let stats = q.stats().await.unwrap();
    assert_eq!((cap(&stats, "dram"), cap(&stats, "disk")), (Some(24 << 20), Some(32 << 20)), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_writing_past_its_dram_quota_evicts_only_its_own_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("quota.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[tenants]]\nname = \"heavy\"\ntokens = [\"{TOKEN_A}\"]\ndram_bytes = \"24MiB\"\n\n\
             [[tenants]]\nname = \"quiet\"\ntokens = [\"{TOKEN_B}\"]\ndram_bytes = \"24MiB\"\n"
        ),
    )
    .unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let heavy = client_as(&server, Some(TOKEN_A)).await;
    let quiet = client_as(&server, Some(TOKEN_B)).await;
    let ns_q = quiet.register(namespace("quiet", b"q", small_layout())).await.unwrap();
    let ns_h = heavy.register(namespace("heavy", b"h", small_layout())).await.unwrap();
    // 16 MiB for the quiet tenant (512 blocks of 32 KiB).
    let quiet_doc = tokens(5, 512 * 16);
    let quiet_blocks = full_block_payloads(&ns_q, &quiet_doc);
    quiet.store(&ns_q, &quiet_doc, &quiet_blocks).await.unwrap().ok().unwrap();
    // 128 MiB from the heavy one: twice the node's whole DRAM, five times its quota.
    for round in 0..8u32 {
        let doc = tokens(100 + round, 512 * 16);
        let blocks = full_block_payloads(&ns_h, &doc);
        let report = heavy.store(&ns_h, &doc, &blocks).await.unwrap();
        assert_eq!(report.rejected, vec![], "round {round}: room is made out of its own blocks");
    }
    assert_eq!(quiet.lookup(&ns_q, &quiet_doc).await.unwrap(), quiet_doc.len(), "every quiet block stays");
    assert_eq!(quiet.load(&ns_q, &quiet_doc).await.unwrap(), quiet_blocks);
    // Each tenant's stats show its own bytes: the quiet one its 16 MiB, and the two together
    // no more than the node holds (node-wide figures, shown to both, would add up to twice that).
    let own = |s: kvtier_proto::pb::StatsResponse| s.tiers.iter().map(|t| t.resident_bytes).sum::<u64>();
    let (of_heavy, of_quiet) = (own(heavy.stats().await.unwrap()), own(quiet.stats().await.unwrap()));
    assert!(of_quiet >= 16 << 20, "the quiet tenant's 16 MiB: {of_quiet}");
    assert!(of_heavy <= 24 << 20, "the heavy tenant's writes in flight count against its quota: {of_heavy}");
    assert!(of_heavy + of_quiet <= 64 << 20, "the node's cap holds, and each sees its own: {of_heavy} + {of_quiet}");
    // Its DRAM line: its quota as the capacity, and the blocks its bytes are.
    let dram = |s: kvtier_proto::pb::StatsResponse| s.tiers.into_iter().find(|t| t.tier == "dram").unwrap();
    let q = dram(quiet.stats().await.unwrap());
    assert_eq!(q.capacity_bytes, 24 << 20, "{q:?}");
    assert_eq!(q.blocks * quiet_blocks[0].len() as u64, q.resident_bytes, "{q:?}");
    assert!(metric(&server.scrape(), "kvtier_quota_evictions_total", &[]) >= 3000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_is_unregistered_by_its_owner_only_and_stays_gone_after_a_restart() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = config(cfg_dir.path());
    let data = tempfile::tempdir().unwrap();
    let args = ["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB", "--disk-capacity", "64MiB"];
    let mut server = ServerProcess::start_in(data.path(), &args);
    let a = client_as(&server, Some(TOKEN_A)).await;
    let b = client_as(&server, Some(TOKEN_B)).await;
    let gone = a.register(namespace("a", b"gone", small_layout())).await.unwrap();
    let kept = a.register(namespace("a", b"kept", small_layout())).await.unwrap();
    let doc = tokens(6, 48);
    for ns in [&gone, &kept] {
        let blocks = full_block_payloads(ns, &doc);
        a.park(ns, "s", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();
    }
    let err = b.unregister(&gone).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownNamespace(_)), "another tenant unregisters: {err}");
    let d = a.unregister(&gone).await.unwrap();
    let (sessions, blocks) = (d.sessions_dropped, d.blocks_removed);
    assert_eq!((sessions, blocks), (1, 3));
    let err = a.lookup(&gone, &doc).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownNamespace(_)), "{err}");
    assert_eq!(a.stats().await.unwrap().namespaces, 1);

    // After a restart the unregistered namespace (and its session) stay gone; the other is back.
    drop(a);
    drop(b);
    let _ = server.child.kill();
    let _ = server.child.wait();
    server = ServerProcess::start_in(data.path(), &args);
    // The start line counts the unregistered namespace's blocks its scan found as dropped, not
    // as recovered (3 kept, 3 dropped; it said "recovered 6 blocks").
    let line = server.stdout.iter().find(|l| l.contains("recovered")).cloned().unwrap_or_default();
    assert!(line.contains("recovered 3 blocks, 3 of deleted namespaces dropped"), "{:?}", server.stdout);
    // So do the metrics, and the gauges are there from the start (the namespaces gauge was
    // absent until a namespace was registered, the queue's until the first demotion).
    let m = server.scrape();
    assert_eq!(metric(&m, "kvtier_disk_recovered_blocks_total", &[]), 3.0, "{m}");
    assert_eq!(metric(&m, "kvtier_namespaces", &[]), 1.0, "{m}");
    assert!(m.contains("kvtier_disk_queue_depth 0"), "{m}");
    assert!(m.contains("kvtier_sessions 1"), "the kept namespace's session: {m}");
    assert!(m.contains("kvtier_connections_open{listener=\"data plane\"}"), "{m}");
    let a = client_as(&server, Some(TOKEN_A)).await;
    assert_eq!(a.stats().await.unwrap().namespaces, 1);
    assert_eq!(a.resume(&kept, "s").await.unwrap().blocks, full_block_payloads(&kept, &doc));
    let err = a.resume(&gone, "s").await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownNamespace(_)), "{err}");
    // Registering it again starts empty, and stays so across another restart (the copies
    // written before the unregistration stay gone); what it stores anew survives restarts.
    let again = a.register(namespace("a", b"gone", small_layout())).await.unwrap();
    assert_eq!(a.lookup(&again, &doc).await.unwrap(), 0);
    drop(a);
    let _ = server.child.kill();
    let _ = server.child.wait();
    server = ServerProcess::start_in(data.path(), &args);
    let a = client_as(&server, Some(TOKEN_A)).await;
    let again = a.register(namespace("a", b"gone", small_layout())).await.unwrap();
    assert_eq!(a.lookup(&again, &doc).await.unwrap(), 0, "old copies came back after a second restart");
    let fresh = full_block_payloads(&again, &doc);
    a.park(&again, "new", &doc, &fresh, &ParkOptions::default(), 0).await.unwrap();
    drop(a);
    let _ = server.child.kill();
    let _ = server.child.wait();
    server = ServerProcess::start_in(data.path(), &args);
    let a = client_as(&server, Some(TOKEN_A)).await;
    assert_eq!(a.resume(&again, "new").await.unwrap().blocks, fresh);
    // The session dropped with the unregistration stays dropped, though its blocks (the same
    // keys) are held again; and no start took it for a lost session.
    let err = a.resume(&again, "s").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(ref m) if !m.contains("lost")), "{err}");
    assert_eq!(metric(&server.scrape(), "kvtier_sessions_lost_total", &[]), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_past_its_disk_quota_does_not_push_anothers_blocks_off_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let server = with_tenants(
        dir.path(),
        &format!(
            "[[tenants]]\nname = \"heavy\"\ntokens = [\"{TOKEN_A}\"]\ndram_bytes = \"8MiB\"\ndisk_bytes = \"8MiB\"\n\n\
             [[tenants]]\nname = \"quiet\"\ntokens = [\"{TOKEN_B}\"]\n"
        ),
        "16MiB",
    );
    let heavy = client_as(&server, Some(TOKEN_A)).await;
    let quiet = client_as(&server, Some(TOKEN_B)).await;
    let ns_q = quiet.register(namespace("quiet", b"q", small_layout())).await.unwrap();
    let ns_h = heavy.register(namespace("heavy", b"h", small_layout())).await.unwrap();
    // Stores go in steps of 64 blocks (the demotion queue's depth), each once the queue is empty:
    // a machine too busy to write a queue's worth in the writers' 5 s wait would drop demotions,
    // which is not what this test is about.
    let drained = || until_demotions_written(&server);
    // 24 MiB for the quiet tenant: more than DRAM holds, so part of it is on disk.
    let quiet_doc = tokens(11, 768 * 16);
    let quiet_blocks = full_block_payloads(&ns_q, &quiet_doc);
    for first in (0..768).step_by(64) {
        let end = (first + 64) * 16;
        quiet
            .store_from(&ns_q, &quiet_doc[..end], first, &quiet_blocks[first..first + 64])
            .await
            .unwrap()
            .ok()
            .unwrap();
        drained().await;
    }
    // 160 MiB from the heavy one, whose DRAM and disk quotas are 8 MiB each: its own evictions are
    // what would fill the disk (the DRAM quota keeps this about the disk: few of the quiet
    // tenant's blocks have to leave DRAM, so a busy machine's demotion queue can't drop them).
    for round in 0..10u32 {
        let doc = tokens(200 + round, 512 * 16);
        let blocks = full_block_payloads(&ns_h, &doc);
        for first in (0..512).step_by(64) {
            let end = (first + 64) * 16;
            heavy.store_from(&ns_h, &doc[..end], first, &blocks[first..first + 64]).await.unwrap().ok().unwrap();
            drained().await;
        }
    }
    assert_eq!(quiet.lookup(&ns_q, &quiet_doc).await.unwrap(), quiet_doc.len(), "every quiet block is still held");
    let got = quiet.load(&ns_q, &quiet_doc).await.unwrap();
    assert!(
        got.len() == quiet_blocks.len() && got == quiet_blocks,
        "{} of {} quiet blocks loaded",
        got.len(),
        quiet_blocks.len()
    );
    assert!(metric(&server.scrape(), "kvtier_disk_demotions_over_quota_total", &[]) > 0.0);
}

/// A read grant is usable the way every client reads: it registers the namespace (to learn its id)
/// and then looks up and loads. Registering an existing namespace of the granting tenant creates
/// nothing and counts against no quota; creating one stays the owner's, and the grantee is told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_grantee_registers_the_owners_namespace_to_read_it_and_changes_nothing() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = config(cfg_dir.path());
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let a = client_as(&server, Some(TOKEN_A)).await;
    let b = client_as(&server, Some(TOKEN_B)).await;
    let r = client_as(&server, Some(TOKEN_R)).await;
    let op = client_as(&server, Some(OPERATOR)).await;
    let ns_a = a.register(namespace("a", b"corpus", small_layout())).await.unwrap();
    let doc = tokens(12, 64);
    let blocks = full_block_payloads(&ns_a, &doc);
    a.store(&ns_a, &doc, &blocks).await.unwrap().ok().unwrap();
    a.park(&ns_a, "shared", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();

    // r's own handle, from its own registration (as the CLI and the Python client get one).
    let ns = r.register(namespace("a", b"corpus", small_layout())).await.expect("a grantee registers");
    assert_eq!(ns.id, ns_a.id);
    assert_eq!(r.lookup(&ns, &doc).await.unwrap(), 64);
    assert_eq!(r.load(&ns, &doc).await.unwrap(), blocks);
    assert_eq!(r.resume(&ns, "shared").await.unwrap().blocks, blocks);

    // ...and changes nothing, on either plane.
    let other = tokens(13, 32);
    let report = r.store(&ns, &other, &full_block_payloads(&ns, &other)).await.unwrap();
    assert_eq!(report.stored, 0);
    assert!(report.rejected.iter().all(|(_, s)| *s == ItemStatus::Forbidden), "{:?}", report.rejected);
    forbidden(r.park(&ns, "r-agent", &doc, &blocks, &ParkOptions::default(), 0).await, "park under a read grant");
    forbidden(r.drop_session(&ns, "shared").await, "drop under a read grant");
    forbidden(r.purge(&ns).await, "purge under a read grant");
    forbidden(r.unregister(&ns).await, "unregister under a read grant");
    assert_eq!(a.lookup(&ns_a, &other).await.unwrap(), 0, "nothing of r's landed in a's namespace");
    assert_eq!(a.resume(&ns_a, "shared").await.unwrap().blocks, blocks);

    // Its registration created nothing and counted against nothing: r still registers its one own.
    assert_eq!(op.stats().await.unwrap().namespaces, 1);
    r.register(namespace("r", b"own", small_layout())).await.expect("r's max_namespaces is untouched");
    let Err(err) = r.register(namespace("r", b"second", small_layout())).await else { panic!("past max_namespaces") };
    assert!(matches!(err, ClientError::QuotaExceeded(_)), "{err}");

    // A namespace of a that a has not registered: r is told it is not there and r can't create it.
    let Err(ClientError::Forbidden(m)) = r.register(namespace("a", b"not yet", small_layout())).await else {
        panic!("a grantee created a namespace of the granting tenant")
    };
    assert!(
        m.contains("namespace not registered")
            && m.contains("tenant \"a\" has not registered it")
            && m.contains("tenant \"r\" may use it but not create it"),
        "{m}"
    );
    assert_eq!(op.stats().await.unwrap().namespaces, 2);

    // No grant, no registration: the namespace exists, but b is refused as before.
    forbidden(b.register(namespace("a", b"corpus", small_layout())).await, "register without a grant");
    let Err(ClientError::Forbidden(m)) = b.register(namespace("a", b"not yet", small_layout())).await else {
        panic!("a tenant without a grant registered another's namespace")
    };
    assert!(!m.contains("not registered"), "nothing told to a tenant without a grant: {m}");
}

/// The walkthrough's case: a tenant with a read grant uses the `kvtier` CLI's `lookup` and `get`
/// with `--tenant` naming the granting tenant; its `put` is refused, and so is a tenant without
/// a grant.
#[test]
fn a_read_grant_is_usable_from_the_cli() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = config(cfg_dir.path());
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let text = "The same documents, searched by one tenant and read by another one's chat.";
    let as_tenant = |token: &str, cmd: &str, extra: &[&str]| {
        let mut args = vec![cmd, "--server", &addr, "--auth-token", token, "--tenant", "a", "--text", text];
        args.extend_from_slice(extra);
        cli(&args)
    };
    let (ok, out, err) = as_tenant(TOKEN_A, "put", &[]);
    assert!(ok && out.contains("stored 4 of 4"), "{out} {err}");

    let (ok, out, err) = as_tenant(TOKEN_C, "lookup", &[]);
    assert!(ok && out.contains("64 of 74 tokens are stored"), "{out} {err}");
    let (ok, out, err) = as_tenant(TOKEN_C, "get", &[]);
    assert!(ok && out.contains("loaded 4 block(s) = 64 tokens"), "{out} {err}");

    let (ok, out, err) = as_tenant(TOKEN_C, "put", &["--salt", "other"]);
    assert!(
        !ok && err.contains("namespace not registered") && err.contains("may use it but not create it"),
        "{out} {err}"
    );
    let (ok, out, err) = as_tenant(TOKEN_C, "put", &[]);
    assert!(!ok && out.contains("stored 0 of 4 block(s), 0 bytes"), "{out} {err}");
    // One line for the one reason, with its stable code, and an error that carries the code too.
    assert!(out.contains("rejected block(s) 0-3: KV:Auth:Forbidden: forbidden"), "{out}");
    assert!(err.contains("KV:Auth:Forbidden: 4 of 4 block(s) refused"), "{err}");
    // A park with a read grant is refused as a park, not as one block's trouble.
    let (ok, out, err) = cli(&[
        "session",
        "park",
        "--server",
        &addr,
        "--auth-token",
        TOKEN_C,
        "--tenant",
        "a",
        "--text",
        text,
        "--id",
        "p",
    ]);
    assert!(!ok && err.contains("KV:Auth:Forbidden: session park refused: forbidden"), "{out} {err}");
    assert!(err.contains("the session was not written"), "{err}");
    // No grant at all: a store is told it may not use the namespace, not that it may not read it.
    let (ok, out, err) = as_tenant(TOKEN_B, "put", &[]);
    assert!(!ok && err.contains("tenant \"b\" may not use namespaces of tenant \"a\""), "{out} {err}");
    // Another tenant's namespace is answered as one nobody registered (the CLI's questions
    // register nothing, so the registration's "forbidden" is not said either).
    let (ok, out, err) = as_tenant(TOKEN_B, "lookup", &[]);
    assert!(ok && out.contains("0 of 74 tokens are stored") && out.contains("no such namespace"), "{out} {err}");
    let (ok, out, _) = as_tenant(TOKEN_A, "lookup", &[]);
    assert!(ok && out.contains("64 of 74 tokens are stored"), "{out}");

    // Without `--tenant` the namespace is the credential's tenant's (the node says whose in its
    // `Info`): a's own put and lookup name a's namespace, not the `cli` tenant's another tenant
    // would be refused.
    let (ok, out, err) = cli(&["put", "--server", &addr, "--auth-token", TOKEN_A, "--text", text]);
    assert!(ok && out.contains("stored 4 of 4"), "{out} {err}");
    let (ok, out, err) = cli(&["lookup", "--server", &addr, "--auth-token", TOKEN_A, "--text", text]);
    assert!(ok && out.contains("64 of 74 tokens are stored"), "{out} {err}");
    // The same namespace as `--tenant a` names: c, granted a's, reads it.
    let (ok, out, err) = as_tenant(TOKEN_C, "lookup", &[]);
    assert!(ok && out.contains("64 of 74 tokens are stored"), "{out} {err}");
}

/// With a disk tier, a tenant's parked session may be larger than its `dram_bytes` quota: its pins
/// stop at their share of the quota (as the node's at `max_pinned_ratio`), the rest of the park's
/// blocks are leased without a pin, and the manifest pins them all on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_session_larger_than_its_dram_quota_parks_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("quota.toml");
    std::fs::write(&cfg, format!("[[tenants]]\nname = \"a\"\ntokens = [\"{TOKEN_A}\"]\ndram_bytes = \"8MiB\"\n"))
        .unwrap();
    let server = node_with_disk(&cfg);
    let a = client_as(&server, Some(TOKEN_A)).await;
    let ns = a.register(namespace("a", b"a", small_layout())).await.unwrap();
    // 12 MiB of KV (384 blocks of 32 KiB) against an 8 MiB quota.
    let doc = tokens(3, 384 * 16);
    let blocks = session_payloads(&ns, &doc);
    let info = a.park(&ns, "long", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();
    assert_eq!(info.token_count as usize, doc.len());
    assert_eq!(a.resume(&ns, "long").await.unwrap().blocks, blocks, "resumed whole and byte-exact");
    assert!(metric(&server.scrape(), "kvtier_dram_leases_unpinned_total", &[]) > 0.0, "past its pinned share");
}

/// What quotas reserve is kept from the tenants without one (and the operator): a tenant with no
/// `dram_bytes` flooding the tier evicts its own blocks, never those of a tenant under its quota,
/// and the namespaces of owners without a `max_namespaces` share the node's slots the quotas
/// leave. Before, the flood evicted the quota'd tenant's blocks to nothing, and a tenant without
/// a `max_namespaces` could take every slot on the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_quotas_reserve_is_kept_from_tenants_without_one() {
    const KEPT: &str = "tenant-kept-secret-01";
    const FREE: &str = "tenant-free-secret-02";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tenants.toml");
    std::fs::write(
        &path,
        format!(
            "auth_token = \"{OPERATOR}\"\n\n[[tenants]]\nname = \"kept\"\ntokens = [\"{KEPT}\"]\n\
             dram_bytes = \"16MiB\"\nmax_namespaces = 4090\n\n[[tenants]]\nname = \"free\"\ntokens = [\"{FREE}\"]\n"
        ),
    )
    .unwrap();
    let server = ServerProcess::start(&["--config", path.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let (kept, free) = (client_as(&server, Some(KEPT)).await, client_as(&server, Some(FREE)).await);
    let kept_ns = kept.register(namespace("kept", b"", small_layout())).await.unwrap();
    let free_ns = free.register(namespace("free", b"", small_layout())).await.unwrap();
    let mine = tokens(1, 16 * 256); // 256 blocks of 32 KiB: 8 MiB, half its quota
    let blocks = full_block_payloads(&kept_ns, &mine);
    kept.store(&kept_ns, &mine, &blocks).await.unwrap().ok().unwrap();
    for seed in 100..132 {
        let t = tokens(seed, 16 * 256);
        let p = full_block_payloads(&free_ns, &t);
        free.store(&free_ns, &t, &p).await.unwrap().ok().unwrap();
    }
    assert_eq!(kept.lookup(&kept_ns, &mine).await.unwrap(), mine.len(), "the quota'd tenant's blocks were evicted");
    assert_eq!(kept.load(&kept_ns, &mine).await.unwrap(), blocks);
    let last = tokens(131, 16 * 256);
    assert_eq!(free.lookup(&free_ns, &last).await.unwrap(), last.len(), "the flood keeps its newest");

    // Slots: 4,096 less kept's 4,090 leaves 6 for the others (free's and the operator's).
    let op = client_as(&server, Some(OPERATOR)).await;
    for i in 0..4u8 {
        free.register(namespace("free", &[i], small_layout())).await.unwrap();
    }
    op.register(namespace("ops", b"", small_layout())).await.unwrap(); // 6 with free's first
    let Err(err) = free.register(namespace("free", b"seventh", small_layout())).await else { panic!("past the share") };
    assert!(matches!(err, ClientError::Capacity(ref m) if m.contains("share 6")), "{err}");
    kept.register(namespace("kept", b"second", small_layout())).await.expect("kept's slots are its own");
}

/// A tenant at its `max_namespaces` asking the CLI about a namespace that does not exist is told
/// there is none, and nothing is created, not refused for its quota (the CLI registers the
/// namespace it names before every command).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_questions_about_a_namespace_that_does_not_exist_create_none() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&["--config", config(dir.path()).to_str().unwrap()]);
    let addr = server.grpc_addr();
    let q = |args: &[&str]| {
        let all: Vec<&str> =
            args.iter().copied().chain(["--server", &addr, "--auth-token", TOKEN_Q, "--tenant", "q"]).collect();
        cli(&all)
    };
    let (ok, out, err) = q(&["put", "--text", "a prefix of tokens long enough for a block or more of them"]);
    assert!(ok, "{out} {err}");
    let (ok, out, err) = q(&["lookup", "--model", "never-existed", "--text", "a prefix of tokens"]);
    assert!(ok && out.contains("0 of 18 tokens"), "{out} {err}");
    let (ok, out, err) = q(&["session", "ls", "--model", "never-existed"]);
    assert!(ok && out.contains("0 session(s)"), "{out} {err}");
    let (ok, _, err) = q(&["unregister", "--model", "never-existed"]);
    assert!(!ok && err.contains("KV:Namespace:Unknown") && !err.contains("Quota"), "{err}");
    let client = client_as(&server, Some(TOKEN_Q)).await;
    assert_eq!(client.stats().await.unwrap().namespaces, 1, "nothing was created");

    // A tenant far from its quota: a typo in the flags created the namespace, for good, and
    // `purge` said it purged nothing.
    let a = |args: &[&str]| {
        let all: Vec<&str> =
            args.iter().copied().chain(["--server", &addr, "--auth-token", TOKEN_A, "--tenant", "a"]).collect();
        cli(&all)
    };
    let typo = ["--model", "typo-model"];
    let (ok, out, err) = a(&[&["lookup", "--text", "a prefix of tokens"][..], &typo].concat());
    assert!(ok && out.contains("0 of 18 tokens") && out.contains("no such namespace"), "{out} {err}");
    let (ok, out, err) = a(&[&["get", "--text", "a prefix of tokens"][..], &typo].concat());
    assert!(ok && out.contains("loaded 0 block(s)") && out.contains("no such namespace"), "{out} {err}");
    let (ok, out, err) = a(&[&["session", "ls"][..], &typo].concat());
    assert!(ok && out.contains("0 session(s)") && out.contains("no such namespace"), "{out} {err}");
    for cmd in [&["session", "resume", "--id", "s"][..], &["session", "drop", "--id", "s"], &["purge"], &["unregister"]]
    {
        let (ok, _, err) = a(&[cmd, &typo].concat());
        assert!(!ok && err.contains("KV:Namespace:Unknown"), "{cmd:?}: {err}");
    }
    let client = client_as(&server, Some(TOKEN_A)).await;
    assert_eq!(client.stats().await.unwrap().namespaces, 0, "nothing was created");
}

/// A member passes an unregistration on to every other (`local_only`, as the operator): a node
/// that does not know the namespace still remembers when its sessions went, so that a copy held
/// by a node that was away is not adopted through it (`tests/session_replicas.rs`). A tenant's
/// `local_only` unregistration of a namespace unknown here plants nothing against another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unregistration_passed_on_for_an_unknown_namespace_is_remembered_for_the_operator_only() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&["--config", config(dir.path()).to_str().unwrap()]);
    let (op, a, b) = (
        client_as(&server, Some(OPERATOR)).await,
        client_as(&server, Some(TOKEN_A)).await,
        client_as(&server, Some(TOKEN_B)).await,
    );
    let (passed_on, planted) =
        (namespace("a", b"passed-on", small_layout()), namespace("a", b"planted", small_layout()));
    let unregister = |id: NamespaceId| kvtier_proto::pb::UnregisterNamespaceRequest {
        namespace_id: bytes::Bytes::copy_from_slice(&id.0),
        local_only: true,
        as_of_ago_ms: 1,
    };
    for (by, ns) in [(&op, &passed_on), (&b, &planted)] {
        let err = by.raw_grpc().unregister_namespace(unregister(ns.id())).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    }
    for (ns, remembered) in [(passed_on, true), (planted, false)] {
        let h = a.register(ns).await.unwrap();
        let toks = tokens(7, 40);
        a.park(&h, "s", &toks, &session_payloads(&h, &toks), &ParkOptions::default(), 0).await.unwrap();
        let r = op
            .session_replica(kvtier_proto::pb::SessionReplicaRequest {
                namespace_id: bytes::Bytes::copy_from_slice(&h.id.0),
                session_id: "s".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(r.held, "a session parked since is the namespace's own");
        assert_eq!(r.dropped, remembered, "{r:?}");
    }
}

/// A tenant's `disk_bytes` holds against a burst: its evicted blocks queued for the disk count
/// against the quota before they are written (all of a burst passed the check at once, and the
/// tenant ended a queue's worth of blocks past it, its own Stats showing 2.7 MiB of 2). And a
/// park its `max_session_bytes` refuses writes nothing to disk (its blocks were made durable
/// before the check, and stayed: 3x the tenant's disk quota after five refused parks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_disk_quota_holds_against_bursts_and_refused_parks() {
    let dir = tempfile::tempdir().unwrap();
    let server = with_tenants(
        dir.path(),
        &format!(
            "auth_token = \"{OPERATOR}\"\n\
             [[tenants]]\nname = \"bursty\"\ntokens = [\"{TOKEN_A}\"]\ndram_bytes = \"1MiB\"\ndisk_bytes = \"2MiB\"\n\n\
             [[tenants]]\nname = \"parker\"\ntokens = [\"{TOKEN_B}\"]\nmax_session_bytes = \"1MiB\"\n"
        ),
        "64MiB",
    );
    let disk_of = |s: kvtier_proto::pb::StatsResponse| {
        s.tiers.into_iter().find(|t| t.tier == "disk").map_or(0, |t| t.resident_bytes)
    };
    let bursty = client_as(&server, Some(TOKEN_A)).await;
    let ns = bursty.register(namespace("bursty", b"b", small_layout())).await.unwrap();
    let block = small_layout().block_bytes();
    // 6 MiB in one call: DRAM keeps 1 MiB, the rest is evicted at once.
    let doc = tokens(5, 192 * 16);
    bursty.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap();
    until_demotions_written(&server).await;
    let on_disk = disk_of(bursty.stats().await.unwrap());
    assert!(on_disk >= 2 * block, "some of the burst went to disk: {on_disk}");
    // Its Stats count its blocks there (they said 0 blocks).
    let disk = bursty.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "disk").unwrap();
    assert_eq!(disk.blocks * block, disk.resident_bytes, "{disk:?}");
    assert!(on_disk <= (2 << 20) + block, "{on_disk} bytes on disk, past the 2 MiB quota by more than a block");

    let parker = client_as(&server, Some(TOKEN_B)).await;
    let ns = parker.register(namespace("parker", b"p", small_layout())).await.unwrap();
    let toks = tokens(6, 48 * 16);
    for i in 0..3 {
        let err = parker
            .park(&ns, &format!("big{i}"), &toks, &session_payloads(&ns, &toks), &ParkOptions::default(), 0)
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::QuotaExceeded(ref m) if m.contains("max_session_bytes")), "{err}");
    }
    assert_eq!(disk_of(parker.stats().await.unwrap()), 0, "a refused park wrote its blocks to disk");
    // A park within the quota: its blocks on disk, pinned there, in the tenant's Stats (its
    // disk showed pinned 0 while the operator's showed the session's bytes).
    let small = tokens(7, 8 * 16);
    parker.park(&ns, "small", &small, &session_payloads(&ns, &small), &ParkOptions::default(), 0).await.unwrap();
    let disk = parker.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "disk").unwrap();
    assert_eq!((disk.blocks, disk.pinned_bytes, disk.resident_bytes), (8, 8 * block, 8 * block), "{disk:?}");

    // The operator's Stats break the node down by tenant: each tenant's share is what its own
    // Stats show; a tenant's Stats list no tenants.
    let op = client_as(&server, Some(OPERATOR)).await.stats().await.unwrap();
    let names: Vec<&str> = op.tenants.iter().map(|t| t.tenant.as_str()).collect();
    assert_eq!(names, ["bursty", "parker"]);
    for (t, c) in op.tenants.iter().zip([&bursty, &parker]) {
        let own = c.stats().await.unwrap();
        assert!(own.tenants.is_empty(), "a tenant sees no other tenant");
        assert_eq!((t.namespaces, t.sessions), (own.namespaces, own.sessions), "{}", t.tenant);
        let disk = |tiers: &[kvtier_proto::pb::TierStats]| tiers.iter().find(|x| x.tier == "disk").cloned().unwrap();
        let (theirs, mine) = (disk(&t.tiers), disk(&own.tiers));
        assert_eq!(
            (theirs.blocks, theirs.resident_bytes, theirs.pinned_bytes, theirs.capacity_bytes),
            (mine.blocks, mine.resident_bytes, mine.pinned_bytes, mine.capacity_bytes),
            "{}",
            t.tenant
        );
    }
    assert_eq!(op.tenants[1].sessions, 1);
    let (ok, out, err) = cli(&["stats", "--server", &server.grpc_addr(), "--auth-token", OPERATOR]);
    assert!(ok && out.contains("tenant parker: 1 namespace(s), 1 session(s); dram "), "{out} {err}");
}
