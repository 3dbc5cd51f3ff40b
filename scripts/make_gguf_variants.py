"""The embedded SmolLM2 GGUF requantized by llama.cpp's own quantizer into the file types users download:
Q4_K_M, Q5_K_M, Q6_K, Q8_0 and F16 (each a mix of block types, as llama.cpp makes them), for measuring and
running blockspec on them. Needs llama-cpp-python (the `llamacpp` extra; pyproject.toml says how to build
it on CPUs where its native build crashes); blockspec's tests do not need these files.

    PYTHONPATH=. python scripts/make_gguf_variants.py [--out DIR] [--types Q4_K_M,Q8_0] [--threads 2]

Requantizing an already quantized file compounds error (fine for format and speed work, not for quality
claims). Prints each file's size and its tensors per type.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
from pathlib import Path

from blockspec.models.default_model import gguf_path
from blockspec.models.gguf_file import GGUFFile

FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "F16": 1}  # gguf.LlamaFileType's numbers


def requantize(source: Path, target: Path, ftype: int, threads: int) -> None:
    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit(f"llama-cpp-python is not installed ({exc}): pip install 'blockspec[llamacpp]' "
                         f"(see pyproject.toml for the build flags)") from exc
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if code != 0:
        raise SystemExit(f"llama_model_quantize({source} -> {target}, ftype {ftype}) returned {code}")


def type_counts(path: Path) -> str:
    import gguf

    tensors = GGUFFile(path).tensors
    counts = collections.Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in tensors)
    return ", ".join(f"{name} {count}" for name, count in counts.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gguf-variants"))
    parser.add_argument("--types", default=",".join(FILE_TYPES), help=f"of {', '.join(FILE_TYPES)}")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    names = [name.strip().upper() for name in args.types.split(",") if name.strip()]
    unknown = [name for name in names if name not in FILE_TYPES]
    if unknown:
        parser.error(f"--types {','.join(unknown)}: not one of {', '.join(FILE_TYPES)}")
    source = gguf_path()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = args.out / f"smollm2-135m-instruct-{name.lower()}.gguf"
        requantize(source, target, FILE_TYPES[name], args.threads)
        print(f"{target}: {target.stat().st_size / 1e6:.1f} MB; {type_counts(target)}")


if __name__ == "__main__":
    main()
