"""Load and validate recipe cards: safe YAML, the schema, then the consistency checks.

Every problem names the file, the line and the YAML path of the field (`layout.tp`), so a
reader can go straight to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import pydantic

from openrecipes.cards.checks import Finding, Loc, check_card
from openrecipes.cards.paths import find_absolute_paths, is_catalog_path
from openrecipes.config.safe_yaml import UnsafeYamlError, load_plain_yaml_file
from openrecipes.cards.schema import RecipeCard
from openrecipes.utils import one_line, path_inside

CARD_SUFFIXES = (".yaml", ".yml")
# a runnable recipe beside its card (recipes/<model>/<gpu>/<name>.recipe.yaml): not a card, skipped in directories
RECIPE_SUFFIXES = (".recipe.yaml", ".recipe.yml")


@dataclass(frozen=True, kw_only=True)
class Problem:
    file: str
    line: int | None
    path: str
    message: str
    severity: Literal["error", "warning", "note"] = "error"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        field_path = f" {self.path}:" if self.path else ""
        prefix = "" if self.severity == "error" else f"{self.severity}: "
        # a file name or key holding a line break must not split the problem over lines (or forge one of its own)
        return one_line(f"{where}:{field_path} {prefix}{self.message}")


@dataclass(kw_only=True)
class LoadedCard:
    """A card that passed the schema, with what the site needs beside it."""

    path: Path
    card: RecipeCard
    text: str
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)


class CardError(ValueError):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems if p.severity == "error"))


def format_loc(loc: Iterable[Any]) -> str:
    """('correctness', 'component_tests', 0, 'result') -> 'correctness.component_tests[0].result'."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not str(part).isprintable():  # a key with control or bidi characters is shown escaped, never raw
            text += f"[{str(part)!r}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _line_for(lines: dict[tuple[Any, ...], int], loc: Loc) -> int | None:
    # the deepest written ancestor: a missing field points at its parent mapping
    for cut in range(len(loc), -1, -1):
        if tuple(loc[:cut]) in lines:
            return lines[tuple(loc[:cut])]
    return None


def _shown(value: Any, limit: int = 80) -> str:
    """A rejected value as a problem quotes it: its repr, cut to ``limit`` characters (a card may hold a
    megabyte-long string or a thousand-digit number, which would bury the line that names the field)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def schema_problems(error: pydantic.ValidationError, source: str,
                     lines: dict[tuple[Any, ...], int]) -> list[Problem]:
    problems = []
    for item in error.errors(include_url=False):
        loc = tuple(item["loc"])
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field (not in the card schema)"
        elif item["type"] == "missing":
            message = "required field is missing"
        elif "input" in item and not isinstance(item["input"], (dict, list)):
            message += f", got {_shown(item['input'])}"
        problems.append(Problem(file=source, line=_line_for(lines, loc), path=format_loc(loc),
                                message=message))
    return problems


def load_card(path: str | os.PathLike, *, published: bool | None = None) -> LoadedCard:
    """Load one card and run every check; raise CardError if it is not a valid card at all.

    Consistency errors do not raise: they are in the result's ``problems`` (see ``ok``). ``published``: whether
    the card is one of a catalog's, where an absolute machine path is an error rather than a warning; None (the
    default) decides by where the file is (``paths.is_catalog_path``: under a repository's ``recipes/``).
    """
    path = Path(path)
    source = str(path)
    try:
        data, lines, text = load_plain_yaml_file(path)
    except UnsafeYamlError as error:
        raise CardError([Problem(file=error.source, line=error.line, path="",
                                 message=error.message)]) from None
    if not isinstance(data, dict):
        raise CardError([Problem(file=source, line=1, path="",
                                 message="a card is a YAML mapping at the top level")])
    try:
        card = RecipeCard.model_validate(data)
    except pydantic.ValidationError as error:
        raise CardError(schema_problems(error, source, lines)) from None
    problems = [to_problem(finding, source, lines) for finding in check_card(card)]
    published = is_catalog_path(path) if published is None else published
    problems += [to_problem(finding, source, lines) for finding in path_findings(data, published=published)]
    return LoadedCard(path=path, card=card, text=text, problems=problems)


def path_findings(tree: Any, *, published: bool) -> list[Finding]:
    """One finding per field holding absolute machine paths: an error on a published card, else a warning."""
    by_field: dict[Loc, list[str]] = {}
    for loc, found in find_absolute_paths(tree):
        by_field.setdefault(loc, []).append(found)
    findings = []
    for loc, found in by_field.items():
        more = f" (and {len(found) - 1} more: {', '.join(found[1:4])}{', ...' if len(found) > 4 else ''})" \
            if len(found) > 1 else ""
        message = (f"{format_loc(loc)} holds the absolute machine path {found[0]!r}{more}, which a reader's clone of "
                   "the repository does not have: use a path relative to the repository (e.g. a recipe under "
                   "recipes/) or name the build (input, tokenizer, flags) and its hash")
        if not published:
            message += " (a warning outside a repository's recipes/ catalog, an error in it)"
        findings.append(Finding(loc=loc, message=message, severity="error" if published else "warning"))
    return findings


def to_problem(finding: Finding, source: str, lines: dict[tuple[Any, ...], int]) -> Problem:
    return Problem(file=source, line=_line_for(lines, finding.loc), path=format_loc(finding.loc),
                   message=finding.message, severity=finding.severity)


def validate_file(path: str | os.PathLike, *, published: bool | None = None
                  ) -> tuple[LoadedCard | None, list[Problem]]:
    """The card and its problems, or None and the problems that kept it from loading (``published``: load_card)."""
    try:
        loaded = load_card(path, published=published)
    except CardError as error:
        return None, error.problems
    return loaded, loaded.problems


def find_card_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files named directly, and every *.yaml / *.yml under directories (sorted, recursive), but recipes
    (*.recipe.yaml) there."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            walked = sorted(p for p in path.rglob("*") if p.suffix in CARD_SUFFIXES and p.is_file()
                            and not p.name.endswith(RECIPE_SUFFIXES))
            # a link in the directory to a file outside it is refused by name: a catalog must not publish (or
            # quote in its errors) a file of whoever builds it
            found.extend(path_inside(path, str(p.relative_to(path)), source=path, key="card file") for p in walked)
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return found


def validate_paths(paths: Iterable[str | os.PathLike], *, published: bool | None = None
                   ) -> tuple[list[LoadedCard], list[Problem]]:
    """Validate every card under ``paths``; returns the loaded cards and all problems (``published``: load_card)."""
    paths = list(paths)
    files = find_card_files(paths)
    if not files:
        raise ValueError(f"no card files (*.yaml) under {', '.join(str(p) for p in paths)}")
    cards: list[LoadedCard] = []
    problems: list[Problem] = []
    for path in files:
        loaded, found = validate_file(path, published=published)
        problems.extend(found)
        if loaded is not None:
            cards.append(loaded)
    return cards, problems
