//! A client of etcd's v3 API: ranges, puts, deletes, transactions, leases and watches over
//! gRPC, with TLS, user authentication and HTTP/2 keep-alive pings.
//!
//! The transport is tonic's; the messages and stubs are generated at build time from
//! `proto/etcd.proto`, the part of etcd's API that tether speaks. This module owns the
//! connection: endpoints, TLS, the auth token (sent with every request, and renewed once
//! when etcd says it expired), and the request stream that keeps a watch open. It knows
//! nothing of the fleet's keys; `Layout` (in `etcd/mod.rs`) does.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Request, Status};

/// etcd's messages and gRPC stubs, generated from `proto/etcd.proto` by `build.rs`.
#[allow(dead_code, unreachable_pub, missing_docs, clippy::all, clippy::pedantic)]
pub(crate) mod pb {
    tonic::include_proto!("etcdserverpb");
}

use pb::auth_client::AuthClient;
use pb::kv_client::KvClient;
use pb::lease_client::LeaseClient;
use pb::watch_client::WatchClient;

/// How to connect: timeouts, keep-alive pings, TLS and a user.
#[derive(Debug, Clone)]
pub(crate) struct ConnectOptions {
    /// How long establishing one connection may take.
    pub(crate) connect_timeout: Duration,
    /// How often an HTTP/2 ping goes out on a connection, busy or idle.
    pub(crate) keep_alive_interval: Duration,
    /// How long a ping's answer may take before the connection counts as dead: a silent
    /// network partition shows as a failed stream, not as a watch that never fires again.
    pub(crate) keep_alive_timeout: Duration,
    /// TLS, if any: also for endpoints written without `https://`.
    pub(crate) tls: Option<Tls>,
    /// A user to authenticate as: name and password.
    pub(crate) user: Option<(String, String)>,
}

/// TLS material, in PEM.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tls {
    /// The CA bundle that etcd's certificate must chain to; the system's roots without it.
    pub(crate) ca: Option<Vec<u8>>,
    /// A client certificate and its private key.
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// Why a connection or a request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("no etcd endpoint was given")]
    NoEndpoint,
    #[error("invalid endpoint `{endpoint}`")]
    Endpoint {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot connect")]
    Connect(#[source] tonic::transport::Error),
    #[error("authentication as `{user}` failed")]
    Authenticate {
        user: String,
        #[source]
        source: Rejected,
    },
    #[error("etcd's auth token is not valid metadata")]
    Token,
    #[error(transparent)]
    Rejected(#[from] Rejected),
}

/// A request that etcd, or the way to it, did not carry out: its gRPC status.
#[derive(Debug)]
pub(crate) struct Rejected(Status);

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // tonic's own Display adds empty details and metadata: the code and message say it.
        match self.0.message() {
            "" => write!(f, "{}", self.0.code()),
            message => write!(f, "{}: {}", self.0.code(), message.escape_debug()),
        }
    }
}

impl std::error::Error for Rejected {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.0)
    }
}

/// The auth token sent with every request, once a user has authenticated.
#[derive(Debug, Clone, Default)]
struct Token(Arc<RwLock<Option<MetadataValue<Ascii>>>>);

impl Token {
    fn set(&self, token: MetadataValue<Ascii>) {
        *self.0.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(token);
    }
}

impl Interceptor for Token {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let token = self.0.read().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        if let Some(token) = token {
            request.metadata_mut().insert("token", token);
        }
        Ok(request)
    }
}

type Authorized = InterceptedService<Channel, Token>;

/// A connection to an etcd cluster. Cloning it is cheap and shares the connection.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    members: Arc<Members>,
    token: Token,
    user: Option<(String, String)>,
}

/// One channel per endpoint, and the one that requests go to: the next one once it fails,
/// as etcd's own clients move on from a member that went away.
#[derive(Debug)]
struct Members {
    channels: Vec<Channel>,
    current: AtomicUsize,
}

impl Members {
    /// The channel that requests go to now, and its index.
    fn current(&self) -> (usize, Channel) {
        let index = self.current.load(Ordering::Relaxed) % self.channels.len().max(1);
        (index, self.channels[index].clone())
    }

