"""Data: byte tokenizer, cached tokens, packing, deterministic batches."""

import pathlib
import re

import numpy as np
import pytest

from jmem.data import (BOS, EOS, ByteTokenizer, PackedDataset, default_documents, default_text, load_documents,
                       tokenize_documents, tokenizer_id)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JMEM_CACHE", str(tmp_path / "cache"))


def test_default_text_is_pydoc_topics():
    from pydoc_data.topics import topics

    docs = default_documents()
    assert len(docs) == len(topics) and sorted(docs) == sorted(topics.values())
    assert len(default_text()) > 100_000


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    s = "héllo\n\tworld — ∑ 😀"
    ids = tok.encode(s)
    assert max(ids) < 256 and tok.decode(ids) == s
    assert tok.decode(ids + [BOS, EOS]) == s


class CountingTokenizer(ByteTokenizer):
    calls = 0

    def encode(self, text, add_bos=None):
        CountingTokenizer.calls += 1
        return super().encode(text, add_bos)


def test_cache_dir_expands_home_and_reads_empty_as_unset(monkeypatch):
    """JMEM_CACHE="" cached into the working directory, and "~/c" into a folder named "~" there."""
    from jmem.data import cache_dir

    home = pathlib.Path.home()
    monkeypatch.setenv("JMEM_CACHE", "")
    assert cache_dir() == home / ".cache" / "jmem"
    monkeypatch.setenv("JMEM_CACHE", "~/c")
    assert cache_dir() == home / "c"


def test_tokens_are_cached_on_disk(tmp_path):
    docs = ["alpha beta gamma " * 50, "delta epsilon " * 80]
    tok = CountingTokenizer()
    a = PackedDataset.from_text(docs, tok, seq=16)
    files = list((tmp_path / "cache" / "tokens").glob("*.npy"))
    assert len(files) == 1
    calls = CountingTokenizer.calls
    tokenizer_id(tok)
    probe = CountingTokenizer.calls - calls
    b = PackedDataset.from_text(docs, tok, seq=16)
    # Only the tokenizer-identity probe runs; the documents are read from the cache.
    assert CountingTokenizer.calls == calls + 2 * probe
    np.testing.assert_array_equal(a.train, b.train)
    PackedDataset.from_text(docs + ["more"], tok, seq=16)  # other text: another file
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 2


class NewlineAsSpaceTokenizer(ByteTokenizer):
    """ByteTokenizer's name, vocabulary and encoding of plain words; not of line breaks."""

    def encode(self, text, add_bos=None):
        return super().encode(text.replace("\n", " "), add_bos)


def test_cache_key_tells_apart_tokenizers_and_document_lists(tmp_path):
    docs = ["line one\nline two\n" * 20]
    plain = tokenize_documents(docs, ByteTokenizer(), bos=BOS, eos=EOS)
    other = tokenize_documents(docs, NewlineAsSpaceTokenizer(), bos=BOS, eos=EOS)
    assert 10 in plain and 10 not in other  # not the first tokenizer's cached stream
    one = tokenize_documents(["x\x00y"], ByteTokenizer(), bos=BOS, eos=EOS)
    two = tokenize_documents(["x", "y"], ByteTokenizer(), bos=BOS, eos=EOS)
    assert len(one) == 5 and len(two) == 6


def test_cache_key_tells_apart_tokenizers_differing_on_one_character(tmp_path):
    """Tokenizers that differ on a letter the probe text lacked ('z') shared a cache file."""
    class OneLetter(ByteTokenizer):
        name = "ByteTokenizer"  # the same name and vocabulary size: only the encoding tells them apart

        def encode(self, text, add_bos=None):
            return [self.vocab_size - 1 if i == ord("z") else i for i in super().encode(text, add_bos)]

    docs = ["zebra zone " * 20]
    plain = tokenize_documents(docs, ByteTokenizer(), bos=BOS, eos=EOS)
    other = tokenize_documents(docs, OneLetter(), bos=BOS, eos=EOS)
    assert plain[1] == ord("z") and other[1] == ByteTokenizer.vocab_size - 1


