// MegaScope page: hand-written, no libraries, works offline. Talks to /ws (see scope/protocol.py).
"use strict";

const $ = (id) => document.getElementById(id);
const ROW_COLOURS = ["#2b59c3", "#d1495b", "#2f8f4e", "#c47b12", "#7b3fb5", "#168aad", "#8c564b", "#555"];
const HEAD_WEIGHTS = ["attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight"];
const ACTIVATION_POINTS = ["in", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out", "mlp.out", "out"];
let ws = null, model = null, run = null, drawPending = false, readOnly = false;

function updateReadOnly() {
  if (!readOnly) return;
  $("generate").disabled = true; $("stop").disabled = true;
  $("generate").title = "this server shows a training run's probe generations; it takes no requests";
}

// ---------- connection ----------
function connect() {
  const token = new URLSearchParams(location.search).get("token");
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws" +
    (token ? "?token=" + encodeURIComponent(token) : "");
  ws = new WebSocket(url);
  ws.onopen = () => setStatus("connected", "ok");
  ws.onclose = (ev) => { setStatus("offline" + (ev.reason ? ": " + ev.reason : ""), "err"); $("generate").disabled = true; };
  ws.onmessage = (ev) => handle(JSON.parse(ev.data));
}

function setStatus(text, cls) { const s = $("status"); s.textContent = text; s.className = "status " + (cls || ""); }

function handle(msg) {
  switch (msg.type) {
    case "hello": readOnly = !!msg.read_only; if (msg.model) setModel(msg.model); updateReadOnly();
      if (msg.training) { $("console").hidden = false; trainState(msg.training); } break;
    case "train_state": $("console").hidden = false; trainState(msg); break;
    case "info": if (msg.model) setModel(msg.model); updateReadOnly(); break;
    case "train": if (lastTrain) trainState({ ...lastTrain, step: msg.step });
      $("train-info").textContent = `training step ${msg.step}` +
      (msg.loss !== undefined ? `, loss ${msg.loss.toFixed(3)}` : "") + (msg.lr !== undefined ? `, lr ${msg.lr.toExponential(1)}` : ""); break;
    case "start": startRun(msg); break;
    case "step": addStep(msg); break;
    case "pca": run && (run.pca = msg); schedule(); break;
    case "done": finish(msg); break;
    case "busy": setStatus("busy: another generation is running", "busy"); break;
    case "error": showError(msg); break;
  }
}

let lastTrain = null;
function trainState(m) {
  lastTrain = m;
  $("train-state").textContent = `step ${m.step}: ` + (m.waiting ? "paused (waiting)" : m.paused ? "pausing after this step" : "running") +
    `, probe every ${m.every} steps`;
  $("train-state").dataset.step = m.step; $("train-state").dataset.waiting = m.waiting; $("train-state").dataset.every = m.every;
}

function control(action, every) { if (ws && ws.readyState === 1) ws.send(JSON.stringify({ type: "control", action, every })); }

function showError(msg) {
  setStatus("error: " + msg.code, "err");
  $("timing").innerHTML = "";
  const p = document.createElement("div"); p.id = "error"; p.textContent = msg.message;
  $("timing").appendChild(p);
  $("generate").disabled = readOnly; $("stop").disabled = true;
}

function fillSelect(sel, values, labels) {
  const keep = sel.value;
  sel.innerHTML = "";
  values.forEach((v, i) => { const o = document.createElement("option"); o.value = v; o.textContent = labels ? labels[i] : v; sel.appendChild(o); });
  if (values.map(String).includes(keep)) sel.value = keep;
}

function setModel(m) {
  model = m;
  $("model-info").textContent = `${m.name}: ${m.family}, ${m.num_layers} layers, ${m.num_heads} heads` +
    (m.num_kv_heads !== m.num_heads ? ` (${m.num_kv_heads} kv heads)` : "") + `, hidden ${m.hidden_size}` +
    (m.meta && m.meta.val_loss ? `, val loss ${m.meta.val_loss}` : "");
  const layers = [...Array(m.num_layers).keys()];
  fillSelect($("layer"), layers); fillSelect($("pca-layer"), layers);
  $("pca-layer").value = String(m.num_layers - 1);
  fillSelect($("head"), [...Array(m.num_heads).keys()]);
  updateTargets();
  $("generate").disabled = readOnly;
}

function updateTargets() {
  const place = $("pert-place").value;
  const t = $("pert-target");
  if (place === "weight") fillSelect(t, model ? model.weights : []);
  else if (place === "activation") fillSelect(t, ACTIVATION_POINTS);
  else fillSelect(t, ["out"], ["layers.L.out"]);
  t.disabled = place === "hidden";
}

// ---------- request ----------
function intList(text) {
  const s = text.trim();
  if (!s || s === "all") return null;
  return s.split(/[ ,]+/).filter(Boolean).map((x) => parseInt(x, 10));
}

function numberOrNull(id) { const v = $(id).value.trim(); return v === "" ? null : Number(v); }

function perturbation() {
  if (!$("pert-enabled").checked) return [];
  const place = $("pert-place").value, target = $("pert-target").value, kind = $("pert-kind").value;
  const p = { kind, place, target: place === "hidden" ? "out" : target, strength: Number($("pert-strength").value),
    seed: Number($("pert-seed").value), layers: intList($("pert-layers").value) };
  const rate = numberOrNull("pert-rate");
  if (rate !== null) p.rate = rate;
  if (kind === "bitflip") { p.bit = numberOrNull("pert-bit"); }
  const heads = intList($("pert-heads").value);
  const headsApply = (place === "activation" && ["attn.q", "attn.k", "attn.v", "attn.probs"].includes(target)) ||
    (place === "weight" && HEAD_WEIGHTS.includes(target));
  if (heads && headsApply) p.heads = heads;
  return [p];
}

function request() {
  const prompts = $("prompts").value.split("\n").filter((l) => l.length > 0);
  const points = [...document.querySelectorAll(".pt:checked")].map((c) => c.value);
  return {
    type: "generate", prompts, max_new_tokens: Number($("ntokens").value),
    temperature: Number($("temperature").value), top_k: Number($("topk").value), greedy: $("greedy").checked,
    seed: Number($("seed").value), report_top: 5,
    capture: { points, logit_lens: $("lens").checked,
      pca_layer: $("pca-on").checked ? Number($("pca-layer").value) : null },
    perturbations: perturbation(),
  };
}

// ---------- decoding ----------
function halfToFloat(h) {
  const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e === 0) return s * Math.pow(2, -14) * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * Math.pow(2, e - 15) * (1 + f / 1024);
}

