"""Measurement helpers for the ie_lab demo model.

Used by ``scripts/train_demo_model.py`` (final report) and by
``tests/test_demo_model.py`` (re-measurement). Everything here works on a plain
``transformers`` causal LM (Llama-style: ``model.model.layers[i]``) and uses
plain PyTorch forward hooks; nothing depends on ie_lab itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------
# generic helpers
# --------------------------------------------------------------------------


def ensure_eager_attention(model) -> None:
    """Switch to eager attention so ``output_attentions=True`` returns weights."""
    if getattr(model.config, "_attn_implementation", None) != "eager":
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = "eager"


def decoder_layers(model):
    return model.model.layers


def _layer_output_tensor(output):
    return output[0] if isinstance(output, tuple) else output


# --------------------------------------------------------------------------
# (a) induction
# --------------------------------------------------------------------------


def repeated_random_batch(
    candidate_ids: Sequence[int], n_seq: int, seq_len: int, bos_id: int, seed: int
) -> torch.Tensor:
    """``[BOS, t_1..t_L, t_1..t_L]`` with t_i uniform over ``candidate_ids``."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.as_tensor(list(candidate_ids), dtype=torch.long)
    idx = torch.randint(0, len(cand), (n_seq, seq_len), generator=g)
    toks = cand[idx]
    bos = torch.full((n_seq, 1), bos_id, dtype=torch.long)
    return torch.cat([bos, toks, toks], dim=1)


@torch.no_grad()
def induction_metrics(
    model,
    candidate_ids: Sequence[int],
    bos_id: int,
    n_seq: int = 64,
    seq_len: int = 25,
    seed: int = 1234,
    batch_size: int = 32,
) -> dict:
    """Loss ratio (2nd copy / 1st copy) and per-head induction scores.

    Sequence layout: position 0 = BOS, first copy at 1..L, second copy at
    L+1..2L. Losses exclude the first token of each copy (neither is
    predictable); the ratio over whole copies is reported as well.

    Induction score of a head = mean attention from a second-copy position
    ``L+1+k`` to position ``k+2`` (the token right after the previous
    occurrence of the current token), averaged over k = 0..L-1 and sequences.
    """
    ensure_eager_attention(model)
    model.eval()
    L = seq_len
    ids = repeated_random_batch(candidate_ids, n_seq, L, bos_id, seed)
    first_sum = second_sum = 0.0
    first_all = second_all = 0.0
    n_first = n_second = 0
    n_first_all = n_second_all = 0
    head_scores = None
    q_pos = torch.arange(L + 1, 2 * L + 1)
    k_pos = torch.arange(2, L + 2)
    for start in range(0, n_seq, batch_size):
        x = ids[start : start + batch_size]
        out = model(input_ids=x, output_attentions=True)
        logp = F.log_softmax(out.logits.float(), dim=-1)
        # loss of predicting token at position p uses logits at p-1
        tgt = x[:, 1:]
        nll = -logp[:, :-1].gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [b, 2L]
        # nll[:, p-1] is the loss of token at position p
        first = nll[:, 0:L]  # positions 1..L
        second = nll[:, L : 2 * L]  # positions L+1..2L
        first_sum += first[:, 1:].sum().item()
        second_sum += second[:, 1:].sum().item()
        n_first += first[:, 1:].numel()
        n_second += second[:, 1:].numel()
        first_all += first.sum().item()
        second_all += second.sum().item()
        n_first_all += first.numel()
        n_second_all += second.numel()
        per_layer = []
        for att in out.attentions:  # [b, h, T, T]
            a = att[:, :, q_pos, k_pos]  # [b, h, L]
            per_layer.append(a.sum(dim=(0, 2)))
        s = torch.stack(per_layer)  # [layers, heads]
        head_scores = s if head_scores is None else head_scores + s
    head_scores = head_scores / (n_seq * L)
    best = int(torch.argmax(head_scores))
    n_heads = head_scores.shape[1]
    first_loss = first_sum / n_first
    second_loss = second_sum / n_second
    return {
        "seq_len": L,
        "n_sequences": n_seq,
        "first_copy_loss": first_loss,
        "second_copy_loss": second_loss,
        "loss_ratio": second_loss / first_loss,
        "loss_ratio_whole_copies": (second_all / n_second_all) / (first_all / n_first_all),
        "uniform_loss": math.log(len(candidate_ids)),
        "head_scores": [[round(float(v), 4) for v in row] for row in head_scores],
        "best_head": {
            "layer": best // n_heads,
            "head": best % n_heads,
            "score": float(head_scores.flatten()[best]),
        },
    }


