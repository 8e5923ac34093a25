"""model=gpt and data=text: the byte corpus and its splits, the model's pieces, and short real training runs."""

from __future__ import annotations

import re

import pytest
import torch
from gpt_support import TINY, column, read_metrics, steps

from lit_template.data.text import TextDataModule, TokenWindows, unigram_bpb
from lit_template.errors import ConfigError
from lit_template.models.gpt import GPT, WarmupCosine
from lit_template.models.gpt_parallel import clip_grad_norm


def small_text(tmp_path, text: str = "hello world, " * 400) -> str:
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(text[: len(text) // 2])
    (folder / "sub" / "a.txt").write_text(text[len(text) // 2 :])
    (folder / "ignored.md").write_text("not a txt file")
    return str(folder)


def tiny_gpt(**kwargs) -> GPT:
    sizes = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
    model = GPT(optimizer=lambda params: torch.optim.AdamW(params), **{**sizes, **kwargs})
    model.configure_model()
    return model


# -- data: fast -----------------------------------------------------------------------------------------------------


def test_stdlib_corpus_is_the_same_on_every_build_and_splits_are_contiguous():
    a, b = TextDataModule(max_bytes=300_000, block_size=32), TextDataModule(max_bytes=300_000, block_size=32)
    a.setup("fit")
    b.setup("fit")
    assert a.digest == b.digest and len(a.tokens) == 300_000  # deterministic, capped
    splits = a.split_tokens()
    # train, val, test in corpus order, nothing lost or shared
    assert torch.equal(torch.cat([splits["train"], splits["val"], splits["test"]]), a.tokens)
    assert len(splits["val"]) == len(splits["test"]) == 15_000
    x, y = a.data_train[3]
    assert x.shape == y.shape == (32,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])  # y is x shifted by one byte
    assert torch.equal(x, splits["train"][96:128].long())  # window i starts at i * stride
    # the baseline the model must beat: between 0 and 8 bits, well above 3 for Python source
    assert 3.0 < unigram_bpb(splits["val"]) < 8.0


def test_windows_and_unigram_entropy():
    tokens = torch.arange(10, dtype=torch.uint8)
    windows = TokenWindows(tokens, block_size=4, stride=2)
    assert len(windows) == 3  # starts 0, 2, 4: the last needs bytes 4..8 for x and 5..9 for y
    assert windows[2][1].tolist() == [5, 6, 7, 8]
    with pytest.raises(IndexError):
        windows[3]
    assert unigram_bpb(torch.arange(256, dtype=torch.uint8)) == pytest.approx(8.0)
    assert unigram_bpb(torch.zeros(100, dtype=torch.uint8)) == pytest.approx(0.0)


def test_data_dir_reads_txt_files_sorted(tmp_path):
    dm = TextDataModule(data_dir=small_text(tmp_path), max_bytes=None, block_size=8, val_fraction=0.1)
    dm.setup("fit")
    assert dm.num_files == 2  # b.txt, sub/a.txt; not the .md
    assert bytes(dm.tokens.tolist()).startswith(b"hello world")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 1000}, r"data\.block_size=1000 is not smaller than the val split"),
        ({"block_size": 0}, r"data\.block_size=0"),
        ({"test_fraction": 0.6, "val_fraction": 0.5}, r"data\.test_fraction=0\.6"),
        ({"vocab_size": 100}, r"data\.vocab_size=100"),
    ],
)
def test_bad_data_options_are_config_errors(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TextDataModule(data_dir=small_text(tmp_path), max_bytes=None, **{"block_size": 8, **kwargs}).setup("fit")


def test_empty_corpus_is_a_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data\.data_dir=.*the corpus is empty"):
        TextDataModule(data_dir=str(tmp_path / "empty")).setup("fit")


# -- model: fast ----------------------------------------------------------------------------------------------------


def test_network_is_built_once_in_configure_model_with_tied_head():
    model = GPT(optimizer=torch.optim.AdamW, vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=8)
    assert model.net is None  # nothing built before the strategy can shard it
    model.configure_model()
    net = model.net
    model.configure_model()
    assert model.net is net
    assert net.lm_head.weight is net.wte.weight
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)


def test_attention_is_causal():
    model = tiny_gpt()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # change the future only
    torch.testing.assert_close(model(x)[0, :10], model(y)[0, :10])


def test_generate_greedy_top_k_and_long_prompts():
    torch.manual_seed(0)
    model = tiny_gpt()
    prompt = torch.tensor([list(b"def ")])
    out = model.generate(prompt, max_new_tokens=5, temperature=0)
    assert out.shape == (1, 9) and torch.equal(out[:, :4], prompt)
    assert torch.equal(out, model.generate(prompt, 5, temperature=0))  # greedy: deterministic
    assert torch.equal(out, model.generate(prompt, 5, temperature=1.0, top_k=1))  # top-1 sampling is greedy
    sampled = model.generate(prompt, 5, temperature=1.0, top_k=10)
    assert sampled.shape == (1, 9) and int(sampled.max()) < 256
    # a prompt longer than the context is cropped to block_size, not an index error
    assert model.generate(torch.zeros(1, 40, dtype=torch.long), 3).shape == (1, 43)
    assert model.training  # generate restores the mode it found


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_embd": 30, "n_head": 4}, r"model\.n_embd=30 is not divisible by model\.n_head=4"),
        ({"n_layer": 0}, r"model\.n_layer=0"),
        ({"lr_schedule": "linear"}, r"model\.lr_schedule='linear'"),
        ({"tensor_parallel_size": 3}, r"trainer\.strategy\.tensor_parallel_size=3 does not divide model\.n_head=4"),
    ],
)
def test_bad_model_options_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GPT(optimizer=torch.optim.AdamW, **{"n_head": 4, "n_embd": 32, **kwargs})


def test_warmup_cosine_schedule():
    f = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)  # half way down the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    total = clip_grad_norm(a, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(total, expected)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


# -- real runs: slow ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_short_gpt_tiny_run_improves_val_loss_below_the_unigram_baseline(train):
    # experiment=gpt_tiny as a user runs it, cut to 300 steps with validation every 100
    run = train(
        "experiment=gpt_tiny",
        "trainer.max_steps=300",
        "trainer.val_check_interval=100",
        "trainer.limit_val_batches=20",
        "trainer.limit_test_batches=5",
        "callbacks.rich_progress_bar=null",
        timeout=110,
    )
    baseline = float(re.search(r"unigram baseline of val ([\d.]+) bits/byte", run.output).group(1))
    bpb = column(read_metrics(run.run_dir()), "val/bpb")
    assert sorted(bpb) == [99, 199, 299]
    assert bpb[299] < bpb[99] < 8.0, bpb
    assert bpb[299] < baseline - 0.5, (bpb, baseline)
    assert "test/bpb" in run.output
    assert "val/bpb = " in run.output  # gpt_tiny's optimized_metric


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.n_head=3"], r"model\.n_embd=32 is not divisible by model\.n_head=3"),
        (["model.vocab_size=100"], r"model\.vocab_size=100 is smaller than the 256 byte values"),
        (["data.block_size=64"], r"data\.block_size=64 is longer than model\.block_size=32"),
    ],
)
def test_bad_options_fail_with_one_line_and_exit_2(train, overrides, message):
    run = train(*TINY, *steps(2), *overrides, check=False, timeout=60)
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), run.stderr[-3000:]
    assert "Traceback" not in run.output
