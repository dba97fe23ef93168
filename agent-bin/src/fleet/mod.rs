//! The fleet catalog: services that a cluster store (etcd v3) holds for this node.
//!
//! Keys are `<prefix>/nodes/<node>/services/<service id>`; each value is one service object
//! in the register API's JSON schema. This module owns the key layout, the parsing of values into
//! services (an invalid value is a per-key report, never a failure of the whole set), and
//! the connection options shared by the agent's follower (`follow`) and the operators'
//! commands (`cli`). Its services enter `LocalState` as `Source::External("etcd")`. It
//! never starts a process and writes nothing outside the data dir (`store`).

pub(crate) mod cli;
pub(crate) mod etcd;
pub(crate) mod follow;
pub(crate) mod publish;
pub(crate) mod roles;
pub(crate) mod rollout;
pub(crate) mod status;
pub(crate) mod store;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tether_state::config::{self, ConfigError, Format, Origin};
use tether_state::{IdError, Service, ServiceId, SourceKind};

/// The name of the fleet source in the catalog (`Source::External`).
pub(crate) const SOURCE_NAME: &str = "etcd";

/// The catalog source kind of fleet services.
pub(crate) fn source_kind() -> SourceKind {
    SourceKind::External(SOURCE_NAME.to_owned())
}

/// Where one node's services live in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    prefix: String,
    node: String,
}

/// A node name or prefix that cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LayoutError {
    #[error("node name `{node}` is invalid: it must match {}", tether_state::SERVICE_ID_RULE)]
    Node { node: String },
    #[error("etcd prefix `{prefix}` is invalid: it must start with `/`")]
    Prefix { prefix: String },
}

impl Layout {
    /// The layout of `node` under `prefix` (a trailing `/` is ignored).
    pub(crate) fn new(prefix: &str, node: &str) -> Result<Self, LayoutError> {
        if !prefix.starts_with('/') {
            return Err(LayoutError::Prefix { prefix: prefix.to_owned() });
        }
        // A node name is a key segment and a label: the id rule, as for a service id.
        let valid_node = tether_state::check_service_id(node).is_ok();
        if !valid_node {
            return Err(LayoutError::Node { node: node.to_owned() });
        }
        Ok(Self { prefix: prefix.trim_end_matches('/').to_owned(), node: node.to_owned() })
    }

    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn node(&self) -> &str {
        &self.node
    }

    /// The key of this node's status: `<prefix>/status/<node>`.
    pub(crate) fn status_key(&self) -> String {
        format!("{}/status/{}", self.prefix, self.node)
    }

    /// The key of one proxy's status: `<prefix>/status/<node>/proxies/<proxy id>`.
    pub(crate) fn proxy_status_key(&self, proxy: &tether_state::ProxyId) -> String {
        format!("{}/proxies/{proxy}", self.status_key())
    }

    /// The key that lists one ready instance of a service:
    /// `<prefix>/instances/<service name>/<node>/<service id>`.
    pub(crate) fn instance_key(&self, name: &tether_state::ServiceName, id: &ServiceId) -> String {
        format!("{}/instances/{name}/{}/{id}", self.prefix, self.node)
    }

    /// The prefix of every service key of this node, ending in `/`.
    pub(crate) fn services_prefix(&self) -> String {
        format!("{}/nodes/{}/services/", self.prefix, self.node)
    }

    /// The key of service `id`.
    pub(crate) fn key(&self, id: &ServiceId) -> String {
        format!("{}{id}", self.services_prefix())
    }
}

