"""Token files: `hspmd data prepare` writes Megatron's .bin/.idx plus a checksummed manifest,
streaming; TokenFiles reads them back; every bad input is one `hspmd: error:` line naming the file."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.cli import main as cli
from hspmd.runtime.data.prepare import load_tokenizer, prepare
from hspmd.runtime.data.tokens import DataError, TokenFiles, TokenWriter, paths

TEXT = "The first document.\nIt has two lines.\n\n\nThe second one, é and ü.\n\nThird\n"


def write(path, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def read_megatron_index(path: str):
    """The index as Megatron's reader sees it (struct layout of MMIDIDX version 1)."""
    with open(path, "rb") as f:
        magic, version, code, count, boundaries = struct.unpack("<9sQBQQ", f.read(34))
        lengths = np.frombuffer(f.read(4 * count), dtype="<i4")
        pointers = np.frombuffer(f.read(8 * count), dtype="<i8")
        docs = np.frombuffer(f.read(8 * boundaries), dtype="<i8")
        assert f.read() == b""
    return magic, version, code, lengths, pointers, docs


def test_bytes_round_trip_in_megatron_layout(tmp_path):
    manifest = prepare([write(tmp_path / "c.txt", TEXT)], str(tmp_path / "out" / "c"))
    files = TokenFiles(tmp_path / "out" / "c")
    texts = ["The first document.\nIt has two lines.\n", "The second one, é and ü.\n", "Third\n"]
    assert files.documents == 3 == manifest["documents"]
    assert [bytes(files.document(i).astype(np.uint8)).decode() for i in range(3)] == texts
    assert files.tokens == sum(len(t.encode()) for t in texts)
    magic, version, code, lengths, pointers, docs = read_megatron_index(paths(tmp_path / "out" / "c")[1])
    assert (magic, version, code) == (b"MMIDIDX\x00\x00", 1, 8)  # uint16
    assert lengths.tolist() == [len(t.encode()) for t in texts]
    assert pointers.tolist() == [0, 2 * lengths[0], 2 * (lengths[0] + lengths[1])]
    assert docs.tolist() == [0, 1, 2, 3]
    assert bytes(files.document(1, 4, 10).astype(np.uint8)) == texts[1].encode()[4:10]
    files.verify()


