"""The GEMM tuner's disk cache (fp4rl.kernels.tune_cache): where it lives, what a file is keyed by, picks
round-tripped and validated against the current candidates, concurrent writers merged, bad files and
unwritable directories handled. The tuner using it on a GPU: tests/test_triton_gemm.py."""

import json
import os
import warnings

import pytest
import torch

from fp4rl.kernels import gemm_tune, tune_cache


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(tune_cache, "_ENTRIES", {})
    monkeypatch.setitem(tune_cache.STATE, "off", False)


def test_directory_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4RL_TUNE_CACHE", "0")
    assert tune_cache.directory() is None
    monkeypatch.setenv("FP4RL_TUNE_CACHE", "")
    assert tune_cache.directory() is None
    monkeypatch.setenv("FP4RL_TUNE_CACHE", str(tmp_path / "c"))
    assert tune_cache.directory() == tmp_path / "c"
    monkeypatch.delenv("FP4RL_TUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_cache.directory() == tmp_path / "fp4rl" / "gemm_tune"


def test_file_name_names_the_gpu_software_and_kernels():
    import triton

    name = tune_cache.file_name("NVIDIA H200 (MIG 1g)", (9, 0))
    assert name.startswith("NVIDIA-H200-MIG-1g-sm90-torch") and name.endswith(".json")
    assert torch.__version__.split("+")[0] in name and triton.__version__ in name
    h = tune_cache.sources_hash()
    assert len(h) == 16 and h in name and all(c in "0123456789abcdef" for c in h)
    assert "/" not in name and " " not in name


def test_key_drops_the_device():
    key = (64, 4096, 7168, 1, False, False, 1, torch.device("cuda", 3), True, 0)
    assert json.loads(tune_cache.key_str(key)) == [64, 4096, 7168, 1, False, False, 1, True, 0]
    assert tune_cache.key_str(key) == tune_cache.key_str(key[:7] + (torch.device("cuda", 0),) + key[8:])


def test_picks_round_trip_and_must_still_be_candidates(tmp_path):
    path = tmp_path / "d" / "gpu.json"
    cands = ([gemm_tune.WIDE] + gemm_tune.candidate_configs(128, 4096, 2048, torch.device("cpu"))
             + [gemm_tune.FALLBACK])
    k1 = (128, 4096, 2048, 1, False, False, 1, torch.device("cpu"), True, 0)
    k2 = k1[:-2] + (False, 0)
    assert tune_cache.lookup(path, k1, cands) is None  # no file yet
    tune_cache.store(path, k1, cands[1])  # a Triton configuration (a dict)
    tune_cache.store(path, k2, gemm_tune.FALLBACK)
    tune_cache._ENTRIES.clear()  # a new process: read back from the file
    assert tune_cache.lookup(path, k1, cands) is cands[1]  # the candidate object itself
    assert tune_cache.lookup(path, k2, cands) == gemm_tune.FALLBACK
    # a pick that is no longer among the key's candidates (changed candidate lists) is not taken
    assert tune_cache.lookup(path, k1, cands[:1] + cands[2:]) is None
    assert tune_cache.lookup(path, k1[:1] + (8192,) + k1[2:], cands) is None  # another key


def test_concurrent_writers_merge(tmp_path):
    path = tmp_path / "gpu.json"
    k = [(m, 4096, 2048, 1, False, False, 1, None, False, 0) for m in (64, 128)]
    tune_cache.store(path, k[0], "a")
    tune_cache._ENTRIES.clear()  # another process, which read the file before the first one wrote
    tune_cache._ENTRIES[path] = {}
    tune_cache.store(path, k[1], "b")
    data = json.loads(path.read_text())
    assert data == {tune_cache.key_str(k[0]): "a", tune_cache.key_str(k[1]): "b"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tune-")]  # no temporary file left


def test_the_first_pick_stored_wins(tmp_path):
    """Two processes time the same key at once (Ray actors starting together): the second to store gets
    the first one's pick back, and the file keeps it; a pick that is no longer a candidate is replaced."""
    path = tmp_path / "gpu.json"
    cands = [gemm_tune.WIDE, gemm_tune.FALLBACK, "dense"]
    k = (64, 4096, 2048, 1, False, False, 1, None, False, 0)
    assert tune_cache.store(path, k, gemm_tune.WIDE, cands) == gemm_tune.WIDE
    tune_cache._ENTRIES.clear()  # the other process, which looked the key up before the first one stored
    tune_cache._ENTRIES[path] = {}
    assert tune_cache.store(path, k, gemm_tune.FALLBACK, cands) == gemm_tune.WIDE
    assert json.loads(path.read_text()) == {tune_cache.key_str(k): gemm_tune.WIDE}
    assert tune_cache.lookup(path, k, cands) == gemm_tune.WIDE  # and it is what it now reads
    assert tune_cache.store(path, k, "dense", ["dense", gemm_tune.FALLBACK]) == "dense"  # WIDE gone
    assert json.loads(path.read_text()) == {tune_cache.key_str(k): "dense"}


def test_unreadable_file_is_ignored_then_rewritten(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("{not json")
    key = (64, 4096, 2048, 1, False, False, 1, None, False, 0)
    with pytest.warns(UserWarning, match="unreadable"):
        assert tune_cache.lookup(path, key, ["x"]) is None
    with pytest.warns(UserWarning, match="unreadable"):
        tune_cache.store(path, key, "x")
    tune_cache._ENTRIES.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tune_cache.lookup(path, key, ["x"]) == "x"


def test_unwritable_directory_turns_the_cache_off(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "sub" / "gpu.json"  # a directory under a regular file cannot be made
    with pytest.warns(UserWarning, match="cache off for this process"):
        tune_cache.store(path, (1,), "x")
    assert tune_cache.STATE["off"]
    monkeypatch.setenv("FP4RL_TUNE_CACHE", str(tmp_path))
    assert tune_cache.file_for(torch.device("cpu")) is None  # off: not even the device is queried


def test_kernel_switches_and_sources_name_the_file(monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("FP4RL_")]:
        monkeypatch.delenv(k)
    plain = tune_cache.file_name("H200", (9, 0))
    assert "-env" not in plain
    monkeypatch.setenv("FP4RL_TUNE_CACHE", str(tmp_path))  # not a kernel switch
    monkeypatch.setenv("FP4RL_TRACEBACK", "1")
    assert tune_cache.file_name("H200", (9, 0)) == plain
    monkeypatch.setenv("FP4RL_PDL", "0")  # an A/B switch: picks timed under it go to another file
    other = tune_cache.file_name("H200", (9, 0))
    assert other != plain and "-env" in other
    monkeypatch.setenv("FP4RL_TUNE_CACHE", "~/c")
    assert tune_cache.directory() == (tmp_path.home() / "c").resolve()
    # a kernel source missing from the installation turns the cache off (the GEMM still runs)
    monkeypatch.setattr(tune_cache, "_SOURCES", tune_cache._SOURCES + ("missing.cu",))
    tune_cache.sources_hash.cache_clear()
    try:
        with pytest.raises(OSError):
            tune_cache.sources_hash()
    finally:
        tune_cache.sources_hash.cache_clear()


def test_a_miss_rereads_a_file_another_process_wrote(tmp_path):
    path = tmp_path / "gpu.json"
    k1, k2 = (64, 1), (128, 1)
    tune_cache.store(path, k1, "a")
    assert tune_cache.lookup(path, k2, ["b"]) is None
    other = {tune_cache.key_str(k1): "a", tune_cache.key_str(k2): "b"}  # another process's write
    path.write_text(json.dumps(other))
    os.utime(path, ns=(1, 1))  # (a different modification time, whatever the clock's resolution)
    assert tune_cache.lookup(path, k2, ["b"]) == "b"
    tune_cache.store(path, (256, 1), "c")
    assert (path.stat().st_mode & 0o777) == 0o644  # readable by the others sharing the cache


class _Clone:
    """A stand-in weight copy (a weakref tells whether the tuner let it go)."""


def _tuner(monkeypatch, tmp_path, fail=None, oom=False):
    """gemm_tune._choose with the CUDA pieces replaced: candidate c times c's index (us); `fail` candidates
    raise in their first (eager) run. Returns (choose, weakrefs to the rotation's copies, disabled-WIDE
    calls)."""
    import weakref

    from fp4rl.kernels import gemv_cuda

    monkeypatch.setattr(gemm_tune, "INTERPRET", False)
    monkeypatch.setattr(gemm_tune, "_sm_count", lambda d: 132)
    monkeypatch.setattr(gemm_tune, "_l2_bytes", lambda d: 50 * 2**20)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (2**34, 2**35))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"name": "H200", "major": 9, "minor": 0})())
    monkeypatch.setenv("FP4RL_TUNE_CACHE", str(tmp_path))
    disabled = []
    monkeypatch.setattr(gemv_cuda, "disable_wide", lambda exc: disabled.append(repr(exc)))
    clones = []

    def make(count):
        out = []
        for _ in range(count):
            clone = _Clone()
            clones.append(weakref.ref(clone))
            out.append(lambda c, clone=clone: (c, clone))
        return out

    def warm(calls):
        for call in calls:
            c, _ = call()
            if fail is not None and c in fail:
                raise (torch.OutOfMemoryError("no memory") if oom else RuntimeError("NVRTC refused it"))

    monkeypatch.setattr(gemm_tune, "warm", warm)
    monkeypatch.setattr(gemm_tune, "time_chain", lambda calls: float(cands().index(calls[0]()[0])))
    device = type("D", (), {"type": "cuda"})()

    def cands():
        return [gemm_tune.WIDE] + gemm_tune.candidate_configs(100, 4096, 2048, device) + [gemm_tune.FALLBACK]

    mb = 2**20  # the weight's operands as the tuner sizes them: 33 MB read per call, 66 MB a copy
    sized = [type("T", (), {"nbytes": b})() for b in (29 * mb, 4 * mb, 0)]
    ops = (*sized, type("M", (), {"wt": sized[0], "st": sized[1]})(), None, None)

    def choose(key):
        return gemm_tune._choose(key, 100, 4096, 2048, device, None, False, True, True,
                                 lead=(gemm_tune.WIDE,), rotate=(make, ops))
    return choose, clones, disabled, cands


