//! Tests of the engine side on the host backend: sessions driven in process (engine buffers are
//! real sealed memfds imported as IPC memory), and the socket with real descriptors.

use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use kvtier_proto::{DType, HashScheme, KvLayout, KEY_LEN};
use memmap2::MmapMut;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

use super::proto::{Header, HEADER_LEN};
use super::*;
use crate::pool::LenderStats;
use crate::HostDevice;

const LAYERS: usize = 4;
/// 2 (K, V) × 4 layers × 2 heads × 8 dims × 2 bytes × 4 tokens = 1 KiB blocks, 256-byte layers.
const BLOCK: usize = 1024;
const LB: usize = BLOCK / LAYERS;

fn namespace() -> Namespace {
    Namespace::new("t", "m", KvLayout::new(LAYERS as u16, 2, 8, DType::Fp16, 4), HashScheme::Blake3, b"s")
}

/// The engine's own block hash `n` (what it sends the agent).
fn key(n: u8) -> BlockKey {
    BlockKey([n; KEY_LEN])
}

/// The key block `n` is held under in G1 and the store: the engine's hash salted into the
/// namespace, as the client salts it.
fn stored(n: u8) -> BlockKey {
    BlockKey::opaque(&namespace(), &key(n).0)
}

/// An engine's KV buffer: a sealed memfd of `pages` pages, mapped here too.
struct EngineMem {
    fd: OwnedFd,
    map: MmapMut,
    pages: usize,
}

impl EngineMem {
    fn new(pages: usize, seal: bool) -> Self {
        let fd = rustix::fs::memfd_create("engine", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, (pages * BLOCK) as u64).unwrap();
        if seal {
            rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        }
        // SAFETY: a memfd of this test's own, sized above.
        let map = unsafe { MmapMut::map_mut(&fd) }.unwrap();
        EngineMem { fd, map, pages }
    }

    fn at(&self, layer: usize, page: usize) -> std::ops::Range<usize> {
        let o = (layer * self.pages + page) * LB;
        o..o + LB
    }

    /// Page `page` of every layer filled with bytes derived from `seed`.
    fn fill(&mut self, page: usize, seed: u8) {
        for l in 0..LAYERS {
            let r = self.at(l, page);
            for (i, b) in self.map[r].iter_mut().enumerate() {
                *b = seed.wrapping_mul(31).wrapping_add((i * 7 + l * 13) as u8);
            }
        }
    }

    fn block(&self, page: usize) -> Vec<u8> {
        (0..LAYERS).flat_map(|l| self.map[self.at(l, page)].to_vec()).collect()
    }
}

type TestAgent = Agent<HostDevice, MemorySpill>;

fn agent(pool_pages: usize, tweak: impl FnOnce(&mut AgentConfig)) -> Arc<TestAgent> {
    let mut cfg = AgentConfig::new(BLOCK);
    cfg.capacity = Capacity::Bytes(pool_pages * BLOCK);
    tweak(&mut cfg);
    Arc::new(Agent::new(Arc::new(HostDevice::new(0, 64 << 20)), MemorySpill::default(), cfg).unwrap())
}

/// A session driven in process; answers collected.
struct Eng {
    s: Session<HostDevice, MemorySpill>,
    next: u32,
}

#[derive(Debug)]
struct Ans {
    h: Header,
    body: Vec<u8>,
}

