"""A real `app.py` process for the benchmarks that measure the served app from outside."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600


@dataclass
class ServedApp:
    process: subprocess.Popen
    url: str
    log_path: Path
    workdir: tempfile.TemporaryDirectory

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"unknown x {os.cpu_count()}"


def start_app(app_args: list[str], env: dict[str, str] | None = None,
              wrapper: list[str] = ()) -> ServedApp:
    """Start app.py on a free port with its session log in a temporary folder; return once
    /health answers 200 (raises with the log's tail if the process dies first). `wrapper`:
    a script (and its arguments) that runs app.py in its own process (bench/soak_probe.py)."""
    workdir = tempfile.TemporaryDirectory(prefix="kvscope-bench-")
    port = free_port()
    log_path = Path(workdir.name) / "app.log"
    command = [sys.executable, *wrapper, str(ROOT / "app.py"), "--port", str(port),
               "--db", str(Path(workdir.name) / "kvscope.db"), *app_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False",
                                        **(env or {})})
    app = ServedApp(process, f"http://127.0.0.1:{port}", log_path, workdir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"app.py exited with {process.returncode}:\n{app.log()[-3000:]}")
        try:
            if httpx.get(f"{app.url}/health", timeout=1).status_code == 200:
                return app
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_app(app)
    raise TimeoutError(f"app.py did not answer /health within {START_TIMEOUT_S} s")


def stop_app(app: ServedApp) -> None:
    app.process.send_signal(signal.SIGTERM)
    try:
        app.process.wait(30)
    except subprocess.TimeoutExpired:
        app.process.kill()
        app.process.wait()
    app.workdir.cleanup()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
