"""`recap run --ray` on a real local Ray (2 CPUs, 2 workers, the demo model): the records a local run writes."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import torch

from recap_cli.models import load
from recap_cli.session import Session

from .test_cli_run import invoke, lines

ray = pytest.importorskip("ray")  # CI installs the [ray] extra, so there these tests run

from recap_cli import records, scale  # noqa: E402 - needs Ray

BENCH = Path(__file__).resolve().parent.parent / "sample_inputs" / "bench"
# What must equal a local run's record; timings, steps and acceptance depend on each worker's memory.
SAME = ("id", "answer", "answers", "error", "new_tokens", "method", "model", "dataset", "turns")
TOKENS = "12"


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Ten lines of the demo bench sets (single and multi-turn) with a bad line, a missing and a corrupt image."""
    d = tmp_path_factory.mktemp("ray")
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    picked = []
    for name, n in (("demo_vqa", 4), ("demo_caption", 2), ("demo_multiturn", 1)):
        for raw in (BENCH / f"{name}.jsonl").read_bytes().splitlines()[:n]:
            rec = orjson.loads(raw)
            rec["image"] = str(BENCH / rec["image"])
            picked.append(orjson.dumps(rec))
    picked[0] = picked[0][:-1] + b', "Question": "unread"}'  # a key recap ignores: warned of, as in a local run
    picked[2:2] = [b"{not json", b'{"id": "gone", "image": "missing.png"}']
    picked.append(b'{"id": "corrupt", "image": "corrupt.png", "question": "What colour?"}')
    path = d / "requests.jsonl"
    path.write_bytes(b"\n".join(picked) + b"\n\n")  # a blank line yields no record, as in a local run
    return path


@pytest.fixture(scope="module")
def local(inputs):
    """What a plain `recap run` writes for the same inputs."""
    result = invoke(["run", inputs, "--model", "demo", "--max-new-tokens", TOKENS])
    assert result.exit_code == 1, result.stderr
    return lines(result.stdout)


def same(records: list[dict]) -> list[dict]:
    return [{k: r.get(k) for k in SAME} for r in records]


def ray_run(inputs, *extra, stdin: bytes | None = None):
    return invoke(["run", inputs, "--model", "demo", "--max-new-tokens", TOKENS, "--ray", "auto", "--workers", 2,
                   *extra], stdin)


def test_two_workers_write_what_a_local_run_writes_in_order(ray_local, inputs, local, tmp_path):
    assert [r["error"] is not None for r in local].count(True) == 3
    memory, summary = tmp_path / "memory.pt", tmp_path / "summary.json"
    result = ray_run(inputs, "--memory", memory, "--summary", summary)
    assert result.exit_code == 1, result.stderr  # some records failed: the bad lines
    out = lines(result.stdout)
    assert same(out) == same(local)
    warned = " ".join(result.stderr.split())  # rich wraps long lines
    assert warned.count("key 'Question' is not one recap reads: ignored (did you mean 'question'?)") == 1
    assert "image not found" in out[3]["error"] and "cannot read image" in out[-1]["error"]
    s = orjson.loads(summary.read_bytes())
    assert s["items"] == len(local) and s["errors"] == 3 and s["restarts"] == 0
    assert sum(w["items"] for w in s["per_worker"].values()) == len(local)
    assert s["requests_per_hour"] > 0 and s["wall_tokens_per_s"] > 0
    # The merged memory is a memory file like any other: a local session loads it.
    session = Session(load("demo", device="cpu"), "recap")
    session.load_memory(memory)
    assert session.drafter.order1.filled() > 0


def test_resume_from_stdin_answers_only_what_the_output_lacks(ray_local, inputs, local, tmp_path, monkeypatch):
    """As a local run: line 1 ran out of memory (a rerun may fix that) and is answered again, after its error
    record; lines 3 and 4 failed for good (bad JSON, a missing image), are skipped, and said to be."""
    out = tmp_path / "out.jsonl"
    oom = {**{k: local[0][k] for k in ("id", "line", "method", "model")}, "answer": None,
           "error": "OutOfMemoryError: CUDA out of memory", "retry": True}
    head = b"".join(orjson.dumps(r) + b"\n" for r in [oom, *local[1:4]])
    out.write_bytes(head + b'{"id": "torn')  # a crash left half a line
    monkeypatch.chdir(inputs.parent)  # stdin's relative image paths resolve against the working directory
    result = ray_run("-", "-o", out, "--resume", stdin=inputs.read_bytes())
    assert result.exit_code == 1, result.stderr
    assert result.stdout == ""
    assert same(lines(out.read_text())) == same([oom, *local[1:4], local[0], *local[4:]])
    assert f"{len(local) - 3} items" in result.stderr
    said = " ".join(result.stderr.split())
    assert f"{out} holds only error records for 2 lines of the input (3, 4), from earlier runs" in said


