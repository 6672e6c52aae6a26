//! The codec on the device: FP8 E4M3 with one scale per row, as CUDA C compiled at run time by
//! NVRTC (no nvcc at build time), and the payload header the CPU puts in front of a device-encoded
//! body so that the result is byte for byte `kvtier_kernels::encode(CodecId::FP8_E4M3, ..)`.
//!
//! The kernels follow `kvtier_kernels`' scalar reference exactly (its `codec` module doc has the
//! rules): per row `s = canonical(fl(amax / 448), 20 bits)` (0 when amax < 2^-100),
//! `code = e4m3(fl(x / s))` with a true IEEE division (`__fdiv_rn`, never a reciprocal) and
//! round-to-nearest-even saturating E4M3; decoding `fl(e4m3(code) · s)` (`__fmul_rn`, no FMA
//! contraction), stored as bf16 (round to nearest even), fp16 (saturated to ±65504, then
//! `cvt.rn`) or f32. fp16 conversions are PTX `cvt`, so no header is needed. The source is a
//! plain string in every build; only compiling and launching it needs the `cuda` feature and a
//! GPU (`crate::device::cuda`). NVFP4 and the rotated codecs are not ported yet.

use kvtier_kernels::BlockSpec;
use kvtier_proto::DType;

use crate::device::fp8_body_len;

/// The two kernel entry points in [`FP8_CUDA_SRC`].
pub const FP8_ENCODE_KERNEL: &str = "kvtier_fp8_encode_rows";
pub const FP8_DECODE_KERNEL: &str = "kvtier_fp8_decode_rows";

/// Rows per thread block of the kernels (one warp per row).
pub const FP8_ROWS_PER_BLOCK: u32 = 8;

/// Offsets of codec ranges must be multiples of this (the kernels read elements and scales as
/// aligned words). Both backends refuse other offsets.
pub const CODEC_ALIGN: usize = 16;

/// The kernels' dtype argument.
pub fn kernel_dtype(dtype: DType) -> Option<i32> {
    match dtype {
        DType::Bf16 => Some(0),
        DType::Fp16 => Some(1),
        DType::Fp32 => Some(2),
        DType::Fp8E4m3 => None,
    }
}

/// CUDA C for NVRTC. Launch: grid `ceil(rows / 8)`, block 256 (8 warps, one row per warp);
/// `status` is zeroed before the launch and ORed with 1 by any row that cannot be coded.
pub const FP8_CUDA_SRC: &str = r#"
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

// kvtier_kernels::formats::e4m3_from_f32: round to nearest even, saturate to +-448, NaN -> 0x7F.
__device__ __forceinline__ u8 kv_e4m3_from_f32(float x) {
    u32 bits = __float_as_uint(x);
    u8 sign = (u8)((bits >> 24) & 0x80u);
    u32 ab = bits & 0x7FFFFFFFu;
    float a = __uint_as_float(ab);
    if (ab > 0x7F800000u) return sign | 0x7Fu;
    if (a >= 448.0f) return sign | 0x7Eu;
    if (a < 0.015625f) return sign | (u8)rintf(__fmul_rn(a, 512.0f));
    u32 r = (ab + 0x7FFFFu + ((ab >> 20) & 1u)) >> 20;
    return sign | (u8)(r - ((127u - 7u) << 3));
}

