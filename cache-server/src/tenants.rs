//! Tenants as principals: which credential belongs to whom, what each principal may touch (its own
//! namespaces, and others' only by an explicit grant in the config), and each tenant's quotas.
//! Every plane authenticates a connection or call once ([`Tenants::authenticate`]) and checks every
//! request against the namespace's owner ([`Principal::may`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::config::ServerConfig;
use crate::error::ServerError;

/// What a request does to a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Look up, load, resume, list.
    Read,
    /// Store, park, extend, drop, purge.
    Write,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
        }
    }
}

/// A tenant refused for one of its quotas: counted under its name and the quota
/// (`kvtier_quota_refusals_total{tenant,quota}`: tenants are the operator's, so the labels are
/// bounded) and said at DEBUG, so that an operator sees which tenant runs into which limit.
pub fn quota_refused(tenant: &str, quota: &'static str, why: String) -> ServerError {
    ::metrics::counter!("kvtier_quota_refusals_total", "tenant" => tenant.to_string(), "quota" => quota).increment(1);
    tracing::debug!(tenant, quota, "refused for a quota: {why}");
    ServerError::QuotaExceeded(why)
}

/// Quotas of one tenant (`None`: none of that kind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quotas {
    pub max_namespaces: Option<u64>,
    pub max_sessions: Option<u64>,
    pub max_session_bytes: Option<u64>,
    pub dram_bytes: Option<u64>,
    pub disk_bytes: Option<u64>,
}

/// A configured tenant.
#[derive(Debug)]
pub struct Tenant {
    pub name: String,
    /// A small number the tiers account the tenant's bytes under (0 is the operator's).
    pub index: u32,
    read: HashSet<String>,
    write: HashSet<String>,
    pub quotas: Quotas,
    /// Its data-plane, same-node and gRPC connections open now (see [`Tenant::connection`]).
    connections: std::sync::atomic::AtomicUsize,
    /// Its session creates asking the cluster whether their id is free now (see
    /// [`Tenant::create_check`]).
    create_checks: tokio::sync::Semaphore,
}

/// Session creates one tenant may have asking the cluster at once (each claims its id in the
/// cluster's Redis and asks every member): more wait for one of these to end.
pub const MAX_CREATE_CHECKS_PER_TENANT: usize = 32;

impl Tenant {
    /// One of the tenant's `max` connection slots (data plane, same-node socket and gRPC together),
    /// held until dropped; the number it holds already when they are all taken.
    pub fn connection(self: &Arc<Self>, max: usize) -> Result<TenantConnection, usize> {
        use std::sync::atomic::Ordering;
        self.connections
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .map(|_| TenantConnection(self.clone()))
    }

    /// One of the tenant's [`MAX_CREATE_CHECKS_PER_TENANT`] slots for a session create's check
    /// across the cluster, held until dropped; waited for up to `within`, then refused (`Capacity`,
    /// retry), so one tenant's flood of creates loads the cluster's Redis and members no more than
    /// that many checks at a time, and waits behind its own checks only.
    pub async fn create_check(&self, within: Duration) -> Result<tokio::sync::SemaphorePermit<'_>, ServerError> {
        let busy = || {
            ::metrics::counter!("kvtier_session_create_checks_refused_total").increment(1);
            ServerError::Capacity(format!(
                "tenant {:?} has {MAX_CREATE_CHECKS_PER_TENANT} session creates asking the cluster already, and \
                 none ended within {within:?}; retry",
                self.name
            ))
        };
        match tokio::time::timeout(within, self.create_checks.acquire()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(busy()),
        }
    }
}

/// A slot for a connection of `principal`'s (see [`Tenant::connection`]): `None` for the
/// operator, who has no such limit; why not when the tenant holds `max` already (counted in
/// `kvtier_connections_refused_total{listener, reason="per_tenant"}`).
pub fn connection_slot(
    principal: &Principal,
    max: usize,
    listener: &'static str,
) -> Result<Option<TenantConnection>, String> {
    let Principal::Tenant(t) = principal else { return Ok(None) };
    t.connection(max).map(Some).map_err(|n| {
        metrics::counter!("kvtier_connections_refused_total", "listener" => listener, "reason" => "per_tenant")
            .increment(1);
        format!("tenant {:?} has {n} connections to this node already (max_connections_per_tenant)", t.name)
    })
}

