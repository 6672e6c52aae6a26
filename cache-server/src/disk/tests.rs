use super::*;
use kvtier_proto::{BlockFrame, CodecId, DType, KvLayout};

fn layout() -> KvLayout {
    KvLayout::new(2, 1, 64, DType::Fp16, 16) // 8 KiB blocks
}

fn frame(i: u32) -> BlockFrame {
    let key = BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes());
    let payload: Vec<u8> =
        (0..layout().block_bytes()).map(|j| (j as u32).wrapping_mul(31).wrapping_add(i) as u8).collect();
    BlockFrame::new(NamespaceId([1; 16]), key, layout(), CodecId::RAW, 16, Bytes::from(payload))
}

fn open(dir: &Path, cap: u64) -> (DiskTier, RecoveryReport) {
    DiskTier::open(DiskConfig {
        dir: dir.to_path_buf(),
        capacity_bytes: cap,
        segment_bytes: 64 << 10,
        sync_writes: false,
    })
    .unwrap()
}

#[test]
fn write_read_and_recover() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (t, r) = open(dir.path(), 1 << 20);
        assert_eq!(r.blocks, 0);
        for i in 0..20 {
            let f = frame(i);
            t.write(&f.header, &f.payload).unwrap();
        }
        let f = frame(3);
        let (h, p) = t.read(&f.header.namespace, &f.header.key).unwrap();
        assert_eq!((h, p), (f.header, f.payload));
    }
    let (t, r) = open(dir.path(), 1 << 20);
    assert_eq!((r.blocks, r.discarded), (20, 0));
    for i in 0..20 {
        let f = frame(i);
        assert_eq!(t.read(&f.header.namespace, &f.header.key).unwrap().1, f.payload, "block {i}");
    }
    // Resident is the blocks' payload bytes (it was the segment files' bytes, headers and dead
    // records included), after recovery and a removal alike.
    let bb = layout().block_bytes();
    assert_eq!(t.stats().resident_bytes, 20 * bb);
    assert!(t.stats().used_bytes > 20 * bb);
    let f = frame(3);
    assert!(t.remove(&f.header.namespace, &f.header.key));
    assert_eq!(t.stats().resident_bytes, 19 * bb);
}

#[test]
fn cap_holds_and_oldest_segments_go_first_unless_pinned() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 256 << 10; // 4 segments of 64 KiB; each record is 12 KiB (8 KiB + header, aligned)
    let (t, _) = open(dir.path(), cap);
    let first = frame(0);
    t.write(&first.header, &first.payload).unwrap();
    t.pin(&first.header.namespace, &[first.header.key]).unwrap();
    for i in 1..100 {
        let f = frame(i);
        t.write(&f.header, &f.payload).unwrap();
        let s = t.stats();
        assert!(s.used_bytes <= cap, "{s:?}");
    }
    assert!(t.stats().evicted_blocks > 0);
    assert!(t.read(&first.header.namespace, &first.header.key).is_some(), "pinned block survived");
    assert!(t.read(&NamespaceId([1; 16]), &frame(2).header.key).is_some(), "shares the pinned block's segment");
    assert!(t.read(&NamespaceId([1; 16]), &frame(7).header.key).is_none(), "old unpinned segment evicted");
    assert!(t.read(&NamespaceId([1; 16]), &frame(99).header.key).is_some());
}