    /// Moves on from the member at `index`, unless another request already did.
    fn failed(&self, index: usize) {
        let next = (index + 1) % self.channels.len().max(1);
        let _ = self.current.compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The member that a new client sends to first, at random: so that a fleet's watches and
/// lease keep-alives spread over the members instead of all landing on the first one listed.
fn first_member(count: usize) -> usize {
    let mut bytes = [0; 8];
    // Without the OS's randomness, the clock's nanoseconds spread a fleet well enough.
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        bytes = u64::from(nanos.subsec_nanos()).to_le_bytes();
    }
    usize::try_from(u64::from_le_bytes(bytes) % u64::try_from(count.max(1)).unwrap_or(1)).unwrap_or(0)
}

/// Whether a request may be sent again through another member after it failed with
/// `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// It changes nothing, or changes the same thing twice harmlessly: on any failure of
    /// the member (unavailable, no leader).
    Safe,
    /// Only when it surely never reached etcd (no connection to the member) or etcd
    /// refused it before applying it (no leader).
    Unsent,
}

/// Whether `status` says the member could not be used: its connection failed or it has no
/// leader. Another member may serve.
fn member_failed(status: &Status) -> bool {
    status.code() == Code::Unavailable
}

/// Whether `status` says the request never reached etcd's state machine: the connection
/// to the member could not be made, or the member had no leader to give it to.
fn unsent(status: &Status) -> bool {
    if status.code() != Code::Unavailable {
        return false;
    }
    if status.message().contains("no leader") || status.message().contains("tcp connect error") {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && matches!(io.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound)
        {
            return true;
        }
        source = error.source();
    }
    false
}

