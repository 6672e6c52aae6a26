use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex as StdMutex;
use std::time::{Duration, Instant};

use kvtier_proto::{CodecId, DType, KvLayout};
use proptest::prelude::*;

use super::*;

const KIB: usize = 1024;
const NS: NamespaceId = NamespaceId([7; 16]);

fn key(i: u32) -> BlockKey {
    let mut k = [0xAB; 32];
    k[..4].copy_from_slice(&i.to_le_bytes());
    BlockKey(k)
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (i as usize).wrapping_mul(131).wrapping_add(j.wrapping_mul(7)).wrapping_add(j >> 9) as u8)
        .collect()
}

fn header(ns: NamespaceId, i: u32, len: usize) -> FrameHeader {
    FrameHeader {
        codec: CodecId::RAW,
        flags: 0,
        tokens: 1,
        namespace: ns,
        key: key(i),
        layout: KvLayout::new(2, 1, 4, DType::Fp16, 16),
        payload_len: len as u64,
        checksum: 0,
    }
}

fn put(t: &DramTier, i: u32, len: usize, p: Priority) -> Result<InsertOutcome, ServerError> {
    t.insert(header(NS, i, len), &payload(i, len), p)
}

fn tier(cap: usize, ratio: f64) -> DramTier {
    DramTier::new(DramConfig { capacity_bytes: cap as u64, max_pinned_ratio: ratio })
}

fn check_caps(t: &DramTier) {
    let s = t.stats();
    assert!(s.allocated_bytes <= s.capacity_bytes, "{s:?}");
    assert!(s.resident_bytes <= s.allocated_bytes, "{s:?}");
    assert!(s.pinned_bytes <= s.allocated_bytes, "{s:?}");
}

#[test]
fn round_trip_miss_and_already_present() {
    let t = tier(1 << 20, 0.9);
    assert_eq!(put(&t, 1, 5000, Priority::Normal).unwrap(), InsertOutcome::Inserted);
    let b = t.get(&NS, &key(1)).unwrap();
    assert_eq!(&b.payload[..], &payload(1, 5000)[..]);
    assert_eq!(b.header, header(NS, 1, 5000));
    assert!(t.get(&NS, &key(2)).is_none());
    assert!(t.get(&NamespaceId([8; 16]), &key(1)).is_none(), "namespaces never match");
    // The second insert keeps the first bytes.
    assert_eq!(
        t.insert(header(NS, 1, 5000), &payload(9, 5000), Priority::High).unwrap(),
        InsertOutcome::AlreadyPresent
    );
    // Through reserve/commit too: the slot goes back to the free list.
    let mut w = t.reserve(5000).unwrap();
    w.buf_mut().copy_from_slice(&payload(9, 5000));
    assert_eq!(t.commit(w, header(NS, 1, 5000), Priority::Low).unwrap(), InsertOutcome::AlreadyPresent);
    assert_eq!(&t.get(&NS, &key(1)).unwrap().payload[..], &payload(1, 5000)[..]);
    let s = t.stats();
    assert_eq!((s.hits, s.misses, s.inserts, s.blocks), (2, 2, 1, 1));
    assert_eq!((s.resident_bytes, s.allocated_bytes), (5000, 2 * 5120));
    assert_eq!((s.bytes_in, s.bytes_out), (5000, 10000));
    assert!(t.contains(&NS, &key(1)) && !t.contains(&NS, &key(2)));
    assert_eq!(t.stats().hits, 2, "contains counts nothing");
}

#[test]
fn too_large_and_length_mismatch() {
    let t = tier(64 * KIB, 0.9);
    assert!(matches!(t.reserve(64 * KIB + 1), Err(ServerError::TooLarge { .. })));
    assert!(matches!(t.insert(header(NS, 1, 10), &[0; 9], Priority::Normal), Err(ServerError::InvalidRequest(_))));
    let w = t.reserve(100).unwrap();
    assert!(matches!(t.commit(w, header(NS, 1, 99), Priority::Normal), Err(ServerError::InvalidRequest(_))));
    assert!(t.reserve(64 * KIB).is_ok(), "the mismatched slot went back and was released");
}

#[test]
fn dropped_writer_returns_its_slot() {
    let t = tier(16 * KIB, 0.9);
    let w = t.reserve(16 * KIB).unwrap();
    assert_eq!(t.stats().allocated_bytes, 16 * KIB as u64);
    assert!(matches!(t.reserve(4 * KIB), Err(ServerError::Capacity(_))), "the writer holds the whole budget");
    drop(w);
    assert_eq!(t.stats().allocated_bytes, 16 * KIB as u64, "kept as a free slot");
    // Another class: the free slot is given back to make room.
    put(&t, 1, 8 * KIB, Priority::Normal).unwrap();
    assert_eq!(t.stats().allocated_bytes, 8 * KIB as u64);
}

#[test]
fn twice_read_block_survives_a_scan_of_one_hit_blocks() {
    let t = tier(640 * KIB, 0.9); // 10 blocks of 64 KiB
    put(&t, 1, 64 * KIB, Priority::Normal).unwrap(); // hot: read twice
    put(&t, 2, 64 * KIB, Priority::Normal).unwrap(); // control: never read
    t.get(&NS, &key(1)).unwrap();
    t.get(&NS, &key(1)).unwrap();
    for i in 100..150 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
        check_caps(&t);
    }
    assert!(t.contains(&NS, &key(1)), "hot block flushed by a one-off scan");
    assert!(!t.contains(&NS, &key(2)), "a never-read block must not survive the same scan");
    assert!(t.stats().evictions >= 42);
    // The control block was remembered in the ghost queue and comes back straight into main.
    put(&t, 2, 64 * KIB, Priority::Normal).unwrap();
    let e = t.shared.index.get(&(NS, key(2))).unwrap();
    assert_eq!(e.place, Place::Main);
}

