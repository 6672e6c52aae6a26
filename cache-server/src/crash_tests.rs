//! Power-loss tests: the node's real disk tier, session store and namespace registry
//! ([`NodeState`], as `kvtier serve` opens it) on a [`FaultFs`], cut at many points of a workload
//! and torn in many ways, then reopened with the real recovery code.
//!
//! What the node acknowledges as durable: a namespace registration (`namespaces.log` appended and
//! synced before it is visible), and a park (its blocks written and the disk synced, then its
//! manifest appended to `sessions.log` and synced — `ControlPlane::park`'s two steps, called here
//! as it calls them). Blocks stored without a park and drops are not. After any crash: the node
//! starts; every acknowledged registration and park is back (the park at its version or a later
//! attempt's, its blocks with their exact bytes); no block ever reads back with wrong bytes.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, HashScheme, KvLayout, Namespace, NamespaceId};
use proptest::prelude::*;

use crate::config::{ByteSize, ServerConfig};
use crate::dram::Priority;
use crate::error::ServerError;
use crate::fs::fault::{CrashMode, FaultFs};
use crate::sessions::ParkSpec;
use crate::state::NodeState;
use crate::tenants::Principal;

fn layout() -> KvLayout {
    KvLayout::new(2, 1, 64, DType::Fp16, 16) // 8 KiB blocks, 12 KiB records on disk
}

fn namespace(model: &str) -> Namespace {
    Namespace::new("t", model, layout(), HashScheme::Blake3, b"salt")
}

fn frame(ns: NamespaceId, i: u32) -> BlockFrame {
    let key = BlockKey(*blake3::hash(&[&ns.0[..], &i.to_le_bytes()].concat()).as_bytes());
    let payload: Vec<u8> =
        (0..layout().block_bytes()).map(|j| (j as u32).wrapping_mul(31).wrapping_add(i * 7 + 1) as u8).collect();
    BlockFrame::new(ns, key, layout(), CodecId::RAW, 16, Bytes::from(payload))
}

const BLOCKS: u32 = 24;

struct Harness {
    dir: tempfile::TempDir,
    fs: FaultFs,
    rt: tokio::runtime::Runtime,
    /// Disk tier cap: small enough that segments roll, get evicted and compacted.
    disk_capacity: u64,
}

impl Harness {
    fn new(disk_capacity: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultFs::new(dir.path());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Harness { dir, fs, rt, disk_capacity }
    }

    fn config(&self) -> ServerConfig {
        ServerConfig {
            data_dir: self.dir.path().to_path_buf(),
            dram_capacity: ByteSize(8 << 20),
            disk_capacity: ByteSize(self.disk_capacity),
            disk_segment_bytes: ByteSize(64 << 10),
            metrics_listen: None,
            ..ServerConfig::default()
        }
    }

    fn open(&self) -> Result<NodeState, ServerError> {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        NodeState::open_with(self.config(), addr, self.fs.shared())
    }

    /// The node opened with `ns` registered, and that registration recorded as acknowledged.
    fn open_registered(&self, ns: &Namespace, acked: &mut Acked) -> NodeState {
        let node = self.open().unwrap();
        node.register_namespace(&Principal::Operator, ns.clone()).unwrap();
        acked.namespaces.push(ns.id());
        node
    }

    /// A block in DRAM, as the data plane's `PUT` leaves it.
    fn store(&self, node: &NodeState, f: &BlockFrame) {
        if node.tiers().holds(&f.header.namespace, &f.header.key) {
            return;
        }
        let mut slot = node.tiers().reserve(&f.header.namespace, f.payload.len()).unwrap();
        slot.buf_mut().copy_from_slice(&f.payload);
        node.tiers().commit(slot, f.header, Priority::Normal).unwrap();
    }

