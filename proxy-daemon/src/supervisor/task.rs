//! The supervising task of one process: its instances, its exits and restarts, its
//! checks, and the commands of its handle.

use std::io;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use tether_state::error_chain;

use super::Shared;
use super::checks::{self, Checked, Checks};
use super::instance::{Instance, InstanceKind};
use super::reload::{Reload, ReloadReply, Step};
use super::watched::Watch;
use crate::control::{self, Commands, Stop};
use crate::error::DetachError;
use crate::journal::{Handover, JournalSink};
use crate::proc::{self, Identity};
use crate::spec::{ProcessSpec, ProcessUpdate, ReloadOutcome, ReloadResult, Reloads};
use crate::status::{ExitReason, ProcessState, ProcessStatus};

/// The supervising task of one process.
pub(super) struct Task {
    key: u64,
    spec: ProcessSpec,
    shared: Arc<Shared>,
    commands: control::Receiver,
    /// The attempt number of the restart that began the current run (0: first start).
    attempt: u32,
    /// The pid of the latest instance: the one its pid file names, if any.
    last_pid: Option<u32>,
    /// Which check the status's `error` comes from, if one does: a passing check clears it.
    health_error: Option<HealthError>,
    /// The empty cgroup of the last instance, kept for the next one.
    spare_cgroup: Option<Box<str>>,
    /// A reload asked since the one in flight began (which is a local of [`Task::run`],
    /// since a reload's steps are `Send` but not `Sync`), with its callers (none for a
    /// watched file's change): one reload after it answers them all.
    reload_next: Option<Vec<ReloadReply>>,
    /// Where the lines of one instance end and the next one's begin, for the journal, and
    /// the generation of the current instance.
    handover: Option<Arc<Handover>>,
    generation: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HealthError {
    /// A readiness probe failed; cleared when the instance turns ready.
    Readiness,
    /// Liveness probes failed, or restarted the instance; cleared when one passes.
    Liveness,
}

enum Event {
    Commands(Box<Commands>),
    Exited(io::Result<()>),
    Checked(Checked),
    Reload(Step),
    Watched,
}

/// However supervision ends (a final state, a detach, a dropped handle, a panic), the
/// process leaves the supervisor's list.
impl Drop for Task {
    fn drop(&mut self) {
        self.shared.forget_process(self.key);
    }
}

impl Task {
    pub(super) fn new(
        key: u64,
        spec: ProcessSpec,
        shared: Arc<Shared>,
        commands: control::Receiver,
        last_pid: Option<u32>,
        handover: Option<Arc<Handover>>,
    ) -> Self {
        Task {
            key,
            spec,
            shared,
            commands,
            attempt: 0,
            last_pid,
            health_error: None,
            spare_cgroup: None,
            reload_next: None,
            handover,
            generation: 0,
        }
    }

