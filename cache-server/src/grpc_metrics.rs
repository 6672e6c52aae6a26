//! Every gRPC call counted and timed by method, its failures by status code, whatever answered
//! it: a handler, the credential check before it, or tonic itself. The handlers counted only the
//! calls they answered with success, and eight methods (Stats, Purge, UnregisterNamespace,
//! ListSessions, WatchEvents, Members, Info, SameNodeTicket) not at all, so an error rate per
//! method could not be had.
//!
//! A tower layer around the node's gRPC service: `kvtier_requests_total{op}` and
//! `kvtier_request_seconds{op}` (to the answer's headers: a stream's first), and
//! `kvtier_request_errors_total{op,code}` for an answer whose headers carry a status other than
//! OK (a failed unary call is answered with its status in the headers). A call its client gave up
//! on before it was answered (a reset stream, a closed connection) counts as a request with the
//! code `cancelled`, timed to when it was given up.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::codegen::http;

/// The layer to put around the gRPC service.
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcMetricsLayer;

impl<S> tower_layer::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetrics { inner }
    }
}

/// [`GrpcMetricsLayer`]'s service.
#[derive(Clone, Debug)]
pub struct GrpcMetrics<S> {
    inner: S,
}

impl<S, B, RB> tower_service::Service<http::Request<B>> for GrpcMetrics<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let op = op_of(req.uri().path());
        let start = Instant::now();
        let answer = self.inner.call(req);
        let unanswered = Unanswered { op, start, answered: false };
        Box::pin(async move {
            // Moved in whole: dropped with the future.
            let mut unanswered = unanswered;
            let r = answer.await;
            unanswered.answered = true;
            crate::metrics::observe(op, start);
            let code = match &r {
                Ok(resp) => resp
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map_or(tonic::Code::Ok, tonic::Code::from),
                Err(_) => tonic::Code::Unknown,
            };
            if code != tonic::Code::Ok {
                ::metrics::counter!("kvtier_request_errors_total", "op" => op, "code" => code_label(code)).increment(1);
            }
            r
        })
    }
}

/// A call in flight: counted as `cancelled` if dropped unanswered (its client gave up on it).
struct Unanswered {
    op: &'static str,
    start: Instant,
    answered: bool,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if !self.answered {
            crate::metrics::observe(self.op, self.start);
            ::metrics::counter!("kvtier_request_errors_total", "op" => self.op, "code" => code_label(tonic::Code::Cancelled))
                .increment(1);
        }
    }
}

/// The `op` label of a call to `path` (`/kvtier.v1.KvTier/ParkSession`): the names the handlers
/// used before (`park`, `resume`, ...), snake case for the rest.
fn op_of(path: &str) -> &'static str {
    match path.rsplit('/').next().unwrap_or_default() {
        "Info" => "info",
        "RegisterNamespace" => "register_namespace",
        "Lookup" => "lookup",
        "ParkSession" => "park",
        "ExtendSession" => "extend",
        "ResumeSession" => "resume",
        "DropSession" => "drop",
        "ListSessions" => "list_sessions",
        "Stats" => "stats",
        "Purge" => "purge",
        "UnregisterNamespace" => "unregister_namespace",
        "WatchEvents" => "watch_events",
        "RouteHint" => "route_hint",
        "SessionReplica" => "session_replica",
        "Members" => "members",
        "ReportAgentBlocks" => "report_agent_blocks",
        "AgentDemands" => "agent_demands",
        "SameNodeTicket" => "samenode_ticket",
        _ => "other",
    }
}

/// A status code as a label.
fn code_label(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "ok",
        Cancelled => "cancelled",
        Unknown => "unknown",
        InvalidArgument => "invalid_argument",
        DeadlineExceeded => "deadline_exceeded",
        NotFound => "not_found",
        AlreadyExists => "already_exists",
        PermissionDenied => "permission_denied",
        ResourceExhausted => "resource_exhausted",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        OutOfRange => "out_of_range",
        Unimplemented => "unimplemented",
        Internal => "internal",
        Unavailable => "unavailable",
        DataLoss => "data_loss",
        Unauthenticated => "unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_of_the_service_has_its_own_label() {
        let proto = include_str!("../../proto/proto/kvtier.proto");
        let methods: Vec<&str> = proto
            .lines()
            .filter_map(|l| l.trim().strip_prefix("rpc "))
            .map(|l| l.split('(').next().unwrap_or_default().trim())
            .collect();
        assert!(methods.len() >= 18, "{methods:?}");
        for m in methods {
            assert_ne!(op_of(&format!("/kvtier.v1.KvTier/{m}")), "other", "{m} has no label");
        }
        assert_eq!(op_of("/kvtier.v1.KvTier/ParkSession"), "park");
        assert_eq!(op_of("/x/Nope"), "other");
    }
}
