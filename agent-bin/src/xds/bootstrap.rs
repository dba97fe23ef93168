//! `tether envoy bootstrap`: the bootstrap with which an Envoy gets its whole config from
//! the agent over ADS.
//!
//! The bootstrap holds the proxy's token, so that it is written only to stdout or to a file
//! of mode 0600. The token comes from the proxy's own environment when the command runs
//! as the proxy (`TETHER_PROXY_ID`, `TETHER_PROXY_TOKEN`), else from the data dir's
//! `tokens.json`, which only the agent's user can read.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use serde_json::{Value, json};
use tether_state::config::DisplayPath;
use tether_state::persist::{PrivateDir, RegistrationStore, TokenStore};
use tether_state::{ProxyId, ProxyToken, proxy_env};

use super::{SOCKET_NAME, TOKEN_METADATA};
use crate::error::UsageError;

/// The name of the static cluster through which Envoy reaches the agent.
pub(crate) const XDS_CLUSTER: &str = "tether_xds";

/// How long Envoy waits for the first answer of a resource type before it starts without
/// it: short, so that a started Envoy is ready quickly even while the agent is away.
pub(crate) const INITIAL_FETCH_TIMEOUT: &str = "1s";

/// Where Envoy reaches the agent's xDS server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum XdsTarget {
    /// The Unix socket in the data dir.
    Socket(PathBuf),
    /// `--xds-address`.
    Tcp(SocketAddr),
}

/// What a bootstrap says.
#[derive(Debug, Clone)]
pub(crate) struct Bootstrap<'a> {
    pub(crate) proxy: &'a ProxyId,
    pub(crate) token: &'a ProxyToken,
    pub(crate) xds: &'a XdsTarget,
    pub(crate) admin: SocketAddr,
    /// Incremental ADS (`DELTA_GRPC`) rather than state of the world (`GRPC`).
    pub(crate) delta: bool,
}

impl Bootstrap<'_> {
    /// The bootstrap as JSON (which Envoy reads as YAML too).
    pub(crate) fn to_json(&self) -> Value {
        let address = match self.xds {
            XdsTarget::Socket(path) => json!({"pipe": {"path": path.display().to_string()}}),
            XdsTarget::Tcp(address) => {
                json!({"socket_address": {"address": address.ip().to_string(), "port_value": address.port()}})
            }
        };
        let ads_source =
            json!({"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": INITIAL_FETCH_TIMEOUT});
        json!({
            "node": {"id": self.proxy.as_str(), "cluster": self.proxy.service_id().as_str()},
            "admin": {
                "address": {"socket_address": {"address": self.admin.ip().to_string(), "port_value": self.admin.port()}}
            },
            "dynamic_resources": {
                "ads_config": {
                    "api_type": if self.delta { "DELTA_GRPC" } else { "GRPC" },
                    "transport_api_version": "V3",
                    "set_node_on_first_message_only": true,
                    "grpc_services": [{
                        "envoy_grpc": {"cluster_name": XDS_CLUSTER},
                        "initial_metadata": [{"key": TOKEN_METADATA, "value": self.token.expose()}]
                    }]
                },
                "cds_config": ads_source,
                "lds_config": ads_source
            },
            "static_resources": {
                "clusters": [{
                    "name": XDS_CLUSTER,
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}}
                        }
                    },
                    "load_assignment": {
                        "cluster_name": XDS_CLUSTER,
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]
                    }
                }]
            }
        })
    }
}

/// What `tether envoy bootstrap` was given.
#[derive(Debug, Clone)]
pub(crate) struct BootstrapRequest {
    /// The proxy (or its service's id); `None`: `TETHER_PROXY_ID`.
    pub(crate) proxy: Option<String>,
    /// `--data-dir`, when given (or `TETHER_DATA_DIR`).
    pub(crate) data_dir: Option<PathBuf>,
    pub(crate) xds_address: Option<SocketAddr>,
    pub(crate) admin_address: SocketAddr,
    pub(crate) output: Option<PathBuf>,
    pub(crate) delta: bool,
}

