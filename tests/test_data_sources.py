"""Prompt sources: datasets.Dataset objects, local files and folders, Hub names (offline), every column layout, the
compact PromptTable, and every error a user can hit. The oracle is tokenize_prompts (itself checked against the
tokenizer's chat template) on the same rows as plain Python dicts."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from fastdistill.data import PromptTable, routed_table, tokenize_prompts  # noqa: E402
from fastdistill.data.sources import load_prompt_source, prepare_prompts, prompt_messages, tokenize_dataset  # noqa: E402
from fastdistill.errors import ConfigError  # noqa: E402
from fastdistill.tiny import build_tokenizer  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_datasets_cache(tmp_path, monkeypatch):
    """load_dataset and map write their Arrow caches under the test's folder, not the user's home."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]


def chat_rows(count: int = 6) -> list[dict]:
    return [{"prompt": chat(f"What is {i} + {i}?"), "teacher_id": ("math", "code")[i % 2]} for i in range(count)]


def assert_same_rows(table: PromptTable, expected: list[dict]) -> None:
    assert isinstance(table, PromptTable) and len(table) == len(expected)
    assert [table[i] for i in range(len(table))] == expected


# ------------------------------------------------------------------------------------------------ PromptTable


def test_prompt_table_round_trips_rows_and_pickles_compactly():
    rows = [{"prompt_ids": [5, 6, 7], "teacher_id": "math", "prompt": "a"}, {"prompt_ids": [8], "prompt": None},
            {"prompt_ids": [9, 10], "teacher_id": "code", "prompt": ["x"]}]
    table = PromptTable.from_rows(rows)
    assert table.token_ids.dtype == np.int32 and table.token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert table.offsets.tolist() == [0, 3, 4, 6] and table.lengths.tolist() == [3, 1, 2]
    assert table.teacher_names == ("code", "math") and table.teacher_codes.tolist() == [1, -1, 0]
    assert [table.teacher_id(i) for i in range(3)] == ["math", None, "code"]
    assert list(table) == rows and table[-1] == rows[2] and table[1:] == rows[1:]
    assert all(type(t) is int for t in table[0]["prompt_ids"])
    assert list(pickle.loads(pickle.dumps(table))) == rows
    assert PromptTable.from_rows([{"prompt_ids": [1]}]).prompts is None  # no prompt anywhere: none kept
    with pytest.raises(IndexError, match="row 3 out of range for a table of 3 rows"):
        table[3]
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease and end at len"):
        PromptTable(np.arange(3), np.array([0, 2, 1, 3]))
    with pytest.raises(ValueError, match=r"teacher_codes must hold one code in \[-1, len\(teacher_names\)\)"):
        PromptTable(np.arange(3), np.array([0, 3]), np.array([1]), ("a",))
    with pytest.raises(ValueError, match="prompts has 2 entries for 1 rows"):
        PromptTable(np.arange(3), np.array([0, 3]), prompts=["a", "b"])
    with pytest.raises(ValueError, match="token_ids and offsets must be 1-D"):
        PromptTable(np.zeros((2, 2)), np.array([0, 4]))


def test_routing_of_rows_and_of_a_table():
    """``routed_table`` takes rows or a table alike: with several teachers each row keeps its own, with one every
    row goes to it; every refusal names the row."""
    rows = [{"prompt_ids": [1, 2], "teacher_id": "math"}, {"prompt_ids": [3], "teacher_id": "code"}]
    for dataset in (rows, PromptTable.from_rows(rows)):
        routed = routed_table(dataset, ["code", "math"])
        assert isinstance(routed, PromptTable)
        assert [row["teacher_id"] for row in routed] == ["math", "code"]
        assert [row["prompt_ids"] for row in routed] == [[1, 2], [3]]
        assert [row["teacher_id"] for row in routed_table(dataset, ["solo"])] == ["solo", "solo"]
    for bad_rows, message in [
        ([{"prompt_ids": [1], "teacher_id": "bio"}], r"row 0 has teacher_id='bio'.*\['code', 'math'\]"),
        ([{"prompt_ids": [1], "teacher_id": "math"}, {"prompt_ids": [2]}], r"row 1 has teacher_id=None"),
        ([{"prompt_ids": [1], "teacher_id": "math"}, {"prompt_ids": []}], r"row 1: prompt_ids must be a non-empty"),
        ([{"prompt_ids": [1], "teacher_id": "math"}, {"teacher_id": "math"}], r"row 1: prompt_ids .* got None"),
        ([{"prompt_ids": "abc", "teacher_id": "math"}], r"row 0: prompt_ids .* got 'abc'"),
    ]:
        with pytest.raises(ValueError, match=message):
            routed_table(bad_rows, ["code", "math"])
    with pytest.raises(ValueError, match="the dataset is empty"):
        routed_table([], ["a"])
    with pytest.raises(ValueError, match="the dataset is empty"):
        PromptTable(np.zeros(0), np.zeros(1)).routed(["a"])


