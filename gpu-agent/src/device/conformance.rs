//! The [`Device`] contract as generic checks, run against every backend: the host backend in
//! every test run, the CUDA backend in the GPU tests. A backend that passes these meets the same
//! errors and the same bytes as the other.

use kvtier_kernels::{BlockSpec, KvBlockView};
use kvtier_proto::{CodecId, DType};
use rand::{Rng, SeedableRng};

use super::{fp8_body_len, CodecOp, Device};
use crate::{AgentError, HostBuffer};

/// H2D, D2D within and across buffers, D2H: exact bytes, and every refused call names its error.
pub(crate) fn copies_and_errors<D: Device>(dev: &D, other: &D) {
    let s = dev.new_stream().unwrap();
    let h = HostBuffer::from_vec((0..4096u32).map(|i| (i * 7 % 251) as u8).collect());
    let back = HostBuffer::new(4096);
    let _r1 = dev.register_host(&h).unwrap();
    let _r2 = dev.register_host(&back).unwrap();
    assert!(matches!(dev.register_host(&h), Err(AgentError::AlreadyRegistered { .. })));
    let a = dev.alloc(4096).unwrap();
    let b = dev.alloc(4096).unwrap();
    dev.copy_h2d(&s, &h.range(0, 4096), a.all()).unwrap();
    dev.copy_d2d(&s, a.range(0, 2048), b.range(2048, 2048)).unwrap();
    dev.copy_d2d(&s, a.range(2048, 2048), b.range(0, 2048)).unwrap();
    dev.copy_d2d(&s, b.range(0, 16), b.range(100, 16)).unwrap();
    dev.copy_d2h(&s, b.all(), &back.range(0, 4096)).unwrap();
    let ev = dev.record(&s).unwrap();
    dev.wait(&ev).unwrap();
    assert_eq!(dev.query(&ev), Ok(true));
    let src = h.to_vec();
    let mut want: Vec<u8> = src[2048..].iter().chain(&src[..2048]).copied().collect();
    want.copy_within(0..16, 100);
    assert_eq!(back.to_vec(), want);

    assert!(matches!(dev.copy_h2d(&s, &h.range(0, 4097), a.range(0, 4097)), Err(AgentError::OutOfBounds { .. })));
    assert!(matches!(dev.copy_d2h(&s, a.range(4000, 100), &back.range(0, 100)), Err(AgentError::OutOfBounds { .. })));
    assert_eq!(dev.copy_d2d(&s, a.range(0, 8), b.range(0, 9)), Err(AgentError::LengthMismatch { src: 8, dst: 9 }));
    assert_eq!(dev.copy_d2d(&s, a.range(0, 16), a.range(8, 16)), Err(AgentError::Overlap));
    let foreign = other.alloc(64).unwrap();
    let found = other.ordinal();
    assert_eq!(
        dev.copy_d2d(&s, foreign.all(), a.range(0, 64)),
        Err(AgentError::WrongDevice { expected: dev.ordinal(), found })
    );
    let unpinned = HostBuffer::new(64);
    assert!(matches!(dev.copy_h2d(&s, &unpinned.range(0, 64), a.range(0, 64)), Err(AgentError::NotRegistered { .. })));
    dev.free(b).unwrap();
    assert_eq!(dev.copy_d2d(&s, a.range(0, 8), b.range(0, 8)), Err(AgentError::FreedHandle(b.id())));
    assert_eq!(dev.free(b), Err(AgentError::FreedHandle(b.id())));
    let used = dev.mem_info().unwrap();
    assert!(matches!(dev.alloc(used.total + 1), Err(AgentError::OutOfMemory { .. }) | Err(AgentError::Driver { .. })));
    // The refused calls enqueued nothing: the stream is healthy.
    dev.wait(&dev.record(&s).unwrap()).unwrap();
    dev.free(a).unwrap();
    other.free(foreign).unwrap();
}

fn random_block(spec: &BlockSpec, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let row = spec.row_len();
    let mut out = Vec::with_capacity(spec.byte_len());
    for r in 0..spec.rows() {
        // Row magnitudes from 2^-30 to 2^30 (fp16: 2^-12..2^12), some rows zero, some subnormal-ish.
        let span = if spec.dtype == DType::Fp16 { 12 } else { 30 };
        let e = (r as i32 * 7919 % (2 * span + 1)) - span;
        for _ in 0..row {
            let v: f32 = if r % 13 == 5 { 0.0 } else { (rng.random::<f32>() * 2.0 - 1.0) * 2f32.powi(e) };
            match spec.dtype {
                DType::Bf16 => out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
                DType::Fp16 => out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
                _ => out.extend_from_slice(&v.to_le_bytes()),
            }
        }
    }
    out
}

