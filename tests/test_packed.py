"""fp4rl.packed.build_sampler_model: refusals at build time of what cannot run here."""

import pytest
import torch
from rl_fixtures import converted_model

from fp4rl.nvfp4 import cpu_gemm
from fp4rl.packed import build_sampler_model
from fp4rl.sampler import Sampler

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def test_nvfp4_gemm_is_refused_at_build_time_without_the_kernel(monkeypatch):
    """nvfp4_gemm=True on a CPU without the AMX kernel was accepted, then the first forward raised inside
    cpu_gemm.linear; it is refused when the copy is built, as prepack=True is, naming the fix."""
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    model, _ = converted_model(CONFIG, "nvfp4-w4a16")
    kw = dict(dtype=torch.bfloat16, device="cpu", cache_dequantized=False, fuse=True)
    with pytest.raises(ValueError, match=r"nvfp4_gemm=True needs .*cpu_gemm.*pass nvfp4_gemm=False"):
        build_sampler_model(model, nvfp4_gemm=True, **kw)
    with pytest.raises(ValueError, match=r"pass nvfp4_gemm=False"):
        Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, nvfp4_gemm=True)
    copy = build_sampler_model(model, nvfp4_gemm=False, **kw)  # the fix named works
    assert copy(torch.tensor([[1, 2, 3]])).isfinite().all()
    assert not Sampler(model, eos_token_ids=[], dtype=torch.bfloat16).nvfp4_gemm  # the default: off here


def test_fusing_frees_each_groups_unfused_weights_as_it_goes(monkeypatch):
    """fuse_linears over BF16 linears: each group's unfused weights are freed once its fused buffer holds
    them, not at the end (a list of every module kept the replaced nn.Linears alive: the full 48-layer
    Qwen3-30B-A3B's BF16 sampler peaked at 57.8 + 36 GiB and ran out of an 80 GB card's memory)."""
    import weakref

    from rl_fixtures import tiny_model

    from fp4rl.model import CausalLM
    from fp4rl.packed import FusedGroup, fuse_linears

    model = tiny_model(moe=True)
    refs, alive = [], []
    init = FusedGroup.__init__

    def counting_init(self, members):
        alive.append(sum(r() is not None for r in refs))  # earlier groups' unfused weights still alive
        for m in members:
            refs.append(weakref.ref(m.weight))
            if m.weight.data_ptr() in loaded:  # the state dict's tensor behind the Parameter (assign=True)
                refs.append(loaded[m.weight.data_ptr()])
        init(self, members)

    loaded, load = {}, CausalLM.load_state_dict

    def recording_load(self, state, *args, **kwargs):
        loaded.update({t.data_ptr(): weakref.ref(t) for t in state.values()})
        return load(self, state, *args, **kwargs)

    monkeypatch.setattr(FusedGroup, "__init__", counting_init)
    monkeypatch.setattr(CausalLM, "load_state_dict", recording_load)
    groups = fuse_linears(model)
    assert len(groups) > 4 and any(len(g.members) == 2 for g in groups)
    assert max(alive) <= 1, alive  # at most the loop's last member of the group before
    assert model(torch.tensor([[1, 2, 3]])).isfinite().all()
    # the sampler's BF16 copy fuses its own tensors: the state dict it loaded them from must not hold them
    refs.clear()
    alive.clear()
    copy = build_sampler_model(model, dtype=torch.bfloat16, device="cpu", cache_dequantized=False, fuse=True)
    assert loaded and len(alive) == len(groups) and max(alive) <= 1, alive
    assert copy(torch.tensor([[1, 2, 3]])).isfinite().all()


@pytest.mark.gpu
def test_a_cuda_copy_of_a_host_trainer_quantizes_on_the_gpu_to_the_trainer_bytes():
    """A sampler on the GPU built from a trainer in host memory (a 30B's BF16 trainer does not fit beside
    its sampler on an 80 GB card): each weight is quantized on the GPU, uncached, to the bytes of the
    trainer's own Q(W) (fused groups' shared global scale, experts), and the trainer's caches stay empty."""
    from rl_fixtures import tiny_model

    from fp4rl.packed import PackedNVFP4Linear
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import NVFP4Linear, convert, invalidate

    trainer = convert(tiny_model(moe=True), PrecisionContract("nvfp4-w4a16"))
    with torch.no_grad():
        trainer.model.layers[0].self_attn.v_proj.weight.mul_(7)
    invalidate(trainer)
    copy = build_sampler_model(trainer, dtype=torch.bfloat16, device="cuda", cache_dequantized=False,
                               fuse=True)
    linears = dict(trainer.named_modules())
    assert all(m._qweight is None for m in linears.values() if isinstance(m, NVFP4Linear))
    packed = {n: m for n, m in copy.named_modules() if isinstance(m, PackedNVFP4Linear)}
    assert packed and any(".experts." in n for n in packed)
    for name, m in packed.items():
        q, ref = m.quantized_weight(), linears[name].quantized_weight()  # ref: quantized on the CPU
        assert q.data.is_cuda
        for f in ("data", "block_scale", "global_scale"):
            assert torch.equal(getattr(q, f).cpu().reshape(-1).view(torch.uint8),
                               getattr(ref, f).reshape(-1).view(torch.uint8)), (name, f)
