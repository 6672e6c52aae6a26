//! Unit tests of the page pool on the host backend.

use super::*;
use crate::{HostDevice, MemInfo};

const PAGE: usize = 1024;

fn ns(n: u8) -> NamespaceId {
    NamespaceId([n; kvtier_proto::NAMESPACE_ID_LEN])
}

fn key(n: u8) -> BlockKey {
    BlockKey([n; kvtier_proto::KEY_LEN])
}

struct Fix {
    dev: Arc<HostDevice>,
    engine: DeviceBuf,
    pool: PagePool<HostDevice, MemorySpill>,
}

/// A pool of `pages` pages and an engine buffer of 8 pages, page i filled with i + 1.
fn fix(pages: usize) -> Fix {
    let dev = Arc::new(HostDevice::new(0, 1 << 20));
    let engine = dev.alloc(8 * PAGE).unwrap();
    for i in 0..8 {
        dev.write_sync(engine.range(i * PAGE, PAGE), &[i as u8 + 1; PAGE]).unwrap();
    }
    let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::Bytes(pages * PAGE + PAGE / 2));
    let pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
    Fix { dev, engine, pool }
}

impl Fix {
    fn put(&mut self, k: u8, engine_page: usize) {
        let ev = self.pool.insert_from_device(&ns(1), &key(k), self.engine.range(engine_page * PAGE, PAGE)).unwrap();
        self.dev.wait(&ev).unwrap();
    }

    /// Loads `k` into engine page 7 and returns its first byte (None on a miss).
    fn get(&mut self, k: u8) -> Option<u8> {
        let ev = self.pool.load_into(&ns(1), &key(k), self.engine.range(7 * PAGE, PAGE)).unwrap()?;
        self.dev.wait(&ev).unwrap();
        let bytes = self.dev.read_sync(self.engine.range(7 * PAGE, PAGE)).unwrap();
        assert!(bytes.iter().all(|b| *b == bytes[0]));
        Some(bytes[0])
    }
}

#[test]
fn capacity_is_a_fraction_of_free_memory_or_bytes() {
    let dev = Arc::new(HostDevice::new(0, 1 << 20));
    let _used = dev.alloc(1 << 19).unwrap();
    let p = PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(4096)).unwrap();
    // 20% of the 512 KiB free, in whole 4 KiB pages.
    assert_eq!(p.pages(), (((1 << 19) as f64 * 0.2) as usize) / 4096);
    assert_eq!(dev.mem_info().unwrap().free, (1 << 19) - p.pages() * 4096);
    drop(p);
    assert_eq!(dev.mem_info().unwrap(), MemInfo { free: 1 << 19, total: 1 << 20 });
    let p = PagePool::new(
        dev.clone(),
        MemorySpill::default(),
        PoolConfig::new(4096).with_capacity(Capacity::Bytes(10_000)),
    )
    .unwrap();
    assert_eq!((p.pages(), p.stats().pages), (2, 2));
    for bad in [
        Capacity::FractionOfFree(0.0),
        Capacity::FractionOfFree(1.5),
        Capacity::FractionOfFree(f64::NAN),
        Capacity::Bytes(100),
    ] {
        let r = PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(4096).with_capacity(bad));
        assert!(matches!(r, Err(AgentError::Config(_))), "{bad:?}");
    }
    assert!(matches!(
        PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(0)),
        Err(AgentError::Config(_))
    ));
    let too_big = PoolConfig::new(4096).with_capacity(Capacity::Bytes(1 << 20));
    assert!(matches!(PagePool::new(dev, MemorySpill::default(), too_big), Err(AgentError::OutOfMemory { .. })));
}

