"""Widget latencies measured in a real browser (JupyterLab 4 + headless Chromium), written to results/widgets-cpu.json.

- slider change -> first steered token on screen (the bundled demo model; includes the panel's 30 ms debounce);
- bytes on the kernel websocket for one head's attention at 512 tokens x 32 heads (and the float32 payload);
- picker render time for a 40-layer model (render() entry to the next animation frame).

Run: python benchmarks/widgets_latency.py   (then python benchmarks/render.py)
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.widgets_harness import Server, setup_code  # noqa: E402

REPEATS = 15
CELLS = [
    setup_code("llama"),
    "sd = ie_lab.Session(ie_lab.DEMO_MODEL, device='cpu', progress=False)\n"
    "sp = sd.steering_panel('One morning , Mary went to the park .', "
    "vector=torch.randn(128, generator=torch.Generator().manual_seed(0)), scale=0.0, max_new_tokens=8); sp",
    # 512 tokens x 32 heads: a tiny Llama with 32 heads of 8 and room for 1024 positions
    "from transformers import LlamaConfig, AutoModelForCausalLM\n"
    "cfg = LlamaConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=32, head_dim=8,\n"
    "                  num_key_value_heads=8, intermediate_size=256, max_position_embeddings=1024)\n"
    "torch.manual_seed(0); big = ie_lab.Session(AutoModelForCausalLM.from_config(cfg).eval(), tokenizer=t, progress=False)\n"
    "ids = torch.randint(4, 512, (1, 512), generator=torch.Generator().manual_seed(0))\n"
    "a = big.show_attention(ids, layers=[0, 1]); a",
    "p40 = ie_lab.cheatsheet({'model_type': 'llama', 'hidden_size': 4096, 'num_hidden_layers': 40, "
    "'num_attention_heads': 32, 'num_key_value_heads': 8, 'intermediate_size': 14336, 'vocab_size': 128256}); p40",
    "p40b = ie_lab.cheatsheet({'model_type': 'qwen3_moe', 'hidden_size': 2048, 'num_hidden_layers': 40, "
    "'num_attention_heads': 32, 'num_key_value_heads': 4, 'num_experts': 64}); p40b",
]


def main() -> dict:
    srv = Server()
    try:
        srv.write("bench.ipynb", CELLS)
        frames: list[int] = []
        page = srv.browser.new_page(viewport={"width": 1300, "height": 1000})

        def on_ws(ws):
            if "/channels" in ws.url:
                ws.on("framereceived", lambda payload: frames.append(len(payload)))

        page.on("websocket", on_ws)
        srv.browser_page = page
        page.goto(f"{srv.base}/lab/tree/bench.ipynb?reset&token={srv.token}")
        page.wait_for_function(
            "() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
            timeout=90000,
        )
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        srv.wait_cells(page, timeout=300)
        for sel in (".iel-steer .iel-text", ".iel-attn canvas.iel-pattern", ".iel-picker svg"):
            page.wait_for_selector(sel, timeout=60000)

        # 1. slider -> first steered token on screen
        lat = []
        for i in range(REPEATS):
            page.wait_for_function(
                "() => !document.querySelector('.iel-steer').classList.contains('iel-busy')", timeout=30000
            )
            page.wait_for_timeout(100)
            t = page.evaluate(
                """(v) => new Promise((resolve) => {
                const root = document.querySelector('.iel-steer');
                const r = root.querySelector('input[data-knob="scale"]');
                const t0 = performance.now();
                r.value = String(v); r.dispatchEvent(new Event('input', {bubbles: true}));
                const poll = () => { const f = Number(root.dataset.firstTokenAt || 0);
                  if (f > t0) resolve(f - t0); else requestAnimationFrame(poll); };
                poll();
            })""",
                1.0 + i * 0.5,
            )
            lat.append(t)

        # 2. one head's attention payload at 512 tokens
        page.wait_for_timeout(500)
        view = page.locator(".iel-attn")
        frames.clear()
        view.locator('.iel-thumb[data-head="7"]').click()
        page.wait_for_selector('.iel-attn .iel-thumb.iel-sel[data-head="7"]', timeout=30000)
        page.wait_for_timeout(300)
        ws_bytes = sum(frames)
        payload = int(srv.execute(page, "print(len(a.pattern))"))
        n_tokens = int(srv.execute(page, "print(len(a.tokens))"))
        srv.shot(view, "attention-512x32.png")

        # 3. picker render for 40 layers (two models: dense and MoE)
        render_ms = [
            float(x)
            for x in page.evaluate("() => [...document.querySelectorAll('.iel-picker')].map(e => e.dataset.renderMs)")
        ]
        rerender = []
        for _ in range(5):  # re-render on layer change (same code path as a first render's diagram)
            rerender.append(
                page.evaluate("""() => new Promise((resolve) => {
                const sel = document.querySelectorAll('.iel-picker select')[0];
                const t0 = performance.now();
                sel.value = String((Number(sel.value) + 1) % 40); sel.dispatchEvent(new Event('change'));
                requestAnimationFrame(() => resolve(performance.now() - t0)); })""")
            )
        srv.shot(page.locator(".iel-picker").first, "picker-40-layers.png")
        srv.close_page(page)
    finally:
        srv.close()
    return {
        "benchmark": "widgets",
        "device": "cpu (headless Chromium, JupyterLab 4)",
        "threads": 1,
        "date": datetime.date.today().isoformat(),
        "repeats": REPEATS,
        "slider_to_first_token_ms": {
            "median": statistics.median(lat),
            "p90": sorted(lat)[int(0.9 * (len(lat) - 1))],
            "max": max(lat),
            "target": 150,
        },
        "attention_head": {
            "tokens": n_tokens,
            "heads": 32,
            "payload_bytes": payload,
            "websocket_bytes": ws_bytes,
            "target_bytes": 1.1e6,
        },
        "picker_render_ms": {
            "layers": 40,
            "first_render": render_ms,
            "layer_switch_median": statistics.median(rerender),
            "target": 200,
        },
    }


if __name__ == "__main__":
    r = main()
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "widgets-cpu.json"), "w") as f:
        json.dump(r, f, indent=1)
    print(json.dumps(r, indent=1))
