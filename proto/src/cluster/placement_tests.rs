//! Placement: balance, movement on join and leave, distinct and spread replicas, reader order,
//! weights, determinism — by counting over many keys, and as properties over random clusters.

use std::collections::HashSet;

use crate::{BlockKey, NamespaceId};
use proptest::prelude::*;

use super::*;

const KEYS: u64 = 200_000;

fn ns(n: u8) -> NamespaceId {
    NamespaceId([n; 16])
}

fn key(i: u64) -> BlockKey {
    BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes())
}

fn member(id: &str, node: Option<&str>, rack: Option<&str>, zone: Option<&str>, capacity: u64) -> Member {
    Member {
        id: NodeId::new(id).unwrap(),
        grpc_addr: format!("{id}:7070"),
        data_addr: format!("{id}:7071"),
        labels: Labels::new(node, rack, zone),
        capacity,
        since_ms: 0,
    }
}

fn plain(n: usize) -> Vec<Member> {
    (0..n).map(|i| member(&format!("node-{i}"), None, None, None, 1 << 30)).collect()
}

/// Keys per member index at `rf = 1`.
fn counts(p: &Placement, keys: u64) -> Vec<u64> {
    let mut c = vec![0u64; p.len()];
    for i in 0..keys {
        c[p.primary(&ns(1), &key(i)).unwrap()] += 1;
    }
    c
}

/// The largest relative deviation of `counts[i]` from `expected[i]`.
fn max_dev(counts: &[u64], expected: &[f64]) -> f64 {
    counts.iter().zip(expected).map(|(&c, &e)| (c as f64 - e).abs() / e).fold(0.0, f64::max)
}

fn ids(p: &Placement, owners: &[usize]) -> Vec<String> {
    owners.iter().map(|&i| p.member(i).unwrap().id.to_string()).collect()
}

#[test]
fn equal_members_get_equal_shares() {
    let mut worst = 0.0f64;
    for n in 3..=16 {
        let p = Placement::new(&plain(n));
        let c = counts(&p, KEYS);
        let dev = max_dev(&c, &vec![KEYS as f64 / n as f64; n]);
        // One node's share has a standard deviation of ~sqrt(KEYS/n)/(KEYS/n) (0.9% at 16 nodes).
        assert!(dev < 0.04, "{n} nodes: keys per node {c:?} deviate by {:.2}%", dev * 100.0);
        worst = worst.max(dev);
    }
    eprintln!("balance, 3..=16 equal nodes, {KEYS} keys: worst deviation {:.2}%", worst * 100.0);
}

#[test]
fn replicas_are_balanced_too() {
    // At rf = 3 every member holds ~3/n of the keys.
    let n = 8;
    let p = Placement::new(&plain(n));
    let mut c = vec![0u64; n];
    let mut out = Vec::new();
    for i in 0..KEYS / 2 {
        p.owners_into(&ns(1), &key(i), 3, &mut out);
        for &o in &out {
            c[o] += 1;
        }
    }
    let dev = max_dev(&c, &vec![(KEYS / 2) as f64 * 3.0 / n as f64; n]);
    assert!(dev < 0.04, "rf=3 over {n} nodes: {c:?} ({:.2}%)", dev * 100.0);
}

#[test]
fn a_join_moves_about_one_share_and_only_onto_the_new_member() {
    for n in [3usize, 4, 8, 15] {
        let before = Placement::new(&plain(n));
        let mut members = plain(n);
        members.push(member("joiner", None, None, None, 1 << 30));
        let after = Placement::new(&members);
        let joiner = after.index_of(&NodeId::new("joiner").unwrap()).unwrap();
        let mut moved = 0u64;
        for i in 0..KEYS {
            let k = key(i);
            let (b, a) = (before.primary(&ns(1), &k).unwrap(), after.primary(&ns(1), &k).unwrap());
            let (b, a) = (&before.member(b).unwrap().id, &after.member(a).unwrap().id);
            if a != b {
                moved += 1;
                assert_eq!(a, &after.member(joiner).unwrap().id, "key {i} moved between old members");
            }
        }
        let frac = moved as f64 / KEYS as f64;
        let ideal = 1.0 / (n + 1) as f64;
        eprintln!("join {n}->{}: moved {:.2}% of keys (ideal {:.2}%)", n + 1, frac * 100.0, ideal * 100.0);
        assert!((frac - ideal).abs() / ideal < 0.05, "join {n}->{}: moved {frac}, ideal {ideal}", n + 1);
    }
}

