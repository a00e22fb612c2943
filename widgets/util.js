// Pure helpers shared by the panels (no DOM access at import time). Unit-tested in tests/js/.

export const VIRIDIS_STOPS = [
  [68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [109, 205, 89], [180, 222, 44], [253, 231, 37],
];

/** A 256-entry RGB lookup table interpolated from colour stops. */
export function makeLut(stops = VIRIDIS_STOPS) {
  const lut = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const t = (i / 255) * (stops.length - 1);
    const a = Math.floor(t), b = Math.min(stops.length - 1, a + 1), f = t - a;
    for (let c = 0; c < 3; c++) lut[i * 3 + c] = Math.round(stops[a][c] * (1 - f) + stops[b][c] * f);
  }
  return lut;
}

/** Map a value in [0, 1] to a byte after a display scale: "linear", "sqrt" or "row" (already row-normalised). */
export function toByte(v, scale = "linear") {
  if (!(v > 0)) return 0;
  const x = scale === "sqrt" ? Math.sqrt(Math.min(1, v)) : Math.min(1, v);
  return Math.round(x * 255);
}

/** RGBA pixels for an n x m matrix of probabilities under a display scale. */
export function patternPixels(values, rows, cols, scale = "linear", lut = makeLut()) {
  const out = new Uint8ClampedArray(rows * cols * 4);
  for (let i = 0; i < rows; i++) {
    let rowMax = 0;
    if (scale === "row") for (let j = 0; j < cols; j++) rowMax = Math.max(rowMax, values[i * cols + j]);
    for (let j = 0; j < cols; j++) {
      let v = values[i * cols + j];
      if (scale === "row") v = rowMax > 0 ? v / rowMax : 0;
      const b = toByte(v, scale === "row" ? "linear" : scale);
      const o = (i * cols + j) * 4;
      out[o] = lut[b * 3]; out[o + 1] = lut[b * 3 + 1]; out[o + 2] = lut[b * 3 + 2]; out[o + 3] = 255;
    }
  }
  return out;
}

/**
 * Size of the attention pattern for n tokens in a panel `avail` px wide: square cells, as large as the width allows
 * (up to 28 px), beside the token list when that leaves cells as large as they need, else the list goes below.
 * Every token is labelled on both axes while cells can be 12 px or more (labels up to 13 px); beyond that the
 * labels are in the read-out and the cells shrink to fit the width (below 2 px, fractional).
 */
export function patternGeometry(n, avail) {
  n = Math.max(1, n);
  const width = Math.max(320, avail || 640);
  const LABEL_MARGIN = 80, SIDE = 314; // room for 10-character labels; the token list column and its gap
  const labels = (width - LABEL_MARGIN - 8) / n >= 12;
  const margin = labels ? LABEL_MARGIN : 4;
  let usable = width - margin - 8;
  if (usable - SIDE >= n * (labels ? 12 : 4)) usable -= SIDE;
  // whole pixels keep cells crisp; below 2 px a fraction still fits 256 tokens in a narrow panel (hover reads them)
  const cellPx = usable / n >= 2 ? Math.min(28, Math.floor(usable / n)) : Math.max(1, usable / n);
  const font = Math.max(10, Math.min(13, cellPx - 2));
  return { n, labels, margin, cellPx, size: cellPx * n, font };
}

/** A Float32Array over a binary trait (DataView, ArrayBuffer or typed array), copying when unaligned. */
export function asFloat32(buf) {
  if (!buf) return new Float32Array(0);
  const bytes = buf instanceof ArrayBuffer ? new Uint8Array(buf)
    : new Uint8Array(buf.buffer, buf.byteOffset || 0, buf.byteLength);
  if (bytes.byteOffset % 4 === 0 && bytes.byteLength % 4 === 0) {
    return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  }
  return new Float32Array(bytes.slice().buffer, 0, Math.floor(bytes.byteLength / 4));
}

export function asBytes(buf) {
  if (!buf) return new Uint8Array(0);
  if (buf instanceof ArrayBuffer) return new Uint8Array(buf);
  return new Uint8Array(buf.buffer, buf.byteOffset || 0, buf.byteLength);
}

