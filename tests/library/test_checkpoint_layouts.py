"""A corpus of students' assignment-1 layouts and the handout's ablations (tests/student_layouts.py: small
models written here, each with its own names and a naive forward): each loads with key_map="auto" to its own
logits (|delta| < 1e-4), or is refused with a message naming the fix; `verify` catches the ablations whose
keys are the base model's; nothing is dropped without allow_dropped= and a warning."""

import pytest
import torch
from adapters import run_infer_key_map, run_load_cs336_checkpoint, run_verify_checkpoint
from student_layouts import LAYOUTS, Arch, Layout, StudentLM

from cs336_inference.model import (AutoKeyMapError, CheckpointMismatchError, ModelConfig, split_fused_gate_up,
                                   split_fused_qkv)

IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
RENAMED = LAYOUTS["mha_r_w_Q_swiglu_ff_linear_W_g"]


def _config(arch: Arch, **fields) -> ModelConfig:
    return ModelConfig(vocab_size=arch.vocab, context_length=32, d_model=arch.d_model, num_layers=arch.layers,
                       num_heads=arch.heads, num_kv_heads=arch.kv_heads, d_ff=arch.d_ff, rope_theta=arch.theta,
                       norm_eps=arch.eps, **fields)


def _delta(model, student) -> float:
    with torch.no_grad():
        return float((model(IDS) - student(IDS)).abs().max())


def _pasted_key_map(printed: str):
    """Run the code key_map='auto' printed, as a user pasting it would."""
    namespace = {"split_fused_qkv": split_fused_qkv, "split_fused_gate_up": split_fused_gate_up}
    exec(printed.split("key_map=key_map:\n", 1)[1], namespace)
    return namespace["key_map"]


ARCHS = {"gqa": Arch(), "mha": Arch(kv_heads=4), "mqa": Arch(kv_heads=1)}
CASES = [(layout, "gqa") for layout in LAYOUTS] + [("bare_Wq_Wk_Wv_Wo_dot_w", "mha"), ("fused_qkv_proj_weights", "mqa"),
                                                   ("gain_weights_ffn_l1_output_embed", "mha")]


