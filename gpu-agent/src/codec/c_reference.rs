//! The device codecs' arithmetic checked without a GPU: [`super::CUDA_HELPERS_SRC`] — every helper
//! the kernels call, row helpers included — compiled as C with the system compiler (CUDA's
//! correctly rounded intrinsics defined as the IEEE operations they name, no FMA contraction, fp16
//! through `_Float16`), driven row by row in the kernels' order of passes, and compared byte for
//! byte with `kvtier_kernels` on edge cases and random rows, in both directions, for FP8, FP8+had,
//! NVFP4 and NVFP4+had, every dtype and both memory orders. What this cannot check is the launch
//! itself (warps, shuffles, atomics): the ignored GPU test does that on a device.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use half::f16;
use kvtier_kernels::{BlockSpec, Codec, KvBlockView};
use kvtier_proto::{CodecId, DType, MemoryOrder};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{kernel_dtype, CUDA_HELPERS_SRC, CUDA_TYPES_SRC};

const PRELUDE: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#define __device__
#define __forceinline__ static inline
#define KV_SYNC()
"#;

const INTRINSICS: &str = r#"
static inline u32 __float_as_uint(float f) { u32 u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float kv_h2f(u16 h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline u16 kv_f2h(float f) { _Float16 x = (_Float16)f; u16 h; memcpy(&h, &x, 2); return h; }
"#;

/// The kernels' passes, one row at a time with `(lane, lanes) = (0, 1)`. Exit status 3: the
/// kernels would set `status` (input refused or payload corrupt).
const DRIVER: &str = r#"
int main(int argc, char** argv) {
    if (argc != 10) return 2;
    const char* op = argv[1];
    int dtype = atoi(argv[2]);
    u32 hd = (u32)atoi(argv[3]), layers = (u32)atoi(argv[4]), tokens = (u32)atoi(argv[5]);
    u32 heads = (u32)atoi(argv[6]), block_first = (u32)atoi(argv[7]), seed = (u32)atoi(argv[8]);
    u32 rotate = (u32)atoi(argv[9]);
    u32 planes = 2u * layers;
    u64 rows = (u64)planes * tokens * heads;
    u32 es = dtype == 2 ? 4u : 2u;
    u32 nb = (hd + 15u) / 16u, cb = (hd + 1u) / 2u;
    size_t cap = 1 << 26, n = 0;
    u8* in = malloc(cap);
    size_t got;
    while ((got = fread(in + n, 1, cap - n, stdin)) > 0) n += got;
    float* x = malloc(hd * 4);
    u8* out;
    size_t out_len;
    if (!strcmp(op, "fp8_enc")) {
        out_len = rows * 4 + rows * hd;
        out = calloc(out_len, 1);
        for (u64 r = 0; r < rows; r++) {
            if (kv_load_row(x, in + r * hd * es, hd, dtype, rotate, seed, 0u, 1u)) return 3;
            if (rotate) kv_fwht_row(x, hd, 0u, 1u);
            float s = kv_fp8_scale(kv_row_amax_bits(x, hd, 0u, 1u));
            memcpy(out + r * 4, &s, 4);
            float div = s == 0.0f ? 1.0f : s;
            for (u32 i = 0; i < hd; i++) out[rows * 4 + r * hd + i] = kv_e4m3_from_f32(__fdiv_rn(x[i], div));
        }
    } else if (!strcmp(op, "nvfp4_enc")) {
        out_len = planes * 4 + rows * nb + rows * cb;
        out = calloc(out_len, 1);
        u32* amax = (u32*)out;
        for (u64 r = 0; r < rows; r++) {
            if (kv_load_row(x, in + r * hd * es, hd, dtype, rotate, seed, 0u, 1u)) return 3;
            if (rotate) kv_fwht_row(x, hd, 0u, 1u);
            u32 m = kv_row_amax_bits(x, hd, 0u, 1u);
            u32 p = kv_plane_of_row(r, tokens, heads, planes, block_first);
            if (m > amax[p]) amax[p] = m;
        }
        for (u64 r = 0; r < rows; r++) {
            kv_load_row(x, in + r * hd * es, hd, dtype, rotate, seed, 0u, 1u);
            if (rotate) kv_fwht_row(x, hd, 0u, 1u);
            u32 a = amax[kv_plane_of_row(r, tokens, heads, planes, block_first)];
            kv_nvfp4_encode_row(x, hd, kv_nvfp4_global(a), kv_nvfp4_enc(a), out + planes * 4 + r * nb,
                out + planes * 4 + rows * nb + r * cb, 0u, 1u);
        }
        for (u32 p = 0; p < planes; p++) amax[p] = __float_as_uint(kv_nvfp4_global(amax[p]));
    } else if (!strcmp(op, "fp8_dec")) {
        out_len = rows * hd * es;
        out = calloc(out_len, 1);
        for (u64 r = 0; r < rows; r++) {
            float s;
            memcpy(&s, in + r * 4, 4);
            u32 bad = (u32)(!(s >= 0.0f) || s == __uint_as_float(0x7F800000u));
            for (u32 i = 0; i < hd; i++) {
                u8 c = in[rows * 4 + r * hd + i];
                bad |= (u32)((c & 0x7Fu) == 0x7Fu);
                x[i] = __fmul_rn(kv_e4m3_to_f32(c), s);
                if (rotate) bad |= (u32)((__float_as_uint(x[i]) & 0x7FFFFFFFu) > 0x76800000u);
            }
            if (bad) return 3;
            if (rotate) kv_unrotate_store(x, out + r * hd * es, hd, dtype, seed, 0u, 1u);
            else for (u32 i = 0; i < hd; i++) kv_store(out + r * hd * es, i, dtype, x[i]);
        }
    } else if (!strcmp(op, "nvfp4_dec")) {
        out_len = rows * hd * es;
        out = calloc(out_len, 1);
        for (u64 r = 0; r < rows; r++) {
            float g;
            memcpy(&g, in + 4 * kv_plane_of_row(r, tokens, heads, planes, block_first), 4);
            u32 bad = (u32)(!(g >= 0.0f) || g == __uint_as_float(0x7F800000u));
            for (u32 i = 0; i < hd; i++) {
                x[i] = kv_nvfp4_value(in + planes * 4 + r * nb, in + planes * 4 + rows * nb + r * cb, i, g, &bad);
                if (rotate) bad |= (u32)((__float_as_uint(x[i]) & 0x7FFFFFFFu) > 0x76800000u);
            }
            if (bad) return 3;
            if (rotate) kv_unrotate_store(x, out + r * hd * es, hd, dtype, seed, 0u, 1u);
            else for (u32 i = 0; i < hd; i++) kv_store(out + r * hd * es, i, dtype, x[i]);
        }
    } else {
        return 2;
    }
    fwrite(out, 1, out_len, stdout);
    return 0;
}
"#;

/// The C compiler's flags for the driver.
const CC_FLAGS: [&str; 6] = ["-std=gnu11", "-O1", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Werror"];

/// Compiles the helpers and the driver once per source text and flags: in a folder beside the
/// test binary (the build's own, not a shared temporary one) named by their hash, reused by
/// later runs; each process builds into its own file and renames it into place.
fn driver() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let text = [PRELUDE, CUDA_TYPES_SRC, INTRINSICS, CUDA_HELPERS_SRC, DRIVER].concat();
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&(&text, CC_FLAGS), &mut h);
        let exe = std::env::current_exe().unwrap();
        let beside = exe.parent().map_or_else(std::env::temp_dir, PathBuf::from);
        let dir = beside.join(format!("kvtier-agent-cref-{:016x}", std::hash::Hasher::finish(&h)));
        let bin = dir.join("helpers");
        if bin.exists() {
            return bin;
        }
        std::fs::create_dir_all(&dir).unwrap();
        let pid = std::process::id();
        let (src, built) = (dir.join(format!("helpers-{pid}.c")), dir.join(format!("helpers-{pid}")));
        std::fs::write(&src, text).unwrap();
        let out = Command::new("cc")
            .args(CC_FLAGS)
            .arg("-o")
            .arg(&built)
            .arg(&src)
            .arg("-lm")
            .output()
            .expect("the C check needs the system C compiler `cc`");
        let _ = std::fs::remove_file(&src);
        assert!(out.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&out.stderr));
        std::fs::rename(&built, &bin).unwrap();
        bin
    })
}

