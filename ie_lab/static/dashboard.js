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
function refuse(input, message, errorEl, lastGood) {
  input.setAttribute("aria-invalid", "true");
  input.classList.add("iel-invalid");
  input.title = message;
  if (errorEl) errorEl.textContent = message;
  if (lastGood !== void 0 && lastGood !== null) input.value = String(lastGood);
  const clear = () => {
    input.removeAttribute("aria-invalid");
    input.classList.remove("iel-invalid");
    input.title = "";
    input.removeEventListener("input", clear);
  };
  input.addEventListener("input", clear);
}
function clearRefused(root) {
  for (const e of root.querySelectorAll('[aria-invalid="true"]')) {
    e.removeAttribute("aria-invalid");
    e.classList.remove("iel-invalid");
    e.title = "";
  }
}
function plural(n, one, many = one + "s") {
  return `${n} ${Number(n) === 1 ? one : many}`;
}
function wholeNumber(text) {
  const t = String(text).trim();
  return /^-?\d+$/.test(t) ? Number(t) : null;
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
function featureList(items, current) {
  return items.map(({ id, max, density }) => h("button", {
    class: "iel-featbtn" + (id === current ? " iel-sel" : ""),
    type: "button",
    "data-f": String(id),
    "aria-selected": id === current ? "true" : "false",
    title: `feature ${id}: max ${fmt(max)}, density ${pct(density)}`
  }, h("span", { text: `#${id}` }), h("span", { class: "iel-muted", text: ` ${fmt(max)}` })));
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
function render({ model, el }) {
  const root = h("div", { class: "iel-root iel-dash" });
  const num = h("input", { type: "number", min: "0", step: "1", class: "iel-num", "aria-label": "feature index" });
  const go = h("button", { class: "iel-btn", type: "button", text: "show" });
  const list = h("div", { class: "iel-feats", role: "listbox", "aria-label": "the corpus's strongest features" });
  const body = h("div", { class: "iel-dash-body" });
  const error = h("div", { class: "iel-error", role: "alert" });
  root.append(h(
    "div",
    { class: "iel-row" },
    h("label", {}, "feature ", num),
    go,
    h("span", { class: "iel-muted", text: `of ${plural(model.get("n_features"), "feature")} · strongest:` }),
    list
  ), body, error);
  el.append(root);
  const request = (f) => {
    if (f === model.get("feature")) return;
    root.classList.add("iel-busy");
    model.send({ cmd: "select", feature: f });
  };
  function refresh() {
    root.classList.remove("iel-busy");
    const cur = model.get("feature");
    num.max = String(model.get("n_features") - 1);
    if (document.activeElement !== num) num.value = String(cur);
    const ids = asInt32(model.get("list_ids")), mx = asFloat32(model.get("list_max")), dn = asFloat32(model.get("list_density"));
    list.replaceChildren(...featureList(Array.from(ids, (id, i) => ({ id, max: mx[i], density: dn[i] })), cur));
    drawFeature(body, fromTraits(model));
  }
  list.addEventListener("click", (e) => {
    const b = e.target.closest(".iel-featbtn");
    if (b) request(Number(b.dataset.f));
  });
  let asked = false;
  go.addEventListener("click", () => {
    const f = wholeNumber(num.value), n = model.get("n_features");
    if (f === null || f < 0 || f >= n) {
      refuse(num, `${JSON.stringify(num.value.trim())} is not a feature here: features run from 0 to ${n - 1}; still showing ${model.get("feature")}.`, error, model.get("feature"));
      return;
    }
    asked = true;
    request(f);
  });
  num.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      e.preventDefault();
      go.click();
    }
  });
  const onError = () => {
    error.textContent = model.get("error");
  };
  const onMsg = (msg) => {
    if (!(msg && msg.type === "error")) return;
    error.textContent = msg.message;
    root.classList.remove("iel-busy");
    if (asked) refuse(num, msg.message, error, model.get("feature"));
    asked = false;
  };
  const onShown = () => {
    asked = false;
    clearRefused(root);
    refresh();
    onError();
  };
  model.on("change:feature", onShown);
  model.on("change:ctx_values", refresh);
  model.on("change:error", onError);
  model.on("msg:custom", onMsg);
  refresh();
  onError();
  return () => {
    model.off("change:feature", onShown);
    model.off("change:ctx_values", refresh);
    model.off("change:error", onError);
    model.off("msg:custom", onMsg);
  };
}
var dashboard_default = { render };
export {
  dashboard_default as default,
  fromTraits
};