@pytest.mark.parametrize("layout, heads", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_every_layout_loads_with_auto_and_the_printed_map_pastes_back(layout, heads, capsys):
    arch = ARCHS[heads]
    student = StudentLM(arch, LAYOUTS[layout], seed=1)
    model = run_load_cs336_checkpoint(student.state_dict(), _config(arch), key_map="auto")
    assert _delta(model, student) < 1e-4
    printed = capsys.readouterr().out
    if layout == "handout":
        assert "already have the handout's names" in printed
        return
    again = run_load_cs336_checkpoint(student.state_dict(), _config(arch), key_map=_pasted_key_map(printed))
    with torch.no_grad():
        assert torch.equal(again(IDS), model(IDS))


ABLATIONS = {   # student architecture, the config fields that load it
    "post_norm": (Arch(post_norm=True), dict(norm_position="post")),
    "nope": (Arch(rope=False), dict(positional="none")),
    "silu_ffn": (Arch(swiglu=False, d_ff=64), dict(ffn="silu")),
    "no_rmsnorm": (Arch(norms=False), dict(norm="none")),
    "qk_norm_gain": (Arch(qk_norm="gain"), dict(qk_norm="gain", qk_norm_eps=1e-6)),
    "qk_norm_no_gain": (Arch(qk_norm="no_gain"), dict(qk_norm="no_gain", qk_norm_eps=1e-6)),
}
QK_NAMES = Layout(**{**RENAMED.__dict__, "q_norm": "q_norm.g", "k_norm": "k_norm.g"})


@pytest.mark.parametrize("name", ABLATIONS)
def test_each_ablation_loads_with_its_config_fields(name):
    arch, fields = ABLATIONS[name]
    student = StudentLM(arch, QK_NAMES, seed=2)
    model = run_load_cs336_checkpoint(student.state_dict(), _config(arch, **fields), key_map="auto",
                                      verify=student)
    assert _delta(model, student) < 1e-4


@pytest.mark.parametrize("name, fix", [("post_norm", "norm_position='post'"), ("nope", "positional='none'"),
                                       ("qk_norm_no_gain", "qk_norm='no_gain'")])
def test_verify_catches_ablations_with_the_base_models_keys(name, fix):
    arch, fields = ABLATIONS[name]
    student = StudentLM(arch, QK_NAMES, seed=3)
    wrong = run_load_cs336_checkpoint(student.state_dict(), _config(arch), key_map="auto")   # loads: same keys
    assert _delta(wrong, student) > 1e-2
    with pytest.raises(CheckpointMismatchError, match=rf"max \|delta logit\| = .*matches these weights with {fix}"):
        run_verify_checkpoint(wrong, student)
    with pytest.raises(CheckpointMismatchError) as err:
        run_load_cs336_checkpoint(student.state_dict(), _config(arch), key_map="auto", verify=student)
    assert err.value.suggestion == dict([fix.replace("'", "").split("=")]) and err.value.max_delta > 1e-2


@pytest.mark.parametrize("name, message", [
    ("silu_ffn", r"no layer has ffn\.w3 .*ModelConfig\(\.\.\., ffn='silu'\)"),
    ("no_rmsnorm", r"no RMSNorm weights in its blocks and no final norm.*norm='none'\)"),
    ("qk_norm_gain", r"look like QK-norm gains .*qk_norm='gain'"),
])
def test_ablations_with_other_keys_are_refused_naming_the_config_field(name, message):
    arch, _ = ABLATIONS[name]
    student = StudentLM(arch, QK_NAMES if name != "qk_norm_gain" else LAYOUTS["handout"], seed=4)
    for key_map in ("auto", None):
        with pytest.raises(ValueError, match=message):
            run_load_cs336_checkpoint(student.state_dict(), _config(arch), key_map=key_map)


def test_dropping_is_never_silent():
    """The way the README used to show (rename to None) needs allow_dropped= and warns naming each tensor."""
    student = StudentLM(ABLATIONS["qk_norm_gain"][0], LAYOUTS["handout"], seed=5)
    drop = {r"\.(q|k)_norm\.": None}
    with pytest.raises(ValueError, match=r"key_map discarded 4 tensor\(s\).*allow_dropped=(.|\n)*qk_norm='gain'"):
        run_load_cs336_checkpoint(student.state_dict(), _config(student.arch), key_map=drop)
    with pytest.warns(UserWarning, match=r"discarded 4 tensor\(s\).*layers\.0\.attn\.q_norm\.weight \(8,\)"):
        run_load_cs336_checkpoint(student.state_dict(), _config(student.arch), key_map=drop, allow_dropped="_norm")
    # buffers a student saved (RoPE tables): refused with the hint, then dropped with a warning
    buffers = StudentLM(Arch(), Layout(buffers={"cos_cached": (32, 4)}), seed=6)
    with pytest.raises(ValueError, match=r"unexpected keys .*cos_cached(.|\n)*RoPE tables .*allow_dropped="):
        run_load_cs336_checkpoint(buffers.state_dict(), _config(buffers.arch), key_map="auto")
    with pytest.warns(UserWarning, match=r"discarded 2 tensor\(s\).*layers\.0\.attn\.cos_cached \(32, 4\)"):
        model = run_load_cs336_checkpoint(buffers.state_dict(), _config(buffers.arch), key_map="auto",
                                          allow_dropped="cos_cached")
    assert _delta(model, buffers) < 1e-4
    with pytest.raises(TypeError, match="allow_dropped must be"):
        run_load_cs336_checkpoint(buffers.state_dict(), _config(buffers.arch), allow_dropped=3)


def test_auto_refuses_ambiguous_roles_naming_the_candidates():
    nameless = StudentLM(Arch(), Layout(k="a.weight", v="b.weight"), seed=7)   # k and v: same shape, no names
    with pytest.raises(AutoKeyMapError, match=r"layers\.0\.attn\.a\.weight could be any of \['attn\.k_proj\.weight', "
                                              r"'attn\.v_proj\.weight'\]"):
        run_infer_key_map(nameless.state_dict(), _config(nameless.arch))
    # w1 = gate, w2 = up, w3 = down: the names contradict the shapes, so no guess is loaded
    renumbered = StudentLM(Arch(), Layout(w1="w1.weight", w3="w2.weight", w2="w3.weight"), seed=8)
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.w2\.weight has shape \(48, 32\), but its name says "
                                         r"ffn\.w2\.weight \(shape \(32, 48\)"):
        run_load_cs336_checkpoint(renumbered.state_dict(), _config(renumbered.arch), key_map="auto")
    deeper = StudentLM(Arch(layers=3), Layout(), seed=9)
    with pytest.raises(AutoKeyMapError, match=r"layer indices \[0, 1, 2\] .*config.num_layers=2"):
        run_infer_key_map(deeper.state_dict(), _config(Arch()))


