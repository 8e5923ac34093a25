"""What the entry points check on the command line before Hydra composes the config."""

from __future__ import annotations

import re
from pathlib import Path

from lit_template.diagnostics.report import say_error


def null_group_override(argv: list[str], conf_dir: Path) -> str | None:
    """The message for ``group=null`` on the command line, where ``group`` is a config group (a folder of ``conf/``).

    Hydra 1.3.8 answers it with a traceback ending in "Config group override must be a string or a list. Got
    NoneType"; the way to drop a group's config is ``~group``.
    """
    for arg in argv:
        match = re.fullmatch(r"([A-Za-z_][\w/]*)=(null|None)", arg)
        if match and (conf_dir / match.group(1)).is_dir():
            group = match.group(1)
            return (
                f"{arg}: {group} is a config group, which takes the name of a config in conf/{group}/ (not null); "
                f"to run without it, write ~{group}"
            )
    return None


def check_command_line(argv: list[str], conf_dir: Path) -> None:
    """Exit 2 with one line for a command-line mistake Hydra would answer with a traceback."""
    problem = null_group_override(argv, conf_dir)
    if problem:
        say_error(problem)
        raise SystemExit(2)
