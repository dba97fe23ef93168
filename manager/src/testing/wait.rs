//! Waits on what the engine publishes, each until a condition holds or a deadline passes.
//!
//! This module only reads a [`ManagerHandle`]: it never drives the engine, and a wait that
//! fails says what it waited for and what it saw last, rather than hanging.

use std::fmt;
use std::time::Duration;

use tether_state::ProxyId;
use tokio::sync::broadcast::error::RecvError;

use crate::backend::ProxyState;
use crate::status::{ManagerHandle, ProxyStatus};

/// A wait that ended before its condition held.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The deadline passed first.
    #[error("timed out after {} waiting until {condition}; last seen: {}", humantime::format_duration(*waited), seen(proxy, last_seen))]
    TimedOut {
        /// What was waited for, as a sentence: `proxy web-proxy is running`.
        condition: String,
        /// The proxy waited on, if the wait was on one.
        proxy: Option<ProxyId>,
        /// How long it waited.
        waited: Duration,
        /// The last statuses seen: of the proxy waited on (none if it was not listed), or of
        /// every proxy.
        last_seen: Vec<ProxyStatus>,
    },
    /// The engine was gone (dropped, closed or killed) first: nothing would change any more.
    #[error("the engine ended before {condition}; last seen: {}", seen(proxy, last_seen))]
    EngineGone {
        /// What was waited for, as a sentence.
        condition: String,
        /// The proxy waited on, if the wait was on one.
        proxy: Option<ProxyId>,
        /// The last statuses seen, as for [`WaitError::TimedOut`].
        last_seen: Vec<ProxyStatus>,
    },
}

/// Waits until `check` returns `Some` for the statuses of every proxy (ordered by id), and
/// returns what it returned. It is asked at once, then after every change the engine
/// publishes.
///
/// `condition` says what is waited for; the error repeats it ("timed out after 10s waiting
/// until {condition}").
///
/// # Errors
///
/// [`WaitError::TimedOut`] when `timeout` passes first, [`WaitError::EngineGone`] when the
/// engine is gone first; both carry every proxy's last status.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use tether_manager::testing::wait_for;
/// use tether_manager::ProxyState;
/// # async fn example(handle: tether_manager::ManagerHandle) -> Result<(), tether_manager::testing::WaitError> {
///
/// // Returns the pids once both proxies run.
/// let pids = wait_for(
///     &handle,
///     "two proxies are running",
///     |statuses| {
///         let running: Vec<u32> = statuses
///             .iter()
///             .filter(|status| status.state == ProxyState::Running)
///             .filter_map(|status| status.figures.pid)
///             .collect();
///         (running.len() == 2).then_some(running)
///     },
///     Duration::from_secs(10),
/// )
/// .await?;
/// # Ok(())
/// # }
/// ```
pub async fn wait_for<T>(
    handle: &ManagerHandle,
    condition: &str,
    mut check: impl FnMut(&[ProxyStatus]) -> Option<T>,
    timeout: Duration,
) -> Result<T, WaitError> {
    let waited = wait(handle, || check(&handle.status()), timeout).await;
    waited.map_err(|end| end.into_error(condition.to_owned(), None, handle.status()))
}

/// Waits until proxy `id` is listed and `check` holds for its status, and returns that
/// status.
///
/// `condition` completes the sentence "waiting until proxy `id` …": `"has restarted"`.
///
/// # Errors
///
/// As [`wait_for`], with the last status of `id` only (none if it was not listed).
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn wait_for_proxy(
    handle: &ManagerHandle,
    id: &ProxyId,
    condition: &str,
    mut check: impl FnMut(&ProxyStatus) -> bool,
    timeout: Duration,
) -> Result<ProxyStatus, WaitError> {
    let waited = wait(handle, || handle.proxy(id).filter(|status| check(status)), timeout).await;
    waited.map_err(|end| {
        let condition = format!("proxy {id} {condition}");
        end.into_error(condition, Some(id.clone()), handle.proxy(id).into_iter().collect())
    })
}

