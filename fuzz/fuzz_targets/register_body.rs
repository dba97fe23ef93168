//! The body of `PUT /v1/agent/service/register`, as the handler reads it: bytes that must
//! be UTF-8, then `parse_service`. Never panics, and an accepted service writes back to a
//! body that reads to the same service, which is how registrations are persisted.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_state::config::{Format, Origin, parse_service, to_service_text};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(service) = parse_service(text, Format::Json, &Origin::Body) else { return };

    let body = to_service_text(&service, Format::Json).expect("a registered service writes as a JSON body");
    let reread = parse_service(&body, Format::Json, &Origin::Body)
        .unwrap_or_else(|err| panic!("written body does not parse: {err}\n{body}"));
    assert_eq!(reread, service, "register body round trip changed the service\n{body}");
    let again = to_service_text(&reread, Format::Json).expect("a registered service writes as a JSON body");
    assert_eq!(again, body, "writing a service is not deterministic");
});
