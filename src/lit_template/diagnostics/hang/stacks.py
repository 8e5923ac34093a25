"""Where is a thread? Its Python stack, in paths a reader recognises, and the collective it waits in, if any."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

_STACK_LIMIT = 64


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str

    @property
    def where(self) -> str:
        return f"{short_path(self.filename)}:{self.lineno} {self.function}"


def short_path(filename: str) -> str:
    """A path a reader recognises: relative to the repo (cwd) or to site-packages / the standard library."""
    path = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    cwd = os.getcwd().replace("\\", "/").rstrip("/") + "/"
    if path.startswith(cwd):
        return path[len(cwd) :]
    lib = f"/lib/python{sys.version_info.major}.{sys.version_info.minor}/"
    if lib in path:
        return path.split(lib, 1)[1]
    return path


def thread_stack(ident: int | None) -> list[Frame]:
    """The Python stack of one thread, innermost frame first (empty if the thread is gone)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    stack = []
    while frame is not None and len(stack) < _STACK_LIMIT:
        stack.append(Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return stack


def _in_torch(frame: Frame) -> bool:
    return "/torch/" in frame.filename.replace("\\", "/")


def collective_of(stack: list[Frame], distributed: bool) -> str | None:
    """The collective a thread is blocked in, read from its innermost frames; None if it is not in one.

    Only the innermost run of torch frames counts: a user function called from inside torch (a custom autograd
    backward) that loops forever is stuck, not waiting. With gloo or NCCL, DDP's gradient all-reduce runs inside the
    C++ autograd engine, so a thread of a DDP job blocked there shows only ``_engine_run_backward`` as its innermost
    Python frame: that counts as waiting in the all-reduce (a backward of a model that fits in the step time does not
    take ``stall_timeout_s``).
    """
    if not distributed:
        return None
    for i, frame in enumerate(stack):
        if not _in_torch(frame):
            return None
        path = frame.filename.replace("\\", "/")
        if "/torch/distributed/" in path:
            # the innermost public function of torch.distributed (all_reduce, barrier, ...), not its wrappers
            public = [
                f
                for f in stack[i:]
                if "/torch/distributed/" in f.filename.replace("\\", "/")
                and not f.function.startswith("_")
                and f.function != "wrapper"
            ]
            return f"torch.distributed.{(public[0] if public else frame).function}"
        if path.endswith("/torch/nn/parallel/distributed.py"):
            if "broadcast" in frame.function or "buffers" in frame.function:
                return "DDP buffer broadcast in forward"
            return f"DDP {frame.function} in forward"
        if i == 0 and frame.function == "_engine_run_backward":
            return "DDP gradient all-reduce in backward"
    return None
