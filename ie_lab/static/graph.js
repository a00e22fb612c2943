// ie_lab notebook panels, built by widgets/build.py from widgets/ (sources ec41fa865fb07ef2); edit those, not this file

// widgets/util.js
function asFloat32(buf) {
  if (!buf) return new Float32Array(0);
  const bytes = buf instanceof ArrayBuffer ? new Uint8Array(buf) : new Uint8Array(buf.buffer, buf.byteOffset || 0, buf.byteLength);
  if (bytes.byteOffset % 4 === 0 && bytes.byteLength % 4 === 0) {
    return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  }
  return new Float32Array(bytes.slice().buffer, 0, Math.floor(bytes.byteLength / 4));
}
function plural(n, one, many = one + "s") {
  return `${n} ${Number(n) === 1 ? one : many}`;
}
function showToken(t) {
  if (t === "") return "∅";
  return t.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/^ /, "·").replace(/^Ġ/, "·").replace(/^▁/, "·");
}

// widgets/dashboard_view.js
function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") e.textContent = v;
    else if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== void 0 && c !== false) e.append(c);
  return e;
}
var SVG = "http://www.w3.org/2000/svg";
function s(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}
var fmt = (v) => Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(2) : v.toFixed(3);
var pct = (x) => (x >= 0.01 ? (100 * x).toFixed(1) : x > 0 ? (100 * x).toPrecision(2) : "0") + "%";
function contexts(d, readout) {
  const box = h("div", { class: "iel-dash-ctxs", "aria-label": `top activations of feature ${d.feature}` });
  if (!d.contexts.length) box.append(h("div", { class: "iel-muted", text: `feature ${d.feature} never fires on this corpus` }));
  d.contexts.forEach((c, k) => {
    const line = h("div", { class: "iel-text iel-feat-tokens iel-dash-ctx", "data-k": String(k) });
    c.tokens.forEach((t, i) => {
      const v = c.values[i] || 0, a = d.max > 0 ? Math.min(1, v / d.max) : 0;
      const sp = h("span", {
        class: "iel-tok" + (a > 0 ? " iel-on" : "") + (i === c.at ? " iel-peak" : ""),
        tabindex: "0",
        "data-i": String(i),
        "data-v": String(v),
        text: showToken(t),
        title: `${JSON.stringify(t)} · feature ${d.feature} = ${fmt(v)}`
      });
      sp.style.setProperty("--iel-a", `${Math.round(a * 70)}%`);
      line.append(sp);
    });
    const onTok = (e) => {
      const sp = e.target.closest(".iel-tok");
      if (!sp) return;
      const i = Number(sp.dataset.i);
      readout.textContent = `context ${k + 1} (prompt ${c.prompt}, token ${c.position - c.at + i}) ${JSON.stringify(c.tokens[i])}: feature ${d.feature} = ${fmt(c.values[i] || 0)}`;
    };
    line.addEventListener("mouseover", onTok);
    line.addEventListener("focusin", onTok);
    box.append(h("div", { class: "iel-dash-ctxrow" }, h("span", { class: "iel-dash-peak", text: fmt(c.value) }), line));
  });
  return box;
}
function histogram(d) {
  const counts = d.hist.counts, edges = d.hist.edges;
  const W = 300, H = 90, n = Math.max(1, counts.length), top = Math.max(1, ...counts);
  const svg = s("svg", {
    class: "iel-dash-hist",
    viewBox: `0 0 ${W} ${H + 16}`,
    width: W,
    height: H + 16,
    role: "img",
    "aria-label": `histogram of feature ${d.feature}'s non-zero activations`
  });
  counts.forEach((c, i) => {
    const bh = c / top * H, r = s("rect", { x: i * W / n + 0.5, y: H - bh, width: Math.max(1, W / n - 1), height: bh, class: "iel-dash-bar" });
    const t = s("title");
    t.textContent = `${fmt(edges[i])} to ${fmt(edges[i + 1])}: ${plural(c, "token")}`;
    r.append(t);
    svg.append(r);
  });
  svg.append(s("line", { x1: 0, y1: H + 0.5, x2: W, y2: H + 0.5, class: "iel-dash-axis" }));
  const lab = (x, anchor, text) => {
    const t = s("text", { x, y: H + 13, "text-anchor": anchor, class: "iel-dash-lab" });
    t.textContent = text;
    return t;
  };
  svg.append(lab(0, "start", fmt(edges[0] || 0)), lab(W, "end", fmt(edges[edges.length - 1] || 0)));
  return svg;
}
function logitTable(title, rows, cls) {
  const t = h("table", { class: "iel-dash-logits " + cls });
  t.append(h("caption", { text: title }));
  for (const [tok, v] of rows) t.append(h("tr", {}, h("td", { class: "iel-dash-logtok", text: showToken(tok) }), h("td", { class: "iel-dash-logval", text: fmt(v) })));
  return t;
}
function drawFeature(body, d) {
  const readout = h("div", { class: "iel-readout iel-dash-readout", "aria-live": "polite", text: "hover a token for its value" });
  const head = h(
    "div",
    { class: "iel-title" },
    h("b", { text: `feature ${d.feature}` }),
    ` · ${d.address} · density ${pct(d.density)} (fires on ${d.n_fired} of ${plural(d.n_tokens, "token")}) · max ${fmt(d.max)}`
  );
  const left = h("div", { class: "iel-dash-col" }, h("div", { class: "iel-colhead", text: "top activations" }), contexts(d, readout), readout);
  const logits = h("div", { class: "iel-dash-logrow" });
  if (d.promoted.length) logits.append(logitTable("promoted", d.promoted, "iel-dash-pos"), logitTable("suppressed", d.suppressed, "iel-dash-neg"));
  const right = h(
    "div",
    { class: "iel-dash-col" },
    h("div", { class: "iel-colhead", text: "activation histogram (non-zero)" }),
    histogram(d),
    h("div", { class: "iel-colhead", text: "decoder direction through the unembedding" }),
    logits,
    h("div", { class: "iel-muted iel-dash-note", text: d.logit_note })
  );
  if (d.steering) {
    const st = d.steering;
    right.append(
      h("div", { class: "iel-colhead", text: `steering: + ${fmt(st.scale)} × decoder direction` }),
      h(
        "div",
        { class: "iel-dash-steer" },
        h("div", { class: "iel-muted", text: "prompt" }),
        h("div", { class: "iel-text", "data-which": "prompt", text: st.prompt }),
        h("div", { class: "iel-muted", text: "without" }),
        h("div", { class: "iel-text", "data-which": "baseline", text: st.baseline }),
        h("div", { class: "iel-muted", text: "with" }),
        h("div", { class: "iel-text", "data-which": "steered", text: st.steered })
      )
    );
  }
  const notes = (d.notes || []).length ? h("div", { class: "iel-muted", text: d.notes.join("; ") }) : null;
  body.replaceChildren(head, h("div", { class: "iel-dash-grid" }, left, right), notes || "");
}

