"""The `disco-ray` CLI through `python -m disco_ray`: happy paths, and one-line errors with exit 2."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest

from disco_ray.cli import app as cli_module
from disco_ray.graph import formats
from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import INPUT
from disco_ray.graph.sizes import format_size, parse_size
from tests.conftest import ROOT, plan_of_two_gpu_graph, sample_memgraph, two_gpu_graph

EXAMPLE = ROOT / "examples" / "matmul3.json"
CHAIN = ROOT / "examples" / "chain.json"


def assert_one_line_error(r, *fragments: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("disco-ray: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


# ---- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("123", 123),
        ("0", 0),
        ("64KiB", 65536),
        ("1.5GiB", 3 * 2**29),
        ("64MiB", 2**26),
        ("2GB", 2 * 10**9),
        ("10kB", 10_000),
        ("10KB", 10_000),
        ("64mib", 2**26),
        ("1 TiB", 2**40),
        ("7B", 7),
        ("0.5KiB", 512),
        (" 3MB ", 3 * 10**6),
        (4096, 4096),
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "abc", "64XiB", "-1", "1.5", "0.3B", "1.2.3", "KiB", "64 Ki B", "1e3"])
def test_parse_size_errors_name_the_text(text):
    with pytest.raises(UsageError, match=f"bad size {text!r}"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (2**26, "64 MiB"),
        (3 * 2**29, "1.5 GiB"),
        (2**41, "2 TiB"),
    ],
)
def test_format_size(n, text):
    assert format_size(n) == text
    assert parse_size(text) == n or "." in text


# ---- info / ops --------------------------------------------------------------------------------
def test_info_taskgraph(cli):
    r = cli("info", EXAMPLE)
    assert r.returncode == 0, r.stderr
    assert "15 vertices (6 input, 6 kernel, 3 transfer) on 3 GPU(s), 14 edges" in r.stdout
    assert "gpu:1 112 KiB" in r.stdout
    r = cli("info", "--json", EXAMPLE)
    st = json.loads(r.stdout)
    assert st["format"] == "disco-taskgraph" and st["min_capacity_per_gpu"] == [49152] * 3


def test_info_memgraph(cli, tmp_path):
    path = tmp_path / "m.msgpack"
    formats.save(sample_memgraph(), path)
    r = cli("info", path)
    assert r.returncode == 0, r.stderr
    assert "8 vertices" in r.stdout and "9 edges (6 data, 3 mem)" in r.stdout
    assert "offloaded 16 KiB in 1 offloads, reloaded 32 KiB in 2 reloads" in r.stdout
    st = json.loads(cli("info", "--json", path).stdout)
    assert st["arena_high_water"] == [49152, 16384] and st["bytes_offloaded"] == 16384
    assert st["format"] == "disco-memgraph" and st["note"] == "x"


def test_ops_doc_is_up_to_date(cli):
    # a fresh process: tests may register test-only ops (actors.testops) in this one
    r = cli("ops", "--markdown")
    assert r.returncode == 0
    doc = (ROOT / "docs" / "OPS.md").read_text()
    assert r.stdout == doc, "docs/OPS.md is stale: run python -m disco_ray ops --markdown > docs/OPS.md"


def test_help(cli):
    r = cli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("plan", "verify", "info"))


# ---- input errors: exit 2, one line, no output file ----------------------------------------------
@pytest.fixture
def bad_files(tmp_path):
    """A directory of broken inputs next to a good TaskGraph."""
    good = tmp_path / "g.json"
    formats.save(two_gpu_graph(), good)
    (tmp_path / "broken.json").write_text('{"format": "disco-taskgraph",\n "version": 1 "gpus": 2}')
    doc = two_gpu_graph().to_dict()
    doc["vertices"][2]["inputs"] = ["x0", "ghost"]
    (tmp_path / "unknown.json").write_text(json.dumps(doc))
    doc = two_gpu_graph().to_dict()
    doc["vertices"][0]["shape"] = [64, 63]
    (tmp_path / "shape.json").write_text(json.dumps(doc))
    (tmp_path / "order.json").write_text('["x0", 3]')
    (tmp_path / "garbage.msgpack").write_bytes(b"\xc1")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["plan", "missing.json", "--capacity", "1MiB"], ["missing.json: cannot read"]),
        (["plan", "broken.json", "--capacity", "1MiB"], ["broken.json: malformed JSON at line 2 column 15"]),
        (
            ["plan", "unknown.json", "--capacity", "1MiB"],
            ["unknown.json: vertex 'm1': unknown input 'ghost'"],
        ),
        (["plan", "shape.json", "--capacity", "1MiB"], ["shape.json: vertex 'm1': matmul inner dims differ"]),
        (["plan", "garbage.msgpack", "--capacity", "1MiB"], ["garbage.msgpack: malformed msgpack"]),
        (["plan", "g.json", "--capacity", "lots"], ["plan: argument --capacity: bad size 'lots'"]),
        (
            ["plan", "g.json", "--capacity", "1MiB", "--capacity-gpu", "2=1MiB"],
            ["--capacity-gpu 2=1 MiB: gpu 2 out of range 0..1"],
        ),
        (["plan", "g.json", "--capacity", "1MiB", "--capacity-gpu", "x=1MiB"], ["bad GPU capacity 'x=1MiB'"]),
        (["plan", "g.json", "--capacity", "1MiB", "--capacity-gpu", "1=1.5B"], ["bad size '1.5B'"]),
        (
            ["plan", "g.json", "--capacity", "1MiB", "--alignment", "0"],
            ["--alignment: want a positive integer"],
        ),
        (["plan", "g.json", "--capacity", "1MiB", "--order", "nope.txt"], ["--order nope.txt: cannot read"]),
        (
            ["plan", "g.json", "--capacity", "1MiB", "--order", "order.json"],
            ["--order order.json: want a JSON list"],
        ),
        (["plan", "g.json"], ["plan: the following arguments are required: --capacity"]),
        (["verify", "g.json", "missing.json"], ["missing.json: cannot read"]),
        (["verify", "g.json", "g.json"], ["\"format\" must be 'disco-memgraph'"]),
        (["info", "broken.json"], ["broken.json: malformed JSON"]),
        (["info", "g.txt"], ["g.txt: unknown file suffix '.txt'"]),
        (["frobnicate"], ["invalid choice: 'frobnicate'"]),
        ([], ["required: COMMAND"]),
    ],
)
def test_input_errors(bad_files, capsys, monkeypatch, args, fragments):
    """Through the CLI's entry point in this process (the subprocess tests check the real exit
    status and stderr of each command)."""
    out = bad_files / "out.json"
    if args and args[0] == "plan" and "--capacity" in args:
        args = [*args, "-o", str(out)]
    monkeypatch.chdir(bad_files)
    capsys.readouterr()
    rc = cli_module.main(args)
    got = capsys.readouterr()
    r = subprocess.CompletedProcess(args, rc, got.out, got.err)
    assert_one_line_error(r, *fragments)
    assert not out.exists()
    assert not [p for p in bad_files.iterdir() if p.name.startswith(".out")]  # no temp file left


@pytest.mark.parametrize(
    ("name", "fragment"),
    [("out.txt", "out.txt: unknown file suffix '.txt'"), ("out", "unknown file suffix '(none)'")],
)
def test_plan_output_suffix_checked_first(cli, bad_files, name, fragment):
    r = cli("plan", "g.json", "--capacity", "1MiB", "-o", name, cwd=bad_files)
    assert_one_line_error(r, fragment)
    assert not (bad_files / name).exists()


def test_other_modules_add_commands(tmp_path, monkeypatch, capsys):
    (tmp_path / "hello_cmd.py").write_text(
        "def add_hello(sub):\n"
        "    sub.add_parser('hello').add_argument('--times', type=int, default=1)\n"
        "def cmd_hello(args):\n"
        "    print('hello ' * args.times)\n"
        "    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli_module.COMMANDS, "hello", "hello_cmd")
    assert cli_module.main(["hello", "--times", "2"]) == 3
    assert capsys.readouterr().out.strip() == "hello hello"
    assert cli_module.main(["hello", "--times", "x"]) == 2
    assert capsys.readouterr().err.startswith("disco-ray: error: hello: argument --times: invalid int value")


# ---- verify ------------------------------------------------------------------------------------
@pytest.fixture
def plans(tmp_path):
    formats.save(two_gpu_graph(), tmp_path / "g.json")
    formats.save(plan_of_two_gpu_graph(), tmp_path / "ok.msgpack")
    formats.save(plan_of_two_gpu_graph(clobber=True), tmp_path / "bad.json")
    return tmp_path


def test_verify_ok(cli, plans):
    r = cli("verify", "g.json", "ok.msgpack", cwd=plans)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok: ok.msgpack is a correct plan of g.json")


def test_verify_violations(cli, plans):
    r = cli("verify", "g.json", "bad.json", cwd=plans)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines and all(ln.strip() for ln in lines)
    assert "Traceback" not in r.stderr and r.stderr.strip().endswith("violation(s)")
    r = cli("verify", "--limit", "1", "g.json", "bad.json", cwd=plans)
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 1


# ---- plan --------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".msgpack"])
def test_plan_then_verify_and_info(cli, tmp_path, suffix):
    out = tmp_path / f"m{suffix}"
    # chain.json needs 64 KiB on gpu 0 to keep everything resident: 48 KiB forces an offload of
    # 'a' and a reload of the clean input 'x' from its own host copy
    r = cli("plan", CHAIN, "--capacity", "48KiB", "--capacity-gpu", "1=32KiB", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "offloaded 16 KiB in 1 offloads, reloaded 32 KiB in 2 reloads" in r.stderr
    assert f"wrote {out}" in r.stderr
    mg = formats.load_memgraph(out)
    assert mg.capacity == [49152, 32768]
    assert any(v.ins and v.ins[0].src is None and v.ins[0].loc.device == INPUT for v in mg)
    st = json.loads(cli("info", "--json", out).stdout)
    assert st["by_kind"]["offload"] == 1 and st["bytes_reloaded"] == 32768
    assert st["arena_high_water"][0] <= 49152 and st["arena_high_water"][1] <= 32768
    r = cli("verify", CHAIN, out)
    assert r.returncode == 0, r.stdout + r.stderr


def test_verify_names_the_gpu_whose_host_store_is_over_its_capacity(cli, tmp_path):
    """A plan whose host offload was given host_capacity 0: verify exits 1 naming the GPU and bytes."""
    out = tmp_path / "m.json"
    assert cli("plan", CHAIN, "--capacity", "48KiB", "-o", out).returncode == 0
    doc = json.loads(out.read_text())
    host = {v["device"] for v in doc["vertices"] if v["out"]["device"] == "host"}
    assert host == {"gpu:0"}
    use = max(
        v["out"]["offset"] + v["out"]["nbytes"] for v in doc["vertices"] if v["out"]["device"] == "host"
    )
    doc["devices"][0]["host_capacity"] = 0
    out.write_text(json.dumps(doc))
    r = cli("verify", CHAIN, out)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"host store use of {use} bytes" in r.stdout and "host store capacity 0 of gpu:0" in r.stdout


def test_plan_in_two_processes_is_the_same_plan(cli, tmp_path):
    plans = []
    for workers in ("1", "2"):
        out = tmp_path / f"m{workers}.json"
        r = cli("plan", CHAIN, "--capacity", "48KiB", "--workers", workers, "-o", out)
        assert r.returncode == 0, r.stderr
        mg = formats.load_memgraph(out)
        assert mg.stats["planner_processes"] == int(workers)
        plans.append((mg.vertices, mg.edges, mg.outputs))
        assert cli("verify", CHAIN, out).returncode == 0
    assert plans[0] == plans[1]
    r = cli("plan", CHAIN, "--capacity", "48KiB", "--workers", "0", "-o", tmp_path / "m0.json")
    assert r.returncode == 2 and "--workers" in r.stderr and not (tmp_path / "m0.json").exists()


@pytest.mark.parametrize("name", ["order.txt", "order.json"])
def test_plan_with_order(cli, tmp_path, name):
    tg = formats.load_taskgraph(EXAMPLE)
    ids = [v.id for v in tg]
    (tmp_path / name).write_text(
        json.dumps(ids) if name.endswith(".json") else "# file order\n" + "\n".join(ids)
    )
    r = cli("plan", EXAMPLE, "--capacity", "1MiB", "--order", tmp_path / name, "-o", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr
    assert formats.load_memgraph(tmp_path / "m.json").stats["order"] == "given"
    assert cli("verify", EXAMPLE, tmp_path / "m.json").returncode == 0


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (
            ["--capacity", "40KiB"],
            ["matmul3.json: vertex 'p0': its inputs plus output need 49152 bytes on gpu 0"],
        ),
        (["--capacity", "1MiB", "--capacity-gpu", "2=16KiB"], ["matmul3.json: vertex 'p2'", "gpu 2"]),
        (["--capacity", "1MiB", "--order", "rev.txt"], ["matmul3.json: order: vertex "]),
        (["--capacity", "1MiB", "--alignment", "100"], ["--alignment: want a power of two"]),
    ],
)
def test_plan_errors(cli, tmp_path, extra, fragments):
    ids = [v.id for v in formats.load_taskgraph(EXAMPLE)]
    (tmp_path / "rev.txt").write_text("\n".join(reversed(ids)))
    r = cli("plan", EXAMPLE, *extra, "-o", "m.json", cwd=tmp_path)
    assert_one_line_error(r, *fragments)
    assert list(tmp_path.iterdir()) == [tmp_path / "rev.txt"]


def test_plan_unwritable_output(cli, tmp_path):
    r = cli("plan", EXAMPLE, "--capacity", "1MiB", "-o", tmp_path / "no" / "such" / "m.json")
    assert_one_line_error(r, "m.json: cannot write (No such file or directory)")
    assert not (tmp_path / "no").exists()


# ---- no tracebacks for any malformed field ------------------------------------------------------
JUNK = [None, -1, 1.5, "x", [0], 10**20, "__delete__"]


def _paths(d, pre=()):
    """Every key path into a JSON document."""
    yield pre
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        yield from _paths(v, (*pre, k))


def _mutated(doc, path, value):
    doc = json.loads(json.dumps(doc))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if value == "__delete__":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@pytest.mark.parametrize("which", ["taskgraph", "memgraph"])
def test_any_malformed_field_is_one_line_error(tmp_path, capsys, monkeypatch, which):
    """Every field of a good document replaced by junk (or deleted): exit 0, 1 or 2, never a traceback."""
    parser = cli_module.build_parser()
    monkeypatch.setattr(cli_module, "build_parser", lambda: parser)  # building it was most of each call
    tg, mg = tmp_path / "tg.json", tmp_path / "mg.json"
    formats.save(two_gpu_graph(), tg)
    formats.save(plan_of_two_gpu_graph(), mg)
    good = (two_gpu_graph() if which == "taskgraph" else plan_of_two_gpu_graph()).to_dict()
    bad = tmp_path / "bad.json"
    for path in list(_paths(good))[1:]:
        for value in JUNK:
            bad.write_text(json.dumps(_mutated(good, path, value)))
            if which == "taskgraph":
                runs = [["info", bad], ["plan", bad, "--capacity", "1MiB", "-o", tmp_path / "out.json"]]
            else:
                runs = [["info", bad], ["verify", tg, bad]]
            for args in runs:
                rc = cli_module.main([str(a) for a in args])
                err = capsys.readouterr().err
                assert rc in (0, 1, 2), (path, value, args)
                assert rc != 2 or (err.startswith("disco-ray: error: ") and err.count("\n") == 1), (
                    path,
                    value,
                    err,
                )


@pytest.mark.parametrize("capacity", ["1MiB", "32KiB"])
def test_plan_and_verify_the_formats_example(cli, tmp_path, capacity):
    """FORMATS.md's TaskGraph, verbatim; 32 KiB is the least gpu 0 can work with (x0, w0, m1 evicting one)."""
    src = ROOT / "examples" / "formats.json"
    out = tmp_path / "m.json"
    r = cli("plan", src, "--capacity", capacity, "-o", out)
    if capacity == "32KiB":  # m1 needs x0 + w0 + its own 16 KiB: 48 KiB
        assert r.returncode == 2 and "vertex 'm1'" in r.stderr and not out.exists()
        return
    assert r.returncode == 0, r.stderr
    assert cli("verify", src, out).returncode == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "disco-memgraph" and [d["device"] for d in doc["devices"]] == ["gpu:0", "gpu:1"]
    assert {v["kind"] for v in doc["vertices"]} == {"input", "kernel", "transfer"}


