//! Namespaces: tenant + model fingerprint + KV layout + hashing scheme + salt. Two namespaces
//! that differ in any of these never share a key, so two models, two tenants or two TP layouts
//! never share bytes by accident.

use crate::{KvLayout, ProtoError};

pub const NAMESPACE_ID_LEN: usize = 16;
const MAX_NAME_LEN: usize = 256;
const MAX_SALT_LEN: usize = 64;
const MAX_ENGINE_LEN: usize = 1024;

/// The hash that chains block keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum HashScheme {
    Blake3 = 1,
    Sha256 = 2,
}

impl HashScheme {
    pub fn from_code(code: u32) -> Result<Self, ProtoError> {
        match code {
            1 => Ok(HashScheme::Blake3),
            2 => Ok(HashScheme::Sha256),
            other => Err(ProtoError::UnknownHashScheme(other)),
        }
    }
}

/// A 128-bit id derived from every field of a [`Namespace`], salt included.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamespaceId(pub [u8; NAMESPACE_ID_LEN]);

impl NamespaceId {
    pub fn from_slice(b: &[u8]) -> Result<Self, ProtoError> {
        let arr: [u8; NAMESPACE_ID_LEN] =
            b.try_into().map_err(|_| ProtoError::NamespaceIdLength { expected: NAMESPACE_ID_LEN, actual: b.len() })?;
        Ok(NamespaceId(arr))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ns:{}", &self.to_hex()[..12])
    }
}

impl std::fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Who owns the KV and what produced it.
///
/// ```
/// use kvtier_proto::{DType, HashScheme, KvLayout, Namespace};
/// let layout = KvLayout::new(32, 8, 128, DType::Bf16, 16);
/// let a = Namespace::new("acme", "llama-3-8b@sha256:1234", layout, HashScheme::Blake3, b"acme-secret");
/// let b = Namespace::new("acme", "llama-3-8b@sha256:1234", layout, HashScheme::Blake3, b"other-secret");
/// assert_ne!(a.id(), b.id());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    pub tenant: String,
    /// A fingerprint of the model weights and anything else that changes the KV (e.g. a RoPE
    /// scaling setting or a LoRA adapter), chosen by the engine.
    pub model: String,
    pub layout: KvLayout,
    pub hashing: HashScheme,
    /// Per-tenant secret mixed into every key, so keys can't be crafted to collide with another
    /// tenant's.
    pub salt: Vec<u8>,
    /// What an engine's own block hashes don't carry, as `key=value;` pairs the engine adapter
    /// writes (engine, model revision, PP stage, page size, layout name, hash algorithm). Empty
    /// for token-hashed namespaces. Part of the identity when set.
    pub engine: String,
    /// Blocks are only ever stored and kept lossless: a quantized store is refused, and no tier
    /// re-encodes them lossily. Always so for an opaque layout. Part of the identity when set.
    pub lossless: bool,
    /// In a cluster: how many nodes hold each block and parked session (1..=[`MAX_REPLICAS`]);
    /// 0 leaves it to the cluster's default (`cluster_rf`). Part of the identity when set, so
    /// every node derives the same factor from the same spec.
    pub replicas: u8,
}

/// Most copies a namespace may ask a cluster to keep.
pub const MAX_REPLICAS: u8 = 8;

impl Namespace {
    pub fn new(
        tenant: impl Into<String>,
        model: impl Into<String>,
        layout: KvLayout,
        hashing: HashScheme,
        salt: &[u8],
    ) -> Self {
        Namespace {
            tenant: tenant.into(),
            model: model.into(),
            layout,
            hashing,
            salt: salt.to_vec(),
            engine: String::new(),
            lossless: false,
            replicas: 0,
        }
    }

    /// The same namespace for an engine that hashes blocks itself: `engine` holds what its hashes
    /// don't (see [`Namespace::engine`]).
    pub fn with_engine(mut self, engine: impl Into<String>) -> Self {
        self.engine = engine.into();
        self
    }

    /// The same namespace, lossless only (see [`Namespace::lossless`]).
    pub fn with_lossless(mut self, lossless: bool) -> Self {
        self.lossless = lossless;
        self
    }

