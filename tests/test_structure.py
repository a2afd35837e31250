"""The structure of DESIGN.md, measured on the code: what imports what, how long and how
branchy the step path is, how wide a resident is, and that the loader knows no family.

Every rule is read off the source with `ast` (imports inside `if TYPE_CHECKING:` and inside
functions count too), so a test fails the day the code breaks the rule, with the place named.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import inflight
import inflight.protocol
import inflight.runtime.host

PACKAGE_DIR = Path(inflight.__file__).parent

Graph = dict[str, set[str]]


def _modules(package) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def test_the_torch_free_half_imports_no_torch():
    """The protocol, the engine and the runtime's host half run without torch."""
    modules = ["inflight.engine", *_modules(inflight.protocol), *_modules(inflight.runtime.host)]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- reading the source -------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceModule:
    """One .py file of the package: its dotted name, and whether it is a package's
    `__init__.py` (whose folder is the package itself)."""

    name: str
    path: Path
    is_package: bool

    @property
    def folder(self) -> str:
        """The package (folder) the file belongs to."""
        return self.name if self.is_package else self.name.rpartition(".")[0]

    @property
    def relpath(self) -> str:
        return self.path.relative_to(PACKAGE_DIR.parent).as_posix()


@cache
def _package_modules() -> dict[str, SourceModule]:
    """Every .py file under inflight/, by dotted name. Walked on disk rather than with pkgutil:
    `inflight/protocol` is a namespace package (no `__init__.py`), which pkgutil does not
    descend into from its parent."""
    found: dict[str, SourceModule] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = SourceModule(".".join(parts), path, is_package)
    return found


@cache
def _source(path: Path) -> str:
    return path.read_text()


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(_source(path), filename=str(path))


# -- imports -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportEdge:
    """`source` imports `target` (both modules of the package) at `line` of its file."""

    source: SourceModule
    target: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.source.relpath}:{self.line}"


def _resolve(name: str, known: Mapping[str, SourceModule]) -> str | None:
    """The file an import of dotted `name` runs: the module itself, or a package's
    `__init__.py`; for `a.b.attr` the longest prefix that is a file. None outside the
    package, or for a namespace package (no file runs)."""
    while name:
        if name in known:
            return name
        if (PACKAGE_DIR.parent / name.replace(".", "/")).is_dir():
            return None  # a namespace package: importing it runs no file of ours
        name = name.rpartition(".")[0]
    return None


