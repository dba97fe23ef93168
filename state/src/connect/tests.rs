//! Tests of the Connect vocabulary: every rule of a value, and intention precedence, by
//! example and against a brute-force reference.

use proptest::prelude::*;

use super::*;

fn name(name: &str) -> ServiceName {
    ServiceName::new(name).unwrap()
}

fn rule(source: &str, destination: &str, action: IntentionAction) -> Intention {
    Intention::new(IntentionTarget::parse(source).unwrap(), IntentionTarget::parse(destination).unwrap(), action)
}

/// What decides `source -> destination` among `rules` with a `deny` default: the action and
/// the decisive rule, as `source -> destination`.
#[track_caller]
fn check(
    rules: &[(&str, &str, IntentionAction)],
    source: &str,
    destination: &str,
) -> (IntentionAction, Option<String>) {
    let rules = rules.iter().map(|&(s, d, action)| rule(s, d, action)).collect();
    let intentions = Intentions::new(rules, IntentionAction::Deny).unwrap();
    let decision = intentions.decide(&name(source), &name(destination));
    (decision.action, decision.rule.map(ToString::to_string))
}

use IntentionAction::{Allow, Deny};

/// Every level of precedence present, each with another action than the level below.
const LEVELS: &[(&str, &str, IntentionAction)] =
    &[("*", "*", Allow), ("web", "*", Deny), ("*", "db", Allow), ("web", "db", Deny)];

#[test]
fn an_exact_source_and_destination_beats_every_wildcard() {
    assert_eq!(check(LEVELS, "web", "db"), (Deny, Some("web -> db".into())));
}

#[test]
fn a_wildcard_source_with_an_exact_destination_beats_an_exact_source_with_a_wildcard_destination() {
    assert_eq!(check(LEVELS, "api", "db"), (Allow, Some("* -> db".into())));
    assert_eq!(check(&LEVELS[..3], "web", "db"), (Allow, Some("* -> db".into())));
}

#[test]
fn an_exact_source_with_a_wildcard_destination_beats_the_wildcard_pair() {
    assert_eq!(check(LEVELS, "web", "cache"), (Deny, Some("web -> *".into())));
}

#[test]
fn the_wildcard_pair_decides_what_nothing_more_precise_matches() {
    assert_eq!(check(LEVELS, "api", "cache"), (Allow, Some("* -> *".into())));
}

#[test]
fn with_no_matching_rule_the_default_decides() {
    assert_eq!(check(&[("web", "db", Allow)], "api", "db"), (Deny, None));
    assert_eq!(check(&[], "web", "db"), (Deny, None));
    let intentions = Intentions::new(vec![rule("web", "db", Deny)], Allow).unwrap();
    assert_eq!(intentions.decide(&name("api"), &name("db")), Decision { action: Allow, rule: None });
}

#[test]
fn an_exact_destination_without_a_rule_for_the_source_falls_back_to_wildcard_destinations() {
    assert_eq!(check(&[("api", "db", Deny), ("web", "*", Allow)], "web", "db"), (Allow, Some("web -> *".into())));
}

#[test]
fn names_match_exactly() {
    assert_eq!(check(&[("web", "db", Allow)], "Web", "db"), (Deny, None));
    assert_eq!(check(&[("web", "db", Allow)], "web", "db2"), (Deny, None));
}

#[test]
fn a_pair_defined_twice_is_refused_naming_both_rules() {
    let rules = vec![rule("web", "db", Allow), rule("*", "db", Deny), rule("web", "db", Deny), rule("*", "db", Allow)];
    let err = Intentions::new(rules, Deny).unwrap_err();
    assert_eq!(err.pairs(), [(0, 2), (1, 3)]);
    assert_eq!(
        err.to_string(),
        "intention web -> db is defined twice (rules 0 and 2), and 1 more rule(s) repeat a pair"
    );
}

