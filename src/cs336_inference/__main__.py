from .cli import main
from .startup import exit_code

raise SystemExit(exit_code(main()))   # exit_code: ends at once while a background compile still runs
