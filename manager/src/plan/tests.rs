//! Tests of the pure planning function, through one `check` helper.

use std::collections::{BTreeSet, HashMap};

use tether_state::{ProxyId, ProxySpec, ProxyToken, Service, ServiceId, ServiceName};

use super::*;

const ROOT: Policy = Policy { refuse_root: true, root_users: BTreeSet::new() };
const OPEN: Policy = Policy { refuse_root: false, root_users: BTreeSet::new() };

/// `policy`, knowing that `users` are uid 0.
fn knowing_root(policy: Policy, users: &[&str]) -> Policy {
    let mut policy = policy;
    for user in users {
        policy.note_uid(user, Some(0));
    }
    policy
}

fn token() -> ProxyToken {
    ProxyToken::from_hex("00112233445566778899aabbccddeeff").unwrap()
}

fn service(name: &str) -> Service {
    Service::new(ServiceId::new(name).unwrap(), ServiceName::new(name).unwrap()).with_proxy(ProxySpec::default())
}

fn proxy_of(service: Service) -> Arc<ManagedProxy> {
    Arc::new(ManagedProxy::new(Arc::new(service), token()).unwrap())
}

fn proxy(name: &str) -> Arc<ManagedProxy> {
    proxy_of(service(name))
}

fn edited(name: &str, edit: impl FnOnce(&mut Service)) -> Arc<ManagedProxy> {
    let mut service = service(name);
    edit(&mut service);
    proxy_of(service)
}

fn with_user(name: &str) -> Arc<ManagedProxy> {
    run_as(name, "nobody")
}

fn run_as(name: &str, user: &str) -> Arc<ManagedProxy> {
    edited(name, |s| s.proxy.as_mut().unwrap().user = Some(user.into()))
}

fn running(proxy: &Arc<ManagedProxy>) -> Observed {
    Observed::Running { applied: proxy.clone() }
}

fn adopted(service: Service, token: &ProxyToken) -> Observed {
    Observed::Adopted { origin: Some(Origin { service: Arc::new(service), token: token.fingerprint() }) }
}

#[track_caller]
fn check(desired: &[Arc<ManagedProxy>], observed: &[(&str, Observed)], policy: Policy, expected: &[(&str, Action)]) {
    let desired_map: HashMap<ProxyId, Arc<ManagedProxy>> =
        desired.iter().map(|p| (p.id().clone(), p.clone())).collect();
    let observed_map: HashMap<ProxyId, Observed> =
        observed.iter().map(|(id, o)| (ProxyId::parse(*id).unwrap(), o.clone())).collect();
    let got = plan(&desired_map, &observed_map, &policy);
    let expected: Vec<(ProxyId, Action)> = expected.iter().map(|(id, a)| (ProxyId::parse(*id).unwrap(), *a)).collect();
    let ids: Vec<&ProxyId> = desired_map.keys().collect();
    assert_eq!(got, expected, "desired={ids:?} observed={observed:?} policy={policy:?}");
}

#[test]
fn new_proxy_is_started() {
    check(&[proxy("web")], &[], OPEN, &[("web-proxy", Action::Start)]);
    check(&[proxy("web")], &[("web-proxy", Observed::Idle)], OPEN, &[("web-proxy", Action::Start)]);
}

#[test]
fn unwanted_running_proxy_is_stopped() {
    check(&[], &[("web-proxy", running(&proxy("web")))], OPEN, &[("web-proxy", Action::Stop)]);
}

#[test]
fn unwanted_proxy_without_process_is_forgotten() {
    let failed = Observed::Failed { wanted: Some(proxy("db")), has_process: false };
    let blocked = Observed::Blocked { wanted: proxy("api") };
    check(
        &[],
        &[("web-proxy", Observed::Idle), ("db-proxy", failed), ("api-proxy", blocked)],
        OPEN,
        &[("api-proxy", Action::Forget), ("db-proxy", Action::Forget), ("web-proxy", Action::Forget)],
    );
}

