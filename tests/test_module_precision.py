"""Per-module precision (precision.modules): which linear runs which conf/precision option, in the torch engine's
conversion, the plan's checks, engine=megatron's per-module recipe (megatron-core's own quant_recipe classes) and a
resume. tests/test_train.py trains a run with a mixed assignment end to end on a CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from recipes.config import (
    ConfigError, ModulePrecision, check_modules, dump_config, linear_names, load_config, load_option,
    module_assignment, to_dict,
)
from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.linear import BlockwiseScaling, Bf16Linear, Fp8Linear, TensorwiseScaling
from recipes.fp8.mlp import Fp8Mlp
from recipes.models.transformer import Transformer
from recipes.plan.checks import validate


def with_modules(name: str, *entries: tuple[str, str], **changes):
    return dataclasses.replace(load_option("precision", name), modules=[ModulePrecision(*e) for e in entries],
                               **changes)


def test_first_match_wins_then_the_bf16_layers_then_the_run_precision():
    precision = with_modules("fp8_current", ("layers.0.mlp.*", "fp8_blockwise"), ("layers.[03].*", "bf16"),
                             ("layers.*.mlp.fc2", "bf16"), num_layers_at_end_in_bf16=1, num_layers_at_start_in_bf16=1)
    got = module_assignment(precision, 4)
    assert list(got) == linear_names(4)
    assert got["layers.0.mlp.fc1"] == got["layers.0.mlp.fc2"] == "fp8_blockwise"  # before the shorthand
    assert got["layers.0.attention.qkv"] == got["layers.3.mlp.fc1"] == "bf16"
    assert got["layers.1.mlp.fc2"] == "bf16" and got["layers.1.mlp.fc1"] == got["layers.2.attention.out"] \
        == "fp8_current"
    assert got["output_layer"] == "bf16"
    plain = module_assignment(load_option("precision", "fp8_current"), 4)
    assert set(plain.values()) == {"fp8_current", "bf16"} and [k for k, v in plain.items() if v == "bf16"] == \
        ["output_layer"]


@pytest.mark.parametrize("entry,message", [
    (("layers.0.mlp.fc1; rm -rf x", "bf16"), r"a pattern is a glob over linear names"),
    (("layers.${oc.env:HOME}", "bf16"), r"a pattern is a glob over linear names"),
    (("layers.9.*", "bf16"), r"matches none of the model's linear layers"),
    (("layers.*.mlp.fc3", "bf16"), r"matches none"),
    (("layers.0.*", "fp8_turbo"), r"no option 'fp8_turbo' in conf/precision"),
    (("output_layer", "fp8_current"), r"assigns fp8_current to output_layer, which runs in BF16"),
])
def test_entries_that_cannot_be_meant_are_refused_in_one_line(entry, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_modules(with_modules("fp8_current", entry), 4)
    assert "\n" not in str(error.value)


def test_a_recipe_that_would_train_no_linear_is_refused():
    """nvfp4's preset keeps the last 4 layers in BF16: on a 4-layer model nothing would run in NVFP4."""
    with pytest.raises(ConfigError, match=r"precision=nvfp4 leaves every linear in BF16 .* model.num_layers=4"):
        check_modules(load_option("precision", "nvfp4"), 4)
    check_modules(load_option("precision", "nvfp4"), 5)
    with pytest.raises(ConfigError, match="leaves every linear in BF16"):
        check_modules(with_modules("fp8_current", ("layers.*", "bf16")), 4)
    check_modules(with_modules("bf16", ("layers.*", "bf16")), 4)


def test_the_torch_engine_converts_each_linear_as_assigned():
    cfg = dataclasses.replace(load_option("model", "tiny_llama"), num_layers=3)
    model = Transformer(cfg)
    precision = with_modules("fp8_current", ("layers.0.*", "bf16"), ("layers.2.mlp.fc2", "fp8_blockwise"),
                             ("layers.2.mlp.fc1", "fp8_blockwise"), ("layers.1.mlp.fc2", "fp8_delayed"))
    assert convert_to_fp8(model.layers, precision, bf16_linears=True) == 8
    recipes = {name: type(m.recipe) if isinstance(m, Fp8Linear) else type(m)
               for name, m in model.named_modules() if isinstance(m, (Fp8Linear, Bf16Linear))}
    assert {n: r for n, r in recipes.items() if n.startswith("layers.0.")} == {
        f"layers.0.{kind}": Bf16Linear for kind in ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")}
    assert recipes["layers.1.attention.qkv"] is TensorwiseScaling and recipes["layers.1.mlp.fc1"] is TensorwiseScaling
    assert recipes["layers.1.mlp.fc2"].__name__ == "DelayedScaling"
    assert recipes["layers.2.mlp.fc1"] is recipes["layers.2.mlp.fc2"] is BlockwiseScaling
    # an MLP is fused only where fc1 and fc2 share one recipe: layer 2's (blockwise), not layer 1's (mixed)
    assert isinstance(model.layers[2].mlp, Fp8Mlp) and not isinstance(model.layers[1].mlp, Fp8Mlp)


def test_modules_reach_the_config_file_and_back(hydra_compose, tmp_path):
    cfg = hydra_compose("precision=fp8_current", "dryrun=true",
                        'precision.modules=[{pattern: "layers.0.*", precision: bf16}]')
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "config.yaml").precision.modules == [ModulePrecision("layers.0.*", "bf16")]
    data = yaml.safe_load(dump_config(cfg))
    data["precision"]["modules"] = ["layers.0.*"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"'precision.modules\[0\]' must be a mapping"):
        load_config(tmp_path / "bad.yaml")


