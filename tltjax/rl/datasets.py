"""RL prompt datasets: (prompt, answer) pairs from files, synthetic tasks or reasoning_gym, and a
resumable sampler of prompt batches.

The answer is whatever the reward function reads (`tltjax.rl.rewards`): a final answer for
"math", a task's answer for a synthetic task, `rewards.reasoning_gym_answer` JSON for
"reasoning_gym".
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tltjax import data
from tltjax.models.tokenizer import Tokenizer
from tltjax.rl import rewards, tasks

ANSWER_INSTRUCTION = "Give only your final answer between <answer> and </answer> tags."


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One RL prompt and the answer its reward function checks responses against."""

    prompt: str
    answer: str


# --- files ---------------------------------------------------------------------------------------


def _read_jsonl(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number} is not valid JSON ({e}): {line[:200]!r}.") from None


def _read_parquet(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    for number, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"row {number}", row


READERS: dict[str, Callable[[pathlib.Path], Iterator[tuple[str, Any]]]] = {
    ".jsonl": _read_jsonl,
    ".parquet": _read_parquet,
}


def _answer_text(answer: Any) -> str:
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (dict, list)):
        return json.dumps(answer)
    return str(answer)


def load_prompt_dataset(
    path: str | pathlib.Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[PromptExample]:
    """The (prompt, answer) rows of a .jsonl or .parquet file; answers become strings.

    Every row must hold a string `prompt_field` and a non-null `answer_field`.
    """
    path = pathlib.Path(path)
    if path.suffix not in READERS:
        raise ValueError(f"prompt dataset {str(path)!r}: unknown extension {path.suffix!r}; use one of {sorted(READERS)}.")
    if not path.is_file():
        raise FileNotFoundError(f"prompt dataset {str(path)!r} does not exist (cwd {pathlib.Path.cwd()}).")
    examples = []
    for where, row in READERS[path.suffix](path):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {where} is a {type(row).__name__}, expected an object with fields.")
        for field in (prompt_field, answer_field):
            if row.get(field) is None:
                raise ValueError(
                    f"{path}: {where} has no field {field!r} (or it is null); fields present: "
                    f"{sorted(row)}. Pick others with prompt_field= / answer_field=."
                )
        prompt = row[prompt_field]
        if not isinstance(prompt, str):
            raise ValueError(f"{path}: {where} field {prompt_field!r} is a {type(prompt).__name__}, expected a string.")
        examples.append(PromptExample(prompt, _answer_text(row[answer_field])))
    if not examples:
        raise ValueError(f"prompt dataset {str(path)!r} has no rows.")
    return examples


# --- generated datasets --------------------------------------------------------------------------


def task_dataset(task_name: str, n: int, seed: int, **options) -> list[PromptExample]:
    """`n` prompts of a synthetic task (`tltjax.rl.tasks`), deterministic in `seed`."""
    task = tasks.get_task(task_name)
    try:
        examples = task.generate(n, seed=seed, **options)
    except TypeError as e:
        raise ValueError(f"options {options} do not fit task {task_name!r}: {e}") from None
    return [PromptExample(e.prompt, e.answer) for e in examples]


def reasoning_gym_dataset(name: str, n: int, seed: int, **options) -> list[PromptExample]:
    """`n` reasoning_gym problems of dataset `name` (config `options`), for the "reasoning_gym" reward.

    The prompt is the question plus `ANSWER_INSTRUCTION`; the answer is
    `rewards.reasoning_gym_answer(name, entry)`.
    """
    import reasoning_gym

    known = reasoning_gym.factory.DATASETS
    if name not in known:
        raise ValueError(f"reasoning_gym has no dataset {name!r}; known: {sorted(known)}.")
    config_cls = known[name][1]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(options) - fields
    if unknown:
        raise ValueError(f"reasoning_gym dataset {name!r} has no options {sorted(unknown)}; its options: {sorted(fields)}.")
    dataset = reasoning_gym.create_dataset(name, size=n, seed=seed, **options)
    return [
        PromptExample(f"{entry['question']}\n\n{ANSWER_INSTRUCTION}", rewards.reasoning_gym_answer(name, entry))
        for entry in (dataset[i] for i in range(n))
    ]


def encode(examples: Sequence[PromptExample], tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of each prompt as a chat user turn, ready for the reply (`data.encode_prompts`)."""
    return data.encode_prompts([e.prompt for e in examples], tokenizer)


# --- sampling ------------------------------------------------------------------------------------


class PromptSampler:
    """Endless batches of `batch_prompts` examples, a fresh permutation every epoch.

    Deterministic in `seed`; the last incomplete batch of each epoch is dropped, so every
    example appears at most once per batch. `next()` gives a batch's indices into `examples`,
    iterating gives the examples. `state()` is a small JSON-able dict and `restore(state)`
    continues with exactly the batches that would have followed.
    """

    def __init__(self, examples: Sequence[PromptExample], batch_prompts: int, seed: int):
        if not 1 <= batch_prompts <= len(examples):
            raise ValueError(
                f"batch_prompts must be in [1, {len(examples)}] (the number of examples), got {batch_prompts}."
            )
        self.examples = examples
        self.batch_prompts = batch_prompts
        self.seed = seed
        self.epoch = 0
        self.batch = 0  # next batch within the epoch
        self._order = self._permutation(0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.examples) // self.batch_prompts

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def next(self) -> list[int]:
        """Indices into `examples` of the next batch."""
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = self.batch * self.batch_prompts
        self.batch += 1
        return self._order[start : start + self.batch_prompts].tolist()

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[PromptExample]:
        return [self.examples[i] for i in self.next()]

    def state(self) -> dict[str, int]:
        """The position: which batch comes next, and what it was drawn from."""
        return {"seed": self.seed, "epoch": self.epoch, "batch": self.batch,
                "num_examples": len(self.examples), "batch_prompts": self.batch_prompts}

    def restore(self, state: dict[str, int]) -> None:
        """Continues from `state()`; the dataset, batch size and seed must be the ones it came from."""
        mine = self.state()
        for key in ("seed", "num_examples", "batch_prompts"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={mine[key]}; "
                    "resume with the same prompts, batch size and seed."
                )
        if not 0 <= state["batch"] <= self.batches_per_epoch:
            raise ValueError(f"sampler state batch={state['batch']} is outside [0, {self.batches_per_epoch}].")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._order = self._permutation(self.epoch)
