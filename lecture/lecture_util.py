"""edtrace's text/link/image, echoed to the terminal so `python lecture/lecture_10.py` narrates.

Under edtrace (`python -m edtrace.execute -m lecture_10 -o DIR`) the renderings go into the trace as
usual: a rendering is attached to the lecture line that made it, so `part(...)` and `section(...)`
show up as headings on the lines of `main()` and of each section. Run directly, everything is also
printed. Image paths are relative to the repository root, whatever the working directory.

Two paths through one file: every section of the lecture is core; the functions a section calls for more
(experiments, committed benchmark tables, the real model) are marked `@deep_dive`. The full lecture runs
everything; the class path (`lecture_10_class`, after `use_class_path()`) skips the deep dives, leaving a
gray note where each would run.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import functools

import edtrace
from edtrace import Reference
from edtrace.execute_util import Rendering

__all__ = ["OFFICIAL_IMAGE_ROOTS", "ROOT", "Reference", "core", "deep_dive", "figure", "formula", "image", "is_class_path", "link",
           "official_image_url", "part", "section", "section_heading", "show_table", "text",
           "use_class_path"]

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


# Where the official lectures keep the images they show as `images/NAME` (the folder at each repository's root).
OFFICIAL_IMAGE_ROOTS = {2026: "https://raw.githubusercontent.com/stanford-cs336/lectures/main/",
                        2025: "https://raw.githubusercontent.com/stanford-cs336/spring2025-lectures/main/"}


def official_image_url(path: str, year: int = 2026) -> str:
    """The address of an image the official lecture shows: `images/NAME` lives in that year's lecture
    repository; anything else is already the address the official lecture itself uses."""
    if path.startswith(("http://", "https://")):
        return path
    if not path.startswith("images/") or year not in OFFICIAL_IMAGE_ROOTS:
        raise ValueError(f"official image {path!r} (year {year!r}): expected a URL or images/NAME with a year in "
                         f"{sorted(OFFICIAL_IMAGE_ROOTS)}")
    return OFFICIAL_IMAGE_ROOTS[year] + path


def figure(what: str, url: str, image: str | None = None, width: int = 600, year: int = 2026) -> None:
    """Where the official lecture shows an image: the same image on screen, and a link to its source (the
    paper's figure or table, or the image's own address). `image` is the official lecture's own path
    (`images/NAME`, in that year's lecture repository) or URL. The trace records the address and the
    viewer loads it in class; nothing is downloaded here (edtrace's own `image()` would fetch a URL into
    var/files, so the rendering is recorded directly). The terminal prints the address."""
    if image is not None:
        address = official_image_url(image, year)
        edtrace.execute_util._current_renderings.append(Rendering(type="image", data=address, style={"width": width}))
        print(f"  [figure: {what}] {address}")
    link(Reference(title=f"Figure: {what}" if image is None else f"Source: {what}", url=url))


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


_PATH = {"class": False}


def use_class_path() -> None:
    """From now on, `@deep_dive` functions do nothing but leave a note: the class path (lecture_10_class)."""
    _PATH["class"] = True


def is_class_path() -> bool:
    return _PATH["class"]


def deep_dive(function):
    """Mark a lecture function as a deep dive: the full lecture runs it; the class path leaves a gray note
    in its place (one trace step, on the line that calls it)."""
    @functools.wraps(function)
    def run_unless_class(*args, **kwargs):
        if _PATH["class"]:
            note = f"(Deep dive in the full lecture: {function.__name__.replace('_', ' ')}.)"
            edtrace.text(note, style={"color": "gray"})
            print(note)
            return None
        return function(*args, **kwargs)
    run_unless_class.deep_dive = True
    return run_unless_class


def core(function):
    """Mark a lecture helper as part of the class path (sections are core without saying so)."""
    return function


def show_table(block: str, width: int = 100) -> None:
    """A table in monospace. The trace shows it only if every line fits the screen (`width` characters);
    a wider one is printed by the terminal run only, and the trace says so (the figure beside it shows it)."""
    if max(len(line) for line in block.splitlines()) <= width:
        edtrace.text(block, verbatim=True)
    else:
        edtrace.text("(The full table is printed by the terminal run; the figure below shows it.)", style={"color": "gray"})
    print(block)


def formula(expr) -> str:
    """A sympy expression as narration: `·` for products and `^` for powers, so that markdown never reads
    the `*` of `2*B*D*F` as emphasis (a helper here, not in the lecture: the trace need not step into it)."""
    return str(expr).replace("**", "^").replace("*", "·")


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
