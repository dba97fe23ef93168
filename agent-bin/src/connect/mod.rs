//! Connect in the agent: the certificate authority that the config dirs' `[connect]` table
//! describes (`ca.rs`), and the one `tether_manager::Leaves` loop that keeps a leaf
//! certificate for each service with a proxy, started, replaced or stopped as reloads say.
//!
//! A CA is loaded before anything changes: a reload whose CA cannot be loaded is refused
//! whole, and the leaves of the running CA stay as they are. This module never shows a
//! private key: the API's leaf endpoint, for the proxy that owns it, is the one place that
//! hands one out.

pub(crate) mod ca;

use std::sync::{Arc, Mutex};

use tether_manager::{CertificateAuthority, LeafEvent, LeafPolicy, Leaves, LeavesHandle};
use tether_state::config::ConnectSection;
use tether_state::persist::DataDir;
use tether_state::{CaRoot, LocalState, lock};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

pub(crate) use ca::{Authority, CaLoadError};

/// A CA loaded from a `[connect]` table, ready to be put in place.
pub(crate) struct Prepared {
    authority: Arc<Authority>,
    policy: LeafPolicy,
}

/// Loads the CA of `section`, if it has a `[connect]` table: `None` without one.
///
/// # Errors
///
/// [`CaLoadError`], naming the file and field.
pub(crate) fn prepare(section: &ConnectSection, data: &DataDir) -> Result<Option<Prepared>, CaLoadError> {
    let (Some(connect), Some(file)) = (section.connect(), section.connect_file()) else { return Ok(None) };
    let authority = Authority::load(connect, file, data)?;
    let policy = LeafPolicy::new(connect.trust_domain.clone(), connect.datacenter.clone(), connect.ca.leaf_ttl.get());
    Ok(Some(Prepared { authority: Arc::new(authority), policy }))
}

/// The leaves loop while it runs, and what it was started with.
struct Running {
    handle: LeavesHandle,
    roots: Vec<CaRoot>,
    policy: LeafPolicy,
    stop: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
}

/// Connect's runtime: the leaves loop of the CA in force, if any, and its events.
pub(crate) struct Connect {
    catalog: LocalState,
    running: Mutex<Option<Running>>,
    /// Every leaf event of whichever loop runs, for the events stream.
    events: broadcast::Sender<LeafEvent>,
    /// The connections that built-in proxies refused or closed, by service and reason.
    refusals: Mutex<std::collections::BTreeMap<(String, &'static str), u64>>,
    /// Each refusal as its proxy reported it, for the events stream.
    refused: broadcast::Sender<Refusal>,
    /// Bumped whenever a CA comes into force, changes or goes, so that a reader of
    /// [`Connect::leaves`] takes the loop that runs now.
    applied: tokio::sync::watch::Sender<u64>,
}

/// Why a built-in proxy refused a connection (or closed one), as it reports it.
pub(crate) const REFUSAL_REASONS: [&str; 6] =
    ["no-certificate", "untrusted", "expired", "bad-identity", "denied", "handshake"];

/// A connection that a service's built-in proxy refused, or closed when an intention came to
/// deny it.
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    pub(crate) time: std::time::SystemTime,
    pub(crate) service: tether_state::ServiceId,
    /// One of [`REFUSAL_REASONS`].
    pub(crate) reason: &'static str,
    pub(crate) detail: String,
}

/// How many leaf events a slow reader may fall behind by.
const EVENT_BACKLOG: usize = 1024;

impl Connect {
    /// Connect for `catalog`, with no CA yet.
    pub(crate) fn new(catalog: LocalState) -> Self {
        Self {
            catalog,
            running: Mutex::new(None),
            events: broadcast::channel(EVENT_BACKLOG).0,
            refusals: Mutex::default(),
            refused: broadcast::channel(EVENT_BACKLOG).0,
            applied: tokio::sync::watch::channel(0).0,
        }
    }

    /// Counts `refusal` and tells it to the events stream.
    pub(crate) fn refuse(&self, refusal: Refusal) {
        *lock(&self.refusals).entry((refusal.service.to_string(), refusal.reason)).or_default() += 1;
        let _ = self.refused.send(refusal);
    }

    /// The refusals from now on.
    pub(crate) fn refusals(&self) -> broadcast::Receiver<Refusal> {
        self.refused.subscribe()
    }

    /// The leaves, while a CA is in force.
    pub(crate) fn leaves(&self) -> Option<LeavesHandle> {
        lock(&self.running).as_ref().map(|running| running.handle.clone())
    }

    /// A generation bumped whenever a CA comes into force, changes or goes.
    pub(crate) fn applied(&self) -> tokio::sync::watch::Receiver<u64> {
        self.applied.subscribe()
    }

    /// The leaf events from now on, of every CA that comes into force.
    pub(crate) fn events(&self) -> broadcast::Receiver<LeafEvent> {
        self.events.subscribe()
    }

