"""One import root: kvscope installs as `kvscope.*` and takes no generic top-level name;
and installed from its wheel, it serves without the checkout.

Checked from outside the repository (a fresh interpreter in another folder), as a user
who installed kvscope into an environment of their own would import it.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.engine.replay.cost_model import StepCost
from kvscope.engine.sampling_params import SamplingParams
from kvscope.kernels import cpu_extension

REPO = Path(__file__).resolve().parents[1]
# What a wheel is built from: the build files and the folders setup.py installs.
BUILD_INPUTS = ("setup.py", "pyproject.toml", "README.md", "kvscope", "engine", "kernels", "ui",
                "storage")


def run_in(folder: Path, script: str) -> dict:
    result = subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_only_kvscope_is_installed_at_the_top(tmp_path):
    found = run_in(tmp_path, (
        "import importlib.util, json\n"
        "from kvscope import LLM, SamplingParams\n"
        "import kvscope.engine, kvscope.kernels, kvscope.ui, kvscope.storage\n"
        "names = ('engine', 'kernels', 'ui', 'storage')\n"
        "specs = {n: importlib.util.find_spec(n) for n in names}\n"
        "print(json.dumps({'top': {n: s.origin if s else None for n, s in specs.items()},\n"
        "                  'parts': [m.__file__ for m in (kvscope.engine, kvscope.kernels)],\n"
        "                  'api': [LLM.__module__, SamplingParams.__module__]}))\n"))
    for name, origin in found["top"].items():
        # Hugging Face's `kernels` may be installed (the dev extras install it); ours never is.
        assert origin is None or Path(origin).resolve() != REPO / name / "__init__.py", name
    assert [Path(path).parent.name for path in found["parts"]] == ["engine", "kernels"]
    assert found["api"] == ["kvscope.engine.entrypoints.llm", "kvscope.engine.sampling_params"]


def test_hugging_face_kernels_beside_kvscope(tmp_path, tiny_model):
    """transformers probes for a package named `kernels` (and its GGUF code imports from
    it): with Hugging Face's installed, both packages import and transformers loads a model."""
    folder = tiny_model("llama").path
    found = run_in(tmp_path, (
        "import json, kernels, kvscope.kernels, transformers\n"
        f"model = transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})\n"
        "print(json.dumps({'hf': kernels.__file__, 'ours': kvscope.kernels.__file__,\n"
        "                  'model': type(model).__name__}))\n"))
    assert Path(found["hf"]).parent.parent.name == "site-packages"
    assert Path(found["ours"]).resolve().parent == REPO / "kernels"
    assert found["model"] == "LlamaForCausalLM"


def test_inside_the_repository_installed_packages_win_over_its_folders(tiny_model):
    """Run from the repository (as `python app.py` and `python -m pytest` are), its folders
    are on sys.path too: Hugging Face's `kernels`, not kernels/, is what transformers gets."""
    folder = tiny_model("llama").path
    found = run_in(REPO, (
        "import json, kvscope, transformers\n"
        "import kernels\n"
        f"model = transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})\n"
        "print(json.dumps({'hf': kernels.__file__, 'model': type(model).__name__}))\n"))
    assert Path(found["hf"]).parent.parent.name == "site-packages"
    assert found["model"] == "LlamaForCausalLM"