/// Runs `tether envoy bootstrap`.
///
/// # Errors
///
/// [`UsageError`] for a bad id or a proxy without a token; the write's error.
pub(crate) fn run(request: &BootstrapRequest) -> anyhow::Result<ExitCode> {
    let own_id = std::env::var(proxy_env::PROXY_ID).ok();
    let name = request.proxy.clone().or_else(|| own_id.clone()).ok_or_else(|| {
        UsageError(format!("no PROXY_ID: give one, or run this as the proxy, whose {} names it", proxy_env::PROXY_ID))
    })?;
    let candidates = crate::catalog::names::proxies_named(&name).map_err(|err| UsageError(err.to_string()))?;
    // Run as the proxy, its data dir is where its agent's socket is.
    let data_dir = match (&request.data_dir, std::env::var_os(proxy_env::SOCKET)) {
        (Some(dir), _) => dir.clone(),
        (None, Some(socket)) => Path::new(&socket)
            .parent()
            .map(Path::to_owned)
            .unwrap_or_else(|| PathBuf::from(crate::cli::DEFAULT_DATA_DIR)),
        (None, None) => PathBuf::from(crate::cli::DEFAULT_DATA_DIR),
    };
    let (proxy, token) = token_of(&candidates, own_id.as_deref(), &data_dir)?;
    let xds = match request.xds_address {
        Some(address) => XdsTarget::Tcp(address),
        None => XdsTarget::Socket(std::path::absolute(data_dir.join(SOCKET_NAME)).context("resolving the data dir")?),
    };
    let bootstrap =
        Bootstrap { proxy: &proxy, token: &token, xds: &xds, admin: request.admin_address, delta: request.delta };
    let mut text = serde_json::to_string_pretty(&bootstrap.to_json()).context("encoding the bootstrap")?;
    text.push('\n');
    match &request.output {
        Some(path) => {
            // Mode 0600: the file holds the proxy's token.
            tether_state::persist::write_atomic(path, text.as_bytes())
                .with_context(|| format!("writing the bootstrap to {}", DisplayPath(path)))?;
        }
        None => std::io::stdout().write_all(text.as_bytes()).context("writing the bootstrap")?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The first of `candidates` that has a token: from the environment when it is the proxy
/// this runs as, else from `data_dir`'s `tokens.json`, else from its API registration.
fn token_of(candidates: &[ProxyId], own_id: Option<&str>, data_dir: &Path) -> anyhow::Result<(ProxyId, ProxyToken)> {
    if let (Some(own), Ok(token)) = (own_id, std::env::var(proxy_env::PROXY_TOKEN)) {
        if let Some(proxy) = candidates.iter().find(|id| id.as_str() == own) {
            let token = ProxyToken::from_hex(token)
                .map_err(|err| UsageError(format!("{} is not a token: {err}", proxy_env::PROXY_TOKEN)))?;
            return Ok((proxy.clone(), token));
        }
    }
    let absolute = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_owned());
    let dir = PrivateDir::open_no_follow(&absolute)
        .with_context(|| format!("cannot open the data dir {}", DisplayPath(&absolute)))?;
    let loaded = TokenStore::new(dir).load();
    if let Some(damaged) = loaded.damaged {
        return Err(anyhow::anyhow!(
            "the tokens of {} cannot be read ({}): the agent makes new ones at its next start",
            DisplayPath(&absolute),
            damaged.problem
        ));
    }
    // An API registration holds its proxy's token from before `tokens.json` does.
    let registrations = PrivateDir::open_no_follow(&absolute.join("registrations")).ok().map(RegistrationStore::new);
    let registered = |id: &ProxyId| registrations.as_ref().and_then(|store| store.token(&id.service_id()));
    let found = candidates.iter().find_map(|id| loaded.tokens.get(id).map(|token| (id.clone(), token.clone())));
    found.or_else(|| candidates.iter().find_map(|id| registered(id).map(|token| (id.clone(), token)))).ok_or_else(
        || {
            let names: Vec<&str> = candidates.iter().map(ProxyId::as_str).collect();
            UsageError(format!(
                "no proxy {} has a token in {}: is it in the agent's catalog?",
                names.join(" or "),
                DisplayPath(&absolute)
            ))
            .into()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registered_proxys_token_is_found_in_its_registration_before_tokens_json_has_it() {
        let root = tempfile::tempdir().unwrap();
        let data = tether_state::persist::DataDir::open(root.path()).unwrap();
        let service = tether_state::Service::new(
            tether_state::ServiceId::new("web").unwrap(),
            tether_state::ServiceName::new("web").unwrap(),
        )
        .with_proxy(tether_state::ProxySpec::default());
        let token = ProxyToken::generate().unwrap();
        let kept = data.registrations().save_with_token(&service, &token).unwrap();
        let proxy = service.id.proxy_id();
        let found = token_of(std::slice::from_ref(&proxy), None, root.path());
        if kept {
            assert_eq!(found.unwrap(), (proxy.clone(), token));
        } else {
            // A file system without extended attributes: only tokens.json can tell.
            assert!(found.unwrap_err().to_string().contains("no proxy web-proxy has a token"));
        }
        // Once tokens.json has it, that is where it comes from.
        let other = ProxyToken::generate().unwrap();
        data.tokens().save(&std::collections::BTreeMap::from([(proxy.clone(), other.clone())])).unwrap();
        assert_eq!(token_of(std::slice::from_ref(&proxy), None, root.path()).unwrap(), (proxy, other));
    }

    #[test]
    fn the_bootstrap_names_the_node_carries_the_token_and_reaches_the_socket() {
        let proxy = ProxyId::parse("web-proxy").unwrap();
        let token = ProxyToken::from_hex("ab".repeat(32)).unwrap();
        let xds = XdsTarget::Socket(PathBuf::from("/var/lib/tether/xds.sock"));
        let admin: SocketAddr = "127.0.0.1:19000".parse().unwrap();
        let json = Bootstrap { proxy: &proxy, token: &token, xds: &xds, admin, delta: false }.to_json();
        assert_eq!(json["node"]["id"], "web-proxy");
        assert_eq!(json["node"]["cluster"], "web");
        let service = &json["dynamic_resources"]["ads_config"]["grpc_services"][0];
        assert_eq!(service["envoy_grpc"]["cluster_name"], XDS_CLUSTER);
        assert_eq!(service["initial_metadata"][0]["key"], TOKEN_METADATA);
        assert_eq!(service["initial_metadata"][0]["value"], "ab".repeat(32));
        let cluster = &json["static_resources"]["clusters"][0];
        let endpoint = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"];
        assert_eq!(endpoint["address"]["pipe"]["path"], "/var/lib/tether/xds.sock");
        assert_eq!(json["admin"]["address"]["socket_address"]["port_value"], 19000);
        assert_eq!(json["dynamic_resources"]["lds_config"]["initial_fetch_timeout"], INITIAL_FETCH_TIMEOUT);
        assert_eq!(json["dynamic_resources"]["ads_config"]["api_type"], "GRPC");
        let delta = Bootstrap { proxy: &proxy, token: &token, xds: &xds, admin, delta: true }.to_json();
        assert_eq!(delta["dynamic_resources"]["ads_config"]["api_type"], "DELTA_GRPC");
    }

    #[test]
    fn a_tcp_target_is_a_socket_address() {
        let proxy = ProxyId::parse("web-proxy").unwrap();
        let token = ProxyToken::from_hex("ab".repeat(32)).unwrap();
        let xds = XdsTarget::Tcp("127.0.0.1:8502".parse().unwrap());
        let admin: SocketAddr = "127.0.0.1:19000".parse().unwrap();
        let json = Bootstrap { proxy: &proxy, token: &token, xds: &xds, admin, delta: false }.to_json();
        let endpoint =
            &json["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"];
        assert_eq!(endpoint["address"]["socket_address"]["port_value"], 8502);
    }
}
