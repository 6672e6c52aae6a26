//! The RDMA verbs mover (feature `rdma`, rdma-sys over libibverbs): one-sided READ and WRITE
//! between local registered memory and a peer's leased slot, on a reliable-connected queue pair.
//!
//! - [`RdmaDevice::open`] opens a verbs device (by name, or the first) and its port 1, and
//!   allocates a protection domain. With no verbs provider or device — every machine without an
//!   RDMA NIC, where `ibv_get_device_list` returns NULL with `ENOSYS` or an empty list — it is
//!   [`AgentError::NoRdmaDevice`] and the caller moves bytes over TCP/QUIC.
//! - Memory: [`BulkMover::register`] registers a [`HostBuffer`] (the arena, a staging buffer) for
//!   local write and remote read/write; [`RdmaDevice::register_dmabuf`] registers device pages
//!   exported as a dma-buf (GPUDirect RDMA) where the driver allows, and says
//!   [`AgentError::Unsupported`] where it does not.
//! - Connection: [`RdmaDevice::mover`] creates a queue pair and completion queue; the two sides
//!   exchange [`EndpointDescriptor`]s over the control plane and call [`RdmaMover::connect`]
//!   (INIT → RTR → RTS).
//! - Moves: one signalled work request per call, polled to completion with a deadline. A timeout
//!   moves the queue pair to the error state (flushing the request, so the NIC stops touching the
//!   memory) and breaks the mover. One request is in flight per mover at a time.
//!
//! None of this runs in CI (no RDMA device there); it is built and linted with `--features rdma`,
//! and its logic (descriptors, bounds, completion waits) is tested through the loopback mover.

use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rdma_sys::*;

use super::{
    check_move, wait_completion, BulkMover, Completion, CompletionQueue, EndpointDescriptor, MoverRegion,
    SlotDescriptor,
};
use crate::device::HostBuffer;
use crate::error::{AgentError, Result};

/// The port every mover uses.
const PORT: u8 = 1;
/// GID table index used on RoCE (index 0: the port's link-local GID).
const GID_INDEX: u8 = 0;
/// Completion queue depth.
const CQ_DEPTH: i32 = 64;
/// The largest single move: one work request's scatter entry holds a u32 length; larger moves
/// are split by the caller.
pub const MAX_MOVE: usize = 1 << 30;

fn rdma_err(op: &'static str) -> AgentError {
    AgentError::Rdma { op, detail: std::io::Error::last_os_error().to_string() }
}

fn rdma_rc(op: &'static str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        // Verbs calls return an errno value (or -1 with errno set).
        let e = if rc > 0 { std::io::Error::from_raw_os_error(rc) } else { std::io::Error::last_os_error() };
        Err(AgentError::Rdma { op, detail: e.to_string() })
    }
}

/// An open verbs device, its port's addressing and a protection domain. Cloning shares it.
#[derive(Clone)]
pub struct RdmaDevice {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    name: String,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    lid: u16,
    gid: [u8; 16],
    mtu: ibv_mtu::Type,
}

