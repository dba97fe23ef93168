//! A small HTTP/1.1 client for the control socket, used by the CLI commands and the
//! built-in proxy (which may reach the agent at its `--http-addr` instead).
//!
//! One request per connection; no retries. It knows the wire format only as JSON values.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tether_state::config::DisplayPath;
use tokio::net::{TcpStream, UnixStream};

/// How long a CLI command waits for the agent.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Why a request did not get an answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    #[error("cannot reach the agent at {}: is `tether agent` running with this --data-dir?", DisplayPath(.socket))]
    Connect {
        socket: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open the agent's socket {}: it is the agent's user's alone (or root's)", DisplayPath(.socket))]
    Closed {
        socket: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot reach the agent at http://{address}")]
    ConnectHttp {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the agent did not answer within {}", humantime::format_duration(TIMEOUT))]
    Timeout,
    #[error("the request to the agent failed")]
    Http(#[source] hyper::Error),
    #[error("cannot build the request")]
    Request(#[source] hyper::http::Error),
}

/// Where the agent answers: its socket, or its `--http-addr`, which serves the read
/// endpoints only.
#[derive(Debug, Clone)]
pub(crate) enum AgentAt {
    Socket(PathBuf),
    Http(SocketAddr),
}

/// An answer from the agent.
pub(crate) struct Response {
    pub(crate) status: StatusCode,
    pub(crate) body: Bytes,
}

impl Response {
    /// The `error` field of a JSON error body, or the body itself.
    pub(crate) fn error_message(&self) -> String {
        serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&self.body).trim().to_owned())
    }
}

/// Sends one request to the agent's socket.
pub(crate) async fn request(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<Response, ClientError> {
    tokio::time::timeout(TIMEOUT, send(&AgentAt::Socket(socket.to_owned()), method, path, body, &[]))
        .await
        .map_err(|_| ClientError::Timeout)?
}

/// Sends one GET with extra headers to the agent `at`, waiting up to `timeout` for the
/// answer.
pub(crate) async fn request_with(
    at: &AgentAt,
    path: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<Response, ClientError> {
    tokio::time::timeout(timeout, send(at, Method::GET, path, None, headers)).await.map_err(|_| ClientError::Timeout)?
}

/// Sends one PUT with a JSON body and extra headers to the agent's socket.
pub(crate) async fn put_with(
    socket: &Path,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Response, ClientError> {
    tokio::time::timeout(TIMEOUT, send(&AgentAt::Socket(socket.to_owned()), Method::PUT, path, Some(body), headers))
        .await
        .map_err(|_| ClientError::Timeout)?
}

/// An HTTP/1.1 connection to the agent: what sends requests, and the task that runs it.
type Connection = (hyper::client::conn::http1::SendRequest<Full<Bytes>>, tokio::task::JoinHandle<hyper::Result<()>>);

/// Connects to the agent and runs the HTTP/1.1 connection in a task of its own.
async fn connect(at: &AgentAt) -> Result<Connection, ClientError> {
    match at {
        AgentAt::Socket(socket) => {
            let stream = UnixStream::connect(socket).await.map_err(|source| {
                let socket = socket.to_owned();
                match source.kind() {
                    std::io::ErrorKind::PermissionDenied => ClientError::Closed { socket, source },
                    _ => ClientError::Connect { socket, source },
                }
            })?;
            handshake(stream).await
        }
        &AgentAt::Http(address) => {
            let stream =
                TcpStream::connect(address).await.map_err(|source| ClientError::ConnectHttp { address, source })?;
            handshake(stream).await
        }
    }
}

async fn handshake<S>(stream: S) -> Result<Connection, ClientError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(ClientError::Http)?;
    Ok((sender, tokio::spawn(connection)))
}

/// The `Host` of a request: over TCP, the loopback address the agent checks for.
fn host(at: &AgentAt) -> String {
    match at {
        AgentAt::Socket(_) => "tether".to_owned(),
        AgentAt::Http(address) => address.to_string(),
    }
}

/// Sends a GET and hands each chunk of a successful answer's body to `chunk` as it
/// arrives, with no time limit once the answer has begun (a followed log streams until
/// interrupted). An unsuccessful answer is returned whole, as [`request`] does.
pub(crate) async fn stream(
    socket: &Path,
    path: &str,
    mut chunk: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<Response, ClientError> {
    let begun = async {
        let (mut sender, connection) = connect(&AgentAt::Socket(socket.to_owned())).await?;
        let request = Request::builder()
            .method(Method::GET)
            .uri(path)
            .header(hyper::header::HOST, "tether")
            .body(Full::new(Bytes::new()))
            .map_err(ClientError::Request)?;
        let response = sender.send_request(request).await.map_err(ClientError::Http)?;
        Ok::<_, ClientError>((response, sender, connection))
    };
    let (response, sender, connection) =
        tokio::time::timeout(TIMEOUT, begun).await.map_err(|_| ClientError::Timeout)??;
    let status = response.status();
    let mut body = response.into_body();
    if status != StatusCode::OK {
        let body = body.collect().await.map_err(ClientError::Http)?.to_bytes();
        return Ok(Response { status, body });
    }
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ClientError::Http)?;
        if let Some(data) = frame.data_ref() {
            if chunk(data).is_err() {
                break; // the reader went away (a closed pipe): stop quietly
            }
        }
    }
    drop(sender);
    connection.abort();
    Ok(Response { status, body: Bytes::new() })
}

async fn send(
    at: &AgentAt,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
    headers: &[(&str, &str)],
) -> Result<Response, ClientError> {
    // The connection task ends with the request; it is awaited below through the response.
    let (mut sender, connection) = connect(at).await?;
    let mut request = Request::builder().method(method);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .uri(path)
        .header(hyper::header::HOST, host(at))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(ClientError::Request)?;
    let response = sender.send_request(request).await.map_err(ClientError::Http)?;
    let status = response.status();
    let body = response.into_body().collect().await.map_err(ClientError::Http)?.to_bytes();
    drop(sender);
    let _ = connection.await;
    Ok(Response { status, body })
}
