"""A node's own data: every format read from real files, every bad input refused with the row and the fix, the
node config and the simulation's partition-sources, and the operator's check command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.config import DataSection
from common.data import DataError, Example, load_client_data, own_data
from common.data.files import read_file

QA = [(f"What is the capital of country number {i}?", f"City {i}.") for i in range(40)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows():
    return [
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
                {"role": "user", "content": "And in words?"},
                {"role": "assistant", "content": f"It is {a.lower()}"},
            ]
        }
        for q, a in QA
    ]


def write_all_formats(tmp_path) -> dict[str, object]:
    """The same 40 question-answer pairs in every format and container the reader takes."""
    import datasets

    pc = [{"prompt": q, "completion": a} for q, a in QA]
    out = {
        "prompt-completion": write_jsonl(tmp_path / "pc.jsonl", pc),
        "prompt-answer": write_jsonl(tmp_path / "pa.jsonl", [{"prompt": q, "answer": a} for q, a in QA]),
        "alpaca": tmp_path / "alpaca.json",
        "chat": write_jsonl(tmp_path / "chat.jsonl", chat_rows()),
        "sharegpt": write_jsonl(
            tmp_path / "sharegpt.jsonl",
            [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in QA],
        ),
        "csv": tmp_path / "pc.csv",
        "parquet": tmp_path / "pc.parquet",
        "saved": tmp_path / "saved",
    }
    out["alpaca"].write_text(json.dumps([{"instruction": q, "input": "", "output": a} for q, a in QA], indent=1))
    table = datasets.Dataset.from_list(pc)
    table.to_csv(str(out["csv"]), index=False)
    table.to_parquet(str(out["parquet"]))
    table.save_to_disk(str(out["saved"]))
    return out


def test_every_format_and_container_reads_the_same_examples(tmp_path):
    files = write_all_formats(tmp_path)
    expected = {
        "prompt-answer": "prompt-completion",
        "csv": "prompt-completion",
        "parquet": "prompt-completion",
        "saved": "prompt-completion",
    }
    keys = {}
    for name, path in files.items():
        data = read_file(path)
        assert data.format == expected.get(name, name), name
        assert len(data.examples) == 40
        keys[name] = sorted(e.content_key() for e in data.examples)
    # single-turn data is the same example whatever it came in (the split then agrees too)
    assert len({tuple(k) for n, k in keys.items() if n != "chat"}) == 1
    chat = read_file(files["chat"]).examples[0]
    assert [m["role"] for m in chat.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.answer == "It is city 0." and chat.prompt == "And in words?"


def test_a_folder_of_files_is_read_as_one_dataset(tmp_path):
    rows = chat_rows()
    (tmp_path / "notes").mkdir()
    write_jsonl(tmp_path / "notes" / "2025.jsonl", rows[:25])
    write_jsonl(tmp_path / "notes" / "2026.jsonl", rows[25:])
    (tmp_path / "notes" / "README.txt").write_text("not data\n")  # other files in the folder are not read
    data = load_client_data(DataSection(), 0, 1, 0, {"data-path": str(tmp_path / "notes")})
    assert data.counts["data-examples"] == 40 and all(e.turns for e in data.train)


def test_a_named_format_wins_over_detection_and_an_unknown_layout_says_what_each_needs(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": q, "reply": a} for q, a in QA])
    with pytest.raises(DataError, match="cannot tell the format") as err:
        read_file(path)
    assert "data-format" in err.value.detail and "'instruction' and 'output'" in err.value.detail
    assert "['question', 'reply']" in err.value.detail and "question" not in str(err.value)  # the columns stay
    with pytest.raises(DataError, match=r"row 1: field 'instruction' is missing \(format alpaca\)"):
        read_file(path, "alpaca")


def test_multi_turn_chat_learns_every_assistant_turn_and_nothing_else(tmp_path):
    from common.model import load_tokenizer
    from common.training import IGNORE, encode, prompt_ids

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    example = read_file(write_jsonl(tmp_path / "chat.jsonl", chat_rows()[:1])).examples[0]
    enc = encode(tokenizer, example, 512)
    learned = tokenizer.decode([t for t, label in zip(enc.input_ids, enc.labels) if label != IGNORE])
    assert learned == "City 0.<|im_end|>It is city 0.<|im_end|>"
    assert tokenizer.decode(enc.input_ids).startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    # generation is scored on the last assistant turn, from the whole conversation before it
    assert tokenizer.decode(prompt_ids(tokenizer, example)).endswith("And in words?<|im_end|>\n<|im_start|>assistant\n")


def bad_files(tmp_path):
    """(file, expected message in the error the server may see, expected words in the node's detail)."""
    big = "x" * 3000
    good = {"prompt": "q", "completion": "a"}
    cases = {
        "missing": (tmp_path / "nope.jsonl", "does not exist", "data-path"),
        "empty": (tmp_path / "empty.jsonl", "is empty", "empty.jsonl"),
        "invalid-json": (tmp_path / "bad.jsonl", "line 3 is not valid JSON", "Fix that line"),
        "missing-field": (
            tmp_path / "field.jsonl",
            "row 2: field 'completion' is missing",
            "'prompt' and 'completion'",
        ),
        "no-assistant": (tmp_path / "noasst.jsonl", "row 1: field 'messages' has no assistant turn", "assistant turn"),
        "not-utf8": (tmp_path / "latin.jsonl", "line 2 is not UTF-8", "Save the file as UTF-8"),
        "huge-row": (tmp_path / "huge.jsonl", "line 2 has 3,0", "raise data.max-row-chars"),
        "bad-role": (tmp_path / "role.jsonl", "row 1: field 'messages[0].role' must be one of", "secret-robot"),
        "not-object": (tmp_path / "list.jsonl", "row 2 is a JSON list, not an object", "object"),
        "unknown-suffix": (tmp_path / "notes.secret", "a file of this kind is not read", "'.secret' are not read"),
        "unknown-columns": (tmp_path / "cols.jsonl", "cannot tell the format from the file's 2 column", "secret_q"),
        "huge-csv-row": (tmp_path / "huge.csv", "row 2 has 3,0", "raise data.max-row-chars"),
        "huge-csv-field": (tmp_path / "field.csv", "row 2 has a field over data.max-row-chars", "close its quotes"),
        "huge-parquet-row": (tmp_path / "huge.parquet", "row 2 has 3,0", "raise data.max-row-chars"),
        "huge-json-array-row": (tmp_path / "huge.json", "row 2 has 3,0", "raise data.max-row-chars"),
        "huge-saved-row": (tmp_path / "huge-saved", "row 2 has 3,0", "raise data.max-row-chars"),
        "huge-row-in-folder": (tmp_path / "csvs", "file 2 of 2 in the folder: row 1 has 3,0", "b.csv"),
        "empty-folder": (
            tmp_path / "notes-dir",
            "the folder holds no data file and is not a saved dataset",
            "save_to_disk",
        ),
        "bad-file-in-folder": (tmp_path / "two", "file 2 of 2 in the folder: line 2 is not valid JSON", "b.jsonl"),
        "mixed-folder": (tmp_path / "mixed", "the folder mixes ['csv', 'json'] files", "one kind of file"),
    }
    (tmp_path / "notes-dir").mkdir()
    (tmp_path / "notes-dir" / "secret.txt").write_text("secret question\n")
    for name in ("two", "mixed"):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "a.jsonl", [good] * 5)
    (tmp_path / "two" / "b.jsonl").write_text(json.dumps(good) + '\n{"prompt": secret}\n')
    (tmp_path / "mixed" / "b.csv").write_text("prompt,completion\nsecret,a\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n{'prompt': oops}\n")
    write_jsonl(tmp_path / "field.jsonl", [good, {"prompt": "secret question"}])
    write_jsonl(tmp_path / "noasst.jsonl", [{"messages": [{"role": "user", "content": "secret question"}]}])
    (tmp_path / "latin.jsonl").write_bytes(json.dumps(good).encode() + b'\n{"prompt": "caf\xe9", "completion": "a"}\n')
    write_jsonl(tmp_path / "huge.jsonl", [good, {"prompt": big, "completion": "a"}])
    write_jsonl(tmp_path / "role.jsonl", [{"messages": [{"role": "secret-robot", "content": "secret"}]}])
    (tmp_path / "list.jsonl").write_text(json.dumps(good) + '\n["secret question", "a"]\n')
    (tmp_path / "notes.secret").write_text("secret question\n")
    write_jsonl(tmp_path / "cols.jsonl", [{"secret_q": "q", "secret_a": "a"}] * 3)
    # every reader bounds a row (the limit here is 2,000): CSV by its fields' sum and by one field, Parquet, one
    # JSON array, a saved dataset, a folder
    half = {"prompt": "secret " + "x" * 1500, "completion": "y" * 1500}
    import datasets

    datasets.Dataset.from_list([good, half]).to_csv(str(tmp_path / "huge.csv"), index=False)
    (tmp_path / "field.csv").write_text(f'prompt,completion\nq,a\n"secret {big}",a\n')
    datasets.Dataset.from_list([good, half]).to_parquet(str(tmp_path / "huge.parquet"))
    (tmp_path / "huge.json").write_text(json.dumps([good, half]))
    datasets.Dataset.from_list([good, half]).save_to_disk(str(tmp_path / "huge-saved"))
    (tmp_path / "csvs").mkdir()
    datasets.Dataset.from_list([good] * 5).to_csv(str(tmp_path / "csvs" / "a.csv"), index=False)
    datasets.Dataset.from_list([half]).to_csv(str(tmp_path / "csvs" / "b.csv"), index=False)
    return cases


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "empty",
        "invalid-json",
        "missing-field",
        "no-assistant",
        "not-utf8",
        "huge-row",
        "bad-role",
        "not-object",
        "unknown-suffix",
        "unknown-columns",
        "huge-csv-row",
        "huge-csv-field",
        "huge-parquet-row",
        "huge-json-array-row",
        "huge-saved-row",
        "huge-row-in-folder",
        "empty-folder",
        "bad-file-in-folder",
        "mixed-folder",
    ],
)
def test_bad_data_is_refused_naming_the_row_and_the_fix_without_its_text(tmp_path, case):
    path, reason, fix = bad_files(tmp_path)[case]
    cfg = DataSection(max_row_chars=2000)
    with pytest.raises(DataError) as err:
        load_client_data(cfg, 0, 1, 0, {"data-path": str(path)})
    assert reason in str(err.value), str(err.value)
    assert fix in err.value.detail and str(path) in err.value.detail, err.value.detail
    # what may reach the server: no path, no file name, no text of a row, no column name
    assert str(tmp_path) not in str(err.value) and path.name not in str(err.value) and "secret" not in str(err.value)


