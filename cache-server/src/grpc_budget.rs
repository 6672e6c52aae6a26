//! What gRPC requests still arriving may make the node hold: a tower layer around the gRPC
//! service that draws every request body's bytes from one node-wide budget
//! (`grpc_max_buffered_bytes`) as they arrive, and ends a body that stalls (no byte for
//! `stall_timeout`) or takes longer than [`BODY_DEADLINE`] in all.
//!
//! tonic reads a message whole before the handler sees it (up to 64 MiB each, 256 calls at once
//! per connection), so one client announcing large messages and never finishing them held
//! gigabytes, for as long as it kept the connection. Now a body waits for budget before more of
//! it is read (HTTP/2 flow control then holds the sender back), is refused `RESOURCE_EXHAUSTED`
//! after waiting `stall_timeout` for it, and gives its bytes back once tonic has read it
//! (decoded: the handler's copy is the request's own). A tenant's bodies also draw from its own
//! share (`grpc_max_buffered_bytes_per_tenant`, half the budget by default), so one tenant
//! holding its share leaves the rest to the others.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::codegen::http;

/// Bytes taken from the budget at a time, before a body is read on (its first piece, and each
/// next once what it read reaches what it holds).
const PIECE: u32 = 64 << 10;

/// The longest a request body may take to arrive, however steadily it trickles in.
pub const BODY_DEADLINE: Duration = Duration::from_secs(60);

/// Which tenant a request is from (by its credential), `None` for the operator's; it may leave
/// what it found in the request's extensions for the services inside.
pub type WhoAsks = Arc<dyn Fn(&http::HeaderMap, &mut http::Extensions) -> Option<String> + Send + Sync>;

/// The node-wide budget and the timeouts, shared by every connection's service.
#[derive(Clone)]
pub struct GrpcBodyBudgetLayer {
    budget: Arc<Semaphore>,
    stall: Duration,
    deadline: Duration,
    /// Each tenant's share (its bodies draw from it too), made when it first sends one.
    shares: Arc<parking_lot::Mutex<std::collections::HashMap<String, Arc<Semaphore>>>>,
    share: usize,
    who: Option<WhoAsks>,
}

impl GrpcBodyBudgetLayer {
    /// At most `bytes` of request bodies still arriving at once; a body that moves no byte for
    /// `stall` (or waits that long for budget) is ended, as is one not whole after `deadline`.
    pub fn new(bytes: u64, stall: Duration, deadline: Duration) -> Self {
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX).clamp(PIECE as usize, Semaphore::MAX_PERMITS);
        GrpcBodyBudgetLayer {
            budget: Arc::new(Semaphore::new(bytes)),
            stall,
            deadline,
            shares: Default::default(),
            share: bytes,
            who: None,
        }
    }

    /// Holds each tenant's bodies (`who` says whose a request is) to `share` bytes of the budget.
    pub fn with_tenant_shares(mut self, share: u64, who: WhoAsks) -> Self {
        self.share = usize::try_from(share).unwrap_or(usize::MAX).clamp(PIECE as usize, Semaphore::MAX_PERMITS);
        self.who = Some(who);
        self
    }

    fn share_of(&self, parts: &mut http::request::Parts) -> Option<Arc<Semaphore>> {
        let tenant = self.who.as_ref()?(&parts.headers, &mut parts.extensions)?;
        let mut shares = self.shares.lock();
        Some(shares.entry(tenant).or_insert_with(|| Arc::new(Semaphore::new(self.share))).clone())
    }
}

impl std::fmt::Debug for GrpcBodyBudgetLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcBodyBudgetLayer").field("stall", &self.stall).field("deadline", &self.deadline).finish()
    }
}

impl<S> tower_layer::Layer<S> for GrpcBodyBudgetLayer {
    type Service = GrpcBodyBudget<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcBodyBudget { inner, layer: self.clone() }
    }
}

