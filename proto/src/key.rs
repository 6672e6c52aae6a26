//! Block keys: 256-bit chained prefix hashes, salted per namespace.
//!
//! `k0 = H(salt, FULL, tokens0, extra)`, `ki = H(salt, FULL, k(i-1), tokens_i, extra)`. A key
//! therefore names a block *and everything before it*: equal keys mean equal prefixes. A partial
//! last block (a session's tail) hashes under its own domain tag so it never equals a full block.
//! Engines that hash blocks themselves hand their hashes in through [`BlockKey::opaque`].

use crate::{HashScheme, Namespace, ProtoError};
use sha2::Digest;

pub const KEY_LEN: usize = 32;

const DOMAIN_FULL: u8 = 1;
const DOMAIN_PARTIAL: u8 = 2;
const DOMAIN_OPAQUE: u8 = 3;

/// A 256-bit block key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; KEY_LEN]);

impl std::fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "key:")?;
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl std::fmt::Display for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl TryFrom<&[u8]> for BlockKey {
    type Error = ProtoError;
    fn try_from(b: &[u8]) -> Result<Self, ProtoError> {
        let arr: [u8; KEY_LEN] =
            b.try_into().map_err(|_| ProtoError::KeyLength { expected: KEY_LEN, actual: b.len() })?;
        Ok(BlockKey(arr))
    }
}

impl BlockKey {
    /// Parses a key written as 64 hex digits.
    pub fn from_hex(s: &str) -> Result<Self, ProtoError> {
        let s = s.trim();
        if s.len() != KEY_LEN * 2 || !s.is_ascii() {
            return Err(ProtoError::KeyLength { expected: KEY_LEN, actual: s.len() / 2 });
        }
        let mut out = [0u8; KEY_LEN];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|_| ProtoError::Malformed(format!("key {s:?} is not hex")))?;
        }
        Ok(BlockKey(out))
    }

    /// Salts a hash an engine computed itself (vLLM's `sha256_cbor` block hash, SGLang's sha256
    /// chain) into this namespace. Any length of engine hash is accepted.
    pub fn opaque(ns: &Namespace, engine_hash: &[u8]) -> BlockKey {
        let mut h = Hasher::new(ns.hashing, &ns.key_salt());
        h.update(&[DOMAIN_OPAQUE]);
        h.update(&(engine_hash.len() as u64).to_le_bytes());
        h.update(engine_hash);
        h.finish()
    }
}

/// One hashing state for either scheme.
enum Hasher {
    Blake3(Box<blake3::Hasher>),
    Sha256(sha2::Sha256),
}

impl Hasher {
    fn new(scheme: HashScheme, salt: &[u8; 32]) -> Self {
        match scheme {
            HashScheme::Blake3 => Hasher::Blake3(Box::new(blake3::Hasher::new_keyed(salt))),
            HashScheme::Sha256 => {
                let mut h = sha2::Sha256::new();
                h.update(salt);
                Hasher::Sha256(h)
            }
        }
    }
    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Blake3(h) => {
                h.update(b);
            }
            Hasher::Sha256(h) => h.update(b),
        }
    }
    fn finish(self) -> BlockKey {
        match self {
            Hasher::Blake3(h) => BlockKey(*h.finalize().as_bytes()),
            Hasher::Sha256(h) => BlockKey(h.finalize().into()),
        }
    }
}

/// Computes the key chain of a token sequence in one namespace.
///
/// ```
/// use kvtier_proto::{DType, HashScheme, KeyChain, KvLayout, Namespace};
/// let ns = Namespace::new("t", "m", KvLayout::new(2, 1, 8, DType::Fp16, 4), HashScheme::Blake3, b"");
/// let chain = KeyChain::new(&ns);
/// let tokens: Vec<u32> = (0..10).collect();
/// let keys = chain.full_blocks(&tokens);
/// assert_eq!(keys.len(), 2); // 10 tokens = 2 full blocks of 4 + a tail of 2
/// // A longer prompt with the same first 8 tokens shares both keys.
/// let longer: Vec<u32> = (0..12).collect();
/// assert_eq!(chain.full_blocks(&longer)[..2], keys[..]);
/// assert!(chain.tail(&tokens).is_some());
/// ```
#[derive(Clone)]
pub struct KeyChain {
    scheme: HashScheme,
    salt: [u8; 32],
    block_tokens: usize,
    extra: Vec<u8>,
}

impl KeyChain {
    pub fn new(ns: &Namespace) -> Self {
        KeyChain {
            scheme: ns.hashing,
            salt: ns.key_salt(),
            block_tokens: ns.layout.block_tokens as usize,
            extra: Vec::new(),
        }
    }

