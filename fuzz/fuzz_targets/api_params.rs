//! Everything else the control API reads from a request, on arbitrary strings: the ids in
//! request paths, the blocking query's `index` and `wait`, and the `X-Tether-Proxy-Token`
//! comparison.
//!
//! The parsers are the library functions the handlers in `agent-bin/src/api/` call:
//! `ServiceId::new` (deregister), `ProxyId::parse` (proxy status and config),
//! `humantime::parse_duration` (`wait`) and `ProxyToken::matches`. The query string is
//! decoded with `serde_urlencoded` into a copy of the handler's private `ConfigQuery`, as
//! axum's `Query` extractor does.

#![no_main]

use std::path::{Component, Path};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tether_state::{MAX_SERVICE_ID_LEN, PROXY_SUFFIX, ProxyId, ProxyToken, ServiceId, TokenError};

/// The longest wait a blocking query may ask for, as in `proxy_config.rs`.
const MAX_WAIT: Duration = Duration::from_secs(600);

/// A token to compare candidates with, like the handler's decoy for unknown ids.
const KNOWN_TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// A copy of `agent-bin`'s `ConfigQuery`.
#[derive(serde::Deserialize)]
struct ConfigQuery {
    // Decoded only: an `index` that is not a u64 must fail the whole query, as it does there.
    #[allow(dead_code)]
    index: Option<u64>,
    wait: Option<String>,
}

fuzz_target!(|data: &[u8]| {
    // Paths, query strings and header values reach the handlers as `&str`.
    let Ok(text) = std::str::from_utf8(data) else { return };
    service_id(text);
    proxy_id(text);
    wait(text);
    if let Ok(ConfigQuery { wait: Some(raw), .. }) = serde_urlencoded::from_str(text) {
        wait(&raw);
    }
    // `stored\ncandidate`: a token as read back from storage, and what a client sends.
    let (stored, candidate) = text.split_once('\n').unwrap_or((text, text));
    token(stored, candidate);
});

/// An accepted id is one plain file name: the data dir builds paths from it.
fn plain_file_name(id: &str) {
    assert!(!id.is_empty());
    assert!(id != "." && id != "..", "{id:?}");
    assert!(id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')), "{id:?}");
    assert!(!id.contains('/') && !id.contains('\0'), "{id:?}");
    let mut components = Path::new(id).components();
    assert!(matches!(components.next(), Some(Component::Normal(name)) if name == id), "{id:?}");
    assert!(components.next().is_none(), "{id:?}");
}

/// A refusal's message goes into the response and the logs: no raw control characters.
fn clean_message(message: &str) {
    assert!(!message.chars().any(char::is_control), "{message:?}");
}

fn service_id(text: &str) {
    match ServiceId::new(text) {
        Ok(id) => {
            assert_eq!(id.as_str(), text);
            assert!(text.len() <= MAX_SERVICE_ID_LEN, "{text:?}");
            assert!(text.as_bytes()[0].is_ascii_alphanumeric(), "{text:?}");
            plain_file_name(id.as_str());
            assert_eq!(id.to_string(), text);
            let proxy = id.proxy_id();
            assert_eq!(ProxyId::parse(proxy.as_str()).as_ref(), Ok(&proxy));
            assert_eq!(proxy.service_id(), id);
        }
        Err(err) => clean_message(&err.to_string()),
    }
}

fn proxy_id(text: &str) {
    match ProxyId::parse(text) {
        Ok(id) => {
            assert_eq!(id.as_str(), text);
            let service = text.strip_suffix(PROXY_SUFFIX).expect("a proxy id ends in -proxy");
            assert!(service.len() <= MAX_SERVICE_ID_LEN, "{text:?}");
            assert!(text.len() <= MAX_SERVICE_ID_LEN + PROXY_SUFFIX.len(), "{text:?}");
            plain_file_name(id.as_str());
            assert_eq!(id.service_id().as_str(), service);
            assert_eq!(ServiceId::new(service).as_ref(), Ok(&id.service_id()));
            assert_eq!(id.service_id().proxy_id(), id);
        }
        Err(err) => clean_message(&err.to_string()),
    }
}

fn wait(raw: &str) {
    match humantime::parse_duration(raw) {
        Ok(duration) => {
            let _capped = duration.min(MAX_WAIT);
            // Durations in config files are written with `format_duration` and read back.
            let written = humantime::format_duration(duration).to_string();
            assert_eq!(humantime::parse_duration(&written).ok(), Some(duration), "{raw:?} -> {written:?}");
        }
        Err(err) => {
            let _message = format!("invalid wait {raw:?}: {err}");
        }
    }
}

fn token(stored: &str, candidate: &str) {
    let known = ProxyToken::from_hex(KNOWN_TOKEN).expect("64 hex digits are a token");
    assert_eq!(known.matches(candidate), candidate == KNOWN_TOKEN);
    assert_eq!(known.matches(stored), stored == KNOWN_TOKEN);
    match ProxyToken::from_hex(stored) {
        Ok(token) => {
            assert!(stored.len() >= 32 && stored.len().is_multiple_of(2), "{stored:?}");
            assert!(stored.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')), "{stored:?}");
            assert_eq!(token.expose(), stored);
            assert!(token.matches(stored));
            assert_eq!(token.matches(candidate), candidate == stored);
            // A candidate that differs in any one byte is refused.
            let mut near = stored.as_bytes().to_vec();
            let at = candidate.len() % near.len();
            near[at] = if near[at] == b'0' { b'1' } else { b'0' };
            let near = String::from_utf8(near).expect("hex stays ASCII");
            assert!(!token.matches(&near));
            assert!(!format!("{token:?} {token}").contains(stored));
            assert_eq!(token.fingerprint().as_str().len(), 64);
        }
        // The refusal never depends on, and so never echoes, the input.
        Err(err) => assert!(matches!(err, TokenError::Malformed), "{stored:?}"),
    }
}