def test_the_tuner_keeps_and_reuses_its_pick(monkeypatch, tmp_path):
    import gc

    choose, clones, disabled, cands = _tuner(monkeypatch, tmp_path)
    monkeypatch.setattr(gemm_tune, "_TUNED", {})
    monkeypatch.setattr(gemm_tune, "TUNE_LOG", {})
    key = (128, 4096, 2048, 1, False, False, 1, None, True, 0)
    assert choose(key) == gemm_tune.WIDE  # index 0: the fastest
    assert len(clones) == 5  # ceil(3 x 50 MB / 33 MB) operand sets, every candidate timed on them
    assert len(gemm_tune.TUNE_LOG[key]) == len(cands()) and not disabled
    gc.disable()  # nothing may depend on a garbage-collection pass to free the copies
    try:
        assert all(r() is None for r in clones)
    finally:
        gc.enable()
    # a new process: the pick comes from the file, nothing is timed
    monkeypatch.setattr(gemm_tune, "_TUNED", {})
    monkeypatch.setattr(gemm_tune, "TUNE_LOG", {})
    monkeypatch.setattr(tune_cache, "_ENTRIES", {})
    n = len(clones)
    assert choose(key) == gemm_tune.WIDE and not gemm_tune.TUNE_LOG and len(clones) == n


