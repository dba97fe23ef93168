//! Config files in TOML: `parse_file` never panics, and what it accepts writes back to
//! text that reads to the same services, as TOML and as the JSON bodies that
//! `tether register` sends.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_state::config::{Format, Origin, parse_file, parse_service, to_file_text, to_service_text};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(services) = parse_file(text, Format::Toml, &Origin::Body) else { return };

    let written = to_file_text(&services, Format::Toml).expect("services read from TOML write back as TOML");
    let reread = parse_file(&written, Format::Toml, &Origin::Body)
        .unwrap_or_else(|err| panic!("written TOML does not parse: {err}\n{written}"));
    assert_eq!(reread, services, "TOML round trip changed the services\n{written}");

    // `tether register FILE` reads a TOML file and sends each service as a JSON body.
    for service in &services {
        let body = to_service_text(service, Format::Json).expect("a service writes as a JSON body");
        let reread = parse_service(&body, Format::Json, &Origin::Body)
            .unwrap_or_else(|err| panic!("written JSON body does not parse: {err}\n{body}"));
        assert_eq!(&reread, service, "TOML to JSON body changed the service\n{body}");
    }
});
