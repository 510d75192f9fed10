"""A checkpoint is untrusted input (issue 15, items 3, 4 and 10): shard names in the index
stay inside the checkpoint directory, safetensors headers obey the format's rules (checked
against the safetensors library), and a directory that is not a checkpoint is refused in
one line that says what it holds."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from k3_trtllm.checkpoint.hf import CheckpointError, HFCheckpoint
from k3_trtllm.checkpoint.loader import load_hf_state_dict
from k3_trtllm.checkpoint.safetensors_format import SafetensorsFormatError, read_header, read_tensor
from k3_trtllm.checkpoint.synth import synth_tensors
from k3_trtllm.cli import main
from k3_trtllm.config import load_config
from k3_trtllm.convert import convert_checkpoint

INDEX = "model.safetensors.index.json"


def write_raw(path: Path, header: dict | str, data: bytes, length: int | None = None) -> Path:
    """A safetensors file with exactly this header (dict or raw JSON text) and data bytes."""
    body = (header if isinstance(header, str) else json.dumps(header)).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes((len(body) if length is None else length).to_bytes(8, "little") + body + data)
    return path


def f32(shape, begin, end, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---- item 4: header rules ----------------------------------------------------------------

# (header, data bytes, message after "{path}: "): each breaks one rule of the format.
BAD_HEADERS = {
    "overlap": ({"a": f32([4], 0, 16), "b": f32([2], 8, 16)}, 16,
                "tensor 'b': data_offsets [8, 16] overlap tensor 'a' [0, 16]"),
    "shared bytes": ({"a": f32([4], 0, 16), "b": f32([4], 0, 16)}, 16,
                     "tensor 'b': data_offsets [0, 16] overlap tensor 'a' [0, 16]"),
    "gap": ({"a": f32([4], 0, 16), "b": f32([4], 20, 36)}, 36,
            "tensor 'b': data_offsets [20, 36] leave bytes [16, 20) after tensor 'a' [0, 16] in no tensor"),
    "not from the start": ({"a": f32([4], 8, 24)}, 24,
                           "tensor 'a': data_offsets [8, 24] leave bytes [0, 8) at the start of the data section "
                           "in no tensor"),
    "bytes after the last tensor": ({"a": f32([4], 0, 16)}, 20,
                                    "the data section holds 20 bytes; the last 4 (after tensor 'a' [0, 16]) are "
                                    "in no tensor"),
    "past the end": ({"a": f32([4], 0, 16), "b": f32([4], 16, 32)}, 24,
                     "truncated safetensors file: header declares 32 bytes of tensor data, the file holds 24"),
    "unknown dtype": ({"a": f32([4], 0, 16, dtype="F17")}, 16,
                      "tensor 'a': unknown dtype 'F17' (known: BF16, F16, F32, F64, U8, U16, U32, U64, I8, I16, "
                      "I32, I64, BOOL, F8_E4M3, F8_E5M2, F8_E8M0, C64)"),
    "dtype not a string": ({"a": f32([4], 0, 16, dtype=4)}, 16, "tensor 'a': unknown dtype 4 (known: "),
    "negative dim": ({"a": f32([-1, 4], 0, 16)}, 16,
                     "tensor 'a': shape [-1, 4] is not a list of non-negative integers"),
    "float dim": ({"a": f32([2.0, 2], 0, 16)}, 16,
                  "tensor 'a': shape [2.0, 2] is not a list of non-negative integers"),
    "boolean dim": ({"a": f32([True, 4], 0, 16)}, 16,
                    "tensor 'a': shape [True, 4] is not a list of non-negative integers"),
    "reversed offsets": ({"a": f32([4], 16, 0)}, 16,
                         "tensor 'a': data_offsets [16, 0] are not [begin, end] with 0 <= begin <= end"),
    "one offset": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16]}}, 16,
                   "tensor 'a': data_offsets [16] are not [begin, end] with 0 <= begin <= end"),
    "span is not shape x dtype": ({"a": f32([2, 2], 0, 12)}, 12,
                                  "tensor 'a': data_offsets [0, 12] do not hold 16 bytes of F32 [2, 2]"),
    "missing field": ({"a": {"dtype": "F32", "shape": [4]}}, 16,
                      "tensor 'a': malformed header entry {'dtype': 'F32', 'shape': [4]} (expected an object with "
                      "dtype, shape and data_offsets)"),
    "metadata not strings": ({"__metadata__": {"format": 1}, "a": f32([4], 0, 16)}, 16,
                             "`__metadata__` is not an object of strings"),
    "named twice": ('{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
                    '"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 16,
                    "the header names 'a' twice"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_each_header_rule_is_enforced_naming_file_and_tensor(case, tmp_path):
    header, nbytes, message = BAD_HEADERS[case]
    path = write_raw(tmp_path / "bad.safetensors", header, bytes(nbytes))
    with pytest.raises(SafetensorsFormatError) as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: {message}")


# The safetensors library (an independent implementation of the same format) refuses every
# one of these files too, except a name given twice: its JSON map keeps the last entry,
# which is exactly the ambiguity k3-trt refuses.
@pytest.mark.parametrize("case", [c for c in BAD_HEADERS if c != "named twice"])
def test_the_safetensors_library_refuses_the_same_files(case, tmp_path):
    header, nbytes, _ = BAD_HEADERS[case]
    path = write_raw(tmp_path / "bad.safetensors", header, bytes(nbytes))
    with pytest.raises(Exception):
        with safe_open(str(path), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]


def test_header_length_over_the_format_limit(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", {"a": f32([4], 0, 16)}, bytes(16), length=100_000_001)
    with pytest.raises(SafetensorsFormatError) as info:
        read_header(path)
    assert str(info.value) == (f"{path}: not a safetensors file (header length 100000001 bytes exceeds the "
                               "format's limit of 100000000)")


def test_valid_layouts_in_any_header_order_match_the_library(tmp_path):
    """Entries out of offset order, empty tensors and null metadata are valid: both readers
    agree on the values."""
    values = {"b": torch.arange(4, dtype=torch.float32), "a": torch.tensor([7, 8], dtype=torch.int16)}
    header = {"__metadata__": None,  # optional, null allowed
              "a": f32([2], 16, 20, dtype="I16"), "empty": f32([0, 3], 16, 16), "b": f32([4], 0, 16)}
    data = values["b"].numpy().tobytes() + values["a"].numpy().tobytes()
    path = write_raw(tmp_path / "ok.safetensors", header, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        ours = {k: read_tensor(fd, info) for k, info in read_header(path).items()}
    finally:
        os.close(fd)
    with safe_open(str(path), "pt") as f:
        library = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(ours) == sorted(library) == ["a", "b", "empty"]
    for k in ours:
        assert ours[k].dtype == library[k].dtype and torch.equal(ours[k], library[k]), k


@pytest.fixture(scope="module")
def tiny(ckpt_dir):
    path = ckpt_dir("tiny")
    return path, synth_tensors(load_config(path))


def test_tensors_sharing_bytes_do_not_convert(tiny, tmp_path):
    """k_proj pointing at q_proj's bytes: both look valid alone, but the file is malformed."""
    src, tensors = tiny
    hf = tmp_path / "ckpt"
    hf.mkdir()
    shutil.copy(src / "config.json", hf / "config.json")
    q, k = (f"model.layers.1.self_attn.{x}_proj.weight" for x in "qk")
    header, data = {}, bytearray()
    for name, t in tensors.items():
        if name == k:
            continue
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        if name == q:
            header[k] = dict(header[q])
        data += raw
    shard = write_raw(hf / "model.safetensors", header, bytes(data))
    begin, end = header[q]["data_offsets"]
    with pytest.raises(CheckpointError) as info:
        convert_checkpoint(hf, tmp_path / "out", progress=False)
    assert str(info.value) == f"{shard}: tensor {k!r}: data_offsets [{begin}, {end}] overlap tensor {q!r} " \
                              f"[{begin}, {end}]"
    assert not (tmp_path / "out").exists()


