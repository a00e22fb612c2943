"""Graph mode: static taps compiled into vLLM's graph for a set of points declared at engine start.

With ``enforce_eager=False`` vLLM traces the model's trunk once (torch.compile) and, on GPUs, replays it
from CUDA graphs: Python hooks inside the trunk run only while it is traced, never afterwards. A static tap
is therefore pure tensor work that the trace records: ``buffer[:n].copy_(tensor)`` into a buffer allocated
before tracing (fixed address, room for the largest batch). Everything per request (which rows belong to
whom, positions, tensor-parallel gathers) happens outside the trunk, in the worker's hooks on the top-level
model, which stay Python on every step (vLLM graphs the trunk piecewise; ie_lab asks for PIECEWISE).

Taps must be in place before vLLM traces the model, which happens while the engine is built, before any
``collective_rpc`` can reach the worker. So graph mode loads the weights through a model loader of its own
(``load_format="ie_lab_static"``): vLLM's safetensors loader, then the taps. The declared points travel in
``model_loader_extra_config``. A tick/echo pair checks on every step that the taps really ran in the
compiled graph (a stale compile cache or a fully graphed forward would skip them): a forward whose echo is
stale raises instead of returning nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .layer_binding import _tp_size, bind_vllm
from .sites import hook_targets, site_table
from .static_steer import StaticSteer, allocate, steer_hook

LOAD_FORMAT = "ie_lab_static"
CONFIG_KEY = "ie_lab_static_points"
STEER_KEY = "ie_lab_static_steer"


@dataclasses.dataclass
class Tap:
    point: str  # base address, "resid_post.3" or "embeddings"
    buffer: torch.Tensor  # [max tokens in one forward, width on this rank]
    sharded: bool  # this rank holds a slice of the width: gather across tensor-parallel ranks after reading


class StaticTaps:
    """The buffers and the tick/echo liveness pair of one model; stored on the model as ``_ie_static``. ``steer``:
    the declared steering sites' buffers (static_steer.py), None where none were declared."""

    def __init__(self, taps: dict[str, Tap], tick: torch.Tensor, echo: torch.Tensor, steer: StaticSteer | None = None):
        self.taps, self.tick, self.echo, self.steer = taps, tick, echo, steer
        self.step = 0

    def arm(self) -> None:
        """Before a forward (outside the graph): a new tick the compiled graph must echo."""
        self.step = (self.step + 1) % (1 << 20)
        self.tick.fill_(self.step)

    def check(self) -> None:
        sites = {} if self.steer is None else self.steer.sites
        seen = torch.cat([self.echo] + [x.echo for x in sites.values()]).tolist()  # one device read for all
        stale = [p for p, e in zip(sites, seen[1:]) if e != self.step]
        if stale:
            raise RuntimeError(
                f"ie_lab graph mode: the steering at {stale} did not run in this forward (the compiled graph does not "
                "contain it: a stale vLLM compile cache, or a fully graphed forward). Restart the Session, or "
                "create it without steer_points."
            )
        if seen[0] != self.step:
            raise RuntimeError(
                "ie_lab graph mode: the static taps did not run in this forward (the compiled graph does not "
                "contain them: a stale vLLM compile cache, or a fully graphed forward). Nothing was captured; "
                "restart the Session, or create it without graph_points."
            )


