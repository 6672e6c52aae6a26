//! Blocks handed to their new owners ahead of reads. Once a membership change has been quiet for
//! `peer_rebalance` (a member joined, left, or restarted with empty memory), each node walks the
//! blocks its own DRAM and disk hold and, for every key whose owners now include members new to
//! it — not its owners before the change, or restarted since — queues the block for them as a
//! hint of the hinted handoff (`super::handoff`): sent at handoff's pace, given up if the key is
//! purged or moves again, kept across a restart on a node with a disk. Of a key's former owners
//! only the first still a member (and not restarted) sends it: the others hold the same block,
//! and a node that merely cached a block it fetched sends nothing. The new owners are first
//! asked which of the keys they hold already (a restarted node with a disk recovered its
//! blocks), so only what they lack is sent, and keys already waiting for them are not queued
//! twice. A backup pass a minute later has every former owner still a member send what the new
//! owners still lack (the first may have evicted it), and asks again the members the first pass
//! left out (down, not answering, not taking hints off the queue).
//!
//! Without it a moved key was found only while `super::settle` still asked its former owners
//! (reads within ten minutes of the change, repaired as read); a key read later missed through
//! its new owner although the cluster held it. A walk keeps at most [`MEMBER_ROOM`] hints
//! waiting per member and waits for handoff to send them; a further change of the membership
//! ends it (the next pass, after the next quiet period, starts from the same placement).
//! Changes closer together than the quiet period are one change to a node that saw them
//! together, so two nodes may each take themselves for a block's former owner and both send it
//! (the receiver answers the second "present").

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, NamespaceId};
use tokio::sync::watch;

use super::member::{Member, NodeId};
use super::peer::PeerTier;
use super::placement::{Placement, MAX_RF};
use crate::error::ServerError;
use crate::state::NodeState;

/// Keys asked of a new owner per `EXISTS` request.
const ASK_KEYS: usize = 1024;
/// Most hints one walk keeps waiting for one member; past it the walk waits for handoff to send
/// some (about 4,096 a second per member).
const MEMBER_ROOM: usize = 8192;
/// How often a walk waiting for room looks again, and how long it waits without progress before
/// it leaves that member to the next pass.
const ROOM_POLL: Duration = Duration::from_millis(500);
const ROOM_STUCK: Duration = Duration::from_secs(60);
/// When the backup pass runs after a change's first one: every former owner still a member (not
/// only the first) sends what the new owners still lack, and members skipped before are asked
/// again. A second backup follows if that one skipped members too.
pub const BACKUP_AFTER: [Duration; 2] = [Duration::from_secs(60), Duration::from_secs(300)];

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
    /// owners in `before` that is still a member of `now` and not restarted (with `any_former`:
    /// any of them, for a backup pass). Empty otherwise.
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
        any_former: bool,
        out: &mut Vec<usize>,
    ) {
        out.clear();
        before.owners_into(ns, key, rf, &mut self.before);
        let still_here = |id: &NodeId| now.index_of(id).is_some() && !restarted.contains(id);
        let mut senders = self.before.iter().map(|&i| &before.members()[i].id).filter(|id| still_here(id));
        let sends = match any_former {
            false => senders.next() == Some(local),
            true => senders.any(|id| id == local),
        };
        if !sends {
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
    /// Blocks a new owner said it held already, or that were waiting for it already.
    pub held_there: u64,
    /// Blocks the hints had no room for.
    pub dropped: u64,
    /// New owners left to the next pass: down, not answering, or not taking hints off the queue.
    pub skipped_members: u64,
    /// Whether the walk ended early: the membership changed again, or the node is stopping.
    pub cut_short: bool,
    /// Whether the members differed at all (else nothing was walked).
    pub walked: bool,
    /// Low-priority copies (cached or relayed) of keys this node has come to own, raised to
    /// normal priority: its copy is an owner's now.
    pub raised: u64,
}

/// When a node's passes run.
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    /// How long a membership change must stay quiet before its pass (`peer_rebalance`).
    pub quiet: Duration,
    /// The same for a change that only took members away (`peer_rebalance_departed`): a member
    /// stopped for a rolling restart comes back within it, and is then handed only what it lacks
    /// instead of its share going to interim owners and back.
    pub departed: Duration,
    /// When backup passes follow a change's first pass (the node runs with [`BACKUP_AFTER`]).
    pub backups: &'static [Duration],
}

