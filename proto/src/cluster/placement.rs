//! Which members own a block: weighted rendezvous (highest-random-weight) hashing of the block's
//! namespace and key over the members, `rf` replicas spread across nodes, racks and zones, and the
//! order in which a reader should try those replicas (its own node first, then its rack, its
//! zone, the rest). Pure policy: no I/O, no clock; every node computes the same answer from the
//! same member list.
//!
//! Each member `m` gets a score for a key `k`: `w_m / -ln(u)`, with `u` in (0, 1) a hash of `k`
//! and `m`'s id and `w_m` its capacity; the highest scores own the key. A member wins a key with
//! probability `w_m / Σw`, and a change of one member moves only the keys it wins or loses — a
//! join takes about `w_new / Σw` of the keys, all onto the new member; a leave moves only the
//! leaver's keys. When every member has the same capacity the scores are compared as integers,
//! so no floating-point rounding can make two nodes disagree.
//!
//! The hash functions and seeds below are part of the cluster's wire contract: changing them moves
//! every key. `placement_is_pinned` in the tests fails if they change by accident.

use std::collections::HashMap;

use crate::{BlockKey, NamespaceId, KEY_LEN, NAMESPACE_ID_LEN};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::member::{Labels, Member, NodeId};

/// Replication factor when a namespace names none.
pub const DEFAULT_RF: usize = 1;
/// Largest replication factor placement serves; larger requests are clamped to it.
pub const MAX_RF: usize = 8;

/// Seed of the block-key hash (part of the wire contract, see the module doc).
const KEY_SEED: u64 = 0x6b76_7469_6572_4b31; // "kvtierK1"
/// Seed of the member-id hash (part of the wire contract).
const MEMBER_SEED: u64 = 0x6b76_7469_6572_4d31; // "kvtierM1"

/// Members whose scores `owners_into` keeps on the stack; larger clusters use one allocation.
const STACK_SCORES: usize = 128;

/// How close a replica is to a reader; lower is closer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Locality {
    /// The reader is that member.
    SameMember,
    /// Same machine (`node` label).
    SameNode,
    /// Same rack (and zone).
    SameRack,
    SameZone,
    Remote,
}

/// Who is reading: a member, or a client that knows its own labels.
#[derive(Clone, Copy, Debug)]
pub struct Reader<'a> {
    pub id: Option<&'a NodeId>,
    pub labels: &'a Labels,
}

/// What placement keeps per member: its hash seed, weight and interned topology domains.
#[derive(Clone, Copy, Debug)]
struct Slot {
    seed: u64,
    weight: f64,
    node: u32,
    rack: u32,
    zone: u32,
}

/// One member list, ready to place keys. Build it once per membership change.
///
/// ```
/// use kvtier_proto::{BlockKey, NamespaceId};
/// use kvtier_proto::cluster::{Labels, Member, NodeId, Placement, Reader};
///
/// let member = |id: &str, rack: &str| Member {
///     id: NodeId::new(id).unwrap(),
///     grpc_addr: format!("{id}:7070"),
///     data_addr: format!("{id}:7071"),
///     labels: Labels::new(Some(id), Some(rack), None),
///     capacity: 64 << 30,
///     since_ms: 0,
/// };
/// let p = Placement::new(&[member("a", "r1"), member("b", "r1"), member("c", "r2")]);
/// let (ns, key) = (NamespaceId([1; 16]), BlockKey([7; 32]));
/// let mut owners = p.owners(&ns, &key, 2);
/// let racks: Vec<_> = owners.iter().map(|&i| p.members()[i].labels.rack.clone().unwrap()).collect();
/// assert!(racks.contains(&"r2".to_string()), "two replicas, two racks");
/// // A reader on machine "c" tries its own machine's copy first.
/// let here = Labels::new(Some("c"), Some("r2"), None);
/// p.read_order(Reader { id: None, labels: &here }, &mut owners);
/// assert_eq!(p.members()[owners[0]].id.as_str(), "c");
/// ```
#[derive(Clone, Debug)]
pub struct Placement {
    /// Sorted by id, one entry per id.
    members: Vec<Member>,
    slots: Vec<Slot>,
    /// Indices of the members with a capacity above zero (the only possible owners).
    eligible: Vec<u32>,
    /// Whether the eligible members' capacities differ (else scores compare as integers).
    weighted: bool,
}

