"""The import contract: the layers of docs/ARCHITECTURE.md, checked on the source so they cannot drift.

Built on the standard library alone (ast over ie_lab/**/*.py). Every import counts, at module level and inside
function bodies alike: an import moved into a function hides the graph from a reader, not from this check.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "ie_lab"

# Module prefix -> layer. The longest matching prefix wins; a module no prefix names is "tool" (mappers,
# points_table, sizing, coverage, docs_gen, toy: helpers above the core that no rule restricts yet).
LAYERS = {
    # Tensor math on torch alone: the steering methods, attention rebuilt from q/k, lens post-processing,
    # projection scores. The vLLM worker runs them in its own process, so they import nothing of ie_lab.
    "ie_lab.ops": "ops",
    # Plain facts every layer reads: the point registry, the address grammar, the error classes, the Cache type.
    "ie_lab.points": "shared",
    "ie_lab.address": "shared",
    "ie_lab.errors": "shared",
    "ie_lab.cache": "shared",
    # What a model's structure is: config arithmetic, model_type quirks, the binder, the attention-function tap.
    "ie_lab.arch": "arch",
    # The Backend protocol every backend implements, and the registry that finds one by name (by import path,
    # so this module imports none of them): a new backend needs nothing else.
    "ie_lab.backend": "protocol",
    # What both backends share and neither owns: input checks, address parsing, result types, steering specs
    # and scopes, sampling checks, projection checks, model handles. The chat template rendering is read by
    # the input checks, so it sits here too.
    "ie_lab.core": "core",
    "ie_lab.chat": "core",
    # What each backend can do and the refusal text: read by every backend and by the remote server.
    "ie_lab.capabilities": "core",
    # The backends: one model run in this process through transformers, one served by vLLM.
    "ie_lab.eager": "eager",
    "ie_lab.vllm": "vllm",
    # The remote backend: a client for a Session served elsewhere, and the server that serves one.
    "ie_lab.remote": "remote",
    # Sessions and loading: concurrency, lifecycle, choosing a backend.
    "ie_lab.session": "session",
    "ie_lab.loading": "session",
    # Notebook panels: they talk to a Session.
    "ie_lab.widgets": "widgets",
}

# The package's own __init__ (the free functions users call): a facade over everything, imported by nothing.
PACKAGE = "ie_lab"

# Layers that must not reach the backends, the sessions or the panels: they sit below all of them.
BELOW_BACKENDS = ("ops", "shared", "arch", "core", "protocol")

BACKENDS = ("eager", "vllm", "remote")

RULES = {
    **{f"{b} imports no other backend": (b, tuple(o for o in BACKENDS if o != b)) for b in BACKENDS},
    **{
        f"{low} imports no backend, session or widget": (low, (*BACKENDS, "session", "widgets"))
        for low in BELOW_BACKENDS
    },
}

# Known exceptions, each named with why and removed with the import it excuses: (importer module, layer it may
# still import), or a set of modules that may still import one another. test_known_exceptions_are_still_needed
# fails on an entry that no longer matches anything, so the list cannot go stale. None are left: the Session
# redesign (issue 15 item 1) removed the vLLM session's eager imports, the package imports and the
# package/loading/session/vllm-session cycle that the core move could not.
KNOWN_EDGES: set[tuple[str, str]] = set()
KNOWN_CYCLES: list[set[str]] = []


def module_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (PKG.parent / rel).with_suffix(".py").is_file() or (PKG.parent / rel / "__init__.py").is_file()


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it sits; `from pkg import name` names pkg.name when
    that is a module of ie_lab, else pkg (a name defined in pkg's __init__)."""
    me = module_of(path)
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
                out.append((node.lineno, sub if mod.startswith(PACKAGE) and _is_module(sub) else mod))
    return out


