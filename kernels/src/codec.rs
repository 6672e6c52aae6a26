//! Encoding and decoding whole blocks: [`Codec`] turns a [`KvBlockView`] into a payload and a
//! payload back into the engine's dtype, choosing the format from a `kvtier_proto::CodecId`.
//!
//! Scale rules (the exact arithmetic; `fl` = one f32 rounding, `e4m3`/`e2m1` = round to nearest
//! even with saturation, see [`crate::formats`]):
//!
//! - **FP8, per (token, head)** (default): `s = canonical(fl(amax_row / 448), 20 bits)`,
//!   `code = e4m3(fl(x / s))`, decoded `fl(e4m3(code) · s)`. (A true division, not a multiply by
//!   the reciprocal: it keeps the per-element bound exact and matches engines' `x / k_scale`.)
//! - **FP8, per tensor**: the same with the amax of the (layer, K|V) plane; **static**: the caller's
//!   `k_scale`/`v_scale` as given (`code = e4m3(fl(x / k_scale))`, byte-compatible with engines
//!   that store `x / k_scale` as FP8).
//! - **NVFP4**: per plane `amax`; global decode scale `g = canonical(fl(amax / 2688), 18 bits)`;
//!   `enc = fl(2688 / amax)`; per 16-element micro-block along `head_dim`
//!   `bs = e4m3(fl(fl(amax_block / 6) · enc))`, `d = fl(e4m3(bs) · g)`, `code = e2m1(fl(x · fl(1/d)))`;
//!   decoded `fl(e2m1(code) · d)`. A `head_dim` that is not a multiple of 16 ends each row with a
//!   shorter micro-block.
//! - **amax = 0** (and amax below 2^-100, treated as 0): the scale is 0, every code is ±0 (the
//!   input's sign is kept), and the block decodes to ±0. For NVFP4 `g = 0`, `enc = 0`, so every block
//!   scale is 0 too. A micro-block whose scale rounds to 0 in E4M3 encodes as ±0 the same way.
//! - NaN or Inf anywhere in the input of FP8 or NVFP4 is [`CodecError::NonFinite`]. Raw and raw+LZ4
//!   keep the engine's bytes exactly, whatever they are.
//!
//! Canonical scales (see [`crate::formats::canonical_scale`]) make decoding to FP32 and encoding
//! again reproduce the payload byte for byte; decoding to BF16/FP16 and re-encoding keeps every code
//! and every block scale (the FP32 scales move by the BF16/FP16 rounding of the amax).
//!
//! **Rotated codecs** (`+had`: [`CodecId::FP8_E4M3_HAD`], [`CodecId::NVFP4_HAD`] and their `+lz4`
//! forms): every row is loaded to f32 and rotated along `head_dim` ([`crate::rotation`]:
//! `y = H · diag(s) · x / sqrt(n)`), then quantized by exactly the rules above, applied to `y`
//! (amaxes, scales and codes are those of the rotated values). Decoding dequantizes to f32, applies
//! the inverse rotation with the seed recorded in the payload, and rounds once into the output
//! dtype. A row holding a value beyond 2^100 ([`crate::rotation::ROTATION_MAX_INPUT`], ≈ 1.3·10^30)
//! is [`CodecError::InvalidInput`] for the rotated codecs (NaN/Inf is [`CodecError::NonFinite`] as
//! for the plain ones), so that neither the rotation nor its inverse can overflow f32.
//!
//! Large blocks are split into row ranges handled in parallel (rayon); every row's bytes depend only
//! on that row and on per-plane values computed first, so the output does not depend on the split.

use kvtier_proto::{CodecId, DType, MemoryOrder};
use rayon::prelude::*;

use crate::block::{load_f32, BlockSpec, KvBlockView};
use crate::kernel::{scalar, Backend, Isa, ROTATED_SAFE_BITS};
use crate::payload::{Format, Fp8ScaleMode, PayloadInfo, PayloadParts, PAYLOAD_HEADER_LEN};
use crate::rotation::{Rotation, DEFAULT_ROTATION_SEED, ROTATION_MAX_DECODED, ROTATION_MAX_INPUT};
use crate::scale::{fp8_scale, nvfp4_plane_scales};
use crate::CodecError;

/// Rotated rows are handed to the kernels in batches of about this many elements (32 KiB of f32),
/// small enough to stay in the core's cache between the rotation and the quantization.
const ROTATION_BATCH_ELEMENTS: usize = 8192;

/// The largest NVFP4 global scale the fused rotated decoder takes (2^98): every decoded value is
/// then at most `6 · 448 · 2^98 < 2^110`, below [`ROTATION_MAX_DECODED`], so the check the unfused
/// path makes cannot fail. Larger ones (only in payloads the encoder did not write) take that path.
const NVFP4_FUSED_MAX_GLOBAL: f32 = 3.169_126_5e29;

/// A layer-first NVFP4 block encoded on one thread rotates each plane once into a scratch buffer
/// of at most this many bytes (and reads it for the amax, then for the codes); larger planes are
/// rotated twice, batch by batch.
const ROTATION_PLANE_SCRATCH: usize = 4 << 20;

/// The FP8 scale granularity to encode with.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Fp8Scaling {
    /// One scale per (token, KV head).
    #[default]
    PerTokenHead,
    /// One scale per (layer, K|V) from the plane's amax.
    PerTensor,
    /// One `[k_scale, v_scale]` per layer, given by the engine; each finite and positive.
    Static(Vec<[f32; 2]>),
}

/// The format and LZ4 flag a codec id names. Whether it rotates is [`is_rotated`]: the rotated
/// codecs (`+had`) have the format and LZ4 flag of their plain form.
pub fn split_codec(codec: CodecId) -> Result<(Format, bool), CodecError> {
    Ok(match codec {
        CodecId::RAW => (Format::Raw, false),
        CodecId::RAW_LZ4 => (Format::Raw, true),
        CodecId::FP8_E4M3 | CodecId::FP8_E4M3_HAD => (Format::Fp8E4m3, false),
        CodecId::FP8_E4M3_LZ4 | CodecId::FP8_E4M3_HAD_LZ4 => (Format::Fp8E4m3, true),
        CodecId::NVFP4 | CodecId::NVFP4_HAD => (Format::Nvfp4, false),
        CodecId::NVFP4_LZ4 | CodecId::NVFP4_HAD_LZ4 => (Format::Nvfp4, true),
        other => return Err(CodecError::UnknownCodec(other.0)),
    })
}

