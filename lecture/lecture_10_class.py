"""CS336 Lecture 10 in class: the core path through lecture_10.py.

The same file as the full lecture, without its deep dives (the functions marked `@deep_dive`: experiments,
committed benchmark tables, the real model), which leave a gray note where they would run. Every official
section, in the official order, at about the official lecture's length.

Terminal narration:  python -m cs336_inference lecture --class   (or python lecture/lecture_10_class.py)
Trace, from the repository root or from lecture/:
    python -m edtrace.execute -m lecture_10_class -o var/traces
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lecture_util  # noqa: E402

lecture_util.use_class_path()

import lecture_10  # noqa: E402

main = lecture_10.main
# edtrace traces the file a module names as its own (`inspect.getfile`): the class path steps through
# lecture_10.py itself, so the viewer shows the lecture's source, as for the full lecture.
__file__ = lecture_10.__file__

if __name__ == "__main__":
    main()
