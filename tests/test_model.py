"""Whole-model invariants on the tiny K3 (spec §8's suggested checks).

fp64 runs compare code paths that are mathematically identical (chunked vs recurrent KDA,
non-absorbed vs absorbed MLA, batched vs alone), so they agree to ~1e-12; the tolerance
1e-9 leaves room for summation-order differences over 10 layers and nothing else."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import dequantized_state

from k3_trtllm.checkpoint.loader import load_hf_state_dict
from k3_trtllm.checkpoint.synth import preset_config, synth_tensors, write_checkpoint
from k3_trtllm.config import parse_config
from k3_trtllm.model import build_step, load_model, model_from_state_dict
from k3_trtllm.model.step import is_pure_decode

BS = 16  # latent-cache block size used throughout
F64 = dict(rtol=1e-9, atol=1e-9)


def _table(first_block: int, n: int) -> list[int]:
    return list(range(first_block, first_block + n))


def _prompt(seed: int, n: int, vocab: int = 1024) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _caches_equal(a, b, **tol):
    for pool in ("latent", "conv", "recurrent"):
        for layer, tensor in getattr(a, pool).items():
            torch.testing.assert_close(getattr(b, pool)[layer], tensor, **tol, msg=f"{pool} cache of layer {layer}")


def _incremental(model, ids, prefix, table):
    caches = model.allocate_caches(16, BS, 4)
    rows = [model(build_step([(ids[:prefix], 0, 0, table)], BS, logits_all=True), caches, decode=False)]
    for i in range(prefix, len(ids)):
        rows.append(model(build_step([([ids[i]], i, 0, table)], BS), caches, decode=True))
    return torch.cat(rows), caches


def _write(tmp_path, name, config):
    return write_checkpoint(tmp_path / name, config, synth_tensors(parse_config(config)))


@pytest.mark.parametrize("variant", ["tiny", "rope", "no-attn-res"])
def test_prefix_prefill_then_decode_equals_full_prefill(variant, ckpt_dir, tmp_path):
    if variant == "tiny":
        path = ckpt_dir("tiny")
    else:
        config = preset_config("tiny")
        if variant == "rope":
            config["mla_use_nope"] = False
        else:
            config["attn_res_block_size"] = None
        path = _write(tmp_path, variant, config)
    model = load_model(path, dtype=torch.float64)
    ids, table = _prompt(0, 70), _table(0, 5)  # 70 tokens: crosses the 64-token KDA chunk
    full_caches = model.allocate_caches(16, BS, 4)
    full = model(build_step([(ids, 0, 0, table)], BS, logits_all=True), full_caches, decode=False)
    incremental, caches = _incremental(model, ids, 65, table)
    torch.testing.assert_close(incremental, full, **F64)
    _caches_equal(full_caches, caches, **F64)


def test_prefix_then_decode_bf16_close_to_full(ckpt_dir):
    """bf16 activations: the decode forms (recurrent KDA, absorbed MLA) reproduce the prefill
    forms only to fp32 rounding, and a bf16 rounding of a layer output can flip on that
    difference and propagate. Measured: relative logit error 2e-8 on this prompt (the
    roundings agree); one flip in an early layer gives ~1e-3. Bound 1e-2: a 10x margin over
    that, and 100x below what a wrong state or cache hand-off gives (O(1))."""
    model = load_model(ckpt_dir("tiny"), dtype=torch.bfloat16)
    ids, table = _prompt(1, 70), _table(0, 5)
    full = model(build_step([(ids, 0, 0, table)], BS, logits_all=True), model.allocate_caches(16, BS, 4), decode=False)
    incremental, _ = _incremental(model, ids, 65, table)
    rel = (incremental - full).norm() / full.norm()
    assert rel < 1e-2, rel
    assert (incremental.argmax(-1) == full.argmax(-1)).float().mean() > 0.95


def test_mixed_step_equals_each_sequence_alone(ckpt_dir):
    """3 prefill sequences (one crossing a KDA chunk) and 5 decode sequences in one step."""
    model = load_model(ckpt_dir("tiny"), dtype=torch.float64)
    prefills = [_prompt(10 + i, n) for i, n in enumerate((5, 17, 66))]
    decodes = [_prompt(20 + i, n) for i, n in enumerate((1, 3, 16, 30, 64))]
    slots = list(range(8))
    tables = [_table(5 * i, 5) for i in range(8)]

    def prime(caches):
        # decode sequences have their prompt minus the last token cached already
        for j, ids in enumerate(decodes):
            if len(ids) > 1:
                model(build_step([(ids[:-1], 0, slots[3 + j], tables[3 + j])], BS), caches, decode=False)

    batched_caches = model.allocate_caches(40, BS, 8)
    prime(batched_caches)
    seqs = [(ids, 0, slots[i], tables[i]) for i, ids in enumerate(prefills)]
    seqs += [([ids[-1]], len(ids) - 1, slots[3 + j], tables[3 + j]) for j, ids in enumerate(decodes)]
    batched = model(build_step(seqs, BS), batched_caches, decode=False)

    alone_caches = model.allocate_caches(40, BS, 8)
    prime(alone_caches)
    alone = torch.cat([model(build_step([s], BS), alone_caches, decode=is_pure_decode([s])) for s in seqs])
    torch.testing.assert_close(batched, alone, **F64)
    _caches_equal(alone_caches, batched_caches, **F64)


def test_mxfp4_model_equals_bf16_model_with_dequantized_experts(ckpt_dir):
    """Same bf16 path; the only difference is where dequantisation happens, which is exact."""
    path = ckpt_dir("tiny-mxfp4")
    cfg_q, state_q = load_hf_state_dict(path)
    state = dequantized_state(state_q)
    config = copy.deepcopy(preset_config("tiny-mxfp4"))
    del config["quantization_config"]
    cfg = parse_config(config)
    assert cfg_q.moe.mxfp4 and not cfg.moe.mxfp4
    quantized = model_from_state_dict(cfg_q, state_q)
    dequantized = model_from_state_dict(cfg, state)
    step = build_step([(_prompt(3, 40), 0, 0, _table(0, 3)), (_prompt(4, 9), 0, 1, _table(3, 1))], BS)
    a = quantized(step, quantized.allocate_caches(8, BS, 2), decode=False)
    b = dequantized(step, dequantized.allocate_caches(8, BS, 2), decode=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mxfp4", "tiny-nested", "kernel-shapes"])
def test_synthetic_models_have_healthy_logits(preset, ckpt_dir):
    model = load_model(ckpt_dir(preset), dtype=torch.bfloat16)
    logits = model(build_step([(_prompt(5, 24), 0, 0, _table(0, 2))], BS, logits_all=True),
                   model.allocate_caches(4, BS, 1), decode=False)
    assert torch.isfinite(logits).all()
    assert 1.0 < logits.std().item() < 5.0
    # not a flat model: different positions predict different tokens
    assert logits.argmax(-1).unique().numel() > 4


def test_nested_checkpoint_equals_flat(ckpt_dir):
    flat = load_model(ckpt_dir("tiny"), dtype=torch.float32)
    nested = load_model(ckpt_dir("tiny-nested"), dtype=torch.float32)
    step = build_step([(_prompt(6, 12), 0, 0, _table(0, 1))], BS)
    assert torch.equal(flat(step, flat.allocate_caches(2, BS, 1), decode=False),
                       nested(step, nested.allocate_caches(2, BS, 1), decode=False))


@pytest.mark.parametrize("preset", ["tiny", "tiny-mxfp4"])
def test_moe_terms_added_by_the_mix_equal_the_summed_output(preset, ckpt_dir, monkeypatch):
    """The AttnRes mixes take the latent MoE's routed and shared outputs as two terms and add them
    (on CUDA inside the mix kernel): the logits and caches must be bitwise those of the model that
    adds them itself, in bf16 where each add rounds."""
    from k3_trtllm.model.layers import LatentMoE
    model = load_model(ckpt_dir(preset), dtype=torch.bfloat16)
    assert any(isinstance(layer.mlp, LatentMoE) and layer.mlp.moe.num_shared_experts
               for layer in model.transformer.layers)
    step = build_step([(_prompt(6, 20), 0, 0, _table(0, 2)), (_prompt(7, 5), 0, 1, _table(2, 1))], BS)
    caches = model.allocate_caches(4, BS, 2)
    got = model(step, caches, decode=False)
    summed = LatentMoE.forward

    def one_term(self, x, terms=False):  # the sum made by the MoE itself, handed on as one term
        return (summed(self, x),) if terms else summed(self, x)
    monkeypatch.setattr(LatentMoE, "forward", one_term)
    summed_caches = model.allocate_caches(4, BS, 2)
    want = model(step, summed_caches, decode=False)
    assert torch.equal(got, want)
    _caches_equal(caches, summed_caches, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_padded_kda_in_proj_keeps_the_columns(ckpt_dir, dtype):
    """A CPU model keeps the checkpoint's KDA in_proj rows (layers.prepare_weights_ pads CUDA
    weights only), so its bits never depend on the BLAS's blocking of a wider product. Padded
    (KdaAttention.pad_in_proj_, as on CUDA: the tiny model's 548 rows become 552), the state_dict
    stays the checkpoint's tensors, and logits and every cache match the unpadded model over a
    prefill and decode steps: the padded product keeps the same columns (a shifted or dropped
    column is an O(1) error), up to the summation order the BLAS picks for 552 rows (fp64 on an
    AMD EPYC host differs in the last bits; the tolerances are a few hundred ulps of each dtype)."""
    plain = load_model(ckpt_dir("tiny"), dtype=dtype)
    kda = [m for m in plain.modules() if type(m).__name__ == "KdaAttention"]
    assert kda and all(m._in_proj_weight() is m.in_proj.weight for m in kda)
    model = copy.deepcopy(plain)
    for m in (m for m in model.modules() if type(m).__name__ == "KdaAttention"):
        m.pad_in_proj_()
        assert m._in_proj_weight().shape[0] == 552 and m.in_proj.weight.shape[0] == sum(m.split) == 548
    state = model.state_dict()
    assert all(state[n].shape == t.shape and torch.equal(state[n], t) for n, t in plain.state_dict().items())
    ids = _prompt(7, 40)
    table = _table(0, 4)
    got, got_caches = _incremental(model, ids, 33, table)
    want, want_caches = _incremental(plain, ids, 33, table)
    tol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    _caches_equal(got_caches, want_caches, rtol=tol, atol=tol)
