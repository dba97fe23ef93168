//! `cargo xtask deps`: the crate graph against the allow-list.
//!
//! It reads `cargo metadata --no-deps` and nothing else.

use std::path::Path;
use std::process::Command;

/// Allowed edges between workspace crates, for every kind of dependency (normal, dev,
/// build). Editing this list is an architecture change: update ARCHITECTURE.md in the same
/// pull request.
const ALLOWED_DEPS: &[(&str, &[&str])] = &[
    ("tether-state", &[]),
    ("tether-manager", &["tether-state"]),
    ("tether-proxy-daemon", &["tether-state", "tether-manager"]),
    ("tether-agent", &["tether-state", "tether-manager", "tether-proxy-daemon"]),
    ("tether-test-proxy", &[]),
    ("xtask", &[]),
];

/// Allowed edges that must stay optional, so that the first crate builds without the
/// second: the supervisor is reusable without the engine.
const OPTIONAL_DEPS: &[(&str, &str)] = &[("tether-proxy-daemon", "tether-manager")];

/// Crates that make or read keys and certificates, and the one member that may depend on them
/// directly: the library crates carry a key as a value and never sign (ARCHITECTURE.md).
const CRYPTO_CRATES: &[&str] = &["rcgen", "x509-parser", "ring", "rustls", "tokio-rustls", "openssl"];
const CRYPTO_OWNER: &str = "tether-agent";

/// The workspace's own metadata (`cargo metadata --no-deps`).
pub(crate) fn metadata(cargo: &str, root: &Path) -> Result<serde_json::Value, String> {
    let output = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .output()
        .map_err(|err| format!("cannot run cargo metadata: {err}"))?;
    if !output.status.success() {
        return Err(format!("cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr)));
    }
    serde_json::from_slice(&output.stdout).map_err(|err| format!("cargo metadata printed invalid JSON: {err}"))
}

/// Every edge that is not allowed, and every member missing from the list.
pub(crate) fn check(cargo: &str, root: &Path) -> Result<Vec<String>, String> {
    let metadata = metadata(cargo, root)?;
    let packages = metadata["packages"].as_array().ok_or("cargo metadata has no packages")?;
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut problems = Vec::new();
    for package in packages {
        let name = package["name"].as_str().unwrap_or("?");
        let Some((_, allowed)) = ALLOWED_DEPS.iter().find(|(member, _)| *member == name) else {
            problems.push(format!("{name}: workspace member missing from the allow-list in xtask/src/deps.rs"));
            continue;
        };
        for dependency in package["dependencies"].as_array().into_iter().flatten() {
            let Some(target) = dependency["name"].as_str() else { continue };
            let kind = dependency["kind"].as_str().unwrap_or("normal");
            // A crate's tests may use the crate itself with a feature on (its mocks, as a
            // downstream crate would): no edge between two crates.
            if target == name && kind == "dev" {
                continue;
            }
            if CRYPTO_CRATES.contains(&target) && name != CRYPTO_OWNER {
                problems.push(format!(
                    "{name} -> {target} ({kind}): only {CRYPTO_OWNER} performs cryptography; see ARCHITECTURE.md"
                ));
            }
            if members.contains(&target) && !allowed.contains(&target) {
                problems.push(format!("{name} -> {target} ({kind}): not an allowed edge; see ARCHITECTURE.md"));
            }
            let must_be_optional = OPTIONAL_DEPS.contains(&(name, target)) && kind == "normal";
            if must_be_optional && dependency["optional"].as_bool() != Some(true) {
                problems.push(format!("{name} -> {target}: must be an optional dependency; see ARCHITECTURE.md"));
            }
        }
    }
    Ok(problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crate_graph_follows_the_allow_list() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let problems = check(&cargo, root).unwrap();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn the_allow_list_points_only_downwards() {
        // Each crate may depend only on crates listed before it: the graph has no cycle.
        for (index, (name, allowed)) in ALLOWED_DEPS.iter().enumerate() {
            for target in *allowed {
                let position = ALLOWED_DEPS.iter().position(|(member, _)| member == target);
                assert!(position.is_some_and(|p| p < index), "{name} -> {target}");
            }
        }
    }
}