#[test]
fn low_is_evicted_before_normal_before_high() {
    let t = tier(640 * KIB, 0.9);
    for i in 0..3 {
        put(&t, i, 64 * KIB, Priority::High).unwrap();
    }
    for i in 10..13 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
    }
    for i in 20..30 {
        put(&t, i, 64 * KIB, Priority::Low).unwrap();
    }
    assert!((0..3).chain(10..13).all(|i| t.contains(&NS, &key(i))), "Low must go first");
    assert_eq!((20..30).filter(|&i| t.contains(&NS, &key(i))).count(), 4);
    // With no Low left, Normal goes before High.
    for i in 20..30 {
        t.remove(&NS, &key(i));
    }
    for i in 40..47 {
        put(&t, i, 64 * KIB, Priority::High).unwrap();
    }
    assert!((0..3).all(|i| t.contains(&NS, &key(i))));
    assert!((10..13).all(|i| !t.contains(&NS, &key(i))));
    assert_eq!(Priority::from_u32(0), Priority::Low);
    assert_eq!(Priority::from_u32(1), Priority::Normal);
    assert_eq!(Priority::from_u32(7), Priority::High);
}

#[test]
fn pin_is_all_or_nothing() {
    let t = tier(640 * KIB, 0.5);
    for i in 0..6 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
    }
    match t.pin(&NS, &[key(0), key(50), key(1), key(51)]) {
        Err(ServerError::MissingBlocks { missing, missing_tail }) => {
            assert_eq!(missing, vec![1, 3]);
            assert!(!missing_tail);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(t.stats().pinned_bytes, 0);
    assert!(t.remove(&NS, &key(0)), "nothing was pinned");
    put(&t, 0, 64 * KIB, Priority::Normal).unwrap();
    // Limit: 320 KiB = 5 blocks. A duplicated key is pinned twice but counted once.
    t.pin(&NS, &[key(0), key(0), key(1), key(2), key(3)]).unwrap();
    assert_eq!(t.stats().pinned_bytes, 4 * 64 * KIB as u64);
    assert!(matches!(t.pin(&NS, &[key(4), key(5)]), Err(ServerError::Capacity(_))));
    assert_eq!(t.stats().pinned_bytes, 4 * 64 * KIB as u64, "a failed pin pins nothing");
    assert!(t.remove(&NS, &key(4)));
    t.pin(&NS, &[key(1)]).unwrap(); // already pinned: no new bytes
    t.unpin(&NS, &[key(0), key(1), key(99)]);
    assert!(!t.remove(&NS, &key(0)), "still pinned once");
    assert!(!t.remove(&NS, &key(1)), "still pinned once");
    t.unpin(&NS, &[key(0), key(0), key(0)]);
    assert!(t.remove(&NS, &key(0)));
    assert_eq!(t.stats().pinned_bytes, 3 * 64 * KIB as u64);
}

#[test]
fn reserve_fails_when_everything_is_pinned_and_pins_survive() {
    let t = tier(256 * KIB, 1.0);
    for i in 0..4 {
        put(&t, i, 64 * KIB, Priority::Low).unwrap();
    }
    t.pin(&NS, &(0..4).map(key).collect::<Vec<_>>()).unwrap();
    assert!(matches!(t.reserve(4 * KIB), Err(ServerError::Capacity(_))));
    assert!(matches!(put(&t, 9, 64 * KIB, Priority::High), Err(ServerError::Capacity(_))));
    for i in 0..4 {
        assert_eq!(&t.get(&NS, &key(i)).unwrap().payload[..], &payload(i, 64 * KIB)[..]);
    }
    // Unpinned blocks re-enter the queues and become evictable again.
    t.unpin(&NS, &[key(2)]);
    put(&t, 9, 64 * KIB, Priority::High).unwrap();
    assert!(!t.contains(&NS, &key(2)));
    assert!([0, 1, 3, 9].iter().all(|&i| t.contains(&NS, &key(i))));
    check_caps(&t);
}

#[test]
fn a_held_block_keeps_its_bytes_after_eviction() {
    let t = tier(64 * KIB, 0.9);
    put(&t, 1, 64 * KIB, Priority::Normal).unwrap();
    let held = t.get(&NS, &key(1)).unwrap();
    put(&t, 2, 64 * KIB, Priority::Normal).unwrap(); // evicts 1; its slot is held, so not reused
    assert!(!t.contains(&NS, &key(1)));
    assert_eq!(&held.payload[..], &payload(1, 64 * KIB)[..]);
    assert_eq!(&t.get(&NS, &key(2)).unwrap().payload[..], &payload(2, 64 * KIB)[..]);
    assert_eq!(t.stats().allocated_bytes, 64 * KIB as u64, "the held slot no longer counts");
    // A slot recycled while a view of it is alive is never handed to a writer either.
    let held2 = t.get(&NS, &key(2)).unwrap();
    assert!(t.remove(&NS, &key(2)));
    let mut w = t.reserve(64 * KIB).unwrap();
    w.buf_mut().fill(0xEE);
    assert_eq!(&held2.payload[..], &payload(2, 64 * KIB)[..]);
    assert_eq!(&held.payload[..], &payload(1, 64 * KIB)[..]);
}

#[test]
fn eviction_hook_receives_demoted_blocks() {
    let t = tier(128 * KIB, 0.9);
    type Demoted = Vec<(IndexKey, Vec<u8>)>;
    let got: Arc<StdMutex<Demoted>> = Arc::default();
    let sink = Arc::clone(&got);
    t.set_eviction_hook(Some(Arc::new(move |k, b: StoredBlock| {
        sink.lock().unwrap().push((k, b.payload.to_vec()));
    })));
    for i in 0..4 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
    }
    let got = got.lock().unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], ((NS, key(0)), payload(0, 64 * KIB)));
    assert_eq!(got[1], ((NS, key(1)), payload(1, 64 * KIB)));
    check_caps(&t);
}

