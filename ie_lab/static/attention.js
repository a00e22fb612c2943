// ie_lab notebook panels, built by widgets/build.py from widgets/ (sources ec41fa865fb07ef2); edit those, not this file

// widgets/util.js
var VIRIDIS_STOPS = [
  [68, 1, 84],
  [72, 40, 120],
  [62, 74, 137],
  [49, 104, 142],
  [38, 130, 142],
  [31, 158, 137],
  [53, 183, 121],
  [109, 205, 89],
  [180, 222, 44],
  [253, 231, 37]
];
function makeLut(stops = VIRIDIS_STOPS) {
  const lut = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const t = i / 255 * (stops.length - 1);
    const a = Math.floor(t), b = Math.min(stops.length - 1, a + 1), f = t - a;
    for (let c = 0; c < 3; c++) lut[i * 3 + c] = Math.round(stops[a][c] * (1 - f) + stops[b][c] * f);
  }
  return lut;
}
function toByte(v, scale = "linear") {
  if (!(v > 0)) return 0;
  const x = scale === "sqrt" ? Math.sqrt(Math.min(1, v)) : Math.min(1, v);
  return Math.round(x * 255);
}
function patternPixels(values, rows, cols, scale = "linear", lut = makeLut()) {
  const out = new Uint8ClampedArray(rows * cols * 4);
  for (let i = 0; i < rows; i++) {
    let rowMax = 0;
    if (scale === "row") for (let j = 0; j < cols; j++) rowMax = Math.max(rowMax, values[i * cols + j]);
    for (let j = 0; j < cols; j++) {
      let v = values[i * cols + j];
      if (scale === "row") v = rowMax > 0 ? v / rowMax : 0;
      const b = toByte(v, scale === "row" ? "linear" : scale);
      const o = (i * cols + j) * 4;
      out[o] = lut[b * 3];
      out[o + 1] = lut[b * 3 + 1];
      out[o + 2] = lut[b * 3 + 2];
      out[o + 3] = 255;
    }
  }
  return out;
}
function patternGeometry(n, avail) {
  n = Math.max(1, n);
  const width = Math.max(320, avail || 640);
  const LABEL_MARGIN = 80, SIDE = 314;
  const labels = (width - LABEL_MARGIN - 8) / n >= 12;
  const margin = labels ? LABEL_MARGIN : 4;
  let usable = width - margin - 8;
  if (usable - SIDE >= n * (labels ? 12 : 4)) usable -= SIDE;
  const cellPx = usable / n >= 2 ? Math.min(28, Math.floor(usable / n)) : Math.max(1, usable / n);
  const font = Math.max(10, Math.min(13, cellPx - 2));
  return { n, labels, margin, cellPx, size: cellPx * n, font };
}
function asFloat32(buf) {
  if (!buf) return new Float32Array(0);
  const bytes = buf instanceof ArrayBuffer ? new Uint8Array(buf) : new Uint8Array(buf.buffer, buf.byteOffset || 0, buf.byteLength);
  if (bytes.byteOffset % 4 === 0 && bytes.byteLength % 4 === 0) {
    return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  }
  return new Float32Array(bytes.slice().buffer, 0, Math.floor(bytes.byteLength / 4));
}
function asBytes(buf) {
  if (!buf) return new Uint8Array(0);
  if (buf instanceof ArrayBuffer) return new Uint8Array(buf);
  return new Uint8Array(buf.buffer, buf.byteOffset || 0, buf.byteLength);
}
function plural(n, one, many = one + "s") {
  return `${n} ${Number(n) === 1 ? one : many}`;
}
function showToken(t) {
  if (t === "") return "∅";
  return t.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/^ /, "·").replace(/^Ġ/, "·").replace(/^▁/, "·");
}

