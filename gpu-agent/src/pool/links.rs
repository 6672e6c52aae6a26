//! The node's links, found rather than declared: which pairs of devices reach each other's memory
//! directly (peer access turned on, [`Device::enable_peer_access`]) and how fast — a configured
//! rate, or timed peer copies each way. What [`NodePool`](super::NodePool) budgets borrowing
//! against: a pair without peer access gets no link, so neither device borrows from the other.
//! A pair that fails to link (no peer path, a driver error, a probe that does not fit) is left
//! unlinked with the reason: the node runs with the links it has.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::NodeLink;
use crate::device::{Device, DeviceBuf, DeviceOrdinal};
use crate::error::{AgentError, Result};

/// Timed rounds per direction; the link's rate is the median round's.
const PROBE_ROUNDS: usize = 5;
/// Copies enqueued back to back in one round, waited for once: the enqueue and the wake-up are
/// paid once per round, not per copy (tens of µs beside a 64 MiB copy's ~150 µs over NVLink).
const COPIES_PER_ROUND: u32 = 4;

/// How a link's bandwidth is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkRate {
    /// Every link carries this many bytes per second (configured, or the host backend's model).
    Fixed(u64),
    /// Timed peer copies of this many bytes each way (after one untimed copy); the link's rate
    /// is the slower direction's median.
    Measured { bytes: usize },
}

/// The links of a node's devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FoundLinks {
    /// Pairs with peer access both ways, with their rate.
    pub links: Vec<NodeLink>,
    /// Pairs without one: they copy through the host and never borrow from each other.
    pub unlinked: Vec<Unlinked>,
}

/// A pair of devices left without a link (lower ordinal first), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unlinked {
    pub a: DeviceOrdinal,
    pub b: DeviceOrdinal,
    pub why: String,
}

/// Turns on peer access between every pair of `devices` (both ways) and rates the pairs that
/// have it. Measuring allocates `bytes` on each device of a pair for the time of its copies.
/// An error only for a zero-byte probe; a pair that fails is [`FoundLinks::unlinked`].
pub fn find_links<D: Device>(devices: &[Arc<D>], rate: LinkRate) -> Result<FoundLinks> {
    if let LinkRate::Measured { bytes: 0 } = rate {
        return Err(AgentError::Config("a link is measured with copies of at least one byte".into()));
    }
    let mut found = FoundLinks::default();
    for (i, a) in devices.iter().enumerate() {
        for b in &devices[i + 1..] {
            let (lo, hi) = (a.ordinal().min(b.ordinal()), a.ordinal().max(b.ordinal()));
            match link(a, b, rate) {
                Ok(bytes_per_sec) => found.links.push(NodeLink { a: lo, b: hi, bytes_per_sec: bytes_per_sec.max(1) }),
                Err(why) => found.unlinked.push(Unlinked { a: lo, b: hi, why }),
            }
        }
    }
    Ok(found)
}

/// Peer access both ways between `a` and `b` and the link's rate; why not, when they can't be
/// linked (peer access turned on one way only is turned off again).
fn link<D: Device>(a: &Arc<D>, b: &Arc<D>, rate: LinkRate) -> std::result::Result<u64, String> {
    // Both ways: a borrow's fill runs on the borrower's stream, a load from a lent page on the
    // loader's.
    let ab = a.enable_peer_access(b).map_err(|e| format!("turning on peer access: {e}"))?;
    let ba = ab && b.enable_peer_access(a).map_err(|e| format!("turning on peer access: {e}"))?;
    if !(ab && ba) {
        if ab {
            // Best effort: a mapping left on costs one of the device's peer slots, nothing else.
            let _ = a.disable_peer_access(b);
        }
        return Err("no peer access (no direct path between them, or the driver's peer limit)".into());
    }
    match rate {
        LinkRate::Fixed(r) => Ok(r),
        LinkRate::Measured { bytes } => measure(a, b, bytes).map_err(|e| format!("measuring the link: {e}")),
    }
}

/// The slower direction's median rate of `bytes` copied between `a` and `b`, in bytes/s.
fn measure<D: Device>(a: &Arc<D>, b: &Arc<D>, bytes: usize) -> Result<u64> {
    let on_a = a.alloc(bytes)?;
    let on_b = match b.alloc(bytes) {
        Ok(buf) => buf,
        Err(e) => {
            a.free(on_a)?;
            return Err(e);
        }
    };
    let timed = time_both_ways(a.as_ref(), on_a, b.as_ref(), on_b);
    // Freed whatever the copies did: `free` waits for copies still in flight.
    let freed = a.free(on_a).and(b.free(on_b));
    let (ab, ba) = timed?;
    freed?;
    let slower = ab.max(ba).as_secs_f64().max(1e-9);
    Ok((bytes as f64 * f64::from(COPIES_PER_ROUND) / slower) as u64)
}

