"""One's own work on the ray engine: a module from torch run by the Ray workers, and ops of one's
own, which travel to the workers with the graph (defined in a test: by value), or fail with the
op and the fix named when a worker cannot rebuild one."""

from __future__ import annotations

import sys

import pytest
import torch

import disco_ray
from disco_ray.graph import kernels, ops
from disco_ray.graph.errors import RunError
from disco_ray.graph.taskgraph import TaskGraph
from tests.ray_fixtures import pool  # noqa: F401  (module fixture)
from tests.torch_models import build

pytestmark = pytest.mark.ray


def test_a_module_from_torch_runs_on_the_ray_workers_with_offload(pool):  # noqa: F811
    net, args = build("encoder")
    model = disco_ray.from_torch(net, args, gpus=2, engine="ray", pool=pool)
    least, _ = model.capacity_bounds()
    model.close()
    model = disco_ray.from_torch(
        net, args, gpus=2, engine="ray", pool=pool, capacity=[n + 512 for n in least]
    )
    res = model.run(*args)
    assert res.details.plan.stats["bytes_reloaded"] > 0
    torch.testing.assert_close(res.outputs["output"], net(*args), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(model(*args), net(*args), atol=2e-6, rtol=1e-5)  # weights now held
    model.close()


def _register(name: str, infer, fn) -> None:
    ops.register(ops.OpSpec(name, 1, 1, infer, attrs={"k": 2.0}, doc="x * k + 1"))
    kernels.impl(name)(fn)


def _graph(op: str) -> TaskGraph:
    g = TaskGraph(gpus=2)
    x = g.kernel(op, g.input("x", (4, 4)), k=3.0)
    g.output(g.kernel(op, g.transfer(x, 1), k=0.5))
    return g


def test_an_op_defined_in_the_driver_reaches_the_workers(pool):  # noqa: F811
    def infer(shapes, dtypes, attrs):
        return shapes[0], dtypes[0]

    def affine(out, ins, attrs):  # a closure: pickled by value, nothing for the workers to import
        torch.add(ins[0] * attrs["k"], 1.0, out=out)

    _register("affine_here", infer, affine)
    try:
        x = torch.arange(16.0).reshape(4, 4)
        out = disco_ray.run(_graph("affine_here"), {"x": x}, engine="ray", pool=pool)
        torch.testing.assert_close(next(iter(out.values())), (x * 3 + 1) * 0.5 + 1)
    finally:
        kernels.unregister("affine_here")


def test_a_worker_that_cannot_rebuild_an_op_names_it_and_the_fix(pool, tmp_path, monkeypatch):  # noqa: F811
    # a module only the driver can import: on a path added after the workers started
    (tmp_path / "driver_only_ops.py").write_text(
        "import torch\n"
        "def infer(shapes, dtypes, attrs):\n    return shapes[0], dtypes[0]\n"
        "def affine(out, ins, attrs):\n    torch.add(ins[0] * attrs['k'], 1.0, out=out)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import driver_only_ops

    _register("affine_there", driver_only_ops.infer, driver_only_ops.affine)
    try:
        with pytest.raises(RunError) as e:
            disco_ray.run(_graph("affine_there"), {"x": torch.ones(4, 4)}, engine="ray", pool=pool)
        msg = str(e.value)
        assert "op 'affine_there': this worker cannot load its definition" in msg
        assert "No module named 'driver_only_ops'" in msg and "op_modules=[...]" in msg
    finally:
        kernels.unregister("affine_there")
        sys.modules.pop("driver_only_ops", None)


def _readme_block(heading: str) -> str:
    """The first python block after README's `heading`."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    import re

    after = text.split(f"\n## {heading}\n", 1)[1]
    return re.split(r"```python(?: run)?\n", after, maxsplit=1)[1].split("```", 1)[0]


def test_the_readme_walkthrough_from_a_torch_module_runs_with_offload(pool, capsys):  # noqa: F811
    code = _readme_block("From a torch module to a run with offload")
    assert code.count("gpus=2,") == 1
    code = code.replace("gpus=2,", "gpus=2, pool=pool,")  # the module's warm actors, not new ones
    exec(compile(code, "README.md", "exec"), {"pool": pool})
    offloaded, reloaded = map(int, capsys.readouterr().out.split())
    assert (offloaded, reloaded) == (1310720, 2360320)  # the figures README prints


def test_the_readme_own_op_example_runs(pool):  # noqa: F811
    code = _readme_block("Your own op")
    assert code.count('capacity="48KiB")') == 1
    code = code.replace('capacity="48KiB")', 'capacity="48KiB", pool=pool)')
    env = {"pool": pool}
    try:
        exec(compile(code, "README.md", "exec"), env)
    finally:
        kernels.unregister("clamp_scale")
    x, w = env["inputs"]["x"], env["inputs"]["w"]
    want = torch.clamp(torch.clamp(x @ w, -2.0, 1.0) * 0.5, -1.0, 1.0) * 2.0
    torch.testing.assert_close(env["out"][env["g"].outputs[0]], want)
