"""edtrace's text/link/image, echoed to the terminal so `python lecture/lecture_10.py` narrates.

Under edtrace (`python -m edtrace.execute -m lecture_10 -o DIR`) the renderings go into the trace as
usual: a rendering is attached to the lecture line that made it, so `part(...)` and `section(...)`
show up as headings on the lines of `main()` and of each section. Run directly, everything is also
printed. Image paths are relative to the repository root, whatever the working directory.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import edtrace
from edtrace import Reference

__all__ = ["ROOT", "Reference", "figure", "image", "link", "part", "section", "section_heading", "text"]

ROOT = Path(__file__).resolve().parents[1]


def text(message: str, **kwargs) -> None:
    edtrace.text(message, **kwargs)
    if kwargs.get("verbatim"):
        print(message)
    else:
        print(textwrap.fill(message, width=100, subsequent_indent="  "))


def link(reference: Reference | None = None, **kwargs) -> None:
    reference = reference if reference is not None else Reference(**kwargs)
    edtrace.link(reference)
    words = [reference.label, reference.title if reference.label != f"[{reference.title}]" else None, reference.url]
    print("  -> " + " ".join(w for w in words if w))


def figure(what: str, url: str) -> None:
    """Where the official lecture shows a figure we do not redistribute: a link to its source (the
    paper's figure or table, or the image's own address). Nothing is fetched, ever."""
    link(Reference(title=f"Figure: {what}", url=url))


def image(path: str, **kwargs) -> None:
    """Show `path` (relative to the repository root). edtrace records it relative to the working
    directory, as it records the lecture file itself, so a trace written from the root or from
    lecture/ points at the right file either way."""
    resolved = Path(path) if Path(path).is_absolute() else ROOT / path
    if not resolved.is_file():
        raise FileNotFoundError(f"lecture image not found: {resolved} (regenerate it with "
                                "`python -m cs336_inference figures` or the benchmark that writes it)")
    edtrace.image(os.path.relpath(resolved), **kwargs)
    print(f"  [figure: {path}]")


def part(title: str) -> None:
    """A part of the lecture (the official lecture's `### ...` lines in main())."""
    edtrace.text(f"## {title}")
    print("\n" + "#" * 100 + f"\n{title.upper()}\n" + "#" * 100)


def section_heading(name: str) -> str:
    """The heading of the section function `name`: 'review_of_arithmetic_intensity' -> 'Review of arithmetic intensity'."""
    heading = f" {name.replace('_', ' ')} ".replace(" kv ", " KV ").strip()
    return heading[0].upper() + heading[1:]


def section(name: str) -> None:
    """The first line of each section function: a heading in the trace and in the terminal."""
    edtrace.text(f"### {section_heading(name)}")
    print("\n" + "=" * 100 + f"\n{name}\n" + "=" * 100)