impl Ans {
    fn status(&self) -> u8 {
        self.h.status
    }
    fn u32s(&self) -> Vec<u32> {
        self.body.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
    }
    fn msg(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn parse(all: Vec<Vec<u8>>) -> Vec<Ans> {
    all.into_iter()
        .map(|m| Ans { h: Header::decode(m[..HEADER_LEN].try_into().unwrap()), body: m[HEADER_LEN..].to_vec() })
        .collect()
}

impl Eng {
    fn new(a: &Arc<TestAgent>) -> Self {
        Eng { s: Session::new(a.clone()).unwrap(), next: 1 }
    }

    /// An engine on device `ordinal` of the agent's node.
    fn on(a: &Arc<TestAgent>, ordinal: u32) -> Self {
        Eng { s: Session::on_device(a.clone(), ordinal).unwrap(), next: 1 }
    }

    fn call(&mut self, req: Request, fd: Option<OwnedFd>) -> Vec<Ans> {
        let mut out = Vec::new();
        self.next += 1;
        self.s
            .handle(self.next, req, fd, &mut |m| {
                out.push(m);
                Ok(())
            })
            .unwrap();
        parse(out)
    }

    fn one(&mut self, req: Request, fd: Option<OwnedFd>) -> Ans {
        let mut a = self.call(req, fd);
        assert_eq!(a.len(), 1);
        a.remove(0)
    }

    fn open(&mut self) {
        let a = self.one(Request::Open(namespace()), None);
        assert_eq!(a.status(), 0, "{}", a.msg());
        assert_eq!(&a.body[..8], &(BLOCK as u64).to_le_bytes());
    }

    fn register(&mut self, m: &EngineMem) -> u32 {
        let fd = m.fd.try_clone().unwrap();
        let a = self.one(
            Request::Register { source: BufferSource::Memfd, len: (m.pages * BLOCK) as u64, pages: m.pages as u32 },
            Some(fd),
        );
        assert_eq!(a.status(), 0, "{}", a.msg());
        a.u32s()[0]
    }

    fn save_all_layers(&mut self, buf: u32, items: &[Item]) -> Vec<Ans> {
        (0..LAYERS as u16)
            .map(|layer| self.one(Request::Save { buffer: buf, layer, items: items.to_vec() }, None))
            .collect()
    }
}

fn items(pairs: &[(u32, u8)]) -> Vec<Item> {
    pairs.iter().map(|(p, k)| Item { page: *p, key: key(*k) }).collect()
}

#[test]
fn saved_layers_reload_byte_identical_into_another_engines_pages() {
    let a = agent(8, |_| {});
    let mut m1 = EngineMem::new(4, true);
    for p in 0..4 {
        m1.fill(p, p as u8 + 1);
    }
    let mut e1 = Eng::new(&a);
    e1.open();
    let b1 = e1.register(&m1);
    let saved = e1.save_all_layers(b1, &items(&[(0, 10), (1, 11), (2, 12), (3, 13)]));
    assert!(saved.iter().all(|s| s.status() == 0));
    assert_eq!(saved[0].u32s(), [4, 0]);
    assert_eq!(saved[LAYERS - 1].u32s(), [4, 4], "the last layer commits every block");
    assert_eq!(a.stats().pool.resident, 4);

    // A second engine, its own buffer, the pages in another order.
    let m2 = EngineMem::new(4, true);
    let mut e2 = Eng::new(&a);
    e2.open();
    let b2 = e2.register(&m2);
    let got = e2.call(Request::Load { buffer: b2, items: items(&[(3, 10), (2, 11), (1, 12), (0, 13)]) }, None);
    assert_eq!(got.len(), 1 + LAYERS);
    assert_eq!(got[0].u32s(), [4, 4, 0], "found, from G1, from G2");
    for (l, g) in got[1..].iter().enumerate() {
        assert_eq!((g.h.op, g.status(), g.h.aux as usize), (Op::Layer as u8, 0, l));
    }
    for (dst, src) in [(3, 0), (2, 1), (1, 2), (0, 3)] {
        assert_eq!(m2.block(dst), m1.block(src), "page {dst}");
    }
    let st = a.stats();
    assert_eq!((st.loaded_from_g1, st.saved_blocks, st.pool.pinned), (4, 4, 0));
    assert!(st.copy_bytes >= 8 * BLOCK as u64 && st.copy_seconds > 0.0);
}

#[test]
fn a_small_pool_spills_and_loads_come_back_from_the_store_layer_by_layer() {
    let a = agent(2, |_| {});
    let mut m1 = EngineMem::new(6, true);
    for p in 0..6 {
        m1.fill(p, 40 + p as u8);
    }
    let mut e1 = Eng::new(&a);
    e1.open();
    let b1 = e1.register(&m1);
    // Two blocks at a time (the pool holds two): six blocks, four spilled.
    for chunk in [[(0, 1), (1, 2)], [(2, 3), (3, 4)], [(4, 5), (5, 6)]] {
        assert!(e1.save_all_layers(b1, &items(&chunk)).iter().all(|s| s.status() == 0));
    }
    assert!(a.wait_for_spills(std::time::Duration::from_secs(5)));
    let st = a.stats();
    assert_eq!((st.pool.spills, st.pool.resident), (4, 2));
    // A prefix of six plus one key no one stored: six found, the last a miss.
    let m2 = EngineMem::new(7, true);
    let mut e2 = Eng::new(&a);
    e2.open();
    let b2 = e2.register(&m2);
    let keys = items(&[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 99)]);
    let got = e2.call(Request::Load { buffer: b2, items: keys }, None);
    assert_eq!(got[0].u32s(), [6, 2, 4]);
    assert!(got[1..].iter().all(|g| g.status() == 0));
    for p in 0..6 {
        assert_eq!(m2.block(p), m1.block(p), "block {p}");
    }
    assert_eq!(m2.block(6), vec![0u8; BLOCK], "a miss leaves its page alone");
    assert_eq!(a.stats().load_misses, 1);
    assert_eq!(a.stats().pool.pinned, 0);
    // A one-device node never borrows, and its evictions are not counted as declines.
    let b = a.stats().borrow;
    assert_eq!((b.declines(), b.reclaims, b.lenders[&0]), (0, 0, LenderStats::default()));
    assert!(b.link_bytes.is_empty());
}

#[test]
fn bad_requests_get_clear_errors() {
    let a = agent(4, |c| {
        c.max_buffers_per_connection = 1;
        c.max_open_saves_per_connection = 2;
    });
    let m = EngineMem::new(2, true);
    let mut e = Eng::new(&a);
    let st = |a: &Ans| Status::try_from_u8(a.status());
    // Nothing before OPEN.
    let r = e.one(Request::Load { buffer: 1, items: vec![] }, None);
    assert_eq!((st(&r), r.msg().contains("OPEN")), (Status::BadRequest, true));
    // A layout whose blocks are not the agent's page size.
    let wrong = Namespace::new("t", "m", KvLayout::new(4, 2, 16, DType::Fp16, 4), HashScheme::Blake3, b"s");
    let r = e.one(Request::Open(wrong), None);
    assert_eq!((st(&r), r.msg().contains("G1 pages are 1024")), (Status::SizeMismatch, true), "{}", r.msg());
    e.open();
    // A buffer smaller than its pages; a memfd without its descriptor; an unsealed memfd.
    let r = e.one(
        Request::Register { source: BufferSource::Memfd, len: BLOCK as u64, pages: 2 },
        Some(m.fd.try_clone().unwrap()),
    );
    assert_eq!(st(&r), Status::SizeMismatch, "{}", r.msg());
    let r = e.one(Request::Register { source: BufferSource::Memfd, len: 2 * BLOCK as u64, pages: 2 }, None);
    assert!(r.msg().contains("descriptor"), "{}", r.msg());
    let loose = EngineMem::new(2, false);
    let r = e.one(
        Request::Register { source: BufferSource::Memfd, len: 2 * BLOCK as u64, pages: 2 },
        Some(loose.fd.try_clone().unwrap()),
    );
    assert!(r.msg().contains("F_SEAL_SHRINK"), "{}", r.msg());
    // A CUDA handle on the host backend names nothing.
    let r = e.one(Request::Register { source: BufferSource::CudaIpc([1; 64]), len: 2 * BLOCK as u64, pages: 2 }, None);
    assert_eq!(st(&r), Status::BadRequest, "{}", r.msg());
    let b = e.register(&m);
    let r = e.one(
        Request::Register { source: BufferSource::Memfd, len: 2 * BLOCK as u64, pages: 2 },
        Some(m.fd.try_clone().unwrap()),
    );
    assert_eq!(st(&r), Status::Busy, "one buffer per connection here: {}", r.msg());
    // Unknown buffer, page and layer out of range.
    let r = e.one(Request::Save { buffer: b + 5, layer: 0, items: items(&[(0, 1)]) }, None);
    assert_eq!(st(&r), Status::UnknownBuffer);
    let r = e.one(Request::Save { buffer: b, layer: 0, items: items(&[(0, 1), (2, 2)]) }, None);
    assert_eq!((st(&r), r.msg().contains("page 2")), (Status::OutOfRange, true), "{}", r.msg());
    let r = e.one(Request::Load { buffer: b, items: items(&[(7, 1)]) }, None);
    assert_eq!(st(&r), Status::OutOfRange);
    let r = e.one(Request::Save { buffer: b, layer: LAYERS as u16, items: items(&[(0, 1)]) }, None);
    assert_eq!(st(&r), Status::OutOfRange);
    // A later layer of a key whose layer 0 was never saved; layers out of order.
    let r = e.one(Request::Save { buffer: b, layer: 1, items: items(&[(0, 1)]) }, None);
    assert_eq!((st(&r), r.msg().contains("layer 0 was not saved")), (Status::UnknownKey, true), "{}", r.msg());
    assert_eq!(e.one(Request::Save { buffer: b, layer: 0, items: items(&[(0, 1)]) }, None).status(), 0);
    let r = e.one(Request::Save { buffer: b, layer: 2, items: items(&[(0, 1)]) }, None);
    assert_eq!((st(&r), r.msg().contains("layer 1 comes next")), (Status::UnknownKey, true), "{}", r.msg());
    // At most two open saves on this connection.
    let r = e.one(Request::Save { buffer: b, layer: 0, items: items(&[(0, 2), (1, 3)]) }, None);
    assert_eq!(st(&r), Status::Busy, "{}", r.msg());
    assert_eq!(a.stats().pool.pinned, 1, "the refused save reserved nothing");
    // Unknown keys load as misses, not errors.
    let got = e.call(Request::Load { buffer: b, items: items(&[(0, 77)]) }, None);
    assert_eq!(got[0].u32s(), [0, 0, 0]);
    let r = e.one(Request::Unregister { buffer: b + 9 }, None);
    assert_eq!(st(&r), Status::UnknownBuffer);
    assert_eq!(e.one(Request::Unregister { buffer: b }, None).status(), 0);
    assert!(a.stats().refused >= 14);
}

#[test]
fn a_session_that_goes_away_mid_save_gives_its_pages_back() {
    let a = agent(2, |_| {});
    let m = EngineMem::new(2, true);
    let mut e = Eng::new(&a);
    e.open();
    let b = e.register(&m);
    assert_eq!(e.one(Request::Save { buffer: b, layer: 0, items: items(&[(0, 1), (1, 2)]) }, None).status(), 0);
    // Both pages are held by the unfinished save: another engine can't save now.
    let mut other = Eng::new(&a);
    other.open();
    let ob = other.register(&m);
    let r = other.one(Request::Save { buffer: ob, layer: 0, items: items(&[(0, 3)]) }, None);
    assert_eq!(Status::try_from_u8(r.status()), Status::Busy);
    assert_eq!(a.stats().connections, 2);
    drop(e);
    assert_eq!(a.stats().connections, 1);
    assert_eq!((a.stats().pool.pinned, a.stats().pool.resident), (0, 0));
    assert!(other.save_all_layers(ob, &items(&[(0, 3)])).iter().all(|r| r.status() == 0));
}

impl Status {
    fn try_from_u8(v: u8) -> Status {
        [
            Status::Ok,
            Status::BadRequest,
            Status::OutOfRange,
            Status::UnknownBuffer,
            Status::UnknownKey,
            Status::Busy,
            Status::Internal,
            Status::SizeMismatch,
        ]
        .into_iter()
        .find(|s| *s as u8 == v)
        .unwrap()
    }
}

/// The engine's end of the socket.
struct Client {
    sock: UnixStream,
}

impl Client {
    fn send(&mut self, req: &Request, id: u32, fd: Option<&OwnedFd>) {
        let msg = req.encode(id);
        match fd {
            None => self.sock.write_all(&msg).unwrap(),
            Some(fd) => {
                let fds = [fd.as_fd()];
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut anc = SendAncillaryBuffer::new(&mut space);
                assert!(anc.push(SendAncillaryMessage::ScmRights(&fds)));
                let n = rustix::net::sendmsg(&self.sock, &[IoSlice::new(&msg)], &mut anc, SendFlags::NOSIGNAL).unwrap();
                self.sock.write_all(&msg[n..]).unwrap();
            }
        }
    }

