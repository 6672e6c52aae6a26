//! Row kernels and the choice between them. A row is the `head_dim` elements of one (layer,
//! K|V, token, head). [`scalar`] is the reference; [`avx2`] (x86-64 with AVX2 and F16C, chosen at
//! run time) writes identical bytes faster, and [`avx512`] (AVX-512 F/BW/VL/DQ on top, and
//! AVX512-BF16 where present) does so for the `+had` codecs — the rotation fused with FP8
//! quantization, with FP8 and NVFP4 dequantization, and NVFP4 quantization of rotated planes —
//! and for plain FP8 decoding (what a load of an `fp8_e4m3` namespace runs), the other kernels
//! staying AVX2 there. The AVX2 kernels have the same fused forms on eight lanes
//! (for the same head dims, [`avx2::covers`]), so a CPU without AVX-512 takes the same routes.
//! The codec calls these through [`Isa`], one call per
//! run of rows for the encoders (a chunk, or a plane for NVFP4) and per row for decoding, so the
//! feature check and the dtype dispatch happen once per run, not per element.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod scalar;

use kvtier_proto::DType;

use crate::rotation::Rotation;
/// See [`Isa::rotate_rows_max`].
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::ROTATED_SAFE_BITS;
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const ROTATED_SAFE_BITS: u32 = 0x6C80_0000;
use crate::CodecError;

/// Runs `row(k, codes, out)` over a run of rows: row `k`'s `hd` input bytes of `src` and its
/// `out_row` bytes of `dst`; whether any row returned true (all rows run). Inlined into each
/// backend's kernel, so the row kernel inlines into its loop.
#[inline(always)]
pub(crate) fn any_row(
    src: &[u8],
    hd: usize,
    dst: &mut [u8],
    out_row: usize,
    mut row: impl FnMut(usize, &[u8], &mut [u8]) -> bool,
) -> bool {
    if hd == 0 {
        return false;
    }
    assert!(src.len().is_multiple_of(hd) && src.len() / hd * out_row <= dst.len());
    let mut any = false;
    for (k, (c, o)) in src.chunks_exact(hd).zip(dst.chunks_exact_mut(out_row)).enumerate() {
        any |= row(k, c, o);
    }
    any
}

/// Which implementation runs the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// The fastest one this CPU supports.
    #[default]
    Auto,
    /// The scalar reference.
    Scalar,
    /// AVX2 + F16C; an error where the CPU lacks them.
    Avx2,
    /// AVX-512 (F, BW, VL, DQ) for the rotations of the `+had` codecs and plain FP8 decoding,
    /// AVX2 + F16C for the rest; an error where the CPU lacks any of them.
    Avx512,
}

impl Backend {
    /// Whether the AVX2 + F16C kernels can run here.
    pub fn avx2_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("f16c")
                && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether the AVX-512 kernels (and the AVX2 ones they fall back on) can run here.
    pub fn avx512_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            Self::avx2_available()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512dq")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether the AVX-512 kernels may also use AVX512-BF16 (where detected, unless a test turned
    /// it off with `__testing::avx512_bf16`).
    fn avx512bf16_in_use() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512bf16") && !AVX512_BF16_OFF.load(std::sync::atomic::Ordering::Relaxed)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    pub(crate) fn resolve(self) -> Result<Isa, CodecError> {
        match self {
            Backend::Scalar => Ok(Isa::Scalar),
            Backend::Auto if Self::avx512_available() => Ok(Isa::Avx512(Avx512Token(Self::avx512bf16_in_use()))),
            Backend::Auto if Self::avx2_available() => Ok(Isa::Avx2(Avx2Token(()))),
            Backend::Auto => Ok(Isa::Scalar),
            Backend::Avx2 if Self::avx2_available() => Ok(Isa::Avx2(Avx2Token(()))),
            Backend::Avx2 => Err(CodecError::BackendUnavailable("avx2+f16c")),
            Backend::Avx512 if Self::avx512_available() => Ok(Isa::Avx512(Avx512Token(Self::avx512bf16_in_use()))),
            Backend::Avx512 => Err(CodecError::BackendUnavailable("avx512f+bw+vl+dq")),
        }
    }
}

/// Proof that AVX2 and F16C were detected: only [`Backend::resolve`] makes one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2Token(());

/// Proof that AVX-512 F, BW, VL and DQ were detected, and everything an [`Avx2Token`] proves:
/// only [`Backend::resolve`] makes one. Its flag: AVX512-BF16 was detected too (and is in use).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Avx512Token(bool);

/// Test hook: set, the AVX-512 backend resolved afterwards leaves AVX512-BF16 unused (the same
/// bytes by another route).
pub(crate) static AVX512_BF16_OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A resolved backend.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Isa {
    Scalar,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2(Avx2Token),
    /// Also runs every AVX2 kernel.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512(Avx512Token),
}

impl Isa {
    /// FP8 sources and outputs are rare (raw engines in FP8); they take the scalar route.
    fn simd(self, dtype: DType) -> bool {
        self.avx2() && dtype != DType::Fp8E4m3
    }

    /// Whether the AVX2 kernels may run (an AVX-512 backend proves the AVX2 features too).
    fn avx2(self) -> bool {
        matches!(self, Isa::Avx2(_) | Isa::Avx512(_))
    }

    pub(crate) fn row_amax_bits(self, dtype: DType, src: &[u8]) -> u32 {
        #[cfg(target_arch = "x86_64")]
        if self.simd(dtype) {
            // SAFETY: an Avx2 Isa exists only after the CPU features were detected.
            return unsafe { avx2::row_amax_bits(dtype, src) };
        }
        scalar::row_amax_bits(dtype, src)
    }

