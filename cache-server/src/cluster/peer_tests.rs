//! The peer tier through a fake [`PeerTransport`]: one request per peer per fetch, replicas in
//! read order, a corrupt, short, foreign or wrong-length answer is a miss (never its bytes), a
//! stalled peer costs one timeout and is then skipped, and forwards reach every other owner.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, HashScheme, KvLayout, Namespace};
use parking_lot::Mutex;
use tokio::sync::watch;

use super::*;

/// How a fake peer answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Honest,
    /// One payload byte flipped, the header left as it was.
    Corrupt,
    /// The payload cut short by one byte (header unchanged).
    Short,
    /// Another key's block in place of each one asked for.
    Foreign,
    /// One answer fewer than keys asked.
    MissingAnswer,
    /// Never answers.
    Stall,
    /// Refuses at once.
    Refuse,
}

#[derive(Default)]
struct Fake {
    /// Per member id: its blocks.
    held: Mutex<HashMap<String, HashMap<BlockKey, StoredBlock>>>,
    modes: Mutex<HashMap<String, Mode>>,
    /// Every call: (peer, op, keys or blocks).
    calls: Mutex<Vec<(String, &'static str, usize)>>,
}

impl Fake {
    fn mode(&self, peer: &str) -> Mode {
        self.modes.lock().get(peer).copied().unwrap_or(Mode::Honest)
    }
    fn calls(&self, op: &str) -> Vec<(String, usize)> {
        self.calls.lock().iter().filter(|c| c.1 == op).map(|c| (c.0.clone(), c.2)).collect()
    }
}

impl PeerTransport for Fake {
    fn get<'a>(
        &'a self,
        peer: &'a Member,
        _ns: &'a Namespace,
        keys: &'a [BlockKey],
    ) -> PeerFuture<'a, Vec<Option<StoredBlock>>> {
        Box::pin(async move {
            let id = peer.id.to_string();
            self.calls.lock().push((id.clone(), "get", keys.len()));
            let mode = self.mode(&id);
            let refuse = || ServerError::Peer { peer: id.clone(), reason: "refused".into() };
            match mode {
                Mode::Stall => std::future::pending::<()>().await,
                Mode::Refuse => return Err(refuse()),
                _ => {}
            }
            let held = self.held.lock().get(&id).cloned().unwrap_or_default();
            let any = held.values().next().cloned();
            let mut out: Vec<Option<StoredBlock>> = keys
                .iter()
                .map(|k| {
                    let mut b = held.get(k).cloned()?;
                    match mode {
                        Mode::Corrupt => {
                            let mut p = b.payload.to_vec();
                            p[7] ^= 0x40;
                            b.payload = Bytes::from(p);
                        }
                        Mode::Short => b.payload = b.payload.slice(..b.payload.len() - 1),
                        Mode::Foreign => b = any.clone().filter(|a| a.header.key != *k)?,
                        _ => {}
                    }
                    Some(b)
                })
                .collect();
            if mode == Mode::MissingAnswer {
                out.pop();
            }
            Ok(out)
        })
    }

    fn exists<'a>(&'a self, peer: &'a Member, _ns: &'a Namespace, keys: &'a [BlockKey]) -> PeerFuture<'a, Vec<bool>> {
        Box::pin(async move {
            let id = peer.id.to_string();
            self.calls.lock().push((id.clone(), "exists", keys.len()));
            if self.mode(&id) == Mode::Refuse {
                return Err(ServerError::Peer { peer: id, reason: "refused".into() });
            }
            let held = self.held.lock().get(&id).cloned().unwrap_or_default();
            Ok(keys.iter().map(|k| held.contains_key(k)).collect())
        })
    }

    fn put<'a>(&'a self, peer: &'a Member, _ns: &'a Namespace, blocks: &'a [StoredBlock]) -> PeerFuture<'a, usize> {
        Box::pin(async move {
            let id = peer.id.to_string();
            self.calls.lock().push((id.clone(), "put", blocks.len()));
            if self.mode(&id) == Mode::Refuse {
                return Err(ServerError::Peer { peer: id, reason: "refused".into() });
            }
            let mut held = self.held.lock();
            let mine = held.entry(id).or_default();
            for b in blocks {
                mine.insert(b.header.key, b.clone());
            }
            Ok(blocks.len())
        })
    }
}

