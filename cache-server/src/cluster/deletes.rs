//! Namespace deletes across the cluster. A purge or an unregistration asked of one node is done
//! there, then asked of every other member (flagged `local_only`, so it travels one hop): blocks
//! forwarded to their owners, cached from peers or replicated with a session live on other nodes,
//! and a node that kept them would hand them back through the peer tier. A member that can't be
//! reached — or that left the membership lately (killed: its TTL ran out) — is asked again in the
//! background, at once when it (re)appears in the membership and every so often, for up to
//! [`OWED_FOR`] from when the delete was asked, so a node that was down when a tenant deleted its
//! data does not keep serving it once it is back. One delete is owed per member and namespace (a
//! later one replaces it: an unregistration a purge). A late unregistration is made as of when it
//! was asked: sessions touched since (the namespace registered again) stay, and the namespace with
//! them; a late purge removes what the member holds then.
//!
//! What is owed is kept in `owed_deletes.log` in the data directory ([`OwedLog`]), rewritten whole
//! whenever it changes and durable before the delete is answered, so the asking node restarting
//! before the member returns loses nothing: it reads the log at start and asks again. What this
//! does not cover: a member that left the membership before the asking node (re)started (the node
//! never saw it leave, so owes it nothing), and a member back under another node id.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvtier_proto::record_log::deletes::{self as records, read_owed_deletes_log, OwedDeleteRecord};
use kvtier_proto::record_log::{encode_log_header, encode_record, LogKey, LogKind};
use kvtier_proto::{pb, Namespace};
use parking_lot::Mutex;

use super::member::{Member, NodeId};
use super::peer::PeerTier;
use crate::error::ServerError;
use crate::fs::FileSystem;

/// How long a delete a member missed is retried.
pub const OWED_FOR: Duration = Duration::from_secs(3600);
/// Most deletes owed to unreachable members at once; past it a missed delete is not retried
/// (logged and counted in `kvtier_peer_deletes_abandoned_total`).
pub const MAX_OWED: usize = 1024;
/// First and longest wait between the retries of an owed delete.
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What is deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NamespaceDelete {
    /// Every unpinned block of the namespace (`Purge`).
    Purge,
    /// The namespace itself: its sessions, its blocks and its registration (`UnregisterNamespace`).
    Unregister,
}

impl NamespaceDelete {
    pub fn name(self) -> &'static str {
        match self {
            NamespaceDelete::Purge => "purge",
            NamespaceDelete::Unregister => "unregister",
        }
    }
}

/// What a delete did on the other members.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterDelete {
    /// Members that did it (one that did not know the namespace had nothing of it: done too).
    pub members_done: u32,
    pub blocks_removed: u64,
    pub sessions_dropped: u64,
    /// Members that could not be reached, and why; each is asked again in the background.
    pub failed: Vec<(NodeId, String)>,
    /// Members that left the membership lately (killed, stopped): asked when they are back.
    pub away: Vec<(NodeId, String)>,
}

/// A delete owed to a member: what, and when it was asked (wall-clock time: it outlives the
/// process, in [`OwedLog`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owed {
    pub what: NamespaceDelete,
    pub asked: SystemTime,
}

impl Owed {
    /// How long ago it was asked (zero if the clock went back since).
    fn age(&self) -> Duration {
        self.asked.elapsed().unwrap_or_default()
    }
}

/// `owed_deletes.log` in a node's data directory: the deletes the node owes members it could not
/// reach, rewritten whole (a new file synced and renamed over the old) whenever they change, and
/// read at start.
#[derive(Debug)]
pub struct OwedLog {
    path: PathBuf,
    fs: Arc<dyn FileSystem>,
    /// The file's secret: what its records' tags are keyed with.
    key: LogKey,
    /// Serializes rewrites, and holds the last generation written: each writes what is owed when
    /// it holds this, so the last one written is the latest.
    writing: Mutex<u64>,
    /// Generations asked for: a save whose generation a later write covered writes nothing (a
    /// member back with a thousand owed deletes done at once asks a thousand saves).
    wanted: std::sync::atomic::AtomicU64,
}

/// A delete read back from [`OwedLog`]: the member, the namespace, what and when.
pub type Restored = (NodeId, Namespace, Owed);

impl OwedLog {
    pub const FILE: &'static str = "owed_deletes.log";