#[test]
fn unchanged_proxy_is_left_alone() {
    let web = proxy("web");
    check(std::slice::from_ref(&web), &[("web-proxy", running(&web))], OPEN, &[]);
    // An equal proxy built anew (a complete answer after a catalog reload) is unchanged too.
    check(&[proxy("web")], &[("web-proxy", running(&web))], OPEN, &[]);
}

#[test]
fn restart_relevant_change_restarts() {
    let new = edited("web", |s| drop(s.proxy.as_mut().unwrap().env.insert("A".into(), "1".into())));
    check(&[new], &[("web-proxy", running(&proxy("web")))], OPEN, &[("web-proxy", Action::Restart)]);
}

#[test]
fn other_change_is_applied_in_place() {
    let new = edited("web", |s| s.port = Some(9090));
    check(&[new], &[("web-proxy", running(&proxy("web")))], OPEN, &[("web-proxy", Action::Update)]);
}

#[test]
fn proxy_without_user_is_blocked_when_root_is_refused() {
    check(&[proxy("web")], &[], ROOT, &[("web-proxy", Action::Block)]);
    check(&[with_user("web")], &[], ROOT, &[("web-proxy", Action::Start)]);
    check(&[proxy("web")], &[], OPEN, &[("web-proxy", Action::Start)]);
}

#[test]
fn proxy_whose_user_is_uid_0_is_blocked_when_root_is_refused() {
    let policy = knowing_root(ROOT, &["root", "toor"]);
    check(&[run_as("web", "root")], &[], policy.clone(), &[("web-proxy", Action::Block)]);
    check(&[run_as("web", "toor")], &[], policy.clone(), &[("web-proxy", Action::Block)]);
    check(&[with_user("web")], &[], policy.clone(), &[("web-proxy", Action::Start)]);
    // A user that does not resolve is not known to be root: its start fails and says why.
    check(&[run_as("web", "ghost")], &[], policy.clone(), &[("web-proxy", Action::Start)]);
    check(
        &[run_as("web", "root")],
        &[("web-proxy", running(&with_user("web")))],
        policy,
        &[("web-proxy", Action::Stop)],
    );
    check(&[run_as("web", "root")], &[], knowing_root(OPEN, &["root"]), &[("web-proxy", Action::Start)]);
}

#[test]
fn a_user_that_stops_being_uid_0_is_no_longer_refused() {
    let mut policy = knowing_root(ROOT, &["svc"]);
    let web = run_as("web", "svc");
    check(std::slice::from_ref(&web), &[], policy.clone(), &[("web-proxy", Action::Block)]);
    policy.note_uid("svc", Some(1000));
    let blocked = Observed::Blocked { wanted: web.clone() };
    check(std::slice::from_ref(&web), &[("web-proxy", blocked.clone())], knowing_root(ROOT, &["svc"]), &[]);
    // The engine looks the user up again when the proxy changes, and decides with the answer.
    check(&[web], &[("web-proxy", blocked)], policy.clone(), &[("web-proxy", Action::Start)]);
    policy.note_uid("svc", None);
    check(&[run_as("web", "svc")], &[], policy, &[("web-proxy", Action::Start)]);
}

#[test]
fn a_refusal_names_the_user_and_its_uid() {
    let policy = knowing_root(ROOT, &["toor"]);
    let message = |proxy: &Arc<ManagedProxy>| policy.refusal(proxy).map(|refusal| refusal.to_string());
    assert_eq!(
        message(&run_as("web", "toor")).as_deref(),
        Some(
            "refusing to run the proxy as root: its `user` \"toor\" is uid 0 \
             (set a `user` that is not root, or allow root with --allow-root)"
        )
    );
    assert_eq!(
        message(&proxy("web")).as_deref(),
        Some(
            "refusing to run the proxy as root: it has no `user`, so it would run as the agent, uid 0 \
             (set a `user` that is not root, or allow root with --allow-root)"
        )
    );
    assert_eq!(message(&with_user("web")), None);
    assert_eq!(knowing_root(OPEN, &["toor"]).refusal(&run_as("web", "toor")), None);
}

