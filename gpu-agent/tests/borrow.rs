//! Borrowing HBM from a peer GPU on two host devices, with the policy and the copies wired by
//! hand (the agent does this itself through `pool::NodePool`; see `engine/tests.rs`): the policy
//! decides, the page is allocated on the lender and filled with a peer copy, the bytes go to the
//! link monitor, and the page reads back; once the link is busy the policy declines (recompute).

use std::time::{Duration, Instant};

use kvtier_agent::policy::{BorrowConfig, Decision, DeclineReason, PeerPolicy};
use kvtier_agent::{Device, DeviceBuf, HostDevice};

const HBM: usize = 1 << 20;
const PAGE: usize = 64 << 10;

#[test]
fn a_full_gpu_borrows_a_peer_page_until_the_link_budget_says_recompute() {
    let t0 = Instant::now();
    // GPU 7 is larger: its 20% share has room for 12 pages, so the link is what limits borrowing.
    let (g3, g7) = (HostDevice::new(3, HBM), HostDevice::new(7, 4 * HBM));
    let mut policy = PeerPolicy::new(BorrowConfig::default().with_window(Duration::from_secs(1))).unwrap();
    policy.add_gpu(3, HBM as u64).unwrap();
    policy.add_gpu(7, 4 * HBM as u64).unwrap();
    // A modelled link that moves 1 MiB per second: 30% of it is ~307 KiB per window.
    policy.add_link(3, 7, HBM as u64).unwrap();

    let stream = g3.new_stream().unwrap();
    let engine = g3.alloc(PAGE).unwrap();
    let mut local: Vec<DeviceBuf> = Vec::new();
    let mut borrowed: Vec<DeviceBuf> = Vec::new();
    let mut declined = None;
    for i in 0..16u8 {
        let now = t0 + Duration::from_millis(10 * i as u64);
        g3.write_sync(engine.all(), &vec![i; PAGE]).unwrap();
        let d = policy.decide(3, PAGE as u64, now).unwrap();
        match &d {
            Decision::Local => {
                let p = g3.alloc(PAGE).unwrap();
                g3.copy_d2d(&stream, engine.all(), p.all()).unwrap();
                local.push(p);
            }
            Decision::Borrow { from: 7, link_use } => {
                assert!(*link_use <= 0.3);
                let p = g7.alloc(PAGE).unwrap();
                g3.copy_peer(&stream, &g3, engine.all(), &g7, p.all()).unwrap();
                borrowed.push(p);
            }
            Decision::Borrow { from, .. } => panic!("borrowed from unknown GPU {from}"),
            Decision::Reclaim => panic!("GPU 3 lent nothing, so it has nothing to reclaim"),
            Decision::Decline(why) => {
                declined = Some((i, why.clone()));
                break;
            }
        }
        policy.commit(3, PAGE as u64, &d, now).unwrap();
        g3.wait(&g3.record(&stream).unwrap()).unwrap();
    }
    // 20% of 1 MiB holds 3 pages of 64 KiB; the link budget allows 4 more (4 × 64 KiB ≤ 307 KiB).
    assert_eq!((local.len(), borrowed.len()), (3, 4));
    let (at, why) = declined.expect("the link budget declines the eighth page");
    assert_eq!(at, 7);
    assert!(matches!(why, DeclineReason::LinkBudget { best } if best > 0.3));
    assert_eq!(policy.borrowed(3, 7), 4 * PAGE as u64);

    // The borrowed pages hold exactly what was written: read them back over the link.
    let back = g3.alloc(PAGE).unwrap();
    for (k, p) in borrowed.iter().enumerate() {
        g3.copy_peer(&stream, &g7, p.all(), &g3, back.all()).unwrap();
        g3.wait(&g3.record(&stream).unwrap()).unwrap();
        assert_eq!(g3.read_sync(back.all()).unwrap(), vec![3 + k as u8; PAGE], "borrowed page {k}");
    }
    for (k, p) in local.iter().enumerate() {
        assert_eq!(g3.read_sync(p.all()).unwrap(), vec![k as u8; PAGE], "local page {k}");
    }

    // A window later the link is quiet again and borrowing resumes; returning pages frees room.
    let later = t0 + Duration::from_secs(2);
    assert!(matches!(policy.decide(3, PAGE as u64, later).unwrap(), Decision::Borrow { from: 7, .. }));
    for p in borrowed.drain(..) {
        g7.free(p).unwrap();
        policy.release(3, 7, PAGE as u64).unwrap();
    }
    assert_eq!(policy.borrowed(3, 7), 0);
    assert_eq!(g7.mem_info().unwrap().free, 4 * HBM);
}
