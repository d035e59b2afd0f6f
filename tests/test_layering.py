"""The house rules of wrapopt's imports, read from the source with ``ast`` (See
docs/design.md, "The house: packages and which may import which").

- Arrows point down. The shared modules import only shared modules; a stage
  imports the shared modules and only the lower modules ``STAGES`` names for
  it; only the wiring (api, cli, evaluation, testing) imports anything, and
  ``WIRING`` says which other wiring it must not import.
- No wrapopt module imports another inside a function (``LAZY`` lists the few
  that must, with the reason).
- No private name (``_x``) is imported from another module, nor read as an
  attribute of an imported wrapopt module; a private module is imported only
  from its own package.
- No module is over 500 lines, none is named like a standard-library module,
  and no import cycle exists.

Each failure names the file, the line, the import and the rule. ``PENDING``
holds the breaks known when this test was written, each fixed elsewhere; an
entry that is no longer needed fails too, so that the list only shrinks.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from dataclasses import dataclass

import networkx as nx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "wrapopt"
MAX_LINES = 500

# The bottom layer: imported by every layer, importing only each other.
SHARED = {"spec", "errors", "tp", "fileio", "units", "fingerprint", "losses",
          "launch", "version", "assumptions", "train", "choices",
          "progress", "consensus", "wrapped", "checks", "selective", "rank_faults"}

# The stages: each may import the shared modules, its own package, and the modules named
# here (a name covers its submodules). Written from what the code imports, and no wider.
STAGES: dict[str, tuple[str, ...]] = {
    "hardware": (),
    "trace": (),
    "models": (),
    "plan": (),
    "debug": (),
    "cost": ("hardware.profiles", "hardware.host"),  # the fabric, compute and host data it prices a step with
    # drives the Simulator it is given; prices one pipeline stage's units alone and each pipeline
    # rank's peak (search/pipeline_stages.py, [Note: per-stage refinement])
    "search": ("cost.simulate", "cost.pipeline"),
    "interop": ("plan.file",),  # reads a WrapPlan
    # formats a FabricProfile, and a SearchResult (report/choice.py: the choice beside the
    # baselines, the search behind it); search sits below report and never imports it
    "report": ("hardware.profiles", "search.driver"),
}

# The wiring: may import anything except the wiring named here (the arrows point down
# here too: cli -> evaluation -> api). The root package (__init__.py) re-exports for users.
WIRING: dict[str, tuple[str, ...]] = {
    "job": ("api", "cli", "evaluation", "testing"),  # prepare(): the one wiring of the stages, below every entry point
    "predict": ("api", "cli", "evaluation", "testing"),  # estimate(): one given plan, the stages wired as api does
    "api": ("cli", "evaluation", "testing"),
    "evaluation": ("cli", "testing"),
    "testing": ("cli", "evaluation"),
    "cli": ("testing",),
}

# (file, imported module): imports inside a function that must stay there, and why.
LAZY: dict[tuple[str, str], str] = {}
# Layers whose modules import the library inside their functions: the CLI's parsers load no torch,
# and each command imports what it runs in its body (See [Note: first contact] in wrapopt/cli/main.py).
LAZY_LAYERS = {"cli"}

# Breaks known when this test was written, each being fixed elsewhere (issue 18). Remove an
# entry with its fix: an entry that no longer matches anything fails.
PENDING: dict[str, set] = {
    "private": set(),  # (file, imported module, name)
    "long": set(),  # (file, its line count): may not grow
    "stdlib": {  # module; to decide: rename it, or keep it with a stated reason
        "wrapopt.trace",
    },
}


@dataclass(frozen=True)
class Import:
    path: str  # of the importing file, relative to the repository
    line: int
    text: str  # the statement, for this one name
    importer: str  # dotted module name
    target: str  # the wrapopt module imported (the package, for a name from its __init__)
    name: str | None  # the name imported from ``target``; None for a module
    in_function: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}: `{self.text}`"


def _modules() -> dict[str, str]:
    """Dotted name -> path relative to the repository, for every module of the package."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(REPO, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), REPO)
                name = rel[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = rel.replace(os.sep, "/")
    return out


MODULES = _modules()


def _source(module: str) -> str:
    with open(os.path.join(REPO, MODULES[module]), encoding="utf-8") as f:
        return f.read()


def _parse(module: str) -> ast.Module:
    return ast.parse(_source(module), filename=MODULES[module])


def _function_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(sub) for sub in ast.walk(node) if sub is not node)
    return inside


