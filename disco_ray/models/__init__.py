"""Real models on disco-ray: checkpoints in, logits and generated tokens out.

model = disco_ray.models.load("ckpt/", gpus=2, capacity="64MiB")
model.prefill(ids); model.generate(ids, max_new_tokens=20); model.close()
"""

from .llama import Generation, LlamaModel
from .load import load

__all__ = ["Generation", "LlamaModel", "load"]
