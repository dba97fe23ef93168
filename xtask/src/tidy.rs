//! `cargo xtask tidy`: house rules that the compiler does not check (with `floors`, the
//! import floors of the binary).
//!
//! It only reads source files (and asks `git` which files are tracked); it never edits them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The crates whose sources are checked: the workspace's members, and `downstream`, which
/// uses them from outside the workspace.
const CRATES: &[&str] = &["state", "manager", "proxy-daemon", "agent-bin", "test-proxy", "xtask", "downstream"];

/// The one module allowed to create processes in production code: every spawn goes through
/// it, so that process groups, descriptors and cgroups are handled in one place.
const SPAWN_MODULE: &str = "proxy-daemon/src/spawn.rs";

/// A line that may name a process API for a reviewed reason carries this marker.
const SPAWN_ALLOW: &str = "tidy: allow(spawn)";

/// Words that name a document kept outside the repository when written in capitals: the
/// repository stands alone, so its docs, rustdoc and comments state a rule themselves, or
/// point at a file that is here (`docs/reference.md`, `ARCHITECTURE.md`, a module).
/// Spelled in pieces, so that this file does not report itself.
const OUTSIDE_DOCUMENTS: &[&str] = &[concat!("SP", "EC"), concat!("STY", "LE")];

/// A path that leaves the repository for a sibling folder of shared documents.
const OUTSIDE_PATH: &str = concat!("../sha", "red/");

/// The section sign: followed by a number, it points into a numbered document, and none of
/// the repository's documents is numbered so.
const SECTION_SIGN: char = '\u{a7}';

