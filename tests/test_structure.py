"""The house: every module imports alone, imports form no circle, modules stay small."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import time

import pytest
from conftest import run_child

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dm_env_rpc_client"
MAX_LINES = 550  # the guideline is ~500 lines


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {
        _module_name(path): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_proto" not in path.parts
    }


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its code (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from package import module`` imports the module; else the names' module.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, or None."""
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if node in trail:
            return [*trail[trail.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            found = visit(target, [*trail, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_import_graph_checker_sees_circles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_two_modules_import_each_other_not_even_inside_a_function() -> None:
    graph = _graph()
    # Packages import their own modules to re-export them; only their modules count here.
    graph = {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
        if name != "dm_env_rpc_client"
    }
    pairs = sorted(
        (a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ())
    )
    assert pairs == []
    assert _cycle(graph) is None


def test_presentation_depends_on_the_core_never_the_reverse() -> None:
    graph = _graph()
    assert "dm_env_rpc_client.environment" not in graph["dm_env_rpc_client.display"]
    assert "dm_env_rpc_client.specs" not in graph["dm_env_rpc_client.display"]
    assert "dm_env_rpc_client.environment" not in graph["dm_env_rpc_client._adaptor.stacked"]
    # Core modules import display only inside the methods that render (checked by name).
    for name in ("dm_env_rpc_client.specs", "dm_env_rpc_client.environment"):
        tree = ast.parse(_modules()[name].read_text())
        top = [
            node
            for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "display" in ast.unparse(node)
        ]
        assert top == [], name


# Imports each module named in argv alone: before each, every package module is dropped from
# sys.modules and an empty package stands in for the package (its __init__ imports everything,
# which would hide a module that works only after another was imported), so each module's body
# and those of the package modules it imports run afresh. Only compiling is shared: each
# source file is compiled once per process (with PYTHONDONTWRITEBYTECODE, as on this machine,
# there is no .pyc, and recompiling the same sources for every module was most of the cost).
_IMPORT_ALONE = """
import importlib, importlib.machinery, sys, types
root = sys.argv[1]
compiled = {}
source_to_code = importlib.machinery.SourceFileLoader.source_to_code
def compile_once(self, data, path, **kwargs):
    key = (path, bytes(data))
    if key not in compiled:
        compiled[key] = source_to_code(self, data, path, **kwargs)
    return compiled[key]
importlib.machinery.SourceFileLoader.source_to_code = compile_once
for name in sys.argv[2:]:
    for key in [k for k in sys.modules if k.startswith('dm_env_rpc_client')]:
        if '._proto' not in key:
            del sys.modules[key]
    stub = types.ModuleType('dm_env_rpc_client')
    stub.__path__ = [root]
    sys.modules['dm_env_rpc_client'] = stub
    try:
        importlib.import_module(name)
    except ImportError as exc:  # an integration whose extra is not installed
        missing = exc.name or getattr(exc.__cause__, 'name', None) or ''
        module = name.rsplit('.', 1)[1]
        if not (name.startswith('dm_env_rpc_client.integrations.') and missing
                and not missing.startswith('dm_env_rpc')
                and (module.startswith('_') or 'dm_env_rpc_client[' in str(exc))):
            print(f'{name}: {type(exc).__name__}: {exc}')
    except Exception as exc:
        print(f'{name}: {type(exc).__name__}: {exc}')
print('imported', len(sys.argv) - 2)
"""


def test_each_module_imports_alone() -> None:
    names = [
        name for name in _modules() if name != "dm_env_rpc_client" and not name.endswith("__main__")
    ]
    # Two children at once (the integrations, whose libraries are most of the import time,
    # and the rest): on a loaded machine each process gets its own share of the cores.
    groups = [
        [name for name in names if name.startswith("dm_env_rpc_client.integrations.")],
        [name for name in names if not name.startswith("dm_env_rpc_client.integrations.")],
    ]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _IMPORT_ALONE, str(PACKAGE), *group],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for group in groups
    ]
    deadline = time.monotonic() + 90
    try:
        results = [
            child.communicate(timeout=max(1.0, deadline - time.monotonic())) for child in children
        ]
    except subprocess.TimeoutExpired:
        for child in children:
            child.kill()
        outputs = [child.communicate() for child in children]
        pytest.fail(f"importing every module alone ran over 90 s; the children printed {outputs}")
    for child, group, (stdout, stderr) in zip(children, groups, results, strict=True):
        assert child.returncode == 0, stderr
        assert stdout == f"imported {len(group)}\n", stdout
    assert sum(len(group) for group in groups) == len(names) > 100


def test_modules_stay_under_the_size_guideline() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: size for name, size in sizes.items() if size > MAX_LINES} == {}


def test_the_docs_layout_lists_every_module() -> None:
    text = (ROOT / "docs" / "index.md").read_text()
    layout = text[text.index("## How the package is laid out") :]
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_proto" not in path.parts
        and "integrations" not in path.parts  # a folder of its own, listed as one
        and f"`{path.relative_to(PACKAGE)}`" not in layout
    ]
    assert missing == [], "add these modules to the layout table in docs/index.md"


