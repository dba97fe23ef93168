"use strict";
// The status page. It asks the agent for every proxy once, then follows the events stream:
// each event goes to the feed and to its proxy's timeline, and the proxies are asked for
// again (at most four times a second). The last hour's events come from the history on
// load. With a fleet, its nodes are asked for every two seconds. Uptimes tick locally.
// Every text the agent sends is put in as text, never as markup.

const HOUR = 3600 * 1000;
const PAGE_SIZE = 500;
const FEED_SIZE = 300;
const PER_PROXY = 256;

const rows = new Map();
const details = new Map();
const opened = new Set();
const timelines = new Map();
let proxies = [];
let byId = new Map();
let page = 0;
let refreshing = false, again = false, lastRefresh = 0;
const seenEvents = new Set();
const feedEvents = [];
const timings = { firstRender: null, lastApply: null, lastRefreshMs: null, rows: 0 };
window.tetherTimings = timings;

const body = document.getElementById("proxies");
const filter = document.getElementById("filter");
const feed = document.getElementById("feed");
const feedFilter = document.getElementById("feed-filter");

function text(value) { return value === null || value === undefined ? "-" : String(value); }

function element(name, attributes, ...children) {
  const node = document.createElement(name);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (key === "class") node.className = value; else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function uptime(proxy, now) {
  if (proxy.state !== "running" || !proxy.started_at) return "-";
  let s = Math.max(0, Math.floor((now - Date.parse(proxy.started_at)) / 1000));
  const d = Math.floor(s / 86400); s %= 86400;
  const h = Math.floor(s / 3600); s %= 3600;
  const m = Math.floor(s / 60); s %= 60;
  return (d ? d + "d " : "") + (d || h ? h + "h " : "") + (d || h || m ? m + "m " : "") + s + "s";
}

function lastExit(exit) {
  if (!exit) return "-";
  if ("code" in exit) return "code " + exit.code;
  if ("signal" in exit) return "signal " + exit.signal;
  return JSON.stringify(exit);
}

function cells(proxy, now) {
  const r = proxy.resources || null;
  return [
    proxy.id, proxy.service, proxy.state,
    proxy.ready === undefined ? "-" : (proxy.ready ? "yes" : "no"),
    text(proxy.pid), text(proxy.restarts), uptime(proxy, now),
    r && r.cpu_seconds !== undefined && r.cpu_seconds !== null ? r.cpu_seconds.toFixed(2) + "s" : "-",
    r && r.memory_bytes ? (r.memory_bytes / 1048576).toFixed(1) + " MiB" : "-",
    lastExit(proxy.last_exit), proxy.error || "",
  ];
}

const CLASSES = ["id", "service", "state", "ready", "pid num", "restarts num", "uptime", "cpu num", "mem num", "exit", "error"];

function matches(proxy, wanted) {
  return wanted === "" || (proxy.id + " " + proxy.service + " " + proxy.state).toLowerCase().includes(wanted);
}

function newRow(id) {
  const row = document.createElement("tr");
  row.dataset.proxy = id;
  for (const name of CLASSES) {
    const cell = document.createElement("td");
    cell.className = name;
    row.appendChild(cell);
  }
  row.children[0].title = "show or hide the detail";
  row.children[0].addEventListener("click", () => toggle(id));
  return row;
}

// The last lines of each open proxy's output, when the agent serves them over HTTP
// (`--http-logs`): asked for when its detail opens and after each of its events, at most
// once a second per proxy. `null`: not served here.
const LOG_LINES = 20;
const logs = new Map();
const logsAsked = new Map();
let logsServed = true;

async function refreshLogs(id) {
  if (!logsServed || !opened.has(id)) return;
  const last = logsAsked.get(id) || 0;
  if (Date.now() - last < 1000) return;
  logsAsked.set(id, Date.now());
  try {
    const answer = await fetch("/v1/agent/proxy/" + encodeURIComponent(id) + "/logs?lines=" + LOG_LINES, { cache: "no-store" });
    if (answer.status === 404) {
      // An open proxy is known: a 404 says the route is not served (no --http-logs).
      const said = await answer.json().catch(() => ({}));
      if (!String(said.error || "").includes(id)) { logsServed = false; render(); return; }
    }
    if (!answer.ok) return;
    logs.set(id, await answer.text());
    render();
  } catch (_) {
    // The agent is away: the next event asks again.
  }
}

function toggle(id) {
  if (opened.has(id)) opened.delete(id); else opened.add(id);
  if (opened.has(id)) refreshLogs(id); else { logs.delete(id); logsAsked.delete(id); }
  feedFilter.value = opened.has(id) ? id : "";
  renderFeed();
  render();
}

function render() {
  const now = Date.now();
  const wanted = filter.value.trim().toLowerCase();
  const counts = {};
  const shown = [];
  for (const proxy of proxies) {
    counts[proxy.state] = (counts[proxy.state] || 0) + 1;
    if (matches(proxy, wanted)) shown.push(proxy);
  }
  // Only one page of rows is in the document: a thousand proxies never freeze the browser.
  const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
  page = Math.min(page, pages - 1);
  const visible = shown.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE);
  document.getElementById("pages").hidden = pages === 1;
  document.getElementById("page").textContent = "page " + (page + 1) + " of " + pages + " (" + shown.length + " proxies)";
  const keep = new Set();
  for (const proxy of visible) {
    keep.add(proxy.id);
    let row = rows.get(proxy.id);
    if (!row) { row = newRow(proxy.id); rows.set(proxy.id, row); }
    const values = cells(proxy, now);
    let changed = false;
    values.forEach((value, index) => {
      const cell = row.children[index];
      if (cell.textContent !== value) {
        if (index !== 6) changed = changed || cell.textContent !== "";
        cell.textContent = value;
      }
    });
    row.children[2].className = "state state-" + proxy.state;
    row.classList.toggle("open", opened.has(proxy.id));
    if (changed) {
      row.classList.remove("changed");
      void row.offsetWidth;
      row.classList.add("changed");
    }
  }
  for (const [id, row] of rows) {
    if (!keep.has(id)) { row.remove(); rows.delete(id); }
  }
  for (const [id, detail] of details) {
    if (!keep.has(id) || !opened.has(id)) { detail.remove(); details.delete(id); }
  }
  // Keep the rows in the order the agent lists them (by id), each open one followed by
  // its detail.
  let previous = null;
  for (const proxy of visible) {
    const sequence = [rows.get(proxy.id)];
    if (opened.has(proxy.id)) sequence.push(detailOf(proxy, now));
    for (const node of sequence) {
      const expected = previous ? previous.nextSibling : body.firstChild;
      if (node !== expected) body.insertBefore(node, expected);
      previous = node;
    }
  }
  const parts = Object.keys(counts).sort().map((state) => counts[state] + " " + state);
  document.getElementById("summary").textContent =
    proxies.length + (proxies.length === 1 ? " proxy" : " proxies") + (parts.length ? ": " + parts.join(", ") : "");
}

