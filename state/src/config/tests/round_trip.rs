//! Round trips: what is written (config files, register bodies, a service's own serde) reads
//! back to the same services, for arbitrary valid services.

use proptest::prelude::*;

use super::*;

fn word() -> impl Strategy<Value = String> {
    "[A-Za-z0-9 ._/:=-]{1,12}"
}

/// A command line: an absolute program or a bare name, then arguments of any words.
fn command_words() -> impl Strategy<Value = Vec<String>> {
    let program = prop_oneof!["/[a-z]{1,8}(/[a-z]{1,8}){0,2}", "[A-Za-z0-9._-]{1,12}"];
    (program, prop::collection::vec(word(), 0..3)).prop_map(|(program, args)| {
        let mut words = vec![program];
        words.extend(args);
        words
    })
}

fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        (0u64..100_000).prop_map(Duration::from_millis),
        (0u64..100_000).prop_map(Duration::from_secs),
        (0u64..1_000_000_000).prop_map(Duration::from_nanos),
    ]
}

fn config_value() -> impl Strategy<Value = serde_json::Value> {
    // No nulls and no floats: TOML has no null, and float formatting is not the point here.
    let leaf = prop_oneof![
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        word().prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
        ]
    })
}

fn probe(for_liveness: bool) -> impl Strategy<Value = Probe> {
    let any_kind = prop_oneof![
        (1u16..).prop_map(|port| Probe::Tcp(TcpTarget::parse(&format!("127.0.0.1:{port}")).unwrap())),
        ("[a-z]{1,8}", "(/[a-z0-9]{1,6}){0,3}")
            .prop_map(|(host, path)| Probe::Http(HttpTarget::parse(&format!("http://{host}:8080{path}")).unwrap())),
        command_words().prop_map(|words| Probe::Exec(CommandLine::from_words(words).unwrap())),
        Just(Probe::Notify),
        "[a-z][a-z .*]{0,11}".prop_map(|pattern| Probe::LogLine(LinePattern::new(&pattern).unwrap())),
        (3u32..=1020).prop_map(Probe::Fd),
    ];
    any_kind.prop_filter("a liveness probe", move |probe| !for_liveness || probe.checks_liveness())
}

fn health() -> impl Strategy<Value = (Option<Readiness>, Option<Liveness>)> {
    let positive = || (1u64..100_000).prop_map(Duration::from_millis);
    (
        prop::option::of((probe(false), positive(), positive())),
        prop::option::of((probe(true), positive(), positive(), 1u32..10)),
    )
        .prop_map(|(readiness, liveness)| {
            (
                readiness.map(|(probe, interval, timeout)| Readiness { probe, interval, timeout }),
                liveness.map(|(probe, interval, timeout, failures)| Liveness { probe, interval, timeout, failures }),
            )
        })
}

fn listeners() -> impl Strategy<Value = Vec<Listener>> {
    let address =
        prop_oneof![(1u16..).prop_map(|port| format!("127.0.0.1:{port}")), "/[a-z]{1,8}(/[a-z]{1,8}){0,2}\\.sock",];
    prop::collection::vec(("[A-Za-z0-9_.-]{1,10}", address), 0..3).prop_map(|pairs| {
        let mut listeners: Vec<Listener> = Vec::new();
        for (name, address) in pairs {
            let listener =
                Listener { name: ListenerName::new(&name).unwrap(), address: ListenAddress::parse(&address).unwrap() };
            if listeners.iter().all(|l| l.name != listener.name && l.address != listener.address) {
                listeners.push(listener);
            }
        }
        listeners
    })
}

fn update() -> impl Strategy<Value = UpdatePolicy> {
    let strategies = vec![UpdateStrategy::Restart, UpdateStrategy::Overlap, UpdateStrategy::Epoch];
    (
        prop::sample::select(strategies),
        1u64..100_000,
        1u64..10_000_000,
        UpdatePolicy::MIN_GENERATIONS..10,
        any::<bool>(),
    )
        .prop_map(|(strategy, ms, drain_ms, max_generations, keep_listening)| {
            let mut policy = UpdatePolicy { strategy, timeout: Duration::from_millis(ms), ..UpdatePolicy::default() };
            // `drain_timeout`, `max_generations` and `keep_listening` belong to epoch alone.
            if strategy == UpdateStrategy::Epoch {
                policy.drain_timeout = Duration::from_millis(drain_ms);
                policy.max_generations = max_generations;
                policy.keep_listening = keep_listening;
            }
            policy
        })
}

fn proxy_spec() -> impl Strategy<Value = ProxySpec> {
    (proxy_spec_without_health(), health(), listeners(), update()).prop_map(
        |(mut spec, (readiness, liveness), listeners, update)| {
            spec.readiness = readiness.map(Box::new);
            spec.liveness = liveness.map(Box::new);
            // Listeners take descriptors from 3: a readiness `fd` moves above them.
            if let Some(Readiness { probe: Probe::Fd(fd), .. }) = spec.readiness.as_deref_mut() {
                *fd += listeners.len() as u32;
            }
            spec.listeners = listeners;
            spec.update = update;
            // `keep_listening` needs a readiness check.
            spec.update.keep_listening &= spec.readiness.is_some();
            spec
        },
    )
}