    /// The same namespace, held by `replicas` nodes of a cluster (see [`Namespace::replicas`]).
    pub fn with_replicas(mut self, replicas: u8) -> Self {
        self.replicas = replicas;
        self
    }

    /// Whether no block of this namespace may be quantized: `lossless`, or an opaque layout.
    pub fn is_lossless(&self) -> bool {
        self.lossless || self.layout.is_opaque()
    }

    pub fn validate(&self) -> Result<(), ProtoError> {
        let bad = |m: String| Err(ProtoError::InvalidNamespace(m));
        if self.tenant.is_empty() || self.tenant.len() > MAX_NAME_LEN {
            return bad(format!("tenant must be 1..={MAX_NAME_LEN} bytes"));
        }
        if self.model.is_empty() || self.model.len() > MAX_NAME_LEN {
            return bad(format!("model must be 1..={MAX_NAME_LEN} bytes"));
        }
        if self.salt.len() > MAX_SALT_LEN {
            return bad(format!("salt must be at most {MAX_SALT_LEN} bytes"));
        }
        if self.engine.len() > MAX_ENGINE_LEN {
            return bad(format!("engine must be at most {MAX_ENGINE_LEN} bytes"));
        }
        if self.replicas > MAX_REPLICAS {
            return bad(format!("replicas must be 0 (the cluster's default) ..={MAX_REPLICAS}, got {}", self.replicas));
        }
        self.layout.validate()
    }

