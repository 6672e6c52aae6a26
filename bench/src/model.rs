//! The arithmetic users otherwise do by hand: KV bytes per token, prefill FLOPs, prefill time on a
//! named GPU, reload time over a named link, the reload-vs-recompute crossover, and a capacity plan.
//!
//! Prefill FLOPs of `T` tokens (causal, Kaplan et al.): `2·N·T + n_layer·d_attn·T²`. With a cached
//! prefix of `h` tokens the suffix costs `2·N·(T−h) + n_layer·d_attn·(T²−h²)`, so a hit of `h`
//! tokens saves exactly `flops(h)` whatever follows it.

use serde::Serialize;

/// A transformer's shape, enough for KV size and prefill FLOPs.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Model {
    pub name: &'static str,
    /// Parameters (N), excluding embeddings' effect being negligible.
    pub params: f64,
    pub layers: u32,
    /// Query heads (d_attn = heads · head_dim).
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
}

impl Model {
    pub const LLAMA3_8B: Model =
        Model { name: "Llama-3-8B", params: 8.03e9, layers: 32, heads: 32, kv_heads: 8, head_dim: 128 };
    pub const LLAMA3_70B: Model =
        Model { name: "Llama-3-70B", params: 70.6e9, layers: 80, heads: 64, kv_heads: 8, head_dim: 128 };

    pub fn by_name(s: &str) -> Option<Model> {
        match s.to_ascii_lowercase().as_str() {
            "llama-3-8b" | "8b" | "llama3-8b" => Some(Self::LLAMA3_8B),
            "llama-3-70b" | "70b" | "llama3-70b" => Some(Self::LLAMA3_70B),
            _ => None,
        }
    }

    pub fn d_attn(&self) -> f64 {
        f64::from(self.heads) * f64::from(self.head_dim)
    }

    /// K and V elements per token over all layers.
    pub fn kv_elems_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers) * f64::from(self.kv_heads) * f64::from(self.head_dim)
    }

    /// KV bytes per token in a codec.
    pub fn kv_bytes_per_token(&self, codec: Codec) -> f64 {
        self.kv_elems_per_token() * codec.bytes_per_elem(self.head_dim)
    }

    /// Prefill FLOPs of `t` tokens from nothing: `2·N·t + n_layer·d_attn·t²`.
    pub fn prefill_flops(&self, t: f64) -> f64 {
        2.0 * self.params * t + f64::from(self.layers) * self.d_attn() * t * t
    }

    /// FLOPs a cached prefix of `hit` tokens saves on a request of `total` tokens (= flops(hit)).
    pub fn saved_flops(&self, hit: f64, total: f64) -> f64 {
        let hit = hit.min(total);
        self.prefill_flops(total)
            - (2.0 * self.params * (total - hit) + f64::from(self.layers) * self.d_attn() * (total * total - hit * hit))
    }
}

/// How KV is stored in a tier.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum Codec {
    Bf16,
    /// FP8 E4M3, one f32 scale per (token, KV head) vector.
    Fp8,
    /// NVFP4: E2M1 nibbles, one E4M3 scale byte per 16 elements.
    Nvfp4,
}

impl Codec {
    pub fn parse(s: &str) -> Option<Codec> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "fp16" | "none" => Some(Codec::Bf16),
            "fp8" | "e4m3" => Some(Codec::Fp8),
            "nvfp4" | "fp4" => Some(Codec::Nvfp4),
            _ => None,
        }
    }

    pub fn bytes_per_elem(self, head_dim: u32) -> f64 {
        match self {
            Codec::Bf16 => 2.0,
            Codec::Fp8 => 1.0 + 4.0 / f64::from(head_dim),
            Codec::Nvfp4 => 0.5 + 1.0 / 16.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::Bf16 => "bf16",
            Codec::Fp8 => "fp8-e4m3",
            Codec::Nvfp4 => "nvfp4",
        }
    }
}

/// A GPU's dense BF16 peak and the fraction of it prefill reaches.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Gpu {
    pub name: &'static str,
    pub bf16_tflops: f64,
    pub mfu: f64,
}

impl Gpu {
    pub const ALL: [Gpu; 5] = [
        Gpu { name: "A100-SXM", bf16_tflops: 312.0, mfu: 0.5 },
        Gpu { name: "L40S", bf16_tflops: 362.0, mfu: 0.5 },
        Gpu { name: "H100-SXM", bf16_tflops: 989.0, mfu: 0.5 },
        Gpu { name: "H200", bf16_tflops: 989.0, mfu: 0.5 },
        Gpu { name: "B200", bf16_tflops: 2250.0, mfu: 0.5 },
    ];

    pub fn by_name(s: &str) -> Option<Gpu> {
        let l = s.to_ascii_lowercase();
        Self::ALL
            .iter()
            .copied()
            .find(|g| g.name.to_ascii_lowercase().starts_with(&l) || l.starts_with(&g.name.to_ascii_lowercase()))
    }

    /// Sustained FLOP/s of prefill.
    pub fn flops_per_s(&self) -> f64 {
        self.bf16_tflops * 1e12 * self.mfu
    }

