"""The package layout holds: no import cycles, one place that reads the backend, TF-free arithmetic,
no function body over 80 lines."""

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


def _imports(path: pathlib.Path, modules: set[str]) -> list[tuple[str, bool, int]]:
    """`(tfmem module, inside a function body, line)` for each import in `path`, at any depth:
    `import`, `from ... import`, and the halves a module names with `backend.half(...)`."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [f"{child.module}.{alias.name}" for alias in child.names]
                names = [name if name in modules else child.module for name in names]
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                  and child.func.attr == "half"):
                names = [keyword.value.value for keyword in child.keywords
                         if isinstance(keyword.value, ast.Constant)]
            for name in names:
                while name and name not in modules:  # `import tfmem.x.y` of a package
                    name = name.rpartition(".")[0]
                if name:
                    found.append((name, in_function, child.lineno))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _graph(in_functions: bool = False) -> dict[str, set[str]]:
    paths = _modules()
    return {name: {target for target, deferred, _ in _imports(path, set(paths))
                   if in_functions or not deferred} - {name}
            for name, path in paths.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(name, stack):
        state[name] = 1
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_module_level_import_cycles():
    # A package's __init__ importing its own submodules is how re-exports work, not a cycle.
    edges = {name: {target for target in targets if not target.startswith(name + ".")}
             for name, targets in _graph().items()}
    assert _cycles(edges) == []


def _package(module: str) -> str:
    """`tfmem.memory.planner` → `tfmem.memory`; a top-level module is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def test_the_package_graph_runs_one_way_counting_imports_in_function_bodies():
    edges: dict[str, set[str]] = {}
    for name, targets in _graph(in_functions=True).items():
        for target in targets:
            source, goal = _package(name), _package(target)
            if source != goal and goal != "tfmem":
                edges.setdefault(source, set()).add(goal)
    assert _cycles(edges) == []
    # Below everything that picks a half, `backend` imports nothing of tfmem above it.
    assert _graph(in_functions=True)["tfmem.backend"] <= {"tfmem._tf"}


# At most this many imports of tfmem modules inside function bodies, each saying why on its
# line: an optional dependency, or TensorFlow where the JAX backend runs without it.
_MAX_DEFERRED = 10


def test_imports_in_function_bodies_are_few_and_say_why():
    paths = _modules()
    deferred = [(name, target, line) for name, path in paths.items()
                for target, in_function, line in _imports(path, set(paths)) if in_function]
    assert len(deferred) <= _MAX_DEFERRED, deferred
    unexplained = [(name, line) for name, target, line in deferred
                   if "#" not in paths[name].read_text().splitlines()[line - 1]]
    assert unexplained == []


def test_the_import_walk_sees_function_bodies_and_backend_halves(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(textwrap.dedent("""
        import tfmem.a
        def f():
            from tfmem.b import name
        HALF = backend.half(tensorflow="tfmem.c", jax="tfmem.d")
        """))
    found = _imports(path, {"tfmem.a", "tfmem.b", "tfmem.c", "tfmem.d"})
    assert [(name, deferred) for name, deferred, _ in found] == [
        ("tfmem.a", False), ("tfmem.b", True), ("tfmem.c", False), ("tfmem.d", False)]


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


_MAX_FUNCTION_LINES = 80


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of a function's body, its docstring left out (nested functions count in)."""
    body = function.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1


def test_no_function_body_is_over_80_lines():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_code_lines(node)} lines)"
            for path in sorted(PACKAGE.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _code_lines(node) > _MAX_FUNCTION_LINES]
    assert long == []
    # The count itself: a docstring is not code, every statement after it is.
    probe = ast.parse('def f():\n    """Doc.\n\n    More."""\n    x = 1\n\n    return x\n')
    assert _code_lines(probe.body[0]) == 3
