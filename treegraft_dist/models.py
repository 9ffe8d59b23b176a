"""Loading a target / middle pair from a local folder or a hub id, and checking they can share a tree."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from . import draft
from .hf import CausalLM
from .precision import auto_dtype


class ModelError(ValueError):
    """A model or tokenizer cannot be used as asked; the message says what to do."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def describe_model(source: str, tokenizer: PreTrainedTokenizerBase | None = None) -> LoadedModel:
    """Tokenizer and configs only: for a driver whose weights load in remote actors."""
    path = _resolve_folder(source)
    tok = tokenizer if tokenizer is not None else load_tokenizer(source)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _load_error(source, e) from e
    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = None  # a model without generation_config.json: eos comes from its config and tokenizer
    return LoadedModel(None, tok, source, config, gen)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(_resolve_folder(source))
    except (OSError, ValueError) as e:
        raise e if isinstance(e, ModelError) else _load_error(source, e) from e


def load_model(source: str, device: str = "auto", dtype: str = "auto",
               tokenizer: PreTrainedTokenizerBase | None = None, pack: bool = True, drafter: bool = False
               ) -> LoadedModel:
    """Load a causal LM (and its tokenizer unless given); a missing folder or unknown id raises ModelError.
    On a CPU its linear layers run packed where that is faster here (`CausalLM.pack_linears`; `pack=False`:
    stock, e.g. to change the weights afterwards). Its drafting head covers the draft vocabulary, and a
    `drafter` (the middle model) runs its decoder linears in int8 where that is faster (draft.py)."""
    dev = pick_device(device)
    tok = tokenizer if tokenizer is not None else load_tokenizer(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(_resolve_folder(source), dtype=pick_dtype(dtype, dev))
    except (OSError, ValueError) as e:
        raise e if isinstance(e, ModelError) else _load_error(source, e) from e
    lm = CausalLM(model.to(dev))
    if drafter and pack:
        draft.quantize_middle(lm)
    if pack:
        lm.pack_linears()
    loaded = LoadedModel(lm, tok, source)
    always = draft.special_ids(tok, loaded.eos_ids)
    draft.set_draft_vocabulary(lm, draft.draft_vocabulary(lm.vocab_size, draft.vocab_setting(), always))
    return loaded


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
