"""Real models from the command line without a network: `recap models`, downloads and their one-sentence errors,
--offline, --quiet, and stderr that is the same whether or not it is a terminal."""

from __future__ import annotations

import orjson
from typer.testing import CliRunner

from recap_cli import cli

from .hub import fake_hub, hub_cache, http_error, put_in_cache  # noqa: F401 - fixtures


def invoke(args, input: bytes | None = None):
    result = CliRunner().invoke(cli.app, [str(a) for a in args], input=input)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_models_says_which_are_on_disk(hub_cache, model_dirs):
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    put_in_cache(hub_cache, "HuggingFaceTB/SmolLM2-135M-Instruct", model_dirs["text"])
    # An interrupted download: the tree listing names a weights file that never arrived.
    partial = put_in_cache(hub_cache, "Qwen/Qwen2.5-VL-3B-Instruct", model_dirs["text"], commit="1" * 40)
    files = {f.name: TreeCacheEntry(size=f.stat().st_size, blob_id="0" * 40) for f in partial.iterdir()}
    files["model-00002-of-00002.safetensors"] = TreeCacheEntry(size=10**9, blob_id="1" * 40)
    write_tree_cache(str(partial.parent.parent), "1" * 40, files)

    result = invoke(["models"])
    assert result.exit_code == 0
    rows = {line.split("\t")[0]: line.split("\t") for line in result.stdout.splitlines()}
    assert all(len(row) == 6 for row in rows.values())  # name, family, size, source, state, size on disk
    assert rows["demo"][4] == "on disk" and rows["demo"][5].endswith(" MB")
    assert rows["smollm2-135m"][3:5] == ["HuggingFaceTB/SmolLM2-135M-Instruct", "on disk"]
    assert rows["smollm2-135m"][5].endswith(" MB")
    assert rows["qwen2.5-vl-3b"][4] == "partial"
    assert rows["qwen2.5-vl-7b"][1:] == ["qwen2_5_vl", "7B", "Qwen/Qwen2.5-VL-7B-Instruct", "not downloaded", "-"]