function time(value) {
  if (!value) return "-";
  const at = new Date(value);
  return isNaN(at) ? String(value) : at.toLocaleString();
}

function verdict(result, error) {
  const good = result === "applied" || result === "signalled" || result === "rendered" || result === "unchanged";
  return element("span", { class: good ? "good" : "bad" }, result + (error ? ": " + error : ""));
}

// The detail of an open proxy: what the table has no room for. Built again on each render,
// which is cheap: only open proxies have one.
function detailOf(proxy, now) {
  let row = details.get(proxy.id);
  if (!row) {
    row = element("tr", { class: "detail" });
    row.dataset.detail = proxy.id;
    row.append(element("td", { colspan: String(CLASSES.length) }));
    details.set(proxy.id, row);
  }
  const list = element("dl");
  const add = (name, value, key) => {
    list.append(element("dt", {}, name), element("dd", key ? { "data-key": key } : {}, value));
  };
  add("state", proxy.state + (proxy.status_text ? " — " + proxy.status_text : ""), "state");
  if (proxy.state === "waiting" || proxy.state === "blocked") add("waiting for", proxy.error || "-", "waiting");
  if (proxy.depends_on && proxy.depends_on.length) {
    const list = element("span");
    proxy.depends_on.forEach((d, at) => {
      const other = d.proxy ? byId.get(d.proxy) : null;
      const state = other ? other.state : "not registered";
      const met = other && (d.condition === "started" ? other.pid : other.state === "running");
      if (at) list.append("; ");
      list.append(d.dependency + " (" + d.condition + "): ", element("span", { class: met ? "good" : "bad" }, state));
    });
    add("depends on", list, "depends-on");
  }
  if (proxy.update) {
    add("update", proxy.update.state + (proxy.update.pid ? " (pid " + proxy.update.pid + ")" : ""), "update");
  }
  if (proxy.last_reload) {
    add("last reload", element("span", {}, time(proxy.last_reload.at) + " ", verdict(proxy.last_reload.result, proxy.last_reload.error)), "last-reload");
  }
  if (proxy.last_xds) {
    const x = proxy.last_xds;
    add("last xDS", element("span", {}, time(x.at) + " " + (x.type || "") + " " + (x.version || "") + " ", verdict(x.result, x.error)), "last-xds");
  }
  if (proxy.generations && proxy.generations.length) {
    add("generations", proxy.generations.map((g) => "epoch " + g.epoch + " pid " + text(g.pid) + " " + g.role).join("; "), "generations");
  }
  if (proxy.certificate) {
    const c = proxy.certificate;
    const cert = element("span", {}, (c.spiffe_id || "-") + ", serial " + text(c.serial) + ", valid until " + time(c.not_after) +
      (c.next_renewal ? ", renewed from " + time(c.next_renewal) : ""));
    if (c.error) cert.append(" ", element("span", { class: "bad" }, c.error));
    add("certificate", cert, "certificate");
  }
  if (proxy.error && proxy.state !== "waiting" && proxy.state !== "blocked") {
    add("error", element("span", { class: "bad" }, proxy.error), "error");
  }
  if (proxy.templates && proxy.templates.length) {
    const list = element("span");
    proxy.templates.forEach((t, at) => {
      if (at) list.append("; ");
      list.append(t.destination + ": " + time(t.at) + " ", verdict(t.result, t.error));
    });
    add("templates", list, "templates");
  }
  if (logs.has(proxy.id)) {
    add("logs", element("pre", { class: "logs" }, logs.get(proxy.id) || "(nothing written yet)"), "logs");
  } else if (!logsServed) {
    add("logs", "tether logs " + proxy.id + " (the agent serves a proxy's output on its socket, and over HTTP only with --http-logs: it may hold secrets)", "logs");
  }
  const events = timelines.get(proxy.id) || [];
  const cell = row.firstChild;
  cell.replaceChildren(list, timeline(events, now), legend(), lastEvents(events));
  return row;
}

