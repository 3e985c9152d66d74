"""`key_map="auto"`: which tensor of a student's checkpoint plays which role, from its shape and its name.

Every student names the assignment-1 modules differently (`blocks.3.mha_r.w_Q`, `transformer_layers.3.attn.Wq`,
`layers.3.swiglu_ff.linear_1.W`, `embed.embed_matrix`, `out_norm.g`, ...), but the shapes are fixed by the
config and the names carry a few tokens that say enough: a layer index, q/k/v/o, w1/w2/w3 or gate/up/down,
norm 1/2/final, embedding vs head, a fused qkv or gate_up. Each key gets the roles its shape allows, narrowed
by the roles its name says; a key left with one role takes it (and leaves it to no other), until nothing
changes. Whatever stays open is refused, naming the candidates: a guess is never loaded.

`infer_key_map` returns the mapping as an ordinary key map (regex renames plus `split_fused_*` steps), and
`code` prints it so it can be pasted back as an explicit `key_map=`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .checkpoint_keys import rename_keys, split_fused_gate_up, split_fused_qkv
from .config import ModelConfig

PARAM_NAMES = {"weight", "w", "g", "gain", "weights", "scale", "embed_matrix", "embedding", "embeddings",
               "matrix", "param", "kernel", "gamma"}
BIAS_NAMES = {"bias", "b", "beta"}
FUSED_QKV = "attn.qkv_proj.weight"
FUSED_GATE_UP = "ffn.gate_up_proj.weight"

# Leaf names (lower case, '_' removed) of each role inside a block.
_PROJ = r"(proj|projection|linear|lin|layer|mat|matrix|weight|w)?"
_LAYER_NAMES = {
    "attn.q_proj.weight": rf"^(w|to|proj|linear|lin)?q(uery)?{_PROJ}$",
    "attn.k_proj.weight": rf"^(w|to|proj|linear|lin)?k(ey)?{_PROJ}$",
    "attn.v_proj.weight": rf"^(w|to|proj|linear|lin)?v(alue)?{_PROJ}$",
    "attn.output_proj.weight": rf"^(w|to)?o{_PROJ}$|^(w|attn|c)?out(put)?{_PROJ}$|^c?proj$|^dense$",
    FUSED_QKV: r"qkv|kqv|kvq|vqk|qvk|vkq|^cattn$|^inproj$",
    "ffn.w1.weight": r"^(w|linear|lin|l|fc|dense|proj|layer|mat)1$|^w?gate(proj|linear|lin)?$|^wg$",
    "ffn.w2.weight": r"^(w|linear|lin|l|fc|dense|proj|layer|mat)2$|^w?down(proj|linear|lin)?$|^wd$",
    "ffn.w3.weight": r"^(w|linear|lin|l|fc|dense|proj|layer|mat)3$|^w?up(proj|linear|lin)?$|^wu$",
    FUSED_GATE_UP: r"gateup|upgate|w13|w31|w1w3|w3w1|^fcin$",
    "ln1.weight": r"^(ln|norm|rms|rmsnorm|layernorm|lnorm)1$|^(attn|attention|att|sa|mha|input|preattn|"
                  r"preattention)(ln|norm|rmsnorm|layernorm)$|^(ln|norm|rmsnorm)(attn|attention|att|sa|mha)$",
    "ln2.weight": r"^(ln|norm|rms|rmsnorm|layernorm|lnorm)2$|^(ffn|mlp|ff|fc|postattn|postattention)"
                  r"(ln|norm|rmsnorm|layernorm)$|^(ln|norm|rmsnorm)(ffn|mlp|ff)$",
    "attn.q_norm.weight": r"^q(uery)?(norm|ln|rmsnorm|layernorm)$|^(norm|ln)q$",
    "attn.k_norm.weight": r"^k(ey)?(norm|ln|rmsnorm|layernorm)$|^(norm|ln)k$",
}
_ATTN_ROLES = {r for r in _LAYER_NAMES if r.startswith("attn.")}
_FFN_ROLES = {r for r in _LAYER_NAMES if r.startswith("ffn.")}
_GENERIC_NORM = r"^(ln|norm|rms|rmsnorm|layernorm)$"     # a norm inside the attention or ffn module
# Buffers and tensors no role takes (left for the loader to report): RoPE tables, masks, position embeddings.
_NOT_A_WEIGHT = r"rope|rotary|freq|^cos|^sin|cached|mask|tril|^pos$|position|wpe|posemb"
_HEADISH = r"^(out|output|head|lm|lmhead|unembed|unembedding|logits?|classifier|readout|decoder|proj|linear)$"
_EMBEDISH = r"^(emb|embed|embedding|embeddings|wte|tok|token|tokens|vocab)$"


@dataclass
class InferredKeyMap:
    """What `key_map="auto"` chose: `renames` {checkpoint key: handout key (a fused one before its split)},
    `splits` (fused tensors: suffix -> row order), `unmapped` (keys no role took), and the pasteable `code`."""
    renames: dict[str, str]
    splits: dict[str, str] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    rules: dict[str, str] = field(default_factory=dict)

    @property
    def key_map(self) -> list:
        """The same mapping as an explicit key map (what `code` prints)."""
        steps: list = [self.rules] if self.rules else []
        for suffix, order in self.splits.items():
            steps.append(split_fused_qkv(suffix, order) if suffix == FUSED_QKV else split_fused_gate_up(suffix, order))
        return steps

    @property
    def code(self) -> str:
        """Python source defining `key_map` (paste it, then pass key_map=key_map)."""
        rules = ["{", *(f"    {_literal(p)}: {_literal(t)}," for p, t in self.rules.items()), "}"]
        if not self.splits:
            return "key_map = " + "\n".join(rules)
        names = {s: "split_fused_qkv" if s == FUSED_QKV else "split_fused_gate_up" for s in self.splits}
        lines = [f"from cs336_inference.model import {', '.join(sorted(set(names.values())))}", "key_map = ["]
        if self.rules:
            lines += ["    " + r for r in rules[:-1]] + ["    },"]
        lines += [f"    {names[s]}({s!r}, {o!r})," for s, o in self.splits.items()]
        return "\n".join(lines + ["]"])

    def __call__(self, state: dict, config: ModelConfig) -> dict:
        """Apply it (a key map step), dropping nothing: unmapped keys stay and are reported by the loader."""
        for step in self.key_map:
            state = (rename_keys(step) if isinstance(step, dict) else step)(dict(state), config)
        return state


def _literal(text: str) -> str:
    """A Python literal for `text`, raw when it holds backslashes (regexes, backreferences)."""
    if '"' not in text and not text.endswith("\\"):
        return f'r"{text}"' if "\\" in text else f'"{text}"'
    return repr(text)


def _forms(component: str) -> list[str]:
    """The ways a name component can be read: 'w_Q' -> ['w_q', 'wq', 'w', 'q']."""
    low = component.lower()
    return [low, low.replace("_", ""), *low.split("_")]


_NAMED_INDEX = re.compile(r"^(layers?|blocks?|h|transformer_?blocks?|decoder_?layers?)_?(\d+)$", re.IGNORECASE)


def _layer_component(parts: list[str]) -> tuple[int | None, int | None]:
    """(position of the component holding the layer index, the index): the first all-digit component
    (an nn.ModuleList), else one like 'layer_3' or 'block3' (an nn.ModuleDict)."""
    for i, p in enumerate(parts):
        if p.isdigit():
            return i, int(p)
    for i, p in enumerate(parts):
        match = _NAMED_INDEX.match(p)
        if match:
            return i, int(match.group(2))
    return None, None


def _split_key(key: str) -> tuple[int | None, list[str], str]:
    """key -> (layer index or None, parent components (index removed), leaf name)."""
    parts = key.split(".")
    layer, index = _layer_component(parts)
    rest = [p for i, p in enumerate(parts) if i != layer]
    if len(rest) > 1 and rest[-1].lower() in PARAM_NAMES | BIAS_NAMES:
        rest = rest[:-1]
    return index, rest[:-1], rest[-1]


def _section(parents: list[str]) -> str | None:
    forms = [f for p in parents for f in _forms(p)]
    attn = any("attn" in f or "attention" in f or f in ("mha", "mhsa", "msa", "sa", "selfatt") for f in forms)
    ffn = any(f in ("ffn", "mlp", "ff", "feedforward", "swiglu", "glu", "fc", "silu", "positionwise")
              for f in forms) or any("ffn" in f or "mlp" in f or "feedforward" in f for f in forms)
    return "attn" if attn and not ffn else "ffn" if ffn and not attn else None


def layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple]:
    """The role -> shape of one block of `config` (fused roles included)."""
    D, F, N, K, H = config.d_model, config.d_ff, config.num_heads, config.num_kv_heads, config.head_dim
    owns_kv = config.kv_source_layer(layer) == layer
    shapes = {"attn.q_proj.weight": (N * H, D), "attn.output_proj.weight": (D, N * H),
              "ffn.w1.weight": (F, D), "ffn.w2.weight": (D, F)}
    if owns_kv:
        shapes.update({"attn.k_proj.weight": (K * H, D), "attn.v_proj.weight": (K * H, D),
                       FUSED_QKV: ((N + 2 * K) * H, D)})
    if config.ffn == "swiglu":
        shapes.update({"ffn.w3.weight": (F, D), FUSED_GATE_UP: (2 * F, D)})
    if config.norm == "rmsnorm":
        shapes.update({"ln1.weight": (D,), "ln2.weight": (D,)})
    if config.qk_norm == "gain":
        shapes.update({"attn.q_norm.weight": (H,), "attn.k_norm.weight": (H,)})
    return shapes


def _layer_roles(key: str, shape: tuple, parents: list[str], leaf: str, shapes: dict) -> tuple[set, set]:
    """(roles the shape allows, roles the name says), both restricted to the key's section."""
    section = _section(parents)
    allowed = set(shapes) - (_FFN_ROLES if section == "attn" else _ATTN_ROLES if section == "ffn" else set())
    by_shape = {r for r in allowed if shapes[r] == shape}
    flat = leaf.lower().replace("_", "")
    by_name = {r for r in allowed if re.search(_LAYER_NAMES[r], flat)}
    if not by_name and re.search(_GENERIC_NORM, flat) and section is not None:
        by_name = {"ln1.weight" if section == "attn" else "ln2.weight"} & allowed
    return by_shape, by_name


