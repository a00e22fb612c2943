"""The gradient verdict (Session.grad_support, ie_lab/eager/grad_support.py, capabilities.GradSupport): whether
gradients are available on a model and backend and what blocks them, read before any run.

Each blocker is shown to be real where it can be: the model the verdict blocks does fail (or silently lose part
of) a gradient, and the verdict names what is in the way; the model it passes gives gradients equal to finite
differences elsewhere (tests/test_jacobian_lens.py)."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import capabilities
from ie_lab.eager.grad_support import grad_support
from ie_lab.toy import tiny_model
from tests.conftest import assert_clean, hook_count
from tests.remote_fixtures import server_fixture, token_fixture  # noqa: F401 (pytest fixtures: server, token)


def _lm():
    m, t = tiny_model("llama")
    return ie_lab.load(m, t, quiet=True)


def _forwards(lm) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    seen: list[int] = []
    h = lm.hf.register_forward_pre_hook(lambda *a: seen.append(1))
    return seen, h


def test_a_float_model_on_eager_has_gradients_and_no_forward_runs(session):
    lm = session._lm
    seen, h = _forwards(lm)
    try:
        verdict = session.grad_support()
    finally:
        h.remove()
    assert seen == [] and verdict and verdict.available and verdict.reasons == () and verdict.backend == "eager"
    assert repr(verdict) == "GradSupport(available=True, backend='eager')"
    # llama's rotary embedding runs under torch.no_grad() (transformers decorates it), and blocks nothing: its
    # cos and sin depend on positions alone
    from ie_lab.eager.grad_support import _no_grad_forward

    assert _no_grad_forward(lm.hf.model.rotary_emb) == "torch.no_grad()"
    verdict.require("gradients")  # no refusal


def test_an_int8_parameter_blocks_gradients_and_is_named():
    lm = _lm()
    mlp = lm.hf.model.layers[1].mlp
    w = mlp.down_proj.weight
    mlp.down_proj.weight = torch.nn.Parameter(w.round().to(torch.int8), requires_grad=False)
    verdict = grad_support(lm)
    assert not verdict and len(verdict.reasons) == 1
    assert (
        "parameter model.layers.1.mlp.down_proj.weight (int8) holds integer or quantized values" in verdict.reasons[0]
    )
    assert "unquantized" in verdict.instead
    # what the verdict foretells: the operation is refused before any hook, naming the parameter
    with pytest.raises(ie_lab.CapabilityUnsupported, match=r"fit_jacobian_lens is not supported.*down_proj\.weight"):
        ie_lab.fit_jacobian_lens(lm, "The cat", progress=False)
    assert hook_count(lm.hf) == 0
    # so are gradients and a capture with grad=True, with the same reason, before any hook or forward
    seen, h = _forwards(lm)
    try:
        with pytest.raises(ie_lab.CapabilityUnsupported, match=r"gradients is not supported.*down_proj\.weight"):
            ie_lab.gradients(lm, "The cat", lambda logits: logits.sum(), "resid_post.0")
        with pytest.raises(ie_lab.CapabilityUnsupported, match=r"capture\(grad=True\).*down_proj\.weight"):
            ie_lab.capture(lm, "The cat", ["resid_post.0"], grad=True)
    finally:
        h.remove()
    assert seen == [] and hook_count(lm.hf) == 0
    # ... what the refusal saves: the model itself cannot run a backward through it (not even the float forward)
    with pytest.raises(RuntimeError):
        lm.hf(lm.tokenizer("The cat", return_tensors="pt").input_ids)
    assert_clean(lm)


def test_quantized_buffers_float8_and_many_parameters_are_named_with_a_count():
    lm = _lm()
    layers = lm.hf.model.layers
    layers[0].mlp.up_proj.register_buffer("qweight", torch.zeros(4, 4, dtype=torch.int32))  # GPTQ's packed weights
    layers[0].mlp.register_buffer("position_ids", torch.arange(4))  # an integer buffer that is no weight: fine
    verdict = grad_support(lm)
    assert not verdict and "parameter model.layers.0.mlp.up_proj.qweight (int32) holds" in verdict.reasons[0]
    if hasattr(torch, "float8_e4m3fn"):
        for lb in layers:
            for proj in (lb.mlp.gate_proj, lb.mlp.down_proj):
                proj.weight = torch.nn.Parameter(proj.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
        reason = grad_support(lm).reasons[0]
        assert reason.startswith("parameters model.layers.0.mlp.gate_proj.weight (float8_e4m3fn), ")
        assert "and 2 more hold integer or quantized values" in reason


def test_bitsandbytes_parameters_do_not_block():
    """bitsandbytes' 4-bit and 8-bit weights carry a backward for the input (QLoRA trains through them)."""

    class Int8Params(torch.nn.Parameter):  # the class name is what the verdict reads; bitsandbytes is not needed
        pass

    lm = _lm()
    proj = lm.hf.model.layers[0].mlp.down_proj
    proj.weight = Int8Params(proj.weight.detach().round().to(torch.int8), requires_grad=False)
    assert grad_support(lm)


