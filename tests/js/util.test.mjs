// Unit tests for the panels' pure helpers: `node --test tests/js/`
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  addressOf, asFloat32, debounce, diffTokens, fillLayer, firstDivergence, layoutBlock, makeLut, patternPixels,
  plural, pointOrder, servedAt, showToken, snippet, toByte,
} from "../../widgets/util.js";

const PLAIN = { parallel_block: false, sandwich_norms: false, pre_norms: true, gated_mlp: true, qk_norm: false, attn_gate: false, n_streams: 1, moe_layers: [] };

test("diffTokens marks only what changed, both sides", () => {
  const d = diffTokens([1, 2, 3, 4], [1, 9, 3, 4, 5]);
  assert.deepEqual(d.a, ["same", "removed", "same", "same"]);
  assert.deepEqual(d.b, ["same", "added", "same", "same", "added"]);
  assert.deepEqual(diffTokens([], [7]).b, ["added"]);
  assert.deepEqual(diffTokens([1, 2], [1, 2]), { a: ["same", "same"], b: ["same", "same"] });
  assert.equal(firstDivergence([1, 2, 3], [1, 2, 4]), 2);
});

test("debounce: the latest call wins, earlier ones never fire", () => {
  const pending = new Map(); let id = 0;
  const timers = { set: (fn) => { pending.set(++id, fn); return id; }, clear: (h) => pending.delete(h) };
  const calls = [];
  const f = debounce((x) => calls.push(x), 30, timers);
  f(1); f(2); f(3);
  assert.equal(pending.size, 1);
  for (const [h, fn] of [...pending]) { pending.delete(h); fn(); }
  assert.deepEqual(calls, [3]);
  f(4); f.flush();
  assert.equal(pending.size, 0);
});

test("colour scale: bytes in range, sqrt brightens faint weights, NaN is dark", () => {
  assert.equal(toByte(0), 0); assert.equal(toByte(1), 255); assert.equal(toByte(NaN), 0); assert.equal(toByte(2), 255);
  assert.ok(toByte(0.01, "sqrt") > toByte(0.01, "linear"));
  const lut = makeLut();
  assert.equal(lut.length, 768);
  const px = patternPixels(new Float32Array([1, 0, 0.5, 0.5]), 2, 2, "row", lut);
  assert.equal(px.length, 16);
  assert.deepEqual([...px.slice(8, 11)], [...px.slice(12, 15)]); // equal weights in a row look the same
  assert.deepEqual([...px.slice(0, 3)], [...lut.slice(765, 768)]); // row max is the top colour
});

test("asFloat32 reads unaligned views by copying", () => {
  const src = new Float32Array([0.25, 0.5]);
  const bytes = new Uint8Array(9); bytes.set(new Uint8Array(src.buffer), 1);
  const view = new DataView(bytes.buffer, 1, 8);
  assert.deepEqual([...asFloat32(view)], [0.25, 0.5]);
  assert.deepEqual([...asFloat32(src.buffer)], [0.25, 0.5]);
});

test("layout: sequential pre-norm block in forward order", () => {
  const order = pointOrder(layoutBlock(PLAIN));
  const at = (n) => order.indexOf(n);
  assert.ok(at("embeddings") < at("resid_pre") && at("resid_pre") < at("attn_in") && at("attn_in") < at("attn_probs"));
  assert.ok(at("attn_out") < at("resid_mid") && at("resid_mid") < at("mlp_in") && at("mlp_act") < at("mlp_out"));
  assert.ok(at("mlp_out_post") < at("resid_post") && at("resid_post") < at("final_norm") && at("final_norm") < at("lm_head"));
  assert.equal(at("q_norm_in"), -1); assert.equal(at("router_logits"), -1);
});

test("layout: parallel block has no resid_mid and two branch columns", () => {
  const lay = layoutBlock({ ...PLAIN, parallel_block: true });
  const names = pointOrder(lay);
  assert.ok(!names.includes("resid_mid"));
  const cols = new Set(lay.items.filter((i) => i.kind === "point" && i.name === "mlp_in" || i.name === "attn_in").map((i) => i.col));
  assert.deepEqual([...cols].sort(), [1, 2]);
  assert.equal(lay.items.filter((i) => i.kind === "join").length, 1);
});

