"""Evaluate a checkpoint on the test set: ``python eval.py ckpt_path=/path/to/file.ckpt``."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import lit_template.utils.resolvers  # noqa: F401  (registers ${lt.*} before Hydra composes)


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> dict[str, float]:
    from lit_template.evaluate import run

    return run(cfg)


if __name__ == "__main__":
    from lit_template.utils.cli import check_command_line

    check_command_line(sys.argv[1:], Path(__file__).parent / "conf")
    main()
