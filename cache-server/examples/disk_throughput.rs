//! Measures the disk tier's write and read throughput and its restart (recovery) time on a
//! directory, for comparison with `fio` on the same directory, and what the disk codec
//! (re-encoding demoted blocks) costs per byte of KV and saves on disk:
//! `cargo run --release -p kvtier-server --example disk_throughput -- DIR [MiB]`.

use std::time::Instant;

use bytes::Bytes;
use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, KvLayout, NamespaceId};
use kvtier_server::disk::recode::{recode, Recoded};
use kvtier_server::disk::{DiskConfig, DiskTier};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().ok_or("usage: disk_throughput DIR [MiB]")?);
    let mib: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let layout = KvLayout::new(32, 8, 128, DType::Bf16, 8); // 1 MiB blocks
    let cfg =
        DiskConfig { dir: dir.clone(), capacity_bytes: (mib + 256) << 20, segment_bytes: 64 << 20, sync_writes: false };
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
    let (tier, report) = DiskTier::open(cfg.clone())?;
    let recovery = t.elapsed();
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
    let t = Instant::now();
    for f in &frames {
        let (_, p) = tier.read(&f.header.namespace, &f.header.key).ok_or("block missing")?;
        assert_eq!(p.len(), f.payload.len());
    }
    let read = (mib << 20) as f64 / t.elapsed().as_secs_f64() / 1e9;
    drop(tier);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let (dw, dr) = direct_io(&dir, mib)?;
    let mw = mmap_write(&dir, mib)?;
    let _ = std::fs::remove_dir_all(&dir);
    let codecs = [CodecId::RAW, CodecId::RAW_LZ4, CodecId::FP8_E4M3_HAD, CodecId::NVFP4_HAD_LZ4];
    let mut recoded = Vec::new();
    for codec in codecs {
        recoded.push((codec, recode_write(&cfg, layout, mib.min(256), codec)?));
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!("{mib} MiB in 1 MiB blocks on {}:", dir.display());
    println!(
        "  disk tier (buffered pwrite, 4 KiB-aligned records): write+fsync {write:.2} GB/s, cold read {read:.2} GB/s"
    );
    println!(
        "  O_DIRECT pwrite/pread of aligned 1 MiB buffers:       write+fsync {dw:.2} GB/s, cold read {dr:.2} GB/s"
    );
    println!("  mmap + memcpy + msync:                                 write {mw:.2} GB/s");
    println!(
        "  restart: recovered {} blocks / {} bytes in {:?} ({} discarded)",
        report.blocks, report.bytes, recovery, report.discarded
    );
    println!("  disk codec on demotion ({} MiB of bf16 KV, re-encode + write + fsync, GB/s of KV in):", mib.min(256));
    let base = recoded[0].1 .0;
    for (codec, (gbps, ratio)) in recoded {
        println!("    {:<16} {gbps:.2} GB/s ({:.2}x of raw), on disk {ratio:.3} of the KV", codec.name(), gbps / base);
    }
    Ok(())
}

/// Writes `mib` MiB of bf16 KV (Gaussian-like, as attention KV is) through `recode` into a fresh
/// disk tier, as the demotion thread does: (GB/s of KV in, bytes on disk / bytes of KV).
fn recode_write(
    cfg: &DiskConfig,
    layout: KvLayout,
    mib: u64,
    codec: CodecId,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let _ = std::fs::remove_dir_all(&cfg.dir);
    std::fs::create_dir_all(&cfg.dir)?;
    let (tier, _) = DiskTier::open(cfg.clone())?;
    let mut uniform = kvtier_kernels::__testing::uniform_source(0x2545_f491_4f6c_dd1d);
    let frames: Vec<BlockFrame> = (0..mib)
        .map(|i| {
            let payload: Vec<u8> = (0..1u64 << 19)
                .flat_map(|_| {
                    half::bf16::from_f32((uniform() + uniform() + uniform() - 1.5) * 2.0).to_bits().to_le_bytes()
                })
                .collect();
            let key = BlockKey(*blake3::hash(&(i + 1_000_000).to_le_bytes()).as_bytes());
            BlockFrame::new(NamespaceId([1; 16]), key, layout, CodecId::RAW, 8, Bytes::from(payload))
        })
        .collect();
    let t = Instant::now();
    let mut on_disk = 0u64;
    for f in &frames {
        let (h, p) = match recode(codec, &f.header, &f.payload) {
            Recoded::Encoded(h, p) => (h, p),
            Recoded::Kept => (f.header, f.payload.clone()),
            Recoded::Refused(why) => return Err(why.into()),
        };
        on_disk += p.len() as u64;
        tier.write(&h, &p)?;
    }
    tier.sync()?;
    let gbps = (mib << 20) as f64 / t.elapsed().as_secs_f64() / 1e9;
    Ok((gbps, on_disk as f64 / (mib << 20) as f64))
}

/// A 4 KiB-aligned window of a plain buffer, as O_DIRECT needs (no unsafe allocation).
fn aligned(buf: &mut [u8], len: usize) -> &mut [u8] {
    let off = buf.as_ptr().align_offset(4096);
    &mut buf[off..off + len]
}

const O_DIRECT: i32 = 0o40000; // Linux x86_64

fn direct_io(dir: &std::path::Path, mib: u64) -> std::io::Result<(f64, f64)> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let path = dir.join("direct.bin");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .custom_flags(O_DIRECT)
        .open(&path)?;
    let mut raw = vec![7u8; (1 << 20) + 4096];
    let buf = aligned(&mut raw, 1 << 20);
    let t = Instant::now();
    for i in 0..mib {
        f.write_all_at(buf, i << 20)?;
    }
    f.sync_data()?;
    let w = (mib << 20) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    for i in 0..mib {
        f.read_exact_at(buf, i << 20)?;
    }
    let r = (mib << 20) as f64 / t.elapsed().as_secs_f64() / 1e9;
    Ok((w, r))
}

fn mmap_write(dir: &std::path::Path, mib: u64) -> std::io::Result<f64> {
    let path = dir.join("mmap.bin");
    let f = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path)?;
    f.set_len(mib << 20)?;
    // SAFETY: the file was just created by this process and nothing else maps or truncates it.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&f)? };
    let src = vec![9u8; 1 << 20];
    let t = Instant::now();
    for chunk in map.chunks_mut(1 << 20) {
        chunk.copy_from_slice(&src[..chunk.len()]);
    }
    map.flush()?;
    Ok((mib << 20) as f64 / t.elapsed().as_secs_f64() / 1e9)
}