/// A connection slot of a tenant's, given back when dropped.
#[derive(Debug)]
pub struct TenantConnection(Arc<Tenant>);

impl Drop for TenantConnection {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Who is asking.
#[derive(Debug, Clone)]
pub enum Principal {
    /// The node's operator: no tenants configured (one user), or the holder of `auth_token`.
    /// Reaches every namespace.
    Operator,
    Tenant(Arc<Tenant>),
}

impl Principal {
    /// Whether this principal may `access` a namespace owned by `owner` (its `tenant` field).
    pub fn may(&self, access: Access, owner: &str) -> bool {
        match self {
            Principal::Operator => true,
            Principal::Tenant(t) => {
                t.name == owner || t.write.contains(owner) || (access == Access::Read && t.read.contains(owner))
            }
        }
    }

    /// Whether two credentials stand for the same principal.
    pub fn same_as(&self, other: &Principal) -> bool {
        match (self, other) {
            (Principal::Operator, Principal::Operator) => true,
            (Principal::Tenant(a), Principal::Tenant(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// The tenant's name, or `"operator"` (for logs and audit lines).
    pub fn name(&self) -> &str {
        match self {
            Principal::Operator => "operator",
            Principal::Tenant(t) => &t.name,
        }
    }

    pub fn tenant(&self) -> Option<&Arc<Tenant>> {
        match self {
            Principal::Operator => None,
            Principal::Tenant(t) => Some(t),
        }
    }

    /// The refusal for a request this principal may not make (no namespace id in it: ids are
    /// not to be confirmed to someone who may not use them).
    pub fn refusal(&self, access: Access, what: &str) -> ServerError {
        metrics::counter!("kvtier_auth_denied_total", "access" => access.as_str()).increment(1);
        // A client can set this off on every request: said once per 10 s (all counted above).
        static SAID: crate::metrics::LogThrottle = crate::metrics::LogThrottle::new(std::time::Duration::from_secs(10));
        if let Some(held_back) = SAID.allow() {
            tracing::warn!(
                principal = self.name(),
                access = access.as_str(),
                what,
                held_back,
                "request refused: not granted (held_back: refusals not logged since the last line)"
            );
        }
        ServerError::Forbidden(format!("tenant {:?} may not {} {what}", self.name(), access.as_str()))
    }
}

/// Why a connection's or call's credentials were refused (said to the client: it names only
/// what the client itself presented).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("missing credential (a bearer token or a client certificate)")]
    NoCredential,
    #[error("bad credential: the token is not one this node knows")]
    BadToken,
    #[error("the client certificate names {cert:?} and the token {token:?}: both must name the same tenant")]
    CertAndTokenDiffer { cert: String, token: String },
    /// A verified certificate whose names stand for nobody here (and no token beside it).
    #[error(
        "the client certificate ({names}) stands for no tenant or operator on this node: add one of its names to a \
         tenant's cert_names or to tls.operator_names, or present a token"
    )]
    UnmappedCert { names: String },
}

/// Whom a connection's verified TLS client certificate stands for.
#[derive(Debug, Clone, Default)]
pub enum CertIdentity {
    /// No certificate: no TLS, or none presented.
    #[default]
    Absent,
    /// A certificate whose names no tenant's `cert_names` and no `tls.operator_names` hold, or
    /// that names two principals (refused, not guessed): its names, for the refusal.
    Unmapped(String),
    Known(Principal),
}

impl CertIdentity {
    pub fn principal(&self) -> Option<&Principal> {
        match self {
            CertIdentity::Known(p) => Some(p),
            _ => None,
        }
    }
}

/// The node's credentials and tenants.
#[derive(Debug, Default)]
pub struct Tenants {
    /// blake3 of each accepted token. Looking tokens up by their hash keeps the comparison's
    /// timing independent of how much of a guessed token is right (only of its hash, which tells
    /// an attacker nothing about the token).
    by_token: HashMap<[u8; 32], Principal>,
    /// Client-certificate names (verified by TLS against `tls.client_ca`) and whom they stand for.
    by_cert_name: HashMap<String, Principal>,
    by_name: HashMap<String, Arc<Tenant>>,
    /// Same-node tickets issued to callers of the control plane.
    tickets: crate::tickets::Tickets,
}

fn token_hash(token: &[u8]) -> [u8; 32] {
    *blake3::hash(token).as_bytes()
}

fn check_token(owner: &str, t: &str) -> Result<(), ServerError> {
    if t.len() < 16 || t.len() > kvtier_proto::dataplane::MAX_TOKEN_LEN {
        return Err(ServerError::Config(format!("tenant {owner:?}: every token must be 16..=1024 bytes")));
    }
    Ok(())
}

impl Tenants {
    /// Builds the credential table; refuses duplicate names or tokens, grants naming no tenant,
    /// unreadable token files and tokens of the wrong size.
    pub fn from_config(c: &ServerConfig) -> Result<Tenants, ServerError> {
        let mut out = Tenants::default();
        let names: HashSet<&str> = c.tenants.iter().map(|t| t.name.as_str()).collect();
        for (i, t) in c.tenants.iter().enumerate() {
            if t.name.is_empty() || t.name.len() > 256 {
                return Err(ServerError::Config("tenants: every name must be 1..=256 bytes".into()));
            }
            for g in t.read.iter().chain(&t.write) {
                if !names.contains(g.as_str()) {
                    return Err(ServerError::Config(format!(
                        "tenant {:?} is granted {g:?}, which is no tenant",
                        t.name
                    )));
                }
            }
            let tenant = Arc::new(Tenant {
                name: t.name.clone(),
                index: i as u32 + 1,
                read: t.read.iter().cloned().collect(),
                write: t.write.iter().cloned().collect(),
                quotas: Quotas {
                    max_namespaces: t.max_namespaces,
                    max_sessions: t.max_sessions,
                    max_session_bytes: t.max_session_bytes.map(|b| b.0),
                    dram_bytes: t.dram_bytes.map(|b| b.0),
                    disk_bytes: t.disk_bytes.map(|b| b.0),
                },
                connections: Default::default(),
                create_checks: tokio::sync::Semaphore::new(MAX_CREATE_CHECKS_PER_TENANT),
            });
            if out.by_name.insert(t.name.clone(), tenant.clone()).is_some() {
                return Err(ServerError::Config(format!("tenant {:?} is configured twice", t.name)));
            }
            let mut tokens = t.tokens.clone();
            if let Some(path) = &t.token_file {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    ServerError::Config(format!("tenant {:?}: token_file {}: {e}", t.name, path.display()))
                })?;
                tokens.push(text.trim().to_string());
            }
            if tokens.is_empty() && t.cert_names.is_empty() {
                return Err(ServerError::Config(format!("tenant {:?} has neither a token nor cert_names", t.name)));
            }
            for n in &t.cert_names {
                out.add_cert_name(n, Principal::Tenant(tenant.clone()))?;
            }
            for tok in tokens {
                check_token(&t.name, &tok)?;
                if out.by_token.insert(token_hash(tok.as_bytes()), Principal::Tenant(tenant.clone())).is_some() {
                    return Err(ServerError::Config(format!("tenant {:?}: a token is used twice", t.name)));
                }
            }
        }
        if !out.by_cert_name.is_empty() && c.tls.as_ref().is_none_or(|t| t.client_ca.is_none()) {
            return Err(ServerError::Config("tenants name cert_names but tls.client_ca is not set".into()));
        }
        if let Some(tls) = &c.tls {
            for n in &tls.operator_names {
                out.add_cert_name(n, Principal::Operator)?;
            }
            if !tls.operator_names.is_empty() && tls.client_ca.is_none() {
                return Err(ServerError::Config("tls.operator_names is set but tls.client_ca is not".into()));
            }
        }
        if let Some(op) = &c.auth_token {
            if out.by_token.insert(token_hash(op.as_bytes()), Principal::Operator).is_some() {
                return Err(ServerError::Config("auth_token is also a tenant's token".into()));
            }
        }
        Ok(out)
    }

