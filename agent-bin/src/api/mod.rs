//! The control API: HTTP/1.1 + JSON on `agent.sock`, and its read-only subset on
//! `--http-addr`.
//!
//! Handlers translate between the wire (`dto`) and the libraries; they hold no state of
//! their own and never block the runtime. Every error answer, whoever makes it (a handler,
//! an extractor's rejection, the router), is `{"error": "..."}` with its status code: 400,
//! 403, 404, 405, 409, 413 or 500.

pub(crate) mod connect_ca;
pub(crate) mod connect_mesh;
pub(crate) mod dto;
pub(crate) mod events;
pub(crate) mod history;
mod host;
pub(crate) mod logs;
pub(crate) mod proxy_config;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use hyper::body::Frame;
use tether_manager::{ManagerHandle, ProxyStatus};
use tether_state::config::{self, Format, Origin};
use tether_state::{CatalogError, ProxyId, ServiceId};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::catalog::sources::{RegisterError, ReloadError, ReloadReport, Sources};
use crate::metrics::Metrics;
use dto::{ErrorDto, HealthDto, ProxyStatusDto};

/// A response body fed by a channel: each message is one chunk; the body ends when the
/// sender is dropped, and the sender learns that the client went away when it is closed.
pub(crate) struct ChannelBody(pub(crate) mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes))))
    }
}

/// The proxy that the path's `name` means, among those the engine has: 400 for a name that
/// is no id, 404 for one that names no proxy.
fn known_proxy(state: &ApiState, name: &str) -> Result<ProxyId, ApiError> {
    let candidates = crate::catalog::names::proxies_named(name)
        .map_err(|err| ApiError::new(StatusCode::BAD_REQUEST, err.to_string()))?;
    candidates.into_iter().find(|id| state.manager.proxy(id).is_some()).ok_or_else(|| {
        ApiError::new(StatusCode::NOT_FOUND, format!("no proxy {name}, and no service {name} with a proxy"))
    })
}

/// How long a stream may wait for its client to take the next chunk before it is closed:
/// a client that reads nothing must not hold its slot and the agent's memory forever.
pub(crate) const STREAM_STALL: Duration = Duration::from_secs(30);

/// The slots of one listener for the answers that stay open (event streams, log follows,
/// blocking queries). There are fewer of them than the listener's connections, so that the
/// reads that answer at once (health, status, metrics, the page) always find room.
#[derive(Debug, Clone)]
pub(crate) struct StreamSlots {
    slots: Arc<Semaphore>,
    cap: usize,
}

impl StreamSlots {
    /// `cap` slots.
    pub(crate) fn new(cap: usize) -> Self {
        Self { slots: Arc::new(Semaphore::new(cap)), cap }
    }

    /// Takes a slot for one stream; it is free again when the permit is dropped.
    ///
    /// # Errors
    ///
    /// 503 when every slot is taken: the answer closes its connection, so that a refused
    /// client holds no connection either.
    pub(crate) fn take(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.slots.clone().try_acquire_owned().map_err(|_| {
            let message = format!("{} streams are open on this listener, the most it holds; try again later", self.cap);
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
        })
    }
}

/// Sends one chunk of a stream. `false` when the client went away, or took nothing for
/// [`STREAM_STALL`]: the stream is then over.
///
/// # Cancel safety
///
/// Cancel-safe: a chunk is either sent or dropped with the future.
pub(crate) async fn send_chunk(chunks: &mpsc::Sender<Bytes>, chunk: Bytes) -> bool {
    matches!(tokio::time::timeout(STREAM_STALL, chunks.send(chunk)).await, Ok(Ok(())))
}

/// A request to stop every proxy and exit; answered once the proxies are stopped.
pub(crate) type LeaveRequest = oneshot::Sender<Result<(), String>>;

