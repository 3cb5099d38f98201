"""Training text -> tokens (cached on disk) -> packed sequences -> batches by seed.

Default text: the standard library's `pydoc_data.topics` (English prose on
every CPython), one document per help topic; any UTF-8 file by path.

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

from jmem.checks import check_int
from jmem.io.tokenizer import ByteTokenizer

BYTE_VOCAB = ByteTokenizer.vocab_size
BOS, EOS, PAD = ByteTokenizer.bos_id, ByteTokenizer.eos_id, ByteTokenizer.pad_id


def _encode(tokenizer, text: str) -> list[int]:
    # BOS/EOS are added by the packer, so ask tokenizers that can add a BOS not to.
    if hasattr(tokenizer, "add_bos"):
        return list(tokenizer.encode(text, add_bos=False))
    return list(tokenizer.encode(text))


def default_documents() -> list[str]:
    """The help topics of `pydoc_data.topics`, one document each, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def default_text() -> str:
    """All `pydoc_data.topics` values joined by blank lines."""
    return "\n\n".join(default_documents())


def load_documents(path: str | os.PathLike | None, flag: str = "--data") -> list[str]:
    """The documents of a UTF-8 text file (the whole file is one document), or the
    default text's documents when `path` is None or "default".

    Raises:
        ValueError: a missing, empty or non-UTF-8 file, named by `flag` (the option it came from).
    """
    if path is None or str(path) in ("", "default"):
        return default_documents()
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; accepted: a UTF-8 text file, or leave it unset "
                         "for the default text (pydoc_data.topics)")
    if not p.is_file():
        raise ValueError(f"{flag} {str(path)!r}: no such file; accepted: a UTF-8 text file, or leave it unset "
                         "for the default text (pydoc_data.topics)")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark is not text
    except UnicodeDecodeError as e:  # a binary file (e.g. a token-id .bin) would train on garbage
        raise ValueError(f"{flag} {str(path)!r}: not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); accepted: "
                         "a UTF-8 text file") from None
    if not text.strip():
        raise ValueError(f"{flag} {str(path)!r}: the file is empty (no text but whitespace); accepted: a UTF-8 "
                         "text file with text")
    return [text]


def cache_dir() -> pathlib.Path:
    """`$JMEM_CACHE` or `~/.cache/jmem`."""
    return pathlib.Path(os.environ.get("JMEM_CACHE", pathlib.Path.home() / ".cache" / "jmem"))


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


def tokenize_documents(docs: list[str], tokenizer, *, bos: int | None, eos: int | None, cache: bool = True) -> np.ndarray:
    """One int32 stream ``[BOS] doc [EOS] ...``, cached under `cache_dir()/tokens`.

    The cache key hashes the text, the separators and `tokenizer_id`, so a
    different text or tokenizer never reads a stale file.
    """
    h = hashlib.sha256()
    for d in docs:  # each document's length first: ["a\0b"] and ["a", "b"] differ
        b = d.encode("utf-8", errors="surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    key = f"{h.hexdigest()[:24]}-{tokenizer_id(tokenizer)}-{bos}-{eos}.npy"
    path = cache_dir() / "tokens" / key
    if cache and path.is_file():
        try:
            return np.load(path)
        except (OSError, ValueError, EOFError):
            pass  # a truncated or empty file from an interrupted write: rebuild it
    parts = []
    for d in docs:
        ids = _encode(tokenizer, d)
        if bos is not None:
            ids = [bos] + ids
        if eos is not None:
            ids = ids + [eos]
        parts.append(np.asarray(ids, np.int32))
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
            np.save(tmp, stream)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home must not stop training
    return stream


@dataclasses.dataclass(frozen=True)
class PackedDataset:
    """Fixed-length windows of a token stream, split into train and validation.

    Attributes:
        train: i32[n_train, seq + 1] windows.
        valid: i32[n_valid, seq + 1] windows (may be empty).
        seq: model sequence length.
    """

    train: np.ndarray
    valid: np.ndarray
    seq: int

    @classmethod
    def from_tokens(cls, stream: np.ndarray, seq: int, *, valid_fraction: float = 0.05) -> "PackedDataset":
        check_int("seq", seq, 1)
        stream = np.asarray(stream)
        if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
            raise ValueError(f"stream of dtype {stream.dtype} and shape {stream.shape}; accepted: a 1-D sequence of "
                             "integer token ids")
        if not 0 <= valid_fraction < 1:
            raise ValueError(f"valid_fraction={valid_fraction}; accepted: 0 <= valid_fraction < 1")
        n = (len(stream) - 1) // seq
        if n < 2:
            raise ValueError(f"the text has {len(stream)} tokens: too short for two windows of seq={seq}; accepted: "
                             f"a text of at least {2 * seq + 1} tokens, or a smaller seq")
        # Windows overlap by one token so each target follows its input.
        idx = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
        windows = stream[idx]
        n_valid = int(n * valid_fraction) if valid_fraction > 0 else 0
        n_valid = min(max(n_valid, 1 if valid_fraction > 0 else 0), n - 1)
        return cls(train=windows[: n - n_valid], valid=windows[n - n_valid :], seq=seq)

    @classmethod
    def from_text(cls, docs: list[str] | str, tokenizer, seq: int, *, cache: bool = True, valid_fraction: float = 0.05) -> "PackedDataset":
        """Tokenize (cached) and pack. `docs` is one string or a list of documents."""
        if isinstance(docs, str):
            docs = [docs]
        bos = getattr(tokenizer, "bos_id", None)
        eos = getattr(tokenizer, "eos_id", None)
        stream = tokenize_documents(docs, tokenizer, bos=bos, eos=eos, cache=cache)
        return cls.from_tokens(stream, seq, valid_fraction=valid_fraction)

    @property
    def num_tokens(self) -> int:
        return int(self.train.size + self.valid.size)

    def _order(self, epoch: int, seed: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(len(self.train))

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
