"""Training text -> tokens (cached on disk) -> packed sequences -> batches by seed.

Default text: the standard library's `pydoc_data.topics` (English prose on
every CPython), one document per help topic; any UTF-8 file by path. The
topics repeat paragraphs (a fifth of the characters), so part of the default
text's held-out windows also occur in its training windows: its validation
loss is optimistic, a smoke check rather than a measure of generalisation.

Tokenizers: models trained from scratch (`LlamaConfig.tiny()/small()`, vocab
259) use `jmem.io.tokenizer.ByteTokenizer`: the 256 byte values are the ids
0..255, then BOS=256, EOS=257, PAD=258. No vocabulary file, no merges: any text round-trips exactly,
which is what a from-scratch model on a few hundred kilobytes needs. A real
model passes its own tokenizer (anything with `encode(str) -> list[int]`;
`bos_id`/`eos_id` are used as separators when present).

Packing: documents are joined as ``BOS doc EOS BOS doc EOS ...`` into one token
stream cut into windows of `seq + 1` tokens (inputs = window[:-1], targets =
window[1:]), so no position is padding. Windows are split into train and
validation sets once; train batches are a pure function of `(seed, step)`
(a fresh permutation of the windows per epoch), so a resumed run sees exactly
the batches an uninterrupted run would.

Example:
    >>> tok = ByteTokenizer()
    >>> ds = PackedDataset.from_text(default_text(), tok, seq=128)
    >>> batch = ds.batch(step=0, batch_size=8, seed=0)   # {"inputs", "targets", "mask"}
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

import numpy as np

from jmem.checks import check_int, is_number
from jmem.io.tokenizer import ByteTokenizer, GGUFTokenizer

BYTE_VOCAB = ByteTokenizer.vocab_size
BOS, EOS, PAD = ByteTokenizer.bos_id, ByteTokenizer.eos_id, ByteTokenizer.pad_id


ENCODE_PIECE = 1 << 18  # characters a tokenizer encodes at once (its per-token working memory is ~0.5 KB)


def text_pieces(text: str, size: int | None = None):
    """`text` in consecutive pieces of about `size` characters or more, each cut just before a newline that
    follows a letter: a boundary of every byte-level BPE pre-tokenizer split (GPT-2's and Llama 3's
    patterns end a letter run there and start the newline run afresh), so the pieces encode to the
    ids of the whole text. A text without such a newline past `size` stays one piece."""
    size = ENCODE_PIECE if size is None else size
    start = 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and not text[cut - 1].isalpha():
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _encode(tokenizer, text: str) -> np.ndarray:
    if type(tokenizer).encode is ByteTokenizer.encode:  # the ids are the bytes: no list of Python ints
        return np.frombuffer(text.encode("utf-8"), np.uint8)
    # BOS/EOS are added by the packer, so ask tokenizers that can add a BOS not to. A large file is encoded
    # in pieces: the tokenizer holds offsets and strings for every token of one call (~0.5 KB each).
    kw = {"add_bos": False} if hasattr(tokenizer, "add_bos") else {}
    split = text_pieces(text) if isinstance(tokenizer, GGUFTokenizer) else [text]  # byte-level BPE: see there
    pieces = [np.asarray(tokenizer.encode(piece, **kw), np.int32) for piece in split]
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def default_documents() -> list[str]:
    """The help topics of `pydoc_data.topics`, one document each, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def default_text() -> str:
    """All `pydoc_data.topics` values joined by blank lines."""
    return "\n\n".join(default_documents())


def data_name(path: str | os.PathLike | None, flag: str = "--data") -> str:
    """How messages name the text `load_documents(path, flag)` reads: `--data 'a.txt'` or "the default text"."""
    return "the default text" if path is None or str(path) == "default" else f"{flag} {str(path)!r}"


