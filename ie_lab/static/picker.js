// ie_lab notebook panels, built by widgets/build.py from widgets/ (sources ec41fa865fb07ef2); edit those, not this file

// widgets/util.js
function plural(n, one, many = one + "s") {
  return `${n} ${Number(n) === 1 ? one : many}`;
}
function fillLayer(template, layer) {
  return template ? template.split("{L}").join(String(layer)) : "";
}
function addressOf(point, layer) {
  return point.scope === "trunk" ? point.name : `${point.name}.${layer}`;
}
function servedAt(point, layer) {
  const idx = point.scope === "trunk" ? 0 : layer;
  const ok = point.served.charAt(idx) === "1";
  return { ok, why: ok ? "" : point.why[String(idx)] || "not served here" };
}
function snippet(point, layer, handle = { var: "s", kind: "session" }, family = "") {
  const h2 = typeof handle === "string" ? { var: handle, kind: "session" } : handle;
  const a = addressOf(point, layer);
  const text = `"When Mary and John went to the store,"`;
  const lines = [];
  if (h2.kind === "family") lines.push(`${h2.var} = ie_lab.Session("path/or/hub-id")  # any ${family || "such"} model`);
  lines.push(h2.kind === "model" ? `cache = ie_lab.capture(${h2.var}, ${text}, ["${a}"])` : `cache = ${h2.var}.capture(${text}, ["${a}"])`);
  lines.push(`cache["${a}"].shape  # ${point.shape}`);
  return lines.join("\n");
}
function layoutBlock(st, moe = false, names = null, layer = 0) {
  const has = (n) => names === null || names.has(n);
  const ROW = 24;
  const items = [];
  let y = 20;
  const push = (it) => {
    items.push(it);
    return it;
  };
  const multi = (st.n_streams || 1) > 1;
  const mixerAt = (st.mixer_layers || []).indexOf(layer);
  const mixerKind = mixerAt >= 0 ? st.mixer_kinds[mixerAt] : "";
  const noMlp = (st.no_mlp_layers || []).includes(layer);
  const mlpOnly = (st.mlp_only_layers || []).includes(layer);
  const sharedNorm = st.parallel_block && st.pre_norms && st.parallel_norms !== "separate";
  const branchNorms = st.pre_norms && !sharedNorm;
  push({ kind: "trunk", label: st.embed_label || "token embedding", col: 0, y });
  y += ROW;
  const spine = (name) => {
    if (has(name)) {
      push({ kind: "point", name, col: 0, y });
      y += ROW;
    }
  };
  spine("embeddings");
  y += 6;
  const blockTop = y - 8;
  if (multi) spine("resid_streams");
  spine("resid_pre");
  const column = (col, y0) => {
    let yy = y0;
    return {
      p: (name) => {
        if (has(name)) {
          push({ kind: "point", name, col, y: yy });
          yy += ROW;
        }
      },
      m: (label, role) => {
        push({ kind: "module", label, role, col, y: yy });
        yy += ROW;
      },
      end: () => yy
    };
  };
  const attn = (col, y0) => {
    const { p, m, end } = column(col, y0);
    if (multi) p("attn_stream_collapse");
    if (branchNorms) m(st.parallel_block ? "input norm (attention branch)" : "input norm", "norm");
    p("attn_in");
    if (st.q_latent || st.kv_latent) {
      if (st.q_latent) {
        m("q_a_proj (down) · norm", "linear");
        p("q_latent");
      }
      if (st.kv_latent) {
        m("kv_a_proj (down) · norm", "linear");
        p("kv_latent");
      }
      m(st.kv_latent ? "q_b_proj · kv_b_proj (up, per head)" : "q_b_proj (up, per head)", "linear");
      if (st.kv_latent) p("k_nope");
    } else if (st.qk_norm) {
      m("q_proj · k_proj", "linear");
      p("q_norm_in");
      p("k_norm_in");
      m("q_norm · k_norm", "norm");
      p("q_norm_out");
      p("k_norm_out");
    } else {
      m("q_proj · k_proj · v_proj", "linear");
    }
    p("value");
    m(st.attn_labels && st.attn_labels[layer] || "attention (q·kᵀ, softmax)", "attn");
    p("attn_scores");
    p("attn_probs");
    p("z");
    if (st.attn_gate) p("attn_gate");
    m("o_proj", "linear");
    p("attn_out");
    if (st.sandwich_norms) m("post-attention norm", "norm");
    p("attn_out_post");
    if (multi) {
      p("attn_stream_write");
      p("attn_stream_mix");
    }
    return end();
  };
  const mixer = (col, y0) => {
    const { p, m, end } = column(col, y0);
    if (branchNorms) m("input norm", "norm");
    p("mixer_in");
    m(`${mixerKind} mixer`, "mixer");
    if ((st.state_layers || []).includes(layer)) p("mixer_state");
    if ((st.conv_state_layers || []).includes(layer)) p("mixer_conv_state");
    p("mixer_out");
    if (st.sandwich_norms) m("post-mixer norm", "norm");
    p("mixer_out_post");
    return end();
  };
  const mlp = (col, y0) => {
    const { p, m, end } = column(col, y0);
    if (multi) p("mlp_stream_collapse");
    if (branchNorms) m(st.parallel_block ? "input norm (MLP branch)" : "pre-MLP norm", "norm");
    p("mlp_in");
    if (moe) {
      m("router", "router");
      p("router_logits");
      p("expert_weights");
      p("expert_indices");
      m("experts (top-k, weighted sum)", "experts");
    } else if (st.gated_mlp) {
      m("gate_proj · up_proj", "linear");
      p("mlp_pre");
      p("mlp_pre_linear");
      m("act(gate) × up", "act");
      p("mlp_act");
      m("down_proj", "linear");
    } else {
      m("up_proj", "linear");
      p("mlp_pre");
      m("activation", "act");
      p("mlp_act");
      m("down_proj", "linear");
    }
    p("mlp_out");
    if (st.sandwich_norms) m("post-MLP norm", "norm");
    p("mlp_out_post");
    if (multi) {
      p("mlp_stream_write");
      p("mlp_stream_mix");
    }
    return end();
  };
  if (st.parallel_block) {
    push({ kind: "fork", col: 1, y: y - 10, to: noMlp ? [1] : [1, 2] });
    if (sharedNorm) {
      push({ kind: "module", label: "input norm (shared)", role: "norm", col: 1, span: 2, y });
      y += ROW;
    }
    const end = Math.max((mixerKind ? mixer : attn)(1, y), noMlp ? y : mlp(2, y));
    y = end;
    push({ kind: "join", col: 0, y, from: noMlp ? [1] : [1, 2] });
    y += ROW;
  } else if (mlpOnly) {
    push({ kind: "fork", col: 1, y: y - 10, to: [1] });
    y = mlp(1, y);
    push({ kind: "join", col: 0, y, from: [1] });
    y += ROW;
  } else {
    push({ kind: "fork", col: 1, y: y - 10, to: [1] });
    y = (mixerKind ? mixer : attn)(1, y);
    push({ kind: "join", col: 0, y, from: [1] });
    y += ROW;
    if (!noMlp) {
      spine("resid_mid");
      push({ kind: "fork", col: 1, y: y - 10, to: [1] });
      y = mlp(1, y);
      push({ kind: "join", col: 0, y, from: [1] });
      y += ROW;
    }
  }
  spine("resid_post");
  const blockBottom = y - 8;
  y += 6;
  push({ kind: "module", label: "final norm", role: "norm", col: 0, y, trunk: true });
  y += ROW;
  spine("final_norm");
  push({ kind: "module", label: "lm_head (unembedding)", role: "linear", col: 0, y, trunk: true });
  y += ROW;
  spine("lm_head");
  return { items, height: y, blockTop, blockBottom };
}
function layerKindLabel(spec, i) {
  const mixers = spec.layer_mixers || [];
  if (mixers.every((k) => k === "attention")) return "";
  if (mixers[i] === "mlp" || mixers[i] === "moe") return `${mixers[i] === "moe" ? "MoE" : "MLP"}-only block`;
  if (mixers[i] !== "attention") return `${mixers[i]} (mixer)`;
  return spec.layer_kinds[i] === "sliding" ? "sliding attention" : "attention";
}
function pointOrder(layout) {
  return layout.items.filter((it) => it.kind === "point").sort((p, q) => p.y - q.y || p.col - q.col).map((it) => it.name);
}