def test_the_kvscope_command_serves_with_app_flags(tmp_path):
    """The console script pyproject installs: `serve` takes app.py's flags (`replay` is
    run in-process by tests/test_replay.py)."""
    command = Path(sys.executable).parent / "kvscope"
    serve = subprocess.run([command, "serve", "--help"], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout
    assert "--block-size" in serve and "--graceful-shutdown-s" in serve
    assert serve.startswith("usage: kvscope serve")
    unknown = subprocess.run([command, "bogus"], cwd=tmp_path, capture_output=True, text=True)
    assert unknown.returncode == 2 and "serve" in unknown.stderr


def installed_wheel(tmp_path: Path) -> tuple[Path, Path]:
    """A venv with kvscope installed from a wheel of this checkout: no editable install, no
    checkout on its path. A .pth file lends it this interpreter's site-packages folders for
    the dependencies; a folder a .pth file names only goes on the path (the .pth files in it
    are not run), so the finder of an editable kvscope there stays out. Returns the venv's
    bin/ and site-packages folders."""
    source, venv = tmp_path / "source", tmp_path / "venv"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-qq"]
    # Offline: the build runs on this interpreter's setuptools, and nothing is fetched.
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", tmp_path / "wheels", source], check=True)
    (wheel,) = (tmp_path / "wheels").glob("kvscope-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "--no-deps", wheel], check=True)
    site = Path(succeed([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        tmp_path).strip())
    lent = [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")]
    (site / "lent-dependencies.pth").write_text("".join(f"{entry}\n" for entry in lent))
    return venv / "bin", site


def succeed(command: list, folder: Path, **env: str) -> str:
    """The stdout of `command` run in `folder` without PYTHONPATH (and with `env` added);
    fails with its stderr."""
    env = {**{key: value for key, value in os.environ.items() if key != "PYTHONPATH"}, **env}
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, Path]:
    """installed_wheel's venv, built once for this file's tests."""
    return installed_wheel(tmp_path_factory.mktemp("wheel"))


def test_a_wheel_serves_and_replays_without_the_checkout(wheel_venv, tmp_path,
                                                         tiny_chat_model_path):
    """kvscope installed from its wheel, run from a folder outside the checkout: every part
    and every file the package reads at run time come from the venv, `kvscope serve` takes
    its flags and `kvscope replay --simulate` replays a trace."""
    bin_folder, site = wheel_venv
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    found = json.loads(succeed([bin_folder / "python", "-c", (
        "import json\n"
        "import kvscope, kvscope.app, kvscope.engine, kvscope.storage\n"
        "from kvscope.kernels import cpu_extension\n"
        "from kvscope.ui import dashboard, frame_guard\n"
        "print(json.dumps({'modules': [kvscope.__file__, kvscope.app.__file__,\n"
        "                              kvscope.engine.__file__, kvscope.storage.__file__],\n"
        "                  'data': [str(dashboard.CSS_PATH), str(dashboard.POLLER_PATH),\n"
        "                           str(frame_guard.FRAME_GUARD_JS),\n"
        "                           *map(str, cpu_extension.inputs())]}))\n")], outside))
    for path in map(Path, found["modules"] + found["data"]):
        assert path.is_relative_to(site) and path.is_file(), path
    assert any(Path(path).suffix == ".cpp" for path in found["data"])

    kvscope = bin_folder / "kvscope"
    serve = succeed([kvscope, "serve", "--help"], outside)
    assert serve.startswith("usage: kvscope serve") and "--block-size" in serve
    trace, cost = outside / "trace.jsonl", outside / "cost.json"
    trace.write_text("".join(json.dumps({"timestamp": 20 * i, "input_length": 30 + i,
                                         "output_length": 4, "hash_ids": [i % 2]}) + "\n"
                             for i in range(4)))
    cost.write_text(StepCost(0.01, 1e-4, 0.0, 0.0).to_json())
    (run,) = json.loads(succeed([kvscope, "replay", trace, "--model", tiny_chat_model_path,
                                 "--simulate", "--cost-model", cost, "--json",
                                 "--config", "num_gpu_blocks_override=32"], outside))
    assert run["mode"] == "simulated" and run["num_requests"] == 4


# An engine step on the tiny model in the wheel's venv: its first token, the backend that
# computed it and the folder the kernels were built from (argv[2], where given, instead of the
# package's own).
ONE_STEP = """
import json, sys
from pathlib import Path
from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.kernels import cpu_extension
if len(sys.argv) > 2:
    cpu_extension.CSRC = Path(sys.argv[2])
engine = EngineCore(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32",
                                 device_memory_gb=0.05))
engine.add_request([5, 6, 7], SamplingParams(max_tokens=1))
(output,) = engine.step().outputs
print(json.dumps({"token_ids": output.outputs[0].token_ids, "csrc": str(cpu_extension.CSRC),
                  "backend": engine.runner.kernel_ops.backend}))
"""


def files_in(folder: Path) -> dict[Path, bytes]:
    return {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*")
            if path.is_file()}


def test_a_wheel_builds_its_cpu_kernels_from_the_package_and_steps(wheel_venv, tmp_path,
                                                                   tiny_model, make_engine,
                                                                   cpu_kernel_ops):
    """The C++ sources and headers ship as package data, and an engine of the installed
    kvscope steps on the kernels built from them, greedy equal to this checkout's.

    A build takes minutes, so where the package's C++ files are the checkout's byte for byte
    the step loads this session's build of the checkout's (the same compile); otherwise
    (a file the wheel lacks or changed) the package compiles its own, into a cache of its own,
    and KVSCOPE_REQUIRE_CPU_KERNELS makes a failed build fail the step."""
    bin_folder, site = wheel_venv
    shipped = site / "kvscope" / "kernels" / "csrc"
    same_files = files_in(shipped) == files_in(cpu_extension.CSRC)
    step = [bin_folder / "python", "-c", ONE_STEP, tiny_model("llama").path]
    # The package's own build goes to a cache of the test's, out of the user's.
    env = {"KVSCOPE_REQUIRE_CPU_KERNELS": "1",
           **({} if same_files else {"KVSCOPE_CACHE_DIR": str(tmp_path / "cache")})}
    found = json.loads(succeed([*step, cpu_extension.CSRC] if same_files else step, tmp_path,
                               **env).strip().splitlines()[-1])
    assert found["backend"] == "cpu"
    assert Path(found["csrc"]) == (cpu_extension.CSRC if same_files else shipped)
    engine = make_engine("llama")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=1))
    (output,) = engine.step().outputs
    assert found["token_ids"] == output.outputs[0].token_ids
