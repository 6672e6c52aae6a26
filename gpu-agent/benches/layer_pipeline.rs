//! Layer-pipelined load on the host backend: time from `start_load_kv` to the first layer being
//! usable vs to the last, beside a plain `memcpy` of the same bytes measured in the same run (the
//! limit of this machine). Run with `cargo bench -p kvtier-agent --bench layer_pipeline`;
//! `LAYERS`, `PAGES` (per layer) and `PAGE_KIB` override the shape.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_agent::pipeline::LayerSource;
use kvtier_agent::{Device, HostBuffer, HostDevice, LayerPipeline, Transfer};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let layers = env("LAYERS", 32);
    let pages = env("PAGES", 16);
    let page = env("PAGE_KIB", 256) << 10;
    let total = layers * pages * page;
    let runs = 7;

    let dev = Arc::new(HostDevice::new(0, total + (1 << 20)));
    let host = HostBuffer::from_vec((0..total).map(|i| (i % 251) as u8).collect());
    let _reg = dev.register_host(&host)?;
    let engine = dev.alloc(total)?;
    let pipe = LayerPipeline::new(dev.clone())?;

    // Baseline: one memcpy of the same bytes, same thread count as a stream (one).
    let src = host.to_vec();
    let mut dst = vec![0u8; total];
    let memcpy = median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(&src);
                std::hint::black_box(&dst);
                t.elapsed()
            })
            .collect(),
    );

    let (mut first, mut last, mut start_call) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let plan = (0..layers)
            .map(|l| {
                LayerSource::new(
                    (0..pages)
                        .map(|p| {
                            let off = (l * pages + p) * page;
                            Transfer::HostToDevice { src: host.range(off, page), dst: engine.range(off, page) }
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
        h.wait_for_layer_load(layers - 1)?;
        last.push(t.elapsed());
        if h.wait_all().iter().any(Result::is_err) {
            return Err("a layer failed".into());
        }
    }
    if dev.read_sync(engine.all())? != src {
        return Err("loaded bytes differ".into());
    }
    let (first, last, start_call) = (median(first), median(last), median(start_call));
    let gbs = |d: Duration| total as f64 / d.as_secs_f64() / 1e9;
    println!("layer_pipeline: {layers} layers x {pages} pages x {} KiB = {} MiB, host backend, median of {runs}", page >> 10, total >> 20);
    println!("  memcpy baseline (same bytes)   {:>9.2} ms  {:>6.2} GB/s", memcpy.as_secs_f64() * 1e3, gbs(memcpy));
    println!("  start_load_kv returned after   {:>9.3} ms", start_call.as_secs_f64() * 1e3);
    println!("  first layer usable after       {:>9.3} ms", first.as_secs_f64() * 1e3);
    println!("  last layer usable after        {:>9.2} ms  {:>6.2} GB/s", last.as_secs_f64() * 1e3, gbs(last));
    println!("  first / last                   {:>9.3}  (ideal 1/{layers} = {:.3})", first.as_secs_f64() / last.as_secs_f64(), 1.0 / layers as f64);
    println!("  last / memcpy                  {:>9.2}", last.as_secs_f64() / memcpy.as_secs_f64());
    Ok(())
}