/// Runs the driver: `Some(bytes)`, or `None` where the kernels would set their status word.
fn run(op: &str, spec: &BlockSpec, seed: u16, rotate: bool, input: &[u8]) -> Option<Vec<u8>> {
    let dtype = kernel_dtype(spec.dtype).unwrap();
    let args = [
        op.to_string(),
        dtype.to_string(),
        spec.head_dim.to_string(),
        spec.layers.to_string(),
        spec.tokens.to_string(),
        spec.kv_heads.to_string(),
        u32::from(spec.order == MemoryOrder::BlockFirst).to_string(),
        seed.to_string(),
        u32::from(rotate).to_string(),
    ];
    let mut child = Command::new(driver()).args(&args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let data = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    match out.status.code() {
        Some(0) => Some(out.stdout),
        Some(3) => None,
        other => panic!("driver {args:?} exited with {other:?}"),
    }
}

fn to_bytes(dtype: DType, values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            // Truncation keeps every bf16 pattern reachable (and is the bits an engine holds).
            DType::Bf16 => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
            DType::Fp16 => f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect()
}

/// Rows of one kind per case: random KV-like values with outliers, and edge cases.
fn cases(spec: &BlockSpec, rng: &mut StdRng) -> Vec<(&'static str, Vec<f32>)> {
    let n = spec.elements();
    let gauss = |rng: &mut StdRng| -> f32 {
        let (u, v): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    };
    let mut random: Vec<f32> = (0..n).map(|_| gauss(rng)).collect();
    for i in (0..n).step_by(37) {
        random[i] *= 40.0;
    }
    let mut mixed: Vec<f32> = (0..n)
        .map(|i| match i % 9 {
            0 => 0.0,
            1 => -0.0,
            2 => 2f32.powi(-110),
            3 => -2f32.powi(-7) * 1.5,
            4 => 448.0 * 1.0625,
            5 => 1.0625,
            6 => -3.5,
            7 => 0.25,
            _ => gauss(rng) * 1e-3,
        })
        .collect();
    mixed[n / 2] = 6.0e4;
    // One plane very large, the rest tiny: per-plane scales must not mix.
    let tokens_heads = spec.tokens as usize * usize::from(spec.kv_heads) * spec.row_len();
    let planes_apart: Vec<f32> =
        (0..n).map(|i| if i < tokens_heads { gauss(rng) * 1e4 } else { gauss(rng) * 1e-30 }).collect();
    vec![
        ("random", random),
        ("mixed edge values", mixed),
        ("all zero", vec![0.0; n]),
        ("all negative zero", vec![-0.0; n]),
        ("below 2^-100", vec![2f32.powi(-101); n]),
        ("planes far apart", planes_apart),
        ("constant", vec![-1.5; n]),
    ]
}

const CODECS: [(CodecId, &str, bool); 4] = [
    (CodecId::FP8_E4M3, "fp8", false),
    (CodecId::FP8_E4M3_HAD, "fp8", true),
    (CodecId::NVFP4, "nvfp4", false),
    (CodecId::NVFP4_HAD, "nvfp4", true),
];

fn specs() -> Vec<BlockSpec> {
    let mut out = Vec::new();
    for (hd, dtype, order) in [
        (64u16, DType::Bf16, MemoryOrder::LayerFirst),
        (128, DType::Fp16, MemoryOrder::BlockFirst),
        (96, DType::Fp32, MemoryOrder::LayerFirst),
        (100, DType::Bf16, MemoryOrder::BlockFirst),
        (17, DType::Fp32, MemoryOrder::BlockFirst),
        (7, DType::Fp16, MemoryOrder::LayerFirst),
        (1, DType::Bf16, MemoryOrder::LayerFirst),
    ] {
        let mut s = BlockSpec::new(2, 3, 2, hd, dtype);
        s.order = order;
        out.push(s);
    }
    out
}

#[test]
fn c_helpers_encode_and_decode_byte_for_byte_like_kvtier_kernels() {
    let mut rng = StdRng::seed_from_u64(0x6b76_7469_6572);
    let mut compared = 0;
    for spec in specs() {
        for (name, values) in cases(&spec, &mut rng) {
            let input = to_bytes(spec.dtype, &values);
            for (codec, op, rotate) in CODECS {
                let seed = 0x4B56;
                let view = KvBlockView::new(spec, &input).unwrap();
                let cpu = Codec::new(codec).with_rotation_seed(seed).encode(&view).unwrap();
                let c = run(&format!("{op}_enc"), &spec, seed, rotate, &input)
                    .unwrap_or_else(|| panic!("{codec:?} {spec:?} {name}: the C helpers refused"));
                assert!(c == cpu[32..], "{codec:?} {spec:?} {name}: encoded bodies differ");
                let cpu_out = Codec::new(codec).decode(&cpu, &spec).unwrap();
                let c_out = run(&format!("{op}_dec"), &spec, seed, rotate, &cpu[32..]).unwrap();
                assert!(c_out == cpu_out, "{codec:?} {spec:?} {name}: decoded bytes differ");
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 7 * 7 * 4);
}

#[test]
fn c_helpers_refuse_what_kvtier_kernels_refuses() {
    let spec = BlockSpec::new(1, 2, 2, 32, DType::Fp32);
    let n = spec.elements();
    for (bad, rotated_only) in [(f32::NAN, false), (f32::INFINITY, false), (2f32.powi(101), true)] {
        let mut values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.1).sin()).collect();
        values[n - 5] = bad;
        let input = to_bytes(spec.dtype, &values);
        for (codec, op, rotate) in CODECS {
            let cpu = Codec::new(codec).encode(&KvBlockView::new(spec, &input).unwrap());
            let c = run(&format!("{op}_enc"), &spec, 0x4B56, rotate, &input);
            let refused = !rotated_only || rotate;
            assert_eq!(cpu.is_err(), refused, "{codec:?} {bad}");
            assert_eq!(c.is_none(), refused, "{codec:?} {bad}");
            if !refused {
                assert!(c.unwrap() == cpu.unwrap()[32..], "{codec:?} {bad}");
            }
        }
    }
    // Corrupt bodies: a NaN code, a NaN or negative scale.
    let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).cos()).collect();
    let input = to_bytes(spec.dtype, &values);
    for (codec, op, rotate) in CODECS {
        let payload = Codec::new(codec).encode(&KvBlockView::new(spec, &input).unwrap()).unwrap();
        let body_at = if op == "fp8" { 32 + 4 * spec.rows() + 3 } else { 32 + 4 * spec.planes() + 1 };
        for (at, v) in [(body_at, 0x7Fu8), (35, 0xFF), (35, 0x80)] {
            let mut bad = payload.clone();
            bad[at] = v;
            let cpu = Codec::new(codec).decode(&bad, &spec);
            let c = run(&format!("{op}_dec"), &spec, 0x4B56, rotate, &bad[32..]);
            assert_eq!(cpu.is_err(), c.is_none(), "{codec:?} byte {at} = {v:#x}");
            if let (Ok(cpu), Some(c)) = (cpu, c) {
                assert!(c == cpu, "{codec:?} byte {at} = {v:#x}");
            }
        }
    }
}

