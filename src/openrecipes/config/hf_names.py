"""Hugging Face training argument names (transformers' TrainingArguments, TRL's SFTConfig) and PEFT's LoraConfig
names a recipe does not take, each with what the recipe calls the setting. A key a recipe refuses as unknown (in the
YAML or through --set) gets this hint in the error (config/recipe.py), wherever in the tree it was written."""

from __future__ import annotations

_BATCH = ("global_batch (rows per optimizer step, over all ranks; the layout sets the rows per microbatch: "
          "layout.max_tokens_per_gpu, layout.rows_per_microbatch)")
_ROW_TOKENS = "data.build.row_tokens (every row is exactly that many tokens: conversations are packed, never padded)"

HF_TRAINING_NAMES: dict[str, str] = {
    "learning_rate": "optimizer.lr",
    "num_train_epochs": "epochs (passes over data.build.rows, turned into steps), or steps",
    "max_steps": "steps",
    "warmup_steps": "optimizer.warmup_fraction (the share of steps that warm up, from 0 to 1)",
    "warmup_ratio": "optimizer.warmup_fraction",
    "per_device_train_batch_size": _BATCH,
    "train_batch_size": _BATCH,
    "gradient_accumulation_steps": _BATCH,
    "max_seq_length": _ROW_TOKENS,
    "max_length": _ROW_TOKENS,
    "weight_decay": "optimizer.weight_decay",
    "max_grad_norm": "optimizer.grad_clip",
    "adam_beta1": "optimizer.betas (a pair)",
    "adam_beta2": "optimizer.betas (a pair)",
    "adam_epsilon": "optimizer.eps",
    "lr_scheduler_type": "optimizer.decay (cosine, linear or constant)",
    "bf16": "precision (bf16 or fp32)",
    "output_dir": "run_dir",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
}


def hf_name_hint(key: str) -> str | None:
    """What the recipe calls the Hugging Face training argument ``key``, as a phrase for an error; None if it is none."""
    ours = HF_TRAINING_NAMES.get(key)
    return None if ours is None else f"{key} is a Hugging Face training argument; a recipe sets {ours}"


# PEFT's LoraConfig names, inside the recipe's lora section (`r` is too short for a close-match suggestion)
PEFT_LORA_NAMES: dict[str, str] = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
                                   "target_modules": "targets"}


def peft_name_hint(section: tuple, key: str) -> str | None:
    """The did-you-mean for PEFT's LoraConfig name ``key`` written in the recipe section ``section`` (a path of
    keys), as a phrase for an error; None outside the lora section or for another key."""
    ours = PEFT_LORA_NAMES.get(key) if tuple(section) == ("lora",) else None
    return None if ours is None else f"did you mean '{ours}'? PEFT's LoraConfig calls lora.{ours} {key}"
