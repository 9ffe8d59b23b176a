"""A CPU model loaded for decoding keeps no view of its checkpoint's file mapping (loading.own_memory), so the
pages its conversion read do not stay resident beside the weights in use."""

import mmap
import sys

import numpy as np
import pytest
import torch
from tiny import char_tokenizer, save_tiny, tiny_model

from treegraft_dist.models import compact, kernels, loading
from treegraft_dist.models.kernels import LINEAR_ENV
from treegraft_dist.models.loading import load_model, own_memory
from treegraft_dist.models.pages import drop_file_pages


def mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


def foreign(values: np.ndarray) -> torch.Tensor:
    """A tensor over memory torch did not allocate, as a mapped checkpoint's are."""
    return torch.from_numpy(values)


def test_own_memory_copies_foreign_views_keeps_ties_and_skips_what_it_is_told():
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    inner = torch.nn.Linear(4, 4)
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "inner": inner})
    emb.weight = head.weight = torch.nn.Parameter(foreign(np.arange(32, dtype=np.float32).reshape(8, 4)),
                                                  requires_grad=False)
    inner.weight = torch.nn.Parameter(foreign(np.ones((4, 4), np.float32)), requires_grad=False)
    inner.register_buffer("table", foreign(np.zeros(3, np.float32)))
    own = inner.bias  # allocated by torch
    copied = own_memory(model, skip={id(inner.weight)})
    assert copied == (32 + 3) * 4
    assert emb.weight is head.weight and emb.weight.untyped_storage().resizable()  # still tied, now owned
    assert torch.equal(emb.weight, torch.arange(32, dtype=torch.float32).reshape(8, 4))
    assert inner.table.untyped_storage().resizable()
    assert not inner.weight.untyped_storage().resizable()  # skipped
    assert inner.bias is own


@pytest.mark.skipif(kernels.unsupported(torch.float32) is not None, reason="no packed fp32 linear here")
@pytest.mark.parametrize("path", ["packed", "compact"])
def test_a_loaded_cpu_model_drops_its_checkpoint_mapping(tmp_path, fresh_choice, path):
    if path == "compact" and compact.extension()[0] is None:
        pytest.skip(str(compact.extension()[1]))
    model = tiny_model("llama", seed=4)
    # bf16-representable weights: every linear has an exact compact form
    model = model.to(torch.bfloat16).float()
    folder = save_tiny(tmp_path / "m", model, char_tokenizer())
    fresh_choice.setenv(LINEAR_ENV, path)
    lm = load_model(folder, "cpu", "float32").lm
    assert lm.compact == (path == "compact") and lm.packed
    checkpoint = str(tmp_path / "m" / "model.safetensors")
    assert not mapped(checkpoint)
    assert all(t.untyped_storage().resizable() for t in [*lm.model.parameters(), *lm.model.buffers()]
               if t.layout == torch.strided)
    stock = load_model(folder, "cpu", "float32", pack=False).lm
    assert mapped(checkpoint)  # unconverted linears read the mapping: nothing is copied out of it
    ids = torch.arange(3, 23)
    ref = stock.logits(stock.hidden(stock.new_cache(), ids, torch.arange(20)))
    out = lm.logits(lm.hidden(lm.new_cache(), ids, torch.arange(20)))
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), (out - ref).abs().max()


@pytest.mark.skipif(kernels.unsupported(torch.float32) is not None, reason="no packed fp32 linear here")
def test_stock_linears_read_the_mapping_and_nothing_is_copied_from_it(tmp_path, fresh_choice):
    folder = save_tiny(tmp_path / "m", tiny_model("llama", seed=5), char_tokenizer())
    fresh_choice.setenv(LINEAR_ENV, "stock")
    lm = load_model(folder, "cpu", "float32").lm
    assert not lm.packed and not lm.compact
    assert mapped(str(tmp_path / "m" / "model.safetensors"))
    assert not lm.model.get_input_embeddings().weight.untyped_storage().resizable()


def mapping_rss_kb(path: str) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    kb, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            key = line.split(maxsplit=1)[0]
            if not key.endswith(":"):  # a mapping's header line; its fields ("Rss:", ...) follow
                inside = line.rstrip().endswith(path)
            elif inside and key == "Rss:":
                kb += int(line.split()[1])
    return kb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_dropped_checkpoint_pages_leave_the_process_and_read_back_from_the_file(tmp_path):
    """A packed layer's source weight, a view of the mapped checkpoint, stops counting as resident once dropped;
    the file is untouched (a later read faults the same values back in); torch's own memory is never touched."""
    values = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: whole pages
    path = tmp_path / "model.safetensors"
    values.tofile(path)
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)  # as safetensors maps a checkpoint
    weight = torch.frombuffer(mapping, dtype=torch.float32)
    assert torch.equal(weight, torch.from_numpy(values))  # read: every page resident
    before = mapping_rss_kb(str(path))
    assert before >= 15 << 10
    assert drop_file_pages([weight]) >= (16 << 20) - 2 * mmap.PAGESIZE
    assert mapping_rss_kb(str(path)) < before / 8
    assert torch.equal(weight[-5:], torch.from_numpy(values[-5:]))  # faulted back in from the file
    own = torch.arange(1 << 20, dtype=torch.float32)
    assert drop_file_pages([own]) == 0 and float(own[-1]) == (1 << 20) - 1
    del weight


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_wider_checkpoint_is_narrowed_parameter_by_parameter_as_transformers_would_load_it(tmp_path, arch,
                                                                                         monkeypatch):
    """An fp32 checkpoint loaded in bf16 loads at its own dtype and each parameter is cast on its own
    (loading.narrow), so the whole file is never resident beside the narrowed weights: the model equals
    transformers' own bf16 load in every parameter and buffer, dtype and value, ties included."""
    from transformers import AutoModelForCausalLM

    model = tiny_model(arch, seed=6)
    assert model.dtype == torch.float32
    folder = save_tiny(tmp_path / "m", model, char_tokenizer())
    narrowed = []
    monkeypatch.setattr(loading, "narrow", lambda m, dtype, _narrow=loading.narrow: narrowed.append(dtype)
                        or _narrow(m, dtype))
    ours = load_model(folder, "cpu", "bfloat16", pack=False).lm.model
    assert narrowed == [torch.bfloat16]
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert ours.config.dtype == torch.bfloat16
    for mine, want in [(dict(ours.named_parameters()), dict(theirs.named_parameters())),
                       (dict(ours.named_buffers()), dict(theirs.named_buffers()))]:
        assert mine.keys() == want.keys()
        for name, t in mine.items():
            assert t.dtype == want[name].dtype and torch.equal(t, want[name]), name
    assert all(p.untyped_storage().resizable() for p in ours.parameters())  # cast copies, not views of the file
    tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    assert tied == (theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight)
