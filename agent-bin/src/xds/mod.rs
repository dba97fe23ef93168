//! The xDS server: Envoy's aggregated discovery service (ADS, state of the world and delta, over
//! gRPC), which serves each Envoy its listeners, clusters and endpoints from the catalog, and,
//! with a CA in force, its service's leaf and the roots as secrets (SDS), mutual TLS, and the
//! intentions as an RBAC filter (`resources/mesh.rs`).
//!
//! Both protocols are served: state of the world (`StreamAggregatedResources`) and
//! incremental (`DeltaAggregatedResources`), with one stream loop over the `Protocol` of
//! `stream.rs`, behind the gRPC service of `service.rs` (small buffers per stream).
//! An Envoy names itself by `node.id` (its proxy id) and proves it with the proxy's token in
//! the `x-tether-token` metadata of the stream; a stream without both is refused and counted.
//! Each stream follows the catalog, the readiness of the proxies, the leaves, roots and
//! intentions (one watch channel that [`Xds::follow`] bumps), builds what its proxy is served (`resources.rs`, a pure function),
//! and sends what changed (`stream.rs`, which keeps the order and the verdicts).
//! What Envoy says of each response (applied, or refused with its error) is the proxy's
//! `last_xds` in the status, and `tether_xds_responses_total` counts it.
//!
//! This module serves only: it starts no process and writes no file.

pub(crate) mod bootstrap;
pub(crate) mod resources;
mod service;
pub(crate) mod sidecar;
mod stream;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tether_manager::{ManagerHandle, ProxyEvent};
use tether_state::{Catalog, LocalState, ProxyId, ServiceName, SpiffeId};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{broadcast, watch};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::catalog::sources::Sources;
use crate::connect::Connect;
use crate::templates::InstanceSource;
use resources::{ConfigError, EnvoyConfig, Kind, Mesh, ProxyResources, Target, leaf_secret_name};
use service::{Ads, Requests, Responses};
use stream::{Answer, Protocol};

/// The gRPC metadata key that carries the proxy's token.
pub(crate) const TOKEN_METADATA: &str = "x-tether-token";

/// The xDS socket's file name in the data dir.
pub(crate) const SOCKET_NAME: &str = "xds.sock";

/// Responses queued for one stream before its task waits for Envoy to take them: a stream
/// whose Envoy reads nothing holds at most this many.
const QUEUED_RESPONSES: usize = 4;

/// What Envoy said of the last response of a type, or why the agent sends none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum XdsResult {
    /// Envoy applied it (an ACK).
    Applied,
    /// Envoy refused it (a NACK), with its error.
    Refused,
    /// The proxy's `config` cannot be served: nothing new is sent.
    Invalid,
}

impl XdsResult {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            XdsResult::Applied => "applied",
            XdsResult::Refused => "refused",
            XdsResult::Invalid => "invalid",
        }
    }
}

/// A proxy's last xDS verdict, as its status shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) at: SystemTime,
    /// The resource type; `None` for [`XdsResult::Invalid`].
    pub(crate) kind: Option<&'static str>,
    pub(crate) version: Option<String>,
    pub(crate) result: XdsResult,
    pub(crate) error: Option<String>,
}

/// What the board keeps of one proxy whose Envoy connected: its last verdict per type, why
/// nothing is sent (if so), and Envoy's answers per type, counted.
#[derive(Debug, Default)]
struct ProxyVerdicts {
    by_kind: [Option<Verdict>; Kind::ALL.len()],
    invalid: Option<Verdict>,
    /// Per type: responses applied, responses refused.
    answers: [[u64; 2]; Kind::ALL.len()],
}

