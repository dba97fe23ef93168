//! The restart schedule, as pure functions of the policy and the history.
//!
//! This module owns the arithmetic of SPEC.md's restart policy. It never sleeps, never
//! reads a clock and never touches a process: callers pass in how long the last run
//! lasted and get back how long to wait.

use std::time::Duration;

use crate::spec::RestartPolicy;

/// The first backoff step after the free attempts.
const BASE_DELAY: Duration = Duration::from_secs(1);

/// The delay before restart number `attempt` (1-based) since the last reset.
pub(crate) fn delay(policy: &RestartPolicy, attempt: u32) -> Duration {
    if attempt <= policy.free_attempts {
        return Duration::ZERO;
    }
    let exponent = attempt - policy.free_attempts - 1;
    // 2^31 s is far past any sensible cap; saturate instead of overflowing.
    let factor = 1u32.checked_shl(exponent.min(31)).unwrap_or(u32::MAX);
    BASE_DELAY.saturating_mul(factor).min(policy.max_delay)
}

/// The attempt number of the restart that follows a run of `run`, given the attempt
/// number of the restart that began it (0 for the first start).
pub(crate) fn next_attempt(policy: &RestartPolicy, previous_attempt: u32, run: Duration) -> u32 {
    if run >= policy.healthy_after { 1 } else { previous_attempt.saturating_add(1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(free_attempts: u32, max_delay_secs: u64) -> RestartPolicy {
        RestartPolicy {
            free_attempts,
            max_delay: Duration::from_secs(max_delay_secs),
            healthy_after: Duration::from_secs(10),
        }
    }

    #[track_caller]
    fn check_schedule(policy: RestartPolicy, expected_secs: &[u64]) {
        let schedule: Vec<u64> =
            (1..=expected_secs.len() as u32).map(|attempt| delay(&policy, attempt).as_secs()).collect();
        assert_eq!(schedule, expected_secs, "policy={policy:?}");
    }

    #[test]
    fn free_attempts_restart_at_once_then_backoff_doubles() {
        check_schedule(policy(3, 60), &[0, 0, 0, 1, 2, 4, 8, 16, 32, 60, 60]);
    }

    #[test]
    fn backoff_starts_at_once_without_free_attempts() {
        check_schedule(policy(0, 60), &[1, 2, 4, 8]);
    }

    #[test]
    fn backoff_is_capped_at_max_delay() {
        check_schedule(policy(1, 5), &[0, 1, 2, 4, 5, 5]);
    }

    #[test]
    fn huge_attempt_numbers_saturate_at_the_cap() {
        assert_eq!(delay(&policy(3, 60), u32::MAX), Duration::from_secs(60));
        assert_eq!(delay(&policy(0, u64::MAX / 2), 200), Duration::from_secs(1 << 31));
    }

    #[test]
    fn a_healthy_run_resets_the_count() {
        let policy = policy(3, 60);
        assert_eq!(next_attempt(&policy, 7, Duration::from_secs(10)), 1);
        assert_eq!(next_attempt(&policy, 7, Duration::from_millis(9_999)), 8);
        assert_eq!(next_attempt(&policy, 0, Duration::ZERO), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_waits_follow_the_schedule_in_paused_time() {
        let policy = policy(1, 4);
        let start = tokio::time::Instant::now();
        let mut attempt = 0;
        let mut waited = Vec::new();
        for _ in 0..5 {
            attempt = next_attempt(&policy, attempt, Duration::from_millis(5));
            let before = tokio::time::Instant::now();
            tokio::time::sleep(delay(&policy, attempt)).await;
            waited.push((tokio::time::Instant::now() - before).as_secs());
        }
        assert_eq!(waited, [0, 1, 2, 4, 4]);
        assert_eq!((tokio::time::Instant::now() - start).as_secs(), 11);
    }
}