    fn answer(&mut self) -> Option<Ans> {
        let mut h = [0u8; HEADER_LEN];
        self.sock.read_exact(&mut h).ok()?;
        let h = Header::decode(&h);
        let mut body = vec![0u8; h.body_len as usize];
        self.sock.read_exact(&mut body).ok()?;
        Some(Ans { h, body })
    }
}

/// An engine socket of `a` in a fresh folder: the folder (kept while the test runs), the
/// socket's path, the server.
fn socket_of(a: &Arc<TestAgent>) -> (tempfile::TempDir, std::path::PathBuf, EngineServer) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let server = EngineServer::bind(a.clone(), &path).unwrap();
    (dir, path, server)
}

/// A connection to the socket at `path` with the test namespace open.
fn opened(path: &std::path::Path) -> Client {
    let mut c = Client { sock: UnixStream::connect(path).unwrap() };
    c.send(&Request::Open(namespace()), 1, None);
    assert_eq!(c.answer().unwrap().status(), 0);
    c
}

/// Registers `m` (all its pages) on `c` by its memfd; the buffer's id.
fn register_on(c: &mut Client, m: &EngineMem) -> u32 {
    let len = (m.pages * BLOCK) as u64;
    c.send(&Request::Register { source: BufferSource::Memfd, len, pages: m.pages as u32 }, 2, Some(&m.fd));
    let ans = c.answer().unwrap();
    assert_eq!(ans.status(), 0, "{}", ans.msg());
    ans.u32s()[0]
}