    /// Opens the log in `dir` and reads back the deletes still owed (asked within [`OWED_FOR`]).
    /// A file whose header no longer verifies is moved aside (`.damaged`, said in the log), not
    /// read: without its secret no record in it can be trusted.
    pub fn open(dir: &Path, fs: Arc<dyn FileSystem>) -> Result<(OwedLog, Vec<Restored>), ServerError> {
        use prost::Message;
        let lost = "deletes this node owed members that were away are not asked again";
        let (path, key, owed) =
            crate::session_log::open_rewritten_log(dir, Self::FILE, LogKind::OwedDeletes, &*fs, lost, |data| {
                let (found, mut skipped) = read_owed_deletes_log(data)?;
                let mut owed = Vec::new();
                for r in found {
                    let member = NodeId::new(r.member).ok();
                    let ns = pb::NamespaceSpec::decode(r.spec).ok().and_then(|pb| Namespace::from_pb(&pb).ok());
                    let (Some(member), Some(ns)) = (member, ns) else {
                        skipped += 1; // a record naming no valid member or namespace
                        continue;
                    };
                    let what = if r.what == records::UNREGISTER {
                        NamespaceDelete::Unregister
                    } else {
                        NamespaceDelete::Purge
                    };
                    let o = Owed { what, asked: UNIX_EPOCH + Duration::from_millis(r.asked_unix_ms) };
                    if o.age() < OWED_FOR {
                        owed.push((member, ns, o));
                    }
                }
                Ok((owed, skipped))
            })?;
        Ok((OwedLog { path, fs, key, writing: Mutex::new(0), wanted: Default::default() }, owed))
    }

    /// Writes `owed` as the whole log.
    pub(crate) fn write(&self, owed: &[Restored]) -> std::io::Result<()> {
        use prost::Message;
        let mut data = encode_log_header(LogKind::OwedDeletes, &self.key);
        for (member, ns, o) in owed {
            let spec = ns.to_pb().encode_to_vec();
            let r = OwedDeleteRecord {
                member: member.as_str(),
                what: match o.what {
                    NamespaceDelete::Purge => records::PURGE,
                    NamespaceDelete::Unregister => records::UNREGISTER,
                },
                asked_unix_ms: o.asked.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64,
                spec: &spec,
            };
            data.extend(encode_record(&self.key, &r.encode()));
        }
        self.fs.replace(&self.path, &data)
    }
}

