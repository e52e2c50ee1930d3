"""Batched rollout on packed NVFP4 weights: KV cache, per-token logprobs, routing replay, weight sync.

The sampler runs the trainer's own model code (fp4rl.model) on its own copy of the weights, in
which every linear the precision contract quantizes holds only the packed NVFP4 bytes the
trainer's forward computed with and computes exactly what the trainer computes (W4A4: the same
per-token activation quantizer); see fp4rl/packed.py. Weight sync (fp4rl/weight_sync.py) writes
new bytes in place; the KV cache is BF16, FP8 or NVFP4 (fp4rl/kvcache.py). On CUDA in bfloat16
(`kernels=True`) the packed linears, routed experts and quantized-KV decode attention run the
Triton kernels, the KV cache is static and every decode step is a CUDA graph replay; see
fp4rl/gpu_decode.py.

Generation (`Sampler.generate`), for P prompts x n samples:
1. prefill: the P distinct prompts, left-padded into one [P, T_p] batch with an attention mask,
   run once; lm_head only on the last position. Their cache rows are then copied n times
   (`SamplerKVCache.select`), so the n samples of a prompt share one prefill.
2. decode: one token per active row per step, written to a preallocated cache slot; positions
   count real tokens, so a left-padded row sees the positions of the unpadded prompt.
3. a row finishes on an EOS token ("eos"), a stop string in its decoded text ("stop", the text is
   cut before it, the tokens are kept) or max_new_tokens ("length"); finished rows leave the
   batch (the cache, mask and positions are compacted), so they cost nothing afterwards.
Sampling draws from softmax(logits / T) restricted by top-k then top-p, by inverse CDF with a
seeded torch.Generator (same seed, same inputs -> same completions; one generator serves the whole
batch, so a prompt's completions also depend on the other prompts and on n). The logprob recorded for a token
is log_softmax(logits / T) (T = 1 when greedy), computed in fp32 like grpo.token_logprobs, and
*not* renormalised by top-k/top-p: it is the distribution the trainer scores. The logits themselves are
the lm_head's output in the sampler's dtype: a BF16 sampler's are rounded to BF16 before the fp32
log_softmax (up to half a BF16 step: 1/32 at |logit| in [8, 16)), which a trainer computing FP32 logits does
not do; that rounding is part of the BF16 sampler's logprob mismatch.

MoE routing replay: the experts chosen for every position the trainer scores (the prompt and all
completion tokens but the last) come back as `Completion.routing` [num_moe_layers, L - 1, top_k] int16,
ready for `model(ids[:, :-1], routing=[r[i][None] for i ...])`.
"""

from __future__ import annotations

import contextlib
import operator
import time
import warnings
from dataclasses import dataclass

import torch

from fp4rl import cpu_head, gpu_trace, trace
from fp4rl.batch import MAX_EXPERTS, ROUTING_DTYPE
from fp4rl.cpu_ops import FastCPUDecoder
from fp4rl.kvcache import KV_CACHE_KINDS, make_kv_cache
from fp4rl.model import CausalLM
from fp4rl.nvfp4 import cpu_gemm
from fp4rl.packed import PackedNVFP4Linear, PrepackedLinear, build_sampler_model, onednn_bf16_available
from fp4rl.sampling import SamplingParams, _generator_seed, inverse_cdf_sample, nucleus, sample_next  # noqa: F401

__all__ = ["Completion", "PackedNVFP4Linear", "Sampler", "SamplingParams", "sample_next"]

FINISH_REASONS = ("eos", "stop", "length")


# ----------------------------------------------------------------------------------------------
# Requests and results


