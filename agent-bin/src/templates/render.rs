//! Rendering one template: the Jinja2 language (minijinja), the data a template sees, and
//! the instances it asks for through [`InstanceSource`].
//!
//! This module reads no file and writes none: the text comes in, the bytes go out.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex};

use minijinja::{AutoEscape, Environment, UndefinedBehavior};
use serde::Serialize;
use tether_state::Service;

/// A service as a template sees it: in `service`, `services` and (with its node) the
/// entries of `instances(name)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ServiceData {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) address: String,
    pub(crate) port: Option<u16>,
    pub(crate) tags: Vec<String>,
    pub(crate) meta: BTreeMap<String, String>,
}

impl From<&Service> for ServiceData {
    fn from(service: &Service) -> Self {
        Self {
            id: service.id.as_str().to_owned(),
            name: service.name.as_str().to_owned(),
            address: service.address.clone(),
            port: service.port,
            tags: service.tags.clone(),
            meta: service.meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        }
    }
}

/// One ready instance of a service, as `instances(name)` lists it: the fleet's record of it,
/// whichever source found it.
pub(crate) use crate::etcd::Instance;

/// Where the ready instances of a service are found: this agent's catalog, or the fleet's
/// `instances/<name>/` prefix in etcd. One source per agent, which the templates'
/// `instances(name)`, the xDS server's endpoints and the built-in proxies' upstreams share.
pub(crate) trait InstanceSource: Send + Sync {
    /// The ready instances of the services named `name`, in any order; `Err` with the reason
    /// when they are not known (the render fails, and the last good file stays). It may
    /// block until the first answer about `name`: call it from a blocking thread.
    fn instances(&self, name: &str) -> Result<Vec<Instance>, String>;

    /// What is known of `name` now, without waiting: `None` until its first answer (a
    /// source that learns names as they are asked for starts learning this one).
    fn known(&self, name: &str) -> Option<Vec<Instance>> {
        self.instances(name).ok()
    }

    /// A generation bumped whenever what the source knows changes, for readers that follow
    /// it; `None` for a source whose changes are the catalog's and the proxies' readiness,
    /// which those readers follow already.
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
}

/// What every template of an agent sees besides its own service.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SharedData {
    /// This agent's node name, if it has one.
    pub(crate) node: Option<String>,
    /// Every service of the catalog, by id.
    pub(crate) services: Vec<ServiceData>,
}

#[derive(Serialize)]
struct Context<'a> {
    service: &'a ServiceData,
    node: &'a Option<String>,
    services: &'a [ServiceData],
}

/// A template's output, and the service names it asked `instances` for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rendered {
    pub(crate) text: String,
    pub(crate) instances_of: BTreeSet<String>,
}

/// Why a template did not render: a syntax error or an error while it ran.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) struct RenderError {
    /// The 1-based line of the template, when known.
    pub(crate) line: Option<usize>,
    /// What went wrong, in the language's words.
    pub(crate) reason: String,
}

impl fmt::Display for RenderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}", self.reason),
            None => f.write_str(&self.reason),
        }
    }
}

impl From<minijinja::Error> for RenderError {
    fn from(err: minijinja::Error) -> Self {
        let reason = match err.detail() {
            Some(detail) => format!("{}: {detail}", err.kind()),
            None => err.kind().to_string(),
        };
        Self { line: err.line(), reason }
    }
}

/// The language as templates get it: no escaping (these are config files, not HTML),
/// undefined names are errors (a typo must not render an empty backend list), and a
/// template's last newline is kept.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_keep_trailing_newline(true);
    env
}

/// Checks that `text` parses, without rendering it.
///
/// # Errors
///
/// The syntax error, with its line.
pub(crate) fn check_syntax(name: &str, text: &str) -> Result<(), RenderError> {
    let env = environment();
    env.template_from_named_str(name, text)?;
    Ok(())
}

