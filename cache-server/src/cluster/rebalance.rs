//! Blocks handed to their new owners ahead of reads. Once a membership change has been quiet for
//! `peer_rebalance` (a member joined, left, or restarted with empty memory), each node walks the
//! blocks its own DRAM and disk hold and, for every key whose owners now include members new to
//! it — not its owners before the change, or restarted since — queues the block for them as a
//! hint of the hinted handoff (`super::handoff`): sent at handoff's pace, given up if the key is
//! purged or moves again, kept across a restart on a node with a disk. Of a key's former owners
//! only the first still a member (and not restarted) sends it: the others hold the same block,
//! and a node that merely cached a block it fetched sends nothing. The new owners are first
//! asked which of the keys they hold already (a restarted node with a disk recovered its
//! blocks), so only what they lack is sent. Changes closer together than the quiet period are
//! one change to a node that saw them together, so two nodes may each take themselves for a
//! block's former owner and both send it (the receiver answers the second "present").
//!
//! Without it a moved key was found only while `super::settle` still asked its former owners
//! (reads within ten minutes of the change, repaired as read); a key read later missed through
//! its new owner although the cluster held it. The walk fills at most half of the hints' bound
//! at a time and waits for handoff to drain them; a further change of the membership ends it
//! (the next pass, after the next quiet period, starts over from the new placement).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, NamespaceId};
use tokio::sync::watch;

use super::member::{Member, NodeId};
use super::peer::PeerTier;
use super::placement::{Placement, MAX_RF};
use crate::state::NodeState;

/// Keys asked of a new owner per `EXISTS` request.
const ASK_KEYS: usize = 1024;
/// How often a walk waiting for room in the hints looks again.
const ROOM_POLL: Duration = Duration::from_millis(500);

/// The members of `now` that restarted since `before`: in both, with a registration time that
/// changed (0 is unknown: no restart told).
pub fn restarted(before: &[Member], now: &[Member]) -> Vec<NodeId> {
    now.iter()
        .filter(|m| {
            m.since_ms != 0 && before.iter().any(|b| b.id == m.id && b.since_ms != 0 && b.since_ms != m.since_ms)
        })
        .map(|m| m.id.clone())
        .collect()
}

/// What one key's owners went through, computed with reusable buffers.
#[derive(Default)]
pub struct Planner {
    before: Vec<usize>,
    now: Vec<usize>,
}

impl Planner {
    /// The members (indices into `now`'s members) that `local` hands `key` to after the
    /// placement went from `before` to `now`, into `out`: the key's owners in `now` that were not
    /// among its owners in `before`, or are in `restarted` — when `local` is the first of its
    /// owners in `before` that is still a member of `now` and not restarted. Empty otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn new_owners(
        &mut self,
        before: &Placement,
        now: &Placement,
        restarted: &[NodeId],
        local: &NodeId,
        ns: &NamespaceId,
        key: &BlockKey,
        rf: usize,
        out: &mut Vec<usize>,
    ) {
        out.clear();
        before.owners_into(ns, key, rf, &mut self.before);
        let still_here = |id: &NodeId| now.index_of(id).is_some() && !restarted.contains(id);
        let sender = self.before.iter().map(|&i| &before.members()[i].id).find(|id| still_here(id));
        if sender != Some(local) {
            return;
        }
        now.owners_into(ns, key, rf, &mut self.now);
        for &i in &self.now {
            let id = &now.members()[i].id;
            let owned_before = self.before.iter().any(|&b| before.members()[b].id == *id);
            if id != local && (!owned_before || restarted.contains(id)) {
                out.push(i);
            }
        }
    }
}

/// What one pass queued.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Rebalance {
    /// Blocks queued for a new owner (hints added).
    pub queued: u64,
    /// Blocks a new owner said it held already.
    pub held_there: u64,
    /// Blocks the hints had no room for (counted as forwards dropped).
    pub dropped: u64,
    /// Whether the walk ended early: the membership changed again, or the node is stopping.
    pub cut_short: bool,
}

/// Runs a pass after every membership change that stayed quiet for `after`, until `stop` turns
/// true. The first placement it compares with is the one it finds at its start (a node that
/// starts empty hands nothing over: the others hand to it; one that recovered blocks from its
/// disk and then sees members it did not see at start asks them which of those they lack).
pub async fn rebalance_loop(state: Arc<NodeState>, after: Duration, mut stop: watch::Receiver<bool>) {
    let Some(peers) = state.tiers().peers().cloned() else { return };
    let mut members = peers.members();
    let mut seen = peers.placement();
    loop {
        tokio::select! {
            _ = crate::stopped(&mut stop) => return,
            changed = members.changed() => if changed.is_err() { return },
        }
        // Quiet for `after`: a burst of changes (a restart is a leave and a join) is one pass.
        loop {
            tokio::select! {
                _ = crate::stopped(&mut stop) => return,
                _ = tokio::time::sleep(after) => break,
                changed = members.changed() => if changed.is_err() { return },
            }
        }
        members.borrow_and_update();
        let now = peers.placement();
        let generation = members.borrow().generation;
        let changed = || members.borrow().generation != generation || *stop.borrow();
        let started = Instant::now();
        let out = rebalance_pass(&state, &peers, &seen, &now, changed).await;
        // A pass cut short by a further change: the next one starts from the same placement.
        if !out.cut_short {
            seen = now;
        }
        if out.queued + out.held_there + out.dropped > 0 || out.cut_short {
            tracing::info!(
                queued = out.queued,
                held_there = out.held_there,
                dropped = out.dropped,
                cut_short = out.cut_short,
                took_ms = started.elapsed().as_millis() as u64,
                "membership changed: blocks this node holds queued for their new owners"
            );
        }
    }
}

