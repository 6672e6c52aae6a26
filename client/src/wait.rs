//! Whether a call that may poll for its answer ([`crate::polled`]) does, or parks: chosen by what
//! each way has recently taken for calls of its size in this process.
//!
//! Polling pays only while the machine has a core to spare for it. On a quiet machine a polled
//! 1 MiB load over loopback TCP ran 25–70% faster than a parked one and a 64 KiB load 30–90%
//! faster; with one busy process beside it on the same 2 cores (an engine's own threads, a build),
//! the spinning thread takes the core the server needs to produce the answer, and polled loads ran
//! 15–45% slower than parked ones. No signal of the operating system told the two apart (CPU
//! pressure stalls 10–47% of every 20 ms on the quiet machine too, from the poller itself), so
//! the process measures what it cares about: the time from a call's request to its answer, per
//! size class ([`WaitChooser`]). Calls take one way; one call in [`EXPLORE_EVERY`] tries the other,
//! compared with the way taken as it runs at that moment, and when the other has been faster over
//! its recent trials it becomes the way taken: the choice follows the machine as it gets busy or
//! quiet.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a call waits for its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Non-blocking reads between yields, on the caller's core.
    Poll,
    /// Parked until the I/O driver wakes the task.
    Park,
}

impl Wait {
    fn other(self) -> Wait {
        match self {
            Wait::Poll => Wait::Park,
            Wait::Park => Wait::Poll,
        }
    }
}

/// Size classes: calls are compared with calls of the same power of two of their poll budget in
/// µs (which grows with the bytes they move: a same-node call's poll budget, a TCP call's expected
/// wait for its whole answer).
const CLASSES: usize = 16;
/// One call in this many takes the other way, to compare it with the way taken.
pub(crate) const EXPLORE_EVERY: u32 = 16;
/// Weight of a new call in the estimate of the way taken (every call but the trials: a slow
/// weight, so that one slow call moves it little).
const WEIGHT_TAKEN: f64 = 0.125;
/// Weight of a new trial in the running comparison (one call in [`EXPLORE_EVERY`]: a faster one).
const WEIGHT_TRIAL: f64 = 0.25;
/// A call's time counts for at most this factor (`ln 4`) above or below the estimate it joins or
/// is compared with: one call preempted for milliseconds does not flip the choice alone.
const LN_CLAMP: f64 = std::f64::consts::LN_2 * 2.0;
/// The other way becomes the way taken once its trials ran this much faster (5%, as a log
/// ratio): two ways about as fast don't take turns on noise.
const MARGIN: f64 = 0.05;

/// One size class: the way its calls take, the running estimate of their time (a running mean of
/// `ln µs`), how the other way compared when tried (a running mean of `ln(other's µs) - estimate
/// then`: below zero, it was faster), and its calls.
///
/// Each trial of the other way is compared with the estimate of the way taken *at that moment*,
/// not with a long-run figure of its own, so a drift that slows or speeds both alike (a bigger
/// copy into the caller's buffer, a colder cache, another phase of the caller's work) cancels out.
#[derive(Debug, Clone, Copy)]
struct Class {
    taken: Wait,
    ln_us: Option<f64>,
    other_vs_taken: f64,
    calls: u32,
}

const FRESH: Class = Class { taken: Wait::Poll, ln_us: None, other_vs_taken: 0.0, calls: 0 };

/// The choice between polling and parking, as plain data: `choose` for a call, `record` of what
/// it took once answered.
#[derive(Debug)]
pub(crate) struct WaitChooser {
    classes: [Class; CLASSES],
}

impl WaitChooser {
    pub(crate) const fn new() -> Self {
        WaitChooser { classes: [FRESH; CLASSES] }
    }

    /// The size class of a call that may poll for `budget`.
    pub(crate) fn class(budget: Duration) -> usize {
        let us = (budget.as_micros() as u64).max(1);
        ((63 - us.leading_zeros()) as usize).min(CLASSES - 1)
    }

    /// How the next call of `class` waits: the way taken (polling, at first), and every
    /// [`EXPLORE_EVERY`]th call, once the way taken has a time, the other.
    pub(crate) fn choose(&mut self, class: usize) -> Wait {
        let c = &mut self.classes[class];
        if c.ln_us.is_none() {
            return c.taken;
        }
        c.calls = c.calls.wrapping_add(1);
        if c.calls.is_multiple_of(EXPLORE_EVERY) {
            c.taken.other()
        } else {
            c.taken
        }
    }