    /// Supervises `instance` (`ready` when it needs no readiness check, or was adopted) and
    /// every instance after it, until a stop, a detach or a dropped handle.
    ///
    /// A plain function returning an `async move` block, not an `async fn`: an `async fn`
    /// keeps its arguments and the locals they move into side by side in its future, which
    /// lives as long as the process, and this one's arguments are most of it.
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    pub(super) fn run(mut self, mut instance: Instance, ready: bool) -> impl Future<Output = ()> + Send {
        async move {
            let mut checks = Checks::new(&self.spec, ready, &mut instance, &self.shared);
            // The reload in flight, if one is; boxed: most processes never reload.
            let mut reload: Option<Box<Reload>> = None;
            // The reload's watched files, if any.
            let mut watch = Watch::of(&self.spec);
            loop {
                let event = {
                    // Each wait is a poll of its own (commands, the exit) or a boxed future
                    // made only when there is something to wait for (checks, a reload, watched
                    // files): the task's future, one allocation per supervised process for as
                    // long as it runs, keeps no room for any of them. Every wait is cancel-safe:
                    // commands are taken only when returned, a pidfd stays readable once its
                    // process exited, and a dropped check changes nothing.
                    let spec = &self.spec;
                    let mut checked = (!checks.idle()).then(|| Box::pin(checks.next(spec)));
                    let mut step = reload.as_mut().map(|running| Box::pin(running.next(spec)));
                    let mut watched = watch.as_mut().map(|watching| Box::pin(watching.changed()));
                    let (commands, pidfd) = (&self.commands, &instance.pidfd);
                    std::future::poll_fn(|cx| {
                        if let Poll::Ready(commands) = commands.poll_recv(cx) {
                            return Poll::Ready(Event::Commands(Box::new(commands)));
                        }
                        if let Poll::Ready(exited) = pidfd.poll_exited(cx) {
                            return Poll::Ready(Event::Exited(exited));
                        }
                        if let Some(Poll::Ready(checked)) = checked.as_mut().map(|f| f.as_mut().poll(cx)) {
                            return Poll::Ready(Event::Checked(checked));
                        }
                        if let Some(Poll::Ready(step)) = step.as_mut().map(|f| f.as_mut().poll(cx)) {
                            return Poll::Ready(Event::Reload(step));
                        }
                        if let Some(Poll::Ready(())) = watched.as_mut().map(|f| f.as_mut().poll(cx)) {
                            return Poll::Ready(Event::Watched);
                        }
                        Poll::Pending
                    })
                    .await
                };
                match event {
                    Event::Checked(checked) => {
                        if matches!(checked, Checked::NotReady(_) | Checked::Unhealthy { .. } | Checked::Dead(_)) {
                            self.set_status(|status| status.figures.probe_failures += 1);
                        }
                        if let Checked::Dead(message) = checked {
                            // Stopped as on a stop (its kill signal, then SIGKILL after the
                            // timeout), then restarted on the backoff like any exit.
                            tracing::warn!(pid = instance.pid, error = %message, "process unhealthy; restarting it");
                            self.fail_reloads(
                                &mut reload,
                                "the proxy was restarted during the reload: its liveness failed",
                            );
                            let _unsignalled = Box::pin(self.terminate(&instance, Stop::Signalled)).await;
                            let Some(next) = Box::pin(self.restart_after_exit(instance, Some(message))).await else {
                                return;
                            };
                            instance = next;
                            checks = self.checks_of_new(&mut instance);
                        } else if let Checked::Reload(notice) = checked {
                            let step = reload.as_mut().and_then(|running| running.noticed(&notice));
                            if let Some(Step::Done(result, error)) = step {
                                self.end_reload(&mut reload, result, error);
                            }
                        } else {
                            self.checked(checked);
                        }
                    }
                    Event::Reload(step) => self.reload_step(&mut reload, step, &instance),
                    Event::Watched => {
                        tracing::info!("a watched file changed; reloading");
                        self.ask_reload(&mut reload, Vec::new());
                    }
                    Event::Commands(commands) => {
                        if let Some(update) = commands.update {
                            if let Some(health) = &update.health {
                                checks.update(
                                    health.readiness.as_deref().cloned(),
                                    health.liveness.as_deref().cloned(),
                                    &self.shared,
                                );
                            }
                            let rewatch = update.reload.as_ref().is_some_and(|new| {
                                new.as_ref().map(|r| &r.watch) != self.spec.reload.as_ref().map(|r| &r.watch)
                            });
                            self.apply(*update);
                            if rewatch {
                                watch = Watch::of(&self.spec);
                            }
                        }
                        let ending = commands.stop.is_some() || commands.detach.is_some() || commands.handle_gone;
                        if !commands.reload.is_empty() {
                            self.ask_reload(&mut reload, commands.reload);
                        }
                        if ending {
                            self.fail_reloads(
                                &mut reload,
                                "the proxy is no longer supervised: it was stopped or detached",
                            );
                        }
                        if let Some(how) = commands.stop {
                            return Box::pin(self.stop(instance, how)).await;
                        }
                        if let Some(reply) = commands.detach {
                            let _caller_gone = reply.send(self.detach(&mut instance));
                            instance.release();
                            return;
                        }
                        if commands.handle_gone {
                            self.shared.rotator.forget(self.key);
                            tracing::info!(pid = instance.pid, "handle dropped; process left running unsupervised");
                            instance.release();
                            return;
                        }
                    }
                    Event::Exited(result) => {
                        if let Err(error) = result {
                            // The reactor failed us; the process may be alive, so leave it be.
                            tracing::error!(pid = instance.pid, %error, "cannot watch process; supervision ended");
                            let error = Some(format!("cannot watch process: {error}"));
                            Box::pin(self.finish(ProcessState::Failed, None, error)).await;
                            return;
                        }
                        self.fail_reloads(
                            &mut reload,
                            "the proxy exited during the reload; it is restarted as after any exit",
                        );
                        let Some(next) = Box::pin(self.restart_after_exit(instance, None)).await else {
                            return;
                        };
                        instance = next;
                        checks = self.checks_of_new(&mut instance);
                    }
                }
            }
        }
    }

