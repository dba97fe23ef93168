//! A tiny agent built on tether's library crates, the way another project builds one: it
//! depends on `tether-state`, `tether-manager` and `tether-proxy-daemon` (the supervisor
//! alone, without its engine adapter) and uses only their public APIs.
//!
//! - [`SupervisorBackend`]: its own [`ProxyBackend`], which runs each proxy's command as an
//!   OS process through `tether-proxy-daemon`'s `Supervisor`.
//! - [`CatalogWatcher`]: a task that follows the catalog's change notifications and reports
//!   which proxies changed.
//! - [`engine`]: the engine over a catalog and a backend, as this agent configures it.
//!
//! It exists to be tested from `tests/`, as a stranger tests code that drives the engine: with
//! `tether-manager`'s test kit and mocks, and against real processes. It never touches a
//! process but through the supervisor.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod backend;
mod watcher;

use std::sync::Arc;
use std::time::Duration;

use tether_manager::{Manager, ManagerConfig, MemorySnapshotStore, ProxyBackend};
use tether_state::LocalState;

pub use backend::{SupervisorBackend, UnsupportedProxy};
pub use watcher::{CatalogChange, CatalogWatcher};

/// The engine of this agent: over `catalog` and `backend`, with its snapshot kept in memory
/// (this agent adopts nothing after a restart), and a catalog change applied after 50ms
/// without a further one.
pub fn engine(catalog: &LocalState, backend: Arc<dyn ProxyBackend>) -> Manager {
    let config = ManagerConfig { sync_quiescent: Duration::from_millis(50), ..ManagerConfig::default() };
    Manager::new(Arc::new(catalog.clone()), backend, Arc::new(MemorySnapshotStore::new()), config)
}
