//! The actions the engine runs: launching one per proxy in its own task, applying each
//! outcome when it is done, and trying failed starts again on the restart backoff.
//!
//! This module never runs two actions on one proxy, and never waits for an action inside
//! the engine's loop: outcomes arrive through the action set.

use std::cmp::Reverse;
use std::sync::Arc;

use tether_state::{ManagedProxy, ProcessFigures, ProxyId, ReloadOutcome, RestartPolicy, UpdateStrategy};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Manager, Outcome, encoded_service};
use crate::backend::{BackendError, BackendState, BackendStatus, ProxyBackend, ProxyHandle, ProxyState};
use crate::plan::{Action, Observed};
use crate::status::{ActionKind, Request, RequestError};

impl Manager {
    pub(super) fn launch(&mut self, id: &ProxyId, action: Action) {
        let wanted = self.desired.get(id).map(|d| d.proxy.clone());
        let wanted_revision = self.desired.get(id).map(|d| d.revision);
        let Some(slot) = self.slots.get_mut(id) else { return };
        let installed = slot.installed.as_ref().map(|installed| (installed.handle.clone(), installed.generation));
        let handle = installed.as_ref().map(|(handle, _)| handle.clone());
        slot.busy = Some(action);
        slot.launched_for = wanted.clone();
        slot.launched_revision = wanted_revision;
        slot.old_serves = false;
        if std::mem::take(&mut slot.waiting) {
            slot.error = None;
        }
        // An overlapping update, or a hot restart by the proxy itself, publishes its new
        // instance while the old one serves. Only a generation (its status lists the
        // proxy's generations) can hand over by itself: an instance started otherwise (before
        // `update = "epoch"` was set, or by a backend without generations) is restarted.
        let hands_over = slot.installed.as_ref().is_some_and(|i| !i.status().generations.is_empty());
        let overlap = match (action, &wanted, &installed) {
            (Action::Restart, Some(proxy), Some((_, generation)))
                if proxy.spec().update.strategy == UpdateStrategy::Overlap
                    || (proxy.spec().update.strategy == UpdateStrategy::Epoch && hands_over) =>
            {
                let (progress, next) = watch::channel(None);
                let mut changes = next.clone();
                let notify = self.status_tx.clone();
                let (watched, generation) = (id.clone(), *generation);
                let watcher = self.background.spawn(async move {
                    while changes.changed().await.is_ok() {
                        if notify.send((watched.clone(), generation)).is_err() {
                            break;
                        }
                    }
                });
                slot.overlap = Some(Box::new((next, watcher)));
                let superseded = CancellationToken::new();
                if proxy.spec().update.strategy == UpdateStrategy::Epoch {
                    slot.superseded = Some(superseded.clone());
                }
                Some((progress, superseded))
            }
            _ => None,
        };
        let backend = self.backend.clone();
        let shutting_down = self.shutting_down.clone();
        let task = async move {
            match (action, wanted, handle) {
                (Action::Start, Some(proxy), _) => start(&*backend, proxy).await,
                (Action::Restart, Some(proxy), Some(old)) => match overlap {
                    Some((progress, superseded)) if proxy.spec().update.strategy == UpdateStrategy::Epoch => {
                        epoch_update(&*backend, &*old, proxy, progress, shutting_down, superseded).await
                    }
                    Some((progress, _)) => overlap_update(&*backend, &*old, proxy, progress, shutting_down).await,
                    None => {
                        // Created before the stop: what the new handle holds (its
                        // listeners) stays open in between.
                        let new = backend.create(proxy.clone());
                        match old.stop().await {
                            Ok(()) => start_created(new, proxy).await,
                            Err(error) => Outcome::StopFailed { error },
                        }
                    }
                },
                (Action::Restart, Some(proxy), None) => start(&*backend, proxy).await,
                (Action::Update, Some(proxy), Some(handle)) => match handle.update(proxy.clone()).await {
                    Ok(()) => Outcome::Updated { proxy },
                    Err(error) => Outcome::UpdateFailed { error },
                },
                (_, _, Some(handle)) => match handle.stop().await {
                    Ok(()) => Outcome::Stopped,
                    Err(error) => Outcome::StopFailed { error },
                },
                (_, _, None) => Outcome::Stopped,
            }
        };
        let span = tracing::info_span!("proxy", proxy = %id, action = ?action);
        let abort = self.actions.spawn(task.instrument(span));
        self.action_ids.insert(abort.id(), id.clone());
        let mut board = self.published.lock();
        board.stats.actions += 1;
        board.stats.in_flight = self.actions.len();
        drop(board);
        self.publish(id);
    }

