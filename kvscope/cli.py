"""The `kvscope` command: `kvscope serve` (the server, app.py's flags) and `kvscope replay`."""

import importlib.util
import sys
from pathlib import Path

COMMANDS = {"serve": "run the server and dashboard (the flags of `python app.py`)",
            "replay": "replay a recorded session or a trace under other engine knobs"}
USAGE = "usage: kvscope {serve,replay} ...\n" + "".join(
    f"  {name:<8}{text}\n" for name, text in COMMANDS.items())


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write(USAGE)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    if command == "replay":
        from kvscope.engine.replay.cli import main as replay_main
        from kvscope.storage import replay_source

        replay_main(rest, session_logs=replay_source)
    else:
        serve_main(rest)


def serve_main(argv: list[str]) -> None:
    """app.py's main. kvscope installs from its checkout (`pip install -e .`), whose top
    holds app.py beside the package folders."""
    app_path = Path(__file__).resolve().parents[1] / "app.py"
    if not app_path.is_file():
        raise SystemExit(f"kvscope serve: no app.py beside the package at {app_path.parent}; "
                         "install kvscope from its checkout (pip install -e .)")
    spec = importlib.util.spec_from_file_location("kvscope_app", app_path)
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    sys.argv[0] = "kvscope serve"
    app.main(argv)


if __name__ == "__main__":
    main()
