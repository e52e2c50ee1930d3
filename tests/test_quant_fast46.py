"""quant.cu's 4/6 decision (FAST46, decide46) run on the CPU: the kernel file's device functions compiled by
g++ with a few lines standing in for the CUDA intrinsics (IEEE float32 operations, round to nearest, no
contraction), block by block, against fp4rl.nvfp4.reference. The GPU runs the same source (tests/
test_quant_cuda.py); here CI checks the bound itself, on the blocks where it matters: near ties found by
bisection (adjacent float32 inputs on which the reference's choice flips), exact ties, and the guards' edges.
"""

import ctypes
import shutil
import subprocess

import pytest
import torch

from fp4rl.kernels.quantize import cuda as qc
from fp4rl.nvfp4 import reference

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the kernel source as C++)")

# What quant.cu's quantize path uses from CUDA, as host C++ (kernels that are compiled but never called here
# need the rest to parse).
SHIM = r"""
#include <math.h>
#include <string.h>
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline uint2 make_uint2(unsigned a, unsigned b) { uint2 r = {a, b}; return r; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline unsigned __vmaxu2(unsigned a, unsigned b) {
  unsigned lo = (a & 0xFFFFu) > (b & 0xFFFFu) ? a & 0xFFFFu : b & 0xFFFFu;
  unsigned hi = (a >> 16) > (b >> 16) ? a >> 16 : b >> 16;
  return lo | (hi << 16);
}
static inline unsigned __vcmpltu2(unsigned a, unsigned b) {
  return ((a & 0xFFFFu) < (b & 0xFFFFu) ? 0xFFFFu : 0u) | ((a >> 16) < (b >> 16) ? 0xFFFF0000u : 0u);
}
static inline unsigned __reduce_max_sync(unsigned, unsigned v) { return v; }
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int) { return v; }  // (the tile kernel)
static inline int __any_sync(unsigned, int p) { return p; }
static inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {  // CUDA's default mode
  unsigned long long v = ((unsigned long long)b << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFFu) << (8 * i);
  return r;
}
static inline void __syncthreads() {}
static inline int atomicMax(int* p, int v) { int o = *p; if (v > o) *p = v; return o; }
struct Dim3 { unsigned x; };
static Dim3 threadIdx, blockIdx, gridDim;
static long long g_known, g_lean;
#define HOST_COUNT(k) (g_known += (k))
#define HOST_LEAN() (++g_lean)
"""

