//! Stores and loads straight to a block's owners in a cluster. [`OwnerRouter`] reads the members
//! from the node the client talks to (its "home", `Members`), places every block with the
//! rendezvous hashing the nodes use ([`kvtier_proto::cluster::Placement`]) and sends it to its
//! first owner — which forwards it to the others when the namespace keeps more copies — so a
//! block crosses one hop instead of two (client → any node → owner). Loads go to the first owner
//! likewise. Whatever an owner can't take or serve (down, refused, a miss) goes through the home
//! node as before, so a stale view costs a hop, never a block; the view is re-read after
//! [`OwnerRouter::REFRESH`] or on [`OwnerRouter::refresh`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use kvtier_proto::cluster::{Member, NodeId, Placement};
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::{pb, BlockFrame, BlockKey, NamespaceId};

use crate::{ClientConfig, ClientError, KvClient, NamespaceHandle};

/// The cluster as a node reported it (`Members`); the default is a node without a cluster.
#[derive(Clone, Debug, Default)]
pub struct ClusterMembers {
    /// Every member, the reporting node included; empty for a node without a cluster.
    pub members: Vec<Member>,
    /// The reporting node's id.
    pub local: Option<NodeId>,
    /// Copies of each block of a namespace that sets no `replicas`.
    pub cluster_rf: usize,
    /// The membership store was unreachable: the last known members.
    pub stale: bool,
    /// Members that left within the last hour, and how long ago, newest first (empty from nodes
    /// older than this field). What they held left with them.
    pub departed: Vec<(NodeId, Duration)>,
}

impl KvClient {
    /// The cluster's members as this node sees them, with their labels and capacity.
    pub async fn members(&self) -> Result<ClusterMembers, ClientError> {
        let mut g = self.grpc();
        let r = self.timed(async move { Ok(g.members(pb::MembersRequest {}).await?.into_inner()) }).await?;
        let members = r.members.iter().map(Member::from_pb).collect::<Result<Vec<_>, _>>()?;
        let local = if r.local_id.is_empty() { None } else { Some(NodeId::new(r.local_id)?) };
        let departed = r
            .departed
            .into_iter()
            .map(|d| Ok((NodeId::new(d.node_id)?, Duration::from_millis(d.left_ms_ago))))
            .collect::<Result<Vec<_>, ClientError>>()?;
        Ok(ClusterMembers { members, local, cluster_rf: r.cluster_rf.max(1) as usize, stale: r.stale, departed })
    }
}

struct View {
    placement: Arc<Placement>,
    cluster_rf: usize,
    local: Option<NodeId>,
    at: Instant,
}

/// One member's client and the namespaces registered there.
struct Node {
    client: KvClient,
    handles: HashMap<NamespaceId, NamespaceHandle>,
}

