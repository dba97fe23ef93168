//! `GET /v1/agent/connect/ca/roots` and `GET /v1/agent/connect/ca/leaf/{service}`: the
//! roots the mesh trusts, for anyone who reads the API, and a service's leaf certificate
//! with its private key, for the service's own proxy alone (its token, as for its config).
//!
//! Both are blocking queries as the config endpoint's: `?index=N&wait=DUR` answers once
//! the index passes N (a new leaf, new roots) or the wait ends, and `X-Tether-Index` carries
//! the index. A wait holds one of the listener's stream slots.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use tether_manager::{LeafBoard, LeavesHandle};
use tether_state::ServiceId;

use super::dto::{self, CaRootDto, CaRootsDto, INDEX_HEADER, LeafDto, TOKEN_HEADER};
use super::proxy_config::{forbidden, wait_of};
use super::{ApiError, ApiState, StreamSlots};
use crate::catalog::names::authorised;

#[derive(Debug, Deserialize)]
pub(crate) struct BlockingQuery {
    pub(crate) index: Option<u64>,
    pub(crate) wait: Option<String>,
}

/// 404 for an endpoint of Connect while no config dir has a `[connect]` table.
pub(crate) fn not_enabled() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "Connect is not enabled: no config dir has a [connect] table")
}

fn leaves(state: &ApiState) -> Result<LeavesHandle, ApiError> {
    state.connect.leaves().ok_or_else(not_enabled)
}

/// The wait of a blocking query on `watched`: returns at once without `?index=`, or when
/// `passed(value, index)` holds already; else once it holds, the query's wait ends or the
/// API stops, holding one of the listener's stream slots meanwhile.
pub(crate) async fn block<T>(
    state: &ApiState,
    mut watched: tokio::sync::watch::Receiver<T>,
    query: &BlockingQuery,
    slots: &StreamSlots,
    passed: impl Fn(&T, u64) -> bool,
) -> Result<(), ApiError> {
    let Some(index) = query.index else { return Ok(()) };
    if passed(&watched.borrow_and_update(), index) {
        return Ok(());
    }
    let wait = wait_of(query.wait.as_deref())?;
    let _slot = slots.take()?;
    let waited = tokio::time::timeout(wait, async {
        tokio::select! {
            () = state.shutdown.cancelled() => {}
            _ = watched.wait_for(|value| passed(value, index)) => {}
        }
    });
    let _ = waited.await;
    Ok(())
}

/// A blocking query's answer: `body`, with its index in `X-Tether-Index`.
pub(crate) fn with_index(body: impl serde::Serialize, index: u64) -> Response {
    let mut response = Json(body).into_response();
    if let Ok(value) = HeaderValue::from_str(&index.to_string()) {
        response.headers_mut().insert(INDEX_HEADER, value);
    }
    response
}

pub(crate) async fn get_roots(
    State(state): State<ApiState>,
    Query(query): Query<BlockingQuery>,
    Extension(slots): Extension<StreamSlots>,
) -> Result<Response, ApiError> {
    let handle = leaves(&state)?;
    block(&state, handle.watch(), &query, &slots, |board: &LeafBoard, index| board.roots_index > index).await?;
    let board = handle.board();
    let roots: Vec<CaRootDto> = board
        .roots
        .iter()
        .map(|root| CaRootDto {
            id: root.serial.clone(),
            serial: root.serial.clone(),
            not_after: dto::rfc3339(root.not_after),
            root_cert: root.cert_pem.clone(),
            active: root.active,
        })
        .collect();
    let body = CaRootsDto {
        trust_domain: board.trust_domain.as_ref().map(ToString::to_string).unwrap_or_default(),
        active_root_id: board.roots.iter().find(|root| root.active).map(|root| root.serial.clone()),
        roots,
        index: board.roots_index,
    };
    let index = board.roots_index;
    drop(board);
    Ok(with_index(body, index))
}

pub(crate) async fn get_leaf(
    State(state): State<ApiState>,
    Path(service): Path<String>,
    Query(query): Query<BlockingQuery>,
    Extension(slots): Extension<StreamSlots>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let token = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()).ok_or_else(forbidden)?.to_owned();
    let service_id = ServiceId::new(service).ok();
    let proxy_id = service_id.as_ref().map(ServiceId::proxy_id);
    // The same refusal for an unknown service and a wrong token.
    authorised(state.sources.state(), &proxy_id, &token).ok_or_else(forbidden)?;
    let Some(service_id) = service_id else { return Err(forbidden()) };
    let handle = leaves(&state)?;
    block(&state, handle.watch(), &query, &slots, |board: &LeafBoard, index| {
        board.services.get(&service_id).is_some_and(|status| status.index > index)
    })
    .await?;
    let board = handle.board();
    let status = board.services.get(&service_id).cloned();
    drop(board);
    let Some(status) = status else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("service {service_id} has no leaf certificate yet; try again"),
        ));
    };
    let Some(leaf) = status.leaf else {
        let why = status.error.unwrap_or_else(|| "not issued yet".to_owned());
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("service {service_id} has no valid leaf certificate: {why}"),
        ));
    };
    let body = LeafDto {
        service: status.name.map(|name| name.to_string()).unwrap_or_default(),
        service_id: service_id.to_string(),
        spiffe_id: leaf.spiffe_id.to_string(),
        serial: leaf.serial.clone(),
        cert_pem: leaf.cert_pem.clone(),
        // The one place a key leaves the agent: to the proxy that proved it owns it.
        private_key_pem: leaf.key.expose().to_owned(),
        valid_after: dto::rfc3339(leaf.not_before),
        valid_before: dto::rfc3339(leaf.not_after),
        index: status.index,
    };
    Ok(with_index(body, status.index))
}

/// The status of one service's certificate, as `tether status --json` shows it: never the key.
pub(crate) fn certificate_of(state: &ApiState, service: &ServiceId) -> Option<dto::CertificateDto> {
    let handle = state.connect.leaves()?;
    let board = handle.board();
    let status = board.services.get(service)?;
    Some(dto::CertificateDto {
        serial: status.leaf.as_ref().map(|leaf| leaf.serial.clone()),
        spiffe_id: status.leaf.as_ref().map(|leaf| leaf.spiffe_id.to_string()),
        not_after: status.leaf.as_ref().map(|leaf| dto::rfc3339(leaf.not_after)),
        next_renewal: status.next_attempt.map(dto::rfc3339),
        error: status.error.clone(),
    })
}