    pub(super) fn on_done(&mut self, done: Result<(tokio::task::Id, Outcome), JoinError>) {
        let (task, outcome) = match done {
            Ok((task, outcome)) => (task, Ok(outcome)),
            Err(join) => (join.id(), Err(join)),
        };
        let Some(id) = self.action_ids.remove(&task) else { return };
        if !self.dependents.is_empty() {
            // Read before the outcome changes what it runs: what it depends on may stop once
            // it is down.
            let dependencies = self.dependencies_of(&id);
            self.wake(dependencies);
        }
        let Some(slot) = self.slots.get_mut(&id) else { return };
        let action = slot.busy.take();
        if let Some((_, watcher)) = slot.overlap.take().map(|overlap| *overlap) {
            watcher.abort();
        }
        slot.superseded = None;
        let wanted = slot.launched_for.take();
        let wanted_revision = slot.launched_revision.take();
        let mut failed = None;
        let succeeded = matches!(outcome, Ok(Outcome::Started { .. } | Outcome::Stopped | Outcome::Updated { .. }));
        if let Some(kind) = action.and_then(action_kind) {
            *self.published.lock().stats.actions_by_kind.entry((kind, succeeded)).or_default() += 1;
        }
        match outcome {
            Ok(Outcome::Started { proxy, handle }) => {
                // The backend tells of the start with what it knows (the process backend: the
                // pid and the program); one line per start at the default level.
                tracing::debug!(proxy = %id, "proxy started");
                slot.observed = Observed::Running { applied: proxy.clone() };
                slot.error = None;
                slot.start_failures = 0;
                slot.retry_at = None;
                // A restart asked by the operator keeps the count; any other start is new.
                slot.restarts_base = slot.requested.as_deref().map_or(0, |(_, base)| *base);
                slot.applied_revision = wanted_revision;
                self.uninstall(&id);
                self.install(&id, handle.into(), encoded_service(&proxy), Some(proxy.token().fingerprint()));
            }
            Ok(Outcome::StartFailed { error }) => {
                let had_process = slot.installed.is_some() && action == Some(Action::Restart);
                // A restart whose start failed has already stopped the old process.
                // The start is tried again on the restart backoff: a descriptor, memory or
                // the program itself may be back by then.
                slot.start_failures = slot.start_failures.saturating_add(1);
                let delay = wanted.as_ref().map_or(RestartPolicy::MIN_RETRY_DELAY, |proxy| {
                    proxy.spec().restart.delay_after_failed_start(slot.start_failures)
                });
                let at = Instant::now() + delay;
                slot.retry_at = Some(at);
                self.retries.push(Reverse((at, id.clone())));
                tracing::warn!(
                    proxy = %id,
                    error = %crate::error_chain(&error),
                    attempt = slot.start_failures,
                    backoff_ms = delay.as_millis() as u64,
                    "start failed; retrying"
                );
                slot.observed = Observed::Failed { wanted, has_process: false };
                failed = Some(error);
                if had_process || slot.installed.is_some() {
                    self.uninstall(&id);
                }
            }
            Ok(Outcome::Stopped) => {
                tracing::info!(proxy = %id, "proxy stopped");
                slot.observed = Observed::Idle;
                slot.error = None;
                self.uninstall(&id);
            }
            Ok(Outcome::StopFailed { error }) => {
                slot.observed = Observed::Failed { wanted, has_process: true };
                failed = Some(error);
            }
            Ok(Outcome::Updated { proxy }) => {
                tracing::info!(proxy = %id, "change applied in place");
                slot.observed = Observed::Running { applied: proxy.clone() };
                slot.error = None;
                slot.applied_revision = wanted_revision;
                if let Some(installed) = &mut slot.installed {
                    installed.service = encoded_service(&proxy);
                    installed.token = Some(proxy.token().fingerprint());
                }
                self.send_record(&id);
            }
            Ok(Outcome::UpdateFailed { error }) => {
                slot.observed = Observed::Failed { wanted, has_process: true };
                failed = Some(error);
            }
            Ok(Outcome::OverlapFailed { reason }) => {
                // Not tried again until the next change (or `tether restart`): a new instance
                // that cannot get ready would otherwise be started every `update_timeout`.
                tracing::warn!(proxy = %id, %reason, "update beside the old instance abandoned; the old instance serves on");
                slot.observed = Observed::Failed { wanted, has_process: true };
                slot.old_serves = true;
                slot.error = Some(reason);
                self.published.lock().stats.failures += 1;
            }
            Err(join) => {
                // In tests, a panic in an action is most often a mock's unmet expectation:
                // raised again here, it fails the test instead of leaving it waiting for a
                // state that never comes. An agent marks the proxy failed and goes on.
                #[cfg(any(test, feature = "testing"))]
                if join.is_panic() {
                    std::panic::resume_unwind(join.into_panic());
                }
                let has_process = slot.installed.is_some();
                slot.observed = Observed::Failed { wanted, has_process };
                slot.error = Some(format!("the {action:?} action ended abnormally: {join}").to_lowercase());
                self.published.lock().stats.failures += 1;
            }
        }
        if let Some(error) = failed {
            let message = crate::error_chain(&error);
            if !matches!(error, BackendError::Start { .. }) {
                tracing::warn!(proxy = %id, error = %message, "action failed; retried on the next change");
            }
            if let Some(slot) = self.slots.get_mut(&id) {
                slot.error = Some(message);
            }
            self.published.lock().stats.failures += 1;
        }
        if let Some(slot) = self.slots.get_mut(&id) {
            if let Some((done, _)) = slot.requested.take().map(|requested| *requested) {
                let answer = match (&slot.observed, &slot.error) {
                    (Observed::Running { .. }, None) => Ok(()),
                    (_, error) => Err(RequestError::Failed {
                        id: id.clone(),
                        reason: error.clone().unwrap_or_else(|| "it was stopped meanwhile".to_owned()),
                    }),
                };
                let _caller_gone = done.send(answer);
            }
        }
        self.publish(&id);
        // Level-triggered: plan the proxy again against what is wanted now, and those
        // ordered with it: its dependents may start, what it depends on may stop.
        self.consider(&id);
        self.wake_around(&id);
        self.plan_woken();
        while self.actions.len() < self.config.max_concurrent_actions.max(1) && !self.closing {
            let Some(next) = self.backlog.pop_front() else { break };
            self.in_backlog.remove(&next);
            self.consider(&next);
        }
        let mut board = self.published.lock();
        board.stats.in_flight = self.actions.len();
        board.stats.queued = self.backlog.len();
    }