class AsciiOnlyTokenizer(ByteTokenizer):
    """A narrow alphabet: refuses text it has no tokens for."""

    def encode(self, text, add_bos=None):
        if not text.isascii():
            raise KeyError(next(c for c in text if not c.isascii()))
        return super().encode(text, add_bos)


def test_a_tokenizer_with_a_narrow_alphabet_is_cached_too():
    stream = tokenize_documents(["plain ascii text " * 10], AsciiOnlyTokenizer(), bos=BOS, eos=EOS)
    assert len(stream) == 17 * 10 + 2


def test_empty_cache_file_is_rebuilt(tmp_path):
    docs = ["some words " * 30]
    stream = tokenize_documents(docs, ByteTokenizer(), bos=BOS, eos=EOS)
    (cached,) = (tmp_path / "cache" / "tokens").glob("*.npy")
    cached.write_bytes(b"")  # an unflushed write after a power cut
    np.testing.assert_array_equal(tokenize_documents(docs, ByteTokenizer(), bos=BOS, eos=EOS), stream)
    assert cached.stat().st_size > 0


def test_packing_shifts_targets_and_separates_documents():
    docs = ["abc" * 40, "xyz" * 40]
    ds = PackedDataset.from_text(docs, ByteTokenizer(), seq=8, valid_fraction=0.1)
    stream = np.concatenate([[BOS], list(b"abc" * 40), [EOS], [BOS], list(b"xyz" * 40), [EOS]])
    all_w = np.concatenate([ds.train, ds.valid])
    np.testing.assert_array_equal(all_w[:, :-1].reshape(-1), stream[: all_w.shape[0] * 8])
    b = ds.batch(0, 4, seed=0)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert b["inputs"].dtype == np.int32 and b["mask"].shape == (4, 8)
    assert len(ds.valid) >= 1 and len(ds.train) + len(ds.valid) == (len(stream) - 1) // 8


def test_batches_are_a_function_of_seed_and_step():
    ds = PackedDataset.from_text(default_documents()[:40], ByteTokenizer(), seq=32)
    a = [ds.batch(s, 8, seed=3)["inputs"] for s in range(5)]
    b = [ds.batch(s, 8, seed=3)["inputs"] for s in (4, 2, 0, 1, 3)]
    for s, x in zip((4, 2, 0, 1, 3), b):
        np.testing.assert_array_equal(a[s], x)
    assert not np.array_equal(ds.batch(0, 8, seed=4)["inputs"], a[0])
    # One epoch visits every train window exactly once (random tokens: every window differs, so rows
    # compare as a multiset; the text repeats windows, whose distinct count missed a window drawn twice).
    ds = PackedDataset.from_tokens(np.random.default_rng(0).integers(0, 50_000, 20 * 32 + 1), seq=32)
    n = len(ds.train)
    rows = np.concatenate([ds.batch(s, 1, seed=3)["inputs"] for s in range(n)])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, ds.train[:, :-1].tolist()))


def test_file_input_and_errors(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("some text\n" * 100)
    assert load_documents(str(p)) == ["some text\n" * 100]
    assert load_documents("default") == default_documents()
    for empty in ("", " "):  # `--text "$FILE"` with FILE unset trained on the default text without a word
        with pytest.raises(ValueError, match=f"^--text {empty!r} is empty; accepted: a text file path, or default"):
            load_documents(empty, "--text")
    with pytest.raises(ValueError, match="no such file"):
        load_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="is a directory; accepted: a UTF-8 text file"):
        load_documents(str(tmp_path))
    binary = tmp_path / "train.bin"
    binary.write_bytes(b"token ids \x00\x01\xff\xfe")
    with pytest.raises(ValueError, match=r"--text '.*train.bin': not UTF-8 text \(byte 12 is 0xff\); accepted: a "
                                         "UTF-8 text file"):
        load_documents(str(binary), "--text")
    with pytest.raises(ValueError, match="too short for two windows of seq=64; accepted: a text of at least 129 "
                                         "tokens, or a smaller seq"):
        PackedDataset.from_text("tiny", ByteTokenizer(), seq=64)
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n")
    with pytest.raises(ValueError, match=r"the file is empty \(no text but whitespace\)"):
        load_documents(str(blank))
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello")
    assert load_documents(str(bom)) == ["hello"]


