"""load(): from an HF id, a local folder or a model object to an EagerModel, the in-process model handle."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch

from ..arch.config_facts import UNBOUND_INSTEAD, ArchFacts, unbound_structure
from ..capabilities import LOAD_CAPABILITY, require
from ..core.files import check_folder, read_json

# The argument checks live in the core: the vLLM backend and the Session read them too.
from ..core.load_checks import (
    check_flags,
    check_tokenizer_arg,
    default_dtype,
    pick_device,
    resolve_dtype,
)
from ..errors import ArchitectureUnsupported, CapabilityUnsupported, InputError
from . import quantized
from .model import EagerModel, choose_attention

# transformers and huggingface_hub are imported inside the functions that load a model: `import ie_lab` does not
# pay for them until a model is loaded.


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _on(p: torch.Tensor, want: torch.device) -> bool:
    return p.device.type == want.type and (
        want.index is None or p.device.index == want.index or (p.device.index is None and want.index == 0)
    )


def _needs_change(model: torch.nn.Module, dev: torch.device | None, dtype: torch.dtype | None) -> bool:
    for p in model.parameters():
        if dev is not None and not _on(p, dev):
            return True
        if dtype is not None and p.is_floating_point() and p.dtype != dtype:
            return True
    return False


def _json_in(src: str, filename: str) -> dict:
    """A JSON file of a folder or hub repo (the file only: nothing in it runs), or {} when there is none."""
    path: str | None
    if os.path.isdir(src):
        path = os.path.join(src, filename)
        path = path if os.path.lexists(path) else None  # there but no regular file: read_json refuses it
    else:
        from transformers.utils import cached_file

        try:
            path = cached_file(
                src,
                filename,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
        except OSError:
            path = None
    if not path:
        return {}
    got = read_json(path, f"the model's {filename}")
    if not isinstance(got, dict):
        raise InputError(f"{filename} of {src!r} holds a JSON {type(got).__name__}, not an object; it is damaged.")
    return got


def _tokenizer_code(src: str) -> str | None:
    """The custom tokenizer class a folder or repo names through auto_map, if any (read, never imported)."""
    for filename in ("tokenizer_config.json", "config.json"):
        auto = _json_in(src, filename).get("auto_map") or {}
        ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
        if ref:
            names = [r for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if r]
            return f"{' / '.join(names)} (auto_map in {filename})"
    return None


def _refuse_tokenizer_code(src: str, trust_remote_code: bool) -> None:
    code = _tokenizer_code(src)
    if code and not trust_remote_code:
        raise InputError(
            f"the tokenizer at {src!r} is custom code: {code}. ie_lab runs no code from a model's files unless you "
            "pass trust_remote_code=True after reading it, and it will not swap in a generic tokenizer that may split "
            "text differently. Pass trust_remote_code=True, or tokenizer= a tokenizer you built yourself."
        )


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer.tiktoken",
)


def _load_tokenizer(src: str, trust_remote_code: bool, asked: bool):
    """The tokenizer at `src`, or None where there is none (the load line says so); custom code only if trusted."""
    from transformers import AutoTokenizer

    if os.path.isdir(src):
        check_folder(src, "the tokenizer folder's")
    _refuse_tokenizer_code(src, trust_remote_code)
    if not asked and os.path.isdir(src) and not any(os.path.isfile(os.path.join(src, f)) for f in _TOKENIZER_FILES):
        return None
    try:
        with _transformers_bars_off():  # a hub download of the tokenizer files would draw the hub's bars
            return AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if (
            not asked
            and not os.path.isdir(src)
            and not (_json_in(src, "tokenizer_config.json") or _json_in(src, "tokenizer.json"))
        ):
            return None  # a hub repo that ships no tokenizer
        raise InputError(
            f"could not load the tokenizer at {src!r} ({type(e).__name__}: {str(e).strip()[:300]}). "
            "Pass tokenizer= a tokenizer object, or the id or folder of one."
        ) from None


def _check_tokenizer_arg(tokenizer: Any, trust_remote_code: bool):
    if isinstance(tokenizer, (str, os.PathLike)):
        return _load_tokenizer(os.path.expanduser(os.fspath(tokenizer)), trust_remote_code, asked=True)
    return tokenizer


@contextlib.contextmanager
def _transformers_bars_off():
    """Hide transformers' own bars ("Loading weights ...") and huggingface_hub's for one load, then put the
    user's global settings back, even after an error. ie_lab shows its own single bar (Session(progress=...));
    transformers' would show even with progress=False. transformers' switch also flips the hub's (5.19, 5.24)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    tf_on, hub_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if tf_on else hf_logging.disable_progress_bar)()
        (disable_progress_bars if hub_off else enable_progress_bars)()


