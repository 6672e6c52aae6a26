//! The CUDA backend (cargo feature `cuda`): the [`Device`] contract through cudarc's driver API,
//! with the driver and NVRTC loaded at run time. The build needs no CUDA toolkit; on a machine
//! without a driver [`CudaDevice::new`] returns [`AgentError::DeviceUnavailable`] (it checks for
//! the library before cudarc would panic on its absence).
//!
//! - Device memory: `cuMemAlloc` allocations behind the same handle table as the host backend,
//!   so bounds, freed and foreign handles are refused before the driver sees them. `free`
//!   synchronizes the context first, so copies already enqueued on the memory finish.
//! - Host memory: [`HostBuffer`]s pinned with `cuMemHostRegister` (portable); unregistered on
//!   drop of the [`Registration`], after the context has drained. Each stream keeps the host
//!   buffers of its in-flight copies alive until an event recorded after them completes. One
//!   buffer can be registered with one CUDA device of a process at a time (the driver pins a
//!   range once; a second device gets [`AgentError::Driver`]).
//! - Events are created with blocking sync, so a wait sleeps instead of spinning.
//! - IPC: an engine's exported allocation is opened with `cuIpcOpenMemHandle` (lazy peer
//!   access) into the same handle table and closed by `free`. The driver refuses handles the same
//!   process exported, so this path needs the engine in another process (not in these tests).
//! - Codec kernels: [`crate::codec::cuda_source`] (FP8, NVFP4 and their `+had` forms) compiled by
//!   NVRTC on first use, with precise division and no FMA contraction; [`Device::launch_codec`]
//!   picks the kernels by codec id (NVFP4 encodes are three launches: plane amaxes, block scales
//!   and codes, global scales).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use parking_lot::Mutex;

use super::{
    check_lengths, check_no_overlap, CodecOp, Device, DeviceBuf, DeviceOrdinal, DeviceRange, HostBuffer, HostRange,
    IpcHandle, MemInfo, Registration,
};
use crate::codec::{
    cuda_source, kernel_dtype, FP8_DECODE_KERNEL, FP8_ENCODE_KERNEL, FP8_ROWS_PER_BLOCK, QUANT_KERNELS,
};
use crate::error::{AgentError, Result};
use kvtier_proto::{CodecId, MemoryOrder};

mod report;
pub use report::gpu_report;

fn driver(op: &'static str) -> impl Fn(result::DriverError) -> AgentError {
    move |e| AgentError::Driver { op, detail: e.to_string() }
}

/// Whether a CUDA driver library can be loaded on this machine (it says nothing of GPUs).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver's candidate library names and drops what it opened.
    unsafe { sys::is_culib_present() }
}

/// One GPU through the CUDA driver. Cloning shares it.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: DeviceOrdinal,
    ctx: Arc<CudaContext>,
    table: Mutex<Table>,
    kernels: OnceLock<std::result::Result<Kernels, AgentError>>,
    /// Events other devices recorded after peer copies touching this device's memory; `free`
    /// waits for them (its own context synchronize does not cover other devices' streams).
    foreign: Mutex<Vec<CudaEvent>>,
}

struct Table {
    next_id: u64,
    /// Device addresses; `true` for memory imported from another process (closed with
    /// `cuIpcCloseMemHandle`, not freed).
    live: HashMap<u64, (CUdeviceptr, bool)>,
}

/// Unmaps an import or frees an allocation of the bound context.
///
/// # Safety
/// `ptr` came from `cuIpcOpenMemHandle` (`imported`) or `cuMemAlloc` in the bound context, is
/// released once, and no enqueued work uses it any more.
unsafe fn release(ptr: CUdeviceptr, imported: bool) -> std::result::Result<(), result::DriverError> {
    if imported {
        // SAFETY: the caller's contract.
        unsafe { sys::cuIpcCloseMemHandle(ptr) }.result()
    } else {
        // SAFETY: the caller's contract.
        unsafe { result::free_sync(ptr) }
    }
}