// kvtier_kernels::formats::e4m3_to_f32 (exact).
__device__ __forceinline__ float kv_e4m3_to_f32(u8 c) {
    u32 e = (c >> 3) & 0xFu, m = c & 7u;
    float mag;
    if (e == 0xFu && m == 7u) mag = __uint_as_float(0x7FC00000u);
    else if (e == 0u) mag = __fmul_rn((float)m, 0.001953125f);
    else mag = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ float kv_h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 kv_f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// dtype: 0 bf16, 1 fp16, 2 fp32.
__device__ __forceinline__ float kv_load(const u8* src, u64 i, int dtype) {
    if (dtype == 0) return __uint_as_float(((u32)((const u16*)src)[i]) << 16);
    if (dtype == 1) return kv_h2f(((const u16*)src)[i]);
    return ((const float*)src)[i];
}

__device__ __forceinline__ void kv_store(u8* dst, u64 i, int dtype, float v) {
    if (dtype == 0) {
        u32 b = __float_as_uint(v);
        ((u16*)dst)[i] = (u16)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    } else if (dtype == 1) {
        ((u16*)dst)[i] = kv_f2h(fminf(fmaxf(v, -65504.0f), 65504.0f));
    } else {
        ((float*)dst)[i] = v;
    }
}

// canonical(fl(amax / 448), 20 bits); 0 below 2^-100.
__device__ __forceinline__ float kv_fp8_scale(u32 amax_bits) {
    if (amax_bits < 0x0D800000u) return 0.0f;
    u32 b = __float_as_uint(__fdiv_rn(__uint_as_float(amax_bits), 448.0f));
    const u32 mask = (1u << 4) - 1u;
    if ((b & mask) != 0u) b = (b | mask) + 1u;
    return __uint_as_float(b);
}

// body = rows f32 scales, then rows * hd codes.
extern "C" __global__ void kvtier_fp8_encode_rows(const u8* src, u8* body, u32* status, u32 rows, u32 hd, int dtype) {
    u64 row = (u64)blockIdx.x * 8u + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31u;
    if (row >= rows) return;
    const u8* rsrc = src + row * hd * (dtype == 2 ? 4u : 2u);
    u32 m = 0u;
    for (u32 i = lane; i < hd; i += 32u) {
        u32 b = __float_as_uint(kv_load(rsrc, i, dtype)) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    for (int off = 16; off > 0; off >>= 1) {
        u32 o = __shfl_xor_sync(0xFFFFFFFFu, m, off);
        m = o > m ? o : m;
    }
    if (m >= 0x7F800000u) {
        if (lane == 0u) atomicOr(status, 1u);
        return;
    }
    float s = kv_fp8_scale(m);
    if (lane == 0u) ((float*)body)[row] = s;
    float div = s == 0.0f ? 1.0f : s;
    u8* codes = body + (u64)rows * 4u + row * hd;
    for (u32 i = lane; i < hd; i += 32u) {
        codes[i] = kv_e4m3_from_f32(__fdiv_rn(kv_load(rsrc, i, dtype), div));
    }
}

extern "C" __global__ void kvtier_fp8_decode_rows(const u8* body, u8* out, u32* status, u32 rows, u32 hd, int dtype) {
    u64 row = (u64)blockIdx.x * 8u + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31u;
    if (row >= rows) return;
    float s = ((const float*)body)[row];
    if (!(s >= 0.0f) || s == __uint_as_float(0x7F800000u)) {
        if (lane == 0u) atomicOr(status, 1u);
        return;
    }
    const u8* codes = body + (u64)rows * 4u + row * hd;
    u8* rout = out + row * hd * (dtype == 2 ? 4u : 2u);
    u32 bad = 0u;
    for (u32 i = lane; i < hd; i += 32u) {
        u8 c = codes[i];
        bad |= (c & 0x7Fu) == 0x7Fu;
        kv_store(rout, i, dtype, __fmul_rn(kv_e4m3_to_f32(c), s));
    }
    if (bad) atomicOr(status, 1u);
}
"#;

/// The 32-byte `kvtier_kernels` payload header of an FP8 per-row payload of `spec` (see
/// `kvtier_kernels::payload`): put in front of a device-encoded body it makes the payload
/// `kvtier_kernels::encode` writes, and in front of a device-bound body it lets the CPU decoder read
/// it.
pub fn fp8_payload_header(spec: &BlockSpec) -> Vec<u8> {
    let mut h = Vec::with_capacity(32);
    h.extend_from_slice(b"KVQ1");
    h.push(1); // format: fp8-e4m3
    h.push(0); // flags: no LZ4, not rotated
    h.push(spec.dtype as u8);
    h.push(spec.order as u8);
    h.push(0); // FP8 scales per (token, head)
    h.extend_from_slice(&[0; 3]); // no rotation scheme, no seed
    h.extend_from_slice(&spec.layers.to_le_bytes());
    h.extend_from_slice(&spec.kv_heads.to_le_bytes());
    h.extend_from_slice(&spec.head_dim.to_le_bytes());
    h.extend_from_slice(&[0; 2]); // no seed check
    h.extend_from_slice(&spec.tokens.to_le_bytes());
    h.extend_from_slice(&(fp8_body_len(spec) as u64).to_le_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::{CodecId, MemoryOrder};

    #[test]
    fn header_matches_the_cpu_codec() {
        for (dtype, order) in [
            (DType::Bf16, MemoryOrder::LayerFirst),
            (DType::Fp16, MemoryOrder::BlockFirst),
            (DType::Fp32, MemoryOrder::LayerFirst),
        ] {
            let mut spec = BlockSpec::new(3, 5, 2, 24, dtype);
            spec.order = order;
            let bytes = vec![0x11u8; spec.byte_len()];
            let payload =
                kvtier_kernels::encode(CodecId::FP8_E4M3, &kvtier_kernels::KvBlockView::new(spec, &bytes).unwrap())
                    .unwrap();
            assert_eq!(&payload[..32], &fp8_payload_header(&spec)[..], "{dtype:?} {order:?}");
            assert_eq!(payload.len(), 32 + fp8_body_len(&spec));
        }
    }

    /// What can be checked without a GPU: the source is in the build, names both entry points
    /// with C linkage, and uses only correctly rounded arithmetic (no fast-math intrinsics).
    #[test]
    fn cuda_source_has_the_entry_points_and_no_fast_math() {
        for k in [FP8_ENCODE_KERNEL, FP8_DECODE_KERNEL] {
            assert!(FP8_CUDA_SRC.contains(&format!("extern \"C\" __global__ void {k}(")), "{k}");
        }
        for fast in ["__fdividef", "__expf", "__frcp", "-use_fast_math", "#include"] {
            assert!(!FP8_CUDA_SRC.contains(fast), "{fast}");
        }
        assert_eq!(FP8_CUDA_SRC.matches('{').count(), FP8_CUDA_SRC.matches('}').count());
        assert_eq!(kernel_dtype(DType::Fp8E4m3), None);
    }
}