/// One pass from `before` to `now` over the blocks this node's DRAM and disk hold; `changed`
/// says when to stop early.
pub async fn rebalance_pass(
    state: &NodeState,
    peers: &Arc<PeerTier>,
    before: &Placement,
    now: &Placement,
    changed: impl Fn() -> bool,
) -> Rebalance {
    let mut out = Rebalance::default();
    let restarted = restarted(before.members(), now.members());
    let same_members = before.members().len() == now.members().len()
        && before.members().iter().zip(now.members()).all(|(a, b)| a.id == b.id && a.capacity == b.capacity);
    if same_members && restarted.is_empty() {
        return out;
    }
    ::metrics::counter!("kvtier_peer_rebalance_passes_total").increment(1);
    let mut held = state.tiers().held_keys();
    held.sort_unstable_by_key(|(ns, _)| ns.0);
    let (mut planner, mut targets) = (Planner::default(), Vec::with_capacity(MAX_RF));
    for group in held.chunk_by(|a, b| a.0 == b.0) {
        let ns_id = group[0].0;
        let Ok(ns) = state.namespace(&ns_id) else { continue };
        let rf = peers.rf_for(&ns);
        // Per new owner (an index into `now`), the keys this node hands to it.
        let mut by_member: HashMap<usize, Vec<BlockKey>> = HashMap::new();
        for (_, key) in group {
            planner.new_owners(before, now, &restarted, peers.local(), &ns_id, key, rf, &mut targets);
            for &m in &targets {
                by_member.entry(m).or_default().push(*key);
            }
        }
        for (m, keys) in by_member {
            let member = &now.members()[m];
            for part in keys.chunks(ASK_KEYS) {
                if changed() {
                    out.cut_short = true;
                    return finish(out);
                }
                // What the owner lacks; a member that doesn't answer gets them all (handoff
                // sends them once it does, and a block it holds is answered present).
                let lacking: Vec<BlockKey> =
                    match peers.bounded(member, peers.transport().exists(member, &ns, part)).await {
                        Ok(there) if there.len() == part.len() => {
                            part.iter().zip(&there).filter(|(_, held)| !**held).map(|(k, _)| *k).collect()
                        }
                        Ok(_) => part.to_vec(),
                        Err(e) => {
                            peers.failed(member, "exists", &e);
                            part.to_vec()
                        }
                    };
                out.held_there += (part.len() - lacking.len()) as u64;
                // Room for them in the hints' first half, waiting for handoff to drain it.
                while peers.hints().lock().len() + lacking.len() > super::handoff::MAX_HINTS / 2 {
                    if changed() {
                        out.cut_short = true;
                        return finish(out);
                    }
                    tokio::time::sleep(ROOM_POLL).await;
                }
                let dropped = peers.hints().lock().add(&member.id, ns_id, &lacking, Instant::now());
                out.dropped += dropped as u64;
                out.queued += (lacking.len() - dropped) as u64;
            }
        }
    }
    finish(out)
}

