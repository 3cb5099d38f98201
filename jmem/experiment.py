"""The command line of the experiment scripts: typed flags from a dataclass (tyro), and bad input
as one `error: ...` line on stderr with exit status 2, never a traceback.

Example:
    >>> def cli(argv=None) -> int:
    ...     return run_experiment(Config, main, argv, description=__doc__)
"""

from __future__ import annotations

import sys
from typing import Callable

import tyro


def run_experiment(config_cls: type, main: Callable, argv: list[str] | None = None,
                   description: str | None = None) -> int:
    """Parse `argv` into `config_cls`, run `main(config)`; a `ValueError` is exit status 2 with one line.

    `description`: the script's docstring (its first paragraph becomes the `--help` summary).
    """
    summary = description.split("\n\n")[0] if description else None
    cfg = tyro.cli(config_cls, args=argv, description=summary)
    try:
        main(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
