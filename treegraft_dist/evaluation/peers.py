"""The peer methods the evaluation compares against, run by stock transformers `model.generate` on the same
models, greedy, and reported as our own `Generation`.

- hf-assisted: assisted generation with the middle model as `assistant_model`. The assistant keeps
  transformers' defaults: up to `num_assistant_tokens=20` drafts a round, schedule "constant", and drafting
  stops early once the assistant's top probability drops below `assistant_confidence_threshold=0.4` (static
  here; transformers adapts it per request only when scikit-learn is installed).
- hf-pld: prompt lookup decoding, `prompt_lookup_num_tokens=10` drafts copied after the earliest match of the
  last n-gram (`max_matching_ngram_size` left at its default, 2) anywhere in prompt + output.

Stats use the vocabulary of RequestStats, with one difference: transformers verifies the first drafts in the
prefill forward, so there is no separate prefill. rounds = target forward passes (prefill included);
accepted = tokens each of them gained (bonus included; sums to new_tokens); tree_sizes = root + drafts
verified per round; middle_calls = assistant forward passes per round. Phases stay 0 (generate cannot be
split from outside): all time is `other`, and wall_s is the whole call.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from ..decoding.engine import Generation, check_request, truncate
from ..decoding.stats import PhaseTimer, RequestStats
from ..models.hf import CausalLM

PEER_METHODS = ("hf-assisted", "hf-pld")
PLD_NUM_TOKENS = 10
PAD_FALLBACK_ID = 0  # batch size 1 never pads, but generate wants an id
# transformers' assisted generation calls the assistant's generate with a config and loose kwargs, and warns
# about its own call.
OWN_CALL_WARNING = "Passing `generation_config` together with"


def run_peer(method: str, target: CausalLM, middle: CausalLM | None, prompt: list[int], max_new_tokens: int,
             eos_ids: set[int]) -> Generation:
    """Decode `prompt` greedily with a peer method; tokens stop after the first eos, as plain decoding does."""
    if method not in PEER_METHODS:
        raise ValueError(f"unknown peer method {method!r}: use one of {', '.join(PEER_METHODS)}")
    if method == "hf-assisted" and middle is None:
        raise ValueError("hf-assisted drafts with the middle model as transformers' assistant_model: "
                         "pass a middle model")
    check_request(prompt, max_new_tokens)
    stats = RequestStats(method, prompt_tokens=len(prompt))
    timer = PhaseTimer(stats, target.device)
    tokens: list[int] = []
    if max_new_tokens:
        assistant = middle.model if method == "hf-assisted" else None
        config = _greedy_config(max_new_tokens, eos_ids, PLD_NUM_TOKENS if method == "hf-pld" else None)
        rounds = _Rounds()
        ids = torch.tensor([prompt], device=target.device)
        with _recording(target.model, assistant, rounds), torch.inference_mode():
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                        assistant_model=assistant, streamer=rounds)
        tokens = truncate(out[0, len(prompt):].tolist(), max_new_tokens, eos_ids)
        rounds.tree_sizes[0] -= len(prompt) - 1  # the first forward also ran the prompt
        stats.rounds = len(rounds.tree_sizes)
        stats.accepted, stats.tree_sizes, stats.middle_calls = rounds.accepted, rounds.tree_sizes, rounds.middle_calls
    stats.new_tokens = len(tokens)
    timer.finish()
    return Generation(tokens, stats)


def _greedy_config(max_new_tokens: int, eos_ids: set[int], prompt_lookup: int | None) -> GenerationConfig:
    eos = sorted(eos_ids)
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                            eos_token_id=eos or None, pad_token_id=eos[0] if eos else PAD_FALLBACK_ID,
                            prompt_lookup_num_tokens=prompt_lookup)


class _Rounds(BaseStreamer):
    """Per-round records. generate streams the prompt first, then the tokens each target forward gained."""

    def __init__(self):
        self.accepted: list[int] = []
        self.tree_sizes: list[int] = []  # tokens fed to each target forward
        self.middle_calls: list[int] = []
        self._middle_forwards = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.accepted.append(value.numel())
        self._prompt_seen = True

    def end(self) -> None:
        pass

    def target_forward(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.tree_sizes.append(ids.shape[-1])
        self.middle_calls.append(self._middle_forwards)
        self._middle_forwards = 0

    def middle_forward(self, module, args, kwargs) -> None:
        self._middle_forwards += 1


@contextmanager
def _recording(target: PreTrainedModel, assistant: PreTrainedModel | None, rounds: _Rounds):
    """Hooks that count forwards, and blank generation configs so checkpoint defaults (sampling settings,
    repetition penalty, eos, assistant schedule) neither change greedy decoding nor raise warnings; all undone
    on exit."""
    with ExitStack() as stack:
        stack.enter_context(_blank_generation_config(target))
        stack.callback(target.register_forward_pre_hook(rounds.target_forward, with_kwargs=True).remove)
        if assistant is not None:
            stack.enter_context(_blank_generation_config(assistant))
            stack.callback(assistant.register_forward_pre_hook(rounds.middle_forward, with_kwargs=True).remove)
            logger = logging.getLogger("transformers.generation.utils")
            logger.addFilter(_not_own_call_warning)
            stack.callback(logger.removeFilter, _not_own_call_warning)
        yield


def _not_own_call_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(OWN_CALL_WARNING)


@contextmanager
def _blank_generation_config(model: PreTrainedModel):
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