/// A member's score for one key; higher wins. Ties (astronomically rare) go to the lower index.
#[derive(Clone, Copy, Debug)]
struct Score {
    /// `w / -ln(u)` when weighted, else 0.
    weighted: f64,
    hash: u64,
}

impl Score {
    const ZERO: Score = Score { weighted: 0.0, hash: 0 };

    fn order(&self, other: &Score) -> std::cmp::Ordering {
        self.weighted.total_cmp(&other.weighted).then(self.hash.cmp(&other.hash))
    }

    fn beats(self, other: Score) -> bool {
        self.order(&other) == std::cmp::Ordering::Greater
    }
}

impl Placement {
    /// Placement over `members` (in any order). Duplicate ids keep their first entry; members
    /// with zero capacity own nothing.
    pub fn new(members: &[Member]) -> Self {
        let mut sorted: Vec<Member> = members.to_vec();
        // Stable: the first entry of an id survives `dedup_by`.
        sorted.sort_by(|a, b| a.id.cmp(&b.id));
        sorted.dedup_by(|later, first| later.id == first.id);

        // Topology domains interned to small integers. An unlabeled member is a domain of its
        // own (keyed by its unique id); a rack name is only unique within its zone.
        let mut domains: HashMap<String, u32> = HashMap::new();
        let mut intern = |key: String| -> u32 {
            let n = domains.len() as u32;
            *domains.entry(key).or_insert(n)
        };
        let mut slots = Vec::with_capacity(sorted.len());
        for m in &sorted {
            let id = m.id.as_str();
            let l = &m.labels;
            let zone = l.zone.as_deref().unwrap_or("");
            slots.push(Slot {
                seed: xxh3_64_with_seed(id.as_bytes(), MEMBER_SEED),
                weight: m.capacity as f64,
                node: intern(l.node.as_ref().map_or_else(|| format!("n?{id}"), |n| format!("n={n}"))),
                rack: intern(l.rack.as_ref().map_or_else(|| format!("r?{id}"), |r| format!("r={zone}/{r}"))),
                zone: intern(l.zone.as_ref().map_or_else(|| format!("z?{id}"), |z| format!("z={z}"))),
            });
        }

        let eligible: Vec<u32> =
            sorted.iter().enumerate().filter(|(_, m)| m.capacity > 0).map(|(i, _)| i as u32).collect();
        let weighted = eligible.windows(2).any(|w| sorted[w[0] as usize].capacity != sorted[w[1] as usize].capacity);
        Placement { members: sorted, slots, eligible, weighted }
    }

    /// The members, sorted by id; owner indices point into this slice.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn member(&self, idx: usize) -> Option<&Member> {
        self.members.get(idx)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The index of a member by id.
    pub fn index_of(&self, id: &NodeId) -> Option<usize> {
        self.members.binary_search_by(|m| m.id.cmp(id)).ok()
    }

    /// The owners of a block, best first, in `out` (cleared first): `rf` (clamped to
    /// 1..=[`MAX_RF`] and to the number of members with capacity) distinct members. The first is
    /// the highest score; each next one is the highest-scoring member in a rack not yet used if
    /// there is one, preferring among those a zone not yet used, then a machine not yet used.
    /// (Spreading is only as even as the topology: with rf = 2 over two racks of unequal size,
    /// the smaller rack holds half the replicas.)
    pub fn owners_into(&self, ns: &NamespaceId, key: &BlockKey, rf: usize, out: &mut Vec<usize>) {
        out.clear();
        let rf = rf.clamp(1, MAX_RF).min(self.eligible.len());
        if rf == 0 {
            return;
        }
        let k = key_hash(ns, key);
        if rf == 1 {
            out.extend(self.best(k));
            return;
        }
        // Every eligible member's score, computed once and sorted best first (on the stack for
        // up to STACK_SCORES members).
        let n = self.eligible.len();
        let mut on_stack = [(Score::ZERO, 0u32); STACK_SCORES];
        let mut on_heap = Vec::new();
        let ranked: &mut [(Score, u32)] = if n <= STACK_SCORES {
            &mut on_stack[..n]
        } else {
            on_heap.resize(n, (Score::ZERO, 0));
            &mut on_heap
        };
        for (r, &i) in ranked.iter_mut().zip(&self.eligible) {
            *r = (self.score(k, &self.slots[i as usize]), i);
        }
        ranked.sort_unstable_by(|a, b| b.0.order(&a.0).then(a.1.cmp(&b.1)));
        const ALL_FRESH: [bool; 3] = [true; 3];
        for _ in 0..rf {
            // The first (best-scoring) member with the freshest domains.
            let mut best: Option<(usize, [bool; 3])> = None;
            for &(_, i) in ranked.iter() {
                let i = i as usize;
                if out.contains(&i) {
                    continue;
                }
                let s = &self.slots[i];
                // Lexicographic: a rack not yet used, then a zone, then a machine.
                let fresh = [
                    !out.iter().any(|&o| self.slots[o].rack == s.rack),
                    !out.iter().any(|&o| self.slots[o].zone == s.zone),
                    !out.iter().any(|&o| self.slots[o].node == s.node),
                ];
                if best.is_none_or(|(_, bf)| fresh > bf) {
                    best = Some((i, fresh));
                    if fresh == ALL_FRESH {
                        break;
                    }
                }
            }
            match best {
                Some((i, _)) => out.push(i),
                None => break,
            }
        }
    }