# ---- the command line as documented: -v/-q, --progress, a closed pipe, usage lines --------------
def test_verbose_shows_the_plans_debug_messages_and_quiet_only_warnings(cli, tmp_path):
    args = ["plan", EXAMPLE, "--capacity", "1MiB", "-o", tmp_path / "m.json"]
    loud, default, quiet = cli("-v", *args), cli(*args), cli("-q", *args)
    assert loud.returncode == default.returncode == quiet.returncode == 0, (loud.stderr, quiet.stderr)
    debug = [ln for ln in loud.stderr.splitlines() if ln not in default.stderr.splitlines()]
    assert any(ln.startswith("plan: ") and "vertices on" in ln for ln in debug), loud.stderr
    assert "wrote" in default.stderr and "plan: " not in default.stderr  # INFO, no debug lines
    assert quiet.stderr == ""  # nothing below a warning


class _Lines(logging.Handler):
    """The messages logged, in order."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("total", [7, 19, 34, 100, 1000])
def test_progress_logs_one_line_per_tenth(total):
    from disco_ray.cli.run import progress_arg

    report = progress_arg(True, total)
    assert callable(report)
    log, seen = logging.getLogger("disco_ray"), _Lines()
    level = log.level
    log.addHandler(seen)
    log.setLevel(logging.INFO)
    try:
        for n in range(total + 1):  # a poll per vertex, then the end reported again
            report(n)
        report(total)
    finally:
        log.removeHandler(seen)
        log.setLevel(level)
    lines = [ln for ln in seen.lines if ln.startswith("run: ")]
    assert 1 <= len(lines) <= 10 and lines[-1].endswith("(100%)"), lines
    tenths = [int(ln.rsplit("(", 1)[1].rstrip("%)")) // 10 for ln in lines]
    assert tenths == sorted(set(tenths)), lines  # never two lines in one tenth


def test_a_reader_that_closes_early_ends_the_command_quietly():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "disco_ray", "ops"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.close()  # `disco-ray ops | head -0`: the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""  # no traceback, no error line


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("plan", ["--capacity SIZE[,SIZE...] [", "-o MEMGRAPH"]),
        ("run", ["--out OUT.npz"]),
        ("finetune", ["--steps K", "] --capacity SIZE[,SIZE...]"]),
        ("generate", ["(--budget-file FILE | --capacity SIZE[,SIZE...])"]),
    ],
)
def test_usage_marks_required_options(cli, command, shown):
    r = cli(command, "--help")
    usage = " ".join(r.stdout.split("\n\n", 1)[0].split())
    assert r.returncode == 0 and all(s in usage for s in shown), usage


@pytest.mark.parametrize("fails", [True, False])
def test_a_failed_runs_actors_close_after_its_error_line(capsys, monkeypatch, fails):
    """A pool's close takes seconds (actors killed, a private Ray shut down): the error line that
    names a stopped worker is printed first (`app.closing_after_error`)."""
    import importlib

    from disco_ray.cli import app
    from disco_ray.graph.errors import RunError

    closed: list[str] = []

    class Pool:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            closed.append(capsys.readouterr().err)  # what stderr held when it closed

    def cmd_ops(args):
        with app.closing_after_error(Pool()):
            if fails:
                raise RunError("gpu:0 worker (pid 7) has not answered for 10 s")
        return 0

    monkeypatch.setattr(importlib.import_module(app.COMMANDS["ops"]), "cmd_ops", cmd_ops)
    assert app.main(["ops"]) == (2 if fails else 0)
    if fails:
        assert closed == ["disco-ray: error: gpu:0 worker (pid 7) has not answered for 10 s\n"]
    else:
        assert closed == [""]
