//! The shape of an engine's KV cache for one tensor-parallel rank, and the byte size it fixes.

use crate::ProtoError;

/// Element type of the engine's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    Bf16 = 1,
    Fp16 = 2,
    Fp32 = 3,
    /// An engine that already keeps its cache in FP8 (e4m3fn).
    Fp8E4m3 = 4,
}

impl DType {
    pub fn size(self) -> u64 {
        match self {
            DType::Bf16 | DType::Fp16 => 2,
            DType::Fp32 => 4,
            DType::Fp8E4m3 => 1,
        }
    }

    pub fn from_code(code: u32) -> Result<Self, ProtoError> {
        Ok(match code {
            1 => DType::Bf16,
            2 => DType::Fp16,
            3 => DType::Fp32,
            4 => DType::Fp8E4m3,
            other => return Err(ProtoError::UnknownDType(other)),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::Fp16 => "fp16",
            DType::Fp32 => "fp32",
            DType::Fp8E4m3 => "fp8_e4m3",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ProtoError> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => DType::Bf16,
            "fp16" | "f16" | "float16" | "half" => DType::Fp16,
            "fp32" | "f32" | "float32" | "float" => DType::Fp32,
            "fp8" | "fp8_e4m3" | "float8_e4m3fn" => DType::Fp8E4m3,
            other => return Err(ProtoError::InvalidLayout(format!("unknown dtype {other:?}"))),
        })
    }
}

/// How a block's bytes are ordered. Both hold the same bytes; the order says which index varies
/// slowest, so an engine can copy a block without a transpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MemoryOrder {
    /// `[layer][k|v][token][head][dim]`: lets a loader hand the engine layer 0 before layer N lands.
    LayerFirst = 1,
    /// `[token][layer][k|v][head][dim]`.
    BlockFirst = 2,
    /// The engine's own bytes, in an order only the engine knows (a vLLM offload chunk, an
    /// LMCache `KV_2LTD` chunk, an SGLang host page): a block is [`KvLayout::opaque_block_bytes`]
    /// bytes. Only lossless codecs apply, since kvtier can't tell K from V or one head from the
    /// next.
    Opaque = 3,
}

impl MemoryOrder {
    pub fn from_code(code: u32) -> Result<Self, ProtoError> {
        Ok(match code {
            1 => MemoryOrder::LayerFirst,
            2 => MemoryOrder::BlockFirst,
            3 => MemoryOrder::Opaque,
            other => return Err(ProtoError::UnknownOrder(other)),
        })
    }
}

/// The KV cache shape of one tensor-parallel rank. It fixes the byte size of a block.
///
/// ```
/// use kvtier_proto::{DType, KvLayout};
/// // Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, 16 tokens per block, one rank.
/// let l = KvLayout::new(32, 8, 128, DType::Bf16, 16);
/// assert_eq!(l.bytes_per_token(), 2 * 32 * 8 * 128 * 2);
/// assert_eq!(l.block_bytes(), 16 * 131072);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub layers: u16,
    /// KV heads of the whole model; a rank holds `kv_heads / tp_world` of them (or one replicated
    /// head when `tp_world > kv_heads`).
    pub kv_heads: u16,
    pub head_dim: u16,
    pub dtype: DType,
    pub block_tokens: u32,
    pub tp_rank: u16,
    pub tp_world: u16,
    pub order: MemoryOrder,
    /// Bytes of one full block of an [`MemoryOrder::Opaque`] layout (the engine's chunk or page
    /// size); 0 for every other order, whose block size follows from the shape.
    pub opaque_block_bytes: u64,
}

/// Upper bounds that keep a layout's arithmetic far from overflow.
const MAX_LAYERS: u16 = 1024;
const MAX_HEADS: u16 = 1024;
const MAX_HEAD_DIM: u16 = 4096;
const MAX_BLOCK_TOKENS: u32 = 1 << 16;
/// Largest opaque block: far above any engine chunk, far below arithmetic trouble.
const MAX_OPAQUE_BLOCK_BYTES: u64 = 1 << 32;

