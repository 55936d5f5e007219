"""`openrecipes site build` and `openrecipes site serve`."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path("site-out")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("site", help="build or serve the static recipe site")
    verbs = parser.add_subparsers(dest="site_verb", metavar="ACTION", required=True)

    build = verbs.add_parser("build", help="write the static site from the card catalog")
    build.add_argument("--recipes", type=Path, action="append", metavar="DIR",
                       help="catalog directory; repeat it to put several catalogs on one site (default: ./recipes)")
    build.add_argument("--verification", type=Path, default=None, metavar="DIR",
                       help="verification cards, one model page each (default: verification/ beside the first "
                            "--recipes, when it exists)")
    build.add_argument("--out", type=Path, default=DEFAULT_OUT, help="site directory to write")
    build.set_defaults(func=_build)

    serve = verbs.add_parser("serve", help="serve a built site on 127.0.0.1")
    serve.add_argument("--dir", type=Path, default=DEFAULT_OUT, help="site directory to serve")
    serve.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    serve.set_defaults(func=_serve)


def _build(args: argparse.Namespace) -> int:
    from openrecipes.site.build import build_site

    catalogs = args.recipes or [Path("recipes")]
    for catalog in catalogs:
        if not catalog.is_dir():
            raise FileNotFoundError(f"{catalog}: no such catalog directory")
    verification = args.verification
    if verification is None and (catalogs[0].resolve().parent / "verification").is_dir():
        verification = catalogs[0].resolve().parent / "verification"
    elif verification is not None and not verification.is_dir():
        raise FileNotFoundError(f"{verification}: no such verification directory")
    site = build_site(catalogs, args.out, verification)
    print(f"wrote {args.out}/index.html, {len(site.pages)} recipe page(s) and {len(site.model_pages)} model page(s)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from openrecipes.site.serve import make_server

    server = make_server(args.dir, args.port)
    host, port = server.server_address[:2]
    print(f"serving {args.dir} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