impl ProxyVerdicts {
    /// The verdict to show: why nothing is sent, else the latest refusal still in force,
    /// else the latest verdict.
    fn last(&self) -> Option<Verdict> {
        if let Some(invalid) = &self.invalid {
            return Some(invalid.clone());
        }
        let known = self.by_kind.iter().flatten();
        let refused = known.clone().filter(|verdict| verdict.result == XdsResult::Refused).max_by_key(|v| v.at);
        refused.or_else(|| known.max_by_key(|verdict| verdict.at)).cloned()
    }
}

#[derive(Debug, Default)]
struct Board {
    /// Boxed, so that the map's nodes stay small: one per proxy whose Envoy connected.
    verdicts: BTreeMap<ProxyId, Box<ProxyVerdicts>>,
    /// Streams refused for a missing or wrong token, or an unknown node id.
    refused_streams: u64,
    /// Streams open now.
    streams: u64,
}

/// What the events stream tells of xDS.
#[derive(Debug, Clone)]
pub(crate) struct XdsEvent {
    pub(crate) time: SystemTime,
    pub(crate) proxy: ProxyId,
    /// `xds-refused` (Envoy refused a response) or `xds-invalid` (the config cannot be served).
    pub(crate) event: &'static str,
    pub(crate) detail: String,
}

/// Where the xDS server finds Connect: the CA and its leaves, the `[connect]` table and the
/// intentions in force.
pub(crate) struct MeshSource {
    pub(crate) connect: Arc<Connect>,
    pub(crate) sources: Arc<Sources>,
}

struct Shared {
    catalog: LocalState,
    instances: Arc<dyn InstanceSource>,
    mesh: MeshSource,
    /// Bumped on every change that may change what a proxy is served.
    changes: watch::Sender<u64>,
    board: Mutex<Board>,
    events: broadcast::Sender<XdsEvent>,
    /// Ends every stream.
    stop: CancellationToken,
}

/// The xDS server's state, shared by its streams, the status and the metrics. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Xds {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Xds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Xds").finish_non_exhaustive()
    }
}

impl Xds {
    /// A server of `catalog`'s proxies, with upstream endpoints from `instances` (or, with a
    /// CA in force, from `mesh`'s ready proxies); `stop` ends every stream.
    pub(crate) fn new(
        catalog: LocalState,
        instances: Arc<dyn InstanceSource>,
        mesh: MeshSource,
        stop: CancellationToken,
    ) -> Self {
        let (changes, _) = watch::channel(0);
        let (events, _) = broadcast::channel(64);
        let shared = Shared { catalog, instances, mesh, changes, board: Mutex::default(), events, stop };
        Self { shared: Arc::new(shared) }
    }

    fn board(&self) -> MutexGuard<'_, Board> {
        // Every critical section only moves values in or out.
        self.shared.board.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A generation bumped on every change of the catalog, of a proxy's readiness or of the
    /// fleet's instances: what the built-in proxies' upstream queries wait on.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    /// The last verdict of `proxy`'s Envoy, if one ever connected since the agent started.
    pub(crate) fn last(&self, proxy: &ProxyId) -> Option<Verdict> {
        self.board().verdicts.get(proxy).and_then(|verdicts| verdicts.last())
    }