/// Whether a codec keeps every bit of the input.
pub fn is_lossless(codec: CodecId) -> bool {
    matches!(codec, CodecId::RAW | CodecId::RAW_LZ4)
}

/// Whether a codec rotates rows along `head_dim` before quantizing (the `+had` codecs, see
/// [`crate::rotation`]).
pub fn is_rotated(codec: CodecId) -> bool {
    matches!(codec, CodecId::FP8_E4M3_HAD | CodecId::FP8_E4M3_HAD_LZ4 | CodecId::NVFP4_HAD | CodecId::NVFP4_HAD_LZ4)
}

/// The rotated (`+had`) form of a quantizing codec, keeping its format and LZ4 layer; a rotated
/// codec is its own. `None` for raw, raw+LZ4 and unknown ids.
///
/// ```
/// use kvtier_kernels::rotated_variant;
/// use kvtier_proto::CodecId;
/// assert_eq!(rotated_variant(CodecId::NVFP4_LZ4), Some(CodecId::NVFP4_HAD_LZ4));
/// assert_eq!(rotated_variant(CodecId::RAW), None);
/// ```
pub fn rotated_variant(codec: CodecId) -> Option<CodecId> {
    match codec {
        CodecId::FP8_E4M3 | CodecId::FP8_E4M3_HAD => Some(CodecId::FP8_E4M3_HAD),
        CodecId::FP8_E4M3_LZ4 | CodecId::FP8_E4M3_HAD_LZ4 => Some(CodecId::FP8_E4M3_HAD_LZ4),
        CodecId::NVFP4 | CodecId::NVFP4_HAD => Some(CodecId::NVFP4_HAD),
        CodecId::NVFP4_LZ4 | CodecId::NVFP4_HAD_LZ4 => Some(CodecId::NVFP4_HAD_LZ4),
        _ => None,
    }
}

/// A configured codec.
///
/// ```
/// use kvtier_kernels::{BlockSpec, Codec, KvBlockView};
/// use kvtier_proto::{CodecId, DType};
/// // 2 layers, 4 tokens, 2 heads of 16, fp32.
/// let spec = BlockSpec::new(2, 4, 2, 16, DType::Fp32);
/// let values: Vec<f32> = (0..spec.elements()).map(|i| (i as f32 * 0.37).sin()).collect();
/// let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
/// let view = KvBlockView::new(spec, &bytes).unwrap();
///
/// let codec = Codec::new(CodecId::FP8_E4M3);
/// let payload = codec.encode(&view).unwrap();
/// assert!(payload.len() < bytes.len() / 2);
/// let back = codec.decode(&payload, &spec).unwrap();
/// assert_eq!(back.len(), bytes.len());
/// ```
#[derive(Debug, Clone)]
pub struct Codec {
    id: CodecId,
    fp8_scaling: Fp8Scaling,
    backend: Backend,
    parallel_min_bytes: usize,
    rotation_seed: u16,
}

impl Codec {
    pub fn new(id: CodecId) -> Self {
        Codec {
            id,
            fp8_scaling: Fp8Scaling::default(),
            backend: Backend::Auto,
            parallel_min_bytes: 1 << 20,
            rotation_seed: DEFAULT_ROTATION_SEED,
        }
    }

    pub fn id(&self) -> CodecId {
        self.id
    }

    /// FP8 scale granularity. Default: [`Fp8Scaling::PerTokenHead`].
    pub fn with_fp8_scaling(mut self, s: Fp8Scaling) -> Self {
        self.fp8_scaling = s;
        self
    }

    /// Kernel implementation. Default: [`Backend::Auto`].
    pub fn with_backend(mut self, b: Backend) -> Self {
        self.backend = b;
        self
    }

    /// Blocks of at least this many input bytes are split over rayon's threads; `usize::MAX`
    /// keeps every call on the calling thread. Default: 1 MiB.
    pub fn with_parallel_min_bytes(mut self, n: usize) -> Self {
        self.parallel_min_bytes = n;
        self
    }

    /// The seed of the rotation signs for the rotated (`+had`) codecs; ignored by the others. The
    /// payload records it, so decoding needs no option. Default: [`DEFAULT_ROTATION_SEED`].
    pub fn with_rotation_seed(mut self, seed: u16) -> Self {
        self.rotation_seed = seed;
        self
    }

    fn parallel(&self, bytes: usize) -> bool {
        bytes >= self.parallel_min_bytes && crate::par::current_num_threads() > 1
    }

