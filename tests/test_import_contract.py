"""The import contract: the layers of docs/ARCHITECTURE.md, checked on the source so they cannot drift.

Built on the standard library alone (ast over ie_lab/**/*.py). Every import counts, at module level and inside
function bodies alike: an import moved into a function hides the graph from a reader, not from this check.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "ie_lab"
PACKAGE = "ie_lab"

# The layers, bottom first. A module imports its own layer and the layers below it, nothing above; layers on one
# rank are siblings that do not import one another (no backend imports another). docs/ARCHITECTURE.md draws this
# picture, top first, and test_the_architecture_picture_is_this_table holds the two together.
ORDER: tuple[tuple[str, ...], ...] = (
    ("ops",),
    ("errors",),
    ("arch",),
    ("shared",),
    ("core",),
    ("protocol",),
    ("eager", "vllm", "remote"),
    ("tools",),
    ("widgets",),
    ("session",),
    ("serve",),
    ("front",),
)
RANK = {name: i for i, names in enumerate(ORDER) for name in names}

# Every module of the package, by the table: an entry names a module, or a package and so every module under it
# (a new file in ie_lab/eager/ is eager's). A module no entry covers fails test_every_module_has_a_layer: a new
# top-level module gets its row here (and its line in docs/ARCHITECTURE.md) when it is written.
LAYERS = {
    # Tensor math on torch alone: the steering methods, attention rebuilt from q/k, lens post-processing,
    # projection scores. The vLLM worker runs them in its own process, so they import nothing of ie_lab.
    "ie_lab.ops": "ops",
    # The error classes and their sentence helpers: every layer raises them.
    "ie_lab.errors": "errors",
    # What a model's structure is: config arithmetic, model_type quirks, the binder, the attention-function tap.
    "ie_lab.arch": "arch",
    # The point registry and the address grammar (an Address is checked against a config's ArchFacts).
    "ie_lab.points": "shared",
    "ie_lab.point_kinds": "shared",
    "ie_lab.point_structure": "shared",
    "ie_lab.address": "shared",
    # What every backend shares and none owns: input checks, chat templates, address parsing, result types and the
    # Cache, steering specs and scopes, sampling, projection and load-argument checks, model handles, what each
    # backend can do (capabilities), memory sizing, the points table every backend reports.
    "ie_lab.core": "core",
    "ie_lab.chat": "core",  # the old path of core/chat.py, for the package __init__
    "ie_lab.cache": "core",
    "ie_lab.capabilities": "core",
    "ie_lab.sizing": "core",
    "ie_lab.points_table": "core",
    "ie_lab.corpus": "core",  # the corpus harvest's format, driver and reader (every backend drives it)
    # The Backend protocol every backend implements, and the registry that finds one by name (by import path,
    # so this module imports none of them): a new backend needs nothing else.
    "ie_lab.backend": "protocol",
    # The backends: one model run in this process through transformers (load() builds its model), one served by
    # vLLM, one a client of a Session served elsewhere (with the wire format and the op checks it shares with the
    # server).
    "ie_lab.eager": "eager",
    "ie_lab.loading": "eager",
    "ie_lab.vllm": "vllm",
    "ie_lab.remote": "remote",
    # Built on a backend's model: names in other engines (mappers), SAEs, the families survey, tiny test models.
    "ie_lab.mappers": "tools",
    "ie_lab.sae": "tools",
    "ie_lab.sae_files": "tools",
    "ie_lab.sae_release": "tools",
    "ie_lab.transcoders": "tools",
    "ie_lab.circuit_tracer_files": "tools",
    "ie_lab.transcoder_release": "tools",
    "ie_lab.saelens_export": "tools",
    "ie_lab.coverage": "tools",
    "ie_lab.toy": "tools",
    "ie_lab.tiny": "tools",
    # Notebook panels: Python classes over the public API of the Session (or model) they are given.
    "ie_lab.widgets": "widgets",
    # The Session: concurrency and lifecycle over the backend it holds; it opens the panels.
    "ie_lab.session": "session",
    # `ie-lab serve`: one Session behind HTTP.
    "ie_lab.remote.server": "serve",
    "ie_lab.remote.server_defaults": "serve",
    "ie_lab.remote.server_tokens": "serve",
    "ie_lab.remote.server_app": "serve",
    "ie_lab.remote.command": "serve",
    "ie_lab.remote.connect": "serve",
    # What a user calls: the package __init__ (the free functions), the command line, the generated docs.
    "ie_lab": "front",
    "ie_lab.__main__": "front",
    "ie_lab.cli": "front",
    "ie_lab.cli_points": "front",
    "ie_lab.cli_doctor": "front",
    "ie_lab.cli_common": "front",
    "ie_lab.docs_gen": "front",
    "ie_lab.harvest_ray": "front",  # opens a Session in each Ray task
}

BACKENDS = ("eager", "vllm", "remote")

# Known exceptions, each with why and the fix that removes it: (importer module, layer it may still import) ->
# why. test_known_exceptions_are_still_needed fails on an entry that no longer matches anything, so the list cannot
# go stale. Each sits in a file whose owner makes the fix (issue 29 was split by files).
KNOWN_EDGES: dict[tuple[str, str], str] = {}
KNOWN_CYCLES: list[tuple[set[str], str]] = []
KNOWN_ROOM_CYCLES: list[tuple[set[str], str]] = []


def module_of(path: pathlib.Path, root: pathlib.Path = PKG) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: pathlib.Path = PKG) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (root.parent / rel).with_suffix(".py").is_file() or (root.parent / rel / "__init__.py").is_file()


def imports_of(path: pathlib.Path, root: pathlib.Path = PKG) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it sits; `from pkg import name` names pkg.name when
    that is a module of the package, else pkg (a name defined in pkg's __init__)."""
    me = module_of(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((node.lineno, sub if mod.startswith(root.name) and _is_module(sub, root) else mod))
    return out


@functools.cache  # parsed once per run: every test reads the same source (and none changes the graph)
def graph(root: pathlib.Path = PKG) -> dict[str, list[tuple[int, str]]]:
    return {module_of(p, root): imports_of(p, root) for p in sorted(root.rglob("*.py"))}


def entry_of(module: str) -> str | None:
    """The LAYERS entry that covers an ie_lab module: itself, or the nearest package above it that has one (the
    package __init__'s entry covers only itself)."""
    if module == PACKAGE:
        return PACKAGE
    return max(
        (e for e in LAYERS if e != PACKAGE and (module == e or module.startswith(e + "."))), key=len, default=None
    )


def layer(module: str) -> str | None:
    """The layer of an ie_lab module (None outside ie_lab, or for a module the table does not cover)."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    entry = entry_of(module)
    return LAYERS[entry] if entry else None


ABOVE = "{} imports no layer above it"
SIBLING = "no backend imports another"
PACKAGE_RULE = "no module imports the package __init__"
OPS_RULE = "ops imports only torch and the standard library"
RULES = {ABOVE.format(name) for names in ORDER[:-1] for name in names} | {SIBLING, PACKAGE_RULE, OPS_RULE}


def violations(g: dict[str, list[tuple[int, str]]]) -> list[tuple[str, str, int, str]]:
    """(rule, importer, line, imported) for every edge that breaks a rule."""
    out = []
    for mod, edges in g.items():
        mine = layer(mod)
        for line, target in edges:
            theirs = layer(target)
            if target == PACKAGE and mod != PACKAGE:
                out.append((PACKAGE_RULE, mod, line, target))
            elif mine is not None and theirs is not None and mod != PACKAGE:
                if RANK[theirs] > RANK[mine]:
                    out.append((ABOVE.format(mine), mod, line, target))
                elif RANK[theirs] == RANK[mine] and theirs != mine:
                    out.append((SIBLING, mod, line, target))
            if mine == "ops":
                top = target.split(".")[0]
                if top != "torch" and top not in sys.stdlib_module_names and not target.startswith("ie_lab.ops"):
                    out.append((OPS_RULE, mod, line, target))
    return out


def cycles(g: dict[str, list[tuple[int, str]]]) -> list[set[str]]:
    """The import cycles among the graph's modules: every strongly connected set of two or more."""
    adj = {m: sorted({t for _, t in es if t in g and t != m}) for m, es in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []
    for root in adj:  # Tarjan's algorithm, iteratively (no recursion limit to meet)
        if root in index:
            continue
        work = [(root, iter(adj[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(adj[w])))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def room(module: str) -> str:
    """A module's room: its top-level module or subpackage of ie_lab (ie_lab.eager.taps -> ie_lab.eager)."""
    return ".".join(module.split(".")[:2])


def rooms(g: dict[str, list[tuple[int, str]]]) -> dict[str, list[tuple[int, str]]]:
    """The graph between rooms: chat.py importing core/handles.py while core/inputs.py imports chat.py is a cycle
    between two rooms although no two modules import each other."""
    out: dict[str, list[tuple[int, str]]] = {}
    for mod, edges in g.items():
        out.setdefault(room(mod), []).extend((line, room(t)) for line, t in edges if t.startswith(PACKAGE + "."))
    return out


def _excused(v: tuple[str, str, int, str]) -> bool:
    return (v[1], layer(v[3])) in KNOWN_EDGES


def _unknown(found: list[set[str]], known: list[tuple[set[str], str]]) -> list[list[str]]:
    return [sorted(c) for c in found if not any(c <= k for k, _ in known)]


def test_every_module_has_a_layer():
    uncovered = sorted(m for m in graph() if layer(m) is None)
    assert not uncovered, (
        f"modules with no row in LAYERS (add one, and the module to docs/ARCHITECTURE.md): {uncovered}"
    )
    assert set(LAYERS.values()) == set(RANK), "every layer of ORDER has modules, every row names a layer of ORDER"


def test_a_new_module_without_a_row_fails():
    # A new top-level module belongs to no entry until it is given one; a new file of a subpackage is that
    # subpackage's; the package __init__'s entry covers no module below it.
    assert layer("ie_lab.brand_new") is None
    assert layer("ie_lab.eager.brand_new") == "eager" and layer("ie_lab.remote.server") == "serve"
    assert layer("ie_lab.remote.brand_new") == "remote"


def test_every_row_names_a_module():
    g = graph()
    stale = sorted(e for e in LAYERS if e not in g)
    assert not stale, f"LAYERS rows that name no module or package of ie_lab (delete or rename them): {stale}"


def test_the_layers_hold():
    found = [v for v in violations(graph()) if not _excused(v)]
    assert not found, "import contract broken (rule, importer, line, imported):\n" + "\n".join(map(str, found))


def test_no_import_cycle():
    bad = _unknown(cycles(graph()), KNOWN_CYCLES)
    assert not bad, f"import cycles in ie_lab (every import counts, inside functions too): {bad}"


def test_no_import_cycle_between_rooms():
    bad = _unknown(cycles(rooms(graph())), KNOWN_ROOM_CYCLES)
    assert not bad, f"import cycles between ie_lab's top-level modules and subpackages: {bad}"


def test_no_import_cycle_in_the_validator():
    g = graph(ROOT / "validator")
    assert "validator.spec" in {t for _, t in g["validator.run"]}  # `from . import spec as S`
    assert "validator.run" in {t for _, t in g["validator.__main__"]}  # inside main()
    assert not cycles(g), f"import cycles in validator/ (every import counts, inside functions too): {cycles(g)}"


def test_known_exceptions_are_still_needed():
    g = graph()
    used = {(v[1], layer(v[3])) for v in violations(g)}
    stale = sorted(set(KNOWN_EDGES) - used)
    assert not stale, f"these known exceptions no longer happen: delete them from KNOWN_EDGES: {stale}"
    for found, known, name in (
        (cycles(g), KNOWN_CYCLES, "KNOWN_CYCLES"),
        (cycles(rooms(g)), KNOWN_ROOM_CYCLES, "KNOWN_ROOM_CYCLES"),
    ):
        gone = [sorted(k) for k, _ in known if not any(c <= k for c in found)]
        assert not gone, f"these known cycles are gone: delete them from {name}: {gone}"
        smaller = [(sorted(k), sorted(c)) for k, _ in known for c in found if c < k]
        assert not smaller, f"a known cycle shrank: keep only the modules still in it in {name}: {smaller}"


def test_every_import_is_seen():
    g = graph()
    assert "ie_lab.eager.capture" in g and "ie_lab.vllm.worker" in g and "ie_lab.core.inputs" in g
    assert "ie_lab.core.inputs" in {t for _, t in g["ie_lab.eager.capture"]}  # `from ..core.inputs import x`
    assert "ie_lab.arch.attention_tap" in {t for _, t in g["ie_lab.arch.binder"]}  # `from . import module`
    # an import inside a function body counts: the free functions of the package import their backend lazily
    assert "ie_lab.loading" in {t for _, t in g["ie_lab"]}


# Each rule fires on the kind of edge it forbids: the import graph the code had before the core existed
# (issue 15: measured at commit 5d11ce8) and before issue 29 (chat <-> core, loading -> eager, points_table ->
# eager.taps, helpers importing upwards), reduced to one such edge per rule, and edges a plausible slip would add.
BROKEN = {
    SIBLING: {
        "ie_lab.vllm.session": [(55, "ie_lab.eager.inputs")],
        "ie_lab.eager.generate": [(1, "ie_lab.vllm.wire")],
        "ie_lab.remote.client": [(1, "ie_lab.eager.capture")],
    },
    ABOVE.format("ops"): {"ie_lab.ops.lens": [(1, "ie_lab.vllm.worker")]},
    ABOVE.format("errors"): {"ie_lab.errors": [(1, "ie_lab.points")]},
    ABOVE.format("arch"): {"ie_lab.arch.binder": [(387, "ie_lab.eager.attention_tap")]},
    ABOVE.format("shared"): {
        "ie_lab.address": [(1, "ie_lab.core.results")],
        "ie_lab.points": [(1, "ie_lab.core.results")],
    },
    ABOVE.format("core"): {
        "ie_lab.core.handles": [(1, "ie_lab.eager.model")],
        "ie_lab.chat": [(1, "ie_lab.session")],
        "ie_lab.points_table": [(58, "ie_lab.eager.taps")],
        "ie_lab.core.inputs": [(1, "ie_lab.backend")],
    },
    ABOVE.format("protocol"): {"ie_lab.backend": [(1, "ie_lab.eager.backend")]},
    ABOVE.format("eager"): {"ie_lab.eager.backend": [(1, "ie_lab.session")]},
    ABOVE.format("vllm"): {"ie_lab.vllm.backend": [(1, "ie_lab.mappers")]},
    ABOVE.format("remote"): {"ie_lab.remote.client": [(38, "ie_lab.session")]},
    ABOVE.format("tools"): {"ie_lab.coverage": [(1, "ie_lab.widgets.picker")]},
    ABOVE.format("widgets"): {"ie_lab.widgets.picker": [(1, "ie_lab.session")]},
    ABOVE.format("session"): {"ie_lab.session": [(1, "ie_lab.remote.server")]},
    ABOVE.format("serve"): {"ie_lab.remote.server": [(1, "ie_lab.cli")]},
    PACKAGE_RULE: {"ie_lab.eager.capture": [(182, "ie_lab")]},
    OPS_RULE: {
        "ie_lab.ops.steering": [(1, "ie_lab.errors")],
        "ie_lab.ops.attention": [(1, "numpy")],
    },
}


def test_every_rule_is_shown_to_fire():
    assert set(BROKEN) == RULES


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_each_rule_fires(rule):
    g = BROKEN[rule]
    fired = {(v[0], v[1]) for v in violations(g)}
    assert {(rule, mod) for mod in g} <= fired


def test_what_the_rules_allow_is_allowed():
    # Downward and sideways-within-a-layer edges pass: a rule that fired on everything would pass the tests above.
    allowed = {
        "ie_lab.session": [(1, "ie_lab.widgets.picker"), (2, "ie_lab.core.inputs"), (3, "ie_lab.backend")],
        "ie_lab.eager.backend": [(1, "ie_lab.loading"), (2, "ie_lab.eager.taps"), (3, "ie_lab.points_table")],
        "ie_lab.widgets.features": [(1, "ie_lab.sae")],
        "ie_lab.cli": [(1, "ie_lab.remote.command"), (2, "ie_lab.coverage")],
        "ie_lab.address": [(1, "ie_lab.arch.config_facts"), (2, "ie_lab.errors")],
        "ie_lab.ops.lens": [(1, "torch"), (2, "math"), (3, "ie_lab.ops.projection")],
    }
    assert violations(allowed) == []


def test_a_cycle_is_found():
    g = {
        "ie_lab.vllm.worker": [(1, "ie_lab.vllm.static_taps")],
        "ie_lab.vllm.static_taps": [(2, "ie_lab.vllm.worker")],
        "ie_lab.points": [],
    }
    assert cycles(g) == [{"ie_lab.vllm.worker", "ie_lab.vllm.static_taps"}]
    # the cycle issue 29 found: chat.py -> core/handles.py, core/inputs.py -> chat.py (no module pair is a cycle)
    g = {
        "ie_lab.chat": [(11, "ie_lab.core.handles")],
        "ie_lab.core.handles": [(12, "ie_lab.errors")],
        "ie_lab.core.inputs": [(14, "ie_lab.chat")],
        "ie_lab.errors": [],
    }
    assert cycles(g) == [] and cycles(rooms(g)) == [{"ie_lab.chat", "ie_lab.core"}]


# ---- docs/ARCHITECTURE.md: the picture of these layers ----------------------------------------------------------

ARCH_DOC = ROOT / "docs" / "ARCHITECTURE.md"
# In the picture, a word ending in .py is a module and one ending in / a package, both relative to ie_lab/.
_NAMED = re.compile(r"(?<![\w./<>-])((?:[a-z_0-9]+/)*[a-z_0-9]+\.py|(?:[a-z_0-9]+/)+)(?![\w/])")


def picture() -> list[tuple[str, str]]:
    """(layer, module or package) for every name in the layer picture of docs/ARCHITECTURE.md: the first code block,
    whose first column names the layer of the lines it starts."""
    text = ARCH_DOC.read_text()
    block = text.split("```\n", 2)[1]
    out, current = [], None
    for line in block.splitlines():
        head = line[:13].strip()
        if head:
            current = head.split()[0]
        for name in _NAMED.findall(line[13:]):
            assert current is not None, line
            parts = name.rstrip("/").removesuffix(".py").split("/")
            if parts[-1] == "__init__":
                parts.pop()
            out.append((current, ".".join([PACKAGE, *parts])))
    return out


def test_the_architecture_picture_is_this_table():
    named = picture()
    g = graph()
    assert {where for where, _ in named} == set(RANK), "the picture has one row per layer, named as in ORDER"
    missing = sorted({m for _, m in named if m not in g})
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"
    # Every module is drawn in its own layer's row, itself or by its package; a row may mention a module of another
    # layer (`refuses from capabilities.py`) only where that module is drawn in its own row too.
    drawn = {(where, m) for where, m in named if layer(m) == where}
    unnamed = sorted(m for m in g if m != PACKAGE and not any(m == n or m.startswith(n + ".") for _, n in drawn))
    assert not unnamed, (
        f"modules docs/ARCHITECTURE.md does not draw in their layer's row (nor their package): {unnamed}"
    )
    ranks = [RANK[where] for where, _ in named]
    assert ranks == sorted(ranks, reverse=True), "the picture runs from the top layer down"


def test_the_wire_format_imports_without_side_effects():
    # The vLLM client and its worker share ie_lab/vllm/wire.py for the data they exchange; importing it must not
    # import vLLM or the worker (which registers graph mode's model loader with vLLM when imported).
    code = (
        "import sys, ie_lab.vllm.wire as w; w.unpack(w.pack(__import__('torch').ones(2)));"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'ie_lab.vllm.worker',"
        " 'ie_lab.vllm.static_taps'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _lazy_imports() -> dict[str, tuple[str, str | None]]:
    """The names the package __init__ imports under `if TYPE_CHECKING:`, as its _LAZY table spells them."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
    )
    out: dict[str, tuple[str, str | None]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for a in node.names:
            if node.module is None:  # `from . import sizing`: the module itself
                out[a.asname or a.name] = (f".{a.name}", None)
            else:
                out[a.asname or a.name] = (f".{node.module}", a.name)
    return out


def test_the_package_imports_no_torch():
    # `import ie_lab` (and so every `ie-lab` command line, --help included) loads neither torch nor transformers:
    # the package __init__ imports its heavy names on first use (PEP 562).
    code = (
        "import sys, ie_lab; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'vllm'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_lazy_name_resolves_to_its_module_object():
    import importlib

    import ie_lab

    lazy = _lazy_imports()
    assert lazy == ie_lab._LAZY  # what IDEs and mypy see is what __getattr__ imports
    assert set(lazy) <= set(ie_lab.__all__) and set(ie_lab.__all__) <= set(dir(ie_lab))
    for name, (module, attr) in lazy.items():
        mod = importlib.import_module(module, "ie_lab")
        assert getattr(ie_lab, name) is (mod if attr is None else getattr(mod, attr)), name
    star: dict = {}
    exec("from ie_lab import *", star)
    assert set(ie_lab.__all__) <= set(star) and star["Session"] is ie_lab.Session
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ie_lab.nope  # noqa: B018
