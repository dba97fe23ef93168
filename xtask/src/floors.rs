//! The floors of the `tether` binary: which of its modules may import which, checked by
//! reading `use crate::…` and `super::…` paths (part of `cargo xtask tidy`).
//!
//! Two rules, both from ARCHITECTURE.md ("Invariants"):
//!
//! - a top-level module imports only modules on a floor below its own ([`FLOORS`]), so that
//!   no circle runs between the binary's folders and a new module must be given a floor;
//! - inside a folder, its files import one another without a circle. `mod.rs` is the
//!   folder's face: it declares and wires its children, and they may use its own items, so
//!   it is not one of the files compared.
//!
//! Comment lines and each file's `#[cfg(test)]` module are not read: a test may reach
//! anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// The binary's source folder.
const BINARY: &str = "agent-bin/src";

/// The binary's top-level modules, lowest floor first. A module imports only from floors
/// below its own. Editing this list is an architecture change: update ARCHITECTURE.md too.
pub(crate) const FLOORS: &[&[&str]] = &[
    // Leaves: they import no other module of the binary.
    &["cli", "client", "error", "metrics"],
    // etcd's room: the client, its options and the records written there.
    &["etcd"],
    // The certificate authority's providers.
    &["connect"],
    &["catalog"],
    &["fleet"],
    &["templates"],
    // The xDS server: Envoy's config from the catalog and the templates' instances.
    &["xds"],
    &["api"],
    // The entry points of the commands, and the wiring of the agent.
    &["agent", "commands", "connect_proxy", "intention", "logging", "validate"],
    &["main"],
];

/// Every violation of the floors in the binary, one line each.
pub(crate) fn check(root: &Path) -> Result<Vec<String>, String> {
    let src = root.join(BINARY);
    let mut files = BTreeMap::new();
    collect(&src, &src, &mut files)?;
    Ok(problems(&files))
}

fn collect(src: &Path, dir: &Path, files: &mut BTreeMap<String, String>) -> Result<(), String> {
    let entries = fs::read_dir(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|err| format!("{}: {err}", dir.display()))?.path();
        if path.is_dir() {
            collect(src, &path, files)?;
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            let text = fs::read_to_string(&path).map_err(|err| format!("{}: {err}", path.display()))?;
            let relative = path.strip_prefix(src).unwrap_or(&path).to_string_lossy().into_owned();
            files.insert(relative, text);
        }
    }
    Ok(())
}

/// The module path of a file relative to the source folder: `fleet/mod.rs` is `[fleet]`,
/// `fleet/cli.rs` `[fleet, cli]`, `main.rs` `[]`.
fn module_path(relative: &str) -> Vec<String> {
    let without = relative.strip_suffix(".rs").unwrap_or(relative);
    let mut parts: Vec<String> = without.split('/').map(str::to_owned).collect();
    if parts.last().is_some_and(|last| last == "mod" || last == "main") {
        parts.pop();
    }
    parts
}