    /// Encodes a block. `raw` returns the engine's bytes unchanged; every other codec returns a
    /// self-describing payload (see [`crate::payload`]).
    pub fn encode(&self, block: &KvBlockView) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::new();
        self.encode_into(block, &mut out)?;
        Ok(out)
    }

    /// [`Codec::encode`] into a caller's buffer (its old contents are replaced; empty on error),
    /// so a hot path can reuse it: the quantizing codecs without LZ4 write straight into it and
    /// neither allocate nor zero it when it is already big enough.
    pub fn encode_into(&self, block: &KvBlockView, out: &mut Vec<u8>) -> Result<(), CodecError> {
        let res = self.encode_into_inner(block, out);
        if res.is_err() {
            out.clear();
        }
        res
    }

    fn encode_into_inner(&self, block: &KvBlockView, out: &mut Vec<u8>) -> Result<(), CodecError> {
        let (format, lz4) = split_codec(self.id)?;
        let spec = *block.spec();
        if format == Format::Raw && !lz4 {
            out.clear();
            out.extend_from_slice(block.bytes());
            return Ok(());
        }
        if format != Format::Raw && !matches!(spec.dtype, DType::Bf16 | DType::Fp16 | DType::Fp32) {
            return Err(CodecError::UnsupportedDType {
                codec: self.id.name(),
                dtype: spec.dtype,
                why: "quantizing codecs take bf16, fp16 or fp32",
            });
        }
        let fp8_scales = match (&self.fp8_scaling, format) {
            (_, Format::Raw | Format::Nvfp4) | (Fp8Scaling::PerTokenHead, _) => Fp8ScaleMode::PerTokenHead,
            (Fp8Scaling::PerTensor, _) => Fp8ScaleMode::PerTensor,
            (Fp8Scaling::Static(_), _) => Fp8ScaleMode::Static,
        };
        let rotation_seed = is_rotated(self.id).then_some(self.rotation_seed);
        let rot = rotation_seed.map(|seed| Rotation::new(spec.row_len(), seed));
        let mut info = PayloadInfo { format, lz4, spec, fp8_scales, rotation_seed, body_len: 0 };
        let total = info.sections().total();
        info.body_len = total as u64;
        if format == Format::Raw || lz4 {
            out.clear();
            info.write_header(out);
            if format == Format::Raw {
                out.extend_from_slice(&lz4_flex::block::compress(block.bytes()));
                return Ok(());
            }
            let isa = self.backend.resolve()?;
            let mut body = vec![0u8; total];
            self.encode_body(format, &Source { isa, spec, src: block.bytes(), rot: rot.as_ref() }, &mut body)?;
            out.extend_from_slice(&lz4_flex::block::compress(&body));
            return Ok(());
        }
        let isa = self.backend.resolve()?;
        let mut header = Vec::with_capacity(PAYLOAD_HEADER_LEN);
        info.write_header(&mut header);
        debug_assert_eq!(header.len(), PAYLOAD_HEADER_LEN);
        // Old bytes are kept rather than zeroed: the header and every section of the body
        // (scales, block scales, codes) are then written in full.
        out.truncate(PAYLOAD_HEADER_LEN + total);
        out.resize(PAYLOAD_HEADER_LEN + total, 0);
        out[..PAYLOAD_HEADER_LEN].copy_from_slice(&header);
        let source = Source { isa, spec, src: block.bytes(), rot: rot.as_ref() };
        self.encode_body(format, &source, &mut out[PAYLOAD_HEADER_LEN..])
    }

    fn encode_body(&self, format: Format, source: &Source, body: &mut [u8]) -> Result<(), CodecError> {
        match format {
            Format::Fp8E4m3 => self.encode_fp8(source, body),
            Format::Nvfp4 => self.encode_nvfp4(source, body),
            Format::Raw => Ok(()),
        }
    }

    fn encode_fp8(&self, source: &Source, body: &mut [u8]) -> Result<(), CodecError> {
        let (isa, spec, src) = (source.isa, source.spec, source.src);
        let hd = spec.row_len();
        let parallel = self.parallel(src.len());
        let plane_scales: Option<Vec<f32>> = match &self.fp8_scaling {
            Fp8Scaling::PerTokenHead => None,
            Fp8Scaling::PerTensor => {
                let amax = plane_amax(source, parallel)?;
                Some(amax.iter().map(|&a| fp8_scale(a)).collect())
            }
            Fp8Scaling::Static(pairs) => {
                if pairs.len() != usize::from(spec.layers) {
                    return Err(CodecError::InvalidInput(format!(
                        "{} static scale pairs for {} layers",
                        pairs.len(),
                        spec.layers
                    )));
                }
                let flat: Vec<f32> = pairs.iter().flat_map(|p| p.iter().copied()).collect();
                if let Some(bad) = flat.iter().find(|s| !(s.is_finite() && **s > 0.0 && **s <= 1e30)) {
                    return Err(CodecError::InvalidInput(format!(
                        "static FP8 scale {bad} must be finite, positive and at most 1e30"
                    )));
                }
                // Non-finite input is an error in every mode.
                plane_amax(source, parallel)?;
                Some(flat)
            }
        };
        let (scales, codes) =
            body.split_at_mut(if plane_scales.is_some() { 4 * spec.planes() } else { 4 * spec.rows() });
        if let Some(ps) = &plane_scales {
            for (dst, s) in scales.chunks_exact_mut(4).zip(ps) {
                dst.copy_from_slice(&s.to_le_bytes());
            }
        }
        let per_row_scales = plane_scales.is_none();
        let static_scales = matches!(self.fp8_scaling, Fp8Scaling::Static(_));
        let row_bytes = hd * spec.dtype.size() as usize;
        // The kernels read `kd` rows of `krb` bytes: the block's own, or rotated f32.
        let kd = source.kernel_dtype();
        let krb = hd * kd.size() as usize;
        let chunks =
            split_rows(spec.rows(), row_bytes, parallel, codes, hd, if per_row_scales { scales } else { &mut [] }, 4);
        run(parallel, chunks, |c| {
            let r0 = c.rows.start;
            if let (None, Some(rot)) = (&plane_scales, source.rot) {
                // Rotated, one scale per row: rotated and quantized in one pass per row, the
                // range check folded into that pass where the kernel can (the rows are refused
                // afterwards, by the same check and error, and what was written discarded).
                let per = (ROTATION_BATCH_ELEMENTS / hd).max(1);
                let mut b0 = r0;
                while b0 < c.rows.end {
                    let e = (b0 + per).min(c.rows.end);
                    let (o, n) = (b0 - r0, e - b0);
                    let (sc, co) = (&mut c.b[4 * o..4 * (o + n)], &mut c.a[o * hd..(o + n) * hd]);
                    match isa.fp8_encode_rows_rotated_fused(rot, spec.dtype, source.src_rows(b0..e), sc, co) {
                        None => break,
                        Some(bits) => {
                            if bits > ROTATED_SAFE_BITS {
                                source.checked(b0..e)?;
                            }
                            b0 = e;
                        }
                    }
                }
                if b0 == c.rows.end {
                    return Ok(());
                }
                return source.checked_batches(b0..c.rows.end, |b0, bytes| {
                    let (o, n) = (b0 - r0, bytes.len() / row_bytes);
                    let (sc, co) = (&mut c.b[4 * o..4 * (o + n)], &mut c.a[o * hd..(o + n) * hd]);
                    isa.fp8_encode_rows_rotated(rot, spec.dtype, bytes, sc, co).map_err(|k| source.bad_row(b0 + k))
                });
            }
            let mut scratch = Vec::new();
            source.batches(c.rows.clone(), &mut scratch, |b0, bytes| {
                let (o, n) = (b0 - r0, bytes.len() / krb);
                match &plane_scales {
                    // One kernel call per run of rows: amax, scale and codes of each row.
                    None => isa
                        .fp8_encode_rows(kd, bytes, hd, &mut c.b[4 * o..4 * (o + n)], &mut c.a[o * hd..(o + n) * hd])
                        .map_err(|k| source.bad_row(b0 + k)),
                    Some(ps) => {
                        for k in 0..n {
                            let scale = ps[spec.plane_of_row(b0 + k)];
                            // Computed per-tensor scales bound every |x| by 448·scale; static ones do not.
                            let (scale, bounded) = if scale == 0.0 { (1.0, true) } else { (scale, !static_scales) };
                            isa.fp8_encode_row(
                                kd,
                                &bytes[k * krb..(k + 1) * krb],
                                scale,
                                bounded,
                                &mut c.a[(o + k) * hd..(o + k + 1) * hd],
                            );
                        }
                        Ok(())
                    }
                }
            })
        })
    }

    fn encode_nvfp4(&self, source: &Source, body: &mut [u8]) -> Result<(), CodecError> {
        let (isa, spec, src) = (source.isa, source.spec, source.src);
        let es = spec.dtype.size() as usize;
        let hd = spec.row_len();
        let parallel = self.parallel(src.len());
        let nb = hd.div_ceil(16);
        let cb = hd.div_ceil(2);
        let (scales, rest) = body.split_at_mut(4 * spec.planes());
        let (bs, codes) = rest.split_at_mut(spec.rows() * nb);
        // The kernels read rows of `kspec`: the block's own, or rotated f32.
        let kspec = spec.with_dtype(source.kernel_dtype());
        let per_plane = spec.rows() / spec.planes();
        let plane_fits = source.rot.is_none() || per_plane * hd * 4 <= ROTATION_PLANE_SCRATCH;
        let per_plane_pass = spec.order == MemoryOrder::LayerFirst && plane_fits && (!parallel || source.rot.is_some());
        if per_plane_pass {
            // One plane at a time (its rows are contiguous): its amax, then its codes while its
            // bytes are still in cache (rotated once, when rotating). The same bytes as the two
            // passes below; on a NaN or Inf the partly written body is discarded by the caller.
            // Rotating, the planes are also the parallel split (each plane is rotated once).
            let row_bytes = hd * es;
            let mut planes = scales
                .chunks_exact_mut(4)
                .zip(bs.chunks_exact_mut(per_plane * nb).zip(codes.chunks_exact_mut(per_plane * cb)))
                .enumerate();
            type Plane<'b> = (usize, (&'b mut [u8], (&'b mut [u8], &'b mut [u8])));
            let plane = |scratch: &mut Vec<u8>, (p, (pscale, (pbs, pcodes))): Plane| {
                let rows = p * per_plane..(p + 1) * per_plane;
                if let Some(rot) = source.rot {
                    // Rotated into `scratch` with the plane's amax taken from the registers, the
                    // range check proven by it (or made on the source when it cannot be), then
                    // the codes from `scratch` while it is in cache.
                    scratch.resize(per_plane * hd * 4, 0);
                    if let Some(bits) = isa.rotate_rows_max(rot, spec.dtype, source.src_rows(rows.clone()), scratch) {
                        if bits > ROTATED_SAFE_BITS {
                            source.checked(rows.clone())?;
                        }
                        let (g, enc) = nvfp4_plane_scales(f32::from_bits(bits));
                        pscale.copy_from_slice(&g.to_le_bytes());
                        isa.nvfp4_encode_plane_f32(hd, scratch, g, enc, pbs, pcodes);
                        return Ok(());
                    }
                }
                let psrc = source.whole(rows.clone(), scratch)?;
                let bits = isa.row_amax_bits(kspec.dtype, psrc);
                if bits >= 0x7F80_0000 {
                    return Err(source.first_bad_row(rows.start, psrc));
                }
                // The kernel reads the scales of the planes of its rows: only plane p's here.
                let (mut g, mut enc) = (vec![0f32; spec.planes()], vec![0f32; spec.planes()]);
                (g[p], enc[p]) = nvfp4_plane_scales(f32::from_bits(bits));
                pscale.copy_from_slice(&g[p].to_le_bytes());
                let next = match source.rot {
                    None => &src[rows.end * row_bytes..((rows.end + per_plane) * row_bytes).min(src.len())],
                    Some(_) => &[],
                };
                isa.nvfp4_encode_rows(&kspec, rows.start, psrc, next, &g, &enc, pbs, pcodes);
                Ok(())
            };
            return if parallel {
                let planes = planes.collect::<Vec<_>>();
                let results: Vec<Result<(), CodecError>> =
                    crate::par::run(|| planes.into_par_iter().map_init(Vec::new, plane).collect());
                results.into_iter().collect()
            } else {
                let mut scratch = Vec::new();
                planes.try_for_each(|item| plane(&mut scratch, item))
            };
        }
        let amax = plane_amax(source, parallel)?;
        let (g, enc): (Vec<f32>, Vec<f32>) = amax.iter().map(|&a| nvfp4_plane_scales(a)).unzip();
        for (dst, s) in scales.chunks_exact_mut(4).zip(&g) {
            dst.copy_from_slice(&s.to_le_bytes());
        }
        let krb = hd * kspec.dtype.size() as usize;
        let chunks = split_rows(spec.rows(), hd * es, parallel, codes, cb, bs, nb);
        run(parallel, chunks, |c| {
            let r0 = c.rows.start;
            let mut scratch = Vec::new();
            source.batches(c.rows.clone(), &mut scratch, |b0, bytes| {
                let (o, n) = (b0 - r0, bytes.len() / krb);
                let (cbs, ccodes) = (&mut c.b[o * nb..(o + n) * nb], &mut c.a[o * cb..(o + n) * cb]);
                isa.nvfp4_encode_rows(&kspec, b0, bytes, &[], &g, &enc, cbs, ccodes);
                Ok(())
            })
        })
    }

    /// Decodes a payload of `spec` (the block as it was encoded: the frame's layout and token
    /// count) into `spec.dtype`.
    pub fn decode(&self, payload: &[u8], spec: &BlockSpec) -> Result<Vec<u8>, CodecError> {
        // The output is as large as `spec` says, and `spec` may come from a frame header someone
        // else wrote: nothing is allocated before the payload is known to hold that block.
        spec.validate()?;
        let (format, lz4) = split_codec(self.id)?;
        if format == Format::Raw && !lz4 {
            raw_of(payload, spec)?;
        } else {
            payload_of(payload, spec)?;
        }
        let mut out = vec![0u8; spec.byte_len()];
        self.decode_into(payload, spec, spec.dtype, &mut out)?;
        Ok(out)
    }

    /// Decodes a payload of `spec` into `out`, as `out_dtype` elements in `spec`'s memory order.
    /// `out` must be exactly `spec.elements() * out_dtype.size()` bytes.
    pub fn decode_into(
        &self,
        payload: &[u8],
        spec: &BlockSpec,
        out_dtype: DType,
        out: &mut [u8],
    ) -> Result<(), CodecError> {
        spec.validate()?;
        let (format, lz4) = split_codec(self.id)?;
        let want = spec.elements() * out_dtype.size() as usize;
        if out.len() != want {
            return Err(CodecError::InvalidInput(format!("output buffer is {} bytes, {want} needed", out.len())));
        }
        let isa = self.backend.resolve()?;
        let parallel = self.parallel(out.len());
        if format == Format::Raw && !lz4 {
            raw_of(payload, spec)?;
            return convert(spec, payload, out_dtype, out, parallel);
        }
        // The header first (cheap): a payload of another shape is refused before its body is
        // decompressed.
        let info = payload_of(payload, spec)?;
        let parts = PayloadParts::open(payload)?;
        let rotated = is_rotated(self.id);
        if info.format != format || info.lz4 != lz4 || info.rotation_seed.is_some() != rotated {
            return Err(CodecError::Corrupt(format!(
                "payload is {:?} (lz4 {}, rotated {}), codec {} expects {format:?} (lz4 {lz4}, rotated {rotated})",
                info.format,
                info.lz4,
                info.rotation_seed.is_some(),
                self.id.name()
            )));
        }
        let os = out_dtype.size() as usize;
        let hd = spec.row_len();
        let rot = info.rotation_seed.map(|seed| Rotation::new(hd, seed));
        let sink = Sink { isa, rot: rot.as_ref(), hd, out_dtype };
        match format {
            Format::Raw => convert(spec, parts.codes(), out_dtype, out, parallel),
            Format::Fp8E4m3 => {
                let scales = parts.scales();
                // What the encoder never writes: a negative scale (-0.0 too, which backends would
                // decode to zeros of different signs), or one above that of the largest finite
                // amax (its codes would decode past f32).
                let max = fp8_scale(f32::MAX);
                if scales.iter().any(|s| !s.is_finite() || s.is_sign_negative() || *s > max) {
                    return Err(CodecError::Corrupt("FP8 scale is negative, not finite or out of range".into()));
                }
                let per_row = info.fp8_scales == Fp8ScaleMode::PerTokenHead;
                let codes = parts.codes();
                let chunks = split_rows(spec.rows(), hd * os, parallel, out, hd * os, &mut [], 0);
                let scale_of = |r: usize| if per_row { scales[r] } else { scales[spec.plane_of_row(r)] };
                // Plain, or rotated where a fused kernel dequantizes and inverse-rotates in one
                // pass per row (no f32 rows in memory; scales this small keep every decoded value
                // below ROTATION_MAX_DECODED): one kernel call per chunk of rows, each row's
                // scale a plain index the kernel inlines.
                let fused = rot.as_ref().filter(|rot| {
                    isa.fuses_rotated_decode(rot, out_dtype) && scales.iter().all(|s| *s <= ROTATION_MAX_INPUT)
                });
                if rot.is_none() || fused.is_some() {
                    return run(parallel, chunks, |c| {
                        let (r0, r1) = (c.rows.start, c.rows.end);
                        let codes = &codes[r0 * hd..r1 * hd];
                        let bad = if per_row {
                            let row_scales = &scales[r0..r1];
                            fp8_rows(isa, fused, codes, hd, |k| row_scales[k], out_dtype, c.a)
                        } else {
                            fp8_rows(isa, fused, codes, hd, plane_values(spec, r0, &scales), out_dtype, c.a)
                        };
                        if bad {
                            Err(bad_code())
                        } else {
                            Ok(())
                        }
                    });
                }
                run(parallel, chunks, |c| {
                    sink.rows(c, |r, dtype, dst| {
                        isa.fp8_decode_row(&codes[r * hd..(r + 1) * hd], scale_of(r), dtype, dst)
                    })
                })
            }
            Format::Nvfp4 => {
                let g = parts.scales();
                // As for FP8: what the encoder never writes.
                let max = nvfp4_plane_scales(f32::MAX).0;
                if g.iter().any(|s| !s.is_finite() || s.is_sign_negative() || *s > max) {
                    return Err(CodecError::Corrupt(
                        "NVFP4 global scale is negative, not finite or out of range".into(),
                    ));
                }
                let (bs, codes) = (parts.block_scales(), parts.codes());
                let (nb, cb) = (hd.div_ceil(16), hd.div_ceil(2));
                let chunks = split_rows(spec.rows(), hd * os, parallel, out, hd * os, &mut [], 0);
                if let Some(rot) = rot.as_ref().filter(|rot| {
                    isa.fuses_rotated_decode(rot, out_dtype) && g.iter().all(|s| *s <= NVFP4_FUSED_MAX_GLOBAL)
                }) {
                    // Dequantized and inverse-rotated in one pass per row (no f32 rows in memory);
                    // global scales this small keep every decoded value below ROTATION_MAX_DECODED.
                    return run(parallel, chunks, |c| {
                        let (r0, r1) = (c.rows.start, c.rows.end);
                        let bad = isa.nvfp4_decode_rows_rotated(
                            rot,
                            &bs[r0 * nb..r1 * nb],
                            &codes[r0 * cb..r1 * cb],
                            plane_values(spec, r0, &g),
                            out_dtype,
                            c.a,
                        );
                        if bad {
                            Err(bad_code())
                        } else {
                            Ok(())
                        }
                    });
                }
                run(parallel, chunks, |c| {
                    sink.rows(c, |r, dtype, dst| {
                        let gp = g[spec.plane_of_row(r)];
                        isa.nvfp4_decode_row(
                            &bs[r * nb..(r + 1) * nb],
                            &codes[r * cb..(r + 1) * cb],
                            gp,
                            hd,
                            dtype,
                            dst,
                        )
                    })
                })
            }
        }
    }
}

