"""Seconds from `python app.py` to a served /health, for N starts in a row (JSON on stdout).

The first start of a fresh machine converts the default model and profiles the token
budget; later starts reuse both. Run it under the bench lock:

    flock /work/bench.lock .venv/bin/python bench/startup.py --starts 2
"""

import argparse
import json
import platform
import time

from served import cpu_name, start_app, stop_app  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=2, help="starts in a row")
    parser.add_argument("app_args", nargs="*", help="extra app.py flags (after --)")
    args = parser.parse_args()
    seconds = []
    for _ in range(args.starts):
        started = time.perf_counter()
        app = start_app(args.app_args)
        seconds.append(round(time.perf_counter() - started, 1))
        stop_app(app)
    print(json.dumps({"bench": "startup", "app_args": args.app_args, "seconds": seconds,
                      "cpu": cpu_name(), "python": platform.python_version()}, indent=2))


if __name__ == "__main__":
    main()