/// Whether `a` and `b` are one member, with the same registration, capacity and labels.
fn same_member(a: &Member, b: &Member) -> bool {
    a.id == b.id && a.since_ms == b.since_ms && a.capacity == b.capacity && a.labels == b.labels
}

/// Whether two member lists name the same members, each unchanged.
fn same_members(a: &[Member], b: &[Member]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_member(a, b))
}

/// Whether `now` is `before` with members taken away and nothing else changed (no member
/// joined, restarted, or changed its capacity or labels).
pub fn departures_only(before: &[Member], now: &[Member]) -> bool {
    now.len() < before.len() && now.iter().all(|m| before.iter().any(|b| same_member(b, m)))
}

/// When the pass for the members `now` (from `seen`, the last pass's) is due, the burst of
/// changes that led there having started at `first` and its latest come at `at`: departures
/// alone wait `departed` from the first of them (nodes removed one after another every few
/// minutes must not put the pass off for good), never less than `quiet` after the latest; any
/// other change waits `quiet` after the latest.
fn pass_due(
    seen: &[Member],
    now: &[Member],
    first: tokio::time::Instant,
    at: tokio::time::Instant,
    schedule: &Schedule,
) -> tokio::time::Instant {
    match departures_only(seen, now) {
        true => (first + schedule.departed).max(at + schedule.quiet),
        false => at + schedule.quiet,
    }
}

/// Runs a pass after every membership change that stayed quiet for its wait, and backup passes
/// after it, as `schedule` says, until `stop` turns true. The first placement it compares with is
/// the one it finds at its start.
pub async fn rebalance_loop(state: Arc<NodeState>, schedule: Schedule, mut stop: watch::Receiver<bool>) {
    let Some(peers) = state.tiers().peers().cloned() else { return };
    let mut members = peers.members();
    let mut seen = peers.placement();
    // The change the backup passes are for, and when the next one is due.
    let mut backup: Option<(Arc<Placement>, Arc<Placement>, usize, tokio::time::Instant)> = None;
    loop {
        let due = backup.as_ref().map(|b| b.3);
        let is_backup = tokio::select! {
            _ = crate::stopped(&mut stop) => return,
            changed = members.changed() => if changed.is_err() { return } else { false },
            _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => true,
        };
        if !is_backup {
            // Quiet for the wait: a burst of changes (a restart is a leave and a join) is one
            // pass, and members that left wait longer (they may be back soon).
            // (A snapshot that only went stale and back is no change.)
            members.borrow_and_update();
            let mut current = peers.placement();
            let first = tokio::time::Instant::now();
            let mut quiet_until = pass_due(seen.members(), current.members(), first, first, &schedule);
            loop {
                tokio::select! {
                    _ = crate::stopped(&mut stop) => return,
                    _ = tokio::time::sleep_until(quiet_until) => break,
                    changed = members.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let now = peers.placement();
                        if !same_members(current.members(), now.members()) {
                            quiet_until =
                                pass_due(seen.members(), now.members(), first, tokio::time::Instant::now(), &schedule);
                            current = now;
                        }
                    }
                }
            }
            // Back where the last pass left it (a snapshot that went stale and back, a member
            // that left and came back unchanged): no pass, and a backup still due stays due.
            if same_members(seen.members(), peers.placement().members()) {
                continue;
            }
        }
        let (before, now, round) = match (&backup, is_backup) {
            (Some((b, n, round, _)), true) => (b.clone(), n.clone(), *round + 1),
            _ => (seen.clone(), peers.placement(), 0),
        };
        let generation = members.borrow().generation;
        let changed = || members.borrow().generation != generation || *stop.borrow();
        let started = Instant::now();
        let out = rebalance_pass(&state, &peers, &before, &now, is_backup, changed).await;
        if out.queued + out.held_there + out.dropped + out.skipped_members + out.raised > 0 || out.cut_short {
            tracing::info!(
                queued = out.queued,
                held_there = out.held_there,
                dropped = out.dropped,
                skipped_members = out.skipped_members,
                raised = out.raised,
                cut_short = out.cut_short,
                backup = is_backup,
                took_ms = started.elapsed().as_millis() as u64,
                members_before = before.members().len(),
                members_now = now.members().len(),
                "membership changed: blocks this node holds queued for their new owners"
            );
        }
        if out.cut_short {
            // A further change: the next pass starts from the same placement.
            backup = None;
            continue;
        }
        seen = now.clone();
        backup = match schedule.backups.get(round) {
            // After a first pass that walked (the members differed: a former owner that sent
            // nothing in it may hold what the first sender lacked); after a backup only if it
            // left members out.
            Some(wait) if (round == 0 && out.walked) || out.skipped_members > 0 => {
                Some((before, now, round, tokio::time::Instant::now() + *wait))
            }
            _ => None,
        };
    }
}

