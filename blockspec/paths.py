"""Paths a user gives, checked before anything slow starts: folders that must exist (a checkpoint, a draft)
and files or folders to be written. Each problem is a BlockspecError naming the setting, the path and the
fix; a file where a folder is expected says so (a `.gguf`: what blockspec does with GGUF files)."""

from __future__ import annotations

from pathlib import Path

from blockspec.errors import BlockspecError, ModelLoadError, setting

# The draft that ships with blockspec for the embedded target; "default" names it wherever a draft folder
# is asked for, so commands read the same from any folder.
SHIPPED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-dflash"
SHIPPED_DRAFT_NAME = "default"

GGUF_HELP = ("blockspec reads Hugging Face checkpoint folders (config.json, *.safetensors, tokenizer.json); "
             "a GGUF file runs only as the embedded SmolLM2 (give no model path for it). For this model, "
             "point {name} at its original Hugging Face folder: quantization q8_0, q4_0 or q4_1 then holds "
             "its weights in GGUF blocks on the CPU as llama.cpp would.")


def check_folder(path: str | Path, name: str, what: str, needs: str | None = "config.json") -> Path:
    """An existing folder (holding `needs`, when given) for setting `name`; `what` says what it should be.
    Problems are ModelLoadErrors: these are checkpoints to load."""
    folder = Path(path).expanduser()
    flag = setting(name)
    if not folder.exists():
        raise ModelLoadError(f"{flag}={str(path)!r} does not exist: pass {what}.")
    if not folder.is_dir():
        if folder.suffix.lower() == ".gguf":
            raise ModelLoadError(f"{flag}={str(path)!r} is a GGUF file, not a folder. "
                                 + GGUF_HELP.format(name=flag))
        raise ModelLoadError(f"{flag}={str(path)!r} is a file, not a folder: pass {what}.")
    if needs is not None and not (folder / needs).is_file():
        raise ModelLoadError(f"{flag}={str(path)!r} has no {needs}: pass {what}.")
    return folder


def draft_folder(path: str) -> str:
    """A draft folder as given, with "default" read as the shipped draft's."""
    return str(SHIPPED_DRAFT) if path == SHIPPED_DRAFT_NAME else path


def check_output_file(path: str | Path, name: str) -> Path:
    """A file to write: its folder exists and it is not itself a folder."""
    target = Path(path).expanduser()
    flag = setting(name)
    if target.is_dir():
        raise BlockspecError(f"{flag}={str(path)!r} is a folder; give a file name to write to.")
    if not target.resolve().parent.is_dir():
        raise BlockspecError(f"{flag}={str(path)!r}: folder {str(target.resolve().parent)!r} does not exist; "
                             f"create it or pick another path.")
    return target


def check_output_folder(path: str | Path, name: str) -> Path:
    """A folder to write into (made if missing): neither it nor a parent may be a file."""
    target = Path(path).expanduser()
    flag = setting(name)
    for part in (target, *target.parents):
        if part.exists() and not part.is_dir():
            what = "it is a file" if part == target else f"{str(part)!r} is a file"
            raise BlockspecError(f"{flag}={str(path)!r} must be a folder to write into, but {what}. Pick "
                                 f"another path.")
    return target
