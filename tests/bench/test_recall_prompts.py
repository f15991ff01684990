import json

import pytest

from bench.recall_prompts import lead_of, main, recall_prompt, recalled_file, source_files


def _words(text: str) -> int:
    """A tokenizer stand-in: one token a word."""
    return len(text.split())


def _file(path: str, words: int) -> str:
    return f"# file: {path}\n" + "".join(f"w{i} w{i}\n" for i in range(words // 2))


def _prompt() -> str:
    # a preamble, then files of 3 + 400, 3 + 200, 3 + 100 and 3 + 50 words: they start 762, 359, 156 and 53 words
    # from the end
    return "preamble\n" + _file("a.py", 400) + _file("b.py", 200) + _file("c.py", 100) + _file("d.py", 50)


def test_files_are_split_at_their_file_lines_with_tokens_to_the_end():
    files = source_files(_prompt(), _words)
    assert [(f.path, f.tokens, f.tokens_from_end) for f in files] == [
        ("a.py", 403, 762), ("b.py", 203, 359), ("c.py", 103, 156), ("d.py", 53, 53)]
    assert all(_prompt()[f.start:].startswith("# file: ") for f in files)


@pytest.mark.parametrize(("context", "min_tokens", "expected"), [
    (1024, 100, "a.py"),  # 256..764 back: a.py, the first in range
    (800, 100, "b.py"),  # 200..596 back: a.py (762) is too far
    (800, 300, None),  # b.py is too short, a.py too far
    (100, 10, None),  # 25..71 back: only d.py, the last file, whose copy would continue the text before it
])  # fmt: skip
def test_the_recalled_file_is_far_back_inside_the_cut_and_long_enough(context, min_tokens, expected):
    chosen = recalled_file(source_files(_prompt(), _words), context, 4, min_tokens)
    assert (chosen and chosen.path) == expected


def test_the_lead_is_whole_lines_up_to_about_the_lead_tokens():
    file = source_files(_prompt(), _words)[1]
    assert lead_of(file, 6, _words) == "# file: b.py\nw0 w0\nw1 w1\n"  # 2 + 2 + 2 words
    assert lead_of(file, 1, _words) == "# file: b.py\n"


def test_the_prompt_ends_with_the_file_opened_again_on_a_line_of_its_own():
    row = {"id": "long-001", "source": "pkg", "text": _prompt().rstrip("\n")}
    prompt = recall_prompt(row, 1024, 4, 100, _words)
    assert prompt["id"] == "recall-long-001" and prompt["recalled_file"] == "a.py"
    assert prompt["text"] == row["text"] + "\n# file: a.py\nw0 w0\n"
    assert recall_prompt(row, 800, 4, 300, _words) is None


def test_the_command_writes_the_prompts_that_fit_and_refuses_a_context_too_small(tmp_path, tiny_target_dir):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": "x", "text": _prompt()}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--data", str(data), "--tokenizer-model", str(tiny_target_dir), "--context", "2048",
                 "--lead-tokens", "8", "--min-file-tokens", "100", "--out", str(out)]) == 0
    [written] = [json.loads(line) for line in out.read_text().splitlines()]
    assert written["text"].startswith(_prompt()) and written["text"].endswith("\n")
    assert written["recalled_file"] in {"a.py", "b.py", "c.py"}
    with pytest.raises(SystemExit):
        main(["--data", str(data), "--tokenizer-model", str(tiny_target_dir), "--context", "32", "--out", str(out)])


def test_a_folder_without_a_tokenizer_is_refused_with_its_path(tmp_path, capsys):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": "x", "text": _prompt()}) + "\n")
    with pytest.raises(SystemExit):
        main(["--data", str(data), "--tokenizer-model", str(tmp_path / "nowhere"), "--context", "2048",
              "--out", str(tmp_path / "out.jsonl")])
    assert f"cannot load a tokenizer from {tmp_path / 'nowhere'}" in capsys.readouterr().err
