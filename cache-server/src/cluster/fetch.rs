//! A client request's blocks that no local tier holds, loaded from their owners in chunks that
//! run ahead of the answer: the data plane's `GET` starts writing what it has while the next
//! chunk is still crossing from the peers, so the two hops overlap instead of adding up, and at
//! most [`AHEAD`] chunks of [`CHUNK_BYTES`] are held per request instead of the whole answer.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use kvtier_proto::{BlockKey, Namespace};

use crate::dram::StoredBlock;
use crate::state::NodeState;

/// Payload bytes of one chunk (at least one block).
pub const CHUNK_BYTES: u64 = 16 << 20;
/// Chunks loading at once for one request (the one being answered and the next).
pub const AHEAD: usize = 2;
/// Most payload bytes one request loads from peers (keys past it are misses).
pub const MAX_FETCH_BYTES: u64 = 256 << 20;

type Chunk = HashMap<BlockKey, StoredBlock>;

/// A spawned chunk load, aborted when dropped (a client that went away stops its fetches).
struct ChunkTask(tokio::task::JoinHandle<Chunk>);

impl Drop for ChunkTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Future for ChunkTask {
    type Output = Chunk;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Chunk> {
        // A chunk that panicked or was aborted is a chunk of misses (a panic counted).
        Pin::new(&mut self.0).poll(cx).map(|r| {
            r.unwrap_or_else(|e| {
                if e.is_panic() {
                    ::metrics::counter!("kvtier_errors_total", "kind" => "peer_fetch_panic").increment(1);
                }
                Chunk::default()
            })
        })
    }
}

/// The remote part of one request, in key order (see the module doc).
pub struct PeerFetch {
    state: Arc<NodeState>,
    ns: Option<Namespace>,
    /// Chunks not started yet, in order.
    todo: VecDeque<Vec<BlockKey>>,
    /// Chunks started, in order.
    running: VecDeque<ChunkTask>,
    /// Per remote key: its chunk's index.
    chunk_of: HashMap<BlockKey, usize>,
    /// Chunks finished (their blocks are in `got`).
    done: usize,
    got: Chunk,
}

impl PeerFetch {
    /// Plans (and starts) loading those of `keys` no local tier holds; nothing outside a cluster
    /// or for an unknown namespace.
    pub fn start(state: &Arc<NodeState>, ns: Option<Namespace>, keys: &[BlockKey]) -> PeerFetch {
        let mut f = PeerFetch {
            state: state.clone(),
            ns: None,
            todo: VecDeque::new(),
            running: VecDeque::new(),
            chunk_of: HashMap::new(),
            done: 0,
            got: HashMap::new(),
        };
        let Some(ns) = ns.filter(|_| state.tiers().has_remote()) else { return f };
        let block = ns.layout.block_bytes().max(1);
        let per_chunk = (CHUNK_BYTES / block).max(1) as usize;
        let most = (MAX_FETCH_BYTES / block).max(1) as usize;
        let held = state.tiers().exists(&ns.id(), keys);
        let mut missing: Vec<BlockKey> = Vec::new();
        for (k, h) in keys.iter().zip(held) {
            if !h && !f.chunk_of.contains_key(k) && missing.len() < most {
                f.chunk_of.insert(*k, missing.len() / per_chunk);
                missing.push(*k);
            }
        }
        f.todo = missing.chunks(per_chunk).map(<[BlockKey]>::to_vec).collect();
        f.ns = Some(ns);
        f.launch();
        f
    }

    /// Starts chunks until [`AHEAD`] are running.
    fn launch(&mut self) {
        let Some(ns) = &self.ns else { return };
        while self.running.len() < AHEAD {
            let Some(keys) = self.todo.pop_front() else { return };
            let (state, ns) = (self.state.clone(), ns.clone());
            self.running
                .push_back(ChunkTask(tokio::spawn(async move { state.tiers().fetch_remote(&ns, &keys).await })));
        }
    }

    /// Whether `key` is one this request loads from peers (no local tier held it when planned).
    pub fn planned(&self, key: &BlockKey) -> bool {
        self.chunk_of.contains_key(key)
    }

    /// For a key this request loads from peers ([`Self::planned`]): its block if its owners had
    /// it, taken before any local read so that the copy the fetch cached in DRAM isn't counted as
    /// a DRAM hit too (the local tiers' misses counted instead); `None` otherwise (not planned, or
    /// the owners had none: the caller reads the local tiers, which may hold it by now).
    pub async fn take_planned(&mut self, key: &BlockKey) -> Option<StoredBlock> {
        let b = self.take(key).await?;
        self.state.tiers().count_local_miss();
        Some(b)
    }

    /// The block of `key` if its owners had it, waiting for its chunk (and the ones before it).
    pub async fn take(&mut self, key: &BlockKey) -> Option<StoredBlock> {
        let chunk = *self.chunk_of.get(key)?;
        while self.done <= chunk {
            let task = self.running.pop_front()?;
            self.launch();
            self.got.extend(task.await);
            self.done += 1;
        }
        self.got.remove(key)
    }
}