def load_documents(path: str | os.PathLike | None, flag: str = "--data") -> list[str]:
    """The documents of a UTF-8 text file (the whole file is one document), or the
    default text's documents when `path` is None or "default".

    Raises:
        ValueError: an empty path, or a missing, empty or non-UTF-8 file, named by `flag` (the option it
            came from).
    """
    if path is None or str(path) == "default":
        return default_documents()
    if not str(path).strip():  # `--data "$FILE"` with FILE unset: not a request for the default text
        raise ValueError(f"{flag} {str(path)!r} is empty; accepted: a text file path, or default (the standard "
                         "library's pydoc topics)")
    p = check_text_file(path, flag)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r}: {e.strerror.lower()}; {_ACCEPTED}") from None
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0  # a byte-order mark is not text
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:  # a binary file (e.g. a token-id .bin) would train on garbage
        at = bom + e.start
        raise ValueError(f"{flag} {str(path)!r}: not UTF-8 text (byte {at} is {raw[at]:#04x}); accepted: "
                         "a UTF-8 text file") from None
    if not text or text.isspace():  # (no stripped copy of a large text)
        raise ValueError(f"{flag} {str(path)!r}: the file is empty (no text but whitespace); accepted: a UTF-8 "
                         "text file with text")
    return [text]


_ACCEPTED = "accepted: a UTF-8 text file, or leave it unset for the default text (pydoc_data.topics)"


def check_text_file(path: str | os.PathLike, flag: str = "--data") -> pathlib.Path:
    """`path` as a Path when it names a regular file; else a ValueError naming `flag` and what is wrong
    (missing, a directory, a pipe or device, a name the system refuses). Reads nothing."""
    p = pathlib.Path(path).expanduser()
    try:
        if p.is_dir():
            problem = "is a directory"
        elif p.is_file():
            return p
        else:
            problem = "not a regular file" if p.exists() else "no such file"
    except OSError as e:  # a name too long, a folder that cannot be entered
        problem = e.strerror.lower()
    raise ValueError(f"{flag} {str(path)!r}: {problem}; {_ACCEPTED}")


def cache_dir() -> pathlib.Path:
    """`$JMEM_CACHE` (`~` expanded) or, when unset or empty, `~/.cache/jmem`."""
    return pathlib.Path(os.environ.get("JMEM_CACHE") or "~/.cache/jmem").expanduser()


def tokenizer_id(tokenizer) -> str:
    """A stable identity of a tokenizer for the cache key: its name and vocabulary size, its
    GGUF `tokenizer.*` fields when it keeps them (the vocabulary, merges and special ids), and
    how it encodes a probe of words, digits, whitespace, line breaks, every printable ASCII and
    Latin-1 character, and other non-ASCII text. Two tokenizers of one name and vocabulary size,
    without GGUF fields, that differ only on text outside the probe share a key: give them
    different `name`s, or tokenize with `cache=False`."""
    name = getattr(tokenizer, "name", None) or type(tokenizer).__name__
    vocab = getattr(tokenizer, "vocab_size", None)
    h = hashlib.sha256(f"{name}|{vocab}|".encode())
    for key, value in sorted((getattr(tokenizer, "metadata", None) or {}).items()):
        if key.startswith("tokenizer."):
            h.update(f"{key}={value!r}\x00".encode())
    for line in _PROBE.split("\n"):  # a line a tokenizer cannot encode (a narrow alphabet) counts as such
        try:
            ids = ",".join(map(str, _encode(tokenizer, line + "\n")))
        except Exception as e:  # noqa: BLE001 - any refusal is part of the identity, not an error here
            ids = type(e).__name__
        h.update(ids.encode() + b"|")
    return h.hexdigest()[:16]


_PROBE = ("The quick brown fox; 12345 67.890 Ünïcödé 漢字 🙂\n\tTab  two  spaces\r\n\n   indented\nEND\n"
          + " ".join(map(chr, range(33, 127))) + "\n" + " ".join(map(chr, range(161, 256))))
"""Text whose encoding tells tokenizers apart that share a name and vocabulary size."""


