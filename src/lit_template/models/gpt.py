"""A small decoder-only transformer language model (GPT) and its LightningModule.

The network is built in ``configure_model``, not in ``__init__``: under Lightning's ``ModelParallelStrategy`` the
strategy sets ``self.device_mesh`` first, and the layers are then made tensor parallel and sharded (FSDP2) before any
optimizer sees them (``gpt_parallel.py``). On one process, or under DDP, the same hook just builds the network.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from lit_template.errors import ConfigError
from lit_template.models.gpt_net import GPTNet

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class GPT(L.LightningModule):
    """Trains :class:`GPTNet` on ``(x, y)`` token windows (``y`` is ``x`` shifted by one).

    Args:
        optimizer: a partial optimizer (``_partial_: true``), called with the parameter groups (weight decay on
            matrices only).
        vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias: the network's sizes.
        warmup_steps: linear LR warmup over this many optimizer steps; then ``lr_schedule``.
        lr_schedule: ``cosine`` (decay to ``min_lr_ratio`` x lr over ``trainer.estimated_stepping_batches``) or
            ``constant``.
        min_lr_ratio: the cosine schedule's final LR as a fraction of the optimizer's lr.
        sequence_parallel: under tensor parallelism also shard LayerNorm/dropout activations along the sequence.
        compile: ``torch.compile`` each block (after parallelisation).
        tensor_parallel_size: what the trainer's strategy will use (the yaml reads it from ``trainer.strategy``),
            checked here against ``n_head`` before any process starts; null: checked when the mesh exists.
    """

    def __init__(
        self,
        optimizer: OptimizerFactory,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        warmup_steps: int = 0,
        lr_schedule: str = "cosine",
        min_lr_ratio: float = 0.1,
        sequence_parallel: bool = False,
        compile: bool = False,
        tensor_parallel_size: Any = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["optimizer"])
        check_sizes(vocab_size, block_size, n_layer, n_head, n_embd, dropout, warmup_steps, lr_schedule, min_lr_ratio)
        if isinstance(tensor_parallel_size, int) and not isinstance(tensor_parallel_size, bool):
            check_heads(n_head, tensor_parallel_size)
        self.optimizer_factory = optimizer
        self.net: GPTNet | None = None
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()

    # -- building -------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # Lightning calls this for fit and again for test/validate/predict: build (and parallelise) once
        if self.net is not None:
            return
        h = self.hparams
        self.net = GPTNet(h.vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd, h.dropout, h.bias)
        if self._device_mesh is not None:
            from lit_template.models.gpt_parallel import parallelize_gpt

            parallelize_gpt(self.net, self._device_mesh, n_head=h.n_head, sequence_parallel=h.sequence_parallel)
        if h.compile:
            for i, block in enumerate(self.net.blocks):
                self.net.blocks[i] = torch.compile(block)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.net is not None, "configure_model() builds the network; call it first"
        return self.net(idx)

    # -- training -------------------------------------------------------------------------------------------------

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model_step(batch)
        # this rank's batch, written at log steps only; no prog_bar: Lightning would read a prog_bar value on the host
        # after every batch (a GPU sync per step). The template's progress bar shows it, read at log steps
        # (conf/callbacks/rich_progress_bar.yaml step_metrics). The epoch mean is synced once at epoch end.
        self.log("train/loss_step", loss.detach(), on_step=True, on_epoch=False)
        self.train_loss.update(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train/loss", self.train_loss.compute(), sync_dist=True)
        self.train_loss.reset()

    def on_train_start(self) -> None:
        self.val_loss.reset()  # the sanity check's numbers must not count

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_loss.update(self.model_step(batch))

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # synced over every rank
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        # bits per byte: the tokens are bytes, so nats per token / ln 2
        self.log("val/bpb", loss / math.log(2), prog_bar=True, sync_dist=True)
        self.val_loss.reset()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.test_loss.update(self.model_step(batch))

    def on_test_epoch_end(self) -> None:
        loss = self.test_loss.compute()
        self.log("test/loss", loss, sync_dist=True)
        self.log("test/bpb", loss / math.log(2), sync_dist=True)
        self.test_loss.reset()

    # -- predict (python predict.py model=gpt data=text ckpt_path=...) ---------------------------------------------

    # predict.py sets it from predict.yaml's `generate:`; these are the defaults
    predict_options: dict[str, Any] = {}  # noqa: RUF012  (replaced per instance, never mutated)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        """Each window's first ``prompt_bytes`` bytes (``prompt``) continued by ``max_new_tokens`` generated bytes
        (``text``), decoded as UTF-8 with undecodable bytes replaced; ``index`` when the batch carries one.
        Temperature 0 is greedy, so one process and DDP write the same text."""
        opts = {"prompt_bytes": 32, "max_new_tokens": 64, "temperature": 0.0, "top_k": None, **self.predict_options}
        x = batch["input"] if isinstance(batch, dict) else batch[0]
        prompt = x[:, : max(1, min(int(opts["prompt_bytes"]), x.shape[1]))]
        out = self.generate(prompt, int(opts["max_new_tokens"]), float(opts["temperature"]), opts["top_k"])

        def text(tokens: torch.Tensor) -> str:
            return bytes(tokens.tolist()).decode("utf-8", errors="replace")

        result: dict[str, Any] = {
            "prompt": [text(p) for p in prompt],
            "text": [text(o[prompt.shape[1] :]) for o in out],
        }
        if isinstance(batch, dict) and "index" in batch:
            result["index"] = batch["index"]
        return result

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Any = None,
    ) -> None:
        # torch's clip_grad_norm_ stacks the per-tensor norms, which fails when they are DTensors on different meshes
        # (tensor-parallel blocks next to data-parallel-only embeddings); the norm is summed here as plain numbers
        if gradient_clip_val is None or gradient_clip_algorithm not in (None, "norm"):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        from lit_template.models.gpt_parallel import clip_grad_norm

        clip_grad_norm([p for g in optimizer.param_groups for p in g["params"]], float(gradient_clip_val))

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        # weight decay on matrices (linear weights, embeddings), not on biases and LayerNorm gains
        groups = [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        try:
            optimizer = self.optimizer_factory(params=groups)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"model.optimizer: {err} (see conf/model/gpt.yaml)") from None
        h = self.hparams
        if h.lr_schedule == "constant" and h.warmup_steps == 0:
            return {"optimizer": optimizer}
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = WarmupCosine(h.warmup_steps, total, h.min_lr_ratio, cosine=h.lr_schedule == "cosine")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- cost -----------------------------------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters of the whole (unsharded) network, from the sizes; ``non_embedding``: without the position
        embedding (a lookup, no matmul). The tied token embedding counts once: it is the LM head's matrix."""
        h = self.hparams
        d, b = h.n_embd, int(h.bias)
        block = 4 * (d * d + b * d) + (4 * d * d + b * 4 * d) + (4 * d * d + b * d) + 2 * (d + b * d)
        total = h.n_layer * block + h.vocab_size * d + (d + b * d)
        return total if non_embedding else total + h.block_size * d

    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6 N + 12 L T d`` (PaLM, appendix B; nanoGPT's ``estimate_mfu``).

        ``6 N``: every weight's matmul, forward (2) and backward (4), N = :meth:`num_params`. ``12 L T d``: per layer
        the attention scores ``Q K^T`` and the weighted sum ``A V`` (2 T d each, forward, times 3 with the backward)
        at context T = ``block_size``, counted in full although the causal mask needs only half. The profiling
        callback reads this for MFU (with ``callbacks.profiling.peak_flops`` on a CPU) instead of counting FLOPs.
        """
        h = self.hparams
        return 6.0 * self.num_params() + 12.0 * h.n_layer * h.block_size * h.n_embd

    # -- sampling -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Extend ``idx`` (batch, time) by ``max_new_tokens`` sampled tokens; ``temperature`` 0 is greedy.

        The context is cropped to ``block_size``: the position embedding has no rows beyond it.
        """
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.hparams.block_size :])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx


class WarmupCosine:
    """LR multiplier: linear warmup to 1 over ``warmup`` steps, then cosine down to ``min_ratio`` at ``total``.

    A callable object, not a lambda, so LambdaLR's state_dict (the step count) round-trips through a checkpoint.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float, cosine: bool = True) -> None:
        self.warmup, self.total, self.min_ratio, self.cosine = warmup, total, min_ratio, cosine

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not self.cosine:
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_sizes(
    vocab_size: int,
    block_size: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    dropout: float,
    warmup_steps: int,
    lr_schedule: str,
    min_lr_ratio: float,
) -> None:
    """One ConfigError naming the first bad option."""
    for name, value in (
        ("vocab_size", vocab_size),
        ("block_size", block_size),
        ("n_layer", n_layer),
        ("n_head", n_head),
        ("n_embd", n_embd),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{name}={value!r}: must be a whole number >= 1")
    if n_embd % n_head:
        raise ConfigError(
            f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}: each head gets n_embd / n_head "
            f"channels; use an n_head that divides {n_embd}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"model.dropout={dropout}: must be in [0, 1)")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"model.warmup_steps={warmup_steps!r}: must be a whole number >= 0")
    if lr_schedule not in ("cosine", "constant"):
        raise ConfigError(f"model.lr_schedule={lr_schedule!r}: choose cosine or constant")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"model.min_lr_ratio={min_lr_ratio}: must be in [0, 1]")


def check_heads(n_head: int, tensor_parallel_size: int) -> None:
    if tensor_parallel_size < 1 or n_head % tensor_parallel_size:
        raise ConfigError(
            f"trainer.strategy.tensor_parallel_size={tensor_parallel_size} does not divide model.n_head={n_head}: "
            f"tensor parallelism gives each rank n_head / tensor_parallel_size heads; use a divisor of {n_head}"
        )
