//! An engine running in a task of its own, for tests: started in one call, stopped, closed or
//! killed in one call, with a panic of the engine's raised again in the test.
//!
//! This module owns the one task it spawns; dropping a [`RunningManager`] aborts it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::manager::{Manager, ShutdownError};
use crate::status::ManagerHandle;

/// [`Manager::run`] in a task of its own, until [`RunningManager::stop`],
/// [`RunningManager::close`] or [`RunningManager::kill`].
///
/// A panic of the engine's (under the `testing` feature, a panic of an action is raised again
/// by the engine: a mock's unmet expectation, a test's callback, a misuse of the
/// [`RecordingBackend`](super::RecordingBackend)) is raised again by whichever of those is
/// called, and by the drop of a `RunningManager` whose engine ended so: a test fails with the
/// panic's own message. Meanwhile the waits of this module end as soon as the engine is gone
/// ([`WaitError::EngineGone`](super::WaitError::EngineGone)), rather than at their deadline.
///
/// Dropping it without a stop aborts the engine's task: the engine is dropped, and its
/// handles with it (a backend's proxies keep running, as after a crash of the agent).
///
/// # Examples
///
/// ```
/// # use std::sync::Arc;
/// # use tether_manager::tether_state::LocalState;
/// # use tether_manager::{Manager, ManagerConfig, MemorySnapshotStore};
/// use tether_manager::testing::{RecordingBackend, RunningManager};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// # let catalog = Arc::new(LocalState::new());
/// # let store = Arc::new(MemorySnapshotStore::new());
/// let manager = Manager::new(catalog, Arc::new(RecordingBackend::new()), store, ManagerConfig::default());
/// let running = RunningManager::spawn(manager);
/// let view = running.handle().clone();
/// // … change the catalog, wait on `view` …
/// running.close().await.unwrap();
/// # }
/// ```
#[derive(Debug)]
pub struct RunningManager {
    handle: ManagerHandle,
    shutdown: CancellationToken,
    /// `None` once joined.
    task: Option<JoinHandle<Manager>>,
}

impl RunningManager {
    /// Runs `manager` in a new task of the current tokio runtime until it is stopped.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(mut manager: Manager) -> Self {
        let handle = manager.handle();
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            manager.run(token).await;
            manager
        });
        Self { handle, shutdown, task: Some(task) }
    }

    /// The engine's statuses, events and counters, for the waits of this module.
    pub fn handle(&self) -> &ManagerHandle {
        &self.handle
    }

    /// Ends [`Manager::run`] and gives the engine back, for a [`Manager::close`] or
    /// [`Manager::kill`] of one's own, or to run it again.
    ///
    /// # Panics
    ///
    /// With the panic of the engine's run, if it panicked.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future aborts the engine's task, as dropping the `RunningManager` does.
    pub async fn stop(mut self) -> Manager {
        self.shutdown.cancel();
        let Some(task) = self.task.as_mut() else { unreachable!("joined only here and in drop") };
        let joined = task.await;
        self.task = None;
        match joined {
            Ok(manager) => manager,
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            Err(join) => panic!("the engine's task ended without its engine: {join}"),
        }
    }

    /// Ends [`Manager::run`], then [`Manager::close`]: every proxy is detached and keeps
    /// running, and the snapshot is written.
    ///
    /// # Errors
    ///
    /// As [`Manager::close`].
    ///
    /// # Panics
    ///
    /// With the panic of the engine's run, or of a detach (as [`Manager::close`]).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`Manager::close`].
    pub async fn close(self) -> Result<(), ShutdownError> {
        self.stop().await.close().await
    }

    /// Ends [`Manager::run`], then [`Manager::kill`]: every proxy is stopped.
    ///
    /// # Errors
    ///
    /// As [`Manager::kill`].
    ///
    /// # Panics
    ///
    /// With the panic of the engine's run, or of a stop (as [`Manager::kill`]).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`Manager::kill`].
    pub async fn kill(self) -> Result<(), ShutdownError> {
        self.stop().await.kill().await
    }
}

impl Drop for RunningManager {
    fn drop(&mut self) {
        let Some(mut task) = self.task.take() else { return };
        if !task.is_finished() {
            task.abort();
            return;
        }
        // Finished: its result is ready, so one poll takes it without waiting.
        let mut context = Context::from_waker(Waker::noop());
        if let Poll::Ready(Err(join)) = Pin::new(&mut task).poll(&mut context) {
            // A second panic while one unwinds would abort the whole test binary.
            if join.is_panic() && !std::thread::panicking() {
                std::panic::resume_unwind(join.into_panic());
            }
        }
    }
}
