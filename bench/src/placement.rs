//! `--pin`: every server a run starts (kvtier, Redis, LMCache) on CPUs of its own, every client
//! (the bench's tasks, its Python driver, `redis-benchmark`) on the others — the same for every
//! system measured, so their ratios stay fair — and the TCP baseline's sender on the servers'
//! side, its receiver on the clients'. Left to the scheduler (the default), a multi-threaded
//! server and client sharing a few cores migrate between them and wake each other across them;
//! on a VM each such wake-up is an inter-processor interrupt through the hypervisor.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::OnceLock;

use anyhow::Context;

/// Which CPUs the servers and the clients of a pinned run use.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Placement {
    pub servers: Vec<usize>,
    pub clients: Vec<usize>,
}

static PLACEMENT: OnceLock<Placement> = OnceLock::new();

impl Placement {
    /// The CPUs this process may use, split in two: the upper half (at least one) for servers,
    /// the rest for clients. `Err` on a machine with a single CPU.
    pub fn split(allowed: &[usize]) -> anyhow::Result<Placement> {
        anyhow::ensure!(allowed.len() >= 2, "--pin needs two CPUs at least (this process may use {allowed:?})");
        let at = allowed.len() / 2;
        Ok(Placement { servers: allowed[at..].to_vec(), clients: allowed[..at].to_vec() })
    }

    /// The servers' CPUs as a cpulist (`kvtier serve --cpus`).
    pub fn servers_cpulist(&self) -> String {
        self.servers.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
    }
}

/// Pins this run: the placement of the CPUs this process may use, this process (every thread,
/// and so the children it starts) confined to the clients' CPUs. Call before any runtime starts.
pub fn pin() -> anyhow::Result<&'static Placement> {
    let placement = Placement::split(&allowed()?)?;
    let set = cpu_set(&placement.clients);
    let tasks = std::fs::read_dir("/proc/self/task").context("listing this process's threads")?;
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<libc::pid_t>().ok()) else { continue };
        // SAFETY: `set` is a valid `cpu_set_t` of the size passed; the call only reads it.
        if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
            let e = std::io::Error::last_os_error();
            anyhow::ensure!(e.raw_os_error() == Some(libc::ESRCH), "pinning thread {tid}: {e}");
        }
    }
    Ok(PLACEMENT.get_or_init(|| placement))
}

/// The placement, if this run is pinned.
pub fn current() -> Option<&'static Placement> {
    PLACEMENT.get()
}

/// Starts `cmd` (a server) on the servers' CPUs, if this run is pinned.
pub fn on_server_cpus(cmd: &mut Command) {
    let Some(p) = current() else { return };
    let set = cpu_set(&p.servers);
    // SAFETY: the closure runs in the child between fork and exec and makes one system call,
    // which is async-signal-safe, on a set built before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Moves the calling thread to the servers' CPUs, if this run is pinned (the sending end of a
/// baseline stream, which stands for a server).
pub fn move_to_server_cpus() -> std::io::Result<()> {
    let Some(p) = current() else { return Ok(()) };
    let set = cpu_set(&p.servers);
    // SAFETY: `set` is a valid `cpu_set_t` of the size passed; the call only reads it.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The CPUs this thread may use.
fn allowed() -> anyhow::Result<Vec<usize>> {
    // SAFETY: an all-zero `cpu_set_t` is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is writable and of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error()).context("reading this process's CPUs");
    }
    // SAFETY: `CPU_ISSET` reads the set within its size (`CPU_SETSIZE` bits).
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: an all-zero `cpu_set_t` is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c` comes from `allowed`, below `CPU_SETSIZE`.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upper_half_serves_and_one_cpu_is_refused() {
        let p = Placement::split(&[0, 1]).unwrap();
        assert_eq!((p.servers.as_slice(), p.clients.as_slice()), (&[1][..], &[0][..]));
        let p = Placement::split(&[0, 1, 2, 3, 4]).unwrap();
        assert_eq!((p.servers.as_slice(), p.clients.as_slice()), (&[2, 3, 4][..], &[0, 1][..]));
        assert_eq!(p.servers_cpulist(), "2,3,4");
        assert!(Placement::split(&[3]).unwrap_err().to_string().contains("two CPUs"));
    }
}