/// Every problem found, one line each, naming file and line.
pub(crate) fn check(root: &Path) -> Result<Vec<String>, String> {
    let mut problems = Vec::new();
    check_references(root, &mut problems)?;
    problems.extend(crate::floors::check(root)?);
    for krate in CRATES {
        let dir = root.join(krate);
        if !dir.is_dir() {
            problems.push(format!("{krate}/: missing crate"));
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
    // The tools of the house (xtask, the tests' stand-in proxy) and binaries are not the product.
    let production = in_src
        && !relative.starts_with("xtask/")
        && !relative.starts_with("test-proxy/")
        && !relative.contains("/src/bin/");
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

/// Reports every line of every tracked text file that refers to a document outside the
/// repository.
fn check_references(root: &Path, problems: &mut Vec<String>) -> Result<(), String> {
    let files = tracked_files(root)?;
    let names: Vec<String> = files.iter().filter_map(|file| file.rsplit('/').next()).map(str::to_lowercase).collect();
    for file in &files {
        // Deleted but not yet committed, binary, or not UTF-8: nothing a reader follows.
        let Ok(text) = fs::read_to_string(root.join(file)) else { continue };
        if text.contains('\0') {
            continue;
        }
        for (index, line) in text.lines().enumerate() {
            if let Some(found) = outside_reference(line, &names) {
                problems.push(format!(
                    "{file}:{}: refers to a document outside the repository ({found}): state the rule here, \
                     or point at docs/reference.md, ARCHITECTURE.md or a module",
                    index + 1
                ));
            }
        }
    }
    Ok(())
}

/// What in `line` refers to a document outside the repository, if anything. `tracked` holds
/// the lowercase names of the repository's files: a document of that name is here.
fn outside_reference(line: &str, tracked: &[String]) -> Option<String> {
    for word in OUTSIDE_DOCUMENTS {
        if let Some(at) = find_word(line, word) {
            let rest = &line[at..];
            let end =
                rest.find(|c: char| c.is_whitespace() || matches!(c, ')' | ',' | ';' | '`')).unwrap_or(rest.len());
            return Some(format!("`{}`", &rest[..end]));
        }
        // ASCII lowercase keeps byte offsets, so `at` indexes `line` too.
        let file = format!("{}.md", word.to_ascii_lowercase());
        let lower = line.to_ascii_lowercase();
        if let Some(at) = find_word(&lower, &file).filter(|_| !tracked.contains(&file)) {
            return Some(format!("`{}`", &line[at..at + file.len()]));
        }
    }
    if line.contains(OUTSIDE_PATH) {
        return Some(format!("`{OUTSIDE_PATH}`"));
    }
    let numbered = line
        .match_indices(SECTION_SIGN)
        .any(|(at, sign)| line[at + sign.len()..].trim_start().starts_with(|c: char| c.is_ascii_digit()));
    if numbered {
        return Some("a section number".to_owned());
    }
    None
}

/// Where `word` first appears in `text` as a word of its own: not inside a longer name such
/// as `ProcessSpec`, `SPECS` or `MAX_SPEC`.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(found) = text[from..].find(word) {
        let at = from + found;
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        if !before.is_some_and(is_name) && !after.is_some_and(is_name) {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// The repository's files, relative to `root`, with `/` separators: those `git` tracks, and
/// new ones it does not ignore; without `git`, every file below `root` but `target/` and
/// `.git`.
fn tracked_files(root: &Path) -> Result<Vec<String>, String> {
    let listed = Command::new("git")
        .args(["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
        .current_dir(root)
        .output();
    if let Some(output) = listed.ok().filter(|output| output.status.success()) {
        let text = String::from_utf8_lossy(&output.stdout);
        let mut files: Vec<String> = text.split('\0').filter(|name| !name.is_empty()).map(str::to_owned).collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let mut files = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = fs::read_dir(&dir).map_err(|err| format!("{}: {err}", dir.display()))?;
        for entry in entries {
            let entry = entry.map_err(|err| format!("{}: {err}", dir.display()))?;
            let path = entry.path();
            if path.is_dir() {
                if entry.file_name() != "target" && entry.file_name() != ".git" {
                    pending.push(path);
                }
            } else if let Ok(relative) = path.strip_prefix(root) {
                files.push(relative.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    files.sort();
    Ok(files)
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

    /// What [`outside_reference`] finds in `line`, in a repository of `files`.
    fn reference(line: &str, files: &[&str]) -> Option<String> {
        let names: Vec<String> =
            files.iter().filter_map(|file| file.rsplit('/').next()).map(str::to_lowercase).collect();
        outside_reference(line, &names)
    }

    #[test]
    fn references_to_documents_outside_the_repository_are_reported() {
        // Spelled in pieces, as in the constants above, so that this file passes its own check.
        let caught = [
            concat!("/// see SP", "EC \u{a7}", "3"),
            concat!("(STY", "LE.md \u{a7}", "12)"),
            concat!("as SP", "EC's defaults say"),
            concat!("the rule of `SP", "EC.md`"),
            concat!("read ../sha", "red/notes first"),
            concat!("see spe", "c.md"),
            concat!("section \u{a7}", "4 of the guide"),
        ];
        for line in caught {
            assert!(reference(line, &[]).is_some(), "not caught: {line}");
        }
        assert_eq!(reference(concat!("see SP", "EC \u{a7}", "3"), &[]).as_deref(), Some(concat!("`SP", "EC`")));
        assert_eq!(reference(concat!("(STY", "LE.md \u{a7}", "12)"), &[]).as_deref(), Some(concat!("`STY", "LE.md`")));
    }

    #[test]
    fn names_that_merely_contain_the_words_pass() {
        let fine = [
            "let spec = ProcessSpec::new(name, program, &data);",
            "/// The spec a proxy runs with; see `docs/reference.md`.",
            "const MAX_SPECS: usize = 4; const SPEC_VERSION: u32 = 1;",
            "<style>body { color: black }</style>",
            "Specification of the socket-activation protocol.",
            "../other/file.rs and shared/ alone",
            "\u{a7} alone, and a price of 3 \u{a7}",
        ];
        for line in fine {
            assert_eq!(reference(line, &[]), None, "{line}");
        }
        let here = concat!("see spe", "c.md");
        assert_eq!(reference(here, &[concat!("docs/spe", "c.md")]), None, "a file of the repository is here");
    }

    #[test]
    fn a_reference_is_reported_with_its_file_and_line() {
        let root = std::env::temp_dir().join(format!("xtask-tidy-{}", std::process::id()));
        fs::create_dir_all(root.join("docs")).unwrap();
        fs::write(root.join("docs/a.md"), concat!("# A\n\nThe rule is in SP", "EC.md.\n")).unwrap();
        fs::write(root.join("docs/b.md"), "# B\n\nThe rule is stated here.\n").unwrap();
        let mut problems = Vec::new();
        let checked = check_references(&root, &mut problems);
        fs::remove_dir_all(&root).unwrap();
        checked.unwrap();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("docs/a.md:3: "), "{problems:?}");
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
