"""`parallel.decode_split`: two real ranks on 127.0.0.1 (gloo) decode like one process, and say where a
decode step's time went. The reference logits and tokens are computed here by the unsharded model."""

import pytest
import torch

from cs336_inference.model import load_pretrained
from cs336_inference.parallel import launch
from cs336_inference.parallel.decode_split import decode_split_rank, probe_allreduce

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_two_ranks_decode_like_one_process_and_split_each_step():
    prompt = [[5, 17, 200, 3, 99, 42, 7, 1], [1, 2, 3, 4, 5, 6, 7, 8]]
    new_tokens = 6
    tp = launch(decode_split_rank, 2, "target", prompt, new_tokens, probe_reps=5, timeout_s=300)
    model = load_pretrained("target", dtype=torch.float32).eval()
    ids = torch.tensor(prompt)
    with torch.no_grad():     # greedy decode without a cache: the whole sequence re-run every step
        ref_logits, ref_tokens = [], []
        for _ in range(new_tokens + 1):
            last = model(ids)[:, -1]
            ref_logits.append(last)
            ref_tokens.append(last.argmax(-1))
            ids = torch.cat([ids, last.argmax(-1)[:, None]], 1)
    assert (tp["prefill_logits"] - ref_logits[0]).abs().max() < 1e-4
    assert (tp["decode_logits"] - torch.stack(ref_logits[1:])).abs().max() < 1e-4
    assert torch.equal(tp["tokens"], torch.stack(ref_tokens[:new_tokens], 1))
    L = model.config.num_layers
    assert tp["all_reduces"] == 2 * L                                   # one after attention, one after the FFN
    assert len(tp["step_s"]) == len(tp["comm_s"]) == new_tokens
    assert all(0 < c < s for c, s in zip(tp["comm_s"], tp["step_s"]))  # inside the step, and not free
    assert tp["latency_s"] > 0 and tp["bandwidth_Bps"] > 0
    assert tp["weight_bytes"] * 2 == tp["full_weight_bytes"]
    whole_cache = model.new_cache(2, len(prompt[0]) + new_tokens + 1).nbytes
    assert tp["cache_bytes"] * 2 == whole_cache


@pytest.mark.parametrize("kwargs", [dict(reps=0), dict(reps=2, probe_bytes=-4), dict(reps=1.5)])
def test_probe_refuses_bad_sizes_before_any_collective(kwargs):
    with pytest.raises((ValueError, TypeError), match="reps|probe_bytes"):
        probe_allreduce(**kwargs)      # no process group here: a collective would raise something else
