//! One ADS stream's bookkeeping, state of the world ([`StreamState`]) or incremental
//! ([`DeltaState`]): what Envoy asked for, what was sent with which version and nonce, and
//! what Envoy said of it.
//!
//! Pure: requests come in, responses and verdicts come out; the gRPC plumbing is `mod.rs`'s.
//! The rules it keeps:
//!
//! - Types are sent in the order of [`Kind::ALL`] (clusters, then endpoints, then
//!   listeners), each only once Envoy has asked for it, and only when its version differs
//!   from what was sent last.
//! - A removed cluster is still sent until Envoy has applied the listeners of the same config
//!   (so that no listener names a cluster that is gone): removals come last.
//! - A version Envoy refused (a NACK) is not sent again: only a change of the config, which
//!   changes the version, sends anything of that type again. (Incrementally: a resource's
//!   version Envoy refused is not sent again.)

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};

use super::resources::{Kind, ProxyResources, Resources, version};

/// What Envoy said of a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// An ACK: it applied the version.
    Applied { kind: Kind, version: String },
    /// A NACK: it refused the version, with its own error text.
    Refused { kind: Kind, version: String, error: String },
}

#[derive(Debug, Clone)]
struct Sent {
    version: String,
    nonce: String,
    resources: Resources,
}

#[derive(Debug, Clone, Default)]
struct TypeState {
    /// Envoy asked for this type on this stream.
    subscribed: bool,
    /// For endpoints and secrets: the names Envoy asked for, sorted, without repeats.
    names: Vec<String>,
    sent: Option<Sent>,
    /// The last version Envoy applied.
    applied: Option<String>,
    /// The last version Envoy refused, while it is what was sent last.
    refused: Option<String>,
}

/// One stream's state.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamState {
    types: [TypeState; Kind::ALL.len()],
    nonces: u64,
}

impl StreamState {
    /// Takes one request from Envoy; the verdict it carries, if it answers the last response
    /// of its type. Requests of types the agent does not serve, and answers to older
    /// responses (stale nonces), carry none.
    pub(crate) fn on_request(&mut self, request: &DiscoveryRequest) -> Option<Answer> {
        let kind = Kind::from_type_url(&request.type_url)?;
        let state = &mut self.types[kind.index()];
        state.subscribed = true;
        if kind.named() {
            let mut names = request.resource_names.clone();
            names.sort_unstable();
            names.dedup();
            state.names = names;
        }
        if request.response_nonce.is_empty() {
            // A first request of this type (or Envoy asking again from scratch): it gets the
            // current resources, whatever was sent before.
            state.sent = None;
            state.refused = None;
            return None;
        }
        let sent = state.sent.as_ref().filter(|sent| sent.nonce == request.response_nonce)?;
        let version = sent.version.clone();
        match &request.error_detail {
            Some(status) => {
                state.refused = Some(version.clone());
                Some(Answer::Refused { kind, version, error: status.message.trim_end().to_owned() })
            }
            None => {
                state.applied = Some(version.clone());
                state.refused = None;
                Some(Answer::Applied { kind, version })
            }
        }
    }

    /// The responses that bring Envoy to `desired`, in order; none when it has (or refused)
    /// everything it asked for.
    pub(crate) fn responses(&mut self, desired: &ProxyResources) -> Vec<DiscoveryResponse> {
        let mut responses = Vec::new();
        for kind in Kind::ALL {
            if !self.types[kind.index()].subscribed {
                continue;
            }
            let resources = self.to_send(kind, desired);
            let state = &self.types[kind.index()];
            let asked: &[String] = if kind.named() { &state.names } else { &[] };
            let version = version(&resources, asked);
            let unchanged = state.sent.as_ref().is_some_and(|sent| sent.version == version);
            if unchanged || state.refused.as_ref() == Some(&version) {
                continue;
            }
            self.nonces += 1;
            let nonce = self.nonces.to_string();
            responses.push(DiscoveryResponse {
                version_info: version.clone(),
                resources: resources.values().cloned().collect(),
                type_url: kind.type_url(),
                nonce: nonce.clone(),
                ..DiscoveryResponse::default()
            });
            self.types[kind.index()].sent = Some(Sent { version, nonce, resources });
        }
        responses
    }

