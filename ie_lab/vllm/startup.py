"""Building the vLLM engine for a VLLMBackend: the checkpoint's facts and structure checked first, vLLM's model
class chosen, the engine (in process or not, hooks or a compiled graph) started and its worker asked what it
serves. A room of VLLMBackend (ie_lab/vllm/backend.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from ..arch import quirks
from ..arch.config_facts import ArchFacts
from ..errors import (
    CapabilityUnsupported,
)
from .checks import (
    VLLMModel,
    graph_point_names,
    refuse_unserved_layout,
    steer_point_names,
)
from .engine import AsyncDriver, InprocDriver, engine_args
from .quantized import check_quantized

# vllm itself is imported inside the methods that build requests (SamplingParams, TokensPrompt): it is an optional,
# heavy dependency, and importing this module must not import it.


VERIFIED_FAMILIES = quirks.VLLM_VERIFIED


def _config_keys(model_type: str, cfg: Any) -> dict:
    """hf_overrides for the config keys vLLM's model reads where transformers' model uses another key
    (quirks.VLLM_CONFIG_KEYS), each only where the checkpoint's config lacks it: the model vLLM builds is then the
    one transformers builds from the same config."""
    keys = quirks.VLLM_CONFIG_KEYS.get(model_type, ({}, ""))[0]
    fill = {k: getattr(cfg, src) for k, src in keys.items() if getattr(cfg, k, None) is None}
    return {"hf_overrides": fill} if fill else {}


class _Startup:
    """Loading the model into a new engine (`_aload`), from the Session's arguments."""

    # attributes another room of the same class defines (declared for the type checker; no value here, so
    # nothing shadows the owner at run time)
    _engine_auto: Any
    engine_kind: str
    _mode: Any
    _dp: int

    async def _aload(self, path, tokenizer, tp, prefix, max_model_len, seed, trust_remote_code, extra):
        if os.path.isdir(os.path.expanduser(path)):
            path = os.path.expanduser(path)
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        facts = ArchFacts.from_config(cfg)
        if facts.model_type in quirks.VLLM_DIFFERS:
            raise CapabilityUnsupported(
                f"{facts.model_type} on backend='vllm'",
                quirks.VLLM_DIFFERS[facts.model_type] + ".",
                "use backend='eager', which runs transformers' own model.",
            )
        if facts.model_type in quirks.VLLM_CANNOT_RUN:
            raise CapabilityUnsupported(
                f"{facts.model_type} on backend='vllm'",
                f"vLLM itself fails on this family: {quirks.VLLM_CANNOT_RUN[facts.model_type]}.",
                "use backend='eager', which serves every point on this family.",
            )
        if facts.model_type in quirks.VLLM_RUNS_UNBOUND:
            raise CapabilityUnsupported(
                f"{facts.model_type} on backend='vllm'",
                f"vLLM runs this family, but ie_lab's worker does not read it yet: "
                f"{quirks.VLLM_RUNS_UNBOUND[facts.model_type]}.",
                "use backend='eager', which serves every point on this family.",
            )
        # A wrapper (a multimodal model around a text trunk: Gemma 3, GOT-OCR2) is verified on its own: vLLM builds
        # the wrapper's model class, towers and all, whatever trunk it holds.
        checked = getattr(cfg, "model_type", None) or facts.model_type
        if facts.model_type not in VERIFIED_FAMILIES or checked not in VERIFIED_FAMILIES:
            raise CapabilityUnsupported(
                f"{checked} on backend='vllm'",
                f"ie_lab's vLLM worker has not been verified point by point against eager on {checked} "
                "(validator/README.md lists what differs or does not load), and ie_lab does not serve tensors it "
                "has not checked.",
                "use backend='eager', which serves every point on this family.",
            )
        if facts.model_type in quirks.VLLM_CONFIG_LIMITS:
            key, runs, why = quirks.VLLM_CONFIG_LIMITS[facts.model_type]
            value = getattr(cfg.get_text_config(), key, None)  # a wrapper's (Llama 4's) text config holds it
            if value not in runs:
                raise CapabilityUnsupported(
                    f"{facts.model_type} with {key}={value!r} on backend='vllm'",
                    f"vLLM itself runs this family only with {key} in {list(runs)}: {why}.",
                    "use backend='eager', which serves every point with this config.",
                )
        if facts.model_type in quirks.VLLM_CONFIG_EQUAL:
            key, other, why = quirks.VLLM_CONFIG_EQUAL[facts.model_type]
            value, want = getattr(cfg, key, None), getattr(cfg, other, None)
            if value is not None and value != want:
                raise CapabilityUnsupported(
                    f"{facts.model_type} with {key}={value!r} and {other}={want!r} on backend='vllm'",
                    f"vLLM itself runs this family only with {key} equal to {other}: {why}.",
                    "use backend='eager', which serves every point with this config.",
                )
        refuse_unserved_layout(cfg, facts)
        if facts.model_type in quirks.VLLM_WINDOW_CAPPED:
            cap = int(cfg.sliding_window)
            self._len_why = (
                f"{facts.model_type} is served on vLLM only up to its sliding window of {cap} tokens, "
                f"where vLLM and transformers agree: {quirks.VLLM_WINDOW_CAPPED[facts.model_type]}."
            )
            if max_model_len is not None and max_model_len > cap:
                raise CapabilityUnsupported(
                    f"max_model_len={max_model_len} on {facts.model_type}",
                    self._len_why,
                    f"use max_model_len <= {cap} (the default here), or backend='eager'.",
                )
            max_model_len = min(cap, facts.max_positions or cap)
        if tp > 1 and facts.model_type in quirks.VLLM_SINGLE_RANK:
            raise CapabilityUnsupported(
                f"tensor_parallel_size={tp} on {facts.model_type}",
                "vLLM's layer for this family adds attention and MLP outputs before a single all-reduce, so with "
                "tensor parallelism no rank holds attn_out or mlp_out.",
                "use tensor_parallel_size=1 (or backend='eager').",
            )
        tok_src = os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else path
        tok = (
            tokenizer
            if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike))
            else AutoTokenizer.from_pretrained(tok_src, trust_remote_code=trust_remote_code)
        )
        dtype = self._torch_dtype or getattr(cfg, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        # a quantized checkpoint: served only where its kernels were checked
        check_quantized(cfg, dtype, graph=self._graph is not None or self._steer_pts is not None)
        self._max_len = int(max_model_len or facts.max_positions or 0) or None
        if self._graph is not None or self._mode == "generate":
            if self._graph is not None:
                self._graph = graph_point_names(facts, self._graph, allow_empty=self._steer_pts is not None)
            if self._steer_pts is not None:
                self._steer_pts = steer_point_names(facts, self._steer_pts)
            self._graph_dir = tempfile.mkdtemp(prefix="ie_lab-vllm-compile-")
            # also when the session is never closed (a notebook restarted, a script that just ends)
            self._graph_dir_gone = weakref.finalize(self, shutil.rmtree, self._graph_dir, True)

        def make_args() -> Any:
            return engine_args(
                path,
                tokenizer=tok_src,
                dtype=str(dtype).replace("torch.", ""),
                tensor_parallel_size=tp,
                data_parallel_size=self._dp,
                enable_prefix_caching=prefix,
                max_model_len=max_model_len or facts.max_positions,
                seed=seed,
                extra={"trust_remote_code": trust_remote_code, **extra, **_config_keys(facts.model_type, cfg)},
                async_engine=self.engine_kind == "async",
                graph_points=self._graph,
                compile_dir=self._graph_dir,
                steer_points=self._steer_pts,
                generate_only=self._mode == "generate",
                native_ops=quirks.VLLM_NATIVE_OPS.get(facts.model_type, ((), ""))[0],
            )

        args = make_args()
        model_config = args.create_model_config()
        if model_config.using_transformers_backend():  # vLLM's own choice, before it builds anything
            self._transformers_backend(facts.model_type, tp)
            args = make_args()
        if self._dp > 1 and model_config.is_moe:
            raise CapabilityUnsupported(
                f"data_parallel_size={self._dp} on {facts.model_type} (a mixture of experts)",
                "vLLM's data-parallel engines run a mixture of experts' layers together (the experts sharded across "
                "ranks, each forward's tokens gathered from every rank, idle ranks stepping dummy batches), which "
                "ie_lab has not checked against eager; dense models' ranks run independently.",
                "use data_parallel_size=1, or ie_lab.harvest_on_ray, one Session per part (docs/HARVEST.md).",
            )
        self._driver = InprocDriver(args) if self.engine_kind == "inproc" else AsyncDriver(args, dp=self._dp)
        await self._driver.build()
        if self._mode == "generate":
            # nothing is installed: a Python hook inside the compiled model would run only while it is traced
            info = {
                "model_class": (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0],
                "n_layers": facts.n_layers,
                "present": {},
                "tp_size": tp,
                "final_norm": False,
                "mode": "generate",
            }
        else:
            info = (await self._driver.rpc("ie_install"))[0]  # every worker of every data-parallel rank installs
        return VLLMModel(path, facts, tok, dtype, info)

    def _transformers_backend(self, model_type: str, tp: int) -> None:
        """vLLM runs this family through its Transformers modeling backend (it has no model of its own for it), which
        decorates transformers' own model class for vLLM's compiler in the process that builds the engine: its
        __init__ and __call__ are replaced, so an eager model of that class in the same process fails on its next
        forward ('...Model' object has no attribute 'do_not_compile') and no new one can be built (vLLM's config
        is not set). The engine therefore runs in a process of its own, where the decorated class stays. Its
        points are checked against eager on one rank only (tests/test_vllm_transformers_backend.py)."""
        if self._dp > 1:
            raise CapabilityUnsupported(
                f"data_parallel_size={self._dp} for {model_type}",
                "vLLM runs this family through its Transformers modeling backend, whose points ie_lab has checked "
                "against eager in one engine only.",
                "use data_parallel_size=1, or ie_lab.harvest_on_ray for a harvest in parts (docs/HARVEST.md).",
            )
        if tp > 1:
            raise CapabilityUnsupported(
                f"tensor_parallel_size={tp} for {model_type}",
                "vLLM runs this family through its Transformers modeling backend, whose points ie_lab has checked "
                "against eager on one rank only (how that backend shards transformers' attention and MoE modules "
                "across ranks is not checked).",
                "use tensor_parallel_size=1, or backend='eager'.",
            )
        if self.engine_kind == "async":
            return
        if not self._engine_auto:
            raise CapabilityUnsupported(
                f"engine='inproc' for {model_type}",
                "vLLM runs this family through its Transformers modeling backend, which decorates transformers' own "
                "model class for vLLM's compiler in the process that builds the engine; eager models of that class in "
                "this process would then fail on their next forward, and none could be built.",
                "use engine='auto' or engine='async': the engine then runs in a process of its own (in a script, "
                "start the Session under `if __name__ == '__main__':`, as vLLM's own processes require).",
            )
        self.engine_kind = "async"
