//! `tether validate` and the CLI's usage errors.

use assert_cmd::prelude::*;
use predicates::prelude::*;

use crate::support::{Dirs, tether};

#[test]
fn valid_config_dirs_exit_zero_with_a_summary() {
    let dirs = Dirs::new();
    dirs.write_config("web.toml", "[[service]]\nname = \"web\"\n[service.proxy]\n[[service]]\nname = \"db\"\n");
    tether()
        .arg("validate")
        .arg(&dirs.config)
        .assert()
        .code(0)
        .stdout(predicate::str::contains("valid: 2 service(s), 1 with a managed proxy"));
}

#[test]
fn unknown_config_key_is_a_usage_error_naming_file_line_and_field() {
    let dirs = Dirs::new();
    dirs.write_config("web.toml", "[sevice]\nname = \"web\"\n");
    let file = dirs.config.join("web.toml");
    tether()
        .arg("validate")
        .arg(&dirs.config)
        .assert()
        .code(2)
        .stderr(predicate::str::contains(format!("{}:1:2: field `sevice`: unknown field `sevice`", file.display())));
}

#[test]
fn every_error_of_every_dir_is_reported() {
    let one = Dirs::new();
    let two = Dirs::new();
    one.write_config("a.toml", "[[service]]\nname = \"web\"\n[service.proxy]\nkill_timeout = \"5x\"\n");
    two.write_config("b.json", "{\"service\": [{\"name\": \"db\", \"port\": 99999}]}");
    tether()
        .arg("validate")
        .arg(&one.config)
        .arg(&two.config)
        .assert()
        .code(2)
        .stderr(predicate::str::contains("a.toml:4:16: field `service[0].proxy.kill_timeout`"))
        .stderr(predicate::str::contains("b.json:1:41: field `service[0].port`"))
        .stderr(predicate::str::contains("2 error(s)"));
}

#[test]
fn errors_are_listed_one_a_line_in_the_order_the_files_were_read() {
    let one = Dirs::new();
    let two = Dirs::new();
    one.write_config("z.toml", "[[service]]\nname = \"web\"\n");
    two.write_config("a.toml", "[[service]]\nname = \"web\"\n");
    two.write_config("b.toml", "[[service]]\nname = \"db\"\nprot = 1\n");
    let output = tether().arg("validate").arg(&one.config).arg(&two.config).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8(output.stderr).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    let (first, second, broken) = (one.config.join("z.toml"), two.config.join("a.toml"), two.config.join("b.toml"));
    assert_eq!(lines.len(), 3, "{stderr}");
    // The id is reported where it is defined again, though that file sorts first.
    assert_eq!(
        lines[0],
        format!("{}:1:1: duplicate service id `web`: already defined at {}:1:1", second.display(), first.display())
    );
    assert!(lines[1].starts_with(&format!("{}:3:1: field `service[0].prot`: ", broken.display())), "{stderr}");
    assert_eq!(lines[2], "2 error(s)");
}

#[test]
fn cli_commands_without_an_agent_fail_with_exit_one_and_say_why() {
    let dirs = Dirs::new();
    tether()
        .args(["status", "--data-dir"])
        .arg(&dirs.data)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("cannot reach the agent at"))
        .stderr(predicate::str::contains("is `tether agent` running with this --data-dir?"));
}

#[test]
fn bad_arguments_are_usage_errors() {
    tether().args(["status", "--bogus"]).assert().code(2);
    let dirs = Dirs::new();
    tether()
        .args(["deregister", "../etc", "--data-dir"])
        .arg(&dirs.data)
        .assert()
        .code(2)
        .stderr(predicate::str::contains("invalid service id \"../etc\""));
    tether()
        .args(["register", "/nonexistent/services.toml", "--data-dir"])
        .arg(&dirs.data)
        .assert()
        .code(2)
        .stderr(predicate::str::contains("/nonexistent/services.toml: cannot read"));
}

#[test]
fn connect_proxy_outside_an_agent_explains_itself() {
    tether()
        .arg("connect-proxy")
        .assert()
        .code(2)
        .stderr(predicate::str::contains("TETHER_PROXY_ID is not set: connect-proxy is started by the agent"));
}

#[test]
fn help_lists_every_command() {
    let assert = tether().arg("--help").assert().code(0);
    let out = String::from_utf8(assert.get_output().stdout.clone()).unwrap();
    for command in [
        "agent",
        "status",
        "register",
        "deregister",
        "leave",
        "logs",
        "reload",
        "events",
        "restart",
        "validate",
        "intention",
        "connect-proxy",
    ] {
        assert!(out.contains(command), "{command} missing from:\n{out}");
    }
}