/// Why one key's value was skipped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ValueError {
    #[error("key is not UTF-8")]
    KeyNotUtf8,
    #[error("key is not under {prefix}")]
    OutsidePrefix { prefix: String },
    #[error("the key's last segment is not a valid service id")]
    KeyId(#[source] IdError),
    #[error("value is not UTF-8")]
    ValueNotUtf8,
    #[error("invalid service")]
    Invalid(#[source] ConfigError),
    #[error("the value's id `{value_id}` differs from the key's id `{key_id}`")]
    IdMismatch { key_id: ServiceId, value_id: ServiceId },
}

/// Parses one key and its value into a service.
///
/// # Errors
///
/// A [`ValueError`] that says what is wrong; for an invalid service, its source names the
/// position and the field, with the key in place of a file name.
pub(crate) fn parse_entry(layout: &Layout, key: &[u8], value: &[u8]) -> Result<Service, ValueError> {
    let id = key_id(layout, key)?;
    let text = std::str::from_utf8(value).map_err(|_| ValueError::ValueNotUtf8)?;
    let origin = Origin::File(PathBuf::from(String::from_utf8_lossy(key).into_owned()));
    let service = config::parse_service(text, Format::Json, &origin).map_err(ValueError::Invalid)?;
    if service.id != id {
        return Err(ValueError::IdMismatch { key_id: id, value_id: service.id });
    }
    Ok(service)
}

/// The service id that a key names.
pub(crate) fn key_id(layout: &Layout, key: &[u8]) -> Result<ServiceId, ValueError> {
    let key = std::str::from_utf8(key).map_err(|_| ValueError::KeyNotUtf8)?;
    let prefix = layout.services_prefix();
    let rest = key.strip_prefix(&prefix).ok_or(ValueError::OutsidePrefix { prefix })?;
    ServiceId::new(rest).map_err(ValueError::KeyId)
}

/// The desired set of one node as last read from etcd: every valid value, by key id, and
/// every invalid key with its problem. `revision` is the etcd revision it reflects (0 when
/// unknown), so that a follower can resume watching at `revision + 1`; `mod_revisions` holds,
/// for each service in force, the mod revision of the key it was read from.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Desired {
    pub(crate) revision: i64,
    pub(crate) services: BTreeMap<ServiceId, Service>,
    pub(crate) mod_revisions: BTreeMap<ServiceId, i64>,
    pub(crate) invalid: BTreeMap<String, String>,
}

impl Desired {
    /// Records a put of `key` at `mod_revision`. Returns the problem when the value was
    /// skipped (the key's last valid service, and its mod revision, stay in force).
    pub(crate) fn put_at(&mut self, layout: &Layout, key: &[u8], value: &[u8], mod_revision: i64) -> Option<String> {
        let problem = self.put(layout, key, value);
        if problem.is_none() {
            if let Ok(id) = key_id(layout, key) {
                self.mod_revisions.insert(id, mod_revision);
            }
        }
        problem
    }

    /// Records a put of `key`. Returns the problem when the value was skipped.
    pub(crate) fn put(&mut self, layout: &Layout, key: &[u8], value: &[u8]) -> Option<String> {
        let shown = String::from_utf8_lossy(key).into_owned();
        // An invalid value leaves the key's last valid service in force, as an invalid file
        // leaves the previous config in force on SIGHUP: a typo never stops a proxy.
        match parse_entry(layout, key, value) {
            Ok(service) => {
                self.invalid.remove(&shown);
                self.services.insert(service.id.clone(), service);
                None
            }
            Err(err) => {
                let problem = crate::error::error_chain(&err);
                self.invalid.insert(shown, problem.clone());
                Some(problem)
            }
        }
    }

    /// A fresh read (`next`) that keeps, for each key that is invalid now, the last valid
    /// service of `self`.
    pub(crate) fn carry_over(&self, layout: &Layout, mut next: Desired) -> Desired {
        for key in next.invalid.keys() {
            if let Ok(id) = key_id(layout, key.as_bytes()) {
                if let Some(service) = self.services.get(&id) {
                    if let Some(mod_revision) = self.mod_revisions.get(&id) {
                        next.mod_revisions.entry(id.clone()).or_insert(*mod_revision);
                    }
                    next.services.entry(id).or_insert_with(|| service.clone());
                }
            }
        }
        next
    }

    /// Records a delete of `key`.
    pub(crate) fn delete(&mut self, layout: &Layout, key: &[u8]) {
        self.invalid.remove(String::from_utf8_lossy(key).as_ref());
        if let Ok(id) = key_id(layout, key) {
            self.services.remove(&id);
            self.mod_revisions.remove(&id);
        }
    }
}

