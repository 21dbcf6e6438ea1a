"""The explorer page's CSS and JavaScript (inlined into every page; see explorer.py).

Kept as Python strings so they ship inside the package with no package-data configuration.
The script reads the JSON block ``#attnlab-data`` and draws four panels (the overview of every
layer x head, the head view, the heatmap, the movement); ``window.attnlabExplorer``
exposes the state and the draw functions to tests. It uses no library and no network.
"""

CSS = r"""
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: #222; background: #fafafa; }
header { padding: 10px 18px 4px; background: #fff; border-bottom: 1px solid #ddd; }
h1 { font-size: 17px; margin: 0 0 8px; font-weight: 600; }
h2 { font-size: 15px; margin: 0 0 2px; }
#controls { display: flex; flex-wrap: wrap; gap: 18px; align-items: center; }
#controls label { display: flex; gap: 6px; align-items: center; }
select { font: inherit; padding: 2px 4px; }
#threshold { width: 120px; }
#info { color: #555; margin: 6px 0 2px; font-size: 13px; }
/* its own line, always one line high: hovering never moves the page under the mouse */
#focus-info { color: #c0392b; font-weight: 600; margin: 6px 0 0; min-height: 1.4em;
              white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
main { display: flex; flex-wrap: wrap; gap: 14px; padding: 14px 18px; align-items: flex-start; }
.panel { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; }
.hint { color: #666; font-size: 12px; margin: 0 0 6px; width: 0; min-width: 100%; }
#headview-scroll { max-height: 640px; overflow-y: auto; overflow-x: hidden; }
#headview text { font: 12px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
                 cursor: pointer; user-select: none; }
#headview text.special { fill: #888; font-style: italic; }
#headview text.focus { font-weight: 700; fill: #c0392b; }
#headview .colhead { font-size: 11px; fill: #666; cursor: default; }
#heatmap-wrap { display: flex; gap: 8px; align-items: flex-start; }
#heatmap { image-rendering: pixelated; cursor: crosshair; }
#readout { font-size: 12px; color: #333; min-height: 1.4em; margin: 4px 0 0; }
#movement text { font-size: 11px; fill: #333; pointer-events: none; paint-order: stroke;
                 stroke: #fff; stroke-width: 3px; stroke-linejoin: round; }
#movement text.focus { font-size: 13px; font-weight: 700; fill: #c0392b; }
#movement .axis { font-size: 11px; fill: #666; }
#movement circle { cursor: pointer; }
footer { padding: 0 18px 18px; color: #666; font-size: 12px; max-width: 1100px; }
#overview { display: grid; gap: 3px; align-items: start; max-height: 560px; overflow: auto;
            padding-right: 4px; max-width: 100%; }
#overview .ov-col { font-size: 10px; color: #666; text-align: center; }
#overview .ov-layer { font: 11px system-ui, sans-serif; color: #444; background: none; border: 0;
                      padding: 0 6px 0 0; text-align: right; white-space: nowrap;
                      cursor: pointer; align-self: center; }
#overview .ov-layer.selected { color: #c0392b; font-weight: 700; }
#overview .thumb { display: flex; flex-direction: column; align-items: center; padding: 1px;
                   border: 2px solid transparent; border-radius: 3px; background: #fff;
                   cursor: pointer; font: inherit; }
#overview .thumb:hover { border-color: #9ab; }
#overview .thumb.selected { border-color: #c0392b; }
#overview .thumb canvas { image-rendering: pixelated; display: block; }
#overview .ov-h { font-size: 9px; line-height: 1.1; color: #777; }
#overview .pat { font-size: 10px; line-height: 1.25; color: #333; }
#overview .pat-prev, #overview .pat-next, #overview .pat-diag { color: #1f5fa8; }
#overview .pat-sink { color: #888; }
#overview .pat-broad { color: #2e7d32; }
#overview .pat-content { color: #c0392b; font-weight: 600; }
#overview-selected { margin: 2px 0 6px; font-size: 13px; min-height: 1.4em; }
"""

