//! Ordering (`depends_on`): starts wait for dependencies, stops go dependents first.

use tether_state::{Condition, Dependency, SourceKind};

use super::*;

const SECOND: Duration = Duration::from_secs(1);

fn depending(name: &str, on: &[(&str, Condition)]) -> Service {
    let mut service = service(name);
    let spec = service.proxy.as_mut().unwrap();
    for (dependency, condition) in on {
        spec.depends_on.insert(Dependency::new(*dependency).unwrap(), *condition);
    }
    service
}

fn first_call(fake: &Fake, call: Call, id: &ProxyId) -> Instant {
    fake.calls_of(call)
        .into_iter()
        .find(|(_, of)| of == id)
        .map(|(at, _)| at)
        .unwrap_or_else(|| panic!("no {call:?} of {id}"))
}

fn order_of(fake: &Fake, call: Call) -> Vec<ProxyId> {
    fake.calls_of(call).into_iter().map(|(_, id)| id).collect()
}

#[tokio::test(start_paused = true)]
async fn a_dependent_waits_until_its_dependency_is_ready_and_says_for_what() {
    let fake = Fake::new();
    fake.state().ready_after.insert(pid("a"), 2 * SECOND);
    let t0 = Instant::now();
    let state = catalog(&[service("a"), depending("b", &[("a", Condition::Ready)])]);
    let running = run_with(&state, &fake, &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    let waiting = running.until_state(&pid("b"), ProxyState::Waiting).await;
    assert_eq!(waiting.figures.error.as_deref(), Some("waiting for a-proxy to be ready (it is starting)"));
    running.until_state(&pid("b"), ProxyState::Running).await;
    assert_eq!(first_call(&fake, Call::Start, &pid("a")), t0);
    assert_eq!(first_call(&fake, Call::Start, &pid("b")), t0 + 2 * SECOND, "b starts once a is ready");
    assert_eq!(running.handle.proxy(&pid("b")).unwrap().figures.error, None);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn started_needs_only_a_process_not_readiness() {
    let fake = Fake::new();
    fake.state().never_ready.insert(pid("a"));
    let state = catalog(&[service("a"), depending("b", &[("a-proxy", Condition::Started)])]);
    let running = run_with(&state, &fake, &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    running.until_state(&pid("b"), ProxyState::Running).await;
    assert_eq!(running.handle.proxy(&pid("a")).unwrap().state, ProxyState::Starting);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_chain_starts_in_order() {
    let fake = Fake::new();
    let mut services = vec![service("n0")];
    for i in 1..30 {
        services.push(depending(&format!("n{i}"), &[(&format!("n{}", i - 1), Condition::Ready)]));
        fake.state().ready_after.insert(pid(&format!("n{i}")), Duration::from_millis(10));
    }
    // Listed backwards, so that the order comes from the dependencies alone.
    services.reverse();
    let running = run_with(&catalog(&services), &fake, &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    running.until_state(&pid("n29"), ProxyState::Running).await;
    let expected: Vec<ProxyId> = (0..30).map(|i| pid(&format!("n{i}"))).collect();
    assert_eq!(order_of(&fake, Call::Start), expected);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_missing_dependency_keeps_its_dependent_waiting_until_it_is_registered() {
    let running = run(&[depending("b", &[("a", Condition::Ready), ("c", Condition::Started)]), service("c")]);
    running.until_state(&pid("c"), ProxyState::Running).await;
    let waiting = running.until_state(&pid("b"), ProxyState::Waiting).await;
    assert_eq!(waiting.figures.error.as_deref(), Some("waiting for a (not in the catalog)"));
    assert!(running.fake.calls_of(Call::Start).iter().all(|(_, id)| *id != pid("b")));
    running.state.upsert(service("a"), Source::Api).unwrap();
    running.until_state(&pid("b"), ProxyState::Running).await;
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_dependency_that_restarts_does_not_restart_its_dependents() {
    let running = run(&[service("a"), depending("b", &[("a", Condition::Ready)])]);
    let b = running.until_state(&pid("b"), ProxyState::Running).await;
    tokio::time::timeout(LIMIT, running.handle.restart(&pid("a"))).await.unwrap().unwrap();
    running.until_state(&pid("a"), ProxyState::Running).await;
    let stops = order_of(&running.fake, Call::Stop);
    assert_eq!(stops, [pid("a")], "only a was stopped, by its restart");
    assert_eq!(running.handle.proxy(&pid("b")).unwrap().figures.pid, b.figures.pid);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn holding_a_dependency_stops_its_dependents_first_and_releasing_it_starts_them_again() {
    let fake = Fake::new();
    fake.state().stop_delay.insert(pid("c"), SECOND);
    fake.state().stop_delay.insert(pid("b"), SECOND);
    let state = catalog(&[
        service("a"),
        depending("b", &[("a", Condition::Ready)]),
        depending("c", &[("b", Condition::Started)]),
    ]);
    let running = run_with(&state, &fake, &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    running.until_state(&pid("c"), ProxyState::Running).await;
    let t0 = Instant::now();
    tokio::time::timeout(LIMIT, running.handle.hold(&pid("a"), true)).await.unwrap().unwrap();
    running.until_state(&pid("a"), ProxyState::Stopped).await;
    assert_eq!(order_of(&fake, Call::Stop), [pid("c"), pid("b"), pid("a")]);
    assert_eq!(first_call(&fake, Call::Stop, &pid("b")), t0 + SECOND, "b stops once c is down");
    assert_eq!(first_call(&fake, Call::Stop, &pid("a")), t0 + 2 * SECOND, "a stops once b is down");
    let b = running.until_state(&pid("b"), ProxyState::Waiting).await;
    assert_eq!(b.figures.error.as_deref(), Some("waiting for a-proxy to be ready (it is stopped by the operator)"));
    assert_eq!(
        running.until_state(&pid("c"), ProxyState::Waiting).await.figures.error.as_deref(),
        Some("waiting for b-proxy to be started (it is waiting)")
    );

    tokio::time::timeout(LIMIT, running.handle.hold(&pid("a"), false)).await.unwrap().unwrap();
    running.until_state(&pid("c"), ProxyState::Running).await;
    assert_eq!(order_of(&fake, Call::Start)[3..], [pid("a"), pid("b"), pid("c")]);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn deregistering_several_at_once_stops_dependents_first() {
    let fake = Fake::new();
    fake.state().stop_delay.insert(pid("b"), SECOND);
    let state = catalog(&[service("a"), depending("b", &[("a", Condition::Ready)]), service("x")]);
    let running = run_with(&state, &fake, &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    running.until_state(&pid("b"), ProxyState::Running).await;
    running.until_state(&pid("x"), ProxyState::Running).await;
    let t0 = Instant::now();
    state.replace_source(&SourceKind::Api, vec![(service("x"), Source::Api)]).unwrap();
    running.until_gone(&pid("a")).await;
    running.until_gone(&pid("b")).await;
    assert_eq!(first_call(&fake, Call::Stop, &pid("b")), t0);
    assert_eq!(first_call(&fake, Call::Stop, &pid("a")), t0 + SECOND, "a stops once b is down");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn deregistering_a_dependency_alone_stops_its_dependent_which_then_waits_for_it() {
    let running = run(&[service("a"), depending("b", &[("a", Condition::Ready)])]);
    running.until_state(&pid("b"), ProxyState::Running).await;
    running.state.remove(&ServiceId::new("a").unwrap(), &SourceKind::Api).unwrap();
    running.until_gone(&pid("a")).await;
    assert_eq!(order_of(&running.fake, Call::Stop), [pid("b"), pid("a")]);
    let b = running.until_state(&pid("b"), ProxyState::Waiting).await;
    assert_eq!(b.figures.error.as_deref(), Some("waiting for a (not in the catalog)"));
    running.state.upsert(service("a"), Source::Api).unwrap();
    running.until_state(&pid("b"), ProxyState::Running).await;
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn kill_stops_dependents_first_and_independent_proxies_at_once() {
    let fake = Fake::new();
    for name in ["b", "x", "y"] {
        fake.state().stop_delay.insert(pid(name), SECOND);
    }
    let state = catalog(&[
        service("a"),
        depending("b", &[("a", Condition::Ready)]),
        depending("c", &[("b", Condition::Started), ("a", Condition::Ready)]),
        service("x"),
        service("y"),
    ]);
    let running = run_with(&state, &fake, &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    running.until_state(&pid("c"), ProxyState::Running).await;
    let manager = running.stop().await;
    let t0 = Instant::now();
    tokio::time::timeout(LIMIT, manager.kill()).await.unwrap().unwrap();
    let at = |name: &str| first_call(&fake, Call::Stop, &pid(name));
    assert_eq!((at("c"), at("x"), at("y")), (t0, t0, t0), "what nothing depends on stops at once");
    assert_eq!(at("b"), t0, "c stops without delay");
    assert_eq!(at("a"), t0 + SECOND, "a stops once b and c are down");
    assert!(fake.state().live.is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_agent_restart_adopts_dependents_without_stopping_or_reordering_them() {
    let first = run(&[depending("b", &[("a", Condition::Ready)]), service("a")]);
    first.until_state(&pid("b"), ProxyState::Running).await;
    let (state, fake, store) = (first.state.clone(), first.fake.clone(), first.store.clone());
    tokio::time::timeout(LIMIT, first.stop().await.close()).await.unwrap().unwrap();

    let second = run_with(&state, &fake, &store, ManagerConfig::default());
    fake.wait_calls(Call::Update, 2).await;
    second.until_state(&pid("a"), ProxyState::Running).await;
    second.until_state(&pid("b"), ProxyState::Running).await;
    assert_eq!(fake.calls_of(Call::Start).len(), 2, "only the first agent started them");
    assert!(fake.calls_of(Call::Stop).is_empty());
    second.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_cycle_made_through_the_api_waits_named_and_never_starts() {
    let running = run(&[depending("a", &[("b", Condition::Ready)]), depending("b", &[("a", Condition::Started)])]);
    let a = running.until_state(&pid("a"), ProxyState::Waiting).await;
    assert_eq!(a.figures.error.as_deref(), Some("waiting for b-proxy to be ready (it is waiting)"));
    running.until_state(&pid("b"), ProxyState::Waiting).await;
    assert!(running.fake.calls_of(Call::Start).is_empty());
    let refused = running.handle.restart(&pid("a")).await;
    assert!(matches!(refused, Err(RequestError::Blocked { .. })), "{refused:?}");
    running.stop().await;
}

mod property {
    use proptest::prelude::*;

    use super::*;

    /// A random graph without cycles: proxy `i` may depend only on proxies before it.
    fn graph() -> impl Strategy<Value = Vec<(BTreeMap<usize, bool>, u64, u64)>> {
        (2..10usize).prop_flat_map(|n| {
            (0..n)
                .map(|i| {
                    (
                        prop::collection::btree_map(0..i.max(1), any::<bool>(), if i == 0 { 0..1 } else { 0..3 }),
                        0..3000u64,
                        0..2000u64,
                    )
                })
                .collect::<Vec<_>>()
        })
    }

    async fn scenario(graph: Vec<(BTreeMap<usize, bool>, u64, u64)>) {
        let fake = Fake::new();
        let name = |i: usize| format!("p{i}");
        let mut services = Vec::new();
        for (i, (deps, ready_ms, stop_ms)) in graph.iter().enumerate() {
            let on: Vec<(String, Condition)> = deps
                .iter()
                .map(|(d, ready)| (name(*d), if *ready { Condition::Ready } else { Condition::Started }))
                .collect();
            let on: Vec<(&str, Condition)> = on.iter().map(|(d, c)| (d.as_str(), *c)).collect();
            services.push(depending(&name(i), &on));
            fake.state().ready_after.insert(pid(&name(i)), Duration::from_millis(*ready_ms + 1));
            fake.state().stop_delay.insert(pid(&name(i)), Duration::from_millis(*stop_ms));
        }
        let running =
            run_with(&catalog(&services), &fake, &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
        for i in 0..graph.len() {
            running.until_state(&pid(&name(i)), ProxyState::Running).await;
        }
        let manager = running.stop().await;
        tokio::time::timeout(LIMIT, manager.kill()).await.unwrap().unwrap();
        for (i, (deps, _, _)) in graph.iter().enumerate() {
            let me = pid(&name(i));
            for (d, ready) in deps {
                let dependency = pid(&name(*d));
                let started = first_call(&fake, Call::Start, &dependency);
                let earliest = if *ready { started + Duration::from_millis(graph[*d].1 + 1) } else { started };
                assert!(first_call(&fake, Call::Start, &me) >= earliest, "{me} started before {dependency} was ready");
                let stopped = first_call(&fake, Call::Stop, &me) + Duration::from_millis(graph[i].2);
                assert!(first_call(&fake, Call::Stop, &dependency) >= stopped, "{dependency} stopped before {me}");
            }
        }
        assert!(fake.state().live.is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn starts_follow_dependencies_and_kills_go_in_reverse(graph in graph()) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
            runtime.block_on(scenario(graph));
        }
    }
}
