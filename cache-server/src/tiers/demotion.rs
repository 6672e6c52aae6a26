//! Demotion: the DRAM eviction hook hands evicted blocks to a bounded queue (they stay findable
//! in the [`InTransitTier`] until they are on disk), one thread writes them out, and writers wait
//! while the queue is full ([`DemotionDepth`]: woken when a block leaves it, never by polling).
//!
//! A block purged while queued (its namespace purged or unregistered) is not written. The thread
//! checks that, writes the block and takes it out of the queue's index holding the disk's write
//! gate ([`DiskTier::writes`]), which a purge or an unregistration holds while it takes its mark
//! and purges the queue ([`super::TierStack::invalidate`]): a block is written before the mark
//! (dropped at recovery) or not at all, never after it, where a restart would find it again under
//! the namespace registered anew. Re-encoding runs before, outside the gate.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::InTransitTier;
use crate::disk::{self, DiskTier};
use crate::dram::{self, DramTier};

/// Blocks waiting to be demoted from DRAM to disk at most; past that an eviction is dropped.
pub const DEMOTION_QUEUE: usize = 64;
/// The depth at which writers wait for room: half the queue, the other half left for the
/// evictions of writers already past their check (each has room for its block when it looks, and
/// several evict at once), so that they are queued and not dropped.
const WRITERS_WAIT_AT: usize = DEMOTION_QUEUE / 2;

/// Address space the DRAM region needs beyond its capacity for blocks evicted and still queued
/// for disk (their slots are no longer counted against the cap but stay in use until written):
/// a full queue of the largest blocks. Only address space: the region touches pages as used.
pub fn queue_headroom(capacity: u64, max_block: u64) -> u64 {
    DEMOTION_QUEUE as u64 * max_block.min(capacity)
}

/// The demotion queue's depth: counted by the eviction hook and the demotion thread, published
/// as `kvtier_disk_queue_depth`, and waited on by writers while the queue is full (woken when a
/// block leaves it, not by polling).
#[derive(Default)]
pub struct DemotionDepth {
    depth: AtomicUsize,
    room: tokio::sync::Notify,
    /// Keeps the hook and the writer from publishing out of order (which could leave the gauge
    /// showing a block that is gone).
    publish: Mutex<()>,
}

impl DemotionDepth {
    pub fn get(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }

    /// One block in (`up`) or out; publishes the gauge and wakes writers waiting for room.
    pub fn step(&self, up: bool) {
        let _order = self.publish.lock();
        let d = if up {
            self.depth.fetch_add(1, Ordering::Relaxed).saturating_add(1)
        } else {
            self.depth.fetch_sub(1, Ordering::Relaxed).saturating_sub(1)
        };
        ::metrics::gauge!("kvtier_disk_queue_depth").set(d as f64);
        if !up {
            // One writer per block gone, not all of them at once (each would evict a block).
            self.room.notify_one();
        }
    }

    /// Whether writers wait now: the demotion thread then writes blocks out as they came rather
    /// than spend time re-encoding them.
    fn backed_up(&self) -> bool {
        self.get() >= WRITERS_WAIT_AT
    }

    /// Waits until the queue has room (below [`WRITERS_WAIT_AT`]) or `deadline` passes.
    pub async fn wait_for_room(&self, deadline: tokio::time::Instant) {
        loop {
            let woken = self.room.notified();
            tokio::pin!(woken);
            // Registered before the check, so a block leaving in between still wakes us.
            woken.as_mut().enable();
            if !self.backed_up() {
                // A notification taken by `woken` but not awaited passes to the next writer
                // when it drops (tokio's `Notify`).
                return;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                return;
            }
        }
    }
}

