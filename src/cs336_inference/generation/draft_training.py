"""Training Medusa heads and an EAGLE draft by self-distillation on the target's own greedy text.

1. `self_distillation_data`: the target continues each prompt greedily (what it will be asked to
   draft for), then one full forward over prompt + continuation records, at every position t, its
   feature f_t (last block output, before the final norm) and its greedy choice a_t = argmax logits_t.
2. `train_medusa`: head k at position t learns a_{t+k} (the token 1 + k ahead), by cross-entropy
   through the frozen LM head, plus a regression of its output onto the target's normed feature at
   t + k (the input that makes the LM head say a_{t+k}).
3. `train_eagle`: the draft reads (h_t, embed(x_{t+1})) over a window, h = norm(f) the LM head's input,
   and regresses h_{t+1}, plus the cross-entropy of lm_head(h^_{t+1}) against a_{t+1} (EAGLE's loss:
   regression + 0.1 x CE).
   A little noise on the input features makes it tolerate its own imperfect guesses while drafting.

The cross-entropy runs over the vocabulary the data uses (`labels.unique()`): the LM head's other
rows never appear as a label, and on a 49k vocabulary the full softmax would dominate the CPU time.
So the trained module keeps those ids as its `vocab` and drafts among them only (`draft_vocab`).
Only the heads train; the target is frozen and never sees a gradient.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import _checks
from ..model.transformer import TransformerLM
from .draft_vocab import set_vocab
from .eagle import EagleDraft, eagle_config
from .generate import generate
from .medusa import MedusaHeads


def _out_of_time(t0: float, budget: float | None, step: int) -> bool:
    return budget is not None and step > 0 and time.perf_counter() - t0 > budget


@dataclass
class DistillData:
    """Per sequence: tokens x (T,), the target's features f (T, D) and greedy choices a (T,) (a_t predicts x_{t+1})."""

    tokens: list[torch.Tensor]
    features: list[torch.Tensor]
    labels: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def vocabulary(self) -> torch.Tensor:
        """The label ids that occur, sorted (V_used,): the rows of the LM head the losses read."""
        return torch.cat(self.labels).unique()


@torch.no_grad()
def self_distillation_data(target: TransformerLM, prompts: list[list[int]], new_tokens: int,
                           batch_size: int = 8, stop_tokens=None) -> DistillData:
    """The target's greedy continuations of `prompts` and its features and choices along them."""
    _checks.instance("target", target, TransformerLM)
    _checks.positive_ints(new_tokens=new_tokens, batch_size=batch_size)
    if not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    data = DistillData([], [], [])
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        out = generate(target, batch, new_tokens, stop_tokens=stop_tokens)
        for prompt, cont in zip(batch, out.tokens):
            ids = torch.tensor([list(prompt) + list(cont)], device=target.device)       # (1, T)
            logits, hidden = target(ids, return_hidden=True)
            data.tokens.append(ids[0].cpu())
            data.features.append(hidden[0].float().cpu())                              # (T, D)
            data.labels.append(logits[0].argmax(-1).cpu())                              # (T,)
    return data


