"""Pack what a GPU session needs into .device/ (git-ignored), for scripts/device_train.sh.

The lent GPU machine reaches no package index and receives at most 64 MiB per call (the working tree
included), so the embedded target travels as parts of its GGUF, one part per call, stashed in /tmp there
between calls; the prompt sets travel as JSONL files in the `{"turns": [...]}` format that
`blockspec bench --dataset PATH.jsonl` reads (worded exactly as the built-in sets), and `gguf`, the one
package the device image lacks, as a wheel.

    PYTHONPATH=. .venv/bin/python scripts/device_pack.py    # then: see scripts/device_train.sh
"""

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

from blockspec.bench.datasets import load_dataset
from blockspec.models.default_model import gguf_path

CALL_LIMIT = 64 * 2**20  # what one call may carry, the working tree included
MARGIN = 2 * 2**20  # the wheel, the prompt sets and what the tree grows by before the session
root = Path(__file__).resolve().parent.parent
pack = root / ".device"
shutil.rmtree(pack, ignore_errors=True)
pack.mkdir()

tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.split(b"\0")
tree = sum((root / f.decode()).stat().st_size for f in tracked if f and (root / f.decode()).is_file())
gguf = gguf_path().read_bytes()
room = CALL_LIMIT - tree - MARGIN
parts = math.ceil(len(gguf) / room)
size = math.ceil(len(gguf) / parts)
for i in range(parts):
    (pack / f"gguf.part{i + 1}").write_bytes(gguf[i * size : (i + 1) * size])
(pack / "gguf.sha256").write_text(f"{hashlib.sha256(gguf).hexdigest()}  {gguf_path().name}\n")

for name in ("humaneval", "mt-bench"):
    rows = [json.dumps({"turns": list(p.turns), "id": p.source_id}) for p in load_dataset(name).prompts]
    (pack / f"{name}.jsonl").write_text("\n".join(rows) + "\n")

subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(pack),
                "gguf==0.19.0"], check=True)
print(f"{pack}: working tree {tree / 2**20:.1f} MiB, GGUF {len(gguf) / 2**20:.1f} MiB in {parts} parts of "
      f"{size / 2**20:.1f} MiB (one per call: parts 1..{parts - 1} stashed, the last with the run)")