fn member(id: &str) -> Member {
    Member {
        id: NodeId::new(id).unwrap(),
        grpc_addr: format!("{id}:7070"),
        data_addr: format!("{id}:7071"),
        labels: Labels::new(Some(id), None, None),
        capacity: 1 << 30,
    }
}

fn namespace() -> Namespace {
    Namespace::new("acme", "m", KvLayout::new(1, 1, 64, DType::Fp16, 16), HashScheme::Blake3, b"salt")
}

fn block(ns: &Namespace, i: u32) -> StoredBlock {
    let key = BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes());
    let len = ns.layout.block_bytes() as usize;
    let payload: Vec<u8> = (0..len).map(|j| (j as u32).wrapping_mul(31).wrapping_add(i) as u8).collect();
    let f = BlockFrame::new(ns.id(), key, ns.layout, CodecId::RAW, ns.layout.block_tokens, Bytes::from(payload));
    StoredBlock { header: f.header, payload: f.payload }
}

struct Setup {
    tier: Arc<PeerTier>,
    fake: Arc<Fake>,
    placement: Placement,
    ns: Namespace,
    _stop: watch::Sender<bool>,
    _members: watch::Sender<Snapshot>,
}

/// Node "a" of members a, b, c, with every block `0..n` held by its owners (other than "a").
fn setup(rf: usize, n: u32, timeout: Duration) -> (Setup, Vec<StoredBlock>) {
    let members = vec![member("a"), member("b"), member("c")];
    let placement = Placement::new(&members);
    let snap = Snapshot { members: Arc::from(members), stale: false, generation: 1 };
    let (members_tx, rx) = watch::channel(snap);
    let fake = Arc::new(Fake::default());
    let ns = namespace();
    let blocks: Vec<StoredBlock> = (0..n).map(|i| block(&ns, i)).collect();
    for b in &blocks {
        for o in placement.owners(&ns.id(), &b.header.key, rf) {
            let id = placement.members()[o].id.to_string();
            fake.held.lock().entry(id).or_default().insert(b.header.key, b.clone());
        }
    }
    let (stop, stop_rx) = watch::channel(false);
    let cfg = PeerConfig { rf, timeout, max_inflight: 8 };
    let (tier, _task) =
        PeerTier::start(NodeId::new("a").unwrap(), Labels::new(Some("a"), None, None), rx, fake.clone(), cfg, stop_rx);
    (Setup { tier, fake, placement, ns, _stop: stop, _members: members_tx }, blocks)
}

impl Setup {
    fn owners(&self, b: &StoredBlock, rf: usize) -> Vec<String> {
        self.placement
            .owners(&self.ns.id(), &b.header.key, rf)
            .into_iter()
            .map(|i| self.placement.members()[i].id.to_string())
            .collect()
    }
}

fn keys(blocks: &[StoredBlock]) -> Vec<BlockKey> {
    blocks.iter().map(|b| b.header.key).collect()
}

#[tokio::test]
async fn one_request_per_peer_and_exact_blocks() {
    let (s, blocks) = setup(1, 64, Duration::from_secs(5));
    let got = s.tier.fetch(&s.ns, &keys(&blocks)).await;
    let mut peers = std::collections::BTreeSet::new();
    for (b, g) in blocks.iter().zip(&got) {
        let owner = &s.owners(b, 1)[0];
        if owner == "a" {
            assert!(g.is_none(), "a block this node owns is asked of nobody");
        } else {
            peers.insert(owner.clone());
            let g = g.as_ref().expect("held by its owner");
            assert_eq!((g.header, &g.payload), (b.header, &b.payload));
        }
    }
    let calls = s.fake.calls("get");
    assert_eq!(calls.len(), peers.len(), "one request per peer: {calls:?}");
    assert_eq!(calls.iter().map(|c| c.0.clone()).collect::<std::collections::BTreeSet<_>>(), peers);
    assert_eq!(calls.iter().map(|c| c.1).sum::<usize>(), got.iter().filter(|g| g.is_some()).count());
    let st = s.tier.stats();
    assert_eq!((st.requests, st.errors), (peers.len() as u64, 0));
}