HARNESS = r"""
// v: the amax (SRC 0) or the decode-direction global scale g (SRC 3); codes: 2 words per block; returns how
// many blocks decide46 decided
extern "C" long long quantize_host(const void* x, int n_blk, float v, unsigned* codes, unsigned char* sbits) {
  g_known = g_lean = 0;
  const Scales sc = scales_from(v);
  for (int b = 0; b < n_blk; ++b) {
    Raw r;
    load_block(x, b, r);
    u32 raw, fin, bmax;
    block_max_bits(r, raw, fin, bmax);
    uint2 c;
    u32 s;
    quantize_block(r, sc, bmax, c, s);
    codes[2 * b] = c.x;
    codes[2 * b + 1] = c.y;
    sbits[b] = (unsigned char)s;
  }
  return g_known;
}
extern "C" long long lean_count() { return g_lean; }  // blocks lean46 took (FAST46 3) in the last call
#if FAST46 == 3
// 16x16 tiles as nvfp4_quant_tile16 computes them with FAST46 3: a tile's 16 lanes as a loop, the shuffles'
// butterfly (lane distance 8, 4, 2, 1) as the same pairwise sums; x [16 n_tr, 16 nb_row], codes 2 words and
// sbits one byte per block in row-major order; returns how many tiles tile46_decide decided
static void bfly(float* v) {
  for (int m = 8; m > 0; m >>= 1) {
    float t[16];
    for (int i = 0; i < 16; ++i) t[i] = __fadd_rn(v[i], v[i ^ m]);
    memcpy(v, t, sizeof t);
  }
}
extern "C" long long quantize_tiles_host(const void* x, int n_tr, int nb_row, float v, unsigned* codes,
                                         unsigned char* sbits) {
  g_known = 0;
  const Scales sc = scales_from(v);
  for (int tr = 0; tr < n_tr; ++tr) {
    for (int col = 0; col < nb_row; ++col) {
      Raw r[16];
      u32 bm[16], tm = 0;
      long long b[16];
      for (int i = 0; i < 16; ++i) {
        u32 raw, fin;
        b[i] = ((long long)tr * 16 + i) * nb_row + col;
        load_block(x, b[i], r[i]);
        block_max_bits(r[i], raw, fin, bm[i]);
        tm = max(tm, bm[i]);
      }
      const float tmax = __uint_as_float(tm);
      float s6, s4, enc6, enc4;
      candidates46(sc, tmax, s6, s4, enc6, enc4);
      uint2 c6[16], c4[16];
      float l6[16], l4[16], b6[16], b4[16];
      bool lean = tile46_guards(sc, tmax, s6, enc6, enc4);
      for (int i = 0; i < 16; ++i)
        lean &= tile46_block(r[i], __uint_as_float(bm[i]), enc6, enc4, l6[i], l4[i], b6[i], b4[i], c6[i],
                             c4[i]);
      bfly(l6); bfly(l4); bfly(b6); bfly(b4);
      int pick = lean ? tile46_decide(s6, s4, l6[0], l4[0], b6[0], b4[0]) : -1;
      if (tmax == 0.0f) pick = 0;
      if (pick < 0) {
        float e6[16], e4[16];
        for (int i = 0; i < 16; ++i) {
          if (sc.fast) {
            e6[i] = candidate_error<true>(r[i], s6, enc6, sc);
            e4[i] = candidate_error<true>(r[i], s4, enc4, sc);
          } else {
            errors_ieee(r[i], s6, enc6, s4, enc4, sc, &e6[i], &e4[i]);
          }
        }
        bfly(e6); bfly(e4);
        pick = e4[0] < e6[0];
      }
      for (int i = 0; i < 16; ++i) {
        const uint2 c = lean ? (pick ? c4[i] : c6[i]) : codes_of(r[i], pick ? enc4 : enc6);
        codes[2 * b[i]] = c.x;
        codes[2 * b[i] + 1] = c.y;
        sbits[b[i]] = (unsigned char)e4m3_bits(pick ? s4 : s6);
      }
    }
  }
  return g_known;
}
// float32 bit patterns lo..hi-1 on which div6 differs from IEEE division by 6
extern "C" long long div6_mismatches(unsigned lo, unsigned hi) {
  long long bad = 0;
  for (unsigned b = lo; b < hi; ++b) {
    float v = __uint_as_float(b);
    bad += div6(v) != v / 6.0f;
  }
  return bad;
}
#endif
"""


def host_builder(root):
    """get(mae, src, f32, fast, nf): quant.cu compiled for the host under root per (MAE, SRC, IN_F32, FAST46,
    NONFINITE), once each: a ctypes library (with FAST46 3 also quantize_tiles_host, for
    tests/test_quant_tile46.py)."""
    built = {}

    def get(mae: bool, src: int, f32: bool, fast: int = 2, nf: bool = False):
        key = (mae, src, f32, fast, nf)
        if key not in built:
            defs = dict(RULE46=1, MAE=int(mae), NONFINITE=int(nf), SRC=src, GIVEN_ROWS=0, IN_F32=int(f32),
                        FAST46=fast)
            name = "q_" + "_".join(str(int(k)) for k in key)
            cpp = root / f"{name}.cpp"
            cpp.write_text(SHIM + qc.source(defs) + HARNESS)
            so = root / f"{name}.so"
            cmd = ["g++", "-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
                   "-w", "-o", str(so), str(cpp)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-3000:]
            lib = ctypes.CDLL(str(so))
            lib.quantize_host.restype = ctypes.c_longlong
            lib.quantize_host.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
                                          ctypes.c_void_p]
            lib.lean_count.restype = ctypes.c_longlong
            if fast == 3:
                lib.quantize_tiles_host.restype = ctypes.c_longlong
                lib.quantize_tiles_host.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                    ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
            built[key] = lib
        return built[key]

    return get


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return host_builder(tmp_path_factory.mktemp("fast46"))