// widgets/picker.js
var SVG = "http://www.w3.org/2000/svg";
var COLX = [36, 196, 400];
function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") e.textContent = v;
    else if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c) e.append(c);
  return e;
}
function s(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
function render({ model, el }) {
  const t0 = performance.now();
  const spec = model.get("spec");
  const byName = new Map(spec.points.map((p) => [p.name, p]));
  let layer = model.get("layer");
  let focusName = null;
  const root = h("div", { class: "iel-root iel-picker" });
  const head = h("div", { class: "iel-head" });
  const title = h("div", { class: "iel-title" });
  title.append(h("b", { text: spec.family }), ` · ${plural(spec.n_layers, "layer")} · d_model ${spec.d_model} · ${plural(spec.n_heads, "head")} × ${spec.head_dim} (${spec.n_kv_heads} kv) · d_mlp ${spec.d_mlp}` + (spec.n_experts ? ` · ${plural(spec.n_experts, "expert")}` : "") + ` · backend ${spec.backend}`);
  const layerBox = h("label", { class: "iel-layer" }, "layer ");
  const prev = h("button", { class: "iel-btn", type: "button", "aria-label": "previous layer", text: "◀" });
  const sel = h("select", { "aria-label": "layer" });
  const hybrid = layerKindLabel(spec, 0) !== "";
  for (let i = 0; i < spec.n_layers; i++) {
    const kind = hybrid ? ` · ${layerKindLabel(spec, i)}` : spec.layer_kinds[i] && spec.layer_kinds[i] !== "global" ? ` (${spec.layer_kinds[i]})` : "";
    const moe = spec.structure.moe_layers.includes(i) ? " MoE" : "";
    sel.append(h("option", { value: String(i), text: `${i}${kind}${moe}` }));
  }
  const next = h("button", { class: "iel-btn", type: "button", "aria-label": "next layer", text: "▶" });
  layerBox.append(prev, sel, next);
  const selectedLine = h("div", { class: "iel-selected", "aria-live": "polite" });
  head.append(title, h("div", { class: "iel-row" }, layerBox, selectedLine));
  const strip = hybrid ? h("div", { class: "iel-kinds", role: "group", "aria-label": `layer kinds: ${spec.layer_kinds_text}` }) : null;
  if (strip) {
    for (let i = 0; i < spec.n_layers; i++) {
      const label = layerKindLabel(spec, i);
      const cell = h("button", {
        type: "button",
        class: "iel-kind " + (spec.layer_mixers[i] === "attention" ? "iel-k-attn" : "iel-k-mixer"),
        "data-layer": String(i),
        "data-kind": spec.layer_mixers[i],
        title: `layer ${i}: ${label}`,
        "aria-label": `layer ${i}: ${label}`,
        text: String(i)
      });
      strip.append(cell);
    }
    strip.addEventListener("click", (e) => {
      const c = e.target.closest(".iel-kind");
      if (c) setLayer(Number(c.dataset.layer));
    });
    head.append(strip, h("div", { class: "iel-kinds-text", text: spec.layer_kinds_text }));
  }
  const body = h("div", { class: "iel-body" });
  const svgWrap = h("div", { class: "iel-diagram" });
  const card = h("div", { class: "iel-card", "aria-live": "polite" });
  const error = h("div", { class: "iel-error", role: "alert" });
  body.append(svgWrap, card);
  root.append(head, body, error);
  el.append(root);
  let order = [];
  let svg = null;
  function drawDiagram() {
    const moe = spec.structure.moe_layers.includes(layer);
    const layout = layoutBlock(spec.structure, moe, new Set(byName.keys()), layer);
    order = pointOrder(layout);
    const width = spec.structure.parallel_block ? 630 : 420;
    svg = s("svg", {
      width,
      height: layout.height,
      viewBox: `0 0 ${width} ${layout.height}`,
      role: "group",
      "aria-label": `block diagram of layer ${layer}`
    });
    const bg = s("g", { class: "iel-wires" });
    const fg = s("g");
    svg.append(bg, fg);
    const items = layout.items;
    const top = items[0].y, bottom = items[items.length - 1].y;
    const frame = s("rect", {
      x: 8,
      y: layout.blockTop,
      width: width - 16,
      height: layout.blockBottom - layout.blockTop,
      rx: 8,
      class: "iel-block"
    });
    bg.append(frame);
    bg.append(s("line", { x1: COLX[0], y1: top, x2: COLX[0], y2: bottom, class: "iel-spine" }));
    if ((spec.structure.n_streams || 1) > 1) {
      for (const dx of [-4, 4]) bg.append(s("line", { x1: COLX[0] + dx, y1: layout.blockTop, x2: COLX[0] + dx, y2: layout.blockBottom, class: "iel-spine iel-stream" }));
    }
    const lbl = s("text", { x: width - 14, y: layout.blockTop + 14, "text-anchor": "end", class: "iel-blocklabel" });
    lbl.textContent = `layer ${layer} of ${spec.n_layers}` + (moe ? " · MoE" : "") + (hybrid ? ` · ${spec.layer_mixers[layer]}` : spec.layer_kinds[layer] && spec.layer_kinds[layer] !== "global" ? ` · ${spec.layer_kinds[layer]} attention` : "");
    if (strip) for (const c of strip.children) c.classList.toggle("iel-cur", Number(c.dataset.layer) === layer);
    bg.append(lbl);
    const forks = items.filter((i) => i.kind === "fork"), joins = items.filter((i) => i.kind === "join");
    forks.forEach((f, k) => {
      const j = joins[k];
      for (const col of f.to) {
        bg.append(s("path", { d: `M${COLX[0]},${f.y} H${COLX[col]} V${j.y} H${COLX[0]}`, class: "iel-branch" }));
      }
    });
    for (const it of items) {
      const x = COLX[it.col];
      if (it.kind === "module" || it.kind === "trunk") {
        const w = it.span === 2 ? COLX[2] - COLX[1] + 190 : it.col === 0 ? 170 : 196;
        const g = s("g", { class: `iel-mod iel-m-${it.role || "trunk"}` });
        g.append(s("rect", { x: x - 12, y: it.y - 9, width: w, height: 18, rx: 4 }));
        const tx = s("text", { x: x - 4, y: it.y + 4, "data-full": it.label, "data-room": String(w - 14) });
        tx.textContent = it.label;
        const tip = s("title");
        tip.textContent = it.label;
        g.append(tip, tx);
        fg.append(g);
      } else if (it.kind === "join") {
        const g = s("g", { class: "iel-join" });
        g.append(s("circle", { cx: x, cy: it.y, r: 7 }));
        g.append(s("path", { d: `M${x - 4},${it.y} H${x + 4} M${x},${it.y - 4} V${it.y + 4}` }));
        fg.append(g);
      } else if (it.kind === "point") {
        const p = byName.get(it.name);
        const { ok } = servedAt(p, layer);
        const g = s("g", {
          class: "iel-pt" + (ok ? "" : " iel-off"),
          tabindex: "-1",
          role: "button",
          "data-name": p.name,
          "aria-label": `${addressOf(p, layer)}${ok ? "" : " (not served)"}`
        });
        g.append(s("rect", { x: x - 9, y: it.y - 10, width: 168, height: 20, rx: 10, class: "iel-hit" }));
        g.append(s("circle", { cx: x, cy: it.y, r: 5.5 }));
        const tx = s("text", { x: x + 12, y: it.y + 4 });
        tx.textContent = p.scope === "trunk" ? p.name : `${p.name}.${layer}`;
        g.append(tx);
        fg.append(g);
      }
    }
    svgWrap.replaceChildren(svg);
    fitLabels();
    refreshSelection();
  }
  function fitLabels() {
    if (!svg || !svg.isConnected) return;
    for (const tx of svg.querySelectorAll(".iel-mod text")) {
      const room = Number(tx.dataset.room), full = tx.dataset.full;
      tx.textContent = full;
      tx.style.fontSize = "";
      if (tx.getComputedTextLength() === 0) return;
      if (tx.getComputedTextLength() <= room) continue;
      tx.style.fontSize = "10px";
      if (tx.getComputedTextLength() <= room) continue;
      let lo = 1, hi = full.length;
      while (lo < hi) {
        const mid = Math.ceil((lo + hi) / 2);
        tx.textContent = full.slice(0, mid).trimEnd() + "…";
        if (tx.getComputedTextLength() <= room) lo = mid;
        else hi = mid - 1;
      }
      tx.textContent = full.slice(0, lo).trimEnd() + "…";
    }
  }
  if (document.fonts) document.fonts.ready.then(fitLabels);
  const shownObs = typeof IntersectionObserver === "function" ? new IntersectionObserver((es) => {
    if (es.some((e) => e.isIntersecting)) fitLabels();
  }) : null;
  function refreshSelection() {
    const selected = new Set(model.get("selected"));
    for (const g of svgWrap.querySelectorAll(".iel-pt")) {
      const p = byName.get(g.dataset.name);
      const on = selected.has(addressOf(p, layer));
      g.classList.toggle("iel-sel", on);
      g.setAttribute("aria-pressed", on ? "true" : "false");
    }
    const list = model.get("selected");
    selectedLine.textContent = list.length ? `selected: ${list.join(", ")}` : "click a point to select it (shift: several)";
    const first = focusName && order.includes(focusName) ? focusName : order[0];
    for (const g of svgWrap.querySelectorAll(".iel-pt")) g.setAttribute("tabindex", g.dataset.name === first ? "0" : "-1");
  }
  function showCard(name) {
    focusName = name;
    const p = byName.get(name);
    if (!p) return;
    const { ok, why } = servedAt(p, layer);
    const v = p.verdicts[spec.backend];
    card.replaceChildren();
    const addr = addressOf(p, layer);
    card.dataset.address = addr;
    card.append(h(
      "div",
      { class: "iel-card-title" },
      h("code", { text: addr }),
      h("span", { class: "iel-chip " + (ok ? "iel-ok" : "iel-no"), text: ok ? v.verdict === "served" ? "served" : v.verdict : "not served" })
    ));
    if (!ok) card.append(h("div", { class: "iel-why", text: why }));
    card.append(h("p", { class: "iel-def", text: p.definition }));
    if (p.note) card.append(h("p", { class: "iel-note", text: p.note }));
    const dl = h("table", { class: "iel-kv" });
    const breakable = (val) => {
      const c = h("code");
      String(val).split(/(?<=[._])/).forEach((part, i) => {
        if (i) c.append(h("wbr"));
        c.append(part);
      });
      return c;
    };
    const row = (k, val) => {
      dl.append(h("tr", {}, h("th", { text: k }), h("td", {}, breakable(val))));
    };
    row("width", p.width);
    row("shape", p.shape);
    const names = [["transformerlens", "TransformerLens"], ["transformerlens_bridge", "TransformerBridge"], ["nnterp", "nnterp"]];
    for (const [k, label] of names) row(label, fillLayer(p.names[k], layer) || "—");
    card.append(dl);
    for (const w of p.warnings) card.append(h("div", { class: "iel-warn", text: "⚠ " + fillLayer(w, layer) }));
    const vt = h("table", { class: "iel-verdicts" });
    for (const [b, bv] of Object.entries(p.verdicts)) {
      vt.append(h(
        "tr",
        {},
        h("td", { text: b + (b === spec.backend ? { family: " (shown)", model: " (this model)" }[spec.handle.kind] || " (this session)" : "") }),
        h("td", { class: bv.ok ? "iel-ok-t" : "iel-no-t", text: bv.verdict }),
        h("td", { text: bv.reason })
      ));
    }
    card.append(vt);
    const code = snippet(p, layer, spec.handle, spec.family);
    const pre = h("pre", { class: "iel-snippet", text: code });
    const copy = h("button", { class: "iel-btn", type: "button", text: "copy" });
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(code);
        copy.textContent = "copied";
      } catch {
        const r = document.createRange();
        r.selectNodeContents(pre);
        const sl = getSelection();
        sl.removeAllRanges();
        sl.addRange(r);
        copy.textContent = "selected: Ctrl+C";
      }
      setTimeout(() => {
        copy.textContent = "copy";
      }, 1200);
    });
    card.append(h("div", { class: "iel-snipbox" }, pre, copy));
    placeCard();
  }
  function placeCard() {
    const g = focusName && svgWrap.querySelector(`.iel-pt[data-name="${focusName}"]`);
    if (!g || getComputedStyle(body).flexDirection === "column") {
      card.style.marginTop = "";
      return;
    }
    const room = svgWrap.getBoundingClientRect().height - card.offsetHeight;
    const y = g.getBoundingClientRect().top - svgWrap.getBoundingClientRect().top - 24;
    card.style.marginTop = `${Math.max(0, Math.min(room, y))}px`;
  }
  function choose(name, multi) {
    const p = byName.get(name);
    if (!p) return;
    const { ok, why } = servedAt(p, layer);
    showCard(name);
    if (!ok) {
      error.textContent = `${addressOf(p, layer)} is not served here: ${why}`;
      return;
    }
    error.textContent = "";
    model.send({ cmd: "select", address: addressOf(p, layer), multi: !!multi });
  }
  function setLayer(L) {
    if (L < 0 || L >= spec.n_layers || L === layer) return;
    layer = L;
    sel.value = String(L);
    drawDiagram();
    if (focusName) showCard(focusName);
  }
  svgWrap.addEventListener("click", (e) => {
    const g = e.target.closest(".iel-pt");
    if (g) {
      g.focus();
      choose(g.dataset.name, e.shiftKey || e.metaKey || e.ctrlKey);
    }
  });
  svgWrap.addEventListener("mouseover", (e) => {
    const g = e.target.closest(".iel-pt");
    if (g) showCard(g.dataset.name);
  });
  svgWrap.addEventListener("focusin", (e) => {
    const g = e.target.closest(".iel-pt");
    if (g) showCard(g.dataset.name);
  });
  svgWrap.addEventListener("keydown", (e) => {
    const g = e.target.closest(".iel-pt");
    if (!g) return;
    const i = order.indexOf(g.dataset.name);
    let to = null;
    if (e.key === "ArrowDown" || e.key === "ArrowRight") to = order[Math.min(order.length - 1, i + 1)];
    else if (e.key === "ArrowUp" || e.key === "ArrowLeft") to = order[Math.max(0, i - 1)];
    else if (e.key === "Home") to = order[0];
    else if (e.key === "End") to = order[order.length - 1];
    else if (e.key === "PageDown" || e.key === "]") {
      setLayer(layer + 1);
      to = g.dataset.name;
    } else if (e.key === "PageUp" || e.key === "[") {
      setLayer(layer - 1);
      to = g.dataset.name;
    } else if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      choose(g.dataset.name, e.shiftKey);
      return;
    } else return;
    e.preventDefault();
    e.stopPropagation();
    const target = svgWrap.querySelector(`.iel-pt[data-name="${to}"]`);
    if (target) {
      for (const x of svgWrap.querySelectorAll(".iel-pt")) x.setAttribute("tabindex", "-1");
      target.setAttribute("tabindex", "0");
      target.focus();
    }
  });
  sel.addEventListener("change", () => setLayer(Number(sel.value)));
  prev.addEventListener("click", () => setLayer(layer - 1));
  next.addEventListener("click", () => setLayer(layer + 1));
  const onSelected = () => {
    const list = model.get("selected");
    if (list.length) {
      const m = /^(.*?)(?:\.(\d+))?$/.exec(list[list.length - 1]);
      if (m[2] !== void 0) setLayer(Number(m[2]));
      if (byName.has(m[1])) showCard(m[1]);
    }
    refreshSelection();
    error.textContent = model.get("error");
  };
  const onLayer = () => setLayer(model.get("layer"));
  const onError = () => {
    error.textContent = model.get("error");
  };
  const onMsg = (msg) => {
    if (msg && msg.type === "error") error.textContent = msg.message;
  };
  model.on("change:selected", onSelected);
  model.on("change:layer", onLayer);
  model.on("change:error", onError);
  model.on("msg:custom", onMsg);
  sel.value = String(layer);
  error.textContent = model.get("error");
  drawDiagram();
  const sel0 = model.get("selected");
  showCard(sel0.length ? sel0[sel0.length - 1].split(".")[0] : "resid_post");
  requestAnimationFrame(() => {
    root.dataset.renderMs = (performance.now() - t0).toFixed(1);
  });
  if (shownObs) shownObs.observe(svgWrap);
  return () => {
    if (shownObs) shownObs.disconnect();
    model.off("change:selected", onSelected);
    model.off("change:layer", onLayer);
    model.off("change:error", onError);
    model.off("msg:custom", onMsg);
  };
}
var picker_default = { render };
export {
  picker_default as default
};
