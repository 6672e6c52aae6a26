//! Layer-pipelined load: time from `start_load_kv` to the first layer being usable vs to the last,
//! beside two baselines measured in the same run: a CPU `memcpy` of the same bytes and one
//! synchronous whole-buffer copy through the device (`write_sync`: a memcpy on the host backend,
//! `cuMemcpyHtoD` on CUDA).
//!
//! `cargo bench -p kvtier-agent --bench layer_pipeline` runs the host backend;
//! `KVTIER_BENCH_DEVICE=cuda cargo bench -p kvtier-agent --features cuda --bench layer_pipeline`
//! runs GPU 0. `LAYERS`, `PAGES` (per layer) and `PAGE_KIB` override the shape.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_agent::pipeline::LayerSource;
use kvtier_agent::{Device, HostBuffer, HostDevice, LayerPipeline, Transfer};

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
    dev.free(engine)?;
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
    run("host", Arc::new(HostDevice::new(0, total + (1 << 20))), &s)
}
