//! `[connect]`, `[connect.ca]` and `[[intention]]`: what is read, what each error says, and
//! what the loader makes of them across files.

use crate::connect::{CaProvider, IntentionTarget, LeafTtl};

use super::*;

const MESH: &str = "[connect]\ntrust_domain = \"example.org\"\n[connect.ca]\nprovider = \"dev\"\n";

#[track_caller]
fn parsed(text: &str) -> ParsedFile {
    parse_config_file(text, Format::Toml, &file()).unwrap()
}

#[track_caller]
fn error(text: &str) -> String {
    match parse_config_file(text, Format::Toml, &file()) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(err) => err.to_string(),
    }
}

#[track_caller]
fn intention_error(lines: &str) -> String {
    error(&format!("[[intention]]\n{lines}\n"))
}

#[test]
fn every_key_of_connect_is_read() {
    let connect = parsed(
        r#"
[connect]
trust_domain = "mesh.example.org"
datacenter = "eu-west-1"
default_intention = "allow"

[connect.ca]
provider = "file"
cert_file = "/etc/tether/ca.pem"
key_file = "/etc/tether/ca-key.pem"
roots = ["/etc/tether/old-root.pem"]
leaf_ttl = "24h"
"#,
    )
    .connect
    .unwrap();
    assert_eq!(connect.trust_domain.as_str(), "mesh.example.org");
    assert_eq!(connect.datacenter.as_str(), "eu-west-1");
    assert_eq!(connect.default_intention, IntentionAction::Allow);
    let pem = |path: &str| crate::PemPath::new(path).unwrap();
    assert_eq!(
        connect.ca.provider,
        CaProvider::File { cert_file: pem("/etc/tether/ca.pem"), key_file: pem("/etc/tether/ca-key.pem") }
    );
    assert_eq!(connect.ca.roots, [pem("/etc/tether/old-root.pem")]);
    assert_eq!(connect.ca.leaf_ttl.get(), Duration::from_secs(24 * 3600));
}

#[test]
fn connect_gets_its_defaults() {
    let connect = parsed(MESH).connect.unwrap();
    assert_eq!(connect.datacenter.as_str(), "dc1");
    assert_eq!(connect.default_intention, IntentionAction::Deny);
    assert_eq!(connect.ca.provider, CaProvider::Dev);
    assert!(connect.ca.roots.is_empty());
    assert_eq!(connect.ca.leaf_ttl, LeafTtl::default());
}

#[test]
fn connect_and_intentions_are_read_from_json_too() {
    let text = r#"{"connect": {"trust_domain": "example.org", "ca": {"provider": "dev"}},
 "intention": [{"source": "web", "destination": "*", "action": "deny", "description": "web talks to no one"}]}"#;
    let parsed = parse_config_file(text, Format::Json, &file()).unwrap();
    assert_eq!(parsed.connect.unwrap().trust_domain.as_str(), "example.org");
    let intention = &parsed.intentions[0];
    assert_eq!(intention.to_string(), "web -> *");
    assert_eq!(intention.description(), Some("web talks to no one"));
}

#[test]
fn an_invalid_trust_domain_names_file_line_and_field() {
    assert_eq!(
        error("[connect]\ntrust_domain = \"spiffe://example.org\"\n[connect.ca]\nprovider = \"dev\"\n"),
        "conf.d/web.toml:2:16: field `connect.trust_domain`: invalid trust domain \"spiffe://example.org\": it has \
         a scheme: write the trust domain alone, such as \"example.org\""
    );
    assert!(
        error("[connect]\ntrust_domain = \"Example.org:8443\"\n[connect.ca]\nprovider = \"dev\"\n")
            .contains("it has a port")
    );
    assert!(error("[connect]\ntrust_domain = \"\"\n[connect.ca]\nprovider = \"dev\"\n").contains("it is empty"));
}

