"""The graph code of real language models (Hugging Face checkpoints), in one place.

- `layer`: `LayerSpec`, the description of a decoder layer, and `Layer`, the tensor-parallel
  layer builder that every graph with a decoder layer uses (these models and the synthetic
  `workloads.llama`); the rotary tables.
- `families`: the model families (LLaMA, ...), one module each, and the registry that picks one by
  a config's model_type: the config fields each reads, what it refuses, its tensors.
- `checkpoint`: a checkpoint directory read without its weights (config, tensor files, shapes).
- `model`: prefill and decode TaskGraphs of a whole model, with a KV cache the workers keep.
- `lora`, `train`: LoRA adapters and one fine-tuning step as a TaskGraph.

Their drivers (planning, running, generation, training loops) are in `disco_ray.models`.
"""