def test_hints_say_what_each_suggested_map_fixes():
    student = StudentLM(Arch(), RENAMED, seed=10)
    with pytest.raises(ValueError) as err:
        run_load_cs336_checkpoint(student.state_dict(), _config(student.arch))
    message = str(err.value)
    assert "key_map=COMMON_RENAMES fixes 4 of the 21 missing keys; 17 stay missing" in message
    assert "key_map='auto' loads this checkpoint (it places all 21 tensors" in message
    nameless = StudentLM(Arch(), Layout(k="a.weight", v="b.weight"), seed=7)
    with pytest.raises(ValueError, match="key_map='auto' does not load it either: .* could be any of"):
        run_load_cs336_checkpoint(nameless.state_dict(), _config(nameless.arch))


def test_verify_names_the_kind_of_difference_it_cannot_explain():
    student = StudentLM(Arch(theta=500000.0), Layout(), seed=11)
    theta_wrong = run_load_cs336_checkpoint(student.state_dict(), _config(Arch()))
    with pytest.raises(CheckpointMismatchError, match=r"Position 0 agrees .* RoPE \(rope_theta"):
        run_verify_checkpoint(theta_wrong, student)
    swapped = run_load_cs336_checkpoint(student.state_dict(), _config(student.arch),
                                        key_map={r"\.w1\.": ".tmp.", r"\.w3\.": ".w1.", r"\.tmp\.": ".w3."})
    with pytest.raises(CheckpointMismatchError, match=r"Position 0 already differs.* w1 \(gate\) vs w3 \(up\)"):
        run_verify_checkpoint(swapped, student)
    assert run_verify_checkpoint(run_load_cs336_checkpoint(student.state_dict(), _config(student.arch)), student) < 1e-4
    with pytest.raises(ValueError, match=r"returned logits of shape \(2, 16\)"):
        run_verify_checkpoint(swapped, lambda ids: ids.float())