def _token_ids(ids, vocab_size: int) -> set[int]:
    """eos_token_ids as a set of ints: one int or an iterable of ints (a list, a tensor, a NumPy array);
    anything else is refused by name (a tensor's elements, or strings, never matched). Ids past the model's
    vocabulary (it can never sample them) are dropped with a warning."""
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    try:
        items = [operator.index(ids)] if not hasattr(ids, "__iter__") else [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"Sampler eos_token_ids={ids!r}: must be a token id or an iterable of token ids "
                         "(ints), e.g. [tokenizer.eos_token_id]") from None
    bad = [t for t in items if not 0 <= t < vocab_size]
    if bad:
        warnings.warn(f"Sampler eos_token_ids: {bad[:5]} are not ids of the model's {vocab_size}-token "
                      "vocabulary (it never samples them): ignored", stacklevel=3)
    return {t for t in items if 0 <= t < vocab_size}


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """sampler logprob of each completion token under log_softmax(logits / T) (T = 1 when greedy),
    not renormalised by top-p/top-k: the distribution the trainer scores."""
    text: str
    """decoded completion (special tokens skipped; cut before the stop string when one matched)."""
    finish_reason: str  # "eos" | "stop" | "length"
    policy_version: int
    routing: torch.Tensor | None
    """MoE: experts [num_moe_layers, len(prompt_ids) + len(completion_ids) - 1, top_k] (int16,
    fp4rl.batch.ROUTING_DTYPE) for every position the trainer scores, replayable with model(..., routing=...);
    None for dense models."""
    guidance: dict | None = None
    """TRACE (SamplingParams.guidance > 0): per guided input (fp4rl.trace.input_key), the guidance
    of the len(prompt_ids) + len(completion_ids) - 1 tokens the sampler fed, as Guidance.to_dict()
    (a routed experts' down input: [tokens, top_k] rows, one per slot)."""


# ----------------------------------------------------------------------------------------------
# End-of-sequence ids