/// One pass from `before` to `now` over the blocks this node's DRAM and disk hold (`backup`:
/// sent by every former owner still here, not only the first); `changed` says when to stop early.
pub async fn rebalance_pass(
    state: &Arc<NodeState>,
    peers: &Arc<PeerTier>,
    before: &Arc<Placement>,
    now: &Arc<Placement>,
    backup: bool,
    changed: impl Fn() -> bool,
) -> Rebalance {
    let mut out = Rebalance::default();
    let same = |a: &Member, b: &Member| a.id == b.id && a.capacity == b.capacity && a.labels == b.labels;
    let same_members = before.members().len() == now.members().len()
        && before.members().iter().zip(now.members()).all(|(a, b)| same(a, b));
    if same_members && restarted(before.members(), now.members()).is_empty() {
        return out;
    }
    out.walked = true;
    ::metrics::counter!("kvtier_peer_rebalance_passes_total").increment(1);
    let pass_started = Instant::now();
    // The walk and the placement of every key, off the async workers: a node may hold millions.
    let plan = {
        let (state, peers, before, now) = (state.clone(), peers.clone(), before.clone(), now.clone());
        tokio::task::spawn_blocking(move || plan_pass(&state, &peers, &before, &now, backup)).await
    };
    let Ok((plan, raised)) = plan else { return finish(out) };
    out.raised = raised;
    let mut skipped: Vec<usize> = Vec::new();
    for ((ns_id, m), keys) in plan {
        if skipped.contains(&m) {
            continue;
        }
        let member = &now.members()[m];
        let pending = peers.hints().lock().pending_keys(&member.id);
        let mut waiting_since = Instant::now();
        for part in keys.chunks(ASK_KEYS) {
            if changed() {
                out.cut_short = true;
                return finish(out);
            }
            // Unregistered or deleted meanwhile: asking its owners would register it there again.
            let Ok(ns) = state.namespace(&ns_id) else { break };
            if peers.deleted_since(&ns_id, pass_started) {
                break;
            }
            // Already waiting for it (a forward it missed, an earlier pass): not queued twice.
            let asked = part.len();
            let part: Vec<BlockKey> = part.iter().filter(|k| !pending.contains(&(ns_id, **k))).copied().collect();
            out.held_there += (asked - part.len()) as u64;
            if part.is_empty() {
                continue;
            }
            // What the owner lacks. A member that doesn't answer is left to the next pass. (Asked
            // even if it was marked down lately: a member that restarted was, while it was away.)
            // Tried twice: the first call to a member that restarted may go out on a pooled
            // connection to its old process.
            let mut asked = peers.bounded(member, peers.transport().exists(member, &ns, &part)).await;
            if asked.is_err() {
                asked = peers.bounded(member, peers.transport().exists(member, &ns, &part)).await;
            }
            let there = match asked {
                Ok(there) if there.len() == part.len() => there,
                Ok(there) => {
                    let why = format!("{} answers to EXISTS of {} keys", there.len(), part.len());
                    peers.failed(member, "exists", &ServerError::Peer { peer: member.id.to_string(), reason: why });
                    skipped.push(m);
                    break;
                }
                Err(e) => {
                    peers.failed(member, "exists", &e);
                    skipped.push(m);
                    break;
                }
            };
            let lacking: Vec<BlockKey> = part.iter().zip(&there).filter(|(_, held)| !**held).map(|(k, _)| *k).collect();
            out.held_there += (part.len() - lacking.len()) as u64;
            // Room for them among the member's hints, as handoff sends them.
            loop {
                let waiting = peers.hints().lock().pending_for(&member.id);
                if waiting + lacking.len() <= MEMBER_ROOM.max(lacking.len()) {
                    break;
                }
                if changed() {
                    out.cut_short = true;
                    return finish(out);
                }
                if peers.is_down(&member.id, Instant::now()) || waiting_since.elapsed() >= ROOM_STUCK {
                    skipped.push(m);
                    break;
                }
                tokio::time::sleep(ROOM_POLL).await;
            }
            if skipped.contains(&m) {
                break;
            }
            waiting_since = Instant::now();
            let (dropped, pending) = {
                let mut hints = peers.hints().lock();
                (hints.add(&member.id, ns_id, &lacking, Instant::now()), hints.len())
            };
            ::metrics::gauge!("kvtier_peer_handoff_pending").set(pending as f64);
            out.dropped += dropped as u64;
            out.queued += (lacking.len() - dropped) as u64;
        }
    }
    out.skipped_members = skipped.len() as u64;
    finish(out)
}