#[test]
fn a_partial_wildcard_or_an_empty_name_is_refused() {
    let err = IntentionTarget::parse("web*").unwrap_err();
    assert!(err.to_string().contains("`*` is a wildcard only on its own"), "{err}");
    let err = IntentionTarget::parse("").unwrap_err();
    assert_eq!(err.to_string(), "invalid service name \"\" in an intention: it is empty");
    assert_eq!(IntentionTarget::parse("*").unwrap(), IntentionTarget::Any);
}

#[test]
fn a_description_shows_on_one_line() {
    let base = rule("web", "db", Allow);
    assert_eq!(base.clone().with_description("web reads db").unwrap().description(), Some("web reads db"));
    assert!(base.clone().with_description("two\nlines").is_err());
    assert!(base.with_description("x".repeat(Intention::MAX_DESCRIPTION_LEN + 1)).is_err());
}

#[test]
fn trust_domains_follow_the_spiffe_rule_and_say_what_is_wrong() {
    for valid in ["example.org", "mesh-1.example_2.org", "a", &"a".repeat(MAX_TRUST_DOMAIN_LEN)] {
        assert!(TrustDomain::new(valid).is_ok(), "{valid}");
    }
    let reason = |domain: &str| match TrustDomain::new(domain).unwrap_err() {
        ConnectValueError::TrustDomain { reason, .. } => reason,
        other => panic!("{other}"),
    };
    assert_eq!(reason(""), "it is empty");
    assert_eq!(reason(&"a".repeat(MAX_TRUST_DOMAIN_LEN + 1)), "it is longer than 255 bytes");
    assert!(reason("spiffe://example.org").starts_with("it has a scheme"));
    assert!(reason("example.org/ns").starts_with("it has a path"));
    assert!(reason("example.org:8443").starts_with("it has a port"));
    assert!(reason("Example.org").starts_with("it has uppercase letters"));
    assert!(reason("exa mple.org").starts_with("it may only contain"));
    assert!(reason("user@example.org").starts_with("it may only contain"));
}

#[test]
fn datacenters_are_lowercase_names() {
    assert_eq!(Datacenter::default().as_str(), DEFAULT_DATACENTER);
    assert!(Datacenter::new("eu-west_1").is_ok());
    for invalid in ["", "EU", "eu.west", "dc 1", &"d".repeat(Datacenter::MAX_LEN + 1)] {
        assert!(Datacenter::new(invalid).is_err(), "{invalid:?}");
    }
}

#[test]
fn leaf_lifetimes_are_bounded() {
    assert_eq!(LeafTtl::default().get(), LeafTtl::DEFAULT);
    assert!(LeafTtl::new(LeafTtl::MIN).is_ok());
    assert!(LeafTtl::new(LeafTtl::MAX).is_ok());
    let err = LeafTtl::new(Duration::from_secs(9)).unwrap_err();
    assert_eq!(err.to_string(), "leaf_ttl of 9s is too short: it must be 10s to 1year");
    assert!(LeafTtl::new(LeafTtl::MAX + Duration::from_secs(1)).is_err());
}

#[test]
fn pem_paths_are_absolute_paths_of_files() {
    assert!(PemPath::new("/etc/tether/ca.pem").is_ok());
    for invalid in ["ca.pem", "./ca.pem", "/", "/etc/.."] {
        assert!(PemPath::new(invalid).is_err(), "{invalid}");
    }
}

/// The brute-force reference: every matching rule, the most precise first, scored without
/// [`Precedence`]: a precise destination counts twice what a precise source counts.
fn reference<'a>(
    rules: &'a [Intention],
    default: IntentionAction,
    source: &ServiceName,
    destination: &ServiceName,
) -> (IntentionAction, Option<&'a Intention>) {
    let score = |rule: &Intention| {
        let exact = |target: &IntentionTarget| u8::from(*target != IntentionTarget::Any);
        2 * exact(rule.destination()) + exact(rule.source())
    };
    let matching = rules.iter().filter(|rule| {
        let hits = |target: &IntentionTarget, name: &ServiceName| match target {
            IntentionTarget::Any => true,
            IntentionTarget::Service(own) => own.as_str() == name.as_str(),
        };
        hits(rule.source(), source) && hits(rule.destination(), destination)
    });
    match matching.max_by_key(|rule| score(rule)) {
        Some(rule) => (rule.action(), Some(rule)),
        None => (default, None),
    }
}

