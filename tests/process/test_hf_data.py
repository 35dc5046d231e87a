"""Unit tests for kuangchao.workers.data.tokenized (with readers.py and encode.py): the
user's text, jsonl, parquet and chat files, tokenized once and cached beside the data."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kuangchao.platform.spec.jobspec import DataSection
from kuangchao.workers.data import encode, tokenized
from kuangchao.workers.data.readers import CACHE_FOLDER
from kuangchao.workers.data.tokenized import (
    IGNORE_INDEX,
    MaskedBatchSource,
    load_tokenized,
    tokenizer_vocab,
)
from kuangchao.workers.errors import DataError
from tests.hf_fixtures import VOCAB, chat_rows, stdlib_texts, tiny_tokenizer, write_datasets

SEQ = 32
N_DOCS = 40


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_datasets(tmp_path_factory.mktemp("data"), N_DOCS)


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def load(path: Path | str, tok_dir: Path, fmt: str | None = None, seq_len: int = SEQ,
         vocab_limit: int | None = VOCAB, roots: tuple[str, ...] | None = None, seed: int = 0,
         **data: object) -> tokenized.TokenizedData:
    section = DataSection(path=str(path), format=fmt, **data)
    return load_tokenized(section, str(tok_dir), seq_len, vocab_limit=vocab_limit, roots=roots,
                          seed=seed)


def copy_data(src: Path, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    if src.is_dir():
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".*"))
    else:
        shutil.copy(src, dest)
    return dest


def expected_stream(tok, texts: list[str]) -> np.ndarray:
    """Each document as [bos] + ids + [eos], packed."""
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return np.concatenate([[tok.bos_token_id, *d, tok.eos_token_id] for d in ids]).astype(np.uint32)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def forbid_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was tokenized again despite a cache")

    monkeypatch.setattr(encode, "load_tokenizer", fail)
    monkeypatch.setattr(encode, "tokenize", fail)


# --- formats ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_each_format_packs_the_documents_as_bos_ids_eos(fmt, tok, tok_dir, datasets) -> None:
    data = load(datasets[fmt], tok_dir, fmt)

    assert data.tokens.dtype == np.uint32 and isinstance(data.tokens, np.memmap)
    np.testing.assert_array_equal(data.tokens, expected_stream(tok, stdlib_texts(N_DOCS)))
    assert data.mask is None and data.eval_tokens is None and data.eval_mask is None
    assert data.meta["documents"] == N_DOCS and data.meta["tokens"] == len(data.tokens)
    assert data.meta["eval_documents"] == 0 and data.meta["format"] == fmt


def test_text_jsonl_and_parquet_give_identical_streams(tok_dir, datasets) -> None:
    streams = [np.asarray(load(datasets[f], tok_dir, f).tokens) for f in ("text", "jsonl", "parquet")]

    np.testing.assert_array_equal(streams[0], streams[1])
    np.testing.assert_array_equal(streams[0], streams[2])


def test_documents_are_separated_by_eos_then_bos(tok, tok_dir, datasets) -> None:
    tokens = np.asarray(load(datasets["jsonl"], tok_dir, "jsonl").tokens)

    eos_at = np.flatnonzero(tokens == tok.eos_token_id)
    assert len(eos_at) == N_DOCS and eos_at[-1] == len(tokens) - 1
    assert tokens[0] == tok.bos_token_id
    assert (tokens[eos_at[:-1] + 1] == tok.bos_token_id).all()
    first = tok.decode(tokens[1:eos_at[0]].tolist())
    assert first == stdlib_texts(1)[0]


def test_format_is_inferred_from_the_extension_when_unset(tok_dir, datasets) -> None:
    inferred = load(datasets["parquet"], tok_dir, None)

    assert inferred.meta["format"] == "parquet"
    np.testing.assert_array_equal(inferred.tokens, load(datasets["jsonl"], tok_dir, "jsonl").tokens)


def test_a_glob_and_a_folder_read_their_files_in_sorted_order(tok, tok_dir, tmp_path) -> None:
    texts = stdlib_texts(N_DOCS)
    parts = tmp_path / "parts"
    parts.mkdir()
    write_jsonl(parts / "b.jsonl", [{"text": t} for t in texts[20:]])
    write_jsonl(parts / "a.jsonl", [{"text": t} for t in texts[:20]])
    (parts / "notes.txt").write_text("not read: not a .jsonl file")

    by_glob = load(f"{parts}/*.jsonl", tok_dir, "jsonl")
    by_folder = load(parts, tok_dir, "jsonl")

    np.testing.assert_array_equal(by_glob.tokens, expected_stream(tok, texts))
    np.testing.assert_array_equal(by_folder.tokens, by_glob.tokens)
    assert by_glob.cache_dir.parent == parts / CACHE_FOLDER
    assert [f[0] for f in by_folder.meta["files"]] == ["a.jsonl", "b.jsonl"]


def test_a_text_folder_reads_subfolders_and_skips_hidden_files(tok, tok_dir, tmp_path) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.md").write_text("alpha")
    (folder / "sub" / "b.txt").write_text("beta")
    (folder / ".hidden").write_text("never")

    data = load(folder, tok_dir, "text", seq_len=2)

    np.testing.assert_array_equal(data.tokens, expected_stream(tok, ["alpha", "beta"]))


def test_max_bytes_stops_reading_and_cuts_the_last_document(tok, tok_dir, datasets) -> None:
    texts = stdlib_texts(N_DOCS)
    budget = len(texts[0].encode()) + len(texts[1].encode()) + 1500

    data = load(datasets["jsonl"], tok_dir, "jsonl", max_bytes=budget)

    cut = texts[2].encode()[:1500].decode()
    np.testing.assert_array_equal(data.tokens, expected_stream(tok, [*texts[:2], cut]))
    assert data.meta["bytes_read"] == budget and data.meta["max_bytes_reached"]


# --- chat ------------------------------------------------------------------------------


def test_chat_mask_marks_exactly_the_assistant_tokens(tok, tok_dir, datasets) -> None:
    data = load(datasets["chat"], tok_dir, "chat")

    rows = chat_rows(stdlib_texts(N_DOCS))
    rendered = tok.apply_chat_template([r["messages"] for r in rows], tokenize=True,
                                       return_dict=True, return_assistant_tokens_mask=True)
    bos = tok.bos_token_id  # the template writes no <s>; each row gets one, unmasked
    want_tokens = np.concatenate([[bos, *ids] for ids in rendered["input_ids"]])
    want_mask = np.concatenate([[0, *m] for m in rendered["assistant_masks"]])
    np.testing.assert_array_equal(data.tokens, want_tokens)
    np.testing.assert_array_equal(data.mask, want_mask)
    assert data.mask.dtype == np.uint8 and data.meta["targets"] == int(want_mask.sum())
    answers = tok.decode(np.asarray(data.tokens)[:len(rendered["input_ids"][0]) + 1]
                         [np.asarray(data.mask[:len(rendered["input_ids"][0]) + 1]) == 1].tolist())
    assert answers == rows[0]["messages"][1]["content"] + "</s>"


def test_masked_batches_put_ignore_index_on_prompt_targets(tok_dir, datasets) -> None:
    data = load(datasets["chat"], tok_dir, "chat")
    source = MaskedBatchSource(data.tokens, data.mask, SEQ, seed=3)

    x, y = source.get(range(0, 16))

    starts = np.array([source.order.offset(g) for g in range(16)])
    at = starts[:, None] + np.arange(SEQ + 1)
    tokens, mask = np.asarray(data.tokens, dtype=np.int64)[at], np.asarray(data.mask)[at]
    np.testing.assert_array_equal(x.numpy(), tokens[:, :-1])
    want_y = np.where(mask[:, 1:] == 1, tokens[:, 1:], IGNORE_INDEX)
    np.testing.assert_array_equal(y.numpy(), want_y)
    assert x.dtype == y.dtype == torch.int64
    assert (y == IGNORE_INDEX).any() and (y != IGNORE_INDEX).any()


def test_masked_batches_without_a_mask_match_batch_source(tok_dir, datasets) -> None:
    from kuangchao.workers.data.sampling import BatchSource

    data = load(datasets["jsonl"], tok_dir, "jsonl")
    x, y = MaskedBatchSource(data.tokens, None, SEQ, 1).get(range(5, 9))
    bx, by = BatchSource(data.tokens, SEQ, 1).get(range(5, 9))

    assert (x == bx).all() and (y == by).all()


def test_a_chat_template_without_generation_marks_is_refused(tok_dir, tmp_path, datasets) -> None:
    plain = tmp_path / "tok"
    shutil.copytree(tok_dir, plain)
    (plain / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}")

    with pytest.raises(DataError, match="marks no assistant tokens") as err:
        load(datasets["chat"], plain, "chat")
    assert "data.tokenizer" in str(err.value) and "generation" in str(err.value)


# --- cache -----------------------------------------------------------------------------


def test_a_second_load_reuses_the_cache_without_tokenizing(tok_dir, datasets, tmp_path,
                                                           monkeypatch) -> None:
    path = copy_data(datasets["jsonl"], tmp_path / "d")
    first = load(path, tok_dir, "jsonl", eval_fraction=0.2)
    assert first.cache_dir.parent == tmp_path / "d" / CACHE_FOLDER
    assert sorted(p.name for p in first.cache_dir.iterdir()) == [
        "eval_tokens.u32", "meta.json", "tokens.u32"]

    forbid_tokenizing(monkeypatch)
    second = load(path, tok_dir, "jsonl", eval_fraction=0.2)

    assert second.cache_dir == first.cache_dir and second.meta == first.meta
    np.testing.assert_array_equal(second.tokens, first.tokens)
    np.testing.assert_array_equal(second.eval_tokens, first.eval_tokens)


def test_changing_the_data_or_a_setting_makes_a_new_key(tok_dir, datasets, tmp_path) -> None:
    path = copy_data(datasets["jsonl"], tmp_path / "d")
    first = load(path, tok_dir, "jsonl")
    with path.open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")

    edited = load(path, tok_dir, "jsonl")
    other_budget = load(path, tok_dir, "jsonl", max_bytes=50_000)

    assert len({first.cache_dir, edited.cache_dir, other_budget.cache_dir}) == 3
    assert edited.meta["documents"] == first.meta["documents"] + 1


def test_a_failed_build_leaves_no_cache_folder(tok_dir, datasets, tmp_path, monkeypatch) -> None:
    path = copy_data(datasets["jsonl"], tmp_path / "d")
    real_add = encode._Split.add
    calls = []

    def add_then_fail(self, *args, **kwargs):
        real_add(self, *args, **kwargs)  # something is on disk when the build dies
        calls.append(1)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(encode._Split, "add", add_then_fail)
    with pytest.raises(DataError, match="cannot write the tokenized cache"):
        load(path, tok_dir, "jsonl")
    assert calls
    assert [p for p in (tmp_path / "d" / CACHE_FOLDER).iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(encode._Split, "add", real_add)
    assert load(path, tok_dir, "jsonl").meta["documents"] == N_DOCS


def test_a_broken_cache_folder_is_rebuilt(tok_dir, datasets, tmp_path) -> None:
    path = copy_data(datasets["jsonl"], tmp_path / "d")
    good = load(path, tok_dir, "jsonl")
    with open(good.cache_dir / "tokens.u32", "r+b") as f:
        f.truncate(8)  # sizes no longer match meta.json

    again = load(path, tok_dir, "jsonl")

    assert again.cache_dir == good.cache_dir and again.meta["tokens"] == good.meta["tokens"]
    assert (again.cache_dir / "tokens.u32").stat().st_size == 4 * good.meta["tokens"]


def test_the_rename_loser_uses_the_winners_cache(tok_dir, datasets, tmp_path, monkeypatch) -> None:
    path = copy_data(datasets["jsonl"], tmp_path / "d")
    winner = load(path, tok_dir, "jsonl")
    monkeypatch.setattr(tokenized, "_find_cache", lambda parents, key: None)  # both raced

    loser = load(path, tok_dir, "jsonl")

    assert loser.cache_dir == winner.cache_dir
    assert sorted(p.name for p in (tmp_path / "d" / CACHE_FOLDER).iterdir()
                  if not p.name.endswith(".lock")) == [winner.cache_dir.name]


def test_concurrent_loads_build_one_cache(tok_dir, datasets, tmp_path) -> None:
    path = copy_data(datasets["parquet"], tmp_path / "d")
    results: list[object] = []

    def run() -> None:
        try:
            results.append(load(path, tok_dir, "parquet").cache_dir)
        except Exception as exc:  # pragma: no cover - reported below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    assert len(results) == 3 and len(set(results)) == 1 and isinstance(results[0], Path)
    assert [p.name for p in (tmp_path / "d" / CACHE_FOLDER).iterdir()
            if not p.name.endswith(".lock")] == [results[0].name]


def test_an_unwritable_data_folder_falls_back_to_the_user_cache(tok_dir, datasets, tmp_path,
                                                                 cache_home, monkeypatch) -> None:
    path = copy_data(datasets["jsonl"], tmp_path / "d")
    (tmp_path / "d" / CACHE_FOLDER).write_text("a file where the cache folder would go")

    data = load(path, tok_dir, "jsonl")

    assert data.cache_dir.parent == cache_home / "kuangchao" / "tokenized"
    forbid_tokenizing(monkeypatch)
    assert load(path, tok_dir, "jsonl").cache_dir == data.cache_dir


# --- eval split ------------------------------------------------------------------------


def test_eval_split_holds_out_whole_documents_deterministically(tok, tok_dir, datasets,
                                                                tmp_path) -> None:
    texts = stdlib_texts(N_DOCS)
    data = load(datasets["jsonl"], tok_dir, "jsonl", eval_fraction=0.25, seed=7)

    held = [i for i in range(N_DOCS) if encode.held_out(7, i, 0.25)]
    assert 0 < len(held) < N_DOCS
    np.testing.assert_array_equal(data.eval_tokens, expected_stream(tok, [texts[i] for i in held]))
    np.testing.assert_array_equal(
        data.tokens, expected_stream(tok, [t for i, t in enumerate(texts) if i not in held]))
    assert data.meta["eval_documents"] == len(held)
    assert data.meta["documents"] == N_DOCS - len(held)

    elsewhere = load(copy_data(datasets["jsonl"], tmp_path / "d"), tok_dir, "jsonl",
                     eval_fraction=0.25, seed=7)
    np.testing.assert_array_equal(elsewhere.eval_tokens, data.eval_tokens)
    reseeded = load(datasets["jsonl"], tok_dir, "jsonl", eval_fraction=0.25, seed=8)
    assert reseeded.meta["eval_documents"] != len(held) or not np.array_equal(
        reseeded.eval_tokens, data.eval_tokens)


def test_chat_eval_split_carries_its_mask(tok_dir, datasets) -> None:
    data = load(datasets["chat"], tok_dir, "chat", eval_fraction=0.25)

    assert data.eval_mask is not None and len(data.eval_mask) == len(data.eval_tokens)
    assert data.meta["eval_targets"] == int(np.count_nonzero(data.eval_mask)) > 0


def test_an_eval_fraction_that_holds_out_nothing_is_refused(tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "two.jsonl", [{"text": "first document " * 20},
                                                {"text": "second document " * 20}])
    seed = next(s for s in range(100) if not any(encode.held_out(s, i, 0.01) for i in range(2)))

    with pytest.raises(DataError, match="data.eval_fraction: .* at least one document"):
        load(path, tok_dir, "jsonl", seq_len=4, eval_fraction=0.01, seed=seed)
    assert [p for p in (tmp_path / CACHE_FOLDER).iterdir() if not p.name.endswith(".lock")] == []


# --- errors ----------------------------------------------------------------------------


def test_a_missing_path_names_data_path(tok_dir, tmp_path) -> None:
    with pytest.raises(DataError, match=r"data.path: '.*nowhere.jsonl' does not exist"):
        load(tmp_path / "nowhere.jsonl", tok_dir, "jsonl")


def test_a_glob_that_matches_nothing_names_data_path(tok_dir, tmp_path) -> None:
    with pytest.raises(DataError, match="data.path: the pattern .* matches no"):
        load(f"{tmp_path}/*.jsonl", tok_dir, "jsonl")


def test_a_row_without_the_field_lists_its_keys(tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "fine"}, {"body": "x", "id": 2}])

    with pytest.raises(DataError) as err:
        load(path, tok_dir, "jsonl")
    message = str(err.value)
    assert message.startswith("data.field: ") and f"{path}:2" in message
    assert "'text'" in message and "body, id" in message


def test_a_parquet_file_without_the_column_lists_its_columns(tok_dir, datasets) -> None:
    with pytest.raises(DataError, match=r"data.field: .* no column 'body' \(its columns: text, id\)"):
        load(datasets["parquet"], tok_dir, "parquet", field="body")


def test_an_invalid_json_line_names_file_and_line(tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, "", '{"text": "unterminated'])

    with pytest.raises(DataError, match=rf"data.path: {path}:3 is not valid JSON"):
        load(path, tok_dir, "jsonl")


def test_a_chat_row_without_messages_names_the_row(tok_dir, tmp_path) -> None:
    rows = chat_rows(stdlib_texts(2))
    path = write_jsonl(tmp_path / "chat.jsonl", [rows[0], {"prompt": "hi", "answer": "hello"}])

    with pytest.raises(DataError, match=rf"{path}:2 has no 'messages' \(its keys: prompt, answer\)"):
        load(path, tok_dir, "chat")


def test_chat_messages_of_the_wrong_shape_are_refused(tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "text": "hi"}]}])

    with pytest.raises(DataError, match=rf"{path}:1 is not a non-empty list of \{{role, content\}}"):
        load(path, tok_dir, "chat")


def test_a_tokenizer_larger_than_the_embeddings_is_refused(tok_dir, datasets) -> None:
    assert tokenizer_vocab(str(tok_dir)) == VOCAB

    with pytest.raises(DataError, match=rf"data.tokenizer: the tokenizer's vocabulary \({VOCAB}\) "
                                        r"exceeds the model's embeddings \(100\)"):
        load(datasets["jsonl"], tok_dir, "jsonl", vocab_limit=100)
    section = DataSection(path=str(datasets["jsonl"]), format="jsonl")
    with pytest.raises(DataError, match=r"^model.path: the tokenizer's vocabulary"):
        load_tokenized(section, str(tok_dir), SEQ, vocab_limit=100, roots=None,
                       tokenizer_field="model.path")


def test_a_missing_tokenizer_folder_names_the_setting(tmp_path, datasets) -> None:
    with pytest.raises(DataError, match="data.tokenizer: '.*' is not a folder"):
        load(datasets["jsonl"], tmp_path / "no-tokenizer", "jsonl")


def test_too_few_tokens_for_seq_len_is_refused(tok_dir, datasets) -> None:
    with pytest.raises(DataError, match=r"fewer than model.seq_len \+ 2"):
        load(datasets["jsonl"], tok_dir, "jsonl", seq_len=10_000_000)


def test_a_path_outside_the_roots_is_refused(tok_dir, datasets, tmp_path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    os.symlink(datasets["jsonl"], allowed / "link.jsonl")

    with pytest.raises(DataError, match="leads outside the folders jobs may read"):
        load(allowed / "link.jsonl", tok_dir, "jsonl", roots=(str(allowed),))
    inside = load(datasets["jsonl"], tok_dir, "jsonl", roots=(str(datasets["jsonl"].parent),))
    assert inside.meta["documents"] == N_DOCS


def test_every_file_is_permitted_before_it_is_read(tok_dir, tmp_path, monkeypatch) -> None:
    from kuangchao.workers.data import corpus

    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(f"document {name} " * 10)
    asked: list[str] = []
    monkeypatch.setattr(corpus, "_read_guard", asked.append)

    load(folder, tok_dir, "text", seq_len=4)

    assert str(folder / "a.txt") in asked and str(folder / "b.txt") in asked