/// The problems of `files` (path relative to the source folder, text).
fn problems(files: &BTreeMap<String, String>) -> Vec<String> {
    let floor_of = |module: &str| FLOORS.iter().position(|floor| floor.contains(&module));
    let top_level: BTreeSet<String> =
        files.keys().filter_map(|relative| module_path(relative).first().cloned()).collect();
    let mut problems = Vec::new();
    for module in &top_level {
        if floor_of(module).is_none() {
            problems
                .push(format!("{BINARY}/{module}: a top-level module of the binary without a floor (xtask floors.rs)"));
        }
    }
    // Edges between the children of each folder, for the circle check.
    let mut inner: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
    for (relative, text) in files {
        let path = module_path(relative);
        let from = path.first().map_or("main", String::as_str);
        let siblings: BTreeSet<String> = match path.first() {
            Some(folder) => files
                .keys()
                .map(|other| module_path(other))
                .filter(|other| other.len() == 2 && other[0] == *folder)
                .map(|other| other[1].clone())
                .collect(),
            None => BTreeSet::new(),
        };
        // A folder's `mod.rs` (and the crate root) name their children without a prefix.
        let children = match (relative.ends_with("mod.rs"), path.is_empty()) {
            (_, true) => top_level.clone(),
            (true, false) => siblings.clone(),
            (false, false) => BTreeSet::new(),
        };
        for (line_number, target) in imports(text, &path, &children) {
            // A name that is no module is an item of the crate root.
            let to = target.first().filter(|to| top_level.contains(*to)).map_or("main", String::as_str);
            if to != from {
                let allowed = match (floor_of(from), floor_of(to)) {
                    // The crate root's items (`main`) are above everything.
                    (Some(mine), Some(theirs)) => theirs < mine,
                    _ => true, // reported above
                };
                if !allowed {
                    problems.push(format!(
                        "{BINARY}/{relative}:{line_number}: `{from}` imports `{to}`, which is not on a floor below it (xtask floors.rs)"
                    ));
                }
                continue;
            }
            // Inside one folder: the child named, or the folder's `mod.rs`.
            if path.len() < 2 && target.len() < 2 {
                continue;
            }
            let node = |path: &[String]| match path.get(1) {
                Some(child) if siblings.contains(child) => child.clone(),
                _ => "mod".to_owned(),
            };
            let (a, b) = (node(&path), node(&target));
            if a != b && a != "mod" && b != "mod" {
                inner.entry(from.to_owned()).or_default().insert((a, b));
            }
        }
    }
    for (folder, edges) in &inner {
        if let Some(circle) = find_circle(edges) {
            problems
                .push(format!("{BINARY}/{folder}/: its files import one another in a circle: {}", circle.join(" -> ")));
        }
    }
    problems
}

/// The absolute module paths that `text` (of the module at `path`, whose child modules are
/// `children`) imports, with their line
/// numbers, outside comments and its test module.
fn imports(text: &str, path: &[String], children: &BTreeSet<String>) -> Vec<(usize, Vec<String>)> {
    let mut found = Vec::new();
    // Inline modules (`mod name { … }`): their names, and the brace depth they opened at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0_usize;
    let mut lines = text.lines().enumerate().peekable();
    while let Some((index, line)) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        if trimmed.starts_with("#[cfg(test)]")
            && lines.peek().is_some_and(|(_, next)| next.trim_start().starts_with("mod "))
        {
            break;
        }
        let declared = trimmed.strip_prefix("pub(super) ").or(trimmed.strip_prefix("pub(crate) ")).unwrap_or(trimmed);
        if let Some(name) = declared.strip_prefix("mod ").and_then(|rest| rest.strip_suffix(" {")) {
            inline.push((name.to_owned(), depth));
        }
        let here: Vec<String> = path.iter().cloned().chain(inline.iter().map(|(name, _)| name.clone())).collect();
        let path = here.as_slice();
        depth = (depth + line.matches('{').count()).saturating_sub(line.matches('}').count());
        inline.retain(|(_, opened)| *opened < depth);
        for (start, _) in line.match_indices("crate::") {
            let before = line[..start].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue; // `tether_crate::`, not ours
            }
            for rest in paths_after(&line[start + "crate::".len()..]) {
                found.push((index + 1, rest));
            }
        }
        for (start, _) in line.match_indices("super::") {
            let before = line[..start].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue; // the second `super::` of a chain, read with the first
            }
            let mut base: Vec<String> = path.to_vec();
            let mut rest = &line[start..];
            while let Some(after) = rest.strip_prefix("super::") {
                base.pop();
                rest = after;
            }
            for tail in paths_after(rest) {
                let mut full = base.clone();
                full.extend(tail);
                found.push((index + 1, full));
            }
        }
        // A directory module names its children without a prefix.
        for child in children {
            let needle = format!("{child}::");
            for (start, _) in line.match_indices(&needle) {
                let before = line[..start].chars().next_back();
                if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    let mut full = path.to_vec();
                    full.push(child.clone());
                    found.push((index + 1, full));
                }
            }
        }
    }
    found
}

