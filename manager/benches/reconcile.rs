//! Reconcile cost with a fast fake backend: the initial reconcile of 10 000 proxies, and one
//! change in a catalog of 10 000 (which must cost the change, not the catalog).
//!
//! Run with `cargo bench -p tether-manager`. Plain `std::time::Instant`, medians over many
//! repetitions; no processes are spawned.

#![allow(clippy::print_stdout)] // A bench reports on stdout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tether_manager::{
    BackendError, BackendState, BackendStatus, Manager, ManagerConfig, MemorySnapshotStore, ProxyBackend, ProxyHandle,
    ProxyState,
};
use tether_state::{LocalState, ManagedProxy, ProxySpec, Service, ServiceId, ServiceName, Source};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const PROXIES: usize = 10_000;
const REPETITIONS: usize = 2_000;

/// Completes every operation at once and counts them.
struct FastBackend {
    done: watch::Sender<u64>,
}

struct FastHandle {
    status: watch::Sender<BackendStatus>,
    done: watch::Sender<u64>,
}

#[async_trait]
impl ProxyHandle for FastHandle {
    async fn start(&self) -> Result<(), BackendError> {
        self.status.send_modify(|s| {
            s.state = BackendState::Running;
            s.figures.pid = Some(1);
        });
        self.done.send_modify(|n| *n += 1);
        Ok(())
    }
    async fn stop(&self) -> Result<(), BackendError> {
        self.done.send_modify(|n| *n += 1);
        Ok(())
    }
    async fn detach(&self) {}
    async fn update(&self, _proxy: Arc<ManagedProxy>) -> Result<(), BackendError> {
        self.done.send_modify(|n| *n += 1);
        Ok(())
    }
    fn status(&self) -> watch::Receiver<BackendStatus> {
        self.status.subscribe()
    }
}

#[async_trait]
impl ProxyBackend for FastBackend {
    fn create(&self, _proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle> {
        Box::new(FastHandle { status: watch::Sender::new(BackendStatus::default()), done: self.done.clone() })
    }
}

fn service(index: usize, port: u16) -> Service {
    let name = format!("svc{index}");
    let mut service =
        Service::new(ServiceId::new(&name).unwrap(), ServiceName::new(name).unwrap()).with_proxy(ProxySpec::default());
    service.port = Some(port);
    service
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

async fn bench() {
    let state = LocalState::new();
    let entries = (0..PROXIES).map(|i| (service(i, 1), Source::Api)).collect();
    state.replace_source(&tether_state::SourceKind::Api, entries).unwrap();
    let done = watch::Sender::new(0u64);
    let backend = FastBackend { done: done.clone() };
    let config =
        ManagerConfig { sync_quiescent: Duration::ZERO, sync_max_delay: Duration::ZERO, ..ManagerConfig::default() };
    let mut manager =
        Manager::new(Arc::new(state.clone()), Arc::new(backend), Arc::new(MemorySnapshotStore::new()), config);
    let view = manager.handle();
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let mut finished = done.subscribe();

    let started = Instant::now();
    let task = tokio::spawn(async move {
        manager.run(token).await;
        manager
    });
    finished.wait_for(|n| *n >= PROXIES as u64).await.unwrap();
    while view.stats().in_flight > 0 || view.stats().queued > 0 {
        tokio::task::yield_now().await;
    }
    let initial = started.elapsed();
    let first_pass = view.stats().last_duration;
    assert_eq!(view.status().iter().filter(|s| s.state == ProxyState::Running).count(), PROXIES);
    println!("initial reconcile of {PROXIES} proxies: {initial:?} to all running (first pass: {first_pass:?})");

    let mut latencies = Vec::with_capacity(REPETITIONS);
    let mut passes = Vec::with_capacity(REPETITIONS);
    for repetition in 0..REPETITIONS {
        let target = *finished.borrow() + 1;
        let index = repetition * 7 % PROXIES;
        let at = Instant::now();
        state
            .upsert(service(index, 2 + (repetition % 2) as u16 + (repetition as u16 % 1000) * 2), Source::Api)
            .unwrap();
        finished.wait_for(|n| *n >= target).await.unwrap();
        latencies.push(at.elapsed());
        passes.push(view.stats().last_duration);
    }
    println!(
        "one in-place change in {PROXIES}: median {:?} end to end (catalog write to update applied), median pass {:?}, over {REPETITIONS} repetitions",
        median(latencies),
        median(passes),
    );
    shutdown.cancel();
    let manager = task.await.unwrap();
    manager.close().await.unwrap();
}

fn main() {
    // Two workers, as on the agent's machine: the snapshot writer runs beside the engine.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_time().build().unwrap();
    runtime.block_on(bench());
}