    fn add_cert_name(&mut self, name: &str, who: Principal) -> Result<(), ServerError> {
        if name.is_empty() || name.len() > 1024 {
            return Err(ServerError::Config("every certificate name must be 1..=1024 bytes".into()));
        }
        if self.by_cert_name.insert(name.to_string(), who).is_some() {
            return Err(ServerError::Config(format!("certificate name {name:?} is given to two principals")));
        }
        Ok(())
    }

    /// Whether callers must present a credential (any token or certificate name is configured).
    pub fn required(&self) -> bool {
        !self.by_token.is_empty() || !self.by_cert_name.is_empty()
    }

    /// Whom a verified client certificate's names stand for (none: no certificate was
    /// presented); `Unmapped` when no name is configured, or when its names point at two
    /// different principals (refused, not guessed).
    pub fn authenticate_cert(&self, names: &[String]) -> CertIdentity {
        if names.is_empty() {
            return CertIdentity::Absent;
        }
        let unmapped = || {
            let shown: Vec<String> = names.iter().take(4).map(|n| format!("{n:?}")).collect();
            let more = if names.len() > 4 { format!(" and {} more", names.len() - 4) } else { String::new() };
            CertIdentity::Unmapped(format!("names {}{more}", shown.join(", ")))
        };
        let mut found: Option<&Principal> = None;
        for n in names {
            if let Some(p) = self.by_cert_name.get(n) {
                match found {
                    Some(f) if !f.same_as(p) => {
                        tracing::warn!("a client certificate names two principals: refused");
                        return unmapped();
                    }
                    _ => found = Some(p),
                }
            }
        }
        found.map_or_else(unmapped, |p| CertIdentity::Known(p.clone()))
    }