/// A few names, so that rules and questions collide often, and the wildcard.
fn target() -> impl Strategy<Value = String> {
    prop_oneof![Just("*".to_owned()), "[abc]"]
}

fn action() -> impl Strategy<Value = IntentionAction> {
    prop_oneof![Just(Allow), Just(Deny)]
}

proptest! {
    #[test]
    fn the_most_precise_matching_rule_always_decides(
        raw in prop::collection::vec((target(), target(), action()), 0..16),
        default in action(),
        source in "[abcd]",
        destination in "[abcd]",
    ) {
        // Each pair once: a set with a repeated pair is refused (the property below).
        let mut seen = std::collections::HashSet::new();
        let rules: Vec<Intention> = raw
            .iter()
            .filter(|(s, d, _)| seen.insert((s.clone(), d.clone())))
            .map(|(s, d, action)| rule(s, d, *action))
            .collect();
        let intentions = Intentions::new(rules.clone(), default).unwrap();
        let (source, destination) = (name(&source), name(&destination));
        let decision = intentions.decide(&source, &destination);
        let (action, expected) = reference(&rules, default, &source, &destination);
        prop_assert_eq!(decision.action, action);
        prop_assert_eq!(decision.rule, expected);
        if let Some(rule) = decision.rule {
            // Unique pairs leave no tie: no other matching rule is as precise.
            let ties = rules
                .iter()
                .filter(|other| other.matches(&source, &destination) && other.precedence() == rule.precedence());
            prop_assert_eq!(ties.count(), 1);
        }
    }

    #[test]
    fn the_decision_does_not_depend_on_the_order_of_the_rules(
        (rules, shuffled) in prop::collection::vec((target(), target(), action()), 0..16).prop_flat_map(|raw| {
            let mut seen = std::collections::HashSet::new();
            let unique: Vec<_> = raw.into_iter().filter(|(s, d, _)| seen.insert((s.clone(), d.clone()))).collect();
            (Just(unique.clone()), Just(unique).prop_shuffle())
        }),
        default in action(),
        source in "[abcd]",
        destination in "[abcd]",
    ) {
        let build = |raw: &[(String, String, IntentionAction)]| {
            let rules = raw.iter().map(|(s, d, action)| rule(s, d, *action)).collect();
            Intentions::new(rules, default).unwrap()
        };
        let (given, reordered) = (build(&rules), build(&shuffled));
        let (source, destination) = (name(&source), name(&destination));
        let (first, second) = (given.decide(&source, &destination), reordered.decide(&source, &destination));
        prop_assert_eq!(first.action, second.action);
        // The same rule, wherever it stands in the list.
        prop_assert_eq!(first.rule, second.rule);
    }

    #[test]
    fn a_set_is_refused_exactly_when_it_repeats_a_pair_and_every_repeat_is_named(
        raw in prop::collection::vec((target(), target(), action()), 0..8),
    ) {
        let rules: Vec<Intention> = raw.iter().map(|(s, d, action)| rule(s, d, *action)).collect();
        let mut repeats = Vec::new();
        for (second, later) in rules.iter().enumerate() {
            if let Some(first) = rules[..second].iter().position(|earlier| {
                earlier.source() == later.source() && earlier.destination() == later.destination()
            }) {
                repeats.push((first, second));
            }
        }
        match Intentions::new(rules, Deny) {
            Ok(_) => prop_assert!(repeats.is_empty()),
            Err(duplicates) => prop_assert_eq!(duplicates.pairs(), repeats.as_slice()),
        }
    }
}