/// Checks that a raw (uncompressed, unencoded) `payload` is exactly a block of `spec`.
fn raw_of(payload: &[u8], spec: &BlockSpec) -> Result<(), CodecError> {
    if payload.len() != spec.byte_len() {
        return Err(CodecError::Corrupt(format!(
            "raw payload is {} bytes, {} expected",
            payload.len(),
            spec.byte_len()
        )));
    }
    Ok(())
}

/// The header of an encoded `payload`, checked to describe a block of `spec`, and its body's
/// length to be one the stored bytes can hold (LZ4 expands ~255× at most).
fn payload_of(payload: &[u8], spec: &BlockSpec) -> Result<PayloadInfo, CodecError> {
    let info = crate::payload::inspect(payload)?;
    if info.spec != *spec {
        return Err(CodecError::ShapeMismatch { expected: format!("{spec:?}"), found: format!("{:?}", info.spec) });
    }
    crate::payload::check_stored(&info, payload)?;
    Ok(info)
}

/// Encodes with the default options of [`Codec::new`].
pub fn encode(codec: CodecId, block: &KvBlockView) -> Result<Vec<u8>, CodecError> {
    Codec::new(codec).encode(block)
}

/// Decodes into `spec.dtype` with the default options of [`Codec::new`].
pub fn decode(codec: CodecId, payload: &[u8], spec: &BlockSpec) -> Result<Vec<u8>, CodecError> {
    Codec::new(codec).decode(payload, spec)
}