def tokenize_documents(docs: list[str] | str, tokenizer, *, bos: int | None, eos: int | None,
                       cache: bool = True) -> np.ndarray:
    """One stream ``[BOS] doc [EOS] ...`` of token ids, cached under `cache_dir()/tokens`: uint16
    when every id fits (two bytes per token in memory and on disk), else int32.

    The cache key hashes the text, the separators and `tokenizer_id`, so a
    different text or tokenizer never reads a stale file. A cache file that
    cannot be read, or holds what no tokenizer run wrote (not a 1-D array of
    ids, none at all, negative ids), is rebuilt; a cache folder that cannot
    be written is skipped.
    """
    docs = [docs] if isinstance(docs, str) else docs  # one document, not one per character
    if not isinstance(docs, (list, tuple)) or not all(isinstance(d, str) for d in docs):
        bad = docs if not isinstance(docs, (list, tuple)) else next(d for d in docs if not isinstance(d, str))
        raise ValueError(f"docs holds {bad!r:.60} ({type(bad).__name__}); accepted: a str or a list of str documents "
                         "(token ids: PackedDataset.from_tokens)")
    if not callable(getattr(tokenizer, "encode", None)):
        raise ValueError(f"tokenizer={tokenizer!r:.60}; accepted: a tokenizer with encode(text) -> ids, e.g. "
                         "jmem.io.tokenizer.ByteTokenizer() or a jmem.LM's .tokenizer")
    key = f"{_text_digest(docs)[:24]}-{tokenizer_id(tokenizer)}-{bos}-{eos}.npy"
    path = cache_dir() / "tokens" / key
    if cache:
        stream = _load_cached(path)
        if stream is not None:
            return stream
    head, tail = ([] if t is None else [np.asarray([t], np.min_scalar_type(t))] for t in (bos, eos))
    parts = []
    for d in docs:
        parts += [*head, _encode(tokenizer, d), *tail]
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int64)
    del parts
    fits = stream.size and 0 <= stream.min() and stream.max() < 2**16
    stream = stream.astype(np.uint16 if fits else np.int32, copy=False)
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
            np.save(tmp, stream)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home must not stop training
    return stream


