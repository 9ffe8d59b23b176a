"""Loading a target / middle pair from a local folder or a hub id, and checking they can share a tree."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from . import compact, draft, kernels
from .hf import CausalLM
from .pages import drop_file_pages
from .precision import auto_dtype
from .prepare import prepare_missing, resolve_model_path


class ModelError(ValueError):
    """A model or tokenizer cannot be used as asked; the message says what to do."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Attention implementations that apply a 4D float mask as given: tree attention is such a mask. Flash
# attention and flex attention take only padding or their own block masks and would silently let every
# node see every other one.
MASKED_ATTENTION = ("sdpa", "eager")


@dataclass
class LoadedModel:
    """A model's tokenizer and configs, and its weights (`lm`) unless they live elsewhere (in actors)."""

    lm: CausalLM | None
    tokenizer: PreTrainedTokenizerBase
    source: str
    config: object = None
    generation_config: object = None

    def __post_init__(self):
        if self.lm is not None:
            self.config = self.config or self.lm.model.config
            self.generation_config = self.generation_config or self.lm.model.generation_config

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.generation_config, self.config, self.tokenizer):
            eos = getattr(src, "eos_token_id", None)
            if eos is not None:
                ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids


def describe_model(source: str, tokenizer: PreTrainedTokenizerBase | None = None, tp: int = 1) -> LoadedModel:
    """Tokenizer and configs only: for a driver whose weights load in remote actors (checked for `tp` ranks
    before any actor is placed)."""
    path = _resolve_folder(source)
    tok = tokenizer if tokenizer is not None else load_tokenizer(source)
    config = load_config(source, tp)
    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = None  # a model without generation_config.json: eos comes from its config and tokenizer
    return LoadedModel(None, tok, source, config, gen)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        require_cuda(dev)
    return dev


def require_cuda(dev: torch.device) -> None:
    """A CUDA device this process can use, or ModelError saying why not (instead of torch's traceback)."""
    if torch.version.cuda is None and torch.version.hip is None:
        raise ModelError(f"--device {dev}: this torch build ({torch.__version__}) has no CUDA support: install a "
                         "CUDA build (make setup TORCH=\"torch==... --index-url https://download.pytorch.org/whl/cu128\" "
                         "in a fresh .venv) or use --device cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ModelError(f"--device {dev}: torch {torch.__version__} supports CUDA but sees no GPU (no driver, or "
                         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}): use --device cpu")
    if dev.index is not None and dev.index >= count:
        raise ModelError(f"--device {dev}: this machine shows {count} GPU{'s' if count > 1 else ''} "
                         f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})")


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto": the fastest precision the device runs natively, measured (precision.py); else as named."""
    if dtype == "auto":
        return auto_dtype(device)
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _resolve_folder(source: str) -> str:
    path = os.path.expanduser(source)
    # Anything that is not a folder must read as a hub id ("org/name" or "name").
    if not os.path.isdir(path) and (source.startswith((".", "/", "~")) or source.count("/") > 1):
        raise ModelError(f"model folder {source!r} does not exist: give a local folder with config.json or a hub id")
    return path


def _load_error(source: str, e: Exception) -> ModelError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ModelError(f"cannot load {source!r} ({first}): give a local folder with config.json and tokenizer "
                      "files, or a hub id reachable from this machine")


def load_config(source: str, tp: int = 1):
    """The model's config, refused (ModelError) where tree decoding cannot run it on `tp` ranks."""
    try:
        config = AutoConfig.from_pretrained(_resolve_folder(source))
    except (OSError, ValueError) as e:
        raise e if isinstance(e, ModelError) else _load_error(source, e) from e
    check_supported(config, source, tp)
    return config