def test_a_pick_another_process_stored_while_this_one_timed_is_taken(monkeypatch, tmp_path):
    """Sampler processes on one machine run one configuration per key: one that stores its pick while this
    process is timing the same key makes this one drop its own (faster here) pick and run the stored one."""
    choose, _, _, cands = _tuner(monkeypatch, tmp_path)
    monkeypatch.setattr(gemm_tune, "_TUNED", {})
    monkeypatch.setattr(gemm_tune, "TUNE_LOG", {})
    monkeypatch.setattr(tune_cache, "_ENTRIES", {})
    key = (128, 4096, 2048, 1, False, False, 1, None, True, 0)
    timed = gemm_tune.time_chain
    other = cands()[2]

    def time_and_race(calls):
        if not gemm_tune.TUNE_LOG[key]:  # the other process finishes while this one times its first
            tune_cache.store(tune_cache.file_for(None), key, other)
        return timed(calls)

    monkeypatch.setattr(gemm_tune, "time_chain", time_and_race)
    assert choose(key) == other and gemm_tune._TUNED[key] == other
    assert min(gemm_tune.TUNE_LOG[key], key=lambda e: e[1])[0] == gemm_tune.WIDE  # its own pick was WIDE


@pytest.mark.parametrize("first_fails", [False, True])
def test_a_small_weight_is_not_timed(monkeypatch, tmp_path, first_fails):
    """A weight under gemm_tune.TUNE_MIN_BYTES (packed data + scales) takes the first candidate that runs,
    untimed, and nothing goes to disk: a call over it is launch-bound, and timing compiles every candidate per
    row bucket. A first candidate that fails is skipped as the timing loop skips it (WIDE refused: the wgmma
    build off). TUNE_MIN_BYTES = 0 (FP4RL_TUNE_MIN_BYTES=0) times it."""
    _, _, disabled, cands = _tuner(monkeypatch, tmp_path, fail=[gemm_tune.WIDE] if first_fails else None)
    monkeypatch.setattr(gemm_tune, "_TUNED", {})
    monkeypatch.setattr(gemm_tune, "TUNE_LOG", {})
    monkeypatch.setattr(gemm_tune, "time_chain",
                        lambda calls: 1.0 if calls[0]()[0] == gemm_tune.WIDE else 0.5)
    device = type("D", (), {"type": "cuda"})()
    make = lambda count: [lambda c: (c, None) for _ in range(count)]  # noqa: E731
    ran = []
    run = lambda c: ran.append(c) or (c, None)  # noqa: E731
    kb = 2**10
    first = cands()[1] if first_fails else gemm_tune.WIDE
    for data, scales, timed in ((3072 * kb, 384 * kb, False), (3800 * kb, 500 * kb, True)):
        sized = [type("T", (), {"nbytes": b})() for b in (data, scales, 0)]
        key = (128, 4096, 2048, 1, False, False, 1, None, True, 0, data)
        pick = gemm_tune._choose(key, 100, 4096, 2048, device, run, False, True, True, lead=(gemm_tune.WIDE,),
                                 rotate=(make, (*sized, None, None, None)))
        assert (key in gemm_tune.TUNE_LOG) == timed
        assert pick == (cands()[1] if timed else first)
        if not timed:
            assert ran == [gemm_tune.WIDE] + ([first] if first_fails else [])  # compiled and run, once each
    assert len(disabled) == (2 if first_fails else 0)  # (once per pick: the stand-in keeps WIDE in `lead`)
    assert len(list(tmp_path.glob("*.json"))) == (0 if first_fails else 1)  # the timed pick only (if clean)
    monkeypatch.setattr(gemm_tune, "TUNE_MIN_BYTES", 0)
    key = (128, 4096, 2048, 1, False, False, 1, None, True, 0, 1)
    sized = [type("T", (), {"nbytes": b})() for b in (kb, kb, 0)]
    assert gemm_tune._choose(key, 100, 4096, 2048, device, run, False, True, True, lead=(gemm_tune.WIDE,),
                             rotate=(make, (*sized, None, None, None))) == cands()[1]
    assert key in gemm_tune.TUNE_LOG