#[test]
fn a_leave_moves_only_the_leavers_keys() {
    let n = 10;
    let before = Placement::new(&plain(n));
    let leaver = NodeId::new("node-3").unwrap();
    let rest: Vec<Member> = plain(n).into_iter().filter(|m| m.id != leaver).collect();
    let after = Placement::new(&rest);
    let (mut moved, mut owned) = (0u64, 0u64);
    for i in 0..KEYS {
        let k = key(i);
        let b = &before.member(before.primary(&ns(1), &k).unwrap()).unwrap().id;
        let a = &after.member(after.primary(&ns(1), &k).unwrap()).unwrap().id;
        if *b == leaver {
            owned += 1;
        }
        if a != b {
            moved += 1;
            assert_eq!(*b, leaver, "key {i} moved though its owner stayed");
        }
    }
    assert_eq!(moved, owned, "every key of the leaver moves, no other");
    eprintln!("leave 10->9: moved {:.2}% of keys (ideal 10%)", moved as f64 * 100.0 / KEYS as f64);
}

#[test]
fn with_replicas_a_join_replaces_at_most_one_owner() {
    let before = Placement::new(&plain(6));
    let mut members = plain(6);
    members.push(member("joiner", None, None, None, 1 << 30));
    let after = Placement::new(&members);
    let mut changed = 0u64;
    for i in 0..KEYS / 4 {
        let k = key(i);
        let b: HashSet<String> = ids(&before, &before.owners(&ns(1), &k, 3)).into_iter().collect();
        let a: HashSet<String> = ids(&after, &after.owners(&ns(1), &k, 3)).into_iter().collect();
        let added: Vec<_> = a.difference(&b).collect();
        assert!(added.is_empty() || added == ["joiner"], "key {i}: {b:?} -> {a:?}");
        changed += u64::from(!added.is_empty());
    }
    // The joiner is among the top 3 of 7 for ~3/7 of the keys.
    let frac = changed as f64 / (KEYS / 4) as f64;
    assert!((frac - 3.0 / 7.0).abs() < 0.02, "{frac}");
}

#[test]
fn owners_are_distinct_and_clamped() {
    let p = Placement::new(&plain(4));
    for i in 0..1000 {
        let o = p.owners(&ns(1), &key(i), 3);
        assert_eq!(o.len(), 3);
        assert_eq!(o.iter().collect::<HashSet<_>>().len(), 3);
        assert_eq!(o[0], p.primary(&ns(1), &key(i)).unwrap(), "the first owner is the rf=1 owner");
    }
    // Past the scores kept on the stack: the same rules.
    let big = Placement::new(&plain(STACK_SCORES + 72));
    for i in 0..200 {
        let o = big.owners(&ns(1), &key(i), 4);
        assert_eq!(o.iter().collect::<HashSet<_>>().len(), 4);
        assert_eq!(o[0], big.primary(&ns(1), &key(i)).unwrap());
    }
    assert_eq!(p.owners(&ns(1), &key(0), 9).len(), 4, "rf is clamped to the members");
    assert_eq!(p.owners(&ns(1), &key(0), 0).len(), 1, "rf 0 reads as 1");
    assert!(Placement::new(&[]).owners(&ns(1), &key(0), 2).is_empty());
    assert_eq!(Placement::new(&[]).primary(&ns(1), &key(0)), None);
}

#[test]
fn zero_capacity_members_own_nothing() {
    let mut members = plain(3);
    members.push(member("draining", None, None, None, 0));
    let p = Placement::new(&members);
    let d = p.index_of(&NodeId::new("draining").unwrap()).unwrap();
    for i in 0..2000 {
        assert!(!p.owners(&ns(1), &key(i), 8).contains(&d));
    }
    assert_eq!(p.owners(&ns(1), &key(0), 8).len(), 3);
}

#[test]
fn namespaces_place_the_same_key_independently() {
    let p = Placement::new(&plain(8));
    let differ = (0..1000).filter(|&i| p.primary(&ns(1), &key(i)) != p.primary(&ns(2), &key(i))).count();
    // Independent placements agree on 1/8 of the keys.
    assert!((800..950).contains(&differ), "{differ}");
}

#[test]
fn placement_ignores_input_order_and_duplicates() {
    let members = plain(7);
    let mut shuffled = members.clone();
    shuffled.reverse();
    shuffled.swap(1, 4);
    shuffled.push(members[2].clone());
    let (a, b) = (Placement::new(&members), Placement::new(&shuffled));
    assert_eq!(b.len(), 7);
    for i in 0..2000 {
        assert_eq!(ids(&a, &a.owners(&ns(1), &key(i), 3)), ids(&b, &b.owners(&ns(1), &key(i), 3)));
    }
}

