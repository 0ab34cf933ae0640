"""engine=nemo: the run as NeMo 2's own pretraining recipe (`nemo.collections.llm.recipes`), built and trained
inside the NeMo container by the NeMo installed there.

    mapping     the resolved config as recipe fields (dotted paths -> values): pure, no NeMo needed
    preflight   what engine=nemo refuses before launch, and the plan's lines; no NeMo needed
    build       NeMo's recipe with those fields written over it (imports NeMo: in the job only)
    callback    a Lightning callback writing metrics.jsonl and summary.json (imports Lightning: in the job only)

The entry point is recipes.nemo.engine (beside them, as recipes.megatron.engine is). Importing this package
imports nothing from NeMo.
"""
