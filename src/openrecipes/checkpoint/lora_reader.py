"""Reading a PEFT LoRA adapter for merge-lora: everything PEFT (0.21) would apply is read exactly, the rest refused.

What PEFT applies when it loads an adapter and merges it (``PeftModel.from_pretrained(...).merge_and_unload()``):

- each adapted module's ``s · B A``, with rank and alpha from ``r``/``lora_alpha`` unless a ``rank_pattern`` /
  ``alpha_pattern`` key matches the module's name (the first key, in file order, matching a dot-suffix of the name as
  a regular expression), and ``s = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``);
- only for modules the config targets (``target_modules`` as a list: the name or a dot-suffix of it; as a string: a
  full regular-expression match; ``exclude_modules`` alike): tensors for any other module are dropped by PEFT, so
  they are refused here rather than merged;
- ``target_parameters`` wrap each module's targeted parameters one inside the other in the order the module
  registers them (transformers' experts: ``gate_up_proj``, then ``down_proj``), whatever order the config lists
  them in: the innermost wrapper's keys carry one ``.base_layer`` per wrapper around it. Any other module's
  targeted parameter is its 2-D ``weight`` (the router's, which PEFT's ``all-linear`` adds on MoE models).

Refused by name: anything that changes the model some other way (DoRA, ``modules_to_save``, biases, embedding
adapters, layer selection or replication, ...), an A without its B or a B without its A, a rank that disagrees with
the config (PEFT refuses to load those), non-float or non-finite tensors, a malformed config, and an unresolved
``all-linear`` (PEFT saves the module list it resolves to).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

import torch

from openrecipes.checkpoint.finite import require_finite
from openrecipes.checkpoint.safetensors_header import TORCH_FLOAT_DTYPES, read_header, read_tensor

PREFIX = "base_model.model."
# transformers' fused expert parameters, in the order the experts module registers them: PEFT's nesting order
EXPERT_PARAMETER_NAMES = ("gate_up_proj", "down_proj")
EXPERTS_MODULE = "experts"
MATRIX_PARAMETER = "weight"  # any other module's targetable parameter: its 2-D weight (a router's, say)
MAX_CONFIG_BYTES = 16 * 2**20

# read below; every other field must be absent or hold its neutral value (None, false, empty)
_HANDLED = {"r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
            "target_parameters", "bias", "init_lora_weights", "lora_dropout", "peft_type"}
# fields that do not change the merged weights (bookkeeping, or options of initialisations that are refused)
_INERT = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
          "runtime_config", "megatron_core", "qalora_group_size", "loftq_config", "eva_config", "corda_config",
          "lora_ga_config"}
# init_lora_weights values that leave the base weights alone when PEFT builds the adapter (only the factors' starting
# values differ, and a saved adapter's factors replace them), and those whose initialisation rewrites the base
# weights (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA: peft 0.21's LoraConfig)
_PLAIN_INITS = (True, False, "gaussian", "orthogonal", "mica", "eva")
_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
# peft's TaskType values (a task_type PEFT does not know is refused when it loads the adapter)
_TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
_KEY_HINTS = (("lora_embedding_", "embedding adapters (lora_embedding_A/B)"),
              ("modules_to_save", "modules_to_save copies"), ("lora_magnitude_vector", "DoRA magnitudes"))


@dataclass(frozen=True)
class AdapterConfig:
    source: Path
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: str | tuple[str, ...] | None
    exclude_modules: str | tuple[str, ...] | None
    target_parameters: tuple[str, ...]

    def rank_and_scaling(self, name: str) -> tuple[int, float]:
        """The rank and scale PEFT gives the adapter of module or parameter ``name``."""
        r = _pattern_value(self.rank_pattern, name, self.r)
        alpha = _pattern_value(self.alpha_pattern, name, self.alpha)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)

    def targets_module(self, module: str) -> bool:
        if self.exclude_modules and _matches(self.exclude_modules, module):
            return False
        return self.target_modules is not None and bool(_matches(self.target_modules, module))

    def wrapped_parameters(self, module: str) -> list[str]:
        """The parameters of ``module`` that ``target_parameters`` wraps, innermost wrapper first."""
        own = EXPERT_PARAMETER_NAMES if module.rsplit(".", 1)[-1] == EXPERTS_MODULE else (MATRIX_PARAMETER,)
        return [name for name in own
                if any(_suffix_match(target, f"{module}.{name}") for target in self.target_parameters)]


@dataclass(frozen=True)
class Factors:
    """One adapter pair; ``target`` is the HF parameter it changes (``<module>.weight`` or an expert parameter)."""
    target: str
    A: torch.Tensor
    B: torch.Tensor
    rank: int
    scaling: float
    experts: bool


def _suffix_match(target: str, name: str) -> bool:
    return name == target or name.endswith("." + target)


def _matches(targets: str | tuple[str, ...], name: str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(_suffix_match(target, name) for target in targets)


def _pattern_value(pattern: dict[str, Any], name: str, default: Any) -> Any:
    for key, value in pattern.items():  # the first matching key wins, as in PEFT
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _neutral(value: Any) -> bool:
    return value is None or value is False or value in ([], {}, "")


def _number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return math.isfinite(value) if isinstance(value, float) else abs(value) < 2**63


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**63


def _names(path: Path, field: str, value: Any, *, list_only: bool = False) -> str | tuple[str, ...] | None:
    if value is None or (isinstance(value, str) and not list_only):
        if isinstance(value, str):
            _compile(path, field, value, value)
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    kinds = "a list of strings" if list_only else "a string or a list of strings"
    raise ValueError(f"{path}: {field} must be {kinds}, not {json.dumps(value)[:80]}")


def _compile(path: Path, field: str, pattern: str, regex: str) -> None:
    """``regex`` (``pattern`` as PEFT uses it) compiles, or a ValueError naming ``field``."""
    try:
        re.compile(regex)
    except re.error as error:
        raise ValueError(f"{path}: {field} {pattern!r} is not a regular expression ({error})") from None


def _pattern(path: Path, config: dict[str, Any], field: str, valid, kind: str) -> dict[str, Any]:
    pattern = config.get(field) or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"{path}: {field} must be a mapping of module patterns to {kind}")
    for key, value in pattern.items():
        _compile(path, f"{field} key", key, rf"(.*\.)?({key})$")
        if not valid(value):
            raise ValueError(f"{path}: {field}[{key!r}] is {json.dumps(value)}, not {kind}")
    return dict(pattern)


def _load_json(path: Path) -> Any:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, more than an adapter config holds")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValueError(f"{path}: not valid JSON ({type(error).__name__}: {str(error)[:200]})") from None


def _refuse_unmerged_features(path: Path, config: dict[str, Any]) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}; only LORA adapters merge")
    for field, value in config.items():
        if field not in _HANDLED and field not in _INERT and not _neutral(value):
            raise ValueError(f"{path}: {field} is set ({json.dumps(value)[:80]}); merge-lora merges plain LoRA "
                             "only and would not apply it as PEFT does")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias is {config['bias']!r}; merge-lora merges adapters with bias 'none' only")
    init = config.get("init_lora_weights", True)
    if any(init is plain or (isinstance(plain, str) and init == plain) for plain in _PLAIN_INITS):
        return
    if isinstance(init, str) and init.lower().startswith(_REWRITING_INITS):
        raise ValueError(f"{path}: init_lora_weights {json.dumps(init)[:80]}: PEFT would rewrite the base weights "
                         "when it builds this adapter; merge-lora does not")
    raise ValueError(f"{path}: init_lora_weights {json.dumps(init)[:80]} is not a value PEFT knows (true, false, "
                     f"{', '.join(repr(p) for p in _PLAIN_INITS[2:])}, or an initialisation that rewrites the base)")


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """The adapter config at ``path``, validated; ValueError naming the file and field otherwise."""
    path = Path(path)
    config = _load_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: an adapter config is a JSON object, not a {type(config).__name__}")
    _refuse_unmerged_features(path, config)
    for field in ("r", "lora_alpha"):
        if field not in config:
            raise ValueError(f"{path}: {field} is missing")
    if not _positive_int(config["r"]):
        raise ValueError(f"{path}: r is {json.dumps(config['r'])}, not a positive integer")
    if not _number(config["lora_alpha"]):
        raise ValueError(f"{path}: lora_alpha is {json.dumps(config['lora_alpha'])}, not a finite number")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"{path}: use_rslora must be true or false")
    parameters = _names(path, "target_parameters", config.get("target_parameters"), list_only=True) or ()
    for target in parameters:
        if target.rsplit(".", 1)[-1] not in (*EXPERT_PARAMETER_NAMES, MATRIX_PARAMETER):
            raise ValueError(f"{path}: target_parameters names {target!r}; merge-lora merges the expert parameters "
                             f"{', '.join(EXPERT_PARAMETER_NAMES)} and modules' {MATRIX_PARAMETER} only")
    if isinstance(config.get("target_modules"), str) and config["target_modules"].lower() == "all-linear":
        raise ValueError(f"{path}: target_modules is 'all-linear', which PEFT resolves against the model (adding "
                         "target parameters); merge-lora needs the module list PEFT saves in its place")
    dropout = config.get("lora_dropout", 0)
    if not _number(dropout) or not 0 <= dropout <= 1:
        raise ValueError(f"{path}: lora_dropout is {json.dumps(dropout)[:80]}, not a probability in [0, 1]")
    if parameters and dropout != 0:
        raise ValueError(f"{path}: lora_dropout must be 0 with target_parameters (PEFT refuses it there)")
    task = config.get("task_type")
    if task is not None and task not in _TASK_TYPES:
        raise ValueError(f"{path}: task_type {json.dumps(task)[:80]} is not one of PEFT's ({', '.join(_TASK_TYPES)})")
    return AdapterConfig(
        source=path, r=config["r"], alpha=float(config["lora_alpha"]), use_rslora=config.get("use_rslora", False),
        rank_pattern=_pattern(path, config, "rank_pattern", _positive_int, "a positive integer"),
        alpha_pattern=_pattern(path, config, "alpha_pattern", _number, "a finite number"),
        target_modules=_names(path, "target_modules", config.get("target_modules")),
        exclude_modules=_names(path, "exclude_modules", config.get("exclude_modules")),
        target_parameters=parameters)


def _split_key(path: Path, key: str) -> tuple[str, int, str]:
    """``(module, base_layer hops, "A" or "B")`` of a PEFT key; ValueError for anything but a LoRA factor."""
    match = _KEY.match(key)
    if match is None:
        what = next((hint for marker, hint in _KEY_HINTS if marker in key), None)
        if what is None:
            what = "a bias" if key.endswith(".bias") else "not a base_model.model.<module>.lora_{A,B}.weight key"
        raise ValueError(f"{path}: tensor {key!r}: {what}; merge-lora merges LoRA A/B weights only")
    module, hops = match["module"], 0
    while module.endswith(".base_layer"):
        module, hops = module[:-len(".base_layer")], hops + 1
    if ".base_layer." in module or module.startswith("base_layer"):
        raise ValueError(f"{path}: tensor {key!r}: base_layer inside the module path is not a PEFT layout")
    return module, hops, match["factor"]


def read_adapter_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the adapter file, after its header and keys pass; each float and finite."""
    path = Path(path)
    entries = read_header(path)
    for key, entry in entries.items():
        _split_key(path, key)
        if entry.dtype not in TORCH_FLOAT_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} is {entry.dtype}; LoRA factors must be one of "
                             f"{', '.join(TORCH_FLOAT_DTYPES)}")
    return {key: require_finite(read_tensor(path, key, entry), key, path) for key, entry in entries.items()}