JS = r"""
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("attnlab-data").textContent);
  const SVGNS = "http://www.w3.org/2000/svg";  // a namespace name, never fetched
  const QT = DATA.query_tokens, KT = DATA.key_tokens;
  const L = QT.length, S = KT.length, H = DATA.num_heads, NL = DATA.num_layers;
  const SPECIAL = new Set(DATA.special);
  const MAX_LINES = 1500;        // the strongest lines drawn at once
  const ROW = 17;                // head view row height (px)
  const MIN_HOVER_WEIGHT = 0.002; // a hovered token's lines: every weight above this
  const PULL_MAX_WIDTH = 9;      // px, the strongest pull on the focus token
  const state = {
    layer: DATA.default.layer, head: DATA.default.head, threshold: DATA.default.threshold,
    hover: null, pinned: null,   // {i, side: "q" | "k"}
    scale: Math.max(L, S) > 64 ? "sqrt" : "linear",
    aside: DATA.default.aside || "none",  // "special" | "first": keys set aside, renormalised
  };

  // ---- data: base64 -> typed arrays, one layer at a time --------------------------------
  function bytes(b64) {
    const bin = atob(b64), out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  // little-endian, as Python wrote them (and as every browser's typed arrays read them)
  const typed = (Kind) => (b64) => {
    const b = bytes(b64);
    return new Kind(b.buffer, 0, b.length / Kind.BYTES_PER_ELEMENT);
  };
  const f32 = typed(Float32Array), u16 = typed(Uint16Array), i16 = typed(Int16Array);

  const cache = new Map();       // layer -> {heads: [Float32Array L*S], mean: Float32Array|null}
  function layerData(l) {
    if (cache.has(l)) return cache.get(l);
    const enc = DATA.layers[l], rowmax = f32(enc.rowmax), q = bytes(enc.w);
    const ix = DATA.encoding.kind === "topk" ? u16(enc.idx) : null;
    const EX = DATA.encoding.exact, ex = enc.exact ? f32(enc.exact) : null;  // exact columns
    const total = enc.total ? f32(enc.total) : null;  // top-k: each row's true sum [H, L]
    const levels = DATA.encoding.levels, heads = [];
    for (let h = 0; h < H; h++) {
      const m = new Float32Array(L * S);
      if (DATA.encoding.kind === "dense") {
        for (let i = 0; i < L; i++) {
          const r = rowmax[h * L + i] / levels, base = (h * L + i) * S;
          for (let j = 0; j < S; j++) m[i * S + j] = q[base + j] * r;
        }
      } else {
        const k = DATA.encoding.k;
        for (let i = 0; i < L; i++) {
          const r = rowmax[h * L + i] / levels, base = (h * L + i) * k;
          for (let t = 0; t < k; t++) m[i * S + ix[base + t]] = q[base + t] * r;
        }
      }
      if (ex) {
        for (let i = 0; i < L; i++) {
          const base = (h * L + i) * EX.length;
          for (let c = 0; c < EX.length; c++) m[i * S + EX[c]] = ex[base + c];
        }
      }
      heads.push(m);
    }
    const entry = { heads: heads, mean: null, total: total, meanTotal: null };
    cache.set(l, entry);
    if (cache.size > 3) cache.delete(cache.keys().next().value);  // keep memory bounded
    return entry;
  }
  function matrix(l, h) {
    const e = layerData(l);
    if (h >= 0) return e.heads[h];
    if (!e.mean) {
      const m = new Float32Array(L * S);
      for (const hm of e.heads) for (let x = 0; x < m.length; x++) m[x] += hm[x];
      for (let x = 0; x < m.length; x++) m[x] /= H;
      e.mean = m;
    }
    return e.mean;
  }
  // Each row's true sum, where the page holds only its strongest weights (else null: the
  // decoded row sums to it, within the 8 bits' rounding).
  function rowTotals(l, h) {
    const e = layerData(l);
    if (!e.total) return null;
    if (h >= 0) return e.total.subarray(h * L, (h + 1) * L);
    if (!e.meanTotal) {
      const t = new Float32Array(L);
      for (let x = 0; x < H * L; x++) t[x % L] += e.total[x] / H;
      e.meanTotal = t;
    }
    return e.meanTotal;
  }
  // What is drawn: the weights, or each row renormalised without some keys. Attention to
  // [CLS]/[SEP] (BERT) or to the first token (a decoder's "attention sink") is often a no-op
  // that hides the rest of the row; setting it aside shows how the rest is shared.
  const ASIDE = { none: new Set(), special: SPECIAL, first: new Set([0]) };
  const shown = new Map();
  function current() {
    const W = matrix(state.layer, state.head), out = ASIDE[state.aside];
    if (!out.size || DATA.kind === "cross") return W;
    const key = state.layer + ":" + state.head + ":" + state.aside;
    if (!shown.has(key)) {
      const V = new Float32Array(W.length), total = rowTotals(state.layer, state.head);
      for (let i = 0; i < L; i++) {
        // what the row gives the other keys: its true sum less the set-aside keys' (exact)
        // weights where weak weights were left out, else the sum of what is stored
        let sum = 0;
        if (total) {
          sum = total[i];
          for (const j of out) if (j < S) sum -= W[i * S + j];
        } else {
          for (let j = 0; j < S; j++) if (!out.has(j)) sum += W[i * S + j];
        }
        for (let j = 0; j < S; j++) {
          V[i * S + j] = out.has(j) || sum <= 0 ? 0 : W[i * S + j] / sum;
        }
      }
      shown.clear(); shown.set(key, V);
    }
    return shown.get(key);
  }
  const focus = () => state.hover || state.pinned;
  const headName = () => (state.head < 0 ? "mean of heads" : "head " + state.head);

  // ---- colours: an approximation of viridis (dark blue = 0 -> yellow = max) ---------------
  const ANCHORS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const LUT = [];
  for (let t = 0; t < 256; t++) {
    const x = (t / 255) * (ANCHORS.length - 1), a = Math.min(Math.floor(x), ANCHORS.length - 2);
    const f = x - a;
    LUT.push(ANCHORS[a].map((c, c_i) => Math.round(c + f * (ANCHORS[a + 1][c_i] - c))));
  }

  // ---- svg helpers --------------------------------------------------------------------
  function el(name, attrs, parent) {
    const e = document.createElementNS(SVGNS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  const short = (t) => (t.length > 16 ? t.slice(0, 15) + "…" : t);
  // A label that fits in maxPx (as `width` measures it): the token, or its first characters
  // and "…" (at most 16 characters, as short()). Where a label is elided, its element carries
  // the whole token as a tooltip; the heatmap's labels show it when hovered.
  function fitLabel(t, maxPx, width) {
    const cp = Array.from(t);  // code points: an emoji is never cut in half
    if (cp.length <= 16 && width(t) <= maxPx) return t;
    let n = Math.min(cp.length, 15);
    while (n > 1 && width(cp.slice(0, n).join("") + "…") > maxPx) n--;
    return cp.slice(0, n).join("") + "…";
  }
  const measurer = document.createElement("canvas").getContext("2d");
  function widthIn(font) {
    return (s) => { measurer.font = font; return measurer.measureText(s).width; };
  }

  // ---- head view ----------------------------------------------------------------------
  const hv = document.getElementById("headview");
  const HV_W = 380, XQ = 150, XK = 230, TOP = 22;
  const HV_LABEL = 140;  // px a head-view label may take: the space beside its column, less 6
  // measured in the labels' own font, bold (a focused label is bold: it must fit too)
  const hvWidth = widthIn('700 12px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif');
  const hvHeight = TOP + Math.max(L, S) * ROW + 6;
  hv.setAttribute("width", HV_W); hv.setAttribute("height", hvHeight);
  el("text", { x: XQ, y: 12, "text-anchor": "end", class: "colhead" }, hv).textContent =
    DATA.kind === "cross" ? "target (attending)" : "query (attending)";
  el("text", { x: XK, y: 12, class: "colhead" }, hv).textContent =
    DATA.kind === "cross" ? "source (attended to)" : "key (attended to)";
  const hvLines = el("g", { id: "hv-lines" }, hv);
  const qText = [], kText = [], kBack = [], qBack = [];
  function tokenColumn(tokens, side) {
    const x = side === "q" ? XQ : XK, texts = [], backs = [];
    tokens.forEach((t, i) => {
      const y = TOP + i * ROW + ROW / 2;
      const back = el("rect", { x: side === "q" ? x - 130 : x - 4, y: y - ROW / 2 + 1, width: 134,
        height: ROW - 2, fill: "#1f5fa8", "fill-opacity": 0, rx: 2,
        "pointer-events": "none" }, hv);
      const label = fitLabel(t, HV_LABEL, hvWidth);
      const group = el("g", {}, hv);  // a <title> in the group: the whole token on hover
      if (label !== t) el("title", {}, group).textContent = t;
      const txt = el("text", { x: side === "q" ? x : x + 0, y: y + 4, "text-anchor":
        side === "q" ? "end" : "start", "data-i": i, class: "tok " + side +
        (side === "q" && SPECIAL.has(i) ? " special" : "") }, group);
      txt.textContent = label;
      txt.addEventListener("mouseenter", () => { state.hover = { i: i, side: side }; update(); });
      txt.addEventListener("mouseleave", () => { state.hover = null; update(); });
      txt.addEventListener("click", () => {
        const p = state.pinned;
        state.pinned = p && p.i === i && p.side === side ? null : { i: i, side: side };
        update();
      });
      texts.push(txt); backs.push(back);
    });
    return [texts, backs];
  }
  {
    const [qt, qb] = tokenColumn(QT, "q"), [kt, kb] = tokenColumn(KT, "k");
    qText.push(...qt); qBack.push(...qb); kText.push(...kt); kBack.push(...kb);
  }
  const yOf = (i) => TOP + i * ROW + ROW / 2;

  function drawHeadView() {
    const W = current(), f = focus();
    const edges = [];
    if (f && f.side === "q") {  // what the focus token attends to: its row
      for (let j = 0; j < S; j++) {
        const w = W[f.i * S + j];
        if (w > MIN_HOVER_WEIGHT) edges.push([f.i, j, w]);
      }
    } else if (f && f.side === "k") {  // what attends to it: its column
      for (let i = 0; i < L; i++) {
        const w = W[i * S + f.i];
        if (w > MIN_HOVER_WEIGHT) edges.push([i, f.i, w]);
      }
    } else {  // every weight above the threshold
      for (let i = 0; i < L; i++) {
        for (let j = 0; j < S; j++) {
          const w = W[i * S + j];
          if (w >= state.threshold) edges.push([i, j, w]);
        }
      }
    }
    edges.sort((a, b) => b[2] - a[2]);
    if (edges.length > MAX_LINES) edges.length = MAX_LINES;
    const top = edges.length ? edges[0][2] : 1;
    const colour = f && f.side === "k" ? "#e67e22" : "#1f5fa8";
    const frag = document.createDocumentFragment();
    for (const [i, j, w] of edges) {
      const r = w / top;
      el("line", { x1: XQ + 4, y1: yOf(i), x2: XK - 4, y2: yOf(j), stroke: colour,
        "stroke-width": (0.6 + 3 * r).toFixed(2), "stroke-opacity": (0.12 + 0.8 * r).toFixed(3),
        "data-i": i, "data-j": j, "data-w": w.toFixed(4) }, frag);
    }
    hvLines.replaceChildren(frag);
    hv.dataset.lines = String(edges.length);
    // token backgrounds: the focus row's weights on the key side, or the focus column's
    for (let j = 0; j < S; j++) {
      const w = f && f.side === "q" ? W[f.i * S + j] : 0;
      kBack[j].setAttribute("fill-opacity", (w / (top || 1) * 0.35).toFixed(3));
    }
    for (let i = 0; i < L; i++) {
      const w = f && f.side === "k" ? W[i * S + f.i] : 0;
      qBack[i].setAttribute("fill", "#e67e22");
      qBack[i].setAttribute("fill-opacity", (w / (top || 1) * 0.35).toFixed(3));
    }
    qText.forEach((t, i) => t.classList.toggle("focus", !!f && f.side === "q" && f.i === i));
    kText.forEach((t, j) => t.classList.toggle("focus", !!f && f.side === "k" && f.i === j));
  }

  // ---- heatmap ------------------------------------------------------------------------
  const hm = document.getElementById("heatmap"), cb = document.getElementById("colorbar");
  const cell = Math.max(1, Math.min(28, Math.floor(480 / Math.max(L, S))));
  const labels = cell >= 9;
  const ctx = hm.getContext("2d");
  // one font for measuring and drawing the labels (measured at 11 px and drawn at 12, a long
  // label ran past the canvas's edge); a label wider than HM_LABEL is elided, and hovering
  // it shows the whole token (the readout and the canvas's tooltip)
  const HM_LABEL = 140, LABEL_FONT = Math.min(12, cell) + "px sans-serif";
  const hmWidth = widthIn(LABEL_FONT);
  const qLabels = QT.map((t) => fitLabel(t, HM_LABEL, hmWidth));
  const kLabels = KT.map((t) => fitLabel(t, HM_LABEL, hmWidth));
  const labelW = (shown) => Math.ceil(Math.max(0, ...shown.map(hmWidth))) + 8;
  const M = { left: labels ? labelW(qLabels) : 6, top: 6, bottom: labels ? labelW(kLabels) : 6 };
  hm.width = M.left + S * cell + 6; hm.height = M.top + L * cell + M.bottom;
  const off = document.createElement("canvas");
  off.width = S; off.height = L;
  let heatTop = 1;

  function drawHeatmap() {
    const W = current(), f = focus();
    let top = 0;
    for (let x = 0; x < W.length; x++) if (W[x] > top) top = W[x];
    heatTop = top > 0 ? top : 1;
    const octx = off.getContext("2d"), img = octx.createImageData(S, L);
    const sqrt = state.scale === "sqrt";
    for (let x = 0; x < W.length; x++) {
      const t = W[x] / heatTop, c = LUT[Math.min(255, Math.round((sqrt ? Math.sqrt(t) : t) * 255))];
      img.data[4 * x] = c[0]; img.data[4 * x + 1] = c[1]; img.data[4 * x + 2] = c[2];
      img.data[4 * x + 3] = 255;
    }
    octx.putImageData(img, 0, 0);
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, hm.width, hm.height);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, M.left, M.top, S * cell, L * cell);
    if (labels) {
      ctx.fillStyle = "#333"; ctx.font = LABEL_FONT;
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      qLabels.forEach((t, i) => ctx.fillText(t, M.left - 4, M.top + (i + 0.5) * cell));
      kLabels.forEach((t, j) => {
        ctx.save(); ctx.translate(M.left + (j + 0.5) * cell, M.top + L * cell + 4);
        ctx.rotate(-Math.PI / 2); ctx.fillText(t, 0, 0); ctx.restore();
      });
    }
    if (f) {
      ctx.strokeStyle = "#ff3b30"; ctx.lineWidth = 2;
      if (f.side === "q") ctx.strokeRect(M.left, M.top + f.i * cell, S * cell, cell);
      else ctx.strokeRect(M.left + f.i * cell, M.top, cell, L * cell);
    }
    drawColorbar();
  }
  function drawColorbar() {
    const h = Math.min(L * cell, 300), c = cb.getContext("2d");
    cb.width = 64; cb.height = h + 20;
    for (let y = 0; y < h; y++) {
      const v = LUT[Math.round(255 * (1 - y / (h - 1 || 1)))];
      c.fillStyle = "rgb(" + v.join(",") + ")"; c.fillRect(0, 10 + y, 14, 1);
    }
    c.fillStyle = "#333"; c.font = "11px sans-serif"; c.textBaseline = "middle";
    const mid = state.scale === "sqrt" ? heatTop / 4 : heatTop / 2;  // the colour halfway up
    c.fillText(heatTop.toFixed(3), 18, 10); c.fillText(mid.toFixed(3), 18, 10 + h / 2);
    c.fillText("0", 18, 10 + h - 1);
  }
  hm.addEventListener("mousemove", (ev) => {
    const r = hm.getBoundingClientRect();
    const x = (ev.clientX - r.left) * (hm.width / r.width) - M.left;
    const y = (ev.clientY - r.top) * (hm.height / r.height) - M.top;
    const i = Math.floor(y / cell), j = Math.floor(x / cell);
    const out = document.getElementById("readout");
    let tip = "";
    if (i >= 0 && i < L && j >= 0 && j < S) {
      out.textContent = "“" + QT[i] + "” (" + i + ") → “" + KT[j] + "” (" + j + "): " +
        current()[i * S + j].toFixed(3);
    } else if (labels && x < 0 && i >= 0 && i < L) {  // a query's label: the whole token
      tip = out.textContent = (DATA.kind === "cross" ? "target" : "query") + " " + i + ": " +
        QT[i];
    } else if (labels && y >= L * cell && j >= 0 && j < S) {  // a key's label
      tip = out.textContent = (DATA.kind === "cross" ? "source" : "key") + " " + j + ": " +
        KT[j];
    }
    hm.title = tip;
  });

  // ---- embedding movement --------------------------------------------------------------
  const mv = document.getElementById("movement");
  const MV_W = 460, MV_H = 420, PAD = 34;
  mv.setAttribute("width", MV_W); mv.setAttribute("height", MV_H);
  mv.setAttribute("viewBox", "0 0 " + MV_W + " " + MV_H);
  const ptsCache = new Map();
  function points(l) {
    if (!ptsCache.has(l)) ptsCache.set(l, i16(DATA.movement[l].pts));
    return ptsCache.get(l);
  }
  function drawMovement() {
    if (!DATA.movement) return;
    const P = points(state.layer), sets = DATA.movement[state.layer].sets;
    // set 0: before; 1: after the whole attention sublayer; 2 + h: after head h alone
    const s = state.head >= 0 && DATA.head_writes ? 2 + state.head : 1;
    // the view: tokens the projection was fitted on (far-out ones are drawn at the edge)
    const unfitted = new Set(DATA.movement[state.layer].unfitted);
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (let a = 0; a < sets * L; a++) {
      if (unfitted.has(a % L)) continue;
      const x = P[2 * a], y = P[2 * a + 1];
      if (x < x0) x0 = x; if (x > x1) x1 = x; if (y < y0) y0 = y; if (y > y1) y1 = y;
    }
    const sx = (MV_W - 2 * PAD) / ((x1 - x0) || 1), sy = (MV_H - 2 * PAD) / ((y1 - y0) || 1);
    const rawX = (set, i) => PAD + (P[2 * (set * L + i)] - x0) * sx;
    const rawY = (set, i) => MV_H - PAD - (P[2 * (set * L + i) + 1] - y0) * sy;
    const inside = (x, y) =>
      x >= PAD - 1 && x <= MV_W - PAD + 1 && y >= PAD - 1 && y <= MV_H - PAD + 1;
    const offChart = new Set();
    for (const i of unfitted) if (!inside(rawX(0, i), rawY(0, i))) offChart.add(i);
    // an off-chart token is drawn where the line from the chart's centre to it leaves the chart
    function edge(x, y) {
      const cx = MV_W / 2, cy = MV_H / 2, dx = x - cx, dy = y - cy;
      let t = 1;
      if (x > MV_W - PAD) t = Math.min(t, (MV_W - PAD - cx) / dx);
      if (x < PAD) t = Math.min(t, (PAD - cx) / dx);
      if (y > MV_H - PAD) t = Math.min(t, (MV_H - PAD - cy) / dy);
      if (y < PAD) t = Math.min(t, (PAD - cy) / dy);
      return [cx + dx * t, cy + dy * t];
    }
    const X = (set, i) => (offChart.has(i) ? edge(rawX(set, i), rawY(set, i))[0] : rawX(set, i));
    const Y = (set, i) => (offChart.has(i) ? edge(rawX(set, i), rawY(set, i))[1] : rawY(set, i));
    const f = focus(), fi = f ? f.i : DATA.default.focus;
    const crowded = L > 60;  // hundreds of tokens: lighter marks, the focus and pulls stand out
    const W = current();
    const frag = document.createDocumentFragment();
    const defs = el("defs", {}, frag);
    const marker = el("marker", { id: "head", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 5, markerHeight: 5, orient: "auto-start-reverse" }, defs);
    el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#1f5fa8" }, marker);
    const fmarker = el("marker", { id: "fhead", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 4, markerHeight: 4, orient: "auto-start-reverse" }, defs);
    el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#c0392b" }, fmarker);
    // pulls on the focus token: width proportional to its weight on each other token
    const pulls = el("g", { id: "mv-pulls" }, frag);
    let top = 0;
    for (let j = 0; j < L; j++) if (j !== fi && W[fi * S + j] > top) top = W[fi * S + j];
    const ranked = [];
    for (let j = 0; j < L; j++) {
      if (j === fi) continue;
      const w = W[fi * S + j], width = top > 0 ? (PULL_MAX_WIDTH * w) / top : 0;
      ranked.push([w, j]);
      if (width < 0.05) continue;
      el("line", { x1: X(0, fi), y1: Y(0, fi), x2: X(0, j), y2: Y(0, j), stroke: "#e67e22",
        "stroke-opacity": 0.5, "stroke-width": width.toFixed(3), "stroke-linecap": "round",
        "data-j": j, "data-w": w.toFixed(4) }, pulls);
    }
    ranked.sort((a, b) => b[0] - a[0]);
    const arrows = el("g", { id: "mv-arrows" }, frag);
    for (let i = 0; i < L; i++) {
      if (i === fi) continue;
      el("line", { x1: X(0, i), y1: Y(0, i), x2: X(s, i), y2: Y(s, i), stroke: "#1f5fa8",
        "stroke-opacity": crowded ? 0.15 : 0.45, "stroke-width": crowded ? 0.8 : 1.2,
        "marker-end": "url(#head)" }, arrows);
    }
    el("line", { x1: X(0, fi), y1: Y(0, fi), x2: X(s, fi), y2: Y(s, fi), stroke: "#c0392b",
      "stroke-width": 2.5, "marker-end": "url(#fhead)", id: "mv-focus-arrow" }, arrows);
    const dots = el("g", { id: "mv-points" }, frag);
    for (let i = 0; i < L; i++) {
      const before = el("circle", { cx: X(0, i), cy: Y(0, i), r: crowded ? 2.2 : 4, fill: "#fff",
        stroke: "#8a8a8a", "stroke-width": 1.3, "data-i": i }, dots);
      el("circle", { cx: X(s, i), cy: Y(s, i), r: i === fi ? 5 : crowded ? 1.8 : 3.2,
        fill: i === fi ? "#c0392b" : "#1f5fa8", "data-i": i }, dots);
      before.addEventListener("mouseenter", () => { state.hover = { i: i, side: "q" }; update(); });
      before.addEventListener("mouseleave", () => { state.hover = null; update(); });
    }
    const labelled = L <= 40 ? [...Array(L).keys()] : [fi, ...ranked.slice(0, 8).map((r) => r[1])];
    for (const i of labelled) {
      const right = X(0, i) > MV_W - 90;
      const t = el("text", { x: X(0, i) + (right ? -6 : 6), y: Y(0, i) + (i === fi ? 16 : -5),
        "text-anchor": right ? "end" : "start", class: i === fi ? "focus" : "" }, frag);
      t.textContent = short(QT[i]) + (offChart.has(i) ? " (off chart)" : "");
    }
    const ex = DATA.movement[state.layer].explained;
    el("text", { x: MV_W / 2, y: MV_H - 8, "text-anchor": "middle", class: "axis" }, frag)
      .textContent = "PC1 (" + Math.round(100 * ex[0]) + "% of variance)";
    el("text", { x: 12, y: MV_H / 2, "text-anchor": "middle", class: "axis",
      transform: "rotate(-90 12 " + MV_H / 2 + ")" }, frag)
      .textContent = "PC2 (" + Math.round(100 * ex[1]) + "% of variance)";
    mv.replaceChildren(frag);
    mv.dataset.focus = String(fi);
    document.getElementById("movement-hint").textContent =
      DATA.layer_names[state.layer] + " · " + headName() + ": hollow = before, filled = " +
      (s === 1 ? "after the attention sublayer (x + attention(x)" +
        (state.head >= 0 ? ", all heads: this trace has no per-head outputs)" : ")") :
        "after this head's write alone (x + head " + state.head + ")") +
      ". Orange: the pull of each token on “" + QT[fi] +
      "”, as wide as its attention weight. One PCA per layer, fitted on before and after.";
  }

  // ---- controls and updates ------------------------------------------------------------
  const layerSel = document.getElementById("layer"), headSel = document.getElementById("head");
  DATA.layer_names.forEach((name, l) => layerSel.add(new Option(name, String(l))));
  headSel.add(new Option("mean of heads", "-1"));
  for (let h = 0; h < H; h++) headSel.add(new Option("head " + h, String(h)));
  layerSel.value = String(state.layer); headSel.value = String(state.head);
  const thr = document.getElementById("threshold");
  const thrOut = document.getElementById("threshold-value");
  thr.value = String(state.threshold); thrOut.textContent = state.threshold.toFixed(2);
  layerSel.addEventListener("change", () => { state.layer = +layerSel.value; update(); });
  headSel.addEventListener("change", () => { state.head = +headSel.value; update(); });
  const scaleSel = document.getElementById("scale"), aside = document.getElementById("aside");
  scaleSel.value = state.scale;
  scaleSel.addEventListener("change", () => { state.scale = scaleSel.value; update(); });
  if (DATA.kind === "cross") aside.parentElement.style.display = "none";
  if (!SPECIAL.size) aside.querySelector("option[value='special']").remove();
  aside.value = state.aside;
  aside.addEventListener("change", () => { state.aside = aside.value; update(); });
  thr.addEventListener("input", () => {
    state.threshold = +thr.value; thrOut.textContent = state.threshold.toFixed(2); update();
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.target && ev.target.tagName === "SELECT") return;
    if (ev.key === "ArrowDown" && state.layer < NL - 1) state.layer++;
    else if (ev.key === "ArrowUp" && state.layer > 0) state.layer--;
    else if (ev.key === "ArrowRight" && state.head < H - 1) state.head++;
    else if (ev.key === "ArrowLeft" && state.head > -1) state.head--;
    else return;
    layerSel.value = String(state.layer); headSel.value = String(state.head); update();
  });

  // ---- overview: every layer x head at a glance, each labelled with its pattern ----------
  // Thumbnails come precomputed (averaged down to <= 32 x 32 cells, 8 bits on one colour
  // scale for the whole page: relative to the largest cell of any thumbnail, OV.top), once per
  // "set aside" choice; the labels are computed in Python from the full weights
  // (attnlab.viz.head_patterns), never from the thumbnails.
  const OV = DATA.overview, PAT = DATA.patterns;
  const PAT_CLASSES = new Set(["prev", "next", "diag", "sink", "broad", "content"]);
  const ovBox = document.getElementById("overview");
  // Each cell is a whole number of screen pixels (a 32-cell thumbnail squeezed into 30 css px
  // dropped two rows and columns, "pixelated"), about THUMB_TARGET css px a side; a layer's
  // heads wrap onto rows of at most OV_ROW_WIDTH css px, so many heads stay legible.
  const THUMB_TARGET = 56, OV_ROW_WIDTH = 900, DPR = window.devicePixelRatio || 1;
  const cellPx = Math.max(1, Math.round((THUMB_TARGET * DPR) / Math.max(OV.rows, OV.cols))) / DPR;
  const TW = OV.cols * cellPx, TH = OV.rows * cellPx;  // css px of a thumbnail's canvas
  const PER_ROW = Math.max(1, Math.min(H, Math.floor(OV_ROW_WIDTH / (TW + 9))));
  const ROWS = Math.ceil(H / PER_ROW), WRAPPED = PER_ROW < H;  // grid rows per layer
  ovBox.style.gridTemplateColumns = "auto repeat(" + PER_ROW + ", " + Math.ceil(TW + 6) + "px)";
  ovBox.dataset.perRow = String(PER_ROW);
  const thumbs = [], layerButtons = [];  // thumbs[layer][head] = {button, canvas}
  function openHead(l, h) {
    state.layer = l; state.head = h;
    layerSel.value = String(l); headSel.value = String(h); update();
  }
  function node(tag, cls, text) {
    const e = document.createElement(tag);
    e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  // column heads name the heads when a layer is one row; wrapped, each thumbnail names its own
  const head0 = WRAPPED ? 1 : 2;  // the grid row of layer 0
  if (!WRAPPED) {
    ovBox.appendChild(node("span", "ov-col"));
    for (let h = 0; h < H; h++) ovBox.appendChild(node("span", "ov-col", "head " + h));
  }
  for (let l = 0; l < NL; l++) {
    const name = node("button", "ov-layer", DATA.layer_names[l]);
    name.dataset.layer = String(l);
    name.title = "the mean of the heads of " + DATA.layer_names[l];
    name.style.gridColumn = "1";
    name.style.gridRow = head0 + l * ROWS + " / span " + ROWS;
    name.addEventListener("click", () => openHead(l, -1));
    ovBox.appendChild(name); layerButtons.push(name);
    const row = [];
    for (let h = 0; h < H; h++) {
      const b = node("button", "thumb");
      b.dataset.layer = String(l); b.dataset.head = String(h);
      b.style.gridColumn = String(2 + (h % PER_ROW));
      b.style.gridRow = String(head0 + l * ROWS + Math.floor(h / PER_ROW));
      if (WRAPPED) b.appendChild(node("span", "ov-h", "head " + h));
      const c = document.createElement("canvas");
      c.width = OV.cols; c.height = OV.rows;
      c.style.width = TW + "px";
      c.style.height = TH + "px";
      b.appendChild(c);
      const p = PAT ? PAT[l][h] : null;
      if (p) {
        b.appendChild(node("span", "pat" + (PAT_CLASSES.has(p.short) ? " pat-" + p.short : ""),
          p.short));
      }
      b.title = DATA.layer_names[l] + " · head " + h +
        (p ? ": " + p.label + " " + p.score.toFixed(2) : "");
      b.addEventListener("click", () => openHead(l, h));
      ovBox.appendChild(b); row.push({ button: b, canvas: c });
    }
    thumbs.push(row);
  }
  const PAT_LEGEND = PAT ?
    "prev: the previous token · next: the next token · diag: itself · sink: the first or " +
    "special tokens · broad: spread over most tokens · content: keys picked by what they are, " +
    "not where. Labels come from the full weights, with nothing set aside." :
    "Pattern labels describe self-attention; a translator's cross-attention has none.";
  let ovDrawn = "";
  function drawOverview() {
    const key = state.aside + ":" + state.scale;
    if (key !== ovDrawn) {  // repaint only when the colours change, not on hover
      ovDrawn = key;
      const name = OV.thumbs[state.aside] ? state.aside : "none";
      const set = OV.thumbs[name], sqrt = state.scale === "sqrt";
      const top = OV.top ? OV.top[name] : null;
      document.getElementById("overview-legend").textContent = (top === null ? "" :
        "Colours: one scale for every thumbnail on the page, so heads and layers compare by " +
        "colour: dark = 0, yellow = " + top.toFixed(3) + " (the largest weight of any " +
        "thumbnail, blocks of cells averaged" + (sqrt ? "; √weight" : "") + "). ") + PAT_LEGEND;
      const n = OV.rows * OV.cols;
      for (let l = 0; l < NL; l++) {
        const q = bytes(set[l]);
        for (let h = 0; h < H; h++) {
          const cx = thumbs[l][h].canvas.getContext("2d");
          const img = cx.createImageData(OV.cols, OV.rows);
          for (let x = 0; x < n; x++) {
            const t = q[h * n + x] / 255;
            const c = LUT[Math.min(255, Math.round((sqrt ? Math.sqrt(t) : t) * 255))];
            img.data[4 * x] = c[0]; img.data[4 * x + 1] = c[1]; img.data[4 * x + 2] = c[2];
            img.data[4 * x + 3] = 255;
          }
          cx.putImageData(img, 0, 0);
        }
      }
    }
    thumbs.forEach((row, l) => row.forEach((t, h) =>
      t.button.classList.toggle("selected", l === state.layer && h === state.head)));
    layerButtons.forEach((b, l) =>
      b.classList.toggle("selected", l === state.layer && state.head < 0));
    const p = PAT && state.head >= 0 ? PAT[state.layer][state.head] : null;
    document.getElementById("overview-selected").textContent = "Open: " +
      DATA.layer_names[state.layer] + " · " + headName() +
      (p ? " — " + p.label + " (" + p.score.toFixed(2) + ")" : "");
  }

  function update() {
    const t0 = performance.now();
    drawOverview(); drawHeadView(); drawHeatmap(); drawMovement();
    const f = focus(), info = [];
    if (f) info.push("focus: “" + (f.side === "q" ? QT : KT)[f.i] + "” (" + (f.side === "q" ?
      "what it attends to" : "what attends to it") + (state.pinned ? ", pinned" : "") + ")");
    if (state.aside !== "none") {
      info.push("rows renormalised without " + (state.aside === "special" ? "special tokens" :
        "the first token “" + KT[0] + "”"));
    }
    document.getElementById("focus-info").textContent = info.join(" · ");
    document.body.dataset.renderMs = (performance.now() - t0).toFixed(1);
  }

  const enc = DATA.encoding;
  document.getElementById("info").textContent = DATA.model + " · " + L + (DATA.kind === "cross" ?
    " target × " + S + " source tokens" : " tokens") + " · " + NL + " layers × " + H + " heads" +
    (DATA.text ? " · “" + DATA.text.slice(0, 120) + (DATA.text.length > 120 ? "…" : "") + "”" : "");
  document.getElementById("notes").textContent = "Weights are stored with 8 bits per weight, " +
    "relative to the largest weight of their row (error ≤ 0.2% of that largest weight; " +
    "weights below 1/510 of it show as 0)" +
    (enc.exact.length ? "; the weights on the tokens that can be set aside (" +
      enc.exact.map((j) => "“" + short(KT[j]) + "”").join(", ") + ") exactly, and the 8 bits " +
      "relative to the rest of the row" : "") +
    (enc.kind === "topk" ? "; each row keeps only its " + enc.k + " strongest other weights (" +
      Math.round(100 * enc.kept) + "% of the other weights' attention on average), the rest " +
      "show as 0 (set aside, a row is still divided by its true remaining sum)" : "") +
    ". Lines show weights ≥ the threshold (at most " + MAX_LINES + ", the strongest). " +
    "Keys: ↑/↓ layer, ←/→ head. Made by attnlab; works offline.";
  if (!DATA.movement) document.getElementById("movement-panel").style.display = "none";

  window.attnlabExplorer = {  // for tests and the curious: state, data and the heatmap layout
    state: state, update: update, matrix: matrix, shown: current, data: DATA, openHead: openHead,
    heatmap: { left: M.left, top: M.top, cell: cell },
  };
  update();
  document.body.dataset.ready = "1";
})();
"""
