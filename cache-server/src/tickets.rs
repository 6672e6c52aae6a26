//! Same-node tickets: how a client authenticated only by its TLS client certificate gets onto
//! the same-node Unix socket, where no certificate is presented. Over the (authenticated) control
//! plane it asks for a ticket (`SameNodeTicket`); the node remembers the ticket's hash with the
//! caller's principal for [`TICKET_TTL`]; the client presents it as the token in the socket's
//! hello, which redeems it: once, before it expires, and only there (the data plane and gRPC
//! never accept one). The connection then acts for that principal, so a ticket opens exactly the
//! namespaces its caller could use. Outstanding tickets are capped ([`MAX_TICKETS`]; the oldest
//! go first).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::ServerError;
use crate::tenants::Principal;

/// How long a ticket may wait to be redeemed.
pub const TICKET_TTL: Duration = Duration::from_secs(60);
/// Most tickets outstanding at once on a node.
pub const MAX_TICKETS: usize = 4096;
/// What every ticket starts with: how the hello tells a ticket from a token.
pub const TICKET_PREFIX: &str = "kvsn-ticket:";

/// The tickets issued and not yet redeemed or expired, by the blake3 of the ticket.
#[derive(Debug, Default)]
pub struct Tickets {
    live: Mutex<HashMap<[u8; 32], (Principal, Instant)>>,
}

impl Tickets {
    /// A new ticket standing for `who`, valid for [`TICKET_TTL`].
    pub fn issue(&self, who: &Principal) -> Result<String, ServerError> {
        self.issue_at(who, Instant::now())
    }

    fn issue_at(&self, who: &Principal, now: Instant) -> Result<String, ServerError> {
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret)
            .map_err(|e| ServerError::Io(std::io::Error::other(format!("no randomness for a ticket: {e}"))))?;
        let ticket = format!("{TICKET_PREFIX}{}", hex(&secret));
        let mut live =
            self.live.lock().map_err(|_| ServerError::Io(std::io::Error::other("the ticket table is poisoned")))?;
        live.retain(|_, (_, expires)| *expires > now);
        if live.len() >= MAX_TICKETS {
            // The one closest to expiring goes: a flood of requests can't grow the table.
            if let Some(oldest) = live.iter().min_by_key(|(_, (_, e))| *e).map(|(k, _)| *k) {
                live.remove(&oldest);
            }
        }
        live.insert(*blake3::hash(ticket.as_bytes()).as_bytes(), (who.clone(), now + TICKET_TTL));
        metrics::counter!("kvtier_samenode_tickets_total", "event" => "issued").increment(1);
        Ok(ticket)
    }

    /// The principal `presented` stands for, removing it: `None` for a ticket never issued,
    /// already redeemed or expired.
    pub fn redeem(&self, presented: &[u8]) -> Option<Principal> {
        self.redeem_at(presented, Instant::now())
    }

    fn redeem_at(&self, presented: &[u8], now: Instant) -> Option<Principal> {
        let hash = *blake3::hash(presented).as_bytes();
        let found = self.live.lock().ok()?.remove(&hash);
        let event = match &found {
            Some((_, expires)) if *expires > now => "redeemed",
            Some(_) => "expired",
            None => "unknown",
        };
        metrics::counter!("kvtier_samenode_tickets_total", "event" => event).increment(1);
        found.filter(|(_, expires)| *expires > now).map(|(p, _)| p)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_is_redeemed_once_before_it_expires() {
        let t = Tickets::default();
        let now = Instant::now();
        let a = t.issue_at(&Principal::Operator, now).unwrap();
        assert!(a.starts_with(TICKET_PREFIX) && a.len() == TICKET_PREFIX.len() + 64);
        let b = t.issue_at(&Principal::Operator, now).unwrap();
        assert_ne!(a, b);
        assert!(t
            .redeem_at(a.as_bytes(), now + Duration::from_secs(59))
            .is_some_and(|p| p.same_as(&Principal::Operator)));
        assert!(t.redeem_at(a.as_bytes(), now).is_none(), "used once");
        assert!(t.redeem_at(b.as_bytes(), now + TICKET_TTL).is_none(), "expired");
        assert!(t.redeem_at(b"kvsn-ticket:00", now).is_none(), "never issued");
    }

    #[test]
    fn the_table_stays_bounded() {
        let t = Tickets::default();
        let now = Instant::now();
        let first = t.issue_at(&Principal::Operator, now).unwrap();
        for i in 0..MAX_TICKETS {
            t.issue_at(&Principal::Operator, now + Duration::from_millis(1 + i as u64)).unwrap();
        }
        assert_eq!(t.live.lock().unwrap().len(), MAX_TICKETS);
        assert!(t.redeem_at(first.as_bytes(), now).is_none(), "the oldest went first");
    }
}