def _rank_error(path: Path, config: AdapterConfig, key: str, A: torch.Tensor, B: torch.Tensor, r: int,
                name: str, per_expert: str = "") -> ValueError:
    return ValueError(f"{path}: {key}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are not rank {r}"
                      f"{per_expert} (the rank {config.source.name} gives {name})")


def _wrapped(path: Path, config: AdapterConfig, module: str, hops: int, A: torch.Tensor, B: torch.Tensor,
             key: str, parameters: list[str]) -> Factors:
    """A ``target_parameters`` adapter: of an experts parameter (E·r rows of A), or of a 2-D weight (r rows)."""
    if config.targets_module(module):
        raise ValueError(f"{path}: {key}: {module} is targeted by both target_modules and target_parameters "
                         "(PEFT refuses that)")
    if hops >= len(parameters):
        raise ValueError(f"{path}: {key}: {hops} base_layer hops, but target_parameters wraps only "
                         f"{len(parameters)} parameter(s) of {module}")
    name = parameters[len(parameters) - 1 - hops]  # the outermost wrapper is the last
    target = f"{module}.{name}"
    r, scaling = config.rank_and_scaling(target)
    if name == MATRIX_PARAMETER:
        if A.shape[0] != r or B.shape[1] != r:
            raise _rank_error(path, config, key, A, B, r, target)
        return Factors(target, A, B, r, scaling, experts=False)
    experts = A.shape[0] // r
    if A.shape[0] != experts * r or experts == 0 or B.shape[1] != r * experts:
        raise _rank_error(path, config, key, A, B, r, target, " per expert")
    return Factors(target, A, B, r, scaling, experts=True)


