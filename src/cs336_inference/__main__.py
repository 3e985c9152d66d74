from .cli import main
from .workshop.startup import exit_code

raise SystemExit(exit_code(main()))   # exit_code: ends at once while a background compile still runs
