"""The benchmark workloads declared in bench/workloads.yaml, validated: one entry per workload (model and depth, row
shape, layout, recompute, kernels, LoRA, FP8, and the peer it is compared with). `engine_speed.py` trains an entry,
`run.py` runs entries beside their peers, `report.py` writes BENCHMARKS.md's current tables from their results.

Unset fields keep engine_speed.py's defaults (one 8,192-token row of 8 layers of Qwen3-30B-A3B, full recompute, eager,
precision-aware Adam on one GPU): an entry states only what differs, so its record in a results file is the same dict
the engine-speed results have always carried.
"""

from __future__ import annotations

import importlib
import sys
from functools import cache
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

BENCH = Path(__file__).resolve().parent
WORKLOADS_FILE = BENCH / "workloads.yaml"



class PeerHarness(NamedTuple):
    """A peer harness: its script (bench/), the registered model family it trains, the one model it trains where it
    trains only one (else any model of the family, named by --model), and the workload fields run.py passes it, each
    as the option of the same name (the family harness reads the engine's model, overrides and tiny model)."""

    script: str
    family: str
    model: str | None
    options: tuple[str, ...]


_DEPTH = ("layers", "row_tokens", "window")
_MODEL = ("model", "overrides", "tiny_model", *_DEPTH)
PEER_HARNESSES = {
    "transformers_qwen3_moe": PeerHarness("hf_qwen3_moe.py", "qwen3_moe", "qwen3-30b-a3b", _DEPTH),
    "transformers_peft_qwen3_moe": PeerHarness("hf_qwen3_moe.py", "qwen3_moe", "qwen3-30b-a3b", _DEPTH),  # --lora
    "transformers_deepseek_v3": PeerHarness("hf_deepseek_v3.py", "deepseek_v3", "deepseek-v3-671b", ("row_tokens",)),
    "transformers_gpt_oss": PeerHarness("hf_families.py", "gpt_oss", None, _MODEL),
    "transformers_peft_gpt_oss": PeerHarness("hf_families.py", "gpt_oss", None, _MODEL),  # --lora: peft's adapters
    "transformers_glm4_moe": PeerHarness("hf_families.py", "glm4_moe", None, _MODEL),
    "transformers_qwen3_5_moe": PeerHarness("hf_families.py", "qwen3_5_moe", None, _MODEL),
}
# modules that hold a workload's model and row shape shared with a peer (the one home of those numbers)
MODEL_FROM = {"deepseek_v3_workload"}
# fields that describe the comparison, not the engine's run: left out of the engine's spec (and its results record)
_NOT_ENGINE = {"description", "peer", "baseline", "profile", "model_from"}
# the adapters of a `lora: true` workload (the recipe's lora section), which its peer trains too
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]}
LORA_HARNESSES = ("transformers_peft_qwen3_moe", "transformers_peft_gpt_oss")


def default_window(steps: int) -> tuple[int, int]:
    """The timing window (0-based steps, inclusive) of a run without its own: 5 steps of warm-up, and the last
    step left out (the profiled one)."""
    return 5, min(19, steps - 2)