    /// A park as the control plane makes it: blocks made durable, then the manifest.
    fn park(
        &self,
        node: &NodeState,
        ns: &Namespace,
        id: &str,
        keys: Vec<BlockKey>,
        expected: u64,
    ) -> Result<u64, ServerError> {
        let ns_id = ns.id();
        self.rt.block_on(node.tiers().persist(&ns_id, &keys, None))?;
        let spec = ParkSpec {
            namespace: ns_id,
            id: id.into(),
            token_count: keys.len() as u64 * 16,
            keys,
            tail: None,
            ttl: Duration::from_secs(3600),
            priority: Priority::Normal,
            expected_version: expected,
        };
        let limits = node.session_limits(ns);
        node.sessions().park(node.tiers().session_pins(), spec, &limits).map(|m| m.version)
    }
}

/// What the workload was told, to hold recovery to.
#[derive(Default)]
struct Acked {
    namespaces: Vec<NamespaceId>,
    /// Per session: its last acknowledged park (version, keys) and the index of that park among
    /// its attempts.
    parks: HashMap<String, (u64, Vec<BlockKey>, usize)>,
    /// Per session: the keys of every park tried, acknowledged or not.
    attempts: HashMap<String, Vec<Vec<BlockKey>>>,
    /// Sessions dropped after their last acknowledged park (a drop is not synced: either may
    /// come back).
    dropped: HashSet<String>,
}

/// Checks a recovered node against what was acknowledged; `Err` says what broke.
fn check(node: &NodeState, acked: &Acked, namespaces: &[Namespace]) -> Result<(), String> {
    for id in &acked.namespaces {
        if node.namespace(id).is_err() {
            return Err(format!("acknowledged namespace {id} lost"));
        }
    }
    let disk = node.tiers().disk().ok_or("no disk tier")?;
    // No block reads back wrong: right bytes or a miss.
    for ns in namespaces {
        for i in 0..BLOCKS {
            let f = frame(ns.id(), i);
            if let Some((h, p)) = disk.read(&f.header.namespace, &f.header.key) {
                if h != f.header || p != f.payload {
                    return Err(format!("block {i} of {} read back wrong", ns.model));
                }
            }
        }
    }
    let ns_id = namespaces[0].id();
    let recovered: HashMap<String, (u64, Vec<BlockKey>)> =
        node.sessions().list(Some(ns_id)).into_iter().map(|m| (m.id, (m.version, m.keys))).collect();
    for (id, (version, keys)) in &recovered {
        let tried = acked.attempts.get(id).ok_or(format!("session {id} was never parked"))?;
        if !tried.contains(keys) {
            return Err(format!("session {id} came back with keys no park had"));
        }
        for k in keys {
            match disk.read(&ns_id, k) {
                Some((h, _)) if h.key == *k => {}
                _ => return Err(format!("session {id} v{version} came back without its block {k}")),
            }
        }
    }
    for (id, (version, keys, at)) in &acked.parks {
        if acked.dropped.contains(id) {
            continue;
        }
        let Some((v, k)) = recovered.get(id) else {
            return Err(format!("acknowledged park of {id} v{version} lost"));
        };
        let later = &acked.attempts[id][*at..];
        if v < version || (v == version && k != keys) || !later.contains(k) {
            return Err(format!("session {id} came back at v{v}, acknowledged v{version}"));
        }
    }
    Ok(())
}