def test_the_homework_skeleton_loads_and_verifies_the_students_model(tmp_path, capsys):
    import importlib.util

    from cs336_inference.homework import skeleton
    skeleton.write_skeleton(tmp_path / "my_solution")
    spec = importlib.util.spec_from_file_location("a1_loader", tmp_path / "my_solution" / "my_assignment1_model.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    student = StudentLM(Arch(post_norm=True), RENAMED, seed=12)
    model = loader.load_my_model(student.state_dict(), _config(student.arch, norm_position="post"), student)
    assert _delta(model, student) < 1e-4
    with pytest.raises(CheckpointMismatchError, match="norm_position='post'"):
        loader.load_my_model(student.state_dict(), _config(student.arch), student)


def test_auto_with_tied_embeddings_takes_the_table_once_or_twice():
    student = StudentLM(Arch(), RENAMED, seed=13)
    with torch.no_grad():
        student.out_linear.W.copy_(student.embedding.embedding)      # the student tied them: both names saved
    state = student.state_dict()
    tied = _config(student.arch, tie_embeddings=True)
    both = run_load_cs336_checkpoint(state, tied, key_map="auto")
    once = run_load_cs336_checkpoint({k: v for k, v in state.items() if k != "out_linear.W"}, tied, key_map="auto")
    with torch.no_grad():
        want = student(IDS)
        assert float((both(IDS) - want).abs().max()) < 1e-4 and torch.equal(once(IDS), both(IDS))


def test_auto_places_a_nameless_key_by_elimination():
    """In MHA, q/k/v/output all have shape (D, D); with q, k, v named, the nameless 'mix' can only be the output
    projection. Likewise in the FFN, w1 and w3 are both (F, D): with w1 named, 'blend' must be w3. A single
    pass over the keys (no elimination) leaves both unplaced; a wrong placement changes the logits."""
    student = StudentLM(Arch(kv_heads=4), Layout(o="mix.weight", w3="blend.weight"), seed=11)
    inferred = run_infer_key_map(student.state_dict(), _config(student.arch))
    for i in range(student.arch.layers):
        assert inferred.renames[f"layers.{i}.attn.mix.weight"] == f"layers.{i}.attn.output_proj.weight"
        assert inferred.renames[f"layers.{i}.ffn.blend.weight"] == f"layers.{i}.ffn.w3.weight"
    model = run_load_cs336_checkpoint(student.state_dict(), _config(student.arch), key_map="auto")
    assert _delta(model, student) < 1e-4



def test_auto_reads_a_module_named_for_both_attention_and_ffn_by_its_leaf_names():
    """A student's FFN module called 'post_attn_mlp' names both sections ('attn' and 'mlp'), so the module name
    says nothing and its tensors are placed by their leaf names (w1/w2/w3) and shapes alone. Taking it for the
    attention module would leave no role for (d_ff, d_model) tensors there: the FFN weights would go unplaced.
    The reference is the student's own forward."""
    student = StudentLM(Arch(), Layout(ffn="post_attn_mlp"), seed=16)
    inferred = run_infer_key_map(student.state_dict(), _config(student.arch))
    for i in range(student.arch.layers):
        for w in ("w1", "w2", "w3"):
            assert inferred.renames[f"layers.{i}.post_attn_mlp.{w}.weight"] == f"layers.{i}.ffn.{w}.weight"
    model = run_load_cs336_checkpoint(student.state_dict(), _config(student.arch), key_map="auto")
    assert _delta(model, student) < 1e-4


def test_verify_suggests_the_students_norm_eps_where_it_matters():
    """A student whose RMSNorm uses eps = 1e-8, loaded with the default norm_eps = 1e-5: on embeddings of mean
    square ~1e-6 the first norm differs by a factor ~sqrt(11), and of the eps values verify tries only 1e-8
    reproduces the student's logits, so that is the fix it must name."""
    student = StudentLM(Arch(eps=1e-8), Layout(), seed=12)
    with torch.no_grad():
        student.get_parameter("token_embeddings.weight").mul_(1e-3)
    wrong = run_load_cs336_checkpoint(student.state_dict(), _config(Arch()))
    assert wrong.config.norm_eps == 1e-5 and _delta(wrong, student) > 1e-2
    with pytest.raises(CheckpointMismatchError, match=r"matches these weights with norm_eps=1e-08") as err:
        run_verify_checkpoint(wrong, student)
    assert err.value.suggestion == {"norm_eps": 1e-8}
    right = run_load_cs336_checkpoint(student.state_dict(), _config(student.arch))
    assert run_verify_checkpoint(right, student) < 1e-4


def test_verify_tolerance_is_relative_to_large_logits():
    """Logits of size ~1e3 (the head scaled by 1000): a shift of 0.05 is within rtol = 1e-3 of them (though
    50 x atol), a shift of 20 is not; both computed here from the student's own logits."""
    student = StudentLM(Arch(), Layout(), seed=13)
    with torch.no_grad():
        student.get_parameter("lm_head.weight").mul_(1000)
    model = run_load_cs336_checkpoint(student.state_dict(), _config(student.arch))
    with torch.no_grad():
        scale = float(student(torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))).abs().max())
    assert scale > 500                                   # 1e-3 * scale > 0.05 + 1e-3, and 20 > 1e-3 + 1e-3 * scale
    assert run_verify_checkpoint(model, lambda ids: student(ids) + 0.05) == pytest.approx(0.05, abs=5e-3)
    with pytest.raises(CheckpointMismatchError, match=r"max \|delta logit\| = 20"):
        run_verify_checkpoint(model, lambda ids: student(ids) + 20.0)


def test_verify_of_a_bf16_model_against_the_students_fp32_forward():
    """bf16 rounds every activation (relative 2^-8): the fp32 tolerance would refuse a correct bf16 model, so a
    bf16 model is held to atol 5e-2 + rtol 2e-2; a real difference (post-norm weights loaded as pre-norm)
    is still refused in bf16."""
    student = StudentLM(Arch(), Layout(), seed=14)
    model = run_load_cs336_checkpoint(student.state_dict(), _config(student.arch)).to(torch.bfloat16)
    worst = run_verify_checkpoint(model, student)
    assert 1e-3 < worst < 5e-2 + 2e-2 * 10, worst      # bf16 rounding shows, and is accepted
    arch, _ = ABLATIONS["post_norm"]
    post = StudentLM(arch, QK_NAMES, seed=15)
    wrong = run_load_cs336_checkpoint(post.state_dict(), _config(arch), key_map="auto").to(torch.bfloat16)
    with pytest.raises(CheckpointMismatchError):
        run_verify_checkpoint(wrong, post)