def _imports(module: str) -> list[Import]:
    tree = _parse(module)
    inside = _function_nodes(tree)
    is_package = MODULES[module].endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        common = dict(path=MODULES[module], line=node.lineno, importer=module, in_function=id(node) in inside)
        if isinstance(node, ast.Import):
            out += [Import(text=f"import {a.name}", target=a.name, name=None, **common)
                    for a in node.names if a.name.split(".")[0] == PACKAGE]
            continue
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            parts = module.split(".")[: len(module.split(".")) - (0 if is_package else 1) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        if base.split(".")[0] != PACKAGE:
            continue
        for a in node.names:
            text = f"from {'.' * node.level}{node.module or ''} import {a.name}"
            sub = f"{base}.{a.name}"
            out.append(Import(text=text, target=sub, name=None, **common) if sub in MODULES else
                       Import(text=text, target=base, name=a.name, **common))
    return out


@functools.cache
def _all_imports() -> tuple[Import, ...]:
    """Every import of the package, parsed when a test first asks (not at collection: every pytest
    process collects this file, and parsing the package takes seconds)."""
    return tuple(imp for module in MODULES for imp in _imports(module))


def _top(module: str) -> str:
    """The layer key of a module: ``cost`` for wrapopt.cost.step, "" for the root package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _fail(problems: list[str], rule: str) -> None:
    if problems:
        pytest.fail(f"{len(problems)} break(s) of the rule: {rule}\n" + "\n".join(problems), pytrace=False)


def _layer_rule(imp: Import) -> str | None:
    """Why this import breaks the layering, or None if it does not."""
    src, dst = _top(imp.importer), _top(imp.target)
    if imp.target not in MODULES:
        return f"{imp.target} is not a module of the package (old paths are aliases for users only)"
    if dst == "":
        return f"nothing inside the package imports the root package {PACKAGE} (it re-exports for users)"
    if src == "" or src == dst:
        return None
    if src in SHARED:
        return None if dst in SHARED else (
            f"{src} is a shared module; it imports only the shared modules ({', '.join(sorted(SHARED))})")
    if src in STAGES:
        lower = STAGES[src]
        if dst in SHARED or any(imp.target == f"{PACKAGE}.{m}" or imp.target.startswith(f"{PACKAGE}.{m}.")
                                for m in lower):
            return None
        allowed = f"and {', '.join(lower)}" if lower else "only"
        return (f"{src} is a stage; it imports the shared modules {allowed}, not {imp.target}"
                " (move the code down, or widen STAGES in tests/test_layering.py and say why in docs/design.md)")
    if src in WIRING:
        return (f"{src} must not import {dst}: the wiring points down (cli -> evaluation -> api)"
                if dst in WIRING[src] else None)
    return None  # an unknown package: test_every_module_has_a_layer names it


def test_every_module_has_a_layer():
    known = SHARED | set(STAGES) | set(WIRING) | {""}
    unknown = sorted(f"{MODULES[m]}: {_top(m)}" for m in MODULES if _top(m) not in known)
    _fail(unknown, "every module has a layer: add it to SHARED, STAGES or WIRING in tests/test_layering.py "
                   "and to the table in docs/design.md")


def test_imports_point_down():
    problems = []
    for imp in _all_imports():
        rule = _layer_rule(imp)
        if rule:
            problems.append(f"{imp.where()}: {rule}")
    _fail(problems, "arrows point down (shared <- stages <- wiring; STAGES names what each stage may import)")


def test_no_wrapopt_import_inside_a_function():
    problems, used = [], set()
    for imp in _all_imports():
        if imp.in_function and _top(imp.importer) not in LAZY_LAYERS:
            key = (imp.path, imp.target)
            if key in LAZY:
                used.add(key)
            else:
                problems.append(f"{imp.where()}: imported inside a function; import it at the top of the module "
                                "(or, if it must load late, add it to LAZY with the reason)")
    problems += [f"{path}: LAZY lists {target}, which it no longer imports inside a function; remove the entry"
                 for path, target in sorted(set(LAZY) - used)]
    _fail(problems, "no wrapopt module imports another inside a function")


def test_no_private_name_crosses_modules():
    problems, used = [], set()
    for imp in _all_imports():
        if imp.name is not None and _private(imp.name):
            key = (imp.path, imp.target, imp.name)
            if key in PENDING["private"]:
                used.add(key)
            else:
                problems.append(f"{imp.where()}: {imp.name} is private to {imp.target}; make it public "
                                "(drop the underscore) or move the code that needs it")
        elif imp.name is None and _private(imp.target.rsplit(".", 1)[-1]):
            home = imp.target.rsplit(".", 1)[0]
            if not (imp.importer == home or imp.importer.startswith(home + ".")):
                problems.append(f"{imp.where()}: {imp.target} is private to {home}")
    for module in MODULES:  # `launch._x` where `launch` is an imported wrapopt module
        aliases = {}
        tree = _parse(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) or isinstance(node, ast.Import):
                for a in node.names:
                    full = a.name if isinstance(node, ast.Import) else f"{node.module}.{a.name}"
                    if full in MODULES and (a.asname or isinstance(node, ast.ImportFrom)):
                        aliases[a.asname or a.name] = full
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _private(node.attr)):
                problems.append(f"{MODULES[module]}:{node.lineno}: `{node.value.id}.{node.attr}`: {node.attr} is "
                                f"private to {aliases[node.value.id]}")
    problems += [f"{path}: PENDING['private'] lists {name} from {target}, no longer imported; remove the entry"
                 for path, target, name in sorted(PENDING["private"] - used)]
    _fail(problems, "no private name (_x) is imported from another module")


def test_no_module_over_500_lines():
    problems, used = [], set()
    for module, path in MODULES.items():
        n = len(_source(module).splitlines())
        known = {count for p, count in PENDING["long"] if p == path}
        if known:
            used.add((path, max(known)))
        if n > MAX_LINES and not (known and n <= max(known)):
            problems.append(f"{path}: {n} lines, over {MAX_LINES}; split it by what its parts do")
        if known and n <= MAX_LINES:
            problems.append(f"{path}: {n} lines, no longer over {MAX_LINES}; remove it from PENDING['long']")
    problems += [f"{path}: PENDING['long'] lists a file that does not exist; remove the entry"
                 for path, _ in sorted(PENDING["long"] - used)]
    _fail(problems, f"no module over {MAX_LINES} lines")


def test_no_module_named_like_the_standard_library():
    problems = []
    for module, path in MODULES.items():
        last = module.rsplit(".", 1)[-1]
        clash = last in sys.stdlib_module_names and last != "__main__"
        if clash and module not in PENDING["stdlib"]:
            problems.append(f"{path}: {module} is named like the standard-library module {last!r}; rename it")
        if not clash and module in PENDING["stdlib"]:
            problems.append(f"{path}: {module} no longer clashes; remove it from PENDING['stdlib']")
    problems += [f"PENDING['stdlib'] lists {m}, which does not exist; remove the entry"
                 for m in PENDING["stdlib"] - set(MODULES)]
    _fail(problems, "no module named like a standard-library module")


def test_no_import_cycle():
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    first: dict[tuple[str, str], Import] = {}
    for imp in _all_imports():
        if imp.target in MODULES and imp.target != imp.importer:
            graph.add_edge(imp.importer, imp.target)
            first.setdefault((imp.importer, imp.target), imp)
    problems = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            cycle = nx.find_cycle(graph.subgraph(component))
            problems.append(" -> ".join(a for a, _ in cycle) + f" -> {cycle[0][0]}: " +
                            "; ".join(first[edge].where() for edge in cycle))
    _fail(problems, "no import cycle (function-level imports counted)")
