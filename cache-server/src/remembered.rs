//! Session ids a node remembers with a time after the session is gone (when it expired, when it
//! was dropped), bounded node-wide. When full, the oldest of the tenant that holds the most (of its
//! namespace holding the most) are forgotten first, so one tenant's flood (parking and dropping
//! sessions by the thousand, spread over as many namespaces as it may register) can't push out
//! what another's late resume or returning copy needs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvtier_proto::NamespaceId;

/// The tenant of each registered namespace (a hash of its name), kept by the node beside its
/// namespace table. A leaf lock: nothing else is locked while it is held.
pub type NamespaceOwners = Arc<parking_lot::RwLock<HashMap<NamespaceId, u64>>>;

/// A tenant's key in [`NamespaceOwners`].
pub fn owner_key(tenant: &str) -> u64 {
    kvtier_proto::checksum(tenant.as_bytes())
}

/// Ids and their times, per namespace, at most `max` in all.
#[derive(Debug)]
pub struct RememberedIds {
    by_ns: HashMap<NamespaceId, HashMap<String, Instant>>,
    len: usize,
    max: usize,
    /// Whose each namespace is; without it (or for a namespace it doesn't know), each namespace
    /// counts as a tenant of its own.
    owners: Option<NamespaceOwners>,
    /// The owner of each namespace in `by_ns`, as of its first id remembered (so an unregistered
    /// namespace's ids still count against its tenant).
    owner_of: HashMap<NamespaceId, u64>,
}

impl RememberedIds {
    pub fn new(max: usize) -> Self {
        RememberedIds { by_ns: HashMap::new(), len: 0, max: max.max(1), owners: None, owner_of: HashMap::new() }
    }

    /// `ns`'s ids, made (and its owner noted) if it has none yet.
    fn ids_of(&mut self, ns: NamespaceId) -> &mut HashMap<String, Instant> {
        if !self.by_ns.contains_key(&ns) {
            let owner = self.owners.as_ref().and_then(|o| o.read().get(&ns).copied());
            self.owner_of.insert(ns, owner.unwrap_or_else(|| kvtier_proto::checksum(&ns.0)));
        }
        self.by_ns.entry(ns).or_default()
    }

