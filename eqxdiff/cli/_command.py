"""What both console commands do around their ``main``: user errors in one line, a closed pipe quietly."""

import os
import sys
from collections.abc import Callable
from pathlib import Path


def run_command(main: Callable[..., object]) -> None:
    """Run ``main(prog=...)``; a bad model, flag value or input (``ValueError``: ``CheckpointError``,
    ``ConfigError``, ``MeshError``, ``DataError`` ...; or ``OSError``) prints ``error: ...`` and exits with status 2
    instead of a traceback."""
    try:
        main(prog=Path(sys.argv[0]).name)
    except BrokenPipeError:  # stdout piped into a command that stopped reading (`--help | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