def _vocab_map(data: DistillData, vocab_size: int, val: DistillData | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(used ids (V_used,), map (V,) from an id to its index among them)."""
    used = data.vocabulary() if val is None else torch.cat([data.vocabulary(), val.vocabulary()]).unique()
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[used] = torch.arange(len(used))
    return used, index


def _frozen_head(target: TransformerLM, used: torch.Tensor) -> torch.Tensor:
    """(V_used, D) fp32 rows of the LM head."""
    return target.lm_head.weight.detach()[used.to(target.device)].float().cpu()


def _medusa_batch(h: list[torch.Tensor], labels: list[torch.Tensor], index: torch.Tensor,
                  picks: list[tuple[int, int]], K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For positions (sequence, t): the inputs h_t (B, D), the features the heads should reach h_{t+1..t+K}
    (B, K, D), and the target's next tokens t+1..t+K as indices among the used ids (B, K)."""
    x = torch.stack([h[s][t] for s, t in picks])
    want = torch.stack([h[s][t + 1:t + K + 1] for s, t in picks])
    lab = torch.stack([index[labels[s][t + 1:t + K + 1]] for s, t in picks])
    return x, want, lab


def train_medusa(target: TransformerLM, data: DistillData, num_heads: int = 4, steps: int = 300,
                 batch_size: int = 256, lr: float = 1e-3, reg_weight: float = 1.0, seed: int = 0,
                 log_every: int = 50, time_budget_s: float | None = None,
                 val: DistillData | None = None) -> tuple[MedusaHeads, dict]:
    """Heads trained on `data` (fp32 on the CPU) for `steps` steps, or until `time_budget_s` wall seconds
    have passed; returns (heads, history: loss and top-1 accuracy per head, steps_run). With `val`
    (held-out sequences), the mean top-1 accuracy on them is logged and the best heads are kept (early
    stopping: a few thousand tokens are memorised long before the budget ends)."""
    _checks.positive_ints(num_heads=num_heads, steps=steps, batch_size=batch_size)
    K, D = num_heads, target.config.d_model
    norm = target.ln_final
    with torch.no_grad():   # the normed features h_t, the LM head's inputs, of every position
        h = [norm(f.to(target.device, target.dtype)).float().cpu() for f in data.features]
    starts = [(s, t) for s, x in enumerate(data.tokens) for t in range(len(x) - K)]    # t + K inside the sequence
    if not starts:
        raise ValueError(f"no sequence is longer than num_heads={K} tokens; generate longer continuations")
    used, index = _vocab_map(data, target.config.vocab_size, val)
    W = _frozen_head(target, used)                                                     # (V_used, D)
    heads = MedusaHeads(D, K)
    if val is not None:
        with torch.no_grad():
            hv = [norm(f.to(target.device, target.dtype)).float().cpu() for f in val.features]
        xv = torch.cat([x[:len(x) - K] for x in hv])                                   # (N, D)
        labv = torch.cat([torch.stack([index[a[k:len(a) - K + k]] for k in range(1, K + 1)], -1)
                          for a in val.labels])                                        # (N, K)

    def val_accuracy() -> float:
        with torch.no_grad():
            return float((heads(xv) @ W.T).argmax(-1).eq(labv).float().mean())
    best = (-1.0, None)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    history, t0, done = dict(step=[], loss=[], accuracy=[]), time.perf_counter(), 0
    for step in range(steps):
        if _out_of_time(t0, time_budget_s, step):
            break
        x, want, lab = _medusa_batch(h, data.labels, index, [starts[i] for i in
                                     torch.randint(len(starts), (batch_size,), generator=g).tolist()], K)
        z = heads(x)                                                                   # (B, K, D)
        logits = z @ W.T                                                               # (B, K, V_used)
        ce = F.cross_entropy(logits.reshape(-1, len(used)), lab.reshape(-1))
        loss = ce + reg_weight * F.smooth_l1_loss(z, want)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if step % log_every == 0 or step == steps - 1:
            acc = (logits.argmax(-1) == lab).float().mean(0).tolist()                  # per head
            best = _log_step("medusa", heads, step, loss, acc, f"per head {[round(a, 2) for a in acc]}", history,
                             best, val_accuracy if val is not None else None, t0)
    set_vocab(heads, used, target.config.vocab_size)   # it learned to rank these ids only (`draft_vocab`)
    return _finish(heads, history, best, done), history


def train_eagle(target: TransformerLM, data: DistillData, steps: int = 300, window: int = 64, batch_size: int = 8,
                lr: float = 1e-3, ce_weight: float = 0.1, noise: float = 0.2, seed: int = 0,
                log_every: int = 50, time_budget_s: float | None = None,
                val: DistillData | None = None) -> tuple[EagleDraft, dict]:
    """A draft trained on `data` (fp32 on the CPU) for `steps` steps or `time_budget_s` wall seconds;
    returns (draft, history: loss and top-1 accuracy, steps_run). With `val`, its top-1 accuracy on
    the held-out sequences is logged and the best draft kept (early stopping).

    noise: uniform noise on the input features, as a fraction of their RMS (EAGLE adds U(-0.1, 0.1))."""
    _checks.positive_ints(steps=steps, window=window, batch_size=batch_size)
    torch.manual_seed(seed)
    draft = EagleDraft(eagle_config(target.config))
    seqs = [s for s, x in enumerate(data.tokens) if len(x) > window + 1]
    if not seqs:
        raise ValueError(f"no sequence is longer than window + 1 = {window + 1} tokens; lower window")
    used, index = _vocab_map(data, target.config.vocab_size, val)
    W = _frozen_head(target, used)                                                     # (V_used, D)
    norm = copy.deepcopy(target.ln_final).float().cpu().requires_grad_(False)        # frozen, fp32 for training
    with torch.no_grad():   # the draft's features: h = norm(f), the LM head's inputs (eagle.py says why)
        h = [norm(f.float()) for f in data.features]
        h_val = [norm(f.float()) for f in val.features] if val is not None else []
    embed = target.token_embeddings.weight.detach().float().cpu()                       # (V, D)
    scale = torch.cat(h).pow(2).mean().sqrt()                                          # feature RMS

    def val_accuracy() -> float:   # teacher-forced: each position reads the target's true feature
        right = total = 0
        with torch.no_grad():
            for f, x, a in zip(h_val, val.tokens, val.labels):
                pred = draft(f[None, :-1], embed[x[None, 1:]])[0]
                right += int((pred @ W.T).argmax(-1).eq(index[a[1:]]).sum())
                total += len(a) - 1
        return right / max(total, 1)
    best = (-1.0, None)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    history, t0, done = dict(step=[], loss=[], accuracy=[]), time.perf_counter(), 0
    for step in range(steps):
        if _out_of_time(t0, time_budget_s, step):
            break
        f_in, x_next, f_out, lab = [], [], [], []
        for _ in range(batch_size):
            s = seqs[int(torch.randint(len(seqs), (1,), generator=g))]
            t = int(torch.randint(len(data.tokens[s]) - window - 1 + 1, (1,), generator=g))
            f_in.append(h[s][t:t + window])
            x_next.append(data.tokens[s][t + 1:t + window + 1])
            f_out.append(h[s][t + 1:t + window + 1])
            lab.append(index[data.labels[s][t + 1:t + window + 1]])
        f_in, f_out, lab = torch.stack(f_in), torch.stack(f_out), torch.stack(lab)     # (B, W, D), (B, W)
        f_in = f_in + noise * scale * (2 * torch.rand(f_in.shape, generator=g) - 1)
        pred = draft(f_in, embed[torch.stack(x_next)])                                 # (B, W, D)
        logits = pred @ W.T                    # (B, W, V_used)
        ce = F.cross_entropy(logits.reshape(-1, len(used)), lab.reshape(-1))
        loss = F.smooth_l1_loss(pred / scale, f_out / scale) + ce_weight * ce
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if step % log_every == 0 or step == steps - 1:
            acc = float((logits.argmax(-1) == lab).float().mean())
            best = _log_step("eagle", draft, step, loss, acc, f"{acc:.2f}", history, best,
                             val_accuracy if val is not None else None, t0)
    set_vocab(draft, used, target.config.vocab_size)
    return _finish(draft, history, best, done), history


def _log_step(name: str, module: torch.nn.Module, step: int, loss: torch.Tensor, acc, acc_text: str,
              history: dict, best: tuple, val_accuracy, t0: float) -> tuple:
    """Record a logged step in `history` (with the held-out accuracy where `val_accuracy` is given) and print
    it; returns `best` (held-out accuracy, state dict, step), replaced when this step beats it."""
    history["step"].append(step)
    history["loss"].append(float(loss.detach()))
    history["accuracy"].append(acc)
    note = ""
    if val_accuracy is not None:
        history.setdefault("val_accuracy", []).append(v := val_accuracy())
        if v > best[0]:
            best = (v, copy.deepcopy(module.state_dict()), step)
        note = f", held-out {v:.2f}"
    print(f"  {name} step {step}: loss {history['loss'][-1]:.3f}, top-1 accuracy {acc_text}{note} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return best


def _finish(module: torch.nn.Module, history: dict, best: tuple, done: int) -> torch.nn.Module:
    """The trained module, frozen for inference: the best held-out state where one was kept (early stopping)."""
    history["steps_run"] = done
    if best[1] is not None:
        module.load_state_dict(best[1])
        history["best_step"], history["best_val_accuracy"] = best[2], best[0]
    return module.eval().requires_grad_(False)
