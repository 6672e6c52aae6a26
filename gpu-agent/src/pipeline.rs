//! Layer-pipelined load and save, shaped like vLLM's KV connector: [`LayerPipeline::start_load_kv`]
//! enqueues every layer's copies at once on one load stream and returns a [`LoadHandle`] with one
//! completion per layer, so the engine runs layer 0's attention while layers 1.. are still
//! landing ([`LoadHandle::wait_for_layer_load`], or [`LoadHandle::layer_event`] to make the
//! engine's own stream wait without blocking the host). [`LayerPipeline::save_kv_layer`] copies a
//! layer out as soon as the engine's compute for it is done (an event to wait on), overlapping with
//! the next layer's compute; [`LayerPipeline::wait_for_save`] reports every layer's outcome.
//!
//! Errors are per layer: a refused copy (bad range, freed page), a failure while copying, or a
//! source that could not be fetched (a [`LayerSource::ready`] event that completed with an error)
//! fails that layer only; the engine recomputes it. Layers complete in order (one stream). Each
//! layer's copies go to the device as one batch ([`Device::copy_batch`]), so a layer of many pages
//! takes one slot of the stream's bounded queue on the host backend; a load of more layers than
//! the queue holds makes `start_load_kv` wait for room (backpressure).
//!
//! A pipeline built [`LayerPipeline::with_peers`] also moves [`Transfer::Peer`] copies (pages
//! borrowed from a peer GPU) with [`Device::copy_peer`] on the same stream, in order with the
//! layer's other copies; such a layer goes to the device in runs (local runs still one batch
//! each), so a refused copy may leave earlier runs enqueued — the layer fails either way.

use std::collections::HashMap;
use std::sync::Arc;

pub use crate::device::Transfer;
use crate::device::{Device, DeviceOrdinal};
use crate::error::{AgentError, Result};

/// Saved layers awaiting [`LayerPipeline::wait_for_save`] at most; a save beyond that is failed
/// (the list is bounded like every queue). A forward pass saves each layer once, then waits.
pub const MAX_PENDING_SAVES: usize = 4096;

/// One layer of a load: its copies, and optionally an event that says its source bytes are ready
/// (e.g. the same-node client finished staging this layer from G2). The copies wait for it on the
/// device; if it completes with an error, the layer fails with that error.
pub struct LayerSource<E> {
    pub transfers: Vec<Transfer>,
    pub ready: Option<E>,
}

impl<E> LayerSource<E> {
    /// A layer whose source bytes are already in place.
    pub fn new(transfers: Vec<Transfer>) -> Self {
        LayerSource { transfers, ready: None }
    }

    /// The same layer, copied only once `ready` completes.
    pub fn after(mut self, ready: E) -> Self {
        self.ready = Some(ready);
        self
    }
}

/// The per-layer completions of one load.
pub struct LoadHandle<D: Device> {
    device: Arc<D>,
    layers: Vec<LayerState<D::Event>>,
}

struct LayerState<E> {
    ready: Option<E>,
    done: Result<E>,
}

impl<D: Device> LoadHandle<D> {
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    fn layer(&self, layer: usize) -> Result<&LayerState<D::Event>> {
        self.layers.get(layer).ok_or(AgentError::LayerOutOfRange { layer, layers: self.layers.len() })
    }

    /// Blocks until `layer` has landed; its error if it failed.
    pub fn wait_for_layer_load(&self, layer: usize) -> Result<()> {
        let l = self.layer(layer)?;
        let done = l.done.as_ref().map_err(Clone::clone)?;
        self.device.wait(done)?;
        match &l.ready {
            Some(r) => self.device.wait(r),
            None => Ok(()),
        }
    }

    /// Whether `layer` has landed, without blocking (`Err` if it failed).
    pub fn is_layer_ready(&self, layer: usize) -> Result<bool> {
        let l = self.layer(layer)?;
        let done = l.done.as_ref().map_err(Clone::clone)?;
        if !self.device.query(done)? {
            return Ok(false);
        }
        match &l.ready {
            Some(r) => self.device.query(r),
            None => Ok(true),
        }
    }

    /// The event that completes when `layer`'s copies have run, for an engine stream to wait on
    /// ([`Device::stream_wait`]). A failed source is not seen through it: check
    /// [`LoadHandle::is_layer_ready`] or [`LoadHandle::wait_for_layer_load`] before using the bytes.
    pub fn layer_event(&self, layer: usize) -> Result<&D::Event> {
        self.layer(layer)?.done.as_ref().map_err(Clone::clone)
    }

