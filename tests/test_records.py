"""Reading a request line: the shapes people write, and what recap says when a line is not what it reads."""

from __future__ import annotations

import errno
from pathlib import Path

import orjson
import pytest
from PIL import Image

from recap_cli.records import TransientError, glance, load_image, parse_line, unknown_key


def parse(rec: dict):
    return parse_line(orjson.dumps(rec), 1, Path("/data"))


def test_a_system_message_before_the_user_turn_is_context():
    system = {"role": "system", "content": "Answer briefly."}
    user = {"role": "user", "content": "What is in this picture?"}
    req = parse({"id": "s", "image": "a.png", "messages": [system, user]})
    assert req.error is None and req.history == [system] and req.turns == [user["content"]]
    answered = {"role": "assistant", "content": "A cat."}
    req = parse({"id": "t", "messages": [user, answered, system, user]})
    assert req.error is None and req.history == [user, answered, system] and req.turns == [user["content"]]
    req = parse({"id": "u", "messages": [user, system, user]})
    assert "system message goes before the user turns" in req.error
    assert "must end with user turns" in parse({"id": "v", "messages": [system]}).error


def test_keys_recap_does_not_read_are_named_with_the_key_likely_meant():
    req = parse({"id": "i", "images": ["a.png"], "question": "What?", "label": 3})
    assert req.error is None and req.image is None and req.unknown == ["images", "label"]
    assert unknown_key("images").endswith("(did you mean 'image'?)")
    assert unknown_key("Question").endswith("(did you mean 'question'?)")
    assert unknown_key("label") == "key 'label' is not one recap reads: ignored"
    assert parse({"id": "k", "prompt": "Hi", "seed": 3, "dataset": "d"}).unknown == []


def test_a_question_beside_what_takes_its_place_is_named_as_ignored():
    """'messages' holds the conversation and 'question' the question: a 'prompt' or 'question' beside them was
    answered without, and without a word."""
    turns = [{"role": "user", "content": "Hi"}]
    assert parse({"id": 1, "messages": turns, "prompt": "Bye", "question": "Why?"}).unknown == ["prompt", "question"]
    assert parse({"id": 2, "question": "Why?", "prompt": "Bye"}).unknown == ["prompt"]
    assert parse({"id": 3, "question": "Why?", "messages": turns}).turns == ["Hi"]
    assert unknown_key("prompt") == "key 'prompt' is read only without 'messages' and 'question': ignored"
    assert unknown_key("question") == "key 'question' is read only without 'messages': ignored"


def test_a_messages_own_keys_recap_does_not_read_are_named_with_its_index():
    """A message gives recap its role and content: a "name", or a "contents" typo, was dropped without a word."""
    turns = [{"role": "system", "content": "Be brief.", "name": "sys"},
             {"role": "user", "content": "Hi", "name": "ann", "contents": "Hello"}]
    req = parse({"id": 1, "messages": turns, "label": 2})
    assert req.error is None and req.turns == ["Hi"]  # answered all the same
    assert req.unknown == ["label", "messages[0].name", "messages[1].name", "messages[1].contents"]
    assert unknown_key("messages[1].name") == "key 'name' in messages[1] is not one recap reads: ignored"
    assert unknown_key("messages[1].contents").endswith("in messages[1] is not one recap reads: ignored "
                                                        "(did you mean 'content'?)")
    typo = parse({"id": 2, "messages": [{"role": "user", "contents": "Hi"}]})
    assert "non-empty string 'content'" in typo.error and typo.unknown == ["messages[0].contents"]
    assert glance(orjson.dumps({"messages": turns})) == (["messages[0].name", "messages[1].name",
                                                          "messages[1].contents"], None)  # --ray's driver too


def test_a_url_or_a_folder_as_the_image_says_so(tmp_path):
    assert "is a URL" in parse({"id": "u", "image": "https://example.com/cat.jpg"}).error
    with pytest.raises(ValueError, match="is a folder"):
        load_image(tmp_path)


def test_an_image_the_file_system_failed_to_give_may_read_on_a_rerun(tmp_path, monkeypatch):
    """A network file system that timed out is no fault of the file: its error is a TransientError (its record
    says ``"retry": true``); a damaged file fails the same way every time, a plain ValueError."""
    from recap_cli.batch import retryable

    damaged = tmp_path / "damaged.png"
    damaged.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(ValueError, match="cannot read image") as bad:
        load_image(damaged)
    assert not isinstance(bad.value, TransientError) and not retryable(bad.value)
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")

    def timed_out(*args, **kwargs):
        raise OSError(errno.ETIMEDOUT, "Connection timed out")

    monkeypatch.setattr(Image, "open", timed_out)
    with pytest.raises(TransientError, match="cannot read image .*timed out") as flaky:
        load_image(tmp_path / "ok.png")
    assert retryable(flaky.value)


def test_only_a_bad_input_is_an_error_for_good():
    """What a record's ``retry`` says: a ValueError is the request's own fault, anything else (out of memory, a
    bug in recap) may pass on a rerun."""
    import torch

    from recap_cli.batch import retryable

    assert not retryable(ValueError("the prompt is 90 tokens and the model reads at most 64"))
    for passing in (torch.OutOfMemoryError("CUDA out of memory"), MemoryError(), RuntimeError("CUDA error"),
                    IndexError("drafter bug"), TransientError("cannot read image a.png: timed out")):
        assert retryable(passing), passing


@pytest.mark.parametrize("mode, suffix, opened", [("I;16", "png", "I;16"), ("I;16B", "tif", "I;16B"),
                                                  ("I;16", "pgm", "I")])
def test_a_16_bit_grayscale_image_is_scaled_not_clipped_to_white(tmp_path, mode, suffix, opened):
    """PIL's own conversion to RGB clips 16-bit values over 255: every pixel of a 16-bit PNG came out white."""
    gray = Image.linear_gradient("L").resize((64, 48))  # 0..255
    wide = Image.frombytes("I", gray.size, b"".join((v * 257).to_bytes(4, "little") for v in gray.getdata()))
    path = tmp_path / f"g16.{suffix}"
    wide.convert(mode).save(path)
    assert Image.open(path).mode == opened
    assert load_image(path).tobytes() == gray.convert("RGB").tobytes()


def test_a_32_bit_image_within_8_bits_reads_as_it_always_did(tmp_path):
    Image.new("I", (8, 8), 200).save(tmp_path / "dark.tif")
    assert load_image(tmp_path / "dark.tif").tobytes() == Image.new("RGB", (8, 8), (200,) * 3).tobytes()
