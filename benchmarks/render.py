"""Render benchmarks/results/*.json into benchmarks/results-latest.md (generated; never edit by hand)."""

from __future__ import annotations

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _verdict(v: float, target: str) -> str:
    """'>= x', '<= x', 'a-b' or 'reported' (no verdict)."""
    if target.startswith(">="):
        return "met" if v >= float(target.split()[1]) else "**missed**"
    if target.startswith("<="):
        return "met" if v <= float(target.split()[1]) else "**missed**"
    if "-" in target and target[0].isdigit():
        lo, hi = (float(x) for x in target.split("-"))
        return "met" if lo <= v <= hi else "**missed**"
    return ""


def _ratio_rows(r: dict, digits: int) -> list[str]:
    out = ["", "| ratio | measured | target | verdict |", "| --- | ---: | --- | --- |"]
    for k, v in r["ratios"].items():
        t = r["targets"][k]
        shown = f"{v:.2f} ms" if k.endswith("(ms per call)") else f"{v:.{digits}f}"
        out.append(f"| {k} | {shown} | {t} | {_verdict(v, t)} |")
    return out + [""]


def _mb(v) -> str:
    return "" if v is None else f"{v:.1f} MB"


def _eager_batch(r: dict) -> list[str]:
    """eager_batch.py: each variant's time, its ratio to HF batched generate (median, fastest round), peak memory."""
    peak = r.get("peak_rss_growth_mb") or {}
    out = [
        f"## Eager batched generation, {r.get('model_key', 'bench20m')} ({r['device']}, {r['threads']} threads, "
        f"{r['date']})",
        "",
        f"{r['model']}; {r['prompts']}; {r['repeats']} interleaved repeats; every prompt's tokens checked equal to "
        "HF batched generate's and its solo run's first."
        + (
            " Peak memory: the process's RSS growth over its level before the variant (one untimed run each, "
            f"{r['rss_before_mb']:.0f} MB resident before)."
            if peak
            else " (Peak memory not measured in this run.)"
        ),
        "",
        "| variant | median | ratio vs HF batched (median) | fastest-round ratio | peak RSS growth | target | verdict |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for k, v in r["median_s"].items():
        ratio, target = r["ratio_vs_hf_batched"][k], r.get("target", {}).get(k)
        verdict = "" if target is None else ("met" if ratio <= target else "**missed**")
        out.append(
            f"| {k} | {v * 1000:.0f} ms | {ratio:.2f}x | {r['best_ratio_vs_hf_batched'][k]:.2f}x | "
            f"{_mb(peak.get(k))} | {'' if target is None else f'<= {target:.2f}x'} | {verdict} |"
        )
    return out + [""]


def _patch_sweep_batch(r: dict) -> list[str]:
    """patch_sweep_batch.py: one forward per cell vs batched cells, the speedup and each one's peak memory."""
    peak = r.get("peak_rss_growth_mb") or {}
    target = r.get("target_speedup")
    verdict = "" if target is None else ("met" if r["speedup"] >= target else "**missed**")
    out = [
        f"## Batched patch sweep, {r['model_key']} ({r['device']}, {r['threads']} threads, {r['date']})",
        "",
        f"{r['model']}; {r['grid']} ({r['cells']} cells); median of {r['repeats']} interleaved repeats after a "
        "warm-up; the grids checked equal to 1e-5 first. Peak memory: the process's RSS growth over its level "
        "before the variant (one untimed run each).",
        "",
        "| variant | median | peak RSS growth |",
        "| --- | ---: | ---: |",
        f"| one forward per cell (batch_size=1) | {_t(r['per_cell_s'])} | {_mb(peak.get('per_cell'))} |",
        f"| batched ({r['auto_batch_size']} cells per forward) | {_t(r['batched_s'])} | {_mb(peak.get('batched'))} |",
    ]
    if "prefix_s" not in r:
        return out + [
            "",
            "| ratio | measured | target | verdict |",
            "| --- | ---: | --- | --- |",
            f"| speedup, per-cell over batched | {r['speedup']:.2f}x | {'' if target is None else f'>= {target}x'} | "
            f"{verdict} |",
            "",
        ]
    # patch_sweep now (the cached prefix skipped, ie_lab/eager/sweep.py) beside the two whole-prompt variants
    return out + [
        f"| patch_sweep now: batched, the corrupted run's cached prefix skipped ({r['prefix_forwards']} forwards) | "
        f"{_t(r['prefix_s'])} | {_mb(peak.get('prefix'))} |",
        "",
        f"Load average (1, 5, 15 min) before {r['load_average_before']}, after {r['load_average_after']}.",
        "",
        "| ratio | measured | target | verdict |",
        "| --- | ---: | --- | --- |",
        f"| speedup, patch_sweep now over one forward per cell | {r['speedup']:.2f}x | "
        f"{'' if target is None else f'>= {target}x'} | {verdict} |",
        f"| speedup, previous batched sweep over one forward per cell | {r['batched_speedup']:.2f}x | | |",
        f"| speedup, patch_sweep now over the previous batched sweep | {r['prefix_over_batched']:.2f}x | | |",
        "",
    ]


def render() -> str:
    out = [
        "# Benchmark results",
        "",
        "<!-- generated by `python benchmarks/render.py` from benchmarks/results/*.json -->",
        "",
    ]
    for path in sorted(glob.glob(os.path.join(HERE, "results", "*.json"))):
        r = json.load(open(path))
        if r.get("benchmark") == "capture_overhead":
            out += [
                f"## Capture overhead ({r['device']}, {r['threads']} threads, {r['date']})",
                "",
                f"{r['model']}; one {r['prompt_tokens']}-token prompt; median of {r['repeats']} interleaved repeats "
                "after a warm-up. Ratios are against the bare forward in the same run.",
                "",
                "| variant | median | ratio vs bare forward | target |",
                "| --- | ---: | ---: | --- |",
            ]
            for k, v in r["median_s"].items():
                target = r.get("target", {}).get(k)
                ratio = r["ratio_vs_bare"][k]
                verdict = (
                    "" if target is None else (f"<= {target:.2f}x " + ("met" if ratio <= target else "**missed**"))
                )
                out.append(f"| {k} | {v * 1000:.1f} ms | {ratio:.3f}x | {verdict} |")
            out.append("")
        elif r.get("benchmark") == "attribution_graph":
            if r["threads"] == min(
                json.load(open(p))["threads"]
                for p in glob.glob(os.path.join(HERE, "results", "attribution_graph-*t-cpu.json"))
            ):  # one section for every thread count's file
                out += [f"## Attribution graphs vs circuit-tracer ({r['device']}, {r['date']})", ""]
                out += readme_attribution_graph() + [""]
        elif r.get("benchmark") == "generation":
            out += [
                f"## Generation ({r['device']}, {r['threads']} threads, {r['date']})",
                "",
                f"{r['model']}; median of {r['repeats']} interleaved repeats after a warm-up; every variant's "
                "tokens checked against HF greedy generate first.",
                "",
                "| variant | median |",
                "| --- | ---: |",
            ]
            out += [f"| {k} | {v * 1000:.0f} ms |" for k, v in r["median_s"].items()]
            out += _ratio_rows(r, 3)
        elif r.get("benchmark") == "vllm_generate":
            out += [
                f"## vLLM backend vs eager ({r['device']}, {r['threads']} thread(s), {r['date']})",
                "",
                f"{r['model']}; {r['vllm']}; {r['new_tokens']} new greedy tokens per request, 8 prompts "
                f"({r['tokens_8']} tokens in all); median of {r['repeats']} interleaved repeats after a warm-up; "
                "every vLLM request's tokens checked against eager's first.",
                "",
                "| variant | median | tok/s |",
                "| --- | ---: | ---: |",
            ]
            for k, v in r["median_s"].items():
                tps = r["tok_per_s"].get(k)
                out.append(f"| {k} | {v * 1000:.0f} ms | {'' if tps is None else f'{tps:.0f}'} |")
            out += _ratio_rows(r, 2)
        elif r.get("benchmark") == "session_threads":
            out += [
                f"## Session calls vs direct calls ({r['device']}, {r['threads']} threads, {r['date']})",
                "",
                f"{r['model']}; median of {r['repeats']} interleaved repeats after a warm-up, in one process "
                "whose main thread has an OpenMP pool (as in a notebook); outputs checked equal first. "
                "`benchmarks/session_threads.py` says why plain Session calls compute on the caller's thread.",
                "",
                "| variant | median |",
                "| --- | ---: |",
            ]
            out += [f"| {k} | {v * 1000:.1f} ms |" for k, v in r["median_s"].items()]
            out += _ratio_rows(r, 3)
        elif r.get("benchmark") == "eager_batch":
            out += _eager_batch(r)
        elif r.get("benchmark") == "patch_sweep_batch":
            out += _patch_sweep_batch(r)
        elif r.get("benchmark") == "widgets":
            sl, at, pk = r["slider_to_first_token_ms"], r["attention_head"], r["picker_render_ms"]
            out += [
                f"## Widgets ({r['device']}, {r['date']})",
                "",
                "Measured in the browser by `benchmarks/widgets_latency.py` (Playwright + Debian Chromium against a "
                "real JupyterLab server). The slider round trip uses the bundled demo model; the attention payload a "
                "random 32-head model at 512 tokens; the picker a 40-layer config (no weights).",
                "",
                "| measure | measured | target | verdict |",
                "| --- | ---: | --- | --- |",
                f"| slider change -> first steered token on screen (median of {r['repeats']}; p90 {sl['p90']:.0f} ms, "
                f"max {sl['max']:.0f} ms) | {sl['median']:.0f} ms | <= {sl['target']} ms | "
                f"{'met' if sl['median'] <= sl['target'] else '**missed**'} |",
                f"| one head's attention, {at['tokens']} tokens x {at['heads']} heads: websocket bytes (float32 "
                f"payload {at['payload_bytes']:,} B) | {at['websocket_bytes']:,} B | <= {at['target_bytes'] / 1e6:.1f} MB | "
                f"{'met' if at['websocket_bytes'] <= at['target_bytes'] else '**missed**'} |",
                f"| picker first render, {pk['layers']} layers (slowest of {len(pk['first_render'])}; layer switch "
                f"{pk['layer_switch_median']:.0f} ms) | {max(pk['first_render']):.0f} ms | <= {pk['target']} ms | "
                f"{'met' if max(pk['first_render']) <= pk['target'] else '**missed**'} |",
                "",
            ]
    for device in cell_devices():
        out += render_sidebyside(load_cells(device), device, headline=False)
    return "\n".join(out) + "\n"


# ---- the side-by-side matrix (benchmarks/run.py, one JSON cell per model x engine x workload) ----------------

SBS_WORKLOADS = [
    ("forward_512", "forward_512", "one forward, {forward_tokens} tokens"),
    ("capture_mid", "capture_mid", "forward capturing the middle layer's resid_post"),
    ("capture_all", "capture_all", "forward capturing every layer's resid_post"),
    ("generate", "generate", "{prompt_tokens}-token prompt, {new_tokens} greedy tokens"),
    ("generate_x8", "generate_x8", "8 such requests at once"),
    ("capture_gen", "capture_gen", "{short_new} tokens while capturing every resid_post"),
    ("steer", "steer", "{short_new} tokens steered at two layers"),
    ("lens_topk", "lens_topk", "logit lens, {lens_rows} rows to top-{lens_k}"),
    ("attention", "attention", "one layer's attention patterns, {forward_tokens} tokens"),
    ("widget_round_trip", "widget round trip", "slider change to first steered token on screen"),
]
SBS_ENGINES = [
    ("bare", "transformers + hand hook"),
    ("ie_eager", "ie_lab eager"),
    ("ie_vllm", "ie_lab vLLM"),
    ("ie_vllm_graph", "ie_lab vLLM graph mode"),
    ("interp", "interp-engine"),
    ("tl", "TransformerLens 4.3"),
    ("tl_nocache", "TL 4.3, no KV cache"),
    ("nnsight", "nnsight 0.8"),
]
SBS_PEERS = ["interp", "tl", "tl_nocache", "nnsight"]
GEN_WORKLOADS = {"generate", "generate_x8", "capture_gen", "steer"}


def cell_devices() -> list[str]:
    base = os.path.join(HERE, "results", "sidebyside")
    return sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d))) if os.path.isdir(base) else []


