// The graph panel's supernodes (node --test): a group is one box whose edges are its members' edges summed, an edge
// inside the group is not drawn, and the other edges are left as they are.
import { test } from "node:test";
import assert from "node:assert/strict";
import { visible } from "../../widgets/graph.js";

const nodes = ["emb:0", "feat:0:0:1", "feat:0:0:2", "feat:1:0:3", "logit:7"].map((id, i) => ({ i, id }));
const edges = [
  { src: 0, dst: 1, w: 1.5 }, { src: 0, dst: 2, w: -0.5 }, // embedding -> each member: summed to 1.0
  { src: 1, dst: 2, w: 9 }, // inside the group: not drawn
  { src: 1, dst: 3, w: 0.25 }, { src: 2, dst: 3, w: 0.5 }, // members -> feature: 0.75
  { src: 3, dst: 4, w: -2 }, // untouched
];

test("a supernode's edges are its members' edges summed; edges inside it are not drawn", () => {
  const v = visible({ nodes, edges, supernodes: { pair: ["feat:0:0:1", "feat:0:0:2"] } });
  const got = Object.fromEntries(v.edges.map((e) => [e.a + ">" + e.b, e.w]));
  assert.deepEqual(got, { "n:0>g:pair": 1.0, "g:pair>n:3": 0.75, "n:3>n:4": -2 });
  assert.deepEqual(v.groups.pair.map((n) => n.id), ["feat:0:0:1", "feat:0:0:2"]);
});

test("with no supernode every edge is drawn as it is", () => {
  const v = visible({ nodes, edges, supernodes: {} });
  assert.equal(v.edges.length, edges.length);
  assert.deepEqual(v.edges.map((e) => e.w), edges.map((e) => e.w));
});
