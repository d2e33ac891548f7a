"""Tests for tltjax/rl/datasets.py: prompt files, generated datasets, encoding and the resumable
prompt sampler."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tltjax import data
from tltjax.models.tokenizer import char_tokenizer
from tltjax.rl import datasets, rewards, tasks
from tltjax.rl.datasets import PromptExample, PromptSampler

ROWS = [{"prompt": "1+1", "answer": 2, "id": 0}, {"prompt": "2+3", "answer": "5", "id": 1}]


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


# --- files ---------------------------------------------------------------------------------------


def test_load_jsonl_and_parquet(tmp_path):
    """Both formats give the same examples; answers become strings; blank lines are skipped."""
    jsonl = write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "", json.dumps(ROWS[1])])
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "answer": int(r["answer"])} for r in ROWS]), parquet)
    expected = [PromptExample("1+1", "2"), PromptExample("2+3", "5")]
    assert datasets.load_prompt_dataset(jsonl) == expected
    assert datasets.load_prompt_dataset(str(parquet)) == expected


def test_load_custom_fields(tmp_path):
    """prompt_field / answer_field pick other columns; structured answers become JSON."""
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q", "solution": {"x": 1}})])
    assert datasets.load_prompt_dataset(path, "question", "solution") == [PromptExample("q", '{"x": 1}')]


@pytest.mark.parametrize(
    "name, lines, error, match",
    [
        ("d.csv", ["a"], ValueError, r"unknown extension '.csv'; use one of \['.jsonl', '.parquet'\]"),
        ("d.jsonl", [json.dumps(ROWS[0]), "{oops"], ValueError, "line 2 is not valid JSON"),
        ("d.jsonl", [json.dumps(ROWS[0]), "", json.dumps({"prompt": "p", "id": 3})], ValueError,
         r"line 3 has no field 'answer' \(or it is null\); fields present: \['id', 'prompt'\]"),
        ("d.jsonl", [json.dumps({"prompt": "p", "answer": None})], ValueError, "line 1 has no field 'answer'"),
        ("d.jsonl", [json.dumps({"prompt": ["p"], "answer": 1})], ValueError, "field 'prompt' is a list"),
        ("d.jsonl", ["[1, 2]"], ValueError, "line 1 is a list, expected an object"),
        ("d.jsonl", [""], ValueError, "has no rows"),
    ],
)
def test_load_errors(tmp_path, name, lines, error, match):
    """Each malformed input is reported with where it is and what was wrong."""
    path = write_jsonl(tmp_path / name, lines)
    with pytest.raises(error, match=match):
        datasets.load_prompt_dataset(path)


def test_load_missing_file_and_parquet_field(tmp_path):
    """A missing file says so; a parquet file without the field names its row and columns."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        datasets.load_prompt_dataset(tmp_path / "nope.jsonl")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "1"}]), path)
    with pytest.raises(ValueError, match=r"row 0 has no field 'prompt'.*\['answer', 'question'\]"):
        datasets.load_prompt_dataset(path)


# --- generated datasets --------------------------------------------------------------------------


def test_task_dataset_matches_task():
    """task_dataset is the task's examples as (prompt, answer), deterministic in the seed."""
    got = datasets.task_dataset("longtail_arith", 20, seed=5, max_steps=4)
    want = tasks.generate(20, seed=5, max_steps=4)
    assert got == [PromptExample(e.prompt, e.answer) for e in want]
    with pytest.raises(ValueError, match="do not fit task 'longtail_arith'"):
        datasets.task_dataset("longtail_arith", 2, seed=0, bogus=1)
    with pytest.raises(KeyError, match="unknown task"):
        datasets.task_dataset("nope", 2, seed=0)


def test_reasoning_gym_dataset():
    """Prompts are the question plus the <answer> instruction; answers are the reward's JSON."""
    examples = datasets.reasoning_gym_dataset("chain_sum", 3, seed=1, min_terms=2, max_terms=2)
    assert examples == datasets.reasoning_gym_dataset("chain_sum", 3, seed=1, min_terms=2, max_terms=2)
    for ex in examples:
        spec = json.loads(ex.answer)
        assert spec["dataset"] == "chain_sum"
        assert ex.prompt == f"{spec['entry']['question']}\n\n{datasets.ANSWER_INSTRUCTION}"
        assert rewards.reasoning_gym_reward(f"<answer>{spec['entry']['answer']}</answer>", ex.answer) == 1.0
    with pytest.raises(ValueError, match="no dataset 'nope'"):
        datasets.reasoning_gym_dataset("nope", 1, seed=0)
    with pytest.raises(ValueError, match=r"no options \['bogus'\]; its options: .*'min_terms'"):
        datasets.reasoning_gym_dataset("chain_sum", 1, seed=0, bogus=1)


def test_encode_uses_the_chat_prompt():
    """encode gives exactly data.encode_prompts of the prompts (chat template applied)."""
    examples = datasets.task_dataset("longtail_arith", 4, seed=0)
    tokenizer = char_tokenizer(tasks.alphabet)
    ids = datasets.encode(examples, tokenizer)
    assert ids == data.encode_prompts([e.prompt for e in examples], tokenizer)
    assert tokenizer.decode(ids[0]) == f"<bos><|im_start|>user\n{examples[0].prompt}<|im_end|>\n<|im_start|>assistant\n"


# --- sampler -------------------------------------------------------------------------------------

EXAMPLES = [PromptExample(str(i), str(i)) for i in range(10)]


def take(sampler, k):
    return [sampler.next() for _ in range(k)]


def test_sampler_epochs_are_permutations():
    """Each epoch's batches are disjoint, drawn from a fresh permutation; the remainder is dropped."""
    sampler = PromptSampler(EXAMPLES, batch_prompts=3, seed=0)
    epochs = [take(sampler, 3) for _ in range(4)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat)) == 9
    assert len({tuple(map(tuple, e)) for e in epochs}) == 4
    assert next(iter(PromptSampler(EXAMPLES, 3, seed=0))) == [EXAMPLES[i] for i in epochs[0][0]]


def test_sampler_is_deterministic():
    """The same seed gives the same batches; another seed gives others."""
    assert take(PromptSampler(EXAMPLES, 4, seed=1), 7) == take(PromptSampler(EXAMPLES, 4, seed=1), 7)
    assert take(PromptSampler(EXAMPLES, 4, seed=1), 7) != take(PromptSampler(EXAMPLES, 4, seed=2), 7)


@pytest.mark.parametrize("consumed", [0, 2, 3, 7])
def test_sampler_resumes_exactly(consumed):
    """A sampler restored from state() (through JSON) yields exactly the batches that followed,
    across epoch boundaries too."""
    original = PromptSampler(EXAMPLES, 3, seed=4)
    take(original, consumed)
    state = json.loads(json.dumps(original.state()))
    resumed = PromptSampler(EXAMPLES, 3, seed=4)
    resumed.restore(state)
    assert take(resumed, 8) == take(original, 8)


def test_sampler_errors():
    """Bad batch sizes and states from another setup are refused with the mismatch named."""
    with pytest.raises(ValueError, match=r"batch_prompts must be in \[1, 10\]"):
        PromptSampler(EXAMPLES, 11, seed=0)
    state = PromptSampler(EXAMPLES, 3, seed=0).state()
    with pytest.raises(ValueError, match="batch_prompts=3 but this sampler has batch_prompts=2"):
        PromptSampler(EXAMPLES, 2, seed=0).restore(state)
    with pytest.raises(ValueError, match="num_examples=10 but this sampler has num_examples=9"):
        PromptSampler(EXAMPLES[:9], 3, seed=0).restore(state)
