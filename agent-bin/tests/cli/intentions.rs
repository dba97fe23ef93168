//! `[connect]` and `[[intention]]` in config dirs: `tether validate` checks them, and
//! `tether intention check` says what decides a connection, without an agent.

use assert_cmd::prelude::*;
use predicates::prelude::*;

use crate::support::{Dirs, tether};

const MESH: &str = "[connect]\ntrust_domain = \"example.org\"\n[connect.ca]\nprovider = \"dev\"\n";

fn intention(source: &str, destination: &str, action: &str) -> String {
    format!("[[intention]]\nsource = \"{source}\"\ndestination = \"{destination}\"\naction = \"{action}\"\n")
}

fn check(dirs: &Dirs, source: &str, destination: &str) -> assert_cmd::assert::Assert {
    tether().args(["intention", "check", source, destination, "--config-dir"]).arg(&dirs.config).assert()
}

#[test]
fn validate_counts_intentions_and_names_the_trust_domain() {
    let dirs = Dirs::new();
    dirs.write_config(
        "mesh.toml",
        &format!("{MESH}\n{}\n{}", intention("web", "db", "allow"), intention("*", "*", "deny")),
    );
    dirs.write_config("web.toml", "[[service]]\nname = \"web\"\n");
    tether()
        .arg("validate")
        .arg(&dirs.config)
        .assert()
        .code(0)
        .stdout("valid: 1 service(s), 0 with a managed proxy, 2 intention(s), connect in trust domain example.org\n");
}

#[test]
fn validate_refuses_a_bad_trust_domain_with_file_line_and_field() {
    let dirs = Dirs::new();
    dirs.write_config(
        "mesh.toml",
        "[connect]\ntrust_domain = \"example.org:8443\"\n[connect.ca]\nprovider = \"dev\"\n",
    );
    let file = dirs.config.join("mesh.toml");
    tether()
        .arg("validate")
        .arg(&dirs.config)
        .assert()
        .code(2)
        .stderr(predicate::str::contains(format!(
            "{}:2:16: field `connect.trust_domain`: invalid trust domain \"example.org:8443\": it has a port",
            file.display()
        )))
        .stderr(predicate::str::contains("1 error(s)"));
}

#[test]
fn validate_refuses_an_intention_naming_nothing_and_an_unknown_action() {
    let dirs = Dirs::new();
    dirs.write_config("mesh.toml", &format!("{}\n{}", intention("", "db", "allow"), intention("web", "db", "permit")));
    let file = dirs.config.join("mesh.toml");
    tether()
        .arg("validate")
        .arg(&dirs.config)
        .assert()
        .code(2)
        // The first error of a file is its error.
        .stderr(predicate::str::contains(format!(
            "{}:2:10: field `intention[0].source`: invalid service name \"\" in an intention: it is empty",
            file.display()
        )));
}

#[test]
fn validate_refuses_a_second_connect_table_and_a_repeated_intention_naming_both_places() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &format!("{MESH}\n{}", intention("web", "db", "allow")));
    dirs.write_config("b.toml", &format!("{}\n{MESH}", intention("web", "db", "deny")));
    let (a, b) = (dirs.config.join("a.toml"), dirs.config.join("b.toml"));
    let output = tether().arg("validate").arg(&dirs.config).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8(output.stderr).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines,
        [
            format!(
                "{}:6:1: field `connect`: a second [connect] table: the config dirs hold one, and {}:1:1 has it already",
                b.display(),
                a.display()
            ),
            format!(
                "{}:1:1: field `intention[0]`: duplicate intention web -> db: already defined at {}:6:1",
                b.display(),
                a.display()
            ),
            "2 error(s)".to_owned(),
        ],
        "{stderr}"
    );
}

#[test]
fn validate_refuses_unknown_keys_of_connect_ca() {
    let dirs = Dirs::new();
    dirs.write_config("mesh.toml", &format!("{MESH}ca_file = \"/etc/ca.pem\"\n"));
    tether()
        .arg("validate")
        .arg(&dirs.config)
        .assert()
        .code(2)
        .stderr(predicate::str::contains("mesh.toml:5:1: field `connect.ca.ca_file`: unknown field `ca_file`"));
}

#[test]
fn check_allows_by_the_most_precise_intention_and_names_it_with_its_file() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &format!("{MESH}\n{}", intention("*", "db", "deny")));
    dirs.write_config(
        "b.toml",
        &format!("{}description = \"web reads the catalog\"\n", intention("web", "db", "allow")),
    );
    let b = dirs.config.join("b.toml");
    check(&dirs, "web", "db")
        .code(0)
        .stdout(format!("allow: web -> db (intention web -> db in {}: \"web reads the catalog\")\n", b.display()));
}

#[test]
fn check_denies_by_a_wildcard_intention_with_exit_one() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &format!("{}\n{}", intention("*", "db", "deny"), intention("api", "*", "allow")));
    let a = dirs.config.join("a.toml");
    // A wildcard source with an exact destination beats an exact source with a wildcard one.
    check(&dirs, "api", "db").code(1).stdout(format!("deny: api -> db (intention * -> db in {})\n", a.display()));
    check(&dirs, "api", "cache")
        .code(0)
        .stdout(format!("allow: api -> cache (intention api -> * in {})\n", a.display()));
}

#[test]
fn check_says_when_the_default_decides() {
    let dirs = Dirs::new();
    dirs.write_config("i.toml", &intention("web", "db", "allow"));
    check(&dirs, "api", "db").code(1).stdout("deny: api -> db (no intention matches; the default is deny)\n");

    dirs.write_config(
        "mesh.toml",
        "[connect]\ntrust_domain = \"example.org\"\ndefault_intention = \"allow\"\n[connect.ca]\nprovider = \"dev\"\n",
    );
    let mesh = dirs.config.join("mesh.toml");
    check(&dirs, "api", "db").code(0).stdout(format!(
        "allow: api -> db (no intention matches; the default_intention of {} is allow)\n",
        mesh.display()
    ));
}

#[test]
fn check_with_an_invalid_config_prints_every_error_and_exits_two() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &intention("web", "db", "maybe"));
    check(&dirs, "web", "db")
        .code(2)
        .stdout("")
        .stderr(predicate::str::contains("a.toml:4:10: field `intention[0].action`: unknown action \"maybe\""))
        .stderr(predicate::str::contains("1 error(s)"));
}

#[test]
fn check_refuses_a_wildcard_or_an_invalid_name_as_bad_input() {
    let dirs = Dirs::new();
    check(&dirs, "*", "db").code(2).stderr(predicate::str::contains("SRC must name a service"));
    check(&dirs, "web", "").code(2).stderr(predicate::str::contains("DST: invalid service name \"\": it is empty"));
    tether().args(["intention", "check", "web"]).assert().code(2);
}
