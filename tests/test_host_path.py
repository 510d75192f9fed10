"""The host side of an eager step (issue 20's host time): packed launcher params, the step's tensors
made once, the residual stream's fewer ops. The CUDA halves (one host-to-device copy per step, no
fill or cast launches) are in tests/gpu/test_host_path_cuda.py."""
from __future__ import annotations

import ctypes
from dataclasses import fields

import pytest
import torch

from k3_trtllm.model import build_step
from k3_trtllm.model import step as step_module
from k3_trtllm.model.step import StepInputs, with_snapshot_tensors
from k3_trtllm.ops import c_abi
from k3_trtllm.ops.norm import cuda as norm_cuda

STRUCTS = [s.structure for s in c_abi.PARAMS] + [norm_cuda.RmsNormParams, norm_cuda.AttnResMixParams,
                                                  norm_cuda.GluParams]


def _values(structure):
    """Distinct values for every field (arrays flattened), and the same as Structure arguments."""
    flat, args = [], []
    for i, (name, ctype) in enumerate(structure._fields_):
        if issubclass(ctype, ctypes.Array):
            items = [0x1000 * (i + 1) + k for k in range(ctype._length_)]
            flat += items
            args.append(ctype(*items))
        else:
            v = 0.5 + i if ctype in (ctypes.c_float, ctypes.c_double) else (0x10000 * (i + 1) + 7
                                                                            if ctype is ctypes.c_void_p else i + 3)
            flat.append(v)
            args.append(v)
    return flat, args


@pytest.mark.parametrize("structure", STRUCTS, ids=lambda s: s.__name__)
def test_packed_params_are_byte_for_byte_the_structure(structure):
    """A launcher reads the packed bytes as its C struct: they must equal what ctypes builds, padding
    and all (the ctypes twins are checked against the C compiler in test_c_abi / test_norm_ops)."""
    flat, args = _values(structure)
    packed = c_abi.packer(structure).pack(*flat)
    assert len(packed) == ctypes.sizeof(structure)
    assert packed == bytes(structure(*args))
    assert bytes(structure.from_buffer_copy(packed)) == bytes(structure(*args))


def test_a_layout_the_packer_cannot_reproduce_is_refused():
    class Packed(ctypes.Structure):  # no C alignment: the struct module's native layout differs
        _pack_ = 1
        _fields_ = [("n", ctypes.c_int), ("ptr", ctypes.c_void_p)]
    with pytest.raises(ValueError, match="Packed.ptr: struct offset 8, ctypes offset 4"):
        c_abi.packer(Packed)


def test_fill_equals_the_structure_set_field_by_field():
    """``fill`` now packs; the struct it returns must hold what setting each field by name gives."""
    spec = c_abi.KDA
    c = spec.contract
    sizes = {"T": 3, "P": 8, "H": 2, "K": 4, "V": 4, "W": 4, "B": 2, "S": 5, "N": 2, "Ns": 3}
    inputs = [torch.empty([int(eval(e, {}, sizes)) for e in t.shape], dtype=torch.uint8) for t in c.inputs]
    out = torch.empty(1, dtype=torch.uint8)
    work = torch.empty(32, dtype=torch.uint8)
    got = spec.fill(inputs, (out,), (2, 4, -5.0), work)
    want = spec.structure()
    for t, s in zip(inputs, c.inputs):
        setattr(want, s.name, t.data_ptr())
    want.out, want.workspace = out.data_ptr(), work.data_ptr()
    want.num_tokens, want.num_seqs, want.conv_width, want.snapshot_width, want.snapshot_slots = 3, 2, 4, 2, 3
    want.num_heads, want.head_dim, want.lower_bound = 2, 4, -5.0
    assert bytes(got) == bytes(want)
    assert spec.fill(inputs, (out,), (2, 4, -5.0)).workspace is None


def _step(batch: int) -> StepInputs:
    return build_step([([5 + i], 10 + i, i, [i]) for i in range(batch)], 16)


def test_no_snapshot_tensors_are_made_once_per_batch_size(monkeypatch):
    """A step that takes no snapshots gets one -1 column and row 0 (the KDA ops read no point);
    the pair is made once per (device, batch size), not per step (two fill launches a step)."""
    monkeypatch.setattr(step_module, "_NO_SNAPSHOTS", {})
    a, b = with_snapshot_tensors(_step(3)), with_snapshot_tensors(_step(3))
    assert a.snapshot_offsets.tolist() == [[-1]] * 3 and a.snapshot_rows.tolist() == [[0]] * 3
    assert a.snapshot_offsets.dtype == a.snapshot_rows.dtype == torch.int32
    assert a.snapshot_offsets is b.snapshot_offsets and a.snapshot_rows is b.snapshot_rows
    c = with_snapshot_tensors(_step(2))
    assert c.snapshot_offsets.shape == (2, 1) and c.snapshot_offsets is not a.snapshot_offsets
    with torch.inference_mode():  # made inside inference mode, still a plain tensor
        monkeypatch.setattr(step_module, "_NO_SNAPSHOTS", {})
        d = with_snapshot_tensors(_step(1))
    assert not d.snapshot_offsets.is_inference()
    taking = build_step([([1] * 64, 0, 0, [0, 1, 2, 3])], 16, snapshots=[[(64, 1)]])
    assert with_snapshot_tensors(taking) is taking