def _from_base(module: SourceModule, node: ast.ImportFrom) -> str:
    """The absolute name of what `from <base> import ...` reads, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = module.name if module.is_package else module.folder
    parts = package.split(".")
    if node.level > 1:
        parts = parts[: -(node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _imports(module: SourceModule) -> list[ImportEdge]:
    """The package's modules `module` imports, anywhere in the file: top level, functions, and
    `if TYPE_CHECKING:` blocks. `from pkg import name` imports module `pkg.name` where that is a
    file, else `pkg` itself (its `__init__.py` for a package). The parents Python runs on the
    way (`a/__init__.py` for `import a.b`) are not counted: they are no choice of the file."""
    known = _package_modules()
    edges: list[ImportEdge] = []
    for node in ast.walk(_tree(module.path)):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, known) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in known else _resolve(base, known))
        edges += [ImportEdge(module, t, node.lineno) for t in targets if t is not None]
    return edges


@cache
def _all_imports() -> tuple[ImportEdge, ...]:
    return tuple(edge for m in _package_modules().values() for edge in _imports(m))


def _in_scope(name: str, scope: str) -> bool:
    return name == scope or name.startswith(scope + ".")


def _room(name: str, folder: str) -> str | None:
    """The room of `folder` that module `name` lies in: the subfolder holding it, or the file
    itself when it lies in `folder` directly (a package's `__init__` is its folder's own file);
    None when it lies outside."""
    if not name.startswith(folder + "."):
        return None
    return folder + "." + name[len(folder) + 1 :].split(".")[0]


def _import_graph(folder: str, by_room: bool) -> tuple[Graph, dict[tuple[str, str], str]]:
    """The import graph among the modules under `folder` or, `by_room`, among its rooms (its
    subfolders and its own files, each subfolder's modules' imports counted as the
    subfolder's), and for each edge the first import that makes it."""
    known = _package_modules()

    def node(name: str) -> str | None:
        if not _in_scope(name, folder) or name == folder:
            return None
        return _room(name, folder) if by_room else name

    graph: Graph = {n: set() for m in known if (n := node(m)) is not None}
    where: dict[tuple[str, str], str] = {}
    for edge in _all_imports():
        source, target = node(edge.source.name), node(edge.target)
        if source is not None and target is not None and source != target:
            graph[source].add(target)
            where.setdefault((source, target), edge.where)
    return graph, where


def _strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycle_through(start: str, component: set[str], graph: Graph) -> list[str]:
    """A shortest circle from `start` back to itself inside its component (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in a component but on no circle")


def _circles(graph: Graph) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of more than one node, with one circle through it."""
    return [
        (component, _cycle_through(component[0], set(component), graph))
        for component in _strongly_connected(graph)
        if len(component) > 1
    ]


def _describe(component: list[str], circle: list[str], where: Mapping[tuple[str, str], str]) -> str:
    """`a -> b (a.py:3) -> a (b.py:7)`: a circle, each step with the import that makes it, and
    the whole component where it holds more than the circle."""
    steps = [f"{b} ({where[a, b]})" for a, b in zip(circle, circle[1:], strict=False)]
    text = " -> ".join([circle[0], *steps])
    if len(component) > len(circle) - 1:
        text += f"\n    ({len(component)} entangled in all: {', '.join(component)})"
    return text


def test_no_import_circle_between_files():
    """Imports go one way (DESIGN.md, Layers): no file reaches itself through what it
    imports. A circle means the layers are not layers: neither end can be read, tested or
    replaced without the other."""
    graph, where = _import_graph("inflight", by_room=False)
    circles = _circles(graph)
    report = "\n".join("  " + _describe(component, circle, where) for component, circle in circles)
    print(f"\n{len(graph)} modules checked, {len(circles)} import circle(s)\n{report}")
    assert not circles, f"import circles among the modules of inflight:\n{report}"


def _folders() -> list[str]:
    return sorted({m.name for m in _package_modules().values() if m.is_package} | {"inflight"})


def test_no_import_circle_between_the_rooms_of_any_folder():
    """Inside every folder (`inflight`, `inflight/model`, ... down to `kernels/cpu`), its rooms
    (its subfolders, each taken whole, and its own files) import one way: `attention/` may
    stand on `model/metadata.py`, but then nothing `metadata.py` imports may reach back into
    `attention/`."""
    reports = []
    for folder in _folders():
        graph, where = _import_graph(folder, by_room=True)
        for component, circle in _circles(graph):
            reports.append(f"  in {folder}: {_describe(component, circle, where)}")
    print(f"\n{len(_folders())} folders checked, {len(reports)} circle(s)")
    assert not reports, "import circles between the rooms of a folder:\n" + "\n".join(reports)


def test_the_server_imports_neither_runtime_nor_model():
    """The server talks to the engine through `inflight.api` and the protocol (DESIGN.md: the
    server must not import the runtime or the model), so it can be run against any engine."""
    forbidden = [
        f"{edge.where} imports {edge.target}"
        for edge in _all_imports()
        if _in_scope(edge.source.name, "inflight.server")
        and (_in_scope(edge.target, "inflight.runtime") or _in_scope(edge.target, "inflight.model"))
    ]
    assert not forbidden, "the server reaches below the engine:\n  " + "\n  ".join(forbidden)


# -- functions -----------------------------------------------------------------------------------

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(path: Path) -> dict[str, FunctionNode]:
    """The module-level functions and the methods of module-level classes of a file, by
    qualified name (`Class.method`); a function nested in another is part of it."""
    found: dict[str, FunctionNode] = {}
    for node in _tree(path).body:
        if isinstance(node, FunctionNode):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, FunctionNode):
                    found[f"{node.name}.{item.name}"] = item
    return found


def _function(relpath: str, qualname: str) -> FunctionNode:
    functions = _functions(PACKAGE_DIR / relpath)
    assert qualname in functions, f"inflight/{relpath} has no {qualname}: update this test"
    return functions[qualname]


def _line_count(function: FunctionNode) -> int:
    """From `def` to the function's last line (decorators not counted)."""
    return function.end_lineno - function.lineno + 1


@pytest.mark.parametrize(
    ("relpath", "qualname"),
    [
        ("runtime/host/scheduler.py", "Scheduler.schedule"),
        ("runtime/device/executor.py", "Executor.launch"),
    ],
)
def test_the_step_planners_stay_short(relpath: str, qualname: str):
    """The plan and the launch of a step are read whenever the step changes: a feature's work
    goes into its hook, and these two stay a screen long (under 40 lines)."""
    lines = _line_count(_function(relpath, qualname))
    print(f"\n{qualname} (inflight/{relpath}): {lines} lines")
    assert lines < 40, f"{qualname} (inflight/{relpath}) is {lines} lines; the limit is 39"