function decode(c) {
  const bin = atob(c.data), n = bin.length, bytes = new Uint8Array(n);
  for (let i = 0; i < n; i++) bytes[i] = bin.charCodeAt(i);
  const dv = new DataView(bytes.buffer);
  let out;
  if (c.dtype === "fp16") { out = new Float32Array(n / 2); for (let i = 0; i < out.length; i++) out[i] = halfToFloat(dv.getUint16(2 * i, true)); }
  else if (c.dtype === "fp32") { out = new Float32Array(n / 4); for (let i = 0; i < out.length; i++) out[i] = dv.getFloat32(4 * i, true); }
  else { out = new Float32Array(n); for (let i = 0; i < n; i++) out[i] = dv.getInt8(i) * c.scale; }
  return out;
}

// Split a step's tensor into per-(row, position) feature vectors. q/k/v/probs are [b, heads, s, x];
// everything else is [b, s, x]. Per position we keep heads-major features.
function storeState(name, c, p0) {
  const v = decode(c), sh = c.shape, perHead = sh.length === 4;
  const b = sh[0], H = perHead ? sh[1] : 1, s = perHead ? sh[2] : sh[1], x = sh[sh.length - 1];
  const st = run.states[name] || (run.states[name] = { heads: H, width: x, rows: [] });
  for (let r = 0; r < b; r++) {
    const rows = st.rows[r] || (st.rows[r] = []);
    for (let i = 0; i < s; i++) {
      const f = new Float32Array(H * x);
      for (let h = 0; h < H; h++) {
        const src = perHead ? ((r * H + h) * s + i) * x : (r * s + i) * x;
        f.set(v.subarray(src, src + x), h * x);
      }
      rows[p0 + i] = { width: x, data: f };
    }
  }
}

