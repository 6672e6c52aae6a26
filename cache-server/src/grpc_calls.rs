//! What a gRPC connection's calls tell the listener that holds it: whether one passed the
//! credential check, whose tenant slot the connection holds (`max_connections_per_tenant`), and
//! how long it has had no call in flight, so that it is closed after `idle_timeout` idle.
//!
//! The listener's [`crate::listen::GrpcConn`] and every call's extensions share one
//! [`ConnCalls`]; the credential check admits a call through it, and [`GrpcCallsLayer`] counts the
//! calls in flight: a call lasts until its answer's body is dropped, so a stream
//! (`WatchEvents`, `AgentDemands`) keeps its connection for as long as it is open.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tonic::codegen::http;

use crate::tenants::{Principal, TenantConnection};

/// One gRPC connection's calls, as its listener and its calls see them.
#[derive(Debug)]
pub struct ConnCalls {
    authenticated: AtomicBool,
    /// The tenant slot the connection took with its first call of a tenant's.
    tenant_slot: parking_lot::Mutex<Option<TenantConnection>>,
    in_flight: AtomicUsize,
    /// When the last call ended (or the connection opened), as ms after `opened`.
    last_end_ms: AtomicU64,
    opened: Instant,
}

impl Default for ConnCalls {
    fn default() -> Self {
        ConnCalls {
            authenticated: AtomicBool::new(false),
            tenant_slot: parking_lot::Mutex::new(None),
            in_flight: AtomicUsize::new(0),
            last_end_ms: AtomicU64::new(0),
            opened: Instant::now(),
        }
    }
}

impl ConnCalls {
    /// Whether a call of the connection passed the credential check and was admitted.
    pub fn authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }

    /// Admits a call that authenticated as `principal`: a tenant's first call takes one of its
    /// `max` connection slots for the connection (held until the connection closes); why not
    /// when the tenant holds them all. Later calls, whoever they are from, ride on that slot (the
    /// operator's take none).
    pub fn admit(&self, principal: &Principal, max: usize) -> Result<(), String> {
        if let Principal::Tenant(_) = principal {
            let mut slot = self.tenant_slot.lock();
            if slot.is_none() {
                *slot = crate::tenants::connection_slot(principal, max, "grpc")?;
            }
        }
        self.authenticated.store(true, Ordering::Release);
        Ok(())
    }

    /// How long the connection has had no call in flight; `None` while one is.
    pub fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.last_end_ms.load(Ordering::Acquire));
        Some(self.opened.elapsed().saturating_sub(since))
    }

    fn begin(self: &Arc<Self>) -> CallInFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        CallInFlight(self.clone())
    }
}

/// One call in flight on its connection, until dropped.
#[derive(Debug)]
struct CallInFlight(Arc<ConnCalls>);

impl Drop for CallInFlight {
    fn drop(&mut self) {
        let c = &self.0;
        // The end is stamped before the call stops counting: a connection is never seen idle
        // with the time of an earlier call's end.
        c.last_end_ms.fetch_max(c.opened.elapsed().as_millis() as u64, Ordering::AcqRel);
        c.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts every call in flight on its connection (found in the request's extensions as
/// [`crate::listen::GrpcPeer`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcCallsLayer;

impl<S> tower_layer::Layer<S> for GrpcCallsLayer {
    type Service = GrpcCalls<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcCalls { inner }
    }
}

/// [`GrpcCallsLayer`]'s service.
#[derive(Clone, Debug)]
pub struct GrpcCalls<S> {
    inner: S,
}

impl<S, B, RB> tower_service::Service<http::Request<B>> for GrpcCalls<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<CallBody<RB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let call = req.extensions().get::<crate::listen::GrpcPeer>().map(|p| p.calls.begin());
        let answer = self.inner.call(req);
        Box::pin(async move {
            let resp = answer.await?;
            Ok(resp.map(|body| CallBody { inner: body, _call: call }))
        })
    }
}

/// An answer's body, holding its call in flight until dropped.
pub struct CallBody<B> {
    inner: B,
    _call: Option<CallInFlight>,
}

impl<B: http_body::Body + Unpin> http_body::Body for CallBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ServerConfig, TenantConfig};
    use crate::tenants::Tenants;

    fn tenants() -> Tenants {
        let tenant = |name: &str| TenantConfig {
            name: name.into(),
            tokens: vec![format!("token-of-tenant-{name}")],
            ..Default::default()
        };
        Tenants::from_config(&ServerConfig { tenants: vec![tenant("a"), tenant("b")], ..ServerConfig::default() })
            .unwrap()
    }

    #[test]
    fn a_connection_is_idle_only_with_no_call_in_flight_and_since_the_last_ended() {
        let calls = Arc::new(ConnCalls::default());
        std::thread::sleep(Duration::from_millis(30));
        assert!(calls.idle_for().unwrap() >= Duration::from_millis(30), "idle since it opened");
        let (a, b) = (calls.begin(), calls.begin());
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(calls.idle_for(), None);
        drop(a);
        assert_eq!(calls.idle_for(), None, "another call is still in flight");
        drop(b);
        assert!(calls.idle_for().unwrap() < Duration::from_millis(20), "idle from the last call's end");
    }

    #[test]
    fn a_connection_takes_its_tenant_s_slot_once_and_gives_it_back_when_closed() {
        let t = tenants();
        let (a, b) =
            (t.authenticate(Some(b"token-of-tenant-a")).unwrap(), t.authenticate(Some(b"token-of-tenant-b")).unwrap());
        let (one, two, three) = (ConnCalls::default(), ConnCalls::default(), ConnCalls::default());
        assert!(!one.authenticated());
        // Its later calls, a's or b's, ride on the slot its first took.
        for p in [&a, &a, &b] {
            one.admit(p, 2).unwrap();
        }
        assert!(one.authenticated());
        two.admit(&a, 2).unwrap();
        let why = three.admit(&a, 2).unwrap_err();
        assert!(why.contains("tenant \"a\"") && why.contains("max_connections_per_tenant"), "{why}");
        assert!(!three.authenticated(), "a refused connection has made no call");
        three.admit(&b, 2).unwrap();
        drop(one);
        let four = ConnCalls::default();
        four.admit(&a, 2).expect("the closed connection's slot is taken again");
        assert!(ConnCalls::default().admit(&a, 2).is_err(), "and it was the only one free");
        ConnCalls::default().admit(&Principal::Operator, 2).expect("the operator has no such limit");
    }
}