# ---- item 3: shard names stay inside the checkpoint --------------------------------------

def _with_index(src: Path, tmp_path: Path, rename) -> tuple[Path, Path]:
    """A copy of ``src`` whose index maps its first shard to ``rename(shard path)``."""
    hf = shutil.copytree(src, tmp_path / "ckpt")
    index = json.loads((hf / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    new = rename(hf / first)
    index["weight_map"] = {k: (new if v == first else v) for k, v in index["weight_map"].items()}
    (hf / INDEX).write_text(json.dumps(index))
    return hf, hf / INDEX


def test_index_shard_with_dotdot_is_refused(tiny, tmp_path):
    def outside(shard: Path) -> str:
        (tmp_path / "elsewhere").mkdir()
        shard.rename(tmp_path / "elsewhere" / "x.safetensors")  # a real shard, readable there
        return "../elsewhere/x.safetensors"

    hf, index = _with_index(tiny[0], tmp_path, outside)
    with pytest.raises(CheckpointError) as info:
        HFCheckpoint(hf)
    assert str(info.value) == (f"{index}: shard '../elsewhere/x.safetensors' lies outside {hf} (shard names are "
                               "paths relative to the checkpoint directory, without '..')")


@pytest.mark.parametrize("absolute", ["/etc/passwd", "moved"])
def test_index_shard_with_an_absolute_path_is_refused(absolute, tiny, tmp_path):
    def outside(shard: Path) -> str:
        if absolute != "moved":
            return absolute
        return str(shard.rename(tmp_path / "moved.safetensors"))

    hf, index = _with_index(tiny[0], tmp_path, outside)
    name = absolute if absolute != "moved" else str(tmp_path / "moved.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_hf_state_dict(hf)
    assert str(info.value).startswith(f"{index}: shard {name!r} lies outside {hf}")


def test_index_shard_symlinked_out_of_the_checkpoint_is_refused(tiny, tmp_path):
    def link_out(shard: Path) -> str:
        target = shard.rename(tmp_path / "target.safetensors")
        (shard.parent / "link.safetensors").symlink_to(target)
        return "link.safetensors"

    hf, index = _with_index(tiny[0], tmp_path, link_out)
    with pytest.raises(CheckpointError) as info:
        HFCheckpoint(hf)
    assert str(info.value) == (f"{index}: shard 'link.safetensors' resolves to {tmp_path / 'target.safetensors'}, "
                               f"outside the checkpoint directory {hf}")


def test_globbed_shard_symlinked_out_is_refused(tiny, tmp_path):
    hf = shutil.copytree(tiny[0], tmp_path / "ckpt")
    (hf / INDEX).unlink()
    shard = sorted(hf.glob("*.safetensors"))[0]
    target = shard.rename(tmp_path / "target.safetensors")
    shard.symlink_to(target)
    with pytest.raises(CheckpointError) as info:
        HFCheckpoint(hf)
    assert str(info.value) == (f"{shard}: a symbolic link resolves to {target}, outside the checkpoint "
                               f"directory {hf}")


def test_links_inside_the_checkpoint_and_the_hub_cache_layout_load(tiny, tmp_path):
    """Links that stay inside are fine, and so is the Hugging Face hub cache, whose snapshot
    directory links every file to ``../../blobs/``: the tensors equal the plain checkpoint's."""
    src, _ = tiny
    _, expected = load_hf_state_dict(src)
    repo = tmp_path / "models--moonshotai--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    linked_dir = tmp_path / "linked"
    linked_dir.symlink_to(snapshot)  # the model dir itself given through a link
    for path in (snapshot, linked_dir):
        _, got = load_hf_state_dict(path)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_index_shard_name_that_is_not_a_string(tiny, tmp_path):
    hf, index = _with_index(tiny[0], tmp_path, lambda shard: 7)
    with pytest.raises(CheckpointError) as info:
        HFCheckpoint(hf)
    assert str(info.value) == f"{index}: shard name 7 is not a file name"


# ---- item 10: a directory that is not a checkpoint ---------------------------------------

def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def engine_dir(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "eng"
    res = invoke("build", tiny[0], out, "--dtype", "float32", "--max-batch-size", "2", "--max-num-tokens", "16",
                 "--max-seq-len", "64", "--block-size", "8", "--builder", "none")
    assert res.exit_code == 0, res.output
    return out


def _one_line_error(res) -> str:
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    return lines[0]


def test_run_on_an_engine_dir_names_the_checkpoint_to_pass(engine_dir, tiny):
    line = _one_line_error(invoke("run", engine_dir, "--prompt-ids", "1,2"))
    assert line == (f"Error: cannot load {engine_dir}: {engine_dir}: an engine directory written by `k3-trt build` "
                    "(config.json has `ranks` and `limits`), not a checkpoint; pass the checkpoint it was built "
                    f"from ({tiny[0].resolve()})")


WANTED = ("pass a K3 checkpoint directory: an HF one (config.json with model_type 'kimi_k3' or 'kimi_linear', "
          "and *.safetensors) or one written by `k3-trt convert`")


def test_run_on_an_empty_dir(tmp_path):
    line = _one_line_error(invoke("run", tmp_path, "--prompt-ids", "1,2"))
    assert line == f"Error: cannot load {tmp_path}: {tmp_path}: empty directory, no config.json; {WANTED}"


def test_run_on_weights_without_a_config(tiny, tmp_path):
    for f in sorted(tiny[0].glob("*.safetensors"))[:2]:
        shutil.copy(f, tmp_path / f.name)
    line = _one_line_error(invoke("run", tmp_path, "--prompt-ids", "1,2"))
    assert line == (f"Error: cannot load {tmp_path}: {tmp_path}: holds 2 entries (model-00001-of-00003.safetensors, "
                    f"model-00002-of-00003.safetensors), no config.json; {WANTED}")


def test_run_on_another_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    line = _one_line_error(invoke("run", tmp_path, "--prompt-ids", "1,2"))
    assert line == (f"Error: cannot load {tmp_path}: {tmp_path / 'config.json'}: model_type 'llama', architectures "
                    f"['LlamaForCausalLM']: not a Kimi K3 checkpoint; {WANTED}")


def test_convert_on_a_converted_checkpoint(tiny, tmp_path):
    converted = tmp_path / "converted"
    convert_checkpoint(tiny[0], converted, progress=False)
    line = _one_line_error(invoke("convert", converted, tmp_path / "again"))
    assert line == (f"Error: {converted}: a checkpoint written by `k3-trt convert`; this step reads an HF K3 "
                    "checkpoint: pass the directory it was converted from")
    assert not (tmp_path / "again").exists()
