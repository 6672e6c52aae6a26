//! The pool against a model: a list in LRU order, pins and the bytes each key holds. Any sequence
//! of inserts, loads, pins, unpins and removes leaves the same resident set, spills the same
//! blocks in the same order with the same bytes, and loads the bytes the key was inserted with.

use proptest::prelude::*;

use super::*;
use crate::HostDevice;

const PAGE: usize = 64;
const PAGES: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    Insert(u8),
    Load(u8),
    Pin(u8),
    Unpin(u8),
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0u8..8;
    prop_oneof![
        3 => k.clone().prop_map(Op::Insert),
        3 => k.clone().prop_map(Op::Load),
        1 => k.clone().prop_map(Op::Pin),
        1 => k.clone().prop_map(Op::Unpin),
        1 => k.prop_map(Op::Remove),
    ]
}

#[derive(Default)]
struct Model {
    /// Least recently used first: (key, pins).
    order: Vec<(u8, u32)>,
    spilled: Vec<u8>,
}

impl Model {
    fn pos(&self, k: u8) -> Option<usize> {
        self.order.iter().position(|(x, _)| *x == k)
    }

    fn touch(&mut self, k: u8) {
        if let Some(i) = self.pos(k) {
            let e = self.order.remove(i);
            self.order.push(e);
        }
    }

    /// Ok(true) inserted, Ok(false) already there, Err: every page pinned.
    fn insert(&mut self, k: u8) -> Result<bool, ()> {
        if self.pos(k).is_some() {
            self.touch(k);
            return Ok(false);
        }
        if self.order.len() == PAGES {
            let i = self.order.iter().position(|(_, p)| *p == 0).ok_or(())?;
            let (victim, _) = self.order.remove(i);
            self.spilled.push(victim);
        }
        self.order.push((k, 0));
        Ok(true)
    }
}

fn key(k: u8) -> BlockKey {
    BlockKey([k; kvtier_proto::KEY_LEN])
}

proptest! {
    #[test]
    fn pool_matches_the_lru_model(ops in proptest::collection::vec(op(), 1..80)) {
        let ns = NamespaceId([1; kvtier_proto::NAMESPACE_ID_LEN]);
        let dev = Arc::new(HostDevice::new(0, 1 << 20));
        let engine = dev.alloc(9 * PAGE).unwrap();
        for k in 0..8u8 {
            dev.write_sync(engine.range(k as usize * PAGE, PAGE), &[k + 100; PAGE]).unwrap();
        }
        let out = engine.range(8 * PAGE, PAGE);
        let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::Bytes(PAGES * PAGE));
        let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Insert(k) => {
                    let got = pool.insert_from_device(&ns, &key(k), engine.range(k as usize * PAGE, PAGE));
                    match model.insert(k) {
                        Ok(_) => { dev.wait(&got.unwrap()).unwrap(); }
                        Err(()) => prop_assert_eq!(got.err(), Some(AgentError::PoolExhausted { pages: PAGES })),
                    }
                }
                Op::Load(k) => {
                    let got = pool.load_into(&ns, &key(k), out).unwrap();
                    prop_assert_eq!(got.is_some(), model.pos(k).is_some());
                    if let Some(ev) = got {
                        dev.wait(&ev).unwrap();
                        prop_assert_eq!(dev.read_sync(out).unwrap(), vec![k + 100; PAGE]);
                        model.touch(k);
                    }
                }
                Op::Pin(k) => {
                    let got = pool.pin(&ns, &key(k));
                    match model.pos(k) {
                        Some(i) => { model.order[i].1 += 1; prop_assert_eq!(got, Ok(model.order[i].1)); }
                        None => prop_assert_eq!(got, Err(AgentError::NotResident)),
                    }
                }
                Op::Unpin(k) => {
                    let got = pool.unpin(&ns, &key(k));
                    match model.pos(k) {
                        Some(i) if model.order[i].1 > 0 => {
                            model.order[i].1 -= 1;
                            prop_assert_eq!(got, Ok(model.order[i].1));
                            if model.order[i].1 == 0 { model.touch(k); }
                        }
                        Some(_) => prop_assert_eq!(got, Err(AgentError::NotPinned)),
                        None => prop_assert_eq!(got, Err(AgentError::NotResident)),
                    }
                }
                Op::Remove(k) => {
                    let got = pool.remove(&ns, &key(k));
                    match model.pos(k) {
                        Some(i) if model.order[i].1 > 0 => prop_assert_eq!(got, Err(AgentError::Pinned)),
                        Some(i) => { model.order.remove(i); prop_assert_eq!(got, Ok(())); }
                        None => prop_assert_eq!(got, Err(AgentError::NotResident)),
                    }
                }
            }
            let mut resident: Vec<u8> = pool.keys().iter().map(|(_, k)| k.0[0]).collect();
            resident.sort();
            let mut want: Vec<u8> = model.order.iter().map(|(k, _)| *k).collect();
            want.sort();
            prop_assert_eq!(resident, want);
        }
        let spilled = pool.spill_target().received();
        prop_assert_eq!(spilled.iter().map(|b| b.key.1 .0[0]).collect::<Vec<_>>(), model.spilled.clone());
        for b in spilled {
            prop_assert_eq!(b.payload, vec![b.key.1 .0[0] + 100; PAGE]);
        }
        let s = pool.stats();
        prop_assert_eq!(s.spills as usize, model.spilled.len());
        prop_assert_eq!(s.pinned, model.order.iter().filter(|(_, p)| *p > 0).count());
    }
}