    /// [`Placement::owners_into`] into a new vector.
    pub fn owners(&self, ns: &NamespaceId, key: &BlockKey, rf: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(rf.clamp(1, MAX_RF));
        self.owners_into(ns, key, rf, &mut out);
        out
    }

    /// The single owner of a block at `rf = 1` (allocation-free); `None` when no member has
    /// capacity.
    pub fn primary(&self, ns: &NamespaceId, key: &BlockKey) -> Option<usize> {
        self.best(key_hash(ns, key))
    }

    /// The highest-scoring eligible member for a key hash.
    fn best(&self, k: u64) -> Option<usize> {
        let mut best: Option<(usize, Score)> = None;
        for &i in &self.eligible {
            let score = self.score(k, &self.slots[i as usize]);
            if best.is_none_or(|(_, b)| score.beats(b)) {
                best = Some((i as usize, score));
            }
        }
        best.map(|(i, _)| i)
    }

    /// How close member `idx` is to `reader`.
    pub fn locality(&self, reader: Reader<'_>, idx: usize) -> Locality {
        let Some(m) = self.members.get(idx) else {
            return Locality::Remote;
        };
        let r = reader.labels;
        let same = |a: &Option<String>, b: &Option<String>| a.is_some() && a == b;
        if reader.id == Some(&m.id) {
            Locality::SameMember
        } else if same(&r.node, &m.labels.node) {
            Locality::SameNode
        } else if same(&r.rack, &m.labels.rack) && r.zone == m.labels.zone {
            Locality::SameRack
        } else if same(&r.zone, &m.labels.zone) {
            Locality::SameZone
        } else {
            Locality::Remote
        }
    }

    /// Sorts owners (as [`Placement::owners_into`] returns them) into the order `reader` should
    /// try them: closest first; equally close replicas keep their placement order.
    pub fn read_order(&self, reader: Reader<'_>, owners: &mut [usize]) {
        owners.sort_by_key(|&i| self.locality(reader, i));
    }

    fn score(&self, k: u64, s: &Slot) -> Score {
        let hash = xxh3_64_with_seed(&k.to_le_bytes(), s.seed);
        let weighted = if self.weighted {
            // u in (0, 1): the top 53 bits, centred in their interval so u is never 0 or 1.
            let u = ((hash >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
            s.weight / -u.ln()
        } else {
            0.0
        };
        Score { weighted, hash }
    }
}

/// The 64-bit hash a block is placed by (namespace and key together: the same opaque key in two
/// namespaces is two blocks).
fn key_hash(ns: &NamespaceId, key: &BlockKey) -> u64 {
    let mut buf = [0u8; NAMESPACE_ID_LEN + KEY_LEN];
    buf[..NAMESPACE_ID_LEN].copy_from_slice(&ns.0);
    buf[NAMESPACE_ID_LEN..].copy_from_slice(&key.0);
    xxh3_64_with_seed(&buf, KEY_SEED)
}

#[cfg(test)]
#[path = "placement_tests.rs"]
mod tests;