    /// Waits for every layer; one result per layer.
    pub fn wait_all(&self) -> Vec<Result<()>> {
        (0..self.layers.len()).map(|l| self.wait_for_layer_load(l)).collect()
    }
}

/// The outcome of every saved layer since the last [`LayerPipeline::wait_for_save`], in the order
/// they were saved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveReport {
    pub layers: Vec<(usize, Result<()>)>,
}

impl SaveReport {
    pub fn is_ok(&self) -> bool {
        self.layers.iter().all(|(_, r)| r.is_ok())
    }

    /// The layers that failed, with their errors.
    pub fn failed(&self) -> Vec<(usize, AgentError)> {
        self.layers.iter().filter_map(|(l, r)| r.as_ref().err().map(|e| (*l, e.clone()))).collect()
    }
}

/// A load stream and a save stream on one device.
///
/// ```
/// use std::sync::Arc;
/// use kvtier_agent::pipeline::{LayerPipeline, LayerSource, Transfer};
/// use kvtier_agent::{Device, HostBuffer, HostDevice};
///
/// let dev = Arc::new(HostDevice::new(0, 1 << 20));
/// let staged = HostBuffer::from_vec((0..64).collect()); // 4 layers of 16 bytes
/// let _pinned = dev.register_host(&staged).unwrap();
/// let engine = dev.alloc(64).unwrap();
/// let pipe = LayerPipeline::new(dev.clone()).unwrap();
/// let layers = (0..4)
///     .map(|l| LayerSource::new(vec![Transfer::HostToDevice {
///         src: staged.range(16 * l, 16),
///         dst: engine.range(16 * l, 16),
///     }]))
///     .collect();
/// let load = pipe.start_load_kv(layers);
/// load.wait_for_layer_load(0).unwrap(); // layer 0 is usable; later ones may still be copying
/// assert_eq!(dev.read_sync(engine.range(0, 16)).unwrap(), (0..16).collect::<Vec<u8>>());
/// assert!(load.wait_all().iter().all(Result::is_ok));
/// ```
pub struct LayerPipeline<D: Device> {
    device: Arc<D>,
    /// Devices this one has peer access to, for [`Transfer::Peer`] copies.
    peers: HashMap<DeviceOrdinal, Arc<D>>,
    load: D::Stream,
    save: D::Stream,
    saves: Vec<(usize, Result<D::Event>)>,
}

impl<D: Device> LayerPipeline<D> {
    pub fn new(device: Arc<D>) -> Result<Self> {
        let load = device.new_stream()?;
        let save = device.new_stream()?;
        Ok(LayerPipeline { device, peers: HashMap::new(), load, save, saves: Vec::new() })
    }

    /// The same pipeline, able to copy to and from `peers` ([`Transfer::Peer`]); the pipeline's
    /// own device in the list is ignored.
    pub fn with_peers(mut self, peers: impl IntoIterator<Item = Arc<D>>) -> Self {
        let own = self.device.ordinal();
        self.peers.extend(peers.into_iter().filter(|p| p.ordinal() != own).map(|p| (p.ordinal(), p)));
        self
    }

    /// The device of `ordinal`: this one or a peer.
    fn device_of(&self, ordinal: DeviceOrdinal) -> Result<&D> {
        if ordinal == self.device.ordinal() {
            return Ok(&self.device);
        }
        self.peers
            .get(&ordinal)
            .map(|d| &**d)
            .ok_or(AgentError::NoPeerAccess { device: self.device.ordinal(), peer: ordinal })
    }

    /// Enqueues a layer's copies on `stream`: one batch when all are local, else local runs as
    /// batches and peer copies one by one between them, in order.
    fn enqueue(&self, stream: &D::Stream, transfers: &[Transfer]) -> Result<()> {
        let dev = &*self.device;
        let peer = |t: &Transfer| matches!(t, Transfer::Peer { .. });
        if !transfers.iter().any(peer) {
            return dev.copy_batch(stream, transfers);
        }
        for run in transfers.chunk_by(|a, b| peer(a) == peer(b)) {
            if !peer(&run[0]) {
                dev.copy_batch(stream, run)?;
                continue;
            }
            for t in run {
                if let Transfer::Peer { src, dst } = t {
                    let (s, d) = (self.device_of(src.buf.device())?, self.device_of(dst.buf.device())?);
                    dev.copy_peer(stream, s, *src, d, *dst)?;
                }
            }
        }
        Ok(())
    }