    pub fn prefill_seconds(&self, m: &Model, tokens: f64) -> f64 {
        m.prefill_flops(tokens) / self.flops_per_s()
    }
}

/// A link KV comes back over, at an assumed effective (not nominal) one-way bandwidth.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Link {
    pub name: &'static str,
    pub gb_per_s: f64,
}

impl Link {
    pub const ALL: [Link; 7] = [
        Link { name: "NVLink-C2C (GH200, 450 GB/s nominal)", gb_per_s: 400.0 },
        Link { name: "PCIe Gen5 x16 (64 GB/s nominal)", gb_per_s: 50.0 },
        Link { name: "PCIe Gen4 x16 (32 GB/s nominal)", gb_per_s: 25.0 },
        Link { name: "400GbE (50 GB/s nominal)", gb_per_s: 45.0 },
        Link { name: "100GbE (12.5 GB/s nominal)", gb_per_s: 11.0 },
        Link { name: "NVMe Gen5 x4, one drive", gb_per_s: 12.0 },
        Link { name: "NVMe Gen4 x4, one drive", gb_per_s: 6.5 },
    ];

    pub fn reload_seconds(&self, bytes: f64) -> f64 {
        bytes / (self.gb_per_s * 1e9)
    }
}

/// The context length from which reloading `T` tokens of KV over `link` is faster than
/// recomputing them on `gpu`: reload wins when `T·b/BW < (2N·T + L·d·T²)/F`, i.e. when
/// `T > (F·b/BW − 2N)/(L·d)`. 0 means reload wins at every length.
pub fn crossover_tokens(m: &Model, codec: Codec, gpu: &Gpu, link: &Link) -> f64 {
    let b = m.kv_bytes_per_token(codec);
    let t = (gpu.flops_per_s() * b / (link.gb_per_s * 1e9) - 2.0 * m.params) / (f64::from(m.layers) * m.d_attn());
    t.max(0.0)
}