/** Debounce with an injectable clock (tests pass fake timers). The latest call wins. */
export function debounce(fn, ms, timers = { set: (f, t) => setTimeout(f, t), clear: (h) => clearTimeout(h) }) {
  let handle = null;
  const wrapped = (...args) => {
    if (handle !== null) timers.clear(handle);
    handle = timers.set(() => { handle = null; fn(...args); }, ms);
  };
  wrapped.flush = () => { if (handle !== null) { timers.clear(handle); handle = null; } };
  return wrapped;
}

/**
 * Token-level difference of two token lists (longest common subsequence of ids or strings).
 * Returns {a: [...], b: [...]} with one mark per token: "same", or "removed" (only in a) / "added" (only in b).
 */
export function diffTokens(a, b) {
  const n = a.length, m = b.length;
  const L = Array.from({ length: n + 1 }, () => new Uint16Array(m + 1));
  for (let i = n - 1; i >= 0; i--)
    for (let j = m - 1; j >= 0; j--)
      L[i][j] = a[i] === b[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  const ma = new Array(n).fill("removed"), mb = new Array(m).fill("added");
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (a[i] === b[j]) { ma[i] = "same"; mb[j] = "same"; i++; j++; }
    else if (L[i + 1][j] >= L[i][j + 1]) i++;
    else j++;
  }
  return { a: ma, b: mb };
}

/** Index of the first position where two lists differ (length of the common prefix). */
export function firstDivergence(a, b) {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return i;
}

/**
 * A refused value in an input: the input shows an error state (aria-invalid, outlined in the error colour, the
 * reason as its tooltip), the panel's alert line says why, and the input takes back `lastGood` (the value in
 * effect) when one is given. The error state clears at the next edit.
 */
export function refuse(input, message, errorEl, lastGood) {
  input.setAttribute("aria-invalid", "true");
  input.classList.add("iel-invalid");
  input.title = message;
  if (errorEl) errorEl.textContent = message;
  if (lastGood !== undefined && lastGood !== null) input.value = String(lastGood);
  const clear = () => {
    input.removeAttribute("aria-invalid"); input.classList.remove("iel-invalid"); input.title = "";
    input.removeEventListener("input", clear);
  };
  input.addEventListener("input", clear);
}

/** Clear every refused mark in a panel: a later command was accepted, and the alert line it went with is cleared. */
export function clearRefused(root) {
  for (const e of root.querySelectorAll('[aria-invalid="true"]')) {
    e.removeAttribute("aria-invalid"); e.classList.remove("iel-invalid"); e.title = "";
  }
}

/** "1 feature", "2 features": a count with its noun in the right number. */
export function plural(n, one, many = one + "s") {
  return `${n} ${Number(n) === 1 ? one : many}`;
}

/** A whole number typed in a number box, or null (empty, a fraction, text). */
export function wholeNumber(text) {
  const t = String(text).trim();
  return /^-?\d+$/.test(t) ? Number(t) : null;
}

/** A token as it should read on screen: visible spaces and newlines, never empty. */
export function showToken(t) {
  if (t === "") return "∅";
  return t.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/^ /, "·").replace(/^Ġ/, "·").replace(/^▁/, "·");
}

/** Fill "{L}" in another engine's name with a layer. */
export function fillLayer(template, layer) {
  return template ? template.split("{L}").join(String(layer)) : "";
}

/** The address text for a point at a layer (trunk points take none). */
export function addressOf(point, layer) {
  return point.scope === "trunk" ? point.name : `${point.name}.${layer}`;
}

/** Whether a point is served at a layer, and the reason when it is not. */
export function servedAt(point, layer) {
  const idx = point.scope === "trunk" ? 0 : layer;
  const ok = point.served.charAt(idx) === "1";
  return { ok, why: ok ? "" : (point.why[String(idx)] || "not served here") };
}

/**
 * The copyable snippet for a point. handle: {var, kind} from the kernel: the variable the user's code holds the
 * session in ("session": var.capture), a model from ie_lab.load ("model": ie_lab.capture(var, ...)), or no model
 * yet ("family": a first line that makes the session the snippet names). A string is a session's variable.
 */
