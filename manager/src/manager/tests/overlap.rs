//! `update = "overlap"`: the new instance starts beside the old one, which stops only once
//! the new one is ready; an update whose new instance never gets ready leaves the old one
//! serving, with the error, until the next change.

use tether_state::{UpdatePolicy, UpdateStrategy};

use super::*;

fn overlapping(name: &str, timeout: Duration) -> Service {
    let mut service = service(name);
    service.proxy.as_mut().unwrap().update =
        UpdatePolicy { strategy: UpdateStrategy::Overlap, timeout, ..UpdatePolicy::default() };
    service
}

fn changed(mut service: Service, level: &str) -> Service {
    service.proxy.as_mut().unwrap().env.insert("LOG_LEVEL".into(), level.into());
    service
}

#[tokio::test(start_paused = true)]
async fn a_restart_requiring_change_starts_the_new_instance_before_stopping_the_old() {
    let web = overlapping("web", Duration::from_secs(30));
    let running = run(std::slice::from_ref(&web));
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    running.state.upsert(changed(web, "debug"), Source::Api).unwrap();
    running.fake.wait_calls(Call::Stop, 1).await;
    let calls: Vec<Call> = running.fake.state().calls.iter().map(|(_, _, call)| *call).collect();
    assert_eq!(calls, [Call::Start, Call::Start, Call::Stop], "the new instance starts first");
    let second = running.until_state(&pid("web"), ProxyState::Running).await;
    assert_ne!(first.figures.pid, second.figures.pid);
    assert_eq!(running.fake.state().live[&pid("web")].spec().env["LOG_LEVEL"], "debug");
    assert!(second.update.is_none() && second.figures.error.is_none(), "{second:?}");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_old_instance_serves_while_the_new_one_starts_and_status_shows_both() {
    let web = overlapping("web", Duration::from_secs(30));
    let running = run(std::slice::from_ref(&web));
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    running.fake.state().never_ready.insert(pid("web"));
    running.state.upsert(changed(web, "debug"), Source::Api).unwrap();
    running.fake.wait_calls(Call::Start, 2).await;
    let mut events = running.handle.subscribe();
    let during = tokio::time::timeout(LIMIT, async {
        loop {
            if let Some(status) = running.handle.proxy(&pid("web")).filter(|s| s.update.is_some()) {
                return status;
            }
            let _ = events.recv().await;
        }
    })
    .await
    .unwrap();
    assert_eq!(during.state, ProxyState::Running, "the old instance serves: {during:?}");
    assert_eq!(during.figures.pid, first.figures.pid);
    let update = during.update.unwrap();
    assert_eq!(update.state, ProxyState::Starting);
    assert!(update.pid.is_some() && update.pid != first.figures.pid);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_new_instance_that_never_gets_ready_is_abandoned_and_the_old_one_serves_on() {
    let web = overlapping("web", Duration::from_secs(5));
    let running = run(std::slice::from_ref(&web));
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    running.fake.state().never_ready.insert(pid("web"));
    let t0 = Instant::now();
    running.state.upsert(changed(web.clone(), "debug"), Source::Api).unwrap();
    let stops = running.fake.wait_calls(Call::Stop, 1).await;
    assert!(stops[0].0 - t0 >= Duration::from_secs(5), "stopped at {:?}", stops[0].0 - t0);
    let mut events = running.handle.subscribe();
    let after = tokio::time::timeout(LIMIT, async {
        loop {
            if let Some(status) = running.handle.proxy(&pid("web")).filter(|s| s.figures.error.is_some()) {
                return status;
            }
            let _ = events.recv().await;
        }
    })
    .await
    .unwrap();
    assert_eq!(after.state, ProxyState::Running);
    assert_eq!(after.figures.pid, first.figures.pid, "the old instance serves on");
    assert!(after.update.is_none());
    let error = after.figures.error.unwrap();
    assert!(
        error.contains("not ready within update_timeout (5s)") && error.contains("old instance serves on"),
        "{error}"
    );
    assert_eq!(running.fake.state().live[&pid("web")].spec().env.get("LOG_LEVEL"), None);

    // Not tried again on its own: only the next change starts another new instance.
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(running.fake.calls_of(Call::Start).len(), 2);
    running.fake.state().never_ready.clear();
    running.state.upsert(changed(web, "info"), Source::Api).unwrap();
    running.fake.wait_calls(Call::Stop, 2).await;
    let last = running.until_state(&pid("web"), ProxyState::Running).await;
    assert_eq!(running.fake.state().live[&pid("web")].spec().env["LOG_LEVEL"], "info");
    assert!(last.figures.error.is_none(), "{last:?}");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_restart_asked_through_the_handle_overlaps_too() {
    let running = run(&[overlapping("web", Duration::from_secs(30))]);
    let before = running.until_state(&pid("web"), ProxyState::Running).await;
    tokio::time::timeout(LIMIT, running.handle.restart(&pid("web"))).await.unwrap().unwrap();
    let calls: Vec<Call> = running.fake.state().calls.iter().map(|(_, _, call)| *call).collect();
    assert_eq!(calls, [Call::Start, Call::Start, Call::Stop]);
    let after = running.handle.proxy(&pid("web")).unwrap();
    assert_eq!(after.state, ProxyState::Running);
    assert_ne!(after.figures.pid, before.figures.pid);
    assert_eq!(running.fake.live_ids(), ["web-proxy"]);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_does_not_wait_for_an_overlap_and_keeps_the_old_instance() {
    let web = overlapping("web", Duration::from_secs(300));
    let running = run(std::slice::from_ref(&web));
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    running.fake.state().never_ready.insert(pid("web"));
    running.state.upsert(changed(web, "debug"), Source::Api).unwrap();
    running.fake.wait_calls(Call::Start, 2).await;
    let t0 = Instant::now();
    let fake = running.fake.clone();
    let manager = running.stop().await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(300), "the shutdown waited {:?}", t0.elapsed());
    let calls: Vec<Call> = fake.state().calls.iter().map(|(_, _, call)| *call).collect();
    assert_eq!(
        calls,
        [Call::Start, Call::Start, Call::Stop, Call::Detach],
        "the new one stopped, the old one left running"
    );
    assert_eq!(fake.state().live[&pid("web")].spec().env.get("LOG_LEVEL"), None, "the old instance runs on");
    assert!(first.figures.pid.is_some());
}

#[tokio::test(start_paused = true)]
async fn a_restored_process_whose_spec_is_not_known_is_replaced_by_an_overlap() {
    // After a crash during an update, the backend kept the old instance, which serves, and
    // cannot say which spec it runs: the update is done again, the old one serving meanwhile.
    let web = overlapping("web", Duration::from_secs(30));
    let state = catalog(&[changed(web.clone(), "debug")]);
    let fake = Fake::new();
    let old = catalog(std::slice::from_ref(&web)).changes_since(None).upserted[0].proxy.clone();
    fake.state().live.insert(pid("web"), old);
    fake.state().candidates.push(pid("web"));
    fake.state().adopted.insert(pid("web"), crate::Adopted::Unknown);
    let store = Arc::new(MemorySnapshotStore::corrupt());
    let running = run_with(&state, &fake, &store, ManagerConfig::default());
    fake.wait_calls(Call::Stop, 1).await;
    let calls: Vec<Call> = fake.state().calls.iter().map(|(_, _, call)| *call).collect();
    assert_eq!(calls, [Call::Restore, Call::Start, Call::Stop], "the new instance starts first");
    assert_eq!(fake.state().live[&pid("web")].spec().env["LOG_LEVEL"], "debug");
    let after = running.until_state(&pid("web"), ProxyState::Running).await;
    assert!(after.update.is_none() && after.figures.error.is_none(), "{after:?}");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_process_kept_instead_of_its_record_and_proven_to_run_the_wanted_proxy_is_not_restarted() {
    // The snapshot still names the old instance of an update that completed: the backend
    // kept the new one, which runs what is wanted.
    let web = overlapping("web", Duration::from_secs(30));
    let state = catalog(&[changed(web.clone(), "debug")]);
    let wanted = state.changes_since(None).upserted[0].proxy.clone();
    let fake = Fake::new();
    fake.state().live.insert(pid("web"), wanted.clone());
    fake.state().adopted.insert(pid("web"), crate::Adopted::Desired);
    let stale = ProxyRecord {
        id: pid("web"),
        service: Some(web),
        token: Some(wanted.token().fingerprint()),
        backend: record_of(serde_json::json!({ "proof": "web-proxy", "pid": 5 })),
    };
    let store = Arc::new(MemorySnapshotStore::with_snapshot(Snapshot::new(vec![stale])));
    let running = run_with(&state, &fake, &store, ManagerConfig::default());
    running.until_state(&pid("web"), ProxyState::Running).await;
    let mut saves = store.saves();
    tokio::time::timeout(LIMIT, saves.wait_for(|_| store.snapshot().is_some_and(|s| s.proxies.len() == 1)))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(fake.calls_of(Call::Start).is_empty() && fake.calls_of(Call::Stop).is_empty(), "kept as it runs");
    let record = &store.snapshot().unwrap().proxies[0];
    assert_eq!(
        record.service.as_ref().and_then(|s| s.proxy.as_ref()).map(|p| &p.env["LOG_LEVEL"]),
        Some(&"debug".into())
    );
    running.stop().await;
}