# The layers of the package, lowest first (docs/architecture.md draws them). A module may
# import modules of its own layer or of lower ones, never of a higher one. A name ending in
# ".*" stands for a folder's modules; an exact name wins over a folder.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["errors", "_base", "_base.*"]),
    ("codec", ["tensors", "specs", "messages", "display", "random_actions", "_codec", "_codec.*"]),
    ("fast paths", ["_fastpath", "_fastpath.*"]),
    ("transport", ["connection", "aio", "_transport", "_transport.*"]),
    ("adaptor", ["environment", "aio_environment", "properties", "_adaptor", "_adaptor.*"]),
    ("servers", ["server", "server.*", "launch", "_launch", "_launch.*"]),
    ("batch", ["batched", "multiagent", "_batch", "_batch.*"]),
    ("tools", ["recording", "multiagent_recording", "conformance", "_tools", "_tools.*"]),
    ("stepping", ["stepping", "_stepping", "_stepping.*", "watch", "_watch", "_watch.*"]),
    ("command-line pieces", ["_cli", "_cli.run", "_cli.check", "_cli.watch"]),
    ("integrations", ["integrations", "integrations.*"]),
    ("programs", ["cli", "__main__", "server.__main__", "_cli.record", "_cli.rllink"]),
    ("the package", [""]),
]


def _layer_of(name: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The index of ``name``'s layer (``name`` without the package prefix), or None."""
    for index, (_, members) in enumerate(layers):
        if name in members:
            return index
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, members) in enumerate(layers):
        for member in members:
            prefix = member.removesuffix("*")
            fits = member.endswith(".*") and name.startswith(prefix)
            if fits and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def _short(name: str) -> str:
    return name.removeprefix("dm_env_rpc_client").removeprefix(".")