/// One workload step (`op`, `a`, `b` from the test's inputs). Errors are expected (the machine
/// may be down); only successes are recorded as acknowledged.
fn step(h: &Harness, node: &NodeState, acked: &mut Acked, namespaces: &[Namespace], (op, a, b): (u8, u8, u8)) {
    let ns = &namespaces[0];
    match op % 8 {
        0 | 1 => {
            // Blocks stored, and some demoted to disk (the demotion thread's call).
            let f = frame(ns.id(), u32::from(a) % BLOCKS);
            h.store(node, &f);
            if op % 8 == 1 {
                if let Some(d) = node.tiers().disk() {
                    let _ = d.write(&f.header, &f.payload);
                }
            }
        }
        2..=4 => {
            let id = format!("s{}", a % 4);
            let first = u32::from(b) % BLOCKS;
            let n = 1 + u32::from(b / 32) % 4;
            let frames: Vec<BlockFrame> = (first..first + n).map(|i| frame(ns.id(), i % BLOCKS)).collect();
            for f in &frames {
                h.store(node, f);
            }
            let keys: Vec<BlockKey> = frames.iter().map(|f| f.header.key).collect();
            let current = node.sessions().list(Some(ns.id())).into_iter().find(|m| m.id == id).map_or(0, |m| m.version);
            let tried = acked.attempts.entry(id.clone()).or_default();
            tried.push(keys.clone());
            let at = tried.len() - 1;
            if let Ok(v) = h.park(node, ns, &id, keys.clone(), current) {
                acked.parks.insert(id.clone(), (v, keys, at));
                acked.dropped.remove(&id);
            }
        }
        5 => {
            let id = format!("s{}", a % 4);
            if let Ok(true) = node.sessions().drop_session(node.tiers().session_pins(), ns.id(), &id) {
                acked.dropped.insert(id);
            }
        }
        7 => {
            // A purge: every block of the namespace not pinned by a parked session goes (durably:
            // recovery checks no acknowledged park lost a block).
            let _ = node.purge_namespace(&Principal::Operator, &ns.id());
        }
        _ => {
            let other = &namespaces[1];
            if node.register_namespace(&Principal::Operator, other.clone()).is_ok() {
                acked.namespaces.push(other.id());
            }
            if let Some(d) = node.tiers().disk() {
                let _ = d.sync();
            }
        }
    }
}

/// A fault injected before step `at` of a workload.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// The disk full from the `n`th write on, for three steps.
    Enospc { at: usize, n: u64 },
    /// The next file sync fails (EIO), losing what it covered.
    SyncEio { at: usize },
    /// The next directory sync fails.
    DirSyncEio { at: usize },
}

fn fault_strategy() -> impl Strategy<Value = Option<Fault>> {
    proptest::option::of(prop_oneof![
        (0usize..28, 1u64..6).prop_map(|(at, n)| Fault::Enospc { at, n }),
        (0usize..28).prop_map(|at| Fault::SyncEio { at }),
        (0usize..28).prop_map(|at| Fault::DirSyncEio { at }),
    ])
}

/// Runs `ops` on a fresh node (with `fault` injected on the way), cuts power after `freeze`
/// changes (or at the end), crashes with `mode`, reopens and checks; then crashes once more right
/// after recovery (torn) and checks again.
fn run(
    ops: &[(u8, u8, u8)],
    fault: Option<Fault>,
    freeze: Option<u64>,
    mode: CrashMode,
    disk_capacity: u64,
) -> Result<(), String> {
    let h = Harness::new(disk_capacity);
    let namespaces = [namespace("m1"), namespace("m2")];
    let mut acked = Acked::default();
    {
        let node = h.open().map_err(|e| format!("first start: {e}"))?;
        node.register_namespace(&Principal::Operator, namespaces[0].clone()).map_err(|e| e.to_string())?;
        acked.namespaces.push(namespaces[0].id());
        if let Some(n) = freeze {
            h.fs.freeze_after(n);
        }
        for (i, &o) in ops.iter().enumerate() {
            match fault {
                Some(Fault::Enospc { at, n }) if at == i => h.fs.enospc_from(Some(n)),
                Some(Fault::Enospc { at, .. }) if at + 3 == i => h.fs.enospc_from(None),
                Some(Fault::SyncEio { at }) if at == i => h.fs.fail_syncs(1),
                Some(Fault::DirSyncEio { at }) if at == i => h.fs.fail_dir_syncs(1),
                _ => {}
            }
            step(&h, &node, &mut acked, &namespaces, o);
        }
        h.fs.crash(mode);
    }
    {
        let node = h.open().map_err(|e| format!("recovery failed to start: {e}"))?;
        check(&node, &acked, &namespaces).map_err(|e| format!("after the crash: {e}"))?;
        h.fs.crash(CrashMode::Torn(7));
    }
    let node = h.open().map_err(|e| format!("second recovery failed to start: {e}"))?;
    check(&node, &acked, &namespaces).map_err(|e| format!("after a crash right after recovery: {e}"))
}

