//! The block frame: a fixed 128-byte header + payload. The same bytes go over the wire, into DRAM
//! and onto disk; every reader verifies both checksums, and a mismatch is a miss, never wrong bytes.
//!
//! Header (little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVTB` |
//! | 4 | 2 | version (1) |
//! | 6 | 2 | codec id |
//! | 8 | 4 | tokens in this block (≤ layout.block_tokens; fewer for a partial tail) |
//! | 12 | 2 | flags: bit 0 [`FRAME_FLAG_KEEP_LOSSLESS`]; other bits must be zero |
//! | 14 | 2 | reserved, zero |
//! | 16 | 16 | namespace id |
//! | 32 | 32 | block key |
//! | 64 | 16 | layout (layers, kv_heads, head_dim, dtype, order, block_tokens, tp_rank, tp_world) |
//! | 80 | 8 | payload length |
//! | 88 | 8 | payload checksum (xxh3-64) |
//! | 96 | 8 | opaque block bytes (the opaque layout order only; zero otherwise) |
//! | 104 | 16 | reserved, zero |
//! | 120 | 8 | header checksum (xxh3-64 of bytes 0..120) |

use crate::checksum::checksum;
use bytes::Bytes;

use crate::{BlockKey, DType, KvLayout, MemoryOrder, NamespaceId, ProtoError, KEY_LEN, NAMESPACE_ID_LEN};

pub const FRAME_MAGIC: [u8; 4] = *b"KVTB";
pub const FRAME_VERSION: u16 = 1;
pub const FRAME_HEADER_LEN: usize = 128;
/// The writer asks every tier to keep this block lossless (e.g. the attention-sink blocks at the
/// start of a context): a tier may compress it losslessly, never quantize it.
pub const FRAME_FLAG_KEEP_LOSSLESS: u16 = 1;
/// Every flag bit this version knows; a header with any other bit set is refused.
pub const FRAME_FLAGS_KNOWN: u16 = FRAME_FLAG_KEEP_LOSSLESS;

/// How a payload is encoded. The codecs themselves live in `kvtier-kernels`; here they are only
/// names, and the size rule the server can check without decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CodecId(pub u16);

impl CodecId {
    /// The engine's own bytes.
    pub const RAW: CodecId = CodecId(0);
    /// The engine's bytes through LZ4.
    pub const RAW_LZ4: CodecId = CodecId(1);
    pub const FP8_E4M3: CodecId = CodecId(2);
    pub const FP8_E4M3_LZ4: CodecId = CodecId(3);
    pub const NVFP4: CodecId = CodecId(4);
    pub const NVFP4_LZ4: CodecId = CodecId(5);
    /// FP8 E4M3 after a randomized Hadamard rotation along `head_dim` (undone on decode).
    pub const FP8_E4M3_HAD: CodecId = CodecId(6);
    pub const FP8_E4M3_HAD_LZ4: CodecId = CodecId(7);
    /// NVFP4 after a randomized Hadamard rotation along `head_dim` (undone on decode).
    pub const NVFP4_HAD: CodecId = CodecId(8);
    pub const NVFP4_HAD_LZ4: CodecId = CodecId(9);

    pub fn is_known(self) -> bool {
        self.0 <= 9
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "raw",
            1 => "raw+lz4",
            2 => "fp8_e4m3",
            3 => "fp8_e4m3+lz4",
            4 => "nvfp4",
            5 => "nvfp4+lz4",
            6 => "fp8_e4m3+had",
            7 => "fp8_e4m3+had+lz4",
            8 => "nvfp4+had",
            9 => "nvfp4+had+lz4",
            _ => "unknown",
        }
    }

    /// The codec a name means: [`CodecId::name`]'s spellings, plus `fp8` for `fp8_e4m3` (also in
    /// `fp8+lz4`, `fp8+had`, `fp8+had+lz4`) and `lz4` for `raw+lz4`. Case-insensitive.
    pub fn from_name(name: &str) -> Option<CodecId> {
        let n = name.trim().to_ascii_lowercase();
        let n = n.replace("fp8+", "fp8_e4m3+");
        let n = match n.as_str() {
            "fp8" => "fp8_e4m3",
            "lz4" => "raw+lz4",
            other => other,
        };
        (0..=u16::MAX).map(CodecId).take_while(|c| c.is_known()).find(|c| c.name() == n)
    }

    /// The largest payload this codec may produce for `raw_len` bytes of engine KV. Raw payloads
    /// must match exactly; encoded ones carry their own scales and shapes, so they get a margin.
    pub fn max_payload(self, raw_len: u64) -> u64 {
        if self == CodecId::RAW {
            raw_len
        } else {
            raw_len + raw_len / 64 + 64 * 1024
        }
    }
}

