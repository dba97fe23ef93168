//! `GET /v1/agent/proxy/{id}/config`: a proxy's service and opaque `config`, for the proxy
//! itself, authenticated by its token, with Consul-style blocking queries.
//!
//! A blocking query waits on the catalog's change notifications and one timer for its
//! `wait`, so a thousand waiting proxies cost no wake-up while nothing changes. Refusals
//! never say which proxy ids exist.

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use tether_state::{Catalog, ProxyId, Revision};

use super::dto::{INDEX_HEADER, ProxyConfigDto, ServiceDto, TOKEN_HEADER};
use super::{ApiError, ApiState, StreamSlots};
use crate::catalog::names::authorised;

/// How long a blocking query waits when it does not say.
const DEFAULT_WAIT: Duration = Duration::from_secs(300);

/// The longest a blocking query may wait.
const MAX_WAIT: Duration = Duration::from_secs(600);

#[derive(Debug, Deserialize)]
pub(crate) struct ConfigQuery {
    index: Option<u64>,
    wait: Option<String>,
}

pub(crate) fn forbidden() -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "missing or invalid X-Tether-Proxy-Token for this proxy")
}

/// The wait of a blocking query: `wait` (humantime), else [`DEFAULT_WAIT`], at most
/// [`MAX_WAIT`].
///
/// # Errors
///
/// 400 for a `wait` that is no duration.
pub(crate) fn wait_of(wait: Option<&str>) -> Result<Duration, ApiError> {
    let wait = match wait {
        Some(wait) => humantime::parse_duration(wait)
            .map_err(|err| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid wait {wait:?}: {err}")))?,
        None => DEFAULT_WAIT,
    };
    Ok(wait.min(MAX_WAIT))
}

pub(crate) async fn get_config(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(query): Query<ConfigQuery>,
    Extension(slots): Extension<StreamSlots>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let token = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()).ok_or_else(forbidden)?.to_owned();
    let id = ProxyId::parse(id).ok();
    let catalog = state.sources.state();
    // Subscribe before reading, so that a change between the read and the wait wakes us.
    let mut changes = catalog.subscribe();
    let mut entry = authorised(catalog, &id, &token).ok_or_else(forbidden)?;
    if let Some(index) = query.index {
        let wait = wait_of(query.wait.as_deref())?;
        // A query that waits holds one of the listener's stream slots while it waits.
        let _slot = if entry.revision <= Revision::new(index) { Some(slots.take()?) } else { None };
        let deadline = tokio::time::sleep(wait);
        tokio::pin!(deadline);
        while entry.revision <= Revision::new(index) {
            tokio::select! {
                () = &mut deadline => break,
                () = state.shutdown.cancelled() => break,
                changed = changes.changed() => {
                    if changed.is_none() {
                        break;
                    }
                    entry = authorised(catalog, &id, &token).ok_or_else(forbidden)?;
                }
            }
        }
    }
    let Some(proxy) = entry.proxy.as_ref() else { return Err(forbidden()) };
    let service = &entry.service;
    let body = ProxyConfigDto {
        proxy_id: proxy.id().to_string(),
        service: ServiceDto {
            id: service.id.to_string(),
            name: service.name.to_string(),
            address: service.address.clone(),
            port: service.port,
        },
        config: proxy.spec().config.clone(),
        index: entry.revision.get(),
    };
    let mut response = Json(body).into_response();
    if let Ok(value) = HeaderValue::from_str(&entry.revision.get().to_string()) {
        response.headers_mut().insert(INDEX_HEADER, value);
    }
    Ok(response)
}