def test_verify_of_a_bf16_model_uses_the_bf16_atol_when_rtol_is_zero():
    """With rtol=0 only atol is left: a correct bf16 conversion differs from the student's fp32 logits by bf16
    rounding (measured here, above fp32's atol 1e-3 and below 5e-2), so it must pass with bf16's default atol
    5e-2 (the documented rule) and would be refused with fp32's 1e-3; an explicit atol=1e-3 refuses it."""
    student = StudentLM(Arch(), Layout(), seed=14)
    model = run_load_cs336_checkpoint(student.state_dict(), _config(student.arch)).to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rounding = float((model(ids).float() - student(ids)).abs().max())
    assert 1e-3 < rounding < 5e-2, rounding
    assert run_verify_checkpoint(model, student, rtol=0.0) < 5e-2
    with pytest.raises(CheckpointMismatchError):
        run_verify_checkpoint(model, student, rtol=0.0, atol=1e-3)


@pytest.mark.parametrize("extra", [1, -1])
def test_a_fused_projection_with_a_wrong_number_of_rows_is_refused_not_split(extra):
    """A fused q/k/v must have exactly N H + 2 K H rows (counted here from the config): one row more or fewer is
    another layout, never split silently."""
    cfg = _config(ARCHS["gqa"])
    rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    fused = {"layers.0.attn.qkv_proj.weight": torch.zeros(rows + extra, cfg.d_model)}
    with pytest.raises(ValueError, match=f"has {rows + extra} rows; a fused q/k/v projection for this config has "
                                         f"{rows}"):
        split_fused_qkv()(fused, cfg)
    parts = split_fused_qkv()({"layers.0.attn.qkv_proj.weight": torch.zeros(rows, cfg.d_model)}, cfg)
    assert [tuple(p.shape) for p in parts.values()] == [(cfg.num_heads * cfg.head_dim, cfg.d_model)] + \
        [(cfg.num_kv_heads * cfg.head_dim, cfg.d_model)] * 2


def test_two_tensors_named_for_one_role_are_refused_not_one_picked():
    """A layer with both q_proj and `query` of q's shape: either could be q, so auto must refuse (naming both), not
    load one and leave the other unmapped."""
    cfg = _config(ARCHS["gqa"])
    state = dict(StudentLM(ARCHS["gqa"], LAYOUTS["handout"]).state_dict())
    assert "layers.0.attn.q_proj.weight" in state
    state["layers.0.attn.query.weight"] = state["layers.0.attn.q_proj.weight"].clone()
    with pytest.raises(AutoKeyMapError, match=r"found 2 tensors for attn\.q_proj\.weight in layer 0"):
        run_infer_key_map(state, cfg)


def test_a_key_map_that_renames_two_keys_onto_one_is_refused():
    """Two tensors under one name: the second would silently replace the first, so the rename refuses."""
    from cs336_inference.model import rename_keys
    cfg = _config(ARCHS["gqa"])
    state = {"layers.0.ffn.gate_proj.weight": torch.zeros(2), "layers.0.ffn.W1.weight": torch.ones(2)}
    with pytest.raises(ValueError, match=r"maps two keys to 'layers\.0\.ffn\.w1\.weight'"):
        rename_keys({r"\.ffn\.(gate_proj|W1)\.": ".ffn.w1."})(state, cfg)
    with pytest.raises(ValueError, match="maps two keys to 'same'"):
        rename_keys(lambda key: "same")(state, cfg)


def test_verify_suggests_the_smallest_change_when_a_larger_one_also_matches():
    """With one token (seq_len=1) RoPE rotates by angle 0, so NoPE changes nothing: a post-norm student is matched
    by norm_position='post' alone and by post + NoPE; the suggestion must be the single change."""
    arch, _ = ABLATIONS["post_norm"]
    student = StudentLM(arch, QK_NAMES, seed=3)
    wrong = run_load_cs336_checkpoint(student.state_dict(), _config(arch), key_map="auto")
    with pytest.raises(CheckpointMismatchError) as err:
        run_verify_checkpoint(wrong, student, seq_len=1)
    assert err.value.suggestion == {"norm_position": "post"}


def test_verify_suggests_dropping_a_weightless_qk_norm_the_student_does_not_have():
    """The flip works both ways: loaded with qk_norm='no_gain' (same keys) but the student has no QK-norm."""
    arch = ARCHS["gqa"]
    student = StudentLM(arch, QK_NAMES, seed=3)
    wrong = run_load_cs336_checkpoint(student.state_dict(), _config(arch, qk_norm="no_gain"), key_map="auto")
    with pytest.raises(CheckpointMismatchError) as err:
        run_verify_checkpoint(wrong, student)
    assert err.value.suggestion == {"qk_norm": "none"}