/// A decoded and verified frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub codec: CodecId,
    pub tokens: u32,
    /// [`FRAME_FLAG_KEEP_LOSSLESS`] or 0.
    pub flags: u16,
    pub namespace: NamespaceId,
    pub key: BlockKey,
    pub layout: KvLayout,
    pub payload_len: u64,
    pub checksum: u64,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[0..4].copy_from_slice(&FRAME_MAGIC);
        h[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&self.codec.0.to_le_bytes());
        h[8..12].copy_from_slice(&self.tokens.to_le_bytes());
        h[12..14].copy_from_slice(&self.flags.to_le_bytes());
        h[16..32].copy_from_slice(&self.namespace.0);
        h[32..64].copy_from_slice(&self.key.0);
        let mut l = Vec::with_capacity(16);
        self.layout.encode_into(&mut l);
        h[64..80].copy_from_slice(&l);
        h[80..88].copy_from_slice(&self.payload_len.to_le_bytes());
        h[88..96].copy_from_slice(&self.checksum.to_le_bytes());
        h[96..104].copy_from_slice(&self.layout.opaque_block_bytes.to_le_bytes());
        let hc = checksum(&h[..120]);
        h[120..128].copy_from_slice(&hc.to_le_bytes());
        h
    }

    /// Parses and verifies a header. Does not look at the payload.
    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        if b.len() < FRAME_HEADER_LEN {
            return Err(ProtoError::Truncated { need: FRAME_HEADER_LEN, have: b.len() });
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        if b[0..4] != FRAME_MAGIC {
            return Err(ProtoError::BadMagic(u32_at(0)));
        }
        if u64_at(120) != checksum(&b[..120]) {
            return Err(ProtoError::HeaderChecksum);
        }
        let version = u16_at(4);
        if version != FRAME_VERSION {
            return Err(ProtoError::UnsupportedVersion(version));
        }
        let mut ns = [0u8; NAMESPACE_ID_LEN];
        ns.copy_from_slice(&b[16..32]);
        let mut key = [0u8; KEY_LEN];
        key.copy_from_slice(&b[32..64]);
        let layout = KvLayout {
            layers: u16_at(64),
            kv_heads: u16_at(66),
            head_dim: u16_at(68),
            dtype: DType::from_code(b[70].into())?,
            order: MemoryOrder::from_code(b[71].into())?,
            block_tokens: u32_at(72),
            tp_rank: u16_at(76),
            tp_world: u16_at(78),
            opaque_block_bytes: u64_at(96),
        };
        layout.validate()?;
        let flags = u16_at(12);
        if flags & !FRAME_FLAGS_KNOWN != 0 {
            return Err(ProtoError::UnknownFlags(flags));
        }
        let header = FrameHeader {
            codec: CodecId(u16_at(6)),
            tokens: u32_at(8),
            flags,
            namespace: NamespaceId(ns),
            key: BlockKey(key),
            layout,
            payload_len: u64_at(80),
            checksum: u64_at(88),
        };
        if !header.codec.is_known() {
            return Err(ProtoError::UnknownCodec(header.codec.0));
        }
        Ok(header)
    }

    /// Checks the payload length against the layout, the token count and the codec.
    pub fn check_size(&self) -> Result<(), ProtoError> {
        if self.tokens == 0 || self.tokens > self.layout.block_tokens {
            return Err(ProtoError::TooManyTokens { tokens: self.tokens, block_tokens: self.layout.block_tokens });
        }
        if self.layout.is_opaque() && !matches!(self.codec, CodecId::RAW | CodecId::RAW_LZ4) {
            return Err(ProtoError::LossyCodec { codec: self.codec.0 });
        }
        let raw = self.layout.bytes_for_tokens(self.tokens);
        let ok = if self.codec == CodecId::RAW && self.layout.is_opaque() && self.tokens < self.layout.block_tokens {
            // An engine's partial block (LMCache's last chunk): its own size, up to a block.
            self.payload_len > 0 && self.payload_len <= raw
        } else if self.codec == CodecId::RAW {
            self.payload_len == raw
        } else {
            self.payload_len > 0 && self.payload_len <= self.codec.max_payload(raw)
        };
        if ok {
            Ok(())
        } else {
            Err(ProtoError::SizeMismatch {
                expected: raw,
                actual: self.payload_len,
                tokens: self.tokens,
                codec: self.codec.0,
            })
        }
    }

    /// Verifies `payload` is the one this header describes.
    pub fn verify_payload(&self, payload: &[u8]) -> Result<(), ProtoError> {
        if payload.len() as u64 != self.payload_len {
            return Err(ProtoError::Truncated { need: self.payload_len as usize, have: payload.len() });
        }
        let actual = checksum(payload);
        if actual != self.checksum {
            return Err(ProtoError::PayloadChecksum { expected: self.checksum, actual });
        }
        Ok(())
    }
}