// widgets/attention.js
var SVGNS = "http://www.w3.org/2000/svg";
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
var LUT = makeLut();
function render({ model, el }) {
  const root = h("div", { class: "iel-root iel-attn" });
  const head = h("div", { class: "iel-head" });
  const title = h("div", { class: "iel-title" });
  const layerSel = h("select", { "aria-label": "layer" });
  const scaleSel = h("select", { "aria-label": "colour scale" });
  for (const [v, t] of [["sqrt", "√p (faint weights visible)"], ["linear", "p (linear)"], ["row", "p / row max"]]) scaleSel.append(h("option", { value: v, text: t }));
  head.append(title, h("div", { class: "iel-row" }, h("label", {}, "layer ", layerSel), h("label", {}, "colour ", scaleSel)));
  const thumbs = h("div", { class: "iel-thumbs", role: "listbox", "aria-label": "heads" });
  const main = h("div", { class: "iel-attn-main" });
  const canvas = h("canvas", { class: "iel-pattern", tabindex: "0", "aria-label": "attention pattern" });
  const axes = document.createElementNS(SVGNS, "svg");
  axes.setAttribute("class", "iel-axes");
  axes.setAttribute("aria-hidden", "true");
  const patbox = h("div", { class: "iel-patbox" }, canvas, axes);
  const legend = h("div", { class: "iel-legend" });
  const readout = h("div", { class: "iel-readout", "aria-live": "polite" });
  const strip = h("div", { class: "iel-tokens", "aria-label": "tokens" });
  const error = h("div", { class: "iel-error", role: "alert" });
  main.append(h("div", { class: "iel-patwrap" }, patbox, legend), h("div", { class: "iel-side" }, readout, strip));
  root.append(head, thumbs, main, error);
  el.append(root);
  let focus = -1;
  let cell = null;
  let pending = null;
  const tokens = () => model.get("tokens");
  function drawLegend() {
    const c = h("canvas", { width: 120, height: 10 });
    const ctx = c.getContext("2d");
    for (let i = 0; i < 120; i++) {
      const b = Math.round(i / 119 * 255);
      ctx.fillStyle = `rgb(${LUT[b * 3]},${LUT[b * 3 + 1]},${LUT[b * 3 + 2]})`;
      ctx.fillRect(i, 0, 1, 10);
    }
    const sc = scaleSel.value;
    legend.replaceChildren(
      h("span", { text: "0" }),
      c,
      h("span", { text: sc === "row" ? "row max" : "1" }),
      h("span", { class: "iel-muted", text: sc === "sqrt" ? " (√ scale)" : "" })
    );
  }
  function drawThumbs() {
    const n = model.get("n_heads"), side = model.get("thumb_side");
    const data = asBytes(model.get("thumbs"));
    const cur = model.get("head");
    thumbs.replaceChildren();
    for (let k = 0; k < n; k++) {
      const c = h("canvas", { width: side, height: side });
      const ctx = c.getContext("2d");
      const img = ctx.createImageData(side, side);
      for (let i = 0; i < side * side; i++) {
        const b2 = data[k * side * side + i] || 0;
        img.data[i * 4] = LUT[b2 * 3];
        img.data[i * 4 + 1] = LUT[b2 * 3 + 1];
        img.data[i * 4 + 2] = LUT[b2 * 3 + 2];
        img.data[i * 4 + 3] = 255;
      }
      ctx.putImageData(img, 0, 0);
      const b = h("button", {
        class: "iel-thumb" + (k === cur ? " iel-sel" : ""),
        type: "button",
        role: "option",
        "aria-selected": k === cur ? "true" : "false",
        tabindex: k === cur ? "0" : "-1",
        "data-head": String(k),
        title: `layer ${model.get("layer")} head ${k}`
      }, c, h("span", { text: `h${k}` }));
      thumbs.append(b);
    }
  }
  function geometry() {
    return patternGeometry(tokens().length, main.clientWidth || root.clientWidth || 0);
  }
  let drawnAxes = "";
  function drawAxes(g) {
    const { n, labels, margin, size, cellPx, font } = g;
    const key = [n, margin, size, focus, tokens().join("\0")].join("|");
    if (key === drawnAxes) return;
    drawnAxes = key;
    axes.setAttribute("width", String(size + margin));
    axes.setAttribute("height", String(size + margin));
    axes.replaceChildren();
    if (!labels) return;
    const text = (x, y, t, i, cls, rot) => {
      const e = document.createElementNS(SVGNS, "text");
      e.setAttribute("x", String(x));
      e.setAttribute("y", String(y));
      e.setAttribute("class", cls + (i === focus ? " iel-focus" : ""));
      e.setAttribute("data-i", String(i));
      e.setAttribute("font-size", String(font));
      if (rot) e.setAttribute("transform", `rotate(-60 ${x} ${y})`);
      e.textContent = showToken(t).slice(0, 10);
      axes.append(e);
    };
    tokens().forEach((t, i) => text(margin - 4, margin + (i + 0.5) * cellPx, t, i, "iel-ylab", false));
    tokens().forEach((t, j) => text(margin + (j + 0.5) * cellPx, margin - 4, t, j, "iel-xlab", true));
  }
  function drawPattern() {
    const g = geometry();
    const { n, margin, size, cellPx } = g;
    const vals = asFloat32(model.get("pattern"));
    const dpr = window.devicePixelRatio || 1;
    canvas.width = (size + margin) * dpr;
    canvas.height = (size + margin) * dpr;
    canvas.style.width = `${size + margin}px`;
    canvas.style.height = `${size + margin}px`;
    root.style.setProperty("--iel-cell", `${cellPx}px`);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, size + margin, size + margin);
    drawAxes(g);
    if (vals.length !== n * n) return;
    const off = document.createElement("canvas");
    off.width = n;
    off.height = n;
    const octx = off.getContext("2d");
    const img = octx.createImageData(n, n);
    img.data.set(patternPixels(vals, n, n, scaleSel.value, LUT));
    octx.putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, margin, margin, size, size);
    const hi = getComputedStyle(root).getPropertyValue("--iel-accent").trim() || "#e91e63";
    ctx.strokeStyle = hi;
    ctx.lineWidth = 1.5;
    if (focus >= 0 && focus < n) {
      ctx.strokeRect(margin, margin + focus * cellPx, size, cellPx);
      ctx.setLineDash([3, 3]);
      ctx.strokeRect(margin + focus * cellPx, margin, cellPx, size);
      ctx.setLineDash([]);
    }
    if (cell) {
      ctx.strokeStyle = "#fff";
      ctx.strokeRect(margin + cell[1] * cellPx, margin + cell[0] * cellPx, cellPx, cellPx);
    }
  }
  function drawStrip() {
    const toks = tokens();
    const vals = asFloat32(model.get("pattern"));
    const n = toks.length;
    const kids = strip.children;
    if (kids.length !== n) {
      strip.replaceChildren(...toks.map((t, i) => h("span", { class: "iel-tok", tabindex: "0", "data-i": String(i), title: `${i}: ${JSON.stringify(t)}`, text: showToken(t) })));
    }
    for (let j = 0; j < n; j++) {
      const sp = strip.children[j];
      if (focus < 0 || vals.length !== n * n) {
        sp.style.background = "";
        sp.style.boxShadow = "";
        sp.classList.remove("iel-focus");
        continue;
      }
      const to = vals[focus * n + j];
      const from = vals[j * n + focus];
      sp.style.background = to > 5e-3 ? `rgba(233, 30, 99, ${Math.min(0.85, Math.sqrt(to))})` : "";
      sp.style.boxShadow = from > 5e-3 ? `inset 0 -${Math.max(1, Math.round(Math.sqrt(from) * 5))}px 0 rgba(33, 150, 243, 0.95)` : "";
      sp.classList.toggle("iel-focus", j === focus);
    }
  }
  function describeFocus() {
    const toks = tokens();
    const vals = asFloat32(model.get("pattern"));
    const n = toks.length;
    const L = model.get("layer"), H = model.get("head");
    if (cell && vals.length === n * n) {
      const [q, k] = cell;
      readout.textContent = `L${L} H${H}: query ${q} ${JSON.stringify(toks[q])} → key ${k} ${JSON.stringify(toks[k])}: ${vals[q * n + k].toFixed(4)}`;
    } else if (focus >= 0) {
      let best = 0;
      for (let j = 0; j < n; j++) if (vals[focus * n + j] > vals[focus * n + best]) best = j;
      readout.textContent = `L${L} H${H}: token ${focus} ${JSON.stringify(toks[focus])} attends most to ${best} ${JSON.stringify(toks[best])} (${(vals[focus * n + best] || 0).toFixed(3)}). Pink: what it attends to; blue underline: what attends to it.`;
    } else {
      readout.textContent = `L${L} H${H}: hover a token or a cell. Rows are queries, columns keys.`;
    }
  }
  function refreshAll() {
    const n = tokens().length;
    title.replaceChildren(h("b", { text: "attention" }), ` · ${model.get("title")} · ${plural(model.get("tokens").length, "token")} · ${plural(model.get("n_heads"), "head")} · showing layer ${model.get("layer")}, head ${model.get("head")}`);
    if (layerSel.options.length !== model.get("layers").length) {
      layerSel.replaceChildren(...model.get("layers").map((L) => h("option", { value: String(L), text: String(L) })));
    }
    layerSel.value = String(model.get("layer"));
    if (focus >= n) focus = -1;
    drawThumbs();
    drawPattern();
    drawStrip();
    describeFocus();
    drawLegend();
  }
  function request(layer, head2) {
    pending = [layer, head2];
    root.classList.add("iel-busy");
    model.send({ cmd: "select", layer, head: head2 });
  }
  thumbs.addEventListener("click", (e) => {
    const b = e.target.closest(".iel-thumb");
    if (b) request(model.get("layer"), Number(b.dataset.head));
  });
  thumbs.addEventListener("keydown", (e) => {
    const b = e.target.closest(".iel-thumb");
    if (!b) return;
    const k = Number(b.dataset.head), n = model.get("n_heads");
    const perRow = Math.max(1, Math.floor(thumbs.clientWidth / (b.offsetWidth + 6)) || 8);
    let to = null;
    if (e.key === "ArrowRight") to = Math.min(n - 1, k + 1);
    else if (e.key === "ArrowLeft") to = Math.max(0, k - 1);
    else if (e.key === "ArrowDown") to = Math.min(n - 1, k + perRow);
    else if (e.key === "ArrowUp") to = Math.max(0, k - perRow);
    else if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      request(model.get("layer"), k);
      return;
    } else return;
    e.preventDefault();
    e.stopPropagation();
    const t = thumbs.children[to];
    for (const x of thumbs.children) x.setAttribute("tabindex", "-1");
    t.setAttribute("tabindex", "0");
    t.focus();
  });
  layerSel.addEventListener("change", () => request(Number(layerSel.value), model.get("head")));
  scaleSel.addEventListener("change", () => {
    drawPattern();
    drawLegend();
  });
  canvas.addEventListener("mousemove", (e) => {
    const { n, margin, cellPx } = geometry();
    const r = canvas.getBoundingClientRect();
    const q = Math.floor((e.clientY - r.top - margin) / cellPx), k = Math.floor((e.clientX - r.left - margin) / cellPx);
    if (q >= 0 && q < n && k >= 0 && k < n) {
      cell = [q, k];
      focus = q;
    } else {
      cell = null;
    }
    drawPattern();
    drawStrip();
    describeFocus();
  });
  canvas.addEventListener("mouseleave", () => {
    cell = null;
    drawPattern();
    describeFocus();
  });
  canvas.addEventListener("keydown", (e) => {
    const n = tokens().length;
    if (e.key === "ArrowDown") focus = Math.min(n - 1, focus + 1);
    else if (e.key === "ArrowUp") focus = Math.max(0, focus - 1);
    else return;
    e.preventDefault();
    e.stopPropagation();
    cell = null;
    drawPattern();
    drawStrip();
    describeFocus();
  });
  const onTok = (e) => {
    const sp = e.target.closest(".iel-tok");
    if (!sp) return;
    focus = Number(sp.dataset.i);
    cell = null;
    drawPattern();
    drawStrip();
    describeFocus();
  };
  strip.addEventListener("mouseover", onTok);
  strip.addEventListener("focusin", onTok);
  const onPattern = () => {
    pending = null;
    root.classList.remove("iel-busy");
    refreshAll();
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
  model.on("change:pattern", onPattern);
  model.on("change:thumbs", onPattern);
  model.on("change:error", onError);
  model.on("msg:custom", onMsg);
  const onTheme = () => requestAnimationFrame(() => drawPattern());
  const themeObs = new MutationObserver(onTheme);
  themeObs.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-name", "data-jp-theme-light", "class"] });
  const media = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;
  if (media && media.addEventListener) media.addEventListener("change", onTheme);
  let lastWidth = -1;
  const sizeObs = new ResizeObserver(() => {
    const w = main.clientWidth;
    if (w !== lastWidth) {
      lastWidth = w;
      drawPattern();
    }
  });
  sizeObs.observe(main);
  refreshAll();
  return () => {
    themeObs.disconnect();
    sizeObs.disconnect();
    if (media && media.removeEventListener) media.removeEventListener("change", onTheme);
    model.off("change:pattern", onPattern);
    model.off("change:thumbs", onPattern);
    model.off("change:error", onError);
    model.off("msg:custom", onMsg);
  };
}
var attention_default = { render };
export {
  attention_default as default
};
