"""Byte-level text data that needs no download: the Python standard library's own sources.

Reading bytes (not tokens) keeps the default run free of tokenizers and downloads, and the
standard library is real, varied text that every Python installation already has.
"""

from __future__ import annotations

import pathlib
import sysconfig

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests"}


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files in sorted path order (no installed packages, caches, tests)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [path for path in sorted(root.rglob("*.py"))
            if not _SKIPPED_DIRS & set(path.relative_to(root).parts)]


def read_bytes(files: list[pathlib.Path], limit: int | None = None) -> torch.Tensor:
    """The concatenated bytes of ``files`` (at most ``limit``) as a long tensor of byte values."""
    chunks, size = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if limit is not None and size >= limit:
            break
    blob = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def stdlib_bytes(limit: int | None = None) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's sources (the demo's and the app's default)."""
    return read_bytes(stdlib_files(), limit)


class RandomWindows(Dataset):
    """``length`` windows at offsets drawn from a generator seeded per index: deterministic, any order."""

    def __init__(self, data: torch.Tensor, context: int, length: int, seed: int) -> None:
        self.data, self.context, self.length, self.seed = data, context, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, len(self.data) - self.context - 1, (1,), generator=generator))
        window = self.data[start: start + self.context + 1]
        return window[:-1], window[1:]


class StridedWindows(Dataset):
    """Non-overlapping windows from the start of ``data``: a fixed validation set."""

    def __init__(self, data: torch.Tensor, context: int, count: int) -> None:
        self.data, self.context = data, context
        self.count = min(count, (len(data) - 1) // context)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[index * self.context: (index + 1) * self.context + 1]
        return window[:-1], window[1:]


class ByteDataModule(pl.LightningDataModule):
    """Next-byte prediction on a byte stream; the last ``val_fraction`` of the stream is validation."""

    def __init__(self, context: int = 64, batch_size: int = 12, val_fraction: float = 0.05,
                 val_windows: int = 96, limit_bytes: int | None = None, train_samples: int = 1_000_000,
                 seed: int = 0) -> None:
        super().__init__()
        self.context, self.batch_size, self.val_fraction = context, batch_size, val_fraction
        self.val_windows, self.limit_bytes, self.train_samples, self.seed = (
            val_windows, limit_bytes, train_samples, seed)
        self.data: torch.Tensor | None = None

    def files(self) -> list[pathlib.Path]:
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the run summary."""
        return f"{self.num_bytes:,} bytes"

    @property
    def num_bytes(self) -> int:
        return 0 if self.data is None else len(self.data)

    def setup(self, stage: str | None = None) -> None:
        if self.data is None:
            self.data = read_bytes(self.files(), self.limit_bytes)
        split = int(len(self.data) * (1 - self.val_fraction))  # deterministic: a fixed tail
        self.train_data, self.val_data = self.data[:split], self.data[split:]
        if min(len(self.train_data), len(self.val_data)) <= self.context + 1:
            raise ValueError(f"too little text ({len(self.data)} bytes) for `data.context`={self.context}")

    def train_dataloader(self) -> DataLoader:
        dataset = RandomWindows(self.train_data, self.context, self.train_samples, self.seed)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(StridedWindows(self.val_data, self.context, self.val_windows),
                          batch_size=self.batch_size)


class StdlibDataModule(ByteDataModule):
    """The standard library's sources of the interpreter running this (its version is in the summary)."""

    def files(self) -> list[pathlib.Path]:
        return stdlib_files()

    def describe(self) -> str:
        return f"Python standard library, {self.num_bytes:,} bytes"


class TextPathDataModule(ByteDataModule):
    """A local text file, or every file under a folder (sorted paths), read as bytes."""

    def __init__(self, path: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.path = pathlib.Path(path).expanduser()

    def files(self) -> list[pathlib.Path]:
        if not self.path.exists():
            raise FileNotFoundError(f"`data.path`: no such file or folder: {self.path}")
        if self.path.is_file():
            return [self.path]
        files = [p for p in sorted(self.path.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
        if not files:
            raise FileNotFoundError(f"`data.path`: the folder {self.path} holds no files")
        return files

    def describe(self) -> str:
        return f"{self.path}, {self.num_bytes:,} bytes"
