//! What a data-plane TCP connection may set on its socket at both ends beyond Nagle: on a
//! connection that never leaves the host, a congestion control that does not pace — while the
//! connection has the node to itself ([`PaceSwitch`]), or for its whole life (opt-in,
//! [`CONGESTION_ENV`]).
//!
//! BBR, the system default on some distributions and cloud images, paces every connection's
//! sends to its estimate of the path's bandwidth, loopback ones too, where there is no path to
//! estimate. Measured on a 2-vCPU VM whose default is BBR: one loopback stream moved 3.5 GB/s
//! under BBR and 4.4–7.7 under CUBIC; kvtier's 1 MiB stores and loads on one connection 1.15–1.35×
//! faster under CUBIC. But with many connections at once, loopback segments of one connection are
//! reordered when its sender moves between CPUs, and a loss-based control takes every reordering
//! for a loss: 5× the spurious retransmissions, and 64 KiB loads of 8 blocks at concurrency 16
//! 0.6× as fast. Hence a switch per request: the server runs a connection unpaced while it is
//! alone and on the system's choice as soon as others run, and its answers tell the client,
//! which switches its own end (the one a store's bytes leave from) likewise. A connection that
//! leaves the host always keeps the system's choice.

use std::net::IpAddr;
use std::os::fd::AsFd;
use std::sync::OnceLock;

/// Congestion controls that do not pace, in the order a same-host connection asks for them
/// until the kernel lets it take one: CUBIC (built into most kernels, but an unprivileged process
/// may take it only where `net.ipv4.tcp_allowed_congestion_control` lists it), then Reno (always
/// allowed). What `KVTIER_SAME_HOST_CONGESTION=unpaced` means.
pub const UNPACED: [&str; 2] = ["cubic", "reno"];

/// The environment variable that chooses same-host data-plane connections' congestion control
/// ([`SameHostCongestion`]): `auto`, `system`, `unpaced`, or a comma-separated list of names.
pub const CONGESTION_ENV: &str = "KVTIER_SAME_HOST_CONGESTION";

/// Whether a connection between `local` and `peer` stays on this host: the peer is a loopback
/// address (IPv4-mapped ones included) or this end's own address.
pub fn same_host(local: IpAddr, peer: IpAddr) -> bool {
    let peer = peer.to_canonical();
    peer.is_loopback() || peer == local.to_canonical()
}

/// How same-host data-plane connections choose their congestion control ([`CONGESTION_ENV`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SameHostCongestion {
    /// `auto` (the default, unset): the server switches a connection to [`UNPACED`] while it
    /// has the node to itself and back to the system's when others run ([`PaceSwitch`]), and
    /// says so in its answers (`dataplane::ANSWER_ALONE`); a client switches its own end as they
    /// say, for the requests that follow.
    WhileAlone,
    /// `system`: the system's, always.
    System,
    /// `unpaced` ([`UNPACED`]), or a list of names: the first the kernel accepts, at both ends,
    /// for the connection's life.
    Always(Vec<String>),
}

/// The process's [`SameHostCongestion`], from [`CONGESTION_ENV`]. Read once per process.
pub fn same_host_congestion() -> &'static SameHostCongestion {
    static CHOICE: OnceLock<SameHostCongestion> = OnceLock::new();
    CHOICE.get_or_init(|| congestion_choice(std::env::var(CONGESTION_ENV).ok().as_deref()))
}