/// Wires DRAM evictions to the disk tier: the eviction hook hands blocks to a bounded queue
/// (dropping, and counting, what doesn't fit — data-plane writers wait while it is full, so that
/// is rare) and one thread writes them out ([`write_demoted`]). A queued block stays findable in
/// `transit` until it is on disk. The queue closes when the hook is removed from `dram`.
pub fn start(
    dram: &DramTier,
    transit: &InTransitTier,
    disk: Arc<DiskTier>,
    depth: Arc<DemotionDepth>,
    codec: Option<kvtier_proto::CodecId>,
    keep_as_sent: KeepAsSent,
) -> Option<std::thread::JoinHandle<()>> {
    // Each block with whether it must be written as it was sent (see [`KeepAsSent`]).
    let (tx, rx) = std::sync::mpsc::sync_channel::<(dram::StoredBlock, bool)>(DEMOTION_QUEUE);
    let hook_depth = depth.clone();
    let probe = disk.clone();
    let (hook_transit, transit) = (transit.clone(), transit.clone());
    // Runs under the DRAM tier's lock (one call at a time), so the block is findable here before
    // DRAM forgets it.
    let hook: dram::EvictionHook = Arc::new(move |_key, block| {
        // On disk already (a parked session's block): nothing more to write.
        if probe.contains(&block.header.namespace, &block.header.key) {
            return;
        }
        // Its tenant holds its disk quota, counting its blocks queued: its own block goes,
        // nobody else's. Counted against the quota from here until written or dropped.
        let (ns, bytes) = (block.header.namespace, block.payload.len() as u64);
        if !probe.reserve_demotion(&ns, bytes) {
            ::metrics::counter!("kvtier_disk_demotions_over_quota_total").increment(1);
            return;
        }
        // An earlier copy of the same key is queued: that one will be written.
        if !hook_transit.admit(&block) {
            probe.release_demotion(&ns, bytes);
            return;
        }
        // Decided here, under the DRAM lock, while the block's lease (if any) still stands.
        let as_sent = keep_as_sent(&block.header.namespace, &block.header.key);
        // Findable and counted before the send, so the writer's removal can never run first.
        hook_depth.step(true);
        if let Err(e) = tx.try_send((block, as_sent)) {
            let (block, _) = match e {
                std::sync::mpsc::TrySendError::Full(b) | std::sync::mpsc::TrySendError::Disconnected(b) => b,
            };
            hook_transit.finish(&block);
            probe.release_demotion(&ns, bytes);
            hook_depth.step(false);
            ::metrics::counter!("kvtier_disk_demotions_dropped_total").increment(1)
        }
    });
    dram.set_eviction_hook(Some(hook));
    // Present from the start (it was absent until the first demotion).
    ::metrics::gauge!("kvtier_disk_queue_depth").set(depth.get() as f64);
    std::thread::Builder::new()
        .name("kvtier-demote".into())
        .spawn(move || {
            // A full or failing disk fails every write: say so once per 10 s, count them all.
            let said = crate::metrics::LogThrottle::new(Duration::from_secs(10));
            for (block, as_sent) in rx {
                let reserved = (block.header.namespace, block.payload.len() as u64);
                // Re-encoding costs CPU; when the queue backs up, blocks go out as they came
                // rather than be dropped for want of room.
                let busy = depth.backed_up();
                match demote(&disk, &transit, codec.filter(|_| !as_sent), busy, &block) {
                    Demotion::Written { recoded } => {
                        ::metrics::counter!("kvtier_disk_demotions_total").increment(1);
                        if let Some(saved) = recoded {
                            ::metrics::counter!("kvtier_disk_recoded_total").increment(1);
                            ::metrics::counter!("kvtier_disk_recode_saved_bytes_total").increment(saved);
                        }
                    }
                    Demotion::Failed(e) => {
                        ::metrics::counter!("kvtier_disk_demotions_failed_total").increment(1);
                        if let Some(held_back) = said.allow() {
                            tracing::warn!("demotion to disk failed ({} since the last warning): {e}", held_back + 1);
                        }
                    }
                    Demotion::Purged => {}
                }
                // Counted as held now (if written): no longer as queued.
                disk.release_demotion(&reserved.0, reserved.1);
                depth.step(false);
            }
        })
        .map_err(|e| tracing::error!("cannot start the demotion thread: {e}"))
        .ok()
}

/// Whether a block evicted from DRAM must reach the disk as it was sent, never re-encoded with
/// the disk codec: a block a session's park has leased (a parked session's blocks are kept as
/// sent, see [`super::TierStack::pin_lease`]).
pub type KeepAsSent = Arc<dyn Fn(&kvtier_proto::NamespaceId, &kvtier_proto::BlockKey) -> bool + Send + Sync>;

/// What became of one queued block.
enum Demotion {
    /// On disk (or nothing to write: on disk already, or damaged and dropped); `recoded`: the
    /// payload bytes re-encoding saved, when it was.
    Written {
        recoded: Option<u64>,
    },
    Failed(crate::error::ServerError),
    /// Purged (or its namespace unregistered) while queued: not written.
    Purged,
}

