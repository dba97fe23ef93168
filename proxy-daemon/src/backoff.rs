//! The restart history: which attempt a restart is, given how long the last run lasted.
//!
//! The delay of each attempt is the policy's own (`RestartPolicy::delay_before`); this
//! module only counts. It never sleeps, never reads a clock and never touches a process.

use std::time::Duration;

use crate::spec::RestartPolicy;

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
            tokio::time::sleep(policy.delay_before(attempt)).await;
            waited.push((tokio::time::Instant::now() - before).as_secs());
        }
        assert_eq!(waited, [0, 1, 2, 4, 4]);
        assert_eq!((tokio::time::Instant::now() - start).as_secs(), 11);
    }
}