#[test]
fn the_socket_carries_descriptors_answers_per_layer_and_enforces_its_limits() {
    let a = agent(4, |c| {
        c.max_connections = 2;
        c.idle_timeout = std::time::Duration::from_millis(300);
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let server = EngineServer::bind(a.clone(), &path).unwrap();
    let mut m = EngineMem::new(2, true);
    m.fill(0, 5);
    m.fill(1, 6);
    let mut c = Client { sock: UnixStream::connect(&path).unwrap() };
    c.send(&Request::Open(namespace()), 1, None);
    assert_eq!(c.answer().unwrap().status(), 0);
    c.send(&Request::Register { source: BufferSource::Memfd, len: 2 * BLOCK as u64, pages: 2 }, 2, Some(&m.fd));
    let buf = c.answer().unwrap().u32s()[0];
    // Every layer sent before reading an answer (as an engine saving during its forward pass).
    for layer in 0..LAYERS as u16 {
        c.send(&Request::Save { buffer: buf, layer, items: items(&[(0, 1), (1, 2)]) }, 10 + u32::from(layer), None);
    }
    for layer in 0..LAYERS as u32 {
        let ans = c.answer().unwrap();
        assert_eq!((ans.h.request_id, ans.status()), (10 + layer, 0));
    }
    // Load both into the other page order; one answer, then one per layer.
    m.map.fill(0);
    c.send(&Request::Load { buffer: buf, items: items(&[(1, 1), (0, 2)]) }, 20, None);
    assert_eq!(c.answer().unwrap().u32s(), [2, 2, 0]);
    for l in 0..LAYERS {
        let ans = c.answer().unwrap();
        assert_eq!((ans.h.op, ans.h.aux as usize, ans.h.request_id), (Op::Layer as u8, l, 20));
    }
    let mut want = EngineMem::new(2, true);
    want.fill(0, 6);
    want.fill(1, 5);
    assert_eq!((m.block(0), m.block(1)), (want.block(0), want.block(1)));
    // A request of the most items (a body well past one read of the socket) is read whole and
    // answered: none of these keys is held, so none lands.
    let many: Vec<(u32, u8)> = (0..proto::MAX_ITEMS).map(|i| ((i % 2) as u32, 100 + (i % 100) as u8)).collect();
    c.send(&Request::Load { buffer: buf, items: items(&many) }, 25, None);
    let ans = c.answer().unwrap();
    assert_eq!((ans.h.request_id, ans.status()), (25, 0), "{}", ans.msg());
    assert_eq!(ans.u32s()[0], 0, "no key of that load is held");
    for l in 0..LAYERS {
        let ans = c.answer().unwrap();
        assert_eq!((ans.h.op, ans.h.aux as usize, ans.h.request_id), (Op::Layer as u8, l, 25));
    }
    // A malformed body is refused and the connection stays in step.
    c.sock.write_all(&Header { body_len: 3, op: Op::Load as u8, status: 0, aux: 0, request_id: 30 }.encode()).unwrap();
    c.sock.write_all(&[1, 2, 3]).unwrap();
    let ans = c.answer().unwrap();
    assert_eq!((ans.h.request_id, ans.status()), (30, Status::BadRequest as u8));
    // Two connections at most: a third is told so and closed.
    let second = Client { sock: UnixStream::connect(&path).unwrap() };
    let mut third = Client { sock: UnixStream::connect(&path).unwrap() };
    let ans = third.answer().unwrap();
    assert_eq!(ans.status(), Status::Busy as u8, "{}", ans.msg());
    assert!(third.answer().is_none());
    // An oversized request closes the connection without reading its body.
    let h = Header { body_len: (proto::MAX_BODY + 1) as u32, op: Op::Load as u8, status: 0, aux: 0, request_id: 31 };
    c.sock.write_all(&h.encode()).unwrap();
    let ans = c.answer().unwrap();
    assert_eq!((ans.h.request_id, ans.status()), (31, Status::BadRequest as u8));
    assert!(c.answer().is_none());
    // An idle connection is closed after the idle timeout.
    drop(second);
    while a.stats().connections > 0 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    let mut idle = Client { sock: UnixStream::connect(&path).unwrap() };
    let t = std::time::Instant::now();
    assert!(idle.answer().is_none());
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    drop(server);
    assert!(!path.exists());
}

/// A descriptor belongs to the request it came with: one sent with a refused request (or any
/// other) is closed, never taken for a later registration's memory. Before, descriptors queued
/// per connection, so the next memfd `REGISTER` mapped the stray one (wrong bytes saved).
#[test]
fn a_stray_descriptor_is_never_a_later_registrations_memory() {
    let a = agent(4, |_| {});
    let (_dir, path, _server) = socket_of(&a);
    let mut stray = EngineMem::new(2, true);
    stray.fill(0, 9);
    stray.fill(1, 9);
    let mut m = EngineMem::new(2, true);
    m.fill(0, 5);
    m.fill(1, 6);
    let mut c = opened(&path);
    // A registration refused (a CUDA IPC handle on the host device) with a memfd attached, and
    // a request that takes none with one attached.
    c.send(
        &Request::Register { source: BufferSource::CudaIpc([1; 64]), len: 2 * BLOCK as u64, pages: 2 },
        2,
        Some(&stray.fd),
    );
    assert_ne!(c.answer().unwrap().status(), 0);
    c.send(&Request::Load { buffer: 99, items: items(&[(0, 1)]) }, 3, Some(&stray.fd));
    assert_ne!(c.answer().unwrap().status(), 0);
    c.send(&Request::Register { source: BufferSource::Memfd, len: 2 * BLOCK as u64, pages: 2 }, 4, Some(&m.fd));
    let ans = c.answer().unwrap();
    assert_eq!(ans.status(), 0, "{}", ans.msg());
    let buf = ans.u32s()[0];
    for layer in 0..LAYERS as u16 {
        c.send(&Request::Save { buffer: buf, layer, items: items(&[(0, 1), (1, 2)]) }, 10 + u32::from(layer), None);
    }
    for _ in 0..LAYERS {
        assert_eq!(c.answer().unwrap().status(), 0);
    }
    let want = (m.block(0), m.block(1));
    m.map.fill(0);
    c.send(&Request::Load { buffer: buf, items: items(&[(0, 1), (1, 2)]) }, 20, None);
    assert_eq!(c.answer().unwrap().u32s()[0], 2);
    for _ in 0..LAYERS {
        c.answer().unwrap();
    }
    assert!((m.block(0), m.block(1)) == want, "the registration mapped another descriptor's memory");
}

/// An engine that sends its OPEN and its memfd REGISTER back to back (one read may take both,
/// the descriptor with the second) gets its buffer: the descriptor belongs to the REGISTER.
#[test]
fn a_registration_pipelined_after_open_keeps_its_descriptor() {
    let a = agent(4, |_| {});
    let (_dir, path, _server) = socket_of(&a);
    for round in 0..20u32 {
        let m = EngineMem::new(2, true);
        let mut c = Client { sock: UnixStream::connect(&path).unwrap() };
        c.send(&Request::Open(namespace()), 1, None);
        c.send(&Request::Register { source: BufferSource::Memfd, len: 2 * BLOCK as u64, pages: 2 }, 2, Some(&m.fd));
        assert_eq!(c.answer().unwrap().status(), 0);
        let ans = c.answer().unwrap();
        assert_eq!(ans.status(), 0, "round {round}: {}", ans.msg());
    }
}

/// A socket another agent listens on is refused (it was taken over, then removed when the
/// second agent stopped); a stopped agent removes only its own socket file, and stops promptly
/// even with its file gone (it waited for a connection that could no longer come).
#[test]
fn an_agents_socket_is_its_own() {
    let a = agent(4, |_| {});
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let first = EngineServer::bind(a.clone(), &path).unwrap();
    let err = EngineServer::bind(a.clone(), &path).err().expect("a second agent on a live socket");
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
    assert!(err.to_string().contains("another agent"), "{err}");
    opened(&path); // the first still serves

    // Its file removed and another agent bound there: stopping the first leaves the other's.
    std::fs::remove_file(&path).unwrap();
    let second = EngineServer::bind(a.clone(), &path).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(first);
        let _ = tx.send(());
    });
    rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the first agent stopped promptly");
    assert!(path.exists(), "the second agent's socket is left alone");
    opened(&path);
    // With its file gone, it still stops.
    std::fs::remove_file(&path).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(second);
        let _ = tx.send(());
    });
    rx.recv_timeout(std::time::Duration::from_secs(5)).expect("stopped with its socket file gone");
}

/// A save whose next layer does not come within `save_timeout` is given up and its G1 page
/// given back, also while its connection sits idle: an engine that never sends its last layer
/// can't hold the pool. Before, the pages stayed pinned until the connection closed (10 min idle).
#[test]
fn an_unfinished_save_gives_its_pages_back_after_the_save_timeout() {
    let a = agent(4, |c| c.save_timeout = std::time::Duration::from_millis(1500));
    let (_dir, path, _server) = socket_of(&a);
    let connect = |m: &EngineMem| {
        let mut c = opened(&path);
        let buffer = register_on(&mut c, m);
        (c, buffer)
    };
    let (ma, mb) = (EngineMem::new(4, true), EngineMem::new(4, true));
    let (mut stuck, sb) = connect(&ma);
    let four = items(&[(0, 1), (1, 2), (2, 3), (3, 4)]);
    stuck.send(&Request::Save { buffer: sb, layer: 0, items: four.clone() }, 3, None);
    assert_eq!(stuck.answer().unwrap().status(), 0);
    let (mut other, ob) = connect(&mb);
    let theirs = items(&[(0, 11), (1, 12)]);
    other.send(&Request::Save { buffer: ob, layer: 0, items: theirs.clone() }, 4, None);
    assert_eq!(other.answer().unwrap().status(), Status::Busy as u8, "the pool is held by the open saves");
    // The stuck engine sends nothing more; its saves expire while its connection is idle (its
    // pages given back before they are counted). Polled: a fixed 2.5 s was a guess on a busy machine.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while a.stats().saves_expired < 4 {
        assert!(std::time::Instant::now() < deadline, "the saves did not expire: {:?}", a.stats().saves_expired);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(a.stats().saves_expired, 4);
    assert_eq!(a.stats().pool.pinned, 0);
    for layer in 0..LAYERS as u16 {
        other.send(&Request::Save { buffer: ob, layer, items: theirs.clone() }, 10 + u32::from(layer), None);
        let ans = other.answer().unwrap();
        assert_eq!(ans.status(), 0, "layer {layer}: {}", ans.msg());
    }
    // The stuck engine's next layer is refused: its save was given up.
    stuck.send(&Request::Save { buffer: sb, layer: 1, items: four }, 5, None);
    assert_eq!(stuck.answer().unwrap().status(), Status::UnknownKey as u8);
}