    /// Extra bytes mixed into every key (a LoRA id, a multimodal input hash, a cache-salt).
    pub fn with_extra(mut self, extra: &[u8]) -> Self {
        self.extra = extra.to_vec();
        self
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    fn hash(&self, domain: u8, prev: Option<&BlockKey>, tokens: &[u32]) -> BlockKey {
        let mut h = Hasher::new(self.scheme, &self.salt);
        h.update(&[domain]);
        match prev {
            Some(p) => {
                h.update(&[1]);
                h.update(&p.0);
            }
            None => h.update(&[0]),
        }
        h.update(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.update(&(self.extra.len() as u32).to_le_bytes());
        h.update(&self.extra);
        h.finish()
    }

    /// Keys of every full block of `tokens`, in order.
    pub fn full_blocks(&self, tokens: &[u32]) -> Vec<BlockKey> {
        let mut keys = Vec::with_capacity(tokens.len() / self.block_tokens);
        let mut prev: Option<BlockKey> = None;
        for chunk in tokens.chunks_exact(self.block_tokens) {
            let k = self.hash(DOMAIN_FULL, prev.as_ref(), chunk);
            keys.push(k);
            prev = Some(k);
        }
        keys
    }

    /// Key of the partial last block, or `None` when `tokens` fill whole blocks.
    pub fn tail(&self, tokens: &[u32]) -> Option<BlockKey> {
        let full = tokens.len() / self.block_tokens * self.block_tokens;
        if full == tokens.len() {
            return None;
        }
        let prev = self.full_blocks(&tokens[..full]).last().copied();
        Some(self.tail_after(prev.as_ref(), &tokens[full..]))
    }

    /// Key of a partial block `tail_tokens` following the full block `prev`.
    pub fn tail_after(&self, prev: Option<&BlockKey>, tail_tokens: &[u32]) -> BlockKey {
        self.hash(DOMAIN_PARTIAL, prev, tail_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, KvLayout};
    use proptest::prelude::*;

    fn ns(scheme: HashScheme, salt: &[u8]) -> Namespace {
        Namespace::new("t", "m", KvLayout::new(2, 1, 8, DType::Fp16, 4), scheme, salt)
    }

    #[test]
    fn schemes_and_salts_give_different_keys() {
        let tokens: Vec<u32> = (0..8).collect();
        let a = KeyChain::new(&ns(HashScheme::Blake3, b"x")).full_blocks(&tokens);
        let b = KeyChain::new(&ns(HashScheme::Sha256, b"x")).full_blocks(&tokens);
        let c = KeyChain::new(&ns(HashScheme::Blake3, b"y")).full_blocks(&tokens);
        assert_ne!(a, b);
        assert_ne!(a, c);
        let d = KeyChain::new(&ns(HashScheme::Blake3, b"x")).with_extra(b"lora-7").full_blocks(&tokens);
        assert_ne!(a, d);
    }

    #[test]
    fn tail_never_equals_a_full_block() {
        let chain = KeyChain::new(&ns(HashScheme::Blake3, b""));
        let tokens: Vec<u32> = (0..4).collect();
        let full = chain.full_blocks(&tokens)[0];
        assert_ne!(chain.tail_after(None, &tokens), full);
        assert_eq!(chain.tail(&tokens), None);
        assert_eq!(chain.tail(&tokens[..3]), Some(chain.tail_after(None, &tokens[..3])));
    }

    #[test]
    fn key_length_is_checked() {
        assert_eq!(BlockKey::try_from(&[0u8; 31][..]), Err(ProtoError::KeyLength { expected: 32, actual: 31 }));
        let k = BlockKey([7; 32]);
        assert_eq!(BlockKey::from_hex(&k.to_string()).unwrap(), k);
        assert!(BlockKey::from_hex("zz").is_err());
    }

    #[test]
    fn opaque_keys_are_salted() {
        let a = BlockKey::opaque(&ns(HashScheme::Sha256, b"x"), b"vllm-hash");
        let b = BlockKey::opaque(&ns(HashScheme::Sha256, b"y"), b"vllm-hash");
        assert_ne!(a, b);
    }

    proptest! {
        #[test]
        fn keys_depend_on_the_whole_prefix(tokens in proptest::collection::vec(0u32..50_000, 8..64), flip in 0usize..8) {
            let chain = KeyChain::new(&ns(HashScheme::Blake3, b"p"));
            let keys = chain.full_blocks(&tokens);
            let mut other = tokens.clone();
            other[flip] ^= 1;
            let other_keys = chain.full_blocks(&other);
            // Changing a token changes its block's key and every key after it, never one before.
            let block = flip / 4;
            prop_assert_eq!(&keys[..block], &other_keys[..block]);
            for i in block..keys.len() {
                prop_assert_ne!(keys[i], other_keys[i]);
            }
        }
    }
}