def one_error(result, after: str | None = None) -> str:
    """stderr's one 'error:' line, which must be all of it (or follow the one info line ``after``)."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 + (after is not None) and lines[-1].startswith("error: "), result.stderr
    assert after is None or lines[0].startswith(after)
    return lines[-1]


def test_offline_run_names_the_download_command(fake_hub, tmp_path):
    (tmp_path / "r.jsonl").write_bytes(b'{"id": "t", "image": null, "prompt": "hi"}\n')
    for args in (["--offline"], ["--offline", "--quiet"]):
        result = invoke(["run", tmp_path / "r.jsonl", "--model", "qwen2.5-vl-7b", *args])
        assert result.exit_code == 2 and result.stdout == ""
        assert "offline mode is on" in one_error(result)
        assert "`hf download Qwen/Qwen2.5-VL-7B-Instruct`" in result.stderr
    assert fake_hub.calls == []
    result = invoke(["compare", tmp_path / "r.jsonl", "--model", "qwen2.5-vl-7b", "--offline"])
    assert result.exit_code == 2 and "offline mode is on" in one_error(result)


def test_a_missing_repo_is_one_sentence_before_any_work(fake_hub, tmp_path):
    from huggingface_hub.errors import RepositoryNotFoundError

    fake_hub.raises = http_error(RepositoryNotFoundError, 404, "someone/no-such-model")
    (tmp_path / "r.jsonl").write_bytes(b'{"id": "t", "image": null, "prompt": "hi"}\n')
    result = invoke(["run", tmp_path / "r.jsonl", "--model", "someone/no-such-model"])
    assert result.exit_code == 2 and result.stdout == ""
    line = one_error(result, after="downloading someone/no-such-model into the Hugging Face cache")
    assert "there is no model 'someone/no-such-model' on the Hugging Face hub" in line


def test_a_download_is_announced_then_the_run_goes_on(fake_hub, model_dirs, tmp_path):
    fake_hub.serves = model_dirs["text"]
    (tmp_path / "r.jsonl").write_bytes(b'{"id": "t", "image": null, "prompt": "hi"}\n')
    result = invoke(["run", tmp_path / "r.jsonl", "--model", "someone/tiny-llama", "--max-new-tokens", 4])
    assert result.exit_code == 0, result.stderr
    assert "downloading someone/tiny-llama into the Hugging Face cache" in result.stderr
    assert fake_hub.bars_during_download == [False]  # stderr is not a terminal: no download bars in a log
    assert orjson.loads(result.stdout)["new_tokens"] == 4
    again = invoke(["run", tmp_path / "r.jsonl", "--model", "someone/tiny-llama", "--max-new-tokens", 4, "--quiet"])
    assert again.exit_code == 0 and fake_hub.calls == ["someone/tiny-llama"]  # the second run finds the cache
    assert again.stderr == ""


def test_stderr_not_a_terminal_gets_no_bars_and_quiet_gets_nothing(model_dirs, tmp_path):
    (tmp_path / "r.jsonl").write_bytes(b'{"id": "t", "image": null, "prompt": "hi"}\n')
    loud = invoke(["run", tmp_path / "r.jsonl", "--model", model_dirs["text"], "--max-new-tokens", 4])
    assert loud.exit_code == 0
    assert "Loading weights" not in loud.stderr and "\r" not in loud.stderr  # transformers' bar follows recap's
    assert len(loud.stderr.splitlines()) == 1 and loud.stderr.startswith("1 items, 0 errors, 4 tokens in ")
    quiet = invoke(["run", tmp_path / "r.jsonl", "--model", model_dirs["text"], "--max-new-tokens", 4, "-q",
                    "--summary", tmp_path / "s.json"])
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert orjson.loads(quiet.stdout)["answer"] == orjson.loads(loud.stdout)["answer"]
    assert orjson.loads((tmp_path / "s.json").read_bytes())["items"] == 1  # --summary still writes
    bad = invoke(["run", tmp_path / "missing.jsonl", "-q"])
    assert bad.exit_code == 2 and "input file not found" in one_error(bad)  # errors still print


def test_compare_table_is_whole_when_stderr_is_not_a_terminal(model_dirs, tmp_path):
    prompts = [{"id": f"p{i}", "image": None, "prompt": f"Say {i} {i} {i}."} for i in range(2)]
    (tmp_path / "p.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in prompts))
    args = ["compare", tmp_path / "p.jsonl", "--model", model_dirs["text"], "--max-new-tokens", 6, "--warmup", 0,
            "--methods", "recap:mixing=fixed,recap:orders=1,recap:suffix=off,tr", "--report", tmp_path / "rep"]
    result = invoke(args)
    assert result.exit_code == 0, result.stderr
    assert "…" not in result.stderr  # rich cut 80-column logs to "tota…" and "100.…"
    header = next(line for line in result.stderr.splitlines() if "method" in line)
    for column in ("mean×", "total×", "p10", "p50", "p90", "tok/s", "acc/step", "draft%", "match"):
        assert column in header
    row = next(line for line in result.stderr.splitlines() if "recap:suffix=off" in line)
    assert row.rstrip().endswith("100.0% │")  # the whole row on one line, the match rate whole
    assert "report written to" in result.stderr
    quiet = invoke(args + ["--quiet"])
    assert quiet.exit_code == 0 and "report written" not in quiet.stderr
    assert "100.0%" in quiet.stderr  # the result table is what compare is for: --quiet keeps it


def test_report_console_renders_whole_lines_off_a_terminal():
    import io

    from recap_cli import report

    row = {"mean_speedup": 1.234, "total_speedup": 1.1, "p10": 0.8, "p50": 1.0, "p90": 1.9, "tokens_per_s": 12345.6,
           "mean_accepted": 2.2, "draft_share": 0.07, "match_rate": 1.0, "mismatches": [], "speedups": []}
    long = "recap:mixing=fixed,orders=1,suffix=off,budget=128,depth=10"
    summary = {"all": {long: row, "tr": {**row, "mismatches": [f"input-{i}" for i in range(20)]}}}
    out = io.StringIO()
    report.table(summary, "ar", report.console(out))
    lines = out.getvalue().splitlines()
    assert any(long in line and "12345.6" in line and "100.0%" in line for line in lines)
    assert any(line.startswith("tr: tokens differ") and line.endswith("input-4, and 15 more") for line in lines)


def test_ctrl_c_during_a_download_exits_130_without_a_traceback(fake_hub, tmp_path):
    fake_hub.raises = KeyboardInterrupt()
    (tmp_path / "r.jsonl").write_bytes(b'{"id": "t", "image": null, "prompt": "hi"}\n')
    result = invoke(["run", tmp_path / "r.jsonl", "--model", "someone/big-model"])
    assert result.exit_code == 130 and result.stdout == ""
    assert result.stderr.splitlines()[-1].startswith("interrupted before any request was answered")
