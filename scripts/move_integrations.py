"""Lays ``dm_env_rpc_client/integrations/`` out as one subpackage per library (issue 35).

Run from the repository root on a clean tree, then commit what it did as one commit::

    python scripts/move_integrations.py && git add -A && git commit

What it does, for each library (gymnasium, ray, sb3, minari, rlds):

1. ``git mv`` the library's flat modules into ``integrations/<library>/``: the public
   module ``<library>.py`` becomes ``<library>/_api.py`` and each private helper
   ``_<prefix>_<name>.py`` becomes ``<library>/_<name>.py`` (the table ``MOVES``);
   a module already in a subpackage (``pettingzoo/``) is left where it is.
2. Writes ``<library>/__init__.py``: the public module's one-line description, then
   its public names (its ``__all__``, else its top-level names without a leading
   underscore) re-exported from ``_api``, so every public import path works unchanged.
3. Rewrites the moved modules' relative imports (one level deeper now) and every
   dotted or slashed reference to a moved module anywhere in the tree (package,
   tests, bench, docs, scripts), including names that tests take from a public
   module but that the new ``__init__`` does not re-export (``from
   ...integrations.gymnasium import _x`` then reads from ``gymnasium._api``).

It is idempotent: a second run finds nothing to move and changes nothing.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INTEGRATIONS = ROOT / "dm_env_rpc_client" / "integrations"
PACKAGE = "dm_env_rpc_client.integrations"

# library -> (its public module, the prefixes of its private helpers, extra helpers by name)
LIBRARIES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "gymnasium": ("gymnasium", ("_gym_",), ("_vector_batch",)),
    "ray": ("ray", ("_ray_",), ()),
    "sb3": ("sb3", ("_sb3_",), ()),
    "minari": ("minari", ("_minari_",), ()),
    "rlds": ("rlds", ("_rlds_",), ()),
}
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".cfg", ".txt", ".ipynb", ".pyi", ""}
SKIP_PARTS = {".git", ".venv", "node_modules", "__pycache__", "_proto"}


def _moves() -> dict[str, tuple[str, str]]:
    """Old module name (in integrations/) -> (library, new module name in its folder)."""
    moves: dict[str, tuple[str, str]] = {}
    for library, (public, prefixes, extras) in LIBRARIES.items():
        if (INTEGRATIONS / f"{public}.py").exists():
            moves[public] = (library, "_api")
        for path in sorted(INTEGRATIONS.glob("_*.py")):
            name = path.stem
            for prefix in prefixes:
                if name.startswith(prefix):
                    moves[name] = (library, "_" + name[len(prefix) :])
            if name in extras:
                moves[name] = (library, name)
    return moves


def _bound_names(tree: ast.Module) -> set[str]:
    """Names the module binds when imported (not those under ``if TYPE_CHECKING``)."""
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Try):
            for inner in node.body:
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    bound.update((a.asname or a.name).split(".")[0] for a in inner.names)
    return bound


def _public_names(path: pathlib.Path) -> tuple[str, list[str]]:
    """The module's one-line description and its public names."""
    tree = ast.parse(path.read_text())
    doc = (ast.get_docstring(tree) or "").strip().splitlines()
    line = doc[0] if doc else ""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return line, [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return line, sorted(n for n in names if not n.startswith("_"))


def _relative(module_text: str, old: str, moves: dict[str, tuple[str, str]]) -> str:
    """A moved module's relative imports, seen from one level deeper."""
    library = moves[old][0]

    def sibling(name: str) -> str:
        """``name`` (a flat integrations module) as seen from inside ``library``'s folder."""
        if name in moves:
            lib, new = moves[name]
            return (
                f".{new}" if lib == library else f"..{lib}.{new}" if new != "_api" else f"..{lib}"
            )
        return f"..{name}"  # an integrations module that did not move (a subpackage)

    def rewrite(match: re.Match[str]) -> str:
        indent, dots, rest = match.group(1), match.group(2), match.group(3)
        if dots == ".":
            name, _, tail = rest.strip().partition(" ")
            if name == "import":  # from . import a as b, c
                parts = []
                for item in tail.split(","):
                    item = item.strip()
                    base, _, alias = item.partition(" as ")
                    target = sibling(base)
                    parent, _, leaf = target.rpartition(".")
                    parts.append((parent or ".", leaf, alias or (base if leaf != base else "")))
                return "\n".join(
                    f"{indent}from {p} import {leaf}" + (f" as {a}" if a else "")
                    for p, leaf, a in parts
                )
            return f"{indent}from {sibling(name)} {tail}"
        return f"{indent}from .{dots}{rest}"

    return re.sub(r"(?m)^([ \t]*)from (\.+)([A-Za-z_ ].*)$", rewrite, module_text)


def _text_files() -> list[pathlib.Path]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return [
        ROOT / name
        for name in listed
        if not SKIP_PARTS.intersection(pathlib.Path(name).parts)
        and pathlib.Path(name).suffix in TEXT_SUFFIXES
        and (ROOT / name).is_file()
    ]


def main() -> int:
    moves = _moves()
    if not moves:
        print("nothing to move")
        return 0
    exported: dict[str, tuple[str, list[str]]] = {}
    for old, (library, new) in moves.items():
        if new == "_api":
            exported[library] = _public_names(INTEGRATIONS / f"{old}.py")
    for old, (library, new) in moves.items():
        folder = INTEGRATIONS / library
        folder.mkdir(exist_ok=True)
        source = INTEGRATIONS / f"{old}.py"
        text = _relative(source.read_text(), old, moves)
        subprocess.run(["git", "mv", str(source), str(folder / f"{new}.py")], cwd=ROOT, check=True)
        (folder / f"{new}.py").write_text(text)
    for library, (line, names) in exported.items():
        bound = _bound_names(ast.parse((INTEGRATIONS / library / "_api.py").read_text()))
        eager = [n for n in names if n in bound]
        body = "\n".join(f"    {n}," for n in eager)
        lazy = ""
        if "__getattr__" in bound and len(eager) < len(names):
            lazy = "from ._api import __getattr__ as __getattr__  # names imported on first use\n"
        (INTEGRATIONS / library / "__init__.py").write_text(
            f'"""{line}"""\n\nfrom ._api import (\n{body}\n)\n{lazy}\n__all__ = [\n'
            + "\n".join(f'    "{n}",' for n in names)
            + "\n]\n"
        )
        subprocess.run(
            ["git", "add", str(INTEGRATIONS / library / "__init__.py")], cwd=ROOT, check=True
        )
    # Every other reference: dotted module paths and file paths.
    dotted = {
        f"{PACKAGE}.{old}": f"{PACKAGE}.{lib}" + ("" if new == "_api" else f".{new}")
        for old, (lib, new) in moves.items()
    }
    slashed = {
        f"integrations/{old}.py": f"integrations/{lib}/{new}.py"
        for old, (lib, new) in moves.items()
    }
    # Relative imports from elsewhere in the package (``from .integrations._ray_cli``).
    dotted.update(
        {
            f"integrations.{old}": f"integrations.{lib}" + ("" if new == "_api" else f".{new}")
            for old, (lib, new) in moves.items()
        }
    )
    # Backticked module names in docstrings and pages (````_gym_spaces````).
    dotted.update(
        {
            f"``{old}``": f"``{lib}.{new}``"
            for old, (lib, new) in moves.items()
            if old.startswith("_")
        }
    )
    pattern = re.compile(
        "|".join(
            (r"(?<![A-Za-z0-9_])" if k[0].isalpha() else "") + re.escape(k) + r"(?![A-Za-z0-9_])"
            for k in sorted(dotted, key=len, reverse=True)
        )
    )
    slash_pattern = re.compile(
        "|".join(re.escape(k) for k in sorted(slashed, key=len, reverse=True))
    )
    private_from_public = re.compile(
        r"from (dm_env_rpc_client\.integrations\.(" + "|".join(exported) + r")) import ([^\n(]+)$",
        re.MULTILINE,
    )

    def private_import(match: re.Match[str]) -> str:
        module, library, names = match.group(1), match.group(2), match.group(3)
        wanted = [n.strip() for n in names.split("#")[0].split(",") if n.strip()]
        submodules = {new for lib, new in moves.values() if lib == library}
        if all(n.split(" as ")[0] in {*exported[library][1], *submodules} for n in wanted):
            return match.group(0)
        return f"from {module}._api import {names}"

    # Modules left in integrations/ (and its other subpackages) that import a moved one.
    for path in sorted(INTEGRATIONS.rglob("*.py")):
        rel = path.relative_to(INTEGRATIONS)
        if len(rel.parts) == 2 and rel.parts[0] in exported:
            continue  # moved just now, already rewritten
        up = "." * len(rel.parts)  # integrations/x.py: "."; integrations/pkg/x.py: ".."
        text = path.read_text()
        for old, (lib, new) in moves.items():
            target = f"{up}{lib}" + ("" if new == "_api" else f".{new}")
            text = re.sub(
                rf"(?m)^([ \t]*from ){re.escape(up + old)}(?![A-Za-z0-9_])", rf"\g<1>{target}", text
            )
        path.write_text(text)
    from_package = re.compile(
        r"(?m)^([ \t]*)from (dm_env_rpc_client\.|\.+)integrations import ([^\n(#]+)$"
    )

    def package_import(match: re.Match[str]) -> str:
        indent, names = match.group(1), [n.strip() for n in match.group(3).split(",")]
        base = match.group(2) + "integrations"
        kept, lines = [], []
        for item in names:
            name, _, alias = item.partition(" as ")
            if name not in moves:
                kept.append(item)
                continue
            lib, new = moves[name]
            if new == "_api":
                kept.append(item)  # the public module is now the folder of the same name
            else:
                lines.append(f"{indent}from {base}.{lib} import {new} as {alias or name}")
        if kept:
            lines.insert(0, f"{indent}from {base} import {', '.join(kept)}")
        return "\n".join(lines)

    changed = 0
    for path in _text_files():
        text = path.read_text()
        text = from_package.sub(package_import, text)
        new_text = pattern.sub(lambda m: dotted[m.group(0)], text)
        new_text = slash_pattern.sub(lambda m: slashed[m.group(0)], new_text)
        new_text = private_from_public.sub(private_import, new_text)
        if new_text != path.read_text():
            path.write_text(new_text)
            changed += 1
    print(f"moved {len(moves)} modules into {len(exported)} folders; rewrote {changed} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