def default_eos_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion by default: the tokenizer's eos_token_id, the model config's and
    generation_config.json's (kept by fp4rl.load_model as model.generation_eos_token_ids); a chat model may
    end its turns on any of them. Sorted, so it travels (e.g. to Ray actors) as plain data."""
    ids: set[int] = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), model.config.extra.get("eos_token_id"),
                getattr(model, "generation_eos_token_ids", None)):
        ids |= set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    return sorted(ids)


class Sampler:
    """Generates completions with packed NVFP4 weights; `load(payload)` syncs weights from the trainer.

    model        a CausalLM converted with qat.convert (any contract, "bf16" included); it is copied.
    tokenizer    a Hugging Face tokenizer (needed for str prompts, text and stop strings) or None.
    kv_cache     "bf16" (the model's dtype), "fp8" or "nvfp4"; see fp4rl.kvcache.
    max_seq_len  prompt + completion limit (default: the config's max_position_embeddings).
    dtype        compute dtype of the copy (default: the trainer model's).
    cache_dequantized  keep DQ(W) per weight version (default: on for the CPU, off on CUDA).
    fuse         one GEMM (and one Q(x)) for q/k/v and for gate/up (default: on for the CPU).
    eos_token_ids      tokens that end a completion (default: the tokenizer's eos_token_id, the model
                       config's and generation_config.json's (fp4rl.load_model keeps it), ids or lists).
    kernels      Triton NVFP4 kernels, static KV cache, grouped experts (fp4rl/gpu_decode.py); needs
                 dtype bfloat16 (default: on for CUDA in bfloat16, off elsewhere; the CPU runs them
                 only under TRITON_INTERPRET=1).
    cuda_graphs  with kernels on CUDA: one CUDA graph per decode batch bucket (and TRACE guidance fraction:
                 guided generates record the guidance inside their graphs; default: on).
    prepack      BF16 on the CPU: every linear computes with its weight reordered once per weight
                 version for oneDNN, bit-identical to F.linear and 1.5-2.6x faster per GEMM (default:
                 on for a BF16 CPU sampler where torch's oneDNN supports BF16); see fp4rl/packed.py.
    cpu_ops      BF16 on the CPU: RMSNorm + residual, RoPE + KV write + attention and SiLU*up as fused C
                 kernels (fp4rl/cpu_ops.py; default: on for a BF16 CPU sampler where they build).
    fast_head    choose tokens (greedy, or temperature sampling without top-k/top-p) with one fused pass
                 instead of ~35 torch ops: the C code of fp4rl/cpu_head.py on the CPU, the Triton kernel
                 of fp4rl/kernels/sample_head.py with the kernel engine (default: on for a BF16 CPU
                 sampler where the C code builds and with kernels); the same draws from the generator,
                 same distribution, float32-rounding-level logprob differences.
    nvfp4_gemm   BF16 on the CPU: NVFP4 linears multiply up to 64 rows straight from the packed bytes
                 with the AMX kernel of fp4rl.nvfp4.cpu_gemm (no dequantized copy is kept; larger
                 prefills dequantize per call); default: on where that kernel is available.
    dense_rows   with kernels: the packed dense linears also keep DQ(W) in bfloat16 (+2 B per weight) and
                 calls of at least this many rows (large decode batches, prefill) run cuBLAS on it where
                 the GEMM tuner times it faster than the 4-bit kernels (always when not tuning): the
                 reference's arithmetic at the BF16 engine's speed (the H200's 4-bit kernels are slower than
                 cuBLAS from 64-128 rows: bench/RESULTS.md); routed experts stay on the grouped kernels.
                 0 (default): no copies.
    """

    def __init__(self, model: CausalLM, tokenizer=None, *, kv_cache: str = "bf16", device="cpu",
                 max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                 cache_dequantized: bool | None = None, fuse: bool | None = None, eos_token_ids=None,
                 policy_version: int = 0, kernels: bool | None = None, cuda_graphs: bool | None = None,
                 prepack: bool | None = None, nvfp4_gemm: bool | None = None, fast_head: bool | None = None,
                 cpu_ops: bool | None = None, dense_rows: int = 0):
        if not isinstance(model, CausalLM):
            raise TypeError(f"Sampler needs an fp4rl CausalLM (fp4rl.load_model + qat.convert), got "
                            f"{type(model).__name__}")
        if kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"Sampler kv_cache={kv_cache!r}: use one of {KV_CACHE_KINDS}")
        self.device = torch.device(device)
        self.dtype = dtype or model.model.embed_tokens.weight.dtype
        on_cpu = self.device.type == "cpu"
        cache_dequantized = on_cpu if cache_dequantized is None else cache_dequantized
        if kernels is None:
            kernels = self.device.type == "cuda" and self.dtype == torch.bfloat16
        fuse = (on_cpu or kernels) if fuse is None else fuse
        cpu_bf16 = on_cpu and self.dtype == torch.bfloat16

        def cpu_bf16_path(name: str, value: bool | None, available) -> bool:
            """A fast path of the BF16 CPU sampler: on by default where it can run, refused elsewhere."""
            if value is None:
                return cpu_bf16 and available()
            if value and not cpu_bf16:
                raise ValueError(f"Sampler {name}=True is for a BF16 sampler on the CPU (got {self.dtype} on "
                                 f"{self.device}); pass {name}=False or dtype=torch.bfloat16")
            return value

        self.prepack = prepack = cpu_bf16_path("prepack", prepack, onednn_bf16_available)
        self.nvfp4_gemm = nvfp4_gemm = cpu_bf16_path("nvfp4_gemm", nvfp4_gemm, cpu_gemm.available)
        cpu_ops = cpu_bf16_path("cpu_ops", cpu_ops, lambda: True)  # if unbuildable, fast_cpu_ops does nothing
        if fast_head is None:
            fast_head = (cpu_bf16 and cpu_head.available()) or kernels
        self.config = model.config
        limit = self.config.max_position_embeddings
        self.max_seq_len = limit if max_seq_len is None else max_seq_len
        n = self.max_seq_len
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"Sampler max_seq_len={max_seq_len!r}: must be an integer >= 2")
        if limit and self.max_seq_len > limit:
            raise ValueError(f"Sampler max_seq_len={max_seq_len}: more positions than the model's "
                             f"max_position_embeddings = {limit} (its RoPE and training stop there); use "
                             f"max_seq_len <= {limit}, or leave it out")
        self.model = build_sampler_model(model, dtype=self.dtype, device=self.device,
                                         cache_dequantized=cache_dequantized, fuse=fuse, prepack=prepack,
                                         nvfp4_gemm=nvfp4_gemm, cpu_ops=cpu_ops)
        self.fast_head = fast_head
        self.engine = None
        if not isinstance(dense_rows, int) or isinstance(dense_rows, bool) or dense_rows < 0:
            raise ValueError(f"Sampler dense_rows={dense_rows!r}: an integer >= 0 (0: off)")
        if dense_rows and not kernels:
            raise ValueError(f"Sampler dense_rows={dense_rows} is for the CUDA kernel engine (kernels=True: "
                             f"a bfloat16 sampler on CUDA); this sampler runs torch on "
                             f"{self.device} in {self.dtype}: pass dense_rows=0 (the CPU sampler caches "
                             "DQ(W) already)")
        self.dense_rows = dense_rows
        if kernels:
            from fp4rl.gpu_decode import DecodeEngine

            self.engine = DecodeEngine(self.model, graphs=True if cuda_graphs is None else cuda_graphs,
                                       dense_rows=dense_rows)
        self.tokenizer, self.kv_cache = tokenizer, kv_cache
        if eos_token_ids is None:
            eos_token_ids = default_eos_token_ids(model, tokenizer)
        self.eos_token_ids = _token_ids(eos_token_ids, self.config.vocab_size)
        # padded slots are masked, so any id in the vocabulary does; a pad token added to a tokenizer without
        # resizing the embeddings (an id past them) would fail the embedding lookup
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if isinstance(pad, int) and 0 <= pad < self.config.vocab_size else 0
        self.cpu_ops = isinstance(self.model.model, FastCPUDecoder)
        self.policy_version = policy_version
        self.weights_digest: str | None = None  # the digest of the last payload loaded (None: built weights)
        self.weights_error: str | None = None  # set by a load whose verification failed (see load)
        self.num_moe_layers = len(self.config.moe_layers)
        if self.num_moe_layers and self.config.num_experts > MAX_EXPERTS:
            raise ValueError(f"Sampler: {self.config.num_experts} experts do not fit the routing record's "
                             f"{ROUTING_DTYPE} (at most {MAX_EXPERTS})")
        # a list: generate appends time.perf_counter() each time a step's tokens reach the host (the decode
        # cadence, without prefill and setup: fp4rl.benchmarks.sampler_gpu's tokens/s); None: no clock
        self.step_clock: list[float] | None = None

    # -- weights -----------------------------------------------------------------------------
    def load(self, payload, *, verify: bool = False) -> None:
        """Apply a weight_sync.Payload in place. Everything is validated first (version, names,
        shapes, dtypes, checksums); a refused payload raises and leaves the old weights. With
        verify=True the sampler's tensors are re-hashed afterwards and must equal the payload's; if
        they do not (weight_sync.VerifyError: the copy went wrong, the old weights are gone) the
        sampler refuses to generate until a later load succeeds; likewise when the copy itself is
        interrupted (KeyboardInterrupt, a device error)."""
        from fp4rl.weight_sync import VerifyError, apply_payload

        try:
            apply_payload(self.model, payload, current_version=self.policy_version, verify=verify,
                          current_digest=self.weights_digest)
        except VerifyError as exc:
            self._invalidate()
            self.weights_error = f"v{payload.version} failed verification after loading: {exc}"
            raise
        except BaseException as exc:  # interrupted while copying: neither the old weights nor the new
            if getattr(exc, "weights_touched", False):
                self._invalidate()
                self.weights_error = (f"loading v{payload.version} was interrupted halfway "
                                      f"({type(exc).__name__}: {exc})")
            raise
        self._invalidate()
        self.policy_version, self.weights_digest, self.weights_error = payload.version, payload.digest, None

    def _invalidate(self) -> None:
        """Drop what the sampler derived from its weights (dequantized / prepacked / fused copies)."""
        for m in self.model.modules():
            if isinstance(m, PackedNVFP4Linear | PrepackedLinear):
                m.invalidate()
            plan = getattr(m, "plan", None)  # a KernelMoeBlock's expert stacks and their decode copies
            if plan is not None and callable(getattr(plan, "invalidate", None)):
                plan.invalidate()
        for group in self.model.fused_groups:
            group.invalidate()

    def memory(self) -> dict[str, float]:
        """Bytes of the packed linears vs the same weights in BF16; what the sampler derives from them
        per weight version (`dequantized_cache_bytes`: a DQ(W) cache, oneDNN-reordered DQ(W), or the
        AMX kernel's copy; `decode_copy_bytes`: the CUDA decode kernels' copies, mma16 or gemv32;
        `dense_copy_bytes`: the kernel engine's DQ(W) copies, dense_rows);
        prepacked copies of BF16 linears; every parameter and buffer."""
        packed = [m for m in self.model.modules() if isinstance(m, PackedNVFP4Linear)]
        params = sum(m.in_features * m.out_features for m in packed)
        packed_bytes = sum(m.quantized_weight().nbytes for m in packed)
        cache_bytes = sum(m._dequantized.nbytes for m in packed if m._dequantized is not None)
        cache_bytes += sum(m._prepacked.nbytes + m._gemm.nbytes for m in packed)
        cache_bytes += sum(g.nbytes for g in self.model.fused_groups if g.packed)
        prepacked_dense = sum(m._prepacked.nbytes for m in self.model.modules()
                              if isinstance(m, PrepackedLinear))
        prepacked_dense += sum(g.nbytes for g in self.model.fused_groups if not g.packed)
        from fp4rl.gpu_decode import decode_copy_bytes, dense_copy_bytes

        return dict(quantized_params=params, packed_bytes=packed_bytes, bf16_bytes=2 * params,
                    packed_vs_bf16=packed_bytes / max(2 * params, 1), dequantized_cache_bytes=cache_bytes,
                    prepacked_dense_bytes=prepacked_dense, decode_copy_bytes=decode_copy_bytes(self.model),
                    dense_copy_bytes=dense_copy_bytes(self.model),
                    other_bytes=sum(p.nbytes for p in self.model.parameters()))

    # -- generation --------------------------------------------------------------------------
    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str | torch.Tensor) or not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("generate: prompts must be a non-empty list of prompts, each a list of token "
                             "ids or a str")
        V, out = self.config.vocab_size, []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"generate: prompt {i} is a str but the Sampler has no tokenizer; "
                                     "pass token ids or a tokenizer")
                p = self.tokenizer(p)["input_ids"]
            elif isinstance(p, torch.Tensor):
                p = p.tolist()
            if isinstance(p, int):
                raise ValueError(f"generate: prompt {i} is the int {p}: prompts is a list of prompts, each a "
                                 "list of token ids; wrap one prompt as [[id, id, ...]]")
            ids = list(p)
            if not ids:
                raise ValueError(f"generate: prompt {i} is empty; a completion needs at least one token to "
                                 "condition on (e.g. the BOS token)")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"generate: prompt {i} must hold int token ids, got {type(ids[0]).__name__}")
            if min(ids) < 0 or max(ids) >= V:
                raise ValueError(f"generate: prompt {i} has token ids outside [0, {V}) (the vocabulary)")
            out.append(ids)
        return out

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams) -> list[Completion]:
        """Completions for every prompt x params.n, ordered prompt by prompt, sample by sample."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"generate: params must be a SamplingParams, got {type(params).__name__}")
        if self.weights_error is not None:
            raise RuntimeError(f"generate: the sampler's weights are not a known version "
                               f"({self.weights_error}); load a payload again before generating")
        prompt_ids = self._encode(prompts)
        if params.stop and self.tokenizer is None:
            raise ValueError("generate: stop strings need a tokenizer to decode the text")
        specials = [t for t in getattr(self.tokenizer, "all_special_tokens", None) or () if t]
        special = sorted((s, t) for s in params.stop for t in specials if t in s)
        if special:
            stop, token = special[0]
            raise ValueError(f"generate: stop string {stop!r} contains the special token {token!r}, which "
                             "the decoded text never contains (special tokens are skipped), so it could "
                             "never match: pass the token's id in Sampler(eos_token_ids=...) (or stop on the "
                             "text around it)")
        for i, ids in enumerate(prompt_ids):
            if len(ids) + params.max_new_tokens > self.max_seq_len:
                raise ValueError(f"generate: prompt {i} has {len(ids)} tokens and max_new_tokens="
                                 f"{params.max_new_tokens}, more than the context of {self.max_seq_len} "
                                 "tokens (max_seq_len); shorten the prompt or lower max_new_tokens")
        version, dev = self.policy_version, self.device
        P, n, new = len(prompt_ids), params.n, params.max_new_tokens
        lens = [len(ids) for ids in prompt_ids]
        T_p = max(lens)
        total = T_p + new  # cache slots: padded prompt, then one per generated token
        generator = torch.Generator(dev)
        if params.seed is not None:
            generator.manual_seed(_generator_seed(params.seed, dev))
        else:
            generator.seed()

        # prefill the P distinct prompts, left-padded; lm_head on the last position only
        ids = torch.full((P, T_p), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(P, total, dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, T_p - len(p):] = torch.tensor(p)
            mask[i, T_p - len(p):T_p] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        if params.guidance and not trace.guided_modules(self.model, params.guidance):
            raise ValueError(f"generate: SamplingParams.guidance={params.guidance} records TRACE guidance of "
                             "the W4A4 linears (quantized activations), and this Sampler's model has none: "
                             "convert it with a W4A4 contract, e.g. PrecisionContract('nvfp4-linear') "
                             "(precision.preset = 'nvfp4-linear'; 'nvfp4-experts' for an MoE model's routed "
                             "experts), or pass guidance=0")
        if self.engine is not None:  # the engine's modules record it themselves (fp4rl.gpu_trace)
            self.engine.set_guidance(params.guidance)
            recording = contextlib.nullcontext(gpu_trace.EngineRecording(self.engine) if params.guidance
                                               else None)
        else:
            recording = (trace.recording(self.model, params.guidance) if params.guidance
                         else contextlib.nullcontext())
        with recording as rec:
            return self._generate(prompt_ids, params, lens, T_p, total, generator, ids, mask, version, dev, P,
                                  n, new, rec)

    def _generate(self, prompt_ids, params, lens, T_p, total, generator, ids, mask, version, dev, P, n, new,
                  rec) -> list[Completion]:
        B = P * n
        if self.engine is not None:  # a view of the engine's static cache
            cache = self.engine.new_cache(self.kv_cache, P, B, total)
        else:
            cache = make_kv_cache(self.kv_cache, self.config, P, total, dtype=self.dtype, device=dev)
        h, chosen = self.model.model(ids, None, mask[:, :T_p], cache, None)  # h [P, T_p, H]
        logits = self.model.lm_head(h[:, -1])  # [P, V]
        guide_pre, guide_steps, fed_rows = {}, {}, []
        if rec is not None:  # prefill rows [P * T_p]; each decode step's rows are collected below
            guide_pre = {k: trace.Guidance(g.bits.view(P, T_p, *g.bits.shape[1:]),  # (routed experts' down
                                           g.block_scale.view(P, T_p, *g.block_scale.shape[1:]),  # input:
                                           g.amax.view(P, T_p, *g.amax.shape[1:]))  # [..., top_k, F/8])
                         for k, g in rec.take().items()}
            guide_steps = {k: [] for k in guide_pre}  # per step, its rows (none preallocated for all steps)

        # n samples per prompt share the prefill: copy each prompt's rows n times
        rows = torch.arange(P, device=dev).repeat_interleave(n)  # [B] prompt of each row
        if n > 1:
            cache.select(rows)
            mask, logits = mask[rows], logits[rows]
        routing = None
        if self.num_moe_layers:
            k = self.config.num_experts_per_tok
            if self.engine is not None:  # the engine's record, written by one launch after each step's graph
                routing = self.engine.routing(B, total)
            else:
                routing = torch.zeros(self.num_moe_layers, B, total, k, dtype=ROUTING_DTYPE, device=dev)
            prefill = torch.stack(chosen)  # [L_moe, P, T_p, k]
            for r in range(B):
                L = lens[r // n]
                routing[:, r, :L] = prefill[:, r // n, T_p - L:]

        active = list(range(B))  # original row of each batch row
        active_t = torch.arange(B, device=dev)  # the same on the device (indexing without a host copy)
        positions = torch.tensor([lens[r // n] for r in range(B)], device=dev)  # next RoPE position per row
        completion: list[list[int]] = [[] for _ in range(B)]
        logprobs = torch.zeros(B, new, dtype=torch.float32, device=dev)
        reasons, texts = [""] * B, [None] * B
        # With the decode engine the next step is queued before this step's tokens reach the host (the
        # tokens go through pinned memory, so only their copy is waited for): the host's per-step work
        # (EOS / stop checks, bookkeeping, launches) overlaps the GPU's step. Rows that finish at this step
        # ran one step too many; their outputs are dropped at the compaction below. (So the step after a row
        # finishes runs on the batch before compaction: the other rows' arithmetic may differ in the last bits
        # from a step on the compacted batch, as a row's already depends on its batch's size and bucket.
        # The same seed still gives the same completions.)
        lookahead = self.engine is not None

        def fed(rows: list[int]) -> None:  # a decode step's guidance: one row per row fed
            fed_rows.append(torch.tensor(rows, dtype=torch.long))
            for k, g in rec.take().items():
                guide_steps[k].append(g)

        tokens = self._next_tokens(logits, params, generator, logprobs, active_t, 0)  # [b]
        for step in range(new):
            host, ready = _to_host(tokens)
            logits = None
            if lookahead and step < new - 1:
                logits, positions = self._decode_step(cache, tokens, positions, mask, T_p + step, routing,
                                                      active_t)
                if rec is not None:  # the rows fed (those finishing now ran one step too many: dropped below)
                    fed(active)
            if ready is not None:
                ready.synchronize()
            if self.step_clock is not None:
                self.step_clock.append(time.perf_counter())
            finished = []
            for i, t in enumerate(host.tolist()):
                r = active[i]
                completion[r].append(t)
                if t in self.eos_token_ids:
                    reasons[r] = "eos"
                elif params.stop and (cut := self._find_stop(completion[r], params.stop)) is not None:
                    reasons[r], texts[r] = "stop", cut
                elif step == new - 1:
                    reasons[r] = "length"
                if reasons[r]:
                    finished.append(i)
            if len(finished) == len(active):
                break
            if finished:  # compaction: finished rows leave the batch
                gone = set(finished)
                keep = [i for i in range(len(active)) if i not in gone]
                idx = torch.tensor(keep, device=dev)
                cache.select(idx)
                mask, positions, tokens, active_t = mask[idx], positions[idx], tokens[idx], active_t[idx]
                if logits is not None:
                    logits = logits[idx]
                active = [active[i] for i in keep]
            if logits is None:
                logits, positions = self._decode_step(cache, tokens, positions, mask, T_p + step, routing,
                                                      active_t)
                if rec is not None:  # the rows fed: token `step` of each active row
                    fed(active)
            tokens = self._next_tokens(logits, params, generator, logprobs, active_t, step + 1)

        logprobs = logprobs.cpu()
        guide_dec, dec_rows = {}, []
        if rec is not None:  # every step's rows one after the other; dec_rows[r]: row r's, in step order
            rec.flush()  # (the engine's guidance copies, in flight until here)
            fed_row = torch.cat(fed_rows) if fed_rows else torch.zeros(0, dtype=torch.long)
            counts = torch.bincount(fed_row, minlength=B).tolist()
            dec_rows = torch.sort(fed_row, stable=True).indices.split(counts)
            guide_dec = {k: trace.Guidance.cat(guide_steps[k]) if guide_steps[k] else
                         trace.Guidance.empty((0, *g.amax.shape[2:]), g.width) for k, g in guide_pre.items()}
            del guide_steps
        out = []
        for r in range(B):
            p, c = prompt_ids[r // n], completion[r]
            out.append(Completion(
                prompt_index=r // n, sample_index=r % n, prompt_ids=list(p), completion_ids=c,
                logprobs=logprobs[r, :len(c)].tolist(),
                text=texts[r] if texts[r] is not None else self._decode(c),
                finish_reason=reasons[r], policy_version=version,
                routing=None if routing is None else routing[:, r, :len(p) + len(c) - 1].cpu().clone(),
                guidance=None if rec is None else {  # the prompt's rows (shared prefill), then the fed ones
                    k: trace.Guidance.cat([g.index(r // n, slice(T_p - len(p), T_p)),
                                           guide_dec[k].index(dec_rows[r][:len(c) - 1])]).to_dict()
                    for k, g in guide_pre.items()},
            ))
        return out

    def _decode_step(self, cache, tokens, positions, mask, slot: int, routing, rows):
        """(logits [b, V], the next step's positions) of one decode step: `tokens` [b] at `positions` [b] go
        to cache slot `slot` (the mask's column, set here); the experts chosen are recorded in `routing` for
        the original rows `rows` [b]. The engine does all of it (one launch before its graph, which also
        advances the positions in place, and one after it for the record)."""
        if self.engine is not None:  # kernels on the static cache, a CUDA graph replay per step
            logits, _ = self.engine.decode(cache, tokens, positions, mask[:, :slot + 1],
                                           rows=None if routing is None else rows, advance=True)
            return logits, positions
        mask[:, slot] = 1
        h, chosen = self.model.model(tokens[:, None], positions[:, None], mask[:, :slot + 1], cache, None)
        logits = self.model.lm_head(h[:, -1])  # [b, V]
        if routing is not None:
            routing[:, rows, positions] = torch.stack(chosen)[:, :, 0].to(ROUTING_DTYPE)  # [L_moe, b, k]
        return logits, positions + 1

    def _next_tokens(self, logits: torch.Tensor, params: SamplingParams, generator, logprobs, rows,
                     col: int) -> torch.Tensor:
        """The next tokens [b] from logits [b, V]; their logprobs go to logprobs[rows, col] (by the GPU
        head's own launch where it runs)."""
        tokens, lp = self._sample(logits, params, generator, (logprobs, rows, col))
        if lp is not None:
            logprobs[rows, col] = lp
        return tokens

    def _sample(self, logits, params, generator, record):
        """(tokens, logprobs) or, where the GPU head wrote `record` itself, (tokens, None)."""
        if self.fast_head and (params.greedy or (params.top_k == 0 and params.top_p == 1.0)):
            if logits.device.type == "cpu" and not (self.engine is not None and _interpreting()):
                out = cpu_head.sample_head(logits, params.greedy, params.temperature, generator)
            else:  # CUDA (or the kernel engine under TRITON_INTERPRET=1)
                from fp4rl.kernels import sample_head

                try:
                    out = sample_head.sample_head(logits, params.greedy, params.temperature, generator,
                                                  record)
                    if out is not None:
                        return out[0], None
                except (ValueError, TypeError):
                    raise
                except Exception as exc:  # noqa: BLE001 - Triton cannot build or run it here: torch's ops
                    warnings.warn(f"the GPU sampling kernel failed ({type(exc).__name__}: {str(exc)[:200]}); "
                                  "the sampler uses torch's ops from now on", stacklevel=2)
                    self.fast_head, out = False, None
            if out is not None:
                return out
        return sample_next(logits, params, generator)

    def _find_stop(self, ids: list[int], stop: tuple[str, ...]) -> str | None:
        """The text before the first stop string in decode(ids), or None when none occurs. Called after
        every new token, so a stop string can only have appeared at the end: the last tokens are decoded
        first (a window of the longest stop string's length + 16 tokens), and the whole completion only on a
        hit there or when the window's text is short (tokens that decode to nothing); decoding all of it at
        every step cost O(length^2) per row (1 s for one 4096-token completion)."""
        longest = max(map(len, stop))
        window = longest + 16
        if len(ids) > window:
            tail = self._decode(ids[-window:])
            if len(tail) >= longest + 8 and not any(s in tail for s in stop):
                return None
        text = self._decode(ids)
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        return text[:min(hits)] if hits else None


def _interpreting() -> bool:
    from fp4rl.kernels._common import INTERPRET

    return INTERPRET


def _to_host(tokens: torch.Tensor):
    """(host tensor, event to wait for or None): a CUDA tensor is copied into pinned memory behind the work
    queued so far, so that waiting for it does not wait for what is queued after."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream, whatever device is current
    return host, ready