// SAFETY: libibverbs objects may be used from any thread (the library locks internally where it
// needs to); the raw pointers are only freed in Drop, once.
unsafe impl Send for DeviceInner {}
// SAFETY: as above.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: the PD and context were created in `open` and are released once, here, after
        // every region and mover (they hold this Arc) is gone.
        unsafe {
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

impl RdmaDevice {
    /// Opens device `name` (or the first one). [`AgentError::NoRdmaDevice`] when the machine has
    /// none.
    pub fn open(name: Option<&str>) -> Result<Self> {
        let mut n = 0i32;
        // SAFETY: `n` is a valid out-pointer; the list is freed below.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            return Err(AgentError::NoRdmaDevice(format!("ibv_get_device_list: {e}")));
        }
        // SAFETY: `list` holds `n` device pointers followed by NULL, valid until freed.
        let devices: Vec<*mut ibv_device> = (0..n.max(0) as usize).map(|i| unsafe { *list.add(i) }).collect();
        let dev_name = |d: *mut ibv_device| {
            // SAFETY: `d` is a device of the live list; the name is a NUL-terminated string.
            unsafe { CStr::from_ptr(ibv_get_device_name(d)) }.to_string_lossy().into_owned()
        };
        let chosen = match name {
            None => devices.first().copied(),
            Some(want) => devices.iter().copied().find(|d| dev_name(*d) == want),
        };
        let Some(dev) = chosen else {
            let names: Vec<String> = devices.iter().map(|d| dev_name(*d)).collect();
            // SAFETY: frees the list obtained above, once.
            unsafe { ibv_free_device_list(list) };
            return Err(AgentError::NoRdmaDevice(match name {
                None => "no RDMA devices on this machine".into(),
                Some(want) => format!("no RDMA device named {want} (have {names:?})"),
            }));
        };
        let name = dev_name(dev);
        // SAFETY: `dev` is a device of the live list; the context outlives the list.
        let ctx = unsafe { ibv_open_device(dev) };
        // SAFETY: frees the list obtained above, once (the opened context stays valid).
        unsafe { ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(rdma_err("ibv_open_device"));
        }
        let fail = |e: AgentError, pd: *mut ibv_pd| {
            // SAFETY: releases what this function created, once, on its error path.
            unsafe {
                if !pd.is_null() {
                    ibv_dealloc_pd(pd);
                }
                ibv_close_device(ctx);
            }
            Err(e)
        };
        // SAFETY: zeroed is a valid ibv_port_attr (plain integers) for the query to fill.
        let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `port` is a valid out-pointer of the size the call is told.
        if let Err(e) = rdma_rc("ibv_query_port", unsafe { ___ibv_query_port(ctx, PORT, &mut port) }) {
            return fail(e, std::ptr::null_mut());
        }
        // SAFETY: zeroed is a valid gid for the query to fill.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `gid` is a valid out-pointer.
        if let Err(e) = rdma_rc("ibv_query_gid", unsafe { ibv_query_gid(ctx, PORT, GID_INDEX.into(), &mut gid) }) {
            return fail(e, std::ptr::null_mut());
        }
        // SAFETY: `ctx` is open.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return fail(rdma_err("ibv_alloc_pd"), pd);
        }
        Ok(RdmaDevice {
            inner: Arc::new(DeviceInner {
                name,
                ctx,
                pd,
                lid: port.lid,
                // SAFETY: every bit pattern of the union is a valid byte array.
                gid: unsafe { gid.raw },
                mtu: port.active_mtu,
            }),
        })
    }

    /// The device's name (`mlx5_0`, ...).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// A new mover (queue pair and completion queue), ready to [`RdmaMover::connect`].
    pub fn mover(&self) -> Result<RdmaMover> {
        let d = &self.inner;
        // SAFETY: `ctx` is open; no completion channel.
        let cq = unsafe { ibv_create_cq(d.ctx, CQ_DEPTH, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(rdma_err("ibv_create_cq"));
        }
        // SAFETY: zeroed is a valid ibv_qp_init_attr (pointers null, numbers 0); fields set below.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap = ibv_qp_cap { max_send_wr: 16, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        // SAFETY: the PD is live; `init` is a valid attribute struct.
        let qp = unsafe { ibv_create_qp(d.pd, &mut init) };
        if qp.is_null() {
            let e = rdma_err("ibv_create_qp");
            // SAFETY: the CQ was created above and is unused.
            unsafe { ibv_destroy_cq(cq) };
            return Err(e);
        }
        // SAFETY: `qp` was just created and is live.
        let qpn = unsafe { (*qp).qp_num };
        let mover = RdmaMover {
            dev: d.clone(),
            cq,
            qp,
            local: EndpointDescriptor { qpn, psn: psn_for(qp as usize), lid: d.lid, gid: d.gid },
            state: Mutex::new(State::Reset),
            next_wr: AtomicU64::new(1),
        };
        mover.to_init()?;
        Ok(mover)
    }

    /// Registers `len` bytes at `base` — memory this crate does not own, such as the server's
    /// DRAM arena that it leases to peers slot by slot — for local use and remote reads and
    /// writes; peers name it by its virtual address.
    ///
    /// # Safety
    /// `base..base + len` must stay mapped until the returned registration is dropped.
    pub unsafe fn register_raw(&self, base: *mut u8, len: usize) -> Result<RdmaMemoryRegion> {
        if len == 0 {
            return Err(AgentError::Rdma { op: "ibv_reg_mr", detail: "cannot register an empty range".into() });
        }
        // SAFETY: the PD is live; the caller keeps `base..base + len` mapped while registered.
        let mr = unsafe { ibv_reg_mr(self.inner.pd, base as *mut _, len, access_flags()) };
        if mr.is_null() {
            return Err(rdma_err("ibv_reg_mr"));
        }
        Ok(RdmaMemoryRegion { mr, iova: base as u64, len, _dev: self.inner.clone() })
    }

    /// Registers `len` bytes at `offset` of a dma-buf (device pages a GPU driver exported: with
    /// the `cuda` feature, `CudaDevice::export_dmabuf`), at remote address `iova`, so that peers
    /// can move into and out of device memory directly. The registration keeps its own reference
    /// to the dma-buf; `fd` may be closed afterwards. [`AgentError::Unsupported`] where the kernel,
    /// the NIC driver or the GPU driver cannot (the caller then stages through host memory).
    pub fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<RdmaMemoryRegion> {
        let access = access_flags();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&fd);
        // SAFETY: the PD is live; `fd` is an open descriptor for the call; the kernel checks that it
        // is a dma-buf, and the range and access.
        let mr = unsafe { ibv_reg_dmabuf_mr(self.inner.pd, offset, len, iova, fd, access) };
        if mr.is_null() {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                // EOPNOTSUPP, ENOSYS: the provider or kernel has no dma-buf registration.
                Some(95 | 38) => {
                    AgentError::Unsupported(format!("dma-buf memory registration on {}: {e}", self.inner.name))
                }
                _ => AgentError::Rdma { op: "ibv_reg_dmabuf_mr", detail: e.to_string() },
            });
        }
        Ok(RdmaMemoryRegion { mr, iova, len, _dev: self.inner.clone() })
    }
}

