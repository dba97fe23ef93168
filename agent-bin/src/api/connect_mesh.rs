//! What a built-in proxy needs of the mesh beyond its certificate, each for its own proxy's
//! token: `GET /v1/agent/connect/intentions/{service}` (the intentions that decide who may
//! connect to the service, as a blocking query on the intentions' index, so that a proxy
//! closes a connection that a reload denies), `GET /v1/agent/connect/upstream/{service}/{destination}`
//! (where the ready instances of an upstream take mutual TLS, as a blocking query on the
//! catalog and the proxies' readiness), and `PUT /v1/agent/connect/refused/{service}` (a
//! connection the proxy refused or closed: counted, and told as an event).

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use tether_state::{ProxyId, ServiceId, ServiceName, SpiffeId};

use super::connect_ca::{BlockingQuery, block, not_enabled, with_index};
use super::dto::{IntentionDto, IntentionsDto, MeshInstanceDto, RefusalDto, TOKEN_HEADER, UpstreamDto};
use super::proxy_config::forbidden;
use super::{ApiError, ApiState, StreamSlots};
use crate::catalog::mesh::mesh_instances;
use crate::catalog::names::authorised;

/// The longest detail of a refusal that is kept.
const MAX_DETAIL: usize = 512;

/// The service of the proxy whose token `headers` carry, if it is `service`'s.
fn own_service(state: &ApiState, service: &str, headers: &HeaderMap) -> Result<tether_state::Entry, ApiError> {
    let token = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()).ok_or_else(forbidden)?;
    let proxy_id: Option<ProxyId> = ServiceId::new(service).ok().map(|id| id.proxy_id());
    authorised(state.sources.state(), &proxy_id, token).ok_or_else(forbidden)
}

pub(crate) async fn get_intentions(
    State(state): State<ApiState>,
    Path(service): Path<String>,
    Query(query): Query<BlockingQuery>,
    Extension(slots): Extension<StreamSlots>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let entry = own_service(&state, &service, &headers)?;
    let changes = state.sources.intentions_index();
    block(&state, changes.clone(), &query, &slots, |index, wanted| *index > wanted).await?;
    // The index before the section: a change in between is answered again by the next query.
    let index = *changes.borrow();
    let section = state.sources.connect_section();
    if section.connect().is_none() {
        return Err(not_enabled());
    }
    let name = &entry.service.name;
    let intentions = section.intentions();
    let body = IntentionsDto {
        default_intention: intentions.default_action().as_str().to_owned(),
        intentions: intentions
            .rules()
            .iter()
            .filter(|rule| rule.destination().matches(name))
            .map(|rule| IntentionDto {
                source: rule.source().to_string(),
                destination: rule.destination().to_string(),
                action: rule.action().as_str().to_owned(),
            })
            .collect(),
        index,
    };
    Ok(with_index(body, index))
}

pub(crate) async fn get_upstream(
    State(state): State<ApiState>,
    Path((service, destination)): Path<(String, String)>,
    Query(query): Query<BlockingQuery>,
    Extension(slots): Extension<StreamSlots>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    own_service(&state, &service, &headers)?;
    let destination = ServiceName::new(destination.as_str())
        .map_err(|err| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid destination: {err}")))?;
    let changes = state.xds.changes();
    block(&state, changes.clone(), &query, &slots, |index, wanted| *index > wanted).await?;
    let index = *changes.borrow();
    let section = state.sources.connect_section();
    let connect = section.connect().ok_or_else(not_enabled)?;
    let spiffe_id = SpiffeId::service(&connect.trust_domain, &connect.datacenter, &destination)
        .map_err(|err| ApiError::new(StatusCode::BAD_REQUEST, err.to_string()))?;
    let ready = |id: &ProxyId| state.manager.proxy(id).is_some_and(|status| status.ready());
    let instances = mesh_instances(state.sources.state(), &destination, ready)
        .into_iter()
        .map(|found| MeshInstanceDto { service_id: found.service_id, address: found.address, port: found.port })
        .collect();
    let body = UpstreamDto { destination: destination.to_string(), spiffe_id: spiffe_id.to_string(), instances, index };
    Ok(with_index(body, index))
}

pub(crate) async fn put_refused(
    State(state): State<ApiState>,
    Path(service): Path<String>,
    headers: HeaderMap,
    Json(refusal): Json<RefusalDto>,
) -> Result<Response, ApiError> {
    let entry = own_service(&state, &service, &headers)?;
    let Some(reason) = crate::connect::REFUSAL_REASONS.into_iter().find(|known| *known == refusal.reason) else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("unknown reason {:?}: one of {}", refusal.reason, crate::connect::REFUSAL_REASONS.join(", ")),
        ));
    };
    let mut detail: String = refusal.detail.chars().filter(|c| !c.is_control()).collect();
    if detail.len() > MAX_DETAIL {
        let mut end = MAX_DETAIL;
        while !detail.is_char_boundary(end) {
            end -= 1;
        }
        detail.truncate(end);
    }
    tracing::info!(service = %entry.service.id, reason, %detail, "connection refused");
    state.connect.refuse(crate::connect::Refusal {
        time: std::time::SystemTime::now(),
        service: entry.service.id.clone(),
        reason,
        detail,
    });
    Ok(StatusCode::NO_CONTENT.into_response())
}
