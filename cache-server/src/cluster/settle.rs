//! Ownership that moved lately. After a membership change — a member joined, left, or restarted
//! with empty memory — the new owners of a key hold few of its blocks yet, while its former
//! owners (or its other replicas) still do. For [`SETTLE_FOR`] after a change, a load asks a
//! key's former owners after its current ones, and a miss answered by an owner *new to the key*
//! (one that became its owner within the window, or whose process started within it) is asked of
//! the next candidate instead of ending there. A restart is told by the member's registration
//! time (`since`) changing, timed by this node's clock; only for the members it finds at its own
//! start does the registration's wall-clock age count. The peer tier sends the blocks found that way to
//! the owners that missed them (read repair), so the cluster settles as it is read (and
//! `super::rebalance` hands the blocks over ahead of reads, once the change is quiet). Outside the
//! window, and for an owner that held the key throughout it, an owner's miss is final: a block the
//! cluster doesn't hold costs one round trip, as before.
//!
//! Pure: the caller passes the clocks in.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, NamespaceId};

use super::member::{Member, NodeId};
use super::placement::Placement;

/// How long after a membership change former owners are asked and new owners' misses are not
/// final.
pub const SETTLE_FOR: Duration = Duration::from_secs(10 * 60);

/// Most earlier placements remembered (a restart is a leave and a join: two changes).
const MAX_EARLIER: usize = 4;

/// Most candidates asked for one key (its owners, then its former owners).
pub const MAX_CANDIDATES: usize = 8;

/// Most restarts remembered.
const MAX_RESTARTS: usize = 4096;

/// One member a key may be asked of, in the order to ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Index into the current placement's members.
    pub member: usize,
    /// One of the key's current owners (a former owner is asked only for what it still holds).
    pub owner: bool,
    /// A miss answered here is worth asking the next candidate: the member is new to the key.
    pub miss_moves_on: bool,
}

/// The placements replaced within [`SETTLE_FOR`], newest first, with when each was replaced, and
/// the members that restarted within it.
#[derive(Clone, Default)]
pub struct Settling {
    earlier: VecDeque<(Arc<Placement>, Instant)>,
    restarted: Vec<(NodeId, Instant)>,
}

impl Settling {
    /// `old` was replaced by a new placement at `now`.
    pub fn replaced(&mut self, old: Arc<Placement>, now: Instant) {
        self.earlier.push_front((old, now));
        self.earlier.truncate(MAX_EARLIER);
        self.expire(now);
    }

    fn expire(&mut self, now: Instant) {
        while self.earlier.back().is_some_and(|(_, at)| now.saturating_duration_since(*at) >= SETTLE_FOR) {
            self.earlier.pop_back();
        }
        self.restarted.retain(|(_, at)| now.saturating_duration_since(*at) < SETTLE_FOR);
    }

    /// The members went from `old` to `new` (both sorted by id) at `now`: a member in both whose
    /// registration time changed restarted then.
    pub fn restarts(&mut self, old: &[Member], new: &[Member], now: Instant) {
        for m in new {
            let Ok(i) = old.binary_search_by(|o| o.id.cmp(&m.id)) else { continue };
            if m.since_ms != 0 && old[i].since_ms != m.since_ms {
                self.note_restart(m.id.clone(), now);
            }
        }
    }

    /// The members this node finds at its own start (`now`; `now_ms` its wall clock): one whose
    /// registration is younger than the window, by the two hosts' clocks, counts as restarted
    /// when it registered (a registration time ahead of this clock, as now).
    pub fn at_start(&mut self, members: &[Member], local: &NodeId, now: Instant, now_ms: u64) {
        for m in members.iter().filter(|m| &m.id != local && m.since_ms != 0) {
            let age = Duration::from_millis(now_ms.saturating_sub(m.since_ms));
            if age < SETTLE_FOR {
                self.note_restart(m.id.clone(), now.checked_sub(age).unwrap_or(now));
            }
        }
    }

    fn note_restart(&mut self, id: NodeId, at: Instant) {
        self.restarted.retain(|(i, _)| *i != id);
        if self.restarted.len() >= MAX_RESTARTS {
            self.restarted.remove(0);
        }
        self.restarted.push((id, at));
    }

    /// Whether member `id` restarted within the window at `now`.
    fn restarted_lately(&self, id: &NodeId, now: Instant) -> bool {
        self.restarted.iter().any(|(i, at)| i == id && now.saturating_duration_since(*at) < SETTLE_FOR)
    }

