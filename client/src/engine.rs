//! [`EngineClient`]: the never-raise face of the client for inference engines. Every error or
//! timeout becomes a miss with a reason (counted in `kvtier_client_misses_total{op,reason}`), so
//! the engine simply recomputes. It connects lazily; after a failed attempt it waits twenty times
//! what that attempt took (at least 50 ms, at most `retry_after`) before the next, so a server that
//! is down costs the engine one quick miss per call, not a hang, and one that restarts is reached
//! again within about 50 ms of answering.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::Namespace;
use tokio::sync::Mutex;

use crate::{
    ClientConfig, ClientError, KvClient, NamespaceHandle, ParkOptions, ResumedSession, SameNodeStats, SessionInfo,
};

/// Why an engine call came back empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    pub reason: &'static str,
    pub detail: String,
}

/// Blocks loaded for a prefix: possibly fewer than asked (or none), and why.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub blocks: Vec<Bytes>,
    pub miss: Option<Miss>,
}

struct Conn {
    client: Option<KvClient>,
    /// When the next attempt to connect may start (after a failed one).
    next_attempt: Option<Instant>,
    /// Why the last attempt to connect failed, said again while backing off.
    last_failure: Option<ClientError>,
    namespaces: Vec<(Namespace, NamespaceHandle)>,
}

/// A client that never raises and never waits longer than its budget.
#[derive(Clone)]
pub struct EngineClient {
    addr: String,
    cfg: ClientConfig,
    budget: Duration,
    retry_after: Duration,
    conn: Arc<Mutex<Conn>>,
}

/// The shortest wait before reconnecting after a failed attempt.
pub const MIN_RETRY_AFTER: Duration = Duration::from_millis(50);

/// How long to wait after a connection attempt that failed after `took`: twenty times that, so
/// connecting takes at most about a twentieth of the time a dead server is called, within
/// [`MIN_RETRY_AFTER`] and `most`.
fn retry_wait(took: Duration, most: Duration) -> Duration {
    took.saturating_mul(20).clamp(MIN_RETRY_AFTER.min(most), most)
}

fn miss(op: &'static str, e: &ClientError) -> Miss {
    metrics::counter!("kvtier_client_misses_total", "op" => op, "reason" => e.reason()).increment(1);
    tracing::debug!(op, "kvtier miss: {e}");
    Miss { reason: e.reason(), detail: e.to_string() }
}

impl EngineClient {
    /// `budget` bounds every call end to end (connecting included).
    pub fn new(addr: impl Into<String>, cfg: ClientConfig, budget: Duration) -> Self {
        crate::fork::hold_locks_over_fork();
        EngineClient {
            addr: addr.into(),
            cfg,
            budget,
            retry_after: Duration::from_secs(1),
            conn: Arc::new(Mutex::new(Conn {
                client: None,
                next_attempt: None,
                last_failure: None,
                namespaces: Vec::new(),
            })),
        }
    }

    /// The longest wait before reconnecting after a failed attempt. Default: 1 s. The wait is
    /// twenty times what the failed attempt took, at least [`MIN_RETRY_AFTER`] (a refused
    /// connection fails in microseconds: a restarted server is reached again soon after it
    /// listens) and at most this (an attempt that ran into its connect timeout is not repeated
    /// on every call).
    pub fn with_retry_after(mut self, d: Duration) -> Self {
        self.retry_after = d;
        self
    }

    /// What the automatic same-node path of the current connection did so far (see
    /// [`crate::near`]); empty before a call connected, and counted afresh after a reconnect.
    pub async fn samenode_stats(&self) -> SameNodeStats {
        self.conn.lock().await.client.as_ref().map(KvClient::samenode_stats).unwrap_or_default()
    }

    async fn handle(&self, ns: &Namespace) -> Result<(KvClient, NamespaceHandle), ClientError> {
        let mut c = self.conn.lock().await;
        if c.client.is_none() {
            // Only after a failed attempt: a connection that worked and was closed (or broke)
            // is dialled again at once.
            if c.last_failure.is_some() && c.next_attempt.is_some_and(|t| Instant::now() < t) {
                return Err(match &c.last_failure {
                    // A refused credential stays refused: said as it was, in its own kind.
                    Some(e @ ClientError::Unauthenticated(_)) => e.clone(),
                    Some(e) => ClientError::Connect {
                        addr: self.addr.clone(),
                        reason: format!(
                            "backing off for {:?} more after a failed attempt ({e})",
                            c.next_attempt.map(|t| t.saturating_duration_since(Instant::now())).unwrap_or_default()
                        ),
                    },
                    None => ClientError::Connect { addr: self.addr.clone(), reason: "backing off".into() },
                });
            }
            let started = Instant::now();
            match KvClient::connect(&self.addr, self.cfg.clone()).await {
                Ok(client) => {
                    c.client = Some(client);
                    c.last_failure = None;
                }
                Err(e) => {
                    let wait = retry_wait(started.elapsed(), self.retry_after);
                    c.next_attempt = Some(Instant::now() + wait);
                    c.last_failure = Some(e.clone());
                    return Err(e);
                }
            }
            c.namespaces.clear();
        }
        let client = c.client.clone().ok_or_else(|| ClientError::Io("not connected".into()))?;
        if let Some((_, h)) = c.namespaces.iter().find(|(n, _)| n == ns) {
            return Ok((client, h.clone()));
        }
        let h = client.register(ns.clone()).await?;
        c.namespaces.push((ns.clone(), h.clone()));
        Ok((client, h))
    }

