//! Session ids a node remembers with a time after the session is gone (when it expired, when it
//! was dropped), bounded node-wide. When full, the oldest of whichever namespace holds the most
//! are forgotten first, so one namespace's flood (a tenant parking and dropping sessions by the
//! thousand) can't push out what another's late resume or returning copy needs.

use std::collections::HashMap;
use std::time::Instant;

use kvtier_proto::NamespaceId;

/// Ids and their times, per namespace, at most `max` in all.
#[derive(Debug)]
pub struct RememberedIds {
    by_ns: HashMap<NamespaceId, HashMap<String, Instant>>,
    len: usize,
    max: usize,
}

impl RememberedIds {
    pub fn new(max: usize) -> Self {
        RememberedIds { by_ns: HashMap::new(), len: 0, max: max.max(1) }
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
        self.by_ns.entry(ns).or_default().insert(id.to_string(), at);
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
        self.by_ns.entry(ns).or_default().insert(id.to_string(), at);
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
        self.len = len;
    }

    /// Forgets the oldest eighth (at least one) of the namespace remembering the most ids.
    fn forget_oldest_of_largest(&mut self) {
        let Some((&ns, m)) = self.by_ns.iter_mut().max_by_key(|(_, m)| m.len()) else { return };
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
