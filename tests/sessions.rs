//! Agent sessions against a real server: park after turn 1, extend after turn 2 sending only new
//! blocks, resume with identical bytes, drop frees the pins, TTL expiry.

use std::time::Duration;

use kvtier_client::{ClientError, ParkOptions};
use kvtier_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_extend_resume_drop() {
    let server = ServerProcess::start(&["--dram-capacity", "128MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"s", small_layout())).await.unwrap();
    let bb = ns.block_bytes();

    // Turn 1: 1000 tokens = 62 full blocks + a tail of 8.
    let turn1 = tokens(7, 1000);
    let blocks1 = session_payloads(&ns, &turn1);
    assert_eq!(blocks1.len(), 63);
    let info = client.park(&ns, "agent-7", &turn1, &blocks1, &ParkOptions::default(), 0).await.unwrap();
    assert_eq!((info.version, info.token_count, info.blocks, info.has_tail), (1, 1000, 62, true));

    // Turn 2: 600 more tokens. Only blocks from index 62 (old tail + new tokens) on are sent.
    let mut turn2 = turn1.clone();
    turn2.extend(tokens(8, 600));
    let all2 = session_payloads(&ns, &turn2);
    let new_blocks = &all2[62..];
    let before = client.stats().await.unwrap().tiers[0].bytes_in;
    let info = client.extend(&ns, "agent-7", 1, 1000, &turn2, new_blocks).await.unwrap();
    assert_eq!((info.version, info.token_count, info.blocks, info.has_tail), (2, 1600, 100, false));
    let after = client.stats().await.unwrap().tiers[0].bytes_in;
    assert_eq!(after - before, 38 * bb, "only the 38 new blocks travel");

    // Extending against a stale version changes nothing.
    let err = client.extend(&ns, "agent-7", 1, 1600, &turn2, &[]).await.unwrap_err();
    assert!(matches!(err, ClientError::VersionConflict(_)), "{err}");

    // Resume (from another connection) returns exactly the KV of the 1600 tokens.
    let other = server.client().await;
    let ns2 = other.register(namespace("agents", b"s", small_layout())).await.unwrap();
    let r = other.resume(&ns2, "agent-7").await.unwrap();
    assert_eq!(r.info.version, 2);
    assert_eq!(r.blocks, all2);

    // The session's blocks are also prefix-cache hits for anyone with the same tokens.
    assert_eq!(other.lookup(&ns2, &turn2).await.unwrap(), 1600);

    let pinned = client.stats().await.unwrap().tiers[0].pinned_bytes;
    assert!(pinned >= 100 * bb, "pinned {pinned}");
    assert_eq!(client.list_sessions(Some(&ns)).await.unwrap().len(), 1);
    assert!(client.drop_session(&ns, "agent-7").await.unwrap());
    assert_eq!(client.stats().await.unwrap().tiers[0].pinned_bytes, 0);
    assert!(!client.drop_session(&ns, "agent-7").await.unwrap());
    let err = client.resume(&ns, "agent-7").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expiry_unpins_and_resume_says_expired() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"ttl", small_layout())).await.unwrap();
    let t = tokens(3, 100);
    let opts = ParkOptions { ttl: Some(Duration::from_millis(600)), priority: None };
    client.park(&ns, "short-lived", &t, &session_payloads(&ns, &t), &opts, 0).await.unwrap();
    assert!(client.stats().await.unwrap().tiers[0].pinned_bytes > 0);
    // The sweeper (every 250 ms, its expiry written on the I/O pool) runs past the TTL: the pins
    // are gone even before anyone asks. Polled: a fixed 1.5 s was a guess on a busy machine.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let s = client.stats().await.unwrap();
        if s.tiers[0].pinned_bytes == 0 && s.sessions == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the expired session still pins: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let err = client.resume(&ns, "short-lived").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionExpired(_)), "{err}");
    assert!(err.to_string().contains("KV:Session:Expired"), "{err}");
    // The id can be parked again afresh.
    let info =
        client.park(&ns, "short-lived", &t, &session_payloads(&ns, &t), &ParkOptions::default(), 0).await.unwrap();
    assert_eq!(info.version, 1);
}

