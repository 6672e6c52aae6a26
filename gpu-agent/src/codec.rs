//! The codecs on the device: FP8 E4M3 with one scale per row, NVFP4, and the rotated (`+had`)
//! forms of both, as CUDA C compiled at run time by NVRTC (no nvcc at build time), and the payload
//! header the CPU puts in front of a device-encoded body so that the result is byte for byte
//! `kvtier_kernels::encode(codec, ..)`.
//!
//! The kernels follow `kvtier_kernels`' scalar reference exactly (its `codec` module doc has the
//! rules):
//!
//! - FP8: per row `s = canonical(fl(amax / 448), 20 bits)` (0 when amax < 2^-100),
//!   `code = e4m3(fl(x / s))` with a true IEEE division (`__fdiv_rn`, never a reciprocal) and
//!   round-to-nearest-even saturating E4M3; decoding `fl(e4m3(code) · s)` (`__fmul_rn`, no FMA
//!   contraction).
//! - NVFP4: per plane `g = canonical(fl(amax / 2688), 18 bits)`, `enc = fl(2688 / amax)`; per
//!   16-element micro-block `bs = e4m3(fl(fl(amax_b / 6) · enc))`, `d = fl(e4m3(bs) · g)`,
//!   `code = e2m1(fl(x · fl(1 / d)))`; decoding `fl(e2m1(code) · d)`. The plane amax needs the
//!   whole plane first: one kernel takes each row's amax into its plane's scale word
//!   (`atomicMax` on the bits), a second writes block scales and codes, a third turns the amax
//!   words into global scales.
//! - `+had`: every row is multiplied by `s_i · fl(1/sqrt(n))` (SplitMix64 signs from the seed,
//!   power-of-two chunks of `head_dim`), then the Walsh–Hadamard butterflies run stage by stage
//!   (`h = 1, 2, 4, …`) in shared memory; decoding runs the butterflies on the dequantized f32
//!   values, then multiplies by the same factors and rounds once into the output dtype.
//!
//! Output is stored as bf16 (round to nearest even), fp16 (saturated to ±65504, then `cvt.rn`) or
//! f32. fp16 conversions are PTX `cvt`, so no header is needed. The source is plain strings in
//! every build, split so that the arithmetic ([`CUDA_HELPERS_SRC`]) also compiles as C: a test
//! runs it with the system C compiler against `kvtier_kernels` byte for byte. Compiling and
//! launching the kernels needs the `cuda` feature and a GPU (`crate::device::cuda`).

use kvtier_kernels::{BlockSpec, Format, Fp8ScaleMode, PayloadInfo};
use kvtier_proto::{CodecId, DType};

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

/// The element types every part of the CUDA source uses.
pub const CUDA_TYPES_SRC: &str = r#"
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

"#;

/// Device-only pieces the helpers use: fp16 conversions as PTX `cvt` and the warp barrier
/// `KV_SYNC()` (the C check of the helpers replaces them with `_Float16` conversions, which round
/// the same way, and nothing).
pub const CUDA_F16_SRC: &str = r#"
#define KV_SYNC() __syncwarp()

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

"#;

/// The arithmetic of every codec kernel, one element, micro-block or row at a time: plain C
/// apart from the CUDA intrinsic names, so that a test compiles it with the system C compiler
/// (intrinsics defined as the IEEE operations they are) and checks it byte for byte against
/// `kvtier_kernels`. Row helpers take `(lane, lanes)` and a `KV_SYNC()` between dependent steps:
/// a warp calls them with `(lane, 32)`, the C check with `(0, 1)`; every step they split across
/// lanes is independent per element, so both give the same bytes.
pub const CUDA_HELPERS_SRC: &str = r#"
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

// kvtier_kernels::formats::e2m1_from_f32: round to nearest even, saturate to +-6; sign in bit 3.
__device__ __forceinline__ u8 kv_e2m1_from_f32(float x) {
    u32 bits = __float_as_uint(x);
    u8 sign = (u8)((bits >> 28) & 0x8u);
    float a = __uint_as_float(bits & 0x7FFFFFFFu);
    u32 code = (u32)(a > 0.25f) + (u32)(a >= 0.75f) + (u32)(a > 1.25f) + (u32)(a >= 1.75f)
        + (u32)(a > 2.5f) + (u32)(a >= 3.5f) + (u32)(a > 5.0f);
    return sign | (u8)code;
}

