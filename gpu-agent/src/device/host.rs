//! The host backend: a [`Device`] whose "device memory" is ordinary RAM and whose streams are
//! worker threads, one per stream, fed through a bounded queue. Copies and codec launches run on
//! the worker, so an event really completes later than the call that enqueued the work, in stream
//! order, as on a GPU. It checks everything the CUDA backend checks (bounds, freed and foreign
//! handles, registration, capacity), so code tested here meets the same errors there.
//!
//! Codec launches run `kvtier-kernels`' CPU codec, the reference the CUDA kernels match.

use std::collections::HashMap;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;

use kvtier_kernels::payload::PAYLOAD_HEADER_LEN;
use kvtier_kernels::{Codec, KvBlockView};
use parking_lot::{Condvar, Mutex, RwLock};

use super::shm::{self, Storage};
use super::{
    check_lengths, check_no_overlap, CodecOp, Device, DeviceBuf, DeviceOrdinal, DeviceRange, HostBuffer, HostMem,
    HostRange, IpcHandle, MemInfo, Registration, Transfer,
};
use crate::codec::payload_header;
use crate::error::{AgentError, Result};

/// Depth of a stream's queue (operations, not bytes) unless [`HostDevice::with_queue_depth`] says
/// otherwise.
pub const DEFAULT_QUEUE_DEPTH: usize = 4096;

type Mem = Arc<RwLock<Storage>>;

/// A host-memory device. Cloning shares it.
///
/// ```
/// use kvtier_agent::{Device, HostBuffer, HostDevice};
/// let dev = HostDevice::new(0, 1 << 20);
/// let host = HostBuffer::from_vec(vec![7u8; 64]);
/// let _reg = dev.register_host(&host).unwrap();
/// let page = dev.alloc(64).unwrap();
/// let stream = dev.new_stream().unwrap();
/// dev.copy_h2d(&stream, &host.range(0, 64), page.all()).unwrap();
/// let done = dev.record(&stream).unwrap();
/// dev.wait(&done).unwrap();
/// assert_eq!(dev.read_sync(page.all()).unwrap(), vec![7u8; 64]);
/// ```
#[derive(Clone)]
pub struct HostDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: DeviceOrdinal,
    instance: u64,
    capacity: usize,
    queue_depth: usize,
    /// Whether peers may reach this device's memory directly ([`Device::enable_peer_access`]).
    peer_access: bool,
    table: Mutex<Table>,
}

struct Table {
    next_id: u64,
    /// Allocations and imports; `true` for imported memory (not counted in `used`).
    live: HashMap<u64, (Mem, bool)>,
    used: usize,
}

/// Memory exported by host devices of this process, by handle bytes: the host backend's stand-in
/// for the driver's IPC table.
static EXPORTS: std::sync::OnceLock<Mutex<HashMap<[u8; 64], Mem>>> = std::sync::OnceLock::new();

/// Makes every host device's handles distinct from every other's.
static NEXT_INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

const IPC_MAGIC: &[u8; 8] = b"KVHOSTIP";

fn exports() -> &'static Mutex<HashMap<[u8; 64], Mem>> {
    EXPORTS.get_or_init(|| Mutex::new(HashMap::new()))
}

impl HostDevice {
    /// A device numbered `ordinal` with `capacity` bytes of "device memory" and streams of
    /// [`DEFAULT_QUEUE_DEPTH`] operations.
    pub fn new(ordinal: DeviceOrdinal, capacity: usize) -> Self {
        Self::with_queue_depth(ordinal, capacity, DEFAULT_QUEUE_DEPTH)
    }

    /// As [`HostDevice::new`], with streams that hold `depth` operations before enqueueing blocks
    /// (backpressure, as a GPU's push buffer). A depth below 1 becomes 1.
    pub fn with_queue_depth(ordinal: DeviceOrdinal, capacity: usize, depth: usize) -> Self {
        Self::build(ordinal, capacity, depth, true)
    }

    fn build(ordinal: DeviceOrdinal, capacity: usize, depth: usize, peer_access: bool) -> Self {
        HostDevice {
            inner: Arc::new(Inner {
                ordinal,
                instance: NEXT_INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                capacity,
                queue_depth: depth.max(1),
                peer_access,
                table: Mutex::new(Table { next_id: 1, live: HashMap::new(), used: 0 }),
            }),
        }
    }

    /// As [`HostDevice::new`], for a device with no direct path to any other (a GPU behind
    /// another PCIe root, without P2P): [`Device::enable_peer_access`] says false both ways, so
    /// the node declares no link to it. Copies to and from it still work.
    pub fn without_peer_access(ordinal: DeviceOrdinal, capacity: usize) -> Self {
        Self::build(ordinal, capacity, DEFAULT_QUEUE_DEPTH, false)
    }