def _text_digest(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:  # each document's length first: ["a\0b"] and ["a", "b"] differ
        b = d.encode("utf-8", errors="surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _load_cached(path: pathlib.Path) -> np.ndarray | None:
    """The cached stream at `path`, or None when there is none that a tokenizer run could have written."""
    try:
        if not path.is_file():
            return None
        stream = np.load(path)
    except (OSError, ValueError, EOFError):  # unreadable, or truncated by an interrupted write
        return None
    if stream.ndim != 1 or stream.dtype not in (np.uint16, np.int32) or not stream.size or stream.min() < 0:
        return None
    return stream


@dataclasses.dataclass(frozen=True)
class PackedDataset:
    """Fixed-length windows of a token stream, split into train and validation.

    Attributes:
        train: [n_train, seq + 1] windows (views of the token stream: no copy).
        valid: [n_valid, seq + 1] windows (may be empty).
        seq: model sequence length.
    """

    train: np.ndarray
    valid: np.ndarray
    seq: int
    # The last epochs' window orders by (seed, epoch): drawn once per epoch, not once per batch (a
    # permutation of 10M windows takes ~0.5 s).
    _orders: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_tokens(cls, stream: np.ndarray, seq: int, *, valid_fraction: float = 0.05,
                    names: tuple[str, str] = ("the text", "seq=")) -> "PackedDataset":
        """Pack `stream` into windows of `seq` + 1 tokens. `names` (the text, the seq prefix) name them
        in the too-short error, e.g. ("--data 'a.txt'", "--seq ")."""
        check_int("seq", seq, 1)
        stream = np.asarray(stream)
        if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
            raise ValueError(f"stream of dtype {stream.dtype} and shape {stream.shape}; accepted: a 1-D sequence of "
                             "integer token ids")
        if not is_number(valid_fraction) or not 0 <= valid_fraction < 1:
            raise ValueError(f"valid_fraction={valid_fraction!r}; accepted: 0 <= valid_fraction < 1")
        if stream.size and (stream.min() < 0 or stream.max() >= 2**31):  # batches hold int32 ids
            i = int(np.argmax((stream < 0) | (stream >= 2**31)))
            raise ValueError(f"stream[{i}]={stream[i]} is not a token id; accepted: integer ids in [0, 2**31)")
        n = (len(stream) - 1) // seq
        if n < 2:
            text, seq_name = names
            raise ValueError(f"{text} has {len(stream)} tokens: too short for two windows of {seq_name}{seq}; "
                             f"accepted: a text of at least {2 * seq + 1} tokens, or a smaller {seq_name.rstrip(' =')}")
        # Windows overlap by one token so each target follows its input; strided views, not copies.
        windows = np.lib.stride_tricks.sliding_window_view(stream, seq + 1)[::seq][:n]
        n_valid = int(n * valid_fraction) if valid_fraction > 0 else 0
        n_valid = min(max(n_valid, 1 if valid_fraction > 0 else 0), n - 1)
        return cls(train=windows[: n - n_valid], valid=windows[n - n_valid :], seq=seq)

    @classmethod
    def from_text(cls, docs: list[str] | str, tokenizer, seq: int, *, cache: bool = True, valid_fraction: float = 0.05,
                  names: tuple[str, str] = ("the text", "seq=")) -> "PackedDataset":
        """Tokenize (cached) and pack. `docs` is one string or a list of documents; `names` as `from_tokens`."""
        if isinstance(docs, str):
            docs = [docs]
        bos = getattr(tokenizer, "bos_id", None)
        eos = getattr(tokenizer, "eos_id", None)
        stream = tokenize_documents(docs, tokenizer, bos=bos, eos=eos, cache=cache)
        return cls.from_tokens(stream, seq, valid_fraction=valid_fraction, names=names)

    @property
    def num_tokens(self) -> int:
        """Tokens the windows cover (each window shares its last token with the next)."""
        return (len(self.train) + len(self.valid)) * self.seq + 1

    def digest(self) -> str:
        """SHA-256 of the windows' tokens and their split: equal for equal datasets, whatever the
        stream's integer type (a token cache written as int32 and a fresh uint16 stream agree)."""
        h = hashlib.sha256(f"{len(self.train)}|{len(self.valid)}|{self.seq}|".encode())
        for w in (self.train, self.valid):
            for i in range(0, len(w), 4096):  # a slice at a time: the windows are views of one stream
                h.update(w[i : i + 4096].astype("<i4").tobytes())
        return h.hexdigest()

    def _order(self, epoch: int, seed: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = np.random.default_rng([seed, epoch]).permutation(len(self.train))
        return self._orders[key]

    def batch(self, step: int, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
        """The train batch of `step`: a pure function of (step, batch_size, seed).

        Returns:
            {"inputs": i32[batch, seq], "targets": i32[batch, seq], "mask": f32[batch, seq]}
        """
        for name, value, least in (("step", step, 0), ("batch_size", batch_size, 1), ("seed", seed, 0)):
            check_int(name, value, least)
        n = len(self.train)
        start = step * batch_size
        rows = []
        epoch, pos = divmod(start, n)
        order = self._order(epoch, seed)
        while len(rows) < batch_size:
            take = min(batch_size - len(rows), n - pos)
            rows.extend(order[pos : pos + take])
            pos += take
            if pos == n:
                epoch, pos = epoch + 1, 0
                order = self._order(epoch, seed)
        return _as_batch(self.train[np.asarray(rows)])

    def eval_batches(self, batch_size: int, max_batches: int | None = None):
        """Validation batches in order; the last partial batch is dropped (fixed shapes)."""
        check_int("batch_size", batch_size, 1)
        n = len(self.valid) // batch_size
        if max_batches is not None:
            check_int("max_batches", max_batches, 0)
            n = min(n, max_batches)
        for i in range(n):
            yield _as_batch(self.valid[i * batch_size : (i + 1) * batch_size])


def _as_batch(w: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "inputs": w[:, :-1].astype(np.int32),
        "targets": w[:, 1:].astype(np.int32),
        "mask": np.ones(w[:, 1:].shape, np.float32),
    }