/// What `tether agent --etcd ... --node ...` follows.
#[derive(Debug, Clone)]
pub(crate) struct FleetOptions {
    pub(crate) layout: Layout,
    pub(crate) etcd: EtcdOptions,
    /// The TTL of the status lease (`--fleet-ttl`).
    pub(crate) ttl: Duration,
}

impl FleetOptions {
    /// The fleet options of `tether agent`, if it follows etcd.
    ///
    /// # Errors
    ///
    /// A [`crate::error::UsageError`] for an invalid node or prefix, unreadable TLS files, or a
    /// password without a user: the agent does not start on options it cannot use.
    pub(crate) fn of_agent(args: &crate::cli::AgentArgs) -> anyhow::Result<Option<Self>> {
        let Some(node) = &args.node else { return Ok(None) };
        let usage = |message: String| anyhow::Error::from(crate::error::UsageError(message));
        let layout = Layout::new(&args.etcd_options.etcd_prefix, node).map_err(|err| usage(err.to_string()))?;
        let etcd = EtcdOptions::from_args(args.etcd.clone(), &args.etcd_options);
        etcd.connect_options().map_err(|err| usage(crate::error::error_chain(&err)))?;
        let ttl = args.fleet_ttl;
        if ttl.as_secs() == 0 || ttl.subsec_nanos() != 0 {
            let shown = humantime::format_duration(ttl);
            return Err(usage(format!("--fleet-ttl {shown}: a lease lives whole seconds, at least one")));
        }
        Ok(Some(Self { layout, etcd, ttl }))
    }
}

/// How to reach etcd: endpoints, TLS and auth, in the shape of etcd's own clients.
#[derive(Debug, Clone)]
pub(crate) struct EtcdOptions {
    pub(crate) endpoints: Vec<String>,
    pub(crate) cacert: Option<PathBuf>,
    pub(crate) cert: Option<PathBuf>,
    pub(crate) key: Option<PathBuf>,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
}

/// How long one connection attempt or one request may take.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Why etcd could not be reached or asked.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EtcdError {
    #[error("cannot read {what} {}", config::DisplayPath(.path))]
    ReadFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--etcd-cert and --etcd-key go together")]
    HalfIdentity,
    #[error("--etcd-password needs --etcd-user")]
    PasswordWithoutUser,
    #[error("etcd at {endpoints}: {operation} failed")]
    Request {
        endpoints: String,
        operation: &'static str,
        #[source]
        source: etcd::Error,
    },
    #[error("etcd at {endpoints}: {operation} timed out after {}s", REQUEST_TIMEOUT.as_secs())]
    Timeout { endpoints: String, operation: &'static str },
}

impl EtcdError {
    /// Whether the options themselves are wrong (a usage error), not the connection.
    pub(crate) fn is_usage(&self) -> bool {
        matches!(self, Self::ReadFile { .. } | Self::HalfIdentity | Self::PasswordWithoutUser)
    }
}

impl EtcdOptions {
    /// The options of the command line.
    pub(crate) fn from_args(endpoints: Vec<String>, args: &crate::cli::EtcdArgs) -> Self {
        Self {
            endpoints,
            cacert: args.etcd_cacert.clone(),
            cert: args.etcd_cert.clone(),
            key: args.etcd_key.clone(),
            user: args.etcd_user.clone(),
            password: args.etcd_password.clone(),
        }
    }

    /// The endpoints, for messages.
    pub(crate) fn shown(&self) -> String {
        self.endpoints.join(",")
    }

