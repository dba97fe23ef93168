//! What every test here builds: catalogs of services with a proxy, and engines over them.

use std::sync::Arc;
use std::time::Duration;

use tether_manager::tether_state::{LocalState, ProxyId, ProxySpec, Service, ServiceId, ServiceName, Source};
use tether_manager::{Manager, ManagerConfig, MemorySnapshotStore, ProxyBackend};

/// How long a wait may take before the test fails: far beyond any backoff of these tests,
/// which run on a paused clock.
pub const LIMIT: Duration = Duration::from_secs(600);

/// A service `name` with a proxy of the default spec.
pub fn service(name: &str) -> Service {
    Service::new(ServiceId::new(name).unwrap(), ServiceName::new(name).unwrap()).with_proxy(ProxySpec::default())
}

/// Changes `service`'s proxy with `change`.
pub fn with_proxy(mut service: Service, change: impl FnOnce(&mut ProxySpec)) -> Service {
    change(service.proxy.as_mut().unwrap());
    service
}

/// The id of service `name`'s proxy.
pub fn id(name: &str) -> ProxyId {
    ServiceId::new(name).unwrap().proxy_id()
}

/// A catalog that wants `services`.
pub fn catalog(services: &[Service]) -> LocalState {
    let catalog = LocalState::new();
    for service in services {
        catalog.upsert(service.clone(), Source::Api).unwrap();
    }
    catalog
}

/// An engine over `catalog` and `backend`, with the default configuration and an empty
/// snapshot.
pub fn manager(catalog: &LocalState, backend: impl ProxyBackend + 'static) -> Manager {
    let store = Arc::new(MemorySnapshotStore::new());
    Manager::new(Arc::new(catalog.clone()), Arc::new(backend), store, ManagerConfig::default())
}

/// The message of the panic that `task` ended with.
pub async fn panic_of<T: std::fmt::Debug>(task: tokio::task::JoinHandle<T>) -> String {
    let ended = tokio::time::timeout(LIMIT, task).await.expect("the task ends, rather than hangs");
    let panic = ended.expect_err("the task panicked").into_panic();
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}
