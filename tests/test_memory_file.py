"""A --memory file is checked before the model loads, so a damaged one costs no model load; what torch says about
unpickling stays out of the message; a warm start says where its memory came from."""

from __future__ import annotations

import torch

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
    for name in ("empty", "random", "a list", "version 1", "version 9", "method"):
        path, says = cases[name]
        r = invoke(["run", src, "--model", "demo", "--memory", path, "--max-new-tokens", 3])
        assert r.exit_code == 2, (name, r.stderr)
        assert "cannot load memory" in said(r) and says in said(r), (name, r.stderr)
    # the model's fingerprint and the drafter's own payload need the model: those are checked after it loads
    monkeypatch.undo()
    path, says = cases["model"]
    r = invoke(["run", src, "--model", model_dirs["text"], "--memory", path, "--max-new-tokens", 3])
    assert r.exit_code == 2 and says in said(r)


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