/// FP8 encode and decode on the device give `kvtier_kernels`' bytes exactly, and a NaN row sets
/// the status word.
pub(crate) fn fp8_codec_matches_kvtier_kernels<D: Device>(dev: &D) {
    let s = dev.new_stream().unwrap();
    for (i, (dtype, hd)) in
        [(DType::Bf16, 128u16), (DType::Fp16, 64), (DType::Fp32, 96), (DType::Bf16, 40)].into_iter().enumerate()
    {
        let spec = BlockSpec::new(3, 16, 4, hd, dtype);
        let bytes = random_block(&spec, i as u64 + 1);
        let cpu = kvtier_kernels::encode(CodecId::FP8_E4M3, &KvBlockView::new(spec, &bytes).unwrap()).unwrap();
        let body_len = fp8_body_len(&spec);
        let src = dev.alloc(bytes.len()).unwrap();
        let body = dev.alloc(body_len).unwrap();
        let out = dev.alloc(bytes.len()).unwrap();
        let status = dev.alloc(16).unwrap();
        dev.write_sync(src.all(), &bytes).unwrap();
        dev.launch_codec(
            &s,
            &CodecOp::Fp8Encode { spec, src: src.all(), body: body.all(), status: status.range(0, 4) },
        )
        .unwrap();
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        assert_eq!(dev.read_sync(status.range(0, 4)).unwrap(), [0; 4], "{dtype:?} encode status");
        assert!(dev.read_sync(body.all()).unwrap() == cpu[32..], "{dtype:?} hd {hd}: encoded body differs");
        // Decode the CPU's body on the device.
        dev.write_sync(body.all(), &cpu[32..]).unwrap();
        dev.launch_codec(
            &s,
            &CodecOp::Fp8Decode { spec, body: body.all(), out: out.all(), status: status.range(0, 4) },
        )
        .unwrap();
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        let want = kvtier_kernels::decode(CodecId::FP8_E4M3, &cpu, &spec).unwrap();
        assert_eq!(dev.read_sync(status.range(0, 4)).unwrap(), [0; 4], "{dtype:?} decode status");
        assert!(dev.read_sync(out.all()).unwrap() == want, "{dtype:?} hd {hd}: decoded bytes differ");
        // A NaN in one row: the status word says the body is unusable.
        let mut bad = bytes.clone();
        let es = dtype.size() as usize;
        let nan: Vec<u8> = match dtype {
            DType::Fp32 => f32::NAN.to_le_bytes().to_vec(),
            DType::Fp16 => half::f16::NAN.to_bits().to_le_bytes().to_vec(),
            _ => half::bf16::NAN.to_bits().to_le_bytes().to_vec(),
        };
        bad[5 * es..6 * es].copy_from_slice(&nan);
        dev.write_sync(src.all(), &bad).unwrap();
        dev.launch_codec(
            &s,
            &CodecOp::Fp8Encode { spec, src: src.all(), body: body.all(), status: status.range(0, 4) },
        )
        .unwrap();
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        assert_ne!(dev.read_sync(status.range(0, 4)).unwrap(), [0; 4], "{dtype:?} NaN row not flagged");
        for b in [src, body, out, status] {
            dev.free(b).unwrap();
        }
    }
    // Refused launches: wrong body length, unaligned offset, FP8 input.
    let spec = BlockSpec::new(1, 2, 1, 16, DType::Bf16);
    let buf = dev.alloc(4096).unwrap();
    let op = CodecOp::Fp8Encode { spec, src: buf.range(0, 128), body: buf.range(1024, 10), status: buf.range(2048, 4) };
    assert!(matches!(dev.launch_codec(&s, &op), Err(AgentError::Codec(_))));
    let op = CodecOp::Fp8Encode {
        spec,
        src: buf.range(4, 128),
        body: buf.range(1024, fp8_body_len(&spec)),
        status: buf.range(2048, 4),
    };
    assert!(matches!(dev.launch_codec(&s, &op), Err(AgentError::Codec(_))));
    let op = CodecOp::Fp8Encode {
        spec,
        src: buf.range(0, 128),
        body: buf.range(64, fp8_body_len(&spec)),
        status: buf.range(2048, 4),
    };
    assert_eq!(dev.launch_codec(&s, &op), Err(AgentError::Overlap));
    let spec8 = spec.with_dtype(DType::Fp8E4m3);
    let op = CodecOp::Fp8Encode {
        spec: spec8,
        src: buf.range(0, 64),
        body: buf.range(1024, fp8_body_len(&spec8)),
        status: buf.range(2048, 4),
    };
    assert!(matches!(dev.launch_codec(&s, &op), Err(AgentError::Codec(_))));
    dev.free(buf).unwrap();
}

