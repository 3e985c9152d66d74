"""The workloads of `bench speculative`: a target, its drafters and prompts.

The shipped toy pair on stories (free generation) and echo drills (lines that repeat earlier lines:
input-grounded, where prompt lookup shines); SmolLM2-135M-Instruct with prompt lookup on chat tasks
whose answer copies a given passage, and on free writing for contrast (where the model is installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..data.corpus import VAL_EVERY, build_corpus
from ..model.checkpoints import load_pretrained
from ..model.real_models import real_model_missing
from ..model.tokenizer import ENDOFTEXT, load_tokenizer


@dataclass
class Workload:
    name: str
    target: torch.nn.Module
    drafters: dict            # name -> TransformerLM or "prompt_lookup"
    prompts: list[list[int]]
    max_new_tokens: int
    note: str = ""
    stop_tokens: list[int] | None = None
    gammas: tuple[int, ...] | None = None  # None: the benchmark's sweep
    extra: dict = field(default_factory=dict)


def _val_documents(prefix: str) -> list[str]:
    docs = build_corpus(0).decode("utf-8").split(ENDOFTEXT)
    return [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1 and d.startswith(prefix)]


def toy_workloads(device, quick: bool) -> list[Workload]:
    target = load_pretrained("target", device=device)
    draft, scratch = load_pretrained("draft", device=device), load_pretrained("draft-scratch", device=device)
    n_prompts, new = (1, 32) if quick else (2, 96)
    stories = [list(d[:64].encode()) for d in _val_documents("Once upon a time")[:n_prompts]]
    echoes = [list(d[:320].encode()) for d in _val_documents("Echo drill") if len(d) > 480][:n_prompts]
    return [
        Workload("toy-story", target, {"draft": draft, "draft-scratch": scratch, "prompt_lookup": "prompt_lookup"},
                 stories, new, "free continuation of a story opening (64 bytes)"),
        Workload("toy-echo", target, {"draft": draft, "prompt_lookup": "prompt_lookup"}, echoes, new,
                 "echo drills: each line repeats an earlier one (320-byte prompt), an input-grounded task"),
    ]


def prose_paragraphs() -> list[str]:
    """Plain-prose paragraphs (350-650 characters) of CPython's own help text: offline English to edit."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for par in topics[name].split("\n\n"):
            if 350 < len(par) < 650 and not par.startswith(" ") and not any(m in par for m in ("::", "*", "`", "\n ")):
                out.append(" ".join(par.split()))
    return out


REAL_TASKS = ("Rewrite the following passage, putting each sentence on its own line:\n\n",
              "Summarize the following passage:\n\n")


def real_workloads(device, quick: bool) -> list[Workload]:
    """SmolLM2-135M-Instruct (when its package is installed) with prompt lookup: chat tasks
    whose answer copies a given passage (edit, summarise), and free writing where nothing can be copied."""
    name = "smollm2-135m"
    missing = real_model_missing(name)
    if missing:
        print(f"(real model unavailable: {missing}; toy workloads only)")
        return []
    target, tok = load_pretrained(name, device=device), load_tokenizer(name)
    paragraphs = prose_paragraphs()

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    n_prompts, new = (1, 24) if quick else (2, 128)
    grounded = [chat(REAL_TASKS[i % 2] + paragraphs[1 + 5 * i]) for i in range(n_prompts)]
    free = [chat("Write a short story about a lighthouse keeper who finds a message in a bottle.")]  # contrast
    lookup = {"prompt_lookup": "prompt_lookup"}
    extra = dict(model=name, parameters=target.num_parameters(), dtype=str(target.dtype))
    return [
        Workload("smollm2-grounded", target, lookup, grounded, new,
                 "SmolLM2-135M-Instruct, chat: rewrite / summarise a given passage (the answer copies the input)",
                 stop_tokens=tok.stop_ids, extra=extra),
        Workload("smollm2-free", target, lookup, free, new // 2,
                 "SmolLM2-135M-Instruct, chat: write a story (nothing to copy from the prompt)",
                 stop_tokens=tok.stop_ids, gammas=(1, 2, 4, 8), extra=extra),
    ]