    /// A call of `class` that waited `wait` took `took` from its request to its answer. The
    /// other way, once its recent trials ran more than [`MARGIN`] faster than the way taken,
    /// becomes the way taken.
    pub(crate) fn record(&mut self, class: usize, wait: Wait, took: Duration) {
        let c = &mut self.classes[class];
        // At least 1 ns, so that the logarithm is finite.
        let ln_us = (took.as_secs_f64() * 1e6).max(1e-3).ln();
        let Some(est) = c.ln_us else {
            if wait == c.taken {
                c.ln_us = Some(ln_us);
            }
            return;
        };
        let off = (ln_us - est).clamp(-LN_CLAMP, LN_CLAMP);
        if wait == c.taken {
            c.ln_us = Some(est + WEIGHT_TAKEN * off);
            return;
        }
        c.other_vs_taken += WEIGHT_TRIAL * (off - c.other_vs_taken);
        if c.other_vs_taken < -MARGIN {
            // The new way's estimate is the old one's plus how the trials compared, and seen from
            // the new way, the old one is as much slower.
            let ln_us = Some(est + c.other_vs_taken);
            *c = Class { taken: wait, ln_us, other_vs_taken: -c.other_vs_taken, calls: 0 };
        }
    }

    #[cfg(test)]
    fn taken(&self, class: usize) -> Wait {
        self.classes[class].taken
    }
}

/// A process's choices for one kind of connection (TCP, same-node), shared by its calls; or, in
/// tests, one fixed way.
pub(crate) struct Waits {
    chooser: Mutex<WaitChooser>,
    fixed: Option<Wait>,
}

/// TCP data-plane calls' choices ([`crate::polled::PolledRead`]).
pub(crate) static TCP_WAITS: Waits = Waits::new();
/// TCP stores' choices, apart from loads' (an answer that comes after the bytes went out, not
/// with them: [`crate::polled::PolledRead::arm_store`]).
pub(crate) static TCP_STORE_WAITS: Waits = Waits::new();
/// Same-node calls' choices ([`crate::polled::PolledSocket`]).
pub(crate) static SAMENODE_WAITS: Waits = Waits::new();

/// Every process-wide chooser's lock, held by a thread about to fork ([`crate::fork`]), in one
/// order.
pub(crate) fn lock_all() -> Vec<MutexGuard<'static, WaitChooser>> {
    [&TCP_WAITS, &TCP_STORE_WAITS, &SAMENODE_WAITS].into_iter().map(Waits::lock).collect()
}

impl Waits {
    pub(crate) const fn new() -> Self {
        Waits { chooser: Mutex::new(WaitChooser::new()), fixed: None }
    }

    /// Always `wait`, learning nothing (tests of the polling itself).
    #[cfg(test)]
    pub(crate) const fn fixed(wait: Wait) -> Self {
        Waits { chooser: Mutex::new(WaitChooser::new()), fixed: Some(wait) }
    }

    fn lock(&self) -> MutexGuard<'_, WaitChooser> {
        // A panic elsewhere while holding it leaves plain numbers behind: still usable.
        self.chooser.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with<T>(&self, f: impl FnOnce(&mut WaitChooser) -> T) -> T {
        f(&mut self.lock())
    }

    /// Chooses for a call, starting now, that may poll for `budget`: `None` for a zero budget
    /// (it parks, and there is nothing to learn).
    pub(crate) fn start(&'static self, budget: Duration) -> Option<WaitTicket> {
        if budget.is_zero() {
            return None;
        }
        let class = WaitChooser::class(budget);
        let wait = self.fixed.unwrap_or_else(|| self.with(|c| c.choose(class)));
        Some(WaitTicket { waits: self, class, wait, started: Instant::now() })
    }
}

/// One call's choice, reported with the time it took once the call is answered (a call that
/// fails reports nothing).
pub(crate) struct WaitTicket {
    waits: &'static Waits,
    class: usize,
    wait: Wait,
    started: Instant,
}

impl WaitTicket {
    /// Whether the call polls.
    pub(crate) fn polls(&self) -> bool {
        self.wait == Wait::Poll
    }