/// What the handlers share.
#[derive(Clone)]
pub(crate) struct ApiState {
    pub(crate) sources: Arc<Sources>,
    pub(crate) manager: ManagerHandle,
    pub(crate) leave: mpsc::Sender<LeaveRequest>,
    pub(crate) metrics: Arc<Metrics>,
    /// Cancelled when the API stops: blocking queries answer at once then.
    pub(crate) shutdown: tokio_util::sync::CancellationToken,
    /// The fleet follower's status, when the agent follows etcd.
    pub(crate) fleet: Option<crate::fleet::follow::SharedStatus>,
    /// The proxies held down by `tether stop`, as kept in the data dir.
    pub(crate) held: Arc<crate::catalog::held::Held>,
    /// The proxies' templates: their errors are shown in the status, their events streamed.
    pub(crate) templates: crate::templates::Templates,
    /// Connect: the leaf certificates, shown in the status and served to their proxies.
    pub(crate) connect: Arc<crate::connect::Connect>,
    /// The xDS server: each proxy's last verdict from its Envoy.
    pub(crate) xds: crate::xds::Xds,
    /// The events of the last hour.
    pub(crate) history: history::History,
    /// Reads every node of the fleet for the page, when the agent follows etcd.
    pub(crate) fleet_reader: Option<Arc<crate::fleet::status::FleetReader>>,
}

/// An API error: a status code and a message for `{"error": ...}`.
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(ErrorDto { error: self.message })).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Busy or shutting down: the connection is not kept for another request.
            response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        }
        response
    }
}

impl From<RegisterError> for ApiError {
    fn from(err: RegisterError) -> Self {
        let status = match &err {
            RegisterError::CommandRefused { .. } => StatusCode::FORBIDDEN,
            RegisterError::Cycle { .. } => StatusCode::BAD_REQUEST,
            RegisterError::Catalog(CatalogError::Conflict { .. } | CatalogError::Duplicate { .. }) => {
                StatusCode::CONFLICT
            }
            RegisterError::Catalog(CatalogError::NotFound { .. }) => StatusCode::NOT_FOUND,
            RegisterError::Catalog(_) | RegisterError::Persist { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, crate::error::error_chain(&err))
    }
}

/// The routes of `agent.sock`: everything, with `streams` slots for answers that stay open.
pub(crate) fn socket_router(state: ApiState, streams: usize) -> Router {
    let routes = read_routes()
        .route("/v1/agent/service/register", put(register))
        .route("/v1/agent/service/deregister/{id}", put(deregister))
        .route("/v1/agent/leave", put(leave))
        .route("/v1/agent/connect/refused/{service}", put(connect_mesh::put_refused))
        .route("/v1/agent/reload", put(reload))
        .route("/v1/agent/proxy/{id}/restart", put(restart))
        .route("/v1/agent/proxy/{id}/reload", put(reload_proxy))
        .route("/v1/agent/proxy/{id}/stop", put(stop))
        .route("/v1/agent/proxy/{id}/start", put(start))
        // On the socket; over HTTP only with `--http-logs`: a proxy's output may hold secrets.
        .route("/v1/agent/proxy/{id}/logs", get(logs::get_logs));
    with_json_errors(routes).layer(axum::Extension(StreamSlots::new(streams))).with_state(state)
}

/// The routes of `--http-addr`: reading only, for requests that name the loopback, with
/// `streams` slots for answers that stay open; the proxies' output only with `logs`
/// (`--http-logs`).
pub(crate) fn http_router(state: ApiState, streams: usize, logs: bool) -> Router {
    let routes = read_routes();
    let routes = if logs { routes.route("/v1/agent/proxy/{id}/logs", get(logs::get_logs)) } else { routes };
    with_json_errors(routes)
        .layer(middleware::from_fn(host::require_loopback))
        .layer(axum::Extension(StreamSlots::new(streams)))
        .with_state(state)
}

/// Adds the answers for an unknown path and a method a path does not take, makes every
/// error answer JSON, and marks every answer `nosniff`. Call it once every route is in:
/// layers reach only the routes before.
fn with_json_errors(routes: Router<ApiState>) -> Router<ApiState> {
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::map_response(json_errors))
        .layer(middleware::map_response(nosniff))
}