    /// Takes reloads asked by `replies`: one begins now, unless one runs (they then wait for
    /// the next, which begins once it ends). Answered `None` at once without a reload policy.
    fn ask_reload(&mut self, reload: &mut Option<Box<Reload>>, replies: Vec<ReloadReply>) {
        let Some(policy) = self.spec.reload.clone() else {
            for reply in replies {
                let _caller_gone = reply.send(None);
            }
            return;
        };
        if reload.is_some() {
            self.reload_next.get_or_insert_with(Vec::new).extend(replies);
            return;
        }
        tracing::info!("reloading");
        *reload = Some(Box::new(Reload::new(*policy, &self.spec, replies)));
    }

    /// Carries out a reload's `step`: sends its signal to `instance`, or ends it.
    fn reload_step(&mut self, reload: &mut Option<Box<Reload>>, step: Step, instance: &Instance) {
        let (result, error) = match step {
            Step::Done(result, error) => (result, error),
            Step::Ask => {
                let Some(running) = reload.as_mut() else { return };
                let Some(signal) = running.signal() else { return };
                match instance.pidfd.send_signal(signal.into()) {
                    Ok(()) => {
                        tracing::debug!(pid = instance.pid, %signal, "reload signalled");
                        match running.asked(&self.spec) {
                            Some(Step::Done(result, error)) => (result, error),
                            _ => return,
                        }
                    }
                    Err(cause) => {
                        (ReloadResult::Failed, Some(format!("cannot send {signal} to pid {}: {cause}", instance.pid)))
                    }
                }
            }
        };
        self.end_reload(reload, result, error);
    }

    /// Ends the reload in flight with `result`: shows it, answers its callers, and begins
    /// the next one if more were asked meanwhile.
    fn end_reload(&mut self, reload: &mut Option<Box<Reload>>, result: ReloadResult, error: Option<String>) {
        let Some(ended) = reload.take() else { return };
        let outcome = ReloadOutcome::now(result, error);
        if result.succeeded() {
            tracing::info!(result = %result, "reloaded");
        } else {
            tracing::warn!(result = %result, error = outcome.error.as_deref(), "reload failed");
        }
        self.set_status(|status| {
            status.figures.reloads = Some(Box::new(Reloads::after(status.figures.reloads.as_deref(), outcome.clone())))
        });
        ended.answer(&outcome);
        if let Some(asked) = self.reload_next.take() {
            self.ask_reload(reload, asked);
        }
    }

    /// Fails the reload in flight, and those asked after it, with `reason`: the instance
    /// they were for is gone.
    fn fail_reloads(&mut self, reload: &mut Option<Box<Reload>>, reason: &str) {
        if reload.is_none() {
            return;
        }
        let asked = self.reload_next.take().unwrap_or_default();
        self.end_reload(reload, ReloadResult::Failed, Some(reason.to_owned()));
        let outcome = ReloadOutcome::now(ReloadResult::Failed, Some(reason.to_owned()));
        for reply in asked {
            let _caller_gone = reply.send(Some(outcome.clone()));
        }
    }

