// ie_lab notebook panels, built by widgets/build.py from widgets/ (sources ec41fa865fb07ef2); edit those, not this file

// widgets/util.js
function debounce(fn, ms, timers = { set: (f, t) => setTimeout(f, t), clear: (h2) => clearTimeout(h2) }) {
  let handle = null;
  const wrapped = (...args) => {
    if (handle !== null) timers.clear(handle);
    handle = timers.set(() => {
      handle = null;
      fn(...args);
    }, ms);
  };
  wrapped.flush = () => {
    if (handle !== null) {
      timers.clear(handle);
      handle = null;
    }
  };
  return wrapped;
}
function diffTokens(a, b) {
  const n = a.length, m = b.length;
  const L = Array.from({ length: n + 1 }, () => new Uint16Array(m + 1));
  for (let i2 = n - 1; i2 >= 0; i2--)
    for (let j2 = m - 1; j2 >= 0; j2--)
      L[i2][j2] = a[i2] === b[j2] ? L[i2 + 1][j2 + 1] + 1 : Math.max(L[i2 + 1][j2], L[i2][j2 + 1]);
  const ma = new Array(n).fill("removed"), mb = new Array(m).fill("added");
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (a[i] === b[j]) {
      ma[i] = "same";
      mb[j] = "same";
      i++;
      j++;
    } else if (L[i + 1][j] >= L[i][j + 1]) i++;
    else j++;
  }
  return { a: ma, b: mb };
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