// kvtier_kernels::formats::e2m1_to_f32 (exact), the low 4 bits of `c`.
__device__ __forceinline__ float kv_e2m1_to_f32(u8 c) {
    u32 m = c & 7u;
    float mag = m == 0u ? 0.0f : m == 1u ? 0.5f : m == 2u ? 1.0f : m == 3u ? 1.5f
        : m == 4u ? 2.0f : m == 5u ? 3.0f : m == 6u ? 4.0f : 6.0f;
    return (c & 8u) ? -mag : mag;
}

// kvtier_kernels::formats::canonical_scale: round a finite scale up to (24 - drop) significant bits.
__device__ __forceinline__ float kv_canonical(float s, u32 drop) {
    u32 b = __float_as_uint(s);
    u32 mask = (1u << drop) - 1u;
    if ((b & mask) == 0u || (b & 0x7F800000u) == 0x7F800000u) return s;
    return __uint_as_float((b | mask) + 1u);
}

// An NVFP4 plane's global decode scale canonical(fl(amax / 2688), 18 bits); 0 below 2^-100.
__device__ __forceinline__ float kv_nvfp4_global(u32 amax_bits) {
    if (amax_bits < 0x0D800000u) return 0.0f;
    return kv_canonical(__fdiv_rn(__uint_as_float(amax_bits), 2688.0f), 6u);
}

// An NVFP4 plane's encode factor fl(2688 / amax); 0 below 2^-100.
__device__ __forceinline__ float kv_nvfp4_enc(u32 amax_bits) {
    if (amax_bits < 0x0D800000u) return 0.0f;
    return __fdiv_rn(2688.0f, __uint_as_float(amax_bits));
}