#[test]
fn hits_are_device_to_device_copies_of_the_exact_bytes() {
    let mut f = fix(4);
    f.put(10, 2);
    assert!(f.pool.contains(&ns(1), &key(10)));
    assert!(!f.pool.contains(&ns(2), &key(10)), "namespaces never share keys");
    // Overwrite the engine's source page: the pool kept its own copy.
    f.dev.write_sync(f.engine.range(2 * PAGE, PAGE), &[0xEE; PAGE]).unwrap();
    assert_eq!(f.get(10), Some(3));
    assert_eq!(f.get(11), None);
    let s = f.pool.stats();
    assert_eq!((s.hits, s.misses, s.inserts, s.resident), (1, 1, 1, 1));
    assert!(matches!(
        f.pool.load_into(&ns(1), &key(10), f.engine.range(0, PAGE - 1)),
        Err(AgentError::PageSizeMismatch { len, page: PAGE }) if len == PAGE - 1
    ));
    assert!(matches!(
        f.pool.insert_from_device(&ns(1), &key(12), f.engine.range(0, 2 * PAGE)),
        Err(AgentError::PageSizeMismatch { .. })
    ));
}

#[test]
fn the_least_recently_used_block_is_spilled_with_its_bytes() {
    let mut f = fix(3);
    f.put(1, 0);
    f.put(2, 1);
    f.put(3, 2);
    assert_eq!(f.get(1), Some(1)); // 1 is now the most recent; 2 the least
    f.put(4, 3);
    let spilled = f.pool.spill_target().received();
    assert_eq!(spilled.len(), 1);
    assert_eq!(spilled[0].key, (ns(1), key(2)));
    assert_eq!((spilled[0].codec, &spilled[0].payload), (CodecId::RAW, &vec![2u8; PAGE]));
    assert_eq!(f.get(2), None);
    assert_eq!((f.get(1), f.get(3), f.get(4)), (Some(1), Some(3), Some(4)));
    let s = f.pool.stats();
    assert_eq!((s.evictions, s.spills, s.spilled_bytes, s.resident), (1, 1, PAGE as u64, 3));
    // Re-inserting a resident key takes no page and evicts nothing.
    f.put(4, 5);
    assert_eq!(f.pool.stats().evictions, 1);
    assert_eq!(f.get(4), Some(4));
}

#[test]
fn pinned_blocks_stay_and_a_fully_pinned_pool_refuses() {
    let mut f = fix(2);
    f.put(1, 0);
    f.put(2, 1);
    assert_eq!(f.pool.pin(&ns(1), &key(1)), Ok(1));
    assert_eq!(f.pool.pin(&ns(1), &key(1)), Ok(2));
    f.pool.pin(&ns(1), &key(2)).unwrap();
    assert_eq!(f.pool.stats().pinned, 2);
    let r = f.pool.insert_from_device(&ns(1), &key(3), f.engine.range(2 * PAGE, PAGE));
    assert!(matches!(r, Err(AgentError::PoolExhausted { pages: 2 })));
    assert_eq!(f.pool.remove(&ns(1), &key(2)), Err(AgentError::Pinned));
    assert_eq!(f.pool.unpin(&ns(1), &key(2)), Ok(0));
    assert_eq!(f.pool.unpin(&ns(1), &key(2)), Err(AgentError::NotPinned));
    // Block 1 is older but pinned (twice): block 2 goes.
    f.put(3, 2);
    assert_eq!(f.pool.spill_target().received()[0].key, (ns(1), key(2)));
    assert_eq!(f.pool.unpin(&ns(1), &key(1)), Ok(1));
    assert_eq!(f.pool.pin(&ns(1), &key(9)), Err(AgentError::NotResident));
    assert_eq!(f.get(1), Some(1));
}

#[test]
fn unpinned_blocks_rejoin_the_lru_as_most_recent() {
    let mut f = fix(2);
    f.put(1, 0);
    f.put(2, 1);
    f.pool.pin(&ns(1), &key(1)).unwrap();
    f.pool.unpin(&ns(1), &key(1)).unwrap();
    f.put(3, 2);
    assert_eq!(f.pool.spill_target().received()[0].key, (ns(1), key(2)));
}

#[test]
fn blocks_from_a_tier_are_dropped_not_spilled() {
    let mut f = fix(1);
    let staged = HostBuffer::from_vec(vec![9u8; PAGE]);
    let _reg = f.dev.register_host(&staged).unwrap();
    let ev = f.pool.insert_from_host(&ns(1), &key(1), &staged.range(0, PAGE)).unwrap();
    f.dev.wait(&ev).unwrap();
    assert_eq!(f.get(1), Some(9));
    f.put(2, 1);
    let s = f.pool.stats();
    assert_eq!((s.evictions, s.clean_drops, s.spills), (1, 1, 0));
    assert!(f.pool.spill_target().received().is_empty());
}

