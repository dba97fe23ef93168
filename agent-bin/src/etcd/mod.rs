//! etcd, as every part of the agent speaks to it: the client (`client`), where things live
//! (`Layout`), how to reach it (`EtcdOptions`, with `REQUEST_TIMEOUT` for every request), the
//! one reconnect schedule of everything that follows or writes etcd (`RECONNECT`, spread by
//! `jittered`), the one way of following a prefix (`read_and_watch`, and `follow_prefix` with its own
//! connection and reconnects), and the records that are written there (`records`), which the writer and
//! every reader share.
//!
//! This is a leaf of the binary: it imports no other module of it but `cli` (the flags of
//! its options, the rollout's `OnFailure`), so that the follower, the publisher, the
//! templates, the API and the `tether fleet` commands can all use it without a circle. It
//! knows nothing of what the services in it mean for the catalog; `fleet` does.

pub(crate) mod client;
pub(crate) mod records;

use std::path::PathBuf;
use std::time::Duration;

use tether_state::config;
use tether_state::{Backoff, ServiceId};
use tokio_util::sync::CancellationToken;

pub(crate) use client::{Client, Error, WatchStream, delete_op, mod_revision_is, pb, put_op, revision};
pub(crate) use records::{Instance, IntentionRecord, NodeRecord, PublishedProxy, RolloutRecord, rfc3339};

/// The delays between two sessions with etcd, for the follower, the publisher and the
/// templates' watches alike: 250 ms, doubled after each failure up to 10 s, each spread by
/// [`jittered`].
pub(crate) const RECONNECT: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));

/// How far each reconnect delay is spread, in thousandths of itself either way: ± 20%.
const JITTER_PER_MILLE: u32 = 200;

/// `delay` ± 20%, so that a fleet of agents does not reconnect in lockstep; the clock's
/// nanoseconds are random enough for that.
pub(crate) fn jittered(delay: Duration) -> Duration {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    Backoff::jitter(delay, JITTER_PER_MILLE, u64::from(nanos))
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

    /// The prefix of the fleet's intentions, `<prefix>/intentions/`, under which each key is
    /// `<source>/<destination>`.
    pub(crate) fn intentions_prefix(&self) -> String {
        format!("{}/intentions/", self.prefix)
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
        source: Error,
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
    pub(crate) fn connect_options(&self) -> Result<client::ConnectOptions, EtcdError> {
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
            tls = Some(client::Tls { ca, identity });
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
        Ok(client::ConnectOptions {
            connect_timeout: REQUEST_TIMEOUT,
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            tls,
            user,
        })
    }

    /// Connects (and authenticates, with a user), within [`REQUEST_TIMEOUT`].
    pub(crate) async fn connect(&self) -> Result<Client, EtcdError> {
        let options = self.connect_options()?;
        timed(self, "connect", Client::connect(&self.endpoints, &options)).await
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
    request: impl Future<Output = Result<T, Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(EtcdError::Request { endpoints: options.shown(), operation, source }),
        Err(_elapsed) => Err(EtcdError::Timeout { endpoints: options.shown(), operation }),
    }
}

/// Reads every key under `prefix` and hands them to `apply`, then reads them all again on
/// every change, until `stop`; a failure is logged (naming `what`) and followed by a new
/// connection on [`RECONNECT`]'s backoff, and what was applied stays in force meanwhile.
///
/// # Cancel safety
///
/// Meant to run as a task of its own; it returns once `stop` is cancelled.
pub(crate) async fn follow_prefix(
    options: &EtcdOptions,
    prefix: &str,
    what: &str,
    stop: &CancellationToken,
    mut apply: impl FnMut(&[pb::KeyValue]),
) {
    let mut backoff = RECONNECT;
    loop {
        let mut answered = false;
        let session = async {
            let client = options.connect().await.map_err(|err| tether_state::error_chain(&err))?;
            read_and_watch(&client, prefix, |kvs| {
                answered = true;
                apply(kvs);
            })
            .await
        };
        let error = tokio::select! {
            () = stop.cancelled() => return,
            Err(error) = session => error,
        };
        if answered {
            backoff.reset();
        }
        let wait = jittered(backoff.next());
        tracing::warn!(%prefix, what, error = %error, retry_in = ?wait, "cannot follow etcd");
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Reads `prefix` through `client` and hands the keys to `apply`, then reads them again on
/// every change, until an error.
///
/// # Cancel safety
///
/// Cancel-safe: dropping it drops the watch.
pub(crate) async fn read_and_watch(
    client: &Client,
    prefix: &str,
    mut apply: impl FnMut(&[pb::KeyValue]),
) -> Result<std::convert::Infallible, String> {
    let error = |err: &dyn std::error::Error| tether_state::error_chain(err);
    let range = client.get_prefix(prefix).await.map_err(|err| error(&err))?;
    let revision = revision(range.header.as_ref());
    apply(&range.kvs);
    let mut stream = client.watch_prefix(prefix, revision + 1).await.map_err(|err| error(&err))?;
    loop {
        match stream.message().await.map_err(|err| error(&err))? {
            // Read whole again: one small prefix, and no event order to get right.
            Some(_) => {
                let range = client.get_prefix(prefix).await.map_err(|err| error(&err))?;
                apply(&range.kvs);
            }
            None => return Err("etcd ended the watch".to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_layout() {
        let layout = Layout::new("/tether/", "n1").unwrap();
        assert_eq!(layout.services_prefix(), "/tether/nodes/n1/services/");
        assert_eq!(layout.key(&ServiceId::new("web").unwrap()), "/tether/nodes/n1/services/web");
        assert!(Layout::new("tether", "n1").is_err());
        assert!(Layout::new("/t", "a/b").is_err());
        assert!(Layout::new("/t", "").is_err());
    }
}
