"""edtrace's text/link/image, echoed to the terminal so `python lecture/lecture_10.py` narrates.

Under edtrace the renderings go to the trace viewer as usual; run directly they are also printed.
"""

from __future__ import annotations

import textwrap

import edtrace
from edtrace import Reference

__all__ = ["Reference", "image", "link", "section", "text"]


def text(message: str, **kwargs) -> None:
    edtrace.text(message, **kwargs)
    if kwargs.get("verbatim"):
        print(message)
    else:
        print(textwrap.fill(message, width=100, subsequent_indent="  "))


def link(reference: Reference | None = None, **kwargs) -> None:
    reference = reference if reference is not None else Reference(**kwargs)
    edtrace.link(reference)
    print(f"  -> {reference.label} {reference.title or ''} {reference.url or ''}".rstrip())


def image(path: str, **kwargs) -> None:
    edtrace.image(path, **kwargs)
    print(f"  [figure: {path}]")


def section(title: str) -> None:
    print("\n" + "=" * 100 + f"\n{title}\n" + "=" * 100)