#[test]
fn a_layer_pipelined_load_reads_pinned_pages_on_another_stream() {
    use crate::pipeline::{LayerPipeline, LayerSource, Transfer};
    // Each block (page) holds 4 layers of PAGE / 4 bytes, layer-first.
    let mut f = fix(2);
    f.put(1, 0);
    f.put(2, 1);
    let pipe = LayerPipeline::new(f.dev.clone()).unwrap();
    let pages: Vec<_> = [1u8, 2].iter().map(|k| f.pool.pin_for_load(&ns(1), &key(*k)).unwrap().unwrap()).collect();
    assert_eq!(f.pool.pin_for_load(&ns(1), &key(9)), Ok(None));
    let dst = f.dev.alloc(2 * PAGE).unwrap();
    let lb = PAGE / 4;
    let layers = (0..4)
        .map(|l| {
            LayerSource::new(
                pages
                    .iter()
                    .enumerate()
                    .map(|(b, p)| Transfer::DeviceToDevice {
                        src: p.buf.range(p.offset + l * lb, lb),
                        dst: dst.range(l * 2 * lb + b * lb, lb),
                    })
                    .collect(),
            )
        })
        .collect();
    let h = pipe.start_load_kv(layers);
    // Pinned: a new block cannot take their pages while the load runs.
    assert!(matches!(
        f.pool.insert_from_device(&ns(1), &key(3), f.engine.range(2 * PAGE, PAGE)),
        Err(AgentError::PoolExhausted { .. })
    ));
    assert!(h.wait_all().iter().all(Result::is_ok));
    let got = f.dev.read_sync(dst.all()).unwrap();
    for l in 0..4 {
        assert_eq!(&got[l * 2 * lb..l * 2 * lb + lb], &vec![1u8; lb][..], "layer {l} block 1");
        assert_eq!(&got[l * 2 * lb + lb..(l + 1) * 2 * lb], &vec![2u8; lb][..], "layer {l} block 2");
    }
    for k in [1u8, 2] {
        assert_eq!(f.pool.unpin(&ns(1), &key(k)), Ok(0));
    }
    assert_eq!(f.pool.stats().hits, 2);
    f.put(3, 2);
    assert_eq!(f.pool.stats().evictions, 1);
}

#[test]
fn spills_can_be_encoded_on_the_device_exactly_as_the_cpu_codec() {
    use kvtier_kernels::KvBlockView;
    let spec = BlockSpec::new(2, 4, 2, 64, DType::Bf16);
    let page = spec.byte_len();
    let dev = Arc::new(HostDevice::new(0, 1 << 20));
    let engine = dev.alloc(3 * page).unwrap();
    let block: Vec<u8> = (0..spec.elements())
        .flat_map(|i| half::bf16::from_f32(((i * 37 % 101) as f32 - 50.0) * 0.37).to_bits().to_le_bytes())
        .collect();
    let mut nan_block = block.clone();
    nan_block[6..8].copy_from_slice(&half::bf16::NAN.to_bits().to_le_bytes());
    dev.write_sync(engine.range(0, page), &block).unwrap();
    dev.write_sync(engine.range(page, page), &nan_block).unwrap();
    let cfg = PoolConfig::new(page).with_capacity(Capacity::Bytes(page)).with_fp8_spill(spec);
    let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
    pool.insert_from_device(&ns(1), &key(1), engine.range(0, page)).unwrap();
    pool.insert_from_device(&ns(1), &key(2), engine.range(page, page)).unwrap();
    pool.insert_from_device(&ns(1), &key(3), engine.range(2 * page, page)).unwrap();
    let got = pool.spill_target().received();
    let want = kvtier_kernels::encode(CodecId::FP8_E4M3, &KvBlockView::new(spec, &block).unwrap()).unwrap();
    assert_eq!(got[0], SpilledBlock { key: (ns(1), key(1)), codec: CodecId::FP8_E4M3, payload: want.clone() });
    assert!(want.len() < page * 3 / 5, "{} of {page}", want.len());
    // The NaN block cannot be quantized: it goes out as the engine's bytes.
    assert_eq!(got[1], SpilledBlock { key: (ns(1), key(2)), codec: CodecId::RAW, payload: nan_block });
    let s = pool.stats();
    assert_eq!((s.spills, s.encoded_spills, s.raw_fallbacks), (2, 1, 1));
    assert_eq!(s.spilled_bytes, (want.len() + page) as u64);
    for bad in [spec.with_dtype(DType::Fp8E4m3), BlockSpec::new(2, 4, 2, 128, DType::Bf16)] {
        let cfg = PoolConfig::new(page).with_capacity(Capacity::Bytes(page)).with_fp8_spill(bad);
        assert!(matches!(PagePool::new(dev.clone(), MemorySpill::default(), cfg), Err(AgentError::Config(_))));
    }
}

