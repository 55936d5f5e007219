"""Parity of the native model with transformers on a checkpoint directory: logits, loss and every gradient.

Both models load the same checkpoint in the same dtype on the CPU and see the same seeded random input ids. When the
config has a ``pad_token_id``, that token is written into the middle of every sequence: whether its embedding row
gets a gradient (transformers' ``padding_idx`` says none) is then checked on every run, not only on the seeds whose
random ids happen to contain it.
Errors are max-relative: max |native - hf| / max |hf| over a tensor. transformers' gradients are read into native
names through the family's own map of checkpoint names (``ModelFamily.native_parts``, what import reads), so every
registered family is compared: the experts fused (``gate_up_proj``) or one tensor per expert, a vision-language
model's language model under its prefix. A parameter the native model keeps frozen (DeepSeek-V3's expert correction
bias, a buffer in transformers) has no gradient on either side and is not compared. The transformers class is the
checkpoint's own ``architectures`` entry when transformers has it (never repository code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ParityThresholds:
    logits: float = 1e-5
    loss: float = 1e-5
    grads: float = 1e-4
    # a gradient over ``grads`` passes within 8x the native model's own fp32 rounding (off where the user named the
    # limit: a tolerance given is the tolerance)
    grads_allow_rounding: bool = True


@dataclass(kw_only=True)
class ParityReport:
    checkpoint: str
    dtype: str
    tokens: int
    thresholds: ParityThresholds
    logits_error: float = float("nan")
    loss_error: float = float("nan")
    native_loss: float = float("nan")
    hf_loss: float = float("nan")
    grad_errors: dict[str, float] = field(default_factory=dict)
    # gradients over the fp32 limit judged instead by 8x the native model's own fp32 rounding (its fp64 gradient)
    rounding_limits: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def worst_grad(self) -> tuple[str, float]:
        if not self.grad_errors:
            return ("-", 0.0)
        name = max(self.grad_errors, key=self.grad_errors.get)
        return name, self.grad_errors[name]

    @property
    def passed(self) -> bool:
        return not self.problems


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / scale


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def native_gradients(family, hf_params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor | None]:
    """transformers' gradients under native names, in the native layout (None: no gradient reached it)."""
    from openrecipes.models.common.hf_experts import FusedHalf, Rearranged

    parts: dict[str, dict] = {}
    for hf_name, param in hf_params.items():
        for native_name, part in family.native_parts(hf_name):
            parts.setdefault(native_name, {})[part] = param.grad
    out: dict[str, torch.Tensor | None] = {}
    for name, held in parts.items():
        if None in held:
            out[name] = held[None]
        elif any(g is None for g in held.values()):
            out[name] = None
        elif all(isinstance(part, Rearranged) for part in held):  # a fixed view of the whole tensor
            (part, grad), = held.items()
            out[name] = part.take(grad)
        elif all(isinstance(part, FusedHalf) for part in held):  # this half of dim 1 of gate_up_proj
            (part, grad), = held.items()
            out[name] = grad.chunk(2, dim=1)[part.index]
        else:  # one tensor per expert, stacked along dim 0
            out[name] = torch.stack([held[expert] for expert in sorted(held)])
    return out


