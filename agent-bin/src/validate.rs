//! `tether validate DIR...`: loads config dirs exactly as the agent would, and reports.
//!
//! It starts nothing and writes nothing.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use tether_state::TemplateSource;
use tether_state::config::DisplayPath;

use crate::cli::ValidateArgs;

/// Prints every error (exit 2), or a one-line summary (exit 0) after a warning for each
/// program that this host does not have, and for each proxy whose output goes to a journal
/// that does not listen.
pub(crate) fn run(args: &ValidateArgs) -> anyhow::Result<ExitCode> {
    match tether_state::config::load_dirs(&args.dirs) {
        Ok(loaded) => {
            let entries = loaded.services;
            let mut stderr = std::io::stderr().lock();
            let broken = template_errors(&entries);
            if !broken.is_empty() {
                for error in &broken {
                    writeln!(stderr, "{error}")?;
                }
                writeln!(stderr, "{} error(s)", broken.len())?;
                return Ok(ExitCode::from(2));
            }
            // Services come file by file, in each file's order: a service's index is its
            // place in its file's `service` list, as errors name it.
            let mut next_index: HashMap<&Path, usize> = HashMap::new();
            let journal = tether_proxy_daemon::journal_listens(&args.journal_socket).err();
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
                if let (Some(error), true) = (&journal, proxy.log.output.to_journal()) {
                    writeln!(
                        stderr,
                        "warning: {}: field `{field}.log_target`: no journal listens at `{}` ({error}); {} cannot \
                         start until one does",
                        DisplayPath(&entry.file),
                        args.journal_socket.display(),
                        entry.service.id.proxy_id(),
                    )?;
                }
            }
            let proxies = entries.iter().filter(|e| e.service.proxy.is_some()).count();
            let mut summary = format!("valid: {} service(s), {proxies} with a managed proxy", entries.len());
            let intentions = loaded.connect.intentions().rules().len();
            if intentions > 0 {
                summary.push_str(&format!(", {intentions} intention(s)"));
            }
            if let Some(connect) = loaded.connect.connect() {
                summary.push_str(&format!(", connect in trust domain {}", connect.trust_domain));
            }
            writeln!(std::io::stdout(), "{summary}")?;
            Ok(ExitCode::SUCCESS)
        }
        Err(errors) => {
            writeln!(std::io::stderr(), "{errors}\n{} error(s)", errors.len())?;
            Ok(ExitCode::from(2))
        }
    }
}

/// Every template that does not parse, or whose `source` cannot be read, one line each:
/// the config file and field, the template's destination, and the template's line. The
/// agent would make such a proxy `failed` with the same error at each start.
fn template_errors(entries: &[tether_state::config::ConfigEntry]) -> Vec<String> {
    let mut errors = Vec::new();
    let mut next_index: HashMap<&Path, usize> = HashMap::new();
    for entry in entries {
        let index = next_index.entry(&entry.file).or_default();
        let service_index = *index;
        *index += 1;
        let Some(proxy) = &entry.service.proxy else { continue };
        for (at, template) in proxy.templates.iter().enumerate() {
            let place = format!(
                "{}: field `service[{service_index}].proxy.template[{at}]`: template {}",
                DisplayPath(&entry.file),
                DisplayPath(&template.destination)
            );
            let text = match &template.source {
                TemplateSource::Inline(text) => text.clone(),
                TemplateSource::File(path) => match std::fs::read_to_string(path) {
                    Ok(text) => text,
                    Err(err) => {
                        errors.push(format!("{place}: cannot read its source {}: {err}", DisplayPath(path)));
                        continue;
                    }
                },
            };
            if let Err(err) = crate::templates::check_syntax(&template.destination.to_string_lossy(), &text) {
                errors.push(format!("{place}: {err}"));
            }
        }
    }
    errors
}
