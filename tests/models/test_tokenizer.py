"""Tests for tltjax/models/tokenizer.py: char tokenizer invariants and parity with transformers."""

import json
import string

import jinja2
import numpy as np
import pytest
import transformers

from tltjax.models.tokenizer import CHATML_TEMPLATE, Tokenizer, char_tokenizer

ALPHABET = "0123456789+-*=#"

# A Qwen-like ChatML template with a default system prompt, written for these tests.
CHATML_WITH_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CHAT = [{"role": "user", "content": "12 +3 *2"}, {"role": "assistant", "content": "12+3=15\n#30"}]


def random_strings(chars, n=50, max_len=40, seed=0):
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(chars), size=rng.integers(0, max_len))) for _ in range(n)]


@pytest.fixture(scope="module")
def char_tok():
    return char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def saved(char_tok, tmp_path_factory):
    """(our tokenizer, transformers tokenizer) for the char tokenizer saved to disk."""
    path = tmp_path_factory.mktemp("char_tok")
    char_tok.save_pretrained(path)
    return char_tok, transformers.AutoTokenizer.from_pretrained(path)


def test_char_tokenizer_one_id_per_char_and_round_trip(char_tok):
    """Every alphabet character, '\\n' and ' ' is exactly one distinct id; decode∘encode = id."""
    chars = ALPHABET + "\n "
    ids = [char_tok.encode(c) for c in chars]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(chars)
    assert char_tok.token_to_id("<unk>") not in {i[0] for i in ids}
    for s in random_strings(chars):
        encoded = char_tok.encode(s)
        assert len(encoded) == len(s)
        assert char_tok.decode(encoded) == s


def test_char_tokenizer_special_ids(char_tok):
    """<pad> is id 0; specials are single distinct ids; add_special_tokens prepends <bos>."""
    assert char_tok.pad_id == 0 == char_tok.token_to_id("<pad>")
    specials = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
    ids = [char_tok.token_to_id(t) for t in specials]
    assert None not in ids and len(set(ids)) == len(ids)
    assert (char_tok.bos_id, char_tok.eos_id) == (ids[1], ids[2])
    assert char_tok.encode("<|im_start|>12<|im_end|>") == [ids[3], *char_tok.encode("12"), ids[4]]
    with_bos = char_tok.encode("12", add_special_tokens=True)
    assert with_bos == [char_tok.bos_id, *char_tok.encode("12")]
    assert char_tok.decode([char_tok.bos_id, *char_tok.encode("1 2"), char_tok.eos_id],
                           skip_special_tokens=True) == "1 2"
    assert char_tok.vocab_size == max(char_tok.backend.get_vocab().values()) + 1


def test_saved_char_tokenizer_matches_transformers(saved):
    """transformers loads the saved char tokenizer and agrees on ids, specials and chat text."""
    ours, hf = saved
    assert len(hf) == ours.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert hf.pad_token_id == ours.pad_id
    for s in random_strings(ALPHABET + "\n ", seed=1) + ["<|im_start|>user\n1+1<|im_end|><eos>"]:
        assert ours.encode(s) == hf.encode(s, add_special_tokens=False)
        assert ours.encode(s, add_special_tokens=True) == hf.encode(s, add_special_tokens=True)
        assert ours.decode(ours.encode(s)) == hf.decode(hf.encode(s, add_special_tokens=False))
    for messages, gen in [(CHAT[:1], True), (CHAT, False)]:
        text = ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        hf_ids = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
        ids = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
        assert ids == hf_ids["input_ids"]
    assert text == (
        "<|im_start|>user\n12 +3 *2<|im_end|>\n<|im_start|>assistant\n12+3=15\n#30<|im_end|>\n"
    )


def test_chatml_with_system_message_matches_transformers(tmp_path):
    """A ChatML template with a (default or given) system message renders as transformers does."""
    ours = char_tokenizer(string.ascii_letters + string.digits + ".,!?+-*=#",
                          chat_template=CHATML_WITH_SYSTEM)
    ours.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with_system = [{"role": "system", "content": "Answer with a number."}, *CHAT,
                   {"role": "user", "content": "And 7 *3?"}]
    for messages in (with_system, CHAT[:1]):
        text = ours.apply_chat_template(messages)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(messages, tokenize=True) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_from_pretrained_round_trip_and_dict_special_tokens(char_tok, tmp_path):
    """Saving then loading keeps ids, specials and template; {"content": ...} tokens are read."""
    char_tok.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.special_tokens == char_tok.special_tokens
    assert loaded.chat_template == char_tok.chat_template == CHATML_TEMPLATE
    assert loaded.encode("12+3=15\n") == char_tok.encode("12+3=15\n")

    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True, "lstrip": False}
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(tmp_path).eos_id == char_tok.token_to_id("<|im_end|>")


def test_loads_a_directory_saved_by_transformers(saved, tmp_path):
    """A directory that transformers wrote (template in chat_template.jinja) loads back intact."""
    ours, hf = saved
    hf.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == ours.chat_template
    assert loaded.special_tokens == ours.special_tokens
    assert loaded.apply_chat_template(CHAT, tokenize=True) == ours.apply_chat_template(CHAT, tokenize=True)


def test_clear_errors(char_tok, tmp_path):
    """A directory without tokenizer.json, a tokenizer without a template, and an unknown
    special token each raise an error that names the problem."""
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        Tokenizer.from_pretrained(tmp_path)
    no_template = Tokenizer(char_tok.backend, eos_token="<eos>")
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(CHAT)
    with pytest.raises(ValueError, match="'<nope>' is not in the tokenizer's vocabulary"):
        Tokenizer(char_tok.backend, eos_token="<nope>")