def test_traced_steps_get_fresh_no_snapshot_tensors(monkeypatch):
    """While torch.compile / torch.export trace, shapes may be symbolic and tensors fake: no cache."""
    monkeypatch.setattr(step_module, "_NO_SNAPSHOTS", {})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    a, b = with_snapshot_tensors(_step(2)), with_snapshot_tensors(_step(2))
    assert a.snapshot_offsets is not b.snapshot_offsets and not step_module._NO_SNAPSHOTS
    assert a.snapshot_offsets.tolist() == [[-1], [-1]]


def test_a_step_to_the_cpu_keeps_every_field():
    step = build_step([([5, 6], 0, 1, [2]), ([7], 4, 0, [0, 1])], 16, snapshots=[[(2, 0)], []])
    moved = step.to("cpu")
    for f in fields(StepInputs):
        assert torch.equal(getattr(moved, f.name), getattr(step, f.name)), f.name



def _step_by_definition(seqs, block_size, logits_all=False, snapshots=None) -> dict:
    """build_step's fields spelled out per sequence and token (the contract, DESIGN §3), as lists."""
    ids, pos, cu, slotmap, last = [], [], [0], [], []
    width = max(1, max(len(t) for *_, t in seqs))
    for new_ids, ctx, _, table in seqs:
        ids += new_ids
        for p in range(ctx, ctx + len(new_ids)):
            pos.append(p)
            slotmap.append(table[p // block_size] * block_size + p % block_size)
        cu.append(len(ids))
        last.append(len(ids) - 1)
    out = dict(input_ids=ids, positions=pos, cu_seqlens=cu, context_lens=[s[1] for s in seqs],
               logits_indices=list(range(len(ids))) if logits_all else last,
               block_tables=[list(t) + [0] * (width - len(t)) for *_, t in seqs], slot_mapping=slotmap,
               state_slots=[s[2] for s in seqs], has_initial_state=[int(s[1] > 0) for s in seqs],
               snapshot_offsets=None, snapshot_rows=None)
    if snapshots and any(snapshots):
        n = max(map(len, snapshots))
        out["snapshot_offsets"] = [[o for o, _ in p] + [-1] * (n - len(p)) for p in snapshots]
        out["snapshot_rows"] = [[r for _, r in p] + [0] * (n - len(p)) for p in snapshots]
    return out


def test_build_step_is_its_definition():
    """The vectorised build_step against the per-token definition: decode and prefill batches, ragged
    tables, snapshots, logits_all; every field int32, contiguous, sharing no memory with another."""
    import random
    rng = random.Random(0)
    for _ in range(300):
        decode, bs = rng.random() < 0.5, rng.choice([1, 16, 64])
        seqs = []
        for slot in rng.sample(range(300), rng.choice([1, 2, 7, 33, 128])):
            n, ctx = (1, rng.randint(1, 300)) if decode else (rng.randint(1, 70), rng.randint(0, 300))
            table = [rng.randint(0, 9999) for _ in range(-(-(ctx + n) // bs) + rng.randint(0, 2))]
            seqs.append(([rng.randint(0, 999) for _ in range(n)], ctx, slot, table))
        snapshots = [[(rng.randint(1, len(s[0])), rng.randint(0, 9)) for _ in range(rng.randint(0, 2))]
                     for s in seqs] if rng.random() < 0.5 else None
        logits_all = rng.random() < 0.2
        step = build_step(seqs, bs, logits_all, snapshots)
        want = _step_by_definition(seqs, bs, logits_all, snapshots)
        storages = set()
        for f in fields(StepInputs):
            t = getattr(step, f.name)
            if want[f.name] is None:
                assert t is None, f.name
                continue
            assert t.dtype == torch.int32 and t.is_contiguous() and t.tolist() == want[f.name], f.name
            storages.add(t.untyped_storage().data_ptr())
        assert len(storages) == sum(w is not None for w in want.values())
    with pytest.raises(ValueError, match="at least one new token"):
        build_step([([1], 0, 0, [0]), ([], 3, 1, [1])], 16)
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold 17 tokens"):
        build_step([([1], 0, 0, [0]), ([1], 16, 1, [1])], 16)


def test_the_runners_table_rows_follow_the_block_manager():
    """ModelRunner keeps each slot's block table as a row between steps: after appends, a new list in
    a slot (freed, shared, another sequence), shorter or longer, the gathered rows are the tables."""
    import random

    from k3_trtllm.runtime.model_runner import _TableRows
    rng, rows, tables = random.Random(1), _TableRows(), {}
    for _ in range(3000):
        for slot in rng.sample(range(40), 5):
            if slot not in tables or rng.random() < 0.2:
                tables[slot] = [rng.randint(0, 9999) for _ in range(rng.randint(0, 70))]
            else:
                tables[slot].extend(rng.randint(0, 9999) for _ in range(rng.randint(0, 3)))
        batch = rng.sample(sorted(tables), rng.randint(1, min(16, len(tables))))
        seqs = [([1], 0, slot, tables[slot]) for slot in batch]
        width = max(1, max(len(tables[slot]) for slot in batch))
        got = rows.gather(seqs)
        assert got.tolist() == [tables[s] + [0] * (width - len(tables[s])) for s in batch]
        if all(tables[slot] for slot in batch):  # a step needs a block per sequence
            kept = build_step(seqs, 1 << 20, block_tables=got).block_tables
            assert torch.equal(kept, build_step(seqs, 1 << 20).block_tables)


def _host_time():
    import importlib.util
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("host_time", root / "bench" / "host_time.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["host_time"] = module
    spec.loader.exec_module(module)
    return module, root / "examples" / "tiny-k3" / "config.json"


def test_host_time_reports_each_case_and_where_its_host_time_goes(tmp_path):
    """bench/host_time.py at tiny dims on CPU: a decode and a cache-hit prefill case, each with its
    host and step times, a cProfile (functions by own time, per file) and the profiler's CPU ops."""
    import json
    ht, config = _host_time()
    out = tmp_path / "host.json"
    assert ht.main(["--device", "cpu", "--config", str(config), "--tp", "2", "--ep", "2", "--layers", "2",
                    "--context", "16", "--prefill-tokens", "8", "--iters", "1", "--warmup", "0", "--profile-steps", "1",
                    "--top", "5", "--no-tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for case, decode, tokens in (("slice_decode_b1", True, 1), ("slice_prefill_hit", False, 8)):
        r = report[case]
        assert (r["decode"], r["tokens"], r["seqs"]) == (decode, tokens, 1)
        assert r["host_ms"] > 0 and r["step_ms"]["iters"] == 1
        prof = r["cprofile"]
        assert len(prof["top_functions"]) == 5 and len(prof["by_file_us"]) <= 5
        assert 0 < sum(f["own_us_per_step"] for f in prof["by_file_us"]) <= prof["profiled_us_per_step"] * 1.000001
        assert any("k3_trtllm/" in f["file"] for f in prof["by_file_us"])
        assert r["cpu_ops"] and all(op["calls_per_step"] > 0 for op in r["cpu_ops"])


def test_host_time_times_the_parts_of_an_engine_decode_step(tmp_path):
    """bench/host_time.py's engine case (the tiny model on CPU, fp32): every part of a decode step."""
    import json
    ht, _ = _host_time()
    out = tmp_path / "engine.json"
    assert ht.main(["--device", "cpu", "--no-slice", "--no-tiny", "--engine-batches", "2", "--engine-context", "20",
                    "--engine-dtype", "float32", "--iters", "2", "--warmup", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["engine_decode_b2"]
    assert (r["batch"], r["context"], r["iters"], r["graph_replays"], r["forward"]) == (2, 20, 2, 0, True)
    assert list(r["parts_ms"]) == list(ht.ENGINE_PARTS) and all(v > 0 for v in r["parts_ms"].values())
    assert r["host_ms"] == pytest.approx(sum(r["parts_ms"].values()))
    assert ht.main(["--device", "cpu", "--no-slice", "--no-tiny", "--engine-batches", "2", "--engine-context", "20",
                    "--engine-dtype", "float32", "--engine-no-forward", "--iters", "2", "--warmup", "1",
                    "--out", str(out)]) == 0
    alone = json.loads(out.read_text())["engine_decode_b2"]
    assert not alone["forward"] and alone["parts_ms"]["execute"] < r["parts_ms"]["execute"]


def test_host_time_refuses_a_bad_config_in_one_line(tmp_path, capsys):
    ht, _ = _host_time()
    assert ht.main(["--device", "cpu", "--config", str(tmp_path / "missing.json"), "--no-tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("host_time.py: --config ")