// What a mark on the timeline looks like: a shape and a class per kind of event, so that
// colour is never the only signal.
function markOf(name) {
  if (name === "started" || name === "restarted" || name === "ready") return { shape: "up", kind: "start" };
  if (name === "reloaded") return { shape: "diamond", kind: "reload" };
  if (name === "reload-failed") return { shape: "diamond", kind: "fail" };
  if (name === "stopped" || name === "held" || name === "removed") return { shape: "square", kind: "stop" };
  if (name === "exited" || name === "failed" || name === "backoff" || name === "unhealthy" || name.endsWith("-failed") ||
      name.endsWith("-refused") || name.endsWith("-invalid") || name.endsWith("-expired")) return { shape: "down", kind: "fail" };
  return { shape: "dot", kind: "stop" };
}

const SVG = "http://www.w3.org/2000/svg";

function svg(name, attributes) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  return node;
}

// The last hour of one proxy as marks on a line: restarts, failures, reloads.
function timeline(events, now) {
  const width = 600, height = 40, left = 4, right = 596, y = 20;
  const chart = svg("svg", { class: "timeline", viewBox: "0 0 " + width + " " + height, role: "img" });
  chart.setAttribute("aria-label", "the last hour: " + events.length + " events");
  chart.append(svg("line", { class: "axis", x1: left, x2: right, y1: y, y2: y }));
  const label = (x, words, anchor) => {
    const t = svg("text", { x, y: height - 2, "text-anchor": anchor });
    t.textContent = words;
    chart.append(t);
  };
  label(left, "1 hour ago", "start");
  label(right, "now", "end");
  for (const event of events) {
    const at = Date.parse(event.time);
    if (!(now - at <= HOUR)) continue;
    const x = left + (right - left) * (1 - (now - at) / HOUR);
    const mark = markOf(event.event);
    let shape;
    if (mark.shape === "up") shape = svg("path", { d: `M${x} ${y - 7} L${x + 5} ${y + 2} L${x - 5} ${y + 2} Z` });
    else if (mark.shape === "diamond") shape = svg("path", { d: `M${x} ${y - 6} L${x + 5} ${y} L${x} ${y + 6} L${x - 5} ${y} Z` });
    else if (mark.shape === "square") shape = svg("rect", { x: x - 4, y: y - 4, width: 8, height: 8 });
    else if (mark.shape === "down") shape = svg("path", { d: `M${x} ${y + 7} L${x + 5} ${y - 2} L${x - 5} ${y - 2} Z` });
    else shape = svg("circle", { cx: x, cy: y, r: 3 });
    shape.setAttribute("class", "mark " + mark.kind);
    shape.dataset.event = event.event;
    const title = svg("title", {});
    title.textContent = time(event.time) + " " + event.event + (event.detail ? ": " + event.detail : "");
    shape.append(title);
    chart.append(shape);
  }
  return chart;
}