    pub fn device(&self) -> &Arc<D> {
        &self.device
    }

    /// Enqueues every layer's copies, in layer order, and returns at once with one completion per
    /// layer. A layer whose copies are refused is failed in the handle; the others go ahead.
    pub fn start_load_kv(&self, layers: Vec<LayerSource<D::Event>>) -> LoadHandle<D> {
        let dev = &*self.device;
        let states = layers
            .into_iter()
            .map(|l| {
                let done = (|| {
                    if let Some(r) = &l.ready {
                        dev.stream_wait(&self.load, r)?;
                    }
                    self.enqueue(&self.load, &l.transfers)?;
                    dev.record(&self.load)
                })();
                LayerState { ready: l.ready, done }
            })
            .collect();
        LoadHandle { device: self.device.clone(), layers: states }
    }

    /// Enqueues the copies that save `layer`, after `compute_done` (the engine's event for that
    /// layer's forward pass) when given. Failures are reported by [`LayerPipeline::wait_for_save`].
    pub fn save_kv_layer(&mut self, layer: usize, transfers: &[Transfer], compute_done: Option<&D::Event>) {
        let dev = &*self.device;
        let pending = self.saves.len();
        let done = (|| {
            if pending >= MAX_PENDING_SAVES {
                return Err(AgentError::Config(format!(
                    "{pending} saved layers not yet waited for: call wait_for_save"
                )));
            }
            if let Some(e) = compute_done {
                dev.stream_wait(&self.save, e)?;
            }
            self.enqueue(&self.save, transfers)?;
            dev.record(&self.save)
        })();
        self.saves.push((layer, done));
    }