/// One small pinned block in every segment (parked sessions of a few tokens each) must not freeze
/// the tier: the segment such pins hold least of is compacted (its pinned blocks copied out,
/// synced, then it is deleted), and the pinned blocks stay readable, also after a restart.
#[test]
fn a_few_small_pins_in_every_segment_do_not_freeze_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 1 << 20; // 16 segments of 64 KiB, 5 records of 12 KiB each
                       // One pinned block in each of the first 20 segments (more than the tier holds at once).
    let pinned: Vec<u32> = (0..20).map(|s| s * 5).collect();
    {
        let (t, _) = open(dir.path(), cap);
        for i in 0..400 {
            let f = frame(i);
            t.write(&f.header, &f.payload).unwrap_or_else(|e| panic!("block {i}: {e}"));
            if pinned.contains(&i) {
                t.pin(&f.header.namespace, &[f.header.key]).unwrap();
            }
            let s = t.stats();
            assert!(s.used_bytes <= cap, "{s:?}");
        }
        for &i in &pinned {
            let f = frame(i);
            assert_eq!(t.read(&f.header.namespace, &f.header.key).unwrap().1, f.payload, "pinned block {i}");
        }
        assert!(t.read(&NamespaceId([1; 16]), &frame(399).header.key).is_some());
        t.sync().unwrap();
    }
    let (t, r) = open(dir.path(), cap);
    assert_eq!(r.discarded, 0);
    for &i in &pinned {
        let f = frame(i);
        assert_eq!(
            t.read(&f.header.namespace, &f.header.key).unwrap().1,
            f.payload,
            "pinned block {i} after a restart"
        );
    }
}

/// An observer that keeps the keys the tier says it evicted.
fn observed(t: &DiskTier) -> Arc<parking_lot::Mutex<Vec<BlockKey>>> {
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let keep = seen.clone();
    t.set_eviction_observer(Some(Arc::new(move |keys: &[crate::dram::IndexKey]| {
        keep.lock().extend(keys.iter().map(|k| k.1));
    })));
    seen
}

/// Writes frames `range` and pins `pinned` of them as they land.
fn write_pinning(t: &DiskTier, range: std::ops::Range<u32>, pinned: &[u32]) {
    for i in range {
        let f = frame(i);
        t.write(&f.header, &f.payload).unwrap_or_else(|e| panic!("block {i}: {e}"));
        if pinned.contains(&i) {
            t.pin(&f.header.namespace, &[f.header.key]).unwrap();
        }
    }
}

/// A compaction's unpinned blocks are evictions like a deleted segment's: counted and told to the
/// eviction observer (KV events). Before, they vanished from the index uncounted and untold, so a
/// router following events believed them still on disk.
#[test]
fn a_compaction_counts_and_tells_the_blocks_it_evicts() {
    let dir = tempfile::tempdir().unwrap();
    // 4 segments of 64 KiB (5 records of 12 KiB), a pinned block in each of the first three.
    let (t, _) = open(dir.path(), 256 << 10);
    let seen = observed(&t);
    write_pinning(&t, 0..15, &[0, 5, 10]);
    assert_eq!(t.stats().evicted_blocks, 0);
    // A fourth segment needs room, every sealed one holds a pin: the first is compacted.
    write_pinning(&t, 15..16, &[]);
    let gone: Vec<BlockKey> = (1..5).map(|i| frame(i).header.key).collect();
    assert_eq!(*seen.lock(), gone, "the first segment's unpinned blocks, told");
    assert_eq!(t.stats().evicted_blocks, 4);
    let ns = NamespaceId([1; 16]);
    assert_eq!(t.read(&ns, &frame(0).header.key).unwrap().1, frame(0).payload, "the pinned block moved");
    assert!(gone.iter().all(|k| t.read(&ns, k).is_none()));
}

