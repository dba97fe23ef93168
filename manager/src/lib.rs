//! The reconcile engine of tether.
//!
//! It keeps the proxies that run equal to the proxies the catalog asks for, through traits,
//! and never touches an operating-system process itself: it owns the decisions (start,
//! stop, restart on change, in place, blocked, failed), the order between proxies (a proxy
//! `waiting` until its `depends_on` is met; dependents stopped before what they depend on),
//! the coalescing of catalog changes, the snapshot of what runs, and the two shutdowns. It must never depend on `nix`,
//! `tokio::process` or `tether-proxy-daemon`.
//!
//! - [`Manager`]: the engine; [`ManagerConfig`]: its windows, bounds and root policy, with
//!   the [`UserLookup`] through which the agent tells which users are root.
//! - [`ProxyBackend`] and [`ProxyHandle`]: the seam to whatever runs proxies.
//! - [`Leaves`]: a valid leaf certificate for each service with a proxy, signed through the
//!   [`CertificateAuthority`] seam, renewed at 60 to 80 % of its life ([`LeavesHandle`] reads them).
//! - [`SnapshotStore`]: where the snapshot lives ([`FileSnapshotStore`], [`MemorySnapshotStore`]).
//! - [`ManagerHandle`]: statuses, [`ProxyEvent`]s and [`ReconcileStats`] for the API and metrics.
//! - `testing` (a feature): a recording backend, waits with deadlines and an engine running in
//!   a task, for tests of code that drives the engine.
//!
//! # Example
//!
//! A downstream agent plugs in its own backend (here one that runs nothing) and runs the
//! engine until shutdown:
//!
//! ```
//! use std::sync::Arc;
//!
//! use tether_manager::tether_state::{LocalState, ManagedProxy, ProxySpec, Service, ServiceId, ServiceName, Source};
//! use tether_manager::{
//!     BackendError, BackendState, BackendStatus, CancellationToken, Manager, ManagerConfig, MemorySnapshotStore,
//!     ProxyBackend, ProxyHandle, ProxyState, async_trait, watch,
//! };
//!
//! /// A "process" that is only a status.
//! struct Pretend(watch::Sender<BackendStatus>);
//!
//! #[async_trait]
//! impl ProxyHandle for Pretend {
//!     async fn start(&self) -> Result<(), BackendError> {
//!         self.0.send_modify(|s| s.state = BackendState::Running);
//!         Ok(())
//!     }
//!     async fn stop(&self) -> Result<(), BackendError> { Ok(()) }
//!     async fn detach(&self) {}
//!     async fn update(&self, _proxy: Arc<ManagedProxy>) -> Result<(), BackendError> { Ok(()) }
//!     fn status(&self) -> watch::Receiver<BackendStatus> { self.0.subscribe() }
//!     // `record` keeps its default: nothing to prove after an agent restart.
//! }
//!
//! struct PretendBackend;
//!
//! #[async_trait]
//! impl ProxyBackend for PretendBackend {
//!     fn create(&self, _proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle> {
//!         Box::new(Pretend(watch::Sender::new(BackendStatus::default())))
//!     }
//!     // `restore` and `adoption_candidates` keep their defaults: nothing survives an agent
//!     // restart here, so nothing is adopted.
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let catalog = LocalState::new();
//! let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap()).with_proxy(ProxySpec::default());
//! catalog.upsert(web, Source::Api).unwrap();
//!
//! let store = Arc::new(MemorySnapshotStore::new());
//! let mut manager = Manager::new(Arc::new(catalog), Arc::new(PretendBackend), store.clone(), ManagerConfig::default());
//! let view = manager.handle();
//! let mut events = view.subscribe();
//! let shutdown = CancellationToken::new();
//!
//! // Run until the proxy is up, then shut down without stopping it.
//! let stop = shutdown.clone();
//! let watch_events = async move {
//!     while let Ok(_event) = events.recv().await {
//!         if view.status().iter().all(|s| s.state == ProxyState::Running) {
//!             stop.cancel();
//!         }
//!     }
//! };
//! tokio::join!(manager.run(shutdown.clone()), async {
//!     tokio::select! { () = watch_events => {}, () = shutdown.cancelled() => {} }
//! });
//! manager.close().await.unwrap();
//! assert_eq!(store.snapshot().unwrap().proxies[0].id.as_str(), "web-proxy");
//! # }
//! ```
//!
//! # Cargo features
//!
//! | feature | default | what it does |
//! |---|---|---|
//! | `testing` | off | exports `tether_manager::testing`, a test kit for code that drives the engine: `RecordingBackend` (a backend that records every call, in order, and can be told to fail starts and to end proxies), waits with deadlines whose errors name what they waited for (`wait_for`, `wait_until_state`, …), and `RunningManager` (the engine in a task, stopped, closed or killed in one call, its panics carried to the test); the engine then raises a panic of an action again rather than marking the proxy failed. No dependency of its own |
//! | `mock` | off | exports `MockProxyBackend`, `MockProxyHandle` and `MockSnapshotStore`, [`mockall`](https://docs.rs/mockall) mocks of [`ProxyBackend`], [`ProxyHandle`] and [`SnapshotStore`], and, in `tether_manager::testing`, `mock_backend` and `mock_handle`, which give them defaults; turns on `testing`, and `tether-state`'s `mock` feature (`MockCatalog`, reachable as `tether_manager::tether_state::MockCatalog`) |
//!
//! # Testing code that drives the engine
//!
//! Enable the features from `[dev-dependencies]` only, so that they stay out of release
//! builds:
//!
//! ```toml
//! [dev-dependencies]
//! tether-manager = { version = "0.1", features = ["testing"] } # or "mock", which includes it
//! ```
//!
//! What a backend must do, and what the engine does with it (in which order it calls what,
//! two handles of one proxy during a restart, which states a backend reports), is on
//! [`ProxyBackend`] and [`ProxyHandle`].
//!
//! ## Against the recording backend
//!
//! `testing::RecordingBackend` runs nothing: it reports every started proxy running with a
//! pid of its own, records what the engine asks, and does what a backend does when a process
//! exits (it restarts it on the proxy's backoff). A test that a proxy whose process exits is
//! restarted, and that closing the engine leaves it running (compiled and run by
//! `cargo test --doc --features testing`, on tokio's paused clock):
//!
#![cfg_attr(feature = "testing", doc = "```")]
#![cfg_attr(not(feature = "testing"), doc = "```ignore")]
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use tether_manager::testing::{CallKind, RecordingBackend, RunningManager, wait_for_proxy, wait_until_state};
//! use tether_manager::tether_state::{ExitReason, LocalState, ProxySpec, Service, ServiceId, ServiceName, Source};
//! use tether_manager::{Manager, ManagerConfig, MemorySnapshotStore, ProxyState};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let catalog = LocalState::new();
//! let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap());
//! catalog.upsert(web.with_proxy(ProxySpec::default()), Source::Api).unwrap();
//! let id = ServiceId::new("web").unwrap().proxy_id();
//!
//! let backend = RecordingBackend::new();
//! let store = Arc::new(MemorySnapshotStore::new());
//! let manager = Manager::new(Arc::new(catalog), Arc::new(backend.clone()), store, ManagerConfig::default());
//! let running = RunningManager::spawn(manager);
//! let limit = Duration::from_secs(10);
//!
//! let web = wait_until_state(running.handle(), &id, ProxyState::Running, limit).await.unwrap();
//! assert_eq!(web.figures.pid, Some(1001));
//!
//! // Its process exits; the backend restarts it, and counts the restart.
//! backend.exit(&id, ExitReason::Code(1));
//! let web = wait_for_proxy(running.handle(), &id, "has restarted", |web| web.figures.restarts == 1, limit).await.unwrap();
//! assert_eq!((web.state, web.figures.pid), (ProxyState::Running, Some(1002)));
//!
//! // Closing detaches the proxy: it keeps running, for the next engine.
//! running.close().await.unwrap();
//! use CallKind::{Create, Detach, Start};
//! assert_eq!(backend.calls_of(&id), [(Create, 1), (Start, 1), (Detach, 1)]);
//! assert_eq!(backend.running(&id), [1002]);
//! # }
//! ```
//!
//! A wait that does not see its condition by its deadline fails with what it waited for and
//! what it saw last: "timed out after 10s waiting until proxy web-proxy is running; last seen:
//! web-proxy failed (error: cannot start proxy web-proxy: …)". One that outlives the engine
//! ends at once, and `RunningManager` raises a panic of the engine's again, so that a test
//! fails with the panic's own message.
//!
//! ## Against the mocks
//!
//! The mocks let a test say exactly what the backend is asked and answers. A mock checks its
//! expectations when it is dropped, and panics if one was not met; a call that no
//! expectation accepts panics at once (the engine raises that panic again). Without help,
//! every method the engine calls needs an expectation, the traits' default methods included;
//! `testing::mock_backend` and `testing::mock_handle` set defaults for the calls a test is
//! rarely about (`adoption_candidates`, `restored`; `status` — running —, `record`,
//! `detach`, and `adopted` of a restored handle), after the test's own expectations, so that those win: mockall answers a call
//! with the first expectation, in the order they were set, that accepts it. A test that the
//! engine starts a new proxy once, and never stops it, not even when it closes (compiled and
//! run by `cargo test --doc --features mock`):
//!
#![cfg_attr(feature = "mock", doc = "```")]
#![cfg_attr(not(feature = "mock"), doc = "```ignore")]
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use tether_manager::testing::{RunningManager, mock_backend, mock_handle, wait_until_state};
//! use tether_manager::tether_state::{LocalState, ProxySpec, Service, ServiceId, ServiceName, Source};
//! use tether_manager::{Manager, ManagerConfig, MemorySnapshotStore, ProxyState};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! // Started once, never stopped; its status, record and detach keep the defaults.
//! let handle = mock_handle(|handle| {
//!     handle.expect_start().times(1).returning(|| Ok(()));
//!     handle.expect_stop().never();
//! });
//! let backend = mock_backend(|backend| {
//!     backend.expect_create().times(1).return_once(move |proxy| {
//!         assert_eq!(proxy.id().as_str(), "web-proxy");
//!         Box::new(handle)
//!     });
//! });
//!
//! let catalog = LocalState::new();
//! let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap());
//! catalog.upsert(web.with_proxy(ProxySpec::default()), Source::Api).unwrap();
//! let store = Arc::new(MemorySnapshotStore::new());
//! let manager = Manager::new(Arc::new(catalog), Arc::new(backend), store.clone(), ManagerConfig::default());
//! let running = RunningManager::spawn(manager);
//!
//! let id = ServiceId::new("web").unwrap().proxy_id();
//! wait_until_state(running.handle(), &id, ProxyState::Running, Duration::from_secs(10)).await.unwrap();
//! running.close().await.unwrap(); // drops the mocks, which check their expectations
//! assert_eq!(store.snapshot().unwrap().proxies[0].id.as_str(), "web-proxy");
//! # }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod backend;
mod leaves;
mod manager;
mod plan;
mod snapshot;
mod status;
#[cfg(feature = "testing")]
pub mod testing;
mod users;

