"""Quality metrics every later technique reports: loss / bits per byte / perplexity on held-out
text (bytes or, on real text, UTF-8 bytes), agreement with a reference model (KL divergence, top-1
agreement), and long-range recall (exact answers, or per digit).

All three are deterministic: evaluation windows are fixed (consecutive, non-overlapping) and the
recall probes are seeded, so two models (say fp32 and int4) are scored on exactly the same tokens.
With a byte tokenizer one token is one byte, so bits per byte = loss / ln 2 (the few
<|endoftext|> tokens are counted as bytes too).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _checks
from .corpus import make_recall_probe
from ..generation.generate import generate, left_pad

__all__ = ["bits_per_byte", "compare_on_text", "compare_to_reference", "decode_kl_to_reference", "evaluate_lm",
           "eval_windows", "long_range_recall", "make_recall_probe", "recall_digit_scores", "recall_nll",
           "recall_probes"]


def eval_windows(data: torch.Tensor, seq_len: int, batch_size: int = 8, max_batches: int | None = None):
    """Yield (x, y) batches (B, T) of consecutive non-overlapping windows from the start of `data`."""
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of token ids, got {getattr(data, 'shape', type(data))}")
    _checks.positive_ints(seq_len=seq_len, batch_size=batch_size)
    _checks.optional_positive_int("max_batches", max_batches)
    num_windows = (data.numel() - 1) // seq_len
    if num_windows == 0:
        raise ValueError(f"data has {data.numel()} tokens, need at least seq_len + 1 = {seq_len + 1}")
    total_batches = math.ceil(num_windows / batch_size)
    if max_batches is not None:
        total_batches = min(total_batches, max_batches)
    for b in range(total_batches):
        starts = torch.arange(b * batch_size, min((b + 1) * batch_size, num_windows)) * seq_len  # (B,)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]                              # (B, T+1)
        windows = data[idx]
        yield windows[:, :-1], windows[:, 1:]


def bits_per_byte(total_nats: float, num_bytes: int) -> float:
    """A summed cross-entropy in nats as bits per byte of the text it was measured on: nats / ln 2 is
    bits; dividing by the text's bytes (not its tokens) makes models with different tokenizers
    comparable. Our byte-level models predict one byte per token, so num_bytes is the token count."""
    _checks.number("total_nats", total_nats, 0, allowed="a finite number >= 0 (a summed cross-entropy)")
    _checks.positive_int("num_bytes", num_bytes)
    return total_nats / (math.log(2) * num_bytes)


def _check_model_fits(model, seq_len: int) -> None:
    if seq_len > model.config.context_length:
        raise ValueError(f"seq_len ({seq_len}) exceeds the model's context_length ({model.config.context_length})")


@torch.no_grad()
def evaluate_lm(model, data: torch.Tensor, seq_len: int = 256, batch_size: int = 8,
                max_batches: int | None = 16) -> dict:
    """Mean next-token cross-entropy (nats) over fixed windows -> {loss, bits_per_byte, perplexity, tokens}."""
    _check_model_fits(model, seq_len)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_windows(data, seq_len, batch_size, max_batches):
        logits = model(x.to(model.device)).float()  # (B, T, V)
        total += F.cross_entropy(logits.flatten(0, 1), y.to(model.device).flatten(), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "bits_per_byte": bits_per_byte(total, count), "perplexity": math.exp(loss), "tokens": count}


@torch.no_grad()
def compare_to_reference(model, reference, data: torch.Tensor, seq_len: int = 256, batch_size: int = 8,
                         max_batches: int | None = 16) -> dict:
    """How close `model` is to `reference` on the same windows.

    kl: mean over positions of KL(reference || model) in nats (the reference's distribution is the
    one we want; KL is 0 iff they agree everywhere). top1_agreement: fraction of positions where
    both models' most likely next token is the same.
    """
    _check_model_fits(model, seq_len)
    _check_model_fits(reference, seq_len)
    if model.config.vocab_size != reference.config.vocab_size:
        raise ValueError(f"vocab sizes differ: model {model.config.vocab_size}, "
                         f"reference {reference.config.vocab_size}")
    states = model.training, reference.training
    model.eval(), reference.eval()
    kl_sum, agree, count = 0.0, 0, 0
    for x, _ in eval_windows(data, seq_len, batch_size, max_batches):
        logp = F.log_softmax(model(x.to(model.device)).float(), dim=-1)              # (B, T, V)
        logq = F.log_softmax(reference(x.to(reference.device)).float(), dim=-1).to(logp.device)
        kl_sum += (logq.exp() * (logq - logp)).sum().item()
        agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
        count += x.numel()
    model.train(states[0]), reference.train(states[1])
    return {"kl": kl_sum / count, "top1_agreement": agree / count, "tokens": count}


def recall_probes(distance: int, num_trials: int, seed: int = 0, num_items: int = 4, digits: int = 3):
    """The seeded probes `long_range_recall` scores at one distance (so others can reuse them)."""
    return [make_recall_probe(num_items, distance, seed=seed * 1_000_003 + distance * 1009 + t, digits=digits)
            for t in range(num_trials)]


@torch.no_grad()
def long_range_recall(model, distances, num_trials: int = 32, seed: int = 0, num_items: int = 4,
                      digits: int = 3, batch_size: int = 32) -> dict[int, float]:
    """Accuracy of greedily generating the value of a fact stated ~d tokens before its query.

    For each d in `distances`, `num_trials` seeded probes (`make_recall_probe`) are completed with
    `generate` (greedy, KV cache); a trial counts when all `digits` digits are right. Chance is
    10**-digits for a model that cannot see the fact; copying a random distractor scores about
    1 / num_items.
    """
    _checks.positive_int("num_trials", num_trials)
    distances = list(distances)
    if not distances:
        raise ValueError("distances must be a non-empty list of ints")
    context = model.config.context_length
    result = {}
    for d in distances:
        probes = recall_probes(d, num_trials, seed, num_items, digits)
        longest = max(len(p.prompt_ids) for p in probes) + digits
        if longest > context:
            raise ValueError(f"distance {d} needs {longest} tokens of context, the model has {context}")
        correct = 0
        for i in range(0, num_trials, batch_size):
            chunk = probes[i:i + batch_size]
            out = generate(model, [p.prompt_ids for p in chunk], max_new_tokens=digits, temperature=0.0)
            correct += sum(tokens == p.answer_ids for tokens, p in zip(out.tokens, chunk))
        result[int(d)] = correct / num_trials
    return result


@torch.no_grad()
def recall_nll(model, distances, num_trials: int = 32, seed: int = 0, num_items: int = 4,
               digits: int = 3) -> dict[int, float]:
    """The soft version of `long_range_recall`: mean negative log-likelihood (nats per digit) of the
    correct value under teacher forcing, on the same probes. ln(10) = 2.30 means the model has no
    idea; 0 means certain recall. More sensitive than exact-match accuracy for weak models."""
    _checks.positive_int("num_trials", num_trials)
    distances = list(distances)
    if not distances:
        raise ValueError("distances must be a non-empty list of ints")
    was_training = model.training
    model.eval()
    result = {}
    for d in distances:
        total = 0.0
        for probe in recall_probes(d, num_trials, seed, num_items, digits):
            prompt, answer = probe.prompt_ids, probe.answer_ids
            if len(prompt) + len(answer) > model.config.context_length:
                raise ValueError(f"distance {d} needs {len(prompt) + len(answer)} tokens of context, "
                                 f"the model has {model.config.context_length}")
            ids = torch.tensor(prompt + answer, device=model.device)
            logp = F.log_softmax(model(ids[None, :-1])[0, -len(answer):].float(), dim=-1)  # (digits, V)
            total -= logp.gather(1, ids[-len(answer):, None]).sum().item()
        result[int(d)] = total / (num_trials * digits)
    model.train(was_training)
    return result


@torch.no_grad()
def recall_digit_scores(model, distances, num_trials: int, seed: int = 0, num_items: int = 2) -> dict:
    """Softer than exact match, for tiny models that rarely get a whole answer: on the probes
    `long_range_recall` uses, feed prompt + answer (teacher forcing, one padded batch per distance)
    and score each answer digit: top-1 accuracy (chance 0.1) and negative log-likelihood (ln 10 = 2.30
    for a model that cannot see the fact). {str(d): {"digit_accuracy", "nll_per_digit"}}."""
    out = {}
    for d in distances:
        probes = recall_probes(d, num_trials, seed, num_items)
        ids, pad = left_pad([p.prompt_ids + p.answer_ids for p in probes])
        ids = ids.to(model.device)
        logits = model(ids[:, :-1], pad=pad if int(pad.max()) else None)    # (B, T-1, V)
        n = len(probes[0].answer_ids)                                        # same digits for all
        logp = torch.log_softmax(logits[:, -n:].float(), dim=-1)            # predictions of the answer
        target = ids[:, -n:]
        out[str(d)] = {"digit_accuracy": (logp.argmax(-1) == target).float().mean().item(),
                       "nll_per_digit": -logp.gather(-1, target[..., None]).mean().item()}
    return out


@torch.inference_mode()
def compare_on_text(models: dict, reference, windows: torch.Tensor, nbytes: torch.Tensor) -> dict[str, dict]:
    """Every model of `models` on the same token windows (N, T+1) of real text, against `reference`:
    bits per UTF-8 byte (`nbytes[token]`: each token's byte length), KL(reference || model) per token
    and top-1 agreement with the reference."""
    totals = {name: dict(nll=0.0, kl=0.0, agree=0) for name in models}
    count, byte_count = 0, 0
    for window in windows:
        x, y = window[None, :-1].to(reference.device), window[1:].to(reference.device)
        ref = F.log_softmax(reference(x)[0].float(), -1)                    # (T, V)
        for name, m in models.items():
            logp = ref if m is reference else F.log_softmax(m(x)[0].float(), -1)
            totals[name]["nll"] -= float(logp.gather(1, y[:, None]).sum())
            totals[name]["kl"] += float((ref.exp() * (ref - logp)).sum())
            totals[name]["agree"] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        count += y.numel()
        byte_count += int(nbytes[y.cpu()].sum())
    return {name: dict(bits_per_byte=t["nll"] / math.log(2) / byte_count, nll_per_token=t["nll"] / count,
                       kl_to_reference=t["kl"] / count, top1_agreement=t["agree"] / count, tokens=count,
                       bytes=byte_count) for name, t in totals.items()}


@torch.inference_mode()
def decode_kl_to_reference(model, reference, ids: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || model) over next-token distributions, and top-1 agreement (the same-context
    next token), on ids (B, T). The model runs as decode runs it, one position per step through its
    cache (quantized layers take their packed few-row kernels there); the reference in one forward."""
    ref = reference(ids).float().log_softmax(-1)
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    out = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(ids.shape[1])], 1).float().log_softmax(-1)
    kl = (ref.exp() * (ref - out)).sum(-1).mean()
    return float(kl), float((ref.argmax(-1) == out.argmax(-1)).float().mean())
