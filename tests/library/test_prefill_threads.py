"""The thread policy covers prefill as well as decode: under contention a tuned model's prefill (many
tokens) runs on one thread by its own threshold, and gets its thread count back afterwards."""

import torch

import adapters


def test_a_prefill_under_contention_runs_on_one_thread_by_its_own_threshold(monkeypatch):
    from cs336_inference import cpu_tuning
    from cs336_inference.timing import num_threads

    config = adapters.make_config(vocab_size=64, d_model=32, num_heads=2, d_ff=64, num_layers=1, context_length=32)
    model = cpu_tuning.tune_for_cpu(adapters.make_model(config))
    seen, asked = [], []
    model.lm_head.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    ids = torch.randint(0, 64, (1, 12))
    with num_threads(2), torch.no_grad():
        monkeypatch.setattr(cpu_tuning, "cpu_contended", lambda threshold=0.5: asked.append(threshold) or True)
        model(ids, cache=model.new_cache(1, 16))
        assert seen == [1] and asked == [cpu_tuning.PREFILL_CONTENDED] and torch.get_num_threads() == 2
        monkeypatch.setattr(cpu_tuning, "cpu_contended", lambda threshold=0.5: False)
        model(ids, cache=model.new_cache(1, 16))
        assert seen == [1, 2]
        with cpu_tuning.prefill_threads():
            assert torch.get_num_threads() == 2
