"""The package's shape: dependencies point down the layers, no module imports itself back through others,
torch.distributed stays in the parallel engine, every registered model family declares the whole contract, and a
one-process run works out its model config once."""

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "openrecipes"

# what each package may import from openrecipes (besides itself); cli/demo/__init__ sit on top and may use all
ALLOWED = {
    "config": {"utils"},
    "utils": set(),
    "data": {"config", "utils"},
    "models": {"config", "utils"},
    "parallel": {"config", "models", "utils"},
    "optim": {"parallel", "utils"},
    "checkpoint": {"config", "data", "models", "parallel", "utils"},
    "measure": {"config", "utils"},
    "plan": {"config", "measure", "models", "utils"},  # measure: the MFU formula
    # train asks the planner (which imports none of these) whether a run fits the host before starting it
    "train": {"checkpoint", "config", "data", "models", "optim", "parallel", "plan", "utils"},
    "verify": {"config", "data", "measure", "models", "optim", "utils"},
    "cards": {"config", "data", "measure", "models", "utils", "verify"},
    "site": {"cards", "config", "utils"},
    # the tuner sits on top: it runs train (as a process), measure and verify, and writes cards and the site
    "tune": {"cards", "config", "data", "measure", "models", "plan", "site", "train", "utils", "verify"},
}
# below every layer: any module may read the version there (never from the package's face, openrecipes/__init__.py)
BELOW_EVERY_LAYER = {"version"}
DISTRIBUTED_PACKAGES = {"parallel", "train", "checkpoint"}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    package = _package(path)
    if package not in ALLOWED:
        return
    for module, names in _imports(path):
        if module.startswith("torch.distributed"):
            assert package in DISTRIBUTED_PACKAGES, f"{path.name} imports {module}"
        assert module != "openrecipes" or "__version__" not in names, f"{path.name}: read openrecipes.version"
        if not module.startswith("openrecipes."):
            continue
        other = module.split(".")[1]
        if other == package or other in BELOW_EVERY_LAYER:
            continue
        assert other in ALLOWED[package], f"{package} must not import {module}"
        private = [name for name in names if name.startswith("_")]
        assert not private, f"{path.name} imports private {private} from {module}"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package under ``root`` and the package modules it imports, wherever in the file the
    import stands (a function's deferred import runs as surely as a top-level one); ``from a import b`` counts as
    importing ``a.b`` when that is a module. Imports under ``if TYPE_CHECKING:`` never run and are left out."""
    paths = {_module_name(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        tree = _tree(path)
        typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and _typing_only(block.test)
                       for node in ast.walk(block)}
        imported = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths else node.module
                             for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {other for other in imported if other in paths and other != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(frozenset(component))
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, f"import cycles: {[sorted(cycle) for cycle in cycles]}"


def test_the_cycle_finder_sees_deferred_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "train").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train" / "__init__.py").write_text("")
    (package / "train" / "engine.py").write_text("from pkg.train.images import check\n")
    (package / "train" / "images.py").write_text("def check():\n    from pkg.train import engine\n")
    (package / "train" / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from pkg.train import engine\n")
    (package / "train" / "loop.py").write_text("from pkg.train import engine, typed\n")
    assert import_cycles(import_graph(package)) == [frozenset({"pkg.train.engine", "pkg.train.images"})]


def test_run_directory_names_have_one_home():
    """The names of a save's directory (step-NNNNNN) and of a LoRA run's adapter are config/rundir.py's; every other
    module imports them (a pattern, glob or format of its own would drift apart)."""
    step_name = re.compile(r"^step-(\*|%0?6d|\\d|$)")
    home = ROOT / "config" / "rundir.py"
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == home:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and step_name.match(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                    and node.right.value == "adapter"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} / 'adapter'")
    assert not found, f"import the names from config/rundir.py: {found}"


def test_no_model_module_imports_the_recipe():
    offenders = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "models").rglob("*.py"))
                 for module, _ in _imports(path) if module.startswith("openrecipes.config.recipe")]
    assert not offenders, f"models/ must take plain values, not the recipe: {offenders}"


def test_a_one_process_train_resolves_the_model_config_once(tmp_path, monkeypatch):
    """`openrecipes train` on the tiny example works the model config out once, and hands it to every check, the
    build and the weights-fit check."""
    import torch

    from openrecipes.cli import main
    from openrecipes.models import resolve

    original, calls = resolve.resolve_model_config, []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):  # wherever it was imported by name
        if getattr(module, "resolve_model_config", None) is original:
            monkeypatch.setattr(module, "resolve_model_config", counted)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3-sft.yaml"
    try:
        assert main(["train", str(example), "--set", "steps=2", "--set", "global_batch=2", "--set", "data.build.rows=4",
                     "--set", "data.build.row_tokens=128", "--set", f"run_dir={tmp_path / 'run'}"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert len(calls) == 1, calls


def test_every_family_declares_the_whole_contract():
    import torch

    from openrecipes.data.templates import LOSS_MASKS
    from openrecipes.models.common.kernels import KernelOptions
    from openrecipes.models.families import TP_STYLES, family_for_config, family_for_model
    from openrecipes.models.registry import families
    from openrecipes.models.shape import ModelShape

    assert len(families()) >= 2
    for family in families():
        assert family.named_configs and family.model_types and family.chat_format in LOSS_MASKS
        plan = family.sharding
        assert set(plan.attention_tp.values()) <= set(TP_STYLES) and plan.replicated and plan.experts
        for name, factory in family.named_configs.items():
            config = factory()
            assert family_for_config(config) is family
            assert isinstance(family.planner_shape(config, name), ModelShape)
        # the smallest named config is built and every path of the sharding plan resolves in it
        config = min((f() for f in family.named_configs.values()), key=lambda c: c.hidden_size)
        model = family.build(config, device="cpu", dtype=torch.float32, seed=0, kernels=KernelOptions())
        assert isinstance(model, family.model_class) and family_for_model(model) is family
        for path in (plan.embedding, plan.final_norm, plan.lm_head):
            model.get_submodule(path)
        layers = plan.decoder_layers(model)
        assert len(layers) == config.num_hidden_layers
        # a family may hold dense layers (DeepSeek-V3's first ones): the plan says which, and at least one is MoE
        attention, moe = plan.attention_of(layers[0]), plan.moe_blocks(layers)[0]
        assert all(plan.moe_of(layer) is None or plan.moe_of(layer) is plan.feed_forward_of(layer) for layer in layers)
        assert attention.head_dim > 0 and attention.backend == "auto"
        # tensor parallelism reads the head counts from the attention module
        assert attention.num_kv_heads > 0 and attention.num_heads % attention.num_kv_heads == 0
        assert all(hasattr(attention, name) for name in plan.attention_tp)
        for weight, ffn_dim in plan.experts.items():
            assert getattr(moe.experts, weight).dim() > ffn_dim
        names = [n for n, _ in model.named_parameters()]
        covered = [n for n in names if ".experts." in n or any(part in n for part in plan.replicated)
                   or any(f".{p}." in n for p in plan.attention_tp)]
        assert covered == names
        if family.images is not None:  # its towers and projection name modules, and with the decoder cover the model
            paths = family.images.towers + family.images.projection
            encoder = [f"{p}.{n}" for p in paths for n, _ in model.get_submodule(p).named_parameters()]
            decoder = (plan.layers, plan.embedding, plan.final_norm, plan.lm_head)
            assert encoder and len(set(encoder)) == len(encoder)
            assert sorted(encoder + [n for n in names if n.startswith(decoder)]) == sorted(names)
            assert 0 <= family.images.image_token_id(config) < config.vocab_size
            assert all(size > 0 for size in family.images.patch_geometry(config))
        # the router load-balancing loss: declared only by a family whose model routes with softmax top-k routers
        # (what models/common/router_loss.py pools), through config fields every named config holds
        from openrecipes.models.common.moe import SoftmaxTopKRouter

        if family.aux_loss is not None:
            assert any(isinstance(m, SoftmaxTopKRouter) for m in model.modules()), family.name
            for factory in family.named_configs.values():
                assert isinstance(family.aux_loss.requested(factory()), bool)
                assert family.aux_loss.coefficient(factory()) >= 0
                assert isinstance(getattr(factory(), family.aux_loss.request_key), bool)
        config_dict = family.config_to_hf(config)
        assert config_dict["model_type"] in family.model_types


def test_every_run_has_a_parallel_state():
    """One process has a state too (parallel.mesh.single_process): no function takes None for it or guards it."""
    import re

    none_state = re.compile(r"\bparallel(?:_state)?\s*(?:is None|is not None|=\s*None|:\s*[\w.]+\s*\|\s*None)")
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in sorted(ROOT.rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1) if none_state.search(line)]
    assert offenders == [], "\n".join(offenders)


def test_mfu_is_computed_in_one_place():
    """6 · N (FLOPs per active parameter per token) is written once, in measure/metrics.py; plan/, cards/ and the
    tuner call its functions."""
    import re

    formula = re.compile(r"\b6(?:\.0)?\s*\*\s*[\w.()\[\]\"']*(?:active|param|n_active)", re.IGNORECASE)
    home = ROOT / "measure" / "metrics.py"
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in sorted(ROOT.rglob("*.py")) if path != home
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if formula.search(line.split("#")[0])]
    assert offenders == [], "\n".join(offenders)
    assert formula.search(home.read_text())  # the check sees the formula where it lives
