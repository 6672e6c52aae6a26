//! The self-describing payload every codec except plain `raw` writes: a 32-byte header saying
//! format, shape, dtype, scale mode and rotation, then a body, LZ4-compressed when the codec says so.
//!
//! (`raw` payloads are the engine's bytes exactly, because the block frame checks a raw payload's
//! length against the layout; the frame header carries their shape.)
//!
//! Header, little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVQ1` |
//! | 4 | 1 | format: 0 raw, 1 fp8-e4m3, 2 nvfp4 |
//! | 5 | 1 | flags: bit 0 = body is LZ4 (`lz4_flex` block format); bit 1 = rotated (the `+had` codecs: values were rotated along `head_dim` before quantization, see [`crate::rotation`]); other bits zero |
//! | 6 | 1 | source dtype (`kvtier_proto::DType` code) |
//! | 7 | 1 | memory order (`kvtier_proto::MemoryOrder` code) |
//! | 8 | 1 | FP8 scale mode: 0 per (token, head), 1 per tensor, 2 static per tensor; else 0 |
//! | 9 | 1 | rotation scheme: 1 = randomized Hadamard v1 ([`crate::rotation`]) when flags bit 1 is set; else 0 |
//! | 10 | 2 | rotation seed (u16) when rotated; else 0 |
//! | 12 | 2 | layers |
//! | 14 | 2 | kv heads |
//! | 16 | 2 | head dim |
//! | 18 | 2 | bitwise NOT of the rotation seed when rotated (a check: a corrupted seed is an error, not a silently different rotation); else 0 |
//! | 20 | 4 | tokens |
//! | 24 | 8 | body length before compression |
//!
//! Payloads written before the rotated codecs existed have zeros in bytes 9..12 and 18..20 and
//! read the same as before; [`inspect`] refuses any other combination (a rotated format raw, a
//! scheme without the flag, a seed check that does not match, a non-zero byte where nothing is
//! rotated).
//!
//! Body, in this order (rows as in [`crate::block`]; plane `p = 2·layer + (0 for K, 1 for V)`):
//!
//! - **raw**: the source bytes.
//! - **fp8-e4m3**: decode scales as f32 (one per row, or one per plane), then one code byte per
//!   element in the source's memory order. Value = `e4m3(code) × scale`.
//! - **nvfp4**: one f32 global decode scale per plane, then `ceil(head_dim/16)` E4M3 block-scale
//!   bytes per row, then `ceil(head_dim/2)` code bytes per row (element 2i in the low nibble,
//!   a padding nibble is 0). Value = `e2m1(code) × (e4m3(block scale) × global)`.
//!
//! A rotated payload's body is exactly the body of its plain format for the rotated rows (the
//! scales are those of the rotated values); the decoder applies the inverse rotation after
//! dequantizing.

use std::borrow::Cow;

use kvtier_proto::{DType, MemoryOrder};

use crate::{BlockSpec, CodecError};

pub const PAYLOAD_MAGIC: [u8; 4] = *b"KVQ1";
pub const PAYLOAD_HEADER_LEN: usize = 32;
/// Header byte 9 of a rotated payload: the randomized Hadamard rotation of [`crate::rotation`].
pub const ROTATION_SCHEME_HADAMARD: u8 = 1;
const FLAG_LZ4: u8 = 1;
const FLAG_ROTATED: u8 = 2;

/// How the body holds the values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    Raw,
    Fp8E4m3,
    Nvfp4,
}

/// Granularity of FP8 scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fp8ScaleMode {
    /// One scale per (token, KV head): `amax / 448`, canonicalized. The default.
    #[default]
    PerTokenHead,
    /// One scale per (layer, K|V), computed from the plane's amax.
    PerTensor,
    /// One scale per (layer, K|V), given by the caller (an engine's `k_scale`/`v_scale`).
    Static,
}

/// What a payload header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadInfo {
    pub format: Format,
    pub lz4: bool,
    /// Shape, source dtype and memory order of the block that was encoded.
    pub spec: BlockSpec,
    pub fp8_scales: Fp8ScaleMode,
    /// The rotation seed when the rows were rotated before quantization (the `+had` codecs, see
    /// [`crate::rotation`]); `None` otherwise.
    pub rotation_seed: Option<u16>,
    /// Body length before compression.
    pub body_len: u64,
}