# -- feature conditions on the step path ---------------------------------------------------------

# Where each step-path file's path starts. What those functions call in the same file (a
# module function, `self.method`, `Class.method`) is on the path too (`_step_path`).
STEP_PATH_ROOTS: dict[str, tuple[str, ...]] = {
    "runtime/host/session.py": ("GenerationSession.step",),
    "runtime/host/scheduler.py": ("Scheduler.schedule",),
    # launch queues the forward, sample the sampling, fetch takes the tokens: the session's
    # three per-step calls of its executor.
    "runtime/device/executor.py": ("Executor.launch", "Executor.sample", "Executor.fetch"),
    "runtime/device/model_runner.py": ("ModelRunner.forward", "ModelRunner.execute"),
    # The session calls `complete` for each step, `finish` for cancelled and failed rows.
    "runtime/host/output_processor.py": ("OutputProcessor.complete", "OutputProcessor.finish"),
    "runtime/device/batch_builder.py": ("build_ragged_batch",),
    "model/families/llama.py": ("LlamaForCausalLM.forward",),
}

# Words that name a feature, matched whole against the words of a condition's source (its
# identifiers split at `_`, `.` and camelCase: `row.drafts`, `prompt_logprobs`, `MambaStates`),
# in the forms the code spells them.
FEATURE_WORDS = re.compile(
    r"speculative|spec|drafts?|grammars?|matchers?|constrain(t|ts|ed)?|structured|"
    r"penalt(y|ies)|penali[sz]ed|bias|media|images?|audio|encoders?|mrope|lora|adapters?|"
    r"parallel|workers?|ranks?|logprobs?|scores?|scoring|recurrent|mamba|hybrid"
)


def _call_targets(function: FunctionNode, owner: str | None) -> Iterator[str]:
    """The qualified names `function` calls that could be in its own file: `name(...)`,
    `self.name(...)` / `cls.name(...)` (as `owner.name`) and `Class.name(...)`."""
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            yield func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            receiver = func.value.id
            if receiver in ("self", "cls") and owner is not None:
                yield f"{owner}.{func.attr}"
            else:
                yield f"{receiver}.{func.attr}"


def _step_path(relpath: str, roots: tuple[str, ...]) -> list[str]:
    """The roots and every function of the same file they reach through calls."""
    functions = _functions(PACKAGE_DIR / relpath)
    for root in roots:
        assert root in functions, f"inflight/{relpath} has no {root}: update STEP_PATH_ROOTS"
    reached = list(roots)
    queue = deque(roots)
    while queue:
        name = queue.popleft()
        owner = name.rpartition(".")[0] or None
        for target in _call_targets(functions[name], owner):
            if target in functions and target not in reached:
                reached.append(target)
                queue.append(target)
    return reached


def _conditions(function: FunctionNode) -> Iterator[ast.expr]:
    """The test of every `if` / `elif`, `while`, conditional expression and comprehension
    `if` in the function (nested functions included)."""
    for node in ast.walk(function):
        if isinstance(node, ast.If | ast.While | ast.IfExp):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def _words(text: str) -> list[str]:
    """The lower-cased words of source text: identifiers split at `_` and at camelCase."""
    return [
        w.lower()
        for token in re.findall(r"[A-Za-z]+", text)
        for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", token)
    ]


def _names_a_feature(text: str) -> bool:
    return any(FEATURE_WORDS.fullmatch(word) for word in _words(text))


@dataclass(frozen=True)
class FeatureCondition:
    function: str
    line: int
    text: str


def _feature_conditions(relpath: str, qualname: str) -> list[FeatureCondition]:
    path = PACKAGE_DIR / relpath
    found = []
    for test in _conditions(_functions(path)[qualname]):
        text = ast.get_source_segment(_source(path), test) or ""
        if _names_a_feature(text):
            found.append(FeatureCondition(qualname, test.lineno, " ".join(text.split())))
    return sorted(found, key=lambda c: c.line)


