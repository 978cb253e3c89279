// gradflow explore: draws one sentence's channel view from the data the server (or the static export) provides.
// window.GRADFLOW = {mode: "live" | "static", models, losses, max_tokens, max_chars, examples (live), view (static),
//                   plotly (static: "inline", or "parent" in a notebook frame, which asks the notebook for plotly.js)}.
"use strict";

const ROLE_COLORS = {masked: "#CC3311", random: "#EE7733", kept: "#EE3377", context: "#0077BB",
                     prompt: "#332288", special: "#009988", pad: "#BBBBBB", relpos: "#33BBEE"};
const ROLE_ORDER = Object.keys(ROLE_COLORS);  // the display order of gradflow.roles.ROLE_ORDER
const ZERO_FILL = "#DDDDDD";
const LOSS_ROLES = ["masked", "random", "kept"];
const cfg = window.GRADFLOW;
const state = {view: null, mask: [], maskMode: "explicit", busy: false, pending: null};

function $(id) { return document.getElementById(id); }

function tokenLabel(view, t) {
  const tok = view.tokens[t], inp = view.input_tokens[t];
  return tok === inp ? tok : `${tok} → ${inp}`;
}

function valueText(v) {
  if (v === null || v === undefined) return "n/a";
  if (v === 0) return "exactly 0";
  return v.toPrecision(6);
}

// colour-bar tick 10^k as the PNG's log axes write it (gradflow.figures.canvas): 0.001 ... 1000 plain, else 10^k
function decadeText(k) {
  if (k >= -3 && k < 4) return k < 0 ? (10 ** k).toFixed(-k) : String(10 ** k);
  return `10<sup>${k}</sup>`;
}

function showMessage(text, kind) {
  const box = $("message");
  box.textContent = text || "";
  box.className = text ? `message ${kind || "info"}` : "message";
}

// ---------------------------------------------------------------- tokens
function renderTokens(view) {
  const row = $("tokens");
  row.innerHTML = "";
  view.tokens.forEach((tok, t) => {
    const chip = document.createElement("button");
    const role = view.roles[t];
    chip.type = "button";
    chip.className = `token role-${role}`;
    chip.textContent = tokenLabel(view, t);
    chip.dataset.position = String(t);
    chip.dataset.role = role;
    chip.dataset.lastBlockZero = String(Boolean(view.last_block_zero[t]));
    chip.style.borderColor = ROLE_COLORS[role] || "#777";
    if (LOSS_ROLES.includes(role)) chip.style.background = ROLE_COLORS[role];
    chip.title = `${t}: ${tok} (${role})` + (role === "special" ? ": special tokens never carry the loss" : "");
    if (cfg.mode === "live" && role !== "special" && role !== "pad") {
      chip.addEventListener("click", () => toggleMask(t));
    } else {
      chip.disabled = cfg.mode !== "live" || role === "special";
    }
    row.appendChild(chip);
  });
}

// ---------------------------------------------------------------- heatmap
function cellPolygons(cells, x0, x1) {
  const xs = [], ys = [];
  for (const [t, s] of cells) {
    const a = s === null ? x0 : s - 0.5, b = s === null ? x1 : s + 0.5;
    xs.push(a, b, b, a, a, null);
    ys.push(t - 0.5, t - 0.5, t + 0.5, t + 0.5, t - 0.5, null);
  }
  return [xs, ys];
}