// widgets/steering.js
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
var USES = { add: ["scale"], orthogonal: ["scale"], norm_scaled_add: ["scale"], cap: ["cap_min", "cap_max"], swap: ["target"], ablate: [] };
var LABELS = { scale: "coefficient", cap_min: "cap min", cap_max: "cap max", target: "target" };
function render({ model, el }) {
  const root = h("div", { class: "iel-root iel-steer" });
  const v = model.get("var_name") || "s";
  const title = h("div", { class: "iel-title" });
  const prompt = h("textarea", { class: "iel-prompt", rows: "2", "aria-label": "prompt", title: "Ctrl+Enter to run" });
  const pointSel = h("select", { "aria-label": "steering point" });
  const layerIn = h("input", { type: "number", min: "0", step: "1", class: "iel-num", "aria-label": "layer" });
  const methodSel = h("select", { "aria-label": "method" });
  const sliders = h("div", { class: "iel-sliders" });
  const methodHelp = h("div", { class: "iel-methodhelp iel-muted", id: `iel-mh-${Math.random().toString(36).slice(2)}`, "aria-live": "polite" });
  methodSel.setAttribute("aria-describedby", methodHelp.id);
  const status = h("span", { class: "iel-status", "aria-live": "polite" });
  const bar = h("progress", { class: "iel-progress", max: "1", value: "0", "aria-label": "vector progress" });
  const stopBtn = h("button", { class: "iel-btn", type: "button", text: "stop", title: "cancel the work in flight" });
  const source = h("div", { class: "iel-source" });
  const missing = h(
    "div",
    { class: "iel-novector", role: "note" },
    h("b", { text: "No steering vector yet: " }),
    "the controls change nothing until there is one. Get one by ",
    h("span", { text: "typing two prompt lists below and pressing " }),
    h("i", { text: "use difference of means" }),
    ", or from Python: ",
    h("code", { text: `${v}.steering_panel(prompt, positive=[...], negative=[...])` }),
    ", ",
    h("code", { text: "vector=" }),
    " a tensor, a saved .pt / .npy path or a capture (",
    h("code", { text: `${v}.capture(...)` }),
    "), or ",
    h("code", { text: "panel.set_contrast(positive, negative)" }),
    "."
  );
  const pos = h("textarea", { rows: "3", "aria-label": "positive prompts, one per line", placeholder: "positive prompts, one per line" });
  const neg = h("textarea", { rows: "3", "aria-label": "negative prompts, one per line", placeholder: "negative prompts, one per line" });
  const computeBtn = h("button", { class: "iel-btn", type: "button", text: "use difference of means" });
  const contrast = h(
    "details",
    { class: "iel-contrast" },
    h("summary", { text: "vector from two prompt lists" }),
    h("div", { class: "iel-row" }, pos, neg),
    computeBtn
  );
  const baseBox = h("div", { class: "iel-text", "data-which": "baseline", "aria-label": "baseline continuation" });
  const steerBox = h("div", { class: "iel-text", "data-which": "steered", "aria-label": "steered continuation", "aria-live": "polite" });
  const error = h("div", { class: "iel-error", role: "alert" });
  root.append(
    title,
    h("div", { class: "iel-row" }, h("label", { class: "iel-grow" }, "prompt", prompt)),
    h(
      "div",
      { class: "iel-row iel-controls" },
      h("label", {}, "point ", pointSel),
      h("label", {}, "layer ", layerIn),
      h("label", {}, "method ", methodSel),
      h("span", { class: "iel-busybox" }, status, bar, stopBtn)
    ),
    methodHelp,
    missing,
    sliders,
    source,
    contrast,
    h(
      "div",
      { class: "iel-cols" },
      h("div", { class: "iel-col" }, h("div", { class: "iel-colhead", text: "baseline" }), baseBox),
      h("div", { class: "iel-col" }, h("div", { class: "iel-colhead" }, "steered ", h("span", { class: "iel-muted", text: "(changed tokens marked)" })), steerBox)
    ),
    error
  );
  el.append(root);
  let seq = model.get("seq");
  let current = seq;
  let live = null;
  const inputs = {};
  function tokensOf(which) {
    if (live && live[which] && (which !== "steered" || live.steered.length)) return live[which];
    return which === "baseline" ? model.get("baseline") : model.get("steered");
  }
  function idsOf(which) {
    if (live && live[which + "_ids"] && (which !== "steered" || live.steered.length)) return live[which + "_ids"];
    return which === "baseline" ? model.get("baseline_ids") : model.get("steered_ids");
  }
  function drawTexts() {
    const bt = tokensOf("baseline"), st = tokensOf("steered");
    const d = diffTokens(idsOf("baseline"), idsOf("steered"));
    const span = (t, mark) => h("span", { class: "iel-tok iel-" + mark, text: t });
    baseBox.replaceChildren(...bt.map((t, i) => span(t, live && live.baseline && i >= bt.length ? "same" : d.a[i] || "same")));
    steerBox.replaceChildren(...st.map((t, i) => span(t, d.b[i] || "same")));
    steerBox.dataset.seq = String(current);
    steerBox.dataset.count = String(st.length);
    baseBox.dataset.count = String(bt.length);
    root.classList.toggle("iel-stale", !!(live && live.steered.length === 0));
  }
  function drawSliders() {
    const m = methodNow();
    sliders.replaceChildren();
    for (const k of USES[m]) {
      const [lo, hi, step] = k === "scale" ? model.get("scale_range") : model.get("proj_range");
      const v2 = model.get(k);
      const r = h("input", {
        type: "range",
        min: String(Math.min(lo, v2)),
        max: String(Math.max(hi, v2)),
        step: String(step),
        value: String(v2),
        "aria-label": LABELS[k],
        "data-knob": k
      });
      if (!model.get("has_vector")) {
        r.disabled = true;
        r.title = "no steering vector yet";
      }
      const out = h("output", { text: Number(v2).toFixed(2) });
      r.addEventListener("input", () => {
        out.textContent = Number(r.value).toFixed(2);
        sendSoon();
      });
      r.addEventListener("pointerdown", () => {
        r.dataset.held = "1";
      });
      const letGo = () => {
        delete r.dataset.held;
      };
      r.addEventListener("pointerup", letGo);
      r.addEventListener("change", letGo);
      r.addEventListener("lostpointercapture", letGo);
      inputs[k] = r;
      sliders.append(h("label", { class: "iel-slider" }, h("span", { text: LABELS[k] }), r, out));
    }
    if (!USES[m].length) sliders.append(h("span", { class: "iel-muted", text: "ablate removes the direction: no coefficient." }));
  }
  function drawHeader() {
    title.replaceChildren(
      h("b", { text: "steering" }),
      ` · ${methodNow()} at `,
      h("code", { text: model.get("address") }),
      ` · ${plural(model.get("max_new_tokens"), "greedy token")}`
    );
    syncBox(prompt, "prompt", model.get("prompt"));
    const [name, L] = model.get("address").split(".");
    const pts = model.get("points");
    if ([...pointSel.options].map((o) => o.value).join() !== pts.join()) pointSel.replaceChildren(...pts.map((p) => h("option", { value: p, text: p })));
    pointSel.value = name;
    layerIn.max = String(model.get("n_layers") - 1);
    if (document.activeElement !== layerIn) layerIn.value = L;
    markServed();
    const help = model.get("method_help") || {};
    if (methodSel.options.length !== model.get("methods").length) methodSel.replaceChildren(...model.get("methods").map((p) => h("option", { value: p, text: p, title: help[p] || "" })));
    methodSel.value = methodNow();
    methodHelp.textContent = help[methodSel.value] || "";
    methodSel.title = methodHelp.textContent;
    source.textContent = "vector: " + model.get("vector_source");
    syncBox(pos, "positive", model.get("positive").join("\n"));
    syncBox(neg, "negative", model.get("negative").join("\n"));
    const none = !model.get("has_vector");
    missing.hidden = !none;
    if (none && !contrast.open && !openedOnce) {
      contrast.open = true;
      openedOnce = true;
    }
  }
  function markServed() {
    const L = Math.trunc(Number(layerIn.value)), per = model.get("point_layers") || {};
    for (const o of pointSel.options) {
      const on = per[o.value] === void 0 || per[o.value].charAt(L) === "1";
      o.disabled = !on;
      o.title = on ? "" : `not on layer ${L} of this model`;
    }
  }
  let pendingMethod = null;
  function methodNow() {
    if (pendingMethod !== null && model.get("method") === pendingMethod) pendingMethod = null;
    return pendingMethod ?? model.get("method");
  }
  const shown = {};
  let openedOnce = false;
  function syncBox(box, key, value) {
    if (shown[key] === value) return;
    if (document.activeElement === box) return;
    shown[key] = value;
    box.value = value;
  }
  function drawStatus() {
    const st = model.get("status");
    const [done, total] = model.get("progress");
    const vec = st === "vector";
    status.textContent = vec ? `computing the vector: ${done}/${plural(total, "prompt")}…` : live ? "generating…" : st === "generating" ? "generating…" : st;
    bar.hidden = !vec;
    bar.max = String(Math.max(1, total));
    bar.value = String(done);
    const busy = !!live || st === "generating" || vec;
    stopBtn.hidden = !busy;
    root.classList.toggle("iel-busy", busy);
  }
  function knobs() {
    const out = { method: methodSel.value };
    for (const k of USES[methodSel.value]) out[k] = Number(inputs[k].value);
    return out;
  }
  const send = () => {
    seq = Math.max(seq, current, model.get("seq")) + 1;
    root.dataset.sentAt = String(performance.now());
    model.send({ cmd: "steer", seq, ...knobs() });
  };
  const sendSoon = debounce(send, 30);
  methodSel.addEventListener("change", () => {
    methodHelp.textContent = methodSel.title = (model.get("method_help") || {})[methodSel.value] || "";
    pendingMethod = methodSel.value;
    drawSliders();
    drawHeader();
    sendSoon.flush();
    send();
  });
  let edited = null;
  const inEffect = () => {
    const [name, L] = model.get("address").split(".");
    return { name, L };
  };
  const sendAddress = (e) => {
    const L = wholeNumber(layerIn.value), n = model.get("n_layers");
    if (L === null || L < 0 || L >= n) {
      const keep = inEffect();
      pointSel.value = keep.name;
      refuse(layerIn, `${JSON.stringify(layerIn.value.trim())} is not a layer of this model: layers are 0 to ${n - 1}; still steering at ${model.get("address")}.`, error, keep.L);
      markServed();
      return;
    }
    edited = e && e.target === pointSel ? pointSel : layerIn;
    seq = Math.max(seq, current) + 1;
    model.send({ cmd: "address", seq, address: `${pointSel.value}.${L}` });
  };
  pointSel.addEventListener("change", sendAddress);
  layerIn.addEventListener("change", sendAddress);
  const sendPrompt = () => {
    edited = prompt;
    seq = Math.max(seq, current) + 1;
    model.send({ cmd: "prompt", seq, prompt: prompt.value });
  };
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      e.stopPropagation();
      sendPrompt();
    }
  });
  prompt.addEventListener("change", () => {
    if (prompt.value !== model.get("prompt")) sendPrompt();
  });
  stopBtn.addEventListener("click", () => {
    sendSoon.flush();
    model.send({ cmd: "cancel" });
  });
  computeBtn.addEventListener("click", () => {
    const lines = (t) => t.value.split("\n").map((x) => x.trim()).filter(Boolean);
    seq = Math.max(seq, current) + 1;
    model.send({ cmd: "contrast", seq, positive: lines(pos), negative: lines(neg) });
  });
  root.addEventListener("keydown", (e) => {
    if (e.target.matches("input, textarea, select")) e.stopPropagation();
  });
  const onMsg = (msg) => {
    if (!msg || typeof msg !== "object") return;
    if (msg.type === "start") {
      if (msg.seq < current) return;
      current = msg.seq;
      live = { steered: [], steered_ids: [] };
      if (msg.baseline) {
        live.baseline = [];
        live.baseline_ids = [];
      }
      error.textContent = "";
      clearRefused(root);
      drawStatus();
      drawTexts();
    } else if (msg.type === "token") {
      if (msg.seq !== current || !live) return;
      if (msg.which === "baseline" && live.baseline) {
        live.baseline.push(msg.token);
        live.baseline_ids.push(msg.id);
      } else if (msg.which === "steered") {
        live.steered.push(msg.token);
        live.steered_ids.push(msg.id);
        if (live.steered.length === 1) root.dataset.firstTokenAt = String(performance.now());
      }
      drawTexts();
    } else if (msg.type === "done") {
      if (msg.seq !== current) return;
      live = null;
      drawTexts();
      drawStatus();
    } else if (msg.type === "error") {
      if (msg.seq === void 0 || msg.seq === current) {
        live = null;
        drawStatus();
        drawTexts();
      }
      error.textContent = msg.message;
      if (edited === prompt) refuse(prompt, msg.message, error);
      else if (edited) {
        const keep = inEffect();
        pointSel.value = keep.name;
        refuse(layerIn, msg.message, error, keep.L);
        markServed();
      }
      edited = null;
    }
  };
  const onState = () => {
    if (!live) drawTexts();
    drawHeader();
    drawStatus();
  };
  const onAccepted = () => {
    edited = null;
  };
  const onRanges = () => drawSliders();
  const onKnob = () => {
    for (const [k, r] of Object.entries(inputs)) {
      if (!r.isConnected || r.dataset.held) continue;
      const v2 = model.get(k);
      if (Math.abs(Number(r.value) - v2) > 1e-9) {
        r.value = String(v2);
        r.nextSibling.textContent = Number(v2).toFixed(2);
      }
    }
  };
  const onMethod = () => {
    drawSliders();
    drawHeader();
  };
  const onHasVector = () => {
    drawSliders();
    drawHeader();
  };
  const onError = () => {
    error.textContent = model.get("error");
  };
  const listeners = [
    ["msg:custom", onMsg],
    ["change:status", drawStatus],
    ["change:progress", drawStatus],
    ["change:error", onError],
    ["change:method", onMethod],
    ["change:has_vector", onHasVector]
  ];
  for (const k of ["steered", "baseline", "seq", "address", "prompt", "vector_source", "positive", "negative"]) listeners.push(["change:" + k, onState]);
  listeners.push(["change:address", onAccepted], ["change:prompt", onAccepted]);
  for (const k of ["scale_range", "proj_range"]) listeners.push(["change:" + k, onRanges]);
  for (const k of ["scale", "cap_min", "cap_max", "target"]) listeners.push(["change:" + k, onKnob]);
  for (const [ev, fn] of listeners) model.on(ev, fn);
  drawHeader();
  drawSliders();
  drawTexts();
  drawStatus();
  onError();
  return () => {
    for (const [ev, fn] of listeners) model.off(ev, fn);
    sendSoon.flush();
  };
}
var steering_default = { render };
export {
  steering_default as default
};