#[test]
fn purge_namespace_keeps_pinned_and_other_namespaces() {
    let t = tier(1 << 20, 0.9);
    let other = NamespaceId([9; 16]);
    for i in 0..4 {
        put(&t, i, 8 * KIB, Priority::Normal).unwrap();
        t.insert(header(other, i, 8 * KIB), &payload(i, 8 * KIB), Priority::Normal).unwrap();
    }
    t.pin(&NS, &[key(3)]).unwrap();
    assert_eq!(t.purge_namespace(&NS).len(), 3);
    assert!(t.contains(&NS, &key(3)));
    assert!((0..4).all(|i| t.contains(&other, &key(i))));
    assert_eq!(t.stats().blocks, 5);
    assert_eq!(t.stats().resident_bytes, 5 * 8 * KIB as u64);
    assert_eq!(t.longest_prefix(&other, &[key(0), key(1), key(7), key(2)]), 2);
    assert_eq!(t.longest_prefix(&NS, &[key(0)]), 0);
}

/// A small deterministic generator (xorshift64*), so the numbers below are reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// 50 sequential jobs through a 4 MiB tier: full 64 KiB blocks (16 tokens of 4 KiB) plus a
/// partial tail of 1..=15 tokens, LZ4-like jitter on some tails. Full blocks sit in exact
/// classes and every tail is >= 4 KiB, so each slot is < 1.25x its payload; with no free
/// slots lingering (nothing is removed), allocated / resident must stay below 1.25.
#[test]
fn fragmentation_stays_bounded() {
    let cap = 4 << 20;
    let t = tier(cap, 0.9);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut next = 0u32;
    let mut worst: f64 = 1.0;
    for job in 0..50 {
        let blocks = 1 + rng.below(40);
        for _ in 0..blocks {
            put(&t, next, 64 * KIB, Priority::Normal).unwrap();
            next += 1;
            check_caps(&t);
        }
        let mut tail = (1 + rng.below(15) as usize) * 4 * KIB;
        if rng.below(2) == 0 {
            tail -= rng.below(2048) as usize;
        }
        put(&t, next, tail.max(4 * KIB), Priority::Normal).unwrap();
        next += 1;
        check_caps(&t);
        if job % 5 == 0 {
            // Some re-use so the policy has hot blocks too.
            for j in 0..8 {
                t.get(&NS, &key(next.saturating_sub(1 + j * 3)));
            }
        }
        let s = t.stats();
        if s.allocated_bytes * 10 >= cap as u64 * 9 {
            worst = worst.max(s.allocated_bytes as f64 / s.resident_bytes as f64);
        }
    }
    let s = t.stats();
    eprintln!(
        "dram fragmentation: allocated {} / resident {} = {:.4} at the end, worst {worst:.4} (cap {cap}, {} evictions)",
        s.allocated_bytes,
        s.resident_bytes,
        s.allocated_bytes as f64 / s.resident_bytes as f64,
        s.evictions
    );
    assert!(s.evictions > 0, "the jobs must overflow the tier");
    assert!(worst < 1.25, "allocator overhead {worst}");
}

/// Worst case for the size classes: every payload a random size (compressed blocks, 4 KiB to
/// 2 MiB). Each slot is < 1.25x its payload, so the aggregate must be too; expect ~1.1.
#[test]
fn overhead_of_variable_sizes() {
    let cap = 64 << 20;
    let t = tier(cap, 0.9);
    let mut rng = Rng(42);
    for i in 0..400 {
        let len = 4 * KIB + rng.below(2 << 20) as usize;
        t.insert(header(NS, i, len), &vec![i as u8; len], Priority::Normal).unwrap();
        check_caps(&t);
    }
    let s = t.stats();
    let ratio = s.allocated_bytes as f64 / s.resident_bytes as f64;
    eprintln!(
        "dram overhead, random sizes: allocated {} / resident {} = {ratio:.4}",
        s.allocated_bytes, s.resident_bytes
    );
    assert!(s.evictions > 0);
    assert!(ratio < 1.25, "allocator overhead {ratio}");
}

#[test]
fn concurrent_inserts_and_gets_see_the_right_bytes() {
    let cap = 1 << 20;
    let t = Arc::new(tier(cap, 0.9));
    let len_of = |i: u32| 4 * KIB + (i as usize % 9) * 4 * KIB + (i as usize % 5) * 100;
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (t, done) = (Arc::clone(&t), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !done.load(Ordering::Relaxed) {
                let s = t.stats();
                assert!(s.allocated_bytes <= s.capacity_bytes, "{s:?}");
                n += 1;
            }
            n
        })
    };
    let threads: Vec<_> = (0..8u64)
        .map(|tid| {
            let t = Arc::clone(&t);
            std::thread::spawn(move || {
                let mut rng = Rng(0x1234_5678 + tid * 0x9e37_79b9);
                let (mut hits, mut checked) = (0u64, 0u64);
                for _ in 0..3000 {
                    let i = rng.below(120) as u32;
                    match rng.below(10) {
                        0..=3 => {
                            let r = put(&t, i, len_of(i), Priority::from_u32(i % 3));
                            assert!(r.is_ok(), "{r:?}");
                        }
                        4 => {
                            if t.pin(&NS, &[key(i)]).is_ok() {
                                assert!(t.contains(&NS, &key(i)));
                                t.unpin(&NS, &[key(i)]);
                            }
                        }
                        5 => {
                            t.remove(&NS, &key(i));
                        }
                        _ => {
                            if let Some(b) = t.get(&NS, &key(i)) {
                                assert_eq!(b.header.key, key(i));
                                assert!(b.payload[..] == payload(i, len_of(i))[..], "wrong bytes for {i}");
                                hits += 1;
                            }
                            checked += 1;
                        }
                    }
                }
                (hits, checked)
            })
        })
        .collect();
    let mut hits = 0;
    for th in threads {
        hits += th.join().unwrap().0;
    }
    done.store(true, Ordering::Relaxed);
    assert!(watcher.join().unwrap() > 0);
    check_caps(&t);
    let s = t.stats();
    assert!(hits > 0 && s.evictions > 0, "{s:?}");
    let present: Vec<u32> = (0..120).filter(|&i| t.contains(&NS, &key(i))).collect();
    assert_eq!(s.blocks, present.len() as u64);
    assert_eq!(s.resident_bytes, present.iter().map(|&i| len_of(i) as u64).sum::<u64>());
    assert_eq!(s.pinned_bytes, 0);
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u32, Priority),
    Get(u32),
    Pin(Vec<u32>),
    Unpin(Vec<u32>),
    Remove(u32),
    ReserveDrop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0u32..24;
    prop_oneof![
        4 => (k.clone(), 0u32..3).prop_map(|(i, p)| Op::Insert(i, Priority::from_u32(p))),
        3 => k.clone().prop_map(Op::Get),
        1 => proptest::collection::vec(k.clone(), 1..4).prop_map(Op::Pin),
        1 => proptest::collection::vec(k.clone(), 1..4).prop_map(Op::Unpin),
        1 => k.prop_map(Op::Remove),
        1 => (1usize..70_000).prop_map(Op::ReserveDrop),
    ]
}

