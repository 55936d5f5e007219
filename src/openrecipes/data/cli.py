"""``openrecipes data``: build fixed-length SFT or pretraining rows (docs/data.md).

The flags of ``data build`` that describe the rows are the fields of the recipe's ``data.build`` section
(config/recipe.py: ``DataBuild``): their choices and defaults are read from it, and the flags given are validated by
it, so the command line and a recipe accept the same builds.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from openrecipes.config.recipe import DataBuild, data_build_flag as flag

# help for each flag of a DataBuild field (its choices and default come from the field)
_HELP = {
    "input": "JSON Lines or Parquet file with a 'messages' (sft) or 'text' (pretrain) column, a local Hugging Face "
             "dataset directory, or (pretrain) a Megatron indexed dataset PREFIX[.bin|.idx]; bundled: the bundled "
             "conversations, or documents made from them; bundled-images: the bundled image-text conversations",
    "format": "sft: conversations with a loss mask; pretrain: documents, every target supervised",
    "tokenizer": "Hugging Face tokenizer directory; bundled: the bundled 1,024-token tokenizer (bundled-vl, "
                 "bundled-muse-vl: with image tokens)",
    "loss_mask": "sft: which tokens are supervised, by chat format (assistant turns only; docs/data.md)",
    "row_tokens": "tokens per row",
    "rows": "rows to keep (default: every full row the input yields); too few is an error",
    "seed": "seed of the record permutation",
    "template_kwargs": "sft: extra chat-template variables, e.g. current_date=2026-10-01 reasoning_effort=xhigh "
                       "(true/false become booleans); strftime_now=YYYY-MM-DD: the date strftime_now() renders",
    "chat_template": "sft: template file or built-in name instead of the tokenizer's: qwen3 (renders the text of "
                     "Qwen3's own template; differences in docs/data.md) or muse_spark",
    "eos_token": "token appended after each conversation or document (default: the loss-mask format's for sft, "
                 "the tokenizer's eos_token for pretrain)",
    "max_conversation_tokens": "sft: a conversation of more than N tokens (its separator not counted) is skipped or "
                               "truncated (--too-long); the manifest records the limit and counts them",
    "too_long": "with --max-conversation-tokens: skip such a conversation or keep its first N tokens",
    "input_shape": "sft: openai: role/content messages; sharegpt: from/value turns (human, gpt, system, "
                   "function_call, observation, tool)",
    "messages_field": "sft: the column or key holding the conversation (default: messages; conversations with "
                      "--input-shape sharegpt)",
    "role_map": "sft: rename roles before the check, e.g. developer=system,function=tool,ipython=tool",
    "special_tokens_in_text": "an added token of the tokenizer (special or not: <|im_end|>, <think>, "
                              "<tool_response>...) inside a conversation's or document's own text: tokenized as "
                              "text, never a turn or tool-result marker nor a document's end, but a reply's own "
                              "<think>/<tool_call> markers keep their ids as apply_chat_template makes them (text); "
                              "that input is refused (refuse); every one text, a reply's markers too "
                              "(text_everywhere)",
    "image_processor": "sft: read image parts ({\"type\": \"image\", \"image\": \"local/path.png\"}), sized as this "
                       "preprocessor_config.json (or a directory holding one) says; bundled: the bundled image-text "
                       "set's (default: image parts are refused)",
}
_METAVAR = {"template_kwargs": "K=V", "max_conversation_tokens": "N", "role_map": "FROM=TO,...",
            "image_processor": "FILE|DIR|bundled", "messages_field": "NAME"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("data", help="build fixed-length packed rows (SFT or pretraining)",
                                   description="Build fixed-length packed rows from conversations (SFT) or "
                                               "documents (pretraining).")
    verbs = parser.add_subparsers(dest="data_verb", metavar="SUBCOMMAND")
    build = verbs.add_parser(
        "build", help="conversations or documents -> rows.parquet + manifest.json",
        description="SFT: render conversations with a chat template and mask all but the assistant turns; "
                    "pretrain: tokenize documents (text, or a Megatron indexed dataset) and supervise every "
                    "target within a document. Pack them into rows of exactly --row-tokens tokens, and write "
                    "rows.parquet and manifest.json into --out (atomically). The flags are the recipe's data.build "
                    "keys.")
    _add_spec_arguments(build)
    build.add_argument("--name", default=None, help="dataset name in the manifest (default: --out's name)")
    build.add_argument("--skip-invalid", action="store_true",
                       help="count and skip invalid conversations instead of failing on the first; the summary "
                            "and the manifest count them by reason, with where the first ones are")
    build.add_argument("--overwrite", action="store_true", help="replace an earlier output of data build at --out "
                       "(never another directory)")
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    build.add_argument("--out", required=True, help="output directory")
    build.set_defaults(func=_build)
    parser.set_defaults(func=lambda args: _missing(parser))


def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``DataBuild`` field (``input`` positional); a flag not given is absent from the namespace, so
    the model's default applies."""
    for name, field in DataBuild.model_fields.items():
        choices = _choices(field.annotation)
        default = field.get_default(call_default_factory=True)
        shown = "" if field.is_required() or default in (None, {}, []) else f" (default: {default})"
        options: dict[str, Any] = dict(default=argparse.SUPPRESS, help=_HELP[name] + shown, dest=name)
        if choices:
            options["choices"] = choices
        if name == "template_kwargs":
            options["nargs"] = "*"
        elif _is_int(field.annotation):
            options["type"] = int
        if name in _METAVAR:
            options["metavar"] = _METAVAR[name]
        if name == "input":
            options.pop("dest")
            parser.add_argument(name, nargs="?", **options)
        else:
            parser.add_argument(flag(name), required=field.is_required(), **options)