/// Every codec with a kernel (FP8, FP8+had, NVFP4, NVFP4+had), launched by id: the body is the CPU
/// codec's payload after its header, decoding the CPU's body gives the CPU's bytes, in both memory
/// orders, every dtype and head dims that are and are not multiples of 16 and powers of two. Bad
/// input sets the status word; head dims past the kernels' limit are refused.
pub(crate) fn codecs_by_id_match_kvtier_kernels<D: Device>(dev: &D) {
    use crate::codec::{device_body_len, payload_header, MAX_DEVICE_HEAD_DIM};
    use kvtier_proto::MemoryOrder;
    let s = dev.new_stream().unwrap();
    let codecs = [CodecId::FP8_E4M3, CodecId::FP8_E4M3_HAD, CodecId::NVFP4, CodecId::NVFP4_HAD];
    let shapes = [
        (DType::Bf16, 128u16, MemoryOrder::LayerFirst),
        (DType::Fp16, 64, MemoryOrder::BlockFirst),
        (DType::Fp32, 96, MemoryOrder::LayerFirst),
        (DType::Bf16, 40, MemoryOrder::BlockFirst),
        (DType::Fp16, 576, MemoryOrder::LayerFirst),
    ];
    for (i, (dtype, hd, order)) in shapes.into_iter().enumerate() {
        let mut spec = BlockSpec::new(3, 16, 4, hd, dtype);
        spec.order = order;
        let bytes = random_block(&spec, i as u64 + 11);
        for codec in codecs {
            let seed = 0x4B56 ^ i as u16;
            let cpu = kvtier_kernels::Codec::new(codec)
                .with_rotation_seed(seed)
                .encode(&KvBlockView::new(spec, &bytes).unwrap())
                .unwrap();
            assert_eq!(&cpu[..32], &payload_header(codec, &spec, seed).unwrap()[..]);
            let body_len = device_body_len(codec, &spec).unwrap();
            let (src, body, out, status) = (
                dev.alloc(bytes.len()).unwrap(),
                dev.alloc(body_len).unwrap(),
                dev.alloc(bytes.len()).unwrap(),
                dev.alloc(16).unwrap(),
            );
            dev.write_sync(src.all(), &bytes).unwrap();
            let st = status.range(0, 4);
            let enc =
                CodecOp::Encode { codec, rotation_seed: seed, spec, src: src.all(), body: body.all(), status: st };
            dev.launch_codec(&s, &enc).unwrap();
            dev.wait(&dev.record(&s).unwrap()).unwrap();
            let what = format!("{} {dtype:?} hd {hd} {order:?}", codec.name());
            assert_eq!(dev.read_sync(st).unwrap(), [0; 4], "{what}: encode status");
            assert!(dev.read_sync(body.all()).unwrap() == cpu[32..], "{what}: encoded body differs");
            dev.write_sync(body.all(), &cpu[32..]).unwrap();
            let dec =
                CodecOp::Decode { codec, rotation_seed: seed, spec, body: body.all(), out: out.all(), status: st };
            dev.launch_codec(&s, &dec).unwrap();
            dev.wait(&dev.record(&s).unwrap()).unwrap();
            let want = kvtier_kernels::decode(codec, &cpu, &spec).unwrap();
            assert_eq!(dev.read_sync(st).unwrap(), [0; 4], "{what}: decode status");
            assert!(dev.read_sync(out.all()).unwrap() == want, "{what}: decoded bytes differ");
            // An infinity in one row: flagged by every codec.
            let mut bad = bytes.clone();
            let es = dtype.size() as usize;
            let inf: Vec<u8> = match dtype {
                DType::Fp32 => f32::INFINITY.to_le_bytes().to_vec(),
                DType::Fp16 => half::f16::INFINITY.to_bits().to_le_bytes().to_vec(),
                _ => half::bf16::INFINITY.to_bits().to_le_bytes().to_vec(),
            };
            bad[7 * es..8 * es].copy_from_slice(&inf);
            dev.write_sync(src.all(), &bad).unwrap();
            dev.launch_codec(&s, &enc).unwrap();
            dev.wait(&dev.record(&s).unwrap()).unwrap();
            assert_ne!(dev.read_sync(st).unwrap(), [0; 4], "{what}: Inf not flagged");
            for b in [src, body, out, status] {
                dev.free(b).unwrap();
            }
        }
    }
    // Refused: a codec without a kernel, a head dim past the limit, a wrong body length.
    let buf = dev.alloc(1 << 20).unwrap();
    let spec = BlockSpec::new(1, 1, 1, 16, DType::Bf16);
    let op = |codec, spec: BlockSpec, body_len| CodecOp::Encode {
        codec,
        rotation_seed: 0,
        spec,
        src: buf.range(0, spec.byte_len()),
        body: buf.range(1 << 19, body_len),
        status: buf.range((1 << 20) - 16, 4),
    };
    let lz4 = op(CodecId::NVFP4_LZ4, spec, 64);
    assert!(matches!(dev.launch_codec(&s, &lz4), Err(AgentError::Codec(m)) if m.contains("no device kernel")));
    let wide = BlockSpec::new(1, 1, 1, (MAX_DEVICE_HEAD_DIM + 16) as u16, DType::Bf16);
    let too_wide = op(CodecId::NVFP4, wide, device_body_len(CodecId::NVFP4, &wide).unwrap());
    assert!(matches!(dev.launch_codec(&s, &too_wide), Err(AgentError::Codec(m)) if m.contains("head_dim")));
    let short = op(CodecId::NVFP4_HAD, spec, device_body_len(CodecId::NVFP4_HAD, &spec).unwrap() - 1);
    assert!(matches!(dev.launch_codec(&s, &short), Err(AgentError::Codec(m)) if m.contains("body")));
    dev.free(buf).unwrap();
}
