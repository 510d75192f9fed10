"""Segmented engines (DESIGN §10): `k3-trt build --layout segments` / `--hf-config`, one
weightless ONNX graph per segment kind, and `EngineExecutor` running them on the CPU
backend (onnx's reference evaluator, the k3 nodes calling the reference ops).

References: the torch model and `TorchExecutor` on the same converted checkpoint. The
engines are fp32 (the reference evaluator has no usable bf16 math), so segment logits
agree with the model's to summation order (numpy vs torch matmuls, the stacked AttnRes
mix): measured 4e-5 on logits of magnitude ~8; tolerance 2e-4 as in test_export_engine.
Greedy tokens through the inflight runner must be identical."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import onnx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from k3_trtllm.checkpoint.safetensors_format import read_header
from k3_trtllm.checkpoint.synth import preset_config, synth_tensors, write_checkpoint
from k3_trtllm.cli import main
from k3_trtllm.config import load_config, parse_config
from k3_trtllm.convert import convert_checkpoint
from k3_trtllm.export.schemas import DOMAIN
from k3_trtllm.export.segments import KINDS, SegmentPlan, World, check_segment
from k3_trtllm.model import K3Caches, build_step, load_model
from k3_trtllm.runtime.engine import EngineConfig, LLMEngine
from k3_trtllm.runtime.executor import TorchExecutor
from k3_trtllm.runtime.sequence import SamplingParams
from k3_trtllm.trt.engine_executor import EngineExecutor
from k3_trtllm.trt.segment_build import build_segmented_engine_dir
from k3_trtllm.trt.profiles import BuildLimits

from helpers import free_port

BS = 4
LIMITS = ["--max-batch-size", "8", "--max-num-tokens", "64", "--max-seq-len", "64", "--block-size", str(BS)]
K3_CONFIG = Path(__file__).resolve().parents[2] / "shared/k3/config.json"  # the real K3 config, beside the repo
NEEDS_K3_CONFIG = pytest.mark.skipif(not K3_CONFIG.is_file(), reason=f"{K3_CONFIG} not present")
PROMPT_LENS = [3, 9, 17, 40, 5, 24, 12, 33]
# 14 blocks of 4 tokens hold the longest request (40 + 8) alone but not the batch: preemption;
# 16 tokens per step: the long prompts are prefilled in chunks
RUNNER = dict(num_blocks=14, max_slots=8, block_size=BS, max_batch_size=8, max_num_tokens=16)


HAVE_RTX = importlib.util.find_spec("tensorrt_rtx_bindings") is not None


def _build(args, builder: str = "none") -> None:
    if builder == "tensorrt-rtx":
        from trt_creators import register_python_creators

        from k3_trtllm.trt.bindings import import_tensorrt

        register_python_creators(import_tensorrt("tensorrt-rtx"))
    result = CliRunner().invoke(main, ["build", *args, "--dtype", "float32", "--builder", builder, "--quiet", *LIMITS])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def world1(ckpt_dir, tmp_path_factory):
    """A world-1 conversion of the MXFP4 tiny model and its segmented engine."""
    root = tmp_path_factory.mktemp("seg1")
    convert_checkpoint(ckpt_dir("tiny-mxfp4"), root / "ckpt", 1, 1, progress=False)
    # with TensorRT-RTX the plans are built too (Python build-phase creators, tests/trt_creators.py)
    _build([str(root / "ckpt"), str(root / "engine"), "--layout", "segments"], "tensorrt-rtx" if HAVE_RTX else "none")
    return root / "ckpt", root / "engine"


@pytest.fixture(scope="module")
def world2(ckpt_dir, tmp_path_factory):
    """A tp2/ep2 conversion of the bf16-expert tiny model, its engine, and the engine built
    from the HF config alone for the same world."""
    root = tmp_path_factory.mktemp("seg2")
    convert_checkpoint(ckpt_dir("tiny"), root / "ckpt", 2, 2, progress=False)
    _build([str(root / "ckpt"), str(root / "engine"), "--layout", "segments"])
    _build(["--hf-config", str(ckpt_dir("tiny") / "config.json"), "--tp", "2", "--ep", "2", str(root / "from_config")])
    return root / "ckpt", root / "engine", root / "from_config"


def _config(engine: Path) -> dict:
    return json.loads((engine / "config.json").read_text())


@NEEDS_K3_CONFIG
def test_one_graph_per_kind_for_any_layer_count():
    """K3's 93 layers at TP8/EP8 and the tiny model's 10 need the same seven graphs: export
    work does not grow with the layers (the monolithic export grew as L², DESIGN §10)."""
    tiny = SegmentPlan(load_config("examples/tiny-k3"), World(), torch.float32, BS)
    k3 = SegmentPlan(load_config(K3_CONFIG), World(8, 8), torch.bfloat16, 64)
    assert list(tiny.specs) == list(k3.specs) and set(k3.specs) == set(KINDS)
    assert len(k3.layers) == 93
    kinds = [k for ls in k3.layers for k in ls.kinds]
    assert kinds.count("moe") == kinds.count("moe_combine") == 92 and kinds.count("dense_mlp") == 1
    # the local shapes of rank 0 of 8: 12 of 96 MLA heads, 112 of 896 experts, 1/8 of the vocab
    moe = {t.name: t for t in k3.specs["moe"].inputs}
    assert moe["mlp.experts.w13.weight_packed"].shape == (112, 2 * 3072, 3584 // 2)
    assert moe["mlp.experts.w13.weight_packed"].dtype == torch.int8
    assert moe["mlp.router.weight"].shape == (896, 7168) and moe["expert_offset"].role == "rank"
    assert {t.name: t for t in k3.specs["head"].inputs}["lm_head.weight"].shape == (163840 // 8, 7168)
    assert k3.specs["kda_attention"].blocks == (0, 8) and k3.specs["mla_attention"].blocks == (1, 8)
    assert k3.specs["head"].blocks == (8, 8) == (k3.cfg.num_attn_res_blocks,) * 2
    assert [k3.expert_offset(r) for r in range(8)] == [112 * r for r in range(8)]


def test_segments_pass_the_checker_and_take_every_weight_as_an_input(world1, world2):
    for engine in (world1[1], world2[1]):
        config = _config(engine)
        assert sorted(s["kind"] for s in config["segments"]) == sorted(KINDS)
        for seg in config["segments"]:
            graph = check_segment(engine / seg["onnx"])  # full_check + strict shape inference; raises
            assert [i.name for i in graph.graph.input] == [t["name"] for t in seg["inputs"]]
            assert [o.name for o in graph.graph.output] == [t["name"] for t in seg["outputs"]]
            # no weights inside: initializers are the exporter's small constants only
            assert sum(onnx.numpy_helper.to_array(i).size for i in graph.graph.initializer) <= 64, seg["kind"]
            types = {i.name: i.type.tensor_type.elem_type for i in graph.graph.input}
            for t in seg["inputs"]:
                if t["dtype"] == "int8":  # MXFP4 bytes, carried as INT8 (schemas.BYTES_ONNX_TYPE)
                    assert types[t["name"]] == onnx.TensorProto.INT8
            plugins = sorted({n.op_type for n in graph.graph.node if n.domain == DOMAIN})
            assert plugins == seg["plugins"]
            assert seg["profiles"]["order"] == ["prefill", "decode"]
            for phase in ("prefill", "decode"):
                assert set(seg["profiles"][phase]) == {t["name"] for t in seg["inputs"]}
        assert {p["name"] for p in config["plugins"]} == {s for seg in config["segments"] for s in seg["plugins"]}


def test_every_rank_tensor_feeds_exactly_one_weight_input_per_use(world1, world2):
    """The engine dir names, for every layer, the checkpoint tensor behind each weight input:
    together they are exactly the rank file's tensors, each used once."""
    for ckpt, engine in (world1, world2[:2]):
        config = _config(engine)
        feeds = list(config["embed"]["weights"].values()) + list(config["head"]["weights"].values())
        for layer in config["layers"]:
            feeds += [t for seg in layer["segments"] for t in seg["weights"].values()]
        assert len(feeds) == len(set(feeds))
        for rank in range(config["mapping"]["world_size"]):
            assert set(read_header(ckpt / f"rank{rank}.safetensors")) == set(feeds)
        kinds = [[s["kind"] for s in layer["segments"]] for layer in config["layers"]]
        assert kinds[0] == ["kda_attention", "dense_mlp"] and kinds[3] == ["mla_attention", "moe", "moe_combine"]
    ranks = _config(world2[1])["ranks"]
    assert [(r["vocab_start"], r["expert_offset"]) for r in ranks] == [(0, 0), (512, 4)]