/// Byte lengths of the three body sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sections {
    /// f32 scales: per row or per plane (FP8), per plane (NVFP4 global); none for raw.
    pub scales: usize,
    /// NVFP4 block scales; none otherwise.
    pub block_scales: usize,
    /// Codes (or raw bytes).
    pub codes: usize,
}

impl Sections {
    pub fn total(&self) -> usize {
        self.scales + self.block_scales + self.codes
    }
}

impl PayloadInfo {
    pub fn sections(&self) -> Sections {
        let s = &self.spec;
        let rows = s.rows();
        let hd = s.row_len();
        match self.format {
            Format::Raw => Sections { scales: 0, block_scales: 0, codes: s.byte_len() },
            Format::Fp8E4m3 => {
                let n = if self.fp8_scales == Fp8ScaleMode::PerTokenHead { rows } else { s.planes() };
                Sections { scales: 4 * n, block_scales: 0, codes: s.elements() }
            }
            Format::Nvfp4 => {
                Sections { scales: 4 * s.planes(), block_scales: rows * hd.div_ceil(16), codes: rows * hd.div_ceil(2) }
            }
        }
    }

    pub(crate) fn write_header(&self, out: &mut Vec<u8>) {
        let s = &self.spec;
        out.extend_from_slice(&PAYLOAD_MAGIC);
        out.push(match self.format {
            Format::Raw => 0,
            Format::Fp8E4m3 => 1,
            Format::Nvfp4 => 2,
        });
        out.push(if self.lz4 { FLAG_LZ4 } else { 0 } | if self.rotation_seed.is_some() { FLAG_ROTATED } else { 0 });
        out.push(s.dtype as u8);
        out.push(s.order as u8);
        out.push(match self.fp8_scales {
            Fp8ScaleMode::PerTokenHead => 0,
            Fp8ScaleMode::PerTensor => 1,
            Fp8ScaleMode::Static => 2,
        });
        match self.rotation_seed {
            Some(seed) => {
                out.push(ROTATION_SCHEME_HADAMARD);
                out.extend_from_slice(&seed.to_le_bytes());
            }
            None => out.extend_from_slice(&[0; 3]),
        }
        out.extend_from_slice(&s.layers.to_le_bytes());
        out.extend_from_slice(&s.kv_heads.to_le_bytes());
        out.extend_from_slice(&s.head_dim.to_le_bytes());
        out.extend_from_slice(&self.rotation_seed.map_or(0, |seed| !seed).to_le_bytes());
        out.extend_from_slice(&s.tokens.to_le_bytes());
        out.extend_from_slice(&self.body_len.to_le_bytes());
    }
}

/// Checks that the bytes after `info`'s header (from [`inspect`] of `payload`) can hold its body:
/// exactly its length, or for LZ4 no more than LZ4 can expand them to (~255×). Refusing more
/// keeps a corrupt header from asking for a huge allocation, of the body or of the decoded block.
pub fn check_stored(info: &PayloadInfo, payload: &[u8]) -> Result<(), CodecError> {
    let stored = payload.len().saturating_sub(PAYLOAD_HEADER_LEN) as u64;
    let body_len = info.body_len;
    if info.lz4 && body_len > stored.saturating_mul(256) + 64 {
        return Err(CodecError::Corrupt(format!("{stored} LZ4 bytes cannot hold {body_len}")));
    }
    if !info.lz4 && stored != body_len {
        return Err(CodecError::Corrupt(format!("body is {stored} bytes, header says {body_len}")));
    }
    Ok(())
}