    /// What to send of `kind` for `desired`.
    fn to_send(&self, kind: Kind, desired: &ProxyResources) -> Resources {
        let state = &self.types[kind.index()];
        match kind {
            Kind::Cluster => {
                let mut clusters = desired.of(Kind::Cluster).clone();
                // Until Envoy applies the listeners of this config, the clusters it drops
                // stay: a listener it still runs may name them.
                let listeners = &self.types[Kind::Listener.index()];
                let caught_up = !listeners.subscribed
                    || listeners.applied.as_deref() == Some(version(desired.of(Kind::Listener), &[]).as_str());
                if !caught_up {
                    for (name, cluster) in state.sent.iter().flat_map(|sent| &sent.resources) {
                        clusters.entry(name.clone()).or_insert_with(|| cluster.clone());
                    }
                }
                clusters
            }
            Kind::Endpoint | Kind::Secret => {
                // Endpoints and secrets are asked for by name: a name the config dropped keeps
                // what was sent for it, for a cluster that stays until the listeners move on.
                let previous = state.sent.as_ref().map(|sent| &sent.resources);
                state
                    .names
                    .iter()
                    .filter_map(|name| {
                        let found = desired.of(kind).get(name).or_else(|| previous?.get(name))?;
                        Some((name.clone(), found.clone()))
                    })
                    .collect()
            }
            Kind::Listener => desired.of(Kind::Listener).clone(),
        }
    }
}

/// What the gRPC plumbing needs of a stream's bookkeeping, state of the world or delta.
pub(crate) trait Protocol: Default + Send + 'static {
    /// Its name in logs: `sotw` or `delta`.
    const NAME: &'static str;
    type Request: prost::Message + Default + Send + 'static;
    type Response: prost::Message + Send + 'static;

    /// The `node.id` of a request, if it has one.
    fn node(request: &Self::Request) -> Option<&str>;

    /// Takes one request; the verdict it carries, if any.
    fn on_request(&mut self, request: &Self::Request) -> Option<Answer>;

    /// The responses that bring Envoy to `desired`, in order.
    fn responses(&mut self, desired: &ProxyResources) -> Vec<Self::Response>;
}

impl Protocol for DeltaState {
    const NAME: &'static str = "delta";
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;

    fn node(request: &DeltaDiscoveryRequest) -> Option<&str> {
        request.node.as_ref().map(|node| node.id.as_str())
    }

    fn on_request(&mut self, request: &DeltaDiscoveryRequest) -> Option<Answer> {
        DeltaState::on_request(self, request)
    }

    fn responses(&mut self, desired: &ProxyResources) -> Vec<DeltaDiscoveryResponse> {
        DeltaState::responses(self, desired)
    }
}

impl Protocol for StreamState {
    const NAME: &'static str = "sotw";
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;

    fn node(request: &DiscoveryRequest) -> Option<&str> {
        request.node.as_ref().map(|node| node.id.as_str())
    }

    fn on_request(&mut self, request: &DiscoveryRequest) -> Option<Answer> {
        StreamState::on_request(self, request)
    }

    fn responses(&mut self, desired: &ProxyResources) -> Vec<DiscoveryResponse> {
        StreamState::responses(self, desired)
    }
}

/// The most responses of an incremental stream that wait for Envoy's answer: Envoy answers
/// each in order, so that only one that never gets an answer is dropped.
const PENDING_DELTAS: usize = 16;

/// A delta response sent and not answered yet.
#[derive(Debug, Clone)]
struct PendingDelta {
    kind: Kind,
    nonce: String,
    system_version: String,
    /// Each resource sent or removed, with the version Envoy had before (`None`: none).
    before: BTreeMap<String, Option<String>>,
    /// Each resource sent, with its version.
    sent: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default)]