    /// Carries out a handle's request.
    pub(super) fn on_request(&mut self, request: Request) {
        match request {
            Request::Restart { id, done } => {
                if let Err(refused) = self.restart(&id) {
                    let _caller_gone = done.send(Err(refused));
                    return;
                }
                let restarts = self.published.lock().proxies.get(&id).map_or(0, |status| status.figures.restarts);
                if let Some(slot) = self.slots.get_mut(&id) {
                    slot.requested = Some(Box::new((done, restarts)));
                }
            }
            Request::Reload { id, done } => self.reload(id, done),
            Request::Hold { id, hold, done } => {
                if !self.desired.contains_key(&id) {
                    let _caller_gone = done.send(Err(RequestError::NotFound(id)));
                    return;
                }
                let changed = if hold { self.held.insert(id.clone()) } else { self.held.remove(&id) };
                if changed {
                    tracing::info!(proxy = %id, hold, "held down by the operator, or released");
                    if let Some(slot) = self.slots.get_mut(&id) {
                        // Released: started at once, whatever backoff a failed start was in.
                        slot.start_failures = 0;
                        slot.retry_at = None;
                    }
                    self.consider(&id);
                    // What depends on it stops first, or may start again.
                    self.wake_around(&id);
                    self.plan_woken();
                    self.publish(&id);
                }
                let _caller_gone = done.send(Ok(()));
            }
        }
    }

    /// Reloads `id` in place through its installed handle, in a task of its own that
    /// answers `done`: a reload changes no process the engine tracks, so it is no action,
    /// and it may run beside one (the backend runs one proxy's reloads one at a time).
    fn reload(&mut self, id: ProxyId, done: oneshot::Sender<Result<ReloadOutcome, RequestError>>) {
        let refused = if self.closing {
            Some(RequestError::Gone)
        } else if !self.desired.contains_key(&id) {
            Some(RequestError::NotFound(id.clone()))
        } else if self.desired.get(&id).is_some_and(|d| d.proxy.spec().reload.is_none()) {
            Some(RequestError::NoReload(id.clone()))
        } else {
            None
        };
        if let Some(refused) = refused {
            let _caller_gone = done.send(Err(refused));
            return;
        }
        let installed = self.slots.get(&id).and_then(|slot| slot.installed.as_ref()).map(|i| Arc::clone(&i.handle));
        let shown = self.published.lock().proxies.get(&id).map_or(ProxyState::Pending, |status| status.state);
        let Some(handle) = installed.filter(|_| shown == ProxyState::Running) else {
            let _caller_gone = done.send(Err(RequestError::NotRunning { id, state: shown }));
            return;
        };
        tracing::info!(proxy = %id, "reload asked");
        self.background.spawn(async move {
            // A handle whose spec lost its `reload` since says so: no reload table.
            let answer = handle.reload().await.ok_or(RequestError::NoReload(id));
            let _caller_gone = done.send(answer);
        });
    }

