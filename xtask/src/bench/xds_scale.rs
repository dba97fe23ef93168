//! xDS at scale: one agent with 1 000 proxies, and 1 000 simulated Envoys, each its own gRPC
//! connection to the agent's `--xds-address`, half of them state of the world and half
//! incremental. Each subscribes as Envoy does (clusters; the endpoints of the clusters it
//! is sent; listeners), with a first request as large as Envoy's, and acknowledges every
//! response. Measured:
//!
//! - the agent's resident memory per stream: with every stream subscribed and acknowledged,
//!   minus before the first one opened, over 1 000;
//! - a catalog change that concerns all 1 000 (one more instance of `db`, the upstream every
//!   proxy has): the time until the last client decoded the new endpoints, beside the first;
//! - the agent's context switches while nothing changes, with the 1 000 streams open and
//!   before they opened.
//!
//! The clients' token is the proxy's own: each proxy is a `sleep` whose environment holds
//! `TETHER_PROXY_TOKEN`.

use std::collections::BTreeMap;
use std::fs;
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{Extension, Node};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::lab::{Agent, Lab};
use super::report::{Row, median, met, ms, ratio};
use super::sys;

/// Simulated Envoys, and proxies of the agent.
const CLIENTS: usize = 1_000;

/// Catalog changes timed.
const CHANGES: usize = 5;

/// Extensions named in each simulated Envoy's node: as many bytes as a real Envoy's.
const EXTENSIONS: usize = 446;

/// How long the agent is watched while nothing changes.
const IDLE: Duration = Duration::from_secs(10);

const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// The targets.
const RSS_TARGET_KIB: f64 = 20.0;
const FAN_OUT_TARGET: Duration = Duration::from_secs(1);

/// What the clients tell the bench.
#[derive(Default)]
struct Progress {
    /// Clients that have applied clusters, endpoints and listeners once.
    synced: AtomicUsize,
    /// By the number of `db` endpoints decoded: when each client first decoded that many.
    reached: Mutex<BTreeMap<usize, Vec<Instant>>>,
    /// Streams that ended, with why.
    ended: Mutex<Vec<String>>,
}

impl Progress {
    /// A client decoded `endpoints` endpoints of `db`; counted once per client and count,
    /// `best` being the most that client has counted so far.
    fn saw(&self, best: &mut usize, endpoints: usize) {
        if endpoints <= *best {
            return;
        }
        *best = endpoints;
        let now = Instant::now();
        self.reached.lock().unwrap_or_else(|e| e.into_inner()).entry(endpoints).or_default().push(now);
    }

    fn end(&self, why: String) {
        self.ended.lock().unwrap_or_else(|e| e.into_inner()).push(why);
    }

    fn ended(&self) -> Vec<String> {
        self.ended.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// When each client first decoded `endpoints` endpoints of `db`, once all have.
    fn all_reached(&self, endpoints: usize) -> Option<Vec<Instant>> {
        let reached = self.reached.lock().unwrap_or_else(|e| e.into_inner());
        reached.get(&endpoints).filter(|at| at.len() >= CLIENTS).cloned()
    }
}

/// One simulated Envoy.
#[derive(Clone)]
struct Client {
    proxy: String,
    token: String,
    delta: bool,
}

/// Runs the figures, appending their rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    sys::raise_open_files()?;
    let config = lab.subdir("xds-scale-config")?;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("a free port: {err}"))?;
    let xds = listener.local_addr().map_err(|err| err.to_string())?;
    drop(listener);
    let mut text = String::from("[[service]]\nname = \"db\"\nid = \"db-base\"\nport = 19999\n\n");
    for index in 0..CLIENTS {
        text.push_str(&format!(
            "[[service]]\nname = \"web{index:04}\"\nport = {port}\n[service.proxy]\n\
             command = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n\
             config = {{ bind_port = {bind}, upstreams = [{{ destination_name = \"db\", local_bind_port = {upstream} }}] }}\n\n",
            port = 10_000 + index,
            bind = 30_000 + index,
            upstream = 40_000 + index,
        ));
    }
    fs::write(config.join("services.toml"), text).map_err(|err| format!("services.toml: {err}"))?;
    let xds_flag = xds.to_string();
    let mut agent =
        lab.agent("xds-scale", &config, &lab.dir.join("xds-scale-data"), &["--xds-address", xds_flag.as_str()])?;
    let measured = measure(&mut agent, &xds_flag, rows);
    let left = agent.leave(Duration::from_secs(60));
    measured?;
    left
}

