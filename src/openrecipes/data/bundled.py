"""The data that ships with openrecipes: conversations, a small tokenizer and the built-in chat templates."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).with_name("assets")
CONVERSATIONS = ASSETS / "conversations.jsonl"
DOCUMENTS = ASSETS / "documents.jsonl"  # text documents made from the conversations (make_documents.py)
TOKENIZER = ASSETS / "tokenizer"
TEMPLATES = {"qwen3": ASSETS / "templates" / "qwen3.jinja", "muse_spark": ASSETS / "templates" / "muse_spark.jinja"}
BUNDLED = "bundled"  # the recipe's word for these (data.build.input / tokenizer / image_processor)
# the image-text set (image_text/, made by image_text/make_image_text.py): conversations about small generated
# images, the bundled tokenizer with Qwen3-VL's image tokens added (and one with Muse Spark's), and a preprocessor
# config for tiny images
IMAGE_TEXT = ASSETS / "image_text"
IMAGE_CONVERSATIONS = IMAGE_TEXT / "conversations.jsonl"
VL_TOKENIZER = IMAGE_TEXT / "tokenizer"
MUSE_VL_TOKENIZER = IMAGE_TEXT / "muse_spark_tokenizer"
IMAGE_PROCESSOR = IMAGE_TEXT / "preprocessor_config.json"
BUNDLED_IMAGES = "bundled-images"  # data.build.input: the image-text conversations
BUNDLED_VL = "bundled-vl"  # data.build.tokenizer: the tokenizer with Qwen3-VL's image tokens
BUNDLED_MUSE_VL = "bundled-muse-vl"  # data.build.tokenizer: the tokenizer with Muse Spark's image tokens


def resolve(value: str, bundled: Path) -> Path:
    """A recipe's data path, where ``bundled`` stands for the shipped file."""
    return bundled if value == BUNDLED else Path(value)


def resolve_input(value: str, format: str) -> Path:
    """data.build.input: ``bundled``, ``bundled-images`` or a path."""
    return IMAGE_CONVERSATIONS if value == BUNDLED_IMAGES else resolve(value, default_input(format))


def resolve_tokenizer(value: str) -> Path:
    """data.build.tokenizer: ``bundled``, ``bundled-vl``, ``bundled-muse-vl`` or a directory."""
    return {BUNDLED_VL: VL_TOKENIZER, BUNDLED_MUSE_VL: MUSE_VL_TOKENIZER}.get(value) or resolve(value, TOKENIZER)


def default_input(format: str) -> Path:
    """The bundled input of a build format: conversations for sft, text documents for pretrain."""
    return DOCUMENTS if format == "pretrain" else CONVERSATIONS