impl Client {
    /// Connects to `endpoints` (one, or several to balance over) and authenticates.
    ///
    /// An endpoint is a URL (`http://HOST:PORT`, `https://HOST:PORT`), or `HOST:PORT`, which
    /// means `https` with TLS options and `http` without.
    ///
    /// # Errors
    ///
    /// [`Error::Endpoint`] for an endpoint that is no URL or TLS material that cannot be used,
    /// [`Error::Connect`] when a single endpoint cannot be reached, [`Error::Authenticate`]
    /// when the user is refused.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping it drops the connection.
    pub(crate) async fn connect(endpoints: &[String], options: &ConnectOptions) -> Result<Self, Error> {
        let mut channels = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            let endpoint = endpoint_of(endpoint, options)?;
            // One member: its connection is made now, so that a wrong address shows at once.
            // Several: on demand, each the first time requests go to it.
            channels.push(if endpoints.len() == 1 {
                endpoint.connect().await.map_err(Error::Connect)?
            } else {
                endpoint.connect_lazy()
            });
        }
        if channels.is_empty() {
            return Err(Error::NoEndpoint);
        }
        let first = first_member(channels.len());
        let members = Arc::new(Members { channels, current: AtomicUsize::new(first) });
        let client = Self { members, token: Token::default(), user: options.user.clone() };
        client.authenticate().await?;
        Ok(client)
    }

    /// Asks etcd for a token for the user, if there is one, and sends it from now on.
    async fn authenticate(&self) -> Result<(), Error> {
        let Some((name, password)) = &self.user else { return Ok(()) };
        let request = pb::AuthenticateRequest { name: name.clone(), password: password.clone() };
        let response = AuthClient::new(self.members.current().1)
            .authenticate(request)
            .await
            .map_err(|status| Error::Authenticate { user: name.clone(), source: Rejected(status) })?;
        let token = response.into_inner().token.parse().map_err(|_| Error::Token)?;
        self.token.set(token);
        Ok(())
    }

    fn kv(&self) -> KvClient<Authorized> {
        KvClient::with_interceptor(self.members.current().1, self.token.clone())
    }

    /// Sends `request` through `call` on a KV stub of its own, with the token, once more
    /// after a new authentication if etcd says the token expired ([`Self::with_token`]).
    async fn kv_call<Q: Clone, T, F>(
        &self,
        retry: Retry,
        request: Q,
        call: impl Fn(KvClient<Authorized>, Q) -> F,
    ) -> Result<T, Error>
    where
        F: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.with_token(retry, || call(self.kv(), request.clone())).await
    }

    /// One range request: the reads below differ only in what they ask.
    async fn range(&self, request: pb::RangeRequest) -> Result<pb::RangeResponse, Error> {
        self.kv_call(Retry::Safe, request, |mut kv, request| async move { kv.range(request).await }).await
    }

    /// Runs `call`, and once more after a new authentication if etcd says that the token
    /// expired (etcd's simple tokens expire after five idle minutes). A member that fails is
    /// left for the next, and `call` runs again through it as `retry` allows, once per
    /// member at most.
    async fn with_token<T, F>(&self, retry: Retry, mut call: impl FnMut() -> F) -> Result<T, Error>
    where
        F: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut tries = self.members.channels.len();
        loop {
            let (member, _) = self.members.current();
            let result = match call().await {
                Err(status) if status.code() == Code::Unauthenticated && self.user.is_some() => {
                    self.authenticate().await?;
                    call().await
                }
                result => result,
            };
            match result {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) if member_failed(&status) => {
                    self.members.failed(member);
                    tries -= 1;
                    let again = retry == Retry::Safe || unsent(&status);
                    if tries == 0 || !again {
                        return Err(Rejected(status).into());
                    }
                }
                Err(status) => return Err(Rejected(status).into()),
            }
        }
    }

    /// Every key under `prefix`, with values, read at one revision.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a read changes nothing.
    pub(crate) async fn get_prefix(&self, prefix: &str) -> Result<pb::RangeResponse, Error> {
        let request = pb::RangeRequest {
            key: prefix.as_bytes().to_vec(),
            range_end: prefix_end(prefix.as_bytes()),
            ..Default::default()
        };
        self.range(request).await
    }

    /// The key `key`, if it exists, with its value.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a read changes nothing.
    pub(crate) async fn get(&self, key: &str) -> Result<pb::RangeResponse, Error> {
        let request = pb::RangeRequest { key: key.as_bytes().to_vec(), ..Default::default() };
        self.range(request).await
    }

    /// The number of keys under `prefix`, and the store's revision in the header.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a read changes nothing.
    pub(crate) async fn count_prefix(&self, prefix: &str) -> Result<pb::RangeResponse, Error> {
        let request = pb::RangeRequest {
            key: prefix.as_bytes().to_vec(),
            range_end: prefix_end(prefix.as_bytes()),
            count_only: true,
            ..Default::default()
        };
        self.range(request).await
    }

    /// Writes `value` at `key`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: a put dropped after it was sent may still be applied.
    pub(crate) async fn put(&self, key: &str, value: Vec<u8>) -> Result<pb::PutResponse, Error> {
        let request = pb::PutRequest { key: key.as_bytes().to_vec(), value, ..Default::default() };
        self.kv_call(Retry::Unsent, request, |mut kv, request| async move { kv.put(request).await }).await
    }

    /// Deletes `key`; the response counts what was deleted.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: a delete dropped after it was sent may still be applied.
    pub(crate) async fn delete(&self, key: &str) -> Result<pb::DeleteRangeResponse, Error> {
        let request = pb::DeleteRangeRequest { key: key.as_bytes().to_vec(), ..Default::default() };
        self.kv_call(Retry::Unsent, request, |mut kv, request| async move { kv.delete_range(request).await }).await
    }

    /// Runs a transaction: `success` if every comparison holds, `failure` otherwise.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: a transaction dropped after it was sent may still be applied.
    pub(crate) async fn txn(&self, request: pb::TxnRequest) -> Result<pb::TxnResponse, Error> {
        self.kv_call(Retry::Unsent, request, |mut kv, request| async move { kv.txn(request).await }).await
    }

    fn lease(&self) -> LeaseClient<Authorized> {
        LeaseClient::with_interceptor(self.members.current().1, self.token.clone())
    }

    /// Grants a lease of `ttl` seconds; its id is in the response.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: a lease granted after the call was dropped lives out its TTL unused.
    pub(crate) async fn lease_grant(&self, ttl: i64) -> Result<pb::LeaseGrantResponse, Error> {
        let request = pb::LeaseGrantRequest { ttl, id: 0 };
        self.with_token(Retry::Safe, || {
            let mut lease = self.lease();
            async move { lease.lease_grant(request).await }
        })
        .await
    }

    /// Revokes lease `id`: every key under it is deleted.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: a revoke dropped after it was sent may still be applied.
    pub(crate) async fn lease_revoke(&self, id: i64) -> Result<pb::LeaseRevokeResponse, Error> {
        let request = pb::LeaseRevokeRequest { id };
        self.with_token(Retry::Unsent, || {
            let mut lease = self.lease();
            async move { lease.lease_revoke(request).await }
        })
        .await
    }

    /// Opens a keep-alive stream for lease `id`; [`KeepAlive::renew`] renews it once.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping it drops the stream (the lease lives out its TTL).
    pub(crate) async fn lease_keep_alive(&self, id: i64) -> Result<KeepAlive, Error> {
        let mut requests = None;
        let responses = self
            .with_token(Retry::Safe, || {
                let (sender, receiver) = mpsc::channel(1);
                // etcd answers the stream's headers only once a request arrived: the first
                // renewal goes with the opening, and its answer is the first `renew`'s.
                let _ = sender.try_send(pb::LeaseKeepAliveRequest { id });
                requests = Some(sender);
                let mut lease = self.lease();
                async move { lease.lease_keep_alive(require_leader(ReceiverStream::new(receiver))).await }
            })
            .await?;
        let Some(requests) = requests else { unreachable!("with_token calls its request at least once") };
        Ok(KeepAlive { id, requests, responses, sent: true })
    }

    /// Watches every key under `prefix` from `start_revision` on.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping it drops the watch.
    pub(crate) async fn watch_prefix(&self, prefix: &str, start_revision: i64) -> Result<WatchStream, Error> {
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(pb::WatchCreateRequest {
                key: prefix.as_bytes().to_vec(),
                range_end: prefix_end(prefix.as_bytes()),
                start_revision,
                ..Default::default()
            })),
        };
        // Each try (a retry after a new authentication included) opens the stream with its
        // own request channel, the create request first; the last one's sender is kept.
        let mut requests = None;
        let responses = self
            .with_token(Retry::Safe, || {
                let (sender, receiver) = mpsc::channel(1);
                // The channel has room for the one request, and its receiver is alive.
                let _ = sender.try_send(create.clone());
                requests = Some(sender);
                let mut watch = WatchClient::with_interceptor(self.members.current().1, self.token.clone());
                async move { watch.watch(require_leader(ReceiverStream::new(receiver))).await }
            })
            .await?;
        let Some(requests) = requests else { unreachable!("with_token calls its request at least once") };
        Ok(WatchStream { _requests: requests, responses })
    }
}