def run_host(lib, x: torch.Tensor, v: float):
    """(codes uint8 [N, 8], scale bytes [N], blocks decided by the bound, blocks FAST46 3's lean path took)
    for x [N, 16]."""
    x = x.contiguous()
    n = x.shape[0]
    codes = torch.empty(n, 8, dtype=torch.uint8)
    sb = torch.empty(n, dtype=torch.uint8)
    known = lib.quantize_host(x.data_ptr(), n, float(v), codes.data_ptr(), sb.data_ptr())
    return codes, sb, known, lib.lean_count()


def run_ref(x: torch.Tensor, v: float, mae: bool, src: int, nf: bool = False):
    kw = dict(scale_rule="4/6", err="mae" if mae else "mse", allow_nonfinite=nf)
    kw["amax" if src == 0 else "global_scale"] = torch.tensor(v)
    q = reference.quantize(x, **kw)
    return q.data.reshape(-1, 8), q.block_scale.view(torch.uint8).reshape(-1)


def check(build, x, v, mae, src, fast=2, nf=False, lean=None):
    """The host build's bytes equal the reference's; returns the count decided by decide46 (lean: a list that
    gets the count FAST46 3's lean path took)."""
    codes, sb, known, n_lean = run_host(build(mae, src, x.dtype == torch.float32, fast, nf), x, v)
    rd, rs = run_ref(x, v, mae, src, nf)
    bad = (codes != rd).any(1) | (sb != rs)
    assert not bad.any(), f"{int(bad.sum())} of {len(bad)} blocks differ, first {bad.nonzero()[:5].tolist()}"
    if lean is not None:
        lean.append(n_lean)
    return known


def random_blocks(n: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g) * torch.logspace(-2, 2, n)[torch.randperm(n, generator=g)][:, None]
    return x.to(dtype)


PARAMS = [(False, 0), (True, 0), (False, 3), (True, 3)]


def _v(x: torch.Tensor, src: int) -> float:
    """SRC 0: the tensor's amax; SRC 3: a g that maps it to 6 x 256, as the 4/6 rule would."""
    a = float(x.float().abs().max())
    return a if src == 0 else a / 1536.0


