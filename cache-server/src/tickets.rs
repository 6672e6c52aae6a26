//! Same-node tickets: how a client authenticated only by its TLS client certificate gets onto
//! the same-node Unix socket, where no certificate is presented. Over the (authenticated) control
//! plane it asks for a ticket (`SameNodeTicket`); the node remembers the ticket's hash with the
//! caller's principal for [`TICKET_TTL`]; the client presents it as the token in the socket's
//! hello, which redeems it: once, before it expires, and only there (the data plane and gRPC
//! never accept one). The connection then acts for that principal, so a ticket opens exactly the
//! namespaces its caller could use. Outstanding tickets are capped per principal
//! ([`MAX_TICKETS_PER_PRINCIPAL`]: its own oldest go first) and in all ([`MAX_TICKETS`]: the oldest
//! of whoever holds the most go first), so one tenant asking for tickets by the thousand can't
//! void another's ticket before it is redeemed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::ServerError;
use crate::tenants::Principal;

/// How long a ticket may wait to be redeemed.
pub const TICKET_TTL: Duration = Duration::from_secs(60);
/// Most tickets outstanding at once on a node.
pub const MAX_TICKETS: usize = 4096;
/// Most tickets one principal may have outstanding (a client asks for one per same-node
/// connection it opens, and redeems it at once).
pub const MAX_TICKETS_PER_PRINCIPAL: usize = 256;
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
        // A flood of requests can't grow the table, nor void others' tickets: the one closest to
        // expiring of the caller's own goes first, and, with the table full, of whoever holds the
        // most.
        if live.values().filter(|(p, _)| p.same_as(who)).count() >= MAX_TICKETS_PER_PRINCIPAL {
            Self::void_oldest_of(&mut live, who);
        }
        if live.len() >= MAX_TICKETS {
            let mut held: HashMap<&str, usize> = HashMap::new();
            for (p, _) in live.values() {
                *held.entry(p.name()).or_default() += 1;
            }
            let most = held.into_iter().max_by_key(|(_, n)| *n).map(|(name, _)| name.to_string());
            let most = live.values().map(|(p, _)| p).find(|p| Some(p.name()) == most.as_deref()).cloned();
            if let Some(most) = most {
                Self::void_oldest_of(&mut live, &most);
            }
        }
        live.insert(*blake3::hash(ticket.as_bytes()).as_bytes(), (who.clone(), now + TICKET_TTL));
        metrics::counter!("kvtier_samenode_tickets_total", "event" => "issued").increment(1);
        Ok(ticket)
    }

    fn void_oldest_of(live: &mut HashMap<[u8; 32], (Principal, Instant)>, who: &Principal) {
        let oldest = live.iter().filter(|(_, (p, _))| p.same_as(who)).min_by_key(|(_, (_, e))| *e).map(|(k, _)| *k);
        if let Some(oldest) = oldest {
            live.remove(&oldest);
        }
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

    fn tenants(n: usize) -> crate::tenants::Tenants {
        use crate::config::{ServerConfig, TenantConfig};
        let tenants = (0..n)
            .map(|i| TenantConfig {
                name: format!("t{i}"),
                tokens: vec![format!("token-of-tenant-{i:04}")],
                ..Default::default()
            })
            .collect();
        crate::tenants::Tenants::from_config(&ServerConfig { tenants, ..ServerConfig::default() }).unwrap()
    }

    /// One principal's flood voids its own oldest tickets, not another's; with many principals
    /// the table holds [`MAX_TICKETS`], voiding the oldest of whoever holds the most. Before, the
    /// oldest ticket of the node went, whoever's it was.
    #[test]
    fn the_table_stays_bounded_and_one_principal_s_flood_voids_only_its_own() {
        let ts = tenants(MAX_TICKETS / MAX_TICKETS_PER_PRINCIPAL + 4);
        let who = |i: usize| ts.authenticate(Some(format!("token-of-tenant-{i:04}").as_bytes())).unwrap();
        let t = Tickets::default();
        let now = Instant::now();
        let at = |i: usize| now + Duration::from_millis(1 + i as u64);
        let other = t.issue_at(&who(0), now).unwrap();
        let first = t.issue_at(&Principal::Operator, now).unwrap();
        for i in 0..MAX_TICKETS {
            t.issue_at(&Principal::Operator, at(i)).unwrap();
        }
        assert_eq!(t.live.lock().unwrap().len(), MAX_TICKETS_PER_PRINCIPAL + 1);
        assert!(t.redeem_at(first.as_bytes(), now).is_none(), "the flood's own oldest went first");
        assert!(t.redeem_at(other.as_bytes(), now).is_some_and(|p| p.same_as(&who(0))), "another's is kept");
        // Every tenant at its cap: the table holds MAX_TICKETS, and a quiet tenant's ticket stays.
        let quiet = t.issue_at(&who(1), now).unwrap();
        for i in 0..MAX_TICKETS * 2 {
            t.issue_at(&who(2 + i % (MAX_TICKETS / MAX_TICKETS_PER_PRINCIPAL + 2)), at(i)).unwrap();
        }
        assert_eq!(t.live.lock().unwrap().len(), MAX_TICKETS);
        assert!(t.redeem_at(quiet.as_bytes(), now).is_some(), "the quiet tenant's ticket is kept");
    }
}
