//! Prints the GPU agent's figures on GPU `KVTIER_GPU` (default 0): pinned H2D/D2H through the
//! `Device` seam beside bare `cuMemcpy`, each codec kernel beside device memcpy, and byte equality
//! with `kvtier_kernels`. Run by `scripts/gpu-check`; needs `--features cuda` and a GPU.

fn main() {
    let ordinal = std::env::var("KVTIER_GPU").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let bytes = std::env::var("KVTIER_COPY_MIB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(256) << 20;
    match kvtier_agent::gpu_report(ordinal, bytes) {
        Ok(lines) => lines.iter().for_each(|l| println!("{l}")),
        Err(e) => {
            eprintln!("gpu_report: {e}");
            std::process::exit(1);
        }
    }
}
