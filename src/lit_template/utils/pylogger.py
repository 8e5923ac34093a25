"""Rank-aware logging: every line says which global rank wrote it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_only


class RankFilter(logging.Filter):
    """Adds ``record.rank`` so a log format can show ``[rank N]``; used by conf/hydra/default.yaml."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Lightning sets this from the launcher's environment at import and to the true global rank at setup.
        record.rank = getattr(rank_zero_only, "rank", 0)
        return True


class RankedLogger(logging.LoggerAdapter):
    """A logger that can log on rank zero only (``rank_zero_only=True``) or on one ``rank``; the log format (conf/hydra)
    shows the rank of every line."""

    def __init__(self, name: str = __name__, rank_zero_only: bool = False, extra: Mapping[str, Any] | None = None):
        super().__init__(logging.getLogger(name), extra or {})
        self.rank_zero_only = rank_zero_only

    def log(self, level: int, msg: str, *args: Any, rank: int | None = None, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        current = getattr(rank_zero_only, "rank", 0) or 0
        msg, kwargs = self.process(msg, kwargs)
        if self.rank_zero_only and current != 0:
            return
        if rank is not None and current != rank:
            return
        self.logger.log(level, msg, *args, **kwargs)