fn measure(agent: &mut Agent<'_>, xds: &str, rows: &mut Vec<Row>) -> Result<(), String> {
    let (proxies, _) = agent.wait_running(CLIENTS, Duration::from_secs(120))?;
    let mut clients = Vec::with_capacity(CLIENTS);
    for (index, row) in proxies.iter().enumerate() {
        let pid = row.pid.ok_or_else(|| agent.error(&format!("{} has no pid", row.id)))?;
        let token = sys::environ_var(pid, "TETHER_PROXY_TOKEN")
            .ok_or_else(|| format!("no TETHER_PROXY_TOKEN in the environment of {pid} ({})", row.id))?;
        clients.push(Client { proxy: row.id.clone(), token, delta: index % 2 == 1 });
    }
    // Quiet after the bring-up, then the agent alone with its proxies.
    thread::sleep(Duration::from_secs(2));
    let idle_before = idle_switches(agent.pid())?;
    let rss_before = sys::rss_kib(agent.pid())?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| format!("a runtime for the clients: {err}"))?;
    let progress = Arc::new(Progress::default());
    let endpoint = Endpoint::from_shared(format!("http://{xds}"))
        .map_err(|err| err.to_string())?
        .connect_timeout(Duration::from_secs(10));
    // The clients run on a thread of their own while this one measures the agent.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let spawned = {
        let progress = progress.clone();
        thread::spawn(move || {
            runtime.block_on(async move {
                let mut tasks = tokio::task::JoinSet::new();
                for client in clients {
                    let channel = match endpoint.connect().await {
                        Ok(channel) => channel,
                        Err(err) => return Err(format!("connecting to the xDS server: {err}")),
                    };
                    let progress = progress.clone();
                    tasks.spawn(async move {
                        let proxy = client.proxy.clone();
                        let result = if client.delta {
                            delta(channel, client, &progress).await
                        } else {
                            sotw(channel, client, &progress).await
                        };
                        progress.end(format!("{proxy}: {}", result.err().unwrap_or_else(|| "ended".to_owned())));
                    });
                }
                let _ = stopped.await;
                tasks.shutdown().await;
                Ok(())
            })
        })
    };
    let result = (|| {
        let deadline = Instant::now() + Duration::from_secs(120);
        while progress.synced.load(Ordering::SeqCst) < CLIENTS {
            let ended = progress.ended();
            if !ended.is_empty() || spawned.is_finished() {
                return Err(
                    agent.error(&format!("ADS streams ended while subscribing: {:?}", &ended[..ended.len().min(3)]))
                );
            }
            if Instant::now() > deadline {
                return Err(agent.error(&format!(
                    "{} of {CLIENTS} clients subscribed after 120 s",
                    progress.synced.load(Ordering::SeqCst)
                )));
            }
            thread::sleep(Duration::from_millis(10));
        }
        // The last acknowledgements reach the agent, then it is quiet.
        thread::sleep(Duration::from_secs(2));
        let rss_after = sys::rss_kib(agent.pid())?;
        let idle_after = idle_switches(agent.pid())?;
        let mut fan_out = Vec::new();
        let mut first = Vec::new();
        for change in 0..CHANGES {
            let body = format!(r#"{{"name":"db","id":"db-{change:03}","port":{}}}"#, 20_000 + change);
            let start = Instant::now();
            agent.register(&body)?;
            // The base instance and one per change so far.
            let expected = change + 2;
            let deadline = start + Duration::from_secs(30);
            let reached = loop {
                if let Some(reached) = progress.all_reached(expected) {
                    break reached;
                }
                let ended = progress.ended();
                if !ended.is_empty() {
                    return Err(agent.error(&format!("ADS streams ended: {:?}", &ended[..ended.len().min(3)])));
                }
                if Instant::now() > deadline {
                    return Err(agent.error(&format!(
                        "change {change}: not every client had {expected} endpoints of db after 30 s"
                    )));
                }
                thread::sleep(Duration::from_millis(1));
            };
            let last = reached.iter().max().map_or(Duration::ZERO, |at| at.duration_since(start));
            let earliest = reached.iter().min().map_or(Duration::ZERO, |at| at.duration_since(start));
            eprintln!("xtask: bench: change {change}: first client {}, last {}", ms(earliest), ms(last));
            fan_out.push(last);
            first.push(earliest);
            thread::sleep(Duration::from_millis(500));
        }
        Ok((rss_after, idle_after, fan_out, first))
    })();
    let _ = stop.send(());
    let joined = spawned.join().map_err(|_| "the ADS clients panicked".to_owned())?;
    let (rss_after, idle_after, fan_out, first) = result?;
    joined?;

    #[allow(clippy::cast_precision_loss)]
    let per_stream = rss_after.saturating_sub(rss_before) as f64 / CLIENTS as f64;
    push(
        rows,
        Row::new(
            "xDS, 1 000 ADS streams (500 state of the world, 500 incremental) on one agent: RSS per stream",
            format!("{rss_before} KiB with 1 000 proxies and no stream"),
            format!("{per_stream:.1} KiB ({rss_after} KiB in all)"),
            "—".to_owned(),
            "≤ 20 KiB",
            met(per_stream <= RSS_TARGET_KIB),
        ),
    );
    let (median_last, max_last) = (median(&fan_out), fan_out.iter().max().copied().unwrap_or_default());
    let median_first = median(&first);
    push(
        rows,
        Row::new(
            &format!("xDS, 1 000 streams: API change for all → the last client has it, median / max of {CHANGES}"),
            format!("first client: {}", ms(median_first)),
            format!("{} / {}", ms(median_last), ms(max_last)),
            ratio(median_last.as_secs_f64(), median_first.as_secs_f64()),
            "≤ 1 s",
            met(max_last <= FAN_OUT_TARGET),
        ),
    );
    let per_second = |switches: u64| switches as f64 / IDLE.as_secs_f64();
    #[allow(clippy::cast_precision_loss)]
    let (before, after) = (per_second(idle_before), per_second(idle_after));
    push(
        rows,
        Row::new(
            "xDS, 1 000 streams open, nothing changing: the agent's context switches per second over 10 s",
            format!("no stream: {before:.1}/s"),
            format!("{after:.1}/s"),
            "—".to_owned(),
            "0 caused by streams",
            met(idle_after <= idle_before),
        ),
    );
    Ok(())
}

