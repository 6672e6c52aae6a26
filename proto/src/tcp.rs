//! What a data-plane TCP connection may set on its socket at both ends beyond Nagle: on a
//! connection that never leaves the host, a congestion control that does not pace (opt-in,
//! [`CONGESTION_ENV`]).
//!
//! BBR, the system default on some distributions and cloud images, paces every connection's
//! sends to its estimate of the path's bandwidth, loopback ones too, where there is no path to
//! estimate. Measured on a 2-vCPU VM whose default is BBR: one loopback stream moved 3.5 GB/s
//! under BBR and 4.4–7.7 under CUBIC; kvtier's 1 MiB stores and loads on one connection 1.15–1.35×
//! faster under CUBIC. But with many connections at once, loopback segments of one connection are
//! reordered when its sender moves between CPUs, and a loss-based control takes every reordering
//! for a loss: 5× the spurious retransmissions, and 64 KiB loads of 8 blocks at concurrency 16
//! 0.6× as fast. So the system's choice stays the default, and a node whose clients load one
//! call at a time over same-host TCP can opt in. A connection that leaves the host always keeps
//! the system's choice.

use std::net::IpAddr;
use std::os::fd::AsFd;
use std::sync::OnceLock;

/// Congestion controls that do not pace, in the order a same-host connection asks for them
/// until the kernel lets it take one: CUBIC (built into most kernels, but an unprivileged process
/// may take it only where `net.ipv4.tcp_allowed_congestion_control` lists it), then Reno (always
/// allowed). What `KVTIER_SAME_HOST_CONGESTION=unpaced` means.
pub const UNPACED: [&str; 2] = ["cubic", "reno"];

/// The environment variable that chooses same-host data-plane connections' congestion control,
/// in the server and the client alike: unset or `system` (the default) leaves the system's;
/// `unpaced` is [`UNPACED`]; any other value, a comma-separated list to try in turn.
pub const CONGESTION_ENV: &str = "KVTIER_SAME_HOST_CONGESTION";

/// Whether a connection between `local` and `peer` stays on this host: the peer is a loopback
/// address (IPv4-mapped ones included) or this end's own address.
pub fn same_host(local: IpAddr, peer: IpAddr) -> bool {
    let peer = peer.to_canonical();
    peer.is_loopback() || peer == local.to_canonical()
}

/// The congestion controls same-host connections try, from [`CONGESTION_ENV`]; empty (the
/// system's default) unless it names some. Read once per process.
pub fn same_host_congestion() -> &'static [String] {
    static CHOICE: OnceLock<Vec<String>> = OnceLock::new();
    CHOICE.get_or_init(|| congestion_choice(std::env::var(CONGESTION_ENV).ok().as_deref()))
}

/// [`same_host_congestion`] for the variable's value `var` (`None`: unset).
fn congestion_choice(var: Option<&str>) -> Vec<String> {
    match var.map(str::trim) {
        None | Some("") => Vec::new(),
        Some(v) if v.eq_ignore_ascii_case("system") => Vec::new(),
        Some(v) if v.eq_ignore_ascii_case("unpaced") => UNPACED.iter().map(|s| s.to_string()).collect(),
        Some(v) => v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect(),
    }
}

/// What [`tune_data_socket`] did to a socket's congestion control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tuned<'c> {
    /// Left as it was: no choice made, or a connection that leaves the host.
    System,
    /// A same-host connection set to this one.
    Set(&'c str),
    /// A same-host connection the kernel let take none of the choice (e.g. a name it lacks, or
    /// CUBIC where an unprivileged process may not take it): left on the system's default.
    Refused,
}

/// Sets a connected socket's congestion control for the data plane: when it stays on this host
/// (`peer` and its own address: [`same_host`]), the first of [`same_host_congestion`] the kernel
/// accepts. The connection works whatever this does.
pub fn tune_data_socket(sock: impl AsFd, peer: IpAddr) -> Tuned<'static> {
    tune_with(sock, peer, same_host_congestion())
}

/// [`tune_data_socket`] with the choice `choice` (e.g. [`UNPACED`]) instead of the process's.
pub fn tune_with<S: AsRef<str>>(sock: impl AsFd, peer: IpAddr, choice: &[S]) -> Tuned<'_> {
    if choice.is_empty() {
        return Tuned::System;
    }
    let Some(local) = rustix::net::getsockname(&sock).ok().and_then(|a| std::net::SocketAddr::try_from(a).ok()) else {
        return Tuned::System;
    };
    if !same_host(local.ip(), peer) {
        return Tuned::System;
    }
    let fd = sock.as_fd();
    choice
        .iter()
        .map(AsRef::as_ref)
        .find(|cc| rustix::net::sockopt::set_tcp_congestion(fd, cc).is_ok())
        .map_or(Tuned::Refused, Tuned::Set)
}

/// The congestion control `sock` runs now (`None` where the kernel does not say).
pub fn congestion(sock: impl AsFd) -> Option<String> {
    rustix::net::sockopt::tcp_congestion(sock).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr, TcpListener, TcpStream};

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn loopback_and_own_addresses_are_the_same_host_and_others_are_not() {
        let lo4 = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let own = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5));
        let other = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 6));
        assert!(same_host(own, lo4));
        assert!(same_host(own, IpAddr::V4(Ipv4Addr::new(127, 3, 2, 1))));
        assert!(same_host(own, IpAddr::V6(Ipv6Addr::LOCALHOST)));
        assert!(same_host(own, IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())));
        assert!(same_host(own, own), "this end's own address stays on the host");
        assert!(same_host(own, IpAddr::V6(Ipv4Addr::new(10, 0, 0, 5).to_ipv6_mapped())));
        assert!(!same_host(own, other));
        assert!(!same_host(lo4, other));
    }

    #[test]
    fn the_choice_is_the_system_s_unless_the_variable_names_some() {
        assert!(congestion_choice(None).is_empty());
        assert!(congestion_choice(Some(" ")).is_empty());
        assert!(congestion_choice(Some("System")).is_empty());
        assert_eq!(congestion_choice(Some("unpaced")), UNPACED);
        assert_eq!(congestion_choice(Some("reno, ,bbr")), ["reno", "bbr"]);
    }

    #[test]
    fn a_same_host_connection_takes_the_first_congestion_control_the_kernel_accepts() {
        let (a, _b) = pair();
        let peer = a.peer_addr().unwrap().ip();
        // Reno is built into every kernel and always allowed; a name no kernel has is skipped.
        assert_eq!(tune_with(&a, peer, &["no-such-cc", "reno"]), Tuned::Set("reno"));
        assert_eq!(congestion(&a).as_deref(), Some("reno"));
        let (c, _d) = pair();
        let Tuned::Set(got) = tune_with(&c, peer, &UNPACED) else { panic!("Reno is always allowed") };
        assert_eq!(congestion(&c).as_deref(), Some(got));
    }

    #[test]
    fn a_connection_leaving_the_host_or_given_no_choice_keeps_the_system_default() {
        let (a, _b) = pair();
        let before = congestion(&a);
        assert!(before.is_some(), "Linux says which congestion control a socket runs");
        // A peer elsewhere: this end's address (loopback) is not the peer's.
        assert_eq!(tune_with(&a, IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)), &["reno"]), Tuned::System);
        assert_eq!(congestion(&a), before);
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(tune_with(&a, lo, &congestion_choice(Some("system"))), Tuned::System);
        assert_eq!(congestion(&a), before);
        // No name the kernel takes: refused, the connection as it was.
        assert_eq!(tune_with(&a, lo, &["no-such-cc"]), Tuned::Refused);
        assert_eq!(congestion(&a), before);
    }
}