// widgets/dashboard.js
function asInt32(buf) {
  const f = asFloat32(buf);
  return new Int32Array(f.buffer, f.byteOffset, f.length);
}
function fromTraits(model) {
  const lens = asInt32(model.get("ctx_len")), meta = asInt32(model.get("ctx_meta")), vals = asFloat32(model.get("ctx_values"));
  const toks = model.get("ctx_tokens");
  const contexts2 = [];
  let o = 0;
  lens.forEach((n, k) => {
    const values = Array.from(vals.subarray(o, o + n));
    contexts2.push({
      prompt: meta[3 * k],
      position: meta[3 * k + 1],
      at: meta[3 * k + 2],
      tokens: toks.slice(o, o + n),
      values,
      value: values[meta[3 * k + 2]]
    });
    o += n;
  });
  const lt = model.get("logit_tokens"), lv = asFloat32(model.get("logit_values")), np = model.get("n_promoted");
  const pairs = lt.map((t, i) => [t, lv[i]]);
  const prompt = model.get("steer_prompt");
  return {
    feature: model.get("feature"),
    address: model.get("address"),
    n_tokens: model.get("n_tokens"),
    n_fired: model.get("n_fired"),
    density: model.get("density"),
    max: model.get("max_act"),
    contexts: contexts2,
    hist: { counts: Array.from(asInt32(model.get("hist_counts"))), edges: Array.from(asFloat32(model.get("hist_edges"))) },
    promoted: pairs.slice(0, np),
    suppressed: pairs.slice(np),
    logit_note: model.get("logit_note"),
    steering: prompt ? { prompt, scale: model.get("steer_scale"), baseline: model.get("baseline"), steered: model.get("steered") } : null,
    notes: model.get("notes") ? [model.get("notes")] : []
  };
}

