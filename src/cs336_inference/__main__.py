"""`python -m cs336_inference ...` (and the `cs336-inference` script): the CLI's entry point.

OpenMP's wait policy is applied here, before anything imports torch (see `workshop/openmp.py`):
importing the package itself changes nothing in the environment.
"""


def run() -> None:
    from .workshop.openmp import apply_wait_policy

    apply_wait_policy()
    from .cli import main
    from .workshop.startup import exit_code

    raise SystemExit(exit_code(main()))   # exit_code: ends at once while a background compile still runs


if __name__ == "__main__":
    run()