def install(
    model: nn.Module,
    points: list[str],
    max_tokens: int,
    d_model: int,
    steer_points: list[str] | None = None,
    max_seqs: int = 1,
) -> StaticTaps:
    """Allocate one buffer per declared point (and the buffers of each declared steering site) and register the
    hooks; before vLLM traces the model. The sites are the worker's (sites.py): a tap reads exactly what the
    eager-mode hook reads, and a steering site edits what it edits. Hooks go in the table's order, a site's
    steering before its tap, so a tap reads what the sites before it handed on (as the worker's hooks do)."""
    steer_points = list(steer_points or [])
    bound = bind_vllm(model)
    sites = {site.point: site for site in site_table(model, d_model, bound)}
    hook_on = hook_targets(model, bound[2])  # where a site's module is not what its hooks go on (sites.py)
    missing = [p for p in points + steer_points if p not in sites]
    if missing:
        raise RuntimeError(
            f"ie_lab graph mode: {missing} do not exist on {type(model).__name__}; declare some of {sorted(sites)}"
        )
    not_steerable = [p for p in steer_points if sites[p].write is None]
    if not_steerable:
        raise RuntimeError(f"ie_lab graph mode: {not_steerable} cannot be steered (no site hands an edit on)")
    param = next(model.parameters())
    sharded_ok = _tp_size() > 1  # one rank holds the whole width: nothing to gather
    steer = allocate(steer_points, max_tokens, max_seqs, d_model, param.device) if steer_points else None
    tick = torch.zeros(1, dtype=torch.int64, device=param.device)
    taps: dict[str, Tap] = {}
    wanted = set(points) | set(steer_points)
    for site in sites.values():  # the table's order
        p = site.point
        if steer is not None and p in steer.sites:
            side, edit = steer_hook(site, steer.sites[p], steer.slot, tick)
            if side == "pre":
                hook_on.get(id(site.module), site.module).register_forward_pre_hook(edit, with_kwargs=True)
            else:
                hook_on.get(id(site.module), site.module).register_forward_hook(edit)
        if p not in points:
            continue
        width = site.width()
        if width is None:  # pragma: no cover - the table was built with d_model just above
            raise RuntimeError(f"ie_lab graph mode: no width for {p}")
        buf = torch.zeros(max_tokens, int(width), dtype=param.dtype, device=param.device)
        taps[p] = Tap(p, buf, site.sharded and sharded_ok)
        if site.side == "pre":

            def hook(m, args, kwargs, _b=buf, _f=site.read):
                t = _f(args, kwargs)
                _b[: t.shape[0]].copy_(t)

            hook_on.get(id(site.module), site.module).register_forward_pre_hook(hook, with_kwargs=True)
        else:

            def hook(m, args, out, _b=buf, _f=site.read):
                t = _f(args, out)
                _b[: t.shape[0]].copy_(t)

            hook_on.get(id(site.module), site.module).register_forward_hook(hook)
    # A declared site whose value is a sum the layer forms (sites.Partner): the earlier module's output is kept for
    # it and dropped after the site's module returns (registered after the site's hooks, so it runs after them).
    for site in {id(x.partner): x for x in sites.values() if x.partner is not None and x.point in wanted}.values():
        assert site.partner is not None
        site.partner.module.register_forward_hook(site.partner.keep)
        site.module.register_forward_hook(site.partner.drop)
    taps = {p: taps[p] for p in points}  # the declared order
    echo = torch.full((1,), -1, dtype=torch.int64, device=param.device)
    embed = sites["embeddings"].module

    def canary(m, a, o):  # returns None: a forward hook's return value would replace the module's output
        echo.copy_(tick)

    embed.register_forward_hook(canary)
    static = StaticTaps(taps, tick, echo, steer)
    model._ie_static = static  # type: ignore[assignment]  # an attribute of ours on vLLM's module
    return static


def register_loader() -> None:
    """Make ``load_format="ie_lab_static"`` known to vLLM in this process (client, engine core and workers
    all import this module: the worker extension lives next to it)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as known
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if LOAD_FORMAT in known:
        return

    @register_model_loader(LOAD_FORMAT)
    class StaticTapLoader(DefaultModelLoader):
        """vLLM's safetensors loader, then the static taps (before vLLM compiles the model)."""

        def __init__(self, load_config: Any):
            extra = dict(load_config.model_loader_extra_config or {})
            self.ie_points = list(extra.pop(CONFIG_KEY, []))
            self.ie_steer = list(extra.pop(STEER_KEY, []))
            super().__init__(
                dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config=extra)
            )

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            model = super().load_model(vllm_config, model_config, prefix)
            install(
                model,
                self.ie_points,
                int(vllm_config.scheduler_config.max_num_batched_tokens),
                int(model_config.get_hidden_size()),
                self.ie_steer,
                int(vllm_config.scheduler_config.max_num_seqs),
            )
            return model