function heatmapTraces(view) {
  const T = view.tokens.length, S = view.sites.length;
  const z = [], custom = [], zeros = [];
  for (let t = 0; t < T; t++) {
    z.push([]); custom.push([]);
    for (let s = 0; s < S; s++) {
      const v = view.grad_norm[t][s];
      z[t].push(v > 0 ? Math.log10(v) : null);
      if (v === 0) zeros.push([t, s]);
      custom[t].push([tokenLabel(view, t), view.roles[t], view.sites[s].label, valueText(v),
                      valueText(view.act_norm[t][s])]);
    }
  }
  const finite = z.flat().filter((v) => v !== null);
  const lo = Math.floor(Math.min(...finite, 0)), hi = Math.ceil(Math.max(...finite, -8));
  const ticks = [];
  for (let k = lo; k <= hi; k++) ticks.push(k);
  const heat = {type: "heatmap", z, customdata: custom, x: [...Array(S).keys()], y: [...Array(T).keys()],
    colorscale: "Viridis", xgap: 1, ygap: 1, hoverongaps: true, name: "gradient norm",
    colorbar: {title: {text: "‖∂L/∂h‖", side: "right"}, tickvals: ticks, ticktext: ticks.map(decadeText),
               thickness: 12, len: 0.8},
    hovertemplate: "<b>%{customdata[0]}</b> (%{customdata[1]})<br>%{customdata[2]}<br>" +
                   "‖∂L/∂h‖ = %{customdata[3]}<br>‖h‖ = %{customdata[4]}<extra></extra>"};
  const [zx, zy] = cellPolygons(zeros);
  const zero = {type: "scatter", mode: "lines", x: zx, y: zy, fill: "toself", fillcolor: ZERO_FILL,
    fillpattern: {shape: "/", fgcolor: "#888888", bgcolor: ZERO_FILL, size: 5, solidity: 0.25},
    line: {width: 0}, hoverinfo: "skip", name: "exactly 0", meta: {cells: zeros}, showlegend: zeros.length > 0};
  const strips = [];
  for (const role of ROLE_ORDER.filter((r) => view.roles.includes(r))) {
    const cells = view.roles.map((r, t) => [r, t]).filter(([r]) => r === role).map(([, t]) => [t, null]);
    const [sx, sy] = cellPolygons(cells, -1.5, -0.7);
    strips.push({type: "scatter", mode: "lines", x: sx, y: sy, fill: "toself", fillcolor: ROLE_COLORS[role],
                 line: {width: 0}, hoverinfo: "skip", name: role, legendgroup: "roles"});
  }
  return [heat, zero, ...strips];
}

function heatmapLayout(view) {
  const T = view.tokens.length, S = view.sites.length, x = view.last_block_start - 0.5;
  const ticktext = view.tokens.map((_, t) => {
    const role = view.roles[t], label = tokenLabel(view, t);
    const bold = LOSS_ROLES.includes(role) ? `<b>${label}</b>` : label;
    return `<span style="color:${ROLE_COLORS[role] || "#333"}">${bold}</span>`;
  });
  return {margin: {l: 140, r: 20, t: 40, b: 130}, height: Math.max(340, 170 + 22 * T),
    xaxis: {tickvals: [...Array(S).keys()], ticktext: view.sites.map((s) => s.label), tickangle: -60,
            range: [-1.6, S - 0.5], zeroline: false, showgrid: false, title: {text: "site (blocks count from 0; layers run left to right)"}},
    yaxis: {tickvals: [...Array(T).keys()], ticktext, autorange: "reversed", zeroline: false, showgrid: false},
    legend: {orientation: "h", y: -0.32, x: 0, font: {size: 11}},
    shapes: [{type: "line", x0: x, x1: x, y0: -0.5, y1: T - 0.5, line: {dash: "dash", width: 2, color: "#222"}}],
    annotations: [{x: (x + S - 0.5) / 2, y: -0.6, yanchor: "bottom", text: "after the last attention",
                   showarrow: false, font: {size: 11}}],
    plot_bgcolor: "#ffffff", font: {family: "Helvetica, Arial, sans-serif", size: 12}};
}

// ---------------------------------------------------------------- last-block sublayers
function sublayerTraces(view) {
  const rows = view.sublayers.filter((r) => r.param === "weight");
  const names = [...new Set(rows.map((r) => r.sublayer))];
  const label = (n) => view.after_mixing.includes(n) ? `${n} ✱` : n;
  const roles = [...new Set(rows.map((r) => r.role))];
  return roles.map((role) => {
    const sel = names.map((n) => rows.find((r) => r.sublayer === n && r.role === role));
    return {type: "bar", orientation: "h", name: role, y: names.map(label), x: sel.map((r) => (r ? 100 * r.share : 0)),
      marker: {color: ROLE_COLORS[role] || "#777"},
      customdata: sel.map((r) => (r ? [r.n_positions, r.n_nonzero, valueText(r.magnitude_sum)] : [0, 0, "n/a"])),
      hovertemplate: `<b>%{y}</b> · ${role}<br>share %{x:.2f}%<br>%{customdata[0]} positions, ` +
                     "%{customdata[1]} with a non-zero gradient<br>Σ|grad| = %{customdata[2]}<extra></extra>"};
  });
}