/// Makes what `peers` owes durable in its [`OwedLog`] (where it has one), off the async workers.
/// A write that fails is logged and counted (`kvtier_peer_deletes_unsaved_total`): the deletes
/// stay owed in memory, and the next change writes them all again.
async fn save(peers: &Arc<PeerTier>) {
    let Some(log) = peers.owed_log().cloned() else { return };
    let tier = peers.clone();
    let generation = log.wanted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    let done = tokio::task::spawn_blocking(move || {
        let mut written = log.writing.lock();
        if *written >= generation {
            return Ok(()); // a write begun after this save was asked covered it
        }
        let covers = log.wanted.load(std::sync::atomic::Ordering::SeqCst);
        let now: Vec<Restored> =
            tier.owed_deletes().lock().iter().map(|((id, _), (o, ns))| (id.clone(), ns.clone(), *o)).collect();
        log.write(&now)?;
        *written = covers;
        Ok::<_, std::io::Error>(())
    })
    .await;
    let err = match done {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    ::metrics::counter!("kvtier_peer_deletes_unsaved_total").increment(1);
    tracing::error!("{}: cannot write the deletes owed to members away: {err}", OwedLog::FILE);
}

/// Takes back the deletes `log` held when the node started: each owed again (asked again soon
/// and every so often, as when it was first missed), and the log kept from now on. Call it once,
/// before the node takes requests (it spawns the tasks that ask).
pub fn restore(peers: &Arc<PeerTier>, log: OwedLog, owed: Vec<Restored>) {
    if peers.set_owed_log(log).is_err() {
        return;
    }
    if !owed.is_empty() {
        tracing::info!(deletes = owed.len(), "deletes owed to members that were away, from before the restart");
    }
    for (id, ns, o) in owed {
        owe(peers, id, ns, o);
    }
    // Written again once: what was given up meanwhile goes.
    let peers = peers.clone();
    tokio::spawn(async move { save(&peers).await });
}

/// Asks every member of `others` to do `what` to `ns` on its own, at once, each call within
/// `peer_timeout`. Queued forwards of `ns` are dropped first (they would bring blocks back).
pub async fn delete_elsewhere(
    peers: &Arc<PeerTier>,
    others: &[Member],
    ns: &Namespace,
    what: NamespaceDelete,
) -> ClusterDelete {
    let asked = SystemTime::now();
    peers.mark_deleted(ns.id());
    let mut out = ClusterDelete::default();
    for (id, ago) in peers.departed() {
        if others.iter().all(|m| m.id != id) {
            out.away.push((id.clone(), format!("not a member now (gone {ago:.0?}); asked when it is back")));
            owe(peers, id, ns.clone(), Owed { what, asked });
        }
    }
    let calls =
        others.iter().map(|m| async move { (m, peers.bounded(m, peers.transport().delete(m, ns, what, asked)).await) });
    for (m, r) in futures::future::join_all(calls).await {
        match r {
            Ok((sessions, blocks)) => {
                out.members_done += 1;
                out.sessions_dropped += sessions;
                out.blocks_removed += blocks;
            }
            Err(e) => {
                peers.failed(m, "delete", &e);
                out.failed.push((m.id.clone(), e.to_string()));
                owe(peers, m.id.clone(), ns.clone(), Owed { what, asked });
            }
        }
    }
    // What is owed now is durable before the delete is answered.
    if !out.away.is_empty() || !out.failed.is_empty() {
        save(peers).await;
    }
    out
}

/// Takes the delete owed to `key` out if it is still `owed` (a newer one that replaced it
/// stays); whether it went.
fn settle(peers: &PeerTier, key: &(NodeId, kvtier_proto::NamespaceId), owed: Owed) -> bool {
    let mut all = peers.owed_deletes().lock();
    let same = all.get(key).map(|e| e.0) == Some(owed);
    if same {
        all.remove(key);
        ::metrics::gauge!("kvtier_peer_deletes_owed").set(all.len() as f64);
    }
    same
}

/// Owes `owed` of `ns` to member `id`: one retrying task per member and namespace, which asks
/// until the member answers, [`OWED_FOR`] passes, or this node's peer tier is gone. A delete
/// already owed there is replaced (the task sends the latest; an unregistration is not
/// replaced by a purge). The member is looked up in the membership at every try, so one that
/// left (killed: its TTL ran out) and came back is asked at its new addresses.
fn owe(peers: &Arc<PeerTier>, id: NodeId, ns: Namespace, owed: Owed) {
    let key = (id.clone(), ns.id());
    {
        let mut all = peers.owed_deletes().lock();
        if let Some((pending, _)) = all.get_mut(&key) {
            if !(pending.what == NamespaceDelete::Unregister && owed.what == NamespaceDelete::Purge) {
                *pending = owed;
            }
            return;
        }
        if all.len() >= MAX_OWED {
            ::metrics::counter!("kvtier_peer_deletes_abandoned_total").increment(1);
            tracing::warn!(peer = %id, "a {} missed by an unreachable member is not retried: {MAX_OWED} are owed already", owed.what.name());
            return;
        }
        all.insert(key.clone(), (owed, ns.clone()));
        ::metrics::gauge!("kvtier_peer_deletes_owed").set(all.len() as f64);
    }
    let tier = Arc::downgrade(peers);
    let mut members = peers.members();
    tokio::spawn(async move {
        let mut wait = RETRY_FIRST;
        let mut watching = true;
        let done = loop {
            // A change of the membership (the member coming back) tries at once.
            tokio::select! {
                _ = tokio::time::sleep(wait) => wait = (wait * 2).min(RETRY_MAX),
                changed = members.changed(), if watching => watching = changed.is_ok(),
            }
            let Some(peers) = tier.upgrade() else { return };
            let Some(now_owed) = peers.owed_deletes().lock().get(&key).map(|e| e.0) else { return };
            // Counted from when it was asked (before a restart of this node too).
            if now_owed.age() > OWED_FOR {
                // Replaced by a newer delete meanwhile: that one is sent on the next try.
                if settle(&peers, &key, now_owed) {
                    save(&peers).await;
                    break None;
                }
                continue;
            }
            let member = peers.members().borrow().get(&id).cloned();
            let Some(member) = member else { continue };
            let call = peers.transport().delete(&member, &ns, now_owed.what, now_owed.asked);
            if peers.bounded(&member, call).await.is_ok() {
                // Replaced meanwhile: the newer one is sent on the next try.
                if settle(&peers, &key, now_owed) {
                    save(&peers).await;
                    break Some(now_owed.what);
                }
                wait = Duration::ZERO;
            }
        };
        match done {
            Some(what) => {
                ::metrics::counter!("kvtier_peer_deletes_retried_total").increment(1);
                tracing::info!(peer = %id, "a {} the member missed was done there", what.name());
            }
            None => {
                ::metrics::counter!("kvtier_peer_deletes_abandoned_total").increment(1);
                tracing::warn!(peer = %id, "a delete the member missed was given up {OWED_FOR:?} after it was asked");
            }
        }
    });
}
