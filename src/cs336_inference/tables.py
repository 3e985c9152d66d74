"""Plain-text tables: the one printer every `bench NAME`, the lecture and the notebooks use.

A table is a list of row dicts and a list of columns `(key, header, format)`: format is a
`str.format` spec such as "{:.3f}" (or a function value -> str); a missing value prints "-". The
first column is left-aligned, the others right-aligned, each as wide as its widest cell.
Also here: the result tables the lecture and notebooks show from committed benchmark JSON (they read
results; they never import the benchmarks that produce them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Column = tuple[str, str, "str | Callable | None"]


def format_value(value, fmt: str | Callable | None = None) -> str:
    """One cell: `fmt` applied to value; by default ints and floats get thousands separators."""
    if value is None:
        return "-"
    if callable(fmt):
        return fmt(value)
    if fmt:
        return fmt.format(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.3f}"


def format_table(rows: Sequence[dict], columns: Sequence[Column], title: str | None = None) -> str:
    """rows as text under `columns` (key, header, format), optionally under a title line."""
    cells = [[format_value(row.get(key), fmt) for key, _, fmt in columns] for row in rows]
    heads = [header for _, header, _ in columns]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(heads)]

    def line(values):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    out = ([title] if title else []) + [line(heads), "-" * len(line(heads))] + [line(r) for r in cells]
    return "\n".join(out)


def print_table(rows: Sequence[dict], columns: Sequence[Column], title: str | None = None) -> None:
    print(format_table(rows, columns, title))


def print_mapping(values: dict, title: str | None = None) -> None:
    """A two-column quantity/value table of a flat dict."""
    print_table([{"quantity": k, "value": v} for k, v in values.items()],
                [("quantity", "quantity", None), ("value", "value", None)], title)


# --- result tables of committed benchmark JSON --------------------------------------------------


def ordered_variants(data: dict) -> list[tuple[str, dict]]:
    """(name, results) of `bench kv_variants` in the experiment's order (the JSON has sorted keys)."""
    order = data.get("variant_order", list(data["variants"]))
    return [(name, data["variants"][name]) for name in order]


def kv_variants_table(data: dict) -> str:
    """The KV-variants experiment's one table: quality, cache size and speed per variant."""
    distances, window = data["recall_distances"], data["window"]
    context, lat = data["base"]["context_length"], data["latency"]
    far = [d for d in distances if d > window]
    rows = []
    for name, r in ordered_variants(data):
        ms = f"{r['decode_ms_per_step']:.2f}"
        if "decode_ms_per_step_naive_mla" in r:
            ms += f" (naive MLA {r['decode_ms_per_step_naive_mla']:.2f})"
        rows.append({"variant": name, "params": r["params"], "val_loss": r["val_loss"],
                     **{f"recall_{d}": r["recall"][str(d)] for d in distances},
                     "digits_far": sum(r["recall_digits"][str(d)]["digit_accuracy"] for d in far) / len(far),
                     "kv_bytes": r["kv_bytes_per_token_fp32"], "kv_kib": r["kv_cache_bytes_at_context"] / 1024,
                     "ms": ms})
    columns = [("variant", "variant", None), ("params", "params", "{:,}"), ("val_loss", "val loss", "{:.3f}"),
               *[(f"recall_{d}", f"recall@{d}", "{:.2f}") for d in distances],
               ("digits_far", f"digit acc >{window}", "{:.2f}"), ("kv_bytes", "KV B/tok", "{:,}"),
               ("kv_kib", f"KV KiB@{context}", "{:.0f}"),
               ("ms", f"ms/step (B={lat['batch_size']}, S={lat['context']})", None)]
    return format_table(rows, columns)


def long_context_table(data: dict) -> str:
    """`bench long_context`: passkey accuracy per context, cache size and decode time per variant."""
    contexts, longest = data["contexts"], max(data["contexts"])
    rows = [{"variant": r["variant"], "kv_mb": r["kv_bytes_at_longest"] / 1e6,
             "per_token": r["kv_bytes_per_context_token"],
             **{f"acc_{c}": r["accuracy"][str(c)]["accuracy"] for c in contexts},
             "ms": (r["decode_ms_at_longest"] or {}).get("median")} for r in data["rows"]]
    columns = [("variant", "variant", None), ("kv_mb", f"KV MB@{longest}", "{:.2f}"),
               ("per_token", f"B/token@{longest}", "{:,.0f}"), *[(f"acc_{c}", f"acc@{c}", "{:.2f}") for c in contexts],
               ("ms", f"ms/step@{longest}", "{:.1f}")]
    return format_table(rows, columns)


def quantization_smollm2_table(data: dict) -> str:
    """`bench quantization_smollm2`: size and quality of every method against the published model."""
    columns = [("variant", "variant", None), ("model_bytes", "MB", lambda b: f"{b / 1e6:.1f}"),
               ("bits_per_byte", "bits/byte", "{:.4f}"), ("kl_to_reference", "KL", "{:.4f}"),
               ("top1_agreement", "top-1", "{:.3f}")]
    return format_table(data["rows"], columns)


def alternatives_table(data: dict, pairs=None, contexts=None) -> str:
    """`bench alternatives`: MQAR recall per number of pairs; bytes kept per sequence and decode ms/step per context."""
    pairs = data["pairs"] if pairs is None else pairs
    contexts = data["latency"]["contexts"] if contexts is None else contexts
    rows = []
    for name in data["variant_order"]:
        r = data["variants"][name]
        row = {"variant": name, "params": r.get("params")}
        row |= {f"recall {p}": r["recall"][str(p)] for p in pairs} if "recall" in r else {}
        row |= {f"KiB {T}": r["bytes"][str(T)] / 1024 for T in contexts}
        row |= {f"ms {T}": r["decode_ms"][str(T)] for T in contexts} if "decode_ms" in r else {}
        rows.append(row)
    columns = [("variant", "variant", None), ("params", "params", None)]
    columns += [(f"recall {p}", f"recall@{p}", "{:.2f}") for p in pairs]
    columns += [(f"KiB {T}", f"KiB@T={T}", "{:.1f}") for T in contexts]
    columns += [(f"ms {T}", f"ms@T={T}", "{:.2f}") for T in contexts]
    return format_table(rows, columns, title=f"MQAR recall by key-value pairs (sequences of {data['task']['seq_len']} "
                                            f"tokens); KiB one sequence keeps (fp32) and decode ms/step "
                                            f"(B={data['latency']['batch_size']}) at context T")