def test_a_resume_with_another_assignment_is_refused(hydra_compose):
    from recipes.trainer.checkpoints import CheckpointError, check_compatible

    saved = hydra_compose("precision=fp8_current", "dryrun=true")
    mixed = hydra_compose("precision=fp8_current", "dryrun=true",
                          'precision.modules=[{pattern: "layers.0.*", precision: bf16}]')
    check_compatible(to_dict(saved), saved, Path("checkpoint.pt"))
    with pytest.raises(CheckpointError, match=r"precision.modules=\[\] in the checkpoint, \[\{'pattern': 'layers"):
        check_compatible(to_dict(saved), mixed, Path("checkpoint.pt"))


PLAN = ("model=llama3_8b", "model.num_layers=8", "gpu=h200", "dryrun=true")


def test_the_plan_checks_every_assigned_precision(hydra_compose):
    validate(hydra_compose(*PLAN, "precision=fp8_current",
                           'precision.modules=[{pattern: "layers.0.*", precision: fp8_blockwise}]'))
    refused = {
        # nvfp4 has no native kernel on Hopper, wherever it is assigned
        'precision.modules=[{pattern: "layers.0.*", precision: nvfp4}]': "nvfp4 runs natively only on Blackwell",
        # mxfp8 has no native kernel on Hopper
        'precision.modules=[{pattern: "layers.*.mlp.fc1", precision: mxfp8}]': "runs natively only on Blackwell",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            validate(hydra_compose(*PLAN, "precision=fp8_current", override))


MEGATRON = ("engine=megatron", *PLAN)


def test_engine_megatron_gets_megatron_cores_per_module_recipe(hydra_compose):
    translate = pytest.importorskip("recipes.megatron.translate")
    from megatron.core.quantization.utils import get_quant_config_or_none

    cfg = hydra_compose(*MEGATRON, "precision=fp8_current", "precision.fp8_param_gather=false",
                        'precision.modules=[{pattern: "layers.*.mlp.fc2", precision: bf16},'
                        ' {pattern: "layers.0.*", precision: fp8_blockwise}]')
    validate(cfg)
    config = translate.te_precision_config(cfg)
    assert set(config["configs"]) == {"fp8_current", "bf16", "fp8_blockwise"}
    assert config["configs"]["fp8_blockwise"]["training_recipe"] == dict(
        override_quantized_autocast=True, override_nonquantized_autocast=True, fp8_quantization_recipe="blockwise",
        fp8_format="e4m3")
    assert config["configs"]["bf16"]["training_recipe"] == dict(override_quantized_autocast=True,
                                                                override_nonquantized_autocast=True)
    recipe = translate.quant_recipe(cfg)  # megatron-core's own classes, as from its --te-precision-config-file
    matched = {path: get_quant_config_or_none(path, recipe).config_key for path in (
        "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc2",
        "decoder.layers.5.mlp.linear_fc1", "decoder.layers.5.mlp.linear_fc2", "decoder.layers.5.self_attention.linear_proj")}
    assert matched == {"decoder.layers.0.self_attention.linear_qkv": "fp8_blockwise",
                       "decoder.layers.0.mlp.linear_fc2": "bf16", "decoder.layers.5.mlp.linear_fc1": "fp8_current",
                       "decoder.layers.5.mlp.linear_fc2": "bf16",
                       "decoder.layers.5.self_attention.linear_proj": "fp8_current"}
    assert len(config["matchers"]) == 8 * 4  # every decoder linear named exactly; the output layer has none
    assert translate.te_precision_config(hydra_compose(*MEGATRON, "precision=fp8_current")) is None


@pytest.mark.parametrize("overrides,message", [
    (("parallel.pp=2", "executor.gpus=2"), "layer numbers restart in every pipeline stage"),
    (("precision.fp8_param_gather=true",), "FP8 weights are made in the run's recipe"),
    (('precision.modules=[{pattern: "layers.0.*", precision: fp8_delayed}]',), "delayed scaling"),
    (('precision.modules=[{pattern: "layers.0.*", precision: fp8_blockwise_1d1d}]',),
     "changes Transformer Engine's recipe defaults"),
])
def test_engine_megatron_refuses_what_its_per_module_recipes_cannot_express(hydra_compose, overrides, message):
    modules = 'precision.modules=[{pattern: "layers.0.*", precision: bf16}]'
    base = (*MEGATRON, "precision=fp8_current", "precision.fp8_param_gather=false", modules)
    validate(hydra_compose(*base))
    with pytest.raises(ConfigError, match=message):
        validate(hydra_compose(*base, *overrides))


def test_engine_nemo_refuses_modules(hydra_compose):
    with pytest.raises(ConfigError, match="precision.modules on engine=nemo"):
        validate(hydra_compose("engine=nemo", *PLAN, "precision=fp8_current",
                               'precision.modules=[{pattern: "layers.0.*", precision: bf16}]'))


def test_delayed_layers_of_two_recipes_update_by_their_own_margins():
    """Per-module precision can give a model two delayed-scaling recipes: each layer's scale follows its own."""
    from recipes.fp8.linear import recipe_from_config
    from recipes.fp8.training import update_fp8_scaling

    layers = torch.nn.ModuleList()
    for margin in (0, 2):
        recipe = recipe_from_config(dataclasses.replace(load_option("precision", "fp8_delayed"), margin=margin))
        layers.append(Fp8Linear(torch.nn.Linear(32, 16, bias=False), recipe))
    x = torch.randn(16, 32)
    for layer in layers:
        layer(x).sum().backward()
    update_fp8_scaling(layers)
    scale_0, scale_2 = (layer.fp8_state.scale[0].item() for layer in layers)
    assert scale_0 == pytest.approx(4 * scale_2)  # margin 2: a quarter of the scale, same input amax
