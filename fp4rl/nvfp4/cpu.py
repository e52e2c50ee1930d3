"""Fast NVFP4 quantize / dequantize for CPU tensors, byte-identical to fp4rl.nvfp4.reference.

Same signatures as the reference, so ``fp4rl.nvfp4`` routes CPU tensors here (see its
``_implementation``; ``FP4RL_NVFP4_CPU=reference`` forces the reference). What runs where:

- the deterministic modes (``rounding="nearest"``; tiles 1x16 and 16x16; per-tensor and
  per-row global scales; rule 6 and 4/6 with MSE or MAE; imposed ``amax`` / ``global_scale``;
  float32, bfloat16 and float16 input; ``pad=True`` when K is already a multiple of 16) run in
  a small C kernel, one block at a time while its 16 values sit in registers: block amax,
  E4M3 block scale, encode factor, E2M1 rounding, both 4/6 candidates with their errors and
  the choice, packing. Per-row scales are computed in the same pass (row amax, then its
  blocks, while the row is in cache); a per-tensor amax takes one more read-only pass first.
  The global scales are reference.global_scales_from_amax / _from_decode written out in C
  (three IEEE divisions and a clamp per row or tensor).
- everything else (stochastic rounding, the Hadamard transform, ``allow_nonfinite``, K not a
  multiple of 16, NaN/Inf input, invalid arguments) goes to the reference unchanged, which
  computes it or raises its own error.
- dequantize: one pass, ``(e2m1[code] * e4m3[byte]) * g`` in float32 (the 16 values of a
  block computed once in that order, then looked up), written as float32 or bfloat16 (round
  to nearest even, as torch's cast); float16 is cast by torch from the float32 result. A NaN
  block-scale byte or a non-finite g (no quantizer writes them) goes to the reference: torch's
  own casts disagree on NaN bits.

Why it is exact. The kernel is C compiled by gcc with ``-ffp-contract=off`` (no a*b+c
contracted into an FMA) and without ``-ffast-math`` (no reassociation, no reciprocal
multiplies: ``x / 6.0f`` and ``1.0f / d`` are IEEE divisions), in float32 on SSE/AVX (no
excess precision), in the reference's operation order (see reference.py's docstring). The
two casts where torch's conversion code could differ from a compiler's are done with integer
arithmetic that is exact by construction: E4M3 round-to-nearest-even with satfinite (bit
rounding of the float32 mantissa to 3 bits; subnormals by the 2^23 magic-number rounding of
v * 2^9), and E2M1 rounding by the reference's threshold comparisons. Amaxes are integer
maxima of the |x| bit patterns (for non-negative floats the integer order is the float order;
a pattern >= +inf is NaN or Inf, which sends the call to the reference). 4/6 errors are summed
left to right over a block and, for 16x16 tiles, as the reference's tree over the 16 rows.
tests/test_nvfp4_cpu.py checks codes, block scales, global scales and dequantized bytes
against the reference on the reference tests' tensor families.

Why not torch.compile: tried (inductor, CPU, dynamic shapes; exact with the same integer
casts), but one graph took 56-94 s to compile cold and ~15 s from the on-disk cache, the
default job needs several, and the compiled code was slower than the reference on 2 cores.
The C file here compiles in about a second, once per machine (cached under
``$XDG_CACHE_HOME/fp4rl`` or ``~/.cache/fp4rl``, keyed by source, flags, compiler and CPU),
and is loaded with ctypes (no torch headers). Work is split over ``torch.get_num_threads()``
Python threads by rows (ctypes releases the GIL); small tensors run on one thread.

If no C compiler is found or the build fails, ``available()`` is False, one warning is
issued, and every call goes to the reference: never different bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fp4rl.nvfp4 import reference
from fp4rl.nvfp4.format import BLOCK, NVFP4Tensor

# ---- the C kernel ----------------------------------------------------------------------------
_SOURCE_FILE = Path(__file__).with_name("nvfp4_cpu.c")  # the kernel; packaged beside this module

_CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-fast-math",
           "-fexcess-precision=standard", "-std=gnu11", "-fPIC", "-shared")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MIN_ELEMENTS_PER_THREAD = 1 << 16  # below this, splitting over threads costs more than it saves

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_e4m3_table: torch.Tensor | None = None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "fp4rl"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"fp4rl-{os.getuid() if hasattr(os, 'getuid') else 0}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()  # a shared /tmp: only a folder this user owns, writable by no one else, is trusted
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return Path(tempfile.mkdtemp(prefix="fp4rl-"))  # private to this process: nothing foreign loaded
    return path


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on another CPU is never reused."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86; aarch64
        seen: dict[str, str] = {}
        for ln in info.splitlines():
            key = ln.split(":", 1)[0].strip()
            if key in keys:
                seen.setdefault(key, ln)  # the first core's line of each
        return "\n".join([platform.machine(), *seen.values()])
    except OSError:
        return platform.processor() + platform.machine()


def build(source: Path = _SOURCE_FILE, cflags: tuple[str, ...] = _CFLAGS,
          ldflags: tuple[str, ...] = ()) -> Path:
    """Compile a C file of this package (or find it in the cache); returns the shared library's path.
    The cache key covers the source, the flags, the compiler's version and this CPU. The other C
    kernels of fp4rl (nvfp4/cpu_gemm.py, cpu_ops.py, cpu_head.py) are built by this function too."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc, or $CC) found")
    if not source.exists():
        raise RuntimeError(f"{source} is missing (not packaged?)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [source.read_text(), " ".join(cflags), version, _cpu_signature()]
    parts += [" ".join(ldflags)] if ldflags else []
    key = hashlib.sha256("\0".join(parts).encode())
    target = _cache_dir() / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / f"{source.stem}.so"
        command = [cc, *cflags, "-o", str(out), str(source), *ldflags]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[:2000]}")
        os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    return target