# ------------------------------------------------------------------------------------------------ layouts


def test_chat_prompts_in_a_dataset_match_tokenize_prompts(tokenizer):
    rows = chat_rows()
    table = tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer)
    assert_same_rows(table, tokenize_prompts(rows, tokenizer))
    assert table[0]["prompt_ids"] == tokenizer.apply_chat_template(rows[0]["prompt"], return_dict=False,
                                                                   add_generation_prompt=True)
    assert set(table.teacher_names) == {"code", "math"} and table.teacher_codes.dtype == np.int32


def test_text_prompts_and_chat_template_kwargs(tokenizer):
    rows = [{"prompt": "Count to 5:"}, {"prompt": "Say hi"}]
    assert_same_rows(tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer), tokenize_prompts(rows, tokenizer))
    templated = build_tokenizer()
    templated.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking %}{{ ' <think>' }}{% endif %}")
    chats = [{"prompt": [{"role": "user", "content": "hi"}]}]
    table = tokenize_dataset(datasets.Dataset.from_list(chats), templated,
                             chat_template_kwargs={"enable_thinking": True})
    assert templated.decode(table[0]["prompt_ids"]) == "hi <think>"
    with pytest.raises(ConfigError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        tokenize_dataset(datasets.Dataset.from_list(chats), templated, chat_template_kwargs={"tokenize": False})


def test_messages_prompt_is_every_turn_before_the_last_assistant_turn(tokenizer):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 + 3?"},
                    {"role": "assistant", "content": "6"}]
    rows = [{"messages": conversation}, {"messages": conversation[:3]}]
    table = tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer)
    assert_same_rows(table, tokenize_prompts([{"prompt": conversation[:4]}, {"prompt": conversation[:2]}], tokenizer))
    assert table[0]["prompt"] == conversation[:4]  # read lazily from the dataset, cut the same way
    assert tokenizer.decode(table[1]["prompt_ids"]).endswith("2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_ids_pass_through_and_keep_a_prompt_column():
    rows = [{"prompt_ids": [5, 6, 7], "prompt": "a", "teacher_id": None}, {"prompt_ids": [8], "prompt": "b",
                                                                           "teacher_id": "t"}]
    table = tokenize_dataset(datasets.Dataset.from_list(rows), None)
    assert list(table) == [{"prompt_ids": [5, 6, 7], "prompt": "a"}, {"prompt_ids": [8], "teacher_id": "t",
                                                                     "prompt": "b"}]
    only_ids = tokenize_dataset(datasets.Dataset.from_list([{"prompt_ids": [3, 4]}]), None)
    assert list(only_ids) == [{"prompt_ids": [3, 4], "prompt": None}] and only_ids.prompts is None


def test_the_prompt_column_wins_over_messages(tokenizer):
    rows = [{"prompt": "Say hi", "messages": [{"role": "user", "content": "ignored"}]}]
    assert tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer)[0]["prompt_ids"] == tokenizer(
        "Say hi", add_special_tokens=False)["input_ids"]


def test_parallel_map_gives_the_same_table(tokenizer):
    rows = chat_rows(40)
    dataset = datasets.Dataset.from_list(rows)
    serial = tokenize_dataset(dataset, tokenizer, num_proc=None)
    parallel = tokenize_dataset(dataset, tokenizer, num_proc=2)
    assert list(parallel) == list(serial) == tokenize_prompts(rows, tokenizer)