def graph() -> dict[str, list[tuple[int, str]]]:
    return {module_of(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def layer(module: str) -> str | None:
    """The layer of an ie_lab module (None outside ie_lab)."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    if module == PACKAGE:
        return "package"
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return LAYERS[best] if best else "tool"


def violations(g: dict[str, list[tuple[int, str]]]) -> list[tuple[str, str, int, str]]:
    """(rule, importer, line, imported) for every edge that breaks a rule."""
    out = []
    for mod, edges in g.items():
        mine = layer(mod)
        for line, target in edges:
            theirs = layer(target)
            if theirs == "package" and mod != PACKAGE:
                out.append(("no module imports the package __init__", mod, line, target))
            for rule, (who, banned) in RULES.items():
                if mine == who and theirs in banned:
                    out.append((rule, mod, line, target))
            if mine == "ops":
                top = target.split(".")[0]
                if top != "torch" and top not in sys.stdlib_module_names and not target.startswith("ie_lab.ops"):
                    out.append(("ops imports only torch and the standard library", mod, line, target))
    return out


def cycles(g: dict[str, list[tuple[int, str]]]) -> list[set[str]]:
    """The import cycles among ie_lab's modules: every strongly connected set of two or more."""
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


def _excused(v: tuple[str, str, int, str]) -> bool:
    return (v[1], layer(v[3])) in KNOWN_EDGES


def test_the_layers_hold():
    found = [v for v in violations(graph()) if not _excused(v)]
    assert not found, "import contract broken (rule, importer, line, imported):\n" + "\n".join(map(str, found))


def test_no_import_cycle():
    bad = [sorted(c) for c in cycles(graph()) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not bad, f"import cycles in ie_lab (every import counts, inside functions too): {bad}"


def test_known_exceptions_are_still_needed():
    g = graph()
    used = {(v[1], layer(v[3])) for v in violations(g)}
    stale = sorted(KNOWN_EDGES - used)
    assert not stale, f"these known exceptions no longer happen: delete them from KNOWN_EDGES: {stale}"
    found = cycles(g)
    gone = [sorted(k) for k in KNOWN_CYCLES if not any(c <= k for c in found)]
    assert not gone, f"these known cycles are gone: delete them from KNOWN_CYCLES: {gone}"
    smaller = [(sorted(k), sorted(c)) for k in KNOWN_CYCLES for c in found if c < k]
    assert not smaller, f"a known cycle shrank: keep only the modules still in it in KNOWN_CYCLES: {smaller}"


def test_every_import_is_seen():
    g = graph()
    assert "ie_lab.eager.capture" in g and "ie_lab.vllm.worker" in g and "ie_lab.core.inputs" in g
    assert "ie_lab.core.inputs" in {t for _, t in g["ie_lab.eager.capture"]}  # `from ..core.inputs import x`
    assert "ie_lab.arch.attention_tap" in {t for _, t in g["ie_lab.arch.binder"]}  # `from . import module`
    # an import inside a function body counts: the free functions of the package import their backend lazily
    assert "ie_lab.loading" in {t for _, t in g["ie_lab"]}


# Each rule fires on the kind of edge it forbids: the import graph the code had before the core existed
# (issue 15: measured at commit 5d11ce8), reduced to one such edge per rule, and edges a plausible slip would add.
BROKEN = {
    "vllm imports no other backend": {"ie_lab.vllm.session": [(55, "ie_lab.eager.inputs")]},
    "eager imports no other backend": {"ie_lab.eager.generate": [(1, "ie_lab.vllm.wire")]},
    "remote imports no other backend": {"ie_lab.remote.client": [(1, "ie_lab.eager.capture")]},
    "arch imports no backend, session or widget": {"ie_lab.arch.binder": [(387, "ie_lab.eager.attention_tap")]},
    "core imports no backend, session or widget": {
        "ie_lab.core.handles": [(1, "ie_lab.eager.model")],
        "ie_lab.chat": [(1, "ie_lab.session")],
    },
    "shared imports no backend, session or widget": {"ie_lab.cache": [(1, "ie_lab.widgets.picker")]},
    "ops imports no backend, session or widget": {"ie_lab.ops.lens": [(1, "ie_lab.vllm.worker")]},
    "protocol imports no backend, session or widget": {"ie_lab.backend": [(1, "ie_lab.eager.backend")]},
    "no module imports the package __init__": {"ie_lab.eager.capture": [(182, "ie_lab")]},
    "ops imports only torch and the standard library": {
        "ie_lab.ops.steering": [(1, "ie_lab.errors")],
        "ie_lab.ops.attention": [(1, "numpy")],
    },
}


def test_every_rule_is_shown_to_fire():
    others = {"no module imports the package __init__", "ops imports only torch and the standard library"}
    assert set(BROKEN) == {*RULES, *others}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_each_rule_fires(rule):
    g = BROKEN[rule]
    fired = {(v[0], v[1]) for v in violations(g)}
    assert {(rule, mod) for mod in g} <= fired


def test_a_cycle_is_found():
    g = {
        "ie_lab.vllm.worker": [(1, "ie_lab.vllm.static_taps")],
        "ie_lab.vllm.static_taps": [(2, "ie_lab.vllm.worker")],
        "ie_lab.points": [],
    }
    assert cycles(g) == [{"ie_lab.vllm.worker", "ie_lab.vllm.static_taps"}]


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