fn push(rows: &mut Vec<Row>, row: Row) {
    eprintln!("xtask: bench: {}: {} (baseline {}, target {})", row.figure, row.value, row.baseline, row.target);
    rows.push(row);
}

/// The context switches of every thread of `pid` over [`IDLE`].
fn idle_switches(pid: u32) -> Result<u64, String> {
    let before = sys::context_switches(pid)?;
    thread::sleep(IDLE);
    let after = sys::context_switches(pid)?;
    let (switches, exited) = sys::switches_between(&before, &after);
    if exited > 0 {
        eprintln!("xtask: bench: {exited} thread(s) exited during the idle window: a lower bound");
    }
    Ok(switches)
}

/// The names of the clusters in `resources`.
fn cluster_names<'a>(resources: impl Iterator<Item = &'a Any>) -> Result<Vec<String>, String> {
    resources
        .map(|any| Cluster::decode(any.value.as_slice()).map(|cluster| cluster.name).map_err(|err| err.to_string()))
        .collect()
}

/// The endpoints in a load assignment.
fn endpoint_count(any: &Any) -> Result<(String, usize), String> {
    let assignment = ClusterLoadAssignment::decode(any.value.as_slice()).map_err(|err| err.to_string())?;
    let count = assignment.endpoints.iter().map(|locality| locality.lb_endpoints.len()).sum();
    Ok((assignment.cluster_name, count))
}

