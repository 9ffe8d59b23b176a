"""Files written whole or not at all: a temporary file beside the target, then a rename over it."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what a plain open() would have created


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once the block succeeds it becomes `path` (with the mode a
    new file gets), otherwise it is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with replacing(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, obj) -> None:
    write_text(path, json.dumps(obj, indent=1) + "\n")


def write_csv(path: str | os.PathLike, rows: list[dict]) -> None:
    """Rows with the same keys, the first row's order as the header."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buf.getvalue())


def write_parquet(path: str | os.PathLike, table) -> None:
    """A pyarrow Table as one Parquet file."""
    import pyarrow.parquet as pq

    with replacing(path) as tmp:
        pq.write_table(table, tmp)
