//! The engine over a backend of one's own, built only on `tether-manager`'s public API.
//!
//! The backend here runs no process: each proxy is a status that turns `running` when it is
//! started. The example registers two services, runs the engine until both proxies run,
//! deregisters one, waits until it is gone, and shuts down, printing what it sees.
//!
//! `cargo run -p tether-manager --example custom_backend`

#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use tether_manager::tether_state::{
    LocalState, ManagedProxy, ProxyId, ProxySpec, Service, ServiceId, ServiceName, Source, SourceKind,
};
use tether_manager::{
    BackendError, BackendState, BackendStatus, CancellationToken, Manager, ManagerConfig, ManagerHandle,
    MemorySnapshotStore, ProxyBackend, ProxyHandle, ProxyState, async_trait, watch,
};

/// One proxy of the pretend backend: only a status.
struct PretendProxy {
    id: ProxyId,
    status: watch::Sender<BackendStatus>,
}

#[async_trait]
impl ProxyHandle for PretendProxy {
    async fn start(&self) -> Result<(), BackendError> {
        // The backend, not the engine, says that the proxy runs.
        self.status.send_modify(|status| status.state = BackendState::Running);
        println!("started {}", self.id);
        Ok(())
    }

    async fn stop(&self) -> Result<(), BackendError> {
        println!("stopped {}", self.id);
        Ok(())
    }

    async fn detach(&self) {}

    async fn update(&self, _proxy: Arc<ManagedProxy>) -> Result<(), BackendError> {
        Ok(())
    }

    fn status(&self) -> watch::Receiver<BackendStatus> {
        self.status.subscribe()
    }
    // `record` keeps its default: a pretend proxy has nothing to prove after a restart.
}

struct PretendBackend;

#[async_trait]
impl ProxyBackend for PretendBackend {
    fn create(&self, proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle> {
        Box::new(PretendProxy { id: proxy.id().clone(), status: watch::Sender::new(BackendStatus::default()) })
    }
    // `restore` and `adoption_candidates` keep their defaults: nothing is adopted.
}

fn service(name: &str) -> Service {
    Service::new(ServiceId::new(name).expect("a valid id"), ServiceName::new(name).expect("a valid name"))
        .with_proxy(ProxySpec::default())
}

/// Waits until `done` holds for the engine's statuses, or fails after ten seconds.
async fn until(view: &ManagerHandle, what: &str, done: impl Fn(&[tether_manager::ProxyStatus]) -> bool) {
    let mut events = view.subscribe();
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !done(&view.status()) {
            if events.recv().await.is_err() {
                events = view.subscribe();
            }
        }
    });
    waited.await.unwrap_or_else(|_| panic!("timed out waiting until {what}"));
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let catalog = LocalState::new();
    for name in ["web", "db"] {
        catalog.upsert(service(name), Source::Api).expect("a new service");
    }
    let config = ManagerConfig { sync_quiescent: Duration::from_millis(10), ..ManagerConfig::default() };
    let store = Arc::new(MemorySnapshotStore::new());
    let mut manager = Manager::new(Arc::new(catalog.clone()), Arc::new(PretendBackend), store.clone(), config);
    let view = manager.handle();
    let shutdown = CancellationToken::new();

    let steps = async {
        until(&view, "both proxies run", |all| all.len() == 2 && all.iter().all(|p| p.state == ProxyState::Running))
            .await;
        catalog.remove(&ServiceId::new("db").expect("a valid id"), &SourceKind::Api).expect("a known service");
        until(&view, "db-proxy is gone", |all| all.len() == 1).await;
        for proxy in view.status() {
            println!("{} {}", proxy.id, proxy.state);
        }
        shutdown.cancel();
    };
    tokio::join!(manager.run(shutdown.clone()), steps);
    manager.close().await.expect("the snapshot is written");
    let snapshot = store.snapshot().expect("a snapshot");
    println!("snapshot: {:?}", snapshot.proxies.iter().map(|p| p.id.as_str()).collect::<Vec<_>>());
}