function legend() {
  return element("div", { class: "legend" }, "▲ started, restarted or ready · ▼ exited or failed · ◆ reloaded (red: refused or failed) · ■ stopped");
}

function lastEvents(events) {
  const list = element("ul", { class: "legend" });
  for (const event of events.slice(-5).reverse()) {
    list.append(element("li", {}, time(event.time) + " " + event.event + (event.pid ? " (pid " + event.pid + ")" : "") + (event.detail ? ": " + event.detail : "")));
  }
  return list;
}

function keyOf(event) { return event.time + " " + event.proxy + " " + event.event + " " + event.pid; }

// One event, from the history or the stream: kept once, for the feed and its timeline.
function told(event) {
  // The agent's own events (the store lost or back) name no proxy.
  if (event.proxy === null || event.proxy === undefined) event.proxy = "(agent)";
  const key = keyOf(event);
  if (seenEvents.has(key)) return false;
  seenEvents.add(key);
  let list = timelines.get(event.proxy);
  if (!list) { list = []; timelines.set(event.proxy, list); }
  list.push(event);
  if (list.length > PER_PROXY) list.splice(0, list.length - PER_PROXY);
  if (opened.has(event.proxy)) refreshLogs(event.proxy);
  feedEvents.push(event);
  if (feedEvents.length > FEED_SIZE * 4) feedEvents.splice(0, feedEvents.length - FEED_SIZE * 4);
  // A page left open for days keeps only the keys of the events it still holds.
  if (seenEvents.size > 4 * (FEED_SIZE * 4 + PER_PROXY * timelines.size)) {
    seenEvents.clear();
    for (const kept of [...feedEvents, ...[...timelines.values()].flat()]) {
      seenEvents.add(keyOf(kept));
    }
  }
  return true;
}

function renderFeed() {
  const wanted = feedFilter.value.trim();
  const items = [];
  for (let i = feedEvents.length - 1; i >= 0 && items.length < FEED_SIZE; i--) {
    const event = feedEvents[i];
    if (wanted !== "" && !event.proxy.includes(wanted)) continue;
    const item = element("li", {}, element("span", { class: "time" }, time(event.time)), " ", event.proxy, " ",
      element("span", { class: "what " + markOf(event.event).kind }, event.event),
      event.pid ? " pid " + event.pid : null, event.detail ? ": " + event.detail : null);
    item.dataset.proxy = event.proxy;
    item.dataset.event = event.event;
    items.push(item);
  }
  feed.replaceChildren(...items);
}

async function refresh() {
  if (refreshing) { again = true; return; }
  refreshing = true;
  try {
    const wait = 250 - (Date.now() - lastRefresh);
    if (wait > 0) await new Promise((done) => setTimeout(done, wait));
    lastRefresh = Date.now();
    const began = performance.now();
    const answer = await fetch("/v1/agent/proxies", { cache: "no-store" });
    if (answer.ok) {
      proxies = await answer.json();
      byId = new Map(proxies.map((proxy) => [proxy.id, proxy]));
      render();
      const now = performance.now();
      if (timings.firstRender === null) timings.firstRender = now;
      timings.lastApply = now;
      timings.lastRefreshMs = now - began;
      timings.rows = proxies.length;
    }
  } catch (error) {
    // The stream's own reconnection reports a lost agent.
  } finally {
    refreshing = false;
    if (again) { again = false; refresh(); }
  }
}

