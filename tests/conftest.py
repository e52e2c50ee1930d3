"""Test-session setup that must happen before any test module imports triton.

On machines without a GPU the Triton kernels run in the interpreter. TRITON_INTERPRET is read
when a kernel is decorated, and some oracle libraries (torchao) import triton and its helpers
early, so the variable is set here, before collection, rather than in the kernel test modules.
"""

import os
import shutil
import subprocess


def _has_cuda_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


if not _has_cuda_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the GEMM tuner times every candidate in tests (no picks from, or written to, the user's disk cache);
# tests of the cache set their own directory
os.environ["FP4RL_TUNE_CACHE"] = "0"


def _patch_lang_once() -> None:
    """Under TRITON_INTERPRET=1, a kernel's launch patches triton.language for the interpreter (and restores
    it when the grid is done), and then every call of a @triton.jit helper inside every program patches it
    again: a scan of the whole language with inspect.getmembers, ~0.7 ms a call, a third of the interpreted
    engine tests' time, that changes nothing, as the launch's patch is in place (a patched builtin is no
    longer a builtin, so it is not wrapped twice; the other attributes get the same functions again). Here a
    helper's call inside a launch skips it where the launch, or a helper before it, patched the helper's
    language modules (the standard library's helpers see triton.language.core too); any other call patches
    as before. Triton's behaviour is otherwise unchanged; without the private names it relies on, nothing
    is patched."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
        original, scope_type = interpreter._patch_lang, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    active: set[int] = set()  # ids of the language modules the running launch patched (empty: none running)

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        mine = langs(fn)
        if active and mine <= active:
            return scope_type()  # a helper inside the launch: already patched, nothing to restore
        scope = original(fn)
        launch = not active
        active.update(mine)  # (a helper's modules the launch's patch did not cover, e.g. core: patched once)
        if launch:  # its scope is restored when its grid is done
            restore = scope.restore

            def restore_and_clear():
                try:
                    restore()
                finally:
                    active.clear()

            scope.restore = restore_and_clear
        return scope

    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_lang_once()