fn mode(torn: Option<u64>) -> CrashMode {
    torn.map_or(CrashMode::DropUnsynced, CrashMode::Torn)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Crash points over a whole workload with a fault or none on the way (ENOSPC, EIO on a file
    /// or directory sync), every unsynced change dropped or torn.
    #[test]
    fn acknowledged_parks_and_namespaces_survive_power_loss(
        ops in proptest::collection::vec((0u8..7, any::<u8>(), any::<u8>()), 4..28),
        fault in fault_strategy(),
        freeze in proptest::option::weighted(0.8, 0u64..400),
        torn in proptest::option::of(any::<u64>()),
    ) {
        // A disk small enough to roll, evict and compact segments under the workload.
        if let Err(e) = run(&ops, fault, freeze, mode(torn), 512 << 10) {
            return Err(TestCaseError::fail(e));
        }
    }
}

/// The simplest power loss: a fresh node, one namespace registered and one session parked, then
/// every unsynced change dropped.
#[test]
fn a_park_on_a_fresh_node_survives_power_loss() {
    let ops = [(2, 0, 0)];
    run(&ops, None, None, CrashMode::DropUnsynced, 1 << 20).unwrap();
}

/// Parks `ids` (each of one fresh block) on `node`; returns those acknowledged.
fn park_each(h: &Harness, node: &NodeState, ns: &Namespace, ids: &[(&str, u32)], acked: &mut Acked) -> Vec<String> {
    let mut ok = Vec::new();
    for &(id, block) in ids {
        let f = frame(ns.id(), block);
        h.store(node, &f);
        acked.attempts.entry(id.into()).or_default().push(vec![f.header.key]);
        let at = acked.attempts[id].len() - 1;
        if let Ok(v) = h.park(node, ns, id, vec![f.header.key], 0) {
            acked.parks.insert(id.into(), (v, vec![f.header.key], at));
            ok.push(id.to_string());
        }
    }
    ok
}

/// A failed fsync of the disk tier is reported (the park is refused), and the writes it lost are
/// not taken for durable later: parking the same blocks again writes them again, so an
/// acknowledged park is durable even though the retried fsync "succeeds" (Linux reports a
/// writeback error once, then marks the pages clean).
#[test]
fn eio_on_fsync_is_reported_and_never_acknowledged_later() {
    let h = Harness::new(1 << 20);
    let ns = namespace("m1");
    let mut acked = Acked::default();
    {
        let node = h.open_registered(&ns, &mut acked);
        let f = frame(ns.id(), 1);
        h.store(&node, &f);
        acked.attempts.entry("s".into()).or_default().push(vec![f.header.key]);
        h.fs.fail_syncs(1);
        let err = h.park(&node, &ns, "s", vec![f.header.key], 0).unwrap_err();
        assert!(matches!(err, ServerError::Io(_)), "{err}");
        assert!(node.sessions().is_empty(), "a park whose fsync failed is not acknowledged");
        acked.attempts.entry("s".into()).or_default().push(vec![f.header.key]);
        let v = h.park(&node, &ns, "s", vec![f.header.key], 0).unwrap();
        acked.parks.insert("s".into(), (v, vec![f.header.key], 1));
        h.fs.crash(CrashMode::DropUnsynced);
    }
    let node = h.open().unwrap();
    check(&node, &acked, &[ns.clone(), namespace("m2")]).unwrap();
}

/// A full disk (ENOSPC, half the write landed) under a park's block write (1) or its log append
/// (2): that park is refused with the disk-full code, and nothing acknowledged before or after is
/// lost.
#[test]
fn enospc_loses_nothing_acknowledged() {
    for nth in 1..=2 {
        let h = Harness::new(1 << 20);
        let ns = namespace("m1");
        let mut acked = Acked::default();
        {
            let node = h.open_registered(&ns, &mut acked);
            assert_eq!(park_each(&h, &node, &ns, &[("a", 1), ("b", 2)], &mut acked).len(), 2);
            h.fs.enospc_from(Some(nth));
            let f = frame(ns.id(), 3);
            h.store(&node, &f);
            acked.attempts.entry("c".into()).or_default().push(vec![f.header.key]);
            let err = h.park(&node, &ns, "c", vec![f.header.key], 0).unwrap_err();
            assert_eq!(err.code(), kvtier_proto::codes::DISK_FULL, "write {nth}: {err}");
            h.fs.enospc_from(None);
            assert_eq!(park_each(&h, &node, &ns, &[("d", 4), ("e", 1)], &mut acked).len(), 2, "write {nth}");
            h.fs.crash(CrashMode::DropUnsynced);
        }
        let node = h.open().unwrap();
        check(&node, &acked, &[ns.clone(), namespace("m2")]).unwrap_or_else(|e| panic!("write {nth}: {e}"));
    }
}

/// A park replacing a session that a full disk keeps from being logged leaves the session as it
/// was — listed, at its version, its blocks pinned — and so does the recovery after a power loss.
/// Before, the refused replace dropped the session whole (found by the proptest above: "s1 v1
/// lost"), unpinning the version the log still held, whose blocks could then be evicted.
#[test]
fn a_replace_refused_by_a_full_disk_leaves_the_session_as_it_was() {
    let h = Harness::new(1 << 20);
    let ns = namespace("m1");
    let mut acked = Acked::default();
    {
        let node = h.open_registered(&ns, &mut acked);
        assert_eq!(park_each(&h, &node, &ns, &[("a", 1)], &mut acked).len(), 1);
        // The same block again (already on disk): the log's append is the first write.
        let key = frame(ns.id(), 1).header.key;
        acked.attempts.entry("a".into()).or_default().push(vec![key]);
        h.fs.enospc_from(Some(1));
        let err = h.park(&node, &ns, "a", vec![key], 1).unwrap_err();
        assert_eq!(err.code(), kvtier_proto::codes::DISK_FULL, "{err}");
        h.fs.enospc_from(None);
        let listed: Vec<(String, u64)> = node.sessions().list(None).into_iter().map(|m| (m.id, m.version)).collect();
        assert_eq!(listed, [("a".to_string(), 1)], "the refused replace took the session with it");
        assert!(node.tiers().disk().unwrap().stats().pinned_bytes > 0, "the session's block is no longer pinned");
        h.fs.crash(CrashMode::DropUnsynced);
    }
    let node = h.open().unwrap();
    check(&node, &acked, &[ns.clone(), namespace("m2")]).unwrap();
}

/// A registration refused by a full disk leaves no torn record in `namespaces.log` that hides the
/// registrations acknowledged after it.
#[test]
fn a_refused_namespace_append_hides_nothing() {
    let h = Harness::new(1 << 20);
    let (a, b, c) = (namespace("a"), namespace("b"), namespace("c"));
    {
        let node = h.open().unwrap();
        node.register_namespace(&Principal::Operator, a.clone()).unwrap();
        h.fs.enospc_from(Some(1));
        assert!(node.register_namespace(&Principal::Operator, b.clone()).is_err());
        h.fs.enospc_from(None);
        node.register_namespace(&Principal::Operator, c.clone()).unwrap();
    }
    let node = h.open().unwrap();
    assert!(node.namespace(&a.id()).is_ok());
    assert!(node.namespace(&b.id()).is_err(), "refused, never acknowledged");
    assert!(node.namespace(&c.id()).is_ok(), "acknowledged after the refused one");
}

/// One damaged record in the middle of `namespaces.log` costs that registration only.
#[test]
fn a_damaged_namespace_record_costs_only_itself() {
    let h = Harness::new(1 << 20);
    let (a, b, c) = (namespace("a"), namespace("b"), namespace("c"));
    let path = h.dir.path().join("namespaces.log");
    let mut lens = Vec::new();
    {
        let node = h.open().unwrap();
        for ns in [&a, &b, &c] {
            node.register_namespace(&Principal::Operator, ns.clone()).unwrap();
            lens.push(h.fs.contents(&path).unwrap().len());
        }
    }
    let mut data = h.fs.contents(&path).unwrap();
    data[lens[0] + 20] ^= 0x40; // inside b's record
    h.fs.set_contents(&path, data);
    let node = h.open().unwrap();
    assert!(node.namespace(&a.id()).is_ok());
    assert!(node.namespace(&b.id()).is_err());
    assert!(node.namespace(&c.id()).is_ok(), "the record after the damaged one is read");
}

/// The session log is rewritten and renamed into place at every start; if the directory can't be
/// synced after that, the start fails rather than acknowledging parks into a file a power loss
/// would take back.
#[test]
fn a_session_log_that_cannot_sync_its_directory_acknowledges_nothing_it_would_lose() {
    use crate::session_log::{LoggedSession, Replayed, SessionLog};
    let dir = tempfile::tempdir().unwrap();
    let fault = FaultFs::new(dir.path());
    let fs = fault.shared();
    let s = LoggedSession {
        namespace: namespace("m1").id(),
        id: "a".into(),
        keys: vec![frame(namespace("m1").id(), 1).header.key],
        tail: None,
        token_count: 16,
        ttl_ms: 3_600_000,
        expires_unix_ms: u64::MAX,
        priority: Priority::Normal,
        version: 1,
        dropped_unix_ms: 0,
        created_unix_ms: 0,
    };
    fault.fail_dir_syncs(1);
    let acked = match SessionLog::open_with(&fs, dir.path(), true, 0) {
        Ok((log, _)) => log.put(log.next_seq(), &s).is_ok(),
        Err(_) => false,
    };
    fault.crash(CrashMode::DropUnsynced);
    let (_log, Replayed { sessions: live, .. }) = SessionLog::open_with(&fs, dir.path(), true, 0).unwrap();
    assert!(!acked || live == vec![s], "an acknowledged park lost with the log's rename");
}

/// A new segment whose directory entry can't be synced fails that write, and only that one: the
/// next write creates the segment again.
#[test]
fn a_failed_segment_creation_does_not_wedge_the_tier() {
    let h = Harness::new(1 << 20);
    let ns = namespace("m1");
    let node = h.open().unwrap();
    node.register_namespace(&Principal::Operator, ns.clone()).unwrap();
    let f = frame(ns.id(), 1);
    h.store(&node, &f);
    h.fs.fail_dir_syncs(1);
    assert!(h.park(&node, &ns, "a", vec![f.header.key], 0).is_err());
    h.park(&node, &ns, "a", vec![f.header.key], 0).unwrap();
}

/// The disk tier by itself: after `sync` returns, every block written before it survives any
/// power loss with its exact bytes, and no block ever reads back wrong.
#[test]
fn a_synced_disk_tier_survives_power_loss_on_its_own() {
    use crate::disk::{DiskConfig, DiskTier};
    let ns = namespace("m1").id();
    for seed in 0..40u64 {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultFs::new(dir.path());
        let cfg = DiskConfig {
            dir: dir.path().to_path_buf(),
            capacity_bytes: 4 << 20,
            segment_bytes: 64 << 10,
            sync_writes: false,
        };
        let synced = {
            let (t, _) = DiskTier::open_with(cfg.clone(), fs.shared()).unwrap();
            let mut synced = 0;
            for i in 0..BLOCKS {
                let f = frame(ns, i);
                t.write(&f.header, &f.payload).unwrap();
                if (u64::from(i) * 7 + seed) % 5 == 0 && t.sync().is_ok() {
                    synced = i + 1;
                }
            }
            fs.crash(if seed % 2 == 0 { CrashMode::DropUnsynced } else { CrashMode::Torn(seed) });
            synced
        };
        let (t, _) = DiskTier::open_with(cfg, fs.shared()).unwrap();
        for i in 0..BLOCKS {
            let f = frame(ns, i);
            match t.read(&ns, &f.header.key) {
                Some((h, p)) => assert!(h == f.header && p == f.payload, "seed {seed}: block {i} wrong"),
                None => assert!(i >= synced, "seed {seed}: block {i} synced but lost ({synced} synced)"),
            }
        }
    }
}

/// A first-format `namespaces.log` record (length word with the tombstone flag, xxh3, body).
fn legacy_namespace_record(tombstone: bool, body: &[u8]) -> Vec<u8> {
    let mut rec = (body.len() as u32 | if tombstone { 1 << 31 } else { 0 }).to_le_bytes().to_vec();
    rec.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(body).to_le_bytes());
    rec.extend_from_slice(body);
    rec
}

