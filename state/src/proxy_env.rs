//! The names of the variables that the agent puts in every proxy's environment: the
//! proxy's identity, and how to reach the agent.
//!
//! One place for them, so that the agent that sets them, the backend that finds a proxy
//! again by them after a crash, and the built-in proxy that reads them never disagree. This
//! module holds names only; it reads and sets nothing.

/// The prefix of every variable of tether's own; a proxy's `env` may not set one, and
/// `inherit_env` passes none of the agent's.
pub const PREFIX: &str = "TETHER_";

/// The proxy's id (`<service id>-proxy`).
pub const PROXY_ID: &str = "TETHER_PROXY_ID";

/// The id of the proxy's service.
pub const SERVICE_ID: &str = "TETHER_SERVICE_ID";

/// The proxy's secret token: it proves the proxy to the agent's API, and to the next agent
/// that it was started by this one.
pub const PROXY_TOKEN: &str = "TETHER_PROXY_TOKEN";

/// The path of the agent's control socket.
pub const SOCKET: &str = "TETHER_SOCKET";

/// The agent's loopback HTTP address, when it serves one.
pub const HTTP_ADDR: &str = "TETHER_HTTP_ADDR";

/// With `update = "epoch"`: the generation's restart epoch, as `{restart_epoch}` says it.
pub const RESTART_EPOCH: &str = "TETHER_RESTART_EPOCH";

/// With `update = "epoch"`: the proxy's base id, as `{base_id}` says it.
pub const BASE_ID: &str = "TETHER_BASE_ID";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_has_the_prefix() {
        for name in [PROXY_ID, SERVICE_ID, PROXY_TOKEN, SOCKET, HTTP_ADDR, RESTART_EPOCH, BASE_ID] {
            assert!(name.starts_with(PREFIX), "{name}");
        }
    }
}
