import pytest

from openrecipes.config.recipe import recipe_from_dict


@pytest.fixture(scope="session")
def rows_dir(tmp_path_factory):
    from openrecipes.config.recipe import DataBuild
    from openrecipes.data.build import build

    out = tmp_path_factory.mktemp("rows") / "tiny"
    build(DataBuild(loss_mask="qwen3", row_tokens=64, rows=48, seed=1), out, progress=False)  # the bundled data
    return out


@pytest.fixture()
def make_recipe(rows_dir, tmp_path):
    def make(**overrides):
        tree = {
            "model": "qwen3-moe-tiny", "data": {"rows": str(rows_dir)},
            "layout": {"max_tokens_per_gpu": 128}, "precision": "fp32", "steps": 6, "global_batch": 4,
            "optimizer": {"lr": 3e-3, "warmup_fraction": 0.2, "min_lr": 3e-4, "weight_decay": 0.1},
            "run_dir": str(tmp_path / "run"), "logging": {"progress": False},
        }
        for key, value in overrides.items():
            node = tree
            *parents, leaf = key.split("__")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return recipe_from_dict(tree)

    return make