def test_a_worker_killed_mid_run_loses_and_duplicates_nothing(ray_local, inputs, local, tmp_path, monkeypatch):
    monkeypatch.setenv(scale.FAULT_ENV, "2")  # one worker exits hard after its second record
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    result = ray_run(inputs, "-o", out, "--summary", summary)
    assert result.exit_code == 1, result.stderr
    assert same(lines(out.read_text())) == same(local)
    assert orjson.loads(summary.read_bytes())["restarts"] == 1


def test_a_cluster_failing_part_way_keeps_the_records_and_says_so(ray_local, inputs, local, tmp_path,
                                                                  monkeypatch):
    """A Ray error that is no worker's setup (a node lost, the cluster gone) ends the run as recap's own failure
    does in a local run: one line, the records written stay whole, the summary is written, exit 1."""
    rows = scale._rows

    def failing(ds):
        for n, row in enumerate(rows(ds)):
            if n == 3:
                raise ray.exceptions.RayError("the cluster went away")
            yield row

    monkeypatch.setattr(scale, "_rows", failing)
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    result = ray_run(inputs, "-o", out, "--summary", summary)
    assert result.exit_code == 1, result.stderr
    said = " ".join(result.stderr.split())
    assert "Ray failed after 3 records: RayError: the cluster went away" in said and "Traceback" not in said
    assert "--resume picks up after them" in said
    assert same(lines(out.read_text())) == same(local[:3])
    assert orjson.loads(summary.read_bytes())["interrupted"] is True


def test_a_model_no_worker_can_load_is_a_usage_error(ray_local, inputs, tmp_path):
    result = invoke(["run", inputs, "--model", tmp_path / "no" / "model", "--ray", "auto"])
    assert result.exit_code == 2
    assert "unknown model" in result.stderr and "Traceback" not in result.stderr


def test_memory_cold_on_error_starts_the_workers_cold_and_replaces_a_damaged_file(ray_local, inputs, local,
                                                                                  tmp_path):
    """The driver said "starting cold" and then seeded every worker from the damaged file, which none could load:
    the run ended as a usage error."""
    memory = tmp_path / "memory.pt"
    memory.write_bytes(b"not a memory file")
    result = ray_run(inputs, "--memory", memory, "--memory-cold-on-error")
    assert result.exit_code == 1, result.stderr  # the bad lines' records, nothing else
    assert same(lines(result.stdout)) == same(local)
    assert torch.load(memory, weights_only=True)["format"] == "recap-memory"


def state(rows: dict[int, tuple[list[int], list[float]]], hits: float = 0.0, vocab: int = 6, k: int = 2) -> dict:
    """A memory file's content: an order-1 table with ``rows`` and learned chances (``hits`` of 10 tries)."""
    ids, probs = torch.full((vocab, k), -1, dtype=torch.int32), torch.zeros(vocab, k)
    for t, (i, p) in rows.items():
        ids[t, : len(i)], probs[t, : len(p)] = torch.tensor(i, dtype=torch.int32), torch.tensor(p)
    counts = {"hits": torch.full((2, 2), hits, dtype=torch.float64), "tries": torch.full((2, 2), 10.0 + hits,
                                                                                           dtype=torch.float64)}
    return {"format": "recap-memory", "version": 4, "method": "recap", "model": "m/6",
            "state": {"order1": {"ids": ids, "probs": probs}, "row_chances": counts, "stream_chances": counts}}


