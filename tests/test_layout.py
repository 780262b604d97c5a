"""The package's layout is its architecture: fused_ema's own imports (every one, function-level
ones included) form no cycle, each layer imports only the layers below it, every module says its
job in a docstring, and the compiled module fused_ema._C carries no test-only entry points (they
are torch.ops.fused_ema_testing, reached through tests/testing_ops.py)."""

import ast
import re
from pathlib import Path

import torch

import fused_ema
from fused_ema import _C
from testing_ops import cuda_small_params

PACKAGE = Path(__file__).resolve().parents[1] / "fused_ema"
EXTENSION = "fused_ema._C"  # compiled: imports nothing from the package

# Bottom to top: a module may import from its own layer and the ones before it. Top-level public
# modules are layers of their own, between the private packages they use and those that use them.
LAYERS = [
    ("errors", "_version"),  # no imports from the package
    ("_files",),  # reading checkpoint files, atomic_write
    ("_ext",),  # the compiled extension's Python side
    ("_dist",),  # DTensor primitives, ModelEma(shard=...)
    ("ops",),  # public: the fused lerp ops
    ("_model",),  # walk, name filters, entries, module view, swap
    ("_update",),  # schedule, plan, binding, updater, non_blocking, compile, attach
    ("checkpoint",),  # public: checkpoint formats
    ("_state",),  # options, checkpoints of the EMA, placement, stats
    ("ema",),  # public: the ModelEma façade
    ("_tracks",),  # several ModelEmas updated as one (PostHocEma, Bema)
    ("posthoc", "bema"),  # public: post-hoc EMA snapshots and synthesis; BEMA
    ("integrations", "__init__", "__main__"),
]
TEST_ONLY = ("_sr_words", "_stochastic_round", "_cuda_small_params")


def module_files() -> dict:
    """Dotted module name -> (path, is a package)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph() -> dict:
    """Module -> the package modules it imports (at any depth of its code)."""
    modules = module_files()
    known = set(modules) | {EXTENSION}
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name.split(".") if is_package else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "fused_ema")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "fused_ema":
                    continue
                for alias in node.names:  # a submodule, or a name defined in `source`
                    sub = f"{source}.{alias.name}"
                    deps.add(sub if sub in known else source)
        unknown = deps - known
        assert not unknown, f"{name} imports {sorted(unknown)}, which are not package modules"
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict) -> list:
    """A cycle of the graph as [a, b, ..., a], or [] when it is a DAG."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def layer_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} belongs to no layer of LAYERS: add its package there")


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_package_imports_form_no_cycle():
    graph = import_graph()
    assert "fused_ema._dist.dtensor" in graph and "fused_ema._update.plan" in graph
    assert find_cycle(graph) == []


def test_each_layer_imports_only_the_layers_below():
    wrong = [
        f"{module} -> {dep}"
        for module, deps in import_graph().items()
        for dep in deps
        if dep != EXTENSION and layer_of(dep) > layer_of(module)
    ]
    assert not wrong, "imports that go up a layer:\n" + "\n".join(sorted(wrong))


def test_every_module_says_its_job():
    missing = [
        name
        for name, (path, _) in module_files().items()
        if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    ]
    assert not missing


def test_every_subpackage_ships():
    """pyproject.toml lists packages by name: a layer left out would be missing from a wheel."""
    listed = re.search(
        r"^packages = \[(.*?)\]", (PACKAGE.parent / "pyproject.toml").read_text(), re.M | re.S
    )
    shipped = set(re.findall(r'"([\w.]+)"', listed.group(1)))
    packages = {name for name, (_, is_package) in module_files().items() if is_package}
    assert packages == shipped


def test_the_compiled_module_has_no_test_only_entry_points():
    assert not set(TEST_ONLY) & set(dir(_C))
    assert not [name for name in dir(_C) if "test" in name.lower()]
    for name in ("sr_words", "stochastic_round", "cuda_small_params"):
        assert not hasattr(torch.ops.fused_ema, name)
        assert hasattr(torch.ops.fused_ema_testing, name)


def test_the_launch_parameter_switch_reads_and_restores():
    current = cuda_small_params()
    assert isinstance(current, bool)
    if not fused_ema.build_info()["cuda_kernel"]:
        assert current is False and cuda_small_params(True) is False
    assert cuda_small_params(current) == current
    assert cuda_small_params() == current
