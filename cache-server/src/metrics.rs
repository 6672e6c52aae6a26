//! Prometheus metrics: installs the recorder and serves `/metrics` on its own listener (so a port
//! of 0 works and the bound address can be printed), plus the helpers every handler uses.

use std::net::SocketAddr;
use std::time::Instant;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::error::ServerError;

/// Latency buckets in seconds, from 50 µs to 10 s.
const LATENCY_BUCKETS: &[f64] =
    &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Installs the global recorder, with every metric's help text ([`crate::metric_catalog`]).
/// Call once per process.
pub fn install() -> Result<PrometheusHandle, ServerError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(|e| ServerError::Config(format!("metrics buckets: {e}")))?
        .install_recorder()
        .map_err(|e| ServerError::Config(format!("metrics recorder: {e}")))?;
    crate::metric_catalog::describe_all();
    Ok(handle)
}

/// Serves `GET /metrics` with the current snapshot; with `token`, only to a request that carries
/// `Authorization: Bearer <token>`.
pub async fn serve(listener: TcpListener, handle: PrometheusHandle, token: Option<String>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            // Out of descriptors or similar: back off instead of spinning.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let (handle, token) = (handle.clone(), token.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            // One small request per connection; we don't care what it says beyond the first line.
            let n = match tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let first = String::from_utf8_lossy(&buf[..n]);
            let authorized = token.as_deref().is_none_or(|t| presents_token(&first, t));
            let (status, body) = if !authorized {
                error("unauthenticated");
                ("401 Unauthorized", "missing or bad bearer token\n".to_string())
            } else if first.starts_with("GET /metrics") || first.starts_with("GET / ") {
                ("200 OK", sorted_by_family(&handle.render()))
            } else {
                ("404 Not Found", "try GET /metrics\n".to_string())
            };
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// Whether an HTTP request's head carries `Authorization: Bearer <token>`.
fn presents_token(head: &str, token: &str) -> bool {
    head.lines().any(|l| {
        let Some((name, value)) = l.split_once(':') else { return false };
        name.trim().eq_ignore_ascii_case("authorization")
            && value
                .trim()
                .strip_prefix("Bearer ")
                .is_some_and(|t| constant_time_eq(t.trim().as_bytes(), token.as_bytes()))
    })
}

/// Compares secrets in time that depends on their lengths only, never on where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Binds the metrics listener; returns it with its address.
pub async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), ServerError> {
    let l = TcpListener::bind(addr).await.map_err(|e| ServerError::Config(format!("metrics listener {addr}: {e}")))?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// Records a request's latency under `op`.
pub fn observe(op: &'static str, start: Instant) {
    metrics::histogram!("kvtier_request_seconds", "op" => op).record(start.elapsed().as_secs_f64());
    metrics::counter!("kvtier_requests_total", "op" => op).increment(1);
}

/// Counts an error by kind.
pub fn error(kind: &'static str) {
    metrics::counter!("kvtier_errors_total", "kind" => kind).increment(1);
}

/// Counts a server error by its kind.
pub fn server_error(e: &ServerError) {
    error(e.kind());
}

/// Lets a log line a client can set off on every request through at most once per `every`,
/// saying how many were held back since the last one (the metrics count them all), so one
/// client can't fill the node's log (or the disk under it) at request speed.
pub struct LogThrottle {
    every_ms: u64,
    /// Milliseconds since [`LogThrottle::epoch`] of the last line let through, plus one (0: none yet).
    last: std::sync::atomic::AtomicU64,
    held_back: std::sync::atomic::AtomicU64,
}

impl LogThrottle {
    pub const fn new(every: std::time::Duration) -> Self {
        LogThrottle {
            every_ms: every.as_millis() as u64,
            last: std::sync::atomic::AtomicU64::new(0),
            held_back: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn epoch() -> Instant {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *EPOCH.get_or_init(Instant::now)
    }

    /// `Some(held back since the last line)` when a line may be written now; `None` (and one
    /// more held back) otherwise.
    pub fn allow(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let now = Self::epoch().elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Relaxed);
        if last != 0 && now.saturating_sub(last) < self.every_ms {
            self.held_back.fetch_add(1, Relaxed);
            return None;
        }
        // One caller wins the slot; the others count as held back.
        if self.last.compare_exchange(last, now, Relaxed, Relaxed).is_err() {
            self.held_back.fetch_add(1, Relaxed);
            return None;
        }
        Some(self.held_back.swap(0, Relaxed))
    }
}

/// The exposition `text` with its families in name order, and within a counter's or gauge's
/// family its series in label order, so two scrapes line up (the exporter writes both in hash
/// order). A histogram's lines keep their order (its buckets ascend by `le`).
pub fn sorted_by_family(text: &str) -> String {
    let name_of = |family: &str| -> String {
        let first = family.lines().next().unwrap_or_default();
        let rest = first.strip_prefix("# HELP ").or_else(|| first.strip_prefix("# TYPE ")).unwrap_or(first);
        rest.split([' ', '{']).next().unwrap_or_default().to_string()
    };
    let mut families: Vec<(String, String)> = text
        .split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|f| {
            let f = f.trim_matches('\n');
            let (comments, mut series): (Vec<&str>, Vec<&str>) = f.lines().partition(|l| l.starts_with('#'));
            let in_order = comments
                .iter()
                .any(|l| l.starts_with("# TYPE ") && (l.ends_with(" histogram") || l.ends_with(" summary")));
            if !in_order {
                series.sort_unstable();
            }
            let lines: Vec<&str> = comments.into_iter().chain(series).collect();
            (name_of(f), lines.join("\n"))
        })
        .collect();
    families.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = String::with_capacity(text.len() + 1);
    for (_, f) in families {
        out.push_str(&f);
        out.push_str("\n\n");
    }
    out
}

#[cfg(test)]
mod exposition_tests {
    use super::*;

    /// Families come out in name order, a counter's series in label order, a histogram's lines
    /// as they were; nothing is lost or changed.
    #[test]
    fn families_and_series_come_out_in_order() {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &[0.001, 0.01, 0.1])
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        // Catalogued names (the catalog's test scans this file too).
        metrics::with_local_recorder(&recorder, || {
            metrics::counter!("kvtier_sessions_recovered_total").increment(1);
            metrics::counter!("kvtier_disk_compactions_total").increment(1);
            metrics::counter!("kvtier_sessions_expired_total").increment(1);
            metrics::counter!("kvtier_disk_demotions_total").increment(1);
            metrics::gauge!("kvtier_sessions").set(2.0);
            metrics::gauge!("kvtier_disk_queue_depth").set(2.0);
            metrics::gauge!("kvtier_namespaces").set(2.0);
            for op in ["store", "load", "park", "resume", "lookup", "drop"] {
                metrics::counter!("kvtier_requests_total", "op" => op).increment(3);
            }
            metrics::histogram!("kvtier_request_seconds", "op" => "load").record(0.005);
        });
        let raw = handle.render();
        let sorted = sorted_by_family(&raw);
        let names: Vec<&str> =
            sorted.lines().filter_map(|l| l.strip_prefix("# TYPE ")).map(|l| l.split(' ').next().unwrap()).collect();
        let mut expected = names.clone();
        expected.sort_unstable();
        assert_eq!(names, expected);
        assert_eq!(names.len(), 9, "{sorted}");
        let ops: Vec<&str> = sorted.lines().filter(|l| l.starts_with("kvtier_requests_total{")).collect();
        let mut in_order = ops.clone();
        in_order.sort_unstable();
        assert_eq!(ops, in_order);
        assert_eq!(ops.len(), 6);
        assert!(sorted.contains("# TYPE kvtier_requests_total counter\nkvtier_requests_total{"), "{sorted}");
        let buckets: Vec<&str> = sorted.lines().filter(|l| l.starts_with("kvtier_request_seconds")).collect();
        let raw_buckets: Vec<&str> = raw.lines().filter(|l| l.starts_with("kvtier_request_seconds")).collect();
        assert!(buckets.len() > 3, "{sorted}");
        assert_eq!(buckets, raw_buckets, "a histogram's lines as the exporter wrote them");
        let (mut a, mut b): (Vec<&str>, Vec<&str>) = (raw.lines().collect(), sorted.lines().collect());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "the same lines");
    }
}

#[cfg(test)]
mod throttle_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_line_per_period_and_the_count_of_those_held_back() {
        let t = LogThrottle::new(Duration::from_millis(200));
        assert_eq!(t.allow(), Some(0), "the first goes through");
        for _ in 0..1000 {
            assert_eq!(t.allow(), None);
        }
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(t.allow(), Some(1000), "the next says how many were held back");
        assert_eq!(t.allow(), None);
    }
}