def _pair(path: Path, config: AdapterConfig, module: str, hops: int, A: torch.Tensor, B: torch.Tensor,
          key: str) -> Factors:
    if A.dim() != 2 or B.dim() != 2:
        raise ValueError(f"{path}: {key}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} must be matrices")
    parameters = config.wrapped_parameters(module)
    if parameters:
        return _wrapped(path, config, module, hops, A, B, key, parameters)
    if hops:
        raise ValueError(f"{path}: {key}: base_layer hops, but target_parameters does not target {module}")
    if not config.targets_module(module):
        raise ValueError(f"{path}: {key}: {config.source.name} does not target {module} (target_modules "
                         f"{config.target_modules!r}), so PEFT would not apply this adapter")
    r, scaling = config.rank_and_scaling(module)
    if A.shape[0] != r or B.shape[1] != r:
        raise _rank_error(path, config, key, A, B, r, module)
    return Factors(f"{module}.{MATRIX_PARAMETER}", A, B, r, scaling, experts=False)


def adapter_factors(config: AdapterConfig, tensors: dict[str, torch.Tensor], path: str | Path,
                    modules: Collection[str] | None = None) -> list[Factors]:
    """Each A/B pair of ``tensors`` with the parameter it changes and its scale, checked against ``config``;
    with ``modules`` (the base model's module names), a pair for a module outside them is refused before the
    config's patterns are matched against its name (a name from the file, so a pattern could backtrack on it
    without end)."""
    path = Path(path)
    pairs: dict[tuple[str, int], dict[str, str]] = {}
    for key in tensors:
        module, hops, factor = _split_key(path, key)
        if modules is not None and module not in modules:
            raise ValueError(f"{path}: tensor {key!r}: the base model has no module {module!r}")
        pairs.setdefault((module, hops), {})[factor] = key
    factors = []
    for (module, hops), keys in sorted(pairs.items()):
        if set(keys) != {"A", "B"}:
            (present,) = keys.values()
            missing = "lora_B" if "A" in keys else "lora_A"
            raise ValueError(f"{path}: tensor {present!r} has no {missing} partner")
        factors.append(_pair(path, config, module, hops, tensors[keys["A"]], tensors[keys["B"]], keys["A"]))
    return factors