/// Declarations of the CUDA names the kernels use, for a syntax and type check of the whole NVRTC
/// program as C++ (argument counts and types of every call, undeclared names, typos) on a
/// machine without NVRTC.
const CUDA_DECLARATIONS: &str = r#"
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__
struct KvDim3 { unsigned x, y, z; };
extern KvDim3 threadIdx, blockIdx, blockDim;
unsigned __float_as_uint(float); float __uint_as_float(unsigned);
float __fdiv_rn(float, float); float __fmul_rn(float, float); float __fadd_rn(float, float);
float __fsub_rn(float, float); float __fsqrt_rn(float);
float rintf(float); float fminf(float, float); float fmaxf(float, float);
void __syncwarp(); unsigned __shfl_xor_sync(unsigned, unsigned, int); int __any_sync(unsigned, int);
unsigned atomicOr(unsigned*, unsigned); unsigned atomicMax(unsigned*, unsigned);
"#;

#[test]
fn the_whole_cuda_program_type_checks_as_cpp() {
    let dir = std::env::temp_dir().join(format!("kvtier-agent-cuda-syntax-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("kernels.cpp");
    std::fs::write(&src, [CUDA_DECLARATIONS, &super::cuda_source()].concat()).unwrap();
    let out = Command::new("c++")
        .args(["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"])
        .arg(&src)
        .output()
        .expect("this check needs the system C++ compiler `c++`");
    assert!(out.status.success(), "the CUDA program does not type-check:\n{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(dir);
}
