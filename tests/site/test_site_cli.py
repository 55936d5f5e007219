import argparse
import threading
import urllib.request

import pytest
from .site_fixtures import CATALOG

from openrecipes.site import cli
from openrecipes.site.serve import make_server


def _parse(argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="verb"))
    return parser.parse_args(argv)


def test_build_verb_then_serve_on_localhost(tmp_path, capsys):
    out = tmp_path / "site"
    args = _parse(["site", "build", "--recipes", str(CATALOG), "--out", str(out)])
    assert args.func(args) == 0
    cards = [p for p in CATALOG.glob("*/*/*.yaml") if not p.name.endswith(".recipe.yaml")]  # recipes get no page
    assert f"{len(cards)} recipe page(s)" in capsys.readouterr().out
    server = make_server(out, 0, quiet=True)
    assert server.server_address[0] == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/qwen3-30b-a3b/h200/attune-tp1-pp1-ep8-mt16k.html"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and b"6,913.2" in response.read()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_serve_needs_a_built_site(tmp_path):
    with pytest.raises(FileNotFoundError, match="site build"):
        make_server(tmp_path, 0)


def test_build_needs_a_catalog(tmp_path):
    args = _parse(["site", "build", "--recipes", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    with pytest.raises(FileNotFoundError):
        args.func(args)