    /// Forgets the connection after a transport failure so the next call reconnects, and a
    /// namespace the server says it does not know (unregistered, or a node restarted on an
    /// empty data dir) so the next call registers it again.
    async fn on_error(&self, ns: &Namespace, e: &ClientError) {
        if matches!(
            e,
            ClientError::Io(_) | ClientError::Timeout(_) | ClientError::Connect { .. } | ClientError::Protocol(_)
        ) {
            // Not waited for: a call past its budget returns now. The lock is held by a call that
            // is connecting (it installs a fresh client) or registering on this one (which fails
            // the same way and clears it then).
            if let Ok(mut c) = self.conn.try_lock() {
                c.client = None;
            }
        } else if matches!(
            e,
            ClientError::UnknownNamespace(_) | ClientError::Rejected { status: ItemStatus::UnknownNamespace, .. }
        ) {
            self.forget(ns).await;
        }
    }

    /// Closes the connection (its data-plane and same-node connections go with the last call
    /// still using them); a later call connects again.
    pub async fn close(&self) {
        let mut c = self.conn.lock().await;
        c.client = None;
        c.namespaces.clear();
    }

    /// Forgets `ns`'s registration: the next call with it registers it again (after
    /// `unregister`, or when the server answered that it does not know it).
    pub async fn forget(&self, ns: &Namespace) {
        // Bounded as `on_error`: a caller holding it is registering, which refreshes it anyway.
        if let Ok(mut c) = tokio::time::timeout(Duration::from_millis(100), self.conn.lock()).await {
            c.namespaces.retain(|(n, _)| n != ns);
        }
    }

    /// Runs `f` with a connected client and `ns`'s handle, within the budget; any error becomes a
    /// [`Miss`] (counted, and the connection dropped after a transport failure). The building
    /// block of the calls below, and of bindings that need other calls.
    pub async fn call<T, F, Fut>(&self, op: &'static str, ns: &Namespace, f: F) -> Result<T, Miss>
    where
        F: FnOnce(KvClient, NamespaceHandle) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        self.call_within(op, ns, self.budget, f).await
    }

