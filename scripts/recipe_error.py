"""Each precision's numerical error against a float64 copy of the same model, on one batch of real text.

    python scripts/recipe_error.py [--model llama3_100m] [--layers 2] [--seq-length 256] [--batch 4] [--out DIR]

Per precision, the model is built from the same seed and runs one forward and backward (BF16 autocast, as the
engine trains) on the same batch of the bundled corpus; the reference is the same weights in float64, without FP8
and without autocast. Reported:
- loss, and its difference to the float64 loss;
- GEMM error: the relative error (Frobenius) of each FP8 linear's output against the float64 product of that
  linear's own input and weight, so the FP8 GEMM alone (mean and max over the linears; BF16 has none);
- gradient error: the relative error of each weight gradient of the decoder blocks against the float64 model's,
  so everything the precision changes, compounded through the layers and the backward (mean and max).
Recipes without a native kernel on this device are emulated (blockwise off Hopper, MXFP8 off Blackwell: the torch
engine's rule, `recipes.plan.checks.native_archs`), and the table says so. A recipe that silently ran in BF16 would show
BF16's gradient error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.config import ConfigError, PrecisionConfig, load_option
from recipes.data.dataset import make_dataset
from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.linear import Fp8Linear
from recipes.models.transformer import Transformer
from recipes.plan.checks import native_archs
from recipes.plan.gpu import detect_gpu
from recipes.provenance import provenance

PRECISIONS = "bf16,fp8_current,fp8_delayed,fp8_blockwise,mxfp8"


def needs_emulation(precision: PrecisionConfig, gpu_arch: str) -> bool:
    """No native GEMM for this recipe on this GPU architecture (the torch engine's rule, recipes.plan)."""
    archs = native_archs(precision.recipe)
    return archs is not None and gpu_arch not in archs


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


def forward_backward(model: Transformer, tokens: torch.Tensor, autocast: bool) -> float:
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.double().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item()


def block_weight_gradients(model: Transformer) -> dict[str, torch.Tensor]:
    return {name: p.grad.double() for name, p in model.layers.named_parameters() if p.dim() == 2}


def measure(precision: PrecisionConfig, model_cfg, tokens: torch.Tensor, reference: dict, seed: int) -> dict:
    model = Transformer(model_cfg).to(tokens.device)
    model.init_weights(torch.Generator(tokens.device).manual_seed(seed))
    convert_to_fp8(model.layers, precision)
    gemm_errors: list[float] = []

    def record_gemm_error(linear, inputs, output):
        gemm_errors.append(relative_error(output, inputs[0].double() @ linear.weight.double().t()))

    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.register_forward_hook(record_gemm_error)
    loss = forward_backward(model, tokens, autocast=True)
    gradients = block_weight_gradients(model)
    grad_errors = [relative_error(gradients[name], reference["gradients"][name]) for name in gradients]
    return {
        "precision": precision.name + (" (emulated)" if precision.emulate else ""),
        "loss": loss,
        "loss_minus_float64": loss - reference["loss"],
        "gemm_error_mean": statistics.mean(gemm_errors) if gemm_errors else None,
        "gemm_error_max": max(gemm_errors) if gemm_errors else None,
        "grad_error_mean": statistics.mean(grad_errors),
        "grad_error_max": max(grad_errors),
    }


def float64_reference(model_cfg, tokens: torch.Tensor, seed: int) -> dict:
    model = Transformer(model_cfg, activation_dtype=torch.float64).to(tokens.device)
    model.init_weights(torch.Generator(tokens.device).manual_seed(seed))
    model.double()
    loss = forward_backward(model, tokens, autocast=False)
    return {"loss": loss, "gradients": block_weight_gradients(model)}


def markdown_table(rows: list[dict], reference_loss: float) -> str:
    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [
        f"float64 loss {reference_loss:.5f}",
        "",
        "| precision | loss | minus float64 | GEMM error mean | GEMM error max | grad error mean | grad error max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['loss']:.5f} | {r['loss_minus_float64']:+.5f}"
            f" | {cell(r['gemm_error_mean'], '.4f')} | {cell(r['gemm_error_max'], '.4f')}"
            f" | {r['grad_error_mean']:.4f} | {r['grad_error_max']:.4f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_100m", help="conf/model option (default llama3_100m)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--seq-length", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--batch", type=int, default=4, help="sequences in the batch (default 4)")
    parser.add_argument("--precisions", default=PRECISIONS, help=f"conf/precision options (default {PRECISIONS})")
    parser.add_argument("--seed", type=int, default=1, help="initial weights (default 1)")
    parser.add_argument("--out", type=Path, help="directory for results.json and results.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model_cfg = dataclasses.replace(
            load_option("model", args.model), num_layers=args.layers, seq_length=args.seq_length
        )
        precisions = [load_option("precision", name) for name in args.precisions.split(",")]
        gpu_arch = load_option("gpu", detect_gpu()).arch
        data = make_dataset(load_option("data", "text"), args.seq_length, model_cfg.vocab_size, 0)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tokens = torch.stack([torch.as_tensor(data[i]) for i in range(args.batch)]).to(device)
    print(f"{model_cfg.name}: {args.layers} layers, {args.batch} x {args.seq_length} tokens of the corpus, on {device}")
    reference = float64_reference(model_cfg, tokens, args.seed)
    rows = []
    for precision in precisions:
        precision = dataclasses.replace(precision, emulate=needs_emulation(precision, gpu_arch))
        rows.append(measure(precision, model_cfg, tokens, reference, args.seed))
        print(f"  {rows[-1]['precision']:>22}: gradient error {rows[-1]['grad_error_mean']:.4f}", flush=True)
    table = markdown_table(rows, reference["loss"])
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python scripts/recipe_error.py " + " ".join(sys.argv[1:] if argv is None else argv)
        record = {"command": command, "float64_loss": reference["loss"], "rows": rows, **provenance()}
        (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
        (args.out / "results.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