struct Kernels {
    encode: CudaFunction,
    decode: CudaFunction,
    /// [`QUANT_KERNELS`], in that order.
    quant: Vec<CudaFunction>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
        for ev in self.foreign.get_mut().drain(..) {
            let _ = ev.synchronize();
        }
        let _ = self.ctx.bind_to_thread();
        for (_, (ptr, imported)) in self.table.get_mut().live.drain() {
            // SAFETY: every address in the table came from cuMemAlloc or cuIpcOpenMemHandle in
            // this context (bound by the synchronize above) and was not released (free removes it
            // first); the context has drained, so nothing uses it.
            let _ = unsafe { release(ptr, imported) };
        }
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal`. Without a driver library, or without that GPU:
    /// [`AgentError::DeviceUnavailable`], never a panic.
    pub fn new(ordinal: DeviceOrdinal) -> Result<Self> {
        if !driver_present() {
            return Err(AgentError::DeviceUnavailable("no CUDA driver library (libcuda.so) on this machine".into()));
        }
        let ctx = CudaContext::new(ordinal as usize)
            .map_err(|e| AgentError::DeviceUnavailable(format!("CUDA device {ordinal}: {e}")))?;
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                ordinal,
                ctx,
                table: Mutex::new(Table { next_id: 1, live: HashMap::new() }),
                kernels: OnceLock::new(),
                foreign: Mutex::new(Vec::new()),
            }),
        })
    }

    /// How many GPUs the driver reports. [`AgentError::DeviceUnavailable`] without a driver.
    pub fn count() -> Result<u32> {
        if !driver_present() {
            return Err(AgentError::DeviceUnavailable("no CUDA driver library (libcuda.so) on this machine".into()));
        }
        let n = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> Result<String> {
        self.inner.ctx.name().map_err(driver("cuDeviceGetName"))
    }

    /// Exports `range` of device memory as a dma-buf file descriptor, so that a NIC can register
    /// the device pages themselves (GPUDirect RDMA: `mover::rdma::RdmaDevice::register_dmabuf`,
    /// feature `rdma`). [`AgentError::Unsupported`] where the GPU or driver has no dma-buf export
    /// (it needs the open kernel modules); the driver also refuses ranges that are not page-aligned.
    pub fn export_dmabuf(&self, range: DeviceRange) -> Result<std::os::fd::OwnedFd> {
        let ptr = self.range_ptr(&range, "dma-buf")?;
        self.bind()?;
        let supported = self
            .inner
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .map_err(driver("cuDeviceGetAttribute"))?;
        if supported == 0 {
            return Err(AgentError::Unsupported(format!("GPU {} cannot export dma-buf handles", self.inner.ordinal)));
        }
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `ptr..ptr + len` is a checked range of a live allocation of the bound context;
        // `fd` is a valid place for the driver to write a descriptor.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                ptr,
                range.len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(|e| match e.0 {
            sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => {
                AgentError::Unsupported(format!("dma-buf export on GPU {}: {e}", self.inner.ordinal))
            }
            _ => driver("cuMemGetHandleForAddressRange")(e),
        })?;
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
    }

    fn bind(&self) -> Result<()> {
        self.inner.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }

    fn ptr(&self, buf: &DeviceBuf) -> Result<CUdeviceptr> {
        if buf.device() != self.inner.ordinal {
            return Err(AgentError::WrongDevice { expected: self.inner.ordinal, found: buf.device() });
        }
        let t = self.inner.table.lock();
        match t.live.get(&buf.id()) {
            Some((p, _)) => Ok(*p),
            None if buf.id() < t.next_id => Err(AgentError::FreedHandle(buf.id())),
            None => Err(AgentError::UnknownHandle(buf.id())),
        }
    }

    /// The device address of a checked range.
    fn range_ptr(&self, r: &DeviceRange, what: &'static str) -> Result<CUdeviceptr> {
        let base = self.ptr(&r.buf)?;
        r.check(what)?;
        Ok(base + r.offset as u64)
    }

    fn check_stream(&self, s: &CudaStreamHandle) -> Result<()> {
        if s.device != self.inner.ordinal {
            return Err(AgentError::WrongDevice { expected: self.inner.ordinal, found: s.device });
        }
        Ok(())
    }

    fn kernels(&self) -> Result<&Kernels> {
        self.inner
            .kernels
            .get_or_init(|| {
                // SAFETY: only tries to dlopen NVRTC's candidate library names.
                if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                    return Err(AgentError::DeviceUnavailable("no NVRTC library (libnvrtc.so) on this machine".into()));
                }
                let opts = cudarc::nvrtc::CompileOptions {
                    ftz: Some(false),
                    prec_div: Some(true),
                    fmad: Some(false),
                    ..Default::default()
                };
                let ptx = cudarc::nvrtc::compile_ptx_with_opts(cuda_source(), opts)
                    .map_err(|e| AgentError::Driver { op: "nvrtcCompileProgram", detail: e.to_string() })?;
                let module = self.inner.ctx.load_module(ptx).map_err(driver("cuModuleLoadData"))?;
                Ok(Kernels {
                    encode: module.load_function(FP8_ENCODE_KERNEL).map_err(driver("cuModuleGetFunction"))?,
                    decode: module.load_function(FP8_DECODE_KERNEL).map_err(driver("cuModuleGetFunction"))?,
                    quant: QUANT_KERNELS
                        .iter()
                        .map(|k| module.load_function(k).map_err(driver("cuModuleGetFunction")))
                        .collect::<Result<_>>()?,
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// A CUDA stream and the host buffers its in-flight copies use.
pub struct CudaStreamHandle {
    device: DeviceOrdinal,
    stream: Arc<CudaStream>,
    /// Host buffers of copies not yet known to be done, each with an event recorded after its
    /// copy. Pruned on every enqueue; drained (after a synchronize) on drop.
    in_flight: Mutex<Vec<(CudaEvent, HostBuffer)>>,
}

impl CudaStreamHandle {
    /// Keeps `buf` alive until the work enqueued so far has run.
    fn keep(&self, buf: &HostBuffer) -> Result<()> {
        let ev = self.stream.record_event(None).map_err(driver("cuEventRecord"))?;
        let mut f = self.in_flight.lock();
        f.retain(|(e, _)| !matches!(e.try_is_complete(), Ok(true)));
        f.push((ev, buf.clone()));
        Ok(())
    }
}

impl Drop for CudaStreamHandle {
    fn drop(&mut self) {
        // The buffers may be released only after their copies: wait for them (errors are the
        // context's to report; never panic here).
        let _ = self.stream.synchronize();
        self.in_flight.get_mut().clear();
    }
}

/// A CUDA event (shared).
#[derive(Clone)]
pub struct CudaEventHandle(Arc<CudaEvent>);

impl Device for CudaDevice {
    type Stream = CudaStreamHandle;
    type Event = CudaEventHandle;

    fn ordinal(&self) -> DeviceOrdinal {
        self.inner.ordinal
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let (free, total) = self.inner.ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
        Ok(MemInfo { free, total })
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuf> {
        self.bind()?;
        // SAFETY: allocates fresh device memory in the bound context; its contents are only ever
        // read as bytes. A zero-length buffer gets one byte so that it has an address.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.map_err(|e| match e.0 {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                AgentError::OutOfMemory { requested: len, free: self.mem_info().map_or(0, |m| m.free) }
            }
            _ => driver("cuMemAlloc")(e),
        })?;
        let mut t = self.inner.table.lock();
        let id = t.next_id;
        t.next_id += 1;
        t.live.insert(id, (ptr, false));
        Ok(DeviceBuf::new(self.inner.ordinal, id, len))
    }

    fn export_ipc(&self, buf: DeviceBuf) -> Result<IpcHandle> {
        let ptr = self.ptr(&buf)?;
        if self.inner.table.lock().live.get(&buf.id()).is_some_and(|(_, imported)| *imported) {
            return Err(AgentError::BadIpcHandle("imported memory cannot be exported again".into()));
        }
        self.bind()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `ptr` is a live cuMemAlloc allocation of the bound context; `h` is a valid
        // handle to write.
        unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) }.result().map_err(driver("cuIpcGetMemHandle"))?;
        Ok(IpcHandle::from_bytes(h.reserved.map(|c| c as u8), buf.len()))
    }

    fn import_ipc(&self, handle: &IpcHandle) -> Result<DeviceBuf> {
        self.bind()?;
        let h = sys::CUipcMemHandle { reserved: handle.bytes().map(|b| b as std::ffi::c_char) };
        let mut ptr: CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
        // SAFETY: `ptr` is a valid place for the mapped address; the driver checks the handle.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) }
            .result()
            .map_err(|e| AgentError::BadIpcHandle(format!("cuIpcOpenMemHandle: {e}")))?;
        // The handle's length is the exporter's word; copies are checked against it.
        let mut t = self.inner.table.lock();
        let id = t.next_id;
        t.next_id += 1;
        t.live.insert(id, (ptr, true));
        Ok(DeviceBuf::new(self.inner.ordinal, id, handle.len()))
    }

    fn free(&self, buf: DeviceBuf) -> Result<()> {
        if buf.device() != self.inner.ordinal {
            return Err(AgentError::WrongDevice { expected: self.inner.ordinal, found: buf.device() });
        }
        let (ptr, imported) = {
            let mut t = self.inner.table.lock();
            match t.live.remove(&buf.id()) {
                Some(p) => p,
                None if buf.id() < t.next_id => return Err(AgentError::FreedHandle(buf.id())),
                None => return Err(AgentError::UnknownHandle(buf.id())),
            }
        };
        self.bind()?;
        // Copies already enqueued on the memory finish first (the contract), peers' included.
        self.inner.ctx.synchronize().map_err(driver("cuCtxSynchronize"))?;
        for ev in self.inner.foreign.lock().drain(..) {
            ev.synchronize().map_err(driver("cuEventSynchronize"))?;
        }
        self.bind()?;
        // SAFETY: `ptr` came from cuMemAlloc or cuIpcOpenMemHandle in this context and was just
        // removed from the table, so it is released exactly once; the context has drained, so no
        // work uses it.
        unsafe { release(ptr, imported) }.map_err(driver("cuMemFree"))
    }

    fn register_host(&self, buf: &HostBuffer) -> Result<Registration> {
        if buf.is_registered(self.inner.ordinal) {
            return Err(AgentError::AlreadyRegistered { buffer: buf.id(), device: self.inner.ordinal });
        }
        if buf.is_empty() {
            // Nothing to pin (and the driver refuses an empty range).
            return buf.register(self.inner.ordinal, None);
        }
        self.bind()?;
        let addr = buf.addr();
        // SAFETY: `addr..addr + len` is the heap block of `buf`, which never moves or shrinks
        // while any clone of it lives; the Registration returned holds a clone, so the memory
        // outlives the registration.
        unsafe { sys::cuMemHostRegister_v2(addr as *mut _, buf.len(), sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(driver("cuMemHostRegister"))?;
        let ctx = self.inner.ctx.clone();
        let unregister = move || {
            let _ = ctx.bind_to_thread();
            let _ = ctx.synchronize();
            // SAFETY: `addr` was registered above and is unregistered once, here; the buffer is
            // still alive (the Registration holds it until after this runs).
            let _ = unsafe { sys::cuMemHostUnregister(addr as *mut _) };
        };
        buf.register(self.inner.ordinal, Some(Box::new(unregister)))
    }

    fn new_stream(&self) -> Result<CudaStreamHandle> {
        let stream = self.inner.ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        Ok(CudaStreamHandle { device: self.inner.ordinal, stream, in_flight: Mutex::new(Vec::new()) })
    }

    fn copy_h2d(&self, stream: &CudaStreamHandle, src: &HostRange, dst: DeviceRange) -> Result<()> {
        self.check_stream(stream)?;
        src.buf.require_registered(self.inner.ordinal)?;
        src.check()?;
        let d = self.range_ptr(&dst, "device destination")?;
        check_lengths(src.len, dst.len)?;
        self.bind()?;
        let host = (src.buf.addr() + src.offset) as *const std::ffi::c_void;
        // SAFETY: both ranges were checked against their buffers; the host buffer is pinned
        // (registered) and kept alive by `keep` until this copy has run; the device memory is
        // freed only after a context synchronize.
        unsafe { sys::cuMemcpyHtoDAsync_v2(d, host, src.len, stream.stream.cu_stream()) }
            .result()
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream.keep(&src.buf)
    }

    fn copy_d2h(&self, stream: &CudaStreamHandle, src: DeviceRange, dst: &HostRange) -> Result<()> {
        self.check_stream(stream)?;
        dst.buf.require_registered(self.inner.ordinal)?;
        dst.check()?;
        let s = self.range_ptr(&src, "device source")?;
        check_lengths(src.len, dst.len)?;
        self.bind()?;
        let host = (dst.buf.addr() + dst.offset) as *mut std::ffi::c_void;
        // SAFETY: as in copy_h2d; the host range is written only by this copy until its event
        // (the contract tells the CPU not to look before).
        unsafe { sys::cuMemcpyDtoHAsync_v2(host, s, src.len, stream.stream.cu_stream()) }
            .result()
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        stream.keep(&dst.buf)
    }

    fn copy_d2d(&self, stream: &CudaStreamHandle, src: DeviceRange, dst: DeviceRange) -> Result<()> {
        self.check_stream(stream)?;
        let s = self.range_ptr(&src, "device source")?;
        let d = self.range_ptr(&dst, "device destination")?;
        check_lengths(src.len, dst.len)?;
        check_no_overlap(src, dst)?;
        self.bind()?;
        // SAFETY: both ranges were checked against live allocations of this context and do not
        // overlap; memory is freed only after a context synchronize.
        unsafe { result::memcpy_dtod_async(d, s, src.len, stream.stream.cu_stream()) }
            .map_err(driver("cuMemcpyDtoDAsync"))
    }

    fn enable_peer_access(&self, peer: &CudaDevice) -> Result<bool> {
        if Arc::ptr_eq(&self.inner, &peer.inner) || self.inner.ordinal == peer.inner.ordinal {
            return Ok(true);
        }
        let mut can: std::ffi::c_int = 0;
        // SAFETY: `can` is a valid place for the driver to write; both devices are ones the
        // driver handed out (their contexts are alive).
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.inner.ctx.cu_device(), peer.inner.ctx.cu_device()) }
            .result()
            .map_err(driver("cuDeviceCanAccessPeer"))?;
        if can == 0 {
            return Ok(false);
        }
        self.bind()?;
        // SAFETY: the peer's context is alive (held by `peer`); the call only maps it for this,
        // the bound, context.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
            // The driver's limit of peers per device, or a pair it won't map after all: the pair
            // copies through the host.
            sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => Ok(false),
            e => Err(driver("cuCtxEnablePeerAccess")(result::DriverError(e))),
        }
    }

    fn disable_peer_access(&self, peer: &CudaDevice) -> Result<()> {
        if Arc::ptr_eq(&self.inner, &peer.inner) || self.inner.ordinal == peer.inner.ordinal {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the peer's context is alive (held by `peer`); the call only unmaps it for the
        // bound context, and nothing of ours uses the mapping (the pair is not linked).
        match unsafe { sys::cuCtxDisablePeerAccess(peer.inner.ctx.cu_ctx()) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED => Ok(()),
            e => Err(driver("cuCtxDisablePeerAccess")(result::DriverError(e))),
        }
    }

    fn copy_peer(
        &self,
        stream: &CudaStreamHandle,
        src_dev: &CudaDevice,
        src: DeviceRange,
        dst_dev: &CudaDevice,
        dst: DeviceRange,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let s = src_dev.range_ptr(&src, "peer source")?;
        let d = dst_dev.range_ptr(&dst, "peer destination")?;
        check_lengths(src.len, dst.len)?;
        if Arc::ptr_eq(&src_dev.inner, &dst_dev.inner) {
            check_no_overlap(src, dst)?;
        }
        self.bind()?;
        // SAFETY: both ranges were checked against live allocations of their own devices'
        // contexts. A device frees memory only after synchronizing its own context and waiting
        // for the events peers recorded after their copies of it (`foreign` below).
        unsafe {
            result::memcpy_peer_async(
                dst_dev.inner.ctx.cu_ctx(),
                d,
                src_dev.inner.ctx.cu_ctx(),
                s,
                src.len,
                stream.stream.cu_stream(),
            )
        }
        .map_err(driver("cuMemcpyPeerAsync"))?;
        for other in [src_dev, dst_dev] {
            if !Arc::ptr_eq(&other.inner, &self.inner) {
                let ev = stream.stream.record_event(None).map_err(driver("cuEventRecord"))?;
                let mut f = other.inner.foreign.lock();
                f.retain(|e| !matches!(e.try_is_complete(), Ok(true)));
                f.push(ev);
            }
        }
        Ok(())
    }

    fn launch_codec(&self, stream: &CudaStreamHandle, op: &CodecOp) -> Result<()> {
        self.check_stream(stream)?;
        let (rows, hd) = op.validate()?;
        let (codec, seed, spec, ..) = op.parts();
        let [input, output, status] = op.buffers();
        let (i, o, st) =
            (self.range_ptr(&input, "codec")?, self.range_ptr(&output, "codec")?, self.range_ptr(&status, "codec")?);
        let dtype =
            kernel_dtype(spec.dtype).ok_or_else(|| AgentError::Codec(format!("no kernel for {:?}", spec.dtype)))?;
        let k = self.kernels()?;
        let (rows32, hd32, seed32) = (rows as u32, hd as u32, u32::from(seed));
        let (tokens, heads) = (spec.tokens, u32::from(spec.kv_heads));
        let block_first = u32::from(spec.order == MemoryOrder::BlockFirst);
        let planes = spec.planes() as u32;
        let blocks = rows32.div_ceil(FP8_ROWS_PER_BLOCK);
        // One f32 row per warp in shared memory (validate caps head_dim for these kernels).
        let smem = FP8_ROWS_PER_BLOCK * hd32 * 4;
        let cfg = |shared_mem_bytes: u32| LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * FP8_ROWS_PER_BLOCK, 1, 1),
            shared_mem_bytes,
        };
        let cu = stream.stream.cu_stream();
        self.bind()?;
        // SAFETY: `st` is 4 checked bytes of a live allocation.
        unsafe { result::memset_d8_async(st, 0, 4, cu) }.map_err(driver("cuMemsetD8Async"))?;
        let launched = match (codec, op.is_encode()) {
            (CodecId::FP8_E4M3, encode) => {
                let mut launch = stream.stream.launch_builder(if encode { &k.encode } else { &k.decode });
                launch.arg(&i).arg(&o).arg(&st).arg(&rows32).arg(&hd32).arg(&dtype);
                // SAFETY: the arguments match the kernel's signature (three device pointers, two
                // u32, one int); `validate` checked that input, output and status hold exactly the
                // bytes the kernel reads and writes for `rows` rows of `hd` elements, at aligned
                // offsets.
                unsafe { launch.launch(cfg(0)) }
            }
            (CodecId::FP8_E4M3_HAD, encode) => {
                let mut launch = stream.stream.launch_builder(&k.quant[if encode { 0 } else { 1 }]);
                launch.arg(&i).arg(&o).arg(&st).arg(&rows32).arg(&hd32).arg(&dtype).arg(&seed32);
                // SAFETY: as above, plus the seed (u32); the shared memory holds one row of `hd`
                // f32 per warp, and `validate` capped `hd` so that it fits.
                unsafe { launch.launch(cfg(smem)) }
            }
            (_, true) => {
                // NVFP4 (plain or +had): plane amaxes into the zeroed scale words, then block
                // scales and codes, then the scale words become global scales.
                let rotate = u32::from(codec == CodecId::NVFP4_HAD);
                // SAFETY: the body's first 4 * planes bytes are its scale words, inside the
                // checked body range.
                unsafe { result::memset_d8_async(o, 0, 4 * planes as usize, cu) }.map_err(driver("cuMemsetD8Async"))?;
                let mut amax = stream.stream.launch_builder(&k.quant[2]);
                amax.arg(&i).arg(&o).arg(&st).arg(&rows32).arg(&hd32).arg(&dtype).arg(&rotate).arg(&seed32);
                amax.arg(&tokens).arg(&heads).arg(&block_first);
                // SAFETY: the arguments match `kvtier_nvfp4_amax_rows`; the source holds `rows` rows
                // of `hd` elements, the body starts with one u32 per plane; shared memory as above.
                unsafe { amax.launch(cfg(smem)) }.map_err(driver("cuLaunchKernel"))?;
                let mut enc = stream.stream.launch_builder(&k.quant[3]);
                enc.arg(&i).arg(&o).arg(&rows32).arg(&hd32).arg(&dtype).arg(&rotate).arg(&seed32);
                enc.arg(&tokens).arg(&heads).arg(&block_first);
                // SAFETY: the arguments match `kvtier_nvfp4_encode_rows`; `validate` checked the
                // body is exactly the NVFP4 body of `spec`.
                unsafe { enc.launch(cfg(smem)) }.map_err(driver("cuLaunchKernel"))?;
                let mut globals = stream.stream.launch_builder(&k.quant[4]);
                globals.arg(&o).arg(&planes);
                let g = LaunchConfig {
                    grid_dim: (planes.div_ceil(256), 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the arguments match `kvtier_nvfp4_globals`; the body holds `planes` words.
                unsafe { globals.launch(g) }
            }
            (_, false) => {
                let rotate = u32::from(codec == CodecId::NVFP4_HAD);
                let mut launch = stream.stream.launch_builder(&k.quant[5]);
                launch.arg(&i).arg(&o).arg(&st).arg(&rows32).arg(&hd32).arg(&dtype).arg(&rotate).arg(&seed32);
                launch.arg(&tokens).arg(&heads).arg(&block_first);
                // SAFETY: the arguments match `kvtier_nvfp4_decode_rows`; `validate` checked the body
                // and output sizes; shared memory as above (used only when rotating).
                unsafe { launch.launch(cfg(if rotate == 1 { smem } else { 0 })) }
            }
        };
        launched.map_err(driver("cuLaunchKernel"))?;
        Ok(())
    }

    fn record(&self, stream: &CudaStreamHandle) -> Result<CudaEventHandle> {
        self.check_stream(stream)?;
        let ev = stream
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(driver("cuEventRecord"))?;
        Ok(CudaEventHandle(Arc::new(ev)))
    }

    fn stream_wait(&self, stream: &CudaStreamHandle, event: &CudaEventHandle) -> Result<()> {
        self.check_stream(stream)?;
        stream.stream.wait(&event.0).map_err(driver("cuStreamWaitEvent"))
    }

    fn wait(&self, event: &CudaEventHandle) -> Result<()> {
        event.0.synchronize().map_err(driver("cuEventSynchronize"))
    }

    fn query(&self, event: &CudaEventHandle) -> Result<bool> {
        event.0.try_is_complete().map_err(driver("cuEventQuery"))
    }

    fn read_sync(&self, src: DeviceRange) -> Result<Vec<u8>> {
        let s = self.range_ptr(&src, "device source")?;
        self.bind()?;
        let mut out = vec![0u8; src.len];
        // SAFETY: the device range was checked against a live allocation; `out` is exactly
        // `src.len` bytes.
        unsafe { result::memcpy_dtoh_sync(&mut out, s) }.map_err(driver("cuMemcpyDtoH"))?;
        Ok(out)
    }

    fn write_sync(&self, dst: DeviceRange, bytes: &[u8]) -> Result<()> {
        let d = self.range_ptr(&dst, "device destination")?;
        check_lengths(bytes.len(), dst.len)?;
        self.bind()?;
        // SAFETY: as in read_sync.
        unsafe { result::memcpy_htod_sync(d, bytes) }.map_err(driver("cuMemcpyHtoD"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs everywhere: without a driver library the device is unavailable, as an error.
    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        match CudaDevice::new(0) {
            Err(AgentError::DeviceUnavailable(why)) => {
                assert!(!why.is_empty());
                if !driver_present() {
                    assert!(why.contains("no CUDA driver library"), "{why}");
                }
            }
            Err(other) => panic!("expected DeviceUnavailable, got {other:?}"),
            Ok(dev) => assert!(dev.mem_info().unwrap().total > 0),
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU (CUDA driver)"]
    fn meets_the_device_contract_on_a_gpu() {
        let dev = CudaDevice::new(0).unwrap();
        // A second handle table on the same GPU stands in for another device's handles.
        let other = CudaDevice {
            inner: Arc::new(Inner {
                ordinal: 99,
                ctx: dev.inner.ctx.clone(),
                table: Mutex::new(Table { next_id: 1, live: HashMap::new() }),
                kernels: OnceLock::new(),
                foreign: Mutex::new(Vec::new()),
            }),
        };
        super::super::conformance::copies_and_errors(&dev, &other);
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU (CUDA driver)"]
    fn the_gpus_of_this_machine_are_linked_where_they_have_peer_access() {
        let n = CudaDevice::count().unwrap();
        assert!(n >= 1);
        let devs: Vec<Arc<CudaDevice>> = (0..n).map(|o| Arc::new(CudaDevice::new(o).unwrap())).collect();
        assert!(devs[0].enable_peer_access(&devs[0]).unwrap(), "a GPU reaches itself");
        let found = crate::pool::find_links(&devs, crate::pool::LinkRate::Measured { bytes: 64 << 20 }).unwrap();
        let n = n as usize;
        assert_eq!(found.links.len() + found.unlinked.len(), n * (n - 1) / 2, "every pair, once");
        for l in &found.links {
            eprintln!("GPUs {} and {}: {:.1} GB/s", l.a, l.b, l.bytes_per_sec as f64 / 1e9);
            assert!(l.bytes_per_sec > 1_000_000_000, "a peer link under 1 GB/s: {l:?}");
            // Bytes cross it exactly, both ways.
            let (a, b) = (&devs[l.a as usize], &devs[l.b as usize]);
            let (x, y) = (a.alloc(1 << 20).unwrap(), b.alloc(1 << 20).unwrap());
            let bytes: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
            a.write_sync(x.all(), &bytes).unwrap();
            let s = b.new_stream().unwrap();
            b.copy_peer(&s, a, x.all(), b, y.all()).unwrap();
            b.wait(&b.record(&s).unwrap()).unwrap();
            assert_eq!(b.read_sync(y.all()).unwrap(), bytes);
            a.free(x).unwrap();
            b.free(y).unwrap();
        }
        for u in &found.unlinked {
            eprintln!("GPUs {} and {}: not linked ({})", u.a, u.b, u.why);
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU (CUDA driver)"]
    fn fp8_kernels_match_kvtier_kernels_byte_for_byte() {
        super::super::conformance::fp8_codec_matches_kvtier_kernels(&CudaDevice::new(0).unwrap());
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU (CUDA driver)"]
    fn device_pages_export_as_dma_buf_or_say_unsupported() {
        let dev = CudaDevice::new(0).unwrap();
        let buf = dev.alloc(2 << 20).unwrap();
        match dev.export_dmabuf(buf.all()) {
            Ok(fd) => assert!(std::os::fd::AsRawFd::as_raw_fd(&fd) >= 0),
            Err(AgentError::Unsupported(why)) => eprintln!("dma-buf: {why}"),
            Err(other) => panic!("expected a dma-buf fd or Unsupported, got {other:?}"),
        }
        dev.free(buf).unwrap();
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU (CUDA driver)"]
    fn nvfp4_and_rotated_kernels_match_kvtier_kernels_byte_for_byte() {
        super::super::conformance::codecs_by_id_match_kvtier_kernels(&CudaDevice::new(0).unwrap());
    }
}
