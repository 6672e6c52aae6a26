//! The GPU figures `scripts/gpu-check` prints (feature `cuda`, a GPU needed): pinned host↔device
//! copies through the [`Device`] seam beside a bare synchronous `cuMemcpyHtoD`/`cuMemcpyDtoH` of
//! the same pinned bytes (the limit), every codec kernel's throughput beside a device-to-device
//! memcpy of the same bytes, and whether each kernel's bytes equal `kvtier_kernels`'. Every figure
//! is the median of several timed runs after a warm-up, with its baseline measured in the same run.

use std::time::{Duration, Instant};

use cudarc::driver::sys;
use kvtier_kernels::{BlockSpec, Codec, KvBlockView};
use kvtier_proto::{CodecId, DType};

use super::CudaDevice;
use crate::codec::{device_body_len, payload_header};
use crate::device::{CodecOp, Device, HostBuffer};
use crate::error::{AgentError, Result};

const RUNS: usize = 7;

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Times `f` (which must finish its work before returning): the median of [`RUNS`] after one
/// warm-up.
fn time(mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    f()?;
    let mut ts = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed());
    }
    Ok(median(ts))
}

/// One line per figure, for the GPU check's output.
pub fn gpu_report(ordinal: u32, copy_bytes: usize) -> Result<Vec<String>> {
    let dev = CudaDevice::new(ordinal)?;
    let mut lines = vec![format!("device {ordinal}: {}", dev.name()?)];
    let s = dev.new_stream()?;
    let host = HostBuffer::from_vec((0..copy_bytes).map(|i| (i * 131 % 251) as u8).collect());
    let _pinned = dev.register_host(&host)?;
    let buf = dev.alloc(copy_bytes)?;
    let d = dev.range_ptr(&buf.all(), "report")?;
    let h2d = time(|| {
        dev.copy_h2d(&s, &host.range(0, copy_bytes), buf.all())?;
        dev.wait(&dev.record(&s)?)
    })?;
    let h2d_limit = time(|| {
        dev.bind()?;
        // SAFETY: `d` is `copy_bytes` bytes of a live allocation; the host range is the pinned
        // buffer of the same length, alive for the call.
        unsafe { sys::cuMemcpyHtoD_v2(d, host.addr() as *const _, copy_bytes) }
            .result()
            .map_err(super::driver("cuMemcpyHtoD"))
    })?;
    let d2h = time(|| {
        dev.copy_d2h(&s, buf.all(), &host.range(0, copy_bytes))?;
        dev.wait(&dev.record(&s)?)
    })?;
    let d2h_limit = time(|| {
        dev.bind()?;
        // SAFETY: as above, device to host into the pinned buffer.
        unsafe { sys::cuMemcpyDtoH_v2(host.addr() as *mut _, d, copy_bytes) }
            .result()
            .map_err(super::driver("cuMemcpyDtoH"))
    })?;
    let mib = copy_bytes >> 20;
    for (what, t, limit) in [("pinned H2D", h2d, h2d_limit), ("pinned D2H", d2h, d2h_limit)] {
        lines.push(format!(
            "{what} {mib} MiB: {:.1} GB/s through Device, cuMemcpy {:.1} GB/s (ratio {:.2})",
            gbps(copy_bytes, t),
            gbps(copy_bytes, limit),
            limit.as_secs_f64() / t.as_secs_f64()
        ));
    }
    dev.free(buf)?;

    // Codec kernels on a 64 MiB bf16 block (32 layers, 64 tokens, 8 heads of 128).
    let spec = BlockSpec::new(32, 64, 8, 128, DType::Bf16);
    let n = spec.elements();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..n)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0;
            // bf16 by truncation (any bit pattern is a valid input).
            ((v.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect();
    let src = dev.alloc(bytes.len())?;
    let out = dev.alloc(bytes.len())?;
    let status = dev.alloc(16)?;
    dev.write_sync(src.all(), &bytes)?;
    let memcpy = time(|| {
        dev.copy_d2d(&s, src.all(), out.all())?;
        dev.wait(&dev.record(&s)?)
    })?;
    lines.push(format!(
        "device memcpy {} MiB: {:.1} GB/s (the codecs' baseline)",
        bytes.len() >> 20,
        gbps(bytes.len(), memcpy)
    ));
    for codec in [CodecId::FP8_E4M3, CodecId::FP8_E4M3_HAD, CodecId::NVFP4, CodecId::NVFP4_HAD] {
        let seed = kvtier_kernels::DEFAULT_ROTATION_SEED;
        let body_len = device_body_len(codec, &spec).ok_or_else(|| AgentError::Codec("no body length".into()))?;
        let body = dev.alloc(body_len)?;
        let st = status.range(0, 4);
        let enc = CodecOp::Encode { codec, rotation_seed: seed, spec, src: src.all(), body: body.all(), status: st };
        let dec = CodecOp::Decode { codec, rotation_seed: seed, spec, body: body.all(), out: out.all(), status: st };
        let t_enc = time(|| {
            dev.launch_codec(&s, &enc)?;
            dev.wait(&dev.record(&s)?)
        })?;
        let device_body = dev.read_sync(body.all())?;
        let cpu = Codec::new(codec).with_rotation_seed(seed).encode(&KvBlockView::new(spec, &bytes)?)?;
        let enc_equal = device_body == cpu[32..];
        let t_dec = time(|| {
            dev.launch_codec(&s, &dec)?;
            dev.wait(&dev.record(&s)?)
        })?;
        let status_ok = dev.read_sync(st)? == [0; 4];
        let mut payload = payload_header(codec, &spec, seed).ok_or_else(|| AgentError::Codec("no header".into()))?;
        payload.extend_from_slice(&device_body);
        let dec_equal = dev.read_sync(out.all())? == Codec::new(codec).decode(&payload, &spec)?;
        lines.push(format!(
            "{}: encode {:.1} GB/s ({:.2}x memcpy), decode {:.1} GB/s ({:.2}x memcpy), status {}, bytes equal to kvtier-kernels: encode {}, decode {}",
            codec.name(),
            gbps(bytes.len(), t_enc),
            memcpy.as_secs_f64() / t_enc.as_secs_f64(),
            gbps(bytes.len(), t_dec),
            memcpy.as_secs_f64() / t_dec.as_secs_f64(),
            if status_ok { "ok" } else { "SET" },
            if enc_equal { "yes" } else { "NO" },
            if dec_equal { "yes" } else { "NO" },
        ));
        dev.free(body)?;
    }
    for b in [src, out, status] {
        dev.free(b)?;
    }
    // The sync copies above ran outside any stream: make sure nothing is left.
    dev.inner.ctx.synchronize().map_err(super::driver("cuCtxSynchronize"))?;
    Ok(lines)
}
