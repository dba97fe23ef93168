//! `tether validate DIR...`: loads config dirs exactly as the agent would, and reports.
//!
//! It starts nothing and writes nothing.

use std::io::Write;
use std::process::ExitCode;

use crate::cli::ValidateArgs;

/// Prints every error (exit 2) or a one-line summary (exit 0).
pub(crate) fn run(args: &ValidateArgs) -> anyhow::Result<ExitCode> {
    match tether_state::config::load_dirs(&args.dirs) {
        Ok(entries) => {
            let proxies = entries.iter().filter(|e| e.service.proxy.is_some()).count();
            writeln!(std::io::stdout(), "valid: {} service(s), {proxies} with a managed proxy", entries.len())?;
            Ok(ExitCode::SUCCESS)
        }
        Err(errors) => {
            writeln!(std::io::stderr(), "{errors}\n{} error(s)", errors.len())?;
            Ok(ExitCode::from(2))
        }
    }
}