/// What the planner needs: tier capacities and a traffic mix.
#[derive(Debug, Clone, Serialize)]
pub struct PlanInput {
    pub model: Model,
    pub codec: Codec,
    pub gpu: Gpu,
    /// HBM left for KV per GPU, GB (10^9 bytes).
    pub hbm_kv_gb: f64,
    pub dram_gb: f64,
    pub nvme_gb: f64,
    /// Mean context of a request or session, tokens.
    pub avg_context_tokens: f64,
    /// Requests per second the node serves.
    pub requests_per_s: f64,
    /// Fraction of requests that are agent turns (resume a parked session, then park it again).
    pub session_fraction: f64,
    /// Mean time a session stays parked between turns, seconds.
    pub think_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TierPlan {
    pub tier: &'static str,
    pub capacity_gb: f64,
    pub tokens: f64,
    pub sessions: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LinkPlan {
    pub link: &'static str,
    pub gb_per_s: f64,
    pub crossover_tokens: f64,
    /// Reload time of one average context, seconds.
    pub reload_s: f64,
    /// Prefill time of one average context on the GPU, seconds.
    pub recompute_s: f64,
    /// Reload bandwidth the traffic mix needs as a fraction of the link.
    pub utilisation: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub input: PlanInput,
    pub kv_bytes_per_token: f64,
    pub bytes_per_avg_context: f64,
    pub tiers: Vec<TierPlan>,
    /// Sessions parked at once (Little's law: arrival rate of agent turns × think time).
    pub parked_sessions: f64,
    pub parked_gb: f64,
    /// GB/s of KV reloaded to serve every agent turn from the tiers.
    pub reload_gb_per_s: f64,
    pub links: Vec<LinkPlan>,
}

pub fn plan(input: PlanInput) -> Plan {
    let b = input.model.kv_bytes_per_token(input.codec);
    let ctx_bytes = b * input.avg_context_tokens;
    let tiers = [("HBM (G1, per GPU)", input.hbm_kv_gb), ("DRAM (G2)", input.dram_gb), ("NVMe (G3)", input.nvme_gb)]
        .into_iter()
        .map(|(tier, gb)| {
            let tokens = gb * 1e9 / b;
            TierPlan { tier, capacity_gb: gb, tokens, sessions: tokens / input.avg_context_tokens }
        })
        .collect();
    let session_rate = input.requests_per_s * input.session_fraction;
    let parked_sessions = session_rate * input.think_s;
    let reload_gb_per_s = session_rate * ctx_bytes / 1e9;
    let links = Link::ALL
        .iter()
        .map(|l| LinkPlan {
            link: l.name,
            gb_per_s: l.gb_per_s,
            crossover_tokens: crossover_tokens(&input.model, input.codec, &input.gpu, l),
            reload_s: l.reload_seconds(ctx_bytes),
            recompute_s: input.gpu.prefill_seconds(&input.model, input.avg_context_tokens),
            utilisation: reload_gb_per_s / l.gb_per_s,
        })
        .collect();
    Plan {
        kv_bytes_per_token: b,
        bytes_per_avg_context: ctx_bytes,
        tiers,
        parked_sessions,
        parked_gb: parked_sessions * ctx_bytes / 1e9,
        reload_gb_per_s,
        links,
        input,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_bytes_per_token_of_known_models() {
        // 2 (K,V) · 32 layers · 8 heads · 128 · 2 bytes = 128 KiB; the 70B: 320 KiB.
        assert_eq!(Model::LLAMA3_8B.kv_bytes_per_token(Codec::Bf16), 131072.0);
        assert_eq!(Model::LLAMA3_70B.kv_bytes_per_token(Codec::Bf16), 327680.0);
        // FP8: 1 byte + a 4-byte scale per 128-element vector.
        assert_eq!(Model::LLAMA3_8B.kv_bytes_per_token(Codec::Fp8), 65536.0 * 1.03125);
        assert_eq!(Model::LLAMA3_8B.kv_bytes_per_token(Codec::Nvfp4), 65536.0 * 0.5625);
        // A 128K context of the 70B-class model is 40 GiB (the design's figure).
        assert_eq!(Model::LLAMA3_70B.kv_bytes_per_token(Codec::Bf16) * 131072.0, 40.0 * (1u64 << 30) as f64);
    }

    #[test]
    fn prefill_flops_formula() {
        let m = Model { name: "toy", params: 1000.0, layers: 2, heads: 4, kv_heads: 2, head_dim: 8 };
        // 2·1000·10 + 2·32·100
        assert_eq!(m.prefill_flops(10.0), 20000.0 + 6400.0);
        assert_eq!(m.prefill_flops(0.0), 0.0);
        // A hit saves exactly the FLOPs of the hit prefix, whatever the total.
        for (h, t) in [(0.0, 10.0), (4.0, 10.0), (10.0, 10.0), (7.0, 1000.0)] {
            assert!((m.saved_flops(h, t) - m.prefill_flops(h)).abs() < 1e-6, "h={h} t={t}");
        }
        // Llama-3-8B at 8K tokens: 2·8.03e9·8192 + 32·4096·8192² ≈ 1.40e14 FLOPs.
        let f = Model::LLAMA3_8B.prefill_flops(8192.0);
        assert!((f - (2.0 * 8.03e9 * 8192.0 + 32.0 * 4096.0 * 8192.0 * 8192.0)).abs() < 1.0);
        assert!((1.39e14..1.41e14).contains(&f));
    }

    #[test]
    fn crossover_is_where_reload_and_recompute_cost_the_same() {
        let gpu = Gpu::by_name("h100").unwrap();
        // A slow link makes recompute win for short contexts.
        let slow = Link { name: "1GbE", gb_per_s: 0.11 };
        let m = Model::LLAMA3_8B;
        let t = crossover_tokens(&m, Codec::Bf16, &gpu, &slow);
        assert!(t > 0.0);
        let reload = slow.reload_seconds(t * m.kv_bytes_per_token(Codec::Bf16));
        let recompute = gpu.prefill_seconds(&m, t);
        assert!((reload - recompute).abs() / recompute < 1e-9, "{reload} vs {recompute}");
        // Beyond it reload wins, below it recompute does.
        assert!(slow.reload_seconds(2.0 * t * m.kv_bytes_per_token(Codec::Bf16)) < gpu.prefill_seconds(&m, 2.0 * t));
        assert!(slow.reload_seconds(0.5 * t * m.kv_bytes_per_token(Codec::Bf16)) > gpu.prefill_seconds(&m, 0.5 * t));
        // PCIe Gen5 reloads a GQA model's KV faster than an H100 recomputes it at any length.
        assert_eq!(crossover_tokens(&m, Codec::Bf16, &gpu, &Link::ALL[1]), 0.0);
        // A smaller codec never moves the crossover up.
        assert!(crossover_tokens(&m, Codec::Fp8, &gpu, &slow) <= t);
    }

    #[test]
    fn plan_tiers_and_littles_law() {
        let p = plan(PlanInput {
            model: Model::LLAMA3_8B,
            codec: Codec::Bf16,
            gpu: Gpu::by_name("H100").unwrap(),
            hbm_kv_gb: 40.0,
            dram_gb: 1000.0,
            nvme_gb: 8000.0,
            avg_context_tokens: 32768.0,
            requests_per_s: 10.0,
            session_fraction: 0.5,
            think_s: 60.0,
        });
        assert_eq!(p.kv_bytes_per_token, 131072.0);
        assert!((p.tiers[1].tokens - 1000e9 / 131072.0).abs() < 1e-3);
        assert!((p.tiers[1].sessions - 1000e9 / 131072.0 / 32768.0).abs() < 1e-9);
        assert_eq!(p.parked_sessions, 300.0);
        assert!((p.parked_gb - 300.0 * 32768.0 * 131072.0 / 1e9).abs() < 1e-9);
        assert!((p.reload_gb_per_s - 5.0 * 32768.0 * 131072.0 / 1e9).abs() < 1e-9);
        assert_eq!(p.links.len(), Link::ALL.len());
    }
}