/// A header and its payload.
///
/// ```
/// use bytes::Bytes;
/// use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, KvLayout, NamespaceId};
/// let layout = KvLayout::new(2, 1, 4, DType::Fp16, 2); // 2*2*1*4*2 = 32 bytes per token
/// let payload = Bytes::from(vec![7u8; 64]);
/// let frame = BlockFrame::new(NamespaceId([1; 16]), BlockKey([2; 32]), layout, CodecId::RAW, 2, payload);
/// let wire = frame.to_bytes();
/// assert_eq!(BlockFrame::decode(wire.clone()).unwrap(), frame);
/// let mut bad = wire.to_vec();
/// bad[150] ^= 1;
/// assert!(BlockFrame::decode(Bytes::from(bad)).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockFrame {
    pub header: FrameHeader,
    pub payload: Bytes,
}

impl BlockFrame {
    /// Frames a payload, computing its checksum.
    pub fn new(
        namespace: NamespaceId,
        key: BlockKey,
        layout: KvLayout,
        codec: CodecId,
        tokens: u32,
        payload: Bytes,
    ) -> Self {
        let header = FrameHeader {
            codec,
            tokens,
            flags: 0,
            namespace,
            key,
            layout,
            payload_len: payload.len() as u64,
            checksum: checksum(&payload),
        };
        BlockFrame { header, payload }
    }

    /// The same frame with header flags `flags` (e.g. [`FRAME_FLAG_KEEP_LOSSLESS`]).
    pub fn with_flags(mut self, flags: u16) -> Self {
        self.header.flags = flags;
        self
    }

    /// Header and payload in one buffer (one copy of the payload).
    pub fn to_bytes(&self) -> Bytes {
        let mut v = Vec::with_capacity(FRAME_HEADER_LEN + self.payload.len());
        v.extend_from_slice(&self.header.encode());
        v.extend_from_slice(&self.payload);
        Bytes::from(v)
    }

