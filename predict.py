"""Predict with a checkpoint on one split: ``python predict.py ckpt_path=/path/to/file.ckpt [split=val]``.

The predictions go to ``<run dir>/predictions.csv``, one row per sample in dataset order (also under DDP).
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import lit_template.utils.resolvers  # noqa: F401  (registers ${lt.*} before Hydra composes)


@hydra.main(version_base="1.3", config_path="conf", config_name="predict")
def main(cfg: DictConfig) -> dict:
    from lit_template.predict import run

    return run(cfg)


if __name__ == "__main__":
    from lit_template.utils.cli import check_command_line

    check_command_line(sys.argv[1:], Path(__file__).parent / "conf")
    main()
