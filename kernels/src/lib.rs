//! kvtier codecs: quantization (FP8 E4M3, NVFP4) and a lossless LZ4 layer that shrink KV blocks
//! on their way into a tier, and the policy that picks a codec per namespace and tier.
//! The codec ids are named in `kvtier_proto::CodecId`.