    /// Parses and verifies a whole frame without copying the payload.
    pub fn decode(mut b: Bytes) -> Result<Self, ProtoError> {
        let header = FrameHeader::decode(&b)?;
        let Some(need) = header.payload_len.checked_add(FRAME_HEADER_LEN as u64) else {
            return Err(ProtoError::Malformed(format!("a payload length of {} bytes", header.payload_len)));
        };
        if (b.len() as u64) < need {
            return Err(ProtoError::Truncated { need: usize::try_from(need).unwrap_or(usize::MAX), have: b.len() });
        }
        if (b.len() as u64) > need {
            return Err(ProtoError::Malformed(format!("{} bytes after the payload", b.len() as u64 - need)));
        }
        let payload = b.split_off(FRAME_HEADER_LEN);
        header.verify_payload(&payload)?;
        Ok(BlockFrame { header, payload })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_names_round_trip() {
        for id in (0..=u16::MAX).map(CodecId).take_while(|c| c.is_known()) {
            assert_eq!(CodecId::from_name(id.name()), Some(id));
        }
        assert_eq!(CodecId::from_name("FP8"), Some(CodecId::FP8_E4M3));
        assert_eq!(CodecId::from_name("fp8+lz4"), Some(CodecId::FP8_E4M3_LZ4));
        assert_eq!(CodecId::from_name("lz4"), Some(CodecId::RAW_LZ4));
        assert_eq!(CodecId::from_name("nvfp4+had"), Some(CodecId::NVFP4_HAD));
        assert_eq!(CodecId::from_name("NVFP4+HAD+LZ4"), Some(CodecId::NVFP4_HAD_LZ4));
        assert_eq!(CodecId::from_name("fp8+had"), Some(CodecId::FP8_E4M3_HAD));
        assert_eq!(CodecId::from_name(" fp8+had+lz4 "), Some(CodecId::FP8_E4M3_HAD_LZ4));
        assert_eq!(CodecId::from_name("fp8_e4m3+had"), Some(CodecId::FP8_E4M3_HAD));
        assert_eq!(CodecId::from_name("had"), None);
        assert_eq!(CodecId::from_name("nvfp4+lz4+had"), None);
        assert_eq!(CodecId(10).name(), "unknown");
        assert!(CodecId::NVFP4_HAD_LZ4.is_known() && !CodecId(10).is_known());
        assert_eq!(CodecId::from_name("int4"), None);
        assert_eq!(CodecId::from_name("unknown"), None);
    }

    fn frame(tokens: u32, len: usize) -> BlockFrame {
        let layout = KvLayout::new(2, 1, 4, DType::Fp16, 4);
        BlockFrame::new(
            NamespaceId([3; 16]),
            BlockKey([9; 32]),
            layout,
            CodecId::RAW,
            tokens,
            Bytes::from(vec![5u8; len]),
        )
    }

    #[test]
    fn every_flipped_header_bit_is_caught() {
        let wire = frame(4, 128).to_bytes();
        for bit in 0..FRAME_HEADER_LEN * 8 {
            let mut b = wire.to_vec();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(BlockFrame::decode(Bytes::from(b)).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn flags_round_trip_and_unknown_bits_are_refused() {
        let f = frame(4, 128).with_flags(FRAME_FLAG_KEEP_LOSSLESS);
        let back = BlockFrame::decode(f.to_bytes()).unwrap();
        assert_eq!(back.header.flags, FRAME_FLAG_KEEP_LOSSLESS);
        assert_eq!(back, f);
        // Bytes 12..14 were reserved (zero) before flags: frames written then decode with none.
        assert_eq!(BlockFrame::decode(frame(4, 128).to_bytes()).unwrap().header.flags, 0);
        let mut h = f.header;
        h.flags = 0b110;
        let mut wire = h.encode().to_vec();
        wire.extend_from_slice(&f.payload);
        assert!(matches!(BlockFrame::decode(Bytes::from(wire)), Err(ProtoError::UnknownFlags(0b110))));
    }

    #[test]
    fn payload_corruption_and_truncation() {
        let wire = frame(4, 128).to_bytes();
        let mut b = wire.to_vec();
        *b.last_mut().unwrap() ^= 0x80;
        assert!(matches!(BlockFrame::decode(Bytes::from(b)), Err(ProtoError::PayloadChecksum { .. })));
        assert!(matches!(BlockFrame::decode(wire.slice(..wire.len() - 1)), Err(ProtoError::Truncated { .. })));
        assert!(matches!(BlockFrame::decode(wire.slice(..60)), Err(ProtoError::Truncated { .. })));
    }

    /// A header (its checksum right) claiming a payload near `u64::MAX`: refused, never an
    /// overflow (a frame read back from a shared Redis tier is whatever someone wrote there).
    #[test]
    fn a_payload_length_past_u64_is_refused() {
        let mut h = frame(4, 128).header;
        h.payload_len = u64::MAX - 10;
        let wire = Bytes::from(h.encode().to_vec());
        assert!(matches!(BlockFrame::decode(wire), Err(ProtoError::Malformed(_))));
    }

    #[test]
    fn size_rules() {
        assert!(frame(4, 128).header.check_size().is_ok());
        assert!(frame(2, 64).header.check_size().is_ok()); // a partial tail
        assert!(matches!(frame(4, 127).header.check_size(), Err(ProtoError::SizeMismatch { .. })));
        assert!(matches!(frame(5, 160).header.check_size(), Err(ProtoError::TooManyTokens { .. })));
        assert!(matches!(frame(0, 0).header.check_size(), Err(ProtoError::TooManyTokens { .. })));
        let mut lz = frame(4, 40);
        lz.header.codec = CodecId::RAW_LZ4;
        assert!(lz.header.check_size().is_ok());
    }
}