/// Sends stores and loads straight to the owners of each block (see the module doc).
pub struct OwnerRouter {
    home: KvClient,
    cfg: ClientConfig,
    view: Mutex<View>,
    nodes: tokio::sync::Mutex<HashMap<NodeId, Node>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl OwnerRouter {
    /// How long a view of the members is used before it is read again.
    pub const REFRESH: Duration = Duration::from_secs(5);

    /// A router over the cluster `home` belongs to; `cfg` is how it connects to the other
    /// members (the same credentials as `home`'s).
    pub async fn new(home: KvClient, cfg: ClientConfig) -> Result<Self, ClientError> {
        let view = Self::read_view(&home).await?;
        Ok(OwnerRouter { home, cfg, view: Mutex::new(view), nodes: tokio::sync::Mutex::new(HashMap::new()) })
    }

    async fn read_view(home: &KvClient) -> Result<View, ClientError> {
        let m = home.members().await?;
        Ok(View {
            placement: Arc::new(Placement::new(&m.members)),
            cluster_rf: m.cluster_rf,
            local: m.local,
            at: Instant::now(),
        })
    }

    /// Reads the members again now.
    pub async fn refresh(&self) -> Result<(), ClientError> {
        let v = Self::read_view(&self.home).await?;
        *lock(&self.view) = v;
        Ok(())
    }

    /// The members of the current view.
    pub fn members(&self) -> Vec<Member> {
        lock(&self.view).placement.members().to_vec()
    }

    /// The home node's client.
    pub fn home(&self) -> &KvClient {
        &self.home
    }

    /// The placement to use (re-read when older than [`Self::REFRESH`]; a failed re-read keeps
    /// the old one).
    async fn placement(&self) -> (Arc<Placement>, usize, Option<NodeId>) {
        let old = lock(&self.view).at.elapsed() > Self::REFRESH;
        if old {
            let _ = self.refresh().await;
        }
        let v = lock(&self.view);
        (v.placement.clone(), v.cluster_rf, v.local.clone())
    }

    /// Member index → the keys' positions it owns first; `None` for keys the home node takes
    /// (an empty view, or the home node is the owner).
    fn plan(
        p: &Placement,
        rf: usize,
        local: Option<&NodeId>,
        ns: &NamespaceHandle,
        keys: impl Iterator<Item = BlockKey>,
    ) -> HashMap<Option<usize>, Vec<usize>> {
        let rf = match ns.namespace.replicas {
            0 => rf,
            n => usize::from(n),
        };
        let mut plan: HashMap<Option<usize>, Vec<usize>> = HashMap::new();
        for (i, k) in keys.enumerate() {
            let owner = p.owners(&ns.id, &k, rf).first().copied();
            let owner = owner.filter(|&o| Some(&p.members()[o].id) != local);
            plan.entry(owner).or_default().push(i);
        }
        plan
    }

    /// The client and namespace handle for `member` (connecting and registering once).
    async fn node(&self, member: &Member, ns: &NamespaceHandle) -> Result<(KvClient, NamespaceHandle), ClientError> {
        let mut nodes = self.nodes.lock().await;
        if !nodes.contains_key(&member.id) {
            let client = KvClient::connect(&member.grpc_addr, self.cfg.clone()).await?;
            nodes.insert(member.id.clone(), Node { client, handles: HashMap::new() });
        }
        let Some(node) = nodes.get_mut(&member.id) else {
            return Err(ClientError::Io(format!("no client for {}", member.id)));
        };
        if !node.handles.contains_key(&ns.id) {
            let h = node.client.register(ns.namespace.clone()).await?;
            node.handles.insert(ns.id, h);
        }
        let h = node.handles.get(&ns.id).cloned().ok_or_else(|| ClientError::Io("no namespace handle".into()))?;
        Ok((node.client.clone(), h))
    }

    /// Forgets `member`'s client after a failure (the next call connects again).
    async fn forget(&self, member: &Member) {
        self.nodes.lock().await.remove(&member.id);
    }

    /// Stores frames of `ns`, each sent to its first owner (the home node for those it owns, or
    /// when the owner fails). One status per frame.
    pub async fn store_frames(
        &self,
        ns: &NamespaceHandle,
        frames: &[BlockFrame],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        let (p, rf, local) = self.placement().await;
        let plan = Self::plan(&p, rf, local.as_ref(), ns, frames.iter().map(|f| f.header.key));
        let mut out: Vec<Option<ItemStatus>> = vec![None; frames.len()];
        let mut via_home: Vec<usize> = plan.get(&None).cloned().unwrap_or_default();
        let calls = plan.iter().filter_map(|(o, idx)| o.map(|o| (o, idx))).map(|(o, idx)| {
            let member = &p.members()[o];
            let batch: Vec<BlockFrame> = idx.iter().map(|&i| frames[i].clone()).collect();
            async move {
                let res = match self.node(member, ns).await {
                    Ok((c, _)) => c.store_frames(&batch).await,
                    Err(e) => Err(e),
                };
                (member, idx, res)
            }
        });
        for (member, idx, res) in join_all(calls).await {
            match res {
                Ok(st) if st.len() == idx.len() => {
                    for (&i, s) in idx.iter().zip(st) {
                        out[i] = Some(s);
                    }
                }
                _ => {
                    self.forget(member).await;
                    via_home.extend(idx);
                }
            }
        }
        if !via_home.is_empty() {
            via_home.sort_unstable();
            let batch: Vec<BlockFrame> = via_home.iter().map(|&i| frames[i].clone()).collect();
            let st = self.home.store_frames(&batch).await?;
            for (&i, s) in via_home.iter().zip(st) {
                out[i] = Some(s);
            }
        }
        out.into_iter().map(|s| s.ok_or_else(|| ClientError::Io("a frame got no status".into()))).collect()
    }

    /// Loads blocks of `ns`, each from its first owner; keys an owner misses or can't serve are
    /// asked of the home node (which asks its peers). One entry per key.
    pub async fn load_keys(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<BlockFrame>>, ClientError> {
        let (p, rf, local) = self.placement().await;
        let plan = Self::plan(&p, rf, local.as_ref(), ns, keys.iter().copied());
        let mut out: Vec<Option<BlockFrame>> = vec![None; keys.len()];
        let mut via_home: Vec<usize> = plan.get(&None).cloned().unwrap_or_default();
        let calls = plan.iter().filter_map(|(o, idx)| o.map(|o| (o, idx))).map(|(o, idx)| {
            let member = &p.members()[o];
            let asked: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
            async move {
                let res = match self.node(member, ns).await {
                    Ok((c, h)) => c.load_keys(&h, &asked).await,
                    Err(e) => Err(e),
                };
                (member, idx, res)
            }
        });
        for (member, idx, res) in join_all(calls).await {
            match res {
                Ok(got) if got.len() == idx.len() => {
                    for (&i, f) in idx.iter().zip(got) {
                        match f {
                            Some(f) => out[i] = Some(f),
                            None => via_home.push(i),
                        }
                    }
                }
                _ => {
                    self.forget(member).await;
                    via_home.extend(idx);
                }
            }
        }
        if !via_home.is_empty() {
            via_home.sort_unstable();
            let asked: Vec<BlockKey> = via_home.iter().map(|&i| keys[i]).collect();
            for (&i, f) in via_home.iter().zip(self.home.load_keys(ns, &asked).await?) {
                out[i] = f;
            }
        }
        Ok(out)
    }
}