@pytest.mark.parametrize("mae,src", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_blocks_decided_by_the_bound(build, mae, src, dtype):
    """Ordinary blocks: the reference's bytes, and decide46 settles nearly all of them (the fast path is the
    one that runs)."""
    x = random_blocks(4096, dtype, 1)
    known = check(build, x, _v(x, src), mae, src)
    assert known >= 0.99 * x.shape[0]
    assert check(build, x, _v(x, src), mae, src, fast=1) == known  # the winner's codes in a pass of their own
    assert check(build, x, _v(x, src), mae, src, fast=0) == 0  # FAST46 0: every block exact
    lean = []  # FAST46 3: lean46 takes the blocks whose scales are nonzero E4M3 values, its bound most
    assert check(build, x, _v(x, src), mae, src, fast=3, lean=lean) >= 0.99 * x.shape[0]
    assert lean[0] >= 0.97 * x.shape[0]


def scale_bytes(x: torch.Tensor, t: torch.Tensor, v: float, mae: bool, src: int) -> torch.Tensor:
    """The reference's scale byte of each block of x with element 1 set to t (the choice between the two
    candidates: their scales differ)."""
    xt = x.clone()
    xt[:, 1] = t
    return run_ref(xt, v, mae, src)[1]


def adjacent_flips(x: torch.Tensor, points: list, scale_of, dtype):
    """Rows of x on both sides of a flip of the reference's choice. scale_of(x, t) gives the reference's scale
    byte per row of x for the values t [rows] (positive, of dtype) of the scan's points, in order; each row's
    first pair of consecutive points between which its byte changes is bisected over dtype's bit patterns
    (float32 or bfloat16) until the two ends are adjacent values. Returns (keep: the rows with a flip in
    range, a, b: their adjacent values, of dtype)."""
    lo = torch.full_like(points[0], float("nan"))
    hi = lo.clone()
    prev_t, prev_s = points[0], scale_of(x, points[0])
    for t in points[1:]:
        s = scale_of(x, t)
        fresh = (s != prev_s) & lo.isnan()
        lo[fresh], hi[fresh] = prev_t[fresh], t[fresh]
        prev_t, prev_s = t, s
    keep = ~lo.isnan()
    x = x[keep]
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    a, b = lo[keep].view(ints).clone(), hi[keep].view(ints).clone()  # positive: bits ordered
    sa = scale_of(x, a.view(dtype))
    while bool(((b - a) > 1).any()):
        mid = a + (b - a) // 2
        same = scale_of(x, mid.view(dtype)) == sa
        a = torch.where(same, mid, a)
        b = torch.where(same, b, mid)
    return keep, a.view(dtype), b.view(dtype)


def near_ties(mae: bool, src: int, n: int = 2048, seed: int = 0, dtype=torch.float32):
    """Blocks on both sides of a flip of the reference's choice: element 1 of each block (element 0 is the
    block max, so the candidates' scales stay put) scanned over (0.02, 0.98) of the max for a flip, then
    bisected to adjacent values (adjacent_flips). Returns ([2 m, 16] of dtype for the m blocks with a flip in
    range, the amax or g for the call)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    x[:, 0] = x[:, 1:].abs().amax(1) * 1.25
    x = (x * torch.logspace(-2, 2, n)[:, None]).to(dtype)
    top = x[:, 0].clone()
    v = float(top.max()) if src == 0 else float(top.max()) / 1536.0
    points = [0.02 * top] + [f * top for f in torch.linspace(0.02, 0.98, 49)[1:]]
    keep, a, b = adjacent_flips(x, points, lambda x, t: scale_bytes(x, t, v, mae, src), dtype)
    x = x[keep]
    xa, xb = x.clone(), x.clone()
    xa[:, 1] = a
    xb[:, 1] = b
    assert bool((scale_bytes(x, xa[:, 1], v, mae, src) != scale_bytes(x, xb[:, 1], v, mae, src)).all())
    return torch.cat([xa, xb]), v


@pytest.mark.parametrize("fast", [2, 3])
@pytest.mark.parametrize("mae,src", PARAMS)
def test_near_ties_found_by_bisection(build, mae, src, fast):
    """Adjacent float32 inputs on which the reference's choice flips: the errors of the two candidates agree
    to a few ulps, far inside what the cheaper error can tell apart. The bound must send them to the exact
    errors: with no margin at all (hi = lo = s^2 E) about a third of these blocks take the wrong candidate
    and this test fails. (The proven bound is far from tight: a margin of a few ulps of the products already
    passes here; the proof, not this test, is what covers the worst case.) FAST46 3: lean46's bound, on the
    blocks it takes (most of them)."""
    x, v = near_ties(mae, src)
    assert x.shape[0] >= 1000  # most rows flip somewhere in range
    lean = []
    known = check(build, x, v, mae, src, fast=fast, lean=lean)
    assert known < 0.5 * x.shape[0]  # most of them left to the exact errors
    if fast == 3:
        assert lean[0] >= 0.9 * x.shape[0]


@pytest.mark.parametrize("mae,src", PARAMS)
def test_bfloat16_near_ties(build, mae, src):
    """The same bisection over bfloat16 bit patterns, through FAST46 3's bfloat16 path (the sign taken once
    per element for both candidates): adjacent bfloat16 inputs on either side of a flip."""
    x, v = near_ties(mae, src, dtype=torch.bfloat16)
    assert x.shape[0] >= 1000
    lean = []
    check(build, x, v, mae, src, fast=3, lean=lean)
    check(build, x, v, mae, src, fast=2)
    assert lean[0] >= 0.9 * x.shape[0]


def special_blocks() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = [
        torch.zeros(16),                                       # zero block: both scales 0
        torch.full((16,), 3.0),                                # constant: exact in both candidates
        e2m1[torch.randint(0, 8, (16,), generator=g)] * 0.75,  # one candidate's grid
        e2m1.repeat(2) * 2.0,
        torch.tensor([1.0] + [0.0] * 15),                      # a single value
        torch.tensor([1.0, -1.0] * 8),
        torch.randn(16, generator=g) * 2.0 ** -45,             # block max below 2^-40 (the guard)
        torch.randn(16, generator=g) * 2.0 ** 41,              # above 2^40
        torch.randn(16, generator=g) * 1e-30,
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("fast", [2, 3])
@pytest.mark.parametrize("mae,src", PARAMS)
def test_ties_and_guards(build, mae, src, fast):
    """Exact ties (zero, constant and representable blocks: both errors equal, the reference keeps 6) and
    blocks past the guards' range (tiny or huge block maxima, a global scale that clamps both candidates at
    448), with global scales from the block itself, a larger one, a much smaller one and one that clamps
    both candidates with max |z| in [7, 8) (E2M1 rounds it to 8 without the clamp at 6: lean46 refuses)."""
    x = special_blocks()
    for i in range(x.shape[0]):
        blk = x[i:i + 1]
        a = float(blk.abs().max()) or 1.0
        for amax in (a, a * 7.0, a / 100.0, a * 0.45):  # 0.45: both scales clamp at 448, max |z| in [7, 8)
            v = amax if src == 0 else amax / 1536.0
            check(build, blk, v, mae, src, fast=fast)
            check(build, blk.bfloat16(), v, mae, src, fast=fast)


def grid_ties(src: int, n: int = 8192, seed: int = 0):
    """Blocks whose every value lies on both candidates' grids (0, +-1.5, +-3, +-6 decode steps of the 6
    candidate are 0, +-1, +-2, +-4 of the 4 candidate, whose scale is 1.5x), then moved by a few ulps: both
    errors are a few roundings' worth, and which is smaller is decided by the reference's decode arithmetic
    alone. A tensor amax that is not a power of two, so the decode chain rounds. Returns ([n, 16] float32, the
    amax or g)."""
    g = torch.Generator().manual_seed(seed)
    amax = 1000.0
    s6 = torch.tensor([0.5, 1.0, 2.0, 4.0, 16.0, 64.0, 1.25, 2.5])[torch.randint(0, 8, (n,), generator=g)]
    sigma6 = (s6 * (amax / 1536.0)).float()  # the 6 candidate's decode step, x units (s4 = 1.5 s6 exactly)
    ev = torch.tensor([0.0, 1.5, 3.0, 6.0])[torch.randint(0, 4, (n, 16), generator=g)]
    ev[:, 0] = 6.0  # the block max maps to 6 (and to 4)
    sign = torch.where(torch.rand(n, 16, generator=g) < 0.5, -1.0, 1.0)
    sign[:, 0] = 1.0
    x = (sigma6[:, None] * ev * sign).float()
    bits = x.view(torch.int32)
    k = torch.randint(-3, 4, (n, 16), generator=g, dtype=torch.int32)
    k[:, 0] = 0
    moved = torch.where(x != 0, bits + k, bits).view(torch.float32)  # |x| up or down by k ulps
    v = amax if src == 0 else amax / 1536.0
    return moved, v


@pytest.mark.parametrize("fast", [2, 3])
@pytest.mark.parametrize("mae,src", PARAMS)
def test_grid_ties(build, mae, src, fast):
    """Both candidates exact up to a few ulps: the tightest test of the bound. With its margin cut to 1/250
    (MAE) or 1/4096 (MSE) about half of these blocks take the wrong candidate; with none, 75-85%. Most go to
    the exact errors."""
    x, v = grid_ties(src)
    lean = []
    known = check(build, x, v, mae, src, fast=fast, lean=lean)
    assert known < 0.5 * x.shape[0]
    if fast == 3:
        assert lean[0] == x.shape[0]  # every scale here is a normal E4M3 value: lean46's bound decides


@pytest.mark.parametrize("mae", [False, True])
def test_nonfinite_blocks(build, mae):
    """NONFINITE (allow_nonfinite): blocks holding NaN, +-Inf or -0.0 next to ordinary ones; decide46's NaN
    and Inf errors make every comparison false, so those blocks take the exact errors; the codes of FAST46 2's
    pass (NaN -> 0, Inf -> +-6, -0.0 -> 0) equal the reference's."""
    x = random_blocks(512, torch.float32, 7)
    x[3, 5], x[7, 1], x[9, 14] = float("nan"), float("inf"), -float("inf")
    x[11] = float("nan")
    x[13, 2], x[15] = -0.0, -0.0
    a = float(x[x.isfinite()].abs().max())
    for fast in (3, 2, 1, 0):
        check(build, x, a, mae, 0, fast=fast, nf=True)
        check(build, x.bfloat16(), a, mae, 0, fast=fast, nf=True)
    for xs in (x, x.bfloat16()):  # without NONFINITE (the reference refuses such input): FAST46 3's bytes
        f32 = xs.dtype == torch.float32  # are FAST46 2's (which its general path runs)
        b3, b2 = (run_host(build(mae, 0, f32, fast, False), xs, a) for fast in (3, 2))
        assert torch.equal(b3[0], b2[0]) and torch.equal(b3[1], b2[1])
        assert b3[3] < xs.shape[0] - 4  # the NaN / Inf blocks left the lean path


