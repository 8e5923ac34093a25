"""Byte-level language-model data: a text corpus cut into ``(x, y)`` windows of ``block_size`` bytes.

The default corpus is on every machine that runs this template, with no download: the ``.py`` files at the top of the
Python standard library (``sysconfig.get_paths()['stdlib']``), in sorted order, capped at ``max_bytes``. The same
Python gives the same bytes on every rank and every run; ``data_dir`` takes your own ``*.txt`` files instead.
Train/val/test are contiguous blocks of the corpus (in that order), so no window of one split overlaps another.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from lit_template.data.base import ImageDataModule
from lit_template.errors import ConfigError

VOCAB_SIZE = 256  # bytes


def corpus_files(data_dir: str | None) -> list[Path]:
    """The corpus's files in the order they are read: sorted paths, so every rank and run reads the same bytes."""
    if data_dir is None:
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.data_dir={data_dir!r} is not a folder: give a folder of *.txt files, or null")
    return sorted(root.rglob("*.txt"))


def read_corpus(files: list[Path], max_bytes: int | None) -> bytes:
    """The files' bytes one after another, up to ``max_bytes`` (null: all)."""
    parts, total = [], 0
    for path in files:
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        parts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return b"".join(parts)


def unigram_bpb(tokens: torch.Tensor) -> float:
    """Entropy of the byte histogram of ``tokens`` in bits per byte: what the best model that ignores context
    (one fixed distribution over bytes) achieves on them; a language model must get below it."""
    counts = torch.bincount(tokens.long(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


class TokenWindows(Dataset):
    """Windows ``x = tokens[s : s + T]``, ``y = tokens[s + 1 : s + T + 1]`` starting every ``stride`` tokens."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int) -> None:
        self.tokens, self.block_size, self.stride = tokens, block_size, stride
        self.n = (len(tokens) - 1 - block_size) // stride + 1 if len(tokens) > block_size else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        s = i * self.stride
        chunk = self.tokens[s : s + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class TextDataModule(ImageDataModule):
    """Byte-level LM data. Reuses the template's loaders (``base.py``): the resumable, seeded train loader sharded by
    the data-parallel rank, and evaluation loaders that see every window once.

    Args:
        data_dir: a folder of ``*.txt`` files (read recursively, sorted); null: the standard library's ``*.py``.
        max_bytes: read at most this many bytes of the corpus (null: all).
        block_size: window length in bytes (the model's context; at most ``model.block_size``).
        stride: a training window starts every ``stride`` bytes (null: ``block_size``, no overlap); val/test windows
            never overlap.
        val_fraction, test_fraction: the last contiguous blocks of the corpus.
        batch_size, global_batch_size, num_workers, pin_memory: as for every DataModule here; under tensor
            parallelism the batch is divided over the data-parallel ranks only.
        vocab_size: declared for ``${data.vocab_size}`` (bytes: 256).
    """

    name = "text"
    dataset_num_classes = VOCAB_SIZE

    def __init__(
        self,
        data_dir: str | None = None,
        max_bytes: int | None = 2_000_000,
        block_size: int = 128,
        stride: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        vocab_size: int = VOCAB_SIZE,
        **kwargs: Any,
    ) -> None:
        super().__init__(val_fraction=val_fraction, **kwargs)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"data.block_size={block_size!r}: must be a whole number >= 1")
        if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int) or stride < 1):
            raise ConfigError(f"data.stride={stride!r}: must be a whole number >= 1, or null (= block_size)")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ConfigError(f"data.max_bytes={max_bytes!r}: must be a whole number >= 1, or null (all)")
        if not 0.0 < test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
            raise ConfigError(
                f"data.test_fraction={test_fraction}: must be in (0, 1) with data.val_fraction + data.test_fraction "
                f"< 1 (got {val_fraction + test_fraction})"
            )
        if vocab_size != VOCAB_SIZE:
            raise ConfigError(f"data.vocab_size={vocab_size}: byte-level text has {VOCAB_SIZE} tokens")
        self.data_dir, self.max_bytes = data_dir, max_bytes
        self.block_size, self.stride = block_size, stride or block_size
        self.test_fraction = test_fraction
        self.tokens: torch.Tensor | None = None
        self.splits: dict[str, torch.Tensor] = {}
        self.digest, self.num_files = "", 0

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def load_tokens(self) -> torch.Tensor:
        """The corpus as a uint8 tensor (read once)."""
        if self.tokens is None:
            files = corpus_files(self.data_dir)
            data = read_corpus(files, self.max_bytes)
            if not data:
                where = f"data.data_dir={self.data_dir!r}" if self.data_dir else "the standard library"
                raise ConfigError(f"{where}: the corpus is empty (no *.txt files with text): add text files")
            self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.digest = hashlib.sha256(data).hexdigest()[:16]
            self.num_files = len(files)
        return self.tokens

    def split_tokens(self) -> dict[str, torch.Tensor]:
        """train, val, test: contiguous blocks, in that order, of the sizes the fractions say."""
        if not self.splits:
            tokens = self.load_tokens()
            n = len(tokens)
            n_test = int(n * self.test_fraction)
            n_val = int(n * self.hparams.val_fraction)
            n_train = n - n_val - n_test
            self.splits = {
                "train": tokens[:n_train],
                "val": tokens[n_train : n_train + n_val],
                "test": tokens[n_train + n_val :],
            }
            for name, part in self.splits.items():
                if len(part) <= self.block_size:
                    raise ConfigError(
                        f"data.block_size={self.block_size} is not smaller than the {name} split ({len(part)} "
                        f"bytes of a {n}-byte corpus): use a smaller block_size, a larger data.max_bytes, or more text"
                    )
        return self.splits

    def check_model(self) -> None:
        """The model must read every byte and hold a whole window (read from the attached LightningModule)."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        hparams = getattr(module, "hparams", {}) or {}
        vocab, context = hparams.get("vocab_size"), hparams.get("block_size")
        if vocab is not None and vocab < VOCAB_SIZE:
            raise ConfigError(
                f"model.vocab_size={vocab} is smaller than the {VOCAB_SIZE} byte values of data=text: "
                f"set model.vocab_size={VOCAB_SIZE}"
            )
        if context is not None and context < self.block_size:
            raise ConfigError(
                f"data.block_size={self.block_size} is longer than model.block_size={context} (the model's "
                f"context): set data.block_size<={context}"
            )

    def setup(self, stage: str | None = None) -> None:
        self.check_model()
        if self.data_train is not None:
            return
        splits = self.split_tokens()
        self.data_train = TokenWindows(splits["train"], self.block_size, self.stride)
        self.data_val = TokenWindows(splits["val"], self.block_size, self.block_size)
        self.data_test = TokenWindows(splits["test"], self.block_size, self.block_size)
        rank_zero_info(
            f"text corpus: {self.num_files} files, {len(self.tokens)} bytes (sha256 {self.digest}); windows "
            f"train {len(self.data_train)}, val {len(self.data_val)}, test {len(self.data_test)}; unigram baseline "
            f"of val {unigram_bpb(splits['val']):.3f} bits/byte"
        )