    fn canonical(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.tenant.len() + self.model.len() + self.salt.len());
        for field in [self.tenant.as_bytes(), self.model.as_bytes(), &self.salt] {
            out.extend_from_slice(&(field.len() as u32).to_le_bytes());
            out.extend_from_slice(field);
        }
        self.layout.encode_identity_into(&mut out);
        out.push(self.hashing as u8);
        // Appended only when set, so the ids of namespaces made before these fields are unchanged.
        if !self.engine.is_empty() || self.lossless {
            out.extend_from_slice(b"engine");
            out.extend_from_slice(&(self.engine.len() as u32).to_le_bytes());
            out.extend_from_slice(self.engine.as_bytes());
            out.push(u8::from(self.lossless));
        }
        if self.replicas != 0 {
            out.extend_from_slice(b"replicas");
            out.push(self.replicas);
        }
        out
    }

    /// The id blocks and sessions carry.
    pub fn id(&self) -> NamespaceId {
        let h = blake3::derive_key("kvtier 2026 namespace id v1", &self.canonical());
        let mut id = [0u8; NAMESPACE_ID_LEN];
        id.copy_from_slice(&h[..NAMESPACE_ID_LEN]);
        NamespaceId(id)
    }

    /// The 256-bit salt every key of this namespace is hashed with.
    pub fn key_salt(&self) -> [u8; 32] {
        blake3::derive_key("kvtier 2026 block key salt v1", &self.canonical())
    }

    #[cfg(feature = "grpc")]
    pub fn to_pb(&self) -> crate::pb::NamespaceSpec {
        crate::pb::NamespaceSpec {
            tenant: self.tenant.clone(),
            model: self.model.clone(),
            layout: Some(self.layout.to_pb()),
            hashing: self.hashing as u32,
            salt: bytes::Bytes::copy_from_slice(&self.salt),
            engine: self.engine.clone(),
            lossless: self.lossless,
            replicas: u32::from(self.replicas),
        }
    }

    #[cfg(feature = "grpc")]
    pub fn from_pb(pb: &crate::pb::NamespaceSpec) -> Result<Self, ProtoError> {
        let layout = pb.layout.as_ref().ok_or_else(|| ProtoError::InvalidNamespace("layout is missing".into()))?;
        let ns = Namespace {
            tenant: pb.tenant.clone(),
            model: pb.model.clone(),
            layout: KvLayout::from_pb(layout)?,
            hashing: HashScheme::from_code(pb.hashing)?,
            salt: pb.salt.to_vec(),
            engine: pb.engine.clone(),
            lossless: pb.lossless,
            replicas: u8::try_from(pb.replicas).unwrap_or(u8::MAX),
        };
        ns.validate()?;
        Ok(ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn ns() -> Namespace {
        Namespace::new("t", "m", KvLayout::new(4, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"s")
    }

    #[test]
    fn every_field_changes_the_id() {
        let base = ns();
        let mut variants = vec![];
        let mut v = base.clone();
        v.tenant = "u".into();
        variants.push(v);
        let mut v = base.clone();
        v.model = "n".into();
        variants.push(v);
        let mut v = base.clone();
        v.layout.tp_world = 2;
        variants.push(v);
        let mut v = base.clone();
        v.hashing = HashScheme::Sha256;
        variants.push(v);
        let mut v = base.clone();
        v.salt = b"t".to_vec();
        variants.push(v);
        variants.push(base.clone().with_engine("engine=vllm;pp=0"));
        variants.push(base.clone().with_engine("engine=vllm;pp=1"));
        variants.push(base.clone().with_lossless(true));
        variants.push(base.clone().with_replicas(2));
        variants.push(base.clone().with_replicas(3));
        let mut v = base.clone();
        v.layout = KvLayout::opaque(4096, DType::Fp16, 16);
        variants.push(v.clone());
        v.layout.opaque_block_bytes = 8192;
        variants.push(v);
        // Length prefixes keep ("ab","c") apart from ("a","bc").
        let mut v = base.clone();
        v.tenant = "tm".into();
        v.model = "".into();
        variants.push(v);
        for v in &variants {
            assert_ne!(v.id(), base.id(), "{v:?}");
            assert_ne!(v.key_salt(), base.key_salt(), "{v:?}");
        }
        assert_eq!(ns().id(), base.id());
        for (i, a) in variants.iter().enumerate() {
            for b in &variants[i + 1..] {
                assert_ne!(a.id(), b.id(), "{a:?} vs {b:?}");
            }
        }
    }

    /// `ns()`'s id as computed by an independent BLAKE3 (Python `blake3.blake3(canonical,
    /// derive_key_context=...)`) over the canonical encoding these fields came after.
    const STABLE_ID: &str = "3b9b5527f881ac5dfe55636b6b405f9a";

    /// Ids persisted before `engine`/`lossless`/opaque layouts existed must not change.
    #[test]
    fn ids_of_plain_namespaces_are_stable() {
        assert_eq!(ns().id().to_hex(), STABLE_ID);
    }

    #[test]
    #[cfg(feature = "grpc")]
    fn opaque_namespaces_round_trip_and_are_lossless() {
        let n = Namespace::new("t", "m", KvLayout::opaque(1 << 21, DType::Bf16, 256), HashScheme::Sha256, b"s")
            .with_engine("engine=vllm;hash=sha256");
        assert!(n.is_lossless() && !ns().is_lossless());
        assert_eq!(Namespace::from_pb(&n.to_pb()).unwrap(), n);
        let mut pb = n.to_pb();
        pb.layout.as_mut().unwrap().opaque_block_bytes = 0;
        assert!(Namespace::from_pb(&pb).is_err(), "an opaque layout needs its block size");
        let mut pb = ns().to_pb();
        pb.layout.as_mut().unwrap().opaque_block_bytes = 7;
        assert!(Namespace::from_pb(&pb).is_err(), "block bytes only for the opaque order");
    }

    #[test]
    #[cfg(feature = "grpc")]
    fn pb_round_trip_and_validation() {
        let n = ns();
        assert_eq!(Namespace::from_pb(&n.to_pb()).unwrap(), n);
        let mut pb = n.to_pb();
        pb.tenant.clear();
        assert!(matches!(Namespace::from_pb(&pb), Err(ProtoError::InvalidNamespace(_))));
        let mut pb = n.to_pb();
        pb.layout = None;
        assert!(Namespace::from_pb(&pb).is_err());
    }

    #[test]
    fn replicas_are_bounded_and_zero_keeps_the_id() {
        assert_eq!(ns().with_replicas(0).id(), ns().id(), "0 (the cluster's default) is no change");
        assert!(ns().with_replicas(8).validate().is_ok());
        let err = ns().with_replicas(9).validate().unwrap_err().to_string();
        assert!(err.contains("replicas"), "{err}");
    }
}