/// A stream request that etcd ends, rather than leaves open and silent, while the member
/// that serves it has no leader (etcd's `hasleader` metadata, as its own clients'
/// `WithRequireLeader`): a member cut off from its quorum fails the watch and the lease's
/// keep-alive, so that the agent says the store is unreachable and tries another member.
fn require_leader<T>(stream: T) -> Request<T> {
    let mut request = Request::new(stream);
    request.metadata_mut().insert("hasleader", MetadataValue::from_static("true"));
    request
}

/// The responses of one watch, in revision order.
pub(crate) struct WatchStream {
    /// Held so that the request stream stays open: etcd ends a watch whose client stream ends.
    _requests: mpsc::Sender<pb::WatchRequest>,
    responses: tonic::Streaming<pb::WatchResponse>,
}

impl WatchStream {
    /// The next response; `None` when etcd ended the stream.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a response is taken from the stream only when this returns it.
    pub(crate) async fn message(&mut self) -> Result<Option<pb::WatchResponse>, Error> {
        Ok(self.responses.message().await.map_err(Rejected)?)
    }
}

/// The keep-alive stream of one lease.
pub(crate) struct KeepAlive {
    id: i64,
    requests: mpsc::Sender<pb::LeaseKeepAliveRequest>,
    responses: tonic::Streaming<pb::LeaseKeepAliveResponse>,
    /// A renewal was sent whose answer is not read yet.
    sent: bool,
}

impl KeepAlive {
    /// Renews the lease once; returns its new time to live in seconds, 0 when the lease is
    /// gone (expired or revoked).
    ///
    /// # Errors
    ///
    /// [`Error::Rejected`] when the stream failed or etcd ended it.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the answer to a renewal dropped midway is read by the next call.
    pub(crate) async fn renew(&mut self) -> Result<i64, Error> {
        let ended = || Rejected(Status::unavailable("the lease keep-alive stream ended"));
        if !self.sent {
            self.requests.send(pb::LeaseKeepAliveRequest { id: self.id }).await.map_err(|_| ended())?;
            self.sent = true;
        }
        let response = self.responses.message().await.map_err(Rejected)?.ok_or_else(ended)?;
        self.sent = false;
        Ok(response.ttl)
    }
}

/// A put of `value` at `key` under lease `lease` (0: none), as one operation of a transaction.
pub(crate) fn put_op(key: &str, value: Vec<u8>, lease: i64) -> pb::RequestOp {
    let put = pb::PutRequest { key: key.as_bytes().to_vec(), value, lease, ..Default::default() };
    pb::RequestOp { request: Some(pb::request_op::Request::RequestPut(put)) }
}

/// A delete of `key`, as one operation of a transaction.
pub(crate) fn delete_op(key: &str) -> pb::RequestOp {
    let delete = pb::DeleteRangeRequest { key: key.as_bytes().to_vec(), ..Default::default() };
    pb::RequestOp { request: Some(pb::request_op::Request::RequestDeleteRange(delete)) }
}