struct DeltaType {
    subscribed: bool,
    /// For endpoints and secrets: the names Envoy subscribed to. Clusters and listeners are
    /// wildcard.
    names: BTreeSet<String>,
    /// What Envoy has (or will have, once it applies what was sent): name to version.
    known: BTreeMap<String, String>,
    /// Resource versions Envoy refused: not sent again.
    refused: BTreeMap<String, String>,
    /// The system version of the last response Envoy applied.
    applied: Option<String>,
}

/// One incremental (delta) ADS stream's state: each resource has its own version (a hash of
/// its bytes), and a response carries only what changed, and the names removed.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeltaState {
    types: [DeltaType; Kind::ALL.len()],
    pending: VecDeque<PendingDelta>,
    nonces: u64,
}

impl DeltaState {
    /// Takes one request from Envoy; the verdict it carries, if it answers a response.
    pub(crate) fn on_request(&mut self, request: &DeltaDiscoveryRequest) -> Option<Answer> {
        let kind = Kind::from_type_url(&request.type_url)?;
        let state = &mut self.types[kind.index()];
        state.subscribed = true;
        if kind.named() {
            state.names.extend(request.resource_names_subscribe.iter().cloned());
            for name in &request.resource_names_unsubscribe {
                state.names.remove(name);
                state.known.remove(name);
            }
        }
        if request.response_nonce.is_empty() {
            // A new subscription: what Envoy already has (after a reconnect) is not sent again.
            for (name, version) in &request.initial_resource_versions {
                state.known.insert(name.clone(), version.clone());
            }
            return None;
        }
        let at = self.pending.iter().position(|pending| pending.nonce == request.response_nonce)?;
        let pending = self.pending.remove(at)?;
        let state = &mut self.types[pending.kind.index()];
        match &request.error_detail {
            Some(status) => {
                // Envoy has what it had before; what it refused is not sent again.
                for (name, before) in pending.before {
                    match before {
                        Some(version) => state.known.insert(name, version),
                        None => state.known.remove(&name),
                    };
                }
                state.refused.extend(pending.sent);
                Some(Answer::Refused {
                    kind: pending.kind,
                    version: pending.system_version,
                    error: status.message.trim_end().to_owned(),
                })
            }
            None => {
                state.applied = Some(pending.system_version.clone());
                for name in pending.sent.keys() {
                    state.refused.remove(name);
                }
                Some(Answer::Applied { kind: pending.kind, version: pending.system_version })
            }
        }
    }

    /// The responses that bring Envoy to `desired`, in order: per type, the resources whose
    /// version differs from what Envoy has (and that it did not refuse), and the names gone.
    pub(crate) fn responses(&mut self, desired: &ProxyResources) -> Vec<DeltaDiscoveryResponse> {
        let mut responses = Vec::new();
        for kind in Kind::ALL {
            if !self.types[kind.index()].subscribed {
                continue;
            }
            let (wanted, kept) = self.wanted(kind, desired);
            let state = &self.types[kind.index()];
            let mut before = BTreeMap::new();
            let mut sent = BTreeMap::new();
            let mut resources = Vec::new();
            for (name, resource) in &wanted {
                let resource_version = version([(name, resource)], &[]);
                let has = state.known.get(name);
                if has == Some(&resource_version) || state.refused.get(name) == Some(&resource_version) {
                    continue;
                }
                before.insert(name.clone(), has.cloned());
                sent.insert(name.clone(), resource_version.clone());
                resources.push(Resource {
                    name: name.clone(),
                    version: resource_version,
                    resource: Some(resource.clone()),
                    ..Resource::default()
                });
            }
            // Endpoints and secrets are not removed: a name Envoy still subscribes to keeps
            // what it has.
            let removed: Vec<String> = if kind.named() {
                Vec::new()
            } else {
                state
                    .known
                    .keys()
                    .filter(|name| !wanted.contains_key(*name) && !kept.contains(*name))
                    .cloned()
                    .collect()
            };
            if resources.is_empty() && removed.is_empty() {
                continue;
            }
            for name in &removed {
                before.insert(name.clone(), state.known.get(name).cloned());
            }
            self.nonces += 1;
            let nonce = self.nonces.to_string();
            let system_version = version(&wanted, &[]);
            let state = &mut self.types[kind.index()];
            for (name, resource_version) in &sent {
                state.known.insert(name.clone(), resource_version.clone());
            }
            for name in &removed {
                state.known.remove(name);
            }
            if self.pending.len() == PENDING_DELTAS {
                self.pending.pop_front();
            }
            self.pending.push_back(PendingDelta {
                kind,
                nonce: nonce.clone(),
                system_version: system_version.clone(),
                before,
                sent,
            });
            responses.push(DeltaDiscoveryResponse {
                system_version_info: system_version,
                resources,
                type_url: kind.type_url(),
                removed_resources: removed,
                nonce,
                ..DeltaDiscoveryResponse::default()
            });
        }
        responses
    }