// One micro-block of n (1..16) f32 values: returns its E4M3 block scale code
// e4m3(fl(fl(amax_b / 6) * enc)) and writes ceil(n / 2) code bytes e2m1(fl(x * fl(1 / d))) with
// d = fl(e4m3(bs) * g), element 2j in the low nibble (kvtier_kernels' scalar nvfp4_encode_block).
__device__ __forceinline__ u8 kv_nvfp4_encode_block(const float* x, u32 n, float g, float enc, u8* codes) {
    u32 m = 0u;
    for (u32 i = 0u; i < n; i++) {
        u32 b = __float_as_uint(x[i]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    u8 bs = kv_e4m3_from_f32(__fmul_rn(__fdiv_rn(__uint_as_float(m), 6.0f), enc));
    float d = __fmul_rn(kv_e4m3_to_f32(bs), g);
    float inv = d == 0.0f ? 0.0f : __fdiv_rn(1.0f, d);
    for (u32 j = 0u; 2u * j < n; j++) {
        u8 b = kv_e2m1_from_f32(__fmul_rn(x[2u * j], inv));
        if (2u * j + 1u < n) b |= (u8)(kv_e2m1_from_f32(__fmul_rn(x[2u * j + 1u], inv)) << 4);
        codes[j] = b;
    }
    return bs;
}

// Element i of an NVFP4 row: fl(e2m1(code) * fl(e4m3(bs) * g)); *bad |= a block scale the encoder
// never writes (NaN or negative).
__device__ __forceinline__ float kv_nvfp4_value(const u8* bs, const u8* codes, u32 i, float g, u32* bad) {
    u8 s = bs[i >> 4];
    *bad |= (u32)(s >= 0x7Fu);
    float d = __fmul_rn(kv_e4m3_to_f32(s), g);
    u8 c = (u8)((codes[i >> 1] >> (4u * (i & 1u))) & 0xFu);
    return __fmul_rn(kv_e2m1_to_f32(c), d);
}

// The plane (2 * layer + K|V) of row r: layer-first [layer][k|v][token][head], block-first
// [token][layer][k|v][head].
__device__ __forceinline__ u32 kv_plane_of_row(u64 r, u32 tokens, u32 heads, u32 planes, u32 block_first) {
    if (block_first) return (u32)((r / heads) % planes);
    return (u32)(r / ((u64)tokens * heads));
}

// The rotation chunk (power of two, largest first: the binary digits of hd) holding channel i.
__device__ __forceinline__ void kv_chunk_of(u32 i, u32 hd, u32* off, u32* n) {
    u32 o = 0u;
    for (int b = 15; b >= 0; b--) {
        u32 p = 1u << b;
        if (hd & p) {
            if (i < o + p) { *off = o; *n = p; return; }
            o += p;
        }
    }
    *off = o; *n = 1u;
}

// Channel i's rotation factor s_i * fl(1 / sqrt(n)) (kvtier_kernels::rotation): s_i = -1 where bit
// i % 64 of the (i / 64)-th SplitMix64 output from state `seed` is set.
__device__ __forceinline__ float kv_rot_mul(u32 i, u32 hd, u32 seed) {
    u32 off, n;
    kv_chunk_of(i, hd, &off, &n);
    u64 z = (u64)seed + (u64)(i / 64u + 1u) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    float c = __fdiv_rn(1.0f, __fsqrt_rn((float)n));
    return ((z >> (i % 64u)) & 1ull) ? -c : c;
}

// The unnormalized Walsh-Hadamard butterflies of every chunk of a row in place: stages h = 1, 2, 4,
// ..., each pair (x[j], x[j + h]) -> (x[j] + x[j + h], x[j] - x[j + h]).
__device__ __forceinline__ void kv_fwht_row(float* x, u32 hd, u32 lane, u32 lanes) {
    u32 off = 0u;
    for (int b = 15; b >= 0; b--) {
        u32 n = 1u << b;
        if (!(hd & n)) continue;
        for (u32 h = 1u; h < n; h <<= 1) {
            KV_SYNC();
            for (u32 p = lane; p < n / 2u; p += lanes) {
                u32 j = off + (p / h) * 2u * h + (p % h);
                float a = x[j], c = x[j + h];
                x[j] = __fadd_rn(a, c);
                x[j + h] = __fsub_rn(a, c);
            }
        }
        off += n;
    }
    KV_SYNC();
}

// Loads a source row into x as f32, multiplied by the rotation factors when `rotate`
// (then rotated by kv_fwht_row). Returns this lane's "refuse" flag: a NaN or Inf, or (rotating) a
// value beyond 2^100, which the rotated codecs refuse.
__device__ __forceinline__ u32 kv_load_row(float* x, const u8* src, u32 hd, int dtype, u32 rotate, u32 seed, u32 lane, u32 lanes) {
    u32 bad = 0u;
    u32 limit = rotate ? 0x71800000u : 0x7F7FFFFFu;
    for (u32 i = lane; i < hd; i += lanes) {
        float v = kv_load(src, i, dtype);
        bad |= (u32)((__float_as_uint(v) & 0x7FFFFFFFu) > limit);
        x[i] = rotate ? __fmul_rn(v, kv_rot_mul(i, hd, seed)) : v;
    }
    return bad;
}

// This lane's share of a row's amax, as f32 bits.
__device__ __forceinline__ u32 kv_row_amax_bits(const float* x, u32 hd, u32 lane, u32 lanes) {
    u32 m = 0u;
    for (u32 i = lane; i < hd; i += lanes) {
        u32 b = __float_as_uint(x[i]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    return m;
}

// Block scales and codes of an NVFP4 row of f32 values: one micro-block per lane at a time.
__device__ __forceinline__ void kv_nvfp4_encode_row(const float* x, u32 hd, float g, float enc, u8* bs, u8* codes, u32 lane, u32 lanes) {
    for (u32 b = lane; 16u * b < hd; b += lanes) {
        u32 n = hd - 16u * b < 16u ? hd - 16u * b : 16u;
        bs[b] = kv_nvfp4_encode_block(x + 16u * b, n, g, enc, codes + 8u * b);
    }
}

// The inverse rotation of a row of decoded f32 values in x, stored into dst as dtype:
// butterflies, then one product by the rotation factor per element, rounded once.
__device__ __forceinline__ void kv_unrotate_store(float* x, u8* dst, u32 hd, int dtype, u32 seed, u32 lane, u32 lanes) {
    kv_fwht_row(x, hd, lane, lanes);
    for (u32 i = lane; i < hd; i += lanes) kv_store(dst, i, dtype, __fmul_rn(x[i], kv_rot_mul(i, hd, seed)));
}

"#;

/// The FP8 per-row kernels. Launch: grid `ceil(rows / 8)`, block 256 (8 warps, one row per warp);
/// `status` is zeroed before the launch and ORed with 1 by any row that cannot be coded.
pub const FP8_CUDA_SRC: &str = r#"
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

/// The FP8 `+had` and NVFP4 (plain and `+had`) kernels: [`QUANT_KERNELS`] names them. Same launch
/// shape as the FP8 ones, plus `8 * head_dim * 4` bytes of dynamic shared memory.
pub const QUANT_CUDA_SRC: &str = r#"
// The rotated and NVFP4 kernels. One warp per row, 8 rows per block of 256 threads; each warp
// stages its row as f32 in dynamic shared memory (8 * hd floats per block). Warps return whole
// (a row's lanes share `row`), so the warp-wide syncs and shuffles below see all 32 lanes.
#define KV_FULL 0xFFFFFFFFu

__device__ __forceinline__ u32 kv_warp_max(u32 m) {
    for (int off = 16; off > 0; off >>= 1) {
        u32 o = __shfl_xor_sync(KV_FULL, m, off);
        m = o > m ? o : m;
    }
    return m;
}

// FP8 per (token, head) of rotated rows: body = rows f32 scales, then rows * hd codes.
extern "C" __global__ void kvtier_fp8_had_encode_rows(const u8* src, u8* body, u32* status, u32 rows, u32 hd, int dtype, u32 seed) {
    extern __shared__ float kv_smem[];
    u32 lane = threadIdx.x & 31u;
    u64 row = (u64)blockIdx.x * 8u + (threadIdx.x >> 5);
    if (row >= rows) return;
    float* x = kv_smem + (u64)(threadIdx.x >> 5) * hd;
    u32 es = dtype == 2 ? 4u : 2u;
    u32 bad = kv_load_row(x, src + row * hd * es, hd, dtype, 1u, seed, lane, 32u);
    if (__any_sync(KV_FULL, bad)) {
        if (lane == 0u) atomicOr(status, 1u);
        return;
    }
    kv_fwht_row(x, hd, lane, 32u);
    u32 m = kv_warp_max(kv_row_amax_bits(x, hd, lane, 32u));
    float s = kv_fp8_scale(m);
    if (lane == 0u) ((float*)body)[row] = s;
    float div = s == 0.0f ? 1.0f : s;
    u8* codes = body + (u64)rows * 4u + row * hd;
    for (u32 i = lane; i < hd; i += 32u) codes[i] = kv_e4m3_from_f32(__fdiv_rn(x[i], div));
}

extern "C" __global__ void kvtier_fp8_had_decode_rows(const u8* body, u8* out, u32* status, u32 rows, u32 hd, int dtype, u32 seed) {
    extern __shared__ float kv_smem[];
    u32 lane = threadIdx.x & 31u;
    u64 row = (u64)blockIdx.x * 8u + (threadIdx.x >> 5);
    if (row >= rows) return;
    float* x = kv_smem + (u64)(threadIdx.x >> 5) * hd;
    float s = ((const float*)body)[row];
    u32 bad = (u32)(!(s >= 0.0f) || s == __uint_as_float(0x7F800000u));
    const u8* codes = body + (u64)rows * 4u + row * hd;
    for (u32 i = lane; i < hd; i += 32u) {
        u8 c = codes[i];
        bad |= (u32)((c & 0x7Fu) == 0x7Fu);
        x[i] = __fmul_rn(kv_e4m3_to_f32(c), s);
        // Decoded (still rotated) values beyond 2^110 mark a payload the encoder never wrote.
        bad |= (u32)((__float_as_uint(x[i]) & 0x7FFFFFFFu) > 0x76800000u);
    }
    if (__any_sync(KV_FULL, bad)) {
        if (lane == 0u) atomicOr(status, 1u);
        return;
    }
    u32 es = dtype == 2 ? 4u : 2u;
    kv_unrotate_store(x, out + row * hd * es, hd, dtype, seed, lane, 32u);
}

// NVFP4 pass 1: each row's amax (of its rotated values when `rotate`) into its plane's word of
// `plane_amax` (the body's scale words, zeroed before), as f32 bits.
extern "C" __global__ void kvtier_nvfp4_amax_rows(const u8* src, u32* plane_amax, u32* status, u32 rows, u32 hd, int dtype, u32 rotate, u32 seed, u32 tokens, u32 heads, u32 block_first) {
    extern __shared__ float kv_smem[];
    u32 lane = threadIdx.x & 31u;
    u64 row = (u64)blockIdx.x * 8u + (threadIdx.x >> 5);
    if (row >= rows) return;
    float* x = kv_smem + (u64)(threadIdx.x >> 5) * hd;
    u32 es = dtype == 2 ? 4u : 2u;
    u32 planes = (u32)(rows / ((u64)tokens * heads));
    u32 bad = kv_load_row(x, src + row * hd * es, hd, dtype, rotate, seed, lane, 32u);
    if (__any_sync(KV_FULL, bad)) {
        if (lane == 0u) atomicOr(status, 1u);
        return;
    }
    if (rotate) kv_fwht_row(x, hd, lane, 32u);
    u32 m = kv_warp_max(kv_row_amax_bits(x, hd, lane, 32u));
    if (lane == 0u) atomicMax(plane_amax + kv_plane_of_row(row, tokens, heads, planes, block_first), m);
}

// NVFP4 pass 2: block scales and codes of every row from its plane's amax (pass 1).
extern "C" __global__ void kvtier_nvfp4_encode_rows(const u8* src, u8* body, u32 rows, u32 hd, int dtype, u32 rotate, u32 seed, u32 tokens, u32 heads, u32 block_first) {
    extern __shared__ float kv_smem[];
    u32 lane = threadIdx.x & 31u;
    u64 row = (u64)blockIdx.x * 8u + (threadIdx.x >> 5);
    if (row >= rows) return;
    float* x = kv_smem + (u64)(threadIdx.x >> 5) * hd;
    u32 es = dtype == 2 ? 4u : 2u;
    u32 planes = (u32)(rows / ((u64)tokens * heads));
    kv_load_row(x, src + row * hd * es, hd, dtype, rotate, seed, lane, 32u);
    if (rotate) kv_fwht_row(x, hd, lane, 32u);
    else __syncwarp();
    u32 amax = ((const u32*)body)[kv_plane_of_row(row, tokens, heads, planes, block_first)];
    u32 nb = (hd + 15u) / 16u, cb = (hd + 1u) / 2u;
    u8* bs = body + (u64)planes * 4u + row * nb;
    u8* codes = body + (u64)planes * 4u + (u64)rows * nb + row * cb;
    kv_nvfp4_encode_row(x, hd, kv_nvfp4_global(amax), kv_nvfp4_enc(amax), bs, codes, lane, 32u);
}

// NVFP4 pass 3: each plane's amax word becomes its global decode scale.
extern "C" __global__ void kvtier_nvfp4_globals(u32* scales, u32 planes) {
    u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < planes) scales[p] = __float_as_uint(kv_nvfp4_global(scales[p]));
}

extern "C" __global__ void kvtier_nvfp4_decode_rows(const u8* body, u8* out, u32* status, u32 rows, u32 hd, int dtype, u32 rotate, u32 seed, u32 tokens, u32 heads, u32 block_first) {
    extern __shared__ float kv_smem[];
    u32 lane = threadIdx.x & 31u;
    u64 row = (u64)blockIdx.x * 8u + (threadIdx.x >> 5);
    if (row >= rows) return;
    float* x = kv_smem + (u64)(threadIdx.x >> 5) * hd;
    u32 planes = (u32)(rows / ((u64)tokens * heads));
    float g = ((const float*)body)[kv_plane_of_row(row, tokens, heads, planes, block_first)];
    u32 bad = (u32)(!(g >= 0.0f) || g == __uint_as_float(0x7F800000u));
    u32 nb = (hd + 15u) / 16u, cb = (hd + 1u) / 2u;
    const u8* bs = body + (u64)planes * 4u + row * nb;
    const u8* codes = body + (u64)planes * 4u + (u64)rows * nb + row * cb;
    u32 es = dtype == 2 ? 4u : 2u;
    u8* dst = out + row * hd * es;
    for (u32 i = lane; i < hd; i += 32u) {
        float v = kv_nvfp4_value(bs, codes, i, g, &bad);
        if (rotate) {
            x[i] = v;
            bad |= (u32)((__float_as_uint(v) & 0x7FFFFFFFu) > 0x76800000u);
        } else {
            kv_store(dst, i, dtype, v);
        }
    }
    if (__any_sync(KV_FULL, bad)) {
        if (lane == 0u) atomicOr(status, 1u);
        return;
    }
    if (rotate) kv_unrotate_store(x, dst, hd, dtype, seed, lane, 32u);
}
"#;

/// The whole NVRTC program: types, device-only pieces, helpers, then every kernel.
pub fn cuda_source() -> String {
    [CUDA_TYPES_SRC, CUDA_F16_SRC, CUDA_HELPERS_SRC, FP8_CUDA_SRC, QUANT_CUDA_SRC].concat()
}

/// The FP8 `+had` and NVFP4 kernel entry points in [`QUANT_CUDA_SRC`].
pub const QUANT_KERNELS: [&str; 6] = [
    "kvtier_fp8_had_encode_rows",
    "kvtier_fp8_had_decode_rows",
    "kvtier_nvfp4_amax_rows",
    "kvtier_nvfp4_encode_rows",
    "kvtier_nvfp4_globals",
    "kvtier_nvfp4_decode_rows",
];

/// The largest `head_dim` the NVFP4 and `+had` kernels take (a warp stages its row in shared
/// memory: 8 rows of 1024 f32 are 32 KiB per block). Both backends refuse larger ones; the
/// caller codes those blocks on the CPU.
pub const MAX_DEVICE_HEAD_DIM: usize = 1024;

/// Whether the device kernels implement `codec` (FP8 per (token, head), NVFP4, and their `+had`
/// forms; the `+lz4` forms compress on the CPU, raw needs no kernel).
pub fn device_codec(codec: CodecId) -> bool {
    matches!(codec, CodecId::FP8_E4M3 | CodecId::FP8_E4M3_HAD | CodecId::NVFP4 | CodecId::NVFP4_HAD)
}

/// The payload description of a device codec's output for `spec` (`None` for codecs without a
/// kernel).
fn device_payload_info(codec: CodecId, spec: &BlockSpec, rotation_seed: u16) -> Option<PayloadInfo> {
    if !device_codec(codec) {
        return None;
    }
    let format = if matches!(codec, CodecId::NVFP4 | CodecId::NVFP4_HAD) { Format::Nvfp4 } else { Format::Fp8E4m3 };
    let mut info = PayloadInfo {
        format,
        lz4: false,
        spec: *spec,
        fp8_scales: Fp8ScaleMode::PerTokenHead,
        rotation_seed: kvtier_kernels::is_rotated(codec).then_some(rotation_seed),
        body_len: 0,
    };
    info.body_len = info.sections().total() as u64;
    Some(info)
}

/// Bytes of a device codec's body for `spec` (the payload after its 32-byte header).
pub fn device_body_len(codec: CodecId, spec: &BlockSpec) -> Option<usize> {
    device_payload_info(codec, spec, 0).map(|i| i.body_len as usize)
}

/// The 32-byte `kvtier_kernels` payload header of a device codec's payload of `spec` (see
/// `kvtier_kernels::payload`): in front of the body the kernels write it makes the payload
/// `kvtier_kernels` writes for the same codec and rotation seed.
pub fn payload_header(codec: CodecId, spec: &BlockSpec, rotation_seed: u16) -> Option<Vec<u8>> {
    let info = device_payload_info(codec, spec, rotation_seed)?;
    let mut h = Vec::with_capacity(32);
    h.extend_from_slice(b"KVQ1");
    h.push(if info.format == Format::Nvfp4 { 2 } else { 1 });
    h.push(if info.rotation_seed.is_some() { 2 } else { 0 }); // flags: rotated, no LZ4
    h.push(spec.dtype as u8);
    h.push(spec.order as u8);
    h.push(0); // FP8 scales per (token, head); 0 for NVFP4
    match info.rotation_seed {
        Some(seed) => {
            h.push(kvtier_kernels::payload::ROTATION_SCHEME_HADAMARD);
            h.extend_from_slice(&seed.to_le_bytes());
        }
        None => h.extend_from_slice(&[0; 3]),
    }
    h.extend_from_slice(&spec.layers.to_le_bytes());
    h.extend_from_slice(&spec.kv_heads.to_le_bytes());
    h.extend_from_slice(&spec.head_dim.to_le_bytes());
    h.extend_from_slice(&info.rotation_seed.map_or(0, |seed| !seed).to_le_bytes());
    h.extend_from_slice(&spec.tokens.to_le_bytes());
    h.extend_from_slice(&info.body_len.to_le_bytes());
    Some(h)
}

#[cfg(test)]
mod c_reference;

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::MemoryOrder;

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
        let src = cuda_source();
        for k in [FP8_ENCODE_KERNEL, FP8_DECODE_KERNEL].iter().chain(&QUANT_KERNELS) {
            assert_eq!(src.matches(&format!("extern \"C\" __global__ void {k}(")).count(), 1, "{k}");
        }
        for fast in ["__fdividef", "__expf", "__frcp", "__fmaf", "rsqrtf", "-use_fast_math", "#include"] {
            assert!(!src.contains(fast), "{fast}");
        }
        // The helpers are plain C apart from the intrinsics the C check defines.
        for device_only in ["__global__", "__shfl", "__syncwarp", "atomic", "threadIdx", "asm("] {
            assert!(!CUDA_HELPERS_SRC.contains(device_only), "{device_only}");
        }
        assert_eq!(src.matches('{').count(), src.matches('}').count());
        assert_eq!(kernel_dtype(DType::Fp8E4m3), None);
    }

    #[test]
    fn device_headers_match_the_cpu_codec() {
        for codec in [CodecId::FP8_E4M3, CodecId::FP8_E4M3_HAD, CodecId::NVFP4, CodecId::NVFP4_HAD] {
            for (dtype, order, hd) in [
                (DType::Bf16, MemoryOrder::LayerFirst, 24),
                (DType::Fp16, MemoryOrder::BlockFirst, 17),
                (DType::Fp32, MemoryOrder::LayerFirst, 64),
            ] {
                let mut spec = BlockSpec::new(2, 3, 2, hd, dtype);
                spec.order = order;
                let bytes = vec![0x11u8; spec.byte_len()];
                let view = kvtier_kernels::KvBlockView::new(spec, &bytes).unwrap();
                let payload = kvtier_kernels::Codec::new(codec).with_rotation_seed(0x1234).encode(&view).unwrap();
                assert_eq!(&payload[..32], &payload_header(codec, &spec, 0x1234).unwrap()[..], "{codec:?} {dtype:?}");
                assert_eq!(payload.len(), 32 + device_body_len(codec, &spec).unwrap());
            }
        }
        assert!(payload_header(CodecId::NVFP4_LZ4, &BlockSpec::new(1, 1, 1, 16, DType::Bf16), 0).is_none());
        assert!(!device_codec(CodecId::RAW));
    }
}