    /// Launches a restart of `id` asked by the operator: stop and start of a process that
    /// runs, a start at once of one that does not (a failed start skips its backoff).
    fn restart(&mut self, id: &ProxyId) -> Result<(), RequestError> {
        if self.closing {
            return Err(RequestError::Gone);
        }
        if !self.desired.contains_key(id) {
            return Err(RequestError::NotFound(id.clone()));
        }
        if self.held.contains(id) {
            let reason = "it is held down (stopped); start it first".to_owned();
            return Err(RequestError::Blocked { id: id.clone(), reason });
        }
        let Some(slot) = self.slots.get_mut(id) else { return Err(RequestError::NotFound(id.clone())) };
        if slot.busy.is_some() || slot.requested.is_some() {
            return Err(RequestError::Busy(id.clone()));
        }
        if let Observed::Blocked { .. } = slot.observed {
            return Err(RequestError::Blocked { id: id.clone(), reason: slot.error.clone().unwrap_or_default() });
        }
        if slot.waiting {
            return Err(RequestError::Blocked { id: id.clone(), reason: slot.error.clone().unwrap_or_default() });
        }
        slot.retry_at = None;
        let action = if slot.observed.has_process() {
            Action::Restart
        } else {
            slot.observed = Observed::Idle;
            Action::Start
        };
        tracing::info!(proxy = %id, ?action, "restart asked");
        self.launch(id, action);
        Ok(())
    }

    /// Tries again every failed start whose backoff is over.
    pub(super) fn retry_due(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, _))) = self.retries.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((at, id))) = self.retries.pop() else { break };
            let Some(slot) = self.slots.get_mut(&id) else { continue };
            if slot.retry_at != Some(at) || slot.busy.is_some() {
                continue; // stale: started, changed or forgotten since
            }
            slot.retry_at = None;
            if let Observed::Failed { has_process: false, .. } = slot.observed {
                tracing::info!(proxy = %id, attempt = slot.start_failures + 1, "retrying the failed start");
                slot.observed = Observed::Idle;
                self.consider(&id);
            }
        }
        self.plan_woken();
    }
}

async fn start(backend: &dyn ProxyBackend, proxy: Arc<ManagedProxy>) -> Outcome {
    start_created(backend.create(proxy.clone()), proxy).await
}

async fn start_created(handle: Box<dyn ProxyHandle>, proxy: Arc<ManagedProxy>) -> Outcome {
    match handle.start().await {
        Ok(()) => Outcome::Started { proxy, handle },
        Err(error) => Outcome::StartFailed { error },
    }
}

/// `update = "epoch"`: waits while `max_generations` generations of the proxy live (as the
/// old handle's status lists them), then starts the new generation beside `old` as an
/// overlapping update does, and lets `old` drain once the new one is ready
/// ([`ProxyHandle::drain`]): it is not signalled. When the new one fails, it is stopped and
/// `old` stays current, as in an overlapping update.
async fn epoch_update(
    backend: &dyn ProxyBackend,
    old: &dyn ProxyHandle,
    proxy: Arc<ManagedProxy>,
    progress: watch::Sender<Option<BackendStatus>>,
    shutting_down: CancellationToken,
    superseded: CancellationToken,
) -> Outcome {
    let max = proxy.spec().update.max_generations as usize;
    let mut status = old.status();
    let cancelled = shutting_down.clone();
    let mut shutdown = std::pin::pin!(cancelled.cancelled());
    loop {
        let live = status.borrow_and_update().generations.len().max(1);
        if live < max {
            break;
        }
        let error = format!("waiting for an old generation to exit: {live} run, and max_generations is {max}");
        let waiting = BackendStatus {
            figures: ProcessFigures { error: Some(error), ..ProcessFigures::default() },
            ..BackendStatus::default()
        };
        progress.send_replace(Some(waiting));
        tokio::select! {
            changed = status.changed() => if changed.is_err() {
                break; // the old handle is gone: nothing more to wait for
            },
            () = &mut shutdown => {
                return Outcome::OverlapFailed {
                    reason: "hot restart abandoned, the current generation serves on: the agent is shutting down"
                        .to_owned(),
                };
            }
            () = superseded.cancelled() => {
                return Outcome::OverlapFailed {
                    reason: "hot restart given up while it waited for an old generation to exit: what it would start \
                             is no longer wanted"
                        .to_owned(),
                };
            }
        }
    }
    progress.send_replace(None);
    replace_beside(backend, old, proxy, progress, shutting_down, Retire::Drain).await
}