#[test]
fn connect_needs_a_trust_domain_and_a_ca() {
    let err = error("[connect]\n[connect.ca]\nprovider = \"dev\"\n");
    assert!(err.starts_with("conf.d/web.toml:1:1: field `connect`: missing field `trust_domain`"), "{err}");
    let err = error("[connect]\ntrust_domain = \"example.org\"\n");
    assert!(err.contains("field `connect`: missing field `ca`"), "{err}");
    let err = error("[connect]\ntrust_domain = \"example.org\"\n[connect.ca]\n");
    assert!(err.contains("field `connect.ca`: missing field `provider`"), "{err}");
}

#[test]
fn unknown_keys_of_connect_are_refused_with_their_field() {
    let err = error(&format!("{MESH}leaf_tll = \"1h\"\n"));
    assert!(err.starts_with("conf.d/web.toml:5:1: field `connect.ca.leaf_tll`: unknown field `leaf_tll`"), "{err}");
    let err =
        error("[connect]\ntrust_domain = \"example.org\"\ndatacentre = \"dc2\"\n[connect.ca]\nprovider = \"dev\"\n");
    assert!(err.contains("field `connect.datacentre`: unknown field `datacentre`"), "{err}");
}

#[test]
fn the_datacenter_and_the_default_intention_are_checked() {
    let err =
        error("[connect]\ntrust_domain = \"example.org\"\ndatacenter = \"EU 1\"\n[connect.ca]\nprovider = \"dev\"\n");
    assert!(err.starts_with("conf.d/web.toml:3:14: field `connect.datacenter`: invalid datacenter \"EU 1\""), "{err}");
    let err = error(
        "[connect]\ntrust_domain = \"example.org\"\ndefault_intention = \"permit\"\n[connect.ca]\nprovider = \"dev\"\n",
    );
    assert!(
        err.contains("field `connect.default_intention`: unknown action \"permit\": expected \"allow\" or \"deny\""),
        "{err}"
    );
}

#[test]
fn the_file_provider_needs_its_certificate_and_key_and_the_dev_provider_refuses_them() {
    let head = "[connect]\ntrust_domain = \"example.org\"\n[connect.ca]\n";
    let err = error(&format!("{head}provider = \"file\"\nkey_file = \"/etc/ca-key.pem\"\n"));
    assert!(err.starts_with("conf.d/web.toml:3:1: field `connect.ca`: provider = \"file\" needs `cert_file`"), "{err}");
    let err = error(&format!("{head}provider = \"file\"\ncert_file = \"/etc/ca.pem\"\n"));
    assert!(err.contains("field `connect.ca`: provider = \"file\" needs `key_file`"), "{err}");
    let err = error(&format!("{head}provider = \"dev\"\ncert_file = \"/etc/ca.pem\"\n"));
    assert!(err.contains("`cert_file` is for provider = \"file\""), "{err}");
    let err = error(&format!("{head}provider = \"vault\"\n"));
    assert!(err.contains("field `connect.ca.provider`: unknown variant `vault`, expected `file` or `dev`"), "{err}");
}

#[test]
fn certificate_paths_are_absolute_and_the_leaf_lifetime_is_bounded() {
    let err = error(&format!("{MESH}roots = [\"/etc/root.pem\", \"root2.pem\"]\n"));
    assert!(err.starts_with("conf.d/web.toml:5:9: field `connect.ca.roots[1]`: invalid path \"root2.pem\""), "{err}");
    let head = "[connect]\ntrust_domain = \"example.org\"\n[connect.ca]\nprovider = \"file\"\n";
    let err = error(&format!("{head}cert_file = \"ca.pem\"\nkey_file = \"/etc/ca-key.pem\"\n"));
    assert!(
        err.contains("field `connect.ca.cert_file`: invalid path \"ca.pem\": it must be an absolute path"),
        "{err}"
    );
    let err = error(&format!("{MESH}leaf_ttl = \"5s\"\n"));
    assert!(err.contains("field `connect.ca.leaf_ttl`: leaf_ttl of 5s is too short: it must be 10s to 1year"), "{err}");
    let err = error(&format!("{MESH}leaf_ttl = \"3 fortnights\"\n"));
    assert!(err.contains("field `connect.ca.leaf_ttl`: invalid duration"), "{err}");
}

