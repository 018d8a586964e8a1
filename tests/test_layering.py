"""The stack's order: each stage imports only the stages below it, type-only imports too.

The stages, bottom up, are the folders (and the engine's shared vocabulary, the files at
engine/'s top) that docs/architecture.md draws. An import that points up, or a module that
belongs to no stage, fails here with the file and line that made it.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("kvscope", "engine", "kernels", "storage", "ui")

# Bottom up. A path ending in "/" is a folder and everything below it; otherwise one file.
STAGES = (
    ("package root", ("kvscope/__init__.py",)),  # OpenMP's policy, the folders' finder
    ("kernels", ("kernels/",)),
    ("vocabulary", ("engine/__init__.py", "engine/config.py", "engine/speculative_config.py",
                    "engine/sampling_params.py", "engine/outputs.py")),
    ("core", ("engine/core/",)),
    ("worker", ("engine/worker/",)),
    ("sample", ("engine/sample/",)),
    ("spec_decode", ("engine/spec_decode/",)),
    ("telemetry", ("engine/telemetry/",)),
    ("orchestrator", ("engine/orchestrator/",)),
    ("replicas", ("engine/replicas/",)),
    ("entrypoints", ("engine/entrypoints/",)),
    ("serving", ("engine/serving/",)),
    ("replay", ("engine/replay/",)),
    ("storage", ("storage/",)),
    ("ui", ("ui/",)),
    ("command line", ("kvscope/", "app.py")),  # cli.py, app.py: what wires the stages
)


def stage_of(path: str) -> int:
    for index, (_, members) in enumerate(STAGES):
        for member in members:
            if path == member or member.endswith("/") and path.startswith(member):
                return index
    raise AssertionError(f"{path} belongs to no stage: add it to STAGES (and the map in "
                         "docs/architecture.md)")


def module_path(module: str) -> str | None:
    """kvscope.engine.core.request -> engine/core/request.py (None outside the package)."""
    parts = module.split(".")
    if parts[0] != "kvscope":
        return None
    folder = parts[1:] if len(parts) > 1 and parts[1] in PACKAGE_FOLDERS[1:] else parts
    base = REPO.joinpath(*folder)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(REPO).as_posix()
    return None


def package_files() -> list[str]:
    files = [path.relative_to(REPO).as_posix() for folder in PACKAGE_FOLDERS
             for path in (REPO / folder).rglob("*.py")]
    return sorted(files) + ["app.py"]


def imports(path: str) -> list[tuple[int, str]]:
    """Every module of the package that `path` imports, anywhere in it (functions and
    TYPE_CHECKING blocks included), with the line."""
    tree = ast.parse((REPO / path).read_text(), path)
    parts = path.removesuffix(".py").split("/")
    package = ["kvscope", *(parts[:-1] if parts[0] != "kvscope" else parts[1:-1])]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [base])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            target = module_path(name)
            if target is not None and target != path:
                found.append((node.lineno, target))
    return found


def test_every_import_points_down_the_stack():
    upward = []
    for path in package_files():
        here = stage_of(path)
        for line, target in imports(path):
            there = stage_of(target)
            if there > here:
                upward.append(f"{path}:{line} ({STAGES[here][0]}) imports {target} "
                              f"({STAGES[there][0]})")
    assert not upward, "imports that point up the stack:\n" + "\n".join(upward)


def test_the_core_reads_only_the_config_and_the_sampling_params():
    allowed = {"engine/config.py", "engine/sampling_params.py"}
    outside = [f"{path}:{line} imports {target}" for path in package_files()
               if path.startswith("engine/core/") for line, target in imports(path)
               if not target.startswith("engine/core/") and target not in allowed]
    assert not outside, "\n".join(outside)


def test_the_request_is_a_leaf():
    assert {target for _, target in imports("engine/core/request.py")} == {
        "engine/sampling_params.py"}


def test_the_check_sees_an_upward_import(tmp_path):
    """The walk finds imports inside functions and TYPE_CHECKING blocks, relative ones too."""
    assert ("engine/orchestrator/engine_core.py" in
            {target for _, target in imports("engine/orchestrator/async_engine.py")})
    assert stage_of("engine/core/request.py") < stage_of("engine/orchestrator/engine_core.py")
    assert module_path("kvscope.engine.core.request") == "engine/core/request.py"
    assert module_path("kvscope.storage") == "storage/__init__.py"
    assert module_path("kvscope.cli") == "kvscope/cli.py"
    assert module_path("torch") is None
