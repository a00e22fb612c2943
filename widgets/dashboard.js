// Feature dashboard panel: one SAE feature's contexts, histogram, logits and steering, drawn by dashboard_view.js from
// the panel's traits (numbers as binary buffers). Switching feature (the number box, or the list of the corpus's
// strongest features) asks the kernel, which sends the new feature's data.
import { asFloat32, clearRefused, plural, refuse, wholeNumber } from "./util.js";
import { drawFeature, featureList, h } from "./dashboard_view.js";

function asInt32(buf) {
  const f = asFloat32(buf); // the same bytes, read as int32
  return new Int32Array(f.buffer, f.byteOffset, f.length);
}

/** The panel's traits as the plain data drawFeature reads. */
export function fromTraits(model) {
  const lens = asInt32(model.get("ctx_len")), meta = asInt32(model.get("ctx_meta")), vals = asFloat32(model.get("ctx_values"));
  const toks = model.get("ctx_tokens");
  const contexts = [];
  let o = 0;
  lens.forEach((n, k) => {
    const values = Array.from(vals.subarray(o, o + n));
    contexts.push({ prompt: meta[3 * k], position: meta[3 * k + 1], at: meta[3 * k + 2], tokens: toks.slice(o, o + n),
      values, value: values[meta[3 * k + 2]] });
    o += n;
  });
  const lt = model.get("logit_tokens"), lv = asFloat32(model.get("logit_values")), np = model.get("n_promoted");
  const pairs = lt.map((t, i) => [t, lv[i]]);
  const prompt = model.get("steer_prompt");
  return {
    feature: model.get("feature"), address: model.get("address"), n_tokens: model.get("n_tokens"),
    n_fired: model.get("n_fired"), density: model.get("density"), max: model.get("max_act"), contexts,
    hist: { counts: Array.from(asInt32(model.get("hist_counts"))), edges: Array.from(asFloat32(model.get("hist_edges"))) },
    promoted: pairs.slice(0, np), suppressed: pairs.slice(np), logit_note: model.get("logit_note"),
    steering: prompt ? { prompt, scale: model.get("steer_scale"), baseline: model.get("baseline"), steered: model.get("steered") } : null,
    notes: model.get("notes") ? [model.get("notes")] : [],
  };
}

function render({ model, el }) {
  const root = h("div", { class: "iel-root iel-dash" });
  const num = h("input", { type: "number", min: "0", step: "1", class: "iel-num", "aria-label": "feature index" });
  const go = h("button", { class: "iel-btn", type: "button", text: "show" });
  const list = h("div", { class: "iel-feats", role: "listbox", "aria-label": "the corpus's strongest features" });
  const body = h("div", { class: "iel-dash-body" });
  const error = h("div", { class: "iel-error", role: "alert" });
  root.append(h("div", { class: "iel-row" }, h("label", {}, "feature ", num), go,
    h("span", { class: "iel-muted", text: `of ${plural(model.get("n_features"), "feature")} · strongest:` }), list), body, error);
  el.append(root);

  const request = (f) => { if (f === model.get("feature")) return; root.classList.add("iel-busy"); model.send({ cmd: "select", feature: f }); };
  function refresh() {
    root.classList.remove("iel-busy");
    const cur = model.get("feature");
    num.max = String(model.get("n_features") - 1);
    if (document.activeElement !== num) num.value = String(cur);
    const ids = asInt32(model.get("list_ids")), mx = asFloat32(model.get("list_max")), dn = asFloat32(model.get("list_density"));
    list.replaceChildren(...featureList(Array.from(ids, (id, i) => ({ id, max: mx[i], density: dn[i] })), cur));
    drawFeature(body, fromTraits(model));
  }
  list.addEventListener("click", (e) => { const b = e.target.closest(".iel-featbtn"); if (b) request(Number(b.dataset.f)); });
  let asked = false; // the number box's value is with the kernel: a refusal marks the box and puts back the feature shown
  go.addEventListener("click", () => {
    const f = wholeNumber(num.value), n = model.get("n_features");
    if (f === null || f < 0 || f >= n) {
      refuse(num, `${JSON.stringify(num.value.trim())} is not a feature here: features run from 0 to ${n - 1}; still showing ${model.get("feature")}.`, error, model.get("feature"));
      return;
    }
    asked = true; request(f);
  });
  num.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); go.click(); } });
  const onError = () => { error.textContent = model.get("error"); };
  const onMsg = (msg) => {
    if (!(msg && msg.type === "error")) return;
    error.textContent = msg.message; root.classList.remove("iel-busy");
    if (asked) refuse(num, msg.message, error, model.get("feature"));
    asked = false;
  };
  const onShown = () => { asked = false; clearRefused(root); refresh(); onError(); };
  model.on("change:feature", onShown);
  model.on("change:ctx_values", refresh);
  model.on("change:error", onError);
  model.on("msg:custom", onMsg);
  refresh();
  onError();
  return () => { model.off("change:feature", onShown); model.off("change:ctx_values", refresh); model.off("change:error", onError); model.off("msg:custom", onMsg); };
}

export default { render };