#[test]
fn intentions_are_read_in_order() {
    let parsed = parsed(
        "[[intention]]\nsource = \"web\"\ndestination = \"db\"\naction = \"allow\"\n\n\
         [[intention]]\nsource = \"*\"\ndestination = \"db\"\naction = \"deny\"\ndescription = \"db is private\"\n",
    );
    assert!(parsed.connect.is_none());
    let [first, second] = parsed.intentions.as_slice() else { panic!("two intentions") };
    assert_eq!(first.source(), &IntentionTarget::Service(ServiceName::new("web").unwrap()));
    assert_eq!((first.action(), first.description()), (IntentionAction::Allow, None));
    assert_eq!(second.source(), &IntentionTarget::Any);
    assert_eq!(second.description(), Some("db is private"));
}

#[test]
fn a_bad_intention_names_file_line_and_field() {
    assert_eq!(
        intention_error("source = \"web\"\ndestination = \"db\"\naction = \"permit\""),
        "conf.d/web.toml:4:10: field `intention[0].action`: unknown action \"permit\": expected \"allow\" or \"deny\""
    );
    let err = intention_error("source = \"web*\"\ndestination = \"db\"\naction = \"allow\"");
    assert!(
        err.starts_with("conf.d/web.toml:2:10: field `intention[0].source`: invalid service name \"web*\""),
        "{err}"
    );
    let err = intention_error("source = \"\"\ndestination = \"db\"\naction = \"allow\"");
    assert!(
        err.contains("field `intention[0].source`: invalid service name \"\" in an intention: it is empty"),
        "{err}"
    );
    let err = intention_error("source = \"web\"\naction = \"allow\"");
    assert!(err.contains("field `intention[0]`: missing field `destination`"), "{err}");
    let err = intention_error("source = \"web\"\ndestination = \"db\"\naction = \"allow\"\nprecedence = 9");
    assert!(err.contains("field `intention[0].precedence`: unknown field `precedence`"), "{err}");
    let err =
        intention_error("source = \"web\"\ndestination = \"db\"\naction = \"allow\"\ndescription = \"a\\u0007b\"");
    assert!(
        err.contains("field `intention[0].description`: invalid description: it contains control characters"),
        "{err}"
    );
}

#[test]
fn an_intention_repeated_in_one_file_names_both_places() {
    let rule = |action: &str| format!("[[intention]]\nsource = \"web\"\ndestination = \"db\"\naction = \"{action}\"\n");
    let text = format!("{}\n{}", rule("allow"), rule("deny"));
    assert_eq!(
        error(&text),
        "conf.d/web.toml:6:1: field `intention[1]`: duplicate intention web -> db: already defined at \
         conf.d/web.toml:1:1"
    );
}

#[test]
fn a_file_of_services_to_register_refuses_connect_and_intentions() {
    let err = parse_file(&format!("[[service]]\nname = \"web\"\n\n{MESH}"), Format::Toml, &file()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "conf.d/web.toml:4:1: field `connect`: `[connect]` is read from config dirs only, not from a file of \
         services to register"
    );
    let text = r#"{"service": [], "intention": [{"source": "web", "destination": "db", "action": "allow"}]}"#;
    let err = parse_file(text, Format::Json, &file()).unwrap_err();
    assert!(err.to_string().contains("field `intention[0]`: intentions are read from config dirs only"), "{err}");
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, text).unwrap();
    path
}

