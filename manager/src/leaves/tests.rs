//! The leaves' schedule on the paused clock, with a fake authority whose failures the test
//! switches on and off, and the mock for what it is asked.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tether_state::{LocalState, PrivateKeyPem, ProxySpec, Service, Source};

use super::*;

/// Signs "certificates" that are only their serial, valid from now for the request's TTL.
#[derive(Default)]
struct FakeCa {
    serials: AtomicU64,
    failing: AtomicBool,
    requests: Mutex<Vec<LeafRequest>>,
}

impl CertificateAuthority for FakeCa {
    fn roots(&self) -> Vec<CaRoot> {
        vec![CaRoot {
            serial: "01".into(),
            cert_pem: "root".into(),
            not_after: SystemTime::now() + Duration::from_secs(86_400),
            active: true,
        }]
    }

    fn issue(&self, request: LeafRequest) -> Result<IssuedLeaf, CaError> {
        self.requests.lock().unwrap().push(request.clone());
        if self.failing.load(Ordering::SeqCst) {
            return Err(CaError::Sign { service: request.service_id, source: "the CA is unavailable".into() });
        }
        let serial = format!("{:02x}", self.serials.fetch_add(1, Ordering::SeqCst) + 2);
        let now = SystemTime::now();
        Ok(IssuedLeaf {
            serial: serial.clone(),
            cert_pem: format!("cert {serial}"),
            key: PrivateKeyPem::new(format!("key {serial}")),
            spiffe_id: request.spiffe_id,
            not_before: now,
            not_after: now + request.ttl,
        })
    }
}

const TTL: Duration = Duration::from_secs(100);
const DEADLINE: Duration = Duration::from_secs(3600);

fn policy() -> LeafPolicy {
    LeafPolicy::new(TrustDomain::new("example.org").unwrap(), Datacenter::default(), TTL)
}

fn service(id: &str, name: &str, proxy: bool) -> Service {
    let service = Service::new(ServiceId::new(id).unwrap(), ServiceName::new(name).unwrap());
    if proxy { service.with_proxy(ProxySpec::default()) } else { service }
}

fn catalog(services: &[Service]) -> LocalState {
    let state = LocalState::new();
    for service in services {
        state.upsert(service.clone(), Source::Api).unwrap();
    }
    state
}

fn id(name: &str) -> ServiceId {
    ServiceId::new(name).unwrap()
}

/// Waits, on the paused clock, until `check` holds for the board.
async fn until(handle: &LeavesHandle, what: &str, check: impl Fn(&LeafBoard) -> bool) {
    let mut board = handle.watch();
    let waited = tokio::time::timeout(DEADLINE, board.wait_for(|board| check(board))).await;
    assert!(matches!(waited, Ok(Ok(_))), "timed out waiting until {what}: {:?}", handle.board().services);
}

struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn spawn(leaves: Leaves) -> Self {
        let stop = CancellationToken::new();
        let task = tokio::spawn(leaves.run(stop.clone()));
        Self { stop, task }
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(DEADLINE, self.task).await.expect("the loop stops").expect("the loop does not panic");
    }
}

#[tokio::test(start_paused = true)]
async fn issue_all_gives_each_service_with_a_proxy_a_leaf_of_its_identity() {
    let state = catalog(&[service("web-1", "web", true), service("db", "db", true), service("plain", "plain", false)]);
    let ca = Arc::new(FakeCa::default());
    let mut leaves = Leaves::new(Arc::new(state), ca.clone(), policy());
    leaves.issue_all();
    let handle = leaves.handle();
    let board = handle.board();
    assert_eq!(board.services.keys().cloned().collect::<Vec<_>>(), [id("db"), id("web-1")]);
    let web = board.services[&id("web-1")].leaf.clone().unwrap();
    assert_eq!(web.spiffe_id.as_str(), "spiffe://example.org/ns/default/dc/dc1/svc/web");
    assert_eq!(board.roots.len(), 1);
    assert!(board.services.values().all(|status| status.error.is_none() && status.index == board.index));
    let requests = ca.requests.lock().unwrap();
    assert_eq!(requests.len(), 2);
    assert!(requests.iter().all(|request| request.ttl == TTL));
}