/// Tells a browser to take every answer as the type it says: a JSON answer carries text
/// that proxies and probe targets chose (`status_text`, errors), which must never be read
/// as a page.
async fn nosniff(mut response: Response) -> Response {
    response.headers_mut().insert(header::X_CONTENT_TYPE_OPTIONS, header::HeaderValue::from_static("nosniff"));
    response
}

fn read_routes() -> Router<ApiState> {
    Router::new()
        .route("/v1/agent/proxies", get(proxies))
        .route("/v1/agent/proxy/{id}", get(proxy))
        .route("/v1/agent/proxy/{id}/config", get(proxy_config::get_config))
        .route("/v1/agent/connect/ca/roots", get(connect_ca::get_roots))
        .route("/v1/agent/connect/ca/leaf/{service}", get(connect_ca::get_leaf))
        .route("/v1/agent/connect/intentions/{service}", get(connect_mesh::get_intentions))
        .route("/v1/agent/connect/upstream/{service}/{destination}", get(connect_mesh::get_upstream))
        .route("/", get(page))
        .route("/page.js", get(page_script))
        .route("/page.css", get(page_style))
        .route("/v1/agent/events", get(events::get_events))
        .route("/v1/agent/history", get(history::get_history))
        .route("/v1/agent/health", get(health))
        .route("/v1/agent/fleet", get(fleet))
        .route("/v1/agent/fleet/nodes", get(fleet_nodes))
        .route("/metrics", get(metrics))
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

/// The router adds the `Allow` header to this answer.
async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, format!("method {method} is not allowed on {}", uri.path()))
}

/// The most of a non-JSON error body that [`json_errors`] reads; rejections are one line.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Rewrites an error answer that is not JSON into `{"error": ...}`, with the same status
/// and headers: the rejections of axum's extractors (413 for a body over the limit, 400
/// for a bad query string or path) are plain text.
async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, ERROR_BODY_LIMIT).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let message = match text.trim() {
        "" => status.canonical_reason().unwrap_or("error").to_lowercase(),
        message => message.to_owned(),
    };
    let (json_parts, json_body) = ApiError::new(status, message).into_response().into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.extend(json_parts.headers);
    Response::from_parts(parts, json_body)
}

/// The wire form of a proxy's status.
pub(crate) fn status_dto(status: &ProxyStatus) -> ProxyStatusDto {
    ProxyStatusDto {
        id: status.id.to_string(),
        service: status.service.to_string(),
        state: status.state.as_str().to_owned(),
        figures: status.figures.clone(),
        ready: status.ready(),
        status_text: status.figures.status_text.clone(),
        resources: status.usage.as_deref().map(|usage| dto::ResourcesDto {
            cpu_seconds: usage.cpu.as_secs_f64(),
            memory_bytes: usage.memory_bytes,
            tasks: usage.tasks,
        }),
        update: status.update.as_ref().map(|update| dto::UpdateDto {
            state: update.state.as_str().to_owned(),
            pid: update.pid,
            started_at: update.started_at.map(dto::rfc3339),
        }),
        last_reload: status.figures.reloads.as_ref().map(|reloads| dto::ReloadDto::from(&reloads.last)),
        generations: status
            .generations
            .iter()
            .flatten()
            .enumerate()
            .map(|(at, generation)| dto::GenerationDto {
                epoch: generation.epoch,
                pid: generation.pid,
                role: match (at, generation.draining) {
                    (0, _) => "current",
                    (_, true) => "draining",
                    (_, false) => "new",
                }
                .to_owned(),
            })
            .collect(),
        certificate: None,
        last_xds: None,
        depends_on: Vec::new(),
        templates: Vec::new(),
    }
}

