//! A test kit for code that drives the engine (enable the `testing` feature from
//! `[dev-dependencies]`): a backend that records what it is asked, waits that end at a
//! deadline with a message, and an engine running in a task of its own.
//!
//! - [`RecordingBackend`]: a [`ProxyBackend`](crate::ProxyBackend) that runs nothing, reports
//!   every started proxy `running` with a made-up pid, records every call in order
//!   ([`Call`]), and can be told to fail starts or to end a proxy as if it had exited.
//! - [`wait_for`], [`wait_for_proxy`], [`wait_until_state`], [`wait_until_gone`]: wait on a
//!   [`ManagerHandle`](crate::ManagerHandle) until a condition holds; a [`WaitError`] names
//!   the condition and the last statuses seen.
//! - [`RunningManager`]: [`Manager::run`](crate::Manager::run) in a task, stopped, closed or
//!   killed in one call, with any panic of the engine's carried to the test.
//! - With the `mock` feature, `mock_backend` and `mock_handle`: mocks with defaults for
//!   the calls a test is not about.
//!
//! Everything works under tokio's paused clock (`#[tokio::test(start_paused = true)]`):
//! deadlines and backoffs are timers, and the clock jumps to the next one when nothing else
//! runs.
//!
//! This module is for tests: it never runs a process, and a misuse of it panics (the engine
//! raises a panic of an action again under this feature, so that the test fails).

#[cfg(feature = "mock")]
mod mocks;
mod recording;
mod running;
mod wait;

#[cfg(feature = "mock")]
pub use mocks::{mock_backend, mock_handle};
pub use recording::{Call, CallKind, RecordingBackend};
pub use running::RunningManager;
pub use wait::{WaitError, wait_for, wait_for_proxy, wait_until_gone, wait_until_state};