/// Reads and checks a payload header (not the body).
pub fn inspect(payload: &[u8]) -> Result<PayloadInfo, CodecError> {
    let corrupt = |m: String| Err(CodecError::Corrupt(m));
    if payload.len() < PAYLOAD_HEADER_LEN {
        return corrupt(format!("{} bytes is shorter than the {PAYLOAD_HEADER_LEN}-byte header", payload.len()));
    }
    if payload[0..4] != PAYLOAD_MAGIC {
        return corrupt(format!("bad magic {:02x?}", &payload[0..4]));
    }
    let u16_at = |o: usize| u16::from_le_bytes([payload[o], payload[o + 1]]);
    let format = match payload[4] {
        0 => Format::Raw,
        1 => Format::Fp8E4m3,
        2 => Format::Nvfp4,
        f => return corrupt(format!("unknown format {f}")),
    };
    let flags = payload[5];
    if flags & !(FLAG_LZ4 | FLAG_ROTATED) != 0 {
        return corrupt(format!("unknown flags {flags:#x}"));
    }
    let dtype = DType::from_code(payload[6].into()).map_err(|e| CodecError::Corrupt(e.to_string()))?;
    let order = MemoryOrder::from_code(payload[7].into()).map_err(|e| CodecError::Corrupt(e.to_string()))?;
    let fp8_scales = match payload[8] {
        0 => Fp8ScaleMode::PerTokenHead,
        1 => Fp8ScaleMode::PerTensor,
        2 => Fp8ScaleMode::Static,
        m => return corrupt(format!("unknown scale mode {m}")),
    };
    let (scheme, seed, check) = (payload[9], u16_at(10), u16_at(18));
    let rotation_seed = if flags & FLAG_ROTATED != 0 {
        if format == Format::Raw {
            return corrupt("a raw payload marked rotated".into());
        }
        if scheme != ROTATION_SCHEME_HADAMARD {
            return corrupt(format!("unknown rotation scheme {scheme}"));
        }
        if check != !seed {
            return corrupt(format!("rotation seed {seed:#06x} does not match its check {check:#06x}"));
        }
        Some(seed)
    } else {
        if scheme != 0 || seed != 0 || check != 0 {
            return corrupt(format!(
                "rotation fields (scheme {scheme}, seed {seed:#06x}, check {check:#06x}) in a payload not marked rotated"
            ));
        }
        None
    };
    let spec = BlockSpec {
        layers: u16_at(12),
        kv_heads: u16_at(14),
        head_dim: u16_at(16),
        tokens: u32::from_le_bytes([payload[20], payload[21], payload[22], payload[23]]),
        dtype,
        order,
    };
    spec.validate().map_err(|e| CodecError::Corrupt(e.to_string()))?;
    let mut b = [0u8; 8];
    b.copy_from_slice(&payload[24..32]);
    let info = PayloadInfo {
        format,
        lz4: flags & FLAG_LZ4 != 0,
        spec,
        fp8_scales,
        rotation_seed,
        body_len: u64::from_le_bytes(b),
    };
    if info.body_len != info.sections().total() as u64 {
        return corrupt(format!(
            "body length {} does not fit the shape (expected {})",
            info.body_len,
            info.sections().total()
        ));
    }
    Ok(info)
}

/// A payload's header and (decompressed) body, split into its sections.
#[derive(Debug, Clone)]
pub struct PayloadParts<'a> {
    pub info: PayloadInfo,
    body: Cow<'a, [u8]>,
}

impl<'a> PayloadParts<'a> {
    /// Parses a payload, decompressing its body if it is LZ4.
    pub fn open(payload: &'a [u8]) -> Result<Self, CodecError> {
        let info = inspect(payload)?;
        check_stored(&info, payload)?;
        let stored = &payload[PAYLOAD_HEADER_LEN..];
        let body_len = info.body_len as usize;
        let body = if info.lz4 {
            let mut out = vec![0u8; body_len];
            let n = lz4_flex::block::decompress_into(stored, &mut out)
                .map_err(|e| CodecError::Corrupt(format!("lz4: {e}")))?;
            if n != body_len {
                return Err(CodecError::Corrupt(format!("lz4 body is {n} bytes, header says {body_len}")));
            }
            Cow::Owned(out)
        } else {
            Cow::Borrowed(stored)
        };
        Ok(PayloadParts { info, body })
    }

    /// The f32 scales section as raw little-endian bytes.
    pub fn scale_bytes(&self) -> &[u8] {
        &self.body[..self.info.sections().scales]
    }

    /// The f32 scales (per row or per plane for FP8; per plane for NVFP4).
    pub fn scales(&self) -> Vec<f32> {
        self.scale_bytes().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// NVFP4 E4M3 block scales, `ceil(head_dim/16)` per row.
    pub fn block_scales(&self) -> &[u8] {
        let s = self.info.sections();
        &self.body[s.scales..s.scales + s.block_scales]
    }

    /// Codes (or raw bytes).
    pub fn codes(&self) -> &[u8] {
        let s = self.info.sections();
        &self.body[s.scales + s.block_scales..]
    }
}
