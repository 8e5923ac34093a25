"""Make the template your own project: rename the package everywhere.

    python scripts/rename.py my_project             # or: make rename NAME=my_project
    python scripts/rename.py my_project --dry-run   # only say what would change

Renames the package directory (``src/<package>`` -> ``src/my_project``) and replaces the import name (the
template's ``lit`` + ``_template``) and the distribution name (pyproject's ``name``; the new one is ``my-project``)
in every text file of the project: pyproject's ``name`` and isort config, imports, every ``_target_`` in ``conf/``,
the README title, the tests, scripts and docs. The files are the ones git knows (tracked, plus untracked files that
are not ignored); outside a git repository, every file except virtual environments, run outputs and caches. Then it
says what it changed.

The current name is read from the project (pyproject's ``name`` and the package under ``src/``), so running it again
with the same name does nothing, and a renamed project can be renamed again.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import keyword
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
# never walked (outside git): environments, caches and build metadata anywhere; run outputs at the top only
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", "node_modules"}
SKIP_TOP_DIRS = {"env", "logs", "outputs", "multirun", "data", "build", "dist"}
# what the template depends on, by import name: refused even when not installed in the running interpreter
DEPENDENCIES = {
    "torch",
    "torchvision",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning_utilities",
    "torchmetrics",
    "hydra",
    "hydra_plugins",
    "omegaconf",
    "optuna",
    "submitit",
    "joblib",
    "rich",
    "sklearn",
    "matplotlib",
    "psutil",
    "numpy",
    "scipy",
    "pytest",
    "tensorboard",
    "setuptools",
}
LINE_LENGTH = 120


class RenameError(Exception):
    """Something the user can fix: printed as one line, exit code 2."""


def dist_name(import_name: str) -> str:
    return import_name.replace("_", "-")


def normalize(name: str) -> str:
    """PEP 503 normalisation, with underscores: ``My-Project`` and ``my.project`` are ``my_project``."""
    return re.sub(r"[-_.]+", "_", name).lower()


def project_name(root: Path) -> str:
    """``[project] name`` of pyproject.toml, as written there."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        raise RenameError(f"{pyproject} does not exist: run this from the template's checkout (scripts/rename.py)")
    match = re.search(r'(?ms)^\[project\]\s*$.*?^name\s*=\s*["\']([^"\']+)["\']', pyproject.read_text())
    if not match:
        raise RenameError(f"{pyproject} has no [project] name = ...: cannot tell the current distribution name")
    return match.group(1)


def current_names(root: Path) -> tuple[str, str]:
    """(import name, distribution name as pyproject writes it) of the project now."""
    dist = project_name(root)
    packages = sorted(p.name for p in (root / "src").glob("*/__init__.py") for p in [p.parent])
    if normalize(dist) in packages:
        return normalize(dist), dist
    if len(packages) == 1:
        return packages[0], dist
    raise RenameError(
        f"cannot tell which package under src/ is {dist!r} (found {packages or 'none'}): "
        f"expected src/{normalize(dist)}/"
    )


def check_name(new: str, root: Path) -> None:
    """A name a package can have and that shadows nothing."""
    example = normalize(new) if NAME_RE.match(normalize(new)) and not keyword.iskeyword(normalize(new)) else ""
    example = example or "my_project"
    if not new.isidentifier() or keyword.iskeyword(new) or keyword.issoftkeyword(new):
        raise RenameError(
            f"NAME={new!r} is not a valid Python package name: use a Python identifier that is not a keyword, "
            f"e.g. {example}"
        )
    if not NAME_RE.match(new):
        raise RenameError(
            f"NAME={new!r}: use lowercase letters, digits and underscores, starting with a letter (PEP 8 package "
            f"names), e.g. {example}"
        )
    if new in sys.stdlib_module_names or new in sys.builtin_module_names:
        raise RenameError(f"NAME={new!r} is a module of Python's standard library: `import {new}` would be ambiguous")
    if new in DEPENDENCIES or new in importlib.metadata.packages_distributions():
        raise RenameError(f"NAME={new!r} is the name of an installed package: choose a name nothing else uses")
    # modules next to the entry points and the tests (python train.py puts the repo root first on sys.path)
    own = {p.stem for d in (root, root / "tests", root / "scripts") for p in d.glob("*.py")}
    own |= {p.name for p in root.iterdir() if p.is_dir()}
    if new in own:
        raise RenameError(f"NAME={new!r} is already a module or folder of this project: choose another name")
    try:
        spec = importlib.util.find_spec(new)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and not str(spec.origin or "").startswith(str(root)):
        where = spec.origin or "a namespace package"
        raise RenameError(f"NAME={new!r} can already be imported ({where}): choose another name")


