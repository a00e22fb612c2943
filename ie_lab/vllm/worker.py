"""The vLLM worker extension: persistent hooks, per-request capture, steering and logit lens.

Loaded inside every vLLM worker through ``worker_extension_cls="ie_lab.vllm.worker.IELabWorker"``; the
client talks to it only through ``collective_rpc`` with plain data (dicts, lists, bytes), so it works the
same in-process and across vLLM's worker processes.

Life of a request with work attached:

1. ``ie_register(key, spec)`` stores what the request wants (points, steering, lens) under a client key;
2. the request carries ``extra_args={"ie_lab": key}``; a pre-hook on the model reads, for every forward,
   the runner's ``input_batch.req_ids`` and ``query_start_loc`` (the flattened layout) and the positions,
   and keeps the rows of requests that have a spec;
3. hooks placed once at install time read (or edit) only those rows and file slices per request with
   their absolute positions, so the grouping of requests into forwards does not matter;
4. ``ie_collect(key)`` reassembles by position, rebuilds attention from the captured post-RoPE q/k,
   and forgets the key; ``ie_release(key)`` forgets it without returning anything (aborts).

Head- and neuron-sharded points are gathered across tensor-parallel ranks inside the hook (every rank
runs the same hooks on the same layout, so the collective is matched); only rank 0 keeps the data.

This module installs the hooks and runs them; what is kept per request is in worker_requests.py, and the read-out
(``ie_drain``, ``ie_collect``, attention rebuilt from q/k) in worker_readout.py, a base of IELabWorker.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..ops import steering as steer_ops
from ..ops.projection import from_plain
from ..ops.projection import scores as project_scores
from ..ops.splice import splice as splice_rows
from . import child_exit
from .sites import LayerSites, Site, _first, _tp_size, bind_vllm, hook_targets, site_table
from .static_steer import METHOD_INDEX, StaticSteer, params_of
from .wire import RECOMPUTED, unpack  # what crosses to the client: plain data (vllm/wire.py)
from .worker_readout import WorkerReadout
from .worker_requests import GraphSteer, Row, Spec, layer_of, non_finite, position_mask, scrub, tp_rank

# Imported in each process that runs a worker: vLLM's engine core (one rank) or its workers (tensor parallelism) end
# without the interpreter's teardown once their shutdown is done (child_exit.py; nothing in any other process).
child_exit.install()


def _gather(t: torch.Tensor) -> torch.Tensor:
    if _tp_size() == 1:
        return t
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(t.contiguous(), dim=-1)


def _transcoder(r: Row, s: dict, seg: torch.Tensor) -> torch.Tensor:
    """One request's rows at a transcoder's output point, the transcoder spliced in (ops/splice.py, the eager hooks'
    arithmetic) from the rows its input point handed the MLP in this forward. A clamp at a position edits the row of
    that absolute position only (wherever vLLM put it in the flattened batch; in no forward when a prefix cache or an
    earlier chunk already ran it); a clamp at every position (None) edits every row, prompt and generated."""
    x = r.spec.tc_seen.pop(s["tc"], None)
    if x is None or x.shape[0] != seg.shape[0]:
        raise RuntimeError(f"the transcoder written at {s['address']} ran without its input rows in this forward")
    enc, W, b, idx, vals, at, error = s["tc_t"]
    where = None
    if any(p is not None for p in at):
        pos = r.positions.to(seg.device)
        where = torch.stack([torch.ones_like(pos, dtype=torch.bool) if p is None else pos == p for p in at], -1)
    new, _ = splice_rows(seg, project_scores(x.to(seg.device), enc), W, b, idx, vals, error, where)
    return new.to(seg.dtype)


class IELabWorker(WorkerReadout):
    """Mixed into vLLM's worker class; every public method here (and of its base WorkerReadout) is reachable through
    collective_rpc."""

    model_runner: Any  # vLLM's worker has it; this class is only ever mixed into one
    _ie_info: dict

    # ---- install --------------------------------------------------------------------------------
    def ie_install(self) -> dict:
        if getattr(self, "_ie_installed", False):
            return self._ie_info
        runner = self.model_runner
        model = runner.model if hasattr(runner, "model") else runner.get_model()
        self._ie_model = model
        self._ie_specs: dict[str, Spec] = {}
        self._ie_ran = 0
        self._ie_rows: list[Row] | None = None
        self._ie_ids: torch.Tensor | None = None
        self._ie_busy = False  # inside our own read-out (lens): hooks stand aside
        embed, final, layers = bind_vllm(model)
        self._ie_layers = layers
        self._ie_final = final
        self._ie_handles: list[Any] = []
        h = self._ie_handles
        h.append(model.register_forward_pre_hook(self._ie_on_forward, with_kwargs=True))
        h.append(model.register_forward_hook(self._ie_after_forward))
        self._ie_static = getattr(model, "_ie_static", None)
        if self._ie_static is not None:
            # Graph mode: the trunk is compiled with the static taps inside; no Python hook may go in there.
            declared: dict[str, list[int]] = defaultdict(list)
            steer_sites = self._ie_static.steer.sites if self._ie_static.steer is not None else {}
            for point in sorted(set(self._ie_static.taps) | set(steer_sites)):
                name, _, tail = point.partition(".")
                declared[name].append(int(tail) if tail else 0)
            self._ie_installed = True
            self._ie_info = {
                "model_class": type(model).__name__,
                "n_layers": len(layers),
                "present": dict(declared),
                "tp_size": _tp_size(),
                "final_norm": final is not None,
                "graph_points": sorted(self._ie_static.taps),
                "steer_points": sorted(self._ie_static.steer.sites) if self._ie_static.steer is not None else [],
            }
            return self._ie_info
        table = site_table(model, bound=(embed, final, layers))
        # Where vLLM's Transformers backend calls an attention layer's forward directly (past its hooks), the hooks
        # meant for that layer go on a stand-in its forward is routed through.
        hook_on = hook_targets(model, layers)
        # One hook per module and side, running that module's sites in table order (each reads what the one
        # before it handed on): the same sites graph mode taps.
        groups: dict[tuple[int, str], list[Site]] = {}
        for site in table:
            groups.setdefault((id(site.module), site.side), []).append(site)
        for (_, side), group in groups.items():
            mod = hook_on.get(id(group[0].module), group[0].module)
            if side == "pre":
                h.append(mod.register_forward_pre_hook(self._guard(self._pre_sites(group)), with_kwargs=True))
            else:
                h.append(mod.register_forward_hook(self._guard(self._post_sites(group))))
        # A site whose value is a sum the layer forms (sites.Partner): the earlier module's output is kept for it and
        # dropped after the site's module returns (registered after its sites' hook, so it runs after them).
        for site in {id(x.partner): x for x in table if x.partner is not None}.values():
            assert site.partner is not None
            h.append(site.partner.module.register_forward_hook(site.partner.keep))
            h.append(site.module.register_forward_hook(site.partner.drop))
        present: dict[str, list[int]] = defaultdict(list)
        for site in table:
            if site.layer is not None:
                present[site.name].append(site.layer)
        for s in layers:
            if s.attn_core is None:  # a mixer layer: no attention pattern to rebuild
                continue
            sinks = getattr(s.attn_core.impl, "sinks", None)
            if sinks is not None:  # this rank's heads: the read-out on rank 0 rebuilds every head (all ranks gather)
                s.sinks = _gather(sinks.detach().float().reshape(1, -1))[0].cpu()
            # attention patterns are rebuilt from the q/k the kernel receives, on every layer
            core = hook_on.get(id(s.attn_core), s.attn_core)
            h.append(core.register_forward_pre_hook(self._guard(self._qk_reader(s)), with_kwargs=True))
            for name in RECOMPUTED:
                present[name].append(s.index)
        self._ie_installed = True
        self._ie_info = {
            "model_class": type(model).__name__,
            "n_layers": len(layers),
            "present": dict(present),
            "tp_size": _tp_size(),
            "final_norm": final is not None,
        }
        return self._ie_info

    # ---- per-forward layout ---------------------------------------------------------------------
    def _ie_on_forward(self, mod, args, kwargs):
        self._ie_rows = None
        steer = self._ie_static.steer if self._ie_static is not None else None
        if not self._ie_specs or not self.model_runner.input_batch.num_reqs:
            if steer is not None:  # a forward of plain requests: no steering buffer may keep an earlier step's rows
                steer.fill(0, [])
            return None
        runner = self.model_runner
        ib = runner.input_batch
        n = ib.num_reqs
        positions = kwargs.get("positions")
        if positions is None:
            positions = next(
                (a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point() and a is not args[0]),
                None,
            )
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        qsl = runner.query_start_loc.np[: n + 1].tolist()
        rows = []
        for i, req_id in enumerate(ib.req_ids[:n]):
            st = runner.requests.get(req_id)
            extra = getattr(getattr(st, "sampling_params", None), "extra_args", None) or {}
            key = extra.get("ie_lab")
            spec = self._ie_specs.get(key) if key is not None else None
            if spec is None or spec.error is not None or qsl[i + 1] <= qsl[i]:
                continue
            spec.forwards += 1
            pos = positions[qsl[i] : qsl[i + 1]].detach().to("cpu").clone()
            rows.append(Row(key, spec, qsl[i], qsl[i + 1], pos, i))
        self._ie_rows = rows or None
        self._ie_ids = input_ids if rows else None
        if steer is not None:
            self._fill_steer(steer, rows, int((input_ids if input_ids is not None else positions).shape[0]))
        if self._ie_static is not None and rows:
            self._ie_static.arm()
        return None

    def _ie_after_forward(self, mod, args, out):
        static = self._ie_static
        try:
            if static is not None and self._ie_rows is not None:
                # Graph mode: the compiled trunk has written every declared point; file the rows outside it.
                static.check()
                n = max(r.end for r in self._ie_rows)
                self._graph_broke(static, n)
                for point, tap in static.taps.items():
                    self._read(point, tap.buffer[:n], sharded=tap.sharded)
            if self._ie_rows is not None:
                self._check_finite(out)
        finally:
            self._ie_rows = None
            self._ie_ids = None

    def _graph_broke(self, static: Any, n: int) -> None:
        """Graph mode: the requests whose rows a declared site's steering made non-finite in this forward (the
        compiled site handed those rows on unsteered and flagged them, static_steer.steer_rows) fail, naming it."""
        live = [(p, site) for p, site in (static.steer.sites.items() if static.steer is not None else ()) if site.live]
        if not live:
            return
        flags = torch.stack([site.bad[:n] for _, site in live]).cpu()  # one device read for every site
        for (point, _), bad in zip(live, flags):
            if not bool(bad.any()):
                continue
            for r in self._ie_rows or ():
                broke = bad[r.start : r.end]
                if r.spec.error is None and bool(broke.any()):
                    r.spec.error = non_finite(point, r, broke)

    def _check_finite(self, out: Any) -> None:
        """The last line: a steered request whose final rows are non-finite although no site's steering made them so
        (a finite edit that overflowed in a later layer) has written them into the KV cache. It fails, its rows
        are zeroed for the sampler, and the cache is cleared of non-finite values before any block is reused."""
        x = _first(out) if not isinstance(out, torch.Tensor) else out
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        dirty = False
        for r in self._ie_rows or ():
            if not r.spec.steer or r.spec.error is not None or r.end > x.shape[0]:
                continue
            broke = ~torch.isfinite(x[r.start : r.end]).all(dim=-1)
            if bool(broke.any()):
                sites = ", ".join(sorted({s["address"] for s in r.spec.steer}))
                r.spec.error = non_finite(f"the model's output (after steering {sites})", r, broke.cpu(), cleared=True)
                x[r.start : r.end].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                dirty = True
        if dirty:
            scrub(getattr(self.model_runner, "kv_caches", None))

    def _guard(self, hook: Callable) -> Callable:
        """A hook that fails fails the requests it was working for, not the engine: the forward goes on
        unchanged at that point, every ie_lab request in it is marked failed (its work stops, ie_collect
        reports why) and plain requests never notice. Never silent: a request whose steering could not be
        applied here is failed, not returned unsteered."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return hook(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - attributed to the requests of this forward
                for r in self._ie_rows or ():
                    if r.spec.error is None:
                        r.spec.error = f"{type(e).__name__}: {e}"
                return None

        return guarded

    def _active(self) -> list[Row] | None:
        if self._ie_busy:
            return None
        return self._ie_rows

    # ---- reading ----------------------------------------------------------------------------------
    def _file(self, rows: list[Row], point: str, t: torch.Tensor) -> None:
        keep = tp_rank() == 0
        for r in rows:
            if point in r.spec.points:
                if keep:
                    r.spec.store[point].append((r.positions, t[r.start : r.end].detach().to("cpu").clone()))
            if keep and point in r.spec.project:
                # Projected here, on the activation's device: only [tokens, k] scores leave the worker.
                enc, head, head_dim = r.spec.project[point]
                x = t[r.start : r.end].detach()
                if head is not None:
                    x = x.reshape(x.shape[0], -1, head_dim)[:, head]
                r.spec.proj_store[point].append((r.positions, project_scores(x, enc).to("cpu")))

    def _wanted(self, rows: list[Row], point: str) -> bool:
        return any(point in r.spec.points or point in r.spec.project for r in rows) or any(
            r.spec.lens is not None and point == f"{r.spec.lens['point']}.{layer_of(point)}" for r in rows
        )

    def _lens_all(self, rows: list[Row], point: str, t: torch.Tensor) -> None:
        """The logit lens inside the worker: final norm, the model's own logits, top-k; only top-k is kept."""
        want = [
            r
            for r in rows
            if r.spec.lens is not None
            and f"{r.spec.lens['point']}.{layer_of(point)}" == point
            and layer_of(point) in r.spec.lens["layers"]
        ]
        if not want:
            return
        self._ie_busy = True
        try:
            x = torch.cat([t[r.start : r.end] for r in want])
            x = self._ie_final(x) if self._ie_final is not None else x
            x = _first(x)
            logits = self._ie_model.compute_logits(x)
        finally:
            self._ie_busy = False
        if logits is None or tp_rank() != 0:
            return
        off = 0
        for r in want:
            n = r.end - r.start
            probs = torch.softmax(logits[off : off + n].float(), -1)
            lens = r.spec.lens
            assert lens is not None  # want holds only requests with a lens
            vals, idx = probs.topk(int(lens["k"]), dim=-1)
            r.spec.lens_rows[layer_of(point)].append((r.positions, idx.cpu(), vals.cpu()))
            off += n

    def _read(self, point: str, t: torch.Tensor, sharded: bool = False) -> None:
        rows = self._active()
        if rows is None or not self._wanted(rows, point):
            return
        if sharded:
            t = _gather(t)
        self._file(rows, point, t)
        self._lens_all(rows, point, t)

    def _visit(self, rows: list[Row], site: Site, t: torch.Tensor) -> torch.Tensor | None:
        """One site's value in this forward: steered where asked (steerable sites only), then read; the edited
        value, or None if it is unchanged."""
        if site.write is None:
            self._read(site.point, t, sharded=site.sharded)
            return None
        return self._steer_and_read(rows, site.point, t)

    def _pre_sites(self, group: list[Site]) -> Callable:
        """The sites read off one module's arguments, in table order; edits are handed on to the next site and
        to the call."""

        def hook(mod, args, kwargs):
            rows = self._active()
            if rows is None:
                return None
            changed = False
            for site in group:
                new = self._visit(rows, site, site.read(args, kwargs))
                if new is not None:
                    args, kwargs = site.write(args, kwargs, new)
                    changed = True
            return (args, kwargs) if changed else None

        return hook

    def _post_sites(self, group: list[Site]) -> Callable:
        """The sites read off one module's output, in table order; edits replace the output."""

        def hook(mod, args, out):
            rows = self._active()
            if rows is None:
                return None
            changed = False
            for site in group:
                new = self._visit(rows, site, site.read(args, out))
                if new is not None:
                    out = site.write(args, out, new)
                    changed = True
            return out if changed else None

        return hook

    # ---- steering ---------------------------------------------------------------------------------
    def _steer(self, rows: list[Row], point: str, t: torch.Tensor) -> torch.Tensor | None:
        """The tensor with every steering spec for this point applied to its rows, or None if none applies."""
        todo = [(r, s) for r in rows for s in r.spec.steer if s["address"] == point]
        if not todo:
            return None
        out = t.clone()
        changed = False
        for r, s in todo:
            if r.spec.error is not None:
                continue
            try:  # one request's steering failing fails that request only; the others in this forward go on
                seg = out[r.start : r.end]
                if s["method"] == "transcoder_in":  # read, for the transcoder's write at mlp_out in this forward
                    r.spec.tc_seen[s["tc"]] = seg.detach().to(torch.float32, copy=True)
                    continue
                changed = True
                if s["method"] == "splice":
                    out[r.start : r.end] = self._splice(r, s, seg)
                    continue
                if s["method"] == "transcoder":
                    new = _transcoder(r, s, seg)
                    broke = ~torch.isfinite(new).all(dim=-1)
                    if bool(broke.any()):  # kept out of the KV cache, as a steering edit's non-finite rows are
                        r.spec.error = non_finite(point, r, broke.cpu())
                        out[r.start : r.end] = t[r.start : r.end]
                        continue
                    out[r.start : r.end] = new
                    continue
                mask = position_mask(
                    s["positions"],
                    r.positions,
                    r.spec.prompt_len,
                    self._ie_ids[r.start : r.end] if self._ie_ids is not None else None,
                    r.spec.special_ids,
                )
                fn = steer_ops.FUNCTIONS[s["method"]]
                if mask is not None:
                    mask = mask.to(seg.device)[None]
                new = fn(seg[None], s["vector_t"].to(seg.device), mask=mask, **s["kwargs"])[0]
                broke = ~torch.isfinite(new).all(dim=-1)
                if bool(broke.any()):
                    # Handed on unsteered: a non-finite row would go into the KV cache, whose freed blocks the next
                    # requests reuse (a masked slot's weight 0 times NaN is NaN). The request fails instead.
                    r.spec.error = non_finite(point, r, broke.cpu())
                    out[r.start : r.end] = t[r.start : r.end]
                    continue
                out[r.start : r.end] = new
            except Exception as e:  # noqa: BLE001
                r.spec.error = f"steering {point} with {s['method']}: {type(e).__name__}: {e}"
        return out if changed else None

    def _splice(self, r: Row, s: dict, seg: torch.Tensor) -> torch.Tensor:
        """One request's rows with an SAE spliced in (ops/splice.py, the eager hooks' arithmetic); its features kept
        under their name ('sae.<name>.acts') when its capture asked for them."""
        enc, W, b, idx, vals = s["splice_t"]
        new, acts = splice_rows(seg, project_scores(seg.float(), enc), W, b, idx, vals, s["splice"]["error"])
        if s["splice"]["keep"] and tp_rank() == 0:
            r.spec.proj_store[s["splice"]["acts"]].append((r.positions, acts.to("cpu")))
        return new.to(seg.dtype)

    def _fill_steer(self, steer: StaticSteer, rows: list[Row], n_tokens: int) -> None:
        """Graph mode: every steered row's method, request slot, vector and numbers into the static buffers the
        compiled trunk reads, before it runs (rows of other requests, and positions a mask leaves out: -1)."""
        entries = []
        for r in rows:
            for g in r.spec.graph_steer:
                mask = position_mask(
                    g.positions,
                    r.positions,
                    r.spec.prompt_len,
                    self._ie_ids[r.start : r.end] if self._ie_ids is not None else None,
                    r.spec.special_ids,
                )
                entries.append((g.point, r.start, r.end, r.slot, g.method, mask, g))
        steer.fill(n_tokens, entries)

    def _steer_and_read(self, rows: list[Row], point: str, t: torch.Tensor) -> torch.Tensor | None:
        """Steer the rows that ask for it, read what is handed on; the steered tensor, or None if unchanged."""
        new = self._steer(rows, point, t)
        self._read(point, t if new is None else new)
        return new

    def _qk_reader(self, s: LayerSites) -> Callable:
        """The post-RoPE q and k the attention kernel receives, kept (gathered over ranks) for the layers whose
        patterns a request asked for: attn_scores / attn_probs are rebuilt from them when it ends."""
        L = s.index

        def hook(mod, args, kwargs):
            rows = self._active()
            if rows is None or not any(L in r.spec.attn_layers for r in rows):
                return None
            q, k = (kwargs[n] if n in kwargs else args[i] for i, n in enumerate(("query", "key")))
            qg = _gather(q.reshape(q.shape[0], -1))
            kg = k.reshape(k.shape[0], -1) if s.kv_replicated else _gather(k.reshape(k.shape[0], -1))
            if tp_rank() == 0:
                for r in rows:
                    if L in r.spec.attn_layers:
                        r.spec.qk[L].append(
                            (r.positions, qg[r.start : r.end].cpu().clone(), kg[r.start : r.end].cpu().clone())
                        )
            return None

        return hook

    # ---- the client's calls -------------------------------------------------------------------------
    def ie_register(self, key: str, spec: dict) -> bool:
        steer = []
        for s in spec.get("steer", []):
            s = dict(s)
            s["vector_t"] = unpack(s["vector"]).to(torch.float32)
            if isinstance(s.get("positions"), dict):  # a boolean mask travels packed
                s["positions"] = unpack(s["positions"]).bool()
            if s["method"] == "transcoder":  # the transcoder's encoder, decoder and clamps, unpacked once per request
                tc = s["transcoder"]
                b = None if tc["b_dec"] is None else unpack(tc["b_dec"]).float()
                idx = torch.tensor(tc["idx"], dtype=torch.long)
                vals = torch.tensor(tc["vals"], dtype=torch.float32)
                enc = from_plain(tc["encoder"], unpack)
                s["tc_t"] = (enc, unpack(tc["W_dec"]).float(), b, idx, vals, list(tc["at"]), bool(tc["error"]))
            if s["method"] == "splice":  # the SAE, unpacked once per request
                sp = s["splice"]
                b = None if sp["b_dec"] is None else unpack(sp["b_dec"]).float()
                idx = torch.tensor(sp["idx"], dtype=torch.long)
                vals = torch.tensor(sp["vals"], dtype=torch.float32)
                s["splice_t"] = (from_plain(sp["encoder"], unpack), unpack(sp["W_dec"]).float(), b, idx, vals)
            steer.append(s)
        project = {
            point: (from_plain(p["encoder"], unpack), p.get("head"), int(p.get("head_dim", 0)))
            for point, p in (spec.get("project") or {}).items()
        }
        entry = Spec(
            set(spec.get("points", [])),
            set(spec.get("attn_layers", [])),
            steer,
            spec.get("lens"),
            int(spec.get("prompt_len", 0)),
            frozenset(spec.get("special_ids", [])),
            project=project,
        )
        static = getattr(self, "_ie_static", None)
        if static is not None and steer:
            entry.graph_steer, entry.error = self._graph_steer(static.steer, steer)
        self._ie_specs[key] = entry
        return True

    def _graph_steer(self, buffers: StaticSteer | None, steer: list[dict]) -> tuple[list[GraphSteer], str | None]:
        """Graph mode: each steering entry prepared once (its direction on the device, its numbers); an error for a
        site that was not declared, or a site steered twice (one method per request and site per forward), which
        the client refuses first."""
        out: list[GraphSteer] = []
        declared = buffers.sites if buffers is not None else {}
        device = next(self._ie_model.parameters()).device
        for s in steer:
            point = s["address"]
            if point not in declared:
                return [], f"steering {point} in graph mode: it is not a declared steering site ({sorted(declared)})"
            if any(g.point == point for g in out):
                return [], f"steering {point} twice in one request in graph mode"
            vec = steer_ops.direction(s["method"], s["vector_t"], normalize=bool(s["kwargs"].get("normalize")))
            params = torch.tensor(params_of(s["method"], s["kwargs"]), dtype=torch.float32)
            out.append(GraphSteer(point, METHOD_INDEX[s["method"]], s["positions"], vec.to(device), params.to(device)))
        return out, None

    def ie_release(self, key: str) -> bool:
        spec = self._ie_specs.pop(key, None)
        if spec is not None and spec.forwards:
            self._ie_ran += 1
        return spec is not None

    def ie_exit_role(self) -> str | None:
        """Which of vLLM's processes this worker runs in, where that process ends without the interpreter's teardown
        (child_exit.py): 'engine core', 'worker', or None (the client's own process). Any mode, before ie_install."""
        return child_exit.installed_role()

    def ie_state(self) -> dict:
        """What the worker holds: for tests that an abort leaves nothing behind."""
        return {
            "specs": sorted(self._ie_specs),
            "rows_in_flight": self._ie_rows is not None,
            "steering": sum(len(s.steer) for s in self._ie_specs.values()),
            "hooks": len(self._ie_handles),
            "installed": bool(getattr(self, "_ie_installed", False)),
            # which engine this worker serves, and how many registered requests it ran: with data parallelism, the
            # proof that every rank served requests with ie_lab's hooks in place
            # (vLLM renumbers a dense model's independent ranks to 0 inside each engine; data_parallel_index keeps it)
            "dp_rank": int(getattr(getattr(self, "parallel_config", None), "data_parallel_index", 0) or 0),
            "pid": os.getpid(),
            "requests_run": getattr(self, "_ie_ran", 0),
            # which of vLLM's processes this worker runs in, where it ends without the interpreter's teardown
            # (child_exit.py): 'engine core', 'worker', or None (in the client's process)
            "fast_exit": child_exit.installed_role(),
        }


# Graph mode's model loader must be known wherever this module is imported: the client (which validates
# load_format) and every worker (vLLM imports the extension class before it loads the model).
from . import static_taps as _static_taps  # noqa: E402

_static_taps.register_loader()