def _global_roles(parents: list[str], leaf: str, config: ModelConfig) -> tuple[dict, set]:
    D, V = config.d_model, config.vocab_size
    forms = [f for p in [*parents, leaf] for f in _forms(p)]
    headish = any(re.search(_HEADISH, f) for f in forms)
    shapes = {"token_embeddings.weight": (V, D)}
    if not config.tie_embeddings or headish:   # a tied model's copy of the table is checked by the loader
        shapes["lm_head.weight"] = (V, D)
    if config.has_final_norm:
        shapes["ln_final.weight"] = (D,)
    by_name = set()
    if headish and "lm_head.weight" in shapes:
        by_name.add("lm_head.weight")
    elif any(re.search(_EMBEDISH, f) or f.startswith("embed") or f.startswith("tokemb") for f in forms):
        by_name.add("token_embeddings.weight")
    if any("norm" in f or f in ("ln", "lnf", "rms", "final") for f in forms) and "ln_final.weight" in shapes:
        by_name = {"ln_final.weight"}
    return shapes, by_name


class AutoKeyMapError(ValueError):
    """key_map='auto' could not decide (names the keys and candidates)."""


def _resolve(keys: dict[str, tuple[set, set, tuple]], where: str, shapes: dict) -> tuple[dict, list[str]]:
    """keys: {key: (shape roles, name roles, shape)} -> ({key: role}, unmapped keys); raises when ambiguous."""
    candidates, problems = {}, []
    for key, (by_shape, by_name, shape) in keys.items():
        if by_name and not by_name & by_shape:
            named = sorted(by_name)[0]
            problems.append(f"{key} has shape {shape}, but its name says {named} (shape {shapes[named]} in this "
                            f"config){_shape_field_hint(named)}")
            continue
        candidates[key] = set(by_name & by_shape) if by_name else set(by_shape)
    if problems:
        raise AutoKeyMapError(f"key_map='auto' cannot place {where}: " + "; ".join(problems))
    chosen: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        taken = set(chosen.values())
        singles: dict[str, list[str]] = {}
        for key, roles in candidates.items():
            if key not in chosen and len(roles - taken) == 1:
                singles.setdefault(next(iter(roles - taken)), []).append(key)
        for role, ks in singles.items():
            if len(ks) > 1:
                raise AutoKeyMapError(f"key_map='auto' found {len(ks)} tensors for {role} in {where}: {ks}; write "
                                      f"the key_map for this layout yourself (see the mapping printed with "
                                      f"infer_key_map on a layout it can read)")
            chosen[ks[0]] = role
            changed = True
    open_keys = {k: sorted(r - set(chosen.values())) for k, r in candidates.items() if k not in chosen}
    ambiguous = {k: r for k, r in open_keys.items() if r}
    if ambiguous:
        detail = "; ".join(f"{k} could be any of {r}" for k, r in ambiguous.items())
        key, roles = next(iter(ambiguous.items()))
        raise AutoKeyMapError(f"key_map='auto' cannot tell apart the tensors of {where}: {detail} (same shapes, and "
                              f"the names say nothing). Pass an explicit key_map for them, e.g. "
                              f"{{r'^{re.escape(key)}$': 'layers.{_key_layer(key)}.{roles[0]}', ...}}")
    return chosen, [k for k in keys if k not in chosen]