def _against_the_flow(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Every import of a higher layer's module, as "module (layer) -> module (layer)"."""
    found = []
    for name, targets in sorted(graph.items()):
        mine = _layer_of(_short(name), layers)
        for target in sorted(targets):
            theirs = _layer_of(_short(target), layers)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(
                    f"{_short(name)} ({layers[mine][0]}) -> {_short(target)} ({layers[theirs][0]})"
                )
    return found


def test_the_layer_checker_sees_an_import_against_the_flow() -> None:
    layers = [("low", ["a", "f.*"]), ("high", ["b", "f.top"])]
    graph = {"a": {"b"}, "b": {"a"}, "f.x": {"f.top"}, "f.top": {"f.x"}}
    assert _layer_of("f.x", layers) == 0 and _layer_of("f.top", layers) == 1
    assert _against_the_flow(graph, layers) == ["a (low) -> b (high)", "f.x (low) -> f.top (high)"]


def test_every_module_has_a_layer() -> None:
    missing = sorted(
        _short(n) or "__init__" for n in _graph() if _layer_of(_short(n), LAYERS) is None
    )
    assert missing == [], "declare the layer of these modules in LAYERS"


def test_no_module_imports_against_the_flow_of_the_layers() -> None:
    """Down the flow only: the codec never imports a connection, the adaptor never a batch,
    the batch never the command line, and nothing but the programs imports an integration."""
    assert _against_the_flow(_graph(), LAYERS) == []


def test_the_architecture_page_names_every_folder_and_layer() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = sorted(
        f"`{path.parent.name}/`" for path in PACKAGE.glob("*/__init__.py") if path.parent.name
    )
    assert [f for f in folders if f not in text] == [], "describe these folders in the page"
    rules = text[text.index("## The rules of the layering") :]
    assert [name for name, _ in LAYERS if f"| {name} |" not in rules] == []


def test_nothing_but_the_command_lines_imports_their_pieces() -> None:
    """``_cli/`` is the command lines' own room: the server's ``__main__`` and ``run --ray`` take
    their argument types from ``_base.cli_args``, and the library its loop from ``stepping``."""
    outside = sorted(
        f"{_short(name)} -> {_short(target)}"
        for name, targets in _graph().items()
        for target in targets
        if (_short(target) == "_cli" or _short(target).startswith("_cli."))
        and not (_short(name) == "cli" or _short(name).startswith("_cli."))
    )
    assert outside == []


def test_the_stepping_loop_is_public_and_documented() -> None:
    """``dmr.collect`` is the one stepping loop: exported, with a guide page in the site's nav
    that runs it, and its module in the layout table."""
    import dm_env_rpc_client as dmr
    from dm_env_rpc_client import stepping

    for name in stepping.__all__:
        assert name == "DEFAULT_PIPELINE" or getattr(dmr, name) is getattr(stepping, name)
    page = (ROOT / "docs" / "stepping.md").read_text()
    assert "```python" in page and "dmr.collect(" in page
    assert "stepping.md" in (ROOT / "mkdocs.yml").read_text()
    assert "dmr.collect(" in (ROOT / "README.md").read_text()


# integrations/: one folder per library, Gymnasium's own layout (issue 35). Each folder's
# __init__ gives the library's one-line description and its public names; its machinery is
# private modules beside it.
INTEGRATION_FOLDERS = {"gymnasium", "minari", "pettingzoo", "ray", "rlds", "sb3"}


def test_integrations_are_one_folder_per_library() -> None:
    folder = PACKAGE / "integrations"
    loose = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    assert loose == [], "put these modules in their library's folder under integrations/"
    folders = {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert folders == INTEGRATION_FOLDERS
    for name in sorted(folders):
        init = ast.parse((folder / name / "__init__.py").read_text())
        doc = (ast.get_docstring(init) or "").strip()
        assert doc and "\n" not in doc, f"integrations/{name}/__init__.py: a one-line docstring"
        exported = [
            node
            for node in init.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        assert exported, f"integrations/{name}/__init__.py lists its public names in __all__"
        public = [
            p.name
            for p in (folder / name).glob("*.py")
            if p.name != "__init__.py" and not p.name.startswith("_")
        ]
        assert public == [], f"integrations/{name}/: its public names come from __init__ only"


def test_the_public_integration_paths_are_unchanged() -> None:
    """The names users import still import from where they always did."""
    code = (
        "from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv, GymnasiumVectorEnv\n"
        "from dm_env_rpc_client.integrations.ray import ServerFleet, run_sharded\n"
        "from dm_env_rpc_client.integrations.pettingzoo import ParallelEnv\n"
    )
    result = run_child([sys.executable, "-c", code], timeout=100)
    assert result.returncode == 0, result.stderr