/// [`same_host_congestion`] for the variable's value `var` (`None`: unset).
fn congestion_choice(var: Option<&str>) -> SameHostCongestion {
    match var.map(str::trim) {
        None | Some("") => SameHostCongestion::WhileAlone,
        Some(v) if v.eq_ignore_ascii_case("auto") => SameHostCongestion::WhileAlone,
        Some(v) if v.eq_ignore_ascii_case("system") => SameHostCongestion::System,
        Some(v) if v.eq_ignore_ascii_case("unpaced") => {
            SameHostCongestion::Always(UNPACED.iter().map(|s| s.to_string()).collect())
        }
        Some(v) => {
            let names: Vec<String> =
                v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
            if names.is_empty() {
                SameHostCongestion::WhileAlone
            } else {
                SameHostCongestion::Always(names)
            }
        }
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

/// Sets a connected socket's congestion control for its life, where the process asks for that
/// ([`SameHostCongestion::Always`]) and the connection stays on this host (`peer` and its own
/// address: [`same_host`]): the first name the kernel accepts. The connection works whatever
/// this does.
pub fn tune_data_socket(sock: impl AsFd, peer: IpAddr) -> Tuned<'static> {
    match same_host_congestion() {
        SameHostCongestion::Always(names) => tune_with(sock, peer, names),
        SameHostCongestion::WhileAlone | SameHostCongestion::System => Tuned::System,
    }
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

/// Whether congestion control `cc` paces a connection's sends by itself: BBR and its versions.
/// (Linux's loss-based controls pace only under the `fq` queueing discipline, which loopback
/// does not run.)
pub fn paces(cc: &str) -> bool {
    cc.starts_with("bbr")
}

/// A same-host connection's congestion control, switched per request by the end that sends the
/// bulk of its bytes (the server, for loads): [`UNPACED`] while the connection has the node to
/// itself, the system's as soon as other connections run ([`SameHostCongestion::WhileAlone`]).
///
/// Switching a live connection's control is one `setsockopt`; Linux starts the new control's
/// state afresh and keeps the connection's window. Measured on a 2-vCPU VM whose default is BBR,
/// a 1 MiB request/response loop on one connection: 2.8 GB/s under BBR, 4.3 from the start under
/// CUBIC, 4.6 switched from BBR to CUBIC after 200 round trips, 4.0 switched back and forth on
/// every request.
#[derive(Debug)]
pub struct PaceSwitch {
    /// The unpaced controls to try, in turn ([`UNPACED`]).
    names: &'static [&'static str],
    /// The control the socket had when it was made: what it returns to.
    system: String,
    /// The unpaced name the kernel took last (tried first next time).
    unpaced: Option<&'static str>,
    /// Whether the socket runs unpaced now.
    unpaced_now: bool,
    /// The kernel refused a switch: the socket stays as it is from then on.
    off: bool,
}

/// What [`PaceSwitch::fit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switched<'c> {
    /// The socket already ran what fits (or the switch is off).
    Unchanged,
    /// The socket runs this one now.
    To(&'c str),
    /// The kernel took none of the names: the socket keeps what it runs, and the switch is off.
    Refused,
}

impl PaceSwitch {
    /// For a connected socket, as the process chooses ([`same_host_congestion`]): `None` unless
    /// that is [`SameHostCongestion::WhileAlone`], the connection stays on this host, and its
    /// control now paces ([`paces`]: a system whose default is CUBIC has nothing to switch).
    pub fn for_socket(sock: impl AsFd, peer: IpAddr) -> Option<PaceSwitch> {
        match same_host_congestion() {
            SameHostCongestion::WhileAlone => PaceSwitch::new(sock, peer),
            _ => None,
        }
    }

    /// [`PaceSwitch::for_socket`] whatever the process chooses.
    pub fn new(sock: impl AsFd, peer: IpAddr) -> Option<PaceSwitch> {
        PaceSwitch::among(sock, peer, &UNPACED).filter(|sw| paces(&sw.system))
    }

    /// A switch between `names` (tried in turn while alone) and the control the socket runs now,
    /// whatever that is, unless it is one of `names`.
    fn among(sock: impl AsFd, peer: IpAddr, names: &'static [&'static str]) -> Option<PaceSwitch> {
        let local = rustix::net::getsockname(&sock).ok().and_then(|a| std::net::SocketAddr::try_from(a).ok())?;
        if !same_host(local.ip(), peer) {
            return None;
        }
        let system = congestion(&sock)?;
        if names.contains(&system.as_str()) {
            return None;
        }
        Some(PaceSwitch { names, system, unpaced: None, unpaced_now: false, off: false })
    }

    /// Fits `sock`'s control to whether its connection has the node to itself (`alone`):
    /// unpaced if so, the system's if not. A syscall only when that changes.
    pub fn fit(&mut self, sock: impl AsFd, alone: bool) -> Switched<'_> {
        if self.off || alone == self.unpaced_now {
            return Switched::Unchanged;
        }
        let fd = sock.as_fd();
        if !alone {
            if rustix::net::sockopt::set_tcp_congestion(fd, &self.system).is_err() {
                self.off = true;
                return Switched::Refused;
            }
            self.unpaced_now = false;
            return Switched::To(&self.system);
        }
        let tried = self.unpaced.into_iter().chain(self.names.iter().copied().filter(|n| Some(*n) != self.unpaced));
        let mut took = None;
        for name in tried {
            if rustix::net::sockopt::set_tcp_congestion(fd, name).is_ok() {
                took = Some(name);
                break;
            }
        }
        match took {
            Some(name) => {
                self.unpaced = Some(name);
                self.unpaced_now = true;
                Switched::To(name)
            }
            None => {
                self.off = true;
                Switched::Refused
            }
        }
    }

    /// The control the socket returns to when others run.
    pub fn system(&self) -> &str {
        &self.system
    }
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
        use SameHostCongestion::*;
        let names = |v: &[&str]| Always(v.iter().map(|s| s.to_string()).collect());
        assert_eq!(congestion_choice(None), WhileAlone);
        assert_eq!(congestion_choice(Some(" ")), WhileAlone);
        assert_eq!(congestion_choice(Some("Auto")), WhileAlone);
        assert_eq!(congestion_choice(Some(" , ")), WhileAlone);
        assert_eq!(congestion_choice(Some("System")), System);
        assert_eq!(congestion_choice(Some("unpaced")), names(&UNPACED));
        assert_eq!(congestion_choice(Some("reno, ,bbr")), names(&["reno", "bbr"]));
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
        assert_eq!(tune_with(&a, lo, &[] as &[&str]), Tuned::System);
        assert_eq!(congestion(&a), before);
        // No name the kernel takes: refused, the connection as it was.
        assert_eq!(tune_with(&a, lo, &["no-such-cc"]), Tuned::Refused);
        assert_eq!(congestion(&a), before);
    }

    #[test]
    fn only_bbr_paces() {
        assert!(paces("bbr") && paces("bbr3"));
        assert!(!paces("cubic") && !paces("reno") && !paces("dctcp"));
    }

    #[test]
    fn a_switched_connection_runs_unpaced_while_alone_and_the_system_s_control_otherwise() {
        // The "system's" control: one that paces where the kernel lets this process take it,
        // else any other than Reno, which stands in for the unpaced ones here.
        let (a, _b) = pair();
        let lo = a.peer_addr().unwrap().ip();
        let Some(system) = ["bbr", "cubic"].into_iter().find(|cc| tune_with(&a, lo, &[*cc]) == Tuned::Set(cc)) else {
            // Only Reno here: nothing to switch between, and the switch says so.
            assert_eq!(congestion(&a).as_deref(), Some("reno"));
            assert!(PaceSwitch::among(&a, lo, &["reno"]).is_none());
            eprintln!("this kernel lets the test take only Reno: the switch itself is not exercised");
            return;
        };
        let mut sw = PaceSwitch::among(&a, lo, &["no-such-cc", "reno"]).expect("a pacing control on loopback");
        assert_eq!(sw.system(), system);
        assert_eq!(sw.fit(&a, false), Switched::Unchanged, "not alone: already the system's");
        assert_eq!(congestion(&a).as_deref(), Some(system));
        assert_eq!(sw.fit(&a, true), Switched::To("reno"));
        assert_eq!(congestion(&a).as_deref(), Some("reno"));
        assert_eq!(sw.fit(&a, true), Switched::Unchanged);
        assert_eq!(sw.fit(&a, false), Switched::To(system));
        assert_eq!(congestion(&a).as_deref(), Some(system));
        assert_eq!(sw.fit(&a, true), Switched::To("reno"), "the name that worked is tried first");
        // A socket already on an unpaced control, or a peer elsewhere, has nothing to switch.
        assert!(PaceSwitch::among(&a, lo, &["reno"]).is_none());
        let (c, _d) = pair();
        assert!(PaceSwitch::among(&c, IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)), &["reno"]).is_none());
        // No name the kernel takes: refused once, and the socket left as it was from then on.
        assert_eq!(tune_with(&a, lo, &[system]), Tuned::Set(system));
        let mut none = PaceSwitch::among(&a, lo, &["no-such-cc"]).expect("a pacing control on loopback");
        assert_eq!(none.fit(&a, true), Switched::Refused);
        assert_eq!(congestion(&a).as_deref(), Some(system));
        assert_eq!(none.fit(&a, true), Switched::Unchanged);
        assert_eq!(none.fit(&a, false), Switched::Unchanged);
    }
}
