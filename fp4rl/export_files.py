"""The files of an NVFP4 export directory: safetensors shards, JSON configs, README.md, and
fp4rl_manifest.json, which records the size and sha256 of every file so a load can refuse a
file that changed after export.

The directory is written into a temporary sibling and renamed into place, so OUT is either
complete or absent; an existing non-empty OUT is replaced only when asked (overwrite=True), and
only when it is an earlier export (it holds fp4rl_manifest.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from fp4rl.hf import fsync_dir, fsync_tree

MANIFEST = "fp4rl_manifest.json"
INDEX_FILE = "model.safetensors.index.json"
# Files whose presence changes what a loader reads: any of them not in the manifest is refused.
_CHECKED_SUFFIXES = (".safetensors", ".json")


def readme(name: str, manifest: dict, summary: str) -> str:
    """README.md of an export: what it holds and the commands that serve it."""
    fmt, act = manifest["format"], manifest["activations"]
    if fmt == "modelopt":
        vllm = f"vllm serve ./{name} --quantization modelopt_fp4"
        sglang = (f"python -m sglang.launch_server --model-path ./{name} --quantization modelopt_fp4"
                  if act == "w4a4" else
                  "# SGLang's ModelOpt loader reads quant_algo FP8/NVFP4 only; for W4A16 export with "
                  "--format compressed-tensors")
    else:
        vllm = f"vllm serve ./{name}"
        sglang = f"python -m sglang.launch_server --model-path ./{name} --quantization compressed-tensors"
    calib = manifest["calibration"]
    scales = ("no input scales (activations stay BF16)" if calib is None else
              f"static input scales from the activation amax over {calib['prompts']} calibration prompts "
              f"({calib['tokens']} tokens; {calib['source']})")
    gs = manifest["global_scales"]
    return f"""# {name}: NVFP4 ({fmt}, {act.upper()}) exported by fp4rl {manifest['producer']['version']}

Source: `{manifest['source'] or 'in-memory model'}`. Every quantized linear holds the bytes the
trainer's forward computed with: E2M1 codes, E4M3 scales per 16 values (4/6 scales are ordinary
E4M3 values), one FP32 global scale per tensor, shared by q/k/v and by gate/up. Unquantized
tensors are {manifest['dtype']}; the modules the contract keeps BF16 are the exclude/ignore list
({manifest['excluded_modules']} entries). Activations: {scales}. Global scales exactly as trained:
{gs['exact']} of {gs['tensors']}.

## Serve

```bash
{vllm}
{sglang}
```

fp4rl quantizes activations per token, online; the static input scales here serve engines that
use one scale per tensor. Engines that scale activations per token ignore them: SGLang's
FlashInfer TRT-LLM MoE path with `SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1`, and the online
modes that quantize a BF16 checkpoint themselves (vLLM `--quantization nvfp4_per_token`, SGLang
`--quantization nvfp4_online`, Blackwell only: serve the BF16 run checkpoint for those).
Routed-expert layers kept BF16 (the last-layer rule) need a server that honours the exclude list
for its fused MoE modules (vLLM does); check yours. On Hopper, vLLM runs NVFP4 weights through
its FP4 Marlin kernel with BF16 activations (W4A16); SGLang's `modelopt_fp4` needs Blackwell
(SM100). These commands follow the vLLM/SGLang loaders' source; the exporter did not run them.

## Load back into fp4rl (evaluate, or continue RL from the served weights)

```python
import fp4rl
model, tokenizer = fp4rl.load_model("./{name}")  # checks {MANIFEST}: sha256 of every file
```

## Precision contract

```
{summary}
```
"""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_out(out: Path, overwrite: bool) -> None:
    """FileExistsError unless OUT can take an export: absent, an empty folder, or (overwrite) an earlier
    export. Called before the model loads (fp4rl.export.export) and again when writing."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export: {out} is a file, not a folder: pick another OUT")
    if out.exists() and any(out.iterdir()):
        if not (out / MANIFEST).is_file():  # --force must not delete a folder that is not an export
            held = sorted(p.name for p in out.iterdir())
            raise FileExistsError(f"export: {out} is not empty and is not an fp4rl export (no {MANIFEST}; it "
                                  f"holds {held[:3]}{'...' if len(held) > 3 else ''}); overwrite=True "
                                  "(--force) replaces only an earlier export or an empty folder: pick "
                                  "another OUT, or remove it yourself if it is yours to delete")
        if not overwrite:
            raise FileExistsError(f"export: {out} holds an earlier export; pass overwrite=True (--force) to "
                                  "replace it")


def write_dir(out: Path, write, overwrite: bool) -> Path:
    """write(tmp) into a temporary sibling, fsync it, then rename it to OUT: OUT is complete or absent."""
    check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp and safetensors make them private; a server may run as another user
        for f in tmp.iterdir():
            f.chmod(0o644)
        fsync_tree(tmp)  # the files are on disk before the rename publishes them (a power loss)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            fsync_dir(out.parent)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
            fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_json(file: Path, obj: dict) -> None:
    with open(file, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def verify_manifest(path: str | os.PathLike) -> dict:
    """Check every file listed in path/fp4rl_manifest.json (size, then sha256) and that no
    safetensors or JSON file was added; -> the manifest. Raises ValueError naming the file."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path / MANIFEST} is not a valid fp4rl manifest ({e}); the export is damaged: "
                         "export again") from e
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file} is listed in {MANIFEST} but missing: the export is incomplete")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"{file} is {size} bytes, {MANIFEST} says {entry['bytes']}: it was truncated or "
                             "altered after export; export again")
        if sha256(file) != entry["sha256"]:
            raise ValueError(f"{file} does not match its sha256 in {MANIFEST}: it was altered after export; "
                             "export again")
    extra = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST
                   and p.name.endswith(_CHECKED_SUFFIXES) and p.name not in files)
    if extra:
        raise ValueError(f"{path / extra[0]} is not in {MANIFEST}: it was added after export "
                         f"({len(extra)} such file(s)); remove it or export again")
    return manifest
