//! A claim across the cluster (the create of one session id) held for as long as the work it
//! guards runs: renewed well before its TTL runs out, given back when dropped. Its TTL only bounds
//! how long a node that died holding it keeps others waiting.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::Membership;
use crate::error::ServerError;

/// How long a claim is renewed at most: past it, work still running is left unguarded (warned
/// and counted) rather than keeping others waiting on a node that may be stuck.
pub const MAX_CLAIM_HOLD: Duration = Duration::from_secs(600);

/// A claim this node holds on `what`: renewed every third of its TTL while it lives, given back
/// when dropped — wherever that happens (a blocking thread included: it keeps the runtime's
/// handle).
pub struct HeldClaim {
    membership: Arc<dyn Membership>,
    what: String,
    token: String,
    lost: Arc<AtomicBool>,
    renewing: tokio::task::AbortHandle,
    rt: tokio::runtime::Handle,
}

impl HeldClaim {
    /// Claims `what` for `ttl`, renewed while held: `None` while another node holds it.
    pub async fn take(
        membership: &Arc<dyn Membership>,
        what: String,
        ttl: Duration,
    ) -> Result<Option<HeldClaim>, ServerError> {
        let Some(token) = membership.claim(&what, ttl).await? else { return Ok(None) };
        let lost = Arc::new(AtomicBool::new(false));
        let renewing = tokio::spawn(renew(membership.clone(), what.clone(), token.clone(), ttl, lost.clone()));
        Ok(Some(HeldClaim {
            membership: membership.clone(),
            what,
            token,
            lost,
            renewing: renewing.abort_handle(),
            rt: tokio::runtime::Handle::current(),
        }))
    }

    /// Whether the claim ran out while held (renewals went unanswered past its TTL, or it was
    /// held past [`MAX_CLAIM_HOLD`]): another node may hold it now.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }
}

impl Drop for HeldClaim {
    fn drop(&mut self) {
        self.renewing.abort();
        let (membership, what, token) =
            (self.membership.clone(), std::mem::take(&mut self.what), std::mem::take(&mut self.token));
        self.rt.spawn(async move { membership.release(&what, token).await });
    }
}

/// Renews the claim every third of `ttl` (so two renewals can fail before it runs out) until
/// aborted, lost, or held [`MAX_CLAIM_HOLD`].
async fn renew(membership: Arc<dyn Membership>, what: String, token: String, ttl: Duration, lost: Arc<AtomicBool>) {
    let every = (ttl / 3).max(Duration::from_millis(10));
    let until = tokio::time::Instant::now() + MAX_CLAIM_HOLD;
    loop {
        tokio::time::sleep(every).await;
        if tokio::time::Instant::now() >= until {
            tracing::warn!(claim = %what, "a cluster claim held for {MAX_CLAIM_HOLD:?} is no longer renewed");
            break;
        }
        match membership.renew(&what, &token, ttl).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(claim = %what, "a cluster claim ran out while held (its renewals went unanswered)");
                break;
            }
            // Tried again next time: two more tries are left within the TTL.
            Err(e) => tracing::debug!(claim = %what, "a cluster claim was not renewed: {e}"),
        }
    }
    lost.store(true, Ordering::Relaxed);
    ::metrics::counter!("kvtier_cluster_claims_lost_total").increment(1);
}
