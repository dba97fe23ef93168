//! The backend contract as the engine keeps it, seen from a backend: a restart creates the
//! new handle before it stops the old one, an overlapping update runs both handles, and what
//! a backend reports is what the engine shows.

use tether_manager::testing::{CallKind, RecordingBackend, RunningManager, mock_backend, mock_handle, wait_for_proxy};
use tether_manager::tether_state::{Source, UpdatePolicy, UpdateStrategy};
use tether_manager::{BackendState, BackendStatus, ProcessFigures, ProxyState, watch};

use crate::support::{LIMIT, catalog, id, manager, service, with_proxy};

use CallKind::{Create, Start, Stop};

#[tokio::test(start_paused = true)]
async fn a_restart_creates_the_new_handle_before_it_stops_the_old_one() {
    let catalog = catalog(&[service("web")]);
    let backend = RecordingBackend::new();
    let running = RunningManager::spawn(manager(&catalog, backend.clone()));
    let runs = |pid| {
        move |status: &tether_manager::ProxyStatus| {
            status.state == ProxyState::Running && status.figures.pid == Some(pid)
        }
    };
    wait_for_proxy(running.handle(), &id("web"), "runs as pid 1001", runs(1001), LIMIT).await.unwrap();

    // A new environment needs a restart.
    let changed = with_proxy(service("web"), |spec| _ = spec.env.insert("LOG_LEVEL".into(), "debug".into()));
    catalog.upsert(changed, Source::Api).unwrap();
    wait_for_proxy(running.handle(), &id("web"), "runs as pid 1002", runs(1002), LIMIT).await.unwrap();
    // Handle 2 exists while handle 1 still runs: created before the stop, started after it.
    assert_eq!(backend.calls_of(&id("web")), [(Create, 1), (Start, 1), (Create, 2), (Stop, 1), (Start, 2)]);
    let created = backend.calls().into_iter().find(|call| call.kind == Create && call.handle == 2).unwrap();
    assert_eq!(created.proxy.unwrap().spec().env["LOG_LEVEL"], "debug");

    // A restart asked through the handle keeps the same order.
    running.handle().restart(&id("web")).await.unwrap();
    assert_eq!(backend.calls_of(&id("web"))[5..], [(Create, 3), (Stop, 2), (Start, 3)]);
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_overlapping_update_runs_the_new_handle_beside_the_old_one_until_it_is_running() {
    let overlap = |spec: &mut tether_manager::tether_state::ProxySpec| {
        spec.update = UpdatePolicy { strategy: UpdateStrategy::Overlap, ..UpdatePolicy::default() };
    };
    let catalog = catalog(&[with_proxy(service("web"), overlap)]);
    let backend = RecordingBackend::new();
    let running = RunningManager::spawn(manager(&catalog, backend.clone()));
    let first = tether_manager::testing::wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT)
        .await
        .unwrap();

    let changed = with_proxy(service("web"), |spec| {
        overlap(spec);
        spec.env.insert("LOG_LEVEL".into(), "debug".into());
    });
    catalog.upsert(changed, Source::Api).unwrap();
    let second = wait_for_proxy(
        running.handle(),
        &id("web"),
        "has a new process",
        |s| s.figures.pid != first.figures.pid,
        LIMIT,
    )
    .await
    .unwrap();
    assert_eq!(second.figures.pid, Some(1002));
    // Both handles started, and the old one stopped only after the new one ran.
    assert_eq!(backend.calls_of(&id("web")), [(Create, 1), (Start, 1), (Create, 2), (Start, 2), (Stop, 1)]);
    assert_eq!(backend.running(&id("web")), [1002]);
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn what_a_backend_reports_is_shown_as_the_engine_state_of_its_name() {
    let (status, observed) = watch::channel(BackendStatus { state: BackendState::Running, ..BackendStatus::default() });
    let backend = mock_backend(|backend| {
        let handle = mock_handle(|handle| {
            handle.expect_start().times(1).returning(|| Ok(()));
            // Set before the defaults, so this status is the one the engine reads.
            handle.expect_status().returning(move || observed.clone());
        });
        backend.expect_create().times(1).return_once(move |_| Box::new(handle));
    });
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend));
    let states = [
        BackendState::Running,
        BackendState::Backoff,
        BackendState::Starting,
        BackendState::Failed,
        BackendState::Stopping,
        BackendState::Pending,
    ];
    for state in states {
        status.send_modify(|status| status.state = state);
        let shown = ProxyState::from(state);
        let condition = format!("is {shown}");
        wait_for_proxy(running.handle(), &id("web"), &condition, |s| s.state == shown, LIMIT).await.unwrap();
    }
    running.close().await.unwrap();
}

