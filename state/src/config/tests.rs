//! Tests of config parsing: every error message is part of the UI, and round trips are exact.

use super::*;

fn file() -> Origin {
    Origin::File("conf.d/web.toml".into())
}

#[track_caller]
fn toml_error(text: &str) -> String {
    parse_file(text, Format::Toml, &file()).unwrap_err().to_string()
}

#[track_caller]
fn json_error(text: &str) -> String {
    parse_file(text, Format::Json, &Origin::File("conf.d/web.json".into())).unwrap_err().to_string()
}

#[track_caller]
fn proxy_error(proxy_lines: &str) -> String {
    toml_error(&format!("[[service]]\nname = \"web\"\n[service.proxy]\n{proxy_lines}\n"))
}

#[track_caller]
fn one(text: &str) -> Service {
    let mut services = parse_file(text, Format::Toml, &file()).unwrap();
    assert_eq!(services.len(), 1);
    services.remove(0)
}

#[test]
fn an_empty_proxy_table_gets_every_default() {
    let service = one("[[service]]\nname = \"web\"\n[service.proxy]\n");
    assert_eq!(service.id.as_str(), "web");
    assert_eq!(service.address, "127.0.0.1");
    assert_eq!(service.port, None);
    let spec = service.proxy.unwrap();
    assert_eq!(spec, ProxySpec::default());
    assert_eq!(spec.command, ProxyCommand::BuiltIn);
    assert_eq!(spec.kill, KillPolicy { signal: KillSignal::Int, timeout: Duration::from_secs(5) });
    assert_eq!(spec.restart.free_attempts, 3);
    assert_eq!(spec.restart.max_delay, Duration::from_secs(60));
    assert_eq!(spec.restart.healthy_after, Duration::from_secs(10));
    assert_eq!(spec.log, LogPolicy { max_size: 64 << 20, keep: 5, output: LogOutput::Files });
    assert!(!spec.inherit_env);
}

