//! A synthetic but realistic workload, fully determined by its seed: R engine replicas share M
//! system prompts and documents whose popularity follows a Zipf law; agent sessions park, think,
//! resume and extend. Contexts run from `min_ctx` to `max_ctx` tokens, log-uniformly.
//!
//! The generator uses its own SplitMix64 so a seed gives the same trace on every platform and
//! every version of every dependency.

use serde::Serialize;

/// SplitMix64: small, fast, and stable forever.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Log-uniform in [lo, hi].
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        ((a + (b - a) * self.next_f64()).exp().round() as u64).clamp(lo, hi)
    }

    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next_f64()).ln()
    }
}

/// Zipf over ranks 0..n: P(k) ∝ 1/(k+1)^s, sampled from a cumulative table.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut cdf = Vec::with_capacity(n);
        let mut acc = 0.0;
        for k in 0..n {
            acc += 1.0 / ((k + 1) as f64).powf(s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.next_f64();
        self.cdf.partition_point(|&c| c <= u).min(self.cdf.len() - 1)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TraceConfig {
    pub seed: u64,
    pub replicas: u32,
    /// Shared system prompts and documents.
    pub docs: u32,
    pub zipf_s: f64,
    /// Requests that read a shared document plus a fresh user suffix.
    pub prefix_requests: u32,
    /// Agent sessions, each with `turns` turns after its first park.
    pub sessions: u32,
    pub turns: u32,
    pub min_ctx: u64,
    pub max_ctx: u64,
    /// Fresh tokens per request after the shared document.
    pub suffix_tokens: (u64, u64),
    /// Tokens a turn adds to a session.
    pub turn_tokens: (u64, u64),
    /// Mean think time between turns, seconds of trace time.
    pub think_s: f64,
    /// Mean gap between prefix requests, seconds of trace time.
    pub request_gap_s: f64,
}

impl Default for TraceConfig {
    fn default() -> Self {
        TraceConfig {
            seed: 42,
            replicas: 4,
            docs: 64,
            zipf_s: 1.0,
            prefix_requests: 400,
            sessions: 24,
            turns: 4,
            min_ctx: 1024,
            max_ctx: 131072,
            suffix_tokens: (64, 1024),
            turn_tokens: (256, 4096),
            think_s: 30.0,
            request_gap_s: 0.5,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Op {
    /// A replica serves a request: shared document `doc` then `suffix_tokens` fresh tokens.
    Prefix {
        replica: u32,
        doc: u32,
        suffix_tokens: u64,
        request: u32,
    },
    /// A new session parks its first context.
    Park {
        session: u32,
        tokens: u64,
    },
    /// A session comes back after thinking: resume everything.
    Resume {
        session: u32,
        replica: u32,
    },
    /// The turn's new tokens are appended and the session parked again.
    Extend {
        session: u32,
        tokens: u64,
    },
    Drop {
        session: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    /// Trace time, seconds.
    pub at: f64,
    pub op: Op,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trace {
    /// Token count of each shared document.
    pub doc_tokens: Vec<u64>,
    pub events: Vec<Event>,
}

impl Trace {
    pub fn generate(cfg: &TraceConfig) -> Trace {
        let mut rng = Rng::new(cfg.seed);
        let doc_tokens: Vec<u64> = (0..cfg.docs).map(|_| rng.log_uniform(cfg.min_ctx, cfg.max_ctx)).collect();
        let zipf = Zipf::new(cfg.docs as usize, cfg.zipf_s);
        let mut ev: Vec<(f64, u64, Op)> = Vec::new();
        let mut seq = 0u64;
        let mut push = |at: f64, op: Op, ev: &mut Vec<(f64, u64, Op)>| {
            ev.push((at, seq, op));
            seq += 1;
        };
        let mut t = 0.0;
        for request in 0..cfg.prefix_requests {
            t += rng.exp(cfg.request_gap_s);
            let op = Op::Prefix {
                replica: rng.range(0, u64::from(cfg.replicas.max(1)) - 1) as u32,
                doc: zipf.sample(&mut rng) as u32,
                suffix_tokens: rng.range(cfg.suffix_tokens.0, cfg.suffix_tokens.1),
                request,
            };
            push(t, op, &mut ev);
        }
        let span = t.max(1.0);
        for session in 0..cfg.sessions {
            let mut at = rng.next_f64() * span * 0.5;
            let mut tokens = rng.log_uniform(cfg.min_ctx, (cfg.max_ctx / 2).max(cfg.min_ctx));
            push(at, Op::Park { session, tokens }, &mut ev);
            for _ in 0..cfg.turns {
                at += rng.exp(cfg.think_s);
                let replica = rng.range(0, u64::from(cfg.replicas.max(1)) - 1) as u32;
                push(at, Op::Resume { session, replica }, &mut ev);
                tokens = (tokens + rng.range(cfg.turn_tokens.0, cfg.turn_tokens.1)).min(cfg.max_ctx);
                at += 0.001;
                push(at, Op::Extend { session, tokens }, &mut ev);
            }
            push(at + 0.001, Op::Drop { session }, &mut ev);
        }
        ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        Trace { doc_tokens, events: ev.into_iter().map(|(at, _, op)| Event { at, op }).collect() }
    }
}

/// Token ids of a stream (a document, a request suffix, a session), derived from its identity so
/// that the same document always hashes to the same block keys.
pub fn tokens(stream: u64, from: u64, n: u64) -> impl Iterator<Item = u32> {
    (from..from + n).map(move |i| {
        let mut r = Rng::new(stream.wrapping_mul(0xA24B_AED4_963E_E407) ^ i);
        r.next_u64() as u32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_trace() {
        let cfg = TraceConfig::default();
        let a = Trace::generate(&cfg);
        let b = Trace::generate(&cfg);
        assert_eq!(a, b);
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
        let c = Trace::generate(&TraceConfig { seed: 43, ..cfg.clone() });
        assert_ne!(a, c);
        // Every event of the config is there: requests, and per session park + turns·2 + drop.
        assert_eq!(a.events.len() as u32, cfg.prefix_requests + cfg.sessions * (2 + 2 * cfg.turns));
        assert!(a.events.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn rng_is_stable_across_versions() {
        // SplitMix64 reference values for seed 0 (Vigna's splitmix64.c).
        let mut r = Rng::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let t: Vec<u32> = tokens(7, 0, 4).collect();
        assert_eq!(t, tokens(7, 0, 4).collect::<Vec<_>>());
        assert_eq!(&t[2..], &tokens(7, 2, 2).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn zipf_favours_low_ranks_and_contexts_stay_in_range() {
        let z = Zipf::new(100, 1.0);
        let mut r = Rng::new(1);
        let mut counts = vec![0u32; 100];
        for _ in 0..20000 {
            counts[z.sample(&mut r)] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[10] && counts[10] > counts[99]);
        // P(rank 0) = 1/H_100 ≈ 0.193
        assert!((3300..4400).contains(&counts[0]), "{}", counts[0]);
        let cfg = TraceConfig::default();
        let tr = Trace::generate(&cfg);
        assert!(tr.doc_tokens.iter().all(|&t| (cfg.min_ctx..=cfg.max_ctx).contains(&t)));
        for e in &tr.events {
            if let Op::Park { tokens, .. } | Op::Extend { tokens, .. } = e.op {
                assert!((cfg.min_ctx..=cfg.max_ctx).contains(&tokens));
            }
        }
    }
}
