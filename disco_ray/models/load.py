"""`disco_ray.models.load`: a checkpoint directory opened as a `LlamaModel`, its options checked.

Words people bring from transformers' `from_pretrained` get an answer: `dtype` (a name, a
torch.dtype, or "auto": the checkpoint's) is taken as transformers 5 takes it, `torch_dtype` as its
deprecated alias (one warning, as transformers 5 gives); `device_map`, `max_memory` and the others
of `ASK_INSTEAD` are refused naming the disco-ray option that does the same; any other unknown
option is refused naming the ones there are.
"""

from __future__ import annotations

import inspect
import logging

from disco_ray.graph.errors import UsageError

from .llama import LlamaModel

log = logging.getLogger("disco_ray")
_PER_GPU = "capacity= (arena bytes per GPU: a size, one per GPU, 'auto' or '60%')"
ASK_INSTEAD = {  # transformers' / accelerate's word -> what disco-ray takes for it
    "device_map": f"disco-ray places every layer by its plan: give gpus= (GPUs to split over) and {_PER_GPU}",
    "max_memory": f"give {_PER_GPU} and host_capacity= (each GPU's host-store budget)",
    "offload_folder": "give disk_dir= (where offloads beyond host_capacity spill)",
    "offload_state_dict": "the workers read their own shards of the checkpoint: give weights='disk' to keep none in host memory",
    "load_in_8bit": "give quantize='int8'",
    "load_in_4bit": "give quantize='int4'",
    "quantization_config": "give quantize='int8' or 'int4' (and quant_group=)",
}


def load(path: str, **kw) -> LlamaModel:
    """`LlamaModel(path, **kw)`: a checkpoint directory ready to prefill and generate.

    `capacity` defaults to "auto" (the largest that fits each GPU's free memory, less a margin:
    `disco_ray.driver.free_memory`). `dtype` may be a torch.dtype or "auto" (the checkpoint's);
    `torch_dtype` is its deprecated alias.

    Raises:
        UsageError: an option transformers takes that disco-ray does not (naming what to give
            instead), or an unknown option.
    """
    if "torch_dtype" in kw:
        old = kw.pop("torch_dtype")
        if "dtype" in kw and kw["dtype"] != old:
            raise UsageError(f"load: torch_dtype={old!r} and dtype={kw['dtype']!r}: give dtype only")
        log.warning("load: `torch_dtype` is deprecated, as in transformers 5: use `dtype`")
        kw["dtype"] = old
    for word, instead in ASK_INSTEAD.items():
        if word in kw:
            raise UsageError(f"load: {word}= is transformers' option, not disco-ray's: {instead}")
    known = set(inspect.signature(LlamaModel.__init__).parameters) - {"self", "path"}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise UsageError(f"load: unknown option {unknown[0]!r} (options: {', '.join(sorted(known))})")
    return LlamaModel(path, **kw)