def _choices(annotation: Any) -> list[str] | None:
    args = [annotation, *(typing.get_args(annotation) if _is_optional(annotation) else ())]  # X, or X | None
    literal = next((a for a in args if typing.get_origin(a) is typing.Literal), None)
    return list(typing.get_args(literal)) if literal is not None else None


def _is_optional(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _is_int(annotation: Any) -> bool:
    return annotation is int or (_is_optional(annotation) and int in typing.get_args(annotation))


def spec_from_args(args: argparse.Namespace) -> DataBuild:
    """The ``DataBuild`` the flags given describe; a bad value is one line per problem naming its flag."""
    from openrecipes.data.chat_input import parse_role_map
    from openrecipes.data.templates import parse_template_kwargs

    given = {name: getattr(args, name) for name in DataBuild.model_fields if hasattr(args, name)}
    if "template_kwargs" in given:
        given["template_kwargs"] = parse_template_kwargs(given["template_kwargs"])
    if "role_map" in given:
        given["role_map"] = parse_role_map(given["role_map"])
    try:
        return DataBuild.model_validate(given)
    except ValidationError as error:
        raise ValueError("\n".join(_flag_error(item) for item in error.errors())) from None


def _flag_error(item: dict[str, Any]) -> str:
    loc = item["loc"]
    message = re.sub(r"^Value error, ", "", item["msg"])
    if loc:
        return f"{flag(str(loc[0]))}: {message}"
    # a check across fields names them by key: name them by flag here
    return re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: flag(m.group(0)) if m.group(0) in DataBuild.model_fields
                  else m.group(0), message)


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _build(args: argparse.Namespace) -> int:
    from openrecipes.data.build import build

    # build() refuses an --out it may not replace
    manifest = build(spec_from_args(args), Path(args.out), name=args.name, skip_invalid=args.skip_invalid,
                     overwrite=args.overwrite, progress=not args.no_progress)
    summary = {key: manifest[key] for key in ("name", "rows", "row_tokens", "supervised_token_ratio",
                                              "rows_sha256", "parquet_sha256")}
    counts = manifest.get("counts", {})
    summary["skipped"] = skipped_summary(manifest)
    summary["tokens_in_rows_without_a_supervised_token"] = counts.get("tokens_in_rows_skipped_unsupervised", 0)
    print(json.dumps(summary, indent=2))
    return 0


def skipped_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """How many records were skipped and why: {"total": N, "<reason>": {"count": n, "first": [where, ...]}}."""
    reasons = manifest.get("invalid_reasons") or {}
    return {"total": sum(entry["count"] for entry in reasons.values()), **reasons}