/// A small tier (four segments) whose sealed segments are mostly pinned, the segment being
/// written full and unpinned: that segment goes and writes go on. Before, every write was refused
/// ("each holds blocks of parked sessions") with 40% of the tier pinned, until a session dropped.
#[test]
fn a_small_tier_makes_room_out_of_its_unpinned_active_segment() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = open(dir.path(), 256 << 10);
    let seen = observed(&t);
    // Three of five pinned in each of the first two segments (too many to compact), the third
    // segment unpinned.
    write_pinning(&t, 0..15, &[0, 1, 2, 5, 6, 7]);
    let pinned = t.stats().pinned_bytes;
    write_pinning(&t, 15..20, &[]);
    let ns = NamespaceId([1; 16]);
    let gone: Vec<BlockKey> = (10..15).map(|i| frame(i).header.key).collect();
    assert_eq!(*seen.lock(), gone, "the full unpinned segment's blocks, told");
    assert!(gone.iter().all(|k| t.read(&ns, k).is_none()));
    for i in [0, 1, 2, 5, 6, 7, 3, 15, 19] {
        assert_eq!(t.read(&ns, &frame(i).header.key).unwrap().1, frame(i).payload, "block {i}");
    }
    assert_eq!(t.stats().pinned_bytes, pinned);
    assert!(t.stats().used_bytes <= 256 << 10);
    // With the segment being written pinned too, there is nothing left to free: refused, and
    // said so.
    write_pinning(&t, 20..25, &[15, 16, 17, 18, 19, 20, 21, 22, 23, 24]);
    let f = frame(25);
    let e = t.write(&f.header, &f.payload).unwrap_err();
    assert!(
        matches!(e, ServerError::Capacity(ref m) if m.contains("every segment holds blocks of parked sessions")),
        "{e}"
    );
}

#[test]
fn full_of_pins_is_a_capacity_error() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = open(dir.path(), 128 << 10);
    let mut i = 0;
    let err = loop {
        let f = frame(i);
        match t.write(&f.header, &f.payload) {
            Ok(()) => t.pin(&f.header.namespace, &[f.header.key]).unwrap(),
            Err(e) => break e,
        }
        i += 1;
        assert!(i < 100);
    };
    assert!(matches!(err, ServerError::Capacity(_)), "{err}");
    for j in 0..i {
        assert!(t.read(&NamespaceId([1; 16]), &frame(j).header.key).is_some());
    }
}

#[test]
fn corruption_is_a_miss_and_torn_tails_are_dropped_at_recovery() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (t, _) = open(dir.path(), 1 << 20);
        for i in 0..3 {
            let f = frame(i);
            t.write(&f.header, &f.payload).unwrap();
        }
        // Flip a payload byte of block 1 on disk.
        let seg = segment_path(&dir.path().join("segments"), 1);
        let mut bytes = std::fs::read(&seg).unwrap();
        bytes[12288 + 200] ^= 0xFF;
        std::fs::write(&seg, &bytes).unwrap();
        let f = frame(1);
        assert!(t.read(&f.header.namespace, &f.header.key).is_none());
        assert_eq!(t.stats().corrupt, 1);
        assert!(t.read(&f.header.namespace, &f.header.key).is_none(), "removed after the first failure");
        // A torn tail: half a record appended, as a crash mid-write would leave.
        let f = frame(9);
        let mut torn = f.header.encode().to_vec();
        torn.extend_from_slice(&f.payload[..1000]);
        let mut bytes = std::fs::read(&seg).unwrap();
        bytes.extend_from_slice(&torn);
        std::fs::write(&seg, &bytes).unwrap();
    }
    let (t, r) = open(dir.path(), 1 << 20);
    assert_eq!(r.blocks, 2, "{r:?}");
    assert_eq!(r.discarded, 2, "the corrupt block and the torn one: {r:?}");
    assert!(t.read(&NamespaceId([1; 16]), &frame(0).header.key).is_some());
    assert!(t.read(&NamespaceId([1; 16]), &frame(9).header.key).is_none());
    // New writes land after the truncated tail and survive another restart.
    let f = frame(10);
    t.write(&f.header, &f.payload).unwrap();
    drop(t);
    let (t, r) = open(dir.path(), 1 << 20);
    assert_eq!((r.blocks, r.discarded), (3, 1));
    assert_eq!(t.read(&f.header.namespace, &f.header.key).unwrap().1, f.payload);
}

