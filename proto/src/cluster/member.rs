//! What the cluster knows about one server: its id, where to reach it, where it sits (node, rack,
//! zone labels) and how much it can hold. Shared by [`super::membership`], which announces and
//! watches members (in the server), and [`super::placement`], which maps blocks onto them.

use std::fmt;

use crate::ProtoError;

/// Longest member id, label or address accepted (bytes).
pub const MAX_FIELD_LEN: usize = 256;

/// A server's id in the cluster: stable across restarts of the same server (placement hashes it,
/// so a new id moves that server's share of the keys).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(String);

impl NodeId {
    /// 1 to [`MAX_FIELD_LEN`] bytes of printable ASCII without spaces.
    pub fn new(id: impl Into<String>) -> Result<Self, ProtoError> {
        let id = id.into();
        check_field("member id", &id)?;
        if id.is_empty() {
            return Err(ProtoError::InvalidMember("member id is empty".into()));
        }
        Ok(NodeId(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// Where a member sits. An absent label means "unknown": for spreading replicas such a member
/// counts as its own domain; for a reader's preference it matches nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Labels {
    /// The machine (several servers may share one, e.g. one per NUMA socket).
    pub node: Option<String>,
    pub rack: Option<String>,
    pub zone: Option<String>,
}

impl Labels {
    pub fn new(node: Option<&str>, rack: Option<&str>, zone: Option<&str>) -> Self {
        let own = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_owned);
        Labels { node: own(node), rack: own(rack), zone: own(zone) }
    }

    fn validate(&self) -> Result<(), ProtoError> {
        for (what, v) in [("node label", &self.node), ("rack label", &self.rack), ("zone label", &self.zone)] {
            if let Some(v) = v {
                check_field(what, v)?;
            }
        }
        Ok(())
    }
}

/// One member of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: NodeId,
    /// The gRPC control plane, as peers and clients should dial it (`host:port`).
    pub grpc_addr: String,
    /// The bulk data plane (`host:port`).
    pub data_addr: String,
    pub labels: Labels,
    /// Bytes the member offers for blocks; placement gives it a share of the keys in proportion.
    /// Zero means "owns nothing" (a draining or client-only member).
    pub capacity: u64,
    /// When the member's process first registered (unix ms; 0 when unknown): a member that
    /// started lately holds little of what it owns yet. Compared with the other fields, so a
    /// restart is a change of the membership.
    pub since_ms: u64,
}

impl Member {
    /// Checks every field's length and characters.
    pub fn validate(&self) -> Result<(), ProtoError> {
        check_field("gRPC address", &self.grpc_addr)?;
        check_field("data address", &self.data_addr)?;
        self.labels.validate()
    }
}

#[cfg(feature = "grpc")]
impl Member {
    /// The member as `Members` lists it.
    pub fn to_pb(&self) -> crate::pb::ClusterMember {
        let label = |l: &Option<String>| l.clone().unwrap_or_default();
        crate::pb::ClusterMember {
            node_id: self.id.as_str().to_string(),
            grpc_addr: self.grpc_addr.clone(),
            data_addr: self.data_addr.clone(),
            node: label(&self.labels.node),
            rack: label(&self.labels.rack),
            zone: label(&self.labels.zone),
            capacity: self.capacity,
        }
    }

    /// A member `Members` listed, checked.
    pub fn from_pb(m: &crate::pb::ClusterMember) -> Result<Self, ProtoError> {
        fn label(l: &str) -> Option<&str> {
            (!l.is_empty()).then_some(l)
        }
        let member = Member {
            id: NodeId::new(m.node_id.clone())?,
            grpc_addr: m.grpc_addr.clone(),
            data_addr: m.data_addr.clone(),
            labels: Labels::new(label(&m.node), label(&m.rack), label(&m.zone)),
            capacity: m.capacity,
            since_ms: 0,
        };
        member.validate()?;
        Ok(member)
    }
}

/// Printable ASCII, no spaces, at most [`MAX_FIELD_LEN`] bytes.
fn check_field(what: &str, v: &str) -> Result<(), ProtoError> {
    if v.len() > MAX_FIELD_LEN {
        return Err(ProtoError::InvalidMember(format!("{what} is {} bytes, more than {MAX_FIELD_LEN}", v.len())));
    }
    if !v.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ProtoError::InvalidMember(format!("{what} {v:?} must be printable ASCII without spaces")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_fields_are_checked() {
        assert!(NodeId::new("node-1").is_ok());
        assert!(NodeId::new("").is_err());
        assert!(NodeId::new("a b").is_err());
        assert!(NodeId::new("x".repeat(MAX_FIELD_LEN + 1)).is_err());
        let mut m = Member {
            id: NodeId::new("n").unwrap(),
            grpc_addr: "10.0.0.1:7070".into(),
            data_addr: "10.0.0.1:7071".into(),
            labels: Labels::new(Some("host-a"), Some(""), None),
            capacity: 1,
            since_ms: 0,
        };
        assert_eq!(m.labels.rack, None, "an empty label is no label");
        assert!(m.validate().is_ok());
        m.labels.zone = Some("eu\nwest".into());
        assert!(m.validate().is_err());
    }
}
