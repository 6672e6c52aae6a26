//! Benchmarks of kvtier beside its baselines. The measured figures of the single-node service are
//! produced by `kvtier-server`'s `dataplane` benchmark for now; the full harness (Redis, traces,
//! capacity planner, plots) is a later step.