    /// An event that the host completes by hand ([`EventTrigger::complete`]): the stand-in for
    /// "this layer's source bytes have arrived", and a test gate.
    pub fn user_event(&self) -> (HostEvent, EventTrigger) {
        let c = Arc::new(Completion::default());
        (HostEvent(c.clone()), EventTrigger(c))
    }

    fn lookup(&self, buf: &DeviceBuf) -> Result<Mem> {
        if buf.device() != self.inner.ordinal {
            return Err(AgentError::WrongDevice { expected: self.inner.ordinal, found: buf.device() });
        }
        let t = self.inner.table.lock();
        match t.live.get(&buf.id()) {
            Some((m, _)) => Ok(m.clone()),
            None if buf.id() < t.next_id => Err(AgentError::FreedHandle(buf.id())),
            None => Err(AgentError::UnknownHandle(buf.id())),
        }
    }

    fn range_mem(&self, r: &DeviceRange, what: &'static str) -> Result<Mem> {
        let m = self.lookup(&r.buf)?;
        r.check(what)?;
        Ok(m)
    }

    fn check_stream(&self, s: &HostStream) -> Result<()> {
        if s.device != self.inner.ordinal {
            return Err(AgentError::WrongDevice { expected: self.inner.ordinal, found: s.device });
        }
        Ok(())
    }
}

/// Where a [`HostEvent`] stands.
#[derive(Default)]
struct Completion {
    state: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl Completion {
    fn complete(&self, r: Result<()>) {
        let mut s = self.state.lock();
        if s.is_none() {
            *s = Some(r);
            self.cv.notify_all();
        }
    }

    fn wait(&self) -> Result<()> {
        let mut s = self.state.lock();
        loop {
            if let Some(r) = s.as_ref() {
                return r.clone();
            }
            self.cv.wait(&mut s);
        }
    }

    fn query(&self) -> Result<bool> {
        match self.state.lock().as_ref() {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(e.clone()),
        }
    }
}

/// An event of the host backend.
#[derive(Clone)]
pub struct HostEvent(Arc<Completion>);

impl std::fmt::Debug for HostEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostEvent({:?})", self.0.state.lock().as_ref().map(|r| r.is_ok()))
    }
}

/// Completes a [`HostDevice::user_event`]. Dropping it without completing completes the event
/// with [`AgentError::StreamClosed`], so nothing waits forever.
pub struct EventTrigger(Arc<Completion>);

impl EventTrigger {
    /// Completes the event (successfully, or with `Err`).
    pub fn complete(self, r: Result<()>) {
        self.0.complete(r);
    }
}

impl Drop for EventTrigger {
    fn drop(&mut self) {
        self.0.complete(Err(AgentError::StreamClosed));
    }
}

enum Op {
    Run(Box<dyn FnOnce() -> Result<()> + Send>),
    Record(Arc<Completion>),
    Wait(Arc<Completion>),
}

/// A stream of the host backend: a worker thread and a bounded queue. Dropping it lets the
/// worker finish what was enqueued and exit.
pub struct HostStream {
    device: DeviceOrdinal,
    tx: SyncSender<Op>,
}

impl HostStream {
    fn send(&self, op: Op) -> Result<()> {
        self.tx.send(op).map_err(|_| AgentError::StreamClosed)
    }
}

fn worker(rx: Receiver<Op>) {
    // The first failure since the last recorded event; reported to the next one.
    let mut failed: Option<AgentError> = None;
    while let Ok(op) = rx.recv() {
        match op {
            Op::Run(f) => {
                if let Err(e) = f() {
                    failed.get_or_insert(e);
                }
            }
            Op::Record(c) => c.complete(failed.take().map_or(Ok(()), Err)),
            // A stream waiting on an event does not inherit its error (as cuStreamWaitEvent).
            Op::Wait(c) => {
                let _ = c.wait();
            }
        }
    }
}

/// Runs `f` with `src` locked for reading and `dst` for writing, taking the two locks in address
/// order so that two streams copying in opposite directions cannot deadlock. Same lock: `f` gets
/// one slice as both (the caller copies within it).
fn with_two(src: &RwLock<Storage>, dst: &RwLock<Storage>, f: impl FnOnce(Option<&[u8]>, &mut [u8])) {
    if std::ptr::eq(src, dst) {
        f(None, &mut dst.write());
        return;
    }
    if (src as *const _ as usize) < (dst as *const _ as usize) {
        let s = src.read();
        let mut d = dst.write();
        f(Some(&s), &mut d);
    } else {
        let mut d = dst.write();
        let s = src.read();
        f(Some(&s), &mut d);
    }
}

