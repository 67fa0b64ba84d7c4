"""How the embedded defaults were trained: drivers, never imported by a replica.

shapes.py        the default image model (`omniserve/tiny-shapes-sd`), run by scripts/train_shapes.py
shapes_lora.py   its LoRA adapter "twins", run by scripts/train_shapes_lora.py
rewriter.py      the default LLM (`embedded:tiny-rewriter`): `python -m training.rewriter`

The weights and their training records are committed where the loaders read them (stages/embedded/tiny-*).
"""
