//! Tests of the engine's snapshot: what close and kill leave in it, when it is written, and
//! restore from it (records, the backend's candidates, older formats).

use super::*;

#[tokio::test(start_paused = true)]
async fn close_detaches_every_proxy_and_keeps_it_in_the_snapshot() {
    let running = run(&[service("web"), service("db")]);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.until_state(&pid("db"), ProxyState::Running).await;
    let (fake, store) = (running.fake.clone(), running.store.clone());
    let manager = running.stop().await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
    assert_eq!(fake.calls_of(Call::Detach).len(), 2);
    assert!(fake.calls_of(Call::Stop).is_empty());
    assert_eq!(fake.live_ids(), ["db-proxy", "web-proxy"]);
    let ids: Vec<String> = store.snapshot().unwrap().proxies.iter().map(|r| r.id.to_string()).collect();
    assert_eq!(ids, ["db-proxy", "web-proxy"]);
}

#[tokio::test(start_paused = true)]
async fn kill_stops_every_proxy_in_parallel_and_empties_the_snapshot() {
    let running = run(&[service("a"), service("b"), service("c")]);
    for name in ["a", "b", "c"] {
        running.until_state(&pid(name), ProxyState::Running).await;
    }
    let (fake, store) = (running.fake.clone(), running.store.clone());
    for name in ["a", "b", "c"] {
        fake.state().stop_delay.insert(pid(name), Duration::from_secs(5));
    }
    let manager = running.stop().await;
    let t0 = Instant::now();
    tokio::time::timeout(LIMIT, manager.kill()).await.unwrap().unwrap();
    assert_eq!(Instant::now() - t0, Duration::from_secs(5), "three 5s stops run in parallel");
    assert!(fake.live_ids().is_empty());
    assert!(fake.calls_of(Call::Detach).is_empty());
    assert_eq!(store.snapshot().unwrap().proxies, []);
}

#[tokio::test(start_paused = true)]
async fn kill_reports_proxies_that_did_not_stop() {
    let running = run(&[service("web")]);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.fake.state().script.push_back((true, 0));
    let (fake, store) = (running.fake.clone(), running.store.clone());
    let manager = running.stop().await;
    let err = tokio::time::timeout(LIMIT, manager.kill()).await.unwrap().unwrap_err();
    assert!(matches!(&err, ShutdownError::Stop { failed, .. } if failed == &[pid("web")]), "{err:?}");
    assert_eq!(fake.live_ids(), ["web-proxy"]);
    assert_eq!(store.snapshot().unwrap().proxies.len(), 1, "a proxy that still runs stays in the snapshot");
}