fn copy_between(src: &RwLock<Storage>, so: usize, dst: &RwLock<Storage>, doff: usize, len: usize) {
    with_two(src, dst, |s, d| match s {
        Some(s) => d[doff..doff + len].copy_from_slice(&s[so..so + len]),
        None => d.copy_within(so..so + len, doff),
    });
}

/// One side of a checked copy: a host buffer's memory or a device allocation.
enum Side {
    Host(Arc<HostMem>),
    Dev(Mem),
}

impl Side {
    fn lock(&self) -> &RwLock<Storage> {
        match self {
            Side::Host(h) => &h.data,
            Side::Dev(d) => d,
        }
    }
}

/// A copy that passed every check, holding both memories alive until it has run.
struct Prepared {
    src: Side,
    src_off: usize,
    dst: Side,
    dst_off: usize,
    len: usize,
}

impl Prepared {
    fn run(&self) {
        copy_between(self.src.lock(), self.src_off, self.dst.lock(), self.dst_off, self.len);
    }
}

impl HostDevice {
    /// Checks a copy as the CUDA backend does (registration, bounds, handles, lengths, overlap).
    fn prepare(&self, t: &Transfer) -> Result<Prepared> {
        let host = |r: &HostRange| -> Result<Side> {
            r.buf.require_registered(self.inner.ordinal)?;
            r.check()?;
            Ok(Side::Host(r.buf.mem().clone()))
        };
        Ok(match t {
            Transfer::HostToDevice { src, dst } => {
                let s = host(src)?;
                let d = self.range_mem(dst, "device destination")?;
                check_lengths(src.len, dst.len)?;
                Prepared { src: s, src_off: src.offset, dst: Side::Dev(d), dst_off: dst.offset, len: dst.len }
            }
            Transfer::DeviceToHost { src, dst } => {
                let d = host(dst)?;
                let s = self.range_mem(src, "device source")?;
                check_lengths(src.len, dst.len)?;
                Prepared { src: Side::Dev(s), src_off: src.offset, dst: d, dst_off: dst.offset, len: src.len }
            }
            Transfer::DeviceToDevice { src, dst } => {
                let s = self.range_mem(src, "device source")?;
                let d = self.range_mem(dst, "device destination")?;
                check_lengths(src.len, dst.len)?;
                check_no_overlap(*src, *dst)?;
                Prepared {
                    src: Side::Dev(s),
                    src_off: src.offset,
                    dst: Side::Dev(d),
                    dst_off: dst.offset,
                    len: src.len,
                }
            }
            Transfer::Peer { src, dst } => return Err(super::peer_refused(self.inner.ordinal, src, dst)),
        })
    }
}

impl Device for HostDevice {
    type Stream = HostStream;
    type Event = HostEvent;