/// `GET /v1/agent/fleet`: the etcd follower's status; 404 when the agent follows no etcd.
async fn fleet(State(state): State<ApiState>) -> Result<Json<dto::FleetDto>, ApiError> {
    let status =
        state.fleet.as_ref().ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "the agent follows no etcd"))?;
    let status = status.get();
    Ok(Json(dto::FleetDto {
        node: status.node,
        prefix: status.prefix,
        endpoints: status.endpoints,
        connected: status.connected,
        unreachable_since: status.unreachable_since.map(dto::rfc3339),
        revision: status.revision,
        services: status.services,
        invalid: status.invalid,
        last_error: status.last_error,
    }))
}

/// Every node of the fleet, read from etcd by the agent: the page never talks to etcd.
async fn fleet_nodes(State(state): State<ApiState>) -> Result<Json<dto::FleetNodesDto>, ApiError> {
    let reader =
        state.fleet_reader.as_ref().ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "the agent follows no etcd"))?;
    let report = reader.report().await.map_err(|err| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot read the fleet: {}", crate::error::error_chain(&err)),
        )
    })?;
    Ok(Json(report.into()))
}

async fn proxies(State(state): State<ApiState>) -> Json<Vec<ProxyStatusDto>> {
    Json(state.manager.status().iter().map(|status| status_with_templates(&state, status)).collect())
}

/// A proxy's status, with its templates' error when the engine has none to show: a file
/// that failed to render again is kept as it was, and the proxy runs on with it. With
/// Connect, its service's certificate, and the certificate's error when nothing else is
/// wrong: a leaf that cannot be renewed shows before it expires.
fn status_with_templates(state: &ApiState, status: &tether_manager::ProxyStatus) -> ProxyStatusDto {
    let mut dto = status_dto(status);
    if dto.figures.error.is_none() {
        dto.figures.error = state.templates.error(&status.id);
    }
    dto.certificate = connect_ca::certificate_of(state, &status.service);
    if dto.figures.error.is_none() {
        dto.figures.error = dto.certificate.as_ref().and_then(|certificate| certificate.error.clone());
    }
    dto.last_xds = state.xds.last(&status.id).map(|verdict| dto::XdsDto::from(&verdict));
    dto.templates = state
        .templates
        .last_renders(&status.id)
        .into_iter()
        .map(|(destination, render)| dto::TemplateRenderDto {
            destination: destination.display().to_string(),
            at: dto::rfc3339(render.at),
            result: render.result.to_owned(),
            error: render.error,
        })
        .collect();
    if let Some(proxy) = state.sources.state().get(&status.service).and_then(|entry| entry.proxy) {
        dto.depends_on = proxy
            .spec()
            .depends_on
            .iter()
            .map(|(dependency, condition)| dto::DependencyDto {
                dependency: dependency.to_string(),
                condition: condition.as_str().to_owned(),
                proxy: dependency.resolve(|id| state.manager.proxy(id).is_some()).map(|id| id.to_string()),
            })
            .collect();
    }
    dto
}

async fn proxy(State(state): State<ApiState>, Path(id): Path<String>) -> Result<Json<ProxyStatusDto>, ApiError> {
    let id = known_proxy(&state, &id)?;
    let status =
        state.manager.proxy(&id).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no proxy {id}")))?;
    Ok(Json(status_with_templates(&state, &status)))
}

async fn register(State(state): State<ApiState>, body: Bytes) -> Result<Json<serde_json::Value>, ApiError> {
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "body is not UTF-8"))?;
    state.sources.check_register_body(text)?;
    let service = config::parse_service(text, Format::Json, &Origin::Body)
        .map_err(|err| ApiError::new(StatusCode::BAD_REQUEST, crate::error::error_chain(&err)))?;
    let id = service.id.clone();
    let sources = state.sources.clone();
    // Persisting fsyncs: keep it off the runtime's worker threads.
    tokio::task::spawn_blocking(move || sources.register(service))
        .await
        .map_err(|err| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))??;
    // The proxy's token is durable with its registration: `tokens.json`, which holds every
    // proxy's, follows soon, once for a burst of registrations.
    state.sources.save_tokens_soon();
    Ok(Json(serde_json::json!({ "registered": id.as_str() })))
}

