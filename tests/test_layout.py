"""The package layout holds: no import cycles, one place that reads the backend, TF-free arithmetic."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfmem"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """tfmem modules imported when `path` is imported (function-level imports excluded)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks count too
            nodes = node.body + node.orelse
        else:
            nodes = [node]
        for item in nodes:
            if isinstance(item, ast.Import):
                found.update(alias.name for alias in item.names)
            elif isinstance(item, ast.ImportFrom) and item.module and item.level == 0:
                found.add(item.module)
                found.update(f"{item.module}.{alias.name}" for alias in item.names)
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: _top_level_imports(path, set(paths)) - {name} for name, path in paths.items()}


def test_no_module_level_import_cycles():
    graph = _graph()
    # A package's __init__ importing its own submodules is how re-exports work, not a cycle.
    edges = {name: {target for target in targets if not target.startswith(name + ".")}
             for name, targets in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(name, stack):
        state[name] = 1
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def _asks_for_the_backend(path: pathlib.Path) -> bool:
    """Whether the code (not the docs) of `path` calls `keras.backend.backend()`."""
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backend" and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "backend"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_only_the_backend_module_asks_which_backend_runs():
    askers = sorted(_module_name(path) for path in PACKAGE.rglob("*.py")
                    if _asks_for_the_backend(path))
    assert askers == ["tfmem.backend"]


def _branches_on_the_backend(source: str) -> bool:
    """Whether `source` compares `backend.NAME` (or a "tensorflow"/"jax" literal) with anything."""
    def is_backend_name(node):
        return isinstance(node, ast.Attribute) and node.attr == "NAME" and isinstance(
            node.value, ast.Name) and node.value.id == "backend"

    def is_name_literal(node):
        return isinstance(node, ast.Constant) and node.value in ("tensorflow", "jax")

    def branches(node):
        operands = [node.left, *node.comparators]
        equality = all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
        return any(map(is_backend_name, operands)) or (
            equality and any(map(is_name_literal, operands)))

    return any(isinstance(node, ast.Compare) and branches(node)
               for node in ast.walk(ast.parse(source)))


def test_only_the_backend_module_branches_on_the_backend():
    branching = sorted(_module_name(path) for path in PACKAGE.rglob("*.py")
                       if _branches_on_the_backend(path.read_text()))
    assert branching == ["tfmem.backend"]
    # The check itself: it sees a comparison with the name, and ignores a mere mention.
    assert _branches_on_the_backend('if backend.NAME == "jax":\n    pass')
    assert _branches_on_the_backend('use_tf = name != "tensorflow"')
    assert _branches_on_the_backend('if backend.NAME in ("jax",):\n    pass')
    assert not _branches_on_the_backend('print(f"backend {backend.NAME}")')
    assert not _branches_on_the_backend('imported = "tensorflow" in sys.modules')


def test_every_subpackage_says_what_it_owns():
    for init in PACKAGE.glob("*/__init__.py"):
        docstring = ast.get_docstring(ast.parse(init.read_text()))
        assert docstring and len(docstring.splitlines()) <= 12, init


def test_shared_arithmetic_imports_no_tensorflow():
    program = textwrap.dedent(
        """
        import sys

        class NoTensorFlow:
            def find_spec(self, name, path=None, target=None):
                if name == "tensorflow" or name.startswith("tensorflow."):
                    raise ModuleNotFoundError(f"No module named {name!r}")

        sys.meta_path.insert(0, NoTensorFlow())
        import types
        sys.modules["tfmem"] = types.ModuleType("tfmem")  # skip tfmem/__init__ (it imports TF)
        sys.modules["tfmem"].__path__ = [sys.argv[1] + "/tfmem"]
        from tfmem.runtime import budget, cluster, runtime
        from tfmem.memory import guard
        print(cluster.nearest_multiples(100, 24), runtime.Runtime("cpu", None, 2).global_batch_size(4, 3),
              budget.budget_for(device="tpu-v3-8").num_replicas)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program, str(ROOT)], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, KERAS_BACKEND="jax"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "96 or 120 24 8"


def test_runtime_imports_none_of_the_modules_that_build_it():
    # `Runtime.from_strategy` describes a strategy itself: no function-level import circle
    # between `runtime` and the per-backend `distribute` modules that build a `Runtime`.
    tree = ast.parse((PACKAGE / "runtime" / "runtime.py").read_text())
    imported = {alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    assert not [name for name in imported if "distribute" in name or name.startswith("tensorflow")]