    /// Makes room by tenant, as `owners` says whose each namespace is.
    pub fn set_owners(&mut self, owners: NamespaceOwners) {
        self.owners = Some(owners);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the next new id would make room first.
    pub fn is_full(&self) -> bool {
        self.len >= self.max
    }

    pub fn get(&self, ns: NamespaceId, id: &str) -> Option<Instant> {
        self.by_ns.get(&ns)?.get(id).copied()
    }

    /// Remembers `id` at `at`, or at the later of `at` and its time if it is remembered already.
    /// A new id past the bound first makes room (see [`Self::make_room`]; `keep` is asked first
    /// whether any may go for free, e.g. past a time that matters).
    pub fn insert_latest(&mut self, ns: NamespaceId, id: &str, at: Instant, keep: impl Fn(&Instant) -> bool) {
        if let Some(had) = self.by_ns.get_mut(&ns).and_then(|m| m.get_mut(id)) {
            *had = (*had).max(at);
            return;
        }
        if self.is_full() {
            self.retain(keep);
            self.make_room();
        }
        self.ids_of(ns).insert(id.to_string(), at);
        self.len += 1;
    }

    /// Remembers `id` at `at` exactly (replacing a time remembered before).
    pub fn insert(&mut self, ns: NamespaceId, id: &str, at: Instant) {
        if let Some(had) = self.by_ns.get_mut(&ns).and_then(|m| m.get_mut(id)) {
            *had = at;
            return;
        }
        if self.is_full() {
            self.make_room();
        }
        self.ids_of(ns).insert(id.to_string(), at);
        self.len += 1;
    }

    /// Forgets the oldest of whichever namespaces remember the most, a sixty-fourth of the bound
    /// at least (so the work is paid once per that many new ids, however the ids are spread).
    fn make_room(&mut self) {
        let goal = self.max - self.max.div_ceil(64).min(self.max);
        while self.len > goal && !self.by_ns.is_empty() {
            self.forget_oldest_of_largest();
        }
    }

    pub fn remove(&mut self, ns: NamespaceId, id: &str) -> Option<Instant> {
        let m = self.by_ns.get_mut(&ns)?;
        let at = m.remove(id)?;
        self.len -= 1;
        if m.is_empty() {
            self.by_ns.remove(&ns);
            self.owner_of.remove(&ns);
        }
        Some(at)
    }

    /// Keeps only the ids whose time `keep` accepts.
    pub fn retain(&mut self, keep: impl Fn(&Instant) -> bool) {
        let mut len = 0;
        self.by_ns.retain(|_, m| {
            m.retain(|_, at| keep(at));
            len += m.len();
            !m.is_empty()
        });
        self.owner_of.retain(|ns, _| self.by_ns.contains_key(ns));
        self.len = len;
    }

    /// The namespace remembering the most ids of the tenant remembering the most.
    fn largest(&self) -> Option<NamespaceId> {
        let owner = |ns: &NamespaceId| self.owner_of.get(ns).copied().unwrap_or_else(|| kvtier_proto::checksum(&ns.0));
        let mut per_owner: HashMap<u64, (usize, NamespaceId, usize)> = HashMap::new();
        for (ns, m) in &self.by_ns {
            let e = per_owner.entry(owner(ns)).or_insert((0, *ns, 0));
            e.0 += m.len();
            if m.len() > e.2 {
                (e.1, e.2) = (*ns, m.len());
            }
        }
        per_owner.into_values().max_by_key(|(total, _, _)| *total).map(|(_, ns, _)| ns)
    }

    /// Forgets the oldest eighth (at least one) of [`Self::largest`].
    fn forget_oldest_of_largest(&mut self) {
        let Some(ns) = self.largest() else { return };
        let Some(m) = self.by_ns.get_mut(&ns) else { return };
        let n = (m.len() / 8).max(1);
        let mut by_age: Vec<(Instant, &String)> = m.iter().map(|(id, at)| (*at, id)).collect();
        by_age.select_nth_unstable(n - 1);
        let oldest: Vec<String> = by_age[..n].iter().map(|(_, id)| (*id).clone()).collect();
        for id in &oldest {
            m.remove(id);
        }
        self.len -= n;
        if m.is_empty() {
            self.by_ns.remove(&ns);
            self.owner_of.remove(&ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ns(n: u8) -> NamespaceId {
        NamespaceId([n; 16])
    }

    #[test]
    fn one_namespace_s_flood_forgets_its_own_oldest_not_another_s() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = RememberedIds::new(100);
        for i in 0..10 {
            r.insert(ns(1), &format!("quiet-{i}"), at(i));
        }
        for i in 0..1000 {
            r.insert(ns(2), &format!("flood-{i}"), at(100 + i));
            assert!(r.len() <= 100);
        }
        for i in 0..10 {
            assert_eq!(r.get(ns(1), &format!("quiet-{i}")), Some(at(i)), "the quiet namespace keeps all of its own");
        }
        assert!(r.get(ns(2), "flood-999").is_some(), "the newest of the flood is kept");
        assert!(r.get(ns(2), "flood-0").is_none(), "its oldest are forgotten");
        assert!(r.len() >= 86, "room is made a few at a time: {}", r.len());
    }

    /// A tenant flooding through many namespaces forgets its own oldest, not another tenant's
    /// one namespace (which, per namespace, holds the most).
    #[test]
    fn one_tenant_s_flood_over_many_namespaces_forgets_its_own() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let owners: NamespaceOwners = Default::default();
        owners.write().insert(ns(1), owner_key("quiet"));
        for n in 2..=20 {
            owners.write().insert(ns(n), owner_key("flood"));
        }
        let mut r = RememberedIds::new(100);
        r.set_owners(owners);
        for i in 0..30 {
            r.insert(ns(1), &format!("quiet-{i}"), at(i));
        }
        for i in 0..2000u64 {
            r.insert(ns(2 + (i % 19) as u8), &format!("flood-{i}"), at(100 + i));
            assert!(r.len() <= 100);
        }
        for i in 0..30 {
            assert_eq!(r.get(ns(1), &format!("quiet-{i}")), Some(at(i)), "the quiet tenant keeps all of its own");
        }
        // Without owners each namespace is a tenant: the quiet one's 30 were the most, and went.
        let mut r = RememberedIds::new(100);
        for i in 0..30 {
            r.insert(ns(1), &format!("quiet-{i}"), at(i));
        }
        for i in 0..2000u64 {
            r.insert(ns(2 + (i % 19) as u8), &format!("flood-{i}"), at(100 + i));
        }
        assert!((0..30).any(|i| r.get(ns(1), &format!("quiet-{i}")).is_none()), "per namespace, the flood wins");
    }

    #[test]
    fn a_later_time_wins_and_free_room_is_taken_first() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = RememberedIds::new(3);
        r.insert_latest(ns(1), "a", at(5), |_| true);
        r.insert_latest(ns(1), "a", at(2), |_| true);
        assert_eq!(r.get(ns(1), "a"), Some(at(5)), "a time never moves back");
        r.insert(ns(1), "a", at(2));
        assert_eq!(r.get(ns(1), "a"), Some(at(2)), "unless set outright");
        r.insert(ns(1), "b", at(3));
        r.insert(ns(2), "c", at(1));
        // Full: what `keep` lets go goes first, and nothing else.
        r.insert_latest(ns(1), "d", at(9), |t| *t > at(1));
        assert_eq!((r.get(ns(2), "c"), r.len()), (None, 3));
        assert_eq!(r.remove(ns(1), "a"), Some(at(2)));
        assert_eq!(r.remove(ns(1), "a"), None);
        assert_eq!(r.len(), 2);
        r.retain(|t| *t > at(3));
        assert_eq!((r.len(), r.get(ns(1), "d")), (1, Some(at(9))));
    }
}