/// A park asking for a TTL above the server's `session_max_ttl` is refused by the client before
/// any block is sent (the node says its limit when the client connects); the node's own check
/// refuses it too, for a client that was not told. Before, the blocks were uploaded and left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_over_the_servers_limit_is_refused_before_anything_is_sent() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    assert_eq!(client.server_info().session_max_ttl_ms, 24 * 3600 * 1000);
    let ns = client.register(namespace("agents", b"max-ttl", small_layout())).await.unwrap();
    let t = tokens(4, 100);
    let too_long = ParkOptions { ttl: Some(Duration::from_secs(100 * 24 * 3600)), priority: None };
    let err = client.park(&ns, "long", &t, &session_payloads(&ns, &t), &too_long, 0).await.unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(ref m) if m.contains("session_max_ttl")), "{err}");
    assert_eq!(client.lookup(&ns, &t).await.unwrap(), 0, "blocks were sent for a park that could not be");
    assert_eq!(client.stats().await.unwrap().sessions, 0);
    // A client that was not told (a raw call) is refused by the node.
    let e = client
        .raw_grpc()
        .park_session(kvtier_proto::pb::ParkRequest {
            namespace_id: bytes::Bytes::copy_from_slice(&ns.id.0),
            session_id: "long".into(),
            ttl_ms: 100 * 24 * 3600 * 1000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(e.code() == tonic::Code::InvalidArgument && e.message().contains("session_max_ttl"), "{e:?}");
    // The limit itself is accepted.
    let max = ParkOptions { ttl: Some(Duration::from_secs(24 * 3600)), priority: None };
    assert_eq!(client.park(&ns, "long", &t, &session_payloads(&ns, &t), &max, 0).await.unwrap().version, 1);
}

/// An extend's context must start with the session's tokens: one that doesn't (another first
/// turn, of any length) is refused with `KV:Request:Invalid`, and the session keeps its version
/// and its bytes. `session_manifest` reads the manifest alone (no block leaves the node), and a
/// TTL of 0 is refused before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_with_a_context_that_does_not_continue_the_session_is_refused() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--disk-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"continue", small_layout())).await.unwrap();
    let turn1 = tokens(11, 82);
    let blocks1 = session_payloads(&ns, &turn1);
    client.park(&ns, "agent-1", &turn1, &blocks1, &ParkOptions::default(), 0).await.unwrap();

    let dram_out = |s: &ServerProcess| metric(&s.scrape(), "kvtier_tier_bytes_out_total", &[("tier", "dram")]);
    let before = dram_out(&server);
    let m = client.session_manifest(&ns, "agent-1").await.unwrap();
    assert_eq!((m.info.version, m.info.token_count, m.keys.len(), m.tail_key.is_some()), (1, 82, 5, true));
    assert_eq!(m.keys, ns.keys(&turn1));
    assert_eq!(dram_out(&server), before, "reading a manifest moved blocks");

    // Another context, longer than the session's: its first five blocks' keys differ.
    let disk_in = |s: &ServerProcess| metric(&s.scrape(), "kvtier_tier_bytes_in_total", &[("tier", "disk")]);
    let disk_before = disk_in(&server);
    assert!(disk_before > 0.0, "the park made its blocks durable on disk");
    let other = tokens(12, 87);
    let base = 82 / ns.block_tokens();
    let err = client.extend(&ns, "agent-1", 1, 82, &other, &session_payloads(&ns, &other)[base..]).await.unwrap_err();
    match &err {
        ClientError::Refused { code, message } => {
            assert_eq!(code, "KV:Request:Invalid", "{err}");
            assert!(message.contains("does not continue session \"agent-1\"") && message.contains("first 80 tokens"));
        }
        other => panic!("{other}"),
    }
    // The same tokens but the last kept block changed: refused too.
    let mut edited = turn1.clone();
    edited[79] ^= 1;
    edited.extend(tokens(13, 20));
    let err = client.extend(&ns, "agent-1", 1, 82, &edited, &session_payloads(&ns, &edited)[base..]).await;
    assert!(matches!(err, Err(ClientError::Refused { .. })), "{err:?}");
    // Refused before the new blocks were made durable: nothing was written to disk for them.
    assert_eq!(disk_in(&server), disk_before, "a refused extend wrote its blocks to disk");
    let r = client.resume(&ns, "agent-1").await.unwrap();
    assert_eq!((r.info.version, r.info.token_count), (1, 82));
    assert_eq!(r.blocks, blocks1, "a refused extend changed the session's bytes");

    // A context that continues it (an edit past the parked tokens is the new turn's business).
    let mut turn2 = turn1.clone();
    turn2.extend(tokens(14, 30));
    let info = client.extend(&ns, "agent-1", 1, 82, &turn2, &session_payloads(&ns, &turn2)[base..]).await.unwrap();
    assert_eq!((info.version, info.token_count), (2, 112));
    assert_eq!(client.resume(&ns, "agent-1").await.unwrap().blocks, session_payloads(&ns, &turn2));

    let zero = ParkOptions { ttl: Some(Duration::ZERO), priority: None };
    let err = client.park(&ns, "dead", &turn1, &blocks1, &zero, 0).await.unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(ref m) if m.contains("TTL of 0")), "{err}");
    assert!(matches!(client.resume(&ns, "dead").await, Err(ClientError::SessionNotFound(_))));
}