    /// `e4m3(x / scale)`. `bounded`: the caller guarantees `|x| ≤ 448·scale` for every element
    /// (computed scales; not static ones), which lets the vector kernel avoid the division.
    pub(crate) fn fp8_encode_row(self, dtype: DType, src: &[u8], scale: f32, bounded: bool, dst: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if self.simd(dtype) {
            // SAFETY: as above.
            return unsafe { avx2::fp8_encode_row(dtype, src, scale, bounded, dst) };
        }
        let _ = bounded;
        scalar::fp8_encode_row(dtype, src, scale, dst)
    }

    /// FP8 with one scale per row (per (token, head)) for a run of whole rows of `hd` elements:
    /// each row's amax, its scale ([`crate::scale::fp8_scale`], 4 little-endian bytes in
    /// `scales`) and its `hd` codes. `Err(k)`: row `k` of the run holds a NaN or Inf.
    pub(crate) fn fp8_encode_rows(
        self,
        dtype: DType,
        src: &[u8],
        hd: usize,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> Result<(), usize> {
        #[cfg(target_arch = "x86_64")]
        if self.simd(dtype) {
            // SAFETY: as above.
            return match unsafe { avx2::fp8_encode_rows(dtype, src, hd, scales, codes) } {
                Some(k) => Err(k),
                None => Ok(()),
            };
        }
        let row_bytes = hd * dtype.size() as usize;
        for (r, (dst, sc)) in codes.chunks_exact_mut(hd).zip(scales.chunks_exact_mut(4)).enumerate() {
            let row = &src[r * row_bytes..(r + 1) * row_bytes];
            let bits = scalar::row_amax_bits(dtype, row);
            if bits >= 0x7F80_0000 {
                return Err(r);
            }
            let s = crate::scale::fp8_scale(f32::from_bits(bits));
            sc.copy_from_slice(&s.to_le_bytes());
            scalar::fp8_encode_row(dtype, row, if s == 0.0 { 1.0 } else { s }, dst);
        }
        Ok(())
    }

    /// [`Isa::fp8_encode_rows`] of rows rotated by `rot` on the way (the `+had` codecs): the
    /// bytes of rotating the rows into f32 ([`Isa::rotate_rows`]) and encoding those. The
    /// vector kernel does it in one pass per row (rotated in registers, then quantized); the
    /// scalar path is that reference. The caller has checked every row (finite, within
    /// [`crate::rotation::ROTATION_MAX_INPUT`]); `Err(k)` (a rotated row holding a NaN or Inf)
    /// cannot happen then, and is kept for the scalar path's sake.
    pub(crate) fn fp8_encode_rows_rotated(
        self,
        rot: &Rotation,
        dtype: DType,
        src: &[u8],
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> Result<(), usize> {
        if self.fp8_encode_rows_rotated_fused(rot, dtype, src, scales, codes).is_some() {
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        if self.simd(dtype) {
            // SAFETY: an Avx2 or Avx512 Isa exists only after the AVX2 features were detected.
            // The rows were checked by the caller: the rotated max it returns has nothing to add.
            let _ = unsafe { avx2::fp8_encode_rows_rotated(dtype, src, rot.mul(), rot.chunks(), scales, codes) };
            return Ok(());
        }
        let mut rotated = vec![0u8; src.len() / dtype.size() as usize * 4];
        self.rotate_rows(rot, dtype, src, &mut rotated);
        self.fp8_encode_rows(DType::Fp32, &rotated, rot.head_dim(), scales, codes)
    }

    /// [`Isa::fp8_encode_rows_rotated`] on rows nobody has checked, where a kernel does it in
    /// one pass with the range check folded in (AVX-512 or AVX2, chunks they hold in registers):
    /// `Some(bits)`, the largest rotated magnitude as f32 bits (NaN and Inf above every finite
    /// value). At most [`ROTATED_SAFE_BITS`] proves every source value finite and within
    /// [`crate::rotation::ROTATION_MAX_INPUT`]; above it the caller checks the source rows itself
    /// (and discards the scales and codes written if it refuses them). `None` (nothing written)
    /// where there is no such kernel.
    pub(crate) fn fp8_encode_rows_rotated_fused(
        self,
        rot: &Rotation,
        dtype: DType,
        src: &[u8],
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> Option<u32> {
        #[cfg(target_arch = "x86_64")]
        if let (Isa::Avx512(_), true) = (self, avx512::covers(dtype, rot.chunks())) {
            // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were detected.
            return Some(unsafe {
                avx512::fp8_encode_rows_rotated(dtype, src, rot.mul(), rot.chunks(), scales, codes)
            });
        }
        #[cfg(target_arch = "x86_64")]
        if let (Isa::Avx2(_), true) = (self, avx2::covers(dtype, rot.chunks())) {
            // SAFETY: an Avx2 Isa exists only after AVX2, F16C and FMA were detected.
            return Some(unsafe { avx2::fp8_encode_rows_rotated(dtype, src, rot.mul(), rot.chunks(), scales, codes) });
        }
        let _ = (rot, dtype, src, scales, codes);
        None
    }

    pub(crate) fn fp8_decode_row(self, codes: &[u8], scale: f32, out: DType, dst: &mut [u8]) -> bool {
        self.fp8_decode_rows(codes, codes.len(), |_| scale, out, dst)
    }

    /// Plain FP8 rows of `hd` codes (row `k` of `codes` with scale `scale(k)`) into consecutive
    /// rows of `dst` as `out`, one call per run of rows; whether a NaN code was met (`dst` then
    /// unspecified). The bytes of `scalar::fp8_decode_row` row by row.
    pub(crate) fn fp8_decode_rows<F: Fn(usize) -> f32>(
        self,
        codes: &[u8],
        hd: usize,
        scale: F,
        out: DType,
        dst: &mut [u8],
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let (Isa::Avx512(Avx512Token(bf16)), true) = (self, self.simd(out)) {
            // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were
            // detected; its flag says AVX512-BF16 was detected too.
            return unsafe {
                if bf16 {
                    avx512::fp8_decode_plain_rows_bf16ne(codes, hd, scale, out, dst)
                } else {
                    avx512::fp8_decode_plain_rows(codes, hd, scale, out, dst)
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if self.simd(out) {
            // SAFETY: an Avx2 Isa exists only after the CPU features were detected.
            return unsafe { avx2::fp8_decode_rows(codes, hd, scale, out, dst) };
        }
        any_row(codes, hd, dst, hd * out.size() as usize, |k, c, o| scalar::fp8_decode_row(c, scale(k), out, o))
    }

    /// NVFP4 for a run of whole rows: row `k` of `src` is row `r0 + k` of `spec`, encoded with
    /// the global scale `g` and encode factor `enc` of its plane; `bs` and `codes` hold
    /// `ceil(hd/16)` and `ceil(hd/2)` bytes per row. `ahead`: input the caller reads next, which
    /// the vector kernel prefetches (a hint only; any slice).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn nvfp4_encode_rows(
        self,
        spec: &crate::BlockSpec,
        r0: usize,
        src: &[u8],
        ahead: &[u8],
        g: &[f32],
        enc: &[f32],
        bs: &mut [u8],
        codes: &mut [u8],
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.simd(spec.dtype) {
            // SAFETY: as above.
            return unsafe { avx2::nvfp4_encode_rows(spec, r0, src, ahead, g, enc, bs, codes) };
        }
        let _ = ahead;
        let hd = spec.row_len();
        let row_bytes = hd * spec.dtype.size() as usize;
        let (nb, cb) = (hd.div_ceil(16), hd.div_ceil(2));
        for (k, (b, c)) in bs.chunks_exact_mut(nb).zip(codes.chunks_exact_mut(cb)).enumerate() {
            let p = spec.plane_of_row(r0 + k);
            scalar::nvfp4_encode_row(spec.dtype, &src[k * row_bytes..(k + 1) * row_bytes], g[p], enc[p], b, c);
        }
    }

    pub(crate) fn nvfp4_decode_row(
        self,
        bs: &[u8],
        codes: &[u8],
        g: f32,
        n: usize,
        out: DType,
        dst: &mut [u8],
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.simd(out) {
            // SAFETY: as above.
            return unsafe { avx2::nvfp4_decode_row(bs, codes, g, n, out, dst) };
        }
        scalar::nvfp4_decode_row(bs, codes, g, 0, n, out, dst)
    }
}

impl Isa {
    /// Loads whole rows of `dtype` from `src`, rotates them by `rot` and writes them to `out` as
    /// little-endian f32 (4 bytes per element): the bytes of [`Rotation::forward_rows_ref`].
    pub(crate) fn rotate_rows(self, rot: &Rotation, dtype: DType, src: &[u8], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx512(_) = self {
            let mut buf = vec![0f32; rot.head_dim()];
            // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were detected.
            return unsafe { avx512::rotate_rows(dtype, src, rot.mul(), rot.chunks(), &mut buf, out) };
        }
        #[cfg(target_arch = "x86_64")]
        if self.avx2() {
            let mut buf = vec![0f32; rot.head_dim()];
            // SAFETY: an Avx2 or Avx512 Isa exists only after AVX2, F16C and FMA were detected.
            return unsafe { avx2::rotate_rows(dtype, src, rot.mul(), rot.chunks(), &mut buf, out) };
        }
        rot.forward_rows_ref(dtype, src, out)
    }

    /// Inverse-rotates whole rows of little-endian f32 in `src` by `rot` and stores them as
    /// `dtype` in `dst` (the bytes of [`Rotation::inverse_rows_ref`]). Returns the largest
    /// magnitude of `src` as f32 bits (NaN and Inf above every finite value), which the vector
    /// kernel takes from its registers, so the caller can refuse values the encoder never writes
    /// without another pass (`dst` is then unspecified).
    pub(crate) fn unrotate_rows(self, rot: &Rotation, src: &[u8], dtype: DType, dst: &mut [u8]) -> u32 {
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx512(_) = self {
            let mut buf = vec![0f32; rot.head_dim()];
            // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were detected.
            return unsafe { avx512::unrotate_rows(src, rot.mul(), rot.chunks(), &mut buf, dtype, dst) };
        }
        #[cfg(target_arch = "x86_64")]
        if self.avx2() {
            let mut buf = vec![0f32; rot.head_dim()];
            // SAFETY: an Avx2 or Avx512 Isa exists only after AVX2, F16C and FMA were detected.
            return unsafe { avx2::unrotate_rows(src, rot.mul(), rot.chunks(), &mut buf, dtype, dst) };
        }
        rot.inverse_rows_ref(src, dtype, dst);
        scalar::row_amax_bits(DType::Fp32, src)
    }

    /// Whether [`Isa::fp8_decode_rows_rotated`] and [`Isa::nvfp4_decode_rows_rotated`] have a
    /// fused kernel for rows of `rot` decoded into `out` (else the caller decodes into f32 and
    /// calls [`Isa::unrotate_rows`]).
    pub(crate) fn fuses_rotated_decode(self, rot: &Rotation, out: DType) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx512(_) = self {
            return avx512::covers(out, rot.chunks());
        }
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx2(_) = self {
            return avx2::covers(out, rot.chunks());
        }
        let _ = (rot, out);
        false
    }

    /// FP8 rows (`rot.head_dim()` codes each) decoded with `scale(k)` for row `k` and
    /// inverse-rotated into `dst` as `out`, in one pass per row: the bytes of decoding into f32
    /// and [`Isa::unrotate_rows`]. Only where [`Isa::fuses_rotated_decode`]; the caller has
    /// checked every scale is at most [`crate::rotation::ROTATION_MAX_INPUT`] (so no decoded
    /// value passes [`crate::rotation::ROTATION_MAX_DECODED`]). Returns whether a NaN code was
    /// met (`dst` is then unspecified).
    pub(crate) fn fp8_decode_rows_rotated<F: Fn(usize) -> f32>(
        self,
        rot: &Rotation,
        codes: &[u8],
        scale: F,
        out: DType,
        dst: &mut [u8],
    ) -> bool {
        assert!(self.fuses_rotated_decode(rot, out), "no fused rotated decoder");
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx512(Avx512Token(bf16)) = self {
            let (mul, chunks) = (rot.mul(), rot.chunks());
            if bf16 {
                // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were
                // detected; its flag says AVX512-BF16 was detected too.
                return unsafe { avx512::fp8_decode_rows_rotated_bf16ne(codes, scale, mul, chunks, out, dst) };
            }
            // SAFETY: as above.
            return unsafe { avx512::fp8_decode_rows_rotated(codes, scale, mul, chunks, out, dst) };
        }
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx2(_) = self {
            // SAFETY: an Avx2 Isa exists only after AVX2, F16C and FMA were detected.
            return unsafe { avx2::fp8_decode_rows_rotated(codes, scale, rot.mul(), rot.chunks(), out, dst) };
        }
        let _ = (codes, scale, dst);
        unreachable!("checked by the assert above")
    }

    /// NVFP4 rows (`ceil(hd/16)` block scales and `ceil(hd/2)` code bytes each) decoded with the
    /// global scale `g(k)` for row `k` and inverse-rotated into `dst` as `out`, in one pass per
    /// row: the bytes of decoding into f32 and [`Isa::unrotate_rows`]. Only where
    /// [`Isa::fuses_rotated_decode`]; the caller has checked every global scale is at most 2^98
    /// (so no decoded value passes [`crate::rotation::ROTATION_MAX_DECODED`]). Returns whether a
    /// block scale code is not a valid unsigned E4M3 code (`dst` is then unspecified).
    pub(crate) fn nvfp4_decode_rows_rotated<F: Fn(usize) -> f32>(
        self,
        rot: &Rotation,
        bs: &[u8],
        codes: &[u8],
        g: F,
        out: DType,
        dst: &mut [u8],
    ) -> bool {
        assert!(self.fuses_rotated_decode(rot, out), "no fused rotated decoder");
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx512(Avx512Token(bf16)) = self {
            let (mul, chunks) = (rot.mul(), rot.chunks());
            if bf16 {
                // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were
                // detected; its flag says AVX512-BF16 was detected too.
                return unsafe { avx512::nvfp4_decode_rows_rotated_bf16ne(bs, codes, g, mul, chunks, out, dst) };
            }
            // SAFETY: as above.
            return unsafe { avx512::nvfp4_decode_rows_rotated(bs, codes, g, mul, chunks, out, dst) };
        }
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx2(_) = self {
            // SAFETY: an Avx2 Isa exists only after AVX2, F16C and FMA were detected.
            return unsafe { avx2::nvfp4_decode_rows_rotated(bs, codes, g, rot.mul(), rot.chunks(), out, dst) };
        }
        let _ = (bs, codes, g, dst);
        unreachable!("checked by the assert above")
    }

    /// For the rotated NVFP4 encoder, one plane at a time, where a kernel does it (AVX-512 or
    /// AVX2, chunks they hold in registers): rotates the rows of `src` into `scratch` as f32 (the bytes
    /// of [`Isa::rotate_rows`]) and returns the largest rotated magnitude as f32 bits, taken from
    /// the registers. At most [`ROTATED_SAFE_BITS`] proves every source value finite and within
    /// [`crate::rotation::ROTATION_MAX_INPUT`]; above it the caller checks the source. `None`
    /// (nothing written) where there is no such kernel.
    pub(crate) fn rotate_rows_max(self, rot: &Rotation, dtype: DType, src: &[u8], scratch: &mut [u8]) -> Option<u32> {
        #[cfg(target_arch = "x86_64")]
        if let (Isa::Avx512(_), true) = (self, avx512::covers(dtype, rot.chunks())) {
            // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were detected.
            return Some(unsafe { avx512::rotate_rows_max(dtype, src, rot.mul(), rot.chunks(), scratch) });
        }
        #[cfg(target_arch = "x86_64")]
        if let (Isa::Avx2(_), true) = (self, avx2::covers(dtype, rot.chunks())) {
            let mut buf = vec![0f32; rot.head_dim()];
            // SAFETY: an Avx2 Isa exists only after AVX2, F16C and FMA were detected.
            return Some(unsafe { avx2::rotate_rows_max(dtype, src, rot.mul(), rot.chunks(), &mut buf, scratch) });
        }
        let _ = (rot, dtype, src, scratch);
        None
    }

    /// NVFP4 codes of rows of little-endian f32 (`hd` each) of one plane with its global scale
    /// `g` and encode factor `enc`: the bytes of [`Isa::nvfp4_encode_rows`].
    pub(crate) fn nvfp4_encode_plane_f32(
        self,
        hd: usize,
        src: &[u8],
        g: f32,
        enc: f32,
        bs: &mut [u8],
        codes: &mut [u8],
    ) {
        #[cfg(target_arch = "x86_64")]
        if let (Isa::Avx512(_), true) = (self, hd.is_multiple_of(16) && hd > 0) {
            // SAFETY: an Avx512 Isa exists only after the AVX-512 and AVX2 features were detected.
            return unsafe { avx512::nvfp4_encode_rows_f32(src, hd, g, enc, bs, codes) };
        }
        let spec = crate::BlockSpec::new(1, (src.len() / (4 * hd.max(1))) as u32, 1, hd as u16, DType::Fp32);
        self.nvfp4_encode_rows(&spec, 0, src, &[], &[g], &[enc], bs, codes)
    }

    /// Unscaled E4M3 codes of f32 values (a division by 1 is exact).
    pub(crate) fn e4m3_slice(self, xs: &[f32], out: &mut [u8]) {
        let bytes: Vec<u8> = xs.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.fp8_encode_row(DType::Fp32, &bytes, 1.0, false, out);
    }

    /// Unscaled E2M1 codes of f32 values, one per byte.
    pub(crate) fn e2m1_slice(self, xs: &[f32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2() {
            // SAFETY: an Avx2 or Avx512 Isa exists only after the AVX2 features were detected.
            return unsafe { avx2::e2m1_slice(xs, out) };
        }
        for (o, x) in out.iter_mut().zip(xs) {
            *o = crate::formats::e2m1_from_f32(*x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{load_f32, store_f32};

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn row_paths_match_the_reference_on_every_backend() {
        let mut isas = vec![Backend::Scalar.resolve().unwrap()];
        if Backend::avx2_available() {
            isas.push(Backend::Avx2.resolve().unwrap());
        }
        if Backend::avx512_available() {
            isas.push(Backend::Avx512.resolve().unwrap());
        }
        // Every mix of in-vector, two-stage, one-stage and short-chunk paths.
        for hd in [1usize, 7, 8, 16, 24, 32, 64, 96, 100, 128, 256, 512, 576] {
            let rot = Rotation::new(hd, 3);
            let x: Vec<f32> = pseudo_random(4 * hd, 9).iter().map(|v| v * 300.0).collect();
            for dtype in [DType::Bf16, DType::Fp16, DType::Fp32, DType::Fp8E4m3] {
                let src: Vec<u8> = (0..x.len())
                    .flat_map(|i| {
                        let mut b = vec![0u8; dtype.size() as usize];
                        store_f32(dtype, &mut b, 0, x[i]);
                        b
                    })
                    .collect();
                let mut want = Vec::new();
                for r in 0..4 {
                    let mut row: Vec<f32> = (0..hd).map(|i| load_f32(dtype, &src, r * hd + i)).collect();
                    rot.forward(&mut row);
                    want.extend(row.iter().flat_map(|v| v.to_le_bytes()));
                }
                let mut back_want = vec![0u8; src.len()];
                for r in 0..4 {
                    let mut row: Vec<f32> = (0..hd).map(|i| load_f32(DType::Fp32, &want, r * hd + i)).collect();
                    rot.inverse(&mut row);
                    for (i, v) in row.iter().enumerate() {
                        store_f32(dtype, &mut back_want, r * hd + i, *v);
                    }
                }
                for isa in &isas {
                    let mut out = vec![0u8; want.len()];
                    isa.rotate_rows(&rot, dtype, &src, &mut out);
                    assert_eq!(out, want, "{isa:?} {dtype:?} hd {hd}");
                    let mut back = vec![0u8; src.len()];
                    isa.unrotate_rows(&rot, &want, dtype, &mut back);
                    assert_eq!(back, back_want, "{isa:?} {dtype:?} hd {hd} inverse");
                }
            }
        }
    }
}

#[cfg(test)]
mod rotated_fp8_tests {
    use super::*;
    use crate::block::store_f32;
    use proptest::prelude::*;

    /// A row kind for [`hostile_rows`].
    fn fill_row(row: &mut [f32], kind: u32, e: i32, next: &mut impl FnMut() -> u64, specials: bool) {
        let hd = row.len();
        for (i, v) in row.iter_mut().enumerate() {
            let u = (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            *v = match kind {
                0 => 0.0,
                1 => -0.0,
                // Subnormal f32 of both signs.
                2 => f32::from_bits((next() as u32) & 0x007F_FFFF) * if u < 0.0 { -1.0 } else { 1.0 },
                // The first power-of-two chunk all −0, the rest ordinary: −0 rotated values in a
                // row with a nonzero scale.
                3 if i < 1 << (usize::BITS - 1 - hd.leading_zeros()) => -0.0,
                // At the range limit of the rotated codecs.
                4 => u * 2f32.powi(100),
                _ => u * 2f32.powi(e),
            };
            if specials && next().is_multiple_of(97) {
                *v = match next() % 5 {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    3 => -2f32.powi(101),
                    _ => f32::MAX,
                };
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// The fused rotate-and-quantize kernels (AVX-512, and AVX2's) write the scalar
        /// reference's bytes for any run of rows: head dims with and without register forms,
        /// every source dtype, magnitudes across the whole range, zeros of both signs (also
        /// beside nonzero chunks), subnormals, values at 2^100; and with NaN, infinities or values
        /// past 2^100 in the source, the fused kernel's returned max is above
        /// `ROTATED_SAFE_BITS`, which makes the codec check and refuse the rows.
        #[test]
        fn fused_fp8_kernels_match_the_scalar_reference(
            hd in prop::sample::select(vec![16usize, 32, 48, 64, 80, 96, 100, 112, 128, 160, 192, 256, 320, 512]),
            rows in 1usize..20,
            dtype in prop::sample::select(vec![DType::Bf16, DType::Fp16, DType::Fp32]),
            seed in any::<u64>(),
            specials in any::<bool>(),
        ) {
            let mut st = seed | 1;
            let mut next = move || {
                st ^= st << 13;
                st ^= st >> 7;
                st ^= st << 17;
                st
            };
            let mut x = vec![0f32; rows * hd];
            for row in x.chunks_mut(hd) {
                let kind = (next() % 10) as u32;
                let e = if dtype == DType::Fp16 { (next() % 30) as i32 - 14 } else { (next() % 230) as i32 - 130 };
                fill_row(row, kind, e, &mut next, specials);
            }
            let es = dtype.size() as usize;
            let mut src = vec![0u8; x.len() * es];
            for (i, v) in x.iter().enumerate() {
                store_f32(dtype, &mut src, i, *v);
            }
            // What the kernels see: the values as stored in `dtype`.
            let seen: Vec<f32> = (0..x.len()).map(|i| crate::block::load_f32(dtype, &src, i)).collect();
            let valid = seen.iter().all(|v| v.is_finite() && v.abs() <= crate::rotation::ROTATION_MAX_INPUT);
            let rot = Rotation::new(hd, (seed >> 48) as u16);
            let (mut ws, mut wc) = (vec![0u8; 4 * rows], vec![0u8; rows * hd]);
            let want = Isa::Scalar.fp8_encode_rows_rotated(&rot, dtype, &src, &mut ws, &mut wc);
            prop_assert!(want.is_ok() || !valid);
            let mut isas = vec![];
            if Backend::avx2_available() {
                isas.push(Backend::Avx2.resolve().unwrap());
            }
            if Backend::avx512_available() {
                isas.push(Backend::Avx512.resolve().unwrap());
            }
            for isa in isas {
                let (mut gs, mut gc) = (vec![0u8; 4 * rows], vec![0u8; rows * hd]);
                if let Some(bits) = isa.fp8_encode_rows_rotated_fused(&rot, dtype, &src, &mut gs, &mut gc) {
                    if !valid {
                        prop_assert!(bits > ROTATED_SAFE_BITS, "{:?}: bits {:#x} on a source the codec refuses", isa, bits);
                    } else {
                        prop_assert_eq!((&gs, &gc), (&ws, &wc), "{:?} {:?} hd {} rows {} (fused)", isa, dtype, hd, rows);
                    }
                }
                if valid {
                    let (mut gs, mut gc) = (vec![0u8; 4 * rows], vec![0u8; rows * hd]);
                    prop_assert!(isa.fp8_encode_rows_rotated(&rot, dtype, &src, &mut gs, &mut gc).is_ok());
                    prop_assert_eq!((&gs, &gc), (&ws, &wc), "{:?} {:?} hd {} rows {}", isa, dtype, hd, rows);
                }
            }
        }
    }

    /// The fused rotate-and-quantize kernel of every backend writes the scalar bytes, at row
    /// magnitudes from 2^-90 to 2^90: scales inside and outside the range of the exact reciprocal
    /// form (the division path), one-chunk and several-chunk rows, row counts around eight.
    #[test]
    fn fused_fp8_rows_match_the_reference_at_every_magnitude() {
        let mut isas = vec![];
        if Backend::avx2_available() {
            isas.push(Backend::Avx2.resolve().unwrap());
        }
        if Backend::avx512_available() {
            isas.push(Backend::Avx512.resolve().unwrap());
        }
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for hd in [16usize, 64, 96, 128, 256, 320] {
            let rot = Rotation::new(hd, 11);
            for rows in [1usize, 7, 8, 9, 17] {
                for dtype in [DType::Bf16, DType::Fp16, DType::Fp32] {
                    let mut src = vec![0u8; rows * hd * dtype.size() as usize];
                    for r in 0..rows {
                        let e = if dtype == DType::Fp16 { (r as i32 % 9) - 4 } else { (r as i32 * 37 % 181) - 90 };
                        for i in 0..hd {
                            s ^= s << 13;
                            s ^= s >> 7;
                            s ^= s << 17;
                            let v = ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 2f32.powi(e);
                            store_f32(dtype, &mut src, r * hd + i, v);
                        }
                    }
                    let (mut ws, mut wc) = (vec![0u8; 4 * rows], vec![0u8; rows * hd]);
                    Isa::Scalar.fp8_encode_rows_rotated(&rot, dtype, &src, &mut ws, &mut wc).unwrap();
                    for isa in &isas {
                        let (mut gs, mut gc) = (vec![0u8; 4 * rows], vec![0u8; rows * hd]);
                        isa.fp8_encode_rows_rotated(&rot, dtype, &src, &mut gs, &mut gc).unwrap();
                        assert_eq!((gs, gc), (ws.clone(), wc.clone()), "{isa:?} {dtype:?} hd {hd} rows {rows}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod fused_rotated_tests {
    use super::*;
    use crate::block::store_f32;

    fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// The vector backends this CPU runs.
    fn vector_isas() -> Vec<Isa> {
        let mut isas = vec![];
        if Backend::avx2_available() {
            isas.push(Backend::Avx2.resolve().unwrap());
        }
        if Backend::avx512_available() {
            isas.push(Backend::Avx512.resolve().unwrap());
        }
        isas
    }

    const COVERED: [usize; 9] = [16, 32, 64, 128, 256, 48, 96, 80, 496];
    const NOT_COVERED: [usize; 6] = [8, 24, 100, 512, 576, 7];

    /// The AVX2 backend takes every fused rotated route for the head dims whose chunks it holds
    /// in registers (so the byte comparisons of the fused kernels below and in
    /// `tests/fused_rotation.rs` and `tests/simd_backends.rs` run them), and none for the others
    /// or for FP8 rows.
    #[test]
    fn avx2_takes_the_fused_rotated_routes() {
        if !Backend::avx2_available() {
            return;
        }
        let isa = Backend::Avx2.resolve().unwrap();
        for hd in COVERED.into_iter().chain(NOT_COVERED) {
            let rot = Rotation::new(hd, 5);
            for dtype in [DType::Bf16, DType::Fp16, DType::Fp32, DType::Fp8E4m3] {
                let want = COVERED.contains(&hd) && dtype != DType::Fp8E4m3;
                let src = vec![0u8; 3 * hd * dtype.size() as usize];
                let (mut sc, mut co) = (vec![0u8; 12], vec![0u8; 3 * hd]);
                let fp8 = isa.fp8_encode_rows_rotated_fused(&rot, dtype, &src, &mut sc, &mut co);
                let mut scratch = vec![0u8; 3 * hd * 4];
                let nvfp4 = isa.rotate_rows_max(&rot, dtype, &src, &mut scratch);
                assert_eq!(fp8.is_some(), want, "fp8 encode, hd {hd} {dtype:?}");
                assert_eq!(nvfp4.is_some(), want, "nvfp4 plane rotation, hd {hd} {dtype:?}");
                assert_eq!(isa.fuses_rotated_decode(&rot, dtype), want, "decode, hd {hd} {dtype:?}");
                if want {
                    assert_eq!((fp8, nvfp4), (Some(0), Some(0)), "zero rows, hd {hd} {dtype:?}");
                }
            }
        }
    }

    /// The fused plane rotation of every vector backend writes [`Isa::rotate_rows`]' scalar bytes
    /// and returns the largest rotated magnitude; a source holding a NaN, an infinity or a value
    /// beyond 2^100 gives more than [`ROTATED_SAFE_BITS`] (the rotated NVFP4 encoder's range check).
    #[test]
    fn fused_plane_rotation_matches_the_reference_and_flags_hostile_rows() {
        let mut next = xorshift(0x1234_5678);
        for isa in vector_isas() {
            for hd in COVERED {
                let rot = Rotation::new(hd, 9);
                for dtype in [DType::Bf16, DType::Fp16, DType::Fp32] {
                    for special in [None, Some(f32::NAN), Some(f32::INFINITY), Some(-2f32.powi(101)), Some(65504.0)] {
                        let rows = 5;
                        let mut src = vec![0u8; rows * hd * dtype.size() as usize];
                        for i in 0..rows * hd {
                            let u = (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                            let e = if dtype == DType::Fp16 { 3 } else { (i / hd) as i32 * 20 - 40 };
                            store_f32(dtype, &mut src, i, u * 2f32.powi(e));
                        }
                        if let Some(v) = special {
                            store_f32(dtype, &mut src, (next() as usize) % (rows * hd), v);
                        }
                        let seen: Vec<f32> = (0..rows * hd).map(|i| crate::block::load_f32(dtype, &src, i)).collect();
                        let valid =
                            seen.iter().all(|v| v.is_finite() && v.abs() <= crate::rotation::ROTATION_MAX_INPUT);
                        let mut want = vec![0u8; rows * hd * 4];
                        Isa::Scalar.rotate_rows(&rot, dtype, &src, &mut want);
                        let mut got = vec![0u8; rows * hd * 4];
                        let bits = isa.rotate_rows_max(&rot, dtype, &src, &mut got).expect("a fused route");
                        if valid {
                            assert_eq!(got, want, "{isa:?} {dtype:?} hd {hd}");
                            assert_eq!(bits, scalar::row_amax_bits(DType::Fp32, &want), "{isa:?} {dtype:?} hd {hd}");
                            assert!(bits <= ROTATED_SAFE_BITS, "{isa:?} {dtype:?} hd {hd}: {bits:#x}");
                        } else {
                            assert!(bits > ROTATED_SAFE_BITS, "{isa:?} {dtype:?} hd {hd} {special:?}: {bits:#x}");
                        }
                    }
                }
            }
        }
    }

    /// The plain (unrotated) FP8 and NVFP4 row decoders of every vector backend write the scalar
    /// kernels' bytes into BF16, FP16 and FP32 for every E4M3 code, every E2M1 nibble under every
    /// valid block scale, at row lengths around the sixteen- and eight-wide steps and their scalar
    /// tails, under scales from 0 and subnormal to past `256·scale` overflowing (FP8) and to a
    /// block scale times `g` overflowing to infinity (NVFP4); and flag a NaN code or an invalid
    /// block scale exactly when the scalar kernels do.
    /// A run of plain FP8 rows decoded in one call writes the scalar bytes row by row, each row
    /// under its own scale (zero, subnormal, ordinary, large), at head dims that fill the vector
    /// steps and ones that leave tails; a NaN code in one row of the run is flagged.
    #[test]
    fn plain_fp8_runs_of_rows_match_the_scalar_kernel_row_by_row() {
        let scales = [1.0f32, 0.0, 1e-40, 3.7e-3, 2f32.powi(-90), 17.25, 2f32.powi(100)];
        for isa in vector_isas() {
            for out in [DType::Bf16, DType::Fp16, DType::Fp32] {
                let os = out.size() as usize;
                for hd in [7usize, 32, 64, 96, 100, 128, 136] {
                    let rows = 2 * scales.len();
                    for nan_row in [None, Some(5)] {
                        let mut codes: Vec<u8> = (0..rows * hd).map(|i| ((i * 53 + i / hd) % 256) as u8).collect();
                        codes.iter_mut().filter(|c| **c & 0x7F == 0x7F).for_each(|c| *c &= 0xFE);
                        if let Some(r) = nan_row {
                            codes[r * hd + hd / 2] = 0xFF;
                        }
                        let scale = |k: usize| scales[k % scales.len()];
                        let mut want = vec![0u8; rows * hd * os];
                        let mut want_bad = false;
                        for k in 0..rows {
                            want_bad |= scalar::fp8_decode_row(
                                &codes[k * hd..(k + 1) * hd],
                                scale(k),
                                out,
                                &mut want[k * hd * os..(k + 1) * hd * os],
                            );
                        }
                        let mut got = vec![0u8; rows * hd * os];
                        let bad = isa.fp8_decode_rows(&codes, hd, scale, out, &mut got);
                        assert_eq!(bad, nan_row.is_some(), "{isa:?} {out:?} hd {hd}");
                        assert_eq!(bad, want_bad);
                        if !bad {
                            assert_eq!(got, want, "{isa:?} fp8 rows into {out:?}, hd {hd}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn plain_decoders_match_the_scalar_kernels_on_every_code() {
        let lens = [0usize, 1, 7, 8, 15, 16, 17, 24, 31, 32, 40, 100, 128, 129, 272, 280];
        for isa in vector_isas() {
            for out in [DType::Bf16, DType::Fp16, DType::Fp32] {
                let os = out.size() as usize;
                for &n in &lens {
                    for (k, scale) in
                        [0.0, f32::from_bits(1), 1e-40, 1.0, 3.7, 2f32.powi(100), 2f32.powi(121), f32::MAX]
                            .into_iter()
                            .enumerate()
                    {
                        for corrupt in [false, true] {
                            let mut codes: Vec<u8> = (0..n).map(|i| (i * 37 + k) as u8).collect();
                            if !corrupt {
                                codes.iter_mut().filter(|c| **c & 0x7F == 0x7F).for_each(|c| *c &= 0xFE);
                            } else if n > 0 {
                                codes[(k * 5) % n] = [0x7F, 0xFF][k % 2];
                            }
                            let (mut want, mut got) = (vec![0u8; n * os], vec![0u8; n * os]);
                            let want_bad = scalar::fp8_decode_row(&codes, scale, out, &mut want);
                            let bad = isa.fp8_decode_row(&codes, scale, out, &mut got);
                            assert_eq!(bad, want_bad, "{isa:?} fp8 NaN flag, {out:?} n {n} scale {scale}");
                            if !want_bad {
                                assert_eq!(got, want, "{isa:?} fp8 into {out:?}, n {n} scale {scale}");
                            }
                        }
                    }
                    for (k, g) in [0.0, 1e-30, 1.0, 2f32.powi(98), f32::MAX].into_iter().enumerate() {
                        for corrupt in [false, true] {
                            let (nb, cb) = (n.div_ceil(16), n.div_ceil(2));
                            let mut bs: Vec<u8> = (0..nb).map(|b| ((b * 29 + k) % 0x7F) as u8).collect();
                            if corrupt && nb > 0 {
                                bs[k % nb] = [0x7F, 0x80, 0xFF][k % 3];
                            }
                            let nv: Vec<u8> = (0..cb).map(|i| (i * 37 + 3 * k) as u8).collect();
                            let (mut want, mut got) = (vec![0u8; n * os], vec![0u8; n * os]);
                            let want_bad = scalar::nvfp4_decode_row(&bs, &nv, g, 0, n, out, &mut want);
                            let bad = isa.nvfp4_decode_row(&bs, &nv, g, n, out, &mut got);
                            assert_eq!(bad, want_bad, "{isa:?} nvfp4 block-scale flag, {out:?} n {n} g {g}");
                            if !want_bad {
                                assert_eq!(got, want, "{isa:?} nvfp4 into {out:?}, n {n} g {g}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The fused FP8 and NVFP4 decoders of every vector backend write the bytes of the scalar
    /// route (dequantize into f32, then [`Isa::unrotate_rows`]) into every non-FP8 dtype, on
    /// random codes (every E4M3 and E2M1 code, zeros of both signs) under scales across the whole
    /// range the codec lets through (2^-130 .. 2^100, and 0), and report a NaN code or an invalid
    /// block scale exactly when the scalar decoder does.
    #[test]
    fn fused_decoders_match_the_scalar_route() {
        let mut next = xorshift(0xC0FF_EE00);
        for isa in vector_isas() {
            for hd in COVERED {
                let rot = Rotation::new(hd, 21);
                let rows = 11;
                for out in [DType::Bf16, DType::Fp16, DType::Fp32] {
                    for corrupt in [false, true] {
                        let os = out.size() as usize;
                        // FP8: codes with NaNs removed unless corrupting.
                        let mut codes: Vec<u8> = (0..rows * hd).map(|_| next() as u8).collect();
                        if !corrupt {
                            codes.iter_mut().filter(|c| **c & 0x7F == 0x7F).for_each(|c| *c &= 0xFE);
                        }
                        let scales: Vec<f32> = (0..rows)
                            .map(|r| match r {
                                0 => 0.0,
                                1 => 2f32.powi(100),
                                2 => f32::from_bits(1),
                                _ => f32::from_bits(((next() % 226) as u32 + 1) << 23 | (next() as u32 & 0x7F_FFF0)),
                            })
                            .collect();
                        let mut f32s = vec![0u8; rows * hd * 4];
                        let mut want_bad = false;
                        for r in 0..rows {
                            want_bad |= scalar::fp8_decode_row(
                                &codes[r * hd..(r + 1) * hd],
                                scales[r],
                                DType::Fp32,
                                &mut f32s[r * hd * 4..(r + 1) * hd * 4],
                            );
                        }
                        let mut want = vec![0u8; rows * hd * os];
                        Isa::Scalar.unrotate_rows(&rot, &f32s, out, &mut want);
                        assert!(isa.fuses_rotated_decode(&rot, out));
                        let mut got = vec![0u8; rows * hd * os];
                        let bad = isa.fp8_decode_rows_rotated(&rot, &codes, |k| scales[k], out, &mut got);
                        assert_eq!(bad, want_bad, "{isa:?} fp8 NaN flag, {out:?} hd {hd}");
                        if !want_bad {
                            assert_eq!(got, want, "{isa:?} fp8 into {out:?}, hd {hd}");
                        }

                        // NVFP4: block scales below 0x7F unless corrupting.
                        let (nb, cb) = (hd / 16, hd / 2);
                        let mut bs: Vec<u8> = (0..rows * nb).map(|_| (next() % 0x7F) as u8).collect();
                        if corrupt {
                            let i = (next() as usize) % bs.len();
                            bs[i] = [0x7F, 0x80, 0xFF][(next() % 3) as usize];
                        }
                        let nv: Vec<u8> = (0..rows * cb).map(|_| next() as u8).collect();
                        let g: Vec<f32> = (0..rows)
                            .map(|r| match r {
                                0 => 0.0,
                                1 => 2f32.powi(98),
                                _ => f32::from_bits(((next() % 224) as u32 + 1) << 23 | (next() as u32 & 0x7F_FFC0)),
                            })
                            .collect();
                        let mut want_bad = false;
                        for r in 0..rows {
                            want_bad |= scalar::nvfp4_decode_row(
                                &bs[r * nb..(r + 1) * nb],
                                &nv[r * cb..(r + 1) * cb],
                                g[r],
                                0,
                                hd,
                                DType::Fp32,
                                &mut f32s[r * hd * 4..(r + 1) * hd * 4],
                            );
                        }
                        Isa::Scalar.unrotate_rows(&rot, &f32s, out, &mut want);
                        let bad = isa.nvfp4_decode_rows_rotated(&rot, &bs, &nv, |k| g[k], out, &mut got);
                        assert_eq!(bad, want_bad, "{isa:?} nvfp4 block-scale flag, {out:?} hd {hd}");
                        if !want_bad {
                            assert_eq!(got, want, "{isa:?} nvfp4 into {out:?}, hd {hd}");
                        }
                    }
                }
            }
        }
    }
}