def open_library(build_library) -> ctypes.CDLL:
    """ctypes.CDLL of the library build_library() returns; a damaged cache entry is deleted and
    built once more."""
    path = build_library()
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(build_library()))


def missing_cpu_flags(flags: tuple[str, ...]) -> str | None:
    """None when /proc/cpuinfo lists every one of `flags`, else what is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no /proc/cpuinfo (not Linux)"
    have = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    missing = [f for f in flags if f not in have]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def load_once(state: dict, load, warning) -> bool:
    """The lazy loading every C-kernel module of fp4rl shares, on that module's globals `state`
    (`_lib`, `_failed`, `_lock`): the first call runs load(); a failure is kept in `_failed` and,
    when warning(failed) gives a text, warned once. Returns whether `_lib` is loaded."""
    if state["_lib"] is not None:
        return True
    if state["_failed"] is not None:
        return False
    with state["_lock"]:
        if state["_lib"] is None and state["_failed"] is None:
            try:
                state["_lib"] = load()
            except Exception as e:  # noqa: BLE001 - any build/load problem means: the fallback runs
                state["_failed"] = failed = f"{type(e).__name__}: {e}"
                text = warning(failed)
                if text:
                    warnings.warn(text, RuntimeWarning, stacklevel=4)
    return state["_lib"] is not None


def thread_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least `workers` threads for the C kernels (ctypes releases the GIL);
    a pool inherited through fork has no threads, so a forked child makes its own."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp4rl-cpu")
            _pool_pid = os.getpid()
        return _pool


def _load() -> ctypes.CDLL:
    lib = open_library(build)
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.nvfp4_row_amax.argtypes = [ptr, i32, i64, i64, i64, ptr]
    lib.nvfp4_row_amax.restype = i32
    lib.nvfp4_quantize_rows.argtypes = [ptr, i32, i64, i64, i64, i32, i32, i32, i32, ptr, i64, f32, f32,
                                        ptr, ptr, ptr]
    lib.nvfp4_quantize_rows.restype = i32
    lib.nvfp4_dequantize_rows.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, i64, i32, ptr]
    lib.nvfp4_dequantize_rows.restype = i32
    for name in ("nvfp4_cast_e4m3", "nvfp4_round_e2m1"):
        getattr(lib, name).argtypes = [ptr, i64, ptr, ptr]
        getattr(lib, name).restype = None
    return lib


def available() -> bool:
    """Whether the fast path can run (builds and loads the kernel on the first call). On
    failure, warns once; the caller then uses the reference."""
    return load_once(globals(), _load, lambda failed: (
        f"fp4rl.nvfp4: the fast CPU quantizer is unavailable ({failed}); CPU tensors use the reference "
        "quantizer (same bytes, slower)"))


def _parallel_rows(fn, rows: int, elements_per_row: int, align: int) -> None:
    """fn(r0, r1) over [0, rows) split into up to torch.get_num_threads() aligned chunks, run
    on Python threads (the C calls release the GIL)."""
    n = min(torch.get_num_threads(), max(1, rows * elements_per_row // _MIN_ELEMENTS_PER_THREAD))
    n = min(n, rows // align) if rows >= align else 1
    if n <= 1:
        fn(0, rows)
        return
    step = -(-rows // n // align) * align
    bounds = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    pool = thread_pool(len(bounds) - 1)
    futures = [pool.submit(fn, r0, r1) for r0, r1 in bounds[1:]]
    fn(*bounds[0])
    for f in futures:
        f.result()


def _roundings(fn_name: str, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Test hook: the kernel's E4M3 cast ("nvfp4_cast_e4m3", v >= 0) or E2M1 rounding
    ("nvfp4_round_e2m1") of a float32 tensor -> (bytes or codes uint8, float32 values)."""
    if not available():
        raise RuntimeError(f"the fast CPU quantizer is unavailable: {_failed}")
    flat = v.detach().float().contiguous().reshape(-1)
    n = flat.numel()
    flat = torch.nn.functional.pad(flat, (0, (-n) % BLOCK))
    out, value = torch.empty(flat.numel(), dtype=torch.uint8), torch.empty(flat.numel(), dtype=torch.float32)
    getattr(_lib, fn_name)(flat.data_ptr(), flat.numel(), out.data_ptr(), value.data_ptr())
    return out[:n].reshape(v.shape), value[:n].reshape(v.shape)


