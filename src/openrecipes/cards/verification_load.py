"""Load verification cards through the hostile-YAML loader, and validate a mix of recipe and verification cards.

A file is a verification card when its top-level `kind` is `verification`; everything else is a recipe card.
Problems name the file, the line and the field path, as for recipe cards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pydantic

from openrecipes.cards.validate import (
    CardError, Problem, find_card_files, schema_problems, to_problem, validate_file,
)
from openrecipes.cards.verification import VerificationCard
from openrecipes.cards.verification_checks import check_verification_card
from openrecipes.config.safe_yaml import UnsafeYamlError, load_plain_yaml_file

KIND = "verification"


@dataclass(kw_only=True)
class LoadedVerification:
    path: Path
    card: VerificationCard
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def item_problems(self, index: int) -> list[Problem]:
        """The errors found in item ``index`` (their field path starts with items[index])."""
        prefix = f"items[{index}]"
        return [p for p in self.problems if p.severity == "error"
                and (p.path == prefix or p.path.startswith(prefix + "."))]


def is_verification_data(data: object) -> bool:
    return isinstance(data, dict) and data.get("kind") == KIND


def load_verification_card(path: str | os.PathLike) -> LoadedVerification:
    """Load one verification card and run its checks; raise CardError if it is not a valid card at all."""
    path = Path(path)
    source = str(path)
    try:
        data, lines, _ = load_plain_yaml_file(path)
    except UnsafeYamlError as error:
        raise CardError([Problem(file=error.source, line=error.line, path="", message=error.message)]) from None
    if not is_verification_data(data):
        raise CardError([Problem(file=source, line=1, path="kind",
                                 message=f"a verification card is a YAML mapping with kind: {KIND}")])
    try:
        card = VerificationCard.model_validate(data)
    except pydantic.ValidationError as error:
        raise CardError(schema_problems(error, source, lines)) from None
    problems = [to_problem(finding, source, lines) for finding in check_verification_card(card)]
    return LoadedVerification(path=path, card=card, problems=problems)


def _is_verification_file(path: Path) -> bool:
    # a cheap look at the top level; the full load (with every refusal) happens in the loader proper
    try:
        data, _, _ = load_plain_yaml_file(path)
    except UnsafeYamlError:
        return False
    return is_verification_data(data)


def validate_any(paths: Iterable[str | os.PathLike], *, published: bool | None = None) -> tuple[int, list[Problem]]:
    """Validate every card under ``paths``, recipe or verification; returns (files checked, problems).
    ``published`` is for recipe cards (``validate.load_card``)."""
    paths = list(paths)
    files = find_card_files(paths)
    if not files:
        raise ValueError(f"no card files (*.yaml) under {', '.join(str(p) for p in paths)}")
    problems: list[Problem] = []
    for path in files:
        if _is_verification_file(path):
            try:
                problems.extend(load_verification_card(path).problems)
            except CardError as error:
                problems.extend(error.problems)
        else:
            problems.extend(validate_file(path, published=published)[1])
    return len(files), problems


def load_verification_dir(directory: str | os.PathLike) -> list[LoadedVerification]:
    """Every verification card in ``directory`` (sorted); raise CardError on one that does not load at all."""
    files = find_card_files([directory])
    return [load_verification_card(path) for path in files]