def load(
    model_or_path: Any,
    tokenizer: Any = None,
    backend: str = "eager",
    device: Any = None,
    dtype: Any = None,
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    quiet: bool = False,
):
    """Wrap a raw transformers causal LM for ie_lab.

    Returns an EagerModel, whatever is passed: the in-process model the free functions (ie_lab.capture,
    ie_lab.generate, ...) compute on, and what a Session on the eager backend holds. backend='eager' or 'auto' (the
    same); backend='vllm' refuses: vLLM keeps the model inside its engine, which only a Session drives, so its handle
    is ie_lab.Session(path, backend='vllm'), whose methods are the same operations (docs/ARCHITECTURE.md, Backends).

    model_or_path: an HF id, a local folder, or an already-built model object (pass its tokenizer too).
    Weights load from safetensors only; remote code (model or tokenizer) runs only with trust_remote_code=True.
    attn_implementation: by default the kernel that computes everything the config asks for (eager where sdpa would
    drop a soft-cap, else transformers' default); another one is honoured with a ComputeDiffersWarning if it drops
    something. A model object is never changed behind your back: asking for another dtype or device works on a
    copy, and the eval mode ie_lab needs is undone by Session.close() or lm.release(). The load line says each.
    """
    if backend not in ("eager", "vllm", "auto"):
        raise InputError(f"unknown backend {backend!r}; use 'eager', 'vllm' or 'auto'.")
    if backend == "vllm":
        require(LOAD_CAPABILITY, "vllm")
    check_flags(trust_remote_code=trust_remote_code, quiet=quiet)
    check_tokenizer_arg(tokenizer)
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise InputError(f"attn_implementation must be a name such as 'eager' or 'sdpa', got {attn_implementation!r}.")
    torch_dtype = resolve_dtype(dtype)
    if isinstance(model_or_path, torch.nn.Module):
        return _load_object(
            model_or_path, tokenizer, device, torch_dtype, attn_implementation, trust_remote_code, quiet
        )
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise InputError(f"expected an HF id, a folder path or a model object, got {type(model_or_path).__name__}.")
    from transformers import AutoConfig, AutoModelForCausalLM

    src = os.fspath(model_or_path)
    looks_local = src.startswith((".", "/", "~")) or os.sep in src and not src.count("/") == 1
    if looks_local and not os.path.isdir(os.path.expanduser(src)):
        raise InputError(f"no folder at {src!r}: check the path (it should hold config.json and *.safetensors).")
    if os.path.isdir(os.path.expanduser(src)):
        src = os.path.expanduser(src)
        check_folder(src, "the model folder's")  # transformers opens its files: none may block or never end
        if not any(f.endswith(".safetensors") for f in os.listdir(src)):
            raise InputError(
                f"{src!r} holds no .safetensors weights; ie_lab loads safetensors only "
                "(convert with model.save_pretrained(path, safe_serialization=True))."
                + quantized.pickle_words(os.path.join(src, "config.json"))
            )
    dev, why = pick_device(device)
    asked_dtype, torch_dtype = torch_dtype, torch_dtype or default_dtype(dev)
    # Everything that can refuse does so from the config and the tokenizer files, before any weights are read.
    try:
        with _transformers_bars_off():
            config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise InputError(
            f"could not load {src!r}: {e}. Check the id or path; offline, the weights must already be "
            "in the local HF cache or a folder."
        ) from None
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise InputError(
                f"{src!r} needs custom code from its repository; ie_lab runs none unless you pass "
                "trust_remote_code=True after reading that code."
            ) from None
        raise
    found = unbound_structure(config)
    if found is not None:
        raise ArchitectureUnsupported(found[0], found[1], UNBOUND_INSTEAD)
    facts = ArchFacts.from_config(config)  # refuses a config it cannot read, naming what is missing
    asked_tokenizer = tokenizer is not None
    if asked_tokenizer:
        tokenizer = _check_tokenizer_arg(tokenizer, trust_remote_code)
    else:
        _refuse_tokenizer_code(src, trust_remote_code)
    impl, attn_words = choose_attention(facts.raw, attn_implementation)
    kwargs = {"attn_implementation": impl} if impl else {}
    quant = quantized.method_of(config)
    torch_dtype = quantized.torchao_dtype(quant, config, asked_dtype, torch_dtype, src)
    try:
        with _transformers_bars_off(), quantized.bars_off(quant):
            model = AutoModelForCausalLM.from_pretrained(
                src, dtype=torch_dtype, use_safetensors=True, trust_remote_code=trust_remote_code, **kwargs
            )
    except OSError as e:
        raise InputError(
            f"could not load {src!r}: {e}. Check the id or path; offline, the weights must already be "
            "in the local HF cache or a folder."
        ) from None
    except (ValueError, ImportError, RuntimeError) as e:
        if quant is not None and isinstance(e, (ImportError, RuntimeError)):
            quantized.refuse_unloadable(quant, src, e)  # the method's package or hardware is missing
        if isinstance(e, RuntimeError):
            raise
        if attn_implementation is not None:
            raise InputError(
                f"attn_implementation={attn_implementation!r} cannot run here: {e}. Use 'eager' or "
                "'sdpa', or leave it unset."
            ) from None
        raise
    quantized.dequantize(model)  # compressed-tensors: dense weights now, not on the first forward
    model.to(dev).eval()
    if not asked_tokenizer:
        tokenizer = _load_tokenizer(src, trust_remote_code, asked=False)
    lm = EagerModel(model, tokenizer, name=os.fspath(model_or_path))
    if not quiet:
        words = [why, f"dtype {_name(torch_dtype)}"]
        words.append(attn_words or f"attention {getattr(model.config, '_attn_implementation', '?')}")
        if quant is not None:
            words.append(quantized.load_words(model) or "")
        if tokenizer is None:
            words.append("no tokenizer found: pass ids, or tokenizer= to use text")
        print("ie_lab: " + "; ".join(words))
    return lm


