//! `tether intention check SRC DST`: reads the config dirs as `tether validate` does, and
//! says whether SRC may connect to DST, and which intention decided.
//!
//! It starts nothing, writes nothing and needs no agent.

use std::io::Write;
use std::process::ExitCode;

use tether_state::config::{ConnectSection, DisplayPath};
use tether_state::{IntentionAction, ServiceName, WILDCARD};

use crate::cli::IntentionCheckArgs;
use crate::error::UsageError;

/// Prints the verdict and what decided it: exit 0 allow, 1 deny; 2 and every error when a
/// config file is invalid, or the names are not service names.
pub(crate) fn check(args: &IntentionCheckArgs) -> anyhow::Result<ExitCode> {
    let source = service_name("SRC", &args.source)?;
    let destination = service_name("DST", &args.destination)?;
    let loaded = match tether_state::config::load_dirs(&args.config_dirs) {
        Ok(loaded) => loaded,
        Err(errors) => {
            writeln!(std::io::stderr(), "{errors}\n{} error(s)", errors.len())?;
            return Ok(ExitCode::from(2));
        }
    };
    let verdict = verdict(&loaded.connect, &source, &destination);
    writeln!(std::io::stdout(), "{}", verdict.text)?;
    Ok(match verdict.action {
        IntentionAction::Allow => ExitCode::SUCCESS,
        IntentionAction::Deny => ExitCode::from(1),
    })
}

/// A name given on the command line: a service name, and not the wildcard, which a
/// connection never comes from or goes to.
fn service_name(what: &str, raw: &str) -> Result<ServiceName, UsageError> {
    if raw == WILDCARD {
        return Err(UsageError(format!(
            "{what} must name a service: `*` matches every service in an intention, but a connection is between two"
        )));
    }
    ServiceName::new(raw).map_err(|err| UsageError(format!("{what}: {err}")))
}

/// The decision on one connection, as shown.
struct Verdict {
    action: IntentionAction,
    text: String,
}

/// `allow: web -> db (intention web -> db in FILE: "why")`, or for the default,
/// `deny: web -> db (no intention matches; the default is deny)`.
fn verdict(section: &ConnectSection, source: &ServiceName, destination: &ServiceName) -> Verdict {
    let decision = section.intentions().decide(source, destination);
    let reason = match decision.rule {
        Some(rule) => {
            let mut reason = format!("intention {rule}");
            if let Some(file) = section.intention_file(rule) {
                reason.push_str(&format!(" in {}", DisplayPath(file)));
            }
            if let Some(description) = rule.description() {
                reason.push_str(&format!(": {description:?}"));
            }
            reason
        }
        None => match section.connect_file() {
            Some(file) => {
                format!("no intention matches; the default_intention of {} is {}", DisplayPath(file), decision.action)
            }
            None => format!("no intention matches; the default is {}", decision.action),
        },
    };
    Verdict { action: decision.action, text: format!("{}: {source} -> {destination} ({reason})", decision.action) }
}