function renderSublayers(view) {
  const layout = {barmode: "stack", height: 90 + 26 * new Set(view.sublayers.map((r) => r.sublayer)).size,
    margin: {l: 90, r: 20, t: 10, b: 40}, xaxis: {range: [0, 100], title: {text: "share of the weight gradient (%)"}},
    yaxis: {autorange: "reversed"}, legend: {orientation: "h", y: -0.35}, font: {size: 12}};
  Plotly.react("sublayers", sublayerTraces(view), layout, {displayModeBar: false, responsive: true});
  const shared = view.weight_sharing ? ` at its last application (one module applied ${view.weight_sharing.layers.length} ` +
                 "times: see the text)" : "";
  $("sublayers-title").textContent =
    `The last block (blocks.${view.num_blocks - 1}): which roles train each sublayer${shared}`;
}

// ---------------------------------------------------------------- whole view
function render(view) {
  state.view = view;
  renderTokens(view);
  $("explanation").innerHTML = "";
  for (const para of view.explanation) {
    const p = document.createElement("p");
    p.textContent = para;
    $("explanation").appendChild(p);
  }
  const figures = $("figures");
  if (!view.grad_norm) {
    figures.hidden = true;
    figures.dataset.state = "empty";
    showMessage(view.notice, "info");  // once: the explanation panel says what happens next, not the same words
    return;
  }
  figures.hidden = false;
  const loss = view.loss_value === null ? "" : `, loss ${view.loss_value.toFixed(3)} nats`;
  $("heatmap-title").textContent = `${view.model}: ${view.loss_label}${loss}`;
  Plotly.react("heatmap", heatmapTraces(view), heatmapLayout(view), {displaylogo: false, responsive: true})
    .then(() => { figures.dataset.state = "ready"; });
  renderSublayers(view);
  showMessage(view.notice || "", "info");
  updateExports(view);
}

// ---------------------------------------------------------------- live mode: requests
function currentRequest() {
  return {model: $("model").value, loss: $("loss").value, text: $("text").value,
          mask: state.maskMode === "random" ? "random" : state.mask, seed: Number($("seed").value || 0)};
}

async function requestView() {
  if (state.busy) { state.pending = true; return; }
  state.busy = true;
  $("figures").dataset.state = "computing";
  showMessage("computing…", "info");
  try {
    const response = await fetch("api/view", {method: "POST", headers: {"Content-Type": "application/json"},
                                             body: JSON.stringify(currentRequest())});
    const data = await response.json().catch(() => ({error: `the server answered ${response.status}`}));
    if (!response.ok || data.error) {
      $("figures").dataset.state = "error";
      showMessage(data.error || `the server answered ${response.status}`, "error");
    } else {
      render(data);
      if (data.masking.policy === "bert") state.mask = data.masking.selected.slice();
    }
  } catch (err) {
    $("figures").dataset.state = "error";
    showMessage(`The explorer server cannot be reached (${err.message}). Is \`gradflow explore\` still running?`, "error");
  } finally {
    state.busy = false;
    if (state.pending) { state.pending = null; requestView(); }
  }
}

function toggleMask(t) {
  state.maskMode = "explicit";
  const i = state.mask.indexOf(t);
  if (i >= 0) state.mask.splice(i, 1); else state.mask.push(t);
  state.mask.sort((a, b) => a - b);
  requestView();
}

function exportQuery(format) {
  const r = currentRequest();
  const params = new URLSearchParams({format, model: r.model, loss: r.loss, text: r.text, seed: String(r.seed),
                                      mask: r.mask === "random" ? "random" : r.mask.join(",")});
  return `api/export?${params}`;
}

function updateExports(view) {
  if (cfg.mode === "live") {
    for (const fmt of ["png", "pdf", "csv"]) $(`export-${fmt}`).href = exportQuery(fmt);
    return;
  }
  $("export-csv").onclick = (e) => { e.preventDefault(); downloadCsv(view); };
  $("export-png").title = "the heatmap as drawn here (the publication figure: gradflow channels)";
  $("export-png").onclick = (e) => {
    e.preventDefault();
    Plotly.downloadImage("heatmap", {format: "png", filename: "channel_view", scale: 2});
  };
}

