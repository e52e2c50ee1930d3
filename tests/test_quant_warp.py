"""quant.cu's 16x16 kernels themselves (nvfp4_quant_strip16, nvfp4_quant_tile16) run on the CPU by a warp
emulator, against fp4rl.nvfp4.reference: the kernel file compiled by g++ with tests/test_quant_fast46.py's
shim for the CUDA intrinsics, except that a warp's 32 lanes are 32 host threads, `threadIdx` is per thread,
and `__shfl_xor_sync` / `__any_sync` exchange values between the lanes at a barrier. A CTA's 8 warps run one
after another (the kernels share nothing between warps), one CTA (grid-stride loops cover every tile).

What this checks that the GPU tests (tests/test_quant_cuda.py) also do, without a GPU in CI: every lane calls
every shuffle (a lane that skipped one would pair the wrong exchanges: a wrong byte or a timeout here), the
strip kernel's block split over 2 / 4 lanes, the tile kernel's butterflies (TE's tree order) and its 4/6
decided per tile, block columns past the last in a warp, NaN / Inf."""

import ctypes
import hashlib
import shutil
import subprocess

import pytest
import torch

from fp4rl.kernels.quantize import cuda as qc
from fp4rl.nvfp4 import reference
from tests.test_quant_fast46 import SHIM, adjacent_flips
from tests.test_quant_tile46 import scaled_rows, tile_scale_bytes

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the kernel source as C++)")


def _warp_shim() -> str:
    """SHIM with warp-level exchanges between host threads (a lane's value posted, a barrier, the partner's
    read, a barrier) and a per-thread threadIdx."""
    swaps = {
        "template <class T> static inline T __shfl_xor_sync(unsigned, T v, int) { return v; }"
        "  // (the tile kernel)": "",
        "static inline int __any_sync(unsigned, int p) { return p; }": "",
        "static Dim3 threadIdx, blockIdx, gridDim;":
            "static thread_local Dim3 threadIdx;\nstatic Dim3 blockIdx, gridDim;",
        # (every lane counts)
        "static long long g_known, g_lean;": "static std::atomic<long long> g_known, g_lean;",
    }
    s = SHIM
    for old, new in swaps.items():
        assert s.count(old) == 1, old
        s = s.replace(old, new)
    head = r"""
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
"""
    return head + s + r"""
#ifndef WARP_WAIT_S
#define WARP_WAIT_S 20
#endif
static std::mutex g_mu;
static std::condition_variable g_cv;
static int g_waiting = 0, g_gen = 0, g_stuck = 0, g_diverged = 0;
static unsigned long long g_slot[32], g_site[32];
static thread_local unsigned long long t_seq;  // this lane's exchanges so far
static void warp_barrier() {  // all 32 lanes, or give up after WARP_WAIT_S (a lane that missed a shuffle)
  std::unique_lock<std::mutex> lk(g_mu);
  if (g_stuck) return;
  const int gen = g_gen;
  if (++g_waiting == 32) { g_waiting = 0; ++g_gen; g_cv.notify_all(); return; }
  if (!g_cv.wait_for(lk, std::chrono::seconds(WARP_WAIT_S), [&] { return g_gen != gen; })) {
    g_stuck = 1;
    g_cv.notify_all();
  }
}
// every lane at the same exchange: its call site (return address: the functions are not inlined) and count
static void same_exchange(const void* site) {
  const int lane = threadIdx.x & 31;
  g_site[lane] = (unsigned long long)site * 0x9E3779B97F4A7C15ull + t_seq++;
  warp_barrier();
  for (int i = 0; i < 32; ++i) g_diverged |= g_site[i] != g_site[lane];
  warp_barrier();
}
template <class T> __attribute__((noinline)) static T __shfl_xor_sync(unsigned, T v, int m) {
  same_exchange(__builtin_return_address(0));
  const int lane = threadIdx.x & 31;
  unsigned long long u = 0;
  memcpy(&u, &v, sizeof(T));
  g_slot[lane] = u;
  warp_barrier();
  const unsigned long long o = g_slot[lane ^ m];
  warp_barrier();
  T r;
  memcpy(&r, &o, sizeof(T));
  return r;
}
__attribute__((noinline)) static void __syncwarp() { same_exchange(__builtin_return_address(0)); }
__attribute__((noinline)) static int __any_sync(unsigned, int p) {
  same_exchange(__builtin_return_address(0));
  g_slot[threadIdx.x & 31] = p != 0;
  warp_barrier();
  int any = 0;
  for (int i = 0; i < 32; ++i) any |= (int)g_slot[i];
  warp_barrier();
  return any;
}
"""