/// Per (namespace, new owner as an index into `now`): the keys this node hands to it.
type Plan = Vec<((NamespaceId, usize), Vec<BlockKey>)>;

/// The [`Plan`] of a pass, and how many low-priority copies were raised: per (namespace, new
/// owner as an index into `now`), the keys this node hands to it, from a
/// snapshot of what its DRAM and disk hold. A `before` of this node alone (it had not seen the
/// others yet: it started first, or Redis was unreachable at its start) makes it the former owner
/// of everything it holds: whatever it took while alone is handed to its owners, and what it
/// recovered from its disk is offered to the owners that lack it (one `EXISTS` per 1,024 keys).
fn plan_pass(state: &NodeState, peers: &PeerTier, before: &Placement, now: &Placement, backup: bool) -> (Plan, u64) {
    let local = peers.local();
    let restarted = restarted(before.members(), now.members());
    let mut held = state.tiers().held_keys();
    held.sort_unstable_by_key(|(ns, _)| ns.0);
    let (mut planner, mut targets) = (Planner::default(), Vec::with_capacity(MAX_RF));
    let mut plan: HashMap<(NamespaceId, usize), Vec<BlockKey>> = HashMap::new();
    let mut raised = 0;
    for group in held.chunk_by(|a, b| a.0 == b.0) {
        let ns_id = group[0].0;
        let Ok(ns) = state.namespace(&ns_id) else { continue };
        let rf = peers.rf_for(&ns);
        for (_, key) in group {
            planner.new_owners(before, now, &restarted, local, &ns_id, key, rf, backup, &mut targets);
            for &m in &targets {
                plan.entry((ns_id, m)).or_default().push(*key);
            }
        }
        // A copy this node kept at low priority (cached from a peer, relayed for its owners) of
        // a key it now owns: an owner's copy, so it stays like one. Else the new owner answers
        // the others' `EXISTS` "held" and its only copy goes first under pressure.
        let keys: Vec<BlockKey> = group.iter().map(|(_, k)| *k).collect();
        for (key, owned) in keys.iter().zip(peers.owned_here(&ns, &keys)) {
            if owned && state.tiers().raise_dram_priority(&ns_id, key, crate::dram::Priority::Normal) {
                raised += 1;
            }
        }
    }
    let mut plan: Vec<_> = plan.into_iter().collect();
    plan.sort_unstable_by_key(|((ns, m), _)| (*m, ns.0));
    (plan, raised)
}