/// Writes one queued block to disk, unless it was purged meanwhile. It is re-encoded first
/// ([`encode_demoted`], outside the gate); then checked again, written and taken out of the
/// queue's index holding the disk's write gate's read side (an uncontended read lock), so that no
/// purge or unregistration, and no mark, comes in between (see the module docs).
fn demote(
    disk: &DiskTier,
    transit: &InTransitTier,
    codec: Option<kvtier_proto::CodecId>,
    busy: bool,
    block: &dram::StoredBlock,
) -> Demotion {
    if !transit.is_current(block) {
        return Demotion::Purged;
    }
    let demoted = encode_demoted(disk, codec, busy, block);
    let writes = disk.writes();
    if !transit.is_current(block) {
        return Demotion::Purged;
    }
    let done = match &demoted {
        Some(d) => match writes.write(&d.header, &d.payload) {
            Ok(()) => Demotion::Written { recoded: d.recoded },
            Err(e) => Demotion::Failed(e),
        },
        None => Demotion::Written { recoded: None },
    };
    // On disk now (or lost with the write): only this copy's entry goes. Had other hands taken it
    // meanwhile (not a purge: that waits for the gate), the written copy goes too.
    if !transit.finish(block) {
        disk.remove(&block.header.namespace, &block.header.key);
    }
    done
}

/// A block evicted from DRAM as it goes to disk.
struct Demoted {
    header: kvtier_proto::FrameHeader,
    payload: bytes::Bytes,
    /// Re-encoded with the disk codec: the payload bytes that saved.
    recoded: Option<u64>,
}

/// What to write to disk for one block evicted from DRAM: `None` when nothing is (on disk
/// already, or damaged). It is verified first: a block damaged in memory is dropped (and
/// counted), never given a fresh checksum by re-encoding. A lossless block is re-encoded with the
/// disk codec when one is set and the queue is not `busy`.
fn encode_demoted(
    disk: &DiskTier,
    codec: Option<kvtier_proto::CodecId>,
    busy: bool,
    block: &dram::StoredBlock,
) -> Option<Demoted> {
    use disk::recode::{recode, Recoded};
    let h = &block.header;
    if h.verify_payload(&block.payload).is_err() {
        ::metrics::counter!("kvtier_disk_demotions_corrupt_total").increment(1);
        tracing::error!(key = %h.key, "a block evicted from DRAM failed its checksum; not demoted");
        return None;
    }
    if disk.contains(&h.namespace, &h.key) {
        return None;
    }
    let eligible = codec.filter(|c| kvtier_kernels::is_lossless(h.codec) && h.codec != *c);
    if eligible.is_some() && busy {
        ::metrics::counter!("kvtier_disk_recode_skipped_busy_total").increment(1);
    }
    let recoded = eligible.filter(|_| !busy).map(|c| {
        // A codec bug must not stop the demotion thread (every writer would then wait on it).
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| recode(c, h, &block.payload)))
            .unwrap_or_else(|_| Recoded::Refused("the codec panicked".into()))
    });
    let as_sent = Demoted { header: *h, payload: block.payload.clone(), recoded: None };
    Some(match recoded {
        Some(Recoded::Encoded(nh, p)) => {
            Demoted { header: nh, payload: p, recoded: Some(h.payload_len.saturating_sub(nh.payload_len)) }
        }
        Some(Recoded::Refused(why)) => {
            ::metrics::counter!("kvtier_disk_recode_refused_total").increment(1);
            tracing::debug!(key = %h.key, "disk codec refused a block, written as it came: {why}");
            as_sent
        }
        Some(Recoded::Kept) | None => as_sent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writers at a backed-up queue wait, and each block leaving lets one of them go, not all:
    /// many writers hammering a slow demotion thread never push the queue past its capacity
    /// (an eviction past it would be dropped).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_writers_at_a_slow_queue_never_overflow_it() {
        let depth = Arc::new(DemotionDepth::default());
        for _ in 0..WRITERS_WAIT_AT {
            depth.step(true);
        }
        let far = tokio::time::Instant::now() + Duration::from_secs(30);
        let waiting = tokio::spawn({
            let depth = depth.clone();
            async move { depth.wait_for_room(far).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "a writer at a backed-up queue waits");
        depth.step(false);
        tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();

        // 48 writers, each evicting a block whenever it is let go; a demotion thread taking one
        // every 200 µs.
        let (writers, rounds) = (48usize, 40usize);
        let peak = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let drain = {
            let (depth, stop) = (depth.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) || depth.get() > 0 {
                    if depth.get() > 0 {
                        depth.step(false);
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        let tasks: Vec<_> = (0..writers)
            .map(|_| {
                let (depth, peak) = (depth.clone(), peak.clone());
                tokio::spawn(async move {
                    for _ in 0..rounds {
                        depth.wait_for_room(far).await;
                        depth.step(true);
                        peak.fetch_max(depth.get(), Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(60), t).await.unwrap().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        drain.join().unwrap();
        let peak = peak.load(Ordering::Relaxed);
        assert!(peak >= WRITERS_WAIT_AT, "the queue backed up ({peak})");
        assert!(peak <= DEMOTION_QUEUE, "{writers} writers pushed the queue to {peak}, past {DEMOTION_QUEUE}");
    }
}
