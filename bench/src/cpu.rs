//! CPU time spent by the server and by the client while a path runs, per GB it moved: what each
//! system costs beside what it delivers. On this 2-core machine the concurrent cells are bound by
//! the cores that client, server and kernel share, so GB/s alone can't tell a system that needs
//! less CPU per byte (and would go further with more cores, or serve more remote clients) from
//! one that needs more.
//!
//! Times are the kernel's per-process CPU clocks (user + system, every thread, those that have
//! exited too; nanoseconds): `CLOCK_PROCESS_CPUTIME_ID` for the bench itself, the clock of
//! `clock_getcpuclockid(pid)` for a server it started. The Python driver reads the same clocks.

/// The CPU time in seconds process `pid` has used so far (all its threads); `None` when its clock
/// can't be read (the process is gone, or belongs to another PID namespace).
pub fn process_cpu_s(pid: u32) -> Option<f64> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `clock_getcpuclockid` writes one `clockid_t` through the pointer, which points to a
    // live local of that type.
    if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
        return None;
    }
    read_clock(clock)
}

/// The CPU time in seconds this process has used so far (all its threads).
pub fn own_cpu_s() -> Option<f64> {
    read_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn read_clock(clock: libc::clockid_t) -> Option<f64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `clock_gettime` writes one `timespec` through the pointer, which points to a live
    // local of that type.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

/// What one timed phase cost: CPU seconds of the server and of the client (this process).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuSpent {
    pub server_s: Option<f64>,
    pub client_s: Option<f64>,
}

/// The two clocks read at the start of a phase ([`CpuMark::spent`] at its end).
#[derive(Debug, Clone, Copy)]
pub struct CpuMark {
    server_pid: Option<u32>,
    server: Option<f64>,
    client: Option<f64>,
}

impl CpuMark {
    /// Reads the clocks of the server `server_pid` (when the bench knows it) and of this process.
    pub fn now(server_pid: Option<u32>) -> CpuMark {
        CpuMark { server_pid, server: server_pid.and_then(process_cpu_s), client: own_cpu_s() }
    }

    /// The CPU each side used since the mark.
    pub fn spent(&self) -> CpuSpent {
        let since = |before: Option<f64>, now: Option<f64>| Some(now? - before?);
        CpuSpent {
            server_s: since(self.server, self.server_pid.and_then(process_cpu_s)),
            client_s: since(self.client, own_cpu_s()),
        }
    }
}

/// Milliseconds of CPU per GB moved, the median over runs that have a figure; `None` if none has.
pub fn ms_per_gb(spent_s: &[Option<f64>], bytes: usize) -> Option<f64> {
    let per: Vec<f64> = spent_s.iter().flatten().map(|s| s * 1e3 / (bytes as f64 / 1e9)).collect();
    (!per.is_empty()).then(|| crate::median(per))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burns `secs` of this thread's CPU time (however long that takes beside other tests);
    /// the wall time it took.
    fn burn(secs: f64) -> f64 {
        let thread_cpu = || read_clock(libc::CLOCK_THREAD_CPUTIME_ID).unwrap();
        let (t, start) = (std::time::Instant::now(), thread_cpu());
        let mut x = 1u64;
        while thread_cpu() - start < secs {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        t.elapsed().as_secs_f64()
    }

    #[test]
    fn a_process_clock_counts_the_work_of_that_process_only() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let mark = CpuMark::now(Some(std::process::id()));
        let wall = burn(0.2);
        let spent = mark.spent();
        let (server, client) = (spent.server_s.unwrap(), spent.client_s.unwrap());
        // Read through its pid or as this process, the same clock: at least this thread's burn,
        // at most every core for the whole time (other tests run beside it).
        for s in [server, client] {
            assert!(s >= 0.2 && s <= wall * cores + 0.05, "{s} s of CPU for a 0.2 s burn in {wall} s");
        }
        // A sleeping child's clock barely moves while this process burns.
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let mark = CpuMark::now(Some(child.id()));
        burn(0.2);
        let spent = mark.spent();
        assert!(spent.server_s.unwrap() < 0.05, "sleep used {:?} s", spent.server_s);
        assert!(spent.client_s.unwrap() >= 0.2);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_process_that_is_not_there_has_no_clock() {
        assert_eq!(process_cpu_s(u32::MAX), None);
        let mark = CpuMark::now(None);
        assert_eq!(mark.spent().server_s, None);
    }

    #[test]
    fn cpu_per_gb_is_the_median_of_the_runs_that_have_one() {
        // 0.1 s, 0.3 s and 0.2 s for 2 GB each: 50, 150, 100 ms per GB.
        assert_eq!(ms_per_gb(&[Some(0.1), None, Some(0.3), Some(0.2)], 2_000_000_000), Some(100.0));
        assert_eq!(ms_per_gb(&[None, None], 1), None);
    }
}