    /// xDS events from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<XdsEvent> {
        self.shared.events.subscribe()
    }

    fn tell(&self, proxy: &ProxyId, event: &'static str, detail: String) {
        let _ = self.shared.events.send(XdsEvent { time: SystemTime::now(), proxy: proxy.clone(), event, detail });
    }

    /// Wakes every stream when the catalog changes, a proxy becomes ready or stops being
    /// ready (its service's instances change), the fleet's instances change, a leaf or the
    /// roots change, the intentions change, or a CA comes or goes, until the server stops.
    ///
    /// # Cancel safety
    ///
    /// Meant to run as a task of its own.
    pub(crate) async fn follow(self, manager: ManagerHandle) {
        let mut catalog = self.shared.catalog.subscribe();
        let mut statuses = manager.subscribe();
        let mut ready: HashMap<ProxyId, bool> =
            manager.status_unmeasured().into_iter().map(|status| (status.id.clone(), status.ready())).collect();
        let bump = || self.shared.changes.send_modify(|generation| *generation += 1);
        // The fleet's instances change apart from this catalog; a source without changes of
        // its own never wakes this branch.
        let mut fleet = self.shared.instances.changes();
        let fleet_changed = async |fleet: &mut Option<watch::Receiver<u64>>| match fleet {
            Some(receiver) => receiver.changed().await.is_ok(),
            None => std::future::pending().await,
        };
        let connect = &self.shared.mesh.connect;
        let mut applied = connect.applied();
        let mut intentions = self.shared.mesh.sources.intentions_index();
        let mut leaves = connect.leaves().map(|handle| handle.watch());
        loop {
            let leaf_changed = async {
                match leaves.as_mut() {
                    Some(board) => board.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.shared.stop.cancelled() => return,
                changed = fleet_changed(&mut fleet) => {
                    if changed {
                        bump();
                    } else {
                        fleet = None;
                    }
                }
                alive = leaf_changed => {
                    if !alive {
                        leaves = None;
                    }
                    bump();
                }
                changed = applied.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    leaves = connect.leaves().map(|handle| handle.watch());
                    bump();
                }
                changed = intentions.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    bump();
                }
                changed = catalog.changed() => match changed {
                    Some(_) => {
                        self.forget_gone();
                        bump();
                    }
                    None => return,
                },
                event = statuses.recv() => match event {
                    Ok(ProxyEvent::Changed(status)) => {
                        let now = status.ready();
                        if ready.insert(status.id.clone(), now) != Some(now) {
                            bump();
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => bump(),
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    }

    /// Forgets the verdicts and counters of the proxies that left the catalog, so that what
    /// the board holds follows the catalog, not every proxy that ever was.
    fn forget_gone(&self) {
        let catalog = &self.shared.catalog;
        let known = |id: &ProxyId| catalog.get(&id.service_id()).is_some_and(|entry| entry.proxy.is_some());
        let mut board = self.board();
        board.verdicts.retain(|id, _| known(id));
    }

    /// The gRPC server of ADS.
    fn server(self) -> tonic::transport::server::Router {
        tonic::transport::Server::builder().add_service(Ads(self))
    }

    /// Serves ADS on `listener` (the data dir's socket) until the server stops.
    ///
    /// # Errors
    ///
    /// The transport's error, when serving fails.
    pub(crate) async fn serve_unix(self, listener: UnixListener) -> Result<(), tonic::transport::Error> {
        let stop = self.shared.stop.clone();
        self.server().serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop.cancelled_owned()).await
    }

    /// Serves ADS on `listener` (`--xds-address`) until the server stops.
    ///
    /// # Errors
    ///
    /// The transport's error, when serving fails.
    pub(crate) async fn serve_tcp(self, listener: TcpListener) -> Result<(), tonic::transport::Error> {
        let stop = self.shared.stop.clone();
        self.server().serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned()).await
    }

    /// The metrics of the xDS server.
    pub(crate) fn collector(&self) -> Box<dyn Collector> {
        Box::new(XdsCollector(self.clone()))
    }

    /// The proxy whose Envoy calls itself `node` and holds `token`, if that is its token.
    fn authorise(&self, node: &str, token: Option<&str>) -> Option<tether_state::Entry> {
        let id = ProxyId::parse(node).ok();
        crate::catalog::names::authorised(&self.shared.catalog, &id, token?)
    }

    /// What `proxy` is served now; `Ok(None)` when it is no longer in the catalog with that
    /// token (its stream ends).
    fn desired(&self, proxy: &ProxyId, token: &str) -> Result<Option<ProxyResources>, ConfigError> {
        let Some(entry) = crate::catalog::names::authorised(&self.shared.catalog, &Some(proxy.clone()), token) else {
            return Ok(None);
        };
        let Some(managed) = entry.proxy.as_ref() else { return Ok(None) };
        let config = EnvoyConfig::read(proxy, &entry.service, &managed.spec().config)?;
        let mesh = self.mesh(proxy, &entry, &config)?;
        let mut targets: BTreeMap<String, Vec<Target>> = BTreeMap::new();
        for upstream in &config.upstreams {
            if targets.contains_key(&upstream.destination_name) {
                continue;
            }
            // The agent's own catalog answers at once; a name the fleet does not know yet has no
            // target until its first answer, which wakes every stream (`follow`).
            let found = self.shared.instances.known(&upstream.destination_name).unwrap_or_default();
            let found: Vec<Target> = if mesh.is_some() {
                // In the mesh, an upstream reaches its destination's proxies, which take mutual
                // TLS, not the services behind them.
                found
                    .into_iter()
                    .filter_map(|instance| instance.mesh.map(|at| Target { address: at.address, port: at.port }))
                    .collect()
            } else {
                found
                    .into_iter()
                    .filter_map(|instance| Some(Target { address: instance.address, port: instance.port? }))
                    .collect()
            };
            targets.insert(upstream.destination_name.clone(), found);
        }
        Ok(Some(resources::build_from(&config, &targets, mesh.as_ref())))
    }

    /// What `proxy` needs of Connect, when a CA is in force: its service's leaf and identity,
    /// the roots, the intentions, and the identity of each upstream's destination.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for an upstream whose destination name cannot be a SPIFFE id.
    fn mesh(
        &self,
        proxy: &ProxyId,
        entry: &tether_state::Entry,
        config: &EnvoyConfig,
    ) -> Result<Option<Mesh>, ConfigError> {
        let section = self.shared.mesh.sources.connect_section();
        let (Some(connect), Some(leaves)) = (section.connect(), self.shared.mesh.connect.leaves()) else {
            return Ok(None);
        };
        let mut destinations = BTreeMap::new();
        for (at, upstream) in config.upstreams.iter().enumerate() {
            let error = |problem: String| ConfigError {
                proxy: proxy.clone(),
                field: format!("upstreams[{at}].destination_name"),
                problem,
            };
            let name = ServiceName::new(upstream.destination_name.as_str()).map_err(|err| error(err.to_string()))?;
            let id = SpiffeId::service(&connect.trust_domain, &connect.datacenter, &name)
                .map_err(|err| error(err.to_string()))?;
            destinations.insert(upstream.destination_name.clone(), id.to_string());
        }
        let board = leaves.board();
        let leaf = board.services.get(&entry.service.id).and_then(|status| status.leaf.clone());
        let roots = board.roots.clone();
        drop(board);
        Ok(Some(Mesh {
            trust_domain: connect.trust_domain.clone(),
            service_name: entry.service.name.clone(),
            leaf_secret: leaf_secret_name(entry.service.id.as_str()),
            leaf,
            roots,
            intentions: Arc::new(section.intentions().clone()),
            destinations,
        }))
    }

    fn record_answer(&self, proxy: &ProxyId, answer: Answer) {
        let (kind, verdict) = match answer {
            Answer::Applied { kind, version } => {
                tracing::debug!(proxy = %proxy, kind = kind.as_str(), version, "xDS response applied");
                let verdict = Verdict {
                    at: SystemTime::now(),
                    kind: Some(kind.as_str()),
                    version: Some(version),
                    result: XdsResult::Applied,
                    error: None,
                };
                (kind, verdict)
            }
            Answer::Refused { kind, version, error } => {
                tracing::warn!(proxy = %proxy, kind = kind.as_str(), version, error, "Envoy refused an xDS response");
                self.tell(proxy, "xds-refused", format!("{kind} version {version}: {error}"));
                let verdict = Verdict {
                    at: SystemTime::now(),
                    kind: Some(kind.as_str()),
                    version: Some(version),
                    result: XdsResult::Refused,
                    error: Some(error),
                };
                (kind, verdict)
            }
        };
        let mut board = self.board();
        let verdicts = board.verdicts.entry(proxy.clone()).or_default();
        verdicts.answers[kind.index()][usize::from(verdict.result == XdsResult::Refused)] += 1;
        verdicts.by_kind[kind.index()] = Some(verdict);
    }

    /// Records that `proxy`'s config cannot be served (once per distinct error), or, with
    /// `None`, that it can again.
    fn record_invalid(&self, proxy: &ProxyId, error: Option<&ConfigError>) {
        let mut board = self.board();
        let Some(error) = error else {
            if let Some(verdicts) = board.verdicts.get_mut(proxy) {
                verdicts.invalid = None;
            }
            return;
        };
        let verdicts = board.verdicts.entry(proxy.clone()).or_default();
        let text = error.to_string();
        if verdicts.invalid.as_ref().and_then(|v| v.error.as_deref()) != Some(text.as_str()) {
            tracing::warn!(proxy = %proxy, error = %text, "the proxy's config cannot be served over xDS");
            self.tell(proxy, "xds-invalid", text.clone());
            verdicts.invalid = Some(Verdict {
                at: SystemTime::now(),
                kind: None,
                version: None,
                result: XdsResult::Invalid,
                error: Some(text),
            });
        }
    }

    /// Runs one ADS stream: authorises it on its first request, then answers requests and
    /// changes until Envoy goes away, the proxy leaves the catalog, or the server stops.
    ///
    /// An agent holds one such task per Envoy, idle most of the time, so what it holds across
    /// an `await` is kept small: requests wait boxed, responses are encoded before they are
    /// queued, and the cold paths (a refusal, an unreadable request) build their status
    /// outside the task's state.
    async fn stream<P: Protocol>(
        self,
        token: Option<String>,
        mut requests: Requests<P::Request>,
        responses: Responses,
    ) {
        let stop = self.shared.stop.clone();
        let first = tokio::select! {
            () = stop.cancelled() => return,
            () = responses.closed() => return,
            first = requests.message() => boxed(first),
        };
        let first = match first {
            Ok(Some(first)) => first,
            Ok(None) => return,
            Err(status) => return responses.end(undecodable(None, &status)).await,
        };
        let (proxy, token) = match self.admit(P::node(&first).unwrap_or_default(), token) {
            Ok(admitted) => admitted,
            Err(Some(status)) => return responses.end(status).await,
            Err(None) => return,
        };
        tracing::info!(proxy = %proxy, protocol = P::NAME, "xDS stream opened");
        let _open = OpenStream::new(&self);
        let mut changes = self.shared.changes.subscribe();
        changes.mark_unchanged();
        let mut state = P::default();
        let mut pending = Some(first);
        loop {
            if let Some(request) = pending.take() {
                if let Some(answer) = state.on_request(&request) {
                    self.record_answer(&proxy, answer);
                }
            }
            let batch = match self.desired(&proxy, &token) {
                Ok(Some(desired)) => {
                    self.record_invalid(&proxy, None);
                    state.responses(&desired)
                }
                Ok(None) => {
                    tracing::info!(proxy = %proxy, "xDS stream closed: the proxy left the catalog or has a new token");
                    let message = format!("proxy {proxy} is no longer in the catalog with this token");
                    return responses.end(Status::permission_denied(message)).await;
                }
                Err(error) => {
                    self.record_invalid(&proxy, Some(&error));
                    Vec::new()
                }
            };
            if responses.send_all(batch).await.is_err() {
                return;
            }
            let request = tokio::select! {
                () = stop.cancelled() => return,
                () = responses.closed() => return,
                request = requests.message() => boxed(request),
                changed = changes.changed() => match changed {
                    Ok(()) => continue,
                    Err(_) => return,
                },
            };
            match request {
                Ok(Some(request)) => pending = Some(request),
                Ok(None) => return,
                Err(status) => return responses.end(undecodable(Some(&proxy), &status)).await,
            }
        }
    }

    /// Whether a stream whose first request names `node` and which came with `token` may go on:
    /// the proxy and its token if so; if not, the status that ends it (none for a service
    /// that has no proxy any more, whose stream just ends).
    fn admit(&self, node: &str, token: Option<String>) -> Result<(ProxyId, String), Option<Status>> {
        match (self.authorise(node, token.as_deref()), token) {
            (Some(entry), Some(token)) => match entry.proxy.as_ref() {
                Some(managed) => Ok((managed.id().clone(), token)),
                None => Err(None),
            },
            (_, token) => {
                self.board().refused_streams += 1;
                let why = if token.is_none() { "no x-tether-token" } else { "a token that is not its own" };
                tracing::warn!(node = %node, "xDS stream refused: node {node:?} came with {why}");
                let message =
                    format!("node.id {node:?} is no proxy of this agent, or {TOKEN_METADATA} is not its token");
                Err(Some(Status::permission_denied(message)))
            }
        }
    }
}

/// A request as the stream waits with it: boxed, since it is large and rare.
fn boxed<T>(request: Result<Option<T>, Status>) -> Result<Option<Box<T>>, Status> {
    request.map(|request| request.map(Box::new))
}

/// The status that ends a stream whose request could not be read (not a gRPC message of its
/// type, or the stream broke): `INVALID_ARGUMENT`, which a client still there reads as the
/// reason.
fn undecodable(proxy: Option<&ProxyId>, status: &Status) -> Status {
    tracing::debug!(proxy = proxy.map(tracing::field::display), error = %status, "xDS stream ended: a request could not be read");
    Status::invalid_argument(format!("the request could not be read as a discovery request: {}", status.message()))
}

/// Counts a stream as open while it lives.
struct OpenStream(Xds);

impl OpenStream {
    fn new(xds: &Xds) -> Self {
        xds.board().streams += 1;
        Self(xds.clone())
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.board().streams -= 1;
    }
}

/// `tether_xds_responses_total{proxy, type, result}`, `tether_xds_refused_streams_total`,
/// `tether_xds_streams`.
#[derive(Debug)]
struct XdsCollector(Xds);

impl Collector for XdsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let (responses, refused, streams) = {
            let board = self.0.board();
            let mut responses = Vec::new();
            for (proxy, verdicts) in &board.verdicts {
                for kind in Kind::ALL {
                    let [applied, refused] = verdicts.answers[kind.index()];
                    for (result, count) in [(XdsResult::Applied, applied), (XdsResult::Refused, refused)] {
                        if count > 0 {
                            responses.push((proxy.clone(), kind, result.as_str(), count));
                        }
                    }
                }
            }
            (responses, board.refused_streams, board.streams)
        };
        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "tether_xds_responses",
            "Envoy's answers to the xDS responses of the agent, by proxy, resource type and result: applied (ACK) or refused (NACK)",
            None,
            counter.metric_type(),
        )?;
        for (proxy, kind, result, count) in &responses {
            let labels = [("proxy", proxy.as_str()), ("type", kind.as_str()), ("result", *result)];
            ConstCounter::new(*count).encode(family.encode_family(&labels)?)?;
        }
        let refused_streams = ConstCounter::new(refused);
        refused_streams.encode(encoder.encode_descriptor(
            "tether_xds_refused_streams",
            "xDS streams refused: no token, a token that is not the node's, or a node id that is no proxy of this agent",
            None,
            refused_streams.metric_type(),
        )?)?;
        let open = ConstGauge::new(i64::try_from(streams).unwrap_or(i64::MAX));
        open.encode(encoder.encode_descriptor(
            "tether_xds_streams",
            "xDS streams open now",
            None,
            open.metric_type(),
        )?)?;
        Ok(())
    }
}