/// A range of rows and the matching pieces of up to two output sections.
struct Chunk<'a> {
    rows: std::ops::Range<usize>,
    a: &'a mut [u8],
    b: &'a mut [u8],
}

/// Splits `rows` rows (of `row_in_bytes` input bytes each) into chunks, cutting section `a`
/// (`a_row` bytes per row) and `b` (`b_row` bytes per row) to match. One chunk unless `parallel`.
fn split_rows<'a>(
    rows: usize,
    row_in_bytes: usize,
    parallel: bool,
    mut a: &'a mut [u8],
    a_row: usize,
    mut b: &'a mut [u8],
    b_row: usize,
) -> Vec<Chunk<'a>> {
    // About 256 KiB of input per chunk: big enough to amortize the task, small enough to balance.
    let per = if parallel { (256 * 1024 / row_in_bytes.max(1)).max(1) } else { rows.max(1) };
    let mut out = Vec::with_capacity(rows.div_ceil(per));
    let mut r = 0;
    while r < rows {
        let n = per.min(rows - r);
        let (na, nb) = ((n * a_row).min(a.len()), (n * b_row).min(b.len()));
        let (ha, ta) = std::mem::take(&mut a).split_at_mut(na);
        let (hb, tb) = std::mem::take(&mut b).split_at_mut(nb);
        out.push(Chunk { rows: r..r + n, a: ha, b: hb });
        a = ta;
        b = tb;
        r += n;
    }
    out
}

