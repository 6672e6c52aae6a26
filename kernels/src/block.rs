//! What a codec encodes: one block of K and V planes, shaped `[tokens, kv_heads, head_dim]` per
//! layer, in the engine's dtype and memory order.
//!
//! The codecs work on **rows**: the `head_dim` elements of one (layer, K|V, token, head). A row is
//! contiguous in both memory orders, so row `r` always starts at element `r * head_dim`; only the
//! mapping from a row to its **plane** (layer, K|V) depends on the order. Scales are per row
//! (FP8 default), per plane (FP8 per-tensor, NVFP4 global) or per 16-element micro-block within a
//! row (NVFP4).

use kvtier_proto::{DType, KvLayout, MemoryOrder};

use crate::CodecError;

/// The shape and element type of a block's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockSpec {
    pub layers: u16,
    pub tokens: u32,
    /// KV heads held in this block (a rank's share of the model's heads).
    pub kv_heads: u16,
    pub head_dim: u16,
    pub dtype: DType,
    pub order: MemoryOrder,
}

impl BlockSpec {
    /// A layer-first spec.
    pub fn new(layers: u16, tokens: u32, kv_heads: u16, head_dim: u16, dtype: DType) -> Self {
        BlockSpec { layers, tokens, kv_heads, head_dim, dtype, order: MemoryOrder::LayerFirst }
    }

    /// The spec of `tokens` tokens of a layout (one rank's heads, the layout's dtype and order).
    pub fn from_layout(layout: &KvLayout, tokens: u32) -> Self {
        BlockSpec {
            layers: layout.layers,
            tokens,
            kv_heads: u16::try_from(layout.heads_per_rank()).unwrap_or(u16::MAX),
            head_dim: layout.head_dim,
            dtype: layout.dtype,
            order: layout.order,
        }
    }

    /// The same shape in another dtype.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// K and V planes: `2 * layers`. Plane `2 * layer` is K, `2 * layer + 1` is V.
    pub fn planes(&self) -> usize {
        2 * usize::from(self.layers)
    }

    /// Rows of `head_dim` elements.
    pub fn rows(&self) -> usize {
        self.planes() * self.tokens as usize * usize::from(self.kv_heads)
    }

    pub fn row_len(&self) -> usize {
        usize::from(self.head_dim)
    }

    pub fn elements(&self) -> usize {
        self.rows() * self.row_len()
    }

    /// Bytes of the block in its dtype.
    pub fn byte_len(&self) -> usize {
        self.elements() * self.dtype.size() as usize
    }

    /// The plane (`2 * layer + kv`) that row `r` belongs to.
    #[inline]
    pub fn plane_of_row(&self, r: usize) -> usize {
        let heads = usize::from(self.kv_heads);
        match self.order {
            // [layer][k|v][token][head]
            // (Opaque shapes are refused by `validate`; they never reach a codec.)
            MemoryOrder::LayerFirst | MemoryOrder::Opaque => r / (self.tokens as usize * heads),
            // [token][layer][k|v][head]
            MemoryOrder::BlockFirst => (r / heads) % self.planes(),
        }
    }

    /// The end of the run of consecutive rows that share row `r`'s plane: the plane's last row + 1
    /// in layer-first order, the end of `r`'s group of `kv_heads` rows in block-first order.
    #[inline]
    pub(crate) fn plane_run_end(&self, r: usize) -> usize {
        let run = match self.order {
            MemoryOrder::LayerFirst | MemoryOrder::Opaque => self.tokens as usize * usize::from(self.kv_heads),
            MemoryOrder::BlockFirst => usize::from(self.kv_heads),
        }
        .max(1);
        (r / run + 1) * run
    }

    /// (layer, is_v, token, head) of row `r`, for error messages.
    pub fn locate_row(&self, r: usize) -> (usize, bool, usize, usize) {
        let heads = usize::from(self.kv_heads);
        let planes = self.planes();
        let (plane, token) = match self.order {
            MemoryOrder::LayerFirst | MemoryOrder::Opaque => {
                let per_plane = self.tokens as usize * heads;
                (r / per_plane, (r % per_plane) / heads)
            }
            MemoryOrder::BlockFirst => ((r / heads) % planes, r / heads / planes),
        };
        (plane / 2, plane % 2 == 1, token, r % heads)
    }

    /// Checks the shape is non-empty and not absurdly large.
    pub fn validate(&self) -> Result<(), CodecError> {
        if self.order == MemoryOrder::Opaque {
            return Err(CodecError::InvalidInput(
                "an opaque layout's element order is the engine's own: no codec can read it (store it raw)".into(),
            ));
        }
        if self.layers == 0 || self.tokens == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err(CodecError::InvalidInput(format!("empty block shape {self:?}")));
        }
        // 2^40 elements is far beyond any block; it keeps all size arithmetic in range.
        let elements = 2u128
            * u128::from(self.layers)
            * u128::from(self.tokens)
            * u128::from(self.kv_heads)
            * u128::from(self.head_dim);
        if elements > 1 << 40 {
            return Err(CodecError::InvalidInput(format!("block of {elements} elements is too large")));
        }
        Ok(())
    }
}