def test_config_only_build_equals_the_checkpoint_build(world2):
    """`--hf-config --tp 2 --ep 2` (no checkpoint: a world that need not exist) writes the same
    graphs, segment list, layer feeds and rank offsets as the build from the tp2/ep2 conversion."""
    _, engine, from_config = world2
    a, b = _config(engine), _config(from_config)
    for key in ("segments", "layers", "embed", "head", "ranks", "mapping", "dtype", "limits", "plugins"):
        assert a[key] == b[key], key
    assert b["checkpoint"] is None and b["hf_config"].endswith("config.json")
    for seg in a["segments"]:
        assert (engine / seg["onnx"]).read_bytes() == (from_config / seg["onnx"]).read_bytes(), seg["kind"]


@pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX not installed")
def test_tensorrt_rtx_builds_one_weightless_plan_per_kind(world1):
    """Plans of megabytes (the monolithic tiny plan, weights inside, was 21 MiB), streamed to
    disk, two profiles each; the AttnRes block count's profile starts at 0 (layer 0)."""
    config = _config(world1[1])
    assert config["builder"]["module"] == "tensorrt_rtx_bindings"
    for seg in config["segments"]:
        assert seg["plan"] == f"segments/{seg['kind']}.plan"
        assert 0 < (world1[1] / seg["plan"]).stat().st_size < 8 << 20, seg["kind"]
    kda = next(s for s in config["segments"] if s["kind"] == "kda_attention")
    assert kda["profiles"]["prefill"]["blocks"][0][0] == 0 and kda["attn_res_blocks"] == [0, 2]


