"""One import root: kvscope installs as `kvscope.*` and takes no generic top-level name.

Checked from outside the repository (a fresh interpreter in another folder), as a user
who installed kvscope into an environment of their own would import it.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
