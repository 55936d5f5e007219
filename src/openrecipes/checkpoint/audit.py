"""Tensor-by-tensor comparison of two Hugging Face checkpoint directories.

A tensor that B holds in fp32 where A holds a narrower float (bf16, fp16) with every value unchanged is a
*promotion*, as import does for the residual gates: reported as such and not a failure. Every other dtype change
(narrowing, fp32 -> fp64, ...) fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from openrecipes.checkpoint.safetensors_io import HFCheckpoint
from openrecipes.utils import one_line


@dataclass(kw_only=True)
class AuditReport:
    missing: list[str] = field(default_factory=list)      # in A, not in B
    extra: list[str] = field(default_factory=list)        # in B, not in A
    reshaped: list[tuple[str, tuple, tuple]] = field(default_factory=list)
    dtype_changed: list[tuple[str, str, str]] = field(default_factory=list)
    promoted: list[tuple[str, str, str]] = field(default_factory=list)  # (name, A dtype, "float32"), values equal
    exact: int = 0
    differing: list[tuple[str, float]] = field(default_factory=list)  # (name, max abs difference)
    max_abs_diff: float = 0.0
    compared: int = 0
    elements: int = 0  # values compared (the tensors of matching shape)

    def passed(self, atol: float = 0.0) -> bool:
        beyond = [name for name, diff in self.differing if not diff <= atol]
        return not (self.missing or self.extra or self.reshaped or self.dtype_changed or beyond)

    def table(self, atol: float = 0.0) -> str:
        rows = [("tensors compared", str(self.compared)), ("elements compared", f"{self.elements:,}"),
                ("exact matches", str(self.exact)),
                ("missing in B", str(len(self.missing))), ("extra in B", str(len(self.extra))),
                ("reshaped", str(len(self.reshaped))), ("dtype changed", str(len(self.dtype_changed))),
                ("promoted to fp32", f"{len(self.promoted)} (values unchanged)"),
                ("values differ", str(len(self.differing))), ("max abs difference", f"{self.max_abs_diff:.3e}"),
                ("result", "PASS" if self.passed(atol) else f"FAIL (atol {atol:g})")]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        details = ([f"missing  {n}" for n in self.missing] + [f"extra    {n}" for n in self.extra]
                   + [f"reshaped {n}: {a} -> {b}" for n, a, b in self.reshaped]
                   + [f"dtype    {n}: {a} -> {b}" for n, a, b in self.dtype_changed]
                   + [f"promoted {n}: {a} -> {b}, values unchanged" for n, a, b in self.promoted]
                   + [f"differs  {n}: max abs {d:.3e}" for n, d in self.differing if not d <= atol])
        # tensor names come from the files: a name holding a line break must not add a line ("result  PASS")
        return "\n".join(lines + ([""] + [one_line(line) for line in details[:50]] if details else []))

    def to_dict(self, atol: float = 0.0) -> dict:
        return {"passed": self.passed(atol), "atol": atol, "compared": self.compared, "elements": self.elements,
                "exact": self.exact,
                "missing": self.missing, "extra": self.extra,
                "reshaped": [{"name": n, "a": list(a), "b": list(b)} for n, a, b in self.reshaped],
                "dtype_changed": [{"name": n, "a": a, "b": b} for n, a, b in self.dtype_changed],
                "promoted": [{"name": n, "a": a, "b": b} for n, a, b in self.promoted],
                "differing": [{"name": n, "max_abs_diff": d} for n, d in self.differing],
                "max_abs_diff": self.max_abs_diff}


def audit(a_dir: str | Path, b_dir: str | Path) -> AuditReport:
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    report = AuditReport()
    keys_a, keys_b = set(a.keys()), set(b.keys())
    report.missing = sorted(keys_a - keys_b)
    report.extra = sorted(keys_b - keys_a)
    for name in sorted(keys_a & keys_b):
        ta, tb = a.get(name), b.get(name)
        report.compared += 1
        if ta.shape != tb.shape:
            report.reshaped.append((name, tuple(ta.shape), tuple(tb.shape)))
            continue
        report.elements += ta.numel()
        if _is_promotion(ta, tb):
            report.promoted.append((name, _name(ta.dtype), _name(tb.dtype)))
            report.exact += 1
            continue
        if ta.dtype != tb.dtype:
            report.dtype_changed.append((name, str(ta.dtype), str(tb.dtype)))
        if torch.equal(ta, tb.to(ta.dtype)) and ta.dtype == tb.dtype:
            report.exact += 1
            continue
        diff = (ta.double() - tb.double()).abs().max().item() if ta.numel() else 0.0
        report.differing.append((name, diff))
        report.max_abs_diff = max(report.max_abs_diff, diff)
    return report


def _is_promotion(ta: torch.Tensor, tb: torch.Tensor) -> bool:
    """B is fp32, A a narrower float, and widening A gives B exactly (so no value changed)."""
    return (tb.dtype == torch.float32 and ta.is_floating_point() and torch.finfo(ta.dtype).bits < 32
            and torch.equal(ta.to(torch.float32), tb))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