// ---------- run state ----------
function startRun(msg) {
  run = { rows: msg.rows, start: msg.start, total: msg.total, promptLens: msg.prompt_lens,
    tokens: msg.tokens.map((t) => t.slice()), newToks: msg.tokens.map(() => []), states: {}, lens: {},
    last: null, pca: null, grid: null, t0: performance.now() };
  fillSelect($("row"), [...Array(msg.rows).keys()], msg.tokens.map((t, i) => `${i}: ${t.join("").slice(0, 18)}`));
  const out = $("output"); out.innerHTML = "";
  msg.tokens.forEach((t, r) => {
    const d = document.createElement("div"); d.className = "row"; d.id = "row-" + r;
    d.innerHTML = `<span class="rowlabel">${r}</span>`;
    const p = document.createElement("span"); p.className = "prompt"; p.textContent = t.join("");
    d.appendChild(p); out.appendChild(d);
  });
  $("timing").textContent = "";
  setStatus("generating…", "busy");
}

function addStep(msg) {
  if (!run) return;
  const [p0, p1] = msg.positions;
  for (const [name, c] of Object.entries(msg.states || {})) storeState(name, c, p0);
  if (msg.grid) run.grid = msg.grid;
  if (msg.lens) msg.lens.forEach((rowsL, L) => rowsL.forEach((cells, r) => cells.forEach((cell, i) => {
    ((run.lens[L] || (run.lens[L] = {}))[r] || (run.lens[L][r] = []))[p0 + i] = cell;
  })));
  if (msg.next) {
    msg.next.forEach((t, r) => {
      run.tokens[r][p1] = t.text;
      if (!t.new) return;
      run.newToks[r].push(t);
      const s = document.createElement("span"); s.className = "tok" + (t.prob === null || t.prob < 0.2 ? " low" : "") + (t.non_finite ? " nonfinite" : "");
      s.textContent = t.text; s.title = `p=${fmt(t.prob)}` + (t.non_finite ? `, ${t.non_finite} NaN/inf logits masked` : "");
      $("row-" + r).appendChild(s);
    });
    run.last = msg.next;
  }
  schedule();
}

function finish(msg) {
  $("generate").disabled = readOnly; $("stop").disabled = true;
  if (msg.cancelled) { setStatus("stopped", "ok"); return; }
  setStatus("done", "ok");
  $("timing").textContent = `${msg.new_tokens} new tokens in ${msg.seconds}s (${msg.tokens_per_s} tokens/s, ${msg.steps} steps)`;
  schedule();
}

// ---------- drawing ----------
function schedule() { if (!drawPending) { drawPending = true; requestAnimationFrame(() => { drawPending = false; draw(); }); } }

function fmt(p, d = 3) { return p === null || p === undefined ? "NaN" : p.toFixed(d); }

function label(t) { return t === undefined ? "" : t.replace(/ /g, "·").replace(/\n/g, "⏎"); }

function diverging(v) { // v in [-1, 1]: blue - white - red; NaN/inf (after a bit flip) in dark grey
  if (!isFinite(v)) return "#3a3a48";
  const a = Math.min(1, Math.abs(v));
  const c = v < 0 ? [49, 54, 149] : [165, 0, 38];
  return `rgb(${Math.round(255 + (c[0] - 255) * a)},${Math.round(255 + (c[1] - 255) * a)},${Math.round(255 + (c[2] - 255) * a)})`;
}