/// Runs `f` on every chunk, in parallel or in order, and returns the first error in row order.
fn run<'a, F>(parallel: bool, chunks: Vec<Chunk<'a>>, f: F) -> Result<(), CodecError>
where
    F: Fn(Chunk<'a>) -> Result<(), CodecError> + Sync + Send,
{
    if parallel && chunks.len() > 1 {
        let results: Vec<Result<(), CodecError>> = crate::par::run(|| chunks.into_par_iter().map(&f).collect());
        results.into_iter().collect()
    } else {
        chunks.into_iter().try_for_each(f)
    }
}

/// The rows the quantizing kernels read: the block's own bytes, or (the rotated codecs) its rows
/// rotated into little-endian f32, a batch at a time.
struct Source<'a> {
    isa: Isa,
    spec: BlockSpec,
    src: &'a [u8],
    rot: Option<&'a Rotation>,
}

impl Source<'_> {
    /// The dtype of the rows the kernels get.
    fn kernel_dtype(&self) -> DType {
        if self.rot.is_some() {
            DType::Fp32
        } else {
            self.spec.dtype
        }
    }

    fn src_rows(&self, rows: std::ops::Range<usize>) -> &[u8] {
        let rb = self.spec.row_len() * self.spec.dtype.size() as usize;
        &self.src[rows.start * rb..rows.end * rb]
    }

    /// Rows `rows` as the kernels read them, in one piece (rotated into `scratch` if rotating).
    /// Rotating, a row holding a NaN, an infinity or a value beyond [`ROTATION_MAX_INPUT`] is an
    /// error here, before it is rotated.
    fn whole<'s>(&'s self, rows: std::ops::Range<usize>, scratch: &'s mut Vec<u8>) -> Result<&'s [u8], CodecError> {
        let Some(rot) = self.rot else {
            return Ok(self.src_rows(rows));
        };
        let src = self.checked(rows.clone())?;
        scratch.resize(rows.len() * self.spec.row_len() * 4, 0);
        self.isa.rotate_rows(rot, self.spec.dtype, src, scratch);
        Ok(scratch)
    }

    /// The block's own bytes of `rows`, after the check the rotated codecs make before rotating
    /// (see [`Source::whole`]).
    fn checked(&self, rows: std::ops::Range<usize>) -> Result<&[u8], CodecError> {
        let src = self.src_rows(rows.clone());
        if self.isa.row_amax_bits(self.spec.dtype, src) > ROTATION_MAX_INPUT.to_bits() {
            let bad = rows
                .clone()
                .find(|&r| {
                    let bits = self.isa.row_amax_bits(self.spec.dtype, self.src_rows(r..r + 1));
                    bits > ROTATION_MAX_INPUT.to_bits()
                })
                .unwrap_or(rows.start);
            let bits = scalar::row_amax_bits(self.spec.dtype, self.src_rows(bad..bad + 1));
            if bits >= 0x7F80_0000 {
                return Err(non_finite(&self.spec, self.src, bad));
            }
            let (layer, is_v, token, head) = self.spec.locate_row(bad);
            return Err(CodecError::InvalidInput(format!(
                "layer {layer}, {}, token {token}, head {head}: |x| = {:e} is beyond the rotated codecs' \
                 limit 2^100 (so that neither the rotation nor its inverse can overflow f32); use the codec \
                 without +had",
                if is_v { "V" } else { "K" },
                f32::from_bits(bits)
            )));
        }
        Ok(src)
    }

    /// Calls `f(first row, bytes)` on consecutive runs of whole rows covering `rows`, as the
    /// kernels read them: all of `rows` at once, or rotated batches of about
    /// [`ROTATION_BATCH_ELEMENTS`].
    fn batches<F>(&self, rows: std::ops::Range<usize>, scratch: &mut Vec<u8>, mut f: F) -> Result<(), CodecError>
    where
        F: FnMut(usize, &[u8]) -> Result<(), CodecError>,
    {
        if self.rot.is_none() {
            return f(rows.start, self.src_rows(rows));
        }
        let per = (ROTATION_BATCH_ELEMENTS / self.spec.row_len()).max(1);
        let mut r = rows.start;
        while r < rows.end {
            let e = (r + per).min(rows.end);
            f(r, self.whole(r..e, scratch)?)?;
            r = e;
        }
        Ok(())
    }

    /// Calls `f(first row, bytes)` on runs of whole rows covering `rows` with the block's own
    /// bytes, each run [`Source::checked`] first, for the kernels that rotate as they go.
    fn checked_batches<F>(&self, rows: std::ops::Range<usize>, mut f: F) -> Result<(), CodecError>
    where
        F: FnMut(usize, &[u8]) -> Result<(), CodecError>,
    {
        let per = (ROTATION_BATCH_ELEMENTS / self.spec.row_len()).max(1);
        let mut r = rows.start;
        while r < rows.end {
            let e = (r + per).min(rows.end);
            f(r, self.checked(r..e)?)?;
            r = e;
        }
        Ok(())
    }

    /// The error for row `r`, whose kernel input holds a NaN or an infinity (rotated rows never
    /// do: [`Source::whole`] refuses their sources first).
    fn bad_row(&self, r: usize) -> CodecError {
        non_finite(&self.spec, self.src, r)
    }

    /// [`Source::bad_row`] for the first row of `bytes` (kernel rows from row `r0` on) whose amax is
    /// not finite (one of them is not).
    fn first_bad_row(&self, r0: usize, bytes: &[u8]) -> CodecError {
        let krb = self.spec.row_len() * self.kernel_dtype().size() as usize;
        let k = bytes
            .chunks_exact(krb)
            .position(|row| self.isa.row_amax_bits(self.kernel_dtype(), row) >= 0x7F80_0000)
            .unwrap_or(0);
        self.bad_row(r0 + k)
    }
}