/// 64 MiB of DRAM, a 1 GiB disk tier, blocks of 2 MiB. A 30-block
/// session (60 MiB, past the 90% of DRAM that may be pinned) parks — on disk, where its manifest
/// pins it — and resumes whole, and so does a 40-block one (80 MiB, more than all of DRAM);
/// nothing stays pinned in DRAM.
#[test]
fn a_session_larger_than_the_pinned_share_of_dram_parks_on_disk() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--disk-capacity", "1GiB"]);
    let addr = server.grpc_addr();
    let ids: Vec<String> = (3..483).map(|t: u32| t.to_string()).collect();
    let tokens = ids.join(",");
    let layout = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"];
    let with = |cmd: &[&str]| {
        let mut args = cmd.to_vec();
        args.extend_from_slice(&["--server", &addr]);
        args.extend_from_slice(&layout);
        cli(&args)
    };
    let (ok, out, err) = with(&["session", "park", "--id", "big", "--tokens", &tokens]);
    assert!(ok && out.contains("v1: 480 tokens, 30 blocks"), "{out} {err}");
    let (ok, out, err) = with(&["session", "resume", "--id", "big"]);
    assert!(ok && out.contains("480 tokens"), "{out} {err}");
    let text = server.scrape();
    assert_eq!(metric(&text, "kvtier_tier_pinned_bytes", &[("tier", "dram")]), 0.0, "{text}");
    // Larger than the whole of DRAM: the blocks past the pinned share make room by going to
    // disk before the park pins them there.
    let more: Vec<String> = (1000..1640).map(|t: u32| t.to_string()).collect();
    let (ok, out, err) = with(&["session", "park", "--id", "bigger", "--tokens", &more.join(",")]);
    assert!(ok && out.contains("v1: 640 tokens, 40 blocks"), "{out} {err}");
    let (ok, out, err) = with(&["session", "resume", "--id", "bigger"]);
    assert!(ok && out.contains("640 tokens"), "{out} {err}");
    let (ok, out, err) = cli(&["stats", "--server", &addr]);
    assert!(ok, "{err}");
    let disk = out.lines().find(|l| l.trim_start().starts_with("disk:")).unwrap_or_default();
    assert!(disk.contains("pinned 146800640;"), "the sessions' 60 + 80 MiB are pinned on disk: {out}");
    let text = server.scrape();
    assert_eq!(
        metric(&text, "kvtier_tier_pinned_bytes", &[("tier", "disk")]),
        146800640.0,
        "the disk tier's pinned gauge follows its pins: {text}"
    );
}