def test_too_few_examples_to_split_names_the_fractions_and_the_way_out(tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", [{"prompt": q, "completion": a} for q, a in QA[:1]])
    with pytest.raises(DataError, match=r"too few examples to split: 1 examples") as err:
        load_client_data(DataSection(), 0, 1, 0, {"data-path": str(path)})
    assert "data-test-path" in err.value.detail


def test_rows_over_the_prompt_limit_are_cut_and_counted_never_dropped(tmp_path):
    rows = [{"prompt": ("word " * 200) if i % 4 == 0 else q, "completion": a} for i, (q, a) in enumerate(QA)]
    data = load_client_data(
        DataSection(max_prompt_chars=100), 0, 1, 0, {"data-path": str(write_jsonl(tmp_path / "l.jsonl", rows))}
    )
    assert data.counts["data-examples"] == 40 and data.counts["data-clipped"] == 10
    assert data.counts["data-train"] + data.counts["data-test"] == 40
    assert max(len(e.prompt) for e in data.train + data.held_out) <= 104


def test_the_node_config_wins_over_the_bank_and_reports_no_task_names(tmp_path):
    files = write_all_formats(tmp_path)
    data = load_client_data(DataSection(), 2, 3, 0, {"data-path": str(files["chat"]), "partition-id": 2})
    assert data.own and {e.task for e in data.train} == {"data"}
    assert data.counts["data-examples"] == 40 and len(data.train) + len(data.held_out) == 40
    # the split is the content's: the same examples are test examples on another node, in another format
    alpaca = load_client_data(DataSection(), 0, 3, 5, {"data-path": str(files["alpaca"])})
    parquet = load_client_data(DataSection(), 1, 3, 9, {"data-path": str(files["parquet"])})
    assert [e.content_key() for e in alpaca.held_out] == [e.content_key() for e in parquet.held_out]


def test_an_explicit_test_file_is_the_test_split_and_its_copies_are_never_trained_on(tmp_path):
    rows = [{"prompt": q, "completion": a} for q, a in QA]
    main = write_jsonl(tmp_path / "main.jsonl", rows)
    test = write_jsonl(tmp_path / "test.jsonl", [{"prompt": q.upper() + "  ", "completion": a} for q, a in QA[:5]])
    data = load_client_data(DataSection(), 0, 1, 0, {"data-path": str(main), "data-test-path": str(test)})
    assert len(data.held_out) == 5 and data.counts["data-test-copies-dropped"] == 5
    assert not {e.content_key() for e in data.train} & {e.content_key() for e in data.held_out}
    assert len(data.train) == 35


def test_node_config_mistakes_are_named():
    with pytest.raises(DataError, match=r"unknown key\(s\) \['data-pth'\]"):
        own_data(DataSection(), {"data-pth": "/x"}, 0)
    with pytest.raises(DataError, match="data-test-path and data-format need data-path"):
        own_data(DataSection(), {"data-format": "chat"}, 0)


def test_partition_sources_simulate_nodes_that_bring_their_own_data(tmp_path):
    files = write_all_formats(tmp_path)
    sources = f"{files['chat']},{files['alpaca']},{files['parquet']}"
    cfg = DataSection(partition_sources=sources)
    assert [load_client_data(cfg, p, 3, 0, run_config_paths=True).own for p in range(3)] == [True, True, True]
    assert load_client_data(cfg, 0, 3, 0, run_config_paths=True).train[0].turns  # partition 0 reads the chat file
    with pytest.raises(DataError, match="names 3 files; partition 3 has none"):
        load_client_data(cfg, 3, 4, 0, run_config_paths=True)
    with pytest.raises(ValueError, match="do not exist"):
        DataSection(partition_sources=f"{files['chat']},{tmp_path / 'gone.jsonl'}")


def run_check(*args):
    return subprocess.run(
        [sys.executable, "-m", "common.data", "check", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_the_check_command_reports_format_counts_split_and_problems(tmp_path):
    files = write_all_formats(tmp_path)
    out = run_check(files["chat"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "format: chat" in out.stdout and "examples: 40" in out.stdout and "ready" in out.stdout
    assert "split (by content" in out.stdout and "tokens (smollm2-135m-instruct)" in out.stdout
    rows = [{"prompt": q, "completion": a} for q, a in QA] + [{"prompt": "q"}, {"prompt": "r", "completion": ""}]
    out = run_check(write_jsonl(tmp_path / "some-bad.jsonl", rows))
    assert out.returncode == 1 and "row 41: field 'completion' is missing" in out.stdout
    assert "row 42: field 'completion' is empty" in out.stdout and "not ready" in out.stdout
    out = run_check(tmp_path / "absent.jsonl")
    assert out.returncode == 1 and "refused:" in out.stdout and "does not exist" in out.stdout


# --- files as common tools export them ------------------------------------------------------------------------------

PAIRS = [{"prompt": f"What is {i} plus {i}?", "completion": str(2 * i)} for i in range(6)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_byte_order_mark_is_read_as_windows_tools_write_it(tmp_path, suffix):
    body = "".join(json.dumps(r) + "\n" for r in PAIRS) if suffix == ".jsonl" else json.dumps(PAIRS)
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert [e.answer for e in read_file(path).examples] == [r["completion"] for r in PAIRS]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_one_json_object_holding_the_rows_is_named_for_what_it_is(tmp_path, suffix):
    path = tmp_path / f"export{suffix}"
    path.write_text(json.dumps({"version": "1.0", "data": PAIRS}, indent=2))
    with pytest.raises(DataError, match="one JSON object over several lines .*'data'.*not rows") as err:
        read_file(path)
    assert "JSON Lines" in err.value.detail and "is not valid JSON" not in str(err.value)


def test_pretty_printed_rows_in_a_jsonl_file_are_named_for_what_they_are(tmp_path):
    path = tmp_path / "pretty.jsonl"
    path.write_text("".join(json.dumps(r, indent=2) + "\n" for r in PAIRS))
    with pytest.raises(DataError, match="line 1 begins a JSON object that goes on over the next lines") as err:
        read_file(path)
    assert "jq -c" in err.value.detail


def test_column_names_in_any_case_are_the_format_they_name(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text("Prompt,Completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in PAIRS))
    assert [(e.prompt, e.answer) for e in read_file(path).examples] == [(r["prompt"], r["completion"]) for r in PAIRS]


def test_openai_text_content_parts_are_read_and_other_parts_refused_without_their_type(tmp_path):
    def chat(user, assistant):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}

    parts = [chat([{"type": "text", "text": f"Hi {i}"}], [{"type": "text", "text": f"Hello {i}."}]) for i in range(4)]
    path = write_jsonl(tmp_path / "parts.jsonl", parts)
    assert [(e.prompt, e.answer) for e in read_file(path).examples] == [(f"Hi {i}", f"Hello {i}.") for i in range(4)]
    picture = chat([{"type": "image_url", "image_url": {"url": "https://example.org/x.png"}}], "A cat.")
    path = write_jsonl(tmp_path / "picture.jsonl", [picture] * 3)
    with pytest.raises(DataError, match=r"field 'content\[0\]' must be a text part") as err:
        read_file(path)
    assert "image_url" not in str(err.value) and "image_url" in err.value.detail  # the type stays on the node


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--test-fraction", "1.5"], "--test-fraction: Input should be less than 1 (got 1.5)"),
        (["--max-prompt-chars", "10"], "--max-prompt-chars: Input should be greater than or equal to 64"),
        (["--max-seq-len", "5"], "--max-seq-len: Input should be greater than or equal to 16"),
        (["--max-row-chars", "0"], "--max-row-chars"),
    ],
)
def test_a_check_setting_a_run_would_refuse_is_named_by_its_flag(tmp_path, flags, named):
    out = run_check(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), *flags)
    assert out.returncode == 2 and named in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_check_counts_every_bad_row_names_the_first_when_all_fail_and_says_what_the_defaults_cut(tmp_path):
    rows = [{"prompt": f"q{i}"} for i in range(14)] + [{"prompt": "What is one plus one?", "completion": "2"}] * 2
    out = run_check(write_jsonl(tmp_path / "bad.jsonl", rows))
    assert out.returncode == 1 and "rows that cannot be read: 14 (" in out.stdout and "the first 10" in out.stdout
    out = run_check(write_jsonl(tmp_path / "none.jsonl", rows[:14]), "--format", "prompt-completion")
    assert out.returncode == 1 and "no row could be read" in out.stdout
    assert "row 1 of them: row 1: field 'completion' is missing" in out.stdout, out.stdout
    long = [{"prompt": f"Summarise: {'word ' * 200}{i}", "completion": "A summary."} for i in range(40)]
    out = run_check(write_jsonl(tmp_path / "long.jsonl", long))
    assert out.returncode == 0 and "ready" in out.stdout
    assert "note: 40 of 40 prompts cut to data.max-prompt-chars (400)" in out.stdout, out.stdout


def test_a_windows_1252_csv_is_refused_naming_its_line_and_the_fix(tmp_path):
    path = tmp_path / "export.csv"
    path.write_bytes("prompt,completion\nWhat is 2?,Two\nWhat is a café?,A drink\n".encode("cp1252"))
    with pytest.raises(DataError, match=r"line 3 is not UTF-8 \(byte 13 of the line; a Windows-1252") as err:
        read_file(path)
    assert "iconv -f cp1252 -t utf-8" in err.value.detail and "same columns" not in err.value.detail
    quoted = tmp_path / "quoted.csv"  # a quoted field over two lines still reads
    quoted.write_bytes(b'\xef\xbb\xbfprompt,completion\n"Two\nlines",yes\n"One line",no\n')
    assert [e.prompt for e in read_file(quoted).examples] == ["Two\nlines", "One line"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_of_blank_lines_is_said_to_hold_no_rows(tmp_path, suffix):
    path = tmp_path / f"blank{suffix}"
    path.write_text("\n\n\n")
    with pytest.raises(DataError, match="the file holds no rows"):
        read_file(path)


def test_a_long_token_count_says_how_far_it_is_and_a_short_one_says_nothing(capsys):
    from common.data.__main__ import Progress
    from common.model import load_tokenizer
    from common.training import token_counts

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    examples = [Example("qa", q, a) for q, a in QA] * 5
    seen: list[tuple[int, int]] = []
    tokens, _, counted = token_counts(tokenizer, examples, 512, batch=40, progress=lambda *n: seen.append(n))
    assert counted == len(examples) and tokens > 0
    assert seen == [(40 * i, len(examples)) for i in range(1, len(examples) // 40 + 1)]
    Progress("counting tokens", every=60)(40, 200)  # a count that ends within a minute: no line
    assert capsys.readouterr().err == ""
    Progress("counting tokens", every=0)(40, 200)
    assert capsys.readouterr().err.startswith("counting tokens: 40 of 200 (20%; about ")
