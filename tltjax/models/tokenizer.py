"""One tokenizer class over Hugging Face fast tokenizers, with HF-compatible chat templates.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust model behind every HF "fast" tokenizer)
together with the fields of `tokenizer_config.json` that training and generation need: the
special tokens and the jinja2 chat template. It reads and writes the same files that
`transformers` does, so a directory saved here loads with `transformers.AutoTokenizer` and
gives the same ids and the same rendered chats.

`char_tokenizer` builds a character-level tokenizer for synthetic tasks as a genuine
`tokenizers` model (WordLevel over single characters), so tiny experiments run through exactly
the code path that real checkpoints use.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, processors

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The special-token fields of tokenizer_config.json this class understands. Chat templates see
# each one that is set as a variable of the same name (e.g. `eos_token`), as in transformers.
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")

Message = Mapping[str, Any]


class Tokenizer:
    """A HF fast tokenizer plus its special tokens and chat template.

    Invariants: every special token that is set is in the vocabulary (checked here), and
    `encode`/`decode` are exactly those of the wrapped `tokenizers.Tokenizer`, so ids agree with
    `transformers` loading the same files.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
    ):
        """Wraps `backend`; `extra_config` holds other tokenizer_config.json keys, kept on save."""
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens: dict[str, str | None] = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "pad_token": pad_token,
            "unk_token": unk_token,
        }
        self.extra_config = dict(extra_config or {})
        for field, token in self.special_tokens.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(
                    f"{field} {token!r} is not in the tokenizer's vocabulary (size "
                    f"{self.vocab_size}); add it to tokenizer.json or set {field} to a token "
                    "that the vocabulary has."
                )

    # --- loading and saving ------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads a HF tokenizer directory: tokenizer.json, plus tokenizer_config.json if present.

        Special tokens may be strings or `{"content": ...}` dicts (HF writes both); fields missing
        from the config are taken from special_tokens_map.json. A `chat_template.jinja` file, when
        present, takes precedence over the config's template (as in transformers).
        """
        path = Path(path)
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {str(path)!r}: tltjax loads HF *fast* tokenizers only. "
                "If the directory holds a slow tokenizer (e.g. tokenizer.model), convert it once "
                "with `transformers.AutoTokenizer.from_pretrained(path).save_pretrained(path)`."
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))

        config = _read_json(path / CONFIG_FILE)
        special_map = _read_json(path / SPECIAL_TOKENS_MAP_FILE)
        specials = {}
        for field in SPECIAL_TOKEN_FIELDS:
            value = config.pop(field, None)
            if value is None:
                value = special_map.get(field)
            specials[field] = _token_content(value, field, path)

        chat_template = _select_chat_template(config.pop("chat_template", None), path)
        if (path / CHAT_TEMPLATE_FILE).is_file():
            chat_template = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        return cls(backend, chat_template=chat_template, extra_config=config, **specials)

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Writes tokenizer.json and tokenizer_config.json; `AutoTokenizer` loads the directory."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.extra_config,
            **self.special_tokens,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            if (path / CHAT_TEMPLATE_FILE).is_file():  # transformers reads this file first.
                (path / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
        with open(path / CONFIG_FILE, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")

    # --- ids ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings inside `text` become their single ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; for lossless tokenizers `decode(encode(s)) == s`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None when it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (what `len(hf_tokenizer)` returns)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None (e.g. Qwen has none)."""
        return self._special_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-sequence token: generation stops there."""
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        """Id of the padding token, or None."""
        return self._special_id("pad_token")

    def _special_id(self, field: str) -> int | None:
        token = self.special_tokens[field]
        return None if token is None else self.backend.token_to_id(token)

    # --- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders `messages` with the chat template exactly as `transformers` does.

        The template sees `messages`, `add_generation_prompt`, the special tokens that are set
        (`bos_token`, `eos_token`, ...) and `kwargs`, which override them. With `tokenize=True`
        the rendered text is encoded without adding special tokens, as in transformers.
        """
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template: set `Tokenizer.chat_template` to a jinja2 "
                f"template string, or add a 'chat_template' entry to {CONFIG_FILE}."
            )
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise TypeError(
                    f"messages[{i}] is {message!r}; each message must be a dict with a 'role' "
                    "(and usually a 'content'), e.g. {'role': 'user', 'content': 'hi'}."
                )
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        text = _compile_template(self.chat_template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        specials = ", ".join(f"{k}={v!r}" for k, v in self.special_tokens.items() if v is not None)
        return f"Tokenizer(vocab_size={self.vocab_size}, {specials})"


# --- chat template rendering: the sandbox transformers uses ------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's built-in `tojson` HTML-escapes; chat templates expect plain JSON (as transformers).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    """Compiles a chat template in a sandbox configured like transformers' renderer."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


# --- config helpers ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not valid JSON ({e}); fix or delete it.") from e


def _token_content(value: Any, field: str, path: Path) -> str | None:
    """A special token as HF writes it (a string, or a dict with "content") -> the string."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{field} in {str(path / CONFIG_FILE)!r} is {value!r}; expected a string or a dict with "
        "a string 'content' key."
    )


def _select_chat_template(value: Any, path: Path) -> str | None:
    """HF allows one template string or a list of named ones; tltjax uses the 'default' one."""
    if value is None or isinstance(value, str):
        return value
    source = str(path / CONFIG_FILE)
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"]
        raise ValueError(
            f"chat_template in {source!r} lists templates {sorted(map(str, named))} but none is "
            "named 'default'; set `Tokenizer.chat_template` to the one you want."
        )
    raise ValueError(
        f"chat_template in {source!r} has type {type(value).__name__}; expected a string or a "
        "list of {'name': ..., 'template': ...} dicts."
    )


# --- character-level tokenizer -----------------------------------------------------------------

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAR_SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)  # ids 0..5, in this order.
CHAT_ROLES = ("system", "user", "assistant")

# A minimal Qwen-style (ChatML) template: one `<|im_start|>role\ncontent<|im_end|>\n` block per
# message, then `<|im_start|>assistant\n` when a generation prompt is asked for.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def char_tokenizer(
    alphabet: str,
    *,
    chat_template: str | None = CHATML_TEMPLATE,
    roles: Sequence[str] = CHAT_ROLES,
) -> Tokenizer:
    """A character-level `Tokenizer`: every character is one token.

    Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, `<|im_start|>`=4, `<|im_end|>`=5, then the
    distinct characters of `alphabet`, '\\n', ' ' and of the role names (so that chat-formatted
    text never hits `<unk>`), in order of first appearance.

    Invariants: each of those characters encodes to exactly one id, and `decode(encode(s)) == s`
    for any string `s` over them. `encode(s, add_special_tokens=True)` prepends `<bos>`. It is a
    real WordLevel `tokenizers` model, so `save_pretrained` writes a genuine HF tokenizer.json.
    """
    chars = list(dict.fromkeys(alphabet + "\n " + "".join(roles)))
    vocab = {token: i for i, token in enumerate((*CHAR_SPECIAL_TOKENS, *chars))}

    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Every character (newlines included) is its own pre-token; decoding joins them unspaced.
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIAL_TOKENS]
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return Tokenizer(
        backend,
        chat_template=chat_template,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
    )