def test_a_no_grad_module_on_the_residual_path_blocks_gradients():
    class FrozenAct(torch.nn.Module):
        @torch.no_grad()
        def forward(self, x):
            return torch.nn.functional.silu(x)

    lm = _lm()
    ids = torch.tensor([[5, 6, 7, 8]])

    def raw_grad():  # autograd on the raw model: d logit sum / d input embeddings
        emb = lm.hf.get_input_embeddings()(ids).detach().requires_grad_()
        lm.hf(inputs_embeds=emb).logits[0, -1].sum().backward()
        return emb.grad

    before = raw_grad()
    lm.hf.model.layers[1].mlp.act_fn = FrozenAct()
    verdict = grad_support(lm)
    assert not verdict
    assert verdict.reasons == (
        "module model.layers.1.mlp.act_fn (FrozenAct) runs its forward under torch.no_grad(), so nothing flows "
        "back through it",
    )
    # what it would have cost: the same forward (silu either way), but the MLP's share of the gradient is gone
    after = raw_grad()
    assert not torch.allclose(before, after, rtol=1e-3, atol=1e-6)
    # so ie_lab refuses the gradient it would get wrong, naming the module, before any hook
    with pytest.raises(ie_lab.CapabilityUnsupported, match=r"gradients is not supported.*act_fn \(FrozenAct\)"):
        ie_lab.gradients(lm, ids, lambda logits: logits[0, -1].sum(), "resid_post.0")
    assert_clean(lm)


def test_inference_mode_blocks_gradients():
    with torch.inference_mode():
        m, t = tiny_model("llama")
    lm = ie_lab.load(m, t, quiet=True)
    verdict = grad_support(lm)
    assert not verdict and "made under torch.inference_mode()" in verdict.reasons[0]
    assert "parameters model.embed_tokens.weight" in verdict.reasons[0]
    # the calling thread inside inference mode: no graph at all, whatever the model
    plain = _lm()
    with torch.inference_mode():
        inside = grad_support(plain)
    assert not inside and "this thread is inside torch.inference_mode()" in inside.reasons[0]
    assert "outside the `with torch.inference_mode():` block" in inside.instead
    assert grad_support(plain)  # outside it again


def test_vllm_says_no_without_an_engine():
    from ie_lab.vllm.backend import VLLMBackend

    backend = VLLMBackend("/no/such/folder")  # checks its arguments only: no engine starts, nothing is read
    assert backend.lm is None
    verdict = backend.grad_support()
    assert not verdict and verdict.backend == "vllm" and verdict.instead == "use backend='eager'"
    assert verdict.reasons == ("vLLM runs inference-only kernels with no autograd graph",)
    assert verdict == capabilities.table_grad_support("vllm")
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        verdict.require("gradients")
    with pytest.raises(ie_lab.CapabilityUnsupported) as want:
        capabilities.require("gradients", "vllm")
    assert str(e.value) == str(want.value)
    assert capabilities.table_grad_support("eager") == capabilities.GradSupport(True, (), "eager")


def test_a_remote_session_reads_the_servers_verdict():
    from ie_lab.remote.client import RemoteBackend

    backend = RemoteBackend.__new__(RemoteBackend)  # what connect() leaves after the hello: no server needed
    backend._hello = {
        "backend": "eager",
        "grad_support": {"available": False, "reasons": ["parameter w (int8) holds ..."], "instead": "unquantized"},
    }
    verdict = backend.grad_support()
    assert not verdict and verdict.reasons == ("parameter w (int8) holds ...",) and verdict.backend == "remote (eager)"
    backend._hello = {"backend": "vllm"}  # a server from before the verdict: its backend's cell
    assert backend.grad_support() == capabilities.table_grad_support("vllm")


def test_a_served_model_sends_its_verdict_and_the_jacobian_lens_stays_local(server, token):
    pytest.importorskip("fastapi")
    remote = ie_lab.connect(server.url, token=token, replace=False, progress=False)
    try:
        verdict = remote.grad_support()
        assert verdict and verdict.backend == "remote (eager)" and verdict.reasons == ()
        with pytest.raises(ie_lab.CapabilityUnsupported, match="fit_jacobian_lens on a remote Session"):
            remote.fit_jacobian_lens("The cat")
    finally:
        remote.close()