/// One flipped byte in a record's header costs that record, not the rest of the segment.
#[test]
fn a_damaged_header_costs_one_record() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (t, _) = open(dir.path(), 1 << 20);
        for i in 0..6 {
            let f = frame(i);
            t.write(&f.header, &f.payload).unwrap();
        }
    }
    // 8 KiB blocks: each record is header + payload, padded to 12 KiB. Damage block 2's header
    // and block 4's payload.
    let seg = segment_path(&dir.path().join("segments"), 1);
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[2 * 12288 + 20] ^= 0x04;
    bytes[4 * 12288 + 500] ^= 0x80;
    std::fs::write(&seg, &bytes).unwrap();
    let (t, r) = open(dir.path(), 1 << 20);
    assert_eq!((r.blocks, r.discarded), (4, 2), "{r:?}");
    for i in [0, 1, 3, 5] {
        let f = frame(i);
        assert_eq!(t.read(&f.header.namespace, &f.header.key).unwrap().1, f.payload, "block {i}");
    }
    for i in [2, 4] {
        assert!(t.read(&NamespaceId([1; 16]), &frame(i).header.key).is_none(), "block {i}");
    }
}

#[test]
fn accounts_count_live_bytes_through_writes_evictions_and_removals() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 1 << 20;
    let (t, _) = open(dir.path(), cap);
    let ns = NamespaceId([1; 16]);
    let bb = layout().block_bytes();
    for i in 0..3 {
        let f = frame(i);
        t.write(&f.header, &f.payload).unwrap();
    }
    // Blocks held before the assignment count too.
    t.pin(&ns, &[frame(1).header.key]).unwrap();
    t.assign_account(ns, 7, Some(5 * bb));
    assert_eq!(t.account_live(7), 3 * bb);
    assert_eq!(t.account_blocks_and_pinned(7), (3, bb), "blocks and pins held before count too");
    t.pin(&ns, &[frame(0).header.key]).unwrap();
    t.unpin(&ns, &[frame(1).header.key]);
    assert_eq!(t.account_blocks_and_pinned(7), (3, bb));
    t.unpin(&ns, &[frame(0).header.key]);
    assert_eq!(t.account_blocks_and_pinned(7), (3, 0));
    assert!(!t.over_quota(&ns));
    for i in 3..5 {
        let f = frame(i);
        t.write(&f.header, &f.payload).unwrap();
    }
    assert!(t.over_quota(&ns), "5 blocks are the quota");
    assert!(t.remove(&ns, &frame(0).header.key));
    assert_eq!(t.account_live(7), 4 * bb);
    assert!(!t.over_quota(&ns));
    // Segments evicted by the node's FIFO uncount their blocks.
    for i in 5..200 {
        let f = frame(i);
        t.write(&f.header, &f.payload).unwrap();
    }
    let held = (0..200).filter(|i| t.contains(&ns, &frame(*i).header.key)).count() as u64;
    assert_eq!(t.account_live(7), held * bb);
    assert!(!t.over_quota(&NamespaceId([2; 16])), "an unassigned namespace has no quota");
}

#[test]
fn blocks_queued_for_the_disk_count_against_the_quota_until_written_or_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = open(dir.path(), 1 << 20);
    let ns = NamespaceId([1; 16]);
    let bb = layout().block_bytes();
    t.assign_account(ns, 7, Some(3 * bb));
    let f = frame(0);
    t.write(&f.header, &f.payload).unwrap();
    // A burst of evictions: two more fit beside the one held, the rest are refused at once.
    let admitted = (0..6).filter(|_| t.reserve_demotion(&ns, bb)).count();
    assert_eq!(admitted, 2, "queued blocks count against the quota");
    assert!(t.over_quota(&ns));
    // One queued block written, the other dropped: the account holds what it has.
    let f = frame(1);
    t.write(&f.header, &f.payload).unwrap();
    t.release_demotion(&ns, bb);
    t.release_demotion(&ns, bb);
    assert_eq!(t.account_live(7), 2 * bb);
    assert!(t.reserve_demotion(&ns, bb), "room for one again");
    assert!(!t.reserve_demotion(&ns, bb));
    assert!(t.reserve_demotion(&NamespaceId([2; 16]), u64::MAX), "an unassigned namespace has no quota");
}

