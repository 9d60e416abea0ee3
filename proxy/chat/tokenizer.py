"""A Hugging Face tokenizer directory read without transformers: vocabulary, special tokens, template."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from proxy.errors import ProxyError

# The special-token names transformers hands to a chat template as variables.
_TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerLoadError(ProxyError):
    """The tokenizer directory is missing a file or holds something we cannot use."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(frozen=True)
class TokenizerFiles:
    """What a tokenizer directory says, read once at start-up."""

    directory: Path
    tokenizer: Tokenizer
    chat_template: str
    special_tokens: dict[str, str]
    add_bos_token: bool

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


def _chat_template_from(directory: Path, config: dict[str, Any]) -> str:
    # Newer checkpoints keep the template in its own file; it wins over the config, as in transformers.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        # Named templates: the one called "default" is what apply_chat_template uses.
        for entry in template:
            if (
                isinstance(entry, dict)
                and entry.get("name") == "default"
                and isinstance(entry.get("template"), str)
            ):
                return str(entry["template"])
    raise TokenizerLoadError(
        f"no chat template in {directory} (chat_template.jinja or tokenizer_config.json)"
    )


# Parsing a 150k-token vocabulary takes about half a second; a process that loads the same one again
# (`check-template` then `serve`, an app restarted in-process) reuses it. The proxy never mutates a
# Tokenizer (no truncation, padding or added tokens), so sharing one is safe.
_PARSED: OrderedDict[bytes, Tokenizer] = OrderedDict()
_PARSED_KEPT = 2


def _parsed(tokenizer_json: bytes) -> Tokenizer:
    digest = hashlib.blake2b(tokenizer_json, digest_size=16).digest()
    tokenizer = _PARSED.pop(digest, None) or Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    _PARSED[digest] = tokenizer
    while len(_PARSED) > _PARSED_KEPT:
        _PARSED.popitem(last=False)
    return tokenizer


def load_tokenizer_files(directory: Path) -> TokenizerFiles:
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerLoadError(
            f"{tokenizer_json} not found: --tokenizer must name a Hugging Face tokenizer dir"
        )
    config_file = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
    special_tokens = {}
    for name in _TEMPLATE_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            special_tokens[name] = text
    return TokenizerFiles(
        directory=directory,
        tokenizer=_parsed(tokenizer_json.read_bytes()),
        chat_template=_chat_template_from(directory, config),
        special_tokens=special_tokens,
        add_bos_token=bool(config.get("add_bos_token", False)),
    )