# ---- quantize --------------------------------------------------------------------------------------
def _fast_quantize_supported(x, tile, scale_rule, err, rounding, scale_scope, generator, allow_nonfinite,
                             pad, hadamard_seed, global_scale, amax) -> bool:
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype not in _DTYPE_CODES:
        return False
    if x.layout != torch.strided:
        return False
    if rounding != "nearest" or generator is not None or allow_nonfinite or hadamard_seed is not None:
        return False
    if tile not in reference.TILES or scale_rule not in reference.SCALE_RULES or err not in ("mse", "mae"):
        return False
    if scale_scope not in ("tensor", "row") or (global_scale is not None and amax is not None):
        return False
    if x.ndim == 0 or x.numel() == 0 or x.shape[-1] % BLOCK:
        return False
    return tile != (16, 16) or (scale_scope == "tensor" and x.ndim >= 2 and x.shape[-2] % 16 == 0)


def quantize(
    x: torch.Tensor,
    *,
    tile: int | tuple[int, int] = 16,
    scale_rule: str = "6",
    err: str = "mse",
    rounding: str = "nearest",
    scale_scope: str = "tensor",
    generator: torch.Generator | None = None,
    global_scale: torch.Tensor | float | None = None,
    amax: torch.Tensor | float | None = None,
    allow_nonfinite: bool = False,
    pad: bool = False,
    hadamard_seed: int | None = None,
) -> NVFP4Tensor:
    """fp4rl.nvfp4.reference.quantize, computed by the C kernel (see the module docstring)."""
    kwargs = dict(tile=tile, scale_rule=scale_rule, err=err, rounding=rounding, scale_scope=scale_scope,
                  generator=generator, global_scale=global_scale, amax=amax,
                  allow_nonfinite=allow_nonfinite, pad=pad, hadamard_seed=hadamard_seed)
    if not _fast_quantize_supported(x, **kwargs) or not available():
        return reference.quantize(x, **kwargs)
    shape, k = x.shape, x.shape[-1]
    x2 = x.detach().contiguous().reshape(-1, k)  # [R, K]
    rows = x2.shape[0]
    dtype_code = _DTYPE_CODES[x.dtype]
    row_scope = scale_scope == "row"
    scale_shape = torch.Size((*shape[:-1], 1)) if row_scope else torch.Size(())
    lib = _lib
    bad = []

    # Where the global scales come from (the C kernel's `mode`, see its comment).
    if global_scale is not None or amax is not None:
        try:
            if global_scale is not None:
                src = reference._validate_scale(global_scale, "global_scale", scale_shape, x, positive=True)
            else:
                src = reference._validate_scale(amax, "amax", scale_shape, x, positive=False)
        except (TypeError, ValueError):
            return reference.quantize(x, **kwargs)  # raises the reference's error
        mode, src = (2 if global_scale is not None else 1), src.contiguous()
    elif row_scope:
        mode, src = 0, None
    else:  # pass 1: the tensor's amax (and the finite check)
        row_amax = torch.empty(rows, dtype=torch.float32)

        def amax_rows(r0, r1):
            if lib.nvfp4_row_amax(x2.data_ptr(), dtype_code, r0, r1, k, row_amax.data_ptr()):
                bad.append(True)

        _parallel_rows(amax_rows, rows, k, 1)
        if bad:
            return reference.quantize(x, **kwargs)  # raises on NaN/Inf
        mode, src = 1, row_amax.amax()

    data = torch.empty(rows, k // 2, dtype=torch.uint8)
    scale = torch.empty(rows, k // BLOCK, dtype=torch.uint8)
    g = torch.empty(rows if row_scope else 1, dtype=torch.float32)
    tile16 = tile == (16, 16)
    m = reference.GLOBAL_SCALE_MAX[scale_rule]

    def quantize_rows(r0, r1):
        if lib.nvfp4_quantize_rows(x2.data_ptr(), dtype_code, r0, r1, k, tile16, scale_rule == "4/6",
                                   err == "mae", mode, 0 if src is None else src.data_ptr(), int(row_scope),
                                   m, reference._FP32_ONE_SIXTH, data.data_ptr(), scale.data_ptr(),
                                   g.data_ptr()):
            bad.append(True)

    _parallel_rows(quantize_rows, rows, k, 16 if tile16 else 1)
    if bad:
        return reference.quantize(x, **kwargs)  # raises on NaN/Inf
    return NVFP4Tensor(
        data=data.reshape(*shape[:-1], k // 2),
        block_scale=scale.view(torch.float8_e4m3fn).reshape(*shape[:-1], k // BLOCK),
        global_scale=(src if mode == 2 else g).reshape(scale_shape),
        shape=shape,
        dtype=x.dtype,
        tile=tile,
        scale_rule=scale_rule,
        hadamard_seed=None,
    )


# ---- dequantize ------------------------------------------------------------------------------------
def _e4m3_values() -> torch.Tensor:
    """float32 value of each of the 256 E4M3 bytes, from torch's own cast (NaN bytes included)."""
    global _e4m3_table
    if _e4m3_table is None:
        _e4m3_table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return _e4m3_table


def _fast_dequantize_supported(q, dtype) -> bool:
    if not isinstance(q, NVFP4Tensor) or dtype not in _DTYPE_CODES or q.hadamard_seed is not None:
        return False
    data, scale, g = q.data, q.block_scale, q.global_scale
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
               for t in (data, scale, g)):
        return False
    if data.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or g.dtype != torch.float32:
        return False
    if data.ndim == 0 or data.shape[-1] * 2 != q.shape[-1] or q.shape[-1] % BLOCK:
        return False
    if tuple(data.shape[:-1]) != tuple(q.shape[:-1]):
        return False
    if tuple(scale.shape) != (*data.shape[:-1], q.shape[-1] // BLOCK):
        return False
    return g.ndim == 0 or tuple(g.shape) == (*data.shape[:-1], 1)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp4rl.nvfp4.reference.dequantize, computed by the C kernel: (e2m1 * block_scale) * global_scale."""
    if not _fast_dequantize_supported(q, dtype) or not available():
        return reference.dequantize(q, dtype)
    k = q.shape[-1]
    data = q.data.contiguous().reshape(-1, k // 2)
    rows = data.shape[0]
    scale = q.block_scale.contiguous().view(torch.uint8).reshape(rows, k // BLOCK)
    g = q.global_scale.contiguous()
    table = _e4m3_values()
    out_code = 1 if dtype == torch.bfloat16 else 0
    out = torch.empty(rows, k, dtype=torch.bfloat16 if out_code else torch.float32)
    lib = _lib
    bad = []

    def dequantize_rows(r0, r1):
        if lib.nvfp4_dequantize_rows(data.data_ptr(), scale.data_ptr(), g.data_ptr(), int(g.ndim > 0),
                                     table.data_ptr(), r0, r1, k, out_code, out.data_ptr()):
            bad.append(True)

    _parallel_rows(dequantize_rows, rows, k, 1)
    if bad:
        return reference.dequantize(q, dtype)
    out = out.reshape(q.shape)
    return out.to(dtype) if out.dtype != dtype else out


def fake_quantize(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """dequantize(quantize(x, **kwargs)) in x's dtype and shape."""
    return dequantize(quantize(x, **kwargs), dtype=x.dtype)