    /// [`EngineClient::call`] with its own deadline (an engine's per-call budget, e.g. below
    /// its scheduler's or LMCache's `blocking_timeout_secs`), connecting included. A same-node
    /// exchange still in flight at the deadline is not cut off, since the server may be copying
    /// into the caller's memory: it times out at the deadline, closes, and the call returns once
    /// the server has let go (at once normally; at most 5 s more for a server that is stalled).
    pub async fn call_within<T, F, Fut>(
        &self,
        op: &'static str,
        ns: &Namespace,
        budget: Duration,
        f: F,
    ) -> Result<T, Miss>
    where
        F: FnOnce(KvClient, NamespaceHandle) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let work = async {
            let (client, h) = self.handle(ns).await?;
            f(client, h).await
        };
        let scope = crate::near::CallScope { deadline: Instant::now() + budget, exchanges: Default::default() };
        let exchanges = Arc::clone(&scope.exchanges);
        let res = {
            // Dropped at the end of this block, before `on_error` (the call may hold the
            // connection's lock).
            let mut work = std::pin::pin!(crate::near::CALL_SCOPE.scope(scope, work));
            match tokio::time::timeout(budget, &mut work).await {
                Ok(r) => r,
                // Past the budget the call is cut, but never in the middle of a same-node
                // exchange: the server may be copying into the caller's memory until the
                // exchange's own timeout (bounded by the budget) has closed it and seen the
                // server let go.
                Err(_) => tokio::select! {
                    biased;
                    r = &mut work => r,
                    _ = exchanges.none_in_flight() => Err(ClientError::Timeout(budget)),
                },
            }
        };
        match res {
            Ok(v) => Ok(v),
            Err(e) => {
                self.on_error(ns, &e).await;
                Err(miss(op, &e))
            }
        }
    }

    /// Tokens of `tokens` the server can give back (0 on any failure).
    pub async fn lookup(&self, ns: &Namespace, tokens: &[u32]) -> usize {
        self.call("lookup", ns, |c, h| async move { c.lookup(&h, tokens).await }).await.unwrap_or(0)
    }

    /// The longest loadable prefix of `tokens`.
    pub async fn load(&self, ns: &Namespace, tokens: &[u32]) -> Loaded {
        match self.call("load", ns, |c, h| async move { c.load(&h, tokens).await }).await {
            Ok(blocks) => Loaded { blocks, miss: None },
            Err(m) => Loaded { blocks: Vec::new(), miss: Some(m) },
        }
    }

    /// Stores full blocks; the number stored (0 on failure).
    pub async fn store(&self, ns: &Namespace, tokens: &[u32], blocks: &[Bytes]) -> usize {
        self.call("store", ns, |c, h| async move {
            let r = c.store(&h, tokens, blocks).await?;
            // As `store_keys`: a namespace the server does not know is forgotten here too.
            match r.rejected.iter().find(|(_, s)| *s == ItemStatus::UnknownNamespace) {
                Some(&(index, status)) => Err(ClientError::Rejected { index, status }),
                None => Ok(r),
            }
        })
        .await
        .map(|r| r.stored)
        .unwrap_or(0)
    }

    pub async fn park(
        &self,
        ns: &Namespace,
        id: &str,
        tokens: &[u32],
        blocks: &[Bytes],
        opts: &ParkOptions,
    ) -> Result<SessionInfo, Miss> {
        self.call("park", ns, |c, h| async move { c.park(&h, id, tokens, blocks, opts, 0).await }).await
    }

    /// Which engine hashes (an engine's own block hashes, salted into `ns`) the server holds,
    /// each on its own; all false on any failure or past `budget`.
    pub async fn exists_keys(&self, ns: &Namespace, hashes: &[&[u8]], budget: Duration) -> Vec<bool> {
        self.call_within("exists", ns, budget, |c, h| async move {
            let keys: Vec<_> = hashes.iter().map(|e| h.engine_key(e)).collect();
            c.exists_keys(&h, &keys).await
        })
        .await
        .unwrap_or_else(|_| vec![false; hashes.len()])
    }

    /// Stores full blocks under engine hashes (`blocks[i]`: one part, or segments back to back);
    /// true where the server holds the block now, all false on any failure or past `budget`.
    pub async fn store_keys(
        &self,
        ns: &Namespace,
        hashes: &[&[u8]],
        blocks: &[Vec<Bytes>],
        budget: Duration,
    ) -> Vec<bool> {
        self.call_within("store", ns, budget, |c, h| async move {
            let keys: Vec<_> = hashes.iter().map(|e| h.engine_key(e)).collect();
            let statuses = c.store_keys(&h, &keys, blocks).await?;
            // Per block, but of the whole namespace: an error, so its registration is forgotten.
            if let Some(index) = statuses.iter().position(|s| *s == ItemStatus::UnknownNamespace) {
                return Err(ClientError::Rejected { index, status: ItemStatus::UnknownNamespace });
            }
            Ok(statuses.iter().map(|s| s.is_held()).collect())
        })
        .await
        .unwrap_or_else(|_| vec![false; hashes.len()])
    }

    /// Loads blocks of engine hashes straight into `dests`; true where a block landed and
    /// verified, all false on any failure or past `budget` (destinations then hold unspecified
    /// bytes).
    pub async fn load_keys_into(
        &self,
        ns: &Namespace,
        hashes: &[&[u8]],
        dests: &mut [crate::BlockDest<'_>],
        budget: Duration,
    ) -> Vec<bool> {
        let n = hashes.len();
        self.call_within("load", ns, budget, |c, h| async move {
            let keys: Vec<_> = hashes.iter().map(|e| h.engine_key(e)).collect();
            c.load_keys_into(&h, &keys, dests, false).await
        })
        .await
        .unwrap_or_else(|_| vec![false; n])
    }

    pub async fn resume(&self, ns: &Namespace, id: &str) -> Result<ResumedSession, Miss> {
        self.call("resume", ns, |c, h| async move { c.resume(&h, id).await }).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_attempt_waits_twenty_times_what_it_took_within_the_bounds() {
        let most = Duration::from_secs(1);
        // A refused connection (microseconds): the floor.
        assert_eq!(retry_wait(Duration::from_micros(80), most), MIN_RETRY_AFTER);
        assert_eq!(retry_wait(Duration::from_millis(10), most), Duration::from_millis(200));
        // A connect timeout: the ceiling, so a dead host is not dialled on every call.
        assert_eq!(retry_wait(Duration::from_secs(5), most), most);
        // A ceiling below the floor (a test's 10 ms) is kept.
        assert_eq!(retry_wait(Duration::from_secs(5), Duration::from_millis(10)), Duration::from_millis(10));
        assert_eq!(retry_wait(Duration::ZERO, Duration::from_millis(10)), Duration::from_millis(10));
    }
}
