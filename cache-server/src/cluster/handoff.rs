//! Hinted handoff: blocks a forward could not give one of their owners — the owner was skipped
//! as down, or the call failed — are remembered by key, per owner ([`Hints`], bounded), and sent
//! to it again from this node's own tiers once it answers. Without it an owner that was away a
//! moment never got them: with one copy per block, every other node missed those blocks (they
//! were held only by the node that stored them, and a store again found them present there).
//!
//! A hint is given up after [`HINT_FOR`], and when the block is no longer held here (evicted,
//! purged), its namespace is gone or was deleted since, or the member no longer owns the key
//! (the membership changed). A refusal the owner answered with (no room, a tenant's quota) is
//! not a miss: nothing is remembered for it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, NamespaceId};
use tokio::sync::watch;

use super::member::NodeId;
use super::peer::PeerTier;
use crate::dram::StoredBlock;
use crate::error::ServerError;
use crate::state::NodeState;
use crate::tiers::Load;

/// Most keys remembered for all members together; past it a missed block is dropped (counted in
/// `kvtier_peer_forward_dropped_total`, as before hints).
pub const MAX_HINTS: usize = 65_536;
/// How long a hint is kept.
pub const HINT_FOR: Duration = Duration::from_secs(1800);
/// How often the hints are looked at (when there are any).
const PASS_EVERY: Duration = Duration::from_secs(1);
/// Keys one pass takes per member.
const PASS_KEYS: usize = 4096;
/// Payload bytes per request to the member.
const CHUNK_BYTES: usize = 16 << 20;

/// One block owed to an owner: its namespace, its key and when it was stored here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint {
    pub ns: NamespaceId,
    pub key: BlockKey,
    pub stored: Instant,
}

/// The hints of every member, oldest first per member, at most [`MAX_HINTS`] in all.
#[derive(Debug, Default)]
pub struct Hints {
    by_member: HashMap<NodeId, VecDeque<Hint>>,
    total: usize,
}

impl Hints {
    /// Remembers `keys` of `ns` (stored at `stored`) for `member`; returns how many did not fit.
    pub fn add(&mut self, member: &NodeId, ns: NamespaceId, keys: &[BlockKey], stored: Instant) -> usize {
        let room = MAX_HINTS - self.total;
        let take = keys.len().min(room);
        if take > 0 {
            let q = self.by_member.entry(member.clone()).or_default();
            q.extend(keys[..take].iter().map(|&key| Hint { ns, key, stored }));
            self.total += take;
        }
        keys.len() - take
    }

    /// Up to `n` of `member`'s hints, oldest first.
    pub fn take(&mut self, member: &NodeId, n: usize) -> Vec<Hint> {
        let Some(q) = self.by_member.get_mut(member) else { return Vec::new() };
        let out: Vec<Hint> = q.drain(..n.min(q.len())).collect();
        if q.is_empty() {
            self.by_member.remove(member);
        }
        self.total -= out.len();
        out
    }

    /// Gives back hints taken and not sent (the member failed again), ahead of the rest; what no
    /// longer fits is dropped and counted in the return value.
    pub fn put_back(&mut self, member: &NodeId, hints: Vec<Hint>) -> usize {
        let room = MAX_HINTS - self.total;
        let keep = hints.len().min(room);
        let q = self.by_member.entry(member.clone()).or_default();
        for h in hints[..keep].iter().rev() {
            q.push_front(*h);
        }
        if q.is_empty() {
            self.by_member.remove(member);
        }
        self.total += keep;
        hints.len() - keep
    }

    /// Forgets every hint of namespace `ns` (it was purged or unregistered); how many.
    pub fn forget_namespace(&mut self, ns: &NamespaceId) -> usize {
        let before = self.total;
        for q in self.by_member.values_mut() {
            q.retain(|h| h.ns != *ns);
        }
        self.by_member.retain(|_, q| !q.is_empty());
        self.total = self.by_member.values().map(VecDeque::len).sum();
        before - self.total
    }

    /// Forgets hints stored before `before`; how many.
    pub fn expire(&mut self, before: Instant) -> usize {
        let was = self.total;
        for q in self.by_member.values_mut() {
            while q.front().is_some_and(|h| h.stored < before) {
                q.pop_front();
            }
        }
        self.by_member.retain(|_, q| !q.is_empty());
        self.total = self.by_member.values().map(VecDeque::len).sum();
        was - self.total
    }