#[test]
fn fp8_payloads_are_decoded_on_the_device_on_the_way_in() {
    use kvtier_kernels::KvBlockView;
    let spec = BlockSpec::new(2, 4, 2, 64, DType::Fp16);
    let page = spec.byte_len();
    let block: Vec<u8> = (0..spec.elements())
        .flat_map(|i| half::f16::from_f32(((i * 53 % 97) as f32 - 48.0) * 0.11).to_bits().to_le_bytes())
        .collect();
    let payload = kvtier_kernels::encode(CodecId::FP8_E4M3, &KvBlockView::new(spec, &block).unwrap()).unwrap();
    let want = kvtier_kernels::decode(CodecId::FP8_E4M3, &payload, &spec).unwrap();
    let dev = Arc::new(HostDevice::new(0, 1 << 20));
    let engine = dev.alloc(page).unwrap();
    let staged = HostBuffer::from_vec(payload.clone());
    let _reg = dev.register_host(&staged).unwrap();
    let cfg = PoolConfig::new(page).with_capacity(Capacity::Bytes(2 * page)).with_fp8_spill(spec);
    let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
    pool.insert_encoded_from_host(&ns(1), &key(1), &staged.range(0, payload.len())).unwrap();
    let ev = pool.load_into(&ns(1), &key(1), engine.all()).unwrap().unwrap();
    dev.wait(&ev).unwrap();
    assert_eq!(dev.read_sync(engine.all()).unwrap(), want);
    // A NaN code in the body: refused, nothing kept.
    let mut bad = payload.clone();
    let codes_at = 32 + 4 * spec.rows();
    bad[codes_at + 3] = 0x7F;
    let bad_buf = HostBuffer::from_vec(bad);
    let _reg2 = dev.register_host(&bad_buf).unwrap();
    let r = pool.insert_encoded_from_host(&ns(1), &key(2), &bad_buf.range(0, payload.len()));
    assert!(matches!(r, Err(AgentError::Codec(_))), "{r:?}");
    assert!(!pool.contains(&ns(1), &key(2)));
    // Wrong shape or length: refused before any copy.
    assert!(matches!(
        pool.insert_encoded_from_host(&ns(1), &key(3), &staged.range(0, payload.len() - 1)),
        Err(AgentError::Codec(_))
    ));
    staged.write(6, &[DType::Bf16 as u8]).unwrap();
    assert!(matches!(
        pool.insert_encoded_from_host(&ns(1), &key(3), &staged.range(0, payload.len())),
        Err(AgentError::Codec(_))
    ));
    // Both pages are still usable: the refused inserts gave theirs back.
    assert_eq!(pool.stats().resident, 1);
    pool.insert_from_device(&ns(1), &key(4), engine.all()).unwrap();
    assert_eq!((pool.stats().resident, pool.stats().evictions), (2, 0));
    let plain =
        PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(page).with_capacity(Capacity::Bytes(page)));
    assert!(matches!(
        plain.unwrap().insert_encoded_from_host(&ns(1), &key(1), &staged.range(0, payload.len())),
        Err(AgentError::Config(_))
    ));
}