function sequential(v) { // v in [0, 1]: white - dark blue; NaN in dark grey
  if (!isFinite(v)) return "#3a3a48";
  const a = Math.max(0, Math.min(1, v));
  return `rgb(${Math.round(255 - 225 * a)},${Math.round(255 - 190 * a)},${Math.round(255 - 80 * a)})`;
}

function draw() {
  if (!run) return;
  drawTopk(); drawAttention(); drawHeat("attn.q", "heat-q", "q-caption", "Q");
  drawHeat("attn.k", "heat-k", "k-caption", "K"); drawHeat("attn.v", "heat-v", "v-caption", "V");
  drawHeat("mlp.out", "heat-mlp", "mlp-caption", "MLP out"); drawPca(); drawLens(); drawGrid();
}

// Layer x head grid of the last step (entropy of each head's attention, or its query norm), one row per layer.
const GRID = { left: 56, top: 16, cw: 40, ch: 22 };
function drawGrid() {
  const cv = $("grid"), g = cv.getContext("2d"), metric = $("grid-metric").value, { r, L: selL, h: selH } = selected();
  const d = run.grid && run.grid[metric];
  if (!d) { g.clearRect(0, 0, cv.width, cv.height); $("grid-caption").textContent = `layer × head: ${metric === "entropy" ? "attention" : "Q"} not streamed`; return; }
  const vals = d.values[r] || [], H = vals.length ? vals[0].length : 0;
  cv.width = GRID.left + H * GRID.cw + 4; cv.height = GRID.top + d.layers.length * GRID.ch + 4;
  let vmax = 1e-6;
  vals.forEach((row) => row.forEach((v) => { if (v !== null && isFinite(v)) vmax = Math.max(vmax, v); }));
  g.font = "11px monospace"; g.fillStyle = "#334";
  for (let h = 0; h < H; h++) g.fillText(`h${h}`, GRID.left + h * GRID.cw + 10, GRID.top - 4);
  d.layers.forEach((L, i) => {
    g.fillStyle = "#334"; g.fillText(`layer ${L}`, 2, GRID.top + i * GRID.ch + 15);
    for (let h = 0; h < H; h++) {
      const v = vals[i][h];
      g.fillStyle = sequential(v === null ? NaN : v / vmax);
      g.fillRect(GRID.left + h * GRID.cw, GRID.top + i * GRID.ch, GRID.cw - 2, GRID.ch - 2);
      if (L === selL && h === selH) { g.strokeStyle = "#d1495b"; g.lineWidth = 2; g.strokeRect(GRID.left + h * GRID.cw + 1, GRID.top + i * GRID.ch + 1, GRID.cw - 4, GRID.ch - 4); }
    }
  });
  $("grid-caption").textContent = `layer × head, ${metric === "entropy" ? "attention entropy (nats)" : "query norm"} at the last position, row ${r}, max ${fmt(vmax, 2)} (click a cell to open it below)`;
  cv.dataset.layers = d.layers.join(","); cv.dataset.heads = H;
}

function gridClick(ev) {
  const d = run && run.grid && run.grid[$("grid-metric").value];
  if (!d) return;
  const rect = $("grid").getBoundingClientRect();
  const h = Math.floor((ev.clientX - rect.left - GRID.left) / GRID.cw), i = Math.floor((ev.clientY - rect.top - GRID.top) / GRID.ch);
  if (h < 0 || i < 0 || i >= d.layers.length || h >= model.num_heads) return;
  $("layer").value = String(d.layers[i]); $("head").value = String(h); schedule();
}