    /// The checks of an instance this task started: asked for readiness if it has one.
    fn checks_of_new(&self, instance: &mut Instance) -> Checks {
        Checks::new(&self.spec, checks::starts_ready(&self.spec), instance, &self.shared)
    }

    /// Changes the status, and tells the handle's observer.
    fn set_status(&self, change: impl FnOnce(&mut ProcessStatus)) {
        self.commands.publish(|status| {
            change(status);
            true
        });
    }

    /// Changes the status if `change` says it changed anything, and then tells the
    /// handle's observer.
    fn set_status_if(&self, change: impl FnOnce(&mut ProcessStatus) -> bool) -> bool {
        self.commands.publish(change)
    }

    /// Shows what a check found.
    fn checked(&mut self, checked: Checked) {
        match checked {
            Checked::Ready => {
                tracing::info!("process ready");
                let clear = self.health_error.take_if(|from| *from == HealthError::Readiness).is_some();
                self.set_status(|status| {
                    status.state = ProcessState::Running;
                    status.ready = true;
                    if clear {
                        status.figures.error = None;
                    }
                });
            }
            Checked::NotReady(message) => {
                tracing::debug!(error = %message, "process not ready yet");
                self.show_health_error(HealthError::Readiness, message);
            }
            Checked::Alive { recovered } => {
                if recovered {
                    tracing::info!("process answers its liveness probe again");
                }
                if self.health_error.take().is_some() {
                    self.set_status(|status| status.figures.error = None);
                }
            }
            Checked::Unhealthy { failures, message } => {
                tracing::warn!(error = %message, failures, "liveness probe failed");
                self.show_health_error(HealthError::Liveness, message);
            }
            Checked::Dead(message) => self.show_health_error(HealthError::Liveness, message),
            // Only a reload in flight takes these, in the task's loop.
            Checked::Reload(_) => {}
            Checked::StatusText(text) => {
                self.set_status_if(|status| {
                    let changed = status.figures.status_text.as_deref() != Some(text.as_str());
                    status.figures.status_text = Some(text);
                    changed
                });
            }
        }
    }

    fn show_health_error(&mut self, from: HealthError, message: String) {
        self.health_error = Some(from);
        self.set_status_if(|status| {
            let changed = status.figures.error.as_deref() != Some(message.as_str());
            status.figures.error = Some(message);
            changed
        });
    }

    fn apply(&mut self, update: ProcessUpdate) {
        if let Some(kill) = update.kill {
            self.spec.kill = kill;
        }
        if let Some(restart) = update.restart {
            self.spec.restart = restart;
        }
        if let Some(journal) = &update.journal {
            self.spec.logs.journal = Some(Arc::clone(journal));
        }
        if let Some(limits) = update.log_limits {
            self.spec.logs.limits = limits;
            let journal = self.journal().map(|(sink, handover, _)| (sink, handover));
            self.shared.rotator.set_limits(self.key, limits, journal);
        }
        tracing::debug!(?update, "applied in-place update");
        if let Some(limits) = update.limits {
            // The running instance's cgroup was written by the handle.
            self.spec.limits = limits;
        }
        if let Some(reload) = update.reload {
            self.spec.reload = reload.map(Box::new);
        }
        if let Some(restart) = update.restart_on_exit {
            self.spec.restart_on_exit = restart;
        }
        if let Some(health) = update.health {
            self.spec.health = health;
            // For the next instance: the running one keeps the environment it started with.
            checks::set_notify_env(&mut self.spec, self.shared.notify.address());
        }
    }

    fn detach(&self, instance: &mut Instance) -> Result<Identity, DetachError> {
        self.shared.rotator.forget(self.key);
        let identity = self.identity(instance)?;
        tracing::info!(pid = instance.pid, "process detached; left running");
        Ok(identity)
    }