    /// Puts `prepared` in force: the first CA issues every leaf before this returns (at the
    /// agent's start, a proxy finds its leaf from its first request); a different CA or
    /// policy has every leaf issued again; `None` stops issuing and forgets the leaves.
    /// Call it from within the runtime.
    pub(crate) fn apply(&self, prepared: Option<Prepared>) {
        let changed = prepared.is_some() || lock(&self.running).is_some();
        self.put_in_force(prepared);
        if changed {
            self.applied.send_modify(|generation| *generation += 1);
        }
    }

    fn put_in_force(&self, prepared: Option<Prepared>) {
        let mut running = lock(&self.running);
        match (prepared, running.as_mut()) {
            (None, None) => {}
            (None, Some(_)) => {
                if let Some(mut old) = running.take() {
                    old.stop.cancel();
                    old.tasks.abort_all();
                    tracing::info!("connect: no [connect] table any more; leaf certificates are no longer issued");
                }
            }
            (Some(prepared), Some(current)) => {
                let roots = prepared.authority.root_list().to_vec();
                if roots != current.roots || prepared.policy != current.policy {
                    tracing::info!(roots = roots.len(), "connect: a new CA or policy; every leaf is issued again");
                    current.roots = roots;
                    current.policy = prepared.policy.clone();
                    current.handle.replace(prepared.authority, prepared.policy);
                }
            }
            (Some(prepared), None) => {
                let roots = prepared.authority.root_list().to_vec();
                let ca: Arc<dyn CertificateAuthority> = prepared.authority;
                let started = std::time::Instant::now();
                let mut leaves = Leaves::new(Arc::new(self.catalog.clone()), ca, prepared.policy.clone());
                leaves.issue_all();
                let handle = leaves.handle();
                tracing::info!(
                    leaves = handle.board().services.len(),
                    elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                    trust_domain = %prepared.policy.trust_domain,
                    "connect: leaf certificates issued"
                );
                let stop = CancellationToken::new();
                let mut tasks = tokio::task::JoinSet::new();
                let mut events = handle.events();
                let forward = self.events.clone();
                tasks.spawn(async move {
                    loop {
                        match events.recv().await {
                            Ok(event) => {
                                let _ = forward.send(event);
                            }
                            Err(broadcast::error::RecvError::Lagged(_)) => {}
                            Err(broadcast::error::RecvError::Closed) => break,
                        }
                    }
                });
                tasks.spawn(leaves.run(stop.clone()));
                *running = Some(Running { handle, roots, policy: prepared.policy, stop, tasks });
            }
        }
    }

    /// Stops the leaves loop, and waits for it.
    pub(crate) async fn shutdown(&self) {
        let running = lock(&self.running).take();
        if let Some(mut running) = running {
            running.stop.cancel();
            // The loop writes nothing that an abort could leave half-done.
            running.tasks.shutdown().await;
        }
    }
}

/// Loads the CA of the config dirs at the agent's start.
///
/// # Errors
///
/// [`CaLoadError`]: the agent must not start with a CA it cannot use.
pub(crate) fn at_start(connect: &Connect, section: &ConnectSection, data: &DataDir) -> Result<(), CaLoadError> {
    connect.apply(prepare(section, data)?);
    Ok(())
}

/// The metrics of Connect: `tether_leaf_cert_expiry_timestamp_seconds{service}`, when each
/// service's leaf expires (seconds since the epoch), so that an alert fires before one does;
/// and `tether_connect_refusals_total{service, reason}`, the connections that built-in
/// proxies refused or closed.
pub(crate) fn collector(connect: Arc<Connect>) -> Box<dyn prometheus_client::collector::Collector> {
    Box::new(LeafCollector(connect))
}

struct LeafCollector(Arc<Connect>);

impl std::fmt::Debug for LeafCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeafCollector")
    }
}

impl prometheus_client::collector::Collector for LeafCollector {
    fn encode(&self, mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;

        let refusals = lock(&self.0.refusals).clone();
        if !refusals.is_empty() {
            use prometheus_client::metrics::counter::ConstCounter;
            let mut family = encoder.encode_descriptor(
                "tether_connect_refusals",
                "Connections that a built-in proxy refused, or closed once an intention denied them, by reason",
                None,
                ConstCounter::new(0u64).metric_type(),
            )?;
            for ((service, reason), count) in &refusals {
                ConstCounter::new(*count)
                    .encode(family.encode_family(&[("service", service.as_str()), ("reason", reason)])?)?;
            }
        }
        let Some(handle) = self.0.leaves() else { return Ok(()) };
        let expiries: Vec<(String, f64)> = {
            let board = handle.board();
            board
                .services
                .iter()
                .filter_map(|(id, status)| {
                    let leaf = status.leaf.as_ref()?;
                    let at = leaf.not_after.duration_since(std::time::UNIX_EPOCH).ok()?;
                    Some((id.to_string(), at.as_secs_f64()))
                })
                .collect()
        };
        let gauge = ConstGauge::new(0f64);
        let mut family = encoder.encode_descriptor(
            "tether_leaf_cert_expiry_timestamp_seconds",
            "When each service's leaf certificate expires, in seconds since the Unix epoch",
            None,
            gauge.metric_type(),
        )?;
        for (service, at) in &expiries {
            ConstGauge::new(*at).encode(family.encode_family(&[("service", service.as_str())])?)?;
        }
        Ok(())
    }
}