/// An unregistration a cluster member gets late (`local_only`, `as_of_ago_ms`: it was away when
/// it was asked) keeps the sessions touched since — the namespace was registered again and they
/// are its — and the namespace with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_unregistration_keeps_the_sessions_touched_since() {
    let server = ServerProcess::start(&["--dram-capacity", "128MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"late", small_layout())).await.unwrap();
    let (old, new) = (tokens(31, 100), tokens(32, 100));
    let (old_blocks, new_blocks) = (session_payloads(&ns, &old), session_payloads(&ns, &new));
    client.park(&ns, "old", &old, &old_blocks, &ParkOptions::default(), 0).await.unwrap();
    let old_done = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let new_asked = std::time::Instant::now();
    client.park(&ns, "new", &new, &new_blocks, &ParkOptions::default(), 0).await.unwrap();
    let unregister = |ago_ms: u64| kvtier_proto::pb::UnregisterNamespaceRequest {
        namespace_id: bytes::Bytes::copy_from_slice(&ns.id.0),
        local_only: true,
        as_of_ago_ms: ago_ms,
    };
    // Asked halfway between the two parks: "old" was touched before, "new" since. (The age is
    // measured from here, not fixed: a fixed 300 ms after a 600 ms gap fails whenever the new park's
    // answer and this request take longer than 300 ms, as on a busy machine.)
    let asked_at = old_done + (new_asked - old_done) / 2;
    let ago = asked_at.elapsed().as_millis() as u64;
    let r = client.raw_grpc().unregister_namespace(unregister(ago)).await.unwrap().into_inner();
    assert_eq!(r.sessions_dropped, 1, "{r:?}");
    assert!(client.resume(&ns, "new").await.unwrap().blocks == new_blocks, "wrong bytes");
    let err = client.resume(&ns, "old").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
    // Without an age (a plain unregistration): every session goes, and the namespace.
    let r = client.raw_grpc().unregister_namespace(unregister(0)).await.unwrap().into_inner();
    assert_eq!(r.sessions_dropped, 1, "{r:?}");
    let err = client.lookup(&ns, &new).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownNamespace(_)), "{err}");
}

/// A listing of more sessions than one page holds comes whole and in order (the client asks a
/// page at a time); each session's own memory counts against `max_session_keys`, so sessions
/// of one key each can't grow without bound. Before, a node holding ~240k sessions answered
/// `ListSessions` with a message past gRPC's 64 MiB cap (an error for everyone), and sessions
/// naming one block each were bounded only by their keys, ~30x below their real memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sessions_list_page_by_page_and_count_their_own_memory() {
    // 4,100 sessions of one key: (1 + 32) keys' worth each, 135,300 in all; room for no more.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kvtier.toml");
    std::fs::write(&cfg, "max_session_keys = 135320\n").unwrap();
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--config", cfg.to_str().unwrap()]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"many", tiny_layout())).await.unwrap();
    let toks = tokens(3, 16);
    let blocks = full_block_payloads(&ns, &toks);
    for i in 0..4100 {
        client.park(&ns, &format!("s{i:05}"), &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    }
    let err = client.park(&ns, "one-too-many", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap_err();
    assert!(matches!(err, ClientError::Capacity(ref m) if m.contains("max_session_keys")), "{err}");
    let listed = client.list_sessions(Some(&ns)).await.unwrap();
    let ids: Vec<String> = listed.iter().map(|s| s.id.clone()).collect();
    let want: Vec<String> = (0..4100).map(|i| format!("s{i:05}")).collect();
    assert_eq!(ids, want);
    assert_eq!(client.list_sessions(None).await.unwrap().len(), 4100);
}

/// An extend whose context keeps the session's full blocks but not the tokens of its partial
/// tail is refused, the session unchanged; one that keeps them extends. Before, only the full
/// blocks were compared, and the tail's tokens were silently replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extend_that_rewrites_the_sessions_tail_is_refused() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"tail", small_layout())).await.unwrap();
    let turn1 = tokens(11, 40); // two full blocks of 16 and a tail of 8
    let blocks1 = session_payloads(&ns, &turn1);
    client.park(&ns, "t", &turn1, &blocks1, &ParkOptions::default(), 0).await.unwrap();

    let mut other = turn1[..32].to_vec();
    other.extend(tokens(99, 8)); // the tail's tokens, rewritten
    other.extend(tokens(12, 10));
    let blocks = session_payloads(&ns, &other);
    let err = client.extend(&ns, "t", 1, 40, &other, &blocks[2..]).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("KV:Request:Invalid") && msg.contains("tokens 32..40 differ"), "{msg}");
    let r = client.resume(&ns, "t").await.unwrap();
    assert_eq!((r.info.version, r.info.token_count), (1, 40), "unchanged");
    assert!(r.blocks == blocks1, "the session's bytes");

    let mut turn2 = turn1.clone();
    turn2.extend(tokens(12, 10));
    let blocks2 = session_payloads(&ns, &turn2);
    let info = client.extend(&ns, "t", 1, 40, &turn2, &blocks2[2..]).await.unwrap();
    assert_eq!((info.version, info.token_count), (2, 50));
    assert!(client.resume(&ns, "t").await.unwrap().blocks == blocks2);
}