/// A meter with fixed figures, for what the engine makes of them.
struct FixedMeter {
    usage: tether_manager::ResourceUsage,
    stats: tether_manager::BackendStats,
}

impl tether_manager::Meter for FixedMeter {
    fn usage(&self, id: &tether_manager::tether_state::ProxyId, pid: u32) -> Option<tether_manager::ResourceUsage> {
        // Asked for the process the status names.
        assert_eq!((id.as_str(), pid), ("web-proxy", 42), "measures the running instance");
        Some(self.usage)
    }

    fn stats(&self) -> tether_manager::BackendStats {
        self.stats.clone()
    }
}

#[tokio::test(start_paused = true)]
async fn what_a_meter_measures_is_in_the_status_read_and_not_in_events() {
    use std::sync::Arc;
    use std::time::Duration;
    use tether_manager::{BackendStats, Histogram, ProxyEvent, ResourceUsage};

    let usage = ResourceUsage { cpu: Duration::from_millis(1500), memory_bytes: Some(4096), tasks: Some(3) };
    let stats = BackendStats {
        probe_durations: Some(Histogram { bounds: &[0.1, 1.0], counts: vec![2, 1, 0], sum_seconds: 0.7 }),
        foreign_notifications: 5,
    };
    let (status, observed) = watch::channel(BackendStatus {
        state: BackendState::Running,
        figures: ProcessFigures { pid: Some(42), ..ProcessFigures::default() },
        ..BackendStatus::default()
    });
    // The backend's mock needs no word about measuring: the meter is a trait of its own.
    let backend = mock_backend(move |backend| {
        let handle = mock_handle(|handle| {
            handle.expect_start().times(1).returning(|| Ok(()));
            handle.expect_status().returning(move || observed.clone());
        });
        backend.expect_create().times(1).return_once(move |_| Box::new(handle));
    });
    let meter = Arc::new(FixedMeter { usage, stats: stats.clone() });
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend).with_meter(meter));
    let mut events = running.handle().subscribe();
    let shown = wait_for_proxy(running.handle(), &id("web"), "runs as pid 42", |s| s.figures.pid == Some(42), LIMIT)
        .await
        .unwrap();
    assert_eq!(shown.usage.as_deref(), Some(&usage));
    assert_eq!(running.handle().proxy(&id("web")).unwrap().usage.as_deref(), Some(&usage));
    assert_eq!(running.handle().backend_stats(), stats);
    assert_eq!(stats.probe_durations.unwrap().count(), 3);
    // An event is the status as the engine published it: no figures, which would be stale.
    let ProxyEvent::Changed(changed) = events.recv().await.unwrap() else { panic!("a change comes first") };
    assert_eq!(changed.usage, None);
    // Nor a read that asks for none.
    let unmeasured = running.handle().status_unmeasured();
    assert_eq!((unmeasured.len(), unmeasured[0].figures.pid, unmeasured[0].usage.as_deref()), (1, Some(42), None));

    // No process: nothing measured (the meter would fail the test if asked).
    status.send_modify(|status| {
        status.state = BackendState::Backoff;
        status.figures.pid = None;
    });
    let gone = wait_for_proxy(running.handle(), &id("web"), "has no process", |s| s.figures.pid.is_none(), LIMIT)
        .await
        .unwrap();
    assert_eq!(gone.usage, None);
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn without_a_meter_a_status_has_no_usage_and_the_backend_counts_nothing() {
    let backend = RecordingBackend::new();
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend));
    let shown = tether_manager::testing::wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT)
        .await
        .unwrap();
    assert!(shown.figures.pid.is_some());
    assert_eq!(shown.usage, None);
    assert_eq!(running.handle().backend_stats(), tether_manager::BackendStats::default());
    running.close().await.unwrap();
}
