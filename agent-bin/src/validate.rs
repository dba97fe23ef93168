//! `tether validate DIR...`: loads config dirs exactly as the agent would, and reports.
//!
//! It starts nothing and writes nothing.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use tether_state::config::DisplayPath;

use crate::cli::ValidateArgs;

/// Prints every error (exit 2), or a one-line summary (exit 0) after a warning for each
/// program that this host does not have.
pub(crate) fn run(args: &ValidateArgs) -> anyhow::Result<ExitCode> {
    match tether_state::config::load_dirs(&args.dirs) {
        Ok(entries) => {
            let mut stderr = std::io::stderr().lock();
            // Services come file by file, in each file's order: a service's index is its
            // place in its file's `service` list, as errors name it.
            let mut next_index: HashMap<&Path, usize> = HashMap::new();
            for entry in &entries {
                let index = next_index.entry(&entry.file).or_default();
                let field = format!("service[{index}].proxy");
                *index += 1;
                let Some(proxy) = &entry.service.proxy else { continue };
                for missing in tether_proxy_daemon::missing_programs(proxy) {
                    writeln!(
                        stderr,
                        "warning: {}: field `{field}.{}`: {}; the proxy cannot start until it is installed",
                        DisplayPath(&entry.file),
                        missing.field,
                        missing.error
                    )?;
                }
            }
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
