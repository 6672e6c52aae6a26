//! `kvtier plan`: the capacity planner. It lives with the benchmarks (`kvtier-bench plan`); this
//! command takes only the planner's own flags, so its help describes what it accepts, and hands
//! them on.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;

/// The planner's inputs. Unset flags take the planner's defaults (shown in brackets).
#[derive(Args)]
pub struct PlanArgs {
    /// Folder for results.json and the plot [bench-out].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Model: llama-3-8b or llama-3-70b [llama-3-70b].
    #[arg(long)]
    model: Option<String>,
    /// KV codec: bf16, fp8, nvfp4 [bf16].
    #[arg(long)]
    codec: Option<String>,
    /// GPU the prefill it saves is timed on: A100, L40S, H100, H200, B200 [H100].
    #[arg(long)]
    gpu: Option<String>,
    /// Fraction of the GPU's dense BF16 peak that prefill reaches [0.5].
    #[arg(long)]
    mfu: Option<f64>,
    /// HBM for KV, GB [40].
    #[arg(long)]
    hbm_gb: Option<f64>,
    /// DRAM for the KV tier, GB [1000].
    #[arg(long)]
    dram_gb: Option<f64>,
    /// NVMe for the KV tier, GB [8000].
    #[arg(long)]
    nvme_gb: Option<f64>,
    /// Average context, tokens [32768].
    #[arg(long)]
    avg_context: Option<f64>,
    /// Requests per second [10].
    #[arg(long)]
    rps: Option<f64>,
    /// Fraction of requests that are agent sessions [0.5].
    #[arg(long)]
    session_fraction: Option<f64>,
    /// An agent's think time between turns, seconds [60].
    #[arg(long)]
    think_s: Option<f64>,
    /// Model override: layers.
    #[arg(long)]
    layers: Option<u32>,
    /// Model override: KV heads.
    #[arg(long)]
    kv_heads: Option<u32>,
    /// Model override: attention heads.
    #[arg(long)]
    heads: Option<u32>,
    /// Model override: head dimension.
    #[arg(long)]
    head_dim: Option<u32>,
    /// Model override: parameters, billions.
    #[arg(long)]
    params_b: Option<f64>,
}

impl PlanArgs {
    /// The flags given, as `kvtier-bench plan` takes them.
    fn forwarded(&self) -> Vec<String> {
        let mut v = Vec::new();
        let mut flag = |name: &str, value: Option<String>| {
            if let Some(value) = value {
                v.push(format!("--{name}"));
                v.push(value);
            }
        };
        flag("out", self.out.as_ref().map(|p| p.display().to_string()));
        flag("model", self.model.clone());
        flag("codec", self.codec.clone());
        flag("gpu", self.gpu.clone());
        flag("mfu", self.mfu.map(|x| x.to_string()));
        flag("hbm-gb", self.hbm_gb.map(|x| x.to_string()));
        flag("dram-gb", self.dram_gb.map(|x| x.to_string()));
        flag("nvme-gb", self.nvme_gb.map(|x| x.to_string()));
        flag("avg-context", self.avg_context.map(|x| x.to_string()));
        flag("rps", self.rps.map(|x| x.to_string()));
        flag("session-fraction", self.session_fraction.map(|x| x.to_string()));
        flag("think-s", self.think_s.map(|x| x.to_string()));
        flag("layers", self.layers.map(|x| x.to_string()));
        flag("kv-heads", self.kv_heads.map(|x| x.to_string()));
        flag("heads", self.heads.map(|x| x.to_string()));
        flag("head-dim", self.head_dim.map(|x| x.to_string()));
        flag("params-b", self.params_b.map(|x| x.to_string()));
        v
    }
}

/// Runs `kvtier-bench plan` from beside this binary with the flags given; returns its exit code.
pub fn run(a: &PlanArgs) -> anyhow::Result<i32> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let bench = exe.with_file_name("kvtier-bench");
    if !bench.exists() {
        bail!("{} is missing: build it with `cargo build --release -p kvtier-bench`", bench.display());
    }
    let status = std::process::Command::new(&bench)
        .arg("plan")
        .args(a.forwarded())
        .status()
        .with_context(|| format!("running {}", bench.display()))?;
    Ok(status.code().unwrap_or(1))
}