#[test]
fn a_payload_hiding_a_frame_header_where_recovery_would_look_is_never_written() {
    // A tenant's block whose bytes carry another namespace's complete frame at a 4 KiB boundary of
    // the segment: were it written, a damaged header before it would let the recovery scan take the
    // planted frame for a record (bytes of the tenant's choosing under someone else's key).
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = open(dir.path(), 1 << 20);
    let victim = BlockFrame::new(
        NamespaceId([9; 16]),
        BlockKey([7; 32]),
        KvLayout::opaque(64, DType::Fp16, 16),
        CodecId::RAW,
        16,
        Bytes::from(vec![0xAB; 64]),
    );
    let planted = victim.to_bytes();
    let at = RECORD_ALIGN as usize - FRAME_HEADER_LEN;
    let mut bytes = vec![0u8; layout().block_bytes() as usize];
    bytes[at..at + planted.len()].copy_from_slice(&planted);
    let key = BlockKey([3; 32]);
    let carrier = BlockFrame::new(NamespaceId([1; 16]), key, layout(), CodecId::RAW, 16, Bytes::from(bytes.clone()));
    let err = t.write(&carrier.header, &carrier.payload).unwrap_err();
    assert!(err.to_string().contains("frame header at byte 3968"), "{err}");
    assert!(!t.contains(&carrier.header.namespace, &key));

    // Damage the first record on disk and recover: nothing of the victim's namespace appears.
    let f = frame(1);
    t.write(&f.header, &f.payload).unwrap();
    t.sync().unwrap();
    drop(t);
    let seg = segment_path(&dir.path().join("segments"), 1);
    let mut raw = std::fs::read(&seg).unwrap();
    raw[10] ^= 0xFF;
    std::fs::write(&seg, raw).unwrap();
    let (t, r) = open(dir.path(), 1 << 20);
    assert_eq!((r.blocks, r.discarded), (0, 1));
    assert!(!t.contains(&victim.header.namespace, &victim.header.key));

    // The same frame anywhere recovery never looks is ordinary payload.
    let mut elsewhere = vec![0u8; layout().block_bytes() as usize];
    elsewhere[100..100 + planted.len()].copy_from_slice(&planted);
    let ok =
        BlockFrame::new(NamespaceId([1; 16]), BlockKey([4; 32]), layout(), CodecId::RAW, 16, Bytes::from(elsewhere));
    t.write(&ok.header, &ok.payload).unwrap();
    assert!(t.contains(&ok.header.namespace, &ok.header.key));
}

/// The oldest segment holding a namespace's records counts a block forgotten but still in its
/// segment (what recovery would find again), and moves on once the segment is evicted.
#[test]
fn a_namespace_s_oldest_segment_is_that_of_its_oldest_record_until_evicted() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = open(dir.path(), 256 << 10);
    let other = NamespaceId([2; 16]);
    let mut first = frame(0);
    first.header.namespace = other;
    t.write(&first.header, &first.payload).unwrap();
    assert_eq!(t.purge_namespace_before(&other, (u64::MAX, u64::MAX)), 1);
    let seg = t.write_position().0;
    let f = frame(1);
    t.write(&f.header, &f.payload).unwrap();
    let oldest = t.oldest_segment_of();
    assert_eq!(oldest.get(&other), Some(&seg), "forgotten, still in its segment");
    assert_eq!(oldest.get(&NamespaceId([1; 16])), Some(&seg));
    for i in 2..100 {
        let f = frame(i);
        t.write(&f.header, &f.payload).unwrap();
    }
    let oldest = t.oldest_segment_of();
    assert_eq!(oldest.get(&other), None, "its segment was evicted");
    assert!(oldest.get(&NamespaceId([1; 16])).is_some_and(|&s| s > seg));
}