HARNESS = r"""
// kernel 0: nvfp4_quant_strip16, 1: nvfp4_quant_tile16; one CTA of 256 threads as 8 warps in turn; returns 1
// if a barrier timed out, 2 if the lanes of a warp met at different exchanges
extern "C" int run_cta(int kernel, const void* x, void* d, unsigned char* sc, float* g, const float* given,
                       const int* parts, int n_tr, int nb_row) {
  g_stuck = g_diverged = 0;
  gridDim.x = 1;
  blockIdx.x = 0;
  for (int wi = 0; wi < 8 && !g_stuck; ++wi) {
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane)
      lanes.emplace_back([=] {
        threadIdx.x = wi * 32 + lane;
#if !RULE46 || (FAST46 == 3 && !IN_F32)
        if (kernel == 0) nvfp4_quant_strip16(x, d, sc, g, given, parts, n_tr, nb_row);
#endif
        if (kernel == 1) nvfp4_quant_tile16(x, (uint2*)d, sc, g, given, parts, n_tr, nb_row);
      });
    for (auto& t : lanes) t.join();
  }
  return g_stuck ? 1 : g_diverged ? 2 : 0;
}
// tile46_decide's decided calls since the last call (a lane each: 2 a tile in the strip kernel, 16 in the
// tile kernel)
extern "C" long long known_count() { return g_known.exchange(0); }
"""

_BUILT: dict = {}