/// Full blocks of 64 KiB for even keys, partial tails / compressed sizes for odd ones.
fn prop_len(i: u32) -> usize {
    if i & 1 == 0 {
        64 * KIB
    } else {
        1 + (i as usize * 7919) % (64 * KIB)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn caps_and_accounting_hold(ops in proptest::collection::vec(op(), 1..120)) {
        let cap = 300 * KIB;
        let t = tier(cap, 0.6);
        let mut pins: HashMap<u32, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(i, p) => {
                    let r = put(&t, i, prop_len(i), p);
                    prop_assert!(matches!(r, Ok(_) | Err(ServerError::Capacity(_))), "{:?}", r);
                }
                Op::Get(i) => {
                    if let Some(b) = t.get(&NS, &key(i)) {
                        prop_assert!(b.payload[..] == payload(i, prop_len(i))[..]);
                    }
                }
                Op::Pin(ks) => {
                    let keys: Vec<BlockKey> = ks.iter().map(|&i| key(i)).collect();
                    let absent: Vec<u32> = (0..ks.len() as u32).filter(|&j| !t.contains(&NS, &keys[j as usize])).collect();
                    match t.pin(&NS, &keys) {
                        Ok(()) => {
                            prop_assert!(absent.is_empty());
                            for i in ks { *pins.entry(i).or_default() += 1; }
                        }
                        Err(ServerError::MissingBlocks { missing, .. }) => prop_assert_eq!(missing, absent),
                        Err(ServerError::Capacity(_)) => prop_assert!(absent.is_empty()),
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                Op::Unpin(ks) => {
                    let keys: Vec<BlockKey> = ks.iter().map(|&i| key(i)).collect();
                    t.unpin(&NS, &keys);
                    for i in ks {
                        if t.contains(&NS, &key(i)) {
                            let c = pins.entry(i).or_default();
                            *c = c.saturating_sub(1);
                        }
                    }
                }
                Op::Remove(i) => {
                    let expect = t.contains(&NS, &key(i)) && pins.get(&i).copied().unwrap_or(0) == 0;
                    prop_assert_eq!(t.remove(&NS, &key(i)), expect);
                }
                Op::ReserveDrop(len) => {
                    let r = t.reserve(len);
                    prop_assert!(matches!(r, Ok(_) | Err(ServerError::Capacity(_))), "{:?}", r);
                }
            }
            // A key that is absent has no pins (a pinned one can never disappear).
            pins.retain(|_, c| *c > 0);
            let s = t.stats();
            prop_assert!(s.allocated_bytes <= cap as u64, "{:?}", s);
            for i in pins.keys() {
                prop_assert!(t.contains(&NS, &key(*i)), "pinned block {} was evicted", i);
            }
            let present: Vec<u32> = (0..24).filter(|&i| t.contains(&NS, &key(i))).collect();
            prop_assert_eq!(s.blocks, present.len() as u64);
            prop_assert_eq!(s.resident_bytes, present.iter().map(|&i| prop_len(i) as u64).sum::<u64>());
            prop_assert_eq!(s.pinned_bytes, pins.keys().map(|&i| slot_size(prop_len(i)) as u64).sum::<u64>());
            prop_assert!(s.pinned_bytes <= (cap as f64 * 0.6) as u64);
        }
    }
}

fn tier_with(cap: usize, opts: DramOptions) -> DramTier {
    DramTier::with_options(DramConfig::new(cap as u64), opts).unwrap()
}

/// Where a view's bytes lie in the tier's region.
fn offset_in(t: &DramTier, b: &Bytes) -> usize {
    b.as_ptr() as usize - t.region().as_ptr() as usize
}

#[test]
fn a_dropped_lease_returns_its_slot_for_reuse() {
    let t = tier(256 * KIB, 0.9);
    let mut w = t.reserve(60 * KIB).unwrap();
    let off = w.offset().unwrap();
    w.buf_mut().fill(0x5A);
    let s = t.stats();
    assert_eq!((s.leases, s.leased_bytes, s.allocated_bytes), (1, 64 * KIB as u64, 64 * KIB as u64));
    drop(w); // the connection ended before its commit
    let s = t.stats();
    assert_eq!((s.leases, s.leased_bytes, s.blocks), (0, 0, 0));
    let w = t.reserve(64 * KIB).unwrap();
    assert_eq!(w.offset(), Some(off), "the same slot, from its class's free list");
    assert_eq!(t.stats().allocated_bytes, 64 * KIB as u64);
    assert_eq!(t.commit(w, header(NS, 1, 64 * KIB), Priority::Normal).unwrap(), InsertOutcome::Inserted);
    assert_eq!(t.stats().leases, 0);
}

#[test]
fn a_lease_past_its_deadline_is_reclaimed_and_its_commit_fails() {
    let opts = DramOptions { lease_ttl: Duration::from_secs(1), ..DramOptions::default() };
    let t = tier_with(64 * KIB, opts);
    let now = Instant::now();
    let mut stale = t.reserve_at(64 * KIB, now).unwrap();
    assert!(stale.deadline() > now);
    stale.buf_mut().copy_from_slice(&payload(1, 64 * KIB));
    assert_eq!(t.reap_leases(now), 0, "not before its deadline");
    assert_eq!(t.reap_leases(now + Duration::from_secs(2)), 1);
    let s = t.stats();
    assert_eq!((s.leases, s.leased_bytes, s.leases_expired, s.allocated_bytes), (0, 0, 1, 0));
    assert_eq!(s.region_used_bytes, 64 * KIB as u64, "the holder still owns the memory");
    // The budget is free again although the holder never let go: another writer gets a slot
    // (in the headroom), and the stale holder's bytes are untouched by it.
    put(&t, 2, 64 * KIB, Priority::Normal).unwrap();
    assert_eq!(stale.buf_mut(), &payload(1, 64 * KIB)[..]);
    let r = t.commit_at(stale, header(NS, 1, 64 * KIB), Priority::Normal, now + Duration::from_secs(2));
    assert!(matches!(r, Err(ServerError::Capacity(_))), "{r:?}");
    assert!(!t.contains(&NS, &key(1)));
    let s = t.stats();
    assert_eq!((s.blocks, s.allocated_bytes, s.region_used_bytes), (1, 64 * KIB as u64, 64 * KIB as u64));
    assert_eq!(&t.get(&NS, &key(2)).unwrap().payload[..], &payload(2, 64 * KIB)[..]);

    // A commit after the deadline fails even when nothing reaped the lease first, and the slot
    // goes back to the arena.
    assert!(t.remove(&NS, &key(2)));
    let mut late = t.reserve_at(10 * KIB, now).unwrap();
    late.buf_mut().copy_from_slice(&payload(3, 10 * KIB));
    let r = t.commit_at(late, header(NS, 3, 10 * KIB), Priority::Normal, now + Duration::from_secs(5));
    assert!(matches!(r, Err(ServerError::Capacity(_))), "{r:?}");
    let s = t.stats();
    assert_eq!((s.leases, s.leases_expired, s.blocks), (0, 2, 0));
    assert_eq!(s.region_used_bytes, s.allocated_bytes, "only the free-listed slot of key 2 is left");
}

#[test]
fn leased_bytes_are_capped() {
    let opts = DramOptions { max_leased_bytes: Some(128 * KIB as u64), ..DramOptions::default() };
    let t = tier_with(1 << 20, opts);
    let a = t.reserve(64 * KIB).unwrap();
    let b = t.reserve(64 * KIB).unwrap();
    assert!(matches!(t.reserve(4 * KIB), Err(ServerError::Capacity(_))), "128 KiB already leased");
    assert_eq!(t.stats().leased_bytes, 128 * KIB as u64);
    drop(a);
    let c = t.reserve(4 * KIB).unwrap();
    drop((b, c));
    // One lease larger than the limit is granted when no other is open.
    let big = t.reserve(512 * KIB).unwrap();
    assert!(matches!(t.reserve(4 * KIB), Err(ServerError::Capacity(_))));
    drop(big);
    assert_eq!(t.stats().leases, 0);
    // Committed blocks do not count: a writer can fill the tier one lease at a time.
    for i in 0..16 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
    }
    assert_eq!(t.stats().blocks, 16);
}

