"""Compact exact fp32 linears (compact.py, csrc/compact_linear.cpp) and the weight groups prepare.py keeps."""

import copy

import numpy as np
import pytest
import torch
from tiny import perturbed_copy, tiny_model

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import model_key
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.models import compact, kernels, paths
from treegraft_dist.models.compact import CompactLinear, Groups
from treegraft_dist.models.hf import CausalLM

pytestmark = pytest.mark.skipif(compact.extension()[0] is None, reason=str(compact.extension()[1]))


def group_weight(n: int, k: int, group: int, seed: int, offset: bool = True) -> Groups:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-20, 21, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02
    off = torch.rand(n, k // group, generator=g) * 0.01 if offset else torch.empty(0)
    return Groups(q, scale, off, group)


def run(form, x, bias=None):
    return compact.extension()[0].linear(x, *form.args(), bias)


@pytest.mark.parametrize("kind", ["bf16", "fp16", "groups32", "groups16"])
def test_the_kernel_multiplies_the_exact_fp32_weight(kind):
    n, k = 37, 96  # n not a multiple of the 4-row block
    if kind in ("bf16", "fp16"):
        w = torch.randn(n, k).to(getattr(torch, "bfloat16" if kind == "bf16" else "float16")).float()
        form = compact.exact_form(w)
        assert form.kind == (0 if kind == "bf16" else 1)
    else:
        groups = group_weight(n, k, int(kind.removeprefix("groups")), seed=1, offset=kind == "groups32")
        form = groups.form()
        w = form.decode()
        assert compact.exact_form(w, {compact.fingerprint(w[0]): groups}) is not None
    bias = torch.randn(n)
    assert torch.equal(compact.extension()[0].decode(*form.args()), w)  # the kernel decodes to the same bits
    for m in (1, 2, 3, 4, 5, 6, 7, 17, 130):  # 130 rows: two passes over the weight (96-row chunks)
        x = torch.randn(m, k)
        y = run(form, x, bias)
        ref = x.double() @ w.double().T + bias.double()
        assert y.shape == (m, n) and torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bf16", "groups16", "groups32", "groups64", "groups48"])
def test_every_row_is_summed_alike_whatever_the_number_of_rows(kind):
    """A tree pass, prefill and a one-token pass give the same outputs bit for bit: every row count takes
    one of the kernel's paths (decoded in registers for a few rows, through a buffer for more, in chunks
    for a prefill), and each group size its own loop (48: the generic one)."""
    n, k = 66, 384
    if kind == "bf16":
        form = compact.exact_form(torch.randn(n, k).to(torch.bfloat16).float())
    else:
        form = group_weight(n, k, int(kind.removeprefix("groups")), seed=4, offset=kind != "groups16").form()
    x = torch.randn(200, k)
    full = run(form, x)
    spans = [(0, m) for m in range(1, 14)] + [(7, 8), (3, 19), (100, 200), (96, 97)]
    for lo, hi in spans:
        assert torch.equal(run(form, x[lo:hi].contiguous()), full[lo:hi]), (lo, hi)
    assert torch.equal(run(form, x.view(10, 20, k)).view(200, n), full)  # leading dims are rows too


def test_only_exact_forms_are_taken():
    w = torch.randn(8, 16)  # full fp32 mantissas
    assert compact.exact_form(w) is None
    fp16_only = torch.tensor([[1.0 + 2**-9] * 16] * 8)  # 10 mantissa bits: fp16 holds it, bf16 does not
    assert compact.exact_form(fp16_only).kind == 1
    groups = group_weight(8, 32, 32, seed=2)
    other = groups.form().decode()
    other[3, 5] += 1e-3  # same fingerprint (first row), other values: refused, and not 16-bit exact either
    assert compact.exact_form(other, {compact.fingerprint(other[0]): groups}) is None
    assert compact.exact_form(torch.randn(8, 12).to(torch.bfloat16).float()) is None  # K not a multiple of 8


def bf16_exact(model):
    """The same architecture with every weight rounded to bf16 (as a model published in bf16 loads in fp32)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_compact_model_computes_the_fp32_model(arch, fresh_choice):
    fresh_choice.setenv(kernels.LINEAR_ENV, "compact")
    model = bf16_exact(tiny_model(arch, seed=3))
    dense, lm = CausalLM(copy.deepcopy(model)), CausalLM(copy.deepcopy(model))
    assert lm.compact_linears()
    linears = [m for m in lm.model.modules() if isinstance(m, (torch.nn.Linear, CompactLinear))]
    assert linears and all(isinstance(m, CompactLinear) for m in linears)
    assert lm.head.weight is not None and all(m.weight is None for m in linears if m is not lm.head)
    assert model_key(lm, "tiny") == model_key(dense, "tiny").replace("float32", f"float32-compact{compact.KERNEL_VERSION}")
    ids = torch.arange(5, 45)
    ref = dense.logits(dense.hidden(dense.new_cache(), ids, torch.arange(40)))
    out = lm.logits(lm.hidden(lm.new_cache(), ids, torch.arange(40)))
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), (out - ref).abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_speculation_on_compact_models_reproduces_greedy_decoding_in_fp32(arch, fresh_choice):
    fresh_choice.setenv(kernels.LINEAR_ENV, "compact")
    model = bf16_exact(tiny_model(arch, seed=0))
    target, middle = CausalLM(copy.deepcopy(model)), CausalLM(bf16_exact(perturbed_copy(model, 0.3, 1)))
    assert target.compact_linears() and middle.compact_linears()
    prompt = [3, 9, 27, 81, 5, 3, 9, 27, 11, 40, 3, 9]
    dec = Decoder(target, middle, TreeConfig(budget=16))
    ref = dec.generate(prompt, 32, "ar").tokens
    assert ref == Decoder(CausalLM(model)).generate(prompt, 32, "ar").tokens  # the dense fp32 model agrees
    for method in ("all-small", "all-mid", "01010", "10000"):
        gen = dec.generate(prompt, 32, method)
        assert gen.tokens == ref, method
        assert max(gen.stats.tree_sizes) > 1, method


def test_a_drafting_head_over_some_ids_is_compact_too(fresh_choice):
    from treegraft_dist.models import draft

    fresh_choice.setenv(kernels.LINEAR_ENV, "compact")
    lm = CausalLM(bf16_exact(tiny_model("llama", seed=5)))
    assert lm.compact_linears()
    h = lm.hidden(lm.new_cache(), torch.arange(3, 13), torch.arange(10))
    full = lm.logits(h)
    draft.set_draft_vocabulary(lm, np.array([0, 4, 9, 50, 95]))
    assert isinstance(lm.draft_head, CompactLinear)
    assert torch.equal(lm.draft_logits(h), full[:, [0, 4, 9, 50, 95]])


def test_off_when_told_and_a_bad_setting_is_a_clear_error(fresh_choice):
    fresh_choice.setenv(kernels.LINEAR_ENV, "packed")
    assert not compact.choice().compact and compact.choice().reason == f"${kernels.LINEAR_ENV}=packed"
    lm = CausalLM(bf16_exact(tiny_model("llama", seed=5)))
    assert not lm.compact_linears()
    compact.choice.cache_clear()
    kernels.choice.cache_clear()
    fresh_choice.setenv(kernels.LINEAR_ENV, "quick")
    with pytest.raises(ValueError, match="use auto, compact, packed or stock"):
        kernels.choice(torch.float32)
    compact.choice.cache_clear()
    fresh_choice.delenv(kernels.LINEAR_ENV)
    c = compact.choice()
    assert "probe 1 rows: fp32" in c.reason and "16 rows" in c.reason


def test_a_bf16_model_is_left_as_it_is(fresh_choice):
    fresh_choice.setenv(kernels.LINEAR_ENV, "compact")
    lm = CausalLM(tiny_model("llama", seed=5).to(torch.bfloat16))
    assert not lm.compact_linears()


# -- the weight groups of a GGUF file (prepare.py) ----------------------------------------------------------

def random_blocks(kind: str, n_blocks: int, seed: int) -> np.ndarray:
    """Valid GGUF blocks of `kind` with random quants and finite, small f16 scales."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    scale_at = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
                "Q6_K": [208]}[kind]
    for at in scale_at:
        blocks[:, at : at + 2] = rng.uniform(1e-4, 1e-2, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_become_groups_that_reproduce_their_dequantized_values(kind, tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from treegraft_dist.models.prepare import group_params

    qtype = GGMLQuantizationType[kind]
    small = not kind.endswith("_K")  # blocks of 32 (rows of 64 here) or of 256 columns
    per_row = 2 if small else 1
    k = 64 if small else 256
    blocks = random_blocks(kind, 6 * per_row, seed=7)
    w = dequantize(blocks.reshape(6, -1), qtype)
    assert w.shape == (6, k)
    group, scale, offset = group_params(kind, blocks)
    scale = torch.from_numpy(scale.reshape(6, k // group))
    offset = torch.empty(0) if offset is None else torch.from_numpy(offset.reshape(6, k // group))
    full_scale = scale.repeat_interleave(group, 1)
    q = torch.round((torch.from_numpy(w) + (offset.repeat_interleave(group, 1) if offset.numel() else 0)) / full_scale)
    form = Groups(q.to(torch.int8), scale, offset, group).form()
    assert torch.equal(form.decode(), torch.from_numpy(w))
    assert torch.equal(compact.extension()[0].decode(*form.args()), torch.from_numpy(w))


def test_prepare_keeps_the_groups_of_a_gguf_file_and_loading_uses_them(tmp_path):
    import gguf
    from gguf.quants import quantize

    from treegraft_dist.models.prepare import write_weight_groups

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_tensor("blk.0.ffn_up.weight", quantize(w, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_weight_groups(tmp_path / "m.gguf", tmp_path / paths.GROUPS_FILE, progress=False)
    groups = compact.load_groups(tmp_path)
    assert len(groups) == 1
    dequantized = torch.from_numpy(gguf.quants.dequantize(quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                                          gguf.GGMLQuantizationType.Q8_0))
    form = compact.exact_form(dequantized, groups)
    assert form is not None and form.kind == 2 and form.group == 32
    assert form.nbytes < dequantized.numel() * 4 / 3
    assert compact.load_groups(tmp_path / "elsewhere") == {}
    assert compact.load_groups(tmp_path, only={compact.fingerprint(dequantized[0])}).keys() == groups.keys()
    assert compact.load_groups(tmp_path, only={"another weight"}) == {}


@pytest.mark.parametrize("one, tree, wins", [((1.0, 2.0), (1.10, 1.0), True),   # faster at 1 row, 10% slower at 16
                                              ((1.0, 2.0), (1.30, 1.0), False),  # 30% slower at 16 rows
                                              ((2.0, 2.0), (0.5, 1.0), False)])  # no faster at 1 row
def test_the_probe_takes_compact_where_a_step_is_faster_and_a_tree_not_much_slower(monkeypatch, one, tree, wins):
    if compact.extension()[0] is None:
        pytest.skip(compact.extension()[1])
    ms = {(1, "compact"): one[0], (1, "dense"): one[1], (16, "compact"): tree[0], (16, "dense"): tree[1]}
    monkeypatch.setattr(compact, "best_ms", lambda fns, repeats: {k: ms[k] for k in fns})
    assert compact.probe()[0] is wins


# -- embedding and head rows kept compact (CausalLM.compact_tables) -----------------------------------------
@pytest.mark.skipif(kernels.unsupported(torch.float32) is not None, reason="no packed fp32 linear here")
@pytest.mark.parametrize("path, tied", [("packed", False), ("compact", False), ("packed", True)])
def test_a_loaded_fp32_model_keeps_its_embedding_and_head_rows_compact_and_exact(tmp_path, fresh_choice, path, tied):
    """The input embedding and the output head's rows (what drafting gathers) are kept in their exact compact
    form, not as dense fp32 copies: every lookup and row is the checkpoint's to the bit, greedy decoding and
    speculation are unchanged, and transformers' own generate (the peers') runs on the model as loaded."""
    from tiny import char_tokenizer, save_tiny

    from treegraft_dist.models import draft
    from treegraft_dist.models.loading import load_model

    fresh_choice.setenv(kernels.LINEAR_ENV, path)
    model = bf16_exact(tiny_model("llama", seed=7, tie_word_embeddings=tied))
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    folder = save_tiny(tmp_path / "t", model, char_tokenizer())
    mid_folder = save_tiny(tmp_path / "m", bf16_exact(perturbed_copy(model, 0.3, 8)), char_tokenizer())
    target, middle = load_model(folder, "cpu", "float32").lm, load_model(mid_folder, "cpu", "float32", drafter=True).lm
    stock = load_model(folder, "cpu", "float32", pack=False).lm
    for lm in (target, middle):
        assert isinstance(lm.model.get_input_embeddings(), compact.CompactEmbedding)
        assert lm.head.weight is None and lm.head_table is not None
    assert (target.model.get_input_embeddings().table is target.head_table) == tied
    ids = torch.arange(stock.vocab_size)
    assert torch.equal(target.head_rows(ids), stock.head.weight)
    grid = torch.tensor([[3, 9, 27], [81, 5, 0]])
    assert torch.equal(target.model.get_input_embeddings()(grid), stock.model.get_input_embeddings()(grid))
    # a drafting head over some ids takes its rows from the table
    draft.set_draft_vocabulary(target, np.array([0, 4, 9, 50, 95]))
    h = target.hidden(target.new_cache(), torch.arange(3, 13), torch.arange(10))
    assert torch.allclose(target.draft_logits(h), target.logits(h)[:, [0, 4, 9, 50, 95]], rtol=1e-5, atol=1e-5)
    draft.set_draft_vocabulary(target, None)

    prompt = [3, 9, 27, 81, 5, 3, 9, 27, 11, 40, 3, 9]
    dec = Decoder(target, middle, TreeConfig(budget=16))
    ref = dec.generate(prompt, 24, "ar").tokens
    assert ref == Decoder(stock).generate(prompt, 24, "ar").tokens
    for method in ("all-small", "all-mid", "01010"):
        assert dec.generate(prompt, 24, method).tokens == ref, method
    with torch.no_grad():
        ids = torch.tensor([prompt])
        greedy = target.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assisted = target.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                         assistant_model=middle.model)
    assert greedy[0, len(prompt):].tolist() == ref[:12] == assisted[0, len(prompt):].tolist()


def test_weights_without_an_exact_compact_form_stay_dense(tmp_path, fresh_choice):
    from tiny import char_tokenizer, save_tiny

    from treegraft_dist.models.loading import load_model

    fresh_choice.setenv(kernels.LINEAR_ENV, "packed")
    lm = load_model(save_tiny(tmp_path / "t", tiny_model("llama", seed=9), char_tokenizer()), "cpu", "float32").lm
    assert isinstance(lm.model.get_input_embeddings(), torch.nn.Embedding)
    assert lm.head.weight is not None and lm.head_table is None
    assert lm.compact_tables() == 0


@pytest.mark.skipif(kernels.unsupported(torch.float32) is not None, reason="no packed fp32 linear here")
def test_an_embedding_that_computes_more_than_a_lookup_stays_as_it_is_and_so_does_a_head_tied_to_it(fresh_choice):
    class Scaled(torch.nn.Embedding):  # as some architectures scale their embeddings
        def forward(self, ids):
            return super().forward(ids) * 2.0

    fresh_choice.setenv(kernels.LINEAR_ENV, "packed")
    model = bf16_exact(tiny_model("llama", seed=10, tie_word_embeddings=True))
    old = model.get_input_embeddings()
    scaled = Scaled(old.num_embeddings, old.embedding_dim)
    scaled.weight = old.weight
    model.set_input_embeddings(scaled)
    lm = CausalLM(model)
    assert lm.pack_linears()
    assert lm.compact_tables() == 0
    assert model.get_input_embeddings() is scaled and lm.head.weight is scaled.weight and lm.head_table is None