def test_lines_and_jsonl(tmp_path):
    prepare([write(tmp_path / "l.txt", "one\n\ntwo\nthree\n")], str(tmp_path / "l"), split="lines")
    files = TokenFiles(tmp_path / "l")
    assert [bytes(files.document(i).astype(np.uint8)).decode() for i in range(files.documents)] == ["one", "two", "three"]
    jsonl = write(tmp_path / "d.jsonl", "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["a b", "cd"])))
    prepare([jsonl], str(tmp_path / "j"))
    files = TokenFiles(tmp_path / "j.bin")
    assert [bytes(files.document(i).astype(np.uint8)).decode() for i in range(2)] == ["a b", "cd"]


def hf_tokenizer_dir(tmp_path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "first", "document", ".", "it", "has", "two", "lines", "second", "one", ","]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = tmp_path / "tok"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return str(directory)


def test_hugging_face_tokenizer_directory(tmp_path):
    directory = hf_tokenizer_dir(tmp_path)
    manifest = prepare([write(tmp_path / "c.txt", "the first document .\n\nit has two lines\n")], str(tmp_path / "h"),
                       tokenizer=directory)
    files = TokenFiles(tmp_path / "h")
    assert manifest["vocab"] == 12 and files.tokenizer == os.path.abspath(directory)
    assert files.document(0).tolist() == [1, 2, 3, 4] and files.document(1).tolist() == [5, 6, 7, 8]


def test_writer_round_trip(tmp_path_factory):
    """Random documents (empty ones skipped) and vocabularies: read back as written, or refused
    for an id beyond the vocabulary."""
    outcomes = {"round trip": 0, "refused": 0}

    @settings(max_examples=80, deadline=None)
    @given(st.lists(st.lists(st.integers(0, 70_000), max_size=40), min_size=1, max_size=12),
           st.one_of(st.just(70_001), st.integers(1, 70_001)))
    def check(documents, vocab):
        out = str(tmp_path_factory.mktemp("w") / "d")
        writer = TokenWriter(out, vocab)
        kept = [d for d in documents if d]
        try:
            for i, doc in enumerate(documents):
                writer.add(np.asarray(doc, dtype=np.int64), f"document {i}")
            writer.close()
        except DataError:
            writer.abort()
            assert not kept or max(max(d) for d in kept) >= vocab
            outcomes["refused"] += 1
            return
        files = TokenFiles(out)
        assert [files.document(i).tolist() for i in range(files.documents)] == kept
        assert files.dtype == (np.uint16 if vocab <= 65536 else np.int32)
        outcomes["round trip"] += 1

    check()
    assert outcomes["round trip"] >= 20 and outcomes["refused"] >= 5, outcomes


def test_streams_in_constant_memory(tmp_path):
    """Preparing 4 MB of text holds a few documents at a time, not the corpus."""
    paragraph = ("word " * 200 + "\n") * 3 + "\n"
    big = tmp_path / "big.txt"
    with open(big, "w", encoding="utf-8") as f:
        for _ in range(4 * 2**20 // len(paragraph)):
            f.write(paragraph)
    tracemalloc.start()
    try:
        manifest = prepare([str(big)], str(tmp_path / "big"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert manifest["tokens"] > 4_000_000
    assert peak < 1 * 2**20, f"prepare held {peak / 2**20:.1f} MiB for a 4 MiB corpus"


# ---- bad input: one `hspmd: error:` line naming the file ------------------------------------------


def error_of(argv, capsys) -> str:
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hspmd: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_missing_tokenizer(tmp_path, capsys):
    corpus = write(tmp_path / "c.txt", TEXT)
    assert "tokenizer /no/such/tok: no such directory" in error_of(
        ["data", "prepare", corpus, "--out", str(tmp_path / "o"), "--tokenizer", "/no/such/tok"], capsys)
    (tmp_path / "empty").mkdir()
    assert f"tokenizer {tmp_path / 'empty'}" in error_of(
        ["data", "prepare", corpus, "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "empty")], capsys)
    bad = tmp_path / "badtok"
    bad.mkdir()
    write(bad / "tokenizer.json", "{not json")
    assert f"{bad / 'tokenizer.json'}: cannot be read as a tokenizer" in error_of(
        ["data", "prepare", corpus, "--out", str(tmp_path / "o"), "--tokenizer", str(bad)], capsys)
    assert not os.path.exists(tmp_path / "o.json")


def test_token_id_beyond_the_vocabulary(tmp_path, capsys):
    corpus = write(tmp_path / "c.txt", "ok\n\nzzz\n")
    err = error_of(["data", "prepare", corpus, "--out", str(tmp_path / "o"), "--vocab", "120"], capsys)
    assert f"{corpus}:3" in err and "token id 122 is beyond the vocabulary of 120" in err
    with pytest.raises(DataError, match="beyond the vocabulary of 3"):
        prepare([write(tmp_path / "h.txt", "the first document\n")], str(tmp_path / "h"),
                tokenizer=hf_tokenizer_dir(tmp_path), vocab=3)


def test_bad_input_files(tmp_path, capsys):
    assert "nope.txt: no such input file" in error_of(["data", "prepare", str(tmp_path / "nope.txt"), "--out",
                                                        str(tmp_path / "o")], capsys)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"fine\n\ncaf\xe9\n")
    assert f"{latin}:3: not UTF-8" in error_of(["data", "prepare", str(latin), "--out", str(tmp_path / "o")], capsys)
    cut = write(tmp_path / "cut.jsonl", '{"text": "whole"}\n{"text": "cut sh')
    assert f"{cut}:2: not a JSON object" in error_of(["data", "prepare", cut, "--out", str(tmp_path / "o")], capsys)
    blank = write(tmp_path / "blank.txt", "\n\n  \n")
    assert "no document holds any token" in error_of(["data", "prepare", blank, "--out", str(tmp_path / "o")], capsys)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o.")]


def test_truncated_or_damaged_dataset(tmp_path, capsys):
    prefix = str(tmp_path / "d")
    prepare([write(tmp_path / "c.txt", TEXT)], prefix)
    bin_path, idx_path, manifest_path = paths(prefix)
    original = {p: open(p, "rb").read() for p in (bin_path, idx_path, manifest_path)}

    def damaged(path, data):
        for p, content in original.items():
            open(p, "wb").write(data if p == path else content)
        return error_of(["data", "inspect", prefix], capsys)

    assert f"{bin_path}: " in damaged(bin_path, original[bin_path][:-6]) and "truncated" in damaged(bin_path, b"")
    assert f"{idx_path}: does not match the sha256" in damaged(idx_path, original[idx_path][:-8])
    assert f"{manifest_path}: the manifest cannot be read" in damaged(manifest_path, original[manifest_path][:20])
    flipped = bytearray(original[bin_path])
    flipped[3] ^= 1
    for p, content in original.items():
        open(p, "wb").write(bytes(flipped) if p == bin_path else content)
    assert cli(["data", "inspect", prefix]) == 0  # same size: opening passes, --verify hashes it
    assert f"{bin_path}: does not match the sha256" in error_of(["data", "inspect", prefix, "--verify"], capsys)
    os.remove(manifest_path)
    assert f"{manifest_path}: no manifest" in error_of(["data", "inspect", prefix], capsys)


def test_failed_prepare_keeps_the_earlier_dataset(tmp_path):
    prefix = str(tmp_path / "d")
    prepare([write(tmp_path / "c.txt", TEXT)], prefix)
    before = TokenFiles(prefix).tokens
    with pytest.raises(DataError):
        prepare([write(tmp_path / "bad.txt", "fine\n\nzzz\n")], prefix, vocab=120)
    assert TokenFiles(prefix).tokens == before
    assert sorted(os.listdir(tmp_path)) == ["bad.txt", "c.txt", "d.bin", "d.idx", "d.json"]


def test_tokenizer_names():
    assert load_tokenizer("bytes").vocab == 256