/// The endpoints of `db` among what a client has.
fn db_endpoints(counts: &BTreeMap<String, usize>) -> usize {
    counts.get("service:db").copied().unwrap_or(0)
}

fn token_request<T>(message: T, token: &str) -> Result<tonic::Request<T>, String> {
    let mut request = tonic::Request::new(message);
    let value = token.parse().map_err(|_| "a token that is not ASCII".to_owned())?;
    request.metadata_mut().insert("x-tether-token", value);
    Ok(request)
}

/// Marks `kind` applied; once clusters, endpoints and listeners are, the client is synced.
fn applied(kinds: &mut [bool; 3], kind: usize, synced: &mut bool, progress: &Progress) {
    kinds[kind] = true;
    if !*synced && kinds.iter().all(|done| *done) {
        *synced = true;
        progress.synced.fetch_add(1, Ordering::SeqCst);
    }
}

/// The node of a simulated Envoy's first request, as large as a real one: Envoy 1.40 names
/// all its extensions there, about 61 KB in all (3 DATA frames of 16 KiB and one of 12 KB, seen
/// on the wire), which the server reads before it knows who is asking.
fn envoy_node(proxy: &str) -> Node {
    let extensions = (0..EXTENSIONS)
        .map(|index| Extension {
            name: format!("envoy.filters.network.example_{index:03}"),
            category: "envoy.filters.network".to_owned(),
            type_urls: vec![format!(
                "type.googleapis.com/envoy.extensions.filters.network.example_{index:03}.v3.Config"
            )],
            ..Extension::default()
        })
        .collect();
    Node {
        id: proxy.to_owned(),
        cluster: proxy.to_owned(),
        user_agent_name: "envoy".to_owned(),
        extensions,
        ..Node::default()
    }
}
/// A state-of-the-world client: each response is the whole of its type, each acknowledged
/// with its version and nonce (endpoints with the names asked for).
async fn sotw(channel: Channel, client: Client, progress: &Progress) -> Result<(), String> {
    let (requests, receiver) = mpsc::channel::<DiscoveryRequest>(8);
    let node = envoy_node(&client.proxy);
    let ask = |type_url: &str, names: Vec<String>, version: &str, nonce: &str| DiscoveryRequest {
        type_url: type_url.to_owned(),
        resource_names: names,
        version_info: version.to_owned(),
        response_nonce: nonce.to_owned(),
        ..DiscoveryRequest::default()
    };
    let first = DiscoveryRequest { node: Some(node), ..ask(CLUSTER, Vec::new(), "", "") };
    let closed = |_| "the stream's sender closed".to_owned();
    requests.send(first).await.map_err(closed)?;
    let request = token_request(ReceiverStream::new(receiver), &client.token)?;
    let mut grpc = AggregatedDiscoveryServiceClient::new(channel);
    let mut responses =
        grpc.stream_aggregated_resources(request).await.map_err(|status| status.to_string())?.into_inner();
    let mut asked: Vec<String> = Vec::new();
    let mut listeners = false;
    let (mut kinds, mut synced, mut best) = ([false; 3], false, 0);
    while let Some(response) = responses.message().await.map_err(|status| status.to_string())? {
        let (version, nonce) = (response.version_info.as_str(), response.nonce.as_str());
        match response.type_url.as_str() {
            CLUSTER => {
                let names = cluster_names(response.resources.iter())?;
                if names != asked {
                    asked = names;
                    requests.send(ask(ENDPOINT, asked.clone(), "", "")).await.map_err(closed)?;
                }
                requests.send(ask(CLUSTER, Vec::new(), version, nonce)).await.map_err(closed)?;
                if !listeners {
                    listeners = true;
                    requests.send(ask(LISTENER, Vec::new(), "", "")).await.map_err(closed)?;
                }
                applied(&mut kinds, 0, &mut synced, progress);
            }
            ENDPOINT => {
                let counts = response.resources.iter().map(endpoint_count).collect::<Result<_, _>>()?;
                progress.saw(&mut best, db_endpoints(&counts));
                requests.send(ask(ENDPOINT, asked.clone(), version, nonce)).await.map_err(closed)?;
                applied(&mut kinds, 1, &mut synced, progress);
            }
            LISTENER => {
                requests.send(ask(LISTENER, Vec::new(), version, nonce)).await.map_err(closed)?;
                applied(&mut kinds, 2, &mut synced, progress);
            }
            other => return Err(format!("a response of type {other}, never asked for")),
        }
    }
    Ok(())
}

