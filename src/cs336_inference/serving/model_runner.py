"""`ModelRunner`: turn a scheduled batch into one forward of the model over the paged KV cache.

Prefills bring the uncached part of their prompt, decodes their last sampled token; all of them are
concatenated into one row of sum(T_b) tokens (no padding), run through the model's own forward as
one `PagedStep` (the model's `ForwardStep` contract), and the logits of each sequence's last token
come back, (B, V) (with speculative decoding, a decode row also brings its drafts and gets the logits
of all of them: `serving/speculative.py`). The runner is the model's edge: it checks the token ids and
lengths here, on host lists, so the forward itself never reads a value back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged_kv_cache import PagedKVCache
from .scheduler import ScheduledBatch


@dataclass
class StepInputs:
    """One engine step for the model, as host lists: the new tokens (prefills' first, then decodes'),
    each sequence's block table, context and query lengths, the copy-on-write copies, and how many of
    the sequences are prefills."""

    token_ids: list[int]
    tables: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    copies: list[tuple[int, int]]
    num_prefills: int
    logit_rows: list[int] | None = None   # speculative decoding: rows whose logits come back (else each last)


class ModelRunner:
    """decode: None, or `decode(token_ids (1, B), step) -> logits (B, V)` to run the steps that only decode
    (a compiled forward: `fast_path.compiled_engine_decode`) once the step's block tables span more than
    one block (torch would compile a graph of its own for tables of one block: it specializes sizes of
    1). Steps with a prefill run the model eagerly: their shapes vary most."""

    def __init__(self, model, num_blocks: int, block_size: int, decode=None):
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be None or a callable (token_ids, step) -> logits, got {decode!r}")
        self.model = model
        self.cache = PagedKVCache(model, num_blocks, block_size)
        self.decode = decode
        self.capture_features = False   # a Medusa/EAGLE proposer's engine sets it: `features` after each run
        self.features: tuple[torch.Tensor, torch.Tensor] | None = None   # (sum T, D) each

    @staticmethod
    def num_blocks_for(model, block_size: int, num_blocks: int | None = None, kv_budget_bytes: int | None = None,
                       default_tokens: int = 4096) -> int:
        """Size the pool by blocks, by bytes (the budget divided by one block's bytes over all layers),
        or to hold `default_tokens` tokens."""
        if num_blocks is not None:
            return num_blocks
        if kv_budget_bytes is None:
            return -(-default_tokens // block_size)
        per_block = block_size * PagedKVCache.bytes_per_token_of(model)
        if kv_budget_bytes // per_block < 1:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes} is less than one block "
                             f"({per_block} bytes: {block_size} tokens over all layers)")
        return kv_budget_bytes // per_block

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def bytes_per_token(self) -> int:
        return self.cache.bytes_per_token

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, manager) -> torch.Tensor:
        """Run every scheduled token once; logits (B, V) at the last token of each sequence.
        `manager` (a `KVCacheManager` or `ContiguousManager`) holds the block tables."""
        return self.run(self.inputs(batch, manager))

    def inputs(self, batch: ScheduledBatch, manager) -> StepInputs:
        """The step as plain host lists: everything `run` needs, and nothing of the scheduler's
        (a tensor-parallel engine sends exactly this to its other ranks)."""
        ids, tables, context_lens, query_lens = [], [], [], []
        for seq in batch.prefills:  # prefills first, then decodes (the order of the logits)
            start, n = seq.num_computed_tokens, batch.num_scheduled_tokens[seq.seq_id]
            ids.extend(seq.token_ids[start:start + n])
            tables.append(manager.tables[seq.seq_id].blocks)
            context_lens.append(start + n)
            query_lens.append(n)
        verify = False
        for seq in batch.decodes:  # the last sampled token, at the slot just reserved for it
            table = manager.tables[seq.seq_id]   # the scheduler's own sequences: no check needed
            ids.append(seq.token_ids[-1])
            tables.append(table.blocks)
            context_lens.append(table.num_tokens)
            if seq.draft_token_ids:   # speculative decoding: its drafts follow, verified in this forward
                ids.extend(seq.draft_token_ids)
                query_lens.append(1 + len(seq.draft_token_ids))
                verify = True
            else:
                query_lens.append(1)
        inputs = StepInputs(ids, tables, context_lens, query_lens, list(batch.copies), len(batch.prefills))
        if verify:   # logits at each prefill's last token and at every token of each decode
            inputs.logit_rows, end = [], 0
            for i, n in enumerate(query_lens):
                end += n
                inputs.logit_rows.extend(range(end - n, end) if i >= inputs.num_prefills else (end - 1,))
        return inputs

    @torch.inference_mode()
    def run(self, step_inputs: StepInputs) -> torch.Tensor:
        """One forward of a step's inputs over this runner's cache; logits (B, V)."""
        ids, context_lens = step_inputs.token_ids, step_inputs.context_lens
        self.cache.copy_blocks(step_inputs.copies)  # copy-on-write before anything writes the copies
        self.check_step(ids, context_lens)
        step = self.cache.step(step_inputs.tables, context_lens, step_inputs.query_lens)
        token_ids = torch.tensor([ids], device=self.model.device)            # (1, sum T)
        if step_inputs.logit_rows is not None:   # a speculative verify: (R, V), eager (ragged query lengths)
            step.logit_rows = torch.tensor(step_inputs.logit_rows, device=self.model.device)
        if self.capture_features:
            return self._run_capturing_features(token_ids, step)
        if step_inputs.logit_rows is not None:
            return self.model(token_ids, step=step, last_only=True)[0]
        if self.decode is not None and not step_inputs.num_prefills and max(context_lens) > self.cache.block_size:
            return self.decode(token_ids, step)                               # (B, V)
        return self.model(token_ids, step=step, last_only=True)[0]           # (B, V)

    def _run_capturing_features(self, token_ids: torch.Tensor, step) -> torch.Tensor:
        """The eager forward, keeping the target's hidden states at every token it ran (a prefill's whole
        chunk, a decode's last token and drafts): `features` = (last hidden state (sum T, D): the input of
        the final norm, `return_hidden`; second-to-top (sum T, D): the input of the last layer), for a
        proposer that drafts from them (`serving/speculative.py`)."""
        kept = {}

        def second_to_top(module, args):
            kept["second"] = args[0][0]

        hook = self.model.layers[-1].register_forward_pre_hook(second_to_top)
        try:
            logits, hidden = self.model(token_ids, step=step, last_only=True, return_hidden=True)
        finally:
            hook.remove()
        self.features = (hidden[0], kept["second"])
        return logits[0]

    def check_step(self, ids: list[int], context_lens: list[int]) -> None:
        """The edge checks of a step, on host data: ids in the vocabulary, no sequence past the context."""
        config = self.model.config
        if ids and (min(ids) < 0 or max(ids) >= config.vocab_size):
            bad = [t for t in ids if not 0 <= t < config.vocab_size]
            raise ValueError(f"token ids must be in [0, vocab_size={config.vocab_size}), got {bad[:8]}")
        if context_lens and max(context_lens) > config.context_length:
            raise ValueError(f"a sequence of {max(context_lens)} tokens exceeds the model's context_length "
                             f"{config.context_length}")


__all__ = ["ModelRunner", "StepInputs"]
