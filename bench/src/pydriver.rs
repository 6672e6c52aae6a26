//! The Python side of a run: `kvtier/wire_bench.py` (the Python client's `load_into`, its
//! engine-key calls, and LMCache's own client protocol against LMCache's server) run as a
//! subprocess with a Python in which `kvtier` imports, one run of one cell per call. Its JSON
//! answer becomes [`Cell`]s beside the Rust paths.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::blocks::Cell;
use crate::cpu::CpuSpent;

/// The repository root this bench was built from (the driver file is read from the checkout, so
/// a run measures the driver beside the Rust code of the same commit).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python to run: the flag, else `$KVTIER_BENCH_PYTHON`, else the active virtualenv's, else
/// the checkout's `.venv`, else `python3` from PATH.
pub fn find_python(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os("KVTIER_BENCH_PYTHON") {
        return PathBuf::from(p);
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        let p = PathBuf::from(v).join("bin/python");
        if p.is_file() {
            return p;
        }
    }
    let p = repo_root().join(".venv/bin/python");
    if p.is_file() {
        return p;
    }
    PathBuf::from("python3")
}

/// How `python` runs the driver, once `module` (`kvtier`, or `lmcache.v1.protocol`) was found
/// to import there; `Err` says why not.
#[derive(Debug, Clone)]
pub struct Driver {
    python: PathBuf,
    /// The checkout's `wire_bench.py`, run by path (`runpy`, so the package folder does not
    /// shadow top-level modules); `None`: the installed `kvtier.wire_bench`.
    file: Option<PathBuf>,
}

impl Driver {
    pub fn new(python: &Path, module: &str) -> Result<Driver, String> {
        let probe = Command::new(python)
            .args(["-I", "-c", &format!("import {module}")])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
        if !probe.status.success() {
            let err = String::from_utf8_lossy(&probe.stderr);
            return Err(format!(
                "`import {module}` fails in {}: {}",
                python.display(),
                err.lines().last().unwrap_or("no message").trim()
            ));
        }
        let file = repo_root().join("client/python/python/kvtier/wire_bench.py");
        Ok(Driver { python: python.to_path_buf(), file: file.is_file().then_some(file) })
    }

    pub fn python(&self) -> &Path {
        &self.python
    }

