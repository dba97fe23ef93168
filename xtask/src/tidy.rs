//! `cargo xtask tidy`: house rules that the compiler does not check.
//!
//! It only reads source files; it never edits them.

use std::fs;
use std::path::{Path, PathBuf};

/// The crates whose sources are checked.
const CRATES: &[&str] = &["state", "manager", "proxy-daemon", "agent-bin", "xtask"];

/// The one module allowed to create processes in production code: every spawn goes through
/// it, so that process groups, descriptors and cgroups are handled in one place.
const SPAWN_MODULE: &str = "proxy-daemon/src/spawn.rs";

/// A line that may name a process API for a reviewed reason carries this marker.
const SPAWN_ALLOW: &str = "tidy: allow(spawn)";

/// Every problem found, one line each, naming file and line.
pub(crate) fn check(root: &Path) -> Result<Vec<String>, String> {
    let mut problems = Vec::new();
    for krate in CRATES {
        let dir = root.join(krate);
        if !dir.is_dir() {
            problems.push(format!("{krate}/: missing workspace member"));
            continue;
        }
        for file in rust_files(&dir)? {
            let text = fs::read_to_string(&file).map_err(|err| format!("{}: {err}", file.display()))?;
            let relative = file.strip_prefix(root).unwrap_or(&file).to_string_lossy().into_owned();
            check_file(&relative, &text, &mut problems);
        }
    }
    Ok(problems)
}

fn check_file(relative: &str, text: &str, problems: &mut Vec<String>) {
    let in_src = relative.contains("/src/");
    if in_src && !starts_with_module_doc(text) {
        problems.push(format!("{relative}:1: a module starts with a `//!` paragraph saying what it owns"));
    }
    let production = in_src && !relative.starts_with("xtask/") && !relative.contains("/src/bin/");
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        if code.starts_with(concat!("#[should", "_panic")) {
            problems.push(format!("{relative}:{number}: no #[should_panic]: assert on the error with matches!"));
        }
        if code.starts_with(concat!("#[ig", "nore]")) {
            problems.push(format!("{relative}:{number}: #[ignore] needs a reason: #[ignore = \"why\"]"));
        }
        let names_process =
            code.contains(concat!("Command", "::new(")) || code.contains(concat!("process", "::Command"));
        if production && names_process && relative != SPAWN_MODULE && !line.contains(SPAWN_ALLOW) {
            problems.push(format!(
                "{relative}:{number}: processes are spawned only in {SPAWN_MODULE} (or mark a reviewed line `// {SPAWN_ALLOW}`)"
            ));
        }
    }
}

fn starts_with_module_doc(text: &str) -> bool {
    text.lines().map(str::trim).find(|line| !line.is_empty()).is_some_and(|line| line.starts_with("//!"))
}

fn rust_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = fs::read_dir(&dir).map_err(|err| format!("{}: {err}", dir.display()))?;
        for entry in entries {
            let entry = entry.map_err(|err| format!("{}: {err}", dir.display()))?;
            let path = entry.path();
            let name = entry.file_name();
            if path.is_dir() {
                if name != "target" {
                    pending.push(path);
                }
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(relative: &str, text: &str) -> Vec<String> {
        let mut problems = Vec::new();
        check_file(relative, text, &mut problems);
        problems
    }

    #[test]
    fn the_workspace_is_tidy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let problems = check(root).unwrap();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn a_module_without_docs_is_reported() {
        assert_eq!(problems("state/src/a.rs", "use x;\n").len(), 1);
        assert!(problems("state/src/a.rs", "\n//! Owns a.\nuse x;\n").is_empty());
        assert!(problems("state/tests/it/main.rs", "use x;\n").is_empty(), "tests need no module docs");
    }

    #[test]
    fn bare_ignore_and_should_panic_are_reported() {
        let text = concat!(
            "//! Doc.\n#[ig",
            "nore]\nfn a() {}\n#[should",
            "_panic]\nfn b() {}\n#[ignore = \"needs root\"]\nfn c() {}\n"
        );
        let found = problems("state/src/a.rs", text);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("state/src/a.rs:2:"));
        assert!(found[1].starts_with("state/src/a.rs:4:"));
    }

    #[test]
    fn spawning_outside_the_spawn_module_is_reported() {
        let text = concat!("//! Doc.\nlet c = std::process::", "Command", "::new(\"x\");\n");
        assert_eq!(problems("agent-bin/src/main.rs", text).len(), 1);
        assert!(problems("proxy-daemon/src/spawn.rs", text).is_empty());
        assert!(problems("proxy-daemon/tests/it/main.rs", text).is_empty());
        assert!(problems("xtask/src/main.rs", text).is_empty());
        let allowed = concat!("//! Doc.\nlet c = Command", "::new(\"x\"); // tidy: allow(spawn)\n");
        assert!(problems("agent-bin/src/main.rs", allowed).is_empty());
    }
}
