"""The token-choice ops: `sample_tokens` (a token per row of logits, greedy or sampled as
transformers samples) and `finished_rows` (which rows' tokens end them). Kernels live in
`kernels_sample`, beside the math `disco_ray.models.sampling` uses on the driver."""

from __future__ import annotations

from .opspec import OpSpec, no_flops, numel, register


def _infer_sample_tokens(shapes, dtypes, attrs):
    logits, u, params = shapes
    if len(logits) != 2 or logits[1] < 1:
        raise ValueError(f"sample_tokens: logits must be [rows, vocab], got {list(logits)}")
    if dtypes[0] not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"sample_tokens: logits must be floating, got {dtypes[0]}")
    if u != (logits[0],) or dtypes[1] != "int64":
        raise ValueError(
            f"sample_tokens: u must be int64 [{logits[0]}] (one float64's bits per row), got {list(u)} {dtypes[1]}"
        )
    if params != (3,) or dtypes[2] != "int64":
        raise ValueError(
            f"sample_tokens: params must be int64 [3] (float64 bits: temperature, top_k, top_p), got "
            f"{list(params)} {dtypes[2]}"
        )
    return (logits[0],), "int64"


def _infer_finished_rows(shapes, dtypes, attrs):
    tok, stop, left = shapes
    if len(tok) != 1 or stop[:1] != tok or len(stop) != 2 or left != tok:
        raise ValueError(
            f"finished_rows takes tokens [rows], stop ids [rows, S] and left [rows], got {[list(s) for s in shapes]}"
        )
    if any(d not in ("int32", "int64") for d in dtypes):
        raise ValueError(f"finished_rows: every operand must be integers, got {dtypes}")
    return tok, "int64"


register(
    OpSpec(
        "sample_tokens",
        3,
        3,
        _infer_sample_tokens,
        flops=lambda s, o, a: 30.0 * numel(s[0]),  # sort, softmax, cumsum: a bound, not a count
        doc="one token per row of logits [rows, vocab] (int64 [rows]): operands logits, u (int64 "
        "[rows], each a float64's bits: the row's uniform draw in [0, 1), negative for a row with no "
        "sequence, whose token is 0) and params (int64 [3], float64 bits: temperature, 0 for greedy; "
        "top_k, 0 off; top_p, 1 off); "
        "greedy is argmax (lowest id on ties), sampling the inverse CDF at u of softmax of the "
        "logits after temperature, top-k, top-p (transformers' order). Non-finite logits in a row "
        "with a sequence raise, naming the row",
    )
)
register(
    OpSpec(
        "finished_rows",
        3,
        3,
        _infer_finished_rows,
        flops=no_flops,
        doc="int64 [rows]: 1 where a row's token (operand tokens [rows]) is one of its stop ids "
        "(operand [rows, S], -1 padded) or its last (operand left [rows]: new tokens it may still "
        "make, this one included, so 1; 0 marks a row with no sequence, never finished), else 0",
    )
)