def test_a_table_pickles_with_its_lazy_prompts(tokenizer, tmp_path):
    rows = chat_rows(3)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for table in (prepare_prompts(str(path), tokenizer), tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer)):
        assert list(pickle.loads(pickle.dumps(table))) == tokenize_prompts(rows, tokenizer)


# ------------------------------------------------------------------------------------------------ sources


def write_files(rows: list[dict], folder) -> dict[str, str]:
    """The rows as .json (a list), .jsonl, .parquet and .csv files (chat prompts only fit the first three)."""
    folder.mkdir(parents=True, exist_ok=True)
    dataset = datasets.Dataset.from_list(rows)
    paths = {suffix: str(folder / f"rows{suffix}") for suffix in (".json", ".jsonl", ".parquet", ".csv")}
    (folder / "rows.json").write_text(json.dumps(rows))
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset.to_parquet(paths[".parquet"])
    if all(isinstance(row["prompt"], str) for row in rows):
        dataset.to_csv(paths[".csv"], index=False)
    else:
        del paths[".csv"]
    return paths


def test_every_file_type_loads_the_same_rows(tokenizer, tmp_path):
    text_rows = [{"prompt": f"Count to {i}:", "teacher_id": "math"} for i in range(4)]
    chats = chat_rows(4)
    for rows, name in ((text_rows, "text"), (chats, "chat")):
        expected = tokenize_prompts(rows, tokenizer)
        paths = write_files(rows, tmp_path / name)
        assert len(paths) == (4 if name == "text" else 3)
        for path in paths.values():
            assert_same_rows(prepare_prompts(path, tokenizer), expected)


def test_json_rows_mixing_text_and_chat_prompts_still_load(tokenizer, tmp_path):
    rows = [{"prompt": "Count to 3:"}, {"prompt": chat("hi")}]
    for suffix, text in ((".json", json.dumps(rows)), (".jsonl", "".join(json.dumps(r) + "\n" for r in rows))):
        path = tmp_path / f"mixed{suffix}"
        path.write_text(text)
        assert_same_rows(prepare_prompts(str(path), tokenizer), tokenize_prompts(rows, tokenizer))


def test_folders_give_the_configured_split(tokenizer, tmp_path):
    train, test = chat_rows(4), [{"prompt": chat("held out"), "teacher_id": "math"}]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(saved))
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in train))
    (files / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in test))
    for folder in (saved, files):
        assert_same_rows(prepare_prompts(str(folder), tokenizer), tokenize_prompts(train, tokenizer))
        assert_same_rows(prepare_prompts(str(folder), tokenizer, split="test"), tokenize_prompts(test, tokenizer))
        with pytest.raises(ConfigError, match="validation"):
            prepare_prompts(str(folder), tokenizer, what="eval_dataset", split="validation")
    one = tmp_path / "one"
    datasets.Dataset.from_list(test).save_to_disk(str(one))  # a single saved Dataset: every row, whatever the split
    assert_same_rows(prepare_prompts(str(one), tokenizer, split="anything"), tokenize_prompts(test, tokenizer))


def test_lists_of_rows_keep_working_and_their_errors_name_the_source(tokenizer):
    rows = chat_rows(2)
    assert_same_rows(prepare_prompts(rows, tokenizer), tokenize_prompts(rows, tokenizer))
    assert load_prompt_source(rows) == rows
    with pytest.raises(ConfigError, match=r"eval_dataset: row 0: no 'prompt' \(chat messages or text\)"):
        prepare_prompts([{"question": "x"}], tokenizer, what="eval_dataset")


