"""Presets are data: every one must build valid configs on every device type, and a wrong name is a
user error that lists the right ones."""

import pytest

from towerlab.config import RunConfig, TrainConfig
from towerlab.errors import UserError
from towerlab.presets import PRESETS, apply_preset, names, run_options


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_preset_builds_valid_configs(name, device_type):
    cfg = TrainConfig(**apply_preset(name, device_type))
    RunConfig(**run_options(name, device_type))
    assert cfg.model == PRESETS[name].train["model"]
    assert PRESETS[name].measured, "a preset says what it reached and how it was chosen"


def test_apply_preset_returns_a_fresh_dict():
    first = apply_preset(names()[0])
    first["lr"] = -1.0
    assert apply_preset(names()[0]).get("lr") != -1.0


def test_unknown_preset_is_a_user_error_naming_the_known_ones():
    with pytest.raises(UserError, match="mnist-fast"):
        apply_preset("mnist-fastest")


def test_preset_flag_applies_the_recipe_under_typed_flags():
    from towerlab.cli import build_parser
    from towerlab.commands import resolve_train

    cfg, run = resolve_train(build_parser().parse_args(["train", "--preset", "mnist-fast", "--seed", "3"]))
    assert (cfg.model, cfg.batch_size, cfg.schedule, cfg.steps, cfg.seed) == ("lenet5", 256, "onecycle", 537, 3)
    assert run.preset == "mnist-fast" and run.threads is None  # no preset forces a thread count
    cfg, _ = resolve_train(build_parser().parse_args(["train", "--preset", "mnist-fast", "--batch-size", "64"]))
    assert cfg.batch_size == 64 and cfg.lr == 0.012


def test_unknown_preset_and_preset_with_resume_are_user_errors(tmp_path, capsys):
    from towerlab.cli import main

    assert main(["train", "--preset", "imagenet-fast", "--out", str(tmp_path / "a")]) == 2
    assert "unknown preset 'imagenet-fast'" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path), "--preset", "mnist-fast"]) == 2
    assert "--preset does not go with --resume" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_trains_the_same_global_batch_on_cpus_and_gpus(name):
    # What a preset measured on one device type is the same computation on the other.
    batches = [apply_preset(name, kind)["batch_size"] * run_options(name, kind)["devices"] for kind in ("cpu", "cuda")]
    assert batches[0] == batches[1]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_no_preset_sets_a_thread_count(name):
    assert all("threads" not in run_options(name, kind) for kind in ("cpu", "cuda"))


@pytest.mark.parametrize("flags, native", [("fpu sse2 avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
                                           ("fpu sse2 avx2 avx512f", False)])
def test_a_presets_bf16_holds_on_cpus_with_bf16_arithmetic_only(flags, native, tmp_path, monkeypatch):
    from towerlab import presets

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert presets.cpu_bf16(str(cpuinfo)) is native
    assert presets.cpu_bf16(str(tmp_path / "missing")) is False
    monkeypatch.setattr(presets, "cpu_bf16", lambda: native)
    assert apply_preset("mnist-fast", "cpu")["precision"] == ("bf16" if native else "fp32")
    assert apply_preset("mnist-fast", "cuda")["precision"] == "bf16"