    /// Who a connection or call acts for, from what it presented: its certificate's principal
    /// (from [`Self::authenticate_cert`]) and/or a token. A token beside a certificate principal
    /// must name the same principal; why not when refused.
    pub fn resolve(&self, cert: &CertIdentity, token: Option<&[u8]>) -> Result<Principal, Refused> {
        if let (CertIdentity::Unmapped(names), None) = (cert, token) {
            if self.required() {
                metrics::counter!("kvtier_auth_failed_total").increment(1);
                return Err(Refused::UnmappedCert { names: names.clone() });
            }
        }
        match (cert.principal(), token) {
            (Some(p), None) => Ok(p.clone()),
            // A bad token is counted by `authenticate`; a good one naming someone else here.
            (Some(p), Some(t)) => match self.authenticate(Some(t)).ok_or(Refused::BadToken)? {
                q if q.same_as(p) => Ok(q),
                q => {
                    metrics::counter!("kvtier_auth_failed_total").increment(1);
                    Err(Refused::CertAndTokenDiffer { cert: p.name().to_string(), token: q.name().to_string() })
                }
            },
            (None, None) => self.authenticate(None).ok_or(Refused::NoCredential),
            (None, token) => self.authenticate(token).ok_or(Refused::BadToken),
        }
    }

    /// The principal a presented token (`None`: no token) stands for; `None` when refused.
    pub fn authenticate(&self, token: Option<&[u8]>) -> Option<Principal> {
        if !self.required() {
            return Some(Principal::Operator);
        }
        let found = self.by_token.get(&token_hash(token?)).cloned();
        if found.is_none() {
            metrics::counter!("kvtier_auth_failed_total").increment(1);
        }
        found
    }

    /// The same-node tickets (see [`crate::tickets`]).
    pub fn tickets(&self) -> &crate::tickets::Tickets {
        &self.tickets
    }

