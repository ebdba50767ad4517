// The hub's status page: polls the admin JSON API (docs/hub-api.md) every 2 s with the admin
// credential kept in this tab's sessionStorage. Every value from the API goes into the page as
// text (textContent, attribute values), never as HTML.
"use strict";

const STORAGE = "alp-hub-admin";
// every 2 s; `?poll=MS` (250 to 60000) for a quicker or slower page
const POLL_MS = Math.min(Math.max(Number(new URLSearchParams(location.search).get("poll")) || 2000, 250), 60000);
const HOUR = 3600;
const SVG = "http://www.w3.org/2000/svg";
const DAY = 24 * HOUR;
let lastUsage = null; // the last answer of /api/hub/usage: the chart's view redraws from it
const COLORS = ["#2f6fdb", "#e07b24", "#2a9d5c", "#b8427a", "#7a5cc7", "#8a7a12", "#1f9bb0", "#c23b3b"];

let timer = null;
let generation = 0; // bumped at sign-out: answers of an older sign-in are dropped
let team = null; // whether the hub is a replica of a team: null until it said (asked once alone)
let person = null; // who signed in with the team's identity provider (GET /auth/me), else null

const $ = (id) => document.getElementById(id);

class Refused extends Error {}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    tr.append(cell instanceof Node ? cell : el("td", cell === null || cell === undefined ? "–" : cell));
  }
  return tr;
}

function td(child) {
  const cell = document.createElement("td");
  cell.append(child);
  return cell;
}

function fill(tableId, rows, emptyFor) {
  $(tableId).querySelector("tbody").replaceChildren(...rows);
  const empty = document.querySelector(`.empty[data-for="${emptyFor || tableId}"]`);
  if (empty) empty.hidden = rows.length > 0;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  if (value < 60) return `${value.toFixed(1)} s`;
  if (value < 3600) return `${Math.floor(value / 60)} min ${Math.floor(value % 60)} s`;
  return `${(value / 3600).toFixed(1)} h`;
}

function token() {
  return sessionStorage.getItem(STORAGE);
}

