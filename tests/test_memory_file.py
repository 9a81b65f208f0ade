"""A --memory file is checked before the model loads, so a damaged one (or one saved for another model whose
config is on disk) costs no model load, nor a Ray cluster's start; what torch says about unpickling stays out of
the message; a warm start says where its memory came from."""

from __future__ import annotations

import pytest
import torch
import typer

from recap_cli import cli

from .conftest import BUILDERS
from .test_cli_run import invoke, jsonl
from .test_safety import damaged_memories, no_model_load, said, workdir  # noqa: F401 - a fixture


class NotAMemory:
    """Something a pickle can hold but a memory file never does."""


def test_a_damaged_memory_file_stops_the_run_before_the_model_loads(get_adapter, model_dirs, workdir, tmp_path,
                                                                    monkeypatch):
    src = workdir / "early.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))
    cases = damaged_memories(get_adapter, tmp_path)
    no_model_load(monkeypatch)  # loading the model now fails the test: every case must stop before it
    for name in ("empty", "random", "a list", "version 1", "version 9", "method", "model"):
        path, says = cases[name]
        r = invoke(["run", src, "--model", "demo", "--memory", path, "--max-new-tokens", 3])
        assert r.exit_code == 2, (name, r.stderr)
        assert "cannot load memory" in said(r) and says in said(r), (name, r.stderr)
    # the drafter's own payload needs the model: it is checked after the model loads
    monkeypatch.undo()
    path, says = cases["keys"]
    r = invoke(["run", src, "--model", model_dirs["text"], "--memory", path, "--max-new-tokens", 3])
    assert r.exit_code == 2 and says in said(r)


def test_a_memory_of_another_model_stops_a_ray_run_before_ray_starts(get_adapter, model_dirs, workdir, tmp_path,
                                                                       monkeypatch):
    """Only the Ray workers, once started with the model loaded, found a memory saved for another model, and
    --memory-cold-on-error could not save the run. Now the driver reads the model's config as a local run does and
    says so in the same words before Ray starts; with --memory-cold-on-error the workers start cold."""
    from recap_cli.session import Session

    src, mem = workdir / "other.jsonl", tmp_path / "text.pt"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))
    session = Session(get_adapter("text"), "recap")
    session.answer([{"role": "user", "content": "Fill the memory a little."}], [], 4)
    assert session.save_memory(mem)
    started = []

    def ray_run(*args, warm: bool = True, **kw):
        started.append(warm)
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "_run_on_ray", ray_run)
    args = ["run", src, "--model", model_dirs["qwen"], "--memory", mem, "--max-new-tokens", 3]
    local, ray = invoke(args), invoke(args + ["--ray", "local"])
    assert started == [] and ray.exit_code == local.exit_code == 2, ray.stderr
    assert "was saved for model llama/400, not qwen2_5_vl/400" in said(ray) and said(ray) == said(local)
    cold = invoke(args + ["--ray", "local", "--memory-cold-on-error"])
    assert started == [False] and cold.exit_code == 0 and "starting cold" in said(cold), cold.stderr


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_a_models_config_gives_the_fingerprint_its_loaded_session_saves(get_adapter, model_dirs, family):
    """What the check before the model loads compares with a memory file (read from config.json) is what a
    session of the loaded model writes into one."""
    from recap_cli.models import architecture
    from recap_cli.session import Session, fingerprint

    assert fingerprint(*architecture(str(model_dirs[family]))) == Session(get_adapter(family), "ar")._fingerprint()


def test_a_pickle_of_other_objects_is_refused_without_torchs_advice(workdir, tmp_path, monkeypatch):
    src = workdir / "pickle.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))
    path = tmp_path / "objects.pt"
    torch.save({"format": "recap-memory", "state": NotAMemory()}, path)
    no_model_load(monkeypatch)
    r = invoke(["run", src, "--memory", path, "--max-new-tokens", 3])
    assert r.exit_code == 2 and "is not a recap memory file" in said(r), r.stderr
    assert "weights_only" not in said(r) and "trust" not in said(r) and len(r.stderr.splitlines()) == 1


def test_a_warm_start_says_where_its_memory_came_from(get_adapter, model_dirs, workdir, tmp_path):
    src, mem = workdir / "warm.jsonl", tmp_path / "mem.pt"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))
    args = ["run", src, "--model", model_dirs["text"], "--memory", mem, "--max-new-tokens", 3]
    cold = invoke(args)
    assert cold.exit_code == 0 and "loaded" not in said(cold)  # no file yet: a cold start says nothing of it
    warm = invoke(args)
    assert warm.exit_code == 0 and f"memory loaded from {mem}" in said(warm)
    assert invoke(args + ["--quiet"]).stderr == ""
    ar = invoke(["run", src, "--model", model_dirs["text"], "--memory", mem, "--method", "ar", "--max-new-tokens", 3])
    assert ar.exit_code == 0 and "loaded" not in said(ar)  # ar keeps nothing across requests: the file is not used
    assert "--memory is not used: ar keeps no drafter memory" in said(ar)  # and says so, rather than nothing
    before = mem.read_bytes()
    sfx = invoke(["run", src, "--model", model_dirs["text"], "--memory", mem, "--method", "suffix",
                  "--max-new-tokens", 3])
    assert sfx.exit_code == 0 and "--memory is not used: suffix" in said(sfx) and mem.read_bytes() == before
