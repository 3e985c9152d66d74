"""Saving and loading Medusa heads and EAGLE drafts (the trained ones ship as package assets).

A file holds {"kind": "medusa" | "eagle", "d_model", "num_heads" (Medusa) or "config" and "features" (EAGLE),
"state_dict" (half precision: the heads are small and their guesses only need to be good, not exact;
the output stays exact through verification), "vocab" (the token ids it was trained to rank, int32, or
None for all: `draft_vocab`), "meta" (how it was trained)}. An EAGLE file's "features" is
"normed": its draft reads and predicts the target's features after the final norm (`eagle.py`); files
without it hold a draft trained on the features before the norm, which this version cannot run.
`load_draft_heads(target, "medusa-smollm2")` finds a shipped asset by name; a path loads a file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import _checks
from ..model.config import ModelConfig
from ..model.transformer import TransformerLM
from .draft_vocab import set_vocab
from .eagle import EagleDraft, EagleDrafter
from .medusa import MedusaDrafter, MedusaHeads, check_heads_match

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED = {"medusa-smollm2": "medusa-smollm2.pt", "eagle-smollm2": "eagle-smollm2.pt"}
EAGLE_FEATURES = "normed"   # what an EAGLE draft reads: the target's features after its final norm


def save_draft_heads(path, module: MedusaHeads | EagleDraft, meta: dict | None = None,
                     dtype: torch.dtype = torch.bfloat16) -> None:
    """Write heads or a draft to `path` (weights cast to `dtype`)."""
    _checks.instance("module", module, (MedusaHeads, EagleDraft), "MedusaHeads or EagleDraft")
    state = {k: v.detach().to("cpu", dtype) for k, v in module.state_dict().items() if v.is_floating_point()
             and not k.startswith("rope.")}
    vocab = None if module.vocab is None else module.vocab.to("cpu", torch.int32)
    blob = dict(state_dict=state, vocab=vocab, meta=meta or {}, d_model=module.d_model)
    if isinstance(module, MedusaHeads):
        blob |= dict(kind="medusa", num_heads=module.num_heads)
    else:
        blob |= dict(kind="eagle", config=module.config.to_dict(), features=EAGLE_FEATURES)
    torch.save(blob, path)


def _resolve(name_or_path) -> Path:
    if isinstance(name_or_path, str) and name_or_path in SHIPPED:
        return ASSETS / SHIPPED[name_or_path]
    if isinstance(name_or_path, (str, Path)) and Path(name_or_path).is_file():
        return Path(name_or_path)
    raise ValueError(f"unknown draft heads {name_or_path!r}: give a shipped name ({', '.join(SHIPPED)}) or the "
                     "path of a file written by save_draft_heads")


def load_draft_heads(target: TransformerLM, name_or_path) -> MedusaHeads | EagleDraft:
    """Heads or a draft for `target` (same hidden size), on its device and in its dtype, in eval mode."""
    _checks.instance("target", target, TransformerLM)
    path = _resolve(name_or_path)
    if not path.is_file():
        raise ValueError(f"draft heads {name_or_path!r} are not installed (no {path}); train them with "
                         "`python -m cs336_inference bench speculative_heads`")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("kind") not in ("medusa", "eagle"):
        raise ValueError(f"{path} is not a file written by save_draft_heads (no 'kind' medusa/eagle)")
    check_heads_match(target, blob["d_model"], f"{path.name}")
    if blob["kind"] == "eagle" and blob.get("features") != EAGLE_FEATURES:
        raise ValueError(f"{path} holds an EAGLE draft trained on the target's features before the final norm "
                         f"(features={blob.get('features')!r}); this version's drafts read them after it "
                         f"(features={EAGLE_FEATURES!r}): train it again with train_eagle")
    dtype, device = target.dtype, target.device
    if blob["kind"] == "medusa":
        module = MedusaHeads(blob["d_model"], blob["num_heads"], device=device, dtype=dtype)
    else:
        module = EagleDraft(ModelConfig.from_dict(blob["config"]), device=device, dtype=dtype)
    missing, unexpected = module.load_state_dict({k: v.to(dtype) for k, v in blob["state_dict"].items()},
                                                 strict=False)
    if unexpected or [k for k in missing if not k.startswith("rope.")]:
        raise ValueError(f"{path}: keys do not match a {blob['kind']} module (missing {missing}, "
                         f"unexpected {unexpected})")
    try:
        set_vocab(module, blob.get("vocab"), target.config.vocab_size)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its vocab does not fit this target: {e}") from e
    module.meta = blob.get("meta", {})
    return module.eval().requires_grad_(False)


def load_drafter(target: TransformerLM, name_or_path) -> MedusaDrafter | EagleDrafter:
    """The `Drafter` for shipped or saved heads:
    `speculative_generate(target, load_drafter(target, "eagle-smollm2"), prompt, gamma)`."""
    module = load_draft_heads(target, name_or_path)
    return MedusaDrafter(target, module) if isinstance(module, MedusaHeads) else EagleDrafter(target, module)
