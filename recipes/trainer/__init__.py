"""What both engines share: the training loop (loop.py), the checkpoint folders (checkpoints.py), what a run
prints (console.py) and the command line `python -m <engine module> RUN_DIR/config.yaml` (entry.py)."""