/// The median time of a round of copies from `a` to `b` (on `a`'s stream) and from `b` to `a`
/// (on `b`'s).
fn time_both_ways<D: Device>(a: &D, on_a: DeviceBuf, b: &D, on_b: DeviceBuf) -> Result<(Duration, Duration)> {
    let (sa, sb) = (a.new_stream()?, b.new_stream()?);
    let copy = |dev: &D, stream: &D::Stream, from: (&D, DeviceBuf), to: (&D, DeviceBuf)| -> Result<Duration> {
        let t = Instant::now();
        for _ in 0..COPIES_PER_ROUND {
            dev.copy_peer(stream, from.0, from.1.all(), to.0, to.1.all())?;
        }
        let done = dev.record(stream)?;
        dev.wait(&done)?;
        Ok(t.elapsed())
    };
    // One untimed round each way: the first pays for mappings and the driver's setup.
    copy(a, &sa, (a, on_a), (b, on_b))?;
    copy(b, &sb, (b, on_b), (a, on_a))?;
    let mut ab = Vec::with_capacity(PROBE_ROUNDS);
    let mut ba = Vec::with_capacity(PROBE_ROUNDS);
    for _ in 0..PROBE_ROUNDS {
        ab.push(copy(a, &sa, (a, on_a), (b, on_b))?);
        ba.push(copy(b, &sb, (b, on_b), (a, on_a))?);
    }
    ab.sort();
    ba.sort();
    Ok((ab[PROBE_ROUNDS / 2], ba[PROBE_ROUNDS / 2]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::HostDevice;

    fn devices(n: u32) -> Vec<Arc<HostDevice>> {
        (0..n).map(|o| Arc::new(HostDevice::new(o, 8 << 20))).collect()
    }

    #[test]
    fn every_pair_with_peer_access_gets_a_link_at_the_configured_rate() {
        let devs = devices(3);
        let found = find_links(&devs, LinkRate::Fixed(7_000)).unwrap();
        let pairs: Vec<_> = found.links.iter().map(|l| (l.a, l.b, l.bytes_per_sec)).collect();
        assert_eq!(pairs, [(0, 1, 7_000), (0, 2, 7_000), (1, 2, 7_000)]);
        assert!(found.unlinked.is_empty());
        assert_eq!(find_links(&devs[..1], LinkRate::Fixed(7_000)).unwrap(), FoundLinks::default(), "one device");
    }

    #[test]
    fn a_device_without_peer_access_is_left_unlinked() {
        let mut devs = devices(2);
        devs.insert(1, Arc::new(HostDevice::without_peer_access(5, 8 << 20)));
        let found = find_links(&devs, LinkRate::Fixed(1)).unwrap();
        assert_eq!(found.links.iter().map(|l| (l.a, l.b)).collect::<Vec<_>>(), [(0, 1)]);
        let pairs: Vec<_> = found.unlinked.iter().map(|u| (u.a, u.b)).collect();
        assert_eq!(pairs, [(0, 5), (1, 5)]);
        assert!(found.unlinked.iter().all(|u| u.why.contains("no peer access")), "{:?}", found.unlinked);
    }

    #[test]
    fn a_measured_link_is_rated_by_its_copies_and_gives_its_memory_back() {
        let devs = devices(2);
        let found = find_links(&devs, LinkRate::Measured { bytes: 1 << 20 }).unwrap();
        assert_eq!(found.links.len(), 1);
        // The host backend's peer copy is a memcpy: well above 10 MB/s, well below 10 TB/s.
        let rate = found.links[0].bytes_per_sec;
        assert!((10_000_000..10_000_000_000_000).contains(&rate), "{rate} B/s");
        for d in &devs {
            let m = d.mem_info().unwrap();
            assert_eq!(m.free, m.total, "device {} kept the probe's memory", d.ordinal());
        }
    }

    #[test]
    fn a_probe_that_does_not_fit_leaves_its_pair_unlinked_and_frees_what_it_took() {
        let devs = vec![
            Arc::new(HostDevice::new(0, 8 << 20)),
            Arc::new(HostDevice::new(1, 1 << 20)),
            Arc::new(HostDevice::new(2, 8 << 20)),
        ];
        let found = find_links(&devs, LinkRate::Measured { bytes: 4 << 20 }).unwrap();
        // Device 1 can't hold the probe; 0 and 2 still get their link.
        assert_eq!(found.links.iter().map(|l| (l.a, l.b)).collect::<Vec<_>>(), [(0, 2)]);
        assert_eq!(found.unlinked.iter().map(|u| (u.a, u.b)).collect::<Vec<_>>(), [(0, 1), (1, 2)]);
        assert!(found.unlinked.iter().all(|u| u.why.contains("out of device memory")), "{:?}", found.unlinked);
        for d in &devs {
            let m = d.mem_info().unwrap();
            assert_eq!(m.free, m.total, "device {} kept the probe's memory", d.ordinal());
        }
        assert!(matches!(find_links(&devs, LinkRate::Measured { bytes: 0 }), Err(AgentError::Config(_))));
    }
}