    /// The client options; reads the TLS files.
    pub(crate) fn connect_options(&self) -> Result<etcd::ConnectOptions, EtcdError> {
        let read = |what: &'static str, path: &PathBuf| {
            std::fs::read(path).map_err(|source| EtcdError::ReadFile { what, path: path.clone(), source })
        };
        let mut tls = None;
        if self.cacert.is_some() || self.cert.is_some() || self.key.is_some() {
            let ca = match &self.cacert {
                Some(path) => Some(read("the etcd CA certificate", path)?),
                None => None,
            };
            let identity = match (&self.cert, &self.key) {
                (Some(cert), Some(key)) => {
                    Some((read("the etcd client certificate", cert)?, read("the etcd client key", key)?))
                }
                (None, None) => None,
                _ => return Err(EtcdError::HalfIdentity),
            };
            tls = Some(etcd::Tls { ca, identity });
        }
        let user = match (&self.user, &self.password) {
            (Some(user), password) => {
                // etcdctl's shape: `--user NAME:PASSWORD`, or a separate password.
                let (name, inline) = match user.split_once(':') {
                    Some((name, inline)) => (name.to_owned(), Some(inline.to_owned())),
                    None => (user.clone(), None),
                };
                Some((name, password.clone().or(inline).unwrap_or_default()))
            }
            (None, Some(_)) => return Err(EtcdError::PasswordWithoutUser),
            (None, None) => None,
        };
        Ok(etcd::ConnectOptions {
            connect_timeout: REQUEST_TIMEOUT,
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            tls,
            user,
        })
    }

    /// Connects (and authenticates, with a user), within [`REQUEST_TIMEOUT`].
    pub(crate) async fn connect(&self) -> Result<etcd::Client, EtcdError> {
        let options = self.connect_options()?;
        timed(self, "connect", etcd::Client::connect(&self.endpoints, &options)).await
    }
}

/// Runs one etcd request within [`REQUEST_TIMEOUT`], naming `operation` in its error.
///
/// # Cancel safety
///
/// Cancel-safe: dropping it drops the request.
pub(crate) async fn timed<T>(
    options: &EtcdOptions,
    operation: &'static str,
    request: impl Future<Output = Result<T, etcd::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(EtcdError::Request { endpoints: options.shown(), operation, source }),
        Err(_elapsed) => Err(EtcdError::Timeout { endpoints: options.shown(), operation }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout::new("/tether/", "n1").unwrap()
    }

    #[test]
    fn keys_follow_the_layout() {
        let layout = layout();
        assert_eq!(layout.services_prefix(), "/tether/nodes/n1/services/");
        assert_eq!(layout.key(&ServiceId::new("web").unwrap()), "/tether/nodes/n1/services/web");
        assert!(Layout::new("tether", "n1").is_err());
        assert!(Layout::new("/t", "a/b").is_err());
        assert!(Layout::new("/t", "").is_err());
    }

    #[test]
    fn a_value_is_one_service_whose_id_matches_the_key() {
        let layout = layout();
        let service = parse_entry(&layout, b"/tether/nodes/n1/services/web", br#"{"name": "web"}"#).unwrap();
        assert_eq!(service.id.as_str(), "web");
        let err = parse_entry(&layout, b"/tether/nodes/n1/services/api", br#"{"name": "web"}"#).unwrap_err();
        assert!(matches!(err, ValueError::IdMismatch { .. }), "{err}");
        let err = parse_entry(&layout, b"/tether/nodes/n1/services/a/b", br#"{"name": "web"}"#).unwrap_err();
        assert!(matches!(err, ValueError::KeyId(_)), "{err}");
    }

    #[test]
    fn an_invalid_value_names_the_key_and_the_field() {
        let layout = layout();
        let err = parse_entry(&layout, b"/tether/nodes/n1/services/web", br#"{"name": "web", "prot": 1}"#).unwrap_err();
        let text = crate::error::error_chain(&err);
        assert!(text.contains("/tether/nodes/n1/services/web:1:"), "{text}");
        assert!(text.contains("prot"), "{text}");
    }

    #[test]
    fn a_put_of_an_invalid_value_keeps_the_last_valid_service_and_reports_the_key() {
        let layout = layout();
        let mut desired = Desired::default();
        let key = b"/tether/nodes/n1/services/web";
        assert_eq!(desired.put(&layout, key, br#"{"name": "web"}"#), None);
        assert!(desired.put(&layout, key, b"{").is_some());
        assert_eq!(desired.services.len(), 1);
        assert_eq!(desired.invalid.len(), 1);
        let mut reread = Desired::default();
        reread.put(&layout, key, b"{");
        assert_eq!(desired.carry_over(&layout, reread).services.len(), 1);
        desired.delete(&layout, key);
        assert!(desired.invalid.is_empty() && desired.services.is_empty());
    }
}
