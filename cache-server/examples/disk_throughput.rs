//! Measures the disk tier's write and read throughput and its restart (recovery) time on a
//! directory, for comparison with `fio` on the same directory:
//! `cargo run --release -p kvtier-server --example disk_throughput -- DIR [MiB]`.

use std::time::Instant;

use bytes::Bytes;
use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, KvLayout, NamespaceId};
use kvtier_server::disk::{DiskConfig, DiskTier};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().ok_or("usage: disk_throughput DIR [MiB]")?);
    let mib: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let layout = KvLayout::new(32, 8, 128, DType::Bf16, 8); // 1 MiB blocks
    let cfg = DiskConfig { dir: dir.clone(), capacity_bytes: (mib + 256) << 20, segment_bytes: 64 << 20, sync_writes: false };
    let (tier, _) = DiskTier::open(cfg.clone())?;
    let frames: Vec<BlockFrame> = (0..mib)
        .map(|i| {
            let payload: Vec<u8> = (0..1u64 << 20).map(|j| (j ^ i) as u8).collect();
            let key = BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes());
            BlockFrame::new(NamespaceId([1; 16]), key, layout, CodecId::RAW, 8, Bytes::from(payload))
        })
        .collect();
    let t = Instant::now();
    for f in &frames {
        tier.write(&f.header, &f.payload)?;
    }
    tier.sync()?;
    let write = (mib << 20) as f64 / t.elapsed().as_secs_f64() / 1e9;
    drop(tier);
    // Drop the page cache's copy where we may (root only), so reads and recovery hit the disk.
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
    let t = Instant::now();
    let (tier, report) = DiskTier::open(cfg)?;
    let recovery = t.elapsed();
    let t = Instant::now();
    for f in &frames {
        let (_, p) = tier.read(&f.header.namespace, &f.header.key).ok_or("block missing")?;
        assert_eq!(p.len(), f.payload.len());
    }
    let read = (mib << 20) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("disk tier, {mib} MiB of 1 MiB blocks: write+fsync {write:.2} GB/s, read {read:.2} GB/s (page cache warm after recovery scan)");
    println!("restart: recovered {} blocks / {} bytes in {:?} ({} discarded)", report.blocks, report.bytes, recovery, report.discarded);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
