//! Benchmarks of kvtier beside baselines measured in the same run. For now one workload:
//! `kvtier-bench dataplane` (store/load throughput of 1 MiB blocks on loopback against memcpy and
//! raw loopback TCP). The full harness of the benchmark issue (Redis, traces, capacity planner,
//! plots) lands here later.

use std::time::Instant;

/// Median of a list of figures.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// GB/s (10^9 bytes per second) of `bytes` moved in the time `f` takes.
pub fn gbps(bytes: u64, f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_lists() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }
}