function downloadCsv(view) {
  // the columns of gradflow channels' CSV; the attribution columns stay empty, as they are there for grad_norm
  const columns = view.csv_columns;
  const q = (s) => `"${String(s).replace(/"/g, '""')}"`;
  const lines = [columns.join(",")];
  view.sites.forEach((site, s) => view.tokens.forEach((tok, t) => {
    const row = {position: t, token: q(tok), input_token: q(view.input_tokens[t]), role: view.roles[t],
                 site: site.name, layer: site.layer, point: site.point, grad_norm: view.grad_norm[t][s],
                 act_norm: view.act_norm[t][s]};
    lines.push(columns.map((c) => (c in row && row[c] !== null ? row[c] : "")).join(","));
  }));
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([lines.join("\n") + "\n"], {type: "text/csv"}));
  link.download = "channel_view.csv";
  link.click();
}

function setUpLive() {
  for (const name of cfg.models) $("model").add(new Option(name, name));
  for (const [key, label] of Object.entries(cfg.losses)) $("loss").add(new Option(label, key));
  let shownModel = $("model").value;
  $("text").value = cfg.examples[shownModel];
  $("text").maxLength = cfg.max_chars;
  const fresh = () => { state.maskMode = "explicit"; state.mask = []; requestView(); };
  $("show").addEventListener("click", fresh);
  $("text").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); fresh(); } });
  $("model").addEventListener("change", () => {
    // a protein or reaction model starts from its own example, unless the student has typed something
    const text = $("text").value.trim();
    if (!text || text === cfg.examples[shownModel]) $("text").value = cfg.examples[$("model").value];
    shownModel = $("model").value;
    fresh();
  });
  $("loss").addEventListener("change", () => requestView());
  $("random").addEventListener("click", () => { state.maskMode = "random"; requestView(); });
  $("clear").addEventListener("click", fresh);
  // the first screen: BERT's 15% drawn at seed 0 on the model's example sentence, never an empty view
  $("seed").value = "0";
  state.maskMode = "random";
  requestView();
}

// the export links a page offers, joined by " · " (a static page has no PDF: no empty item is left behind)
function setExports(formats) {
  const line = $("exports");
  const links = ["png", "pdf", "csv"].map((f) => $(`export-${f}`));
  line.textContent = "Export: ";
  links.filter((a) => formats.includes(a.id.slice(7))).forEach((a, i) => {
    if (i > 0) line.appendChild(document.createTextNode(" · "));
    line.appendChild(a);
  });
}

function setUpStatic() {
  document.body.classList.add("static");
  setExports(["png", "csv"]);
  render(cfg.view);
  if (cfg.view.grad_norm) {
    showMessage(`A saved view of ${cfg.view.model} (“${cfg.view.text}”); run \`gradflow explore\` to change the ` +
                "sentence or the mask.", "info");
  }
}

// plotly.js is on the page, except in a notebook's frame: there the notebook page hands it over (postMessage)
const NO_PLOTLY = "plotly.js did not arrive. In a notebook it comes with the first channel view displayed in the kernel " +
  "session, and the notebook must be trusted to run it. If that output was cleared, run " +
  "gradflow.explore.view.reset_notebook_plotly() and display the view again.";

function withPlotly(start) {
  if (window.Plotly || cfg.plotly !== "parent") { start(); return; }
  let tries = 0, timer = null;
  const ask = () => {
    if (++tries > 40) { clearInterval(timer); showMessage(NO_PLOTLY, "error"); return; }
    window.parent.postMessage({gradflow: "plotly?"}, "*");
  };
  window.addEventListener("message", (e) => {
    if (e.source !== window.parent || !e.data || e.data.gradflow !== "plotly" || window.Plotly) return;
    clearInterval(timer);
    if (!e.data.js) { showMessage(NO_PLOTLY, "error"); return; }
    const script = document.createElement("script");
    script.textContent = e.data.js;
    document.head.appendChild(script);
    start();
  });
  ask();
  timer = setInterval(ask, 250);
}

window.addEventListener("DOMContentLoaded", () => withPlotly(cfg.mode === "live" ? setUpLive : setUpStatic));