def sign_blocks(dtype) -> torch.Tensor:
    """Blocks for lean46's signs: -0.0, the dtype's smallest negative subnormals and tiny negatives that round
    to a zero magnitude (code 8, not 0) next to an ordinary block max, 32 blocks per block max. bfloat16: the
    sign is taken once per element from x, valid while enc4 >= 2^-15 (a nonzero x * enc cannot underflow to
    -0); block maxima on both sides of it (from 2^17 up a subnormal's z underflows: code 0, the reference's
    z < 0 being false; those blocks must leave the lean path). float32: per candidate from z, whose subnormals
    underflow in one candidate and not the other at some block maxima (8.5-12.5)."""
    g = torch.Generator().manual_seed(11)
    if dtype == torch.bfloat16:
        tops = (1.0, 3.0e4, 1.5e5, 2.0 ** 17, 2.0 ** 18, 1.0e6, 2.0 ** 21, 1.0e7, 2.0 ** 39)
        tiny = -(2.0 ** -133)
    else:
        tops, tiny = (1.0, 8.5, 10.0, 12.5, 100.0, 1.0e4, 1.0e8), -(2.0 ** -149)
    rows = []
    for top in tops:
        for _ in range(32):
            blk = torch.randn(16, generator=g) * top / 4
            blk[0] = top
            k = torch.randperm(15, generator=g)[:6] + 1
            blk[k[0]] = -0.0
            blk[k[1]] = tiny
            blk[k[2]] = tiny * 2
            blk[k[3]] = tiny * float(torch.randint(3, 100, (1,), generator=g))
            blk[k[4]] = -top * 2.0 ** -10  # |z| < 0.25: a zero magnitude with the sign
            blk[k[5]] = -(2.0 ** -126)
            rows.append(blk)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mae", [False, True])