/// A per-mover initial packet sequence number (24 bits), different for each queue pair.
fn psn_for(seed: usize) -> u32 {
    let mut z = (seed as u64) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) & 0xFF_FFFF) as u32
}

fn access_flags() -> i32 {
    (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
        .0 as i32
}

/// Host memory registered with a device; deregistered on drop.
pub struct RdmaRegion {
    buf: HostBuffer,
    mr: *mut ibv_mr,
    _dev: Arc<DeviceInner>,
}

// SAFETY: the MR is an immutable kernel object after registration; it is deregistered once.
unsafe impl Send for RdmaRegion {}
// SAFETY: as above.
unsafe impl Sync for RdmaRegion {}

impl RdmaRegion {
    fn keys(&self) -> (u32, u32) {
        // SAFETY: `mr` is live until drop.
        unsafe { ((*self.mr).lkey, (*self.mr).rkey) }
    }
}

impl MoverRegion for RdmaRegion {
    fn buffer(&self) -> &HostBuffer {
        &self.buf
    }
}

impl Drop for RdmaRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once; the buffer (held by `buf`) outlives
        // the registration.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// Memory registered by address or through dma-buf (device pages), named by peers from `iova`;
/// deregistered on drop.
pub struct RdmaMemoryRegion {
    mr: *mut ibv_mr,
    iova: u64,
    len: usize,
    _dev: Arc<DeviceInner>,
}

// SAFETY: as for RdmaRegion.
unsafe impl Send for RdmaMemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for RdmaMemoryRegion {}

impl RdmaMemoryRegion {
    /// The descriptor of `len` bytes at `offset` of the registered memory, for a peer.
    pub fn describe(&self, offset: usize, len: usize) -> Result<SlotDescriptor> {
        crate::device::check_bounds("registered region", offset, len, self.len)?;
        Ok(SlotDescriptor { addr: self.iova + offset as u64, rkey: self.rkey(), len: len as u64 })
    }

    /// The key peers name the registration by.
    pub fn rkey(&self) -> u32 {
        // SAFETY: `mr` is live until drop.
        unsafe { (*self.mr).rkey }
    }

    /// The address peers name the first registered byte by.
    pub fn iova(&self) -> u64 {
        self.iova
    }
}

impl Drop for RdmaMemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register_raw` or `register_dmabuf`, deregistered once.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reset,
    Init,
    Connected,
    Broken,
}

/// One reliable connection to one peer, and its completion queue.
pub struct RdmaMover {
    dev: Arc<DeviceInner>,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    local: EndpointDescriptor,
    /// Also serializes moves: one request in flight.
    state: Mutex<State>,
    next_wr: AtomicU64,
}

// SAFETY: the QP and CQ are used under `state`'s lock (posting and polling) or read-only
// (`qp_num`); they are destroyed once, in Drop.
unsafe impl Send for RdmaMover {}
// SAFETY: as above.
unsafe impl Sync for RdmaMover {}

impl Drop for RdmaMover {
    fn drop(&mut self) {
        // SAFETY: created in `RdmaDevice::mover`, destroyed once, QP before its CQ.
        unsafe {
            ibv_destroy_qp(self.qp);
            ibv_destroy_cq(self.cq);
        }
    }
}

impl RdmaMover {
    /// This side's endpoint, to send to the peer.
    pub fn endpoint(&self) -> EndpointDescriptor {
        self.local
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, op: &'static str) -> Result<()> {
        // SAFETY: `qp` is live; `attr` is a valid attribute struct for the fields in `mask`.
        rdma_rc(op, unsafe { ibv_modify_qp(self.qp, attr, mask.0 as i32) })
    }

    fn to_init(&self) -> Result<()> {
        // SAFETY: zeroed is a valid ibv_qp_attr (all integers and plain unions).
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = PORT;
        a.qp_access_flags = access_flags() as u32;
        let m = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut a, m, "ibv_modify_qp(INIT)")?;
        *self.state.lock() = State::Init;
        Ok(())
    }

    /// Connects to the peer's endpoint (INIT → RTR → RTS). Both sides must connect before either
    /// moves.
    pub fn connect(&self, remote: &EndpointDescriptor) -> Result<()> {
        let mut state = self.state.lock();
        if *state != State::Init {
            return Err(AgentError::Rdma { op: "connect", detail: format!("queue pair is {state:?}, not Init") });
        }
        // SAFETY: as in to_init.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.dev.mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = PORT;
        if remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = GID_INDEX;
            a.ah_attr.grh.hop_limit = 1;
        }
        let m = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, m, "ibv_modify_qp(RTR)")?;
        // SAFETY: as in to_init.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = self.local.psn;
        a.max_rd_atomic = 1;
        let m = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, m, "ibv_modify_qp(RTS)")?;
        *state = State::Connected;
        Ok(())
    }

    /// Posts one signalled one-sided request and waits for it.
    fn one_sided(
        &self,
        op: &'static str,
        opcode: ibv_wr_opcode::Type,
        local: &RdmaRegion,
        local_offset: usize,
        remote: SlotDescriptor,
        timeout: Duration,
    ) -> Result<()> {
        let len = remote.len as usize;
        if len > MAX_MOVE {
            return Err(AgentError::Rdma { op, detail: format!("{len} bytes is more than one request ({MAX_MOVE})") });
        }
        let mut state = self.state.lock();
        match *state {
            State::Connected => {}
            State::Broken => {
                return Err(AgentError::Rdma { op, detail: "mover broken by an earlier timeout; reconnect".into() })
            }
            s => return Err(AgentError::Rdma { op, detail: format!("queue pair is {s:?}, not connected") }),
        }
        if len == 0 {
            return Ok(());
        }
        let (lkey, _) = local.keys();
        let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let mut sge = ibv_sge { addr: (local.buf.addr() + local_offset) as u64, length: len as u32, lkey };
        // SAFETY: zeroed is a valid ibv_send_wr (null pointers, zero numbers, plain unions).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = opcode;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr = wr_t { rdma: rdma_t { remote_addr: remote.addr, rkey: remote.rkey } };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is connected; `wr` and `sge` live across the call (the provider copies
        // them into the send queue); the local range was checked inside the registered buffer,
        // which the region keeps alive and registered while this call waits for the completion.
        rdma_rc("ibv_post_send", unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) })?;
        let r = wait_completion(self, wr_id, op, timeout);
        if matches!(r, Err(AgentError::Timeout { .. })) {
            // Flush the request so the NIC stops touching the memory, and refuse further moves.
            *state = State::Broken;
            // SAFETY: as in to_init.
            let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.qp_state = ibv_qp_state::IBV_QPS_ERR;
            let _ = self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ibv_modify_qp(ERR)");
            let _ = wait_completion(self, wr_id, op, Duration::from_secs(1));
        }
        r
    }
}

impl CompletionQueue for RdmaMover {
    fn poll(&self) -> Result<Vec<Completion>> {
        // SAFETY: zeroed is a valid ibv_wc for the provider to fill.
        let mut wcs: [ibv_wc; 8] = unsafe { std::mem::zeroed() };
        // SAFETY: the CQ is live; `wcs` has room for 8 entries.
        let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(AgentError::Rdma { op: "ibv_poll_cq", detail: format!("returned {n}") });
        }
        Ok(wcs[..n as usize]
            .iter()
            .map(|wc| Completion {
                wr_id: wc.wr_id,
                result: match wc.status {
                    ibv_wc_status::IBV_WC_SUCCESS => Ok(()),
                    s => {
                        // SAFETY: returns a static string for any status value.
                        let what = unsafe { CStr::from_ptr(ibv_wc_status_str(s)) }.to_string_lossy().into_owned();
                        if s == ibv_wc_status::IBV_WC_REM_ACCESS_ERR {
                            Err(AgentError::RemoteAccess(what))
                        } else {
                            Err(AgentError::Rdma {
                                op: "completion",
                                detail: format!("{what} (vendor {:#x})", wc.vendor_err),
                            })
                        }
                    }
                },
            })
            .collect())
    }
}

impl BulkMover for RdmaMover {
    type Region = RdmaRegion;

    fn register(&self, buf: &HostBuffer) -> Result<RdmaRegion> {
        if buf.is_empty() {
            return Err(AgentError::Rdma { op: "ibv_reg_mr", detail: "cannot register an empty buffer".into() });
        }
        // SAFETY: the PD is live; `addr..addr + len` is the heap block of `buf`, which never moves
        // while the region (holding a clone) lives, and is deregistered in the region's Drop.
        let mr = unsafe { ibv_reg_mr(self.dev.pd, buf.addr() as *mut _, buf.len(), access_flags()) };
        if mr.is_null() {
            return Err(rdma_err("ibv_reg_mr"));
        }
        Ok(RdmaRegion { buf: buf.clone(), mr, _dev: self.dev.clone() })
    }

    fn describe(&self, region: &RdmaRegion, offset: usize, len: usize) -> Result<SlotDescriptor> {
        crate::device::check_bounds("mover region", offset, len, region.buf.len())?;
        Ok(SlotDescriptor { addr: (region.buf.addr() + offset) as u64, rkey: region.keys().1, len: len as u64 })
    }

    fn write(
        &self,
        local: &RdmaRegion,
        local_offset: usize,
        slot: &SlotDescriptor,
        slot_offset: u64,
        len: usize,
        timeout: Duration,
    ) -> Result<()> {
        let window = check_move(&local.buf, local_offset, slot, slot_offset, len)?;
        self.one_sided("RDMA WRITE", ibv_wr_opcode::IBV_WR_RDMA_WRITE, local, local_offset, window, timeout)
    }

    fn read(
        &self,
        slot: &SlotDescriptor,
        slot_offset: u64,
        local: &RdmaRegion,
        local_offset: usize,
        len: usize,
        timeout: Duration,
    ) -> Result<()> {
        let window = check_move(&local.buf, local_offset, slot, slot_offset, len)?;
        self.one_sided("RDMA READ", ibv_wr_opcode::IBV_WR_RDMA_READ, local, local_offset, window, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs everywhere: on a machine without an RDMA device opening one is `NoRdmaDevice`, never a
    /// panic; an unknown name is the same error.
    #[test]
    fn no_device_is_a_clear_error() {
        match RdmaDevice::open(None) {
            Err(AgentError::NoRdmaDevice(why)) => {
                assert!(why.contains("ibv_get_device_list") || why.contains("no RDMA devices"), "{why}");
                assert!(AgentError::NoRdmaDevice(why).to_string().contains("TCP/QUIC"));
            }
            Err(other) => panic!("expected NoRdmaDevice, got {other:?}"),
            Ok(dev) => assert!(!dev.name().is_empty()),
        }
        assert!(matches!(RdmaDevice::open(Some("no-such-device")), Err(AgentError::NoRdmaDevice(_))));
    }

    /// Two movers of one device connected to each other (an active port needed): a WRITE into a
    /// leased slot and a READ back, exact bytes; a move past the lease is refused before posting.
    #[test]
    #[ignore = "needs an RDMA device with an active port"]
    fn loopback_connection_moves_bytes() {
        let dev = RdmaDevice::open(None).unwrap();
        let (a, b) = (dev.mover().unwrap(), dev.mover().unwrap());
        a.connect(&b.endpoint()).unwrap();
        b.connect(&a.endpoint()).unwrap();
        let arena = b.register(&HostBuffer::new(8192)).unwrap();
        let slot = crate::mover::decode_slot(&b.describe(&arena, 4096, 4096).unwrap().encode()).unwrap();
        let src = a.register(&HostBuffer::from_vec((0..8192u32).map(|i| (i * 13) as u8).collect())).unwrap();
        let t = Duration::from_secs(5);
        a.write(&src, 0, &slot, 0, 4096, t).unwrap();
        assert_eq!(&arena.buffer().to_vec()[4096..], &src.buffer().to_vec()[..4096]);
        a.read(&slot, 100, &src, 4096, 1000, t).unwrap();
        assert_eq!(&src.buffer().to_vec()[4096..5096], &src.buffer().to_vec()[100..1100]);
        assert!(matches!(a.write(&src, 0, &slot, 4000, 200, t), Err(AgentError::OutsideLease { .. })));
    }
}
