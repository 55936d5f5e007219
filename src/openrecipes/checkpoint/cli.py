"""`openrecipes convert import|export|audit`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face and native formats",
                                   description="Convert between Hugging Face safetensors and native "
                                               "torch.distributed.checkpoint directories, and audit checkpoints.")
    verbs = parser.add_subparsers(dest="convert_verb", metavar="ACTION", required=True)

    imp = verbs.add_parser("import", help="HF safetensors directory -> native DCP directory",
                           description="Read a Hugging Face directory (config.json, safetensors) into a native "
                                       "torch.distributed.checkpoint directory, tensor by tensor.")
    imp.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    imp.add_argument("ckpt_dir", help="native checkpoint directory to write")
    imp.add_argument("--overwrite", action="store_true", help="replace CKPT_DIR if it exists")
    imp.add_argument("--full", action="store_true",
                     help="full-checkpoint mode: every tensor, the perception towers and their adapters as well as "
                          "the text model (Muse Spark); without it (text-only mode) a Muse Spark checkpoint's "
                          "towers are skipped and counted. Models without a text-only mode are always imported whole")
    imp.set_defaults(func=_import)

    exp = verbs.add_parser("export", help="native or training checkpoint -> HF safetensors directory",
                           description="Write a Hugging Face directory (config.json, safetensors shards) from a "
                                       "native checkpoint (`convert import` output) or from a training save "
                                       "(RUN_DIR/checkpoints/step-NNNNNN, any layout); a training save's export "
                                       "also gets the tokenizer files its rows were built with and the source "
                                       "model's generation_config.json.")
    exp.add_argument("ckpt_dir", help="native checkpoint directory, or a training save RUN_DIR/checkpoints/step-N")
    exp.add_argument("hf_dir", help="Hugging Face directory to write")
    exp.add_argument("--max-shard-gib", type=float, default=5.0, help="largest safetensors shard (default 5)")
    exp.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it exists")
    exp.add_argument("--dtypes", choices=("source", "native"), default="source",
                     help="source (default): each tensor in the dtype the imported checkpoint had, so tensors "
                          "promoted to fp32 on import go back bitwise; for a training save, the dtype the recipe "
                          "trains it in (bf16 recipes: bf16 except the fp32-pinned tensors); native: the dtypes "
                          "the checkpoint holds (promoted tensors, and the fp32 masters of data-parallel runs, "
                          "stay fp32)")
    exp.add_argument("--expert-layout", choices=("fused", "per_expert"), default=None,
                     help="fused: two 3-D tensors per layer (gate_up_proj, down_proj); per_expert: one tensor per "
                          "expert and projection (default: the layout the imported checkpoint had, else the "
                          "model family's: fused for Muse Spark, per_expert for Qwen3-MoE)")
    exp.set_defaults(func=_export)

    aud = verbs.add_parser("audit", help="compare two HF checkpoint directories tensor by tensor",
                           description="Exit status 0 only when both hold the same keys, shapes and dtypes and "
                                       "every value agrees within --atol. Every tensor of both is compared (towers "
                                       "included): none is skipped.")
    aud.add_argument("a_dir", help="first Hugging Face directory")
    aud.add_argument("b_dir", help="second Hugging Face directory")
    aud.add_argument("--atol", type=float, default=0.0, help="allowed max abs difference (default 0: bitwise)")
    aud.add_argument("--json", action="store_true", help="print JSON instead of a table")
    aud.set_defaults(func=_audit)

    merge = verbs.add_parser("merge-lora", help="HF base + PEFT LoRA adapter -> merged HF safetensors directory",
                             description="Write base + (alpha / r) · B A for every adapted weight as a Hugging Face "
                                         "checkpoint directory that transformers loads.")
    merge.add_argument("base", help="Hugging Face checkpoint directory of the base model")
    merge.add_argument("adapter", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    merge.add_argument("--out", required=True, help="output directory")
    merge.add_argument("--overwrite", action="store_true", help="replace an earlier output at --out")
    merge.set_defaults(func=_merge_lora)


def _merge_lora(args: argparse.Namespace) -> int:
    from openrecipes.checkpoint.lora import merge_lora

    summary = merge_lora(args.base, args.adapter, args.out, overwrite=args.overwrite)
    print(json.dumps(summary, indent=2))
    return 0


def _import(args: argparse.Namespace) -> int:
    from openrecipes.checkpoint.native import import_hf

    manifest = import_hf(args.hf_dir, args.ckpt_dir, overwrite=args.overwrite, full=args.full)
    promoted = f" ({len(manifest['promoted'])} promoted to fp32, values unchanged)" if manifest["promoted"] else ""
    skipped = f"; {manifest['skipped']} tower tensor(s) skipped (text-only mode)" if manifest["skipped"] else ""
    print(f"wrote {len(manifest['tensors'])} native tensors to {args.ckpt_dir}{promoted}{skipped}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from openrecipes.checkpoint.native import MANIFEST, export_hf
    from openrecipes.checkpoint.training_export import export_training_checkpoint
    from openrecipes.checkpoint.training_save import run_dir_of

    if not (Path(args.ckpt_dir) / MANIFEST).is_file() and run_dir_of(args.ckpt_dir) is not None:
        export_training_checkpoint(args.ckpt_dir, args.hf_dir, max_shard_bytes=int(args.max_shard_gib * 2**30),
                                   overwrite=args.overwrite, dtypes=args.dtypes, expert_layout=args.expert_layout)
        print(f"wrote Hugging Face checkpoint to {args.hf_dir}")
        return 0
    export_hf(args.ckpt_dir, args.hf_dir, max_shard_bytes=int(args.max_shard_gib * 2**30), overwrite=args.overwrite,
              dtypes=args.dtypes, expert_layout=args.expert_layout)
    print(f"wrote Hugging Face checkpoint to {args.hf_dir}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from openrecipes.checkpoint.audit import audit

    report = audit(args.a_dir, args.b_dir)
    print(json.dumps(report.to_dict(args.atol), indent=2) if args.json else report.table(args.atol))
    return 0 if report.passed(args.atol) else 1