    /// The placements replaced within the window at `now`, newest first.
    fn recent(&self, now: Instant) -> impl Iterator<Item = &Placement> {
        self.earlier.iter().filter(move |(_, at)| now.saturating_duration_since(*at) < SETTLE_FOR).map(|(p, _)| &**p)
    }

    /// Whether anything settles at `now`: a placement replaced within the window, or a member
    /// that restarted within it.
    pub fn active(&self, now: Instant) -> bool {
        self.recent(now).next().is_some()
            || self.restarted.iter().any(|(_, at)| now.saturating_duration_since(*at) < SETTLE_FOR)
    }

    /// The candidates for `key` (namespace `ns`, `rf` owners): `owners` (indices into `p`, the
    /// key's current owners other than this node, best first) marked, then its former owners
    /// still members (not `local`), up to [`MAX_CANDIDATES`].
    #[allow(clippy::too_many_arguments)]
    pub fn candidates(
        &self,
        p: &Placement,
        ns: &NamespaceId,
        rf: usize,
        key: &BlockKey,
        owners: &[usize],
        local: &NodeId,
        now: Instant,
        out: &mut Vec<Candidate>,
    ) {
        out.clear();
        let members = p.members();
        let earlier: Vec<(&Placement, Vec<usize>)> = self
            .recent(now)
            .map(|e| {
                let mut o = Vec::with_capacity(rf);
                e.owners_into(ns, key, rf, &mut o);
                (e, o)
            })
            .collect();
        // Whether `id` owned the key in every placement of the window.
        let owned_throughout = |id: &NodeId| {
            earlier.iter().all(|(e, o)| o.iter().any(|&i| e.members().get(i).is_some_and(|m| &m.id == id)))
        };
        for &i in owners.iter().take(MAX_CANDIDATES) {
            let m = &members[i];
            out.push(Candidate {
                member: i,
                owner: true,
                miss_moves_on: self.restarted_lately(&m.id, now) || !owned_throughout(&m.id),
            });
        }
        for (e, o) in &earlier {
            for &j in o {
                if out.len() >= MAX_CANDIDATES {
                    return;
                }
                let Some(id) = e.members().get(j).map(|m| &m.id) else { continue };
                if id == local {
                    continue;
                }
                let Ok(i) = members.binary_search_by(|m| m.id.cmp(id)) else { continue };
                if out.iter().any(|c| c.member == i) {
                    continue;
                }
                out.push(Candidate { member: i, owner: false, miss_moves_on: true });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::test_member as member;

    fn key(i: u32) -> BlockKey {
        BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes())
    }

    const NOW_MS: u64 = 10_000_000_000;
    const LONG_AGO: u64 = NOW_MS - 3_600_000;

    #[test]
    fn a_steady_cluster_has_nothing_to_settle() {
        let members = [member("a", LONG_AGO), member("b", LONG_AGO), member("c", 0)];
        let p = Placement::new(&members);
        let mut s = Settling::default();
        let now = Instant::now();
        // Found at this node's start, registered an hour ago (or with no time): settled.
        s.at_start(&members, &members[0].id, now, NOW_MS);
        assert!(!s.active(now));
        let ns = NamespaceId([7; 16]);
        let mut out = Vec::new();
        for i in 0..50 {
            let owners: Vec<usize> = p.owners(&ns, &key(i), 2).into_iter().filter(|&o| o != 0).collect();
            s.candidates(&p, &ns, 2, &key(i), &owners, &p.members()[0].id, now, &mut out);
            assert_eq!(out.len(), owners.len());
            assert!(out.iter().all(|c| c.owner && !c.miss_moves_on), "{out:?}");
        }
    }

    #[test]
    fn after_a_join_the_newcomer_moves_on_and_the_former_owner_follows() {
        let before = Arc::new(Placement::new(&[member("a", LONG_AGO), member("b", LONG_AGO)]));
        let after = Placement::new(&[member("a", LONG_AGO), member("b", LONG_AGO), member("c", LONG_AGO)]);
        let ns = NamespaceId([7; 16]);
        let now = Instant::now();
        let mut s = Settling::default();
        s.restarts(before.members(), after.members(), now);
        assert!(!s.active(now), "a join is no restart");
        s.replaced(before.clone(), now);
        assert!(s.active(now));
        let local = NodeId::new("a").unwrap();
        let (mut moved, mut kept, mut out) = (0, 0, Vec::new());
        for i in 0..200 {
            let k = key(i);
            let owner = after.owners(&ns, &k, 1)[0];
            let was = &before.members()[before.owners(&ns, &k, 1)[0]].id;
            let owners: Vec<usize> = [owner].into_iter().filter(|&o| after.members()[o].id != local).collect();
            s.candidates(&after, &ns, 1, &k, &owners, &local, now, &mut out);
            let ids: Vec<&str> = out.iter().map(|c| after.members()[c.member].id.as_str()).collect();
            if after.members()[owner].id.as_str() == "c" {
                // The key moved to the newcomer: its miss moves on, to the former owner (unless
                // that is this node, which holds what it holds).
                moved += 1;
                assert!(out[0].owner && out[0].miss_moves_on, "{out:?}");
                if was != &local {
                    assert_eq!(ids, ["c", was.as_str()]);
                    assert!(!out[1].owner);
                } else {
                    assert_eq!(ids, ["c"]);
                }
            } else {
                // Kept by its owner: nothing changes.
                kept += 1;
                assert!(out.iter().all(|c| !c.miss_moves_on), "{ids:?}");
            }
        }
        assert!(moved > 30 && kept > 30, "{moved} moved, {kept} kept");
        // Past the window: as in a steady cluster.
        let later = now + SETTLE_FOR;
        assert!(!s.active(later));
        s.candidates(&after, &ns, 1, &key(0), &[2], &local, later, &mut out);
        assert_eq!(out, [Candidate { member: 2, owner: true, miss_moves_on: false }]);
    }

    #[test]
    fn a_member_that_restarted_moves_on_without_a_placement_change() {
        let old = [member("a", LONG_AGO), member("b", LONG_AGO), member("c", LONG_AGO)];
        // b's registration time changed: a new process (the wall clock it says is not used).
        let new = [member("a", LONG_AGO), member("b", 5), member("c", LONG_AGO)];
        let p = Placement::new(&new);
        let mut s = Settling::default();
        let now = Instant::now();
        s.restarts(&old, &new, now);
        assert!(s.active(now));
        let ns = NamespaceId([7; 16]);
        let mut out = Vec::new();
        s.candidates(&p, &ns, 2, &key(1), &[1, 2], &p.members()[0].id, now, &mut out);
        assert_eq!(
            out,
            [
                Candidate { member: 1, owner: true, miss_moves_on: true },
                Candidate { member: 2, owner: true, miss_moves_on: false }
            ]
        );
        // Ten minutes on, it holds what it will hold.
        assert!(!s.active(now + SETTLE_FOR));
    }

    #[test]
    fn at_start_a_young_registration_counts_by_its_age_and_one_ahead_of_this_clock_as_now() {
        // Ahead of the monotonic clock's start by more than the window (a host up for minutes).
        let now = Instant::now() + SETTLE_FOR;
        let members = [
            member("a", NOW_MS - 1000),
            member("b", NOW_MS - (SETTLE_FOR.as_millis() as u64 - 60_000)),
            member("c", NOW_MS + 3_600_000),
        ];
        let mut s = Settling::default();
        s.at_start(&members, &NodeId::new("a").unwrap(), now, NOW_MS);
        let id = |x: &str| NodeId::new(x).unwrap();
        assert!(!s.restarted_lately(&id("a"), now), "this node itself is not asked");
        assert!(s.restarted_lately(&id("b"), now));
        assert!(!s.restarted_lately(&id("b"), now + Duration::from_secs(61)), "b's window ends a minute on");
        assert!(s.restarted_lately(&id("c"), now + SETTLE_FOR - Duration::from_secs(1)), "c's clock is ahead");
        assert!(!s.restarted_lately(&id("c"), now + SETTLE_FOR));
    }

    #[test]
    fn earlier_placements_are_kept_for_the_window_and_at_most_four() {
        let now = Instant::now();
        let mut s = Settling::default();
        let p = Arc::new(Placement::new(&[member("a", 0)]));
        for i in 0..6 {
            s.replaced(p.clone(), now + Duration::from_secs(i));
        }
        assert_eq!(s.earlier.len(), MAX_EARLIER);
        s.replaced(p.clone(), now + SETTLE_FOR + Duration::from_secs(4));
        assert_eq!(
            s.recent(now + SETTLE_FOR + Duration::from_secs(4)).count(),
            2,
            "those replaced at 3 s and 4 s have gone"
        );
    }
}
