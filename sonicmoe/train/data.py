"""Byte-level text corpus: the CPython standard library sources by default, or the user's files.

Tokens are bytes (vocabulary 256). The files are listed in sorted path order, then concatenated in a
fixed pseudo-random order (by SHA-256 of the relative path, so that a byte cap samples the whole tree
rather than its first directories, and the held-out tail is a sample of files from all over it), each
preceded by a one-line header naming the file. The last ``val_fraction`` of the bytes is the
validation split. Everything here is deterministic given the files and the seed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _relative_key(root: Path):
    return lambda p: p.relative_to(root).as_posix()


def stdlib_source_files() -> tuple[Path, list[Path]]:
    """The standard library's ``.py`` files, sorted by relative path (tests and site-packages skipped).

    Returns:
        (root, files): the stdlib directory from ``sysconfig.get_paths()["stdlib"]`` and its files.

    Raises:
        FileNotFoundError: no ``.py`` file there (a Python installed without its sources).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    if not files:
        raise FileNotFoundError(f"no .py sources under the standard library directory {root}; "
                                "pass --data PATH")
    return root, sorted(files, key=_relative_key(root))


def text_files(path: Path) -> tuple[Path, list[Path]]:
    """The file ``path``, or every non-hidden regular file under the directory ``path``, sorted.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no file.
    """
    if path.is_file():
        return path.parent, [path]
    if not path.is_dir():
        raise FileNotFoundError(f"--data {path}: no such file or directory")
    files = [p for p in path.rglob("*")
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    if not files:
        raise FileNotFoundError(f"--data {path}: the directory holds no file")
    return path, sorted(files, key=_relative_key(path))


def corpus_order(files: list[Path], root: Path) -> list[Path]:
    """The files in the corpus's fixed pseudo-random order: by SHA-256 of the relative path."""
    # os.fsencode: a file name that is not UTF-8 (held as surrogate escapes) gets its bytes back; UTF-8 names encode
    # as before, so the order is unchanged
    return sorted(files, key=lambda p: hashlib.sha256(os.fsencode(p.relative_to(root).as_posix())).digest())


def read_corpus(files: list[Path], root: Path, max_bytes: int) -> tuple[bytes, int]:
    """Concatenate the files in :func:`corpus_order` (each after a ``# ==== relative/path ====`` line),
    at most ``max_bytes`` in all.

    Files holding a NUL byte (binary) are skipped. Returns the bytes and the number of files used.
    """
    chunks: list[bytes] = []
    size = 0
    used = 0
    for p in corpus_order(files, root):
        if size >= max_bytes:
            break
        body = p.read_bytes()
        if b"\x00" in body:
            continue
        piece = b"# ==== " + os.fsencode(p.relative_to(root).as_posix()) + b" ====\n" + body
        if not piece.endswith(b"\n"):
            piece += b"\n"
        piece = piece[: max_bytes - size]
        chunks.append(piece)
        size += len(piece)
        used += 1
    return b"".join(chunks), used


@dataclasses.dataclass
class ByteCorpus:
    """Train and validation byte streams.

    Attributes:
        train: (N_train,) uint8 bytes (CPU).
        val: (N_val,) uint8 bytes (CPU), the tail of the corpus.
        source: where the text came from (a path, for the log).
        num_files: files read.
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str
    num_files: int

    @classmethod
    def load(cls, data: str | None, max_bytes: int, val_fraction: float) -> ByteCorpus:
        """Read ``data`` (a file or directory; ``None``: the stdlib sources) and split off the tail.

        Raises:
            FileNotFoundError: nothing to read. ValueError: the text is too short to split.
        """
        root, files = stdlib_source_files() if data is None else text_files(Path(data))
        # the file or directory given (a single file's root is its folder, which the log would name instead)
        source = str(root if data is None else Path(data))
        blob, used = read_corpus(files, root, max_bytes)
        if len(blob) < 64:
            raise ValueError(f"corpus from {source} has only {len(blob)} bytes; need at least 64")
        all_bytes = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        n_val = max(2, int(len(blob) * val_fraction))
        return cls(train=all_bytes[:-n_val].clone(), val=all_bytes[-n_val:].clone(), source=source,
                   num_files=used)

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 (hex) of the split sizes and bytes: what a resumed run must train and evaluate on again (hashed
        once per corpus: the CLI's check and the run's checkpoints share it)."""
        h = hashlib.sha256(f"{self.train.numel()},{self.val.numel()};".encode())
        h.update(self.train.numpy().tobytes())
        h.update(self.val.numpy().tobytes())
        return h.hexdigest()

    def check_seq_len(self, seq_len: int) -> None:
        """Raise ValueError unless both splits hold more than ``seq_len`` + 1 bytes."""
        for name, split in (("train", self.train), ("validation", self.val)):
            if split.numel() < seq_len + 2:
                raise ValueError(f"the {name} split has {split.numel()} bytes, fewer than seq_len + 2 = "
                                 f"{seq_len + 2}; use more data or a shorter --seq-len")

    @staticmethod
    def _windows(split: torch.Tensor, starts: torch.Tensor, seq_len: int, device: torch.device):
        idx = starts[:, None] + torch.arange(seq_len + 1)
        chunk = split[idx]
        if device.type == "cuda":
            chunk = chunk.pin_memory()
        chunk = chunk.to(device, non_blocking=True).long()
        return chunk[:, :-1], chunk[:, 1:]

    def train_batch(self, batch_size: int, seq_len: int, generator: torch.Generator,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of the train split: inputs and next-byte targets, both (B, L) int64.

        Window starts are drawn from ``generator`` (a CPU generator whose state the checkpoint keeps).
        """
        high = self.train.numel() - seq_len - 1
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        return self._windows(self.train, starts, seq_len, device)

    def val_batches(self, batch_size: int, seq_len: int, num_batches: int,
                    device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation set: ``num_batches`` batches of windows evenly spaced over the val split.

        The same windows every call, so validation losses of one run are comparable.
        """
        high = self.val.numel() - seq_len - 1
        # float64: float32 holds only even integers past 2**24 and rounded high up, one byte past the split's end
        starts = torch.linspace(0, high, batch_size * num_batches, dtype=torch.float64).round().long().clamp_(max=high)
        for b in range(num_batches):
            yield self._windows(self.val, starts[b * batch_size:(b + 1) * batch_size], seq_len, device)
