//! The records of `namespaces.log`: a registration (a protobuf `NamespaceSpec`, which the server
//! decodes), an unregistration or a purge (the id and the disk tier's write position then), as bodies of
//! [`super`]'s keyed records; and the replay of a whole file, as the server runs it at start (and
//! the fuzz target on arbitrary bytes).

use crate::{NamespaceId, ProtoError, NAMESPACE_ID_LEN};

use super::{read_log, LogContents, LogKind};

/// A body's first byte: a registration.
pub const REGISTER: u8 = 0;
/// A body's first byte: an unregistration.
pub const UNREGISTER: u8 = 1;
/// A body's first byte: a purge (the namespace stays registered).
pub const PURGE: u8 = 2;
/// Largest record body replay believes (a `NamespaceSpec` is well under a KiB).
pub const MAX_RECORD: usize = 1 << 20;

/// One record of `namespaces.log`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NamespaceRecord<'a> {
    /// The protobuf `NamespaceSpec` of a registered namespace.
    Register(&'a [u8]),
    /// A namespace unregistered when the disk tier's write position was `mark` (segment,
    /// offset): copies of its blocks before it predate the unregistration.
    Unregister { id: NamespaceId, mark: (u64, u64) },
    /// A namespace's blocks purged when the disk tier's write position was `mark`: copies on
    /// disk before it are gone (except those a parked session pinned).
    Purge { id: NamespaceId, mark: (u64, u64) },
}

impl NamespaceRecord<'_> {
    /// The record's body.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            NamespaceRecord::Register(spec) => {
                let mut b = Vec::with_capacity(1 + spec.len());
                b.push(REGISTER);
                b.extend_from_slice(spec);
                b
            }
            NamespaceRecord::Unregister { id, mark } | NamespaceRecord::Purge { id, mark } => {
                let mut b = Vec::with_capacity(1 + NAMESPACE_ID_LEN + 16);
                b.push(if matches!(self, NamespaceRecord::Purge { .. }) { PURGE } else { UNREGISTER });
                b.extend_from_slice(&id.0);
                b.extend_from_slice(&mark.0.to_le_bytes());
                b.extend_from_slice(&mark.1.to_le_bytes());
                b
            }
        }
    }

    /// A record from its body; `None` for a kind or length this build does not know.
    pub fn decode(body: &[u8]) -> Option<NamespaceRecord<'_>> {
        let (&kind, rest) = body.split_first()?;
        match kind {
            REGISTER => Some(NamespaceRecord::Register(rest)),
            UNREGISTER => NamespaceRecord::unregistration(rest),
            PURGE => match NamespaceRecord::unregistration(rest)? {
                NamespaceRecord::Unregister { id, mark } => Some(NamespaceRecord::Purge { id, mark }),
                _ => None,
            },
            _ => None,
        }
    }

    /// An unregistration from its 32 bytes (id, segment, offset).
    pub fn unregistration(b: &[u8]) -> Option<NamespaceRecord<'_>> {
        if b.len() != NAMESPACE_ID_LEN + 16 {
            return None;
        }
        let id = NamespaceId::from_slice(&b[..NAMESPACE_ID_LEN]).ok()?;
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        Some(NamespaceRecord::Unregister { id, mark: (word(NAMESPACE_ID_LEN), word(NAMESPACE_ID_LEN + 8)) })
    }
}

/// The records of a current-format `namespaces.log` in file order and the damaged stretches
/// skipped; `None` for a file without a header (the first format, which the server reads with
/// its own legacy reader).
pub fn read_namespace_log(file: &[u8]) -> Result<Option<(Vec<NamespaceRecord<'_>>, u64)>, ProtoError> {
    let LogContents::Keyed { scan, .. } = read_log(LogKind::Namespaces, file, MAX_RECORD)? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(scan.records.len());
    let mut skipped = scan.skipped;
    for (_, body) in scan.records {
        // The server's own record (its tag verified); one this build cannot read is counted.
        match NamespaceRecord::decode(body) {
            Some(r) => out.push(r),
            None => skipped += 1,
        }
    }
    Ok(Some((out, skipped)))
}
