//! TLS on both planes and client certificates as credentials, against a real server whose
//! certificates come from `kvtier cert`: a tenant named by its certificate reaches its own data
//! and nothing of another's; clients without a certificate, with one from another CA, speaking
//! plain TCP or checking for another name are refused while the server keeps serving; a token
//! beside a certificate must name the same principal; the nodes of a cluster reach each other
//! over TLS, or QUIC, with their node certificates.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvtier_client::{ClientConfig, ClientError, ClientTls, KvClient, ParkOptions};
use kvtier_tests::*;

const CAROL_TOKEN: &str = "carol-secret-token-0001";

/// `kvtier cert ...` in `dir`; panics with its output when it fails.
fn cert(args: &[&str]) {
    let out = Command::new(kvtier_bin()).arg("cert").args(args).output().expect("run kvtier cert");
    assert!(out.status.success(), "kvtier cert {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA with a node certificate for 127.0.0.1 and localhost, clients alice, bob, ops and dave (in
/// no tenant's `cert_names`), and a second, unrelated CA ("rogue") that also issued an "alice".
fn pki(dir: &Path) -> (PathBuf, PathBuf) {
    let (ca, rogue) = (dir.join("ca"), dir.join("rogue"));
    let (ca_s, rogue_s) = (ca.to_str().unwrap(), rogue.to_str().unwrap());
    cert(&["ca", "--dir", ca_s]);
    cert(&["node", "--dir", ca_s, "--name", "node", "--host", "127.0.0.1", "--host", "localhost"]);
    for who in ["alice", "bob", "ops", "dave"] {
        cert(&["client", "--dir", ca_s, "--name", who]);
    }
    cert(&["ca", "--dir", rogue_s]);
    cert(&["client", "--dir", rogue_s, "--name", "alice"]);
    (ca, rogue)
}

fn config(dir: &Path, ca: &Path, require_client_cert: bool) -> PathBuf {
    let path = dir.join("tls.toml");
    let p = |f: &str| ca.join(f).display().to_string();
    std::fs::write(
        &path,
        format!(
            r#"
[tls]
cert = "{}"
key = "{}"
client_ca = "{}"
require_client_cert = {require_client_cert}
operator_names = ["ops"]

[[tenants]]
name = "alice"
cert_names = ["alice"]

[[tenants]]
name = "bob"
cert_names = ["bob"]

[[tenants]]
name = "carol"
tokens = ["{CAROL_TOKEN}"]
"#,
            p("node.pem"),
            p("node.key"),
            p("ca.pem")
        ),
    )
    .unwrap();
    path
}

fn tls(ca: &Path, who: Option<(&Path, &str)>) -> ClientTls {
    let ident = who.map(|(dir, name)| (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key"))));
    ClientTls::from_files(&ca.join("ca.pem"), ident.as_ref().map(|(c, k)| (c.as_path(), k.as_path()))).unwrap()
}

async fn connect(server: &ServerProcess, tls: Option<ClientTls>, token: Option<&str>) -> Result<KvClient, ClientError> {
    let cfg = ClientConfig {
        tls,
        auth_token: token.map(str::to_string),
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    };
    KvClient::connect(&server.grpc_addr(), cfg).await
}

/// Connecting, or the first call after it, fails (a refused handshake can surface either way).
async fn refused(server: &ServerProcess, tls: Option<ClientTls>, token: Option<&str>, what: &str) -> String {
    match connect(server, tls, token).await {
        Err(e) => e.to_string(),
        Ok(c) => match c.stats().await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{what}: the server answered"),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_named_by_client_certificates_over_tls_on_both_planes() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, rogue) = pki(tmp.path());
    let cfg = config(tmp.path(), &ca, true);
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);

    // alice, by her certificate alone: register, store, load (data plane), park, resume.
    let alice = connect(&server, Some(tls(&ca, Some((&ca, "alice")))), None).await.expect("alice connects");
    let ns = alice.register(namespace("alice", b"alice's salt", small_layout())).await.unwrap();
    let doc = tokens(7, 64);
    let blocks = full_block_payloads(&ns, &doc);
    alice.store(&ns, &doc, &blocks).await.unwrap().ok().unwrap();
    assert_eq!(alice.load(&ns, &doc).await.unwrap(), blocks, "exact bytes back over TLS");
    let keys = ns.keys(&doc);
    let mut out = vec![0u8; blocks.len() * ns.block_bytes() as usize];
    let mut dests: Vec<_> = out.chunks_exact_mut(ns.block_bytes() as usize).map(|c| vec![c]).collect();
    let got = alice.load_keys_into(&ns, &keys, &mut dests, true).await.unwrap();
    assert!(got.iter().all(|&hit| hit) && got.len() == blocks.len(), "fused load over TLS: {got:?}");
    assert_eq!(out, blocks.concat());
    alice.park(&ns, "agent", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();
    assert_eq!(alice.resume(&ns, "agent").await.unwrap().blocks, blocks);

    // bob's certificate is bob: nothing of alice's (not even that her namespace exists).
    let bob = connect(&server, Some(tls(&ca, Some((&ca, "bob")))), None).await.expect("bob connects");
    assert!(matches!(bob.lookup(&ns, &doc).await, Err(ClientError::UnknownNamespace(_))));
    assert!(matches!(bob.load_keys(&ns, &keys).await, Err(ClientError::UnknownNamespace(_))));
    assert!(bob.list_sessions(None).await.unwrap().is_empty());

    // The operator's certificate reaches everything.
    let ops = connect(&server, Some(tls(&ca, Some((&ca, "ops")))), None).await.expect("ops connects");
    assert_eq!(ops.list_sessions(None).await.unwrap().len(), 1);
    assert_eq!(ops.load(&ns, &doc).await.unwrap(), blocks);

    // Refused, each with the server serving on: no client certificate (it is required here), a
    // certificate from another CA, plain TCP, a server name the node's certificate lacks.
    let msgs = [
        refused(&server, Some(tls(&ca, None)), Some(CAROL_TOKEN), "no client certificate").await,
        refused(&server, Some(tls(&ca, Some((&rogue, "alice")))), None, "another CA's alice").await,
        refused(&server, None, Some(CAROL_TOKEN), "plain TCP").await,
        {
            let mut t = tls(&ca, Some((&ca, "alice")));
            t.server_name = Some("kvtier.example.com".into());
            refused(&server, Some(t), None, "another server name").await
        },
    ];
    for m in &msgs {
        assert!(!m.is_empty());
    }
    // A certificate the CA signed whose name stands for nobody here is said to be one (it was
    // "missing credential", though a certificate was presented).
    let nobody = refused(&server, Some(tls(&ca, Some((&ca, "dave")))), None, "dave, in no cert_names").await;
    assert!(
        nobody.contains("KV:Auth:Unauthenticated")
            && nobody.contains("the client certificate (names \"dave\") stands for no tenant or operator"),
        "{nobody}"
    );
    assert!(
        msgs[3].contains("certificate") || msgs[3].contains("Certificate") || msgs[3].contains("transport"),
        "{}",
        msgs[3]
    );

    // The data plane speaks TLS only: a plain hello gets no answer, and the connection closes.
    let mut raw = std::net::TcpStream::connect(server.data).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    raw.write_all(&kvtier_proto::dataplane::Hello::encode(kvtier_proto::dataplane::PROTOCOL_VERSION, b"")).unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    assert!(
        answer.is_empty() || answer[0] == 0x15,
        "a plain client gets nothing but a TLS alert, got {:?}",
        &answer[..answer.len().min(16)]
    );

    // Still serving alice, byte-exact; failed handshakes are counted (once the server's side of
    // each ended, which may be after the client saw the alert: polled).
    assert_eq!(alice.load(&ns, &doc).await.unwrap(), blocks);
    until_metric(&server, "kvtier_errors_total", &[("kind", "tls_handshake")], 4.0);
    let text = server.scrape();
    // alice loaded alone over TLS: where the system's congestion control paces, the socket under
    // her TLS connection ran unpaced for it (`KVTIER_SAME_HOST_CONGESTION=auto`, the default).
    let system = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap();
    let unpaced: f64 = kvtier_proto::tcp::UNPACED
        .iter()
        .map(|cc| metric(&text, "kvtier_dataplane_congestion_switches_total", &[("cc", cc)]))
        .sum();
    assert_eq!(unpaced >= 1.0, kvtier_proto::tcp::paces(system.trim()), "{system}: {unpaced} switches over TLS");
}

/// Over TLS too an idle gRPC connection is told GOAWAY (written into the TLS stream between
/// tonic's frames and flushed as a record of its own): the client takes it in and closes the
/// connection itself (none is closed for ignoring it), and its next call goes out on a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tls_connection_is_told_goaway_and_the_client_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _rogue) = pki(tmp.path());
    let cfg = config(tmp.path(), &ca, false);
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("idle_timeout = \"2s\"\n{text}")).unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let alice = connect(&server, Some(tls(&ca, Some((&ca, "alice")))), None).await.unwrap();
    alice.stats().await.unwrap();
    // Told at 2 s idle; closed by the node 2 s later if the client had not closed it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let m = server.scrape();
    assert_eq!(metric(&m, "kvtier_errors_total", &[("kind", "grpc_idle_timeout")]), 1.0, "{m}");
    assert_eq!(metric(&m, "kvtier_errors_total", &[("kind", "grpc_goaway_ignored")]), 0.0, "{m}");
    assert!(!alice.stats().await.unwrap().tiers.is_empty(), "the next call goes out on a new connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_optional_client_certificates_tokens_work_and_must_agree_with_a_certificate() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _rogue) = pki(tmp.path());
    let cfg = config(tmp.path(), &ca, false);
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);

    // carol has a token and no certificate: TLS for privacy, the token for who she is.
    let carol = connect(&server, Some(tls(&ca, None)), Some(CAROL_TOKEN)).await.expect("carol connects");
    let ns = carol.register(namespace("carol", b"", small_layout())).await.unwrap();
    let doc = tokens(3, 32);
    let blocks = full_block_payloads(&ns, &doc);
    carol.store(&ns, &doc, &blocks).await.unwrap().ok().unwrap();
    assert_eq!(carol.load(&ns, &doc).await.unwrap(), blocks);

    // Neither a certificate nor a token: refused. alice's certificate with carol's token: two
    // principals, refused rather than guessed.
    let none = refused(&server, Some(tls(&ca, None)), None, "no credential").await;
    assert!(none.contains("nauthenticated") && none.contains("missing credential"), "{none}");
    let both = refused(&server, Some(tls(&ca, Some((&ca, "alice")))), Some(CAROL_TOKEN), "two principals").await;
    // Said as what it is (it was the generic "missing or bad credential").
    assert!(both.contains("nauthenticated") && both.contains("both must name the same tenant"), "{both}");
    // The data plane decides the same way: gRPC as carol (token), data-plane streams made with
    // alice's certificate and carol's token in the hello: refused.
    let alice_tls = tls(&ca, Some((&ca, "alice"))).rustls_config().unwrap();
    let data = server.data;
    let connector = move || {
        let alice_tls = alice_tls.clone();
        async move {
            let sock = tokio::net::TcpStream::connect(data).await?;
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let s = tokio_rustls::TlsConnector::from(alice_tls).connect(name, sock).await?;
            Ok(Box::new(s) as kvtier_client::BoxedStream)
        }
    };
    let cfg =
        ClientConfig { tls: Some(tls(&ca, None)), auth_token: Some(CAROL_TOKEN.into()), ..ClientConfig::default() };
    let mixed = KvClient::connect_with(&server.grpc_addr(), cfg, connector).await.expect("gRPC as carol");
    match mixed.load_keys(&ns, &ns.keys(&doc)).await {
        Err(ClientError::Unauthenticated(_)) => {}
        other => panic!("a certificate and a token of two principals on the data plane: {other:?}"),
    }
    assert_eq!(carol.load(&ns, &doc).await.unwrap(), blocks, "carol is unaffected");
}

#[test]
fn bad_tls_settings_stop_the_server_at_start_with_the_setting_named() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _) = pki(tmp.path());
    let run = |toml: String| {
        let path = tmp.path().join("bad.toml");
        std::fs::write(&path, toml).unwrap();
        let out = Command::new(kvtier_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--no-metrics", "--config"])
            .arg(&path)
            .arg("--data-dir")
            .arg(tmp.path().join("data"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "the server must not start");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let p = |f: &str| ca.join(f).display().to_string();
    let missing = run(format!("[tls]\ncert = \"{}\"\nkey = \"{}\"\n", p("nope.pem"), p("node.key")));
    assert!(missing.contains("tls.cert") && missing.contains("nope.pem"), "{missing}");
    let not_a_key = run(format!("[tls]\ncert = \"{}\"\nkey = \"{}\"\n", p("node.pem"), p("node.pem")));
    assert!(not_a_key.contains("tls.key"), "{not_a_key}");
    let no_ca = run(format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\n[[tenants]]\nname = \"x\"\ncert_names = [\"x\"]\n",
        p("node.pem"),
        p("node.key")
    ));
    assert!(no_ca.contains("client_ca"), "{no_ca}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_handshake_is_closed_and_holds_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _) = pki(tmp.path());
    let cfg = config(tmp.path(), &ca, true);
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    // Silent connections on both listeners: closed after the handshake timeout (10 s).
    let t0 = std::time::Instant::now();
    let silent: Vec<_> = [server.data, server.grpc].iter().map(|a| std::net::TcpStream::connect(a).unwrap()).collect();
    // Meanwhile a good client is served.
    let alice = connect(&server, Some(tls(&ca, Some((&ca, "alice")))), None).await.expect("alice connects");
    alice.stats().await.unwrap();
    for mut s in silent {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "closed without an answer");
    }
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_secs(9) && waited < Duration::from_secs(25), "closed after {waited:?}");
    // Counted just after the socket closes: give the counter a moment.
    let mut timeouts = 0.0;
    for _ in 0..50 {
        timeouts = metric(&server.scrape(), "kvtier_errors_total", &[("kind", "tls_handshake_timeout")]);
        if timeouts >= 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(timeouts, 2.0, "both silent connections timed out");
}

/// The operator's token of [`tls_cluster`]'s nodes.
const CLUSTER_OPERATOR: &str = "cluster-operator-token-0001";

/// Two nodes of one TLS cluster (node certificates from `ca`, the operator's token shared), with
/// `extra` config lines, once they see each other.
fn tls_cluster(dir: &Path, ca: &Path, redis: &kvtier_tests::redis::Redis, extra: &str) -> Vec<ServerProcess> {
    let operator = CLUSTER_OPERATOR;
    let p = |f: &str| ca.join(f).display().to_string();
    let nodes: Vec<ServerProcess> = ["n1", "n2"]
        .iter()
        .map(|id| {
            let cfg = dir.join(format!("{id}.toml"));
            std::fs::write(
                &cfg,
                format!(
                    "auth_token = \"{operator}\"\ncluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\n\
                     peer_timeout = \"2s\"\n{extra}\n\n[tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n\
                     [[tenants]]\nname = \"alice\"\ncert_names = [\"alice\"]\n",
                    redis.url(),
                    p("node.pem"),
                    p("node.key"),
                    p("ca.pem")
                ),
            )
            .unwrap();
            ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
        })
        .collect();
    until_members(&nodes, 2);
    nodes
}

/// Alice stores through n1 and loads through n2; the blocks n1 owns come from n1 (n2's node
/// certificate, the operator's token), byte-exact. The peer tier's line of n2's `Stats`.
async fn stored_at_n1_loads_at_n2(nodes: &[ServerProcess], ca: &Path) -> kvtier_proto::pb::TierStats {
    let a1 = connect(&nodes[0], Some(tls(ca, Some((ca, "alice")))), None).await.expect("alice at n1");
    let a2 = connect(&nodes[1], Some(tls(ca, Some((ca, "alice")))), None).await.expect("alice at n2");
    let ns1 = a1.register(namespace("alice", b"fleet", small_layout())).await.unwrap();
    let ns2 = a2.register(namespace("alice", b"fleet", small_layout())).await.unwrap();
    let doc = tokens(11, 512);
    let blocks = full_block_payloads(&ns1, &doc);
    a1.store(&ns1, &doc, &blocks).await.unwrap().ok().unwrap();
    // n1 forwards n2's share after acknowledging the store: until it arrived, n2 misses those
    // (a miss, never other bytes).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = a2.load(&ns2, &doc).await.unwrap();
        assert!(got[..] == blocks[..got.len()], "only exact bytes, even before the forwards arrived");
        if got.len() == blocks.len() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{} of {} blocks through n2", got.len(), blocks.len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The peer tier's counters are the node's (every tenant's traffic): the operator's view,
    // with a node certificate as the peers present it.
    let op = connect(&nodes[1], Some(tls(ca, Some((ca, "node")))), Some(CLUSTER_OPERATOR))
        .await
        .expect("the operator at n2");
    op.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "peer").expect("a peer tier")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_of_a_tls_cluster_reach_each_other_over_tls_with_their_node_certificates() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _) = pki(tmp.path());
    let redis = kvtier_tests::redis::Redis::start();
    let nodes = tls_cluster(tmp.path(), &ca, &redis, "");
    let peer = stored_at_n1_loads_at_n2(&nodes, &ca).await;
    assert!(peer.requests >= 1 && peer.errors == 0, "n2 asked n1 over TLS: {peer:?}");
    assert_eq!(metric(&nodes[0].scrape(), "kvtier_quic_streams_total", &[]), 0.0, "no QUIC unless asked for");
}

/// `peer_transport = "quic"`: the nodes' data planes reach each other over QUIC (one connection,
/// a stream per pooled connection), a client with the cluster's certificate may use it too, and
/// one without a certificate or with another CA's is refused at the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_reach_each_other_over_quic_and_strangers_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, rogue) = pki(tmp.path());
    let redis = kvtier_tests::redis::Redis::start();
    let nodes = tls_cluster(tmp.path(), &ca, &redis, "peer_transport = \"quic\"");
    let peer = stored_at_n1_loads_at_n2(&nodes, &ca).await;
    assert!(peer.requests >= 1 && peer.errors == 0, "n2 asked n1: {peer:?}");
    let n1 = nodes[0].scrape();
    assert!(metric(&n1, "kvtier_quic_connections_total", &[]) >= 1.0, "n2 reached n1 over QUIC");
    assert!(metric(&n1, "kvtier_quic_streams_total", &[]) >= 1.0);

    // Alice's own client over QUIC: her certificate is her credential there too.
    let quic_client = |who: ClientTls| {
        let grpc = nodes[0].grpc_addr();
        let data = nodes[0].data.to_string();
        async move {
            let cfg = ClientConfig {
                tls: Some(who.clone()),
                connect_timeout: Duration::from_secs(5),
                request_timeout: Duration::from_secs(5),
                ..ClientConfig::default()
            };
            let quic = kvtier_client::QuicConnector::new(&data, &who)?;
            KvClient::connect_with(&grpc, cfg, quic).await
        }
    };
    let alice = quic_client(tls(&ca, Some((&ca, "alice")))).await.expect("alice over QUIC");
    let ns = alice.register(namespace("alice", b"quic", small_layout())).await.unwrap();
    let doc = tokens(12, 256);
    let blocks = full_block_payloads(&ns, &doc);
    alice.store(&ns, &doc, &blocks).await.unwrap().ok().unwrap();
    assert!(alice.load(&ns, &doc).await.unwrap() == blocks, "alice's blocks over QUIC, exact");
    let streams = metric(&nodes[0].scrape(), "kvtier_quic_streams_total", &[]);
    assert!(streams > metric(&n1, "kvtier_quic_streams_total", &[]), "alice's data went over QUIC");

    // No client certificate: refused before any stream is served.
    let e = kvtier_client::QuicConnector::new(&nodes[0].data.to_string(), &tls(&ca, None)).unwrap_err();
    assert!(e.to_string().contains("client certificate"), "{e}");
    // Another CA's "alice" (its gRPC channel is refused as well, so only the QUIC handshake is
    // tried here): the handshake fails and the node counts it.
    let rogue_tls = tls(&ca, Some((&rogue, "alice")));
    let before = metric(&nodes[0].scrape(), "kvtier_errors_total", &[("kind", "quic_handshake")]);
    let quic = kvtier_client::QuicConnector::new(&nodes[0].data.to_string(), &rogue_tls).unwrap();
    let stream = kvtier_client::DataPlaneConnector::connect(&quic).await;
    let refused = match stream {
        Err(_) => true,
        Ok(mut s) => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            // The client may finish its side first: the refusal shows on the first exchange.
            let _ = s.write_all(b"KVDP\x01\x00\x00\x00").await;
            let mut b = [0u8; 8];
            tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut b)).await.map_or(true, |r| r.is_err())
        }
    };
    assert!(refused, "a certificate from another CA got a QUIC stream served");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while metric(&nodes[0].scrape(), "kvtier_errors_total", &[("kind", "quic_handshake")]) <= before {
        assert!(std::time::Instant::now() < deadline, "the refused handshake was not counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    // And the node goes on serving alice.
    assert!(alice.load(&ns, &doc).await.unwrap() == blocks, "still served, exact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_only_clients_reach_the_same_node_socket_with_single_use_tickets() {
    use kvtier_client::{ItemStatus, SameNode, SharedBuffer};
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _rogue) = pki(tmp.path());
    let cfg = config(tmp.path(), &ca, true);
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);

    // alice, by her certificate alone: shared-buffer calls go over the same-node socket (the
    // client fetched a ticket for the connection), not TCP.
    let alice = connect(&server, Some(tls(&ca, Some((&ca, "alice")))), None).await.expect("alice connects");
    let ns = alice.register(namespace("alice", b"alice's salt", small_layout())).await.unwrap();
    let bb = ns.block_bytes();
    let keys = ns.keys(&tokens(31, 3 * ns.block_tokens()));
    let mut src = SharedBuffer::new(3 * bb as usize).unwrap();
    for (i, k) in keys.iter().enumerate() {
        src.as_mut_slice()[i * bb as usize..(i + 1) * bb as usize].copy_from_slice(&payload_for(k, bb));
    }
    let offsets: Vec<u64> = (0..3).map(|i| i * bb).collect();
    assert_eq!(alice.store_keys_from_buffer(&ns, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 3]);
    let mut dst = SharedBuffer::new(3 * bb as usize).unwrap();
    assert_eq!(alice.load_keys_into_buffer(&ns, &keys, &mut dst, &offsets, false).await.unwrap(), vec![true; 3]);
    assert_eq!(dst.as_slice(), src.as_slice());
    let st = alice.samenode_stats();
    assert_eq!((st.stores, st.loads, st.fallback_total()), (1, 1, 0), "{st:?}");
    let text = server.scrape();
    assert!(metric(&text, "kvtier_requests_total", &[("op", "samenode_load")]) >= 1.0);
    assert!(metric(&text, "kvtier_requests_total", &[("op", "samenode_store")]) >= 1.0);

    // A ticket opens one connection, once.
    let path = std::path::PathBuf::from(&alice.server_info().samenode_socket);
    let open = |t: String| {
        let path = path.clone();
        async move { SameNode::connect(&path, Some(&t), Duration::from_secs(5), Duration::from_secs(10), 64).await }
    };
    let ticket = alice.samenode_ticket().await.unwrap();
    let mut near = open(ticket.clone()).await.expect("a fresh ticket opens the socket");
    assert!(matches!(open(ticket.clone()).await, Err(ClientError::Unauthenticated(_))), "used twice");
    let made_up = format!("kvsn-ticket:{}", "ab".repeat(32));
    assert!(matches!(open(made_up).await, Err(ClientError::Unauthenticated(_))));
    // It is not a token: gRPC and the data plane don't take it (beside alice's certificate it
    // names nobody).
    let fresh = alice.samenode_ticket().await.unwrap();
    refused(&server, Some(tls(&ca, Some((&ca, "alice")))), Some(&fresh), "a ticket as a token").await;

    // The connection acts for alice, and only alice: bob's namespace is refused on it.
    let bob = connect(&server, Some(tls(&ca, Some((&ca, "bob")))), None).await.expect("bob connects");
    let bob_ns = bob.register(namespace("bob", b"bob's salt", small_layout())).await.unwrap();
    let bob_keys = bob_ns.keys(&tokens(32, bob_ns.block_tokens()));
    bob.store_keys(&bob_ns, &bob_keys, &[vec![payload_for(&bob_keys[0], bb)]]).await.unwrap();
    let e = near.load_into_buffer(&bob_ns, &bob_keys, &mut dst, &[0], false).await.unwrap_err();
    assert!(matches!(e, ClientError::UnknownNamespace(_)), "{e}");
    assert_eq!(near.load_into_buffer(&ns, &keys[..1], &mut dst, &[0], false).await.unwrap(), vec![true]);
    // bob's own ticket reaches his block.
    let mut bob_near = open(bob.samenode_ticket().await.unwrap()).await.unwrap();
    assert_eq!(bob_near.load_into_buffer(&bob_ns, &bob_keys, &mut dst, &[bb], false).await.unwrap(), vec![true]);
    let text = server.scrape();
    assert!(metric(&text, "kvtier_samenode_tickets_total", &[("event", "redeemed")]) >= 3.0);
    assert!(metric(&text, "kvtier_samenode_tickets_total", &[("event", "unknown")]) >= 2.0);
}