test("layout: sandwich norms, QK-norm, MoE, gate and streams appear when the structure has them", () => {
  const lay = layoutBlock({ ...PLAIN, sandwich_norms: true, qk_norm: true, attn_gate: true, n_streams: 4 }, true);
  const names = pointOrder(lay);
  for (const n of ["q_norm_in", "k_norm_out", "attn_gate", "router_logits", "expert_weights", "resid_streams", "attn_stream_collapse"]) assert.ok(names.includes(n), n);
  assert.ok(!names.includes("mlp_act"));
  const mods = lay.items.filter((i) => i.kind === "module").map((i) => i.label);
  assert.ok(mods.includes("post-attention norm") && mods.includes("post-MLP norm"));
  const known = new Set(["resid_pre", "resid_post"]);
  assert.deepEqual(pointOrder(layoutBlock(PLAIN, false, known)), ["resid_pre", "resid_post"]);
});

test("layout: latent attention draws its latents and k_nope; plain attention does not", () => {
  const names = pointOrder(layoutBlock({ ...PLAIN, q_latent: true, kv_latent: true }));
  for (const n of ["q_latent", "kv_latent", "k_nope"]) assert.ok(names.includes(n), n);
  assert.ok(names.indexOf("kv_latent") < names.indexOf("k_nope") && names.indexOf("k_nope") < names.indexOf("attn_scores"));
  const kvOnly = pointOrder(layoutBlock({ ...PLAIN, kv_latent: true }));
  assert.ok(!kvOnly.includes("q_latent") && kvOnly.includes("kv_latent"));
  const plain = pointOrder(layoutBlock(PLAIN));
  for (const n of ["q_latent", "kv_latent", "k_nope"]) assert.ok(!plain.includes(n), n);
});

test("layout: a mixer layer draws the states it leaves, only on the layers that have them", () => {
  const st = { ...PLAIN, mixer_layers: [0, 1], mixer_kinds: ["mamba", "mlstm"], state_layers: [0, 1], conv_state_layers: [0] };
  const l0 = pointOrder(layoutBlock(st, false, null, 0));
  assert.ok(l0.includes("mixer_state") && l0.includes("mixer_conv_state") && l0.includes("mixer_out"));
  const l1 = pointOrder(layoutBlock(st, false, null, 1));
  assert.ok(l1.includes("mixer_state") && !l1.includes("mixer_conv_state"));
  const attnLayer = pointOrder(layoutBlock(st, false, null, 2));
  assert.ok(!attnLayer.includes("mixer_state") && attnLayer.includes("attn_probs"));
});

test("cards: addresses, served flags, names and snippets", () => {
  const p = { name: "mlp_out", scope: "layer", served: "01", why: { 0: "absent here" }, shape: "[batch, seq, 64]" };
  assert.equal(addressOf(p, 3), "mlp_out.3");
  assert.equal(addressOf({ name: "lm_head", scope: "trunk" }, 3), "lm_head");
  assert.deepEqual(servedAt(p, 0), { ok: false, why: "absent here" });
  assert.deepEqual(servedAt(p, 1), { ok: true, why: "" });
  assert.equal(fillLayer("blocks.{L}.hook_mlp_out", 7), "blocks.7.hook_mlp_out");
  assert.equal(fillLayer("", 7), "");
  assert.match(snippet(p, 1), /s\.capture\(.*\["mlp_out\.1"\]\)\ncache\["mlp_out\.1"\]\.shape  # \[batch, seq, 64\]/);
  // issue 33: the snippet names the variable the user has (the kernel finds it), never an undefined `lm`
  assert.match(snippet(p, 1, { var: "g", kind: "session" }), /^cache = g\.capture\(/);
  assert.match(snippet(p, 1, { var: "model", kind: "model" }), /^cache = ie_lab\.capture\(model,/);
  const fam = snippet(p, 1, { var: "s", kind: "family" }, "gemma2");
  assert.match(fam, /^s = ie_lab\.Session\(.*gemma2.*\ncache = s\.capture\(/);
  assert.ok(!/\blm\b/.test(fam + snippet(p, 1)));
  assert.equal(showToken(" the"), "·the"); assert.equal(showToken("\n"), "↵"); assert.equal(showToken(""), "∅");
});

test("debounce with the real clock (default timers must not lose their this)", async () => {
  const calls = [];
  const f = debounce((x) => calls.push(x), 5);
  f(1); f(2);
  await new Promise((r) => setTimeout(r, 30));
  assert.deepEqual(calls, [2]);
});

test("counts read in the right number (issue 33: \"1 features\")", () => {
  assert.equal(plural(1, "feature"), "1 feature");
  assert.equal(plural(2, "feature"), "2 features");
  assert.equal(plural(0, "head"), "0 heads");
  assert.equal(plural(1, "greedy token"), "1 greedy token");
});