#[test]
fn a_reader_view_outlives_eviction_while_new_blocks_are_written() {
    let t = tier(256 * KIB, 0.9);
    for i in 0..4 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
    }
    let held: Vec<StoredBlock> = (0..4).map(|i| t.get(&NS, &key(i)).unwrap()).collect();
    let offsets: Vec<usize> = held.iter().map(|b| offset_in(&t, &b.payload)).collect();
    for i in 10..40 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
        let b = t.get(&NS, &key(i)).unwrap();
        assert!(!offsets.contains(&offset_in(&t, &b.payload)), "a held slot was handed to a writer");
        assert_eq!(&b.payload[..], &payload(i, 64 * KIB)[..]);
        check_caps(&t);
    }
    assert!((0..4).all(|i| !t.contains(&NS, &key(i))), "all evicted");
    for (i, b) in held.iter().enumerate() {
        assert_eq!(&b.payload[..], &payload(i as u32, 64 * KIB)[..], "held block {i} changed");
    }
    let s = t.stats();
    assert_eq!(s.region_used_bytes, s.allocated_bytes + 4 * 64 * KIB as u64, "{s:?}");
    drop(held);
    let s = t.stats();
    assert_eq!(s.region_used_bytes, s.allocated_bytes, "the last reader returned the slots");
}

#[test]
fn the_region_stays_within_capacity_without_readers() {
    let cap = 1 << 20;
    let t = tier(cap, 0.9);
    let s = t.stats();
    assert_eq!(s.region_bytes, (cap + 2 * cap) as u64, "capacity + headroom");
    assert_eq!(s.region_used_bytes, 0, "nothing is touched up front");
    let mut rng = Rng(7);
    for i in 0..400 {
        let len = 1 + rng.below(200 * KIB as u64) as usize;
        t.insert(header(NS, i, len), &payload(i, len), Priority::Normal).unwrap();
        let s = t.stats();
        assert!(s.region_used_bytes <= cap as u64, "{s:?}");
        assert_eq!(s.region_used_bytes, s.allocated_bytes);
    }
}

#[test]
fn memfd_tier_maps_to_the_same_bytes_through_its_fd() {
    let t = tier_with(1 << 20, DramOptions { region: RegionMode::Memfd, ..DramOptions::default() });
    assert_eq!(t.region().mode(), RegionMode::Memfd);
    for i in 0..5 {
        put(&t, i, 3000 + 1000 * i as usize, Priority::Normal).unwrap();
    }
    let b = t.get(&NS, &key(3)).unwrap();
    let off = offset_in(&t, &b.payload);
    // A second mapping of the same memfd, as a same-node process would make from the fd.
    let fd = t.region().fd().unwrap().try_clone_to_owned().unwrap();
    let file = std::fs::File::from(fd);
    let map = unsafe_map_copy(&file);
    assert_eq!(map.len(), t.region().len());
    assert_eq!(&map[off..off + 6000], &payload(3, 6000)[..]);
    assert!(tier(1 << 20, 0.9).region().fd().is_none(), "anonymous regions have no fd");
}

