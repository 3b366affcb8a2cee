"""The architecture, kept: no import cycles, the layers only point down (base ← sketch ← algo; the math never imports
the engines nor Lightning), the package's root holds only the face, the training mode is chosen in one place, and
every dotted path a config, the README, docs/ or bench/ names imports."""

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "lightning_logra"

# What each layer may import from the project, besides itself (the callbacks/ folder installs as
# lightning_logra.callbacks, above them all).
LAYERS = {
    "base": (),
    "sketch": ("base",),
    "algo": ("base", "sketch"),
    # episodes run over any engine through its generate call, and know nothing of the training (module, modes)
    "episodes": ("base",),
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(layer):
    allowed = {layer, *LAYERS[layer]}
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for module in _imported_modules(path):
            if module.startswith("lightning_logra."):
                assert module.split(".")[1] in allowed, f"{path.relative_to(ROOT)} imports {module}"


def _package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package under `root` by its dotted name (callbacks/ installs as
    lightning_logra.callbacks)."""
    found = {}
    for folder, prefix in ((root / "lightning_logra", ()), (root / "callbacks", ("lightning_logra",))):
        for path in folder.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """The package's import cycles (strongly connected groups of modules), every import counted: inside functions
    and under `if TYPE_CHECKING:` too. `from a.b import c` points at the module a.b.c when there is one, else at
    a.b."""
    modules = _package_modules(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = (f"{node.module}.{alias.name}" for alias in node.names)
                edges.update(name if name in modules else node.module for name in named)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = sorted(edge for edge in edges if edge in modules and edge != name)
    # Tarjan's strongly connected components, iteratively
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        cycles.append(sorted(group))
            elif edge not in index:
                index[edge] = low[edge] = len(index)
                stack.append(edge)
                on_stack.add(edge)
                work.append((edge, iter(graph[edge])))
            elif edge in on_stack:
                low[node] = min(low[node], index[edge])
    return cycles


def test_the_package_has_no_import_cycles():
    assert import_cycles(ROOT) == []


def test_an_import_cycle_is_found(tmp_path):
    # A cycle through a TYPE_CHECKING import, as the module and its sample source had.
    (tmp_path / "lightning_logra" / "train").mkdir(parents=True)
    (tmp_path / "callbacks").mkdir()
    (tmp_path / "lightning_logra" / "train" / "module.py").write_text("from lightning_logra.train.source import S\n")
    (tmp_path / "lightning_logra" / "train" / "source.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_logra.train.module import M\n")
    assert import_cycles(tmp_path) == [["lightning_logra.train.module", "lightning_logra.train.source"]]


MATH = ["lightning_logra.base.batch", "lightning_logra.base.hashing", "lightning_logra.sketch",
        "lightning_logra.algo.kl", "lightning_logra.algo.losses", "lightning_logra.algo.advantages",
        "lightning_logra.algo.logprobs", "lightning_logra.algo.update", "lightning_logra.algo.step_size"]


def test_math_does_not_import_the_rollout_engines_nor_lightning():
    # A fresh interpreter, so that nothing imported by other tests hides an import; one for all of MATH (each start
    # imports torch: 5 s apiece), importing them in turn: while none has imported a forbidden module, whatever the
    # next one imports shows, and the first that does is named (those after it are named too).
    code = ("import importlib, json, sys\n"
            "bad = {}\n"
            f"for module in {MATH!r}:\n"
            "    importlib.import_module(module)\n"
            "    bad[module] = sorted(m for m in sys.modules\n"
            "                         if m.startswith(('lightning_logra.rollout', 'vllm', 'lightning.')))\n"
            "print(json.dumps(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    imported = json.loads(out.strip().splitlines()[-1])
    assert list(imported) == MATH
    offenders = {module: bad for module, bad in imported.items() if bad}
    if offenders:
        first, bad = next(iter(offenders.items()))
        pytest.fail(f"{first} imports {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")


def test_the_package_root_holds_only_the_face():
    files = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert files == ["__init__.py", "checks.py", "cli.py", "export.py", "fetch.py", "paths.py"]


# An engine server's process (rollout/server/) and the trainer's side of it (rollout/remote/) share only the wire
# protocol (rollout/protocol.py): neither imports the other.
APART = {"rollout/server": "lightning_logra.rollout.remote", "rollout/remote": "lightning_logra.rollout.server"}


@pytest.mark.parametrize("side", sorted(APART))
def test_an_engine_server_and_the_trainers_side_of_it_import_nothing_of_each_other(side):
    for path in sorted((PACKAGE / side).rglob("*.py")):
        for module in _imported_modules(path):
            assert not module.startswith(APART[side]), f"{path.relative_to(ROOT)} imports {module}"


# The types that say what kind of training a run does. Only the mode selection may switch on them.
MODE_TYPES = ("SketchOptimizer", "SketchConfig", "LoRAConfig", "LoRAStrategy", "SketchStrategy", "SketchDDPStrategy",
              "SketchFSDPStrategy", "SketchTraining")


def test_no_type_switch_on_the_training_mode_outside_its_selection():
    offenders = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "callbacks").glob("*.py")]):
        if path.parent.name == "sketch":
            continue  # the sketch core checks its own types (what a configured factory builds)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "training_mode" and path.name == "modes.py":
                continue
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"):
                continue
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & set(MODE_TYPES) and not _inside(tree, node, "training_mode"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def _inside(tree: ast.AST, target: ast.AST, function: str) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == function and target in ast.walk(node)
               for node in ast.walk(tree))


def _dotted_paths() -> set[str]:
    """Every `lightning_logra.<...>.<Name>` written in configs/, the README, docs/ and bench/."""
    texts = [*ROOT.glob("configs/*.yaml"), ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("bench/**/*.py"),
             *ROOT.glob("bench/*.md")]
    found = set()
    for path in texts:
        found |= set(re.findall(r"\blightning_logra(?:\.[A-Za-z_]\w*)+", path.read_text()))
    return found


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or an attribute of one (a class, a function), after the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_every_dotted_path_the_configs_readme_docs_and_bench_name_imports():
    paths = _dotted_paths()
    assert len(paths) > 30  # the collection found them
    assert [path for path in sorted(paths) if not _resolves(path)] == []


def test_every_package_folder_is_installed():
    # `pip install .` (not editable) builds a wheel from this list alone: a folder missing from it is missing there.
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(path.parent.relative_to(ROOT).parts) for path in PACKAGE.rglob("*.py")}
    on_disk |= {"lightning_logra.callbacks"}
    assert on_disk == listed
    for name in on_disk - {"lightning_logra.callbacks"}:
        assert (ROOT / name.replace(".", "/") / "__init__.py").exists(), f"{name} has no __init__.py"