#[tokio::test(start_paused = true)]
async fn snapshot_is_written_only_when_its_content_changes() {
    let running = run(&[service("web")]);
    let mut saves = running.store.saves();
    running.until_state(&pid("web"), ProxyState::Running).await;
    tokio::time::timeout(LIMIT, saves.wait_for(|n| *n == 1)).await.unwrap().unwrap();
    let recorded = running.store.snapshot().unwrap();
    let record = &recorded.proxies[0];
    assert_eq!(record.token.as_ref(), Some(&running.state.tokens()[&pid("web")].fingerprint()));
    let text = serde_json::to_string(&recorded).unwrap();
    assert!(!text.contains(running.state.tokens()[&pid("web")].expose()), "no secret in the snapshot");

    // A status change that leaves the record as it was writes nothing.
    let before = running.handle.proxy(&pid("web")).unwrap();
    running.state.upsert(with_user("db"), Source::Api).unwrap();
    running.until_state(&pid("db"), ProxyState::Running).await;
    tokio::time::timeout(LIMIT, saves.wait_for(|n| *n == 2)).await.unwrap().unwrap();
    assert_eq!(running.handle.proxy(&pid("web")).unwrap(), before);
    let store = running.store.clone();
    let manager = running.stop().await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
    assert_eq!(*saves.borrow(), 2, "closing changed nothing, so it wrote nothing");
    assert_eq!(store.snapshot().unwrap().proxies.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_backend_restart_rewrites_the_snapshot_with_the_new_pid() {
    // The mock handle's status sender lets the test play the backend's supervisor.
    let (status, receiver) = watch::channel(BackendStatus {
        state: BackendState::Running,
        figures: ProcessFigures { pid: Some(10), ..ProcessFigures::default() },
        ..Default::default()
    });
    let status = Arc::new(status);
    let mut handle = MockProxyHandle::new();
    handle.expect_on_status_change().returning(|_| false);
    handle.expect_start().returning(|| Ok(()));
    handle.expect_status().returning(move || receiver.clone());
    let reader = status.clone();
    handle.expect_record().returning(move || record_of(serde_json::json!({ "pid": reader.borrow().figures.pid })));
    handle.expect_detach().returning(|| ());
    let mut handle = Some(handle);
    let mut backend = MockProxyBackend::new();
    backend.expect_adoption_candidates().returning(Vec::new);
    backend.expect_restored().times(1).return_const(());
    backend.expect_create().times(1).returning(move |_| Box::new(handle.take().unwrap()));
    let store = Arc::new(MemorySnapshotStore::new());
    let state = catalog(&[service("web")]);
    let manager = Manager::new(Arc::new(state), Arc::new(backend), store.clone(), ManagerConfig::default());
    let view = manager.handle();
    let (shutdown, task) = spawn_run(manager);
    let mut saves = store.saves();
    tokio::time::timeout(LIMIT, saves.wait_for(|n| *n == 1)).await.unwrap().unwrap();
    status.send_modify(|s| {
        s.state = BackendState::Running;
        s.figures.pid = Some(11);
        s.figures.restarts = 1;
        s.figures.last_exit = Some(crate::ExitReason::Code(3));
    });
    tokio::time::timeout(LIMIT, saves.wait_for(|n| *n == 2)).await.unwrap().unwrap();
    assert_eq!(store.snapshot().unwrap().proxies[0].backend, record_of(serde_json::json!({ "pid": 11 })));
    let shown = view.proxy(&pid("web")).unwrap();
    assert_eq!(
        (shown.figures.pid, shown.figures.restarts, shown.figures.last_exit),
        (Some(11), 1, Some(crate::ExitReason::Code(3)))
    );
    shutdown.cancel();
    let manager = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn restore_adopts_a_proven_proxy_without_restarting_it() {
    let first = run(&[service("web")]);
    let web = first.until_state(&pid("web"), ProxyState::Running).await;
    let (state, fake, store) = (first.state.clone(), first.fake.clone(), first.store.clone());
    tokio::time::timeout(LIMIT, first.stop().await.close()).await.unwrap().unwrap();

    let second = run_with(&state, &fake, &store, ManagerConfig::default());
    fake.wait_calls(Call::Update, 1).await;
    let adopted = second.until_state(&pid("web"), ProxyState::Running).await;
    assert_eq!(adopted.figures.pid, web.figures.pid);
    assert_eq!(fake.calls_of(Call::Restore).len(), 1);
    assert_eq!((second.handle.stats().adopted, second.handle.stats().dropped), (1, 0));
    assert_eq!(fake.calls_of(Call::Start).len(), 1, "only the first agent started it");
    assert!(fake.calls_of(Call::Stop).is_empty());
    assert!(fake.state().ran_twice.is_empty());
    second.stop().await;
}

#[tokio::test(start_paused = true)]
async fn restore_drops_a_record_the_backend_cannot_prove() {
    let ghost = ProxyRecord {
        id: pid("web"),
        service: None,
        token: None,
        backend: record_of(serde_json::json!({ "pid": 4242 })),
    };
    let store = Arc::new(MemorySnapshotStore::with_snapshot(Snapshot::new(vec![ghost])));
    let mut backend = MockProxyBackend::new();
    backend.expect_restore().times(1).returning(|_, _, _| None);
    backend.expect_adoption_candidates().returning(Vec::new);
    backend.expect_restored().times(1).return_const(());
    backend.expect_create().times(1).returning(|_| Box::new(mock_handle(Ok(()))));
    let manager =
        Manager::new(Arc::new(catalog(&[service("web")])), Arc::new(backend), store.clone(), ManagerConfig::default());
    let view = manager.handle();
    let (shutdown, task) = spawn_run(manager);
    let mut saves = store.saves();
    // First the stale record is dropped, then the new process is recorded.
    tokio::time::timeout(LIMIT, saves.wait_for(|n| *n >= 1)).await.unwrap().unwrap();
    tokio::time::timeout(LIMIT, saves.wait_for(|_| store.snapshot().is_some_and(|s| s.proxies.len() == 1)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(store.snapshot().unwrap().proxies[0].backend, record_of(serde_json::json!({ "pid": 7 })));
    assert_eq!((view.stats().adopted, view.stats().dropped), (0, 1));
    assert!(view.stats().snapshot_writes >= 1);
    shutdown.cancel();
    let manager = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn corrupt_snapshot_falls_back_to_the_backends_candidates_and_keeps_a_proven_one() {
    let fake = Fake::new();
    // A proxy from an earlier agent still runs, and the backend finds it without a snapshot;
    // restoring it against the wanted proxy proves that it runs that proxy.
    let state = catalog(&[service("web")]);
    let old = state.changes_since(None).upserted[0].proxy.clone();
    fake.state().live.insert(pid("web"), old);
    fake.state().candidates.push(pid("web"));
    let store = Arc::new(MemorySnapshotStore::corrupt());
    let running = run_with(&state, &fake, &store, ManagerConfig::default());
    running.until_state(&pid("web"), ProxyState::Running).await;
    let mut saves = store.saves();
    tokio::time::timeout(LIMIT, saves.wait_for(|_| store.snapshot().is_some_and(|s| s.proxies.len() == 1)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(fake.calls_of(Call::Restore).len(), 1);
    assert!(fake.calls_of(Call::Start).is_empty(), "a proven candidate is not restarted");
    assert!(fake.calls_of(Call::Stop).is_empty());
    let record = &store.snapshot().unwrap().proxies[0];
    assert!(record.service.is_some() && record.token.is_some(), "the snapshot now says what it runs");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_adopted_candidate_that_is_no_longer_wanted_is_stopped() {
    let fake = Fake::new();
    let old = catalog(&[service("gone")]).changes_since(None).upserted[0].proxy.clone();
    fake.state().live.insert(pid("gone"), old);
    fake.state().candidates.push(pid("gone"));
    let store = Arc::new(MemorySnapshotStore::corrupt());
    let running = run_with(&catalog(&[]), &fake, &store, ManagerConfig::default());
    fake.wait_calls(Call::Stop, 1).await;
    assert!(fake.calls_of(Call::Start).is_empty());
    assert!(!fake.state().live.contains_key(&pid("gone")));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn restore_is_given_the_wanted_proxy_and_nothing_for_an_unwanted_one() {
    let record = |name: &str| ProxyRecord {
        id: pid(name),
        service: None,
        token: None,
        backend: record_of(serde_json::json!({})),
    };
    let store = Arc::new(MemorySnapshotStore::with_snapshot(Snapshot::new(vec![record("gone"), record("web")])));
    let mut backend = MockProxyBackend::new();
    backend
        .expect_restore()
        .withf(|id, _, desired| id == &pid("web") && desired.as_ref().is_some_and(|p| p.id() == &pid("web")))
        .times(1)
        .returning(|_, _, _| None);
    backend
        .expect_restore()
        .withf(|id, _, desired| id == &pid("gone") && desired.is_none())
        .times(1)
        .returning(|_, _, _| None);
    backend.expect_adoption_candidates().returning(Vec::new);
    backend.expect_restored().times(1).return_const(());
    backend.expect_create().times(1).returning(|_| Box::new(mock_handle(Ok(()))));
    let manager =
        Manager::new(Arc::new(catalog(&[service("web")])), Arc::new(backend), store.clone(), ManagerConfig::default());
    let handle = manager.handle();
    let (shutdown, task) = spawn_run(manager);
    let mut events = handle.subscribe();
    tokio::time::timeout(LIMIT, async {
        while handle.proxy(&pid("web")).is_none_or(|s| s.state != ProxyState::Running) {
            let _ = events.recv().await;
        }
    })
    .await
    .unwrap();
    shutdown.cancel();
    // Dropping the manager checks both restore expectations.
    drop(tokio::time::timeout(LIMIT, task).await.unwrap().unwrap());
}

#[tokio::test(start_paused = true)]
async fn a_proxy_started_after_the_last_snapshot_write_is_adopted_from_its_candidate_not_run_twice() {
    let fake = Fake::new();
    let state = catalog(&[service("web"), service("late")]);
    let proxies: Vec<_> = state.changes_since(None).upserted.into_iter().map(|d| d.proxy).collect();
    for proxy in &proxies {
        fake.state().live.insert(proxy.id().clone(), proxy.clone());
    }
    // The snapshot knows only `web`; `late` was started after its last write, and the
    // agent was killed before the next one. The backend still finds `late` (pid file).
    let web = ProxyRecord {
        id: pid("web"),
        service: Some(proxies[1].service().clone()),
        token: Some(proxies[1].token().fingerprint()),
        backend: record_of(serde_json::json!({ "proof": "web-proxy", "pid": 5 })),
    };
    assert_eq!(proxies[1].id(), &pid("web"));
    fake.state().candidates.extend([pid("late"), pid("web")]);
    let store = Arc::new(MemorySnapshotStore::with_snapshot(Snapshot::new(vec![web])));
    let running = run_with(&state, &fake, &store, ManagerConfig::default());
    running.until_state(&pid("late"), ProxyState::Running).await;
    running.until_state(&pid("web"), ProxyState::Running).await;
    assert!(fake.calls_of(Call::Start).is_empty(), "both were adopted, none started again");
    assert_eq!(fake.calls_of(Call::Restore).len(), 2, "the candidate of an adopted id is not restored");
    assert!(fake.state().ran_twice.is_empty());
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_unprovable_snapshot_record_falls_back_to_the_candidate_of_its_id() {
    let fake = Fake::new();
    let state = catalog(&[service("web")]);
    let proxy = state.changes_since(None).upserted[0].proxy.clone();
    fake.state().live.insert(pid("web"), proxy.clone());
    fake.state().candidates.push(pid("web"));
    // A stale record (the process was restarted after the last write): it proves nothing.
    let stale = ProxyRecord {
        id: pid("web"),
        service: Some(proxy.service().clone()),
        token: Some(proxy.token().fingerprint()),
        backend: record_of(serde_json::json!({ "proof": "another process", "pid": 4 })),
    };
    let store = Arc::new(MemorySnapshotStore::with_snapshot(Snapshot::new(vec![stale])));
    let running = run_with(&state, &fake, &store, ManagerConfig::default());
    running.until_state(&pid("web"), ProxyState::Running).await;
    assert!(fake.calls_of(Call::Start).is_empty(), "adopted through its candidate, not started again");
    assert_eq!(fake.calls_of(Call::Restore).len(), 2);
    assert_eq!((running.handle.stats().adopted, running.handle.stats().dropped), (1, 1));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_snapshot_of_an_older_format_is_written_again_after_restore_though_nothing_changed() {
    for (migrated_from, writes) in [(None, 0), (Some(1), 1)] {
        let first = run(&[service("web")]);
        first.until_state(&pid("web"), ProxyState::Running).await;
        let (state, fake, memory) = (first.state.clone(), first.fake.clone(), first.store.clone());
        tokio::time::timeout(LIMIT, first.stop().await.close()).await.unwrap().unwrap();
        let mut snapshot = memory.snapshot().unwrap();
        snapshot.migrated_from = migrated_from;

        let saves = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut store = crate::MockSnapshotStore::new();
        store.expect_load().returning(move || Ok(Some(snapshot.clone())));
        let counter = saves.clone();
        store.expect_save().returning(move |_| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        });
        let manager = Manager::new(Arc::new(state), Arc::new(fake.clone()), Arc::new(store), ManagerConfig::default());
        let view = manager.handle();
        let (shutdown, task) = spawn_run(manager);
        let mut events = view.subscribe();
        tokio::time::timeout(LIMIT, async {
            while view.proxy(&pid("web")).is_none_or(|status| status.state != ProxyState::Running) {
                let _ = events.recv().await;
            }
        })
        .await
        .unwrap();
        shutdown.cancel();
        let manager = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
        tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
        assert_eq!(fake.calls_of(Call::Start).len(), 1, "adopted, not started again");
        assert_eq!(saves.load(std::sync::atomic::Ordering::SeqCst), writes, "migrated from {migrated_from:?}");
    }
}
