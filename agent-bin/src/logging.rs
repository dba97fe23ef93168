//! The tracing subscriber: installed once, by the binary, in text or JSON.
//!
//! Libraries only emit events; this is the one place that decides where they go.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;
use crate::error::UsageError;

/// Logs to stderr at `level` (or `RUST_LOG` when set) in `format`; text has colours only
/// on a terminal, and never with `NO_COLOR` set, so that journald and log files get
/// plain lines.
pub(crate) fn install(level: &str, format: LogFormat) -> Result<(), UsageError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => EnvFilter::try_new(directives),
        _ => EnvFilter::try_new(level),
    }
    .map_err(|err| UsageError(format!("invalid --log-level {level:?}: {err}")))?;
    let colours = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty());
    // A line that cannot be written (stderr is a log file on a full file system) is lost,
    // and nothing else happens: by default the subscriber reports it with `eprintln!`, which
    // panics when stderr fails too, so a full disk would end a proxy at its next line.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colours)
        .log_internal_errors(false);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
    installed.map_err(|err| UsageError(format!("cannot install the logger: {err}")))
}
