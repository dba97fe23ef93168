//! Mocks of the backend traits with defaults for the calls that a test is not about, so
//! that it sets expectations only for the ones it is.
//!
//! This module only builds mocks; it never runs the engine.

use std::sync::Arc;

use tokio::sync::watch;

use crate::backend::{BackendRecord, BackendState, BackendStatus, MockProxyBackend, MockProxyHandle};

/// A [`MockProxyBackend`] with the expectations that `expect` sets, then defaults for the
/// calls the engine makes at every start: [`adoption_candidates`] finds none and
/// [`restored`] does nothing, any number of times.
///
/// mockall answers a call with the first expectation, in the order they were set, that
/// matches it and is not used up; the defaults come after the test's own, so the test's win.
/// A default accepts any number of calls: a call past a test's `.times(n)` falls through to
/// it rather than failing. To count a defaulted call exactly, build the mock with
/// `MockProxyBackend::new()` and set every expectation by hand.
///
/// [`adoption_candidates`]: crate::ProxyBackend::adoption_candidates
/// [`restored`]: crate::ProxyBackend::restored
///
/// # Examples
///
/// ```
/// use tether_manager::testing::{mock_backend, mock_handle};
///
/// // The engine may create one handle, which it may start; the rest are defaults.
/// let backend = mock_backend(|backend| {
///     let handle = mock_handle(|handle| {
///         handle.expect_start().returning(|| Ok(()));
///     });
///     backend.expect_create().return_once(move |_proxy| Box::new(handle));
/// });
/// # drop(backend);
/// ```
pub fn mock_backend(expect: impl FnOnce(&mut MockProxyBackend)) -> MockProxyBackend {
    let mut backend = MockProxyBackend::new();
    expect(&mut backend);
    backend.expect_adoption_candidates().returning(Vec::new);
    backend.expect_restored().return_const(());
    backend
}

/// A [`MockProxyHandle`] with the expectations that `expect` sets, then defaults, each for
/// any number of calls: [`status`] is [`BackendState::Running`] (with no pid) and never
/// changes, [`record`] records nothing, [`detach`] does nothing, and
/// [`on_status_change`] declines (the engine waits on the status channel).
///
/// `start`, `stop` and `update` have no default: a call of one the test did not expect fails
/// it. The order of the defaults and their fall-through are as for [`mock_backend`].
///
/// [`status`]: crate::ProxyHandle::status
/// [`record`]: crate::ProxyHandle::record
/// [`detach`]: crate::ProxyHandle::detach
/// [`on_status_change`]: crate::ProxyHandle::on_status_change
pub fn mock_handle(expect: impl FnOnce(&mut MockProxyHandle)) -> MockProxyHandle {
    let mut handle = MockProxyHandle::new();
    expect(&mut handle);
    let running = BackendStatus { state: BackendState::Running, ..BackendStatus::default() };
    // The sender lives as long as the mock: a closed status would read as a handle that is
    // no longer observed.
    let status = Arc::new(watch::Sender::new(running));
    handle.expect_status().returning(move || status.subscribe());
    handle.expect_record().returning(BackendRecord::none);
    handle.expect_detach().return_const(());
    handle.expect_on_status_change().returning(|_| false);
    handle
}