    fn identity(&self, instance: &mut Instance) -> Result<Identity, DetachError> {
        // Our child is not reaped until we wait for it, so its pid is still its own.
        let start_time = match instance.start_time {
            Some(start_time) => start_time,
            None => {
                let start_time = proc::read_stat(instance.pid)
                    .map_err(|source| DetachError::Identity { pid: instance.pid, source })?
                    .start_time;
                instance.start_time = Some(start_time);
                start_time
            }
        };
        Ok(Identity {
            pid: instance.pid,
            pgid: instance.pgid,
            start_time,
            boot_id: self.shared.boot_id.clone(),
            cgroup: instance.cgroup.as_deref().map(str::to_owned),
        })
    }

    /// Stops the running instance, as `how` says, and ends supervision.
    async fn stop(mut self, mut instance: Instance, how: Stop) {
        let pid = instance.pid;
        // Told to exit, it no longer counts as ready, even while it still runs.
        self.set_status(|status| {
            status.state = ProcessState::Stopping;
            status.ready = false;
        });
        let error = self.terminate(&instance, how).await;
        // Grandchildren that outlived the leader; the unreaped leader still holds the id.
        instance.sweep(self.shared.cgroups.as_ref()).await;
        let last_exit = instance.reap().await;
        self.commands.close();
        tracing::info!(pid, ?last_exit, "process stopped");
        self.finish(ProcessState::Stopped, last_exit, error).await;
    }

    /// Ends the instance's main process: its kill signal to the group (unless `how` says it
    /// was asked already), then SIGKILL after the kill timeout. Returns once it exited (not
    /// reaped), with what went wrong, if anything did.
    async fn terminate(&self, instance: &Instance, how: Stop) -> Option<String> {
        let (pid, kill) = (instance.pid, self.spec.kill);
        // The leader is alive or an unreaped zombie while its pidfd is not readable or it
        // is our child, so the group id cannot have been reused.
        let leader_known =
            matches!(instance.kind, InstanceKind::Child(_)) || matches!(instance.pidfd.has_exited(), Ok(false));
        let mut error = None;
        if leader_known {
            if how == Stop::Signalled {
                if let Err(cause) = proc::signal_group(instance.pgid, kill.signal.into()) {
                    error = Some(format!("failed to signal process group {}: {cause}", instance.pgid));
                }
            }
            if tokio::time::timeout(kill.timeout, instance.pidfd.exited()).await.is_err() {
                tracing::warn!(
                    pid,
                    timeout_ms = kill.timeout.as_millis() as u64,
                    "process ignored its kill signal; sending SIGKILL"
                );
                if let Err(cause) = proc::signal_group(instance.pgid, Signal::SIGKILL) {
                    error = Some(format!("failed to kill process group {}: {cause}", instance.pgid));
                }
                if let Err(cause) = instance.pidfd.exited().await {
                    error = Some(format!("cannot watch process: {cause}"));
                }
            }
        }
        error
    }

    /// Publishes a final state after removing the pid file and forgetting the logs. The
    /// process leaves the supervisor's list first, so that whoever sees the final state no
    /// longer finds it there.
    async fn finish(&mut self, state: ProcessState, last_exit: Option<ExitReason>, error: Option<String>) {
        self.shared.forget_process(self.key);
        self.shared.rotator.forget(self.key);
        if let (Some(cgroups), Some(spare)) = (&self.shared.cgroups, self.spare_cgroup.take()) {
            cgroups.remove_empty(&spare);
        }
        let removed = match (self.last_pid, &self.spec.pid_file) {
            (Some(pid), Some(pid_file)) => self.shared.pid_files.remove(pid_file, pid).await,
            _ => Ok(()),
        };
        let error = error.or_else(|| removed.err().map(|cause| format!("failed to remove pid file: {cause}")));
        // Supervision ends here: its share of the listeners goes now, not whenever this task
        // is dropped, so that whoever sees the end (a deregistration) finds them closed.
        self.spec.listeners = Vec::new();
        self.set_status(|status| {
            status.state = state;
            status.figures.pid = None;
            status.identity = None;
            status.ready = false;
            if last_exit.is_some() {
                status.figures.last_exit = last_exit;
            }
            if error.is_some() {
                status.figures.error = error;
            }
        });
    }