// widgets/graph.js
var KINDS = ["embedding", "feature", "error", "logit"];
var SVG2 = "http://www.w3.org/2000/svg";
var TOP_EDGES = 6;
function s2(tag, attrs = {}) {
  const e = document.createElementNS(SVG2, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}
function asInt322(buf) {
  const f = asFloat32(buf);
  return new Int32Array(f.buffer, f.byteOffset, f.length);
}
var fmtW = (w) => w === 0 ? "0" : Number(w.toPrecision(4)).toString();
function graphFromTraits(model) {
  const ids = model.get("node_ids"), labels = model.get("node_labels");
  const kind = asInt322(model.get("node_kind")), row = asInt322(model.get("node_row")), col = asInt322(model.get("node_col"));
  const value = asFloat32(model.get("node_value")), infl = asFloat32(model.get("node_influence"));
  const nodes = ids.map((id, i) => ({ i, id, label: labels[i], kind: KINDS[kind[i]], row: row[i], col: col[i], value: value[i], influence: infl[i] }));
  const src = asInt322(model.get("edge_src")), dst = asInt322(model.get("edge_dst")), w = asFloat32(model.get("edge_weight"));
  const edges = Array.from(src, (a, k) => ({ src: a, dst: dst[k], w: w[k] }));
  return { nodes, edges, tokens: model.get("tokens"), n_layers: model.get("n_layers"), supernodes: model.get("supernodes") };
}
function visible(g) {
  var _a;
  const groupOf = /* @__PURE__ */ new Map();
  for (const [name, ids] of Object.entries(g.supernodes || {})) for (const id of ids) groupOf.set(id, name);
  const key = (n) => groupOf.has(n.id) ? "g:" + groupOf.get(n.id) : "n:" + n.i;
  const sums = /* @__PURE__ */ new Map();
  for (const e of g.edges) {
    const a = key(g.nodes[e.src]), b = key(g.nodes[e.dst]);
    if (a === b) continue;
    const k = a + "|" + b;
    sums.set(k, (sums.get(k) || 0) + e.w);
  }
  const edges = Array.from(sums, ([k, w]) => {
    const [a, b] = k.split("|");
    return { a, b, w };
  });
  const groups = {};
  for (const n of g.nodes) if (groupOf.has(n.id)) (groups[_a = groupOf.get(n.id)] || (groups[_a] = [])).push(n);
  return { key, edges, groups };
}
function layout(g, width) {
  const nCols = Math.max(1, g.tokens.length), nRows = g.n_layers + 2;
  const left = 56, bottom = 46, top = 14;
  const colW = Math.max(46, (width - left - 8) / nCols);
  const cells = /* @__PURE__ */ new Map();
  for (const n of g.nodes) {
    const k = n.row + ":" + n.col;
    if (!cells.has(k)) cells.set(k, []);
    cells.get(k).push(n);
  }
  const fullest = Math.max(1, ...Array.from(cells.values(), (l) => l.length));
  const rowH = Math.max(64, 16 + 11 * Math.ceil(fullest / Math.max(1, Math.floor((colW - 6) / 12))));
  const pos = new Array(g.nodes.length);
  for (const list of cells.values()) {
    list.sort((a, b) => b.influence - a.influence || a.i - b.i);
    const perLine = Math.max(1, Math.floor((colW - 6) / 12)), lines = Math.ceil(list.length / perLine);
    const dy = Math.min(11, (rowH - 12) / Math.max(1, lines - 1));
    list.forEach((n, j) => {
      const inLine = Math.min(perLine, list.length - Math.floor(j / perLine) * perLine);
      const x = left + (n.col + 0.5) * colW + (j % perLine - (inLine - 1) / 2) * 12;
      const y = top + (nRows - 1 - n.row) * rowH + rowH / 2 + (Math.floor(j / perLine) - (lines - 1) / 2) * dy;
      pos[n.i] = [x, y];
    });
  }
  return { pos, W: left + nCols * colW + 8, H: top + nRows * rowH + bottom, left, top, rowH, colW, nRows };
}
function shape(kind, x, y, r) {
  if (kind === "embedding") return s2("rect", { x: x - r, y: y - r, width: 2 * r, height: 2 * r, rx: 1.5 });
  if (kind === "error") return s2("polygon", { points: `${x},${y - r - 1} ${x + r + 1},${y} ${x},${y + r + 1} ${x - r - 1},${y}` });
  if (kind === "logit") return s2("polygon", { points: `${x},${y - r - 2} ${x + r + 1},${y + r} ${x - r - 1},${y + r}` });
  return s2("circle", { cx: x, cy: y, r });
}
function render({ model, el }) {
  const root = h("div", { class: "iel-root iel-graph" });
  const nt = h("input", { type: "number", min: "0.001", max: "1", step: "0.01", class: "iel-num", "aria-label": "node threshold" });
  const et = h("input", { type: "number", min: "0.001", max: "1", step: "0.005", class: "iel-num", "aria-label": "edge threshold" });
  const prune = h("button", { class: "iel-btn", type: "button", text: "prune" });
  const name = h("input", { type: "text", class: "iel-g-name", placeholder: "supernode name", "aria-label": "supernode name" });
  const group = h("button", { class: "iel-btn", type: "button", text: "group" });
  const groupsBox = h("div", { class: "iel-g-groups" });
  const head = h("div", { class: "iel-title" });
  const diagram = h("div", { class: "iel-g-diagram" });
  const readout = h("div", { class: "iel-readout iel-g-readout", "aria-live": "polite", text: "hover a node for its edges; click a feature for its dashboard; shift-click features to group them" });
  const note = h("div", { class: "iel-muted iel-g-note" });
  const legend = h("div", { class: "iel-muted iel-g-legend", text: "■ embedding · ● feature · ◆ error (the MLP's output minus the transcoder's) · ▲ logit · edges: width |weight|, positive in the accent colour, negative in the error colour" });
  const dashNote = h("div", { class: "iel-muted iel-g-dashnote" });
  const dash = h("div", { class: "iel-g-dash iel-dash" });
  const error = h("div", { class: "iel-error", role: "alert" });
  root.append(
    head,
    h(
      "div",
      { class: "iel-row" },
      h("label", {}, "node threshold ", nt),
      h("label", {}, "edge threshold ", et),
      prune,
      h("span", { class: "iel-muted", text: "·" }),
      name,
      group,
      groupsBox
    ),
    diagram,
    legend,
    readout,
    note,
    error,
    dashNote,
    dash
  );
  el.append(root);
  const picked = /* @__PURE__ */ new Set();
  let g = null, vis = null;
  function describe(key) {
    if (key.startsWith("g:")) {
      const nm = key.slice(2);
      return `supernode ${JSON.stringify(nm)} (${plural(vis.groups[nm].length, "feature")})`;
    }
    return g.nodes[Number(key.slice(2))].label;
  }
  function edgeTable(cls, title, list, other) {
    const t = h("table", { class: "iel-g-edges " + cls });
    t.append(h("caption", { text: title }));
    for (const e of list) t.append(h("tr", { "data-w": String(e.w), "data-k": e[other] }, h("td", { class: "iel-g-w", text: fmtW(e.w) }), h("td", { text: describe(e[other]) })));
    return t;
  }
  function hover(key) {
    const byAbs = (x, y) => Math.abs(y.w) - Math.abs(x.w);
    const into = vis.edges.filter((e) => e.b === key).sort(byAbs), out = vis.edges.filter((e) => e.a === key).sort(byAbs);
    readout.replaceChildren(
      h("div", { class: "iel-g-label", text: describe(key) }),
      h(
        "div",
        { class: "iel-g-edgecols" },
        edgeTable("iel-g-in", `incoming (top ${Math.min(TOP_EDGES, into.length)} of ${into.length})`, into.slice(0, TOP_EDGES), "a"),
        edgeTable("iel-g-out", `outgoing (top ${Math.min(TOP_EDGES, out.length)} of ${out.length})`, out.slice(0, TOP_EDGES), "b")
      )
    );
  }
  function draw() {
    g = graphFromTraits(model);
    vis = visible(g);
    for (const id of Array.from(picked)) if (!g.nodes.some((n) => n.id === id && n.kind === "feature")) picked.delete(id);
    const L = layout(g, Math.max(480, diagram.clientWidth || root.clientWidth || 900));
    const svg = s2("svg", {
      class: "iel-g-svg",
      viewBox: `0 0 ${L.W} ${L.H}`,
      width: L.W,
      height: L.H,
      role: "img",
      "aria-label": `attribution graph: ${plural(g.nodes.length, "node")}, ${plural(g.edges.length, "edge")}`
    });
    for (let r = 0; r < L.nRows; r++) {
      const y = L.top + (L.nRows - 1 - r) * L.rowH + L.rowH / 2;
      svg.append(s2("line", { x1: L.left, x2: L.W - 8, y1: y, y2: y, class: "iel-g-grid" }));
      const t = s2("text", { x: 4, y: y + 4, class: "iel-g-axis" });
      t.textContent = r === 0 ? "emb" : r === L.nRows - 1 ? "logits" : `L${r - 1}`;
      svg.append(t);
    }
    g.tokens.forEach((tok, c) => {
      const t = s2("text", { x: L.left + (c + 0.5) * L.colW, y: L.H - 28, "text-anchor": "middle", class: "iel-g-tok" });
      const shown = showToken(tok);
      t.textContent = shown.length > 8 ? shown.slice(0, 7) + "…" : shown;
      const tt = s2("title");
      tt.textContent = `position ${c}: ${JSON.stringify(tok)}`;
      t.append(tt);
      svg.append(t);
    });
    const at = /* @__PURE__ */ new Map();
    g.nodes.forEach((n) => {
      const k = vis.key(n);
      if (k.startsWith("n:")) at.set(k, L.pos[n.i]);
    });
    for (const [nm, members] of Object.entries(vis.groups)) {
      const xs = members.map((n) => L.pos[n.i][0]), ys = members.map((n) => L.pos[n.i][1]);
      at.set("g:" + nm, [xs.reduce((a, b) => a + b, 0) / xs.length, ys.reduce((a, b) => a + b, 0) / ys.length]);
    }
    const edgesG = s2("g", { class: "iel-g-edgelayer" });
    const maxW = Math.max(1e-12, ...vis.edges.map((e) => Math.abs(e.w)));
    for (const e of vis.edges.slice().sort((x, y) => Math.abs(x.w) - Math.abs(y.w))) {
      const [x1, y1] = at.get(e.a), [x2, y2] = at.get(e.b);
      edgesG.append(s2("line", {
        x1,
        y1,
        x2,
        y2,
        class: "iel-g-edge " + (e.w >= 0 ? "iel-g-pos" : "iel-g-neg"),
        "stroke-width": (0.4 + 3.6 * Math.abs(e.w) / maxW).toFixed(2),
        "data-a": e.a,
        "data-b": e.b
      }));
    }
    svg.append(edgesG);
    const nodesG = s2("g", { class: "iel-g-nodelayer" });
    for (const n of g.nodes) {
      if (!vis.key(n).startsWith("n:")) continue;
      const [x, y] = L.pos[n.i];
      const e = shape(n.kind, x, y, 5);
      e.setAttribute("class", `iel-g-node iel-g-${n.kind}` + (picked.has(n.id) ? " iel-g-picked" : "") + (n.id === model.get("selected") ? " iel-g-current" : ""));
      e.setAttribute("data-key", "n:" + n.i);
      e.setAttribute("data-id", n.id);
      e.setAttribute("data-kind", n.kind);
      e.setAttribute("tabindex", "0");
      nodesG.append(e);
    }
    for (const nm of Object.keys(vis.groups)) {
      const [x, y] = at.get("g:" + nm);
      const box = s2("g", { class: "iel-g-super", "data-key": "g:" + nm, "data-name": nm, tabindex: "0" });
      const label = s2("text", { x, y: y + 4, "text-anchor": "middle", class: "iel-g-superlab" });
      label.textContent = nm.length > 14 ? nm.slice(0, 13) + "…" : nm;
      const wBox = Math.max(40, 7 * Math.min(14, nm.length) + 12);
      box.append(s2("rect", { x: x - wBox / 2, y: y - 10, width: wBox, height: 20, rx: 4 }), label);
      nodesG.append(box);
    }
    svg.append(nodesG);
    diagram.replaceChildren(svg);
    const counts = KINDS.map((k) => `${g.nodes.filter((n) => n.kind === k).length} ${k}`).join(", ");
    head.replaceChildren(h("b", { text: "attribution graph" }), ` · ${counts} nodes · ${plural(g.edges.length, "edge")} · "${g.tokens.join("")}"`);
    note.textContent = model.get("graph_note");
    if (document.activeElement !== nt) nt.value = String(model.get("node_threshold"));
    if (document.activeElement !== et) et.value = String(model.get("edge_threshold"));
    groupsBox.replaceChildren(...Object.entries(g.supernodes).map(([nm, ids]) => h(
      "span",
      { class: "iel-g-groupitem", "data-name": nm },
      `${nm} (${ids.length}) `,
      h("button", { class: "iel-btn iel-g-ungroup", type: "button", "data-name": nm, text: "ungroup" })
    )));
    group.disabled = picked.size < 2;
    root.classList.remove("iel-busy");
  }
  function drawDash() {
    root.classList.remove("iel-busy");
    dashNote.textContent = model.get("dashboard_note");
    if (model.get("selected")) drawFeature(dash, fromTraits(model));
    else dash.replaceChildren();
    for (const e of diagram.querySelectorAll(".iel-g-current")) e.classList.remove("iel-g-current");
    const cur = diagram.querySelector(`[data-id="${CSS.escape(model.get("selected"))}"]`);
    if (cur) cur.classList.add("iel-g-current");
  }
  const onOver = (e) => {
    const t = e.target.closest("[data-key]");
    if (t && vis) hover(t.dataset.key);
  };
  diagram.addEventListener("mouseover", onOver);
  diagram.addEventListener("focusin", onOver);
  diagram.addEventListener("click", (e) => {
    const t = e.target.closest(".iel-g-node");
    if (!t || t.dataset.kind !== "feature") return;
    if (e.shiftKey || e.ctrlKey || e.metaKey) {
      const id = t.dataset.id;
      if (picked.has(id)) picked.delete(id);
      else picked.add(id);
      t.classList.toggle("iel-g-picked", picked.has(id));
      group.disabled = picked.size < 2;
      return;
    }
    root.classList.add("iel-busy");
    model.send({ cmd: "select", node: t.dataset.id });
  });
  group.addEventListener("click", () => {
    const nm = name.value.trim();
    if (!nm) {
      error.textContent = "name the supernode first";
      return;
    }
    model.send({ cmd: "group", name: nm, nodes: Array.from(picked) });
  });
  groupsBox.addEventListener("click", (e) => {
    const b = e.target.closest(".iel-g-ungroup");
    if (b) model.send({ cmd: "ungroup", name: b.dataset.name });
  });
  prune.addEventListener("click", () => {
    const a = Number(nt.value), b = Number(et.value);
    if (!(a > 0 && a <= 1 && b > 0 && b <= 1)) {
      error.textContent = "thresholds are fractions in (0, 1]";
      return;
    }
    root.classList.add("iel-busy");
    model.send({ cmd: "prune", node_threshold: a, edge_threshold: b });
  });
  for (const inp of [nt, et]) inp.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      e.preventDefault();
      prune.click();
    }
  });
  const onGroups = () => {
    picked.clear();
    name.value = "";
    draw();
  };
  const onError = () => {
    error.textContent = model.get("error");
  };
  const onMsg = (msg) => {
    if (msg && msg.type === "error") {
      error.textContent = msg.message;
      root.classList.remove("iel-busy");
    }
  };
  model.on("change:node_ids", draw);
  model.on("change:edge_weight", draw);
  model.on("change:supernodes", onGroups);
  model.on("change:selected", drawDash);
  model.on("change:ctx_values", drawDash);
  model.on("change:error", onError);
  model.on("msg:custom", onMsg);
  draw();
  drawDash();
  onError();
  return () => {
    model.off("change:node_ids", draw);
    model.off("change:edge_weight", draw);
    model.off("change:supernodes", onGroups);
    model.off("change:selected", drawDash);
    model.off("change:ctx_values", drawDash);
    model.off("change:error", onError);
    model.off("msg:custom", onMsg);
  };
}
var graph_default = { render };
export {
  graph_default as default,
  fmtW,
  graphFromTraits,
  visible
};
