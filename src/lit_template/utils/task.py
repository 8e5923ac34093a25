"""The task wrapper: user errors as one short line, failed sweep jobs reported instead of ending the sweep."""

from __future__ import annotations

import functools
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from omegaconf import DictConfig

from lit_template.distributed.launch import forget_job_rendezvous, in_multirun
from lit_template.errors import ConfigError
from lit_template.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def _write_failure(cfg: DictConfig, error: BaseException) -> None:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failure.json").write_text(
        json.dumps(
            {
                "kind": "job_failed",
                "error_type": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exception(error),
            },
            indent=2,
        )
    )


def _teardown_distributed() -> None:
    # A multirun runs its jobs in one process: the next job must not find this job's process group or port.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_job_rendezvous()


def task_wrapper(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Wrap ``run(cfg)``.

    - ConfigError: a short message naming the option, exit code 2, no traceback.
    - In a multirun, any failure is written to ``<job dir>/failure.json``, logged, and the job returns NaN so the
      sweep (basic or Optuna, which counts a NaN as a failed trial) goes on with the next job.
    """

    @functools.wraps(task)
    def wrapped(cfg: DictConfig) -> Any:
        try:
            return task(cfg)
        except ConfigError as err:
            if in_multirun():
                log.error(f"job failed: {err}")
                _write_failure(cfg, err)
                return math.nan
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except Exception as err:
            if not in_multirun():
                raise
            log.exception(f"job failed with {type(err).__name__}: {err} (the sweep goes on)")
            _write_failure(cfg, err)
            return math.nan
        finally:
            _teardown_distributed()

    return wrapped