/// A save of more new blocks than the pool's unpinned pages is refused before anything is
/// evicted for it. Before, it evicted the whole pool, then was refused.
#[test]
fn a_save_larger_than_the_pool_is_refused_before_evicting_anything() {
    let a = agent(4, |_| {});
    let mut m = EngineMem::new(5, true);
    for p in 0..5 {
        m.fill(p, p as u8 + 1);
    }
    let mut e = Eng::new(&a);
    e.open();
    let buf = e.register(&m);
    assert!(e.save_all_layers(buf, &items(&[(0, 1), (1, 2), (2, 3)])).iter().all(|r| r.status() == 0));
    assert_eq!(a.stats().pool.resident, 3);
    let five = items(&[(0, 11), (1, 12), (2, 13), (3, 14), (4, 15)]);
    let r = e.one(Request::Save { buffer: buf, layer: 0, items: five }, None);
    assert_eq!(r.status(), Status::Busy as u8, "{}", r.msg());
    assert!(r.msg().contains("needs as many G1 pages"), "{}", r.msg());
    assert_eq!((a.stats().pool.resident, a.stats().pool.evictions), (3, 0), "nothing was evicted for it");
    // Five again, three of them held already: two pages are needed, and there is room.
    let again = items(&[(0, 1), (1, 2), (2, 3), (3, 14), (4, 15)]);
    assert!(e.save_all_layers(buf, &again).iter().all(|r| r.status() == 0));
}

/// A store that refuses everything: the server down or full.
#[derive(Clone, Default)]
struct DownStore;

impl Spill for DownStore {
    fn spill(&self, _: &NamespaceId, _: &BlockKey, _: kvtier_proto::CodecId, _: &[u8]) -> Result<()> {
        Err(AgentError::Spill("server unreachable".into()))
    }
}

impl BackingStore for DownStore {
    fn open_namespace(&self, _: &Namespace) -> Result<()> {
        Ok(())
    }
    fn fetch(&self, _: &NamespaceId, _: &[BlockKey], _: usize, _: &mut [u8]) -> Result<Vec<bool>> {
        Err(AgentError::Spill("server unreachable".into()))
    }
}

#[test]
fn a_store_that_fails_turns_spills_into_drops_and_fetches_into_misses() {
    let mut cfg = AgentConfig::new(BLOCK);
    cfg.capacity = Capacity::Bytes(BLOCK);
    let a = Arc::new(Agent::new(Arc::new(HostDevice::new(0, 16 << 20)), DownStore, cfg).unwrap());
    let mut m = EngineMem::new(2, true);
    m.fill(0, 1);
    m.fill(1, 2);
    let mut e = Session::new(a.clone()).unwrap();
    let call = |e: &mut Session<HostDevice, DownStore>, req: Request, fd: Option<OwnedFd>| {
        let mut out = Vec::new();
        e.handle(1, req, fd, &mut |msg| {
            out.push(msg);
            Ok(())
        })
        .unwrap();
        parse(out)
    };
    assert_eq!(call(&mut e, Request::Open(namespace()), None)[0].status(), 0);
    let reg = Request::Register { source: BufferSource::Memfd, len: 2 * BLOCK as u64, pages: 2 };
    let b = call(&mut e, reg, Some(m.fd.try_clone().unwrap()))[0].u32s()[0];
    for k in [1u8, 2] {
        for layer in 0..LAYERS as u16 {
            let r = call(&mut e, Request::Save { buffer: b, layer, items: items(&[(u32::from(k) - 1, k)]) }, None);
            assert_eq!(r[0].status(), 0, "{}", r[0].msg());
        }
    }
    // Block 1 was evicted to make room and its spill (on the spill thread) failed: dropped,
    // counted.
    assert!(a.wait_for_spills(std::time::Duration::from_secs(5)));
    let st = a.stats();
    assert_eq!((st.pool.evictions, st.pool.spills, st.pool.spill_errors), (1, 0, 1));
    // Loading it: the store's failure is a miss, the engine gets a clean answer and recomputes.
    let got = call(&mut e, Request::Load { buffer: b, items: items(&[(0, 1), (1, 2)]) }, None);
    assert_eq!(got[0].u32s(), [0, 0, 0], "the prefix stops at the first key");
    assert!(got[1..].iter().all(|g| g.status() == 0));
    let st = a.stats();
    assert_eq!((st.store_errors, st.load_misses, st.pool.pinned), (1, 2, 0));
    // Block 2 is still a G1 hit on its own.
    let got = call(&mut e, Request::Load { buffer: b, items: items(&[(0, 2)]) }, None);
    assert_eq!(got[0].u32s(), [1, 1, 0]);
    assert_eq!(m.block(0), m.block(1));
}

#[test]
fn a_load_takes_from_the_store_only_what_its_staging_buffer_holds() {
    let a = agent(1, |c| c.max_store_bytes_per_load = 2 * BLOCK + BLOCK / 2);
    let mut m = EngineMem::new(4, true);
    for p in 0..4 {
        m.fill(p, 60 + p as u8);
    }
    let mut e = Eng::new(&a);
    e.open();
    let b = e.register(&m);
    for p in 0..4u8 {
        assert!(e.save_all_layers(b, &items(&[(u32::from(p), p + 1)])).iter().all(|s| s.status() == 0));
    }
    assert!(a.wait_for_spills(std::time::Duration::from_secs(5)));
    assert_eq!(a.stats().pool.spills, 3);
    // Keys 1..3 are in the store, key 4 in G1; two blocks fit the staging buffer: 1 and 2 land,
    // 3 is a miss, so the prefix is two long (key 4's pin is given back).
    let m2 = EngineMem::new(4, true);
    let b2 = e.register(&m2);
    let got = e.call(Request::Load { buffer: b2, items: items(&[(0, 1), (1, 2), (2, 3), (3, 4)]) }, None);
    assert_eq!(got[0].u32s(), [2, 0, 2]);
    assert_eq!((m2.block(0), m2.block(1)), (m.block(0), m.block(1)));
    assert_eq!(m2.block(2), vec![0u8; BLOCK]);
    assert_eq!(a.stats().pool.pinned, 0);
}

