"""Load a Hugging Face tokenizer directory without transformers.

A directory holds ``tokenizer.json`` and, for the chat template, ``chat_template.jinja``
and/or a ``chat_template`` field in ``tokenizer_config.json`` (the .jinja file wins, as in
transformers). Only the ``tokenizers`` library is needed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openrecipes.utils import sha256_file, utf8_problem

BUNDLED_TOKENIZER = Path(__file__).with_name("assets") / "tokenizer"


@dataclass(kw_only=True)
class TokenizerBundle:
    directory: Path
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    chat_template_source: str | None
    config: dict[str, Any]
    file_sha256: dict[str, str] = field(default_factory=dict)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def marker_token_strings(self) -> list[str]:
        """Every added token, special or not: text quoting one would otherwise become that token's id, and a chat
        format gives structure to added tokens that are not marked special (Qwen3's ``<think>``, ``<tool_call>``,
        ``<tool_response>``), so a conversation quoting one could forge reasoning, a call or a tool's result."""
        return sorted(t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.content)

    def marker_pattern(self, keep: tuple[str, ...] = ()) -> re.Pattern[str] | None:
        """The added tokens (but those in ``keep``) as one pattern, longest first (so a token is never cut short by
        a shorter one)."""
        tokens = [t for t in self.marker_token_strings() if t not in keep]
        if not tokens:
            return None
        return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))

    def config_token(self, key: str) -> str | None:
        """``eos_token`` etc. from tokenizer_config.json, given as a string or {"content": ...}."""
        value = self.config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None


def read_utf8(path: Path) -> str:
    """A text file the build reads (a chat template), refused in one line naming it when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: {utf8_problem(error)}") from None


def _template_from_config(config: dict[str, Any], path: Path) -> str | None:
    template = config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                if not isinstance(entry.get("template"), str):  # str() made null the template text "None"
                    raise ValueError(f"{path}: chat_template's 'default' entry has no string 'template'")
                return entry["template"]
        raise ValueError(f"{path}: chat_template is a list without a 'default' entry")
    raise ValueError(f"{path}: chat_template must be a string or a list of named templates")


def _added_tokens_as_special(tokenizer: Any) -> None:
    """Mark every added token special in the loaded tokenizer (the file is left as it is).

    ``encode_special_tokens`` (split_special_tokens) reads as text only the added tokens marked special; the builds
    turn it on to keep a quoted marker text, so every added token must be among them. Encoding with it off is
    unchanged: an added token is matched in the input whether it is special or not."""
    from tokenizers import AddedToken

    plain = [t for t in tokenizer.get_added_tokens_decoder().values() if not t.special]
    if plain:  # re-adding an existing token by its content updates it in place; its id stays
        tokenizer.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip,
                                                 rstrip=t.rstrip, normalized=t.normalized, special=True)
                                      for t in plain])


def load_tokenizer(directory: str | Path) -> TokenizerBundle:
    """Load ``directory``; raise FileNotFoundError / ValueError naming the file at fault."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"--tokenizer: {directory} is not a directory")
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"--tokenizer: {tokenizer_json} not found (a tokenizer directory needs "
                                "tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    except Exception as error:  # the Rust error type is not importable by name
        raise ValueError(f"{tokenizer_json}: cannot load tokenizer: {error}") from error
    hashes = {"tokenizer.json": sha256_file(tokenizer_json)}
    config: dict[str, Any] = {}
    config_path = directory / "tokenizer_config.json"
    for optional in (config_path, directory / "chat_template.jinja"):  # a folder or a pipe there is no such file
        if optional.exists() and not optional.is_file():
            raise ValueError(f"{optional}: not a regular file")
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_path}: line {error.lineno}: invalid JSON: {error.msg}") from error
        except UnicodeDecodeError as error:
            raise ValueError(f"{config_path}: {utf8_problem(error)}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: a tokenizer config is a JSON object, not a {type(config).__name__}")
        hashes["tokenizer_config.json"] = sha256_file(config_path)
    template, source = None, None
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        template, source = read_utf8(jinja_path), str(jinja_path)
        hashes["chat_template.jinja"] = sha256_file(jinja_path)
    elif config:
        template = _template_from_config(config, config_path)
        source = f"{config_path} (chat_template)" if template is not None else None
    _added_tokens_as_special(tokenizer)
    return TokenizerBundle(directory=directory, tokenizer=tokenizer, chat_template=template,
                           chat_template_source=source, config=config, file_sha256=hashes)