async fn deregister(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = ServiceId::new(id).map_err(|err| ApiError::new(StatusCode::BAD_REQUEST, err.to_string()))?;
    let sources = state.sources.clone();
    let service = id.clone();
    tokio::task::spawn_blocking(move || sources.deregister(&service))
        .await
        .map_err(|err| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))??;
    // A deregistered proxy is gone, hold and all: registered again, it runs.
    let held = state.held.clone();
    let proxy = id.proxy_id();
    let released = tokio::task::spawn_blocking(move || held.set(&proxy, false)).await;
    if let Ok(Err(err)) = released {
        tracing::warn!(service = %id, error = %crate::error::error_chain(&err), "cannot release the hold of a deregistered proxy");
    }
    Ok(Json(serde_json::json!({ "deregistered": id.as_str() })))
}

async fn leave(State(state): State<ApiState>) -> Result<Json<serde_json::Value>, ApiError> {
    let (done, stopped) = oneshot::channel();
    state
        .leave
        .send(done)
        .await
        .map_err(|_| ApiError::new(StatusCode::CONFLICT, "the agent is already shutting down"))?;
    match stopped.await {
        Ok(Ok(())) => Ok(Json(serde_json::json!({ "left": true }))),
        Ok(Err(message)) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)),
        Err(_) => Err(ApiError::new(StatusCode::CONFLICT, "the agent is already shutting down")),
    }
}

/// `PUT /v1/agent/proxy/{id}/restart`: restarts one proxy now; answered once the new process
/// runs.
async fn restart(State(state): State<ApiState>, Path(id): Path<String>) -> Result<Json<ProxyStatusDto>, ApiError> {
    use tether_manager::RequestError;
    let id = known_proxy(&state, &id)?;
    state.manager.restart(&id).await.map_err(|err| {
        let status = match &err {
            RequestError::NotFound(_) => StatusCode::NOT_FOUND,
            RequestError::Busy(_) | RequestError::Blocked { .. } => StatusCode::CONFLICT,
            RequestError::Gone => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, err.to_string())
    })?;
    let status =
        state.manager.proxy(&id).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no proxy {id}")))?;
    Ok(Json(status_dto(&status)))
}

/// `PUT /v1/agent/proxy/{id}/reload`: reloads one proxy in place; answered with the verdict,
/// whatever it is (a refused or failed reload is an answer, not an error of the request).
/// 400 when the proxy has no `reload` table, 409 when it has no process to reload.
async fn reload_proxy(State(state): State<ApiState>, Path(id): Path<String>) -> Result<Json<dto::ReloadDto>, ApiError> {
    use tether_manager::RequestError;
    let id = known_proxy(&state, &id)?;
    let outcome = state.manager.reload(&id).await.map_err(|err| {
        let status = match &err {
            RequestError::NotFound(_) => StatusCode::NOT_FOUND,
            RequestError::NoReload(_) => StatusCode::BAD_REQUEST,
            RequestError::NotRunning { .. } | RequestError::Busy(_) => StatusCode::CONFLICT,
            RequestError::Gone => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, err.to_string())
    })?;
    Ok(Json(dto::ReloadDto::from(&outcome)))
}

/// `PUT /v1/agent/proxy/{id}/stop`: holds one proxy down; it is stopped and stays `stopped`
/// (across agent restarts and reloads) until started. Answered once the engine has it; the
/// stop itself shows in the proxy's status.
async fn stop(State(state): State<ApiState>, Path(id): Path<String>) -> Result<Json<ProxyStatusDto>, ApiError> {
    hold(state, id, true).await
}