def test_engine_executor_step_equals_the_model(world1):
    """Prefill of two prompts, a decode step, then decodes mixed with a new prompt: logits and
    every cache pool against the torch model (prefill op forms, as the segments hold)."""
    ckpt, engine = world1
    model = load_model(ckpt, dtype=torch.float32)
    ref = model.allocate_caches(12, BS, 3)
    ex = EngineExecutor(engine, num_blocks=12, max_slots=3)
    run, profiles = ex.backend.run, []
    ex.backend.run = lambda kind, feeds, outs, phase: profiles.append(phase) or run(kind, feeds, outs, phase)
    for i, (step, decode) in enumerate(zip(_steps(), PHASES)):
        torch.testing.assert_close(ex.execute(step, decode), model(step, ref, decode=False), rtol=0, atol=2e-4,
                                   msg=f"logits of step {i}")
        # every segment of a step runs on the profile of the phase the caller decided
        assert set(profiles) == {"decode" if decode else "prefill"}, (i, set(profiles))
        profiles.clear()
    for pool in ("latent", "conv", "recurrent"):
        for layer, t in getattr(ref, pool).items():
            torch.testing.assert_close(getattr(ex.caches, pool)[layer], t, rtol=0, atol=2e-4, msg=f"{pool} {layer}")


def _prompts():
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1024, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return prompts, [SamplingParams(max_new_tokens=3 + i % 6) for i in range(len(prompts))]


def _generate(executor, eos) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(executor, EngineConfig(**RUNNER), eos_token_ids=(eos,))
    prompts, params = _prompts()
    return [r.output_token_ids for r in engine.generate(prompts, params)], engine