# --------------------------------------------------------------------------
# (b) indirect object identification
# --------------------------------------------------------------------------


@torch.no_grad()
def ioi_metrics(model, tokenizer, examples: Sequence[dict], batch_size: int = 64) -> dict:
    """``examples``: dicts with ``prompt`` (ends right before the IO name),
    ``io`` and ``s`` (single-token names). Returns mean logit(IO) - logit(S),
    accuracy (IO logit > S logit) and top-1 accuracy (IO is the argmax)."""
    model.eval()
    diffs, top1 = [], []
    pad_id = tokenizer.pad_token_id
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        enc = [tokenizer(ex["prompt"])["input_ids"] for ex in chunk]
        io_ids = [tokenizer.convert_tokens_to_ids(ex["io"]) for ex in chunk]
        s_ids = [tokenizer.convert_tokens_to_ids(ex["s"]) for ex in chunk]
        T = max(len(e) for e in enc)
        x = torch.full((len(enc), T), pad_id, dtype=torch.long)
        mask = torch.zeros((len(enc), T), dtype=torch.long)
        for i, e in enumerate(enc):  # right padding, read logits at last real token
            x[i, : len(e)] = torch.tensor(e)
            mask[i, : len(e)] = 1
        logits = model(input_ids=x, attention_mask=mask).logits
        last = torch.tensor([len(e) - 1 for e in enc])
        final = logits[torch.arange(len(enc)), last]
        io_t = torch.tensor(io_ids)
        s_t = torch.tensor(s_ids)
        d = final[torch.arange(len(enc)), io_t] - final[torch.arange(len(enc)), s_t]
        diffs.extend(d.tolist())
        top1.extend((final.argmax(-1) == io_t).tolist())
    diffs_t = torch.tensor(diffs)
    return {
        "n_prompts": len(diffs),
        "logit_diff_mean": float(diffs_t.mean()),
        "logit_diff_std": float(diffs_t.std()) if len(diffs) > 1 else 0.0,
        "accuracy": float((diffs_t > 0).float().mean()),
        "top1_accuracy": float(torch.tensor(top1, dtype=torch.float).mean()),
    }


# --------------------------------------------------------------------------
# (c) mood direction and steering
# --------------------------------------------------------------------------


@torch.no_grad()
def mean_residual(model, tokenizer, texts: Sequence[str], layer: int, batch_size: int = 64) -> torch.Tensor:
    """Mean output of decoder layer ``layer`` over all non-BOS, non-pad tokens."""
    model.eval()
    captured = {}

    def hook(_mod, _inp, output):
        captured["h"] = _layer_output_tensor(output).detach()

    handle = decoder_layers(model)[layer].register_forward_hook(hook)
    total, count = None, 0
    try:
        for start in range(0, len(texts), batch_size):
            enc = [tokenizer(t)["input_ids"] for t in texts[start : start + batch_size]]
            T = max(len(e) for e in enc)
            x = torch.full((len(enc), T), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(enc), T), dtype=torch.long)
            for i, e in enumerate(enc):
                x[i, : len(e)] = torch.tensor(e)
                mask[i, : len(e)] = 1
            model(input_ids=x, attention_mask=mask)
            h = captured["h"]
            m = mask.clone()
            m[:, 0] = 0  # skip BOS
            s = (h * m.unsqueeze(-1)).sum(dim=(0, 1))
            total = s if total is None else total + s
            count += int(m.sum())
    finally:
        handle.remove()
    return total / count