/// The module-path segments that follow a `crate::` or `super::`: one path, or each of a
/// `{…}` group's (only the segments up to the item matter: at most two).
fn paths_after(rest: &str) -> Vec<Vec<String>> {
    let ident = |text: &str| -> String { text.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    if let Some(group) = rest.strip_prefix('{') {
        let end = group.find('}').unwrap_or(group.len());
        return group[..end]
            .split(',')
            .map(str::trim)
            .filter(|part| !part.is_empty() && *part != "self")
            .map(|part| part.split("::").take(2).map(ident).filter(|s| !s.is_empty()).collect())
            .filter(|segments: &Vec<String>| !segments.is_empty())
            .collect();
    }
    let mut segments = Vec::new();
    let mut text = rest;
    while segments.len() < 2 {
        let first = ident(text);
        if first.is_empty() {
            break;
        }
        text = &text[first.len()..];
        segments.push(first);
        match text.strip_prefix("::") {
            Some(after) if !after.starts_with('{') => text = after,
            _ => break,
        }
    }
    if segments.is_empty() { Vec::new() } else { vec![segments] }
}

/// A circle among `edges`, as the nodes along it, if there is one.
fn find_circle(edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges {
        next.entry(from).or_default().push(to);
    }
    fn visit<'a>(
        node: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|on| *on == node) {
            let mut circle: Vec<String> = stack[at..].iter().map(|s| (*s).to_owned()).collect();
            circle.push(node.to_owned());
            return Some(circle);
        }
        if !done.insert(node) {
            return None;
        }
        stack.push(node);
        for to in next.get(node).into_iter().flatten() {
            if let Some(circle) = visit(to, next, stack, done) {
                return Some(circle);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    for node in next.keys() {
        let mut stack = Vec::new();
        if let Some(circle) = visit(node, &next, &mut stack, &mut done) {
            return Some(circle);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems_of(files: &[(&str, &str)]) -> Vec<String> {
        problems(&files.iter().map(|(path, text)| ((*path).to_owned(), (*text).to_owned())).collect())
    }

    #[test]
    fn an_import_from_a_higher_floor_is_reported() {
        let problems = problems_of(&[
            ("fleet/mod.rs", "//! x\nuse crate::api::dto::rfc3339;\n"),
            ("api/mod.rs", "//! x\nuse crate::fleet::follow::SharedStatus;\n"),
        ]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("fleet/mod.rs:2: `fleet` imports `api`"), "{problems:?}");
    }

    #[test]
    fn grouped_imports_and_the_crate_roots_own_paths_count() {
        let problems = problems_of(&[
            ("fleet/mod.rs", "//! x\nuse crate::{error::UsageError, api::dto};\n"),
            ("error.rs", "//! x\n"),
            ("main.rs", "//! x\nfn main() { api::run() }\n"),
            ("api/mod.rs", "//! x\nuse super::{cli, fleet::Layout};\n"),
            ("cli.rs", "//! x\n"),
        ]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("fleet/mod.rs:2: `fleet` imports `api`"), "{problems:?}");
        let problems = problems_of(&[("cli.rs", "//! x\nfn f() { crate::main_helper() }\n"), ("main.rs", "//! x\n")]);
        assert_eq!(problems.len(), 1, "{problems:?}");
    }

    #[test]
    fn a_circle_between_the_files_of_a_folder_is_reported() {
        let files = [
            ("fleet/mod.rs", "//! x\npub(crate) mod cli;\npub(crate) mod status;\n"),
            ("fleet/cli.rs", "//! x\nfn run() { super::status::run() }\n"),
            (
                "fleet/status.rs",
                "//! x\nuse super::cli::etcd_failure;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
            ),
        ];
        let problems = problems_of(&files);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("cli -> status -> cli"), "{problems:?}");
        // The same helper in `mod.rs`: no circle.
        let files = [
            ("fleet/mod.rs", "//! x\npub(crate) mod cli;\npub(crate) mod status;\npub(crate) fn etcd_failure() {}\n"),
            ("fleet/cli.rs", "//! x\nfn run() { super::status::run() }\n"),
            ("fleet/status.rs", "//! x\nuse super::etcd_failure;\n"),
        ];
        assert_eq!(problems_of(&files), Vec::<String>::new());
    }

    #[test]
    fn a_module_without_a_floor_is_reported() {
        let problems = problems_of(&[("shiny.rs", "//! x\n")]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("shiny"), "{problems:?}");
    }
}