def _check_weights(model: torch.nn.Module) -> None:
    """Refuse, before anything touches it, a model object with no weights or with weights on the meta device."""
    if next(model.parameters(), None) is None:
        raise InputError(
            f"the {type(model).__name__} object has no parameters, so it is no language model to run: pass a "
            "transformers causal LM (AutoModelForCausalLM.from_pretrained(...)) or a folder or HF id."
        )
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, t in tensors if t.is_meta]
    if meta:
        raise InputError(
            f"{len(meta)} of the model's {len(tensors)} weights and buffers are on the meta device (e.g. {meta[0]}): "
            "shapes without numbers, as a model built under torch.device('meta') or init_empty_weights is, or one a "
            "device_map offloaded, so nothing can be computed. Load the real weights first (model.to_empty("
            "device='cpu') then model.load_state_dict(...), or AutoModelForCausalLM.from_pretrained(path) without "
            "offloading), or pass the folder or HF id to ie_lab.load / Session."
        )


def _load_object(
    model: torch.nn.Module,
    tokenizer: Any,
    device: Any,
    torch_dtype: torch.dtype | None,
    attn_implementation: str | None,
    trust_remote_code: bool,
    quiet: bool,
):
    if attn_implementation is not None:
        # Switching kernels on the caller's object would change their model; ie_lab leaves that to them.
        raise CapabilityUnsupported(
            "attn_implementation= with a model object",
            "the kernel is part of the object you built, and ie_lab does not change your object.",
            f"call model.set_attn_implementation({attn_implementation!r}) yourself first, or load from the folder "
            f"or id with attn_implementation={attn_implementation!r}.",
        )
    _check_weights(model)
    tokenizer = _check_tokenizer_arg(tokenizer, trust_remote_code)
    dev = pick_device(device)[0] if device is not None else None
    p = next(model.parameters())
    given = f"{p.device}, {_name(p.dtype)}"
    notes = []
    if _needs_change(model, dev, torch_dtype):
        # Never cast or move the caller's object in place: casting back does not restore the weights.
        target = copy.deepcopy(model).to(device=dev, dtype=torch_dtype)
        target.eval()
        q = next(target.parameters())
        notes.append(
            f"working on a copy in {_name(q.dtype)} on {q.device} (your object stays {given}; the copy "
            "takes memory of its own)"
        )
        lm = EagerModel(target, tokenizer)
    else:
        lm = EagerModel(model, tokenizer)
        notes.append(f"model object on {given} (kept as given)")
        if lm.hold_eval():
            notes.append(
                "switched from training to eval mode (dropout off); Session.close() or lm.release() "
                "restores each module's mode"
            )
    if not quiet:
        notes.append(f"attention {getattr(lm.hf.config, '_attn_implementation', '?')}")
        print("ie_lab: " + "; ".join(notes))
    return lm