def _lib(root, defs: dict):
    # (WARP_WAIT_S before the shim, which reads it)
    wait = f"#define WARP_WAIT_S {defs['WARP_WAIT_S']}\n" if "WARP_WAIT_S" in defs else ""
    text = wait + _warp_shim() + qc.source(defs) + HARNESS
    key = hashlib.sha1(text.encode()).hexdigest()[:16]  # (a new file for a new source: dlopen keeps old ones)
    if key not in _BUILT:
        cpp = root / f"w_{key}.cpp"
        cpp.write_text(text)
        so = root / f"w_{key}.so"
        # (no jump threading: it copies a shuffle's call into the paths a branch before it splits, which
        # the check of its call site would take for lanes at different exchanges)
        cmd = ["g++", "-O1", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
               "-pthread", "-fno-thread-jumps", "-fno-tree-dominator-opts", "-w", "-o", str(so), str(cpp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        lib = ctypes.CDLL(str(so))
        lib.run_cta.restype = ctypes.c_int
        lib.run_cta.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_int]
        lib.known_count.restype = ctypes.c_longlong
        _BUILT[key] = lib
    return _BUILT[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("warp")


def run_kernel(root, x, kernel, rule46=False, mae=False, g=None, nf=False, fast46=0, **extra):
    """x [16 n, 16 m] through the emulated kernel: (codes uint8 [rows, cols / 2], scale bytes, g); the
    tensor's amax (SRC 0) or an imposed decode-direction g (SRC 3)."""
    x = x.contiguous()
    src = 0 if g is None else 3
    defs = dict(qc.flat_config(x.dtype, rule46, mae, nf, src, False, fast46 if rule46 else 0))
    defs.update(extra)
    lib = _lib(root, defs)
    r, k = x.shape
    data = torch.full((r, k // 2), 0xAB, dtype=torch.uint8)
    sc = torch.full((r, k // 16), 0xAB, dtype=torch.uint8)
    g_out = torch.zeros(1)
    xf = x.float().abs()
    fin = xf[torch.isfinite(xf)]
    parts = torch.tensor([float(fin.max()) if fin.numel() else 0.0, 0.0]).view(torch.int32)
    given = torch.tensor([0.0 if g is None else g])
    stuck = lib.run_cta(kernel, x.data_ptr(), data.data_ptr(), sc.data_ptr(), g_out.data_ptr(),
                        given.data_ptr(), parts.data_ptr(), r // 16, k // 16)
    assert stuck != 1, "a warp barrier timed out: a lane missed a shuffle"
    assert stuck != 2, "the lanes of a warp met at different shuffles"
    run_kernel.known = lib.known_count()
    return data, sc, g_out


def check(root, x, kernel, rule46=False, mae=False, g=None, nf=False, fast46=0, **extra):
    data, sc, g_out = run_kernel(root, x, kernel, rule46, mae, g, nf, fast46, **extra)
    kw = dict(scale_rule="4/6" if rule46 else "6", err="mae" if mae else "mse", allow_nonfinite=nf,
              tile=(16, 16))
    if g is not None:
        kw["global_scale"] = torch.tensor(g)
    q = reference.quantize(x, **kw)
    bad_d = (data != q.data).any(1)
    bad_s = sc != q.block_scale.view(torch.uint8)
    assert not bad_d.any(), f"code rows differ: {bad_d.nonzero().flatten()[:8].tolist()}"
    assert not bad_s.any(), f"scale bytes differ at {bad_s.nonzero()[:8].tolist()}"
    assert g_out[0] == q.global_scale.reshape(-1)[0]
    return run_kernel.known


def tiles(shape, dtype, seed):
    """Random rows over 8 decades, a tile of E2M1 grid points and ties, a zero tile, a tiny tile."""
    gen = torch.Generator().manual_seed(seed)
    r, k = shape
    x = torch.randn(shape, generator=gen)
    x = x * torch.logspace(-4, 4, r)[torch.randperm(r, generator=gen)][:, None]
    v = torch.arange(-48, 49, dtype=torch.float32) * 0.125
    x[:16, :16] = v[torch.randint(0, v.numel(), (16, 16), generator=gen)]
    if r >= 32:
        x[16:32, :16] = 0.0
    if k >= 32:
        x[:16, 16:32] *= 2.0 ** -20
    return x.to(dtype)


# name: (kernel, compile keys added, FAST46 for 4/6: 3 is decide46 per tile); the strip kernel takes rule 6,
# and rule 4/6 decided per tile on bfloat16
KERNELS = {"strip": (0, {}, 0), "strip decide46": (0, {}, 3), "tile": (1, {}, 0), "tile decide46": (1, {}, 3),
           "tile 2 pairs a warp": (1, {"TILE_U": 2}, 0),
           "tile decide46 4 pairs a warp": (1, {"TILE_U": 4}, 3),
           "tile 2 pairs staged": (1, {"TILE_U": 2, "TILE_SMEM": 1}, 0),
           "tile decide46 4 pairs staged": (1, {"TILE_U": 4, "TILE_SMEM": 1}, 3),
           "tile decide46 2 pairs staged (the default)": (1, {"TILE_U": 2, "TILE_SMEM": 1}, 3)}
# (rule 4/6, MAE, SRC 3): rules 6 and 4/6 with the tensor's amax, rule 6 and 4/6 MAE with an imposed g
RULES = [(False, False, False), (False, False, True), (True, False, False), (True, True, True)]


def _fits(kernel: int, fast46: int, rule46: bool, dtype=torch.bfloat16) -> bool:
    strip46 = fast46 == 3 and dtype == torch.bfloat16
    return (kernel == 1 or not rule46 or strip46) and (rule46 or not fast46)


# (staged 4 pairs a warp: bfloat16 only, float32's 67 KB of shared memory is over a CTA's static 48 KB)
CASES = [(name, rule, dtype) for name, (kernel, extra, fast46) in KERNELS.items() for rule in RULES
         for dtype in (torch.bfloat16, torch.float32) if _fits(kernel, fast46, rule[0], dtype)
         and not (extra.get("TILE_SMEM") and extra["TILE_U"] == 4 and dtype == torch.float32)]


@pytest.mark.parametrize("name,rule,dtype", CASES)
def test_kernels_match_the_reference(root, name, rule, dtype):
    """Shapes whose block columns end inside a warp: 5 (both kernels), 17 (the bfloat16 strip's 16 a warp,
    plus one) and 9 (float32's 8 plus one); the tile kernel with 2 or 4 tile pairs a warp (TILE_U), some past
    the last (48x80: 9 pairs), and staged through shared memory (TILE_SMEM: where a tile row's pairs are a
    multiple of TILE_U, as the launcher sends it; 2U - 1 block columns, the last pair half past the last
    column, and 4U)."""
    kernel, extra, fast46 = KERNELS[name]
    rule46, mae, src3 = rule
    shapes = [(48, 80), (32, 272)] if dtype == torch.bfloat16 else [(48, 80), (32, 144)]
    if extra.get("TILE_SMEM"):
        shapes = [(48, 16 * (2 * extra["TILE_U"] - 1)), (32, 16 * 4 * extra["TILE_U"])]
    for i, shape in enumerate(shapes):
        x = tiles(shape, dtype, seed=i)
        g = float(x.float().abs().max()) / (1536.0 if rule46 else 2688.0) * 0.75 if src3 else None
        check(root, x, kernel, rule46, mae, g, fast46=fast46, **extra)


@pytest.mark.parametrize("name,rule46", [(n, r) for n, (k, _, f) in KERNELS.items() for r in (False, True)
                                         if _fits(k, f, r)])
def test_nonfinite(root, name, rule46):
    """allow_nonfinite: NaN -> 0, +-Inf -> +-6, scales from the finite values; a NaN half block (one lane's
    in the strip kernel), a whole NaN block, a whole NaN tile."""
    kernel, extra, fast46 = KERNELS[name]
    x = tiles((48, 112), torch.float32, seed=5)  # (7 block columns: 4 tile pairs a tile row, the last half)
    x[3, 5], x[7, 1], x[9, 30] = float("nan"), float("inf"), -float("inf")
    x[20, 40:48] = float("nan")
    x[33, 48:64] = float("nan")
    x[16:32, 64:80] = float("nan")
    x[40, 96:112] = float("inf")
    check(root, x.bfloat16(), kernel, rule46, nf=True, fast46=fast46 if rule46 else 0, **extra)


@pytest.mark.parametrize("mae", [False, True])
def test_strip_decide46_unchecked_nonfinite_as_the_tile_kernel(root, mae):
    """NaN / Inf without allow_nonfinite (the engine's unchecked calls, which the reference refuses): the
    strip kernel's 4/6 gives the tile kernel's bytes (a tile's max over its non-NaN values, Inf included; NaN
    for an all-NaN block or tile)."""
    x = tiles((48, 256), torch.float32, seed=6)
    x[3, 5], x[7, 1], x[9, 30] = float("nan"), float("inf"), -float("inf")
    x[20, 40:48] = float("nan")
    x[16:32, 64:80] = float("nan")
    x[40, 96:112] = float("inf")
    x = x.bfloat16()
    strip = run_kernel(root, x, 0, True, mae, fast46=3)
    tile = run_kernel(root, x, 1, True, mae, fast46=3)
    for a, b in zip(strip, tile):
        assert torch.equal(a, b)


def test_strip_decide46_tiles_of_zeros_and_nonfinite(root):
    """Tiles whose finite max is 0 but that hold +-Inf or NaN (a helper's review case: the strip kernel's zero
    tile stored code 0 for them): allow_nonfinite gives +-Inf the codes of +-6 (the reference's bytes), and
    unchecked the tile kernel's bytes; a lone 16x16 tensor (the warp's other tiles past the last column) and a
    zero strip beside ordinary rows."""
    a = torch.zeros(16, 16)
    a[0, 0], a[5, 9], a[9, 3] = float("inf"), -float("inf"), float("nan")
    b = torch.zeros(32, 256)
    b[16:] = torch.randn(16, 256, generator=torch.Generator().manual_seed(8))
    b[3, 40], b[7, 200], b[12, 100] = float("inf"), float("nan"), -float("inf")
    for x in (a.bfloat16(), b.bfloat16()):
        for mae in (False, True):
            check(root, x, 0, True, mae, nf=True, fast46=3)
            for got, want in zip(run_kernel(root, x, 0, True, mae, fast46=3),
                                 run_kernel(root, x, 1, True, mae, fast46=3)):
                assert torch.equal(got, want)


@pytest.mark.parametrize("scale", [2.0 ** 110, 2.0 ** -100])
def test_amax_outside_the_bound_range(root, scale):
    """Rule 4/6 with a tensor amax past 2^100 or below 2^-70 (sc.fast false): every tile by the exact errors
    with IEEE division, on the strip and the tile kernels decided per tile."""
    x = (tiles((32, 272), torch.float32, seed=3) * scale).bfloat16()
    for kernel in (0, 1):
        for mae in (False, True):
            assert check(root, x, kernel, True, mae, fast46=3) == 0


def test_tree_order(root):
    """A tile whose 4/6 pick flips under any pairing of its rows but TE's (rows r + r+8 first: the tile
    kernel's butterfly, the strip kernel's tree inside a lane), with the exact errors and decided per tile:
    u = 2^-30, row 1 (four 1.0) costs only 4 0.25, row 2 (4.5) only 6 0.25, rows 3 and 4 16u and 25u to
    both."""
    t = torch.zeros(16, 16)
    t[0, 0], t[2, 0], t[3, 0], t[4, 0] = 6.0, 4.5, 2.0 ** -13, 5 * 2.0 ** -15
    t[1, :4] = 1.0
    x = torch.cat([torch.cat([t] * 3, 1), torch.cat([t] * 3, 1) * 0.5], 0).bfloat16()
    assert reference.quantize(x, tile=(16, 16), scale_rule="4/6").block_scale.float()[0, 0] == 384.0
    for kernel, fast46 in ((1, 0), (1, 3), (0, 3)):
        check(root, x, kernel, True, fast46=fast46)
        check(root, x, kernel, True, g=2.0 ** -8, fast46=fast46)


def test_strip_decide46_decides_ordinary_tiles(root):
    """The strip kernel's lane bound is tight enough to matter: random tiles over 8 decades (tiles(), which
    also has grid-point ties, a zero tile, a tiny one) are nearly all decided by it, not by the exact errors;
    the bytes are the reference's."""
    x = tiles((64, 256), torch.bfloat16, seed=7)
    n_tiles = x.numel() // 256
    for mae, g in ((False, None), (True, float(x.float().abs().max()) / 1536.0)):
        assert check(root, x, 0, True, mae, g, fast46=3) // 2 >= n_tiles - 4  # (2 lanes a tile call it)


def strip_near_ties(mae: bool, src: int, n: int = 256, seed: int = 0):
    """bfloat16 16x16 tiles on both sides of a flip of the reference's 4/6 choice: rows 0..7 near 6's grid,
    rows 8..15 near 4's, element (0, 0) the tile's max (6 times a power of two); rows 8..15 scaled by t,
    bisected over bfloat16 t to a flip (a step of t moves 128 values: a coarse gap), then element (15, 15)
    alone set to values in (0.02, 0.98) of the max, bisected to adjacent bfloat16 values (a gap of one
    element's ulp). Returns ([16, 16 x 2m] tiles side by side, g or None)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    x = torch.zeros(n, 16, 16)
    x[:, :8, :2] = grid[torch.randint(0, 6, (n, 8, 2), generator=gen)]
    x[:, 8:, :] = grid[torch.randint(0, 6, (n, 8, 16), generator=gen)] * 1.5
    x = x * torch.where(torch.rand(n, 16, 16, generator=gen) < 0.5, -1.0, 1.0)
    x = (x * (1 + 0.05 * torch.randn(n, 16, 16, generator=gen))).clamp(-5.9, 5.9)
    x[:, 0, 0] = 6.0
    x = (x * 2.0 ** torch.randint(-6, 7, (n, 1, 1), generator=gen).float()).bfloat16()
    top = x[:, 0, 0].float()
    v = float(top.max()) if src == 0 else float(top.max()) / 1536.0

    def scale_of(x):  # [n, 16, 16] -> each tile's scale byte
        return tile_scale_bytes(x, torch.ones(x.shape[0], dtype=x.dtype), v, mae, src)

    def elem_set(x, t):
        xt = x.clone()
        xt[:, 15, 15] = t
        return xt

    pts = [torch.full((n,), float(f)).bfloat16() for f in torch.linspace(0.02, 0.98, 49)]
    keep, a, _ = adjacent_flips(x, pts, lambda x, t: tile_scale_bytes(x, t, v, mae, src), torch.bfloat16)
    x, top = scaled_rows(x[keep], a).reshape(-1, 16, 16), top[keep]
    pts = [(f * top).bfloat16() for f in torch.linspace(0.02, 0.98, 49)]
    keep, a, b = adjacent_flips(x, pts, lambda x, t: scale_of(elem_set(x, t)), torch.bfloat16)
    x = torch.cat([elem_set(x[keep], a), elem_set(x[keep], b)])
    assert x.shape[0] >= 100, x.shape  # most tiles flip somewhere in both scans
    assert bool((scale_of(x[: x.shape[0] // 2]) != scale_of(x[x.shape[0] // 2:])).all())
    return x.permute(1, 0, 2).reshape(16, -1).contiguous(), None if src == 0 else v


def both_grids(n: int = 128, seed: int = 11) -> torch.Tensor:
    """bfloat16 16x16 tiles side by side [16, 16 n] of values on both candidates' grids ({1.5, 3, 6} sigma6 =
    {1, 2, 4} sigma4, the tile's max 6) moved by up to 3 ulps: both candidates decode alike, the reference's
    errors tie and it keeps 6, while the cheap errors differ by their roundings (as in
    tests/test_quant_tile46.py)."""
    gen = torch.Generator().manual_seed(seed)
    vals = torch.tensor([0.0, 1.5, 3.0, 6.0])
    x = vals[torch.randint(0, 4, (n, 16, 16), generator=gen)]
    x = x * torch.where(torch.rand(n, 16, 16, generator=gen) < 0.5, -1.0, 1.0)
    x[:, 0, 0] = 6.0
    bits = x.bfloat16().view(torch.int16).to(torch.int32)
    ulps = torch.randint(-3, 4, (n, 16, 16), generator=gen, dtype=torch.int32)
    moved = torch.where(x != 0, bits + ulps, bits)
    moved[:, 0, 0] = bits[:, 0, 0]
    return moved.to(torch.int16).view(torch.bfloat16).permute(1, 0, 2).reshape(16, -1).contiguous()


@pytest.mark.parametrize("mae,src", [(False, 0), (True, 3)])
def test_strip_decide46_near_ties(root, mae, src):
    """The strip kernel's 4/6 decided per tile from lane sums (quant.cu strip_decide46) on tiles one bfloat16
    ulp of one element from a flip of the reference's choice, and on tiles whose candidates tie: the
    reference's bytes, with many near ties and every tie left to the exact errors."""
    x, g = strip_near_ties(mae, src)
    known = check(root, x, 0, True, mae, g, fast46=3) // 2
    assert known < 0.9 * (x.shape[1] // 16), known
    x = both_grids()
    g = None if src == 0 else 6.0 / 1536.0
    assert check(root, x, 0, True, mae, g, fast46=3) == 0


def test_strip_decide46_without_a_margin_is_caught(root, monkeypatch):
    """The tied tiles above catch a strip kernel that decides by its cheap errors alone (no bound, no
    widening, no slack for the products): rounding noise then picks 4 for tiles the reference keeps at 6."""
    src = qc._SOURCE.read_text()
    swaps = {"  return U * (1132.0f * xs * xm * r + 88.0f * e + 16.0f);": "  return 0.0f * r;",
             "const float c = 1.0000019073486328125f, t = 7.62939453125e-06f;  // 1 + 2^-19, 2^-17":
                 "const float c = 1.0f;",
             "const float v6 = B6 + t * (E6 + B6), v4 = B4 + t * (E4 + B4);":
                 "const float v6 = 0.0f, v4 = 0.0f;"}
    for old, new in swaps.items():
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    monkeypatch.setattr(qc, "source",
                        lambda defs: "".join(f"#define {k} {v}\n" for k, v in defs.items()) + src)
    with pytest.raises(AssertionError, match="differ"):
        check(root, both_grids(), 0, True, fast46=3)


def test_a_lane_that_misses_a_shuffle_is_caught(root, monkeypatch):
    """The emulator itself: a kernel whose lanes past the last column skip the tile max's shuffle (the bug
    the kernels' comments rule out) is caught: its lanes meet at different exchanges (which here still pair
    the right values: only the live lanes read each other's)."""
    src = qc._SOURCE.read_text()
    old = "    for (int k = 1; k < LPB; k <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, k));"
    assert src.count(old) == 1
    bad = src.replace(old, "    if (live)\n" + old)
    x = tiles((16, 80), torch.bfloat16, seed=1)  # 5 block columns: 22 of 32 lanes dead
    check(root, x, 0, WARP_WAIT_S=2)  # (the kernel as it is passes)
    monkeypatch.setattr(qc, "source", lambda defs: "".join(f"#define {k} {v}\n" for k, v in defs.items())
                        + bad)
    with pytest.raises(AssertionError, match="different shuffles|barrier timed out"):
        check(root, x, 0, WARP_WAIT_S=2)
