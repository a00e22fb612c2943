// The attention pattern's size for 10 to 256 tokens at the widths a notebook gives (node --test).
import { test } from "node:test";
import assert from "node:assert/strict";
import { patternGeometry } from "../../widgets/util.js";

test("pattern geometry: square cells that fit the width, every token labelled while cells reach 12 px", () => {
  for (const width of [420, 700, 1000, 1600]) {
    for (const n of [10, 24, 41, 64, 128, 256]) {
      const g = patternGeometry(n, width);
      assert.ok(g.size + g.margin <= width, `${n} tokens overflow ${width} px: ${g.size + g.margin}`);
      assert.ok(g.cellPx >= 1 && g.cellPx <= 28);
      assert.ok(Math.abs(g.size - g.cellPx * n) < 1e-9);
      if (g.labels) assert.ok(g.cellPx >= 12 && g.font >= 10 && g.font <= g.cellPx, `${n} @ ${width}: ${g.cellPx}`);
    }
  }
  // 41 tokens in a JupyterLab cell (~1000 px): labelled, cells big enough to read, not a 240 px corner
  const g = patternGeometry(41, 1000);
  assert.ok(g.labels && g.cellPx >= 14 && g.size >= 500, JSON.stringify(g));
  // a short prompt is not blown up, a long one uses the width
  assert.equal(patternGeometry(10, 1000).cellPx, 28);
  assert.ok(patternGeometry(256, 1000).size >= 700);
});