def project_files(root: Path) -> list[Path]:
    """Relative paths of the project's files: git's tracked and untracked-but-not-ignored ones in a git checkout,
    else a walk that leaves out environments, outputs and caches."""
    if (root / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=root,
                capture_output=True,
                check=True,
            ).stdout
            names = sorted({n for n in out.decode().split("\0") if n})
            return [Path(n) for n in names if (root / n).is_file() and not (root / n).is_symlink()]
        except (OSError, subprocess.CalledProcessError):
            pass  # no git on PATH, or not a work tree after all: walk
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        top = Path(dirpath) == root
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIP_DIRS and not (top and d in SKIP_TOP_DIRS) and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if not path.is_symlink() and not name.endswith((".pyc", ".ckpt")):
                files.append(path.relative_to(root))
    return files


@dataclass
class Plan:
    old: str
    old_dist: str
    new: str
    new_dist: str
    edits: dict[Path, tuple[str, int]] = field(default_factory=dict)  # relative path -> (new text, replacements)
    # relative (from, to, is a folder), deepest first
    moves: list[tuple[Path, Path, bool]] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (old, new) strings, replaced in this order
    long_lines: list[str] = field(default_factory=list)


def plan_rename(root: Path, new: str) -> Plan:
    old, old_dist = current_names(root)
    plan = Plan(old, old_dist, new, dist_name(new))
    # the import name; the dashed distribution name; and pyproject's own spelling if it is neither
    # (a pyproject `name = "my_project"` keeps its underscore style: it is renamed with the import name)
    pairs = [(old, new), (dist_name(old), plan.new_dist)]
    if old_dist not in (old, dist_name(old)):
        pairs.insert(0, (old_dist, plan.new_dist))
    plan.pairs = pairs
    for rel in project_files(root):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: no names in it
        if "\0" in text:
            continue
        count, new_text = 0, text
        for a, b in pairs:
            count += new_text.count(a)
            new_text = new_text.replace(a, b)
        if count:
            plan.edits[rel] = (new_text, count)
            if rel.suffix == ".py":  # what ruff checks (line-length 120): a longer name can push a line over
                lines = zip(text.splitlines(), new_text.splitlines(), strict=False)
                plan.long_lines += [
                    f"{rel_after(rel, plan)}:{number}"
                    for number, (was, now) in enumerate(lines, 1)
                    if len(now) > LINE_LENGTH >= len(was)
                ]
    # every file or folder whose name holds the old name (src/<old>/ itself), deepest first so parents move last
    dirs = {parent for rel in project_files(root) for parent in [rel, *rel.parents] if str(parent) != "."}
    for rel in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        if any(a in rel.name for a, _ in pairs):
            name = rel.name
            for a, b in pairs:
                name = name.replace(a, b)
            plan.moves.append((rel, rel.with_name(name), (root / rel).is_dir()))
    return plan


def apply(root: Path, plan: Plan) -> None:
    for rel, (text, _) in plan.edits.items():
        (root / rel).write_text(text, encoding="utf-8")
    for src, dst, _ in plan.moves:
        if (root / src).exists():
            if (root / dst).exists():
                raise RenameError(f"cannot move {src} to {dst}: {dst} exists")
            os.replace(root / src, root / dst)


def rel_after(path: Path, plan: Plan) -> Path:
    """Where ``path`` is after the moves."""
    parts = []
    for part in path.parts:
        for a, b in plan.pairs:
            part = part.replace(a, b)
        parts.append(part)
    return Path(*parts)


def report(plan: Plan, dry_run: bool) -> str:
    would = "would " if dry_run else ""
    head = "dry run: " if dry_run else ""
    lines = [f"{head}{plan.old} -> {plan.new} (distribution {plan.old_dist} -> {plan.new_dist})"]
    lines.append(f"{would}change {len(plan.edits)} files ({sum(n for _, n in plan.edits.values())} replacements):")
    lines += [f"  {rel_after(rel, plan)}  ({n})" for rel, (_, n) in sorted(plan.edits.items())]
    lines.append(f"{would}rename {len(plan.moves)} paths:" if plan.moves else "no file or folder names change")
    lines += [f"  {a}/ -> {b}/" if folder else f"  {a} -> {b}" for a, b, folder in plan.moves]
    if plan.long_lines:
        shown = ", ".join(plan.long_lines[:5]) + (" ..." if len(plan.long_lines) > 5 else "")
        lines.append(f"{len(plan.long_lines)} Python lines are now over {LINE_LENGTH} characters ({shown}): make lint")
    if not dry_run:
        lines += [
            "next:",
            f"  .venv/bin/pip uninstall -y {plan.old_dist} && .venv/bin/pip install -e '.[dev]'"
            f"   # the venv still imports {plan.old} from the old path",
            "  git add -A   # git sees the moved folder as deleted + new files",
            "  make test-fast",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the new package (import) name, e.g. my_project; the distribution is my-project")
    parser.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="the project's folder (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        old, _ = current_names(root)
        if args.name == old:
            print(f"the package is already named {old}: nothing to do")
            return 0
        check_name(args.name, root)
        plan = plan_rename(root, args.name)
        if not args.dry_run:
            apply(root, plan)
    except RenameError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report(plan, args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