# What each option of load() / Session() does to the answer on the eager backend (docs/CAPABILITIES.md is generated
# from this). tests/test_option_audit.py checks every row: the result equals the raw transformers model run with
# the same option, or the call refuses.
OPTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "`dtype`",
        "the weights and every activation are computed in that dtype; from a folder or id the weights load "
        "in it (`from_pretrained(dtype=...)`), a model object is copied and cast (your object is left as it is). "
        "Default: float32 on CPU, bfloat16 (or float16) on CUDA, float16 on MPS",
        "equals the raw model loaded (or cast) with the same dtype, bit for bit; unknown names refuse",
    ),
    (
        "`device`",
        "where the model runs; a model object elsewhere is copied there (your object stays put). Default: "
        "CUDA, then MPS, then CPU, with the reason in the load line",
        "cpu audited here (equals the raw model); a device that is not present refuses",
    ),
    (
        "`attn_implementation`",
        "the attention kernel. Unset: the one that computes everything the config asks for "
        "(eager where sdpa would drop `attn_logit_softcapping`, as on Gemma 2; transformers' default elsewhere, where "
        "the kernels agree to float noise); the load line names it and why. Set: honoured, with a "
        "`ComputeDiffersWarning` when it drops something (`quirks.ATTENTION_KERNEL_DROPS`). A model object keeps the "
        "kernel it was built with (warned the same way); passing the option with an object refuses",
        "equals the raw model with the same kernel; unset, equals the eager reference and differs from sdpa on Gemma 2; "
        "a kernel that cannot run here refuses",
    ),
    (
        "`tokenizer`",
        "how text becomes ids: unset, the folder's or id's own tokenizer (none found: the load line says "
        "so and text input refuses); a path or id loads that one; an object is used as given",
        "ids equal the raw tokenizer's on the same text; a tokenizer that fails to load refuses",
    ),
    (
        "`trust_remote_code`",
        "lets custom code from the model's files run (model or tokenizer classes named by "
        "`auto_map`). Without it such a model or tokenizer refuses before any of its code is imported, never replaced "
        "by a generic class",
        "refusal checked with code that would leave a trace if imported",
    ),
    (
        "`backend='vllm'` engine arguments (`engine_kwargs`)",
        "only an allow-list reaches vLLM (batch size, token budget and chunked prefill, KV block size, memory sizing, "
        "`max_logprobs`, logging and loading): none changes a captured or steered tensor. Anything that compiles the "
        "model (`enforce_eager=False`, `compilation_config`: use `graph_points=`), changes numerics hooks cannot see "
        "(`kv_cache_dtype`, quantization), runs draft tokens, or repeats a Session keyword is refused at load with why; "
        "the table is in docs/VLLM.md",
        "every refusal, and an allowed set (8-token chunks, a batch of 2) equal to eager, in "
        "tests/test_vllm_reliability.py",
    ),
)


def options_markdown() -> str:
    rows = ["| option | what it does to the answer (eager) | audit |", "| --- | --- | --- |"]
    rows += [f"| {o} | {what} | {audit} |" for o, what, audit in OPTIONS]
    return "\n".join(rows) + "\n"