/// [`GrpcBodyBudgetLayer`]'s service.
#[derive(Clone, Debug)]
pub struct GrpcBodyBudget<S> {
    inner: S,
    layer: GrpcBodyBudgetLayer,
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for GrpcBodyBudget<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let share = self.layer.share_of(&mut parts);
        let body = BudgetedBody::new(body, &self.layer, share);
        self.inner.call(http::Request::from_parts(parts, tonic::body::Body::new(body)))
    }
}

/// A piece of the tenant's share (if it has one), then of the node's budget.
type Pieces = (Option<OwnedSemaphorePermit>, OwnedSemaphorePermit);
type Acquire = Pin<Box<dyn Future<Output = Result<Pieces, tokio::sync::AcquireError>> + Send>>;

/// A request body drawing its bytes from the budget; they go back when it is dropped.
pub struct BudgetedBody<B> {
    inner: B,
    budget: Arc<Semaphore>,
    /// Budget held: what was read of the body, and the rest of the last piece taken ahead.
    held: Option<OwnedSemaphorePermit>,
    /// Its tenant's share, and what it holds of it (as much as of the budget).
    share: Option<Arc<Semaphore>>,
    held_share: Option<OwnedSemaphorePermit>,
    read: usize,
    acquiring: Option<Acquire>,
    stall: Duration,
    /// Restarted by every byte that arrives (and by the budget when it is granted).
    idle: Pin<Box<tokio::time::Sleep>>,
    deadline: Duration,
    whole_by: Pin<Box<tokio::time::Sleep>>,
    done: bool,
}

impl<B> BudgetedBody<B> {
    fn new(inner: B, layer: &GrpcBodyBudgetLayer, share: Option<Arc<Semaphore>>) -> Self {
        BudgetedBody {
            inner,
            budget: layer.budget.clone(),
            held: None,
            share,
            held_share: None,
            read: 0,
            acquiring: None,
            stall: layer.stall,
            idle: Box::pin(tokio::time::sleep(layer.stall)),
            deadline: layer.deadline,
            whole_by: Box::pin(tokio::time::sleep(layer.deadline)),
            done: false,
        }
    }

    fn held(&self) -> usize {
        self.held.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }

    fn keep(&mut self, (mine, permit): Pieces) {
        match &mut self.held {
            Some(h) => h.merge(permit),
            None => self.held = Some(permit),
        }
        match (&mut self.held_share, mine) {
            (Some(h), Some(p)) => h.merge(p),
            (slot @ None, p) => *slot = p,
            (Some(_), None) => {}
        }
    }

    /// Gives back all it holds.
    fn release(&mut self) {
        self.held = None;
        self.held_share = None;
    }

    /// Ends the body with `status`, giving its budget back.
    fn end(
        &mut self,
        kind: &'static str,
        status: tonic::Status,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        crate::metrics::error(kind);
        self.done = true;
        self.release();
        self.acquiring = None;
        Poll::Ready(Some(Err(status)))
    }
}

