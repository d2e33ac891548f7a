"""Tests for tltjax/data.py: SFT rows, masks, skipping and prompt parity with generation."""

import numpy as np
import pytest

from tltjax.data import encode_prompts, sft_batches
from tltjax.models.tokenizer import char_tokenizer
from tltjax.rl import tasks


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(tasks.alphabet)


def test_rows_are_prompt_prefix_response_eos_then_padding(tokenizer):
    """Each row is encode_prompts' prefix + response + <eos>, right-padded; the loss mask is 1
    exactly on response tokens and <eos>."""
    examples = tasks.generate(16, seed=0, max_steps=4)
    batches = sft_batches(examples, tokenizer, batch_size=16, seq_len=128, seed=0)
    (batch,) = list(batches)
    assert batch["tokens"].dtype == np.int32 and batch["tokens"].shape == (16, 128)
    assert batch["loss_mask"].dtype == np.float32 and batch["loss_mask"].shape == (16, 128)
    assert batches.num_skipped == 0

    by_prompt = {ex.prompt: ex for ex in examples}
    for tokens, mask in zip(batch["tokens"], batch["loss_mask"]):
        ex = by_prompt[tokenizer.decode(tokens).split("user\n")[1].split("<|im_end|>")[0]]
        (prompt,) = encode_prompts([ex.prompt], tokenizer)
        assert prompt[0] == tokenizer.bos_id and prompt.count(tokenizer.bos_id) == 1
        chat = f"<|im_start|>user\n{ex.prompt}<|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.decode(prompt) == "<bos>" + chat
        target = tokenizer.encode(ex.response) + [tokenizer.eos_id]
        n = len(prompt) + len(target)
        np.testing.assert_array_equal(tokens[:n], prompt + target)
        assert (tokens[n:] == tokenizer.pad_id).all()
        np.testing.assert_array_equal(mask, [0] * len(prompt) + [1] * len(target) + [0] * (128 - n))


def test_too_long_examples_are_skipped_and_counted_not_truncated(tokenizer):
    """Examples longer than seq_len are dropped and counted; every kept row ends in <eos>."""
    examples = tasks.generate(400, seed=1)
    seq_len = 96
    lengths = [len(p) + len(tokenizer.encode(ex.response)) + 1
               for ex, p in zip(examples, encode_prompts([e.prompt for e in examples], tokenizer))]
    batches = sft_batches(examples, tokenizer, batch_size=8, seq_len=seq_len, seed=0)
    assert batches.num_skipped == sum(n > seq_len for n in lengths) > 0
    for batch in batches:
        last = batch["loss_mask"].shape[1] - 1 - np.argmax(batch["loss_mask"][:, ::-1], axis=1)
        np.testing.assert_array_equal(batch["tokens"][np.arange(8), last], tokenizer.eos_id)


def test_batches_are_deterministic_and_epochs_cover_each_row_once(tokenizer):
    """Same seed, same batches; each epoch visits distinct rows; epochs=None keeps going."""
    examples = tasks.generate(40, seed=2, max_steps=6)
    make = lambda **kw: sft_batches(examples, tokenizer, batch_size=8, seq_len=128, **kw)
    a, b = list(make(seed=5, epochs=2)), list(make(seed=5, epochs=2))
    assert len(a) == len(make(seed=5, epochs=2)) == 10
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    for epoch in (a[:5], a[5:]):
        rows = np.concatenate([x["tokens"] for x in epoch])
        assert sorted(r.tobytes() for r in rows) == sorted(r.tobytes() for r in make(seed=0).tokens)
    infinite = iter(make(seed=5, epochs=None))
    assert len([next(infinite) for _ in range(25)]) == 25


def test_too_few_fitting_examples_is_a_clear_error(tokenizer):
    """If fewer examples fit than one batch needs, the error says how many fit and what to do."""
    with pytest.raises(ValueError, match="only 0 of 4 examples fit in seq_len=8"):
        sft_batches(tasks.generate(4, seed=0), tokenizer, batch_size=2, seq_len=8, seed=0)


def test_bos_is_not_doubled_when_the_template_writes_it():
    """A template that emits <bos> itself (as Llama 3's does) gets no second <bos>."""
    template = "{{ bos_token }}{{ messages[0]['content'] }}"
    tok = char_tokenizer(tasks.alphabet, chat_template=template)
    (prompt,) = encode_prompts(["1 +2"], tok)
    assert prompt == [tok.bos_id, *tok.encode("1 +2")]
