//! Ownership that moved lately. After a membership change — a member joined, left, or restarted
//! with empty memory — the new owners of a key hold few of its blocks yet, while its former
//! owners (or its other replicas) still do. For [`SETTLE_FOR`] after a change, a load asks a
//! key's former owners after its current ones, and a miss answered by an owner *new to the key*
//! (one that became its owner within the window, or whose process started within it) is asked of
//! the next candidate instead of ending there. The peer tier sends the blocks found that way to
//! the owners that missed them (read repair), so the cluster settles as it is read. Outside the
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

/// The placements replaced within [`SETTLE_FOR`], newest first, with when each was replaced.
#[derive(Clone, Default)]
pub struct Settling {
    earlier: VecDeque<(Arc<Placement>, Instant)>,
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
    }

    /// The placements replaced within the window at `now`, newest first.
    fn recent(&self, now: Instant) -> impl Iterator<Item = &Placement> {
        self.earlier.iter().filter(move |(_, at)| now.saturating_duration_since(*at) < SETTLE_FOR).map(|(p, _)| &**p)
    }

    /// Whether anything settles at `now`: a placement replaced within the window, or a member of
    /// `p` whose process started within it (`now_ms`: the wall clock, unix ms).
    pub fn active(&self, p: &Placement, now: Instant, now_ms: u64) -> bool {
        self.recent(now).next().is_some() || p.members().iter().any(|m| started_lately(m, now_ms))
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
        now_ms: u64,
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
                miss_moves_on: started_lately(m, now_ms) || !owned_throughout(&m.id),
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

/// Whether `m`'s process registered within [`SETTLE_FOR`] of `now_ms` (unix ms): it restarted or
/// joined lately, and holds little of what it owns.
pub fn started_lately(m: &Member, now_ms: u64) -> bool {
    m.since_ms > 0 && now_ms.saturating_sub(m.since_ms) < SETTLE_FOR.as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::member::Labels;

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
        BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes())
    }

    const NOW_MS: u64 = 10_000_000_000;
    const LONG_AGO: u64 = NOW_MS - 3_600_000;

    #[test]
    fn a_steady_cluster_has_nothing_to_settle() {
        let p = Placement::new(&[member("a", LONG_AGO), member("b", LONG_AGO), member("c", 0)]);
        let s = Settling::default();
        let now = Instant::now();
        assert!(!s.active(&p, now, NOW_MS));
        let ns = NamespaceId([7; 16]);
        let mut out = Vec::new();
        for i in 0..50 {
            let owners: Vec<usize> = p.owners(&ns, &key(i), 2).into_iter().filter(|&o| o != 0).collect();
            s.candidates(&p, &ns, 2, &key(i), &owners, &p.members()[0].id, now, NOW_MS, &mut out);
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
        s.replaced(before.clone(), now);
        assert!(s.active(&after, now, NOW_MS));
        let local = NodeId::new("a").unwrap();
        let (mut moved, mut kept, mut out) = (0, 0, Vec::new());
        for i in 0..200 {
            let k = key(i);
            let owner = after.owners(&ns, &k, 1)[0];
            let was = &before.members()[before.owners(&ns, &k, 1)[0]].id;
            let owners: Vec<usize> = [owner].into_iter().filter(|&o| after.members()[o].id != local).collect();
            s.candidates(&after, &ns, 1, &k, &owners, &local, now, NOW_MS, &mut out);
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
        assert!(!s.active(&after, later, NOW_MS));
        s.candidates(&after, &ns, 1, &key(0), &[2], &local, later, NOW_MS, &mut out);
        assert_eq!(out, [Candidate { member: 2, owner: true, miss_moves_on: false }]);
    }

    #[test]
    fn a_member_that_restarted_lately_moves_on_without_a_placement_change() {
        let p = Placement::new(&[member("a", LONG_AGO), member("b", NOW_MS - 5_000), member("c", LONG_AGO)]);
        let s = Settling::default();
        let now = Instant::now();
        assert!(s.active(&p, now, NOW_MS));
        let ns = NamespaceId([7; 16]);
        let mut out = Vec::new();
        s.candidates(&p, &ns, 2, &key(1), &[1, 2], &p.members()[0].id, now, NOW_MS, &mut out);
        assert_eq!(
            out,
            [
                Candidate { member: 1, owner: true, miss_moves_on: true },
                Candidate { member: 2, owner: true, miss_moves_on: false }
            ]
        );
        // Ten minutes on, it holds what it will hold.
        assert!(!s.active(&p, now, NOW_MS + SETTLE_FOR.as_millis() as u64));
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