    pub fn members(&self) -> Vec<NodeId> {
        self.by_member.keys().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

/// Sends the hints of members that answer again, every [`PASS_EVERY`] while there are any, until
/// `stop` turns true.
pub async fn handoff_loop(state: Arc<NodeState>, mut stop: watch::Receiver<bool>) {
    let Some(peers) = state.tiers().peers().cloned() else { return };
    loop {
        tokio::select! {
            _ = crate::stopped(&mut stop) => return,
            _ = tokio::time::sleep(PASS_EVERY) => {}
        }
        if peers.hints().lock().is_empty() {
            continue;
        }
        handoff_pass(&state, &peers).await;
    }
}

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Handoff {
    /// Blocks the members took.
    pub sent: u64,
    /// Hints given up: aged out, the block gone from here, the namespace gone or deleted since,
    /// the member no longer an owner, or no room to keep them after a failure.
    pub given_up: u64,
}

/// One pass: every member with hints that is in the membership and not known to be down gets
/// (up to [`PASS_KEYS`] of) its blocks.
pub async fn handoff_pass(state: &NodeState, peers: &Arc<PeerTier>) -> Handoff {
    let now = Instant::now();
    let mut out = Handoff::default();
    let members = {
        let mut hints = peers.hints().lock();
        out.given_up += now.checked_sub(HINT_FOR).map_or(0, |t| hints.expire(t)) as u64;
        hints.members()
    };
    let p = peers.placement();
    for id in members {
        let Some(at) = p.members().iter().position(|m| m.id == id) else { continue };
        let member = &p.members()[at];
        if peers.is_down(&member.id, now) {
            continue;
        }
        let taken = peers.hints().lock().take(&id, PASS_KEYS);
        let mut by_ns: HashMap<NamespaceId, Vec<Hint>> = HashMap::new();
        for h in taken {
            by_ns.entry(h.ns).or_default().push(h);
        }
        let mut unsent = Vec::new();
        let mut failed = false;
        // The first request of a pass carries one block: a member still unreachable (a partition)
        // costs one block read per pass, not a chunk's.
        let mut probed = false;
        for (ns_id, hints) in by_ns {
            if failed {
                unsent.extend(hints);
                continue;
            }
            let Ok(ns) = state.namespace(&ns_id) else {
                out.given_up += hints.len() as u64;
                continue;
            };
            let rf = peers.rf_for(&ns);
            let mut chunk: Vec<StoredBlock> = Vec::new();
            let mut in_chunk: Vec<Hint> = Vec::new();
            let mut bytes = 0usize;
            let last = hints.len();
            for (i, h) in hints.into_iter().enumerate() {
                if failed {
                    unsent.push(h);
                    continue;
                }
                let owner = p.owners(&ns_id, &h.key, rf).contains(&at);
                // This node's own DRAM and disk only (G1 is not asked to spill for a hint).
                let held = state.tiers().tiers().any(|t| t.contains(&ns_id, &h.key));
                if !owner || !held || peers.deleted_since(&ns_id, h.stored) {
                    out.given_up += 1;
                } else {
                    match state.tiers().get_for_node(&ns_id, &h.key).await {
                        Load::Hit(b) => {
                            bytes += b.payload.len();
                            chunk.push(b);
                            in_chunk.push(h);
                        }
                        // The disk's read budget taken by loads now: the next pass.
                        Load::Busy => unsent.push(h),
                        Load::Miss => out.given_up += 1,
                    }
                }
                if !chunk.is_empty() && (!probed || bytes >= CHUNK_BYTES || i + 1 == last) {
                    probed = true;
                    match peers.bounded(member, peers.transport().put(member, &ns, &chunk)).await {
                        Ok(held) => {
                            out.sent += held as u64;
                            // Refused there (no room, a quota): not a miss to remember.
                            out.given_up += chunk.len().saturating_sub(held) as u64;
                            peers.count_forwarded(held as u64, chunk.iter().map(|b| b.payload.len() as u64).sum());
                        }
                        Err(e) => {
                            failed = matches!(e, ServerError::Peer { .. });
                            peers.failed(member, "put", &e);
                            if failed {
                                unsent.append(&mut in_chunk);
                            } else {
                                out.given_up += chunk.len() as u64;
                            }
                        }
                    }
                    chunk.clear();
                    in_chunk.clear();
                    bytes = 0;
                }
            }
        }
        if !unsent.is_empty() {
            out.given_up += peers.hints().lock().put_back(&id, unsent) as u64;
        }
    }
    ::metrics::counter!("kvtier_peer_handoff_sent_total").increment(out.sent);
    ::metrics::counter!("kvtier_peer_handoff_given_up_total").increment(out.given_up);
    ::metrics::gauge!("kvtier_peer_handoff_pending").set(peers.hints().lock().len() as f64);
    if out.sent > 0 {
        tracing::info!(sent = out.sent, "blocks owners missed while they were down were handed to them");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> BlockKey {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        BlockKey(k)
    }

    #[test]
    fn hints_are_bounded_taken_oldest_first_and_given_back_ahead() {
        let (a, b) = (NodeId::new("a").unwrap(), NodeId::new("b").unwrap());
        let (ns1, ns2) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
        let t0 = Instant::now();
        let mut h = Hints::default();
        let keys: Vec<BlockKey> = (0..10).map(key).collect();
        assert_eq!(h.add(&a, ns1, &keys, t0), 0);
        assert_eq!(h.add(&b, ns2, &keys[..4], t0 + Duration::from_secs(5)), 0);
        assert_eq!(h.len(), 14);
        let first = h.take(&a, 3);
        assert_eq!(first.iter().map(|x| x.key).collect::<Vec<_>>(), keys[..3]);
        assert_eq!(h.put_back(&a, first[1..].to_vec()), 0);
        assert_eq!(h.take(&a, 2).iter().map(|x| x.key).collect::<Vec<_>>(), keys[1..3], "given back ahead");
        assert_eq!(h.len(), 11);
        // Expired: a's (stored at t0), not b's.
        assert_eq!(h.expire(t0 + Duration::from_secs(1)), 7);
        assert_eq!(h.members(), std::slice::from_ref(&b));
        assert_eq!(h.forget_namespace(&ns2), 4);
        assert!(h.is_empty() && h.members().is_empty());

        // Bounded: what does not fit is said, on add and on giving back.
        let many: Vec<BlockKey> = (0..MAX_HINTS as u32 + 5).map(key).collect();
        assert_eq!(h.add(&a, ns1, &many, t0), 5);
        assert_eq!(h.len(), MAX_HINTS);
        let taken = h.take(&a, 10);
        assert_eq!(h.add(&b, ns1, &many[..4], t0), 0);
        assert_eq!(h.put_back(&a, taken), 4, "the room was taken meanwhile");
        assert_eq!(h.len(), MAX_HINTS);
    }
}
