"""The data that ships with openrecipes: conversations, a small tokenizer and the built-in chat templates."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).with_name("assets")
CONVERSATIONS = ASSETS / "conversations.jsonl"
DOCUMENTS = ASSETS / "documents.jsonl"  # text documents made from the conversations (make_documents.py)
TOKENIZER = ASSETS / "tokenizer"
TEMPLATES = {"qwen3": ASSETS / "templates" / "qwen3.jinja", "muse_spark": ASSETS / "templates" / "muse_spark.jinja"}
BUNDLED = "bundled"  # the recipe's word for these (data.build.input / tokenizer)


def resolve(value: str, bundled: Path) -> Path:
    """A recipe's data path, where ``bundled`` stands for the shipped file."""
    return bundled if value == BUNDLED else Path(value)


def default_input(format: str) -> Path:
    """The bundled input of a build format: conversations for sft, text documents for pretrain."""
    return DOCUMENTS if format == "pretrain" else CONVERSATIONS