def test_unusable_sources_are_config_errors(tokenizer, tmp_path):
    (tmp_path / "rows.txt").write_text("hello")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "no-rows.json").write_text("[]")
    cases = [
        ([], "train_dataset: the dataset is empty"),
        (str(tmp_path / "missing.jsonl"), r"train_dataset: dataset file '.*missing.jsonl' does not exist"),
        (str(tmp_path / "rows.txt"), r"unsupported file type '.txt' .*expected a .json, .jsonl, .parquet or .csv"),
        (str(tmp_path / "empty.jsonl"), r"train_dataset: the dataset file '.*empty.jsonl' is empty"),
        (str(tmp_path / "no-rows.json"), r"train_dataset: could not load '.*no-rows.json': .*corresponds to no data"),
        (datasets.Dataset.from_list([{"prompt": "x"}]).select([]), "train_dataset: the dataset is empty"),
        (datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x"}])}),
         r"got a DatasetDict with splits \['train'\]; pass one split, e.g. dataset\['train'\]"),
        (datasets.Dataset.from_list([{"prompt": "x"}]).to_iterable_dataset(),
         r"an IterableDataset \(streaming=True\) is not supported"),
        (42, "expected a datasets.Dataset, a list of row dicts, a file path, .* got int"),
    ]
    for source, message in cases:
        with pytest.raises(ConfigError, match=message):
            prepare_prompts(source, tokenizer)


@pytest.mark.slow
def test_an_unreachable_hub_name_is_a_clear_error_offline(tmp_path):
    """In a fresh process with the Hub switched off (the variables are read when datasets is imported), so nothing
    is fetched."""
    code = ("from fastdistill.data.sources import load_prompt_source\n"
            "from fastdistill.errors import ConfigError\n"
            "try:\n    load_prompt_source('fastdistill-tests/no-such-dataset', split='train', dataset_config='main')\n"
            "except ConfigError as error:\n    print(error)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("train_dataset: could not load 'fastdistill-tests/no-such-dataset' "
                                 "(dataset_config='main', split='train'): ")
    assert ("It is not a local file or folder, so it was looked up on the Hugging Face Hub in offline mode "
            "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); pass a local file or folder") in out.stdout