impl KvLayout {
    /// A single-rank, layer-first layout.
    pub fn new(layers: u16, kv_heads: u16, head_dim: u16, dtype: DType, block_tokens: u32) -> Self {
        KvLayout {
            layers,
            kv_heads,
            head_dim,
            dtype,
            block_tokens,
            tp_rank: 0,
            tp_world: 1,
            order: MemoryOrder::LayerFirst,
            opaque_block_bytes: 0,
        }
    }

    /// An opaque layout: blocks of `block_bytes` bytes holding `block_tokens` tokens of the
    /// engine's KV, in an order the engine defines. `dtype` is the engine's KV dtype; it and the
    /// TP rank/world are part of the identity, not used to size the block.
    ///
    /// ```
    /// use kvtier_proto::{DType, KvLayout};
    /// let l = KvLayout::opaque(2 << 20, DType::Bf16, 256);
    /// assert!(l.is_opaque());
    /// assert_eq!(l.block_bytes(), 2 << 20);
    /// ```
    pub fn opaque(block_bytes: u64, dtype: DType, block_tokens: u32) -> Self {
        KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            dtype,
            block_tokens,
            tp_rank: 0,
            tp_world: 1,
            order: MemoryOrder::Opaque,
            opaque_block_bytes: block_bytes,
        }
    }

    /// Whether blocks are the engine's own bytes ([`MemoryOrder::Opaque`]).
    pub fn is_opaque(&self) -> bool {
        self.order == MemoryOrder::Opaque
    }

    /// Checks the layout is usable; every other method assumes it is.
    pub fn validate(&self) -> Result<(), ProtoError> {
        let bad = |m: String| Err(ProtoError::InvalidLayout(m));
        if self.layers == 0 || self.layers > MAX_LAYERS {
            return bad(format!("layers must be 1..={MAX_LAYERS}, got {}", self.layers));
        }
        if self.kv_heads == 0 || self.kv_heads > MAX_HEADS {
            return bad(format!("kv_heads must be 1..={MAX_HEADS}, got {}", self.kv_heads));
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return bad(format!("head_dim must be 1..={MAX_HEAD_DIM}, got {}", self.head_dim));
        }
        if self.block_tokens == 0 || self.block_tokens > MAX_BLOCK_TOKENS {
            return bad(format!("block_tokens must be 1..={MAX_BLOCK_TOKENS}, got {}", self.block_tokens));
        }
        if self.tp_world == 0 || self.tp_rank >= self.tp_world {
            return bad(format!("tp_rank {} must be below tp_world {}", self.tp_rank, self.tp_world));
        }
        if self.is_opaque() {
            if self.opaque_block_bytes == 0 || self.opaque_block_bytes > MAX_OPAQUE_BLOCK_BYTES {
                return bad(format!(
                    "an opaque block must be 1..={MAX_OPAQUE_BLOCK_BYTES} bytes, got {}",
                    self.opaque_block_bytes
                ));
            }
            return Ok(());
        }
        if self.opaque_block_bytes != 0 {
            return bad("opaque_block_bytes is only for the opaque order".into());
        }
        if self.tp_world <= self.kv_heads && !self.kv_heads.is_multiple_of(self.tp_world) {
            return bad(format!("kv_heads {} do not split evenly over tp_world {}", self.kv_heads, self.tp_world));
        }
        Ok(())
    }

    /// KV heads held by this rank.
    pub fn heads_per_rank(&self) -> u64 {
        if self.tp_world > self.kv_heads {
            1
        } else {
            u64::from(self.kv_heads / self.tp_world)
        }
    }

    /// Bytes of K and V for one token across all layers of this rank (an opaque layout's block
    /// bytes over its tokens, rounded up).
    pub fn bytes_per_token(&self) -> u64 {
        if self.is_opaque() {
            return self.opaque_block_bytes.div_ceil(u64::from(self.block_tokens.max(1)));
        }
        2 * u64::from(self.layers) * self.heads_per_rank() * u64::from(self.head_dim) * self.dtype.size()
    }

    /// Bytes of `tokens` tokens in the engine's dtype (a partial block when below `block_tokens`).
    /// For an opaque layout, the engine's bytes for that share of a block, rounded up (engines
    /// that store partial blocks, like LMCache's last chunk, may use fewer).
    pub fn bytes_for_tokens(&self, tokens: u32) -> u64 {
        if self.is_opaque() {
            return (self.opaque_block_bytes * u64::from(tokens)).div_ceil(u64::from(self.block_tokens.max(1)));
        }
        self.bytes_per_token() * u64::from(tokens)
    }

    /// Bytes of one full block.
    pub fn block_bytes(&self) -> u64 {
        self.bytes_for_tokens(self.block_tokens)
    }

    #[cfg(feature = "grpc")]
    pub fn to_pb(&self) -> crate::pb::KvLayout {
        crate::pb::KvLayout {
            layers: self.layers.into(),
            kv_heads: self.kv_heads.into(),
            head_dim: self.head_dim.into(),
            dtype: self.dtype as u32,
            block_tokens: self.block_tokens,
            tp_rank: self.tp_rank.into(),
            tp_world: self.tp_world.into(),
            order: self.order as u32,
            opaque_block_bytes: self.opaque_block_bytes,
        }
    }

    #[cfg(feature = "grpc")]
    pub fn from_pb(pb: &crate::pb::KvLayout) -> Result<Self, ProtoError> {
        let small = |name: &str, v: u32| {
            u16::try_from(v).map_err(|_| ProtoError::InvalidLayout(format!("{name} {v} is out of range")))
        };
        let layout = KvLayout {
            layers: small("layers", pb.layers)?,
            kv_heads: small("kv_heads", pb.kv_heads)?,
            head_dim: small("head_dim", pb.head_dim)?,
            dtype: DType::from_code(pb.dtype)?,
            block_tokens: pb.block_tokens,
            tp_rank: small("tp_rank", pb.tp_rank)?,
            tp_world: small("tp_world", pb.tp_world)?,
            order: MemoryOrder::from_code(pb.order)?,
            opaque_block_bytes: pb.opaque_block_bytes,
        };
        layout.validate()?;
        Ok(layout)
    }

    /// A canonical byte encoding, used in namespace ids and frame headers.
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.layers.to_le_bytes());
        out.extend_from_slice(&self.kv_heads.to_le_bytes());
        out.extend_from_slice(&self.head_dim.to_le_bytes());
        out.push(self.dtype as u8);
        out.push(self.order as u8);
        out.extend_from_slice(&self.block_tokens.to_le_bytes());
        out.extend_from_slice(&self.tp_rank.to_le_bytes());
        out.extend_from_slice(&self.tp_world.to_le_bytes());
    }

    /// What an opaque layout adds to [`KvLayout::encode_into`] in a namespace's identity (nothing
    /// for other orders, so their ids are unchanged).
    pub(crate) fn encode_identity_into(&self, out: &mut Vec<u8>) {
        self.encode_into(out);
        if self.is_opaque() {
            out.extend_from_slice(&self.opaque_block_bytes.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallel_splits_heads() {
        let mut l = KvLayout::new(80, 8, 128, DType::Bf16, 16);
        l.tp_world = 4;
        l.tp_rank = 3;
        l.validate().unwrap();
        assert_eq!(l.heads_per_rank(), 2);
        assert_eq!(l.bytes_per_token(), 2 * 80 * 2 * 128 * 2);
        l.tp_world = 16; // more ranks than heads: each rank keeps one replicated head
        l.tp_rank = 15;
        l.validate().unwrap();
        assert_eq!(l.heads_per_rank(), 1);
    }

    #[test]
    fn rejects_bad_layouts() {
        let ok = KvLayout::new(32, 8, 128, DType::Bf16, 16);
        for bad in [
            KvLayout { layers: 0, ..ok },
            KvLayout { block_tokens: 0, ..ok },
            KvLayout { tp_world: 3, ..ok },
            KvLayout { tp_rank: 1, ..ok },
            KvLayout { head_dim: 5000, ..ok },
        ] {
            assert!(bad.validate().is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    #[cfg(feature = "grpc")]
    fn pb_round_trip() {
        let l = KvLayout::new(30, 3, 64, DType::Fp16, 32);
        assert_eq!(KvLayout::from_pb(&l.to_pb()).unwrap(), l);
        let mut pb = l.to_pb();
        pb.dtype = 99;
        assert_eq!(KvLayout::from_pb(&pb), Err(ProtoError::UnknownDType(99)));
    }
}