def check_supported(config, source: str, tp: int = 1) -> None:
    """One-line ModelError for what would break first: an attention implementation that ignores the tree mask,
    sliding-window layers, or a TP degree that does not divide the attention and key/value heads."""
    attention = getattr(config, "_attn_implementation", None)
    if attention is not None and attention not in MASKED_ATTENTION:
        raise ModelError(f"{source!r} is set to attention implementation {attention!r}, which ignores the 4D float "
                         f"mask tree verification passes: load it with attn_implementation={' or '.join(MASKED_ATTENTION)} "
                         "(drop attn_implementation from its config.json)")
    sliding = sliding_window_layers(config)
    if sliding:
        raise ModelError(f"{source!r} uses sliding-window attention (window {getattr(config, 'sliding_window', None)}) on {len(sliding)} "
                         f"of its {config.num_hidden_layers} layers: such a layer's cache drops keys by position, "
                         "which the KV compaction after every round does not follow; use a full-attention model or "
                         "config (use_sliding_window false)")
    if tp > 1:
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        if heads % tp or kv % tp:
            fits = [d for d in range(2, min(heads, kv) + 1) if heads % d == 0 and kv % d == 0]
            raise ModelError(f"--tp {tp} cannot shard {source!r}: its {heads} attention heads and {kv} key/value heads "
                             f"must both divide by the TP degree; use --tp {' or '.join(map(str, [1] + fits))}")


def sliding_window_layers(config) -> list[int]:
    """The layers whose attention (and cache) is windowed: by `layer_types` where the config has them (Qwen2,
    Qwen3, Gemma set them from use_sliding_window / max_window_layers), else every layer of a config with a
    window set (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types:
        return [i for i, kind in enumerate(types) if "sliding" in str(kind)]
    if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None):
        return list(range(config.num_hidden_layers))
    return []


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(_resolve_folder(source))
    except (OSError, ValueError) as e:
        raise e if isinstance(e, ModelError) else _load_error(source, e) from e


def load_model(source: str, device: str = "auto", dtype: str = "auto",
               tokenizer: PreTrainedTokenizerBase | None = None, pack: bool = True, drafter: bool = False
               ) -> LoadedModel:
    """Load a causal LM (and its tokenizer unless given); a missing folder or unknown id raises ModelError.
    On a CPU its linear layers run over exact compact weights (`CausalLM.compact_linears`) or packed
    (`CausalLM.pack_linears`) where that is faster here (`pack=False`: stock, e.g. to change the weights
    afterwards). Its drafting head covers the draft vocabulary, and a
    `drafter` (the middle model) runs its decoder linears in int8 where that is faster (draft.py)."""
    dev = pick_device(device)
    tok = tokenizer if tokenizer is not None else load_tokenizer(source)
    config = load_config(source)  # a model tree decoding cannot run fails here, before its weights load
    try:
        model = _from_pretrained(_resolve_folder(source), config, pick_dtype(dtype, dev))
    except (OSError, ValueError) as e:
        raise e if isinstance(e, ModelError) else _load_error(source, e) from e
    check_supported(model.config, source)  # the attention implementation transformers resolved
    lm = CausalLM(model.to(dev))
    if pack:
        if replaces_linears(lm, drafter):
            # What the faster linears below keep of the checkpoint (embedding, head, norms, biases) is copied out
            # of its file mapping first, so that the mapping goes once they have replaced the linears' weights.
            own_memory(lm.model, skip={id(m.weight) for m in lm.model.modules()
                                       if isinstance(m, torch.nn.Linear) and m is not lm.head})
        if drafter:
            draft.quantize_middle(lm)  # int8 decoder linears where faster (inexact: drafting only)
        lm.compact_linears(_resolve_folder(source))
        lm.pack_linears()
        lm.compact_tables(_resolve_folder(source))
    loaded = LoadedModel(lm, tok, source)
    always = draft.special_ids(tok, loaded.eos_ids)
    draft.set_draft_vocabulary(lm, draft.draft_vocabulary(lm.vocab_size, draft.vocab_setting(), always))
    return loaded


def _from_pretrained(folder: str, config, dtype: torch.dtype):
    """transformers' model at `dtype`. A checkpoint stored wider (the prepared embedded pair is fp32) loads at
    its own dtype, as views of the mapped file, and each parameter is then narrowed on its own, its file pages
    given back as it goes (`narrow`): transformers' own conversion read the whole file first, and a bf16 load
    of the fp32 1.5B target peaked at 11.1 GB of resident memory for 4.1 GB kept (2-core Zen 4 EPYC)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    wider = isinstance(stored, torch.dtype) and stored.is_floating_point and stored.itemsize > dtype.itemsize
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=stored if wider else dtype)
    if not wider:
        return model
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        del model  # modules transformers keeps in fp32 at any dtype: its own conversion knows which
        return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype)
    narrow(model, dtype)
    return model


