// ie_lab notebook panels, built by widgets/build.py from widgets/ (sources ec41fa865fb07ef2); edit those, not this file

// widgets/util.js
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

// widgets/dashboard_export.js
function main() {
  const src = document.getElementById("iel-dashboards");
  if (!src) return;
  const all = JSON.parse(src.textContent);
  const root = h("div", { class: "iel-root iel-dash iel-export" });
  const nav = h("nav", { class: "iel-dash-nav", "aria-label": "features" });
  nav.append(h("div", { class: "iel-colhead", text: `${plural(all.features.length, "feature")} at ${all.address}` }));
  const main2 = h("div", { class: "iel-dash-main" });
  for (const d of all.features) {
    nav.append(h("a", {
      href: `#feature-${d.feature}`,
      class: "iel-featbtn",
      "data-f": String(d.feature),
      title: `density ${pct(d.density)}, max ${fmt(d.max)}`
    }, `#${d.feature}`, h("span", { class: "iel-muted", text: ` ${pct(d.density)}` })));
    const sec = h("section", { id: `feature-${d.feature}`, class: "iel-dash-feature", "data-f": String(d.feature) });
    drawFeature(sec, d);
    main2.append(sec);
  }
  root.append(h("h1", { class: "iel-dash-h1", text: all.title }), h("div", { class: "iel-muted", text: all.subtitle }), nav, main2);
  document.body.append(root);
  document.body.dataset.ielReady = "true";
}
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", main);
else main();
