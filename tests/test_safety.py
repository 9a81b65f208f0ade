"""No lost data, no tracebacks: paths checked before the model loads, context limits, resume, damaged memory
files, the warm state a memory file brings back, SIGTERM and a closed stdout, EXIF, BOM, --root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from PIL import Image

from recap_cli import cli, models, safety
from recap_cli.records import load_image
from recap_cli.session import Session

from .conftest import make_image
from .test_cli_run import invoke, jsonl, lines

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_inputs"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("safety")
    make_image(1).save(d / "a.png")
    return d


def said(result) -> str:
    """stderr with line wrapping undone (rich wraps at 80 columns when stderr is not a terminal)."""
    return " ".join(result.stderr.split())


def no_model_load(monkeypatch):
    def refuse(*args, **kw):
        raise AssertionError("the model was loaded before the paths were checked")

    monkeypatch.setattr(models, "load", refuse)  # the command line imports it where it loads the model


# --- paths: checked before the model loads ----------------------------------------------------------------------

def test_output_that_is_the_input_is_refused(workdir, monkeypatch):
    no_model_load(monkeypatch)
    src = workdir / "r.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "hi"}))
    (workdir / "link.jsonl").unlink(missing_ok=True)
    (workdir / "link.jsonl").symlink_to(src)
    (workdir / "hard.jsonl").unlink(missing_ok=True)
    os.link(src, workdir / "hard.jsonl")
    for target in (src, workdir / "link.jsonl", workdir / "hard.jsonl", workdir / "sub" / ".." / "r.jsonl"):
        (workdir / "sub").mkdir(exist_ok=True)
        r = invoke(["run", src, "-o", target])
        assert r.exit_code == 2 and "is the input file" in said(r), (target, r.stderr)
        assert src.read_bytes() == jsonl({"id": 1, "prompt": "hi"})
    r = invoke(["run", src, "--summary", workdir / "link.jsonl"])
    assert r.exit_code == 2 and "--summary" in said(r)
    r = invoke(["run", src, "-o", workdir / "x.jsonl", "--memory", workdir / "x.jsonl"])
    assert r.exit_code == 2 and "same file" in said(r)


def test_unwritable_targets_are_refused_before_the_model_loads(workdir, monkeypatch):
    no_model_load(monkeypatch)
    src = workdir / "w.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "hi"}))
    r = invoke(["run", src, "-o", workdir / "missing" / "out.jsonl"])
    assert r.exit_code == 2 and "does not exist" in said(r) and "Traceback" not in said(r)
    r = invoke(["run", src, "-o", src / "out.jsonl"])  # a "folder" that is a file
    assert r.exit_code == 2 and "does not exist" in said(r)
    (workdir / "adir").mkdir(exist_ok=True)
    r = invoke(["run", src, "-o", workdir / "adir"])
    assert r.exit_code == 2 and "is a folder" in said(r)
    r = invoke(["run", src, "--memory", workdir / "adir"])  # used to crash at save time, after the whole run
    assert r.exit_code == 2 and "--memory" in said(r) and "is a folder" in said(r)
    r = invoke(["run", src, "--summary", workdir / "nope" / "s.json"])
    assert r.exit_code == 2 and "--summary" in said(r)


def test_a_dash_names_stdout_for_the_records_only(workdir, monkeypatch):
    """``-o -`` is stdout; a summary or a memory there would be mixed into the records (it used to write a file
    named "-")."""
    no_model_load(monkeypatch)
    monkeypatch.chdir(workdir)
    src = workdir / "d.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "hi"}))
    for flag in ("--summary", "--memory"):
        r = invoke(["run", src, flag, "-"])
        assert r.exit_code == 2 and f"{flag} -: stdout carries the records" in said(r), r.stderr
    r = invoke(["compare", src, "--json", "-"])
    assert r.exit_code == 2 and "--json -: stdout carries the records" in said(r)
    assert not (workdir / "-").exists()


def test_worker_options_without_ray_are_refused(workdir, monkeypatch):
    """--workers 4 without --ray used to run one process and say nothing of the other three."""
    no_model_load(monkeypatch)
    src = workdir / "k.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "hi"}))
    for extra in (["--workers", 2], ["--gpus-per-worker", 1], ["--cpus-per-worker", 2]):
        r = invoke(["run", src, *extra])
        assert r.exit_code == 2 and "size a --ray run" in said(r), (extra, r.stderr)


def test_compare_checks_its_files_before_the_model_loads(workdir, monkeypatch):
    """A typo in --json used to end a whole comparison in a traceback, its results unwritten."""
    no_model_load(monkeypatch)
    src = workdir / "c.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "hi"}))
    r = invoke(["compare", src, "--json", workdir / "missing" / "out.json"])
    assert r.exit_code == 2 and "--json" in said(r) and "does not exist" in said(r) and "Traceback" not in said(r)
    r = invoke(["compare", workdir / "a.png", src, "--json", src])
    assert r.exit_code == 2 and "is the input file" in said(r)
    r = invoke(["compare", src, "--report", src])
    assert r.exit_code == 2 and "--report" in said(r) and "name a folder" in said(r)


def test_read_only_places_are_named(tmp_path, monkeypatch):
    """What the skipped test below checks for real, where root's writes would pass anyway."""
    from recap_cli import safety

    (tmp_path / "there.pt").write_bytes(b"")
    monkeypatch.setattr(safety.os, "access", lambda path, mode: False)
    assert "folder" in safety.unwritable(tmp_path / "new.jsonl", "-o") and "read-only" in \
        safety.unwritable(tmp_path / "new.jsonl", "-o")
    assert safety.unwritable(tmp_path / "there.pt", "--memory", atomic=True).endswith("is read-only")
    monkeypatch.setattr(safety.os, "access", lambda path, mode: Path(path) != tmp_path)
    assert safety.unwritable(tmp_path / "there.pt", "-o") is None
    assert "folder" in safety.unwritable(tmp_path / "there.pt", "--memory", atomic=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(workdir, monkeypatch):
    no_model_load(monkeypatch)
    ro = workdir / "ro"
    ro.mkdir(exist_ok=True)
    ro.chmod(0o555)
    try:
        r = invoke(["run", workdir / "w.jsonl", "-o", ro / "out.jsonl"])
        assert r.exit_code == 2 and "read-only" in said(r)
    finally:
        ro.chmod(0o755)


# --- token limits ---------------------------------------------------------------------------------------------

def test_a_record_cannot_exceed_the_run_ceiling_unless_allowed(model_dirs, workdir):
    src = workdir / "ceiling.jsonl"
    src.write_bytes(jsonl({"id": "big", "prompt": "Go on and on.", "max_new_tokens": 40},
                          {"id": "small", "prompt": "Go on and on.", "max_new_tokens": 2}))
    r = invoke(["run", src, "--model", model_dirs["text"], "--max-new-tokens", 5])
    out = lines(r.stdout)
    assert r.exit_code == 0 and out[0]["new_tokens"] <= 5 and out[1]["new_tokens"] <= 2
    assert "line 1 asks for more than --max-new-tokens 5" in said(r)
    longer = lines(invoke(["run", src, "--model", model_dirs["text"], "--max-new-tokens", 5,
                           "--allow-longer"]).stdout)
    assert longer[0]["new_tokens"] > 5


def test_context_length_caps_every_request_and_refuses_a_prompt_that_cannot_fit(short_model, workdir):
    """64 positions: a huge limit ends at prompt + new tokens = 64 instead of decoding forever, and a prompt of
    more than 64 tokens is an error record instead of an answer decoded past the model's positions."""
    src = workdir / "context.jsonl"
    src.write_bytes(jsonl({"id": "endless", "prompt": "Say something.", "max_new_tokens": 10**9},
                          {"id": "long", "prompt": "word " * 10_000},
                          {"id": "after", "prompt": "Still there?", "max_new_tokens": 3}))
    r = invoke(["run", src, "--model", short_model, "--allow-longer", "--method", "recap", "--budget", 4])
    endless, long, after = lines(r.stdout)
    assert r.exit_code == 1
    assert endless["error"] is None and 20 < endless["new_tokens"] < 64
    assert "the model reads at most 64" in long["error"] and long["answer"] is None
    assert after["error"] is None and after["new_tokens"] == 3


def test_the_context_cap_holds_prompt_plus_new_tokens_exactly(get_adapter, monkeypatch):
    adapter = get_adapter("text")
    messages = [{"role": "user", "content": "Count with me."}]
    length = adapter.build(messages, []).length
    monkeypatch.setattr(adapter.model.config, "max_position_embeddings", length + 7)
    monkeypatch.setattr(adapter, "eos_token_ids", set())  # never stops early
    for method in ("ar", "recap"):
        gen = Session(adapter, method).answer(messages, [], 100)
        assert len(gen.tokens) == 7, method
    monkeypatch.setattr(adapter.model.config, "max_position_embeddings", length)
    with pytest.raises(ValueError, match="reads at most"):
        Session(adapter, "ar").answer(messages, [], 5)


# --- what a record reports -------------------------------------------------------------------------------------

def test_accepted_hist_counts_only_emitted_tokens(get_adapter):
    """Deep, always-right trees against a small token limit: the limit cuts the accepted path, and the cut part
    was never emitted. Drafted tokens in the histogram + bonus tokens = new tokens, exactly."""
    from recap_cli.decoding.engine import Engine, generate

    from .conftest import OracleDrafter, request

    adapter = get_adapter("text")
    messages, images = request("text", "Describe the picture in one sentence, please.")
    prompt = adapter.build(messages, images)
    reference = generate(Engine(adapter), prompt, Session(adapter, "ar").drafter, 40).tokens
    for limit in (2, 3, 5, 9):
        gen = generate(Engine(adapter), prompt, OracleDrafter(reference, 1.0, 12, 0, adapter.vocab_size), limit)
        assert gen.tokens == reference[:limit]
        drafted = sum(k * v for k, v in gen.accepted_hist.items())
        assert drafted + gen.by_source["BONUS"] == len(gen.tokens) == limit, (limit, gen.accepted_hist)
        assert gen.mean_accepted == (limit - 1) / gen.steps


# --- resume ---------------------------------------------------------------------------------------------------

def test_resume_matches_line_and_id_so_repeated_and_implicit_ids_are_not_skipped(model_dirs, workdir):
    src, out = workdir / "dups.jsonl", workdir / "dups.out.jsonl"
    recs = [{"id": "a", "prompt": "First?"}, {"prompt": "No id: my id is my line number, 2."},
            {"id": "a", "prompt": "The same id again?"}, {"id": 2, "prompt": "An explicit id 2."}]
    src.write_bytes(jsonl(*recs[:2]))
    args = ["--model", model_dirs["text"], "-o", out, "--max-new-tokens", 3]
    assert invoke(["run", src, *args]).exit_code == 0
    src.write_bytes(jsonl(*recs))
    r = invoke(["run", src, *args, "--resume"])
    assert r.exit_code == 0
    assert [(x["line"], x["id"]) for x in lines(out.read_text())] == [(1, "a"), (2, 2), (3, "a"), (4, 2)]
    # Nothing left to answer: a second resume appends nothing.
    assert invoke(["run", src, *args, "--resume"]).exit_code == 0
    assert len(lines(out.read_text())) == 4


def test_resume_answers_again_a_line_whose_id_changed(model_dirs, workdir):
    src, out = workdir / "edit.jsonl", workdir / "edit.out.jsonl"
    src.write_bytes(jsonl({"id": "x", "prompt": "One?"}))
    args = ["--model", model_dirs["text"], "-o", out, "--max-new-tokens", 3]
    invoke(["run", src, *args])
    src.write_bytes(jsonl({"id": "y", "prompt": "Another?"}))
    invoke(["run", src, *args, "--resume"])
    assert [x["id"] for x in lines(out.read_text())] == ["x", "y"]


# --- damaged memory files -------------------------------------------------------------------------------------

def saved_memory(get_adapter, path: Path, method: str = "recap") -> dict:
    session = Session(get_adapter("text"), method)
    session.answer([{"role": "user", "content": "Fill the memory a little."}], [], 6)
    assert session.save_memory(path)
    return torch.load(path, weights_only=True)


def damaged_memories(get_adapter, d: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error must say)."""
    good = saved_memory(get_adapter, d / "good.pt")
    cases = {}

    def write(name, obj=None, raw=None):
        path = d / f"{name}.pt"
        path.write_bytes(raw) if raw is not None else torch.save(obj, path)
        return path

    def changed(fn):
        state = {**good, "state": {**good["state"], "order1": dict(good["state"]["order1"]),
                                   "row_chances": dict(good["state"]["row_chances"])}}
        fn(state)
        return state

    ids = good["state"]["order1"]["ids"]
    cases["empty"] = write("empty", raw=b""), "not a recap memory file"
    cases["random"] = write("random", raw=os.urandom(4096)), "not a recap memory file"
    cases["a list"] = write("list", [1, 2, 3]), "not a recap memory file"
    cases["version 1"] = write("v1", {"method": "recap", "model": good["model"], "ids": ids,
                                      "probs": good["state"]["order1"]["probs"]}), "older recap"
    cases["version 9"] = write("v9", {**good, "version": 9}), "version 9"
    cases["method"] = write("method", {**good, "method": "tr"}), "--method tr"
    cases["model"] = write("model", {**good, "model": "llama/999"}), "llama/999"
    cases["keys"] = write("keys", changed(lambda s: s["state"].pop("order1"))), "damaged"
    cases["table keys"] = write("tkeys", changed(lambda s: s["state"]["order1"].pop("probs"))), "damaged"
    cases["shape"] = write("shape", changed(lambda s: s["state"]["order1"].update(ids=ids[:, :3]))), "shapes"
    cases["rows"] = write("rows", changed(lambda s: s["state"]["order1"].update(
        ids=ids[:10], probs=s["state"]["order1"]["probs"][:10]))), "vocabulary of 10"
    cases["dtype"] = write("dtype", changed(lambda s: s["state"]["order1"].update(ids=ids.float()))), "ids of"
    cases["range"] = write("range", changed(lambda s: s["state"]["order1"].update(
        ids=torch.where(ids >= 0, ids + 10_000, ids)))), "outside the vocabulary"
    cases["gap"] = write("gap", changed(lambda s: s["state"]["order1"].update(
        ids=torch.cat([torch.full_like(ids[:, :1], -1), torch.zeros_like(ids[:, 1:])], 1)))), "gap"
    cases["chances"] = write("cal", changed(lambda s: s["state"]["row_chances"].update(
        hits=torch.ones(2, 2, dtype=torch.float64)))), "learned chances"
    cases["counts"] = write("counts", changed(lambda s: s["state"]["row_chances"].update(
        hits=s["state"]["row_chances"]["tries"] + 1))), "hits <= tries"
    return cases


def test_a_damaged_memory_file_is_one_sentence_and_exit_2(get_adapter, model_dirs, workdir, tmp_path):
    src = workdir / "m.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))
    for name, (path, says) in damaged_memories(get_adapter, tmp_path).items():
        before = path.read_bytes()
        r = invoke(["run", src, "--model", model_dirs["text"], "--memory", path, "--max-new-tokens", 3])
        assert r.exit_code == 2, (name, r.stderr, r.stdout)
        assert "cannot load memory" in said(r) and says in said(r), (name, r.stderr)
        assert "Traceback" not in said(r) and r.stdout == "" and path.read_bytes() == before, name


def test_cold_on_error_warns_and_overwrites_the_damaged_file(model_dirs, workdir, tmp_path):
    src, mem = workdir / "cold.jsonl", tmp_path / "mem.pt"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))
    mem.write_bytes(os.urandom(100))
    r = invoke(["run", src, "--model", model_dirs["text"], "--memory", mem, "--max-new-tokens", 3,
                "--memory-cold-on-error"])
    assert r.exit_code == 0 and "starting cold" in said(r) and "memory saved" in said(r)
    assert invoke(["run", src, "--model", model_dirs["text"], "--memory", mem, "--max-new-tokens", 3]).exit_code == 0


def test_a_killed_save_leaves_no_temp_file_behind(get_adapter, tmp_path):
    mem = tmp_path / "mem.pt"
    for stale in (".mem.pt.tmp", ".mem.pt.k3j_9xq2"):  # ours, and what tempfile.mkstemp left before
        (tmp_path / stale).write_bytes(b"half a save")
    (tmp_path / ".mem.pt.notes").write_bytes(b"not ours")
    saved_memory(get_adapter, mem)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mem.pt.notes", "mem.pt"]


# --- the warm state a memory file brings back ------------------------------------------------------------------

def test_a_memory_run_continues_exactly_where_the_last_one_stopped(tmp_path):
    """Run A saves, run B loads: B's records equal the second half of one run over A + B, step for step (the
    calibration included: without it RECAP's trees, and so its steps, differ). A fixed budget keeps trees
    independent of timing."""
    reqs = [orjson.loads(x) for x in (SAMPLES / "requests.jsonl").read_bytes().splitlines()[:6]]
    for r in reqs:
        r["image"] = str(SAMPLES / r["image"])
    a, b, both = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ab.jsonl"
    a.write_bytes(jsonl(*reqs[:3]))
    b.write_bytes(jsonl(*reqs[3:]))
    both.write_bytes(jsonl(*reqs))
    mem = tmp_path / "mem.pt"
    args = ["--max-new-tokens", 32, "--budget", 16, "--batch", 1]  # one at a time: the same order of memory writes
    keys = ("id", "answer", "answers", "new_tokens", "steps", "accepted_hist", "tokens_by_source", "error")
    one = lines(invoke(["run", both, *args]).stdout)[3:]
    assert invoke(["run", a, *args, "--memory", mem]).exit_code == 0
    two = lines(invoke(["run", b, *args, "--memory", mem]).stdout)
    assert [{k: r.get(k) for k in keys} for r in two] == [{k: r.get(k) for k in keys} for r in one]
    assert all(r["error"] is None for r in two)


@pytest.mark.parametrize("method", ["recap", "tr", "pld"])
def test_the_drafter_state_survives_a_save_and_load(get_adapter, method, tmp_path):
    adapter = get_adapter("text")
    session = Session(adapter, method)
    session.answer([{"role": "user", "content": "Fill the memory a little."}], [], 12)
    session.save_memory(tmp_path / "m.pt")
    fresh = Session(adapter, method)
    fresh.load_memory(tmp_path / "m.pt")
    saved, loaded = session.drafter.state(), fresh.drafter.state()
    flat = lambda s: {(k, j): v for k, d in s.items() if d is not None for j, v in d.items()}  # noqa: E731
    # recap: order-1 ids/probs, the stream's and the rows' learned chances and the placed calibration's hits/tries,
    # the stream memory's tokens, lengths, segments and last prompt, the openings' trust (expected, emitted); tr:
    # its table; pld: its chain chances
    assert flat(saved).keys() == flat(loaded).keys() and len(flat(saved)) == {"recap": 14, "tr": 2, "pld": 2}[method]
    assert all(torch.equal(flat(saved)[k], flat(loaded)[k]) for k in flat(saved))
    if method != "pld":
        assert (session.drafter.order1 if method == "recap" else session.drafter.table).filled() > 5
    if method == "recap":  # the stream memory comes back as the same tree: every count, every continuation
        mine, theirs = session.drafter.stream.tree, fresh.drafter.stream.tree
        assert len(mine) > 20 and list(mine.seqs.values()) == list(theirs.seqs.values())
        text = next(iter(mine.seqs.values()))
        for i in range(len(text) - 4):
            a, b = mine.match(text[i:i + 4]), theirs.match(text[i:i + 4])
            assert mine.occurrences(a) == theirs.occurrences(b) and mine.children(a) == theirs.children(b)


# --- SIGTERM and a closed stdout, in a real process -------------------------------------------------------------

def many_requests(path: Path, n: int = 400) -> Path:
    image = str(SAMPLES / "images" / "shapes-01.png")
    path.write_bytes(jsonl(*[{"id": i, "image": image, "question": "What is in this picture?"} for i in range(n)]))
    return path


def start(args: list) -> subprocess.Popen:
    """recap run from this worktree (its recap_cli/ first on the path), in a real process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", "from recap_cli.cli import app; app()", *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigterm_stops_like_ctrl_c_with_memory_and_summary(tmp_path):
    mem, summary = tmp_path / "mem.pt", tmp_path / "summary.json"
    proc = start(["run", many_requests(tmp_path / "in.jsonl"), "--memory", mem, "--summary", summary,
                  "--max-new-tokens", 8])
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    # Read on through the same buffered reader: communicate() would read the pipe underneath it and lose the lines
    # readline() had already buffered (a batch writes several records at once).
    rest, stderr = proc.stdout.read(), proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 143, stderr
    out = [orjson.loads(x) for x in (first + rest).splitlines()]
    assert 1 <= len(out) < 400 and [r["id"] for r in out] == list(range(len(out)))
    assert "(terminated)" in stderr and "memory saved" in stderr and "Traceback" not in stderr
    assert mem.is_file() and orjson.loads(summary.read_bytes())["interrupted"] is True


def test_a_closed_stdout_stops_quietly_with_141_and_saves_memory(tmp_path):
    mem = tmp_path / "mem.pt"
    proc = start(["run", many_requests(tmp_path / "in.jsonl"), "--memory", mem, "--max-new-tokens", 8])
    orjson.loads(proc.stdout.readline())
    proc.stdout.close()  # `| head -n 1`
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr
    assert "(stdout closed)" in stderr and "memory saved" in stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert mem.is_file()


# --- images, BOM, --root ----------------------------------------------------------------------------------------

def test_exif_orientation_is_applied(tmp_path):
    img = make_image(3, (80, 60))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": a phone held upright stores the pixels sideways
    img.save(tmp_path / "phone.jpg", exif=exif)
    upright = load_image(tmp_path / "phone.jpg")
    assert upright.size == (60, 80) and upright.mode == "RGB"
    assert load_image(tmp_path / "phone.jpg").tobytes() == upright.tobytes()


def test_a_utf8_bom_does_not_break_line_1(model_dirs, workdir, monkeypatch):
    data = b"\xef\xbb\xbf" + jsonl({"id": "first", "prompt": "Hello?"}, {"id": "second", "prompt": "Hi?"})
    src = workdir / "bom.jsonl"
    src.write_bytes(data)
    for args, stdin in ((["run", src], None), (["run", "-"], data)):
        r = invoke([*args, "--model", model_dirs["text"], "--max-new-tokens", 2], stdin)
        out = lines(r.stdout)
        assert r.exit_code == 0 and [x["id"] for x in out] == ["first", "second"], r.stdout


def test_stdin_image_paths_resolve_against_root(model_dirs, workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not where the image is
    data = jsonl({"id": "img", "image": "a.png", "question": "What colour?"})
    r = invoke(["run", "-", "--model", model_dirs["qwen"], "--max-new-tokens", 3], data)
    err = lines(r.stdout)[0]["error"]
    assert r.exit_code == 1 and "image not found" in err and str(tmp_path) in err and "--root" in err
    r = invoke(["run", "-", "--model", model_dirs["qwen"], "--max-new-tokens", 3, "--root", workdir], data)
    assert r.exit_code == 0 and lines(r.stdout)[0]["error"] is None
    r = invoke(["run", "-", "--model", model_dirs["qwen"], "--root", tmp_path / "nope"], data)
    assert r.exit_code == 2 and "--root" in said(r)


def test_the_readme_stdin_pipeline_works_as_written(monkeypatch):
    """`head -n 3 sample_inputs/requests.jsonl | recap run - --root sample_inputs`, from the repo root."""
    readme = (ROOT / "README.md").read_text()
    assert "head -n 3 sample_inputs/requests.jsonl | recap run - --root sample_inputs" in readme
    monkeypatch.chdir(ROOT)
    head = b"".join((SAMPLES / "requests.jsonl").read_bytes().splitlines(keepends=True)[:3])
    r = invoke(["run", "-", "--root", "sample_inputs", "--max-new-tokens", 16], head)
    out = lines(r.stdout)
    assert r.exit_code == 0 and len(out) == 3 and all(x["error"] is None for x in out), r.stdout


def test_a_stop_signal_waits_for_the_line_being_written():
    """SIGTERM (or Ctrl-C) arriving while a record is written and counted is raised once that is done, so the
    output never holds half a line."""
    done = []
    with pytest.raises(safety.Terminated), safety.terminate_as_interrupt():
        with safety.whole_lines():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("written")
            done.append("counted")
        done.append("next record")
    assert done == ["written", "counted"]
