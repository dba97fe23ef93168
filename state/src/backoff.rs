//! Capped exponential backoff: the waits between the attempts of every retry loop in tether.
//!
//! Restarts of exited proxies, starts that failed, snapshot and pid-file writes, the built-in
//! proxy's config queries and the fleet's etcd sessions all wait on a [`Backoff`], each with
//! its own first wait and cap. This module is arithmetic on [`Duration`]s only: it never reads
//! a clock, never sleeps and has no randomness of its own (a jittered wait takes its random
//! number from the caller), so the loop that waits owns its timer and its tests own time.

use std::time::Duration;

/// The waits of a retry loop: `first`, then twice the wait before, up to `max`.
///
/// Each call of [`next`](Self::next) hands out the wait before the next attempt;
/// [`reset`](Self::reset), after a success, starts the schedule over at `first`.
/// [`delay`](Self::delay) reads any wait of the schedule without advancing it.
///
/// ```
/// use std::time::Duration;
/// use tether_state::Backoff;
///
/// let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(1));
/// let waits: Vec<u128> = (0..5).map(|_| backoff.next().as_millis()).collect();
/// assert_eq!(waits, [250, 500, 1000, 1000, 1000]);
///
/// backoff.reset();
/// assert_eq!(backoff.next(), Duration::from_millis(250));
/// assert_eq!(backoff.delay(3), Duration::from_secs(1));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    /// The waits handed out since the schedule was created or last reset.
    retries: u32,
}