pub use backend::{
    Adopted, BackendError, BackendRecord, BackendState, BackendStats, BackendStatus, BoxError, Generation, Histogram,
    Meter, ProxyBackend, ProxyHandle, ProxyState, ResourceUsage, StatusChanged,
};
#[cfg(any(test, feature = "mock"))]
pub use backend::{MockProxyBackend, MockProxyHandle};
#[cfg(any(test, feature = "mock"))]
pub use leaves::MockCertificateAuthority;
pub use leaves::{
    CaError, CertificateAuthority, LeafBoard, LeafEvent, LeafEventKind, LeafPolicy, LeafStatus, Leaves, LeavesHandle,
    renewal_point,
};
pub use manager::{Manager, ManagerConfig, ShutdownError};
#[cfg(any(test, feature = "mock"))]
pub use snapshot::MockSnapshotStore;
pub use snapshot::{
    BoxedCause, EncodedSnapshot, FileSnapshotStore, MemorySnapshotStore, OLDEST_SNAPSHOT_VERSION, ProxyRecord,
    SNAPSHOT_VERSION, Snapshot, SnapshotError, SnapshotStore, UnknownVersion,
};
pub use status::{
    ActionKind, ManagerHandle, PASS_BUCKETS, ProxyEvent, ProxyStatus, ReconcileStats, RequestError, UpdateStatus,
};
pub use users::UserLookup;

pub(crate) use tether_state::error_chain;

// What the public signatures need, so that a downstream backend depends on this crate alone.
pub use async_trait::async_trait;
pub use serde_json;
pub use tether_state;
pub use tether_state::{ExitReason, ProcessFigures};
pub use tokio::sync::watch;
pub use tokio_util::sync::CancellationToken;

// The README is the crate's page on crates.io: its example runs as a doctest too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