def _torch_tokens(ckpt) -> list[list[int]]:
    model = load_model(ckpt, dtype=torch.float32)
    caches = K3Caches.allocate(model.config, RUNNER["num_blocks"], BS, RUNNER["max_slots"], torch.float32)
    tokens, engine = _generate(TorchExecutor(model, caches, "cpu"), model.config.eos_token_id)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.computed_tokens <= RUNNER["max_num_tokens"] * engine.stats.num_steps
    return tokens


def test_inflight_greedy_tokens_equal_the_torch_executor(world1):
    ckpt, engine_dir = world1
    expected = _torch_tokens(ckpt)
    ex = EngineExecutor(engine_dir, num_blocks=RUNNER["num_blocks"], max_slots=RUNNER["max_slots"])
    tokens, engine = _generate(ex, ex.cfg.eos_token_id)
    assert engine.scheduler.num_preemptions > 0  # preempted by recompute, and chunked (40 > 16 tokens)
    assert tokens == expected


def _rank_worker(rank: int, port: int, engine_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ex = EngineExecutor(engine_dir, num_blocks=RUNNER["num_blocks"], max_slots=RUNNER["max_slots"])
        # every rank runs the same deterministic scheduler, so the ranks' steps (and collectives) pair up
        tokens, engine = _generate(ex, ex.cfg.eos_token_id)
        torch.save((tokens, engine.scheduler.num_preemptions), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_world2_ranks_over_gloo_give_the_world1_tokens(world2, ckpt_dir, tmp_path):
    """tp2/ep2: heads, MLP slices, experts (offset 4 on rank 1) and vocab rows split over two
    processes; the segments' partial sums all-reduced and the vocab shards gathered between
    segments give the tokens of the unsharded model."""
    ckpt, engine, _ = world2
    mp.spawn(_rank_worker, args=(free_port(), str(engine), str(tmp_path)), nprocs=2, join=True)
    expected = _torch_tokens(ckpt_dir("tiny"))
    for rank in range(2):
        tokens, preemptions = torch.load(tmp_path / f"rank{rank}.pt")
        assert preemptions > 0
        assert tokens == expected, f"rank {rank}"


def _run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", *args, "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "4",
                                       "--device", "cpu", "--json", "--quiet", "--threads", "1"])
    return result.exit_code, result.stdout if result.exit_code == 0 else result.output


def test_run_executes_an_engine_dir_and_names_a_mismatching_checkpoint(world1, world2, ckpt_dir, tmp_path):
    ckpt, engine = world1
    code, out = _run(str(engine))
    assert code == 0, out
    ref_code, ref = _run(str(ckpt), "--dtype", "float32")
    assert ref_code == 0, ref
    assert json.loads(out)["outputs"][0]["output_ids"] == json.loads(ref)["outputs"][0]["output_ids"]
    # another model (bf16 experts, another quantization) and another mapping: one line each
    code, out = _run(str(engine), "--checkpoint", str(world2[0]))
    assert code == 1 and "is another model than engine" in out and "Traceback" not in out
    convert_checkpoint(ckpt_dir("tiny"), tmp_path / "tp1", 1, 1, progress=False)
    code, out = _run(str(world2[1]), "--checkpoint", str(tmp_path / "tp1"))
    assert code == 1 and "converted for tp 1, ep 1; engine" in out and len(out.strip().splitlines()) == 1
    code, out = _run(str(world2[2]))  # built from a config alone: it names no checkpoint
    assert code == 1 and "pass --checkpoint" in out


@NEEDS_K3_CONFIG
def test_build_refuses_a_world_the_config_cannot_split(tmp_path):
    result = CliRunner().invoke(main, ["build", "--hf-config", str(K3_CONFIG), "--tp", "3", str(tmp_path / "out"),
                                       "--builder", "none", "--quiet"])
    assert result.exit_code == 1
    assert result.output.strip().startswith("k3-trt build: error: ") and len(result.output.strip().splitlines()) == 1
    assert "vocab_size = 163840 is not divisible by --tp 3" in result.output
    assert not (tmp_path / "out").exists()