# ------------------------------------------------------------------------------------------------ row errors


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": "x"}], r"train_dataset: the dataset has no 'prompt', 'messages' or 'prompt_ids' column "
                              r"\(it has \['question'\]\)"),
        ([{"prompt": "ok"}, {"prompt": None}], r"train_dataset: row 1: column 'prompt' is empty \(None\)"),
        ([{"prompt": 3}], r"row 0: column 'prompt' must hold chat messages or text, got int"),
        ([{"prompt": "a"}, {"prompt": ""}], r"row 1: the prompt in column 'prompt' tokenises to no tokens"),
        ([{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": []}],
         r"row 1: column 'prompt' must be a non-empty list of chat messages, got an empty list"),
        ([{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": None, "content": "b"}]}],
         r"row 1: message 0 of column 'prompt' must be a mapping with a string 'role'"),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
          {"messages": [{"role": "user", "content": "c"}]}],
         r"row 1: column 'messages' has no assistant turn, so no prompt can be cut from it"),
        ([{"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}],
         r"row 0: column 'messages' has no user \(or system\) turn before its last assistant turn"),
        ([{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}],
         r"row 0: column 'messages' has no user \(or system\) turn before its last assistant turn"),
        ([{"messages": "hi"}], r"row 0: column 'messages' must be a non-empty list of chat messages, got str"),
        ([{"prompt_ids": [1, 2]}, {"prompt_ids": [1, -2]}], r"row 1: column 'prompt_ids' holds id -2, not a token id"),
        ([{"prompt_ids": [1, 2]}, {"prompt_ids": [1, 5000]}],
         r"row 1: column 'prompt_ids' holds id 5000, outside the tokenizer's \d+ ids"),
        ([{"prompt_ids": [[1, 2]]}], r"row 0: column 'prompt_ids' must hold a flat list of ints"),
        ([{"prompt_ids": [1], "teacher_id": "a"}, {"prompt_ids": [2], "teacher_id": 7}],
         r"row 1: column 'teacher_id' must hold strings, got 7"),
    ],
)
def test_row_errors_name_the_column_and_the_row(tokenizer, tmp_path, rows, message):
    path = tmp_path / "rows.jsonl"  # the JSON loader takes columns that mix types (a Json column), as users' files do
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = datasets.load_dataset("json", data_files=str(path), split="train")
    with pytest.raises(ConfigError, match=message):
        tokenize_dataset(dataset, tokenizer)


def test_tokenizer_and_length_errors(tokenizer):
    dataset = datasets.Dataset.from_list([{"prompt": "Count to five please"}])
    with pytest.raises(ConfigError, match="train_dataset: a tokenizer is needed to tokenise the 'prompt' column"):
        tokenize_dataset(dataset, None)
    with pytest.raises(ConfigError, match=r"row 0: the prompt has \d+ tokens, more than max_prompt_tokens=2"):
        tokenize_dataset(dataset, tokenizer, max_prompt_tokens=2)
    with pytest.raises(ConfigError, match="max_prompt_tokens must be a positive int or None, got 0"):
        tokenize_dataset(dataset, tokenizer, max_prompt_tokens=0)


def test_prompt_messages_rule():
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert prompt_messages(turns, 0) == turns[:1]  # the last assistant turn is turn 1; turn 2 has no answer
    with pytest.raises(ConfigError, match=r"dataset: row 4: message 1 of column 'messages' must be a mapping"):
        prompt_messages([turns[0], "b"], 4)


# ------------------------------------------------------------------------------------------------ config fields


def test_dataset_config_fields_are_validated():
    base = {"model_name_or_path": "m"}
    config = AsyncDistillationConfig(**base)
    assert (config.dataset_config, config.dataset_train_split, config.dataset_test_split) == (None, "train", "test")
    for field, value, message in [
        ("dataset_train_split", "", "dataset_train_split must be a split name"),
        ("dataset_test_split", None, "dataset_test_split must be a split name"),
        ("dataset_config", 3, "dataset_config must be None or a non-empty string"),
        ("train_dataset", "", "train_dataset must be None or a non-empty string"),
        ("eval_dataset", ["rows"], "eval_dataset must be None or a non-empty string"),
    ]:
        with pytest.raises(ConfigError, match=message):
            AsyncDistillationConfig(**base, **{field: value})


# ------------------------------------------------------------------------------------------------ the trainer


def test_the_trainer_takes_a_dataset_object_or_a_folder_and_its_splits(tmp_path, tokenizer):
    from fastdistill.tiny import build_model, save_pretrained_dir, tiny_config
    from fastdistill.train.trainer import AsyncDistillationTrainer

    model = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=7)
    student_dir = save_pretrained_dir(model, tokenizer, tmp_path / "student")
    train = chat_rows(6)
    test = [{"prompt": chat("held out"), "teacher_id": "math"}, {"prompt": chat("also held out"),
                                                                 "teacher_id": "code"}]
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train), "validation": datasets.Dataset.from_list(test)}
                         ).save_to_disk(str(folder))
    settings = dict(model_name_or_path=str(student_dir), teacher_server_urls={"math": "http://127.0.0.1:9",
                                                                              "code": "http://127.0.0.1:10"},
                    weight_sync_backend="none", gradient_checkpointing=False, save_strategy="no")

    from_objects = AsyncDistillationTrainer(AsyncDistillationConfig(**settings, output_dir=str(tmp_path / "a")),
                                            train_dataset=datasets.Dataset.from_list(train),
                                            eval_dataset=datasets.Dataset.from_list(test))
    from_config = AsyncDistillationTrainer(AsyncDistillationConfig(
        **settings, output_dir=str(tmp_path / "b"), train_dataset=str(folder), eval_dataset=str(folder),
        dataset_test_split="validation"))
    for trainer in (from_objects, from_config):
        assert isinstance(trainer.rows, PromptTable) and list(trainer.rows) == tokenize_prompts(train, tokenizer)
        assert trainer.num_prompts == 6 and trainer.has_eval
        # routed (each keeps its teacher), with the optional answer column (absent here)
        assert list(trainer.evaluator.rows) == [{**row, "answer": None} for row in tokenize_prompts(test, tokenizer)]
    with pytest.raises(ConfigError, match=r"eval_dataset: .* has no split 'test'; its splits are \['train', "
                                          r"'validation'\]"):
        AsyncDistillationTrainer(AsyncDistillationConfig(**settings, output_dir=str(tmp_path / "c"),
                                                         train_dataset=str(folder), eval_dataset=str(folder)))