/// Where decoded rows go: straight into the output, or (rotated payloads) through f32 and the
/// inverse rotation.
struct Sink<'a> {
    isa: Isa,
    rot: Option<&'a Rotation>,
    hd: usize,
    out_dtype: DType,
}

impl Sink<'_> {
    /// Decodes the rows of chunk `c` into `c.a` through `row(r, dtype, dst)`, which writes row `r`
    /// into `dst` as `dtype` and returns true on a code the encoder never writes.
    fn rows<F>(&self, c: Chunk, row: F) -> Result<(), CodecError>
    where
        F: Fn(usize, DType, &mut [u8]) -> bool,
    {
        let (hd, os) = (self.hd, self.out_dtype.size() as usize);
        let r0 = c.rows.start;
        let Some(rot) = self.rot else {
            for (k, r) in c.rows.enumerate() {
                if row(r, self.out_dtype, &mut c.a[k * hd * os..(k + 1) * hd * os]) {
                    return Err(bad_code());
                }
            }
            return Ok(());
        };
        let per = (ROTATION_BATCH_ELEMENTS / hd).max(1);
        let mut scratch = vec![0u8; per.min(c.rows.len()) * hd * 4];
        let mut b = r0;
        while b < c.rows.end {
            let e = (b + per).min(c.rows.end);
            let f32s = &mut scratch[..(e - b) * hd * 4];
            for (k, dst) in (b..e).zip(f32s.chunks_exact_mut(hd * 4)) {
                if row(k, DType::Fp32, dst) {
                    return Err(bad_code());
                }
            }
            // The encoder's values stay far below this; larger ones could overflow in the inverse
            // (whose output is then discarded).
            let amax =
                self.isa.unrotate_rows(rot, f32s, self.out_dtype, &mut c.a[(b - r0) * hd * os..(e - r0) * hd * os]);
            if amax > ROTATION_MAX_DECODED.to_bits() {
                return Err(CodecError::Corrupt("rotated payload decodes to values the encoder never writes".into()));
            }
            b = e;
        }
        Ok(())
    }
}

/// FP8 rows of `hd` codes decoded into `dst` as `out` by one kernel call: the fused rotated
/// decoder under `rot`, else the plain one; whether a code the encoder never writes was met.
fn fp8_rows<F: Fn(usize) -> f32>(
    isa: Isa,
    rot: Option<&Rotation>,
    codes: &[u8],
    hd: usize,
    scale: F,
    out: DType,
    dst: &mut [u8],
) -> bool {
    match rot {
        Some(rot) => isa.fp8_decode_rows_rotated(rot, codes, scale, out, dst),
        None => isa.fp8_decode_rows(codes, hd, scale, out, dst),
    }
}

/// `k ↦ values[plane of row r0 + k]` for calls with `k` never decreasing, as the row kernels make
/// them: the plane (a division) is found once per run of rows sharing it, not once per row.
fn plane_values<'a>(spec: &'a BlockSpec, r0: usize, values: &'a [f32]) -> impl Fn(usize) -> f32 + 'a {
    let run = std::cell::Cell::new((r0, r0, 0f32));
    move |k| {
        let r = r0 + k;
        let (start, end, v) = run.get();
        if (start..end).contains(&r) {
            return v;
        }
        let v = values[spec.plane_of_row(r)];
        run.set((r, spec.plane_run_end(r), v));
        v
    }
}