#[test]
fn an_engine_that_goes_away_mid_load_leaves_nothing_pinned() {
    let a = agent(4, |_| {});
    let mut m = EngineMem::new(2, true);
    m.fill(0, 1);
    let mut e = Eng::new(&a);
    e.open();
    let b = e.register(&m);
    assert!(e.save_all_layers(b, &items(&[(0, 1)])).iter().all(|r| r.status() == 0));
    for fail_at in [0, 2] {
        let mut sent = 0;
        let r = e.s.handle(9, Request::Load { buffer: b, items: items(&[(1, 1)]) }, None, &mut |_| {
            sent += 1;
            if sent > fail_at {
                Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "engine gone"))
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
        assert_eq!(a.stats().pool.pinned, 0, "failing after {fail_at} answers");
    }
}

/// A node of host devices 0, 1, ... whose pools hold `pages[i]` blocks each (all of the device's
/// memory), every pair linked at `bytes_per_sec`, the link monitor's window an hour (nothing
/// leaves it during a test).
fn node_agent(pages: &[usize], bytes_per_sec: u64) -> Arc<TestAgent> {
    let mut cfg = AgentConfig::new(BLOCK);
    cfg.capacity = Capacity::FractionOfFree(1.0);
    cfg.borrow = BorrowConfig::default().with_window(Duration::from_secs(3600));
    let devices: Vec<Arc<HostDevice>> =
        pages.iter().enumerate().map(|(i, p)| Arc::new(HostDevice::new(i as u32, p * BLOCK))).collect();
    let n = pages.len() as u32;
    let links: Vec<NodeLink> = (0..n).flat_map(|a| (a + 1..n).map(move |b| NodeLink { a, b, bytes_per_sec })).collect();
    Arc::new(Agent::node(devices, &links, MemorySpill::default(), cfg).unwrap())
}

fn filled(pages: usize, seed: u8) -> EngineMem {
    let mut m = EngineMem::new(pages, true);
    for p in 0..pages {
        m.fill(p, seed + p as u8);
    }
    m
}

#[test]
fn a_full_device_borrows_a_peer_page_through_its_saves_and_loads_it_back_over_the_link() {
    let a = node_agent(&[2, 2], 1 << 40);
    let ns = namespace().id();
    let m1 = filled(4, 60);
    let mut e1 = Eng::on(&a, 0);
    e1.open();
    let b1 = e1.register(&m1);
    let saved = e1.save_all_layers(b1, &items(&[(0, 1), (1, 2), (2, 3)]));
    assert!(saved.iter().all(|s| s.status() == 0), "{:?}", saved.iter().map(Ans::msg).collect::<Vec<_>>());
    assert_eq!(saved[LAYERS - 1].u32s(), [3, 3]);
    let st = a.stats();
    assert_eq!(st.borrow.lenders[&1], LenderStats { lent_pages: 1, borrows: 1, borrowed_bytes: BLOCK as u64 });
    assert_eq!((st.pool.evictions, st.borrow.declines(), st.pool.resident), (0, 0, 3));
    assert_eq!(st.borrow.link_bytes[&(0, 1)], BLOCK as u64, "the borrowed page's fill crossed the link");
    {
        let node = a.pool.lock();
        assert_eq!(node.pool(1).unwrap().owner(&(ns, stored(3))), Some(0), "device 1's pool holds 0's block");
        assert_eq!(node.policy().borrowed(0, 1), BLOCK as u64);
    }
    // Another engine on device 0 loads all three; the borrowed one crosses the link again.
    let m2 = EngineMem::new(3, true);
    let mut e2 = Eng::on(&a, 0);
    e2.open();
    let b2 = e2.register(&m2);
    let got = e2.call(Request::Load { buffer: b2, items: items(&[(2, 1), (1, 2), (0, 3)]) }, None);
    assert_eq!(got[0].u32s(), [3, 3, 0]);
    assert!(got[1..].iter().all(|g| g.status() == 0));
    for (dst, src) in [(2, 0), (1, 1), (0, 2)] {
        assert_eq!(m2.block(dst), m1.block(src), "page {dst}");
    }
    let st = a.stats();
    assert_eq!((st.borrow.link_bytes[&(0, 1)], st.pool.pinned), (2 * BLOCK as u64, 0));
    // A save that goes away after layer 0 gives its borrowed page back to the lender's share.
    let mut e3 = Eng::on(&a, 0);
    e3.open();
    let b3 = e3.register(&m1);
    let r = e3.one(Request::Save { buffer: b3, layer: 0, items: items(&[(3, 4)]) }, None);
    assert_eq!(r.status(), 0, "{}", r.msg());
    assert_eq!(a.stats().borrow.lenders[&1].lent_pages, 2);
    assert_eq!(a.pool.lock().policy().share(1).unwrap(), (2 * BLOCK as u64, 0));
    drop(e3);
    assert_eq!(a.stats().borrow.lenders[&1].lent_pages, 1);
    let node = a.pool.lock();
    assert_eq!(node.policy().share(1).unwrap(), (2 * BLOCK as u64, BLOCK as u64));
    assert_eq!(node.policy().borrowed(0, 1), BLOCK as u64);
    drop(node);
    assert!(Session::on_device(a.clone(), 9).is_err(), "a device not on the node");
}

#[test]
fn past_the_link_budget_a_full_device_declines_and_evicts_into_g2_instead() {
    // 2 bytes/s over an hour: 30% is 2160 bytes, two 1 KiB fills; device 1 has room for four.
    let a = node_agent(&[2, 4], 2);
    let ns = namespace().id();
    let m1 = filled(5, 80);
    let mut e1 = Eng::on(&a, 0);
    e1.open();
    let b1 = e1.register(&m1);
    for p in 0..5u32 {
        let saved = e1.save_all_layers(b1, &items(&[(p, p as u8 + 1)]));
        assert!(saved.iter().all(|s| s.status() == 0));
    }
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    let st = a.stats();
    assert_eq!((st.borrow.lenders[&1].borrows, st.borrow.declined_link_budget), (2, 1));
    assert_eq!((st.pool.evictions, st.pool.spills, st.pool.resident), (1, 1, 4));
    assert_eq!(a.store().get(&ns, &stored(1)), Some(m1.block(0)), "the least recently used block went to G2");
    let used = st.link_use[&(0, 1)];
    assert!(used > 0.28 && used <= 0.3, "{used}");
    // Everything comes back byte-identical: two from device 0's pool, two over the link, one
    // from G2.
    let m2 = EngineMem::new(5, true);
    let mut e2 = Eng::on(&a, 0);
    e2.open();
    let b2 = e2.register(&m2);
    let got = e2.call(Request::Load { buffer: b2, items: items(&[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]) }, None);
    assert_eq!(got[0].u32s(), [5, 4, 1]);
    assert!(got[1..].iter().all(|g| g.status() == 0));
    for p in 0..5 {
        assert_eq!(m2.block(p), m1.block(p), "block {p}");
    }
}

#[test]
fn a_lenders_own_blocks_take_its_lent_pages_back_and_are_never_starved() {
    let a = node_agent(&[1, 3], 1 << 40);
    let ns = namespace().id();
    // Device 1's engine saves a block first: the oldest block of its pool.
    let m1 = filled(3, 200);
    let mut e1 = Eng::on(&a, 1);
    e1.open();
    let b1 = e1.register(&m1);
    assert!(e1.save_all_layers(b1, &items(&[(0, 10)])).iter().all(|s| s.status() == 0));
    let m0 = filled(4, 100);
    let mut e0 = Eng::on(&a, 0);
    e0.open();
    let b0 = e0.register(&m0);
    assert!(e0.save_all_layers(b0, &items(&[(0, 1), (1, 2), (2, 3)])).iter().all(|s| s.status() == 0));
    assert_eq!(a.stats().borrow.lenders[&1].lent_pages, 2, "the rest of device 1's share is lent");
    // Device 1 saves two more: its share is its own, so both lent pages come back (spilled to G2
    // for device 0) although its own block 10 is the least recently used of its pool.
    assert!(e1.save_all_layers(b1, &items(&[(1, 11), (2, 12)])).iter().all(|s| s.status() == 0));
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    let st = a.stats();
    assert_eq!((st.borrow.reclaims, st.borrow.lenders[&1].lent_pages, st.borrow.declines()), (2, 0, 0));
    assert_eq!(st.pool.spills, 2);
    assert_eq!(a.store().get(&ns, &stored(2)), Some(m0.block(1)));
    assert_eq!(a.store().get(&ns, &stored(3)), Some(m0.block(2)));
    {
        let node = a.pool.lock();
        let lender = node.pool(1).unwrap();
        assert!([10, 11, 12].iter().all(|k| lender.contains(&ns, &stored(*k))), "the lender kept its own blocks");
        assert_eq!(lender.owner(&(ns, stored(11))), Some(1));
        assert_eq!((node.policy().borrowed(0, 1), node.policy().lent(1)), (0, 0));
    }
    // Device 0 is full and device 1's share holds only its own blocks: no peer has room, so
    // device 0 evicts its own block.
    assert!(e0.save_all_layers(b0, &items(&[(3, 4)])).iter().all(|s| s.status() == 0));
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    let st = a.stats();
    assert_eq!((st.borrow.declined_no_peer_capacity, st.pool.spills), (1, 3));
    assert_eq!(a.store().get(&ns, &stored(1)), Some(m0.block(0)));
    // An engine on device 1 loads device 0's blocks: from G2, and the one in device 0's pool over
    // the link.
    let m2 = EngineMem::new(4, true);
    let mut e2 = Eng::on(&a, 1);
    drop(e1);
    e2.open();
    let b2 = e2.register(&m2);
    let got = e2.call(Request::Load { buffer: b2, items: items(&[(0, 1), (1, 2), (2, 3), (3, 4)]) }, None);
    assert_eq!(got[0].u32s(), [4, 1, 3]);
    for p in 0..4 {
        assert_eq!(m2.block(p), m0.block(p), "block {p}");
    }
}

/// Saves `keys` one block at a time from pages 0.. of `m` (a small pool spills the oldest).
fn save_each(e: &mut Eng, buf: u32, keys: &[u8]) {
    for (p, k) in keys.iter().enumerate() {
        let saved = e.save_all_layers(buf, &items(&[(p as u32, *k)]));
        assert!(saved.iter().all(|s| s.status() == 0), "{:?}", saved.iter().map(Ans::msg).collect::<Vec<_>>());
    }
}

/// A LOAD's first answer (found, from G1, from G2), after checking that every layer landed.
fn load_counts(e: &mut Eng, buf: u32, pairs: &[(u32, u8)]) -> Vec<u32> {
    let got = e.call(Request::Load { buffer: buf, items: items(pairs) }, None);
    assert_eq!(got.len(), 1 + LAYERS);
    assert!(got[1..].iter().all(|g| g.status() == 0), "{:?}", got.iter().map(Ans::msg).collect::<Vec<_>>());
    got[0].u32s()
}

fn stored_change(changes: &[crate::pool::PoolChange], k: u8) -> bool {
    changes.contains(&crate::pool::PoolChange::Stored((namespace().id(), stored(k))))
}

#[test]
fn a_block_loaded_from_g2_is_promoted_into_g1_and_the_next_load_is_a_g1_hit() {
    let a = agent(2, |_| {});
    let ns = namespace().id();
    let m1 = filled(4, 20);
    let mut e1 = Eng::new(&a);
    e1.open();
    let b1 = e1.register(&m1);
    save_each(&mut e1, b1, &[1, 2, 3]);
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    assert_eq!(a.store().get(&ns, &stored(1)), Some(m1.block(0)), "block 1 was spilled to G2");
    let _ = a.take_g1_changes();

    let m2 = EngineMem::new(2, true);
    let mut e2 = Eng::new(&a);
    e2.open();
    let b2 = e2.register(&m2);
    assert_eq!(load_counts(&mut e2, b2, &[(0, 1)]), [1, 0, 1], "from G2");
    assert_eq!(m2.block(0), m1.block(0));
    let st = a.stats();
    assert_eq!((st.promotions, st.promotions_skipped, st.loaded_from_g2), (1, 0, 1));
    assert_eq!((st.pool.resident, st.pool.pinned), (2, 0));
    assert!(a.resident_keys().contains(&(ns, stored(1))), "block 1 is in G1 again");
    let (changes, lost) = a.take_g1_changes();
    assert!(stored_change(&changes, 1) && !lost, "the promotion is a G1 change: {changes:?}");

    // The second load is served from G1, byte-identical, and asks G2 for nothing more.
    assert_eq!(load_counts(&mut e2, b2, &[(1, 1)]), [1, 1, 0], "from G1");
    assert_eq!(m2.block(1), m1.block(0));
    let st = a.stats();
    assert_eq!((st.loaded_from_g1, st.loaded_from_g2, st.promotions), (1, 1, 1));

    // A promoted block came from a tier: evicting it drops it, no second spill.
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    let spills = a.stats().pool.spills;
    let m3 = filled(2, 90);
    let b3 = e1.register(&m3);
    save_each(&mut e1, b3, &[7, 8]);
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    assert!(!a.resident_keys().contains(&(ns, stored(1))));
    let st = a.stats();
    assert_eq!(st.pool.clean_drops, 1, "block 1 was dropped, not spilled");
    assert_eq!(st.pool.spills, spills + 1, "only the other evicted block (an engine's) was spilled");
    assert_eq!(a.store().received().iter().filter(|b| b.key == (ns, stored(1))).count(), 1);
    let (changes, _) = a.take_g1_changes();
    let gone = crate::pool::PoolChange::Evicted { key: (ns, stored(1)), below: true };
    assert!(changes.contains(&gone), "reported leaving G1 with G2 still holding it: {changes:?}");
}

#[test]
fn with_promotion_off_every_load_of_a_spilled_block_goes_to_g2() {
    let a = agent(2, |c| c.promote_loads = false);
    let ns = namespace().id();
    let m1 = filled(3, 30);
    let mut e1 = Eng::new(&a);
    e1.open();
    let b1 = e1.register(&m1);
    save_each(&mut e1, b1, &[1, 2, 3]);
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    let _ = a.take_g1_changes();
    let m2 = EngineMem::new(2, true);
    let b2 = e1.register(&m2);
    for p in 0..2 {
        assert_eq!(load_counts(&mut e1, b2, &[(p, 1)]), [1, 0, 1], "load {p}: from G2");
        assert_eq!(m2.block(p as usize), m1.block(0));
    }
    let st = a.stats();
    assert_eq!((st.loaded_from_g1, st.loaded_from_g2), (0, 2));
    assert_eq!((st.promotions, st.promotions_skipped, st.pool.evictions), (0, 0, 1));
    assert!(!a.resident_keys().contains(&(ns, stored(1))));
    assert!(a.take_g1_changes().0.is_empty(), "loads changed nothing in G1");
}

#[test]
fn a_pool_whose_pages_are_all_pinned_serves_the_load_from_g2_and_counts_a_skipped_promotion() {
    let a = agent(2, |_| {});
    let m1 = filled(5, 50);
    let mut e1 = Eng::new(&a);
    e1.open();
    let b1 = e1.register(&m1);
    save_each(&mut e1, b1, &[1, 2, 3]);
    // Another engine's saves of two new blocks hold both pages pinned (layer 0 of 4 saved).
    let mut e3 = Eng::new(&a);
    e3.open();
    let b3 = e3.register(&m1);
    let r = e3.one(Request::Save { buffer: b3, layer: 0, items: items(&[(3, 4), (4, 5)]) }, None);
    assert_eq!(r.status(), 0, "{}", r.msg());
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    assert_eq!(a.stats().pool.pinned, 2);
    let _ = a.take_g1_changes();

    let m2 = EngineMem::new(1, true);
    let mut e2 = Eng::new(&a);
    e2.open();
    let b2 = e2.register(&m2);
    assert_eq!(load_counts(&mut e2, b2, &[(0, 1)]), [1, 0, 1], "served from G2 all the same");
    assert_eq!(m2.block(0), m1.block(0));
    let st = a.stats();
    assert_eq!((st.promotions, st.promotions_skipped, st.pool.pinned), (0, 1, 2));
    assert!(a.take_g1_changes().0.is_empty());
    // The pinned saves were left alone: they finish and commit.
    for layer in 1..LAYERS as u16 {
        let r = e3.one(Request::Save { buffer: b3, layer, items: items(&[(3, 4), (4, 5)]) }, None);
        assert_eq!(r.status(), 0, "{}", r.msg());
    }
    assert_eq!(a.stats().saved_blocks, 5);
}

#[test]
fn promotion_borrows_a_peer_page_when_the_engines_device_is_full() {
    let a = node_agent(&[1, 1], 1 << 40);
    let ns = namespace().id();
    let m1 = filled(2, 70);
    let mut e0 = Eng::on(&a, 0);
    e0.open();
    let b0 = e0.register(&m1);
    save_each(&mut e0, b0, &[1]);
    // Block 9 is in G2 only (stored there by another node).
    let other = filled(1, 9);
    a.store().spill(&ns, &stored(9), kvtier_proto::CodecId::RAW, &other.block(0)).unwrap();

    let m2 = EngineMem::new(3, true);
    let b2 = e0.register(&m2);
    assert_eq!(load_counts(&mut e0, b2, &[(0, 1), (1, 9)]), [2, 1, 1]);
    assert_eq!((m2.block(0), m2.block(1)), (m1.block(0), other.block(0)));
    let st = a.stats();
    assert_eq!((st.promotions, st.borrow.lenders[&1].borrows), (1, 1), "device 0 is full: borrowed");
    assert_eq!(st.borrow.link_bytes[&(0, 1)], BLOCK as u64, "the promotion's fill crossed the link");
    assert_eq!(a.pool.lock().pool(1).unwrap().owner(&(ns, stored(9))), Some(0));
    // The next load is a G1 hit over the link, byte-identical.
    assert_eq!(load_counts(&mut e0, b2, &[(2, 9)]), [1, 1, 0]);
    assert_eq!(m2.block(2), other.block(0));
    assert_eq!(a.stats().borrow.link_bytes[&(0, 1)], 2 * BLOCK as u64);
}

/// A store whose spills wait until released (a stalled server); fetches find nothing.
#[derive(Clone, Default)]
struct GatedStore {
    open: Arc<(Mutex<bool>, parking_lot::Condvar)>,
}

impl GatedStore {
    fn release(&self) {
        *self.open.0.lock() = true;
        self.open.1.notify_all();
    }
}

impl Spill for GatedStore {
    fn spill(&self, _: &NamespaceId, _: &BlockKey, _: kvtier_proto::CodecId, _: &[u8]) -> Result<()> {
        let mut open = self.open.0.lock();
        while !*open {
            self.open.1.wait(&mut open);
        }
        Ok(())
    }
}

impl BackingStore for GatedStore {
    fn open_namespace(&self, _: &Namespace) -> Result<()> {
        Ok(())
    }
    fn fetch(&self, _: &NamespaceId, keys: &[BlockKey], _: usize, _: &mut [u8]) -> Result<Vec<bool>> {
        Ok(vec![false; keys.len()])
    }
}

#[test]
fn a_block_whose_eviction_is_still_being_spilled_is_loaded_but_not_promoted() {
    let mut cfg = AgentConfig::new(BLOCK);
    cfg.capacity = Capacity::Bytes(BLOCK);
    let store = GatedStore::default();
    let a = Arc::new(Agent::new(Arc::new(HostDevice::new(0, 16 << 20)), store.clone(), cfg).unwrap());
    let m = filled(3, 5);
    let mut e = Session::new(a.clone()).unwrap();
    let mut call = |req: Request, fd: Option<OwnedFd>| {
        let mut out = Vec::new();
        e.handle(1, req, fd, &mut |msg| {
            out.push(msg);
            Ok(())
        })
        .unwrap();
        parse(out)
    };
    assert_eq!(call(Request::Open(namespace()), None)[0].status(), 0);
    let reg = Request::Register { source: BufferSource::Memfd, len: 3 * BLOCK as u64, pages: 3 };
    let b = call(reg, Some(m.fd.try_clone().unwrap()))[0].u32s()[0];
    for k in [1u8, 2] {
        for layer in 0..LAYERS as u16 {
            let r = call(Request::Save { buffer: b, layer, items: items(&[(u32::from(k) - 1, k)]) }, None);
            assert_eq!(r[0].status(), 0, "{}", r[0].msg());
        }
    }
    // Block 1's spill is stalled: the load reads it in flight, and leaves G1 (block 2) alone —
    // its eviction has not been reported yet, so a promotion now would be reported before it.
    let got = call(Request::Load { buffer: b, items: items(&[(2, 1)]) }, None);
    assert_eq!(got[0].u32s(), [1, 0, 1]);
    assert_eq!(m.block(2), m.block(0));
    let st = a.stats();
    assert_eq!((st.promotions, st.promotions_skipped, st.pool.evictions), (0, 1, 1));
    assert_eq!(a.resident_keys(), [(namespace().id(), stored(2))]);
    store.release();
    assert!(a.wait_for_spills(Duration::from_secs(5)));
}

#[test]
fn an_engine_that_goes_away_before_a_promoting_load_starts_gives_the_reserved_page_back() {
    let a = agent(2, |_| {});
    let ns = namespace().id();
    let m = filled(4, 10);
    let mut e = Eng::new(&a);
    e.open();
    let b = e.register(&m);
    save_each(&mut e, b, &[1, 2, 3]);
    assert!(a.wait_for_spills(Duration::from_secs(5)));
    let gone = |_: Vec<u8>| Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "engine gone"));
    let r = e.s.handle(9, Request::Load { buffer: b, items: items(&[(3, 1)]) }, None, &mut { gone });
    assert!(r.is_err());
    let st = a.stats();
    assert_eq!((st.promotions, st.promotions_skipped, st.pool.pinned), (0, 1, 0));
    assert!(!a.resident_keys().contains(&(ns, stored(1))));
    assert_eq!(a.pool.lock().pool(0).unwrap().free_pages(), 1, "the reserved page is free again");
}
