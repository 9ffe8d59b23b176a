"""The benchmark question sets (JSONL: question_id, category, turns) and their chat-formatted prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parents[1] / "data" / "benchmarks"
BENCHMARKS = {
    "mt_bench": "mt_bench.jsonl",
    "gsm8k": "gsm8k.jsonl",
    "humaneval": "humaneval.jsonl",
    "alpaca": "alpaca.jsonl",
    "qa": "qa.jsonl",
    "sum": "sum.jsonl",
}


class BenchmarkError(ValueError):
    """A benchmark name or file that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class Question:
    benchmark: str
    question_id: str
    category: str
    turns: tuple[str, ...]


def load_questions(path: str | Path, benchmark: str | None = None) -> list[Question]:
    path = Path(path)
    if not path.is_file():
        raise BenchmarkError(f"benchmark file {str(path)!r} does not exist")
    name = benchmark or path.stem
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError("'turns' must be a non-empty list of non-empty strings")
            out.append(Question(name, str(row["question_id"]), str(row.get("category", "")), tuple(turns)))
        except (ValueError, KeyError, TypeError) as e:
            raise BenchmarkError(f"{path}:{lineno}: not a benchmark row ({e}); each line must be a JSON object "
                                 "with question_id, category and turns (a list of strings)") from e
    if not out:
        raise BenchmarkError(f"benchmark file {str(path)!r} holds no questions")
    return out


def builtin(name: str) -> list[Question]:
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}: choose from {', '.join(BENCHMARKS)} or pass "
                             "--benchmark-file FILE")
    return load_questions(DATA_DIR / BENCHMARKS[name], name)


def chat_prompt(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    """Token ids of a conversation whose last user turn awaits an answer (earlier turns answered)."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer("\n\n".join(turns), add_special_tokens=True)["input_ids"]