export function snippet(point, layer, handle = { var: "s", kind: "session" }, family = "") {
  const h = typeof handle === "string" ? { var: handle, kind: "session" } : handle;
  const a = addressOf(point, layer);
  const text = `"When Mary and John went to the store,"`;
  const lines = [];
  if (h.kind === "family") lines.push(`${h.var} = ie_lab.Session("path/or/hub-id")  # any ${family || "such"} model`);
  lines.push(h.kind === "model" ? `cache = ie_lab.capture(${h.var}, ${text}, ["${a}"])` : `cache = ${h.var}.capture(${text}, ["${a}"])`);
  lines.push(`cache["${a}"].shape  # ${point.shape}`);
  return lines.join("\n");
}

/**
 * Layout of one decoder block, in forward order, for the picker's SVG.
 * structure: {parallel_block, sandwich_norms, pre_norms, gated_mlp, qk_norm, attn_gate, n_streams, parallel_norms
 * ("shared" | "separate" | "none"), attn_labels (per layer), embed_label}, moe: this layer is MoE, layer: which layer.
 * Labels come from the kernel's facts (attn_labels, embed_label); the fallbacks claim nothing about positions.
 * Returns {items, height}: items are {kind: "point"|"module"|"join"|"fork"|"trunk", name|label, col, y}.
 * col 0 is the residual spine; attention is col 1; the MLP is col 1 (sequential) or col 2 (parallel).
 */