/// The error for a payload holding a code the encoder never writes.
fn bad_code() -> CodecError {
    CodecError::Corrupt("payload holds a NaN or signed scale code the encoder never writes".into())
}

/// Largest `|x|` of every plane of the rows `source` gives the kernels; [`CodecError::NonFinite`]
/// at the first NaN/Inf in row order.
fn plane_amax(source: &Source, parallel: bool) -> Result<Vec<f32>, CodecError> {
    let (isa, spec) = (source.isa, source.spec);
    let row_bytes = spec.row_len() * spec.dtype.size() as usize;
    let rows = spec.rows();
    let kd = source.kernel_dtype();
    let scan = |range: std::ops::Range<usize>| -> Result<Vec<u32>, CodecError> {
        let mut m = vec![0u32; spec.planes()];
        let mut scratch = Vec::new();
        let mut r = range.start;
        while r < range.end {
            // One kernel call per run of consecutive rows of the same plane (a whole plane's
            // share of the range in layer-first order, `kv_heads` rows in block-first order).
            let p = spec.plane_of_row(r);
            let e = spec.plane_run_end(r).min(range.end);
            source.batches(r..e, &mut scratch, |b0, bytes| {
                let bits = isa.row_amax_bits(kd, bytes);
                if bits >= 0x7F80_0000 {
                    return Err(source.first_bad_row(b0, bytes));
                }
                m[p] = m[p].max(bits);
                Ok(())
            })?;
            r = e;
        }
        Ok(m)
    };
    let maxes = if parallel {
        let per = (256 * 1024 / row_bytes.max(1)).max(1);
        let parts: Vec<Result<Vec<u32>, CodecError>> = crate::par::run(|| {
            (0..rows.div_ceil(per)).into_par_iter().map(|i| scan(i * per..((i + 1) * per).min(rows))).collect()
        });
        let mut m = vec![0u32; spec.planes()];
        for part in parts {
            for (a, b) in m.iter_mut().zip(part?) {
                *a = (*a).max(b);
            }
        }
        m
    } else {
        scan(0..rows)?
    };
    Ok(maxes.into_iter().map(f32::from_bits).collect())
}

fn non_finite(spec: &BlockSpec, src: &[u8], r: usize) -> CodecError {
    let hd = spec.row_len();
    let (layer, is_v, token, head) = spec.locate_row(r);
    let (dim, value) = (0..hd)
        .map(|d| (d, load_f32(spec.dtype, src, r * hd + d)))
        .find(|(_, v)| !v.is_finite())
        .unwrap_or((0, f32::NAN));
    CodecError::NonFinite { layer, kv: if is_v { "V" } else { "K" }, token, head, dim, value }
}

/// Copies or converts raw elements into `out_dtype`.
fn convert(spec: &BlockSpec, src: &[u8], out_dtype: DType, out: &mut [u8], parallel: bool) -> Result<(), CodecError> {
    if spec.dtype == out_dtype {
        out.copy_from_slice(src);
        return Ok(());
    }
    let (is, os, hd) = (spec.dtype.size() as usize, out_dtype.size() as usize, spec.row_len());
    let chunks = split_rows(spec.rows(), hd * os, parallel, out, hd * os, &mut [], 0);
    run(parallel, chunks, |c| {
        let r0 = c.rows.start;
        let n = c.rows.len();
        scalar::convert_row(spec.dtype, &src[r0 * hd * is..(r0 + n) * hd * is], out_dtype, c.a);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::{CodecId, DType};

    #[test]
    fn a_header_claiming_a_huge_block_is_refused_before_anything_that_size_is_allocated() {
        // 2^40 elements of f32 (4 TiB decoded) claimed by 100 bytes of LZ4: were the block
        // allocated first, this test would abort.
        let spec = BlockSpec::new(1024, 65536, 64, 128, DType::Fp32);
        spec.validate().unwrap();
        let mut info = PayloadInfo {
            format: Format::Fp8E4m3,
            lz4: true,
            spec,
            fp8_scales: Fp8ScaleMode::PerTokenHead,
            rotation_seed: None,
            body_len: 0,
        };
        info.body_len = info.sections().total() as u64;
        let mut payload = Vec::new();
        info.write_header(&mut payload);
        payload.extend_from_slice(&[0u8; 100]);
        let err = Codec::new(CodecId::FP8_E4M3_LZ4).decode(&payload, &spec).unwrap_err();
        assert!(matches!(&err, CodecError::Corrupt(m) if m.contains("LZ4 bytes cannot hold")), "{err}");
        // A frame's spec that is not the payload's own: refused on the header alone.
        let small = BlockSpec::new(2, 16, 2, 64, DType::Bf16);
        let err = Codec::new(CodecId::FP8_E4M3_LZ4).decode(&payload, &small).unwrap_err();
        assert!(matches!(err, CodecError::ShapeMismatch { .. }), "{err}");
    }

    #[test]
    fn scales_the_encoder_never_writes_are_corrupt_on_every_path() {
        let spec = BlockSpec::new(2, 16, 2, 64, DType::Bf16);
        let bytes: Vec<u8> = (0..spec.byte_len()).map(|i| (i % 97) as u8 & 0x3f).collect();
        let block = KvBlockView::new(spec, &bytes).unwrap();
        for codec in [CodecId::FP8_E4M3, CodecId::NVFP4, CodecId::FP8_E4M3_HAD, CodecId::NVFP4_HAD] {
            let good = encode(codec, &block).unwrap();
            Codec::new(codec).decode(&good, &spec).unwrap();
            // The first scale of the body: an FP8 row's, or an NVFP4 plane's global one.
            for bad in [-0.0f32, -1.0, f32::INFINITY, f32::NAN, 1e36, f32::MAX] {
                let mut p = good.clone();
                p[PAYLOAD_HEADER_LEN..PAYLOAD_HEADER_LEN + 4].copy_from_slice(&bad.to_le_bytes());
                let err = Codec::new(codec).decode(&p, &spec).unwrap_err();
                assert!(matches!(err, CodecError::Corrupt(_)), "{} scale {bad}: {err}", codec.name());
            }
        }
    }
}
