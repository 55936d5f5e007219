"""A training checkpoint (RUN_DIR/checkpoints/step-NNNNNN) as a Hugging Face directory.

A training save holds ``model``, ``optimizer`` and ``trainer`` state (``checkpoint/training_save.py``), written under
whatever layout the run had; DCP reshards on load, so only the model's tensors are read, whole, in one process.
What the directory needs besides the weights comes from the run: the model config from ``RUN_DIR/recipe.yaml``
(registry name or HF directory, with ``model_overrides``), the tokenizer files the rows were built with (the rows'
manifest names them and their sha256), the rows' chat template when it was not the tokenizer's own, the image
processor of rows built with images (``preprocessor_config.json``), and the source HF directory's
``generation_config.json`` when the recipe started from one, else one written from the rows' stop token and the
tokenizer's special tokens (their ids also fill config.json's empty bos/eos_token_id).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from openrecipes.checkpoint.hf import hf_tensors_from_native, recipe_model_config
from openrecipes.checkpoint.safe_load import METADATA_FILE
from openrecipes.checkpoint.safetensors_io import HF_MARKER, HF_WRITER, write_hf_dir
from openrecipes.checkpoint.training_save import read_model_state, run_dir_of
from openrecipes.config.rundir import CHECKPOINTS_DIR, RECIPE_FILE, RUN_FILE, read_run_info, rows_directory
from openrecipes.utils import check_output_dir, path_inside, sha256_file

EXPORT_DTYPES = ("source", "native")
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def export_training_checkpoint(ckpt_dir: str | Path, hf_dir: str | Path, *, max_shard_bytes: int = 5 * 2**30,
                               overwrite: bool = False, dtypes: str = "source",
                               expert_layout: str | None = None, lora: str = "merged") -> Path:
    """Write the model of the training save ``ckpt_dir`` as a Hugging Face directory ``hf_dir``; returns it.

    ``dtypes="source"``: each tensor in the dtype the recipe trains it in (a bf16 recipe: bf16, except the tensors
    the model pins to fp32), whatever the layout stored (data-parallel runs keep fp32 masters); ``"native"``: the
    dtypes the save holds. ``expert_layout``: "fused" or "per_expert" (None: the family's default). ``lora`` (a LoRA
    run's save): "merged", the model it trained (base + s·BA); "base", the frozen base alone.
    """
    from openrecipes.config.recipe import load_recipe
    from openrecipes.models.families import family_for_config

    if lora not in ("merged", "base"):
        raise ValueError(f"lora must be 'merged' or 'base', got {lora!r}")
    if dtypes not in EXPORT_DTYPES:
        raise ValueError(f"dtypes must be one of {EXPORT_DTYPES}, got {dtypes!r}")
    ckpt_dir = Path(ckpt_dir)
    run_dir = run_dir_of(ckpt_dir)
    if run_dir is None:
        raise FileNotFoundError(f"{ckpt_dir} is not a training save (expected RUN_DIR/{CHECKPOINTS_DIR}/step-NNNNNN "
                                f"holding {METADATA_FILE}, with RUN_DIR/{RECIPE_FILE})")
    recipe = load_recipe(run_dir / RECIPE_FILE)
    inputs = _export_inputs(recipe, run_dir, ckpt_dir)
    check_output_dir(hf_dir, marker=HF_MARKER, writer=HF_WRITER, overwrite=overwrite, inputs=inputs,
                     option="HF_DIR")  # before any tensor is read: a refusal costs nothing
    config = recipe_model_config(recipe)
    _check_run_model(run_dir, config)
    family = family_for_config(config)
    # the model as the recipe trains it: names, shapes, and each tensor's dtype (KeepFP32 modules stay fp32)
    trained_dtype = recipe.compute_dtype()
    model = family.build(config, device="meta", dtype=trained_dtype, seed=None)
    expected = dict(model.named_parameters())
    if recipe.lora is not None:  # the save holds the frozen base and the adapters under their training names
        from openrecipes.models.common.lora import LoraSpec, apply_lora

        apply_lora(model, LoraSpec.from_recipe(recipe))
    state = read_model_state(ckpt_dir, dict(model.named_parameters()))
    if recipe.lora is not None:
        if lora == "base":  # B = 0 adds exactly nothing: the merge then returns the base under the base's names
            state = {name: torch.zeros_like(t) if "lora_B" in name else t for name, t in state.items()}
        state = _merged_lora_state(model, state)
    if dtypes == "source":
        state = {name: tensor.to(expected[name].dtype) for name, tensor in state.items()}
    tokenizer_files = _tokenizer_files(recipe, run_dir)  # first: it checks the files generation_tokens reads
    tokens = generation_tokens(recipe, run_dir)
    hf_config = family.config_to_hf(config)
    for key in ("bos_token_id", "eos_token_id"):  # read by no forward pass; what transformers' generate starts from
        if hf_config.get(key) is None and tokens.get(key) is not None:
            hf_config[key] = tokens[key][0] if key == "eos_token_id" else tokens[key]
    extra = {**tokenizer_files, **_generation_config(recipe.model, tokens)}
    write_hf_dir(hf_dir, hf_tensors_from_native(state, family, config, expert_layout), hf_config,
                 max_shard_bytes=max_shard_bytes, overwrite=overwrite, extra_files=extra, inputs=inputs)
    return Path(hf_dir)


def _export_inputs(recipe: Any, run_dir: Path, ckpt_dir: Path) -> list[Path]:
    """What an export reads, which its HF_DIR keeps apart from: the save, the run's recipe, its rows and their
    tokenizer directory, and the model directory the run started from (a registry name reads no file)."""
    from openrecipes.data.manifest import read_manifest
    from openrecipes.models.registry import names

    rows = rows_directory(recipe.data.rows, run_dir)
    inputs = [ckpt_dir, run_dir / RECIPE_FILE, rows]
    tokenizer = read_manifest(rows, require=("tokenizer",))["tokenizer"]
    if isinstance(tokenizer, dict) and isinstance(tokenizer.get("directory"), str) and tokenizer["directory"]:
        inputs.append(Path(tokenizer["directory"]))
    if recipe.model not in names():
        inputs.append(Path(recipe.model))
    return inputs


def _merged_lora_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA run's save as the merged model (base + s·BA, in fp32; each tensor back in the dtype its base was
    saved in), under the base model's names: what a LoRA run exports is the model it trained."""
    from openrecipes.models.common.lora import merge_adapters

    saved = {name: tensor.dtype for name, tensor in state.items() if "lora_" not in name}
    unexpected = model.load_state_dict({name: t.float() for name, t in state.items()}, strict=False,
                                       assign=True).unexpected_keys
    assert not unexpected, unexpected  # the names were checked against this model's parameters
    merge_adapters(model)
    return {name: param.detach().to(saved[name]) for name, param in model.named_parameters()}


def _check_run_model(run_dir: Path, config: Any) -> None:
    """The recipe's model must be the one the run trained (a registry entry or HF directory may have changed)."""
    if not (run_dir / RUN_FILE).is_file():
        return
    recorded = read_run_info(run_dir).model.total_params
    if recorded is not None and recorded != config.total_params():
        raise ValueError(f"{run_dir / RUN_FILE}: the run trained a model of {recorded:,} parameters, but "
                         f"{run_dir / RECIPE_FILE} now resolves to one of {config.total_params():,}; the model it "
                         "names has changed since the run")


def _tokenizer_files(recipe: Any, run_dir: Path) -> dict[str, str]:
    """The tokenizer files the run's rows were built with (checked against the sha256 the manifest recorded), and
    the rows' chat template when it was not the tokenizer's own, so the export formats chats as the model learnt."""
    from openrecipes.data.manifest import read_manifest
    from openrecipes.data.templates import load_template_text

    rows = rows_directory(recipe.data.rows, run_dir)
    manifest = read_manifest(rows, require=("tokenizer",))
    source = rows / "manifest.json"
    tokenizer = manifest["tokenizer"]
    hashes = tokenizer.get("files_sha256", {}) if isinstance(tokenizer, dict) else None
    if not isinstance(hashes, dict):
        raise ValueError(f"{source}: tokenizer.files_sha256 is not a mapping of file names to sha256")
    directory = Path(tokenizer.get("directory", ""))
    files: dict[str, str] = {}
    for name, digest in sorted(hashes.items()):
        # each name is also where the file goes in the export: a plain name, or it would write outside HF_DIR;
        # the tokenizer directory may be a Hugging Face cache snapshot, whose files link to blobs beside it
        path = path_inside(directory, name, source=source, key="tokenizer.files_sha256", plain_name=True,
                           links_may_leave=True)
        if not path.is_file():
            raise FileNotFoundError(f"{source}: tokenizer file {path} is missing (the rows were built with it)")
        if sha256_file(path) != digest:
            raise ValueError(f"{source}: tokenizer file {path} has changed since the rows were built "
                             "(its sha256 differs from the manifest's)")
        files[name] = path.read_text(encoding="utf-8")
    if manifest.get("images"):  # rows with images: the processor they were sized by, for the exported model
        from openrecipes.data.image_rows import PROCESSOR_FILE
        from openrecipes.data.images import ImageProcessorConfig

        processor = ImageProcessorConfig.from_manifest(manifest["images"]["processor"])
        files[PROCESSOR_FILE] = json.dumps(processor.to_hf_dict(), indent=2) + "\n"
    template_source = manifest.get("template_source") or ""
    if not template_source:
        return files  # pretraining rows: plain text, no chat template
    if template_source.endswith("(chat_template)") or template_source == str(directory / CHAT_TEMPLATE_FILE):
        return files  # the tokenizer's own template, already among its files
    text, _ = load_template_text(template_source.removeprefix("built-in "))
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != manifest.get("template_sha256"):
        raise ValueError(f"{source}: chat template {template_source} has changed since the rows were built")
    files[CHAT_TEMPLATE_FILE] = text
    return files


def generation_tokens(recipe: Any, run_dir: Path) -> dict[str, Any]:
    """The token ids generation needs, from the run's rows and their tokenizer: ``eos_token_id``, the stop tokens
    (for chat rows first the chat format's end of turn, which closes every supervised answer; then the tokenizer's
    eos_token and the token the rows end each conversation or document with), ``bos_token_id`` and
    ``pad_token_id`` (the tokenizer's, else the first stop token); a token the tokenizer lacks is left out."""
    from openrecipes.data.manifest import read_manifest
    from openrecipes.data.templates import LOSS_MASKS, get_loss_mask
    from openrecipes.data.tokenizer import load_tokenizer

    manifest = read_manifest(rows_directory(recipe.data.rows, run_dir), require=("tokenizer",))
    bundle = load_tokenizer(manifest["tokenizer"]["directory"])  # its files' sha256 are checked by the export
    ids = {key: bundle.token_id(token) for key in ("bos_token", "eos_token", "pad_token")
           if (token := bundle.config_token(key)) is not None}
    # chat rows name their format; pretraining rows ("pretrain") have no turns to end
    end_of_turn = bundle.token_id(get_loss_mask(manifest["loss_mask"]).end.strip()) \
        if manifest.get("loss_mask") in LOSS_MASKS else None
    stops = [end_of_turn, ids.get("eos_token"), manifest.get("eos_token_id")]
    eos = list(dict.fromkeys(i for i in stops if isinstance(i, int) and not isinstance(i, bool)))
    pad = ids.get("pad_token") if ids.get("pad_token") is not None else (eos[0] if eos else None)
    return {"bos_token_id": ids.get("bos_token"), "eos_token_id": eos or None, "pad_token_id": pad}


def _generation_config(model: str, tokens: dict[str, Any]) -> dict[str, str]:
    """The source HF directory's generation_config.json (sampling defaults, stop tokens), when it has one; else
    one holding the run's ``generation_tokens``, so generation stops where the training data ended a turn.
    (pad_token_id goes here only: in config.json it would freeze that token's embedding row in a later run.)"""
    from openrecipes.models.registry import names

    path = Path(model) / GENERATION_CONFIG
    if model in names() or not path.is_file():
        written = {key: value for key, value in tokens.items() if value is not None}
        return {GENERATION_CONFIG: json.dumps(written, indent=2) + "\n"} if written else {}
    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: line {error.lineno}: invalid JSON: {error.msg}") from None
    return {GENERATION_CONFIG: text}
