"""Packed CPU linear layers (kernels.py): same outputs as the stock ones, lossless speculation on them."""

import copy
import json

import pytest
import torch
from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import model_key
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.models import kernels
from treegraft_dist.models.hf import CausalLM
from treegraft_dist.models.kernels import LINEAR_ENV, PackedLinear
from treegraft_dist.models.loading import load_model

pytestmark = pytest.mark.skipif(kernels.unsupported(torch.float32) is not None,
                                reason=f"{kernels.unsupported(torch.float32)}")


@pytest.fixture
def fresh_choice(monkeypatch):
    """kernels.choice is decided once per process: clear it around a test that sets $TREEGRAFT_LINEAR."""
    kernels.choice.cache_clear()
    yield monkeypatch
    kernels.choice.cache_clear()


def packed(model, pad_to: int | None = None) -> CausalLM:
    lm = CausalLM(copy.deepcopy(model))
    kernels.pack(lm.model, pad_to)
    lm.packed = True
    return lm


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_logits_equal_stock_ones_to_fp32_rounding(arch):
    model = tiny_model(arch, seed=3)
    stock, fast = CausalLM(model), packed(model)
    ids = torch.arange(5, 45)
    ref = stock.logits(stock.hidden(stock.new_cache(), ids, torch.arange(40)))
    out = fast.logits(fast.hidden(fast.new_cache(), ids, torch.arange(40)))
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), (out - ref).abs().max()
    assert not torch.equal(out, torch.zeros_like(out))


def test_pack_keeps_the_head_dense_and_drops_the_other_dense_weights():
    model = tiny_model("llama", seed=1)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    lm = packed(model)
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == n_linear and all(isinstance(m, PackedLinear) for m in linears)
    assert lm.head.weight is not None and lm.head.weight.shape[0] == lm.vocab_size
    assert all(m.weight is None for m in linears if m is not lm.head)
    # The parameter count names the model as loaded, so a packed model's profile key differs only by the suffix.
    assert lm.num_params == sum(p.numel() for p in model.parameters())
    assert model_key(lm, "tiny") == model_key(CausalLM(model), "tiny") + "-packed"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_speculation_on_packed_models_reproduces_packed_greedy_decoding_in_fp32(arch):
    model = tiny_model(arch, seed=0)
    target, middle = packed(model), packed(perturbed_copy(model, 0.3, 1))
    prompt = [3, 9, 27, 81 % 96, 5, 3, 9, 27, 11, 40, 3, 9]
    dec = Decoder(target, middle, TreeConfig(budget=16))
    ref = dec.generate(prompt, 32, "ar").tokens
    # Packed and stock products round alike here: greedy decoding agrees too.
    assert ref == Decoder(CausalLM(model)).generate(prompt, 32, "ar").tokens
    for method in ("all-small", "all-mid", "01010", "10000"):
        gen = dec.generate(prompt, 32, method)
        assert gen.tokens == ref, method
        assert max(gen.stats.tree_sizes) > 1, method  # trees were verified, not plain steps


def test_load_model_packs_on_cpu_unless_told_not_to(tmp_path, fresh_choice):
    folder = save_tiny(tmp_path / "m", tiny_model("llama"), char_tokenizer())
    fresh_choice.setenv(LINEAR_ENV, "packed")
    assert load_model(folder, "cpu", "float32").lm.packed
    assert not load_model(folder, "cpu", "float32", pack=False).lm.packed
    kernels.choice.cache_clear()
    fresh_choice.setenv(LINEAR_ENV, "stock")
    lm = load_model(folder, "cpu", "float32").lm
    assert not lm.packed and kernels.choice(torch.float32).reason == f"${LINEAR_ENV}=stock"


def test_auto_measures_and_says_what_it_measured(fresh_choice):
    fresh_choice.delenv(LINEAR_ENV, raising=False)
    c = kernels.choice(torch.float32)
    assert "probe 1 rows: stock" in c.reason and "16 rows" in c.reason
    assert kernels.describe(torch.float32).startswith("CPU linear layers in float32: ")


def test_a_bad_setting_or_an_unsupported_dtype_is_a_clear_error(fresh_choice):
    fresh_choice.setenv(LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match="use auto, compact, packed or stock"):
        kernels.choice(torch.float32)
    kernels.choice.cache_clear()
    why_not = kernels.unsupported(torch.bfloat16)
    if why_not is None:
        pytest.skip("this processor runs bf16 packed")
    fresh_choice.setenv(LINEAR_ENV, "packed")
    with pytest.raises(ValueError, match="does not run bfloat16 here"):
        kernels.choice(torch.bfloat16)
    fresh_choice.setenv(LINEAR_ENV, "auto")
    kernels.choice.cache_clear()
    assert not kernels.choice(torch.bfloat16).packed