def test_signs(build, mae, dtype):
    """Each block max's 32 blocks with their own amax (SRC 0) and g (SRC 3), the bytes the reference's: lean46
    takes those its guards allow (bfloat16: not from ~1.3e5 up); then the whole set under one amax."""
    x = sign_blocks(dtype)
    n_lean = 0
    for i in range(0, x.shape[0], 32):
        blk = x[i:i + 32]
        b = float(blk.float().abs().max())
        lean = []
        check(build, blk, b, mae, 0, fast=3, lean=lean)
        check(build, blk, b / 1536.0, mae, 3, fast=3)
        n_lean += lean[0]
    assert n_lean >= 64  # at least the blocks of the two smallest maxima
    check(build, x, float(x.float().abs().max()), mae, 0, fast=3)
    lib = build(mae, 0, dtype == torch.float32, 3, False)
    codes = run_host(lib, x[:32], float(x[:32].float().abs().max()))[0]
    assert bool(((codes.view(-1) & 0x88) != 0).any())  # negative codes among them


@pytest.mark.parametrize("mae", [False, True])
def test_lean_edges(build, mae):
    """The guards' edges: max |z| exactly 7 (fl(bamax * enc6) == 7 with both scales clamped at 448: E2M1 would
    round it to 8, so lean46 must refuse; `< 7` tested), and an imposed amax of 0 (S_enc = 1 as TE: outside
    decide46's range)."""
    x = torch.tensor([[2352.0, 1000.0, -2000.0, 5.0] + [100.0] * 12])  # g = 0.75: 2352 * enc6 == 7
    check(build, x, 0.75, mae, 3, fast=3)
    check(build, x.bfloat16(), 0.75, mae, 3, fast=3)
    x = random_blocks(256, torch.float32, 2)
    lean = []
    check(build, x, 0.0, mae, 0, fast=3, lean=lean)
    check(build, x.bfloat16(), 0.0, mae, 0, fast=3)
    assert lean[0] == 0