def narrow(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast `model`'s floating-point parameters to `dtype` one at a time (tied ones stay tied), giving back the
    file pages of each one's old value once it is cast (pages.py); buffers keep their dtype, as transformers'
    own load at `dtype` leaves them (rotary frequencies stay fp32)."""
    with torch.no_grad():
        for p in model.parameters():  # each shared Parameter once
            if p.is_floating_point() and p.dtype != dtype:
                old = p.data
                p.data = old.to(dtype)
                drop_file_pages([old])
    model.config.dtype = dtype


def replaces_linears(lm: CausalLM, drafter: bool = False) -> bool:
    """Whether int8 (a drafter's), compact or packed layers replace `lm`'s linears in this process (each choice
    is made once per process, where it is first asked)."""
    if lm.device.type != "cpu":
        return False
    return ((drafter and kernels.int8_choice(lm.dtype).int8) or (lm.dtype == compact.DTYPE and compact.choice().compact)
            or kernels.choice(lm.dtype).packed)


def own_memory(model: torch.nn.Module, skip: set[int] = frozenset()) -> int:
    """Copy into this process's own memory every parameter and buffer of `model` (but those whose id is in
    `skip`) that views memory torch did not allocate, the checkpoint's file mapping; returns the bytes copied.

    transformers maps a safetensors checkpoint and, where the file's dtype is the model's, keeps its tensors as
    views of the mapping. Every page of it that was ever read stays mapped, and counted resident, as long as
    one view lives: once compact or packed layers had replaced the linears of the fp32 1.5B target, its
    embedding, head and norms kept 6.0 GB of file pages resident beside the 3.8 GB of weights in use (12.7 GB
    in all where the linears run packed). A tensor torch allocated (a converted dtype, a packed or compact
    form, a GPU copy) is left as it is: only a view of foreign memory has a storage that cannot resize."""
    copied, seen = 0, set(skip)
    with torch.no_grad():
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if t is None or id(t) in seen or t.layout != torch.strided or t.device.type != "cpu":
                        continue
                    seen.add(id(t))
                    if t.untyped_storage().resizable():
                        continue
                    mapped = t.data
                    if isinstance(t, torch.nn.Parameter):
                        t.data = mapped.clone()  # the same Parameter: tied weights stay tied
                    else:
                        store[name] = mapped.clone()
                    drop_file_pages([mapped])  # the copy replaces it: its file pages go now (pages.py)
                    copied += t.numel() * t.element_size()
    return copied


def check_tokenizers(target: PreTrainedTokenizerBase, middle: PreTrainedTokenizerBase, target_src: str,
                     middle_src: str) -> None:
    """Both models must map text to the same ids, or the middle drafter's tokens mean nothing."""
    if target.get_vocab() != middle.get_vocab():
        raise ModelError(f"the tokenizers of target {target_src!r} and middle {middle_src!r} differ: "
                         "pick a middle drafter from the same model family (same vocabulary)")


def check_pair(target: LoadedModel, middle: LoadedModel) -> None:
    check_tokenizers(target.tokenizer, middle.tokenizer, target.source, middle.source)
    if middle.lm.vocab_size < len(target.tokenizer):
        raise ModelError(f"middle model {middle.source!r} has {middle.lm.vocab_size} output ids, fewer than the "
                         f"{len(target.tokenizer)} tokens of the shared tokenizer")


def resolve_pair(target: str, middle: str | None, cache_dir: str | None
                 ) -> tuple[str, PreTrainedTokenizerBase, str | None, PreTrainedTokenizerBase | None]:
    """(target source, tokenizer, middle source or None, tokenizer) for model names as the user gives them
    (`middle` None or "none": no middle drafter): embedded names prepared on demand, tokenizers compared
    before any weights are loaded."""
    middle = None if middle is None or middle.lower() == "none" else middle
    if middle is not None:
        prepare_missing([target, middle], cache_dir)  # both side by side where both are to build
    t_src = resolve_model_path(target, cache_dir)
    t_tok = load_tokenizer(t_src)
    if middle is None:
        return t_src, t_tok, None, None
    m_src = resolve_model_path(middle, cache_dir)
    m_tok = load_tokenizer(m_src)
    check_tokenizers(t_tok, m_tok, target, middle)
    return t_src, t_tok, m_src, m_tok