/// Any codec with a device kernel, not only FP8: an NVFP4+had pool spills exactly the payload
/// the CPU codec writes with the same rotation seed, and decodes such a payload on the way in to
/// what the CPU decoder gives; a codec without a kernel is refused when the pool is built.
#[test]
fn spills_use_the_generic_device_codec_nvfp4_with_rotation_too() {
    use kvtier_kernels::KvBlockView;
    let (codec, seed) = (CodecId::NVFP4_HAD, 0x1234);
    let spec = BlockSpec::new(2, 4, 2, 64, DType::Bf16);
    let page = spec.byte_len();
    let dev = Arc::new(HostDevice::new(0, 1 << 20));
    let engine = dev.alloc(2 * page).unwrap();
    let block: Vec<u8> = (0..spec.elements())
        .flat_map(|i| half::bf16::from_f32(((i * 29 % 89) as f32 - 44.0) * 0.21).to_bits().to_le_bytes())
        .collect();
    dev.write_sync(engine.range(0, page), &block).unwrap();
    let cfg = PoolConfig::new(page).with_capacity(Capacity::Bytes(page)).with_spill_codec(codec, seed, spec);
    let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
    pool.insert_from_device(&ns(1), &key(1), engine.range(0, page)).unwrap();
    pool.insert_from_device(&ns(1), &key(2), engine.range(page, page)).unwrap();
    let want = kvtier_kernels::Codec::new(codec)
        .with_rotation_seed(seed)
        .encode(&KvBlockView::new(spec, &block).unwrap())
        .unwrap();
    let got = pool.spill_target().received();
    assert_eq!(got[0], SpilledBlock { key: (ns(1), key(1)), codec, payload: want.clone() });
    assert!(want.len() < page / 3, "{} of {page}", want.len());
    assert_eq!(pool.stats().encoded_spills, 1);

    let staged = HostBuffer::from_vec(want.clone());
    let _reg = dev.register_host(&staged).unwrap();
    pool.insert_encoded_from_host(&ns(1), &key(3), &staged.range(0, want.len())).unwrap();
    let ev = pool.load_into(&ns(1), &key(3), engine.range(page, page)).unwrap().unwrap();
    dev.wait(&ev).unwrap();
    assert_eq!(dev.read_sync(engine.range(page, page)).unwrap(), kvtier_kernels::decode(codec, &want, &spec).unwrap());

    let lz4 =
        PoolConfig::new(page).with_capacity(Capacity::Bytes(page)).with_spill_codec(CodecId::FP8_E4M3_LZ4, 0, spec);
    let r = PagePool::new(dev.clone(), MemorySpill::default(), lz4);
    assert!(matches!(&r, Err(AgentError::Config(m)) if m.contains("no device kernel")), "{:?}", r.err());
}

struct FailingSpill;

impl Spill for FailingSpill {
    fn spill(&self, _: &NamespaceId, _: &BlockKey, _: CodecId, _: &[u8]) -> Result<()> {
        Err(AgentError::Spill("G2 full".into()))
    }
}

#[test]
fn a_failed_spill_is_counted_and_the_insert_still_succeeds() {
    let dev = Arc::new(HostDevice::new(0, 1 << 20));
    let engine = dev.alloc(2 * PAGE).unwrap();
    let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::Bytes(PAGE));
    let mut pool = PagePool::new(dev.clone(), FailingSpill, cfg).unwrap();
    pool.insert_from_device(&ns(1), &key(1), engine.range(0, PAGE)).unwrap();
    pool.insert_from_device(&ns(1), &key(2), engine.range(PAGE, PAGE)).unwrap();
    let s = pool.stats();
    assert_eq!((s.evictions, s.spill_errors, s.spills, s.resident), (1, 1, 0, 1));
    assert!(pool.contains(&ns(1), &key(2)) && !pool.contains(&ns(1), &key(1)));
}

#[test]
fn a_refused_copy_gives_its_page_back() {
    let mut f = fix(1);
    f.dev.free(f.engine).unwrap();
    let r = f.pool.insert_from_device(&ns(1), &key(1), f.engine.range(0, PAGE));
    assert_eq!(r.err(), Some(AgentError::FreedHandle(f.engine.id())));
    assert_eq!(f.pool.stats().resident, 0);
    let other = f.dev.alloc(PAGE).unwrap();
    f.dev.wait(&f.pool.insert_from_device(&ns(1), &key(2), other.all()).unwrap()).unwrap();
    assert_eq!(f.pool.keys(), vec![(ns(1), key(2))]);
    f.pool.remove(&ns(1), &key(2)).unwrap();
    assert_eq!(f.pool.remove(&ns(1), &key(2)), Err(AgentError::NotResident));
    assert_eq!(f.pool.stats().evictions, 0);
}

