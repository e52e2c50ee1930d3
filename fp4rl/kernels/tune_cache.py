"""The GEMM tuner's picks on disk, so that a new process (a restarted sampler, another Ray worker on the same
kind of GPU) reuses them instead of timing every candidate again (14-22 s of warm-up per batch bucket for
Qwen3-8B on an H200 with the Triton candidates compiled: bench/RESULTS.md, twentieth session).

One JSON file per (GPU name, compute capability, torch, triton, the kernels' sources): a change to a kernel or
to a candidate list (the hash of their source files) starts a new file, so a pick is never reused for code it
was not timed on. An entry maps the tuner's key (gemm_tune._choose's, without the device) to the kept
candidate; a cached pick is taken only while it is still one of the key's candidates. Directory:
FP4RL_TUNE_CACHE (a path; "0" or empty turns the cache off), else $XDG_CACHE_HOME/fp4rl/gemm_tune, else
~/.cache/fp4rl/gemm_tune.
FP4RL_* switches that change the kernels (PDL, splits: every FP4RL_* variable but FP4RL_TUNE_CACHE and
FP4RL_TRACEBACK) are part of the file name too. Writes take a lock, merge with what is on disk and replace
the file atomically (a temporary file renamed), so concurrent processes neither tear the file nor drop each
other's picks; a miss re-reads a file that another process has changed, and of two processes that timed the
same key at once the second adopts the first one's pick (`store`): one configuration, one rounding, per
machine. A file that cannot be read is
ignored (and rewritten), a directory that cannot be written turns the cache off for the process with one
warning. The tuner stores a pick only when every candidate ran (gemm_tune._choose): a pick made without a
candidate that failed in one process (the wgmma build off, a Gluon failure, an out-of-memory) is not kept
for the others.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch

_SOURCES = ("gemm.py", "gemm_tune.py", "gemm_kernel.py", "gemv.py", "gemv_cuda.py", "gemv_cuda_grouped.py",
            "gemv_mma16.cu", "_common.py", "pdl.py", "dequantize.py")
# environment switches that are not kernel choices (every other FP4RL_* variable is part of the file name: A/B
# switches such as FP4RL_PDL change what the candidates measure)
_ENV_IGNORED = ("FP4RL_TUNE_CACHE", "FP4RL_TRACEBACK")
STATE = {"off": False, "error": None}
_ENTRIES: dict[Path, dict] = {}  # file -> its entries as last read or written by this process
_MTIME: dict[Path, int | None] = {}  # file -> its modification time (ns) when last read


def directory() -> Path | None:
    """Where the cache files go (None: the cache is off)."""
    v = os.environ.get("FP4RL_TUNE_CACHE")
    if v is not None:
        return None if v.strip() in ("", "0") else Path(v).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fp4rl" / "gemm_tune"


@functools.cache
def sources_hash() -> str:
    """The kernels' and candidate lists' source files, hashed (a missing file raises OSError)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def env_hash() -> str:
    """The FP4RL_* environment switches (but _ENV_IGNORED), hashed: '' when none is set."""
    items = sorted((k, v) for k, v in os.environ.items() if k.startswith("FP4RL_") and k not in _ENV_IGNORED)
    return hashlib.sha256(repr(items).encode()).hexdigest()[:8] if items else ""


def file_name(gpu: str, capability: tuple[int, int]) -> str:
    """The cache file of one GPU kind with this torch, triton and kernel sources."""
    import triton

    def clean(s: str) -> str:
        return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-")

    env = env_hash()
    return (f"{clean(gpu)}-sm{capability[0]}{capability[1]}-torch{clean(torch.__version__)}"
            f"-triton{clean(triton.__version__)}-{sources_hash()}{'-env' + env if env else ''}.json")


def file_for(device) -> Path | None:
    """The cache file for a CUDA device (None: the cache is off)."""
    d = directory()
    if d is None or STATE["off"]:
        return None
    p = torch.cuda.get_device_properties(device)
    try:
        return d / file_name(p.name, (p.major, p.minor))
    except OSError as exc:  # a source file missing from this installation: no cache rather than no GEMM
        _off(exc, "cannot hash the kernel sources")
        return None


def _off(exc: Exception, what: str) -> None:
    STATE["off"], STATE["error"] = True, repr(exc)[:300]
    warnings.warn(f"GEMM tune cache off for this process: {what} ({STATE['error']}); set FP4RL_TUNE_CACHE to "
                  "a writable directory, or 0 to silence this", stacklevel=4)


def key_str(key: tuple) -> str:
    """The tuner's key without its device (the file is per kind of GPU), as JSON text."""
    return json.dumps([v for v in key if not isinstance(v, torch.device)])


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _read(path: Path) -> dict:
    _MTIME[path] = _mtime(path)
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # no file (yet)
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"GEMM tune cache {path} unreadable ({exc!r:.200}): ignored, it is rewritten on the "
                      "next tuned shape", stacklevel=3)
        return {}
    return data if isinstance(data, dict) else {}


def lookup(path: Path, key: tuple, candidates: list):
    """The cached pick for key if it is still one of `candidates` (that object itself), else None."""
    if path not in _ENTRIES or (key_str(key) not in _ENTRIES[path] and _mtime(path) != _MTIME.get(path)):
        _ENTRIES[path] = _read(path)  # first use, or a miss while another process has written the file
    cached = _ENTRIES[path].get(key_str(key))
    if cached is None:
        return None
    return next((c for c in candidates if c == cached), None)


def store(path: Path, key: tuple, pick, candidates: list | None = None):
    """Record key -> pick (a config dict or a path name), merged with the file as it is on disk now, under an
    exclusive lock on a sidecar file (concurrent writers do not drop each other's entries). -> the pick to
    run: the first one stored wins. When another process stored one of `candidates` for the key first (Ray
    sampler actors starting together all miss the cache and time), that one is kept and returned, so every
    process sharing the directory runs the same configuration, and candidates that sum in another order
    give no process other bits than the rest."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            on_disk = _read(path)
            first = on_disk.get(key_str(key))
            if first is not None and candidates is not None:
                kept = next((c for c in candidates if c == first), None)
                if kept is not None:
                    _ENTRIES[path] = {**_ENTRIES.get(path, {}), **on_disk}
                    return kept
            entries = {**_ENTRIES.get(path, {}), **on_disk, key_str(key): pick}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entries, f, indent=0, sort_keys=True)
                os.chmod(tmp, 0o644)  # (mkstemp makes it owner-only; the cache may be shared)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
            _MTIME[path] = _mtime(path)
    except (OSError, TypeError, ValueError) as exc:
        _off(exc, f"cannot write {path}")
        return pick
    _ENTRIES[path] = entries
    return pick