/// `PUT /v1/agent/proxy/{id}/start`: releases a proxy held down by `stop`.
async fn start(State(state): State<ApiState>, Path(id): Path<String>) -> Result<Json<ProxyStatusDto>, ApiError> {
    hold(state, id, false).await
}

async fn hold(state: ApiState, id: String, hold: bool) -> Result<Json<ProxyStatusDto>, ApiError> {
    let id = known_proxy(&state, &id)?;
    // Written first: once answered, the hold survives a crash of the agent.
    let held = state.held.clone();
    let target = id.clone();
    tokio::task::spawn_blocking(move || held.set(&target, hold))
        .await
        .map_err(|join| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, join.to_string()))?
        .map_err(|err| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, crate::error::error_chain(&err)))?;
    state.manager.hold(&id, hold).await.map_err(|err| {
        let status = match err {
            tether_manager::RequestError::NotFound(_) => StatusCode::NOT_FOUND,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, err.to_string())
    })?;
    let status =
        state.manager.proxy(&id).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no proxy {id}")))?;
    Ok(Json(status_dto(&status)))
}

/// Reloads the config dirs, SIGHUP's way and the API's: the files, then the CA of their
/// `[connect]` table, all before anything changes; a CA that cannot be loaded refuses the
/// reload whole, and the leaves of the CA in force stay as they are.
///
/// # Errors
///
/// [`ReloadError`]; a failed task is [`ReloadError::Connect`] too, with its reason.
pub(crate) async fn reload_config(
    sources: Arc<Sources>,
    connect: &crate::connect::Connect,
) -> Result<ReloadReport, ReloadError> {
    let reloaded = tokio::task::spawn_blocking(move || {
        let data = sources.data().clone();
        sources.reload_with(|section| {
            crate::connect::prepare(section, &data).map_err(|err| ReloadError::Connect(Box::new(err)))
        })
    })
    .await
    .map_err(|join| ReloadError::Connect(Box::new(join)))?;
    let (report, prepared) = reloaded?;
    connect.apply(prepared);
    Ok(report)
}

/// `PUT /v1/agent/reload`: reloads the config dirs as SIGHUP does, and says whether it took.
async fn reload(State(state): State<ApiState>) -> Result<Json<serde_json::Value>, ApiError> {
    let reloaded = reload_config(state.sources.clone(), &state.connect).await;
    match reloaded {
        Ok(report) => Ok(Json(serde_json::json!({
            "added": report.catalog.added,
            "changed": report.catalog.changed,
            "removed": report.catalog.removed,
            "files_read": report.files.read,
            "files_unchanged": report.files.reused,
        }))),
        // The previous config stays in force. Invalid files show every error, one a line.
        Err(err) => Err(ApiError::new(StatusCode::BAD_REQUEST, crate::error::error_chain(&err))),
    }
}

/// `GET /`: the status page, one self-contained file built into the binary. It reads
/// `/v1/agent/proxies` and follows `/v1/agent/events`, so it needs nothing the read
/// endpoints do not serve, and loads nothing from elsewhere (its policy says so).
/// What the page's answers may load: its own script and style, and the agent's answers;
/// nothing inline, nothing from elsewhere, and no frame may hold it.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                           img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One of the page's files, built into the binary.
fn page_file(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CONTENT_SECURITY_POLICY, PAGE_POLICY),
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        body,
    )
}

async fn page() -> impl IntoResponse {
    page_file("text/html; charset=utf-8", include_str!("page.html"))
}

async fn page_script() -> impl IntoResponse {
    page_file("text/javascript; charset=utf-8", include_str!("page.js"))
}

async fn page_style() -> impl IntoResponse {
    page_file("text/css; charset=utf-8", include_str!("page.css"))
}

async fn health() -> Json<HealthDto> {
    Json(HealthDto { status: "ok".to_owned() })
}

async fn metrics(State(state): State<ApiState>) -> impl IntoResponse {
    let body = state.metrics.render();
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body)
}