/// An incremental client: clusters and listeners by wildcard, the endpoints of each cluster
/// subscribed by name as it comes; every response acknowledged by its nonce.
async fn delta(channel: Channel, client: Client, progress: &Progress) -> Result<(), String> {
    let (requests, receiver) = mpsc::channel::<DeltaDiscoveryRequest>(8);
    let node = envoy_node(&client.proxy);
    let ask = |type_url: &str, subscribe: Vec<String>, nonce: &str| DeltaDiscoveryRequest {
        type_url: type_url.to_owned(),
        resource_names_subscribe: subscribe,
        response_nonce: nonce.to_owned(),
        ..DeltaDiscoveryRequest::default()
    };
    let first = DeltaDiscoveryRequest { node: Some(node), ..ask(CLUSTER, Vec::new(), "") };
    let closed = |_| "the stream's sender closed".to_owned();
    requests.send(first).await.map_err(closed)?;
    let request = token_request(ReceiverStream::new(receiver), &client.token)?;
    let mut grpc = AggregatedDiscoveryServiceClient::new(channel);
    let mut responses =
        grpc.delta_aggregated_resources(request).await.map_err(|status| status.to_string())?.into_inner();
    let mut subscribed: Vec<String> = Vec::new();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut listeners = false;
    let (mut kinds, mut synced, mut best) = ([false; 3], false, 0);
    while let Some(response) = responses.message().await.map_err(|status| status.to_string())? {
        let nonce = response.nonce.as_str();
        match response.type_url.as_str() {
            CLUSTER => {
                let names = cluster_names(response.resources.iter().filter_map(|resource| resource.resource.as_ref()))?;
                let new: Vec<String> = names.into_iter().filter(|name| !subscribed.contains(name)).collect();
                if !new.is_empty() {
                    subscribed.extend(new.iter().cloned());
                    requests.send(ask(ENDPOINT, new, "")).await.map_err(closed)?;
                }
                requests.send(ask(CLUSTER, Vec::new(), nonce)).await.map_err(closed)?;
                if !listeners {
                    listeners = true;
                    requests.send(ask(LISTENER, Vec::new(), "")).await.map_err(closed)?;
                }
                applied(&mut kinds, 0, &mut synced, progress);
            }
            ENDPOINT => {
                for resource in &response.resources {
                    if let Some(any) = &resource.resource {
                        let (name, count) = endpoint_count(any)?;
                        counts.insert(name, count);
                    }
                }
                for name in &response.removed_resources {
                    counts.remove(name);
                }
                progress.saw(&mut best, db_endpoints(&counts));
                requests.send(ask(ENDPOINT, Vec::new(), nonce)).await.map_err(closed)?;
                applied(&mut kinds, 1, &mut synced, progress);
            }
            LISTENER => {
                requests.send(ask(LISTENER, Vec::new(), nonce)).await.map_err(closed)?;
                applied(&mut kinds, 2, &mut synced, progress);
            }
            other => return Err(format!("a response of type {other}, never asked for")),
        }
    }
    Ok(())
}