function drawTopk() {
  if (!run.last) return;
  let html = "<table><tr><th>row</th><th>token</th><th>prob</th><th>top candidates</th></tr>";
  run.last.forEach((t, r) => {
    const cands = t.top.map(([txt, p]) => `<span class="bar" style="width:${Math.max(1, (p || 0) * 60)}px"></span><span class="mono">${esc(label(txt))}</span> ${fmt(p)}`).join("&nbsp; ");
    const nf = t.non_finite ? ` <span class="warn">${t.non_finite} NaN/inf logits masked</span>` : "";
    html += `<tr><td>${r}</td><td class="mono">${esc(label(t.text))}${t.forced ? " (prompt)" : ""}</td><td>${fmt(t.prob)}${nf}</td><td>${cands}</td></tr>`;
  });
  $("topk-view").innerHTML = html + "</table>";
}

function esc(s) { return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]); }

function selected() { return { r: Number($("row").value || 0), L: Number($("layer").value || 0), h: Number($("head").value || 0) }; }

function drawAttention() {
  const { r, L, h } = selected(), cv = $("attn"), g = cv.getContext("2d");
  g.clearRect(0, 0, cv.width, cv.height);
  const st = run.states[`layers.${L}.attn.probs`];
  $("attn-caption").textContent = `Attention, layer ${L}, head ${h}, row ${r}` + (st ? "" : " (not streamed)");
  if (!st || !st.rows[r]) return;
  const rows = st.rows[r], n = rows.length, pad = 28, cell = (cv.width - pad) / n;
  for (let i = 0; i < n; i++) {
    const e = rows[i]; if (!e) continue;
    for (let j = 0; j < e.width; j++) { g.fillStyle = sequential(e.data[h * e.width + j]); g.fillRect(pad + j * cell, pad + i * cell, Math.ceil(cell), Math.ceil(cell)); }
  }
  g.fillStyle = "#334"; g.font = `${Math.min(11, Math.max(7, cell))}px monospace`;
  const every = Math.ceil(8 / cell);
  for (let i = 0; i < n; i += every) {
    const t = label(run.tokens[r][i]);
    g.fillText(t.slice(0, 3), 2, pad + (i + 0.8) * cell);
    g.save(); g.translate(pad + (i + 0.8) * cell, pad - 2); g.rotate(-Math.PI / 2); g.fillText(t.slice(0, 3), 0, 0); g.restore();
  }
}

function drawHeat(point, canvasId, captionId, title) {
  const { r, L } = selected(), cv = $(canvasId), g = cv.getContext("2d");
  g.clearRect(0, 0, cv.width, cv.height);
  const st = run.states[`layers.${L}.${point}`];
  if (!st || !st.rows[r]) { $(captionId).textContent = `${title}, layer ${L} (not streamed)`; return; }
  const rows = st.rows[r], n = rows.length, width = st.heads * st.width;
  $(captionId).textContent = `${title}, layer ${L}: ${n} tokens × ` + (st.heads > 1 ? `${st.heads} heads × ${st.width}` : `${st.width}`) + " (pooled)";
  let amax = 1e-6;
  rows.forEach((e) => { if (e) for (const x of e.data) if (isFinite(x)) amax = Math.max(amax, Math.abs(x)); });
  const pad = 24, cw = (cv.width - pad) / width, ch = Math.min(14, (cv.height - 4) / n);
  rows.forEach((e, i) => {
    if (!e) return;
    for (let j = 0; j < width; j++) { g.fillStyle = diverging(e.data[j] / amax); g.fillRect(pad + j * cw, 2 + i * ch, Math.ceil(cw), Math.ceil(ch)); }
  });
  g.strokeStyle = "#222"; g.lineWidth = 1;
  for (let h = 1; h < st.heads; h++) { const x = pad + h * st.width * cw; g.beginPath(); g.moveTo(x, 2); g.lineTo(x, 2 + n * ch); g.stroke(); }
  g.fillStyle = "#334"; g.font = `${Math.min(11, Math.max(7, ch))}px monospace`;
  const every = Math.ceil(8 / ch);
  for (let i = 0; i < n; i += every) g.fillText(label(run.tokens[r][i]).slice(0, 3), 1, 2 + (i + 0.85) * ch);
}