def test_tune_min_bytes_from_the_environment(monkeypatch):
    assert gemm_tune._env_bytes("FP4RL_TEST_UNSET_BYTES", 123) == 123
    monkeypatch.setenv("FP4RL_TEST_BYTES", "0")
    assert gemm_tune._env_bytes("FP4RL_TEST_BYTES", 123) == 0
    for bad in ("4MiB", "-1", ""):
        monkeypatch.setenv("FP4RL_TEST_BYTES", bad)
        with pytest.raises(ValueError, match="FP4RL_TEST_BYTES=.*integer number of bytes >= 0"):
            gemm_tune._env_bytes("FP4RL_TEST_BYTES", 123)


@pytest.mark.parametrize("oom", [False, True])
def test_a_failed_candidate_is_skipped_and_its_pick_not_kept(monkeypatch, tmp_path, oom):
    import gc

    choose, clones, disabled, cands = _tuner(monkeypatch, tmp_path, fail=[gemm_tune.WIDE], oom=oom)
    monkeypatch.setattr(gemm_tune, "_TUNED", {})
    monkeypatch.setattr(gemm_tune, "TUNE_LOG", {})
    key = (128, 4096, 2048, 1, False, False, 1, None, True, 0)
    assert choose(key) == cands()[1]  # the fastest that ran
    assert isinstance(gemm_tune.TUNE_LOG[key][0][1], str)  # the failure, as text
    assert len(disabled) == (0 if oom else 1)  # a compile failure turns the wgmma build off; an OOM does not
    gc.disable()
    try:
        assert all(r() is None for r in clones)  # no kept traceback holds the copies
    finally:
        gc.enable()
    assert not list(tmp_path.glob("*.json"))  # a pick made without a failed candidate is not kept on disk


