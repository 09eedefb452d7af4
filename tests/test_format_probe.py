"""--dtype auto measured on a few layers of the real weights: the whole-model estimate, and the choice it makes
against the choice three whole loads make."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tiny import llama

from specdemo.backends import formats
from specdemo.backends.loading import LoadedModel, LoadSettings
from specdemo.session import calibration, format_probe
from specdemo.session.format_probe import PassSplit, decoder_layers, quick_curves

LAYERS = 8
#: what each format's layers and head cost here (seconds slept per pass, whatever its length): the head is dear in
#: w8a8 and the layers in bfloat16, so that on 2 layers bfloat16 looks fastest and on all 8 w8a8 is
COSTS = {"w8a8": (0.002, 0.012), "int8": (0.005, 0.005), "bfloat16": (0.005, 0.001)}


def _slowed(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """``model`` with each decoder layer and its head sleeping as :data:`COSTS` says for ``fmt``."""
    per_layer, head = COSTS[fmt]
    for layer in decoder_layers(model):
        layer.register_forward_hook(lambda *args: time.sleep(per_layer))
    model.get_output_embeddings().register_forward_hook(lambda *args: time.sleep(head))
    return model


IN_FORMAT = format_probe.in_format  # the tests below wrap it


def _whole(fmt: str) -> torch.nn.Module:
    return _slowed(IN_FORMAT(llama(5, layers=LAYERS).to(torch.bfloat16).eval(), fmt), fmt)


def test_a_pass_is_its_rest_plus_its_layers_scaled_to_the_whole_model() -> None:
    assert PassSplit(0.010, 0.006).scaled(2, 8) == pytest.approx(0.010 + 3 * 0.006)
    assert PassSplit(0.010, 0.006).scaled(8, 8) == pytest.approx(0.010)


def test_the_quick_choice_agrees_with_the_whole_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_probe, "in_format", lambda model, fmt, *args: _slowed(IN_FORMAT(model, fmt, *args), fmt))
    monkeypatch.setattr(format_probe, "load_first_layers", lambda source, settings, layers: (
        _cut(llama(5, layers=LAYERS).to(torch.bfloat16).eval(), layers), LAYERS))
    monkeypatch.setattr(format_probe, "PROBE_REPEATS", 3)
    auto = LoadSettings(dtype="auto", device="cpu")
    quick = calibration.choose_format("tiny:target", auto, folder=tmp_path / "quick",
                                      measure_candidates=lambda s, st: quick_curves(s, st, layers=2))

    def whole_load(source, settings, progress=True, on_progress=None):
        return LoadedModel(source, _whole(settings.dtype), None, torch.device("cpu"), torch.bfloat16, settings)

    monkeypatch.setattr(calibration, "forget_model", lambda source, settings: None)
    whole = calibration.choose_format("tiny:target", auto, folder=tmp_path / "whole", load=whole_load)
    assert quick.format == whole.format == "w8a8", (quick.summary(), whole.summary())
    assert "measured here on 2 of 8 layers of the real weights" in quick.reason
    for fmt, curve in quick.curves.items():  # the estimate is within a quarter of the whole model's curve
        assert curve.measured_layers == "2 of 8"
        assert curve.seconds[0] == pytest.approx(whole.curves[fmt].seconds[0], rel=0.25), fmt
    # the whole model's weight bytes, from 2 of its 8 layers
    assert quick.curves["w8a8"].weight_bytes == formats.weight_bytes_per_pass(_whole("w8a8"))
    # on 2 layers as they stand, bfloat16 would have looked fastest: the scaling is what makes the choice agree
    cut_bf16 = COSTS["bfloat16"][0] * 2 + COSTS["bfloat16"][1]
    cut_w8a8 = COSTS["w8a8"][0] * 2 + COSTS["w8a8"][1]
    assert cut_bf16 < cut_w8a8


def _cut(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model


def test_the_first_layers_of_a_gguf_are_those_of_the_whole_model(tmp_path: Path, monkeypatch) -> None:
    from test_real_gguf import write_tiny_qwen2_gguf

    from specdemo.backends import gguf_convert

    from transformers import AutoModelForCausalLM, GgufConfig

    for tied in (True, False):
        path = tmp_path / f"tiny-{tied}.gguf"
        write_tiny_qwen2_gguf(path, layers=5, tied=tied, quantized=True)
        cut, total = gguf_convert.load_first_layers(path, 2)
        assert total == 5 and len(cut.model.layers) == 2
        whole = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        whole_state = {name: t.to(torch.bfloat16) for name, t in whole.state_dict().items()}
        cut_state = cut.state_dict()
        if not tied:  # the embedding is looked up from its blocks, as the int8 storage keeps it
            del cut_state["model.embed_tokens.blocks"]
            cut_state["model.embed_tokens.weight"] = cut.get_input_embeddings().weight
        for name, tensor in cut_state.items():
            assert torch.equal(tensor, whole_state[name]), name
        if tied:  # as the file says
            assert cut.get_output_embeddings().weight is cut.get_input_embeddings().weight


def test_the_first_layers_of_a_folder_are_read_with_its_own_weights(tmp_path: Path) -> None:
    from specdemo.backends.loading import load_first_layers

    model = llama(7, layers=3)
    model.save_pretrained(str(tmp_path / "tiny"))
    cut, total = load_first_layers(str(tmp_path / "tiny"), LoadSettings(dtype="auto", device="cpu"), 2)
    assert total == 3 and len(decoder_layers(cut)) == 2 and cut.dtype == torch.bfloat16
    whole = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}
    for name, tensor in cut.state_dict().items():
        assert torch.equal(tensor, whole[name]), name
