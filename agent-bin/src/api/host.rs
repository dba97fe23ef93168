//! The `Host` check of `--http-addr`, against DNS rebinding.
//!
//! A web page can point a name it controls at 127.0.0.1 and make the browser that shows it
//! send requests to a loopback port; the browser then lets the page read the answers, since
//! they come from the page's own name. Such a request carries that name in `Host`. So the
//! TCP address answers only requests that name the loopback: `localhost`, `127.x.y.z` or
//! `[::1]`, with or without a port. The socket needs no such check: no browser reaches it.

use std::net::{Ipv4Addr, Ipv6Addr};

use axum::extract::Request;
use axum::http::uri::Authority;
use axum::http::{StatusCode, Version, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;

/// Answers 403 to a request that names a host other than the loopback, and 400 to an
/// HTTP/1.1 request that names none; passes every other request on.
pub(crate) async fn require_loopback(request: Request, next: Next) -> Response {
    match check(&request) {
        Ok(()) => next.run(request).await,
        Err(err) => err.into_response(),
    }
}

fn check(request: &Request) -> Result<(), ApiError> {
    let mut headers = request.headers().get_all(header::HOST).iter();
    let host = headers.next();
    if headers.next().is_some() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "more than one Host header"));
    }
    let host = host
        .map(|value| {
            value.to_str().map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "the Host header is not ASCII text"))
        })
        .transpose()?;
    // A request in absolute form (`GET http://name/ HTTP/1.1`) names its host in the target.
    let target = request.uri().authority().map(Authority::as_str);
    if host.is_none() && target.is_none() && request.version() >= Version::HTTP_11 {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "missing Host header"));
    }
    match [host, target].into_iter().flatten().find(|name| !is_loopback(name)) {
        None => Ok(()),
        Some(name) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("host {name:?} is not a loopback name; this address answers only localhost, 127.0.0.0/8 and [::1]"),
        )),
    }
}

/// Whether `host` (a `Host` value: a name or an address, and maybe a port) is `localhost`
/// or a loopback address.
fn is_loopback(host: &str) -> bool {
    let (name, port) = split_port(host);
    if port.is_some_and(|port| port.parse::<u16>().is_err()) {
        return false;
    }
    if let Some(v6) = name.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')) {
        return v6.parse::<Ipv6Addr>().is_ok_and(|ip| ip.to_canonical().is_loopback());
    }
    name.eq_ignore_ascii_case("localhost") || name.parse::<Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// Splits a `Host` value into its name and its port, if it has one: `[::1]:80` into `[::1]`
/// and `80`.
fn split_port(host: &str) -> (&str, Option<&str>) {
    if host.starts_with('[') {
        return match host.rfind("]:") {
            Some(end) => (&host[..=end], Some(&host[end + 2..])),
            None => (host, None),
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) => (name, Some(port)),
        None => (host, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_addresses_pass_with_or_without_a_port() {
        for host in [
            "localhost",
            "LocalHost:8500",
            "127.0.0.1",
            "127.0.0.1:8500",
            "127.1.2.3:80",
            "[::1]",
            "[::1]:8500",
            "[0:0:0:0:0:0:0:1]:1",
            "[::ffff:127.0.0.1]",
        ] {
            assert!(is_loopback(host), "{host}");
        }
    }

    #[test]
    fn other_names_and_malformed_hosts_are_refused() {
        for host in [
            "",
            "evil.example",
            "evil.example:8500",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "10.0.0.1",
            "0.0.0.0:8500",
            "[::]:8500",
            "[::2]",
            "::1",
            "user@localhost",
            "localhost:port",
            "localhost:99999",
            "localhost:",
            "127.1",
            "127.0.0.1:80:80",
            "[::1]x",
            "[::1]:x",
        ] {
            assert!(!is_loopback(host), "{host}");
        }
    }
}
