// pagedllm dashboard: polls dashboard/state every second and redraws. The state carries
// cumulative token counters, so the throughput history lives here, built from successive polls.
"use strict";
(() => {
  const KEY = "pagedllm-dashboard-key";
  const POLL_MS = 1000, HISTORY_S = 300, RATE_WINDOW_S = 5, MAX_ROWS = 200;
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);
  const history = [];  // {t, p, g}: server time, cumulative prompt and generation tokens
  const maps = [];  // per engine core: {svg, rects, cols, cell, owners}
  let inFlight = false, needKey = false;

  const pct = (x) => (100 * x).toFixed(1) + "%";
  const num = (x) => (x >= 100 || x === 0 ? String(Math.round(x)) : x.toFixed(x >= 10 ? 1 : 2));
  const secs = (s) => (s < 1 ? Math.round(1000 * s) + " ms" : s.toFixed(s < 10 ? 2 : 1) + " s");
  function hue(id) {
    let h = 0;
    for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
    return `hsl(${h % 360}, 62%, ${42 + (h >> 9) % 16}%)`;
  }
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  function setStatus(text, error) {
    $("status").textContent = text;
    $("status").classList.toggle("error", !!error);
  }

  // ---- API key: asked for on a 401, kept in sessionStorage (this tab only) -----------------
  function askKey(why) {
    needKey = true;
    $("keyform").classList.add("shown");
    $("key-why").textContent = why;
    setStatus("waiting for the API key", true);
    $("key").focus();
  }
  $("keyform-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    needKey = false;
    poll();
  });

  async function poll() {
    if (inFlight || needKey) return;
    inFlight = true;
    try {
      const key = sessionStorage.getItem(KEY);
      const resp = await fetch("dashboard/state", {
        headers: key ? {Authorization: "Bearer " + key} : {}, cache: "no-store"});
      if (resp.status === 401) return askKey(key ? "the server refused this key" : "");
      if (!resp.ok) return setStatus(`dashboard/state answered ${resp.status}`, true);
      const state = await resp.json();
      $("keyform").classList.remove("shown");
      render(state);
      setStatus("updated " + new Date(state.timestamp * 1000).toLocaleTimeString());
    } catch (e) {
      setStatus("cannot reach the server: " + e.message, true);
    } finally {
      inFlight = false;
    }
  }

  // ---- throughput -----------------------------------------------------------------------------
  function record(state) {
    const last = history[history.length - 1];
    if (last && (state.prompt_tokens < last.p || state.generation_tokens < last.g)) history.length = 0;
    history.push({t: state.timestamp, p: state.prompt_tokens, g: state.generation_tokens});
    while (history.length && history[0].t < state.timestamp - HISTORY_S - RATE_WINDOW_S) history.shift();
  }
  function rates() {  // tokens/s over the RATE_WINDOW_S before each poll
    const out = [];
    for (let i = 1, j = 0; i < history.length; i++) {
      while (history[j + 1].t <= history[i].t - RATE_WINDOW_S) j++;
      const dt = history[i].t - history[j].t;
      if (dt > 0) out.push({t: history[i].t, p: (history[i].p - history[j].p) / dt,
                            g: (history[i].g - history[j].g) / dt});
    }
    return out;
  }
  function drawChart(points, now) {
    const svg = $("chart"), W = 600, H = 220, L = 48, R = 8, T = 8, B = 22;
    const top = Math.max(1, ...points.map((q) => Math.max(q.p, q.g)));
    const scale = Math.pow(10, Math.floor(Math.log10(top)));
    const ymax = Math.ceil(top / scale) * scale;
    const x = (t) => L + (W - L - R) * (1 - (now - t) / HISTORY_S);
    const y = (v) => H - B - (H - T - B) * v / ymax;
    const parts = [];
    for (const f of [0, 0.5, 1]) {
      parts.push(`<line class="grid" x1="${L}" x2="${W - R}" y1="${y(f * ymax)}" y2="${y(f * ymax)}"/>`,
                 `<text x="${L - 6}" y="${y(f * ymax) + 4}" text-anchor="end">${num(f * ymax)}</text>`);
    }
    for (const m of [5, 4, 3, 2, 1, 0]) {
      const anchor = m === 5 ? "start" : m ? "middle" : "end";
      parts.push(`<text x="${x(now - 60 * m)}" y="${H - 6}" text-anchor="${anchor}">${m ? "−" + m + " min" : "now"}</text>`);
    }
    const shown = points.filter((q) => q.t >= now - HISTORY_S);
    for (const [key, cls] of [["p", "prompt"], ["g", "gen"]]) {
      const pts = shown.map((q) => `${x(q.t).toFixed(1)},${y(q[key]).toFixed(1)}`).join(" ");
      parts.push(`<polyline class="${cls}" points="${pts}"/>`);
    }
    svg.innerHTML = parts.join("");
  }

  // ---- KV block map: one SVG per engine core, cells created once, repainted when they change ---
  function blockMap(index, state, multi) {
    const n = state.block_states.length;
    let map = maps[index];
    if (!map || map.rects.length !== n) {
      const box = el("div", undefined, "blockmap");
      const cell = n <= 1024 ? 14 : n <= 4096 ? 9 : 6, cols = Math.floor(1200 / cell);
      const svg = document.createElementNS(SVG, "svg");
      svg.id = "blocks-" + index;
      svg.setAttribute("viewBox", `0 0 ${cols * cell} ${Math.ceil(n / cols) * cell}`);
      const rects = [];
      for (let b = 0; b < n; b++) {
        const r = document.createElementNS(SVG, "rect");
        r.setAttribute("x", (b % cols) * cell);
        r.setAttribute("y", Math.floor(b / cols) * cell);
        r.setAttribute("width", cell - 1);
        r.setAttribute("height", cell - 1);
        r.setAttribute("rx", 1.5);
        svg.appendChild(r);
        rects.push(r);
      }
      box.append(el("h3"), svg);
      if (map) map.box.replaceWith(box); else $("blockmaps").appendChild(box);
      map = maps[index] = {box, svg, rects, cols, cell, owners: [], shared: []};
      svg.addEventListener("mousemove", (ev) => hover(map, ev));
      svg.addEventListener("mouseleave", () => { $("tooltip").style.display = "none"; });
    }
    const owners = new Array(n).fill(null), shared = new Array(n).fill(0);
    for (const r of state.requests) {
      for (const b of r.block_ids) { owners[b] = owners[b] ?? r.id; shared[b]++; }
    }
    map.owners = owners;
    map.shared = shared;
    map.states = state.block_states;
    for (let b = 0; b < n; b++) {
      const cls = {f: "free", u: "used", c: "cached"}[state.block_states[b]];
      const rect = map.rects[b], owner = cls === "used" ? owners[b] : null;
      if (rect.getAttribute("class") !== cls) rect.setAttribute("class", cls);
      if (rect.dataset.owner !== (owner ?? "")) {
        rect.dataset.owner = owner ?? "";
        rect.style.fill = owner ? hue(owner) : "";
      }
    }
    const more = state.blocks_truncated ? ` (the first ${n} drawn)` : "";
    map.box.querySelector("h3").textContent = (multi ? `Engine ${index}: ` : "") +
      `${state.num_blocks} blocks of ${state.block_size} tokens${more}; ` +
      `${state.num_blocks - state.num_free_blocks} in use, ${state.num_free_blocks} free`;
  }
  function hover(map, ev) {
    const box = map.svg.getBoundingClientRect(), unit = box.width / (map.cols * map.cell);
    const col = Math.floor((ev.clientX - box.left) / unit / map.cell);
    const b = Math.floor((ev.clientY - box.top) / unit / map.cell) * map.cols + col;
    const tip = $("tooltip");
    if (col >= map.cols || b < 0 || b >= map.rects.length) { tip.style.display = "none"; return; }
    const s = map.states[b];
    let text = `block ${b}: ` + (s === "f" ? "free" : s === "c" ? "cached, evictable" : "in use");
    if (s === "u") text += map.owners[b] ? ` by ${map.owners[b]}` : " (held for a request's samples)";
    if (map.shared[b] > 1) text += ` (shared by ${map.shared[b]} requests)`;
    tip.textContent = text;
    tip.style.display = "block";
    tip.style.left = ev.clientX + 12 + "px";
    tip.style.top = ev.clientY + 12 + "px";
  }

  // ---- queues ---------------------------------------------------------------------------------
  const COLUMNS = ["Request", "Engine", "LoRA", "Prompt computed", "Generated", "TTFT", "Age", "Blocks", "Preempted"];
  function queueTable(table, rows, now, multiEngine) {
    table.replaceChildren();
    const head = table.createTHead().insertRow();
    for (const c of COLUMNS) if (c !== "Engine" || multiEngine) head.appendChild(el("th", c));
    const body = table.createTBody();
    if (!rows.length) {
      body.insertRow().appendChild(el("td", "none", "empty")).colSpan = COLUMNS.length;
      return;
    }
    for (const r of rows.slice(0, MAX_ROWS)) {
      const tr = body.insertRow();
      const id = tr.appendChild(el("td", undefined, "id"));
      id.title = r.id;
      id.append(el("span", undefined, "swatch"), r.id);
      id.firstChild.style.background = hue(r.id);
      if (multiEngine) tr.appendChild(el("td", String(r.engine)));
      tr.appendChild(el("td", r.lora ?? "–"));
      const prog = tr.appendChild(el("td")), bar = prog.appendChild(el("span", undefined, "bar"));
      bar.appendChild(el("span")).style.width = pct(r.prompt_tokens ? r.prompt_computed / r.prompt_tokens : 1);
      prog.append(`${r.prompt_computed} / ${r.prompt_tokens}`);
      tr.appendChild(el("td", r.output_tokens + (r.max_tokens ? ` / ${r.max_tokens}` : "")));
      tr.appendChild(el("td", r.first_token_time ? secs(r.first_token_time - r.arrival_time) : "–"));
      tr.appendChild(el("td", secs(Math.max(0, now - r.arrival_time))));
      tr.appendChild(el("td", String(r.num_blocks)));
      tr.appendChild(el("td", String(r.num_preemptions)));
    }
    if (rows.length > MAX_ROWS) {
      body.insertRow().appendChild(el("td", `… and ${rows.length - MAX_ROWS} more`, "empty")).colSpan = 9;
    }
  }

  // ---- engines and adapters -------------------------------------------------------------------
  function engineTable(engines, spec) {
    document.querySelectorAll(".spec-col").forEach((c) => c.classList.toggle("hidden", !spec));
    const body = $("engines").tBodies[0];
    body.replaceChildren();
    engines.forEach((e, i) => {
      const s = e.stats, tr = body.insertRow();
      for (const v of [i, s.num_running, s.num_waiting, pct(s.kv_cache_usage), `${s.num_free_blocks} / ${s.num_total_blocks}`,
                       pct(s.prefix_cache_hit_rate), s.num_preemptions]) tr.appendChild(el("td", String(v)));
      if (spec) tr.appendChild(el("td", pct(s.spec_decode_acceptance_rate ?? 0)));
    });
  }
  function loraTable(stats) {
    const names = {};
    for (const [k, v] of Object.entries(stats)) {
      const [kind, name] = [k.slice(0, k.indexOf(":")), k.slice(k.indexOf(":") + 1)];
      if (kind !== "lora_running" && kind !== "lora_waiting") continue;
      (names[name] ??= {lora_running: 0, lora_waiting: 0})[kind] += v;
    }
    const body = $("loras").tBodies[0];
    body.replaceChildren();
    for (const name of Object.keys(names).sort()) {
      const tr = body.insertRow();
      for (const v of [name, names[name].lora_running, names[name].lora_waiting]) tr.appendChild(el("td", String(v)));
    }
    $("lora-section").classList.toggle("hidden", !Object.keys(names).length);
  }

  function render(state) {
    const s = state.stats, multi = state.engines.length > 1;
    $("model").textContent = state.model;
    record(state);
    const r = rates(), last = r[r.length - 1];
    $("rate-prompt").textContent = last ? num(last.p) : "–";
    $("rate-gen").textContent = last ? num(last.g) : "–";
    drawChart(r, state.timestamp);
    const queues = {running: [], waiting: [], preempted: []};
    state.engines.forEach((e, i) => {
      blockMap(i, e, multi);
      for (const req of e.requests) queues[req.queue]?.push({...req, engine: i});
    });
    for (const [name, rows] of Object.entries(queues)) {
      $("count-" + name).textContent = rows.length;
      queueTable($("queue-" + name), rows, state.timestamp, multi);
    }
    $("preemptions-total").textContent = `${s.num_preemptions ?? 0} preemptions so far`;
    const total = state.engines.reduce((a, e) => a + e.num_blocks, 0);
    const free = state.engines.reduce((a, e) => a + e.num_free_blocks, 0);
    $("kv-usage").textContent = pct(total ? 1 - free / total : 0);
    $("kv-blocks").textContent = `${total - free} of ${total} blocks`;
    $("hit-rate").textContent = pct(s.prefix_cache_hit_rate ?? 0);
    $("hit-tokens").textContent = `${s.prefix_cache_hits ?? 0} of ${s.prefix_cache_queries ?? 0} prompt tokens`;
    const spec = "spec_decode_acceptance_rate" in s;
    $("spec-card").classList.toggle("hidden", !spec);
    if (spec) {
      $("spec-rate").textContent = pct(s.spec_decode_acceptance_rate);
      $("spec-len").textContent = `mean acceptance length ${num(s.spec_decode_mean_acceptance_length ?? 0)}`;
    }
    engineTable(state.engines, spec);
    loraTable(s);
    document.body.dataset.renders = Number(document.body.dataset.renders) + 1;
    document.body.dataset.timestamp = state.timestamp;
  }

  setInterval(poll, POLL_MS);
  poll();
})();