impl Backoff {
    /// A schedule that waits `first`, then doubles each wait, never past `max` (the first
    /// wait included).
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max, retries: 0 }
    }

    /// The wait before retry number `retry` of this schedule, counted from 0: `first` × 2^`retry`,
    /// capped at `max`. Does not advance the schedule.
    pub fn delay(&self, retry: u32) -> Duration {
        const NANOS_PER_SEC: u128 = 1_000_000_000;
        // In nanoseconds, where every product of a `Duration` and a power of two that a
        // `Duration` can hold is exact; a larger one, or one that overflows, is past any cap.
        let doubled = match 1_u128.checked_shl(retry) {
            Some(factor) => self.first.as_nanos().checked_mul(factor),
            None if self.first.is_zero() => Some(0),
            None => None,
        };
        match doubled {
            Some(nanos) if nanos <= self.max.as_nanos() => {
                // At most `max`, so both parts fit.
                let secs = u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX);
                let subsec = u32::try_from(nanos % NANOS_PER_SEC).unwrap_or(0);
                Duration::new(secs, subsec)
            }
            _ => self.max,
        }
    }

    /// The wait before the next attempt; the one after it is twice as long, up to the cap.
    #[allow(clippy::should_implement_trait)] // Not an iterator: the schedule never ends, so no `Option`.
    pub fn next(&mut self) -> Duration {
        let wait = self.delay(self.retries);
        self.retries = self.retries.saturating_add(1);
        wait
    }

    /// Starts the schedule over: the next wait is `first` again.
    pub fn reset(&mut self) {
        self.retries = 0;
    }

    /// How many waits [`next`](Self::next) has handed out since the schedule was created or
    /// last reset: 0 while nothing has failed.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// `delay` spread evenly over ± `spread_per_mille` thousandths of itself (at most 1000),
    /// the point picked by `random`: any number, from whatever randomness the caller has.
    /// Clients that failed together (a fleet of agents that lost the same server) then do not
    /// retry together.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tether_state::Backoff;
    ///
    /// let second = Duration::from_secs(1);
    /// assert_eq!(Backoff::jitter(second, 200, 0), Duration::from_millis(800));
    /// assert_eq!(Backoff::jitter(second, 200, 400), Duration::from_millis(1200));
    /// assert_eq!(Backoff::jitter(second, 200, 401), Duration::from_millis(800));
    /// ```
    pub fn jitter(delay: Duration, spread_per_mille: u32, random: u64) -> Duration {
        let spread = spread_per_mille.min(1000);
        // At most 2 × 1000 + 1, so the remainder fits a `u32`.
        let offset = u32::try_from(random % u64::from(2 * spread + 1)).unwrap_or(0);
        let per_mille = 1000 - spread + offset;
        delay.checked_mul(per_mille).map_or_else(|| (delay / 1000).saturating_mul(per_mille), |scaled| scaled / 1000)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn millis(waits: impl IntoIterator<Item = Duration>) -> Vec<u128> {
        waits.into_iter().map(|wait| wait.as_millis()).collect()
    }

    #[test]
    fn waits_double_from_the_first_up_to_the_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let waits = millis((0..9).map(|_| backoff.next()));
        assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(backoff.retries(), 9);
    }

    #[test]
    fn reset_starts_the_schedule_over() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        assert_eq!(backoff.retries(), 0);
        for _ in 0..4 {
            backoff.next();
        }
        backoff.reset();
        assert_eq!(backoff.retries(), 0);
        assert_eq!(millis([backoff.next(), backoff.next()]), [1000, 2000]);
    }

    #[test]
    fn a_first_wait_over_the_cap_is_the_cap() {
        let mut backoff = Backoff::new(Duration::from_secs(3), Duration::from_secs(2));
        assert_eq!(millis([backoff.next(), backoff.next()]), [2000, 2000]);
    }

    #[test]
    fn delays_far_down_the_schedule_do_not_overflow() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::MAX);
        assert_eq!(backoff.delay(62), Duration::from_secs(1 << 62));
        assert_eq!(backoff.delay(64), Duration::MAX);
        assert_eq!(backoff.delay(u32::MAX), Duration::MAX);
        let never = Backoff::new(Duration::ZERO, Duration::from_secs(1));
        assert_eq!(never.delay(u32::MAX), Duration::ZERO);
        let mut counted = Backoff { retries: u32::MAX, ..backoff };
        assert_eq!(counted.next(), Duration::MAX);
        assert_eq!(counted.retries(), u32::MAX, "the count saturates");
    }

    #[test]
    fn jitter_stays_within_its_spread() {
        let delay = Duration::from_secs(10);
        assert_eq!(Backoff::jitter(delay, 0, 12345), delay);
        assert_eq!(Backoff::jitter(delay, 5000, 0), Duration::ZERO, "the spread is at most the delay itself");
        assert_eq!(Backoff::jitter(Duration::MAX, 200, 400), Duration::MAX, "saturates instead of overflowing");
        let waits: Vec<Duration> = (0..=400).map(|random| Backoff::jitter(delay, 200, random)).collect();
        assert_eq!(waits.iter().min(), Some(&Duration::from_secs(8)));
        assert_eq!(waits.iter().max(), Some(&Duration::from_secs(12)));
    }

    proptest! {
        #[test]
        fn delays_grow_by_doubling_until_the_cap(first_ms in 0_u64..100_000, max_ms in 0_u64..10_000_000, retry in 0_u32..200) {
            let backoff = Backoff::new(Duration::from_millis(first_ms), Duration::from_millis(max_ms));
            let (this, following) = (backoff.delay(retry), backoff.delay(retry + 1));
            prop_assert!(this <= following, "monotonic: {this:?} then {following:?}");
            prop_assert!(following <= backoff.max, "capped: {following:?}");
            prop_assert_eq!(following, (this * 2).min(backoff.max));
        }

        #[test]
        fn next_walks_the_schedule_and_reset_rewinds_it(first_ms in 0_u64..10_000, max_ms in 0_u64..1_000_000, steps in 0_u32..80) {
            let mut backoff = Backoff::new(Duration::from_millis(first_ms), Duration::from_millis(max_ms));
            for retry in 0..steps {
                prop_assert_eq!(backoff.next(), backoff.delay(retry));
            }
            prop_assert_eq!(backoff.retries(), steps);
            backoff.reset();
            prop_assert_eq!(backoff.next(), Duration::from_millis(first_ms.min(max_ms)));
        }

        #[test]
        fn jitter_is_within_the_spread_of_the_delay(delay_ms in 0_u64..1_000_000, spread in 0_u32..=1000, random: u64) {
            let delay = Duration::from_millis(delay_ms);
            let wait = Backoff::jitter(delay, spread, random);
            prop_assert!(wait >= delay * (1000 - spread) / 1000 && wait <= delay * (1000 + spread) / 1000, "{wait:?}");
        }
    }
}
