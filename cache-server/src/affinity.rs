//! The CPUs a node runs on (`cpus` in the configuration): a Linux cpulist (`"2-5"`, `"0,4-7"`)
//! parsed, and the process confined to it — every thread it has and, through them, every thread
//! it starts later. Start it before the runtime, so that the runtime sizes its worker pool by the
//! set (`std::thread::available_parallelism` follows the affinity).
//!
//! Why a node would: on a host it shares with inference engines, the cache's threads then stay
//! off the engines' cores, and each side's wake-ups stay on its own cores (measured on a 2-vCPU
//! VM, Python threads loading 64 KiB blocks from a node on the other core: 1.3–1.6× the GB/s of
//! both left to the scheduler, a third less client CPU per GB; see the README).

use crate::error::ServerError;

/// The CPUs of a cpulist: comma-separated CPU numbers and inclusive ranges, e.g. `"0,2-3"`;
/// sorted, without repeats. Empty lists, reversed ranges and CPUs past the kernel's set size are
/// errors.
pub fn parse_cpulist(list: &str) -> Result<Vec<usize>, ServerError> {
    let bad =
        |why: String| ServerError::Config(format!("cpus = {list:?}: {why} (a cpulist such as \"2-5\" or \"0,4-7\")"));
    let number = |s: &str| s.trim().parse::<usize>().map_err(|_| bad(format!("{:?} is not a CPU number", s.trim())));
    let mut cpus = Vec::new();
    for part in list.split(',') {
        if part.trim().is_empty() {
            return Err(bad("an empty entry".into()));
        }
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (number(lo)?, number(hi)?),
            None => {
                let n = number(part)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(bad(format!("the range {lo}-{hi} runs backwards")));
        }
        if hi >= rustix::thread::CpuSet::MAX_CPU {
            return Err(bad(format!(
                "CPU {hi} is past the {} this kernel interface can name",
                rustix::thread::CpuSet::MAX_CPU
            )));
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Confines every thread of this process to `cpus`; threads started later inherit it from the
/// thread that starts them. An error names the CPUs when the kernel refuses them (none of them
/// online, or outside what the process's cgroup allows).
pub fn confine_process(cpus: &[usize]) -> Result<(), ServerError> {
    let mut set = rustix::thread::CpuSet::new();
    for &cpu in cpus {
        set.set(cpu);
    }
    let refused = |e: std::io::Error| {
        ServerError::Config(format!(
            "cpus {cpus:?}: the kernel refused them ({e}); the CPUs this process may use: {}",
            allowed().map(|a| format!("{a:?}")).unwrap_or_else(|e| format!("unknown ({e})"))
        ))
    };
    // This thread first: an error here leaves the process as it was.
    rustix::thread::sched_setaffinity(None, &set).map_err(|e| refused(e.into()))?;
    let tasks = std::fs::read_dir("/proc/self/task")
        .map_err(|e| ServerError::Config(format!("cpus: cannot list this process's threads: {e}")))?;
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else { continue };
        let Some(pid) = rustix::process::Pid::from_raw(tid) else { continue };
        match rustix::thread::sched_setaffinity(Some(pid), &set) {
            // A thread that ended since the listing.
            Ok(()) | Err(rustix::io::Errno::SRCH) => {}
            Err(e) => return Err(refused(e.into())),
        }
    }
    Ok(())
}

/// The CPUs this thread may run on now.
pub fn allowed() -> std::io::Result<Vec<usize>> {
    let set = rustix::thread::sched_getaffinity(None)?;
    Ok((0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpulist_parses_to_sorted_cpus_and_bad_ones_say_why() {
        assert_eq!(parse_cpulist("3").unwrap(), vec![3]);
        assert_eq!(parse_cpulist("0,4-6, 2").unwrap(), vec![0, 2, 4, 5, 6]);
        assert_eq!(parse_cpulist("1-2,2-3").unwrap(), vec![1, 2, 3]);
        for (list, says) in [
            ("", "empty entry"),
            ("1,,2", "empty entry"),
            ("x", "\"x\" is not a CPU number"),
            ("5-2", "runs backwards"),
            ("-1", "\"\" is not a CPU number"),
            ("99999", "past the"),
        ] {
            let e = parse_cpulist(list).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("cpulist"), "{list:?}: {e}");
        }
    }

    /// Confined to one CPU it may use, every thread of a process is on that CPU alone, the
    /// threads started before and after alike; a CPU it may not use is refused with the CPUs
    /// it may, and leaves the process as it was. Run in a child process (this test's own
    /// binary), so the test harness's threads are not confined.
    #[test]
    fn a_process_confined_to_a_cpu_runs_every_thread_there() {
        if std::env::var_os("KVTIER_AFFINITY_CHILD").is_some() {
            let before = std::thread::spawn(std::thread::park);
            let all = allowed().unwrap();
            let cpu = *all.last().unwrap();
            let e = confine_process(&[rustix::thread::CpuSet::MAX_CPU - 1]).unwrap_err().to_string();
            assert!(e.contains("refused") && e.contains("may use"), "{e}");
            assert_eq!(allowed().unwrap(), all, "a refusal changed nothing");
            confine_process(&[cpu]).unwrap();
            let after = std::thread::spawn(allowed).join().unwrap().unwrap();
            assert_eq!(after, vec![cpu], "a thread started afterwards");
            for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
                let status = std::fs::read_to_string(task.path().join("status")).unwrap();
                let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim();
                assert_eq!(parse_cpulist(list).unwrap(), vec![cpu], "thread {:?}", task.file_name());
            }
            before.thread().unpark();
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "affinity::tests::a_process_confined_to_a_cpu_runs_every_thread_there", "--nocapture"])
            .env("KVTIER_AFFINITY_CHILD", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
    }
}