@pytest.mark.parametrize("mae,src", PARAMS)
def test_lean_subnormal_scales(build, mae, src):
    """Blocks whose scales are subnormal E4M3 values (bamax / 6 * S_enc below 2^-6: blocks three to four
    decades below the amax, as in a row whose columns span four): the bytes the reference's; lean46 takes
    every block from 2^-7 (the scale then holds at least 4 steps of 2^-9, so max |z| <= 6 * 4.5 / 4 < 7) and
    leaves those whose rounded scale pushes max |z| to 7 or their scale to 0."""
    g = torch.Generator().manual_seed(7)
    amax = 1000.0
    v = amax if src == 0 else amax / 1536.0
    for lo, hi, all_lean in ((-7.0, -6.0, True), (-11.0, -7.0, False)):
        base = 2.0 ** (lo + (hi - lo) * torch.rand(512, generator=g))  # bamax / 6 * S_enc (1536 / amax)
        x = torch.randn(512, 16, generator=g)
        x = x / x.abs().amax(1, keepdim=True) * (base * 6.0 * amax / 1536.0)[:, None]
        x[0, 0] = amax  # the amax itself, in a block of its own scale
        for xd in (x, x.bfloat16()):
            lean = []
            check(build, xd, v, mae, src, fast=3, lean=lean)
            if all_lean:
                assert lean[0] == x.shape[0]
            else:
                assert 0 < lean[0] < x.shape[0]


def test_lean_bound_per_block(build):
    """lean46's MSE bound from each block's own E and max |z| leaves few blocks to the exact errors on rows of
    four decades between columns: 0.26% of them with the bound's maximum under the guards (before the
    twenty-eighth session; each such block sends its warp down errors_exact), ~0.06% with it."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 4096, generator=g) * torch.logspace(-2, 2, 4096)).bfloat16()
    undecided = 0
    for row in x:
        known = check(build, row.reshape(-1, 16), float(row.float().abs().max()), False, 0, fast=3)
        undecided += 256 - known
    assert undecided <= 0.001 * x.numel() / 16, undecided


def test_div6_is_the_correctly_rounded_division(build):
    """lean46's bamax / 6 by a product and two FMAs equals float32 division on every float32 in [1, 4)
    (scaling by 2 commutes with both, so every input whose quotient is normal)."""
    lib = build(False, 0, False, 3)
    lib.div6_mismatches.restype = ctypes.c_longlong
    lib.div6_mismatches.argtypes = [ctypes.c_uint, ctypes.c_uint]
    assert lib.div6_mismatches(127 << 23, 129 << 23) == 0