#[tokio::test]
async fn held_asks_each_owner_once() {
    let (s, blocks) = setup(1, 64, Duration::from_secs(5));
    let held = s.tier.held(&s.ns, &keys(&blocks)).await;
    for (b, h) in blocks.iter().zip(&held) {
        assert_eq!(*h, s.owners(b, 1)[0] != "a");
    }
    assert!(s.fake.calls("exists").len() <= 2);
    s.fake.modes.lock().insert("b".into(), Mode::Refuse);
    let held = s.tier.held(&s.ns, &keys(&blocks)).await;
    for (b, h) in blocks.iter().zip(&held) {
        assert_eq!(*h, s.owners(b, 1)[0] == "c", "a failed peer's keys read as not held");
    }
}

#[tokio::test]
async fn bad_answers_are_misses_never_their_bytes() {
    for mode in [Mode::Corrupt, Mode::Short, Mode::Foreign, Mode::MissingAnswer, Mode::Refuse] {
        let (s, blocks) = setup(1, 48, Duration::from_secs(5));
        for p in ["b", "c"] {
            s.fake.modes.lock().insert(p.into(), mode);
        }
        let got = s.tier.fetch(&s.ns, &keys(&blocks)).await;
        assert!(got.iter().all(|g| g.is_none()), "{mode:?}: a bad answer gave a block");
        assert!(s.tier.stats().errors > 0, "{mode:?}: counted");
    }
}

#[tokio::test]
async fn a_stalled_peer_costs_one_timeout_then_is_skipped() {
    let timeout = Duration::from_millis(200);
    let (s, blocks) = setup(1, 48, timeout);
    s.fake.modes.lock().insert("b".into(), Mode::Stall);
    let t = Instant::now();
    let got = s.tier.fetch(&s.ns, &keys(&blocks)).await;
    let took = t.elapsed();
    assert!(took >= timeout && took < timeout * 3, "{took:?}");
    for (b, g) in blocks.iter().zip(&got) {
        assert_eq!(g.is_some(), s.owners(b, 1)[0] == "c", "only c's blocks load");
    }
    // Within DOWN_FOR, b is not asked again: its keys miss at once.
    let t = Instant::now();
    let again = s.tier.fetch(&s.ns, &keys(&blocks)).await;
    assert!(t.elapsed() < timeout, "{:?}", t.elapsed());
    assert_eq!(again.iter().filter(|g| g.is_some()).count(), got.iter().filter(|g| g.is_some()).count());
    assert_eq!(s.fake.calls("get").iter().filter(|c| c.0 == "b").count(), 1);
}

#[tokio::test]
async fn rf2_loads_from_the_other_replica_when_one_fails() {
    let (s, blocks) = setup(2, 48, Duration::from_secs(5));
    s.fake.modes.lock().insert("b".into(), Mode::Refuse);
    let got = s.tier.fetch(&s.ns, &keys(&blocks)).await;
    for (b, g) in blocks.iter().zip(&got) {
        let owners = s.owners(b, 2);
        if owners.iter().any(|o| o == "c") {
            let g = g.as_ref().expect("c holds a replica");
            assert_eq!(g.payload, b.payload);
        } else {
            assert!(g.is_none());
        }
    }
    assert!(s.fake.calls("get").len() <= 3, "one round, plus one for b's keys: {:?}", s.fake.calls("get"));
}

#[tokio::test]
async fn forwards_reach_every_other_owner_once() {
    let (s, blocks) = setup(2, 32, Duration::from_secs(5));
    s.fake.held.lock().clear();
    s.tier.forward(s.ns.clone(), blocks.clone());
    let deadline = Instant::now() + Duration::from_secs(5);
    let want: usize = blocks.iter().map(|b| s.owners(b, 2).iter().filter(|o| *o != "a").count()).sum();
    while s.tier.forward_counts().0 < want as u64 {
        assert!(Instant::now() < deadline, "forwarded {:?} of {want}", s.tier.forward_counts());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let puts = s.fake.calls("put");
    assert!(puts.len() <= 2, "one request per owner: {puts:?}");
    for b in &blocks {
        for o in s.owners(b, 2).iter().filter(|o| *o != "a") {
            assert!(s.fake.held.lock()[o].contains_key(&b.header.key), "{o} holds its replica");
        }
    }
}