/// A borrowed block to encode: `spec` says how to read `bytes` (little-endian elements).
#[derive(Debug, Clone, Copy)]
pub struct KvBlockView<'a> {
    spec: BlockSpec,
    bytes: &'a [u8],
}

impl<'a> KvBlockView<'a> {
    /// Checks that `bytes` holds exactly the block `spec` describes.
    pub fn new(spec: BlockSpec, bytes: &'a [u8]) -> Result<Self, CodecError> {
        spec.validate()?;
        if bytes.len() != spec.byte_len() {
            return Err(CodecError::InvalidInput(format!(
                "block bytes: expected {} for {spec:?}, got {}",
                spec.byte_len(),
                bytes.len()
            )));
        }
        Ok(KvBlockView { spec, bytes })
    }

    pub fn spec(&self) -> &BlockSpec {
        &self.spec
    }

    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

/// Reads element `i` of a little-endian buffer of `dtype` as f32 (exact for bf16/fp16/fp32).
#[inline]
pub(crate) fn load_f32(dtype: DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        DType::Bf16 => f32::from_bits(u32::from(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])) << 16),
        DType::Fp16 => half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
        DType::Fp32 => f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]),
        DType::Fp8E4m3 => crate::formats::e4m3_to_f32(bytes[i]),
    }
}

/// Largest finite fp16, the value decoding saturates to rather than writing an infinity.
pub(crate) const F16_MAX: f32 = 65504.0;

/// Writes `v` as element `i` of a little-endian buffer of `dtype`, rounding to nearest even.
/// FP16 saturates to ±65504 so that a value from a wider source never turns into an infinity.
#[inline]
pub(crate) fn store_f32(dtype: DType, bytes: &mut [u8], i: usize, v: f32) {
    match dtype {
        DType::Bf16 => bytes[2 * i..2 * i + 2].copy_from_slice(&bf16_bits_rne(v).to_le_bytes()),
        DType::Fp16 => {
            let h = half::f16::from_f32(v.clamp(-F16_MAX, F16_MAX));
            bytes[2 * i..2 * i + 2].copy_from_slice(&h.to_bits().to_le_bytes());
        }
        DType::Fp32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        DType::Fp8E4m3 => bytes[i] = crate::formats::e4m3_from_f32(v),
    }
}

/// f32 → bf16 bits, round to nearest even (finite inputs; the codecs only produce finite values).
#[inline]
pub(crate) fn bf16_bits_rne(v: f32) -> u16 {
    let b = v.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_map_to_planes_in_both_orders() {
        let mut s = BlockSpec::new(3, 4, 2, 8, DType::Bf16);
        // layer-first: plane-major
        assert_eq!(s.plane_of_row(0), 0);
        assert_eq!(s.plane_of_row(7), 0);
        assert_eq!(s.plane_of_row(8), 1);
        assert_eq!(s.locate_row(8 * 3 + 5), (1, true, 2, 1));
        s.order = MemoryOrder::BlockFirst;
        // block-first: [token][layer][kv][head]
        assert_eq!(s.plane_of_row(0), 0);
        assert_eq!(s.plane_of_row(2), 1);
        assert_eq!(s.plane_of_row(12), 0);
        assert_eq!(s.locate_row(12 + 3), (0, true, 1, 1));
    }

    #[test]
    fn plane_runs_match_plane_of_row() {
        for order in [MemoryOrder::LayerFirst, MemoryOrder::BlockFirst] {
            let mut s = BlockSpec::new(3, 5, 2, 8, DType::Bf16);
            s.order = order;
            for r in 0..s.rows() {
                let e = s.plane_run_end(r);
                assert!(e > r && e <= s.rows());
                assert!((r..e).all(|q| s.plane_of_row(q) == s.plane_of_row(r)), "{order:?} row {r}");
                assert!(e == s.rows() || s.plane_of_row(e) != s.plane_of_row(e - 1));
            }
        }
    }

    #[test]
    fn bf16_rounding_matches_half() {
        for b in [0x3F80_8000u32, 0x3F81_8000, 0x3F80_8001, 0xBF80_7FFF, 0x7F7F_FFFF, 0x0000_8000] {
            let v = f32::from_bits(b);
            assert_eq!(bf16_bits_rne(v), half::bf16::from_f32(v).to_bits(), "{b:#x}");
        }
    }
}