def test_merge_prefers_written_rows_then_the_most_confident():
    seed = state({0: ([1, 2], [0.9, 0.1]), 1: ([2, 3], [0.6, 0.4]), 2: ([3, 4], [0.5, 0.5])}, hits=1)
    a = state({0: ([1, 2], [0.9, 0.1]), 1: ([4, 5], [0.55, 0.45]), 2: ([5, 1], [0.7, 0.3]), 3: ([1, 0], [0.8, 0.2])},
              hits=3)
    b = state({0: ([3, 4], [0.5, 0.5]), 1: ([2, 3], [0.6, 0.4]), 2: ([1, 5], [0.8, 0.2])}, hits=4)
    merged = scale.merge_memories(seed, [a, b])
    rows = {t: merged["state"]["order1"]["ids"][t].tolist() for t in range(6)}
    assert rows[0] == [3, 4]  # b wrote it (less confident than the seed's row, but newer)
    assert rows[1] == [4, 5]  # only a wrote it; b still holds the seed's
    assert rows[2] == [1, 5]  # both wrote it: b's is more confident
    assert rows[3] == [1, 0]  # new in a
    assert rows[4] == rows[5] == [-1, -1]
    # Counts: the seed's 1 hit once, plus what each worker added (2 and 3): every verdict counted once.
    assert merged["state"]["row_chances"]["hits"].eq(1 + 2 + 3).all()
    assert merged["state"]["stream_chances"]["tries"].eq(11 + 2 + 3).all()
    alone = scale.merge_memories(None, [a])["state"]
    assert alone["order1"]["ids"].equal(a["state"]["order1"]["ids"])
    assert alone["row_chances"]["hits"].equal(a["state"]["row_chances"]["hits"])
    with pytest.raises(ValueError, match="cannot be merged"):
        scale.merge_memories(None, [a, {**b, "model": "other/6"}])


def test_a_usage_error_before_the_first_record_leaves_the_output_untouched(inputs, tmp_path, monkeypatch):
    """Checked before Ray starts: a bad fault-injection knob fails like every usage error, after -o was named."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "kept"}\n')
    monkeypatch.setenv(scale.FAULT_ENV, "many")
    result = ray_run(inputs, "-o", out)
    assert result.exit_code == 2 and scale.FAULT_ENV in result.stderr, result.stderr
    assert out.read_bytes() == b'{"id": "kept"}\n'


def test_workers_that_cannot_load_the_model_leave_the_output_untouched(ray_local, inputs, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "kept"}\n')
    result = invoke(["run", inputs, "--model", tmp_path / "no" / "model", "--ray", "auto", "-o", out])
    assert result.exit_code == 2 and "unknown model" in result.stderr, result.stderr
    assert out.read_bytes() == b'{"id": "kept"}\n'


def test_a_records_own_max_new_tokens_is_capped_as_in_a_local_run(ray_local, tmp_path):
    """--max-new-tokens caps a record's own max_new_tokens on the workers too (--allow-longer lifts the cap)."""
    path = tmp_path / "long.jsonl"
    image = str(BENCH / "images" / "demo-01.png")
    path.write_bytes(orjson.dumps({"id": "long", "image": image, "max_new_tokens": 30}) + b"\n")
    for extra in ((), ("--allow-longer",)):
        local_run = invoke(["run", path, "--model", "demo", "--max-new-tokens", "4", *extra])
        result = invoke(["run", path, "--model", "demo", "--max-new-tokens", "4", "--ray", "auto", *extra])
        assert result.exit_code == local_run.exit_code == 0, result.stderr
        assert same(lines(result.stdout)) == same(lines(local_run.stdout))
        assert lines(result.stdout)[0]["new_tokens"] == (4 if not extra else lines(local_run.stdout)[0]["new_tokens"])
        assert ("capped" in " ".join(result.stderr.split())) == (not extra)


def test_workers_parse_a_line_as_a_local_run_caps_it(tmp_path):
    job = scale.Job(model="demo", method="recap", knobs={}, compile="off", device="cpu", dtype="auto", attn="sdpa",
                    max_new_tokens=5, base=tmp_path)
    raw = b'{"id": "x", "prompt": "hi", "max_new_tokens": 50}'
    assert scale.parse_capped(raw, 1, job).max_new_tokens == 5
    assert [records.glance(r) for r in (raw, b"{not json", b'{"max_new_tokens": true, "promt": 1}', b"[1]")] == [
        ([], 50), ([], None), (["promt"], None), ([], None)]  # what the driver reads to warn, never raising
    job.allow_longer = True
    assert scale.parse_capped(raw, 1, job).max_new_tokens == 50


def test_a_worker_names_the_memory_it_was_sent_not_its_scratch_copy(model_dirs, tmp_path):
    """A memory saved for another model fails a worker's set-up in one sentence that says what the memory is
    (--memory's file, or the worker's own last one), not the temporary copy the worker read it from."""
    path = tmp_path / "demo.pt"
    assert Session(load("demo", device="cpu"), "recap").save_memory(path)
    other = Session(load(str(model_dirs["text"]), device="cpu"), "recap")
    with pytest.raises(scale.WorkerSetupError) as caught:
        scale.load_sent(other, path.read_bytes())
    said = str(caught.value)
    assert said.startswith("cannot load memory: the memory sent to this worker (--memory's file, or its own last) "
                           "was saved for model "), said
    assert "recap-memory-" not in said
