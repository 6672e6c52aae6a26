//! What one node holds while it runs: configuration, the DRAM tier, registered namespaces and
//! the session table. The control plane and the data plane share it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Instant;

use kvtier_proto::{Namespace, NamespaceId};
use parking_lot::{Mutex, RwLock};

use crate::config::ServerConfig;
use crate::dram::{DramConfig, DramTier};
use crate::error::ServerError;
use crate::sessions::{SessionLimits, SessionTable};

/// Most namespaces one node accepts (each costs a map entry; tenants don't need thousands).
pub const MAX_NAMESPACES: usize = 4096;

pub struct NodeState {
    pub config: ServerConfig,
    pub tier: DramTier,
    pub sessions: Mutex<SessionTable>,
    namespaces: RwLock<HashMap<NamespaceId, Namespace>>,
    pub started: Instant,
    pub data_addr: SocketAddr,
}

impl NodeState {
    pub fn new(config: ServerConfig, data_addr: SocketAddr) -> Self {
        let tier = DramTier::new(DramConfig {
            capacity_bytes: config.dram_capacity.0,
            max_pinned_ratio: config.max_pinned_ratio,
        });
        NodeState {
            config,
            tier,
            sessions: Mutex::new(SessionTable::default()),
            namespaces: RwLock::new(HashMap::new()),
            started: Instant::now(),
            data_addr,
        }
    }

    /// Registers a namespace (idempotent) and returns its id.
    pub fn register_namespace(&self, ns: Namespace) -> Result<NamespaceId, ServerError> {
        ns.validate()?;
        if ns.layout.block_bytes() > self.config.max_frame_bytes.0 {
            return Err(ServerError::InvalidRequest(format!(
                "a block of this layout is {} bytes, above max_frame_bytes {}",
                ns.layout.block_bytes(),
                self.config.max_frame_bytes
            )));
        }
        let id = ns.id();
        let mut map = self.namespaces.write();
        if !map.contains_key(&id) {
            if map.len() >= MAX_NAMESPACES {
                return Err(ServerError::Capacity(format!("this node already holds {MAX_NAMESPACES} namespaces")));
            }
            map.insert(id, ns);
            metrics::gauge!("kvtier_namespaces").set(map.len() as f64);
        }
        Ok(id)
    }

    pub fn namespace(&self, id: &NamespaceId) -> Result<Namespace, ServerError> {
        self.namespaces.read().get(id).cloned().ok_or(ServerError::UnknownNamespace(*id))
    }

    pub fn namespace_count(&self) -> usize {
        self.namespaces.read().len()
    }

    pub fn session_limits(&self, ns: &Namespace) -> SessionLimits {
        SessionLimits {
            block_tokens: ns.layout.block_tokens,
            bytes_per_token: ns.layout.bytes_per_token(),
            max_context_tokens: self.config.max_context_tokens,
        }
    }

    /// Refuses a chain of `blocks` blocks longer than the configured maximum context.
    pub fn check_context(&self, ns: &Namespace, blocks: usize) -> Result<(), ServerError> {
        let tokens = blocks as u64 * u64::from(ns.layout.block_tokens);
        if tokens > self.config.max_context_tokens {
            return Err(ServerError::ContextTooLong { tokens, max: self.config.max_context_tokens });
        }
        Ok(())
    }
}
