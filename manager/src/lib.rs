//! The reconcile engine of tether.
//!
//! It keeps the proxies that run equal to the proxies the catalog asks for, through traits,
//! and never touches an operating-system process itself: it owns the decisions (start,
//! stop, restart on change, in place, blocked, failed), the coalescing of catalog changes,
//! the snapshot of what runs, and the two shutdowns. It must never depend on `nix`,
//! `tokio::process` or `tether-proxy-daemon`.
//!
//! - [`Manager`]: the engine; [`ManagerConfig`]: its windows, bounds and root policy, with
//!   the [`UserLookup`] through which the agent tells which users are root.
//! - [`ProxyBackend`] and [`ProxyHandle`]: the seam to whatever runs proxies.
//! - [`SnapshotStore`]: where the snapshot lives ([`FileSnapshotStore`], [`MemorySnapshotStore`]).
//! - [`ManagerHandle`]: statuses, [`ProxyEvent`]s and [`ReconcileStats`] for the API and metrics.
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
//!     BackendError, CancellationToken, Manager, ManagerConfig, MemorySnapshotStore, BackendStatus, ProxyBackend,
//!     ProxyHandle, ProxyState, async_trait, watch,
//! };
//!
//! /// A "process" that is only a status.
//! struct Pretend(watch::Sender<BackendStatus>);
//!
//! #[async_trait]
//! impl ProxyHandle for Pretend {
//!     async fn start(&self) -> Result<(), BackendError> {
//!         self.0.send_modify(|s| s.state = ProxyState::Running);
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
//! | `mock` | off | exports `MockProxyBackend`, `MockProxyHandle` and `MockSnapshotStore`, [`mockall`](https://docs.rs/mockall) mocks of [`ProxyBackend`], [`ProxyHandle`] and [`SnapshotStore`]; turns on `tether-state`'s `mock` feature too (`MockCatalog`, reachable as `tether_manager::tether_state::MockCatalog`) |
//!
//! # Testing against the mocks
//!
//! The engine can be driven against mocks of its seams, so that a test says exactly what
//! the backend is asked and answers. Enable the `mock` feature from `[dev-dependencies]`
//! only, so that it stays out of release builds:
//!
//! ```toml
//! [dev-dependencies]
//! tether-manager = { version = "0.1", features = ["mock"] }
//! ```
//!
//! A mock checks its expectations when it is dropped, and panics if one was not met. Every
//! method the engine calls needs an expectation, the traits' default methods included
//! (`adoption_candidates`, `restored`, `record`, and `adopted` of a restored handle). A
//! test that the engine starts a new proxy once, and detaches it rather than stopping it
//! when it closes (compiled and run by `cargo test --doc --features mock`):
//!
#![cfg_attr(feature = "mock", doc = "```")]
#![cfg_attr(not(feature = "mock"), doc = "```ignore")]
//! use std::sync::Arc;
//!
//! use tether_manager::tether_state::{LocalState, ProxyId, ProxySpec, Service, ServiceId, ServiceName, Source};
//! use tether_manager::{
//!     BackendRecord, BackendStatus, CancellationToken, Manager, ManagerConfig, MemorySnapshotStore, MockProxyBackend,
//!     MockProxyHandle, ProxyState, watch,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // The one proxy's handle: started once, then running as pid 42; detached, never stopped.
//! let (_status, running) =
//!     watch::channel(BackendStatus { state: ProxyState::Running, pid: Some(42), ..Default::default() });
//! let mut handle = MockProxyHandle::new();
//! handle.expect_start().times(1).returning(|| Ok(()));
//! handle.expect_status().returning(move || running.clone());
//! handle.expect_record().returning(BackendRecord::none);
//! handle.expect_detach().times(1).return_const(());
//! handle.expect_stop().never();
//! let mut handle = Some(handle);
//!
//! let mut backend = MockProxyBackend::new();
//! backend.expect_adoption_candidates().returning(Vec::new);
//! backend.expect_restored().times(1).return_const(());
//! backend.expect_create().times(1).returning(move |proxy| {
//!     assert_eq!(proxy.id().as_str(), "web-proxy");
//!     Box::new(handle.take().expect("created once"))
//! });
//!
//! let catalog = LocalState::new();
//! let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap());
//! catalog.upsert(web.with_proxy(ProxySpec::default()), Source::Api).unwrap();
//! let store = Arc::new(MemorySnapshotStore::new());
//! let mut manager = Manager::new(Arc::new(catalog), Arc::new(backend), store.clone(), ManagerConfig::default());
//!
//! let view = manager.handle();
//! let mut events = view.subscribe();
//! let shutdown = CancellationToken::new();
//! let stop = shutdown.clone();
//! tokio::spawn(async move {
//!     let web = ProxyId::parse("web-proxy").unwrap();
//!     while events.recv().await.is_ok() {
//!         if view.proxy(&web).is_some_and(|status| status.pid == Some(42)) {
//!             stop.cancel();
//!         }
//!     }
//! });
//! manager.run(shutdown).await;
//! manager.close().await.unwrap(); // drops the mocks, which check their expectations
//! assert_eq!(store.snapshot().unwrap().proxies[0].id.as_str(), "web-proxy");
//! # }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod backend;
mod manager;
mod plan;
mod snapshot;
mod status;
mod users;

pub use backend::{
    Adopted, BackendError, BackendRecord, BackendStatus, BoxError, ProxyBackend, ProxyHandle, ProxyState,
};
#[cfg(any(test, feature = "mock"))]
pub use backend::{MockProxyBackend, MockProxyHandle};
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
pub use tether_state::ExitReason;
pub use tokio::sync::watch;
pub use tokio_util::sync::CancellationToken;

// The README is the crate's page on crates.io: its example runs as a doctest too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