/// An unregistration's body: the id, then the disk tier's write position (segment, offset).
fn unregistration_body(id: NamespaceId) -> Vec<u8> {
    let mut b = id.0.to_vec();
    b.extend_from_slice(&[0u8; 16]);
    b
}

/// Tenant A registers a namespace whose salt (the tenant's bytes) embeds a whole record that
/// unregisters tenant B's namespace — as the first format would accept it, and keyed with a
/// secret an attacker might guess. A's record is then damaged in its length, so replay
/// resynchronizes inside its body. B stays registered with its blocks, the plant is not applied,
/// and the damaged stretch is counted.
#[test]
fn a_record_planted_in_a_namespace_spec_is_never_replayed() {
    use kvtier_proto::record_log::{encode_record, LogKey};
    let b = Namespace::new("tenant-b", "m", layout(), HashScheme::Blake3, b"b");
    let mut keyed_plant = vec![1u8]; // an unregistration
    keyed_plant.extend(unregistration_body(b.id()));
    let plants =
        [legacy_namespace_record(true, &unregistration_body(b.id())), encode_record(&LogKey([0; 32]), &keyed_plant)];
    for (i, plant) in plants.iter().enumerate() {
        let h = Harness::new(1 << 20);
        let path = h.dir.path().join("namespaces.log");
        let a = Namespace::new("tenant-a", "m", layout(), HashScheme::Blake3, plant);
        let after = Namespace::new("tenant-a", "after", layout(), HashScheme::Blake3, b"x");
        let before_a;
        let f = frame(b.id(), 1);
        {
            let node = h.open().unwrap();
            node.register_namespace(&Principal::Operator, b.clone()).unwrap();
            h.store(&node, &f);
            h.rt.block_on(node.tiers().persist(&b.id(), &[f.header.key], None)).unwrap();
            before_a = h.fs.contents(&path).unwrap().len();
            node.register_namespace(&Principal::Operator, a.clone()).unwrap();
            node.register_namespace(&Principal::Operator, after.clone()).unwrap();
        }
        let mut data = h.fs.contents(&path).unwrap();
        data[before_a + 5] ^= 0x01;
        h.fs.set_contents(&path, data);
        let (crate::state::NamespaceLogContents { unregistered, .. }, _, _, skipped) =
            crate::state::read_namespace_log(&*h.fs.shared(), &path).unwrap();
        assert!(unregistered.is_empty(), "plant {i}: an unregistration was replayed");
        assert_eq!(skipped, 1, "plant {i}: A's damaged record (with the plant in it) skipped");
        let node = h.open().unwrap();
        assert!(node.namespace(&b.id()).is_ok(), "plant {i}: B's namespace unregistered by A's plant");
        assert!(node.namespace(&a.id()).is_err(), "plant {i}: A's damaged record is lost");
        assert!(node.namespace(&after.id()).is_ok(), "plant {i}: the record after it replays");
        let disk = node.tiers().disk().unwrap();
        assert!(disk.read(&b.id(), &f.header.key).is_some(), "plant {i}: B's block purged");
    }
}

