"""The package's layout as docs/architecture.md draws it: no import circle counted over every import
statement (a deferred import inside a function is an arrow too), no arrow from a lower part to one built on
it, and no file of ``probe/`` over 600 lines. Read from the source with ``ast``; nothing is imported."""

import ast
import os
from typing import Dict, List, Set

from procs import REPO

PACKAGE = os.path.join(REPO, "probe")
MAX_LINES = 600
# What a part must never import: the parts built on it (docs/architecture.md, "The layers").
FORBIDDEN = {
    "tables": {"agent", "engine", "client", "injector", "reader", "host", "snapshot", "diagnose", "cli", "page", "mcp"},
    "engine": {"agent", "client", "injector", "reader", "host", "snapshot", "diagnose", "cli", "page", "mcp"},
    "reader": {"agent", "client", "injector", "host", "snapshot", "diagnose", "cli", "page", "mcp"},
    "agent": {"client", "host", "injector", "reader", "snapshot", "diagnose", "cli", "page", "mcp"},
    "injector": {"host", "snapshot", "diagnose", "cli", "page", "mcp"},
    "client": {"snapshot", "diagnose", "cli", "page", "host", "mcp"},
    "diagnose": {"snapshot", "cli", "page", "host", "mcp"},
    "snapshot": {"cli", "page", "mcp"},
    "host": {"cli", "page", "mcp"},
    "page": {"mcp", "host"},
    "mcp": {"page", "host"},
}

# The arrows that cross a rule above on purpose, each named (docs/architecture.md, "Known exceptions"): a rank's
# agent registers with its node helper over the wire, and a launcher's start-up hook starts the node helper.
ALLOWED = {("probe.agent.registration", "probe.client.transport"), ("probe.agent.bootstrap", "probe.host.helper")}


def _modules() -> Dict[str, str]:
    found = {}
    for root, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _imports(module: str, path: str, known: Set[str]) -> Set[str]:
    """Every probe module ``module`` imports, at any depth of its code."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets: Set[str] = set()
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    for node in ast.walk(tree):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + ["%s.%s" % (base, alias.name) for alias in node.names]
        for name in names:
            # The longest known module the name reaches (``from probe.client import results`` is the module).
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    return {module: _imports(module, path, known) for module, path in modules.items()}


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _part(module: str) -> str:
    """``probe.client.cluster`` -> ``client``; a module at the package's root is a part of its own."""
    return module.split(".")[1] if "." in module else ""


def test_the_circle_finder_finds_a_circle_and_only_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    assert _circles(_graph()) == []


def test_no_part_imports_a_part_built_on_it():
    wrong = []
    for module, targets in sorted(_graph().items()):
        banned = FORBIDDEN.get(_part(module), set())
        wrong += ["%s imports %s" % (module, t) for t in sorted(targets)
                  if _part(t) in banned and (module, t) not in ALLOWED]
    assert not wrong, "\n".join(wrong)


def test_no_file_of_the_package_over_600_lines():
    long = {}
    for module, path in _modules().items():
        with open(path, encoding="utf-8") as handle:
            count = sum(1 for _ in handle)
        if count > MAX_LINES:
            long[os.path.relpath(path, REPO)] = count
    assert not long, long


def test_every_name_imported_from_the_package_is_there():
    """A name moved in a restructuring but still imported from its old module fails only when that line runs
    (a deferred import in an alert, a bench's cleanup): each ``from probe.X import name`` in probe/ and
    bench/ is checked here, importing probe's modules (none imports torch)."""
    import importlib

    missing = []
    for top in ("probe", "bench"):
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as handle:
                    tree = ast.parse(handle.read(), path)
                for node in ast.walk(tree):
                    if not (isinstance(node, ast.ImportFrom) and not node.level and node.module
                            and node.module.split(".")[0] == "probe"):
                        continue
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        if alias.name != "*" and not hasattr(module, alias.name):
                            try:
                                importlib.import_module("%s.%s" % (node.module, alias.name))
                            except ImportError:
                                missing.append("%s:%d: %s from %s" % (os.path.relpath(path, REPO), node.lineno,
                                                                     alias.name, node.module))
    assert not missing, "\n".join(missing)
