//! Loads through the shared Redis tier beside plain Redis `GET`s of the same values and a local
//! load, same run: `cargo build --release --bins && cargo run --release -p kvtier-tests --example
//! redis_tier_load` (needs `redis-server`). One `redis-server`, two `kvtier serve` nodes with
//! `[redis_tier]` (no kvtier cluster): n1 stores 5 documents of 64 blocks of 1 MiB, which it
//! writes through to Redis; each run loads a fresh document (n2 keeps what it loaded in DRAM)
//! through n2 — every block from Redis, verified — and reads the same 64 values with a plain
//! redis client, pipelined and one `GET` at a time; medians of 5 runs. Not a test: figures depend
//! on the machine.

use std::time::{Duration, Instant};

use kvtier_proto::{DType, KvLayout};
use kvtier_tests::redis::Redis;
use kvtier_tests::*;

const BLOCKS: usize = 64;
const RUNS: u32 = 5;
const PREFIX: &str = "kvt";

fn node(redis: &Redis, dir: &std::path::Path, id: &str) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    let toml = format!(
        "[redis_tier]\nurl = \"{}\"\nbudget = \"2GiB\"\ntimeout = \"10s\"\nkey_prefix = \"{PREFIX}\"\nwrite_queue_bytes = \"1GiB\"\n",
        redis.url()
    );
    std::fs::write(&cfg, toml).unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "2GiB"])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::main]
async fn main() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) = (node(&redis, dir.path(), "n1"), node(&redis, dir.path(), "n2"));
    let layout = KvLayout::new(8, 8, 128, DType::Bf16, 32); // 1 MiB blocks
    let spec = namespace("bench", b"bench", layout);
    let (c1, c2) = (n1.client().await, n2.client().await);
    let (ns1, ns2) = (c1.register(spec.clone()).await.unwrap(), c2.register(spec).await.unwrap());
    let docs: Vec<Vec<u32>> = (0..RUNS).map(|d| tokens(500 + d, BLOCKS * 32)).collect();
    for t in &docs {
        c1.store(&ns1, t, &full_block_payloads(&ns1, t)).await.unwrap().ok().unwrap();
    }
    let want = (RUNS as usize * BLOCKS) as f64;
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(&n1.scrape(), "kvtier_redis_written_keys_total", &[]) < want {
        assert!(Instant::now() < deadline, "n1 did not write every block to Redis");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut plain = ::redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let bytes = (BLOCKS as u64 * layout.block_bytes()) as f64;
    let gbps = |t: Instant| bytes / t.elapsed().as_secs_f64() / 1e9;
    let (mut local, mut tier, mut piped, mut one_by_one) = (vec![], vec![], vec![], vec![]);
    for t in &docs {
        let keys = ns1.keys(t);
        let names: Vec<String> = keys.iter().map(|k| format!("{PREFIX}:{}:b:{}", hex(&ns1.id.0), hex(&k.0))).collect();

        let s = Instant::now();
        let got = c1.load_keys(&ns1, &keys).await.unwrap();
        local.push(gbps(s));
        assert!(got.iter().all(Option::is_some));

        let s = Instant::now();
        let got = c2.load_keys(&ns2, &keys).await.unwrap();
        tier.push(gbps(s));
        assert!(got.iter().all(Option::is_some), "a load through the Redis tier missed");

        let s = Instant::now();
        let mut p = ::redis::pipe();
        for n in &names {
            p.cmd("GET").arg(n);
        }
        let vals: Vec<Vec<u8>> = p.query_async(&mut plain).await.unwrap();
        piped.push(gbps(s));
        assert!(vals.iter().all(|v| v.len() as u64 > layout.block_bytes()));

        let s = Instant::now();
        for n in &names {
            let v: Vec<u8> = ::redis::cmd("GET").arg(n).query_async(&mut plain).await.unwrap();
            assert!(v.len() as u64 > layout.block_bytes());
        }
        one_by_one.push(gbps(s));
    }
    let hits = metric(&n2.scrape(), "kvtier_tier_hits_total", &[("tier", "redis")]);
    assert_eq!(hits, want, "every load through n2 came from Redis");
    let (l, t, p, o) = (median(local), median(tier), median(piped), median(one_by_one));
    println!("| {BLOCKS} x 1 MiB, medians of {RUNS} | GB/s | Redis tier / this |");
    println!("|---|---|---|");
    println!("| local load (n1's DRAM) | {l:.2} | {:.2}x |", t / l);
    println!("| through the Redis tier (n2: Redis -> verify -> client) | {t:.2} | 1.00x |");
    println!("| plain Redis, one pipeline of GETs | {p:.2} | {:.2}x |", t / p);
    println!("| plain Redis, one GET at a time | {o:.2} | {:.2}x |", t / o);
}
