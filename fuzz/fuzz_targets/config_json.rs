//! Config files in JSON: `parse_file` never panics, and what it accepts writes back to
//! text that reads to the same services.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_state::config::{Format, Origin, parse_file, to_file_text};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(services) = parse_file(text, Format::Json, &Origin::Body) else { return };

    let written = to_file_text(&services, Format::Json).expect("services read from JSON write back as JSON");
    let reread = parse_file(&written, Format::Json, &Origin::Body)
        .unwrap_or_else(|err| panic!("written JSON does not parse: {err}\n{written}"));
    assert_eq!(reread, services, "JSON round trip changed the services\n{written}");

    // TOML has no null, so not every JSON service can be written as TOML; what can be
    // written must read back the same.
    if let Ok(written) = to_file_text(&services, Format::Toml) {
        let reread = parse_file(&written, Format::Toml, &Origin::Body)
            .unwrap_or_else(|err| panic!("written TOML does not parse: {err}\n{written}"));
        assert_eq!(reread, services, "JSON to TOML changed the services\n{written}");
    }
});
