"""Reading a request line: the shapes people write, and what recap says when a line is not what it reads."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from recap_cli.records import load_image, parse_line, unknown_key


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


def test_a_url_or_a_folder_as_the_image_says_so(tmp_path):
    assert "is a URL" in parse({"id": "u", "image": "https://example.com/cat.jpg"}).error
    with pytest.raises(ValueError, match="is a folder"):
        load_image(tmp_path)