/// The whole file behind `file`, read through a fresh shared mapping.
fn unsafe_map_copy(file: &std::fs::File) -> Vec<u8> {
    let m = memmap2::MmapOptions::new().map_raw_read_only(file).unwrap();
    // SAFETY: the mapping lives for this block and is `m.len()` bytes long; the tier's writers
    // finished before the copy.
    unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) }.to_vec()
}

#[derive(Debug, Clone)]
enum ArenaOp {
    Insert(u32),
    Remove(u32),
    Hold(u32),
    Release(usize),
    Lease(u32),
    Commit(usize),
    DropLease(usize),
    Expire,
}

fn arena_op() -> impl Strategy<Value = ArenaOp> {
    let k = 0u32..24;
    prop_oneof![
        5 => k.clone().prop_map(ArenaOp::Insert),
        2 => k.clone().prop_map(ArenaOp::Remove),
        2 => k.clone().prop_map(ArenaOp::Hold),
        1 => (0usize..8).prop_map(ArenaOp::Release),
        2 => k.prop_map(ArenaOp::Lease),
        1 => (0usize..4).prop_map(ArenaOp::Commit),
        1 => (0usize..4).prop_map(ArenaOp::DropLease),
        1 => Just(ArenaOp::Expire),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// Random reserve / commit / evict / remove / hold / expire sequences through a small region
    /// with a little headroom: live slots never overlap each other nor a free extent, and every
    /// live block, held view and open lease still holds exactly its own bytes.
    #[test]
    fn slots_never_overlap(ops in proptest::collection::vec(arena_op(), 1..150)) {
        let cap = 300 * KIB;
        let opts = DramOptions { headroom_bytes: Some(200 * KIB as u64), lease_ttl: Duration::from_secs(10), ..DramOptions::default() };
        let t = tier_with(cap, opts);
        let start = Instant::now();
        let mut now = start;
        let mut held: Vec<(u32, StoredBlock)> = Vec::new();
        let mut leases: Vec<(u32, Lease)> = Vec::new();
        for op in ops {
            match op {
                ArenaOp::Insert(i) => {
                    let r = put(&t, i, prop_len(i), Priority::Normal);
                    prop_assert!(matches!(r, Ok(_) | Err(ServerError::Capacity(_))), "{:?}", r);
                }
                ArenaOp::Remove(i) => { t.remove(&NS, &key(i)); }
                ArenaOp::Hold(i) => {
                    if let Some(b) = t.get(&NS, &key(i)) {
                        if held.len() == 6 { held.remove(0); }
                        held.push((i, b));
                    }
                }
                ArenaOp::Release(j) => { if j < held.len() { held.remove(j); } }
                ArenaOp::Lease(i) => {
                    if leases.len() < 4 {
                        match t.reserve_at(prop_len(i), now) {
                            Ok(mut w) => {
                                w.buf_mut().copy_from_slice(&payload(i, prop_len(i)));
                                leases.push((i, w));
                            }
                            Err(e) => prop_assert!(matches!(e, ServerError::Capacity(_)), "{e}"),
                        }
                    }
                }
                ArenaOp::Commit(j) => {
                    if j < leases.len() {
                        let (i, w) = leases.remove(j);
                        let expired = w.deadline() < now;
                        let r = t.commit_at(w, header(NS, i, prop_len(i)), Priority::Normal, now);
                        if expired {
                            prop_assert!(matches!(r, Err(ServerError::Capacity(_))), "{:?}", r);
                        } else {
                            prop_assert!(r.is_ok(), "{:?}", r);
                        }
                    }
                }
                ArenaOp::DropLease(j) => { if j < leases.len() { leases.remove(j); } }
                ArenaOp::Expire => {
                    now += Duration::from_secs(6);
                    t.reap_leases(now);
                }
            }
            // Contents.
            for i in 0..24u32 {
                if let Some(e) = t.shared.index.get(&(NS, key(i))) {
                    prop_assert!(e.buf.view(prop_len(i))[..] == payload(i, prop_len(i))[..], "block {} damaged", i);
                }
            }
            for (i, b) in &held {
                prop_assert!(b.payload[..] == payload(*i, prop_len(*i))[..], "held view of {} damaged", i);
            }
            for (i, w) in &mut leases {
                prop_assert!(w.buf_mut()[..] == payload(*i, prop_len(*i))[..], "open lease for {} damaged", i);
            }
            // Layout: live slots (deduplicated: a view and its entry share one) and free extents
            // are pairwise disjoint.
            let mut spans: Vec<(usize, usize)> = t.shared.index.iter().map(|e| (e.buf.offset(), e.buf.size())).collect();
            spans.extend(held.iter().map(|(i, b)| (offset_in(&t, &b.payload), slot_size(prop_len(*i)))));
            spans.extend(leases.iter().filter_map(|(i, w)| Some((w.offset()?, slot_size(prop_len(*i))))));
            spans.sort_unstable();
            spans.dedup();
            let live: usize = spans.iter().map(|s| s.1).sum();
            spans.extend(t.shared.arena.check());
            spans.sort_unstable();
            for w in spans.windows(2) {
                prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {:?} and {:?}", w[0], w[1]);
            }
            let s = t.stats();
            prop_assert!(s.allocated_bytes <= cap as u64, "{:?}", s);
            prop_assert!(live as u64 <= s.region_used_bytes && s.region_used_bytes <= s.region_bytes, "{:?}", s);
            prop_assert_eq!(s.leases, leases.iter().filter(|(_, w)| w.deadline() >= now).count() as u64);
        }
        drop((held, leases));
        let s = t.stats();
        prop_assert_eq!(s.region_used_bytes, s.allocated_bytes);
    }
}

/// Writes block `i` of `ns` through a reservation made for its namespace (as the planes do).
fn put_for(t: &DramTier, ns: NamespaceId, i: u32, len: usize) -> Result<InsertOutcome, ServerError> {
    let mut w = t.reserve_for(&ns, len)?;
    w.buf_mut().copy_from_slice(&payload(i, len));
    t.commit(w, header(ns, i, len), Priority::Normal)
}

#[test]
fn a_tenants_writes_in_flight_count_against_its_quota() {
    // Concurrent writers reserve before any of them commits: their open leases count, so the
    // tenant's resident bytes never pass its quota once they all commit (they did before: each
    // reservation saw only the committed bytes).
    let t = tier(1024 * KIB, 0.9);
    let (heavy, quiet) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
    t.assign_account(heavy, 1);
    t.set_account_quota(1, 256 * KIB as u64);
    for i in 0..4 {
        put_for(&t, heavy, i, 32 * KIB).unwrap(); // 128 KiB resident
    }
    let mut open: Vec<_> = (0..8).map(|_| t.reserve_for(&heavy, 32 * KIB).unwrap()).collect();
    // 8 more in flight: room was made out of its own committed blocks, oldest first.
    assert_eq!(t.account_resident(1), 0, "its committed blocks made room for the writes in flight");
    // Its quota is all in flight: a ninth write is refused, saying so, and another tenant's isn't.
    let err = t.reserve_for(&heavy, 32 * KIB).unwrap_err();
    assert!(matches!(err, ServerError::Capacity(ref m) if m.contains("in flight")), "{err}");
    put_for(&t, quiet, 50, 32 * KIB).unwrap();
    for (n, mut w) in open.drain(..).enumerate() {
        let i = 100 + n as u32;
        w.buf_mut().copy_from_slice(&payload(i, 32 * KIB));
        t.commit(w, header(heavy, i, 32 * KIB), Priority::Normal).unwrap();
    }
    assert_eq!(t.account_resident(1), 256 * KIB as u64);
    // A dropped lease and an expired one give their share back.
    drop(t.reserve_for(&heavy, 32 * KIB).unwrap());
    let stale = t.reserve_for(&heavy, 32 * KIB).unwrap();
    t.reap_leases(stale.deadline() + Duration::from_secs(1));
    drop(stale);
    for i in 200..208 {
        t.reserve_for(&heavy, 32 * KIB).map(drop).unwrap();
        put_for(&t, heavy, i, 32 * KIB).unwrap();
        assert!(t.account_resident(1) <= 256 * KIB as u64);
    }
    assert_eq!(t.account_resident(1), 256 * KIB as u64);
}

#[test]
fn a_tenant_at_its_quota_evicts_its_own_blocks_and_never_anothers() {
    let t = tier(1024 * KIB, 0.9);
    let (heavy, quiet) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
    t.assign_account(heavy, 1);
    t.assign_account(quiet, 2);
    t.set_account_quota(1, 256 * KIB as u64);
    // The quiet tenant holds 8 blocks (no quota); the heavy one writes 4x its quota.
    for i in 0..8 {
        put_for(&t, quiet, i, 64 * KIB).unwrap();
    }
    for i in 100..164 {
        put_for(&t, heavy, i, 16 * KIB).unwrap();
        assert!(t.account_resident(1) <= 256 * KIB as u64, "over quota at block {i}");
        check_caps(&t);
    }
    assert_eq!(t.account_resident(2), 8 * 64 * KIB as u64);
    for i in 0..8 {
        let b = t.get(&quiet, &key(i)).expect("the quiet tenant's blocks stay");
        assert_eq!(&b.payload[..], &payload(i, 64 * KIB)[..]);
    }
    // The heavy tenant keeps its newest blocks: the oldest went first.
    assert!(t.get(&heavy, &key(163)).is_some() && t.get(&heavy, &key(100)).is_none());
    assert_eq!(t.account_resident(1), 256 * KIB as u64);

    // Its pins may take max_pinned_ratio (0.9) of its quota, as the node's of the capacity, so
    // they always leave it room to write: pinning all of the quota is refused, and pinned blocks
    // stay while its writes make room out of the others.
    let newest: Vec<_> = (148..164).map(key).collect();
    let err = t.pin(&heavy, &newest).unwrap_err();
    assert!(matches!(err, ServerError::Capacity(ref m) if m.contains("pinned share")), "{err}");
    t.pin(&heavy, &newest[2..]).unwrap(); // 224 of 256 KiB: under 90%
    for i in 999..1003 {
        put_for(&t, heavy, i, 16 * KIB).unwrap();
    }
    assert!(newest[2..].iter().all(|k| t.contains(&heavy, k)), "pinned blocks stay");
    assert!(t.account_resident(1) <= 256 * KIB as u64);
    t.unpin(&heavy, &newest[2..]);
    t.pin(&heavy, &newest[..2]).unwrap_err(); // evicted to make room: gone, not pinnable
    put_for(&t, heavy, 999, 16 * KIB).unwrap();
    // A block larger than the quota can never fit it.
    assert!(matches!(put_for(&t, heavy, 1000, 512 * KIB), Err(ServerError::Capacity(_))));
    // Unassigned namespaces have no quota.
    for i in 2000..2004 {
        put_for(&t, NS, i, 64 * KIB).unwrap();
    }
}

/// The accounts without a quota (a tenant without `dram_bytes`, the operator's namespaces) share
/// what the quotas leave: flooding the tier, they evict their own oldest blocks, never those of
/// a tenant under its quota; their pins and their writes in flight are held to the pool's
/// shares, so a quota'd tenant can always write. Before, a flood without a quota evicted a
/// quota'd tenant's blocks to nothing, and its pins or open leases took the room it was promised.
#[test]
fn accounts_without_a_quota_share_what_the_quotas_leave() {
    let t = tier(1024 * KIB, 0.9);
    let (kept, free, op) = (NamespaceId([1; 16]), NamespaceId([2; 16]), NS);
    t.assign_account(kept, 1);
    t.set_account_quota(1, 256 * KIB as u64);
    t.assign_account(free, 2); // a tenant without a quota
    for i in 0..12 {
        put_for(&t, kept, i, 16 * KIB).unwrap(); // 192 KiB, under its quota
    }
    // The two without a quota flood the tier four times over between them.
    for i in 100..164 {
        put_for(&t, if i % 2 == 0 { free } else { op }, i, 64 * KIB).unwrap();
        check_caps(&t);
        assert!(t.account_resident(2) + t.account_resident(0) <= 768 * KIB as u64, "past the pool at {i}");
    }
    assert_eq!(t.account_resident(1), 192 * KIB as u64, "the quota'd tenant lost blocks");
    for i in 0..12 {
        assert_eq!(&t.get(&kept, &key(i)).expect("kept").payload[..], &payload(i, 16 * KIB)[..]);
    }
    // Theirs went oldest first, across both accounts.
    assert!(t.get(&op, &key(163)).is_some() && t.get(&free, &key(162)).is_some());
    assert!(t.get(&free, &key(100)).is_none() && t.get(&op, &key(101)).is_none());

    // Pins: at most 0.9 of the pool (691 KiB) between them.
    let newest_free: Vec<_> = (152..164).filter(|i| i % 2 == 0).map(key).collect(); // 6 x 64 KiB
    let newest_op: Vec<_> = (152..164).filter(|i| i % 2 == 1).map(key).collect();
    t.pin(&free, &newest_free).unwrap();
    t.pin(&op, &newest_op[..4]).unwrap(); // 640 KiB between them
    let err = t.pin(&op, &newest_op[4..5]).unwrap_err();
    assert!(matches!(err, ServerError::Capacity(ref m) if m.contains("without a dram_bytes quota")), "{err}");
    // The quota'd tenant writes its quota's worth all the same.
    for i in 12..16 {
        put_for(&t, kept, i, 16 * KIB).unwrap();
    }
    assert_eq!(t.account_resident(1), 256 * KIB as u64);
    t.unpin(&free, &newest_free);
    t.unpin(&op, &newest_op[..4]);

    // Writes in flight: the pool's share of the lease budget (on a 64 MiB tier with 32 MiB of
    // quotas, the budget is 32 MiB and the pool's share 16 MiB), then refused saying so, while
    // the quota'd tenant's own still go through.
    let t = tier(64 << 20, 0.9);
    t.assign_account(kept, 1);
    t.set_account_quota(1, 32 << 20);
    t.assign_account(free, 2);
    let open: Vec<_> = (0..16).map(|_| t.reserve_for(&free, 1 << 20).unwrap()).collect();
    let err = t.reserve_for(&op, 1 << 20).unwrap_err();
    assert!(matches!(err, ServerError::Capacity(ref m) if m.contains("writes in flight")), "{err}");
    put_for(&t, kept, 50, 1 << 20).unwrap();
    drop(open);
    put_for(&t, op, 500, 1 << 20).unwrap();
}

/// Quotas that reserve the whole tier (or more) leave no pool: the accounts without one compete
/// under the node-wide policy, as with no quota at all.
#[test]
fn quotas_reserving_the_whole_tier_leave_the_node_wide_policy() {
    let t = tier(1024 * KIB, 0.9);
    let kept = NamespaceId([1; 16]);
    t.assign_account(kept, 1);
    t.set_account_quota(1, 1024 * KIB as u64);
    for i in 0..32 {
        put_for(&t, NS, i, 64 * KIB).unwrap();
        check_caps(&t);
    }
    assert!(t.account_resident(0) > 0);
}

/// In the shared pool, an account whose oldest blocks are all pinned is passed over for another
/// account's unpinned ones (its pinned blocks keep their old ids: it was picked again and again
/// until the write was refused, "held by pinned blocks"); and a block put for a quota'd tenant's
/// namespace (a promotion, a peer's copy) counts against its quota, not the pool.
#[test]
fn the_pool_passes_over_an_account_whose_blocks_are_pinned() {
    let t = tier(1024 * KIB, 0.9);
    let (kept, free, op) = (NamespaceId([1; 16]), NamespaceId([2; 16]), NS);
    t.assign_account(kept, 1);
    t.set_account_quota(1, 256 * KIB as u64);
    t.assign_account(free, 2);
    // The operator's first blocks, pinned (a parked session): the oldest of the pool.
    for i in 0..4 {
        put_for(&t, op, i, 64 * KIB).unwrap();
    }
    t.pin(&op, &(0..4).map(key).collect::<Vec<_>>()).unwrap();
    // A tenant without a quota then writes the pool over twice.
    for i in 100..124 {
        put_for(&t, free, i, 64 * KIB).unwrap_or_else(|e| panic!("block {i}: {e}"));
        check_caps(&t);
    }
    assert!((0..4).all(|i| t.contains(&op, &key(i))), "the pinned blocks stay");
    // The pool is now full to its share with pins and `free`'s blocks; a put for the quota'd
    // tenant takes its own room.
    let h = header(kept, 7, 64 * KIB);
    assert_eq!(t.insert(h, &payload(7, 64 * KIB), Priority::Normal).unwrap(), InsertOutcome::Inserted);
    assert_eq!(t.account_resident(1), 64 * KIB as u64);
    assert_eq!(t.account_resident(2) + t.account_resident(0), 768 * KIB as u64);
}

#[test]
fn a_raised_block_is_evicted_at_its_new_level() {
    let t = tier(640 * KIB, 0.9);
    for i in 10..13 {
        put(&t, i, 64 * KIB, Priority::Normal).unwrap();
    }
    for i in 20..26 {
        put(&t, i, 64 * KIB, Priority::Low).unwrap();
    }
    assert!(t.raise_priority(&NS, &key(20), Priority::Normal));
    assert!(!t.raise_priority(&NS, &key(20), Priority::Normal), "already at that level");
    assert!(!t.raise_priority(&NS, &key(10), Priority::Low), "never lowered");
    assert!(!t.raise_priority(&NS, &key(99), Priority::Normal), "not held");
    // Six more low blocks: the low ones that were there go first, oldest first — not 20, the
    // oldest of them before it was raised.
    for i in 30..36 {
        put(&t, i, 64 * KIB, Priority::Low).unwrap();
    }
    assert!(t.contains(&NS, &key(20)), "the raised block outlives the low ones");
    assert!((10..13).all(|i| t.contains(&NS, &key(i))));
    assert!((21..26).all(|i| !t.contains(&NS, &key(i))), "the low blocks before it went first");
    // Its bytes are counted once, at its new level: removing it leaves the tier consistent.
    assert!(t.remove(&NS, &key(20)));
    assert_eq!(t.stats().blocks, 9);
}
