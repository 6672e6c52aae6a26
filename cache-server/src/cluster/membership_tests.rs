//! Membership without Redis: the view's merge rules (stale, grace after Redis comes back), the
//! member hash format, config checks and `Embedded`.

use super::*;

fn m(id: &str) -> Member {
    Member {
        id: NodeId::new(id).unwrap(),
        grpc_addr: format!("{id}:1"),
        data_addr: format!("{id}:2"),
        labels: Labels::new(Some("h"), Some("r"), None),
        capacity: 7,
        since_ms: 0,
    }
}

fn ids(v: &View) -> Vec<&str> {
    v.members.keys().map(NodeId::as_str).collect()
}

const TTL: Duration = Duration::from_secs(10);

#[test]
fn the_view_follows_redis_and_always_holds_itself() {
    let t0 = Instant::now();
    let mut v = View::new(m("a"));
    assert!(v.polled(t0, vec![m("b"), m("c")], false, TTL));
    assert_eq!(ids(&v), ["a", "b", "c"], "itself even when Redis does not list it yet");
    assert_eq!(v.generation, 2);
    assert!(!v.polled(t0, vec![m("a"), m("b"), m("c")], false, TTL), "no change, no publish");
    assert!(v.polled(t0, vec![m("a"), m("c")], false, TTL));
    assert_eq!(ids(&v), ["a", "c"], "a member gone from Redis is gone at once");
    let mut moved = m("c");
    moved.grpc_addr = "elsewhere:1".into();
    assert!(v.polled(t0, vec![moved.clone()], false, TTL));
    assert_eq!(v.members[&moved.id], moved, "a re-registration with new fields replaces the old");
}

#[test]
fn stale_keeps_members_and_recovery_keeps_them_one_ttl() {
    let t0 = Instant::now();
    let mut v = View::new(m("a"));
    v.polled(t0, vec![m("a"), m("b"), m("c")], false, TTL);
    let g = v.generation;
    assert!(v.failed(), "the first failure makes it stale");
    assert!(!v.failed(), "later failures change nothing");
    let s = v.snapshot();
    assert!(s.stale);
    assert_eq!(s.members.len(), 3, "the last known members are kept");
    assert_eq!(s.generation, g);
    // Redis is back (restarted, empty): only `a` has re-registered so far.
    assert!(v.polled(t0 + Duration::from_secs(60), vec![m("a")], false, TTL), "no longer stale");
    assert!(!v.stale);
    assert_eq!(ids(&v), ["a", "b", "c"], "others keep their place while they re-register");
    v.polled(t0 + Duration::from_secs(65), vec![m("a"), m("b")], false, TTL);
    assert_eq!(ids(&v), ["a", "b", "c"]);
    // One TTL later, whoever has not re-registered is gone.
    assert!(v.polled(t0 + Duration::from_secs(71), vec![m("a"), m("b")], false, TTL));
    assert_eq!(ids(&v), ["a", "b"]);
}

#[test]
fn a_lost_key_opens_the_same_grace() {
    let t0 = Instant::now();
    let mut v = View::new(m("a"));
    v.polled(t0, vec![m("a"), m("b")], false, TTL);
    assert!(!v.polled(t0, vec![m("a")], true, TTL), "b kept: Redis lost its data");
    assert_eq!(ids(&v), ["a", "b"]);
    assert!(v.polled(t0 + TTL, vec![m("a")], false, TTL));
    assert_eq!(ids(&v), ["a"]);
}

#[test]
fn members_round_trip_through_their_hash() {
    let mut a = m("node-1");
    a.labels = Labels::new(None, Some("r1"), Some("z1"));
    a.capacity = u64::MAX;
    let fields: HashMap<String, String> = encode(&a).into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    assert_eq!(decode("node-1", &fields), Some(a));
    let mut future = fields.clone();
    future.insert("v".into(), "2".into());
    assert_eq!(decode("node-1", &future), None, "an unknown format is skipped, not misread");
    let mut broken = fields;
    broken.remove("capacity");
    assert_eq!(decode("node-1", &broken), None);
}

#[test]
fn bad_configs_are_refused() {
    let ok = RedisMembershipConfig::new("redis://127.0.0.1:1", m("a"));
    assert!(ok.validate().is_ok());
    assert!(ok.clone().with_ttl(Duration::from_millis(100)).validate().is_err());
    assert!(ok.clone().with_op_timeout(Duration::from_secs(6)).validate().is_err());
    assert!(ok.clone().with_poll_interval(Duration::from_secs(11)).validate().is_err());
    assert!(ok.clone().with_key_prefix("a{b}").validate().is_err());
    assert_eq!(ok.clone().with_ttl(Duration::from_millis(900)).tick(), Duration::from_millis(300));
}

#[tokio::test]
async fn embedded_is_one_member_forever() {
    let e = Embedded::new(m("solo")).unwrap();
    let s = e.snapshot();
    assert_eq!(s.members.len(), 1);
    assert_eq!(s.members[0].id.as_str(), "solo");
    assert!(!s.stale);
    e.leave().await.unwrap();
    assert_eq!(e.local().id.as_str(), "solo");
}

/// What a member whose shared settings differ is told: the pairs each side has that the other
/// does not.
#[test]
fn differing_settings_name_only_what_differs() {
    let ours = "cluster_rf=2 auth=on tenants=none";
    let theirs = "cluster_rf=5 auth=on tenants=none";
    assert_eq!(differing(theirs, ours), "cluster_rf=5");
    assert_eq!(differing(ours, theirs), "cluster_rf=2");
    assert_eq!(differing(ours, ours), "");
    let cfg = RedisMembershipConfig::new("redis://127.0.0.1:1", m("a"))
        .with_shared_settings(&[("cluster_rf", "2".into()), ("auth", "on".into())]);
    assert_eq!(cfg.settings, "cluster_rf=2 auth=on");
}