def test_segment_build_api_rejects_a_world_for_a_converted_checkpoint(world1, tmp_path):
    with pytest.raises(ValueError, match="mapping fixes them"):
        build_segmented_engine_dir(tmp_path / "x", BuildLimits(), checkpoint=world1[0], world=World(2, 2))


def test_run_starts_the_ranks_of_a_world2_engine_dir(world2, ckpt_dir):
    """`run ENGINE_DIR` of a tp2/ep2 engine starts rank 1 itself (runtime/distributed.py) and
    gives the tokens of the unsharded HF model run by the torch executor."""
    code, out = _run(str(world2[1]))
    assert code == 0, out
    ref_code, ref = _run(str(ckpt_dir("tiny")), "--dtype", "float32", "--block-size", str(BS))
    assert ref_code == 0, ref
    assert json.loads(out)["outputs"][0]["output_ids"] == json.loads(ref)["outputs"][0]["output_ids"]


def test_run_names_a_damaged_engine_config_field(world1, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(world1[1], engine)
    config = _config(engine)
    config["mapping"]["tp_size"] = "two"
    (engine / "config.json").write_text(json.dumps(config))
    code, out = _run(str(engine))
    assert code == 1 and "field `mapping.tp_size` must be a positive integer" in out
    assert len(out.strip().splitlines()) == 1


PHASES = [False, True, False]  # of _steps(): a prefill, a pure decode, decodes beside a prompt


def _steps() -> list:
    return [build_step([(list(range(3, 21)), 0, 0, [0, 1, 2, 3, 4]), (list(range(40, 45)), 0, 2, [5, 6])], BS),
            build_step([([7], 18, 0, [0, 1, 2, 3, 4]), ([9], 5, 2, [5, 6])], BS),
            build_step([([8], 19, 0, [0, 1, 2, 3, 4]), ([4, 5, 6], 0, 1, [7]), ([10], 6, 2, [5, 6])], BS)]


def _variant_worker(rank: int, port: int, engine_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ex = EngineExecutor(engine_dir, num_blocks=12, max_slots=3)
        torch.save([ex.execute(step, decode) for step, decode in zip(_steps(), PHASES)], f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_plain_residual_rope_config_at_tp2_ep1(tmp_path):
    """The branches K3 does not use: no AttnRes (plain pre-norm residual, no block inputs),
    RoPE MLA (a `positions` input), and tp2 with ep1 (each expert's intermediate split over
    the two ranks, moe_tp 2): the engine's logits at world 2 against the HF model at world 1."""
    config = preset_config("tiny")
    config.pop("attn_res_block_size")
    config["mla_use_nope"] = False
    hf = write_checkpoint(tmp_path / "hf", config, synth_tensors(parse_config(config), 0))
    convert_checkpoint(hf, tmp_path / "ckpt", 2, 1, progress=False)
    build_segmented_engine_dir(tmp_path / "engine", BuildLimits(4, 64, 64, BS), checkpoint=tmp_path / "ckpt",
                               dtype=torch.float32, builder="none", log=lambda msg: None)
    engine = _config(tmp_path / "engine")
    mla = next(s for s in engine["segments"] if s["kind"] == "mla_attention")
    names = {t["name"] for t in mla["inputs"]}
    assert "positions" in names and "blocks" not in names and mla["attn_res_blocks"] is None
    mp.spawn(_variant_worker, args=(free_port(), str(tmp_path / "engine"), str(tmp_path)), nprocs=2, join=True)
    model = load_model(hf, dtype=torch.float32)
    caches = model.allocate_caches(12, BS, 3)
    expected = [model(step, caches, decode=False) for step in _steps()]
    for rank in range(2):
        for i, (got, want) in enumerate(zip(torch.load(tmp_path / f"rank{rank}.pt"), expected)):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4, msg=f"rank {rank} step {i}")
