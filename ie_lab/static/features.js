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

// widgets/features.js
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
function asInt32(buf) {
  const f = asFloat32(buf);
  return new Int32Array(f.buffer, f.byteOffset, f.length);
}
var fmt = (v) => Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(2) : v.toFixed(3);
function render({ model, el }) {
  const root = h("div", { class: "iel-root iel-feat" });
  const title = h("div", { class: "iel-title" });
  const num = h("input", { type: "number", min: "0", step: "1", class: "iel-num", "aria-label": "feature index" });
  const go = h("button", { class: "iel-btn", type: "button", text: "show" });
  const picks = h("div", { class: "iel-feats", role: "listbox", "aria-label": "top features over the prompt" });
  const strip = h("div", { class: "iel-text iel-feat-tokens", "aria-label": "tokens coloured by the selected feature" });
  const readout = h("div", { class: "iel-readout", "aria-live": "polite" });
  const error = h("div", { class: "iel-error", role: "alert" });
  root.append(
    title,
    h("div", { class: "iel-row" }, h("span", { class: "iel-muted", text: "top features:" }), picks),
    h("div", { class: "iel-row" }, h("label", {}, "feature ", num), go, h("span", { class: "iel-muted iel-legend-note" })),
    strip,
    readout,
    error
  );
  el.append(root);
  let focus = -1;
  const request = (f) => {
    root.classList.add("iel-busy");
    model.send({ cmd: "select", feature: f });
  };
  function drawTitle() {
    title.replaceChildren(h("b", { text: "features" }), ` · ${model.get("title")} at ${model.get("address")} · ${plural(model.get("tokens").length, "token")} · ${plural(model.get("n_features"), "feature")} · showing feature ${model.get("feature")}`);
    num.max = String(model.get("n_features") - 1);
    if (document.activeElement !== num) num.value = String(model.get("feature"));
  }
  function drawPicks() {
    const ids = asInt32(model.get("top_ids")), mx = asFloat32(model.get("top_max"));
    const cur = model.get("feature");
    picks.replaceChildren(...Array.from(ids, (f, i) => h("button", {
      class: "iel-featbtn" + (f === cur ? " iel-sel" : ""),
      type: "button",
      role: "option",
      "data-f": String(f),
      "aria-selected": f === cur ? "true" : "false",
      title: `feature ${f}: max ${fmt(mx[i])} over the prompt`
    }, h("span", { text: `#${f}` }), h("span", { class: "iel-muted", text: ` ${fmt(mx[i])}` }))));
  }
  function drawTokens() {
    const toks = model.get("tokens"), vals = asFloat32(model.get("values"));
    let top = 0;
    for (const v of vals) top = Math.max(top, Math.abs(v));
    if (strip.children.length !== toks.length) {
      strip.replaceChildren(...toks.map((t, i) => h("span", { class: "iel-tok", tabindex: "0", "data-i": String(i), text: showToken(t) })));
    }
    for (let i = 0; i < toks.length; i++) {
      const sp = strip.children[i], v = vals[i] || 0;
      const a = top > 0 ? Math.min(1, Math.abs(v) / top) : 0;
      sp.style.setProperty("--iel-a", `${Math.round(a * 65)}%`);
      sp.classList.toggle("iel-neg", v < 0);
      sp.classList.toggle("iel-on", a > 0);
      sp.classList.toggle("iel-focus", i === focus);
      sp.title = `${i}: ${JSON.stringify(toks[i])} · feature ${model.get("feature")} = ${fmt(v)}`;
    }
    root.querySelector(".iel-legend-note").textContent = `colour: feature ${model.get("feature")}'s activation, 0 to ${fmt(top)} (its largest |value| on this prompt; red: negative)`;
  }
  function describe() {
    const toks = model.get("tokens"), n = model.get("hover");
    const vals = asFloat32(model.get("values"));
    if (focus < 0 || focus >= toks.length) {
      readout.textContent = `feature ${model.get("feature")}: hover a token for its strongest features; click one to show it.`;
      return;
    }
    const ids = asInt32(model.get("tok_ids")), tv = asFloat32(model.get("tok_vals"));
    const list = h("span", { class: "iel-toklist" });
    for (let j = 0; j < n; j++) {
      const f = ids[focus * n + j];
      list.append(h("button", { class: "iel-featbtn", type: "button", "data-f": String(f), text: `#${f} ${fmt(tv[focus * n + j])}` }));
    }
    readout.replaceChildren(`token ${focus} ${JSON.stringify(toks[focus])}: feature ${model.get("feature")} = ${fmt(vals[focus] || 0)}; strongest: `, list);
  }
  function refresh() {
    root.classList.remove("iel-busy");
    drawTitle();
    drawPicks();
    drawTokens();
    describe();
  }
  const onPick = (e) => {
    const b = e.target.closest(".iel-featbtn");
    if (b) request(Number(b.dataset.f));
  };
  picks.addEventListener("click", onPick);
  readout.addEventListener("click", onPick);
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
  const onTok = (e) => {
    const sp = e.target.closest(".iel-tok");
    if (!sp) return;
    focus = Number(sp.dataset.i);
    drawTokens();
    describe();
  };
  strip.addEventListener("mouseover", onTok);
  strip.addEventListener("focusin", onTok);
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
  model.on("change:values", refresh);
  model.on("change:feature", refresh);
  const onShown = () => {
    asked = false;
    clearRefused(root);
    error.textContent = model.get("error");
  };
  model.on("change:feature", onShown);
  model.on("change:error", onError);
  model.on("msg:custom", onMsg);
  refresh();
  onError();
  return () => {
    model.off("change:values", refresh);
    model.off("change:feature", refresh);
    model.off("change:feature", onShown);
    model.off("change:error", onError);
    model.off("msg:custom", onMsg);
  };
}
var features_default = { render };
export {
  features_default as default
};
