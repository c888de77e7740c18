"""The local web UI: python train_ui.py [--host 127.0.0.1] [--port 7860] [--root DIR ...]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_ui.py", description="A local web UI for train_network.py: edit a config, check the dataset, "
        "start, watch, stop and resume runs.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1); any other needs the token (see --token_file)")
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    parser.add_argument("--root", action="append", metavar="DIR",
                        help="a folder the UI may read and write under (models, data, outputs); repeat for more; "
                             "default: the current folder")
    parser.add_argument("--token_file", metavar="PATH",
                        help="where the access token for a non-loopback --host is kept (created on first start, "
                             "readable by its owner only); default ~/.config/lora-trainer/ui_token")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from library.ui import security

    cwd = Path.cwd()
    roots = [Path(r) for r in (args.root or ["."])]
    problems = [f"--root {r}: not a folder" for r in roots if not (cwd / r).is_dir()]
    if not 0 < args.port < 65536:
        problems.append(f"--port {args.port}: not a port number")
    if problems:
        print("error:" if len(problems) == 1 else f"error: {len(problems)} problems:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    token = None
    if not security.is_loopback(args.host):
        token_file = Path(args.token_file) if args.token_file else security.default_token_file()
        token, created = security.load_or_create_token(token_file)
        if created:
            print(f"access token (shown once; kept in {token_file}, readable by you only): {token}")
        else:
            print(f"access token: in {token_file}")

    import uvicorn

    from library.ui.app import Settings, create_app

    app = create_app(Settings(roots=roots, cwd=cwd, host=args.host, port=args.port, token=token))
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"lora-trainer UI on http://{shown_host}:{args.port}/  (roots: "
          f"{', '.join(str(p) for p in app.state.manager.roots)})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