def test_batch_arguments_are_checked():
    ds = PackedDataset.from_tokens(np.arange(200) % 7, 8)
    for kw, message in [(dict(step=0, batch_size=0), "batch_size=0; accepted: an integer >= 1"),
                        (dict(step=0, batch_size=-3), "batch_size=-3; accepted"),
                        (dict(step=-1, batch_size=2), "step=-1; accepted: an integer >= 0"),
                        (dict(step=1.5, batch_size=2), "step=1.5; accepted"),
                        (dict(step=0, batch_size=2, seed=-1), "seed=-1; accepted: an integer >= 0")]:
        with pytest.raises(ValueError, match=message):
            ds.batch(**kw)
    with pytest.raises(ValueError, match="batch_size=0"):
        next(ds.eval_batches(0))
    with pytest.raises(ValueError, match="max_batches=-1; accepted: an integer >= 0"):
        next(ds.eval_batches(2, max_batches=-1))
    for stream, seq, message in [(np.arange(200) % 7, 2.5, "seq=2.5; accepted: an integer >= 1"),
                                 (np.arange(200) % 7, True, "seq=True"),
                                 (np.linspace(0, 1, 200), 8, "dtype float64 .* accepted: a 1-D sequence of integer"),
                                 (np.zeros((2, 100), np.int32), 8, r"shape \(2, 100\)")]:
        with pytest.raises(ValueError, match=message):
            PackedDataset.from_tokens(stream, seq)
    assert PackedDataset.from_tokens(list(range(100)), 8).seq == 8  # a list of ids is a stream too
    for fraction in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"valid_fraction={fraction}; accepted: 0 <= valid_fraction < 1"):
            PackedDataset.from_tokens(np.arange(200) % 7, 8, valid_fraction=fraction)
    assert ds.batch(3, 2)["inputs"].shape == (2, 8)


def test_token_ids_outside_int32_and_a_string_fraction_are_refused():
    """Ids >= 2**31 wrapped to int32 in batches (2**33 became 0) and negative ids packed; valid_fraction="0.1"
    was a raw comparison TypeError."""
    for stream, bad in ((np.array([2**33] * 100), f"stream[0]={2**33}"),
                        (np.r_[np.arange(50), -3, np.arange(50)], "stream[50]=-3"),
                        (np.r_[np.arange(50), 2**31], f"stream[50]={2**31}")):
        with pytest.raises(ValueError, match=rf"^{re.escape(bad)} is not a token id; accepted: integer ids in "
                                             r"\[0, 2\*\*31\)$"):
            PackedDataset.from_tokens(stream, 8)
    assert PackedDataset.from_tokens(np.r_[np.arange(50), 2**31 - 1], 8).num_tokens == 49
    for fraction in ("0.1", True, None):
        with pytest.raises(ValueError, match=rf"^valid_fraction={re.escape(repr(fraction))}; accepted: 0 <= "):
            PackedDataset.from_tokens(np.arange(200) % 7, 8, valid_fraction=fraction)


def test_from_text_refuses_what_is_not_text_or_a_tokenizer():
    """`from_text(text, None, 8)` and `from_text([1, 2], tok, 8)` were AttributeErrors inside."""
    with pytest.raises(ValueError, match=r"^tokenizer=None; accepted: a tokenizer with encode\(text\) -> ids"):
        PackedDataset.from_text("some text", None, 8, cache=False)
    for docs, shown in (([1, 2], "1 (int)"), (b"text", "b'text' (bytes)"), (["a", None], "None (NoneType)")):
        with pytest.raises(ValueError, match=rf"^docs holds {re.escape(shown)}; accepted: a str or a list of str"):
            PackedDataset.from_text(docs, ByteTokenizer(), 8, cache=False)