def _key_layer(key: str) -> str:
    """The layer index in `key` as text ('i' when it has none)."""
    index = _layer_component(key.split("."))[1]
    return "i" if index is None else str(index)


def _shape_field_hint(role: str) -> str:
    fields = {"ffn.": "d_ff", "attn.k_": "num_kv_heads", "attn.v_": "num_kv_heads", "attn.q_norm": "num_heads",
              "attn.k_norm": "num_heads", "attn.": "num_heads/d_model", "ln": "d_model"}
    name = next((f for p, f in fields.items() if role.startswith(p)), "d_model/vocab_size")
    return f": check config.{name} (or the layout stores it transposed or fused differently)"


def _fused_order(leaf: str, fused: str) -> str:
    flat = leaf.lower().replace("_", "")
    if fused == FUSED_QKV:
        match = re.search(r"qkv|qvk|kqv|kvq|vqk|vkq", flat)
        return match.group(0) if match else "qkv"
    return "up_gate" if re.search(r"upgate|w31|w3w1", flat) else "gate_up"


def infer_key_map(state: dict[str, torch.Tensor], config: ModelConfig) -> InferredKeyMap:
    """Infer every tensor's role (see the module docstring); raises AutoKeyMapError when one is ambiguous."""
    layers: dict[int, dict] = {}
    globals_: dict = {}
    unmapped_early: list[str] = []
    for key, value in state.items():
        index, parents, leaf = _split_key(key)
        shape = tuple(value.shape)
        if any(re.search(_NOT_A_WEIGHT, f) for f in _forms(leaf)[:2]):   # judged by the leaf name only
            unmapped_early.append(key)
        elif index is None:
            shapes, by_name = _global_roles(parents, leaf, config)
            by_shape = {r for r, s in shapes.items() if s == shape}
            globals_[key] = (by_shape, by_name & by_shape, shape)   # outside blocks, names are weak evidence
        else:
            if key.split(".")[-1].lower() in BIAS_NAMES:
                layers.setdefault(index, {})[key] = (set(), set(), shape)
                continue
            shapes = layer_shapes(config, index)
            by_shape, by_name = _layer_roles(key, shape, parents, leaf, shapes)
            layers.setdefault(index, {})[key] = (by_shape, by_name, shape)
    if layers and sorted(layers) != list(range(config.num_layers)):
        raise AutoKeyMapError(f"key_map='auto' found layer indices {sorted(layers)} in the checkpoint but "
                              f"config.num_layers={config.num_layers}; check num_layers")
    renames, unmapped, splits = {}, unmapped_early, {}
    global_shapes = _global_roles(["head"], "", config)[0]
    chosen, left = _resolve(globals_, "the embedding, final norm and head", global_shapes)
    renames.update(chosen)
    unmapped += left
    for index, keys in sorted(layers.items()):
        chosen, left = _resolve(keys, f"layer {index}", layer_shapes(config, index))
        unmapped += left
        roles = set(chosen.values())
        if FUSED_QKV in roles and roles & {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"}:
            raise AutoKeyMapError(f"layer {index} has both a fused qkv projection and separate q/k/v ones: {chosen}")
        for key, role in chosen.items():
            renames[key] = f"layers.{index}.{role}"
            if role in (FUSED_QKV, FUSED_GATE_UP):
                order = _fused_order(_split_key(key)[2], role)
                if splits.setdefault(role, order) != order:
                    raise AutoKeyMapError(f"the fused {role} tensors use different row orders across layers "
                                          f"({splits[role]} vs {order} at {key}); split them with your own key_map")
    return InferredKeyMap(renames, splits, unmapped, _rules(renames, config))


def _rules(renames: dict[str, str], config: ModelConfig) -> dict[str, str]:
    """Regex renames doing `renames`: one rule per pattern shared by every layer, else one per key; a
    two-step rename through a temporary prefix when a target is another rule's source (a swap)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key, target in renames.items():
        if key == target:
            continue
        parts = key.split(".")
        layer, index = _layer_component(parts)
        if layer is None or not target.startswith(f"layers.{index}."):
            groups.setdefault((re.escape(key), target), []).append(key)
            continue
        source = r"\.".join(re.escape(p) if i != layer else re.escape(p[:-len(str(index))]) + r"(\d+)"
                             for i, p in enumerate(parts))
        groups.setdefault((source, "layers.\\1." + target.split(".", 2)[2]), []).append(key)
    rules = {}
    for (source, target), keys in groups.items():
        if "(\\d+)" in source and len(keys) != config.num_layers:   # not in every layer: name each key
            rules.update({f"^{re.escape(k)}$": renames[k] for k in keys})
        else:
            rules[f"^{source}$"] = target
    if not _renames_exactly(rules, renames):   # a swap: go through a temporary name
        rules = {p: "auto_tmp." + t for p, t in rules.items()} | {r"^auto_tmp\.": ""}
    return rules


def _renames_exactly(rules: dict[str, str], renames: dict[str, str]) -> bool:
    compiled = [(re.compile(p), t) for p, t in rules.items()]
    targets = set()
    for key, want in renames.items():
        got = key
        for pattern, target in compiled:
            got = pattern.sub(target, got)
        if got != want or got in targets:
            return False
        targets.add(got)
    return True


__all__ = ["AutoKeyMapError", "InferredKeyMap", "infer_key_map", "layer_shapes"]