def load_cells(device: str) -> list[dict]:
    return [
        json.load(open(p)) for p in sorted(glob.glob(os.path.join(HERE, "results", "sidebyside", device, "*.json")))
    ]


def _t(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _index(cells):
    return {(c["model"], c["engine"], c["workload"]): c for c in cells}


def _models(cells):
    order = {"bench20m": 0, "demo": 1, "widget": 9}
    return sorted({c["model"] for c in cells if c["model"] != "widget"}, key=lambda m: (order.get(m, 5), m))


def _vs_bare(c, bare, base_w=None):
    """(time of cell c over bare transformers' time for base_w, True if both were timed in c's own process)."""
    base_w = base_w or c["workload"]
    inproc = (c.get("base_median_s") or {}).get(base_w)
    if inproc:
        return c["median_s"] / inproc, True
    if bare is not None and bare.get("status") == "ok" and bare.get("median_s"):
        return c["median_s"] / bare["median_s"], False
    return None, False


def _cell_text(c, bare, notes):
    if c is None:
        return "not run"
    st = c["status"]
    if st in ("n/a", "not run", "error"):
        reason = c.get("reason") or ""
        if reason not in notes:
            notes.append(reason)
        return f"{st} [{notes.index(reason) + 1}]"
    text = _t(c["median_s"])
    if c.get("tok_per_s"):
        text += f", {c['tok_per_s']:.0f} tok/s"
    if c["engine"] != "bare":
        r, inproc = _vs_bare(c, bare)
        if r is not None:
            text += f" ({r:.2f}x)" if inproc else f" ({r:.2f}x†)"
    load = max(c.get("load_average") or [0])
    if c.get("cpus") and load > c["cpus"]:  # measured while the machine had more runnable work than cores
        text += f" \u2021load {load:.0f}"
    if st == "WRONG":
        detail = c.get("check") or ""
        if detail not in notes:
            notes.append(detail)
        text = f"**WRONG** [{notes.index(detail) + 1}] {text}"
    return text


# (label, engine, workload, compared with (engine, workload), kind, factor). kind "time<=": the engine's time is at
# most factor x the other's; "speed>=": its throughput is at least factor x; "reported": shown without a verdict.
# Graph mode is opt-in, so it does not stand in for the default mode; its rows are reported beside it.
SBS_TARGETS = [
    (
        "ie_lab eager capture_all <= 1.10x bare forward",
        "ie_eager",
        "capture_all",
        ("bare", "forward_512"),
        "time<=",
        1.10,
    ),
    ("ie_lab eager capture_all <= every peer's", "ie_eager", "capture_all", ("peers", "capture_all"), "time<=", 1.0),
    (
        "ie_lab eager generate >= 0.90x bare HF generate (tok/s)",
        "ie_eager",
        "generate",
        ("bare", "generate"),
        "speed>=",
        0.90,
    ),
    (
        "ie_lab eager generate >= interp-engine's (tok/s)",
        "ie_eager",
        "generate",
        ("interp", "generate"),
        "speed>=",
        1.0,
    ),
    (
        "ie_lab eager capture_gen >= 1.5x interp-engine's (tok/s)",
        "ie_eager",
        "capture_gen",
        ("interp", "capture_gen"),
        "speed>=",
        1.5,
    ),
    (
        "ie_lab vLLM generate_x8 >= 4x ie_lab eager (tok/s)",
        "ie_vllm",
        "generate_x8",
        ("ie_eager", "generate_x8"),
        "speed>=",
        4.0,
    ),
    (
        "ie_lab vLLM graph mode generate_x8 / ie_lab eager (tok/s)",
        "ie_vllm_graph",
        "generate_x8",
        ("ie_eager", "generate_x8"),
        "reported",
        None,
    ),
    (
        "ie_lab vLLM graph mode capture_gen / interp-engine (tok/s)",
        "ie_vllm_graph",
        "capture_gen",
        ("interp", "capture_gen"),
        "reported",
        None,
    ),
]


def sbs_targets(cells, model) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows; a verdict needs every cell it compares to have run and be right.

    Two engines are compared through their in-process ratios to bare transformers (each cell times bare
    transformers beside itself), so the noise between processes cancels; a † marks a figure that had to fall
    back to comparing separate processes (an engine that computes on a thread of its own, or an older cell)."""
    ix = _index(cells)

    def ok(engine, w):
        c = ix.get((model, engine, w))
        return c if c is not None and c.get("status") == "ok" and c.get("median_s") else None

    def why(engine, w):
        c = ix.get((model, engine, w))
        return f"{engine} {w}: {c['status'] if c else 'not run'}"

    def time_over(a, b):
        """a's time over b's, through each one's in-process bare baseline when both have one."""
        (ra, ia), (rb, ib) = (
            _vs_bare(a, ix.get((model, "bare", a["workload"]))),
            _vs_bare(b, ix.get((model, "bare", b["workload"]))),
        )
        if ra is not None and rb is not None and ia and ib:
            return ra / rb, True
        return a["median_s"] / b["median_s"], False

    rows = []
    for label, engine, w, (other, ow), kind, factor in SBS_TARGETS:
        a = ok(engine, w)
        if other == "peers":
            bs = [(e, c) for e in SBS_PEERS if (c := ok(e, ow))]
        else:
            bs = [(other, c)] if (c := ok(other, ow)) else []
        if not a or not bs:
            if kind != "reported":
                missing = why(engine, w) if not a else ("no right peer cell" if other == "peers" else why(other, ow))
                rows.append((label, "", f"not measured ({missing})"))
            continue
        figs = []
        for e, b in bs:
            if other == "bare":
                r, inproc = _vs_bare(a, b, ow)
            else:
                r, inproc = time_over(a, b)
            figs.append((e, r if kind == "time<=" else 1 / r, inproc))
        mark = lambda ip: "" if ip else "†"  # noqa: E731
        if other == "peers":
            measured = ", ".join(f"{e} {v:.2f}x{mark(ip)}" for e, v, ip in figs)
        else:
            measured = f"{figs[0][1]:.2f}x{mark(figs[0][2])}"
        if kind == "reported":
            verdict = "reported"
        elif kind == "time<=":
            verdict = "met" if max(v for _, v, _ in figs) <= factor else "**missed**"
        else:
            verdict = "met" if min(v for _, v, _ in figs) >= factor else "**missed**"
        rows.append((label, measured, verdict))
    return rows


def render_sidebyside(cells: list[dict], device: str, headline: bool = False) -> list[str]:
    """The matrix as markdown: per model, workloads x engines (median, tok/s, ratio vs bare), peak memory, targets."""
    if not cells:
        return []
    ix = _index(cells)
    h = "###" if headline else "##"
    anyc = next((c for c in cells if c.get("threads")), cells[0])
    dates = sorted({c["date"] for c in cells if c.get("date") and c["model"] != "widget"})
    out = [
        f"{h} Side by side ({device}, {anyc.get('threads', '?')} threads, {dates[-1] if dates else '?'})",
        "",
        f"`python -m benchmarks.run`: one process per (model, engine, workload) cell; median of "
        f"{anyc.get('repeats', '?')} runs after a warm-up whose output is checked against bare transformers "
        "(tokens equal HF greedy, tensors allclose): a wrong output is shown as **WRONG**, never as a speed. "
        "(Nx) is the cell's time over bare transformers' time for the same workload, timed in the cell's own process, "
        "interleaved with it (the two sides share every slow spell of the machine); (Nx\u2020) compares with the bare "
        "cell's separate process instead (noisier, about \u00b115% here): engines that compute on a thread of "
        "their own (vLLM's engine loop) are measured that way, "
        "since a second OpenMP pool in one process would slow the baseline beside them too. Targets compare "
        "engines through in-process ratios where both cells have one. [n] points to the notes. "
        "\u2021load N: the 1-minute load average reached N while the cell ran, more than the machine's cores "
        "(cells that predate this record carry no mark).",
        "",
    ]
    for model in _models(cells):
        notes: list[str] = []
        mc = [c for c in cells if c["model"] == model]
        desc = next((c.get("model_desc") for c in mc if c.get("model_desc")), model)
        shape = next((c.get("shape") for c in mc if c.get("shape")), None)
        out += [f"{h}# {model}: {desc}", ""]
        head = "| workload | " + " | ".join(t for _, t in SBS_ENGINES) + " |"
        out += [head, "| --- |" + " ---: |" * len(SBS_ENGINES)]
        for w, label, what in SBS_WORKLOADS:
            src = "widget" if w == "widget_round_trip" else model
            if w == "widget_round_trip" and not any(k[0] == "widget" for k in ix):
                continue
            if shape:
                what = what.format(lens_rows=shape["lens_positions"] * shape["n_layers"], **shape)
            bare = ix.get((src, "bare", w))
            row = [_cell_text(ix.get((src, e, w)), bare, notes) for e, _ in SBS_ENGINES]
            out.append(f"| {label}: {what} | " + " | ".join(row) + " |")
        out += [""] + [f"[{i + 1}] {n}" + "  " for i, n in enumerate(notes)] + [""]
        out += [
            "Peak resident memory of each cell's process (MB; model load included):",
            "",
            "| workload | " + " | ".join(t for _, t in SBS_ENGINES) + " |",
            "| --- |" + " ---: |" * len(SBS_ENGINES),
        ]
        for w, label, _ in SBS_WORKLOADS[:-1]:
            vals = []
            for e, _ in SBS_ENGINES:
                c = ix.get((model, e, w))
                vals.append(f"{c['peak_rss_mb']:.0f}" if c and c.get("peak_rss_mb") else "")
            out.append(f"| {label} | " + " | ".join(vals) + " |")
        out += ["", "| target | measured | verdict |", "| --- | --- | --- |"]
        out += [f"| {a} | {b} | {v} |" for a, b, v in sbs_targets(cells, model)]
        out.append("")
    return out


README_START = (
    "<!-- bench:start (generated by `python benchmarks/render.py` from benchmarks/results/sidebyside; do not edit) -->"
)
README_END = "<!-- bench:end -->"


def readme_block() -> str:
    lines = [README_START, ""]
    devices = cell_devices()
    for device in devices:
        lines += render_sidebyside(load_cells(device), device, headline=True)
    if not devices:
        lines += ["No side-by-side cells yet: `python -m benchmarks.run`.", ""]
    lines.append(README_END)
    return "\n".join(lines)


def readme_with_block(text: str) -> str:
    """README.md with the generated blocks replaced: the side-by-side block (appended when its markers are
    missing) and each named block of README_BLOCKS between its `<!-- bench:begin NAME -->` and
    `<!-- bench:end NAME -->` markers."""
    block = readme_block()
    if README_START in text and README_END in text:
        head, rest = text.split(README_START, 1)
        tail = rest.split(README_END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n## Benchmarks\n\n" + block + "\n"
    for name, fn in README_BLOCKS.items():
        begin, end = named_markers(name)
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + begin + "\n" + "\n".join(fn()) + "\n" + end + rest.split(end, 1)[1]
    return text


# ---- the README's other tables, each rendered from its results file (never typed) ------------------------------


def named_markers(name: str) -> tuple[str, str]:
    return (
        f"<!-- bench:begin {name} (generated by `python benchmarks/render.py` from benchmarks/results; do not edit) -->",
        f"<!-- bench:end {name} -->",
    )


def _result(name: str) -> dict | None:
    p = os.path.join(HERE, "results", f"{name}.json")
    return json.load(open(p)) if os.path.exists(p) else None


def _where(r: dict) -> str:
    """The provenance line under a table: machine, date, versions (as the results file recorded them)."""
    v = r.get("versions") or {k: r[k] for k in ("torch",) if k in r}
    vs = ", ".join(f"{k} {x}" for k, x in v.items())
    threads = f", {r['threads']} thread(s)" if r.get("threads") else ""
    if r.get("load_average"):  # remote.py: 1, 5, 15 min before and after
        la = r["load_average"]
        threads += f", load average {la[0]} before and {la[len(la) // 2]} after"
    versions = f"; {vs}" if vs else ""
    return f"Measured {r.get('date', '?')} on {r.get('machine', r.get('device', '?'))}{threads}{versions}."


def _x(v: float) -> str:
    return f"{v:.2f}x"


def readme_remote() -> list[str]:
    r = _result("remote-cpu")
    if r is None:
        return ["No remote results yet: `python benchmarks/remote.py`."]
    m, q = r["median_s"], r["ratio"]
    mc = r["many_clients"]
    rows = [
        ("generate (64 greedy tokens)", "generate"),
        ("steered generate", "steer"),
        ("generate_stream, one frame per token", "stream"),
        ("capture of every layer's resid_post (128 tokens)", "capture"),
    ]
    out = [
        "| operation | local | remote | remote / local | target |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for label, k in rows:
        t = r.get("target", {}).get(f"{k}_remote_over_local")
        verdict = "" if t is None else f"<= {t}x: {'met' if q[f'{k}_remote_over_local'] <= t else '**missed**'}"
        out.append(
            f"| {label} | {_t(m[f'local_{k}'])} | {_t(m[f'remote_{k}'])} | {_x(q[f'{k}_remote_over_local'])} | {verdict} |"
        )
    out.append(
        f"| the same capture, compress=True | | {_t(m['remote_capture_zlib'])} | "
        f"{_x(q['capture_zlib_remote_over_local'])} | |"
    )
    out += [
        f"| {mc['clients']} clients x {mc['requests_per_client']} requests of {mc['new_tokens']} tokens (throughput) | "
        f"{mc['local_tok_per_s']:.0f} tok/s (one local Session, in turn) | {mc['remote_tok_per_s']:.0f} tok/s | "
        f"{_x(mc['remote_over_local_time'])} the time | |",
        "",
        f"`benchmarks/remote.py`: {r['model']}; median of {r['repeats']} interleaved repeats; every remote output "
        "checked equal to the local one first. " + _where(r),
    ]
    return out


def readme_projection() -> list[str]:
    out = [
        "| backend | 16 directions | 4,096 directions | SAE encoding | scores handed back (16 directions) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    wheres = []
    vp = _result("vllm_projection-cpu")
    for backend in ("eager", "vllm"):
        r = _result(f"projection-{backend}-cpu")
        if r is None:
            out.append(f"| {backend} | not measured | | | |")
            continue
        q = r["ratio_project_over_capture"]
        bytes_ = ""
        if backend == "vllm" and vp:
            b = vp["bytes_per_request"]
            bytes_ = (
                f"{b['project_k16'] / 1e3:.0f} KB against {b['capture_k16'] / 1e3:.0f} KB for the capture "
                f"(`vllm_projection.py`, {vp['date']})"
            )
        elif backend == "eager":
            bytes_ = "in this process: nothing crosses"
        out.append(f"| {backend} | {_x(q['k16'])} | {_x(q['k4096'])} | {_x(q['sae'])} | {bytes_} |")
        wheres.append(f"{backend}: " + _where(r))
    r0 = _result("projection-eager-cpu") or _result("projection-vllm-cpu") or {}
    out += [
        "",
        "Time of `s.project` (scores computed where the activation is: the eager hook, the vLLM worker) over a "
        "capture projected here, in the same run; the SAE is a random ReLU SAE of "
        f"{r0.get('sae_features', '?')} features (`ie_lab.sae.SAE.project`). `benchmarks/projection.py`: "
        f"{r0.get('model', '?')}, {r0.get('tokens', '?')} tokens at {r0.get('point', '?')}, median of "
        f"{r0.get('repeats', '?')} interleaved repeats; scores checked equal to the client-side product first. "
        + " ".join(wheres),
    ]
    return out


def readme_vllm_modes() -> list[str]:
    r = _result("vllm_modes-cpu")
    if r is None:
        return ["No vLLM modes results yet: `python benchmarks/vllm_modes.py`."]
    m, tps = r["median_s"], r["tok_per_s"]
    labels = {
        "hooks": "hooks mode (default)",
        "generate": "generation-only mode (`mode='generate'`)",
        "graph": "graph mode (`graph_points=`)",
        "graph_steer": "graph mode, steered (`steer_points=`)",
        "hooks_steer": "hooks mode, steered",
    }
    out = ["| Session | 8 concurrent generations | tok/s |", "| --- | ---: | ---: |"]
    out += [f"| {labels.get(k, k)} | {_t(v)} | {tps[k]:.0f} |" for k, v in m.items()]
    out += ["", "| ratio | measured | target | verdict |", "| --- | ---: | --- | --- |"]
    for k, v in r["ratios"].items():
        t = r["targets"].get(k, "")
        verdict = ""
        if t.startswith("<="):
            verdict = "met" if v <= float(t.split()[1]) else "**missed**"
        elif t.startswith(">"):
            verdict = "met" if v > float(t.split()[1]) else "**missed**"
        out.append(f"| {k} | {v:.2f} | {t} | {verdict} |")
    out += [
        "",
        f"`benchmarks/vllm_modes.py`: {r['model']}, {r['dtype']}; {r['workload']}; steering {r['steering']}; "
        f"median of {r['repeats']}; greedy ids checked equal between modes first. " + _where(r),
    ]
    return out


def readme_eager_batching() -> list[str]:
    out = [
        "| model | 8 prompts in one call | the same, capturing | the same, steered | 8 concurrent `agenerate` | "
        "the same, each steered | a loop of solo calls |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    wheres = []
    for name in ("eager_batch-cpu", "eager_batch-demo-cpu"):
        r = _result(name)
        if r is None:
            continue
        q = r["ratio_vs_hf_batched"]
        ks = ["ie_batched", "ie_batched_capture", "ie_batched_steered", "session_generate_x8", "session_steer_x8"]
        out.append(f"| {r['model_key']} | " + " | ".join(_x(q[k]) for k in ks) + f" | {_x(q['ie_loop_of_solo'])} |")
        wheres.append(f"{r['model_key']} ({r['model']}): " + _where(r))
    out += [
        "",
        "Time over bare HF batched `generate` of the same left-padded batch, in the same run "
        "(`benchmarks/eager_batch.py`: 8 prompts of 8-64 tokens, 32 greedy tokens each; every prompt's tokens "
        "checked equal to HF's and its solo run's first). " + " ".join(wheres),
    ]
    return out


def readme_attribution_graph() -> list[str]:
    files = sorted(glob.glob(os.path.join(HERE, "results", "attribution_graph-*t-cpu.json")))
    if not files:
        return ["No attribution-graph results yet: `python benchmarks/attribution_graph.py`."]
    out = [
        "| threads | batch size (ie_lab / circuit-tracer) | ie_lab `attribution_graph` | circuit-tracer `attribute` | "
        "ie_lab / circuit-tracer | target |",
        "| ---: | --- | ---: | ---: | ---: | --- |",
    ]
    wheres = []
    for path in files:
        r = json.load(open(path))
        m, q, b = r["median_s"], r["ratio_ie_lab_over_circuit_tracer"], r["batch_sizes"]
        for name in q:
            out.append(
                f"| {r['threads']} | {b[name]['ie_lab']} / {b[name]['circuit_tracer']} | "
                f"{m[f'ie_lab_{name}'] * 1e3:.0f} ms | {m[f'circuit_tracer_{name}'] * 1e3:.0f} ms | {_x(q[name])} | "
                "<= 1.00x: " + ("met" if q[name] <= 1 else "**missed**") + " |"
            )
        wheres.append(f"{r['threads']} thread(s), median of {r['repeats']}: " + _where(r))
    chk = next(iter(r["checked"].values()))
    v = r["circuit_tracer_versions"]
    out += [
        "",
        f"`benchmarks/attribution_graph.py`: {r['model']}, the prompt {r['prompt']!r} ({chk['tokens']} tokens, "
        f"{chk['features_circuit_tracer']} active features past position 0, {chk['n_logits']} logit), CPU, both "
        "sides at the same thread count; the whole call after a warm-up, rounds alternating; "
        f"circuit-tracer {v.get('circuit-tracer')} (nnsight backend, transformers {v.get('transformers')}) in its "
        "own process; the two graphs checked equal first (validator/circuits.py). " + " ".join(wheres),
    ]
    return out


def readme_harvest() -> list[str]:
    r = _result("harvest-cpu")
    if r is None:
        return ["No harvest results yet: `python benchmarks/harvest.py`."]
    q, tps, split = r["throughput_ratio_to_bare"], r["tokens_per_s"], r["time_split"]
    out = [
        "| what runs | tokens/s | throughput / bare forward | time outside the forward | target |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| bare batched transformers forward | {tps['bare_forward']:.0f} | 1.00x | | |",
    ]
    for key, what in (("harvest_1_point", "one point"), ("harvest_8_points", "every layer's resid_post")):
        out.append(
            f"| `ie_lab.harvest`, {what} | {tps[key]:.0f} | {_x(q[key])} | "
            f"{split[key]['outside_forward_share'] * 100:.1f}% | >= 0.85x: "
            + ("met" if q[key] >= 0.85 else "**missed**")
            + " |"
        )
    la = r.get("load_average") or []
    load = f", load average {la[0]:.1f} (1 min) and {la[1]:.1f} (5 min) at the end" if len(la) > 1 else ""
    v = ", ".join(f"{k} {x}" for k, x in (r.get("versions") or {}).items())
    out += [
        "",
        f"`benchmarks/harvest.py`: {r['model']}; {r['prompts']} ragged prompts, {r['tokens']:,} tokens in batches of "
        f"{r['batch_size']}, shards written to disk; medians of {r['repeats']} interleaved rounds, rows checked "
        "against a capture first; the time outside the forward is timed inside one harvest. "
        f"Measured {r.get('date', '?')} on {r.get('machine', '?')}, {r['threads']} thread(s){load}; {v}.",
    ]
    return out


README_BLOCKS = {
    "attribution-graph": readme_attribution_graph,
    "remote": readme_remote,
    "projection": readme_projection,
    "vllm-modes": readme_vllm_modes,
    "eager-batching": readme_eager_batching,
    "harvest": readme_harvest,
}


def chart_figure(cells: list[dict], device: str) -> dict:
    """A plotly figure (plain JSON): per model, each workload's time relative to bare transformers per engine."""
    ix = _index(cells)
    data = []
    models = _models(cells)
    for e, title in SBS_ENGINES:
        xs, ys, texts = [], [], []
        for model in models:
            for w, label, _ in SBS_WORKLOADS[:-1]:
                c, b = ix.get((model, e, w)), ix.get((model, "bare", w))
                r = _vs_bare(c, b)[0] if c and c.get("median_s") else None  # the same ratio as the table's (Nx)
                if r is not None:
                    xs.append(f"{model} {label}")
                    ys.append(round(r, 4))
                    texts.append("WRONG" if c["status"] == "WRONG" else "")
        data.append({"type": "bar", "name": title, "x": xs, "y": ys, "text": texts})
    return {
        "data": data,
        "layout": {
            "title": {
                "text": f"Side by side ({device}): time relative to bare transformers "
                "(lower is faster; WRONG marks a wrong output)"
            },
            "barmode": "group",
            "yaxis": {"type": "log", "title": {"text": "x bare"}},
            "height": 520,
        },
    }


def write_charts() -> list[str]:
    written = []
    os.makedirs(os.path.join(HERE, "charts"), exist_ok=True)
    for device in cell_devices():
        fig = chart_figure(load_cells(device), device)
        p = os.path.join(HERE, "charts", f"sidebyside-{device}.json")
        with open(p, "w") as f:
            json.dump(fig, f, indent=1)
        written.append(p)
        try:
            import plotly.io as pio

            h = os.path.join(HERE, "charts", f"sidebyside-{device}.html")
            pio.write_html(pio.from_json(json.dumps(fig)), h, include_plotlyjs=True, full_html=True)  # offline: no CDN
            written.append(h)
        except ImportError:
            pass
    return written


if __name__ == "__main__":
    text = render()
    with open(os.path.join(HERE, "results-latest.md"), "w") as f:
        f.write(text)
    readme = os.path.join(os.path.dirname(HERE), "README.md")
    with open(readme) as f:
        old = f.read()
    with open(readme, "w") as f:
        f.write(readme_with_block(old))
    write_charts()
    print(text)
    sys.exit(0)