    /// One run of one cell: `target` is `kvtier` or `lmcache`, `to` its `--server ADDR` or
    /// `--port PORT` arguments.
    pub fn run(
        &self,
        target: &str,
        to: &[String],
        size: usize,
        c: usize,
        ops: usize,
        run: usize,
    ) -> anyhow::Result<PyRun> {
        let mut cmd = Command::new(&self.python);
        cmd.arg("-I");
        match &self.file {
            Some(f) => {
                cmd.args([
                    "-c",
                    "import runpy, sys; p = sys.argv.pop(1); sys.argv[0] = p; runpy.run_path(p, run_name='__main__')",
                ])
                .arg(f);
            }
            None => {
                cmd.args(["-m", "kvtier.wire_bench"]);
            }
        }
        cmd.arg(target).args(to).args([
            "--size",
            &size.to_string(),
            "--concurrency",
            &c.to_string(),
            "--ops",
            &ops.to_string(),
            "--run",
            &run.to_string(),
        ]);
        // OpenBLAS (loaded with numpy) keeps worker threads that spin for a while; the driver makes
        // no BLAS call, and their spinning would count in its CPU time.
        cmd.env("OPENBLAS_NUM_THREADS", "1");
        let out = cmd.stdin(Stdio::null()).output().context("running the Python driver")?;
        if !out.status.success() {
            bail!(
                "the Python driver ({target}) exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().rev().find(|l| l.starts_with('{')).context("no JSON from the Python driver")?;
        Ok(serde_json::from_str(line)?)
    }
}

/// One path's figures in one run.
#[derive(Debug, Clone, Deserialize)]
pub struct PyPath {
    pub store_s: f64,
    pub load_s: f64,
    pub store_lat: Vec<f64>,
    pub load_lat: Vec<f64>,
    /// CPU seconds of each phase: `[server, driver]` (the server's `None` where the driver was not
    /// given its pid; both `None` from an older driver).
    #[serde(default)]
    pub store_cpu: [Option<f64>; 2],
    #[serde(default)]
    pub load_cpu: [Option<f64>; 2],
}

/// The driver's answer for one run of one cell.
#[derive(Debug, Clone, Deserialize)]
pub struct PyRun {
    /// Bytes each phase of each path moved.
    pub bytes: usize,
    pub paths: BTreeMap<String, PyPath>,
    /// kvtier namespace ids (hex) the run wrote, for the caller to purge.
    pub namespaces: Vec<String>,
    /// Paths the driver left out, with the reason (the same-node path where the server is on
    /// another host or has no same-node socket).
    #[serde(default)]
    pub skipped: BTreeMap<String, String>,
}

/// Store and load cells of each path, from every run of one (size, concurrency) cell.
pub fn cells(runs: &[PyRun], size: usize, c: usize) -> Vec<Cell> {
    let mut out = Vec::new();
    let Some(first) = runs.first() else { return out };
    for system in first.paths.keys() {
        let ps: Vec<(&PyPath, usize)> = runs.iter().filter_map(|r| Some((r.paths.get(system)?, r.bytes))).collect();
        let st: Vec<f64> = ps.iter().map(|(p, b)| *b as f64 / p.store_s / 1e9).collect();
        let ld: Vec<f64> = ps.iter().map(|(p, b)| *b as f64 / p.load_s / 1e9).collect();
        let sl: Vec<f64> = ps.iter().flat_map(|(p, _)| p.store_lat.iter().copied()).collect();
        let ll: Vec<f64> = ps.iter().flat_map(|(p, _)| p.load_lat.iter().copied()).collect();
        let cpu = |f: fn(&PyPath) -> [Option<f64>; 2]| -> Vec<CpuSpent> {
            ps.iter().map(|(p, _)| CpuSpent { server_s: f(p)[0], client_s: f(p)[1] }).collect()
        };
        let bytes = ps.first().map_or(0, |(_, b)| *b);
        out.push(Cell::from_runs(system, "store", size, c, &st, &sl).with_cpu(&cpu(|p| p.store_cpu), bytes));
        out.push(Cell::from_runs(system, "load", size, c, &ld, &ll).with_cpu(&cpu(|p| p.load_cpu), bytes));
    }
    out
}

/// Parses a namespace id written in hex.
pub fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(s.len().is_multiple_of(2), "odd-length hex {s:?}");
    (0..s.len()).step_by(2).map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_answers_become_cells() {
        let run = |s: f64| -> PyRun {
            serde_json::from_str(&format!(
                r#"{{"bytes": 1000000000, "namespaces": ["00ff"], "paths": {{"python": {{"store_s": {s}, "load_s": 0.5, "store_lat": [0.1, 0.2], "load_lat": [0.05]}}}}}}"#
            ))
            .unwrap()
        };
        let cs = cells(&[run(1.0), run(2.0), run(4.0)], 1 << 20, 4);
        assert_eq!(cs.len(), 2);
        let st = &cs[0];
        assert_eq!((st.system.as_str(), st.op.as_str(), st.concurrency), ("python", "store", 4));
        assert_eq!((st.gb_per_s, st.gb_per_s_min, st.gb_per_s_max), (0.5, 0.25, 1.0));
        assert_eq!(st.ops, 6);
        assert_eq!(cs[1].gb_per_s, 2.0);
        assert_eq!((st.server_cpu_ms_per_gb, st.client_cpu_ms_per_gb), (None, None), "an older driver: no CPU");
        assert_eq!(unhex("00ff").unwrap(), vec![0, 255]);
        assert!(unhex("0").is_err());
        // An older driver says nothing of skipped paths.
        assert!(run(1.0).skipped.is_empty());
    }

    #[test]
    fn the_cpu_a_driver_reports_becomes_ms_per_gb() {
        // 2 GB per phase; loads: the server used 0.2 s then 0.4 s, the driver 1 s then 3 s.
        let run = |srv: f64, drv: f64| -> PyRun {
            serde_json::from_str(&format!(
                r#"{{"bytes": 2000000000, "namespaces": [], "paths": {{"lmcache": {{"store_s": 1, "load_s": 1, "store_lat": [], "load_lat": [], "store_cpu": [null, 0.5], "load_cpu": [{srv}, {drv}]}}}}}}"#
            ))
            .unwrap()
        };
        let cs = cells(&[run(0.2, 1.0), run(0.4, 3.0)], 1 << 20, 1);
        let (st, ld) = (&cs[0], &cs[1]);
        assert_eq!((st.server_cpu_ms_per_gb, st.client_cpu_ms_per_gb), (None, Some(250.0)));
        let (s, c) = (ld.server_cpu_ms_per_gb.unwrap(), ld.client_cpu_ms_per_gb.unwrap());
        assert!((s - 150.0).abs() < 1e-9 && (c - 1000.0).abs() < 1e-9, "{s} {c}");
    }

    #[test]
    fn a_path_the_driver_left_out_is_no_cell_and_keeps_its_reason() {
        let r: PyRun = serde_json::from_str(
            r#"{"bytes": 8, "namespaces": [], "paths": {}, "skipped": {"python-samenode": "0 of 4 loads took the same-node path"}}"#,
        )
        .unwrap();
        assert!(cells(std::slice::from_ref(&r), 1 << 20, 1).is_empty());
        assert_eq!(r.skipped["python-samenode"], "0 of 4 loads took the same-node path");
    }
}
