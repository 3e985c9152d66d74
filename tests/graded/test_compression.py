"""Graded: which structures pruning keeps (structures_to_keep, gqa_heads_to_keep) and the distillation loss
(distillation_loss). References are written here: sorting by (score, index) by hand, groups scored by loops,
KL divergences summed over the vocabulary in float64."""

import math

import pytest
import torch
from adapters import run_distillation_loss, run_gqa_heads_to_keep, run_structures_to_keep


def ref_keep(scores, k):
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return sorted(order[:k])


def test_the_largest_scores_are_kept_in_their_original_order_ties_to_the_lower_index():
    scores = torch.tensor([0.5, 3.0, 0.5, 2.0, 9.0, 0.5, 0.1])
    for k, want in [(1, [4]), (3, [1, 3, 4]), (4, [0, 1, 3, 4]), (5, [0, 1, 2, 3, 4]), (7, list(range(7)))]:
        got = run_structures_to_keep(scores, k)
        assert got.tolist() == want == ref_keep(scores, k), f"keep {k}: got {got.tolist()}, want {want}"
    random_scores = torch.rand(50, generator=torch.Generator().manual_seed(0))
    assert run_structures_to_keep(random_scores, 17).tolist() == ref_keep(random_scores, 17)


def ref_gqa_keep(head_scores, K, keep_kv, keep_g):
    G = len(head_scores) // K
    group_scores = [sum(float(head_scores[g * G + j]) for j in range(G)) for g in range(K)]
    groups = ref_keep(group_scores, keep_kv)
    heads = [g * G + j for g in groups for j in ref_keep(head_scores[g * G:(g + 1) * G], keep_g)]
    return groups, heads


@pytest.mark.parametrize("K, G, keep_kv, keep_g", [(4, 2, 2, 2), (4, 3, 3, 1), (2, 4, 1, 3), (6, 2, 6, 1)])
def test_gqa_pruning_keeps_whole_groups_ranked_by_their_summed_heads(K, G, keep_kv, keep_g):
    g = torch.Generator().manual_seed(K * 10 + G)
    head_scores = torch.rand(K * G, generator=g)
    head_scores[0] = 5.0                  # one strong head in an otherwise weak group
    groups, heads = run_gqa_heads_to_keep(head_scores, K, keep_kv, keep_g)
    want_groups, want_heads = ref_gqa_keep(head_scores, K, keep_kv, keep_g)
    assert groups.tolist() == want_groups and heads.tolist() == want_heads, (groups.tolist(), heads.tolist())


def ref_distillation(student, teacher, T):
    total, n = 0.0, 0
    V = student.shape[-1]
    for s_row, t_row in zip(student.double().reshape(-1, V), teacher.double().reshape(-1, V)):
        log_q = torch.log_softmax(s_row / T, -1)
        log_p = torch.log_softmax(t_row / T, -1)
        total += float((log_p.exp() * (log_p - log_q)).sum())
        n += 1
    return T * T * total / n


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_distillation_is_t_squared_kl_from_the_teacher_to_the_student(temperature):
    g = torch.Generator().manual_seed(int(temperature * 10))
    student = (torch.randn(2, 5, 9, generator=g) * 2).requires_grad_()
    teacher = torch.randn(2, 5, 9, generator=g) * 3
    loss = run_distillation_loss(student, teacher, temperature)
    assert loss.dim() == 0
    assert float(loss.detach()) == pytest.approx(ref_distillation(student.detach(), teacher, temperature), rel=1e-5)
    reverse = ref_distillation(teacher, student.detach(), temperature)    # the other direction differs here
    assert not math.isclose(reverse, ref_distillation(student.detach(), teacher, temperature), rel_tol=1e-3)
    loss.backward()
    assert student.grad is not None and float(student.grad.abs().sum()) > 0