fn finish(out: Rebalance) -> Rebalance {
    ::metrics::counter!("kvtier_peer_rebalance_queued_total").increment(out.queued);
    ::metrics::counter!("kvtier_peer_rebalance_held_there_total").increment(out.held_there);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Labels;

    fn member(id: &str, since_ms: u64) -> Member {
        Member {
            id: NodeId::new(id).unwrap(),
            grpc_addr: format!("{id}:1"),
            data_addr: format!("{id}:2"),
            labels: Labels::default(),
            capacity: 1 << 30,
            since_ms,
        }
    }

    fn key(i: u32) -> BlockKey {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        k[4..8].copy_from_slice(&(i.wrapping_mul(2_654_435_761)).to_le_bytes());
        BlockKey(k)
    }

    fn ids(p: &Placement, idx: &[usize]) -> Vec<String> {
        idx.iter().map(|&i| p.members()[i].id.to_string()).collect()
    }

    /// Per key of 0..400: what each of `holders` hands over, as (sender, key, receivers).
    fn plan(before: &Placement, now: &Placement, holders: &[&str], rf: usize) -> Vec<(String, u32, Vec<String>)> {
        let restarted = restarted(before.members(), now.members());
        let (mut planner, mut out, ns) = (Planner::default(), Vec::new(), NamespaceId([7; 16]));
        let mut all = Vec::new();
        for i in 0..400 {
            for h in holders {
                let local = NodeId::new(*h).unwrap();
                planner.new_owners(before, now, &restarted, &local, &ns, &key(i), rf, &mut out);
                if !out.is_empty() {
                    all.push((h.to_string(), i, ids(now, &out)));
                }
            }
        }
        all
    }

    #[test]
    fn a_join_hands_each_moved_key_from_its_one_former_owner_to_the_newcomer() {
        let before = Placement::new(&[member("a", 1), member("b", 1)]);
        let now = Placement::new(&[member("a", 1), member("b", 1), member("n", 5)]);
        let ns = NamespaceId([7; 16]);
        let moves = plan(&before, &now, &["a", "b", "n"], 1);
        let moved: Vec<u32> =
            (0..400).filter(|&i| now.owners(&ns, &key(i), 1) != before.owners(&ns, &key(i), 1)).collect();
        assert!(moved.len() > 50, "a third of the keys move to n: {}", moved.len());
        assert_eq!(moves.iter().map(|m| m.1).collect::<Vec<_>>(), moved, "every moved key, once, and no other");
        for (sender, i, to) in &moves {
            let former = &before.members()[before.owners(&ns, &key(*i), 1)[0]].id;
            assert_eq!(sender, former.as_str(), "sent by its former owner");
            assert_eq!(to, &["n"], "to the newcomer");
        }
    }

    #[test]
    fn a_restart_is_backed_by_the_first_other_replica_and_a_departure_replaced() {
        let ns = NamespaceId([7; 16]);
        // rf 2, b restarted (its registration time changed): each key b owns is sent to it by
        // the key's other owner, and nothing else moves.
        let before = Placement::new(&[member("a", 1), member("b", 1), member("c", 1)]);
        let now = Placement::new(&[member("a", 1), member("b", 9), member("c", 1)]);
        let moves = plan(&before, &now, &["a", "b", "c"], 2);
        let owned_by_b: Vec<u32> =
            (0..400).filter(|&i| ids(&now, &now.owners(&ns, &key(i), 2)).contains(&"b".to_string())).collect();
        assert_eq!(moves.iter().map(|m| m.1).collect::<Vec<_>>(), owned_by_b);
        for (sender, i, to) in &moves {
            assert_eq!(to, &["b"]);
            assert_ne!(sender, "b", "not by the restarted node itself");
            assert!(ids(&now, &now.owners(&ns, &key(*i), 2)).contains(sender), "by the key's other owner");
        }
        // c left: each key c owned gets its new second owner from the remaining one.
        let now = Placement::new(&[member("a", 1), member("b", 1), member("d", 3)]);
        let moves = plan(&before, &now, &["a", "b", "c", "d"], 2);
        let changed: Vec<u32> = (0..400)
            .filter(|&i| ids(&before, &before.owners(&ns, &key(i), 2)) != ids(&now, &now.owners(&ns, &key(i), 2)))
            .collect();
        assert!(!changed.is_empty());
        for (sender, i, to) in &moves {
            let was = ids(&before, &before.owners(&ns, &key(*i), 2));
            assert!(was.contains(sender) && sender != "c", "{i}: sent by a former owner still here");
            assert!(to.iter().all(|m| !was.contains(m)), "{i}: only to owners new to the key");
        }
        // Every key whose owners changed by more than order is handed over, once.
        let handed: Vec<u32> = moves.iter().map(|m| m.1).collect();
        for i in changed {
            let (mut was, mut is) =
                (ids(&before, &before.owners(&ns, &key(i), 2)), ids(&now, &now.owners(&ns, &key(i), 2)));
            was.sort();
            is.sort();
            assert_eq!(handed.iter().filter(|&&h| h == i).count(), usize::from(was != is), "{i}: {was:?} -> {is:?}");
        }
        // Nothing changed: nothing moves.
        assert!(plan(&before, &before, &["a", "b", "c"], 2).is_empty());
    }

    #[test]
    fn the_first_former_owner_still_here_sends_and_a_caching_node_does_not() {
        let ns = NamespaceId([7; 16]);
        let before = Placement::new(&[member("a", 1), member("b", 1)]);
        // rf 2 over two nodes: both own every key. a leaves, n joins: for every key, b (the only
        // former owner left) sends it to n. A node that holds a block it only cached (n itself,
        // here with no former ownership) sends nothing.
        let now = Placement::new(&[member("b", 1), member("n", 1)]);
        let moves = plan(&before, &now, &["b", "n"], 2);
        assert_eq!(moves.len(), 400);
        assert!(moves.iter().all(|(s, _, to)| s == "b" && to == &["n"]));
        // Both former owners gone: nobody is asked to send (nobody here held it as an owner).
        let now = Placement::new(&[member("n", 1), member("m", 1)]);
        assert!(plan(&before, &now, &["n", "m"], 2).is_empty());
        let _ = ns;
    }

    #[test]
    fn restarts_are_told_by_a_changed_known_registration_time() {
        let before = [member("a", 1), member("b", 2), member("c", 0)];
        let now = [member("a", 1), member("b", 3), member("c", 4), member("d", 5)];
        assert_eq!(restarted(&before, &now), [NodeId::new("b").unwrap()]);
    }
}