#[tokio::test(start_paused = true)]
async fn a_leaf_is_renewed_between_60_and_80_percent_of_its_life() {
    let state = catalog(&[service("web", "web", true)]);
    let ca = Arc::new(FakeCa::default());
    let leaves = Leaves::new(Arc::new(state), ca.clone(), policy());
    let handle = leaves.handle();
    let mut events = handle.events();
    let started = Instant::now();
    let running = Running::spawn(leaves);
    let first = tokio::time::timeout(DEADLINE, events.recv()).await.unwrap().unwrap();
    assert_eq!(first.kind, LeafEventKind::Issued);
    let renewed = tokio::time::timeout(DEADLINE, events.recv()).await.unwrap().unwrap();
    assert_eq!(renewed.kind, LeafEventKind::Renewed);
    assert_ne!(renewed.serial, first.serial);
    let at = started.elapsed();
    assert!(at >= TTL * 6 / 10 && at <= TTL * 8 / 10, "renewed after {at:?} of a {TTL:?} life");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_renewal_is_an_error_at_once_keeps_the_valid_leaf_and_is_retried_on_the_backoff() {
    let state = catalog(&[service("web", "web", true)]);
    let ca = Arc::new(FakeCa::default());
    let leaves = Leaves::new(Arc::new(state), ca.clone(), policy());
    let handle = leaves.handle();
    let mut events = handle.events();
    let running = Running::spawn(leaves);
    until(&handle, "the first leaf", |board| board.services.get(&id("web")).is_some_and(|s| s.leaf.is_some())).await;
    let first = handle.board().services[&id("web")].clone();
    ca.failing.store(true, Ordering::SeqCst);

    let failed = loop {
        let event = tokio::time::timeout(DEADLINE, events.recv()).await.unwrap().unwrap();
        if event.kind == LeafEventKind::Failed {
            break event;
        }
    };
    assert!(failed.error.as_deref().unwrap().contains("the CA is unavailable"), "{failed:?}");
    let status = handle.board().services[&id("web")].clone();
    let error = status.error.clone().unwrap();
    assert!(error.contains("not renewed") && error.contains("expires in"), "{error}");
    assert_eq!(status.leaf.as_ref().unwrap().serial, first.leaf.as_ref().unwrap().serial, "the valid leaf stays");
    assert_eq!(status.index, first.index, "a blocking query is not woken by a failure");

    // Retries after 1 s, 2 s, 4 s, …: the attempts come at growing intervals.
    let mut at = Vec::new();
    for _ in 0..3 {
        let event = tokio::time::timeout(DEADLINE, events.recv()).await.unwrap().unwrap();
        assert_eq!(event.kind, LeafEventKind::Failed);
        at.push(Instant::now());
    }
    assert_eq!(at[1] - at[0], Duration::from_secs(2));
    assert_eq!(at[2] - at[1], Duration::from_secs(4));

    ca.failing.store(false, Ordering::SeqCst);
    until(&handle, "a renewal after the failures", |board| {
        board.services[&id("web")].error.is_none() && board.services[&id("web")].index > first.index
    })
    .await;
    assert_eq!(handle.board().services[&id("web")].failures, 0);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_leaf_whose_renewals_keep_failing_is_dropped_when_it_expires() {
    let state = catalog(&[service("web", "web", true)]);
    let ca = Arc::new(FakeCa::default());
    let mut policy = policy();
    policy.retry = Backoff::new(Duration::from_secs(30), Duration::from_secs(30));
    let leaves = Leaves::new(Arc::new(state), ca.clone(), policy);
    let handle = leaves.handle();
    let running = Running::spawn(leaves);
    until(&handle, "the first leaf", |board| board.services.get(&id("web")).is_some_and(|s| s.leaf.is_some())).await;
    let issued = Instant::now();
    ca.failing.store(true, Ordering::SeqCst);
    until(&handle, "the leaf expired", |board| board.services[&id("web")].leaf.is_none()).await;
    let dropped = issued.elapsed();
    assert!(
        dropped <= TTL && dropped > TTL - Duration::from_secs(1),
        "dropped at its expiry, not at a retry: {dropped:?}"
    );
    let error = handle.board().services[&id("web")].error.clone().unwrap();
    assert!(error.contains("expired"), "{error}");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn services_that_come_go_or_are_renamed_are_followed() {
    let state = catalog(&[service("web", "web", true)]);
    let ca = Arc::new(FakeCa::default());
    let leaves = Leaves::new(Arc::new(state.clone()), ca.clone(), policy());
    let handle = leaves.handle();
    let running = Running::spawn(leaves);
    until(&handle, "web's leaf", |board| board.services.contains_key(&id("web"))).await;

    state.upsert(service("db", "db", true), Source::Api).unwrap();
    until(&handle, "db's leaf", |board| board.services.get(&id("db")).is_some_and(|s| s.leaf.is_some())).await;

    state.upsert(service("web", "frontend", true), Source::Api).unwrap();
    until(&handle, "web's new identity", |board| {
        board.services[&id("web")].leaf.as_ref().is_some_and(|leaf| leaf.spiffe_id.as_str().ends_with("/svc/frontend"))
    })
    .await;

    state.remove(&id("db"), &tether_state::SourceKind::Api).unwrap();
    until(&handle, "db gone", |board| !board.services.contains_key(&id("db"))).await;
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_new_authority_issues_every_leaf_again_and_publishes_its_roots() {
    let state = catalog(&[service("web", "web", true)]);
    let leaves = Leaves::new(Arc::new(state), Arc::new(FakeCa::default()), policy());
    let handle = leaves.handle();
    let running = Running::spawn(leaves);
    until(&handle, "web's leaf", |board| board.services.contains_key(&id("web"))).await;
    let before = handle.board().services[&id("web")].index;

    let mut next = MockCertificateAuthority::new();
    next.expect_roots().returning(Vec::new);
    next.expect_issue().times(1).returning(|request| {
        let now = SystemTime::now();
        Ok(IssuedLeaf {
            serial: "aa".into(),
            cert_pem: "new".into(),
            key: PrivateKeyPem::new("new key"),
            spiffe_id: request.spiffe_id,
            not_before: now,
            not_after: now + request.ttl,
        })
    });
    let mut policy = policy();
    policy.ttl = Duration::from_secs(1000);
    handle.replace(Arc::new(next), policy);
    until(&handle, "the new CA's leaf", |board| {
        board.services[&id("web")].leaf.as_ref().is_some_and(|leaf| leaf.serial == "aa")
    })
    .await;
    let board = handle.board().clone();
    assert!(board.roots.is_empty() && board.roots_index > before);
    assert!(board.services[&id("web")].index > before);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_name_that_cannot_be_an_identity_is_an_error_of_that_service_alone() {
    let state = catalog(&[service("web", "web", true), service("odd", "odd name", true)]);
    let mut leaves = Leaves::new(Arc::new(state), Arc::new(FakeCa::default()), policy());
    leaves.issue_all();
    let handle = leaves.handle();
    let board = handle.board();
    assert!(board.services[&id("web")].leaf.is_some());
    let odd = &board.services[&id("odd")];
    assert!(odd.leaf.is_none());
    assert!(odd.error.as_deref().unwrap().contains("SPIFFE"), "{odd:?}");
}

#[test]
fn renewal_points_fall_between_60_and_80_percent_and_spread() {
    let life = Duration::from_secs(72 * 3600);
    let points: Vec<Duration> = (0..200).map(|serial| renewal_point(life, &format!("{serial:x}"))).collect();
    assert!(points.iter().all(|at| *at >= life * 6 / 10 && *at <= life * 8 / 10));
    let distinct: std::collections::HashSet<_> = points.iter().collect();
    assert!(distinct.len() > 100, "{} distinct points of 200", distinct.len());
}