    /// The call's answer is in: its time joins its way's estimate.
    pub(crate) fn answered(self) {
        if self.waits.fixed.is_none() {
            let took = self.started.elapsed();
            self.waits.with(|c| c.record(self.class, self.wait, took));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn calls_are_classed_by_the_power_of_two_of_their_budget() {
        assert_eq!(WaitChooser::class(Duration::ZERO), 0);
        assert_eq!(WaitChooser::class(Duration::from_micros(1)), 0);
        assert_eq!(WaitChooser::class(Duration::from_micros(50)), 5);
        assert_eq!(WaitChooser::class(Duration::from_micros(63)), 5);
        assert_eq!(WaitChooser::class(Duration::from_micros(64)), 6);
        assert_eq!(WaitChooser::class(crate::polled::poll_budget(64 << 10)), 6, "64 KiB: 50 + 33 µs");
        assert_eq!(WaitChooser::class(crate::polled::poll_budget(1 << 20)), 9, "1 MiB: 50 + 524 µs");
        assert_eq!(WaitChooser::class(Duration::from_secs(3600)), CLASSES - 1);
    }

    #[test]
    fn the_way_taken_is_timed_first_and_the_other_tried_every_so_often() {
        let mut c = WaitChooser::new();
        assert_eq!(c.choose(3), Wait::Poll, "nothing timed: poll");
        assert_eq!(c.choose(3), Wait::Poll, "until a polled call is answered");
        c.record(3, Wait::Park, MS);
        assert_eq!(c.choose(3), Wait::Poll, "a parked call's time before any polled one's says nothing");
        c.record(3, Wait::Poll, MS);
        let ways: Vec<Wait> = (0..2 * EXPLORE_EVERY).map(|_| c.choose(3)).collect();
        assert_eq!(ways.iter().filter(|w| **w == Wait::Park).count(), 2, "one call in {EXPLORE_EVERY} parks");
        assert_eq!(ways[EXPLORE_EVERY as usize - 1], Wait::Park);
        assert_eq!(c.choose(4), Wait::Poll, "another class learns on its own");
    }

    #[test]
    fn a_faster_other_way_becomes_the_way_taken_and_back_when_the_machine_changes() {
        let mut c = WaitChooser::new();
        c.record(0, Wait::Poll, MS);
        c.record(0, Wait::Park, 2 * MS);
        assert_eq!(c.taken(0), Wait::Poll, "parking was slower: polling stays");
        // The machine gets busy: polled calls take 5 ms now, parked ones 2.
        let mut calls = 0;
        while c.taken(0) == Wait::Poll {
            let w = c.choose(0);
            c.record(0, w, if w == Wait::Poll { 5 * MS } else { 2 * MS });
            calls += 1;
            assert!(calls <= 2 * EXPLORE_EVERY, "still polling after {calls} calls");
        }
        // Quiet again: polled calls take 1 ms, parked ones still 2.
        let mut calls = 0;
        while c.taken(0) == Wait::Park {
            let w = c.choose(0);
            c.record(0, w, if w == Wait::Poll { MS } else { 2 * MS });
            calls += 1;
            assert!(calls <= 4 * EXPLORE_EVERY, "still parking after {calls} calls");
        }
    }

    #[test]
    fn a_drift_both_ways_share_does_not_flip_the_choice() {
        let mut c = WaitChooser::new();
        c.record(0, Wait::Poll, MS);
        // The caller's calls get slower and faster in turns (another phase of its work), parking
        // always 30% slower than polling at the same moment.
        for i in 0..40 * EXPLORE_EVERY {
            let phase = if (i / 50) % 2 == 0 { 1.0 } else { 2.5 };
            let w = c.choose(0);
            let us = if w == Wait::Poll { 1_000.0 * phase } else { 1_300.0 * phase };
            c.record(0, w, Duration::from_secs_f64(us / 1e6));
            assert_eq!(c.taken(0), Wait::Poll, "call {i}");
        }
    }

    #[test]
    fn one_outlier_moves_the_estimate_and_the_comparison_by_a_bounded_step() {
        let mut c = WaitChooser::new();
        c.record(0, Wait::Poll, 2 * MS);
        c.record(0, Wait::Poll, Duration::from_secs(1));
        let est = c.classes[0].ln_us.unwrap().exp();
        assert!((est - 2_000.0 * 4f64.powf(WEIGHT_TAKEN)).abs() < 1e-6, "a 1 s call counts as 4x: {est}");
        c.record(0, Wait::Poll, Duration::ZERO);
        let back = c.classes[0].ln_us.unwrap().exp();
        assert!((back - est / 4f64.powf(WEIGHT_TAKEN)).abs() < 1e-6, "a 0 s call as a quarter: {back}");
        c.record(0, Wait::Park, Duration::ZERO);
        let step = c.classes[0];
        assert_eq!(step.taken, Wait::Park, "a far faster trial flips the way at once");
        assert!((step.other_vs_taken - WEIGHT_TRIAL * LN_CLAMP).abs() < 1e-9, "but counts as 4x at most: {step:?}");
        let flipped = step.ln_us.unwrap().exp();
        assert!(
            (flipped - back / 4f64.powf(WEIGHT_TRIAL)).abs() < 1e-6,
            "parking estimated from the comparison: {flipped}"
        );
    }

    #[test]
    fn tickets_report_what_their_call_took_and_a_zero_budget_chooses_nothing() {
        static W: Waits = Waits::new();
        assert!(W.start(Duration::ZERO).is_none());
        let class = WaitChooser::class(Duration::from_micros(100));
        // A call that fails drops its ticket unanswered.
        assert!(W.start(Duration::from_micros(100)).unwrap().polls(), "the first call of a class polls");
        assert!(W.with(|c| c.classes[class].ln_us).is_none(), "a call that failed reports nothing");
        let t = W.start(Duration::from_micros(100)).unwrap();
        std::thread::sleep(MS);
        t.answered();
        let est = W.with(|c| c.classes[class].ln_us).unwrap().exp();
        assert!(est >= 1_000.0, "the sleep is in it: {est} µs");
        static FIXED: Waits = Waits::fixed(Wait::Poll);
        for _ in 0..3 {
            let t = FIXED.start(MS).unwrap();
            assert!(t.polls());
            t.answered();
        }
        assert!(FIXED.with(|c| c.classes[WaitChooser::class(MS)].ln_us).is_none(), "a fixed way learns nothing");
    }
}
