//! KV events ([`KvClient::watch_events`]): a node's stream of stored, evicted and purged block
//! keys and of parked, dropped and expired sessions, for a KV-aware router's index. Events carry
//! the node's id, so a router merges the streams of every node. A watcher that fell behind gets
//! [`EventKind::Lagged`] (events were lost): it should resync with `lookup` / `route_hint`.

use bytes::Bytes;
use kvtier_proto::{pb, BlockKey, NamespaceId};

use super::{KvClient, NamespaceHandle};
use crate::ClientError;

/// What an event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Stored,
    Evicted,
    Purged,
    SessionParked,
    SessionDropped,
    SessionExpired,
    /// The watcher missed `missed` events.
    Lagged,
    /// A kind this client does not know (a newer server).
    Other(i32),
}

impl EventKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            EventKind::Stored => "stored",
            EventKind::Evicted => "evicted",
            EventKind::Purged => "purged",
            EventKind::SessionParked => "session_parked",
            EventKind::SessionDropped => "session_dropped",
            EventKind::SessionExpired => "session_expired",
            EventKind::Lagged => "lagged",
            EventKind::Other(_) => "other",
        }
    }
}

/// One event of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    pub node_id: String,
    /// Per node, increasing.
    pub seq: u64,
    pub kind: EventKind,
    /// `None` for `Lagged`.
    pub namespace: Option<NamespaceId>,
    pub keys: Vec<BlockKey>,
    /// Stored: where; evicted: from where.
    pub tier: String,
    /// Evicted: where to ("" gone).
    pub to_tier: String,
    pub session_id: String,
    /// Lagged: how many events were missed.
    pub missed: u64,
    pub unix_ms: u64,
}

impl KvEvent {
    fn from_pb(e: pb::KvEvent) -> Result<Self, ClientError> {
        let kind = match pb::KvEventKind::try_from(e.kind) {
            Ok(pb::KvEventKind::BlocksStored) => EventKind::Stored,
            Ok(pb::KvEventKind::BlocksEvicted) => EventKind::Evicted,
            Ok(pb::KvEventKind::BlocksPurged) => EventKind::Purged,
            Ok(pb::KvEventKind::SessionParked) => EventKind::SessionParked,
            Ok(pb::KvEventKind::SessionDropped) => EventKind::SessionDropped,
            Ok(pb::KvEventKind::SessionExpired) => EventKind::SessionExpired,
            Ok(pb::KvEventKind::Lagged) => EventKind::Lagged,
            _ => EventKind::Other(e.kind),
        };
        let namespace = if e.namespace_id.is_empty() { None } else { Some(NamespaceId::from_slice(&e.namespace_id)?) };
        let keys = e.keys.iter().map(|k| BlockKey::try_from(&k[..])).collect::<Result<Vec<_>, _>>()?;
        Ok(KvEvent {
            node_id: e.node_id,
            seq: e.seq,
            kind,
            namespace,
            keys,
            tier: e.tier,
            to_tier: e.to_tier,
            session_id: e.session_id,
            missed: e.missed,
            unix_ms: e.unix_ms,
        })
    }
}

/// An open event stream. Dropping it ends the watch (and frees its place under the node's
/// watcher limits).
pub struct EventWatch {
    stream: tonic::Streaming<pb::KvEvent>,
}

impl EventWatch {
    /// The next event; `None` when the node ended the stream (it stopped). Waits as long as it
    /// takes: bound it with a timeout where needed.
    pub async fn next(&mut self) -> Result<Option<KvEvent>, ClientError> {
        match self.stream.message().await? {
            Some(e) => Ok(Some(KvEvent::from_pb(e)?)),
            None => Ok(None),
        }
    }
}

impl KvClient {
    /// Watches the node's events for `namespaces` (empty: every namespace this client may read;
    /// the operator: all). Refused with `PermissionDenied` for another tenant's namespace, and
    /// `ResourceExhausted` past the node's watcher limits.
    pub async fn watch_events(&self, namespaces: &[&NamespaceHandle]) -> Result<EventWatch, ClientError> {
        let ids: Vec<NamespaceId> = namespaces.iter().map(|n| n.id).collect();
        self.watch_events_ids(&ids).await
    }

    /// [`KvClient::watch_events`] by namespace id.
    pub async fn watch_events_ids(&self, namespaces: &[NamespaceId]) -> Result<EventWatch, ClientError> {
        let req =
            pb::WatchEventsRequest { namespace_ids: namespaces.iter().map(|n| Bytes::copy_from_slice(&n.0)).collect() };
        let mut g = self.grpc();
        let stream = self.timed(async move { Ok(g.watch_events(req).await?.into_inner()) }).await?;
        Ok(EventWatch { stream })
    }
}
