"""Our GGUF header reader (models/gguf_file.py) against gguf-py's GGUFReader: the same tensors (names,
shapes, types, bytes) and scalar metadata, on the embedded model and on a file with every metadata type;
a damaged file is a ModelLoadError."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from blockspec.errors import ModelLoadError
from blockspec.models import default_model as dm
from blockspec.models.gguf_file import GGUFFile


def assert_same(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(d) for d in ref.shape), mine.name
        assert mine.tensor_type == int(ref.tensor_type), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the header's own parts
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            if field.types[1] != gguf.GGUFValueType.ARRAY:  # gguf-py flattens nested arrays
                assert ours.array_lengths[key] == len(field.contents()), key
        else:
            assert ours.fields[key] == field.contents(), key
    return ours


def test_the_embedded_model_reads_as_gguf_py_reads_it():
    ours = assert_same(dm.gguf_path())
    assert ours.fields["general.architecture"] == "llama"
    assert ours.array_lengths["tokenizer.ggml.tokens"] == 49152


def test_every_metadata_type_and_tensor_type(tmp_path):
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint64("t.u64", 2**40)
    writer.add_float64("t.f64", 0.125)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strings", ["a", "", "ccc"] * 100)
    writer.add_array("t.ints", list(range(1000)))
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((5, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_same(path)
    assert ours.fields["t.str"] == "héllo" and ours.array_lengths["t.strings"] == 300
    assert ours.array_lengths["t.nested"] == 2 and ours.fields["t.u64"] == 2**40


@pytest.mark.parametrize("damage", ["truncated", "magic", "empty"])
def test_a_damaged_file_is_a_model_load_error(tmp_path, damage):
    data = dm.gguf_path().read_bytes()
    data = {"truncated": data[: 4096], "magic": b"GGUX" + data[4:], "empty": b""}[damage]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        GGUFFile(path)