/// A `namespaces.log` of the first format opens with every registration and unregistration
/// intact, is rewritten in the keyed format (durably: a power loss right after the open keeps
/// it), and a restart after that keeps everything.
#[test]
fn a_first_format_namespace_log_migrates_to_the_keyed_one() {
    use kvtier_proto::record_log::{read_log_header, LogHeader, LogKind};
    use prost::Message;
    let h = Harness::new(1 << 20);
    let path = h.dir.path().join("namespaces.log");
    drop(h.open().unwrap()); // creates the file
    let (a, b, c, d) = (namespace("a"), namespace("b"), namespace("c"), namespace("d"));
    let mut data = Vec::new();
    for ns in [&a, &b, &c] {
        data.extend(legacy_namespace_record(false, &ns.to_pb().encode_to_vec()));
    }
    data.extend(legacy_namespace_record(true, &unregistration_body(b.id())));
    h.fs.set_contents(&path, data);
    {
        let node = h.open().unwrap();
        assert!(node.namespace(&a.id()).is_ok() && node.namespace(&c.id()).is_ok());
        assert!(node.namespace(&b.id()).is_err(), "unregistered in the old log");
        let now = h.fs.contents(&path).unwrap();
        assert!(matches!(read_log_header(LogKind::Namespaces, &now), Ok(LogHeader::Keyed(_))));
        node.register_namespace(&Principal::Operator, d.clone()).unwrap();
    }
    h.fs.crash(CrashMode::DropUnsynced);
    let node = h.open().unwrap();
    for ns in [&a, &c, &d] {
        assert!(node.namespace(&ns.id()).is_ok(), "{} lost after the migration", ns.model);
    }
    assert!(node.namespace(&b.id()).is_err());
}