    fn ordinal(&self) -> DeviceOrdinal {
        self.inner.ordinal
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let used = self.inner.table.lock().used;
        Ok(MemInfo { free: self.inner.capacity - used, total: self.inner.capacity })
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuf> {
        let mut t = self.inner.table.lock();
        let free = self.inner.capacity - t.used;
        if len > free {
            return Err(AgentError::OutOfMemory { requested: len, free });
        }
        let id = t.next_id;
        t.next_id += 1;
        t.used += len;
        t.live.insert(id, (Arc::new(RwLock::new(Storage::Heap(vec![0u8; len].into_boxed_slice()))), false));
        Ok(DeviceBuf::new(self.inner.ordinal, id, len))
    }

    fn export_ipc(&self, buf: DeviceBuf) -> Result<IpcHandle> {
        let mem = self.lookup(&buf)?;
        if self.inner.table.lock().live.get(&buf.id()).is_some_and(|(_, imported)| *imported) {
            return Err(AgentError::BadIpcHandle("imported memory cannot be exported again".into()));
        }
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(IPC_MAGIC);
        bytes[8..16].copy_from_slice(&self.inner.instance.to_le_bytes());
        bytes[16..24].copy_from_slice(&buf.id().to_le_bytes());
        exports().lock().insert(bytes, mem);
        Ok(IpcHandle::from_bytes(bytes, buf.len()))
    }

    fn import_ipc(&self, handle: &IpcHandle) -> Result<DeviceBuf> {
        if let Some(mapped) = shm::import_shared(handle)? {
            let mut t = self.inner.table.lock();
            let id = t.next_id;
            t.next_id += 1;
            t.live.insert(id, (Arc::new(RwLock::new(mapped)), true));
            return Ok(DeviceBuf::new(self.inner.ordinal, id, handle.len()));
        }
        let mem =
            exports().lock().get(handle.bytes()).cloned().ok_or_else(|| {
                AgentError::BadIpcHandle("no memory exported under this handle in this process".into())
            })?;
        let real = mem.read().len();
        if handle.len() != real {
            return Err(AgentError::BadIpcHandle(format!("handle says {} bytes, the export is {real}", handle.len())));
        }
        let mut t = self.inner.table.lock();
        let id = t.next_id;
        t.next_id += 1;
        t.live.insert(id, (mem, true));
        Ok(DeviceBuf::new(self.inner.ordinal, id, real))
    }

    fn free(&self, buf: DeviceBuf) -> Result<()> {
        if buf.device() != self.inner.ordinal {
            return Err(AgentError::WrongDevice { expected: self.inner.ordinal, found: buf.device() });
        }
        let mut t = self.inner.table.lock();
        match t.live.remove(&buf.id()) {
            Some((_, imported)) => {
                if !imported {
                    t.used -= buf.len();
                    // Its exports die with it.
                    let (inst, id) = (self.inner.instance.to_le_bytes(), buf.id().to_le_bytes());
                    exports().lock().retain(|k, _| !(k[..8] == IPC_MAGIC[..] && k[8..16] == inst && k[16..24] == id));
                }
                Ok(())
            }
            None if buf.id() < t.next_id => Err(AgentError::FreedHandle(buf.id())),
            None => Err(AgentError::UnknownHandle(buf.id())),
        }
    }

    fn register_host(&self, buf: &HostBuffer) -> Result<Registration> {
        buf.register(self.inner.ordinal, None)
    }

    fn new_stream(&self) -> Result<HostStream> {
        let (tx, rx) = sync_channel(self.inner.queue_depth);
        std::thread::Builder::new()
            .name(format!("kvtier-hostdev{}-stream", self.inner.ordinal))
            .spawn(move || worker(rx))
            .map_err(|e| AgentError::Driver { op: "spawn stream worker", detail: e.to_string() })?;
        Ok(HostStream { device: self.inner.ordinal, tx })
    }

    fn copy_h2d(&self, stream: &HostStream, src: &HostRange, dst: DeviceRange) -> Result<()> {
        self.check_stream(stream)?;
        let c = self.prepare(&Transfer::HostToDevice { src: src.clone(), dst })?;
        stream.send(Op::Run(Box::new(move || {
            c.run();
            Ok(())
        })))
    }

    fn copy_d2h(&self, stream: &HostStream, src: DeviceRange, dst: &HostRange) -> Result<()> {
        self.check_stream(stream)?;
        let c = self.prepare(&Transfer::DeviceToHost { src, dst: dst.clone() })?;
        stream.send(Op::Run(Box::new(move || {
            c.run();
            Ok(())
        })))
    }

    fn copy_d2d(&self, stream: &HostStream, src: DeviceRange, dst: DeviceRange) -> Result<()> {
        self.check_stream(stream)?;
        let c = self.prepare(&Transfer::DeviceToDevice { src, dst })?;
        stream.send(Op::Run(Box::new(move || {
            c.run();
            Ok(())
        })))
    }

    fn enable_peer_access(&self, peer: &HostDevice) -> Result<bool> {
        Ok(Arc::ptr_eq(&self.inner, &peer.inner) || (self.inner.peer_access && peer.inner.peer_access))
    }

    fn copy_peer(
        &self,
        stream: &HostStream,
        src_dev: &HostDevice,
        src: DeviceRange,
        dst_dev: &HostDevice,
        dst: DeviceRange,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let s = src_dev.range_mem(&src, "peer source")?;
        let d = dst_dev.range_mem(&dst, "peer destination")?;
        check_lengths(src.len, dst.len)?;
        if Arc::ptr_eq(&s, &d) {
            check_no_overlap(src, dst)?;
        }
        let c =
            Prepared { src: Side::Dev(s), src_off: src.offset, dst: Side::Dev(d), dst_off: dst.offset, len: src.len };
        stream.send(Op::Run(Box::new(move || {
            c.run();
            Ok(())
        })))
    }

    fn copy_batch(&self, stream: &HostStream, transfers: &[Transfer]) -> Result<()> {
        self.check_stream(stream)?;
        let copies = transfers.iter().map(|t| self.prepare(t)).collect::<Result<Vec<_>>>()?;
        if copies.is_empty() {
            return Ok(());
        }
        stream.send(Op::Run(Box::new(move || {
            copies.iter().for_each(Prepared::run);
            Ok(())
        })))
    }

    fn launch_codec(&self, stream: &HostStream, op: &CodecOp) -> Result<()> {
        self.check_stream(stream)?;
        op.validate()?;
        let [a, b, st] = op.buffers();
        let (ma, mb, ms) = (self.range_mem(&a, "codec")?, self.range_mem(&b, "codec")?, self.range_mem(&st, "codec")?);
        let op = *op;
        stream.send(Op::Run(Box::new(move || {
            // The CPU reference on the worker; a coding failure sets the status word, as the
            // kernel does. Inputs are copied out first so no two locks are held at once.
            let (codec, seed, spec, _, _, _) = op.parts();
            let [input, output, _] = op.buffers();
            let cpu = Codec::new(codec).with_rotation_seed(seed).with_parallel_min_bytes(usize::MAX);
            let ok = if op.is_encode() {
                let src = ma.read()[input.offset..input.offset + input.len].to_vec();
                match KvBlockView::new(spec, &src).and_then(|v| cpu.encode(&v)) {
                    Ok(p) => {
                        mb.write()[output.offset..output.offset + output.len].copy_from_slice(&p[PAYLOAD_HEADER_LEN..]);
                        true
                    }
                    Err(_) => false,
                }
            } else {
                match payload_header(codec, &spec, seed) {
                    Some(mut payload) => {
                        payload.extend_from_slice(&ma.read()[input.offset..input.offset + input.len]);
                        let mut decoded = vec![0u8; output.len];
                        match cpu.decode_into(&payload, &spec, spec.dtype, &mut decoded) {
                            Ok(()) => {
                                mb.write()[output.offset..output.offset + output.len].copy_from_slice(&decoded);
                                true
                            }
                            Err(_) => false,
                        }
                    }
                    None => false,
                }
            };
            let word: u32 = if ok { 0 } else { 1 };
            ms.write()[st.offset..st.offset + 4].copy_from_slice(&word.to_le_bytes());
            Ok(())
        })))
    }

    fn record(&self, stream: &HostStream) -> Result<HostEvent> {
        self.check_stream(stream)?;
        let c = Arc::new(Completion::default());
        stream.send(Op::Record(c.clone()))?;
        Ok(HostEvent(c))
    }

    fn stream_wait(&self, stream: &HostStream, event: &HostEvent) -> Result<()> {
        self.check_stream(stream)?;
        stream.send(Op::Wait(event.0.clone()))
    }

    fn wait(&self, event: &HostEvent) -> Result<()> {
        event.0.wait()
    }

    fn query(&self, event: &HostEvent) -> Result<bool> {
        event.0.query()
    }

    fn read_sync(&self, src: DeviceRange) -> Result<Vec<u8>> {
        let m = self.range_mem(&src, "device source")?;
        let out = m.read()[src.offset..src.offset + src.len].to_vec();
        Ok(out)
    }

    fn write_sync(&self, dst: DeviceRange, bytes: &[u8]) -> Result<()> {
        let m = self.range_mem(&dst, "device destination")?;
        check_lengths(bytes.len(), dst.len)?;
        m.write()[dst.offset..dst.offset + dst.len].copy_from_slice(bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (HostDevice, HostStream, HostBuffer, Registration) {
        let dev = HostDevice::new(0, 1 << 20);
        let s = dev.new_stream().unwrap();
        let h = HostBuffer::from_vec((0..=255u8).collect());
        let r = dev.register_host(&h).unwrap();
        (dev, s, h, r)
    }

    #[test]
    fn meets_the_device_contract() {
        let dev = HostDevice::new(0, 1 << 20);
        super::super::conformance::copies_and_errors(&dev, &HostDevice::new(1, 1 << 20));
    }

    #[test]
    fn codec_launches_run_the_cpu_reference() {
        super::super::conformance::fp8_codec_matches_kvtier_kernels(&HostDevice::new(0, 16 << 20));
    }

    #[test]
    fn codec_launches_by_id_run_the_cpu_reference() {
        super::super::conformance::codecs_by_id_match_kvtier_kernels(&HostDevice::new(0, 16 << 20));
    }

    #[test]
    fn h2d_d2d_d2h_round_trip_is_exact() {
        let (dev, s, h, _r) = setup();
        let a = dev.alloc(256).unwrap();
        let b = dev.alloc(256).unwrap();
        let back = HostBuffer::new(256);
        let _r2 = dev.register_host(&back).unwrap();
        dev.copy_h2d(&s, &h.range(0, 256), a.all()).unwrap();
        dev.copy_d2d(&s, a.range(0, 128), b.range(128, 128)).unwrap();
        dev.copy_d2d(&s, a.range(128, 128), b.range(0, 128)).unwrap();
        dev.copy_d2h(&s, b.all(), &back.range(0, 256)).unwrap();
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        let want: Vec<u8> = (128..=255u8).chain(0..128).collect();
        assert_eq!(back.to_vec(), want);
    }

    #[test]
    fn copies_within_one_buffer() {
        let (dev, s, h, _r) = setup();
        let a = dev.alloc(256).unwrap();
        dev.copy_h2d(&s, &h.range(0, 16), a.range(0, 16)).unwrap();
        dev.copy_d2d(&s, a.range(0, 16), a.range(100, 16)).unwrap();
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        assert_eq!(dev.read_sync(a.range(100, 16)).unwrap(), (0..16u8).collect::<Vec<_>>());
        assert_eq!(dev.copy_d2d(&s, a.range(0, 16), a.range(8, 16)), Err(AgentError::Overlap));
    }

    #[test]
    fn events_complete_after_the_work_and_in_stream_order() {
        let (dev, s, h, _r) = setup();
        let a = dev.alloc(256).unwrap();
        let (gate, open) = dev.user_event();
        dev.stream_wait(&s, &gate).unwrap();
        dev.copy_h2d(&s, &h.range(0, 256), a.all()).unwrap();
        let ev = dev.record(&s).unwrap();
        // The stream is held at the gate: the copy has not run and the event is pending.
        assert_eq!(dev.query(&ev), Ok(false));
        assert_eq!(dev.read_sync(a.range(255, 1)).unwrap(), [0]);
        open.complete(Ok(()));
        dev.wait(&ev).unwrap();
        assert_eq!(dev.query(&ev), Ok(true));
        assert_eq!(dev.read_sync(a.range(255, 1)).unwrap(), [255]);
    }

    #[test]
    fn refused_copies_name_the_problem() {
        let (dev, s, h, _r) = setup();
        let a = dev.alloc(64).unwrap();
        let other = HostDevice::new(1, 1 << 20);
        let foreign = other.alloc(64).unwrap();
        assert!(matches!(
            dev.copy_h2d(&s, &h.range(0, 65), a.range(0, 65)),
            Err(AgentError::OutOfBounds { what: "device destination", .. })
        ));
        assert!(matches!(
            dev.copy_h2d(&s, &h.range(250, 10), a.range(0, 10)),
            Err(AgentError::OutOfBounds { what: "host", .. })
        ));
        assert_eq!(dev.copy_h2d(&s, &h.range(0, 8), a.range(0, 9)), Err(AgentError::LengthMismatch { src: 8, dst: 9 }));
        assert_eq!(dev.copy_d2d(&s, foreign.all(), a.all()), Err(AgentError::WrongDevice { expected: 0, found: 1 }));
        let other_stream = other.new_stream().unwrap();
        assert_eq!(dev.record(&other_stream).err(), Some(AgentError::WrongDevice { expected: 0, found: 1 }));
        let unpinned = HostBuffer::new(64);
        assert_eq!(
            dev.copy_d2h(&s, a.all(), &unpinned.range(0, 64)),
            Err(AgentError::NotRegistered { buffer: unpinned.id(), device: 0 })
        );
        dev.free(a).unwrap();
        assert_eq!(dev.copy_h2d(&s, &h.range(0, 8), a.range(0, 8)), Err(AgentError::FreedHandle(a.id())));
        assert_eq!(dev.free(a), Err(AgentError::FreedHandle(a.id())));
        let never = DeviceBuf::new(0, 999, 8);
        assert_eq!(dev.read_sync(never.all()), Err(AgentError::UnknownHandle(999)));
        // Nothing was enqueued by the refused calls: the stream is healthy.
        dev.wait(&dev.record(&s).unwrap()).unwrap();
    }

    #[test]
    fn registration_ends_when_dropped() {
        let (dev, s, h, r) = setup();
        let a = dev.alloc(8).unwrap();
        assert!(matches!(dev.register_host(&h), Err(AgentError::AlreadyRegistered { .. })));
        dev.copy_h2d(&s, &h.range(0, 8), a.all()).unwrap();
        drop(r);
        assert!(!h.is_registered(0));
        assert!(matches!(dev.copy_h2d(&s, &h.range(0, 8), a.all()), Err(AgentError::NotRegistered { .. })));
        // The copy enqueued before unregistering still lands.
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        assert_eq!(dev.read_sync(a.all()).unwrap(), (0..8u8).collect::<Vec<_>>());
    }

    #[test]
    fn a_second_registration_is_refused_and_undoes_itself() {
        let h = HostBuffer::new(8);
        let first = h.register(0, None).unwrap();
        let undone = Arc::new(Mutex::new(false));
        let flag = undone.clone();
        let r = h.register(0, Some(Box::new(move || *flag.lock() = true)));
        assert!(matches!(r, Err(AgentError::AlreadyRegistered { device: 0, .. })));
        assert!(*undone.lock());
        assert!(h.is_registered(0));
        drop(first);
        assert!(!h.is_registered(0));
    }

    #[test]
    fn imported_engine_memory_is_the_engine_memory() {
        // The engine (its own device handle table) exports its KV buffer; the agent imports it
        // and writes into it with an ordinary copy.
        let engine = HostDevice::new(0, 1 << 20);
        let agent = HostDevice::new(0, 1 << 20);
        let kv = engine.alloc(256).unwrap();
        let handle = engine.export_ipc(kv).unwrap();
        assert_eq!(handle.len(), 256);
        let mapped = agent.import_ipc(&handle).unwrap();
        assert_eq!(agent.mem_info().unwrap().free, 1 << 20, "imports use the exporter's memory");
        let s = agent.new_stream().unwrap();
        let h = HostBuffer::from_vec((0..=255u8).collect());
        let _r = agent.register_host(&h).unwrap();
        agent.copy_h2d(&s, &h.range(0, 256), mapped.all()).unwrap();
        agent.wait(&agent.record(&s).unwrap()).unwrap();
        assert_eq!(engine.read_sync(kv.all()).unwrap(), (0..=255u8).collect::<Vec<_>>());
        assert!(matches!(agent.export_ipc(mapped), Err(AgentError::BadIpcHandle(_))));
        // Unmapping leaves the engine's memory alone; the handle can be imported again.
        agent.free(mapped).unwrap();
        assert_eq!(agent.read_sync(mapped.all()), Err(AgentError::FreedHandle(mapped.id())));
        assert_eq!(engine.read_sync(kv.range(0, 2)).unwrap(), [0, 1]);
        let again = agent.import_ipc(&handle).unwrap();
        assert!(matches!(
            agent.import_ipc(&IpcHandle::from_bytes(*handle.bytes(), 255)),
            Err(AgentError::BadIpcHandle(_))
        ));
        // Once the engine frees it, the handle names nothing.
        engine.free(kv).unwrap();
        assert!(matches!(agent.import_ipc(&handle), Err(AgentError::BadIpcHandle(_))));
        assert!(matches!(agent.import_ipc(&IpcHandle::from_bytes([7; 64], 256)), Err(AgentError::BadIpcHandle(_))));
        agent.free(again).unwrap();
    }

    #[test]
    fn peer_copies_move_bytes_between_devices_and_check_both_tables() {
        let (g3, g7) = (HostDevice::new(3, 1 << 20), HostDevice::new(7, 1 << 20));
        let s = g3.new_stream().unwrap();
        let mine = g3.alloc(128).unwrap();
        let back = g3.alloc(128).unwrap();
        let lent = g7.alloc(128).unwrap();
        g3.write_sync(mine.all(), &[5; 128]).unwrap();
        g3.copy_peer(&s, &g3, mine.all(), &g7, lent.all()).unwrap();
        g3.copy_peer(&s, &g7, lent.all(), &g3, back.all()).unwrap();
        g3.wait(&g3.record(&s).unwrap()).unwrap();
        assert_eq!(g7.read_sync(lent.all()).unwrap(), [5; 128]);
        assert_eq!(g3.read_sync(back.all()).unwrap(), [5; 128]);
        // A handle checked against the wrong device's table, a stream of the other device.
        assert_eq!(
            g3.copy_peer(&s, &g3, lent.all(), &g7, mine.all()),
            Err(AgentError::WrongDevice { expected: 3, found: 7 })
        );
        let s7 = g7.new_stream().unwrap();
        assert_eq!(
            g3.copy_peer(&s7, &g3, mine.all(), &g7, lent.all()),
            Err(AgentError::WrongDevice { expected: 3, found: 7 })
        );
        assert!(matches!(
            g3.copy_peer(&s, &g3, mine.all(), &g7, lent.range(64, 128)),
            Err(AgentError::OutOfBounds { .. })
        ));
        g7.free(lent).unwrap();
        assert_eq!(g3.copy_peer(&s, &g3, mine.all(), &g7, lent.all()), Err(AgentError::FreedHandle(lent.id())));
    }

    #[test]
    fn capacity_is_a_hard_cap_and_free_returns_it() {
        let dev = HostDevice::new(3, 100);
        let a = dev.alloc(60).unwrap();
        assert_eq!(dev.alloc(41), Err(AgentError::OutOfMemory { requested: 41, free: 40 }));
        assert_eq!(dev.mem_info().unwrap(), MemInfo { free: 40, total: 100 });
        dev.free(a).unwrap();
        assert_eq!(dev.mem_info().unwrap().free, 100);
        assert_eq!(dev.alloc(100).unwrap().device(), 3);
    }

    #[test]
    fn a_failed_operation_fails_the_next_event_only() {
        let (dev, s, _h, _r) = setup();
        let (gate, open) = dev.user_event();
        dev.stream_wait(&s, &gate).unwrap();
        s.send(Op::Run(Box::new(|| Err(AgentError::Driver { op: "injected", detail: "fault".into() })))).unwrap();
        let first = dev.record(&s).unwrap();
        let second = dev.record(&s).unwrap();
        open.complete(Ok(()));
        assert!(matches!(dev.wait(&first), Err(AgentError::Driver { op: "injected", .. })));
        assert_eq!(dev.wait(&second), Ok(()));
    }

    #[test]
    fn freeing_during_a_copy_keeps_the_memory_until_it_lands() {
        let (dev, s, h, _r) = setup();
        let a = dev.alloc(256).unwrap();
        let back = HostBuffer::new(256);
        let _r2 = dev.register_host(&back).unwrap();
        let (gate, open) = dev.user_event();
        dev.stream_wait(&s, &gate).unwrap();
        dev.copy_h2d(&s, &h.range(0, 256), a.all()).unwrap();
        dev.copy_d2h(&s, a.all(), &back.range(0, 256)).unwrap();
        let ev = dev.record(&s).unwrap();
        dev.free(a).unwrap();
        open.complete(Ok(()));
        dev.wait(&ev).unwrap();
        assert_eq!(back.to_vec(), (0..=255u8).collect::<Vec<_>>());
    }

    #[test]
    fn opposite_copies_on_two_streams_do_not_deadlock() {
        let (dev, s1, _h, _r) = setup();
        let s2 = dev.new_stream().unwrap();
        let a = dev.alloc(1 << 16).unwrap();
        let b = dev.alloc(1 << 16).unwrap();
        for _ in 0..200 {
            dev.copy_d2d(&s1, a.all(), b.all()).unwrap();
            dev.copy_d2d(&s2, b.all(), a.all()).unwrap();
        }
        let (e1, e2) = (dev.record(&s1).unwrap(), dev.record(&s2).unwrap());
        assert_eq!((dev.wait(&e1), dev.wait(&e2)), (Ok(()), Ok(())));
    }

    #[test]
    fn a_full_queue_blocks_the_caller_and_loses_nothing() {
        let dev = HostDevice::with_queue_depth(0, 1 << 20, 1);
        let s = dev.new_stream().unwrap();
        let h = HostBuffer::from_vec((0..=255u8).collect());
        let _r = dev.register_host(&h).unwrap();
        let a = dev.alloc(256 * 100).unwrap();
        for i in 0..100 {
            dev.copy_h2d(&s, &h.range(i, 256 - i), a.range(256 * i, 256 - i)).unwrap();
        }
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        let got = dev.read_sync(a.all()).unwrap();
        for i in 0..100 {
            assert_eq!(got[256 * i], i as u8);
            assert_eq!(got[256 * i + 255 - i], 255);
        }
    }

    #[test]
    fn a_batch_is_one_queue_entry_and_all_or_nothing() {
        // A queue of two entries behind a held stream: a batch of 64 copies and the event after
        // it still go in (64 single copies would block the caller), and one bad copy refuses the
        // whole batch.
        let dev = HostDevice::with_queue_depth(0, 1 << 20, 2);
        let s = dev.new_stream().unwrap();
        let h = HostBuffer::from_vec((0..=255u8).collect());
        let _r = dev.register_host(&h).unwrap();
        let a = dev.alloc(64 * 4).unwrap();
        let (gate, open) = dev.user_event();
        dev.stream_wait(&s, &gate).unwrap();
        let mut batch: Vec<_> =
            (0..64).map(|i| Transfer::HostToDevice { src: h.range(i * 4, 4), dst: a.range(i * 4, 4) }).collect();
        batch.push(Transfer::HostToDevice { src: h.range(0, 4), dst: a.range(64 * 4, 4) });
        assert!(matches!(dev.copy_batch(&s, &batch), Err(AgentError::OutOfBounds { .. })));
        batch.pop();
        dev.copy_batch(&s, &batch).unwrap();
        let ev = dev.record(&s).unwrap();
        open.complete(Ok(()));
        dev.wait(&ev).unwrap();
        assert_eq!(dev.read_sync(a.all()).unwrap(), (0..=255u8).collect::<Vec<_>>());
    }

    #[test]
    fn dropped_trigger_fails_its_waiters_instead_of_hanging() {
        let dev = HostDevice::new(0, 0);
        let (ev, trigger) = dev.user_event();
        drop(trigger);
        assert_eq!(dev.wait(&ev), Err(AgentError::StreamClosed));
    }
}
