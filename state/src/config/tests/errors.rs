//! What a config error says, on one line each, and what a list of them gives access to.

use super::*;

fn at(path: &str, line: usize, column: usize) -> Location {
    Location::at(&Origin::File(path.into()), line, column)
}

fn invalid(location: Location, field: Option<&str>, message: &str) -> ConfigError {
    ConfigError::Invalid { location, field: field.map(str::to_owned), message: message.to_owned() }
}

fn duplicate(location: Location, id: &str, first: Location) -> ConfigError {
    ConfigError::Duplicate { location, id: ServiceId::new(id).unwrap(), first: Box::new(first) }
}

#[test]
fn a_list_of_errors_shows_each_on_its_own_line_with_its_cause() {
    let errors = ConfigErrors::new(vec![
        ConfigError::Read {
            location: Location::file(Path::new("conf.d/a.toml")),
            source: std::io::Error::from_raw_os_error(13),
        },
        invalid(at("conf.d/b.toml", 3, 1), Some("service[0].prot"), "unknown field `prot`"),
        duplicate(at("conf.d/b.toml", 5, 1), "web", at("conf.d/b.toml", 1, 1)),
    ])
    .unwrap();
    assert_eq!(
        errors.to_string(),
        "conf.d/a.toml: cannot read: Permission denied (os error 13)\n\
         conf.d/b.toml:3:1: field `service[0].prot`: unknown field `prot`\n\
         conf.d/b.toml:5:1: duplicate service id `web`: already defined at conf.d/b.toml:1:1"
    );
    // Each cause is in its line already: a chain would repeat one of them.
    assert!(std::error::Error::source(&errors).is_none());
    assert_eq!(crate::error_chain(&errors), errors.to_string());
}

#[test]
fn a_list_of_errors_gives_each_error_in_order_and_is_never_empty() {
    assert!(ConfigErrors::new(Vec::new()).is_none());
    let errors = ConfigErrors::new(vec![
        invalid(at("a.toml", 2, 1), Some("service[0].port"), "invalid value"),
        duplicate(at("b.toml", 1, 1), "web", at("a.toml", 1, 1)),
    ])
    .unwrap();
    assert_eq!(errors.len(), 2);
    assert!(!errors.is_empty());
    assert_eq!(errors.first().field(), Some("service[0].port"));
    assert_eq!(errors.as_slice()[1].location(), &at("b.toml", 1, 1));
    let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(lines, errors.to_string().lines().collect::<Vec<_>>());
    let mut borrowed = 0;
    for error in &errors {
        assert!(matches!(error, ConfigError::Invalid { .. } | ConfigError::Duplicate { .. }));
        borrowed += 1;
    }
    assert_eq!(borrowed, 2);
    let owned: Vec<ConfigError> = errors.into_iter().collect();
    assert!(matches!(&owned[1], ConfigError::Duplicate { id, .. } if id.as_str() == "web"));
}

#[test]
fn every_error_has_a_location_and_a_message_and_some_a_field() {
    let file = Location::file(Path::new("conf.d/web.toml"));
    let cases = [
        (
            ConfigError::Read { location: file.clone(), source: std::io::ErrorKind::NotFound.into() },
            None,
            "cannot read",
        ),
        (ConfigError::TooLarge { location: file.clone() }, None, "file is larger than 16777216 bytes"),
        (ConfigError::NotAFile { location: file.clone() }, None, "not a regular file"),
        (ConfigError::NotUtf8 { location: at("conf.d/web.toml", 2, 9) }, None, "not valid UTF-8"),
        (
            invalid(at("conf.d/web.toml", 3, 1), Some("service[0].prot"), "unknown field `prot`"),
            Some("service[0].prot"),
            "unknown field `prot`",
        ),
        (invalid(at("conf.d/web.toml", 1, 1), None, "expected `=`"), None, "expected `=`"),
        (invalid(at("conf.d/web.toml", 1, 1), Some(""), "expected `=`"), None, "expected `=`"),
        (
            duplicate(at("conf.d/web.toml", 4, 1), "web", at("conf.d/web.toml", 1, 1)),
            None,
            "duplicate service id `web`: already defined at conf.d/web.toml:1:1",
        ),
    ];
    for (error, field, message) in cases {
        assert_eq!(error.location().origin, Origin::File("conf.d/web.toml".into()));
        assert_eq!(error.field(), field, "{error}");
        assert_eq!(error.message(), message, "{error}");
        let field = field.map(|field| format!("field `{field}`: ")).unwrap_or_default();
        assert_eq!(error.to_string(), format!("{}: {field}{message}", error.location()));
    }
}

#[test]
fn control_characters_in_keys_and_values_are_escaped_on_display_only() {
    let error =
        parse_file("[[service]]\nname = \"web\"\n\"a\\nb\\u001b[2J\" = 1\n", Format::Toml, &Origin::Body).unwrap_err();
    assert_eq!(error.field(), Some("service[0].a\nb\x1b[2J"));
    let shown = error.to_string();
    assert!(!shown.contains(['\n', '\x1b']), "{shown:?}");
    assert!(
        shown.starts_with("request body:3:1: field `service[0].a\\nb\\u{1b}[2J`: unknown field `a\\nb\\u{1b}[2J`"),
        "{shown}"
    );
}