/// A purge is durable: blocks of the namespace on disk before it stay gone after a restart (and a
/// power loss right after the purge returned), while a block a parked session pins, and blocks
/// written after the purge (a new one, a purged one put again), come back.
#[test]
fn a_purge_survives_a_restart() {
    let h = Harness::new(1 << 20);
    let ns = namespace("m");
    let frames: Vec<BlockFrame> = (0..6).map(|i| frame(ns.id(), i)).collect();
    {
        let node = h.open().unwrap();
        node.register_namespace(&Principal::Operator, ns.clone()).unwrap();
        for f in &frames[..4] {
            h.store(&node, f);
        }
        let keys: Vec<BlockKey> = frames[..4].iter().map(|f| f.header.key).collect();
        h.rt.block_on(node.tiers().persist(&ns.id(), &keys, None)).unwrap();
        h.park(&node, &ns, "kept", vec![frames[0].header.key], 0).unwrap();
        let removed = node.purge_namespace(&Principal::Operator, &ns.id()).unwrap();
        assert!(removed >= 3, "{removed}");
        let disk = node.tiers().disk().unwrap();
        let on_disk: Vec<usize> = (0..4).filter(|&i| disk.read(&ns.id(), &frames[i].header.key).is_some()).collect();
        assert_eq!(on_disk, [0], "the block the session pins stays on disk");
        for f in [&frames[2], &frames[4]] {
            h.store(&node, f);
        }
        h.rt.block_on(node.tiers().persist(&ns.id(), &[frames[2].header.key, frames[4].header.key], None)).unwrap();
    }
    h.fs.crash(CrashMode::DropUnsynced);
    let node = h.open().unwrap();
    let disk = node.tiers().disk().unwrap();
    let on_disk: Vec<usize> = (0..6).filter(|&i| disk.read(&ns.id(), &frames[i].header.key).is_some()).collect();
    assert_eq!(on_disk, [0, 2, 4], "purged blocks came back, or later ones were lost");
    assert_eq!(node.sessions().list(Some(ns.id())).len(), 1, "the session pinning block 0");
    // And again: the purge record still holds at the next start (the log was compacted).
    drop(node);
    let node = h.open().unwrap();
    let disk = node.tiers().disk().unwrap();
    let on_disk: Vec<usize> = (0..6).filter(|&i| disk.read(&ns.id(), &frames[i].header.key).is_some()).collect();
    assert_eq!(on_disk, [0, 2, 4]);
}