export function layoutBlock(st, moe = false, names = null, layer = 0) {
  const has = (n) => names === null || names.has(n);
  const ROW = 24;
  const items = [];
  let y = 20;
  const push = (it) => { items.push(it); return it; };
  const multi = (st.n_streams || 1) > 1;
  const mixerAt = (st.mixer_layers || []).indexOf(layer);
  const mixerKind = mixerAt >= 0 ? st.mixer_kinds[mixerAt] : "";
  const noMlp = (st.no_mlp_layers || []).includes(layer);
  // a single-sublayer trunk's MLP-only block (Nemotron-H): no attention or mixer, its MLP is its one sublayer
  const mlpOnly = (st.mlp_only_layers || []).includes(layer);
  // trunk, top
  // A parallel block either shares one input norm across both branches or gives each branch its own.
  const sharedNorm = st.parallel_block && st.pre_norms && st.parallel_norms !== "separate";
  const branchNorms = st.pre_norms && !sharedNorm;
  push({ kind: "trunk", label: st.embed_label || "token embedding", col: 0, y }); y += ROW;
  const spine = (name) => { if (has(name)) { push({ kind: "point", name, col: 0, y }); y += ROW; } };
  spine("embeddings"); y += 6;
  const blockTop = y - 8;
  if (multi) spine("resid_streams");
  spine("resid_pre");

  // A branch column drawn top-down from y0: p adds a point (when the model has it), m a module; end() is the y after.
  const column = (col, y0) => {
    let yy = y0;
    return {
      p: (name) => { if (has(name)) { push({ kind: "point", name, col, y: yy }); yy += ROW; } },
      m: (label, role) => { push({ kind: "module", label, role, col, y: yy }); yy += ROW; },
      end: () => yy,
    };
  };
  const attn = (col, y0) => {
    const { p, m, end } = column(col, y0);
    if (multi) p("attn_stream_collapse");
    if (branchNorms) m(st.parallel_block ? "input norm (attention branch)" : "input norm", "norm");
    p("attn_in");
    if (st.q_latent || st.kv_latent) {
      // latent attention: queries and keys/values come out of compressed latents, up-projected per head
      if (st.q_latent) { m("q_a_proj (down) · norm", "linear"); p("q_latent"); }
      if (st.kv_latent) { m("kv_a_proj (down) · norm", "linear"); p("kv_latent"); }
      m(st.kv_latent ? "q_b_proj · kv_b_proj (up, per head)" : "q_b_proj (up, per head)", "linear");
      if (st.kv_latent) p("k_nope");
    } else if (st.qk_norm) {
      m("q_proj · k_proj", "linear");
      p("q_norm_in"); p("k_norm_in");
      m("q_norm · k_norm", "norm");
      p("q_norm_out"); p("k_norm_out");
    } else {
      m("q_proj · k_proj · v_proj", "linear");
    }
    p("value");
    m((st.attn_labels && st.attn_labels[layer]) || "attention (q·kᵀ, softmax)", "attn");
    p("attn_scores"); p("attn_probs"); p("z");
    if (st.attn_gate) p("attn_gate");
    m("o_proj", "linear");
    p("attn_out");
    if (st.sandwich_norms) m("post-attention norm", "norm");
    p("attn_out_post");
    if (multi) { p("attn_stream_write"); p("attn_stream_mix"); }
    return end();
  };
  // A hybrid or state-space trunk's mixer layer: its mixer block, labelled with the kind the model's facts name.
  const mixer = (col, y0) => {
    const { p, m, end } = column(col, y0);
    if (branchNorms) m("input norm", "norm");
    p("mixer_in");
    m(`${mixerKind} mixer`, "mixer");
    // the state the mixer leaves for the next forward (read from where the model keeps it, after the prompt)
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
      p("router_logits"); p("expert_weights"); p("expert_indices");
      m("experts (top-k, weighted sum)", "experts");
    } else if (st.gated_mlp) {
      m("gate_proj · up_proj", "linear");
      p("mlp_pre"); p("mlp_pre_linear");
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
    if (multi) { p("mlp_stream_write"); p("mlp_stream_mix"); }
    return end();
  };

  if (st.parallel_block) {
    push({ kind: "fork", col: 1, y: y - 10, to: noMlp ? [1] : [1, 2] });
    if (sharedNorm) { push({ kind: "module", label: "input norm (shared)", role: "norm", col: 1, span: 2, y }); y += ROW; }
    const end = Math.max((mixerKind ? mixer : attn)(1, y), noMlp ? y : mlp(2, y));
    y = end;
    push({ kind: "join", col: 0, y, from: noMlp ? [1] : [1, 2] }); y += ROW;
  } else if (mlpOnly) {
    push({ kind: "fork", col: 1, y: y - 10, to: [1] });
    y = mlp(1, y);
    push({ kind: "join", col: 0, y, from: [1] }); y += ROW;
  } else {
    push({ kind: "fork", col: 1, y: y - 10, to: [1] });
    y = (mixerKind ? mixer : attn)(1, y);
    push({ kind: "join", col: 0, y, from: [1] }); y += ROW;
    if (!noMlp) {
      spine("resid_mid");
      push({ kind: "fork", col: 1, y: y - 10, to: [1] });
      y = mlp(1, y);
      push({ kind: "join", col: 0, y, from: [1] }); y += ROW;
    }
  }
  spine("resid_post");
  const blockBottom = y - 8;
  y += 6;
  push({ kind: "module", label: "final norm", role: "norm", col: 0, y, trunk: true }); y += ROW;
  spine("final_norm");
  push({ kind: "module", label: "lm_head (unembedding)", role: "linear", col: 0, y, trunk: true }); y += ROW;
  spine("lm_head");
  return { items, height: y, blockTop, blockBottom };
}

/** What mixes tokens on a layer, for labels: "" on a trunk whose every layer is attention (drawn as before),
 * else "attention" / "sliding attention", or the mixer's kind from the model's facts with "(mixer)". */
export function layerKindLabel(spec, i) {
  const mixers = spec.layer_mixers || [];
  if (mixers.every((k) => k === "attention")) return "";
  if (mixers[i] === "mlp" || mixers[i] === "moe") return `${mixers[i] === "moe" ? "MoE" : "MLP"}-only block`;
  if (mixers[i] !== "attention") return `${mixers[i]} (mixer)`;
  return spec.layer_kinds[i] === "sliding" ? "sliding attention" : "attention";
}

/** Order in which keyboard navigation visits the points of a layout (forward order, left column first per row). */
export function pointOrder(layout) {
  return layout.items.filter((it) => it.kind === "point").sort((p, q) => p.y - q.y || p.col - q.col).map((it) => it.name);
}