def mood_direction(model, tokenizer, happy_texts, sad_texts, layer: int) -> torch.Tensor:
    """Difference of means (happy - sad) of the residual stream after ``layer``."""
    return mean_residual(model, tokenizer, happy_texts, layer) - mean_residual(model, tokenizer, sad_texts, layer)


@torch.no_grad()
def generate_steered(
    model,
    tokenizer,
    prompts: Sequence[str],
    layer: int,
    vector: torch.Tensor | None,
    coef: float,
    n_new: int = 24,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[list[int]]:
    """Sample continuations while adding ``coef * vector`` to the output of
    decoder layer ``layer`` at every position (a plain forward hook).
    ``temperature == 0`` means greedy. Returns generated token ids per prompt."""
    model.eval()
    handle = None
    if vector is not None and coef != 0:
        add = (coef * vector).to(next(model.parameters()).dtype)

        def hook(_mod, _inp, output):
            if isinstance(output, tuple):
                return (output[0] + add,) + tuple(output[1:])
            return output + add

        handle = decoder_layers(model)[layer].register_forward_hook(hook)
    g = torch.Generator().manual_seed(seed)
    results = []
    try:
        # prompts are processed one length-group at a time (no padding needed)
        encs = [tokenizer(p)["input_ids"] for p in prompts]
        by_len: dict[int, list[int]] = {}
        for i, e in enumerate(encs):
            by_len.setdefault(len(e), []).append(i)
        out_tokens: dict[int, list[int]] = {}
        for _, idxs in sorted(by_len.items()):
            x = torch.tensor([encs[i] for i in idxs], dtype=torch.long)
            gen = []
            for _ in range(n_new):
                logits = model(input_ids=x).logits[:, -1].float()
                if temperature == 0:
                    nxt = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=g).squeeze(-1)
                gen.append(nxt)
                x = torch.cat([x, nxt.unsqueeze(-1)], dim=1)
            gen_t = torch.stack(gen, dim=1)
            for row, i in enumerate(idxs):
                out_tokens[i] = gen_t[row].tolist()
        results = [out_tokens[i] for i in range(len(prompts))]
    finally:
        if handle is not None:
            handle.remove()
    return results


def mood_word_counts(
    continuations: Iterable[Sequence[int]], tokenizer, happy_words: Iterable[str], sad_words: Iterable[str]
) -> dict:
    happy_ids = {tokenizer.convert_tokens_to_ids(w) for w in happy_words}
    sad_ids = {tokenizer.convert_tokens_to_ids(w) for w in sad_words}
    n_h = n_s = n_tok = 0
    for seq in continuations:
        for t in seq:
            n_tok += 1
            n_h += t in happy_ids
            n_s += t in sad_ids
    mood = max(n_h + n_s, 1)
    return {
        "happy_words": n_h,
        "sad_words": n_s,
        "tokens": n_tok,
        "happy_fraction": n_h / mood,
        "sad_fraction": n_s / mood,
    }


def steering_experiment(
    model,
    tokenizer,
    happy_texts,
    sad_texts,
    sad_prompts,
    happy_words,
    sad_words,
    layer: int,
    coefs: Sequence[float],
    n_new: int = 24,
    seed: int = 0,
    temperature: float = 1.0,
) -> dict:
    """Compute the happy-sad direction and measure mood words in continuations
    of sad prompts for each steering coefficient (0 = no steering)."""
    direction = mood_direction(model, tokenizer, happy_texts, sad_texts, layer)
    out = {"layer": layer, "direction_norm": float(direction.norm()), "by_coef": {}}
    for c in coefs:
        conts = generate_steered(
            model, tokenizer, sad_prompts, layer, direction, c, n_new=n_new, seed=seed, temperature=temperature
        )
        out["by_coef"][str(c)] = mood_word_counts(conts, tokenizer, happy_words, sad_words)
    out["_direction"] = direction
    return out