function drawPca() {
  const svg = $("pca"); svg.innerHTML = "";
  if (!run.pca) { $("pca-caption").textContent = "(after the run)"; return; }
  const pts = run.pca.points, xs = pts.map((p) => p[2]), ys = pts.map((p) => p[3]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const W = 320, P = 18, sx = (x) => P + ((x - x0) / (x1 - x0 || 1)) * (W - 2 * P), sy = (y) => W - P - ((y - y0) / (y1 - y0 || 1)) * (W - 2 * P);
  $("pca-caption").textContent = `layer ${run.pca.layer}, PC1 ${(100 * run.pca.explained[0]).toFixed(0)}%, PC2 ${(100 * run.pca.explained[1]).toFixed(0)}%` +
    (run.pca.dropped_non_finite ? `, ${run.pca.dropped_non_finite} non-finite states left out` : "");
  if (!pts.length) return;
  const ns = "http://www.w3.org/2000/svg";
  for (const [r, p, x, y] of pts) {
    const c = document.createElementNS(ns, "circle");
    c.setAttribute("cx", sx(x)); c.setAttribute("cy", sy(y)); c.setAttribute("r", 3.5);
    c.setAttribute("fill", ROW_COLOURS[r % ROW_COLOURS.length]); c.setAttribute("fill-opacity", 0.75);
    const t = document.createElementNS(ns, "title"); t.textContent = `row ${r}, position ${p}: ${label(run.tokens[r][p])}`;
    c.appendChild(t); svg.appendChild(c);
    if (p % 4 === 0) {
      const tx = document.createElementNS(ns, "text"); tx.setAttribute("x", sx(x) + 4); tx.setAttribute("y", sy(y) - 3);
      tx.setAttribute("font-size", "9"); tx.setAttribute("fill", "#556"); tx.textContent = label(run.tokens[r][p]); svg.appendChild(tx);
    }
  }
}

function drawLens() {
  const { r } = selected(), Ls = Object.keys(run.lens).map(Number).sort((a, b) => b - a);
  if (!Ls.length) { $("lens-view").textContent = "(not streamed)"; return; }
  const n = run.tokens[r].length, from = Math.max(0, n - 24);
  let html = "<table><tr><th>layer</th>";
  for (let i = from; i < n; i++) html += `<th class="mono">${esc(label(run.tokens[r][i] || ""))}</th>`;
  html += "</tr>";
  for (const L of Ls) {
    html += `<tr><th>${L}</th>`;
    const cells = run.lens[L][r] || [];
    for (let i = from; i < n; i++) {
      const c = cells[i];
      html += c ? `<td style="background:${sequential(c[1] || 0)};color:${c[1] > 0.6 ? "#fff" : "#123"}" title="p=${fmt(c[1])}">${esc(label(c[0]))}</td>` : "<td></td>";
    }
    html += "</tr>";
  }
  $("lens-view").innerHTML = html + "</table>";
}

// ---------- wiring ----------
$("generate").onclick = () => {
  if (!ws || ws.readyState !== 1) return;
  $("generate").disabled = true; $("stop").disabled = false;
  setStatus("sending…", "busy");
  ws.send(JSON.stringify(request()));
};
$("stop").onclick = () => ws && ws.send(JSON.stringify({ type: "stop" }));
$("pert-place").onchange = updateTargets;
["row", "layer", "head", "grid-metric"].forEach((id) => { $(id).onchange = schedule; });
$("grid").onclick = gridClick;
$("train-pause").onclick = () => control("pause");
$("train-step").onclick = () => control("step");
$("train-resume").onclick = () => control("resume");
$("train-every-set").onclick = () => control("every", Number($("train-every").value));
$("generate").disabled = true;
connect();
