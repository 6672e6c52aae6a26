//! Layer-pipelined load: time from `start_load_kv` to the first layer being usable vs to the last,
//! beside baselines measured in the same run: a CPU `memcpy` of the same bytes (whole, and page by
//! page) and one synchronous whole-buffer copy through the device (`write_sync`: a memcpy on the
//! host backend, `cuMemcpyHtoD` on CUDA). Then saving: compute and save overlapped layer by layer
//! against compute first and save after.
//!
//! `cargo bench -p kvtier-agent --bench layer_pipeline` runs the host backend;
//! `KVTIER_BENCH_DEVICE=cuda cargo bench -p kvtier-agent --features cuda --bench layer_pipeline`
//! runs GPU 0. `LAYERS`, `PAGES` (per layer) and `PAGE_KIB` override the shape (a layer must be
//! a multiple of 512 bytes).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_agent::pipeline::LayerSource;
use kvtier_agent::{fp8_body_len, CodecOp, Device, HostBuffer, HostDevice, LayerPipeline, Transfer};
use kvtier_kernels::BlockSpec;
use kvtier_proto::DType;

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

struct Shape {
    layers: usize,
    pages: usize,
    page: usize,
    runs: usize,
}

fn run<D: Device>(name: &str, dev: Arc<D>, s: &Shape) -> BenchResult<()> {
    let total = s.layers * s.pages * s.page;
    let src: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
    let host = HostBuffer::from_vec(src.clone());
    let _reg = dev.register_host(&host)?;
    let engine = dev.alloc(total)?;
    let pipe = LayerPipeline::new(dev.clone())?;

    let mut dst = vec![0u8; total];
    let memcpy = median(
        (0..s.runs)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(&src);
                std::hint::black_box(&dst);
                t.elapsed()
            })
            .collect(),
    );
    // The same bytes in page-sized pieces: what the load itself does (small copies do not get
    // the non-temporal stores a large memcpy uses, so this is the fair host ceiling).
    let paged = median(
        (0..s.runs)
            .map(|_| {
                let t = Instant::now();
                for (d, c) in dst.chunks_mut(s.page).zip(src.chunks(s.page)) {
                    d.copy_from_slice(c);
                }
                std::hint::black_box(&dst);
                t.elapsed()
            })
            .collect(),
    );
    let mut sync = Vec::new();
    for _ in 0..s.runs {
        let t = Instant::now();
        dev.write_sync(engine.all(), &src)?;
        sync.push(t.elapsed());
    }
    let sync = median(sync);
    dev.write_sync(engine.all(), &vec![0u8; total])?;

    let (mut first, mut last, mut start_call) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..s.runs {
        let plan = (0..s.layers)
            .map(|l| {
                LayerSource::new(
                    (0..s.pages)
                        .map(|p| {
                            let off = (l * s.pages + p) * s.page;
                            Transfer::HostToDevice { src: host.range(off, s.page), dst: engine.range(off, s.page) }
                        })
                        .collect(),
                )
            })
            .collect();
        let t = Instant::now();
        let h = pipe.start_load_kv(plan);
        start_call.push(t.elapsed());
        h.wait_for_layer_load(0)?;
        first.push(t.elapsed());
        h.wait_for_layer_load(s.layers - 1)?;
        last.push(t.elapsed());
        if h.wait_all().iter().any(Result::is_err) {
            return Err("a layer failed".into());
        }
    }
    if dev.read_sync(engine.all())? != src {
        return Err("loaded bytes differ".into());
    }

    // Save: each layer's "forward pass" (a compute-bound kernel on a compute stream — the FP8
    // encoder over a layer-sized bf16 block, standing in for attention) followed by
    // save_kv_layer of that layer, so saving layer l overlaps computing layer l + 1; against
    // computing every layer first and saving after.
    let out = HostBuffer::new(total);
    let _out_reg = dev.register_host(&out)?;
    let layer_bytes = s.pages * s.page;
    let spec = BlockSpec::new(1, (layer_bytes / 512) as u32, 1, 128, DType::Bf16);
    let body_len = fp8_body_len(&spec);
    let status_at = body_len.next_multiple_of(16);
    let block = dev.alloc(spec.byte_len())?;
    let scratch = dev.alloc(status_at + 16)?;
    let bf16: Vec<u8> = (0..spec.elements()).flat_map(|i| (0x3F80u16 + (i % 97) as u16).to_le_bytes()).collect();
    dev.write_sync(block.all(), &bf16)?;
    let compute = dev.new_stream()?;
    let mut pipe = pipe;
    let forward = |l: usize| -> BenchResult<D::Event> {
        let _ = l;
        let op = CodecOp::Fp8Encode {
            spec,
            src: block.all(),
            body: scratch.range(0, body_len),
            status: scratch.range(status_at, 4),
        };
        dev.launch_codec(&compute, &op)?;
        Ok(dev.record(&compute)?)
    };
    let saves = |l: usize| -> Vec<Transfer> {
        (0..s.pages)
            .map(|p| {
                let off = (l * s.pages + p) * s.page;
                Transfer::DeviceToHost { src: engine.range(off, s.page), dst: out.range(off, s.page) }
            })
            .collect()
    };
    let (mut overlapped, mut serial) = (Vec::new(), Vec::new());
    for _ in 0..s.runs {
        let t = Instant::now();
        for l in 0..s.layers {
            let done = forward(l)?;
            pipe.save_kv_layer(l, &saves(l), Some(&done));
        }
        if !pipe.wait_for_save().is_ok() {
            return Err("a save failed".into());
        }
        overlapped.push(t.elapsed());
        let t = Instant::now();
        let mut last = None;
        for l in 0..s.layers {
            last = Some(forward(l)?);
        }
        if let Some(e) = &last {
            dev.wait(e)?;
        }
        for l in 0..s.layers {
            pipe.save_kv_layer(l, &saves(l), None);
        }
        if !pipe.wait_for_save().is_ok() {
            return Err("a save failed".into());
        }
        serial.push(t.elapsed());
    }
    if out.to_vec() != src {
        return Err("saved bytes differ".into());
    }
    dev.free(scratch)?;
    dev.free(block)?;
    dev.free(engine)?;
    let (overlapped, serial) = (median(overlapped), median(serial));
    let (first, last, start_call) = (median(first), median(last), median(start_call));
    let gbs = |d: Duration| total as f64 / d.as_secs_f64() / 1e9;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "layer_pipeline [{name}]: {} layers x {} pages x {} KiB = {} MiB, median of {}",
        s.layers,
        s.pages,
        s.page >> 10,
        total >> 20,
        s.runs
    );
    println!("  CPU memcpy of the same bytes      {:>9.3} ms  {:>7.2} GB/s", ms(memcpy), gbs(memcpy));
    println!("  CPU memcpy, page by page          {:>9.3} ms  {:>7.2} GB/s", ms(paged), gbs(paged));
    println!("  one synchronous device copy       {:>9.3} ms  {:>7.2} GB/s", ms(sync), gbs(sync));
    println!("  start_load_kv returned after      {:>9.3} ms", ms(start_call));
    println!("  first layer usable after          {:>9.3} ms", ms(first));
    println!("  last layer usable after           {:>9.3} ms  {:>7.2} GB/s", ms(last), gbs(last));
    println!(
        "  first / last                      {:>9.3}  (ideal 1/{} = {:.3})",
        first.as_secs_f64() / last.as_secs_f64(),
        s.layers,
        1.0 / s.layers as f64
    );
    println!("  last / synchronous device copy    {:>9.2}", last.as_secs_f64() / sync.as_secs_f64());
    println!("  last / memcpy page by page        {:>9.2}", last.as_secs_f64() / paged.as_secs_f64());
    println!("  compute + save, layer-overlapped  {:>9.3} ms", ms(overlapped));
    println!("  compute, then save                {:>9.3} ms", ms(serial));
    println!("  overlapped / serial               {:>9.2}", overlapped.as_secs_f64() / serial.as_secs_f64());
    Ok(())
}

fn main() -> BenchResult<()> {
    let s = Shape { layers: env("LAYERS", 32), pages: env("PAGES", 16), page: env("PAGE_KIB", 256) << 10, runs: 7 };
    let total = s.layers * s.pages * s.page;
    if std::env::var("KVTIER_BENCH_DEVICE").as_deref() == Ok("cuda") {
        #[cfg(feature = "cuda")]
        return run("cuda:0", Arc::new(kvtier_agent::CudaDevice::new(0)?), &s);
        #[cfg(not(feature = "cuda"))]
        return Err("KVTIER_BENCH_DEVICE=cuda needs --features cuda".into());
    }
    run("host", Arc::new(HostDevice::new(0, total + 3 * (total / s.layers) + (1 << 20))), &s)
}