impl<B> http_body::Body for BudgetedBody<B>
where
    B: http_body::Body<Data = Bytes, Error = tonic::Status> + Unpin,
{
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if this.whole_by.as_mut().poll(cx).is_ready() {
            let after = format!("{:?}", this.deadline);
            return this.end(
                "grpc_body_deadline",
                tonic::Status::deadline_exceeded(format!("the request's body did not arrive whole within {after}")),
            );
        }
        // Budget before more is read: a body that can't have it is not read, so HTTP/2's flow
        // control holds its sender back. (A frame may take it past what it holds, by one frame;
        // a body can't be larger than the whole budget, which is at least the largest message.)
        while this.held() <= this.read {
            let acquire = this.acquiring.get_or_insert_with(|| {
                let (share, budget) = (this.share.clone(), this.budget.clone());
                Box::pin(async move {
                    let mine = match share {
                        Some(s) => Some(s.acquire_many_owned(PIECE).await?),
                        None => None,
                    };
                    Ok((mine, budget.acquire_many_owned(PIECE).await?))
                })
            });
            match acquire.as_mut().poll(cx) {
                Poll::Ready(Ok(permit)) => {
                    this.acquiring = None;
                    this.keep(permit);
                    this.idle.as_mut().reset(tokio::time::Instant::now() + this.stall);
                }
                Poll::Ready(Err(_)) => return this.end("grpc_body_budget", tonic::Status::unavailable("stopping")),
                Poll::Pending => {
                    if this.idle.as_mut().poll(cx).is_ready() {
                        let stall = this.stall;
                        let whose = match &this.share {
                            Some(s) if s.available_permits() < PIECE as usize => {
                                "this tenant's share of them (grpc_max_buffered_bytes_per_tenant)"
                            }
                            _ => "grpc_max_buffered_bytes",
                        };
                        return this.end(
                            "grpc_body_budget",
                            tonic::Status::resource_exhausted(format!(
                                "{}: the node holds as many bytes of requests still arriving as {whose} \
                                 allows, and none came free in {stall:?}; retry",
                                kvtier_proto::codes::CAPACITY
                            )),
                        );
                    }
                    return Poll::Pending;
                }
            }
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.read += data.len();
                    this.idle.as_mut().reset(tokio::time::Instant::now() + this.stall);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.done = true;
                this.release();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.release();
                Poll::Ready(Some(Err(e)))
            }
            Poll::Pending => {
                if this.idle.as_mut().poll(cx).is_ready() {
                    let stall = this.stall;
                    return this.end(
                        "grpc_body_stall",
                        tonic::Status::deadline_exceeded(format!(
                            "the request's body stopped arriving: no byte for {stall:?} (stall_timeout)"
                        )),
                    );
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use tokio::sync::mpsc;

    /// A request body fed piece by piece by the test.
    struct Fed(mpsc::Receiver<Bytes>);

    impl http_body::Body for Fed {
        type Data = Bytes;
        type Error = tonic::Status;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
            self.0.poll_recv(cx).map(|b| b.map(|b| Ok(http_body::Frame::data(b))))
        }
    }

    fn body(layer: &GrpcBodyBudgetLayer) -> (mpsc::Sender<Bytes>, BudgetedBody<Fed>) {
        let (tx, rx) = mpsc::channel(64);
        (tx, BudgetedBody::new(Fed(rx), layer, None))
    }

    async fn next(b: &mut BudgetedBody<Fed>) -> Option<Result<http_body::Frame<Bytes>, tonic::Status>> {
        std::future::poll_fn(|cx| Pin::new(&mut *b).poll_frame(cx)).await
    }

    /// Bodies still arriving hold their bytes against the budget: a second body is not read
    /// while the first holds it all, goes on once the first is dropped (read whole by tonic),
    /// and is refused `RESOURCE_EXHAUSTED` when nothing comes free within the stall timeout.
    #[tokio::test]
    async fn bodies_still_arriving_share_the_budget_and_wait_for_it() {
        let layer = GrpcBodyBudgetLayer::new(PIECE as u64, Duration::from_millis(800), BODY_DEADLINE);
        let (tx_a, mut a) = body(&layer);
        tx_a.send(Bytes::from(vec![1; PIECE as usize])).await.unwrap();
        let got = next(&mut a).await.unwrap().unwrap();
        assert_eq!(got.data_ref().map(Bytes::len), Some(PIECE as usize));
        // `a` read one piece, which it holds until tonic has read it whole: the whole budget.
        let (tx_b, mut b) = body(&layer);
        tx_b.send(Bytes::from_static(b"small")).await.unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(300), next(&mut b)).await.is_err(), "read past the budget");
        drop(a);
        let got = next(&mut b).await.unwrap().unwrap();
        assert_eq!(got.into_data().unwrap(), Bytes::from_static(b"small"));
        drop(tx_b);
        assert!(next(&mut b).await.is_none(), "ends when the sender does");
        assert!(b.is_end_stream());

        // Held for good by one body: the next is refused after the stall timeout.
        let (tx_c, mut c) = body(&layer);
        tx_c.send(Bytes::from(vec![2; PIECE as usize])).await.unwrap();
        next(&mut c).await.unwrap().unwrap();
        let (_tx_d, mut d) = body(&layer);
        let refused = next(&mut d).await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused}");
        assert!(refused.message().contains("grpc_max_buffered_bytes"), "{refused}");
        assert!(next(&mut d).await.is_none(), "ended");
        drop(tx_c);
    }

    /// A tenant's bodies draw from its share too: one tenant holding its share leaves the rest
    /// of the budget to another, whose body is read at once; the first tenant's next body waits,
    /// and is refused naming its share.
    #[tokio::test]
    async fn a_tenant_holding_its_share_leaves_the_rest_to_others() {
        let layer = GrpcBodyBudgetLayer::new(2 * PIECE as u64, Duration::from_millis(500), BODY_DEADLINE)
            .with_tenant_shares(PIECE as u64, Arc::new(|_: &http::HeaderMap, _: &mut http::Extensions| None));
        let share = |name: &str| {
            let mut shares = layer.shares.lock();
            shares.entry(name.to_string()).or_insert_with(|| Arc::new(Semaphore::new(layer.share))).clone()
        };
        let body_of = |name: &str| {
            let (tx, rx) = mpsc::channel(64);
            (tx, BudgetedBody::new(Fed(rx), &layer, Some(share(name))))
        };
        let (tx_a, mut a) = body_of("a");
        tx_a.send(Bytes::from(vec![1; PIECE as usize])).await.unwrap();
        next(&mut a).await.unwrap().unwrap();
        // "a" holds its whole share (half the budget): "b" is read at once.
        let (tx_b, mut b) = body_of("b");
        tx_b.send(Bytes::from_static(b"b's")).await.unwrap();
        let got = tokio::time::timeout(Duration::from_millis(300), next(&mut b)).await.expect("b waited");
        assert_eq!(got.unwrap().unwrap().into_data().unwrap(), Bytes::from_static(b"b's"));
        // A second body of "a" waits for a's share, and is refused naming it.
        let (_tx_a2, mut a2) = body_of("a");
        let refused = next(&mut a2).await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused}");
        assert!(refused.message().contains("this tenant's share"), "{refused}");
        drop((a, tx_a));
        assert_eq!(share("a").available_permits(), PIECE as usize, "a's share came back");
    }

    /// A body that stops arriving is ended after the stall timeout, and one that trickles in
    /// without stalling after the deadline; each gives its budget back.
    #[tokio::test]
    async fn a_stalled_or_endless_body_is_ended_and_its_budget_given_back() {
        let layer = GrpcBodyBudgetLayer::new(4 * PIECE as u64, Duration::from_millis(300), Duration::from_secs(2));
        let (tx, mut stalled) = body(&layer);
        tx.send(Bytes::from(vec![0; 1000])).await.unwrap();
        next(&mut stalled).await.unwrap().unwrap();
        let err = next(&mut stalled).await.unwrap().unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
        assert!(err.message().contains("stall_timeout"), "{err}");
        assert_eq!(layer.budget.available_permits(), 4 * PIECE as usize, "its budget went back when it ended");

        let (tx, mut trickle) = body(&layer);
        let feeder = tokio::spawn(async move {
            while tx.send(Bytes::from_static(b"x")).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut pieces = 0;
        let err = loop {
            match next(&mut trickle).await.unwrap() {
                Ok(_) => pieces += 1,
                Err(e) => break e,
            }
        };
        assert!(pieces >= 10, "it trickled in for a while ({pieces} pieces)");
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
        assert!(err.message().contains("whole within"), "{err}");
        assert_eq!(layer.budget.available_permits(), 4 * PIECE as usize);
        feeder.abort();
    }
}