    /// Blocks until every layer saved since the last call has been copied; each layer's outcome.
    pub fn wait_for_save(&mut self) -> SaveReport {
        let layers = self.saves.drain(..).map(|(l, ev)| (l, ev.and_then(|e| self.device.wait(&e)))).collect();
        SaveReport { layers }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::{DeviceBuf, HostBuffer, HostDevice, HostEvent, Registration};

    const LAYERS: usize = 4;
    const PAGES: usize = 3;
    const PAGE: usize = 4096;

    struct Fixture {
        dev: Arc<HostDevice>,
        host: HostBuffer,
        _reg: Registration,
        engine: DeviceBuf,
        pipe: LayerPipeline<HostDevice>,
    }

    /// Host bytes laid out `[layer][page]`, engine pages laid out `[layer][page]` in reverse page
    /// order (so a wrong offset cannot pass).
    fn fixture(seed: u64) -> Fixture {
        let dev = Arc::new(HostDevice::new(0, 64 << 20));
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let bytes: Vec<u8> = (0..LAYERS * PAGES * PAGE).map(|_| rng.random()).collect();
        let host = HostBuffer::from_vec(bytes);
        let reg = dev.register_host(&host).unwrap();
        let engine = dev.alloc(LAYERS * PAGES * PAGE).unwrap();
        let pipe = LayerPipeline::new(dev.clone()).unwrap();
        Fixture { dev, host, _reg: reg, engine, pipe }
    }

    fn src_off(l: usize, p: usize) -> usize {
        (l * PAGES + p) * PAGE
    }

    fn dst_off(l: usize, p: usize) -> usize {
        (l * PAGES + (PAGES - 1 - p)) * PAGE
    }

    fn layer(f: &Fixture, l: usize) -> LayerSource<HostEvent> {
        LayerSource::new(
            (0..PAGES)
                .map(|p| Transfer::HostToDevice {
                    src: f.host.range(src_off(l, p), PAGE),
                    dst: f.engine.range(dst_off(l, p), PAGE),
                })
                .collect(),
        )
    }

    fn assert_layer_exact(f: &Fixture, l: usize) {
        for p in 0..PAGES {
            let got = f.dev.read_sync(f.engine.range(dst_off(l, p), PAGE)).unwrap();
            let mut want = vec![0u8; PAGE];
            f.host.read(src_off(l, p), &mut want).unwrap();
            assert_eq!(got, want, "layer {l} page {p}");
        }
    }

    #[test]
    fn peer_copies_need_the_peer_and_run_in_order_with_the_layers_other_copies() {
        let (d0, d1) = (Arc::new(HostDevice::new(0, 1 << 20)), Arc::new(HostDevice::new(1, 1 << 20)));
        let (a, b, c, d) = (d0.alloc(64).unwrap(), d1.alloc(64).unwrap(), d0.alloc(64).unwrap(), d0.alloc(64).unwrap());
        d0.write_sync(a.all(), &[5; 64]).unwrap();
        let to_peer = Transfer::Peer { src: a.all(), dst: b.all() };
        let lonely = LayerPipeline::new(d0.clone()).unwrap();
        let h = lonely.start_load_kv(vec![LayerSource::new(vec![to_peer.clone()])]);
        assert_eq!(h.wait_for_layer_load(0), Err(AgentError::NoPeerAccess { device: 0, peer: 1 }));
        let s = d0.new_stream().unwrap();
        assert_eq!(to_peer.enqueue(&*d0, &s), Err(AgentError::NoPeerAccess { device: 0, peer: 1 }));
        assert!(d0.copy_batch(&s, std::slice::from_ref(&to_peer)).is_err());
        // Out to the peer, back into another page, then a local copy: one layer, in order.
        let pipe = LayerPipeline::new(d0.clone()).unwrap().with_peers([d0.clone(), d1.clone()]);
        let layer = vec![
            to_peer,
            Transfer::Peer { src: b.all(), dst: c.all() },
            Transfer::DeviceToDevice { src: c.all(), dst: d.all() },
        ];
        let h = pipe.start_load_kv(vec![LayerSource::new(layer)]);
        h.wait_for_layer_load(0).unwrap();
        assert_eq!(d1.read_sync(b.all()).unwrap(), vec![5; 64]);
        assert_eq!(d0.read_sync(d.all()).unwrap(), vec![5; 64]);
    }

    #[test]
    fn every_layer_lands_byte_exact() {
        let f = fixture(1);
        let h = f.pipe.start_load_kv((0..LAYERS).map(|l| layer(&f, l)).collect());
        assert_eq!(h.layers(), LAYERS);
        for l in 0..LAYERS {
            h.wait_for_layer_load(l).unwrap();
            assert_layer_exact(&f, l);
        }
        assert_eq!(h.wait_for_layer_load(LAYERS), Err(AgentError::LayerOutOfRange { layer: LAYERS, layers: LAYERS }));
    }

    #[test]
    fn layer_zero_is_usable_while_later_layers_are_in_flight() {
        let f = fixture(2);
        // Layer 2's source has not arrived yet.
        let (gate, open) = f.dev.user_event();
        let mut layers: Vec<_> = (0..LAYERS).map(|l| layer(&f, l)).collect();
        layers[2] = layer(&f, 2).after(gate);
        let h = f.pipe.start_load_kv(layers);
        h.wait_for_layer_load(0).unwrap();
        h.wait_for_layer_load(1).unwrap();
        assert_layer_exact(&f, 0);
        assert_eq!(h.is_layer_ready(0), Ok(true));
        // In order: nothing after the held layer has landed either.
        assert_eq!(h.is_layer_ready(2), Ok(false));
        assert_eq!(h.is_layer_ready(3), Ok(false));
        assert_eq!(f.dev.read_sync(f.engine.range(dst_off(3, 0), PAGE)).unwrap(), vec![0u8; PAGE]);
        open.complete(Ok(()));
        assert!(h.wait_all().iter().all(Result::is_ok));
        (0..LAYERS).for_each(|l| assert_layer_exact(&f, l));
    }

    #[test]
    fn an_engine_stream_can_wait_on_a_layer_without_blocking_the_host() {
        let f = fixture(3);
        let h = f.pipe.start_load_kv((0..LAYERS).map(|l| layer(&f, l)).collect());
        let compute = f.dev.new_stream().unwrap();
        let scratch = f.dev.alloc(PAGE).unwrap();
        f.dev.stream_wait(&compute, h.layer_event(1).unwrap()).unwrap();
        // "Attention over layer 1": read one of its pages on the engine's stream.
        f.dev.copy_d2d(&compute, f.engine.range(dst_off(1, 0), PAGE), scratch.all()).unwrap();
        f.dev.wait(&f.dev.record(&compute).unwrap()).unwrap();
        let mut want = vec![0u8; PAGE];
        f.host.read(src_off(1, 0), &mut want).unwrap();
        assert_eq!(f.dev.read_sync(scratch.all()).unwrap(), want);
    }

    #[test]
    fn errors_are_reported_per_layer() {
        let f = fixture(4);
        let (gate, open) = f.dev.user_event();
        let mut layers: Vec<_> = (0..LAYERS).map(|l| layer(&f, l)).collect();
        // Layer 1: a page past the end of the engine buffer. Layer 3: its source failed to arrive.
        layers[1].transfers[2] = Transfer::HostToDevice {
            src: f.host.range(0, PAGE),
            dst: f.engine.range(LAYERS * PAGES * PAGE - PAGE / 2, PAGE),
        };
        layers[3] = layer(&f, 3).after(gate);
        let h = f.pipe.start_load_kv(layers);
        open.complete(Err(AgentError::Spill("G2 fetch failed".into())));
        let results = h.wait_all();
        assert_eq!(results[0], Ok(()));
        assert!(matches!(results[1], Err(AgentError::OutOfBounds { what: "device destination", .. })));
        assert_eq!(results[2], Ok(()));
        assert_eq!(results[3], Err(AgentError::Spill("G2 fetch failed".into())));
        assert!(matches!(h.is_layer_ready(1), Err(AgentError::OutOfBounds { .. })));
        assert!(h.layer_event(1).is_err());
        assert_layer_exact(&f, 0);
        assert_layer_exact(&f, 2);
    }

    #[test]
    fn loads_from_device_pages_are_device_to_device() {
        let f = fixture(5);
        let g1 = f.dev.alloc(LAYERS * PAGE).unwrap();
        for l in 0..LAYERS {
            f.dev.write_sync(g1.range(l * PAGE, PAGE), &vec![l as u8 + 1; PAGE]).unwrap();
        }
        let layers = (0..LAYERS)
            .map(|l| {
                LayerSource::new(vec![Transfer::DeviceToDevice {
                    src: g1.range(l * PAGE, PAGE),
                    dst: f.engine.range(dst_off(l, 0), PAGE),
                }])
            })
            .collect();
        let h = f.pipe.start_load_kv(layers);
        for l in 0..LAYERS {
            h.wait_for_layer_load(l).unwrap();
            assert_eq!(f.dev.read_sync(f.engine.range(dst_off(l, 0), PAGE)).unwrap(), vec![l as u8 + 1; PAGE]);
        }
    }

    #[test]
    fn saves_wait_for_compute_and_report_each_layer() {
        let mut f = fixture(6);
        let h = f.pipe.start_load_kv((0..LAYERS).map(|l| layer(&f, l)).collect());
        assert!(h.wait_all().iter().all(Result::is_ok));
        let out = HostBuffer::new(LAYERS * PAGES * PAGE);
        let _reg = f.dev.register_host(&out).unwrap();
        let (computed, finish) = f.dev.user_event();
        for l in 0..LAYERS {
            let mut ts: Vec<_> = (0..PAGES)
                .map(|p| Transfer::DeviceToHost {
                    src: f.engine.range(dst_off(l, p), PAGE),
                    dst: out.range(src_off(l, p), PAGE),
                })
                .collect();
            if l == 2 {
                ts[0] = Transfer::DeviceToHost { src: f.engine.range(0, PAGE), dst: out.range(0, PAGE + 1) };
            }
            f.pipe.save_kv_layer(l, &ts, (l == 0).then_some(&computed));
        }
        // Nothing is copied before the compute of layer 0 is done.
        assert_eq!(out.to_vec(), vec![0u8; out.len()]);
        finish.complete(Ok(()));
        let report = f.pipe.wait_for_save();
        assert!(!report.is_ok());
        assert_eq!(report.layers.iter().map(|(l, _)| *l).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(report.failed(), vec![(2, AgentError::LengthMismatch { src: PAGE, dst: PAGE + 1 })]);
        let all = out.to_vec();
        let want = f.host.to_vec();
        for l in [0, 1, 3] {
            assert_eq!(all[src_off(l, 0)..src_off(l + 1, 0)], want[src_off(l, 0)..src_off(l + 1, 0)], "layer {l}");
        }
        assert!(f.pipe.wait_for_save().layers.is_empty());
    }

    #[test]
    fn pending_saves_are_bounded() {
        let mut f = fixture(7);
        for l in 0..MAX_PENDING_SAVES + 1 {
            f.pipe.save_kv_layer(l, &[], None);
        }
        let report = f.pipe.wait_for_save();
        assert_eq!(report.layers.len(), MAX_PENDING_SAVES + 1);
        assert_eq!(report.failed().len(), 1);
        assert_eq!(report.failed()[0].0, MAX_PENDING_SAVES);
        f.pipe.save_kv_layer(0, &[], None);
        assert!(f.pipe.wait_for_save().is_ok());
    }
}