#[test]
fn a_program_not_installed_is_a_warning_that_names_it_and_the_path_searched() {
    let dirs = Dirs::new();
    dirs.write_config(
        "web.toml",
        "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"1\"]\n\
         [[service]]\nname = \"api\"\n[service.proxy]\ncommand = [\"definitely-not-installed-xyz\", \"-v\"]\n\
         [[service]]\nname = \"db\"\n[service.proxy]\ncommand = [\"sh\"]\nenv = { PATH = \"/opt/db/bin\" }\n",
    );
    let file = dirs.config.join("web.toml");
    let assert = tether()
        .arg("validate")
        .arg(&dirs.config)
        // The PATH that `validate` runs with is the one searched, unless `env` sets one.
        .env("PATH", "/nonexistent/a:/bin:/usr/bin")
        .assert()
        .code(0)
        .stdout(predicate::str::contains("valid: 3 service(s), 3 with a managed proxy"));
    let stderr = String::from_utf8(assert.get_output().stderr.clone()).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines,
        [
            format!(
                "warning: {}: field `service[1].proxy.command`: program `definitely-not-installed-xyz` not found in \
                 PATH `/nonexistent/a:/bin:/usr/bin`; the proxy cannot start until it is installed",
                file.display()
            ),
            format!(
                "warning: {}: field `service[2].proxy.command`: program `sh` not found in PATH `/opt/db/bin`; the \
                 proxy cannot start until it is installed",
                file.display()
            ),
        ],
        "{stderr}"
    );
}

#[test]
fn a_relative_program_path_is_a_config_error_naming_file_line_and_field() {
    let dirs = Dirs::new();
    dirs.write_config("web.toml", "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"bin/envoy\", \"-c\"]\n");
    let file = dirs.config.join("web.toml");
    tether().arg("validate").arg(&dirs.config).assert().code(2).stderr(predicate::str::contains(format!(
        "{}:4:11: field `service[0].proxy.command`: program \"bin/envoy\" is a relative path: give an absolute path, \
         or a bare name (no `/`) to look up in PATH",
        file.display()
    )));
}

#[test]
fn epoch_keys_and_placeholders_beside_another_update_are_config_errors_naming_file_and_field() {
    let dirs = Dirs::new();
    dirs.write_config(
        "a.toml",
        "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"envoy\"]\ndrain_timeout = \"1m\"\n",
    );
    dirs.write_config(
        "b.toml",
        "[[service]]\nname = \"api\"\n[service.proxy]\nupdate = \"overlap\"\ncommand = [\"envoy\", \"--base-id\", \"{base_id}\"]\n",
    );
    dirs.write_config(
        "c.toml",
        "[[service]]\nname = \"db\"\n[service.proxy]\nupdate = \"epoch\"\nmax_generations = 1\n",
    );
    let file = |name: &str| dirs.config.join(name).display().to_string();
    tether()
        .arg("validate")
        .arg(&dirs.config)
        .assert()
        .code(2)
        .stderr(predicate::str::contains(format!(
            "{}:1:1: field `service[0]`: `proxy.drain_timeout` applies to update = \"epoch\" only, and this proxy's \
             update is \"restart\"",
            file("a.toml")
        )))
        .stderr(predicate::str::contains(format!(
            "{}:1:1: field `service[0]`: `proxy.command` holds {{base_id}}, which only update = \"epoch\" replaces",
            file("b.toml")
        )))
        .stderr(predicate::str::contains(format!(
            "{}:5:19: field `service[0].proxy.max_generations`: max_generations 1 is too few",
            file("c.toml")
        )))
        .stderr(predicate::str::contains("3 error(s)"));

    let valid = Dirs::new();
    valid.write_config(
        "edge.toml",
        "[[service]]\nname = \"edge\"\n[service.proxy]\nupdate = \"epoch\"\ndrain_timeout = \"2m\"\nmax_generations = 2\n\
         command = [\"/bin/true\", \"--restart-epoch\", \"{restart_epoch}\", \"--base-id\", \"{base_id}\"]\n",
    );
    tether().arg("validate").arg(&valid.config).assert().code(0);
}

#[test]
fn a_journal_that_does_not_listen_is_a_warning_naming_the_proxy_and_the_socket() {
    let dirs = Dirs::new();
    dirs.write_config(
        "web.toml",
        "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"1\"]\nlog_target = \"both\"\n\
         [[service]]\nname = \"api\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"1\"]\n",
    );
    let socket = dirs.temp.path().join("journal.socket");
    let validate = || tether().arg("validate").arg(&dirs.config).arg("--journal-socket").arg(&socket).assert().code(0);
    let assert = validate();
    let stderr = String::from_utf8(assert.get_output().stderr.clone()).unwrap();
    let expected = format!(
        "warning: {}: field `service[0].proxy.log_target`: no journal listens at `{}`",
        dirs.config.join("web.toml").display(),
        socket.display()
    );
    assert!(stderr.starts_with(&expected) && stderr.contains("web-proxy cannot start until one does"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "only the proxy whose output goes to the journal: {stderr}");

    let _journal = std::os::unix::net::UnixDatagram::bind(&socket).unwrap();
    let assert = validate();
    assert!(assert.get_output().stderr.is_empty(), "a journal listens: no warning");
}