# a vision-language model's image and video tokens ask for pixels that text-only parity does not give
_MEDIA_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def parity_input_ids(hf_config, *, batch: int, tokens: int, seed: int) -> torch.Tensor:
    """Seeded random ids (batch, tokens) of the text model's vocabulary, none of them a media token; the config's
    pad token, if any, at position tokens // 2 of each row."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, int(text_config.vocab_size), (batch, tokens), generator=generator)
    for key in _MEDIA_TOKENS:
        media = getattr(hf_config, key, None)
        if media is not None:
            input_ids[input_ids == int(media)] = 0
    pad = getattr(text_config, "pad_token_id", None)
    if pad is not None:
        input_ids[:, tokens // 2] = int(pad)
    return input_ids


def _load_transformers(path: Path, dtype: torch.dtype):
    import json

    try:
        import transformers
    except ImportError as exc:
        raise ValueError("verify parity needs the 'transformers' package: pip install transformers") from exc
    # the checkpoint's own class where transformers has it (a vision-language model is no AutoModelForCausalLM)
    architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    named = getattr(transformers, architectures[0], None) if architectures and isinstance(architectures[0], str) \
        else None
    model_class = named if isinstance(named, type) and hasattr(named, "from_pretrained") \
        else transformers.AutoModelForCausalLM
    # safetensors only and no repository code: a pickled pytorch_model.bin or a modeling_*.py could run code
    # eager attention and experts: the plainest reference, and the one that runs in fp64 (transformers' grouped_mm
    # experts take no float64)
    safe = dict(attn_implementation="eager", experts_implementation="eager", use_safetensors=True,
                trust_remote_code=False)
    try:
        model = model_class.from_pretrained(path, dtype=dtype, **safe)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = model_class.from_pretrained(path, torch_dtype=dtype, **safe)
    return model.eval()


def check_parity(path: str | Path, *, tokens: int = 32, batch: int = 2, dtype: str = "fp32", seed: int = 0,
                 thresholds: ParityThresholds = ParityThresholds()) -> ParityReport:
    import openrecipes

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'}: not found (HF_DIR must be a checkpoint directory)")
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {tuple(_DTYPES)}")
    if tokens < 2:
        raise ValueError(f"--tokens must be at least 2 (the loss predicts the next token), got {tokens}")
    torch_dtype = _DTYPES[dtype]
    # openrecipes reads the directory first: its config.json and safetensors get one line naming the file or field,
    # where transformers would end in its own traceback (or start loading, then fail)
    native = openrecipes.from_hf(path, dtype=torch_dtype)
    hf_model = _load_transformers(path, torch_dtype)
    report = ParityReport(checkpoint=str(path), dtype=dtype, tokens=tokens, thresholds=thresholds)

    input_ids = parity_input_ids(hf_model.config, batch=batch, tokens=tokens, seed=seed)
    try:
        hf_logits = hf_model(input_ids).logits
    except Exception as error:  # noqa: BLE001 - whatever transformers raises, the reference is missing
        raise ValueError(f"{path}: transformers' own {type(hf_model).__name__} cannot run this checkpoint "
                         f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); openrecipes "
                         "reads it, but there is no reference to compare against") from None
    native_logits = native(input_ids)
    report.logits_error = max_rel_error(native_logits, hf_logits)
    hf_loss, native_loss = lm_loss(hf_logits, input_ids), lm_loss(native_logits, input_ids)
    report.hf_loss, report.native_loss = hf_loss.item(), native_loss.item()
    report.loss_error = abs(report.native_loss - report.hf_loss) / max(abs(report.hf_loss), 1e-30)
    hf_loss.backward()
    native_loss.backward()

    _compare_gradients(report, native, hf_model)
    if not report.logits_error <= thresholds.logits:
        report.problems.append(f"logits max relative error {report.logits_error:.3g} > {thresholds.logits:g}")
    if not report.loss_error <= thresholds.loss:
        report.problems.append(f"loss relative error {report.loss_error:.3g} > {thresholds.loss:g}")
    over = [name for name, error in report.grad_errors.items() if not error <= thresholds.grads]
    if over and dtype in ("fp32", "fp64") and thresholds.grads_allow_rounding:
        report.rounding_limits = _own_rounding_limits(path, input_ids, native, over, thresholds.grads)
    for name, error in report.grad_errors.items():
        limit = report.rounding_limits.get(name, thresholds.grads)
        if not error <= limit:
            report.problems.append(f"gradient of {name}: max relative error {error:.3g} > {limit:g}")
    return report


def _own_rounding_limits(path: Path, input_ids: torch.Tensor, native, names: list[str],
                         grads_limit: float) -> dict[str, float]:
    """For gradients over the limit: eight times the distance between the native model's own fp32 and fp64
    gradients, where that is more than the limit. A recurrence such as Qwen3.5's delta rule rounds more in fp32 than
    1e-4 on longer rows, and transformers runs it in float32 whatever the dtype asked (so an fp64 comparison meets
    that rounding too); the tests' bound for such families. A real difference from transformers stays over it."""
    import openrecipes

    other_dtype = torch.float64 if next(native.parameters()).dtype == torch.float32 else torch.float32
    other = openrecipes.from_hf(path, dtype=other_dtype)
    lm_loss(other(input_ids), input_ids).backward()
    other_grads = dict(other.named_parameters())
    own = dict(native.named_parameters())
    return {name: max(grads_limit, 8 * max_rel_error(own[name].grad, other_grads[name].grad)) for name in names
            if other_grads[name].grad is not None}


def _compare_gradients(report: ParityReport, native, hf_model) -> None:
    """Each native parameter's gradient against transformers' of the same tensor, by the family's name map."""
    from openrecipes.models.families import family_for_config

    expected_grads = native_gradients(family_for_config(native.config), dict(hf_model.named_parameters()))
    for name, param in native.named_parameters():
        if not param.requires_grad:  # frozen (a buffer in transformers): neither side has a gradient
            continue
        if name not in expected_grads:
            report.problems.append(f"no transformers parameter matches native parameter {name}")
            continue
        expected, got = expected_grads[name], param.grad
        if expected is None and got is None:
            continue
        if expected is None or got is None:
            report.problems.append(f"gradient of {name}: present on one side only "
                                   f"({'native' if got is not None else 'transformers'})")
            continue
        report.grad_errors[name] = max_rel_error(got, expected)


def format_parity(report: ParityReport) -> str:
    name, worst = report.worst_grad
    lines = [f"parity with transformers: {'PASS' if report.passed else 'FAIL'}",
             f"checkpoint: {report.checkpoint}; dtype {report.dtype}; {report.tokens} tokens x 2 sequences",
             f"logits: max relative error {report.logits_error:.3e} (limit {report.thresholds.logits:g})",
             f"loss: native {report.native_loss:.6f}, transformers {report.hf_loss:.6f}, relative error "
             f"{report.loss_error:.3e} (limit {report.thresholds.loss:g})",
             f"gradients: {len(report.grad_errors)} tensors, worst {name} {worst:.3e} "
             f"(limit {report.thresholds.grads:g})"]
    lines += [f"  {name}: {report.grad_errors[name]:.3e}, within 8x the native model's own fp32 rounding "
              f"({limit:.3e}: its fp32 gradient against its fp64 one)" for name, limit in report.rounding_limits.items()
              if report.grad_errors[name] <= limit]
    lines += [f"  problem: {p}" for p in report.problems]
    return "\n".join(lines)


def parity_dict(report: ParityReport) -> dict:
    name, worst = report.worst_grad
    return {"passed": report.passed, "checkpoint": report.checkpoint, "dtype": report.dtype,
            "tokens": report.tokens, "thresholds": vars(report.thresholds).copy(),
            "logits_error": report.logits_error, "loss_error": report.loss_error,
            "native_loss": report.native_loss, "hf_loss": report.hf_loss,
            "worst_grad": {"name": name, "error": worst}, "grad_errors": report.grad_errors,
            "rounding_limits": report.rounding_limits,
            "problems": report.problems}