/// Collects a render's output and refuses to grow beyond `max_size` bytes, so that a
/// template that renders too much fails as soon as it passes the cap instead of after it has
/// built the whole text.
struct Capped {
    bytes: Vec<u8>,
    max_size: u64,
    exceeded: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let total = u64::try_from(self.bytes.len() + buf.len()).unwrap_or(u64::MAX);
        if total > self.max_size {
            self.exceeded = true;
            return Err(std::io::Error::other("the output is too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Renders `text` (named `name` in errors) for `service`, into at most `max_size` bytes.
///
/// # Errors
///
/// A syntax error, or an error while it runs (an undefined name, a bad filter argument),
/// with its line; an output of more than `max_size` bytes.
pub(crate) fn render(
    name: &str,
    text: &str,
    service: &ServiceData,
    shared: &SharedData,
    instances: Arc<dyn InstanceSource>,
    max_size: u64,
) -> Result<Rendered, RenderError> {
    let mut env = environment();
    let asked: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let recorder = asked.clone();
    env.add_function("instances", move |name: String| {
        // Recorded first: a name whose instances are not known yet renders again once they are.
        tether_state::lock(&recorder).insert(name.clone());
        let mut found = instances
            .instances(&name)
            .map_err(|reason| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, reason))?;
        found.sort_by(|a, b| (&a.node, &a.id).cmp(&(&b.node, &b.id)));
        Ok::<_, minijinja::Error>(minijinja::Value::from_serialize(found))
    });
    let context = Context { service, node: &shared.node, services: &shared.services };
    let template = env.template_from_named_str(name, text)?;
    let mut out = Capped { bytes: Vec::new(), max_size, exceeded: false };
    match template.render_captured_to(context, &mut out) {
        Ok(_) => {}
        Err(_) if out.exceeded => {
            return Err(RenderError {
                line: None,
                reason: format!("it renders more than its max_size of {max_size} bytes"),
            });
        }
        Err(err) => return Err(err.into()),
    }
    let text = String::from_utf8(out.bytes)
        .map_err(|_| RenderError { line: None, reason: "it renders bytes that are not UTF-8".to_owned() })?;
    let instances_of = std::mem::take(&mut *tether_state::lock(&asked));
    Ok(Rendered { text, instances_of })
}

#[cfg(test)]
mod tests {
    use tether_state::config::{Format, Origin, parse_file};

    use super::*;

    const MAX: u64 = tether_state::DEFAULT_TEMPLATE_MAX_SIZE;

    fn services(text: &str) -> Vec<Service> {
        parse_file(text, Format::Toml, &Origin::Body).unwrap()
    }

    struct Fixed(Vec<Instance>);

    impl InstanceSource for Fixed {
        fn instances(&self, name: &str) -> Result<Vec<Instance>, String> {
            Ok(self.0.iter().filter(|i| i.meta.get("of").is_some_and(|of| of == name)).cloned().collect())
        }
    }

    fn instance(node: Option<&str>, id: &str, port: u16) -> Instance {
        Instance {
            node: node.map(str::to_owned),
            id: id.into(),
            address: "10.0.0.1".into(),
            port: Some(port),
            tags: vec!["v1".into()],
            meta: BTreeMap::from([("of".to_owned(), "api".to_owned())]),
            mesh: None,
        }
    }

    fn data() -> (ServiceData, SharedData) {
        let all = services(
            "[[service]]\nname = \"web\"\nport = 80\ntags = [\"edge\"]\nmeta = { team = \"a\" }\n\
             [[service]]\nname = \"api\"\nid = \"api-1\"\naddress = \"10.1.1.1\"\n",
        );
        let shared = SharedData { node: Some("n1".into()), services: all.iter().map(ServiceData::from).collect() };
        (ServiceData::from(&all[0]), shared)
    }

    #[test]
    fn a_template_sees_its_service_the_node_and_every_service() {
        let (service, shared) = data();
        let text = "{{ service.id }} {{ service.name }} {{ service.address }}:{{ service.port }} \
                    {{ service.tags | join(',') }} {{ service.meta.team }} node={{ node }}\n\
                    {% for s in services %}{{ s.id }}={{ s.address }}:{{ s.port }};{% endfor %}\n";
        let rendered = render("/etc/web.conf", text, &service, &shared, Arc::new(Fixed(Vec::new())), MAX).unwrap();
        assert_eq!(
            rendered.text, "web web 127.0.0.1:80 edge a node=n1\nweb=127.0.0.1:80;api-1=10.1.1.1:None;\n",
            "null is None, as in Jinja2"
        );
        assert!(rendered.instances_of.is_empty());

        let no_node = SharedData { node: None, ..shared };
        let rendered = render("t", "{{ node is none }}", &service, &no_node, Arc::new(Fixed(Vec::new())), MAX).unwrap();
        assert_eq!(rendered.text, "True");
    }

    #[test]
    fn instances_are_sorted_by_node_then_id_and_their_names_recorded() {
        let (service, shared) = data();
        let source = Fixed(vec![
            instance(Some("n2"), "api-a", 1),
            instance(Some("n1"), "api-b", 2),
            instance(Some("n1"), "api-a", 3),
        ]);
        let text = "{% for i in instances('api') %}{{ i.node }}/{{ i.id }}:{{ i.port }} {% endfor %}\
                    {{ instances('db') | length }}";
        let rendered = render("t", text, &service, &shared, Arc::new(source), MAX).unwrap();
        assert_eq!(rendered.text, "n1/api-a:3 n1/api-b:2 n2/api-a:1 0");
        assert_eq!(rendered.instances_of, BTreeSet::from(["api".to_owned(), "db".to_owned()]));
    }

    #[test]
    fn errors_name_their_line_and_reason() {
        let (service, shared) = data();
        let source: Arc<dyn InstanceSource> = Arc::new(Fixed(Vec::new()));
        let error = render("t", "ok\n{% for x in %}\n", &service, &shared, source.clone(), MAX).unwrap_err();
        assert_eq!(error.line, Some(2), "{error}");
        assert!(error.to_string().starts_with("line 2: syntax error"), "{error}");
        let error = render("t", "a\nb\n{{ service.nmae }}\n", &service, &shared, source.clone(), MAX).unwrap_err();
        assert_eq!(error.line, Some(3), "{error}");
        assert!(error.reason.contains("undefined"), "{error}");
        let error = check_syntax("t", "{% if %}").unwrap_err();
        assert_eq!(error.line, Some(1));
        check_syntax("t", "{{ instances('api') | length }}").unwrap();
    }

    #[test]
    fn nothing_is_escaped_and_the_last_newline_stays() {
        let (mut service, shared) = data();
        service.name = "<a & b>".into();
        let rendered = render("x.html", "{{ service.name }}\n", &service, &shared, Arc::new(Fixed(Vec::new())), MAX);
        assert_eq!(rendered.unwrap().text, "<a & b>\n");
    }

    #[test]
    fn a_render_beyond_its_max_size_fails() {
        let service = ServiceData::from(&services("[[service]]\nname = \"web\"\n")[0]);
        let shared = SharedData { node: None, services: vec![service.clone()] };
        let source: Arc<dyn InstanceSource> = Arc::new(Fixed(Vec::new()));
        let text = "{% for i in range(10) %}{{ 'x' * 100 }}{% endfor %}";
        assert_eq!(render("t", text, &service, &shared, source.clone(), 1000).unwrap().text.len(), 1000);
        let error = render("t", text, &service, &shared, source, 999).unwrap_err();
        assert_eq!(error.to_string(), "it renders more than its max_size of 999 bytes");
    }
}
