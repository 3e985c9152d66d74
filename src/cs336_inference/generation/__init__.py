"""Generation: sampling a token from logits, prefill + decode with a KV cache, speculative decoding.

`sampling` (temperature, top-k, top-p), `generate` (`prefill`, `decode_one_token`, `generate`),
`chat` (streaming into a cache that persists across calls: `extend`, `stream`, `TextStream`,
`ConversationCache`; the chat session is `serving.ChatSession`),
`compiled` (`compile_decode`: a torch.compile'd decode step without graph breaks; `compile_verify`: the
same for a speculative pass's T tokens),
`speculative_rule` (the exact accept/resample rule, `speculative_accept`), `drafters` and
`prompt_lookup`, `medusa`, `eagle`, `lookup_then_draft` (who proposes; `medusa_tree` verifies a tree
of candidates, `eagle_tree` grows one with an EAGLE draft (EAGLE-2); `draft_training` trains Medusa heads
and EAGLE drafts, `draft_heads` saves and loads them),
`speculative` (the draft-verify-rollback loop),
`speculative_theory` (expected gains, the exact proof).
"""

from .chat import ConversationCache, TextStream, TurnStats, extend, stream
from .compiled import compile_decode, compile_verify
from .drafters import Drafter, ModelDrafter
from .draft_heads import load_draft_heads, load_drafter, save_draft_heads
from .eagle import EagleDraft, EagleDrafter
from .eagle_tree import eagle_tree_generate
from .lookup_then_draft import LookupThenDraft
from .medusa import MedusaDrafter, MedusaHeads
from .medusa_tree import medusa_tree_generate
from .sampling_params import SamplingParams
from .generate import GenerationResult, decode_one_token, generate, left_pad, prefill
from .prompt_lookup import PromptLookupDrafter, prompt_lookup_propose
from .sampling import logits_to_probs, sample_next_token
from .speculative import SpeculativeDecoder, SpeculativeResult, speculative_generate
from .speculative_rule import (Acceptance, accept_among_candidates, acceptance_probability, greedy_accept,
                               residual_distribution, speculative_accept)
from .speculative_theory import (OutputDistribution, acceptance_rate, expected_speedup, expected_tokens_per_pass,
                                 optimal_gamma, speculative_output_distribution)

__all__ = ["Acceptance", "ConversationCache", "Drafter", "EagleDraft", "EagleDrafter", "GenerationResult",
           "LookupThenDraft", "MedusaDrafter", "MedusaHeads", "ModelDrafter", "OutputDistribution", "load_draft_heads",
           "load_drafter", "medusa_tree_generate", "eagle_tree_generate", "save_draft_heads",
           "PromptLookupDrafter", "SamplingParams", "SpeculativeDecoder", "SpeculativeResult", "TextStream",
           "TurnStats", "accept_among_candidates", "acceptance_probability", "acceptance_rate", "compile_decode",
           "compile_verify",
           "decode_one_token",
           "expected_speedup", "expected_tokens_per_pass", "extend", "generate", "greedy_accept", "left_pad",
           "logits_to_probs", "optimal_gamma", "prefill", "prompt_lookup_propose", "residual_distribution",
           "sample_next_token", "speculative_accept", "speculative_generate", "speculative_output_distribution",
           "stream"]
