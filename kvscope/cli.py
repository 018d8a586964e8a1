"""The `kvscope` command: `kvscope serve` (the server, kvscope/app.py) and `kvscope replay`."""

import sys

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
        from kvscope.app import main as serve_main

        serve_main(rest, prog="kvscope serve")


if __name__ == "__main__":
    main()
