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

from .sites import _tp_size, site_table

LOAD_FORMAT = "ie_lab_static"
CONFIG_KEY = "ie_lab_static_points"


@dataclasses.dataclass
class Tap:
    point: str  # base address, "resid_post.3" or "embeddings"
    buffer: torch.Tensor  # [max tokens in one forward, width on this rank]
    sharded: bool  # this rank holds a slice of the width: gather across tensor-parallel ranks after reading


class StaticTaps:
    """The buffers and the tick/echo liveness pair of one model; stored on the model as ``_ie_static``."""

    def __init__(self, taps: dict[str, Tap], tick: torch.Tensor, echo: torch.Tensor):
        self.taps, self.tick, self.echo = taps, tick, echo
        self.step = 0

    def arm(self) -> None:
        """Before a forward (outside the graph): a new tick the compiled graph must echo."""
        self.step = (self.step + 1) % (1 << 20)
        self.tick.fill_(self.step)

    def check(self) -> None:
        if int(self.echo.item()) != self.step:
            raise RuntimeError(
                "ie_lab graph mode: the static taps did not run in this forward (the compiled graph does not "
                "contain them: a stale vLLM compile cache, or a fully graphed forward). Nothing was captured; "
                "restart the Session, or create it without graph_points."
            )


def install(model: nn.Module, points: list[str], max_tokens: int, d_model: int) -> StaticTaps:
    """Allocate one buffer per declared point and register the taps; before vLLM traces the model. The sites
    are the worker's (sites.py): a tap reads exactly what the eager-mode hook reads."""
    sites = {site.point: site for site in site_table(model, d_model)}
    missing = [p for p in points if p not in sites]
    if missing:
        raise RuntimeError(
            f"ie_lab graph mode: {missing} do not exist on {type(model).__name__}; declare some of {sorted(sites)}"
        )
    param = next(model.parameters())
    sharded_ok = _tp_size() > 1  # one rank holds the whole width: nothing to gather
    taps: dict[str, Tap] = {}
    for p in points:
        site = sites[p]
        buf = torch.zeros(max_tokens, int(site.width()), dtype=param.dtype, device=param.device)
        taps[p] = Tap(p, buf, site.sharded and sharded_ok)
        if site.side == "pre":

            def hook(m, args, kwargs, _b=buf, _f=site.read):
                t = _f(args, kwargs)
                _b[: t.shape[0]].copy_(t)

            site.module.register_forward_pre_hook(hook, with_kwargs=True)
        else:

            def hook(m, args, out, _b=buf, _f=site.read):
                t = _f(args, out)
                _b[: t.shape[0]].copy_(t)

            site.module.register_forward_hook(hook)
    tick = torch.zeros(1, dtype=torch.int64, device=param.device)
    echo = torch.full((1,), -1, dtype=torch.int64, device=param.device)
    embed = sites["embeddings"].module

    def canary(m, a, o):  # returns None: a forward hook's return value would replace the module's output
        echo.copy_(tick)

    embed.register_forward_hook(canary)
    static = StaticTaps(taps, tick, echo)
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
            )
            return model
