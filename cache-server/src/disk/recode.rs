//! The disk codec: blocks demoted from DRAM to disk that arrive lossless (raw, raw+LZ4) are
//! re-encoded with the codec the operator chose for the disk tier (`disk_codec`), so the cold tier
//! holds more of them. Blocks already quantized keep their codec (never quantized twice), blocks
//! flagged [`FRAME_FLAG_KEEP_LOSSLESS`] (a client's attention-sink blocks) are never quantized, and
//! a block the codec refuses (non-finite values) or cannot shrink is written as it came. Parked
//! sessions write their blocks to disk at park time, not through here.

use bytes::Bytes;
use kvtier_kernels::{is_lossless, BlockSpec, KvBlockView};
use kvtier_proto::{BlockFrame, CodecId, FrameHeader, FRAME_FLAG_KEEP_LOSSLESS};

/// What the disk codec made of one block.
#[derive(Debug)]
pub enum Recoded {
    /// Written as it came: already in the disk codec, already lossy, or no smaller re-encoded.
    Kept,
    /// The codec refused the block (e.g. NaN or infinity in the KV); written as it came.
    Refused(String),
    /// The block in the disk codec: a new header (codec, length, checksum) and payload.
    Encoded(FrameHeader, Bytes),
}

/// Re-encodes `payload` (the payload of `header`) with `codec` where that helps; see the module.
pub fn recode(codec: CodecId, header: &FrameHeader, payload: &[u8]) -> Recoded {
    let keep_lossless = header.flags & FRAME_FLAG_KEEP_LOSSLESS != 0;
    // An opaque block's element order is the engine's secret: no codec here can read it.
    if header.codec == codec
        || !is_lossless(header.codec)
        || (keep_lossless && !is_lossless(codec))
        || header.layout.is_opaque()
    {
        return Recoded::Kept;
    }
    let spec = BlockSpec::from_layout(&header.layout, header.tokens);
    let raw: std::borrow::Cow<'_, [u8]> = if header.codec == CodecId::RAW {
        payload.into()
    } else {
        match kvtier_kernels::decode(header.codec, payload, &spec) {
            Ok(v) => v.into(),
            Err(e) => return Recoded::Refused(e.to_string()),
        }
    };
    let encoded = KvBlockView::new(spec, &raw).and_then(|view| kvtier_kernels::encode(codec, &view));
    match encoded {
        Ok(p) if p.len() < payload.len() => {
            let f = BlockFrame::new(header.namespace, header.key, header.layout, codec, header.tokens, Bytes::from(p))
                .with_flags(header.flags);
            Recoded::Encoded(f.header, f.payload)
        }
        Ok(_) => Recoded::Kept,
        Err(e) => Recoded::Refused(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use kvtier_proto::{BlockKey, DType, KvLayout, NamespaceId};

    fn layout() -> KvLayout {
        KvLayout::new(2, 2, 64, DType::Fp16, 16)
    }

    fn frame(codec: CodecId, mut values: impl FnMut(usize) -> f32) -> BlockFrame {
        let l = layout();
        let raw: Vec<u8> =
            (0..l.block_bytes() as usize / 2).flat_map(|i| f16::from_f32(values(i)).to_bits().to_le_bytes()).collect();
        let spec = BlockSpec::from_layout(&l, 16);
        let payload = if codec == CodecId::RAW {
            raw
        } else {
            kvtier_kernels::encode(codec, &KvBlockView::new(spec, &raw).unwrap()).unwrap()
        };
        BlockFrame::new(NamespaceId([3; 16]), BlockKey([7; 32]), l, codec, 16, Bytes::from(payload))
    }

    fn smooth(i: usize) -> f32 {
        (i as f32 * 0.013).sin() * 2.0
    }

    #[test]
    fn lossless_blocks_are_encoded_and_decode_close() {
        for source in [CodecId::RAW, CodecId::RAW_LZ4] {
            let f = frame(source, smooth);
            let Recoded::Encoded(h, p) = recode(CodecId::NVFP4_HAD_LZ4, &f.header, &f.payload) else {
                panic!("{source:?} was not re-encoded");
            };
            assert_eq!(
                (h.codec, h.key, h.namespace, h.tokens),
                (CodecId::NVFP4_HAD_LZ4, f.header.key, f.header.namespace, 16)
            );
            assert_eq!(h.payload_len, p.len() as u64);
            // The new frame verifies as a whole (checksum of the new payload).
            h.verify_payload(&p).unwrap();
            assert!(p.len() * 3 < layout().block_bytes() as usize, "{} bytes", p.len());
            let back = kvtier_kernels::decode(h.codec, &p, &BlockSpec::from_layout(&layout(), 16)).unwrap();
            let errs: Vec<f32> = back
                .chunks_exact(2)
                .enumerate()
                .map(|(i, c)| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32() - smooth(i))
                .collect();
            let rms_signal =
                (errs.iter().enumerate().map(|(i, _)| smooth(i).powi(2)).sum::<f32>() / errs.len() as f32).sqrt();
            let rms = (errs.iter().map(|e| e * e).sum::<f32>() / errs.len() as f32).sqrt() / rms_signal;
            let max = errs.iter().fold(0f32, |m, e| m.max(e.abs())) / 2.0;
            assert!(rms > 0.0 && rms < 0.15 && max < 0.4, "relative error: rms {rms}, max {max}");
        }
    }

    #[test]
    fn blocks_flagged_keep_lossless_are_only_compressed_losslessly() {
        let f = frame(CodecId::RAW, |_| 1.5); // constant: LZ4 shrinks it
        let f = BlockFrame { header: FrameHeader { flags: FRAME_FLAG_KEEP_LOSSLESS, ..f.header }, payload: f.payload };
        assert!(matches!(recode(CodecId::NVFP4_HAD_LZ4, &f.header, &f.payload), Recoded::Kept));
        let Recoded::Encoded(h, p) = recode(CodecId::RAW_LZ4, &f.header, &f.payload) else {
            panic!("a flagged block may still be compressed losslessly");
        };
        assert_eq!((h.codec, h.flags), (CodecId::RAW_LZ4, FRAME_FLAG_KEEP_LOSSLESS));
        let back = kvtier_kernels::decode(h.codec, &p, &BlockSpec::from_layout(&layout(), 16)).unwrap();
        assert_eq!(back, f.payload);
    }

    #[test]
    fn lossy_blocks_and_same_codec_are_kept() {
        let fp8 = frame(CodecId::FP8_E4M3, smooth);
        assert!(matches!(recode(CodecId::NVFP4_HAD_LZ4, &fp8.header, &fp8.payload), Recoded::Kept));
        let same = frame(CodecId::RAW_LZ4, smooth);
        assert!(matches!(recode(CodecId::RAW_LZ4, &same.header, &same.payload), Recoded::Kept));
    }

    #[test]
    fn blocks_the_codec_refuses_or_cannot_shrink_are_kept() {
        let nan = frame(CodecId::RAW, |i| if i == 100 { f32::NAN } else { smooth(i) });
        match recode(CodecId::NVFP4_HAD, &nan.header, &nan.payload) {
            Recoded::Refused(why) => assert!(!why.is_empty()),
            other => panic!("a NaN block was {other:?}"),
        }
        // Noise does not compress: raw+LZ4 would be larger, so the raw block stays.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise = frame(CodecId::RAW, |_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 20_000) as f32 / 1000.0 - 10.0
        });
        assert!(matches!(recode(CodecId::RAW_LZ4, &noise.header, &noise.payload), Recoded::Kept));
    }
}
