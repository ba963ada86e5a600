"""Sampling on the device (`sample_tokens`, `finished_rows`: disco_ray/graph/kernels_sample.py)
against the driver's `sampling.sample`, and a batch decode graph that samples: its tokens are
those the driver picks from the same graph's gathered logits with the same draws, on 1 and 2 GPUs.
"""

from __future__ import annotations

import pytest
import torch

from disco_ray.driver.api import compile
from disco_ray.graph import ops
from disco_ray.graph.kernels import run_kernel
from disco_ray.graph.kernels_sample import PADDING, as_bits
from disco_ray.models.sampling import SamplingParams, sample, samplers
from workloads.llm.batch import BatchLayout, batch_decode_graph, feed_decode
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.decode_sample import feed_sampling

PARAMS = [
    SamplingParams(),
    SamplingParams(do_sample=True, seed=0),
    SamplingParams(do_sample=True, temperature=0.7, seed=0),
    SamplingParams(do_sample=True, temperature=1.3, top_k=5, seed=0),
    SamplingParams(do_sample=True, temperature=0.9, top_k=12, top_p=0.8, seed=0),
    SamplingParams(do_sample=True, top_p=0.5, seed=0),
]


def params_tensor(p: SamplingParams) -> torch.Tensor:
    return torch.tensor([p.temperature if p.do_sample else 0.0, p.top_k, p.top_p], dtype=torch.float64)


def device_sample(logits: torch.Tensor, u: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    run_kernel("sample_tokens", out, [logits, as_bits(u), as_bits(params_tensor(p))], {})
    return out


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"t{p.temperature}k{p.top_k}p{p.top_p}{p.do_sample}")
@pytest.mark.parametrize("seed", range(8))
def test_the_kernel_picks_the_drivers_tokens_for_the_same_logits_and_draws(p, seed):
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 9, 40
    # ties (few distinct values) and a fraction to break some: every top-k and top-p edge case
    logits = torch.randint(-3, 3, (rows, vocab), generator=g).float() + (
        torch.rand(rows, 1, generator=g) < 0.5
    )
    padding = torch.rand(rows, generator=g) < 0.3
    live = (~padding).nonzero().reshape(-1).tolist()
    logits[padding] = float("nan")  # a padding row's logits are never looked at
    p = SamplingParams(**{**{f: getattr(p, f) for f in p.__slots__}, "seed": seed})  # type: ignore[attr-defined]
    ours, theirs = samplers(p, live), samplers(p, live)
    u = torch.full((rows,), PADDING, dtype=torch.float64)
    if p.do_sample:
        u[live] = torch.tensor([s.peek(1)[0] for s in ours], dtype=torch.float64)
    else:
        u[live] = 0.0
    got = device_sample(logits, u, p)
    want = sample(logits[live], p, theirs if p.do_sample else ())
    assert got[live].tolist() == want.tolist(), f"seed {seed}"
    assert got[padding].eq(0).all()


def test_a_row_samples_with_its_own_draw_whatever_the_others():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    p = SamplingParams(do_sample=True, temperature=2.0, seed=0)
    u = torch.rand(4, generator=g, dtype=torch.float64)
    got = device_sample(logits, u, p)
    for r in range(4):  # each row alone gives its own token: no row reads another's draw
        assert device_sample(logits[r : r + 1], u[r : r + 1], p).item() == got[r].item()
    swapped = u.flip(0)
    assert device_sample(logits, swapped, p).tolist() != got.tolist()


def test_non_finite_logits_in_a_live_row_raise_naming_it():
    logits = torch.zeros(3, 5)
    logits[2, 1] = float("inf")
    u = torch.tensor([0.5, PADDING, 0.1], dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite logits in row 2"):
        device_sample(logits, u, SamplingParams())
    u[2] = PADDING  # the same row as padding: not looked at
    assert device_sample(logits, u, SamplingParams()).tolist() == [0, 0, 0]


def test_finished_rows_flag_stop_ids_and_last_tokens_of_live_rows_only():
    tok = torch.tensor([5, 7, 9, 5, 3])
    stop = torch.tensor([[5, -1], [1, 2], [-1, -1], [5, 5], [-1, -1]])
    left = torch.tensor([3, 1, 4, 0, 2])  # row 3: padding, its stop id does not count
    out = torch.empty(5, dtype=torch.int64)
    run_kernel("finished_rows", out, [tok, stop, left], {})
    assert out.tolist() == [1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="finished_rows"):
        ops.OPS["finished_rows"].infer([(5,), (4, 2), (5,)], ["int64"] * 3, {})
    with pytest.raises(ValueError, match="u must be int64"):
        ops.OPS["sample_tokens"].infer([(5, 9), (5,), (3,)], ["float32", "float32", "int64"], {})


@pytest.mark.parametrize("gpus, micro", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_sampling_decode_graph_picks_what_the_driver_picks_from_its_logits(
    tmp_path, gpus, micro, do_sample
):
    from tests.test_models import make_checkpoint

    make_checkpoint(tmp_path, num_key_value_heads=2)
    ck = Checkpoint(str(tmp_path))
    rows, blocks, block = 4, 3, 4
    mgraph = batch_decode_graph(ck, gpus, rows, blocks, block, micro=micro, stops=4, logits=True)
    layout = BatchLayout.of([5, 3, 7], block, rows)
    p = SamplingParams(do_sample=do_sample, temperature=1.7, top_k=30, seed=4)
    with compile(mgraph.taskgraph, engine="local", order=mgraph.order or None) as prog:
        for step, toks in enumerate([[3, 9, 27], [11, 4, 100]]):
            live = [0, 1, 2]
            ours, theirs = samplers(p, live), samplers(p, live)
            u = torch.tensor([*(s.peek(1)[0] for s in ours), PADDING], dtype=torch.float64)
            left = torch.tensor([1, 5, 2, 0])
            stops = torch.tensor([[toks[0], -1, -1, -1]] + [[-1] * 4] * 3)
            feed = feed_decode(mgraph, ck.config, layout, toks, 8 + step, micro)
            feed |= feed_sampling(mgraph, u, left, params_tensor(p), stops)
            outs = prog.run(feed)
            logits = mgraph.gather(outs)
            got = torch.cat([outs[t] for _, t in mgraph.tokens])
            want = sample(logits[live], p, theirs if do_sample else ())
            assert got[:3].tolist() == want.tolist() and got[3] == 0
            done = torch.cat([outs[d] for d in mgraph.finished])
            assert done.tolist() == [1, 0, 0, 0]  # row 0 made its last token; row 3 is padding


@pytest.mark.parametrize("gpus, micro", [(1, 1), (2, 2)])
def test_the_feeds_of_several_steps_are_each_steps_own(tmp_path, gpus, micro):
    from tests.test_models import make_checkpoint
    from workloads.llm.decode_sample import feed_decode_steps

    make_checkpoint(tmp_path, num_key_value_heads=2)
    ck = Checkpoint(str(tmp_path))
    mgraph = batch_decode_graph(ck, gpus, 4, 3, 4, micro=micro, stops=4)
    layout = BatchLayout.of([5, 3, 7], 4, 4)
    steps = feed_decode_steps(mgraph, ck.config, layout.offsets, [3, 9, 27], 8, 3)
    for j, got in enumerate(steps):
        want = feed_decode(mgraph, ck.config, layout, [3, 9, 27], 8 + j, micro)
        want = want if j == 0 else {x: v for x, v in want.items() if not x.startswith("tok_")}
        assert got.keys() == want.keys() and all(torch.equal(got[x], want[x]) for x in want), j