async function history() {
  try {
    const answer = await fetch("/v1/agent/history", { cache: "no-store" });
    if (!answer.ok) return;
    for (const event of await answer.json()) told(event);
    renderFeed();
    render();
  } catch (error) {
    // The history is a help, not a need: the stream goes on without it.
  }
}

async function follow() {
  const status = document.getElementById("connection");
  let delay = 500;
  const decoder = new TextDecoder();
  for (;;) {
    try {
      const answer = await fetch("/v1/agent/events", { cache: "no-store" });
      if (!answer.ok || !answer.body) throw new Error("status " + answer.status);
      status.textContent = "live";
      status.className = "";
      delay = 500;
      refresh();
      history();
      const reader = answer.body.getReader();
      let pending = "";
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        pending += decoder.decode(value, { stream: true });
        const lines = pending.split("\n");
        pending = lines.pop();
        let any = false;
        for (const line of lines) {
          if (line.trim() === "") continue;
          try { any = told(JSON.parse(line)) || any; } catch (error) { /* not an event */ }
        }
        if (any) renderFeed();
        refresh();
      }
    } catch (error) {
      // Reconnected below.
    }
    status.textContent = "agent unreachable; retrying";
    status.className = "lost";
    await new Promise((done) => setTimeout(done, delay));
    delay = Math.min(delay * 2, 10000);
  }
}

// The fleet's nodes, as the agent reads them from the store; hidden when the agent follows
// no store.
async function fleet() {
  const section = document.getElementById("fleet");
  try {
    const answer = await fetch("/v1/agent/fleet/nodes", { cache: "no-store" });
    if (answer.status === 404) { section.hidden = true; return; }
    section.hidden = false;
    const summary = document.getElementById("fleet-summary");
    if (!answer.ok) {
      const failure = await answer.json().catch(() => ({}));
      summary.replaceChildren(element("span", { class: "bad" }, "the store cannot be read: " + (failure.error || answer.status)));
      return;
    }
    const view = await answer.json();
    const up = view.nodes.filter((node) => node.state === "up").length;
    summary.replaceChildren(element("span", { class: view.ok ? "good" : "bad" },
      view.nodes.length + " nodes, " + up + " up; " + (view.ok ? "converged" : "not converged")));
    const progress = new Map();
    for (const rollout of view.rollouts || []) {
      rollout.nodes.forEach((name, index) => {
        const word = index < rollout.next ? "done" : index < rollout.next + rollout.max_parallel ? "in progress" : "pending";
        progress.set(name, word + " (" + Object.keys(rollout.services).join(", ") + ")");
      });
    }
    const table = [];
    for (const node of view.nodes) {
      const ready = node.proxies.filter((p) => p.ready).length;
      const running = [...new Set(node.proxies.map((p) => p.running_revision).filter((r) => r !== null))];
      const desired = [...new Set(node.proxies.map((p) => p.desired_revision).filter((r) => r !== null))];
      const row = element("tr", {},
        element("td", {}, node.node),
        element("td", { class: node.state === "up" ? "state state-running" : "state state-failed" }, node.state),
        element("td", { class: "num" }, ready), element("td", { class: "num" }, node.proxies.length - ready),
        element("td", {}, running.join(", ") || "-"), element("td", {}, desired.join(", ") || "-"),
        element("td", {}, progress.get(node.node) || "-"));
      row.dataset.node = node.node;
      table.push(row);
    }
    document.getElementById("nodes").replaceChildren(...table);
  } catch (error) {
    // Asked again below.
  }
}

document.getElementById("previous").addEventListener("click", () => { page = Math.max(0, page - 1); render(); });
document.getElementById("next").addEventListener("click", () => { page += 1; render(); });
filter.addEventListener("input", () => { page = 0; render(); });
feedFilter.addEventListener("input", renderFeed);
setInterval(render, 1000);
setInterval(fleet, 2000);
fleet();
refresh();
follow();
