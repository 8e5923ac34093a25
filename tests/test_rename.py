"""scripts/rename.py NAME: the template renamed to your project, checked in a fresh copy of the checkout: no file
names the old package afterwards, and the copy's own tests and train.py run against the copy's package."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, kill_group


def load_script():
    spec = importlib.util.spec_from_file_location("rename_script", ROOT / "scripts" / "rename.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being built
    spec.loader.exec_module(module)
    return module


rename = load_script()
# the names of the checkout under test, read from it (in a renamed copy these are the new ones)
OLD, OLD_DIST = rename.current_names(ROOT)
# a launcher's variables in this environment would make the copy's runs join another job
LAUNCH_VARS = ("LT_RUN_ID", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
NEW = next(n for n in ("my_project", "other_project") if n not in OLD and OLD not in n)


def copy_checkout(dest: Path) -> Path:
    """The checkout's files (git's tracked + untracked, not ignored; no .venv, outputs or caches) copied to dest."""
    for rel in rename.project_files(ROOT):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    return dest


def overlay_venv(root: Path) -> Path:
    """``root/.venv``: a venv without packages of its own that imports the running venv's packages (torch, lightning,
    ...) and ``root/src``, through a ``.pth`` file. The running venv's editable install of the original package is a
    ``.pth`` of its own, which a path added this way does not run: in the copy only the copy's package imports, also
    in the tests that set PYTHONPATH themselves. Returns its python."""
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    shared = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir() and not p.startswith(str(venv))]
    (site / "_renamed_copy.pth").write_text("\n".join([str(root / "src"), *shared]) + "\n")
    return venv / "bin" / "python"


def run_in(root: Path, *cmd: str | Path, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in ``root`` (no PYTHONPATH: the copy's venv finds its package); the process group is killed on a
    timeout."""
    cmd = tuple(map(str, cmd))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "200"}
    for key in ("PYTHONPATH", *LAUNCH_VARS):
        env.pop(key, None)
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def mentions_of_old_name(root: Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        rel = str(path.relative_to(root))
        if OLD in rel or OLD_DIST in rel:
            found.append(f"{rel} (name)")
        elif path.is_file() and (OLD.encode() in (data := path.read_bytes()) or OLD_DIST.encode() in data):
            found.append(rel)
    return found


def renamed_copy(tmp_path: Path) -> tuple[Path, str]:
    copy = copy_checkout(tmp_path / "copy")
    before = digest(copy)
    dry = run_in(copy, sys.executable, "scripts/rename.py", NEW, "--dry-run", timeout=60)
    assert dry.returncode == 0, dry.stdout
    assert f"would rename 1 paths:\n  src/{OLD}/ -> src/{NEW}/" in dry.stdout
    assert digest(copy) == before  # a dry run changes nothing
    done = run_in(copy, sys.executable, "scripts/rename.py", NEW, timeout=60)
    assert done.returncode == 0, done.stdout
    return copy, done.stdout


def test_rename_in_a_copy_then_its_config_tests_and_train_run(tmp_path):
    copy, summary = renamed_copy(tmp_path)
    assert f"{OLD} -> {NEW} (distribution {OLD_DIST} -> {rename.dist_name(NEW)})" in summary
    assert f"rename 1 paths:\n  src/{OLD}/ -> src/{NEW}/" in summary
    for rel in ("pyproject.toml", "README.md", "conf/data/digits.yaml", "train.py", f"src/{NEW}/train.py"):
        assert f"\n  {rel}  (" in summary  # each file it changed, with its number of replacements
    assert mentions_of_old_name(copy) == []
    assert (copy / "src" / NEW / "__init__.py").is_file() and not (copy / "src" / OLD).exists()
    assert f'name = "{rename.dist_name(NEW)}"' in (copy / "pyproject.toml").read_text()
    assert (copy / "README.md").read_text().startswith(f"# {rename.dist_name(NEW)}\n")
    assert f"_target_: {NEW}.data.DigitsDataModule" in (copy / "conf" / "data" / "digits.yaml").read_text()
    # again: nothing to do
    again = run_in(copy, sys.executable, "scripts/rename.py", NEW, timeout=60)
    assert again.returncode == 0 and "nothing to do" in again.stdout

    python = overlay_venv(copy)
    where = run_in(copy, python, "-c", f"import {NEW}; print({NEW}.__file__)", timeout=60)
    assert where.returncode == 0, where.stdout
    assert Path(where.stdout.strip()).resolve().is_relative_to(copy.resolve())  # the copy's package, not the original
    gone = run_in(copy, python, "-c", f"import {OLD}", timeout=60)
    assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stdout  # nothing falls back on the original
    configs = run_in(copy, python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_configs.py", timeout=240)
    assert configs.returncode == 0 and " passed" in configs.stdout, configs.stdout[-4000:]
    train = run_in(copy, python, "train.py", "debug=fdr", f"paths.log_dir={tmp_path / 'logs'}", timeout=180)
    assert train.returncode == 0, train.stdout[-4000:]
    assert f"model <{NEW}.models.LitClassifier>" in train.stdout and "test/acc" in train.stdout


def name_sensitive_tests(root: Path, name: str) -> list[str]:
    """The test modules under ``root/tests`` that use the package's name other than to import it (module paths in
    messages, logger names, ``python -m``), directly or through a helper module of tests/ that does. This module is
    left out: it names the new name it picks, and its fast test is this renaming again."""
    texts = {p: p.read_text() for p in sorted((root / "tests").glob("*.py")) if p.name != Path(__file__).name}

    def names_it(text: str) -> bool:
        lines = text.splitlines()
        return any(name in line and not line.lstrip().startswith(("import ", "from ")) for line in lines)

    helpers = [p.stem for p, text in texts.items() if not p.name.startswith("test_") and names_it(text)]
    return [
        str(p.relative_to(root))
        for p, text in texts.items()
        if p.name.startswith("test_") and (names_it(text) or any(h in text for h in helpers))
    ]


def collected(root: Path, python: str | Path) -> int:
    run = run_in(root, python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", timeout=240)
    assert run.returncode == 0, run.stdout[-4000:]
    return sum(1 for line in run.stdout.splitlines() if "::" in line)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rename_in_a_copy_then_the_whole_suite_collects_and_its_name_sensitive_fast_tests_pass(tmp_path):
    # Every test module imports the renamed package and collects as many tests as here; the fast tests of the modules
    # that use the package's name beyond their imports run in the copy (the rest only import it: the outer suite runs
    # them here).
    copy, _ = renamed_copy(tmp_path)
    assert mentions_of_old_name(copy) == []
    python = overlay_venv(copy)
    assert collected(copy, python) == collected(ROOT, sys.executable) > 250
    sensitive = name_sensitive_tests(copy, NEW)
    assert sensitive == name_sensitive_tests(ROOT, OLD)  # the rename changed no module's selection
    assert {"tests/test_slurm.py", "tests/test_host_sync.py"} <= set(sensitive)
    run = run_in(
        copy,
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not slow",
        "-n",
        "auto",
        *sensitive,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-6000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("torch", "installed package"),
        ("os", "standard library"),
        ("class", "not a valid Python package name"),
        ("1project", "not a valid Python package name"),
        ("my-project", "e.g. my_project"),
        ("MyProject", "lowercase"),
        ("train", "already a module or folder of this project"),
        ("conftest", "already a module or folder of this project"),
    ],
)
def test_bad_names_are_refused_by_name(name, message):
    with pytest.raises(rename.RenameError, match=message):
        rename.check_name(name, ROOT)


def test_bad_name_is_one_line_exit_2(tmp_path):
    run = run_in(ROOT, sys.executable, "scripts/rename.py", "torch", timeout=60)
    assert run.returncode == 2 and run.stdout.startswith("error: NAME='torch'") and "Traceback" not in run.stdout
    assert (ROOT / "src" / OLD).is_dir()


def test_outside_git_the_walk_skips_environments_outputs_and_caches(tmp_path):
    kept = ["src/pkg/data/a.py", "conf/data/b.yaml", "README.md"]
    skipped = [
        ".venv/lib/x.py",
        "logs/run.log",
        "data/raw.txt",
        "src/pkg/__pycache__/a.pyc",
        "src/pkg.egg-info/PKG-INFO",
    ]
    for rel in kept + skipped:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert sorted(str(p) for p in rename.project_files(tmp_path)) == sorted(kept)