#[test]
fn blocked_proxy_stays_blocked_until_it_changes() {
    let web = proxy("web");
    check(std::slice::from_ref(&web), &[("web-proxy", Observed::Blocked { wanted: web.clone() })], ROOT, &[]);
    let moved = edited("web", |s| s.port = Some(1));
    check(&[moved], &[("web-proxy", Observed::Blocked { wanted: web.clone() })], ROOT, &[("web-proxy", Action::Block)]);
    check(
        &[with_user("web")],
        &[("web-proxy", Observed::Blocked { wanted: web })],
        ROOT,
        &[("web-proxy", Action::Start)],
    );
}

#[test]
fn running_proxy_that_policy_refuses_is_stopped() {
    check(&[proxy("web")], &[("web-proxy", running(&with_user("web")))], ROOT, &[("web-proxy", Action::Stop)]);
    check(&[proxy("web")], &[("web-proxy", adopted(service("web"), &token()))], ROOT, &[("web-proxy", Action::Stop)]);
}

#[test]
fn failed_proxy_waits_for_a_change_then_is_retried() {
    let web = proxy("web");
    let failed_start = Observed::Failed { wanted: Some(web.clone()), has_process: false };
    let failed_stop = Observed::Failed { wanted: Some(web.clone()), has_process: true };
    check(std::slice::from_ref(&web), &[("web-proxy", failed_start.clone())], OPEN, &[]);
    check(std::slice::from_ref(&web), &[("web-proxy", failed_stop.clone())], OPEN, &[]);
    let changed = edited("web", |s| s.port = Some(1));
    check(std::slice::from_ref(&changed), &[("web-proxy", failed_start)], OPEN, &[("web-proxy", Action::Start)]);
    check(&[changed], &[("web-proxy", failed_stop)], OPEN, &[("web-proxy", Action::Restart)]);
}

#[test]
fn failed_stop_of_an_unwanted_proxy_is_not_retried_in_a_loop() {
    let failed = Observed::Failed { wanted: None, has_process: true };
    check(&[], &[("web-proxy", failed.clone())], OPEN, &[]);
    // Wanting it again is a change: it is restarted as the new proxy.
    check(&[proxy("web")], &[("web-proxy", failed)], OPEN, &[("web-proxy", Action::Restart)]);
}

#[test]
fn adopted_proxy_that_matches_gets_its_proxy_in_place() {
    check(&[proxy("web")], &[("web-proxy", adopted(service("web"), &token()))], OPEN, &[("web-proxy", Action::Update)]);
    let moved = edited("web", |s| s.port = Some(1));
    check(&[moved], &[("web-proxy", adopted(service("web"), &token()))], OPEN, &[("web-proxy", Action::Update)]);
}

#[test]
fn adopted_proxy_that_differs_or_is_unknown_is_restarted() {
    let mut old = service("web");
    old.proxy.as_mut().unwrap().working_dir = Some("/srv".into());
    check(&[proxy("web")], &[("web-proxy", adopted(old, &token()))], OPEN, &[("web-proxy", Action::Restart)]);
    let other_token = ProxyToken::from_hex("ffeeddccbbaa99887766554433221100").unwrap();
    check(
        &[proxy("web")],
        &[("web-proxy", adopted(service("web"), &other_token))],
        OPEN,
        &[("web-proxy", Action::Restart)],
    );
    check(
        &[proxy("web")],
        &[("web-proxy", Observed::Adopted { origin: None })],
        OPEN,
        &[("web-proxy", Action::Restart)],
    );
}

#[test]
fn unwanted_adopted_proxy_is_stopped() {
    check(&[], &[("web-proxy", Observed::Adopted { origin: None })], OPEN, &[("web-proxy", Action::Stop)]);
}