/// The hash functions and seeds are part of the cluster's contract: nodes of different versions
/// must agree. If this fails, placement changed — every key of every cluster would move.
#[test]
fn placement_is_pinned() {
    let p = Placement::new(&plain(5));
    let got: Vec<String> = (0..6).map(|i| ids(&p, &p.owners(&ns(7), &key(i), 2)).join(",")).collect();
    assert_eq!(got, PINNED);
    // And the weighted (floating-point) path.
    let mut members = plain(5);
    for (i, m) in members.iter_mut().enumerate() {
        m.capacity = (i as u64 + 1) << 30;
    }
    let p = Placement::new(&members);
    let got: Vec<String> = (0..6).map(|i| ids(&p, &p.owners(&ns(7), &key(i), 2)).join(",")).collect();
    assert_eq!(got, PINNED_WEIGHTED);
}

const PINNED: [&str; 6] =
    ["node-2,node-1", "node-0,node-1", "node-3,node-1", "node-4,node-0", "node-2,node-1", "node-2,node-4"];
const PINNED_WEIGHTED: [&str; 6] =
    ["node-2,node-1", "node-0,node-1", "node-3,node-4", "node-4,node-3", "node-2,node-1", "node-4,node-2"];

/// 3 zones × 2 racks × 2 machines × 2 servers per machine.
fn topology() -> Vec<Member> {
    let mut v = Vec::new();
    for z in 0..3 {
        for r in 0..2 {
            for h in 0..2 {
                for s in 0..2 {
                    let node = format!("z{z}-r{r}-h{h}");
                    v.push(member(
                        &format!("{node}-s{s}"),
                        Some(&node),
                        Some(&format!("r{r}")),
                        Some(&format!("z{z}")),
                        1 << 30,
                    ));
                }
            }
        }
    }
    v
}

#[test]
fn replicas_spread_over_machines_racks_and_zones() {
    let p = Placement::new(&topology());
    for i in 0..20_000 {
        let o = p.owners(&ns(1), &key(i), 3);
        let labels: Vec<&Labels> = o.iter().map(|&i| &p.member(i).unwrap().labels).collect();
        let zones: HashSet<_> = labels.iter().map(|l| &l.zone).collect();
        assert_eq!(zones.len(), 3, "rf=3 over 3 zones: one replica per zone, key {i}");
        let o = p.owners(&ns(1), &key(i), 5);
        let racks: HashSet<_> = o.iter().map(|&i| (&p.members()[i].labels.zone, &p.members()[i].labels.rack)).collect();
        let nodes: HashSet<_> = o.iter().map(|&i| &p.members()[i].labels.node).collect();
        assert_eq!((racks.len(), nodes.len()), (5, 5), "rf=5 over 6 racks: distinct racks, key {i}");
    }
    // rf=7 over 6 racks: two replicas must share a rack, but never a machine (12 machines).
    let o = p.owners(&ns(1), &key(0), 7);
    let nodes: HashSet<_> = o.iter().map(|&i| &p.members()[i].labels.node).collect();
    assert_eq!(nodes.len(), 7);
}

#[test]
fn a_rack_name_is_scoped_by_its_zone() {
    // "r0" exists in both zones: two different racks.
    let members = vec![
        member("a", None, Some("r0"), Some("z0"), 1),
        member("b", None, Some("r0"), Some("z1"), 1),
        member("c", None, Some("r0"), Some("z0"), 1),
    ];
    let p = Placement::new(&members);
    for i in 0..500 {
        let o = ids(&p, &p.owners(&ns(1), &key(i), 2));
        assert!(o.contains(&"b".to_string()), "the only other rack holds a replica: {o:?}");
    }
}

#[test]
fn readers_prefer_their_member_then_machine_rack_zone() {
    let p = Placement::new(&topology());
    let me = &p.members()[p.index_of(&NodeId::new("z1-r0-h0-s0").unwrap()).unwrap()];
    let reader = Reader { id: Some(&me.id), labels: &me.labels };
    let at = |id: &str| p.index_of(&NodeId::new(id).unwrap()).unwrap();
    let mut owners = vec![
        at("z2-r0-h0-s0"),
        at("z1-r1-h0-s0"),
        at("z1-r0-h1-s1"),
        at("z1-r0-h0-s1"),
        at("z1-r0-h0-s0"),
        at("z0-r0-h0-s0"),
    ];
    p.read_order(reader, &mut owners);
    assert_eq!(
        ids(&p, &owners),
        ["z1-r0-h0-s0", "z1-r0-h0-s1", "z1-r0-h1-s1", "z1-r1-h0-s0", "z2-r0-h0-s0", "z0-r0-h0-s0"],
        "own member, own machine, own rack, own zone, then the rest in placement order"
    );
    let localities: Vec<Locality> = owners.iter().map(|&o| p.locality(reader, o)).collect();
    assert_eq!(
        localities,
        [
            Locality::SameMember,
            Locality::SameNode,
            Locality::SameRack,
            Locality::SameZone,
            Locality::Remote,
            Locality::Remote
        ]
    );
    // A client with no labels: placement order stands.
    let none = Labels::default();
    let mut o2 = p.owners(&ns(1), &key(3), 3);
    let before = o2.clone();
    p.read_order(Reader { id: None, labels: &none }, &mut o2);
    assert_eq!(o2, before);
}

