//! How `kvtier serve` takes its configuration, through real processes: `/metrics` beyond
//! loopback needs `metrics_token` (no other credential guards it), and one TOML file configures
//! `serve` and `agent` (an `[agent]` table).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_tests::*;

const OPERATOR: &str = "operator-secret-0000";
const METRICS_TOKEN: &str = "metrics-scrape-secret-01";

/// A `kvtier serve` started with exactly `args` (plus a data directory and loopback gRPC and
/// data-plane listeners), killed when dropped.
struct Serve {
    child: Child,
    line: String,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvtier serve` with `args`: `Ok` once it reports its addresses, `Err(stderr)` when it
/// exits first.
fn serve(args: &[&str]) -> Result<Serve, String> {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(kvtier_bin())
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .args(args)
        .env_remove("KVTIER_CONFIG")
        .env("KVTIER_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvtier serve");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        match lines.next() {
            Some(Ok(line)) if line.contains("listening") => {
                std::thread::spawn(move || for _ in lines {});
                return Ok(Serve { child, line, _dir: dir });
            }
            Some(Ok(_)) => {}
            _ => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    Err(err)
}

/// `GET /metrics` on 127.0.0.1 at the port the server reported, with an optional bearer token:
/// the status line.
fn scrape_status(s: &Serve, token: Option<&str>) -> String {
    let url = s.line.split_whitespace().find_map(|w| w.strip_prefix("metrics=")).expect("metrics address");
    let port = url.trim_start_matches("http://").trim_end_matches("/metrics").rsplit(':').next().unwrap();
    let mut c = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    c.write_all(format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n").as_bytes()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out.lines().next().unwrap_or_default().to_string()
}

/// `--metrics 0.0.0.0:…` with only `--auth-token` is refused, naming `metrics_token` (the
/// credential that guards `/metrics`); with `metrics_token` set the node starts and `/metrics`
/// answers only the bearer of it.
#[test]
fn metrics_beyond_loopback_need_the_metrics_token() {
    let Err(err) = serve(&["--metrics", "0.0.0.0:0", "--auth-token", OPERATOR]) else {
        panic!("/metrics was exposed beyond loopback with no metrics_token")
    };
    assert!(err.contains("metrics_listen 0.0.0.0:0 is beyond loopback") && err.contains("set metrics_token"), "{err}");

    let s = serve(&["--metrics", "0.0.0.0:0", "--auth-token", OPERATOR, "--metrics-token", METRICS_TOKEN])
        .expect("starts with metrics_token");
    assert!(scrape_status(&s, None).contains("401"), "no header");
    assert!(scrape_status(&s, Some(OPERATOR)).contains("401"), "the operator's token is not the metrics token");
    assert!(scrape_status(&s, Some(METRICS_TOKEN)).contains("200"));
}

/// One file for a node and its agent: `serve --config` takes a file with an `[agent]` table (and
/// still refuses a misspelt key beside it).
#[test]
fn serve_starts_on_a_file_shared_with_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kvtier.toml");
    let shared = "dram_capacity = \"64MiB\"\n\n[agent]\nserver = \"127.0.0.1:7070\"\ndevice = \"host\"\n\
                  host_memory = \"256MiB\"\npage_bytes = \"64KiB\"\n";
    std::fs::write(&cfg, shared).unwrap();
    let s = serve(&["--no-metrics", "--config", cfg.to_str().unwrap()]).expect("serve reads a shared file");
    assert!(s.line.contains("dram=64MiB"), "{}", s.line);
    drop(s);
    std::fs::write(&cfg, format!("dram_capacty = \"64MiB\"\n{shared}")).unwrap();
    let Err(err) = serve(&["--no-metrics", "--config", cfg.to_str().unwrap()]) else { panic!("a misspelt key") };
    assert!(err.contains("dram_capacty"), "{err}");
}

/// A bad value from an environment variable is refused naming the variable, not only the flag
/// clap names (which was not given); a bad flag is refused as clap says it. The start line
/// gives the DRAM cap exactly where that is short, else about it.
#[test]
fn a_bad_value_from_the_environment_names_its_variable() {
    let refused = |env: Option<&str>, args: &[&str]| {
        let mut cmd = Command::new(kvtier_bin());
        cmd.arg("serve").args(args).env_remove("KVTIER_CONFIG").env_remove("KVTIER_DRAM_CAPACITY");
        if let Some(v) = env {
            cmd.env("KVTIER_DRAM_CAPACITY", v);
        }
        let out = cmd.output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = refused(Some("5zz"), &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("unknown size unit \"zz\"") && err.contains("environment variable KVTIER_DRAM_CAPACITY"),
        "{err}"
    );
    let (code, err) = refused(None, &["--dram-capacity", "5zz"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("'--dram-capacity <DRAM_CAPACITY>'") && !err.contains("environment"), "{err}");
    // Given on the command line too, the flag's value is the one refused.
    let (_, err) = refused(Some("8MiB"), &["--dram-capacity", "5zz"]);
    assert!(!err.contains("environment"), "{err}");

    // A value clap takes but the configuration refuses is said to come from its variable too.
    let (code, err) = refused(Some("100000"), &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("dram_capacity 100000B is below")
            && err.contains("(its value came from the environment variable KVTIER_DRAM_CAPACITY)"),
        "{err}"
    );
    let (_, err) = refused(None, &["--dram-capacity", "100000"]);
    assert!(err.contains("dram_capacity 100000B is below") && !err.contains("environment"), "{err}");

    // A flag of the same name in another subcommand reads another variable: the one of the
    // subcommand run is named.
    let out = Command::new(kvtier_bin())
        .args(["agent", "--server", "127.0.0.1:1"])
        .env_remove("KVTIER_CONFIG")
        .env("KVTIER_METRICS", "not-an-address")
        .env("KVTIER_AGENT_METRICS", "not-an-address")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("environment variable KVTIER_AGENT_METRICS"), "{err}");

    let s = serve(&["--dram-capacity", "1234567KiB"]).unwrap();
    assert!(s.line.contains("dram=1.18GiB "), "{}", s.line);
}