    /// Handles an exit: sweeps the group, reaps, waits out the backoff, starts anew, and
    /// keeps trying on the backoff while starts fail. `None` when supervision ended instead
    /// (a stop or a detach).
    /// `cause` is why the instance was ended, when it did not exit by itself (its liveness
    /// failed): it stays the status's `error` until a check of a later instance passes.
    async fn restart_after_exit(&mut self, mut instance: Instance, cause: Option<String>) -> Option<Instance> {
        let (pid, run) = (instance.pid, instance.started.elapsed());
        // Sweep before reaping: until the leader is reaped its pgid cannot be reused, and a
        // forked worker must not keep the port the next instance binds.
        self.spare_cgroup = instance.clear(self.shared.cgroups.as_ref()).await;
        let last_exit = instance.reap().await;
        if !self.spec.restart_on_exit {
            tracing::info!(pid, ?last_exit, "process exited; not restarted");
            self.commands.close();
            self.finish(ProcessState::Stopped, last_exit, None).await;
            return None;
        }

        if let Some(restarted) = self.spec.restarted.clone() {
            // Started again as it says (a cold start), once what it waits for is over.
            self.set_status(|status| {
                status.state = ProcessState::Backoff;
                status.figures.pid = None;
                status.identity = None;
                status.figures.last_exit = last_exit;
                status.ready = false;
                status.figures.status_text = None;
            });
            if let (Some(pid), Some(pid_file)) = (self.last_pid, &self.spec.pid_file) {
                self.shared.pid_files.forget(pid_file, pid);
            }
            tracing::info!(pid, ?last_exit, "process exited; waiting to start it again");
            if !self.wait_until((restarted.after)()).await {
                return None;
            }
            restarted.apply_to(&mut self.spec);
        }

        self.attempt = self.spec.restart.next_attempt(self.attempt, run);
        let mut delay = self.spec.restart.delay_before(self.attempt);
        let (code, signal) = match last_exit {
            Some(ExitReason::Code(code)) => (Some(code), None),
            Some(ExitReason::Signal(signal)) => (None, Some(signal)),
            None => (None, None),
        };
        tracing::warn!(
            pid,
            code,
            signal,
            attempt = self.attempt,
            backoff_ms = delay.as_millis() as u64,
            "process exited; restarting"
        );
        let state = if delay.is_zero() { ProcessState::Starting } else { ProcessState::Backoff };
        self.health_error = cause.is_some().then_some(HealthError::Liveness);
        self.set_status(|status| {
            status.state = state;
            status.figures.pid = None;
            status.identity = None;
            status.figures.last_exit = last_exit;
            status.ready = false;
            status.figures.status_text = None;
            if cause.is_some() {
                status.figures.error.clone_from(&cause);
            }
        });

        let mut failed_attempts = 0_u32;
        loop {
            if !delay.is_zero() {
                // No pid file names a process that does not exist while the next one waits.
                // (An immediate restart replaces the file instead.)
                if let (Some(pid), Some(pid_file)) = (self.last_pid, &self.spec.pid_file) {
                    self.shared.pid_files.forget(pid_file, pid);
                }
                if !self.wait_backoff(delay).await {
                    return None;
                }
            }
            self.set_status(|status| status.state = ProcessState::Starting);
            if let Some((_, handover, _)) = self.journal() {
                // What is in its log files now is the last instance's: the next one's lines
                // wait for the rotation thread to know its pid.
                self.generation = handover.hold(self.spec.logs.sizes());
            }
            // Boxed: the making of a process is rare in a supervisor's life, and its state
            // would otherwise be part of every supervising task's future.
            let spawning = Box::pin(Instance::spawn(&self.spec, &self.shared, self.spare_cgroup.take()));
            match spawning.await {
                Ok(instance) => return Some(self.restarted(instance, cause)),
                Err(error) => {
                    // A failed start is not final: a descriptor, memory or the program
                    // itself may be back by the next attempt, so it waits on the backoff.
                    let message = error_chain(&error);
                    self.attempt = self.attempt.saturating_add(1);
                    delay = self.spec.restart.delay_after_failed_start(self.attempt);
                    tracing::warn!(
                        error = %message,
                        attempt = self.attempt,
                        backoff_ms = delay.as_millis() as u64,
                        "process cannot be restarted; retrying"
                    );
                    failed_attempts += 1;
                    self.set_status(|status| {
                        status.state = ProcessState::Backoff;
                        status.figures.error =
                            Some(format!("cannot restart (failed attempts: {failed_attempts}): {message}"));
                    });
                }
            }
        }
    }