#[test]
fn weighted_members_get_shares_by_capacity() {
    let caps = [1u64, 2, 3, 4, 6];
    let members: Vec<Member> =
        caps.iter().enumerate().map(|(i, &c)| member(&format!("w{i}"), None, None, None, c << 30)).collect();
    let p = Placement::new(&members);
    let c = counts(&p, KEYS);
    let total: u64 = caps.iter().sum();
    let expected: Vec<f64> = caps.iter().map(|&w| KEYS as f64 * w as f64 / total as f64).collect();
    let dev = max_dev(&c, &expected);
    eprintln!("weighted 1:2:3:4:6, {KEYS} keys: {c:?}, worst deviation {:.2}%", dev * 100.0);
    assert!(dev < 0.04, "{c:?} vs {expected:?}");
}

#[test]
fn growing_one_members_capacity_moves_keys_only_onto_it() {
    let mut members = plain(5);
    let before = Placement::new(&members);
    members[2].capacity *= 2;
    let after = Placement::new(&members);
    let mut moved = 0u64;
    for i in 0..KEYS / 2 {
        let (b, a) = (before.primary(&ns(1), &key(i)).unwrap(), after.primary(&ns(1), &key(i)).unwrap());
        if a != b {
            moved += 1;
            assert_eq!(a, 2, "key {i} moved between unchanged members");
        }
    }
    // Its share goes from 1/5 to 2/6: a move of 2/15 of the keys.
    let frac = moved as f64 / (KEYS / 2) as f64;
    assert!((frac - 2.0 / 15.0).abs() < 0.01, "{frac}");
}

fn arb_member(i: usize) -> impl Strategy<Value = Member> {
    (0u8..3, 0u8..3, 0u8..4, prop_oneof![Just(0u64), Just(1u64 << 30), 1u64..(8 << 30)]).prop_map(
        move |(z, r, h, cap)| {
            let node = format!("h{h}");
            member(&format!("m{i}"), Some(&node), Some(&format!("r{r}")), Some(&format!("z{z}")), cap)
        },
    )
}

fn arb_cluster() -> impl Strategy<Value = Vec<Member>> {
    (1usize..12).prop_flat_map(|n| (0..n).map(arb_member).collect::<Vec<_>>())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Owners are distinct members with capacity, as many as rf allows, first the rf=1 owner; and
    /// replicas use as many racks as there are (up to rf).
    #[test]
    fn owners_are_well_formed(members in arb_cluster(), rf in 1usize..6, k in any::<u64>()) {
        let p = Placement::new(&members);
        let eligible = p.members().iter().filter(|m| m.capacity > 0).count();
        let racks: HashSet<_> = p.members().iter().filter(|m| m.capacity > 0)
            .map(|m| (m.labels.zone.clone(), m.labels.rack.clone())).collect();
        let o = p.owners(&ns(1), &key(k), rf);
        prop_assert_eq!(o.len(), rf.min(eligible));
        prop_assert_eq!(o.iter().collect::<HashSet<_>>().len(), o.len());
        prop_assert!(o.iter().all(|&i| p.members()[i].capacity > 0));
        prop_assert_eq!(o.first().copied(), p.primary(&ns(1), &key(k)));
        let used: HashSet<_> = o.iter().map(|&i| (p.members()[i].labels.zone.clone(), p.members()[i].labels.rack.clone())).collect();
        prop_assert_eq!(used.len(), rf.min(racks.len()).min(o.len()));
    }

    /// Adding a member moves a key only onto that member (rf = 1), whatever the weights.
    #[test]
    fn a_join_only_moves_keys_onto_the_joiner(members in arb_cluster(), cap in 1u64..(8 << 30), keys in proptest::collection::vec(any::<u64>(), 1..64)) {
        let before = Placement::new(&members);
        let mut more = members.clone();
        more.push(member("joiner", None, None, None, cap));
        let after = Placement::new(&more);
        for k in keys {
            let b = before.primary(&ns(1), &key(k)).map(|i| before.members()[i].id.clone());
            let a = after.primary(&ns(1), &key(k)).map(|i| after.members()[i].id.clone());
            if a != b {
                prop_assert_eq!(a.as_ref().map(NodeId::as_str), Some("joiner"));
            }
        }
    }
}