/// `update = "overlap"`: starts the new instance beside `old`, and stops `old` once the new
/// one is ready; abandons the new one, and leaves `old` serving, when it cannot start,
/// exits or is not ready within `update_timeout`, or the engine shuts down meanwhile.
/// `progress` follows the new instance.
async fn overlap_update(
    backend: &dyn ProxyBackend,
    old: &dyn ProxyHandle,
    proxy: Arc<ManagedProxy>,
    progress: watch::Sender<Option<BackendStatus>>,
    shutting_down: CancellationToken,
) -> Outcome {
    replace_beside(backend, old, proxy, progress, shutting_down, Retire::Stop).await
}

/// How the old instance of an update beside it ends once the new one is ready.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retire {
    /// `update = "overlap"`: stopped.
    Stop,
    /// `update = "epoch"`: left to drain and exit on its own.
    Drain,
}

/// Starts the new instance beside `old`, and retires `old` as `retire` says once the new
/// one is ready; otherwise stops the new one and leaves `old` serving.
async fn replace_beside(
    backend: &dyn ProxyBackend,
    old: &dyn ProxyHandle,
    proxy: Arc<ManagedProxy>,
    progress: watch::Sender<Option<BackendStatus>>,
    shutting_down: CancellationToken,
    retire: Retire,
) -> Outcome {
    let (what, update) = match retire {
        Retire::Stop => ("instance", "update"),
        Retire::Drain => ("generation", "hot restart"),
    };
    let timeout = proxy.spec().update.timeout;
    let new = backend.create(proxy.clone());
    if let Err(error) = new.start().await {
        return Outcome::OverlapFailed {
            reason: format!("the new {what} did not start: {}", crate::error_chain(&error)),
        };
    }
    let mut status = new.status();
    let ready = tokio::time::timeout(timeout, async {
        // A shutdown does not wait out the timeout: the old instance is kept.
        let mut shutdown = std::pin::pin!(shutting_down.cancelled());
        loop {
            let current = status.borrow_and_update().clone();
            let state = current.state;
            progress.send_replace(Some(current.clone()));
            match state {
                BackendState::Running => return Ok(()),
                BackendState::Pending | BackendState::Starting => {}
                _ => return Err(not_ready(what, &current)),
            }
            tokio::select! {
                changed = status.changed() => if changed.is_err() {
                    return Err(format!("the new {what} is no longer observed"));
                },
                () = &mut shutdown => return Err("the agent is shutting down".to_owned()),
            }
        }
    })
    .await;
    let reason = match ready {
        Ok(Ok(())) => {
            progress.send_replace(None);
            let retired = match retire {
                Retire::Stop => old.stop().await,
                Retire::Drain => old.drain().await,
            };
            if let Err(error) = retired {
                // The new instance is ready and kept; the old one may still run beside it.
                tracing::error!(proxy = %proxy.id(), error = %crate::error_chain(&error), "the replaced {what} did not stop");
            }
            return Outcome::Started { proxy, handle: new };
        }
        Ok(Err(reason)) => reason,
        Err(_elapsed) => {
            format!("the new {what} was not ready within update_timeout ({})", humantime::format_duration(timeout))
        }
    };
    if let Err(error) = new.stop().await {
        tracing::error!(proxy = %proxy.id(), error = %crate::error_chain(&error), "the abandoned new {what} did not stop");
    }
    Outcome::OverlapFailed { reason: format!("{update} abandoned, the old {what} serves on: {reason}") }
}

/// Why a new instance that left `starting` is not ready, from what the backend saw.
fn not_ready(what: &str, status: &BackendStatus) -> String {
    let mut reason = format!("the new {what} is {} before it was ready", status.state);
    if let Some(exit) = status.figures.last_exit {
        reason.push_str(&format!(" (it exited: {exit})"));
    }
    if let Some(error) = &status.figures.error {
        reason.push_str(&format!(": {error}"));
    }
    reason
}

/// The kind of a backend action, for counting; `None` for decisions that are not actions.
fn action_kind(action: Action) -> Option<ActionKind> {
    match action {
        Action::Start => Some(ActionKind::Start),
        Action::Stop => Some(ActionKind::Stop),
        Action::Restart => Some(ActionKind::Restart),
        Action::Update => Some(ActionKind::Update),
        Action::Block | Action::Forget => None,
    }
}