async function api(method, path, body) {
  // a person's page session rides on its cookie, each change with its CSRF token; the admin
  // credential is a bearer token
  const headers = person ? {} : { authorization: `Bearer ${token()}` };
  if (person && method !== "GET") headers["x-csrf-token"] = person.csrf;
  const init = { method, headers, cache: "no-store", credentials: "same-origin" };
  if (body !== undefined) {
    headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  let data = null;
  try {
    data = await resp.json();
  } catch (_) {
    data = null;
  }
  if (resp.status === 401 || resp.status === 403) throw new Refused("refused");
  if (!resp.ok) {
    const message = data && data.error && data.error.message ? data.error.message : `HTTP ${resp.status}`;
    throw new Error(message);
  }
  return data;
}

// -- sign in and out -----------------------------------------------------------------

async function signIn(event) {
  event.preventDefault();
  const value = $("token").value.trim();
  $("signin-error").textContent = "";
  if (!value) return;
  sessionStorage.setItem(STORAGE, value);
  try {
    await api("GET", "/api/hub/runners");
  } catch (err) {
    sessionStorage.removeItem(STORAGE);
    $("signin-error").textContent =
      err instanceof Refused ? "That is not the admin credential of this hub." : `Cannot reach the hub: ${err.message}`;
    return;
  }
  $("token").value = "";
  start();
}

function signOut(message) {
  if (person) return signOutPerson(message);
  generation += 1;
  if (timer !== null) clearTimeout(timer);
  timer = null;
  sessionStorage.removeItem(STORAGE);
  team = null;
  $("replicas-section").hidden = true;
  $("dashboard").hidden = true;
  $("signout").hidden = true;
  $("signin-section").hidden = false;
  $("status").textContent = "";
  $("signin-error").textContent = message || "";
}

function start() {
  $("signin-section").hidden = true;
  $("dashboard").hidden = false;
  $("signout").hidden = false;
  poll(generation);
}

async function poll(gen) {
  if (gen !== generation) return;
  try {
    await refresh(gen);
    if (gen === generation) $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    if (gen !== generation) return;
    if (err instanceof Refused) {
      signOut(refusedMessage());
      return;
    }
    $("status").textContent = `the hub did not answer: ${err.message}`;
  }
  if (gen === generation) timer = setTimeout(() => poll(gen), POLL_MS);
}

// -- the sections --------------------------------------------------------------------

async function refresh(gen) {
  if (person && person.role !== "admin") return refreshMember(gen);
  // 30 days of hourly totals: the chart draws the last 24 hours per hour or the last 30 days
  // per day (UTC days) from them, without asking again when its view changes
  const since = Math.floor(Date.now() / 1000 / DAY) * DAY - 29 * DAY;
  const [runners, turns, sessions, usage, keys, replicas, prices] = await Promise.all([
    api("GET", "/api/hub/runners"),
    api("GET", "/api/hub/turns"),
    api("GET", "/api/hub/sessions"),
    api("GET", `/api/hub/usage?since=${since}`),
    api("GET", "/api/hub/keys"),
    team === false ? null : api("GET", "/api/hub/replicas"), // a hub alone stays alone
    api("GET", "/api/hub/prices"),
  ]);
  if (gen !== generation) return;
  const names = {};
  for (const r of runners.runners) names[r.id] = r.name || r.id;
  if (replicas !== null) {
    team = replicas.team;
    if (team) showReplicas(replicas.replicas, names);
  }
  showRunners(runners.runners);
  showTurns(turns.turns, names);
  showSessions(sessions.sessions, names);
  lastUsage = usage;
  showUsage();
  showKeys(keys.keys, keys.limitsSupported);
  if (person) await refreshPeopleUsage(gen, Math.floor(Date.now() / 1000 / HOUR) * HOUR - 23 * HOUR);
  showPrices(prices);
}

function showPrices(answer) {
  const money = (v) => (v === null || v === undefined ? null : `${v} ${answer.currency}`);
  fill(
    "prices",
    answer.prices.map((p) => {
      const tr = row([
        p.model,
        money(p.input),
        money(p.output),
        p.watts === null ? null : `${p.watts} W at ${p.kwhPrice} ${answer.currency}/kWh`,
        p.referenceInput === null && p.referenceOutput === null
          ? null
          : `${p.reference || ""} ${money(p.referenceInput) || "–"} / ${money(p.referenceOutput) || "–"}`,
      ]);
      tr.dataset.model = p.model;
      return tr;
    }),
  );
}

function showReplicas(replicas, names) {
  $("replicas-section").hidden = false;
  const self = replicas.find((r) => r.self);
  $("this-replica").textContent = self ? self.id : "?";
  fill(
    "replicas",
    replicas.map((r) => {
      const state = r.up ? "up" : r.stopped ? "stopped" : "down";
      const tr = row([
        r.self ? `${r.id} (this one)` : r.id,
        r.url,
        el("td", state, r.up ? "up" : "down"),
        `${seconds(r.heartbeatSeconds)} ago`,
        r.version,
        r.channels,
        r.runners.map((id) => names[id] || id).join(", "),
      ]);
      tr.dataset.id = r.id;
      tr.dataset.state = state;
      return tr;
    }),
  );
}

function showRunners(runners) {
  fill(
    "runners",
    runners.map((r) => {
      const up = el("td", r.up ? "up" : "down", r.up ? "up" : "down");
      const tr = row([
        r.name || r.id,
        up,
        r.labels.join(", "),
        r.models === null ? "(not listed yet)" : r.models.join(", "),
        `${r.owner}/${r.project}`,
        r.sessions,
        r.turnsInFlight,
        `${seconds(r.lastSeenSeconds)} ago`,
        r.tier,
        revokeRunnerButton(r),
      ]);
      tr.dataset.id = r.id;
      tr.dataset.name = r.name || "";
      tr.dataset.tier = r.tier;
      return tr;
    }),
  );
}

function showTurns(turns, names) {
  fill(
    "turns",
    turns.map((t) => {
      const tr = row([
        t.key,
        t.session,
        t.api,
        t.model,
        t.runnerId ? names[t.runnerId] || t.runnerId : null,
        seconds(t.ageSeconds),
        t.ttftSeconds === null ? null : seconds(t.ttftSeconds),
        t.chunks,
        t.tokensPerSecond,
      ]);
      tr.dataset.key = t.key;
      return tr;
    }),
  );
}

function showSessions(sessions, names) {
  fill(
    "sessions",
    sessions.map((s) => {
      const tr = row([
        s.key,
        s.session,
        s.runnerId ? names[s.runnerId] || s.runnerId : null,
        s.jobId ? s.jobId.slice(0, 8) : null,
        s.turns,
        seconds(s.idleSeconds),
      ]);
      tr.dataset.key = s.key;
      return tr;
    }),
  );
}

function limitsText(k) {
  const src = k.limits && typeof k.limits === "object" ? k.limits : k;
  const parts = [];
  const labels = [
    ["rpm", "req/min"],
    ["tpm", "tok/min"],
    ["tokensPerDay", "tok/day"],
    ["maxStreams", "streams"],
  ];
  for (const [field, label] of labels) {
    const value = src[field] ?? src[field.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`)];
    if (value !== null && value !== undefined) parts.push(`${value} ${label}`);
  }
  return parts.length ? parts.join(", ") : "none";
}

function showKeys(keys, limitsSupported) {
  fill(
    "keys",
    keys.map((k) => {
      const used = k.used || { turns: 0, promptTokens: 0, completionTokens: 0, refused: 0 };
      let action = el("td", "");
      if (!k.revoked) {
        const button = el("button", "Revoke");
        button.type = "button";
        button.addEventListener("click", () => revoke(k.name, button));
        action = td(button);
      }
      const tr = row([
        k.name,
        `${k.owner}/${k.project}`,
        k.createdAt,
        limitsText(k),
        used.turns,
        used.promptTokens + used.completionTokens,
        used.refused,
        el("td", k.revoked ? "revoked" : "active", k.revoked ? "down" : "up"),
        k.person ? k.person.email || k.person.sub : null, // who made it (a signed-in person)
        action,
      ]);
      tr.dataset.name = k.name;
      return tr;
    }),
  );
  for (const input of $("limits").querySelectorAll("input")) input.disabled = !limitsSupported;
  $("limits-note").hidden = limitsSupported;
}

function showUsage() {
  if (lastUsage === null) return;
  const chart = $("usage-chart");
  const month = $("usage-span").value === "month";
  const cost = $("usage-measure").value === "cost";
  const byModel = $("usage-by").value === "model";
  const currency = lastUsage.currency || "";
  const step = month ? DAY : HOUR;
  const slots = month ? 30 : 24;
  const since = month
    ? Math.floor(Date.now() / 1000 / DAY) * DAY - 29 * DAY
    : Math.floor(Date.now() / 1000 / HOUR) * HOUR - 23 * HOUR;
  const byHour = new Map(); // slot index -> Map(key or model -> tokens or cost)
  const keys = [];
  let most = 0;
  let rows = 0;
  for (const r of lastUsage.usage) {
    const slot = Math.floor((r.hour - since) / step);
    if (slot < 0 || slot >= slots) continue;
    rows += 1;
    const name = byModel ? r.model || "(default)" : r.key;
    if (!keys.includes(name)) keys.push(name);
    const hour = byHour.get(slot) || new Map();
    const value = cost ? r.cost || 0 : r.promptTokens + r.completionTokens;
    hour.set(name, (hour.get(name) || 0) + value);
    byHour.set(slot, hour);
  }
  const shown = (v) => (cost ? `${v.toFixed(v && v < 1 ? 4 : 2)} ${currency}` : v.toLocaleString());
  for (const hour of byHour.values()) {
    let sum = 0;
    for (const v of hour.values()) sum += v;
    most = Math.max(most, sum);
  }
  document.querySelector('.empty[data-for="usage"]').hidden = rows > 0;
  chart.hidden = rows === 0;
  keys.sort();
  const width = 760;
  const height = 220;
  const left = cost ? 84 : 56; // room for the top value's label
  const bottom = 24;
  const plotH = height - bottom - 10;
  const barW = (width - left) / slots;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "xMinYMin meet");
  svg.setAttribute("role", "img");
  const what = `${cost ? "Cost" : "Tokens"} per ${month ? "day" : "hour"} and ${byModel ? "model" : "key"}`;
  svg.setAttribute("aria-label", `${what}, last ${month ? "30 days" : "24 hours"}`);
  svg.dataset.view = `${month ? "month" : "day"}-${cost ? "cost" : "tokens"}-${byModel ? "model" : "key"}`;
  const text = (x, y, value, anchor) => {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", x);
    t.setAttribute("y", y);
    t.setAttribute("text-anchor", anchor || "middle");
    t.setAttribute("class", "axis");
    t.textContent = value;
    svg.append(t);
  };
  const axis = document.createElementNS(SVG, "line");
  axis.setAttribute("x1", left);
  axis.setAttribute("x2", width);
  axis.setAttribute("y1", height - bottom);
  axis.setAttribute("y2", height - bottom);
  axis.setAttribute("class", "axisline");
  svg.append(axis);
  text(left - 6, 16, most ? shown(most) : "0", "end");
  text(left - 6, height - bottom, "0", "end");
  for (let slot = 0; slot < slots; slot++) {
    const start = new Date((since + slot * step) * 1000);
    const label = month
      ? `${start.getUTCMonth() + 1}/${start.getUTCDate()}`
      : `${String(start.getHours()).padStart(2, "0")}:00`;
    if (slot % (month ? 5 : 3) === 0) text(left + slot * barW + barW / 2, height - 6, label);
    const hour = byHour.get(slot);
    if (!hour || !most) continue;
    let y = height - bottom;
    for (const key of keys) {
      const tokens = hour.get(key) || 0;
      if (!tokens) continue;
      const h = (tokens / most) * plotH;
      y -= h;
      const bar = document.createElementNS(SVG, "rect");
      bar.setAttribute("x", left + slot * barW + 2);
      bar.setAttribute("y", y);
      bar.setAttribute("width", barW - 4);
      bar.setAttribute("height", Math.max(h, 1));
      bar.setAttribute("fill", COLORS[keys.indexOf(key) % COLORS.length]);
      bar.setAttribute("data-key", key);
      const title = document.createElementNS(SVG, "title");
      title.textContent = `${key}, ${start.toLocaleString()}: ${shown(tokens)}${cost ? "" : " tokens"}`;
      bar.append(title);
      svg.append(bar);
    }
  }
  const legend = el("p", null, "legend");
  keys.forEach((key, i) => {
    const swatch = el("span", "■ ", "swatch");
    swatch.dataset.color = String(i % COLORS.length);
    const item = el("span", null, "legend-item");
    item.append(swatch, document.createTextNode(key));
    legend.append(item);
  });
  chart.replaceChildren(svg, legend);
}

// -- keys ----------------------------------------------------------------------------

async function createKey(event) {
  event.preventDefault();
  const form = event.target;
  $("key-error").textContent = "";
  const body = { name: form.elements.name.value.trim() };
  const project = form.elements.project.value.trim();
  if (project) body.project = project;
  for (const field of ["rpm", "tpm", "tokensPerDay", "maxStreams"]) {
    const input = form.elements[field];
    if (!input.disabled && input.value !== "") body[field] = Number(input.value);
  }
  try {
    const made = await api("POST", "/api/hub/keys", body);
    $("new-key-name").textContent = made.name;
    $("new-key-value").textContent = made.key;
    $("new-key").hidden = false;
    form.reset();
    await refresh(generation);
  } catch (err) {
    if (err instanceof Refused) return signOut(refusedMessage());
    $("key-error").textContent = err.message;
  }
}

function revokeRunnerButton(r) {
  const button = el("button", "Revoke");
  button.type = "button";
  button.title = "Refuse this runner from now on; its sessions move to another runner";
  button.addEventListener("click", () => revokeRunner(r.id, button));
  return td(button);
}

async function revokeRunner(id, button) {
  button.disabled = true;
  $("runner-error").textContent = "";
  try {
    await api("POST", "/api/hub/runners/revoke", { runner: id });
    await refresh(generation);
  } catch (err) {
    if (err instanceof Refused) return signOut("The admin credential was refused: sign in again.");
    $("runner-error").textContent = err.message;
    button.disabled = false;
  }
}

async function revoke(name, button) {
  button.disabled = true;
  $("key-error").textContent = "";
  try {
    await api("POST", "/api/hub/keys/revoke", { name });
    await refresh(generation);
  } catch (err) {
    if (err instanceof Refused) return signOut(refusedMessage());
    $("key-error").textContent = err.message;
    button.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin").addEventListener("submit", signIn);
  $("signin-fields").disabled = false; // the form can be used once this script handles it
  $("signout").addEventListener("click", () => signOut());
  $("create-key").addEventListener("submit", createKey);
  for (const id of ["usage-span", "usage-measure", "usage-by"]) $(id).addEventListener("change", showUsage);
  $("usage-view").addEventListener("submit", (event) => event.preventDefault());
  $("new-key-done").addEventListener("click", () => {
    $("new-key").hidden = true;
    $("new-key-value").textContent = "";
  });
  if (token()) start();
  else startPeople();
});

// -- people who sign in with the team's identity provider (hub --oidc-issuer) ----------

function refusedMessage() {
  return person ? "Your sign-in has ended: sign in again." : "The admin credential was refused: sign in again.";
}

async function startPeople() {
  let me = null;
  try {
    const resp = await fetch("/auth/me", { cache: "no-store", credentials: "same-origin" });
    me = await resp.json();
  } catch (_) {
    return; // the admin credential's form stays
  }
  $("oidc-signin").hidden = !me.oidc;
  if (!me.signedIn) return;
  person = me;
  $("whoami").textContent = `${me.email || me.sub} (${me.role})`;
  $("whoami").hidden = false;
  $("people-usage-section").hidden = false;
  for (const section of document.querySelectorAll(".admin-only")) {
    if (me.role !== "admin") section.hidden = true;
  }
  const project = $("create-key").elements.project;
  project.placeholder = me.role === "admin" ? "local/chat" : me.projects.join(", ");
  if (me.role !== "admin" && me.projects.length) project.value = me.projects[0];
  start();
}

async function refreshMember(gen) {
  // a member: their own keys, and their own usage (per person: theirs alone)
  // 30 days for the chart's views (as an admin's), the last day for the table
  const since = Math.floor(Date.now() / 1000 / DAY) * DAY - 29 * DAY;
  const day = Math.floor(Date.now() / 1000 / HOUR) * HOUR - 23 * HOUR;
  const [usage, keys] = await Promise.all([
    api("GET", `/api/hub/usage?since=${since}`),
    api("GET", "/api/hub/keys"),
  ]);
  if (gen !== generation) return;
  const mine = usage.usage.map((r) => ({ ...r, key: r.email || r.person || "–" }));
  lastUsage = { ...usage, usage: mine };
  showUsage();
  showPeopleUsage(usage.usage.filter((r) => r.hour >= day));
  showKeys(keys.keys, keys.limitsSupported);
}

async function refreshPeopleUsage(gen, since) {
  const usage = await api("GET", `/api/hub/usage?since=${since}&by=person`);
  if (gen === generation) showPeopleUsage(usage.usage);
}

function showPeopleUsage(rows) {
  const totals = new Map(); // person/model -> row
  for (const r of rows) {
    const id = `${r.person}\u0000${r.model}`;
    const kept = totals.get(id) || { ...r, turns: 0, promptTokens: 0, completionTokens: 0 };
    kept.turns += r.turns;
    kept.promptTokens += r.promptTokens;
    kept.completionTokens += r.completionTokens;
    totals.set(id, kept);
  }
  fill(
    "people-usage",
    [...totals.values()].map((r) => {
      const tr = row([
        r.person === null ? "(admin's keys)" : r.person,
        r.email,
        r.model || "(default)",
        r.turns,
        r.promptTokens,
        r.completionTokens,
      ]);
      tr.dataset.person = r.person === null ? "" : r.person;
      return tr;
    }),
  );
}

async function signOutPerson(message) {
  const was = person;
  person = null;
  generation += 1;
  if (timer !== null) clearTimeout(timer);
  timer = null;
  try {
    await fetch("/auth/logout", {
      method: "POST",
      headers: { "x-csrf-token": was.csrf },
      credentials: "same-origin",
    });
  } catch (_) {
    // the session ends with its cookie's lifetime anyway
  }
  $("whoami").hidden = true;
  $("people-usage-section").hidden = true;
  for (const section of document.querySelectorAll(".admin-only")) section.hidden = false;
  $("replicas-section").hidden = true;
  team = null;
  $("dashboard").hidden = true;
  $("signout").hidden = true;
  $("signin-section").hidden = false;
  $("status").textContent = "";
  $("signin-error").textContent = message || "Signed out.";
}
