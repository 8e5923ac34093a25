"""RNG state in the checkpoint: a resumed run draws the same random numbers (dropout, augmentation) as one that never
stopped.

Lightning saves the loops, the optimizers and the schedulers but not the global RNGs. This callback saves the torch,
numpy and Python states (as plain tensors and ints, so the checkpoint still loads with ``weights_only=True``) when a
checkpoint is written, and puts them back as soon as Lightning restores the callbacks on resume: nothing between that
and the first training batch draws from them (a resumed fit runs no sanity check), so the new epoch's dataloader
iterator and the first dropout masks come from the same state as in a run that never stopped.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch


def collect_rng_states() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(state, dtype=torch.int64),
            "gauss": None if gauss is None else float(gauss),
        },
    }


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = states["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))


class RngState(L.Callback):
    """Saves the RNG states with every checkpoint; restores them when training resumes."""

    def state_dict(self) -> dict[str, Any]:
        # Checkpoints are written by rank zero; each rank restores rank zero's state, which is what the uninterrupted
        # single-process run had. Under DDP every rank was seeded alike by seed_everything, so this stays consistent.
        return {"rng": collect_rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning calls this only when a fit resumes (not for test/validate with a ckpt_path)
        if state_dict.get("rng") is not None:
            set_rng_states(state_dict["rng"])
