"""A planted-bug campaign over the surfaces added last: does the fast suite catch realistic bugs?

Each entry of BUGS is (surface, file, old, new, why): `old` occurs exactly once in the file (a path from the
repository root), `new` is a realistic bug (an off-by-one, an eps in the wrong place, swapped arguments, a
missing check, a wrong counter, a stale entry kept). For each, `run` copies src/ and tests/ to a scratch
folder, plants the bug there, and runs the fast tests of its surface (SELECTIONS: `-x -q -m "not slow"`,
PYTHONPATH on the copy); a bug is caught when that run fails. The summary goes to figures/planted_bugs.json.

    python tests/mutation/planted.py                 # every bug (nice it: ~72 short pytest runs)
    python tests/mutation/planted.py --only 3 17     # some of them, by index
    python tests/mutation/planted.py --check         # only check that every `old` occurs exactly once

The snippets are all in BUGS, in one place: after a rename elsewhere (serving's paging classes, ...), refresh
the few that no longer match (`--check` names them)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "planted_bugs.json"
FAST = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow"]

LIB = "tests/library/"
SELECTIONS = {
    "fixed_state": [LIB + "test_fixed_state.py", "tests/graded/test_fixed_state_step.py"],
    "ablations": [LIB + "test_ablations.py", "tests/graded/test_norm_ablations.py"],
    "key_map_auto": [LIB + "test_checkpoint_layouts.py"],
    "verify": [LIB + "test_ablations.py", LIB + "test_checkpoint_layouts.py"],
    "serving": [LIB + "test_engine_api.py", LIB + "test_paging.py", "tests/graded/test_engine_bookkeeping.py"],
    "engine_abort": [LIB + "test_engine_api.py", LIB + "test_async_engine.py"],
    "sampler": [LIB + "test_sampling.py", LIB + "test_engine_api.py", "tests/graded/test_sampling_rules.py"],
    "http_usage": [LIB + "test_http_operations.py"],
    "gguf_exact": [LIB + "test_gguf_exact.py"],
    "grader": [LIB + "test_grader.py", LIB + "test_grader_hostile.py"],
}

M = "src/cs336_inference/model/"
S = "src/cs336_inference/serving/"
LA, SSD, SC, ST = M + "linear_attention.py", M + "ssd.py", M + "short_conv.py", M + "state_cache.py"

BUGS: list[tuple[str, str, str, str, str]] = [
    # --- fixed-state layers -------------------------------------------------------------------------
    ("fixed_state", LA, "x = x / d ** 0.25", "x = x / d ** 0.5", "feature map scaled by 1/sqrt(d) on each side"),
    ("fixed_state", LA, "flatten(-2) / math.sqrt(2)", "flatten(-2) / 2", "second-order term s^2/4, not s^2/2"),
    ("fixed_state", LA, "torch.cat([torch.ones_like(x[..., :1]), x, outer]",
     "torch.cat([torch.zeros_like(x[..., :1]), x, outer]", "the Taylor map's constant term dropped"),
    ("fixed_state", LA, "k = torch.where(valid[:, None, :, None], k, 0.0)", "k = k",
     "padding's phi(0) = [1, 0, 0] enters the normaliser"),
    ("fixed_state", LA, "v.float(), None, normalize=True)", "v.float(), None, normalize=False)",
     "parallel form not normalised"),
    ("fixed_state", LA, "u = torch.where(valid[..., None], u, 0.0)  ", "u = u  ",
     "left padding enters the short convolution"),
    ("fixed_state", SSD, "dt = torch.where(valid[..., None], dt, 0.0)", "dt = dt", "padding decays the state"),
    ("fixed_state", SSD, "-torch.exp(self.a_log.float())[:, None] * dt", "-self.a_log.float()[:, None] * dt",
     "A used in log space (not exponentiated)"),
    ("fixed_state", SSD, "k = dt[..., None] * b[:, None].float()", "k = b[:, None].float() * dt[..., :1].pow(0)",
     "the key is B_t, not dt_t B_t"),
    ("fixed_state", SSD, "y = y + self.d_skip[:, None, None] * v", "y = y + 0.0 * v", "the D skip forgotten"),
    ("fixed_state", SSD, "self.norm(y * F.silu(self.gate_proj(x)))", "self.norm(y) * F.silu(self.gate_proj(x))",
     "gate applied after the norm"),
    ("fixed_state", SC, "window = F.pad(u, (0, 0, self.width - 1, 0))", "window = F.pad(u, (0, 0, 0, self.width - 1))",
     "the convolution pads the future (not causal)"),
    ("fixed_state", SC, "self.weight[:, None, :].to(x.dtype)", "self.weight.flip(-1)[:, None, :].to(x.dtype)",
     "kernel taps reversed"),
    ("fixed_state", ST, "device=log_decay.device).tril(-1)", "device=log_decay.device).tril()",
     "segment sums include a_j (off by one)"),
    ("fixed_state", ST, "from_state = q * log_decay.cumsum(-1).exp()[..., None]", "from_state = q",
     "the carried state not decayed in the parallel form"),
    ("fixed_state", ST, "den = weights.sum(-1)", "den = scores.sum(-1)", "normaliser counts future tokens"),
    ("fixed_state", ST, "y = y / (q @ normalizer[..., None]).clamp_min(1e-6)",
     "y = y / (q @ normalizer[..., None]).clamp_min(1.0)", "decode's denominator clamped far too high"),
    ("fixed_state", ST, "later = log_decay[..., 1:].flip(-1)", "later = log_decay[..., :-1].flip(-1)",
     "decay-to-end off by one"),
    ("fixed_state", ST, "_decayed(state, normalizer, log_decay.sum(-1).exp())",
     "_decayed(state, normalizer, log_decay[..., 1:].sum(-1).exp())", "prefill decays the old state one step short"),
    ("fixed_state", ST, "state, normalizer = _decayed(state, normalizer, log_decay[..., 0].exp())",
     "state, normalizer = state, normalizer", "decode never decays the state"),
    ("fixed_state", ST, "self.length = step.end", "self.length += 1", "length counts steps, not tokens"),
    ("fixed_state", ST, "conv=window[:, window.shape[1] - self.conv.shape[1]:]", "conv=window[:, :self.conv.shape[1]]",
     "keeps the oldest conv inputs, not the newest"),
    ("fixed_state", ST, "if n not in (0, self.length):", "if n not in (0, self.length, self.length - 1):",
     "a one-token rollback of a fixed state allowed"),
    ("fixed_state", ST, "return positions[None, :] >= pad.to(device)[:, None]",
     "return positions[None, :] > pad.to(device)[:, None]", "first real token taken as padding"),
    ("fixed_state", ST, "            self.conv = torch.zeros_like(self.conv)\n", "",
     "truncate(0) keeps the stale conv window"),
    # --- ablations: post-norm, QK-norm ------------------------------------------------------------------
    ("ablations", M + "variants.py", "torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight",
     "(torch.rsqrt(y.pow(2).mean(-1, keepdim=True)) + self.eps) * self.weight", "QK-norm eps outside the rsqrt"),
    ("ablations", M + "variants.py", "return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to",
     "return (y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + self.eps)).to", "weightless QK-norm: sum, not mean"),
    ("ablations", M + "variants.py", "attn.k_norm = cls(config.head_dim, config.eps(\"qk_norm\")",
     "attn.k_norm = cls(config.head_dim, config.eps(\"ln1\")", "k's QK-norm takes the block norm's eps"),
    ("ablations", M + "variants.py", "return self.positional(self(x), cos, sin)",
     "return self(self.positional(x, cos, sin))", "QK-norm after RoPE"),
    ("ablations", M + "variants.py", "attn.q_norm.rotate, attn.k_norm.rotate", "attn.q_norm.rotate, attn.q_norm.rotate",
     "k normalised with q's gain"),
    ("ablations", M + "transformer.py", "x = self.ln1(x + attn_out)", "x = x + self.ln1(attn_out)",
     "post-norm: the norm on the branch, not the sum"),
    ("ablations", M + "transformer.py", "return self.ln2(x + self.ffn(x)), kv", "return x + self.ln2(self.ffn(x)), kv",
     "post-norm: second norm on the branch"),
    ("ablations", M + "config.py", "return self.norm_eps if own is None else own", "return self.norm_eps",
     "a norm's own eps ignored"),
    ("ablations", M + "layers.py", "x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)",
     "x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps ** 2)", "RMSNorm eps squared"),
    ("ablations", M + "variants.py", "built = config.has_final_norm if name == \"ln_final\" else",
     "built = config.norm == \"rmsnorm\" if name == \"ln_final\" else", "final_norm setting ignored"),
    # --- key_map="auto" ---------------------------------------------------------------------------------
    ("key_map_auto", M + "key_inference.py", "rest[-1].lower() in PARAM_NAMES | BIAS_NAMES",
     "rest[-1].lower() in PARAM_NAMES", "a bias leaf kept as the component name"),
    ("key_map_auto", M + "key_inference.py", "return \"attn\" if attn and not ffn else \"ffn\" if ffn and not attn",
     "return \"attn\" if attn else \"ffn\" if ffn", "a section both attn and ffn taken as attn"),
    ("key_map_auto", M + "key_inference.py", "if key not in chosen and len(roles - taken) == 1:",
     "if key not in chosen and len(roles) == 1:", "no placement by elimination"),
    ("key_map_auto", M + "key_inference.py", "            if len(ks) > 1:\n", "            if len(ks) > 2:\n",
     "two tensors for one role not refused"),
    ("key_map_auto", M + "key_inference.py", "{\"ln1.weight\" if section == \"attn\" else \"ln2.weight\"}",
     "{\"ln2.weight\" if section == \"attn\" else \"ln1.weight\"}", "generic norms swapped"),
    ("key_map_auto", M + "key_inference.py", "if not config.tie_embeddings or headish:",
     "if not config.tie_embeddings:", "an lm_head of a tied model not placed"),
    ("key_map_auto", M + "checkpoint_keys.py", "if value.shape[0] != rows:", "if value.shape[0] < rows:",
     "a fused tensor with extra rows split silently"),
    ("key_map_auto", M + "checkpoint_keys.py", "\"k\": config.num_kv_heads * H, \"v\": config.num_kv_heads * H}\n"
     "        return _split(state, suffix, [(f\"attn.{c}_proj\", rows[c]) for c in order]",
     "\"k\": config.num_heads * H, \"v\": config.num_kv_heads * H}\n"
     "        return _split(state, suffix, [(f\"attn.{c}_proj\", rows[c]) for c in order]",
     "fused qkv split with k as wide as q (GQA ignored)"),
    ("key_map_auto", M + "checkpoint_keys.py", "            if new in out:\n", "            if new in out and False:\n",
     "two keys renamed onto one silently"),
    # --- verify -----------------------------------------------------------------------------------------
    ("verify", M + "verify.py", "atol = (5e-2 if half else 1e-3)", "atol = 1e-3", "bf16 compared with fp32's atol"),
    ("verify", M + "verify.py", "tolerance = atol + rtol * float(theirs.abs().max())", "tolerance = atol + rtol",
     "rtol not scaled by the logits' size"),
    ("verify", M + "verify.py", "for e in _EPS_TRIED if e != config.norm_eps]",
     "for e in _EPS_TRIED[:1] if e != config.norm_eps]", "only one other norm eps suggested"),
    ("verify", M + "verify.py", "first = float(delta[:, 0].max())", "first = float(delta[:, -1].max())",
     "position 0's check reads the last position"),
    ("verify", M + "verify.py", "out.sort(key=len)", "out.sort(key=len, reverse=True)",
     "combined variants tried before single ablations"),
    ("verify", M + "verify.py", "if config.qk_norm in (\"none\", \"no_gain\") else None]",
     "if config.qk_norm == \"none\" else None]", "weightless QK-norm never flipped back"),
    # --- chunked prefill, prefix-cache registration -------------------------------------------------------
    ("serving", S + "scheduler.py", "if seq.num_preemptions == 0:", "if True:",
     "a preempted request loses its num_cached_tokens"),
    ("serving", S + "scheduler.py", "new_tokens = min(new_tokens, self.max_num_batched_tokens - batch.num_tokens)",
     "new_tokens = min(new_tokens, self.max_num_batched_tokens)", "a chunk ignores the budget already used"),
    ("serving", S + "scheduler.py", "seq.num_computed_tokens += batch.num_scheduled_tokens[seq.seq_id]",
     "seq.num_computed_tokens = batch.num_scheduled_tokens[seq.seq_id]", "computed tokens set, not advanced"),
    ("serving", S + "scheduler.py", "seq.token_ids[:seq.num_computed_tokens + num_tokens])", "seq.token_ids)",
     "a chunk registers blocks it has not computed yet"),
    ("serving", S + "scheduler.py", "seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0",
     "seq.status = SequenceStatus.WAITING", "a preempted sequence keeps num_computed_tokens"),
    ("serving", S + "scheduler.py", "self.waiting.appendleft(seq)  # it arrived",
     "self.waiting.append(seq)  # it arrived",
     "a preempted request goes to the back of the queue"),
    ("serving", S + "block_pool.py", "        self._by_hash.clear()\n", "",
     "clear() keeps the hash names (stale after a failed forward)"),
    ("serving", S + "engine.py", "            pool.clear_prefix_cache()\n", "            pass\n",
     "prefix-cache names kept after a failed forward"),
    # --- engine abort ---------------------------------------------------------------------------------------
    ("engine_abort", S + "engine.py", "        live = self._live.pop(request_id, None)\n        if live is None:\n"
     "            return False", "        live = self._live.get(request_id)\n        if live is None:\n"
     "            return False", "an aborted request stays live"),
    ("engine_abort", S + "engine.py", "[], \"abort\", seq=seq, live=live)", "[], \"stop\", seq=seq, live=live)",
     "an abort reported as a stop"),
    ("engine_abort", S + "engine.py", "                if live.unfinished == 0:\n",
     "                if live.unfinished < 0:\n",
     "a finished request never leaves the live table"),
    ("engine_abort", S + "async_engine.py", "            self._client_ids.pop(client_id, None)\n", "",
     "a closed stream's request_id stays taken"),
    ("engine_abort", S + "async_engine.py", "internal_id = f\"{client_id}#{serial}\"", "internal_id = f\"{client_id}\"",
     "outputs routed by the caller's id alone"),
    ("engine_abort", S + "async_engine.py", "self._submit((\"abort\", internal_id))",
     "self._submit((\"abort\", client_id))", "abort sent under the caller's id"),
    # --- the sampler's logit check ----------------------------------------------------------------------
    ("sampler", "src/cs336_inference/generation/sampling.py", "if not bool(torch.isfinite(logits.amax(-1)).all()):",
     "if bool(torch.isnan(logits).any()):", "only NaN refused (+inf, all -inf pass)"),
    ("sampler", "src/cs336_inference/generation/sampling.py", "return ~torch.isfinite(logits.amax(-1))",
     "return torch.isnan(logits.amax(-1))", "engine rows with +inf or all -inf not flagged"),
    ("sampler", S + "sampler.py", "    if bad_rows:\n", "    if bad_rows and len(bad_rows) == len(rows):\n",
     "a bad row refused only when every row is bad"),
    ("sampler", "src/cs336_inference/generation/sampling.py", "logits.masked_fill(logits < kth, float(\"-inf\"))",
     "logits.masked_fill(logits <= kth, float(\"-inf\"))", "top-k drops the k-th logit"),
    # --- HTTP usage counting ---------------------------------------------------------------------------------
    ("http_usage", S + "http/server.py", "\"total_tokens\": prompt_tokens + completion_tokens}",
     "\"total_tokens\": completion_tokens}", "total_tokens without the prompt"),
    ("http_usage", S + "http/server.py", "self.counters[\"generation_tokens\"] += completion_tokens",
     "self.counters[\"generation_tokens\"] += 1", "/metrics counts requests as tokens"),
    ("http_usage", S + "http/server.py", "for c in choices[::req.n])", "for c in choices)",
     "the prompt counted once per choice"),
    ("http_usage", S + "http/server.py", "\n            self._usage(prompt_tokens, sum(tokens.values()))\n",
     "\n            pass\n", "a stream without usage not counted in /metrics"),
    # --- the exact Q4_1 mapping ------------------------------------------------------------------------------
    ("gguf_exact", "src/cs336_inference/quantization/gguf_exact.py", "minimum=blocks.minimum.to(device))",
     "minimum=-blocks.minimum.to(device))", "Q4_1 minimum with the wrong sign"),
    ("gguf_exact", "src/cs336_inference/quantization/gguf_exact.py", "scale, zeros, 4, False, group)",
     "scale, zeros, 4, True, group)", "Q4_1 codes read as signed"),
    # --- the grader's own guards -------------------------------------------------------------------------------
    ("grader", "tests/grading.py", "        signal.setitimer(signal.ITIMER_REAL, 0)\n", "",
     "the grader leaves its interval timer armed"),
    ("grader", "tests/grading.py", "signal.setitimer(signal.ITIMER_REAL, timeout + slack, 1.0)",
     "signal.setitimer(signal.ITIMER_REAL, timeout + slack)", "a graded function that swallows its first timeout"),
    ("grader", "tests/guard.py", "            return a.clone()\n", "            return a\n",
     "graded code can change the test's own inputs"),
    ("grader", "tests/guard.py", "except (OutcomeException, Exit, SystemExit, GeneratorExit) as err:",
     "except (OutcomeException, Exit) as err:", "a graded SystemExit ends the run"),
    ("grader", "tests/guard.py", "if type(value) not in (tuple, list) or len(value) != len(returns):",
     "if type(value) not in (tuple, list):", "a tuple of the wrong length accepted"),
]


def check() -> list[str]:
    """The entries whose `old` does not occur exactly once (after a rename elsewhere: refresh them)."""
    problems = []
    for i, (_, path, old, _, why) in enumerate(BUGS):
        n = (ROOT / path).read_text().count(old) if (ROOT / path).exists() else 0
        if n != 1:
            problems.append(f"#{i} {path}: `old` occurs {n} times ({why})")
    return problems


def plant(i: int, scratch: Path) -> list[str]:
    """Plant bug i in a fresh copy of src/ and tests/ under scratch; return the pytest command."""
    surface, path, old, new, _ = BUGS[i]
    for part in ("src", "tests"):
        shutil.rmtree(scratch / part, ignore_errors=True)
        shutil.copytree(ROOT / part, scratch / part, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", scratch / "pyproject.toml")
    target = scratch / path
    text = target.read_text()
    assert text.count(old) == 1, f"#{i}: {path} has {text.count(old)} copies of the snippet"
    target.write_text(text.replace(old, new))
    return [sys.executable, "-m", "pytest", *FAST, "-o", f"pythonpath=src tests {ROOT / 'lecture'}",
            *SELECTIONS[surface]]


def run(indices: list[int], timeout: float) -> dict:
    results = []
    with tempfile.TemporaryDirectory(prefix="planted_") as tmp:
        scratch = Path(tmp)
        for i in indices:
            surface, path, _, _, why = BUGS[i]
            cmd = plant(i, scratch)
            env = {**os.environ, "PYTHONPATH": f"{scratch / 'src'}:{scratch / 'tests'}:{ROOT / 'lecture'}",
                   "MPLBACKEND": "Agg"}
            start = time.monotonic()
            try:
                proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
                caught, tail = proc.returncode != 0, (proc.stdout + proc.stderr).strip().splitlines()[-1:]
                if proc.returncode not in (0, 1):        # an error of the run itself (collection, ...) still fails
                    tail = [f"rc {proc.returncode}: " + " ".join(tail)]
            except subprocess.TimeoutExpired:
                caught, tail = True, [f"timed out after {timeout:g} s"]
            seconds = time.monotonic() - start
            results.append({"index": i, "surface": surface, "file": path, "why": why, "caught": caught,
                            "seconds": round(seconds, 1), "last_line": tail[0][:200] if tail else ""})
            print(f"#{i:2d} {'caught  ' if caught else 'SURVIVED'} {seconds:5.1f}s {surface:12s} {why}", flush=True)
    return {"bugs": len(BUGS), "run": len(results), "caught": sum(r["caught"] for r in results),
            "survived": [r["index"] for r in results if not r["caught"]], "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="indices of the bugs to run (default: all)")
    parser.add_argument("--check", action="store_true", help="only check that each snippet occurs exactly once")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per bug's test run")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON summary (default: figures/planted_bugs.json for a run of every bug)")
    args = parser.parse_args()
    problems = check()
    if problems or args.check:
        print("\n".join(problems) if problems else f"all {len(BUGS)} snippets occur exactly once")
        sys.exit(1 if problems else 0)
    indices = args.only if args.only else list(range(len(BUGS)))
    summary = run(indices, args.timeout)
    out = args.out if args.out is not None else OUT if args.only is None else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"caught {summary['caught']} / {summary['run']} (survived: {summary['survived']})")


if __name__ == "__main__":
    main()
