"""The thread policy covers prefill as well as decode: under contention a tuned model's prefill (many
tokens) runs on one thread by its own threshold, and gets its thread count back afterwards."""

import torch

import adapters


def test_a_prefill_under_contention_runs_on_one_thread_by_its_own_threshold(monkeypatch):
    from cs336_inference.workshop import cpu_tuning
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


def test_a_tuned_model_can_be_copied_and_the_copy_restores_its_own_threads(monkeypatch):
    """deepcopy (quantize_model copies its input) of a CPU-tuned model: the per-thread stacks of counts
    to restore are not shared with the original, and the copy computes what the original computes."""
    import copy

    from cs336_inference.workshop import cpu_tuning
    from cs336_inference.timing import num_threads

    config = adapters.make_config(vocab_size=64, d_model=32, num_heads=2, d_ff=64, num_layers=1, context_length=32)
    model = cpu_tuning.tune_for_cpu(adapters.make_model(config))
    model.cpu_tuning.previous_threads.append(7)   # as if the original were inside a forward
    twin = copy.deepcopy(model)
    assert twin.cpu_tuning.previous_threads == [] and model.cpu_tuning.previous_threads == [7]
    model.cpu_tuning.previous_threads.clear()
    monkeypatch.setattr(cpu_tuning, "cpu_contended", lambda threshold=0.5: True)
    ids = torch.randint(0, 64, (1, 5))
    with num_threads(2), torch.no_grad():
        torch.testing.assert_close(twin(ids), model(ids))
        assert torch.get_num_threads() == 2 and twin.cpu_tuning.previous_threads == []