/// Waits until proxy `id` is listed in `state`, and returns its status.
///
/// # Errors
///
/// As [`wait_for_proxy`]: "timed out after 10s waiting until proxy web-proxy is running;
/// last seen: web-proxy failed (error: cannot start proxy web-proxy: …)".
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn wait_until_state(
    handle: &ManagerHandle,
    id: &ProxyId,
    state: ProxyState,
    timeout: Duration,
) -> Result<ProxyStatus, WaitError> {
    wait_for_proxy(handle, id, &format!("is {state}"), |status| status.state == state, timeout).await
}

/// Waits until proxy `id` is no longer listed: it is not wanted and nothing of it runs.
///
/// # Errors
///
/// As [`wait_for_proxy`].
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn wait_until_gone(handle: &ManagerHandle, id: &ProxyId, timeout: Duration) -> Result<(), WaitError> {
    let waited = wait(handle, || handle.proxy(id).is_none().then_some(()), timeout).await;
    waited.map_err(|end| {
        let condition = format!("proxy {id} is gone");
        end.into_error(condition, Some(id.clone()), handle.proxy(id).into_iter().collect())
    })
}

/// Why a wait ended without its condition.
enum End {
    TimedOut(Duration),
    EngineGone,
}

impl End {
    fn into_error(self, condition: String, proxy: Option<ProxyId>, last_seen: Vec<ProxyStatus>) -> WaitError {
        match self {
            Self::TimedOut(waited) => WaitError::TimedOut { condition, proxy, waited, last_seen },
            Self::EngineGone => WaitError::EngineGone { condition, proxy, last_seen },
        }
    }
}

/// Asks `check` now and after every published change, until it answers, `timeout` passes or
/// the engine is gone.
async fn wait<T>(handle: &ManagerHandle, mut check: impl FnMut() -> Option<T>, timeout: Duration) -> Result<T, End> {
    // Subscribed before the first look, so that no change between the two is missed.
    let mut events = handle.subscribe();
    let waited = tokio::time::timeout(timeout, async {
        let mut gone = std::pin::pin!(handle.engine_gone());
        loop {
            if let Some(found) = check() {
                return Ok(found);
            }
            tokio::select! {
                received = events.recv() => match received {
                    // Fallen behind: the statuses themselves are current, look again.
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    // The handle holds the sender: only a closed engine ends the stream.
                    Err(RecvError::Closed) => return Err(End::EngineGone),
                },
                () = &mut gone => return check().ok_or(End::EngineGone),
            }
        }
    });
    waited.await.unwrap_or(Err(End::TimedOut(timeout)))
}

fn seen<'a>(proxy: &'a Option<ProxyId>, statuses: &'a [ProxyStatus]) -> Seen<'a> {
    Seen { proxy: proxy.as_ref(), statuses }
}

/// The last statuses of a wait's error, one proxy after another.
struct Seen<'a> {
    proxy: Option<&'a ProxyId>,
    statuses: &'a [ProxyStatus],
}

impl fmt::Display for Seen<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.statuses.is_empty() {
            return match self.proxy {
                Some(id) => write!(f, "{id} is not listed"),
                None => f.write_str("no proxy is listed"),
            };
        }
        for (index, status) in self.statuses.iter().enumerate() {
            if index > 0 {
                f.write_str(", ")?;
            }
            describe(f, status)?;
        }
        Ok(())
    }
}

/// One status on one line: `web-proxy backoff (2 restarts, last exit: exit code 3)`.
fn describe(f: &mut fmt::Formatter<'_>, status: &ProxyStatus) -> fmt::Result {
    write!(f, "{} {}", status.id, status.state)?;
    let mut details = Vec::new();
    if let Some(pid) = status.figures.pid {
        details.push(format!("pid {pid}"));
    }
    if status.figures.restarts > 0 {
        details.push(format!("{} restarts", status.figures.restarts));
    }
    if let Some(exit) = status.figures.last_exit {
        details.push(format!("last exit: {exit}"));
    }
    if let Some(error) = &status.figures.error {
        details.push(format!("error: {error}"));
    }
    if !details.is_empty() {
        write!(f, " ({})", details.join(", "))?;
    }
    Ok(())
}
