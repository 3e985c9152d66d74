"""Which endings of a graded test keep its worker for the next one (tests/sandbox.py): graded code that raises
(a package refusing bad input, as the tests ask) keeps it if the worker's reset finds it clean, as after a test
that returned; a result the grader refuses replaces it, and so does graded code that raises after changing its
package's state (the reset's check, not the exception, decides). The reference is the count of workers started."""

import os
import textwrap

import implementation
import pytest
import sandbox

PACKAGE = '''
CALLS = []


def kv_cache_bytes(*args):
    return 7


def refuses(x):
    raise ValueError(f"x must be positive, got {x}")


def raises_after_caching(x):
    CALLS.append(x)                # package state carried to the next test: that worker must go
    raise ValueError("no")
'''

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the sandbox's process checks read /proc (Linux)")


@pytest.fixture
def box(tmp_path):
    pkg = tmp_path / "reuse_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    sb = sandbox.Sandbox(implementation.locate(str(pkg)), timeout=60.0)
    assert sb.start() is None
    sandbox.activate(sb)
    try:
        yield sb
    finally:
        sandbox.activate(None)
        sb.stop()


def _test(sb, body) -> None:
    """One graded test's life: begin, its calls, the reset sent ahead as the grader sends it, end."""
    sb.begin_test()
    try:
        body()
    finally:
        sb.send_reset()
        sb.end_test()


def _ok():
    assert sandbox.call("kv_cache_bytes", (1, 2, 3, 4, 5, 2), None, "number") == 7


def _raises(name):
    def body():
        with pytest.raises(ValueError, match="positive|no"):
            sandbox.call(name, (-1,), None, "number")
    return body


def _refused():
    with pytest.raises(Exception, match="kv_cache_bytes"):
        sandbox.call("kv_cache_bytes", (1, 2, 3, 4, 5, 2), None, "tensor")


def test_a_refusal_by_graded_code_keeps_the_worker(box):
    _test(box, _ok)
    _test(box, _raises("refuses"))
    _test(box, _ok)                                  # settles the test before: the same worker answers
    assert box.workers_started == 1


def test_a_result_the_grader_refuses_replaces_it(box):
    _test(box, _ok)
    _test(box, _refused)
    _test(box, _ok)
    assert box.workers_started == 2


def test_raising_after_changing_the_package_replaces_it(box):
    _test(box, _ok)
    _test(box, _raises("raises_after_caching"))
    _test(box, _ok)
    assert box.workers_started == 2
