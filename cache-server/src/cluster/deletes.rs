//! Namespace deletes across the cluster. A purge or an unregistration asked of one node is done
//! there, then asked of every other member (flagged `local_only`, so it travels one hop): blocks
//! forwarded to their owners, cached from peers or replicated with a session live on other nodes,
//! and a node that kept them would hand them back through the peer tier. A member that can't be
//! reached — or that left the membership lately (killed: its TTL ran out) — is asked again in the
//! background, at once when it (re)appears in the membership and every so often, for up to
//! [`OWED_FOR`], so a node that was down when a tenant deleted its data does not keep serving it
//! once it is back. One delete is owed per member and namespace (a later one replaces it: an
//! unregistration a purge). A late unregistration is made as of when it was asked: sessions
//! touched since (the namespace registered again) stay, and the namespace with them; a late
//! purge removes what the member holds then. What this does not cover: the asking node itself
//! stopping before the member returns (owed deletes are held in memory), and a member back under
//! another node id.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::Namespace;

use super::member::{Member, NodeId};
use super::peer::PeerTier;

/// How long a delete a member missed is retried.
pub const OWED_FOR: Duration = Duration::from_secs(3600);
/// Most deletes owed to unreachable members at once; past it a missed delete is not retried
/// (logged and counted in `kvtier_peer_deletes_abandoned_total`).
pub const MAX_OWED: usize = 1024;
/// First and longest wait between the retries of an owed delete.
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What is deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NamespaceDelete {
    /// Every unpinned block of the namespace (`Purge`).
    Purge,
    /// The namespace itself: its sessions, its blocks and its registration (`UnregisterNamespace`).
    Unregister,
}

impl NamespaceDelete {
    pub fn name(self) -> &'static str {
        match self {
            NamespaceDelete::Purge => "purge",
            NamespaceDelete::Unregister => "unregister",
        }
    }
}

/// What a delete did on the other members.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterDelete {
    /// Members that did it (one that did not know the namespace had nothing of it: done too).
    pub members_done: u32,
    pub blocks_removed: u64,
    pub sessions_dropped: u64,
    /// Members that could not be reached, and why; each is asked again in the background.
    pub failed: Vec<(NodeId, String)>,
    /// Members that left the membership lately (killed, stopped): asked when they are back.
    pub away: Vec<(NodeId, String)>,
}

/// A delete owed to a member: what, and when it was asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owed {
    pub what: NamespaceDelete,
    pub asked: Instant,
}

/// Asks every member of `others` to do `what` to `ns` on its own, at once, each call within
/// `peer_timeout`. Queued forwards of `ns` are dropped first (they would bring blocks back).
pub async fn delete_elsewhere(
    peers: &Arc<PeerTier>,
    others: &[Member],
    ns: &Namespace,
    what: NamespaceDelete,
) -> ClusterDelete {
    let asked = Instant::now();
    peers.mark_deleted(ns.id());
    let mut out = ClusterDelete::default();
    for (id, ago) in peers.departed() {
        if others.iter().all(|m| m.id != id) {
            out.away.push((id.clone(), format!("not a member now (gone {ago:.0?}); asked when it is back")));
            owe(peers, id, ns.clone(), Owed { what, asked });
        }
    }
    let calls =
        others.iter().map(|m| async move { (m, peers.bounded(m, peers.transport().delete(m, ns, what, asked)).await) });
    for (m, r) in futures::future::join_all(calls).await {
        match r {
            Ok((sessions, blocks)) => {
                out.members_done += 1;
                out.sessions_dropped += sessions;
                out.blocks_removed += blocks;
            }
            Err(e) => {
                peers.failed(m, "delete", &e);
                out.failed.push((m.id.clone(), e.to_string()));
                owe(peers, m.id.clone(), ns.clone(), Owed { what, asked });
            }
        }
    }
    out
}

/// Owes `owed` of `ns` to member `id`: one retrying task per member and namespace, which asks
/// until the member answers, [`OWED_FOR`] passes, or this node's peer tier is gone. A delete
/// already owed there is replaced (the task sends the latest; an unregistration is not
/// replaced by a purge). The member is looked up in the membership at every try, so one that
/// left (killed: its TTL ran out) and came back is asked at its new addresses.
fn owe(peers: &Arc<PeerTier>, id: NodeId, ns: Namespace, owed: Owed) {
    let key = (id.clone(), ns.id());
    {
        let mut all = peers.owed_deletes().lock();
        if let Some(pending) = all.get_mut(&key) {
            if !(pending.what == NamespaceDelete::Unregister && owed.what == NamespaceDelete::Purge) {
                *pending = owed;
            }
            return;
        }
        if all.len() >= MAX_OWED {
            ::metrics::counter!("kvtier_peer_deletes_abandoned_total").increment(1);
            tracing::warn!(peer = %id, "a {} missed by an unreachable member is not retried: {MAX_OWED} are owed already", owed.what.name());
            return;
        }
        all.insert(key.clone(), owed);
        ::metrics::gauge!("kvtier_peer_deletes_owed").set(all.len() as f64);
    }
    let tier = Arc::downgrade(peers);
    let mut members = peers.members();
    tokio::spawn(async move {
        let give_up = Instant::now() + OWED_FOR;
        let mut wait = RETRY_FIRST;
        let mut watching = true;
        let done = loop {
            // A change of the membership (the member coming back) tries at once.
            tokio::select! {
                _ = tokio::time::sleep(wait) => wait = (wait * 2).min(RETRY_MAX),
                changed = members.changed(), if watching => watching = changed.is_ok(),
            }
            let Some(peers) = tier.upgrade() else { return };
            if Instant::now() > give_up {
                break None;
            }
            let member = peers.members().borrow().get(&id).cloned();
            let Some(member) = member else { continue };
            let Some(now_owed) = peers.owed_deletes().lock().get(&key).copied() else { return };
            let call = peers.transport().delete(&member, &ns, now_owed.what, now_owed.asked);
            if peers.bounded(&member, call).await.is_ok() {
                let mut all = peers.owed_deletes().lock();
                // Replaced meanwhile: the newer one is sent on the next try.
                if all.get(&key) == Some(&now_owed) {
                    all.remove(&key);
                    ::metrics::gauge!("kvtier_peer_deletes_owed").set(all.len() as f64);
                    break Some(now_owed.what);
                }
                wait = Duration::ZERO;
            }
        };
        match done {
            Some(what) => {
                ::metrics::counter!("kvtier_peer_deletes_retried_total").increment(1);
                tracing::info!(peer = %id, "a {} the member missed was done there", what.name());
            }
            None => {
                if let Some(peers) = tier.upgrade() {
                    let mut all = peers.owed_deletes().lock();
                    all.remove(&key);
                    ::metrics::gauge!("kvtier_peer_deletes_owed").set(all.len() as f64);
                }
                ::metrics::counter!("kvtier_peer_deletes_abandoned_total").increment(1);
                tracing::warn!(peer = %id, "a delete the member missed was given up after {OWED_FOR:?}");
            }
        }
    });
}
