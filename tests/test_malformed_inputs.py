"""Every verb, fed malformed input of each kind through the CLI entry, exits non-zero with one line on stderr naming
the file or field, never a traceback (tests/test_hostile_inputs.py holds the older cases)."""

import json
import shutil

import pytest
import torch

from openrecipes.cli import main


def _one_line_error(capsys, argv, *names, prefix="openrecipes"):
    """Run the CLI on ``argv`` (an exception escaping main fails the test); return its one stderr line."""
    code = main([str(arg) for arg in argv])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


def test_train_on_a_directory_names_it(tmp_path, capsys):
    _one_line_error(capsys, ["train", tmp_path], tmp_path, "directory", prefix="openrecipes train: error")


def _tiny_hf_config():
    from openrecipes.models.registry import get_config

    return get_config("qwen3-moe-tiny").to_hf_dict()


def _without(raw, *keys):
    return {key: value for key, value in raw.items() if key not in keys}


# name -> (config.json content, what the error must name)
BAD_CONFIGS = {
    "a list": (lambda raw: [raw], ["config.json", "JSON object"]),
    "no hidden_size nor head_dim": (lambda raw: _without(raw, "hidden_size", "head_dim"), ["config.json", "hidden_size"]),
    "a string hidden_size": (lambda raw: {**raw, "hidden_size": "64"}, ["config.json", "hidden_size='64'"]),
    "a string in a list field": (lambda raw: {**raw, "mlp_only_layers": ["a"]}, ["config.json", "mlp_only_layers"]),
    "no attention heads": (lambda raw: _without({**raw, "num_attention_heads": 0}, "head_dim"),
                           ["config.json", "num_attention_heads"]),
}


def _hf_dir(tmp_path, config, *, weights=True):
    from safetensors.torch import save_file

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))
    if weights:
        save_file({"model.norm.weight": torch.ones(4)}, str(hf_dir / "model.safetensors"))
    return hf_dir


@pytest.mark.parametrize("verb", ["convert import", "verify parity"])
@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_malformed_config_json_is_one_line(tmp_path, capsys, verb, case):
    pytest.importorskip("transformers")
    make, names = BAD_CONFIGS[case]
    hf_dir = _hf_dir(tmp_path, make(_tiny_hf_config()))
    argv = [*verb.split(), hf_dir] + ([tmp_path / "native"] if verb == "convert import" else [])
    _one_line_error(capsys, argv, *names)


def test_verify_parity_without_safetensors_names_the_directory(tmp_path, capsys):
    pytest.importorskip("transformers")
    hf_dir = _hf_dir(tmp_path, _tiny_hf_config(), weights=False)
    _one_line_error(capsys, ["verify", "parity", hf_dir], hf_dir, "safetensors")


@pytest.mark.parametrize("template, names", [
    ("{% for i in range(10**12) %}x{% endfor %}", ["range()"]),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", ["range()"]),
    ("{{ 'x' * 10**10 }}", ["'*'"]),
    ("{{ 7 ** 100000 }}", ["'**'"]),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ["too deeply"]),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", ["'~'"]),
    ("{% set ns = namespace(s=['x']) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     ["'+'"]),
    ("{{ 'x' | center(4000000000) }}", ["center filter"]),
    ("{{ ('x\n' * 8000000) | indent(1000) }}", ["indent filter"]),
    ("{{ '%0300000000d' % 1 }}", ["'%'"]),
    ("{{ '{:>300000000}'.format('x') }}", ["str.format"]),
    ("{% set a = [1] * 5000 %}{{ ([a] * 5000) | sum(start=[]) | length }}", ["sum filter"]),
], ids=["range 10**12", "nested ranges", "repeated string", "power", "endless macro", "doubled by ~",
        "doubled by +", "center", "indent", "percent padding", "format padding", "sum of lists"])
def test_a_template_without_bounds_is_stopped(tmp_path, capsys, template, names):
    path = tmp_path / "t.jinja"
    path.write_text(template + "\n")
    _one_line_error(capsys, ["data", "build", "--loss-mask", "qwen3", "--row-tokens", "64", "--out",
                             tmp_path / "rows", "--no-progress", "--chat-template", path],
                    "chat template", *names)


def test_a_template_running_too_long_is_stopped(tmp_path, capsys, monkeypatch):
    from openrecipes.data import template_sandbox

    monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 0.2)
    path = tmp_path / "t.jinja"  # loops over a string take no range() budget: the clock stops them
    path.write_text("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}\n")
    _one_line_error(capsys, ["data", "build", "--loss-mask", "qwen3", "--row-tokens", "64", "--out",
                             tmp_path / "rows", "--no-progress", "--chat-template", path],
                    "chat template", "0.2 s")


@pytest.fixture(scope="module")
def built_rows(tmp_path_factory):
    from openrecipes.config.recipe import DataBuild
    from openrecipes.data.build import build

    out = tmp_path_factory.mktemp("rows") / "tiny"
    build(DataBuild(loss_mask="qwen3", row_tokens=64, rows=8, seed=1), out, progress=False)  # the bundled data
    return out


def _damage_by_truncation(rows):
    parquet = rows / "rows.parquet"
    parquet.write_bytes(parquet.read_bytes()[: parquet.stat().st_size // 2])


def _damage_and_rehash(rows):
    """A damaged parquet file whose manifest was edited to match it: the parquet reader itself must refuse it."""
    from openrecipes.utils import sha256_file

    _damage_by_truncation(rows)
    manifest = json.loads((rows / "manifest.json").read_text())
    manifest["parquet_sha256"] = sha256_file(rows / "rows.parquet")
    (rows / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, names", [(_damage_by_truncation, ["rows.parquet", "sha256"]),
                                           (_damage_and_rehash, ["rows.parquet", "not a readable"])],
                         ids=["changed", "changed and rehashed"])
def test_train_on_damaged_rows_is_one_line(built_rows, tmp_path, capsys, damage, names):
    torch.set_num_threads(1)
    rows = tmp_path / "rows"
    shutil.copytree(built_rows, rows)
    damage(rows)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: qwen3-moe-tiny\ndata: {{rows: {rows}}}\nlayout: {{max_tokens_per_gpu: 128}}\n"
                      f"precision: fp32\nsteps: 1\nglobal_batch: 1\nrun_dir: {tmp_path / 'run'}\n"
                      "logging: {progress: false}\n")
    _one_line_error(capsys, ["train", recipe], *names, prefix="openrecipes train: error")


@pytest.mark.parametrize("nesting", ["a: " + "[" * 50_000 + "]" * 50_000, "- " * 50_000 + "x"],
                         ids=["flow", "block"])
def test_card_validate_on_deep_yaml_names_the_line(tmp_path, capsys, nesting):
    card = tmp_path / "deep.yaml"
    card.write_text(nesting + "\n")
    # card validate reports each problem as FILE:LINE: message, the way compilers do
    _one_line_error(capsys, ["card", "validate", card], "nesting deeper than", prefix=f"{card}:1:")


def test_the_bounded_sum_filter_sums_as_jinja_does():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from openrecipes.data.template_sandbox import BoundedSandbox

    source = ("{{ [[1], [2, 3]] | sum(start=[]) }} {{ [(1,), (2,)] | sum(start=()) }} {{ [1, 2.5] | sum }} "
              "{{ [{'a': 1}, {'a': 2}] | sum(attribute='a') }} {{ [] | sum(start=[]) }}")
    assert BoundedSandbox().from_string(source).render() == ImmutableSandboxedEnvironment().from_string(
        source).render()
