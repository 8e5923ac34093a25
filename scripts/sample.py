"""Sample text from a model=gpt checkpoint, on one CPU process.

    python scripts/sample.py logs/train/runs/<id>/checkpoints/epoch_000.ckpt --prompt "def " --max-new-tokens 300
    python scripts/sample.py <run>/checkpoints/last.ckpt --temperature 0 # greedy; a sharded folder (trainer=fsdp2*)

A checkpoint is a ``.ckpt`` file (one process, DDP, ``save_distributed_checkpoint=false``) or the folder that
``ModelParallelStrategy`` writes (one shard per rank + ``meta.pt``); the folder is gathered into one state dict
with torch's ``dcp_to_torch_save``, so a model trained on N ranks samples on one. Both load with
``weights_only=True``: nothing in the file runs code.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(hyper_parameters, model state_dict)`` of a file or sharded-folder checkpoint."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            full = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
        return meta["hyper_parameters"], full["state_dict"]
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint["hyper_parameters"], checkpoint["state_dict"]


def build_model(path: Path) -> Any:
    from lit_template.models.gpt import GPT

    hparams, state = load_checkpoint(path)
    hparams = {k: v for k, v in hparams.items() if k not in ("compile", "tensor_parallel_size")}
    model = GPT(optimizer=None, **hparams)
    model.configure_model()  # one process: no mesh, no sharding
    missing, unexpected = model.load_state_dict(state, strict=False)
    # the LM head is the embedding (tied): a state dict may carry it under one name only
    missing = [k for k in missing if k not in ("net.lm_head.weight", "net.wte.weight")]
    if missing or unexpected:
        raise SystemExit(f"error: {path} does not fit model=gpt: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt_path", type=Path, help="a .ckpt file or a sharded checkpoint folder of model=gpt")
    parser.add_argument("--prompt", default="def ", help="text to continue (encoded as UTF-8 bytes)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes; 0: all")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.ckpt_path.exists():
        print(f"error: ckpt_path={args.ckpt_path} does not exist", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = build_model(args.ckpt_path)
    prompt = torch.tensor([list(args.prompt.encode())] * args.num_samples, dtype=torch.long)
    if prompt.shape[1] == 0:
        prompt = torch.full((args.num_samples, 1), ord("\n"), dtype=torch.long)
    out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None)
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(bytes(row).decode("utf-8", errors="replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