def test_the_step_path_barely_branches_on_features():
    """DESIGN.md: the runtime must not "branch on a feature where a hook belongs". The step
    path (the session's step, the scheduler's plan, the executor's launch / sample / fetch, the
    model runner's forward, the output processor's take-in, the batch builder and the Llama
    family's forward) holds at most 15 conditions that name a feature; each new one is a hook
    that was not written."""
    counts: dict[str, list[FeatureCondition]] = {}
    for relpath, roots in STEP_PATH_ROOTS.items():
        for qualname in _step_path(relpath, roots):
            counts[f"inflight/{relpath} {qualname}"] = _feature_conditions(relpath, qualname)
    total = sum(len(found) for found in counts.values())
    report = "\n".join(
        [
            f"{len(found):3d}  {name}" + "".join(f"\n       {c.line}: {c.text}" for c in found)
            for name, found in counts.items()
        ]
        + [f"{total:3d}  total over {len(counts)} functions"]
    )
    print("\nfeature conditions on the step path:\n" + report)
    assert total <= 15, f"{total} feature conditions on the step path (at most 15):\n{report}"


# -- the resident --------------------------------------------------------------------------------


def test_a_resident_holds_at_most_12_fields():
    """A resident is its seat, its progress and its output; a feature's state lives in its own
    object under `Resident.features` (DESIGN.md: one state object per feature), not as more
    fields here."""
    from inflight.runtime.host.residents import Resident

    names = [f.name for f in dataclasses.fields(Resident)]
    print(f"\nResident: {len(names)} fields: {', '.join(names)}")
    assert len(names) <= 12, f"Resident has {len(names)} fields (at most 12): {names}"


# -- the loader knows no family ------------------------------------------------------------------

# Attributes whose test is a test of the family, whatever it is compared with.
FAMILY_ATTRIBUTES = frozenset({"family", "architecture", "architectures", "model_type"})


def _registered_families() -> tuple[set[str], set[str]]:
    """The names the registry answers to (family names, Hugging Face and GGUF architectures,
    lower-cased) and the names of the classes the family modules define."""
    families = importlib.import_module("inflight.model.families")
    registry = importlib.import_module("inflight.model.registry")
    names: set[str] = set()
    classes: set[str] = set()
    for family in registry.families():
        names |= {family.name, *family.hf_architectures, *family.gguf_architectures}
        if inspect.isclass(family.model):
            classes.add(family.model.__name__)
    for info in pkgutil.iter_modules(families.__path__, families.__name__ + "."):
        module = importlib.import_module(info.name)
        classes |= {
            name
            for name, value in vars(module).items()
            if inspect.isclass(value) and value.__module__ == module.__name__
        }
    return {n.lower() for n in names}, classes


def _loader_conditions(tree: ast.Module) -> Iterator[ast.AST]:
    """Every condition of a file: if / elif / while / conditional expression / comprehension
    `if` / assert tests, and `match` subjects with their patterns."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs
        elif isinstance(node, ast.Match):
            yield node.subject
            yield from (case.pattern for case in node.cases)


def _class_names(node: ast.expr) -> Iterator[str]:
    """The class names an isinstance's second argument lists (`A`, `mod.A`, `(A, B)`)."""
    if isinstance(node, ast.Tuple):
        for element in node.elts:
            yield from _class_names(element)
    elif isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr


def _family_tests(condition: ast.AST, names: set[str], classes: set[str]) -> Iterator[str]:
    """Why a condition tests the family: a string naming one, an isinstance / issubclass
    against a family's class, or a read of the config's family / architecture."""
    for node in ast.walk(condition):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and node.value.lower() in names:
                yield f"the family name {node.value!r}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            yield from (f"{node.func.id} {c}" for c in _class_names(node.args[1]) if c in classes)
        elif isinstance(node, ast.Attribute) and node.attr in FAMILY_ATTRIBUTES:
            yield f"reads .{node.attr}"
        elif isinstance(node, ast.Name) and node.id in FAMILY_ATTRIBUTES:
            yield f"reads {node.id}"


def test_the_loader_has_no_family_branch():
    """The loader builds whatever family the registry names (`registry.model_builder`): a new
    family is its module under `families/` and nothing in the loader. A condition on a family
    name, an architecture or a family's class would be a branch the registry exists to avoid."""
    names, classes = _registered_families()
    assert names and classes, "no family registered: the registry's table has moved"
    path = PACKAGE_DIR / "model/checkpoints/loader.py"
    branches = [
        f"loader.py:{condition.lineno}: {ast.get_source_segment(_source(path), condition)} ({why})"
        for condition in _loader_conditions(_tree(path))
        for why in _family_tests(condition, names, classes)
    ]
    print(f"\n{len(names)} family and architecture names, {len(classes)} family classes")
    assert not branches, "the loader branches on the family:\n  " + "\n  ".join(branches)