#[test]
fn a_reserved_block_is_invisible_until_committed_then_spills_like_an_engine_block() {
    let mut f = fix(2);
    let s = f.dev.new_stream().unwrap();
    let page = f.pool.reserve(&ns(1), &key(1)).unwrap().expect("a fresh key gets a page");
    // Filled in two halves ("layers") on the caller's stream.
    f.dev.copy_d2d(&s, f.engine.range(2 * PAGE, PAGE / 2), page.buf.range(page.offset, PAGE / 2)).unwrap();
    assert!(!f.pool.contains(&ns(1), &key(1)));
    assert_eq!(f.get(1), None, "a load does not see a block still being filled");
    assert_eq!(f.pool.pin(&ns(1), &key(1)), Err(AgentError::NotResident));
    assert_eq!(f.pool.reserve(&ns(1), &key(1)).unwrap(), None, "a second save of the same key copies nothing");
    f.dev.copy_d2d(&s, f.engine.range(2 * PAGE, PAGE / 2), page.buf.range(page.offset + PAGE / 2, PAGE / 2)).unwrap();
    f.dev.wait(&f.dev.record(&s).unwrap()).unwrap();
    // Pinned while filling: two more blocks evict only each other's way, never the reserved one.
    f.put(2, 0);
    assert!(f.pool.reserve(&ns(1), &key(3)).unwrap().is_some());
    assert_eq!(
        f.pool.spill_target().get(&ns(1), &key(2)),
        Some(vec![1; PAGE]),
        "block 2 made room, not the reserved one"
    );
    f.pool.abort(&ns(1), &key(3)).unwrap();
    assert_eq!(f.pool.abort(&ns(1), &key(3)), Err(AgentError::NotResident));
    f.pool.commit(&ns(1), &key(1)).unwrap();
    assert_eq!(f.pool.commit(&ns(1), &key(1)), Err(AgentError::NotResident), "commit once");
    assert_eq!(f.get(1), Some(3));
    assert_eq!(f.pool.stats().resident, 1);
    // Committed blocks are engine blocks: evicting them spills their bytes.
    f.put(4, 3);
    f.put(5, 4);
    assert_eq!(f.pool.spill_target().get(&ns(1), &key(1)), Some(vec![3; PAGE]));
}

#[test]
fn changes_say_what_the_pool_took_in_and_gave_up() {
    let mut f = fix(2);
    let sk = |k: u8| (ns(1), key(k));
    let staged = HostBuffer::from_vec(vec![9u8; PAGE]);
    let _reg = f.dev.register_host(&staged).unwrap();
    f.dev.wait(&f.pool.insert_from_host(&ns(1), &key(1), &staged.range(0, PAGE)).unwrap()).unwrap();
    f.put(2, 1);
    f.put(2, 1); // already held: no change
    let page = f.pool.reserve(&ns(1), &key(3)).unwrap().unwrap(); // evicts 1 (clean: still below)
    assert_eq!(page.len, PAGE);
    let (changes, lost) = f.pool.take_changes();
    assert!(!lost);
    assert_eq!(
        changes,
        [PoolChange::Stored(sk(1)), PoolChange::Stored(sk(2)), PoolChange::Evicted { key: sk(1), below: true }],
        "a reserved block is not reported until committed"
    );
    f.pool.commit(&ns(1), &key(3)).unwrap();
    f.put(4, 3); // evicts 2: spilled, so still below
    f.pool.remove(&ns(1), &key(3)).unwrap(); // forgotten: gone
    let (changes, _) = f.pool.take_changes();
    assert_eq!(
        changes,
        [
            PoolChange::Stored(sk(3)),
            PoolChange::Evicted { key: sk(2), below: true },
            PoolChange::Stored(sk(4)),
            PoolChange::Evicted { key: sk(3), below: false },
        ]
    );
    assert_eq!(f.pool.take_changes(), (vec![], false));
}