def test_a_text_file_that_cannot_be_opened_is_one_error(tmp_path):
    """A pipe, a name the system refuses, a BOM before a bad byte: one line naming the value, the right byte."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"^--data '.*pipe': not a regular file; accepted: a UTF-8 text file"):
        load_documents(str(fifo))
    long_name = str(tmp_path / ("a" * 300))
    with pytest.raises(ValueError, match=r"^--data '.*aaaa': file name too long; accepted: a UTF-8 text file"):
        load_documents(long_name)
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfabcdef\xffgh")
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 9 is 0xff\)"):
        load_documents(str(bom))


def test_a_cache_that_cannot_be_read_or_holds_no_stream_is_rebuilt(tmp_path, monkeypatch):
    import pathlib

    docs = ["some words " * 30]
    stream = tokenize_documents(docs, ByteTokenizer(), bos=BOS, eos=EOS)
    assert stream.dtype == np.uint16  # byte ids fit two bytes
    (cached,) = (tmp_path / "cache" / "tokens").glob("*.npy")
    for bad in (np.zeros((0,), np.uint16), np.full(40, -3, np.int32), np.zeros((4, 4), np.int32)):
        np.save(cached, bad)  # none of these is a stream of byte-tokenizer ids
        np.testing.assert_array_equal(tokenize_documents(docs, ByteTokenizer(), bos=BOS, eos=EOS), stream)
    is_file = pathlib.Path.is_file

    def no_access(self):  # a cache folder this user may not enter (root's home under `docker --user`)
        if "cache" in self.parts:
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(pathlib.Path, "is_file", no_access)
    np.testing.assert_array_equal(tokenize_documents(docs, ByteTokenizer(), bos=BOS, eos=EOS), stream)


def test_windows_are_views_of_the_stream_and_count_its_tokens():
    stream = (np.arange(100) % 7).astype(np.uint16)
    ds = PackedDataset.from_tokens(stream, 8)
    assert np.shares_memory(ds.train, stream) and np.shares_memory(ds.valid, stream)
    assert ds.num_tokens == 12 * 8 + 1  # 12 windows of 8, the last target one past them
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.valid])[:, :-1].reshape(-1), stream[:96])
    other = stream.copy()
    other[50] += 1
    assert ds.digest() == PackedDataset.from_tokens(stream.astype(np.int32), 8).digest() != \
        PackedDataset.from_tokens(other, 8).digest()  # an int32 stream (an older token cache) of the same ids


def test_a_tokenizer_without_bos_or_eos_packs_its_ids_alone():
    class Plain:  # `encode` and nothing else: no separators
        def encode(self, text):
            return [ord(c) % 256 for c in text]

    ds = PackedDataset.from_text(["some text " * 20], Plain(), 8, cache=False)
    np.testing.assert_array_equal(ds.train[0], [ord(c) for c in "some text"])
    assert tokenize_documents(["ab"], Plain(), bos=None, eos=7, cache=False).tolist() == [97, 98, 7]


def test_a_large_text_is_encoded_in_pieces_that_give_the_whole_texts_ids(monkeypatch):
    """The tokenizer holds ~0.5 KB per token of one call (a 5 MB file took 682 MB): pieces cut before a
    newline that follows a letter are a boundary of the byte-level BPE pre-tokenizer, so they change no id."""
    import jmem.data as data
    from jmem.io.gguf import read_gguf
    from jmem.io.tokenizer import GGUFTokenizer
    from jmem.lm import packaged_model_path

    try:
        path = packaged_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = GGUFTokenizer(read_gguf(path).metadata)
    text = "\n\n".join(data.default_documents()[:40]) + "\n 12\n\n\t x!\n\n" + "word\n" * 200
    pieces = list(data.text_pieces(text, 500))
    assert len(pieces) > 20 and "".join(pieces) == text
    assert all(p.startswith("\n") and q[-1].isalpha() for q, p in zip(pieces, pieces[1:]))
    monkeypatch.setattr(data, "ENCODE_PIECE", 500)
    np.testing.assert_array_equal(data._encode(tok, text), tok.encode(text, add_bos=False))