    /// Every configured tenant.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.by_name.values()
    }

    pub fn tenant(&self, name: &str) -> Option<&Arc<Tenant>> {
        self.by_name.get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ByteSize, TenantConfig};

    fn cfg() -> ServerConfig {
        ServerConfig {
            tenants: vec![
                TenantConfig { name: "a".into(), tokens: vec!["token-of-tenant-a".into()], ..Default::default() },
                TenantConfig {
                    name: "b".into(),
                    tokens: vec!["token-of-tenant-b".into()],
                    read: vec!["a".into()],
                    dram_bytes: Some(ByteSize(1 << 20)),
                    ..Default::default()
                },
            ],
            ..ServerConfig::default()
        }
    }

    #[test]
    fn tokens_map_to_their_tenant_and_nothing_else() {
        let t = Tenants::from_config(&cfg()).unwrap();
        assert!(t.required());
        assert_eq!(t.authenticate(Some(b"token-of-tenant-a")).unwrap().name(), "a");
        assert_eq!(t.authenticate(Some(b"token-of-tenant-b")).unwrap().name(), "b");
        assert!(t.authenticate(Some(b"token-of-tenant-c")).is_none());
        assert!(t.authenticate(Some(b"token-of-tenant-")).is_none());
        assert!(t.authenticate(None).is_none());
    }

    /// A tenant's creates ask the cluster at most 32 at a time: the next waits for one to end,
    /// and is refused naming the tenant when none does in time; another tenant's go on.
    #[tokio::test]
    async fn a_tenant_s_create_checks_are_bounded_and_leave_others_alone() {
        let t = Tenants::from_config(&cfg()).unwrap();
        let Principal::Tenant(a) = t.authenticate(Some(b"token-of-tenant-a")).unwrap() else { panic!("a tenant") };
        let Principal::Tenant(b) = t.authenticate(Some(b"token-of-tenant-b")).unwrap() else { panic!("a tenant") };
        let wait = Duration::from_millis(50);
        let mut held = Vec::new();
        for _ in 0..MAX_CREATE_CHECKS_PER_TENANT {
            held.push(a.create_check(wait).await.unwrap());
        }
        let refused = a.create_check(wait).await.unwrap_err();
        assert!(matches!(refused, ServerError::Capacity(_)), "{refused}");
        assert!(refused.to_string().contains("tenant \"a\" has 32 session creates"), "{refused}");
        assert!(b.create_check(wait).await.is_ok(), "another tenant's create is not held back");
        let waiting = a.create_check(Duration::from_secs(5));
        let ended = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            held.pop();
        };
        let (next, ()) = tokio::join!(waiting, ended);
        assert!(next.is_ok(), "a slot given back is taken by the one waiting");
    }

    fn tls_cfg() -> ServerConfig {
        let mut c = cfg();
        c.tenants[0].cert_names = vec!["a.clients".into(), "spiffe://fleet/a".into()];
        c.tenants.push(TenantConfig { name: "certonly".into(), cert_names: vec!["co".into()], ..Default::default() });
        c.tls = Some(crate::config::TlsConfig {
            cert: "node.pem".into(),
            key: "node.key".into(),
            client_ca: Some("ca.pem".into()),
            require_client_cert: Some(false),
            operator_names: vec!["ops".into()],
        });
        c
    }

    #[test]
    fn certificate_names_map_to_one_principal_and_a_token_must_agree() {
        let t = Tenants::from_config(&tls_cfg()).unwrap();
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let known = |n: &[&str]| t.authenticate_cert(&names(n)).principal().cloned();
        assert_eq!(known(&["spiffe://fleet/a"]).unwrap().name(), "a");
        assert_eq!(known(&["unknown", "a.clients"]).unwrap().name(), "a");
        assert_eq!(known(&["co"]).unwrap().name(), "certonly");
        assert!(matches!(known(&["ops"]), Some(Principal::Operator)));
        assert!(matches!(t.authenticate_cert(&[]), CertIdentity::Absent));
        assert!(
            matches!(t.authenticate_cert(&names(&["unknown"])), CertIdentity::Unmapped(n) if n == "names \"unknown\"")
        );
        assert!(
            matches!(t.authenticate_cert(&names(&["a.clients", "co"])), CertIdentity::Unmapped(_)),
            "two principals: refused"
        );
        let a = t.authenticate_cert(&names(&["a.clients"]));
        assert_eq!(t.resolve(&a, None).unwrap().name(), "a");
        assert_eq!(t.resolve(&a, Some(b"token-of-tenant-a")).unwrap().name(), "a");
        let differ = t.resolve(&a, Some(b"token-of-tenant-b")).unwrap_err();
        assert_eq!(
            differ,
            Refused::CertAndTokenDiffer { cert: "a".into(), token: "b".into() },
            "certificate a, token b"
        );
        assert!(differ.to_string().contains("both must name the same tenant"), "{differ}");
        assert_eq!(t.resolve(&a, Some(b"no such token at all")).unwrap_err(), Refused::BadToken);
        assert_eq!(t.resolve(&CertIdentity::Absent, Some(b"token-of-tenant-b")).unwrap().name(), "b");
        assert_eq!(
            t.resolve(&CertIdentity::Absent, None).unwrap_err(),
            Refused::NoCredential,
            "certificate names make credentials required"
        );
        // A certificate standing for nobody is said to be one, not "missing credential"; with a
        // good token beside it the token speaks.
        let nobody = t.authenticate_cert(&names(&["spiffe://fleet/eng-a"]));
        let e = t.resolve(&nobody, None).unwrap_err();
        assert_eq!(e, Refused::UnmappedCert { names: "names \"spiffe://fleet/eng-a\"".into() });
        assert!(
            e.to_string().contains("stands for no tenant or operator") && e.to_string().contains("cert_names"),
            "{e}"
        );
        assert_eq!(t.resolve(&nobody, Some(b"token-of-tenant-b")).unwrap().name(), "b");
    }

    #[test]
    fn certificate_names_need_a_client_ca_and_belong_to_one_principal() {
        let mut c = tls_cfg();
        c.tls.as_mut().unwrap().client_ca = None;
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("client_ca"));
        let mut c = tls_cfg();
        c.tls.as_mut().unwrap().operator_names = vec!["co".into()];
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("two principals"));
        let mut c = tls_cfg();
        c.tenants[1].tokens.clear();
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("neither a token nor cert_names"));
    }

    #[test]
    fn no_credentials_configured_means_one_user() {
        let t = Tenants::from_config(&ServerConfig::default()).unwrap();
        assert!(!t.required());
        assert!(matches!(t.authenticate(None), Some(Principal::Operator)));
    }

    #[test]
    fn grants_are_explicit_and_directed() {
        let t = Tenants::from_config(&cfg()).unwrap();
        let a = t.authenticate(Some(b"token-of-tenant-a")).unwrap();
        let b = t.authenticate(Some(b"token-of-tenant-b")).unwrap();
        assert!(a.may(Access::Write, "a") && a.may(Access::Read, "a"));
        assert!(!a.may(Access::Read, "b"), "b granted a nothing");
        assert!(b.may(Access::Read, "a"), "a's namespaces are readable by b");
        assert!(!b.may(Access::Write, "a"), "a read grant is not a write grant");
        assert!(Principal::Operator.may(Access::Write, "a"));
        assert_eq!(t.tenant("b").map(|t| (t.index, t.quotas.dram_bytes)), Some((2, Some(1 << 20))));
        assert!(t.tenant("nobody").is_none());
    }

    #[test]
    fn bad_tenant_configs_are_refused_with_the_reason() {
        let mut c = cfg();
        c.tenants[1].read = vec!["zzz".into()];
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("no tenant"));
        let mut c = cfg();
        c.tenants[1].tokens = vec!["token-of-tenant-a".into()];
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("used twice"));
        let mut c = cfg();
        c.tenants[0].tokens = vec!["short".into()];
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("16..=1024"));
        let mut c = cfg();
        c.tenants[0].tokens.clear();
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("neither a token nor cert_names"));
        let mut c = cfg();
        c.tenants.push(c.tenants[0].clone());
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("twice"));
        let mut c = cfg();
        c.auth_token = Some("token-of-tenant-a".into());
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("auth_token"));
    }

    #[test]
    fn token_files_are_read_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.token");
        std::fs::write(&f, "  token-from-a-file-0001\n").unwrap();
        let mut c = cfg();
        c.tenants[0].token_file = Some(f);
        let t = Tenants::from_config(&c).unwrap();
        assert_eq!(t.authenticate(Some(b"token-from-a-file-0001")).unwrap().name(), "a");
        c.tenants[0].token_file = Some(dir.path().join("missing"));
        assert!(Tenants::from_config(&c).unwrap_err().to_string().contains("token_file"));
    }
}
