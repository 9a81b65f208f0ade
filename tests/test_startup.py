"""The first seconds of every command: help, `recap models` and usage errors answer without importing torch or
transformers; an early Ctrl-C is one line; no module of recap_cli imports another that (directly or not) imports
it back; `recap models` names its columns."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from recap_cli import cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "recap_cli"
HEAVY = ("torch", "transformers")

# Runs the `recap` entry point in a fresh interpreter and, when it exits however it exits, writes the names of
# every module it imported to $MODULES_OUT.
WITH_MODULES = """
import atexit, json, os, sys
atexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["recap", *sys.argv[1:]]
from recap_cli.__main__ import main
main()
"""


def recap(args: list, tmp_path: Path, code: str = WITH_MODULES, **env) -> subprocess.CompletedProcess:
    """`recap ARGS` from this worktree in a real process (nothing imported yet, as on a user's machine)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODULES_OUT": str(tmp_path / "modules.json"), **env}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["models"], 0), (["run", "--help"], 0),
                                        (["compare", "--help"], 0), (["run", "missing.jsonl"], 2),
                                        (["run", "missing.jsonl", "--quiet"], 2)])
def test_help_models_and_usage_errors_load_neither_torch_nor_transformers(tmp_path, args, code):
    done = recap(args, tmp_path)
    assert done.returncode == code, done.stderr
    modules = set(json.loads((tmp_path / "modules.json").read_text()))
    assert not modules & set(HEAVY), f"`recap {' '.join(args)}` imported {sorted(modules & set(HEAVY))}"
    if args[0] == "run" and code == 2:
        assert done.stderr.strip() == "error: input file not found: missing.jsonl"


@pytest.mark.parametrize("command", [[], ["run"], ["compare"]])
def test_help_at_80_columns_names_every_option_whole(command):
    """Rich's help panels cut long option names at 80 columns ("--memory-cold-on-e…"); click's layout never does,
    and the commands' descriptions are whole too (click cuts the ones it makes itself: "...")."""
    result = CliRunner().invoke(cli.app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert all(len(line) <= 80 for line in text.splitlines())
    cut = re.sub(r"\[ARGS\]\.\.\.|inputs\}?\.\.\.", "", text)  # "..." there says more arguments may follow
    assert "…" not in cut and "..." not in cut, text
    group = typer.main.get_command(cli.app)
    found = group.commands[command[0]] if command else group
    names = [name for param in found.params for name in (*param.opts, *param.secondary_opts) if name.startswith("-")]
    assert len(names) >= (20 if command else 0)  # (the group's own options: --help alone, not among its params)
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} is not whole in {command} --help"


def test_models_names_its_columns_on_stderr_and_keeps_stdout_to_rows():
    result = CliRunner().invoke(cli.app, ["models"])
    assert result.exit_code == 0
    assert result.stderr.splitlines() == ["\t".join(cli.MODEL_COLUMNS)]
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert rows and all(len(row) == len(cli.MODEL_COLUMNS) for row in rows)
    assert rows[0][0] == "demo" and not any(row[0] == "name" for row in rows)


# --- Ctrl-C during start-up -------------------------------------------------------------------------------------

# Sends SIGINT to this process the moment module $INTERRUPT_AT is first imported: Ctrl-C at exactly that point of
# start-up, every time (a timer would land anywhere, or after start-up on a fast machine).
INTERRUPTED = """
import os, signal, sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["INTERRUPT_AT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
# Ctrl-C as a terminal's foreground process gets it: a job started in the background (`cmd &` in a script)
# inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv = ["recap", *sys.argv[1:]]
from recap_cli.__main__ import main
main()
"""


@pytest.mark.parametrize("at", ["recap_cli.cli",  # importing the command line itself
                                "torch",  # loading the model (its first heavy import)
                                "recap_cli.batch"])  # after the model, before the first request
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path, at):
    (tmp_path / "r.jsonl").write_text('{"id": 1, "image": null, "prompt": "Hello?"}\n')
    done = recap(["run", "r.jsonl", "--max-new-tokens", 2], tmp_path, code=INTERRUPTED, INTERRUPT_AT=at)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "interrupted" in done.stderr and done.stdout == ""


def test_a_second_ctrl_c_while_the_process_exits_prints_no_traceback(tmp_path):
    """Ctrl-C pressed twice: the second lands in the interpreter's exit hooks (torch's take a moment)."""
    (tmp_path / "r.jsonl").write_text('{"id": 1, "image": null, "prompt": "Hello?"}\n')
    again = "import atexit\natexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
    code = INTERRUPTED.replace("sys.argv = ", again + "sys.argv = ")
    done = recap(["run", "r.jsonl", "--max-new-tokens", 2], tmp_path, code=code, INTERRUPT_AT="torch")
    assert done.returncode in (130, -signal.SIGINT), done.stderr  # -SIGINT: a shell reports it as 130
    assert "Traceback" not in done.stderr and done.stderr.strip() == "interrupted", done.stderr


# --- no import cycles -------------------------------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The recap_cli modules a module imports anywhere in it (top level, functions, TYPE_CHECKING blocks alike:
    a cycle through a function-level import is still a circle in the design).

    ``from P import x`` is an edge to ``P.x`` when that is a module, else to ``P`` (x is a name in P's
    ``__init__``). Importing ``P.x`` also runs the ``__init__`` of every package above it, so those are edges too,
    except the importer's own packages: Python has already started them before the importer runs, so a package
    whose ``__init__`` imports its own submodules is no cycle."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    own = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 1)} | {package}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in modules and name not in own and name != me:
                    found.add(name)
    return found


def test_no_module_imports_itself_back():
    files = [p for p in PACKAGE.rglob("*.py") if "demo/model" not in p.as_posix()]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports_of(p, modules) for p in files}
    assert "recap_cli.session" in graph["recap_cli.scale"]  # the parser sees relative imports in functions
    assert not any("recap_cli.cli" in deps for name, deps in graph.items() if name != "recap_cli.__main__"), \
        "only the entry point imports the command line"
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [name, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_mkl_runs_in_its_reproducible_mode_on_amd_cpus_unless_the_user_chose_one(tmp_path):
    """recap_cli sets MKL_CBWR before any model runs on an AMD CPU (tree steps of a few tokens cost about a
    one-token step's time in that mode, twice it in MKL's default); a user's own choice stands."""
    import recap_cli

    code = "import os, recap_cli; print(os.environ.get('MKL_CBWR', 'unset'))"
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT), **extra},
                                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run({}).stdout.strip() == ("AUTO" if recap_cli.on_amd_cpu() else "unset")
    assert run({"MKL_CBWR": "COMPATIBLE"}).stdout.strip() == "COMPATIBLE"
    assert run({"MKL_CBWR": ""}).stdout.strip() == ""
