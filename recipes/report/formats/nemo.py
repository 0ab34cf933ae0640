"""NeMo 2 (its Megatron strategy's progress printer) and NeMo 1 (PyTorch Lightning's tqdm progress bar).

- NeMo 2, every log interval: `Training epoch 0, iteration 99/999 | lr: 0.0001 | global_batch_size: 128 |
  global_step: 99 | reduced_train_loss: 2.346 | train_step_timing in s: 1.234 | consumed_samples: 12800`
  (iteration and global_step count from 0).
- NeMo 1: `Epoch 0: : 12%|█▏  | 6/50 [00:41<05:02, reduced_train_loss=10.80, global_step=5.000,
  consumed_samples=1536.0, train_step_timing in s=6.300]`, or `1it [00:04, 4.36s/it, ...]` without a total. The bar
  is redrawn in place (carriage returns): each redraw is a line, and a redraw of the step just read replaces it. A
  bar without `key=value` fields (its first draw) is not a record. A bar cut at the terminal's width has no closing
  `]`: its last field may be cut mid-value and is dropped, and the bar stays a record of its step: without
  `global_step` the bar's count (the finished steps) is the step, also where the cut took the loss and the step time
  (a bar cut inside the loss is a step without a loss, never a line skipped).
- NeMo 1's experiment configuration, printed as YAML under `Experiment configuration`.
"""

from __future__ import annotations

import re

from recipes.report.formats.base import Family, LineFormat
from recipes.report.formats.config_dump import DumpKind

NEMO2 = LineFormat("nemo2", re.compile(r"Training epoch \d+, iteration (?P<it>\d+)/(?P<total>\d+)\s*\|"),
                   zero_based=True)
NEMO1 = LineFormat(
    "nemo1",
    re.compile(r"(?<![A-Za-z])Epoch \d+:[^\[\]]*?(?:\|\s*|\s)(?P<it>\d+)(?:/(?P<total>\d+)|/\?|it)\s*"
               r"\[[^\],]*,(?P<fields>[^\]]*=[^\]]*)(?P<close>\])?"),
    zero_based=False,
    separator=",",
    assign="=",
    redrawn=True,
)

FIELDS = [
    # A unit in the name, "in s", "in ms", scales the value to seconds.
    (re.compile(r"train_step_timing(?: in (?P<unit>ms|s))?"), "time_s"),
    (re.compile(r"reduced_train_loss|train_loss|loss"), "loss"),
    (re.compile(r"tflops_per_gpu|tflops per gpu"), "tflops_per_gpu"),
    (re.compile(r"global_batch_size"), "global_batch_size"),
    (re.compile(r"global_step"), "global_step"),
]

DUMPS = [DumpKind("nemo experiment", re.compile(r"\*{3,}\s*Experiment configuration\s*\*{3,}"), None)]

NEMO = Family("NeMo 2 / NeMo 1 (Lightning)", formats=[NEMO2, NEMO1], fields=FIELDS, dumps=DUMPS)
