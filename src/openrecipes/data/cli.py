"""``openrecipes data``: build fixed-length SFT rows (docs/data.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from openrecipes.data import bundled
from openrecipes.data.chat_input import SHAPES, SPECIAL_TOKEN_POLICIES
from openrecipes.data.stream import TOO_LONG
from openrecipes.data.templates import LOSS_MASKS



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
                    "rows.parquet and manifest.json into --out (atomically).")
    build.add_argument("input", nargs="?", default=None,
                       help="JSON Lines or Parquet file with a 'messages' (sft) or 'text' (pretrain) column, a "
                            "local Hugging Face dataset directory, or (pretrain) a Megatron indexed dataset "
                            "PREFIX[.bin|.idx] (default: the bundled conversations, or documents made from them)")
    build.add_argument("--format", default="sft", choices=["sft", "pretrain"],
                       help="sft: conversations with a loss mask; pretrain: documents, every target supervised")
    build.add_argument("--tokenizer", default=str(bundled.TOKENIZER),
                       help="Hugging Face tokenizer directory (default: the bundled 1,024-token tokenizer)")
    build.add_argument("--loss-mask", default=None, choices=list(LOSS_MASKS),
                       help="which tokens are supervised, by chat format (assistant turns only; docs/data.md); "
                            "required with --format sft")
    build.add_argument("--row-tokens", type=int, required=True, help="tokens per row")
    build.add_argument("--rows", type=int, default=None,
                       help="rows to keep (default: every full row the input yields); too few is an error")
    build.add_argument("--seed", type=int, default=42, help="seed of the conversation permutation")
    build.add_argument("--template-kwargs", nargs="*", default=[], metavar="K=V",
                       help="extra chat-template variables, e.g. current_date=2026-10-01 reasoning_effort=xhigh")
    build.add_argument("--chat-template", default=None,
                       help="template file or built-in name instead of the tokenizer's: qwen3 (renders the text of "
                            "Qwen3's own template; differences in docs/data.md) or muse_spark")
    build.add_argument("--eos-token", default=None,
                       help="token appended after each conversation or document (default: the loss-mask "
                            "format's for sft, the tokenizer's eos_token for pretrain)")
    build.add_argument("--max-conversation-tokens", type=int, default=None, metavar="N",
                       help="sft: a conversation of more than N tokens (its separator not counted) is skipped or "
                            "truncated (--too-long); the manifest records the limit and counts them")
    build.add_argument("--too-long", default="skip", choices=TOO_LONG,
                       help="with --max-conversation-tokens: skip such a conversation (default) or keep its first "
                            "N tokens")
    build.add_argument("--name", default=None, help="dataset name in the manifest (default: --out's name)")
    build.add_argument("--skip-invalid", action="store_true",
                       help="count and skip invalid conversations instead of failing on the first; the summary "
                            "and the manifest count them by reason, with where the first ones are")
    build.add_argument("--input-shape", choices=SHAPES, default="openai",
                       help="openai: role/content messages; sharegpt: from/value turns (human, gpt, system, "
                            "function_call, observation, tool)")
    build.add_argument("--messages-field", metavar="NAME",
                       help="the column or key holding the conversation (default: messages; conversations with "
                            "--input-shape sharegpt)")
    build.add_argument("--role-map", metavar="FROM=TO,...",
                       help="rename roles before the check, e.g. developer=system,function=tool,ipython=tool "
                            "(default: none)")
    build.add_argument("--special-tokens-in-text", choices=SPECIAL_TOKEN_POLICIES, default="text",
                       help="an added token of the tokenizer (special or not: <|im_end|>, <think>, "
                            "<tool_response>...) inside a conversation's or document's own text: tokenized as text, "
                            "never a turn, reasoning or tool marker nor a document's end (text), or that input is "
                            "refused (refuse)")
    build.add_argument("--image-processor", default=None, metavar="FILE|DIR|bundled",
                       help="sft: read image parts ({\"type\": \"image\", \"image\": \"local/path.png\"}), sized as "
                            "this preprocessor_config.json (or a directory holding one) says; bundled: the bundled "
                            "image-text set's (default: image parts are refused)")
    build.add_argument("--overwrite", action="store_true", help="replace an earlier output of data build at --out "
                       "(never another directory)")
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    build.add_argument("--out", required=True, help="output directory")
    build.set_defaults(func=_build)
    parser.set_defaults(func=lambda args: _missing(parser))


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _build(args: argparse.Namespace) -> int:
    from openrecipes.data.build import BuildConfig, build
    from openrecipes.data.chat_input import ChatInput, parse_role_map
    from openrecipes.data.templates import parse_template_kwargs

    out = Path(args.out)  # build() refuses an --out it may not replace
    config = BuildConfig(
        input=Path(args.input or bundled.default_input(args.format)), tokenizer=Path(args.tokenizer),
        format=args.format, loss_mask=args.loss_mask,
        row_tokens=args.row_tokens, rows=args.rows, seed=args.seed,
        template_kwargs=parse_template_kwargs(args.template_kwargs), chat_template=args.chat_template,
        eos_token=args.eos_token, max_conversation_tokens=args.max_conversation_tokens, too_long=args.too_long,
        name=args.name, skip_invalid=args.skip_invalid, overwrite=args.overwrite,
        image_processor=None if args.image_processor is None else bundled.resolve(args.image_processor,
                                                                                  bundled.IMAGE_PROCESSOR),
        progress=not args.no_progress, out=out,
        chat_input=ChatInput(shape=args.input_shape, messages_field=args.messages_field,
                             role_map=parse_role_map(args.role_map), special_tokens=args.special_tokens_in_text))
    if args.format != "sft" and (args.messages_field or args.role_map or args.input_shape != "openai"):
        raise ValueError("--input-shape, --messages-field and --role-map apply to --format sft only")
    manifest = build(config)
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
