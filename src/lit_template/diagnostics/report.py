"""The one frame every finding uses: a JSON file in the run dir and one plain sentence on the console.

A record is ``{"kind", "global_step", "global_rank" or "ranks", ...}``. Reports go to ``<run dir>/reports/``.
Two ways to speak, and only these: ``say`` for a finding (through logging, so it is also in the run's log file), and
``say_error`` for the one ``error: ...`` line a failed run ends with (plain stderr: logging may not be set up yet,
or may be gone).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L

log = logging.getLogger("lit_template.callbacks")


def run_dir(trainer: L.Trainer) -> Path:
    """The run's output dir: Trainer.default_root_dir, which the configs set to Hydra's output dir."""
    return Path(trainer.default_root_dir)


def reports_dir(trainer: L.Trainer) -> Path:
    path = run_dir(trainer) / "reports"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, payload: Any) -> Path:
    """Write atomically (temp file + rename): a reader never sees half a report, a crash never leaves one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def append_jsonl(path: Path, record: dict[str, Any]) -> Path:
    """One JSON record per line; opened in append mode so several ranks may write to one file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return path


def say(message: str, level: int = logging.WARNING) -> None:
    """One plain sentence on the console (and in the run's log file through the logging handlers)."""
    if logging.getLogger().handlers or log.handlers:
        log.log(level, message)
    else:
        print(message, file=sys.stderr, flush=True)


def say_error(message: str) -> None:
    """The one line a failed run ends with: ``error: <message>`` on stderr, flushed."""
    print(f"error: {message}", file=sys.stderr, flush=True)
