"""NVFP4 export on disk and through the CLI: a file changed after export is refused by name, the export is
fsynced before its rename into place, what a server would run differently is refused, --force replaces only
an earlier export, the tokenizer is required unless --no-tokenizer, a run checkpoint exports with its
contract, sharded exports and checkpoints without a manifest, import warnings and its per-linear
dequantization, and `fp4rl generate` on an export. The formats and the export -> import round trip:
tests/test_export.py (whose helpers are shared)."""

import argparse
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import IDS, dense_modelopt, export_as, one_thread, tiny

import fp4rl
from fp4rl.export import add_arguments, export, export_model, run
from fp4rl.export_files import MANIFEST
from fp4rl.export_formats import encode_global_scale, reciprocal
from fp4rl.precision import PrecisionContract
from fp4rl.qat import packed_state

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer files")  # tiny models have none
_fixtures = (dense_modelopt, one_thread)  # the shared fixtures (module-scoped: built again for this module)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_file_changed_after_export_is_refused_naming_it(tmp_path, dense_modelopt):
    out = dense_modelopt[1]
    fp4rl.load_model(_copy(out, tmp_path / "ok"))

    d = _copy(out, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match=r"model\.safetensors is \d+ bytes.*truncated"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "flipped")
    st = load_file(d / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    st[key] = st[key].clone()
    st[key][0, 0] ^= 0x11
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors .*(sha256|bytes)"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "config")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["ignore"] = config["quantization_config"]["ignore"][1:]
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with pytest.raises(ValueError, match=r"config\.json .*(sha256|bytes)"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "added")
    shutil.copyfile(d / "model.safetensors", d / "model-extra.safetensors")
    with pytest.raises(ValueError, match=r"model-extra\.safetensors is not in fp4rl_manifest\.json"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "missing")
    (d / "hf_quant_config.json").unlink()
    with pytest.raises(ValueError, match=r"hf_quant_config\.json is listed .* but missing"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "two_scales")  # another producer's (no manifest) with two global scales
    (d / MANIFEST).unlink()
    st = load_file(d / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight_scale_2"
    st[key] = st[key].reshape(1).repeat(2)
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_scale_2 holds 2 values \[2\].*one global scale per"):
        fp4rl.load_model(d)


def test_export_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """OUT is complete or absent, also after a power loss: every file and the temporary folder are
    fsynced before the rename publishes them, and the parent folder after it."""
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    out = export_model(tiny(layers=2), PrecisionContract("nvfp4-w4a16"), tmp_path / "out")
    i, tmp = next((i, e[1]) for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out.resolve()))
    synced = {e[1] for e in events[:i] if e[0] == "fsync"}
    assert {os.path.join(tmp, p.name) for p in out.iterdir()} | {tmp} <= synced
    assert ("fsync", os.path.realpath(tmp_path)) in events[i + 1:]


def test_refuses_what_a_server_would_run_differently(tmp_path):
    def attempt(model, contract, **kw):
        export_model(model, contract, tmp_path / "x", calib_ids="random", **kw)

    with pytest.raises(ValueError, match="q_proj.*k_proj.*v_proj.*one fused GEMM"):
        attempt(tiny(), PrecisionContract("nvfp4-linear", rules=(("*.q_proj", "bf16"),)))
    model = tiny()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)  # its own amax, so its own scale
    with pytest.raises(ValueError, match="different weight global scales.*fuse_global_scales=True"):
        attempt(model, PrecisionContract("nvfp4-linear", fuse_global_scales=False))
    with pytest.raises(ValueError, match="routed experts of model.layers.0.mlp mix"):
        one_expert_bf16 = (("*.0.mlp.experts.1.*", "bf16"),)
        attempt(tiny("qwen3_moe"), PrecisionContract("nvfp4-experts", rules=one_expert_bf16))
    with pytest.raises(ValueError, match="quantizes no linear"):
        attempt(tiny(), PrecisionContract("bf16"))
    mixed = PrecisionContract("nvfp4-linear", rules=(("model.layers.0.*", "w4a16"),))
    with pytest.raises(ValueError, match="mixes.*activations="):
        attempt(tiny(), mixed)
    assert not (tmp_path / "x").exists()  # nothing half-written
    with pytest.warns(UserWarning, match=r"trained \['w4a16', 'w4a4'\] are exported w4a16"):
        attempt(tiny(), mixed, activations="w4a16")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        attempt(tiny(), PrecisionContract("nvfp4-linear"))
    attempt(tiny(), PrecisionContract("nvfp4-linear"), overwrite=True)
    assert json.loads((tmp_path / "x" / MANIFEST).read_text())["activations"] == "w4a4"


