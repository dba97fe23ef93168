//! Which proxy a name or a token means: the one reading of a name given by a user and the
//! one check of a proxy's token, for the API, the xDS server and the commands.

use tether_state::{Entry, IdError, LocalState, ProxyId, ProxyToken, ServiceId};

/// The proxies that `name` may mean, the more specific first: the proxy whose id it is,
/// then the proxy of the service whose id it is (as `systemctl` takes `nginx` for
/// `nginx.service`). The CLI checks a name with it; the API takes the first one it knows.
///
/// # Errors
///
/// The service id rule's [`IdError`], when `name` is neither a proxy id nor a service id.
pub(crate) fn proxies_named(name: &str) -> Result<Vec<ProxyId>, IdError> {
    let mut candidates = Vec::with_capacity(2);
    if let Ok(id) = ProxyId::parse(name) {
        candidates.push(id);
    }
    match ServiceId::new(name) {
        Ok(service) => candidates.push(service.proxy_id()),
        Err(err) if candidates.is_empty() => return Err(err),
        Err(_) => {}
    }
    Ok(candidates)
}

/// A fixed token to compare against when the id is unknown, so that an unknown id and a
/// wrong token take the same path and time.
fn decoy() -> ProxyToken {
    ProxyToken::from_hex("0".repeat(64)).unwrap_or_else(|_| unreachable!("64 hex digits are a valid token"))
}

/// The entry of the proxy `id`, if `token` is its token: the one check of a proxy's token,
/// for the API's proxy endpoints and the xDS server.
pub(crate) fn authorised(state: &LocalState, id: &Option<ProxyId>, token: &str) -> Option<Entry> {
    let entry = id.as_ref().and_then(|id| state.get(&id.service_id())).filter(|entry| entry.proxy.is_some());
    let expected = entry.as_ref().and_then(|e| e.proxy.as_ref()).map_or_else(decoy, |p| p.token().clone());
    let matches = expected.matches(token);
    entry.filter(|_| matches)
}