fn finish(out: Rebalance) -> Rebalance {
    ::metrics::counter!("kvtier_peer_rebalance_queued_total").increment(out.queued);
    ::metrics::counter!("kvtier_peer_rebalance_held_there_total").increment(out.held_there);
    ::metrics::counter!("kvtier_peer_rebalance_dropped_total").increment(out.dropped);
    ::metrics::counter!("kvtier_peer_rebalance_skipped_members_total").increment(out.skipped_members);
    ::metrics::counter!("kvtier_peer_rebalance_raised_total").increment(out.raised);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::test_member as member;

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
                planner.new_owners(before, now, &restarted, &local, &ns, &key(i), rf, false, &mut out);
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
    }

    #[test]
    fn a_backup_pass_has_every_former_owner_still_here_send() {
        let ns = NamespaceId([7; 16]);
        // rf 2 over a and b (both own every key); n joins. For each key n now owns, a first pass
        // has one of a and b send it; a backup pass both (the first may not hold it any more).
        let before = Placement::new(&[member("a", 1), member("b", 1)]);
        let now = Placement::new(&[member("a", 1), member("b", 1), member("n", 2)]);
        let (mut planner, mut out) = (Planner::default(), Vec::new());
        let mut senders = |i: u32, any_former: bool| {
            let mut n = 0;
            for h in ["a", "b", "n"] {
                let local = NodeId::new(h).unwrap();
                planner.new_owners(&before, &now, &[], &local, &ns, &key(i), 2, any_former, &mut out);
                n += usize::from(!out.is_empty());
            }
            n
        };
        let mut moved = 0;
        for i in 0..400 {
            let to_n = ids(&now, &now.owners(&ns, &key(i), 2)).contains(&"n".to_string());
            moved += usize::from(to_n);
            let want = if to_n { (1, 2) } else { (0, 0) };
            assert_eq!((senders(i, false), senders(i, true)), want, "{i}");
        }
        assert!(moved > 50, "{moved}");
    }

    #[test]
    fn restarts_are_told_by_a_changed_known_registration_time() {
        let before = [member("a", 1), member("b", 2), member("c", 0)];
        let now = [member("a", 1), member("b", 3), member("c", 4), member("d", 5)];
        assert_eq!(restarted(&before, &now), [NodeId::new("b").unwrap()]);
    }

    #[test]
    fn departures_one_after_another_wait_from_the_first_and_other_changes_from_the_latest() {
        let s = Schedule { quiet: Duration::from_secs(30), departed: Duration::from_secs(300), backups: &[] };
        let all = [member("a", 1), member("b", 2), member("c", 3), member("d", 4)];
        let t0 = tokio::time::Instant::now();
        let min = |m: u64| Duration::from_secs(60 * m);
        // c leaves, then d four minutes later: the pass comes 5 minutes after c left.
        assert_eq!(pass_due(&all, &all[..3], t0, t0, &s), t0 + min(5));
        assert_eq!(pass_due(&all, &all[..2], t0, t0 + min(4), &s), t0 + min(5));
        // ... but never sooner than the quiet time after the latest.
        assert_eq!(pass_due(&all, &all[..2], t0, t0 + Duration::from_secs(290), &s), t0 + Duration::from_secs(320));
        // A join (or a restart) in the burst: the quiet time after it.
        let joined = [member("a", 1), member("b", 2), member("e", 5)];
        assert_eq!(pass_due(&all, &joined, t0, t0 + min(4), &s), t0 + min(4) + Duration::from_secs(30));
    }

    #[test]
    fn only_a_change_that_took_members_away_and_nothing_else_is_departures_only() {
        let all = [member("a", 1), member("b", 2), member("c", 3)];
        assert!(departures_only(&all, &[member("a", 1), member("c", 3)]));
        assert!(departures_only(&all, &[member("b", 2)]));
        assert!(!departures_only(&all, &all), "no change");
        assert!(!departures_only(&all, &[member("a", 1), member("c", 4)]), "c restarted");
        assert!(!departures_only(&all, &[member("a", 1), member("d", 5)]), "d joined");
        assert!(!departures_only(&[member("a", 1)], &[member("a", 1), member("b", 2)]), "b joined");
        let mut bigger = member("a", 1);
        bigger.capacity *= 2;
        assert!(!departures_only(&all, &[bigger]), "a's capacity changed");
    }
}