def test_padded_small_products_give_each_row_what_it_gets_alone():
    model = tiny_model("llama", seed=2)
    plain, pad = packed(model), packed(model, 8)
    assert kernels.padding_of(plain.model) == 1 and kernels.padding_of(pad.model) == 8
    linear = next(m for m in pad.model.modules() if isinstance(m, PackedLinear) and m is not pad.head)
    for rows in (1, 3, 7, 8, 9):
        x = torch.randn(1, rows, linear.in_features)
        out = linear(x)
        linear.pad_to = 1
        alone = linear(x)
        linear.pad_to = 8
        assert out.shape == alone.shape == (1, rows, linear.out_features)
        assert torch.allclose(out, alone, rtol=1e-4, atol=1e-5) and not torch.equal(out, torch.zeros_like(out))
    ids = torch.arange(5, 25)
    c1, c2 = plain.new_cache(), pad.new_cache()
    plain.hidden(c1, ids, torch.arange(20))
    pad.hidden(c2, ids, torch.arange(20))
    for n in (1, 2, 5):  # steps and small trees over the cache, padded against not
        a = plain.logits(plain.hidden(c1, ids[:n] + 1, torch.arange(20, 20 + n)))
        b = pad.logits(pad.hidden(c2, ids[:n] + 1, torch.arange(20, 20 + n)))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (n, (a - b).abs().max())


def test_speculation_with_padded_products_reproduces_greedy_decoding_in_fp32():
    model = tiny_model("qwen3", seed=0)
    target, middle = packed(model, 4), packed(perturbed_copy(model, 0.3, 1), 4)
    prompt = [3, 9, 27, 81 % 96, 5, 3, 9, 27, 11, 40, 3, 9]
    ref = Decoder(CausalLM(model)).generate(prompt, 32, "ar").tokens
    dec = Decoder(target, middle, TreeConfig(budget=16))
    for method in ("ar", "all-small", "all-mid", "01010"):
        assert dec.generate(prompt, 32, method).tokens == ref, method


def test_row_padding_is_measured_on_the_weights_recorded_and_can_be_set(monkeypatch, tmp_path):
    from treegraft_dist.models.paths import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    record = tmp_path / kernels.PAD_RECORD
    model = tiny_model("llama", seed=1)
    linears = [m for m in packed(model).model.modules() if isinstance(m, PackedLinear)]
    monkeypatch.delenv(kernels.PAD_ENV, raising=False)
    assert kernels.row_padding(linears) == 1  # a few kB stay in cache: nothing to measure, nothing padded
    assert not record.exists()
    monkeypatch.setattr(kernels, "PAD_PROBE_BYTES", 1)  # measure on them anyway: the rule, on real timings
    ms = kernels._sweep_ms(linears, range(1, 9))
    assert set(ms) == set(range(1, 9)) and all(t > 0 for t in ms.values())
    assert kernels.row_padding(linears) in (1, *kernels.PAD_CANDIDATES)
    monkeypatch.setattr(kernels, "_sweep_ms", lambda stack, rows: {1: 42.0, 2: 45.0, 3: 39.0, 4: 36.0, 5: 36.0,
                                                                   6: 35.0, 7: 42.0, 8: 42.0})
    record.unlink()
    assert kernels.row_padding(linears) == 4
    monkeypatch.setattr(kernels, "_sweep_ms", lambda stack, rows: {n: 40.0 - 0.1 * n for n in range(1, 9)})
    assert kernels.row_padding(linears) == 4  # the first choice on this processor is kept, not measured again
    (key,) = json.loads(record.read_text())
    assert "threads-float32-1layers-" in key  # the probe stops at the first layer reaching PAD_PROBE_BYTES
    record.unlink()
    assert kernels.row_padding(linears) == 1  # 8 rows 2% faster than one: within noise, not padded
    monkeypatch.setenv(kernels.PAD_ENV, "off")
    assert kernels.row_padding(linears) == 1
    monkeypatch.setenv(kernels.PAD_ENV, "6")
    assert kernels.row_padding(linears) == 6
    monkeypatch.setenv(kernels.PAD_ENV, "many")
    with pytest.raises(ValueError, match="use auto, off or a row count"):
        kernels.row_padding(linears)


def test_the_int8_choice_for_a_drafter_is_measured_once_recorded_and_kept(monkeypatch, tmp_path):
    from treegraft_dist.models.paths import CACHE_ENV

    if kernels.int8_unsupported(torch.float32) is not None:
        pytest.skip(kernels.int8_unsupported(torch.float32))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(kernels.INT8_ENV, raising=False)
    record = tmp_path / kernels.INT8_RECORD
    kernels.int8_choice.cache_clear()
    try:
        first = kernels.int8_choice(torch.float32)
        (key,) = json.loads(record.read_text())
        assert "threads-float32-" in key and json.loads(record.read_text())[key]["int8"] == first.int8
        # A later process whose probe would answer otherwise keeps the recorded choice.
        monkeypatch.setattr(kernels, "int8_probe", lambda dtype, repeats: (not first.int8, "probe flipped"))
        kernels.int8_choice.cache_clear()
        assert kernels.int8_choice(torch.float32).int8 == first.int8
        record.unlink()  # a new cache measures again
        kernels.int8_choice.cache_clear()
        again = kernels.int8_choice(torch.float32)
        assert again.int8 != first.int8 and "probe flipped" in again.reason
    finally:
        kernels.int8_choice.cache_clear()