/// A comparison that holds when `key`'s mod revision is `mod_revision` (0: the key does not
/// exist).
pub(crate) fn mod_revision_is(key: &str, mod_revision: i64) -> pb::Compare {
    pb::Compare {
        result: pb::compare::CompareResult::Equal.into(),
        target: pb::compare::CompareTarget::Mod.into(),
        key: key.as_bytes().to_vec(),
        target_union: Some(pb::compare::TargetUnion::ModRevision(mod_revision)),
        range_end: Vec::new(),
    }
}

/// The revision in a response's header (0 without one).
pub(crate) fn revision(header: Option<&pb::ResponseHeader>) -> i64 {
    header.map_or(0, |header| header.revision)
}

/// The end of the key range of every key that starts with `prefix`: the prefix with its
/// last byte that is not 0xff incremented, and what follows it dropped (etcd's own rule);
/// `"\0"`, every key, when there is no such byte.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The tonic endpoint of one etcd endpoint, with the options.
fn endpoint_of(endpoint: &str, options: &ConnectOptions) -> Result<Endpoint, Error> {
    let invalid = |source| Error::Endpoint { endpoint: endpoint.to_owned(), source };
    let url = if endpoint.contains("://") {
        endpoint.to_owned()
    } else if options.tls.is_some() {
        format!("https://{endpoint}")
    } else {
        format!("http://{endpoint}")
    };
    let mut built = Endpoint::from_shared(url.clone())
        .map_err(invalid)?
        .connect_timeout(options.connect_timeout)
        .http2_keep_alive_interval(options.keep_alive_interval)
        .keep_alive_timeout(options.keep_alive_timeout)
        .keep_alive_while_idle(true);
    if url.starts_with("https://") {
        let mut config = ClientTlsConfig::new();
        let tls = options.tls.clone().unwrap_or_default();
        config = match tls.ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(ca)),
            None => config.with_native_roots(),
        };
        if let Some((cert, key)) = tls.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        built = built.tls_config(config).map_err(invalid)?;
    }
    Ok(built)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failed_member_is_left_for_the_next_once() {
        let channel = |port: u16| Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap().connect_lazy();
        let members = Members { channels: vec![channel(1), channel(2), channel(3)], current: AtomicUsize::new(0) };
        members.failed(0);
        assert_eq!(members.current().0, 1);
        // A second request that failed on member 0 does not skip member 1.
        members.failed(0);
        assert_eq!(members.current().0, 1);
        members.failed(1);
        members.failed(2);
        assert_eq!(members.current().0, 0, "round and round");
    }

    #[test]
    fn clients_start_at_members_spread_over_every_one() {
        assert_eq!(first_member(1), 0);
        let mut seen = [0_u32; 3];
        for _ in 0..300 {
            seen[first_member(3)] += 1;
        }
        // 300 draws of 3: each member is chosen; none is even near all of them.
        assert!(seen.iter().all(|count| (1..300).contains(count)), "{seen:?}");
    }

    #[test]
    fn only_a_request_that_never_reached_etcd_counts_as_unsent() {
        assert!(unsent(&Status::unavailable("etcdserver: no leader")));
        assert!(unsent(&Status::unavailable("tcp connect error: Connection refused (os error 111)")));
        assert!(!unsent(&Status::unavailable("transport error: connection reset")), "it may have been applied");
        assert!(!unsent(&Status::internal("etcdserver: no leader")));
        assert!(member_failed(&Status::unavailable("connection reset")));
        assert!(!member_failed(&Status::invalid_argument("bad key")));
    }

    #[test]
    fn a_prefix_range_ends_after_its_last_key() {
        assert_eq!(prefix_end(b"/t/nodes/"), b"/t/nodes0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn an_endpoint_without_a_scheme_is_https_with_tls_options_and_http_without() {
        let mut options = ConnectOptions {
            connect_timeout: Duration::from_secs(1),
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            tls: None,
            user: None,
        };
        assert_eq!(endpoint_of("127.0.0.1:2379", &options).unwrap().uri().scheme_str(), Some("http"));
        options.tls = Some(Tls::default());
        assert_eq!(endpoint_of("127.0.0.1:2379", &options).unwrap().uri().scheme_str(), Some("https"));
        assert_eq!(endpoint_of("http://127.0.0.1:2379", &options).unwrap().uri().scheme_str(), Some("http"));
        let err = endpoint_of("http://bad host", &options).unwrap_err();
        assert!(matches!(err, Error::Endpoint { .. }), "{err}");
    }

    #[test]
    fn a_rejection_shows_its_code_and_message() {
        let rejected = Rejected(Status::unauthenticated("etcdserver: invalid auth token"));
        assert_eq!(rejected.0.code(), Code::Unauthenticated);
        assert!(rejected.to_string().ends_with(": etcdserver: invalid auth token"), "{rejected}");
    }
}
