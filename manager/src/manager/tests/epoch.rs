//! `update = "epoch"`: the new generation starts beside the old one, as in an overlapping
//! update, and the old one is then left to drain (never stopped by the engine); a change
//! waits while `max_generations` generations live; a new generation that fails leaves the
//! old one current.

use tether_state::{UpdatePolicy, UpdateStrategy};

use super::*;

fn epoch(name: &str, timeout: Duration, max_generations: u32) -> Service {
    let mut service = service(name);
    service.proxy.as_mut().unwrap().update =
        UpdatePolicy { strategy: UpdateStrategy::Epoch, timeout, max_generations, ..UpdatePolicy::default() };
    service
}

fn changed(mut service: Service, level: &str) -> Service {
    service.proxy.as_mut().unwrap().env.insert("LOG_LEVEL".into(), level.into());
    service
}

/// The first status of `id` that `until` accepts, with a deadline.
async fn status_where(running: &Running, id: &ProxyId, until: impl Fn(&ProxyStatus) -> bool) -> ProxyStatus {
    let mut events = running.handle.subscribe();
    tokio::time::timeout(LIMIT, async {
        loop {
            if let Some(status) = running.handle.proxy(id).filter(|s| until(s)) {
                return status;
            }
            let _ = events.recv().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no such status of {id}: {:?}", running.handle.proxy(id)))
}

#[tokio::test(start_paused = true)]
async fn a_hot_restart_lets_the_old_generation_drain_instead_of_stopping_it() {
    let web = epoch("web", Duration::from_secs(30), 3);
    let running = run(std::slice::from_ref(&web));
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    running.state.upsert(changed(web, "debug"), Source::Api).unwrap();
    running.fake.wait_calls(Call::Drain, 1).await;
    let calls: Vec<Call> = running.fake.state().calls.iter().map(|(_, _, call)| *call).collect();
    assert_eq!(calls, [Call::Start, Call::Start, Call::Drain], "the old generation is never stopped");
    let second =
        status_where(&running, &pid("web"), |s| s.figures.pid != first.figures.pid && s.state == ProxyState::Running)
            .await;
    assert!(second.figures.error.is_none() && second.update.is_none(), "{second:?}");
    assert_eq!(running.fake.state().live[&pid("web")].spec().env["LOG_LEVEL"], "debug");

    // `tether restart` is a hot restart too.
    tokio::time::timeout(LIMIT, running.handle.restart(&pid("web"))).await.unwrap().unwrap();
    assert_eq!(running.fake.calls_of(Call::Drain).len(), 2);
    assert!(running.fake.calls_of(Call::Stop).is_empty());
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_new_generation_that_never_gets_ready_is_stopped_and_the_old_one_stays_current() {
    let web = epoch("web", Duration::from_secs(5), 3);
    let running = run(std::slice::from_ref(&web));
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    running.fake.state().never_ready.insert(pid("web"));
    running.state.upsert(changed(web, "debug"), Source::Api).unwrap();
    running.fake.wait_calls(Call::Stop, 1).await;
    let after = status_where(&running, &pid("web"), |s| s.figures.error.is_some()).await;
    assert_eq!(
        (after.state, after.figures.pid),
        (ProxyState::Running, first.figures.pid),
        "the old generation serves on"
    );
    let error = after.figures.error.unwrap();
    assert!(
        error.contains("hot restart abandoned, the old generation serves on")
            && error.contains("the new generation was not ready within update_timeout (5s)"),
        "{error}"
    );
    assert!(running.fake.calls_of(Call::Drain).is_empty(), "the old generation is not drained");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_change_waits_while_max_generations_live() {
    let web = epoch("web", Duration::from_secs(30), 2);
    let running = run(std::slice::from_ref(&web));
    running.fake.state().generations.insert(pid("web"), 2);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.state.upsert(changed(web, "debug"), Source::Api).unwrap();
    let waiting = status_where(&running, &pid("web"), |s| s.figures.error.is_some()).await;
    assert_eq!(waiting.state, ProxyState::Running, "{waiting:?}");
    let error = waiting.figures.error.unwrap();
    assert!(error.contains("waiting for an old generation to exit: 2 run, and max_generations is 2"), "{error}");
    assert_eq!(waiting.generations.map_or(0, |live| live.len()), 2);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(running.fake.calls_of(Call::Start).len(), 1, "no new generation while two live");

    // The draining generation exits: the change goes on.
    let installed = running.fake.state().last_started[&pid("web")].clone();
    installed.send_modify(|status| status.generations.truncate(1));
    running.fake.wait_calls(Call::Drain, 1).await;
    assert_eq!(running.fake.calls_of(Call::Start).len(), 2);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_change_that_waits_for_max_generations_gives_way_to_a_newer_one_or_a_removal() {
    let web = epoch("web", Duration::from_secs(30), 2);
    let running = run(std::slice::from_ref(&web));
    running.fake.state().generations.insert(pid("web"), 2);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.state.upsert(changed(web.clone(), "debug"), Source::Api).unwrap();
    status_where(&running, &pid("web"), |s| s.figures.error.as_deref().is_some_and(|e| e.contains("waiting"))).await;

    // A newer change replaces the waiting one, which still waits for room.
    running.state.upsert(changed(web, "info"), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let waiting = running.handle.proxy(&pid("web")).unwrap();
    assert!(
        waiting.figures.error.as_deref().is_some_and(|e| e.contains("waiting for an old generation")),
        "{waiting:?}"
    );
    assert_eq!(running.fake.calls_of(Call::Start).len(), 1);

    // Deregistered while it waits: stopped at once, not after the old generations.
    running.state.remove(&ServiceId::new("web").unwrap(), &tether_state::SourceKind::Api).unwrap();
    running.fake.wait_calls(Call::Stop, 1).await;
    assert_eq!(running.fake.calls_of(Call::Start).len(), 1, "nothing started for a change no longer wanted");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_instance_that_is_no_generation_is_restarted_instead() {
    // Started before `update = "epoch"` was set, say: its status lists no generations.
    let web = epoch("web", Duration::from_secs(30), 3);
    let running = run(std::slice::from_ref(&web));
    running.fake.state().generations.insert(pid("web"), 0);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.fake.state().generations.remove(&pid("web"));
    running.state.upsert(changed(web, "debug"), Source::Api).unwrap();
    running.fake.wait_calls(Call::Start, 2).await;
    let calls: Vec<Call> = running.fake.state().calls.iter().map(|(_, _, call)| *call).collect();
    assert_eq!(calls, [Call::Start, Call::Stop, Call::Start], "stopped, then started: it cannot hand over");
    running.stop().await;
}