/// A session that expired while its node was down says it expired after the restart, as it
/// would have with the node running (it answered "not found").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_expired_while_the_node_was_down_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--dram-capacity", "64MiB", "--disk-capacity", "64MiB"];
    let mut server = ServerProcess::start_in(dir.path(), &args);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"expiry", small_layout())).await.unwrap();
    let toks = tokens(21, 40);
    let blocks = session_payloads(&ns, &toks);
    let short = ParkOptions { ttl: Some(Duration::from_millis(800)), ..ParkOptions::default() };
    client.park(&ns, "brief", &toks, &blocks, &short, 0).await.unwrap();
    client.park(&ns, "lasting", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let server = server.restart_in_place(&args);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"expiry", small_layout())).await.unwrap();
    let err = client.resume(&ns, "brief").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionExpired(_)), "{err}");
    assert!(client.resume(&ns, "lasting").await.unwrap().blocks == blocks);
    let err = client.resume(&ns, "never").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
}

/// A session request naming no session is refused, whoever sends it: an empty id is also the
/// mark under which a node remembers a namespace's unregistration, and a drop of "" passed on
/// by the node that took it was remembered as the whole namespace dropped (its older sessions
/// then dropped wherever a resume met them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_request_without_a_session_id_is_refused() {
    use kvtier_proto::pb;
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"no-id", small_layout())).await.unwrap();
    let toks = tokens(41, 40);
    client.park(&ns, "s", &toks, &session_payloads(&ns, &toks), &ParkOptions::default(), 0).await.unwrap();
    let id = bytes::Bytes::copy_from_slice(&ns.id.0);
    let mut g = client.raw_grpc();
    let drop = g.drop_session(pb::DropSessionRequest { namespace_id: id.clone(), session_id: String::new() }).await;
    assert_eq!(drop.unwrap_err().code(), tonic::Code::InvalidArgument);
    let resume = g.resume_session(pb::ResumeRequest { namespace_id: id.clone(), session_id: String::new() }).await;
    assert_eq!(resume.unwrap_err().code(), tonic::Code::InvalidArgument);
    // The operator's replica calls (no auth here: every caller is the operator).
    let replica = |op: pb::session_replica_request::Op, session: &str| pb::SessionReplicaRequest {
        namespace_id: id.clone(),
        session_id: session.into(),
        op: op as i32,
        dropped: true,
        dropped_ago_ms: 1,
        ..Default::default()
    };
    let err = client.session_replica(replica(pb::session_replica_request::Op::Drop, "")).await.unwrap_err();
    assert!(err.to_string().contains("session_id"), "{err}");
    let got = client.session_replica(replica(pb::session_replica_request::Op::Get, "s")).await.unwrap();
    assert!(got.held && !got.dropped, "{got:?}");
    assert_eq!(client.resume(&ns, "s").await.unwrap().info.version, 1);
}