#[test]
fn every_field_of_the_schema_is_read() {
    let service = one(r#"
[[service]]
name = "web"
id = "web-1"
address = "10.0.0.5"
port = 8080
tags = ["v1", "blue"]
meta = { team = "edge" }

[service.proxy]
exec_mode = "daemon"
command = ["/usr/bin/envoy", "-c", "/etc/envoy/web.yaml"]
working_dir = "/srv/web"
env = { LOG_LEVEL = "info" }
inherit_env = true
user = "nobody"
kill_signal = "SIGTERM"
kill_timeout = "1500ms"
log_max_size = "1MiB"
log_keep = 2
log_target = "both"
config = { bind_port = 21000, upstreams = [{ name = "db" }] }

[service.proxy.restart]
free_attempts = 0
max_delay = "1m"
healthy_after = "30s"
"#);
    assert_eq!(service.id.as_str(), "web-1");
    assert_eq!(service.name.as_str(), "web");
    assert_eq!(service.address, "10.0.0.5");
    assert_eq!(service.port, Some(8080));
    assert_eq!(service.tags, ["v1", "blue"]);
    assert_eq!(service.meta["team"], "edge");
    let spec = service.proxy.unwrap();
    let ProxyCommand::Exec(command) = &spec.command else { panic!("{:?}", spec.command) };
    assert_eq!(command.program(), Path::new("/usr/bin/envoy"));
    assert_eq!(command.args(), ["-c", "/etc/envoy/web.yaml"]);
    assert_eq!(spec.working_dir.as_deref(), Some(Path::new("/srv/web")));
    assert_eq!(spec.env["LOG_LEVEL"], "info");
    assert!(spec.inherit_env);
    assert_eq!(spec.user.as_deref(), Some("nobody"));
    assert_eq!(spec.kill, KillPolicy { signal: KillSignal::Term, timeout: Duration::from_millis(1500) });
    assert_eq!(spec.log, LogPolicy { max_size: 1 << 20, keep: 2, output: LogOutput::Both });
    assert_eq!(spec.config["bind_port"], 21000);
    assert_eq!(spec.config["upstreams"][0]["name"], "db");
    assert_eq!(
        spec.restart,
        RestartPolicy { free_attempts: 0, max_delay: Duration::from_secs(60), healthy_after: Duration::from_secs(30) }
    );
}

#[test]
fn json_files_and_bodies_use_the_same_schema() {
    let text =
        r#"{"service": [{"name": "web", "port": 8080, "proxy": {"kill_signal": "TERM", "config": {"bind_port": 1}}}]}"#;
    let services = parse_file(text, Format::Json, &file()).unwrap();
    assert_eq!(services[0].proxy.as_ref().unwrap().kill.signal, KillSignal::Term);
    let body = parse_service(r#"{"name": "db", "tags": ["a"]}"#, Format::Json, &Origin::Body).unwrap();
    assert_eq!(body.tags, ["a"]);
    assert!(body.proxy.is_none());
}

#[test]
fn a_file_without_services_is_empty_not_an_error() {
    assert!(parse_file("", Format::Toml, &file()).unwrap().is_empty());
    assert!(parse_file("{}", Format::Json, &file()).unwrap().is_empty());
}

#[test]
fn unknown_keys_name_file_line_and_field() {
    assert_eq!(
        toml_error("[[service]]\nname = \"web\"\nprot = 1\n"),
        "conf.d/web.toml:3:1: field `service[0].prot`: unknown field `prot`, expected one of `name`, `id`, `address`, `port`, `tags`, `meta`, `proxy`"
    );
    assert_eq!(
        toml_error("[sevice]\nname = \"web\"\n"),
        "conf.d/web.toml:1:2: field `sevice`: unknown field `sevice`, expected one of `service`, `connect`, `intention`"
    );
    assert!(
        proxy_error("comand = [\"/bin/true\"]")
            .starts_with("conf.d/web.toml:4:1: field `service[0].proxy.comand`: unknown field `comand`")
    );
    assert!(
        toml_error("[[service]]\nname = \"web\"\n[service.proxy.restart]\nmax_delays = \"1s\"\n")
            .starts_with("conf.d/web.toml:4:1: field `service[0].proxy.restart.max_delays`: unknown field")
    );
    assert_eq!(
        json_error("{\"service\": [{\"name\": \"web\", \"prot\": 1}]}"),
        "conf.d/web.json:1:35: field `service[0].prot`: unknown field `prot`, expected one of `name`, `id`, `address`, `port`, `tags`, `meta`, `proxy`"
    );
}

#[test]
fn syntax_errors_name_the_position() {
    assert_eq!(toml_error("[[service]]\nname = \"web\n"), "conf.d/web.toml:2:12: invalid basic string, expected `\"`");
    assert_eq!(json_error("{\"service\": [{\"name\": \"web\"}]} x"), "conf.d/web.json:1:32: trailing characters");
    assert_eq!(json_error("{\"service\": [{\"name\": \"web\""), "conf.d/web.json:1:27: EOF while parsing an object");
}

#[test]
fn missing_name_is_reported_on_its_table() {
    assert_eq!(toml_error("[[service]]\nport = 1\n"), "conf.d/web.toml:1:1: field `service[0]`: missing field `name`");
}

#[test]
fn invalid_ids_and_names_are_refused_with_the_rule() {
    assert_eq!(
        toml_error("[[service]]\nname = \"web\"\nid = \"../x\"\n"),
        "conf.d/web.toml:3:6: field `service[0].id`: invalid service id \"../x\": it must start with a letter or a digit (ids must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$)"
    );
    assert_eq!(
        toml_error("[[service]]\nname = \"web server\"\n"),
        "conf.d/web.toml:1:1: field `service[0]`: no `id` is given, so the name must be a valid id: invalid service id \"web server\": it may only contain letters, digits, `.`, `_` and `-` (ids must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$)"
    );
    // With an explicit id, the name may hold spaces.
    assert_eq!(one("[[service]]\nname = \"web server\"\nid = \"web\"\n").name.as_str(), "web server");
    assert!(
        toml_error("[[service]]\nname = \"\"\nid = \"web\"\n")
            .contains("field `service[0].name`: invalid service name \"\": it is empty")
    );
    assert!(toml_error("[[service]]\nname = \"web\"\nid = \"a/b\"\n").contains("may only contain"));
}

#[test]
fn invalid_service_fields_are_refused() {
    assert_eq!(
        toml_error("[[service]]\nname = \"web\"\nport = 70000\n"),
        "conf.d/web.toml:3:8: field `service[0].port`: invalid value: integer `70000`, expected u16"
    );
    assert!(
        toml_error("[[service]]\nname = \"web\"\naddress = \"\"\n")
            .contains("field `service[0].address`: invalid address \"\"")
    );
    assert!(
        toml_error("[[service]]\nname = \"web\"\naddress = \"a b\"\n").contains("must be a host name or an IP address")
    );
    assert!(
        toml_error("[[service]]\nname = \"web\"\ntags = [\"\"]\n").contains("field `service[0].tags[0]`: invalid tag")
    );
    assert!(toml_error("[[service]]\nname = \"web\"\nmeta = { \"\" = \"x\" }\n").contains("invalid meta key"));
}

#[test]
fn exec_mode_other_than_daemon_is_an_error() {
    assert_eq!(
        proxy_error("exec_mode = \"script\""),
        "conf.d/web.toml:4:13: field `service[0].proxy.exec_mode`: unknown variant `script`, expected `daemon`"
    );
}

#[test]
fn durations_use_humantime_and_say_so() {
    let err = proxy_error("kill_timeout = \"5x\"");
    assert!(
        err.starts_with("conf.d/web.toml:4:16: field `service[0].proxy.kill_timeout`: invalid duration \"5x\""),
        "{err}"
    );
    assert!(err.contains("(examples: \"500ms\", \"5s\", \"1m\")"), "{err}");
    assert_eq!(
        toml_error("[[service]]\nname = \"web\"\n[service.proxy.restart]\nmax_delay = 5\n"),
        "conf.d/web.toml:4:13: field `service[0].proxy.restart.max_delay`: invalid type: integer `5`, expected a string"
    );
    assert!(
        toml_error("[[service]]\nname = \"web\"\n[service.proxy.restart]\nhealthy_after = \"soon\"\n")
            .contains("field `service[0].proxy.restart.healthy_after`: invalid duration \"soon\"")
    );
}

#[test]
fn kill_signal_must_be_a_known_signal() {
    assert_eq!(
        proxy_error("kill_signal = \"SIGSEGV\""),
        "conf.d/web.toml:4:15: field `service[0].proxy.kill_signal`: unknown kill_signal \"SIGSEGV\": expected one of SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2, SIGKILL"
    );
}

#[test]
fn log_target_names_where_output_goes() {
    let output = |value: &str| {
        let service = one(&format!("[[service]]\nname = \"web\"\n[service.proxy]\nlog_target = {value}\n"));
        service.proxy.unwrap().log.output
    };
    assert_eq!(output("\"files\""), LogOutput::Files);
    assert_eq!(output("\"journal\""), LogOutput::Journal);
    assert_eq!(output("\"both\""), LogOutput::Both);
    let error = proxy_error("log_target = \"syslog\"");
    assert!(
        error.starts_with("conf.d/web.toml:4:14: field `service[0].proxy.log_target`: unknown variant `syslog`"),
        "{error}"
    );
}

#[test]
fn log_sizes_take_units_or_bytes() {
    let size = |value: &str| {
        let service = one(&format!("[[service]]\nname = \"web\"\n[service.proxy]\nlog_max_size = {value}\n"));
        service.proxy.unwrap().log.max_size
    };
    assert_eq!(size("\"64MiB\""), 64 << 20);
    assert_eq!(size("\"10MB\""), 10_000_000);
    assert_eq!(size("\"512KiB\""), 512 << 10);
    assert_eq!(size("\"2GiB\""), 2 << 30);
    assert_eq!(size("8192"), 8192);
    assert_eq!(
        proxy_error("log_max_size = \"64XB\""),
        "conf.d/web.toml:4:16: field `service[0].proxy.log_max_size`: invalid size \"64XB\": unknown unit \"XB\" (use B, KB, KiB, MB, MiB, GB or GiB)"
    );
    assert!(proxy_error("log_max_size = 10").contains("below the minimum of 4096"));
    assert!(proxy_error("log_max_size = -1").contains("cannot be negative"));
    assert!(proxy_error("log_max_size = \"99999999999GiB\"").contains("too large"));
    assert!(
        proxy_error("log_keep = 5000")
            .contains("field `service[0].proxy.log_keep`: log_keep 5000 is more than 1000 files")
    );
}

#[test]
fn commands_must_name_a_program() {
    assert_eq!(
        proxy_error("command = []"),
        "conf.d/web.toml:4:11: field `service[0].proxy.command`: command must name a program; leave `command` out for the built-in proxy"
    );
    assert!(proxy_error("command = [\"\"]").contains("must name a program"));
    assert!(proxy_error("command = [\"/bin/sh\", \"a\\u0000b\"]").contains("NUL"));
}

#[test]
fn a_program_is_an_absolute_path_or_a_bare_name_never_a_relative_path() {
    for program in ["/usr/bin/envoy", "envoy", "sleep", ".envoy"] {
        let service =
            one(&format!("[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"{program}\", \"-c\"]\n"));
        let ProxyCommand::Exec(command) = &service.proxy.unwrap().command else { panic!("{program}: not a command") };
        assert_eq!(command.program(), Path::new(program));
    }
    assert_eq!(
        proxy_error("command = [\"bin/envoy\", \"-c\", \"envoy.yaml\"]"),
        "conf.d/web.toml:4:11: field `service[0].proxy.command`: program \"bin/envoy\" is a relative path: give an absolute path, or a bare name (no `/`) to look up in PATH"
    );
    assert!(proxy_error("command = [\"./envoy\"]").contains("program \"./envoy\" is a relative path"));
    let probe = proxy_error("[service.proxy.readiness]\nexec = [\"checks/ready\"]");
    assert!(
        probe.contains("field `service[0].proxy.readiness.exec`: program \"checks/ready\" is a relative path"),
        "{probe}"
    );
}

#[test]
fn working_dir_must_be_absolute() {
    assert!(
        proxy_error("working_dir = \"srv\"")
            .contains("field `service[0].proxy.working_dir`: working_dir \"srv\" must be an absolute path")
    );
}

#[test]
fn env_names_are_checked_and_tether_variables_reserved() {
    assert_eq!(
        proxy_error("env = { TETHER_PROXY_ID = \"x\" }"),
        "conf.d/web.toml:4:9: field `service[0].proxy.env.TETHER_PROXY_ID`: environment variable TETHER_PROXY_ID is reserved: tether sets the TETHER_* variables itself"
    );
    assert!(proxy_error("env = { \"A=B\" = \"x\" }").contains("invalid environment variable name \"A=B\""));
    assert!(proxy_error("env = { \"1A\" = \"x\" }").contains("invalid environment variable name"));
    assert!(proxy_error("env = { A = \"x\\u0000\" }").contains("NUL"));
}

#[test]
fn user_names_are_checked() {
    assert!(proxy_error("user = \"\"").contains("field `service[0].proxy.user`: invalid user \"\""));
    assert!(proxy_error("user = \"a:b\"").contains("invalid user"));
    assert_eq!(
        one("[[service]]\nname = \"web\"\n[service.proxy]\nuser = \"65534\"\n").proxy.unwrap().user.as_deref(),
        Some("65534")
    );
}

#[test]
fn duplicate_ids_in_one_file_name_both_places() {
    assert_eq!(
        toml_error("[[service]]\nname = \"web\"\n\n[[service]]\nname = \"api\"\nid = \"web\"\n"),
        "conf.d/web.toml:4:1: duplicate service id `web`: already defined at conf.d/web.toml:1:1"
    );
    assert_eq!(
        json_error("{\"service\": [{\"name\": \"web\"},\n  {\"name\": \"web\"}]}"),
        "conf.d/web.json:2:3: duplicate service id `web`: already defined at conf.d/web.json:1:14"
    );
}

#[test]
fn register_bodies_refuse_trailing_data_and_lists() {
    let err = parse_service("{\"name\": \"web\"} {}", Format::Json, &Origin::Body).unwrap_err().to_string();
    assert_eq!(err, "request body:1:17: trailing characters");
    let err = parse_service("[]", Format::Json, &Origin::Body).unwrap_err().to_string();
    assert!(err.starts_with("request body:1:"), "{err}");
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let depth = 100_000;
    let json = format!(
        "{{\"service\": [{{\"name\": \"web\", \"proxy\": {{\"config\": {{\"a\": {}{}}}}}}}]}}",
        "[".repeat(depth),
        "]".repeat(depth)
    );
    assert!(parse_file(&json, Format::Json, &file()).is_err());
    let toml = format!(
        "[[service]]\nname = \"web\"\n[service.proxy]\nconfig = {{ a = {}{} }}\n",
        "[".repeat(depth),
        "]".repeat(depth)
    );
    assert!(parse_file(&toml, Format::Toml, &file()).is_err());
}

/// A proxy's `config` that nests `depth` tables, counting `config` itself, in TOML.
fn toml_config_nested(depth: usize) -> String {
    format!(
        "[[service]]\nname = \"web\"\n[service.proxy]\nconfig = {}1{}\n",
        "{ a = ".repeat(depth),
        " }".repeat(depth)
    )
}

/// The same as a register body, with the innermost tables turned into arrays.
fn json_config_nested(depth: usize) -> String {
    let tables = depth / 2;
    let arrays = depth - tables;
    format!(
        "{{\"name\": \"web\", \"proxy\": {{\"config\": {}{}1{}{}}}}}",
        "{\"a\": ".repeat(tables),
        "[".repeat(arrays),
        "]".repeat(arrays),
        "}".repeat(tables)
    )
}

#[test]
fn config_nests_at_most_32_deep_and_the_error_names_the_field() {
    assert_eq!(MAX_CONFIG_DEPTH, 32);
    let config = one(&toml_config_nested(MAX_CONFIG_DEPTH)).proxy.unwrap().config;
    assert_eq!(serde_json::to_string(&config).unwrap().matches('{').count(), MAX_CONFIG_DEPTH);
    let err = toml_error(&toml_config_nested(MAX_CONFIG_DEPTH + 1));
    let field = format!("service[0].proxy.config{}", ".a".repeat(MAX_CONFIG_DEPTH));
    assert!(err.starts_with("conf.d/web.toml:4:"), "{err}");
    assert!(
        err.ends_with(&format!(
            "field `{field}`: `config` nests tables and arrays more than 32 deep (counting `config` itself)"
        )),
        "{err}"
    );

    let body = parse_service(&json_config_nested(MAX_CONFIG_DEPTH), Format::Json, &Origin::Body).unwrap();
    let written = to_service_text(&body, Format::Json).unwrap();
    assert_eq!(parse_service(&written, Format::Json, &Origin::Body).unwrap(), body);
    let err =
        parse_service(&json_config_nested(MAX_CONFIG_DEPTH + 1), Format::Json, &Origin::Body).unwrap_err().to_string();
    let field = format!("proxy.config{}{}", ".a".repeat(16), "[0]".repeat(16));
    assert!(err.starts_with("request body:1:"), "{err}");
    assert!(err.contains(&format!("field `{field}`: `config` nests tables and arrays more than 32 deep")), "{err}");
}

#[test]
fn non_finite_floats_in_config_are_refused_not_turned_into_null() {
    // Found by the `config_toml` fuzz target: `nan` was read as `null`, so the service
    // could not be written back as TOML.
    for value in ["nan", "-nan", "inf", "-inf", "[1.5, inf]", "{ deep = { x = +nan } }"] {
        let err = proxy_error(&format!("config = {{ x = {value} }}"));
        assert!(err.contains("field `service[0].proxy.config.x"), "{value}: {err}");
        assert!(err.contains("cannot be passed to the proxy as JSON"), "{value}: {err}");
    }
    let service = one("[[service]]\nname = \"web\"\n[service.proxy]\nconfig = { x = 0.5, y = [1, \"a\"], z = {} }\n");
    let config = &service.proxy.unwrap().config;
    assert_eq!(serde_json::Value::Object(config.clone()), serde_json::json!({"x": 0.5, "y": [1, "a"], "z": {}}));
    let body = r#"{"name": "web", "proxy": {"config": {"x": null, "y": [null], "z": 1e308}}}"#;
    let service = parse_service(body, Format::Json, &Origin::Body).unwrap();
    assert_eq!(
        serde_json::Value::Object(service.proxy.unwrap().config),
        serde_json::json!({"x": null, "y": [null], "z": 1e308})
    );
    assert!(json_error(r#"{"service": [{"name": "web", "proxy": {"config": [1]}}]}"#).contains("expected a map"));
    assert!(toml_error("[[service]]\nname = \"web\"\n[service.proxy]\nconfig = 1\n").contains("expected a map"));
}

#[test]
fn floats_in_config_read_back_exactly_as_written() {
    // Found by the `config_json` fuzz target: without serde_json's exact float parsing, this
    // integer (too large for u64) read as 1.1111111111111111e21, one unit in the last place
    // low, while its written form read back as 1.1111111111111112e21: a persisted
    // registration changed.
    let text = r#"{"service": [{"name": "web", "proxy": {"config": {"x": 1111111111111111162378}}}]}"#;
    let services = parse_file(text, Format::Json, &file()).unwrap();
    assert_eq!(services[0].proxy.as_ref().unwrap().config["x"].as_f64(), Some(1.111_111_111_111_111_2e21));
    let written = to_file_text(&services, Format::Json).unwrap();
    assert_eq!(parse_file(&written, Format::Json, &file()).unwrap(), services, "{written}");
    let body = to_service_text(&services[0], Format::Json).unwrap();
    assert_eq!(parse_service(&body, Format::Json, &Origin::Body).unwrap(), services[0], "{body}");
}

#[test]
fn health_checks_are_read_with_their_defaults() {
    let text = "[[service]]\nname = \"web\"\n[service.proxy.readiness]\ntcp = \"127.0.0.1:21000\"\n\
                [service.proxy.liveness]\nhttp = \"http://127.0.0.1:19000/ready\"\nfailures = 5\ntimeout = \"3s\"\n";
    let spec = one(text).proxy.unwrap();
    let readiness = spec.readiness.unwrap();
    assert_eq!(readiness.probe, Probe::Tcp(TcpTarget::parse("127.0.0.1:21000").unwrap()));
    assert_eq!((readiness.interval, readiness.timeout), (Duration::from_secs(1), Duration::from_secs(1)));
    let liveness = spec.liveness.unwrap();
    assert_eq!(liveness.probe.to_string(), "http http://127.0.0.1:19000/ready");
    assert_eq!(
        (liveness.interval, liveness.timeout, liveness.failures),
        (Duration::from_secs(10), Duration::from_secs(3), 5)
    );
    for (table, kind) in [
        ("notify = true", "notify"),
        ("exec = [\"/bin/check\", \"-q\"]", "exec"),
        ("log_line = \"listening on .*\"", "log_line"),
        ("fd = 3", "fd"),
    ] {
        let spec = one(&format!("[[service]]\nname = \"web\"\n[service.proxy.readiness]\n{table}\n")).proxy.unwrap();
        assert_eq!(spec.readiness.unwrap().probe.kind(), kind);
    }
}

#[test]
fn bad_health_checks_name_file_line_and_field() {
    let readiness = |lines: &str| proxy_error(&format!("[service.proxy.readiness]\n{lines}"));
    let liveness = |lines: &str| proxy_error(&format!("[service.proxy.liveness]\n{lines}"));
    let two = readiness("tcp = \"127.0.0.1:1\"\nhttp = \"http://127.0.0.1:1/\"");
    assert!(two.starts_with("conf.d/web.toml:"), "{two}");
    assert!(two.contains("field `service[0].proxy.readiness`: 2 probes (tcp, http): give exactly one"), "{two}");
    assert!(readiness("interval = \"1s\"").contains("no probe: give exactly one of"));
    let https = readiness("http = \"https://127.0.0.1/\"");
    assert!(
        https.contains(
            "field `service[0].proxy.readiness.http`: invalid URL \"https://127.0.0.1/\": must start with http://"
        ),
        "{https}"
    );
    let zero = readiness("tcp = \"127.0.0.1:1\"\ninterval = \"0s\"");
    assert!(zero.contains("field `service[0].proxy.readiness.interval`: must be more than zero"), "{zero}");
    assert!(
        readiness("tcp = \"localhost\"")
            .contains("field `service[0].proxy.readiness.tcp`: invalid address \"localhost\": no port")
    );
    assert!(
        readiness("log_line = \"(\"")
            .contains("field `service[0].proxy.readiness.log_line`: invalid regular expression")
    );
    assert!(
        readiness("fd = 1").contains("field `service[0].proxy.readiness.fd`: invalid descriptor 1: must be 3 to 1023")
    );
    assert!(readiness("tcp = \"h:1\"\nfailures = 2").contains("`failures` applies to liveness only"));
    let log = liveness("log_line = \"ready\"");
    assert!(log.contains("field `service[0].proxy.liveness`: a `log_line` probe tells only readiness"), "{log}");
    assert!(liveness("notify = true\nfailures = 0").contains("`failures` must be at least 1"));
    assert!(liveness("grpc = \"h:1\"").contains("unknown field `grpc`"));
}

#[test]
fn listeners_and_update_are_read_with_their_defaults() {
    let service = one("[[service]]\nname = \"web\"\n[service.proxy]\nupdate = \"overlap\"\n\
         [[service.proxy.listener]]\nname = \"public\"\naddress = \"127.0.0.1:21000\"\n\
         [[service.proxy.listener]]\nname = \"admin\"\naddress = \"/run/web/admin.sock\"\n");
    let proxy = service.proxy.unwrap();
    let listed: Vec<(&str, String)> =
        proxy.listeners.iter().map(|l| (l.name.as_str(), l.address.to_string())).collect();
    assert_eq!(listed, [("public", "127.0.0.1:21000".to_owned()), ("admin", "/run/web/admin.sock".to_owned())]);
    assert_eq!(
        proxy.update,
        UpdatePolicy { strategy: UpdateStrategy::Overlap, timeout: Duration::from_secs(30), ..UpdatePolicy::default() }
    );
    let plain = one("[[service]]\nname = \"web\"\n[service.proxy]\n").proxy.unwrap();
    assert!(plain.listeners.is_empty());
    assert_eq!(plain.update, UpdatePolicy::default());
}

#[test]
fn epoch_updates_are_read_with_their_keys_and_defaults() {
    let proxy = |lines: &str| one(&format!("[[service]]\nname = \"web\"\n[service.proxy]\n{lines}\n")).proxy.unwrap();
    let envoy = proxy(
        "update = \"epoch\"\ndrain_timeout = \"2m\"\nmax_generations = 2\nkeep_listening = true\n\
         command = [\"envoy\", \"--restart-epoch\", \"{restart_epoch}\", \"--base-id\", \"{base_id}\"]\n\
         env = { ENVOY_EPOCH = \"epoch-{restart_epoch}\" }\n\
         [service.proxy.readiness]\nexec = [\"/bin/check\"]",
    );
    assert_eq!(
        envoy.update,
        UpdatePolicy {
            strategy: UpdateStrategy::Epoch,
            timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(120),
            max_generations: 2,
            keep_listening: true,
        }
    );
    let defaults = proxy("update = \"epoch\"").update;
    assert_eq!(
        (defaults.drain_timeout, defaults.max_generations, defaults.keep_listening),
        (Duration::from_secs(15 * 60), 3, false)
    );
}

#[test]
fn epoch_keys_and_placeholders_are_refused_beside_another_update() {
    let error = proxy_error("drain_timeout = \"1m\"");
    assert!(
        error.contains("web.toml") && error.contains("`proxy.drain_timeout` applies to update = \"epoch\" only"),
        "{error}"
    );
    let error = proxy_error("update = \"overlap\"\nmax_generations = 4");
    assert!(error.contains("`proxy.max_generations`") && error.contains("update is \"overlap\""), "{error}");
    let error = proxy_error("update = \"epoch\"\nkeep_listening = true");
    assert!(error.contains("web.toml") && error.contains("`proxy.keep_listening` needs a readiness check"), "{error}");
    let error = proxy_error("keep_listening = true");
    assert!(error.contains("`proxy.keep_listening` applies to update = \"epoch\" only"), "{error}");
    let error = proxy_error("command = [\"envoy\", \"--restart-epoch\", \"{restart_epoch}\"]");
    assert!(error.contains("`proxy.command` holds {restart_epoch}"), "{error}");
    let error = proxy_error("command = [\"envoy\"]\nenv = { BASE = \"{base_id}\" }");
    assert!(error.contains("`proxy.env` holds {base_id}"), "{error}");
    let error = proxy_error("update = \"epoch\"\nmax_generations = 1");
    assert!(error.contains("web.toml") && error.contains("max_generations") && error.contains("at least 2"), "{error}");
    let error = proxy_error("update = \"epoch\"\ndrain_timeout = \"0s\"");
    assert!(error.contains("drain_timeout") && error.contains("more than zero"), "{error}");
}

#[test]
fn kind_envoy_runs_envoy_from_path_with_epoch_updates_and_an_admin_port_is_its_readiness() {
    let proxy = |lines: &str| one(&format!("[[service]]\nname = \"web\"\n[service.proxy]\n{lines}\n")).proxy.unwrap();
    let plain = proxy("kind = \"envoy\"");
    assert_eq!(plain.kind, ProxyKind::Envoy { admin_port: None });
    assert_eq!(plain.command, ProxyCommand::Exec(CommandLine::from_words(vec!["envoy".into()]).unwrap()));
    assert_eq!(plain.update.strategy, UpdateStrategy::Epoch);
    assert_eq!(plain.readiness, None);
    let given = proxy(
        "kind = \"envoy\"\nadmin_port = 19000\ncommand = [\"/opt/envoy/bin/envoy\", \"--concurrency\", \"1\"]\nupdate = \"restart\"",
    );
    assert_eq!(given.kind, ProxyKind::Envoy { admin_port: Some(19000) });
    assert_eq!(given.update.strategy, UpdateStrategy::Restart);
    let Some(Readiness { probe: Probe::Http(target), .. }) = given.readiness.as_deref() else {
        panic!("{:?}", given.readiness)
    };
    assert_eq!(target.as_str(), "http://127.0.0.1:19000/ready");
}

#[test]
fn kind_envoy_refuses_another_program_its_own_flags_and_unknown_kinds_naming_the_file_and_field() {
    let error = proxy_error("kind = \"envoy\"\ncommand = [\"/usr/sbin/haproxy\"]");
    assert!(error.contains("web.toml") && error.contains("`proxy.command` runs \"/usr/sbin/haproxy\""), "{error}");
    let error = proxy_error("kind = \"envoy\"\ncommand = [\"envoy\", \"-c\", \"/etc/envoy.yaml\"]");
    assert!(error.contains("web.toml") && error.contains("`proxy.command` holds \"-c\""), "{error}");
    let error = proxy_error("kind = \"envoy\"\ncommand = [\"envoy\", \"--base-id=3\"]");
    assert!(error.contains("`proxy.command` holds \"--base-id=3\""), "{error}");
    let error = proxy_error("kind = \"nginx\"");
    assert!(error.contains("web.toml") && error.contains("kind") && error.contains("`envoy`"), "{error}");
    let error = proxy_error("admin_port = 19000");
    assert!(error.contains("`proxy.admin_port` applies to kind = \"envoy\" only"), "{error}");
    let error = proxy_error("kind = \"envoy\"\nuser = \"envoy\"");
    assert!(error.contains("`proxy.user` cannot be used with kind = \"envoy\""), "{error}");
}

#[test]
fn bad_listeners_and_updates_name_file_line_and_field() {
    let listener = |lines: &str| proxy_error(&format!("[[service.proxy.listener]]\n{lines}"));
    let error = listener("name = \"a:b\"\naddress = \"127.0.0.1:1\"");
    assert!(
        error.contains("web.toml") && error.contains("listener") && error.contains(crate::LISTENER_NAME_RULE),
        "{error}"
    );
    let error = listener("name = \"a\"\naddress = \"relative.sock\"");
    assert!(error.contains("absolute path") && error.contains("address"), "{error}");
    let error = listener("name = \"a\"");
    assert!(error.contains("missing field `address`"), "{error}");
    let error = listener("name = \"a\"\naddress = \"127.0.0.1:1\"\nport = 2");
    assert!(error.contains("unknown field `port`"), "{error}");
    let error = listener(
        "name = \"a\"\naddress = \"127.0.0.1:1\"\n[[service.proxy.listener]]\nname = \"a\"\naddress = \"127.0.0.1:2\"",
    );
    assert!(error.contains("two listeners are named \"a\""), "{error}");
    let error = listener(
        "name = \"a\"\naddress = \"127.0.0.1:1\"\n[[service.proxy.listener]]\nname = \"b\"\naddress = \"127.0.0.1:1\"",
    );
    assert!(error.contains("the same address 127.0.0.1:1"), "{error}");
    let many: String = (0..65)
        .map(|n| format!("[[service.proxy.listener]]\nname = \"l{n}\"\naddress = \"127.0.0.1:{}\"\n", n + 1))
        .collect();
    let error = proxy_error(&many);
    assert!(error.contains("65 listeners: a proxy has at most 64"), "{error}");
    let error = proxy_error("update = \"blue-green\"");
    assert!(error.contains("update") && error.contains("overlap"), "{error}");
    let error = proxy_error("update_timeout = \"0s\"");
    assert!(error.contains("update_timeout") && error.contains("more than zero"), "{error}");
    let error = proxy_error(
        "[service.proxy.readiness]\nfd = 3\n[[service.proxy.listener]]\nname = \"public\"\naddress = \"127.0.0.1:1\"",
    );
    assert!(
        error.contains("readiness.fd 3 is the descriptor of listener \"public\"") && error.contains("4 or more"),
        "{error}"
    );
}

mod connect;
mod errors;
mod loader;
mod round_trip;

#[test]
fn resource_limits_are_read_and_bad_ones_named() {
    let service =
        one("[[service]]\nname = \"web\"\n[service.proxy]\nmemory_max = \"256MiB\"\ncpus = 0.5\npids_max = 512\n");
    let limits = service.proxy.unwrap().limits;
    assert_eq!(limits.memory_max, Some(256 << 20));
    assert_eq!(limits.cpus.map(CpuLimit::quota_micros), Some(50_000));
    assert_eq!(limits.pids_max, Some(512));
    let whole = one("[[service]]\nname = \"web\"\n[service.proxy]\ncpus = 2\nmemory_max = 1073741824\n");
    assert_eq!(whole.proxy.as_ref().unwrap().limits.cpus.map(CpuLimit::cores), Some(2.0));
    assert_eq!(whole.proxy.unwrap().limits.memory_max, Some(1 << 30));

    let error = proxy_error("memory_max = \"12KiB\"");
    assert!(error.contains("conf.d/web.toml:4") && error.contains("memory_max") && error.contains("1MiB"), "{error}");
    let error = proxy_error("memory_max = \"lots\"");
    assert!(error.contains("memory_max") && error.contains("invalid size"), "{error}");
    let error = proxy_error("cpus = 0");
    assert!(error.contains("cpus") && error.contains("0.01 to 4096"), "{error}");
    let error = proxy_error("cpus = \"half\"");
    assert!(error.contains("cpus") && error.contains("number of cores"), "{error}");
    let error = proxy_error("pids_max = 0");
    assert!(error.contains("pids_max") && error.contains("at least 1"), "{error}");
}

#[test]
fn a_reload_table_is_read_with_its_defaults_and_written_back() {
    let text = "[[service]]\nname = \"web\"\n[service.proxy.reload]\nsignal = \"SIGUSR2\"\n\
                check = [\"haproxy\", \"-c\", \"-f\", \"/etc/haproxy/haproxy.cfg\"]\n\
                watch = [\"/etc/haproxy/haproxy.cfg\", \"/etc/haproxy/certs\"]\n";
    let service = one(text);
    let reload = service.proxy.as_ref().unwrap().reload.clone().unwrap();
    assert_eq!(reload.action, ReloadAction::Signal(KillSignal::Usr2));
    assert_eq!(reload.check.as_ref().unwrap().to_words(), ["haproxy", "-c", "-f", "/etc/haproxy/haproxy.cfg"]);
    assert_eq!(reload.watch, [PathBuf::from("/etc/haproxy/haproxy.cfg"), "/etc/haproxy/certs".into()]);
    assert_eq!(reload.timeout, Duration::from_secs(10));
    let exec = one(
        "[[service]]\nname = \"web\"\n[service.proxy.reload]\nexec = [\"/usr/sbin/reload\", \"now\"]\ntimeout = \"3s\"\n",
    );
    let exec = exec.proxy.unwrap().reload.unwrap();
    assert_eq!(
        exec.action,
        ReloadAction::Exec(CommandLine::from_words(vec!["/usr/sbin/reload".into(), "now".into()]).unwrap())
    );
    assert_eq!((exec.check, exec.watch.len(), exec.timeout), (None, 0, Duration::from_secs(3)));
    for format in [Format::Toml, Format::Json] {
        let body = to_service_text(&service, format).unwrap();
        assert_eq!(parse_service(&body, format, &Origin::Body).unwrap(), service, "{body}");
    }
}

#[test]
fn templates_are_read_with_their_defaults_and_written_back() {
    let service = one(r#"
[[service]]
name = "web"
[service.proxy]
[[service.proxy.template]]
source = "/etc/tether/haproxy.cfg.j2"
destination = "/etc/haproxy/haproxy.cfg"
mode = "0640"
on_change = "none"
wait = "1s"
max_size = "1MiB"
[[service.proxy.template]]
contents = "{{ service.name }}"
destination = "/run/web/name"
"#);
    let templates = &service.proxy.as_ref().unwrap().templates;
    assert_eq!(
        templates[0],
        crate::Template {
            source: crate::TemplateSource::File("/etc/tether/haproxy.cfg.j2".into()),
            destination: "/etc/haproxy/haproxy.cfg".into(),
            mode: 0o640,
            on_change: crate::OnChange::Nothing,
            wait: Duration::from_secs(1),
            max_size: 1 << 20,
        }
    );
    assert_eq!(
        templates[1],
        crate::Template::new(crate::TemplateSource::Inline("{{ service.name }}".into()), "/run/web/name".into())
    );
    assert_eq!((templates[1].mode, templates[1].on_change), (0o644, crate::OnChange::Restart));
    assert_eq!(templates[1].wait, Duration::from_millis(200));
    assert_eq!(templates[1].max_size, 16 << 20);
    for format in [Format::Toml, Format::Json] {
        let text = to_service_text(&service, format).unwrap();
        assert_eq!(parse_service(&text, format, &Origin::Body).unwrap(), service, "{text}");
    }
}

#[test]
fn bad_reload_tables_name_file_line_and_field() {
    let reload = |lines: &str| proxy_error(&format!("[service.proxy.reload]\n{lines}"));
    let none = reload("timeout = \"1s\"");
    assert!(none.starts_with("conf.d/web.toml:"), "{none}");
    assert!(none.contains("field `service[0].proxy.reload`: no reload action: give exactly one of signal"), "{none}");
    let both = reload("signal = \"SIGHUP\"\nexec = [\"/bin/true\"]");
    assert!(both.contains("field `service[0].proxy.reload`: both `signal` and `exec`"), "{both}");
    let signal = reload("signal = \"SIGKILL\"");
    assert!(signal.contains("field `service[0].proxy.reload.signal`: unknown reload signal \"SIGKILL\""), "{signal}");
    let relative = reload("signal = \"SIGHUP\"\nwatch = [\"etc/haproxy.cfg\"]");
    assert!(
        relative.contains(
            "field `service[0].proxy.reload.watch[0]`: watched path \"etc/haproxy.cfg\" must be an absolute path"
        ),
        "{relative}"
    );
    let check = reload("signal = \"SIGHUP\"\ncheck = [\"bin/check\"]");
    assert!(
        check.contains("field `service[0].proxy.reload.check`: program \"bin/check\" is a relative path"),
        "{check}"
    );
    let zero = reload("signal = \"SIGHUP\"\ntimeout = \"0s\"");
    assert!(zero.contains("field `service[0].proxy.reload.timeout`: must be more than zero"), "{zero}");
    assert!(reload("signal = \"SIGHUP\"\nwatched = []").contains("unknown field `watched`"));
}

#[test]
fn bad_templates_are_named_with_their_file_line_and_field() {
    let template = |lines: &str| proxy_error(&format!("[[service.proxy.template]]\n{lines}"));
    let error = template("destination = \"/etc/x\"");
    assert!(
        error.starts_with("conf.d/web.toml:4:1: field `service[0].proxy.template[0]`")
            && error.contains("no `source` and no `contents`: give exactly one"),
        "{error}"
    );
    let error = template("source = \"/a.j2\"\ncontents = \"x\"\ndestination = \"/etc/x\"");
    assert!(error.contains("both `source` and `contents`"), "{error}");
    let error = template("contents = \"x\"\ndestination = \"etc/x\"");
    assert!(
        error.starts_with("conf.d/web.toml:6:15: field `service[0].proxy.template[0].destination`")
            && error.contains("\"etc/x\" must be an absolute path"),
        "{error}"
    );
    let error = template("contents = \"x\"\ndestination = \"/etc/\"");
    assert!(error.contains("must name a file"), "{error}");
    let error = template("contents = \"x\"\ndestination = \"/etc/../x\"");
    assert!(error.contains("must name a file"), "{error}");
    let error = template("source = \"a.j2\"\ndestination = \"/etc/x\"");
    assert!(error.contains("template[0].source") && error.contains("absolute path"), "{error}");
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\nmode = \"0999\"");
    assert!(error.contains("template[0].mode") && error.contains("octal"), "{error}");
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\nmode = \"4755\"");
    assert!(error.contains("template[0].mode"), "{error}");
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\non_change = \"reload\"");
    assert!(
        error.starts_with("conf.d/web.toml:")
            && error.contains(
                "`proxy.template[0].on_change` is \"reload\", but the proxy has no [service.proxy.reload] table"
            ),
        "{error}"
    );
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\non_change = \"signal\"");
    assert!(error.contains("unknown on_change \"signal\""), "{error}");
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\nmax_size = \"16XB\"");
    assert!(error.contains("template[0].max_size`: invalid size \"16XB\""), "{error}");
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\nmax_size = 0");
    assert!(error.contains("template[0].max_size`: max_size of 0 bytes"), "{error}");
    // With a reload table, `reload` is the default and may be named.
    let reloadable = |on_change: &str| {
        let text = format!(
            "[[service]]\nname = \"web\"\n[service.proxy.reload]\nsignal = \"SIGHUP\"\n\
             [[service.proxy.template]]\ncontents = \"x\"\ndestination = \"/etc/x\"\n{on_change}"
        );
        one(&text).proxy.unwrap().templates[0].on_change
    };
    assert_eq!(reloadable(""), crate::OnChange::Reload);
    assert_eq!(reloadable("on_change = \"reload\""), crate::OnChange::Reload);
    assert_eq!(reloadable("on_change = \"restart\""), crate::OnChange::Restart);
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\nwait = \"soon\"");
    assert!(error.contains("template[0].wait") && error.contains("invalid duration"), "{error}");
    let error = template("contents = \"x\"\ndestination = \"/etc/x\"\nowner = \"root\"");
    assert!(error.contains("unknown field `owner`"), "{error}");
    let error = template(
        "contents = \"x\"\ndestination = \"/etc/x\"\n[[service.proxy.template]]\ncontents = \"y\"\ndestination = \"/etc/x\"",
    );
    assert!(error.contains("two templates have the destination /etc/x"), "{error}");
}
