//! Intentions from etcd: `<prefix>/intentions/<source>/<destination>`, each source and
//! destination a service name or `*`, each value an `IntentionRecord`
//! (`{"action": "allow"}`, with an optional `description`). Every agent that follows etcd
//! reads the prefix and watches it, in each session of its follower and on its connection,
//! and hands what it holds to
//! `Sources::set_fleet_intentions`, which merges it with the config files' intentions; the
//! built-in proxies follow the result as they follow a reload.
//!
//! A key that says nothing valid is skipped with a warning naming it: it never stops the
//! rest, nor a proxy. This module writes nothing to etcd.

use std::sync::Arc;

use tether_state::{Intention, IntentionAction, IntentionTarget};

use crate::catalog::sources::Sources;
use crate::etcd::{self, Client, IntentionRecord, pb};

/// Follows the fleet's intentions under `prefix` through `client`, handing every reading to
/// `sources`, until the watch fails: the follower runs it in each of its sessions with etcd,
/// on the session's connection, so that one member serves the node's watches, and a new
/// session reads the intentions again.
///
/// # Cancel safety
///
/// Cancel-safe: dropping it drops the watch; what was read stays in force.
pub(crate) async fn follow(client: Client, prefix: String, sources: Arc<Sources>) {
    let read = etcd::read_and_watch(&client, &prefix, |kvs| sources.set_fleet_intentions(read(&prefix, kvs)));
    let Err(error) = read.await;
    tracing::warn!(%prefix, %error, "cannot follow the fleet's intentions until the next session with etcd");
}

/// The intentions that the keys under `prefix` hold, each with its key; an invalid one is
/// skipped with a warning that names it.
pub(crate) fn read(prefix: &str, kvs: &[pb::KeyValue]) -> Vec<(Intention, String)> {
    kvs.iter()
        .filter_map(|kv| {
            let key = String::from_utf8_lossy(&kv.key).into_owned();
            match parse(prefix, &key, &kv.value) {
                Ok(rule) => Some((rule, key)),
                Err(problem) => {
                    tracing::warn!(%key, %problem, "skipping an intention key that says no valid intention");
                    None
                }
            }
        })
        .collect()
}

/// One key and its value as an intention.
///
/// # Errors
///
/// What is wrong with the key or the value.
fn parse(prefix: &str, key: &str, value: &[u8]) -> Result<Intention, String> {
    let rest = key.strip_prefix(prefix).ok_or_else(|| format!("the key is not under {prefix}"))?;
    let (source, destination) = rest
        .split_once('/')
        .filter(|(_, destination)| !destination.contains('/'))
        .ok_or_else(|| format!("the key is not {prefix}<source>/<destination>"))?;
    let target = |raw: &str, what: &str| IntentionTarget::parse(raw).map_err(|err| format!("the key's {what}: {err}"));
    let (source, destination) = (target(source, "source")?, target(destination, "destination")?);
    let record: IntentionRecord = serde_json::from_slice(value)
        .map_err(|err| format!("the value is not {{\"action\": \"allow\" | \"deny\"}}: {err}"))?;
    let action = IntentionAction::from_name(&record.action)
        .ok_or_else(|| format!("action: {:?} is neither \"allow\" nor \"deny\"", record.action))?;
    let rule = Intention::new(source, destination, action);
    match record.description {
        Some(description) => rule.with_description(description).map_err(|err| format!("description: {err}")),
        None => Ok(rule),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFIX: &str = "/tether/intentions/";

    fn kv(key: &str, value: &str) -> pb::KeyValue {
        pb::KeyValue { key: key.as_bytes().to_vec(), value: value.as_bytes().to_vec(), ..pb::KeyValue::default() }
    }

    #[test]
    fn a_key_names_source_and_destination_and_its_value_the_action() {
        let rule = parse(PREFIX, "/tether/intentions/web/db", br#"{"action":"allow"}"#).unwrap();
        assert_eq!(rule.to_string(), "web -> db");
        assert_eq!(rule.action(), IntentionAction::Allow);
        let rule =
            parse(PREFIX, "/tether/intentions/*/db", br#"{"action":"deny","description":"lock db down"}"#).unwrap();
        assert_eq!((rule.to_string().as_str(), rule.action()), ("* -> db", IntentionAction::Deny));
    }

    #[test]
    fn each_bad_key_is_skipped_and_the_good_ones_stay() {
        let kvs = [
            kv("/tether/intentions/web/db", r#"{"action":"deny"}"#),
            kv("/tether/intentions/web", r#"{"action":"deny"}"#),
            kv("/tether/intentions/web/db/extra", r#"{"action":"deny"}"#),
            kv("/tether/intentions/web/", r#"{"action":"deny"}"#),
            kv("/tether/intentions/w*/db", r#"{"action":"deny"}"#),
            kv("/tether/intentions/api/db", r#"{"action":"maybe"}"#),
            kv("/tether/intentions/api/web", "allow"),
            kv("/tether/intentions/api/cache", r#"{"action":"allow","port":1}"#),
        ];
        let read = read(PREFIX, &kvs);
        let kept: Vec<String> = read.iter().map(|(rule, key)| format!("{rule} {key}")).collect();
        assert_eq!(kept, ["web -> db /tether/intentions/web/db"]);
        let problem = |key: &str, value: &str| parse(PREFIX, key, value.as_bytes()).unwrap_err();
        assert!(problem("/tether/intentions/web", r#"{"action":"deny"}"#).contains("<source>/<destination>"));
        assert!(problem("/tether/intentions/api/db", r#"{"action":"maybe"}"#).contains("\"maybe\""));
        assert!(problem("/tether/intentions/w*/db", r#"{"action":"deny"}"#).contains("source"));
        assert!(problem("/tether/intentions/web/", r#"{"action":"deny"}"#).contains("destination"));
        assert!(problem("/tether/intentions/api/cache", r#"{"action":"allow","port":1}"#).contains("port"));
    }
}