def test_force_replaces_only_an_earlier_export_or_an_empty_folder(tmp_path):
    def attempt(out, overwrite=True):
        return export_model(tiny(layers=2), PrecisionContract("nvfp4-w4a16"), out, overwrite=overwrite)

    mine = tmp_path / "mine"  # not an export: --force must not delete it
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for overwrite in (True, False):
        with pytest.raises(FileExistsError, match=r"not an fp4rl export \(no fp4rl_manifest.json.*notes.txt.*"
                                                  "pick another OUT"):
            attempt(mine, overwrite)
    assert (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        attempt(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    attempt(tmp_path / "empty", overwrite=False)  # an empty folder, then the export it holds
    with pytest.raises(FileExistsError, match="earlier export; pass overwrite=True"):
        attempt(tmp_path / "empty", overwrite=False)
    attempt(tmp_path / "empty")
    assert (tmp_path / "empty" / MANIFEST).is_file()


def test_cli_exports_a_run_checkpoint_with_its_contract_and_tokenizer(tmp_path, monkeypatch):
    from rl_fixtures import tiny_model, tiny_tokenizer

    from fp4rl.config import dump_toml, load_config
    from fp4rl.hf import save_model

    base = tmp_path / "base"  # the run's model.name: tokenizer and generation config live there
    save_model(tiny_model(moe=True), tiny_tokenizer(), base)
    (base / "generation_config.json").write_text('{"eos_token_id": 2}\n')
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_000003"
    save_model(tiny_model(moe=True, seed=1), None, ckpt)
    cfg = load_config(None, [f"model.name={json.dumps(str(base))}", "precision.preset=nvfp4-experts",
                             "precision.weight_four_over_six=false"])
    (ckpt / "config.toml").write_text(dump_toml(cfg))
    torch.save({}, ckpt / "trainer.pt")

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "served"
    assert run(parser.parse_args([str(tmp_path / "runs" / "r"), str(out), "--format", "compressed-tensors",
                                  "--calib-prompts", "2"])) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["precision"]["preset"] == "nvfp4-experts"
    assert manifest["precision"]["weight_four_over_six"] is False
    assert manifest["calibration"]["source"] == "built-in prompts"
    assert {"tokenizer.json", "generation_config.json", "README.md"} <= {p.name for p in out.iterdir()}
    model, tokenizer = fp4rl.load_model(out)
    assert tokenizer is not None and model.precision_contract.preset == "nvfp4-experts"
    assert model.precision_contract.weight_four_over_six is False

    with pytest.raises(ValueError, match="--precision"):
        export(base, tmp_path / "nope")
    export(base, tmp_path / "from_model", precision="nvfp4-experts", calib_prompts=1)
    assert (tmp_path / "from_model" / "tokenizer.json").is_file()
    for out in (tmp_path / "runs" / "r", tmp_path / "runs", ckpt):  # --force would delete the source
        with pytest.raises(ValueError, match="is the source .* or a folder holding it"):
            export(tmp_path / "runs" / "r", out, overwrite=True)
    assert (ckpt / "trainer.pt").is_file()
    for out, tok in ((base, None), (tmp_path / "served", tmp_path / "served")):  # nor the tokenizer's
        with pytest.raises(ValueError, match="is the tokenizer source .* or a folder holding it"):
            export(tmp_path / "runs" / "r", out, tokenizer=tok, overwrite=True)
    assert (base / "config.json").is_file() and (tmp_path / "served" / "tokenizer.json").is_file()

    # a run of a Hub id (in the local Hugging Face cache): the tokenizer comes from its cached folder
    from fp4rl import hf

    real = hf._resolve
    monkeypatch.setattr(hf, "_resolve", lambda name: base if name == "org/tiny" else real(name))
    cfg = load_config(None, ["model.name=\"org/tiny\"", "precision.preset=nvfp4-experts"])
    (ckpt / "config.toml").write_text(dump_toml(cfg))
    export(tmp_path / "runs" / "r", tmp_path / "from_hub_id", calib_prompts=1)
    assert (tmp_path / "from_hub_id" / "tokenizer.json").is_file()


def test_an_export_without_a_tokenizer_is_refused_unless_asked_for(tmp_path):
    """A run whose model.name is not on this machine exported without a tokenizer (vLLM then cannot serve
    OUT) and calibrated W4A4 on random token ids, silently; now either is an explicit choice."""
    from rl_fixtures import tiny_model

    from fp4rl.config import dump_toml, load_config
    from fp4rl.hf import save_model

    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_000003"
    save_model(tiny_model(moe=True, seed=1), None, ckpt)
    cfg = load_config(None, ['model.name="someorg/not-cached-model"', "precision.preset=nvfp4-experts"])
    (ckpt / "config.toml").write_text(dump_toml(cfg))
    torch.save({}, ckpt / "trainer.pt")
    run_dir, out = tmp_path / "runs" / "r", tmp_path / "out"
    with pytest.raises(ValueError, match=r"no tokenizer for .*model.name 'someorg/not-cached-model' .*not on "
                                         r"this machine.*--tokenizer DIR.*--no-tokenizer"):
        export(run_dir, out, calib_prompts=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty has no tokenizer files .*--tokenizer DIR"):
        export(run_dir, out, tokenizer=tmp_path / "empty")
    save_model(tiny_model(), None, tmp_path / "model")  # a model folder without a tokenizer
    with pytest.raises(ValueError, match="no tokenizer for .*model: .*model has no tokenizer files"):
        export(tmp_path / "model", out, precision="nvfp4-linear")
    with pytest.raises(ValueError, match="not both"):
        export(run_dir, out, tokenizer=tmp_path / "empty", no_tokenizer=True)
    with pytest.raises(ValueError, match="W4A4 input scales .*need a tokenizer.*calib_ids='random'"):
        export_model(tiny(), PrecisionContract("nvfp4-linear"), out)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # refused before anything was written

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([str(run_dir), str(out), "--tokenizer", "x", "--no-tokenizer"])
    assert run(parser.parse_args([str(run_dir), str(out), "--no-tokenizer", "--calib-prompts", "2"])) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["calibration"]["source"].startswith("random token ids") and "--no-tokenizer" in \
        manifest["calibration"]["source"]
    assert not any(p.name.startswith("tokenizer") for p in out.iterdir())


@pytest.mark.filterwarnings("ignore:.*has no fp4rl_manifest.json")
def test_importing_fused_groups_with_different_global_scales_warns(tmp_path):
    """Another producer's checkpoint whose q/k/v or gate/up hold different global scales: vLLM serves the
    group with one scale, fp4rl's import computes each linear with its own; the import says so."""
    out = export_as(tiny("qwen3_moe"), "nvfp4-w4a16", tmp_path / "out", "modelopt", None)
    (out / MANIFEST).unlink()  # another producer's: no integrity check
    with pytest.warns(UserWarning) as record:
        fp4rl.load_model(out)
    assert not [w for w in record if "global scales" in str(w.message)]  # fp4rl's own: fused scales
    st = load_file(out / "model.safetensors")
    k, up = "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.experts.1.up_proj"
    for name in (k, up):
        st[f"{name}.weight_scale_2"] = st[f"{name}.weight_scale_2"] * 2
    save_file(st, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"2 fused group\(s\) hold different weight global scales, e.g. "
                      r"model.layers.0.self_attn.q_proj, .*k_proj, .*v_proj: .*vLLM runs each group as one "
                      r"GEMM with one global scale.*computes each linear with its own scale"):
        loaded, _ = fp4rl.load_model(out)
    got = packed_state(loaded)[f"{k}.weight"].global_scale
    assert torch.equal(got, st[f"{k}.weight_scale_2"].reshape(()))  # k_proj keeps its own scale


def test_import_dequantizes_each_linear_straight_into_the_model_dtype(tmp_path, monkeypatch):
    """No float32 copy of every quantized linear (4 bytes a parameter) before the model is built: each
    DQ(packed) is computed in the model's dtype, and holds the values float32-then-cast gave."""
    from fp4rl import export_import

    out = export_as(tiny("qwen3_moe"), "nvfp4-w4a16", tmp_path / "out", "compressed-tensors", None)
    asked, real = [], export_import.dequantize

    def recording(q, dtype=torch.float32):
        asked.append(dtype)
        return real(q, dtype)

    monkeypatch.setattr(export_import, "dequantize", recording)
    loaded, _ = fp4rl.load_model(out, dtype=torch.bfloat16)
    assert asked and set(asked) == {torch.bfloat16}
    for k, q in packed_state(loaded).items():
        master = loaded.get_submodule(k.removesuffix(".weight")).weight
        assert master.dtype == torch.bfloat16 and torch.equal(master, real(q, torch.float32).bfloat16()), k


def test_sharded_export_and_a_checkpoint_without_manifest(tmp_path):
    model = tiny("qwen3_moe")
    out = export_model(model, PrecisionContract("nvfp4-linear"), tmp_path / "out",
                       format="compressed-tensors", max_shard_bytes=30_000, calib_prompts=1,
                       calib_ids="random")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert set(shards) <= set(json.loads((out / MANIFEST).read_text())["files"])
    with torch.no_grad():
        expected = model(IDS)
    (out / MANIFEST).unlink()  # as a checkpoint from another producer: no integrity check, no contract
    with pytest.warns(UserWarning, match="no fp4rl_manifest.json"):
        loaded, _ = fp4rl.load_model(out)
    with torch.no_grad():
        got = loaded(IDS)
    exact = all(torch.equal(reciprocal(encode_global_scale(q.global_scale)), q.global_scale)
                for q in packed_state(model).values())
    assert torch.equal(got, expected) if exact else torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    recovered = loaded.precision_contract  # from the files alone: 3 of 4 layers NVFP4
    assert (recovered.preset, recovered.bf16_last_fraction, recovered.rules) == ("nvfp4-linear", 0.25, ())


def test_generate_samples_an_export_with_its_own_precision(tmp_path, monkeypatch, capsys):
    """`fp4rl generate --model OUT` keeps an export's NVFP4 linears (the default --precision bf16 converted
    them back to plain linears: a W4A4 export was sampled without its activation quantizer)."""
    from rl_fixtures import record_sampler_modes, tiny_model, tiny_tokenizer

    from fp4rl.cli import main

    out = export_model(tiny_model(), PrecisionContract("nvfp4-linear"), tmp_path / "out",
                       tokenizer=tiny_tokenizer(), calib_prompts=1)
    seen = record_sampler_modes(monkeypatch)
    argv = ["generate", "--model", str(out), "--prompt", "1 + 1", "--greedy", "--max-new-tokens", "3",
            "--raw"]
    assert main(argv) == 0 and seen == [["w4a4"]]
    with pytest.raises(SystemExit, match="NVFP4 export .*leave it out"):
        main(argv + ["--precision", "nvfp4-w4a16"])
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "no such model directory" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:.*has no fp4rl_manifest.json")
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_import_refuses_scales_no_quantizer_writes(tmp_path, fmt):
    """Another producer's checkpoint (no manifest) with a global scale of 0 / NaN / Inf / < 0 or an E4M3 block
    scale that is NaN or negative: refused naming the linear (they loaded as NaN, zero or sign-flipped
    weights). A block scale of -0 (0x80) is 0 and accepted."""
    out = export_as(tiny("llama"), "nvfp4-w4a16", tmp_path / "out", fmt, None)
    (out / MANIFEST).unlink()
    clean = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    g_key = f"{name}.weight_scale_2" if fmt == "modelopt" else f"{name}.weight_global_scale"
    s_key = f"{name}.weight_scale"

    def load_with(key, edit):
        st = {k: v.clone() for k, v in clean.items()}
        edit(st[key])
        save_file(st, out / "model.safetensors", metadata={"format": "pt"})
        return lambda: fp4rl.load_model(out)

    for bad in (0.0, float("nan"), float("inf"), -0.01):
        if fmt == "compressed-tensors" and bad == float("inf"):
            bad = 0.0  # G = inf -> g = 0: refused as g; covered by 0 above (G = 0 -> g = inf)
        with pytest.raises(ValueError, match=f"{name} has the weight global scale .*finite and > 0"):
            load_with(g_key, lambda t, v=bad: t.fill_(v))()
    for byte in (0x7F, 0xFF, 0x90):
        with pytest.raises(ValueError, match=rf"{name} has 1 E4M3 block scales that are NaN or negative "
                                             rf"\(the first at \[row, block\] \[2, 1\]: byte 0x{byte:02X}\)"):
            load_with(s_key, lambda t, b=byte: t.view(torch.uint8)[2, 1].fill_(b))()
    loaded, _ = load_with(s_key, lambda t: t.view(torch.uint8)[2, 1].fill_(0x80))()  # -0: a zero scale
    assert float(packed_state(loaded)[f"{name}.weight"].block_scale[2, 1].float()) == 0.0


def test_export_refuses_nonfinite_tensors_naming_them(tmp_path):
    """NaN/Inf in a BF16 tensor (embedding, norm, a BF16 linear) was written and served as it was; in a
    quantized linear it stopped the quantizer with a message naming no tensor. Both refused by name, nothing
    written."""
    for key in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.3.self_attn.o_proj.weight",
                "model.layers.0.mlp.down_proj.weight"):
        model = tiny()
        with torch.no_grad():
            model.get_parameter(key).view(-1)[3] = float("nan")
        with pytest.raises(ValueError, match=rf"export: {key} holds 1 NaN/Inf of \d+ values.*step_N"):
            export_model(model, PrecisionContract("nvfp4-linear"), tmp_path / "x", calib_ids="random")
        assert not (tmp_path / "x").exists()


def test_the_manifest_records_the_settings_that_made_the_bytes(tmp_path):
    """A model already converted keeps its NVFP4 bytes; a contract with other quantizer settings is refused
    (the manifest recorded the contract's, and import labelled the bytes with them: weight sync compares the
    labels). Re-exporting an export (CLI) keeps the settings of its manifest."""
    from fp4rl.qat import convert

    model = tiny()
    convert(model, PrecisionContract("nvfp4-w4a16", weight_four_over_six=False))
    with pytest.raises(ValueError, match=r"was converted \(trained\) with weight quantizer "
                                         r".*'scale_rule': '6'.*the contract says .*'scale_rule': '4/6'"):
        export_model(model, PrecisionContract("nvfp4-w4a16"), tmp_path / "x")
    assert not (tmp_path / "x").exists()
    a = export_model(model, PrecisionContract("nvfp4-w4a16", weight_four_over_six=False), tmp_path / "a")
    b = export(a, tmp_path / "b", precision="nvfp4-w4a16", no_tokenizer=True)
    for out in (a, b):
        assert json.loads((out / MANIFEST).read_text())["precision"]["weight_four_over_six"] is False
        loaded, _ = fp4rl.load_model(out)
        assert {q.scale_rule for q in packed_state(loaded).values()} == {"6"}
    assert load_file(a / "model.safetensors").keys() == load_file(b / "model.safetensors").keys()
    sa, sb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_checks_out_and_calib_prompts_before_loading(tmp_path, monkeypatch, dense_modelopt):
    """An OUT that holds an earlier export (without --force), a file, or a folder that is not an export, and a
    --calib-prompts out of range are refused before the model loads (they were refused after minutes of
    loading, converting and packing)."""
    from fp4rl import hf

    _, out, _, _ = dense_modelopt
    monkeypatch.setattr(hf, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    earlier = _copy(out, tmp_path / "earlier")
    for target, match in ((earlier, "holds an earlier export; pass overwrite=True"),
                          (tmp_path / "file", "is a file"), (tmp_path / "other", "is not an fp4rl export")):
        with pytest.raises(FileExistsError, match=match):
            export(out, target, precision="nvfp4-linear", no_tokenizer=True)
    for n in (0, 999):
        with pytest.raises(ValueError, match=f"calib_prompts={n}; use 1.."):
            export(out, tmp_path / "new", precision="nvfp4-linear", no_tokenizer=True, calib_prompts=n)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