class Peer(BaseModel):
    """The other framework a workload is measured beside, in the same call; its recompute and routing follow the
    workload's (gradient checkpointing unless ``recompute: none``; forced balance when ``balanced``)."""

    model_config = ConfigDict(extra="forbid")
    harness: Literal[tuple(PEER_HARNESSES)]
    experts: Literal["grouped_mm", "eager"] = "grouped_mm"  # transformers' experts implementation


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str = ""
    # the comparison
    peer: Peer | None = None
    baseline: str | None = None  # another workload this one is reported against (e.g. FP8 against bf16)
    profile: bool = False  # profile the last step (outside the window) and keep the table in the results
    # the model and its depth
    model: str | None = None  # default qwen3-30b-a3b
    model_from: Literal["deepseek_v3_workload"] | None = None
    overrides: dict[str, Any] | None = None  # model_overrides; default {num_hidden_layers: layers}
    layers: int | None = Field(None, ge=1)
    tiny_model: str | None = None  # what a CPU plumbing run trains instead
    # rows
    packed: bool = False  # many short documents per row, or one document
    rows_per_step: int = Field(1, ge=1)
    rows_per_microbatch: int | None = Field(None, ge=1)
    row_tokens: int | None = Field(None, ge=1)
    balanced: bool = True  # forced exact expert balance (debug.force_load_balance)
    steps: int | None = Field(None, ge=3)
    window: tuple[int, int] | None = None
    # layout
    nproc: int | None = Field(None, ge=1)
    dp: int | None = Field(None, ge=1)
    ep: int | None = Field(None, ge=1)
    tp: int | None = Field(None, ge=1)
    cp: int | None = Field(None, ge=1)
    # recompute, kernels, optimizer, precision
    recompute: Literal["full", "none", "selective", "experts", "full_keep_attention"] | None = None
    compile: bool | None = None
    attention: str | None = None
    loss_chunk: int | None = Field(None, ge=0)
    precision_aware: bool | None = None
    offload: float | None = Field(None, ge=0, le=1)
    offload_update: Literal["device", "host"] | None = None
    lora: bool | None = None
    fp8: list[Literal["experts", "projections"]] | None = None

    @model_validator(mode="after")
    def _peer_runs_the_same_work(self) -> Workload:
        if self.peer is None:
            return self
        harness = PEER_HARNESSES[self.peer.harness]
        spec = self.engine_spec()
        model, tiny = spec.get("model", "qwen3-30b-a3b"), spec.get("tiny_model", "qwen3-moe-tiny")
        lora_peer = self.peer.harness in LORA_HARNESSES
        problems = [f"the peer trains {harness.model}, the workload {model}" if harness.model not in (None, model)
                    else None,
                    *(f"the peer trains {harness.family} models, the workload's {field} is {name}"
                      for field, name in (("model", model), ("tiny_model", tiny)) if family_of(name) != harness.family),
                    "packed rows" if self.packed else None,
                    "more than one row per step" if self.rows_per_step != 1 else None,
                    "several GPUs" if (self.nproc or 1) > 1 else None,
                    f"LoRA, which only {', '.join(LORA_HARNESSES)} train" if self.lora and not lora_peer else None,
                    f"no LoRA, which {self.peer.harness} trains" if not self.lora and lora_peer else None,
                    "FP8" if self.fp8 else None, "offload" if self.offload else None]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(f"a peer runs one bf16 row on one GPU of its family's model, LoRA only beside "
                             f"{', '.join(LORA_HARNESSES)}; this workload has {', '.join(problems)}")
        return self

    def engine_spec(self) -> dict[str, Any]:
        """The dict engine_speed.py's run_variant reads (the fields set, plus the shared model and row shape of
        ``model_from``, which a field the workload sets itself overrides: a longer row of the same model)."""
        spec = {k: v for k, v in self.model_dump(exclude_none=True).items() if k not in _NOT_ENGINE}
        spec["fp8"] = list(self.fp8) if self.fp8 else None
        spec = {k: v for k, v in spec.items() if v is not None}
        if "window" in spec:
            spec["window"] = list(spec["window"])
        if self.model_from:
            shared = _shared_shape(self.model_from)
            spec = {**shared, **spec}
        return spec

    def peer_settings(self) -> dict[str, Any]:
        """What the peer is told: its harness, the experts implementation, recompute and routing as the engine's,
        and with LoRA the engine's adapters."""
        assert self.peer is not None
        script = PEER_HARNESSES[self.peer.harness].script
        return {"harness": self.peer.harness, "script": f"bench/{script}", "experts": self.peer.experts,
                "recompute": self.recompute != "none", "balanced": self.balanced,
                **({"lora": dict(LORA)} if self.lora else {})}


def family_of(model: str) -> str | None:
    """The registered family of a registered model name (None for another name)."""
    from openrecipes.models.registry import families

    return next((family.name for family in families() if model in family.named_configs), None)


def _shared_shape(module_name: str) -> dict[str, Any]:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    module = importlib.import_module(module_name)
    return dict(model=module.MODEL, overrides=dict(module.OVERRIDES), tiny_model=module.TINY_MODEL,
                row_tokens=module.ROW_TOKENS, steps=module.STEPS, window=list(module.WINDOW))


class WorkloadFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workloads: dict[str, Workload]
    # YAML anchors shared by several entries (read by the YAML loader, ignored here)
    shared: dict[str, Any] = {}

    @model_validator(mode="after")
    def _baselines_exist(self) -> WorkloadFile:
        for name, workload in self.workloads.items():
            if workload.baseline is not None and workload.baseline not in self.workloads:
                raise ValueError(f"{name}: baseline {workload.baseline!r} is not a workload")
        return self


def read_workload_file(path: Path = WORKLOADS_FILE) -> WorkloadFile:
    return WorkloadFile.model_validate(yaml.safe_load(Path(path).read_text()))


@cache
def load_workloads(path: Path = WORKLOADS_FILE) -> dict[str, Workload]:
    return read_workload_file(path).workloads


def select(names: str | list[str], path: Path = WORKLOADS_FILE) -> dict[str, Workload]:
    """The named workloads, in the order given; an unknown name fails with the known ones listed."""
    names = [n for n in (names.split(",") if isinstance(names, str) else names) if n]
    known = load_workloads(path)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown workload(s) {', '.join(unknown)}; declared in {path}: {', '.join(known)}")
    return {n: known[n] for n in names}
