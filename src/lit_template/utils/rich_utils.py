"""The rich config tree printed at start (rank zero only) and saved in the run dir."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import rich
import rich.syntax
import rich.tree
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

DEFAULT_ORDER = ("data", "model", "trainer", "callbacks", "logger", "paths", "extras")


@rank_zero_only
def print_config_tree(cfg: DictConfig, order: Sequence[str] = DEFAULT_ORDER, save_to: str | None = None) -> None:
    """Print the resolved config as a tree, main groups first, and save the same text to ``save_to``."""
    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    names = [n for n in order if n in cfg] + [n for n in cfg if n not in order]
    for name in names:
        branch = tree.add(str(name), style="bold", guide_style="dim")
        node = cfg[name]
        text = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node)
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)
    if save_to:
        Path(save_to).parent.mkdir(parents=True, exist_ok=True)
        with open(save_to, "w") as f:
            rich.print(tree, file=f)
