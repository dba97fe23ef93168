//! One state-of-the-world ADS stream's bookkeeping: what Envoy asked for, what was sent
//! with which version and nonce, and what Envoy said of it.
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
//!   changes the version, sends anything of that type again.

use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};

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
    /// For endpoints: the names Envoy asked for, sorted, without repeats.
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
    types: [TypeState; 3],
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
        if kind == Kind::Endpoint {
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
            let asked: &[String] = if kind == Kind::Endpoint { &state.names } else { &[] };
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
            Kind::Endpoint => {
                // Endpoints are asked for by name: a name the config dropped keeps what was
                // sent for it, for a cluster that stays until the listeners move on.
                let previous = state.sent.as_ref().map(|sent| &sent.resources);
                state
                    .names
                    .iter()
                    .filter_map(|name| {
                        let found = desired.of(Kind::Endpoint).get(name).or_else(|| previous?.get(name))?;
                        Some((name.clone(), found.clone()))
                    })
                    .collect()
            }
            Kind::Listener => desired.of(Kind::Listener).clone(),
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
}