    /// What Envoy should have of `kind` (for endpoints, of those subscribed to), and the
    /// names it has that are not to be removed yet: the clusters `desired` dropped, until
    /// Envoy applied the listeners of `desired`.
    fn wanted(&self, kind: Kind, desired: &ProxyResources) -> (Resources, BTreeSet<String>) {
        let state = &self.types[kind.index()];
        match kind {
            Kind::Cluster => {
                let clusters = desired.of(Kind::Cluster).clone();
                let listeners = &self.types[Kind::Listener.index()];
                let caught_up = !listeners.subscribed
                    || listeners.applied.as_deref() == Some(version(desired.of(Kind::Listener), &[]).as_str());
                let kept = if caught_up {
                    BTreeSet::new()
                } else {
                    state.known.keys().filter(|name| !clusters.contains_key(*name)).cloned().collect()
                };
                (clusters, kept)
            }
            Kind::Endpoint | Kind::Secret => {
                let endpoints = desired
                    .of(kind)
                    .iter()
                    .filter(|(name, _)| state.names.contains(*name))
                    .map(|(name, resource)| (name.clone(), resource.clone()))
                    .collect();
                (endpoints, BTreeSet::new())
            }
            Kind::Listener => (desired.of(Kind::Listener).clone(), BTreeSet::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use envoy_types::pb::google::rpc::Status;
    use tether_state::{ProxyId, Service, ServiceId, ServiceName};

    use super::super::resources::{self, LOCAL_CLUSTER, Target};
    use super::*;

    fn desired(config: serde_json::Value, targets: &[(&str, u16)]) -> ProxyResources {
        let id = ServiceId::new("web").unwrap();
        let mut service = Service::new(id.clone(), ServiceName::new("web").unwrap());
        service.port = Some(8080);
        let serde_json::Value::Object(config) = config else { panic!("config is a table") };
        let targets: BTreeMap<String, Vec<Target>> = BTreeMap::from([(
            "db".to_owned(),
            targets.iter().map(|(address, port)| Target { address: (*address).to_owned(), port: *port }).collect(),
        )]);
        resources::build(&ProxyId::parse("web-proxy").unwrap(), &service, &config, &targets).unwrap()
    }

    fn with_db() -> ProxyResources {
        desired(
            serde_json::json!({"bind_port": 21000, "upstreams": [{"destination_name": "db", "local_bind_port": 9191}]}),
            &[("127.0.0.1", 5432)],
        )
    }

    fn without_db() -> ProxyResources {
        desired(serde_json::json!({"bind_port": 21000}), &[])
    }

    fn request(
        kind: Kind,
        names: &[&str],
        answering: Option<&DiscoveryResponse>,
        error: Option<&str>,
    ) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: kind.type_url(),
            resource_names: names.iter().map(|name| (*name).to_owned()).collect(),
            response_nonce: answering.map(|response| response.nonce.clone()).unwrap_or_default(),
            version_info: answering.map(|response| response.version_info.clone()).unwrap_or_default(),
            error_detail: error.map(|message| Status { code: 3, message: message.to_owned(), details: Vec::new() }),
            ..DiscoveryRequest::default()
        }
    }

    fn kinds(responses: &[DiscoveryResponse]) -> Vec<Kind> {
        responses.iter().map(|response| Kind::from_type_url(&response.type_url).unwrap()).collect()
    }

    fn names(response: &DiscoveryResponse) -> Vec<String> {
        use prost::Message;
        response
            .resources
            .iter()
            .map(|any| match Kind::from_type_url(&any.type_url).unwrap() {
                Kind::Cluster => {
                    envoy_types::pb::envoy::config::cluster::v3::Cluster::decode(any.value.as_slice()).unwrap().name
                }
                Kind::Endpoint => {
                    envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment::decode(any.value.as_slice())
                        .unwrap()
                        .cluster_name
                }
                Kind::Listener => {
                    envoy_types::pb::envoy::config::listener::v3::Listener::decode(any.value.as_slice()).unwrap().name
                }
                Kind::Secret => {
                    envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret::decode(any.value.as_slice())
                        .unwrap()
                        .name
                }
            })
            .collect()
    }

    /// A stream through Envoy's usual start: clusters, their endpoints, then listeners, each
    /// applied. Returns the state and the last response of each kind.
    fn started(config: &ProxyResources) -> (StreamState, BTreeMap<Kind, DiscoveryResponse>) {
        let mut stream = StreamState::default();
        let mut last = BTreeMap::new();
        assert_eq!(stream.on_request(&request(Kind::Cluster, &[], None, None)), None);
        let sent = stream.responses(config);
        assert_eq!(kinds(&sent), [Kind::Cluster]);
        last.insert(Kind::Cluster, sent[0].clone());
        let asked: Vec<&str> = config.of(Kind::Endpoint).keys().map(String::as_str).collect();
        stream.on_request(&request(Kind::Endpoint, &asked, None, None));
        let sent = stream.responses(config);
        assert_eq!(kinds(&sent), [Kind::Endpoint]);
        last.insert(Kind::Endpoint, sent[0].clone());
        let applied = stream.on_request(&request(Kind::Cluster, &[], Some(&last[&Kind::Cluster]), None));
        assert!(matches!(applied, Some(Answer::Applied { kind: Kind::Cluster, .. })), "{applied:?}");
        stream.on_request(&request(Kind::Listener, &[], None, None));
        let sent = stream.responses(config);
        assert_eq!(kinds(&sent), [Kind::Listener]);
        last.insert(Kind::Listener, sent[0].clone());
        stream.on_request(&request(Kind::Endpoint, &asked, Some(&last[&Kind::Endpoint]), None));
        stream.on_request(&request(Kind::Listener, &[], Some(&last[&Kind::Listener]), None));
        assert!(stream.responses(config).is_empty(), "nothing changed, nothing is sent");
        (stream, last)
    }

    #[test]
    fn each_type_is_sent_once_asked_for_and_then_only_when_it_changes() {
        let (mut stream, _) = started(&with_db());
        assert!(stream.responses(&with_db()).is_empty());
        let moved = desired(
            serde_json::json!({"bind_port": 21000, "upstreams": [{"destination_name": "db", "local_bind_port": 9191}]}),
            &[("127.0.0.1", 5433)],
        );
        let sent = stream.responses(&moved);
        assert_eq!(kinds(&sent), [Kind::Endpoint], "only the endpoints changed");
    }

    #[test]
    fn a_change_is_sent_clusters_first_then_endpoints_then_listeners() {
        let (mut stream, _) = started(&without_db());
        // Envoy asks for endpoints of the clusters it has: the local one only.
        let sent = stream.responses(&with_db());
        assert_eq!(kinds(&sent), [Kind::Cluster, Kind::Listener]);
        assert_eq!(names(&sent[0]), [LOCAL_CLUSTER, "service:db"]);
        assert_eq!(names(&sent[1]).len(), 2);
    }

    #[test]
    fn a_removed_cluster_stays_until_envoy_applied_the_listeners_without_it() {
        let (mut stream, _) = started(&with_db());
        let sent = stream.responses(&without_db());
        assert_eq!(kinds(&sent), [Kind::Listener], "the cluster is still sent as it was");
        assert_eq!(names(&sent[0]), ["public_listener:127.0.0.1:21000"]);
        stream.on_request(&request(Kind::Listener, &[], Some(&sent[0]), None));
        let sent = stream.responses(&without_db());
        assert_eq!(kinds(&sent), [Kind::Cluster], "once the listeners are applied, the cluster goes");
        assert_eq!(names(&sent[0]), [LOCAL_CLUSTER]);
    }

    #[test]
    fn a_refused_version_is_not_sent_again_until_the_config_changes() {
        let (mut stream, _) = started(&without_db());
        let sent = stream.responses(&with_db());
        let listeners = sent.iter().find(|response| response.type_url == Kind::Listener.type_url()).unwrap();
        let answer = stream.on_request(&request(Kind::Listener, &[], Some(listeners), Some("cannot bind")));
        assert_eq!(
            answer,
            Some(Answer::Refused {
                kind: Kind::Listener,
                version: listeners.version_info.clone(),
                error: "cannot bind".to_owned()
            })
        );
        assert!(stream.responses(&with_db()).is_empty(), "the refused version is not sent again");
        // Back to the config Envoy runs: its listeners go out again, at their old version.
        let sent = stream.responses(&without_db());
        assert!(kinds(&sent).contains(&Kind::Listener), "{:?}", kinds(&sent));
    }

    #[test]
    fn an_answer_to_an_older_response_carries_no_verdict() {
        let (mut stream, last) = started(&without_db());
        let newer = stream.responses(&with_db());
        assert!(!newer.is_empty());
        let stale = stream.on_request(&request(Kind::Cluster, &[], Some(&last[&Kind::Cluster]), Some("old")));
        assert_eq!(stale, None);
    }

    #[test]
    fn requests_of_types_not_served_are_ignored() {
        let mut stream = StreamState::default();
        let request = DiscoveryRequest {
            type_url: "type.googleapis.com/envoy.config.route.v3.RouteConfiguration".to_owned(),
            ..DiscoveryRequest::default()
        };
        assert_eq!(stream.on_request(&request), None);
        assert!(stream.responses(&with_db()).is_empty());
    }

    #[test]
    fn endpoints_are_sent_for_the_names_asked_for() {
        let mut stream = StreamState::default();
        stream.on_request(&request(Kind::Endpoint, &["service:db"], None, None));
        let sent = stream.responses(&with_db());
        assert_eq!(names(&sent[0]), ["service:db"]);
    }

    fn delta_request(
        kind: Kind,
        subscribe: &[&str],
        answering: Option<&DeltaDiscoveryResponse>,
        error: Option<&str>,
    ) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: kind.type_url(),
            resource_names_subscribe: subscribe.iter().map(|name| (*name).to_owned()).collect(),
            response_nonce: answering.map(|response| response.nonce.clone()).unwrap_or_default(),
            error_detail: error.map(|message| Status { code: 3, message: message.to_owned(), details: Vec::new() }),
            ..DeltaDiscoveryRequest::default()
        }
    }

    fn delta_kinds(responses: &[DeltaDiscoveryResponse]) -> Vec<Kind> {
        responses.iter().map(|response| Kind::from_type_url(&response.type_url).unwrap()).collect()
    }

    fn delta_names(response: &DeltaDiscoveryResponse) -> Vec<&str> {
        response.resources.iter().map(|resource| resource.name.as_str()).collect()
    }

    /// A delta stream through Envoy's usual start, every response applied.
    fn delta_started(config: &ProxyResources) -> DeltaState {
        let mut stream = DeltaState::default();
        stream.on_request(&delta_request(Kind::Cluster, &[], None, None));
        let clusters = stream.responses(config);
        assert_eq!(delta_kinds(&clusters), [Kind::Cluster]);
        let asked: Vec<&str> = config.of(Kind::Endpoint).keys().map(String::as_str).collect();
        stream.on_request(&delta_request(Kind::Endpoint, &asked, None, None));
        let endpoints = stream.responses(config);
        assert_eq!(delta_kinds(&endpoints), [Kind::Endpoint]);
        let applied = stream.on_request(&delta_request(Kind::Cluster, &[], Some(&clusters[0]), None));
        assert!(matches!(applied, Some(Answer::Applied { kind: Kind::Cluster, .. })), "{applied:?}");
        stream.on_request(&delta_request(Kind::Endpoint, &[], Some(&endpoints[0]), None));
        stream.on_request(&delta_request(Kind::Listener, &[], None, None));
        let listeners = stream.responses(config);
        assert_eq!(delta_kinds(&listeners), [Kind::Listener]);
        stream.on_request(&delta_request(Kind::Listener, &[], Some(&listeners[0]), None));
        assert!(stream.responses(config).is_empty(), "nothing changed, nothing is sent");
        stream
    }

    #[test]
    fn a_delta_carries_only_the_resources_that_changed() {
        let mut stream = delta_started(&with_db());
        let moved = desired(
            serde_json::json!({"bind_port": 21000, "upstreams": [{"destination_name": "db", "local_bind_port": 9191}]}),
            &[("127.0.0.1", 5433)],
        );
        let sent = stream.responses(&moved);
        assert_eq!(delta_kinds(&sent), [Kind::Endpoint]);
        assert_eq!(delta_names(&sent[0]), ["service:db"], "the local endpoints did not change");
        assert!(sent[0].removed_resources.is_empty());
    }

    #[test]
    fn a_delta_removes_a_cluster_only_once_envoy_applied_the_listeners_without_it() {
        let mut stream = delta_started(&with_db());
        let sent = stream.responses(&without_db());
        assert_eq!(delta_kinds(&sent), [Kind::Listener]);
        assert_eq!(sent[0].removed_resources, ["upstream:db:127.0.0.1:9191"]);
        assert!(sent[0].resources.is_empty(), "the public listener did not change");
        stream.on_request(&delta_request(Kind::Listener, &[], Some(&sent[0]), None));
        let sent = stream.responses(&without_db());
        assert_eq!(delta_kinds(&sent), [Kind::Cluster]);
        assert_eq!(sent[0].removed_resources, ["service:db"]);
    }

    #[test]
    fn a_refused_delta_is_not_sent_again_and_envoy_keeps_what_it_had() {
        let mut stream = delta_started(&without_db());
        let sent = stream.responses(&with_db());
        let listeners = sent.iter().find(|response| response.type_url == Kind::Listener.type_url()).unwrap();
        assert_eq!(delta_names(listeners), ["upstream:db:127.0.0.1:9191"]);
        let answer = stream.on_request(&delta_request(Kind::Listener, &[], Some(listeners), Some("cannot bind\n")));
        assert!(
            matches!(answer, Some(Answer::Refused { kind: Kind::Listener, ref error, .. }) if error == "cannot bind")
        );
        assert!(stream.responses(&with_db()).is_empty(), "the refused resource is not sent again");
        // Envoy never had the upstream listener: going back removes nothing of it.
        let back = stream.responses(&without_db());
        assert!(
            back.iter().all(|response| !response.removed_resources.contains(&"upstream:db:127.0.0.1:9191".to_owned()))
        );
    }

    #[test]
    fn a_reconnected_envoy_gets_only_what_it_does_not_have() {
        let config = with_db();
        let mut stream = DeltaState::default();
        let mut request = delta_request(Kind::Listener, &[], None, None);
        for (name, resource) in config.of(Kind::Listener) {
            request.initial_resource_versions.insert(name.clone(), version([(name, resource)], &[]));
        }
        request.initial_resource_versions.insert("public_listener:127.0.0.1:1".to_owned(), "old".to_owned());
        stream.on_request(&request);
        let sent = stream.responses(&config);
        assert_eq!(delta_kinds(&sent), [Kind::Listener]);
        assert!(sent[0].resources.is_empty(), "{:?}", delta_names(&sent[0]));
        assert_eq!(sent[0].removed_resources, ["public_listener:127.0.0.1:1"]);
    }
}