#[test]
fn the_loader_carries_connect_and_every_intention_with_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = write(
        dir.path(),
        "a-mesh.toml",
        "[connect]\ntrust_domain = \"example.org\"\ndefault_intention = \"allow\"\n[connect.ca]\nprovider = \"dev\"\n\n\
         [[intention]]\nsource = \"*\"\ndestination = \"db\"\naction = \"deny\"\n",
    );
    let web = write(
        dir.path(),
        "web.json",
        r#"{"service": [{"name": "web"}], "intention": [{"source": "web", "destination": "db", "action": "allow"}]}"#,
    );
    let loaded = load_dirs(&[dir.path()]).unwrap();
    assert_eq!(loaded.services.len(), 1);
    let section = &loaded.connect;
    assert_eq!(section.connect().unwrap().trust_domain.as_str(), "example.org");
    assert_eq!(section.connect_file(), Some(mesh.as_path()));
    let intentions = section.intentions();
    assert_eq!(intentions.default_action(), IntentionAction::Allow);
    let name = |n: &str| ServiceName::new(n).unwrap();
    let decision = intentions.decide(&name("web"), &name("db"));
    assert_eq!(decision.action, IntentionAction::Allow);
    assert_eq!(section.intention_file(decision.rule.unwrap()), Some(web.as_path()));
    let decision = intentions.decide(&name("api"), &name("db"));
    assert_eq!(section.intention_file(decision.rule.unwrap()), Some(mesh.as_path()));
    assert_eq!(intentions.decide(&name("api"), &name("web")).rule, None);

    // The incremental loader gives the same, file by file.
    let mut loader = ConfigLoader::new(vec![dir.path().to_owned()]);
    let files = loader.load_files().unwrap();
    assert_eq!(files.files.len(), 2);
    assert_eq!(files.connect.intentions().rules(), intentions.rules());
    assert_eq!(loader.load().unwrap().connect.connect(), section.connect());
}

#[test]
fn without_connect_intentions_are_decided_with_the_default_deny() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "i.toml", "[[intention]]\nsource = \"web\"\ndestination = \"db\"\naction = \"allow\"\n");
    let loaded = load_dirs(&[dir.path()]).unwrap();
    assert!(loaded.connect.connect().is_none());
    assert_eq!(loaded.connect.intentions().default_action(), IntentionAction::Deny);
    assert_eq!(loaded.connect.intentions().rules().len(), 1);
}

#[test]
fn a_second_connect_table_is_refused_naming_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let first = write(dir.path(), "a.toml", MESH);
    let second = write(dir.path(), "b.toml", &format!("[[service]]\nname = \"web\"\n\n{MESH}"));
    let errors = load_dirs(&[dir.path()]).unwrap_err();
    assert_eq!(errors.len(), 1);
    assert_eq!(
        errors.first().to_string(),
        format!(
            "{}:4:1: field `connect`: a second [connect] table: the config dirs hold one, and {}:1:1 has it already",
            second.display(),
            first.display()
        )
    );
}

#[test]
fn an_intention_repeated_across_files_names_both_places_and_every_repeat_is_reported() {
    let one = tempfile::tempdir().unwrap();
    let two = tempfile::tempdir().unwrap();
    let rule =
        |source: &str| format!("[[intention]]\nsource = \"{source}\"\ndestination = \"db\"\naction = \"allow\"\n");
    let first = write(one.path(), "a.toml", &format!("{}\n{}", rule("web"), rule("*")));
    let second =
        write(two.path(), "b.json", r#"{"intention": [{"source": "*", "destination": "db", "action": "deny"}]}"#);
    let third = write(two.path(), "c.toml", &rule("web"));
    let errors: Vec<String> =
        load_dirs(&[one.path(), two.path()]).unwrap_err().iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        [
            format!(
                "{}:1:16: field `intention[0]`: duplicate intention * -> db: already defined at {}:6:1",
                second.display(),
                first.display()
            ),
            format!(
                "{}:1:1: field `intention[0]`: duplicate intention web -> db: already defined at {}:1:1",
                third.display(),
                first.display()
            ),
        ]
    );
}
