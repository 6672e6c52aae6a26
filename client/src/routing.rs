//! Routing hints ([`KvClient::route_hint`]): for a request's tokens (or block keys) and
//! optionally a session, which nodes of the cluster hold how long a prefix, and which hold the
//! session — what a KV-aware router needs to send a request, or an agent's next turn, where its
//! KV is. The node asked answers for itself and asks every other member (one call each, bounded
//! by its `peer_timeout`); a member that did not answer is listed as not `reachable`.

use bytes::Bytes;
use kvtier_proto::{pb, BlockKey};

use super::{KvClient, NamespaceHandle};
use crate::ClientError;

/// What one node holds of a routing hint's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeHolding {
    pub node_id: String,
    /// Its gRPC control plane, as clients dial it.
    pub grpc_addr: String,
    pub data_addr: String,
    /// The node that answered the hint.
    pub answering: bool,
    /// False: unknown (timed out, refused, known down); `error` says why.
    pub reachable: bool,
    pub prefix_blocks: usize,
    pub prefix_tokens: u64,
    pub holds_session: bool,
    pub session_tokens: u64,
    pub error: Option<String>,
}

/// A routing hint: per node, the prefix it holds and whether it holds the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteHint {
    /// Full blocks of the request.
    pub total_blocks: usize,
    pub block_tokens: usize,
    /// The answering node first, then the other members.
    pub nodes: Vec<NodeHolding>,
    /// The membership store was unreachable: the members are the last known set.
    pub membership_stale: bool,
}

impl RouteHint {
    fn from_pb(r: pb::RouteHintResponse) -> Self {
        RouteHint {
            total_blocks: r.total_blocks as usize,
            block_tokens: r.block_tokens as usize,
            membership_stale: r.membership_stale,
            nodes: r
                .nodes
                .into_iter()
                .map(|n| NodeHolding {
                    node_id: n.node_id,
                    grpc_addr: n.grpc_addr,
                    data_addr: n.data_addr,
                    answering: n.answering,
                    reachable: n.reachable,
                    prefix_blocks: n.prefix_blocks as usize,
                    prefix_tokens: n.prefix_tokens,
                    holds_session: n.holds_session,
                    session_tokens: n.session_tokens,
                    error: (!n.error.is_empty()).then_some(n.error),
                })
                .collect(),
        }
    }

    /// Where to send the request: a node holding the session if any, else the reachable node
    /// with the longest prefix (the answering node on a tie); `None` if no node answered.
    pub fn best(&self) -> Option<&NodeHolding> {
        let live = || self.nodes.iter().filter(|n| n.reachable);
        live().find(|n| n.holds_session).or_else(|| {
            live().fold(None, |best: Option<&NodeHolding>, n| match best {
                Some(b) if b.prefix_blocks >= n.prefix_blocks => Some(b),
                _ => Some(n),
            })
        })
    }

    /// The holding of node `id`.
    pub fn node(&self, id: &str) -> Option<&NodeHolding> {
        self.nodes.iter().find(|n| n.node_id == id)
    }
}

impl KvClient {
    /// Which nodes hold how long a prefix of `tokens` (keyed as this namespace keys them), and
    /// which hold `session`.
    pub async fn route_hint(
        &self,
        ns: &NamespaceHandle,
        tokens: &[u32],
        session: Option<&str>,
    ) -> Result<RouteHint, ClientError> {
        self.check_context(tokens.len())?;
        let req = pb::RouteHintRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            tokens: tokens.to_vec(),
            session_id: session.unwrap_or_default().to_string(),
            ..Default::default()
        };
        self.route_hint_request(req).await
    }

    /// [`KvClient::route_hint`] for a chain of block keys (engine-hashed blocks).
    pub async fn route_hint_keys(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        session: Option<&str>,
    ) -> Result<RouteHint, ClientError> {
        self.route_hint_request(keys_request(ns, keys, session, false)).await
    }

    /// What the node itself holds (no other member asked): the leading keys its tiers hold and,
    /// when it holds `session`, the session's token count. What nodes ask each other.
    pub async fn route_hint_local(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        session: Option<&str>,
    ) -> Result<(usize, Option<u64>), ClientError> {
        let r = self.route_hint_request(keys_request(ns, keys, session, true)).await?;
        let here = r.nodes.into_iter().find(|n| n.answering).ok_or_else(|| ClientError::Refused {
            code: "route-hint".into(),
            message: "the node's answer does not list itself".into(),
        })?;
        Ok((here.prefix_blocks, here.holds_session.then_some(here.session_tokens)))
    }

    async fn route_hint_request(&self, req: pb::RouteHintRequest) -> Result<RouteHint, ClientError> {
        let mut g = self.grpc();
        let r = self.timed(async move { Ok(g.route_hint(req).await?.into_inner()) }).await?;
        Ok(RouteHint::from_pb(r))
    }
}

fn keys_request(
    ns: &NamespaceHandle,
    keys: &[BlockKey],
    session: Option<&str>,
    local_only: bool,
) -> pb::RouteHintRequest {
    pb::RouteHintRequest {
        namespace_id: Bytes::copy_from_slice(&ns.id.0),
        keys: keys.iter().map(|k| Bytes::copy_from_slice(&k.0)).collect(),
        session_id: session.unwrap_or_default().to_string(),
        local_only,
        ..Default::default()
    }
}
