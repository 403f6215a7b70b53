"""The package's shape: the import graph of moe_ops (lazy imports inside functions included) has
no cycle, no library module imports a tool (moe_ops.tools), no module imports another's private
names, and only moe_ops._env reads os.environ."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "moe_ops"


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(name, path):
    """(imported module, imported names) for every import statement anywhere in the file."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([mod] if mod else []))
            yield mod, [a.name for a in node.names]


def _graph():
    mods = dict(_modules())
    graph = {}
    for name, path in mods.items():
        deps = set()
        for mod, names in _imports(name, path):
            if not mod.startswith("moe_ops"):
                continue
            for n in names:   # `from moe_ops.launch import dispatch` imports a submodule
                if f"{mod}.{n}" in mods:
                    deps.add(f"{mod}.{n}")
            if mod in mods and not all(f"{mod}.{n}" in mods for n in names or ["?"]):
                deps.add(mod)
        graph[name] = deps - {name}
    return graph


def _package_edges(graph):
    # a module importing its own package's __init__ (re-exports) is not a cycle through code
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_import_graph_has_no_cycle():
    graph = _package_edges(_graph())
    state = {}
    stack = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_library_never_imports_a_tool():
    for name, deps in _graph().items():
        if name.startswith("moe_ops.tools") or name == "moe_ops.bench":
            continue
        assert not [d for d in deps if d.startswith("moe_ops.tools")], (name, deps)


def test_no_private_names_across_modules():
    mods = dict(_modules())
    bad = []
    for name, path in mods.items():
        for mod, names in _imports(name, path):
            if not mod.startswith("moe_ops") or mod == name:
                continue
            for n in names:
                if n.startswith("_") and f"{mod}.{n}" not in mods:
                    bad.append((name, mod, n))
    assert not bad, bad


def test_only_env_reads_the_environment():
    readers = []
    for name, path in _modules():
        text = path.read_text()
        if name != "moe_ops._env" and ("os.environ" in text or "os.getenv" in text):
            readers.append(name)
    assert readers == [], readers