    /// Where the lines go in the journal, with the process's [`Handover`] (made now if
    /// its output did not go there before) and the current instance's generation; `None`
    /// when they do not go there.
    fn journal(&mut self) -> Option<(Arc<JournalSink>, Arc<Handover>, u64)> {
        let sink = self.spec.logs.journal_sink(&self.spec.name)?;
        let handover = Arc::clone(self.handover.get_or_insert_with(Arc::default));
        Some((sink, handover, self.generation))
    }

    /// Takes over a freshly restarted instance: pid file, log watch, status.
    fn restarted(&mut self, instance: Instance, cause: Option<String>) -> Instance {
        let pid = instance.pid;
        if let Some(pid_file) = &self.spec.pid_file {
            self.shared.pid_files.write(pid_file, pid);
        }
        self.last_pid = Some(pid);
        let journal = self.journal();
        self.shared.rotator.watch(self.key, &self.spec.logs, journal, pid, instance.log_sizes);
        tracing::info!(pid, attempt = self.attempt, "process restarted");
        let identity = self.shared.identity(&instance);
        let ready = checks::starts_ready(&self.spec);
        self.health_error = cause.is_some().then_some(HealthError::Liveness);
        self.set_status(|status| {
            status.state = if ready { ProcessState::Running } else { ProcessState::Starting };
            status.ready = ready;
            status.figures.pid = Some(pid);
            status.identity = identity;
            // Restarts that ran: the exits they followed are counted from this.
            status.figures.restarts += 1;
            status.figures.started_at = Some(SystemTime::now());
            status.figures.error = cause;
        });
        instance
    }

    /// Waits `delay` while answering commands. `false` when supervision ended meanwhile.
    async fn wait_backoff(&mut self, delay: Duration) -> bool {
        self.wait_until(tokio::time::sleep(delay)).await
    }

    /// Waits until `over` resolves while answering commands. `false` when supervision ended
    /// meanwhile (a stop, a detach, a dropped handle, or restarts turned off).
    async fn wait_until(&mut self, over: impl Future<Output = ()>) -> bool {
        tokio::pin!(over);
        loop {
            tokio::select! {
                // Pinned outside the loop, so updates do not restart it.
                () = &mut over => return true,
                commands = self.commands.recv() => {
                    if let Some(update) = commands.update {
                        self.apply(*update);
                        if !self.spec.restart_on_exit && commands.stop.is_none() && commands.detach.is_none() {
                            self.commands.close();
                            tracing::info!("restarts turned off while waiting to start again");
                            self.finish(ProcessState::Stopped, None, None).await;
                            return false;
                        }
                    }
                    if commands.stop.is_some() {
                        self.commands.close();
                        tracing::info!("process stopped during backoff");
                        self.finish(ProcessState::Stopped, None, None).await;
                        return false;
                    }
                    if let Some(reply) = commands.detach {
                        let _caller_gone = reply.send(Err(DetachError::NotRunning { state: ProcessState::Backoff }));
                        self.finish(ProcessState::Stopped, None, None).await;
                        return false;
                    }
                    if commands.handle_gone {
                        self.finish(ProcessState::Stopped, None, None).await;
                        return false;
                    }
                }
            }
        }
    }
}