@pytest.mark.parametrize("dense_fastest", [True, False])
def test_the_dense_copy_is_a_timed_candidate_in_place_of_the_fallback(monkeypatch, tmp_path, dense_fastest):
    """A weight with its dense copy (Sampler(dense_rows=)): untuned, the copy runs (the caller chose it);
    tuned, it is timed against the 4-bit kernels and kept only if it is faster, and FALLBACK (the same cuBLAS
    product after a per-call dequantize) is not a candidate."""
    _tuner(monkeypatch, tmp_path)
    monkeypatch.setattr(gemm_tune, "_TUNED", {})
    monkeypatch.setattr(gemm_tune, "TUNE_LOG", {})
    device = type("D", (), {"type": "cuda"})()
    key = (128, 4096, 2048, 1, False, False, 1, None, True, 0, True)

    def timing(calls):
        c = calls[0]()[0]
        if c == gemm_tune.DENSE:
            return 0.5 if dense_fastest else 2.0
        return 1.0 + len(str(c)) / 1e3

    monkeypatch.setattr(gemm_tune, "time_chain", timing)
    make = lambda count: [lambda c: (c, None) for _ in range(count)]  # noqa: E731
    mb = 2**20
    sized = [type("T", (), {"nbytes": b})() for b in (29 * mb, 4 * mb, 0)]
    ops = (*sized, None, None, type("T", (), {"nbytes": 116 * mb})())
    lead = (gemm_tune.DENSE, gemm_tune.WIDE)
    choose = gemm_tune._choose
    assert choose(key, 100, 4096, 2048, device, None, False, True, False, lead=lead) == gemm_tune.DENSE
    monkeypatch.setattr(gemm_tune, "_TUNED", {})
    pick = choose(key, 100, 4096, 2048, device, None, False, True, True, lead=lead, rotate=(make, ops))
    timed = [c for c, _ in gemm_tune.TUNE_LOG[key]]
    assert timed[:2] == [gemm_tune.DENSE, gemm_tune.WIDE] and gemm_tune.FALLBACK not in timed
    assert (pick == gemm_tune.DENSE) == dense_fastest