fn proxy_spec_without_health() -> impl Strategy<Value = ProxySpec> {
    (
        prop::option::of(command_words()),
        prop::option::of("/[a-z]{1,8}(/[a-z]{1,8}){0,2}"),
        prop::collection::btree_map(
            "[A-Z_][A-Z0-9_]{0,8}".prop_filter("reserved", |k| !k.starts_with("TETHER_")),
            word(),
            0..3,
        ),
        any::<bool>(),
        prop::option::of("[a-z][a-z0-9]{0,7}"),
        (prop::sample::select(KillSignal::ALL.to_vec()), duration()),
        (0u32..10, duration(), duration()),
        (
            4096u64..(1 << 40),
            0u32..=1000,
            prop::sample::select(vec![LogOutput::Files, LogOutput::Journal, LogOutput::Both]),
        ),
        prop::collection::btree_map("[a-z_]{1,8}", config_value(), 0..3),
        (
            prop::option::of((1u64 << 20)..(1 << 40)),
            prop::option::of(CpuLimit::MIN_MILLICORES..=CpuLimit::MAX_MILLICORES),
            prop::option::of(1u64..1_000_000),
        ),
        prop::collection::btree_map(
            "[a-z][a-z0-9]{0,6}(-proxy)?".prop_map(|name| Dependency::new(name).unwrap()),
            prop::sample::select(vec![Condition::Started, Condition::Ready]),
            0..3,
        ),
    )
        .prop_map(
            |(
                command,
                working_dir,
                env,
                inherit_env,
                user,
                (signal, timeout),
                restart,
                (max_size, keep, output),
                config,
                (memory_max, millicores, pids_max),
                depends_on,
            )| {
                ProxySpec {
                    exec_mode: ExecMode::Daemon,
                    kind: ProxyKind::Plain,
                    command: command
                        .map(|words| CommandLine::from_words(words).unwrap())
                        .map_or(ProxyCommand::BuiltIn, ProxyCommand::Exec),
                    working_dir: working_dir.map(PathBuf::from),
                    env,
                    inherit_env,
                    user,
                    kill: KillPolicy { signal, timeout },
                    restart: RestartPolicy { free_attempts: restart.0, max_delay: restart.1, healthy_after: restart.2 },
                    log: LogPolicy { max_size, keep, output },
                    config: config.into_iter().collect(),
                    readiness: None,
                    liveness: None,
                    listeners: Vec::new(),
                    update: UpdatePolicy::default(),
                    limits: ResourceLimits {
                        memory_max,
                        cpus: millicores.map(|m| CpuLimit::from_cores(f64::from(m) / 1000.0).unwrap()),
                        pids_max,
                    },
                    reload: None,
                    templates: Vec::new(),
                    depends_on,
                }
            },
        )
}

fn service() -> impl Strategy<Value = Service> {
    (
        "[A-Za-z0-9][A-Za-z0-9._-]{0,20}",
        "[A-Za-z0-9 ._-]{1,20}",
        prop_oneof![Just("127.0.0.1".to_owned()), "[a-z]{1,10}(\\.[a-z]{1,5}){0,2}", Just("::1".to_owned())],
        prop::option::of(any::<u16>()),
        prop::collection::vec(word(), 0..3),
        prop::collection::btree_map("[a-z]{1,6}", word(), 0..3),
        prop::option::of(proxy_spec()),
    )
        .prop_map(|(id, name, address, port, tags, meta, proxy)| Service {
            id: ServiceId::new(id).unwrap(),
            name: ServiceName::new(name).unwrap(),
            address,
            port,
            tags,
            meta,
            proxy,
        })
}

fn distinct_services() -> impl Strategy<Value = Vec<Service>> {
    prop::collection::vec(service(), 0..4).prop_map(|services| {
        let mut seen = std::collections::HashSet::new();
        services.into_iter().filter(|s| seen.insert(s.id.clone())).collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn toml_files_round_trip(services in distinct_services()) {
        let text = to_file_text(&services, Format::Toml).unwrap();
        let parsed = parse_file(&text, Format::Toml, &file()).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(parsed, services);
    }

    #[test]
    fn json_files_round_trip(services in distinct_services()) {
        let text = to_file_text(&services, Format::Json).unwrap();
        let parsed = parse_file(&text, Format::Json, &file()).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(parsed, services);
    }

    #[test]
    fn register_bodies_round_trip(service in service()) {
        let text = to_service_text(&service, Format::Json).unwrap();
        let parsed = parse_service(&text, Format::Json, &Origin::Body).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(parsed, service);
    }

    #[test]
    fn services_round_trip_through_their_own_serde_in_the_register_schema(service in service()) {
        let text = serde_json::to_string(&service).unwrap();
        // The same text as a register body: one schema, written in one place.
        prop_assert_eq!(serde_json::to_string_pretty(&service).unwrap(), to_service_text(&service, Format::Json).unwrap());
        let parsed: Service = serde_json::from_str(&text).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(parsed, service);
    }

    #[test]
    fn arbitrary_text_never_panics(text in any::<String>()) {
        let _ = parse_file(&text, Format::Toml, &file());
        let _ = parse_file(&text, Format::Json, &file());
        let _ = parse_service(&text, Format::Json, &Origin::Body);
    }
}
